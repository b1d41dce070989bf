// Placer: rates every node that fits a demand under the chosen policy and picks one by the tie rule.
#include <mgpu/cluster/policy.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include <mgpu/core/error.hpp>

#include "placement.hpp"

namespace mgpu::cluster {

using detail::free_sum;
using detail::model_allowed;

Placer::Placer(FitPolicy policy, TieRule tie, std::vector<PodType> target, unsigned seed)
    : policy_(policy), tie_(tie), target_(std::move(target)), rng_(seed) {
  if (policy_ == FitPolicy::fgd && target_.empty())
    throw Error(Errc::invalid_argument, "the fgd policy without a target workload (expected at least one pod type)");
}

Placer::Candidate Placer::rate(Cluster const& cluster, Demand const& d, int node) {
  std::vector<int> const& free = cluster.free_gpus(node);
  NodeSpec const& spec = cluster.nodes()[static_cast<std::size_t>(node)];
  Candidate c;
  // The GPUs: whole GPUs are all alike (the first free ones); a fraction goes where the policy says.
  if (d.gpus > 1 || d.gpu_milli == 1000) {
    for (int g = 0; g < static_cast<int>(free.size()) && static_cast<int>(c.gpus.size()) < d.gpus; ++g)
      if (free[static_cast<std::size_t>(g)] >= d.gpu_milli) c.gpus.push_back(g);
  } else if (d.gpus == 1) {
    int pick = -1;
    int fitting = 0;
    double best_after = std::numeric_limits<double>::infinity();
    for (int g = 0; g < static_cast<int>(free.size()); ++g) {
      int const f = free[static_cast<std::size_t>(g)];
      if (f < d.gpu_milli) continue;
      ++fitting;
      int const current = pick < 0 ? 0 : free[static_cast<std::size_t>(pick)];
      switch (policy_) {
        case FitPolicy::first_fit:
          if (pick < 0) pick = g;
          break;
        case FitPolicy::worst_fit:
          if (pick < 0 || f > current) pick = g;
          break;
        case FitPolicy::random:  // reservoir: each fitting GPU equally likely
          if (std::uniform_int_distribution<int>(0, fitting - 1)(rng_) == 0) pick = g;
          break;
        case FitPolicy::fgd: {
          if (pick >= 0 && f == current) break;  // the same free share: the same outcome
          after_.assign(free.begin(), free.end());
          after_[static_cast<std::size_t>(g)] -= d.gpu_milli;
          double const after = fragmentation(cluster.model_of(node), cluster.free_cpu(node) - d.cpu_milli,
                                             cluster.free_memory(node) - d.memory_mib, after_);
          if (after < best_after - 1e-9 || (after <= best_after + 1e-9 && f < current)) {
            best_after = after;
            pick = g;
          }
          break;
        }
        default:  // best-fit, dot-product, gpu-packing: the fullest GPU that fits
          if (pick < 0 || f < current) pick = g;
          break;
      }
    }
    c.gpus.push_back(pick);
    if (policy_ == FitPolicy::fgd) {
      c.score = best_after - fragmentation_before(cluster, node);
      return c;
    }
  }
  double const cpu_left = static_cast<double>(cluster.free_cpu(node) - d.cpu_milli) / spec.cpu_milli;
  double const memory_left = static_cast<double>(cluster.free_memory(node) - d.memory_mib) / spec.memory_mib;
  double const gpu_capacity = 1000.0 * std::max(spec.gpus, 1);
  double const gpu_free = free_sum(free);
  double const gpu_asked = static_cast<double>(d.gpus) * d.gpu_milli;
  switch (policy_) {
    case FitPolicy::random:
      c.score = std::uniform_real_distribution<double>(0.0, 1.0)(rng_);
      break;
    case FitPolicy::first_fit:
      c.score = node;
      break;
    case FitPolicy::best_fit:
      c.score = cpu_left + memory_left + (gpu_free - gpu_asked) / gpu_capacity;
      break;
    case FitPolicy::worst_fit:
      c.score = -(cpu_left + memory_left + (gpu_free - gpu_asked) / gpu_capacity);
      break;
    case FitPolicy::dot_product:
      c.score = -(static_cast<double>(d.cpu_milli) * cluster.free_cpu(node) /
                      (static_cast<double>(spec.cpu_milli) * spec.cpu_milli) +
                  static_cast<double>(d.memory_mib) * cluster.free_memory(node) /
                      (static_cast<double>(spec.memory_mib) * spec.memory_mib) +
                  gpu_asked * gpu_free / (gpu_capacity * gpu_capacity));
      break;
    case FitPolicy::gpu_packing: {
      bool const used = gpu_free < 1000.0 * spec.gpus || (spec.gpus == 0 && cluster.free_cpu(node) < spec.cpu_milli);
      bool const shares_gpu =
          d.gpus == 1 && d.gpu_milli < 1000 && free[static_cast<std::size_t>(c.gpus.front())] < 1000;
      c.score = shares_gpu ? 0 : used ? 1 : 2;
      break;
    }
    case FitPolicy::fgd: {  // whole GPUs or CPU-only
      after_.assign(free.begin(), free.end());
      for (int g : c.gpus) after_[static_cast<std::size_t>(g)] -= d.gpu_milli;
      c.score = fragmentation(cluster.model_of(node), cluster.free_cpu(node) - d.cpu_milli,
                              cluster.free_memory(node) - d.memory_mib, after_) -
                fragmentation_before(cluster, node);
      break;
    }
  }
  return c;
}

namespace {

// The node indices 0 to count - 1, without a list.
struct AllNodes {
  int count;
  struct Iterator {
    int n;
    int operator*() const { return n; }
    Iterator& operator++() {
      ++n;
      return *this;
    }
    bool operator!=(Iterator const& o) const { return n != o.n; }
  };
  [[nodiscard]] Iterator begin() const { return {0}; }
  [[nodiscard]] Iterator end() const { return {count}; }
};

}  // namespace

std::optional<Allocation> Placer::choose(Cluster const& cluster, Demand const& d) {
  return pick(cluster, d, AllNodes{static_cast<int>(cluster.nodes().size())});
}

std::optional<Allocation> Placer::choose_among(Cluster const& cluster, Demand const& d, std::span<int const> nodes) {
  for (int n : nodes) {
    if (n < 0 || n >= static_cast<int>(cluster.nodes().size()))
      throw Error(Errc::invalid_argument, "choose among node " + std::to_string(n) + " (expected 0 to " +
                                              std::to_string(cluster.nodes().size() - 1) + ")");
  }
  return pick(cluster, d, nodes);
}

template <class Nodes>
std::optional<Allocation> Placer::pick(Cluster const& cluster, Demand const& d, Nodes const& nodes) {
  if (!indexed_) index_target(cluster);
  int best = -1;
  Candidate best_candidate;
  int ties = 0;
  for (int n : nodes) {
    if (!cluster.fits(d, n)) continue;
    Candidate c = rate(cluster, d, n);
    double const eps = 1e-9 * std::max(1.0, std::abs(best_candidate.score));
    bool take = false;
    if (best < 0 || c.score < best_candidate.score - eps) {
      take = true;
      ties = 1;
    } else if (c.score <= best_candidate.score + eps) {
      ++ties;
      switch (tie_) {
        case TieRule::first:
          break;
        case TieRule::random:
          take = std::uniform_int_distribution<int>(0, ties - 1)(rng_) == 0;
          break;
        case TieRule::packed:
          take = free_sum(cluster.free_gpus(n)) < free_sum(cluster.free_gpus(best));
          break;
      }
    }
    if (take) {
      best = n;
      best_candidate = std::move(c);
    }
  }
  if (best < 0) return std::nullopt;
  return Allocation{best, std::move(best_candidate.gpus), d.gpus > 0 ? d.gpu_milli : 0, d.cpu_milli, d.memory_mib};
}

}  // namespace mgpu::cluster
