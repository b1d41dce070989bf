// Cluster-scale scheduling: node and pod files, the synthetic generator, FGD's fragmentation
// measure, the placement policies on hand-made clusters, and the fill and replay experiments.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>

#include <mgpu/cluster/cluster.hpp>
#include <mgpu/cluster/policy.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"

using namespace mgpu::cluster;
using mgpu::Errc;

namespace {

std::filesystem::path scratch(std::string const& name) {
  auto const dir = std::filesystem::temp_directory_path() / ("mgpu_cluster_test_" + name);
  std::filesystem::create_directories(dir);
  return dir;
}

void write(std::filesystem::path const& path, std::string const& text) {
  std::ofstream out(path);
  out << text;
}

// `count` nodes with one GPU of model X each.
std::vector<NodeSpec> one_gpu_nodes(int count) {
  std::vector<NodeSpec> nodes;
  for (int i = 0; i < count; ++i) nodes.push_back({"n" + std::to_string(i), 10000, 10000, 1, "X"});
  return nodes;
}

Pod gpu_pod(int milli, int gpus = 1) {
  return {.name = "p", .cpu_milli = 100, .memory_mib = 100, .gpus = gpus, .gpu_milli = milli};
}

// Places `pods` in order with one policy; returns the number that failed.
int place_in_order(Cluster& cluster, std::vector<Pod> const& pods, FitPolicy policy, TieRule tie = TieRule::first) {
  Placer placer(policy, tie, target_workload(cluster, pods), 1);
  int failed = 0;
  for (Pod const& p : pods) {
    auto const a = placer.choose(cluster, cluster.demand_of(p));
    if (a)
      cluster.allocate(*a);
    else
      ++failed;
  }
  return failed;
}

}  // namespace

TEST_CASE("Nodes and pods files: columns, round trip, errors naming file and line", "[cluster]") {
  auto const dir = scratch("files");
  write(dir / "nodes.csv",
        "sn,cpu_milli,memory_mib,gpu,model\nn0,32000,65536,2,V100\nn1,16000,32768,1,T4\nn2,8000,16384,0,\n");
  auto const nodes = read_nodes_csv(dir / "nodes.csv", {.name = "sn", .gpus = "gpu"});
  REQUIRE(nodes.size() == 3);
  CHECK(nodes[0].name == "n0");
  CHECK(nodes[0].cpu_milli == 32000);
  CHECK(nodes[0].memory_mib == 65536);
  CHECK(nodes[1].gpus == 1);
  CHECK(nodes[1].model == "T4");
  CHECK(nodes[2].gpus == 0);
  REQUIRE_MGPU_ERROR(read_nodes_csv(dir / "nodes.csv"), Errc::corrupt_data, "nodes.csv:1: no column named 'name'");

  write(dir / "pods.csv",
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time\n"
        "cpu,4000,8192,0,0,,BE,Running,0,10\n"
        "frac,2000,4096,1,460,V100|T4,LS,Running,1,5\n"
        "multi,8000,16384,2,1000,V100,LS,Failed,2,20\n");
  auto const pods = read_pods_csv(dir / "pods.csv");
  REQUIRE(pods.size() == 3);
  CHECK(pods[0].gpus == 0);
  CHECK(pods[1].gpu_milli == 460);
  CHECK(pods[1].models == "V100|T4");
  CHECK(pods[1].gpu_demand_milli() == 460);
  CHECK(pods[2].gpu_demand_milli() == 2000);
  CHECK(pods[2].deletion == 20);
  CHECK(pods[2].origin == (dir / "pods.csv").string() + ":4");

  write_nodes_csv(dir / "nodes2.csv", nodes);
  write_pods_csv(dir / "pods2.csv", pods);
  auto const nodes2 = read_nodes_csv(dir / "nodes2.csv");
  auto const pods2 = read_pods_csv(dir / "pods2.csv");
  REQUIRE(nodes2.size() == nodes.size());
  REQUIRE(pods2.size() == pods.size());
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    CHECK(nodes2[i].name == nodes[i].name);
    CHECK(nodes2[i].cpu_milli == nodes[i].cpu_milli);
    CHECK(nodes2[i].memory_mib == nodes[i].memory_mib);
    CHECK(nodes2[i].gpus == nodes[i].gpus);
    CHECK(nodes2[i].model == nodes[i].model);
  }
  for (std::size_t i = 0; i < pods.size(); ++i) {
    CHECK(pods2[i].name == pods[i].name);
    CHECK(pods2[i].cpu_milli == pods[i].cpu_milli);
    CHECK(pods2[i].memory_mib == pods[i].memory_mib);
    CHECK(pods2[i].gpus == pods[i].gpus);
    CHECK(pods2[i].gpu_milli == pods[i].gpu_milli);
    CHECK(pods2[i].models == pods[i].models);
    CHECK(pods2[i].qos == pods[i].qos);
    CHECK(pods2[i].creation == pods[i].creation);
    CHECK(pods2[i].deletion == pods[i].deletion);
  }

  std::string const header = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,creation_time,deletion_time\n";
  write(dir / "bad.csv", header + "a,1000,10,1,500,,LS,0,1\nb,abc,10,1,500,,LS,0,1\n");
  REQUIRE_MGPU_ERROR(read_pods_csv(dir / "bad.csv"), Errc::corrupt_data, "bad.csv:3: column 'cpu_milli' is 'abc'");
  write(dir / "bad.csv", header + "a,1000,10,2,500,,LS,0,1\n");
  REQUIRE_MGPU_ERROR(read_pods_csv(dir / "bad.csv"), Errc::corrupt_data,
                     "bad.csv:2: asks for 500 milli of each of 2 GPUs");
  write(dir / "bad.csv", header + "a,1000,10,0,300,,LS,0,1\n");
  REQUIRE_MGPU_ERROR(read_pods_csv(dir / "bad.csv"), Errc::corrupt_data, "expected 0 for a CPU-only pod");
  write(dir / "bad.csv", header + "a,1000,10,1,1200,,LS,0,1\n");
  REQUIRE_MGPU_ERROR(read_pods_csv(dir / "bad.csv"), Errc::corrupt_data, "bad.csv:2: column 'gpu_milli' is '1200'");
  write(dir / "bad.csv", header + "a,1000,10,1,100,,LS,9,1\n");
  REQUIRE_MGPU_ERROR(read_pods_csv(dir / "bad.csv"), Errc::corrupt_data, "expected deletion >= creation");
  write(dir / "bad.csv", header + "a,1000,10\n");
  REQUIRE_MGPU_ERROR(read_pods_csv(dir / "bad.csv"), Errc::corrupt_data, "bad.csv:2: has 3 fields (expected 9)");
  write(dir / "bad_nodes.csv", "name,cpu_milli,memory_mib,gpus,model\na,1000,10,1,T4\na,1000,10,1,T4\n");
  REQUIRE_MGPU_ERROR(read_nodes_csv(dir / "bad_nodes.csv"), Errc::corrupt_data,
                     "bad_nodes.csv:3: node 'a' appears twice");
  write(dir / "bad_nodes.csv", "name,cpu_milli,memory_mib,gpus,model\na,1000,10,4,\n");
  REQUIRE_MGPU_ERROR(read_nodes_csv(dir / "bad_nodes.csv"), Errc::corrupt_data,
                     "bad_nodes.csv:2: node 'a' has 4 GPUs but no model");
  write(dir / "bad_nodes.csv", "name,cpu_milli,memory_mib,gpus,model\na,0,10,4,T4\n");
  REQUIRE_MGPU_ERROR(read_nodes_csv(dir / "bad_nodes.csv"), Errc::corrupt_data, "column 'cpu_milli' is '0'");

  // Against the cluster: unknown models and impossible demands name the pod's file and line.
  Cluster const cluster(nodes);
  write(dir / "models.csv", header + "ok,1000,10,1,500,T4,LS,0,1\nx,1000,10,1,500,T4|A100,LS,0,1\n");
  auto const unknown = read_pods_csv(dir / "models.csv");
  CHECK(cluster.demand_of(unknown[0]).models == std::uint64_t{2});  // T4 is the second model
  REQUIRE_MGPU_ERROR(cluster.check(unknown), Errc::invalid_argument,
                     "models.csv:3): GPU model 'A100' is not in the cluster (expected one of: V100, T4)");
  write(dir / "big.csv", header + "a,1000,10,2,1000,T4,LS,0,1\nb,64000,10,1,1000,,LS,0,1\n");
  auto const big = read_pods_csv(dir / "big.csv");
  REQUIRE_MGPU_ERROR(cluster.demand_of(big[0]), Errc::invalid_argument,
                     "big.csv:2): 1000 milli-CPU, 10 MiB and 2 GPUs of T4 fit no node");
  REQUIRE_MGPU_ERROR(cluster.demand_of(big[1]), Errc::invalid_argument, "big.csv:3)");
}

TEST_CASE("Cluster allocations are checked against GPU, CPU and memory capacity", "[cluster]") {
  Cluster cluster({{"a", 4000, 8000, 2, "T4"}});
  cluster.allocate({.node = 0, .gpus = {0}, .gpu_milli = 700, .cpu_milli = 1000, .memory_mib = 1000});
  CHECK(cluster.free_gpus(0) == std::vector<int>{300, 1000});
  REQUIRE_MGPU_ERROR(cluster.allocate({.node = 0, .gpus = {0}, .gpu_milli = 400, .cpu_milli = 1, .memory_mib = 1}),
                     Errc::invalid_argument, "asks for 400 milli of GPU 0, 300 are free");
  REQUIRE_MGPU_ERROR(cluster.allocate({.node = 0, .gpus = {1}, .gpu_milli = 100, .cpu_milli = 3001, .memory_mib = 1}),
                     Errc::invalid_argument, "3000 and 7000 are free");
  REQUIRE_MGPU_ERROR(cluster.allocate({.node = 0, .gpus = {1, 1}, .gpu_milli = 1000}), Errc::invalid_argument,
                     "distinct GPUs");
  REQUIRE_MGPU_ERROR(cluster.allocate({.node = 3, .gpus = {0}, .gpu_milli = 100}), Errc::invalid_argument, "node 3");
  CHECK(cluster.free_gpus(0) == std::vector<int>{300, 1000});  // the failed allocations changed nothing
  CHECK(cluster.free_cpu(0) == 3000);
  CHECK(cluster.gpu_allocated_milli() == 700);
  // Releasing what the node does not hold is refused; releasing what it holds restores it.
  REQUIRE_MGPU_ERROR(cluster.release({.node = 0, .gpus = {1}, .gpu_milli = 100}), Errc::invalid_argument,
                     "that the node does not hold");
  REQUIRE_MGPU_ERROR(cluster.release({.node = 0, .gpus = {0}, .gpu_milli = 700, .cpu_milli = 1001}),
                     Errc::invalid_argument, "that the node does not hold");
  CHECK(cluster.free_gpus(0) == std::vector<int>{300, 1000});
  Allocation const extra{.node = 0, .gpus = {1}, .gpu_milli = 1000, .cpu_milli = 500, .memory_mib = 7000};
  cluster.allocate(extra);
  CHECK(cluster.free_memory(0) == 0);
  cluster.release(extra);
  CHECK(cluster.free_gpus(0) == std::vector<int>{300, 1000});
  CHECK(cluster.free_cpu(0) == 3000);
  CHECK(cluster.free_memory(0) == 7000);
  CHECK(cluster.gpu_allocated_milli() == 700);
  CHECK_FALSE(cluster.fits({.cpu_milli = 0, .memory_mib = 0, .gpus = 2, .gpu_milli = 1000}, 0));
  CHECK(cluster.fits({.cpu_milli = 3000, .memory_mib = 7000, .gpus = 1, .gpu_milli = 1000}, 0));
  CHECK_FALSE(cluster.fits({.cpu_milli = 3000, .memory_mib = 7000, .gpus = 1, .gpu_milli = 1000, .models = 2},
                           0));  // not model 1
}

TEST_CASE("FGD's fragmentation measure matches hand-computed cases", "[cluster][fgd]") {
  // Types: a 500-milli fraction (half the pods), one whole GPU (a quarter), CPU-only (a quarter).
  std::vector<PodType> const target = {
      {{1000, 0, 1, 500, ~0ULL}, 0.5}, {{1000, 0, 1, 1000, ~0ULL}, 0.25}, {{1000, 0, 0, 0, ~0ULL}, 0.25}};
  std::vector<int> const gpus = {1000, 300, 0};
  // Both GPU types fit; each can use neither the 300 nor the 0; CPU-only pods can use none of 1300.
  CHECK(node_fragmentation(target, 0, 8000, 100, gpus) == Approx(0.5 * 300 + 0.25 * 300 + 0.25 * 1300));
  // Not enough CPU for any type: all 1300 free milli are fragments.
  CHECK(node_fragmentation(target, 0, 500, 100, gpus) == Approx(1300));
  // No GPU with 500 free: nothing fits.
  CHECK(node_fragmentation(target, 0, 8000, 100, std::vector<int>{400, 300}) == Approx(700));
  // The fraction is restricted to model 1: on model 0 it counts all free share.
  auto restricted = target;
  restricted[0].demand.models = 2;
  CHECK(node_fragmentation(restricted, 0, 8000, 100, gpus) == Approx(0.5 * 1300 + 0.25 * 300 + 0.25 * 1300));
  CHECK(node_fragmentation(restricted, 1, 8000, 100, gpus) == Approx(0.5 * 300 + 0.25 * 300 + 0.25 * 1300));
  CHECK(node_fragmentation(target, 0, 8000, 100, std::vector<int>{0, 0}) == 0);

  // The placer's grouped computation equals the per-type definition on a partly filled cluster.
  auto const nodes = synthetic_cluster({.nodes = 60, .seed = 3});
  auto const pods = synthetic_pods({.pods = 400, .constrained_share = 0.5, .seed = 3});
  Cluster cluster(nodes);
  auto const types = target_workload(cluster, pods);
  Placer placer(FitPolicy::random, TieRule::random, types, 5);
  for (Pod const& p : pods) {
    if (auto a = placer.choose(cluster, cluster.demand_of(p))) cluster.allocate(*a);
  }
  double reference = 0;
  for (int n = 0; n < static_cast<int>(nodes.size()); ++n)
    reference += node_fragmentation(types, cluster.model_of(n), cluster.free_cpu(n), cluster.free_memory(n),
                                    cluster.free_gpus(n));
  REQUIRE(cluster.gpu_allocated_milli() > 0);
  CHECK(placer.cluster_fragmentation(cluster) == Approx(reference).epsilon(1e-9));
}

TEST_CASE("Target workloads: shares, coverage and GPU-only types", "[cluster][fgd]") {
  Cluster const cluster(one_gpu_nodes(2));
  std::vector<Pod> pods = {gpu_pod(500), gpu_pod(500), gpu_pod(500), gpu_pod(1000), gpu_pod(1000), gpu_pod(250)};
  pods[5].cpu_milli = 7;
  auto const all = target_workload(cluster, pods);
  REQUIRE(all.size() == 3);
  CHECK(all[0].demand.gpu_milli == 500);
  CHECK(all[0].share == Approx(0.5));
  CHECK(all[1].share == Approx(1.0 / 3));
  auto const most = target_workload(cluster, pods, {.coverage = 0.8});  // 500 and 1000 make up 5/6
  REQUIRE(most.size() == 2);
  CHECK(most[0].share == Approx(0.6));
  pods[0].cpu_milli = 9;  // a different CPU demand: a separate type unless types are by GPU only
  CHECK(target_workload(cluster, pods).size() == 4);
  auto const gpu_only = target_workload(cluster, pods, {.cpu_and_memory = false});
  REQUIRE(gpu_only.size() == 3);
  CHECK(gpu_only[0].demand.cpu_milli == 0);
  REQUIRE_MGPU_ERROR(target_workload(cluster, pods, {.coverage = 0}), Errc::invalid_argument,
                     "expected a share in (0, 1]");
  REQUIRE_MGPU_ERROR(target_workload(cluster, {}), Errc::invalid_argument, "expected at least one");
}

TEST_CASE("Policies on hand-made clusters with a known optimum", "[cluster]") {
  // Three 1-GPU nodes; 600, 600, 400, 400 and a whole GPU all fit only if each 400 joins a 600.
  std::vector<Pod> const pods = {gpu_pod(600), gpu_pod(600), gpu_pod(400), gpu_pod(400), gpu_pod(1000)};
  std::map<FitPolicy, int> const expected_failures = {{FitPolicy::first_fit, 0},
                                                      {FitPolicy::best_fit, 0},
                                                      {FitPolicy::gpu_packing, 0},
                                                      {FitPolicy::fgd, 0},
                                                      {FitPolicy::worst_fit, 1}};
  for (auto const& [policy, failures] : expected_failures) {
    Cluster cluster(one_gpu_nodes(3));
    INFO(name_of(policy));
    CHECK(place_in_order(cluster, pods, policy) == failures);
    CHECK(cluster.gpu_allocated_milli() == (failures == 0 ? 3000 : 2000));
  }
  // Two 2-GPU nodes; two halves then a 2-GPU pod: the halves must share a node.
  std::vector<NodeSpec> const pairs = {{"a", 10000, 10000, 2, "X"}, {"b", 10000, 10000, 2, "X"}};
  std::vector<Pod> const gang = {gpu_pod(500), gpu_pod(500), gpu_pod(1000, 2)};
  for (auto const& [policy, failures] :
       std::map<FitPolicy, int>{{FitPolicy::fgd, 0}, {FitPolicy::best_fit, 0}, {FitPolicy::worst_fit, 1}}) {
    Cluster cluster(pairs);
    INFO(name_of(policy));
    CHECK(place_in_order(cluster, gang, policy) == failures);
  }
  {  // FGD puts the second half on the same GPU as the first: the node keeps a whole GPU.
    Cluster cluster(pairs);
    CHECK(place_in_order(cluster, {gpu_pod(500), gpu_pod(500)}, FitPolicy::fgd) == 0);
    CHECK(cluster.free_gpus(0) == std::vector<int>{0, 1000});
    CHECK(cluster.free_gpus(1) == std::vector<int>{1000, 1000});
  }
  {  // Best-fit counts CPU and memory too: the node the pod fills most tightly.
    Cluster cluster({{"big", 64000, 64000, 1, "X"}, {"small", 2000, 2000, 1, "X"}});
    Pod p = gpu_pod(1000);
    p.cpu_milli = 1500;
    Placer placer(FitPolicy::best_fit, TieRule::first, {}, 1);
    CHECK(placer.choose(cluster, cluster.demand_of(p))->node == 1);
    Placer worst(FitPolicy::worst_fit, TieRule::first, {}, 1);
    CHECK(worst.choose(cluster, cluster.demand_of(p))->node == 0);
  }
}

TEST_CASE("Tie rules: first, packed and random", "[cluster]") {
  // Only whole-GPU pods in the target: placing one on any node with a free GPU changes no node's
  // fragmentation, so every node ties under fgd.
  std::vector<NodeSpec> const nodes = {
      {"a", 10000, 10000, 2, "X"}, {"b", 10000, 10000, 2, "X"}, {"c", 10000, 10000, 2, "X"}};
  Pod const whole = gpu_pod(1000);
  auto const pick = [&](TieRule rule, unsigned seed) {
    Cluster cluster(nodes);
    cluster.allocate({.node = 2, .gpus = {1}, .gpu_milli = 1000});
    Placer placer(FitPolicy::fgd, rule, target_workload(cluster, {whole}), seed);
    return placer.choose(cluster, cluster.demand_of(whole))->node;
  };
  CHECK(pick(TieRule::first, 1) == 0);
  CHECK(pick(TieRule::packed, 1) == 2);  // the least free GPU share
  std::set<int> seen;
  for (unsigned seed = 0; seed < 64; ++seed) seen.insert(pick(TieRule::random, seed));
  CHECK(seen == std::set<int>{0, 1, 2});
  REQUIRE_MGPU_ERROR(Placer(FitPolicy::fgd, TieRule::first, {}, 1), Errc::invalid_argument,
                     "without a target workload");
  REQUIRE_MGPU_ERROR(tie_rule_named("last"), Errc::invalid_argument, "expected one of: first, random, packed");
  REQUIRE_MGPU_ERROR(fit_policy_named("tetris"), Errc::invalid_argument, "dot-product");
  for (FitPolicy p : all_fit_policies()) CHECK(fit_policy_named(name_of(p)) == p);
}

TEST_CASE("Every policy keeps GPUs, CPU and memory within capacity and honours model constraints", "[cluster]") {
  auto const nodes = synthetic_cluster({.nodes = 40, .seed = 7});
  auto const pods = synthetic_pods({.pods = 900, .constrained_share = 0.5, .seed = 7});
  for (FitPolicy policy : all_fit_policies()) {
    for (TieRule tie : {TieRule::first, TieRule::random, TieRule::packed}) {
      INFO(name_of(policy) << " / " << name_of(tie));
      Cluster cluster(nodes);
      Placer placer(policy, tie, target_workload(cluster, pods), 11);
      // An independent ledger of what each GPU, node CPU and memory holds.
      std::map<std::pair<int, int>, int> gpu_used;
      std::vector<long> cpu_used(nodes.size()), memory_used(nodes.size());
      int placed = 0;
      for (Pod const& p : pods) {
        auto const a = placer.choose(cluster, cluster.demand_of(p));
        if (!a) continue;
        ++placed;
        NodeSpec const& node = nodes[static_cast<std::size_t>(a->node)];
        CHECK(static_cast<int>(a->gpus.size()) == p.gpus);
        CHECK(a->gpu_milli == (p.gpus > 0 ? p.gpu_milli : 0));
        if (p.gpus > 0 && !p.models.empty())
          CHECK(("|" + p.models + "|").find("|" + node.model + "|") != std::string::npos);
        cluster.allocate(*a);
        for (int g : a->gpus) gpu_used[{a->node, g}] += a->gpu_milli;
        cpu_used[static_cast<std::size_t>(a->node)] += p.cpu_milli;
        memory_used[static_cast<std::size_t>(a->node)] += p.memory_mib;
      }
      CHECK(placed > 300);
      for (auto const& [gpu, used] : gpu_used) CHECK(used <= 1000);
      for (std::size_t n = 0; n < nodes.size(); ++n) {
        CHECK(cpu_used[n] <= nodes[n].cpu_milli);
        CHECK(memory_used[n] <= nodes[n].memory_mib);
      }
    }
  }
}

TEST_CASE("Fill: accounting, determinism, and FGD ahead of best-fit on the synthetic trace", "[cluster][fill]") {
  auto const nodes = synthetic_cluster({.nodes = 150, .seed = 2});
  auto const pods = synthetic_pods({.pods = 2000, .constrained_share = 0, .seed = 2});
  double capacity = 0;
  for (NodeSpec const& n : nodes) capacity += 1000.0 * n.gpus;
  std::map<FitPolicy, FillResult> results;
  for (FitPolicy policy : all_fit_policies()) {
    INFO(name_of(policy));
    FillResult const r =
        fill(nodes, pods, {.policy = policy, .tie = TieRule::random, .max_arrived = 1.2, .step = 0.1, .seed = 4});
    REQUIRE(r.points.size() == 12);
    for (std::size_t i = 0; i < r.points.size(); ++i) {
      FillPoint const& p = r.points[i];
      CHECK(p.arrived == Approx(0.1 * static_cast<double>(i + 1)));
      CHECK(p.allocated + p.unallocated == Approx(1.0));
      // No departures: what arrived was either allocated or failed, and arrived just passed the mark.
      CHECK(p.allocated + p.failed_gpu >= p.arrived - 1e-9);
      CHECK(p.allocated + p.failed_gpu <= p.arrived + 8000 / capacity);
      CHECK(p.fragmented <= p.unallocated + 1e-9);
      if (i > 0) {
        CHECK(p.pods >= r.points[i - 1].pods);
        CHECK(p.failed >= r.points[i - 1].failed);
        CHECK(p.allocated >= r.points[i - 1].allocated - 1e-12);
      }
      if (!results.empty()) CHECK(p.pods == results.begin()->second.points[i].pods);  // every policy sees the same pods
    }
    CHECK(r.decisions == r.points.back().pods);
    results[policy] = r;
  }
  FillResult const again =
      fill(nodes, pods, {.policy = FitPolicy::fgd, .tie = TieRule::random, .max_arrived = 1.2, .step = 0.1, .seed = 4});
  for (std::size_t i = 0; i < again.points.size(); ++i)
    CHECK(again.points[i].allocated == results[FitPolicy::fgd].points[i].allocated);
  // Below saturation nothing fails under the packing policies; at and past it FGD leaves the least.
  CHECK(results[FitPolicy::fgd].points[4].failed == 0);
  double const fgd = results[FitPolicy::fgd].points[11].unallocated;
  CHECK(fgd < results[FitPolicy::best_fit].points[11].unallocated);
  CHECK(fgd < results[FitPolicy::random].points[11].unallocated);
  CHECK(fgd < results[FitPolicy::dot_product].points[11].unallocated);

  std::string const table = format_fill({results[FitPolicy::fgd], results[FitPolicy::best_fit]});
  CHECK_THAT(table, MGPU_TEST_CONTAINS("fgd"));
  CHECK_THAT(table, MGPU_TEST_CONTAINS("120%"));
  std::string const csv = fill_csv({results[FitPolicy::fgd]});
  CHECK(std::count(csv.begin(), csv.end(), '\n') == 13);
  REQUIRE_MGPU_ERROR(fill(nodes, {}, {}), Errc::invalid_argument, "empty pod list");
  REQUIRE_MGPU_ERROR(fill(nodes, pods, {.step = 0}), Errc::invalid_argument, "expected both > 0");
  std::vector<Pod> const cpu_only = {{.name = "c", .cpu_milli = 100, .memory_mib = 100}};
  REQUIRE_MGPU_ERROR(fill(nodes, cpu_only, {}), Errc::invalid_argument, "ask for no GPU");
}

TEST_CASE("Replay: waits, completion times and utilisation on a hand-computed case", "[cluster][replay]") {
  // One node with one GPU. A holds it over [0, 10); B arrives at 5 and waits until 10, running 2 s;
  // C (CPU-only) runs over [6, 7) beside A; D runs over [20, 25).
  std::vector<Pod> const pods = {
      {.name = "A", .cpu_milli = 100, .gpus = 1, .gpu_milli = 1000, .creation = 0, .deletion = 10},
      {.name = "B", .cpu_milli = 100, .gpus = 1, .gpu_milli = 1000, .creation = 5, .deletion = 7},
      {.name = "C", .cpu_milli = 100, .creation = 6, .deletion = 7},
      {.name = "D", .cpu_milli = 100, .gpus = 1, .gpu_milli = 1000, .creation = 20, .deletion = 25},
  };
  for (FitPolicy policy : all_fit_policies()) {
    INFO(name_of(policy));
    ReplayResult const r = replay(one_gpu_nodes(1), pods, policy);
    CHECK(r.pods == 4);
    CHECK(r.never_started == 0);
    CHECK(r.mean_wait == Approx(5.0 / 4));
    CHECK(r.p95_wait == Approx(5));
    CHECK(r.mean_jct == Approx((10.0 + 7 + 1 + 5) / 4));
    CHECK(r.makespan == Approx(25));
    CHECK(r.gpu_utilization == Approx((10.0 + 2 + 5) / 25));
    CHECK(r.peak_pending == 1);
  }
  std::string const table = format_replay({replay(one_gpu_nodes(1), pods, FitPolicy::fgd)});
  CHECK_THAT(table, MGPU_TEST_CONTAINS("fgd"));
}

TEST_CASE("Synthetic cluster and pods follow the published trace's statistics", "[cluster][synthetic]") {
  auto const nodes = synthetic_cluster({});
  REQUIRE(nodes.size() == 1213);
  int gpus = 0;
  std::map<std::string, int> by_model;
  for (NodeSpec const& n : nodes) {
    gpus += n.gpus;
    by_model[n.model] += n.gpus;
  }
  CHECK(gpus == 6212);  // the published cluster's GPU count
  CHECK(by_model["G2"] == 549 * 8);
  CHECK(synthetic_cluster({.nodes = 100}).size() == 100);

  int const count = 20000;
  auto const pods = synthetic_pods({.pods = count, .constrained_share = 0.33, .seed = 9});
  REQUIRE(pods.size() == static_cast<std::size_t>(count));
  std::map<std::string, double> classes;
  int constrained = 0;
  int gpu_pods = 0;
  std::vector<double> run_times;
  for (Pod const& p : pods) {
    classes[p.gpus == 0 ? "cpu" : p.gpu_milli < 1000 ? "fraction" : p.gpus == 1 ? "one" : "multi"] += 1.0 / count;
    gpu_pods += p.gpus > 0 ? 1 : 0;
    constrained += p.gpus > 0 && !p.models.empty() ? 1 : 0;
    run_times.push_back(p.deletion - p.creation);
  }
  CHECK(classes["cpu"] == Approx(0.1335).margin(0.01));
  CHECK(classes["fraction"] == Approx(0.3776).margin(0.01));
  CHECK(classes["one"] == Approx(0.4798).margin(0.01));
  CHECK(classes["multi"] == Approx(0.0092).margin(0.003));
  CHECK(static_cast<double>(constrained) / gpu_pods == Approx(0.33).margin(0.02));
  std::nth_element(run_times.begin(), run_times.begin() + count / 2, run_times.end());
  CHECK(run_times[count / 2] == Approx(540).epsilon(0.1));
  Cluster const cluster(nodes);
  cluster.check(pods);  // every constraint names a model some node can satisfy

  auto const same = synthetic_pods({.pods = 50, .seed = 9});
  auto const again = synthetic_pods({.pods = 50, .seed = 9});
  auto const other = synthetic_pods({.pods = 50, .seed = 10});
  bool differs = false;
  for (std::size_t i = 0; i < same.size(); ++i) {
    CHECK(same[i].cpu_milli == again[i].cpu_milli);
    CHECK(same[i].models == again[i].models);
    CHECK(same[i].creation == again[i].creation);
    differs = differs || same[i].cpu_milli != other[i].cpu_milli || same[i].gpu_milli != other[i].gpu_milli;
  }
  CHECK(differs);
  // On a small cluster the constraints name only models it has (and can hold the pod on).
  std::vector<NodeSpec> const small = {{"t4", 104000, 524288, 2, "T4"}, {"p100", 16000, 122880, 2, "P100"}};
  auto const on_small = synthetic_pods({.pods = 3000, .constrained_share = 1, .seed = 4, .nodes = small});
  std::set<std::string> named;
  for (Pod const& p : on_small) {
    if (p.gpus > 0 && p.gpus <= 2) CHECK_FALSE(p.models.empty());
    if (!p.models.empty()) named.insert(p.models);
  }
  CHECK(named.contains("T4"));
  CHECK(named.contains("P100"));
  CHECK_FALSE(named.contains("G2"));
  std::vector<Pod> placeable;
  std::copy_if(on_small.begin(), on_small.end(), std::back_inserter(placeable),
               [](Pod const& p) { return p.gpus <= 2; });
  Cluster(small).check(placeable);
  REQUIRE_MGPU_ERROR(synthetic_pods({.pods = 0}), Errc::invalid_argument, "expected >= 1 pod");
  REQUIRE_MGPU_ERROR(synthetic_cluster({.nodes = 0}), Errc::invalid_argument, "expected at least 1");
}
