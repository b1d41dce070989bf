// Device memory: a caching allocator per device with statistics and an optional limit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <mgpu/core/device.hpp>

namespace mgpu {

class Allocator;
namespace detail {
struct BufferInternals;  // the library's stream-ordered release (src/core/backend.hpp)
}

/// A block of device memory (or pinned host memory), owned (move-only). Returns the block to its
/// allocator's cache on destruction. Work that mgpu enqueues on CUDA streams (copies, ops,
/// collectives) records its use of the block, and the allocator reuses the block only once that
/// work has finished; work of one's own on a stream needs the Buffer kept alive until it has run.
class Buffer {
 public:
  Buffer() = default;
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(Buffer const&) = delete;
  Buffer& operator=(Buffer const&) = delete;
  ~Buffer();

  [[nodiscard]] void* data() const noexcept { return data_; }
  /// The bytes asked for (the block itself may be larger).
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] Device device() const noexcept { return device_; }
  /// True for page-locked host memory that CUDA can copy from asynchronously.
  [[nodiscard]] bool pinned() const noexcept { return pinned_; }

 private:
  friend class Allocator;
  friend struct detail::BufferInternals;
  Buffer(std::shared_ptr<Allocator> owner, void* data, std::size_t size, std::size_t block,
         Device device, bool pinned) noexcept;
  std::shared_ptr<Allocator> owner_;
  void* data_ = nullptr;
  std::size_t size_ = 0;
  std::size_t block_ = 0;
  Device device_{};
  bool pinned_ = false;
};

/// An allocator's counters, in bytes unless named otherwise.
struct MemoryStats {
  std::size_t allocated = 0;       ///< held by live buffers (block sizes)
  std::size_t reserved = 0;        ///< taken from the device: allocated plus cached
  std::size_t peak_allocated = 0;  ///< highest `allocated` since creation or reset_peak()
  std::size_t cached = 0;          ///< free blocks kept for reuse
  std::uint64_t allocations = 0;   ///< allocate() calls that returned a block
  std::uint64_t cache_hits = 0;    ///< of those, served from the cache
};

/// A caching allocator for one device. Block sizes are rounded up to size classes (at most 1/8
/// waste above 4 KiB) and freed blocks are kept per class for reuse. A freed block that CUDA work
/// still uses waits, with an event recorded after that work, until the event has completed (stream
/// ordered, without host callbacks). With a limit, `reserved` never exceeds it: cached blocks are
/// released first, blocks awaiting GPU work are polled (never waited for with a blocking call, for
/// at most the library's deadline, default_timeout()), then Error(out_of_memory) is thrown. Thread-safe; memory is returned to the
/// device outside the allocator's lock. Create with Allocator::create(); buffers keep their
/// allocator alive.
class Allocator : public std::enable_shared_from_this<Allocator> {
 public:
  /// An allocator for `device`, limited to `limit` bytes when given.
  static std::shared_ptr<Allocator> create(Device device, std::optional<std::size_t> limit = {});

  Allocator(Allocator const&) = delete;
  Allocator& operator=(Allocator const&) = delete;
  ~Allocator();

  [[nodiscard]] Device device() const noexcept { return device_; }

  /// A block of at least `bytes` bytes, 256-byte aligned; an empty Buffer for 0 bytes.
  /// Throws Error(out_of_memory) naming the device, the request and what is free.
  Buffer allocate(std::size_t bytes);

  /// Page-locked host memory for staging CUDA copies (plain host memory on host devices). Not
  /// counted against the device's limit.
  Buffer allocate_pinned(std::size_t bytes);

  /// Limits `reserved` to `bytes` (std::nullopt: no limit). Throws Error(invalid_argument) when
  /// more than that is already allocated.
  void set_limit(std::optional<std::size_t> bytes);
  [[nodiscard]] std::optional<std::size_t> limit() const;

  [[nodiscard]] MemoryStats stats() const;
  /// Sets peak_allocated to the current allocated bytes.
  void reset_peak();
  /// Returns every cached block to the device.
  void release_cached();

  /// The block size a request of `bytes` is served with.
  static std::size_t block_size(std::size_t bytes) noexcept;

 private:
  Allocator(Device device, std::optional<std::size_t> limit);
  friend class Buffer;
  friend struct detail::BufferInternals;

  // An event recorded on a CUDA stream after the last work there that uses a block.
  struct StreamUse {
    void* stream;
    int ordinal;  // the stream's GPU (the event's)
    void* event;
  };
  // A freed block waiting for the work that still uses it.
  struct PendingBlock {
    void* data;
    std::size_t block;
    bool pinned;
    std::vector<StreamUse> uses;
  };

  void release(void* data, std::size_t block, bool pinned) noexcept;
  void record_use(void* data, void* stream, int ordinal);
  // Moves pending blocks whose work has finished into the caches.
  void reclaim_completed_locked() noexcept;
  // Takes every cached device block out of the books (not those awaiting work), for freeing
  // without the lock.
  void detach_idle_locked(std::vector<void*>& blocks) noexcept;
  // Device bytes freed by their buffers whose GPU work has not finished yet.
  [[nodiscard]] std::size_t pending_device_bytes_locked() const noexcept;
  // Takes every cached device block (and every pending one) out of the books, for freeing
  // without the lock.
  void detach_cached_locked(std::vector<void*>& blocks, std::vector<PendingBlock>& pending) noexcept;
  void free_detached(std::vector<void*> const& blocks, std::vector<PendingBlock>& pending) noexcept;
  void recycle_event(StreamUse const& use) noexcept;

  Device device_;
  mutable std::mutex mutex_;
  std::optional<std::size_t> limit_;
  MemoryStats stats_;
  std::unordered_map<std::size_t, std::vector<void*>> cache_;  // block size -> free blocks
  std::unordered_map<std::size_t, std::vector<void*>> pinned_cache_;
  std::unordered_map<void*, std::vector<StreamUse>> uses_;  // live block -> its CUDA uses
  std::vector<PendingBlock> pending_;
  std::unordered_map<int, std::vector<void*>> spare_events_;  // GPU -> events to record again
};

/// "1.5 MiB", "512 B": a byte count for messages.
std::string format_bytes(std::size_t bytes);

}  // namespace mgpu
