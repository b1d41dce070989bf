// Pipeline partitioning: cutting a model into chunks from profiled per-layer costs, and the
// profiling itself.
#include <mgpu/parallel/pipeline.hpp>

#include <algorithm>
#include <chrono>
#include <string>

#include <mgpu/core/error.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/sched/planning.hpp>

namespace mgpu::pipeline {

Partition partition(nn::Sequential const& model, int chunks, std::vector<double> const& layer_seconds) {
  if (layer_seconds.size() != model.size())
    throw Error(Errc::invalid_argument, "partition with costs for " + std::to_string(layer_seconds.size()) + " layers (expected " +
                                            std::to_string(model.size()) + ", one per layer)");
  auto const cuts = model.cut_points();
  int const units = static_cast<int>(cuts.size()) - 1;
  if (chunks < 1 || chunks > units)
    throw Error(Errc::invalid_argument, "partition into " + std::to_string(chunks) + " stages of a model of " + std::to_string(units) +
                                            " units (expected 1 to " + std::to_string(units) +
                                            " stages; a Linear and its fused activation are one unit)");
  std::vector<double> unit_seconds(static_cast<std::size_t>(units), 0.0);
  for (int u = 0; u < units; ++u) {
    for (std::size_t l = cuts[static_cast<std::size_t>(u)]; l < cuts[static_cast<std::size_t>(u) + 1]; ++l)
      unit_seconds[static_cast<std::size_t>(u)] += layer_seconds[l];
  }
  sched::NodeState node;
  std::vector<int> ids;
  for (int d = 0; d < chunks; ++d) {
    sched::DeviceState device;
    device.id = d;
    device.capacity_bytes = device.free_bytes = 1e18;
    device.links.assign(static_cast<std::size_t>(chunks), 1.0);
    node.devices.push_back(device);
    ids.push_back(d);
  }
  sched::StagePlan const plan = sched::partition(unit_seconds, std::vector<double>(unit_seconds.size(), 0.0), node, ids, chunks);
  Partition result;
  for (int const first : plan.first_layer) result.cuts.push_back(cuts[static_cast<std::size_t>(first)]);  // ends with the unit count
  result.chunk_seconds = plan.stage_seconds;
  return result;
}

std::vector<double> profile_layers(nn::Sequential const& model, DeviceGroup& group, Shape const& input, int repeats) {
  if (repeats < 1) throw Error(Errc::invalid_argument, "profile_layers with " + std::to_string(repeats) + " repeats (expected >= 1)");
  std::vector<double> seconds(model.size(), 0.0);
  auto const cuts = model.cut_points();
  group.run([&](int rank, Device, Stream& stream) {
    if (rank != 0) return;
    nn::Context ctx{group.allocator(0), stream};
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
        auto const start = std::chrono::steady_clock::now();
        unit.forward(x, ctx);
        unit.backward(dy, ctx, true);
        stream.synchronize();
        runs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
      std::nth_element(runs.begin(), runs.begin() + repeats / 2, runs.end());
      seconds[cuts[u]] = runs[static_cast<std::size_t>(repeats / 2)];
      shape = out;
    }
  });
  return seconds;
}

}  // namespace mgpu::pipeline
