// Batches for training: a seeded shuffle per epoch, normalization, and the next batch assembled on
// a background thread while the current one trains.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include <mgpu/core/memory.hpp>
#include <mgpu/core/tensor.hpp>
#include <mgpu/data/dataset.hpp>

namespace mgpu::data {

struct LoaderOptions {
  std::int64_t batch = 64;
  /// Shuffle the order every epoch; the order is a function of (seed, epoch) only, so a run resumed
  /// at (epoch, batch) sees the same batches it would have.
  bool shuffle = true;
  std::uint64_t seed = 0;
  /// Drop a last batch smaller than `batch` (keeps every step's batch size equal).
  bool drop_last = false;
  /// Batches assembled ahead of the consumer (>= 1).
  int prefetch = 2;
  /// Applied to every batch's features (empty: none).
  Normalizer normalizer{};
};

/// One batch on the host: features [B, D] and labels [B], float32.
struct Batch {
  Tensor x;
  Tensor y;
  std::int64_t index = 0;  ///< the batch's position in its epoch
};

/// Iterates a dataset in batches. The dataset must outlive the loader. Batches are host tensors
/// from `allocator` (pinned when `pinned`, for fast copies to a GPU).
class BatchLoader {
 public:
  BatchLoader(Dataset const& data, LoaderOptions options, std::shared_ptr<Allocator> allocator, bool pinned = false);
  BatchLoader(BatchLoader const&) = delete;
  BatchLoader& operator=(BatchLoader const&) = delete;
  ~BatchLoader();

  [[nodiscard]] std::int64_t batches_per_epoch() const noexcept;
  /// Starts (or restarts) `epoch` at batch `first`, dropping batches prefetched for another epoch.
  void start_epoch(std::int64_t epoch, std::int64_t first = 0);
  /// The next batch of the current epoch, or nothing when it is done. Rethrows a failure of the
  /// background thread.
  std::optional<Batch> next();

  struct State;

 private:
  std::unique_ptr<State> state_;
};

}  // namespace mgpu::data
