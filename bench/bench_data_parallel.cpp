// bench_data_parallel: DataParallel training steps of an MLP 784-1024-1024-10 at global batch 256
// in float32 on 1, 2 and 4 host devices, with the bucketed all-reduce overlapped with backward and
// without. Blocks of steps on one device and on N devices are timed in turn, so each ratio is
// taken at one machine speed; counters are medians over turns:
//   samples_per_s     N-device training throughput;
//   speedup_vs_1      N-device samples/s ÷ the same step on one host device, the block before;
//   comm_wait_frac    time a rank waits for its reduces after backward ÷ its step time (mean
//                     over ranks): what the overlap did not hide.
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
#include <vector>

#include <mgpu/mgpu.hpp>

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::int64_t batch = 256;
constexpr std::int64_t batches = 8;
std::vector<std::int64_t> const widths = {784, 1024, 1024, 10};

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

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
  Trainer(std::string const& spec, bool overlap)
      : group(spec), dp(mgpu::nn::Sequential::mlp(widths), group, mgpu::optim::SGD({.lr = 0.01f, .momentum = 0.9f}), [&] {
          mgpu::parallel::DataParallelOptions o;
          o.overlap = overlap;
          return o;
        }()) {}
  // Seconds per step over `steps` steps, and the mean fraction of a step the ranks waited.
  std::pair<double, double> run(Data const& data, int steps) {
    double wait = 0;
    auto const t0 = Clock::now();
    for (int i = 0; i < steps; ++i) {
      std::int64_t const b = next++ % batches;
      auto const r = dp.step(data.x.slice(b * batch, (b + 1) * batch), data.y.slice(b * batch, (b + 1) * batch));
      double rank_wait = 0;
      for (double w : r.wait_ms) rank_wait += w;
      wait += rank_wait / static_cast<double>(r.wait_ms.size());
    }
    double const seconds = std::chrono::duration<double>(Clock::now() - t0).count() / steps;
    return {seconds, wait * 1e-3 / steps / seconds};
  }
};

void BM_data_parallel(benchmark::State& state) {
  int const devices = static_cast<int>(state.range(0));
  bool const overlap = state.range(1) != 0;
  Data const data;
  Trainer one("host:1", overlap);
  Trainer many("host:" + std::to_string(devices), overlap);
  one.run(data, 2);  // warm the allocators' caches and the optimizer state
  many.run(data, 2);
  constexpr int block = 4;
  std::vector<double> step_s, speedups, waits;
  for (auto _ : state) {
    auto const [t1, w1] = one.run(data, block);
    auto const [tn, wn] = many.run(data, block);
    (void)w1;
    step_s.push_back(tn);
    speedups.push_back(t1 / tn);
    waits.push_back(wn);
  }
  state.counters["samples_per_s"] = batch / median(step_s);
  state.counters["speedup_vs_1"] = median(speedups);
  state.counters["comm_wait_frac"] = median(waits);
  state.counters["devices"] = devices;
  state.counters["overlap"] = overlap ? 1 : 0;
  state.counters["steps_timed"] = static_cast<double>(block * step_s.size());
}
BENCHMARK(BM_data_parallel)
    ->ArgNames({"devices", "overlap"})
    ->Args({1, 1})
    ->Args({2, 1})
    ->Args({4, 1})
    ->Args({2, 0})
    ->Args({4, 0})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MinTime(4.0);

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

BENCHMARK_MAIN();
