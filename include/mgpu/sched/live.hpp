// The scheduler on a live DeviceGroup: its node state, and a placer of independent tasks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include <mgpu/core/device_group.hpp>
#include <mgpu/sched/defrag.hpp>
#include <mgpu/sched/scheduler.hpp>

namespace mgpu::sched {

/// Copy bandwidth in GB/s from every rank's memory to every other's (bandwidth[i][j]: i to j;
/// diagonal 0), the median of `repeats` copies of `bytes` each. Meant to run once at start-up.
std::vector<std::vector<double>> measure_peer_bandwidth(DeviceGroup& group, std::size_t bytes = std::size_t{32} << 20, int repeats = 3);

/// The scheduler's view of `group`: device id i is rank i. Type: "host" or the GPU's model (e.g.
/// "H200"); capacity: the device's memory divided among the ranks that share it (logical devices
/// on one GPU, host devices on one machine); free: capacity minus what the rank's allocator holds;
/// speed: throughput relative to the group's fastest device. Links: 1 between ranks sharing memory,
/// else 0.5 with peer access and 0 without; with a `bandwidth` matrix (measure_peer_bandwidth) the
/// links are each pair's slower direction relative to the best pair instead.
NodeState node_state(DeviceGroup const& group, std::vector<std::vector<double>> const& bandwidth = {});

/// Places independent tasks with a scheduler on a live Node: each task's work is enqueued on the
/// chosen rank's stream, its reservation released when the work has run; tasks are not exclusive.
class TaskPlacer {
 public:
  explicit TaskPlacer(DeviceGroup& group, Scheduler scheduler = Scheduler::default_profile());
  TaskPlacer(TaskPlacer const&) = delete;
  TaskPlacer& operator=(TaskPlacer const&) = delete;
  /// Waits for the tasks (failures are not rethrown here: call wait() to see them).
  ~TaskPlacer();

  /// Places `request`, then calls enqueue(rank, stream) on this thread to enqueue the task's work
  /// on the chosen rank's stream. Returns the rank. Throws Error(out_of_memory) naming the request
  /// when no device can take it, and whatever enqueue throws (the reservation is released).
  int submit(Request const& request, std::function<void(int rank, Stream& stream)> const& enqueue);
  /// Waits for every submitted task; rethrows the first failure. Reservations of tasks whose work
  /// did not run (a failed stream skips later work) are released here.
  void wait();
  /// plan_room() for `gang` on the node as it is now, moving at most `max_moves` outstanding tasks
  /// (ids in submission order from 0); returned, not made. Throws as plan_room().
  [[nodiscard]] std::optional<GangPlan> plan_room(Request const& gang, int max_moves = 8);
  [[nodiscard]] Node& node() noexcept { return node_; }

 private:
  void release(std::uint64_t id);
  DeviceGroup& group_;
  Scheduler scheduler_;
  Node node_;
  std::mutex mutex_;
  std::map<std::uint64_t, std::pair<Request, Placement>> outstanding_;
  std::uint64_t next_id_ = 0;
};

}  // namespace mgpu::sched
