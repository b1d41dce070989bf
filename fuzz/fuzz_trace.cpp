// Fuzz target: read_trace_csv (src/cluster/simulator.cpp), the trace reader of schedule_jobs
// --trace, with the default columns and with an end-time column instead of a duration.
#include <mgpu/cluster/simulator.hpp>

#include "fuzz_support.hpp"

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  if (size < 1) return 0;
  mgpu::cluster::TraceColumns columns;
  if (data[0] & 1) columns.end = "end_time";
  auto const path = mgpu::fuzz::write_input("trace", data + 1, size - 1);
  mgpu::fuzz::expect_load_or_error(path.string(), [&] { (void)mgpu::cluster::read_trace_csv(path, columns); });
  return 0;
}
