// The caching allocator and its buffers.
#include <mgpu/core/memory.hpp>

#include "core/host_staging.hpp"

#include <bit>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

#include <mgpu/core/error.hpp>

#include "core/cuda_backend.hpp"

namespace mgpu {
namespace {

constexpr std::size_t alignment = 256;

bool pinned_memory_available() {
  static bool const available = detail::cuda::device_count() > 0;
  return available;
}

void* system_allocate(Device device, std::size_t block) {
  if (device.kind == DeviceKind::cuda) return detail::cuda::device_malloc(device.index, block);
  return std::aligned_alloc(alignment, block);
}

void system_free(Device device, void* data) noexcept {
  if (device.kind == DeviceKind::cuda) {
    detail::cuda::device_free(device.index, data);
  } else {
    std::free(data);
  }
}

}  // namespace

std::string format_bytes(std::size_t bytes) {
  char text[32];
  if (bytes < 1024) {
    std::snprintf(text, sizeof text, "%zu B", bytes);
  } else if (bytes < (std::size_t{1} << 20)) {
    std::snprintf(text, sizeof text, "%.1f KiB", static_cast<double>(bytes) / 1024.0);
  } else if (bytes < (std::size_t{1} << 30)) {
    std::snprintf(text, sizeof text, "%.1f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  } else {
    std::snprintf(text, sizeof text, "%.2f GiB", static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
  }
  return text;
}

Buffer::Buffer(std::shared_ptr<Allocator> owner, void* data, std::size_t size, std::size_t block, Device device,
               bool pinned) noexcept
    : owner_(std::move(owner)), data_(data), size_(size), block_(block), device_(device), pinned_(pinned) {}

Buffer::Buffer(Buffer&& other) noexcept
    : owner_(std::move(other.owner_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      block_(std::exchange(other.block_, 0)),
      device_(other.device_),
      pinned_(other.pinned_) {}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    Buffer old(std::move(*this));
    owner_ = std::move(other.owner_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    block_ = std::exchange(other.block_, 0);
    device_ = other.device_;
    pinned_ = other.pinned_;
  }
  return *this;
}

Buffer::~Buffer() {
  if (owner_ && data_ != nullptr) owner_->release(data_, block_, pinned_);
}

std::shared_ptr<Allocator> Allocator::create(Device device, std::optional<std::size_t> limit) {
  return std::shared_ptr<Allocator>(new Allocator(device, limit));
}

Allocator::Allocator(Device device, std::optional<std::size_t> limit) : device_(device), limit_(limit) {}

Allocator::~Allocator() {
  std::lock_guard lock(mutex_);
  release_cached_locked();
  for (auto& [block, blocks] : pinned_cache_) {
    for (void* data : blocks) {
      if (pinned_memory_available()) {
        detail::cuda::pinned_free(data);
      } else {
        std::free(data);
      }
    }
  }
}

std::size_t Allocator::block_size(std::size_t bytes) noexcept {
  if (bytes <= 4096) return (bytes + 511) / 512 * 512;
  std::size_t const step = std::bit_floor(bytes) / 8;  // >= 512: classes waste at most 1/8
  return (bytes + step - 1) / step * step;
}

Buffer Allocator::allocate(std::size_t bytes) {
  if (bytes == 0) return {};
  std::size_t const block = block_size(bytes);
  std::lock_guard lock(mutex_);
  void* data = nullptr;
  if (auto it = cache_.find(block); it != cache_.end() && !it->second.empty()) {
    data = it->second.back();
    it->second.pop_back();
    stats_.cached -= block;
    ++stats_.cache_hits;
  } else {
    auto const fits = [&] { return !limit_ || stats_.reserved + block <= *limit_; };
    if (!fits()) release_cached_locked();
    if (fits()) {
      data = system_allocate(device_, block);
      if (data == nullptr) {  // the device itself is full: give back the cache and try once more
        release_cached_locked();
        data = system_allocate(device_, block);
      }
    }
    if (data == nullptr) {
      std::string free_text;
      if (limit_) {
        free_text = "limit " + format_bytes(*limit_) + ", " + format_bytes(stats_.allocated) + " allocated, " +
                    format_bytes(*limit_ - std::min(*limit_, stats_.reserved)) + " free";
      } else if (device_.kind == DeviceKind::cuda) {
        std::size_t free = 0;
        std::size_t total = 0;
        detail::cuda::memory_info(device_.index, free, total);
        free_text = format_bytes(stats_.allocated) + " allocated by mgpu, " + format_bytes(free) + " of " +
                    format_bytes(total) + " free on the GPU";
      } else {
        free_text = format_bytes(stats_.allocated) + " allocated, the host has no more memory";
      }
      throw Error(Errc::out_of_memory, "out of memory on " + device_.to_string() + ": requested " +
                                           format_bytes(bytes) + " (block of " + format_bytes(block) + "); " +
                                           free_text + " (expected a request that fits in the free memory)");
    }
    stats_.reserved += block;
  }
  stats_.allocated += block;
  stats_.peak_allocated = std::max(stats_.peak_allocated, stats_.allocated);
  ++stats_.allocations;
  return Buffer(shared_from_this(), data, bytes, block, device_, false);
}

Buffer Allocator::allocate_pinned(std::size_t bytes) {
  if (bytes == 0) return {};
  std::size_t const block = block_size(bytes);
  bool const pinned = pinned_memory_available();
  {
    std::lock_guard lock(mutex_);
    if (auto it = pinned_cache_.find(block); it != pinned_cache_.end() && !it->second.empty()) {
      void* data = it->second.back();
      it->second.pop_back();
      return Buffer(shared_from_this(), data, bytes, block, Device{DeviceKind::host, 0}, true);
    }
  }
  void* data = pinned ? detail::cuda::pinned_malloc(block) : std::aligned_alloc(alignment, block);
  if (data == nullptr)
    throw Error(Errc::out_of_memory, "out of pinned host memory: requested " + format_bytes(bytes) +
                                         " (expected a request the host can lock)");
  return Buffer(shared_from_this(), data, bytes, block, Device{DeviceKind::host, 0}, true);
}

void Allocator::release(void* data, std::size_t block, bool pinned) noexcept {
  std::lock_guard lock(mutex_);
  if (pinned) {
    pinned_cache_[block].push_back(data);
    return;
  }
  stats_.allocated -= block;
  stats_.cached += block;
  cache_[block].push_back(data);
}

void Allocator::release_cached_locked() noexcept {
  for (auto& [block, blocks] : cache_) {
    for (void* data : blocks) {
      system_free(device_, data);
      stats_.reserved -= block;
      stats_.cached -= block;
    }
    blocks.clear();
  }
}

void Allocator::release_cached() {
  std::lock_guard lock(mutex_);
  release_cached_locked();
}

void Allocator::set_limit(std::optional<std::size_t> bytes) {
  std::lock_guard lock(mutex_);
  if (bytes && stats_.allocated > *bytes)
    throw Error(Errc::invalid_argument, "memory limit of " + format_bytes(*bytes) + " for " + device_.to_string() +
                                            " is below the " + format_bytes(stats_.allocated) +
                                            " already allocated (expected a limit of at least that)");
  limit_ = bytes;
  if (limit_ && stats_.reserved > *limit_) release_cached_locked();
}

std::optional<std::size_t> Allocator::limit() const {
  std::lock_guard lock(mutex_);
  return limit_;
}

MemoryStats Allocator::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

void Allocator::reset_peak() {
  std::lock_guard lock(mutex_);
  stats_.peak_allocated = stats_.allocated;
}

Allocator& detail::host_staging_allocator() {
  static std::shared_ptr<Allocator> const pool = Allocator::create(Device{DeviceKind::host, 0});
  return *pool;
}

}  // namespace mgpu
