// The defragmenter: which running pods to move off a node so that a pod fits there (the fewest
// moves), where they go (the placer's choice among the other nodes), and the consolidation pass
// that moves the pod whose move lowers the fragmentation measure the most.
#include <mgpu/cluster/defrag.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <tuple>

#include <mgpu/core/error.hpp>

#include "placement.hpp"

namespace mgpu::cluster {
namespace {

using detail::model_allowed;

void at_least(double value, double least, char const* name) {
  if (!(value >= least) || !std::isfinite(value))
    throw Error(Errc::invalid_argument, std::string("migration option ") + name + " = " + std::to_string(value) +
                                            " (expected a finite number >= " + std::to_string(least) + ")");
}

// Every node but `except`.
std::vector<int> other_nodes(Cluster const& cluster, int except) {
  std::vector<int> out;
  out.reserve(cluster.nodes().size());
  for (int n = 0; n < static_cast<int>(cluster.nodes().size()); ++n)
    if (n != except) out.push_back(n);
  return out;
}

// A node's free resources while pods are taken off it and the new one put on.
struct NodeRoom {
  std::vector<int> gpus;
  int cpu;
  int memory;
  void give_back(Allocation const& a) {
    for (int g : a.gpus) gpus[static_cast<std::size_t>(g)] += a.gpu_milli;
    cpu += a.cpu_milli;
    memory += a.memory_mib;
  }
};

}  // namespace

// Whether a movable pod could go to some node now (else moving it cannot work: its model is full,
// say), by demand, remembered while the cluster is unchanged.
class Defragmenter::Relocatable {
 public:
  Relocatable(Cluster const& cluster, Defragmenter const& owner) : cluster_(cluster), owner_(owner) {}
  bool operator()(Demand const& e) {
    if (!owner_.movable(e)) return false;
    auto [it, added] = fits_.try_emplace({e.cpu_milli, e.memory_mib, e.gpus, e.gpu_milli, e.models}, false);
    for (int n = 0; added && n < static_cast<int>(cluster_.nodes().size()) && !it->second; ++n)
      it->second = cluster_.fits(e, n);
    return it->second;
  }

 private:
  Cluster const& cluster_;
  Defragmenter const& owner_;
  std::map<std::tuple<int, int, int, int, std::uint64_t>, bool> fits_{};
};

Defragmenter::Defragmenter(MigrationOptions options) : options_(options) {
  at_least(options_.max_pod_gpus, 0, "max_pod_gpus");
  at_least(options_.max_moves_per_pod, 1, "max_moves_per_pod");
  at_least(options_.moves_per_100_pods, 0, "moves_per_100_pods");
  at_least(options_.every, 0, "every");
  at_least(options_.moves_per_pass, 0, "moves_per_pass");
  at_least(options_.candidates, 1, "candidates");
  at_least(options_.restart_seconds, 0, "restart_seconds");
  at_least(options_.seconds_per_gib, 0, "seconds_per_gib");
}

void Defragmenter::track(int id, Demand const& demand, Allocation const& allocation) {
  if (id < 0 || (id < static_cast<int>(pods_.size()) && pods_[static_cast<std::size_t>(id)].present))
    throw Error(Errc::invalid_argument,
                "tracking pod " + std::to_string(id) + " (expected a new id >= 0, not one tracked already)");
  if (id >= static_cast<int>(pods_.size())) pods_.resize(static_cast<std::size_t>(id) + 1);
  pods_[static_cast<std::size_t>(id)] = {demand, allocation, true};
  if (allocation.node >= static_cast<int>(on_node_.size())) on_node_.resize(static_cast<std::size_t>(allocation.node) + 1);
  on_node_[static_cast<std::size_t>(allocation.node)].push_back(id);
}

Allocation const& Defragmenter::allocation_of(int id) const {
  if (id < 0 || id >= static_cast<int>(pods_.size()) || !pods_[static_cast<std::size_t>(id)].present)
    throw Error(Errc::invalid_argument, "allocation of pod " + std::to_string(id) + " (expected a tracked id)");
  return pods_[static_cast<std::size_t>(id)].allocation;
}

bool Defragmenter::movable(Demand const& d) const noexcept { return d.gpus <= options_.max_pod_gpus; }

double Defragmenter::downtime_gpu_seconds(Demand const& d) const noexcept {
  double const share = static_cast<double>(d.gpus) * d.gpu_milli / 1000.0;
  return share * (options_.restart_seconds + options_.seconds_per_gib * d.memory_mib / 1024.0);
}

void Defragmenter::moved(int id, Allocation const& to) {
  Tracked& p = pods_[static_cast<std::size_t>(id)];
  std::erase(on_node_[static_cast<std::size_t>(p.allocation.node)], id);
  if (to.node >= static_cast<int>(on_node_.size())) on_node_.resize(static_cast<std::size_t>(to.node) + 1);
  on_node_[static_cast<std::size_t>(to.node)].push_back(id);
  p.allocation = to;
}

std::optional<Defragmenter::Room> Defragmenter::make_room(Cluster& cluster, Placer& placer, Demand const& d,
                                                          int max_moves) {
  max_moves = std::min(max_moves, options_.max_moves_per_pod);
  if (max_moves < 1) return std::nullopt;
  struct Plan {
    int node;
    std::vector<int> evict;
    double rank;  // after the number of moves: lower is better
  };
  std::vector<Plan> plans;
  int const nodes = static_cast<int>(cluster.nodes().size());
  on_node_.resize(static_cast<std::size_t>(nodes));
  Relocatable relocatable(cluster, *this);
  for (int n = 0; n < nodes; ++n) {
    NodeSpec const& spec = cluster.nodes()[static_cast<std::size_t>(n)];
    if (spec.cpu_milli < d.cpu_milli || spec.memory_mib < d.memory_mib || spec.gpus < d.gpus) continue;
    if (d.gpus > 0 && !model_allowed(d, cluster.model_of(n))) continue;
    std::vector<int> const& here = on_node_[static_cast<std::size_t>(n)];
    NodeRoom room{cluster.free_gpus(n), cluster.free_cpu(n), cluster.free_memory(n)};
    std::vector<int> evict;
    auto const take = [&](int id) {
      if (std::find(evict.begin(), evict.end(), id) != evict.end()) return;
      evict.push_back(id);
      room.give_back(pods_[static_cast<std::size_t>(id)].allocation);
    };
    // The movable pods on each GPU, largest share first; a GPU with a pod that cannot move cannot be emptied.
    std::vector<std::vector<int>> on_gpu(room.gpus.size());
    std::vector<char> pinned(room.gpus.size(), 0);
    for (int id : here) {
      Tracked const& p = pods_[static_cast<std::size_t>(id)];
      bool const moves = relocatable(p.demand);
      for (int g : p.allocation.gpus) {
        if (moves)
          on_gpu[static_cast<std::size_t>(g)].push_back(id);
        else
          pinned[static_cast<std::size_t>(g)] = 1;
      }
    }
    for (auto& ids : on_gpu)
      std::sort(ids.begin(), ids.end(), [&](int a, int b) {
        return pods_[static_cast<std::size_t>(a)].allocation.gpu_milli >
               pods_[static_cast<std::size_t>(b)].allocation.gpu_milli;
      });
    int chosen = -1;  // the GPU a fraction goes on
    bool possible = true;
    if (d.gpus > 0 && d.gpu_milli == 1000) {
      int whole = 0;
      std::vector<std::pair<std::size_t, int>> emptiable;  // (pods on it, GPU)
      for (std::size_t g = 0; g < room.gpus.size(); ++g) {
        if (room.gpus[g] == 1000)
          ++whole;
        else if (!pinned[g])
          emptiable.emplace_back(on_gpu[g].size(), static_cast<int>(g));
      }
      int const need = d.gpus - whole;
      if (need > static_cast<int>(emptiable.size())) continue;
      std::sort(emptiable.begin(), emptiable.end());
      for (int i = 0; i < need; ++i)
        for (int id : on_gpu[static_cast<std::size_t>(emptiable[static_cast<std::size_t>(i)].second)]) take(id);
    } else if (d.gpus == 1) {
      std::size_t fewest = std::numeric_limits<std::size_t>::max();
      for (std::size_t g = 0; g < room.gpus.size(); ++g) {
        int free = room.gpus[g];
        std::size_t count = 0;
        for (int id : on_gpu[g]) {
          if (free >= d.gpu_milli) break;
          free += pods_[static_cast<std::size_t>(id)].allocation.gpu_milli;
          ++count;
        }
        if (free >= d.gpu_milli && count < fewest) {
          fewest = count;
          chosen = static_cast<int>(g);
        }
      }
      if (chosen < 0) continue;
      auto const& ids = on_gpu[static_cast<std::size_t>(chosen)];
      for (std::size_t i = 0; i < fewest; ++i) take(ids[i]);
    }
    // CPU and memory: the movable pods that give back most of what is short.
    while (possible && (room.cpu < d.cpu_milli || room.memory < d.memory_mib)) {
      int best = -1;
      for (int id : here) {
        Tracked const& p = pods_[static_cast<std::size_t>(id)];
        if (!relocatable(p.demand) || std::find(evict.begin(), evict.end(), id) != evict.end()) continue;
        auto const gives = [&](Tracked const& q) {
          return room.cpu < d.cpu_milli ? q.allocation.cpu_milli : q.allocation.memory_mib;
        };
        if (best < 0 || gives(p) > gives(pods_[static_cast<std::size_t>(best)])) best = id;
      }
      if (best < 0)
        possible = false;
      else
        take(best);
    }
    if (!possible || evict.empty() || static_cast<int>(evict.size()) > max_moves) continue;
    double rank = 0;
    if (placer.policy() == FitPolicy::fgd) {
      NodeRoom after = room;
      if (chosen >= 0) after.gpus[static_cast<std::size_t>(chosen)] -= d.gpu_milli;
      for (int g = 0, left = d.gpu_milli == 1000 ? d.gpus : 0; left > 0; ++g)
        if (after.gpus[static_cast<std::size_t>(g)] == 1000) {
          after.gpus[static_cast<std::size_t>(g)] = 0;
          --left;
        }
      rank = placer.node_fragmentation(cluster, n, after.cpu - d.cpu_milli, after.memory - d.memory_mib, after.gpus) -
             placer.node_fragmentation(cluster, n);
    } else {
      for (int id : evict) rank += static_cast<double>(pods_[static_cast<std::size_t>(id)].demand.gpus) *
                                   pods_[static_cast<std::size_t>(id)].demand.gpu_milli;
    }
    plans.push_back({n, std::move(evict), rank});
  }
  std::stable_sort(plans.begin(), plans.end(), [](Plan const& a, Plan const& b) {
    return a.evict.size() != b.evict.size() ? a.evict.size() < b.evict.size() : a.rank < b.rank;
  });
  if (plans.size() > static_cast<std::size_t>(options_.candidates)) plans.resize(static_cast<std::size_t>(options_.candidates));
  for (Plan& plan : plans) {
    // Bigger pods find a place first; the new pod goes on the node before they look.
    std::sort(plan.evict.begin(), plan.evict.end(), [&](int a, int b) {
      return pods_[static_cast<std::size_t>(a)].demand.gpus * pods_[static_cast<std::size_t>(a)].demand.gpu_milli >
             pods_[static_cast<std::size_t>(b)].demand.gpus * pods_[static_cast<std::size_t>(b)].demand.gpu_milli;
    });
    for (int id : plan.evict) cluster.release(pods_[static_cast<std::size_t>(id)].allocation);
    int const only[] = {plan.node};
    std::optional<Allocation> placed = placer.choose_among(cluster, d, only);
    std::vector<Allocation> to;
    if (placed) {
      cluster.allocate(*placed);
      std::vector<int> const others = other_nodes(cluster, plan.node);
      for (int id : plan.evict) {
        std::optional<Allocation> a = placer.choose_among(cluster, pods_[static_cast<std::size_t>(id)].demand, others);
        if (!a) break;
        cluster.allocate(*a);
        to.push_back(std::move(*a));
      }
    }
    if (placed && to.size() == plan.evict.size()) {
      Room room{std::move(*placed), {}};
      for (std::size_t i = 0; i < to.size(); ++i) {
        int const id = plan.evict[i];
        room.moves.push_back({id, pods_[static_cast<std::size_t>(id)].allocation, to[i],
                              downtime_gpu_seconds(pods_[static_cast<std::size_t>(id)].demand)});
        moved(id, to[i]);
      }
      return room;
    }
    for (Allocation const& a : to) cluster.release(a);
    if (placed) cluster.release(*placed);
    for (int id : plan.evict) cluster.allocate(pods_[static_cast<std::size_t>(id)].allocation);
  }
  return std::nullopt;
}

std::vector<Move> Defragmenter::consolidate(Cluster& cluster, Placer& placer, int max_moves) {
  std::vector<Move> moves;
  max_moves = std::min(max_moves, options_.moves_per_pass);
  while (static_cast<int>(moves.size()) < max_moves) {
    // Each movable pod's gain on its own node: the fragmentation there without it, less now.
    Relocatable relocatable(cluster, *this);
    std::vector<std::pair<double, int>> gains;
    for (int id = 0; id < static_cast<int>(pods_.size()); ++id) {
      Tracked const& p = pods_[static_cast<std::size_t>(id)];
      if (!p.present || !relocatable(p.demand)) continue;
      int const n = p.allocation.node;
      NodeRoom room{cluster.free_gpus(n), cluster.free_cpu(n), cluster.free_memory(n)};
      room.give_back(p.allocation);
      gains.emplace_back(placer.node_fragmentation(cluster, n, room.cpu, room.memory, room.gpus) -
                             placer.node_fragmentation(cluster, n),
                         id);
    }
    auto const keep = std::min(gains.size(), static_cast<std::size_t>(options_.candidates));
    std::partial_sort(gains.begin(), gains.begin() + static_cast<std::ptrdiff_t>(keep), gains.end());
    double best = -1;  // at least one milli-GPU less
    int best_id = -1;
    Allocation best_to;
    for (std::size_t i = 0; i < keep; ++i) {
      auto const [source_gain, id] = gains[i];
      Tracked const& p = pods_[static_cast<std::size_t>(id)];
      std::optional<Allocation> to = placer.choose_among(cluster, p.demand, other_nodes(cluster, p.allocation.node));
      if (!to) continue;
      NodeRoom room{cluster.free_gpus(to->node), cluster.free_cpu(to->node), cluster.free_memory(to->node)};
      for (int g : to->gpus) room.gpus[static_cast<std::size_t>(g)] -= to->gpu_milli;
      double const gain = source_gain +
                          placer.node_fragmentation(cluster, to->node, room.cpu - to->cpu_milli,
                                                    room.memory - to->memory_mib, room.gpus) -
                          placer.node_fragmentation(cluster, to->node);
      if (gain < best) {
        best = gain;
        best_id = id;
        best_to = std::move(*to);
      }
    }
    if (best_id < 0) break;
    Tracked const& p = pods_[static_cast<std::size_t>(best_id)];
    cluster.release(p.allocation);
    cluster.allocate(best_to);
    moves.push_back({best_id, p.allocation, best_to, downtime_gpu_seconds(p.demand)});
    moved(best_id, best_to);
  }
  return moves;
}

}  // namespace mgpu::cluster
