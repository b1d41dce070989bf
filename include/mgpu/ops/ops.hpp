// The math primitives training needs. Each op checks its arguments at the call (a mismatch throws
// Error(invalid_argument) naming the shapes or types and what was expected) and enqueues its work
// on a stream: on a host device the stream's worker runs Eigen (GEMM, through maps over tensor
// storage, no copies) or the element functors of mgpu/core/detail/training_math.hpp; on a CUDA
// device the op launches cuBLAS (cublasGemmEx) or the same functors as kernels. Every tensor must
// live on the stream's device. Activations may be float32, bfloat16 or float16 (math in float32);
// optimizer buffers are float32. Results that are scalars (losses, norms) are written into tensors
// on the device, so nothing waits: read one with item().
#pragma once

#include <cstddef>
#include <cstdint>

#include <mgpu/core/stream.hpp>
#include <mgpu/core/tensor.hpp>

namespace mgpu::ops {

/// How float32 GEMMs run on CUDA devices: exact float32 products (the default), or TF32 tensor-core
/// products (inputs rounded to a 10-bit mantissa, float32 accumulation; several times faster on
/// Ampere and newer GPUs). Host devices always compute in float32.
enum class Float32Matmul : std::uint8_t { exact, tf32 };
/// Sets the mode for GEMMs enqueued from now on, by any thread (process-wide; thread-safe).
void set_float32_matmul(Float32Matmul mode) noexcept;
/// The current mode (thread-safe).
[[nodiscard]] Float32Matmul float32_matmul() noexcept;

/// C = alpha * op(A) * op(B) + beta * C for 2-D row-major tensors of one dtype, op(X) = X or X^T.
/// m, n and k up to 2^31 - 1 on CUDA devices (Error(invalid_argument) above).
void gemm(Tensor const& a, bool transpose_a, Tensor const& b, bool transpose_b, Tensor const& c, float alpha, float beta,
          Stream& stream);
/// The activation a fused linear op applies.
enum class ActivationKind { identity, relu, gelu };
[[nodiscard]] char const* activation_name(ActivationKind kind) noexcept;

/// A linear layer's forward in one op: y = act(x W + bias) for x [N, in], W [in, out], bias [out],
/// y [N, out]. No pass of its own for the bias (on the host it is the GEMM's starting value), and
/// the activation shares the epilogue's pass. For gelu, `pre` [N, out] receives x W + bias, which
/// gelu's backward needs; identity and relu take an undefined `pre` (relu's backward reads y).
void linear(Tensor const& x, Tensor const& w, Tensor const& bias, Tensor const& y, ActivationKind act, Tensor const& pre,
            Stream& stream);
/// The epilogue of a linear backward in one pass: dz = act'(z) * dy and db[j] = sum over i of
/// dz[i, j], where z is what the forward kept (y for relu, `pre` for gelu; unused for identity).
/// With `accumulate`, db += that sum (gradient accumulation over micro-batches).
void activation_bias_grad(ActivationKind act, Tensor const& z, Tensor const& dy, Tensor const& dz, Tensor const& db,
                          Stream& stream, bool accumulate = false);
/// y[i, j] += bias[j].
void add_bias(Tensor const& y, Tensor const& bias, Stream& stream);
/// db[j] = sum over i of dy[i, j]; with `accumulate`, db[j] += it.
void bias_grad(Tensor const& dy, Tensor const& db, Stream& stream, bool accumulate = false);
/// y = max(x, 0); dx = dy where x > 0.
void relu(Tensor const& x, Tensor const& y, Stream& stream);
void relu_backward(Tensor const& x, Tensor const& dy, Tensor const& dx, Stream& stream);
/// y = GELU(x) (tanh approximation) and its backward.
void gelu(Tensor const& x, Tensor const& y, Stream& stream);
void gelu_backward(Tensor const& x, Tensor const& dy, Tensor const& dx, Stream& stream);

/// LayerNorm over the last dimension of x [N, D] with gamma, beta [D]; writes y and the per-row
/// statistics backward needs into stats [2, N] (float32: means, then 1/sqrt(var + eps)). With
/// `residual` (shaped and typed as x), x += residual first, in the same pass: x then holds the
/// residual sum that is normalized (and that backward reads).
void layer_norm(Tensor const& x, Tensor const& gamma, Tensor const& beta, Tensor const& y, Tensor const& stats,
                float eps, Stream& stream, Tensor const& residual = {});
/// The gradients of layer_norm: dx, and dgamma, dbeta (overwritten, or added to with `accumulate`).
/// With `residual` (shaped and typed as dy), dx = the input gradient + residual in the same pass:
/// the backward of y = LayerNorm(h) where h also feeds a residual path whose gradient is residual.
void layer_norm_backward(Tensor const& x, Tensor const& gamma, Tensor const& stats, Tensor const& dy, Tensor const& dx,
                         Tensor const& dgamma, Tensor const& dbeta, Stream& stream, bool accumulate = false,
                         Tensor const& residual = {});
/// Inverted dropout: y = x / (1 - p) or 0, chosen by a counter-based hash of (seed, index), so the
/// same seed gives the same mask on every device and in dropout_backward (no mask is stored).
/// p must be in [0, 1).
/// `offset` is the global index of x's first element (e.g. a shard's first row times the row
/// length), so every shard of a batch draws the mask the whole batch would.
void dropout(Tensor const& x, Tensor const& y, float p, std::uint64_t seed, Stream& stream, std::int64_t offset = 0);
void dropout_backward(Tensor const& dy, Tensor const& dx, float p, std::uint64_t seed, Stream& stream, std::int64_t offset = 0);

/// Mean softmax cross-entropy of logits [N, C] against class labels [N] (float32 class ids), one
/// numerically stable pass per row; writes dlogits = (softmax - onehot) * grad_scale / N and the
/// mean loss into `loss` (float32, one element). A label outside [0, C) throws
/// Error(invalid_argument) naming the row on a host stream; on a CUDA stream it makes the loss NaN.
void softmax_cross_entropy(Tensor const& logits, Tensor const& labels, Tensor const& dlogits, Tensor const& loss,
                           Stream& stream, float grad_scale = 1.0f);
/// Mean squared error over all elements into `loss`, with dpred = 2 (pred - target) * grad_scale / numel.
void mse(Tensor const& pred, Tensor const& target, Tensor const& dpred, Tensor const& loss, Stream& stream,
         float grad_scale = 1.0f);

/// The number of rows of logits [N, C] whose largest logit is at the label's class, into `out`.
/// A label that is not a class id in [0, C) fails the stream with Error(invalid_argument) naming it.
void count_correct(Tensor const& logits, Tensor const& labels, Tensor const& out, Stream& stream);

/// Reductions into `out` (float32, one element), accumulated in float64 on host devices.
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
/// dst = src * factor in dst's dtype (same element count; e.g. fp16 gradients into fp32 master
/// gradients, unscaled by the loss scale).
void scale_convert(Tensor const& dst, Tensor const& src, float factor, Stream& stream);

/// dst += src * factor in dst's dtype (same element count; gradient accumulation).
void add_scaled(Tensor const& dst, Tensor const& src, float factor, Stream& stream);
/// What the host GEMMs (of gemm and linear) have done on one thread: calls, floating-point
/// operations (2 m n k each) and seconds spent in them.
struct HostGemmStats {
  std::int64_t calls = 0;
  double flops = 0;
  double seconds = 0;
};
/// The calling thread's host GEMM totals since it started; a host stream's GEMMs run on its worker,
/// so read them from work enqueued on that stream. Reading is cheap and changes nothing.
[[nodiscard]] HostGemmStats host_gemm_stats() noexcept;

/// The families of ops besides the GEMMs whose host time host_op_seconds() counts: causal
/// attention; LayerNorm; activations with their bias, dropout and bias gradients; the losses; the
/// optimizer's updates with the gradient clipping's norm and scale; the embedding and its gradient;
/// element-wise adds and conversions (residual adds, gradient accumulation).
enum class HostOpFamily : std::uint8_t { attention, norm, activation, loss, optimizer, embedding, elementwise };
inline constexpr std::size_t host_op_family_count = 7;
/// The name of a family ("attention", "norm", ...).
[[nodiscard]] char const* host_op_family_name(HostOpFamily family) noexcept;
/// Seconds the calling thread has spent running the host work of each family's ops since it
/// started, indexed by HostOpFamily (host GEMMs, including those inside linear, are counted by
/// host_gemm_stats alone; attention's own tile products count as attention). As host_gemm_stats:
/// read from work enqueued on the stream.
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
