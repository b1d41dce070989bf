// AdamW parameter groups (decay_ranges) against two plain AdamW runs, one with the decay and one
// without, and gpt_decay_ranges (the layers' matrix_ranges) against gpt_parameters' shapes, for the
// whole model and for its pipeline stages.
#include <algorithm>
#include <vector>

#include <mgpu/nn/gpt.hpp>
#include <mgpu/optim/optim.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/nn_env.hpp"

using mgpu::Errc;
using mgpu::Tensor;
using mgpu::test::Env;
namespace optim = mgpu::optim;

TEST_CASE("AdamW decay_ranges: decay inside the ranges only, whatever ranges update() is given", "[nn][optim]") {
  Env env;
  Tensor const start = env.random({10}, 1);
  Tensor const grads = env.random({10}, 2);
  auto const run = [&](optim::AdamWOptions const& options, bool split) {
    Tensor params = env.random({10}, 1);
    optim::AdamW opt(options);
    for (int step = 0; step < 3; ++step) {
      opt.begin_step(params, *env.allocator, env.stream);
      if (split) {  // as per-layer updates during backward: ranges that cut across the groups
        opt.update(params, grads, 6, 10, env.stream, 0.5f);
        opt.update(params, grads, 0, 6, env.stream, 0.5f);
      } else {
        opt.update(params, grads, 0, 10, env.stream, 0.5f);
      }
    }
    env.stream.synchronize();
    return mgpu::test::as_double(params);
  };
  optim::AdamWOptions const decay{.lr = 0.1f, .weight_decay = 0.5f};
  optim::AdamWOptions const none{.lr = 0.1f, .weight_decay = 0.0f};
  optim::AdamWOptions grouped = decay;
  grouped.decay_ranges = {{2, 5}, {7, 9}};
  std::vector<double> const with = run(decay, false), without = run(none, false);
  for (bool const split : {false, true}) {
    std::vector<double> const got = run(grouped, split);
    for (std::size_t i = 0; i < got.size(); ++i) {
      bool const decayed = (i >= 2 && i < 5) || (i >= 7 && i < 9);
      INFO("element " << i << (split ? ", split update" : ""));
      CHECK(got[i] == Approx(decayed ? with[i] : without[i]).epsilon(1e-6));
      CHECK(with[i] != without[i]);  // the decay is visible at every element
    }
  }
  REQUIRE_MGPU_ERROR(optim::AdamW({.decay_ranges = {{3, 5}, {4, 6}}}), Errc::invalid_argument,
                     "AdamW decay range [4, 6) after one ending at 5");
  REQUIRE_MGPU_ERROR(optim::AdamW({.decay_ranges = {{3, 3}}}), Errc::invalid_argument, "AdamW decay range [3, 3)");
}

TEST_CASE("gpt_decay_ranges cover exactly the 2-D parameters of gpt_parameters", "[nn][gpt][optim]") {
  mgpu::nn::GptConfig const config{.vocab = 13, .block_size = 6, .n_layer = 2, .n_head = 2, .n_embd = 8};
  auto const ranges = mgpu::nn::gpt_decay_ranges(config);
  for (auto const& p : mgpu::nn::gpt_parameters(config)) {
    std::int64_t inside = 0;
    for (auto const& [b, e] : ranges)
      inside += std::max<std::int64_t>(0, std::min(e, p.offset + p.numel()) - std::max(b, p.offset));
    INFO(p.name);
    CHECK(inside == (p.shape.size() == 2 ? p.numel() : 0));
  }
  CHECK(ranges.front() == std::pair<std::int64_t, std::int64_t>{0, (13 + 6) * 8});  // wte and wpe merged
}

TEST_CASE("a GPT stage's matrix ranges are the whole model's that fall into it, and its head's copy of wte",
          "[nn][gpt][optim]") {
  mgpu::nn::GptConfig const config{.vocab = 13, .block_size = 6, .n_layer = 2, .n_head = 2, .n_embd = 8};
  mgpu::nn::Sequential const whole = mgpu::nn::gpt(config);
  auto const want = mgpu::nn::gpt_decay_ranges(config);
  auto const decayed = [&](std::int64_t i) {
    return std::any_of(want.begin(), want.end(), [&](auto const& r) { return i >= r.first && i < r.second; });
  };
  for (std::vector<std::size_t> const& cuts : {std::vector<std::size_t>{0, 3, whole.size()},
                                              std::vector<std::size_t>{0, 2, 3, 4, whole.size()}}) {
    std::int64_t offset = 0;  // where the stage starts in the whole model's buffer
    for (std::size_t c = 0; c + 1 < cuts.size(); ++c) {
      mgpu::nn::Sequential const stage = whole.stage(cuts[c], cuts[c + 1]);
      auto const ranges = stage.matrix_ranges();
      bool const last = c + 2 == cuts.size();
      std::int64_t const copy = last ? config.vocab * config.n_embd : 0;  // the head's copy of wte, at the end
      INFO("stage " << c << " of " << cuts.size() - 1);
      for (std::int64_t i = 0; i < stage.parameter_count(); ++i) {
        bool const inside =
            std::any_of(ranges.begin(), ranges.end(), [&](auto const& r) { return i >= r.first && i < r.second; });
        CHECK(inside == (i >= stage.parameter_count() - copy ? true : decayed(offset + i)));
      }
      offset += stage.parameter_count() - copy;
    }
    CHECK(offset == whole.parameter_count());
  }
}
