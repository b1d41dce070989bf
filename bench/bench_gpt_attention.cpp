// bench_gpt's host attention rows (run by bench_gpt; see bench_gpt.cpp for the others):
//   BM_attention/<shape>/<queries>/<keys>: causal attention forward + backward alone on that
//   shape's qkv, in tiles of `queries` query rows x `keys` keys (ops::set_host_attention_tiles;
//   0/0: the library's choice per shape, the rows the choice is read from follow it):
//     online_ms               ops::causal_attention + causal_attention_backward (tiled online
//                             softmax, per-row log-sum-exp kept);
//     gflops                  attention's floating-point work (7 products over the visible
//                             (query, key) pairs, as in step_gflop) / online_ms;
//     sgemm_gflops            the same run's 512³ sgemm (as BM_gpt_step's), timed after each turn;
//     gflops_over_sgemm       gflops / sgemm_gflops per turn (median);
//     sgemm_same_shapes_gflops  the same run's sgemm on attention's own products: the library's
//                             host GEMM (ops::gemm, one call per product) on each (sequence, head)'s
//                             Q Kᵀ and P V ([T, d] x [d, T], [T, T] x [T, d]) and the backward's Q Kᵀ,
//                             dY Vᵀ, Pᵀ dY, dSᵀ Q and dS K, dense (2 T² d each), timed after each turn;
//     gflops_over_sgemm_same_shapes  gflops / sgemm_same_shapes_gflops per turn (median): attention's
//                             rate (its causal FLOPs, as gflops counts them) against the dense GEMMs'
//                             on the same shapes; the same as the dense GEMMs' time scaled to the
//                             causal FLOPs over online_ms;
//     online_extra_bytes      the per-row log-sum-exp the online path keeps;
//   and for the library's choice, timed in turn with the same through the whole [B, H, T, T]
//   probability matrix (Eigen GEMMs per head, softmax over full rows):
//     naive_tt_ms, naive_tt_time_ratio (naive_tt_ms / online_ms per turn: > 1, the online path
//                             is faster), naive_tt_extra_bytes (the naive path's P and dP),
//     max_abs_diff_y          max |y_online - y_naive| (a check that both compute the same thing).
//
#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

#include <benchmark/benchmark.h>

#include <mgpu/mgpu.hpp>
#include <mgpu/ops/transformer.hpp>

#include "bench_gpt_support.hpp"

namespace {

using namespace bench::gpt;

// Causal attention through the whole [B, H, T, T] probability matrix: the path the online softmax
// replaces. Forward S = q kᵀ / sqrt(d) masked, P = softmax(S), y = P v; backward dP = dy vᵀ,
// dS = P (dP - rowsum(P dP)), dq = dS k / sqrt(d), dk = dSᵀ q / sqrt(d), dv = Pᵀ dy.
struct NaiveAttention {
  std::int64_t batch, t, c, heads;
  std::vector<float> p, dp;  // [B, H, T, T]
  NaiveAttention(std::int64_t b, std::int64_t t_, std::int64_t c_, std::int64_t h)
      : batch(b), t(t_), c(c_), heads(h), p(static_cast<std::size_t>(b * h * t_ * t_)), dp(p.size()) {}
  [[nodiscard]] std::int64_t d() const { return c / heads; }
  Map part(float* base, std::int64_t b, std::int64_t h, std::int64_t which, std::int64_t width) const {
    return {base + b * t * width + which * c + h * d(), t, d(), Stride(width)};
  }
  Map probs(std::vector<float>& m, std::int64_t b, std::int64_t h) const {
    return {m.data() + (b * heads + h) * t * t, t, t, Stride(t)};
  }
  void forward(float* qkv, float* y) {
    float const scale = 1.0f / std::sqrt(static_cast<float>(d()));
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t h = 0; h < heads; ++h) {
        Map s = probs(p, b, h);
        s.noalias() = part(qkv, b, h, 0, 3 * c) * part(qkv, b, h, 1, 3 * c).transpose() * scale;
        for (std::int64_t i = 0; i < t; ++i) {
          float const max = s.row(i).head(i + 1).maxCoeff();
          s.row(i).head(i + 1) = (s.row(i).head(i + 1).array() - max).exp();
          s.row(i).head(i + 1) /= s.row(i).head(i + 1).sum();
          s.row(i).tail(t - i - 1).setZero();
        }
        part(y, b, h, 0, c).noalias() = s * part(qkv, b, h, 2, 3 * c);
      }
  }
  void backward(float* qkv, float* dy, float* dqkv) {
    float const scale = 1.0f / std::sqrt(static_cast<float>(d()));
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t h = 0; h < heads; ++h) {
        Map const s = probs(p, b, h);
        Map ds = probs(dp, b, h);
        ds.noalias() = part(dy, b, h, 0, c) * part(qkv, b, h, 2, 3 * c).transpose();
        for (std::int64_t i = 0; i < t; ++i) {
          float const row = s.row(i).dot(ds.row(i));
          ds.row(i) = s.row(i).array() * (ds.row(i).array() - row) * scale;
        }
        part(dqkv, b, h, 0, 3 * c).noalias() = ds * part(qkv, b, h, 1, 3 * c);
        part(dqkv, b, h, 1, 3 * c).noalias() = ds.transpose() * part(qkv, b, h, 0, 3 * c);
        part(dqkv, b, h, 2, 3 * c).noalias() = s.transpose() * part(dy, b, h, 0, c);
      }
  }
};

// The library's host GEMM on attention's own products, per (sequence, head), over B H of them:
// forward S = Q Kᵀ and Y = P V, backward S again, dP = dY Vᵀ, dV = Pᵀ dY, dK = dSᵀ Q, dQ = dS K, each
// a dense product (no mask) through ops::gemm on contiguous per-head matrices, run on this thread
// (a Stream::InlineScope: no handoff to the worker per call).
struct SameShapeSgemm {
  std::int64_t count, t, d;
  mgpu::Tensor q, k, v, dy, p, ds, out_tt, out_td;  // [count, T, d] or [count, T, T]
  std::vector<std::array<mgpu::Tensor, 8>> views;   // per head: the tensors above as 2-D matrices
  SameShapeSgemm(mgpu::Allocator& allocator, std::int64_t count_, std::int64_t t_, std::int64_t d_)
      : count(count_), t(t_), d(d_) {
    std::mt19937 rng(5);
    std::normal_distribution<float> n(0.0f, 1.0f);
    auto const make = [&](std::int64_t cols) {
      mgpu::Tensor x = mgpu::Tensor::empty({count, t, cols}, mgpu::DType::float32, allocator);
      for (float& e : x.host_span<float>()) e = n(rng);
      return x;
    };
    q = make(d), k = make(d), v = make(d), dy = make(d), p = make(t), ds = make(t), out_tt = make(t), out_td = make(d);
    for (std::int64_t i = 0; i < count; ++i) {
      std::array<mgpu::Tensor, 8> m;
      mgpu::Tensor const* all[] = {&q, &k, &v, &dy, &p, &ds, &out_tt, &out_td};
      for (std::size_t j = 0; j < m.size(); ++j) {
        mgpu::Tensor const& x = *all[j];
        m[j] = x.slice(i, i + 1).reshape({t, x.shape()[2]});
      }
      views.push_back(std::move(m));
    }
  }
  [[nodiscard]] double flops() const { return 7.0 * 2.0 * static_cast<double>(t * t * d * count); }
  double seconds(mgpu::Stream& stream) {
    mgpu::Stream::InlineScope const inline_here(stream);
    auto const t0 = Clock::now();
    for (auto const& [q_, k_, v_, dy_, p_, ds_, tt, td] : views) {
      mgpu::ops::gemm(q_, false, k_, true, tt, 1.0f, 0.0f, stream);    // S
      mgpu::ops::gemm(p_, false, v_, false, td, 1.0f, 0.0f, stream);   // Y
      mgpu::ops::gemm(q_, false, k_, true, tt, 1.0f, 0.0f, stream);    // S, backward
      mgpu::ops::gemm(dy_, false, v_, true, tt, 1.0f, 0.0f, stream);   // dP
      mgpu::ops::gemm(p_, true, dy_, false, td, 1.0f, 0.0f, stream);   // dV
      mgpu::ops::gemm(ds_, true, q_, false, td, 1.0f, 0.0f, stream);   // dK
      mgpu::ops::gemm(ds_, false, k_, false, td, 1.0f, 0.0f, stream);  // dQ
    }
    stream.synchronize();
    return seconds_since(t0);
  }
};

void BM_attention(benchmark::State& state) {
  Shape const& shape = shapes[state.range(0)];
  mgpu::ops::AttentionTiles const tiles{state.range(1), state.range(2)};
  bool const chosen = tiles.queries == 0;  // the library's choice: also timed against the naive path
  std::int64_t const batch = shape.batch, t = shape.config.block_size, c = shape.config.n_embd,
                     heads = shape.config.n_head;
  mgpu::Device const device{mgpu::DeviceKind::host, 0};
  auto allocator = mgpu::Allocator::create(device);
  mgpu::Stream stream{device};
  auto tensor = [&](mgpu::Shape s, float stddev) {
    mgpu::Tensor x = mgpu::Tensor::empty(std::move(s), mgpu::DType::float32, *allocator);
    std::mt19937 rng(static_cast<unsigned>(x.numel()));
    std::normal_distribution<float> n(0.0f, stddev);
    for (float& v : x.host_span<float>()) v = n(rng);
    return x;
  };
  mgpu::Tensor const qkv = tensor({batch, t, 3 * c}, 1.0f);
  mgpu::Tensor const dy = tensor({batch, t, c}, 1.0f);
  mgpu::Tensor const y = tensor({batch, t, c}, 0.0f);
  mgpu::Tensor const dqkv = tensor({batch, t, 3 * c}, 0.0f);
  mgpu::Tensor const lse = mgpu::Tensor::empty({batch, heads, t}, mgpu::DType::float32, *allocator);
  NaiveAttention naive(chosen ? batch : 0, t, c, heads);
  std::vector<float> naive_y(static_cast<std::size_t>(batch * t * c)), naive_dqkv(static_cast<std::size_t>(qkv.numel()));
  Sgemm sgemm(*allocator);
  SameShapeSgemm same_shapes(*allocator, batch * heads, t, c / heads);
  mgpu::ops::set_host_attention_tiles(tiles);
  auto online = [&] {
    mgpu::ops::causal_attention(qkv, y, lse, heads, stream);
    mgpu::ops::causal_attention_backward(qkv, y, lse, dy, dqkv, heads, stream);
    stream.synchronize();
  };
  auto reference = [&] {  // on the stream's worker too, so both run on one thread in turn
    stream.enqueue([&] {
      naive.forward(qkv.host_span<float>().data(), naive_y.data());
      naive.backward(qkv.host_span<float>().data(), dy.host_span<float>().data(), naive_dqkv.data());
    });
    stream.synchronize();
  };
  online();
  if (chosen) reference();
  (void)sgemm.seconds(stream);
  (void)same_shapes.seconds(stream);  // its primitives, on this thread
  double const flops = attention_flops({.block_size = t, .n_layer = 1, .n_head = heads, .n_embd = c}, batch);
  std::vector<double> online_s, naive_s, ratio, sgemm_ratio, sgemm_s, same_shapes_ratio, same_shapes_s;
  for (auto _ : state) {
    auto t0 = Clock::now();
    online();
    online_s.push_back(seconds_since(t0));
    state.PauseTiming();
    sgemm_s.push_back(sgemm.seconds(stream));  // in turn: the same load
    sgemm_ratio.push_back(flops / online_s.back() / (Sgemm::flops() / sgemm_s.back()));
    same_shapes_s.push_back(same_shapes.seconds(stream));
    same_shapes_ratio.push_back(flops / online_s.back() / (same_shapes.flops() / same_shapes_s.back()));
    state.ResumeTiming();
    if (!chosen) continue;
    t0 = Clock::now();
    reference();
    naive_s.push_back(seconds_since(t0));
    ratio.push_back(naive_s.back() / online_s.back());
  }
  mgpu::ops::set_host_attention_tiles({});
  state.SetLabel(std::string(shape.name) +
                 (chosen ? ", the library's tiles"
                         : ", tiles " + std::to_string(tiles.queries) + " x " + std::to_string(tiles.keys)));
  state.counters["online_ms"] = median(online_s) * 1e3;
  state.counters["gflops"] = flops / median(online_s) / 1e9;
  state.counters["sgemm_gflops"] = Sgemm::flops() / median(sgemm_s) / 1e9;
  state.counters["gflops_over_sgemm"] = median(sgemm_ratio);
  state.counters["sgemm_same_shapes_gflops"] = same_shapes.flops() / median(same_shapes_s) / 1e9;
  state.counters["gflops_over_sgemm_same_shapes"] = median(same_shapes_ratio);
  state.counters["online_extra_bytes"] = static_cast<double>(lse.numel() * 4);
  if (!chosen) return;
  float max_diff = 0.0f;
  auto const got = y.host_span<float>();
  for (std::size_t i = 0; i < naive_y.size(); ++i) max_diff = std::max(max_diff, std::abs(got[i] - naive_y[i]));
  state.counters["naive_tt_ms"] = median(naive_s) * 1e3;
  state.counters["naive_tt_time_ratio"] = median(ratio);
  state.counters["naive_tt_extra_bytes"] = static_cast<double>(2 * naive.p.size() * sizeof(float));
  state.counters["max_abs_diff_y"] = max_diff;
}
BENCHMARK(BM_attention)->Args({0, 0, 0})->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(bench::min_time(3.0));
BENCHMARK(BM_attention)->Args({1, 0, 0})->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(bench::min_time(3.0));
// The tiles the choice was measured among (queries x keys).
BENCHMARK(BM_attention)
    ->ArgsProduct({{0, 1}, {16, 32, 64, 128}, {32, 64, 128, 256}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MinTime(bench::min_time(1.0));

}  // namespace
