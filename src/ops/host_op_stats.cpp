// The calling thread's host time per op family (ops::host_op_seconds).
#include "ops/host_op_stats.hpp"

namespace mgpu::ops {
namespace host {
namespace {
thread_local HostOpSeconds thread_seconds;
}  // namespace

void add_op_seconds(HostOpFamily family, double seconds) noexcept {
  thread_seconds.seconds[static_cast<std::size_t>(family)] += seconds;
}

}  // namespace host

char const* host_op_family_name(HostOpFamily family) noexcept {
  switch (family) {
    case HostOpFamily::attention: return "attention";
    case HostOpFamily::norm: return "norm";
    case HostOpFamily::activation: return "activation";
    case HostOpFamily::loss: return "loss";
    case HostOpFamily::optimizer: return "optimizer";
    case HostOpFamily::embedding: return "embedding";
    case HostOpFamily::elementwise: return "elementwise";
  }
  return "unknown";
}

HostOpSeconds host_op_seconds() noexcept { return host::thread_seconds; }

}  // namespace mgpu::ops
