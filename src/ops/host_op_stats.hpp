// The host op time counts (ops::host_op_seconds): each op's host work runs inside timed().
// Internal: not installed.
#pragma once

#include <chrono>

#include <mgpu/ops/ops.hpp>

namespace mgpu::ops::host {

/// Adds `seconds` to the calling thread's total for `family`.
void add_op_seconds(HostOpFamily family, double seconds) noexcept;

/// Runs fn() and adds the time it took to the calling thread's total for `family`.
template <class Fn>
void timed(HostOpFamily family, Fn const& fn) {
  auto const start = std::chrono::steady_clock::now();
  fn();
  add_op_seconds(family, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
}

}  // namespace mgpu::ops::host
