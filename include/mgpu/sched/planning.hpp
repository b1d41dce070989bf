// What the scheduler decides inside the library: data-parallel shard weights, pipeline stage
// partitions and their devices, and runtime predictions from history.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include <mgpu/sched/scheduler.hpp>

namespace mgpu::sched {

/// Data-parallel shard weights for the listed devices: each device's speed, discounted by the work
/// already queued on it (a device with a second's backlog in a 1 s step gets half its share).
/// `step_seconds` is the expected length of one step on a speed-1 device.
std::vector<double> shard_weights(NodeState const& node, std::vector<int> const& device_ids, double step_seconds = 1.0);

/// A pipeline plan: stage s runs layers [first_layer[s], first_layer[s + 1]) on device[s].
struct StagePlan {
  std::vector<int> first_layer;
  std::vector<int> device;
  std::vector<double> stage_seconds;
  double bottleneck_seconds = 0;
};

/// Orders `device_ids` for a pipeline: the fastest device first, then repeatedly the unused device
/// best linked to the last one (faster on ties), so adjacent stages sit on good links.
std::vector<int> pipeline_order(NodeState const& node, std::vector<int> device_ids);

/// Groups `device_ids` for tensor parallelism into groups of `group_size`, maximizing the worst
/// group's weakest link, then the sum of the weakest links (exact up to 16 devices, greedy beyond).
/// Returns the ids group after group, each group and the groups in `device_ids`' order. Throws
/// Error(invalid_argument) for a group_size < 1 that does not divide the count, or an unknown id.
std::vector<int> tensor_parallel_order(NodeState const& node, std::vector<int> const& device_ids, int group_size);

/// Splits layers (seconds on a speed-1 device, bytes) into `stages` contiguous stages on the first
/// devices of pipeline_order(), minimizing the slowest stage (min_max_split) within free memory.
/// Throws Error(invalid_argument) for bad sizes, Error(out_of_memory) when no split fits.
StagePlan partition(std::vector<double> const& layer_seconds, std::vector<double> const& layer_bytes,
                    NodeState const& node, std::vector<int> const& device_ids, int stages);

/// Learns durations per (task type, device type) from history: an exponentially weighted mean of
/// seconds per unit of size, refined by a least-squares line (seconds = a + b * size) once sizes
/// differ. Reports the error of the predictions it made before each observation.
class RuntimePredictor {
 public:
  explicit RuntimePredictor(double ewma_weight = 0.3) : alpha_(ewma_weight) {}

  /// Predicted seconds; with no history for the pair, `size` itself (seconds on a speed-1 device).
  [[nodiscard]] double predict(std::string const& task_type, std::string const& device_type, double size) const;
  /// Records a finished task (after measuring how far the prediction was off).
  void observe(std::string const& task_type, std::string const& device_type, double size, double seconds);

  struct Accuracy {
    double mean_absolute_percentage_error = 0;
    std::size_t samples = 0;
  };
  [[nodiscard]] Accuracy accuracy() const;

 private:
  struct History {
    double rate = 0;  // EWMA of seconds / size
    bool has_rate = false;
    double n = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  };
  double alpha_;
  std::map<std::pair<std::string, std::string>, History> history_;
  double error_sum_ = 0;
  std::size_t error_count_ = 0;
};

/// predicted-finish: the device on which the request would finish first (queue plus the
/// predictor's estimate for the device's type). The predictor must outlive the plugin.
std::unique_ptr<ScorePlugin> predicted_finish(RuntimePredictor const& predictor);

}  // namespace mgpu::sched
