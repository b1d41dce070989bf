// The validation loss of a language model, defined exactly (train_gpt's --eval-only figure).
#pragma once

#include <cstdint>

#include <mgpu/data/tokens.hpp>
#include <mgpu/nn/layers.hpp>

namespace mgpu::data {

/// The mean per-token cross-entropy (summed in float64) over the first `windows` windows of a
/// sequential `loader` (window i: ids [iT, iT + T), targets one token on), in evaluation mode,
/// batch windows a forward; the loader's position is untouched. Synchronizes ctx's stream. Throws
/// Error(invalid_argument) unless the loader is sequential and 1 <= windows <= loader.windows().
double evaluate_lm(nn::Sequential& model, TokenLoader const& loader, std::int64_t windows, nn::Context& ctx);

}  // namespace mgpu::data
