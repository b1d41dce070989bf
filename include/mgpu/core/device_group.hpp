// DeviceGroup: the devices of one training process, each with its streams, memory and a driver
// thread; runs per-device work concurrently and shards batches across the devices.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <mgpu/core/device.hpp>
#include <mgpu/core/memory.hpp>
#include <mgpu/core/stream.hpp>
#include <mgpu/core/tensor.hpp>

namespace mgpu {

/// Splits `rows` into `parts` contiguous counts.
/// - No weights: even; the first rows % parts parts get one row more.
/// - Weights (one per part, finite, >= 0, not all 0): proportional, by largest remainder; ties go
///   to the lower part index. A weight of 0 gets no rows.
/// - Fewer rows than parts: the later parts get 0 rows (empty shards); executors skip them.
/// Throws Error(invalid_argument) for parts < 1, rows < 0 or bad weights.
std::vector<std::int64_t> shard_sizes(std::int64_t rows, int parts, std::span<double const> weights = {});

/// The devices of a process. Rank r drives device(r) with its own default stream, allocator and
/// driver thread. Move-only. Methods may be called from one thread at a time, except that
/// stream(), allocator() and device() may be used from run()'s callbacks for their own rank.
class DeviceGroup {
 public:
  /// The devices named by $MGPU_DEVICES, else "auto".
  DeviceGroup();
  /// The devices named by `spec` (see parse_devices()).
  explicit DeviceGroup(std::string_view spec);
  /// These devices, in rank order. Throws Error(invalid_argument) when empty.
  explicit DeviceGroup(std::vector<Device> devices);
  DeviceGroup(DeviceGroup&&) noexcept;
  DeviceGroup& operator=(DeviceGroup&&) noexcept;
  DeviceGroup(DeviceGroup const&) = delete;
  DeviceGroup& operator=(DeviceGroup const&) = delete;
  /// Finishes enqueued work and stops the driver threads; never throws.
  ~DeviceGroup();

  [[nodiscard]] int size() const noexcept;
  [[nodiscard]] Device device(int rank) const;
  [[nodiscard]] std::vector<Device> const& devices() const noexcept;

  /// The rank's default stream.
  [[nodiscard]] Stream& stream(int rank) const;
  /// A further stream on the rank's device.
  [[nodiscard]] Stream make_stream(int rank) const;
  /// The rank's caching allocator.
  [[nodiscard]] Allocator& allocator(int rank) const;

  /// Calls fn(rank, device, stream) for every rank at once, each on that rank's driver thread
  /// (bound to its GPU on CUDA), then synchronizes each default stream. Returns when every rank is
  /// done. If any rank throws, the others still run to completion and the first error is rethrown
  /// as mgpu::Error naming its rank: the first in time of the errors that are causes of their own,
  /// before any Error(device) and then Error(communication) (what other ranks see once one failed:
  /// waits on failed work, aborted communicators). Calling run() from inside fn throws
  /// Error(invalid_argument).
  void run(std::function<void(int rank, Device device, Stream& stream)> const& fn);

  /// Registers fn(rank, message), called on the failing rank's driver thread as soon as a rank's
  /// run() callback or its default stream's work fails, before run() returns. Communicators use it
  /// to abort, so that the other ranks stop waiting for the failed one. Returns an id for
  /// remove_failure_listener(). fn must not call back into the group.
  int add_failure_listener(std::function<void(int rank, std::string const& message)> fn);
  /// Removes a listener; after it returns the listener is not running and will not be called.
  void remove_failure_listener(int id) noexcept;

  /// Waits for every rank's default stream; throws the first error.
  void synchronize();
  /// Waits for every rank's default stream and clears their failures without throwing: after a
  /// failed step, whose own error the caller reports.
  void drain() noexcept;

  /// Views of `batch`'s rows split by shard_sizes(batch.dim(0), size(), weights), one per rank,
  /// still in batch's memory.
  [[nodiscard]] std::vector<Tensor> shard(Tensor const& batch, std::span<double const> weights = {}) const;
  /// The same for row counts already split, one per rank (>= 0), summing to batch.dim(0); throws
  /// Error(invalid_argument) for others.
  [[nodiscard]] std::vector<Tensor> shard(Tensor const& batch, std::span<std::int64_t const> rows) const;

  /// Copies of those shards in each rank's own memory, enqueued on each rank's default stream: read
  /// them through that stream's later work, or after synchronize().
  [[nodiscard]] std::vector<Tensor> scatter(Tensor const& batch, std::span<double const> weights = {});
  [[nodiscard]] std::vector<Tensor> scatter(Tensor const& batch, std::span<std::int64_t const> rows);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace mgpu
