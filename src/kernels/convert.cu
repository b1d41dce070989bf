// Element-type conversion and fill kernels: the device side of convert_async() and fill_async().
#include <mgpu/core/detail/elementwise.hpp>

#include "core/cuda_backend.hpp"
#include "core/cuda_device_scope.hpp"
#include "kernels/elementwise.cuh"

namespace mgpu::detail::cuda {

void convert_async(int ordinal, void* dst, DType dst_type, void const* src, DType src_type, std::int64_t count,
                   void* stream) {
  DeviceScope scope(ordinal);
  visit_dtype(dst_type, [&]<class D>(std::type_identity<D>) {
    visit_dtype(src_type, [&]<class S>(std::type_identity<S>) {
      kernels::for_each_index(count, ConvertOp<D, S>{static_cast<D*>(dst), static_cast<S const*>(src)},
                              static_cast<cudaStream_t>(stream));
    });
  });
}

void fill_async(int ordinal, void* dst, DType type, float value, std::int64_t count, void* stream) {
  DeviceScope scope(ordinal);
  visit_dtype(type, [&]<class T>(std::type_identity<T>) {
    kernels::for_each_index(count, FillOp<T>{static_cast<T*>(dst), T(value)}, static_cast<cudaStream_t>(stream));
  });
}

}  // namespace mgpu::detail::cuda
