// Pipeline schedules: the generators' output validates for every size, the simulator's bubbles
// and peak in-flight activations match the closed forms, and the validator rejects broken
// schedules naming the broken action.
#include <mgpu/pipeline/schedule.hpp>

#include <algorithm>
#include <string>

#include "support/catch.hpp"
#include "support/expect_error.hpp"

using namespace mgpu::pipeline;
using K = ActionKind;

namespace {
// Idle time over the whole run, summed over devices.
double bubble_time(Simulation const& s) {
  double busy = 0;
  for (double b : s.busy) busy += b;
  return s.makespan * static_cast<double>(s.busy.size()) - busy;
}
}  // namespace

TEST_CASE("every generated schedule validates", "[parallel][schedule]") {
  for (int p = 1; p <= 4; ++p) {
    for (int m = 1; m <= 8; ++m) {
      CAPTURE(p, m);
      for (std::string const name : {"gpipe", "1f1b", "zb"}) {
        CAPTURE(name);
        Schedule const s = make_schedule(name, p, m);
        REQUIRE_NOTHROW(validate(s));
        CHECK(s.devices == p);
        CHECK(s.micro_batches == m);
      }
      for (int v = 1; v <= 3; ++v) {
        if (v > 1 && m % p != 0) continue;
        CAPTURE(v);
        REQUIRE_NOTHROW(validate(interleaved_one_f_one_b(p, v, m)));
      }
    }
  }
}

TEST_CASE("simulated bubbles match the closed forms with equal costs", "[parallel][schedule]") {
  for (int p = 1; p <= 4; ++p) {
    for (int m = 1; m <= 8; ++m) {
      CAPTURE(p, m);
      double const expected = static_cast<double>(p - 1) / static_cast<double>(m + p - 1);
      Simulation const gp = simulate(gpipe(p, m));
      Simulation const ofob = simulate(one_f_one_b(p, m));
      CHECK(gp.bubble_fraction == Approx(expected).margin(1e-12));
      CHECK(ofob.bubble_fraction == Approx(expected).margin(1e-12));
      // (forward 1, backward 2) per micro-batch on each device, plus the fill and drain.
      CHECK(ofob.makespan == Approx(3.0 * (m + p - 1)));
      // ZB-H1 idles (P-1)(F+B-W) per device instead of 1F1B's (P-1)(F+B+W): a third.
      Simulation const zb = simulate(zero_bubble_h1(p, m));
      if (p > 1 && m >= p) CHECK(bubble_time(zb) == Approx(bubble_time(ofob) / 3.0));
      CHECK(bubble_time(zb) <= bubble_time(ofob) + 1e-9);
      for (int v = 2; v <= 3; ++v) {
        if (m % p != 0) continue;
        CAPTURE(v);
        // v chunks per device, each a v-th of the work: the bubble's time divides by v. In
        // Narayanan et al. 2021's terms, idle time over the ideal time m (t_f + t_b) per device is
        // (p - 1) / (v m); over the makespan (the simulator's fraction), (p - 1) / (v m + p - 1).
        ActionCosts const chunk{1.0 / v, 1.0 / v, 1.0 / v, 0.0};
        Simulation const il = simulate(interleaved_one_f_one_b(p, v, m), {chunk});
        CHECK(bubble_time(il) == Approx(bubble_time(ofob) / v));
        CHECK(bubble_time(il) / (p * m * 3.0) == Approx(static_cast<double>(p - 1) / (v * m)).margin(1e-12));
        CHECK(il.bubble_fraction == Approx(static_cast<double>(p - 1) / (v * m + p - 1)).margin(1e-12));
      }
    }
  }
}

TEST_CASE("simulating with each action's own duration replays a run", "[parallel][schedule]") {
  // Two devices, one micro-batch: device 0 forward (2), its send and the gradient's receive in one
  // group, backward (3); device 1 receive, forward (1), backward (4), send (0.25). The activation
  // arrives at 2 + 0.5, device 1 runs until 7.5, the gradient arrives at 7.75, device 0 ends at 10.75.
  Schedule const s = gpipe(2, 1);
  REQUIRE(s.actions[0] == std::vector<Action>{{K::forward, 0, 0}, {K::send_activation, 0, 0}, {K::recv_gradient, 0, 0}, {K::backward, 0, 0}});
  REQUIRE(s.actions[1] == std::vector<Action>{{K::recv_activation, 0, 1}, {K::forward, 0, 1}, {K::backward, 0, 1}, {K::send_gradient, 0, 1}});
  Simulation const sim = simulate(s, std::vector<std::vector<double>>{{2, 0.5, 9, 3}, {9, 1, 4, 0.25}});
  CHECK(sim.makespan == Approx(10.75));
  CHECK(sim.busy == std::vector<double>{5, 5});
  CHECK(sim.bubble_fraction == Approx(1.0 - 10.0 / 21.5));
  // The same per-chunk costs given per action give the cost-based simulation.
  Schedule const il = interleaved_one_f_one_b(4, 2, 8);
  std::vector<ActionCosts> costs;
  for (int c = 0; c < il.chunks(); ++c) costs.push_back({1.0 + c, 0.5 * c + 1, 2.0, 0.125});
  std::vector<std::vector<double>> durations(il.actions.size());
  for (std::size_t d = 0; d < il.actions.size(); ++d) {
    for (Action const& a : il.actions[d]) {
      ActionCosts const& c = costs[static_cast<std::size_t>(a.chunk)];
      durations[d].push_back(a.kind == K::forward ? c.forward : a.kind == K::backward ? c.backward_input + c.backward_weight : c.transfer);
    }
  }
  Simulation const by_chunk = simulate(il, costs);
  Simulation const by_action = simulate(il, durations);
  CHECK(by_action.makespan == by_chunk.makespan);
  CHECK(by_action.busy == by_chunk.busy);
  CHECK(by_action.end == by_chunk.end);
  durations[3].pop_back();
  REQUIRE_MGPU_ERROR(simulate(il, durations), mgpu::Errc::invalid_argument, "one per action of the schedule");
}

TEST_CASE("peak in-flight activations: 1F1B at most P - d on stage d, GPipe M, ZB-H1 bounded", "[parallel][schedule]") {
  for (int p = 1; p <= 4; ++p) {
    for (int m = 1; m <= 8; ++m) {
      CAPTURE(p, m);
      CHECK(simulate(gpipe(p, m)).peak_in_flight[0] == m);
      Simulation const ofob = simulate(one_f_one_b(p, m));
      CHECK(ofob.peak_in_flight[0] == std::min(p, m));
      for (int d = 0; d < p; ++d) CHECK(ofob.peak_in_flight[static_cast<std::size_t>(d)] <= p - d);
      // ZB-H1: at most P - d waiting for backward_input plus fewer than P for backward_weight,
      // however many micro-batches.
      Simulation const zb = simulate(zero_bubble_h1(p, m));
      for (int d = 0; d < p; ++d) CHECK(zb.peak_in_flight[static_cast<std::size_t>(d)] <= std::max(1, 2 * p - 1 - d));
    }
  }
}

TEST_CASE("the validator rejects broken schedules, naming the action", "[parallel][schedule]") {
  SECTION("a missing action") {
    Schedule s = one_f_one_b(3, 4);
    auto& list = s.actions[0];
    list.erase(std::find(list.begin(), list.end(), Action{K::backward, 3, 0}));
    REQUIRE_MGPU_ERROR(validate(s), mgpu::Errc::invalid_argument, "backward(mb 3, chunk 0) is missing on device 0");
  }
  SECTION("a duplicate") {
    Schedule s = gpipe(2, 2);
    s.actions[0].push_back({K::forward, 1, 0});
    REQUIRE_MGPU_ERROR(validate(s), mgpu::Errc::invalid_argument, "forward(mb 1, chunk 0)): a duplicate");
  }
  SECTION("an action before its dependency") {
    Schedule s = gpipe(2, 2);
    auto& list = s.actions[1];  // recv_activation(mb 0), forward(mb 0), ...
    std::swap(list[0], list[1]);
    REQUIRE_MGPU_ERROR(validate(s), mgpu::Errc::invalid_argument, "device 1, action 0 (forward(mb 0, chunk 1)): runs before its dependency");
  }
  SECTION("an action on the wrong device") {
    Schedule s = gpipe(2, 1);
    s.actions[0].push_back({K::forward, 0, 1});
    REQUIRE_MGPU_ERROR(validate(s), mgpu::Errc::invalid_argument, "chunk 1 runs on device 1");
  }
  SECTION("a deadlocking order") {
    // Device 1 receives both activations in one group before computing; device 0 waits for the
    // first gradient before sending the second activation.
    Schedule s{"hand", 2, 1, 2, {}};
    s.actions = {{{K::forward, 0, 0}, {K::send_activation, 0, 0}, {K::recv_gradient, 0, 0}, {K::backward, 0, 0},
                  {K::forward, 1, 0}, {K::send_activation, 1, 0}, {K::recv_gradient, 1, 0}, {K::backward, 1, 0}},
                 {{K::recv_activation, 0, 1}, {K::recv_activation, 1, 1}, {K::forward, 0, 1}, {K::forward, 1, 1},
                  {K::backward, 0, 1}, {K::send_gradient, 0, 1}, {K::backward, 1, 1}, {K::send_gradient, 1, 1}}};
    REQUIRE_MGPU_ERROR(validate(s), mgpu::Errc::invalid_argument, "deadlock: device 0, action 2 (recv_gradient(mb 0, chunk 0)) waits for device 1");
  }
  SECTION("transfers between two devices in different orders") {
    Schedule s = gpipe(2, 2);
    auto& list = s.actions[0];  // ..., recv_gradient(0), backward(0), recv_gradient(1), backward(1)
    std::rotate(list.end() - 4, list.end() - 2, list.end());
    REQUIRE_MGPU_ERROR(validate(s), mgpu::Errc::invalid_argument, "in the same order");
  }
  SECTION("bad sizes") {
    REQUIRE_MGPU_ERROR(gpipe(2, 0), mgpu::Errc::invalid_argument, "0 micro-batches");
    REQUIRE_MGPU_ERROR(interleaved_one_f_one_b(4, 2, 6), mgpu::Errc::invalid_argument, "expected a multiple of the device count");
    REQUIRE_MGPU_ERROR(make_schedule("pipedream", 2, 2), mgpu::Errc::invalid_argument, "schedule 'pipedream'");
  }
}
