// Host-callable launchers of the core's kernels: element-type conversion and fill, behind
// convert_async() and fill_async() of mgpu/core/tensor.hpp. Internal: not installed. Core declares
// them here, the seam through which it reaches its kernels without including the kernels module;
// src/kernels/convert.cu implements them, and builds without CUDA link throwing stand-ins
// (src/core/no_cuda_backend.cpp). Each leaves the calling thread's current device as it was.
#pragma once

#include <cstdint>

#include <mgpu/core/dtype.hpp>

namespace mgpu::kernels {

// dst[i] = dst_type(src[i]) for i in [0, count), on `stream` of GPU `ordinal`.
void convert_async(int ordinal, void* dst, DType dst_type, void const* src, DType src_type, std::int64_t count, void* stream);
// dst[i] = value for i in [0, count), on `stream` of GPU `ordinal`.
void fill_async(int ordinal, void* dst, DType type, float value, std::int64_t count, void* stream);

}  // namespace mgpu::kernels
