// bench_data_parallel: DataParallel training steps of an MLP 784-1024-1024-10 at global batch 256
// in float32 on 1, 2 and 4 host devices, with the bucketed all-reduce overlapped with backward and
// without. Blocks of steps on one device and on N devices are timed in turn, so each ratio is
// taken at one machine speed; counters are medians over turns:
//   samples_per_s     N-device training throughput;
//   speedup_vs_1      N-device samples/s ÷ the same step on one host device, the block before;
//   comm_wait_frac    time a rank waits for its reduces after backward ÷ its step time (mean
//                     over ranks): what the overlap did not hide;
//   independent_speedup_vs_1  N single-device trainers at once, each on its own thread and 1/N of
//                     every batch, with no communication at all, ÷ the one-device step: what this
//                     machine gives N ranks before any synchronization (the peer to compare with);
//   speedup_vs_independent    data parallel's step rate ÷ those independent trainers'.
// Rows run with the sharded update (shard:1, the default) and with every replica updating all.
// BM_rebalance trains with `rebalance` on host:2@speed=1,0.5 (the second device's work stretched
// to twice its time) from even weights, on the measured compute times: rows_fast_to_slow is the
// first rank's rows ÷ the second's over the last 8 of 24 steps (about 2, somewhat more where fixed
// per-step costs are stretched too), rows_fast_to_slow_first_step the 1:1 it started from.
// With a GPU, BM_cuda_data_parallel times the same steps on cuda:0 and on 2 and 4 logical devices
// sharing it (the cuda_peer all-reduce between them): samples_per_s, speedup_vs_1 (at most 1 on
// one GPU: what splitting the batch and the all-reduce cost) and comm_wait_frac.
// BM_timeline_record and BM_timeline_stream_span give the tracing cost per recorded span (a
// host-side record, and the two marker tasks a stream span adds), on and off.
// Host devices are one worker thread each: on a 2-core machine host:4 shares two cores between
// four ranks, so its speedup is bounded by 2.
//
//   bench_data_parallel --benchmark_out=dp.json --benchmark_out_format=json
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <mgpu/mgpu.hpp>

#include "bench_support.hpp"

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::int64_t batch = 256;
constexpr std::int64_t batches = 8;
std::vector<std::int64_t> const widths = {784, 1024, 1024, 10};

using bench::median;

// Training data: overlapping clusters in host memory, so the loss stays high as in real training.
struct Data {
  std::shared_ptr<mgpu::Allocator> host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  mgpu::Tensor x = mgpu::Tensor::empty({batches * batch, widths.front()}, mgpu::DType::float32, *host);
  mgpu::Tensor y = mgpu::Tensor::empty({batches * batch}, mgpu::DType::float32, *host);
  Data() {
    auto const set = mgpu::data::make_clusters(batches * batch, widths.front(), widths.back(), 3, 0.05f);
    std::copy(set.feature_data().begin(), set.feature_data().end(), x.host_span<float>().begin());
    std::copy(set.labels().begin(), set.labels().end(), y.host_span<float>().begin());
  }
};

struct Trainer {
  mgpu::DeviceGroup group;
  mgpu::parallel::DataParallel dp;
  std::int64_t next = 0;
  Trainer(std::string const& spec, bool overlap, bool shard)
      : group(spec), dp(mgpu::nn::Sequential::mlp(widths), group, mgpu::optim::SGD({.lr = 0.01f, .momentum = 0.9f}), [&] {
          mgpu::parallel::DataParallelOptions o;
          o.overlap = overlap;
          o.zero_stage = shard ? 1 : 0;
          return o;
        }()) {}
  // Seconds per step over `steps` steps on rows [first, first + rows) of each batch, and the mean
  // fraction of a step the ranks waited.
  std::pair<double, double> run(Data const& data, int steps, std::int64_t first = 0, std::int64_t rows = batch) {
    double wait = 0;
    auto const t0 = Clock::now();
    for (int i = 0; i < steps; ++i) {
      std::int64_t const b = next++ % batches;
      auto const r = dp.step(data.x.slice(b * batch + first, b * batch + first + rows), data.y.slice(b * batch + first, b * batch + first + rows));
      double rank_wait = 0;
      for (double w : r.wait_ms) rank_wait += w;
      wait += rank_wait / static_cast<double>(r.wait_ms.size());
    }
    double const seconds = std::chrono::duration<double>(Clock::now() - t0).count() / steps;
    return {seconds, wait * 1e-3 / steps / seconds};
  }
};

// N single-device trainers, each on its own thread and its 1/N of every batch, with no
// synchronization between them: everything data parallelism does except communicating.
struct Independent {
  std::vector<std::unique_ptr<Trainer>> trainers;
  explicit Independent(int n) {
    for (int i = 0; i < n; ++i) trainers.push_back(std::make_unique<Trainer>("host:1", true, false));
  }
  double run(Data const& data, int steps) {
    auto const n = static_cast<std::int64_t>(trainers.size());
    auto const t0 = Clock::now();
    std::vector<std::thread> threads;
    for (std::int64_t i = 0; i < n; ++i) threads.emplace_back([&, i] { trainers[static_cast<std::size_t>(i)]->run(data, steps, i * batch / n, batch / n); });
    for (auto& t : threads) t.join();
    return std::chrono::duration<double>(Clock::now() - t0).count() / steps;
  }
};

void BM_data_parallel(benchmark::State& state) {
  int const devices = static_cast<int>(state.range(0));
  bool const overlap = state.range(1) != 0;
  bool const shard = state.range(2) != 0;
  Data const data;
  Trainer one("host:1", overlap, shard);
  Trainer many("host:" + std::to_string(devices), overlap, shard);
  Independent independent(devices);
  one.run(data, 2);  // warm the allocators' caches and the optimizer state
  many.run(data, 2);
  independent.run(data, 2);
  constexpr int block = 4;
  std::vector<double> step_s, speedups, waits, bound, of_bound;
  for (auto _ : state) {
    auto const [t1, w1] = one.run(data, block);
    auto const [tn, wn] = many.run(data, block);
    double const ti = independent.run(data, block);
    (void)w1;
    step_s.push_back(tn);
    speedups.push_back(t1 / tn);
    waits.push_back(wn);
    bound.push_back(t1 / ti);
    of_bound.push_back(ti / tn);
  }
  state.counters["samples_per_s"] = batch / median(step_s);
  state.counters["speedup_vs_1"] = median(speedups);
  state.counters["comm_wait_frac"] = median(waits);
  state.counters["independent_speedup_vs_1"] = median(bound);
  state.counters["speedup_vs_independent"] = median(of_bound);
  state.counters["devices"] = devices;
  state.counters["overlap"] = overlap ? 1 : 0;
  state.counters["shard_update"] = shard ? 1 : 0;
  state.counters["steps_timed"] = static_cast<double>(block * step_s.size());
}
BENCHMARK(BM_data_parallel)
    ->ArgNames({"devices", "overlap", "shard"})
    ->Args({1, 1, 1})
    ->Args({2, 1, 1})
    ->Args({4, 1, 1})
    ->Args({2, 0, 1})
    ->Args({2, 1, 0})
    ->Args({4, 1, 0})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MinTime(bench::min_time(4.0));

void BM_rebalance(benchmark::State& state) {
  Data const data;
  std::vector<double> ratios, first;
  for (auto _ : state) {
    mgpu::DeviceGroup group{"host:2@speed=1,0.5"};
    mgpu::parallel::DataParallelOptions options;
    options.weights = {1, 1};
    options.rebalance = true;
    mgpu::parallel::DataParallel dp(mgpu::nn::Sequential::mlp(widths), group, mgpu::optim::SGD({.lr = 0.01f}), options);
    std::int64_t fast = 0, slow = 0;
    for (int i = 0; i < 24; ++i) {
      std::int64_t const b = i % batches;
      auto const r = dp.step(data.x.slice(b * batch, (b + 1) * batch), data.y.slice(b * batch, (b + 1) * batch));
      if (i == 0) first.push_back(static_cast<double>(r.rows[0]) / static_cast<double>(r.rows[1]));
      if (i >= 16) {
        fast += r.rows[0];
        slow += r.rows[1];
      }
    }
    ratios.push_back(static_cast<double>(fast) / static_cast<double>(slow));
  }
  state.counters["rows_fast_to_slow"] = median(ratios);
  state.counters["rows_fast_to_slow_first_step"] = median(first);
}
BENCHMARK(BM_rebalance)->Iterations(bench::iterations(3))->Unit(benchmark::kMillisecond);

void BM_cuda_data_parallel(benchmark::State& state) {
  int const devices = static_cast<int>(state.range(0));
  std::string spec = "cuda:0";
  for (int i = 1; i < devices; ++i) spec += ",0";
  Data const data;
  Trainer one("cuda:0", true, true);
  Trainer many(spec, true, true);
  one.run(data, 2);  // warm the allocators' caches, cuBLAS and the optimizer state
  many.run(data, 2);
  constexpr int block = 8;
  std::vector<double> step_s, speedups, waits;
  for (auto _ : state) {
    double const t1 = one.run(data, block).first;
    auto const [tn, wn] = many.run(data, block);
    step_s.push_back(tn);
    speedups.push_back(t1 / tn);
    waits.push_back(wn);
  }
  state.counters["samples_per_s"] = batch / median(step_s);
  state.counters["speedup_vs_1"] = median(speedups);
  state.counters["comm_wait_frac"] = median(waits);
  state.counters["devices"] = devices;
  state.counters["steps_timed"] = static_cast<double>(block * step_s.size());
}

void BM_timeline_record(benchmark::State& state) {
  mgpu::trace::Timeline timeline;
  timeline.enable(state.range(0) != 0);
  std::int64_t n = 0;
  for (auto _ : state) {
    timeline.record({"all-reduce bucket 3", "communication", 1, mgpu::trace::Lane::communication, n, n + 10});
    ++n;
    if (n % 65536 == 0) {  // keep memory bounded; not timed as part of a record on average
      state.PauseTiming();
      timeline.clear();
      state.ResumeTiming();
    }
  }
  state.counters["enabled"] = static_cast<double>(state.range(0));
}
BENCHMARK(BM_timeline_record)->ArgName("enabled")->Arg(0)->Arg(1);

// A stream span around one empty task, synchronized every 64 spans: the difference between the
// enabled and disabled rows is the span's cost on the enqueuing thread and the worker.
void BM_timeline_stream_span(benchmark::State& state) {
  mgpu::trace::Timeline timeline;
  timeline.enable(state.range(0) != 0);
  mgpu::Stream stream(mgpu::Device{});
  std::int64_t n = 0;
  for (auto _ : state) {
    timeline.stream_span(stream, "update", "update", 0, mgpu::trace::Lane::compute, [&] { stream.enqueue([] {}); });
    if (++n % 64 == 0) stream.synchronize();
    if (n % 65536 == 0) {
      state.PauseTiming();
      timeline.clear();
      state.ResumeTiming();
    }
  }
  stream.synchronize();
  state.counters["enabled"] = static_cast<double>(state.range(0));
}
BENCHMARK(BM_timeline_stream_span)->ArgName("enabled")->Arg(0)->Arg(1)->UseRealTime();

}  // namespace

int main(int argc, char** argv) {
  if (mgpu::cuda_device_count() > 0)
    benchmark::RegisterBenchmark("BM_cuda_data_parallel", BM_cuda_data_parallel)
        ->ArgName("devices")
        ->Arg(2)
        ->Arg(4)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime()
        ->MinTime(bench::min_time(2.0));
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
