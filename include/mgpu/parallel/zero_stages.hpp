// Which ZeRO stages each layout's replicas run: the one rule that train::ParallelConfig::validate
// refuses by and plan::plan_gpt enumerates by (docs/parallel-layouts.md, "ZeRO").
#pragma once

#include <mgpu/core/dtype.hpp>

namespace mgpu::parallel {

/// The highest ZeRO stage (DataParallelOptions::zero_stage, TensorParallelOptions::zero_stage) that
/// replicas computing in `compute` run: 3 in float32 and in 16 bits (float32 masters, sharded like
/// the optimizer state); a pipeline's replicas (`pipeline`) 3 in every precision too (the gradients
/// sharded after each chunk's micro-batches, the parameters gathered per unit and pass, rounded to
/// 16 bits as they are gathered).
[[nodiscard]] constexpr int max_zero_stage(DType /*compute*/, bool /*pipeline*/) noexcept { return 3; }

}  // namespace mgpu::parallel
