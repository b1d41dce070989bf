// Shard weights, pipeline partitioning and placement, and the runtime predictor.
#include <mgpu/sched/planning.hpp>

#include <algorithm>
#include <cmath>

#include <mgpu/core/error.hpp>
#include <mgpu/core/memory.hpp>
#include <mgpu/sched/min_max_split.hpp>

namespace mgpu::sched {
namespace {
DeviceState const& device_by_id(NodeState const& node, int id) {
  for (auto const& d : node.devices) {
    if (d.id == id) return d;
  }
  throw Error(Errc::invalid_argument, "device " + std::to_string(id) + " is not in the node (expected one of its device ids)");
}
}  // namespace

std::vector<double> shard_weights(NodeState const& node, std::vector<int> const& device_ids, double step_seconds) {
  if (!(step_seconds > 0)) throw Error(Errc::invalid_argument, "step_seconds " + std::to_string(step_seconds) + " (expected > 0)");
  std::vector<double> weights;
  for (int id : device_ids) {
    DeviceState const& d = device_by_id(node, id);
    weights.push_back(d.speed * step_seconds / (step_seconds + d.queued_seconds / std::max(d.speed, 1e-9)));
  }
  return weights;
}

std::vector<int> pipeline_order(NodeState const& node, std::vector<int> device_ids) {
  std::vector<int> order;
  if (device_ids.empty()) return order;
  auto const speed = [&](int id) { return device_by_id(node, id).speed; };
  auto first = std::max_element(device_ids.begin(), device_ids.end(), [&](int a, int b) { return speed(a) < speed(b); });
  order.push_back(*first);
  device_ids.erase(first);
  while (!device_ids.empty()) {
    DeviceState const& last = device_by_id(node, order.back());
    auto const quality = [&](int id) {
      auto const j = static_cast<std::size_t>(id);
      return std::pair{j < last.links.size() ? last.links[j] : 0.0, speed(id)};
    };
    auto next = std::max_element(device_ids.begin(), device_ids.end(), [&](int a, int b) { return quality(a) < quality(b); });
    order.push_back(*next);
    device_ids.erase(next);
  }
  return order;
}

StagePlan partition(std::vector<double> const& layer_seconds, std::vector<double> const& layer_bytes, NodeState const& node,
                    std::vector<int> const& device_ids, int stages) {
  int const layers = static_cast<int>(layer_seconds.size());
  if (layer_bytes.size() != layer_seconds.size())
    throw Error(Errc::invalid_argument, "partition: " + std::to_string(layer_seconds.size()) + " layer costs but " +
                                            std::to_string(layer_bytes.size()) + " layer sizes (expected one of each per layer)");
  if (stages < 1 || stages > layers)
    throw Error(Errc::invalid_argument, "partition into " + std::to_string(stages) + " stages of " + std::to_string(layers) +
                                            " layers (expected 1 <= stages <= layers)");
  if (static_cast<int>(device_ids.size()) < stages)
    throw Error(Errc::invalid_argument, "partition into " + std::to_string(stages) + " stages on " +
                                            std::to_string(device_ids.size()) + " devices (expected a device per stage)");
  std::vector<int> const order = pipeline_order(node, device_ids);
  std::vector<double> cost_prefix(static_cast<std::size_t>(layers) + 1, 0.0);
  std::vector<double> bytes_prefix(static_cast<std::size_t>(layers) + 1, 0.0);
  for (int l = 0; l < layers; ++l) {
    cost_prefix[static_cast<std::size_t>(l) + 1] = cost_prefix[static_cast<std::size_t>(l)] + layer_seconds[static_cast<std::size_t>(l)];
    bytes_prefix[static_cast<std::size_t>(l) + 1] = bytes_prefix[static_cast<std::size_t>(l)] + layer_bytes[static_cast<std::size_t>(l)];
  }
  std::vector<DeviceState const*> stage_device;
  for (int s = 0; s < stages; ++s) stage_device.push_back(&device_by_id(node, order[static_cast<std::size_t>(s)]));
  auto const device = [&](int s) -> DeviceState const& { return *stage_device[static_cast<std::size_t>(s)]; };
  auto const seconds = [&](int s, int begin, int end) {
    return (cost_prefix[static_cast<std::size_t>(end)] - cost_prefix[static_cast<std::size_t>(begin)]) /
           std::max(device(s).speed, 1e-9);
  };
  auto const fits = [&](int s, int begin, int end) {
    return bytes_prefix[static_cast<std::size_t>(end)] - bytes_prefix[static_cast<std::size_t>(begin)] <=
           device(s).free_bytes;
  };
  std::vector<int> const first = min_max_split(layers, stages, seconds, fits);
  if (first.empty())
    throw Error(Errc::out_of_memory, "no split of " + std::to_string(layers) + " layers (" +
                                         format_bytes(static_cast<std::size_t>(bytes_prefix.back())) + ") into " +
                                         std::to_string(stages) +
                                         " stages fits the devices' free memory (expected more memory or stages)");
  StagePlan plan;
  plan.first_layer = first;
  for (int s = 0; s < stages; ++s) {
    plan.device.push_back(device(s).id);
    plan.stage_seconds.push_back(
        seconds(s, first[static_cast<std::size_t>(s)], first[static_cast<std::size_t>(s) + 1]));
  }
  plan.bottleneck_seconds = std::max(0.0, *std::max_element(plan.stage_seconds.begin(), plan.stage_seconds.end()));
  return plan;
}

double RuntimePredictor::predict(std::string const& task_type, std::string const& device_type, double size) const {
  auto const it = history_.find({task_type, device_type});
  if (it == history_.end() || !it->second.has_rate) return size;
  History const& h = it->second;
  double const denominator = h.n * h.sxx - h.sx * h.sx;
  if (h.n >= 3 && denominator > 1e-12 * std::max(1.0, h.sxx * h.n)) {
    double const b = (h.n * h.sxy - h.sx * h.sy) / denominator;
    double const a = (h.sy - b * h.sx) / h.n;
    if (b >= 0) return std::max(0.0, a + b * size);
  }
  return h.rate * size;
}

void RuntimePredictor::observe(std::string const& task_type, std::string const& device_type, double size, double seconds) {
  double const predicted = predict(task_type, device_type, size);
  if (seconds > 0) {
    error_sum_ += std::fabs(predicted - seconds) / seconds;
    ++error_count_;
  }
  History& h = history_[{task_type, device_type}];
  if (size > 0) {
    double const rate = seconds / size;
    h.rate = h.has_rate ? (1 - alpha_) * h.rate + alpha_ * rate : rate;
    h.has_rate = true;
  }
  h.n += 1;
  h.sx += size;
  h.sy += seconds;
  h.sxx += size * size;
  h.sxy += size * seconds;
}

RuntimePredictor::Accuracy RuntimePredictor::accuracy() const {
  return {error_count_ ? 100.0 * error_sum_ / static_cast<double>(error_count_) : 0.0, error_count_};
}

namespace {
struct PredictedFinish final : ScorePlugin {
  explicit PredictedFinish(RuntimePredictor const& p) : predictor(p) {}
  std::string_view name() const override { return "predicted-finish"; }
  double score(Request const& r, DeviceState const& d, NodeState const&) const override {
    double const task = predictor.predict(r.task_type, d.type, r.work_seconds) / std::max(d.speed, 1e-9);
    return -(d.queued_seconds / std::max(d.speed, 1e-9) + task);
  }
  RuntimePredictor const& predictor;
};
}  // namespace

std::unique_ptr<ScorePlugin> predicted_finish(RuntimePredictor const& predictor) {
  return std::make_unique<PredictedFinish>(predictor);
}

}  // namespace mgpu::sched
