// A GPT's ops (float32/bfloat16/float16, math in float32). Bad shapes throw Error(invalid_argument);
// a bad token id fails the stream naming it and its position. Design: docs/architecture.md.
#pragma once

#include <cstdint>

#include <mgpu/core/stream.hpp>
#include <mgpu/core/tensor.hpp>

namespace mgpu::ops {

/// y[b, t, :] = wte[ids[b, t], :] + wpe[t, :] for ids int32 [B, T], wte [V, C], wpe [P, C] with
/// T <= P, y [B, T, C] (wte, wpe and y of one dtype). An id outside [0, V) fails the stream.
void embedding(Tensor const& ids, Tensor const& wte, Tensor const& wpe, Tensor const& y, Stream& stream);

/// The gradients of embedding(): dwte[v] = sum of dy[b, t] where ids[b, t] = v, dwpe[t] = sum over b
/// of dy[b, t] (rows past T zero), bitwise deterministic. `accumulate_*` adds instead of overwriting.
void embedding_backward(Tensor const& ids, Tensor const& dy, Tensor const& dwte, Tensor const& dwpe,
                        bool accumulate_wte, bool accumulate_wpe, Stream& stream);

/// A vocab-parallel rank's embedding(): wte [rows, C] holds ids [begin, begin + rows) of `vocab`;
/// y = its rows for the ids it holds, 0 for others, + wpe when `positions`. The ranks' sum is
/// embedding()'s y exactly. An id outside [0, vocab) fails the stream.
void vocab_shard_embedding(Tensor const& ids, Tensor const& wte, Tensor const& wpe, Tensor const& y, std::int64_t begin,
                           std::int64_t vocab, bool positions, Stream& stream);

/// The gradients of vocab_shard_embedding(): dwte[v - begin] for the rank's ids v, as
/// embedding_backward() writes them, and the whole dwpe. An id outside [0, vocab) fails the stream.
void vocab_shard_embedding_backward(Tensor const& ids, Tensor const& dy, Tensor const& dwte, Tensor const& dwpe,
                                    std::int64_t begin, std::int64_t vocab, bool accumulate_wte, bool accumulate_wpe,
                                    Stream& stream);

/// Attention dropout: (b, h, i, j) kept (scaled by 1/(1-p)) when uniform01(seed, (((row_offset + b) *
/// heads + head_offset + h) * T + i) * T + j) < 1 - p; offsets global (heads 0: the op's). p 0: off.
struct AttentionDropout {
  float p = 0.0f;
  std::uint64_t seed = 0;
  std::int64_t row_offset = 0;
  std::int64_t head_offset = 0;
  std::int64_t heads = 0;
};

/// Causal multi-head self-attention: qkv [B, T, 3C] holds q, k, v (head h at columns [h d, (h+1) d)
/// of each, d = C / heads); writes y [B, T, C] = softmax(q kᵀ / sqrt(d), keys j <= i) v per head
/// and lse [B, heads, T] (float32), each row's log-sum-exp, all that backward keeps. O(d) memory a row.
void causal_attention(Tensor const& qkv, Tensor const& y, Tensor const& lse, std::int64_t heads, Stream& stream,
                      AttentionDropout const& dropout = {});
/// The gradient of causal_attention: dqkv [B, T, 3C] from qkv, y, lse and dy (same dropout);
/// dqkv may not overlap qkv, y or dy.
void causal_attention_backward(Tensor const& qkv, Tensor const& y, Tensor const& lse, Tensor const& dy,
                               Tensor const& dqkv, std::int64_t heads, Stream& stream,
                               AttentionDropout const& dropout = {});

/// Host causal attention's tiles of query rows and keys (0: the library's choice, by BM_attention).
struct AttentionTiles {
  std::int64_t queries = 0;
  std::int64_t keys = 0;
};
/// Sets host attention's tiles from now on (process-wide, thread-safe); results differ by rounding only.
void set_host_attention_tiles(AttentionTiles tiles) noexcept;

/// Per-token cross-entropy of logits [N, V] (or [B, T, V]) against N int32 targets: loss = sum of
/// -log softmax(row)[target] over rows not `ignore_index`, / divisor (> 0); dlogits = (softmax -
/// onehot) * grad_scale / divisor there, 0 on ignored rows. A target outside [0, V) fails the stream.
void token_cross_entropy(Tensor const& logits, Tensor const& targets, Tensor const& dlogits, Tensor const& loss,
                         float divisor, Stream& stream, std::int32_t ignore_index = -100, float grad_scale = 1.0f);

/// Vocab-parallel cross-entropy on logits [N, V_r] (ids [begin, begin + V_r) of `vocab`), reduced
/// across ranks between passes: row_max ([N]; by max), row_sums ([N, 2]: sum of exp(logit - max),
/// target's logit or 0; by sum), cross_entropy (token_cross_entropy()'s, on the rank's columns).
void vocab_shard_row_max(Tensor const& logits, Tensor const& max, Stream& stream);
void vocab_shard_row_sums(Tensor const& logits, Tensor const& targets, Tensor const& max, Tensor const& sums,
                          std::int64_t begin, Stream& stream);
void vocab_shard_cross_entropy(Tensor const& logits, Tensor const& targets, Tensor const& max, Tensor const& sums,
                               Tensor const& dlogits, Tensor const& loss, std::int64_t begin, std::int64_t vocab,
                               float divisor, Stream& stream, std::int32_t ignore_index = -100,
                               float grad_scale = 1.0f);

}  // namespace mgpu::ops
