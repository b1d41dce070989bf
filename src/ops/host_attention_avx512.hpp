// Host attention's AVX-512 micro-kernels for head sizes 32 and 64 (float32, no dropout):
// host_attention.cpp runs them where the CPU has AVX-512F, else its generic tiles. Internal: not
// installed; compiled with AVX-512 enabled (the rest of the library may not be).
#pragma once

#include <cstdint>

namespace mgpu::ops::host::avx512 {

/// One (sequence, head) of attention. Rows of d floats: q, k, v, y, dy and the gradients row i
/// at ptr + i * ld; kᵀ and vᵀ (backward) element e of key j at kt[e * ldt + j], ldt a multiple of
/// 16 and the columns in [t, ldt) zero. The tiles are bq query rows by bk keys (any sizes >= 1).
struct Head {
  std::int64_t t = 0, d = 0, bq = 0, bk = 0;
  float scale = 0.0f;  // 1 / sqrt(d): multiplies the scores in the exponent and dS
  float const *q = nullptr, *k = nullptr, *v = nullptr;
  std::int64_t ld_qkv = 0;
  float const *kt = nullptr, *vt = nullptr;
  std::int64_t ldt = 0;
  float* y = nullptr;  // forward's output; backward reads dy instead
  float const* dy = nullptr;
  std::int64_t ld_y = 0;
  float* lse_out = nullptr;                           // [t], forward: each row's log-sum-exp of the scaled scores
  float const* lse = nullptr;                         // [t], backward: the forward's lse_out
  float const* row_dot = nullptr;                     // [t], backward: dy_i · y_i
  float *dq = nullptr, *dk = nullptr, *dv = nullptr;  // backward: written, rows of ld_qkv
  // Scratch: s and ds [bq * scratch_row(bk)], acc [bq * d], m and l [bq].
  float *s = nullptr, *ds = nullptr, *acc = nullptr, *m = nullptr, *l = nullptr;
};

/// The row stride of the score tiles in Head::s and Head::ds for bk keys.
[[nodiscard]] constexpr std::int64_t scratch_row(std::int64_t bk) noexcept { return (bk + 15) / 16 * 16; }

/// dst [heads, d, ldt] = the heads' columns of t rows of `stride` floats from src, transposed, the
/// columns past t zero (ldt a multiple of 16 >= t; d a multiple of 16): 16 x 16 blocks through
/// registers.
void pack_transposed(float const* src, std::int64_t stride, std::int64_t t, std::int64_t heads, std::int64_t d,
                     float* dst, std::int64_t ldt) noexcept;

/// y and lse of one head (d 32 or 64): per tile of bq queries, tiles of bk keys: the scores in
/// 4-query x 64-key register blocks (blocks wholly above the diagonal skipped, the rest masked),
/// each row's maximum and its exponentials and sum right after its block (online softmax across
/// key tiles), then P V in register blocks of 24 / (d / 16) rows x d; the log-sum-exps of a tile's
/// rows 16 at a time (a vector log).
void forward(Head const& head) noexcept;

/// dq, dk, dv = one head's gradients (d 32 or 64; rows i of the three zeroed as the tile of
/// queries holding i begins, the first to reach them): per tile, S = q kᵀ and dP = dy vᵀ together in
/// blocks of 4 (d 32) or 8 (d 64) queries x 16 keys, P = e^(scale S - lse) and dS = P (dP -
/// row_dot) scale formed in registers, then dv += Pᵀ dy and dk += dSᵀ q in blocks of 24 / (d / 16)
/// keys x d, dq += dS k in blocks of rows.
void backward(Head const& head) noexcept;

}  // namespace mgpu::ops::host::avx512
