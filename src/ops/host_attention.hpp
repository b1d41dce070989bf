// Causal attention on a host stream's worker (ops::causal_attention and its backward on host
// devices). Internal: not installed.
#pragma once

#include <cstdint>

#include <mgpu/core/detail/transformer_math.hpp>
#include <mgpu/ops/transformer.hpp>

namespace mgpu::ops::host {

/// The tiles host attention runs in: the ones set_host_attention_tiles set, or else the choice
/// BM_attention measured on the nano and GPT-2-small shapes (the same for both); read when the op
/// is enqueued.
[[nodiscard]] AttentionTiles attention_tiles() noexcept;

/// y [B, T, C] and the per-row log-sum-exp lse [B, heads, T] from qkv [B, T, 3C]: per (sequence,
/// head), blocks of tiles.queries queries against the keys they may see in tiles of tiles.keys,
/// each tile's scores and products through a register-blocked float32 micro-kernel reading
/// float32 q and v in place (16-bit storage through float copies) and kᵀ packed once per sequence;
/// the unscaled scores' running maximum and sum per query (online softmax, 1/sqrt(d) in the
/// exponent), so nothing larger than a tile is formed; tiles or
/// tile rows that see no key are skipped, and so are the register blocks of a tile's products
/// that lie wholly above the diagonal (and the masked ranges of the probability products' sums).
/// Float32 heads of 32 or 64 without dropout run host_attention_avx512.hpp's kernels instead
/// where the CPU has AVX-512F, in the same tiles.
template <class T>
void attention_forward(T const* qkv, T* y, float* lse, std::int64_t batch, detail::AttentionShape const& shape,
                       detail::AttentionMask const& mask, AttentionTiles tiles);

/// dqkv [B, T, 3C] from qkv, the forward's y and lse, and dy [B, T, C], recomputing each tile's
/// probabilities from lse (any tiles: lse does not depend on them beyond rounding).
template <class T>
void attention_backward(T const* qkv, T const* y, float const* lse, T const* dy, T* dqkv, std::int64_t batch,
                        detail::AttentionShape const& shape, detail::AttentionMask const& mask, AttentionTiles tiles);

}  // namespace mgpu::ops::host
