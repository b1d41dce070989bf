// The library's deadline ($MGPU_COMM_TIMEOUT) and how messages write durations.
#pragma once

#include <chrono>
#include <string>

namespace mgpu {

/// The environment variable that sets the default deadline, in seconds (e.g. "30" or "0.5").
inline constexpr char const timeout_env_var[] = "MGPU_COMM_TIMEOUT";

/// $MGPU_COMM_TIMEOUT seconds when set, else 300 s: how long communicators wait for other ranks
/// and the allocator for queued GPU work. Throws Error(invalid_argument) unless a positive number.
std::chrono::milliseconds default_timeout();

/// A duration as error messages write it: one decimal in seconds from 1 s ("5.0 s", "2.5 s"),
/// else whole milliseconds ("250 ms").
std::string format_duration(std::chrono::nanoseconds duration);

}  // namespace mgpu
