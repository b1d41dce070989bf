// Migration in the cluster simulator: a defragmenter that moves running small pods (fractional,
// one-GPU and CPU-only ones, MigrationOptions::max_pod_gpus) to make room for a pod that fits no
// node, or to lower the cluster's fragmentation. It plugs in after the placement path: every
// destination, and the pod it makes room for, still goes through the Placer's filter and score and
// Cluster::allocate; it only narrows the nodes the placer may choose among. Not synchronized.
#pragma once

#include <optional>
#include <vector>

#include <mgpu/cluster/cluster.hpp>
#include <mgpu/cluster/policy.hpp>

namespace mgpu::cluster {

/// One pod moved, and the GPU-seconds its downtime costs.
struct Move {
  int pod = -1;  ///< the id it was tracked under
  Allocation from{};
  Allocation to{};
  double gpu_seconds = 0;
};

/// The running pods of one Cluster and the moves among them.
class Defragmenter {
 public:
  /// Throws Error(invalid_argument) naming the option for max_pod_gpus, max_moves_per_pod,
  /// moves_per_pass or candidates below 0 (max_moves_per_pod, candidates: below 1), a negative
  /// cap, `every` or downtime.
  explicit Defragmenter(MigrationOptions options);

  /// Records that pod `id` (>= 0, not tracked yet) runs with `allocation`. Throws
  /// Error(invalid_argument) for a negative or already tracked id.
  void track(int id, Demand const& demand, Allocation const& allocation);
  [[nodiscard]] Allocation const& allocation_of(int id) const;
  [[nodiscard]] bool movable(Demand const& demand) const noexcept;
  /// What moving a pod of `demand` costs: its GPU share x (restart + memory / 1 GiB x seconds_per_gib).
  [[nodiscard]] double downtime_gpu_seconds(Demand const& demand) const noexcept;

  struct Room {
    Allocation placed{};
    std::vector<Move> moves{};
  };
  /// For `demand`, which fits no node now: moves at most `max_moves` (and max_moves_per_pod)
  /// tracked movable pods off one node so that the demand fits there, places them elsewhere with
  /// `placer`, and allocates the demand on that node. Nodes are tried in order of the fewest moves
  /// (then, under fgd, the least fragmentation left on the node; else the least GPU share moved).
  /// Returns the demand's allocation (not tracked: track() it) and the moves, all performed on
  /// `cluster`; std::nullopt and the cluster as it was when no plan of that size works.
  [[nodiscard]] std::optional<Room> make_room(Cluster& cluster, Placer& placer, Demand const& demand, int max_moves);

  /// A consolidation pass: at most `max_moves` moves, each of the tracked movable pod whose move
  /// lowers the placer's fragmentation measure (source and destination node together) the most,
  /// if it lowers it by at least one milli-GPU. Performed on `cluster`; returns the moves.
  std::vector<Move> consolidate(Cluster& cluster, Placer& placer, int max_moves);

 private:
  struct Tracked {
    Demand demand{};
    Allocation allocation{};
    bool present = false;
  };
  class Relocatable;
  void moved(int id, Allocation const& to);
  MigrationOptions options_;
  std::vector<Tracked> pods_{};
  std::vector<std::vector<int>> on_node_{};
};

}  // namespace mgpu::cluster
