// The smoke run of the benchmarks (MGPU_BENCH_QUICK=1, which CI sets through scripts/bench.sh):
// every benchmark and baseline runs and reports, briefly; its figures are not measurements.
// Standard library only: the baselines (MPI, Gloo) include it too.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string_view>

namespace bench {

inline bool quick() {
  static bool const on = [] {
    char const* value = std::getenv("MGPU_BENCH_QUICK");
    return value != nullptr && *value != '\0' && std::string_view(value) != "0";
  }();
  return on;
}
// A benchmark's minimum time in seconds, and its fixed iteration count, as registered: capped in a
// smoke run.
inline double min_time(double seconds) { return quick() ? std::min(seconds, 0.05) : seconds; }
inline std::int64_t iterations(std::int64_t count) { return quick() ? std::min<std::int64_t>(count, 2) : count; }
// A baseline's repetitions of one size (about 64 MiB of traffic in all, 2 to 200): one in a smoke run.
inline int baseline_repetitions(std::int64_t bytes) {
  return quick() ? 1 : static_cast<int>(std::clamp<std::int64_t>((std::int64_t{64} << 20) / std::max<std::int64_t>(bytes, 1), 2, 200));
}
// A baseline's timed rounds of one size, whose median it reports: 5, one in a smoke run.
inline int baseline_rounds() { return quick() ? 1 : 5; }

}  // namespace bench
