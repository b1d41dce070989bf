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
// Both serve a whole group or a subset of its ranks (make_communicator(group, ranks)): rank i of
// the communicator runs on the i-th listed device.
//
// nccl: one NCCL communicator per rank, created together over the communicator's GPUs with a fresh
// unique id (a subset gets its own, beside the group's); operations run on the rank's stream.
// A watchdog thread polls each operation's completion event and ncclCommGetAsyncError, and aborts
// every rank's communicator (ncclCommAbort) when an operation passes its deadline or fails.
#include "comm/cuda_communicators.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <mgpu/comm/detail/reduce_slice.hpp>
#include <mgpu/config.hpp>
#include <mgpu/core/error.hpp>

#include "comm/base.hpp"
#include "core/buffer_internals.hpp"
#include "core/cuda_backend.hpp"
#include "core/cuda_device_scope.hpp"
#include "kernels/reduce.hpp"

#if MGPU_NCCL_ENABLED
#include <nccl.h>
#endif

namespace mgpu::comm::detail {
namespace {

using Clock = std::chrono::steady_clock;

cudaStream_t native(Stream& stream) { return static_cast<cudaStream_t>(stream.native_handle()); }

// The devices of the group's `ranks`, in order: communicator rank i runs on the i-th.
std::vector<Device> devices_of(DeviceGroup const& group, std::vector<int> const& ranks) {
  std::vector<Device> devices;
  for (int const r : ranks) devices.push_back(group.device(r));
  return devices;
}

// `devices[rank]` is the communicator rank's device (the group's rank it stands for).
void check_cuda_device(std::vector<Device> const& devices, int rank, Device device, std::string_view what, Call const& call) {
  Device const own = devices[static_cast<std::size_t>(rank)];
  if (device != own)
    throw Error(Errc::invalid_argument, call.name(rank) + ": " + std::string(what) + " is on " + device.to_string() +
                                            " (expected the rank's own device, " + own.to_string() + ")");
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
  cudaEvent_t last = nullptr;  // after the rank's latest operation, for finalize()
};

class CudaPeerCommunicator final : public CommunicatorBase {
 public:
  // Rank i runs on devices[i] (the group's rank it stands for).
  CudaPeerCommunicator(DeviceGroup& group, std::vector<Device> devices, std::chrono::milliseconds timeout)
      : CommunicatorBase(group, static_cast<int>(devices.size()), Backend::cuda_peer, timeout),
        devices_(std::move(devices)),
        events_(devices_.size()),
        channels_(devices_.size() * devices_.size()),
        meeting_(size(), *state()),
        done_meeting_(size(), *state()) {
    if (size() > max_reduce_ranks)
      throw Error(Errc::invalid_argument, "a cuda_peer communicator over " + std::to_string(size()) +
                                              " ranks (expected at most " + std::to_string(max_reduce_ranks) + ")");
    auto const peers = peer_access_matrix(devices_);
    for (Channel& ch : channels_) ch.word = mgpu::detail::cuda::host_word_create();
    for (int r = 0; r < size(); ++r) {
      int const gpu = devices_[static_cast<std::size_t>(r)].index;
      mgpu::detail::cuda::DeviceScope scope(gpu);
      RankEvents& e = events_[static_cast<std::size_t>(r)];
      MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&e.ready, cudaEventDisableTiming));
      MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&e.done, cudaEventDisableTiming));
      MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&e.last, cudaEventDisableTiming));
      for (int p = 0; p < size(); ++p) {
        int const other = devices_[static_cast<std::size_t>(p)].index;
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
        {
          // Releases the senders' streams still waiting for a receive that will not come (their
          // data is not delivered; the abort reports it).
          std::lock_guard lock(ch.mutex);
          std::atomic_ref(*ch.word).store(static_cast<std::uint32_t>(ch.posted + 1), std::memory_order_release);
        }
        ch.cv.notify_all();
      }
    });
  }

  ~CudaPeerCommunicator() override {
    for (auto& e : events_) {
      for (cudaEvent_t event : {e.ready, e.done, e.last}) {
        if (event != nullptr) MGPU_CUDA_CHECK_NO_THROW(cudaEventDestroy(event));
      }
    }
    for (Channel& ch : channels_) {
      if (ch.word != nullptr) mgpu::detail::cuda::host_word_destroy(ch.word);
    }
  }

 protected:
  void check_device(int rank, Device device, std::string_view what, Call const& call) const override {
    check_cuda_device(devices_, rank, device, what, call);
  }

  void launch(int rank, std::vector<Call> calls, Stream& stream) override {
    state()->begin_operation();
    struct Done {
      SharedState& s;
      ~Done() { s.end_operation(); }
    } done{*state()};
    mgpu::detail::cuda::DeviceScope scope(devices_[static_cast<std::size_t>(rank)].index);
    cudaStream_t const s = native(stream);
    // Sends are posted first and never block this thread (the stream waits for the receiver's
    // copy), so a group's sends and receives cannot block each other.
    bool posted = false;
    try {
      for (Call const& c : calls) {
        if (c.kind == OpKind::send) {
          post_send(rank, c, stream);
          posted = true;
        }
      }
      for (Call const& c : calls) {
        if (c.kind == OpKind::recv) {
          receive(rank, c, stream);
        } else if (c.kind != OpKind::send) {
          collective(rank, c, stream);
        }
      }
      MGPU_CUDA_CHECK(cudaEventRecord(events_[static_cast<std::size_t>(rank)].last, s));
    } catch (Error const& e) {
      // A receiver may still wait for the rest of the group, or a posted send for a receiver.
      if (posted) state()->abort(calls.front().name(rank) + " failed after posting its sends: " + e.what());
      throw;
    }
  }

  void finish_device_work(std::chrono::milliseconds limit) override {
    auto const deadline = Clock::now() + limit;
    // Every posted send must have been received: until then its sender's stream waits.
    for (int from = 0; from < size(); ++from) {
      for (int to = 0; to < size(); ++to) {
        Channel& ch = channel(from, to);
        std::unique_lock lock(ch.mutex);
        if (!ch.cv.wait_until(lock, deadline, [&] { return ch.taken == ch.posted || state()->aborted(); })) {
          std::string const message = "finalize waited " + format_duration(limit) + " for rank " + std::to_string(to) +
                                      " to receive " + std::to_string(ch.posted - ch.taken) + " message(s) from rank " +
                                      std::to_string(from);
          lock.unlock();
          state()->abort(message);
          return;
        }
      }
    }
    // Then the GPUs: each rank's latest operation has finished.
    for (int r = 0; r < size() && !state()->aborted(); ++r) {
      mgpu::detail::cuda::DeviceScope scope(devices_[static_cast<std::size_t>(r)].index);
      while (true) {
        cudaError_t const status = cudaEventQuery(events_[static_cast<std::size_t>(r)].last);
        if (status == cudaSuccess) break;
        if (status != cudaErrorNotReady) {
          state()->abort("finalize: rank " + std::to_string(r) + "'s operations failed on the GPU: " + cudaGetErrorString(status));
          return;
        }
        if (Clock::now() > deadline) {
          state()->abort("finalize waited " + format_duration(limit) + " for rank " + std::to_string(r) +
                         "'s operations to finish on the GPU");
          return;
        }
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
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

  // A send waiting for its receive.
  struct PeerMessage {
    void const* data = nullptr;
    std::int64_t count = 0;
    DType dtype{};
    std::uint64_t seq = 0;  // the sender's n-th send to this receiver
    cudaEvent_t ready = nullptr;
    PeerMessage() = default;
    PeerMessage(PeerMessage const&) = delete;
    PeerMessage& operator=(PeerMessage const&) = delete;
    ~PeerMessage() {
      // Safe while a stream still waits on it: CUDA releases it once it has completed.
      if (ready != nullptr) MGPU_CUDA_CHECK_NO_THROW(cudaEventDestroy(ready));
    }
  };

  // One direction between two ranks. The receiver's stream raises `word` to a message's seq + 1
  // once its copy has run; the sender's stream waits for that, so neither host thread waits for
  // the other side's GPU work.
  struct Channel {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<std::unique_ptr<PeerMessage>> queue;
    std::uint32_t* word = nullptr;  // page-locked, readable and writable by the GPUs
    std::uint64_t posted = 0;
    std::uint64_t taken = 0;
  };

  Channel& channel(int from, int to) { return channels_[static_cast<std::size_t>(from * size() + to)]; }

  void post_send(int rank, Call const& c, Stream& stream) {
    state()->throw_if_aborted(c.name(rank));
    cudaStream_t const s = native(stream);
    auto message = std::make_unique<PeerMessage>();
    message->data = c.send.data();
    message->count = c.count;
    message->dtype = c.dtype;
    message->seq = c.seq;
    MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&message->ready, cudaEventDisableTiming));
    MGPU_CUDA_CHECK(cudaEventRecord(message->ready, s));
    Channel& ch = channel(rank, c.root);
    {
      std::lock_guard lock(ch.mutex);
      ch.queue.push_back(std::move(message));
      ++ch.posted;
    }
    ch.cv.notify_all();
    // The send buffer may be reused once the receiver's copy has run: the stream waits for that.
    mgpu::detail::cuda::stream_wait_word(s, ch.word, static_cast<std::uint32_t>(c.seq + 1));
    mgpu::detail::release_after(stream, c.send);
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

  void receive(int rank, Call const& c, Stream& stream) {
    std::string const what = c.name(rank);
    cudaStream_t const s = native(stream);
    Channel& ch = channel(c.root, rank);
    std::unique_lock lock(ch.mutex);
    wait(ch, lock, what, "rank " + std::to_string(c.root) + " to send", [&] { return !ch.queue.empty(); });
    PeerMessage const& m = *ch.queue.front();
    if (m.count != c.count || m.dtype != c.dtype) {
      std::string const message = what + ": rank " + std::to_string(c.root) + " sent " + std::to_string(m.count) + " " +
                                  std::string(mgpu::to_string(m.dtype)) + " elements, the recv takes " +
                                  std::to_string(c.count) + " " + std::string(mgpu::to_string(c.dtype)) +
                                  " (expected matching count and dtype)";
      lock.unlock();
      state()->abort(message);
      throw Error(Errc::invalid_argument, message);
    }
    std::unique_ptr<PeerMessage> const taken = std::move(ch.queue.front());
    ch.queue.pop_front();
    ++ch.taken;
    MGPU_CUDA_CHECK(cudaStreamWaitEvent(s, taken->ready, 0));
    if (c.count > 0) MGPU_CUDA_CHECK(cudaMemcpyAsync(c.recv.data(), taken->data, c.recv.nbytes(), cudaMemcpyDefault, s));
    mgpu::detail::cuda::stream_write_word(s, ch.word, static_cast<std::uint32_t>(taken->seq + 1));
    mgpu::detail::release_after(stream, c.recv);
    lock.unlock();
    ch.cv.notify_all();
  }

  void collective(int rank, Call const& c, Stream& stream) {
    std::string const what = c.name(rank);
    state()->throw_if_aborted(what);
    cudaStream_t const s = native(stream);
    RankEvents& mine = events_[static_cast<std::size_t>(rank)];
    MGPU_CUDA_CHECK(cudaEventRecord(mine.ready, s));
    Post const post{c.kind, c.seq, c.count, c.dtype, c.op, c.root,
                    c.send.defined() ? c.send.data() : nullptr, c.recv.defined() ? c.recv.data() : nullptr};
    std::vector<Post> const& posts = meeting_.exchange(rank, post, what);
    int const n = size();
    for (int p = 0; p < n; ++p) {
      if (p != rank) MGPU_CUDA_CHECK(cudaStreamWaitEvent(s, events_[static_cast<std::size_t>(p)].ready, 0));
    }
    compute(rank, c, posts, s, what);
    MGPU_CUDA_CHECK(cudaEventRecord(mine.done, s));
    (void)done_meeting_.exchange(rank, 0, what);
    for (int p = 0; p < n; ++p) {
      if (p != rank) MGPU_CUDA_CHECK(cudaStreamWaitEvent(s, events_[static_cast<std::size_t>(p)].done, 0));
    }
    // The stream is now past every rank's reads and writes of this rank's buffers.
    mgpu::detail::release_after(stream, c.send, c.recv);
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
        kernels::reduce_slice(c.dtype, c.op, inputs.data(), n, outputs.data(), n, begin, end, stream);
        break;
      case OpKind::reduce:
        kernels::reduce_slice(c.dtype, c.op, inputs.data(), n, &outputs[static_cast<std::size_t>(c.root)], 1, begin, end, stream);
        break;
      case OpKind::reduce_scatter: {
        for (int p = 0; p < n; ++p)
          inputs[static_cast<std::size_t>(p)] = static_cast<char const*>(inputs[static_cast<std::size_t>(p)]) + element * static_cast<std::size_t>(rank * c.count);
        void* out = c.recv.data();
        kernels::reduce_slice(c.dtype, c.op, inputs.data(), n, &out, 1, 0, c.count, stream);
        break;
      }
      case OpKind::all_gather:
        for (int p = 0; p < n; ++p) {
          void* const to = static_cast<char*>(c.recv.data()) + element * static_cast<std::size_t>(p * c.count);
          if (to == inputs[static_cast<std::size_t>(p)]) continue;  // in place: already there
          MGPU_CUDA_CHECK(cudaMemcpyAsync(to, inputs[static_cast<std::size_t>(p)], element * static_cast<std::size_t>(c.count),
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

  std::vector<Device> devices_;
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
    case DType::int32: return ncclInt32;
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

// Polls a non-blocking communicator until its last call has finished: ncclSuccess, or throws
// Error(communication) for a failure and Error(timeout) past `deadline`. `stop` ends the wait early
// (the communicator is being aborted) with Error(communication).
template <class Stop>
void wait_for_nccl(ncclComm_t comm, std::string const& what, Clock::time_point deadline, Stop const& stop) {
  while (true) {
    ncclResult_t state = ncclSuccess;
    ncclResult_t const status = ncclCommGetAsyncError(comm, &state);
    if (status != ncclSuccess) state = status;
    if (state == ncclSuccess) return;
    if (state != ncclInProgress)
      throw Error(Errc::communication, what + " failed: " + mgpu::detail::cuda::nccl_error_string(static_cast<int>(state)));
    if (stop()) throw Error(Errc::communication, what + " was interrupted: the communicator is being aborted");
    if (Clock::now() > deadline) throw Error(Errc::timeout, what + " did not finish within its deadline (a rank that never called it?)");
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

// Non-blocking NCCL communicators (config.blocking = 0): no NCCL call waits for the other ranks, so
// a rank that never arrives becomes a deadline this code sees, and ncclCommAbort can end it.
// Operations are checked by a watchdog thread (completion events, ncclCommGetAsyncError); on a
// deadline or an error it aborts every rank's communicator, after any launch in progress has left
// NCCL (launches poll with their own deadline and stop when an abort is requested).
class NcclCommunicator final : public CommunicatorBase {
 public:
  // Rank i runs on devices[i] (distinct GPUs): a new NCCL communicator over just these GPUs, with
  // its own unique id, so subsets of a group's ranks (e.g. one pipeline stage across data-parallel
  // replicas) get their own, beside the group's.
  NcclCommunicator(DeviceGroup& group, std::vector<Device> devices, std::chrono::milliseconds timeout)
      : CommunicatorBase(group, static_cast<int>(devices.size()), Backend::nccl, timeout),
        devices_(std::move(devices)),
        comms_(devices_.size(), nullptr) {
    ncclUniqueId id{};
    MGPU_NCCL_CHECK(ncclGetUniqueId(&id));
    // Every local rank's init in one group, as NCCL requires when one thread creates them all.
    MGPU_NCCL_CHECK(ncclGroupStart());
    ncclResult_t failed = ncclSuccess;
    for (int r = 0; r < size() && failed == ncclSuccess; ++r) {
      mgpu::detail::cuda::DeviceScope scope(devices_[static_cast<std::size_t>(r)].index);
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 0;
      ncclResult_t const status = ncclCommInitRankConfig(&comms_[static_cast<std::size_t>(r)], size(), id, r, &config);
      if (status != ncclSuccess && status != ncclInProgress) failed = status;
    }
    ncclResult_t const ended = ncclGroupEnd();  // closes the group whatever happened inside it
    if (failed == ncclSuccess && ended != ncclSuccess && ended != ncclInProgress) failed = ended;
    try {
      if (failed != ncclSuccess)
        throw Error(Errc::communication, "creating the NCCL communicators failed: " +
                                             mgpu::detail::cuda::nccl_error_string(static_cast<int>(failed)));
      auto const deadline = Clock::now() + timeout;
      for (int r = 0; r < size(); ++r)
        wait_for_nccl(comms_[static_cast<std::size_t>(r)], "creating rank " + std::to_string(r) + "'s NCCL communicator", deadline,
                      [] { return false; });
    } catch (...) {
      for (ncclComm_t comm : comms_) {
        if (comm != nullptr) (void)ncclCommAbort(comm);
      }
      throw;
    }
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
    if (comms_aborted_) return;
    // ncclCommFinalize flushes each communicator's operations; being non-blocking, every rank's
    // call returns at once, so one thread finalizes them all. A communicator that does not finalize
    // in time is aborted instead of destroyed.
    bool finalized = !aborted();
    if (finalized) {
      for (ncclComm_t comm : comms_) {
        ncclResult_t const status = ncclCommFinalize(comm);
        finalized = finalized && (status == ncclSuccess || status == ncclInProgress);
      }
      auto const deadline = Clock::now() + timeout();
      try {
        for (ncclComm_t comm : comms_) wait_for_nccl(comm, "ncclCommFinalize", deadline, [] { return false; });
      } catch (...) {
        finalized = false;
      }
    }
    for (ncclComm_t comm : comms_) {
      if (!finalized || ncclCommDestroy(comm) != ncclSuccess) (void)ncclCommAbort(comm);
    }
  }

 protected:
  void check_device(int rank, Device device, std::string_view what, Call const& call) const override {
    check_cuda_device(devices_, rank, device, what, call);
  }

  void launch(int rank, std::vector<Call> calls, Stream& stream) override {
    std::string const what = calls.front().name(rank);
    cudaStream_t const s = native(stream);
    ncclComm_t comm = nullptr;
    {
      // The watchdog aborts (and frees) the communicators only while no launch is inside NCCL.
      std::lock_guard lock(mutex_);
      if (abort_requested_ || comms_aborted_) {
        state()->throw_if_aborted(what);
        throw Error(Errc::communication, what + ": the communicator is being aborted");
      }
      comm = comms_[static_cast<std::size_t>(rank)];
      ++launching_;
    }
    struct Leave {
      NcclCommunicator& self;
      ~Leave() {
        {
          std::lock_guard lock(self.mutex_);
          --self.launching_;
        }
        self.cv_.notify_all();
      }
    } leave{*this};
    mgpu::detail::cuda::DeviceScope scope(devices_[static_cast<std::size_t>(rank)].index);
    void* const barrier = barrier_word(rank, calls);
    MGPU_NCCL_CHECK(ncclGroupStart());
    ncclResult_t failed = ncclSuccess;
    for (Call const& c : calls) {
      ncclResult_t const status = enqueue(rank, c, comm, s, barrier);
      if (status != ncclSuccess && status != ncclInProgress) {
        failed = status;
        break;
      }
    }
    ncclResult_t const ended = ncclGroupEnd();  // always closes the group, also after a failed call
    if (failed == ncclSuccess && ended != ncclSuccess && ended != ncclInProgress) failed = ended;
    try {
      if (failed != ncclSuccess)
        throw Error(Errc::communication, what + " failed: " + mgpu::detail::cuda::nccl_error_string(static_cast<int>(failed)));
      // Non-blocking: the operations are on the stream once the communicator is no longer in progress.
      wait_for_nccl(comm, what, Clock::now() + timeout(), [this] { return state()->aborted(); });
    } catch (Error const& e) {
      state()->abort(e.what());
      throw;
    }
    cudaEvent_t done = nullptr;
    MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    MGPU_CUDA_CHECK(cudaEventRecord(done, s));
    // NCCL touches each rank's buffers only from that rank's stream: they are reused after it.
    for (Call const& c : calls) mgpu::detail::release_after(stream, c.send, c.recv);
    std::lock_guard lock(mutex_);
    pending_.push_back({done, rank, what, Clock::now() + timeout()});
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

  static ncclResult_t enqueue(int rank, Call const& c, ncclComm_t comm, cudaStream_t s, void* barrier) {
    std::size_t const count = static_cast<std::size_t>(c.count);
    switch (c.kind) {
      case OpKind::all_reduce:
        return ncclAllReduce(c.send.data(), c.recv.data(), count, nccl_type(c.dtype), nccl_op(c.op), comm, s);
      case OpKind::reduce_scatter:
        return ncclReduceScatter(c.send.data(), c.recv.data(), count, nccl_type(c.dtype), nccl_op(c.op), comm, s);
      case OpKind::all_gather:
        return ncclAllGather(c.send.data(), c.recv.data(), count, nccl_type(c.dtype), comm, s);
      case OpKind::broadcast:
        return ncclBroadcast(c.send.data(), c.recv.data(), count, nccl_type(c.dtype), c.root, comm, s);
      case OpKind::reduce:
        return ncclReduce(c.send.data(), rank == c.root ? c.recv.data() : nullptr, count, nccl_type(c.dtype), nccl_op(c.op),
                          c.root, comm, s);
      case OpKind::send:
        return ncclSend(c.send.data(), count, nccl_type(c.dtype), c.root, comm, s);
      case OpKind::recv:
        return ncclRecv(c.recv.data(), count, nccl_type(c.dtype), c.root, comm, s);
      case OpKind::barrier:
        return ncclAllReduce(barrier, barrier, 1, ncclFloat32, ncclSum, comm, s);
    }
    return ncclInvalidArgument;
  }

  // The rank's one-word buffer for barriers (made on first use), or nullptr when `calls` has none.
  void* barrier_word(int rank, std::vector<Call> const& calls) {
    if (std::none_of(calls.begin(), calls.end(), [](Call const& c) { return c.kind == OpKind::barrier; })) return nullptr;
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
      if (abort_requested_ && !comms_aborted_ && launching_ == 0) {
        for (ncclComm_t comm : comms_) (void)ncclCommAbort(comm);
        comms_aborted_ = true;
      }
      for (auto it = pending_.begin(); it != pending_.end();) {
        cudaError_t const status = cudaEventQuery(it->done);
        ncclResult_t async = ncclSuccess;
        if (!comms_aborted_) (void)ncclCommGetAsyncError(comms_[static_cast<std::size_t>(it->rank)], &async);
        std::string failure;
        if (async != ncclSuccess && async != ncclInProgress) {
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
      if (stopping_ && pending_.empty() && (launching_ == 0)) break;
    }
    for (void* word : barrier_words_) {
      if (word != nullptr) (void)cudaFree(word);
    }
  }

  std::vector<Device> devices_;
  std::vector<ncclComm_t> comms_;  // freed by ncclCommAbort once comms_aborted_ is set
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Pending> pending_;
  std::vector<void*> barrier_words_;
  int launching_ = 0;  // launches between taking a communicator and leaving NCCL
  bool stopping_ = false;
  bool abort_requested_ = false;
  bool comms_aborted_ = false;
  std::thread watchdog_;
};
#endif

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(DeviceGroup& group, std::vector<int> const& ranks, std::chrono::milliseconds timeout) {
#if MGPU_NCCL_ENABLED
  std::vector<Device> const devices = devices_of(group, ranks);
  std::vector<int> gpus;
  for (Device const d : devices) gpus.push_back(d.index);
  std::sort(gpus.begin(), gpus.end());
  if (std::adjacent_find(gpus.begin(), gpus.end()) != gpus.end())
    throw Error(Errc::invalid_argument, "the nccl backend for a group where ranks share a GPU (expected distinct GPUs; "
                                        "NCCL cannot have two ranks on one GPU, the cuda_peer backend can)");
  return std::make_unique<NcclCommunicator>(group, devices, timeout);
#else
  (void)group;
  (void)ranks;
  (void)timeout;
  throw Error(Errc::device, "the nccl backend: mgpu was built without NCCL (configure with MGPU_WITH_NCCL=ON)");
#endif
}

std::unique_ptr<Communicator> make_cuda_peer_communicator(DeviceGroup& group, std::vector<int> const& ranks,
                                                          std::chrono::milliseconds timeout) {
  return std::make_unique<CudaPeerCommunicator>(group, devices_of(group, ranks), timeout);
}

}  // namespace mgpu::comm::detail
