// Streams and events: a worker thread per host stream, CUDA streams and events on GPUs.
#include <mgpu/core/stream.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include <mgpu/core/error.hpp>

#include "core/backend.hpp"
#include "core/cuda_backend.hpp"
#include "core/stream_impl.hpp"

namespace mgpu {
namespace {

using Clock = std::chrono::steady_clock;

// The state a host event shares with the streams that record and wait on it.
struct HostEventState {
  std::mutex mutex;
  std::condition_variable reached_cv;
  std::uint64_t recorded = 0;  // recordings enqueued
  std::uint64_t reached = 0;   // recordings the stream has passed
  bool failed = false;         // the last reached recording came after failed work
  std::string failed_on;
  Clock::time_point time{};
  // `reached` (low 32 bits) in page-locked memory, for CUDA streams that wait on this event without
  // blocking a host thread; made when a CUDA stream first waits.
  std::uint32_t* device_word = nullptr;

  HostEventState() = default;
  HostEventState(HostEventState const&) = delete;
  HostEventState& operator=(HostEventState const&) = delete;
  ~HostEventState() {
    if (device_word != nullptr) detail::cuda::host_word_destroy(device_word);
  }

  // Called with `mutex` held.
  void publish_reached() {
    if (device_word != nullptr) std::atomic_ref(*device_word).store(static_cast<std::uint32_t>(reached), std::memory_order_release);
  }

  std::uint32_t const* word() {
    std::lock_guard lock(mutex);
    if (device_word == nullptr) {
      device_word = detail::cuda::host_word_create();
      publish_reached();
    }
    return device_word;
  }

  void wait_for(std::uint64_t target) {
    std::unique_lock lock(mutex);
    reached_cv.wait(lock, [&] { return reached >= target; });
    if (failed)
      throw Error(Errc::device, "waited on an event recorded after work on " + failed_on + " failed");
  }
};

}  // namespace

Stream::Stream(Device device) : impl_(std::make_unique<Impl>(device)) {}
Stream::Stream(Stream&&) noexcept = default;
Stream& Stream::operator=(Stream&&) noexcept = default;
Stream::~Stream() = default;

Device Stream::device() const noexcept { return impl_->device; }
void Stream::enqueue(std::function<void()> work) { impl_->push(std::move(work), false); }
void Stream::synchronize() { impl_->synchronize(); }
bool Stream::query() const { return impl_->query(); }
void* Stream::native_handle() const noexcept { return impl_->cuda_stream; }

Stream::InlineScope::InlineScope(Stream& stream) noexcept : previous_(std::exchange(Impl::inline_caller, stream.impl_.get())) {}
Stream::InlineScope::~InlineScope() { Impl::inline_caller = previous_; }

struct Event::Impl {
  bool recorded_on_cuda() const { return cuda_event != nullptr && kind == DeviceKind::cuda; }

  DeviceKind kind = DeviceKind::host;
  std::shared_ptr<HostEventState> host = std::make_shared<HostEventState>();
  // Shared with host streams waiting on it, so re-recording never destroys an event one of them
  // still synchronizes on; a recording replaces it while such a waiter holds it.
  std::shared_ptr<void> cuda_event;
  int cuda_ordinal = -1;
  bool ever_recorded = false;
};

Event::Event() : impl_(std::make_unique<Impl>()) {}
Event::Event(Event&&) noexcept = default;
Event& Event::operator=(Event&&) noexcept = default;
Event::~Event() = default;

void Event::record(Stream& stream) {
  Stream::Impl& s = *stream.impl_;
  Impl& e = *impl_;
  if (s.device.kind == DeviceKind::cuda) {
    if (e.cuda_event == nullptr || e.cuda_ordinal != s.device.index || e.cuda_event.use_count() > 1) {
      e.cuda_event = std::shared_ptr<void>(detail::cuda::event_create(s.device.index), detail::cuda::event_destroy);
      e.cuda_ordinal = s.device.index;
    }
    detail::cuda::event_record(e.cuda_event.get(), s.cuda_stream);
    e.kind = DeviceKind::cuda;
    e.ever_recorded = true;
    return;
  }
  std::uint64_t generation = 0;
  {
    std::lock_guard lock(e.host->mutex);
    generation = ++e.host->recorded;
  }
  e.kind = DeviceKind::host;
  e.ever_recorded = true;
  s.push(
      [state = e.host, generation, &s] {
        bool const failed = s.failed();
        std::lock_guard lock(state->mutex);
        if (generation > state->reached) {
          state->reached = generation;
          state->failed = failed;
          state->failed_on = s.device.to_string();
          state->time = Clock::now();
          state->publish_reached();
        }
        state->reached_cv.notify_all();
      },
      true);
}

void Event::wait(Stream& stream) const {
  Impl const& e = *impl_;
  if (!e.ever_recorded) return;
  Stream::Impl& s = *stream.impl_;
  if (e.recorded_on_cuda()) {
    if (s.device.kind == DeviceKind::cuda) {
      detail::cuda::stream_wait_event(s.cuda_stream, e.cuda_event.get());
    } else {
      s.push([event = e.cuda_event] { detail::cuda::event_synchronize(event.get()); }, false, false);
    }
    return;
  }
  std::uint64_t target = 0;
  {
    std::lock_guard lock(e.host->mutex);
    target = e.host->recorded;
  }
  if (s.device.kind == DeviceKind::cuda) {
    // The GPU itself waits for the host to raise the word: no CUDA callback thread blocks (one
    // that did would stall every stream's callbacks). The callback after it only reports a failure.
    detail::cuda::stream_wait_word(s.cuda_stream, e.host->word(), static_cast<std::uint32_t>(target));
  }
  s.push([state = e.host, target] { state->wait_for(target); }, false, false);
}

void Event::synchronize() const {
  Impl const& e = *impl_;
  if (!e.ever_recorded) return;
  if (e.recorded_on_cuda()) {
    detail::cuda::event_synchronize(e.cuda_event.get());
    return;
  }
  std::uint64_t target = 0;
  {
    std::lock_guard lock(e.host->mutex);
    target = e.host->recorded;
  }
  e.host->wait_for(target);
}

bool Event::query() const {
  Impl const& e = *impl_;
  if (!e.ever_recorded) return true;
  if (e.recorded_on_cuda()) return detail::cuda::event_query(e.cuda_event.get());
  std::lock_guard lock(e.host->mutex);
  return e.host->reached >= e.host->recorded;
}

double Event::elapsed_ms(Event const& start, Event const& end) {
  Impl const& a = *start.impl_;
  Impl const& b = *end.impl_;
  if (!a.ever_recorded || !b.ever_recorded)
    throw Error(Errc::invalid_argument, "elapsed_ms needs two recorded events, got an event that was never recorded");
  if (a.recorded_on_cuda() != b.recorded_on_cuda())
    throw Error(Errc::invalid_argument, "elapsed_ms needs two events recorded on the same kind of device (host or cuda)");
  if (a.recorded_on_cuda()) return detail::cuda::event_elapsed_ms(a.cuda_event.get(), b.cuda_event.get());
  if (!start.query() || !end.query())
    throw Error(Errc::invalid_argument, "elapsed_ms called before both events were reached; synchronize them first");
  Clock::time_point t0;
  Clock::time_point t1;
  {
    std::lock_guard lock(a.host->mutex);
    t0 = a.host->time;
  }
  {
    std::lock_guard lock(b.host->mutex);
    t1 = b.host->time;
  }
  return std::chrono::duration<double, std::milli>(t1 - t0).count();
}

void detail::StreamInternals::enqueue_even_after_failure(Stream& stream, std::function<void(bool)> work) {
  Stream::Impl& s = *stream.impl_;
  s.push([&s, work = std::move(work)] { work(s.failed()); }, true);
}

void detail::StreamInternals::with_blas_handle(Stream& stream, void* (*create)(int), void (*destroy)(void*) noexcept,
                                               std::function<void(void*)> const& use) {
  Stream::Impl& s = *stream.impl_;
  std::lock_guard lock(s.blas_mutex);
  if (s.blas_handle == nullptr) {
    s.blas_handle = create(s.device.index);
    s.blas_destroy = destroy;
  }
  use(s.blas_handle);
}

std::uint64_t detail::StreamInternals::id(Stream const& stream) noexcept { return stream.impl_->id; }

detail::StreamInternals::HostPosition detail::StreamInternals::host_position(Stream const& stream) {
  Stream::Impl const& s = *stream.impl_;
  return {s.progress, s.submitted.load(std::memory_order_acquire)};
}

}  // namespace mgpu
