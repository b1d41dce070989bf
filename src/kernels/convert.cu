// Element-type conversion and fill kernels: the device side of convert_async() and fill_async().
#include <mgpu/core/detail/elementwise.hpp>

#include "core/cuda_backend.hpp"
#include "core/cuda_device_scope.hpp"
#include "kernels/elementwise.cuh"

namespace mgpu::detail::cuda {

void convert_async(int ordinal, void* dst, DType dst_type, void const* src, DType src_type, std::int64_t count,
                   void* stream) {
  DeviceScope scope(ordinal);
  kernels::for_each_index(count, ConvertOp{dst, dst_type, src, src_type}, static_cast<cudaStream_t>(stream));
}

void fill_async(int ordinal, void* dst, DType type, float value, std::int64_t count, void* stream) {
  DeviceScope scope(ordinal);
  kernels::for_each_index(count, FillOp{dst, type, value}, static_cast<cudaStream_t>(stream));
}

}  // namespace mgpu::detail::cuda
