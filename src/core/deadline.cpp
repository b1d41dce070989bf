// The default deadline ($MGPU_COMM_TIMEOUT) and durations in messages.
#include <mgpu/core/deadline.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <mgpu/core/error.hpp>

namespace mgpu {

std::chrono::milliseconds default_timeout() {
  char const* text = std::getenv(timeout_env_var);
  if (text == nullptr || *text == '\0') return std::chrono::seconds(300);
  char* end = nullptr;
  double const seconds = std::strtod(text, &end);
  if (end == text || *end != '\0' || !std::isfinite(seconds) || seconds <= 0)
    throw Error(Errc::invalid_argument, std::string(timeout_env_var) + "='" + text +
                                            "' (expected a positive number of seconds, e.g. 30 or 0.5)");
  return std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(seconds * 1000.0)));
}

std::string format_duration(std::chrono::nanoseconds duration) {
  char text[32];
  double const seconds = std::chrono::duration<double>(duration).count();
  if (seconds >= 1.0) {
    std::snprintf(text, sizeof text, "%.1f s", seconds);
  } else {
    std::snprintf(text, sizeof text, "%.0f ms", seconds * 1e3);
  }
  return text;
}

}  // namespace mgpu
