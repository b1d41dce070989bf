// The nccl backend: one NCCL communicator per rank, created together over the communicator's GPUs
// with a fresh unique id (a subset gets its own, beside the group's); operations run on the rank's
// stream. A watchdog thread polls each operation's completion event and ncclCommGetAsyncError,
// and aborts every rank's communicator (ncclCommAbort) when an operation passes its deadline or
// fails. Rank i of the communicator runs on the i-th listed device (a whole group or a subset).
// Across processes, each process creates the communicators of its own ranks (a contiguous range of
// the world's) with a unique id every process was given, and drives only those.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <deque>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <mgpu/config.hpp>
#include <mgpu/core/error.hpp>

#include "comm/base.hpp"
#include "comm/cuda_common.hpp"
#include "comm/cuda_communicators.hpp"
#include "core/backend.hpp"
#include "core/cuda_device_scope.hpp"

#if MGPU_NCCL_ENABLED
#include <nccl.h>
#endif

namespace mgpu::comm::detail {
#if MGPU_NCCL_ENABLED
namespace {

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
  // A launch is usually on the stream within microseconds: the first 200 us only yield the CPU,
  // then sleeps double from 10 us up to 1 ms (a longer wait is a slow peer or a deadline).
  auto const start = Clock::now();
  auto pause = std::chrono::microseconds(10);
  while (true) {
    ncclResult_t state = ncclSuccess;
    ncclResult_t const status = ncclCommGetAsyncError(comm, &state);
    if (status != ncclSuccess) state = status;
    if (state == ncclSuccess) return;
    if (state != ncclInProgress)
      throw Error(Errc::communication, what + " failed: " + mgpu::detail::cuda::nccl_error_string(static_cast<int>(state)));
    if (stop()) throw Error(Errc::communication, what + " was interrupted: the communicator is being aborted");
    auto const now = Clock::now();
    if (now > deadline) throw Error(Errc::timeout, what + " did not finish within its deadline (a rank that never called it?)");
    if (now - start < std::chrono::microseconds(200)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
  }
}

// Calls `fn` (ncclCommFinalize, ncclCommDestroy or ncclCommAbort) on every communicator in one
// group, as NCCL asks of one thread that manages several; the first failure, else the group's
// status. A communicator `fn` failed on is not used again by the caller.
template <class Fn>
ncclResult_t for_each_comm_in_group(std::vector<ncclComm_t> const& comms, Fn const& fn) noexcept {
  ncclResult_t failed = ncclGroupStart();
  if (failed != ncclSuccess) return failed;
  for (ncclComm_t comm : comms) {
    ncclResult_t const status = fn(comm);
    if (failed == ncclSuccess && status != ncclSuccess && status != ncclInProgress) failed = status;
  }
  ncclResult_t const ended = ncclGroupEnd();  // always closes the group
  if (failed == ncclSuccess && ended != ncclSuccess && ended != ncclInProgress) failed = ended;
  return failed;
}

// Non-blocking NCCL communicators (config.blocking = 0): no NCCL call waits for the other ranks, so
// a rank that never arrives becomes a deadline this code sees, and ncclCommAbort can end it.
// Operations are checked by a watchdog thread (completion events, ncclCommGetAsyncError); on a
// deadline or an error it aborts every rank's communicator, after any launch in progress has left
// NCCL (launches poll with their own deadline and stop when an abort is requested).
class NcclCommunicator final : public CommunicatorBase {
 public:
  // Of `size` ranks, this process drives first_rank + i on devices[i] (distinct GPUs), every process
  // with the same `id`. Within one process (first_rank 0, size = the devices) a fresh id makes a new
  // NCCL communicator over just these GPUs, so subsets of a group's ranks (e.g. one pipeline stage
  // across data-parallel replicas) get their own, beside the group's.
  NcclCommunicator(DeviceGroup& group, int size, int first_rank, std::vector<Device> devices, ncclUniqueId const& id,
                   std::chrono::milliseconds timeout)
      : CommunicatorBase(group, size, Backend::nccl, timeout),
        first_(first_rank),
        devices_(std::move(devices)),
        comms_(devices_.size(), nullptr),
        spare_events_(devices_.size()) {
    // Every local rank's init in one group, as NCCL requires when one thread creates them all.
    MGPU_NCCL_CHECK(ncclGroupStart());
    ncclResult_t failed = ncclSuccess;
    for (int l = 0; l < local_size() && failed == ncclSuccess; ++l) {
      mgpu::detail::cuda::DeviceScope scope(devices_[static_cast<std::size_t>(l)].index);
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 0;
      ncclResult_t const status =
          ncclCommInitRankConfig(&comms_[static_cast<std::size_t>(l)], size, id, first_ + l, &config);
      if (status != ncclSuccess && status != ncclInProgress) failed = status;
    }
    ncclResult_t const ended = ncclGroupEnd();  // closes the group whatever happened inside it
    if (failed == ncclSuccess && ended != ncclSuccess && ended != ncclInProgress) failed = ended;
    try {
      if (failed != ncclSuccess)
        throw Error(Errc::communication, "creating the NCCL communicators failed: " +
                                             mgpu::detail::cuda::nccl_error_string(static_cast<int>(failed)));
      auto const deadline = Clock::now() + timeout;
      for (int l = 0; l < local_size(); ++l)
        wait_for_nccl(comms_[static_cast<std::size_t>(l)],
                      "creating rank " + std::to_string(first_ + l) + "'s NCCL communicator", deadline,
                      [] { return false; });
    } catch (...) {
      std::vector<ncclComm_t> created;
      std::copy_if(comms_.begin(), comms_.end(), std::back_inserter(created), [](ncclComm_t comm) { return comm != nullptr; });
      (void)for_each_comm_in_group(created, ncclCommAbort);
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
    // Operations in flight finish (or the communicators are aborted) while the wakers can still
    // reach this object; after this no abort calls into it.
    shut_down();
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    watchdog_.join();
    if (comms_aborted_) return;
    // ncclCommFinalize flushes each communicator's operations; being non-blocking, every rank's
    // call returns at once, so one thread finalizes them all. Communicators that do not finalize in
    // time are aborted instead of destroyed. A failed ncclCommDestroy may have freed its
    // communicator: it is reported, never followed by an abort of the same communicator.
    bool finalized = !aborted() && for_each_comm_in_group(comms_, ncclCommFinalize) == ncclSuccess;
    if (finalized) {
      auto const deadline = Clock::now() + timeout();
      try {
        for (ncclComm_t comm : comms_) wait_for_nccl(comm, "ncclCommFinalize", deadline, [] { return false; });
      } catch (Error const&) {
        finalized = false;
      }
    }
    if (!finalized) {
      (void)for_each_comm_in_group(comms_, ncclCommAbort);
    } else if (ncclResult_t const status = for_each_comm_in_group(comms_, ncclCommDestroy); status != ncclSuccess) {
      std::fprintf(stderr, "mgpu: destroying the NCCL communicators failed: %s\n",
                   mgpu::detail::cuda::nccl_error_string(static_cast<int>(status)).c_str());
    }
  }

  [[nodiscard]] int first_rank() const noexcept override { return first_; }

 protected:
  [[nodiscard]] bool drives(int rank) const noexcept override { return rank >= first_ && rank < first_ + local_size(); }

  void check_device(int rank, Device device, std::string_view what, Call const& call) const override {
    if (!drives(rank))
      throw Error(Errc::invalid_argument, call.name(rank) + ": rank " + std::to_string(rank) +
                                              " belongs to another process (expected a rank this process drives, " +
                                              std::to_string(first_) + " to " + std::to_string(first_ + local_size() - 1) +
                                              ")");
    Device const own = devices_[static_cast<std::size_t>(rank - first_)];
    if (device != own)
      throw Error(Errc::invalid_argument, call.name(rank) + ": " + std::string(what) + " is on " + device.to_string() +
                                              " (expected the rank's own device, " + own.to_string() + ")");
  }

  void launch(int rank, std::vector<Call> calls, Stream& stream) override {
    std::string const what = calls.front().name(rank);
    std::size_t const l = static_cast<std::size_t>(rank - first_);
    cudaStream_t const s = native(stream);
    ncclComm_t comm = nullptr;
    {
      // The watchdog aborts (and frees) the communicators only while no launch is inside NCCL.
      std::lock_guard lock(mutex_);
      if (abort_requested_ || comms_aborted_) {
        state()->throw_if_aborted(what);
        throw Error(Errc::communication, what + ": the communicator is being aborted");
      }
      comm = comms_[l];
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
    mgpu::detail::cuda::DeviceScope scope(devices_[l].index);
    void* const barrier = barrier_word(l, calls);
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
      try {
        // NCCL may have put some of the operations on the stream: their buffers are reused only
        // after them (the abort ends them).
        for (Call const& c : calls) mgpu::detail::release_after(stream, c.send, c.recv);
      } catch (Error const&) {  // the GPU fails too: the first error says more
      }
      throw;
    }
    // NCCL touches each rank's buffers only from that rank's stream: they are reused after it.
    for (Call const& c : calls) mgpu::detail::release_after(stream, c.send, c.recv);
    cudaEvent_t done = nullptr;
    {
      std::lock_guard lock(mutex_);
      if (auto& spare = spare_events_[l]; !spare.empty()) {
        done = spare.back();
        spare.pop_back();
      }
    }
    if (done == nullptr) MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    cudaError_t const recorded = cudaEventRecord(done, s);
    std::lock_guard lock(mutex_);
    if (recorded != cudaSuccess) {
      spare_events_[l].push_back(done);
      MGPU_CUDA_CHECK(recorded);
    }
    pending_.push_back({done, l, what, Clock::now() + timeout()});
    state()->begin_operation();
    cv_.notify_all();
  }

 private:
  struct Pending {
    cudaEvent_t done;
    std::size_t local;  // the rank's index among this process's
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

  [[nodiscard]] int local_size() const noexcept { return static_cast<int>(devices_.size()); }

  // The local rank's one-word buffer for barriers (made on first use), or nullptr when `calls` has none.
  void* barrier_word(std::size_t local, std::vector<Call> const& calls) {
    if (std::none_of(calls.begin(), calls.end(), [](Call const& c) { return c.kind == OpKind::barrier; })) return nullptr;
    std::lock_guard lock(mutex_);
    if (barrier_words_.empty()) barrier_words_.resize(comms_.size(), nullptr);
    void*& word = barrier_words_[local];
    if (word == nullptr) MGPU_CUDA_CHECK(cudaMalloc(&word, sizeof(float)));
    return word;
  }

  void watch() {
    std::unique_lock lock(mutex_);
    while (true) {
      cv_.wait_for(lock, std::chrono::milliseconds(10));
      if (abort_requested_ && !comms_aborted_ && launching_ == 0) {
        (void)for_each_comm_in_group(comms_, ncclCommAbort);
        comms_aborted_ = true;
      }
      for (auto it = pending_.begin(); it != pending_.end();) {
        cudaError_t const status = cudaEventQuery(it->done);
        ncclResult_t async = ncclSuccess;
        if (!comms_aborted_) (void)ncclCommGetAsyncError(comms_[it->local], &async);
        std::string failure;
        if (async != ncclSuccess && async != ncclInProgress) {
          failure = it->name + " failed: " + ncclGetErrorString(async);
        } else if (status != cudaSuccess && status != cudaErrorNotReady) {
          failure = it->name + " failed: " + cudaGetErrorString(status);
        } else if (status == cudaErrorNotReady && Clock::now() > it->deadline) {
          failure = it->name + " did not finish within the " + format_duration(timeout()) + " deadline";
        }
        if (status == cudaSuccess || !failure.empty() || comms_aborted_) {
          // Kept for the rank's next launch (recording it again is fine even if work before it
          // never finishes: only the watchdog queries it).
          spare_events_[it->local].push_back(it->done);
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
    for (auto const& events : spare_events_) {
      for (cudaEvent_t event : events) (void)cudaEventDestroy(event);
    }
  }

  int first_;                      // the first rank this process drives
  std::vector<Device> devices_;    // per local rank
  std::vector<ncclComm_t> comms_;  // per local rank  // freed by ncclCommAbort once comms_aborted_ is set
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Pending> pending_;
  std::vector<std::vector<cudaEvent_t>> spare_events_;  // per local rank: completion events to record again
  std::vector<void*> barrier_words_;
  int launching_ = 0;  // launches between taking a communicator and leaving NCCL
  bool stopping_ = false;
  bool abort_requested_ = false;
  bool comms_aborted_ = false;
  std::thread watchdog_;
};

}  // namespace
#endif

std::unique_ptr<Communicator> make_nccl_communicator(DeviceGroup& group, std::vector<int> const& ranks, std::chrono::milliseconds timeout) {
#if MGPU_NCCL_ENABLED
  std::vector<Device> const devices = devices_of(group, ranks);
  std::vector<int> gpus;
  for (Device const d : devices) gpus.push_back(d.index);
  std::sort(gpus.begin(), gpus.end());
  if (std::adjacent_find(gpus.begin(), gpus.end()) != gpus.end())
    throw Error(Errc::invalid_argument, "the nccl backend for a group where ranks share a GPU (expected distinct GPUs; "
                                        "NCCL cannot have two ranks on one GPU, the cuda_peer backend can)");
  ncclUniqueId id{};
  MGPU_NCCL_CHECK(ncclGetUniqueId(&id));
  return std::make_unique<NcclCommunicator>(group, static_cast<int>(devices.size()), 0, devices, id, timeout);
#else
  (void)group;
  (void)ranks;
  (void)timeout;
  throw Error(Errc::device, "the nccl backend: mgpu was built without NCCL (configure with MGPU_WITH_NCCL=ON)");
#endif
}

std::vector<std::byte> nccl_unique_id() {
#if MGPU_NCCL_ENABLED
  ncclUniqueId id{};
  MGPU_NCCL_CHECK(ncclGetUniqueId(&id));
  std::vector<std::byte> bytes(sizeof id);
  std::memcpy(bytes.data(), &id, sizeof id);
  return bytes;
#else
  throw Error(Errc::device, "the nccl backend: mgpu was built without NCCL (configure with MGPU_WITH_NCCL=ON)");
#endif
}

std::unique_ptr<Communicator> make_nccl_world_communicator(DeviceGroup& group, std::vector<int> const& ranks, int size,
                                                           int first_rank, std::vector<std::byte> const& id,
                                                           std::chrono::milliseconds timeout) {
#if MGPU_NCCL_ENABLED
  if (id.size() != sizeof(ncclUniqueId))
    throw Error(Errc::invalid_argument, "an NCCL unique id of " + std::to_string(id.size()) + " bytes (expected " +
                                            std::to_string(sizeof(ncclUniqueId)) + ")");
  auto const local = static_cast<int>(ranks.size());
  if (local == 0 || first_rank < 0 || first_rank + local > size)
    throw Error(Errc::invalid_argument, "ranks " + std::to_string(first_rank) + " to " +
                                            std::to_string(first_rank + local - 1) + " of " + std::to_string(size) +
                                            " (expected at least one, within the communicator)");
  std::vector<Device> const devices = devices_of(group, ranks);  // DeviceGroup::device checks each rank
  for (std::size_t i = 0; i < devices.size(); ++i)
    for (std::size_t j = 0; j < i; ++j)
      if (devices[i] == devices[j])
        throw Error(Errc::invalid_argument, "ranks " + std::to_string(first_rank + static_cast<int>(j)) + " and " +
                                                std::to_string(first_rank + static_cast<int>(i)) + " both on " +
                                                devices[i].to_string() +
                                                " (expected distinct GPUs: NCCL cannot have two ranks on one GPU)");
  ncclUniqueId unique{};
  std::memcpy(&unique, id.data(), sizeof unique);
  return std::make_unique<NcclCommunicator>(group, size, first_rank, devices, unique, timeout);
#else
  (void)group;
  (void)ranks;
  (void)size;
  (void)first_rank;
  (void)id;
  (void)timeout;
  throw Error(Errc::device, "the nccl backend: mgpu was built without NCCL (configure with MGPU_WITH_NCCL=ON)");
#endif
}

}  // namespace mgpu::comm::detail
