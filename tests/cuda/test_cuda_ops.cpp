// The training ops on a GPU against the same ops on a host device (the host path is itself checked
// against float64 references in tests/nn), and a short training run on the GPU.
#include <mgpu/core/device_group.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/optim/optim.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "support/catch.hpp"
#include "support/expect_error.hpp"

using mgpu::Device;
using mgpu::DeviceKind;
using mgpu::DType;
using mgpu::Tensor;

namespace {

struct Side {
  Device device;
  std::shared_ptr<mgpu::Allocator> allocator = mgpu::Allocator::create(device);
  mgpu::Stream stream{device};
};

struct Pair {
  Side host{Device{DeviceKind::host, 0}};
  Side gpu{Device{DeviceKind::cuda, 0}};
  std::shared_ptr<mgpu::Allocator> staging = mgpu::Allocator::create(Device{DeviceKind::host, 0});

  // The same random values (optionally as class ids below `classes`) on both sides, in `dtype`.
  std::pair<Tensor, Tensor> random(mgpu::Shape const& shape, unsigned seed, DType dtype = DType::float32, int classes = 0) {
    Tensor f = Tensor::empty(shape, DType::float32, *staging);
    std::mt19937 rng(seed);
    std::normal_distribution<float> n(0, 1);
    std::uniform_int_distribution<int> c(0, std::max(0, classes - 1));
    for (float& v : f.host_span<float>()) v = classes > 0 ? static_cast<float>(c(rng)) : n(rng);
    Tensor h = Tensor::empty(shape, dtype, *host.allocator);
    Tensor g = Tensor::empty(shape, dtype, *gpu.allocator);
    mgpu::convert_async(h, f, host.stream);
    host.stream.synchronize();
    mgpu::copy_async(g, h, gpu.stream);
    gpu.stream.synchronize();
    return {h, g};
  }
  std::pair<Tensor, Tensor> empty(mgpu::Shape const& shape, DType dtype = DType::float32) {
    return {Tensor::empty(shape, dtype, *host.allocator), Tensor::empty(shape, dtype, *gpu.allocator)};
  }
  // Both results as float32 host values.
  std::pair<std::vector<float>, std::vector<float>> fetch(std::pair<Tensor, Tensor> const& t) {
    host.stream.synchronize();
    Tensor g = Tensor::empty(t.second.shape(), t.second.dtype(), *host.allocator);
    mgpu::copy_async(g, t.second, gpu.stream);
    gpu.stream.synchronize();
    auto widen = [&](Tensor const& x) {
      Tensor f = Tensor::empty(x.shape(), DType::float32, *host.allocator);
      mgpu::convert_async(f, x, host.stream);
      host.stream.synchronize();
      auto s = f.host_span<float>();
      return std::vector<float>(s.begin(), s.end());
    };
    return {widen(t.first), widen(g)};
  }
  void require_close(std::pair<Tensor, Tensor> const& t, double tolerance) {
    auto const [h, g] = fetch(t);
    for (std::size_t i = 0; i < h.size(); ++i) {
      INFO("element " << i);
      REQUIRE(g[i] == Approx(h[i]).margin(tolerance).epsilon(tolerance));
    }
  }
};

}  // namespace

TEST_CASE("CUDA ops match the host ops", "[cuda][ops][sanitize]") {
  for (DType dtype : {DType::float32, DType::bfloat16, DType::float16}) {
    INFO(mgpu::to_string(dtype));
    double const tol = dtype == DType::float32 ? 1e-4 : 2e-2;
    Pair p;
    auto a = p.random({64, 96}, 1, dtype);
    auto b = p.random({96, 48}, 2, dtype);
    auto bt = p.random({48, 96}, 3, dtype);
    auto c = p.empty({64, 48}, dtype);
    for (bool tb : {false, true}) {
      mgpu::ops::gemm(a.first, false, tb ? bt.first : b.first, tb, c.first, 1.0f, 0.0f, p.host.stream);
      mgpu::ops::gemm(a.second, false, tb ? bt.second : b.second, tb, c.second, 1.0f, 0.0f, p.gpu.stream);
      p.require_close(c, dtype == DType::float32 ? 1e-3 : 5e-2);
    }
    auto at = p.empty({96, 48}, dtype);
    mgpu::ops::gemm(a.first, true, c.first, false, at.first, 0.5f, 0.0f, p.host.stream);
    mgpu::ops::gemm(a.second, true, c.second, false, at.second, 0.5f, 0.0f, p.gpu.stream);
    p.require_close(at, dtype == DType::float32 ? 1e-3 : 1e-1);

    auto bias = p.random({48}, 4, dtype);
    mgpu::ops::add_bias(c.first, bias.first, p.host.stream);
    mgpu::ops::add_bias(c.second, bias.second, p.gpu.stream);
    p.require_close(c, tol);
    auto db = p.empty({48}, dtype);
    mgpu::ops::bias_grad(c.first, db.first, p.host.stream);
    mgpu::ops::bias_grad(c.second, db.second, p.gpu.stream);
    p.require_close(db, dtype == DType::float32 ? 1e-3 : 1e-1);

    auto x = p.random({32, 40}, 5, dtype);
    auto dy = p.random({32, 40}, 6, dtype);
    auto y = p.empty({32, 40}, dtype);
    auto dx = p.empty({32, 40}, dtype);
    for (auto [fwd, bwd] : {std::pair{&mgpu::ops::relu, &mgpu::ops::relu_backward}, std::pair{&mgpu::ops::gelu, &mgpu::ops::gelu_backward}}) {
      fwd(x.first, y.first, p.host.stream);
      fwd(x.second, y.second, p.gpu.stream);
      p.require_close(y, tol);
      bwd(x.first, dy.first, dx.first, p.host.stream);
      bwd(x.second, dy.second, dx.second, p.gpu.stream);
      p.require_close(dx, tol);
    }
    // The fused linear ops: y = act(x W + b), then dz = act'(z) dy with db in the same pass.
    auto w = p.random({40, 24}, 9, dtype);
    auto lb = p.random({24}, 10, dtype);
    auto ly = p.empty({32, 24}, dtype);
    auto pre = p.empty({32, 24}, dtype);
    auto ldy = p.random({32, 24}, 11, dtype);
    auto lz = p.random({32, 24}, 12, dtype);
    auto ldz = p.empty({32, 24}, dtype);
    auto ldb = p.empty({24}, dtype);
    for (auto act : {mgpu::ops::ActivationKind::identity, mgpu::ops::ActivationKind::relu, mgpu::ops::ActivationKind::gelu}) {
      INFO(mgpu::ops::activation_name(act));
      bool const gelu = act == mgpu::ops::ActivationKind::gelu;
      mgpu::ops::linear(x.first, w.first, lb.first, ly.first, act, gelu ? pre.first : Tensor{}, p.host.stream);
      mgpu::ops::linear(x.second, w.second, lb.second, ly.second, act, gelu ? pre.second : Tensor{}, p.gpu.stream);
      p.require_close(ly, dtype == DType::float32 ? 1e-3 : 5e-2);
      if (gelu) p.require_close(pre, dtype == DType::float32 ? 1e-3 : 5e-2);
      // The backward from one z on both sides (GEMM rounding could flip a ReLU near zero).
      mgpu::ops::activation_bias_grad(act, lz.first, ldy.first, ldz.first, ldb.first, p.host.stream);
      mgpu::ops::activation_bias_grad(act, lz.second, ldy.second, ldz.second, ldb.second, p.gpu.stream);
      p.require_close(ldz, tol);
      p.require_close(ldb, dtype == DType::float32 ? 1e-3 : 1e-1);
    }

    mgpu::ops::dropout(x.first, y.first, 0.25f, 99, p.host.stream);
    mgpu::ops::dropout(x.second, y.second, 0.25f, 99, p.gpu.stream);
    p.require_close(y, tol);

    auto gamma = p.random({40}, 7, dtype);
    auto beta = p.random({40}, 8, dtype);
    auto stats = p.empty({2, 32});
    mgpu::ops::layer_norm(x.first, gamma.first, beta.first, y.first, stats.first, 1e-5f, p.host.stream);
    mgpu::ops::layer_norm(x.second, gamma.second, beta.second, y.second, stats.second, 1e-5f, p.gpu.stream);
    p.require_close(y, tol);
    auto dgamma = p.empty({40}, dtype);
    auto dbeta = p.empty({40}, dtype);
    mgpu::ops::layer_norm_backward(x.first, gamma.first, stats.first, dy.first, dx.first, dgamma.first, dbeta.first, p.host.stream);
    mgpu::ops::layer_norm_backward(x.second, gamma.second, stats.second, dy.second, dx.second, dgamma.second, dbeta.second, p.gpu.stream);
    p.require_close(dx, tol);
    p.require_close(dgamma, dtype == DType::float32 ? 1e-3 : 1e-1);

    auto logits = p.random({50, 10}, 9, dtype);
    auto labels = p.random({50}, 10, DType::float32, 10);
    auto dlogits = p.empty({50, 10}, dtype);
    auto loss = p.empty({1});
    mgpu::ops::softmax_cross_entropy(logits.first, labels.first, dlogits.first, loss.first, p.host.stream);
    mgpu::ops::softmax_cross_entropy(logits.second, labels.second, dlogits.second, loss.second, p.gpu.stream);
    p.require_close(loss, 1e-4);
    p.require_close(dlogits, tol);
    mgpu::ops::count_correct(logits.first, labels.first, loss.first, p.host.stream);
    mgpu::ops::count_correct(logits.second, labels.second, loss.second, p.gpu.stream);
    p.require_close(loss, 0);
    for (auto reduce : {&mgpu::ops::sum, &mgpu::ops::sum_squares, &mgpu::ops::count_nonfinite}) {
      reduce(x.first, loss.first, p.host.stream);
      reduce(x.second, loss.second, p.gpu.stream);
      p.require_close(loss, 1e-3);
    }
  }
}

TEST_CASE("GPU reductions give the same bits on every run", "[cuda][ops][sanitize]") {
  Pair p;
  auto x = p.random({1 << 20}, 21);  // many blocks: an atomic order would vary between runs
  auto out = p.empty({1});
  std::vector<float> first;
  for (int run = 0; run < 5; ++run) {
    mgpu::ops::sum_squares(x.second, out.second, p.gpu.stream);
    auto const [h, g] = p.fetch(out);
    if (run == 0) first = g;
    REQUIRE(g[0] == first[0]);  // bitwise, not approximately
  }
  mgpu::ops::sum_squares(x.first, out.first, p.host.stream);
  auto const [h, g] = p.fetch(out);
  CHECK(g[0] == Approx(h[0]).epsilon(1e-5));
}

TEST_CASE("A bad label fails on the GPU with the host's error", "[cuda][ops][sanitize]") {
  Pair p;
  auto logits = p.random({6, 4}, 3);
  auto labels = p.random({6}, 4, DType::float32, 4);
  auto dlogits = p.empty({6, 4});
  auto loss = p.empty({1});
  // Row 2 gets class 4 of 4 (and row 5 a fraction: the first bad row is the one reported).
  labels.first.host_span<float>()[2] = 4.0f;
  labels.first.host_span<float>()[5] = 1.5f;
  mgpu::copy_async(labels.second, labels.first, p.gpu.stream);
  std::string host_message;
  std::string gpu_message;
  mgpu::ops::softmax_cross_entropy(logits.first, labels.first, dlogits.first, loss.first, p.host.stream);
  try {
    p.host.stream.synchronize();
  } catch (mgpu::Error const& e) {
    host_message = e.what();
  }
  mgpu::ops::softmax_cross_entropy(logits.second, labels.second, dlogits.second, loss.second, p.gpu.stream);
  try {
    p.gpu.stream.synchronize();
  } catch (mgpu::Error const& e) {
    CHECK(e.category() == mgpu::Errc::invalid_argument);
    gpu_message = e.what();
  }
  CHECK_THAT(host_message, MGPU_TEST_CONTAINS("label 4.000000 in row 2"));
  CHECK(gpu_message == host_message);
}

TEST_CASE("TF32 GEMM on the GPU: opt-in, close to float32, not exact", "[cuda][ops]") {
  Pair p;
  auto a = p.random({256, 512}, 31);
  auto b = p.random({512, 128}, 32);
  auto exact = p.empty({256, 128});
  auto fast = p.empty({256, 128});
  REQUIRE(mgpu::ops::float32_matmul() == mgpu::ops::Float32Matmul::exact);
  mgpu::ops::gemm(a.first, false, b.first, false, exact.first, 1.0f, 0.0f, p.host.stream);
  mgpu::ops::gemm(a.second, false, b.second, false, exact.second, 1.0f, 0.0f, p.gpu.stream);
  mgpu::ops::set_float32_matmul(mgpu::ops::Float32Matmul::tf32);
  mgpu::ops::gemm(a.second, false, b.second, false, fast.second, 1.0f, 0.0f, p.gpu.stream);
  mgpu::ops::set_float32_matmul(mgpu::ops::Float32Matmul::exact);
  auto const [reference, gpu_exact] = p.fetch(exact);
  auto const [unused, gpu_tf32] = p.fetch(fast);
  double exact_error = 0;
  double tf32_error = 0;
  for (std::size_t i = 0; i < reference.size(); ++i) {
    exact_error = std::max(exact_error, std::abs(static_cast<double>(gpu_exact[i]) - reference[i]));
    tf32_error = std::max(tf32_error, std::abs(static_cast<double>(gpu_tf32[i]) - reference[i]));
  }
  CHECK(exact_error < 1e-3);       // sums of 512 unit normals: float32 rounding only
  CHECK(tf32_error < 0.5);         // 10-bit mantissa inputs
  CHECK(tf32_error > exact_error);  // and TF32 was really used
}

TEST_CASE("GEMM extents beyond cuBLAS's int are rejected, not truncated", "[cuda][ops]") {
  mgpu::DeviceGroup group("cuda:0");
  // m = 2^31 with k = n = 0: tensors without memory, yet an m that an int cannot hold (the old
  // narrowing made it negative).
  std::int64_t const m = std::int64_t{1} << 31;
  Tensor a = Tensor::empty({m, 0}, DType::float32, group.allocator(0));
  Tensor b = Tensor::empty({0, 0}, DType::float32, group.allocator(0));
  Tensor c = Tensor::empty({m, 0}, DType::float32, group.allocator(0));
  REQUIRE_MGPU_ERROR(mgpu::ops::gemm(a, false, b, false, c, 1.0f, 0.0f, group.stream(0)), mgpu::Errc::invalid_argument,
                     "m = 2147483648");
}

TEST_CASE("CUDA optimizer updates match the host", "[cuda][optim]") {
  Pair p;
  auto params = p.random({10000}, 1);
  auto grads = p.random({10000}, 2);
  auto m = p.random({10000}, 3);
  auto v = p.random({10000}, 4);
  mgpu::ops::sgd_update(params.first, grads.first, m.first, 0.1f, 0.9f, 1e-4f, true, p.host.stream);
  mgpu::ops::sgd_update(params.second, grads.second, m.second, 0.1f, 0.9f, 1e-4f, true, p.gpu.stream);
  p.require_close(params, 1e-5);
  mgpu::ops::scale(v.first, -2.0f, p.host.stream);
  mgpu::ops::scale(v.second, -2.0f, p.gpu.stream);
  p.require_close(v, 0);
  auto sq = p.empty({10000});  // AdamW's second moment starts at zero
  mgpu::ops::scale_convert(sq.first, grads.first, 0.0f, p.host.stream);
  mgpu::ops::scale_convert(sq.second, grads.second, 0.0f, p.gpu.stream);
  mgpu::ops::adamw_update(params.first, grads.first, m.first, sq.first, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, 1, p.host.stream);
  mgpu::ops::adamw_update(params.second, grads.second, m.second, sq.second, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, 1, p.gpu.stream);
  p.require_close(params, 1e-5);
}

TEST_CASE("An MLP trains on the GPU in float32, bfloat16 and float16", "[cuda][train]") {
  for (DType compute : {DType::float32, DType::bfloat16, DType::float16}) {
    INFO(mgpu::to_string(compute));
    Pair p;
    auto x = p.random({512, 8}, 1);
    auto labels = p.empty({512});
    {
      // Labels from a fixed linear rule, so the task is learnable.
      auto [hx, gx] = p.fetch(x);
      for (std::int64_t i = 0; i < 512; ++i) {
        float const s = hx[static_cast<std::size_t>(i * 8)] + hx[static_cast<std::size_t>(i * 8 + 1)];
        labels.first.host_span<float>()[static_cast<std::size_t>(i)] = s > 0.5f ? 2.0f : (s > -0.5f ? 1.0f : 0.0f);
      }
      mgpu::copy_async(labels.second, labels.first, p.gpu.stream);
    }
    mgpu::nn::Context ctx{*p.gpu.allocator, p.gpu.stream};
    auto model = mgpu::nn::Sequential::mlp({8, 64, 3});
    model.materialize(ctx, 5, compute);
    mgpu::optim::AdamW adam({.lr = 0.01f});
    mgpu::optim::LossScaler scaler;
    mgpu::nn::StepOptions const options{.scaler = compute == DType::float16 ? &scaler : nullptr};
    for (int epoch = 0; epoch < 40; ++epoch)
      for (std::int64_t b = 0; b < 512; b += 64)
        mgpu::nn::classification_step(model, adam, x.second.slice(b, b + 64), labels.second.slice(b, b + 64), ctx, options);
    CHECK(mgpu::nn::count_correct(model, x.second, labels.second, ctx) >= 470);
  }
}

TEST_CASE("Kernel temporaries come from the caching allocator, reused by their stream at once", "[cuda]") {
  Pair p;
  auto [x_host, x_gpu] = p.random({4096, 33}, 41);
  auto out = p.empty({1});
  mgpu::ops::sum_squares(x_host, out.first, p.host.stream);
  float const expected = mgpu::ops::item(out.first, p.host.stream);
  mgpu::Allocator& allocator = *p.gpu.allocator;
  p.gpu.stream.synchronize();
  auto const before = allocator.stats();
  mgpu::ops::sum_squares(x_gpu, out.second, p.gpu.stream);  // its partial sums: a scratch block
  auto const first = allocator.stats();
  CHECK(first.allocations == before.allocations + 1);
  mgpu::ops::sum_squares(x_gpu, out.second, p.gpu.stream);  // the same block, before the first has run
  auto const second = allocator.stats();
  CHECK(second.allocations == first.allocations + 1);
  CHECK(second.cache_hits == first.cache_hits + 1);
  CHECK(mgpu::ops::item(out.second, p.gpu.stream) == Approx(expected).epsilon(1e-5));
  CHECK(allocator.stats().allocated == before.allocated);  // the scratch went back with each call
}
