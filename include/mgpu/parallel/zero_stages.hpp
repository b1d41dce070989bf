// Which ZeRO stages each layout's replicas run: the one rule that train::ParallelConfig::validate
// refuses by and plan::plan_gpt enumerates by (docs/parallel-layouts.md, "ZeRO").
#pragma once

#include <mgpu/core/dtype.hpp>

namespace mgpu::parallel {

/// The highest ZeRO stage that replicas computing in `compute` run: 3, except a pipeline's replicas
/// (`pipeline`) in 16 bits: 2.
[[nodiscard]] constexpr int max_zero_stage(DType compute, bool pipeline) noexcept {
  if (!pipeline) return 3;
  return compute == DType::float32 ? 3 : 2;
}

}  // namespace mgpu::parallel
