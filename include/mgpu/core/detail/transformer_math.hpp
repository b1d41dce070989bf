// Element, row and column functors of the transformer ops (mgpu/ops/transformer.hpp), written once
// as __host__ __device__ code: src/ops/transformer.cpp runs them with a loop on a host stream's
// worker (except attention, which the host computes by tiles through GEMMs there),
// src/kernels/transformer.cu over a CUDA grid. Each is called as op(i) for i in [0, n);
// every output element is written by one call, which sums in a fixed order (no atomics), so results
// are bitwise reproducible. Storage may be float32, bfloat16 or float16; the math is float32.
#pragma once

#include <cmath>
#include <cstdint>

#include <mgpu/core/host_device.hpp>
#include <mgpu/core/detail/training_math.hpp>

namespace mgpu::detail {

/// Keys per tile of the attention forward: one rescale of the running sums per tile.
inline constexpr std::int64_t attention_key_tile = 32;

/// The dot product of a[0, n) and b[0, n) in float32 with eight partial sums combined in a fixed
/// tree (independent chains the CPU overlaps; the same order on every device and run).
template <class A, class B>
MGPU_HD inline float dot(A const* a, B const* b, std::int64_t n) {
  float s[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  std::int64_t e = 0;
  for (; e + 8 <= n; e += 8)
    for (int u = 0; u < 8; ++u) s[u] += static_cast<float>(a[e + u]) * static_cast<float>(b[e + u]);
  for (; e < n; ++e) s[0] += static_cast<float>(a[e]) * static_cast<float>(b[e]);
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

/// y[n, e] = wte[ids[n], e] + wpe[n mod t, e], over n * c + e; NaN for an id outside [0, vocab)
/// (the op fails the stream for it; this only keeps the read in bounds).
template <class T>
struct EmbeddingOp {
  std::int32_t const* ids;
  T const* wte;
  T const* wpe;
  T* y;
  std::int64_t t, c, vocab;
  MGPU_HD void operator()(std::int64_t i) const {
    std::int64_t const n = i / c, e = i % c;
    std::int32_t const id = ids[n];
    y[i] = id < 0 || id >= vocab ? T(NAN)
                                 : T(static_cast<float>(wte[id * c + e]) + static_cast<float>(wpe[(n % t) * c + e]));
  }
};

/// A vocab-parallel rank's part of EmbeddingOp, over n * c + e: y[n, e] = wte[ids[n] - begin, e]
/// for an id in [begin, begin + rows) (wte holds those rows) and 0 for any other id, plus
/// wpe[n mod t, e] when `positions`. Summed over ranks whose rows cover the vocab, one of them
/// adding the positions, it is EmbeddingOp's y exactly (one term besides zeros).
template <class T>
struct VocabShardEmbeddingOp {
  std::int32_t const* ids;
  T const* wte;
  T const* wpe;
  T* y;
  std::int64_t t, c, begin, rows;
  bool positions;
  MGPU_HD void operator()(std::int64_t i) const {
    std::int64_t const n = i / c, e = i % c, row = ids[n] - begin;
    float const token = row >= 0 && row < rows ? static_cast<float>(wte[row * c + e]) : 0.0f;
    y[i] = positions ? T(token + static_cast<float>(wpe[(n % t) * c + e])) : T(token);
  }
};

/// The tokens of each id, in position order: offsets [vocab + 1] and positions [n_tokens] such that
/// positions[offsets[v] .. offsets[v + 1]) are the positions holding v. Three passes: count per id
/// (op(v)), an exclusive scan (op(0) only), the lists (op(v)). Ids outside [0, vocab) are left out.
/// With `begin`, v stands for id begin + v (a vocab-parallel rank's rows).
struct TokenCountOp {
  std::int32_t const* ids;
  std::int64_t n_tokens;
  std::int32_t* offsets;  // counts into offsets[v + 1]
  std::int64_t begin = 0;
  MGPU_HD void operator()(std::int64_t v) const {
    std::int32_t count = 0;
    for (std::int64_t n = 0; n < n_tokens; ++n) count += ids[n] == begin + v ? 1 : 0;
    offsets[v + 1] = count;
  }
};
struct TokenScanOp {
  std::int32_t* offsets;
  std::int64_t vocab;
  MGPU_HD void operator()(std::int64_t) const {
    offsets[0] = 0;
    for (std::int64_t v = 0; v < vocab; ++v) offsets[v + 1] += offsets[v];
  }
};
struct TokenListOp {
  std::int32_t const* ids;
  std::int64_t n_tokens;
  std::int32_t const* offsets;
  std::int32_t* positions;
  std::int64_t begin = 0;
  MGPU_HD void operator()(std::int64_t v) const {
    std::int32_t k = offsets[v];
    for (std::int64_t n = 0; n < n_tokens; ++n)
      if (ids[n] == begin + v) positions[k++] = static_cast<std::int32_t>(n);
  }
};

/// dwte[v, e] (+)= sum of dy[n, e] over the positions n of id v, in position order; over v * c + e.
template <class T>
struct EmbeddingTokenGradOp {
  std::int32_t const* offsets;
  std::int32_t const* positions;
  T const* dy;
  T* dwte;
  std::int64_t c;
  bool accumulate;
  MGPU_HD void operator()(std::int64_t i) const {
    std::int64_t const v = i / c, e = i % c;
    float sum = accumulate ? static_cast<float>(dwte[i]) : 0.0f;
    for (std::int32_t k = offsets[v]; k < offsets[v + 1]; ++k) sum += static_cast<float>(dy[positions[k] * c + e]);
    dwte[i] = T(sum);
  }
};

/// dwpe[p, e] (+)= sum over b of dy[b, p, e] (0 for positions p >= t); over positions * c + e.
template <class T>
struct EmbeddingPositionGradOp {
  T const* dy;
  T* dwpe;
  std::int64_t batch, t, c;
  bool accumulate;
  MGPU_HD void operator()(std::int64_t i) const {
    std::int64_t const p = i / c, e = i % c;
    float sum = accumulate ? static_cast<float>(dwpe[i]) : 0.0f;
    if (p < t)
      for (std::int64_t b = 0; b < batch; ++b) sum += static_cast<float>(dy[(b * t + p) * c + e]);
    dwpe[i] = T(sum);
  }
};

/// Attention dropout: element (b, h, i, j) kept when uniform01(seed, counter) < 1 - p (see
/// ops::AttentionDropout); p = 0 keeps everything.
struct AttentionMask {
  float p;
  std::uint64_t seed;
  std::int64_t row_offset, heads, t;
  std::int64_t head_offset = 0;  // the index of the op's head 0 among `heads`
  /// 1 / (1 - p) for a kept element, 0 for a dropped one, 1 without dropout.
  MGPU_HD float factor(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const {
    if (p == 0.0f) return 1.0f;
    auto const counter = static_cast<std::uint64_t>((((row_offset + b) * heads + head_offset + h) * t + i) * t + j);
    return mgpu::detail::uniform01(seed, counter) < 1.0f - p ? 1.0f / (1.0f - p) : 0.0f;
  }
};

/// The geometry of causal attention over qkv [B, T, 3C]: row r = (b heads + h) T + i is query i of
/// head h of sequence b; d = C / heads.
struct AttentionShape {
  std::int64_t t, c, heads;
  MGPU_HD std::int64_t d() const { return c / heads; }
  MGPU_HD std::int64_t q(std::int64_t r) const { return token(r) * 3 * c + head(r) * d(); }  // offset in qkv
  MGPU_HD std::int64_t k(std::int64_t r, std::int64_t j) const {
    return (sequence(r) * t + j) * 3 * c + c + head(r) * d();
  }
  MGPU_HD std::int64_t v(std::int64_t r, std::int64_t j) const { return k(r, j) + c; }
  MGPU_HD std::int64_t out(std::int64_t r) const { return token(r) * c + head(r) * d(); }  // offset in y, dy
  MGPU_HD std::int64_t query(std::int64_t r) const { return r % t; }
  MGPU_HD std::int64_t head(std::int64_t r) const { return (r / t) % heads; }
  MGPU_HD std::int64_t sequence(std::int64_t r) const { return r / t / heads; }
  MGPU_HD std::int64_t token(std::int64_t r) const { return sequence(r) * t + query(r); }
};

/// One query row of causal attention with an online softmax over key tiles: y (through the float
/// accumulator acc [B, T, C]) and lse[r], the row's log-sum-exp of scaled scores. Over B heads T rows.
template <class T>
struct AttentionForwardRow {
  T const* qkv;
  T* y;
  float* lse;
  float* acc;
  AttentionShape s;
  AttentionMask mask;
  MGPU_HD void operator()(std::int64_t r) const {
    std::int64_t const d = s.d(), i = s.query(r), b = s.sequence(r), h = s.head(r);
    float const scale = 1.0f / sqrtf(static_cast<float>(d));
    T const* q = qkv + s.q(r);
    float* a = acc + s.out(r);
    for (std::int64_t e = 0; e < d; ++e) a[e] = 0.0f;
    float m = -INFINITY;
    float l = 0.0f;
    float score[attention_key_tile];
    for (std::int64_t j0 = 0; j0 <= i; j0 += attention_key_tile) {
      std::int64_t const j1 = i + 1 < j0 + attention_key_tile ? i + 1 : j0 + attention_key_tile;
      float tile_max = -INFINITY;
      for (std::int64_t j = j0; j < j1; ++j) {
        score[j - j0] = dot(q, qkv + s.k(r, j), d) * scale;
        tile_max = fmaxf(tile_max, score[j - j0]);
      }
      float const m_new = fmaxf(m, tile_max);
      float const correction = expf(m - m_new);  // 0 on the first tile (m = -inf)
      l *= correction;
      for (std::int64_t e = 0; e < d; ++e) a[e] *= correction;
      for (std::int64_t j = j0; j < j1; ++j) {
        float const p = expf(score[j - j0] - m_new);
        l += p;
        float const kept = p * mask.factor(b, h, i, j);
        if (kept == 0.0f) continue;
        T const* v = qkv + s.v(r, j);
        for (std::int64_t e = 0; e < d; ++e) a[e] += kept * static_cast<float>(v[e]);
      }
      m = m_new;
    }
    T* out = y + s.out(r);
    for (std::int64_t e = 0; e < d; ++e) out[e] = T(a[e] / l);
    lse[r] = m + logf(l);
  }
};

/// row_dot[r] = dy_r . y_r (= the sum over keys of P dP, which the softmax gradient subtracts).
template <class T>
struct AttentionRowDot {
  T const* y;
  T const* dy;
  float* row_dot;
  AttentionShape s;
  MGPU_HD void operator()(std::int64_t r) const { row_dot[r] = dot(dy + s.out(r), y + s.out(r), s.d()); }
};

/// The attention gradient, probabilities recomputed from lse. For `keys` false, row r is query i and
/// writes dq_i = scale sum over j <= i of dS_ij k_j into dacc [B, T, 3C] (float); for `keys` true,
/// row r is key j and writes dk_j = scale sum over i >= j of dS_ij q_i and dv_j = sum of P_ij Z_ij
/// dy_i, with dS_ij = P_ij (Z_ij dy_i . v_j - row_dot_i) and Z the dropout factor.
template <class T>
struct AttentionGradRow {
  T const* qkv;
  T const* dy;
  float const* lse;
  float const* row_dot;
  float* dacc;
  AttentionShape s;
  AttentionMask mask;
  bool keys;
  MGPU_HD void operator()(std::int64_t r) const {
    std::int64_t const d = s.d(), b = s.sequence(r), h = s.head(r), self = s.query(r);
    float const scale = 1.0f / sqrtf(static_cast<float>(d));
    std::int64_t const first_row = r - self;  // row of query 0 of this head and sequence
    float* dq_or_dk = dacc + (keys ? s.k(r, self) : s.q(r));
    float* dv = dacc + s.v(r, self);
    for (std::int64_t e = 0; e < d; ++e) {
      dq_or_dk[e] = 0.0f;
      if (keys) dv[e] = 0.0f;
    }
    std::int64_t const begin = keys ? self : 0;
    std::int64_t const end = keys ? s.t : self + 1;
    for (std::int64_t other = begin; other < end; ++other) {
      std::int64_t const i = keys ? other : self;  // query
      std::int64_t const j = keys ? self : other;  // key
      std::int64_t const qr = first_row + i;
      T const* q = qkv + s.q(qr);
      T const* k = qkv + s.k(r, j);
      T const* v = qkv + s.v(r, j);
      T const* g = dy + s.out(qr);
      float const p = expf(dot(q, k, d) * scale - lse[qr]);
      float const z = mask.factor(b, h, i, j);
      float const ds = p * (z * dot(g, v, d) - row_dot[qr]) * scale;
      if (keys) {
        for (std::int64_t e = 0; e < d; ++e) {
          dq_or_dk[e] += ds * static_cast<float>(q[e]);
          dv[e] += p * z * static_cast<float>(g[e]);
        }
      } else {
        for (std::int64_t e = 0; e < d; ++e) dq_or_dk[e] += ds * static_cast<float>(k[e]);
      }
    }
  }
};

/// One row of per-token cross-entropy: row_loss[i] = -log softmax(logits_i)[target] and dlogits_i
/// = (softmax - onehot) * grad / divisor-scale `g`; 0 and a zero row for target == ignore_index;
/// NaN and a zero row for a target outside [0, vocab) (the op fails the stream for it).
template <class T>
struct TokenCrossEntropyRow {
  T const* logits;
  std::int32_t const* targets;
  T* dlogits;
  float* row_loss;
  std::int64_t vocab;
  std::int32_t ignore_index;
  float g;
  MGPU_HD void operator()(std::int64_t i) const {
    T const* x = logits + i * vocab;
    T* dx = dlogits + i * vocab;
    std::int32_t const target = targets[i];
    if (target == ignore_index || target < 0 || target >= vocab) {
      for (std::int64_t j = 0; j < vocab; ++j) dx[j] = T(0.0f);
      row_loss[i] = target == ignore_index ? 0.0f : NAN;
      return;
    }
    float max = -INFINITY;  // a comparison, not fmaxf: the host loops vectorize (exp_vec too)
    for (std::int64_t j = 0; j < vocab; ++j) max = static_cast<float>(x[j]) > max ? static_cast<float>(x[j]) : max;
    float sum = 0.0f;
    for (std::int64_t j = 0; j < vocab; ++j) sum += mgpu::detail::exp_vec(static_cast<float>(x[j]) - max);
    float const log_sum = max + logf(sum);
    row_loss[i] = log_sum - static_cast<float>(x[target]);
    for (std::int64_t j = 0; j < vocab; ++j)
      dx[j] = T((mgpu::detail::exp_vec(static_cast<float>(x[j]) - log_sum) - (j == target ? 1.0f : 0.0f)) * g);
  }
};

/// The vocab-parallel cross-entropy's passes over a rank's logits [N, cols], whose column j is
/// token id begin + j of a vocab of `vocab` (ops::vocab_shard_cross_entropy). The first: max[i] =
/// row i's largest logit.
template <class T>
struct VocabShardRowMax {
  T const* logits;
  float* max;
  std::int64_t cols;
  MGPU_HD void operator()(std::int64_t i) const {
    T const* x = logits + i * cols;
    float m = -INFINITY;  // a comparison, as TokenCrossEntropyRow's
    for (std::int64_t j = 0; j < cols; ++j) m = static_cast<float>(x[j]) > m ? static_cast<float>(x[j]) : m;
    max[i] = m;
  }
};

/// The second, with max[i] the largest logit of the whole row (reduced over the ranks): sums[2 i]
/// = the sum of exp(logit - max[i]) over the rank's columns, sums[2 i + 1] = the target's logit when
/// the rank holds the target's column, else 0.
template <class T>
struct VocabShardRowSums {
  T const* logits;
  std::int32_t const* targets;
  float const* max;
  float* sums;
  std::int64_t cols, begin;
  MGPU_HD void operator()(std::int64_t i) const {
    T const* x = logits + i * cols;
    float sum = 0.0f;
    for (std::int64_t j = 0; j < cols; ++j) sum += mgpu::detail::exp_vec(static_cast<float>(x[j]) - max[i]);
    std::int64_t const column = targets[i] - begin;
    sums[2 * i] = sum;
    sums[2 * i + 1] = column >= 0 && column < cols ? static_cast<float>(x[column]) : 0.0f;
  }
};

/// The third, with max and sums reduced over the ranks: TokenCrossEntropyRow's row_loss and its
/// dlogits on the rank's columns (0 and a zero row for target == ignore_index; NaN and a zero row
/// for a target outside [0, vocab), which the op fails the stream for).
template <class T>
struct VocabShardCrossEntropyRow {
  T const* logits;
  std::int32_t const* targets;
  float const* max;
  float const* sums;
  T* dlogits;
  float* row_loss;
  std::int64_t cols, begin, vocab;
  std::int32_t ignore_index;
  float g;
  MGPU_HD void operator()(std::int64_t i) const {
    T const* x = logits + i * cols;
    T* dx = dlogits + i * cols;
    std::int32_t const target = targets[i];
    if (target == ignore_index || target < 0 || target >= vocab) {
      for (std::int64_t j = 0; j < cols; ++j) dx[j] = T(0.0f);
      row_loss[i] = target == ignore_index ? 0.0f : NAN;
      return;
    }
    float const log_sum = max[i] + logf(sums[2 * i]);
    row_loss[i] = log_sum - sums[2 * i + 1];
    std::int64_t const column = target - begin;
    for (std::int64_t j = 0; j < cols; ++j)
      dx[j] = T((mgpu::detail::exp_vec(static_cast<float>(x[j]) - log_sum) - (j == column ? 1.0f : 0.0f)) * g);
  }
};

/// *loss = (sum of row_loss in row order, in double) / divisor; op(0) only.
struct RowLossSum {
  float const* row_loss;
  std::int64_t rows;
  float* loss;
  float divisor;
  MGPU_HD void operator()(std::int64_t) const {
    double total = 0.0;
    for (std::int64_t i = 0; i < rows; ++i) total += static_cast<double>(row_loss[i]);
    *loss = static_cast<float>(total / static_cast<double>(divisor));
  }
};

}  // namespace mgpu::detail
