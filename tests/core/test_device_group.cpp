// DeviceGroup: concurrent per-rank work, error propagation, sharding and scattering.
#include <mgpu/core/device_group.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <numeric>
#include <random>
#include <stdexcept>
#include <thread>

#include "support/catch.hpp"
#include "support/expect_error.hpp"

using mgpu::DeviceGroup;
using mgpu::DType;
using mgpu::Errc;
using mgpu::Tensor;
using namespace std::chrono_literals;

namespace {
// Exact largest-remainder apportionment with integer weights: the reference for shard_sizes.
std::vector<std::int64_t> reference_sizes(std::int64_t rows, std::vector<int> const& weights) {
  std::int64_t const total = std::accumulate(weights.begin(), weights.end(), std::int64_t{0});
  std::vector<std::int64_t> sizes;
  std::vector<std::int64_t> remainders;
  std::int64_t assigned = 0;
  for (int w : weights) {
    sizes.push_back(rows * w / total);
    remainders.push_back(rows * w % total);
    assigned += sizes.back();
  }
  std::vector<std::size_t> order(weights.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](auto a, auto b) { return remainders[a] > remainders[b]; });
  for (std::size_t i = 0; assigned < rows; ++i) {
    if (weights[order[i]] > 0) ++sizes[order[i]], ++assigned;
  }
  return sizes;
}
}  // namespace

TEST_CASE("Even shards: sizes differ by at most one, larger first", "[core][shard]") {
  for (std::int64_t rows : {0, 1, 2, 3, 7, 8, 13, 100, 1023, 4096}) {
    for (int parts = 1; parts <= 9; ++parts) {
      auto const sizes = mgpu::shard_sizes(rows, parts);
      REQUIRE(sizes.size() == static_cast<std::size_t>(parts));
      REQUIRE(std::accumulate(sizes.begin(), sizes.end(), std::int64_t{0}) == rows);
      REQUIRE(std::is_sorted(sizes.rbegin(), sizes.rend()));
      REQUIRE(sizes.front() - sizes.back() <= 1);
      REQUIRE(sizes.back() == rows / parts);
    }
  }
  CHECK(mgpu::shard_sizes(2, 4) == std::vector<std::int64_t>{1, 1, 0, 0});  // smaller than the group
}

TEST_CASE("Weighted shards follow largest remainder, zero weights get nothing", "[core][shard]") {
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> weight(0, 9);
  std::uniform_int_distribution<std::int64_t> row_count(0, 5000);
  for (int trial = 0; trial < 3000; ++trial) {
    int const parts = 1 + trial % 8;
    std::vector<int> w(static_cast<std::size_t>(parts));
    for (auto& x : w) x = weight(rng);
    if (std::all_of(w.begin(), w.end(), [](int x) { return x == 0; })) w[0] = 1;
    std::vector<double> const wd(w.begin(), w.end());
    std::int64_t const rows = trial < 200 ? trial % 7 : row_count(rng);
    INFO("rows " << rows << ", parts " << parts);
    REQUIRE(mgpu::shard_sizes(rows, parts, wd) == reference_sizes(rows, w));
  }
  std::vector<double> const w = {3.0, 0.0, 1.0};
  CHECK(mgpu::shard_sizes(8, 3, w) == std::vector<std::int64_t>{6, 0, 2});
  CHECK(mgpu::shard_sizes(1, 3, w) == std::vector<std::int64_t>{1, 0, 0});
}

TEST_CASE("Bad shard arguments are rejected", "[core][shard]") {
  std::vector<double> const two = {1.0, 1.0};
  std::vector<double> const negative = {1.0, -1.0};
  std::vector<double> const zeros = {0.0, 0.0};
  std::vector<double> const nan = {1.0, std::nan("")};
  REQUIRE_MGPU_ERROR(mgpu::shard_sizes(4, 0), Errc::invalid_argument, "expected at least 1");
  REQUIRE_MGPU_ERROR(mgpu::shard_sizes(-1, 2), Errc::invalid_argument, "expected rows >= 0");
  REQUIRE_MGPU_ERROR(mgpu::shard_sizes(4, 3, two), Errc::invalid_argument, "got 2 weights for 3 parts");
  REQUIRE_MGPU_ERROR(mgpu::shard_sizes(4, 2, negative), Errc::invalid_argument, "expected a finite weight >= 0");
  REQUIRE_MGPU_ERROR(mgpu::shard_sizes(4, 2, zeros), Errc::invalid_argument, "all 0");
  REQUIRE_MGPU_ERROR(mgpu::shard_sizes(4, 2, nan), Errc::invalid_argument, "expected a finite weight >= 0");
}

TEST_CASE("A group is built from a spec, a device list or the environment", "[core][group]") {
  DeviceGroup group("host:3");
  CHECK(group.size() == 3);
  CHECK(group.device(2) == mgpu::Device{mgpu::DeviceKind::host, 2});
  CHECK(group.allocator(1).device() == group.device(1));
  CHECK(group.stream(0).device() == group.device(0));
  CHECK(group.make_stream(2).device() == group.device(2));
  REQUIRE_MGPU_ERROR(group.device(3), Errc::invalid_argument, "expected a rank in [0, 3)");
  REQUIRE_MGPU_ERROR(DeviceGroup(std::vector<mgpu::Device>{}), Errc::invalid_argument, "at least one device");
  REQUIRE_MGPU_ERROR(DeviceGroup("host:0"), Errc::invalid_argument, "host device count is 0");
  DeviceGroup from_env;  // MGPU_DEVICES or auto
  CHECK(from_env.size() >= 1);
}

TEST_CASE("run() calls every rank concurrently on its own device", "[core][group]") {
  DeviceGroup group("host:4");
  std::mutex mutex;
  std::condition_variable cv;
  int arrived = 0;
  std::atomic<int> met{0};
  std::vector<int> ranks_seen(4, -1);
  std::atomic<int> own_stream{0};
  group.run([&](int rank, mgpu::Device device, mgpu::Stream& stream) {  // no assertions here: Catch2 is single-threaded
    ranks_seen[static_cast<std::size_t>(rank)] = device.index;
    if (&stream == &group.stream(rank)) ++own_stream;
    std::unique_lock lock(mutex);
    ++arrived;
    cv.notify_all();
    if (cv.wait_for(lock, 10s, [&] { return arrived == 4; })) ++met;  // needs all four at once
  });
  CHECK(met == 4);
  CHECK(own_stream == 4);
  CHECK(ranks_seen == std::vector<int>{0, 1, 2, 3});
}

TEST_CASE("run() waits for stream work and rethrows the first error after the others stop", "[core][group]") {
  DeviceGroup group("host:3");
  std::atomic<int> finished{0};
  REQUIRE_MGPU_ERROR(group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
    if (rank == 1) throw std::runtime_error("rank one failed");
    std::this_thread::sleep_for(50ms);
    stream.enqueue([&] { ++finished; });
  }),
                     Errc::device, "rank 1 (host:1): rank one failed");
  CHECK(finished == 2);  // the other ranks ran to the end, including their stream work

  REQUIRE_MGPU_ERROR(group.run([](int rank, mgpu::Device, mgpu::Stream& stream) {
    if (rank == 2) stream.enqueue([] { throw mgpu::Error(Errc::timeout, "stalled"); });
  }),
                     Errc::timeout, "rank 2 (host:2): stalled");

  std::atomic<int> calls{0};
  group.run([&](int, mgpu::Device, mgpu::Stream&) { ++calls; });  // the group is usable again
  CHECK(calls == 3);
}

TEST_CASE("run() from inside run() is rejected, not a deadlock", "[core][group]") {
  DeviceGroup group("host:2");
  REQUIRE_MGPU_ERROR(group.run([&](int, mgpu::Device, mgpu::Stream&) { group.run([](int, mgpu::Device, mgpu::Stream&) {}); }),
                     Errc::invalid_argument, "called from inside its own run()");
}

TEST_CASE("shard() gives views and scatter() copies each part to its rank", "[core][group]") {
  DeviceGroup group("host:3");
  Tensor batch = Tensor::empty({10, 4}, DType::float32, group.allocator(0));
  auto values = batch.host_span<float>();
  std::iota(values.begin(), values.end(), 0.0f);

  auto const views = group.shard(batch);
  REQUIRE(views.size() == 3);
  CHECK(views[0].dim(0) == 4);
  CHECK(views[2].dim(0) == 3);
  CHECK(views[1].shares_storage(batch));
  CHECK(views[1].host_span<float>()[0] == 16.0f);

  std::vector<double> const weights = {0.0, 1.0, 1.0};
  auto const parts = group.scatter(batch, weights);
  group.synchronize();
  REQUIRE(parts.size() == 3);
  CHECK(parts[0].dim(0) == 0);
  CHECK(parts[1].dim(0) == 5);
  CHECK(parts[2].device() == group.device(2));
  CHECK_FALSE(parts[2].shares_storage(batch));
  CHECK(parts[2].host_span<float>()[0] == 20.0f);
  CHECK(parts[2].host_span<float>().back() == 39.0f);
  CHECK(group.allocator(2).stats().allocated >= 5 * 4 * sizeof(float));
}

TEST_CASE("shard() and scatter() take row counts already split, and refuse counts that do not fit", "[core][group]") {
  DeviceGroup group("host:3");
  Tensor batch = Tensor::empty({10, 4}, DType::float32, group.allocator(0));
  auto values = batch.host_span<float>();
  std::iota(values.begin(), values.end(), 0.0f);
  std::vector<std::int64_t> const rows = {2, 0, 8};
  auto const views = group.shard(batch, rows);
  REQUIRE(views.size() == 3);
  CHECK(views[1].dim(0) == 0);
  CHECK(views[2].host_span<float>()[0] == 8.0f);
  auto const parts = group.scatter(batch, rows);
  group.synchronize();
  CHECK(parts[2].device() == group.device(2));
  CHECK(parts[2].host_span<float>()[0] == 8.0f);
  CHECK(parts[2].host_span<float>().back() == 39.0f);
  for (std::vector<std::int64_t> const& bad : {std::vector<std::int64_t>{5, 5}, {5, 6, -1}, {5, 5, 1}})
    REQUIRE_MGPU_ERROR((void)group.shard(batch, bad), Errc::invalid_argument, "expected 3 counts >= 0, one per rank, summing to 10");
}
