// The scheduler's vocabulary: what a request asks for, and what the node's devices offer.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <vector>

namespace mgpu::sched {

/// A task or a job asking for devices.
struct Request {
  std::string name{};
  /// Devices needed: a whole number >= 1, or a fraction of one GPU (0 < devices < 1).
  double devices = 1;
  /// Memory needed on each device, in bytes.
  double memory_bytes = 0;
  /// Allowed device types, '|'-separated ("V100|A100"); empty allows every type.
  std::string allowed_types{};
  /// Expected work in seconds on a device of speed 1.
  double work_seconds = 0;
  /// Higher runs first and may preempt lower.
  int priority = 0;
  std::string tenant{};
  /// The data set it reads, and its size (locality).
  std::string data{};
  double data_bytes = 0;
  bool preemptible = true;
  /// Whether the request holds its devices' share (jobs) or queues work beside others (tasks).
  bool exclusive = true;
  /// Bandwidth-heavy requests are kept apart by the interference score.
  bool bandwidth_heavy = false;
  /// For the runtime predictor: requests of one type have similar durations.
  std::string task_type{};
  /// Finish within this many seconds of being placed (0: none); bounds the energy plugin's limits.
  double deadline_seconds = 0;
};

/// One device as the scheduler sees it.
struct DeviceState {
  int id = 0;
  std::string type = "host";
  double capacity_bytes = 0;
  double free_bytes = 0;
  /// Fraction of the device not yet given to shared (fractional) requests.
  double free_share = 1.0;
  /// Work already queued on the device, in seconds.
  double queued_seconds = 0;
  /// Relative throughput (1 = reference device).
  double speed = 1.0;
  double idle_watts = 0;
  double max_watts = 0;
  /// The lowest power limit the device accepts, in watts; 0 when its limit cannot be set.
  double min_power_limit = 0;
  /// Link quality to every other device, 0 (none) to 1 (the best link, e.g. NVLink), by id.
  std::vector<double> links{};
  /// Data sets this device already holds.
  std::set<std::string> data{};
  /// Bandwidth-heavy requests running on the device.
  int bandwidth_heavy = 0;
  /// Bandwidth-heavy multi-device requests using the link to every other device, by id.
  std::vector<int> link_heavy{};
};

/// The node: its devices, and how fast data reaches a device that does not hold it.
struct NodeState {
  std::vector<DeviceState> devices{};
  double transfer_bytes_per_second = 16e9;
  /// speed(P) = speed * ((P - idle) / (max - idle))^exponent for a power limit P.
  double power_exponent = 1.0 / 3.0;
};

/// Where a request goes.
struct Placement {
  std::vector<int> devices{};
  /// The share of each device given (1 for whole devices).
  double share = 1.0;
  double score = 0;
  /// A power limit in watts per device, as `devices` (0: leave it), from the energy plugin.
  std::vector<double> power_limits{};
};

/// A device's speed under power limit `watts` (NodeState::power_exponent's model).
double speed_at_power(DeviceState const& device, double watts, double exponent);
/// The power limit of least energy per unit of work, idle / (1 - exponent), clamped to
/// [min_power_limit, max_watts]; max_watts when it cannot be set.
double energy_optimal_power(DeviceState const& device, double exponent);

}  // namespace mgpu::sched
