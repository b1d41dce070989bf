// Each executor's per-device times, reported to a metrics::Registry at the end of every step, on
// host devices: data parallelism's (the very numbers its rebalancing reads), the pipeline's
// (checked against its timeline's spans of the same actions) and tensor parallelism's (compute
// and time in collectives), each within the step's wall time measured around it; NVML's PCI bus
// ids and a library that cannot be loaded.
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <mgpu/core/device_group.hpp>
#include <mgpu/metrics/nvml.hpp>
#include <mgpu/metrics/registry.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/parallel/data_parallel.hpp>
#include <mgpu/parallel/tensor_parallel.hpp>
#include <mgpu/pipeline/pipeline.hpp>
#include <mgpu/trace/timeline.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/nn_env.hpp"

namespace {

using mgpu::Tensor;
using mgpu::metrics::DeviceTimes;
using mgpu::metrics::Registry;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// Float32 class ids 0..classes-1 in turn.
Tensor class_ids(mgpu::test::Env& env, std::int64_t rows, int classes) {
  Tensor y = Tensor::empty({rows}, mgpu::DType::float32, *env.allocator);
  for (std::int64_t i = 0; i < rows; ++i)
    y.host_span<float>()[static_cast<std::size_t>(i)] = static_cast<float>(i % classes);
  return y;
}

// The rank's reported times, which must be there, on its device, with a compute time in (0, wall].
DeviceTimes times_of(Registry const& registry, mgpu::DeviceGroup const& group, int rank, double wall) {
  INFO("rank " << rank);
  std::optional<DeviceTimes> const times = registry.reported_times(rank);
  REQUIRE(times.has_value());
  CHECK(times->rank == rank);
  CHECK(times->device == group.device(rank));
  CHECK(times->compute_seconds > 0);
  CHECK(times->compute_seconds <= wall);
  return *times;
}

}  // namespace

TEST_CASE("metrics: DataParallel reports each rank's compute and wait times, the ones rebalancing reads",
          "[metrics][dp]") {
  mgpu::test::Env env;
  Tensor const x = env.random({64, 8}, 3);
  Tensor const y = class_ids(env, 64, 10);
  mgpu::DeviceGroup group{"host:2"};
  auto const registry = std::make_shared<Registry>("dp");
  mgpu::parallel::DataParallelOptions options;
  options.metrics = registry;
  options.rebalance = true;
  std::vector<double> read_ms(2, -1);  // what rebalancing was given as each rank's measured time
  options.rebalance_time = [&](int rank, std::int64_t, double measured_ms) {
    read_ms[static_cast<std::size_t>(rank)] = measured_ms;
    return measured_ms;
  };
  mgpu::parallel::DataParallel dp(mgpu::nn::Sequential::mlp({8, 16, 10}), group, mgpu::optim::SGD({.lr = 0.01f}),
                                  options);
  for (int step = 0; step < 2; ++step) {
    auto const start = Clock::now();
    mgpu::parallel::DataParallelResult const result = dp.step(x, y);
    double const wall = seconds_since(start);
    for (int rank = 0; rank < 2; ++rank) {
      auto const r = static_cast<std::size_t>(rank);
      DeviceTimes const times = times_of(*registry, group, rank, wall);
      CHECK(times.compute_seconds * 1e3 == Approx(result.compute_ms[r]));
      CHECK(read_ms[r] == Approx(times.compute_seconds * 1e3));
      REQUIRE(times.wait_seconds.has_value());  // host devices: measured
      CHECK(*times.wait_seconds * 1e3 == Approx(result.wait_ms[r]));
      CHECK(*times.wait_seconds < wall);
    }
    registry->record({.step = step + 1, .seconds = wall, .loss_scale = std::nullopt, .skipped = false}, {});
    CHECK_FALSE(registry->reported_times(0).has_value());  // recorded: the next step reports anew
  }
}

TEST_CASE("metrics: the pipeline reports each device's compute and transfer time, as its timeline's spans add up",
          "[metrics][pipeline]") {
  mgpu::test::Env env;
  mgpu::nn::Sequential const model = mgpu::nn::Sequential::mlp({6, 48, 48, 48, 3});
  auto const points = model.cut_points();
  std::vector<std::size_t> const cuts{points.front(), points[points.size() / 2], points.back()};
  mgpu::DeviceGroup group{"host:2"};
  auto const registry = std::make_shared<Registry>("pp");
  auto const timeline = std::make_shared<mgpu::trace::Timeline>();
  mgpu::pipeline::Executor executor(
      model, group, cuts, mgpu::pipeline::one_f_one_b(2, 4),
      [] { return std::make_unique<mgpu::optim::SGD>(mgpu::optim::SgdOptions{.lr = 0.01f}); },
      {.seed = 3, .timeline = timeline, .metrics = registry});
  Tensor const x = env.random({32, 6}, 5);
  Tensor const y = class_ids(env, 32, 3);
  (void)executor.step(x, y);  // warm up the allocators
  timeline->enable();
  auto const start = Clock::now();
  (void)executor.step(x, y);
  double const wall = seconds_since(start);
  timeline->enable(false);
  // The timeline's spans of the same actions: compute lane for forward, backward and the loss;
  // communication lane for sends, receives and sums.
  std::vector<double> span_compute(2, 0), span_wait(2, 0);
  std::vector<int> spans(2, 0);
  for (mgpu::trace::Span const& s : timeline->spans()) {
    double const seconds = static_cast<double>(s.end_ns - s.begin_ns) * 1e-9;
    (s.lane == mgpu::trace::compute ? span_compute : span_wait)[static_cast<std::size_t>(s.rank)] += seconds;
    ++spans[static_cast<std::size_t>(s.rank)];
  }
  for (int rank = 0; rank < 2; ++rank) {
    auto const r = static_cast<std::size_t>(rank);
    DeviceTimes const times = times_of(*registry, group, rank, wall);
    REQUIRE(times.wait_seconds.has_value());
    CHECK(*times.wait_seconds > 0);  // every device sends or receives
    CHECK(times.compute_seconds + *times.wait_seconds <= wall);
    INFO("rank " << rank << ": events " << times.compute_seconds << " s computing, " << *times.wait_seconds
                 << " s waiting; timeline " << span_compute[r] << " s, " << span_wait[r] << " s in " << spans[r]
                 << " spans");
    // The events enclose the timeline's markers of each action, so they measure no less; the sum
    // stays within the step (above). An upper bound per region would depend on the scheduler: a
    // thread preempted between an event and the timeline's marker adds its wait to the event's.
    CHECK(times.compute_seconds >= span_compute[r] * 0.99);
    CHECK(*times.wait_seconds >= span_wait[r] * 0.99);
  }
}

TEST_CASE("metrics: TensorParallel reports each rank's compute and time in collectives within the step",
          "[metrics][tp]") {
  mgpu::test::Env env;
  mgpu::nn::GptConfig const config{.vocab = 64, .block_size = 16, .n_layer = 2, .n_head = 4, .n_embd = 32};
  mgpu::DeviceGroup group{"host:2"};
  auto const registry = std::make_shared<Registry>("tp");
  mgpu::parallel::TensorParallel tp(group, mgpu::nn::gpt(config), {.seed = 5, .metrics = registry});
  mgpu::test::TokenBatch const batch = mgpu::test::rule_batch(env, 3, config.block_size, config.vocab, 7);
  (void)tp.step(batch.ids, batch.targets);
  auto const start = Clock::now();
  (void)tp.step(batch.ids, batch.targets);
  double const wall = seconds_since(start);
  for (int rank = 0; rank < 2; ++rank) {
    DeviceTimes const times = times_of(*registry, group, rank, wall);
    REQUIRE(times.wait_seconds.has_value());
    CHECK(*times.wait_seconds > 0);  // every block all-reduces over the two ranks
    CHECK(times.compute_seconds + *times.wait_seconds <= wall);
  }
}

TEST_CASE("metrics: reported times are refused when negative, and kept per rank until the next record", "[metrics]") {
  Registry registry("j");
  DeviceTimes const t{.rank = 1, .device = {mgpu::DeviceKind::host, 1}, .compute_seconds = 0.5, .wait_seconds = 0.25};
  registry.report_times({&t, 1});
  CHECK_FALSE(registry.reported_times(0).has_value());
  REQUIRE(registry.reported_times(1).has_value());
  CHECK(registry.reported_times(1)->compute_seconds == 0.5);
  DeviceTimes bad = t;
  bad.compute_seconds = -1;
  REQUIRE_MGPU_ERROR(registry.report_times({&bad, 1}), mgpu::Errc::invalid_argument, "compute -1");
  bad = t;
  bad.rank = -2;
  REQUIRE_MGPU_ERROR(registry.report_times({&bad, 1}), mgpu::Errc::invalid_argument, "rank -2");
  CHECK(registry.reported_times(1)->wait_seconds == 0.25);  // a refused report changes nothing
}

TEST_CASE("metrics: NVML's PCI bus ids, from CUDA's spelling or its own, and bad ones refused", "[metrics][nvml]") {
  using mgpu::metrics::nvml_pci_bus_id;
  CHECK(nvml_pci_bus_id("0000:3b:00.0") == "00000000:3B:00.0");      // cudaDeviceGetPCIBusId's
  CHECK(nvml_pci_bus_id("00000000:3B:00.0") == "00000000:3B:00.0");  // NVML's own
  CHECK(nvml_pci_bus_id("0001:af:1f.7") == "00000001:AF:1F.7");
  CHECK(nvml_pci_bus_id("3b:00.0") == "00000000:3B:00.0");  // no domain: 0
  for (char const* bad :
       {"", "3b", "3b:00", "zz:00.0", "0000:3b:00.8", "0000:3b:20.0", "0000:3b:00.0:1", "0000:3b:00.", "123:00.0"})
    REQUIRE_MGPU_ERROR(nvml_pci_bus_id(bad), mgpu::Errc::invalid_argument,
                       "PCI bus id '" + std::string(bad) + "' (expected [domain:]bus:device.function");
}

TEST_CASE("metrics: NVML whose library cannot be loaded is not available, says why, and reads nothing",
          "[metrics][nvml]") {
  mgpu::metrics::Nvml const nvml("libmgpu-test-no-such-nvml.so.1");
  CHECK_FALSE(nvml.available());
  CHECK_THAT(nvml.reason(), MGPU_TEST_CONTAINS("libmgpu-test-no-such-nvml.so.1"));
  CHECK_THAT(nvml.reason(), MGPU_TEST_CONTAINS("GPU utilisation is not exported"));
  CHECK_FALSE(nvml.busy_ratio("0000:3b:00.0").has_value());
  REQUIRE_MGPU_ERROR((void)nvml.busy_ratio("gpu0"), mgpu::Errc::invalid_argument, "PCI bus id 'gpu0'");
}

TEST_CASE("metrics: a GPU's NVML utilisation is exported for the devices that have one", "[metrics][nvml]") {
  Registry registry("j");
  std::vector<mgpu::metrics::DeviceStep> devices(2);
  devices[0] = {.device = "cuda:0", .kind = "cuda", .world_rank = 0, .gpu_utilization = 0.75};
  devices[1] = {.device = "host:0", .kind = "host", .world_rank = 1};
  registry.record({.step = 1, .seconds = 0.01, .loss_scale = std::nullopt, .skipped = false}, devices);
  std::string const text = registry.exposition();
  CHECK(text.find("# TYPE mgpu_device_gpu_utilization_ratio gauge\n") != std::string::npos);
  CHECK(text.find("mgpu_device_gpu_utilization_ratio{job=\"j\",rank=\"0\",device=\"cuda:0\",kind=\"cuda\"} 0.75\n") !=
        std::string::npos);
  CHECK(text.find("mgpu_device_gpu_utilization_ratio{job=\"j\",rank=\"1\"") == std::string::npos);
}
