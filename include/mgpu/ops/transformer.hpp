// The ops of a decoder-only transformer (GPT): token + position embedding and its deterministic
// backward, causal multi-head attention with an online softmax (no [T, T] matrix is ever formed),
// and per-token cross-entropy against int32 targets. Arguments are checked at the call (shapes and
// types; a mismatch throws Error(invalid_argument)); token ids, which live on the device, are
// checked by the enqueued work, which fails the stream with Error(invalid_argument) naming the id
// and its position. Activations may be float32, bfloat16 or float16 (math in float32).
//
// Host and CUDA run the same element code (mgpu/core/detail/transformer_math.hpp): on a GPU one
// thread per output element or attention row, each summing in a fixed order (simple kernels, not
// tuned: no shared-memory tiling or tensor cores yet). Attention on a host stream instead works on
// 64 x 64 tiles of queries and keys through GEMMs (src/ops/transformer.cpp), with the same online
// softmax; results agree with the GPU's to float32 rounding, and each is reproducible run to run.
#pragma once

#include <cstdint>

#include <mgpu/core/stream.hpp>
#include <mgpu/core/tensor.hpp>

namespace mgpu::ops {

/// y[b, t, :] = wte[ids[b, t], :] + wpe[t, :] for ids int32 [B, T], wte [V, C], wpe [P, C] with
/// T <= P, y [B, T, C] (wte, wpe and y of one dtype). An id outside [0, V) fails the stream.
void embedding(Tensor const& ids, Tensor const& wte, Tensor const& wpe, Tensor const& y, Stream& stream);

/// The gradients of embedding(): dwte[v] = the sum of dy[b, t] over the positions holding id v, and
/// dwpe[t] = the sum over b of dy[b, t] (rows of dwpe past T are zero). Bitwise deterministic: each
/// row is summed in position order by one thread, with no atomics. With `accumulate_wte` (or
/// `accumulate_wpe`) the sums are added to the buffer instead of overwriting it (a tied LM head has
/// written its part of dwte first, or micro-batches accumulate).
void embedding_backward(Tensor const& ids, Tensor const& dy, Tensor const& dwte, Tensor const& dwpe,
                        bool accumulate_wte, bool accumulate_wpe, Stream& stream);

/// A vocab-parallel rank's part of embedding(): wte [rows, C] holds token ids [begin, begin +
/// rows) of a vocab of `vocab`; y[b, t, :] = wte[ids[b, t] - begin, :] for the ids it holds and 0
/// for the others, plus wpe[t, :] when `positions`. The sum of every rank's y, one of them adding
/// the positions, is embedding()'s y (exactly: one nonzero term besides the positions). An id
/// outside [0, vocab) fails the stream.
void vocab_shard_embedding(Tensor const& ids, Tensor const& wte, Tensor const& wpe, Tensor const& y, std::int64_t begin,
                           std::int64_t vocab, bool positions, Stream& stream);

/// The gradients of vocab_shard_embedding(): dwte[v - begin] for the rank's ids v, as
/// embedding_backward() writes (or adds) them, and dwpe (every rank gets the whole position
/// gradient, dy being the same on every rank). An id outside [0, vocab) fails the stream.
void vocab_shard_embedding_backward(Tensor const& ids, Tensor const& dy, Tensor const& dwte, Tensor const& dwpe,
                                    std::int64_t begin, std::int64_t vocab, bool accumulate_wte, bool accumulate_wpe,
                                    Stream& stream);

/// Dropout on attention probabilities: element (b, h, i, j) is kept when
/// uniform01(seed, (((row_offset + b) * heads + head_offset + h) * T + i) * T + j) < 1 - p and
/// scaled by 1 / (1 - p); row_offset is the global index of the batch's first sequence, so shards
/// of a batch drop what the whole batch would, and head_offset the global index of the op's first
/// head among `heads` (0: the op's heads), so a tensor-parallel rank's heads drop what the whole
/// model's would. p = 0 disables it.
struct AttentionDropout {
  float p = 0.0f;
  std::uint64_t seed = 0;
  std::int64_t row_offset = 0;
  std::int64_t head_offset = 0;
  std::int64_t heads = 0;
};

/// Causal multi-head self-attention: qkv [B, T, 3C] holds q, k, v side by side (head h at columns
/// [h d, (h + 1) d) of each, d = C / heads); writes y [B, T, C] = softmax(q kᵀ / sqrt(d), keys
/// j <= i) v per head, and lse [B, heads, T] (float32), each row's log-sum-exp of its scaled
/// scores, which is all backward keeps of the softmax. Keys are visited in tiles with a running
/// maximum and sum (an online softmax), so memory beyond the inputs is O(d) per row.
void causal_attention(Tensor const& qkv, Tensor const& y, Tensor const& lse, std::int64_t heads, Stream& stream,
                      AttentionDropout const& dropout = {});
/// The gradient of causal_attention: dqkv [B, T, 3C] from qkv, the forward's y and lse, and dy
/// [B, T, C], recomputing the probabilities from lse (same dropout as the forward).
void causal_attention_backward(Tensor const& qkv, Tensor const& y, Tensor const& lse, Tensor const& dy,
                               Tensor const& dqkv, std::int64_t heads, Stream& stream,
                               AttentionDropout const& dropout = {});

/// The tiles of causal attention on host devices: blocks of `queries` query rows, each against
/// the keys it may see in tiles of `keys` keys (scores, products and the online softmax's updates
/// per tile). Zero in either: the library's choice, measured by BM_attention.
struct AttentionTiles {
  std::int64_t queries = 0;
  std::int64_t keys = 0;
};
/// Sets the tiles host attention enqueued from now on uses, by any thread (process-wide,
/// thread-safe; for measuring the choice). Results differ between tilings only by float32 rounding.
void set_host_attention_tiles(AttentionTiles tiles) noexcept;

/// Per-token cross-entropy of logits [N, V] (or [B, T, V]) against int32 targets of N elements:
/// loss = (sum over rows whose target is not `ignore_index` of -log softmax(row)[target]) / divisor,
/// dlogits = (softmax - onehot(target)) * grad_scale / divisor on those rows and 0 on ignored rows.
/// `divisor` (> 0) is explicit so a shard or a micro-batch can divide by the counted tokens of the
/// whole batch. A target outside [0, V) that is not ignore_index fails the stream.
void token_cross_entropy(Tensor const& logits, Tensor const& targets, Tensor const& dlogits, Tensor const& loss,
                         float divisor, Stream& stream, std::int32_t ignore_index = -100, float grad_scale = 1.0f);

/// The vocab-parallel cross-entropy over a rank's logits [N, V_r] (or [B, T, V_r]) whose columns
/// are token ids [begin, begin + V_r) of a vocab of `vocab`, in three passes; the caller reduces
/// their float32 results across the ranks in between, so no rank ever holds a whole row:
///   vocab_shard_row_max: max [N] = each row's largest logit on the rank; then reduce it by max;
///   vocab_shard_row_sums: sums [N, 2] = each row's sum of exp(logit - max) on the rank, and its
///     target's logit when the rank holds the target (else 0); then reduce it by sum;
///   vocab_shard_cross_entropy: loss and dlogits on the rank's columns, as token_cross_entropy()
///     defines them for the whole row (same divisor, ignore_index and grad_scale). A target outside
///     [0, vocab) that is not ignore_index fails the stream.
void vocab_shard_row_max(Tensor const& logits, Tensor const& max, Stream& stream);
void vocab_shard_row_sums(Tensor const& logits, Tensor const& targets, Tensor const& max, Tensor const& sums,
                          std::int64_t begin, Stream& stream);
void vocab_shard_cross_entropy(Tensor const& logits, Tensor const& targets, Tensor const& max, Tensor const& sums,
                               Tensor const& dlogits, Tensor const& loss, std::int64_t begin, std::int64_t vocab,
                               float divisor, Stream& stream, std::int32_t ignore_index = -100,
                               float grad_scale = 1.0f);

}  // namespace mgpu::ops
