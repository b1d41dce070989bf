// The caching allocator: reuse, statistics, limits, thread safety, stream-ordered reuse.
#include <mgpu/core/memory.hpp>
#include <mgpu/core/tensor.hpp>

#include <atomic>
#include <cstdint>
#include <future>
#include <thread>
#include <vector>

#include "support/catch.hpp"
#include "support/expect_error.hpp"

using mgpu::Allocator;
using mgpu::Device;
using mgpu::DeviceKind;

TEST_CASE("Block sizes are aligned classes with at most 1/8 waste", "[core][memory]") {
  CHECK(Allocator::block_size(1) == 512);
  CHECK(Allocator::block_size(512) == 512);
  CHECK(Allocator::block_size(513) == 1024);
  CHECK(Allocator::block_size(4096) == 4096);
  for (std::size_t bytes = 1; bytes < (std::size_t{1} << 26); bytes = bytes * 3 / 2 + 1) {
    std::size_t const block = Allocator::block_size(bytes);
    REQUIRE(block >= bytes);
    REQUIRE(block % 512 == 0);
    if (bytes > 4096) REQUIRE(static_cast<double>(block - bytes) <= static_cast<double>(bytes) / 8.0);
    REQUIRE(Allocator::block_size(block) == block);  // classes are fixed points
  }
}

TEST_CASE("Freed blocks are reused and statistics follow", "[core][memory]") {
  auto allocator = Allocator::create(Device{DeviceKind::host, 0});
  void* first = nullptr;
  {
    mgpu::Buffer a = allocator->allocate(1000);
    first = a.data();
    CHECK(a.size() == 1000);
    CHECK(reinterpret_cast<std::uintptr_t>(a.data()) % 256 == 0);
    auto const s = allocator->stats();
    CHECK(s.allocated == 1024);
    CHECK(s.reserved == 1024);
    CHECK(s.peak_allocated == 1024);
  }
  auto s = allocator->stats();
  CHECK(s.allocated == 0);
  CHECK(s.cached == 1024);
  CHECK(s.reserved == 1024);

  mgpu::Buffer b = allocator->allocate(900);  // same class: served from the cache
  CHECK(b.data() == first);
  s = allocator->stats();
  CHECK(s.cache_hits == 1);
  CHECK(s.allocations == 2);

  {
    mgpu::Buffer big = allocator->allocate(1 << 20);
    CHECK(allocator->stats().peak_allocated == 1024 + (1 << 20));
  }
  CHECK(allocator->stats().peak_allocated == 1024 + (1 << 20));
  allocator->reset_peak();
  CHECK(allocator->stats().peak_allocated == 1024);

  allocator->release_cached();
  s = allocator->stats();
  CHECK(s.cached == 0);
  CHECK(s.reserved == 1024);

  mgpu::Buffer empty = allocator->allocate(0);
  CHECK(empty.data() == nullptr);
  CHECK(empty.size() == 0);
}

TEST_CASE("Buffers move and keep their allocator alive", "[core][memory]") {
  mgpu::Buffer kept;
  {
    auto allocator = Allocator::create(Device{DeviceKind::host, 3});
    mgpu::Buffer a = allocator->allocate(64);
    kept = std::move(a);
    CHECK(a.data() == nullptr);  // NOLINT(bugprone-use-after-move): moved-from state is specified
  }
  CHECK(kept.data() != nullptr);
  CHECK(kept.device() == Device{DeviceKind::host, 3});
  static_cast<char*>(kept.data())[63] = 1;
}

TEST_CASE("A memory limit raises out_of_memory naming device, request and free bytes", "[core][memory]") {
  auto allocator = Allocator::create(Device{DeviceKind::host, 1}, std::size_t{1} << 20);
  CHECK(allocator->limit() == std::size_t{1} << 20);
  mgpu::Buffer a = allocator->allocate(768 << 10);
  REQUIRE_MGPU_ERROR(allocator->allocate(512 << 10), mgpu::Errc::out_of_memory, "out of memory on host:1: requested 512.0 KiB");
  REQUIRE_MGPU_ERROR(allocator->allocate(512 << 10), mgpu::Errc::out_of_memory, "limit 1.0 MiB, 768.0 KiB allocated, 256.0 KiB free");
  CHECK(allocator->stats().reserved <= std::size_t{1} << 20);

  {  // a cached block is released to make room for a different class
    mgpu::Buffer small = allocator->allocate(200 << 10);
  }
  CHECK(allocator->stats().cached > 0);
  mgpu::Buffer b = allocator->allocate(256 << 10);
  CHECK(allocator->stats().reserved <= std::size_t{1} << 20);

  REQUIRE_MGPU_ERROR(allocator->set_limit(1024), mgpu::Errc::invalid_argument, "below the 1.0 MiB already allocated");
  allocator->set_limit(std::nullopt);
  mgpu::Buffer c = allocator->allocate(4 << 20);
  CHECK(c.data() != nullptr);
}

TEST_CASE("Concurrent allocations never exceed the limit", "[core][memory]") {
  constexpr std::size_t limit = 8 << 20;
  auto allocator = Allocator::create(Device{DeviceKind::host, 0}, limit);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  std::atomic<bool> over_limit{false};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::vector<mgpu::Buffer> held;
      for (int i = 0; i < 300; ++i) {
        try {
          held.push_back(allocator->allocate(static_cast<std::size_t>((i * 7 + t) % 13 + 1) << 16));
        } catch (mgpu::Error const&) {
          ++failures;
          held.clear();
        }
        if (held.size() > 6) held.erase(held.begin());
        if (allocator->stats().reserved > limit) over_limit = true;
      }
    });
  }
  for (auto& t : threads) t.join();
  auto const s = allocator->stats();
  CHECK_FALSE(over_limit);
  CHECK(s.allocated == 0);
  CHECK(s.reserved <= limit);
}

TEST_CASE("Pinned staging buffers are reused and not counted against the limit", "[core][memory]") {
  auto allocator = Allocator::create(Device{DeviceKind::host, 0}, 4096);
  void* first = nullptr;
  {
    mgpu::Buffer staging = allocator->allocate_pinned(1 << 20);
    first = staging.data();
    CHECK(staging.pinned());
  }
  mgpu::Buffer again = allocator->allocate_pinned(1 << 20);
  CHECK(again.data() == first);
  CHECK(allocator->stats().allocated == 0);
}

namespace {
// Holds a stream with host work that waits until open() (or the end of the scope, so that a failed
// check never leaves the stream blocked).
class Gate {
 public:
  explicit Gate(mgpu::Stream& stream) {
    stream.enqueue([opened = promise_.get_future().share()] { opened.wait(); });
  }
  Gate(Gate const&) = delete;
  Gate& operator=(Gate const&) = delete;
  ~Gate() { open(); }
  void open() {
    if (!opened_) promise_.set_value();
    opened_ = true;
  }

 private:
  std::promise<void> promise_;
  bool opened_ = false;
};
}  // namespace

TEST_CASE("A freed block goes back to its stream at once, to other streams after its work", "[core][memory][stream]") {
  auto allocator = Allocator::create(Device{DeviceKind::host, 0});
  mgpu::Stream mine(Device{DeviceKind::host, 0});
  mgpu::Stream other(Device{DeviceKind::host, 0});
  std::vector<int> order;  // written only by `mine`'s work
  Gate gate(mine);         // nothing on `mine` runs until the gate opens
  void* freed = nullptr;
  {
    mgpu::Buffer a = allocator->allocate(4096, mine);
    freed = a.data();
    mine.enqueue([p = static_cast<int*>(a.data()), &order] {
      p[0] = 1;
      order.push_back(p[0]);
    });
    a.record_stream(mine);
  }  // freed while its work waits behind the gate
  mgpu::Buffer for_other = allocator->allocate(4096, other);
  CHECK(for_other.data() != freed);
  mgpu::Buffer plain = allocator->allocate(4096);
  CHECK(plain.data() != freed);
  CHECK(allocator->stats().cache_hits == 0);

  // The same stream gets the block while its earlier work has not run (the gate is closed): its
  // next work runs after that work, in stream order.
  mgpu::Buffer again = allocator->allocate(4096, mine);
  CHECK(again.data() == freed);
  CHECK_FALSE(mine.query());
  CHECK(allocator->stats().cache_hits == 1);
  CHECK(allocator->stats().allocated == 3 * 4096);
  mine.enqueue([p = static_cast<int*>(again.data()), &order] {
    p[0] += 10;
    order.push_back(p[0]);
  });
  again.record_stream(mine);
  again = mgpu::Buffer();  // freed again before anything ran: it keeps its place behind the work
  mgpu::Buffer second_for_other = allocator->allocate(4096, other);
  CHECK(second_for_other.data() != freed);

  gate.open();
  mine.synchronize();
  CHECK(order == std::vector<int>{1, 11});
  // The work has run: any stream, and plain allocate(), may have the block now.
  mgpu::Buffer after = allocator->allocate(4096, other);
  CHECK(after.data() == freed);
}

TEST_CASE("Copies and fills on a host stream release their tensors in stream order, as on a GPU", "[core][memory][stream]") {
  auto allocator = Allocator::create(Device{DeviceKind::host, 0});
  mgpu::Stream stream(Device{DeviceKind::host, 0});
  mgpu::Stream other(Device{DeviceKind::host, 0});
  mgpu::Tensor const y = mgpu::Tensor::empty({1024}, mgpu::DType::float32, *allocator, stream);
  std::size_t const block = Allocator::block_size(y.nbytes());
  Gate gate(stream);
  void* freed = nullptr;
  {
    mgpu::Tensor const x = mgpu::Tensor::empty({1024}, mgpu::DType::float32, *allocator, stream);
    freed = x.data();
    mgpu::fill_async(x, 3.0f, stream);
    mgpu::copy_async(y, x, stream);
  }  // the last handle of x goes while its fill and copy wait behind the gate
  CHECK(allocator->stats().allocated == block);  // counted as the issuing thread holds it
  mgpu::Tensor const for_other = mgpu::Tensor::empty({1024}, mgpu::DType::float32, *allocator, other);
  CHECK(for_other.data() != freed);  // another stream waits for the work
  mgpu::Tensor const z = mgpu::Tensor::empty({1024}, mgpu::DType::float32, *allocator, stream);
  CHECK(z.data() == freed);  // the stream itself reuses it at once: its work runs in order
  mgpu::fill_async(z, 7.0f, stream);
  CHECK_FALSE(stream.query());
  gate.open();
  stream.synchronize();
  for (float v : y.host_span<float>()) REQUIRE(v == 3.0f);  // the copy ran before the block was filled again
  for (float v : z.host_span<float>()) REQUIRE(v == 7.0f);
}

TEST_CASE("A block used by two streams goes to one of them only after the other's work", "[core][memory][stream]") {
  auto allocator = Allocator::create(Device{DeviceKind::host, 0});
  mgpu::Stream first(Device{DeviceKind::host, 0});
  mgpu::Stream second(Device{DeviceKind::host, 0});
  Gate first_gate(first);
  Gate second_gate(second);
  void* freed = nullptr;
  {
    mgpu::Buffer a = allocator->allocate(1 << 16, first);
    freed = a.data();
    a.record_stream(first);
    a.record_stream(second);
  }
  std::vector<mgpu::Buffer> held;                       // kept, so that each request below sees only `a`'s block
  held.push_back(allocator->allocate(1 << 16, first));  // the second stream's work may still use it
  held.push_back(allocator->allocate(1 << 16, second));
  second_gate.open();
  second.synchronize();
  // Only the first stream's use is left: the block is the first stream's at once, nobody else's.
  held.push_back(allocator->allocate(1 << 16, second));
  held.push_back(allocator->allocate(1 << 16));
  for (mgpu::Buffer const& b : held) CHECK(b.data() != freed);
  mgpu::Buffer back = allocator->allocate(1 << 16, first);
  CHECK(back.data() == freed);
  CHECK_FALSE(first.query());
  back = mgpu::Buffer();
  first_gate.open();
  first.synchronize();
  CHECK(allocator->allocate(1 << 16).data() == freed);
}

TEST_CASE("Releasing the cache waits for blocks that host-stream work still uses", "[core][memory][stream]") {
  auto allocator = Allocator::create(Device{DeviceKind::host, 0});
  mgpu::Stream stream(Device{DeviceKind::host, 0});
  std::atomic<bool> ran{false};
  {
    Gate gate(stream);
    mgpu::Buffer a = allocator->allocate(1 << 20);
    stream.enqueue([&ran] { ran = true; });
    a.record_stream(stream);
    a = mgpu::Buffer();
    CHECK(allocator->stats().cached == Allocator::block_size(1 << 20));
  }  // the gate opens; release_cached() frees the block once the work before its marker ran
  allocator->release_cached();
  CHECK(ran);
  CHECK(allocator->stats().cached == 0);
  CHECK(allocator->stats().reserved == 0);
}

TEST_CASE("format_bytes", "[core][memory]") {
  CHECK(mgpu::format_bytes(512) == "512 B");
  CHECK(mgpu::format_bytes(1536) == "1.5 KiB");
  CHECK(mgpu::format_bytes(3 << 20) == "3.0 MiB");
}
