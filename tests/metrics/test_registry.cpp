// metrics::Registry's exposition (names, types, labels, busy ratios, counters), its use from two
// threads at once, the textfile written atomically, and the HTTP endpoint read over a socket.
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <mgpu/config.hpp>
#include <mgpu/metrics/exporter.hpp>
#include <mgpu/metrics/registry.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/temp_path.hpp"

namespace {

using mgpu::metrics::DeviceStep;
using mgpu::metrics::JobStep;
using mgpu::metrics::Registry;

std::vector<DeviceStep> two_devices(double compute0, double compute1) {
  std::vector<DeviceStep> d(2);
  d[0] = {.device = "host:0",
          .kind = "host",
          .world_rank = 0,
          .compute_seconds = compute0,
          .wait_seconds = 0.001,
          .rows = 3,
          .tokens = 48,
          .shard_weight = 0.75,
          .memory_in_use = 100,
          .memory_peak = 200,
          .memory_capacity = 1000};
  d[1] = {.device = "host:1",
          .kind = "host",
          .world_rank = 1,
          .compute_seconds = compute1,
          .wait_seconds = 0.002,
          .rows = 1,
          .tokens = 16,
          .shard_weight = 0.25,
          .memory_in_use = 50,
          .memory_peak = 60,
          .memory_capacity = std::nullopt};
  return d;
}

// The value of the one sample line that starts with `series` ("name{labels}").
double value_of(std::string const& text, std::string const& series) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line))
    if (line.starts_with(series + " ")) return std::stod(line.substr(series.size() + 1));
  FAIL("no sample " << series << " in\n" << text);
  return 0;
}

std::string read_file(std::filesystem::path const& p) {
  std::ifstream in(p);
  return {std::istreambuf_iterator<char>(in), {}};
}

}  // namespace

TEST_CASE("metrics: the exposition names every series with its type, labels and values", "[metrics]") {
  Registry registry("job \"a\"", {.dp = 2, .zero = 1}, 2);
  std::string const before = registry.exposition();
  CHECK(before.find("mgpu_layout_info{job=\"job \\\"a\\\"\",dp=\"2\",tp=\"1\",pp=\"1\",zero=\"1\"} 1\n") !=
        std::string::npos);
  CHECK(before.find("mgpu_device_busy_ratio") == std::string::npos);

  registry.record({.step = 1,
                   .loss = 2.5,
                   .seconds = 0.010,
                   .samples = 4,
                   .tokens = 64,
                   .learning_rate = 1e-3,
                   .loss_scale = std::nullopt,
                   .skipped = false},
                  two_devices(0.008, 0.004));
  registry.record({.step = 2,
                   .loss = 2.0,
                   .seconds = 0.030,
                   .samples = 4,
                   .tokens = 64,
                   .learning_rate = 1e-3,
                   .loss_scale = std::nullopt,
                   .skipped = true},
                  two_devices(0.006, 0.040));
  std::string const text = registry.exposition();
  std::string const d0 = "job=\"job \\\"a\\\"\",rank=\"0\",device=\"host:0\",kind=\"host\"";
  std::string const d1 = "job=\"job \\\"a\\\"\",rank=\"1\",device=\"host:1\",kind=\"host\"";
  CHECK(text.find("# TYPE mgpu_device_busy_ratio gauge\n") != std::string::npos);
  CHECK(text.find("# TYPE mgpu_tokens_total counter\n") != std::string::npos);
  CHECK(text.find("# HELP mgpu_device_memory_bytes ") != std::string::npos);
  CHECK(value_of(text, "mgpu_device_busy_ratio{" + d0 + "}") == Approx(0.2));
  CHECK(value_of(text, "mgpu_device_busy_ratio{" + d1 + "}") == 1.0);  // 40 ms in a 30 ms step: clamped
  CHECK(value_of(text, "mgpu_device_busy_window_ratio{" + d0 + "}") == Approx(0.014 / 0.040));
  CHECK(value_of(text, "mgpu_device_compute_seconds_total{" + d0 + "}") == Approx(0.014));
  CHECK(value_of(text, "mgpu_device_collective_wait_seconds_total{" + d1 + "}") == Approx(0.004));
  CHECK(value_of(text, "mgpu_device_memory_bytes{" + d0 + ",state=\"capacity\"}") == 1000);
  CHECK(value_of(text, "mgpu_device_memory_bytes{" + d0 + ",state=\"peak\"}") == 200);
  CHECK(text.find("mgpu_device_memory_bytes{" + d1 + ",state=\"capacity\"}") == std::string::npos);  // no limit
  CHECK(value_of(text, "mgpu_device_rows_total{" + d0 + "}") == 6);
  CHECK(value_of(text, "mgpu_device_tokens_total{" + d1 + "}") == 32);
  CHECK(value_of(text, "mgpu_device_shard_weight{" + d0 + "}") == 0.75);
  std::string const job = "job=\"job \\\"a\\\"\"";
  CHECK(value_of(text, "mgpu_step{" + job + "}") == 2);
  CHECK(value_of(text, "mgpu_loss{" + job + "}") == 2.0);
  CHECK(value_of(text, "mgpu_tokens_total{" + job + "}") == 128);
  CHECK(value_of(text, "mgpu_tokens_per_second{" + job + "}") == Approx(64 / 0.030));
  CHECK(value_of(text, "mgpu_skipped_steps_total{" + job + "}") == 1);
  CHECK(text.find("mgpu_loss_scale") == std::string::npos);
  CHECK(registry.steps_recorded() == 2);

  // The window spans 2 steps: a third step drops the first.
  registry.record({.step = 3, .seconds = 0.010, .samples = 4, .loss_scale = std::nullopt, .skipped = false},
                  two_devices(0.010, 0.0));
  CHECK(value_of(registry.exposition(), "mgpu_device_busy_window_ratio{" + d0 + "}") == Approx(0.016 / 0.040));
  CHECK(value_of(registry.exposition(), "mgpu_loss{" + job + "}") !=
        value_of(registry.exposition(), "mgpu_loss{" + job + "}"));  // NaN
}

TEST_CASE(
    "metrics: devices without a compute time have no busy ratio nor wait time, those without a wait no wait time, "
    "and a new device list starts again",
    "[metrics]") {
  Registry registry("j");
  std::vector<DeviceStep> d = two_devices(0, 0);
  d[0].compute_seconds.reset();
  d[1].compute_seconds.reset();
  registry.record({.step = 1, .seconds = 0.01, .loss_scale = std::nullopt, .skipped = false}, d);
  CHECK(registry.exposition().find("mgpu_device_busy_ratio") == std::string::npos);
  CHECK(registry.exposition().find("mgpu_device_collective_wait_seconds_total") == std::string::npos);
  CHECK(value_of(registry.exposition(),
                 "mgpu_device_rows_total{job=\"j\",rank=\"0\",device=\"host:0\",kind=\"host\"}") == 3);
  // A compute time without a wait (data parallelism on a GPU): a busy ratio, no wait.
  d[1].compute_seconds = 0.005;
  d[1].wait_seconds.reset();
  registry.record({.step = 2, .seconds = 0.01, .loss_scale = std::nullopt, .skipped = false}, d);
  CHECK(value_of(registry.exposition(),
                 "mgpu_device_busy_ratio{job=\"j\",rank=\"1\",device=\"host:1\",kind=\"host\"}") == Approx(0.5));
  CHECK(registry.exposition().find("mgpu_device_collective_wait_seconds_total") == std::string::npos);
  d.resize(1);
  d[0].device = "cuda:0";
  registry.record({.step = 3, .seconds = 0.01, .loss_scale = std::nullopt, .skipped = false}, d);
  CHECK(value_of(registry.exposition(),
                 "mgpu_device_rows_total{job=\"j\",rank=\"0\",device=\"cuda:0\",kind=\"host\"}") == 3);
  CHECK(registry.exposition().find("device=\"host:1\"") == std::string::npos);
  REQUIRE_MGPU_ERROR(Registry("j", {}, 0), mgpu::Errc::invalid_argument, "window_steps 0 (expected at least 1)");
}

TEST_CASE("metrics: record and exposition from two threads at once", "[metrics]") {
  Registry registry("j");
  std::thread reader([&] {
    for (int i = 0; i < 2000; ++i) CHECK(registry.exposition().starts_with("# HELP mgpu_layout_info"));
  });
  for (int i = 1; i <= 2000; ++i)
    registry.record(
        {.step = i, .seconds = 0.01, .samples = 1, .tokens = 2, .loss_scale = std::nullopt, .skipped = false},
        two_devices(0.005, 0.005));
  reader.join();
  CHECK(value_of(registry.exposition(), "mgpu_tokens_total{job=\"j\"}") == 4000);
}

TEST_CASE("metrics: the textfile is replaced whole, and a name not ending in .prom or an unwritable folder is refused",
          "[metrics]") {
  Registry registry("j");
  registry.record({.step = 1, .seconds = 0.01, .samples = 1, .loss_scale = std::nullopt, .skipped = false},
                  two_devices(0.005, 0.005));
  std::filesystem::path const dir = mgpu::test::temp_path("mgpu-metrics");
  std::filesystem::create_directories(dir);
  mgpu::metrics::write_textfile(registry, dir / "job.prom");
  CHECK(read_file(dir / "job.prom") == registry.exposition());
  CHECK(std::distance(std::filesystem::directory_iterator(dir), {}) == 1);  // no temporary file left
  REQUIRE_MGPU_ERROR(mgpu::metrics::write_textfile(registry, dir / "job.txt"), mgpu::Errc::invalid_argument,
                     "job.txt (expected a name ending in .prom");
  REQUIRE_MGPU_ERROR(mgpu::metrics::write_textfile(registry, dir / "missing" / "job.prom"), mgpu::Errc::io, "missing");
  std::filesystem::remove_all(dir);
}

TEST_CASE("metrics: the HTTP endpoint serves the exposition on 127.0.0.1 and refuses a bad port", "[metrics]") {
  Registry registry("j");
  REQUIRE_MGPU_ERROR(mgpu::metrics::HttpExporter(registry, "127.0.0.1", 70000), mgpu::Errc::invalid_argument,
                     "metrics port 70000 (expected 0 to 65535");
  if (!mgpu::built_with_metrics_http) {
    REQUIRE_MGPU_ERROR(mgpu::metrics::HttpExporter(registry, "127.0.0.1", 0), mgpu::Errc::invalid_argument,
                       "without cpp-httplib");
    return;
  }
  registry.record({.step = 7, .seconds = 0.01, .samples = 1, .loss_scale = std::nullopt, .skipped = false},
                  two_devices(0.005, 0.005));
  mgpu::metrics::HttpExporter exporter(registry, "127.0.0.1", 0);
  REQUIRE(exporter.port() > 0);
  REQUIRE_MGPU_ERROR(mgpu::metrics::HttpExporter(registry, "127.0.0.1", exporter.port()), mgpu::Errc::io,
                     "cannot listen on 127.0.0.1:" + std::to_string(exporter.port()));

  int const fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<std::uint16_t>(exporter.port()));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0);
  std::string const request = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  REQUIRE(::write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size()));
  std::string response;
  char buffer[4096];
  for (ssize_t n; (n = ::read(fd, buffer, sizeof buffer)) > 0;) response.append(buffer, static_cast<std::size_t>(n));
  ::close(fd);
  CHECK(response.starts_with("HTTP/1.1 200"));
  CHECK(response.find("Content-Type: text/plain; version=0.0.4") != std::string::npos);
  CHECK(response.ends_with(registry.exposition()));
}
