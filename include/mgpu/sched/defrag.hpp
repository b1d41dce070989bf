// Room for a gang on a live node: which single-device requests placed there to move, and where,
// so that a multi-device request (a 4-device data-parallel job, say) can be placed. The plan is
// returned, not carried out: the caller moves the work (and its reservations) and then binds the
// gang. Every decision goes through the scheduler's filters and scores.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include <mgpu/sched/scheduler.hpp>

namespace mgpu::sched {

/// A request bound on a node, under the id its owner knows it by.
struct PlacedRequest {
  std::uint64_t id = 0;
  Request request{};
  Placement placement{};
};

/// One placed request moved from one device to another.
struct RequestMove {
  std::uint64_t id = 0;
  int from = -1;
  int to = -1;
};

/// Where the gang goes once the moves are made, and the moves, in order.
struct GangPlan {
  Placement placement{};
  std::vector<RequestMove> moves{};
};

/// A plan of at most `max_moves` moves of `placed` requests that lets `gang` be placed on `node`:
/// each device is rated by the placed requests (single-device, preemptible, largest memory first)
/// it must shed before the scheduler's filters admit the gang there, the devices needing the
/// fewest moves are emptied that far, every shed request goes where the scheduler places it
/// among the other devices, and the gang where it places it then. No moves when the gang fits
/// now; std::nullopt when no plan of that size works. Changes nothing. Throws what validate()
/// throws for the gang, and Error(invalid_argument) for a negative max_moves.
[[nodiscard]] std::optional<GangPlan> plan_room(NodeState const& node, std::span<PlacedRequest const> placed,
                                                Request const& gang, Scheduler const& scheduler, int max_moves = 8);

}  // namespace mgpu::sched
