// Collectives on CUDA devices: the cuda_peer backend on several logical devices sharing GPU 0, and
// NCCL (across every GPU, or a one-rank group on a one-GPU machine), against a host float64
// reference; send/recv into separate buffers, checked; a send that does not wait for its receiver;
// subset communicators (cuda_peer on logical devices of GPU 0, NCCL over distinct GPUs) beside a
// whole-group one. The hang-prone paths (an exchange in one group, an allocation that would wait
// for a receive this thread has yet to post, work on a rank's other streams, a communicator
// destroyed while a stream waits on it) run under short deadlines, so a regression fails instead
// of hanging.
#include <mgpu/comm/communicator.hpp>
#include <mgpu/config.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/scoped_env.hpp"

using mgpu::DType;
using mgpu::Tensor;
using mgpu::comm::ReduceOp;
using mgpu::test::ScopedEnv;

namespace {

// Waits, at most `limit`, for `stream` to finish its work; false if it does not.
bool finishes_within(mgpu::Stream& stream, std::chrono::milliseconds limit) {
  auto const deadline = std::chrono::steady_clock::now() + limit;
  while (!stream.query()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

std::vector<float> download(Tensor const& t) {
  auto host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  Tensor out = Tensor::empty(t.shape(), DType::float32, *host);
  Tensor staged = Tensor::empty(t.shape(), t.dtype(), *host);
  mgpu::Stream stream(t.device());
  mgpu::copy_async(staged, t, stream);
  stream.synchronize();
  mgpu::Stream host_stream({mgpu::DeviceKind::host, 0});
  mgpu::convert_async(out, staged, host_stream);
  host_stream.synchronize();
  auto s = out.host_span<float>();
  return {s.begin(), s.end()};
}

Tensor upload(std::vector<float> const& values, DType dtype, mgpu::Allocator& device, mgpu::Stream& stream) {
  auto host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  auto const n = static_cast<std::int64_t>(values.size());
  Tensor src = Tensor::empty({n}, DType::float32, *host);
  std::copy(values.begin(), values.end(), src.host_span<float>().begin());
  Tensor converted = Tensor::empty({n}, dtype, *host);
  mgpu::Stream host_stream({mgpu::DeviceKind::host, 0});
  mgpu::convert_async(converted, src, host_stream);
  host_stream.synchronize();
  Tensor out = Tensor::empty({n}, dtype, device);
  mgpu::copy_async(out, converted, stream);
  stream.synchronize();
  return out;
}

void check_collectives(std::string const& spec, mgpu::comm::Backend expected) {
  mgpu::DeviceGroup group(spec);
  auto comm = mgpu::comm::make_communicator(group, {.backend = expected});
  REQUIRE(comm->backend() == expected);
  int const n = group.size();
  for (DType t : {DType::float32, DType::bfloat16}) {
    for (std::int64_t count : {1, 7, 1000003}) {
      INFO(spec << ", " << count << " " << mgpu::to_string(t));
      std::vector<std::vector<float>> in(static_cast<std::size_t>(n));
      std::vector<Tensor> buffers;
      std::vector<Tensor> gathered;
      std::vector<Tensor> parts;
      std::vector<Tensor> inbox;  // what the ring exchange delivers: never the sender's own buffer
      for (int r = 0; r < n; ++r) {
        for (std::int64_t i = 0; i < count * n; ++i) in[static_cast<std::size_t>(r)].push_back(static_cast<float>((i * (r + 1)) % 64) - 32.0f);
        buffers.push_back(upload(in[static_cast<std::size_t>(r)], t, group.allocator(r), group.stream(r)));
        parts.push_back(Tensor::empty({count}, t, group.allocator(r)));
        gathered.push_back(Tensor::empty({count * n}, t, group.allocator(r)));
        inbox.push_back(Tensor::empty({count}, t, group.allocator(r)));
      }
      group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
        auto const r = static_cast<std::size_t>(rank);
        comm->reduce_scatter(rank, buffers[r], parts[r], ReduceOp::sum, stream);
        comm->all_gather(rank, parts[r], gathered[r], stream);
        comm->all_reduce(rank, buffers[r], buffers[r], ReduceOp::max, stream);
        comm->group_start(rank);
        comm->send(rank, parts[r], (rank + 1) % n, stream);
        comm->recv(rank, inbox[r], (rank + n - 1) % n, stream);
        comm->group_end(rank);
      });
      for (int r = 0; r < n; ++r) {
        auto const sums = download(gathered[static_cast<std::size_t>(r)]);
        auto const maxima = download(buffers[static_cast<std::size_t>(r)]);
        // Rank r received rank r-1's part: the sum over ranks of the inputs' slice r-1.
        int const from = (r + n - 1) % n;
        auto const received = download(inbox[static_cast<std::size_t>(r)]);
        for (std::int64_t i = 0; i < count; i += std::max<std::int64_t>(1, count / 97)) {
          double sum = 0;
          for (auto const& v : in) sum += v[static_cast<std::size_t>(from * count + i)];
          REQUIRE(received[static_cast<std::size_t>(i)] == sum);
        }
        for (std::int64_t i = 0; i < count * n; i += std::max<std::int64_t>(1, count / 97)) {
          double sum = 0;
          float max = -1e30f;
          for (auto const& v : in) {
            sum += v[static_cast<std::size_t>(i)];
            max = std::max(max, v[static_cast<std::size_t>(i)]);
          }
          REQUIRE(sums[static_cast<std::size_t>(i)] == sum);  // small integers: exact in both dtypes
          REQUIRE(maxima[static_cast<std::size_t>(i)] == max);
        }
      }
    }
  }
  comm->finalize();
}

// Even and odd ranks of `spec` (the odd ones listed in reverse: a subset's rank order need not be
// the group's) each sum-reduce over their own subset communicator while the whole group takes a
// max, then pass their inputs around a ring in the subset's numbering (subsets of two or more);
// checked against host sums.
void check_subsets(std::string const& spec, mgpu::comm::Backend expected) {
  mgpu::DeviceGroup group(spec);
  int const n = group.size();
  std::vector<std::vector<int>> subsets(n > 1 ? 2 : 1);
  for (int r = 0; r < n; ++r) subsets[static_cast<std::size_t>(r % 2)].push_back(r);
  if (n > 1) std::reverse(subsets[1].begin(), subsets[1].end());
  std::vector<std::unique_ptr<mgpu::comm::Communicator>> comms;
  std::vector<std::size_t> which(static_cast<std::size_t>(n));
  std::vector<int> sub_rank(static_cast<std::size_t>(n));
  for (std::size_t s = 0; s < subsets.size(); ++s) {
    comms.push_back(mgpu::comm::make_communicator(group, subsets[s]));
    REQUIRE(comms.back()->backend() == expected);
    REQUIRE(comms.back()->size() == static_cast<int>(subsets[s].size()));
    for (std::size_t i = 0; i < subsets[s].size(); ++i) {
      which[static_cast<std::size_t>(subsets[s][i])] = s;
      sub_rank[static_cast<std::size_t>(subsets[s][i])] = static_cast<int>(i);
    }
  }
  auto whole = mgpu::comm::make_communicator(group);
  constexpr std::int64_t count = 1000;
  std::vector<std::vector<float>> in(static_cast<std::size_t>(n));
  std::vector<Tensor> sums, maxima, mine, inbox;
  for (int r = 0; r < n; ++r) {
    for (std::int64_t i = 0; i < count; ++i) in[static_cast<std::size_t>(r)].push_back(static_cast<float>((r + 1) * (i % 13)));
    sums.push_back(upload(in[static_cast<std::size_t>(r)], DType::float32, group.allocator(r), group.stream(r)));
    maxima.push_back(upload(in[static_cast<std::size_t>(r)], DType::float32, group.allocator(r), group.stream(r)));
    mine.push_back(upload(in[static_cast<std::size_t>(r)], DType::float32, group.allocator(r), group.stream(r)));
    inbox.push_back(Tensor::empty({count}, DType::float32, group.allocator(r)));
  }
  group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
    auto const r = static_cast<std::size_t>(rank);
    auto& comm = *comms[which[r]];
    int const k = sub_rank[r];
    int const m = comm.size();
    comm.all_reduce(k, sums[r], sums[r], ReduceOp::sum, stream);
    whole->all_reduce(rank, maxima[r], maxima[r], ReduceOp::max, stream);
    if (m == 1) return;
    comm.group_start(k);
    comm.send(k, mine[r], (k + 1) % m, stream);
    comm.recv(k, inbox[r], (k + m - 1) % m, stream);
    comm.group_end(k);
  });
  for (int r = 0; r < n; ++r) {
    auto const& members = subsets[which[static_cast<std::size_t>(r)]];
    int const m = static_cast<int>(members.size());
    int const from = members[static_cast<std::size_t>((sub_rank[static_cast<std::size_t>(r)] + m - 1) % m)];
    auto const got_sums = download(sums[static_cast<std::size_t>(r)]);
    auto const got_maxima = download(maxima[static_cast<std::size_t>(r)]);
    auto const got_inbox = download(inbox[static_cast<std::size_t>(r)]);
    for (std::int64_t i = 0; i < count; ++i) {
      auto const at = static_cast<std::size_t>(i);
      float sum = 0;
      for (int const q : members) sum += in[static_cast<std::size_t>(q)][at];
      REQUIRE(got_sums[at] == sum);  // small integers: exact
      REQUIRE(got_maxima[at] == in[static_cast<std::size_t>(n - 1)][at]);
      if (m > 1) REQUIRE(got_inbox[at] == in[static_cast<std::size_t>(from)][at]);
    }
  }
  for (auto& comm : comms) comm->finalize();
  whole->finalize();
}

}  // namespace

TEST_CASE("cuda_peer subset communicators on logical devices sharing GPU 0", "[cuda][comm]") {
  check_subsets("cuda:0,0,0,0", mgpu::comm::Backend::cuda_peer);
}

TEST_CASE("NCCL subset communicators over distinct GPUs (one rank each on a one-GPU machine)", "[cuda][comm]") {
  if (!mgpu::built_with_nccl) MGPU_SKIP("built without NCCL");
  check_subsets("cuda", mgpu::comm::Backend::nccl);
}

TEST_CASE("cuda_peer collectives on logical devices sharing GPU 0", "[cuda][comm]") {
  check_collectives("cuda:0,0", mgpu::comm::Backend::cuda_peer);
  check_collectives("cuda:0,0,0,0", mgpu::comm::Backend::cuda_peer);
}

TEST_CASE("cuda_peer collectives back to back on two streams per rank, one rank's thread lagging", "[cuda][comm]") {
  // One host meeting per collective: a rank may enter the next collective (and record its "inputs
  // ready") while another is still enqueuing its waits for this one, and a rank's collectives on
  // two streams announce their ends in order. Every result is checked.
  mgpu::DeviceGroup group("cuda:0,0,0");
  auto comm = mgpu::comm::make_communicator(
      group, {.backend = mgpu::comm::Backend::cuda_peer, .timeout = std::chrono::milliseconds(20000)});
  int const n = group.size();
  constexpr int rounds = 24;
  constexpr std::int64_t count = 3001;
  std::vector<mgpu::Stream> side;
  for (int r = 0; r < n; ++r) side.emplace_back(group.device(r));
  std::vector<std::vector<Tensor>> inputs(static_cast<std::size_t>(n));
  std::vector<std::vector<Tensor>> outputs(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    for (int k = 0; k < rounds; ++k) {
      std::vector<float> values(count);
      for (std::int64_t i = 0; i < count; ++i)
        values[static_cast<std::size_t>(i)] = static_cast<float>((i + k * (r + 1)) % 17);
      inputs[static_cast<std::size_t>(r)].push_back(
          upload(values, DType::float32, group.allocator(r), group.stream(r)));
      outputs[static_cast<std::size_t>(r)].push_back(Tensor::empty({count}, DType::float32, group.allocator(r)));
    }
  }
  group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
    auto const r = static_cast<std::size_t>(rank);
    for (int k = 0; k < rounds; ++k) {
      if (rank == n - 1 && k % 3 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      mgpu::Stream& s = k % 2 == 0 ? stream : side[r];
      comm->all_reduce(rank, inputs[r][static_cast<std::size_t>(k)], outputs[r][static_cast<std::size_t>(k)],
                       ReduceOp::sum, s);
    }
  });
  for (auto& s : side) s.synchronize();
  comm->finalize();
  for (int r = 0; r < n; ++r) {
    for (int k = 0; k < rounds; ++k) {
      INFO("rank " << r << ", round " << k);
      auto const got = download(outputs[static_cast<std::size_t>(r)][static_cast<std::size_t>(k)]);
      for (std::int64_t i = 0; i < count; ++i) {
        double sum = 0;
        for (int p = 0; p < n; ++p) sum += static_cast<double>((i + k * (p + 1)) % 17);
        REQUIRE(got[static_cast<std::size_t>(i)] == sum);
      }
    }
  }
}

TEST_CASE("cuda_peer all-reduce with 16-byte loads where the ranks' buffers line up, element loads where not",
          "[cuda][comm]") {
  mgpu::DeviceGroup group("cuda:0,0,0,0");
  auto comm = mgpu::comm::make_communicator(group, {.backend = mgpu::comm::Backend::cuda_peer});
  int const n = group.size();
  for (DType t : {DType::float32, DType::bfloat16, DType::float16}) {
    for (std::int64_t count : {5, 4099}) {
      // Views starting `shift` elements into their buffers: lined up (all 0 or all 1: a head, then
      // vectors, then a tail) or not (each rank its own shift: element by element).
      for (bool lined_up : {true, false}) {
        for (std::int64_t base : {0, 1}) {
          INFO(mgpu::to_string(t) << ", " << count << " elements, lined up " << lined_up << ", shift " << base);
          std::vector<std::vector<float>> in(static_cast<std::size_t>(n));
          std::vector<Tensor> views;
          std::vector<Tensor> kept;
          for (int r = 0; r < n; ++r) {
            std::int64_t const shift = lined_up ? base : base + r;
            std::vector<float> values(static_cast<std::size_t>(count + shift), -1.0f);
            for (std::int64_t i = 0; i < count; ++i) {
              float const v = static_cast<float>((i * (r + 3)) % 29) - 14.0f;
              values[static_cast<std::size_t>(shift + i)] = v;
              in[static_cast<std::size_t>(r)].push_back(v);
            }
            kept.push_back(upload(values, t, group.allocator(r), group.stream(r)));
            views.push_back(kept.back().slice(shift, shift + count));
          }
          group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
            auto const& v = views[static_cast<std::size_t>(rank)];
            comm->all_reduce(rank, v, v, ReduceOp::sum, stream);
          });
          for (int r = 0; r < n; ++r) {
            auto const got = download(kept[static_cast<std::size_t>(r)]);
            std::int64_t const shift = lined_up ? base : base + r;
            for (std::int64_t i = 0; i < shift; ++i) REQUIRE(got[static_cast<std::size_t>(i)] == -1.0f);  // untouched
            for (std::int64_t i = 0; i < count; ++i) {
              double sum = 0;
              for (auto const& v : in) sum += v[static_cast<std::size_t>(i)];
              REQUIRE(got[static_cast<std::size_t>(shift + i)] == sum);  // small integers: exact in every dtype
            }
          }
        }
      }
    }
  }
  comm->finalize();
}

TEST_CASE("NCCL collectives across every GPU (one rank on a one-GPU machine)", "[cuda][comm]") {
  if (!mgpu::built_with_nccl) MGPU_SKIP("built without NCCL");
  // One GPU still makes a one-rank NCCL group: non-blocking init, launches, the watchdog, and
  // finalize/destroy all run.
  check_collectives("cuda", mgpu::comm::Backend::nccl);
}

TEST_CASE("A cuda_peer send does not wait for its receiver on the host", "[cuda][comm][sanitize]") {
  mgpu::DeviceGroup group("cuda:0,0");
  auto comm = mgpu::comm::make_communicator(group, {.backend = mgpu::comm::Backend::cuda_peer});
  constexpr std::int64_t n = 4096;
  std::vector<float> values(n);
  for (std::int64_t i = 0; i < n; ++i) values[static_cast<std::size_t>(i)] = static_cast<float>(i % 251) - 100.0f;
  Tensor const message = upload(values, DType::float32, group.allocator(0), group.stream(0));
  Tensor const inbox = Tensor::empty({n}, DType::float32, group.allocator(1));
  double send_seconds = -1;
  group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
    if (rank == 0) {
      auto const start = std::chrono::steady_clock::now();
      comm->send(0, message, 1, stream);
      send_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the receiver comes late
      comm->recv(1, inbox, 0, stream);
    }
  });
  REQUIRE(send_seconds != -1.0);  // rank 0 ran its send
  CHECK(send_seconds < 0.15);  // a send that waited for the receiver would take the 300 ms
  auto const received = download(inbox);
  for (std::int64_t i = 0; i < n; ++i) REQUIRE(received[static_cast<std::size_t>(i)] == values[static_cast<std::size_t>(i)]);
  comm->finalize();
}

TEST_CASE("cuda_peer reports a send nobody receives instead of hanging", "[cuda][comm]") {
  mgpu::DeviceGroup group("cuda:0,0");
  auto comm = mgpu::comm::make_communicator(group, {.backend = mgpu::comm::Backend::cuda_peer,
                                                    .timeout = std::chrono::milliseconds(300)});
  Tensor const message = Tensor::empty({16}, DType::float32, group.allocator(0));
  group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
    if (rank == 0) comm->send(0, message, 1, stream);
  });
  // The watchdog aborts within the deadline, without finalize: the sender's stream is released.
  CHECK(finishes_within(group.stream(0), std::chrono::seconds(10)));
  CHECK(comm->aborted());
  REQUIRE_MGPU_ERROR(comm->finalize(), mgpu::Errc::communication, "for rank 1 to receive 1 message(s) from rank 0");
}

TEST_CASE("A stalled rank on CUDA devices times out instead of hanging", "[cuda][comm]") {
  mgpu::DeviceGroup group("cuda:0,0");
  auto comm = mgpu::comm::make_communicator(group, {.timeout = std::chrono::milliseconds(300)});
  Tensor a = Tensor::empty({16}, DType::float32, group.allocator(0));
  REQUIRE_MGPU_ERROR(group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
    if (rank == 0) comm->all_reduce(rank, a, a, ReduceOp::sum, stream);
  }),
                     mgpu::Errc::timeout, "waited");
  CHECK(comm->aborted());
}

TEST_CASE("cuda_peer: two ranks exchanging a send and a receive in one group do not deadlock on the GPU", "[cuda][comm][sanitize]") {
  // The 1F1B steady state: each step, rank 0 sends an activation and receives a gradient in one
  // group, rank 1 the reverse. Finalize has a deadline: a GPU deadlock becomes an error naming the
  // ranks (and the abort releases the streams) instead of a hang.
  mgpu::DeviceGroup group("cuda:0,0");
  auto comm = mgpu::comm::make_communicator(group, {.backend = mgpu::comm::Backend::cuda_peer,
                                                    .timeout = std::chrono::milliseconds(2000)});
  constexpr int steps = 3;
  constexpr std::int64_t n = 1 << 16;
  auto values = [](int rank, int step) {
    std::vector<float> v(n);
    for (std::int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = static_cast<float>((i * (rank + 2) + step) % 509) - 254.0f;
    return v;
  };
  std::vector<std::vector<Tensor>> outbox(2);
  std::vector<std::vector<Tensor>> inbox(2);
  for (int r = 0; r < 2; ++r) {
    for (int step = 0; step < steps; ++step) {
      outbox[static_cast<std::size_t>(r)].push_back(upload(values(r, step), DType::float32, group.allocator(r), group.stream(r)));
      inbox[static_cast<std::size_t>(r)].push_back(Tensor::empty({n}, DType::float32, group.allocator(r)));
    }
  }
  group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
    auto const r = static_cast<std::size_t>(rank);
    for (std::size_t step = 0; step < steps; ++step) {
      comm->group_start(rank);
      comm->send(rank, outbox[r][step], 1 - rank, stream);
      comm->recv(rank, inbox[r][step], 1 - rank, stream);
      comm->group_end(rank);
    }
  });
  comm->finalize();
  for (int r = 0; r < 2; ++r) {
    for (int step = 0; step < steps; ++step) {
      auto const expected = values(1 - r, step);  // computed on the host, not read back from the sender
      REQUIRE(download(inbox[static_cast<std::size_t>(r)][static_cast<std::size_t>(step)]) == expected);
    }
  }
}

TEST_CASE("Out of GPU memory does not block on work that waits for this thread", "[cuda][comm]") {
  // The freed send buffer's block is reusable only after rank 1's copy, which this thread posts
  // after the allocation: a blocking wait for that work would never end. The allocator polls it
  // for the deadline ($MGPU_COMM_TIMEOUT) and reports out of memory.
  ScopedEnv const deadline("MGPU_COMM_TIMEOUT", "0.5");
  mgpu::DeviceGroup group("cuda:0,0");
  // The communicator's own deadline is longer: its watchdog must not end the send before the
  // allocation has given up.
  auto comm = mgpu::comm::make_communicator(group, {.backend = mgpu::comm::Backend::cuda_peer,
                                                    .timeout = std::chrono::milliseconds(10000)});
  constexpr std::int64_t n = 1 << 20;
  auto& allocator = group.allocator(0);
  Tensor const inbox = Tensor::empty({n}, DType::float32, group.allocator(1));
  allocator.release_cached();
  {
    Tensor const message = Tensor::empty({n}, DType::float32, allocator);
    mgpu::fill_async(message, 3.0f, group.stream(0));
    comm->send(0, message, 1, group.stream(0));
  }
  allocator.set_limit(allocator.stats().reserved);  // only the freed block could serve a request
  auto const start = std::chrono::steady_clock::now();
  REQUIRE_MGPU_ERROR(Tensor::empty({n}, DType::float32, allocator), mgpu::Errc::out_of_memory, "still used by queued GPU work");
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
  comm->recv(1, inbox, 0, group.stream(1));
  group.synchronize();
  CHECK(Tensor::empty({n}, DType::float32, allocator).defined());  // the copy has run: the block is free
  allocator.set_limit(std::nullopt);
  auto const received = download(inbox);
  REQUIRE(std::all_of(received.begin(), received.end(), [](float v) { return v == 3.0f; }));
  comm->finalize();
}

TEST_CASE("cuda_peer finalize waits for every stream a rank used, not only its last", "[cuda][comm]") {
  mgpu::DeviceGroup group("cuda:0,0");
  auto comm = mgpu::comm::make_communicator(group, {.backend = mgpu::comm::Backend::cuda_peer,
                                                    .timeout = std::chrono::milliseconds(300)});
  mgpu::Stream side0(group.device(0));
  mgpu::Stream side1(group.device(1));
  std::promise<void> gate;
  std::shared_future<void> const opened = gate.get_future().share();
  side0.enqueue([opened] { opened.wait(); });  // the send on side0 (and rank 1's copy) waits for the gate
  Tensor const message = Tensor::empty({256}, DType::float32, group.allocator(0));
  Tensor const inbox = Tensor::empty({256}, DType::float32, group.allocator(1));
  group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
    if (rank == 0) {
      comm->send(0, message, 1, side0);
    } else {
      comm->recv(1, inbox, 0, side1);
    }
    comm->barrier(rank, stream);  // each rank's last operation, on its own stream: done at once
  });
  REQUIRE_MGPU_ERROR(comm->finalize(), mgpu::Errc::communication, "rank 0's operations on its stream 1 of 2");
  gate.set_value();
  CHECK(finishes_within(side0, std::chrono::seconds(10)));
  CHECK(finishes_within(side1, std::chrono::seconds(10)));
}

TEST_CASE("cuda_peer receives of one sender on two streams release its buffers only after their own copies", "[cuda][comm]") {
  // Rank 0 sends two messages in one group; rank 1 receives the first on a stream held by a gate and
  // the second on a free one. The second copy runs first, but the sender's stream must still wait
  // for the first: its buffer is read until then.
  mgpu::DeviceGroup group("cuda:0,0");
  auto comm = mgpu::comm::make_communicator(group, {.backend = mgpu::comm::Backend::cuda_peer,
                                                    .timeout = std::chrono::milliseconds(5000)});
  constexpr std::int64_t n = 4096;
  std::vector<float> first(n);
  std::vector<float> second(n);
  for (std::int64_t i = 0; i < n; ++i) {
    first[static_cast<std::size_t>(i)] = static_cast<float>(i % 97);
    second[static_cast<std::size_t>(i)] = -static_cast<float>(i % 89);
  }
  Tensor const m0 = upload(first, DType::float32, group.allocator(0), group.stream(0));
  Tensor const m1 = upload(second, DType::float32, group.allocator(0), group.stream(0));
  Tensor const in0 = Tensor::empty({n}, DType::float32, group.allocator(1));
  Tensor const in1 = Tensor::empty({n}, DType::float32, group.allocator(1));
  mgpu::Stream gated(group.device(1));
  mgpu::Stream free_stream(group.device(1));
  std::promise<void> gate;
  std::shared_future<void> const opened = gate.get_future().share();
  gated.enqueue([opened] { opened.wait(); });
  comm->group_start(0);
  comm->send(0, m0, 1, group.stream(0));
  comm->send(0, m1, 1, group.stream(0));
  comm->group_end(0);
  comm->recv(1, in0, 0, gated);
  comm->recv(1, in1, 0, free_stream);
  CHECK_FALSE(finishes_within(group.stream(0), std::chrono::milliseconds(300)));  // the first copy has not run
  gate.set_value();
  CHECK(finishes_within(group.stream(0), std::chrono::seconds(10)));
  CHECK(finishes_within(free_stream, std::chrono::seconds(10)));
  comm->finalize();
  REQUIRE(download(in0) == first);
  REQUIRE(download(in1) == second);
}

TEST_CASE("A cuda_peer communicator destroyed while a send waits releases the sender's stream", "[cuda][comm]") {
  // The communicator's channel words go back to a pool; one recycled (reset) while a stream still
  // waited on it would hold that stream forever, and the next communicator would share the word.
  mgpu::DeviceGroup group("cuda:0,0");
  Tensor const message = Tensor::empty({256}, DType::float32, group.allocator(0));
  auto comm = mgpu::comm::make_communicator(group, {.backend = mgpu::comm::Backend::cuda_peer,
                                                    .timeout = std::chrono::milliseconds(300)});
  comm->send(0, message, 1, group.stream(0));  // never received
  auto const start = std::chrono::steady_clock::now();
  comm.reset();
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
  CHECK(finishes_within(group.stream(0), std::chrono::seconds(10)));
  // A new communicator (on recycled words) exchanges correctly.
  auto next = mgpu::comm::make_communicator(group, {.backend = mgpu::comm::Backend::cuda_peer,
                                                    .timeout = std::chrono::milliseconds(2000)});
  std::vector<float> values(256);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i) * 0.5f;
  Tensor const sent = upload(values, DType::float32, group.allocator(0), group.stream(0));
  Tensor const inbox = Tensor::empty({256}, DType::float32, group.allocator(1));
  next->send(0, sent, 1, group.stream(0));
  next->recv(1, inbox, 0, group.stream(1));
  next->finalize();
  REQUIRE(download(inbox) == values);
}

TEST_CASE("An aborted NCCL communicator with work in flight is destroyed within its deadline", "[cuda][comm]") {
  if (!mgpu::built_with_nccl) MGPU_SKIP("built without NCCL");
  // One rank per GPU (one on a one-GPU machine): the abort and destroy paths run grouped over
  // every communicator; a later communicator still works.
  mgpu::DeviceGroup group("cuda");
  std::vector<Tensor> buffers;
  for (int r = 0; r < group.size(); ++r) buffers.push_back(Tensor::empty({1 << 22}, DType::float32, group.allocator(r)));
  {
    auto comm = mgpu::comm::make_communicator(group, {.backend = mgpu::comm::Backend::nccl,
                                                      .timeout = std::chrono::milliseconds(2000)});
    group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
      auto const& b = buffers[static_cast<std::size_t>(rank)];
      comm->all_reduce(rank, b, b, ReduceOp::sum, stream);
    });
    comm->abort("aborted by the test");
    auto const start = std::chrono::steady_clock::now();
    comm.reset();
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
  }
  for (int r = 0; r < group.size(); ++r) CHECK(finishes_within(group.stream(r), std::chrono::seconds(10)));
  check_collectives("cuda", mgpu::comm::Backend::nccl);
}
