// Collective faults: a rank that throws, stalls, fails on its stream or passes mismatched arguments
// makes every rank fail within the deadline, never hang; bad arguments are rejected.
#include <mgpu/comm/communicator.hpp>

#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "support/catch.hpp"
#include "support/expect_error.hpp"

using mgpu::DType;
using mgpu::Errc;
using mgpu::Tensor;
using mgpu::comm::ReduceOp;
using namespace std::chrono_literals;

namespace {
struct Fixture {
  explicit Fixture(int n, std::chrono::milliseconds timeout = 20s)
      : group("host:" + std::to_string(n)), comm(mgpu::comm::make_communicator(group, {.timeout = timeout})) {
    for (int r = 0; r < n; ++r) buffers.push_back(Tensor::empty({64}, DType::float32, group.allocator(r)));
  }
  mgpu::DeviceGroup group;
  std::unique_ptr<mgpu::comm::Communicator> comm;
  std::vector<Tensor> buffers;
};

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}
}  // namespace

TEST_CASE("A rank that throws makes every rank fail at once, not at the deadline", "[comm][faults]") {
  Fixture f(4, 30s);
  auto const start = std::chrono::steady_clock::now();
  std::atomic<int> communication_errors{0};
  REQUIRE_MGPU_ERROR(f.group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
    if (rank == 2) throw std::runtime_error("rank two broke");
    try {  // the others fail at the call or at synchronize, depending on when the abort lands
      f.comm->all_reduce(rank, f.buffers[static_cast<std::size_t>(rank)], f.buffers[static_cast<std::size_t>(rank)], ReduceOp::sum, stream);
      stream.synchronize();
    } catch (mgpu::Error const& e) {
      if (e.category() == Errc::communication) ++communication_errors;
      throw;
    }
  }),
                     Errc::device, "rank 2 (host:2): rank two broke");
  CHECK(seconds_since(start) < 10.0);
  CHECK(communication_errors == 3);
  CHECK(f.comm->aborted());
  REQUIRE_MGPU_ERROR(f.comm->barrier(0, f.group.stream(0)), Errc::communication, "aborted: rank 2 failed: rank two broke");
  REQUIRE_MGPU_ERROR(f.comm->finalize(), Errc::communication, "rank 2 failed");
}

TEST_CASE("A rank that stalls makes the others time out naming it", "[comm][faults]") {
  Fixture f(4, 300ms);
  auto const start = std::chrono::steady_clock::now();
  std::vector<double> failed_after(4, -1.0);
  try {
    f.group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
      if (rank == 3) std::this_thread::sleep_for(3000ms);
      f.comm->all_reduce(rank, f.buffers[static_cast<std::size_t>(rank)], f.buffers[static_cast<std::size_t>(rank)], ReduceOp::sum, stream);
      try {
        stream.synchronize();
      } catch (...) {
        failed_after[static_cast<std::size_t>(rank)] = seconds_since(start);
        throw;
      }
    });
    FAIL("run() should have thrown");
  } catch (mgpu::Error const& e) {
    INFO(e.what());
    // The rank that timed out reports Errc::timeout; ranks woken by its abort report
    // Errc::communication quoting it. Either may be the first error run() sees.
    CHECK((e.category() == Errc::timeout || e.category() == Errc::communication));
    CHECK_THAT(std::string(e.what()), MGPU_TEST_CONTAINS("all_reduce #0 waited"));
    CHECK_THAT(std::string(e.what()), MGPU_TEST_CONTAINS("for rank(s) 3"));
  }
  for (int r = 0; r < 3; ++r) {
    CHECK(failed_after[static_cast<std::size_t>(r)] >= 0.25);
    CHECK(failed_after[static_cast<std::size_t>(r)] < 2.5);  // at the deadline, not when rank 3 arrives
  }
}

TEST_CASE("A failure earlier on a rank's stream aborts the collective for everyone", "[comm][faults]") {
  Fixture f(3);
  std::vector<std::string> errors(3);
  try {
    f.group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
      if (rank == 1) stream.enqueue([] { throw std::runtime_error("kernel failed"); });
      try {
        f.comm->all_reduce(rank, f.buffers[static_cast<std::size_t>(rank)], f.buffers[static_cast<std::size_t>(rank)], ReduceOp::sum, stream);
        stream.synchronize();
      } catch (mgpu::Error const& e) {
        errors[static_cast<std::size_t>(rank)] = e.what();
        throw;
      }
    });
    FAIL("run() should have thrown");
  } catch (mgpu::Error const&) {
  }
  CHECK_THAT(errors[1], MGPU_TEST_CONTAINS("kernel failed"));
  CHECK_THAT(errors[0], MGPU_TEST_CONTAINS("rank 1 all_reduce #0 was skipped because earlier work on the rank's stream failed"));
  CHECK_THAT(errors[2], MGPU_TEST_CONTAINS("communication"));
  CHECK(f.comm->aborted());
}

TEST_CASE("Arguments that differ across ranks are reported on every rank", "[comm][faults]") {
  Fixture f(3);
  Tensor shorter = Tensor::empty({63}, DType::float32, f.group.allocator(1));
  std::atomic<int> reported{0};
  REQUIRE_MGPU_ERROR(f.group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
    Tensor const& t = rank == 1 ? shorter : f.buffers[static_cast<std::size_t>(rank)];
    f.comm->all_reduce(rank, t, t, ReduceOp::sum, stream);
    try {
      stream.synchronize();
    } catch (mgpu::Error const& e) {
      if (std::string(e.what()).find("element count 63") != std::string::npos) ++reported;
      throw;
    }
  }),
                     Errc::invalid_argument, "passed element count");
  CHECK(reported >= 2);

  Fixture g(2);
  Tensor half = Tensor::empty({64}, DType::float16, g.group.allocator(1));
  REQUIRE_MGPU_ERROR(g.group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
    Tensor const& t = rank == 1 ? half : g.buffers[0];
    g.comm->broadcast(rank, t, 0, stream);
  }),
                     Errc::invalid_argument, "dtype");
}

TEST_CASE("Bad arguments are rejected at the call and abort the communicator", "[comm][faults]") {
  Fixture f(2);
  auto& s = f.group.stream(0);
  Tensor const& t = f.buffers[0];
  Tensor small = Tensor::empty({10}, DType::float32, f.group.allocator(0));
  REQUIRE_MGPU_ERROR(f.comm->all_reduce(2, t, t, ReduceOp::sum, s), Errc::invalid_argument, "expected a rank in [0, 2)");
  REQUIRE_MGPU_ERROR(f.comm->all_reduce(0, t, small, ReduceOp::sum, s), Errc::invalid_argument, "recv has 10 elements (expected 64");
  CHECK(f.comm->aborted());

  Fixture g(2);
  REQUIRE_MGPU_ERROR(g.comm->broadcast(0, g.buffers[0], 5, g.group.stream(0)), Errc::invalid_argument, "root 5");
  Fixture h(2);
  REQUIRE_MGPU_ERROR(h.comm->send(0, h.buffers[0], 0, h.group.stream(0)), Errc::invalid_argument, "peer 0 (expected another rank");
  Fixture i(2);
  REQUIRE_MGPU_ERROR(i.comm->reduce_scatter(0, i.buffers[0], i.buffers[0], ReduceOp::sum, i.group.stream(0)), Errc::invalid_argument,
                     "send has 64 elements (expected 2 ranks x 64 recv elements = 128)");
  Fixture j(2);
  REQUIRE_MGPU_ERROR(j.comm->all_reduce(0, j.buffers[0], Tensor{}, ReduceOp::sum, j.group.stream(0)), Errc::invalid_argument,
                     "recv is an undefined tensor");
  REQUIRE_MGPU_ERROR(j.comm->group_end(0), Errc::invalid_argument, "without group_start");
}

TEST_CASE("An unmatched send times out instead of hanging, or is reported by finalize if it was eager", "[comm][faults]") {
  Fixture f(2, 200ms);
  Tensor const large = Tensor::empty({(std::int64_t{4} << 20) / 4 + 1}, DType::float32, f.group.allocator(0));  // past the eager limit
  REQUIRE_MGPU_ERROR(f.group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
    if (rank == 0) f.comm->send(rank, large, 1, stream);
  }),
                     Errc::timeout, "send #0 to rank 1 waited");

  Fixture g(3, 200ms);  // a small send completes at once; finalize finds it was never received
  g.group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
    if (rank == 2) g.comm->send(rank, g.buffers[2], 1, stream);
  });
  REQUIRE_MGPU_ERROR(g.comm->finalize(), Errc::communication, "rank 2 sent 1 message(s) to rank 1 that it never received");
}

TEST_CASE("Backend choice and the deadline's environment variable", "[comm]") {
  mgpu::DeviceGroup group("host:2");
  CHECK(mgpu::comm::choose_backend(group) == mgpu::comm::Backend::host);
  REQUIRE_MGPU_ERROR(mgpu::comm::make_communicator(group, {.backend = mgpu::comm::Backend::nccl}), Errc::invalid_argument,
                     "expected the host backend for host devices");
  ::setenv(mgpu::comm::timeout_env_var, "2.5", 1);
  CHECK(mgpu::comm::default_timeout() == 2500ms);
  CHECK(mgpu::comm::make_communicator(group)->timeout() == 2500ms);
  ::setenv(mgpu::comm::timeout_env_var, "soon", 1);
  REQUIRE_MGPU_ERROR(mgpu::comm::default_timeout(), Errc::invalid_argument, "MGPU_COMM_TIMEOUT='soon'");
  ::unsetenv(mgpu::comm::timeout_env_var);
  CHECK(mgpu::comm::default_timeout() == 300s);
}
