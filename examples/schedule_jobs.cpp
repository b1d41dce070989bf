// schedule_jobs: replays a job trace (a CSV file, or a synthetic one) on modelled GPU servers under
// each queue policy, with the library's own scheduler, and prints a table comparing them.
//
//   schedule_jobs --synthetic 500 --servers 2 --gpus 8
//   schedule_jobs --trace jobs.csv --column submit=start_time --column end=end_time --csv out.csv
#include <CLI/CLI.hpp>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <mgpu/mgpu.hpp>

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
  app.add_option("--trace", trace, "trace CSV (see mgpu/sched/simulator.hpp for the columns)")->check(CLI::ExistingFile);
  app.add_option("--synthetic", synthetic, "jobs in a synthetic trace, when no --trace is given")->check(CLI::PositiveNumber);
  app.add_option("--seed", seed, "seed of the synthetic trace");
  app.add_option("--load", load, "synthetic trace: the share of the GPUs its jobs ask for on average")->check(CLI::PositiveNumber);
  app.add_option("--servers", servers, "servers to model")->check(CLI::PositiveNumber);
  app.add_option("--gpus", gpus, "GPUs per server")->check(CLI::PositiveNumber);
  app.add_option("--types", types, "GPU type of each server, cycled (e.g. A100 V100); V100 runs at 0.6x");
  app.add_option("--column", mappings, "map a field to a column name: submit=, duration=, end=, gpus=, gpu_type=, priority=, tenant=, memory_gb=");
  app.add_option("--csv", csv, "also write the comparison as CSV to this file");
  app.add_option("--write-trace", write_trace, "write the trace used (e.g. the synthetic one) to this file");
  CLI11_PARSE(app, argc, argv);

  try {
    mgpu::sched::TraceColumns columns;
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
    mgpu::sched::TraceShape shape{.jobs = synthetic, .seed = seed};
    shape.mean_interarrival_seconds = mgpu::sched::interarrival_for_load(shape, load, servers * gpus);
    std::vector<mgpu::sched::Job> const jobs = trace.empty() ? mgpu::sched::synthetic_trace(shape) : mgpu::sched::read_trace_csv(trace, columns);
    if (!write_trace.empty()) mgpu::sched::write_trace_csv(write_trace, jobs);
    std::vector<mgpu::sched::ServerSpec> specs;
    for (int s = 0; s < servers; ++s) {
      std::string const& type = types[static_cast<std::size_t>(s) % types.size()];
      specs.push_back({.gpus = gpus, .type = type, .speed = type == "V100" ? 0.6 : 1.0});
    }
    auto const nodes = mgpu::sched::make_servers(specs);
    std::printf("%zu jobs on %d server(s) of %d GPUs (%s)\n\n", jobs.size(), servers, gpus, trace.empty() ? "synthetic trace" : trace.c_str());
    std::vector<mgpu::sched::SimulationResult> results;
    for (auto const& policy : mgpu::sched::standard_policies()) results.push_back(mgpu::sched::simulate(jobs, nodes, policy));
    std::printf("%s", mgpu::sched::format_results(results).c_str());
    if (!csv.empty()) {
      std::ofstream out(csv);
      out << mgpu::sched::results_csv(results);
      if (!out) throw mgpu::Error(mgpu::Errc::io, "cannot write " + csv);
    }
    return 0;
  } catch (mgpu::Error const& e) {
    std::fprintf(stderr, "schedule_jobs: %s\n", e.what());
    return 2;
  }
}
