// A trace-driven simulator: replays a job trace on modelled servers under each queue policy, with
// the same Scheduler and JobQueue code the library runs live.
//
// Trace format: CSV with a header row naming its columns. Columns (names configurable through
// TraceColumns, so public traces replay without rewriting): submit time (s), duration (s) or end
// time (s), GPUs requested (whole or fractional), GPU type constraint ('|'-separated, may be
// empty), priority (integer), tenant (optional), memory per GPU in GB (optional). Other columns
// (CPU, ...) are ignored.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include <mgpu/sched/job_queue.hpp>

namespace mgpu::cluster {

/// The header names of each field; empty `end` means durations are given directly.
struct TraceColumns {
  std::string submit = "submit_time";
  std::string duration = "duration";
  std::string end{};
  std::string gpus = "gpus";
  std::string gpu_type = "gpu_type";
  std::string priority = "priority";
  std::string tenant = "tenant";
  std::string memory_gb = "memory_gb";
};

/// Reads a trace. Throws Error(io) when the file cannot be read and Error(corrupt_data) naming the
/// file, line and column for a malformed row or a missing required column.
std::vector<sched::Job> read_trace_csv(std::filesystem::path const& path, TraceColumns const& columns = {});
/// Writes jobs in the default column names.
void write_trace_csv(std::filesystem::path const& path, std::vector<sched::Job> const& jobs);

/// The shape of a synthetic trace: heavy-tailed (log-normal) durations, mostly 1-GPU jobs, Poisson
/// arrivals with bursts, a few tenants of very different sizes, some high-priority jobs.
struct TraceShape {
  int jobs = 400;
  double mean_interarrival_seconds = 60;
  double median_duration_seconds = 1800;
  double duration_sigma = 1.5;    ///< of the log-normal: 1.5 gives a heavy tail
  double burst_probability = 0.1; ///< chance a job starts a burst of quick arrivals
  double fractional_share = 0.1;  ///< jobs asking for half or a quarter of a GPU
  double high_priority_share = 0.1;
  unsigned seed = 1;
};
std::vector<sched::Job> synthetic_trace(TraceShape const& shape);
/// The mean interarrival time that makes `shape`'s jobs ask for `load` (e.g. 0.8) of `gpus` GPUs
/// on average, from the generator's distributions.
double interarrival_for_load(TraceShape const& shape, double load, int gpus);

/// One modelled server.
struct ServerSpec {
  int gpus = 8;
  std::string type = "A100";
  double speed = 1.0;
  double memory_bytes = 80e9;
  double link = 1.0;  ///< link quality between its GPUs (1 = NVLink everywhere)
  double max_watts = 400;
  double idle_watts = 60;
  double min_power_limit = 160;  ///< 0: the GPUs' power limit cannot be set
};
std::vector<sched::NodeState> make_servers(std::vector<ServerSpec> const& specs);

struct SimulationResult {
  std::string policy{};
  int jobs = 0;
  int unfinished = 0;
  double mean_jct = 0;
  double p95_jct = 0;
  double makespan = 0;
  double utilization = 0;  ///< GPU-seconds in use / (GPUs x makespan)
  double mean_queueing_delay = 0;
  double jain_fairness = 1;  ///< over tenants' mean normalized progress (duration / JCT)
  int preemptions = 0;
  double energy_kwh = 0;  ///< drawn by the GPUs while running jobs (at their power limits)
};

/// Replays `jobs` on `servers` under `policy` (with the default scheduling profile).
SimulationResult simulate(std::vector<sched::Job> const& jobs, std::vector<sched::NodeState> const& servers, sched::QueuePolicy const& policy);

/// A fixed-width table of results, one row per policy.
std::string format_results(std::vector<SimulationResult> const& results);
/// The same as CSV.
std::string results_csv(std::vector<SimulationResult> const& results);

}  // namespace mgpu::cluster
