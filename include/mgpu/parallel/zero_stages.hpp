// Which ZeRO stages each layout's replicas run: the one rule that train::ParallelConfig::validate
// refuses by and plan::plan_gpt enumerates by (docs/parallel-layouts.md, "ZeRO").
#pragma once

#include <mgpu/core/dtype.hpp>

namespace mgpu::parallel {

/// The highest ZeRO stage that replicas computing in `compute` run, a pipeline's (`pipeline`) too: 3.
[[nodiscard]] constexpr int max_zero_stage(DType /*compute*/, bool /*pipeline*/) noexcept { return 3; }

}  // namespace mgpu::parallel
