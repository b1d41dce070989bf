// Internal: the pods the fill experiment draws (the same for every policy and for the bound), and
// the points at which it reports.
#pragma once

#include <cstddef>
#include <vector>

#include <mgpu/cluster/policy.hpp>

namespace mgpu::cluster::detail {

/// A point of the fill: reached when `pods` draws have arrived.
struct FillMark {
  std::size_t pods = 0;
  double arrived = 0;
};

struct FillDraws {
  std::vector<Demand> demands{};  ///< of each pod of the trace
  std::vector<std::size_t> pods{};  ///< the trace index of each draw
  std::vector<FillMark> marks{};
};

/// Draws pods from `trace` (seeded by options.seed, with replacement) until their GPU demand
/// reaches options.max_arrived of `cluster`'s capacity. Throws Error(invalid_argument) as fill()
/// documents.
FillDraws draw_fill(Cluster const& cluster, std::vector<Pod> const& trace, FillOptions const& options);

}  // namespace mgpu::cluster::detail
