// The core on CUDA devices: streams, events, memory, copies and kernels, including several logical
// devices sharing one GPU. Runs only where a GPU is visible (see support/cuda_main.cpp).
#include <mgpu/core/device_group.hpp>
#include <mgpu/sched/live.hpp>

#include <mgpu/config.hpp>

#include <algorithm>
#include <atomic>
#include <future>
#include <numeric>
#include <stdexcept>
#include <thread>
#include <vector>

#if MGPU_CUDA_ENABLED
#include <cuda.h>
#include <cuda_runtime.h>
#endif

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

TEST_CASE("CUDA events time work: the parts add up to the whole", "[cuda]") {
  mgpu::DeviceGroup group("cuda:0");
  Tensor a = Tensor::empty({1 << 24}, DType::float32, group.allocator(0));
  auto& stream = group.stream(0);
  mgpu::Event start;
  mgpu::Event middle;
  mgpu::Event end;
  start.record(stream);
  fill_async(a, 1.0f, stream);
  middle.record(stream);
  fill_async(a, 2.0f, stream);
  fill_async(a, 3.0f, stream);
  end.record(stream);
  end.synchronize();
  double const first = mgpu::Event::elapsed_ms(start, middle);
  double const rest = mgpu::Event::elapsed_ms(middle, end);
  double const whole = mgpu::Event::elapsed_ms(start, end);
  CHECK(first > 0.0);  // 64 MiB written: microseconds at least, never nothing
  CHECK(rest > 0.0);
  CHECK(whole == Approx(first + rest).margin(0.01));
  CHECK(whole < 1000.0);
}

#if MGPU_CUDA_ENABLED
namespace {
// The calling thread's current CUDA context (nullptr when none is bound, or the query fails),
// through the driver entry point so the test needs no link to the driver library. No Catch
// assertions here: rank threads call it concurrently.
void* current_context() {
  using GetCurrent = CUresult (*)(CUcontext*);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess)
    return nullptr;
  CUcontext context = nullptr;
  if (reinterpret_cast<GetCurrent>(fn)(&context) != CUDA_SUCCESS) return nullptr;
  return context;
}
}  // namespace

TEST_CASE("run() binds each rank's thread to its GPU before the rank's function runs", "[cuda]") {
  // A thread that never selected a GPU has no current context, so even with every rank on GPU 0
  // a missing binding shows as nullptr; with two GPUs the ranks alternate between them.
  std::string const spec = mgpu::cuda_device_count() >= 2 ? "cuda:1,0,1,0" : "cuda:0,0,0,0";
  mgpu::DeviceGroup group(spec);
  auto const n = static_cast<std::size_t>(group.size());
  std::vector<void*> contexts(n, nullptr);
  std::vector<int> devices(n, -1);
  group.run([&](int rank, Device, mgpu::Stream&) {
    auto const r = static_cast<std::size_t>(rank);
    contexts[r] = current_context();  // before any runtime call on this thread
    if (cudaGetDevice(&devices[r]) != cudaSuccess) devices[r] = -2;
  });
  for (int r = 0; r < group.size(); ++r) {
    INFO("rank " << r << " on " << group.device(r).to_string());
    void* expected = nullptr;
    std::thread probe([&] {  // the primary context of the rank's GPU, seen from a fresh thread
      if (cudaSetDevice(group.device(r).index) == cudaSuccess) expected = current_context();
    });
    probe.join();
    CHECK(expected != nullptr);
    CHECK(contexts[static_cast<std::size_t>(r)] == expected);
    CHECK(devices[static_cast<std::size_t>(r)] == group.device(r).index);
  }
}
#endif

TEST_CASE("A freed GPU block is not reused before the work that uses it has run", "[cuda][sanitize]") {
  mgpu::DeviceGroup group("cuda:0,0");  // two streams on one GPU
  auto& allocator = group.allocator(0);
  constexpr std::int64_t n = 1 << 20;
  std::promise<void> gate;
  std::shared_future<void> const opened = gate.get_future().share();
  // Stream 0 is held by a host callback, so the fill below has surely not run when `a` goes.
  group.stream(0).enqueue([opened] { opened.wait(); });
  void* freed = nullptr;
  {
    Tensor a = Tensor::empty({n}, DType::float32, allocator);
    freed = a.data();
    fill_async(a, 7.0f, group.stream(0));
  }
  Tensor b = Tensor::empty({n}, DType::float32, allocator);  // same size class as `a`
  CHECK(b.data() != freed);
  CHECK(allocator.stats().cached >= mgpu::Allocator::block_size(n * 4));  // `a` waits in the cache
  gate.set_value();
  group.stream(0).synchronize();
  Tensor c = Tensor::empty({n}, DType::float32, allocator);  // the fill has run: `a`'s block is free
  CHECK(c.data() == freed);
  // Releasing the cache while blocks wait for their work returns them without a deadlock.
  allocator.release_cached();
  CHECK(allocator.stats().cached == 0);
}

TEST_CASE("A freed GPU block goes back to its own stream at once, to other streams after its work",
          "[cuda][sanitize]") {
  mgpu::DeviceGroup group("cuda:0,0");  // two streams on one GPU
  auto& allocator = group.allocator(0);
  mgpu::Stream& mine = group.stream(0);
  constexpr std::int64_t n = 1 << 20;
  std::size_t const bytes = n * sizeof(float);
  std::promise<void> gate;
  std::shared_future<void> const opened = gate.get_future().share();
  mine.enqueue([opened] { opened.wait(); });  // nothing on `mine` runs before the gate opens
  void* freed = nullptr;
  {
    Tensor a = Tensor::empty({n}, DType::float32, allocator);
    freed = a.data();
    fill_async(a, 7.0f, mine);  // records its use of `a` on `mine`
  }
  CHECK(allocator.allocate(bytes).data() != freed);                     // plain: only idle blocks
  mgpu::Buffer for_other = allocator.allocate(bytes, group.stream(1));  // another stream: after the fill
  CHECK(for_other.data() != freed);
  auto host = mgpu::Allocator::create(Device{DeviceKind::host, 0});
  Tensor result = Tensor::empty({n}, DType::float32, *host);
  {
    Tensor again = Tensor::empty({n}, DType::float32, allocator, mine);  // the same stream: at once
    CHECK(again.data() == freed);
    CHECK_FALSE(mine.query());
    fill_async(again, 3.0f, mine);  // runs after the first fill, in stream order: it wins
    mgpu::copy_async(result, again, mine);
  }
  gate.set_value();
  mine.synchronize();
  auto const values = result.host_span<float>();
  CHECK(std::all_of(values.begin(), values.end(), [](float v) { return v == 3.0f; }));
  CHECK(allocator.allocate(bytes, group.stream(1)).data() == freed);  // the work has run: anyone's
}

TEST_CASE("A CUDA stream waits on a host-recorded event without blocking CUDA's callback thread", "[cuda][sanitize]") {
  mgpu::DeviceGroup group("cuda:0,0");
  mgpu::Stream host_stream(Device{DeviceKind::host, 0});
  std::promise<void> gate;
  std::shared_future<void> const opened = gate.get_future().share();
  host_stream.enqueue([opened] { opened.wait(); });
  mgpu::Event host_done;
  host_done.record(host_stream);
  host_done.wait(group.stream(0));  // stream 0 waits for the host stream
  std::atomic<bool> other_ran{false};
  group.stream(0).enqueue([] {});
  group.stream(1).enqueue([&] { other_ran = true; });
  // Stream 1's callback runs while stream 0 still waits: the wait is on the GPU, not in a callback.
  group.stream(1).synchronize();
  CHECK(other_ran);
  CHECK_FALSE(group.stream(0).query());
  gate.set_value();
  group.stream(0).synchronize();
  host_stream.synchronize();
}

TEST_CASE("A CUDA stream skips host work after a failure and reports it once", "[cuda]") {
  mgpu::DeviceGroup group("cuda:0");
  auto& stream = group.stream(0);
  bool ran_after = false;
  stream.enqueue([] { throw std::runtime_error("broken"); });
  stream.enqueue([&] { ran_after = true; });
  REQUIRE_MGPU_ERROR(stream.synchronize(), mgpu::Errc::device, "broken");
  CHECK_FALSE(ran_after);
  stream.enqueue([&] { ran_after = true; });  // synchronize() cleared the failure
  stream.synchronize();
  CHECK(ran_after);
}

TEST_CASE("Re-recording a CUDA event on another GPU does not pull it from a host stream's wait", "[cuda]") {
  mgpu::DeviceGroup group(mgpu::cuda_device_count() >= 2 ? "cuda:0,1" : "cuda:0,0");
  mgpu::Stream host_stream(Device{DeviceKind::host, 0});
  Tensor a = Tensor::empty({1 << 22}, DType::float32, group.allocator(0));
  mgpu::Event event;
  for (int i = 0; i < 50; ++i) {
    fill_async(a, static_cast<float>(i), group.stream(0));
    // Alternating GPUs (with two) replaces the event; the host stream's wait keeps the old one.
    event.record(group.stream(i % 2));
    event.wait(host_stream);
  }
  host_stream.synchronize();  // throws if a wait synchronized on a destroyed event
  CHECK(event.query());
  group.synchronize();
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
