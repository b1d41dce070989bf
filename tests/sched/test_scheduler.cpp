// The scheduler framework and its plugins on constructed node states.
#include <mgpu/sched/planning.hpp>
#include <mgpu/sched/scheduler.hpp>

#include <atomic>
#include <functional>
#include <limits>
#include <numeric>
#include <algorithm>
#include <random>
#include <thread>

#include "support/catch.hpp"
#include "support/expect_error.hpp"

using namespace mgpu::sched;
using mgpu::Errc;

namespace {
NodeState node_of(int n, double memory = 80e9) {
  NodeState node;
  for (int i = 0; i < n; ++i) {
    DeviceState d;
    d.id = i;
    d.type = "A100";
    d.capacity_bytes = d.free_bytes = memory;
    d.links.assign(static_cast<std::size_t>(n), 0.1);
    node.devices.push_back(d);
  }
  return node;
}

Scheduler only(std::unique_ptr<ScorePlugin> score) {
  Scheduler s;
  s.add(memory_fit());
  s.add(capability());
  s.add(std::move(score), 1);
  return s;
}
}  // namespace

TEST_CASE("memory-fit and capability filters exclude devices", "[sched]") {
  NodeState node = node_of(4);
  node.devices[0].free_bytes = 10e9;
  node.devices[1].free_bytes = 10e9;
  node.devices[2].type = "V100";
  Request r{.name = "big", .devices = 1, .memory_bytes = 20e9, .allowed_types = "A100|H100"};
  auto const s = Scheduler::default_profile();
  auto const p = s.place(r, node);
  REQUIRE(p);
  CHECK(p->devices == std::vector<int>{3});
  r.devices = 2;
  CHECK_FALSE(s.place(r, node));  // only one device passes both filters
  r.allowed_types = "";
  CHECK(s.place(r, node)->devices == std::vector<int>{2, 3});
}

TEST_CASE("least-loaded picks the idlest device, weighed by speed", "[sched]") {
  NodeState node = node_of(4);
  node.devices[0].queued_seconds = 30;
  node.devices[1].queued_seconds = 5;
  node.devices[2].queued_seconds = 20;
  node.devices[3].queued_seconds = 12;
  node.devices[3].speed = 4;  // 3 s at its speed: the least loaded
  CHECK(only(least_loaded()).place({.name = "t"}, node)->devices == std::vector<int>{3});
}

TEST_CASE("locality picks the device that holds the data", "[sched]") {
  NodeState node = node_of(4);
  node.devices[2].data.insert("imagenet");
  Request r{.name = "t", .data = "imagenet", .data_bytes = 100e9};
  CHECK(only(locality()).place(r, node)->devices == std::vector<int>{2});
  CHECK(Scheduler::default_profile().place(r, node)->devices == std::vector<int>{2});
}

TEST_CASE("topology picks linked pairs and sets", "[sched]") {
  NodeState node = node_of(6);
  auto const link = [&](int a, int b, double q) {
    node.devices[static_cast<std::size_t>(a)].links[static_cast<std::size_t>(b)] = q;
    node.devices[static_cast<std::size_t>(b)].links[static_cast<std::size_t>(a)] = q;
  };
  link(0, 1, 0.5);
  link(3, 4, 1.0);
  link(4, 5, 1.0);
  link(3, 5, 1.0);
  auto const s = only(topology());
  CHECK(s.place({.name = "pair", .devices = 2}, node)->devices == std::vector<int>{3, 4});
  CHECK(s.place({.name = "three", .devices = 3}, node)->devices == std::vector<int>{3, 4, 5});
  CHECK(Scheduler::default_profile().place({.name = "pair", .devices = 2}, node)->devices == std::vector<int>{3, 4});
}

TEST_CASE("heterogeneity, energy and interference prefer what they say", "[sched]") {
  NodeState node = node_of(3);
  node.devices[1].speed = 2;
  node.devices[2].speed = 1.5;
  node.devices[0].max_watts = 300;
  node.devices[1].max_watts = 700;
  node.devices[2].max_watts = 350;
  CHECK(only(heterogeneity()).place({.name = "t"}, node)->devices == std::vector<int>{1});
  CHECK(only(energy()).place({.name = "t"}, node)->devices == std::vector<int>{2});  // 1.5/350 beats 2/700 and 1/300
  node.devices[0].bandwidth_heavy = 1;
  node.devices[1].bandwidth_heavy = 2;
  CHECK(only(interference()).place({.name = "t", .bandwidth_heavy = true}, node)->devices == std::vector<int>{2});
}

TEST_CASE("A user's own plugin joins with a weight", "[sched]") {
  struct PreferIdleMemory final : ScorePlugin {
    std::string_view name() const override { return "prefer-idle-memory"; }
    double score(Request const&, DeviceState const& d, NodeState const&) const override { return d.free_bytes / d.capacity_bytes; }
  };
  NodeState node = node_of(3);
  node.devices[0].free_bytes = 10e9;
  node.devices[2].free_bytes = 70e9;
  node.devices[1].free_bytes = 40e9;
  auto s = Scheduler::default_profile();
  s.add(std::make_unique<PreferIdleMemory>(), 10);
  CHECK(s.place({.name = "t"}, node)->devices == std::vector<int>{2});
  s.set_weight("prefer-idle-memory", 0);
  s.remove("heterogeneity");
  CHECK(s.plugin_names().size() == 7);
}

TEST_CASE("Invalid requests and unknown plugins are rejected clearly", "[sched]") {
  NodeState const node = node_of(4);
  auto s = Scheduler::default_profile();
  REQUIRE_MGPU_ERROR(s.place({.name = "zero", .devices = 0}, node), Errc::invalid_argument, "request 'zero': asks for 0.000000 devices");
  REQUIRE_MGPU_ERROR(s.place({.name = "many", .devices = 5}, node), Errc::invalid_argument, "asks for 5 devices, the node has 4");
  REQUIRE_MGPU_ERROR(s.place({.name = "odd", .devices = 1.5}, node), Errc::invalid_argument, "expected a whole number above 1");
  REQUIRE_MGPU_ERROR(s.place({.name = "neg", .memory_bytes = -1}, node), Errc::invalid_argument, "expected >= 0");
  REQUIRE_MGPU_ERROR(s.set_weight("no-such", 1), Errc::invalid_argument, "no plugin named 'no-such' (expected one of: memory-fit");
  REQUIRE_MGPU_ERROR(s.remove("no-such"), Errc::invalid_argument, "no plugin named 'no-such'");
  REQUIRE_MGPU_ERROR(s.add(least_loaded(), -1), Errc::invalid_argument, "expected a finite weight >= 0");
}

TEST_CASE("Memory is never over-committed under concurrent binds", "[sched]") {
  Node node(node_of(4, 10e9));
  auto const scheduler = Scheduler::default_profile();
  std::atomic<bool> over{false};
  std::atomic<int> placed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<unsigned>(t));
      std::uniform_real_distribution<double> gb(1, 4);
      std::vector<std::pair<Request, Placement>> held;
      for (int i = 0; i < 400; ++i) {
        Request r{.name = "r", .devices = 0.25, .memory_bytes = gb(rng) * 1e9, .work_seconds = 1};
        if (auto p = node.schedule(r, scheduler)) {
          held.emplace_back(r, *p);
          ++placed;
        }
        for (auto const& d : node.snapshot().devices) {
          if (d.free_bytes < 0 || d.free_share < -1e-9) over = true;
        }
        if (held.size() > 3 || (i % 5 == 0 && !held.empty())) {
          node.release(held.front().first, held.front().second);
          held.erase(held.begin());
        }
      }
      for (auto const& [r, p] : held) node.release(r, p);
    });
  }
  for (auto& t : threads) t.join();
  CHECK_FALSE(over);
  CHECK(placed > 100);
  for (auto const& d : node.snapshot().devices) {
    CHECK(d.free_bytes == Approx(10e9));
    CHECK(d.free_share == Approx(1.0));
  }
}

TEST_CASE("Pipeline partition matches brute force; stages follow speed, links and memory", "[sched]") {
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> cost(0.1, 2.0);
  for (int trial = 0; trial < 200; ++trial) {
    int const layers = 3 + trial % 6;
    int const stages = 1 + trial % std::min(layers, 4);
    NodeState node = node_of(4, 1e9 * (1 + trial % 3));
    for (auto& d : node.devices) d.speed = 1 + static_cast<double>((d.id * 7 + trial) % 3);
    std::vector<double> seconds;
    std::vector<double> bytes;
    for (int l = 0; l < layers; ++l) {
      seconds.push_back(cost(rng));
      bytes.push_back(0.4e9 * cost(rng));
    }
    std::vector<int> const order = pipeline_order(node, {0, 1, 2, 3});
    // Brute force over every way to cut the layers into `stages` non-empty runs.
    double best = std::numeric_limits<double>::infinity();
    std::function<void(int, int, double)> search = [&](int stage, int from, double worst) {
      if (stage == stages) {
        if (from == layers) best = std::min(best, worst);
        return;
      }
      DeviceState const& d = node.devices[static_cast<std::size_t>(order[static_cast<std::size_t>(stage)])];
      double c = 0;
      double b = 0;
      for (int to = from + 1; to <= layers - (stages - stage - 1); ++to) {
        c += seconds[static_cast<std::size_t>(to) - 1];
        b += bytes[static_cast<std::size_t>(to) - 1];
        if (b > d.free_bytes) break;
        search(stage + 1, to, std::max(worst, c / d.speed));
      }
    };
    search(0, 0, 0);
    INFO("trial " << trial << ": " << layers << " layers, " << stages << " stages");
    if (std::isinf(best)) {
      REQUIRE_MGPU_ERROR(partition(seconds, bytes, node, {0, 1, 2, 3}, stages), Errc::out_of_memory, "fits");
      continue;
    }
    StagePlan const plan = partition(seconds, bytes, node, {0, 1, 2, 3}, stages);
    REQUIRE(plan.bottleneck_seconds == Approx(best));
    REQUIRE(plan.first_layer.front() == 0);
    REQUIRE(plan.first_layer.back() == layers);
    REQUIRE(plan.device.front() == order.front());
  }
  REQUIRE_MGPU_ERROR(partition({1, 1}, {1, 1}, node_of(2), {0, 1}, 3), Errc::invalid_argument, "expected 1 <= stages <= layers");
}

TEST_CASE("Tensor-parallel groups sit on the best links: an exhaustive search's weakest links, islands kept together", "[sched]") {
  auto const set_link = [](NodeState& node, int a, int b, double quality) {
    node.devices[static_cast<std::size_t>(a)].links[static_cast<std::size_t>(b)] = quality;
    node.devices[static_cast<std::size_t>(b)].links[static_cast<std::size_t>(a)] = quality;
  };
  SECTION("equal links keep the order; pairs joined by the better links are grouped") {
    NodeState node = node_of(4);
    CHECK(tensor_parallel_order(node, {0, 1, 2, 3}, 2) == std::vector<int>{0, 1, 2, 3});
    CHECK(tensor_parallel_order(node, {3, 1, 2, 0}, 2) == std::vector<int>{3, 1, 2, 0});
    set_link(node, 0, 2, 1.0);
    set_link(node, 1, 3, 1.0);
    CHECK(tensor_parallel_order(node, {0, 1, 2, 3}, 2) == std::vector<int>{0, 2, 1, 3});
    CHECK(tensor_parallel_order(node, {0, 1, 2, 3}, 4) == std::vector<int>{0, 1, 2, 3});  // one group: as given
    CHECK(tensor_parallel_order(node, {0, 1, 2, 3}, 1) == std::vector<int>{0, 1, 2, 3});
  }
  SECTION("the best partner of the first device is not taken when that strands a pair without a link") {
    NodeState node = node_of(4);
    for (auto& d : node.devices) d.links.assign(4, 0.0);
    set_link(node, 0, 1, 0.9);
    set_link(node, 1, 3, 0.9);
    set_link(node, 0, 2, 0.8);
    CHECK(tensor_parallel_order(node, {0, 1, 2, 3}, 2) == std::vector<int>{0, 2, 1, 3});
  }
  SECTION("two NVLink islands of four on eight GPUs form the two groups of four") {
    NodeState node = node_of(8);
    for (int a : {0, 1, 4, 5})
      for (int b : {0, 1, 4, 5})
        if (a != b) set_link(node, a, b, 1.0);
    for (int a : {2, 3, 6, 7})
      for (int b : {2, 3, 6, 7})
        if (a != b) set_link(node, a, b, 1.0);
    CHECK(tensor_parallel_order(node, {0, 1, 2, 3, 4, 5, 6, 7}, 4) == std::vector<int>{0, 1, 4, 5, 2, 3, 6, 7});
  }
  SECTION("random links: the grouping scores as the best of every permutation cut into groups") {
    std::mt19937 rng(11);
    std::uniform_real_distribution<double> quality(0.0, 1.0);
    for (std::pair<int, int> const& shape : {std::pair{6, 2}, std::pair{6, 3}, std::pair{8, 2}, std::pair{8, 4}}) {
      int const n = shape.first, size = shape.second;  // not a structured binding: Clang before 16 cannot capture those
      for (int trial = 0; trial < 5; ++trial) {
        NodeState node = node_of(n);
        for (auto& d : node.devices)
          for (double& l : d.links) l = quality(rng);  // not symmetric: a link is its slower direction
        auto const link = [&](int a, int b) {
          return std::min(node.devices[static_cast<std::size_t>(a)].links[static_cast<std::size_t>(b)],
                          node.devices[static_cast<std::size_t>(b)].links[static_cast<std::size_t>(a)]);
        };
        auto const score = [&](std::vector<int> const& order) {
          double worst = 1e300, sum = 0;
          for (std::size_t g = 0; g < order.size(); g += static_cast<std::size_t>(size)) {
            double weakest = 1e300;
            for (std::size_t a = g; a < g + static_cast<std::size_t>(size); ++a)
              for (std::size_t b = a + 1; b < g + static_cast<std::size_t>(size); ++b) weakest = std::min(weakest, link(order[a], order[b]));
            worst = std::min(worst, weakest);
            sum += weakest;
          }
          return std::pair{worst, sum};
        };
        std::vector<int> ids(static_cast<std::size_t>(n));
        std::iota(ids.begin(), ids.end(), 0);
        std::pair<double, double> best{-1, -1};
        std::vector<int> perm = ids;
        do {
          auto const s = score(perm);
          if (s.first > best.first + 1e-12 || (s.first > best.first - 1e-12 && s.second > best.second)) best = s;
        } while (std::next_permutation(perm.begin(), perm.end()));
        std::vector<int> const order = tensor_parallel_order(node, ids, size);
        INFO(n << " devices in groups of " << size << ", trial " << trial);
        std::vector<int> sorted = order;
        std::sort(sorted.begin(), sorted.end());
        CHECK(sorted == ids);
        auto const got = score(order);
        CHECK(got.first == Approx(best.first));
        CHECK(got.second == Approx(best.second));
      }
    }
  }
  SECTION("a group size that does not divide the devices, or an unknown id, is refused") {
    NodeState const node = node_of(4);
    REQUIRE_MGPU_ERROR(tensor_parallel_order(node, {0, 1, 2, 3}, 3), Errc::invalid_argument, "groups of 3 from 4 devices");
    REQUIRE_MGPU_ERROR(tensor_parallel_order(node, {0, 1, 2, 3}, 0), Errc::invalid_argument, "groups of 0");
    REQUIRE_MGPU_ERROR(tensor_parallel_order(node, {0, 9}, 2), Errc::invalid_argument, "device 9 is not in the node");
  }
}

TEST_CASE("Shard weights follow speed and backlog", "[sched]") {
  NodeState node = node_of(3);
  node.devices[1].speed = 2;
  node.devices[2].queued_seconds = 1;  // a step's worth of backlog: half its share
  auto const w = shard_weights(node, {0, 1, 2});
  CHECK(w[0] == Approx(1.0));
  CHECK(w[1] == Approx(2.0));
  CHECK(w[2] == Approx(0.5));
}

TEST_CASE("The runtime predictor learns per task and device type and reports its error", "[sched]") {
  RuntimePredictor p;
  CHECK(p.predict("train", "A100", 100) == 100);  // no history: the nominal duration
  for (int i = 1; i <= 40; ++i) {
    double const size = 10.0 * (i % 7 + 1);
    p.observe("train", "A100", size, 5 + 0.5 * size);  // a fixed start-up plus a per-size rate
  }
  CHECK(p.predict("train", "A100", 200) == Approx(105).epsilon(0.01));
  CHECK(p.predict("train", "V100", 200) == 200);
  auto const a = p.accuracy();
  CHECK(a.samples == 40);
  CHECK(a.mean_absolute_percentage_error < 20);  // early guesses are off; later ones exact
  NodeState node = node_of(2);
  node.devices[0].type = "A100";
  node.devices[1].type = "V100";
  auto s = only(predicted_finish(p));
  CHECK(s.place({.name = "t", .work_seconds = 200, .task_type = "train"}, node)->devices == std::vector<int>{0});
}

TEST_CASE("The energy plugin caps power at the energy-optimal limit, raised just enough for a deadline", "[sched]") {
  NodeState node = node_of(2);
  for (auto& d : node.devices) {
    d.max_watts = 700;
    d.idle_watts = 100;
    d.min_power_limit = 200;
  }
  node.devices[1].min_power_limit = 0;  // this one's limit cannot be set
  // Brute force over a 1 W grid: the limit with the least energy per unit of work, P / speed(P).
  DeviceState const& d = node.devices[0];
  double best = 0;
  double best_energy = INFINITY;
  for (double w = d.min_power_limit; w <= d.max_watts; w += 1) {
    double const e = w / speed_at_power(d, w, node.power_exponent);
    if (e < best_energy) {
      best_energy = e;
      best = w;
    }
  }
  CHECK(energy_optimal_power(d, node.power_exponent) == Approx(best).margin(1.0));
  CHECK(energy_optimal_power(node.devices[1], node.power_exponent) == 700);
  CHECK(speed_at_power(d, 700, node.power_exponent) == 1.0);
  CHECK(speed_at_power(d, 400, node.power_exponent) == Approx(std::cbrt(0.5)));

  auto const s = only(energy());
  auto const both = s.place({.name = "pair", .devices = 2, .work_seconds = 100}, node);
  REQUIRE(both->power_limits.size() == 2);
  CHECK(both->power_limits[0] == Approx(best).margin(1.0));
  CHECK(both->power_limits[1] == 0);  // left alone
  // With a deadline: the lowest limit that meets it (checked against the speed model).
  node.devices[0].queued_seconds = 20;
  auto const urgent = s.place({.name = "urgent", .devices = 2, .work_seconds = 100, .deadline_seconds = 150}, node);
  double const limit = urgent->power_limits[0];
  auto const finish = [&](double w) { return 20 + 100 / speed_at_power(node.devices[0], w, node.power_exponent); };
  CHECK(finish(limit) <= 150);
  CHECK(finish(limit - 1) > 150);
  CHECK(limit > best);
}

TEST_CASE("interference keeps bandwidth-heavy sets off busy links", "[sched]") {
  NodeState node = node_of(3);
  for (auto& d : node.devices) d.links.assign(3, 1.0);
  node.devices[0].link_heavy = {0, 2, 0};
  node.devices[1].link_heavy = {2, 0, 0};
  auto const s = only(interference());
  auto const heavy = s.place({.name = "allreduce", .devices = 2, .bandwidth_heavy = true}, node);
  CHECK(heavy->devices != std::vector<int>{0, 1});
  // Binding a heavy pair loads its link; releasing unloads it.
  NodeState fresh = node_of(2);
  Request const r{.name = "a", .devices = 2, .bandwidth_heavy = true};
  Placement const p{.devices = {0, 1}};
  REQUIRE(reserve(fresh, r, p));
  CHECK(fresh.devices[0].link_heavy[1] == 1);
  CHECK(fresh.devices[1].link_heavy[0] == 1);
  unreserve(fresh, r, p);
  CHECK(fresh.devices[0].link_heavy[1] == 0);
}

TEST_CASE("Gang placement matches an exhaustive search on small nodes", "[sched]") {
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> u(0, 1);
  auto const s = only(topology());
  for (int trial = 0; trial < 20; ++trial) {
    NodeState node = node_of(6);
    for (int a = 0; a < 6; ++a)
      for (int b = a + 1; b < 6; ++b) {
        double const q = u(rng) < 0.5 ? 1.0 : 0.1;
        node.devices[static_cast<std::size_t>(a)].links[static_cast<std::size_t>(b)] = q;
        node.devices[static_cast<std::size_t>(b)].links[static_cast<std::size_t>(a)] = q;
      }
    // The best pair by exhaustive search; the greedy growth from every seed finds it for k = 2.
    double best = -1;
    for (int a = 0; a < 6; ++a)
      for (int b = a + 1; b < 6; ++b) best = std::max(best, node.devices[static_cast<std::size_t>(a)].links[static_cast<std::size_t>(b)]);
    auto const p = s.place({.name = "pair", .devices = 2}, node);
    CHECK(node.devices[static_cast<std::size_t>(p->devices[0])].links[static_cast<std::size_t>(p->devices[1])] == best);
  }
}
