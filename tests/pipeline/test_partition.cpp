// Heterogeneous pipeline partitioning: the planner against brute force over every contiguous split
// (speeds such as 1 and 0.5, tight memory, 1F1B's closed-form P - d micro-batches in flight), its
// errors, the plan's report, the devices read off a group, profiling on a speed-emulated rank 0,
// and end to end on host:2@speed=1,0.5: the faster device gets more layers. Profiles come from
// known costs (a ProfileTimer), never from the machine's speed.
#include <mgpu/nn/layers.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/pipeline/pipeline.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "support/catch.hpp"
#include "support/expect_error.hpp"

using mgpu::Tensor;
namespace nn = mgpu::nn;
namespace pp = mgpu::pipeline;

namespace {

constexpr double inf = std::numeric_limits<double>::infinity();

// `units` Linear layers, each a unit of its own.
nn::Sequential linears(int units) {
  nn::Sequential m;
  for (int u = 0; u < units; ++u) m.add(std::make_unique<nn::Linear>(2, 2));
  return m;
}

// Every split of `units` into `chunks` contiguous non-empty chunks, as each chunk's first unit then `units`.
void for_each_split(int units, int chunks, std::function<void(std::vector<int> const&)> const& visit) {
  std::vector<int> first{0};
  std::function<void()> extend = [&] {
    int const c = static_cast<int>(first.size());
    if (c == chunks) {
      first.push_back(units);
      visit(first);
      first.pop_back();
      return;
    }
    for (int u = first.back() + 1; u <= units - (chunks - c); ++u) {
      first.push_back(u);
      extend();
      first.pop_back();
    }
  };
  extend();
}

struct Case {
  pp::LayerProfile profile;
  std::vector<pp::StageDevice> devices;
  int micro_batches = 1;
  int optimizer_states = 1;
};

// A split's slowest chunk under 1F1B (chunk d on device d, min(P - d, M) micro-batches in flight
// there), or infinity when a chunk does not fit its device.
double slowest_1f1b(Case const& k, std::vector<int> const& first) {
  int const p = static_cast<int>(k.devices.size());
  double worst = 0;
  for (int d = 0; d < p; ++d) {
    double seconds = 0, parameters = 0, activations = 0;
    for (int u = first[static_cast<std::size_t>(d)]; u < first[static_cast<std::size_t>(d) + 1]; ++u) {
      seconds += k.profile.seconds[static_cast<std::size_t>(u)];
      parameters += k.profile.parameter_bytes[static_cast<std::size_t>(u)];
      activations += k.profile.activation_bytes[static_cast<std::size_t>(u)];
    }
    double const need = parameters * (2 + k.optimizer_states) + std::min(p - d, k.micro_batches) * activations;
    if (need > k.devices[static_cast<std::size_t>(d)].free_bytes) return inf;
    worst = std::max(worst, seconds / k.devices[static_cast<std::size_t>(d)].speed);
  }
  return worst;
}

// Seconds of work done on the streams, by the Cost layers that share it.
using Ledger = std::shared_ptr<std::atomic<double>>;

// A layer whose forward and backward each cost `seconds` of a speed-1 device: work on the stream
// that adds them to the ledger, in place of taking that long.
class Cost final : public nn::Layer {
 public:
  Cost(double seconds, Ledger ledger) : seconds_(seconds), ledger_(std::move(ledger)) {}
  std::string name() const override { return "Cost"; }
  Tensor forward(Tensor const& x, nn::Context& ctx) override {
    charge(ctx);
    return x;
  }
  Tensor backward(Tensor const& dy, nn::Context& ctx) override {
    charge(ctx);
    return dy;
  }
  std::unique_ptr<nn::Layer> clone() const override { return std::make_unique<Cost>(seconds_, ledger_); }

 private:
  void charge(nn::Context& ctx) const {
    ctx.stream.enqueue([seconds = seconds_, ledger = ledger_] { *ledger += seconds; });
  }
  double seconds_;
  Ledger ledger_;
};

// `units` pairs of a Linear (no cost in the ledger) and a layer costing `seconds` in forward and
// again in backward.
nn::Sequential costly(int units, double seconds, Ledger const& ledger) {
  nn::Sequential m;
  for (int u = 0; u < units; ++u) {
    m.add(std::make_unique<nn::Linear>(8, 8));
    m.add(std::make_unique<Cost>(seconds, ledger));
  }
  return m;
}

// Times a run as a device of `speed` would take for the ledger's work (1 / speed as long), plus
// `extra[k]` seconds on the k-th run (a disturbance the median must ignore; cycled).
pp::ProfileTimer ledger_timer(Ledger ledger, double speed, std::vector<double> extra = {0.0}) {
  auto runs = std::make_shared<std::size_t>(0);
  return [ledger = std::move(ledger), speed, extra = std::move(extra), runs](std::function<void()> const& run) {
    double const before = *ledger;
    run();  // it waits for the stream: the ledger holds the run's work
    return (*ledger - before) / speed + extra[(*runs)++ % extra.size()];
  };
}

}  // namespace

TEST_CASE("the heterogeneous partition equals brute force over every contiguous split", "[parallel][partition]") {
  std::mt19937 rng(12);
  std::uniform_real_distribution<double> cost(0.1, 4.0);
  std::uniform_int_distribution<int> size(0, 400);
  std::uniform_real_distribution<double> tightness(0.5, 1.6);
  std::vector<double> const speeds{1.0, 0.5, 0.25, 0.75};
  int feasible = 0, infeasible = 0, memory_binds = 0;
  for (int trial = 0; trial < 400; ++trial) {
    int const p = 1 + static_cast<int>(rng() % 4);
    int const units = p + static_cast<int>(rng() % static_cast<unsigned>(9 - p));
    Case k;
    k.micro_batches = 1 + static_cast<int>(rng() % 5);
    k.optimizer_states = static_cast<int>(rng() % 3);
    double total = 0;
    for (int u = 0; u < units; ++u) {
      k.profile.seconds.push_back(cost(rng));
      k.profile.parameter_bytes.push_back(size(rng));  // whole bytes: the sums are exact
      k.profile.activation_bytes.push_back(size(rng));
      total += k.profile.parameter_bytes.back() * (2 + k.optimizer_states) + p * k.profile.activation_bytes.back();
    }
    for (int d = 0; d < p; ++d) {
      // Alternating speeds 1, 0.5 in half the trials, random ones in the others; free memory
      // around an even share, so that memory binds often and sometimes nothing fits.
      double const speed = trial % 2 == 0 ? (d % 2 == 0 ? 1.0 : 0.5) : speeds[rng() % speeds.size()];
      double const free = trial % 5 == 0 ? inf : std::floor(tightness(rng) * total / p);
      k.devices.push_back({speed, free});
    }
    CAPTURE(trial, p, units, k.micro_batches, k.optimizer_states);
    double best = inf;
    for_each_split(units, p, [&](std::vector<int> const& first) { best = std::min(best, slowest_1f1b(k, first)); });
    Case unlimited = k;
    for (auto& d : unlimited.devices) d.free_bytes = inf;
    double fastest = inf;
    for_each_split(units, p, [&](std::vector<int> const& first) { fastest = std::min(fastest, slowest_1f1b(unlimited, first)); });
    if (best != inf && best > fastest) ++memory_binds;
    nn::Sequential const model = linears(units);
    pp::Schedule const schedule = pp::one_f_one_b(p, k.micro_batches);
    if (best == inf) {
      ++infeasible;
      REQUIRE_MGPU_ERROR(pp::partition(model, schedule, k.profile, k.devices, {.optimizer_states = k.optimizer_states}),
                         mgpu::Errc::out_of_memory, "fits in memory");
      continue;
    }
    ++feasible;
    pp::Partition const plan = pp::partition(model, schedule, k.profile, k.devices, {.optimizer_states = k.optimizer_states});
    REQUIRE(plan.cuts.size() == static_cast<std::size_t>(p) + 1);
    std::vector<int> const first(plan.cuts.begin(), plan.cuts.end());  // one layer per unit
    CHECK(slowest_1f1b(k, first) == Approx(best).epsilon(1e-12));       // fits, and is optimal
    CHECK(*std::max_element(plan.chunk_seconds.begin(), plan.chunk_seconds.end()) == Approx(best).epsilon(1e-12));
    for (int d = 0; d < p; ++d) {
      CHECK(plan.device[static_cast<std::size_t>(d)] == d);
      CHECK(plan.chunk_bytes[static_cast<std::size_t>(d)] <= plan.free_bytes[static_cast<std::size_t>(d)]);
    }
  }
  CHECK(feasible > 100);
  CHECK(infeasible > 20);
  CHECK(memory_binds > 20);  // splits where the fastest one does not fit
}

TEST_CASE("with interleaving, chunk c runs at the speed of device c % P, optimally", "[parallel][partition]") {
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> cost(0.1, 4.0);
  for (int trial = 0; trial < 100; ++trial) {
    int const p = 1 + static_cast<int>(rng() % 3);
    int const chunks = 2 * p;
    int const units = chunks + static_cast<int>(rng() % 4);
    pp::LayerProfile profile{{}, std::vector<double>(static_cast<std::size_t>(units), 0.0), std::vector<double>(static_cast<std::size_t>(units), 0.0)};
    for (int u = 0; u < units; ++u) profile.seconds.push_back(cost(rng));
    std::vector<pp::StageDevice> devices;
    for (int d = 0; d < p; ++d) devices.push_back({d % 2 == 0 ? 1.0 : 0.5});
    CAPTURE(trial, p, units);
    double best = inf;
    for_each_split(units, chunks, [&](std::vector<int> const& first) {
      double worst = 0;
      for (int c = 0; c < chunks; ++c) {
        double s = 0;
        for (int u = first[static_cast<std::size_t>(c)]; u < first[static_cast<std::size_t>(c) + 1]; ++u) s += profile.seconds[static_cast<std::size_t>(u)];
        worst = std::max(worst, s / devices[static_cast<std::size_t>(c % p)].speed);
      }
      best = std::min(best, worst);
    });
    pp::Partition const plan = pp::partition(linears(units), pp::interleaved_one_f_one_b(p, 2, p), profile, devices);
    CHECK(*std::max_element(plan.chunk_seconds.begin(), plan.chunk_seconds.end()) == Approx(best).epsilon(1e-12));
    for (int c = 0; c < chunks; ++c) CHECK(plan.device[static_cast<std::size_t>(c)] == c % p);
  }
}

TEST_CASE("an impossible partition names the chunk, device, bytes needed and free; bad input is rejected", "[parallel][partition]") {
  nn::Sequential const model = linears(2);
  // 1F1B on 2 devices with 2 micro-batches: device 0 holds 2 in flight, device 1 one. Each unit:
  // 100 B of parameters (x 3 with momentum SGD) and 10 B of activations per micro-batch.
  pp::LayerProfile const profile{{1.0, 1.0}, {100.0, 100.0}, {10.0, 10.0}};
  pp::Schedule const schedule = pp::one_f_one_b(2, 2);
  pp::Partition const plan = pp::partition(model, schedule, profile, {{1.0, 320.0}, {0.5, 310.0}});
  CHECK(plan.cuts == std::vector<std::size_t>{0, 1, 2});
  CHECK(plan.chunk_seconds == std::vector<double>{1.0, 2.0});
  CHECK(plan.chunk_bytes == std::vector<double>{320.0, 310.0});
  CHECK(pp::to_string(plan) == "chunk 0 on device 0: layers [0, 1), 1 s, 320 B of 320 B free\n"
                               "chunk 1 on device 1: layers [1, 2), 2 s, 310 B of 310 B free\n");
  REQUIRE_MGPU_ERROR(pp::partition(model, schedule, profile, {{1.0, 320.0}, {0.5, 309.0}}), mgpu::Errc::out_of_memory,
                     "at best chunk 1 (layers [1, 2)) on device 1 needs 310 B (300 B of parameters, gradients and optimizer state, "
                     "10 B for 1 micro-batches in flight) but has 309 B free");
  REQUIRE_MGPU_ERROR(pp::partition(model, schedule, profile, {{1.0, inf}}), mgpu::Errc::invalid_argument,
                     "over 1 devices for a schedule of 2 (expected one device per schedule device)");
  REQUIRE_MGPU_ERROR(pp::partition(model, schedule, profile, {{1.0, inf}, {0.0, inf}}), mgpu::Errc::invalid_argument,
                     "device 1 of speed 0.000000 (expected a finite speed > 0)");
  REQUIRE_MGPU_ERROR(pp::partition(model, schedule, {{1.0}, {0.0}, {0.0}}, {{}, {}}), mgpu::Errc::invalid_argument,
                     "costs for 1 layers (expected 2, one per layer)");
  REQUIRE_MGPU_ERROR(pp::partition(model, schedule, {{1.0, -1.0}, {0.0, 0.0}, {0.0, 0.0}}, {{}, {}}), mgpu::Errc::invalid_argument,
                     "for layer 1 (expected a finite value >= 0)");
  REQUIRE_MGPU_ERROR(pp::partition(model, pp::one_f_one_b(3, 2), {{1, 1}, {0, 0}, {0, 0}}, {{}, {}, {}}), mgpu::Errc::invalid_argument,
                     "3 stages of a model of 2 units");
  REQUIRE_MGPU_ERROR(pp::partition(model, schedule, profile, {{}, {}}, {.optimizer_states = -1}), mgpu::Errc::invalid_argument,
                     "-1 optimizer states");
}

TEST_CASE("stage_devices reads speed and free memory off the group", "[parallel][partition]") {
  mgpu::DeviceGroup group("host:2@speed=1,0.5");
  group.allocator(1).set_limit(std::size_t{1} << 20);
  auto const devices = pp::stage_devices(group, 2);
  REQUIRE(devices.size() == 2);
  CHECK(devices[0].speed == 1.0);
  CHECK(devices[1].speed == 0.5);
  CHECK(devices[0].free_bytes > static_cast<double>(std::size_t{1} << 20));
  CHECK(devices[1].free_bytes == static_cast<double>((std::size_t{1} << 20) - group.allocator(1).stats().allocated));
  // Two replicas of a 2-device pipeline: each pipeline device is its slowest, least free rank.
  mgpu::DeviceGroup grid("host:4@speed=1,1,0.5,1");
  grid.allocator(1).set_limit(std::size_t{1} << 20);
  auto const stages = pp::stage_devices(grid, 2);
  REQUIRE(stages.size() == 2);
  CHECK(stages[0].speed == 0.5);  // ranks 0 and 2
  CHECK(stages[1].speed == 1.0);  // ranks 1 and 3
  CHECK(stages[1].free_bytes == static_cast<double>((std::size_t{1} << 20) - grid.allocator(1).stats().allocated));
  REQUIRE_MGPU_ERROR(pp::stage_devices(grid, 3), mgpu::Errc::invalid_argument, "3 pipeline devices of a group of 4 (expected a divisor");
}

TEST_CASE("profiling on a speed-emulated rank 0 reports the fastest device's costs", "[parallel][partition]") {
  constexpr double nominal = 10e-3;
  auto const ledger = std::make_shared<std::atomic<double>>(0.0);
  nn::Sequential const model = costly(1, nominal / 2, ledger);  // 10 ms per forward + backward
  for (auto const& [spec, speed] : {std::pair{"host:1", 1.0}, std::pair{"host:2@speed=0.5,1", 0.5}}) {
    CAPTURE(spec);
    mgpu::DeviceGroup group(spec);
    // Rank 0 at half speed takes twice as long; scaled back, its cost is the fastest device's.
    // Two of the five runs are disturbed (a loaded machine's late wake-ups): the median is not.
    pp::LayerProfile const profile =
        pp::profile_layers(model, group, {4, 8}, 5, ledger_timer(ledger, speed, {0.0, 0.5, 0.0, 0.0, 1.0}));
    CHECK(profile.seconds[0] == 0.0);  // the Linear: nothing in the ledger
    CHECK(profile.seconds[1] == Approx(nominal).epsilon(1e-12));
    CHECK(profile.parameter_bytes == std::vector<double>{8 * 8 * 4 + 8 * 4, 0.0});
    CHECK(profile.activation_bytes[0] >= 4 * 8 * 4);  // at least the Linear's output
  }
  mgpu::DeviceGroup one("host:1");
  REQUIRE_MGPU_ERROR(pp::profile_layers(model, one, {4, 8}, 0), mgpu::Errc::invalid_argument,
                     "0 repeats (expected >= 1)");
}

TEST_CASE("profile_layers times with the steady clock by default", "[parallel][partition]") {
  // A lower bound only: a unit never takes less than the time its work sleeps.
  mgpu::DeviceGroup group("host:1");
  nn::Sequential model;
  class Sleep final : public nn::Layer {
   public:
    std::string name() const override { return "Sleep"; }
    Tensor forward(Tensor const& x, nn::Context& ctx) override {
      ctx.stream.enqueue([] { std::this_thread::sleep_for(std::chrono::milliseconds(2)); });
      return x;
    }
    Tensor backward(Tensor const& dy, nn::Context&) override { return dy; }
    std::unique_ptr<nn::Layer> clone() const override { return std::make_unique<Sleep>(); }
  };
  model.add(std::make_unique<Sleep>());
  CHECK(pp::profile_layers(model, group, {4, 8}, 1).seconds[0] >= 2e-3);
}

TEST_CASE("on host:2@speed=1,0.5 the planned cuts give the faster device more layers", "[parallel][partition]") {
  mgpu::DeviceGroup group("host:2@speed=1,0.5");
  // 16 units: 8 Linears that cost nothing and 8 units of 4 ms per micro-batch.
  auto const ledger = std::make_shared<std::atomic<double>>(0.0);
  nn::Sequential const model = costly(8, 2e-3, ledger);
  pp::Schedule const schedule = pp::one_f_one_b(2, 2);
  pp::LayerProfile const profile = pp::profile_layers(model, group, {4, 8}, 3, ledger_timer(ledger, 1.0));
  for (std::size_t l = 0; l < profile.seconds.size(); ++l) CHECK(profile.seconds[l] == Approx(l % 2 == 1 ? 4e-3 : 0.0));
  pp::Partition const plan = pp::partition(model, schedule, profile, pp::stage_devices(group, 2));
  INFO(pp::to_string(plan));
  CHECK(plan.cuts[1] > 16 - plan.cuts[1]);  // device 0 gets more layers
  // Ideally 5 or 6 of the 8 sleeps on device 0 (5.33 balances 4 ms against 8 ms per sleep).
  CHECK(plan.cuts[1] >= 10);
  CHECK(plan.cuts[1] <= 12);
  // That the planned step is faster than the even split's is a wall-clock measure, so it lives in
  // bench_pipeline (BM_partition's planned_step_vs_even_step), not in a test.
}
