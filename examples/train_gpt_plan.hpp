// train_gpt --plan auto: the planner chooses the layout (plan::plan_gpt over the measured costs),
// and --json's "plan" field reports the choice.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <mgpu/mgpu.hpp>

#include "train_gpt_flags.hpp"

namespace train_gpt {

// What --plan chose, and what it weighed.
struct Planned {
  mgpu::plan::Plan plan;
  std::size_t memory_bytes = 0;
};

// --plan auto: measures the GPT's costs on the devices, plans its layout for the batch, prints the
// choice and the runner-up, and returns it as the layout.
inline mgpu::train::ParallelConfig plan_layout(Options const& o, mgpu::nn::GptConfig const& config, int processes, FILE* log,
                                               std::optional<Planned>& planned) {
  if (!o.layout_flags.empty())
    throw mgpu::Error(mgpu::Errc::invalid_argument, "--plan " + o.plan + " with " + o.layout_flags +
                                                        " (expected no layout flags: the planner chooses them)");
  if (processes > 1)
    throw mgpu::Error(mgpu::Errc::invalid_argument, "--plan " + o.plan + " in a job of " + std::to_string(processes) +
                                                        " processes (expected one process: the planner lays out one process's devices)");
  if (o.precision != "fp32")
    throw mgpu::Error(mgpu::Errc::invalid_argument,
                      "--plan " + o.plan + " with --precision " + o.precision + " (expected fp32: the memory model is float32's)");
  mgpu::DeviceGroup group(o.devices);
  int const devices = group.size();
  // Costs at one row, a replica's rows and the whole batch: the lines through them cover every
  // layout's micro-batches.
  std::vector<std::int64_t> rows{1, std::max<std::int64_t>(1, o.batch_size / devices), o.batch_size};
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  mgpu::plan::GptCosts const costs = mgpu::plan::measure_gpt_costs(config, group, rows);
  Planned& p = planned.emplace();
  p.memory_bytes = std::numeric_limits<std::size_t>::max();
  for (mgpu::sched::DeviceState const& d : mgpu::sched::node_state(group).devices)
    p.memory_bytes = std::min(p.memory_bytes, static_cast<std::size_t>(d.free_bytes));
  if (o.device_memory_mb > 0) p.memory_bytes = static_cast<std::size_t>(o.device_memory_mb) << 20;
  p.plan = mgpu::plan::plan_gpt(config, o.batch_size, devices, costs, {.memory_bytes = p.memory_bytes});
  std::vector<mgpu::plan::Candidate> const& ranked = p.plan.candidates;
  std::fprintf(log, "plan: %zu of %zu layouts over %s fit %.1f MiB per device; ranked by step time from measured costs\n",
               ranked.size(), p.plan.considered, o.devices.c_str(), static_cast<double>(p.memory_bytes) / (1 << 20));
  for (std::size_t i = 0; i < std::min<std::size_t>(2, ranked.size()); ++i)
    std::fprintf(log, "  %s %s: predicted %.1f ms per step, %.2f MB per device\n", i == 0 ? "chosen:   " : "runner-up:",
                 mgpu::plan::to_string(ranked[i].layout).c_str(), ranked[i].step_seconds * 1e3,
                 static_cast<double>(ranked[i].peak_bytes) / 1e6);
  return mgpu::train::ParallelConfig::from_plan(ranked.front().layout);
}

// The "plan" field of --json: the chosen layout and its predictions, the runner-up, the counts.
inline std::string plan_json(std::optional<Planned> const& planned) {
  if (!planned) return "null";
  auto const layout = [](mgpu::plan::Candidate const& c) {
    char text[400];
    std::snprintf(text, sizeof text,
                  "{\"dp\": %d, \"tp\": %d, \"pp\": %d, \"zero\": %d, \"sequence_parallel\": %s, \"recompute\": \"%s\", "
                  "\"micro_batches\": %d, \"predicted_step_s\": %.6g, \"predicted_peak_bytes\": %zu}",
                  c.layout.data_parallel, c.layout.tensor_parallel, c.layout.stages, c.layout.zero_stage,
                  c.layout.sequence_parallel ? "true" : "false",
                  std::string(mgpu::nn::to_string(c.layout.recompute)).c_str(), c.layout.micro_batches, c.step_seconds,
                  c.peak_bytes);
    return std::string(text);
  };
  std::vector<mgpu::plan::Candidate> const& ranked = planned->plan.candidates;
  std::string json = layout(ranked.front());
  json.pop_back();
  return json + ", \"runner_up\": " + (ranked.size() > 1 ? layout(ranked[1]) : std::string("null")) +
         ", \"fit\": " + std::to_string(ranked.size()) + ", \"considered\": " + std::to_string(planned->plan.considered) +
         ", \"memory_bytes\": " + std::to_string(planned->memory_bytes) + "}";
}

}  // namespace train_gpt
