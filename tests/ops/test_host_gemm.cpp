// The host GEMM (oneDNN or Eigen, whichever the build uses; CI builds both) at shapes with tails in
// every dimension, against float64 references: each transpose with alpha and beta, the fused linear
// epilogues in float32 and bfloat16 (float32 accumulation), cached primitives reused with other
// buffers and evicted and recreated, two worker threads at once, the calling thread as the only
// thread, and the counts (and those of the other host ops, by family).
#include <cmath>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <dirent.h>

#include <mgpu/config.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/ops/transformer.hpp>

#include "support/catch.hpp"
#include "support/nn_env.hpp"

using mgpu::DType;
using mgpu::Tensor;
using mgpu::ops::ActivationKind;
using mgpu::test::as_double;
using mgpu::test::Env;
using mgpu::test::to_dtype;
using mgpu::test::widened;

namespace {

// Element (i, j) of op(X) for a row-major X of `cols` columns.
double at(std::vector<double> const& x, std::int64_t cols, bool transposed, std::int64_t i, std::int64_t j) {
  return x[static_cast<std::size_t>(transposed ? j * cols + i : i * cols + j)];
}

int thread_count() {
  int n = 0;
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return -1;
  while (dirent const* e = readdir(dir)) n += e->d_name[0] != '.';
  closedir(dir);
  return n;
}

double gelu(double v) { return 0.5 * v * (1 + std::tanh(std::sqrt(2 / 3.141592653589793) * (v + 0.044715 * v * v * v))); }

}  // namespace

TEST_CASE("Host GEMM: every transpose with alpha and beta matches float64, twice per shape", "[ops][gemm]") {
  INFO("backend " << mgpu::host_gemm_backend);
  Env env;
  struct Shape {
    std::int64_t m, n, k;
  };
  for (Shape const s : {Shape{37, 53, 70}, Shape{130, 67, 259}, Shape{1, 17, 5}}) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        for (auto const& [alpha, beta] : {std::pair{1.0f, 0.0f}, std::pair{-0.5f, 1.0f}, std::pair{2.0f, 0.25f}}) {
          // Twice: the second call reuses the first's primitive with other buffers.
          for (unsigned round = 0; round < 2; ++round) {
            INFO(s.m << "x" << s.n << "x" << s.k << " ta " << ta << " tb " << tb << " alpha " << alpha << " beta " << beta << " round " << round);
            unsigned const seed = round * 10 + 1;
            Tensor a = env.random(ta ? mgpu::Shape{s.k, s.m} : mgpu::Shape{s.m, s.k}, seed);
            Tensor b = env.random(tb ? mgpu::Shape{s.n, s.k} : mgpu::Shape{s.k, s.n}, seed + 1);
            Tensor c = env.random({s.m, s.n}, seed + 2);
            auto const as = as_double(a);
            auto const bs = as_double(b);
            auto const c0 = as_double(c);
            mgpu::ops::gemm(a, ta, b, tb, c, alpha, beta, env.stream);
            env.stream.synchronize();
            auto const cs = as_double(c);
            for (std::int64_t i = 0; i < s.m; ++i) {
              for (std::int64_t j = 0; j < s.n; ++j) {
                double acc = 0;
                double size = 0;
                for (std::int64_t p = 0; p < s.k; ++p) {
                  double const term = at(as, ta ? s.m : s.k, ta, i, p) * at(bs, tb ? s.k : s.n, tb, p, j);
                  acc += term;
                  size += std::abs(term);
                }
                auto const e = static_cast<std::size_t>(i * s.n + j);
                double const expected = alpha * acc + beta * c0[e];
                REQUIRE(std::abs(cs[e] - expected) <= 1e-5 * (std::abs(alpha) * size + std::abs(beta * c0[e])) + 1e-6);
              }
            }
          }
        }
      }
    }
  }
}

TEST_CASE("Host linear: bias and ReLU/GELU epilogues in float32 and bfloat16 (float32 accumulation) match float64", "[ops][gemm]") {
  INFO("backend " << mgpu::host_gemm_backend);
  std::int64_t const n = 67;
  std::int64_t const in = 1027;
  std::int64_t const out = 130;
  for (DType dtype : {DType::float32, DType::bfloat16}) {
    for (ActivationKind act : {ActivationKind::identity, ActivationKind::relu, ActivationKind::gelu}) {
      INFO(mgpu::to_string(dtype) << ' ' << mgpu::ops::activation_name(act));
      Env env;
      // Positive inputs make every partial sum grow to about in / 4: a bfloat16 accumulator would
      // be off by far more than the tolerance below, a float32 one is not.
      Tensor x32 = env.random({n, in}, 1);
      for (float& v : x32.host_span<float>()) v = std::abs(v);
      Tensor x = to_dtype(env, x32, dtype);
      Tensor w = to_dtype(env, env.random({in, out}, 2), dtype);
      Tensor b = to_dtype(env, env.random({out}, 3, 4.0f), dtype);
      Tensor y = Tensor::empty({n, out}, dtype, *env.allocator);
      bool const with_pre = act == ActivationKind::gelu;
      Tensor pre = with_pre ? Tensor::empty({n, out}, dtype, *env.allocator) : Tensor{};
      mgpu::ops::linear(x, w, b, y, act, pre, env.stream);
      auto const xs = widened(env, x);
      auto const ws = widened(env, w);
      auto const bs = widened(env, b);
      auto const ys = widened(env, y);
      auto const pres = with_pre ? widened(env, pre) : std::vector<double>{};
      // float32: accumulation error; bfloat16: the output's rounding (2^-8 relative, twice for GELU's
      // input and output) plus float32 accumulation.
      double const relative = dtype == DType::float32 ? 1e-5 : 2.0 / 256;
      for (std::int64_t i = 0; i < n; ++i) {
        for (std::int64_t j = 0; j < out; ++j) {
          double v = bs[static_cast<std::size_t>(j)];
          double size = std::abs(v);
          for (std::int64_t k = 0; k < in; ++k) {
            double const term = xs[static_cast<std::size_t>(i * in + k)] * ws[static_cast<std::size_t>(k * out + j)];
            v += term;
            size += std::abs(term);
          }
          auto const e = static_cast<std::size_t>(i * out + j);
          double const expected = act == ActivationKind::relu ? std::max(v, 0.0) : act == ActivationKind::gelu ? gelu(v) : v;
          double const tol = relative * std::abs(expected) + 1e-5 * size;
          REQUIRE(std::abs(ys[e] - expected) <= tol + (with_pre ? relative * std::abs(v) : 0.0));
          if (with_pre) REQUIRE(std::abs(pres[e] - v) <= relative * std::abs(v) + 1e-5 * size);
        }
      }
    }
  }
}

TEST_CASE("Host linear with no inner dimension is act(bias); GEMM with k = 0 scales C by beta", "[ops][gemm]") {
  Env env;
  Tensor x = Tensor::empty({3, 0}, DType::float32, *env.allocator);
  Tensor w = Tensor::empty({0, 2}, DType::float32, *env.allocator);
  Tensor b = env.make({2}, {-1.5f, 2.5f});
  Tensor y = env.random({3, 2}, 1);
  mgpu::ops::linear(x, w, b, y, ActivationKind::relu, {}, env.stream);
  env.stream.synchronize();
  CHECK(as_double(y) == std::vector<double>{0, 2.5, 0, 2.5, 0, 2.5});
  Tensor c = env.make({3, 2}, {1, 2, 3, 4, 5, 6});
  mgpu::ops::gemm(x, false, w, false, c, 1.0f, 0.5f, env.stream);
  env.stream.synchronize();
  CHECK(as_double(c) == std::vector<double>{0.5, 1, 1.5, 2, 2.5, 3});
}

TEST_CASE("Host GEMMs on two host streams (two worker threads) at once match each one run alone", "[ops][gemm]") {
  Env first;
  Env second;
  auto run = [](Env& env, unsigned seed, int repeats) {
    Tensor x = env.random({64, 200}, seed);
    Tensor w = env.random({200, 96}, seed + 1);
    Tensor b = env.random({96}, seed + 2);
    Tensor y = Tensor::empty({64, 96}, DType::float32, *env.allocator);
    Tensor dw = Tensor::empty({200, 96}, DType::float32, *env.allocator);
    for (int r = 0; r < repeats; ++r) {
      mgpu::ops::linear(x, w, b, y, ActivationKind::relu, {}, env.stream);
      mgpu::ops::gemm(x, true, y, false, dw, 1.0f, 0.0f, env.stream);
    }
    env.stream.synchronize();
    return std::pair{as_double(y), as_double(dw)};
  };
  auto const alone1 = run(first, 1, 1);
  auto const alone2 = run(second, 7, 1);
  std::pair<std::vector<double>, std::vector<double>> together1;
  std::thread other([&] { together1 = run(first, 1, 20); });
  auto const together2 = run(second, 7, 20);
  other.join();
  CHECK(together1 == alone1);
  CHECK(together2 == alone2);
}

TEST_CASE("Host GEMMs run on the stream's worker alone and are counted there", "[ops][gemm]") {
  Env env;
  Tensor x = env.random({256, 512}, 1);
  Tensor w = env.random({512, 512}, 2);
  Tensor b = env.random({512}, 3);
  Tensor y = Tensor::empty({256, 512}, DType::float32, *env.allocator);
  Tensor xb = to_dtype(env, x, DType::bfloat16);
  Tensor wb = to_dtype(env, w, DType::bfloat16);
  Tensor bb = to_dtype(env, b, DType::bfloat16);
  Tensor yb = Tensor::empty({256, 512}, DType::bfloat16, *env.allocator);
  env.stream.synchronize();
  mgpu::ops::HostGemmStats before;
  env.stream.enqueue([&] { before = mgpu::ops::host_gemm_stats(); });
  env.stream.synchronize();
  int const threads = thread_count();
  for (int r = 0; r < 3; ++r) {
    mgpu::ops::linear(x, w, b, y, ActivationKind::relu, {}, env.stream);
    mgpu::ops::linear(xb, wb, bb, yb, ActivationKind::relu, {}, env.stream);
    mgpu::ops::gemm(y, false, w, true, x, 1.0f, 0.0f, env.stream);
  }
  mgpu::ops::HostGemmStats after;
  env.stream.enqueue([&] { after = mgpu::ops::host_gemm_stats(); });
  env.stream.synchronize();
  // A GEMM library with a thread pool of its own would have started it by now (on any machine with
  // more than one hardware thread).
  CHECK(thread_count() == threads);
  CHECK(after.calls - before.calls == 9);
  CHECK(after.flops - before.flops == 9 * 2.0 * 256 * 512 * 512);
  CHECK(after.seconds > before.seconds);
  CHECK(mgpu::ops::host_gemm_stats().calls == 0);  // this thread ran none
}

TEST_CASE("Host op time counts go to the family of each op, on the worker that ran it", "[ops][gemm]") {
  Env env;
  Tensor x = env.random({64, 96}, 1);
  Tensor gamma = env.random({96}, 2);
  Tensor beta = env.random({96}, 3);
  Tensor y = Tensor::empty({64, 96}, DType::float32, *env.allocator);
  Tensor stats = Tensor::empty({2, 64}, DType::float32, *env.allocator);
  Tensor qkv = env.random({2, 32, 96}, 4);
  Tensor out = Tensor::empty({2, 32, 32}, DType::float32, *env.allocator);
  Tensor lse = Tensor::empty({2, 2, 32}, DType::float32, *env.allocator);
  auto const read = [&] {
    std::pair<mgpu::ops::HostOpSeconds, mgpu::ops::HostGemmStats> r;
    env.stream.enqueue([&r] { r = {mgpu::ops::host_op_seconds(), mgpu::ops::host_gemm_stats()}; });
    env.stream.synchronize();
    return r;
  };
  using F = mgpu::ops::HostOpFamily;
  // Each op in turn: its family's total grows, every other family's and the GEMMs' stay.
  auto const only = [&](F family, auto const& op) {
    INFO(mgpu::ops::host_op_family_name(family));
    auto const [before, gemm_before] = read();
    op();
    auto const [after, gemm_after] = read();
    for (std::size_t f = 0; f < mgpu::ops::host_op_family_count; ++f) {
      INFO("family " << mgpu::ops::host_op_family_name(static_cast<F>(f)));
      if (static_cast<F>(f) == family)
        CHECK(after.seconds[f] > before.seconds[f]);
      else
        CHECK(after.seconds[f] == before.seconds[f]);
    }
    CHECK(gemm_after.calls == gemm_before.calls);
  };
  only(F::norm, [&] { mgpu::ops::layer_norm(x, gamma, beta, y, stats, 1e-5f, env.stream); });
  only(F::attention, [&] { mgpu::ops::causal_attention(qkv, out, lse, 2, env.stream); });
  only(F::elementwise, [&] { mgpu::ops::add_scaled(y, x, 0.5f, env.stream); });
  only(F::activation, [&] { mgpu::ops::gelu(x, y, env.stream); });
  CHECK(std::string(mgpu::ops::host_op_family_name(F::optimizer)) == "optimizer");
  for (double s : mgpu::ops::host_op_seconds().seconds) CHECK(s == 0.0);  // this thread ran none
}

TEST_CASE("Host GEMM over more shapes than its per-thread cache holds, twice: evicted primitives come back right", "[ops][gemm]") {
  Env env;
  for (int pass = 0; pass < 2; ++pass) {
    for (std::int64_t m = 1; m <= 80; ++m) {  // 80 shapes, beyond the 64 cached per thread
      INFO("pass " << pass << " m " << m);
      Tensor a = env.random({m, 9}, static_cast<unsigned>(m));
      Tensor b = env.random({9, 5}, 100);
      Tensor c = Tensor::empty({m, 5}, DType::float32, *env.allocator);
      mgpu::ops::gemm(a, false, b, false, c, 1.0f, 0.0f, env.stream);
      env.stream.synchronize();
      auto const as = as_double(a);
      auto const bs = as_double(b);
      auto const cs = as_double(c);
      for (std::int64_t i = 0; i < m; ++i) {
        for (std::int64_t j = 0; j < 5; ++j) {
          double acc = 0;
          for (std::int64_t p = 0; p < 9; ++p) acc += as[static_cast<std::size_t>(i * 9 + p)] * bs[static_cast<std::size_t>(p * 5 + j)];
          REQUIRE(cs[static_cast<std::size_t>(i * 5 + j)] == Approx(acc).margin(1e-5));
        }
      }
    }
  }
}
