// Pipeline schedules as data, their generators, a validator and a simulator. Pure logic: no
// devices involved. The schedules are described in docs/parallel-layouts.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mgpu::pipeline {

/// What one action does. Chunk c runs on device c % devices; same-device transfers are implicit.
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

/// A pipeline schedule: `actions[d]` is what device d does, in order. Not synchronized.
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
/// 1F1B (PipeDream-Flush): at most devices - d micro-batches in flight on device d.
Schedule one_f_one_b(int devices, int micro_batches);
/// Interleaved 1F1B with `chunks_per_device` chunks per device (Megatron's order); micro_batches
/// must be a multiple of devices when chunks_per_device > 1.
Schedule interleaved_one_f_one_b(int devices, int chunks_per_device, int micro_batches);
/// ZB-H1 zero-bubble: backward split into input and weight halves, the weight halves filling the
/// bubbles; peak_in_flight up to 2 * devices - 1 - d.
Schedule zero_bubble_h1(int devices, int micro_batches);
/// The generator by name: "gpipe", "1f1b", "interleaved" (with chunks_per_device) or "zb".
Schedule make_schedule(std::string const& name, int devices, int micro_batches, int chunks_per_device = 2);

/// Throws Error(invalid_argument), naming the first broken action, unless `schedule` is complete,
/// in dependency order on each device and deadlock-free with blocking transfers.
void validate(Schedule const& schedule);

/// Costs of one chunk's actions, in any time unit; `transfer`: one send/receive pair once posted.
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
  /// Per device: compute time, and the most micro-batch chunks forwarded but not yet backwarded.
  std::vector<double> busy;
  std::vector<int> peak_in_flight;
  /// Per device, per action: start and end times.
  std::vector<std::vector<double>> start, end;
};

/// Runs the schedule in simulated time and predicts it. `costs`: one per chunk, or one for all.
/// Validates the schedule first (Error(invalid_argument)).
Simulation simulate(Schedule const& schedule, std::vector<ActionCosts> const& costs = {ActionCosts{}});
/// simulate() with each action's own duration, durations[d][i] (a measured run). Throws
/// Error(invalid_argument) unless there is one duration per action.
Simulation simulate(Schedule const& schedule, std::vector<std::vector<double>> const& durations);

}  // namespace mgpu::pipeline
