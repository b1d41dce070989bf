// Element math of the training ops (mgpu::ops) as __host__ __device__ functors, written once: the
// host drives them with a loop on a stream's worker, the op family's file in src/kernels (linear.cu,
// activation.cu, ...) with a CUDA grid. It sits
// in core, below ops and src/kernels, which both use it. Two driver shapes:
//   each:   op(i) for i in [0, n)                       (element, row and column operations);
//   reduce: out = scale * sum over i of op(i)           (losses, norms, the non-finite count).
// Storage may be float32, bfloat16 or float16; the math is float32.
#pragma once

#include <cmath>
#include <cstdint>

#include <mgpu/core/dtype.hpp>
#include <mgpu/core/host_device.hpp>

namespace mgpu::detail {

template <class T>
MGPU_HD inline float load(T const* p, std::int64_t i) {
  return static_cast<float>(p[i]);
}
template <class T>
MGPU_HD inline void store(T* p, std::int64_t i, float v) {
  p[i] = T(v);
}

/// False for NaN and ±Inf (v - v is NaN exactly then); needs no <cmath> on either side.
MGPU_HD inline bool is_finite(float v) { return v - v == 0.0f; }

MGPU_HD inline float relu(float x) { return x > 0 ? x : 0.0f; }
MGPU_HD inline float relu_grad(float x, float dy) { return x > 0 ? dy : 0.0f; }

/// e^c for c in [-87, 88] (exp_vec's polynomial, no special cases), for callers that clamp.
MGPU_HD inline float exp_in_range(float c) {
#if defined(__CUDA_ARCH__)
  return expf(c);
#else
  // n = round(c log2 e): adding 1.5 * 2^23 rounds to an integer (floorf would not vectorize).
  float const n = fmaf(c, 1.44269504088896341f, 12582912.0f) - 12582912.0f;
  float r = fmaf(n, -0.693359375f, c);
  r = fmaf(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = fmaf(p, r, 1.3981999507e-3f);
  p = fmaf(p, r, 8.3334519073e-3f);
  p = fmaf(p, r, 4.1665795894e-2f);
  p = fmaf(p, r, 1.6666665459e-1f);
  p = fmaf(p, r, 5.0000001201e-1f);
  float const e = fmaf(p * r, r, r) + 1.0f;
  return e * mgpu::detail::bits_float(static_cast<std::uint32_t>(static_cast<std::int32_t>(n) + 127) << 23);
#endif
}

/// e^x. On a GPU expf; on the host a branch-free form the compiler vectorizes: x = n ln2 + r with
/// |r| <= ln2 / 2 (ln2 split in two parts), a degree-6 polynomial for e^r (Cephes' expf
/// coefficients) and 2^n built in the exponent bits; within 1 ulp of e^x on [-87, 88] (tested
/// against float64 in tests/ops/test_host_activation.cpp), 0 below,
/// +inf above, NaN for NaN (so non-finite values still propagate, as loss scaling needs).
MGPU_HD inline float exp_vec(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  float c = x > -87.0f ? x : -87.0f;  // comparisons, not fminf / fmaxf (library calls); NaN -> -87
  c = c < 88.0f ? c : 88.0f;
  float const e = exp_in_range(c);
  // Two flat selects (GCC vectorizes them in fewer instructions than nested ones): NaN fails both.
  float const r = x <= 88.0f ? e : x + INFINITY;
  return x < -87.0f ? 0.0f : r;
#endif
}

// GELU, tanh approximation: 0.5 x (1 + tanh(u)) with u = sqrt(2/pi) (x + 0.044715 x^3), computed as
// x s with s = 0.5 (1 + tanh(u)) = 1 / (1 + e), e = e^(-2u): one exponential and one division, and
// 1 - s = e s without cancellation. -2u is clamped to [-87, 80] (s about 2e-35 at the cap, not 0,
// so e s stays finite where GELU's tail is flat), with no special cases, so the loop vectorizes
// with one division.
inline constexpr float gelu_k0 = 0.7978845608028654f;  // sqrt(2 / pi)
inline constexpr float gelu_k1 = 0.044715f;

MGPU_HD inline float gelu_exp(float x) {  // e = e^(-2u), capped
  float a = -2.0f * gelu_k0 * (x + gelu_k1 * x * x * x);
  a = a > -87.0f ? a : -87.0f;  // NaN -> -87 (x is NaN then, and so is what uses e)
  return exp_in_range(a < 80.0f ? a : 80.0f);
}

MGPU_HD inline float gelu(float x) { return x / (1.0f + gelu_exp(x)); }

// d/dx GELU = s + x s (1 - s) 2 du/dx = s (1 + 2 x e s du/dx).
MGPU_HD inline float gelu_grad(float x, float dy) {
  float const e = gelu_exp(x);
  float const s = 1.0f / (1.0f + e);
  float const d_inner = gelu_k0 * (1.0f + 3.0f * gelu_k1 * x * x);
  return dy * s * fmaf(2.0f * x * d_inner, e * s, 1.0f);
}

/// The activation functions, as types the functors below take.
struct Identity {
  MGPU_HD static float forward(float x) { return x; }
  MGPU_HD static float backward(float, float dy) { return dy; }
};
struct Relu {
  MGPU_HD static float forward(float x) { return relu(x); }
  MGPU_HD static float backward(float x, float dy) { return relu_grad(x, dy); }
};
struct Gelu {
  MGPU_HD static float forward(float x) { return gelu(x); }
  MGPU_HD static float backward(float x, float dy) { return gelu_grad(x, dy); }
};

/// y = F(x).
template <class T, class F>
struct ActivationOp {
  T const* x;
  T* y;
  MGPU_HD void operator()(std::int64_t i) const { store(y, i, F::forward(load(x, i))); }
};

/// dx = F'(x) dy.
template <class T, class F>
struct ActivationGradOp {
  T const* x;
  T const* dy;
  T* dx;
  MGPU_HD void operator()(std::int64_t i) const { store(dx, i, F::backward(load(x, i), load(dy, i))); }
};

/// y[i, j] += bias[j].
template <class T>
struct BiasAddOp {
  T* y;
  T const* bias;
  std::int64_t cols;
  MGPU_HD void operator()(std::int64_t i) const { store(y, i, load(y, i) + load(bias, i % cols)); }
};

/// The epilogue of a linear forward, on the GEMM's output z = x W: v = z + bias[j], then y = F(v);
/// v is written back into z when y is another tensor (it is the pre-activation backward reads).
template <class T, class F>
struct BiasActivationOp {
  T* z;
  T const* bias;
  T* y;
  std::int64_t cols;
  MGPU_HD void operator()(std::int64_t i) const {
    float const v = load(z, i) + load(bias, i % cols);
    if (y != z) store(z, i, v);
    store(y, i, F::forward(v));
  }
};

/// The epilogue of a linear backward, one call per column j: dz[r, j] = F'(z[r, j]) dy[r, j] and
/// db[j] = sum over rows of dz[r, j] (z: the pre-activation, or for ReLU its output); with
/// `accumulate`, the sum is added to db.
template <class T, class F>
struct ActivationBiasGradCol {
  T const* z;
  T const* dy;
  T* dz;
  T* db;
  std::int64_t rows;
  std::int64_t cols;
  bool accumulate;
  MGPU_HD void operator()(std::int64_t j) const {
    float sum = accumulate ? load(db, j) : 0.0f;
    for (std::int64_t r = 0; r < rows; ++r) {
      std::int64_t const i = r * cols + j;
      float const d = F::backward(load(z, i), load(dy, i));
      store(dz, i, d);
      sum += d;
    }
    store(db, j, sum);
  }
};

/// db[j] = sum over rows of dy[r, j] (added to db with `accumulate`); one call per column.
template <class T>
struct BiasGradOp {
  T const* dy;
  T* db;
  std::int64_t rows;
  std::int64_t cols;
  bool accumulate;
  MGPU_HD void operator()(std::int64_t j) const {
    float sum = accumulate ? load(db, j) : 0.0f;
    for (std::int64_t r = 0; r < rows; ++r) sum += load(dy, r * cols + j);
    store(db, j, sum);
  }
};

/// t *= factor.
template <class T>
struct ScaleOp {
  T* t;
  float factor;
  MGPU_HD void operator()(std::int64_t i) const { store(t, i, load(t, i) * factor); }
};

/// dst = src * factor, converting the element type (mixed precision: low-precision gradients into
/// float32 master gradients, unscaled by the loss scale; master weights into compute weights).
template <class Dst, class Src>
struct ScaleConvertOp {
  Dst* dst;
  Src const* src;
  float factor;
  MGPU_HD void operator()(std::int64_t i) const { store(dst, i, load(src, i) * factor); }
};

/// dst += src * factor, converting the element type (gradient accumulation, error feedback).
template <class Dst, class Src>
struct AddScaledOp {
  Dst* dst;
  Src const* src;
  float factor;
  MGPU_HD void operator()(std::int64_t i) const { store(dst, i, load(dst, i) + load(src, i) * factor); }
};

/// dst[r, dst_column + c] = src[r, src_column + c] for element i = r columns + c of a block of
/// `columns` columns of row-major matrices `src_stride` and `dst_stride` wide (a tensor-parallel
/// output's columns gathered into the whole, or the rank's columns taken from it).
template <class T>
struct CopyColumnsOp {
  T const* src;
  T* dst;
  std::int64_t src_stride, src_column, dst_stride, dst_column, columns;
  MGPU_HD void operator()(std::int64_t i) const {
    std::int64_t const r = i / columns, c = i % columns;
    dst[r * dst_stride + dst_column + c] = src[r * src_stride + src_column + c];
  }
};

/// One row of the fused softmax cross-entropy: returns the row's loss, -log softmax(z)[label], and
/// writes dz = (softmax(z) - onehot(label)) * grad_scale. A label that is not a class id in [0, C)
/// gives a NaN loss and NaN gradients (the host path rejects it with an Error before running).
template <class T>
struct SoftmaxCrossEntropyRow {
  T const* logits;
  float const* labels;
  T* dlogits;
  std::int64_t classes;
  float grad_scale;
  MGPU_HD float operator()(std::int64_t r) const {
    T const* z = logits + r * classes;
    T* dz = dlogits + r * classes;
    float const y = labels[r];
    auto const label = static_cast<std::int64_t>(y);
    if (!(y >= 0.0f) || label >= classes || static_cast<float>(label) != y) {
      for (std::int64_t j = 0; j < classes; ++j) store(dz, j, NAN);
      return NAN;
    }
    float top = load(z, 0);
    for (std::int64_t j = 1; j < classes; ++j) top = fmaxf(top, load(z, j));
    float sum = 0;
    for (std::int64_t j = 0; j < classes; ++j) sum += expf(load(z, j) - top);
    float const log_sum = logf(sum);
    for (std::int64_t j = 0; j < classes; ++j) {
      float const p = expf(load(z, j) - top - log_sum);
      store(dz, j, (p - (j == label ? 1.0f : 0.0f)) * grad_scale);
    }
    return log_sum - (load(z, label) - top);
  }
};

/// One element of the mean squared error: returns (pred - target)^2 and writes
/// dpred = 2 (pred - target) * grad_scale.
template <class T>
struct SquaredErrorOp {
  T const* pred;
  T const* target;
  T* dpred;
  float grad_scale;
  MGPU_HD float operator()(std::int64_t i) const {
    float const d = load(pred, i) - load(target, i);
    store(dpred, i, 2.0f * d * grad_scale);
    return d * d;
  }
};

/// One row of accuracy: 1 when the largest logit (the first of ties) is at the label's class.
template <class T>
struct CorrectRow {
  T const* logits;
  float const* labels;
  std::int64_t classes;
  MGPU_HD float operator()(std::int64_t r) const {
    std::int64_t best = 0;
    for (std::int64_t j = 1; j < classes; ++j)
      if (load(logits, r * classes + j) > load(logits, r * classes + best)) best = j;
    return static_cast<float>(best) == labels[r] ? 1.0f : 0.0f;
  }
};

/// Reductions: x, x^2, and 1 for each NaN or Inf.
template <class T>
struct ValueOp {
  T const* t;
  MGPU_HD float operator()(std::int64_t i) const { return load(t, i); }
};
template <class T>
struct SquareOp {
  T const* t;
  MGPU_HD float operator()(std::int64_t i) const {
    float const v = load(t, i);
    return v * v;
  }
};
template <class T>
struct NonFiniteOp {
  T const* t;
  MGPU_HD float operator()(std::int64_t i) const { return is_finite(load(t, i)) ? 0.0f : 1.0f; }
};

/// SGD with momentum, weight decay and optional Nesterov, one element, in place (PyTorch's
/// formulation).
MGPU_HD inline void sgd_step(float& param, float grad, float& velocity, float lr, float momentum, float weight_decay,
                             bool nesterov) {
  float const g = grad + weight_decay * param;
  velocity = momentum * velocity + g;
  param -= lr * (nesterov ? g + momentum * velocity : velocity);
}

/// AdamW (decoupled weight decay), one element, in place; bias1/bias2 = 1 - beta^step.
MGPU_HD inline void adamw_step(float& param, float grad, float& m, float& v, float lr, float beta1, float beta2, float eps,
                               float weight_decay, float bias1, float bias2) {
  m = beta1 * m + (1.0f - beta1) * grad;
  v = beta2 * v + (1.0f - beta2) * grad * grad;
  float const m_hat = m / bias1;
  float const v_hat = v / bias2;
  param -= lr * (m_hat / (sqrtf(v_hat) + eps) + weight_decay * param);
}

struct SgdOp {
  float* param;
  float const* grad;
  float* velocity;
  float lr, momentum, weight_decay;
  bool nesterov;
  MGPU_HD void operator()(std::int64_t i) const { sgd_step(param[i], grad[i], velocity[i], lr, momentum, weight_decay, nesterov); }
};

struct AdamWOp {
  float* param;
  float const* grad;
  float* m;
  float* v;
  float lr, beta1, beta2, eps, weight_decay, bias1, bias2;
  MGPU_HD void operator()(std::int64_t i) const {
    adamw_step(param[i], grad[i], m[i], v[i], lr, beta1, beta2, eps, weight_decay, bias1, bias2);
  }
};

/// A counter-based uniform number in [0, 1) (splitmix64 finalizer over seed and counter): the
/// same (seed, i) gives the same number on every device and in backward, so dropout keeps no mask.
MGPU_HD inline std::uint64_t mix64(std::uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
MGPU_HD inline float uniform01(std::uint64_t seed, std::uint64_t counter) {
  return static_cast<float>(mix64(seed ^ mix64(counter)) >> 40) * 5.9604644775390625e-8f;  // 24 bits * 2^-24
}

/// Inverted dropout: y = x / keep where uniform01(seed, offset + i) < keep, else 0. Backward is the
/// same op on dy with the same seed and offset. `offset` is the global index of element 0, so a
/// shard of a batch draws the same mask as those rows of the whole batch.
template <class T>
struct DropoutOp {
  T const* x;
  T* y;
  std::uint64_t seed;
  float keep;
  std::uint64_t offset;
  MGPU_HD void operator()(std::int64_t i) const {
    store(y, i, uniform01(seed, offset + static_cast<std::uint64_t>(i)) < keep ? load(x, i) / keep : 0.0f);
  }
};

/// LayerNorm over the last dimension, one row: y = (x - mean) * rstd * gamma + beta; saves mean and
/// rstd = 1 / sqrt(var + eps) (population variance, two passes) for backward.
template <class T>
struct LayerNormRow {
  T const* x;
  T const* gamma;
  T const* beta;
  T* y;
  float* mean;
  float* rstd;
  std::int64_t cols;
  float eps;
  T const* residual = nullptr;  // when set, sum = x + residual first (sum may be x), and sum is normalized
  T* sum = nullptr;
  static constexpr int lanes = 16;  // the row's sums in independent partial sums: the host loop vectorizes
  MGPU_HD void operator()(std::int64_t r) const {
    T const* xr = x + r * cols;
    if (residual != nullptr) {
      for (std::int64_t j = 0; j < cols; ++j) store(sum + r * cols, j, load(xr, j) + load(residual + r * cols, j));
      xr = sum + r * cols;
    }
    float part[lanes] = {};
    std::int64_t j0 = 0;
    for (; j0 + lanes <= cols; j0 += lanes)
      for (int l = 0; l < lanes; ++l) part[l] += load(xr, j0 + l);
    for (std::int64_t j = j0; j < cols; ++j) part[0] += load(xr, j);
    float sum = 0;
    for (int l = 0; l < lanes; ++l) sum += part[l], part[l] = 0;
    float const mu = sum / static_cast<float>(cols);
    for (j0 = 0; j0 + lanes <= cols; j0 += lanes)
      for (int l = 0; l < lanes; ++l) part[l] += (load(xr, j0 + l) - mu) * (load(xr, j0 + l) - mu);
    for (std::int64_t j = j0; j < cols; ++j) part[0] += (load(xr, j) - mu) * (load(xr, j) - mu);
    float sq = 0;
    for (int l = 0; l < lanes; ++l) sq += part[l];
    float const rs = 1.0f / sqrtf(sq / static_cast<float>(cols) + eps);
    for (std::int64_t j = 0; j < cols; ++j) store(y + r * cols, j, (load(xr, j) - mu) * rs * load(gamma, j) + load(beta, j));
    mean[r] = mu;
    rstd[r] = rs;
  }
};

/// LayerNorm backward, one row: dx = rstd (g - mean(g) - xhat mean(g xhat)) with g = dy * gamma.
template <class T>
struct LayerNormGradRow {
  T const* x;
  T const* gamma;
  T const* dy;
  float const* mean;
  float const* rstd;
  T* dx;
  std::int64_t cols;
  T const* residual = nullptr;      // added to dx when set (a residual path's gradient, in the same pass)
  static constexpr int lanes = 16;  // the row's sums in independent partial sums: the host loop vectorizes
  MGPU_HD void operator()(std::int64_t r) const {
    std::int64_t const base = r * cols;
    float const mu = mean[r], rs = rstd[r];  // in registers: the stores to dx may alias them for all the compiler knows
    float part_g[lanes] = {};
    float part_gx[lanes] = {};
    std::int64_t j0 = 0;
    for (; j0 + lanes <= cols; j0 += lanes)
      for (int l = 0; l < lanes; ++l) {
        float const g = load(dy, base + j0 + l) * load(gamma, j0 + l);
        part_g[l] += g;
        part_gx[l] += g * (load(x, base + j0 + l) - mu) * rs;
      }
    for (std::int64_t j = j0; j < cols; ++j) {
      float const g = load(dy, base + j) * load(gamma, j);
      part_g[0] += g;
      part_gx[0] += g * (load(x, base + j) - mu) * rs;
    }
    float sum_g = 0;
    float sum_gx = 0;
    for (int l = 0; l < lanes; ++l) sum_g += part_g[l], sum_gx += part_gx[l];
    float const n = static_cast<float>(cols);
    for (std::int64_t j = 0; j < cols; ++j) {
      float const g = load(dy, base + j) * load(gamma, j);
      float const xhat = (load(x, base + j) - mu) * rs;
      float const skip = residual != nullptr ? load(residual, base + j) : 0.0f;
      store(dx, base + j, rs * (g - sum_g / n - xhat * sum_gx / n) + skip);
    }
  }
};

/// LayerNorm parameter gradients, one column: dgamma = sum over rows of dy xhat, dbeta = sum of dy
/// (added to dgamma and dbeta with `accumulate`).
template <class T>
struct LayerNormParamGradCol {
  T const* x;
  T const* dy;
  float const* mean;
  float const* rstd;
  T* dgamma;
  T* dbeta;
  std::int64_t rows;
  std::int64_t cols;
  bool accumulate;
  MGPU_HD void operator()(std::int64_t j) const {
    float dg = accumulate ? load(dgamma, j) : 0.0f;
    float db = accumulate ? load(dbeta, j) : 0.0f;
    for (std::int64_t r = 0; r < rows; ++r) {
      float const g = load(dy, r * cols + j);
      dg += g * (load(x, r * cols + j) - mean[r]) * rstd[r];
      db += g;
    }
    store(dgamma, j, dg);
    store(dbeta, j, db);
  }
};

}  // namespace mgpu::detail
