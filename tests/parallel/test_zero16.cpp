// DataParallel's ZeRO-2 and ZeRO-3 in bfloat16 and float16 (float32 masters, a loss scaler for
// float16): against ZeRO-1 in the same precision, against one device's 16-bit run, an overflow
// step skipped alike on every rank, and each device's state 1/N of the replicated run's.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <mgpu/core/device_group.hpp>
#include <mgpu/core/memory.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/parallel/data_parallel.hpp>

#include "support/catch.hpp"
#include "support/nn_env.hpp"
#include "support/zero_fixture.hpp"

using mgpu::DType;
namespace nn = mgpu::nn;
using namespace mgpu::test::zero;

namespace {

struct Run {
  std::vector<float> losses, weights;
  std::int64_t skipped = 0;
};

DataParallelOptions options_for(int stage, DType compute, float initial_scale = 1024.0f) {
  DataParallelOptions options = gpt_options(stage);
  options.compute = compute;
  if (compute == DType::float16) options.loss_scaler.emplace(initial_scale, 2.0f, 0.5f, 4);
  return options;
}

// `steps` steps of the fixture's GPT at `stage` on `devices` host devices, every rank's weights
// after (rank after rank).
Run gpt_run(int devices, int stage, DType compute, std::vector<mgpu::test::TokenBatch> const& batches, float initial_scale = 1024.0f) {
  mgpu::DeviceGroup group("host:" + std::to_string(devices));
  DataParallel dp(nn::gpt(config), group, gpt_adamw(), options_for(stage, compute, initial_scale));
  Run out;
  for (auto const& b : batches) out.losses.push_back(dp.step(b.ids, b.targets).loss);
  for (int r = 0; r < devices; ++r) {
    std::vector<float> const w = host_values(dp.replica(r).master_parameters(), group.stream(r));
    out.weights.insert(out.weights.end(), w.begin(), w.end());
  }
  if (dp.loss_scaler() != nullptr) out.skipped = dp.loss_scaler()->skipped();
  return out;
}

}  // namespace

// Stages 2 and 3 unscale the same 16-bit gradients into float32, reduce them in float32 as stage 1
// does (stage 1 in place, they in staging buffers, the same values in the same order), and update
// the same owned float32 masters; stage 3's layers read the gathered masters rounded to 16 bits,
// the values stage 1's all-gather and rounding give. So no 16-bit rounding separates them: bit for
// bit. Against one device, whose rows are not split, only the 16-bit rounding of activations
// differs (each shard rounds its own): losses within 2%.
TEST_CASE("zero_stage 2 and 3 in bfloat16 and float16 give zero_stage 1's GPT run bit for bit, within 2% of one device",
          "[parallel][dp][zero][gpt]") {
  Env env;
  auto const batches = gpt_batches(env, 300);
  for (DType const compute : {DType::bfloat16, DType::float16}) {
    CAPTURE(mgpu::to_string(compute));
    Run const single = gpt_run(1, 0, compute, batches);
    Run const one = gpt_run(2, 1, compute, batches);
    CHECK(one.losses.back() < 0.8f * one.losses.front());  // it learns
    CHECK(worst_relative(one.losses, single.losses) <= 0.02);
    for (int const stage : {2, 3}) {
      CAPTURE(stage);
      Run const got = gpt_run(2, stage, compute, batches);
      CHECK(got.losses == one.losses);
      CHECK(got.weights == one.weights);
      CHECK(worst_relative(got.losses, single.losses) <= 0.02);
    }
  }
}

// A scale that overflows float16 at first: every rank skips the first steps alike (the overflow
// counted over every rank's owned gradients), backs off, and then learns as stage 1 does.
TEST_CASE("zero_stage 2 and 3 in float16 skip an overflowing step on every rank as zero_stage 1 does", "[parallel][dp][zero][gpt]") {
  Env env;
  auto batches = gpt_batches(env, 300);
  batches.resize(6);
  Run const one = gpt_run(2, 1, DType::float16, batches, 1e30f);
  CHECK(one.skipped >= 1);
  std::size_t const n = one.weights.size() / 2;
  for (int const stage : {2, 3}) {
    CAPTURE(stage);
    Run const got = gpt_run(2, stage, DType::float16, batches, 1e30f);
    CHECK(got.skipped == one.skipped);
    CHECK(got.losses == one.losses);
    CHECK(got.weights == one.weights);
    CHECK(std::vector<float>(got.weights.begin(), got.weights.begin() + static_cast<std::ptrdiff_t>(n)) ==
          std::vector<float>(got.weights.begin() + static_cast<std::ptrdiff_t>(n), got.weights.end()));  // the ranks agree
  }
}

// What each device holds between steps (its allocator's bytes): at stage 3 about 1/N of what the
// replicated 16-bit run holds (float32 masters, their 16-bit copies, gradients and AdamW's state),
// and less at each stage from 1 to 3.
TEST_CASE("zero_stage 2 and 3 in bfloat16 keep about 1/N of the replicated run's state per device", "[parallel][dp][zero][gpt]") {
  Env env;
  nn::GptConfig const deep{.vocab = 64, .block_size = 16, .n_layer = 6, .n_head = 2, .n_embd = 32};
  mgpu::test::TokenBatch const b = mgpu::test::rule_batch(env, batch, deep.block_size, deep.vocab, 7);
  int const devices = 4;
  std::vector<std::vector<std::size_t>> held(4);
  for (int const stage : {0, 1, 2, 3}) {
    CAPTURE(stage);
    mgpu::DeviceGroup group("host:" + std::to_string(devices));
    DataParallelOptions options = options_for(stage, DType::bfloat16);
    options.bucket_cap_bytes = 8192;  // a bucket per block
    DataParallel dp(nn::gpt(deep), group, mgpu::optim::AdamW({.decay_ranges = nn::gpt_decay_ranges(deep)}), options);
    std::vector<float> losses;
    for (int s = 0; s < 3; ++s) losses.push_back(dp.step(b.ids, b.targets).loss);
    dp.group().synchronize();
    CHECK(losses.back() < losses.front());
    for (int r = 0; r < devices; ++r) held[static_cast<std::size_t>(stage)].push_back(group.allocator(r).stats().allocated);
  }
  // Stage 3 keeps its owned masters, gradients and state (1/N), the last unit's buffers (the
  // embeddings: gathered float32 staging aside, its 16-bit parameters and gradients, float32
  // gradient staging) and per bucket a few leftover elements.
  std::int64_t const embeddings = (deep.vocab + deep.block_size) * deep.n_embd;
  std::size_t const last = mgpu::Allocator::block_size(static_cast<std::size_t>(embeddings) * 8);
  std::size_t const leftovers = 64 * 1024;
  for (int r = 0; r < devices; ++r) {
    CAPTURE(r);
    auto const i = static_cast<std::size_t>(r);
    WARN("device " << r << " holds " << held[0][i] << ", " << held[1][i] << ", " << held[2][i] << ", " << held[3][i] << " bytes at stages 0 to 3");
    CHECK(held[1][i] < held[0][i]);
    CHECK(held[2][i] < held[1][i]);
    CHECK(held[3][i] < held[2][i]);
    CHECK(held[3][i] <= held[0][i] / devices + last + leftovers);
  }
}
