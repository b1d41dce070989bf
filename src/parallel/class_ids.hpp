// The check both executors make of a batch's labels before any device starts, so that a bad label
// is reported as itself rather than as the aborted transfers it would cause on other devices.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include <mgpu/core/error.hpp>
#include <mgpu/core/tensor.hpp>

namespace mgpu::parallel::detail {

/// Throws Error(invalid_argument), prefixed by `what`, unless `labels` is float32 and, where it is
/// in host memory, every value is a class id in [0, classes). Labels on a GPU are checked by the
/// loss inside the step.
inline void check_class_ids(Tensor const& labels, std::int64_t classes, std::string const& what) {
  if (labels.dtype() != DType::float32)
    throw Error(Errc::invalid_argument, what + ": labels of dtype " + std::string(to_string(labels.dtype())) + " (expected float32 class ids)");
  if (labels.device().kind != DeviceKind::host) return;
  auto const values = labels.host_span<float>();
  for (std::size_t row = 0; row < values.size(); ++row) {
    float const v = values[row];
    if (!(v >= 0 && v < static_cast<float>(classes)) || v != std::floor(v))
      throw Error(Errc::invalid_argument, what + ": label " + std::to_string(v) + " at row " + std::to_string(row) + " (expected a class id in [0, " +
                                              std::to_string(classes) + "))");
  }
}

}  // namespace mgpu::parallel::detail
