// The CUDA side of the training ops: drivers that run the functors of mgpu/ops/detail/math.hpp as
// kernels, and GEMM through cuBLAS. Implemented in src/kernels/ops.cu, which instantiates the
// drivers for every functor ops.cpp uses; the calling thread's current device is left as it was.
#pragma once

#include <cstdint>

#include <mgpu/core/dtype.hpp>

namespace mgpu::ops::cuda {

/// op(i) for i in [0, n) on `stream` of GPU `ordinal`.
template <class Op>
void each(int ordinal, std::int64_t n, Op const& op, void* stream);

/// *out = scale * sum of op(i) for i in [0, n) (out is overwritten).
template <class Op>
void reduce(int ordinal, std::int64_t n, Op const& op, float* out, float scale, void* stream);

/// Row-major C[m, n] = alpha op(A) op(B) + beta C, all of `dtype`, float32 accumulation.
void gemm(int ordinal, DType dtype, bool transpose_a, bool transpose_b, std::int64_t m, std::int64_t n, std::int64_t k,
          float alpha, void const* a, void const* b, float beta, void* c, void* stream);

}  // namespace mgpu::ops::cuda
