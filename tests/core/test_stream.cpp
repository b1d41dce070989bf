// Host streams and events: ordering, cross-stream and cross-device waits, errors, concurrency.
#include <mgpu/core/stream.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "support/catch.hpp"
#include "support/expect_error.hpp"

using mgpu::Device;
using mgpu::DeviceKind;
using namespace std::chrono_literals;

namespace {
// A rendezvous that fails instead of hanging: arrive() returns false if not all parties came in time.
class Rendezvous {
 public:
  explicit Rendezvous(int parties) : parties_(parties) {}
  bool arrive(std::chrono::milliseconds timeout = 10s) {
    std::unique_lock lock(mutex_);
    ++arrived_;
    cv_.notify_all();
    return cv_.wait_for(lock, timeout, [&] { return arrived_ >= parties_; });
  }

 private:
  int parties_;
  int arrived_ = 0;
  std::mutex mutex_;
  std::condition_variable cv_;
};

// Lets a test hold a stream at one point until it is released.
class Gate {
 public:
  void wait() {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return open_; });
  }
  void open() {
    std::lock_guard lock(mutex_);
    open_ = true;
    cv_.notify_all();
  }

 private:
  bool open_ = false;
  std::mutex mutex_;
  std::condition_variable cv_;
};
}  // namespace

TEST_CASE("A stream runs its work in enqueue order", "[core][stream]") {
  mgpu::Stream stream(Device{DeviceKind::host, 0});
  std::vector<int> order;
  for (int i = 0; i < 1000; ++i) stream.enqueue([&order, i] { order.push_back(i); });
  stream.synchronize();
  REQUIRE(order.size() == 1000);
  for (int i = 0; i < 1000; ++i) REQUIRE(order[static_cast<std::size_t>(i)] == i);
  CHECK(stream.query());
  CHECK(stream.native_handle() == nullptr);
}

TEST_CASE("Work does not run on the caller's thread and streams run concurrently", "[core][stream]") {
  constexpr int count = 4;
  std::vector<mgpu::Stream> streams;
  for (int i = 0; i < count; ++i) streams.emplace_back(Device{DeviceKind::host, i});
  Rendezvous all(count);
  std::atomic<int> met{0};
  auto const caller = std::this_thread::get_id();
  std::atomic<bool> ran_on_caller{false};
  for (auto& s : streams) {
    s.enqueue([&] {
      if (std::this_thread::get_id() == caller) ran_on_caller = true;
      if (all.arrive()) ++met;  // only possible when all four run at the same time
    });
  }
  for (auto& s : streams) s.synchronize();
  CHECK(met == count);
  CHECK_FALSE(ran_on_caller);
}

TEST_CASE("An event orders work across streams and devices", "[core][stream][event]") {
  mgpu::Stream producer(Device{DeviceKind::host, 0});
  mgpu::Stream consumer(Device{DeviceKind::host, 1});
  Gate gate;
  std::atomic<int> value{0};
  int seen = -1;
  producer.enqueue([&] {
    gate.wait();
    value = 42;
  });
  mgpu::Event ready;
  ready.record(producer);
  ready.wait(consumer);
  consumer.enqueue([&] { seen = value.load(); });
  std::this_thread::sleep_for(20ms);
  CHECK_FALSE(consumer.query());  // held behind the event
  CHECK_FALSE(ready.query());
  gate.open();
  consumer.synchronize();
  CHECK(seen == 42);
  CHECK(ready.query());
}

TEST_CASE("Waiting on an event never recorded does nothing", "[core][stream][event]") {
  mgpu::Stream stream(Device{DeviceKind::host, 0});
  mgpu::Event never;
  never.wait(stream);
  bool ran = false;
  stream.enqueue([&] { ran = true; });
  stream.synchronize();
  CHECK(ran);
  CHECK(never.query());
  CHECK_NOTHROW(never.synchronize());
}

TEST_CASE("A wait sees the recording made before it, not later ones", "[core][stream][event]") {
  mgpu::Stream a(Device{DeviceKind::host, 0});
  mgpu::Stream b(Device{DeviceKind::host, 1});
  mgpu::Event event;
  event.record(a);
  a.synchronize();
  event.wait(b);  // waits for the first recording, which is done
  Gate gate;
  a.enqueue([&] { gate.wait(); });
  event.record(a);  // a second recording, held by the gate
  bool ran = false;
  b.enqueue([&] { ran = true; });
  b.synchronize();
  CHECK(ran);
  CHECK_FALSE(event.query());
  gate.open();
  event.synchronize();
  CHECK(event.query());
}

TEST_CASE("An exception in host work reaches synchronize and the stream recovers", "[core][stream][error]") {
  mgpu::Stream stream(Device{DeviceKind::host, 2});
  bool later_ran = false;
  stream.enqueue([] { throw std::runtime_error("boom"); });
  stream.enqueue([&] { later_ran = true; });
  REQUIRE_MGPU_ERROR(stream.synchronize(), mgpu::Errc::device, "host work on host:2 threw: boom");
  CHECK_FALSE(later_ran);  // work after a failure is skipped
  CHECK_NOTHROW(stream.synchronize());
  stream.enqueue([&] { later_ran = true; });
  stream.synchronize();
  CHECK(later_ran);

  stream.enqueue([] { throw mgpu::Error(mgpu::Errc::timeout, "slow peer"); });
  REQUIRE_MGPU_ERROR(stream.synchronize(), mgpu::Errc::timeout, "slow peer");
}

TEST_CASE("A failure upstream of an event fails the waiting stream instead of hanging it", "[core][stream][error]") {
  mgpu::Stream producer(Device{DeviceKind::host, 0});
  mgpu::Stream consumer(Device{DeviceKind::host, 1});
  producer.enqueue([] { throw std::runtime_error("producer died"); });
  mgpu::Event event;
  event.record(producer);
  event.wait(consumer);
  bool consumed = false;
  consumer.enqueue([&] { consumed = true; });
  REQUIRE_MGPU_ERROR(consumer.synchronize(), mgpu::Errc::device, "after work on host:0 failed");
  CHECK_FALSE(consumed);
  REQUIRE_MGPU_ERROR(producer.synchronize(), mgpu::Errc::device, "producer died");
  REQUIRE_MGPU_ERROR(event.synchronize(), mgpu::Errc::device, "failed");
}

TEST_CASE("Events time the work between them", "[core][stream][event]") {
  mgpu::Stream stream(Device{DeviceKind::host, 0});
  mgpu::Event start;
  mgpu::Event end;
  start.record(stream);
  stream.enqueue([] { std::this_thread::sleep_for(30ms); });
  end.record(stream);
  end.synchronize();
  double const ms = mgpu::Event::elapsed_ms(start, end);
  CHECK(ms >= 29.0);
  CHECK(ms < 5000.0);
  mgpu::Event unrecorded;
  REQUIRE_MGPU_ERROR(mgpu::Event::elapsed_ms(start, unrecorded), mgpu::Errc::invalid_argument, "never recorded");
}

TEST_CASE("Destroying a stream finishes its work first", "[core][stream]") {
  std::atomic<int> done{0};
  {
    mgpu::Stream stream(Device{DeviceKind::host, 0});
    for (int i = 0; i < 10; ++i) {
      stream.enqueue([&] {
        std::this_thread::sleep_for(1ms);
        ++done;
      });
    }
    mgpu::Stream moved = std::move(stream);
  }
  CHECK(done == 10);
}

TEST_CASE("Work can be enqueued from many threads at once", "[core][stream]") {
  mgpu::Stream stream(Device{DeviceKind::host, 0});
  std::atomic<int> sum{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 500; ++i) stream.enqueue([&] { sum.fetch_add(1, std::memory_order_relaxed); });
    });
  }
  for (auto& t : threads) t.join();
  stream.synchronize();
  CHECK(sum == 2000);
}

TEST_CASE("An inline scope runs work on the calling thread while the stream is idle, keeping its order", "[core][stream]") {
  mgpu::Stream stream(Device{DeviceKind::host, 0});
  auto const caller = std::this_thread::get_id();
  std::vector<char> order;  // appended by whichever thread runs the work, one at a time
  std::thread::id ran_on;
  {
    mgpu::Stream::InlineScope const here(stream);
    stream.enqueue([&] {
      ran_on = std::this_thread::get_id();
      order.push_back('a');
    });
    CHECK(order == std::vector<char>{'a'});  // ran before enqueue returned, without synchronize
    CHECK(ran_on == caller);

    // Busy with work from another thread: what this thread enqueues now is queued behind it.
    Gate gate;
    std::thread([&] { stream.enqueue([&] { gate.wait(); order.push_back('b'); }); }).join();
    stream.enqueue([&] {
      ran_on = std::this_thread::get_id();
      order.push_back('c');
    });
    CHECK(order.size() == 1);
    gate.open();
    stream.synchronize();
    CHECK(order == std::vector<char>{'a', 'b', 'c'});
    CHECK(ran_on != caller);

    // Work another thread enqueues while work runs here waits for it.
    std::atomic<bool> running{false}, enqueued{false};
    std::thread other([&] {
      while (!running) std::this_thread::yield();
      stream.enqueue([&] { order.push_back('e'); });
      enqueued = true;
    });
    stream.enqueue([&] {
      running = true;
      while (!enqueued) std::this_thread::yield();
      std::this_thread::sleep_for(20ms);  // time for a worker that did not wait to run 'e' first
      order.push_back('d');
    });
    other.join();
    stream.synchronize();
    CHECK(order == std::vector<char>{'a', 'b', 'c', 'd', 'e'});

    // A failure is kept for synchronize and skips later work, as on the worker.
    bool later_ran = false;
    CHECK_NOTHROW(stream.enqueue([] { throw std::runtime_error("boom"); }));
    stream.enqueue([&] { later_ran = true; });
    REQUIRE_MGPU_ERROR(stream.synchronize(), mgpu::Errc::device, "host work on host:0 threw: boom");
    CHECK_FALSE(later_ran);
    stream.enqueue([&] { later_ran = true; });
    CHECK(later_ran);

    {  // a nested scope on another stream replaces this one until it ends
      mgpu::Stream second(Device{DeviceKind::host, 1});
      mgpu::Stream::InlineScope const inner(second);
      std::thread::id second_ran_on;
      second.enqueue([&] { second_ran_on = std::this_thread::get_id(); });
      CHECK(second_ran_on == caller);
      stream.enqueue([&] { ran_on = std::this_thread::get_id(); });
      stream.synchronize();
      CHECK(ran_on != caller);
    }
    stream.enqueue([&] { ran_on = std::this_thread::get_id(); });
    CHECK(ran_on == caller);
  }
  stream.enqueue([&] { ran_on = std::this_thread::get_id(); });  // the scope has ended
  stream.synchronize();
  CHECK(ran_on != caller);
}

TEST_CASE("Inline work on an emulated slower device is stretched as on the worker", "[core][stream]") {
  mgpu::Stream slow(mgpu::parse_devices("host:1@speed=0.5")[0]);
  mgpu::Stream::InlineScope const here(slow);
  auto const start = std::chrono::steady_clock::now();
  slow.enqueue([] { std::this_thread::sleep_for(20ms); });
  slow.synchronize();
  CHECK(std::chrono::steady_clock::now() - start >= 40ms);  // 20 ms of work at half speed
}
