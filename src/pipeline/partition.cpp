// Pipeline partitioning: cutting a model into chunks from profiled per-layer costs (on equal
// devices, or on devices of different speeds and free memory for a schedule), the plan's report,
// and the profiling itself. The min-max split is sched::min_max_split, shared with sched::partition.
#include <mgpu/pipeline/pipeline.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>

#include <mgpu/core/error.hpp>
#include <mgpu/core/memory.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/sched/live.hpp>
#include <mgpu/sched/min_max_split.hpp>

namespace mgpu::pipeline {
namespace {

constexpr double unlimited = std::numeric_limits<double>::infinity();

std::size_t at(int i) { return static_cast<std::size_t>(i); }

// The model's units (first layers, then its size), checking that there are at least `chunks`.
std::vector<std::size_t> units_for(nn::Sequential const& model, int chunks) {
  auto cuts = model.cut_points();
  int const units = static_cast<int>(cuts.size()) - 1;
  if (chunks < 1 || chunks > units)
    throw Error(Errc::invalid_argument, "partition into " + std::to_string(chunks) + " stages of a model of " + std::to_string(units) +
                                            " units (expected 1 to " + std::to_string(units) +
                                            " stages; a Linear and its fused activation are one unit)");
  return cuts;
}

// Prefix sums over units of a per-layer value: sums[u] is the total of units [0, u).
std::vector<double> unit_prefix(std::vector<std::size_t> const& cuts, std::vector<double> const& per_layer) {
  std::vector<double> sums(cuts.size(), 0.0);
  for (std::size_t u = 0; u + 1 < cuts.size(); ++u) {
    double unit = 0;
    for (std::size_t l = cuts[u]; l < cuts[u + 1]; ++l) unit += per_layer[l];
    sums[u + 1] = sums[u] + unit;
  }
  return sums;
}

void check_per_layer(nn::Sequential const& model, std::vector<double> const& values, char const* what) {
  if (values.size() != model.size())
    throw Error(Errc::invalid_argument, "partition with " + std::string(what) + " for " + std::to_string(values.size()) + " layers (expected " +
                                            std::to_string(model.size()) + ", one per layer)");
  for (std::size_t l = 0; l < values.size(); ++l) {
    if (!(values[l] >= 0) || !std::isfinite(values[l]))
      throw Error(Errc::invalid_argument, "partition with " + std::string(what) + " " + std::to_string(values[l]) + " for layer " +
                                              std::to_string(l) + " (expected a finite value >= 0)");
  }
}

std::string format_seconds(double seconds) {
  char text[32];
  if (seconds >= 1.0 || seconds == 0.0) {
    std::snprintf(text, sizeof text, "%.3g s", seconds);
  } else if (seconds >= 1e-3) {
    std::snprintf(text, sizeof text, "%.3g ms", seconds * 1e3);
  } else {
    std::snprintf(text, sizeof text, "%.3g us", seconds * 1e6);
  }
  return text;
}

std::string bytes(double b) { return format_bytes(static_cast<std::size_t>(b)); }

}  // namespace

std::string to_string(Partition const& plan) {
  std::string text;
  for (std::size_t c = 0; c < plan.chunk_seconds.size(); ++c) {
    text += "chunk " + std::to_string(c) + " on device " + std::to_string(plan.device[c]) + ": layers [" + std::to_string(plan.cuts[c]) +
            ", " + std::to_string(plan.cuts[c + 1]) + "), " + format_seconds(plan.chunk_seconds[c]);
    if (plan.free_bytes[c] != unlimited) text += ", " + bytes(plan.chunk_bytes[c]) + " of " + bytes(plan.free_bytes[c]) + " free";
    text += "\n";
  }
  return text;
}

Partition partition(nn::Sequential const& model, int chunks, std::vector<double> const& layer_seconds) {
  check_per_layer(model, layer_seconds, "costs");
  auto const cuts = units_for(model, chunks);
  std::vector<double> const seconds = unit_prefix(cuts, layer_seconds);
  auto const cost = [&](int, int begin, int end) { return seconds[at(end)] - seconds[at(begin)]; };
  std::vector<int> const first = sched::min_max_split(static_cast<int>(cuts.size()) - 1, chunks, cost, [](int, int, int) { return true; });
  Partition plan;
  for (int c = 0; c < chunks; ++c) {
    plan.cuts.push_back(cuts[at(first[at(c)])]);
    plan.chunk_seconds.push_back(cost(c, first[at(c)], first[at(c) + 1]));
    plan.device.push_back(c);
  }
  plan.cuts.push_back(model.size());
  plan.chunk_bytes.assign(at(chunks), 0.0);
  plan.free_bytes.assign(at(chunks), unlimited);
  return plan;
}

Partition partition(nn::Sequential const& model, Schedule const& schedule, LayerProfile const& profile,
                    std::vector<StageDevice> const& devices, PartitionOptions options) {
  check_per_layer(model, profile.seconds, "costs");
  check_per_layer(model, profile.parameter_bytes, "parameter bytes");
  check_per_layer(model, profile.activation_bytes, "activation bytes");
  if (devices.size() != at(schedule.devices))
    throw Error(Errc::invalid_argument, "partition over " + std::to_string(devices.size()) + " devices for a schedule of " +
                                            std::to_string(schedule.devices) + " (expected one device per schedule device)");
  for (std::size_t d = 0; d < devices.size(); ++d) {
    if (!(devices[d].speed > 0) || !std::isfinite(devices[d].speed))
      throw Error(Errc::invalid_argument, "partition over device " + std::to_string(d) + " of speed " + std::to_string(devices[d].speed) +
                                              " (expected a finite speed > 0)");
    if (!(devices[d].free_bytes >= 0))
      throw Error(Errc::invalid_argument, "partition over device " + std::to_string(d) + " with " + std::to_string(devices[d].free_bytes) +
                                              " free bytes (expected >= 0)");
  }
  if (options.optimizer_states < 0)
    throw Error(Errc::invalid_argument, "partition with " + std::to_string(options.optimizer_states) +
                                            " optimizer states (expected >= 0: 0 plain SGD, 1 momentum, 2 AdamW)");
  int const chunks = schedule.chunks();
  auto const cuts = units_for(model, chunks);
  std::vector<int> const in_flight = simulate(schedule).peak_in_flight;  // validates the schedule
  std::vector<double> const seconds = unit_prefix(cuts, profile.seconds);
  std::vector<double> const parameters = unit_prefix(cuts, profile.parameter_bytes);
  std::vector<double> const activations = unit_prefix(cuts, profile.activation_bytes);
  double const copies = 2.0 + options.optimizer_states;
  auto const device = [&](int c) -> StageDevice const& { return devices[at(schedule.device_of(c))]; };
  auto const time = [&](int c, int begin, int end) { return (seconds[at(end)] - seconds[at(begin)]) / device(c).speed; };
  auto const state = [&](int begin, int end) { return (parameters[at(end)] - parameters[at(begin)]) * copies; };
  auto const held = [&](int c, int begin, int end) { return in_flight[at(schedule.device_of(c))] * (activations[at(end)] - activations[at(begin)]); };
  auto const need = [&](int c, int begin, int end) { return state(begin, end) + held(c, begin, end); };
  auto const budget = [&](int c) { return device(c).free_bytes / schedule.chunks_per_device; };
  int const units = static_cast<int>(cuts.size()) - 1;
  std::vector<int> const first = sched::min_max_split(units, chunks, time, [&](int c, int begin, int end) { return need(c, begin, end) <= budget(c); });
  if (first.empty()) {
    // The split that overflows least, and its worst chunk.
    auto const overflow = [&](int c, int begin, int end) { return need(c, begin, end) - budget(c); };
    std::vector<int> const closest = sched::min_max_split(units, chunks, overflow, [](int, int, int) { return true; });
    int worst = 0;
    for (int c = 1; c < chunks; ++c) {
      if (overflow(c, closest[at(c)], closest[at(c) + 1]) > overflow(worst, closest[at(worst)], closest[at(worst) + 1])) worst = c;
    }
    int const begin = closest[at(worst)];
    int const end = closest[at(worst) + 1];
    throw Error(Errc::out_of_memory,
                "no split of the model's " + std::to_string(units) + " units into " + std::to_string(chunks) +
                    " chunks fits in memory; at best chunk " + std::to_string(worst) + " (layers [" + std::to_string(cuts[at(begin)]) + ", " +
                    std::to_string(cuts[at(end)]) + ")) on device " + std::to_string(schedule.device_of(worst)) + " needs " +
                    bytes(need(worst, begin, end)) + " (" + bytes(state(begin, end)) + " of parameters, gradients and optimizer state, " +
                    bytes(held(worst, begin, end)) + " for " + std::to_string(in_flight[at(schedule.device_of(worst))]) +
                    " micro-batches in flight) but has " + bytes(budget(worst)) +
                    " free (expected a need within the free memory: more devices, fewer micro-batches in flight or more memory)");
  }
  Partition plan;
  for (int c = 0; c < chunks; ++c) {
    int const begin = first[at(c)];
    int const end = first[at(c) + 1];
    plan.cuts.push_back(cuts[at(begin)]);
    plan.chunk_seconds.push_back(time(c, begin, end));
    plan.device.push_back(schedule.device_of(c));
    plan.chunk_bytes.push_back(need(c, begin, end));
    plan.free_bytes.push_back(budget(c));
  }
  plan.cuts.push_back(model.size());
  return plan;
}

std::vector<StageDevice> stage_devices(DeviceGroup const& group, int devices) {
  if (devices < 1 || group.size() % devices != 0)
    throw Error(Errc::invalid_argument, "stage_devices for " + std::to_string(devices) + " pipeline devices of a group of " +
                                            std::to_string(group.size()) + " (expected a divisor of the group's size)");
  sched::NodeState const node = sched::node_state(group);
  std::vector<StageDevice> out(at(devices), {unlimited, unlimited});
  for (int r = 0; r < group.size(); ++r) {
    sched::DeviceState const& d = node.devices[at(r)];
    double free = d.free_bytes;
    if (auto const limit = group.allocator(r).limit()) {
      double const allocated = static_cast<double>(group.allocator(r).stats().allocated);
      free = std::min(free, std::max(0.0, static_cast<double>(*limit) - allocated));
    }
    StageDevice& device = out[at(r % devices)];
    device.speed = std::min(device.speed, d.speed);
    device.free_bytes = std::min(device.free_bytes, free);
  }
  return out;
}

LayerProfile profile_layers(nn::Sequential const& model, DeviceGroup& group, Shape const& input, int repeats,
                            ProfileTimer const& timer) {
  if (repeats < 1) throw Error(Errc::invalid_argument, "profile_layers with " + std::to_string(repeats) + " repeats (expected >= 1)");
  LayerProfile profile;
  profile.seconds.assign(model.size(), 0.0);
  profile.activation_bytes.assign(model.size(), 0.0);
  for (std::size_t l = 0; l < model.size(); ++l)
    profile.parameter_bytes.push_back(static_cast<double>(model.layer(l).parameter_count()) * static_cast<double>(sizeof(float)));
  double const speed = sched::node_state(group).devices[0].speed;
  ProfileTimer const clock = [](std::function<void()> const& run) {
    auto const start = std::chrono::steady_clock::now();
    run();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  ProfileTimer const& measure = timer ? timer : clock;
  auto const cuts = model.cut_points();
  group.run([&](int rank, Device, Stream& stream) {
    if (rank != 0) return;
    Allocator& allocator = group.allocator(0);
    nn::Context ctx{allocator, stream};
    Shape shape = input;
    for (std::size_t u = 0; u + 1 < cuts.size(); ++u) {
      nn::Sequential unit = model.stage(cuts[u], cuts[u + 1]);
      unit.materialize(ctx, 0);
      Tensor const x = ops::zeros(shape, ctx.allocator, stream);
      Shape const out = unit.output_shape(shape);
      Tensor const dy = ops::zeros(out, ctx.allocator, stream);
      std::vector<double> runs;
      for (int r = 0; r < repeats; ++r) {
        stream.synchronize();
        std::size_t const before = allocator.stats().allocated;
        runs.push_back(measure([&] {
          Tensor const y = unit.forward(x, ctx);
          stream.synchronize();
          profile.activation_bytes[cuts[u]] = static_cast<double>(allocator.stats().allocated - before);
          unit.backward(dy, ctx, true);
          stream.synchronize();
        }));
      }
      std::nth_element(runs.begin(), runs.begin() + repeats / 2, runs.end());
      profile.seconds[cuts[u]] = runs[static_cast<std::size_t>(repeats / 2)] * speed;
      shape = out;
    }
  });
  return profile;
}

}  // namespace mgpu::pipeline
