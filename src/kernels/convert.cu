// Element-type conversion and fill kernels (src/core/convert_kernels.hpp): the device side of
// convert_async() and fill_async(), running the element code of mgpu/core/detail/elementwise.hpp.
#include "core/convert_kernels.hpp"

#include <mgpu/core/detail/elementwise.hpp>

#include "core/cuda_device_scope.hpp"
#include "kernels/elementwise.cuh"

namespace mgpu::kernels {

void convert_async(int ordinal, void* dst, DType dst_type, void const* src, DType src_type, std::int64_t count,
                   void* stream) {
  detail::cuda::DeviceScope scope(ordinal);
  detail::visit_dtype(dst_type, [&]<class D>(std::type_identity<D>) {
    detail::visit_dtype(src_type, [&]<class S>(std::type_identity<S>) {
      for_each_index(count, detail::ConvertOp<D, S>{static_cast<D*>(dst), static_cast<S const*>(src)},
                              static_cast<cudaStream_t>(stream));
    });
  });
}

void fill_async(int ordinal, void* dst, DType type, float value, std::int64_t count, void* stream) {
  detail::cuda::DeviceScope scope(ordinal);
  detail::visit_dtype(type, [&]<class T>(std::type_identity<T>) {
    for_each_index(count, detail::FillOp<T>{static_cast<T*>(dst), T(value)}, static_cast<cudaStream_t>(stream));
  });
}

}  // namespace mgpu::kernels
