// Causal attention on a host stream's worker: tiles of scores and their products through a
// register-blocked float32 micro-kernel (product, skipping the blocks the causal mask zeroes) on
// float32 q, k, v, dy and dqkv in place (16-bit storage through per-sequence float copies) and k, v
// packed transposed once per sequence, and an online softmax in loops the compiler vectorizes
// (exp_vec, maxima and sums in 16 independent lanes, rows in whole masked vectors). Float32 heads
// of 32 or 64 without dropout run host_attention_avx512.cpp's kernels where the CPU has AVX-512.
#include "ops/host_attention.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <new>
#include <type_traits>
#include <vector>

#include <mgpu/core/detail/training_math.hpp>

#include "ops/host_attention_avx512.hpp"

namespace mgpu::ops {
namespace {
std::atomic<std::int64_t> tile_queries{0};
std::atomic<std::int64_t> tile_keys{0};
}  // namespace

void set_host_attention_tiles(AttentionTiles tiles) noexcept {
  tile_queries.store(tiles.queries, std::memory_order_relaxed);
  tile_keys.store(tiles.keys, std::memory_order_relaxed);
}

namespace host {

AttentionTiles attention_tiles() noexcept {
  AttentionTiles const set{tile_queries.load(std::memory_order_relaxed), tile_keys.load(std::memory_order_relaxed)};
  if (set.queries > 0 && set.keys > 0) return set;
  // BM_attention's rows (bench/results/2026-12-06-cpu-gpt-step-host-ops.json's sweep, a loaded
  // 2-core AMD EPYC): since the register blocks above the diagonal are skipped, taller query blocks
  // no longer compute the diagonal tile's masked half, and 64 x 128 is among the fastest on both
  // shapes (nano 0.268 of the sgemm rate in turn, 32 x 128 0.260; GPT-2 small's 0.531, 32 x 128
  // 0.489). On T <= 128 it is one key tile. With the AVX-512 kernels (2026-12-06-cpu-gpt-attention-
  // avx512.json, the worker's CPU time per tiling) it is again among the fastest on both shapes,
  // 16 x 64 to 128 x 128 within 1.5% on nano, the others up to 6% slower on GPT-2 small.
  return {64, 128};
}

namespace {

constexpr std::int64_t lanes = 16;

// Scratch in whole cache lines: the tiles' vector loads and stores then never straddle two.
template <class T>
struct CacheAligned {
  using value_type = T;
  CacheAligned() = default;
  template <class U>
  CacheAligned(CacheAligned<U> const&) noexcept {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, std::size_t) noexcept { ::operator delete(p, std::align_val_t{64}); }
  template <class U>
  bool operator==(CacheAligned<U> const&) const noexcept {
    return true;
  }
};
using Buffer = std::vector<float, CacheAligned<float>>;

// Where a row's loops over its n visible entries end: n rounded up to whole vectors of `lanes`
// where the row has room (width), the entries past n masked, so a row of the diagonal tile runs
// no scalar tail (mostly).
std::int64_t padded(std::int64_t n, std::int64_t width) { return std::min((n + lanes - 1) / lanes * lanes, width); }

// The largest of s[0, n), 1 <= n <= width (entries past n may hold anything, NaN included).
float row_max(float const* s, std::int64_t n, std::int64_t width) {
  float part[lanes];
  std::fill(part, part + lanes, -INFINITY);
  std::int64_t const end = padded(n, width);
  std::int64_t j = 0;
  for (; j + lanes <= end; j += lanes)
    for (std::int64_t l = 0; l < lanes; ++l) {
      float const x = j + l < n ? s[j + l] : -INFINITY;
      part[l] = x > part[l] ? x : part[l];
    }
  for (; j < n; ++j) part[0] = s[j] > part[0] ? s[j] : part[0];
  float m = part[0];
  for (std::int64_t l = 1; l < lanes; ++l) m = part[l] > m ? part[l] : m;
  return m;
}

// s[j] = e^(scale (s[j] - m)) for j in [0, n), 0 for j in [n, width); returns their sum (the
// scores come unscaled: scale > 0 keeps their maximum where it was).
float exp_sum(float* s, std::int64_t n, std::int64_t width, float m, float scale) {
  float part[lanes] = {};
  std::int64_t const end = padded(n, width);
  std::int64_t j = 0;
  for (; j + lanes <= end; j += lanes)
    for (std::int64_t l = 0; l < lanes; ++l) {
      float const e = mgpu::detail::exp_vec((s[j + l] - m) * scale);
      s[j + l] = j + l < n ? e : 0.0f;
      part[l] += s[j + l];
    }
  for (; j < n; ++j) {
    s[j] = mgpu::detail::exp_vec((s[j] - m) * scale);
    part[0] += s[j];
  }
  std::fill(s + j, s + width, 0.0f);
  float sum = 0.0f;
  for (float p : part) sum += p;
  return sum;
}

// A register block of c: R rows x W columns (+)= sum over kk < k of A(r, kk) b[kk, 0..W), where
// A(r, kk) = a[r a_row + kk a_col]; the accumulators stay in vector registers and each step is
// R broadcasts and R W / 16 fused multiply-adds (fmaf: the build does not contract a * b + c).
template <int R, int W>
inline void block(float const* a, std::int64_t a_row, std::int64_t a_col, float const* b, std::int64_t ldb, float* c,
                  std::int64_t ldc, std::int64_t k, bool accumulate) {
  float acc[R][W];
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < W; ++l) acc[r][l] = accumulate ? c[r * ldc + l] : 0.0f;
  for (std::int64_t kk = 0; kk < k; ++kk) {
    float const* row = b + kk * ldb;
    for (int r = 0; r < R; ++r) {
      float const x = a[r * a_row + kk * a_col];
      for (int l = 0; l < W; ++l) acc[r][l] = fmaf(x, row[l], acc[r][l]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < W; ++l) c[r * ldc + l] = acc[r][l];
}

// Which part of a tile product the causal mask can make nonzero, for `offset`:
//   all        every entry of c, from the whole inner dimension;
//   columns    row i of c needs its columns j < i + offset + 1 (c = scores: rows queries, columns
//              keys, offset = first query - first key): a register block computes its columns up
//              to its last row's limit (rounded up to 16), so what lies above the diagonal is
//              mostly skipped, the rest left for the caller to ignore;
//   k_before   row i of c sums over kk < i + offset + 1 (c [queries, d] from probabilities [queries,
//              keys]: the keys a query does not see have probability 0), offset as for columns;
//   k_from     row i of c sums over kk >= i + offset (c [keys, d] from transposed probabilities: the
//              queries before a key do not see it), offset = first key - first query.
enum class Causal { all, columns, k_before, k_from };

// Rows [i, i + R) x columns [j, j + W) of c, over the inner dimension's range the causal mask
// leaves (nothing for a block of Causal::columns wholly above the diagonal).
template <int R, int W>
inline void causal_block(float const* a, std::int64_t a_row, std::int64_t a_col, float const* b, std::int64_t ldb,
                         float* c, std::int64_t ldc, std::int64_t i, std::int64_t j, std::int64_t k, bool accumulate,
                         Causal causal, std::int64_t offset) {
  std::int64_t k0 = 0, k1 = k;
  if (causal == Causal::columns && j >= i + R + offset) return;
  if (causal == Causal::k_before) k1 = std::clamp<std::int64_t>(i + R + offset, 0, k);
  if (causal == Causal::k_from) k0 = std::clamp<std::int64_t>(i + offset, 0, k);
  if (accumulate && k1 <= k0) return;
  block<R, W>(a + i * a_row + k0 * a_col, a_row, a_col, b + k0 * ldb + j, ldb, c + i * ldc + j, ldc, k1 - k0, accumulate);
}

// W columns [j, j + W) of rows [0, m) of c in blocks of 8 rows, then 4, then single rows.
template <int W>
void column_panel(float const* a, std::int64_t a_row, std::int64_t a_col, float const* b, std::int64_t ldb, float* c,
                  std::int64_t ldc, std::int64_t j, std::int64_t m, std::int64_t k, bool accumulate, Causal causal,
                  std::int64_t offset) {
  std::int64_t i = 0;
  for (; i + 8 <= m; i += 8) causal_block<8, W>(a, a_row, a_col, b, ldb, c, ldc, i, j, k, accumulate, causal, offset);
  for (; i + 4 <= m; i += 4) causal_block<4, W>(a, a_row, a_col, b, ldb, c, ldc, i, j, k, accumulate, causal, offset);
  for (; i < m; ++i) causal_block<1, W>(a, a_row, a_col, b, ldb, c, ldc, i, j, k, accumulate, causal, offset);
}

// c [m, n] (+)= A B (beta 0 or 1) with A(i, kk) = a[i a_row + kk a_col] (a row-major matrix or a
// transposed one), B row-major with rows of stride ldb, c row-major with rows of stride ldc: the
// tile products of attention, whose n (d or a key tile) is mostly a multiple of 32; each register
// block skips what `causal` says the mask zeroes.
void product(float const* a, std::int64_t a_row, std::int64_t a_col, float const* b, std::int64_t ldb, float* c,
             std::int64_t ldc, std::int64_t m, std::int64_t n, std::int64_t k, bool accumulate,
             Causal causal = Causal::all, std::int64_t offset = 0) {
  std::int64_t j = 0;
  for (; j + 32 <= n; j += 32) column_panel<32>(a, a_row, a_col, b, ldb, c, ldc, j, m, k, accumulate, causal, offset);
  for (; j + 16 <= n; j += 16) column_panel<16>(a, a_row, a_col, b, ldb, c, ldc, j, m, k, accumulate, causal, offset);
  for (; j < n; ++j) column_panel<1>(a, a_row, a_col, b, ldb, c, ldc, j, m, k, accumulate, causal, offset);
}

// dst [heads, t, d] = the heads' columns of t rows of `stride` elements from src: one pass over
// the rows in order (every head of a sequence at once: the reads stream, where a head at a time
// strides through the sequence once per head).
template <class T>
void pack(T const* src, std::int64_t stride, std::int64_t t, std::int64_t heads, std::int64_t d, Buffer& dst) {
  dst.resize(static_cast<std::size_t>(heads * t * d));
  for (std::int64_t i = 0; i < t; ++i) {
    T const* row = src + i * stride;
    for (std::int64_t h = 0; h < heads; ++h) {
      float* out = dst.data() + (h * t + i) * d;
      for (std::int64_t e = 0; e < d; ++e) out[e] = static_cast<float>(row[h * d + e]);
    }
  }
}

// The row stride of packed kᵀ and vᵀ for t keys: whole vectors of 16, so the AVX-512 kernels
// load a tile's last keys without a mask.
std::int64_t transposed_ld(std::int64_t t) { return (t + 15) / 16 * 16; }

// dst [heads, d, transposed_ld(t)] = the heads' columns of t rows of `stride` elements from src,
// transposed, the columns past t zero: the layout the tile products read k and v in (kᵀ's rows are
// the keys' e-th elements), packed once per sequence. In blocks of 16 rows, each element's 16 keys
// written as one vector (gathered from the rows): a key at a time would store single floats d apart.
template <class T>
void pack_transposed(T const* src, std::int64_t stride, std::int64_t t, std::int64_t heads, std::int64_t d,
                     Buffer& dst) {
  std::int64_t const ld = transposed_ld(t);
  dst.resize(static_cast<std::size_t>(heads * ld * d));
  constexpr std::int64_t edge = 16;
  auto block = [&](std::int64_t i0, auto rows) {
    for (std::int64_t h = 0; h < heads; ++h) {
      float* out = dst.data() + h * d * ld + i0;
      T const* in = src + i0 * stride + h * d;
      for (std::int64_t e = 0; e < d; ++e) {
        for (std::int64_t i = 0; i < rows; ++i) out[e * ld + i] = static_cast<float>(in[i * stride + e]);
        std::fill(out + e * ld + rows, out + (e + 1) * ld - i0, 0.0f);  // past t (only in the last block)
      }
    }
  };
  std::int64_t i0 = 0;
  for (; i0 + edge <= t; i0 += edge) block(i0, std::integral_constant<std::int64_t, edge>{});
  if (i0 < t) block(i0, t - i0);
}

// Whether host_attention_avx512.cpp's kernels run heads of d of T without dropout here (float32).
template <class T>
bool avx512_covers(std::int64_t d, detail::AttentionMask const& mask) {
#if defined(MGPU_HOST_ATTENTION_AVX512)
  static bool const cpu = __builtin_cpu_supports("avx512f");
  return std::is_same_v<T, float> && cpu && (d == 32 || d == 64) && mask.p == 0.0f;
#else
  (void)d;
  (void)mask;
  return false;
#endif
}

// pack_transposed, through the AVX-512 kernels' 16 x 16 register transposes where they run.
template <class T>
void pack_keys(T const* src, std::int64_t stride, std::int64_t t, std::int64_t heads, std::int64_t d,
               detail::AttentionMask const& mask, Buffer& dst) {
#if defined(MGPU_HOST_ATTENTION_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    if (avx512_covers<T>(d, mask)) {
      dst.resize(static_cast<std::size_t>(heads * transposed_ld(t) * d));
      avx512::pack_transposed(src, stride, t, heads, d, dst.data(), transposed_ld(t));
      return;
    }
  }
#endif
  (void)mask;
  pack_transposed(src, stride, t, heads, d, dst);
}

// One of q, k, v, dy (or a gradient) as the tile products read it: head h's row i of d elements at
// at(h) + i ld. float32 storage is read (and written) in place, rows of the sequence's stride;
// 16-bit storage through a float copy [heads, t, d].
template <class F>
struct Heads {
  F* base;
  std::int64_t ld, head_step;
  F* at(std::int64_t h) const { return base + h * head_step; }
};

template <class T>
Heads<float const> heads_of(T const* src, std::int64_t stride, std::int64_t t, std::int64_t heads, std::int64_t d,
                            Buffer& copy) {
  if constexpr (std::is_same_v<T, float>) {
    return {src, stride, d};
  } else {
    pack(src, stride, t, heads, d, copy);
    return {copy.data(), d, t * d};
  }
}

// Where a gradient dst (rows of `stride` elements) accumulates: in place for float32 (zeroed
// here unless `kernel_zeroes`: the AVX-512 kernels zero each row where they first reach it), else
// a zeroed float copy [heads, t, d] that finish() rounds into dst.
template <class T>
Heads<float> gradient_of(T* dst, std::int64_t stride, std::int64_t t, std::int64_t heads, std::int64_t d, Buffer& copy,
                         bool kernel_zeroes) {
  if constexpr (std::is_same_v<T, float>) {
    if (!kernel_zeroes)
      for (std::int64_t i = 0; i < t; ++i) std::fill_n(dst + i * stride, heads * d, 0.0f);
    return {dst, stride, d};
  } else {
    (void)kernel_zeroes;
    copy.assign(static_cast<std::size_t>(heads * t * d), 0.0f);
    return {copy.data(), d, t * d};
  }
}

template <class T>
void finish(Buffer const& copy, std::int64_t t, std::int64_t heads, std::int64_t d, T* dst, std::int64_t stride) {
  if constexpr (!std::is_same_v<T, float>) {
    for (std::int64_t i = 0; i < t; ++i) {
      T* row = dst + i * stride;
      for (std::int64_t h = 0; h < heads; ++h) {
        float const* in = copy.data() + (h * t + i) * d;
        for (std::int64_t e = 0; e < d; ++e) row[h * d + e] = T(in[e]);
      }
    }
  }
}

// The number of keys of tile [j0, j0 + width) that query i may see (j <= i).
std::int64_t visible(std::int64_t i, std::int64_t j0, std::int64_t width) {
  return std::clamp<std::int64_t>(i - j0 + 1, 0, width);
}

// Scratch kept per worker thread between calls.
struct Scratch {
  Buffer q, k, v, kt, vt, dy, dq, dk, dv, s, ds, acc, m, l, row_dot;  // kt, vt: [heads, d, ld]
};

#if defined(MGPU_HOST_ATTENTION_AVX512)
// An AVX-512 kernel's view of head h of a float32 sequence (qkv rows of 3c, y and dy rows of c),
// with the tiles' scratch in w.
avx512::Head avx512_head(float const* qkv, std::int64_t h, detail::AttentionShape const& shape, AttentionTiles tiles,
                         Scratch& w) {
  std::int64_t const t = shape.t, c = shape.c, d = shape.d(), ld = transposed_ld(t);
  std::size_t const tile = static_cast<std::size_t>(tiles.queries * avx512::scratch_row(tiles.keys));
  w.s.resize(tile);
  w.ds.resize(tile);
  w.acc.resize(static_cast<std::size_t>(tiles.queries * d));
  w.m.resize(static_cast<std::size_t>(tiles.queries));
  w.l.resize(static_cast<std::size_t>(tiles.queries));
  avx512::Head head;
  head.t = t;
  head.d = d;
  head.bq = tiles.queries;
  head.bk = tiles.keys;
  head.scale = 1.0f / std::sqrt(static_cast<float>(d));
  head.q = qkv + h * d;
  head.k = qkv + c + h * d;
  head.v = qkv + 2 * c + h * d;
  head.ld_qkv = 3 * c;
  head.kt = w.kt.data() + h * d * ld;
  head.ldt = ld;
  head.ld_y = c;
  head.s = w.s.data();
  head.ds = w.ds.data();
  head.acc = w.acc.data();
  head.m = w.m.data();
  head.l = w.l.data();
  return head;
}
#endif

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

}  // namespace

template <class T>
void attention_forward(T const* qkv, T* y, float* lse, std::int64_t batch, detail::AttentionShape const& shape,
                       detail::AttentionMask const& mask, AttentionTiles tiles) {
  std::int64_t const t = shape.t, c = shape.c, heads = shape.heads, d = shape.d();
  std::int64_t const bq = tiles.queries, bk = tiles.keys;
  float const scale = 1.0f / std::sqrt(static_cast<float>(d));
  Scratch& w = scratch();
  w.s.resize(static_cast<std::size_t>(bq * bk));
  w.acc.resize(static_cast<std::size_t>(bq * d));
  w.m.resize(static_cast<std::size_t>(bq));
  w.l.resize(static_cast<std::size_t>(bq));
  for (std::int64_t b = 0; b < batch; ++b) {
    T const* base = qkv + b * t * 3 * c;
    Heads<float const> const qs = heads_of(base, 3 * c, t, heads, d, w.q);
    Heads<float const> const vs = heads_of(base + 2 * c, 3 * c, t, heads, d, w.v);
    pack_keys(base + c, 3 * c, t, heads, d, mask, w.kt);  // the scores read kᵀ
    for (std::int64_t h = 0; h < heads; ++h) {
      if constexpr (std::is_same_v<T, float>) {
        if (avx512_covers<T>(d, mask)) {
#if defined(MGPU_HOST_ATTENTION_AVX512)
          avx512::Head head = avx512_head(base, h, shape, tiles, w);
          head.y = y + b * t * c + h * d;
          head.lse_out = lse + (b * heads + h) * t;
          avx512::forward(head);
#endif
          continue;
        }
      }
      float const *q = qs.at(h), *kt = w.kt.data() + h * transposed_ld(t) * d, *v = vs.at(h);
      float* row_lse = lse + (b * heads + h) * t;
      for (std::int64_t i0 = 0; i0 < t; i0 += bq) {
        std::int64_t const rows = std::min(bq, t - i0);
        std::fill_n(w.m.begin(), rows, -INFINITY);  // the running maximum of the unscaled scores
        std::fill_n(w.l.begin(), rows, 0.0f);
        std::fill_n(w.acc.begin(), rows * d, 0.0f);
        for (std::int64_t j0 = 0; j0 < i0 + rows; j0 += bk) {
          std::int64_t const cols = std::min(bk, i0 + rows - j0);
          std::int64_t const r0 = std::max<std::int64_t>(0, j0 - i0), n_rows = rows - r0;  // rows before r0 see none
          float* s_tile = w.s.data();
          product(q + (i0 + r0) * qs.ld, qs.ld, 1, kt + j0, transposed_ld(t), s_tile, cols, n_rows, cols, d, false,
                  Causal::columns, i0 + r0 - j0);
          for (std::int64_t r = r0; r < rows; ++r) {
            std::int64_t const i = i0 + r, n = visible(i, j0, cols);
            float* s = s_tile + (r - r0) * cols;
            float* acc = w.acc.data() + r * d;
            auto const ru = static_cast<std::size_t>(r);
            float const m_new = std::max(w.m[ru], row_max(s, n, cols));
            if (m_new != w.m[ru] && w.l[ru] != 0.0f) {  // rescale what earlier tiles summed
              float const correction = mgpu::detail::exp_vec((w.m[ru] - m_new) * scale);
              w.l[ru] *= correction;
              for (std::int64_t e = 0; e < d; ++e) acc[e] *= correction;
            }
            w.m[ru] = m_new;
            w.l[ru] += exp_sum(s, n, cols, m_new, scale);
            if (mask.p != 0.0f)
              for (std::int64_t j = 0; j < n; ++j) s[j] *= mask.factor(b, h, i, j0 + j);
          }
          product(s_tile, cols, 1, v + j0 * vs.ld, vs.ld, w.acc.data() + r0 * d, d, n_rows, d, cols, true,
                  Causal::k_before, i0 + r0 - j0);
        }
        for (std::int64_t r = 0; r < rows; ++r) {
          auto const ru = static_cast<std::size_t>(r);
          float const inverse = 1.0f / w.l[ru];
          float* acc = w.acc.data() + r * d;
          row_lse[i0 + r] = w.m[ru] * scale + std::log(w.l[ru]);
          T* out = y + (b * t + i0 + r) * c + h * d;
          for (std::int64_t e = 0; e < d; ++e) out[e] = T(acc[e] * inverse);
        }
      }
    }
  }
}

template <class T>
void attention_backward(T const* qkv, T const* y, float const* lse, T const* dy, T* dqkv, std::int64_t batch,
                        detail::AttentionShape const& shape, detail::AttentionMask const& mask, AttentionTiles tiles) {
  std::int64_t const t = shape.t, c = shape.c, heads = shape.heads, d = shape.d();
  std::int64_t const bq = tiles.queries, bk = tiles.keys;
  float const scale = 1.0f / std::sqrt(static_cast<float>(d));
  Scratch& w = scratch();
  w.row_dot.resize(static_cast<std::size_t>(heads * t));
  w.s.resize(static_cast<std::size_t>(bq * bk));
  w.ds.resize(static_cast<std::size_t>(bq * bk));
  for (std::int64_t b = 0; b < batch; ++b) {
    T const* base = qkv + b * t * 3 * c;
    T* out = dqkv + b * t * 3 * c;
    Heads<float const> const qs = heads_of(base, 3 * c, t, heads, d, w.q);
    Heads<float const> const ks = heads_of(base + c, 3 * c, t, heads, d, w.k);  // dq reads k
    Heads<float const> const dys = heads_of(dy + b * t * c, c, t, heads, d, w.dy);
    pack_keys(base + c, 3 * c, t, heads, d, mask, w.kt);  // the scores read kᵀ, dP vᵀ
    pack_keys(base + 2 * c, 3 * c, t, heads, d, mask, w.vt);
    for (std::int64_t i = 0; i < t; ++i)
      for (std::int64_t h = 0; h < heads; ++h) {
        std::int64_t const offset = (b * t + i) * c + h * d;
        w.row_dot[static_cast<std::size_t>(h * t + i)] = detail::dot(dy + offset, y + offset, d);
      }
    bool const kernel_zeroes = avx512_covers<T>(d, mask);
    Heads<float> const dqs = gradient_of(out, 3 * c, t, heads, d, w.dq, kernel_zeroes);
    Heads<float> const dks = gradient_of(out + c, 3 * c, t, heads, d, w.dk, kernel_zeroes);
    Heads<float> const dvs = gradient_of(out + 2 * c, 3 * c, t, heads, d, w.dv, kernel_zeroes);
    for (std::int64_t h = 0; h < heads; ++h) {
      if constexpr (std::is_same_v<T, float>) {
        if (avx512_covers<T>(d, mask)) {
#if defined(MGPU_HOST_ATTENTION_AVX512)
          avx512::Head head = avx512_head(base, h, shape, tiles, w);
          head.vt = w.vt.data() + h * d * head.ldt;
          head.dy = dy + b * t * c + h * d;
          head.lse = lse + (b * heads + h) * t;
          head.row_dot = w.row_dot.data() + h * t;
          head.dq = dqs.at(h);
          head.dk = dks.at(h);
          head.dv = dvs.at(h);
          avx512::backward(head);
#endif
          continue;
        }
      }
      float const *q = qs.at(h), *k = ks.at(h), *dyh = dys.at(h);
      std::int64_t const ldt = transposed_ld(t);
      float const *kt = w.kt.data() + h * ldt * d, *vt = w.vt.data() + h * ldt * d;
      float *dq = dqs.at(h), *dk = dks.at(h), *dv = dvs.at(h);
      float const* row_dot = w.row_dot.data() + h * t;
      float const* row_lse = lse + (b * heads + h) * t;
      for (std::int64_t i0 = 0; i0 < t; i0 += bq) {
        std::int64_t const rows = std::min(bq, t - i0);
        for (std::int64_t j0 = 0; j0 < i0 + rows; j0 += bk) {
          std::int64_t const cols = std::min(bk, i0 + rows - j0);
          std::int64_t const r0 = std::max<std::int64_t>(0, j0 - i0), n_rows = rows - r0, first = i0 + r0;
          float* p_tile = w.s.data();
          float* ds_tile = w.ds.data();
          product(q + first * qs.ld, qs.ld, 1, kt + j0, ldt, p_tile, cols, n_rows, cols, d, false, Causal::columns,
                  first - j0);
          product(dyh + first * dys.ld, dys.ld, 1, vt + j0, ldt, ds_tile, cols, n_rows, cols, d, false,
                  Causal::columns, first - j0);
          // From the unscaled scores S: P = e^(scale S - lse), and dS with the scale of the scores
          // folded in (dq = dS k and dk = dSᵀ q then need none).
          for (std::int64_t r = 0; r < n_rows; ++r) {
            std::int64_t const i = first + r, n = visible(i, j0, cols);
            float* p = p_tile + r * cols;
            float* ds = ds_tile + r * cols;
            float const l = row_lse[i], rd = row_dot[i];
            std::int64_t end = n;
            if (mask.p != 0.0f) {
              for (std::int64_t j = 0; j < n; ++j) {  // p becomes P Z (for dv); ds = P (Z dP - row_dot)
                float const prob = mgpu::detail::exp_vec(fmaf(p[j], scale, -l)), z = mask.factor(b, h, i, j0 + j);
                ds[j] = prob * (z * ds[j] - rd) * scale;
                p[j] = prob * z;
              }
            } else {
              end = padded(n, cols);  // whole vectors, the entries past n masked to 0
              for (std::int64_t j = 0; j < end; ++j) {
                float const prob = mgpu::detail::exp_vec(fmaf(p[j], scale, -l)), grad = prob * (ds[j] - rd) * scale;
                p[j] = j < n ? prob : 0.0f;
                ds[j] = j < n ? grad : 0.0f;
              }
            }
            std::fill(p + end, p + cols, 0.0f);
            std::fill(ds + end, ds + cols, 0.0f);
          }
          product(p_tile, 1, cols, dyh + first * dys.ld, dys.ld, dv + j0 * dvs.ld, dvs.ld, cols, d, n_rows, true,
                  Causal::k_from, j0 - first);
          product(ds_tile, 1, cols, q + first * qs.ld, qs.ld, dk + j0 * dks.ld, dks.ld, cols, d, n_rows, true,
                  Causal::k_from, j0 - first);
          product(ds_tile, cols, 1, k + j0 * ks.ld, ks.ld, dq + first * dqs.ld, dqs.ld, n_rows, d, cols, true,
                  Causal::k_before, first - j0);
        }
      }
    }
    finish(w.dq, t, heads, d, out, 3 * c);
    finish(w.dk, t, heads, d, out + c, 3 * c);
    finish(w.dv, t, heads, d, out + 2 * c, 3 * c);
  }
}

#define MGPU_HOST_ATTENTION(T)                                                                          \
  template void attention_forward<T>(T const*, T*, float*, std::int64_t, detail::AttentionShape const&, \
                                     detail::AttentionMask const&, AttentionTiles);                     \
  template void attention_backward<T>(T const*, T const*, float const*, T const*, T*, std::int64_t,     \
                                      detail::AttentionShape const&, detail::AttentionMask const&, AttentionTiles);
MGPU_HOST_ATTENTION(float)
MGPU_HOST_ATTENTION(bfloat16)
MGPU_HOST_ATTENTION(float16)
#undef MGPU_HOST_ATTENTION

}  // namespace host
}  // namespace mgpu::ops
