// Room for a gang: the devices that need the fewest placed requests moved off them before the
// scheduler's filters admit the gang, and where the scheduler places what moves.
#include <mgpu/sched/defrag.hpp>

#include <algorithm>
#include <string>

#include <mgpu/core/error.hpp>

namespace mgpu::sched {

std::optional<GangPlan> plan_room(NodeState const& node, std::span<PlacedRequest const> placed, Request const& gang,
                                  Scheduler const& scheduler, int max_moves) {
  if (max_moves < 0)
    throw Error(Errc::invalid_argument, "plan_room with max_moves " + std::to_string(max_moves) + " (expected >= 0)");
  validate(gang, node);
  if (std::optional<Placement> now = scheduler.place(gang, node)) return GangPlan{std::move(*now), {}};
  int const k = gang.devices < 1 ? 1 : static_cast<int>(gang.devices);
  auto const bytes = [&](std::size_t j) { return placed[j].request.memory_bytes; };
  // Per device: the placed requests it must shed (largest first) before the gang is admitted there.
  struct Shed {
    std::size_t device;
    std::vector<std::size_t> requests;
  };
  std::vector<Shed> options;
  for (std::size_t i = 0; i < node.devices.size(); ++i) {
    std::vector<std::size_t> on;
    for (std::size_t j = 0; j < placed.size(); ++j) {
      Placement const& p = placed[j].placement;
      if (placed[j].request.preemptible && p.devices.size() == 1 && p.devices.front() == node.devices[i].id)
        on.push_back(j);
    }
    std::stable_sort(on.begin(), on.end(), [&](std::size_t a, std::size_t b) { return bytes(a) > bytes(b); });
    NodeState trial = node;
    std::size_t shed = 0;
    while (!scheduler.admits(gang, trial.devices[i], trial) && shed < on.size()) {
      unreserve(trial, placed[on[shed]].request, placed[on[shed]].placement);
      ++shed;
    }
    if (!scheduler.admits(gang, trial.devices[i], trial)) continue;
    on.resize(shed);
    options.push_back({i, std::move(on)});
  }
  if (static_cast<int>(options.size()) < k) return std::nullopt;
  std::stable_sort(options.begin(), options.end(),
                   [](Shed const& a, Shed const& b) { return a.requests.size() < b.requests.size(); });
  options.resize(static_cast<std::size_t>(k));
  std::vector<std::size_t> moving;
  for (Shed const& s : options) moving.insert(moving.end(), s.requests.begin(), s.requests.end());
  if (static_cast<int>(moving.size()) > max_moves) return std::nullopt;
  std::stable_sort(moving.begin(), moving.end(), [&](std::size_t a, std::size_t b) { return bytes(a) > bytes(b); });
  NodeState state = node;
  for (std::size_t j : moving) unreserve(state, placed[j].request, placed[j].placement);
  GangPlan plan;
  for (std::size_t j : moving) {
    NodeState others = state;  // the devices being emptied take nothing
    for (Shed const& s : options) {
      others.devices[s.device].free_bytes = -1;
      others.devices[s.device].free_share = -1;
    }
    std::optional<Placement> to = scheduler.place(placed[j].request, others);
    if (!to || !reserve(state, placed[j].request, *to)) return std::nullopt;
    plan.moves.push_back({placed[j].id, placed[j].placement.devices.front(), to->devices.front()});
  }
  std::optional<Placement> gang_placement = scheduler.place(gang, state);
  if (!gang_placement) return std::nullopt;
  plan.placement = std::move(*gang_placement);
  return plan;
}

}  // namespace mgpu::sched
