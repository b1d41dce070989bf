// bench_train: one training step (forward, softmax cross-entropy, backward, fused SGD-momentum
// update, which classification_step applies per layer during backward) of an MLP 784-1024-1024-10
// at batch 256 in float32 on one host device (one worker thread), against the same step's GEMMs
// alone through Eigen (same shapes and FLOPs) on the same thread, timed alternately in the same
// run. Counters (medians):
//   samples_per_s       training throughput;
//   gemm_roofline_frac  GEMM-only time / full step time (the median of adjacent pairs): everything
//                       that is not a GEMM (bias, activations, loss, the update, the library's
//                       overhead) costs 1 - this;
//   gemm_gflops         the GEMM-only pass's rate, for reference.
// With a GPU, BM_train_step_cuda reports samples_per_s of the same step on cuda:0.
//
//   bench_train --benchmark_out=train.json --benchmark_out_format=json
#include <benchmark/benchmark.h>

#include <Eigen/Core>

#include <algorithm>
#include <chrono>
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
  std::vector<double> step_s;
  std::vector<double> gemm_s;
  std::vector<double> ratios;
  // A step, then a GEMM-only pass on the same host stream (so on the same worker thread), in
  // alternation: both are timed warm (their working sets evict each other from the caches), and
  // each pair sees the same machine speed, so the median of the per-pair ratios is robust to the
  // noise of a shared machine.
  auto const seconds = [](auto&& fn) {
    auto const t0 = Clock::now();
    fn();
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  for (auto _ : state) {
    step_s.push_back(seconds([&] { trainer.step(); }));
    gemm_s.push_back(seconds([&] {
      trainer.stream.enqueue([&] { gemm.run(); });
      trainer.stream.synchronize();
    }));
    ratios.push_back(gemm_s.back() / step_s.back());
    benchmark::DoNotOptimize(gemm.dw.front().data());
  }
  double const step = median(step_s);
  double const g = median(gemm_s);
  state.counters["samples_per_s"] = batch / step;
  state.counters["steps_timed"] = static_cast<double>(step_s.size());
  state.counters["gemm_roofline_frac"] = median(ratios);
  state.counters["step_ms"] = step * 1e3;
  state.counters["gemm_ms"] = g * 1e3;
  state.counters["gemm_gflops"] = gemm.flops() / g * 1e-9;
}
BENCHMARK(BM_train_step_vs_gemm)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(3.0);

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
