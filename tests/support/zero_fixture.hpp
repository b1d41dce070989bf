// The ZeRO tests' shared fixture: a small GPT (a batch uneven over 2, 3 and 4 devices), its AdamW,
// the steps and clipping of a run, and the relative difference they compare with.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <mgpu/nn/gpt.hpp>
#include <mgpu/optim/optim.hpp>

#include "support/catch.hpp"

namespace mgpu::test::zero {

inline nn::GptConfig const config{.vocab = 64, .block_size = 16, .n_layer = 2, .n_head = 2, .n_embd = 32};
inline std::int64_t const batch = 7;  // uneven over 2, 3 and 4 devices
inline int const steps = 20;
inline float const clip = 0.5f;  // below the gradients' norm early on, so steps clip

// The GPT's AdamW, decaying its weight matrices.
inline optim::AdamW gpt_adamw() {
  return optim::AdamW(
      {.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .weight_decay = 0.1f, .decay_ranges = nn::gpt_decay_ranges(config)});
}

// The largest |got - want| / (floor + |want|).
inline double worst_relative(std::vector<float> const& got, std::vector<float> const& want, double floor = 0) {
  REQUIRE(got.size() == want.size());
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    worst = std::max(
        worst, std::abs(static_cast<double>(got[i]) - want[i]) / (floor + std::abs(static_cast<double>(want[i]))));
  return worst;
}

}  // namespace mgpu::test::zero
