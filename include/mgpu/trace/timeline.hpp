// Timeline: what each executor did, on which rank and stream, and when — recorded while tracing
// is on, exported as Chrome/Perfetto trace JSON (open it in ui.perfetto.dev or chrome://tracing).
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <mgpu/core/stream.hpp>

namespace mgpu::trace {

/// One recorded interval: `name` ran on `rank`'s `lane` (a stream, e.g. compute or communication)
/// from begin_ns to end_ns, in nanoseconds since the timeline's origin.
struct Span {
  std::string name;
  std::string category;
  int rank = 0;
  int lane = 0;
  std::int64_t begin_ns = 0;
  std::int64_t end_ns = 0;
};

/// The lanes executors use.
enum Lane : int { compute = 0, communication = 1, host = 2 };

/// A thread-safe record of spans. Off by default: while off, record() and stream_span() cost one
/// relaxed load and record nothing. Executors hold a shared_ptr to the timeline they were given,
/// so stream work that records into it may outlive the executor.
class Timeline {
 public:
  Timeline();

  /// Turns recording on or off (spans already recorded stay).
  void enable(bool on = true) noexcept { enabled_.store(on, std::memory_order_relaxed); }
  [[nodiscard]] bool enabled() const noexcept { return enabled_.load(std::memory_order_relaxed); }

  /// Nanoseconds since the timeline was made (steady clock).
  [[nodiscard]] std::int64_t now_ns() const noexcept;

  /// Records a span that has ended (when enabled). Thread-safe.
  void record(Span span);

  /// Records the host interval of a scope: a span from construction to destruction.
  class Scope {
   public:
    Scope(Timeline* timeline, std::string name, std::string_view category, int rank, int lane);
    Scope(Scope const&) = delete;
    Scope& operator=(Scope const&) = delete;
    ~Scope();

   private:
    Timeline* timeline_;
    Span span_;
  };

  /// Records the interval in which `stream` runs the work that `enqueue()` puts on it: a marker
  /// task before and after it on the stream. On host devices this is exactly when the worker ran
  /// that work; on CUDA streams the markers are host callbacks, so the span is approximate and adds
  /// two callbacks (use tracing there to see ordering, not to time kernels). When disabled, just
  /// calls enqueue().
  template <class Enqueue>
  void stream_span(Stream& stream, std::string name, std::string_view category, int rank, int lane, Enqueue&& enqueue) {
    if (!enabled()) {
      std::forward<Enqueue>(enqueue)();
      return;
    }
    // The markers capture two pointers, which std::function holds without allocating; the span
    // waits in a slot of the timeline's pool until the second marker records it.
    Span* const span = open(Span{std::move(name), std::string(category), rank, lane, 0, 0});
    stream.enqueue([this, span] { span->begin_ns = now_ns(); });
    try {
      std::forward<Enqueue>(enqueue)();
    } catch (...) {
      stream.enqueue([this, span] { close(span, false); });
      throw;
    }
    stream.enqueue([this, span] { close(span, true); });
  }

  /// Every span recorded so far, ordered by begin time (then rank, lane).
  [[nodiscard]] std::vector<Span> spans() const;
  /// Forgets every span.
  void clear();

  /// The spans as Chrome trace-event JSON: one process per rank ("rank N"), one thread per lane.
  [[nodiscard]] std::string chrome_trace_json() const;
  /// Writes chrome_trace_json() to `path` (through a temporary file renamed into place). Throws
  /// Error(io) naming the path when it cannot be written.
  void write_chrome_trace(std::string const& path) const;

 private:
  // A pool slot for a stream span in flight, and its return (recording the span when `keep`). A
  // span whose end marker never runs (its stream failed first) keeps its slot until the timeline
  // goes.
  Span* open(Span span);
  void close(Span* span, bool keep);

  std::atomic<bool> enabled_{false};
  std::int64_t origin_ns_;
  mutable std::mutex mutex_;
  std::vector<Span> spans_;
  std::deque<Span> slots_;        // stable addresses
  std::vector<Span*> free_slots_;
};

/// The name Chrome trace JSON gives a lane ("compute", "communication", "host", or "lane N").
std::string lane_name(int lane);

}  // namespace mgpu::trace
