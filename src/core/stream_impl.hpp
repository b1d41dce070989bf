// Stream::Impl, shared by the core and the communicators: a host stream's queue and worker, or a
// CUDA stream. Internal: not installed.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include <mgpu/core/error.hpp>
#include <mgpu/core/stream.hpp>

#include "core/cuda_backend.hpp"

namespace mgpu {

namespace detail {
// Wraps whatever host work threw into an mgpu::Error naming the stream's device.
inline std::exception_ptr as_error(Device device) {
  try {
    throw;
  } catch (Error const&) {
    return std::current_exception();
  } catch (std::exception const& e) {
    return std::make_exception_ptr(Error(Errc::device, "host work on " + device.to_string() + " threw: " + e.what()));
  } catch (...) {
    return std::make_exception_ptr(Error(Errc::device, "host work on " + device.to_string() + " threw a non-standard exception"));
  }
}

}  // namespace detail

struct Stream::Impl {
  struct Task {
    std::function<void()> work;
    bool runs_after_failure;  // event recordings still complete after a failure
    bool compute;             // stretched on an emulated slower device (not waits, events, collectives)
  };

  explicit Impl(Device d) : device(d) {
    if (device.kind == DeviceKind::cuda) {
      cuda_stream = detail::cuda::stream_create(device.index);
    } else {
      worker = std::thread([this] { run_worker(); });
    }
  }

  ~Impl() {
    if (device.kind == DeviceKind::cuda) {
      if (blas_handle != nullptr) {
        try {
          detail::cuda::stream_synchronize(cuda_stream);  // the handle's last GEMMs have run
        } catch (...) {  // a failed stream still releases its handle
        }
        blas_destroy(blas_handle);
      }
      detail::cuda::stream_destroy(cuda_stream);
      return;
    }
    {
      std::lock_guard lock(mutex);
      stopping = true;
    }
    work_cv.notify_all();
    worker.join();
  }

  Impl(Impl const&) = delete;
  Impl& operator=(Impl const&) = delete;

  void run_worker() {
    std::unique_lock lock(mutex);
    while (true) {
      if (tasks.empty() && !stopping) {
        lock.unlock();
        spin_until([&] { return submitted.load(std::memory_order_acquire) != completed.load(std::memory_order_relaxed); });
        lock.lock();
      }
      // Work enqueued while a task runs inline waits for it, so the queue keeps its order.
      work_cv.wait(lock, [&] { return (stopping && tasks.empty()) || (!tasks.empty() && !inline_running); });
      if (tasks.empty()) return;  // stopping, queue drained
      Task task = std::move(tasks.front());
      tasks.pop_front();
      bool const skip = error != nullptr && !task.runs_after_failure;
      lock.unlock();
      std::exception_ptr failure = run(task, skip);
      lock.lock();
      finish(failure);
    }
  }

  // Runs one task on the calling thread (the worker, or an inline caller), without the lock;
  // returns what it threw.
  std::exception_ptr run(Task& task, bool skip) {
    std::exception_ptr failure;
    if (!task.compute && stretch_owed > std::chrono::nanoseconds::zero()) {
      // The stretched compute before an event or a collective ends only once its sleep is paid.
      auto const now = std::chrono::steady_clock::now();
      std::this_thread::sleep_for(stretch_owed);
      stretch_owed -= std::chrono::steady_clock::now() - now;
    }
    if (!skip) {
      auto const start = std::chrono::steady_clock::now();
      try {
        task.work();
      } catch (...) {
        failure = detail::as_error(device);
      }
      // An emulated slower device: its compute takes 1/speed of the time. Event recordings and
      // waits and communicator work are not stretched, so waiting for peers is not.
      // The stretch is owed and slept in pieces of at least 1 ms, each sleep's overshoot paid
      // back from the next, so the total stays 1/speed however short the tasks.
      if (device.speed < 1.0 && task.compute) {
        auto const now = std::chrono::steady_clock::now();
        stretch_owed += std::chrono::duration_cast<std::chrono::nanoseconds>((now - start) * (1.0 / device.speed - 1.0));
        if (stretch_owed >= std::chrono::milliseconds(1)) {
          std::this_thread::sleep_for(stretch_owed);
          stretch_owed -= std::chrono::steady_clock::now() - now;
        }
      }
    }
    task.work = nullptr;  // release what the work captured before reporting completion
    return failure;
  }

  // Called with `mutex` held after a task ran.
  void finish(std::exception_ptr const& failure) {
    if (failure && !error) error = failure;
    ++completed;
    // Only synchronize() waits here, for an empty queue: waking it after every task would cost
    // a system call per task and wake a thread that goes straight back to sleep.
    if (completed == submitted) done_cv.notify_all();
  }

  // `compute`: whether an emulated slower device stretches the work (waits and collectives are not
  // compute; work that runs after a failure never is).
  void push(std::function<void()> work, bool runs_after_failure, bool compute = true) {
    if (device.kind == DeviceKind::cuda) {
      auto* callback = new Callback{std::move(work), this, runs_after_failure};
      try {
        detail::cuda::launch_host_func(cuda_stream, &Impl::run_callback, callback);
      } catch (...) {
        delete callback;
        throw;
      }
      return;
    }
    Task task{std::move(work), runs_after_failure, compute && !runs_after_failure};
    std::unique_lock lock(mutex);
    if (inline_caller == this && completed == submitted) {
      // The stream is idle and this thread runs it (Stream::InlineScope): the work runs here and now,
      // which is when the worker would have run it, without waking the worker.
      bool const skip = error != nullptr && !runs_after_failure;
      ++submitted;
      inline_running = true;
      lock.unlock();
      std::exception_ptr const failure = run(task, skip);
      lock.lock();
      inline_running = false;
      finish(failure);
      bool const queued = !tasks.empty();  // by other threads, or by the work itself, meanwhile
      lock.unlock();
      if (queued) work_cv.notify_one();
      return;
    }
    tasks.push_back(std::move(task));
    ++submitted;
    lock.unlock();
    work_cv.notify_one();
  }

  // Skips the work after a failure unless it must run anyway, as the host worker does.
  static void run_callback(void* arg) {
    auto* callback = static_cast<Callback*>(arg);
    try {
      if (callback->runs_after_failure || !callback->stream->failed()) callback->work();
    } catch (...) {
      std::exception_ptr const failure = detail::as_error(callback->stream->device);
      std::lock_guard lock(callback->stream->mutex);
      if (!callback->stream->error) callback->stream->error = failure;
    }
    delete callback;
  }

  // Waits briefly for `ready` before a caller blocks on a condition variable: a thread woken from
  // sleep costs tens of microseconds, which small work items would otherwise pay each time.
  template <class Ready>
  static void spin_until(Ready const& ready) {
    auto const start = std::chrono::steady_clock::now();
    do {
      for (int i = 0; i < 32; ++i) {
        if (ready()) return;
        std::this_thread::yield();
      }
    } while (std::chrono::steady_clock::now() - start < std::chrono::microseconds(50));
  }

  bool failed() {
    std::lock_guard lock(mutex);
    return error != nullptr;
  }

  void synchronize() {
    if (device.kind == DeviceKind::cuda) detail::cuda::stream_synchronize(cuda_stream);
    spin_until([&] { return completed.load(std::memory_order_acquire) == submitted.load(std::memory_order_acquire); });
    std::unique_lock lock(mutex);
    done_cv.wait(lock, [&] { return completed == submitted; });
    if (error) std::rethrow_exception(std::exchange(error, nullptr));
  }

  bool query() {
    if (device.kind == DeviceKind::cuda) return detail::cuda::stream_query(cuda_stream);
    std::lock_guard lock(mutex);
    return completed == submitted;
  }

  // Runs a heap-held std::function as a CUDA host callback, keeping its exception for synchronize().
  struct Callback {
    std::function<void()> work;
    Impl* stream;
    bool runs_after_failure;
  };

  Device device;
  void* cuda_stream = nullptr;
  // Never reused, unlike the Impl's address: what the allocator knows a stream by.
  std::uint64_t const id = next_id.fetch_add(1, std::memory_order_relaxed);
  static inline std::atomic<std::uint64_t> next_id{1};

  std::mutex mutex;
  std::condition_variable work_cv;
  std::condition_variable done_cv;
  std::deque<Task> tasks;
  // Changed under `mutex` (for the condition variables), read without it while spinning.
  std::atomic<std::uint64_t> submitted{0};
  // The count of work run, shared with the allocator's records of the host-stream work that uses a
  // freed block (StreamInternals::host_position), which may outlive the stream.
  std::shared_ptr<std::atomic<std::uint64_t>> const progress = std::make_shared<std::atomic<std::uint64_t>>(0);
  std::atomic<std::uint64_t>& completed = *progress;
  // The stream whose idle-time work this thread runs itself (Stream::InlineScope).
  static inline thread_local Impl* inline_caller = nullptr;
  bool stopping = false;
  bool inline_running = false;  // a task runs on an InlineScope's thread; the worker waits
  std::exception_ptr error;
  std::thread worker;
  std::chrono::nanoseconds stretch_owed{0};  // emulated speed: sleep still owed (by the thread running a task)

  // A CUDA stream's cuBLAS handle, made on first use (see StreamInternals::with_blas_handle).
  std::mutex blas_mutex;
  void* blas_handle = nullptr;
  void (*blas_destroy)(void*) noexcept = nullptr;
};

}  // namespace mgpu
