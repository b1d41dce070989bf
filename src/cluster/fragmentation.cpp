// FGD's measure: a node's expected fragmentation under the target workload (the free GPU share
// the workload's pod types cannot use), the target workload itself, and the Placer's cached form of
// the measure by GPU model.
#include <mgpu/cluster/policy.hpp>

#include <algorithm>
#include <map>
#include <tuple>
#include <utility>

#include <mgpu/core/error.hpp>

#include "placement.hpp"

namespace mgpu::cluster {

using detail::free_sum;
using detail::model_allowed;

std::vector<PodType> target_workload(Cluster const& cluster, std::vector<Pod> const& pods,
                                     TargetOptions const& options) {
  if (pods.empty()) throw Error(Errc::invalid_argument, "a target workload from no pods (expected at least one)");
  if (!(options.coverage > 0 && options.coverage <= 1))
    throw Error(Errc::invalid_argument,
                "target coverage " + std::to_string(options.coverage) + " (expected a share in (0, 1])");
  using Key = std::tuple<int, int, int, int, std::uint64_t>;
  std::map<Key, int> counts;
  for (Pod const& p : pods) {
    Demand const d = cluster.demand_of(p);
    ++counts[options.cpu_and_memory ? Key{d.cpu_milli, d.memory_mib, d.gpus, d.gpu_milli, d.models}
                                    : Key{0, 0, d.gpus, d.gpu_milli, d.models}];
  }
  std::vector<std::pair<Key, int>> sorted(counts.begin(), counts.end());
  std::stable_sort(sorted.begin(), sorted.end(), [](auto const& a, auto const& b) { return a.second > b.second; });
  std::vector<PodType> types;
  double covered = 0;
  for (auto const& [key, count] : sorted) {
    if (covered >= options.coverage * static_cast<double>(pods.size()) - 1e-9) break;
    auto const [cpu, memory, gpus, milli, models] = key;
    types.push_back({Demand{cpu, memory, gpus, milli, models}, static_cast<double>(count)});
    covered += count;
  }
  for (PodType& t : types) t.share /= covered;
  return types;
}

double node_fragmentation(std::vector<PodType> const& target, int model, int free_cpu, int free_memory,
                          std::span<int const> free_gpus) {
  double const all = free_sum(free_gpus);
  double total = 0;
  for (PodType const& t : target) {
    Demand const& d = t.demand;
    double f = all;  // CPU-only types, and types that cannot run here, can use none of it
    if (d.gpus > 0 && model_allowed(d, model) && free_cpu >= d.cpu_milli && free_memory >= d.memory_mib) {
      int room = 0;
      double unusable = 0;
      for (int g : free_gpus) {
        if (g >= d.gpu_milli)
          ++room;
        else
          unusable += g;
      }
      if (room >= d.gpus) f = unusable;
    }
    total += t.share * f;
  }
  return total;
}

void Placer::index_target(Cluster const& cluster) {
  by_model_.assign(cluster.models().size(), ModelTypes{});
  for (std::size_t m = 0; m < by_model_.size(); ++m) {
    ModelTypes& view = by_model_[m];
    for (PodType const& t : target_) {
      Demand const& d = t.demand;
      if (d.gpus == 0 || !model_allowed(d, static_cast<int>(m))) {
        view.unable_share += t.share;
        continue;
      }
      auto it = std::find_if(view.groups.begin(), view.groups.end(),
                             [&](Group const& g) { return g.gpus == d.gpus && g.gpu_milli == d.gpu_milli; });
      if (it == view.groups.end()) it = view.groups.insert(view.groups.end(), Group{d.gpus, d.gpu_milli, 0.0, {}});
      it->share += t.share;
      it->members.push_back({d.cpu_milli, d.memory_mib, t.share});
    }
    for (Group& g : view.groups)
      std::sort(g.members.begin(), g.members.end(),
                [](Member const& a, Member const& b) { return a.cpu_milli < b.cpu_milli; });
  }
  before_.assign(cluster.nodes().size(), 0.0);
  before_version_.assign(cluster.nodes().size(), 0);
  indexed_ = true;
}

// node_fragmentation(), by group: a group's types share one GPU test; only CPU and memory differ.
double Placer::fragmentation(int model, int free_cpu, int free_memory, std::span<int const> free_gpus) const {
  double const all = free_sum(free_gpus);
  if (all == 0 || model < 0) return 0;
  ModelTypes const& view = by_model_[static_cast<std::size_t>(model)];
  double total = view.unable_share * all;
  for (Group const& g : view.groups) {
    int room = 0;
    double unusable = 0;
    for (int free : free_gpus) {
      if (free >= g.gpu_milli)
        ++room;
      else
        unusable += free;
    }
    if (room < g.gpus) {
      total += g.share * all;
      continue;
    }
    double able = 0;
    for (Member const& m : g.members) {
      if (m.cpu_milli > free_cpu) break;
      if (m.memory_mib <= free_memory) able += m.share;
    }
    total += able * unusable + (g.share - able) * all;
  }
  return total;
}

double Placer::fragmentation_before(Cluster const& cluster, int node) {
  auto const n = static_cast<std::size_t>(node);
  if (before_version_[n] != cluster.version(node) + 1) {
    before_[n] = fragmentation(cluster.model_of(node), cluster.free_cpu(node), cluster.free_memory(node),
                               cluster.free_gpus(node));
    before_version_[n] = cluster.version(node) + 1;
  }
  return before_[n];
}

double Placer::node_fragmentation(Cluster const& cluster, int node) {
  if (!indexed_) index_target(cluster);
  return fragmentation_before(cluster, node);
}

double Placer::node_fragmentation(Cluster const& cluster, int node, int free_cpu, int free_memory,
                                  std::span<int const> free_gpus) {
  if (!indexed_) index_target(cluster);
  return fragmentation(cluster.model_of(node), free_cpu, free_memory, free_gpus);
}

double Placer::cluster_fragmentation(Cluster const& cluster) {
  if (!indexed_) index_target(cluster);
  double total = 0;
  for (int n = 0; n < static_cast<int>(cluster.nodes().size()); ++n) total += fragmentation_before(cluster, n);
  return total;
}

}  // namespace mgpu::cluster
