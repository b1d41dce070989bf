// Streams and events: ordered queues of device work, and markers to order work across them.
#pragma once

#include <functional>
#include <memory>

#include <mgpu/core/device.hpp>

namespace mgpu {

class Event;
namespace detail {
struct StreamInternals;  // the library's internal access to a stream (src/core/backend.hpp)
}

/// An ordered queue of work on one device, owned (move-only). On a CUDA device it is a CUDA
/// stream; on a host device a worker thread that runs the queue in order, so different streams
/// run concurrently as on a GPU. Work enqueued from several threads is run in enqueue order.
///
/// An exception thrown by host work is kept: later work on the stream is skipped (events still
/// complete, marked failed, so other streams never hang), and synchronize() rethrows it as
/// mgpu::Error on the caller's thread, which clears the stream for reuse. On a CUDA stream the
/// skipped work is the host work (callbacks); kernels and copies already enqueued still run.
class Stream {
 public:
  /// A new stream on `device`. Throws Error(device) if the device cannot make one.
  explicit Stream(Device device);
  Stream(Stream&&) noexcept;
  Stream& operator=(Stream&&) noexcept;
  Stream(Stream const&) = delete;
  Stream& operator=(Stream const&) = delete;
  /// Waits for enqueued work to finish, then releases the stream; never throws.
  ~Stream();

  [[nodiscard]] Device device() const noexcept;

  /// Enqueues host work. On a host device it runs on the stream's worker; on a CUDA stream it runs
  /// as a host callback in stream order and must not call CUDA.
  void enqueue(std::function<void()> work);

  /// Blocks until all enqueued work has run. Throws mgpu::Error for work that failed.
  void synchronize();

  /// True when all enqueued work has run (without waiting).
  [[nodiscard]] bool query() const;

  /// The cudaStream_t of a CUDA stream, nullptr for a host stream.
  [[nodiscard]] void* native_handle() const noexcept;

  /// While alive, host work that this thread enqueues on `stream` runs at once on this thread
  /// whenever the stream is idle, instead of on the stream's worker: for a thread that drives one
  /// stream and mostly waits for it (a pipeline stage's actions, a device's sends and receives),
  /// each piece of work saves a handoff between threads. Work enqueued while the stream is busy is
  /// queued as always, and the worker waits while work runs here, so the stream keeps its order;
  /// a failure is kept for synchronize() and skips later work, as on the worker. Work that other
  /// threads enqueue still runs on the worker. No effect on a CUDA stream. One stream per thread
  /// at a time: a nested scope replaces the outer one until it ends.
  class InlineScope;

 private:
  struct Impl;  // src/core/stream_impl.hpp
  friend class Event;
  friend struct detail::StreamInternals;
  std::unique_ptr<Impl> impl_;
};

class Stream::InlineScope {
 public:
  explicit InlineScope(Stream& stream) noexcept;
  ~InlineScope();
  InlineScope(InlineScope const&) = delete;
  InlineScope& operator=(InlineScope const&) = delete;

 private:
  Impl* previous_;
};

/// A marker in a stream (move-only). record() places it; wait() makes another stream (on any
/// device) wait until the work before the marker has run; elapsed_ms() times between two markers.
/// Waiting on an event that was never recorded does nothing, as in CUDA.
class Event {
 public:
  Event();
  Event(Event&&) noexcept;
  Event& operator=(Event&&) noexcept;
  Event(Event const&) = delete;
  Event& operator=(Event const&) = delete;
  ~Event();

  /// Marks the current end of `stream`. Re-recording moves the marker.
  void record(Stream& stream);
  /// Makes work enqueued later on `stream` wait for this event's last recording.
  void wait(Stream& stream) const;
  /// Blocks until the last recording has been reached. Throws Error(device) if work before it failed.
  void synchronize() const;
  /// True when the last recording has been reached (or the event was never recorded).
  [[nodiscard]] bool query() const;

  /// Milliseconds between two reached recordings on the same kind of device.
  static double elapsed_ms(Event const& start, Event const& end);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace mgpu
