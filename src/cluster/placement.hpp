// Internal: the small demand and free-GPU helpers the placer and FGD's measure share.
#pragma once

#include <span>

#include <mgpu/cluster/cluster.hpp>

namespace mgpu::cluster::detail {

/// Whether `d` may run on GPUs of `model` (an index into Cluster::models()).
inline bool model_allowed(Demand const& d, int model) { return model >= 0 && (d.models >> model & 1); }

/// The free GPU share of a node, in milli-GPUs.
inline int free_sum(std::span<int const> gpus) {
  int s = 0;
  for (int g : gpus) s += g;
  return s;
}

}  // namespace mgpu::cluster::detail
