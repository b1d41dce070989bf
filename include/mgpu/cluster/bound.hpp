// An offline bound for the fill experiment: the least unallocated GPU share that any placement of
// a set of pods on a cluster could reach, whatever the order they came in and whatever policy
// placed them. Two methods: a linear-programming relaxation of the packing over node kinds (GPU
// share, whole GPUs, CPU and memory, with counting cuts for shares that cannot share a GPU),
// solved with GLPK and fast at the published cluster's 6,212 GPUs; and the exact integer program
// over every node and GPU (GLPK's branch and cut), for small instances. The free functions touch
// only their arguments, but call one thread at a time: GLPK may keep its environment per process.
#pragma once

#include <span>

#include <mgpu/cluster/cluster.hpp>
#include <mgpu/cluster/policy.hpp>

namespace mgpu::cluster {

/// relaxation: a lower bound (the LP over node kinds); exact: the optimum (an integer program
/// with a variable per pod type and node, and per fractional type and GPU; small instances only).
enum class BoundMethod { relaxation, exact };

/// A lower bound on the unallocated GPU share (1 - allocated / capacity) that a placement of any
/// subset of `demands` on `cluster`'s nodes can reach; the cluster's current allocations are
/// ignored. With BoundMethod::exact it is the least share exactly. Throws Error(invalid_argument)
/// for a cluster without GPUs, and for BoundMethod::exact on an instance of more than 20,000
/// integer variables (naming their number; expected the relaxation there).
[[nodiscard]] double unallocated_bound(Cluster const& cluster, std::span<Demand const> demands,
                                       BoundMethod method = BoundMethod::relaxation);

/// The fill experiment's bound: the pods fill() draws with `options` (the same for every policy),
/// and at each of its points the bound on the unallocated share for the pods arrived by then
/// (policy "bound"; allocated = 1 - unallocated; the other fields 0). Throws as fill() does.
[[nodiscard]] FillResult fill_bound(std::vector<NodeSpec> const& nodes, std::vector<Pod> const& trace,
                                    FillOptions const& options, BoundMethod method = BoundMethod::relaxation);

}  // namespace mgpu::cluster
