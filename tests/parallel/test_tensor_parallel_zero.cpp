// ZeRO over tensor parallelism's data-parallel replicas (TensorParallelOptions::zero_stage): each
// tensor-parallel index's replicas share DataParallel's gradient sync, which shards the update and
// the optimizer state (stage 1), the gradients (stage 2) and the parameters (stage 3). DP 2 x TP 2,
// with and without sequence parallelism, with clipping and without, follows the one device's curve
// and the replicated update's (stage 0) in float32; ZeRO-1, 2 and 3 in bfloat16 and float16 the
// one device's 16-bit curve; each rank keeps half of its shard's optimizer state (and at stages 2 and 3
// less of its gradients and parameters); checkpoints hold the whole state and continue.
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <mgpu/core/device_group.hpp>
#include <mgpu/core/memory.hpp>
#include <mgpu/io/checkpoint.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/parallel/memory_model.hpp>
#include <mgpu/parallel/tensor_parallel.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/nn_env.hpp"
#include "support/tp_fixture.hpp"
#include "support/temp_path.hpp"

namespace fs = std::filesystem;
namespace nn = mgpu::nn;
namespace par = mgpu::parallel;
using mgpu::DType;
using mgpu::test::Env;
using mgpu::test::TokenBatch;
using mgpu::test::worst_relative;
using mgpu::test::tp::adamw;
using mgpu::test::tp::config;
using mgpu::test::tp::Curve;
using mgpu::test::tp::scaler_for;

namespace {

std::uint64_t const seed = 6;

std::vector<TokenBatch> batches(Env& env, int count) { return mgpu::test::rule_batches(env, count, 4, config, 900); }

// DP 2 x TP 2 with buckets of 8 KiB (several per shard, so stage 2's staging buffers take turns).
par::TensorParallelOptions options(int zero, float clip, bool sequence_parallel = false, DType compute = DType::float32,
                                   std::uint64_t at = seed) {
  return {.seed = at,
          .adamw = adamw,
          .clip_norm = clip,
          .data_parallel = 2,
          .zero_stage = zero,
          .bucket_cap_bytes = 8 << 10,
          .first_bucket_cap_bytes = 4 << 10,
          .sequence_parallel = sequence_parallel,
          .compute = compute,
          .loss_scaler = scaler_for(compute)};
}

Curve run(par::TensorParallel& tp, std::vector<TokenBatch> const& bs, std::size_t from, std::size_t to) {
  Curve out;
  for (std::size_t s = from; s < to; ++s) {
    par::TensorParallel::StepResult const r = tp.step(bs[s].ids, bs[s].targets);
    out.losses.push_back(r.loss);
    out.applied.push_back(r.applied);
  }
  return out;
}

Curve one_device(Env& env, std::vector<TokenBatch> const& bs, float clip, DType compute = DType::float32) {
  return mgpu::test::tp::one_device_run(env, bs, seed, clip, compute);
}

}  // namespace

TEST_CASE("DP 2 x TP 2 with ZeRO-1, 2 and 3, with and without sequence parallelism, trains as ZeRO-0 and one device",
          "[parallel][tensor][zero]") {
  Env env;
  auto const bs = batches(env, 6);
  float const clip = 0.2f;
  Curve const clipped = one_device(env, bs, clip);
  Curve const free = one_device(env, bs, 0.0f);
  REQUIRE(worst_relative(clipped.losses, free.losses) > 1e-4);  // the clipping is active
  for (bool const sp : {false, true}) {
    for (float const c : {clip, 0.0f}) {  // without clipping the update runs at the commit point
      std::vector<double> stage0;
      for (int const zero : {0, 1, 2, 3}) {
        CAPTURE(sp, c, zero);
        mgpu::DeviceGroup group("host:4");
        par::TensorParallel tp(group, nn::gpt(config), options(zero, c, sp));
        Curve const got = run(tp, bs, 0, bs.size());
        CHECK(worst_relative(got.losses, c > 0 ? clipped.losses : free.losses) < 1e-5);
        if (zero == 0) stage0 = got.losses;
        CHECK(worst_relative(got.losses, stage0) < 1e-5);
        // The replicas stay alike: each tensor-parallel index's two shards hold the same weights.
        for (int t = 0; t < 2; ++t) {
          mgpu::Tensor const a = tp.shard(t).master_parameters(), b = tp.shard(2 + t).master_parameters();
          group.synchronize();
          std::vector<float> const x(a.host_span<float>().begin(), a.host_span<float>().end());
          std::vector<float> const y(b.host_span<float>().begin(), b.host_span<float>().end());
          CHECK(x == y);
        }
      }
    }
  }
}

TEST_CASE("ZeRO over tensor parallelism's replicas halves each rank's optimizer state (1), gradients (2) and parameters (3), "
          "as the memory model predicts",
          "[parallel][tensor][zero][memory]") {
  Env env;
  auto const bs = batches(env, 2);
  // Eight blocks, each its own bucket: stage 2's two staging buckets and the owned half of the
  // gradients take less than the whole gradient buffer.
  nn::GptConfig deep = config;
  deep.n_layer = 8;
  std::vector<std::vector<std::size_t>> held(4), peak(4);
  std::vector<std::vector<par::GptMemory>> predicted;  // the memory model's, per stage
  std::vector<std::int64_t> parameters;
  for (int const zero : {0, 1, 2, 3}) {
    mgpu::DeviceGroup group("host:4");
    par::TensorParallel tp(group, nn::gpt(deep), options(zero, 0.2f));
    for (int r = 0; r < 4; ++r) group.allocator(r).reset_peak();
    (void)run(tp, bs, 0, bs.size());
    group.synchronize();  // host streams' queued work holds tensors until it has run
    for (int r = 0; r < 4; ++r) {
      held[static_cast<std::size_t>(zero)].push_back(group.allocator(r).stats().allocated);
      peak[static_cast<std::size_t>(zero)].push_back(group.allocator(r).stats().peak_allocated);
    }
    if (zero == 0)
      for (int r = 0; r < 4; ++r) parameters.push_back(tp.shard(r).parameter_count());
    predicted.push_back(par::predict_gpt_memory(
        deep, 4, {.data_parallel = 2, .tensor_parallel = 2, .zero_stage = zero, .bucket_cap_bytes = 8 << 10, .first_bucket_cap_bytes = 4 << 10}));
  }
  for (std::size_t r = 0; r < 4; ++r) {
    CAPTURE(r, held[0][r], held[1][r], held[2][r], held[3][r], peak[1][r], peak[3][r], parameters[r]);
    // AdamW's two state buffers of float32 per parameter: stage 1 keeps half of them (plus fewer
    // elements than the ranks per bucket past the blocks, and the blocks' rounding).
    auto const state = static_cast<double>(2 * sizeof(float) * static_cast<std::size_t>(parameters[r]));
    double const saved = static_cast<double>(held[0][r]) - static_cast<double>(held[1][r]);
    CHECK(saved > 0.47 * state);
    CHECK(saved < 0.53 * state);
    // The gradients: the owned half and two staging buckets (of about 1/8 each) for the whole.
    CHECK(static_cast<double>(held[2][r]) < static_cast<double>(held[1][r]) - 0.1 * state / 2);
    // Stage 3 keeps the owned half of the parameters and the embeddings' unit (the others come
    // and go), and peaks below stage 1.
    CHECK(static_cast<double>(held[3][r]) < static_cast<double>(held[2][r]) - 0.6 * state / 2);
    CHECK(peak[3][r] < peak[1][r]);
    // The memory model lays out each rank's shard's buckets as the sync does: the state and the
    // gradients it saves are those measured, and its peaks are the measured ones within 0.5%.
    CHECK(held[0][r] - held[1][r] == predicted[0][r].optimizer - predicted[1][r].optimizer);
    // (Between steps stage 2 holds no staging for the last bucket, the embeddings, which the model
    // counts at the peak.)
    auto const [vocab_begin, vocab_end] = par::vocab_shard(deep.vocab, 2, static_cast<int>(r % 2));
    std::size_t const embeddings = mgpu::Allocator::block_size(
        static_cast<std::size_t>((vocab_end - vocab_begin + deep.block_size) * deep.n_embd) * sizeof(float));
    CHECK(held[1][r] - held[2][r] == predicted[1][r].gradients - predicted[2][r].gradients + embeddings);
    for (std::size_t zero = 0; zero < 4; ++zero) {
      CAPTURE(zero, predicted[zero][r].total());
      CHECK(std::abs(static_cast<double>(predicted[zero][r].total()) - static_cast<double>(peak[zero][r])) <=
            0.005 * static_cast<double>(peak[zero][r]));
    }
  }
}

// Stages 2 and 3 reduce and update the same float32 values as stage 1 (see test_zero16.cpp): its
// losses bit for bit.
TEST_CASE("ZeRO-1, 2 and 3 over tensor parallelism's replicas in bfloat16 and float16 follow the one device's 16-bit curve",
          "[parallel][tensor][zero][precision]") {
  Env env;
  auto const bs = batches(env, 6);
  float const clip = 0.2f;
  for (DType const compute : {DType::bfloat16, DType::float16}) {
    CAPTURE(mgpu::to_string(compute));
    Curve const want = one_device(env, bs, clip, compute);
    mgpu::DeviceGroup group("host:4");
    par::TensorParallel zero0(group, nn::gpt(config), options(0, clip, false, compute));
    Curve const replicated = run(zero0, bs, 0, bs.size());
    std::vector<double> zero1;
    for (int const zero : {1, 2, 3}) {
      CAPTURE(zero);
      mgpu::DeviceGroup other("host:4");
      par::TensorParallel tp(other, nn::gpt(config), options(zero, clip, false, compute));
      Curve const got = run(tp, bs, 0, bs.size());
      CHECK(got.applied == want.applied);
      CHECK(worst_relative(got.losses, want.losses) < 0.02);
      CHECK(worst_relative(got.losses, replicated.losses) < 1e-3);
      if (compute == DType::float16) CHECK_FALSE(got.applied.front());  // the scaler skipped the first step
      if (zero == 1) zero1 = got.losses;
      CHECK(got.losses == zero1);
    }
  }
}

TEST_CASE("A ZeRO-1, 2 or 3 DP 2 x TP 2 checkpoint holds the whole optimizer state and continues",
          "[parallel][tensor][zero][checkpoint]") {
  Env env;
  auto const bs = batches(env, 6);
  float const clip = 0.2f;
  fs::path const dir = mgpu::test::temp_path("mgpu-tp-zero-checkpoint");
  fs::remove_all(dir);
  fs::create_directories(dir);
  for (int const zero : {1, 2, 3}) {
    CAPTURE(zero);
    fs::path const file = dir / ("zero" + std::to_string(zero) + ".ckpt");
    std::vector<double> rest;
    {
      mgpu::DeviceGroup group("host:4");
      par::TensorParallel tp(group, nn::gpt(config), options(zero, clip));
      (void)run(tp, bs, 0, 3);
      tp.save(file, {.step = 3});
      rest = run(tp, bs, 3, 6).losses;
    }
    {  // the same layout from other weights: bit for bit
      mgpu::DeviceGroup group("host:4");
      par::TensorParallel tp(group, nn::gpt(config), options(zero, clip, false, DType::float32, 99));
      CHECK(tp.load(file).step == 3);
      CHECK(run(tp, bs, 3, 6).losses == rest);
    }
    {  // ZeRO-0: the replicated update reads every element's state
      mgpu::DeviceGroup group("host:4");
      par::TensorParallel tp(group, nn::gpt(config), options(0, clip, false, DType::float32, 99));
      tp.load(file);
      CHECK(worst_relative(run(tp, bs, 3, 6).losses, rest) < 1e-5);
    }
    // One device: the file holds the whole model's state.
    mgpu::test::OneDeviceGpt one(env, config, 99, adamw);
    CHECK(mgpu::io::load_training(file, one.model, one.opt, *env.allocator, env.stream).step == 3);
    CHECK(worst_relative(one.steps(bs, 3, 6, clip), rest) < 1e-5);
  }
  fs::remove_all(dir);
}

TEST_CASE("TensorParallel refuses a ZeRO stage that does not exist, before any work",
          "[parallel][tensor][zero]") {
  mgpu::DeviceGroup group("host:4");
  REQUIRE_MGPU_ERROR(par::TensorParallel(group, nn::gpt(config), options(4, 0.0f)), mgpu::Errc::invalid_argument,
                     "TensorParallel: zero_stage 4 (expected 0, replicated update, 1, sharded update and optimizer state, "
                     "2, sharded gradients too, or 3, sharded parameters too)");
  REQUIRE_MGPU_ERROR(par::TensorParallel(group, nn::gpt(config), options(-1, 0.0f)), mgpu::Errc::invalid_argument,
                     "TensorParallel: zero_stage -1 (expected 0");
}
