// Placing pods on a cluster: the policies (random, first-fit, best-fit, worst-fit, dot-product,
// GPU packing, and fragmentation gradient descent), the fragmentation measure FGD descends, and
// two experiments: fill (Weng et al., "Beware of Fragmentation", USENIX ATC'23: pods drawn from a
// trace are placed without departures until their GPU demand reaches a share of the cluster) and
// replay (arrivals and departures at the trace's times). The free functions touch only their
// arguments: they may run concurrently on different arguments.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <mgpu/cluster/cluster.hpp>

namespace mgpu::cluster {

/// How a node (and the GPUs on it) is chosen for a pod among the nodes that fit it.
///  random: any node, uniformly; first-fit: the first in file order; best-fit: the least CPU,
///  memory and GPU left (each relative to the node's capacity, summed); worst-fit: the most left;
///  dot-product: the largest alignment of the pod's demand with the node's free resources (Tetris);
///  gpu-packing: a partly used GPU that fits, else a node with GPUs in use, else an idle node;
///  fgd: the least increase of the node's fragmentation under the target workload.
enum class FitPolicy { random, first_fit, best_fit, worst_fit, dot_product, gpu_packing, fgd };

/// Which of several nodes with equal scores wins: the first in file order, a seeded random one,
/// or the one with the least free GPU share (then the first).
enum class TieRule { first, random, packed };

/// The names reports and command-line options use ("first-fit", "packed").
[[nodiscard]] std::string_view name_of(FitPolicy policy) noexcept;
[[nodiscard]] std::string_view name_of(TieRule rule) noexcept;
/// Throws Error(invalid_argument) listing the names there are.
[[nodiscard]] FitPolicy fit_policy_named(std::string_view name);
[[nodiscard]] TieRule tie_rule_named(std::string_view name);
/// Every policy, in the order the reports list them.
[[nodiscard]] std::vector<FitPolicy> all_fit_policies();

/// One kind of pod in the target workload and its share of the pods (shares sum to 1).
struct PodType {
  Demand demand{};
  double share = 0;
};

/// Which pods form the target workload FGD expects.
struct TargetOptions {
  /// Types distinguished by CPU and memory as well as GPUs and models; false: by GPUs and models
  /// only (then a node's CPU and memory never make a type unable to run).
  bool cpu_and_memory = true;
  /// The most frequent types that together make up at least this share of the pods (0 < c <= 1).
  double coverage = 1.0;
};

/// The target workload of `pods` on `cluster`: their distinct demands and frequencies. Throws
/// Error(invalid_argument) for an empty pod list or a coverage outside (0, 1], and whatever
/// Cluster::demand_of throws.
[[nodiscard]] std::vector<PodType> target_workload(Cluster const& cluster, std::vector<Pod> const& pods,
                                                   TargetOptions const& options = {});

/// FGD's fragmentation of one node under a target workload, in milli-GPUs: for each pod type, the
/// free GPU share the type cannot use, weighted by the type's share. A type that cannot run on the
/// node at all (model, CPU, memory, or no GPU with room) cannot use any of the free share, nor can
/// a CPU-only type; a type that can run cannot use the GPUs with less free than it asks of one GPU.
[[nodiscard]] double node_fragmentation(std::vector<PodType> const& target, int model, int free_cpu, int free_memory,
                                        std::span<int const> free_gpus);

/// Chooses nodes for pods with one policy. Keeps per-node caches: use one Placer with one Cluster.
/// Not synchronized.
class Placer {
 public:
  /// `target` is used by fgd (and may be empty for the other policies); `seed` drives the random
  /// policy and the random tie rule. Throws Error(invalid_argument) for fgd without a target.
  Placer(FitPolicy policy, TieRule tie, std::vector<PodType> target, unsigned seed);

  /// The allocation the policy chooses for `demand` on `cluster` as it is now, or std::nullopt
  /// when no node fits. Changes nothing in the cluster.
  [[nodiscard]] std::optional<Allocation> choose(Cluster const& cluster, Demand const& demand);
  /// The same among `nodes` only (indices into cluster.nodes(), in the order ties see them): the
  /// filter the defragmenter narrows. Throws Error(invalid_argument) for an index out of range.
  [[nodiscard]] std::optional<Allocation> choose_among(Cluster const& cluster, Demand const& demand,
                                                       std::span<int const> nodes);
  /// The sum of node_fragmentation over the cluster's nodes, in milli-GPUs.
  [[nodiscard]] double cluster_fragmentation(Cluster const& cluster);
  /// node_fragmentation() of `node` under the placer's target workload, as it is now or with the
  /// free resources given (what-if: the defragmenter rates moves by it); 0 without a target.
  [[nodiscard]] double node_fragmentation(Cluster const& cluster, int node);
  [[nodiscard]] double node_fragmentation(Cluster const& cluster, int node, int free_cpu, int free_memory,
                                          std::span<int const> free_gpus);
  [[nodiscard]] FitPolicy policy() const noexcept { return policy_; }

 private:
  struct Candidate {
    double score = 0;
    std::vector<int> gpus{};
  };
  // The target's GPU pod types that can run on one model, grouped by GPU demand, each group's
  // members sorted by CPU (node_fragmentation() computed per group rather than per type).
  struct Member {
    int cpu_milli;
    int memory_mib;
    double share;
  };
  struct Group {
    int gpus;
    int gpu_milli;
    double share;
    std::vector<Member> members;
  };
  struct ModelTypes {
    double unable_share = 0;  // CPU-only types and types that exclude the model
    std::vector<Group> groups{};
  };
  void index_target(Cluster const& cluster);
  Candidate rate(Cluster const& cluster, Demand const& demand, int node);
  template <class Nodes>
  std::optional<Allocation> pick(Cluster const& cluster, Demand const& demand, Nodes const& nodes);
  double fragmentation(int model, int free_cpu, int free_memory, std::span<int const> free_gpus) const;
  double fragmentation_before(Cluster const& cluster, int node);

  FitPolicy policy_;
  TieRule tie_;
  std::vector<PodType> target_;
  std::mt19937_64 rng_;
  std::vector<ModelTypes> by_model_{};
  bool indexed_ = false;
  std::vector<double> before_{};
  std::vector<std::uint64_t> before_version_{};  // cluster version + 1 of before_; 0: none
  std::vector<int> after_{};
};

/// Migration: when a pod fits no node, a defragmenter (mgpu/cluster/defrag.hpp) may move running
/// small pods to make room for it, and every `every` arrivals move pods that lower the cluster's
/// fragmentation (FGD's measure under the target workload) the most per move. Each move is
/// counted and charged its downtime in GPU-seconds; the cap bounds the moves per arrived pod.
struct MigrationOptions {
  bool enabled = false;
  int max_pod_gpus = 1;         ///< pods of at most this many GPUs move (fractional and CPU-only ones too)
  int max_moves_per_pod = 3;    ///< moves to make room for one pod, at most
  double moves_per_100_pods = 5;  ///< the cap: after n arrivals, at most this x n / 100 moves in all
  int every = 10;               ///< a consolidation pass every this many arrivals (0: none)
  int moves_per_pass = 1;       ///< moves per consolidation pass, at most
  int candidates = 8;           ///< nodes tried per pod that fits nowhere (fewest moves first)
  double restart_seconds = 30;  ///< a moved pod's downtime: its restart ...
  double seconds_per_gib = 1;   ///< ... plus its memory copied at 1 GiB/s
};

/// The fill experiment's settings.
struct FillOptions {
  FitPolicy policy = FitPolicy::fgd;
  TieRule tie = TieRule::random;
  TargetOptions target{};
  double max_arrived = 1.3;  ///< stop when the drawn pods' GPU demand reaches this share of the capacity
  double step = 0.05;        ///< report every this much arrived demand
  unsigned seed = 1;         ///< the pods drawn (the same for every policy) and the random choices
  MigrationOptions migration{};  ///< enabled: the policy's name gains "+migration"
};

/// The cluster when the arrived GPU demand reached `arrived` (shares of the GPU capacity).
struct FillPoint {
  double arrived = 0;
  double allocated = 0;    ///< GPU share allocated
  double unallocated = 0;  ///< 1 - allocated
  double fragmented = 0;   ///< free GPU share the target workload cannot use (FGD's measure)
  double cpu_allocated = 0;
  int pods = 0;           ///< pods drawn so far
  int failed = 0;         ///< of those, pods no node could take
  double failed_gpu = 0;  ///< their GPU demand, as a share of the capacity
  int moves = 0;          ///< pods migrated so far
  double gpu_seconds_lost = 0;  ///< the moved pods' downtime, in GPU-seconds
};

/// One policy's fill: a point every step, and the time its placement decisions took.
struct FillResult {
  std::string policy{};
  std::string tie{};
  std::vector<FillPoint> points{};
  int decisions = 0;
  double seconds = 0;  ///< wall time of the placement decisions
};

/// Draws pods from `trace` (seeded, with replacement) and places each at once, without departures,
/// until their GPU demand reaches options.max_arrived of the capacity; a point every options.step.
/// With options.migration enabled a pod that fits no node may have others moved to make room. The
/// target workload comes from `trace`. Throws Error(invalid_argument) for an empty trace, a trace
/// with no GPU demand, a step or max_arrived <= 0, pods the cluster cannot hold, and migration
/// options out of range.
[[nodiscard]] FillResult fill(std::vector<NodeSpec> const& nodes, std::vector<Pod> const& trace,
                              FillOptions const& options);

/// The replay experiment's result: pods start in arrival order as soon as a node fits them (a pod
/// that does not fit waits; later pods may start before it), and run deletion - creation seconds.
struct ReplayResult {
  std::string policy{};
  int pods = 0;
  int never_started = 0;
  double mean_wait = 0;  ///< seconds from creation to start
  double p95_wait = 0;
  double mean_jct = 0;         ///< seconds from creation to finish
  double makespan = 0;         ///< from the first creation to the last finish
  double gpu_utilization = 0;  ///< allocated GPU share over the makespan
  int peak_pending = 0;
};

/// Replays `pods` on `nodes` under one policy. Throws as fill() does.
[[nodiscard]] ReplayResult replay(std::vector<NodeSpec> const& nodes, std::vector<Pod> const& pods, FitPolicy policy,
                                  TieRule tie = TieRule::random, TargetOptions const& target = {}, unsigned seed = 1);

/// A table of fill results: per policy, the unallocated GPU share at every tenth of arrived demand
/// from 50%, the fragmented share, failed pods, migrations per 100 pods and GPU-seconds lost at
/// 100%, and decisions per second. A result named "bound" (fill_bound()) is a row of its own, and
/// every other row gains its gap to it at 100%.
[[nodiscard]] std::string format_fill(std::vector<FillResult> const& results);
/// Every point of every result as CSV (policy, tie, arrived, allocated, unallocated, ...).
[[nodiscard]] std::string fill_csv(std::vector<FillResult> const& results);
/// A table and CSV of replay results, one row per policy.
[[nodiscard]] std::string format_replay(std::vector<ReplayResult> const& results);
[[nodiscard]] std::string replay_csv(std::vector<ReplayResult> const& results);

}  // namespace mgpu::cluster
