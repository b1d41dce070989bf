// Schedule generators, the validator and the simulator.
#include <mgpu/pipeline/schedule.hpp>

#include <algorithm>
#include <deque>
#include <limits>
#include <map>
#include <tuple>
#include <utility>

#include <mgpu/core/error.hpp>
#include <mgpu/parallel/memory_model.hpp>
#include <mgpu/pipeline/pipeline.hpp>

namespace mgpu::pipeline {
namespace {

using Kind = ActionKind;

bool is_backward(Kind k) { return k == Kind::backward || k == Kind::backward_input; }

void check_sizes(char const* what, int devices, int chunks_per_device, int micro_batches) {
  if (devices < 1 || chunks_per_device < 1 || micro_batches < 1)
    throw Error(Errc::invalid_argument, std::string(what) + " with " + std::to_string(devices) + " devices, " +
                                            std::to_string(chunks_per_device) + " chunks per device and " +
                                            std::to_string(micro_batches) + " micro-batches (expected each >= 1)");
}

// Adds the transfers compute actions need: a receive right before an action that consumes what
// another device produced, a send right after an action whose result another device consumes.
Schedule with_transfers(std::string name, int devices, int chunks_per_device, int micro_batches,
                        std::vector<std::vector<Action>> const& compute) {
  Schedule s{std::move(name), devices, chunks_per_device, micro_batches, {}};
  int const last = s.chunks() - 1;
  s.actions.resize(static_cast<std::size_t>(devices));
  for (int d = 0; d < devices; ++d) {
    auto& out = s.actions[static_cast<std::size_t>(d)];
    for (Action const& a : compute[static_cast<std::size_t>(d)]) {
      bool const prev_remote = a.chunk > 0 && s.device_of(a.chunk - 1) != d;
      bool const next_remote = a.chunk < last && s.device_of(a.chunk + 1) != d;
      if (a.kind == Kind::forward && prev_remote) out.push_back({Kind::recv_activation, a.micro_batch, a.chunk});
      if (is_backward(a.kind) && next_remote) out.push_back({Kind::recv_gradient, a.micro_batch, a.chunk});
      out.push_back(a);
      if (a.kind == Kind::forward && next_remote) out.push_back({Kind::send_activation, a.micro_batch, a.chunk});
      if (is_backward(a.kind) && prev_remote) out.push_back({Kind::send_gradient, a.micro_batch, a.chunk});
    }
  }
  return s;
}

// Adds transfers from a run of the compute orders in unit steps (a fused backward two, every other
// action one, each as soon as its inputs are ready): each transfer goes into both devices' lists at
// one step boundary where neither is inside an action, the first from when its data is ready, so
// that run, with free transfers, is what simulate() reproduces: no device waits for a peer to
// finish an action before a transfer meets. validate() checks the result.
Schedule with_boundary_transfers(std::string name, int devices, int chunks_per_device, int micro_batches,
                                 std::vector<std::vector<Action>> const& compute) {
  Schedule s{std::move(name), devices, chunks_per_device, micro_batches, {}};
  int const last = s.chunks() - 1;
  auto const n = static_cast<std::size_t>(devices);
  // finish[(kind, mb, chunk)] in steps.
  std::map<std::tuple<Kind, int, int>, int> finish;
  auto finished = [&](Kind k, int mb, int c, int t) {
    auto const it = finish.find({k, mb, c});
    return it != finish.end() && it->second <= t;
  };
  auto ready = [&](Action const& a, int t) {
    switch (a.kind) {
      case Kind::forward: return a.chunk == 0 || finished(Kind::forward, a.micro_batch, a.chunk - 1, t);
      case Kind::backward_weight: return finished(Kind::backward_input, a.micro_batch, a.chunk, t);
      default:
        return finished(Kind::forward, a.micro_batch, a.chunk, t) &&
               (a.chunk == last || finished(Kind::backward, a.micro_batch, a.chunk + 1, t) ||
                finished(Kind::backward_input, a.micro_batch, a.chunk + 1, t));
    }
  };
  std::vector<std::size_t> next(n, 0);
  std::vector<int> free_at(n, 0);
  std::vector<std::vector<std::pair<int, Action>>> timed(n);  // (start step, action)
  for (int t = 0;; ++t) {
    bool left = false;
    for (std::size_t d = 0; d < n; ++d) {
      auto const& order = compute[d];
      if (next[d] == order.size()) continue;
      left = true;
      Action const& a = order[next[d]];
      if (free_at[d] > t || !ready(a, t)) continue;
      timed[d].emplace_back(t, a);
      free_at[d] = t + (a.kind == Kind::backward ? 2 : 1);
      finish[{a.kind, a.micro_batch, a.chunk}] = free_at[d];
      ++next[d];
    }
    if (!left) break;
    // Every action takes at most 2 steps and some device can always run one: a generator bug otherwise.
    std::size_t total = 0;
    for (auto const& order : compute) total += order.size();
    if (static_cast<std::size_t>(t) > 2 * total)
      throw Error(Errc::invalid_argument, "schedule generator: a compute order that cannot finish (an action before its inputs)");
  }
  // mid[d][t]: device d is inside a compute action at step t (a fused backward's middle), where it
  // cannot post a transfer; started[(kind, mb, chunk)]: the step an action starts.
  int steps = 0;
  for (int const f : free_at) steps = std::max(steps, f);
  std::vector<std::vector<char>> mid(n, std::vector<char>(static_cast<std::size_t>(steps) + 1, 0));
  std::map<std::tuple<Kind, int, int>, int> started;
  for (std::size_t d = 0; d < n; ++d) {
    for (auto const& [start, a] : timed[d]) {
      started[{a.kind, a.micro_batch, a.chunk}] = start;
      for (int t = start + 1; t < finish[{a.kind, a.micro_batch, a.chunk}]; ++t) mid[d][static_cast<std::size_t>(t)] = 1;
    }
  }
  auto start_of_backward = [&](int mb, int c) {
    auto const fused = started.find({Kind::backward, mb, c});
    return fused != started.end() ? fused->second : started.at({Kind::backward_input, mb, c});
  };
  // A transfer meets at the first step from when its data is ready (`ready`) to when it is
  // consumed (`needed`) at which neither device is inside an action: both post it there and
  // neither waits. (With a fused backward of two steps, the step its data is ready may fall in the
  // middle of the receiver's backward; posting there would stall the sender until it ends.)
  auto meeting = [&](std::size_t from, std::size_t to, int ready, int needed) {
    for (int t = ready; t <= needed; ++t) {
      if (!mid[from][static_cast<std::size_t>(t)] && !mid[to][static_cast<std::size_t>(t)]) return t;
    }
    return ready;
  };
  // Transfers at boundary t for device d, in a fixed order.
  std::vector<std::map<int, std::vector<Action>>> at_boundary(n);
  for (std::size_t d = 0; d < n; ++d) {
    for (auto const& [start, a] : timed[d]) {
      int const ready = start + (a.kind == Kind::backward ? 2 : 1);
      if (a.kind == Kind::forward && a.chunk < last && s.device_of(a.chunk + 1) != static_cast<int>(d)) {
        auto const to = static_cast<std::size_t>(s.device_of(a.chunk + 1));
        int const t = meeting(d, to, ready, started.at({Kind::forward, a.micro_batch, a.chunk + 1}));
        at_boundary[d][t].push_back({Kind::send_activation, a.micro_batch, a.chunk});
        at_boundary[to][t].push_back({Kind::recv_activation, a.micro_batch, a.chunk + 1});
      }
      if (is_backward(a.kind) && a.chunk > 0 && s.device_of(a.chunk - 1) != static_cast<int>(d)) {
        auto const to = static_cast<std::size_t>(s.device_of(a.chunk - 1));
        int const t = meeting(d, to, ready, start_of_backward(a.micro_batch, a.chunk - 1));
        at_boundary[d][t].push_back({Kind::send_gradient, a.micro_batch, a.chunk});
        at_boundary[to][t].push_back({Kind::recv_gradient, a.micro_batch, a.chunk - 1});
      }
    }
  }
  s.actions.resize(n);
  for (std::size_t d = 0; d < n; ++d) {
    auto boundary = at_boundary[d].begin();
    for (auto const& [start, a] : timed[d]) {
      for (; boundary != at_boundary[d].end() && boundary->first <= start; ++boundary)
        s.actions[d].insert(s.actions[d].end(), boundary->second.begin(), boundary->second.end());
      s.actions[d].push_back(a);
    }
    for (; boundary != at_boundary[d].end(); ++boundary)
      s.actions[d].insert(s.actions[d].end(), boundary->second.begin(), boundary->second.end());
  }
  return s;
}

std::string at(int device, std::size_t index, Action const& a) {
  return "device " + std::to_string(device) + ", action " + std::to_string(index) + " (" + to_string(a) + ")";
}

[[noreturn]] void fail(std::string const& message) { throw Error(Errc::invalid_argument, "invalid schedule: " + message); }

// Per device in list order: right device, no duplicates, dependencies first; then completeness.
void check_order(Schedule const& s) {
  if (s.devices < 1 || s.chunks_per_device < 1 || s.micro_batches < 1)
    fail(std::to_string(s.devices) + " devices, " + std::to_string(s.chunks_per_device) + " chunks per device, " +
         std::to_string(s.micro_batches) + " micro-batches (expected each >= 1)");
  if (s.actions.size() != static_cast<std::size_t>(s.devices))
    fail("action lists for " + std::to_string(s.actions.size()) + " devices (expected one per device, " + std::to_string(s.devices) + ")");
  int const chunks = s.chunks();
  int const last = chunks - 1;
  constexpr int kinds = 8;
  // seen[(chunk * M + mb) * kinds + kind] = position of that action on its device, or -1.
  std::vector<std::int64_t> seen(static_cast<std::size_t>(chunks) * static_cast<std::size_t>(s.micro_batches) * kinds, -1);
  auto slot = [&](Kind k, int mb, int chunk) -> std::int64_t& {
    return seen[(static_cast<std::size_t>(chunk) * static_cast<std::size_t>(s.micro_batches) + static_cast<std::size_t>(mb)) * kinds +
                static_cast<std::size_t>(k)];
  };
  auto done = [&](Kind k, int mb, int chunk) { return slot(k, mb, chunk) >= 0; };
  for (int d = 0; d < s.devices; ++d) {
    auto const& list = s.actions[static_cast<std::size_t>(d)];
    for (std::size_t i = 0; i < list.size(); ++i) {
      Action const& a = list[i];
      std::string const where = at(d, i, a);
      if (static_cast<int>(a.kind) >= kinds) fail(where + ": unknown action kind");
      if (a.chunk < 0 || a.chunk >= chunks) fail(where + ": chunk out of range (expected [0, " + std::to_string(chunks) + "))");
      if (a.micro_batch < 0 || a.micro_batch >= s.micro_batches)
        fail(where + ": micro-batch out of range (expected [0, " + std::to_string(s.micro_batches) + "))");
      if (s.device_of(a.chunk) != d)
        fail(where + ": chunk " + std::to_string(a.chunk) + " runs on device " + std::to_string(s.device_of(a.chunk)) +
             " (expected chunk c on device c % " + std::to_string(s.devices) + ")");
      if (done(a.kind, a.micro_batch, a.chunk))
        fail(where + ": a duplicate (it already ran at action " + std::to_string(slot(a.kind, a.micro_batch, a.chunk)) + ")");
      bool const prev_remote = a.chunk > 0 && s.device_of(a.chunk - 1) != d;
      bool const next_remote = a.chunk < last && s.device_of(a.chunk + 1) != d;
      auto need = [&](bool ok, std::string const& expected) {
        if (!ok) fail(where + ": runs before its dependency (expected " + expected + " earlier on device " + std::to_string(d) + ")");
      };
      int const mb = a.micro_batch;
      int const c = a.chunk;
      switch (a.kind) {
        case Kind::forward:
          if (c > 0) {
            need(prev_remote ? done(Kind::recv_activation, mb, c) : done(Kind::forward, mb, c - 1),
                 to_string(Action{prev_remote ? Kind::recv_activation : Kind::forward, mb, prev_remote ? c : c - 1}));
          }
          break;
        case Kind::backward:
        case Kind::backward_input:
          if (done(Kind::backward, mb, c) || done(Kind::backward_input, mb, c))
            fail(where + ": a duplicate (this chunk's backward for the micro-batch already ran)");
          need(done(Kind::forward, mb, c), to_string(Action{Kind::forward, mb, c}));
          if (c < last) {
            bool const got = next_remote ? done(Kind::recv_gradient, mb, c)
                                         : done(Kind::backward, mb, c + 1) || done(Kind::backward_input, mb, c + 1);
            need(got, next_remote ? to_string(Action{Kind::recv_gradient, mb, c}) : "the backward of (mb " + std::to_string(mb) +
                                                                                          ", chunk " + std::to_string(c + 1) + ")");
          }
          break;
        case Kind::backward_weight:
          need(done(Kind::backward_input, mb, c), to_string(Action{Kind::backward_input, mb, c}));
          break;
        case Kind::send_activation:
        case Kind::recv_gradient:
          if (!next_remote) fail(where + ": no transfer needed (expected transfers only between chunks on different devices)");
          if (a.kind == Kind::send_activation) need(done(Kind::forward, mb, c), to_string(Action{Kind::forward, mb, c}));
          break;
        case Kind::send_gradient:
        case Kind::recv_activation:
          if (!prev_remote) fail(where + ": no transfer needed (expected transfers only between chunks on different devices)");
          if (a.kind == Kind::send_gradient)
            need(done(Kind::backward, mb, c) || done(Kind::backward_input, mb, c), "the backward of (mb " + std::to_string(mb) + ", chunk " +
                                                                                      std::to_string(c) + ")");
          break;
      }
      slot(a.kind, mb, c) = static_cast<std::int64_t>(i);
    }
  }
  for (int c = 0; c < chunks; ++c) {
    int const d = s.device_of(c);
    bool const prev_remote = c > 0 && s.device_of(c - 1) != d;
    bool const next_remote = c < last && s.device_of(c + 1) != d;
    for (int mb = 0; mb < s.micro_batches; ++mb) {
      auto missing = [&](Kind k) {
        fail(to_string(Action{k, mb, c}) + " is missing on device " + std::to_string(d) +
             " (expected every micro-batch's forward and backward once on every chunk)");
      };
      if (!done(Kind::forward, mb, c)) missing(Kind::forward);
      if (!done(Kind::backward, mb, c) && !done(Kind::backward_input, mb, c)) missing(Kind::backward);
      if (done(Kind::backward_input, mb, c) && !done(Kind::backward_weight, mb, c)) missing(Kind::backward_weight);
      if (next_remote && !done(Kind::send_activation, mb, c)) missing(Kind::send_activation);
      if (next_remote && !done(Kind::recv_gradient, mb, c)) missing(Kind::recv_gradient);
      if (prev_remote && !done(Kind::recv_activation, mb, c)) missing(Kind::recv_activation);
      if (prev_remote && !done(Kind::send_gradient, mb, c)) missing(Kind::send_gradient);
    }
  }
}

// The peer device of a transfer.
int peer_of(Schedule const& s, Action const& a) {
  bool const forward_dir = a.kind == Kind::send_activation || a.kind == Kind::recv_gradient;
  return s.device_of(forward_dir ? a.chunk + 1 : a.chunk - 1);
}

// The action the peer posts to match `a`.
Action counterpart(Action const& a) {
  switch (a.kind) {
    case Kind::send_activation: return {Kind::recv_activation, a.micro_batch, a.chunk + 1};
    case Kind::recv_activation: return {Kind::send_activation, a.micro_batch, a.chunk - 1};
    case Kind::send_gradient: return {Kind::recv_gradient, a.micro_batch, a.chunk - 1};
    case Kind::recv_gradient: return {Kind::send_gradient, a.micro_batch, a.chunk + 1};
    default: return a;
  }
}

// Runs an order-checked schedule in simulated time (see simulate()); throws naming the first
// blocked action when it deadlocks, or a transfer whose peer posts a different one.
// `duration(d, i)`: how long action i of device d takes (a transfer: the pair, once both are
// posted; asked of the sending side).
template <class Duration>
Simulation run(Schedule const& s, Duration const& duration) {
  auto const n = static_cast<std::size_t>(s.devices);
  Simulation sim;
  sim.busy.assign(n, 0.0);
  sim.peak_in_flight.assign(n, 0);
  sim.start.resize(n);
  sim.end.resize(n);
  for (std::size_t d = 0; d < n; ++d) {
    sim.start[d].assign(s.actions[d].size(), 0.0);
    sim.end[d].assign(s.actions[d].size(), -1.0);
  }
  struct Posted {
    int device;
    std::size_t index;
  };
  std::map<std::pair<int, int>, std::deque<Posted>> sends, recvs;  // keyed by (from, to)
  std::vector<std::size_t> pc(n, 0), group_end(n, 0), pending(n, 0);
  std::vector<double> clock(n, 0.0);
  std::vector<int> in_flight(n, 0);
  auto match = [&](std::pair<int, int> key) {
    auto& sq = sends[key];
    auto& rq = recvs[key];
    while (!sq.empty() && !rq.empty()) {
      Posted const snd = sq.front();
      Posted const rcv = rq.front();
      sq.pop_front();
      rq.pop_front();
      Action const& sa = s.actions[static_cast<std::size_t>(snd.device)][snd.index];
      Action const& ra = s.actions[static_cast<std::size_t>(rcv.device)][rcv.index];
      if (counterpart(sa) != ra)
        fail(at(snd.device, snd.index, sa) + " is received by " + at(rcv.device, rcv.index, ra) +
             " (expected the two devices to post their transfers between each other in the same order)");
      double const t = std::max(sim.start[static_cast<std::size_t>(snd.device)][snd.index],
                                sim.start[static_cast<std::size_t>(rcv.device)][rcv.index]) +
                       duration(static_cast<std::size_t>(snd.device), snd.index);
      for (Posted const& p : {snd, rcv}) {
        sim.end[static_cast<std::size_t>(p.device)][p.index] = t;
        --pending[static_cast<std::size_t>(p.device)];
      }
    }
  };
  bool progress = true;
  while (progress) {
    progress = false;
    for (std::size_t d = 0; d < n; ++d) {
      auto const& list = s.actions[d];
      while (pc[d] < list.size()) {
        Action const& a = list[pc[d]];
        if (!is_transfer(a.kind)) {
          double const len = duration(d, pc[d]);
          sim.start[d][pc[d]] = clock[d];
          clock[d] += len;
          sim.end[d][pc[d]] = clock[d];
          sim.busy[d] += len;
          if (a.kind == Kind::forward) sim.peak_in_flight[d] = std::max(sim.peak_in_flight[d], ++in_flight[d]);
          if (a.kind == Kind::backward || a.kind == Kind::backward_weight) --in_flight[d];
          ++pc[d];
          progress = true;
          continue;
        }
        if (group_end[d] <= pc[d]) {  // post the group of consecutive transfers
          std::size_t e = pc[d];
          while (e < list.size() && is_transfer(list[e].kind)) ++e;
          group_end[d] = e;
          pending[d] = e - pc[d];
          progress = true;
          for (std::size_t i = pc[d]; i < e; ++i) {
            sim.start[d][i] = clock[d];
            int const peer = peer_of(s, list[i]);
            bool const sending = list[i].kind == Kind::send_activation || list[i].kind == Kind::send_gradient;
            auto const key = sending ? std::pair{static_cast<int>(d), peer} : std::pair{peer, static_cast<int>(d)};
            (sending ? sends : recvs)[key].push_back({static_cast<int>(d), i});
            match(key);
          }
        }
        if (pending[d] > 0) break;
        for (std::size_t i = pc[d]; i < group_end[d]; ++i) clock[d] = std::max(clock[d], sim.end[d][i]);
        pc[d] = group_end[d];
        progress = true;
      }
    }
  }
  for (std::size_t d = 0; d < n; ++d) {
    if (pc[d] == s.actions[d].size()) continue;
    // The first device that is stuck: name its first unmatched transfer and where its peer waits.
    std::size_t i = pc[d];
    while (sim.end[d][i] >= 0) ++i;
    Action const& a = s.actions[d][i];
    int const peer = peer_of(s, a);
    auto const p = static_cast<std::size_t>(peer);
    std::string const peer_at = pc[p] < s.actions[p].size() ? "waits at " + at(peer, pc[p], s.actions[p][pc[p]]) : "has finished";
    fail("deadlock: " + at(static_cast<int>(d), i, a) + " waits for device " + std::to_string(peer) + ", which " + peer_at +
         " (expected a matching " + to_string(counterpart(a)) + " that device " + std::to_string(peer) + " can reach)");
  }
  double busy_total = 0;
  for (std::size_t d = 0; d < n; ++d) {
    sim.makespan = std::max(sim.makespan, clock[d]);
    busy_total += sim.busy[d];
  }
  sim.bubble_fraction = sim.makespan > 0 ? 1.0 - busy_total / (static_cast<double>(n) * sim.makespan) : 0.0;
  return sim;
}

}  // namespace

char const* to_string(ActionKind kind) noexcept {
  switch (kind) {
    case Kind::forward: return "forward";
    case Kind::backward: return "backward";
    case Kind::backward_input: return "backward_input";
    case Kind::backward_weight: return "backward_weight";
    case Kind::send_activation: return "send_activation";
    case Kind::recv_activation: return "recv_activation";
    case Kind::send_gradient: return "send_gradient";
    case Kind::recv_gradient: return "recv_gradient";
  }
  return "unknown";
}

std::string to_string(Action const& a) {
  return std::string(to_string(a.kind)) + "(mb " + std::to_string(a.micro_batch) + ", chunk " + std::to_string(a.chunk) + ")";
}

bool is_transfer(ActionKind kind) noexcept {
  return kind == Kind::send_activation || kind == Kind::recv_activation || kind == Kind::send_gradient || kind == Kind::recv_gradient;
}

Schedule gpipe(int devices, int micro_batches) {
  check_sizes("gpipe", devices, 1, micro_batches);
  std::vector<std::vector<Action>> compute(static_cast<std::size_t>(devices));
  for (int d = 0; d < devices; ++d) {
    for (int m = 0; m < micro_batches; ++m) compute[static_cast<std::size_t>(d)].push_back({Kind::forward, m, d});
    for (int m = 0; m < micro_batches; ++m) compute[static_cast<std::size_t>(d)].push_back({Kind::backward, m, d});
  }
  return with_transfers("gpipe", devices, 1, micro_batches, compute);
}

Schedule one_f_one_b(int devices, int micro_batches) {
  check_sizes("one_f_one_b", devices, 1, micro_batches);
  std::vector<std::vector<Action>> compute(static_cast<std::size_t>(devices));
  for (int d = 0; d < devices; ++d) {
    auto& out = compute[static_cast<std::size_t>(d)];
    int const warm = std::min(devices - d - 1, micro_batches);
    for (int m = 0; m < warm; ++m) out.push_back({Kind::forward, m, d});
    for (int i = 0; i + warm < micro_batches; ++i) {
      out.push_back({Kind::forward, warm + i, d});
      out.push_back({Kind::backward, i, d});
    }
    for (int m = micro_batches - warm; m < micro_batches; ++m) out.push_back({Kind::backward, m, d});
  }
  return with_transfers("1f1b", devices, 1, micro_batches, compute);
}

Schedule interleaved_one_f_one_b(int devices, int chunks_per_device, int micro_batches) {
  check_sizes("interleaved_one_f_one_b", devices, chunks_per_device, micro_batches);
  if (chunks_per_device == 1) {
    Schedule s = one_f_one_b(devices, micro_batches);
    s.name = "interleaved";
    return s;
  }
  if (micro_batches % devices != 0)
    throw Error(Errc::invalid_argument, "interleaved 1F1B with " + std::to_string(micro_batches) + " micro-batches on " +
                                            std::to_string(devices) + " devices (expected a multiple of the device count)");
  int const total = micro_batches * chunks_per_device;
  int const round = devices * chunks_per_device;
  std::vector<std::vector<Action>> compute(static_cast<std::size_t>(devices));
  for (int d = 0; d < devices; ++d) {
    auto& out = compute[static_cast<std::size_t>(d)];
    // The k-th forward (backward) of the device: micro-batches in groups of `devices`, each group
    // through every local chunk in turn (backward: last chunk first).
    auto mb = [&](int k) { return (k / round) * devices + k % devices; };
    auto forward = [&](int k) { return Action{Kind::forward, mb(k), ((k % round) / devices) * devices + d}; };
    auto backward = [&](int k) {
      return Action{Kind::backward, mb(k), (chunks_per_device - 1 - (k % round) / devices) * devices + d};
    };
    // Megatron's warm-up forwards. On two devices, which send to each other in both directions, its
    // count has the last device's forward outputs ready in the middle of the first device's fused
    // backwards (and the first's outputs in the middle of the last's): no blocking transfer can
    // meet there without one device waiting, every round. One more warm-up forward on the last
    // device shifts its steady state by a forward, and every transfer meets at a boundary of both.
    int const extra = devices == 2 && d == 1 ? 1 : 0;
    int const warm = std::min((devices - d - 1) * 2 + (chunks_per_device - 1) * devices + extra, total);
    for (int k = 0; k < warm; ++k) out.push_back(forward(k));
    for (int i = 0; i + warm < total; ++i) {
      out.push_back(forward(warm + i));
      out.push_back(backward(i));
    }
    for (int k = total - warm; k < total; ++k) out.push_back(backward(k));
  }
  return with_boundary_transfers("interleaved", devices, chunks_per_device, micro_batches, compute);
}

Schedule zero_bubble_h1(int devices, int micro_batches) {
  check_sizes("zero_bubble_h1", devices, 1, micro_batches);
  // List scheduling in unit time steps with equal costs: a free device runs a pending
  // backward_weight if `devices` of them are pending (bounding what they hold), else the next
  // backward_input if its gradient is there, else the next forward if its input is there and fewer
  // than devices - d micro-batches wait for their backward_input (1F1B's limit), else a pending
  // backward_weight.
  auto const n = static_cast<std::size_t>(devices);
  auto const m = static_cast<std::size_t>(micro_batches);
  constexpr int never = std::numeric_limits<int>::max();
  std::vector<std::vector<int>> f_done(n, std::vector<int>(m, never)), b_done(n, std::vector<int>(m, never));
  std::vector<int> next_f(n, 0), next_b(n, 0), next_w(n, 0);
  std::vector<std::vector<Action>> compute(n);
  for (int t = 0; std::any_of(next_w.begin(), next_w.end(), [&](int w) { return w < micro_batches; }); ++t) {
    for (int d = 0; d < devices; ++d) {
      auto const u = static_cast<std::size_t>(d);
      int const f = next_f[u];
      int const b = next_b[u];
      bool const b_ready = b < f && f_done[u][static_cast<std::size_t>(b)] <= t &&
                           (d == devices - 1 || b_done[u + 1][static_cast<std::size_t>(b)] <= t);
      bool const f_ready = f < micro_batches && (d == 0 || f_done[u - 1][static_cast<std::size_t>(f)] <= t) &&
                           f - b < devices - d;
      bool const w_ready = next_w[u] < b && b_done[u][static_cast<std::size_t>(next_w[u])] <= t;
      if (w_ready && b - next_w[u] >= devices) {
        compute[u].push_back({Kind::backward_weight, next_w[u], d});
        ++next_w[u];
      } else if (b_ready) {
        compute[u].push_back({Kind::backward_input, b, d});
        b_done[u][static_cast<std::size_t>(b)] = t + 1;
        ++next_b[u];
      } else if (f_ready) {
        compute[u].push_back({Kind::forward, f, d});
        f_done[u][static_cast<std::size_t>(f)] = t + 1;
        ++next_f[u];
      } else if (next_w[u] < b && b_done[u][static_cast<std::size_t>(next_w[u])] <= t) {
        compute[u].push_back({Kind::backward_weight, next_w[u], d});
        ++next_w[u];
      }
    }
  }
  return with_boundary_transfers("zb-h1", devices, 1, micro_batches, compute);
}

std::vector<std::vector<parallel::GptPass>> memory_passes(Schedule const& schedule) {
  std::vector<std::vector<parallel::GptPass>> out(schedule.actions.size());
  for (std::size_t d = 0; d < schedule.actions.size(); ++d) {
    for (Action const& a : schedule.actions[d]) {
      using P = parallel::GptPass::Kind;
      P kind = P::forward;
      switch (a.kind) {
        case Kind::forward: kind = P::forward; break;
        case Kind::backward: kind = P::backward; break;
        case Kind::backward_input: kind = P::backward_input; break;
        case Kind::backward_weight: kind = P::backward_weight; break;
        default: continue;  // transfers hold nothing the model counts
      }
      out[d].push_back({kind, a.micro_batch, a.chunk});
    }
  }
  return out;
}

Schedule make_schedule(std::string const& name, int devices, int micro_batches, int chunks_per_device) {
  if (name == "gpipe") return gpipe(devices, micro_batches);
  if (name == "1f1b") return one_f_one_b(devices, micro_batches);
  if (name == "interleaved") return interleaved_one_f_one_b(devices, chunks_per_device, micro_batches);
  if (name == "zb") return zero_bubble_h1(devices, micro_batches);
  throw Error(Errc::invalid_argument, "schedule '" + name + "' (expected gpipe, 1f1b, interleaved or zb)");
}

void validate(Schedule const& schedule) {
  check_order(schedule);
  static_cast<void>(run(schedule, [](std::size_t, std::size_t) { return 1.0; }));  // whether it ends does not depend on costs
}

Simulation simulate(Schedule const& schedule, std::vector<ActionCosts> const& costs) {
  check_order(schedule);
  if (costs.size() != 1 && costs.size() != static_cast<std::size_t>(schedule.chunks()))
    throw Error(Errc::invalid_argument, "simulate with costs for " + std::to_string(costs.size()) + " chunks (expected 1 or " +
                                            std::to_string(schedule.chunks()) + ")");
  return run(schedule, [&](std::size_t d, std::size_t i) {
    Action const& a = schedule.actions[d][i];
    ActionCosts const& c = costs.size() == 1 ? costs[0] : costs[static_cast<std::size_t>(a.chunk)];
    switch (a.kind) {
      case Kind::forward: return c.forward;
      case Kind::backward: return c.backward_input + c.backward_weight;
      case Kind::backward_input: return c.backward_input;
      case Kind::backward_weight: return c.backward_weight;
      default: return c.transfer;
    }
  });
}

Simulation simulate(Schedule const& schedule, std::vector<std::vector<double>> const& durations) {
  check_order(schedule);
  bool matches = durations.size() == schedule.actions.size();
  for (std::size_t d = 0; matches && d < durations.size(); ++d) matches = durations[d].size() == schedule.actions[d].size();
  if (!matches) {
    std::string want, got;
    for (auto const& list : schedule.actions) want += (want.empty() ? "" : ", ") + std::to_string(list.size());
    for (auto const& list : durations) got += (got.empty() ? "" : ", ") + std::to_string(list.size());
    throw Error(Errc::invalid_argument, "simulate with durations for [" + got + "] actions per device (expected [" + want +
                                            "], one per action of the schedule)");
  }
  return run(schedule, [&](std::size_t d, std::size_t i) { return durations[d][i]; });
}

}  // namespace mgpu::pipeline
