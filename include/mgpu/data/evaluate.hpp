// The validation loss of a language model on a token stream, defined exactly (the --eval-only
// figure of examples/train_gpt), so that any other implementation can reproduce it.
#pragma once

#include <cstdint>

#include <mgpu/data/tokens.hpp>
#include <mgpu/nn/layers.hpp>

namespace mgpu::data {

/// The validation loss, defined exactly: the mean per-token cross-entropy over the first `windows`
/// consecutive, non-overlapping block-sized windows of `loader`'s token stream (window i: ids =
/// tokens [i T, i T + T), targets = the next tokens [i T + 1, i T + T + 1), T the loader's block),
/// evaluated loader.options().batch windows per forward, in evaluation mode (the model is put
/// back in training mode after). The loader's position is not used or changed. The sum is taken
/// in float64. Throws Error(invalid_argument) unless the loader is sequential and 1 <= windows <=
/// loader.windows(). Synchronizes ctx's stream.
double evaluate_lm(nn::Sequential& model, TokenLoader const& loader, std::int64_t windows, nn::Context& ctx);

}  // namespace mgpu::data
