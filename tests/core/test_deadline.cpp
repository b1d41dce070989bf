// The library's deadline ($MGPU_COMM_TIMEOUT) and how messages write durations.
#include <mgpu/core/deadline.hpp>

#include <chrono>
#include <cstdlib>
#include <string>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/scoped_env.hpp"

using namespace std::chrono_literals;
using mgpu::Errc;
using mgpu::test::ScopedEnv;

TEST_CASE("The default deadline follows MGPU_COMM_TIMEOUT in seconds, rounded up to milliseconds", "[core][deadline]") {
  CHECK(std::string(mgpu::timeout_env_var) == "MGPU_COMM_TIMEOUT");
  ScopedEnv const env(mgpu::timeout_env_var, "30");
  CHECK(mgpu::default_timeout() == 30s);
  ::setenv(mgpu::timeout_env_var, "0.5", 1);
  CHECK(mgpu::default_timeout() == 500ms);
  ::setenv(mgpu::timeout_env_var, "0.0001", 1);  // 0.1 ms: never rounded down to no deadline
  CHECK(mgpu::default_timeout() == 1ms);
  ::setenv(mgpu::timeout_env_var, "", 1);
  CHECK(mgpu::default_timeout() == 300s);
  ::unsetenv(mgpu::timeout_env_var);
  CHECK(mgpu::default_timeout() == 300s);
}

TEST_CASE("A deadline that is not a positive number of seconds is refused, naming the value", "[core][deadline]") {
  for (char const* bad : {"0", "-2", "soon", "5s", "inf", "nan"}) {
    INFO("MGPU_COMM_TIMEOUT=" << bad);
    ScopedEnv const env(mgpu::timeout_env_var, bad);
    REQUIRE_MGPU_ERROR(mgpu::default_timeout(), Errc::invalid_argument,
                       "MGPU_COMM_TIMEOUT='" + std::string(bad) + "' (expected a positive number of seconds");
  }
}

TEST_CASE("Durations are written in seconds with one decimal from 1 s, else in whole milliseconds", "[core][deadline]") {
  CHECK(mgpu::format_duration(300s) == "300.0 s");
  CHECK(mgpu::format_duration(2500ms) == "2.5 s");
  CHECK(mgpu::format_duration(1s) == "1.0 s");
  CHECK(mgpu::format_duration(90min) == "5400.0 s");
  CHECK(mgpu::format_duration(999ms) == "999 ms");
  CHECK(mgpu::format_duration(250ms) == "250 ms");
  CHECK(mgpu::format_duration(1400us) == "1 ms");
  CHECK(mgpu::format_duration(0ns) == "0 ms");
}
