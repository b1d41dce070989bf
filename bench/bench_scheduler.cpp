// bench_scheduler: placement decisions per second with the default profile (8 and 64 devices),
// the fill experiment at cluster scale under every placement policy (a synthetic 1,213-node,
// 6,212-GPU cluster and 8,152 pods after Alibaba's published trace, filled to 130% arrived GPU
// demand), and the policy tables on synthetic traces.
//
//   bench_scheduler --benchmark_out=scheduler.json --benchmark_out_format=json
#include <benchmark/benchmark.h>

#include <cstdio>

#include <mgpu/mgpu.hpp>

#include "bench_support.hpp"

namespace {

mgpu::sched::NodeState node_of(int devices) {
  mgpu::sched::NodeState node;
  for (int i = 0; i < devices; ++i) {
    mgpu::sched::DeviceState d;
    d.id = i;
    d.type = i % 2 ? "A100" : "H100";
    d.capacity_bytes = 80e9;
    d.free_bytes = 80e9 - 1e9 * (i % 7);
    d.queued_seconds = (i * 13) % 11;
    d.speed = 1.0 + (i % 3) * 0.5;
    d.links.assign(static_cast<std::size_t>(devices), 0.2);
    for (int j = i / 8 * 8; j < i / 8 * 8 + 8 && j < devices; ++j) d.links[static_cast<std::size_t>(j)] = 1.0;  // NVLink within 8
    node.devices.push_back(d);
  }
  return node;
}

// One single-device placement decision per iteration.
void BM_place(benchmark::State& state) {
  auto const node = node_of(static_cast<int>(state.range(0)));
  auto const scheduler = mgpu::sched::Scheduler::default_profile();
  mgpu::sched::Request request{.name = "task", .devices = 1, .memory_bytes = 20e9, .allowed_types = "A100|H100", .work_seconds = 10};
  for (auto _ : state) {
    auto placement = scheduler.place(request, node);
    benchmark::DoNotOptimize(placement);
  }
  state.counters["decisions_per_s"] = benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["devices"] = static_cast<double>(state.range(0));
}
BENCHMARK(BM_place)->Arg(8)->Arg(64);

// A 4-device gang placement, where topology rates every pair of the set.
void BM_place_gang(benchmark::State& state) {
  auto const node = node_of(static_cast<int>(state.range(0)));
  auto const scheduler = mgpu::sched::Scheduler::default_profile();
  mgpu::sched::Request request{.name = "job", .devices = 4, .memory_bytes = 20e9, .work_seconds = 10};
  for (auto _ : state) {
    auto placement = scheduler.place(request, node);
    benchmark::DoNotOptimize(placement);
  }
  state.counters["decisions_per_s"] = benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["devices"] = static_cast<double>(state.range(0));
}
BENCHMARK(BM_place_gang)->Arg(8)->Arg(64);

// One fill experiment per iteration under one placement policy (range(0) indexes all_fit_policies()).
void BM_fill(benchmark::State& state) {
  auto const nodes = mgpu::cluster::synthetic_cluster({});
  auto const pods = mgpu::cluster::synthetic_pods({});
  auto const policy = mgpu::cluster::all_fit_policies()[static_cast<std::size_t>(state.range(0))];
  state.SetLabel(std::string(mgpu::cluster::name_of(policy)));
  double decisions = 0;
  double seconds = 0;
  for (auto _ : state) {
    auto const result =
        mgpu::cluster::fill(nodes, pods, {.policy = policy, .tie = mgpu::cluster::TieRule::random, .max_arrived = 1.3});
    decisions += result.decisions;
    seconds += result.seconds;
    benchmark::DoNotOptimize(result);
  }
  state.counters["decisions_per_s"] = decisions / seconds;
  state.counters["decisions"] = decisions / static_cast<double>(state.iterations());
  state.counters["nodes"] = static_cast<double>(nodes.size());
}
BENCHMARK(BM_fill)->DenseRange(0, 6)->Iterations(bench::iterations(1))->Repetitions(3)->ReportAggregatesOnly(true)->Unit(
    benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  mgpu::cluster::TraceShape shape{.jobs = 400, .seed = 1};
  shape.mean_interarrival_seconds = mgpu::cluster::interarrival_for_load(shape, 0.9, 16);
  auto const jobs = mgpu::cluster::synthetic_trace(shape);
  auto const servers = mgpu::cluster::make_servers({{.gpus = 8}, {.gpus = 8, .type = "V100", .speed = 0.6}});
  std::vector<mgpu::cluster::SimulationResult> results;
  for (auto const& policy : mgpu::sched::standard_policies()) results.push_back(mgpu::cluster::simulate(jobs, servers, policy));
  std::printf("\npolicies on a synthetic trace (400 jobs at 90%% load, servers of 8 A100 and 8 V100 at 0.6x):\n%s",
              mgpu::cluster::format_results(results).c_str());
  auto const nodes = mgpu::cluster::synthetic_cluster({});
  auto const pods = mgpu::cluster::synthetic_pods({});
  std::vector<mgpu::cluster::FillResult> fills;
  for (auto const policy : mgpu::cluster::all_fit_policies())
    fills.push_back(mgpu::cluster::fill(nodes, pods, {.policy = policy}));
  std::printf("\nfill of the synthetic 1,213-node cluster with its 8,152 pods (tie rule random, seed 1):\n%s",
              mgpu::cluster::format_fill(fills).c_str());
  benchmark::Shutdown();
  return 0;
}
