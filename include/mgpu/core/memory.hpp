// Device memory: a caching allocator per device with statistics and an optional limit.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <mgpu/core/device.hpp>
#include <mgpu/core/stream.hpp>

namespace mgpu {

class Allocator;
namespace detail {
struct BufferInternals;  // the library's stream-ordered release (src/core/backend.hpp)
}

/// A block of device memory (or pinned host memory), owned (move-only). Returns the block to its
/// allocator's cache on destruction. Work that mgpu enqueues on streams (copies and ops on host and
/// CUDA streams, collectives on CUDA streams) records its use of the block: the allocator hands the
/// block to work on that same stream at once (Allocator::allocate(bytes, stream); the stream runs
/// in order) and to anyone else only once that work has completed. So the counters (MemoryStats)
/// follow what the issuing threads hold, as on a GPU, not how far behind them the streams' work is.
/// Work of one's own on a stream needs the Buffer kept alive until it has run, or record_stream().
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

  /// Records that the work enqueued on `stream` so far uses this block (on a host stream too): once
  /// the Buffer is gone, the allocator gives the block to `stream` at once and to other streams or
  /// plain allocate() only after that work has run. No effect on an empty Buffer.
  void record_stream(Stream& stream);

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
/// waste above 4 KiB) and freed blocks are kept per class for reuse. A freed block that stream work
/// still uses (recorded by the library's stream work, or Buffer::record_stream) keeps a marker per
/// stream after its last use there (a CUDA event; a host stream's count of work run): a request
/// for that one stream gets it at once (stream order makes the reuse safe), anyone else once the
/// markers have been reached (without host callbacks, never waited for on the host). With a limit, `reserved` never exceeds it: cached blocks are
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

  /// A block of at least `bytes` bytes, 256-byte aligned, that no queued work uses; an empty
  /// Buffer for 0 bytes. Throws Error(out_of_memory) naming the device, the request and what is free.
  Buffer allocate(std::size_t bytes);

  /// The same for work enqueued on `stream` from now on (stream ordered): the block may be one
  /// that was freed while earlier work on `stream` still used it, without waiting for that work.
  /// Other streams and the host touch it only after waiting for `stream` (an Event), as for the
  /// work of `stream` itself.
  Buffer allocate(std::size_t bytes, Stream& stream);

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

  // A marker after the last work on one stream that uses a block: an untimed CUDA event on a
  // CUDA stream; on a host stream the stream's count of work run, and the count it must reach.
  struct StreamUse {
    std::uint64_t stream;  // the stream's id (StreamInternals::id)
    int ordinal;           // CUDA: the event's GPU; -1 on a host stream
    void* event;           // CUDA
    std::shared_ptr<std::atomic<std::uint64_t> const> progress;  // host
    std::uint64_t position;                                      // host
    [[nodiscard]] bool finished() const;
  };
  // A freed block waiting for the work that still uses it.
  struct PendingBlock {
    void* data;
    std::size_t block;
    bool pinned;
    std::vector<StreamUse> uses;
  };

  Buffer allocate(std::size_t bytes, std::optional<std::uint64_t> stream);
  void release(void* data, std::size_t block, bool pinned) noexcept;
  void record_use(void* data, Stream& stream);
  // Drops the finished uses of pending blocks; moves those with none left into the caches.
  void reclaim_completed_locked() noexcept;
  // A pending device block of size `block` whose only unfinished uses are on `stream`, taken out
  // of the books with its uses (they stay the block's); nullptr when there is none.
  void* take_same_stream_locked(std::size_t block, std::uint64_t stream);
  // Takes every cached device block out of the books (not those awaiting work), for freeing
  // without the lock.
  void detach_idle_locked(std::vector<void*>& blocks) noexcept;
  // Device bytes freed by their buffers whose GPU work has not finished yet.
  [[nodiscard]] std::size_t pending_device_bytes_locked() const noexcept;
  // Takes every cached device block (and every pending one) out of the books, for freeing
  // without the lock.
  void detach_cached_locked(std::vector<void*>& blocks, std::vector<PendingBlock>& pending) noexcept;
  void free_detached(std::vector<void*> const& blocks, std::vector<PendingBlock>& pending) noexcept;
  void recycle_event(StreamUse& use) noexcept;

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
