// What pipelines need from layers: stages initialised like the whole model, micro-batches in
// flight at once with gradients accumulated to the full batch's, the split backward equal to the
// fused one, and output shapes inferred without running anything.
#include <mgpu/nn/layers.hpp>
#include <mgpu/ops/ops.hpp>

#include <vector>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/nn_env.hpp"

using mgpu::Tensor;
using mgpu::test::as_double;
using mgpu::test::Env;
namespace nn = mgpu::nn;

namespace {
// Linear+ReLU, LayerNorm, Dropout, Linear+GELU, Linear: every kind of layer and both fusions.
nn::Sequential make_model() {
  nn::Sequential m;
  m.add(std::make_unique<nn::Linear>(6, 8));
  m.add(std::make_unique<nn::ReLU>());
  m.add(std::make_unique<nn::LayerNorm>(8));
  m.add(std::make_unique<nn::Dropout>(0.25f));
  m.add(std::make_unique<nn::Linear>(8, 7, nn::Init::xavier));
  m.add(std::make_unique<nn::GELU>());
  m.add(std::make_unique<nn::Linear>(7, 3, nn::Init::xavier));
  return m;
}

Tensor labels(Env& env, std::int64_t n) {
  std::vector<float> v;
  for (std::int64_t i = 0; i < n; ++i) v.push_back(static_cast<float>((i * 7) % 3));
  return env.make({n}, v);
}

// Full-batch gradients of mean cross-entropy.
std::vector<double> full_batch_gradients(Env& env, nn::Sequential& model, Tensor const& x, Tensor const& y) {
  Tensor const logits = model.forward(x, env.ctx);
  Tensor const dlogits = Tensor::empty(logits.shape(), logits.dtype(), *env.allocator);
  Tensor const loss = env.scalar();
  mgpu::ops::softmax_cross_entropy(logits, y, dlogits, loss, env.stream);
  model.backward(dlogits, env.ctx, false);
  env.stream.synchronize();
  return as_double(model.gradients());
}
}  // namespace

TEST_CASE("a stage holds the whole model's weights for its layers", "[nn][stage]") {
  Env env;
  nn::Sequential whole = make_model();
  whole.materialize(env.ctx, 42);
  CHECK(whole.cut_points() == std::vector<std::size_t>{0, 2, 3, 4, 6, 7});
  std::int64_t offset = 0;
  std::vector<std::size_t> const cuts{0, 3, 6, 7};
  for (std::size_t s = 0; s + 1 < cuts.size(); ++s) {
    nn::Sequential stage = whole.stage(cuts[s], cuts[s + 1]);
    CHECK(stage.first_layer() == cuts[s]);
    stage.materialize(env.ctx, 42);
    env.stream.synchronize();
    auto const want = as_double(whole.parameters().slice(offset, offset + stage.parameter_count()));
    CHECK(as_double(stage.parameters()) == want);
    offset += stage.parameter_count();
    // A stage of a stage keeps the global index too.
    if (stage.size() > 1) {
      nn::Sequential inner = stage.stage(stage.cut_points()[1], stage.size());
      CHECK(inner.first_layer() == cuts[s] + stage.cut_points()[1]);
    }
  }
  CHECK(offset == whole.parameter_count());
}

TEST_CASE("bad stage cuts are rejected", "[nn][stage]") {
  nn::Sequential const whole = make_model();
  REQUIRE_MGPU_ERROR(whole.stage(1, 4), mgpu::Errc::invalid_argument, "cut at layer 1, between Linear(6, 8) and the ReLU");
  REQUIRE_MGPU_ERROR(whole.stage(2, 2), mgpu::Errc::invalid_argument, "expected 0 <= begin < end <= 7");
  REQUIRE_MGPU_ERROR(whole.stage(4, 9), mgpu::Errc::invalid_argument, "expected 0 <= begin < end <= 7");
}

TEST_CASE("output shapes are inferred layer by layer", "[nn][stage]") {
  Env env;
  nn::Sequential model = make_model();
  model.materialize(env.ctx, 1);
  CHECK(model.output_shape({5, 6}) == mgpu::Shape{5, 3});
  CHECK(model.stage(0, 4).output_shape({5, 6}) == mgpu::Shape{5, 8});
  CHECK(model.forward(env.random({5, 6}, 3), env.ctx).shape() == model.output_shape({5, 6}));
  REQUIRE_MGPU_ERROR(model.output_shape({5, 4}), mgpu::Errc::invalid_argument, "Linear(6, 8): input of shape");
  REQUIRE_MGPU_ERROR(model.stage(2, 4).output_shape({5, 6}), mgpu::Errc::invalid_argument, "LayerNorm(8): input of shape");
}

TEST_CASE("micro-batches in flight accumulate the full batch's gradients", "[nn][stage]") {
  Env env;
  std::int64_t const n = 12;
  Tensor const x = env.random({n, 6}, 7);
  Tensor const y = labels(env, n);
  nn::Sequential reference = make_model();
  reference.materialize(env.ctx, 5);
  auto const rng = reference.rng_state();
  auto const want = full_batch_gradients(env, reference, x, y);

  nn::Sequential model = make_model();
  model.materialize(env.ctx, 5);
  model.zero_gradients(env.stream);
  std::vector<std::int64_t> const sizes{5, 3, 4};
  bool const split = GENERATE(false, true);
  CAPTURE(split);
  // Every forward first (GPipe's order), with the step's dropout draw and global rows.
  std::vector<Tensor> dlogits;
  std::int64_t row = 0;
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    model.set_rng_state(rng);
    nn::Context ctx{*env.allocator, env.stream, row, static_cast<std::int64_t>(k), true};
    Tensor const logits = model.forward(x.slice(row, row + sizes[k]), ctx);
    dlogits.push_back(Tensor::empty(logits.shape(), logits.dtype(), *env.allocator));
    Tensor const loss = env.scalar();
    // Each micro-batch's mean, weighted by its share of the batch, sums to the batch's mean.
    mgpu::ops::softmax_cross_entropy(logits, y.slice(row, row + sizes[k]), dlogits.back(), loss, env.stream,
                                     static_cast<float>(sizes[k]) / static_cast<float>(n));
    row += sizes[k];
  }
  for (std::size_t l = 0; l < model.size(); ++l) CHECK(model.layer(l).saved_micro_batches() == (l == 1 || l == 5 ? 0u : 3u));
  for (std::size_t k = sizes.size(); k-- > 0;) {  // backward in another order than forward
    nn::Context ctx{*env.allocator, env.stream, 0, static_cast<std::int64_t>(k), true};
    if (split) {
      model.backward_input(dlogits[k], ctx, false);
      model.backward_weight(ctx);
    } else {
      model.backward(dlogits[k], ctx, false);
    }
  }
  env.stream.synchronize();
  for (std::size_t l = 0; l < model.size(); ++l) CHECK(model.layer(l).saved_micro_batches() == 0u);
  auto const got = as_double(model.gradients());
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) CHECK(got[i] == Approx(want[i]).margin(1e-5).epsilon(1e-4));
}

TEST_CASE("backward_input then backward_weight equals backward", "[nn][stage]") {
  Env env;
  Tensor const x = env.random({4, 6}, 11);
  Tensor const y = labels(env, 4);
  std::vector<std::vector<double>> grads, dxs;
  for (bool const split : {false, true}) {
    nn::Sequential model = make_model();
    model.materialize(env.ctx, 9);
    Tensor const logits = model.forward(x, env.ctx);
    Tensor const dlogits = Tensor::empty(logits.shape(), logits.dtype(), *env.allocator);
    Tensor const loss = env.scalar();
    mgpu::ops::softmax_cross_entropy(logits, y, dlogits, loss, env.stream);
    Tensor dx;
    if (split) {
      dx = model.backward_input(dlogits, env.ctx);
      REQUIRE_MGPU_ERROR(model.backward_input(dlogits, env.ctx), mgpu::Errc::invalid_argument, "backward_input twice for micro-batch 0");
      model.backward_weight(env.ctx);
    } else {
      dx = model.backward(dlogits, env.ctx);
    }
    env.stream.synchronize();
    grads.push_back(as_double(model.gradients()));
    dxs.push_back(as_double(dx));
    REQUIRE_MGPU_ERROR(model.backward_weight(env.ctx), mgpu::Errc::invalid_argument,
                       "for micro-batch 0 (expected a forward of that micro-batch");
  }
  CHECK(grads[0] == grads[1]);
  CHECK(dxs[0] == dxs[1]);
}
