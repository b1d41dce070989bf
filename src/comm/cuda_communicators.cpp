// The CUDA backends.
//
// cuda_peer: ranks meet on the host when they enqueue a collective (each rank calls from its own
// thread, as in DeviceGroup::run); send/recv meet only the pair, through a channel per direction. At
// a collective's meeting they exchange buffer pointers and "inputs ready"
// events; each rank's stream then waits for every rank's inputs, runs the reduction kernel over its
// slice (reading every rank's input through same-GPU or peer pointers, writing every output) and
// records "done"; a second meeting exchanges those, and each stream waits for all of them, so no
// rank reuses a buffer another rank still reads. This also serves several logical devices sharing
// one GPU, which NCCL cannot.
//
// nccl: one NCCL communicator per rank from ncclCommInitAll; operations run on the rank's stream.
// A watchdog thread polls each operation's completion event and ncclCommGetAsyncError, and aborts
// every rank's communicator (ncclCommAbort) when an operation passes its deadline or fails.
#include "comm/cuda_communicators.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <mgpu/comm/detail/reduce_slice.hpp>
#include <mgpu/config.hpp>
#include <mgpu/core/error.hpp>

#include "comm/base.hpp"
#include "comm/cuda_kernels.hpp"
#include "core/cuda_device_scope.hpp"

#if MGPU_NCCL_ENABLED
#include <nccl.h>
#endif

namespace mgpu::comm::detail {
namespace {

using Clock = std::chrono::steady_clock;

cudaStream_t native(Stream& stream) { return static_cast<cudaStream_t>(stream.native_handle()); }

void check_cuda_device(DeviceGroup const& group, int rank, Device device, std::string_view what, Call const& call) {
  if (device != group.device(rank))
    throw Error(Errc::invalid_argument, call.name(rank) + ": " + std::string(what) + " is on " + device.to_string() +
                                            " (expected the rank's own device, " + group.device(rank).to_string() + ")");
}

// A host meeting point for the ranks' enqueuing threads: everyone posts, then everyone reads.
template <class Post>
class Meeting {
 public:
  Meeting(int size, SharedState& shared) : posts_(static_cast<std::size_t>(size)), shared_(shared) {}

  // Posts this rank's value and waits for every rank's; returns them all.
  std::vector<Post> const& exchange(int rank, Post post, std::string const& what) {
    std::unique_lock lock(mutex_);
    std::uint64_t const generation = generation_;
    posts_[static_cast<std::size_t>(rank)] = std::move(post);
    if (++arrived_ == static_cast<int>(posts_.size())) {
      snapshot_ = posts_;
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return snapshot_;
    }
    auto const start = Clock::now();
    while (generation_ == generation) {
      shared_.throw_if_aborted(what);
      if (cv_.wait_until(lock, start + shared_.timeout()) == std::cv_status::timeout && generation_ == generation) {
        std::string const message = what + " waited " + format_duration(Clock::now() - start) + " for " +
                                    std::to_string(static_cast<int>(posts_.size()) - arrived_) + " rank(s) to call it";
        lock.unlock();
        shared_.abort(message);
        throw Error(Errc::timeout, message + " (expected every rank within the " + format_duration(shared_.timeout()) + " deadline)");
      }
    }
    return snapshot_;  // stays valid: the next generation cannot complete before this rank posts again
  }

  void wake() {
    { std::lock_guard lock(mutex_); }
    cv_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<Post> posts_;
  std::vector<Post> snapshot_;
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
  SharedState& shared_;
};

// One rank's events: created once on its GPU, re-recorded every operation.
struct RankEvents {
  cudaEvent_t ready = nullptr;
  cudaEvent_t done = nullptr;
};

class CudaPeerCommunicator final : public CommunicatorBase {
 public:
  CudaPeerCommunicator(DeviceGroup& group, std::chrono::milliseconds timeout)
      : CommunicatorBase(group, Backend::cuda_peer, timeout),
        events_(static_cast<std::size_t>(group.size())),
        channels_(static_cast<std::size_t>(group.size() * group.size())),
        meeting_(group.size(), *state()),
        done_meeting_(group.size(), *state()) {
    if (group.size() > max_reduce_ranks)
      throw Error(Errc::invalid_argument, "a cuda_peer communicator over " + std::to_string(group.size()) +
                                              " ranks (expected at most " + std::to_string(max_reduce_ranks) + ")");
    auto const peers = peer_access_matrix(group.devices());
    for (int r = 0; r < group.size(); ++r) {
      int const gpu = group.device(r).index;
      mgpu::detail::cuda::DeviceScope scope(gpu);
      MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&events_[static_cast<std::size_t>(r)].ready, cudaEventDisableTiming));
      MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&events_[static_cast<std::size_t>(r)].done, cudaEventDisableTiming));
      for (int p = 0; p < group.size(); ++p) {
        int const other = group.device(p).index;
        if (other == gpu) continue;
        if (!peers[static_cast<std::size_t>(r)][static_cast<std::size_t>(p)])
          throw Error(Errc::invalid_argument, "cuda_peer needs peer access from cuda:" + std::to_string(gpu) + " to cuda:" +
                                                  std::to_string(other) + ", which the GPUs do not offer (expected NCCL for them)");
        cudaError_t const status = cudaDeviceEnablePeerAccess(other, 0);
        if (status == cudaErrorPeerAccessAlreadyEnabled) {
          (void)cudaGetLastError();
        } else {
          MGPU_CUDA_CHECK(status);
        }
      }
    }
    state()->on_abort([this] {
      meeting_.wake();
      done_meeting_.wake();
      for (auto& ch : channels_) {
        { std::lock_guard lock(ch.mutex); }
        ch.cv.notify_all();
      }
    });
  }

  ~CudaPeerCommunicator() override {
    for (auto& e : events_) {
      if (e.ready != nullptr) MGPU_CUDA_CHECK_NO_THROW(cudaEventDestroy(e.ready));
      if (e.done != nullptr) MGPU_CUDA_CHECK_NO_THROW(cudaEventDestroy(e.done));
    }
  }

 protected:
  void check_device(int rank, Device device, std::string_view what, Call const& call) const override {
    check_cuda_device(group(), rank, device, what, call);
  }

  void launch(int rank, std::vector<Call> calls, Stream& stream) override {
    state()->begin_operation();
    struct Done {
      SharedState& s;
      ~Done() { s.end_operation(); }
    } done{*state()};
    mgpu::detail::cuda::DeviceScope scope(group().device(rank).index);
    cudaStream_t const s = native(stream);
    // Sends are posted first and awaited last, so a group's sends and receives cannot block each other.
    std::vector<std::unique_ptr<PeerMessage>> sends;
    for (Call const& c : calls) {
      if (c.kind == OpKind::send) sends.push_back(post_send(rank, c, s));
    }
    try {
      for (Call const& c : calls) {
        if (c.kind == OpKind::recv) {
          receive(rank, c, s);
        } else if (c.kind != OpKind::send) {
          collective(rank, c, s);
        }
      }
      for (std::size_t i = 0, k = 0; i < calls.size(); ++i) {
        if (calls[i].kind == OpKind::send) await_taken(rank, calls[i], *sends[k++], s);
      }
    } catch (...) {
      for (std::size_t i = 0, k = 0; i < calls.size(); ++i) {
        if (calls[i].kind == OpKind::send) withdraw(rank, calls[i].root, *sends[k++]);
      }
      throw;
    }
  }

 private:
  struct Post {
    OpKind kind{};
    std::uint64_t seq = 0;
    std::int64_t count = 0;
    DType dtype{};
    ReduceOp op{};
    int root = 0;
    void const* send = nullptr;
    void* recv = nullptr;
  };

  // A send waiting for its receive; the receiver records `copied` once its copy is enqueued.
  struct PeerMessage {
    void const* data = nullptr;
    std::int64_t count = 0;
    DType dtype{};
    cudaEvent_t ready = nullptr;
    cudaEvent_t copied = nullptr;
    bool taken = false;
    ~PeerMessage() {
      if (ready != nullptr) MGPU_CUDA_CHECK_NO_THROW(cudaEventDestroy(ready));
      if (copied != nullptr) MGPU_CUDA_CHECK_NO_THROW(cudaEventDestroy(copied));
    }
  };

  struct Channel {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<PeerMessage*> queue;
  };

  Channel& channel(int from, int to) { return channels_[static_cast<std::size_t>(from * size() + to)]; }

  std::unique_ptr<PeerMessage> post_send(int rank, Call const& c, cudaStream_t stream) {
    state()->throw_if_aborted(c.name(rank));
    auto message = std::make_unique<PeerMessage>();
    message->data = c.send.data();
    message->count = c.count;
    message->dtype = c.dtype;
    MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&message->ready, cudaEventDisableTiming));
    MGPU_CUDA_CHECK(cudaEventRecord(message->ready, stream));
    Channel& ch = channel(rank, c.root);
    {
      std::lock_guard lock(ch.mutex);
      ch.queue.push_back(message.get());
    }
    ch.cv.notify_all();
    return message;
  }

  void withdraw(int rank, int peer, PeerMessage& message) noexcept {
    Channel& ch = channel(rank, peer);
    std::lock_guard lock(ch.mutex);
    std::erase(ch.queue, &message);
  }

  // Waits on the host until `ready()`, with the deadline; `waiting_for` names the other side.
  template <class Ready>
  void wait(Channel& ch, std::unique_lock<std::mutex>& lock, std::string const& what, std::string const& waiting_for,
            Ready const& ready) {
    auto const start = Clock::now();
    while (!ready()) {
      state()->throw_if_aborted(what);
      if (ch.cv.wait_until(lock, start + timeout()) == std::cv_status::timeout && !ready()) {
        std::string const message = what + " waited " + format_duration(Clock::now() - start) + " for " + waiting_for;
        lock.unlock();
        state()->abort(message);
        throw Error(Errc::timeout, message + " (expected it within the " + format_duration(timeout()) + " deadline)");
      }
    }
  }

  void await_taken(int rank, Call const& c, PeerMessage& message, cudaStream_t stream) {
    Channel& ch = channel(rank, c.root);
    std::unique_lock lock(ch.mutex);
    wait(ch, lock, c.name(rank), "rank " + std::to_string(c.root) + " to receive it", [&] { return message.taken; });
    MGPU_CUDA_CHECK(cudaStreamWaitEvent(stream, message.copied, 0));  // the buffer is free after the copy
  }

  void receive(int rank, Call const& c, cudaStream_t stream) {
    std::string const what = c.name(rank);
    Channel& ch = channel(c.root, rank);
    std::unique_lock lock(ch.mutex);
    wait(ch, lock, what, "rank " + std::to_string(c.root) + " to send", [&] { return !ch.queue.empty(); });
    PeerMessage* m = ch.queue.front();
    if (m->count != c.count || m->dtype != c.dtype) {
      std::string const message = what + ": rank " + std::to_string(c.root) + " sent " + std::to_string(m->count) + " " +
                                  std::string(mgpu::to_string(m->dtype)) + " elements, the recv takes " +
                                  std::to_string(c.count) + " " + std::string(mgpu::to_string(c.dtype)) +
                                  " (expected matching count and dtype)";
      lock.unlock();
      state()->abort(message);
      throw Error(Errc::invalid_argument, message);
    }
    ch.queue.pop_front();
    MGPU_CUDA_CHECK(cudaStreamWaitEvent(stream, m->ready, 0));
    if (c.count > 0) MGPU_CUDA_CHECK(cudaMemcpyAsync(c.recv.data(), m->data, c.recv.nbytes(), cudaMemcpyDefault, stream));
    MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&m->copied, cudaEventDisableTiming));
    MGPU_CUDA_CHECK(cudaEventRecord(m->copied, stream));
    m->taken = true;
    lock.unlock();
    ch.cv.notify_all();
  }

  void collective(int rank, Call const& c, cudaStream_t stream) {
    std::string const what = c.name(rank);
    state()->throw_if_aborted(what);
    RankEvents& mine = events_[static_cast<std::size_t>(rank)];
    MGPU_CUDA_CHECK(cudaEventRecord(mine.ready, stream));
    Post const post{c.kind, c.seq, c.count, c.dtype, c.op, c.root,
                    c.send.defined() ? c.send.data() : nullptr, c.recv.defined() ? c.recv.data() : nullptr};
    std::vector<Post> const& posts = meeting_.exchange(rank, post, what);
    int const n = size();
    for (int p = 0; p < n; ++p) {
      if (p != rank) MGPU_CUDA_CHECK(cudaStreamWaitEvent(stream, events_[static_cast<std::size_t>(p)].ready, 0));
    }
    compute(rank, c, posts, stream, what);
    MGPU_CUDA_CHECK(cudaEventRecord(mine.done, stream));
    (void)done_meeting_.exchange(rank, 0, what);
    for (int p = 0; p < n; ++p) {
      if (p != rank) MGPU_CUDA_CHECK(cudaStreamWaitEvent(stream, events_[static_cast<std::size_t>(p)].done, 0));
    }
  }

  void compute(int rank, Call const& c, std::vector<Post> const& posts, cudaStream_t stream, std::string const& what) {
    int const n = size();
    for (int p = 0; p < n; ++p) {
      Post const& other = posts[static_cast<std::size_t>(p)];
      if (other.kind != c.kind || other.count != c.count || other.dtype != c.dtype || other.op != c.op || other.root != c.root) {
        std::string const message = what + ": rank " + std::to_string(p) + " called " + std::string(to_string(other.kind)) +
                                    " with " + std::to_string(other.count) + " " + std::string(mgpu::to_string(other.dtype)) +
                                    " elements (expected the same operation, count, dtype, op and root on every rank)";
        state()->abort(message);
        throw Error(Errc::invalid_argument, message);
      }
    }
    if (c.count == 0) return;
    std::vector<void const*> inputs(static_cast<std::size_t>(n));
    std::vector<void*> outputs(static_cast<std::size_t>(n));
    for (int p = 0; p < n; ++p) {
      inputs[static_cast<std::size_t>(p)] = posts[static_cast<std::size_t>(p)].send;
      outputs[static_cast<std::size_t>(p)] = posts[static_cast<std::size_t>(p)].recv;
    }
    std::size_t const element = size_of(c.dtype);
    std::int64_t const base = c.count / n;
    std::int64_t const extra = c.count % n;
    std::int64_t const begin = rank * base + std::min<std::int64_t>(rank, extra);
    std::int64_t const end = begin + base + (rank < extra ? 1 : 0);
    switch (c.kind) {
      case OpKind::all_reduce:
        launch_reduce_slice(c.dtype, c.op, inputs.data(), n, outputs.data(), n, begin, end, stream);
        break;
      case OpKind::reduce:
        launch_reduce_slice(c.dtype, c.op, inputs.data(), n, &outputs[static_cast<std::size_t>(c.root)], 1, begin, end, stream);
        break;
      case OpKind::reduce_scatter: {
        for (int p = 0; p < n; ++p)
          inputs[static_cast<std::size_t>(p)] = static_cast<char const*>(inputs[static_cast<std::size_t>(p)]) + element * static_cast<std::size_t>(rank * c.count);
        void* out = c.recv.data();
        launch_reduce_slice(c.dtype, c.op, inputs.data(), n, &out, 1, 0, c.count, stream);
        break;
      }
      case OpKind::all_gather:
        for (int p = 0; p < n; ++p) {
          MGPU_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(c.recv.data()) + element * static_cast<std::size_t>(p * c.count),
                                          inputs[static_cast<std::size_t>(p)], element * static_cast<std::size_t>(c.count),
                                          cudaMemcpyDefault, stream));
        }
        break;
      case OpKind::broadcast:
        if (rank != c.root)
          MGPU_CUDA_CHECK(cudaMemcpyAsync(c.recv.data(), inputs[static_cast<std::size_t>(c.root)], c.recv.nbytes(),
                                          cudaMemcpyDefault, stream));
        break;
      default:
        break;
    }
  }

  std::vector<RankEvents> events_;
  std::vector<Channel> channels_;
  Meeting<Post> meeting_;
  Meeting<int> done_meeting_;
};

#if MGPU_NCCL_ENABLED
ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::bfloat16: return ncclBfloat16;
    case DType::float16: return ncclFloat16;
    case DType::float32: break;
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::avg: return ncclAvg;
    case ReduceOp::min: return ncclMin;
    case ReduceOp::max: return ncclMax;
    case ReduceOp::sum: break;
  }
  return ncclSum;
}

class NcclCommunicator final : public CommunicatorBase {
 public:
  NcclCommunicator(DeviceGroup& group, std::chrono::milliseconds timeout)
      : CommunicatorBase(group, Backend::nccl, timeout), comms_(static_cast<std::size_t>(group.size())) {
    std::vector<int> gpus;
    for (Device const d : group.devices()) gpus.push_back(d.index);
    MGPU_NCCL_CHECK(ncclCommInitAll(comms_.data(), group.size(), gpus.data()));
    state()->on_abort([this] {
      std::lock_guard lock(mutex_);
      abort_requested_ = true;
      cv_.notify_all();
    });
    watchdog_ = std::thread([this] { watch(); });
  }

  ~NcclCommunicator() override {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    watchdog_.join();
    for (ncclComm_t comm : comms_) {
      if (comm == nullptr) continue;
      if (aborted()) {
        (void)ncclCommAbort(comm);
      } else if (ncclCommDestroy(comm) != ncclSuccess) {
        (void)ncclCommAbort(comm);
      }
    }
  }

 protected:
  void check_device(int rank, Device device, std::string_view what, Call const& call) const override {
    check_cuda_device(group(), rank, device, what, call);
  }

  void launch(int rank, std::vector<Call> calls, Stream& stream) override {
    cudaStream_t const s = native(stream);
    ncclComm_t const comm = comms_[static_cast<std::size_t>(rank)];
    mgpu::detail::cuda::DeviceScope scope(group().device(rank).index);
    MGPU_NCCL_CHECK(ncclGroupStart());
    for (Call const& c : calls) {
      std::size_t const count = static_cast<std::size_t>(c.count);
      switch (c.kind) {
        case OpKind::all_reduce:
          MGPU_NCCL_CHECK(ncclAllReduce(c.send.data(), c.recv.data(), count, nccl_type(c.dtype), nccl_op(c.op), comm, s));
          break;
        case OpKind::reduce_scatter:
          MGPU_NCCL_CHECK(ncclReduceScatter(c.send.data(), c.recv.data(), count, nccl_type(c.dtype), nccl_op(c.op), comm, s));
          break;
        case OpKind::all_gather:
          MGPU_NCCL_CHECK(ncclAllGather(c.send.data(), c.recv.data(), count, nccl_type(c.dtype), comm, s));
          break;
        case OpKind::broadcast:
          MGPU_NCCL_CHECK(ncclBroadcast(c.send.data(), c.recv.data(), count, nccl_type(c.dtype), c.root, comm, s));
          break;
        case OpKind::reduce:
          MGPU_NCCL_CHECK(ncclReduce(c.send.data(), rank == c.root ? c.recv.data() : nullptr, count, nccl_type(c.dtype),
                                     nccl_op(c.op), c.root, comm, s));
          break;
        case OpKind::send:
          MGPU_NCCL_CHECK(ncclSend(c.send.data(), count, nccl_type(c.dtype), c.root, comm, s));
          break;
        case OpKind::recv:
          MGPU_NCCL_CHECK(ncclRecv(c.recv.data(), count, nccl_type(c.dtype), c.root, comm, s));
          break;
        case OpKind::barrier:
          MGPU_NCCL_CHECK(ncclAllReduce(barrier_word(rank), barrier_word(rank), 1, ncclFloat32, ncclSum, comm, s));
          break;
      }
    }
    MGPU_NCCL_CHECK(ncclGroupEnd());
    cudaEvent_t done = nullptr;
    MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    MGPU_CUDA_CHECK(cudaEventRecord(done, s));
    std::lock_guard lock(mutex_);
    pending_.push_back({done, rank, calls.front().name(rank), Clock::now() + timeout()});
    state()->begin_operation();
    cv_.notify_all();
  }

 private:
  struct Pending {
    cudaEvent_t done;
    int rank;
    std::string name;
    Clock::time_point deadline;
  };

  void* barrier_word(int rank) {
    std::lock_guard lock(mutex_);
    if (barrier_words_.empty()) barrier_words_.resize(comms_.size(), nullptr);
    void*& word = barrier_words_[static_cast<std::size_t>(rank)];
    if (word == nullptr) MGPU_CUDA_CHECK(cudaMalloc(&word, sizeof(float)));
    return word;
  }

  void watch() {
    std::unique_lock lock(mutex_);
    while (true) {
      cv_.wait_for(lock, std::chrono::milliseconds(10));
      if (abort_requested_ && !comms_aborted_) {
        for (ncclComm_t comm : comms_) (void)ncclCommAbort(comm);
        std::fill(comms_.begin(), comms_.end(), nullptr);
        comms_aborted_ = true;
      }
      for (auto it = pending_.begin(); it != pending_.end();) {
        cudaError_t const status = cudaEventQuery(it->done);
        ncclResult_t async = ncclSuccess;
        if (!comms_aborted_) (void)ncclCommGetAsyncError(comms_[static_cast<std::size_t>(it->rank)], &async);
        std::string failure;
        if (async != ncclSuccess) {
          failure = it->name + " failed: " + ncclGetErrorString(async);
        } else if (status != cudaSuccess && status != cudaErrorNotReady) {
          failure = it->name + " failed: " + cudaGetErrorString(status);
        } else if (status == cudaErrorNotReady && Clock::now() > it->deadline) {
          failure = it->name + " did not finish within the " + format_duration(timeout()) + " deadline";
        }
        if (status == cudaSuccess || !failure.empty() || comms_aborted_) {
          (void)cudaEventDestroy(it->done);
          it = pending_.erase(it);
          state()->end_operation();
          if (!failure.empty()) {
            lock.unlock();
            state()->abort(failure);
            lock.lock();
          }
        } else {
          ++it;
        }
      }
      if (stopping_ && pending_.empty()) break;
    }
    for (void* word : barrier_words_) {
      if (word != nullptr) (void)cudaFree(word);
    }
  }

  std::vector<ncclComm_t> comms_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Pending> pending_;
  std::vector<void*> barrier_words_;
  bool stopping_ = false;
  bool abort_requested_ = false;
  bool comms_aborted_ = false;
  std::thread watchdog_;
};
#endif

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(DeviceGroup& group, std::chrono::milliseconds timeout) {
#if MGPU_NCCL_ENABLED
  std::vector<int> gpus;
  for (Device const d : group.devices()) gpus.push_back(d.index);
  std::sort(gpus.begin(), gpus.end());
  if (std::adjacent_find(gpus.begin(), gpus.end()) != gpus.end())
    throw Error(Errc::invalid_argument, "the nccl backend for a group where ranks share a GPU (expected distinct GPUs; "
                                        "NCCL cannot have two ranks on one GPU, the cuda_peer backend can)");
  return std::make_unique<NcclCommunicator>(group, timeout);
#else
  (void)group;
  (void)timeout;
  throw Error(Errc::device, "the nccl backend: mgpu was built without NCCL (configure with MGPU_WITH_NCCL=ON)");
#endif
}

std::unique_ptr<Communicator> make_cuda_peer_communicator(DeviceGroup& group, std::chrono::milliseconds timeout) {
  return std::make_unique<CudaPeerCommunicator>(group, timeout);
}

}  // namespace mgpu::comm::detail
