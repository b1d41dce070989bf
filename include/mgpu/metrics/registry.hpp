// A training job's live metrics, per device and per job, kept for a monitoring system to read:
// the executors' or trainers' numbers recorded at the end of each step, written out in
// Prometheus's text exposition format (served by metrics::HttpExporter, or written as a
// node_exporter textfile by metrics::write_textfile).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <mgpu/core/device.hpp>
#include <mgpu/core/memory.hpp>

namespace mgpu::metrics {

/// The job's layout: data-parallel replicas, tensor-parallel ranks, pipeline stages, ZeRO stage.
struct Layout {
  int dp = 1;
  int tp = 1;
  int pp = 1;
  int zero = 0;
};

/// One device's part of the step just run.
struct DeviceStep {
  std::string device;  ///< as the job names it: "host:0", "cuda:1", across processes "p1:host:0"
  std::string kind;    ///< "host" or "cuda"
  int world_rank = 0;
  /// Seconds of forward and backward on the device, when the executor measures them (empty: its
  /// busy ratios, compute and wait seconds are not exported).
  std::optional<double> compute_seconds{};
  /// Seconds in collectives or transfers, when the executor measures them (read with
  /// compute_seconds; empty: the wait is not exported, as data parallelism's on a GPU).
  std::optional<double> wait_seconds{};
  std::int64_t rows = 0;    ///< rows (samples or sequences) it processed
  std::int64_t tokens = 0;  ///< tokens it processed (0 for a classifier)
  double shard_weight = 1;  ///< its share weight of the batch's rows
  std::size_t memory_in_use = 0;
  std::size_t memory_peak = 0;
  std::optional<std::size_t> memory_capacity{};  ///< the allocator's limit, when it has one
  /// A GPU's utilisation as NVML samples it (metrics::Nvml::busy_ratio), where it was read.
  std::optional<double> gpu_utilization{};
};

/// Fills `d`'s memory fields from an allocator: bytes held by live buffers, their peak, its limit.
void read_memory(DeviceStep& d, Allocator const& allocator);

/// One device's times in the step just run, as the executor that ran it measured them (host
/// devices: the clock on the device's stream; CUDA: events on it). Executors report these to
/// their registry at the end of each step, and a trainer's DeviceStep reads them from there
/// (Registry::reported_times), as data parallelism's rebalancing does: one measurement for both.
struct DeviceTimes {
  int rank = 0;  ///< the device's rank in the executor's caller's DeviceGroup (this process)
  Device device{};
  double compute_seconds = 0;            ///< computing (each executor's options say what it counts)
  std::optional<double> wait_seconds{};  ///< in collectives or transfers, where measured
};

/// The job's part of the step just run.
struct JobStep {
  std::int64_t step = 0;  ///< steps done, this one included
  double loss = NAN;      ///< the step's training loss (NaN: not read this step)
  double seconds = 0;     ///< the step's wall time
  std::int64_t samples = 0;
  std::int64_t tokens = 0;
  double learning_rate = 0;
  std::optional<double> loss_scale;  ///< fp16's dynamic loss scale
  bool skipped = false;              ///< the update was skipped (an overflow)
};

/// The metrics of one job in one process. record() is called at the end of each step by the
/// thread that runs the steps; exposition() may be called from any thread at the same time (a
/// mutex guards the state; record() copies the step's numbers under it and renders nothing).
class Registry {
 public:
  /// `job` labels every series; the busy ratio's moving window spans the last `window_steps`
  /// steps (at least 1).
  explicit Registry(std::string job, Layout layout = {}, int window_steps = 20);
  Registry(Registry const&) = delete;
  Registry& operator=(Registry const&) = delete;
  ~Registry();

  /// Records a step: the job's numbers and each device's (the same devices, in the same order,
  /// every step; a different list starts the devices' counters again).
  void record(JobStep const& job, std::span<DeviceStep const> devices);

  /// Every series in Prometheus's text exposition format (version 0.0.4): # HELP and # TYPE
  /// lines, names with the mgpu_ prefix and base units, counters ending in _total. Empty of
  /// samples before the first record() but for the layout.
  [[nodiscard]] std::string exposition() const;

  /// An executor's report at the end of a step: each of its devices' times (a rank reported
  /// again replaces its times). Thread-safe. Throws Error(invalid_argument) for a negative rank or
  /// time.
  void report_times(std::span<DeviceTimes const> times);
  /// The times last reported for `rank` since the last record() (which forgets them, so a step
  /// whose executor reported nothing exports no times), or empty.
  [[nodiscard]] std::optional<DeviceTimes> reported_times(int rank) const;

  /// Steps recorded so far.
  [[nodiscard]] std::int64_t steps_recorded() const;

 private:
  struct State;
  mutable std::mutex mutex_;
  std::unique_ptr<State> state_;
};

}  // namespace mgpu::metrics
