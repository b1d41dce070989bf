// What every op file of src/ops shares: argument checks, and the two drivers that run an element
// functor of mgpu/core/detail/training_math.hpp on a stream (a loop on a host stream's worker, a
// kernel of the family's file in src/kernels on a CUDA stream). Internal: not installed.
//
// Note [adding an op]
// ~~~~~~~~~~~~~~~~~~~
// An op belongs to a family, and a family has one file of each kind, under the same name: its host
// side src/ops/<family>.cpp and its CUDA side src/kernels/<family>.cu (linear, activation,
// layer_norm, loss, reductions, updates, transformer). Adding an op:
//   1. its element math, as a __host__ __device__ functor in mgpu/core/detail/training_math.hpp (one
//      definition that both the host loop and the CUDA kernel run, so the CPU tests cover it);
//   2. its declaration, with a sentence on what it does, in mgpu/ops/ops.hpp (the transformer
//      family: mgpu/ops/transformer.hpp, with its math in mgpu/core/detail/transformer_math.hpp);
//   3. its definition in src/ops/<family>.cpp: the argument checks below, then run_each or
//      run_reduce with the functor, which pick the host loop or the CUDA kernel by the stream's
//      device and keep the tensors alive until the work has run;
//   4. in src/kernels/<family>.cu, the functor's `each` or `reduce` instantiation (the list at the
//      end of the file): a grid over the functor, or a fixed-order sum of its terms
//      (src/kernels/op_support.cuh). A row or column functor with a kernel of its own defines that
//      kernel there and specializes `Launch` for the functor, as layer_norm.cu does.
// A new family adds both files and names them in CMakeLists.txt (the .cu in the CUDA sources). An op
// that has a faster host path (Eigen, the host GEMM) branches on the stream's device in its family
// file, beside the generic path, as add_bias and linear do.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <mgpu/config.hpp>
#include <mgpu/core/detail/elementwise.hpp>
#include <mgpu/core/detail/training_math.hpp>
#include <mgpu/core/error.hpp>
#include <mgpu/core/stream.hpp>
#include <mgpu/core/tensor.hpp>
#include <mgpu/ops/ops.hpp>

#include "core/backend.hpp"
#include "kernels/ops.hpp"
#include "ops/host_op_stats.hpp"

namespace mgpu::ops {

inline std::string str(DType t) { return std::string(to_string(t)); }

// A defined tensor on the stream's device.
inline void check(Tensor const& t, char const* op, char const* role, Stream const& stream) {
  if (!t.defined()) throw Error(Errc::invalid_argument, std::string(op) + ": " + role + " is undefined (expected a tensor)");
  if (t.dtype() == DType::int32)
    throw Error(Errc::invalid_argument, std::string(op) + ": " + role + " is int32 (expected float32, bfloat16 or float16)");
  if (t.device() != stream.device())
    throw Error(Errc::device, std::string(op) + ": " + role + " is on " + t.device().to_string() + " but the stream is on " +
                                  stream.device().to_string() + " (expected the stream's device)");
}

inline void check_dtype(Tensor const& t, DType expected, char const* op, char const* role) {
  if (t.dtype() != expected)
    throw Error(Errc::invalid_argument, std::string(op) + ": " + role + " is " + str(t.dtype()) + " (expected " + str(expected) + ")");
}

inline void check_same(Tensor const& a, Tensor const& b, char const* op) {
  if (a.shape() != b.shape())
    throw Error(Errc::invalid_argument, std::string(op) + ": shapes " + to_string(a.shape()) + " and " + to_string(b.shape()) +
                                            " differ (expected equal shapes)");
  if (a.dtype() != b.dtype())
    throw Error(Errc::invalid_argument, std::string(op) + ": dtypes " + str(a.dtype()) + " and " + str(b.dtype()) +
                                            " differ (expected one dtype)");
}

inline void check_scalar(Tensor const& out, char const* op, Stream const& stream) {
  check(out, op, "output", stream);
  check_dtype(out, DType::float32, op, "output");
  if (out.numel() != 1)
    throw Error(Errc::invalid_argument, std::string(op) + ": output has shape " + to_string(out.shape()) + " (expected one element)");
}

inline std::int64_t rows(Tensor const& t) { return t.rank() == 0 ? 1 : t.dim(0); }
inline std::int64_t cols(Tensor const& t) { return t.rank() == 0 ? 1 : t.numel() / std::max<std::int64_t>(1, t.dim(0)); }

template <class T>
T* ptr(Tensor const& t) {
  return static_cast<T*>(t.data());
}

// float32 on a host stream: the ops that Eigen does better than an element loop take this path.
inline bool host_float32(Tensor const& t, Stream const& stream) {
  return t.dtype() == DType::float32 && stream.device().kind == DeviceKind::host;
}

// Runs op(i) for i in [0, n) on the stream, recording it as a use of the tensors (`keep`: their
// blocks are reused in stream order, mgpu::detail::enqueue_using); on a host stream its time counts
// to `family` (host_op_seconds).
template <class Op>
void run_each(Stream& stream, HostOpFamily family, std::int64_t n, Op const& op, std::vector<Tensor> const& keep) {
  mgpu::detail::ReleaseAfterOnExit const release(stream, keep);  // reused after the loop or the kernel
  if (stream.device().kind == DeviceKind::host) {
    stream.enqueue([family, n, op] { host::timed(family, [&] { mgpu::detail::for_each_index(n, op); }); });
    return;
  }
#if MGPU_CUDA_ENABLED
  kernels::each(stream.device().index, n, op, stream.native_handle());
#else
  throw Error(Errc::device, "ops on " + stream.device().to_string() + " (this build has no CUDA backend)");
#endif
}

// out[0] = scale * sum of op(i) for i in [0, n); float64 accumulation on the host (in 8 partial
// sums), its time counted to `family`.
template <class Op>
void run_reduce(Stream& stream, HostOpFamily family, std::int64_t n, Op const& op, Tensor const& out, float scale,
                std::vector<Tensor> keep) {
  keep.push_back(out);
  float* result = ptr<float>(out);
  mgpu::detail::ReleaseAfterOnExit const release(stream, keep);  // its kernels, also if the second fails to launch
  if (stream.device().kind == DeviceKind::host) {
    stream.enqueue([family, n, op, result, scale] {
      host::timed(family, [&] {
        // 8 independent float64 partial sums: the loop vectorizes for element ops (a sum of squares
        // over every gradient), where one running sum would go an element at a time.
        constexpr std::int64_t lanes = 8;
        double part[lanes] = {};
        std::int64_t i = 0;
        for (; i + lanes <= n; i += lanes)
          for (std::int64_t l = 0; l < lanes; ++l) part[l] += static_cast<double>(op(i + l));
        for (; i < n; ++i) part[0] += static_cast<double>(op(i));
        double total = 0;
        for (double const p : part) total += p;
        *result = static_cast<float>(static_cast<double>(scale) * total);
      });
    });
    return;
  }
#if MGPU_CUDA_ENABLED
  mgpu::detail::StreamScratch scratch(stream, out);
  kernels::reduce(stream.device().index, n, op, result, scale, scratch, stream.native_handle());
#else
  throw Error(Errc::device, "ops on " + stream.device().to_string() + " (this build has no CUDA backend)");
#endif
}

// Calls fn(T{}) with T the element type of a float32, bfloat16 or float16 tensor.
template <class Fn>
inline void visit(DType dtype, Fn&& fn) {
  mgpu::detail::visit_dtype(dtype, [&]<class T>(std::type_identity<T>) { fn(T{}); });
}

// Calls fn(F{}) with F the functor type of an activation.
template <class Fn>
void visit_activation(ActivationKind act, Fn&& fn) {
  switch (act) {
    case ActivationKind::identity: fn(detail::Identity{}); return;
    case ActivationKind::relu: fn(detail::Relu{}); return;
    case ActivationKind::gelu: fn(detail::Gelu{}); return;
  }
  throw Error(Errc::invalid_argument, "activation " + std::to_string(static_cast<int>(act)) + " (expected identity, relu or gelu)");
}

}  // namespace mgpu::ops
