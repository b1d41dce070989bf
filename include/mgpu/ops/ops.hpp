// The math primitives training needs, on float32 tensors. Each op enqueues its work on a stream
// (host devices: Eigen on the stream's worker, reading tensor storage in place through Eigen maps).
// Shapes are checked at the call: a mismatch throws Error(invalid_argument) naming both shapes.
#pragma once

#include <cstdint>
#include <vector>

#include <mgpu/core/stream.hpp>
#include <mgpu/core/tensor.hpp>

namespace mgpu::ops {

/// C = alpha * op(A) * op(B) + beta * C for 2-D row-major tensors, op(X) = X or X^T.
void gemm(Tensor const& a, bool transpose_a, Tensor const& b, bool transpose_b, Tensor const& c, float alpha, float beta,
          Stream& stream);
/// y[i, j] += bias[j].
void add_bias(Tensor const& y, Tensor const& bias, Stream& stream);
/// db[j] = sum over i of dy[i, j].
void bias_grad(Tensor const& dy, Tensor const& db, Stream& stream);
/// y = max(x, 0); dx = dy where x > 0.
void relu(Tensor const& x, Tensor const& y, Stream& stream);
void relu_backward(Tensor const& x, Tensor const& dy, Tensor const& dx, Stream& stream);
/// y = GELU(x) (tanh approximation) and its backward.
void gelu(Tensor const& x, Tensor const& y, Stream& stream);
void gelu_backward(Tensor const& x, Tensor const& dy, Tensor const& dx, Stream& stream);

/// Mean softmax cross-entropy of logits [N, C] against class labels [N] (class ids stored as
/// float), computed stably in one pass per row; writes dlogits = (softmax - onehot) / N and the loss
/// into *loss (read it after the stream is synchronized). Throws Error(invalid_argument) on the
/// stream for a label outside [0, C).
void softmax_cross_entropy(Tensor const& logits, Tensor const& labels, Tensor const& dlogits, float* loss, Stream& stream);
/// Mean squared error over all elements, with dpred = 2 (pred - target) / numel.
void mse(Tensor const& pred, Tensor const& target, Tensor const& dpred, float* loss, Stream& stream);

/// In-place SGD (momentum, Nesterov, decoupled-from-nothing L2 weight decay) over flat buffers.
void sgd_update(Tensor const& params, Tensor const& grads, Tensor const& velocity, float lr, float momentum,
                float weight_decay, bool nesterov, Stream& stream);
/// In-place AdamW over flat buffers; `step` counts from 1.
void adamw_update(Tensor const& params, Tensor const& grads, Tensor const& m, Tensor const& v, float lr, float beta1,
                  float beta2, float eps, float weight_decay, std::int64_t step, Stream& stream);
/// t *= factor.
void scale(Tensor const& t, float factor, Stream& stream);
/// sqrt(sum of squares) of every element, and whether all are finite, into *norm and *finite.
void global_norm(Tensor const& t, float* norm, bool* finite, Stream& stream);

}  // namespace mgpu::ops
