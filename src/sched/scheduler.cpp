// The scheduler framework and its built-in plugins.
#include <mgpu/sched/scheduler.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>

#include <mgpu/core/error.hpp>

namespace mgpu::sched {
namespace {

int whole_devices(Request const& r) { return r.devices < 1 ? 1 : static_cast<int>(r.devices); }
double share_of(Request const& r) { return r.devices < 1 ? r.devices : 1.0; }
double share_taken(Request const& r) { return r.exclusive ? share_of(r) : 0.0; }

bool type_allowed(std::string_view allowed, std::string_view type) {
  if (allowed.empty()) return true;
  while (true) {
    auto const bar = allowed.find('|');
    if (allowed.substr(0, bar) == type) return true;
    if (bar == std::string_view::npos) return false;
    allowed.remove_prefix(bar + 1);
  }
}

double used_fraction(DeviceState const& d) {
  return d.capacity_bytes > 0 ? 1.0 - d.free_bytes / d.capacity_bytes : 1.0 - d.free_share;
}

double link(DeviceState const& a, DeviceState const& b) {
  auto const j = static_cast<std::size_t>(b.id);
  return j < a.links.size() ? a.links[j] : 0.0;
}

struct MemoryFit final : FilterPlugin {
  std::string_view name() const override { return "memory-fit"; }
  bool admit(Request const& r, DeviceState const& d, NodeState const&) const override {
    return d.free_bytes >= r.memory_bytes && d.free_share + 1e-12 >= share_taken(r);
  }
};

struct Capability final : FilterPlugin {
  std::string_view name() const override { return "capability"; }
  bool admit(Request const& r, DeviceState const& d, NodeState const&) const override {
    return type_allowed(r.allowed_types, d.type);
  }
};

struct LeastLoaded final : ScorePlugin {
  std::string_view name() const override { return "least-loaded"; }
  double score(Request const&, DeviceState const& d, NodeState const&) const override {
    return -d.queued_seconds / std::max(d.speed, 1e-9);
  }
};

struct BinPacking final : ScorePlugin {
  std::string_view name() const override { return "bin-packing"; }
  double score(Request const&, DeviceState const& d, NodeState const& node) const override {
    // Fill used devices first, and among free ones those whose linked neighbours are busy, so
    // that well-connected free sets stay whole.
    double neighbours = 0;
    double weight = 0;
    for (DeviceState const& other : node.devices) {
      if (other.id == d.id) continue;
      double const l = link(d, other);
      neighbours += l * used_fraction(other);
      weight += l;
    }
    return used_fraction(d) + (weight > 0 ? 0.5 * neighbours / weight : 0.0);
  }
};

struct Topology final : ScorePlugin {
  std::string_view name() const override { return "topology"; }
  double score(Request const&, DeviceState const&, NodeState const&) const override { return 0; }
  bool rates_pairs() const override { return true; }
  double pair_score(Request const&, DeviceState const& a, DeviceState const& b, NodeState const&) const override {
    return std::clamp(link(a, b), 0.0, 1.0);
  }
};

struct Locality final : ScorePlugin {
  std::string_view name() const override { return "locality"; }
  double score(Request const& r, DeviceState const& d, NodeState const& node) const override {
    if (r.data.empty() || d.data.contains(r.data)) return 0;
    return -r.data_bytes / std::max(node.transfer_bytes_per_second, 1.0);  // seconds to bring the data
  }
};

struct Heterogeneity final : ScorePlugin {
  std::string_view name() const override { return "heterogeneity"; }
  double score(Request const&, DeviceState const& d, NodeState const&) const override { return d.speed; }
};

struct Energy final : ScorePlugin {
  std::string_view name() const override { return "energy"; }
  double score(Request const&, DeviceState const& d, NodeState const& node) const override {
    double const watts = energy_optimal_power(d, node.power_exponent);
    return watts > 0 ? speed_at_power(d, watts, node.power_exponent) / watts : 0.0;
  }
  void refine(Request const& r, NodeState const& node, Placement& placement) const override {
    placement.power_limits.assign(placement.devices.size(), 0.0);
    for (std::size_t i = 0; i < placement.devices.size(); ++i) {
      DeviceState const* d = nullptr;
      for (auto const& candidate : node.devices) d = candidate.id == placement.devices[i] ? &candidate : d;
      if (d == nullptr || d->min_power_limit <= 0 || d->max_watts <= d->min_power_limit) continue;
      double watts = energy_optimal_power(*d, node.power_exponent);
      if (r.deadline_seconds > 0) {  // the lowest limit (1 W steps) that still meets the deadline
        double const queue = d->queued_seconds / std::max(d->speed, 1e-9);
        auto const finish = [&](double w) { return queue + r.work_seconds / std::max(speed_at_power(*d, w, node.power_exponent), 1e-9); };
        while (watts < d->max_watts && finish(watts) > r.deadline_seconds) watts = std::min(d->max_watts, watts + 1.0);
      }
      placement.power_limits[i] = watts;
    }
  }
};

int link_load(DeviceState const& a, DeviceState const& b) {
  auto const j = static_cast<std::size_t>(b.id);
  return j < a.link_heavy.size() ? a.link_heavy[j] : 0;
}

struct Interference final : ScorePlugin {
  std::string_view name() const override { return "interference"; }
  double score(Request const& r, DeviceState const& d, NodeState const&) const override {
    return r.bandwidth_heavy ? -static_cast<double>(d.bandwidth_heavy) : 0.0;
  }
  bool rates_pairs() const override { return true; }
  double pair_score(Request const& r, DeviceState const& a, DeviceState const& b, NodeState const&) const override {
    return r.bandwidth_heavy ? 1.0 / (1.0 + link_load(a, b)) : 1.0;
  }
};

[[noreturn]] void bad_request(Request const& r, std::string const& what) {
  throw Error(Errc::invalid_argument, "request '" + r.name + "': " + what);
}

}  // namespace

std::unique_ptr<FilterPlugin> memory_fit() { return std::make_unique<MemoryFit>(); }
std::unique_ptr<FilterPlugin> capability() { return std::make_unique<Capability>(); }
std::unique_ptr<ScorePlugin> least_loaded() { return std::make_unique<LeastLoaded>(); }
std::unique_ptr<ScorePlugin> bin_packing() { return std::make_unique<BinPacking>(); }
std::unique_ptr<ScorePlugin> topology() { return std::make_unique<Topology>(); }
std::unique_ptr<ScorePlugin> locality() { return std::make_unique<Locality>(); }
std::unique_ptr<ScorePlugin> heterogeneity() { return std::make_unique<Heterogeneity>(); }
std::unique_ptr<ScorePlugin> energy() { return std::make_unique<Energy>(); }
std::unique_ptr<ScorePlugin> interference() { return std::make_unique<Interference>(); }

double speed_at_power(DeviceState const& d, double watts, double exponent) {
  if (d.min_power_limit <= 0 || d.max_watts <= d.idle_watts || watts >= d.max_watts) return d.speed;
  double const fraction = std::clamp((watts - d.idle_watts) / (d.max_watts - d.idle_watts), 0.0, 1.0);
  return d.speed * std::pow(fraction, exponent);
}

double energy_optimal_power(DeviceState const& d, double exponent) {
  if (d.min_power_limit <= 0 || d.max_watts <= 0) return d.max_watts;
  // Energy per unit of work is P / speed(P) ~ P / (P - idle)^exponent: least at idle / (1 - exponent).
  double const optimum = exponent < 1 ? d.idle_watts / (1.0 - exponent) : d.max_watts;
  return std::clamp(optimum, d.min_power_limit, d.max_watts);
}

void validate(Request const& r, NodeState const& node) {
  if (!(r.devices > 0) || !std::isfinite(r.devices))
    bad_request(r, "asks for " + std::to_string(r.devices) + " devices (expected a whole number >= 1 or a fraction in (0, 1))");
  if (r.devices > 1 && r.devices != std::floor(r.devices))
    bad_request(r, "asks for " + std::to_string(r.devices) + " devices (expected a whole number above 1, or a fraction below 1)");
  if (r.devices > static_cast<double>(node.devices.size()))
    bad_request(r, "asks for " + std::to_string(static_cast<int>(r.devices)) + " devices, the node has " +
                       std::to_string(node.devices.size()) + " (expected at most that)");
  if (r.memory_bytes < 0 || !std::isfinite(r.memory_bytes))
    bad_request(r, "asks for " + std::to_string(r.memory_bytes) + " bytes of memory (expected >= 0)");
  if (r.work_seconds < 0) bad_request(r, "expects " + std::to_string(r.work_seconds) + " s of work (expected >= 0)");
}

Scheduler Scheduler::default_profile() {
  Scheduler s;
  s.add(memory_fit());
  s.add(capability());
  s.add(least_loaded(), 1);
  s.add(topology(), 1);
  s.add(locality(), 1);
  s.add(heterogeneity(), 1);
  s.add(interference(), 1);
  return s;
}

void Scheduler::add(std::unique_ptr<FilterPlugin> filter) { filters_.push_back(std::move(filter)); }

void Scheduler::add(std::unique_ptr<ScorePlugin> score, double weight) {
  if (!(weight >= 0) || !std::isfinite(weight))
    throw Error(Errc::invalid_argument, "weight " + std::to_string(weight) + " for score plugin '" +
                                            std::string(score->name()) + "' (expected a finite weight >= 0)");
  scores_.push_back({std::move(score), weight});
}

std::vector<std::string> Scheduler::plugin_names() const {
  std::vector<std::string> names;
  for (auto const& f : filters_) names.emplace_back(f->name());
  for (auto const& s : scores_) names.emplace_back(s.plugin->name());
  return names;
}

namespace {
[[noreturn]] void unknown_plugin(std::string_view name, std::vector<std::string> const& names) {
  std::string list;
  for (auto const& n : names) list += (list.empty() ? "" : ", ") + n;
  throw Error(Errc::invalid_argument, "no plugin named '" + std::string(name) + "' (expected one of: " + list + ")");
}
}  // namespace

void Scheduler::set_weight(std::string_view name, double weight) {
  for (auto& s : scores_) {
    if (s.plugin->name() == name) {
      if (!(weight >= 0) || !std::isfinite(weight))
        throw Error(Errc::invalid_argument, "weight " + std::to_string(weight) + " for '" + std::string(name) +
                                                "' (expected a finite weight >= 0)");
      s.weight = weight;
      return;
    }
  }
  unknown_plugin(name, plugin_names());
}

void Scheduler::remove(std::string_view name) {
  auto const before = filters_.size() + scores_.size();
  std::erase_if(filters_, [&](auto const& f) { return f->name() == name; });
  std::erase_if(scores_, [&](auto const& s) { return s.plugin->name() == name; });
  if (filters_.size() + scores_.size() == before) unknown_plugin(name, plugin_names());
}

bool Scheduler::admits(Request const& request, DeviceState const& device, NodeState const& node) const {
  return std::all_of(filters_.begin(), filters_.end(), [&](auto const& f) { return f->admit(request, device, node); });
}

std::optional<Placement> Scheduler::place(Request const& request, NodeState const& node) const {
  validate(request, node);
  std::vector<std::size_t> candidates;
  for (std::size_t i = 0; i < node.devices.size(); ++i)
    if (admits(request, node.devices[i], node)) candidates.push_back(i);
  int const k = whole_devices(request);
  if (static_cast<int>(candidates.size()) < k) return std::nullopt;

  // Each per-device plugin's raw scores, normalized to 0-100 across the candidates.
  std::vector<double> combined(candidates.size(), 0.0);
  std::vector<double> raw(candidates.size());
  double pair_weight = 0;
  for (auto const& s : scores_) {
    if (s.weight == 0) continue;
    if (s.plugin->rates_pairs()) pair_weight += s.weight;
    double lo = INFINITY;
    double hi = -INFINITY;
    for (std::size_t c = 0; c < candidates.size(); ++c) {
      raw[c] = s.plugin->score(request, node.devices[candidates[c]], node);
      lo = std::min(lo, raw[c]);
      hi = std::max(hi, raw[c]);
    }
    for (std::size_t c = 0; c < candidates.size(); ++c)
      combined[c] += s.weight * (hi > lo ? 100.0 * (raw[c] - lo) / (hi - lo) : 100.0);
  }

  Placement best;
  best.share = share_of(request);
  if (k == 1) {
    auto const top = static_cast<std::size_t>(std::max_element(combined.begin(), combined.end()) - combined.begin());
    best.devices = {node.devices[candidates[top]].id};
    best.score = combined[top];
  } else {
    best = best_set(request, node, candidates, combined, k, pair_weight);
  }
  for (auto const& s : scores_) {
    if (s.weight > 0) s.plugin->refine(request, node, best);
  }
  return best;
}

// Several devices: grow a set greedily from every seed; a set scores the mean of its devices'
// scores plus, for pair plugins, 100 x weight x its summed pair scores over the most a set of k
// devices could have. Pair scores are computed once per candidate pair, and each candidate's sum
// of pair scores with the growing set is kept up to date, so a seed costs O(k n).
Placement Scheduler::best_set(Request const& request, NodeState const& node, std::vector<std::size_t> const& candidates,
                              std::vector<double> const& combined, int k, double pair_weight) const {
  std::size_t const n = candidates.size();
  std::vector<double> pairs(pair_weight > 0 ? n * n : 0, 0.0);
  if (pair_weight > 0) {
    for (auto const& s : scores_) {
      if (s.weight <= 0 || !s.plugin->rates_pairs()) continue;
      for (std::size_t a = 0; a < n; ++a) {
        for (std::size_t b = a + 1; b < n; ++b) {
          double const v = s.weight * s.plugin->pair_score(request, node.devices[candidates[a]], node.devices[candidates[b]], node);
          pairs[a * n + b] += v;
          pairs[b * n + a] += v;
        }
      }
    }
  }
  double const max_pairs = k * (k - 1) / 2.0;
  Placement best;
  best.share = share_of(request);
  best.score = -INFINITY;
  std::vector<double> with_set(n);
  std::vector<char> used(n);
  std::vector<std::size_t> set;
  for (std::size_t seed = 0; seed < n; ++seed) {
    std::fill(used.begin(), used.end(), 0);
    std::fill(with_set.begin(), with_set.end(), 0.0);
    set.assign(1, seed);
    used[seed] = 1;
    double device_sum = combined[seed];
    double pair_sum = 0;
    std::size_t last = seed;
    while (static_cast<int>(set.size()) < k) {
      std::size_t pick = n;
      double pick_gain = -INFINITY;
      for (std::size_t c = 0; c < n; ++c) {
        if (used[c]) continue;
        if (pair_weight > 0) with_set[c] += pairs[c * n + last];
        double const gain = combined[c] / k + 100.0 * with_set[c] / max_pairs;
        if (gain > pick_gain) {
          pick_gain = gain;
          pick = c;
        }
      }
      set.push_back(pick);
      used[pick] = 1;
      device_sum += combined[pick];
      pair_sum += with_set[pick];
      last = pick;
    }
    double const score = device_sum / k + (pair_weight > 0 ? 100.0 * pair_sum / max_pairs : 0.0);
    if (score > best.score) {
      best.score = score;
      best.devices.clear();
      for (std::size_t c : set) best.devices.push_back(node.devices[candidates[c]].id);
      std::sort(best.devices.begin(), best.devices.end());
    }
  }
  return best;
}

NodeState Node::snapshot() const {
  std::lock_guard lock(mutex_);
  return state_;
}

void Node::report(DeviceState const& device) {
  std::lock_guard lock(mutex_);
  for (auto& d : state_.devices) {
    if (d.id == device.id) {
      d = device;
      return;
    }
  }
  throw Error(Errc::invalid_argument, "report for device " + std::to_string(device.id) + ", which the node does not have");
}

namespace {
DeviceState* find(NodeState& state, int id) {
  for (auto& d : state.devices) {
    if (d.id == id) return &d;
  }
  return nullptr;
}
}  // namespace

namespace {
// A bandwidth-heavy request on several devices loads every link between them.
void add_link_load(NodeState& node, Request const& request, Placement const& placement, int delta) {
  if (!request.bandwidth_heavy || placement.devices.size() < 2) return;
  for (int a : placement.devices) {
    DeviceState* d = find(node, a);
    if (d == nullptr) continue;
    for (int b : placement.devices) {
      if (b == a || b < 0) continue;
      if (d->link_heavy.size() <= static_cast<std::size_t>(b)) d->link_heavy.resize(static_cast<std::size_t>(b) + 1, 0);
      d->link_heavy[static_cast<std::size_t>(b)] = std::max(0, d->link_heavy[static_cast<std::size_t>(b)] + delta);
    }
  }
}
}  // namespace

bool reserve(NodeState& node, Request const& request, Placement const& placement) {
  double const share = share_taken(request);
  for (int id : placement.devices) {  // reserve only if every device still has room
    DeviceState const* d = find(node, id);
    if (d == nullptr || d->free_bytes < request.memory_bytes || d->free_share + 1e-12 < share) return false;
  }
  for (int id : placement.devices) {
    DeviceState& d = *find(node, id);
    d.free_bytes -= request.memory_bytes;
    d.free_share -= share;
    d.queued_seconds += request.work_seconds;
    d.bandwidth_heavy += request.bandwidth_heavy ? 1 : 0;
    if (!request.data.empty()) d.data.insert(request.data);
  }
  add_link_load(node, request, placement, 1);
  return true;
}

void unreserve(NodeState& node, Request const& request, Placement const& placement) {
  double const share = share_taken(request);
  for (int id : placement.devices) {
    DeviceState* d = find(node, id);
    if (d == nullptr) continue;
    d->free_bytes = std::min(d->capacity_bytes, d->free_bytes + request.memory_bytes);
    d->free_share = std::min(1.0, d->free_share + share);
    d->queued_seconds = std::max(0.0, d->queued_seconds - request.work_seconds);
    d->bandwidth_heavy = std::max(0, d->bandwidth_heavy - (request.bandwidth_heavy ? 1 : 0));
  }
  add_link_load(node, request, placement, -1);
}

bool Node::bind(Request const& request, Placement const& placement) {
  std::lock_guard lock(mutex_);
  return reserve(state_, request, placement);
}

void Node::release(Request const& request, Placement const& placement) {
  std::lock_guard lock(mutex_);
  unreserve(state_, request, placement);
}

std::optional<Placement> Node::schedule(Request const& request, Scheduler const& scheduler) {
  for (int attempt = 0; attempt < 8; ++attempt) {
    std::optional<Placement> placement = scheduler.place(request, snapshot());
    if (!placement) return std::nullopt;
    if (bind(request, *placement)) return placement;  // lost a race: decide again on fresh state
  }
  return std::nullopt;
}

}  // namespace mgpu::sched
