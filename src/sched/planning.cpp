// Shard weights, pipeline partitioning and placement, and the runtime predictor.
#include <mgpu/sched/planning.hpp>

#include <algorithm>
#include <cmath>
#include <functional>

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

namespace {
// A grouping's quality: its worst group's weakest link, then the sum of the groups' weakest links.
struct GroupingScore {
  double worst = -1;
  double sum = -1;
  [[nodiscard]] bool better_than(GroupingScore const& other) const {
    constexpr double eps = 1e-12;  // ties keep the grouping found first
    return worst > other.worst + eps || (worst > other.worst - eps && sum > other.sum + eps);
  }
};
}  // namespace

std::vector<int> tensor_parallel_order(NodeState const& node, std::vector<int> const& device_ids, int group_size) {
  auto const n = static_cast<int>(device_ids.size());
  if (group_size < 1 || n % group_size != 0)
    throw Error(Errc::invalid_argument, "tensor_parallel_order: groups of " + std::to_string(group_size) + " from " +
                                            std::to_string(n) + " devices (expected a group size >= 1 dividing the device count)");
  std::vector<DeviceState const*> devices;
  for (int id : device_ids) devices.push_back(&device_by_id(node, id));
  // link(i, j) between positions i and j of device_ids: the slower direction
  auto const one_way = [&](int i, int j) {
    auto const to = static_cast<std::size_t>(device_ids[static_cast<std::size_t>(j)]);
    std::vector<double> const& links = devices[static_cast<std::size_t>(i)]->links;
    return to < links.size() ? links[to] : 0.0;
  };
  auto const link = [&](int i, int j) { return std::min(one_way(i, j), one_way(j, i)); };
  if (group_size == 1 || group_size == n) return device_ids;

  std::vector<int> group_of(static_cast<std::size_t>(n), -1);
  std::vector<int> best;  // group_of of the best grouping found
  GroupingScore best_score;
  std::vector<int> members;  // the group being filled, as positions
  // Fills group `g` from `members`, the unassigned positions after `from` as candidates; the
  // grouping so far has weakest links `worst` (over complete groups) and `sum`.
  std::function<void(int, int, double, double)> search = [&](int g, int from, double worst, double sum) {
    if (static_cast<int>(members.size()) == group_size) {
      double weakest = 1e300;
      for (std::size_t a = 0; a < members.size(); ++a)
        for (std::size_t b = a + 1; b < members.size(); ++b) weakest = std::min(weakest, link(members[a], members[b]));
      double const w = std::min(worst, weakest);
      if (w < best_score.worst - 1e-12) return;  // no better than the best already
      std::vector<int> const done = members;
      members.clear();
      auto const first = std::find(group_of.begin(), group_of.end(), -1);
      if (first == group_of.end()) {
        GroupingScore const score{w, sum + weakest};
        if (score.better_than(best_score)) best_score = score, best = group_of;
      } else {
        auto const p = static_cast<int>(first - group_of.begin());  // the next group starts at the first free device
        group_of[static_cast<std::size_t>(p)] = g + 1;
        members.push_back(p);
        search(g + 1, p + 1, w, sum + weakest);
        members.pop_back();
        group_of[static_cast<std::size_t>(p)] = -1;
      }
      members = done;
      return;
    }
    for (int p = from; p < n; ++p) {
      if (group_of[static_cast<std::size_t>(p)] != -1) continue;
      group_of[static_cast<std::size_t>(p)] = g;
      members.push_back(p);
      search(g, p + 1, worst, sum);
      members.pop_back();
      group_of[static_cast<std::size_t>(p)] = -1;
    }
  };
  if (n <= 16) {
    group_of[0] = 0;
    members.push_back(0);
    search(0, 1, 1e300, 0);
  } else {
    best.assign(static_cast<std::size_t>(n), -1);
    for (int g = 0; g < n / group_size; ++g) {
      std::vector<int> group{static_cast<int>(std::find(best.begin(), best.end(), -1) - best.begin())};
      best[static_cast<std::size_t>(group[0])] = g;
      while (static_cast<int>(group.size()) < group_size) {
        int pick = -1;
        double pick_weakest = -1;
        for (int p = 0; p < n; ++p) {
          if (best[static_cast<std::size_t>(p)] != -1) continue;
          double weakest = 1e300;
          for (int m : group) weakest = std::min(weakest, link(m, p));
          if (weakest > pick_weakest) pick = p, pick_weakest = weakest;
        }
        best[static_cast<std::size_t>(pick)] = g;
        group.push_back(pick);
      }
    }
  }
  // Groups are numbered in the order of their first device; members keep device_ids' order.
  std::vector<int> order;
  for (int g = 0; g < n / group_size; ++g)
    for (int p = 0; p < n; ++p)
      if (best[static_cast<std::size_t>(p)] == g) order.push_back(device_ids[static_cast<std::size_t>(p)]);
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
