// The scheduler on a live DeviceGroup: node state read off the devices, measured links, and tasks
// placed on the devices the scheduler picks.
#include <mgpu/core/device_group.hpp>
#include <mgpu/sched/defrag.hpp>
#include <mgpu/sched/live.hpp>
#include <mgpu/sched/planning.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "support/catch.hpp"
#include "support/expect_error.hpp"

using namespace mgpu::sched;

TEST_CASE("Node state from a host group: memory in use, shared-memory links, equal speeds", "[sched][live]") {
  mgpu::DeviceGroup group("host:3");
  auto const machine = static_cast<double>(mgpu::properties(group.device(0)).memory_bytes);
  mgpu::Tensor held = mgpu::Tensor::empty({1 << 20}, mgpu::DType::float32, group.allocator(1));
  NodeState const node = node_state(group);
  REQUIRE(node.devices.size() == 3);
  for (auto const& d : node.devices) {
    CHECK(d.type == "host");
    CHECK(d.capacity_bytes == Approx(machine / 3));
    CHECK(d.speed == 1.0);
    for (std::size_t j = 0; j < 3; ++j) CHECK(d.links[j] == (static_cast<int>(j) == d.id ? 0.0 : 1.0));
  }
  CHECK(node.devices[1].free_bytes <= node.devices[1].capacity_bytes - 4.0 * (1 << 20));
  CHECK(node.devices[0].free_bytes == node.devices[0].capacity_bytes);
  auto const weights = shard_weights(node, {0, 1, 2});
  CHECK(weights[0] == Approx(weights[2]));
}

TEST_CASE("Measured peer bandwidth becomes link quality", "[sched][live]") {
  mgpu::DeviceGroup group("host:2");
  auto const bw = measure_peer_bandwidth(group, std::size_t{1} << 20, 2);
  REQUIRE(bw.size() == 2);
  CHECK(bw[0][0] == 0);
  CHECK(bw[0][1] > 0.01);  // GB/s
  CHECK(bw[1][0] > 0.01);
  NodeState const node = node_state(group, bw);
  CHECK(node.devices[0].links[1] == Approx(1.0));  // the only pair is the best pair
  REQUIRE_MGPU_ERROR(node_state(group, {{0}}), mgpu::Errc::invalid_argument, "expected 2 x 2");
}

TEST_CASE("The task placer spreads independent tasks, follows data, and frees what tasks held", "[sched][live]") {
  mgpu::DeviceGroup group("host:4");
  TaskPlacer placer(group);
  std::vector<int> per_rank(4, 0);
  std::vector<std::atomic<int>> ran(4);
  for (int t = 0; t < 8; ++t) {
    int const rank = placer.submit({.name = "task", .work_seconds = 1}, [&](int r, mgpu::Stream& stream) {
      CHECK(stream.device() == group.device(r));
      stream.enqueue([&ran, r] {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        ++ran[static_cast<std::size_t>(r)];
      });
    });
    ++per_rank[static_cast<std::size_t>(rank)];
  }
  CHECK(per_rank == std::vector<int>{2, 2, 2, 2});  // least-loaded: queued work is reserved at submit
  placer.wait();
  for (auto const& r : ran) CHECK(r.load() == 2);
  for (auto const& d : placer.node().snapshot().devices) CHECK(d.queued_seconds == 0);

  int const holder = placer.submit({.name = "load", .data = "shard-7", .data_bytes = 1e9}, [](int, mgpu::Stream&) {});
  placer.wait();
  CHECK(placer.submit({.name = "reuse", .data = "shard-7", .data_bytes = 1e9}, [](int, mgpu::Stream&) {}) == holder);
  placer.wait();

  // A task that fails on its stream: its reservation is released by wait(), which reports the failure.
  double const before = placer.node().snapshot().devices[0].free_bytes;
  int const failed = placer.submit({.name = "fails", .memory_bytes = 1e6}, [](int, mgpu::Stream& stream) {
    stream.enqueue([] { throw mgpu::Error(mgpu::Errc::device, "task failed"); });
  });
  REQUIRE_MGPU_ERROR(placer.wait(), mgpu::Errc::device, "task failed");
  CHECK(placer.node().snapshot().devices[static_cast<std::size_t>(failed)].free_bytes == Approx(before));
  REQUIRE_MGPU_ERROR(placer.submit({.name = "huge", .memory_bytes = 1e18}, [](int, mgpu::Stream&) {}), mgpu::Errc::out_of_memory,
                     "task 'huge': no device can take it");
}

TEST_CASE("Room for a gang: the fewest moves of placed requests, checked against capacity from scratch", "[sched][live][defrag]") {
  // Four devices of 10 GB, each holding placed requests; a 2-device gang asks for 8 GB on each.
  NodeState node;
  for (int i = 0; i < 4; ++i) node.devices.push_back({.id = i, .type = "A100", .capacity_bytes = 10e9, .free_bytes = 10e9});
  for (auto& d : node.devices) d.links.assign(4, 1.0);
  std::vector<PlacedRequest> placed;
  auto const put = [&](std::uint64_t id, int device, double bytes, bool preemptible = true) {
    PlacedRequest p{id, {.name = "t" + std::to_string(id), .memory_bytes = bytes, .preemptible = preemptible, .exclusive = false}, {}};
    p.placement.devices = {device};
    REQUIRE(reserve(node, p.request, p.placement));
    placed.push_back(p);
  };
  put(0, 0, 3e9);  // device 0: one 3 GB request to shed
  put(1, 1, 2e9);  // device 1: two 2 GB requests to shed
  put(2, 1, 2e9);
  put(3, 2, 3e9, false);  // device 2: pinned (not preemptible)
  put(4, 3, 3e9);  // device 3: one 3 GB request to shed
  Scheduler const scheduler = Scheduler::default_profile();
  Request const gang{.name = "dp", .devices = 2, .memory_bytes = 8e9};
  REQUIRE(!scheduler.place(gang, node));

  // Exhaustively: the fewest moves (each placed request to any device) after which two devices have 8 GB free.
  std::size_t fewest = 99;
  std::vector<int> where(placed.size());
  for (int code = 0; code < 1024; ++code) {  // 4^5 assignments
    std::vector<double> used(4, 0);
    std::size_t moves = 0;
    bool ok = true;
    for (std::size_t j = 0, c = static_cast<std::size_t>(code); j < placed.size(); ++j, c /= 4) {
      int const to = static_cast<int>(c % 4);
      moves += to != placed[j].placement.devices.front() ? 1 : 0;
      ok = ok && (to == placed[j].placement.devices.front() || placed[j].request.preemptible);
      used[static_cast<std::size_t>(to)] += placed[j].request.memory_bytes;
    }
    int roomy = 0;
    for (double u : used) {
      ok = ok && u <= 10e9;
      roomy += 10e9 - u >= 8e9 ? 1 : 0;
    }
    if (ok && roomy >= 2) fewest = std::min(fewest, moves);
  }
  REQUIRE(fewest == 2);

  std::optional<GangPlan> const plan = plan_room(node, placed, gang, scheduler);
  REQUIRE(plan);
  CHECK(plan->moves.size() == fewest);
  // Carry the moves out from scratch: every device within capacity, the gang's devices with 8 GB free.
  std::vector<double> used(4, 0);
  for (PlacedRequest const& p : placed) {
    int device = p.placement.devices.front();
    for (RequestMove const& m : plan->moves) {
      if (m.id != p.id) continue;
      CHECK(m.from == device);
      CHECK(p.request.preemptible);
      device = m.to;
    }
    used[static_cast<std::size_t>(device)] += p.request.memory_bytes;
  }
  for (double u : used) CHECK(u <= 10e9);
  REQUIRE(plan->placement.devices.size() == 2);
  for (int d : plan->placement.devices) CHECK(10e9 - used[static_cast<std::size_t>(d)] >= 8e9);
  CHECK(node.devices[0].free_bytes == 7e9);  // nothing was moved in `node`

  CHECK(!plan_room(node, placed, gang, scheduler, 1));  // one move is not enough
  Request const small{.name = "one", .devices = 1, .memory_bytes = 5e9};
  std::optional<GangPlan> const fits = plan_room(node, placed, small, scheduler);  // fits now: no moves
  REQUIRE(fits);
  CHECK(fits->moves.empty());
  REQUIRE_MGPU_ERROR(plan_room(node, placed, gang, scheduler, -1), mgpu::Errc::invalid_argument, "expected >= 0");
  REQUIRE_MGPU_ERROR(plan_room(node, placed, {.devices = 5}, scheduler), mgpu::Errc::invalid_argument, "");
}

TEST_CASE("The task placer plans room for a gang among its outstanding tasks without moving them", "[sched][live][defrag]") {
  mgpu::DeviceGroup group("host:4");
  TaskPlacer placer(group);
  double free = placer.node().snapshot().devices[0].free_bytes;
  for (auto const& d : placer.node().snapshot().devices) free = std::min(free, d.free_bytes);
  std::atomic<bool> go{false};
  std::vector<int> rank_of;
  for (int t = 0; t < 4; ++t)  // one task of 30% per device (least-loaded), held until `go`
    rank_of.push_back(placer.submit({.name = "held", .memory_bytes = 0.3 * free, .work_seconds = 1}, [&](int, mgpu::Stream& stream) {
      stream.enqueue([&go] {
        while (!go.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      });
    }));
  std::vector<int> sorted = rank_of;
  std::sort(sorted.begin(), sorted.end());
  REQUIRE(sorted == std::vector<int>{0, 1, 2, 3});
  Request const gang{.name = "dp", .devices = 2, .memory_bytes = 0.8 * free};
  std::vector<double> const before = [&] {
    std::vector<double> out;
    for (auto const& d : placer.node().snapshot().devices) out.push_back(d.free_bytes);
    return out;
  }();
  std::optional<GangPlan> const plan = placer.plan_room(gang);
  REQUIRE(plan);
  REQUIRE(plan->moves.size() == 2);  // one task off each of two devices, onto the other two
  std::vector<double> used(4, 0);
  for (std::size_t t = 0; t < 4; ++t) {
    int device = rank_of[t];
    for (RequestMove const& m : plan->moves)
      if (m.id == t) device = m.to;
    used[static_cast<std::size_t>(device)] += 0.3 * free;
  }
  for (int d : plan->placement.devices) CHECK(free - used[static_cast<std::size_t>(d)] >= 0.8 * free - 1);
  for (double u : used) CHECK(u <= free + 1);
  std::size_t i = 0;
  for (auto const& d : placer.node().snapshot().devices) CHECK(d.free_bytes == before[i++]);  // nothing moved
  go = true;
  placer.wait();
  std::optional<GangPlan> const after = placer.plan_room(gang);
  REQUIRE(after);
  CHECK(after->moves.empty());  // the tasks are done: the gang fits as it is
}
