// An offline bound for the fill experiment: the least unallocated GPU share any placement of a set
// of pods could reach. One thread at a time (GLPK's environment). Guide: docs/scheduler-and-cluster.md.
#pragma once

#include <span>

#include <mgpu/cluster/cluster.hpp>
#include <mgpu/cluster/policy.hpp>

namespace mgpu::cluster {

/// relaxation: a lower bound (an LP over node kinds); exact: the optimum (small instances only).
enum class BoundMethod { relaxation, exact };

/// A lower bound on the unallocated GPU share any placement of `demands` on `cluster`'s empty nodes
/// reaches (exact: the least). Throws Error(invalid_argument) for no GPUs, or exact over 20,000
/// integer variables.
[[nodiscard]] double unallocated_bound(Cluster const& cluster, std::span<Demand const> demands,
                                       BoundMethod method = BoundMethod::relaxation);

/// The bound at each point of fill() with `options` (policy "bound", allocated = 1 - the bound,
/// other fields 0). Throws as fill() does.
[[nodiscard]] FillResult fill_bound(std::vector<NodeSpec> const& nodes, std::vector<Pod> const& trace,
                                    FillOptions const& options, BoundMethod method = BoundMethod::relaxation);

}  // namespace mgpu::cluster
