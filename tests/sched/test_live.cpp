// The scheduler on a live DeviceGroup: node state read off the devices, measured links, and tasks
// placed on the devices the scheduler picks.
#include <mgpu/core/device_group.hpp>
#include <mgpu/sched/live.hpp>
#include <mgpu/sched/planning.hpp>

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
