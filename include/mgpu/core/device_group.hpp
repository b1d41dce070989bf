// DeviceGroup: one process's devices, each with streams, memory and a driver thread.
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

/// Splits `rows` into `parts` contiguous counts: evenly (the first rows % parts one more), or by
/// weights (finite, >= 0, not all 0) by largest remainder, ties to the lower part; later parts may
/// get 0. Throws Error(invalid_argument) for parts < 1, rows < 0 or bad weights.
std::vector<std::int64_t> shard_sizes(std::int64_t rows, int parts, std::span<double const> weights = {});

/// Rank r drives device(r) with its own default stream, allocator and driver thread. Move-only; one
/// thread at a time, but run()'s callbacks may use stream(), allocator() and device() of their rank.
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

  /// Calls fn(rank, device, stream) on every rank's driver thread at once, then synchronizes the
  /// default streams. When ranks throw, all finish and the cause is rethrown naming its rank (the
  /// first error of its own, before Error(device), then Error(communication)). Not from inside fn.
  void run(std::function<void(int rank, Device device, Stream& stream)> const& fn);

  /// Registers fn(rank, message), called on a failing rank's driver thread as soon as its callback or
  /// default stream fails; fn must not call into the group. Returns an id to remove it with.
  int add_failure_listener(std::function<void(int rank, std::string const& message)> fn);
  /// Removes a listener; after it returns the listener is not running and will not be called.
  void remove_failure_listener(int id) noexcept;

  /// Waits for every rank's default stream; throws the first error.
  void synchronize();
  /// Waits for every rank's default stream and clears their failures without throwing.
  void drain() noexcept;

  /// Views of `batch`'s rows split by shard_sizes(batch.dim(0), size(), weights), one per rank,
  /// still in batch's memory.
  [[nodiscard]] std::vector<Tensor> shard(Tensor const& batch, std::span<double const> weights = {}) const;
  /// The same for row counts already split (>= 0, summing to batch.dim(0); else Error(invalid_argument)).
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
