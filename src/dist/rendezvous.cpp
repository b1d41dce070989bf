// The torchrun-style rendezvous over TCP (see rendezvous.hpp): POSIX sockets, every wait a poll()
// against the deadline, messages framed as a 16-byte header (the exchange's sequence number and the
// payload's length) and the payload.
#include "dist/rendezvous.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include <mgpu/core/deadline.hpp>
#include <mgpu/core/error.hpp>

#include "comm/cuda_communicators.hpp"
#include "dist/common.hpp"

namespace mgpu::dist::detail {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::uint64_t magic = 0x6d67707572647631ULL;  // "mgpurdv1": a hello from this protocol

std::string system_error(int code) { return std::strerror(code); }

// A connected socket, closed on destruction.
class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) noexcept : fd_(fd) {}
  Socket(Socket&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Socket& operator=(Socket&& other) noexcept {
    if (this != &other) {
      close();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  Socket(Socket const&) = delete;
  Socket& operator=(Socket const&) = delete;
  ~Socket() { close(); }
  [[nodiscard]] int fd() const noexcept { return fd_; }
  [[nodiscard]] bool valid() const noexcept { return fd_ >= 0; }
  void close() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

// Waits until `fd` is ready for `events` (POLLIN or POLLOUT); false at the deadline.
bool wait_ready(int fd, short events, Clock::time_point deadline) {
  while (true) {
    auto const left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd, events, 0};
    int const n = ::poll(&p, 1, static_cast<int>(std::min<long long>(left, 1000)));
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) throw Error(Errc::communication, "the rendezvous: poll failed: " + system_error(errno));
  }
}

// Sends all of `bytes`; `peer` names the other end in errors.
void send_all(Socket const& s, void const* bytes, std::size_t size, Clock::time_point deadline, std::string const& peer) {
  auto const* p = static_cast<char const*>(bytes);
  while (size > 0) {
    if (!wait_ready(s.fd(), POLLOUT, deadline))
      throw Error(Errc::timeout, "the rendezvous: " + peer + " took no data before the deadline");
    ssize_t const n = ::send(s.fd(), p, size, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      if (errno == EPIPE || errno == ECONNRESET)
        throw Error(Errc::communication, "the rendezvous: " + peer + " closed its connection (did it fail?)");
      throw Error(Errc::communication, "the rendezvous: sending to " + peer + " failed: " + system_error(errno));
    }
    p += n;
    size -= static_cast<std::size_t>(n);
  }
}

// Receives exactly `size` bytes.
void recv_all(Socket const& s, void* bytes, std::size_t size, Clock::time_point deadline, std::string const& peer,
              std::string_view what) {
  auto* p = static_cast<char*>(bytes);
  while (size > 0) {
    if (!wait_ready(s.fd(), POLLIN, deadline))
      throw Error(Errc::timeout, "the rendezvous (" + std::string(what) + "): " + peer +
                                     " was not heard from within the deadline (expected every process to take part; " +
                                     timeout_env_var + " sets the deadline in seconds)");
    ssize_t const n = ::recv(s.fd(), p, size, 0);
    if (n == 0 || (n < 0 && errno == ECONNRESET))
      throw Error(Errc::communication,
                  "the rendezvous (" + std::string(what) + "): " + peer + " closed its connection (did it fail?)");
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      throw Error(Errc::communication, "the rendezvous: receiving from " + peer + " failed: " + system_error(errno));
    }
    p += n;
    size -= static_cast<std::size_t>(n);
  }
}

struct Header {
  std::uint64_t first;   // hello: magic; exchange: its sequence number
  std::uint64_t second;  // hello: rank << 32 | size; exchange: the payload's bytes
};

std::string describe_process(int rank) { return "process " + std::to_string(rank); }

struct State {
  std::mutex mutex;  // one exchange at a time
  Place place;
  std::vector<Socket> peers;  // process 0: one per other process (index = rank); others: [0] = process 0
  std::uint64_t exchanges = 0;
  [[nodiscard]] std::string master() const {
    return "process 0 at " + place.master_addr + ":" + std::to_string(place.master_port);
  }
};

std::unique_ptr<State>& state() {
  static std::unique_ptr<State> s;
  return s;
}

Socket listen_on(int port) {
  Socket s(::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0));
  bool v6 = s.valid();
  if (!v6) s = Socket(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!s.valid()) throw Error(Errc::communication, "the rendezvous: socket failed: " + system_error(errno));
  int one = 1;
  (void)::setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  int bound = -1;
  if (v6) {
    int zero = 0;  // both IPv6 and IPv4 clients
    (void)::setsockopt(s.fd(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_any;
    a.sin6_port = htons(static_cast<std::uint16_t>(port));
    bound = ::bind(s.fd(), reinterpret_cast<sockaddr const*>(&a), sizeof a);
  } else {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    bound = ::bind(s.fd(), reinterpret_cast<sockaddr const*>(&a), sizeof a);
  }
  if (bound != 0 || ::listen(s.fd(), SOMAXCONN) != 0)
    throw Error(Errc::communication, "the rendezvous: process 0 cannot listen on MASTER_PORT " + std::to_string(port) +
                                         ": " + system_error(errno) + " (expected a free port on process 0's server)");
  return s;
}

// Process 0: accepts every other process's connection and hello.
void accept_all(State& st, Clock::time_point deadline) {
  Socket listener = listen_on(st.place.master_port);
  int const P = st.place.size;
  st.peers.resize(static_cast<std::size_t>(P));
  int joined = 1;
  while (joined < P) {
    if (!wait_ready(listener.fd(), POLLIN, deadline)) {
      std::string missing;
      for (int r = 1; r < P; ++r) {
        if (!st.peers[static_cast<std::size_t>(r)].valid()) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
      throw Error(Errc::timeout, "the rendezvous: process 0 waited for " + std::to_string(P - joined) +
                                     " process(es) of " + std::to_string(P) + " (rank " + missing +
                                     ") to connect to MASTER_PORT " + std::to_string(st.place.master_port) +
                                     " (expected every process started with the same MASTER_ADDR and MASTER_PORT; " +
                                     timeout_env_var + " sets the deadline in seconds)");
    }
    Socket c(::accept4(listener.fd(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!c.valid()) {
      if (errno == EINTR || errno == EAGAIN || errno == ECONNABORTED) continue;
      throw Error(Errc::communication, "the rendezvous: accept failed: " + system_error(errno));
    }
    Header hello{};
    recv_all(c, &hello, sizeof hello, deadline, "a process connecting", "joining");
    int const rank = static_cast<int>(hello.second >> 32);
    int const size = static_cast<int>(hello.second & 0xffffffffU);
    if (hello.first != magic)
      throw Error(Errc::communication, "the rendezvous: something that is not an mgpu process connected to MASTER_PORT " +
                                           std::to_string(st.place.master_port));
    if (size != P || rank < 1 || rank >= P || st.peers[static_cast<std::size_t>(rank)].valid())
      throw Error(Errc::communication,
                  "the rendezvous: a process says it is rank " + std::to_string(rank) + " of " + std::to_string(size) +
                      " (expected a rank in [1, " + std::to_string(P) + ") not yet joined, of WORLD_SIZE " +
                      std::to_string(P) + ")");
    int one = 1;
    (void)::setsockopt(c.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    st.peers[static_cast<std::size_t>(rank)] = std::move(c);
    ++joined;
  }
}

// Any other process: connects to process 0 (retrying while it is not listening yet) and says hello.
void connect_to_master(State& st, Clock::time_point deadline) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  std::string const port = std::to_string(st.place.master_port);
  if (int const code = ::getaddrinfo(st.place.master_addr.c_str(), port.c_str(), &hints, &found); code != 0)
    throw Error(Errc::communication, "the rendezvous: MASTER_ADDR '" + st.place.master_addr +
                                         "' does not resolve: " + ::gai_strerror(code) +
                                         " (expected process 0's host name or address)");
  std::unique_ptr<addrinfo, void (*)(addrinfo*)> addresses(found, ::freeaddrinfo);
  std::string last_error = "no address";
  while (true) {
    for (addrinfo const* a = addresses.get(); a != nullptr; a = a->ai_next) {
      Socket s(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
      if (!s.valid()) continue;
      if (::connect(s.fd(), a->ai_addr, a->ai_addrlen) != 0) {
        last_error = system_error(errno);
        continue;
      }
      int one = 1;
      (void)::setsockopt(s.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      Header const hello{magic, (static_cast<std::uint64_t>(st.place.rank) << 32) | static_cast<std::uint32_t>(st.place.size)};
      send_all(s, &hello, sizeof hello, deadline, st.master());
      st.peers.clear();
      st.peers.push_back(std::move(s));
      return;
    }
    if (Clock::now() >= deadline)
      throw Error(Errc::timeout, "the rendezvous: process " + std::to_string(st.place.rank) + " could not reach " +
                                     st.master() + " within the deadline (last: " + last_error +
                                     "; expected process 0 running with the same MASTER_ADDR and MASTER_PORT; " +
                                     timeout_env_var + " sets the deadline in seconds)");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

// Appends `value`'s bytes.
template <class T>
void put(std::vector<std::byte>& out, T const& value) {
  auto const* p = reinterpret_cast<std::byte const*>(&value);
  out.insert(out.end(), p, p + sizeof value);
}

// Reads a T at `at`, advancing it; Error(communication) when `in` is too short.
template <class T>
T take(std::vector<std::byte> const& in, std::size_t& at, std::string_view what) {
  if (at > in.size() || in.size() - at < sizeof(T))
    throw Error(Errc::communication, "the rendezvous: a short " + std::string(what) + " message");
  T value{};
  std::memcpy(&value, in.data() + at, sizeof value);
  at += sizeof value;
  return value;
}

}  // namespace

void join_rendezvous(Place const& place, std::chrono::milliseconds timeout) {
  if (place.master_addr.empty() || place.master_port == 0)
    throw Error(Errc::invalid_argument, "a torchrun-style job of " + std::to_string(place.size) +
                                            " processes without " + (place.master_addr.empty() ? "MASTER_ADDR" : "MASTER_PORT") +
                                            " (expected MASTER_ADDR and MASTER_PORT: where process 0 listens)");
  auto st = std::make_unique<State>();
  st->place = place;
  auto const deadline = Clock::now() + timeout;
  if (place.rank == 0) {
    accept_all(*st, deadline);
  } else {
    connect_to_master(*st, deadline);
  }
  state() = std::move(st);
}

bool in_rendezvous() { return state() != nullptr; }

void leave_rendezvous() noexcept { state().reset(); }

std::vector<std::vector<std::byte>> rendezvous_exchange(std::string_view what, std::span<std::byte const> mine,
                                                        std::chrono::milliseconds timeout) {
  if (!state()) throw Error(Errc::invalid_argument, "a rendezvous exchange outside a torchrun-style job of several processes");
  State& st = *state();
  std::lock_guard lock(st.mutex);
  auto const deadline = Clock::now() + timeout;
  std::uint64_t const seq = ++st.exchanges;
  int const P = st.place.size;
  std::vector<std::vector<std::byte>> all(static_cast<std::size_t>(P));
  auto const check_header = [&](Header const& h, std::string const& peer) {
    if (h.first != seq)
      throw Error(Errc::communication, "the rendezvous (" + std::string(what) + "): " + peer + " is at exchange " +
                                           std::to_string(h.first) + ", this process at " + std::to_string(seq) +
                                           " (expected every process to make the same calls in the same order)");
    if (h.second > (std::uint64_t{1} << 30))
      throw Error(Errc::communication, "the rendezvous: " + peer + " announced " + std::to_string(h.second) + " bytes");
  };
  if (st.place.rank == 0) {
    all[0].assign(mine.begin(), mine.end());
    for (int r = 1; r < P; ++r) {
      Socket const& s = st.peers[static_cast<std::size_t>(r)];
      Header h{};
      recv_all(s, &h, sizeof h, deadline, describe_process(r), what);
      check_header(h, describe_process(r));
      all[static_cast<std::size_t>(r)].resize(h.second);
      recv_all(s, all[static_cast<std::size_t>(r)].data(), h.second, deadline, describe_process(r), what);
    }
    std::vector<std::byte> reply;
    for (auto const& part : all) {
      put(reply, static_cast<std::uint64_t>(part.size()));
      reply.insert(reply.end(), part.begin(), part.end());
    }
    Header const h{seq, reply.size()};
    for (int r = 1; r < P; ++r) {
      send_all(st.peers[static_cast<std::size_t>(r)], &h, sizeof h, deadline, describe_process(r));
      send_all(st.peers[static_cast<std::size_t>(r)], reply.data(), reply.size(), deadline, describe_process(r));
    }
    return all;
  }
  Socket const& s = st.peers.front();
  Header const h{seq, mine.size()};
  send_all(s, &h, sizeof h, deadline, st.master());
  send_all(s, mine.data(), mine.size(), deadline, st.master());
  Header back{};
  recv_all(s, &back, sizeof back, deadline, st.master(), what);
  check_header(back, st.master());
  std::vector<std::byte> reply(back.second);
  recv_all(s, reply.data(), reply.size(), deadline, st.master(), what);
  std::size_t at = 0;
  for (auto& part : all) {
    auto const bytes = take<std::uint64_t>(reply, at, what);
    if (bytes > reply.size() - at) throw Error(Errc::communication, "the rendezvous: a short " + std::string(what) + " message");
    part.assign(reply.begin() + static_cast<std::ptrdiff_t>(at), reply.begin() + static_cast<std::ptrdiff_t>(at + bytes));
    at += bytes;
  }
  return all;
}

std::string rendezvous_address() {
  if (!state()) throw Error(Errc::invalid_argument, "the rendezvous's address outside a torchrun-style job of several processes");
  State const& st = *state();
  Socket const& s = st.place.rank == 0 ? st.peers.at(1) : st.peers.front();
  sockaddr_storage a{};
  socklen_t size = sizeof a;
  if (::getsockname(s.fd(), reinterpret_cast<sockaddr*>(&a), &size) != 0)
    throw Error(Errc::communication, "the rendezvous: getsockname failed: " + system_error(errno));
  char text[INET6_ADDRSTRLEN] = {};
  if (a.ss_family == AF_INET6) {
    auto const& v6 = reinterpret_cast<sockaddr_in6 const&>(a);
    if (IN6_IS_ADDR_V4MAPPED(&v6.sin6_addr)) {  // an IPv4 peer of the dual-stack listener
      in_addr v4{};
      std::memcpy(&v4, v6.sin6_addr.s6_addr + 12, sizeof v4);
      return ::inet_ntop(AF_INET, &v4, text, sizeof text) ? text : "127.0.0.1";
    }
    return ::inet_ntop(AF_INET6, &v6.sin6_addr, text, sizeof text) ? text : "::1";
  }
  auto const& v4 = reinterpret_cast<sockaddr_in const&>(a);
  return ::inet_ntop(AF_INET, &v4.sin_addr, text, sizeof text) ? text : "127.0.0.1";
}

std::vector<std::vector<std::byte>> rendezvous_all_gather(std::span<std::byte const> mine, std::chrono::milliseconds timeout) {
  return rendezvous_exchange("connecting Gloo", mine, timeout);
}

World rendezvous_world(DeviceGroup const& group, Place const& place, std::chrono::milliseconds timeout) {
  std::vector<std::byte> mine;
  put(mine, static_cast<std::int32_t>(group.size()));
  put(mine, static_cast<std::int32_t>(place.host.size()));
  mine.insert(mine.end(), reinterpret_cast<std::byte const*>(place.host.data()),
              reinterpret_cast<std::byte const*>(place.host.data() + place.host.size()));
  for (int r = 0; r < group.size(); ++r) {
    Device const d = group.device(r);
    put(mine, static_cast<std::int32_t>(d.kind));
    put(mine, static_cast<std::int32_t>(d.index));
    put(mine, d.speed);
  }
  auto const all = rendezvous_exchange("make_world", mine, timeout);
  World world;
  world.process = place.rank;
  world.processes = place.size;
  int rank = 0;
  for (int p = 0; p < place.size; ++p) {
    auto const& in = all[static_cast<std::size_t>(p)];
    std::size_t at = 0;
    auto const devices = take<std::int32_t>(in, at, "make_world");
    auto const host_bytes = take<std::int32_t>(in, at, "make_world");
    if (host_bytes < 0 || static_cast<std::size_t>(host_bytes) > in.size() - at)
      throw Error(Errc::communication, "the rendezvous: a short make_world message");
    std::string const host(reinterpret_cast<char const*>(in.data() + at), static_cast<std::size_t>(host_bytes));
    at += static_cast<std::size_t>(host_bytes);
    for (int l = 0; l < devices; ++l, ++rank) {
      auto const kind = take<std::int32_t>(in, at, "make_world");
      auto const index = take<std::int32_t>(in, at, "make_world");
      auto const speed = take<double>(in, at, "make_world");
      world.devices.push_back({rank, Device{static_cast<DeviceKind>(kind), index, speed}, p, l, host});
    }
  }
  return world;
}

std::unique_ptr<comm::Communicator> rendezvous_communicator(World const& world, DeviceGroup& group,
                                                            comm::Options options) {
  std::chrono::milliseconds const timeout = options.timeout.count() > 0 ? options.timeout : comm::default_timeout();
  if (world.devices.front().device.kind != DeviceKind::cuda)  // check_world: one kind
    throw Error(Errc::invalid_argument,
                "host devices across the processes of a torchrun-style job in a build without Gloo (expected CUDA "
                "GPUs, which NCCL connects through the rendezvous; host devices across processes need Gloo "
                "(MGPU_WITH_GLOO) or MPI: launch with mpirun or srun)");
  if (options.backend != comm::Backend::automatic && options.backend != comm::Backend::nccl)
    throw Error(Errc::invalid_argument, "the " + std::string(comm::to_string(options.backend)) +
                                            " backend across processes of CUDA GPUs (expected automatic or nccl)");
  auto const all = rendezvous_exchange("the NCCL unique id",
                                       world.process == 0 ? nccl_id_message() : std::vector<std::byte>{}, timeout);
  std::vector<std::byte> const id = nccl_id_from(all.front());
  return comm::detail::make_nccl_world_communicator(group, group_ranks(group), world.size(), world.first_rank(world.process),
                                                    id, timeout);
}

}  // namespace mgpu::dist::detail
