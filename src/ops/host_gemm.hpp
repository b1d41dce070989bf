// The host GEMM behind one internal interface, with two backends: oneDNN's matmul primitive
// (host_gemm_onednn.cpp, built when MGPU_HOST_GEMM selects oneDNN) and Eigen's blocked kernel
// (host_gemm.cpp, always built: the whole backend of an Eigen build, and what a oneDNN build runs
// for calls oneDNN cannot, such as float16 on CPUs without float16 matmul). Everything runs on
// the calling thread (a host stream's worker) and keeps its state per thread.
#pragma once

#include <cstdint>

#include <mgpu/core/dtype.hpp>

namespace mgpu::ops::host {

/// One row-major GEMM, C = alpha op(A) op(B) + beta C with op(X) = X or X^T, all three in `dtype`
/// (float32, or 16-bit storage with float32 accumulation), followed by an optional epilogue on
/// every row of C: + bias (n elements of `dtype`; then beta must be 0), then ReLU in place, or
/// GELU (tanh approximation) into `gelu_out` [m, n], C keeping the pre-activation.
struct GemmCall {
  DType dtype = DType::float32;
  bool transpose_a = false;
  bool transpose_b = false;
  std::int64_t m = 0;
  std::int64_t n = 0;
  std::int64_t k = 0;
  void const* a = nullptr;  // op(A) is [m, k]: A is [m, k], or [k, m] when transposed
  void const* b = nullptr;  // op(B) is [k, n]: B is [k, n], or [n, k] when transposed
  void* c = nullptr;        // [m, n]
  float alpha = 1.0f;
  float beta = 0.0f;
  void const* bias = nullptr;
  bool relu = false;
  void* gelu_out = nullptr;
};

/// Runs the call on the calling thread through the build's backend, and adds it to the thread's
/// counts (ops::host_gemm_stats); a GELU epilogue then runs the shared functor (detail::Gelu, as
/// the CUDA kernels do) over C, its time counted as an activation (ops::host_op_seconds).
void gemm(GemmCall const& call);

/// The Eigen backend: runs any call but its GELU epilogue.
void eigen_gemm(GemmCall const& call);

/// The oneDNN backend: runs the call (but its GELU epilogue) and returns true, or returns false
/// (having written nothing) for a call that this CPU's oneDNN does not implement. Bias and ReLU are
/// post-ops of the matmul. Its primitives are cached per thread by (shape, transposes, dtype,
/// alpha, beta, bias, ReLU), and oneDNN runs single-threaded on the calling thread. Defined only in
/// oneDNN builds.
bool onednn_gemm(GemmCall const& call);

}  // namespace mgpu::ops::host
