// The trace simulator, trace files and synthetic traces.
#include <mgpu/cluster/simulator.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <sstream>

#include <mgpu/core/error.hpp>

#include "csv.hpp"

namespace mgpu::cluster {
using detail::corrupt;
using detail::number;
using detail::split_csv;
using sched::DeviceState;
using sched::Job;
using sched::JobEvent;
using sched::JobQueue;
using sched::NodeState;
using sched::QueuePolicy;
using sched::RuntimePredictor;
using sched::Scheduler;

std::vector<Job> read_trace_csv(std::filesystem::path const& path, TraceColumns const& columns) {
  std::ifstream in(path);
  if (!in) throw Error(Errc::io, "cannot read trace " + path.string() + " (expected a readable CSV file)");
  std::string line;
  if (!std::getline(in, line)) corrupt(path, 1, "the file is empty (expected a header row)");
  std::vector<std::string> const header = split_csv(line);
  auto const column = [&](std::string const& name, bool required) -> int {
    if (name.empty()) return -1;
    for (std::size_t i = 0; i < header.size(); ++i) {
      if (header[i] == name) return static_cast<int>(i);
    }
    if (required) corrupt(path, 1, "no column named '" + name + "' in the header (expected it, or a mapping to another name)");
    return -1;
  };
  int const submit = column(columns.submit, true);
  int const end = column(columns.end, !columns.end.empty());
  int const duration = columns.end.empty() ? column(columns.duration, true) : -1;
  int const gpus = column(columns.gpus, true);
  int const type = column(columns.gpu_type, false);
  int const priority = column(columns.priority, false);
  int const tenant = column(columns.tenant, false);
  int const memory = column(columns.memory_gb, false);

  std::vector<Job> jobs;
  for (std::size_t number_of_line = 2; std::getline(in, line); ++number_of_line) {
    if (line.empty() || line == "\r") continue;
    std::vector<std::string> const f = split_csv(line);
    if (f.size() < header.size())
      corrupt(path, number_of_line, "has " + std::to_string(f.size()) + " fields (expected " + std::to_string(header.size()) + ")");
    auto const at = [&](int i) { return f[static_cast<std::size_t>(i)]; };
    Job j;
    j.id = static_cast<int>(jobs.size());
    j.submit = number(path, number_of_line, columns.submit, at(submit));
    j.duration = end >= 0 ? number(path, number_of_line, columns.end, at(end)) - j.submit
                          : number(path, number_of_line, columns.duration, at(duration));
    j.gpus = number(path, number_of_line, columns.gpus, at(gpus));
    if (j.duration < 0) corrupt(path, number_of_line, "the job ends before it is submitted (expected end >= submit)");
    if (!(j.gpus > 0))
      corrupt(path, number_of_line,
              "asks for " + at(gpus) +
                  " GPUs (expected more than 0; pods with CPU-only, CPU and memory demands are read as a pods file: "
                  "read_pods_csv, schedule_jobs --pods)");
    if (type >= 0) j.gpu_type = at(type);
    if (priority >= 0 && !at(priority).empty()) {
      double const p = number(path, number_of_line, columns.priority, at(priority));
      if (p != std::floor(p) || p < std::numeric_limits<int>::min() || p > std::numeric_limits<int>::max())
        corrupt(path, number_of_line, "column '" + columns.priority + "' is '" + at(priority) + "' (expected a whole number that fits an int)");
      j.priority = static_cast<int>(p);
    }
    if (tenant >= 0) j.tenant = at(tenant);
    if (memory >= 0 && !at(memory).empty()) j.memory_bytes = number(path, number_of_line, columns.memory_gb, at(memory)) * 1e9;
    jobs.push_back(j);
  }
  std::stable_sort(jobs.begin(), jobs.end(), [](Job const& a, Job const& b) { return a.submit < b.submit; });
  return jobs;
}

void write_trace_csv(std::filesystem::path const& path, std::vector<Job> const& jobs) {
  std::ofstream out(path);
  if (!out) throw Error(Errc::io, "cannot write trace " + path.string());
  out << "submit_time,duration,gpus,gpu_type,priority,tenant,memory_gb\n";
  for (Job const& j : jobs)
    out << j.submit << ',' << j.duration << ',' << j.gpus << ',' << j.gpu_type << ',' << j.priority << ',' << j.tenant << ','
        << j.memory_bytes / 1e9 << '\n';
  if (!out) throw Error(Errc::io, "writing trace " + path.string() + " failed");
}

std::vector<Job> synthetic_trace(TraceShape const& shape) {
  std::mt19937_64 rng(shape.seed);
  std::exponential_distribution<double> gap(1.0 / shape.mean_interarrival_seconds);
  std::lognormal_distribution<double> duration(std::log(shape.median_duration_seconds), shape.duration_sigma);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<Job> jobs;
  double t = 0;
  int burst_left = 0;
  for (int i = 0; i < shape.jobs; ++i) {
    if (burst_left > 0) {
      t += gap(rng) / 20.0;  // a burst: twenty times the usual rate
      --burst_left;
    } else {
      t += gap(rng);
      if (u(rng) < shape.burst_probability) burst_left = 5 + static_cast<int>(u(rng) * 20);
    }
    Job j;
    j.id = i;
    j.submit = t;
    j.duration = std::min(duration(rng), 50.0 * shape.median_duration_seconds);
    double const g = u(rng);
    double const fractional = shape.fractional_share;
    j.gpus = g < fractional ? (u(rng) < 0.5 ? 0.5 : 0.25) : g < fractional + 0.70 ? 1 : g < fractional + 0.80 ? 2 : g < fractional + 0.92 ? 4 : 8;
    j.priority = u(rng) < shape.high_priority_share ? 1 : 0;
    double const who = u(rng);  // one tenant submits most jobs
    j.tenant = who < 0.6 ? "team-a" : who < 0.8 ? "team-b" : who < 0.95 ? "team-c" : "team-d";
    j.memory_bytes = 8e9 + u(rng) * 32e9;
    j.task_type = j.gpus < 1 ? "inference" : "training";
    jobs.push_back(j);
  }
  return jobs;
}

double interarrival_for_load(TraceShape const& shape, double load, int gpus) {
  if (!(load > 0) || gpus < 1)
    throw Error(Errc::invalid_argument, "load " + std::to_string(load) + " on " + std::to_string(gpus) + " GPUs (expected load > 0 and GPUs >= 1)");
  double const f = shape.fractional_share;
  double const mean_gpus = f * 0.375 + 0.70 * 1 + 0.10 * 2 + 0.12 * 4 + (0.08 - f) * 8;  // as synthetic_trace draws them
  double const mean_duration = shape.median_duration_seconds * std::exp(shape.duration_sigma * shape.duration_sigma / 2);
  return mean_duration * std::max(mean_gpus, 0.1) / (load * gpus);
}

std::vector<NodeState> make_servers(std::vector<ServerSpec> const& specs) {
  std::vector<NodeState> servers;
  for (ServerSpec const& spec : specs) {
    if (spec.gpus < 1) throw Error(Errc::invalid_argument, "a server with " + std::to_string(spec.gpus) + " GPUs (expected at least 1)");
    NodeState node;
    for (int g = 0; g < spec.gpus; ++g) {
      DeviceState d;
      d.id = g;
      d.type = spec.type;
      d.capacity_bytes = d.free_bytes = spec.memory_bytes;
      d.speed = spec.speed;
      d.max_watts = spec.max_watts;
      d.idle_watts = spec.idle_watts;
      d.min_power_limit = spec.min_power_limit;
      d.links.assign(static_cast<std::size_t>(spec.gpus), spec.link);
      d.links[static_cast<std::size_t>(g)] = 0;
      node.devices.push_back(d);
    }
    servers.push_back(node);
  }
  return servers;
}

SimulationResult simulate(std::vector<Job> const& jobs, std::vector<NodeState> const& servers, QueuePolicy const& policy) {
  RuntimePredictor predictor;
  JobQueue queue(servers, Scheduler::default_profile(), policy, &predictor);
  std::vector<Job> order = jobs;
  std::stable_sort(order.begin(), order.end(), [](Job const& a, Job const& b) { return a.submit < b.submit; });
  std::map<int, double> finish_at;  // running job -> expected finish
  std::map<int, double> first_start;
  std::map<int, double> finished;
  std::map<int, Job> by_id;
  double busy_gpu_seconds = 0;
  std::map<int, double> started_at;
  std::map<int, double> gpus_of;
  std::map<int, double> watts_of;
  double joules = 0;
  std::size_t next = 0;
  double now = order.empty() ? 0 : order.front().submit;
  double const start_time = now;
  while (true) {
    double const next_submit = next < order.size() ? order[next].submit : std::numeric_limits<double>::infinity();
    double next_finish = std::numeric_limits<double>::infinity();
    for (auto const& [id, t] : finish_at) next_finish = std::min(next_finish, t);
    now = std::min(next_submit, next_finish);
    if (!std::isfinite(now)) break;  // nothing left to happen (jobs that never fit stay unfinished)
    for (auto it = finish_at.begin(); it != finish_at.end();) {
      if (it->second <= now + 1e-9) {
        queue.finish(it->first, now);
        finished[it->first] = now;
        busy_gpu_seconds += gpus_of[it->first] * (now - started_at[it->first]);
        joules += watts_of[it->first] * (now - started_at[it->first]);
        it = finish_at.erase(it);
      } else {
        ++it;
      }
    }
    while (next < order.size() && order[next].submit <= now + 1e-9) {
      by_id[order[next].id] = order[next];
      gpus_of[order[next].id] = order[next].gpus;
      queue.submit(order[next++]);
    }
    for (JobEvent const& e : queue.schedule(now)) {
      if (e.kind == JobEvent::start) {
        first_start.try_emplace(e.job, now);
        started_at[e.job] = now;
        watts_of[e.job] = e.watts;
        finish_at[e.job] = *queue.expected_finish(e.job);
      } else if (e.kind == JobEvent::preempt) {
        busy_gpu_seconds += gpus_of[e.job] * (now - started_at[e.job]);
        joules += watts_of[e.job] * (now - started_at[e.job]);
        finish_at.erase(e.job);
      }
    }
  }

  SimulationResult r;
  r.policy = policy.name;
  r.jobs = static_cast<int>(jobs.size());
  r.unfinished = static_cast<int>(jobs.size() - finished.size());
  r.preemptions = queue.preemptions();
  r.energy_kwh = joules / 3.6e6;
  std::vector<double> jct;
  std::map<std::string, std::pair<double, int>> progress;  // tenant -> (sum of duration / JCT, count)
  double delay = 0;
  double last = start_time;
  for (auto const& [id, end] : finished) {
    Job const& j = by_id[id];
    double const t = end - j.submit;
    jct.push_back(t);
    delay += first_start[id] - j.submit;
    last = std::max(last, end);
    auto& p = progress[j.tenant];
    p.first += t > 0 ? std::min(1.0, j.duration / t) : 1.0;
    p.second += 1;
  }
  if (!jct.empty()) {
    std::sort(jct.begin(), jct.end());
    double sum = 0;
    for (double t : jct) sum += t;
    r.mean_jct = sum / static_cast<double>(jct.size());
    r.p95_jct = jct[std::min(jct.size() - 1, static_cast<std::size_t>(std::ceil(0.95 * static_cast<double>(jct.size()))) - 1)];
    r.mean_queueing_delay = delay / static_cast<double>(jct.size());
  }
  r.makespan = last - start_time;
  double gpus = 0;
  for (auto const& s : servers) gpus += static_cast<double>(s.devices.size());
  r.utilization = r.makespan > 0 ? busy_gpu_seconds / (gpus * r.makespan) : 0;
  double x = 0;
  double xx = 0;
  for (auto const& [tenant, p] : progress) {
    double const v = p.first / p.second;
    x += v;
    xx += v * v;
  }
  r.jain_fairness = xx > 0 ? x * x / (static_cast<double>(progress.size()) * xx) : 1.0;
  return r;
}

std::string format_results(std::vector<SimulationResult> const& results) {
  std::string out;
  char line[256];
  std::snprintf(line, sizeof line, "%-18s %6s %11s %11s %11s %7s %11s %7s %7s %9s\n", "policy", "jobs", "mean JCT", "p95 JCT",
                "makespan", "util", "mean wait", "Jain", "preempt", "energy");
  out += line;
  for (auto const& r : results) {
    std::snprintf(line, sizeof line, "%-18s %6d %9.0f s %9.0f s %9.0f s %6.1f%% %9.0f s %7.3f %7d %5.0f kWh%s\n", r.policy.c_str(),
                  r.jobs, r.mean_jct, r.p95_jct, r.makespan, 100.0 * r.utilization, r.mean_queueing_delay, r.jain_fairness, r.preemptions,
                  r.energy_kwh,
                  r.unfinished ? (" (" + std::to_string(r.unfinished) + " unfinished)").c_str() : "");
    out += line;
  }
  return out;
}

std::string results_csv(std::vector<SimulationResult> const& results) {
  std::ostringstream out;
  out << "policy,jobs,unfinished,mean_jct_s,p95_jct_s,makespan_s,utilization,mean_queueing_delay_s,jain_fairness,preemptions,energy_kwh\n";
  for (auto const& r : results)
    out << r.policy << ',' << r.jobs << ',' << r.unfinished << ',' << r.mean_jct << ',' << r.p95_jct << ',' << r.makespan << ','
        << r.utilization << ',' << r.mean_queueing_delay << ',' << r.jain_fairness << ',' << r.preemptions << ',' << r.energy_kwh << '\n';
  return out.str();
}

}  // namespace mgpu::cluster
