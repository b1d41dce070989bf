// Training's math, enqueued on a stream whose device holds every tensor; bad arguments throw
// Error(invalid_argument) at the call. Activations fp32/bf16/fp16 (math fp32), optimizer buffers
// fp32, scalar results in device tensors (item() reads one). Design: docs/architecture.md.
#pragma once

#include <cstddef>
#include <cstdint>

#include <mgpu/core/stream.hpp>
#include <mgpu/core/tensor.hpp>

namespace mgpu::ops {

/// Float32 GEMMs on CUDA devices: exact (default) or TF32 (10-bit mantissa inputs, float32 sums).
enum class Float32Matmul : std::uint8_t { exact, tf32 };
/// Sets (process-wide, any thread) the mode of GEMMs enqueued from now on; float32_matmul() reads it.
void set_float32_matmul(Float32Matmul mode) noexcept;
[[nodiscard]] Float32Matmul float32_matmul() noexcept;

/// C = alpha * op(A) * op(B) + beta * C, 2-D row-major, one dtype; m, n, k < 2^31 on CUDA devices.
void gemm(Tensor const& a, bool transpose_a, Tensor const& b, bool transpose_b, Tensor const& c, float alpha, float beta,
          Stream& stream);
enum class ActivationKind { identity, relu, gelu };
[[nodiscard]] char const* activation_name(ActivationKind kind) noexcept;

/// y [N, out] = act(x [N, in] W [in, out] + bias [out]) in one op. For gelu, `pre` [N, out] receives
/// x W + bias (its backward reads it); identity and relu take an undefined `pre`.
void linear(Tensor const& x, Tensor const& w, Tensor const& bias, Tensor const& y, ActivationKind act, Tensor const& pre,
            Stream& stream);
/// dz = act'(z) * dy and db[j] = sum over i of dz[i, j] (db += with `accumulate`) in one pass; z is
/// y for relu, `pre` for gelu, unused for identity.
void activation_bias_grad(ActivationKind act, Tensor const& z, Tensor const& dy, Tensor const& dz, Tensor const& db,
                          Stream& stream, bool accumulate = false);
/// y[i, j] += bias[j].
void add_bias(Tensor const& y, Tensor const& bias, Stream& stream);
/// db[j] = sum over i of dy[i, j]; with `accumulate`, db[j] += it.
void bias_grad(Tensor const& dy, Tensor const& db, Stream& stream, bool accumulate = false);
/// y = max(x, 0); dx = dy where x > 0. GELU: the tanh approximation.
void relu(Tensor const& x, Tensor const& y, Stream& stream);
void relu_backward(Tensor const& x, Tensor const& dy, Tensor const& dx, Stream& stream);
void gelu(Tensor const& x, Tensor const& y, Stream& stream);
void gelu_backward(Tensor const& x, Tensor const& dy, Tensor const& dx, Stream& stream);

/// LayerNorm over x [N, D]'s rows with gamma, beta [D]; stats [2, N] (float32) = means, 1/sqrt(var + eps).
/// With `residual` (x's shape and type), x += residual first, in the same pass (x then holds the sum
/// normalized, which backward reads).
void layer_norm(Tensor const& x, Tensor const& gamma, Tensor const& beta, Tensor const& y, Tensor const& stats,
                float eps, Stream& stream, Tensor const& residual = {});
/// The gradients of layer_norm: dx, and dgamma, dbeta (overwritten, or added to with `accumulate`).
/// With `residual` (dy's shape and type), dx = the input gradient + residual, in the same pass.
void layer_norm_backward(Tensor const& x, Tensor const& gamma, Tensor const& stats, Tensor const& dy, Tensor const& dx,
                         Tensor const& dgamma, Tensor const& dbeta, Stream& stream, bool accumulate = false,
                         Tensor const& residual = {});
/// Inverted dropout, p in [0, 1): y = x / (1 - p) or 0 by a hash of (seed, offset + index), the same
/// on every device and in dropout_backward; `offset` is x's first element's global index.
void dropout(Tensor const& x, Tensor const& y, float p, std::uint64_t seed, Stream& stream, std::int64_t offset = 0);
void dropout_backward(Tensor const& dy, Tensor const& dx, float p, std::uint64_t seed, Stream& stream, std::int64_t offset = 0);

/// Mean softmax cross-entropy of logits [N, C] against float32 class ids [N] into `loss`, with
/// dlogits = (softmax - onehot) * grad_scale / N. A label outside [0, C) throws
/// Error(invalid_argument) naming the row on a host stream, and makes the loss NaN on a CUDA one.
void softmax_cross_entropy(Tensor const& logits, Tensor const& labels, Tensor const& dlogits, Tensor const& loss,
                           Stream& stream, float grad_scale = 1.0f);
/// Mean squared error into `loss`; dpred = 2 (pred - target) * grad_scale / numel.
void mse(Tensor const& pred, Tensor const& target, Tensor const& dpred, Tensor const& loss, Stream& stream,
         float grad_scale = 1.0f);

/// The rows of logits [N, C] whose largest logit is the label's, into `out`; a bad label fails the stream.
void count_correct(Tensor const& logits, Tensor const& labels, Tensor const& out, Stream& stream);

/// Reductions into `out` (float32, one element; float64 sums on host devices).
void sum(Tensor const& t, Tensor const& out, Stream& stream);
void sum_squares(Tensor const& t, Tensor const& out, Stream& stream);
/// The number of NaN and Inf elements (the overflow check of mixed precision).
void count_nonfinite(Tensor const& t, Tensor const& out, Stream& stream);

/// In-place fused SGD (momentum, Nesterov, L2 weight decay as in PyTorch) over flat buffers.
void sgd_update(Tensor const& params, Tensor const& grads, Tensor const& velocity, float lr, float momentum,
                float weight_decay, bool nesterov, Stream& stream);
/// In-place fused AdamW over flat buffers; `step` counts from 1.
void adamw_update(Tensor const& params, Tensor const& grads, Tensor const& m, Tensor const& v, float lr, float beta1,
                  float beta2, float eps, float weight_decay, std::int64_t step, Stream& stream);
/// t *= factor.
void scale(Tensor const& t, float factor, Stream& stream);
/// dst = src * factor in dst's dtype (same element count).
void scale_convert(Tensor const& dst, Tensor const& src, float factor, Stream& stream);

/// dst += src * factor in dst's dtype (same element count).
void add_scaled(Tensor const& dst, Tensor const& src, float factor, Stream& stream);
/// dst[:, dst_column + c] = src[:, src_column + c] for c < columns, both [rows, last dim], one dtype.
void copy_columns(Tensor const& src, std::int64_t src_column, Tensor const& dst, std::int64_t dst_column,
                  std::int64_t columns, Stream& stream);
/// One thread's host GEMMs (gemm, linear; a GELU epilogue is an activation): calls, flops, seconds.
struct HostGemmStats {
  std::int64_t calls = 0;
  double flops = 0;
  double seconds = 0;
};
/// The calling thread's totals (a host stream's GEMMs run on its worker: read them from its work).
[[nodiscard]] HostGemmStats host_gemm_stats() noexcept;

/// The op families besides the GEMMs whose host time host_op_seconds() counts (docs/performance.md).
enum class HostOpFamily : std::uint8_t { attention, norm, activation, loss, optimizer, embedding, elementwise };
inline constexpr std::size_t host_op_family_count = 7;
[[nodiscard]] char const* host_op_family_name(HostOpFamily family) noexcept;
/// The calling thread's seconds per family (GEMMs: host_gemm_stats alone), read as host_gemm_stats.
struct HostOpSeconds {
  double seconds[host_op_family_count] = {};
  [[nodiscard]] double operator[](HostOpFamily f) const noexcept { return seconds[static_cast<std::size_t>(f)]; }
};
[[nodiscard]] HostOpSeconds host_op_seconds() noexcept;

/// The value of a one-element tensor: copies it to the host and synchronizes `stream`.
float item(Tensor const& t, Stream& stream);
/// A float32 tensor of `shape` filled with zeros on the stream's device.
Tensor zeros(Shape shape, Allocator& allocator, Stream& stream);

}  // namespace mgpu::ops
