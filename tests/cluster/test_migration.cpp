// Migration and the offline bound: the defragmenter's moves keep every node within capacity
// (recomputed from scratch) and are charged their downtime; the bound is the optimum of an
// exhaustive search on small instances (exact) or below it (relaxation), and below every policy's
// fill, with and without migration.
#include <algorithm>
#include <cmath>
#include <map>
#include <random>

#include <mgpu/cluster/bound.hpp>
#include <mgpu/cluster/cluster.hpp>
#include <mgpu/cluster/defrag.hpp>
#include <mgpu/cluster/policy.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"

using namespace mgpu::cluster;
using mgpu::Errc;

namespace {

// The most GPU share any placement of a subset of pods[i..] adds to `cluster`: every pod left out
// or put on every node and every set of GPUs with room, in turn.
std::int64_t best_allocation(Cluster& cluster, std::vector<Demand> const& pods, std::size_t i) {
  if (i == pods.size()) return cluster.gpu_allocated_milli();
  std::int64_t best = best_allocation(cluster, pods, i + 1);
  Demand const& d = pods[i];
  for (int n = 0; n < static_cast<int>(cluster.nodes().size()); ++n) {
    if (!cluster.fits(d, n)) continue;
    auto const gpus = static_cast<int>(cluster.free_gpus(n).size());
    for (unsigned set = 0; set < (1u << gpus); ++set) {
      Allocation a{n, {}, d.gpus > 0 ? d.gpu_milli : 0, d.cpu_milli, d.memory_mib};
      bool room = true;
      for (int g = 0; g < gpus; ++g) {
        if (!(set >> g & 1)) continue;
        a.gpus.push_back(g);
        room = room && cluster.free_gpus(n)[static_cast<std::size_t>(g)] >= d.gpu_milli;
      }
      if (!room || static_cast<int>(a.gpus.size()) != d.gpus) continue;
      cluster.allocate(a);
      best = std::max(best, best_allocation(cluster, pods, i + 1));
      cluster.release(a);
    }
  }
  return best;
}

// A small random cluster (2-3 nodes of 1-2 GPUs, models X and Y) and pods for it.
std::pair<std::vector<NodeSpec>, std::vector<Demand>> small_instance(std::mt19937& rng) {
  auto const uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  std::vector<NodeSpec> nodes;
  int const count = uniform(2, 3);
  for (int n = 0; n < count; ++n)
    nodes.push_back({"n" + std::to_string(n), 1000 * uniform(4, 16), 1000 * uniform(4, 16), uniform(1, 2),
                     n == 0 || uniform(0, 1) == 0 ? "X" : "Y"});
  std::vector<Demand> pods;
  int const shares[] = {200, 300, 450, 500, 600, 700, 1000, 1000};
  for (int i = 0; i < 5; ++i) {
    Demand d;
    d.cpu_milli = 500 * uniform(1, 12);
    d.memory_mib = 500 * uniform(1, 12);
    d.gpus = uniform(0, 9) == 0 ? 0 : uniform(0, 4) == 0 ? 2 : 1;
    d.gpu_milli = d.gpus == 0 ? 0 : d.gpus > 1 ? 1000 : shares[uniform(0, 7)];
    if (d.gpus > 0 && uniform(0, 3) == 0) d.models = std::uint64_t{1} << uniform(0, 1);  // X or Y only
    pods.push_back(d);
  }
  return {nodes, pods};
}

// Every node's free GPU share, CPU and memory recomputed from the capacities and `allocations`,
// checked within capacity and against what `cluster` reports.
void check_capacity(Cluster const& cluster, std::vector<Allocation> const& allocations) {
  std::vector<NodeSpec> const& nodes = cluster.nodes();
  std::vector<std::vector<int>> gpu(nodes.size());
  std::vector<int> cpu(nodes.size(), 0), memory(nodes.size(), 0);
  for (std::size_t n = 0; n < nodes.size(); ++n) gpu[n].assign(static_cast<std::size_t>(nodes[n].gpus), 0);
  for (Allocation const& a : allocations) {
    auto const n = static_cast<std::size_t>(a.node);
    for (int g : a.gpus) gpu[n][static_cast<std::size_t>(g)] += a.gpu_milli;
    cpu[n] += a.cpu_milli;
    memory[n] += a.memory_mib;
  }
  for (std::size_t n = 0; n < nodes.size(); ++n) {
    INFO("node " << n);
    REQUIRE(cpu[n] <= nodes[n].cpu_milli);
    REQUIRE(memory[n] <= nodes[n].memory_mib);
    CHECK(cluster.free_cpu(static_cast<int>(n)) == nodes[n].cpu_milli - cpu[n]);
    CHECK(cluster.free_memory(static_cast<int>(n)) == nodes[n].memory_mib - memory[n]);
    for (std::size_t g = 0; g < gpu[n].size(); ++g) {
      REQUIRE(gpu[n][g] <= 1000);
      CHECK(cluster.free_gpus(static_cast<int>(n))[g] == 1000 - gpu[n][g]);
    }
  }
}

}  // namespace

TEST_CASE("Bound: the exact program is an exhaustive search's optimum, the relaxation below it", "[cluster][bound]") {
  std::mt19937 rng(11);
  int nontrivial = 0;
  for (int instance = 0; instance < 40; ++instance) {
    INFO("instance " << instance);
    auto [nodes, pods] = small_instance(rng);
    Cluster cluster(nodes);
    for (Demand& d : pods)
      if (d.models != ~std::uint64_t{0} && cluster.models().size() == 1) d.models = 1;  // only X here
    double const capacity = static_cast<double>(cluster.gpu_capacity_milli());
    double const optimum = 1.0 - static_cast<double>(best_allocation(cluster, pods, 0)) / capacity;
    double const exact = unallocated_bound(cluster, pods, BoundMethod::exact);
    CHECK(exact == Approx(optimum).margin(1e-12));
    CHECK(unallocated_bound(cluster, pods, BoundMethod::relaxation) <= optimum + 1e-12);
    std::int64_t demand = 0;
    for (Demand const& d : pods) demand += static_cast<std::int64_t>(d.gpus) * d.gpu_milli;
    // Instances where not every pod fits, so the bound is more than the demand that did not arrive.
    if (optimum > std::max(0.0, 1.0 - static_cast<double>(demand) / capacity) + 1e-9) ++nontrivial;
    // Greedy placement in arrival order under every policy leaves at least the optimum.
    for (FitPolicy policy : all_fit_policies()) {
      Cluster greedy(nodes);
      Placer placer(policy, TieRule::first, {{Demand{}, 1.0}}, 1);
      for (Demand const& d : pods)
        if (auto a = placer.choose(greedy, d)) greedy.allocate(*a);
      CHECK(1.0 - static_cast<double>(greedy.gpu_allocated_milli()) / capacity >= exact - 1e-12);
    }
  }
  CHECK(nontrivial >= 10);  // the instances do test packing, not only the arrived demand
  Cluster const no_gpus({{"c", 1000, 1000, 0, ""}});
  REQUIRE_MGPU_ERROR(unallocated_bound(no_gpus, std::vector<Demand>{}), Errc::invalid_argument, "without GPUs");
  auto const big = synthetic_cluster({.nodes = 1213, .seed = 1});  // 6,212 GPUs x 3 fractional types
  std::vector<Demand> many;
  for (int milli : {200, 300, 400}) many.push_back({1000, 1000, 1, milli, ~std::uint64_t{0}});
  REQUIRE_MGPU_ERROR(unallocated_bound(Cluster(big), many, BoundMethod::exact), Errc::invalid_argument,
                     "expected a small instance");
}

TEST_CASE("Bound: below every policy's fill, with and without migration, at every point", "[cluster][bound][fill]") {
  for (unsigned seed : {1u, 2u, 3u}) {
    INFO("seed " << seed);
    auto const nodes = synthetic_cluster({.nodes = 12, .seed = seed});
    auto const pods = synthetic_pods({.pods = 300, .seed = seed, .nodes = nodes});
    FillOptions const base{.max_arrived = 1.3, .step = 0.1, .seed = seed};
    FillResult const bound = fill_bound(nodes, pods, base);
    REQUIRE(bound.points.size() == 13);
    CHECK(bound.policy == "bound");
    for (bool migrate : {false, true}) {
      for (FitPolicy policy : all_fit_policies()) {
        FillOptions options = base;
        options.policy = policy;
        options.migration.enabled = migrate;
        FillResult const r = fill(nodes, pods, options);
        INFO(r.policy);
        REQUIRE(r.points.size() == bound.points.size());
        for (std::size_t i = 0; i < r.points.size(); ++i) {
          CHECK(bound.points[i].pods == r.points[i].pods);  // the same pods arrived
          CHECK(bound.points[i].unallocated <= r.points[i].unallocated + 1e-12);
        }
      }
    }
  }
  // The exact bound on a cluster small enough for it, beside the relaxation.
  auto const nodes = synthetic_cluster({.nodes = 3, .seed = 5});
  auto const pods = synthetic_pods({.pods = 60, .seed = 5, .nodes = nodes});
  FillOptions const options{.max_arrived = 1.2, .step = 0.2, .seed = 5};
  FillResult const exact = fill_bound(nodes, pods, options, BoundMethod::exact);
  FillResult const relaxed = fill_bound(nodes, pods, options);
  FillResult const fgd = fill(nodes, pods, options);
  for (std::size_t i = 0; i < exact.points.size(); ++i) {
    CHECK(relaxed.points[i].unallocated <= exact.points[i].unallocated + 1e-12);
    CHECK(exact.points[i].unallocated <= fgd.points[i].unallocated + 1e-12);
  }
}

TEST_CASE("Migration: room made with the fewest moves, each charged its downtime", "[cluster][migration]") {
  // Two nodes of two GPUs: 600 + 300 milli on one, 300 + 600 on the other; a whole GPU fits nowhere
  // until one 300 moves beside the other.
  Cluster cluster({{"a", 10000, 10000, 2, "X"}, {"b", 10000, 10000, 2, "X"}});
  Demand const big{1000, 1000, 1, 600, ~std::uint64_t{0}};
  Demand const small{1000, 2048, 1, 300, ~std::uint64_t{0}};
  Defragmenter defrag({.enabled = true});
  std::vector<Allocation> const start = {{0, {0}, 600, 1000, 1000}, {0, {1}, 300, 1000, 2048},
                                         {1, {0}, 300, 1000, 2048}, {1, {1}, 600, 1000, 1000}};
  for (int id = 0; id < 4; ++id) {
    cluster.allocate(start[static_cast<std::size_t>(id)]);
    defrag.track(id, id == 0 || id == 3 ? big : small, start[static_cast<std::size_t>(id)]);
  }
  Demand const whole{2000, 1000, 1, 1000, ~std::uint64_t{0}};
  Placer placer(FitPolicy::best_fit, TieRule::first, {}, 1);
  REQUIRE(!placer.choose(cluster, whole));
  CHECK(!defrag.make_room(cluster, placer, whole, 0));  // no moves allowed: nothing changes
  check_capacity(cluster, start);

  auto room = defrag.make_room(cluster, placer, whole, 5);
  REQUIRE(room);
  REQUIRE(room->moves.size() == 1);
  Move const& move = room->moves.front();
  CHECK((move.pod == 1 || move.pod == 2));
  CHECK(move.from.node != move.to.node);
  CHECK(move.gpu_seconds == Approx(0.3 * (30 + 2048.0 / 1024)));  // its share x (restart + 2 GiB at 1 GiB/s)
  CHECK(room->placed.gpu_milli == 1000);
  CHECK(room->placed.node == move.from.node);
  CHECK(defrag.allocation_of(move.pod).node == move.to.node);
  std::vector<Allocation> now = {room->placed};
  for (int id = 0; id < 4; ++id) now.push_back(defrag.allocation_of(id));
  check_capacity(cluster, now);

  // A pod too big to move stays: room for another whole GPU would need moving a 2-GPU pod.
  Cluster pinned({{"a", 10000, 10000, 2, "X"}});
  Defragmenter keep({.enabled = true, .max_pod_gpus = 1});
  Allocation const pair{0, {0, 1}, 1000, 1000, 1000};
  pinned.allocate(pair);
  keep.track(0, {1000, 1000, 2, 1000, ~std::uint64_t{0}}, pair);
  CHECK(!keep.make_room(pinned, placer, whole, 5));
  check_capacity(pinned, {pair});

  REQUIRE_MGPU_ERROR(Defragmenter({.max_moves_per_pod = 0}), Errc::invalid_argument, "max_moves_per_pod");
  REQUIRE_MGPU_ERROR(Defragmenter({.moves_per_100_pods = -1}), Errc::invalid_argument, "expected a finite number");
  REQUIRE_MGPU_ERROR(defrag.track(1, small, start[1]), Errc::invalid_argument, "not one tracked already");
  REQUIRE_MGPU_ERROR(defrag.allocation_of(9), Errc::invalid_argument, "expected a tracked id");
}

TEST_CASE("Migration never breaks capacity, and the fill charges and caps its moves", "[cluster][migration][fill]") {
  for (FitPolicy policy : {FitPolicy::best_fit, FitPolicy::fgd}) {
    INFO(name_of(policy));
    // Random arrivals on a small synthetic cluster: every make_room and consolidation checked from scratch.
    auto const nodes = synthetic_cluster({.nodes = 10, .seed = 7});
    auto const pods = synthetic_pods({.pods = 400, .seed = 7, .nodes = nodes});
    Cluster cluster(nodes);
    Placer placer(policy, TieRule::random, target_workload(cluster, pods), 3);
    Defragmenter defrag({.enabled = true, .every = 5, .moves_per_pass = 2});
    std::vector<int> placed;
    std::map<int, Demand> demand_of;
    int moves = 0;
    std::mt19937 rng(7);
    for (int id = 0; id < 400; ++id) {
      Demand const d = cluster.demand_of(pods[std::uniform_int_distribution<std::size_t>(0, pods.size() - 1)(rng)]);
      std::optional<Allocation> a = placer.choose(cluster, d);
      if (a) {
        cluster.allocate(*a);
      } else if (auto room = defrag.make_room(cluster, placer, d, 3)) {
        a = room->placed;
        moves += static_cast<int>(room->moves.size());
        for (Move const& m : room->moves) {
          Demand const& moved = demand_of[m.pod];  // its share x (30 s + its memory at 1 GiB/s)
          CHECK(m.gpu_seconds == Approx(moved.gpus * moved.gpu_milli / 1000.0 * (30 + moved.memory_mib / 1024.0)));
        }
      }
      if (a) {
        defrag.track(id, d, *a);
        placed.push_back(id);
        demand_of[id] = d;
      }
      if (id % 5 == 4) moves += static_cast<int>(defrag.consolidate(cluster, placer, 2).size());
      if (id % 25 == 24 || id == 399) {
        std::vector<Allocation> all;
        for (int p : placed) all.push_back(defrag.allocation_of(p));
        check_capacity(cluster, all);
      }
    }
    CHECK(moves > 0);  // the scenario does migrate

    // The fill: moves within the cap at every point, their cost the sum of each move's downtime.
    FillOptions options{.policy = policy, .max_arrived = 1.2, .step = 0.1, .seed = 7};
    options.migration.enabled = true;
    FillResult const r = fill(nodes, pods, options);
    CHECK(r.policy == std::string(name_of(policy)) + "+migration");
    FillPoint const& last = r.points.back();
    CHECK(last.moves > 0);
    for (FillPoint const& p : r.points) CHECK(p.moves <= 5 * p.pods / 100);
    // Each move costs a pod's GPU share (at most one GPU here) x (30 s + its memory at 1 GiB/s), at
    // least a fractional pod's.
    double most_memory = 0;
    for (Pod const& p : pods) most_memory = std::max(most_memory, static_cast<double>(p.memory_mib));
    CHECK(last.gpu_seconds_lost <= last.moves * (30 + most_memory / 1024) + 1e-9);
    FillOptions none = options;
    none.migration.moves_per_100_pods = 0;
    FillResult const capped = fill(nodes, pods, none);
    CHECK(capped.points.back().moves == 0);
    CHECK(capped.points.back().gpu_seconds_lost == 0);
  }
}
