// The caching allocator: reuse, statistics, limits, thread safety.
#include <mgpu/core/memory.hpp>

#include <atomic>
#include <cstdint>
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

TEST_CASE("format_bytes", "[core][memory]") {
  CHECK(mgpu::format_bytes(512) == "512 B");
  CHECK(mgpu::format_bytes(1536) == "1.5 KiB");
  CHECK(mgpu::format_bytes(3 << 20) == "3.0 MiB");
}
