// bench_train: one training step (forward, softmax cross-entropy, backward, fused SGD-momentum
// update, which classification_step applies per layer during backward) of an MLP 784-1024-1024-10
// at batch 256 in float32 on one host device (one worker thread), against the same step's GEMMs
// alone through Eigen (same shapes and FLOPs) and against the whole step written by hand in Eigen,
// all on the same thread in the same run (blocks of four runs each, in turn). Counters (medians
// over turns):
//   samples_per_s          training throughput;
//   gemm_roofline_frac     GEMM-only time / step time: everything that is not a GEMM (bias,
//                          activations, loss, the update, the library's overhead) costs 1 - this;
//   gemm_gflops            the GEMM-only pass's rate, for reference;
//   eigen_step_gemm_frac   GEMM-only time / the bare Eigen step's time (EigenStep below): the same
//                          fraction for hand-written Eigen code on this machine at this time;
//   eigen_step_time_ratio  the bare Eigen step's time / the library's step time (> 1: faster).
// With a GPU, BM_train_step_cuda reports samples_per_s of the same step on cuda:0.
//
//   bench_train --benchmark_out=train.json --benchmark_out_format=json
#include <benchmark/benchmark.h>

#include <Eigen/Core>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <vector>

#include <mgpu/mgpu.hpp>

namespace {

using Clock = std::chrono::steady_clock;
using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

constexpr std::int64_t batch = 256;
std::vector<std::int64_t> const widths = {784, 1024, 1024, 10};

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

// The step's GEMMs through Eigen alone: forward y = x W per layer, backward dW = x^T dy per layer
// and dx = dy W^T for every layer but the first.
struct GemmOnly {
  std::vector<Matrix> w, dw, act, grad;
  GemmOnly() {
    act.emplace_back(Matrix::Random(batch, widths[0]));
    for (std::size_t l = 0; l + 1 < widths.size(); ++l) {
      w.emplace_back(Matrix::Random(widths[l], widths[l + 1]));
      dw.emplace_back(widths[l], widths[l + 1]);
      act.emplace_back(batch, widths[l + 1]);
      grad.emplace_back(Matrix::Random(batch, widths[l + 1]));
    }
  }
  void run() {
    for (std::size_t l = 0; l < w.size(); ++l) act[l + 1].noalias() = act[l] * w[l];
    for (std::size_t l = w.size(); l-- > 0;) {
      dw[l].noalias() = act[l].transpose() * grad[l];
      if (l > 0) grad[l - 1].noalias() = grad[l] * w[l].transpose();
    }
  }
  [[nodiscard]] double flops() const {
    double f = 0;
    for (std::size_t l = 0; l < w.size(); ++l) f += 2.0 * batch * static_cast<double>(widths[l] * widths[l + 1]) * (l > 0 ? 3 : 2);
    return f;
  }
};

// The same training step written directly in Eigen, without the library: forward with bias and
// ReLU, softmax cross-entropy, backward, then SGD-momentum over each weight and bias. It is the
// reference for what a step costs beyond its GEMMs on this machine at the time of the run.
struct EigenStep {
  std::vector<Matrix> w, dw, vw, act, grad;
  std::vector<Eigen::RowVectorXf> b, db, vb;
  float const* x = nullptr;       // [rows, widths.front()]
  float const* labels = nullptr;  // [rows]
  EigenStep(float const* features, float const* classes) : x(features), labels(classes) {
    act.emplace_back(batch, widths[0]);
    for (std::size_t l = 0; l + 1 < widths.size(); ++l) {
      w.emplace_back(Matrix::Random(widths[l], widths[l + 1]) * std::sqrt(6.0f / static_cast<float>(widths[l])));
      dw.emplace_back(widths[l], widths[l + 1]);
      vw.emplace_back(Matrix::Zero(widths[l], widths[l + 1]));
      b.emplace_back(Eigen::RowVectorXf::Zero(widths[l + 1]));
      db.emplace_back(widths[l + 1]);
      vb.emplace_back(Eigen::RowVectorXf::Zero(widths[l + 1]));
      act.emplace_back(batch, widths[l + 1]);
      grad.emplace_back(batch, widths[l + 1]);
    }
  }
  void run(std::int64_t first_row) {
    act[0] = Eigen::Map<Matrix const>(x + first_row * widths[0], batch, widths[0]);
    std::size_t const last = w.size() - 1;
    for (std::size_t l = 0; l <= last; ++l) {
      act[l + 1].noalias() = act[l] * w[l];
      act[l + 1].rowwise() += b[l];
      if (l < last) act[l + 1] = act[l + 1].cwiseMax(0.0f);
    }
    Matrix& logits = act.back();
    for (std::int64_t r = 0; r < batch; ++r) {  // d loss / d logits = (softmax - onehot) / batch
      auto row = logits.row(r);
      Eigen::RowVectorXf const e = (row.array() - row.maxCoeff()).exp().matrix();
      grad[last].row(r) = e / (e.sum() * static_cast<float>(batch));
      grad[last](r, static_cast<Eigen::Index>(labels[first_row + r])) -= 1.0f / static_cast<float>(batch);
    }
    for (std::size_t l = last + 1; l-- > 0;) {
      dw[l].noalias() = act[l].transpose() * grad[l];
      db[l] = grad[l].colwise().sum();
      if (l > 0) {
        grad[l - 1].noalias() = grad[l] * w[l].transpose();
        grad[l - 1] = (act[l].array() > 0.0f).select(grad[l - 1], 0.0f);
      }
    }
    for (std::size_t l = 0; l <= last; ++l) {
      vw[l] = 0.9f * vw[l] + dw[l];
      w[l] -= 0.01f * vw[l];
      vb[l] = 0.9f * vb[l] + db[l];
      b[l] -= 0.01f * vb[l];
    }
  }
};

struct Trainer {
  mgpu::Device device;
  std::shared_ptr<mgpu::Allocator> allocator = mgpu::Allocator::create(device);
  mgpu::Stream stream{device};
  mgpu::nn::Context ctx{*allocator, stream};
  mgpu::nn::Sequential model = mgpu::nn::Sequential::mlp(widths);
  mgpu::optim::SGD sgd{{.lr = 0.01f, .momentum = 0.9f}};
  mgpu::Tensor x, y;
  std::int64_t next = 0;
  // Batches cycle through heavily overlapping clusters, so the loss stays high as in real training:
  // one batch learned by heart drives the gradients into float32 denormals, which are far slower.
  static constexpr std::int64_t batches = 16;
  explicit Trainer(mgpu::Device d) : device(d) {
    model.materialize(ctx, 1);
    auto host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
    auto data = mgpu::data::make_clusters(batches * batch, widths.front(), widths.back(), 3, 0.05f);
    mgpu::Tensor hx = mgpu::Tensor::empty({batches * batch, widths.front()}, mgpu::DType::float32, *host);
    mgpu::Tensor hy = mgpu::Tensor::empty({batches * batch}, mgpu::DType::float32, *host);
    std::copy(data.feature_data().begin(), data.feature_data().end(), hx.host_span<float>().begin());
    std::copy(data.labels().begin(), data.labels().end(), hy.host_span<float>().begin());
    x = mgpu::Tensor::empty(hx.shape(), mgpu::DType::float32, *allocator);
    y = mgpu::Tensor::empty(hy.shape(), mgpu::DType::float32, *allocator);
    mgpu::copy_async(x, hx, stream);
    mgpu::copy_async(y, hy, stream);
    stream.synchronize();
  }
  void step() {
    std::int64_t const b = next++ % batches;
    mgpu::nn::classification_step(model, sgd, x.slice(b * batch, (b + 1) * batch), y.slice(b * batch, (b + 1) * batch), ctx);
    stream.synchronize();
  }
};

void BM_train_step_vs_gemm(benchmark::State& state) {
  Trainer trainer({mgpu::DeviceKind::host, 0});
  GemmOnly gemm;
  trainer.step();  // warm the allocator's cache and the optimizer state
  gemm.run();
  EigenStep eigen(trainer.x.host_span<float>().data(), trainer.y.host_span<float>().data());
  std::vector<double> step_s;
  std::vector<double> gemm_s;
  std::vector<double> ratios;
  std::vector<double> eigen_ratios;
  std::vector<double> vs_eigen;
  // Blocks of a few steps, of GEMM-only passes and of bare Eigen steps, in turn on the same host
  // stream (so on the same worker thread): within a block each run follows one of its kind, as in
  // a training loop, and each turn of three blocks sees one machine speed, so the medians of
  // per-turn ratios are robust to the noise of a shared machine.
  constexpr int block = 4;
  auto const per_run = [](auto&& fn) {
    auto const t0 = Clock::now();
    for (int i = 0; i < block; ++i) fn();
    return std::chrono::duration<double>(Clock::now() - t0).count() / block;
  };
  std::int64_t eigen_batch = 0;
  for (auto _ : state) {
    step_s.push_back(per_run([&] { trainer.step(); }));
    gemm_s.push_back(per_run([&] {
      trainer.stream.enqueue([&] { gemm.run(); });
      trainer.stream.synchronize();
    }));
    double const eigen_s = per_run([&] {
      std::int64_t const first_row = (eigen_batch++ % Trainer::batches) * batch;
      trainer.stream.enqueue([&] { eigen.run(first_row); });
      trainer.stream.synchronize();
    });
    ratios.push_back(gemm_s.back() / step_s.back());
    eigen_ratios.push_back(gemm_s.back() / eigen_s);
    vs_eigen.push_back(eigen_s / step_s.back());
    benchmark::DoNotOptimize(gemm.dw.front().data());
  }
  double const step = median(step_s);
  double const g = median(gemm_s);
  state.counters["samples_per_s"] = batch / step;
  state.counters["steps_timed"] = static_cast<double>(block * step_s.size());
  state.counters["gemm_roofline_frac"] = median(ratios);
  state.counters["eigen_step_gemm_frac"] = median(eigen_ratios);
  state.counters["eigen_step_time_ratio"] = median(vs_eigen);
  state.counters["step_ms"] = step * 1e3;
  state.counters["gemm_ms"] = g * 1e3;
  state.counters["gemm_gflops"] = gemm.flops() / g * 1e-9;
}
BENCHMARK(BM_train_step_vs_gemm)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(8.0);

void BM_train_step_cuda(benchmark::State& state) {
  if (mgpu::cuda_device_count() == 0) {
    state.SkipWithError("no CUDA GPU visible");
    return;
  }
  Trainer trainer({mgpu::DeviceKind::cuda, 0});
  trainer.step();
  std::vector<double> step_s;
  for (auto _ : state) {
    auto const t0 = Clock::now();
    trainer.step();
    step_s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  state.counters["samples_per_s"] = batch / median(step_s);
}
BENCHMARK(BM_train_step_cuda)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
