// The scheduler framework: filter plugins remove devices, score plugins rate the rest (each
// normalized to 0-100 across the candidates, combined as a weighted sum), and binding commits a
// placement's memory and load atomically. Policies are plugins; users add their own.
#pragma once

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <mgpu/sched/types.hpp>

namespace mgpu::sched {

/// Removes devices that cannot take a request.
class FilterPlugin {
 public:
  virtual ~FilterPlugin() = default;
  [[nodiscard]] virtual std::string_view name() const = 0;
  [[nodiscard]] virtual bool admit(Request const& request, DeviceState const& device, NodeState const& node) const = 0;
};

/// Rates devices (higher is better). Raw scores are normalized to 0-100 across the candidates.
/// A plugin that rates pairs (topology) overrides pair_score; a set's pair score is the sum over
/// its pairs, as NVIDIA's GPU allocator does.
class ScorePlugin {
 public:
  virtual ~ScorePlugin() = default;
  [[nodiscard]] virtual std::string_view name() const = 0;
  [[nodiscard]] virtual double score(Request const& request, DeviceState const& device, NodeState const& node) const = 0;
  [[nodiscard]] virtual bool rates_pairs() const { return false; }
  /// 0 (worst) to 1 (best) for two devices serving one request together.
  [[nodiscard]] virtual double pair_score(Request const&, DeviceState const&, DeviceState const&, NodeState const&) const {
    return 0;
  }
  /// Adds what the plugin decides along with the chosen placement (the energy plugin: power limits).
  virtual void refine(Request const&, NodeState const&, Placement&) const {}
};

/// memory-fit: enough free memory (and, for a fractional request, enough free share).
std::unique_ptr<FilterPlugin> memory_fit();
/// capability: the device's type is one the request allows.
std::unique_ptr<FilterPlugin> capability();
/// least-loaded: the shortest queue, in seconds of work at the device's speed.
std::unique_ptr<ScorePlugin> least_loaded();
/// bin-packing: devices already in use, so large connected sets stay free.
std::unique_ptr<ScorePlugin> bin_packing();
/// topology: sets linked by NVLink/P2P (the links in DeviceState).
std::unique_ptr<ScorePlugin> topology();
/// locality: devices holding the request's data; others cost data_bytes / transfer bandwidth.
std::unique_ptr<ScorePlugin> locality();
/// heterogeneity: faster devices (DeviceState::speed).
std::unique_ptr<ScorePlugin> heterogeneity();
/// energy: performance per watt; where a device's power limit can be set, at the energy-optimal
/// limit, which it also writes into the placement (raised as far as the request's deadline needs).
std::unique_ptr<ScorePlugin> energy();
/// interference: keeps bandwidth-heavy requests off devices already running one, and sets of
/// devices off links that bandwidth-heavy multi-device requests already use.
std::unique_ptr<ScorePlugin> interference();

/// A filter/score profile. Copy is disabled (plugins are owned); move it.
class Scheduler {
 public:
  Scheduler() = default;
  Scheduler(Scheduler&&) noexcept = default;
  Scheduler& operator=(Scheduler&&) noexcept = default;

  /// The default profile: filters memory-fit and capability; scores least-loaded (weight 1),
  /// topology (1), locality (1), heterogeneity (1) and interference (1). Bin-packing and energy
  /// are available but off: they trade speed for packing or power.
  static Scheduler default_profile();

  void add(std::unique_ptr<FilterPlugin> filter);
  /// Throws Error(invalid_argument) for a negative or non-finite weight.
  void add(std::unique_ptr<ScorePlugin> score, double weight);
  /// Throws Error(invalid_argument) naming the plugins there are when `name` is not one of them.
  void set_weight(std::string_view name, double weight);
  void remove(std::string_view name);
  [[nodiscard]] std::vector<std::string> plugin_names() const;

  /// Filters, scores and picks devices for `request` (a best set for several devices). No state
  /// changes. std::nullopt when no device (or set) passes the filters. Throws
  /// Error(invalid_argument) for an invalid request (devices <= 0, a fraction above 1 that is not
  /// whole, more devices than the node has, negative memory).
  [[nodiscard]] std::optional<Placement> place(Request const& request, NodeState const& node) const;
  /// Whether every filter admits `device` for `request` (the filter stage of place() for one device).
  [[nodiscard]] bool admits(Request const& request, DeviceState const& device, NodeState const& node) const;

 private:
  struct Weighted {
    std::unique_ptr<ScorePlugin> plugin;
    double weight;
  };
  [[nodiscard]] Placement best_set(Request const& request, NodeState const& node, std::vector<std::size_t> const& candidates,
                                   std::vector<double> const& combined, int k, double pair_weight) const;
  std::vector<std::unique_ptr<FilterPlugin>> filters_;
  std::vector<Weighted> scores_;
};

/// Throws Error(invalid_argument) describing what is wrong with a request for `node`.
void validate(Request const& request, NodeState const& node);

/// Reserves a placement's memory, share and queued work in `node`; false (and nothing changed)
/// when a device no longer has room. Not synchronized: Node::bind is the thread-safe form.
bool reserve(NodeState& node, Request const& request, Placement const& placement);
/// Returns what reserve() took.
void unreserve(NodeState& node, Request const& request, Placement const& placement);

/// A node's live state, safe to share between threads: devices report their state, placements are
/// decided on a snapshot, and bind() commits one atomically (reserve first, nothing on failure).
class Node {
 public:
  explicit Node(NodeState state) : state_(std::move(state)) {}

  [[nodiscard]] NodeState snapshot() const;
  /// Replaces one device's reported state (its id picks which).
  void report(DeviceState const& device);

  /// Reserves the placement's memory, share and queued work; false (and nothing reserved) when a
  /// device no longer has room.
  bool bind(Request const& request, Placement const& placement);
  /// Returns what bind() reserved.
  void release(Request const& request, Placement const& placement);
  /// place() on the current state and bind() in one step; std::nullopt when nothing fits.
  std::optional<Placement> schedule(Request const& request, Scheduler const& scheduler);

 private:
  mutable std::mutex mutex_;
  NodeState state_;
};

}  // namespace mgpu::sched
