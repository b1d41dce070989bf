// The caching allocator and its buffers.
#include <mgpu/core/memory.hpp>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include <mgpu/core/deadline.hpp>
#include <mgpu/core/error.hpp>

#include "core/backend.hpp"
#include "core/cuda_backend.hpp"

namespace mgpu {
namespace {

using Clock = std::chrono::steady_clock;

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

void Buffer::record_stream(Stream& stream) {
  if (owner_ && data_ != nullptr) owner_->record_use(data_, stream);
}

std::shared_ptr<Allocator> Allocator::create(Device device, std::optional<std::size_t> limit) {
  return std::shared_ptr<Allocator>(new Allocator(device, limit));
}

Allocator::Allocator(Device device, std::optional<std::size_t> limit) : device_(device), limit_(limit) {}

Allocator::~Allocator() {
  std::vector<void*> blocks;
  std::vector<PendingBlock> pending;
  detach_cached_locked(blocks, pending);  // no other thread can hold a reference any more
  pending.insert(pending.end(), std::make_move_iterator(pending_.begin()), std::make_move_iterator(pending_.end()));
  pending_.clear();
  free_detached(blocks, pending);
  for (auto& [block, cached] : pinned_cache_) {
    for (void* data : cached) {
      if (pinned_memory_available()) {
        detail::cuda::pinned_free(data);
      } else {
        std::free(data);
      }
    }
  }
  for (auto& [ordinal, events] : spare_events_) {
    for (void* event : events) detail::cuda::event_destroy(event);
  }
}

std::size_t Allocator::block_size(std::size_t bytes) noexcept {
  if (bytes <= 4096) return (bytes + 511) / 512 * 512;
  std::size_t const step = std::bit_floor(bytes) / 8;  // >= 512: classes waste at most 1/8
  return (bytes + step - 1) / step * step;
}

Buffer Allocator::allocate(std::size_t bytes) { return allocate(bytes, std::optional<std::uint64_t>()); }

Buffer Allocator::allocate(std::size_t bytes, Stream& stream) {
  return allocate(bytes, std::optional<std::uint64_t>(detail::StreamInternals::id(stream)));
}

Buffer Allocator::allocate(std::size_t bytes, std::optional<std::uint64_t> stream) {
  if (bytes == 0) return {};
  std::size_t const block = block_size(bytes);
  // When the block does not fit, cached blocks go back to the device (without the lock: cudaFree
  // waits for the GPU, and host callbacks that drop tensors take the lock) and the request is tried
  // again. Blocks freed while queued GPU work still uses them are never waited for with a blocking
  // call: that work may wait for this very thread (a send whose receiver is this rank, on another
  // logical device of the GPU). They are polled, at most for the communicators' deadline, and then
  // the request fails.
  std::optional<Clock::time_point> wait_until;
  while (true) {
    std::vector<void*> to_free;
    bool reserved = false;
    bool awaiting_work = false;
    {
      std::lock_guard lock(mutex_);
      reclaim_completed_locked();
      void* data = stream ? take_same_stream_locked(block, *stream) : nullptr;
      if (auto it = cache_.find(block); data == nullptr && it != cache_.end() && !it->second.empty()) {
        data = it->second.back();
        it->second.pop_back();
      }
      if (data != nullptr) {
        stats_.cached -= block;
        ++stats_.cache_hits;
        stats_.allocated += block;
        stats_.peak_allocated = std::max(stats_.peak_allocated, stats_.allocated);
        ++stats_.allocations;
        return Buffer(shared_from_this(), data, bytes, block, device_, false);
      }
      if (!limit_ || stats_.reserved + block <= *limit_) {
        stats_.reserved += block;  // held while the device allocates, outside the lock
        reserved = true;
      } else {
        detach_idle_locked(to_free);
        awaiting_work = pending_device_bytes_locked() > 0;
      }
    }
    if (reserved) {
      void* const data = system_allocate(device_, block);
      std::lock_guard lock(mutex_);
      if (data != nullptr) {
        stats_.allocated += block;
        stats_.peak_allocated = std::max(stats_.peak_allocated, stats_.allocated);
        ++stats_.allocations;
        return Buffer(shared_from_this(), data, bytes, block, device_, false);
      }
      stats_.reserved -= block;  // the device itself is full
      detach_idle_locked(to_free);
      awaiting_work = pending_device_bytes_locked() > 0;
    }
    if (!to_free.empty()) {  // each round that frees a block makes progress: try again
      for (void* data : to_free) system_free(device_, data);
      continue;
    }
    if (!awaiting_work) break;
    if (!wait_until) wait_until = Clock::now() + default_timeout();
    if (Clock::now() > *wait_until) break;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  std::lock_guard lock(mutex_);
  std::string free_text;
  if (limit_) {
    free_text = "limit " + format_bytes(*limit_) + ", " + format_bytes(stats_.allocated) + " allocated, " +
                format_bytes(*limit_ - std::min(*limit_, stats_.reserved)) + " free";
  } else if (device_.kind == DeviceKind::cuda) {
    std::size_t free = 0;
    std::size_t total = 0;
    detail::cuda::memory_info(device_.index, free, total);
    free_text = format_bytes(stats_.allocated) + " allocated by mgpu, " + format_bytes(free) + " of " + format_bytes(total) +
                " free on the GPU";
  } else {
    free_text = format_bytes(stats_.allocated) + " allocated, the host has no more memory";
  }
  if (std::size_t const awaiting = pending_device_bytes_locked(); awaiting > 0)
    free_text += ", " + format_bytes(awaiting) + " freed but still used by queued GPU work" +
                 (wait_until ? " after a wait of " + format_duration(default_timeout()) : std::string());
  throw Error(Errc::out_of_memory, "out of memory on " + device_.to_string() + ": requested " + format_bytes(bytes) +
                                       " (block of " + format_bytes(block) + "); " + free_text +
                                       " (expected a request that fits in the free memory)");
}

Buffer Allocator::allocate_pinned(std::size_t bytes) {
  if (bytes == 0) return {};
  std::size_t const block = block_size(bytes);
  bool const pinned = pinned_memory_available();
  {
    std::lock_guard lock(mutex_);
    reclaim_completed_locked();
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
  if (!pinned) {
    stats_.allocated -= block;
    stats_.cached += block;
  }
  if (auto it = uses_.find(data); it != uses_.end()) {
    pending_.push_back({data, block, pinned, std::move(it->second)});
    uses_.erase(it);
    return;
  }
  (pinned ? pinned_cache_ : cache_)[block].push_back(data);
}

void Allocator::record_use(void* data, Stream& stream) {
  std::uint64_t const id = detail::StreamInternals::id(stream);
  bool const cuda = stream.device().kind == DeviceKind::cuda;
  // A host stream needs no marker placed: it counts the work it has run.
  std::optional<detail::StreamInternals::HostPosition> host;
  if (!cuda) host = detail::StreamInternals::host_position(stream);
  std::lock_guard lock(mutex_);
  std::vector<StreamUse>& uses = uses_[data];
  auto it = std::find_if(uses.begin(), uses.end(), [&](StreamUse const& u) { return u.stream == id; });
  if (it == uses.end()) {
    StreamUse use{id, -1, nullptr, host ? std::move(host->progress) : nullptr, 0};
    if (cuda) {
      use.ordinal = stream.device().index;
      if (auto& spare = spare_events_[use.ordinal]; !spare.empty()) {
        use.event = spare.back();
        spare.pop_back();
      } else {
        use.event = detail::cuda::event_create_untimed(use.ordinal);
      }
    }
    it = uses.insert(uses.end(), std::move(use));
  }
  // A later use on the same stream moves the marker.
  if (cuda) {
    detail::cuda::event_record(it->event, stream.native_handle());
  } else {
    it->position = std::max(it->position, host->position);
  }
}

bool Allocator::StreamUse::finished() const {
  if (progress) return progress->load(std::memory_order_acquire) >= position;
  try {
    return detail::cuda::event_query(event);
  } catch (...) {  // a failed GPU runs none of the work any more: the block is free
    return true;
  }
}

void Allocator::recycle_event(StreamUse& use) noexcept {
  if (use.progress) return;
  try {
    spare_events_[use.ordinal].push_back(use.event);
  } catch (...) {
    detail::cuda::event_destroy(use.event);
  }
}

void Allocator::reclaim_completed_locked() noexcept {
  for (auto it = pending_.begin(); it != pending_.end();) {
    auto const first_finished =
        std::stable_partition(it->uses.begin(), it->uses.end(), [](StreamUse const& use) { return !use.finished(); });
    for (auto use = first_finished; use != it->uses.end(); ++use) recycle_event(*use);
    it->uses.erase(first_finished, it->uses.end());
    if (!it->uses.empty()) {
      ++it;
      continue;
    }
    (it->pinned ? pinned_cache_ : cache_)[it->block].push_back(it->data);
    it = pending_.erase(it);
  }
}

void* Allocator::take_same_stream_locked(std::size_t block, std::uint64_t stream) {
  auto const it = std::find_if(pending_.begin(), pending_.end(), [&](PendingBlock const& p) {
    return !p.pinned && p.block == block &&
           std::all_of(p.uses.begin(), p.uses.end(), [&](StreamUse const& use) { return use.stream == stream; });
  });
  if (it == pending_.end()) return nullptr;
  void* const data = it->data;
  uses_[data] = std::move(it->uses);  // the new owner's buffer is still behind that work on `stream`
  pending_.erase(it);
  return data;
}

void Allocator::detach_idle_locked(std::vector<void*>& blocks) noexcept {
  for (auto& [block, cached] : cache_) {
    for (void* data : cached) {
      blocks.push_back(data);
      stats_.reserved -= block;
      stats_.cached -= block;
    }
    cached.clear();
  }
}

std::size_t Allocator::pending_device_bytes_locked() const noexcept {
  std::size_t bytes = 0;
  for (PendingBlock const& p : pending_) bytes += p.pinned ? 0 : p.block;
  return bytes;
}

void Allocator::detach_cached_locked(std::vector<void*>& blocks, std::vector<PendingBlock>& pending) noexcept {
  detach_idle_locked(blocks);
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (it->pinned) {
      ++it;
      continue;
    }
    stats_.reserved -= it->block;
    stats_.cached -= it->block;
    pending.push_back(std::move(*it));
    it = pending_.erase(it);
  }
}

void Allocator::free_detached(std::vector<void*> const& blocks, std::vector<PendingBlock>& pending) noexcept {
  for (PendingBlock& p : pending) {
    for (StreamUse const& use : p.uses) {
      if (use.progress) {  // a host stream's worker runs its queue to the end, also after a failure
        while (!use.finished()) std::this_thread::sleep_for(std::chrono::microseconds(100));
        continue;
      }
      try {
        detail::cuda::event_synchronize(use.event);
      } catch (...) {  // as in reclaim_completed_locked: no work runs on a failed GPU
      }
      detail::cuda::event_destroy(use.event);
    }
    if (!p.pinned) {
      system_free(device_, p.data);
    } else if (pinned_memory_available()) {
      detail::cuda::pinned_free(p.data);
    } else {
      std::free(p.data);
    }
  }
  for (void* data : blocks) system_free(device_, data);
}

void Allocator::release_cached() {
  std::vector<void*> blocks;
  std::vector<PendingBlock> pending;
  {
    std::lock_guard lock(mutex_);
    detach_cached_locked(blocks, pending);
  }
  free_detached(blocks, pending);
}

void Allocator::set_limit(std::optional<std::size_t> bytes) {
  std::vector<void*> blocks;
  std::vector<PendingBlock> pending;
  {
    std::lock_guard lock(mutex_);
    if (bytes && stats_.allocated > *bytes)
      throw Error(Errc::invalid_argument, "memory limit of " + format_bytes(*bytes) + " for " + device_.to_string() +
                                              " is below the " + format_bytes(stats_.allocated) +
                                              " already allocated (expected a limit of at least that)");
    limit_ = bytes;
    if (limit_ && stats_.reserved > *limit_) detach_cached_locked(blocks, pending);
  }
  free_detached(blocks, pending);
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

void detail::BufferInternals::record_use(Stream& stream, Buffer const& buffer) {
  if (!buffer.owner_ || buffer.data_ == nullptr) return;
  buffer.owner_->record_use(buffer.data_, stream);
}

void detail::BufferInternals::record_use(Stream& stream, Tensor const& tensor) {
  if (tensor.storage_) record_use(stream, *tensor.storage_);
}

void detail::BufferInternals::record_use(Stream& stream, std::vector<Tensor> const& tensors) {
  for (Tensor const& t : tensors) record_use(stream, t);
}

Allocator& detail::BufferInternals::allocator(Tensor const& tensor) { return *tensor.storage_->owner_; }

void detail::BufferInternals::release_memory(Tensor const& tensor) {
  if (tensor.storage_ && tensor.storage_->data_ != nullptr) *tensor.storage_ = Buffer{};
}

void detail::BufferInternals::acquire_memory(Tensor const& tensor, std::size_t bytes, Allocator& allocator, Stream& stream) {
  if (tensor.storage_ && tensor.storage_->data_ == nullptr) *tensor.storage_ = allocator.allocate(bytes, stream);
}

Tensor detail::BufferInternals::unowned(Tensor const& tensor) {
  Tensor view = tensor;
  if (Buffer const* b = tensor.storage_.get())  // no owner: its destructor returns nothing
    view.storage_ = std::make_shared<Buffer>(Buffer(nullptr, b->data_, b->size_, b->block_, b->device_, b->pinned_));
  return view;
}

}  // namespace mgpu
