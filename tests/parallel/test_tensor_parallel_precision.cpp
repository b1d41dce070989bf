// Tensor parallelism computing in 16 bits: TP 2 and DP 2 x TP 2 in bfloat16, and in float16 with a
// loss scaler, follow the one device's curve in the same precision within 2% (each rank's rounding
// of its own matrices' parts differs from one device's of the whole); the loss scaler skips the same
// steps as the one device's (an initial scale of 2^30 overflows float16 at the first step), and the 16-bit
// curves are not the float32 one (the shards do compute in 16 bits). So does a tensor x pipeline
// grid (TP 2 x PP 2).
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <mgpu/core/device_group.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/parallel/tensor_parallel.hpp>
#include <mgpu/pipeline/pipeline.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/nn_env.hpp"
#include "support/tp_fixture.hpp"

namespace nn = mgpu::nn;
namespace par = mgpu::parallel;
namespace pp = mgpu::pipeline;
using mgpu::DType;
using mgpu::test::tp::adamw;
using mgpu::test::tp::config;
using mgpu::test::tp::Curve;
using mgpu::test::tp::scaler_for;

namespace {

float const clip = 1.0f;
std::uint64_t const seed = 4;
int const steps = 10;

Curve one_device(mgpu::test::Env& env, std::vector<mgpu::test::TokenBatch> const& bs, DType compute) {
  return mgpu::test::tp::one_device_run(env, bs, seed, clip, compute);
}

}  // namespace

TEST_CASE("tensor parallelism in bfloat16 and float16 follows the one device's 16-bit curve", "[parallel][tensor][precision]") {
  mgpu::test::Env env;
  auto const bs = mgpu::test::rule_batches(env, steps, 4, config, 700);
  Curve const fp32 = one_device(env, bs, DType::float32);
  for (DType const compute : {DType::bfloat16, DType::float16}) {
    CAPTURE(mgpu::to_string(compute));
    Curve const want = one_device(env, bs, compute);
    CHECK(want.losses != fp32.losses);
    if (compute == DType::float16) {  // the scaler's first step skips, the later ones apply
      CHECK_FALSE(want.applied.front());
      CHECK(want.applied.back());
    }
    for (int const replicas : {1, 2}) {
      CAPTURE(replicas);
      mgpu::DeviceGroup group("host:4");
      mgpu::DeviceGroup pair("host:2");
      par::TensorParallel tp(replicas == 1 ? pair : group, nn::gpt(config),
                             {.seed = seed,
                              .adamw = adamw,
                              .clip_norm = clip,
                              .data_parallel = replicas,
                              .compute = compute,
                              .loss_scaler = scaler_for(compute)});
      double worst = 0;
      for (int s = 0; s < steps; ++s) {
        auto const i = static_cast<std::size_t>(s);
        par::TensorParallel::StepResult const r = tp.step(bs[i].ids, bs[i].targets);
        CHECK(r.applied == want.applied[i]);
        worst = std::max(worst, std::abs(r.loss - want.losses[i]) / want.losses[i]);
      }
      CHECK(worst < 0.02);
      if (compute == DType::float16) {
        REQUIRE(tp.loss_scaler() != nullptr);
        CHECK(tp.loss_scaler()->skipped() == 1);
      }
    }
  }
  mgpu::DeviceGroup pair("host:2");
  REQUIRE_MGPU_ERROR(par::TensorParallel(pair, nn::gpt(config), {.compute = DType::int32}), mgpu::Errc::invalid_argument,
                     "compute int32 (expected float32, bfloat16 or float16)");
}

TEST_CASE("a float16 tensor-parallel checkpoint carries the loss scaler's state: the resumed run skips nothing more",
          "[parallel][tensor][precision][checkpoint]") {
  mgpu::test::Env env;
  auto const bs = mgpu::test::rule_batches(env, 5, 4, config, 800);
  par::TensorParallelOptions const options{
      .seed = seed, .adamw = adamw, .clip_norm = clip, .compute = DType::float16, .loss_scaler = scaler_for(DType::float16)};
  auto const path = std::filesystem::temp_directory_path() / ("mgpu-tp-fp16-" + std::to_string(::getpid()) + ".ckpt");
  mgpu::DeviceGroup group("host:2");
  std::vector<double> rest;
  {
    par::TensorParallel tp(group, nn::gpt(config), options);
    CHECK_FALSE(tp.step(bs[0].ids, bs[0].targets).applied);  // 2^30 overflows
    CHECK(tp.step(bs[1].ids, bs[1].targets).applied);
    tp.save(path, {.step = 2});
    for (std::size_t s = 2; s < 5; ++s) rest.push_back(tp.step(bs[s].ids, bs[s].targets).loss);
  }
  par::TensorParallel resumed(group, nn::gpt(config), options);  // a fresh scaler at 2^30 would skip again
  resumed.load(path);
  std::filesystem::remove(path);
  REQUIRE(resumed.loss_scaler() != nullptr);
  CHECK(resumed.loss_scaler()->skipped() == 1);
  std::vector<double> got;
  for (std::size_t s = 2; s < 5; ++s) {
    par::TensorParallel::StepResult const r = resumed.step(bs[s].ids, bs[s].targets);
    CHECK(r.applied);
    got.push_back(r.loss);
  }
  CHECK(got == rest);
}

TEST_CASE("a tensor x pipeline grid (TP 2 x PP 2, 1F1B) in bfloat16 and float16 follows the one device's 16-bit curve",
          "[parallel][tensor][pipeline][precision]") {
  mgpu::test::Env env;
  auto const bs = mgpu::test::rule_batches(env, steps, 4, config, 900);
  for (DType const compute : {DType::bfloat16, DType::float16}) {
    CAPTURE(mgpu::to_string(compute));
    Curve const want = one_device(env, bs, compute);
    mgpu::DeviceGroup group("host:4");
    pp::Executor ex(nn::gpt(config), group, {0, 3, 6}, pp::one_f_one_b(2, 2),
                    [](nn::Sequential const& chunk) {
                      mgpu::optim::AdamWOptions o = adamw;
                      o.decay_ranges = chunk.matrix_ranges();
                      return std::make_unique<mgpu::optim::AdamW>(o);
                    },
                    {.seed = seed,
                     .compute = compute,
                     .loss_scaler = scaler_for(compute),
                     .clip_norm = clip,
                     .tensor_parallel = pp::tensor_parallel_stages(nn::gpt(config), {}, 2)});
    double worst = 0;
    for (int s = 0; s < steps; ++s) {
      auto const i = static_cast<std::size_t>(s);
      double const loss = ex.step(bs[i].ids, bs[i].targets);
      CHECK(ex.last_step_applied() == want.applied[i]);
      worst = std::max(worst, std::abs(loss - want.losses[i]) / want.losses[i]);
    }
    CHECK(worst < 0.02);
  }
}
