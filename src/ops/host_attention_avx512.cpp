// Host attention's AVX-512 micro-kernels (see host_attention_avx512.hpp). This file is compiled
// with AVX-512 enabled and runs only where the CPU has it, so everything in it has internal
// linkage or is one of the two entry points: no inline function shared with other files (whose
// one kept copy could then hold AVX-512 instructions) is used here.
#include "ops/host_attention_avx512.hpp"

#include <immintrin.h>

namespace mgpu::ops::host::avx512 {
namespace {

using i64 = std::int64_t;
constexpr i64 lanes = 16;

i64 lower(i64 a, i64 b) { return a < b ? a : b; }
i64 upper(i64 a, i64 b) { return a > b ? a : b; }
i64 chunks(i64 n) { return (n + lanes - 1) / lanes; }
float upper_f(float a, float b) { return a > b ? a : b; }

// detail::exp_vec (core/detail/training_math.hpp) on 16 lanes: the same operations in the same
// order, so the same results.
inline __m512 exp16(__m512 x) {
  __m512 c = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));  // NaN -> -87, as exp_vec
  c = _mm512_min_ps(c, _mm512_set1_ps(88.0f));
  __m512 const shift = _mm512_set1_ps(12582912.0f);
  __m512 const n = _mm512_sub_ps(_mm512_fmadd_ps(c, _mm512_set1_ps(1.44269504088896341f), shift), shift);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), c);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  __m512 const e = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  __m512i const bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  __m512 y = _mm512_mul_ps(e, _mm512_castsi512_ps(bits));
  __mmask16 const big = _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.0f), _CMP_NLE_UQ);  // x > 88 or NaN
  y = _mm512_mask_add_ps(y, big, x, _mm512_set1_ps(__builtin_inff()));
  return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ), _mm512_setzero_ps());
}

// ln x for 16 finite x >= 1 (each row's sum of exponentials, whose largest term is 1): x = m 2^k
// with m in [sqrt(1/2), sqrt(2)), then ln(1 + f) for f = m - 1 as f - f^2 / 2 + f^3 P(f), P of
// degree 8 (the classic single-precision logf coefficients), plus k ln 2 in two parts.
inline __m512 log16(__m512 x) {
  __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);  // [1, 2)
  __m512 k = _mm512_getexp_ps(x);
  __mmask16 const high = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.41421356237f), _CMP_GT_OQ);
  m = _mm512_mask_mul_ps(m, high, m, _mm512_set1_ps(0.5f));
  k = _mm512_mask_add_ps(k, high, k, _mm512_set1_ps(1.0f));
  __m512 const f = _mm512_sub_ps(m, _mm512_set1_ps(1.0f));
  __m512 p = _mm512_set1_ps(7.0376836292e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(-1.1514610310e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.1676998740e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(-1.2420140846e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.4249322787e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(-1.6668057665e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.0000714765e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(-2.4999993993e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(3.3333331174e-1f));
  __m512 const f2 = _mm512_mul_ps(f, f);
  __m512 y = _mm512_mul_ps(_mm512_mul_ps(p, f), f2);                             // f^3 P(f)
  y = _mm512_fmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), y);                    // k ln 2, its small part
  y = _mm512_fmadd_ps(f2, _mm512_set1_ps(-0.5f), y);                             // - f^2 / 2
  return _mm512_fmadd_ps(k, _mm512_set1_ps(0.693359375f), _mm512_add_ps(f, y));  // + f + k ln 2
}

// r[i][j] becomes r[j][i]: a 16 x 16 block of floats transposed in registers (pairs of rows
// interleaved, then pairs of pairs, then 128-bit quarters twice).
inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    __m512d const a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    __m512d const c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xdd);
    t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
  }
}

// A value loaded into a register and kept there: without this GCC folds the load into each of
// the fused multiply-adds that use it, one load per use (the loops here would then be bound by
// loads, not by the multiply-adds).
inline __m512 in_register(__m512 x) {
  asm("" : "+v"(x));
  return x;
}

// The lanes of key chunk [16 c, 16 c + 16) of a tile that a row seeing n of its keys sees.
inline __mmask16 seen(i64 n, i64 c) {
  return _mm512_cmplt_epi32_mask(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                 _mm512_set1_epi32(static_cast<int>(n - c * lanes)));
}

// Blocks of rows [begin, end): f<R>(r) for r in steps of R, the rest in blocks of R / 2, ... 1.
template <int R, class F>
inline void in_blocks(i64 begin, i64 end, F const& f) {
  i64 r = begin;
  for (; r + R <= end; r += R) f.template operator()<R>(r);
  if constexpr (R > 1) in_blocks<R / 2>(r, end, f);
}

// rows [r D, r D + D) = a[r lda, r lda + D) for r < R: the rows a register block broadcasts from,
// next to each other (one pointer and constant offsets, where rows of the sequence's stride would
// take a pointer register each).
template <int D, int R>
inline void gather_rows(float const* a, i64 lda, float* rows) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < D / lanes; ++v)
      _mm512_store_ps(rows + r * D + v * lanes, _mm512_loadu_ps(a + r * lda + v * lanes));
}

// acc[r][c] = sum over e < D of a[r D + e] bt[e ldt + 16 c + lane]: R rows of a tile of scores
// (or of dP; rows gathered by gather_rows), C chunks of 16 keys.
template <int D, int R, int C>
inline void scores(float const* a, float const* bt, i64 ldt, __m512 (&acc)[R][C]) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int e = 0; e < D; ++e) {
    __m512 b[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) b[c] = in_register(_mm512_loadu_ps(bt + e * ldt + c * lanes));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512 const x = _mm512_set1_ps(a[r * D + e]);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(x, b[c], acc[r][c]);
    }
  }
}

// scores() of two products at once, their loads interleaved: S = q kᵀ and dP = dy vᵀ of the same
// rows and keys (twice the independent accumulators, to cover the multiply-adds' latency).
template <int D, int R, int C>
inline void scores_pair(float const* a, float const* bt, float const* a2, float const* bt2, i64 ldt,
                        __m512 (&acc)[R][C], __m512 (&acc2)[R][C]) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c) acc[r][c] = acc2[r][c] = _mm512_setzero_ps();
  for (int e = 0; e < D; ++e) {
    __m512 b[C], b2[C];
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c) {
      b[c] = in_register(_mm512_loadu_ps(bt + e * ldt + c * lanes));
      b2[c] = in_register(_mm512_loadu_ps(bt2 + e * ldt + c * lanes));
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512 const x = _mm512_set1_ps(a[r * D + e]), x2 = _mm512_set1_ps(a2[r * D + e]);
#pragma GCC unroll 2
      for (int c = 0; c < C; ++c) {
        acc[r][c] = _mm512_fmadd_ps(x, b[c], acc[r][c]);
        acc2[r][c] = _mm512_fmadd_ps(x2, b2[c], acc2[r][c]);
      }
    }
  }
}

// out rows [0, R) (stride ldo) += sum over j in [j0, n) of w[r ldr + j ldj] b[j ldb, 0..D), R x D
// accumulators in registers: the products of a tile's probabilities (or dS) with rows of v (or
// k), ldr the tile's row stride and ldj 1, and their transposes (dv += Pᵀ dy, dk += dSᵀ q for R
// keys), ldr 1 and ldj the tile's row stride, j0 the first query that sees the keys. GCC inlines
// it into each call, where the stride that is 1 is a constant (offsets in the instructions).
template <int D, int R>
inline void times_rows(float const* w, i64 ldr, i64 ldj, float const* b, i64 ldb, i64 j0, i64 n, float* out, i64 ldo) {
  constexpr int V = D / lanes;
  __m512 acc[R][V];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_loadu_ps(out + r * ldo + v * lanes);
  for (i64 j = j0; j < n; ++j) {
    __m512 row[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) row[v] = in_register(_mm512_loadu_ps(b + j * ldb + v * lanes));
    float const* wj = w + j * ldj;
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      __m512 const x = _mm512_set1_ps(wj[r * ldr]);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(x, row[v], acc[r][v]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(out + r * ldo + v * lanes, acc[r][v]);
}

// The register blocks: 4 queries x 64 keys for the forward's scores (16 accumulators), and 24
// accumulators (rows or keys x D / 16 vectors) for the products with rows of d. The backward's S
// and dP: 4 queries x 16 keys each at d 32, 8 x 16 at d 64 (in BM_attention's shapes, 8 rows
// made GPT-2 small's attention 1.1x faster and nano's 1.25x slower; 2 x 32 keys, with the
// exponential's constants, spilled accumulators to the stack).
constexpr int score_rows = 4;
template <int D>
constexpr int pair_rows = D == 64 ? 8 : 4;
template <int D>
constexpr int product_rows = 24 / (D / lanes);

template <int D>
void forward_head(Head const& h) {
  constexpr int V = D / lanes;
  i64 const t = h.t, lds = chunks(h.bk) * lanes;  // scratch_row(bk), without the header's inline copy
  __m512 const scale = _mm512_set1_ps(h.scale);
  for (i64 i0 = 0; i0 < t; i0 += h.bq) {
    i64 const rows = lower(h.bq, t - i0);
    for (i64 r = 0; r < rows; ++r) {
      h.m[r] = -__builtin_inff();  // the running maximum of the unscaled scores
      h.l[r] = 0.0f;
      for (int v = 0; v < V; ++v) _mm512_storeu_ps(h.acc + r * D + v * lanes, _mm512_setzero_ps());
    }
    for (i64 j0 = 0; j0 < i0 + rows; j0 += h.bk) {
      i64 const cols = lower(h.bk, i0 + rows - j0), r0 = upper(0, j0 - i0);  // rows before r0 see none
      // The scores of rows [r, r + R), masked; then each row's maximum, rescaled sums and
      // exponentials, the chunks its block skipped zeroed.
      in_blocks<score_rows>(r0, rows, [&]<int R>(i64 r) {
        i64 const n_block = lower(i0 + r + R - j0, cols), n_chunks = chunks(n_block);
        alignas(64) float q[R * D];
        gather_rows<D, R>(h.q + (i0 + r) * h.ld_qkv, h.ld_qkv, q);
        __m512 row_max[R];
#pragma GCC unroll 8
        for (int k = 0; k < R; ++k) row_max[k] = _mm512_set1_ps(-__builtin_inff());
        auto const block = [&]<int C>(i64 c) {
          __m512 acc[R][C];
          scores<D, R, C>(q, h.kt + j0 + c * lanes, h.ldt, acc);
#pragma GCC unroll 8
          for (int k = 0; k < R; ++k)
#pragma GCC unroll 4
            for (int cc = 0; cc < C; ++cc) {
              __mmask16 const mask = seen(lower(i0 + r + k - j0 + 1, cols), c + cc);
              __m512 const s = _mm512_mask_mov_ps(_mm512_set1_ps(-__builtin_inff()), mask, acc[k][cc]);
              _mm512_storeu_ps(h.s + (r + k) * lds + (c + cc) * lanes, s);
              row_max[k] = _mm512_max_ps(row_max[k], s);
            }
        };
        i64 c = 0;
        for (; c + 4 <= n_chunks; c += 4) block.template operator()<4>(c);
        if (c + 2 <= n_chunks) {
          block.template operator()<2>(c);
          c += 2;
        }
        if (c < n_chunks) block.template operator()<1>(c);
#pragma GCC unroll 8
        for (int k = 0; k < R; ++k) {
          float* s = h.s + (r + k) * lds;
          float* acc = h.acc + (r + k) * D;
          float const m_old = h.m[r + k], m_new = upper_f(m_old, _mm512_reduce_max_ps(row_max[k]));
          if (m_new != m_old && h.l[r + k] != 0.0f) {  // rescale what earlier key tiles summed
            __m512 const correction = exp16(_mm512_mul_ps(_mm512_set1_ps(m_old - m_new), scale));
            h.l[r + k] *= _mm512_cvtss_f32(correction);
            for (int v = 0; v < V; ++v)
              _mm512_storeu_ps(acc + v * lanes, _mm512_mul_ps(_mm512_loadu_ps(acc + v * lanes), correction));
          }
          h.m[r + k] = m_new;
          __m512 const m = _mm512_set1_ps(m_new);
          __m512 sum = _mm512_setzero_ps();
          for (i64 cc = 0; cc < n_chunks; ++cc) {
            __m512 const p = exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(s + cc * lanes), m), scale));
            _mm512_storeu_ps(s + cc * lanes, p);
            sum = _mm512_add_ps(sum, p);
          }
          for (i64 cc = n_chunks; cc < chunks(cols); ++cc) _mm512_storeu_ps(s + cc * lanes, _mm512_setzero_ps());
          h.l[r + k] += _mm512_reduce_add_ps(sum);
        }
      });
      in_blocks<product_rows<D>>(r0, rows, [&]<int R>(i64 r) {
        times_rows<D, R>(h.s + r * lds, lds, 1, h.v + j0 * h.ld_qkv, h.ld_qkv, 0, lower(i0 + r + R - j0, cols),
                         h.acc + r * D, D);
      });
    }
    for (i64 r = 0; r < rows; r += lanes) {  // the rows' log-sum-exps, 16 at a time
      __mmask16 const in_tile = seen(rows - r, 0);
      __m512 const l = _mm512_mask_loadu_ps(_mm512_set1_ps(1.0f), in_tile, h.l + r);
      __m512 const lse = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(in_tile, h.m + r), scale, log16(l));
      _mm512_mask_storeu_ps(h.lse_out + i0 + r, in_tile, lse);
    }
    for (i64 r = 0; r < rows; ++r) {
      __m512 const inverse = _mm512_set1_ps(1.0f / h.l[r]);
      for (int v = 0; v < V; ++v)
        _mm512_storeu_ps(h.y + (i0 + r) * h.ld_y + v * lanes,
                         _mm512_mul_ps(_mm512_loadu_ps(h.acc + r * D + v * lanes), inverse));
    }
  }
}

template <int D>
void backward_head(Head const& h) {
  i64 const t = h.t, lds = chunks(h.bk) * lanes;  // scratch_row(bk), without the header's inline copy
  __m512 const scale = _mm512_set1_ps(h.scale);
  constexpr int V = D / lanes;
  for (i64 i0 = 0; i0 < t; i0 += h.bq) {
    i64 const rows = lower(h.bq, t - i0);
    // The queries of this tile are the first to reach dq's rows [i0, i0 + rows), and dk's and dv's
    // (a key is seen by the queries from its own on): zeroed here, in cache, not in a pass before.
    float* const gradients[] = {h.dq, h.dk, h.dv};
    for (i64 i = i0; i < i0 + rows; ++i)
      for (float* g : gradients)
        for (int v = 0; v < V; ++v) _mm512_storeu_ps(g + i * h.ld_qkv + v * lanes, _mm512_setzero_ps());
    for (i64 j0 = 0; j0 < i0 + rows; j0 += h.bk) {
      i64 const cols = lower(h.bk, i0 + rows - j0), first = i0 + upper(0, j0 - i0), n_rows = i0 + rows - first;
      // P and dS of rows [r, r + R) (of the n_rows from `first`), formed in registers.
      in_blocks<pair_rows<D>>(0, n_rows, [&]<int R>(i64 r) {
        i64 const n_block = lower(first + r + R - j0, cols), n_chunks = chunks(n_block);
        alignas(64) float q[R * D], dy[R * D];
        gather_rows<D, R>(h.q + (first + r) * h.ld_qkv, h.ld_qkv, q);
        gather_rows<D, R>(h.dy + (first + r) * h.ld_y, h.ld_y, dy);
        auto const block = [&]<int C>(i64 c) {
          __m512 s[R][C], dp[R][C];
          scores_pair<D, R, C>(q, h.kt + j0 + c * lanes, dy, h.vt + j0 + c * lanes, h.ldt, s, dp);
#pragma GCC unroll 8
          for (int k = 0; k < R; ++k) {
            i64 const i = first + r + k;
            __m512 const lse = _mm512_set1_ps(-h.lse[i]), row_dot = _mm512_set1_ps(h.row_dot[i]);
#pragma GCC unroll 4
            for (int cc = 0; cc < C; ++cc) {
              __mmask16 const mask = seen(lower(i - j0 + 1, cols), c + cc);
              __m512 const p = exp16(_mm512_fmadd_ps(s[k][cc], scale, lse));
              __m512 const g = _mm512_mul_ps(_mm512_mul_ps(p, _mm512_sub_ps(dp[k][cc], row_dot)), scale);
              _mm512_storeu_ps(h.s + (r + k) * lds + (c + cc) * lanes, _mm512_maskz_mov_ps(mask, p));
              _mm512_storeu_ps(h.ds + (r + k) * lds + (c + cc) * lanes, _mm512_maskz_mov_ps(mask, g));
            }
          }
        };
        for (i64 c = 0; c < n_chunks; ++c) block.template operator()<1>(c);
#pragma GCC unroll 8
        for (int k = 0; k < R; ++k)
          for (i64 cc = n_chunks; cc < chunks(cols); ++cc) {
            _mm512_storeu_ps(h.s + (r + k) * lds + cc * lanes, _mm512_setzero_ps());
            _mm512_storeu_ps(h.ds + (r + k) * lds + cc * lanes, _mm512_setzero_ps());
          }
      });
      // dv += Pᵀ dy and dk += dSᵀ q for keys [j, j + K): the queries before a key do not see it.
      in_blocks<product_rows<D>>(0, cols, [&]<int K>(i64 j) {
        i64 const from = upper(0, j0 + j - first);
        times_rows<D, K>(h.s + j, 1, lds, h.dy + first * h.ld_y, h.ld_y, from, n_rows, h.dv + (j0 + j) * h.ld_qkv,
                         h.ld_qkv);
        times_rows<D, K>(h.ds + j, 1, lds, h.q + first * h.ld_qkv, h.ld_qkv, from, n_rows, h.dk + (j0 + j) * h.ld_qkv,
                         h.ld_qkv);
      });
      in_blocks<product_rows<D>>(0, n_rows, [&]<int R>(i64 r) {
        times_rows<D, R>(h.ds + r * lds, lds, 1, h.k + j0 * h.ld_qkv, h.ld_qkv, 0, lower(first + r + R - j0, cols),
                         h.dq + (first + r) * h.ld_qkv, h.ld_qkv);
      });
    }
  }
}

}  // namespace

void pack_transposed(float const* src, std::int64_t stride, std::int64_t t, std::int64_t heads, std::int64_t d,
                     float* dst, std::int64_t ldt) noexcept {
  for (i64 j0 = 0; j0 < t; j0 += lanes) {
    i64 const n = lower(lanes, t - j0);
    for (i64 col = 0; col < heads * d; col += lanes) {
      __m512 r[lanes];
      for (i64 i = 0; i < lanes; ++i)
        r[i] = i < n ? _mm512_loadu_ps(src + (j0 + i) * stride + col) : _mm512_setzero_ps();
      transpose16(r);
      float* out = dst + (col / d) * d * ldt + (col % d) * ldt + j0;
      for (i64 e = 0; e < lanes; ++e) _mm512_storeu_ps(out + e * ldt, r[e]);
    }
  }
}

void forward(Head const& head) noexcept {
  if (head.d == 32)
    forward_head<32>(head);
  else
    forward_head<64>(head);
}

void backward(Head const& head) noexcept {
  if (head.d == 32)
    backward_head<32>(head);
  else
    backward_head<64>(head);
}

}  // namespace mgpu::ops::host::avx512
