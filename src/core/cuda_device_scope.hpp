// DeviceScope: makes a GPU current for one call and restores the caller's device (CUDA builds only).
#pragma once

#include <cuda_runtime.h>

#include <mgpu/core/error.hpp>

namespace mgpu::detail::cuda {

// Makes `ordinal` current for the duration of a call and restores the previous device.
class DeviceScope {
 public:
  explicit DeviceScope(int ordinal) {
    MGPU_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != ordinal) MGPU_CUDA_CHECK(cudaSetDevice(ordinal));
  }
  ~DeviceScope() { MGPU_CUDA_CHECK_NO_THROW(cudaSetDevice(previous_)); }
  DeviceScope(DeviceScope const&) = delete;
  DeviceScope& operator=(DeviceScope const&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace mgpu::detail::cuda
