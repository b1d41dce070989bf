// Pipeline schedules as data: per device, the ordered actions (forward, backward or its input and
// weight halves, and the sends and receives between devices) of every micro-batch on every model
// chunk; generators for GPipe, 1F1B, interleaved 1F1B and ZB-H1; a validator that proves a schedule
// complete, in dependency order and deadlock-free; and a simulator that predicts its makespan,
// bubble and peak in-flight activations from per-action costs. Pure logic: no devices involved.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mgpu::pipeline {

/// What one action does. A model of `chunks()` chunks is laid out round-robin: chunk c runs on
/// device c % devices, so with v chunks per device every device holds v non-adjacent chunks
/// (interleaving). Transfers between chunks on the same device are implicit (no action).
enum class ActionKind : std::uint8_t {
  forward,          ///< the chunk's forward for the micro-batch
  backward,         ///< input and weight gradients together (fused)
  backward_input,   ///< the input gradient only (what the previous chunk waits for)
  backward_weight,  ///< the weight gradient, any time after backward_input
  send_activation,  ///< the chunk's output to the device of chunk + 1
  recv_activation,  ///< the chunk's input from the device of chunk - 1
  send_gradient,    ///< the gradient of the chunk's input to the device of chunk - 1
  recv_gradient,    ///< the gradient of the chunk's output from the device of chunk + 1
};

/// One step of a schedule: `kind` for `micro_batch` on model chunk `chunk`.
struct Action {
  ActionKind kind = ActionKind::forward;
  int micro_batch = 0;
  int chunk = 0;
  friend bool operator==(Action const&, Action const&) = default;
};

/// "forward", "send_activation", ...
[[nodiscard]] char const* to_string(ActionKind kind) noexcept;
/// "forward(mb 3, chunk 1)".
[[nodiscard]] std::string to_string(Action const& action);
/// Whether the action is a send or a receive.
[[nodiscard]] bool is_transfer(ActionKind kind) noexcept;

/// A pipeline schedule: `actions[d]` is what device d does, in order. A value type; not
/// synchronized (share it read-only between threads).
struct Schedule {
  std::string name;
  int devices = 1;
  int chunks_per_device = 1;
  int micro_batches = 1;
  std::vector<std::vector<Action>> actions;

  /// The number of model chunks (devices * chunks_per_device).
  [[nodiscard]] int chunks() const noexcept { return devices * chunks_per_device; }
  /// The device that runs `chunk`.
  [[nodiscard]] int device_of(int chunk) const noexcept { return chunk % devices; }
};

/// GPipe (fill-drain): every forward, then every backward, micro-batches in order.
Schedule gpipe(int devices, int micro_batches);
/// 1F1B (PipeDream-Flush): device d runs devices - d - 1 warm-up forwards, then alternates one
/// forward and one backward, then drains; at most devices - d micro-batches in flight.
Schedule one_f_one_b(int devices, int micro_batches);
/// Interleaved 1F1B with `chunks_per_device` chunks per device (Megatron's order; on 2 devices the
/// last one runs one more warm-up forward, so that transfers in both directions meet between
/// actions); micro_batches must be a multiple of devices when chunks_per_device > 1. With equal
/// costs per chunk (a v-th of a device's stage) each device idles (devices - 1) * (forward +
/// backward) / v, 1F1B's bubble divided by v: Narayanan et al. 2021's (p - 1) / (v * m) of the
/// ideal time.
Schedule interleaved_one_f_one_b(int devices, int chunks_per_device, int micro_batches);
/// ZB-H1 zero-bubble: backward split into input and weight halves; the input half goes first (the
/// previous device waits for it) and weight halves fill what would be bubbles. Device d starts a
/// forward only while fewer than devices - d micro-batches wait for their backward_input (1F1B's
/// limit) and runs a weight half first once `devices` of them are pending; what backward_weight
/// reads stays longer, so peak_in_flight (counted until backward_weight) is up to
/// 2 * devices - 1 - d, whatever the number of micro-batches.
Schedule zero_bubble_h1(int devices, int micro_batches);
/// The generator by name: "gpipe", "1f1b", "interleaved" (with chunks_per_device) or "zb".
Schedule make_schedule(std::string const& name, int devices, int micro_batches, int chunks_per_device = 2);

/// Throws Error(invalid_argument) unless `schedule` is complete (every micro-batch's forward and
/// backward, fused or split, exactly once on every chunk, with the transfers between devices),
/// each device's actions are in dependency order, and running it with blocking sends and receives
/// (consecutive transfers of a device grouped, as the executor issues them) cannot deadlock. The
/// message names the first broken action (device, position and action).
void validate(Schedule const& schedule);

/// Costs of one chunk's actions, in any time unit. A fused backward costs backward_input +
/// backward_weight; `transfer` is the time of one send/receive pair once both are posted.
struct ActionCosts {
  double forward = 1;
  double backward_input = 1;
  double backward_weight = 1;
  double transfer = 0;
};

/// What simulate() predicts.
struct Simulation {
  double makespan = 0;
  /// 1 - (sum of compute time over devices) / (devices * makespan).
  double bubble_fraction = 0;
  /// Per device: compute time, and the most micro-batch chunks whose forward has run and whose
  /// backward (fused, or its weight half) has not.
  std::vector<double> busy;
  std::vector<int> peak_in_flight;
  /// Per device, per action: start and end times.
  std::vector<std::vector<double>> start, end;
};

/// Runs the schedule in simulated time: a device runs its actions in order, a compute action as
/// soon as the device is free, a group of consecutive transfers when each has met its peer.
/// `costs` holds one entry for every chunk, or one for all. Validates the schedule first.
Simulation simulate(Schedule const& schedule, std::vector<ActionCosts> const& costs = {ActionCosts{}});
/// simulate() with each action's own duration, durations[d][i] for schedule.actions[d][i] (for a
/// transfer, the pair's time once both sides are posted; the sending side's entry counts): replays
/// a measured run. Throws Error(invalid_argument) unless there is one duration per action.
Simulation simulate(Schedule const& schedule, std::vector<std::vector<double>> const& durations);

}  // namespace mgpu::pipeline
