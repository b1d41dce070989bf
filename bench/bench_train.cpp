// bench_train: one training step (forward, softmax cross-entropy, backward, fused SGD-momentum
// update, which classification_step applies per layer during backward) of an MLP 784-1024-1024-10
// at batch 256 on one host device (one worker thread), in blocks of four steps taken in turn with
// the baselines below, all on the same worker thread in the same run. Counters (medians over turns):
//   BM_train_step_vs_gemm (float32; its label names the host GEMM backend):
//     samples_per_s          training throughput;
//     step_gemm_gflops       the rate of the library's own GEMM calls inside the timed steps
//                            (ops::host_gemm_stats: their flops over the time spent in them);
//     step_gemm_share        the time in those GEMM calls / the step's time;
//     sgemm_gflops           a standalone single-thread sgemm over the step's GEMM shapes (the same
//                            calls, transposes included): oneDNN's dnnl_sgemm in oneDNN builds, Eigen's
//                            product in Eigen builds;
//     step_gemm_vs_sgemm     step_gemm_gflops / sgemm_gflops, per turn;
//     eigen_step_time_ratio  the same step written by hand in Eigen (EigenStep below): its time / the
//                            library's step time (> 1: the library is faster).
//   BM_train_step_bf16: samples_per_s of the bfloat16-compute step (float32 masters), its
//     step_gemm_share, and vs_float32, its speed over the float32 step's, per turn.
// With a GPU, BM_train_step_cuda reports samples_per_s of the same step on cuda:0.
//
//   bench_train --benchmark_out=train.json --benchmark_out_format=json
#include <benchmark/benchmark.h>
#include <dirent.h>

#include <Eigen/Core>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <mgpu/config.hpp>
#include <mgpu/mgpu.hpp>

#include "bench_support.hpp"

#if MGPU_HOST_GEMM_ONEDNN
#include <oneapi/dnnl/dnnl.h>
#endif


namespace {

using Clock = std::chrono::steady_clock;
using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

constexpr std::int64_t batch = 256;
std::vector<std::int64_t> const widths = {784, 1024, 1024, 10};

// The process's thread count.
int thread_count() {
  int n = 0;
  if (DIR* dir = opendir("/proc/self/task")) {
    while (dirent const* e = readdir(dir)) n += e->d_name[0] != '.';
    closedir(dir);
  }
  return n;
}

using bench::median;

// The step's GEMMs, shape for shape as the library calls them, through a standalone single-thread
// sgemm: forward x W per layer, backward dW = x^T dz per layer and dx = dz W^T for every layer but
// the first. It runs on the trainer's worker thread, where the library's first GEMM has limited
// oneDNN to that thread (BM_train_step_vs_gemm checks that no thread was started).
class SgemmReference {
 public:
  SgemmReference() {
    for (std::size_t l = 0; l + 1 < widths.size(); ++l) {
      add(batch, widths[l + 1], widths[l], false, false);
      add(widths[l], widths[l + 1], batch, true, false);
      if (l > 0) add(batch, widths[l], widths[l + 1], false, true);
    }
  }
  void run() {
    for (Call& g : calls_) {
#if MGPU_HOST_GEMM_ONEDNN
      dnnl_sgemm(g.ta ? 'T' : 'N', g.tb ? 'T' : 'N', g.m, g.n, g.k, 1.0f, g.a.data(), g.ta ? g.m : g.k, g.b.data(), g.tb ? g.k : g.n, 0.0f,
                 g.c.data(), g.n);
#else
      Eigen::Map<Matrix const> const a(g.a.data(), g.ta ? g.k : g.m, g.ta ? g.m : g.k);
      Eigen::Map<Matrix const> const b(g.b.data(), g.tb ? g.n : g.k, g.tb ? g.k : g.n);
      Eigen::Map<Matrix> c(g.c.data(), g.m, g.n);
      if (g.ta) c.noalias() = a.transpose() * b;
      else if (g.tb) c.noalias() = a * b.transpose();
      else c.noalias() = a * b;
#endif
    }
  }
  [[nodiscard]] double flops() const {
    double f = 0;
    for (Call const& g : calls_) f += 2.0 * static_cast<double>(g.m * g.n * g.k);
    return f;
  }
  [[nodiscard]] float const* output() const { return calls_.front().c.data(); }

 private:
  struct Call {
    std::int64_t m, n, k;
    bool ta, tb;
    std::vector<float> a, b, c;
  };
  void add(std::int64_t m, std::int64_t n, std::int64_t k, bool ta, bool tb) {
    std::mt19937 rng(static_cast<unsigned>(calls_.size()));
    std::uniform_real_distribution<float> u(-1, 1);
    auto random = [&](std::int64_t count) {
      std::vector<float> v(static_cast<std::size_t>(count));
      for (float& x : v) x = u(rng);
      return v;
    };
    calls_.push_back({m, n, k, ta, tb, random(m * k), random(k * n), std::vector<float>(static_cast<std::size_t>(m * n))});
  }
  std::vector<Call> calls_;
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
  explicit Trainer(mgpu::Device d, mgpu::DType compute = mgpu::DType::float32) : device(d) {
    model.materialize(ctx, 1, compute);
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

// Seconds per run of fn, over a block of `block` runs.
constexpr int block = 4;
template <class Fn>
double per_run(Fn&& fn) {
  auto const t0 = Clock::now();
  for (int i = 0; i < block; ++i) fn();
  return std::chrono::duration<double>(Clock::now() - t0).count() / block;
}

void BM_train_step_vs_gemm(benchmark::State& state) {
  Trainer trainer({mgpu::DeviceKind::host, 0});
  SgemmReference sgemm;
  trainer.step();  // warm the allocator's cache, the optimizer state and the GEMM primitives
  int const threads = thread_count();
  trainer.stream.enqueue([&] { sgemm.run(); });
  trainer.stream.synchronize();
  if (thread_count() != threads) {
    state.SkipWithError("the standalone sgemm started threads (expected it on the worker thread alone)");
    return;
  }
  EigenStep eigen(trainer.x.host_span<float>().data(), trainer.y.host_span<float>().data());
  std::vector<double> step_s, gemm_gflops, gemm_share, sgemm_gflops, vs_sgemm, vs_eigen;
  // Blocks of steps, of standalone sgemm passes and of bare Eigen steps, in turn on the same host
  // stream (so on the same worker thread): within a block each run follows one of its kind, as in
  // a training loop, and each turn sees one machine speed, so the medians of per-turn ratios are
  // robust to the noise of a shared machine.
  std::int64_t eigen_batch = 0;
  for (auto _ : state) {
    mgpu::ops::HostGemmStats const before = bench::host_gemm_stats(trainer.stream);
    step_s.push_back(per_run([&] { trainer.step(); }));
    mgpu::ops::HostGemmStats const after = bench::host_gemm_stats(trainer.stream);
    double const gemm_s = (after.seconds - before.seconds) / block;
    gemm_gflops.push_back((after.flops - before.flops) / block / gemm_s * 1e-9);
    gemm_share.push_back(gemm_s / step_s.back());
    double const sgemm_s = per_run([&] {
      trainer.stream.enqueue([&] { sgemm.run(); });
      trainer.stream.synchronize();
    });
    sgemm_gflops.push_back(sgemm.flops() / sgemm_s * 1e-9);
    vs_sgemm.push_back(gemm_gflops.back() / sgemm_gflops.back());
    double const eigen_s = per_run([&] {
      std::int64_t const first_row = (eigen_batch++ % Trainer::batches) * batch;
      trainer.stream.enqueue([&] { eigen.run(first_row); });
      trainer.stream.synchronize();
    });
    vs_eigen.push_back(eigen_s / step_s.back());
    benchmark::DoNotOptimize(sgemm.output());
  }
  double const step = median(step_s);
  state.SetLabel(std::string("host GEMM: ") + mgpu::host_gemm_backend);
  state.counters["samples_per_s"] = batch / step;
  state.counters["steps_timed"] = static_cast<double>(block * step_s.size());
  state.counters["step_ms"] = step * 1e3;
  state.counters["step_gemm_gflops"] = median(gemm_gflops);
  state.counters["step_gemm_share"] = median(gemm_share);
  state.counters["sgemm_gflops"] = median(sgemm_gflops);
  state.counters["step_gemm_vs_sgemm"] = median(vs_sgemm);
  state.counters["eigen_step_time_ratio"] = median(vs_eigen);
}
BENCHMARK(BM_train_step_vs_gemm)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(bench::min_time(8.0));

void BM_train_step_bf16(benchmark::State& state) {
  Trainer f32({mgpu::DeviceKind::host, 0});
  Trainer bf16({mgpu::DeviceKind::host, 0}, mgpu::DType::bfloat16);
  f32.step();
  bf16.step();
  std::vector<double> step_s, gemm_share, ratios;
  for (auto _ : state) {
    mgpu::ops::HostGemmStats const before = bench::host_gemm_stats(bf16.stream);
    step_s.push_back(per_run([&] { bf16.step(); }));
    gemm_share.push_back((bench::host_gemm_stats(bf16.stream).seconds - before.seconds) / block / step_s.back());
    ratios.push_back(per_run([&] { f32.step(); }) / step_s.back());
  }
  state.SetLabel(std::string("host GEMM: ") + mgpu::host_gemm_backend);
  state.counters["samples_per_s"] = batch / median(step_s);
  state.counters["step_gemm_share"] = median(gemm_share);
  state.counters["vs_float32"] = median(ratios);
}
BENCHMARK(BM_train_step_bf16)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(bench::min_time(6.0));

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
