// Tensor parallelism as layer styles (parallelize): an MLP (Linear -> GELU -> Linear, column then
// row, or both column-parallel with gathered outputs) over 2 ranks gives the one-device outputs,
// input and parameter gradients, and losses and weights after SGD steps, with and without sequence
// parallelism; the GPT's shards from parallelize
// hold the one-device model's split as each layer's copy_shard says, bit for bit; layers that
// cannot split, and bad plans, are refused naming the layer; TensorParallel trains such a model
// (the MLP, with a loss per rank) as one device does.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <mgpu/comm/communicator.hpp>
#include <mgpu/core/device_group.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/nn/transformer.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/parallel/tensor_parallel.hpp>
#include <mgpu/parallel/tensor_parallel_styles.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/nn_env.hpp"

using mgpu::DType;
using mgpu::Tensor;
using mgpu::test::Env;
namespace nn = mgpu::nn;
namespace par = mgpu::parallel;

namespace {

constexpr std::int64_t batch = 2, tokens = 4, width = 8, hidden = 16;
constexpr std::uint64_t seed = 5;
constexpr int steps = 3;

nn::Sequential mlp() { return nn::Sequential::mlp({width, hidden, width}, "gelu"); }

// Values [batch, tokens, width], and the tokens [t0, t1) of each sequence of them.
std::vector<float> random_values(unsigned s) {
  std::mt19937 rng(s);
  std::normal_distribution<float> n(0, 1);
  std::vector<float> v(static_cast<std::size_t>(batch * tokens * width));
  for (float& x : v) x = n(rng);
  return v;
}

std::vector<float> token_slice(std::vector<float> const& v, std::int64_t t0, std::int64_t t1) {
  std::vector<float> out;
  for (std::int64_t b = 0; b < batch; ++b)
    out.insert(out.end(), v.begin() + (b * tokens + t0) * width, v.begin() + (b * tokens + t1) * width);
  return out;
}

void put_tokens(std::vector<float>& v, std::vector<float> const& part, std::int64_t t0, std::int64_t t1) {
  std::int64_t const n = (t1 - t0) * width;
  for (std::int64_t b = 0; b < batch; ++b)
    std::copy(part.begin() + b * n, part.begin() + (b + 1) * n, v.begin() + (b * tokens + t0) * width);
}

Tensor tensor_of(std::vector<float> const& v, std::int64_t t, mgpu::Allocator& allocator) {
  Tensor x = Tensor::empty({batch, t, width}, DType::float32, allocator);
  std::copy(v.begin(), v.end(), x.host_span<float>().begin());
  return x;
}

// Loss 0.5 mean (y - target)², in float64, and its gradient.
double loss_and_gradient(std::vector<float> const& y, std::vector<float> const& target, std::vector<float>& dy) {
  double loss = 0;
  dy.resize(y.size());
  double const n = static_cast<double>(y.size());
  for (std::size_t i = 0; i < y.size(); ++i) {
    double const d = static_cast<double>(y[i]) - static_cast<double>(target[i]);
    loss += 0.5 * d * d / n;
    dy[i] = static_cast<float>(d / n);
  }
  return loss;
}

void check_close(std::vector<float> const& got, std::vector<float> const& want) {
  REQUIRE(got.size() == want.size());
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(got[i]) - static_cast<double>(want[i])) /
                                std::max(1.0, std::abs(static_cast<double>(want[i]))));
  CHECK(worst <= 1e-5);
}

struct Run {
  std::vector<double> losses;
  std::vector<float> outputs, input_gradient, gradients;  // of the first step
  std::vector<float> parameters;                          // after the steps
};

Run one_device(std::vector<std::vector<float>> const& inputs, std::vector<std::vector<float>> const& targets) {
  Env env;
  nn::Sequential model = mlp();
  model.materialize(env.ctx, seed);
  mgpu::optim::SGD sgd({.lr = 0.5f});
  Run run;
  for (int s = 0; s < steps; ++s) {
    Tensor const y = model.forward(tensor_of(inputs[static_cast<std::size_t>(s)], tokens, *env.allocator), env.ctx);
    std::vector<float> const out = mgpu::test::host_values(y, env.stream);
    std::vector<float> dy;
    run.losses.push_back(loss_and_gradient(out, targets[static_cast<std::size_t>(s)], dy));
    Tensor const dx = model.backward(tensor_of(dy, tokens, *env.allocator), env.ctx);
    if (s == 0) {
      run.outputs = out;
      run.input_gradient = mgpu::test::host_values(dx, env.stream);
      run.gradients = mgpu::test::host_values(model.gradients(), env.stream);
    }
    sgd.step(model.master_parameters(), model.master_gradients(), *env.allocator, env.stream);
  }
  run.parameters = mgpu::test::host_values(model.master_parameters(), env.stream);
  return run;
}

// Each shard's buffer `values` put into the whole model's layout (copy_shard of its split layers).
std::vector<float> to_whole(nn::Sequential const& whole, std::vector<nn::Sequential> const& shards,
                            std::vector<std::vector<float>>& values) {
  std::vector<float> out(static_cast<std::size_t>(whole.parameter_count()));
  std::vector<nn::ParameterRange> const whole_ranges = whole.parameter_ranges();
  for (std::size_t r = 0; r < shards.size(); ++r) {
    std::vector<nn::ParameterRange> const ranges = shards[r].parameter_ranges();
    REQUIRE(ranges.size() == whole_ranges.size());
    for (std::size_t i = 0; i < ranges.size(); ++i) {
      std::span<float> const w = std::span<float>(out).subspan(static_cast<std::size_t>(whole_ranges[i].begin),
                                                               static_cast<std::size_t>(whole_ranges[i].size()));
      std::span<float> const s = std::span<float>(values[r]).subspan(static_cast<std::size_t>(ranges[i].begin),
                                                                     static_cast<std::size_t>(ranges[i].size()));
      auto const* sharded = dynamic_cast<par::ShardedLayer const*>(&shards[r].layer(ranges[i].layer));
      REQUIRE(sharded != nullptr);
      sharded->copy_shard(w, s, false);
    }
  }
  return out;
}

Run tensor_parallel(std::vector<std::vector<float>> const& inputs, std::vector<std::vector<float>> const& targets,
                    par::TensorParallelPlan const& plan) {
  mgpu::DeviceGroup group("host:2");
  std::shared_ptr<mgpu::comm::Communicator> const comm = mgpu::comm::make_communicator(group);
  nn::Sequential const whole = mlp();
  bool const sequence = plan.sequence_parallel;
  std::vector<nn::Sequential> shards;
  std::vector<mgpu::optim::SGD> sgds;
  for (int r = 0; r < 2; ++r) {
    shards.push_back(par::parallelize(whole, plan, comm, r));
    sgds.emplace_back(mgpu::optim::SgdOptions{.lr = 0.5f});
  }
  // The rank's tokens of the batch: all, or with sequence parallelism its half.
  auto const first = [&](int r) { return sequence ? r * tokens / 2 : std::int64_t{0}; };
  auto const last = [&](int r) { return sequence ? (r + 1) * tokens / 2 : tokens; };
  group.run([&](int r, mgpu::Device, mgpu::Stream& stream) {
    nn::Context ctx{group.allocator(r), stream};
    shards[static_cast<std::size_t>(r)].materialize(ctx, seed);
  });
  Run run;
  for (int s = 0; s < steps; ++s) {
    std::vector<std::vector<float>> outs(2), dxs(2), grads(2);
    group.run([&](int r, mgpu::Device, mgpu::Stream& stream) {
      nn::Context ctx{group.allocator(r), stream};
      Tensor const x = tensor_of(token_slice(inputs[static_cast<std::size_t>(s)], first(r), last(r)),
                                 last(r) - first(r), group.allocator(r));
      outs[static_cast<std::size_t>(r)] =
          mgpu::test::host_values(shards[static_cast<std::size_t>(r)].forward(x, ctx), stream);
    });
    std::vector<float> y(static_cast<std::size_t>(batch * tokens * width));
    for (int r = 0; r < 2; ++r) put_tokens(y, outs[static_cast<std::size_t>(r)], first(r), last(r));
    if (!sequence) CHECK(outs[0] == outs[1]);  // the all-reduced or gathered output
    std::vector<float> dy;
    run.losses.push_back(loss_and_gradient(y, targets[static_cast<std::size_t>(s)], dy));
    group.run([&](int r, mgpu::Device, mgpu::Stream& stream) {
      auto const i = static_cast<std::size_t>(r);
      nn::Context ctx{group.allocator(r), stream};
      Tensor const dx = shards[i].backward(
          tensor_of(token_slice(dy, first(r), last(r)), last(r) - first(r), group.allocator(r)), ctx);
      dxs[i] = mgpu::test::host_values(dx, stream);
      grads[i] = mgpu::test::host_values(shards[i].gradients(), stream);
      sgds[i].step(shards[i].master_parameters(), shards[i].master_gradients(), group.allocator(r), stream);
      stream.synchronize();
    });
    if (s == 0) {
      run.outputs = y;
      run.input_gradient.resize(y.size());
      for (int r = 0; r < 2; ++r) put_tokens(run.input_gradient, dxs[static_cast<std::size_t>(r)], first(r), last(r));
      if (!sequence) CHECK(dxs[0] == dxs[1]);  // the column-parallel Linear's all-reduced input gradient
      run.gradients = to_whole(whole, shards, grads);
    }
  }
  std::vector<std::vector<float>> params(2);
  group.run([&](int r, mgpu::Device, mgpu::Stream& stream) {
    params[static_cast<std::size_t>(r)] =
        mgpu::test::host_values(shards[static_cast<std::size_t>(r)].master_parameters(), stream);
  });
  run.parameters = to_whole(whole, shards, params);
  return run;
}

}  // namespace

TEST_CASE("An MLP split column then row, or column with gathered outputs, over 2 ranks trains as on one device",
          "[parallel][tensor][styles]") {
  std::vector<std::vector<float>> inputs, targets;
  for (unsigned s = 0; s < steps; ++s) {
    inputs.push_back(random_values(2 * s + 1));
    targets.push_back(random_values(2 * s + 2));
  }
  Run const want = one_device(inputs, targets);
  REQUIRE(want.losses.back() < want.losses.front());  // the steps change the model
  // Column then row, with and without sequence parallelism; column with gathered outputs twice.
  std::vector<par::TensorParallelPlan> const plans{
      {.styles = {{0, par::column_parallel()}, {2, par::row_parallel()}}},
      {.styles = {{0, par::column_parallel()}, {2, par::row_parallel()}}, .sequence_parallel = true},
      {.styles = {{0, par::column_parallel(true)}, {2, par::column_parallel(true)}}}};
  for (std::size_t p = 0; p < plans.size(); ++p) {
    INFO("plan " << p);
    Run const got = tensor_parallel(inputs, targets, plans[p]);
    check_close(got.outputs, want.outputs);
    check_close(got.input_gradient, want.input_gradient);
    check_close(got.gradients, want.gradients);
    check_close(got.parameters, want.parameters);
    REQUIRE(got.losses.size() == want.losses.size());
    for (std::size_t s = 0; s < want.losses.size(); ++s)
      CHECK(std::abs(got.losses[s] - want.losses[s]) <= 1e-5 * want.losses[s]);
  }
}

TEST_CASE("parallelize splits the GPT's layers as their copy_shard says, bit for bit", "[parallel][tensor][styles]") {
  nn::GptConfig const config{.vocab = 30, .block_size = 8, .n_layer = 2, .n_head = 4, .n_embd = 16, .dropout = 0.1f};
  Env env;
  nn::Sequential whole = nn::gpt(config);
  whole.materialize(env.ctx, seed);
  std::vector<float> whole_values = mgpu::test::host_values(whole.master_parameters(), env.stream);
  for (bool const sequence : {false, true}) {
    INFO("sequence parallel " << sequence);
    mgpu::DeviceGroup group("host:2");
    std::shared_ptr<mgpu::comm::Communicator> const comm = mgpu::comm::make_communicator(group);
    for (int r = 0; r < 2; ++r) {
      nn::Sequential shard = par::parallelize(nn::gpt(config), {.sequence_parallel = sequence}, comm, r);
      // The layers a GPT's tensor-parallel shard has always had (a gather before the head with sequence parallelism).
      REQUIRE(shard.size() == whole.size() + (sequence ? 1 : 0));
      CHECK(dynamic_cast<par::VocabParallelEmbedding const*>(&shard.layer(0)) != nullptr);
      CHECK(dynamic_cast<par::TensorParallelBlock const*>(&shard.layer(2)) != nullptr);
      CHECK(dynamic_cast<par::VocabParallelLMHead const*>(&shard.layer(shard.size() - 1)) != nullptr);
      shard.materialize(env.ctx, seed);
      std::vector<float> const values = mgpu::test::host_values(shard.master_parameters(), env.stream);
      std::vector<nn::ParameterRange> const ranges = shard.parameter_ranges(), whole_ranges = whole.parameter_ranges();
      REQUIRE(ranges.size() == whole_ranges.size());
      for (std::size_t i = 0; i < ranges.size(); ++i) {
        std::vector<float> want(values.begin() + ranges[i].begin, values.begin() + ranges[i].end);
        std::span<float> const w = std::span<float>(whole_values).subspan(
            static_cast<std::size_t>(whole_ranges[i].begin), static_cast<std::size_t>(whole_ranges[i].size()));
        if (auto const* sharded = dynamic_cast<par::ShardedLayer const*>(&shard.layer(ranges[i].layer))) {
          sharded->copy_shard(w, want, true);
        } else {
          want.assign(w.begin(), w.end());
        }
        CHECK(std::equal(want.begin(), want.end(), values.begin() + ranges[i].begin));
      }
      // And the dropout seeds: the whole model's.
      CHECK(shard.rng_seeds() == whole.rng_seeds());
    }
  }
}

TEST_CASE("parallelize refuses layers that cannot split, naming them and why", "[parallel][tensor][styles]") {
  mgpu::DeviceGroup group("host:2");
  std::shared_ptr<mgpu::comm::Communicator> const comm = mgpu::comm::make_communicator(group);
  REQUIRE_MGPU_ERROR(par::parallelize(mlp(), {}, comm, 0), mgpu::Errc::invalid_argument,
                     "parallelize: layer 0 (Linear(8, 16)) has no tensor-parallel style (expected one in the plan");
  REQUIRE_MGPU_ERROR(par::parallelize(nn::Sequential::mlp({8, 3}), {.styles = {{0, par::column_parallel()}}}, comm, 0),
                     mgpu::Errc::invalid_argument,
                     "parallelize: layer 0 (Linear(8, 3)): ColumnParallel(Linear(8, 3)) over 2 ranks (expected the "
                     "ranks dividing the output features, 3)");
  REQUIRE_MGPU_ERROR(
      par::parallelize(mlp(), {.styles = {{0, par::column_parallel()}, {1, par::row_parallel()}}}, comm, 0),
      mgpu::Errc::invalid_argument, "parallelize: layer 1 (GELU): row_parallel for a GELU (expected an nn::Linear)");
  REQUIRE_MGPU_ERROR(par::parallelize(mlp(), {.styles = {{3, par::row_parallel()}}}, comm, 0),
                     mgpu::Errc::invalid_argument, "the plan names layer 3 of a 3-layer model");
  REQUIRE_MGPU_ERROR(par::parallelize(mlp(), {.styles = {{0, par::replicate()}, {2, par::replicate()}},
                                              .sequence_parallel = true},
                                      comm, 0),
                     mgpu::Errc::invalid_argument,
                     "parallelize: layer 0 (Linear(8, 16)): replicate with sequence parallelism for a Linear(8, 16)");
  REQUIRE_MGPU_ERROR(
      par::parallelize(
          mlp(), {.styles = {{0, par::column_parallel(true)}, {2, par::row_parallel()}}, .sequence_parallel = true},
          comm, 0),
      mgpu::Errc::invalid_argument,
      "parallelize: layer 0 (Linear(8, 16)): ColumnParallel(Linear(8, 16)) with a gathered output and "
      "sequence parallelism (expected one of them");
  REQUIRE_MGPU_ERROR(par::parallelize(mlp(), {}, comm, 2), mgpu::Errc::invalid_argument,
                     "parallelize for rank 2 (expected a rank in [0, 2))");
  REQUIRE_MGPU_ERROR(par::parallelize(mlp().stage(2, 3), {}, comm, 0), mgpu::Errc::invalid_argument,
                     "parallelize of a stage starting at layer 2");
  // A style adding a layer before one that is initialized from its index is refused.
  nn::GptConfig const config{.vocab = 30, .block_size = 8, .n_layer = 1, .n_head = 2, .n_embd = 8};
  nn::Sequential reordered;
  nn::Sequential const gpt = nn::gpt(config);
  reordered.add(gpt.layer(4).clone());  // the TiedLMHead first (a gather before it with sequence parallelism)
  reordered.add(gpt.layer(3).clone());  // then a LayerNorm
  REQUIRE_MGPU_ERROR(par::parallelize(reordered, {.sequence_parallel = true}, comm, 0), mgpu::Errc::invalid_argument,
                     "its style adds 1 layer(s) before layer 1 (LayerNorm(8))");
}

TEST_CASE("TensorParallel trains a whole model split by styles as one device does", "[parallel][tensor][styles]") {
  auto const sgd = [](nn::Sequential const&) {
    return std::make_unique<mgpu::optim::SGD>(mgpu::optim::SgdOptions{.lr = 0.5f});
  };
  std::map<std::size_t, par::Style> const styles{{0, par::column_parallel()}, {2, par::row_parallel()}};
  Env env;
  nn::Sequential model = mlp();
  model.materialize(env.ctx, seed);
  auto const optimizer = sgd(model);
  nn::MeanSquaredError const mse;
  mgpu::DeviceGroup group("host:2");
  par::TensorParallel tp(group, mlp(),
                         {.seed = seed,
                          .styles = styles,
                          .loss = [](std::shared_ptr<mgpu::comm::Communicator>,
                                     int) { return std::make_unique<nn::MeanSquaredError>(); },
                          .optimizer = sgd});
  // The shards together are the one-device model materialized from the seed.
  CHECK(tp.gather_parameters() == mgpu::test::host_values(model.master_parameters(), env.stream));
  for (unsigned s = 0; s < steps; ++s) {
    Tensor const x = env.random({6, width}, 10 + s), y = env.random({6, width}, 20 + s);
    double const want = mgpu::ops::item(nn::train_step(model, *optimizer, x, y, mse, env.ctx).loss, env.stream);
    CHECK(std::abs(tp.step(x, y).loss - want) <= 1e-5 * want);
  }
  check_close(tp.gather_parameters(), mgpu::test::host_values(model.master_parameters(), env.stream));
  REQUIRE_MGPU_ERROR(par::TensorParallel(group, mlp(), {.styles = styles}), mgpu::Errc::invalid_argument,
                     "TensorParallel: a model whose last layer is Linear(16, 8) without a loss");
  REQUIRE_MGPU_ERROR(par::TensorParallel(group, mlp(), {.loss = [](std::shared_ptr<mgpu::comm::Communicator>, int) {
                                                          return std::make_unique<nn::MeanSquaredError>();
                                                        }}),
                     mgpu::Errc::invalid_argument, "parallelize: layer 0 (Linear(8, 16)) has no tensor-parallel style");
}
