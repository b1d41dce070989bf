// nn::apply_update with the caller's say over how the parts' values add up: for an executor whose
// parts are not all in this process, or that adds them in another order (a pipeline's replicas
// and stages across processes). Internal: not installed.
#pragma once

#include <functional>
#include <span>

#include <mgpu/core/tensor.hpp>
#include <mgpu/nn/train.hpp>

namespace mgpu::nn::detail {

/// Adds up the parts' values of the overflow count or the norm's squares and returns their total
/// over every part and rank. sums[i] (float32, on part i's stream) holds a value per range of part
/// i's update, 0 for a range not counted: for a part whose `sharded` has owned() ranges, one per
/// owned() range; else three: the elements before shared_begin, the shared ones, those after.
using PartTotal = std::function<double(std::span<Tensor const> sums)>;

/// nn::apply_update (the one unscale, overflow count, clipping norm and update), adding the parts'
/// values with `total` (when set) in place of summing each sharded part's over its ranks
/// (GradientSync::sum_over_ranks) and adding them all in part order in double.
bool apply_update(std::span<UpdatePart const> parts, UpdateOptions const& options, PartTotal const& total);

}  // namespace mgpu::nn::detail
