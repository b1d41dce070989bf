// Element math of the training ops, shared by the host loops and (later) the CUDA kernels.
#pragma once

#include <cmath>

#include <mgpu/core/host_device.hpp>

namespace mgpu::ops::detail {

MGPU_HD inline float relu(float x) { return x > 0 ? x : 0.0f; }
MGPU_HD inline float relu_grad(float x, float dy) { return x > 0 ? dy : 0.0f; }

// GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
inline constexpr float gelu_k0 = 0.7978845608028654f;  // sqrt(2 / pi)
inline constexpr float gelu_k1 = 0.044715f;

MGPU_HD inline float gelu(float x) {
  float const inner = gelu_k0 * (x + gelu_k1 * x * x * x);
  return 0.5f * x * (1.0f + tanhf(inner));
}

MGPU_HD inline float gelu_grad(float x, float dy) {
  float const inner = gelu_k0 * (x + gelu_k1 * x * x * x);
  float const t = tanhf(inner);
  float const d_inner = gelu_k0 * (1.0f + 3.0f * gelu_k1 * x * x);
  return dy * (0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * d_inner);
}

/// SGD with momentum, weight decay and optional Nesterov, one element, in place.
MGPU_HD inline void sgd_step(float& param, float grad, float& velocity, float lr, float momentum, float weight_decay,
                             bool nesterov) {
  float const g = grad + weight_decay * param;
  velocity = momentum * velocity + g;
  param -= lr * (nesterov ? g + momentum * velocity : velocity);
}

/// AdamW (decoupled weight decay), one element, in place; `step` counts from 1.
MGPU_HD inline void adamw_step(float& param, float grad, float& m, float& v, float lr, float beta1, float beta2, float eps,
                               float weight_decay, float bias1, float bias2) {
  m = beta1 * m + (1.0f - beta1) * grad;
  v = beta2 * v + (1.0f - beta2) * grad * grad;
  float const m_hat = m / bias1;
  float const v_hat = v / bias2;
  param -= lr * (m_hat / (sqrtf(v_hat) + eps) + weight_decay * param);
}

}  // namespace mgpu::ops::detail
