// bench_pipeline: one pipelined training step (compute_gradients) per schedule at P = 4 devices and
// M = 8 micro-batches on host devices. Host devices on a small machine share its cores, so the
// per-action costs are sleeps (each chunk: a small Linear plus a layer that sleeps 2 ms in forward,
// 2 ms in backward_input and 2 ms in backward_weight; interleaved chunks sleep half as long): the
// bubble then measures the schedule, not contention for cores. Counters (medians over iterations):
//   bubble_measured          1 - compute time / (devices x step time), from the executor's
//                            timeline spans of each step;
//   bubble_predicted         the simulator's bubble for the same schedule and costs;
//   overhead_us_per_action   (measured step time - simulated makespan) / actions per device: the
//                            executor's time on the critical path that is neither compute nor copy
//                            (the simulation's costs include how much longer than asked a sleep
//                            takes on this machine at the time, measured before each benchmark);
//   sleep_overshoot_us       that excess per sleep;
//   peak_activation_bytes    rank 0's allocator peak during the step (activations in flight);
//   samples_per_s            rows per second of the step.
// BM_partition: unbalanced sleeping layers (costs 1,1,1,6,1,1,3,1,2,1 ms) profiled, partitioned
// into 4 stages for 1F1B on 4 host devices by pipeline::partition, on equal devices and on devices
// of speeds 1, 0.5, 1, 0.5 (stage time: cost / speed); partition_vs_optimum is its slowest stage
// over the brute-force optimum of the same profiled costs and speeds, and even_vs_optimum the same
// for equal-unit cuts.
//
//   bench_pipeline --benchmark_out=pipeline.json --benchmark_out_format=json
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <mgpu/mgpu.hpp>

namespace {

namespace nn = mgpu::nn;
namespace pp = mgpu::pipeline;

constexpr int devices = 4;
constexpr int micro_batches = 8;
constexpr std::int64_t rows = 64;
constexpr std::int64_t width = 64;

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

// Sleeps on the stream: a fixed cost that does not compete for cores.
class Sleep final : public nn::Layer {
 public:
  Sleep(double forward_ms, double backward_input_ms, double backward_weight_ms)
      : f_(forward_ms), bi_(backward_input_ms), bw_(backward_weight_ms) {}
  std::string name() const override { return "Sleep"; }
  mgpu::Tensor forward(mgpu::Tensor const& x, nn::Context& ctx) override {
    sleep(ctx, f_);
    return x;
  }
  mgpu::Tensor backward(mgpu::Tensor const& dy, nn::Context& ctx) override {
    sleep(ctx, bi_ + bw_);
    return dy;
  }
  mgpu::Tensor backward_input(mgpu::Tensor const& dy, nn::Context& ctx) override {
    sleep(ctx, bi_);
    return dy;
  }
  void backward_weight(nn::Context& ctx) override { sleep(ctx, bw_); }
  std::unique_ptr<nn::Layer> clone() const override { return std::make_unique<Sleep>(f_, bi_, bw_); }

 private:
  static void sleep(nn::Context& ctx, double ms) {
    ctx.stream.enqueue([ms] { std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms)); });
  }
  double f_, bi_, bw_;
};

std::unique_ptr<mgpu::optim::Optimizer> sgd() { return std::make_unique<mgpu::optim::SGD>(); }

void BM_schedule(benchmark::State& state, std::string const& name) {
  pp::Schedule const schedule = name == "layer-split" ? pp::layer_split(devices) : pp::make_schedule(name, devices, micro_batches, 2);
  int const v = schedule.chunks_per_device;
  double const ms = 2.0 / v;
  nn::Sequential model;
  for (int c = 0; c < schedule.chunks(); ++c) {
    model.add(std::make_unique<nn::Linear>(width, width));
    model.add(std::make_unique<Sleep>(ms, ms, ms));
  }
  std::vector<std::size_t> cuts;
  for (int c = 0; c <= schedule.chunks(); ++c) cuts.push_back(static_cast<std::size_t>(2 * c));
  mgpu::DeviceGroup group("host:" + std::to_string(devices));
  auto timeline = std::make_shared<mgpu::trace::Timeline>();
  pp::Executor executor(model, group, cuts, schedule, sgd, {.timeline = timeline});
  auto const host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  mgpu::Tensor const x = mgpu::Tensor::empty({rows, width}, mgpu::DType::float32, *host);
  mgpu::Tensor const y = mgpu::Tensor::empty({rows}, mgpu::DType::float32, *host);
  for (std::int64_t i = 0; i < rows * width; ++i) x.host_span<float>()[static_cast<std::size_t>(i)] = static_cast<float>(i % 7) * 0.1f;
  for (std::int64_t i = 0; i < rows; ++i) y.host_span<float>()[static_cast<std::size_t>(i)] = static_cast<float>(i % 10);
  double const predicted = pp::simulate(schedule, {pp::ActionCosts{ms, ms, ms, 0.0}}).bubble_fraction;
  // A sleep lasts longer than asked (timer slack, waking up): measure by how much on this machine
  // now, and give every sleeping action that much more in the makespan the overhead is measured
  // against (a fused backward is one sleep, its halves one each).
  double overshoot_ms = 0;
  {
    int const sleeps = 20;
    mgpu::Stream& stream = group.stream(0);
    auto const start = std::chrono::steady_clock::now();
    for (int i = 0; i < sleeps; ++i) stream.enqueue([ms] { std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms)); });
    stream.synchronize();
    overshoot_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() / sleeps - ms;
  }
  bool const split = schedule.name == "zb-h1";
  double const half = split ? overshoot_ms : overshoot_ms / 2;
  double const predicted_ms = pp::simulate(schedule, {pp::ActionCosts{ms + overshoot_ms, ms + half, ms + half, 0.0}}).makespan;
  std::size_t actions = 0;
  for (auto const& list : schedule.actions) actions = std::max(actions, list.size());
  executor.compute_gradients(x, y);  // warm the allocators
  std::vector<double> bubbles, overheads, peaks, seconds;
  for (auto _ : state) {
    timeline->clear();
    timeline->enable();
    group.allocator(0).reset_peak();
    std::size_t const before = group.allocator(0).stats().allocated;
    executor.compute_gradients(x, y);
    timeline->enable(false);
    double const step = executor.last_step_seconds();
    state.SetIterationTime(step);
    seconds.push_back(step);
    peaks.push_back(static_cast<double>(group.allocator(0).stats().peak_allocated - before));
    auto const spans = timeline->spans();
    std::int64_t begin = spans.front().begin_ns, end = spans.front().end_ns;
    double busy = 0;
    for (auto const& s : spans) {
      begin = std::min(begin, s.begin_ns);
      end = std::max(end, s.end_ns);
      if (s.lane == mgpu::trace::compute) busy += static_cast<double>(s.end_ns - s.begin_ns);
    }
    double const makespan_ns = static_cast<double>(end - begin);
    bubbles.push_back(1.0 - busy / (devices * makespan_ns));
    overheads.push_back((makespan_ns / 1e3 - predicted_ms * 1e3) / static_cast<double>(actions));
  }
  state.counters["bubble_measured"] = median(bubbles);
  state.counters["bubble_predicted"] = predicted;
  state.counters["overhead_us_per_action"] = median(overheads);
  state.counters["peak_activation_bytes"] = median(peaks);
  state.counters["samples_per_s"] = static_cast<double>(rows) / median(seconds);
  state.counters["sleep_overshoot_us"] = overshoot_ms * 1e3;
}

// The slowest stage of cutting per-unit costs at `cuts` (unit indices), stage s at speeds[s].
double slowest(std::vector<double> const& unit, std::vector<double> const& speeds, std::vector<int> const& cuts) {
  double worst = 0;
  for (std::size_t s = 0; s + 1 < cuts.size(); ++s) {
    double sum = 0;
    for (int u = cuts[s]; u < cuts[s + 1]; ++u) sum += unit[static_cast<std::size_t>(u)];
    worst = std::max(worst, sum / speeds[s]);
  }
  return worst;
}

void BM_partition(benchmark::State& state, std::string const& spec) {
  std::vector<double> const costs_ms{1, 1, 1, 6, 1, 1, 3, 1, 2, 1};
  nn::Sequential model;
  for (double const c : costs_ms) model.add(std::make_unique<Sleep>(c / 3, c / 3, c / 3));
  mgpu::DeviceGroup group(spec);
  auto const devices = pp::stage_devices(group, group.size());
  std::vector<double> speeds;
  for (auto const& d : devices) speeds.push_back(d.speed);
  double ratio = 0, even = 0;
  for (auto _ : state) {
    pp::LayerProfile const profile = pp::profile_layers(model, group, {rows, width}, 3);
    std::vector<double> const& seconds = profile.seconds;
    pp::Partition const plan = pp::partition(model, pp::one_f_one_b(group.size(), micro_batches), profile, devices);
    // Brute force over every 4-way split of the 10 units.
    int const n = static_cast<int>(seconds.size());
    double best = 1e300;
    for (int a = 1; a < n; ++a)
      for (int b = a + 1; b < n; ++b)
        for (int c = b + 1; c < n; ++c) best = std::min(best, slowest(seconds, speeds, {0, a, b, c, n}));
    std::vector<int> got;
    for (std::size_t const cut : plan.cuts) got.push_back(static_cast<int>(cut));
    ratio = slowest(seconds, speeds, got) / best;
    even = slowest(seconds, speeds, {0, 3, 5, 8, 10}) / best;
  }
  state.counters["partition_vs_optimum"] = ratio;
  state.counters["even_vs_optimum"] = even;
}

}  // namespace

BENCHMARK_CAPTURE(BM_schedule, layer_split, std::string("layer-split"))->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_schedule, gpipe, std::string("gpipe"))->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_schedule, one_f_one_b, std::string("1f1b"))->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_schedule, interleaved, std::string("interleaved"))->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_schedule, zero_bubble, std::string("zb"))->UseManualTime()->Iterations(5)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_partition, equal, std::string("host:4"))->Iterations(1)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_partition, speeds_1_half_1_half, std::string("host:4@speed=1,0.5,1,0.5"))->Iterations(1)->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
