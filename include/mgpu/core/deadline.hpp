// The library's deadline: how long a wait for other ranks or for queued GPU work may last
// ($MGPU_COMM_TIMEOUT), and how durations are written in the messages that report it.
#pragma once

#include <chrono>
#include <string>

namespace mgpu {

/// The environment variable that sets the default deadline, in seconds (e.g. "30" or "0.5").
inline constexpr char const timeout_env_var[] = "MGPU_COMM_TIMEOUT";

/// The default deadline: $MGPU_COMM_TIMEOUT seconds when set, else 300 s. Communicators wait at
/// most this long for the other ranks (unless given their own), and the caching allocator for
/// blocks still used by queued GPU work. Throws Error(invalid_argument) for a value that is not a
/// positive number.
std::chrono::milliseconds default_timeout();

/// A duration as error messages write it: one decimal in seconds from 1 s ("5.0 s", "2.5 s"),
/// else whole milliseconds ("250 ms").
std::string format_duration(std::chrono::nanoseconds duration);

}  // namespace mgpu
