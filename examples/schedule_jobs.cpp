// schedule_jobs: replays a job trace (a CSV file, or a synthetic one) on modelled GPU servers under
// each queue policy, with the library's own scheduler, and prints a table comparing them. With a
// cluster (--nodes, or --synthetic-nodes) it places pods (--pods, or --synthetic-pods) with CPU,
// memory, fractional GPUs and GPU model constraints under each placement policy, in the replay or
// the fill experiment (see mgpu/cluster/cluster.hpp for the file formats).
//
//   schedule_jobs --synthetic 500 --servers 2 --gpus 8
//   schedule_jobs --trace jobs.csv --column submit=start_time --column end=end_time --csv out.csv
//   schedule_jobs --nodes nodes.csv --pods pods.csv --experiment fill --tie random --csv fill.csv
//   schedule_jobs --synthetic-nodes 1213 --synthetic-pods 8152 --policy fgd --policy fgd+migration --bound relaxation
//   schedule_jobs --synthetic-nodes 1213 --synthetic-pods 8152 --experiment replay
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <mgpu/mgpu.hpp>

namespace {

// Applies FIELD=NAME mappings to a columns struct through `set`, naming the option and fields in errors.
template <typename Set>
void map_columns(std::vector<std::string> const& mappings, std::string const& option, std::string const& fields,
                 Set set) {
  for (std::string const& m : mappings) {
    auto const eq = m.find('=');
    if (eq == std::string::npos)
      throw mgpu::Error(mgpu::Errc::invalid_argument, option + " " + m + " (expected FIELD=NAME)");
    if (!set(m.substr(0, eq), m.substr(eq + 1)))
      throw mgpu::Error(mgpu::Errc::invalid_argument,
                        option + " field '" + m.substr(0, eq) + "' (expected one of: " + fields + ")");
  }
}

void write_text(std::string const& path, std::string const& text) {
  std::ofstream out(path);
  out << text;
  if (!out) throw mgpu::Error(mgpu::Errc::io, "cannot write " + path);
}

struct ClusterOptions {
  std::string nodes_file, pods_file;
  std::vector<std::string> node_mappings, pod_mappings;
  int synthetic_nodes = 0;
  int synthetic_pods = 0;
  double constrained_share = 0.33;
  double interarrival = 350;
  double speedup = 1;
  std::string experiment = "fill";
  std::vector<std::string> policies;
  std::vector<std::string> ties = {"random"};
  double coverage = 1.0;
  bool gpu_only_types = false;
  double max_arrived = 1.3;
  double step = 0.05;
  std::string write_nodes, write_pods;
  std::string bound = "relaxation";
  mgpu::cluster::MigrationOptions migration{};
};

// A policy's name, or a name with "+migration" (the defragmenter on): the policy and whether it migrates.
std::pair<mgpu::cluster::FitPolicy, bool> policy_named(std::string const& name) {
  std::string const suffix = "+migration";
  bool const migrates = name.size() > suffix.size() && name.ends_with(suffix);
  return {mgpu::cluster::fit_policy_named(migrates ? name.substr(0, name.size() - suffix.size()) : name), migrates};
}

int run_cluster(ClusterOptions const& o, unsigned seed, std::string const& csv) {
  namespace s = mgpu::cluster;
  s::NodeColumns node_columns;
  map_columns(o.node_mappings, "--node-column", "name, cpu_milli, memory_mib, gpus, model",
              [&](std::string const& f, std::string const& n) {
                std::string* slot = f == "name"         ? &node_columns.name
                                    : f == "cpu_milli"  ? &node_columns.cpu_milli
                                    : f == "memory_mib" ? &node_columns.memory_mib
                                    : f == "gpus"       ? &node_columns.gpus
                                    : f == "model"      ? &node_columns.model
                                                        : nullptr;
                if (slot) *slot = n;
                return slot != nullptr;
              });
  s::PodColumns pod_columns;
  map_columns(o.pod_mappings, "--pod-column",
              "name, cpu_milli, memory_mib, gpus, gpu_milli, models, qos, creation, deletion",
              [&](std::string const& f, std::string const& n) {
                std::string* slot = f == "name"         ? &pod_columns.name
                                    : f == "cpu_milli"  ? &pod_columns.cpu_milli
                                    : f == "memory_mib" ? &pod_columns.memory_mib
                                    : f == "gpus"       ? &pod_columns.gpus
                                    : f == "gpu_milli"  ? &pod_columns.gpu_milli
                                    : f == "models"     ? &pod_columns.models
                                    : f == "qos"        ? &pod_columns.qos
                                    : f == "creation"   ? &pod_columns.creation
                                    : f == "deletion"   ? &pod_columns.deletion
                                                        : nullptr;
                if (slot) *slot = n;
                return slot != nullptr;
              });
  std::vector<s::NodeSpec> const nodes =
      o.nodes_file.empty()
          ? s::synthetic_cluster({.nodes = o.synthetic_nodes > 0 ? o.synthetic_nodes : 1213, .seed = seed})
          : s::read_nodes_csv(o.nodes_file, node_columns);
  std::vector<s::Pod> pods = o.pods_file.empty()
                                 ? s::synthetic_pods({.pods = o.synthetic_pods > 0 ? o.synthetic_pods : 8152,
                                                      .constrained_share = o.constrained_share,
                                                      .mean_interarrival_seconds = o.interarrival,
                                                      .seed = seed,
                                                      .nodes = nodes})
                                 : s::read_pods_csv(o.pods_file, pod_columns);
  if (o.speedup != 1) {  // arrivals closer together, each pod running as long as before
    for (s::Pod& p : pods) {
      double const run = p.deletion - p.creation;
      p.creation /= o.speedup;
      p.deletion = p.creation + run;
    }
  }
  if (!o.write_nodes.empty()) s::write_nodes_csv(o.write_nodes, nodes);
  if (!o.write_pods.empty()) s::write_pods_csv(o.write_pods, pods);
  s::Cluster const cluster(nodes);
  cluster.check(pods);  // unknown models and impossible demands, naming the file and line
  std::vector<std::pair<s::FitPolicy, bool>> policies;
  for (std::string const& p : o.policies) policies.push_back(policy_named(p));
  if (policies.empty()) {
    for (s::FitPolicy p : s::all_fit_policies()) policies.emplace_back(p, false);
    if (o.experiment == "fill") {
      policies.emplace_back(s::FitPolicy::best_fit, true);
      policies.emplace_back(s::FitPolicy::fgd, true);
    }
  }
  std::vector<s::TieRule> ties;
  for (std::string const& t : o.ties) ties.push_back(s::tie_rule_named(t));
  s::TargetOptions const target{.cpu_and_memory = !o.gpu_only_types, .coverage = o.coverage};
  std::printf(
      "%zu pods (%s) on %zu nodes with %.0f GPUs (%s); target workload: %zu pod types%s covering %.0f%% of the "
      "pods\n\n",
      pods.size(), o.pods_file.empty() ? "synthetic" : o.pods_file.c_str(), nodes.size(),
      static_cast<double>(cluster.gpu_capacity_milli()) / 1000,
      o.nodes_file.empty() ? "synthetic" : o.nodes_file.c_str(), s::target_workload(cluster, pods, target).size(),
      o.gpu_only_types ? " (by GPU demand and model only)" : "", 100 * o.coverage);
  if (o.experiment == "replay") {
    std::vector<s::ReplayResult> results;
    for (s::TieRule tie : ties) {
      for (auto [p, migrates] : policies) {
        if (migrates)
          throw mgpu::Error(mgpu::Errc::invalid_argument, "--policy " + std::string(s::name_of(p)) +
                                                              "+migration with --experiment replay (expected migration "
                                                              "in the fill experiment only)");
        results.push_back(s::replay(nodes, pods, p, tie, target, seed));
      }
    }
    std::printf("%s", s::format_replay(results).c_str());
    if (!csv.empty()) write_text(csv, s::replay_csv(results));
    return 0;
  }
  if (o.experiment != "fill")
    throw mgpu::Error(mgpu::Errc::invalid_argument, "--experiment " + o.experiment + " (expected fill or replay)");
  if (o.bound != "relaxation" && o.bound != "exact" && o.bound != "off")
    throw mgpu::Error(mgpu::Errc::invalid_argument, "--bound " + o.bound + " (expected relaxation, exact or off)");
  auto const start = std::chrono::steady_clock::now();
  std::vector<s::FillResult> results;
  s::MigrationOptions migration = o.migration;
  for (s::TieRule tie : ties) {
    for (auto [p, migrates] : policies) {
      migration.enabled = migrates;
      results.push_back(s::fill(nodes, pods,
                                {.policy = p,
                                 .tie = tie,
                                 .target = target,
                                 .max_arrived = o.max_arrived,
                                 .step = o.step,
                                 .seed = seed,
                                 .migration = migration}));
    }
  }
  s::FillOptions const draws{.max_arrived = o.max_arrived, .step = o.step, .seed = seed};
  if (o.bound != "off")
    results.push_back(s::fill_bound(nodes, pods, draws,
                                    o.bound == "exact" ? s::BoundMethod::exact : s::BoundMethod::relaxation));
  double const seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("fill: pods drawn with replacement (seed %u) until their GPU demand reaches %.0f%% of the capacity\n%s",
              seed, 100 * o.max_arrived, s::format_fill(results).c_str());
  if (std::any_of(policies.begin(), policies.end(), [](auto const& p) { return p.second; }))
    std::printf("migration: at most %g moves per 100 pods, %d per pod that fits nowhere, of pods of at most %d GPU(s); "
                "consolidation %s; a move costs its GPU share x (%g s + %g s per GiB of memory)\n",
                o.migration.moves_per_100_pods, o.migration.max_moves_per_pod, o.migration.max_pod_gpus,
                o.migration.every > 0 ? ("every " + std::to_string(o.migration.every) + " arrivals").c_str() : "off",
                o.migration.restart_seconds, o.migration.seconds_per_gib);
  if (o.bound != "off")
    std::printf("bound: %s (GLPK) on the same draws; a lower bound on the unallocated share of any placement\n",
                o.bound == "exact" ? "the exact integer program" : "the linear-programming relaxation");
  std::printf("experiment: %.1f s (every policy%s)\n", seconds, o.bound != "off" ? " and the bound" : "");
  if (!csv.empty()) write_text(csv, s::fill_csv(results));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Compare GPU job-scheduling policies on a trace"};
  std::string trace;
  int synthetic = 400;
  unsigned seed = 1;
  int servers = 2;
  int gpus = 8;
  std::vector<std::string> types = {"A100"};
  std::vector<std::string> mappings;
  std::string csv;
  std::string write_trace;
  double load = 0.9;
  app.add_option("--trace", trace, "trace CSV (see mgpu/cluster/simulator.hpp for the columns)")->check(CLI::ExistingFile);
  app.add_option("--synthetic", synthetic, "jobs in a synthetic trace, when no --trace is given")->check(CLI::PositiveNumber);
  app.add_option("--seed", seed,
                 "seed of the synthetic trace, nodes and pods, and of the fill's draws and random choices");
  app.add_option("--load", load, "synthetic trace: the share of the GPUs its jobs ask for on average")->check(CLI::PositiveNumber);
  app.add_option("--servers", servers, "servers to model")->check(CLI::PositiveNumber);
  app.add_option("--gpus", gpus, "GPUs per server")->check(CLI::PositiveNumber);
  app.add_option("--types", types, "GPU type of each server, cycled (e.g. A100 V100); V100 runs at 0.6x");
  app.add_option("--column", mappings, "map a field to a column name: submit=, duration=, end=, gpus=, gpu_type=, priority=, tenant=, memory_gb=");
  app.add_option("--csv", csv, "also write the comparison as CSV to this file");
  app.add_option("--write-trace", write_trace, "write the trace used (e.g. the synthetic one) to this file");
  ClusterOptions cluster;
  app.add_option("--nodes", cluster.nodes_file, "cluster: a nodes CSV (name, cpu_milli, memory_mib, gpus, model)")
      ->check(CLI::ExistingFile);
  app.add_option("--pods", cluster.pods_file,
                 "cluster: a pods CSV (name, cpu_milli, memory_mib, num_gpu, gpu_milli, gpu_spec, qos, creation_time, "
                 "deletion_time)")
      ->check(CLI::ExistingFile);
  app.add_option("--node-column", cluster.node_mappings,
                 "map a nodes-file field to a column name: name=, cpu_milli=, memory_mib=, gpus=, model=");
  app.add_option("--pod-column", cluster.pod_mappings,
                 "map a pods-file field to a column name: name=, cpu_milli=, memory_mib=, gpus=, gpu_milli=, models=, "
                 "qos=, creation=, deletion=");
  app.add_option("--synthetic-nodes", cluster.synthetic_nodes, "cluster: synthetic nodes when no --nodes is given")
      ->check(CLI::PositiveNumber);
  app.add_option("--synthetic-pods", cluster.synthetic_pods, "cluster: synthetic pods when no --pods is given")
      ->check(CLI::PositiveNumber);
  app.add_option("--constrained-share", cluster.constrained_share,
                 "synthetic pods: share of GPU pods with a GPU model constraint")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--pod-interarrival", cluster.interarrival,
                 "synthetic pods: mean seconds between arrivals (the trace's: 350)")
      ->check(CLI::PositiveNumber);
  app.add_option("--arrival-speedup", cluster.speedup,
                 "replay: divide creation times by this factor, keeping run times (a load test)")
      ->check(CLI::PositiveNumber);
  app.add_option("--experiment", cluster.experiment, "cluster: fill (Weng et al., ATC'23) or replay")
      ->check(CLI::IsMember({"fill", "replay"}));
  app.add_option(
      "--policy", cluster.policies,
      "cluster: placement policies (default all, and in the fill best-fit+migration fgd+migration): random first-fit "
      "best-fit worst-fit dot-product gpu-packing fgd, each also as NAME+migration (fill only)");
  app.add_option("--tie", cluster.ties,
                 "cluster: tie rules to run each policy under: first, random, packed (default random)");
  app.add_option("--target-coverage", cluster.coverage,
                 "fgd: the most frequent pod types making up this share of the pods")
      ->check(CLI::Range(0.01, 1.0));
  app.add_flag("--target-gpu-only", cluster.gpu_only_types,
               "fgd: pod types by GPU demand and model only (not CPU and memory)");
  app.add_option("--max-arrived", cluster.max_arrived,
                 "fill: stop at this arrived GPU demand, as a share of the capacity")
      ->check(CLI::PositiveNumber);
  app.add_option("--step", cluster.step, "fill: report every this much arrived demand")->check(CLI::PositiveNumber);
  app.add_option("--bound", cluster.bound,
                 "fill: the offline bound beside the policies: relaxation (LP, any size), exact (integer program, "
                 "small clusters) or off")
      ->check(CLI::IsMember({"relaxation", "exact", "off"}));
  app.add_option("--migration-cap", cluster.migration.moves_per_100_pods,
                 "fill, +migration policies: at most this many moves per 100 arrived pods")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--migration-moves", cluster.migration.max_moves_per_pod,
                 "fill, +migration policies: moves to make room for one pod, at most")
      ->check(CLI::PositiveNumber);
  app.add_option("--migration-every", cluster.migration.every,
                 "fill, +migration policies: a consolidation pass every this many arrivals (0: none)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--write-nodes", cluster.write_nodes,
                 "cluster: write the nodes used (e.g. the synthetic ones) to this file");
  app.add_option("--write-pods", cluster.write_pods,
                 "cluster: write the pods used (e.g. the synthetic ones) to this file");
  CLI11_PARSE(app, argc, argv);

  try {
    if (!cluster.nodes_file.empty() || !cluster.pods_file.empty() || cluster.synthetic_nodes > 0 ||
        cluster.synthetic_pods > 0)
      return run_cluster(cluster, seed, csv);
    mgpu::cluster::TraceColumns columns;
    for (std::string const& m : mappings) {
      auto const eq = m.find('=');
      if (eq == std::string::npos) throw mgpu::Error(mgpu::Errc::invalid_argument, "--column " + m + " (expected FIELD=NAME)");
      std::string const field = m.substr(0, eq);
      std::string const name = m.substr(eq + 1);
      if (field == "submit") columns.submit = name;
      else if (field == "duration") columns.duration = name;
      else if (field == "end") columns.end = name;
      else if (field == "gpus") columns.gpus = name;
      else if (field == "gpu_type") columns.gpu_type = name;
      else if (field == "priority") columns.priority = name;
      else if (field == "tenant") columns.tenant = name;
      else if (field == "memory_gb") columns.memory_gb = name;
      else throw mgpu::Error(mgpu::Errc::invalid_argument, "--column field '" + field + "' (expected submit, duration, end, gpus, gpu_type, priority, tenant or memory_gb)");
    }
    mgpu::cluster::TraceShape shape{.jobs = synthetic, .seed = seed};
    shape.mean_interarrival_seconds = mgpu::cluster::interarrival_for_load(shape, load, servers * gpus);
    std::vector<mgpu::sched::Job> const jobs = trace.empty() ? mgpu::cluster::synthetic_trace(shape) : mgpu::cluster::read_trace_csv(trace, columns);
    if (!write_trace.empty()) mgpu::cluster::write_trace_csv(write_trace, jobs);
    std::vector<mgpu::cluster::ServerSpec> specs;
    for (int s = 0; s < servers; ++s) {
      std::string const& type = types[static_cast<std::size_t>(s) % types.size()];
      specs.push_back({.gpus = gpus, .type = type, .speed = type == "V100" ? 0.6 : 1.0});
    }
    auto const nodes = mgpu::cluster::make_servers(specs);
    std::printf("%zu jobs on %d server(s) of %d GPUs (%s)\n\n", jobs.size(), servers, gpus, trace.empty() ? "synthetic trace" : trace.c_str());
    std::vector<mgpu::cluster::SimulationResult> results;
    for (auto const& policy : mgpu::sched::standard_policies()) results.push_back(mgpu::cluster::simulate(jobs, nodes, policy));
    std::printf("%s", mgpu::cluster::format_results(results).c_str());
    if (!csv.empty()) {
      std::ofstream out(csv);
      out << mgpu::cluster::results_csv(results);
      if (!out) throw mgpu::Error(mgpu::Errc::io, "cannot write " + csv);
    }
    return 0;
  } catch (mgpu::Error const& e) {
    std::fprintf(stderr, "schedule_jobs: %s\n", e.what());
    return 2;
  }
}
