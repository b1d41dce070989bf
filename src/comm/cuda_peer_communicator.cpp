// The cuda_peer backend: ranks meet on the host when they enqueue a collective (each rank calls from its own
// thread, as in DeviceGroup::run); send/recv meet only the pair, through a channel per direction
// (a watchdog thread aborts when a send waits for its receive past the deadline). A collective
// meets once on the host: the ranks exchange buffer pointers, their "inputs ready" events recorded
// just before; each rank's stream then waits for every rank's inputs, runs the reduction kernel
// over its slice (reading every rank's input through same-GPU or peer pointers, writing every
// output) and raises its "done" word to the collective's number; each stream then waits on the GPU
// for every rank's word, so no rank reuses a buffer another rank still reads or writes, and no host
// thread waits for another's kernel. This also serves several logical devices sharing one GPU,
// which NCCL cannot.
//
// It serves a whole group or a subset of its ranks (make_communicator(group, ranks)): rank i of
// the communicator runs on the i-th listed device.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <mgpu/core/detail/reduce_slice.hpp>
#include <mgpu/core/error.hpp>

#include "comm/base.hpp"
#include "comm/cuda_common.hpp"
#include "comm/cuda_communicators.hpp"
#include "core/backend.hpp"
#include "core/cuda_device_scope.hpp"
#include "kernels/reduce.hpp"

namespace mgpu::comm::detail {
namespace {

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

// One rank's collective state: created once on its GPU, re-used by every collective.
struct RankEvents {
  // "Inputs ready" of the rank's odd and even collectives. A rank records the next collective's
  // before the others may have waited on this one's (they are between the meeting and their
  // waits), never the one after: that takes the next meeting, which they reach after their waits.
  cudaEvent_t ready[2] = {nullptr, nullptr};
  std::uint64_t collectives = 0;  // the rank's collectives so far (its thread's alone)
  // Page-locked; the rank's stream raises it to a collective's number once its kernel is done with
  // every rank's buffers.
  std::uint32_t* done = nullptr;
  // After the latest write of `done`, on the rank's GPU (made by the first): the next write waits
  // for it, so the word only grows even when the rank's collectives run on several streams.
  cudaEvent_t written = nullptr;
};

// An event after the latest operation a rank enqueued on one of its streams, for finalize().
struct StreamMark {
  cudaStream_t stream = nullptr;
  cudaEvent_t last = nullptr;
};

class CudaPeerCommunicator final : public CommunicatorBase {
 public:
  // Rank i runs on devices[i] (the group's rank it stands for).
  CudaPeerCommunicator(DeviceGroup& group, std::vector<Device> devices, std::chrono::milliseconds timeout)
      : CommunicatorBase(group, static_cast<int>(devices.size()), Backend::cuda_peer, timeout),
        devices_(std::move(devices)),
        events_(devices_.size()),
        marks_(devices_.size()),
        channels_(devices_.size() * devices_.size()),
        meeting_(size(), *state()) {
    if (size() > mgpu::detail::max_reduce_ranks)
      throw Error(Errc::invalid_argument, "a cuda_peer communicator over " + std::to_string(size()) +
                                              " ranks (expected at most " + std::to_string(mgpu::detail::max_reduce_ranks) + ")");
    auto const peers = peer_access_matrix(devices_);
    for (Channel& ch : channels_) ch.word = mgpu::detail::cuda::host_word_create();
    for (int r = 0; r < size(); ++r) {
      int const gpu = devices_[static_cast<std::size_t>(r)].index;
      mgpu::detail::cuda::DeviceScope scope(gpu);
      RankEvents& e = events_[static_cast<std::size_t>(r)];
      for (cudaEvent_t& ready : e.ready) MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
      MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&e.written, cudaEventDisableTiming));
      e.done = mgpu::detail::cuda::host_word_create();
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
      raise_words();
    });
    watchdog_ = std::thread([this] { watch(); });
  }

  // A sender's stream waits for its receiver's copy without a host thread: a receiver that never
  // calls recv would hold it, and whatever waits for that stream, for good. The watchdog aborts the
  // communicator (which releases the stream) when a send has waited past the deadline for its
  // receive, naming both ranks.
  void watch() {
    auto const period = std::clamp(timeout() / 4, std::chrono::milliseconds(1), std::chrono::milliseconds(50));
    std::unique_lock lock(watch_mutex_);
    while (!watch_cv_.wait_for(lock, period, [this] { return stopping_; })) {
      if (state()->aborted()) continue;
      lock.unlock();
      if (std::string const late = unreceived(); !late.empty()) state()->abort(late);
      lock.lock();
    }
  }

  // The first channel whose oldest message has waited past the deadline for its receive,
  // described; empty when none has.
  std::string unreceived() {
    auto const now = Clock::now();
    for (int from = 0; from < size(); ++from) {
      for (int to = 0; to < size(); ++to) {
        Channel& ch = channel(from, to);
        std::lock_guard lock(ch.mutex);
        if (ch.queue.empty() || now - ch.queue.front()->posted_at <= timeout()) continue;
        return "rank " + std::to_string(from) + "'s send waited " + format_duration(now - ch.queue.front()->posted_at) +
               " for rank " + std::to_string(to) + " to receive " + std::to_string(ch.posted - ch.taken) +
               " message(s) from rank " + std::to_string(from) + " (expected a matching recv within the " +
               format_duration(timeout()) + " deadline)";
      }
    }
    return {};
  }

  // Releases the senders' streams still waiting for a receive that will not come (their data is
  // not delivered; the abort reports it) and the streams waiting for a rank's collective kernel
  // that will not run, and wakes the receivers waiting on the host.
  void raise_words() noexcept {
    for (RankEvents const& e : events_) {
      if (e.done != nullptr)
        std::atomic_ref(*e.done).store(std::numeric_limits<std::uint32_t>::max(), std::memory_order_release);
    }
    for (auto& ch : channels_) {
      {
        std::lock_guard lock(ch.mutex);
        std::atomic_ref(*ch.word).store(static_cast<std::uint32_t>(ch.posted + 1), std::memory_order_release);
      }
      ch.cv.notify_all();
    }
  }

  // After an abort: a receive's copy queued before it may write its channel's word later, lowering
  // what the abort raised. Until every stream the ranks used is past their operations (at most the
  // deadline), the words are raised again.
  void drain_after_abort() noexcept {
    auto const deadline = Clock::now() + timeout();
    std::lock_guard marks_lock(marks_mutex_);
    while (Clock::now() < deadline) {
      raise_words();
      bool const drained = std::all_of(marks_.begin(), marks_.end(), [](std::vector<StreamMark> const& marks) {
        return std::all_of(marks.begin(), marks.end(), [](StreamMark const& m) { return cudaEventQuery(m.last) != cudaErrorNotReady; });
      });
      if (drained) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  ~CudaPeerCommunicator() override {
    // Waits (with the deadline) for the device work, or aborts, which raises every channel word:
    // after this no stream waits on a word for a copy that will not come.
    shut_down();
    {
      std::lock_guard lock(watch_mutex_);
      stopping_ = true;
    }
    watch_cv_.notify_all();
    watchdog_.join();
    if (aborted()) drain_after_abort();
    for (auto& e : events_) {
      for (cudaEvent_t event : {e.ready[0], e.ready[1], e.written}) {
        if (event != nullptr) MGPU_CUDA_CHECK_NO_THROW(cudaEventDestroy(event));
      }
    }
    for (Channel& ch : channels_) {
      if (ch.written != nullptr) MGPU_CUDA_CHECK_NO_THROW(cudaEventDestroy(ch.written));
    }
    // The words go back to the pool only once the streams that wait on them or write them are past
    // this communicator's operations: a recycled word is reset for its next owner.
    std::vector<std::uint32_t*> words;
    for (Channel& ch : channels_) {
      if (ch.word != nullptr) words.push_back(ch.word);
    }
    for (RankEvents const& e : events_) {
      if (e.done != nullptr) words.push_back(e.done);
    }
    std::vector<void*> after;
    for (auto& marks : marks_) {
      for (StreamMark const& m : marks) after.push_back(m.last);
    }
    mgpu::detail::cuda::host_words_destroy_after(std::move(words), std::move(after));
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
    // Sends are posted first and never block this thread, so the receivers of this group can find
    // them. The stream waits for their receivers' copies only after this group's own receives and
    // collectives: two ranks exchanging in one group would otherwise each wait for a copy queued
    // behind the other's wait.
    std::vector<Call const*> posted;
    try {
      for (Call const& c : calls) {
        if (c.kind == OpKind::send) {
          post_send(rank, c, stream);
          posted.push_back(&c);
        }
      }
      for (Call const& c : calls) {
        if (c.kind == OpKind::recv) {
          receive(rank, c, stream);
        } else if (c.kind != OpKind::send) {
          collective(rank, c, stream);
        }
      }
    } catch (Error const& e) {
      // A receiver may still wait for the rest of the group, a posted send for a receiver, the
      // other ranks' streams for this rank's "done" word of a collective that met; the abort raises
      // the words, so those waits (and the send waits below) end.
      state()->abort(calls.front().name(rank) + " failed: " + e.what());
      try {
        wait_for_receivers(rank, posted, stream);
        mark_last(rank, stream);
      } catch (Error const&) {  // the GPU fails too: the first error says more
      }
      throw;
    }
    wait_for_receivers(rank, posted, stream);
    mark_last(rank, stream);
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
    // Then the GPUs: the latest operation on every stream each rank used has finished.
    std::lock_guard marks_lock(marks_mutex_);
    for (int r = 0; r < size() && !state()->aborted(); ++r) {
      mgpu::detail::cuda::DeviceScope scope(devices_[static_cast<std::size_t>(r)].index);
      auto const& marks = marks_[static_cast<std::size_t>(r)];
      for (std::size_t m = 0; m < marks.size() && !state()->aborted(); ++m) {
        std::string const whose = "rank " + std::to_string(r) + "'s operations on its stream " + std::to_string(m + 1) +
                                  " of " + std::to_string(marks.size());
        while (true) {
          cudaError_t const status = cudaEventQuery(marks[m].last);
          if (status == cudaSuccess) break;
          if (status != cudaErrorNotReady) {
            state()->abort("finalize: " + whose + " failed on the GPU: " + cudaGetErrorString(status));
            return;
          }
          if (Clock::now() > deadline) {
            state()->abort("finalize waited " + format_duration(limit) + " for " + whose +
                           " to finish on the GPU (a send to or a receive from another rank that never met its peer?)");
            return;
          }
          std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
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
    Clock::time_point posted_at{};
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
    // After the latest receive's write of `word`, on the receiver's GPU (made by the first receive).
    // The next receive's write waits for it, so the word only grows even when the receiver uses
    // several streams: a later copy that finished first must not announce an earlier one.
    cudaEvent_t written = nullptr;
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
    message->posted_at = Clock::now();
    MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&message->ready, cudaEventDisableTiming));
    MGPU_CUDA_CHECK(cudaEventRecord(message->ready, s));
    Channel& ch = channel(rank, c.root);
    {
      std::lock_guard lock(ch.mutex);
      ch.queue.push_back(std::move(message));
      ++ch.posted;
    }
    ch.cv.notify_all();
  }

  // The posted sends' buffers may be reused once their receivers' copies have run: the stream waits
  // for that (without a host thread; an abort raises the words), and the buffers' use is recorded
  // after the wait. Also on a failed group, whose receivers may already have queued their copies.
  void wait_for_receivers(int rank, std::vector<Call const*> const& posted, Stream& stream) {
    for (Call const* c : posted) {
      mgpu::detail::cuda::stream_wait_word(native(stream), channel(rank, c->root).word, static_cast<std::uint32_t>(c->seq + 1));
      mgpu::detail::release_after(stream, c->send);
    }
  }

  // Records the end of the rank's latest operation on `stream`, for finalize().
  void mark_last(int rank, Stream& stream) {
    cudaStream_t const s = native(stream);
    std::lock_guard lock(marks_mutex_);
    auto& marks = marks_[static_cast<std::size_t>(rank)];
    auto it = std::find_if(marks.begin(), marks.end(), [&](StreamMark const& m) { return m.stream == s; });
    if (it == marks.end()) {
      StreamMark mark{s, nullptr};
      MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&mark.last, cudaEventDisableTiming));
      it = marks.insert(marks.end(), mark);
    }
    MGPU_CUDA_CHECK(cudaEventRecord(it->last, s));
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
    mgpu::detail::release_after(stream, c.recv);  // before anything else can fail
    if (ch.written == nullptr) {
      MGPU_CUDA_CHECK(cudaEventCreateWithFlags(&ch.written, cudaEventDisableTiming));
    } else {
      MGPU_CUDA_CHECK(cudaStreamWaitEvent(s, ch.written, 0));
    }
    mgpu::detail::cuda::stream_write_word(s, ch.word, static_cast<std::uint32_t>(taken->seq + 1));
    MGPU_CUDA_CHECK(cudaEventRecord(ch.written, s));
    lock.unlock();
    ch.cv.notify_all();
  }

  // One host meeting per collective: the "done" side needs none, since every rank's stream
  // announces its kernel's end in a word that the other streams wait for on the GPU.
  void collective(int rank, Call const& c, Stream& stream) {
    std::string const what = c.name(rank);
    state()->throw_if_aborted(what);
    cudaStream_t const s = native(stream);
    RankEvents& mine = events_[static_cast<std::size_t>(rank)];
    std::uint64_t const number = ++mine.collectives;  // the same on every rank: all call in one order
    std::size_t const parity = number % 2;
    MGPU_CUDA_CHECK(cudaEventRecord(mine.ready[parity], s));
    Post const post{c.kind, c.seq, c.count, c.dtype, c.op, c.root,
                    c.send.defined() ? c.send.data() : nullptr, c.recv.defined() ? c.recv.data() : nullptr};
    std::vector<Post> const& posts = meeting_.exchange(rank, post, what);
    int const n = size();
    for (int p = 0; p < n; ++p) {
      if (p != rank) MGPU_CUDA_CHECK(cudaStreamWaitEvent(s, events_[static_cast<std::size_t>(p)].ready[parity], 0));
    }
    compute(rank, c, posts, s, what);
    mgpu::detail::release_after(stream, c.send, c.recv);  // this rank's kernel, also if the rest fails
    MGPU_CUDA_CHECK(cudaStreamWaitEvent(s, mine.written, 0));  // the previous collective's write first
    mgpu::detail::cuda::stream_write_word(s, mine.done, static_cast<std::uint32_t>(number));
    MGPU_CUDA_CHECK(cudaEventRecord(mine.written, s));
    for (int p = 0; p < n; ++p) {
      if (p != rank)
        mgpu::detail::cuda::stream_wait_word(s, events_[static_cast<std::size_t>(p)].done,
                                             static_cast<std::uint32_t>(number));
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
  std::mutex marks_mutex_;
  std::vector<std::vector<StreamMark>> marks_;  // per rank, one per stream it used
  std::vector<Channel> channels_;
  Meeting<Post> meeting_;
  std::mutex watch_mutex_;
  std::condition_variable watch_cv_;
  bool stopping_ = false;
  std::thread watchdog_;  // started last, stopped first
};

}  // namespace

std::unique_ptr<Communicator> make_cuda_peer_communicator(DeviceGroup& group, std::vector<int> const& ranks,
                                                          std::chrono::milliseconds timeout) {
  return std::make_unique<CudaPeerCommunicator>(group, devices_of(group, ranks), timeout);
}

}  // namespace mgpu::comm::detail
