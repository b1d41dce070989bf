// The core on CUDA devices: streams, events, memory, copies and kernels, including several logical
// devices sharing one GPU. Runs only where a GPU is visible (see support/cuda_main.cpp).
#include <mgpu/core/device_group.hpp>
#include <mgpu/sched/live.hpp>

#include <numeric>

#include "support/catch.hpp"
#include "support/expect_error.hpp"

using mgpu::Device;
using mgpu::DeviceKind;
using mgpu::DType;
using mgpu::Tensor;

TEST_CASE("CUDA properties and peer access", "[cuda]") {
  auto const props = mgpu::properties({DeviceKind::cuda, 0});
  CHECK(props.memory_bytes > (std::size_t{1} << 30));
  CHECK(props.compute_units > 0);
  CHECK(props.throughput_gflops > 100);
  auto const peer = mgpu::peer_access_matrix(mgpu::parse_devices("cuda:0,0"));
  CHECK(peer[0][1]);
}

TEST_CASE("Round trip host -> GPU -> GPU -> host, pageable and pinned", "[cuda]") {
  mgpu::DeviceGroup group("cuda:0,0");  // two logical devices on one GPU
  auto host = mgpu::Allocator::create(Device{DeviceKind::host, 0});
  Tensor src = Tensor::empty({1 << 20}, DType::float32, *host);
  auto s = src.host_span<float>();
  std::iota(s.begin(), s.end(), 0.5f);
  Tensor pinned = Tensor::empty_pinned({1 << 20}, DType::float32, *host);
  REQUIRE(pinned.pinned());
  Tensor a = Tensor::empty({1 << 20}, DType::float32, group.allocator(0));
  Tensor b = Tensor::empty({1 << 20}, DType::float32, group.allocator(1));
  Tensor out = Tensor::empty({1 << 20}, DType::float32, *host);
  copy_async(a, src, group.stream(0));
  mgpu::Event copied;
  copied.record(group.stream(0));
  copied.wait(group.stream(1));
  copy_async(b, a, group.stream(1));
  copy_async(pinned, b, group.stream(1));
  copy_async(out, b, group.stream(1));
  group.synchronize();
  auto o = out.host_span<float>();
  auto p = pinned.host_span<float>();
  for (std::size_t i = 0; i < o.size(); ++i) {
    REQUIRE(o[i] == s[i]);
    REQUIRE(p[i] == s[i]);
  }
}

TEST_CASE("Conversion and fill kernels match the host element code", "[cuda]") {
  mgpu::DeviceGroup group("cuda:0");
  auto host = mgpu::Allocator::create(Device{DeviceKind::host, 0});
  constexpr std::int64_t n = 100003;
  Tensor src = Tensor::empty({n}, DType::float32, *host);
  auto s = src.host_span<float>();
  for (std::int64_t i = 0; i < n; ++i) s[static_cast<std::size_t>(i)] = static_cast<float>(i) * 0.37f - 1000.0f;
  Tensor d32 = Tensor::empty({n}, DType::float32, group.allocator(0));
  Tensor d16 = Tensor::empty({n}, DType::float16, group.allocator(0));
  Tensor dbf = Tensor::empty({n}, DType::bfloat16, group.allocator(0));
  Tensor h16 = Tensor::empty({n}, DType::float16, *host);
  Tensor hbf = Tensor::empty({n}, DType::bfloat16, *host);
  auto& stream = group.stream(0);
  copy_async(d32, src, stream);
  convert_async(d16, d32, stream);
  convert_async(dbf, d32, stream);
  copy_async(h16, d16, stream);
  copy_async(hbf, dbf, stream);
  stream.synchronize();
  for (std::int64_t i = 0; i < n; ++i) {
    auto const k = static_cast<std::size_t>(i);
    REQUIRE(h16.host_span<mgpu::float16>()[k].bits == mgpu::float_to_float16_bits(s[k]));
    REQUIRE(hbf.host_span<mgpu::bfloat16>()[k].bits == mgpu::float_to_bfloat16_bits(s[k]));
  }
  fill_async(d16, 2.5f, stream);
  copy_async(h16, d16, stream);
  stream.synchronize();
  for (auto v : h16.host_span<mgpu::float16>()) REQUIRE(static_cast<float>(v) == 2.5f);
}

TEST_CASE("GPU memory limit and out-of-memory report", "[cuda]") {
  mgpu::DeviceGroup group("cuda:0");
  group.allocator(0).set_limit(std::size_t{64} << 20);
  mgpu::Buffer a = group.allocator(0).allocate(std::size_t{48} << 20);
  REQUIRE_MGPU_ERROR(group.allocator(0).allocate(std::size_t{32} << 20), mgpu::Errc::out_of_memory, "out of memory on cuda:0");
  group.allocator(0).set_limit(std::nullopt);
  REQUIRE_MGPU_ERROR(group.allocator(0).allocate(std::size_t{1} << 50), mgpu::Errc::out_of_memory, "free on the GPU");
}

TEST_CASE("CUDA events time work and run() binds each rank to its GPU", "[cuda]") {
  mgpu::DeviceGroup group("cuda:0,0,0,0");
  std::vector<Tensor> parts;
  std::vector<double> elapsed(static_cast<std::size_t>(group.size()), -1.0);
  for (int r = 0; r < group.size(); ++r) parts.push_back(Tensor::empty({1 << 22}, DType::float32, group.allocator(r)));
  group.run([&](int rank, Device, mgpu::Stream& stream) {
    mgpu::Event start;
    mgpu::Event end;
    start.record(stream);
    fill_async(parts[static_cast<std::size_t>(rank)], static_cast<float>(rank), stream);
    end.record(stream);
    end.synchronize();
    elapsed[static_cast<std::size_t>(rank)] = mgpu::Event::elapsed_ms(start, end);
  });
  for (double ms : elapsed) CHECK(ms >= 0.0);
  auto host = mgpu::Allocator::create(Device{DeviceKind::host, 0});
  Tensor out = Tensor::empty({1 << 22}, DType::float32, *host);
  copy_async(out, parts[3], group.stream(3));
  group.stream(3).synchronize();
  CHECK(out.host_span<float>()[12345] == 3.0f);
}

TEST_CASE("Scheduler node state from logical devices sharing one GPU", "[cuda][sched]") {
  mgpu::DeviceGroup group("cuda:0,0");
  auto const bw = mgpu::sched::measure_peer_bandwidth(group, std::size_t{64} << 20, 3);
  CHECK(bw[0][1] > 50.0);  // GB/s within one GPU's memory
  auto const node = mgpu::sched::node_state(group);
  auto const total = static_cast<double>(mgpu::properties({DeviceKind::cuda, 0}).memory_bytes);
  CHECK(node.devices[0].capacity_bytes == Approx(total / 2));
  CHECK(node.devices[0].links[1] == 1.0);
  CHECK(node.devices[0].type != "host");
  CHECK_FALSE(node.devices[0].type.empty());
}
