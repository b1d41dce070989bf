// bench_pipeline: one pipelined training step (compute_gradients) per schedule at P = 4 devices and
// M = 8 micro-batches on host devices (and, with a GPU, BM_cuda_pipeline: see there). Host devices on a small machine share its cores, so the
// per-action costs are sleeps (each chunk: one layer that sleeps 2 ms in forward, 2 ms in
// backward_input and 2 ms in backward_weight; interleaved chunks sleep half as long): the bubble
// then measures the schedule, not contention for cores. The chunks have no other layers, whose
// small ops' fixed costs (tens of microseconds for a 64-wide Linear's GEMMs here) would count as
// executor overhead. Each action records when it really began (the executor calling the layer)
// and ended (its sleep returning; a sleep overshoots by 0.1-0.5 ms here, varying from one to the
// next), so the counters compare the run with a replay of the same schedule in which every
// action takes exactly the time it took. The timeline is off, as by default. Counters (medians
// over iterations):
//   bubble_measured          1 - slept time / (devices x step), the step from the first sleep's
//                            start to the last one's end;
//   bubble_predicted         the simulator's bubble for the schedule with the nominal costs;
//   overhead_us_per_action   (that step - the replay's makespan) / the compute actions on the
//                            critical path (the makespan when each compute action takes 1 and a
//                            transfer 0): the executor's time on the critical path that is neither
//                            the sleeps, the loss nor a transfer's wait for its peer (the 2 KiB
//                            copies are counted in it);
//   loss_op_us               the last chunk's loss op per micro-batch, timed alone on its stream
//                            (added to each of its forwards in the replay);
//   sleep_overshoot_us       the median excess of a sleep over what was asked;
//   thread_wake_us           the median time, on this machine at the time, from notifying a
//                            condition variable to the waiting thread running (after 2 ms asleep,
//                            as a stream worker waits for a peer): what a blocking handoff on the
//                            critical path costs whatever the executor does;
//   peak_activation_bytes    rank 0's allocator peak during the step (activations in flight);
//   samples_per_s            rows per second of the step (wall time of compute_gradients' run).
// Rows with cpus:0 run on every CPU the process may use; rows with cpus:1 confine the devices'
// threads to one CPU, which the sleeps leave idle, so no hop waits for another CPU to wake (on a
// virtual machine a halted virtual CPU takes tens of microseconds to resume): the executor's own
// cost, with the caveat that hops due at the same instant queue for that CPU.
// BM_executor: the same schedules with chunks that do nothing (each returns its input), so a step
// is the executor's own work: dispatching every action, the 2 KiB transfers between devices and
// their wake-ups, the per-step set-up, and the last chunk's loss op per micro-batch. Counters:
//   step_us                  the median step (wall time of compute_gradients' run);
//   us_per_compute_action    (step_us - micro-batches x loss_op_us) / the compute actions of all
//                            devices: the executor's time per action, its transfers included;
//   us_per_critical_action   the same over the compute actions on the critical path (as
//                            BM_schedule's overhead_us_per_action counts them);
//   step_us_metrics          the median step of the same executor with ExecutorOptions::metrics
//                            (each device's times reported: events around every compute action
//                            and transfer group), its steps taken in turn with the plain one's;
//   metrics_step_ratio       step_us_metrics / step_us: what the metrics cost a step that does
//                            nothing but the executor's own work (the worst case);
//   compute_actions, transfer_actions   what a step runs.
// BM_partition: unbalanced sleeping layers (costs 1,1,1,6,1,1,3,1,2,1 ms) profiled, partitioned
// into 4 stages for 1F1B on 4 host devices by pipeline::partition, on equal devices and on devices
// of speeds 1, 0.5, 1, 0.5 (stage time: cost / speed); partition_vs_optimum is its slowest stage
// over the brute-force optimum of the same profiled costs and speeds, and even_vs_optimum the same
// for equal-unit cuts; planned_step_vs_even_step is the executor's measured step (median of 5) with
// the planned cuts over the same with those equal-unit cuts.
//
//   bench_pipeline --benchmark_out=pipeline.json --benchmark_out_format=json
#include <benchmark/benchmark.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <mgpu/mgpu.hpp>

#include "bench_support.hpp"

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

// What each sleep really took: (chunk, micro-batch, action kind) -> begin and end, steady-clock ns.
class SleepLog {
 public:
  struct Entry {
    int chunk, micro_batch;
    pp::ActionKind kind;
    std::int64_t begin_ns, end_ns;
  };
  SleepLog() { entries_.reserve(capacity); }
  void add(Entry const& e) {
    std::lock_guard lock(mutex_);
    entries_.push_back(e);
  }
  std::vector<Entry> take() {
    std::vector<Entry> fresh;
    fresh.reserve(capacity);  // so that add() never allocates during a step
    std::lock_guard lock(mutex_);
    return std::exchange(entries_, std::move(fresh));
  }

 private:
  static constexpr std::size_t capacity = 1024;
  std::mutex mutex_;
  std::vector<Entry> entries_;
};

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The median wake-up latency of a thread blocked on a condition variable for `asleep`.
double thread_wake_us(std::chrono::microseconds asleep, int samples) {
  std::mutex mutex;
  std::condition_variable cv;
  std::chrono::steady_clock::time_point notified;
  bool ready = false, done = false;
  std::vector<double> latency;
  std::thread waiter([&] {
    std::unique_lock lock(mutex);
    for (int i = 0; i < samples; ++i) {
      cv.wait(lock, [&] { return ready; });
      latency.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - notified).count());
      ready = false;
      done = true;
      cv.notify_all();
    }
  });
  for (int i = 0; i < samples; ++i) {
    std::this_thread::sleep_for(asleep);
    {
      std::lock_guard lock(mutex);
      ready = true;
      done = false;
      notified = std::chrono::steady_clock::now();
    }
    cv.notify_all();
    std::unique_lock lock(mutex);
    cv.wait(lock, [&] { return done; });
  }
  waiter.join();
  return median(latency);
}

// The median time the last chunk's loss (softmax cross-entropy of [rows, width] logits, the
// labels' copy before it) takes on `stream`, timed on the stream itself after a 2 ms wait.
double loss_op_us(mgpu::Stream& stream, mgpu::Allocator& allocator, std::int64_t rows, int samples) {
  mgpu::Tensor const logits = mgpu::Tensor::empty({rows, width}, mgpu::DType::float32, allocator);
  mgpu::Tensor const labels = mgpu::Tensor::empty({rows}, mgpu::DType::float32, allocator);
  mgpu::Tensor const source = mgpu::Tensor::empty({rows}, mgpu::DType::float32, allocator);
  mgpu::fill_async(logits, 0.1f, stream);
  mgpu::fill_async(source, 1.0f, stream);
  std::vector<double> took;
  for (int i = 0; i < samples; ++i) {
    std::int64_t begin = 0, end = 0;
    stream.enqueue([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      begin = now_ns();
    });
    mgpu::copy_async(labels, source, stream);
    mgpu::Tensor const dlogits = mgpu::Tensor::empty(logits.shape(), logits.dtype(), allocator);
    mgpu::Tensor const loss = mgpu::Tensor::empty({1}, mgpu::DType::float32, allocator);
    mgpu::ops::softmax_cross_entropy(logits, labels, dlogits, loss, stream, 1.0f);
    stream.enqueue([&] { end = now_ns(); });
    stream.synchronize();
    took.push_back(static_cast<double>(end - begin) / 1e3);
  }
  return median(took);
}

// Sleeps on the stream: a fixed cost that does not compete for cores. With a log, records each
// sleep as chunk `chunk`'s action.
class Sleep final : public nn::Layer {
 public:
  Sleep(double forward_ms, double backward_input_ms, double backward_weight_ms, int chunk = 0, std::shared_ptr<SleepLog> log = {})
      : f_(forward_ms), bi_(backward_input_ms), bw_(backward_weight_ms), chunk_(chunk), log_(std::move(log)) {}
  std::string name() const override { return "Sleep"; }
  // Keeps its input until the micro-batch's backward (or weight half) is done, as a real layer
  // keeps its activation, so the allocator's peak counts the micro-batches in flight.
  mgpu::Tensor forward(mgpu::Tensor const& x, nn::Context& ctx) override {
    std::int64_t const begin = now_ns();
    saved_[ctx.micro_batch] = x;
    sleep(ctx, f_, pp::ActionKind::forward, begin);
    return x;
  }
  mgpu::Tensor backward(mgpu::Tensor const& dy, nn::Context& ctx) override {
    std::int64_t const begin = now_ns();
    saved_.erase(ctx.micro_batch);
    sleep(ctx, bi_ + bw_, pp::ActionKind::backward, begin);
    return dy;
  }
  mgpu::Tensor backward_input(mgpu::Tensor const& dy, nn::Context& ctx) override {
    sleep(ctx, bi_, pp::ActionKind::backward_input, now_ns());
    return dy;
  }
  void backward_weight(nn::Context& ctx) override {
    std::int64_t const begin = now_ns();
    saved_.erase(ctx.micro_batch);
    sleep(ctx, bw_, pp::ActionKind::backward_weight, begin);
  }
  std::size_t saved_micro_batches() const override { return saved_.size(); }
  std::unique_ptr<nn::Layer> clone() const override { return std::make_unique<Sleep>(f_, bi_, bw_, chunk_, log_); }

 private:
  // The action begins when the executor calls the layer (`begin`: its bookkeeping and enqueue
  // are the layer's cost, as a real layer's kernel launches are) and ends when the sleep does.
  void sleep(nn::Context& ctx, double ms, pp::ActionKind kind, std::int64_t begin) const {
    ctx.stream.enqueue([ms, log = log_.get(), entry = SleepLog::Entry{chunk_, static_cast<int>(ctx.micro_batch), kind, begin, 0}]() mutable {
      std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms) - std::chrono::nanoseconds(now_ns() - entry.begin_ns));
      entry.end_ns = now_ns();
      if (log != nullptr) log->add(entry);
    });
  }
  double f_, bi_, bw_;
  int chunk_;
  std::shared_ptr<SleepLog> log_;
  std::map<std::int64_t, mgpu::Tensor> saved_;
};

std::unique_ptr<mgpu::optim::Optimizer> sgd() { return std::make_unique<mgpu::optim::SGD>(); }

// Cut points that make each layer of the model a chunk of the schedule.
std::vector<std::size_t> layer_per_chunk(pp::Schedule const& schedule) {
  std::vector<std::size_t> cuts;
  for (int c = 0; c <= schedule.chunks(); ++c) cuts.push_back(static_cast<std::size_t>(c));
  return cuts;
}

// The compute actions on the schedule's critical path: its makespan when each takes 1 and a
// transfer 0.
double critical_actions(pp::Schedule const& schedule) {
  std::vector<std::vector<double>> unit(schedule.actions.size());
  for (std::size_t d = 0; d < unit.size(); ++d)
    for (pp::Action const& a : schedule.actions[d]) unit[d].push_back(pp::is_transfer(a.kind) ? 0.0 : 1.0);
  return pp::simulate(schedule, unit).makespan;
}

// A model of one layer per chunk run by `schedule` on host devices, and the batch it trains on.
struct Run {
  Run(nn::Sequential const& model, pp::Schedule const& schedule, pp::ExecutorOptions options = {})
      : executor(model, group, layer_per_chunk(schedule), schedule, sgd, std::move(options)) {
    for (std::int64_t i = 0; i < rows * width; ++i) x.host_span<float>()[static_cast<std::size_t>(i)] = static_cast<float>(i % 7) * 0.1f;
    for (std::int64_t i = 0; i < rows; ++i) y.host_span<float>()[static_cast<std::size_t>(i)] = static_cast<float>(i % 10);
    int const last = schedule.device_of(schedule.chunks() - 1);
    loss_us = loss_op_us(group.stream(last), group.allocator(last), rows / micro_batches, 20);
  }
  mgpu::DeviceGroup group{"host:" + std::to_string(devices)};
  pp::Executor executor;
  std::shared_ptr<mgpu::Allocator> host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  mgpu::Tensor x = mgpu::Tensor::empty({rows, width}, mgpu::DType::float32, *host);
  mgpu::Tensor y = mgpu::Tensor::empty({rows}, mgpu::DType::float32, *host);
  double loss_us = 0;  // the last chunk's loss op per micro-batch, on its device (loss_op_us)
};

// Confines this thread, and the threads it starts, to its first allowed CPU while alive.
class OneCpu {
 public:
  explicit OneCpu(bool on) : on_(on) {
    if (!on_) return;
    sched_getaffinity(0, sizeof(saved_), &saved_);
    cpu_set_t one;
    CPU_ZERO(&one);
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &saved_)) {
        CPU_SET(c, &one);
        break;
      }
    }
    sched_setaffinity(0, sizeof(one), &one);
  }
  ~OneCpu() {
    if (on_) sched_setaffinity(0, sizeof(saved_), &saved_);
  }
  OneCpu(OneCpu const&) = delete;
  OneCpu& operator=(OneCpu const&) = delete;

 private:
  bool on_;
  cpu_set_t saved_{};
};

void BM_schedule(benchmark::State& state, std::string const& name) {
  OneCpu const pinned(state.range(0) == 1);
  pp::Schedule const schedule = name == "layer-split" ? pp::layer_split(devices) : pp::make_schedule(name, devices, micro_batches, 2);
  int const v = schedule.chunks_per_device;
  double const ms = 2.0 / v;
  auto const log = std::make_shared<SleepLog>();
  nn::Sequential model;
  for (int c = 0; c < schedule.chunks(); ++c) model.add(std::make_unique<Sleep>(ms, ms, ms, c, log));
  Run run(model, schedule);
  mgpu::DeviceGroup& group = run.group;
  pp::Executor& executor = run.executor;
  mgpu::Tensor const& x = run.x;
  mgpu::Tensor const& y = run.y;
  double const predicted = pp::simulate(schedule, {pp::ActionCosts{ms, ms, ms, 0.0}}).bubble_fraction;
  double const critical = critical_actions(schedule);
  executor.compute_gradients(x, y);  // warm the allocators
  log->take();
  // The loss is compute too: the replay adds it to each forward of the last chunk.
  int const last = schedule.chunks() - 1;
  double const loss_ms = run.loss_us / 1e3;
  std::vector<double> bubbles, overheads, overshoots, peaks, seconds;
  for (auto _ : state) {
    group.allocator(0).reset_peak();
    std::size_t const before = group.allocator(0).stats().allocated;
    executor.compute_gradients(x, y);
    double const step = executor.last_step_seconds();
    state.SetIterationTime(step);
    seconds.push_back(step);
    peaks.push_back(static_cast<double>(group.allocator(0).stats().peak_allocated - before));
    // Each compute action's real duration, the transfers' 0: the replay.
    std::map<std::tuple<int, int, pp::ActionKind>, double> slept_ms;
    std::int64_t begin = INT64_MAX, end = INT64_MIN;
    double busy_ms = 0;
    std::vector<double> excess;
    for (SleepLog::Entry const& e : log->take()) {
      double const took = static_cast<double>(e.end_ns - e.begin_ns) / 1e6;
      slept_ms[{e.chunk, e.micro_batch, e.kind}] = took;
      begin = std::min(begin, e.begin_ns);
      end = std::max(end, e.end_ns);
      busy_ms += took;
      excess.push_back(took - (e.kind == pp::ActionKind::backward ? 2 * ms : ms));
    }
    std::vector<std::vector<double>> durations(schedule.actions.size());
    for (std::size_t d = 0; d < durations.size(); ++d) {
      for (pp::Action const& a : schedule.actions[d])
        durations[d].push_back(pp::is_transfer(a.kind) ? 0.0
                                                       : slept_ms.at({a.chunk, a.micro_batch, a.kind}) +
                                                             (a.chunk == last && a.kind == pp::ActionKind::forward ? loss_ms : 0.0));
    }
    double const makespan_ms = static_cast<double>(end - begin) / 1e6;
    double const replay_ms = pp::simulate(schedule, durations).makespan;
    bubbles.push_back(1.0 - busy_ms / (devices * makespan_ms));
    overheads.push_back((makespan_ms - replay_ms) * 1e3 / critical);
    overshoots.push_back(median(excess) * 1e3);
  }
  state.counters["bubble_measured"] = median(bubbles);
  state.counters["bubble_predicted"] = predicted;
  state.counters["overhead_us_per_action"] = median(overheads);
  state.counters["peak_activation_bytes"] = median(peaks);
  state.counters["samples_per_s"] = static_cast<double>(rows) / median(seconds);
  state.counters["sleep_overshoot_us"] = median(overshoots);
  state.counters["loss_op_us"] = loss_ms * 1e3;
  state.counters["thread_wake_us"] = thread_wake_us(std::chrono::microseconds(2000), 40);
}

// A layer that does nothing: BM_executor's chunks, so that a step is the executor's own work.
class Pass final : public nn::Layer {
 public:
  std::string name() const override { return "Pass"; }
  mgpu::Tensor forward(mgpu::Tensor const& x, nn::Context&) override { return x; }
  mgpu::Tensor backward(mgpu::Tensor const& dy, nn::Context&) override { return dy; }
  std::unique_ptr<nn::Layer> clone() const override { return std::make_unique<Pass>(); }
};

void BM_executor(benchmark::State& state, std::string const& name) {
  OneCpu const pinned(state.range(0) == 1);
  pp::Schedule const schedule = pp::make_schedule(name, devices, micro_batches, 2);
  nn::Sequential model;
  for (int c = 0; c < schedule.chunks(); ++c) model.add(std::make_unique<Pass>());
  Run run(model, schedule);
  // The same executor reporting each device's times to a metrics registry (events around every
  // compute action and transfer group), its steps taken in turn with the plain one's.
  Run timed(model, schedule, {.metrics = std::make_shared<mgpu::metrics::Registry>("bench_pipeline")});
  std::size_t compute = 0, transfers = 0;
  for (auto const& list : schedule.actions)
    for (pp::Action const& a : list) ++(pp::is_transfer(a.kind) ? transfers : compute);
  for (int i = 0; i < 5; ++i) {  // warm the allocators and caches
    run.executor.compute_gradients(run.x, run.y);
    timed.executor.compute_gradients(timed.x, timed.y);
  }
  std::vector<double> seconds, timed_seconds;
  for (auto _ : state) {
    run.executor.compute_gradients(run.x, run.y);
    seconds.push_back(run.executor.last_step_seconds());
    state.SetIterationTime(seconds.back());
    timed.executor.compute_gradients(timed.x, timed.y);
    timed_seconds.push_back(timed.executor.last_step_seconds());
  }
  double const step_us = median(seconds) * 1e6;
  state.counters["step_us_metrics"] = median(timed_seconds) * 1e6;
  state.counters["metrics_step_ratio"] = median(timed_seconds) / median(seconds);
  state.counters["step_us"] = step_us;
  state.counters["loss_op_us"] = run.loss_us;
  state.counters["us_per_compute_action"] = (step_us - micro_batches * run.loss_us) / static_cast<double>(compute);
  state.counters["us_per_critical_action"] = (step_us - micro_batches * run.loss_us) / critical_actions(schedule);
  state.counters["compute_actions"] = static_cast<double>(compute);
  state.counters["transfer_actions"] = static_cast<double>(transfers);
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
  pp::Schedule const schedule = pp::one_f_one_b(group.size(), micro_batches);
  auto const host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  mgpu::Tensor const x = mgpu::Tensor::empty({rows, width}, mgpu::DType::float32, *host);
  mgpu::Tensor const y = mgpu::Tensor::empty({rows}, mgpu::DType::float32, *host);
  std::fill(x.host_span<float>().begin(), x.host_span<float>().end(), 0.5f);
  std::fill(y.host_span<float>().begin(), y.host_span<float>().end(), 1.0f);
  auto const step_seconds = [&](std::vector<std::size_t> const& cuts) {
    pp::Executor executor(model, group, cuts, schedule, sgd);
    std::vector<double> seconds;
    for (int i = 0; i < 5; ++i) {
      executor.compute_gradients(x, y);
      seconds.push_back(executor.last_step_seconds());
    }
    return median(seconds);
  };
  double ratio = 0, even = 0, step_ratio = 0;
  for (auto _ : state) {
    pp::LayerProfile const profile = pp::profile_layers(model, group, {rows, width}, 3);
    std::vector<double> const& seconds = profile.seconds;
    pp::Partition const plan = pp::partition(model, schedule, profile, devices);
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
    step_ratio = step_seconds(plan.cuts) / step_seconds({0, 3, 5, 8, 10});
  }
  state.counters["partition_vs_optimum"] = ratio;
  state.counters["even_vs_optimum"] = even;
  state.counters["planned_step_vs_even_step"] = step_ratio;
}

// With a GPU: one step of an MLP of width 1024 (9 Linear layers with ReLUs between, cut evenly into
// the schedule's chunks) on 4 logical devices sharing cuda:0, a batch of 512 rows in 8
// micro-batches. The transfers go through the cuda_peer communicator; the stages share one GPU, so
// this is the executor's and the transfers' cost on a GPU, not a speedup. Counters: step_ms (the
// median step) and samples_per_s.
void BM_cuda_pipeline(benchmark::State& state, std::string const& name) {
  constexpr std::int64_t gpu_rows = 512;
  constexpr std::int64_t gpu_width = 1024;
  pp::Schedule const schedule = pp::make_schedule(name, devices, micro_batches, 2);
  std::vector<std::int64_t> widths(9, gpu_width);
  widths.push_back(10);
  nn::Sequential const model = nn::Sequential::mlp(widths);
  auto const chunks = static_cast<std::size_t>(schedule.chunks());
  std::vector<std::size_t> cuts;
  for (std::size_t c = 0; c <= chunks; ++c) cuts.push_back(model.size() * c / chunks);
  mgpu::DeviceGroup group("cuda:0,0,0,0");
  pp::Executor executor(model, group, cuts, schedule, sgd);
  auto host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  mgpu::Tensor x = mgpu::Tensor::empty({gpu_rows, gpu_width}, mgpu::DType::float32, *host);
  mgpu::Tensor y = mgpu::Tensor::empty({gpu_rows}, mgpu::DType::float32, *host);
  for (std::int64_t i = 0; i < gpu_rows * gpu_width; ++i) x.host_span<float>()[static_cast<std::size_t>(i)] = static_cast<float>(i % 7) * 0.1f;
  for (std::int64_t i = 0; i < gpu_rows; ++i) y.host_span<float>()[static_cast<std::size_t>(i)] = static_cast<float>(i % 10);
  executor.compute_gradients(x, y);  // warm the allocators and cuBLAS
  std::vector<double> seconds;
  for (auto _ : state) {
    executor.compute_gradients(x, y);
    double const step = executor.last_step_seconds();
    state.SetIterationTime(step);
    seconds.push_back(step);
  }
  state.counters["step_ms"] = median(seconds) * 1e3;
  state.counters["samples_per_s"] = static_cast<double>(gpu_rows) / median(seconds);
}

}  // namespace

BENCHMARK_CAPTURE(BM_schedule, layer_split, std::string("layer-split"))->ArgName("cpus")->Arg(0)->Arg(1)->UseManualTime()->Iterations(bench::iterations(9))->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_schedule, gpipe, std::string("gpipe"))->ArgName("cpus")->Arg(0)->Arg(1)->UseManualTime()->Iterations(bench::iterations(9))->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_schedule, one_f_one_b, std::string("1f1b"))->ArgName("cpus")->Arg(0)->Arg(1)->UseManualTime()->Iterations(bench::iterations(9))->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_schedule, interleaved, std::string("interleaved"))->ArgName("cpus")->Arg(0)->Arg(1)->UseManualTime()->Iterations(bench::iterations(9))->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_schedule, zero_bubble, std::string("zb"))->ArgName("cpus")->Arg(0)->Arg(1)->UseManualTime()->Iterations(bench::iterations(9))->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_executor, gpipe, std::string("gpipe"))->ArgName("cpus")->Arg(0)->Arg(1)->UseManualTime()->Iterations(bench::iterations(200))->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_executor, one_f_one_b, std::string("1f1b"))->ArgName("cpus")->Arg(0)->Arg(1)->UseManualTime()->Iterations(bench::iterations(200))->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_executor, interleaved, std::string("interleaved"))->ArgName("cpus")->Arg(0)->Arg(1)->UseManualTime()->Iterations(bench::iterations(200))->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_executor, zero_bubble, std::string("zb"))->ArgName("cpus")->Arg(0)->Arg(1)->UseManualTime()->Iterations(bench::iterations(200))->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_partition, equal, std::string("host:4"))->Iterations(bench::iterations(1))->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_partition, speeds_1_half_1_half, std::string("host:4@speed=1,0.5,1,0.5"))->Iterations(bench::iterations(1))->Unit(benchmark::kMillisecond);

int main(int argc, char** argv) {
  if (mgpu::cuda_device_count() > 0) {
    for (char const* name : {"gpipe", "1f1b", "interleaved", "zb"})
      benchmark::RegisterBenchmark((std::string("BM_cuda_pipeline/") + name).c_str(), BM_cuda_pipeline, std::string(name))
          ->UseManualTime()
          ->Iterations(bench::iterations(20))
          ->Unit(benchmark::kMillisecond);
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
