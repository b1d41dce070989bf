// Ops, layers and optimizers against independent references: naive float64 math, central finite
// differences in float64, hand-computed optimizer steps, and training to a set accuracy.
#include <mgpu/nn/layers.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/optim/optim.hpp>

#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/nn_env.hpp"

using mgpu::DType;
using mgpu::Tensor;
using mgpu::test::as_double;
using mgpu::test::Env;

namespace {

// The model's loss in float64, from its flat parameters: Linear / activation layers in order.
double reference_loss(std::vector<std::pair<std::int64_t, std::int64_t>> const& linear_shapes, std::string const& activation,
                      std::vector<double> const& params, std::vector<double> x, std::int64_t batch, std::vector<double> const& target,
                      bool cross_entropy) {
  std::size_t offset = 0;
  std::int64_t width = linear_shapes.front().first;
  for (std::size_t l = 0; l < linear_shapes.size(); ++l) {
    auto const [in, out] = linear_shapes[l];
    std::vector<double> y(static_cast<std::size_t>(batch * out));
    for (std::int64_t i = 0; i < batch; ++i) {
      for (std::int64_t j = 0; j < out; ++j) {
        double acc = params[offset + static_cast<std::size_t>(in * out + j)];
        for (std::int64_t k = 0; k < in; ++k)
          acc += x[static_cast<std::size_t>(i * in + k)] * params[offset + static_cast<std::size_t>(k * out + j)];
        if (l + 1 < linear_shapes.size()) {
          if (activation == "relu") {
            acc = std::max(acc, 0.0);
          } else {
            acc = 0.5 * acc * (1 + std::tanh(std::sqrt(2 / 3.141592653589793) * (acc + 0.044715 * acc * acc * acc)));
          }
        }
        y[static_cast<std::size_t>(i * out + j)] = acc;
      }
    }
    offset += static_cast<std::size_t>(in * out + out);
    x = y;
    width = out;
  }
  double loss = 0;
  if (cross_entropy) {
    for (std::int64_t i = 0; i < batch; ++i) {
      double top = -1e300;
      for (std::int64_t j = 0; j < width; ++j) top = std::max(top, x[static_cast<std::size_t>(i * width + j)]);
      double sum = 0;
      for (std::int64_t j = 0; j < width; ++j) sum += std::exp(x[static_cast<std::size_t>(i * width + j)] - top);
      loss += std::log(sum) + top - x[static_cast<std::size_t>(i * width + static_cast<std::int64_t>(target[static_cast<std::size_t>(i)]))];
    }
    return loss / static_cast<double>(batch);
  }
  for (std::size_t i = 0; i < x.size(); ++i) loss += (x[i] - target[i]) * (x[i] - target[i]);
  return loss / static_cast<double>(x.size());
}

}  // namespace

TEST_CASE("gemm with every transpose against float64", "[ops]") {
  Env env;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      Tensor a = env.random(ta ? mgpu::Shape{5, 3} : mgpu::Shape{3, 5}, 1);
      Tensor b = env.random(tb ? mgpu::Shape{4, 5} : mgpu::Shape{5, 4}, 2);
      Tensor c = env.random({3, 4}, 3);
      auto const c0 = as_double(c);
      mgpu::ops::gemm(a, ta, b, tb, c, 0.5f, 2.0f, env.stream);
      env.stream.synchronize();
      auto const A = as_double(a);
      auto const B = as_double(b);
      for (int i = 0; i < 3; ++i) {
        for (int j = 0; j < 4; ++j) {
          double acc = 0;
          for (int k = 0; k < 5; ++k) acc += A[static_cast<std::size_t>(ta ? k * 3 + i : i * 5 + k)] * B[static_cast<std::size_t>(tb ? j * 5 + k : k * 4 + j)];
          REQUIRE(c.host_span<float>()[static_cast<std::size_t>(i * 4 + j)] == Approx(0.5 * acc + 2.0 * c0[static_cast<std::size_t>(i * 4 + j)]).margin(1e-5));
        }
      }
    }
  }
  Tensor bad = env.random({2, 2}, 4);
  REQUIRE_MGPU_ERROR(mgpu::ops::gemm(bad, false, env.random({3, 2}, 5), false, bad, 1, 0, env.stream), mgpu::Errc::invalid_argument,
                     "expected [m, k] x [k, n] -> [m, n]");
}

TEST_CASE("Layer gradients match float64 finite differences", "[nn]") {
  for (std::string const activation : {"relu", "gelu"}) {
    for (bool cross_entropy : {true, false}) {
      INFO(activation << (cross_entropy ? " with softmax cross-entropy" : " with MSE"));
      Env env;
      std::int64_t const batch = 6;
      auto model = mgpu::nn::Sequential::mlp({4, 7, 5, 3}, activation);
      model.materialize(env.ctx, 11);
      Tensor x = env.random({batch, 4}, 21);
      std::vector<float> labels = {0, 2, 1, 1, 0, 2};
      Tensor target = cross_entropy ? env.make({batch}, labels) : env.random({batch, 3}, 31);
      Tensor out = model.forward(x, env.ctx);
      Tensor dout = Tensor::empty(out.shape(), DType::float32, *env.allocator);
      Tensor loss_t = env.scalar();
      if (cross_entropy) {
        mgpu::ops::softmax_cross_entropy(out, target, dout, loss_t, env.stream);
      } else {
        mgpu::ops::mse(out, target, dout, loss_t, env.stream);
      }
      Tensor dx = model.backward(dout, env.ctx);
      float const loss = mgpu::ops::item(loss_t, env.stream);

      std::vector<std::pair<std::int64_t, std::int64_t>> const shapes = {{4, 7}, {7, 5}, {5, 3}};
      auto params = as_double(model.parameters());
      auto inputs = as_double(x);
      auto const tgt = as_double(target);
      double const ref = reference_loss(shapes, activation, params, inputs, batch, tgt, cross_entropy);
      REQUIRE(loss == Approx(ref).epsilon(1e-4));
      auto const grads = as_double(model.gradients());
      // d loss / d values[i] by central differences of the float64 reference (values: params or inputs).
      auto const numeric = [&](std::vector<double>& values, std::size_t i) {
        double const h = 1e-6;
        double const keep = values[i];
        values[i] = keep + h;
        double const up = reference_loss(shapes, activation, params, inputs, batch, tgt, cross_entropy);
        values[i] = keep - h;
        double const down = reference_loss(shapes, activation, params, inputs, batch, tgt, cross_entropy);
        values[i] = keep;
        return (up - down) / (2 * h);
      };
      for (std::size_t p = 0; p < params.size(); ++p) {
        INFO("parameter " << p);
        REQUIRE(grads[p] == Approx(numeric(params, p)).margin(2e-4).epsilon(2e-3));
      }
      auto const dinputs = as_double(dx);
      for (std::size_t i = 0; i < inputs.size(); ++i) {
        REQUIRE(dinputs[i] == Approx(numeric(inputs, i)).margin(2e-4).epsilon(2e-3));
      }
    }
  }
}

TEST_CASE("Sequential fuses each Linear with its activation: same outputs and gradients as layer by layer", "[nn]") {
  for (std::string const activation : {"relu", "gelu"}) {
    INFO(activation);
    Env env;
    auto fused = mgpu::nn::Sequential::mlp({5, 8, 8, 3}, activation);
    auto layered = fused.clone();
    fused.materialize(env.ctx, 3);
    layered.materialize(env.ctx, 3);
    Tensor x = env.random({9, 5}, 1);
    Tensor dy = env.random({9, 3}, 2);
    Tensor const y1 = fused.forward(x, env.ctx);
    Tensor const dx1 = fused.backward(dy, env.ctx);
    // The reference: each layer's own forward and backward (a Linear alone, then the activation).
    Tensor h = x;
    for (std::size_t i = 0; i < layered.size(); ++i) h = layered.layer(i).forward(h, env.ctx);
    Tensor g = dy;
    for (std::size_t i = layered.size(); i-- > 0;) g = layered.layer(i).backward(g, env.ctx);
    env.stream.synchronize();
    auto const check_close = [](Tensor const& a, Tensor const& b) {
      auto const va = as_double(a);
      auto const vb = as_double(b);
      REQUIRE(va.size() == vb.size());
      for (std::size_t i = 0; i < va.size(); ++i) REQUIRE(va[i] == Approx(vb[i]).margin(1e-6).epsilon(1e-5));
    };
    check_close(y1, h);
    check_close(dx1, g);
    check_close(fused.gradients(), layered.gradients());
  }
}

TEST_CASE("Backward reports each layer's gradient range as it is written, last layer first", "[nn]") {
  Env env;
  mgpu::nn::Sequential model;
  model.add(std::make_unique<mgpu::nn::Linear>(4, 6));
  model.add(std::make_unique<mgpu::nn::ReLU>());
  model.add(std::make_unique<mgpu::nn::LayerNorm>(6));
  model.add(std::make_unique<mgpu::nn::Linear>(6, 3));
  model.materialize(env.ctx, 1);
  Tensor out = model.forward(env.random({2, 4}, 1), env.ctx);
  std::vector<std::pair<std::int64_t, std::int64_t>> ranges;
  model.backward(env.random({2, 3}, 2), env.ctx, false, [&](std::int64_t begin, std::int64_t end) { ranges.emplace_back(begin, end); });
  std::vector<std::pair<std::int64_t, std::int64_t>> const expected = {{42, 63}, {30, 42}, {0, 30}};
  CHECK(ranges == expected);
  CHECK(model.parameter_count() == 63);
}

TEST_CASE("Softmax cross-entropy is stable for huge logits and rejects bad labels", "[ops]") {
  Env env;
  Tensor logits = env.make({2, 3}, {1000, 0, -1000, 5e4f, 5e4f, 0});
  Tensor labels = env.make({2}, {0, 1});
  Tensor d = Tensor::empty({2, 3}, DType::float32, *env.allocator);
  Tensor loss_t = env.scalar();
  mgpu::ops::softmax_cross_entropy(logits, labels, d, loss_t, env.stream);
  float const loss = mgpu::ops::item(loss_t, env.stream);
  CHECK(loss == Approx(std::log(2.0) / 2).margin(1e-6));  // row 0: 0, row 1: log 2
  CHECK(std::isfinite(d.host_span<float>()[2]));
  Tensor bad = env.make({2}, {0, 3});
  mgpu::ops::softmax_cross_entropy(logits, bad, d, loss_t, env.stream);
  REQUIRE_MGPU_ERROR(env.stream.synchronize(), mgpu::Errc::invalid_argument, "label 3.000000 in row 1 (expected a class id in [0, 3))");
}

TEST_CASE("Optimizer steps match hand-computed values", "[optim]") {
  Env env;
  {  // SGD momentum 0.9, weight decay 0.1, lr 0.5: two steps on p = 1, g = 2
    Tensor p = env.make({1}, {1});
    Tensor g = env.make({1}, {2});
    mgpu::optim::SGD sgd({.lr = 0.5f, .momentum = 0.9f, .weight_decay = 0.1f});
    sgd.step(p, g, *env.allocator, env.stream);  // g' = 2.1, v = 2.1, p = 1 - 1.05 = -0.05
    env.stream.synchronize();
    CHECK(p.host_span<float>()[0] == Approx(-0.05f));
    sgd.step(p, g, *env.allocator, env.stream);  // g' = 1.995, v = 1.89 + 1.995 = 3.885, p = -0.05 - 1.9425
    env.stream.synchronize();
    CHECK(p.host_span<float>()[0] == Approx(-1.9925f));
  }
  {  // Nesterov: p -= lr (g + m v)
    Tensor p = env.make({1}, {1});
    Tensor g = env.make({1}, {2});
    mgpu::optim::SGD sgd({.lr = 0.5f, .momentum = 0.9f, .nesterov = true});
    sgd.step(p, g, *env.allocator, env.stream);  // v = 2, p = 1 - 0.5 (2 + 1.8) = -0.9
    env.stream.synchronize();
    CHECK(p.host_span<float>()[0] == Approx(-0.9f));
  }
  {  // AdamW step 1: m_hat = g, v_hat = g^2, so p -= lr (sign(g) + wd p)
    Tensor p = env.make({2}, {1, -2});
    Tensor g = env.make({2}, {0.5f, -3});
    mgpu::optim::AdamW adam({.lr = 0.1f, .eps = 0.0f, .weight_decay = 0.5f});
    adam.step(p, g, *env.allocator, env.stream);
    env.stream.synchronize();
    CHECK(p.host_span<float>()[0] == Approx(1 - 0.1 * (1 + 0.5)));
    CHECK(p.host_span<float>()[1] == Approx(-2 - 0.1 * (-1 - 1.0)));
  }
}

TEST_CASE("Optimizer updates by range equal one whole step", "[optim]") {
  Env env;
  std::vector<std::unique_ptr<mgpu::optim::Optimizer>> whole;
  std::vector<std::unique_ptr<mgpu::optim::Optimizer>> ranged;
  for (int copy = 0; copy < 2; ++copy) {
    auto& list = copy == 0 ? whole : ranged;
    list.push_back(std::make_unique<mgpu::optim::SGD>(mgpu::optim::SgdOptions{.lr = 0.1f, .momentum = 0.9f, .weight_decay = 0.01f, .nesterov = true}));
    list.push_back(std::make_unique<mgpu::optim::AdamW>(mgpu::optim::AdamWOptions{.lr = 0.01f}));
  }
  for (std::size_t o = 0; o < whole.size(); ++o) {
    INFO(whole[o]->name());
    Tensor p1 = env.random({10}, 1);
    Tensor p2 = env.random({10}, 1);
    for (unsigned step = 0; step < 3; ++step) {
      Tensor g = env.random({10}, 10 + step);
      whole[o]->step(p1, g, *env.allocator, env.stream);
      ranged[o]->begin_step(p2, *env.allocator, env.stream);
      ranged[o]->update(p2, g, 6, 10, env.stream);  // in backward's order: the last layer first
      ranged[o]->update(p2, g, 0, 6, env.stream);
    }
    env.stream.synchronize();
    CHECK(as_double(p1) == as_double(p2));
    CHECK(ranged[o]->steps() == 3);
    for (std::size_t s = 0; s < whole[o]->state().size(); ++s) CHECK(as_double(whole[o]->state()[s].second) == as_double(ranged[o]->state()[s].second));
  }
  mgpu::optim::SGD fresh;
  Tensor p = env.random({10}, 1);
  REQUIRE_MGPU_ERROR(fresh.update(p, p, 0, 10, env.stream), mgpu::Errc::invalid_argument, "expected begin_step(params, ...) first");
  fresh.begin_step(p, *env.allocator, env.stream);
  REQUIRE_MGPU_ERROR(fresh.update(p, p, 5, 11, env.stream), mgpu::Errc::invalid_argument, "expected a range within [0, 10)");
}

TEST_CASE(
    "Optimizer state over given ranges updates them as the whole state does (parameters flat or packed too, "
    "update_packed), and lays out anew keeping values",
    "[optim]") {
  Env env;
  using Ranges = std::vector<std::pair<std::int64_t, std::int64_t>>;
  for (int const kind : {0, 1}) {
    auto const make = [kind]() -> std::unique_ptr<mgpu::optim::Optimizer> {
      if (kind == 0)
        return std::make_unique<mgpu::optim::SGD>(
            mgpu::optim::SgdOptions{.lr = 0.1f, .momentum = 0.9f, .weight_decay = 0.01f});
      return std::make_unique<mgpu::optim::AdamW>(
          mgpu::optim::AdamWOptions{.lr = 0.01f, .weight_decay = 0.1f, .decay_ranges = {{2, 9}}});
    };
    auto whole = make();
    auto sharded = make();
    auto packed_params = make();
    INFO(whole->name());
    Tensor p1 = env.random({12}, 1);
    Tensor p2 = env.random({12}, 1);
    // Owned: [1, 4) and [4, 5) (adjacent: merged), [8, 12); an empty range; the rest is another rank's.
    sharded->set_state_ranges(p2, {{1, 4}, {4, 5}, {6, 6}, {8, 12}}, *env.allocator, env.stream);
    CHECK(sharded->state_ranges() == Ranges{{1, 5}, {8, 12}});
    CHECK(sharded->state_elements(p2) == 8);
    // ZeRO-3: the owned elements' parameters and gradients packed as the state is.
    std::vector<std::int64_t> const owned{1, 2, 3, 4, 8, 9, 10, 11};
    auto const pack = [&](Tensor const& flat) {
      std::vector<double> const v = as_double(flat);
      std::vector<float> out;
      for (std::int64_t const i : owned) out.push_back(static_cast<float>(v[static_cast<std::size_t>(i)]));
      return env.make({8}, out);
    };
    packed_params->set_state_ranges(p2, {{1, 5}, {8, 12}}, *env.allocator, env.stream);
    Tensor p3 = pack(p2);
    for (unsigned step = 0; step < 3; ++step) {
      Tensor g = env.random({12}, 10 + step);
      whole->step(p1, g, *env.allocator, env.stream);
      sharded->begin_step(p2, *env.allocator, env.stream);
      sharded->update(p2, g, 8, 12, env.stream);  // an update range may be part of an owned range
      sharded->update(p2, g, 1, 3, env.stream);
      sharded->update(p2, g, 3, 5, env.stream);
      Tensor const g3 = pack(g);
      packed_params->begin_step(p3, *env.allocator, env.stream);
      packed_params->update_packed(p3, g3, 8, 12, env.stream);
      packed_params->update_packed(p3, g3, 1, 3, env.stream);
      packed_params->update_packed(p3, g3, 3, 5, env.stream);
    }
    env.stream.synchronize();
    std::vector<double> const a = as_double(p1), b = as_double(p2), c = as_double(p3);
    for (std::int64_t i : {1, 2, 3, 4, 8, 9, 10, 11})
      CHECK(b[static_cast<std::size_t>(i)] == a[static_cast<std::size_t>(i)]);
    for (std::size_t k = 0; k < owned.size(); ++k) CHECK(c[k] == a[static_cast<std::size_t>(owned[k])]);
    REQUIRE_MGPU_ERROR(packed_params->update_packed(p2, p2, 1, 3, env.stream), mgpu::Errc::invalid_argument,
                       "(expected both packed over the 8 elements of the state ranges)");
    REQUIRE_MGPU_ERROR(packed_params->update_packed(p3, p3, 4, 9, env.stream), mgpu::Errc::invalid_argument,
                       "expected a range within one of them");
    REQUIRE_MGPU_ERROR(whole->update_packed(p1, p1, 0, 2, env.stream), mgpu::Errc::invalid_argument,
                       "update_packed without state ranges");
    for (std::int64_t i : {0, 5, 6, 7})
      CHECK(b[static_cast<std::size_t>(i)] != a[static_cast<std::size_t>(i)]);  // not owned: not updated
    auto const packed = sharded->state();
    REQUIRE(packed.size() == whole->state().size());
    for (std::size_t s = 0; s < packed.size(); ++s) {
      std::vector<double> const w = as_double(whole->state()[s].second);
      CHECK(as_double(packed[s].second) == std::vector<double>{w[1], w[2], w[3], w[4], w[8], w[9], w[10], w[11]});
    }
    REQUIRE_MGPU_ERROR(sharded->update(p2, p2, 4, 9, env.stream), mgpu::Errc::invalid_argument,
                       "expected a range within one of them");
    // Laid out over every element: the owned values kept in place, the others zero.
    sharded->set_state_ranges(p2, {}, *env.allocator, env.stream);
    CHECK(sharded->state_ranges().empty());
    env.stream.synchronize();
    for (std::size_t s = 0; s < packed.size(); ++s) {
      std::vector<double> const w = as_double(whole->state()[s].second), got = as_double(sharded->state()[s].second);
      REQUIRE(got.size() == 12);
      for (std::size_t i = 0; i < 12; ++i) CHECK(got[i] == ((i >= 1 && i < 5) || i >= 8 ? w[i] : 0.0));
    }
    // And back to a smaller layout: [9, 11) of the whole.
    sharded->set_state_ranges(p2, {{9, 11}}, *env.allocator, env.stream);
    env.stream.synchronize();
    for (std::size_t s = 0; s < packed.size(); ++s) {
      std::vector<double> const w = as_double(whole->state()[s].second);
      CHECK(as_double(sharded->state()[s].second) == std::vector<double>{w[9], w[10]});
    }
  }
  mgpu::optim::SGD sgd;
  Tensor p = env.random({10}, 1);
  REQUIRE_MGPU_ERROR(sgd.set_state_ranges(p, {{4, 6}, {5, 8}}, *env.allocator, env.stream), mgpu::Errc::invalid_argument,
                     "expected sorted, non-overlapping ranges within [0, 10)");
  REQUIRE_MGPU_ERROR(sgd.set_state_ranges(p, {{4, 11}}, *env.allocator, env.stream), mgpu::Errc::invalid_argument,
                     "state over [4, 11)");
}

// ZeRO-3's seam: the layers read their parameters from buffers given to them, the flat buffers
// freed, and the hooks tell which layer runs next. Against the same model on its flat buffers.
TEST_CASE("Sequential::bind_parameters gives the layers other buffers, and forward and backward call BeforeLayer in order",
          "[nn]") {
  Env env;
  auto model = mgpu::nn::Sequential::mlp({4, 7, 5, 3});  // Linear, ReLU, Linear, ReLU, Linear
  model.materialize(env.ctx, 11);
  auto const ranges = model.parameter_ranges();
  REQUIRE(ranges.size() == 3);
  std::int64_t const count = model.parameter_count();
  Tensor x = env.random({6, 4}, 21);
  auto const read = [&](Tensor const& t) {  // once the stream's work has run
    env.stream.synchronize();
    return as_double(t);
  };
  std::vector<double> const want_out = read(model.forward(x, env.ctx));
  std::vector<double> const values = read(model.master_parameters());
  // Two buffers: the first two Linears' parameters, and the last one's.
  std::int64_t const split = ranges[2].begin;
  auto const buffer = [&](std::int64_t begin, std::int64_t end) {
    std::vector<float> v;
    for (std::int64_t i = begin; i < end; ++i) v.push_back(static_cast<float>(values[static_cast<std::size_t>(i)]));
    return env.make({end - begin}, v);
  };
  Tensor const front = buffer(0, split);
  Tensor const back = buffer(split, count);
  model.bind_parameters(0, split, front);
  CHECK(!model.master_parameters().defined());
  CHECK(model.materialized());
  model.bind_parameters(split, count, back);
  std::vector<std::pair<std::size_t, bool>> calls;
  mgpu::nn::Sequential::BeforeLayer const before = [&](std::size_t layer, bool backward) { calls.emplace_back(layer, backward); };
  Tensor const got = model.forward(x, env.ctx, before);
  CHECK(read(got) == want_out);
  // The fused Linear and ReLU are one unit: forward calls the hook at 0, 2, 4 and backward at 4, 2, 0.
  CHECK(calls == std::vector<std::pair<std::size_t, bool>>{{0, false}, {2, false}, {4, false}});
  calls.clear();
  Tensor dout = env.random(got.shape(), 5);
  (void)model.backward(dout, env.ctx, false, {}, before);
  CHECK(calls == std::vector<std::pair<std::size_t, bool>>{{4, true}, {2, true}, {0, true}});
  // The layers read the bound buffers: changing one changes the output.
  mgpu::fill_async(back, 0.0f, env.stream);
  CHECK(read(model.forward(x, env.ctx)) == std::vector<double>(want_out.size(), 0.0));
  // Bound whole again: the flat buffers.
  Tensor const whole = buffer(0, count);
  model.bind_parameters(0, count, whole);
  CHECK(model.master_parameters().shares_storage(whole));
  CHECK(read(model.forward(x, env.ctx)) == want_out);
  REQUIRE_MGPU_ERROR(model.bind_parameters(0, ranges[1].begin + 1, buffer(0, ranges[1].begin + 1)), mgpu::Errc::invalid_argument,
                     "cuts layer 2's parameters");
  REQUIRE_MGPU_ERROR(model.bind_parameters(0, split, buffer(0, split - 1)), mgpu::Errc::invalid_argument,
                     "a buffer of " + std::to_string(split - 1) + " float32 values (expected " + std::to_string(split) + " float32)");
  auto half = mgpu::nn::Sequential::mlp({4, 3});
  half.materialize(env.ctx, 1, DType::bfloat16);
  std::string const n = std::to_string(half.parameter_count());
  REQUIRE_MGPU_ERROR(half.bind_parameters(0, half.parameter_count(), buffer(0, half.parameter_count())),
                     mgpu::Errc::invalid_argument, "a buffer of " + n + " float32 values (expected " + n + " bfloat16)");
}

TEST_CASE("classification_step's update inside backward equals the update after it", "[optim][train]") {
  for (auto const& [optimizer, compute] : {std::pair{"sgd", DType::float32}, std::pair{"adamw", DType::float32},
                                           std::pair{"sgd", DType::bfloat16}, std::pair{"adamw", DType::float16}}) {
    INFO(optimizer << ' ' << mgpu::to_string(compute));
    Env env;
    auto [x, y] = env.clusters(96, 2);
    auto a = mgpu::nn::Sequential::mlp({2, 16, 16, 3});
    auto b = a.clone();
    a.materialize(env.ctx, 5, compute);
    b.materialize(env.ctx, 5, compute);
    auto make = [&, optimizer = optimizer]() -> std::unique_ptr<mgpu::optim::Optimizer> {  // Clang 14 cannot capture a binding
      if (std::string(optimizer) == "sgd") return std::make_unique<mgpu::optim::SGD>(mgpu::optim::SgdOptions{.lr = 0.1f, .momentum = 0.9f});
      return std::make_unique<mgpu::optim::AdamW>();
    };
    auto opt_a = make();
    auto opt_b = make();
    for (std::int64_t batch = 0; batch < 96; batch += 32) {
      // a takes the in-backward path; a clipping norm no gradient reaches sends b through the
      // separate step after backward.
      mgpu::nn::classification_step(a, *opt_a, x.slice(batch, batch + 32), y.slice(batch, batch + 32), env.ctx);
      mgpu::nn::classification_step(b, *opt_b, x.slice(batch, batch + 32), y.slice(batch, batch + 32), env.ctx, {.clip_norm = 1e30f});
    }
    env.stream.synchronize();
    CHECK(as_double(a.master_parameters()) == as_double(b.master_parameters()));
    Tensor const wa = Tensor::empty(a.parameters().shape(), DType::float32, *env.allocator);
    Tensor const wb = Tensor::empty(b.parameters().shape(), DType::float32, *env.allocator);
    mgpu::convert_async(wa, a.parameters(), env.stream);  // the compute-type weights, rounded back in step
    mgpu::convert_async(wb, b.parameters(), env.stream);
    env.stream.synchronize();
    CHECK(as_double(wa) == as_double(wb));
    CHECK(opt_a->steps() == opt_b->steps());
  }
}

TEST_CASE("apply_update over given ranges, with packed gradients and parameters, updates as the whole update does", "[optim][train]") {
  Env env;
  for (bool const clip : {false, true}) {
    INFO("clip " << clip);
    auto whole = mgpu::nn::Sequential::mlp({4, 7, 3});
    auto split = whole.clone();
    whole.materialize(env.ctx, 3);
    split.materialize(env.ctx, 3);
    std::int64_t const n = whole.parameter_count(), k = 20;  // split: [0, k) in place, [k, n) packed
    Tensor const grads = env.random({n}, 7);
    mgpu::copy_async(whole.master_gradients(), grads, env.stream);
    mgpu::copy_async(split.master_gradients(), grads, env.stream);
    Tensor const tail_grads = Tensor::empty({n - k}, DType::float32, *env.allocator);
    Tensor const tail_params = Tensor::empty({n - k}, DType::float32, *env.allocator);
    mgpu::copy_async(tail_grads, grads.slice(k, n), env.stream);
    mgpu::copy_async(tail_params, split.master_parameters().slice(k, n), env.stream);
    env.stream.synchronize();
    std::vector<double> const before = as_double(split.master_parameters());
    mgpu::optim::AdamW a, head, tail;
    tail.set_state_ranges(split.master_parameters(), {{k, n}}, *env.allocator, env.stream);
    int combines = 0, afters = 0;
    mgpu::nn::UpdatePart const reference{&whole, &a, env.allocator.get(), &env.stream};
    mgpu::nn::UpdatePart first{&split, &head, env.allocator.get(), &env.stream};
    first.ranges = {{0, k, true}};
    first.after = [&](mgpu::Stream&) { ++afters; };
    mgpu::nn::UpdatePart second{&split, &tail, env.allocator.get(), &env.stream};
    second.ranges = {{k, n, true}};
    second.gradients = tail_grads;
    second.parameters = tail_params;
    second.combine = [&](Tensor const& values, mgpu::Stream&) {
      CHECK(values.numel() == 1);
      ++combines;
    };
    mgpu::optim::LossScaler scaler_a(1.0f), scaler_b(1.0f);
    mgpu::nn::UpdateOptions options{1.0f, clip ? 0.5f : 0.0f, clip ? &scaler_a : nullptr, false};
    CHECK(mgpu::nn::apply_update({&reference, 1}, options));
    options.scaler = clip ? &scaler_b : nullptr;
    mgpu::nn::UpdatePart const parts[] = {first, second};
    CHECK(mgpu::nn::apply_update(parts, options));
    env.stream.synchronize();
    CHECK(combines == (clip ? 2 : 0));  // the overflow count and the norm
    CHECK(afters == 1);
    std::vector<double> const want = as_double(whole.master_parameters()), got = as_double(split.master_parameters()),
                              got_tail = as_double(tail_params);
    double const tolerance = clip ? 1e-6 : 0.0;  // the norm adds two partial sums, not one
    for (std::int64_t i = 0; i < n; ++i) {
      auto const at = static_cast<std::size_t>(i);
      if (i < k) {
        CHECK(std::abs(got[at] - want[at]) <= tolerance);
      } else {
        CHECK(got[at] == before[at]);  // the packed parameters are written, not the master ones
        CHECK(std::abs(got_tail[at - static_cast<std::size_t>(k)] - want[at]) <= tolerance);
      }
    }
    // A caller's total replaces the parts' combine.
    CHECK(mgpu::nn::apply_update(parts, options, [](std::span<Tensor const>) { return 0.0; }));
    CHECK(combines == (clip ? 2 : 0));
  }
}

TEST_CASE("Schedules, the linear scaling rule and clipping", "[optim]") {
  CHECK(mgpu::optim::step_lr(25, 10, 0.5f) == Approx(0.25f));
  CHECK(mgpu::optim::cosine_lr(0, 100) == Approx(1.0f));
  CHECK(mgpu::optim::cosine_lr(50, 100) == Approx(0.5f));
  CHECK(mgpu::optim::cosine_lr(100, 100, 0.1f) == Approx(0.1f));
  CHECK(mgpu::optim::warmup_lr(0, 4, 1.0f) == Approx(0.25f));
  CHECK(mgpu::optim::warmup_lr(9, 4, 0.3f) == Approx(0.3f));
  CHECK(mgpu::optim::linear_scaled_lr(0.1f, 256, 1024) == Approx(0.4f));
  Env env;
  Tensor g = env.make({2}, {3, 4});
  CHECK(mgpu::optim::clip_grad_norm(g, 1.0f, *env.allocator, env.stream) == Approx(5.0f));
  env.stream.synchronize();
  CHECK(g.host_span<float>()[0] == Approx(0.6f));
  Tensor nan = env.make({1}, {std::nanf("")});
  REQUIRE_MGPU_ERROR(mgpu::optim::clip_grad_norm(nan, 1.0f, *env.allocator, env.stream), mgpu::Errc::invalid_argument, "NaN or Inf");
}

TEST_CASE("An MLP trained with SGD separates Gaussian clusters", "[nn][train]") {
  Env env;
  std::int64_t const n = 600;
  auto const [x, y] = env.clusters(n, 4);
  auto model = mgpu::nn::Sequential::mlp({2, 32, 3});
  model.materialize(env.ctx, 1);
  mgpu::optim::SGD sgd({.lr = 0.1f, .momentum = 0.9f});
  Tensor loss = env.scalar();
  for (int epoch = 0; epoch < 30; ++epoch) {
    for (std::int64_t b = 0; b < n; b += 60) {
      Tensor out = model.forward(x.slice(b, b + 60), env.ctx);
      Tensor dout = Tensor::empty(out.shape(), DType::float32, *env.allocator);
      mgpu::ops::softmax_cross_entropy(out, y.slice(b, b + 60), dout, loss, env.stream);
      model.backward(dout, env.ctx);
      sgd.step(model.parameters(), model.gradients(), *env.allocator, env.stream);
    }
  }
  Tensor out = model.forward(x, env.ctx);
  CHECK(mgpu::ops::item(loss, env.stream) < 0.3f);
  int correct = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    auto const row = out.host_span<float>().subspan(static_cast<std::size_t>(3 * i), 3);
    auto const pred = std::max_element(row.begin(), row.end()) - row.begin();
    correct += pred == static_cast<long>(y.host_span<float>()[static_cast<std::size_t>(i)]) ? 1 : 0;
  }
  CHECK(correct >= 0.95 * n);
}

TEST_CASE("classification_step and count_correct refuse bad numbers and labels", "[optim][train]") {
  Env env;
  auto [x, y] = env.clusters(12, 3);
  auto model = mgpu::nn::Sequential::mlp({2, 8, 3});
  model.materialize(env.ctx, 1);
  mgpu::optim::SGD sgd({.lr = 0.1f});
  env.stream.synchronize();
  auto const before = as_double(model.master_parameters());
  for (float lr_scale : {std::nanf(""), INFINITY, -0.5f}) {
    REQUIRE_MGPU_ERROR(mgpu::nn::classification_step(model, sgd, x, y, env.ctx, {.lr_scale = lr_scale}), mgpu::Errc::invalid_argument,
                       "(expected a finite lr_scale >= 0)");
  }
  for (float clip : {-1.0f, std::nanf(""), INFINITY}) {
    REQUIRE_MGPU_ERROR(mgpu::nn::classification_step(model, sgd, x, y, env.ctx, {.clip_norm = clip}), mgpu::Errc::invalid_argument,
                       "(expected 0 for no clipping, or a finite norm > 0)");
  }
  env.stream.synchronize();
  CHECK(as_double(model.master_parameters()) == before);
  CHECK(sgd.steps() == 0);
  y.host_span<float>()[7] = 3.0f;
  REQUIRE_MGPU_ERROR(mgpu::nn::count_correct(model, x, y, env.ctx), mgpu::Errc::invalid_argument,
                     "count_correct: label 3.000000 in row 7 (expected a class id in [0, 3))");
}

TEST_CASE("A loss scaler's state round-trips, and a bad one is refused", "[optim]") {
  mgpu::optim::LossScaler scaler(1024.0f, 2.0f, 0.5f, 3);
  scaler.update(false);
  scaler.update(true);
  mgpu::optim::LossScaler::State const state = scaler.state();
  CHECK(state == mgpu::optim::LossScaler::State{512.0f, 1, 1});
  mgpu::optim::LossScaler restored(1024.0f, 2.0f, 0.5f, 3);
  restored.set_state(state);
  for (bool finite : {true, true, false, true}) CHECK(restored.update(finite) == scaler.update(finite));
  CHECK(restored.state() == scaler.state());
  REQUIRE_MGPU_ERROR(restored.set_state({0.0f, 0, 0}), mgpu::Errc::invalid_argument, "expected a finite scale > 0");
  REQUIRE_MGPU_ERROR(restored.set_state({1.0f, 3, 0}), mgpu::Errc::invalid_argument, "0 <= good steps < 3");
}
