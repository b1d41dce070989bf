// Host-callable launchers of the training ops' kernels, used by the op files of src/ops: the
// functors of mgpu/core/detail/training_math.hpp and transformer_math.hpp over a grid,
// deterministic reductions and row-wise block kernels (`each` and `reduce`, defined in
// src/kernels/op_support.cuh and instantiated per functor by the family's file: linear.cu,
// activation.cu, layer_norm.cu, loss.cu, reductions.cu, updates.cu, transformer.cu), the label
// check (loss.cu), and GEMM through cuBLAS (linear.cu). Each leaves the calling thread's current
// device as it was.
#pragma once

#include <cstdint>

#include <mgpu/core/dtype.hpp>

#include "core/kernel_scratch.hpp"

namespace mgpu::kernels {

// op(i) for i in [0, n) on `stream` of GPU `ordinal` (a row or column functor: its own kernel).
template <class Op>
void each(int ordinal, std::int64_t n, Op const& op, void* stream);

// *out = scale * sum of op(i) for i in [0, n) (out is overwritten), summed in a fixed order that
// depends only on n: the same inputs give the same bits on every run. Partial sums in `scratch`.
template <class Op>
void reduce(int ordinal, std::int64_t n, Op const& op, float* out, float scale, Scratch& scratch, void* stream);

// Copies to `host_result` (page-locked memory, read after the stream has passed this point) the
// first row whose label is not a class id in [0, classes), as (row << 32) | the label's float bits,
// or all ones when every label is good. The search's word in `scratch`.
void find_bad_label(int ordinal, float const* labels, std::int64_t rows, std::int64_t classes,
                    std::uint64_t* host_result, Scratch& scratch, void* stream);

// A cuBLAS handle made on GPU `ordinal`, for one stream (see StreamInternals::with_blas_handle).
void* create_blas_handle(int ordinal);
void destroy_blas_handle(void* handle) noexcept;

// Row-major C[m, n] = alpha op(A) op(B) + beta C, all of `dtype`, float32 accumulation (TF32
// tensor-core products for float32 when `tf32`). Throws Error(invalid_argument) when m, n or k
// exceed what cuBLAS takes (int).
void gemm(void* blas_handle, int ordinal, DType dtype, bool transpose_a, bool transpose_b, std::int64_t m, std::int64_t n,
          std::int64_t k, float alpha, void const* a, void const* b, float beta, void* c, void* stream, bool tf32);

}  // namespace mgpu::kernels
