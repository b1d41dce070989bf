// The transformer family's kernels (src/ops/transformer.cpp): the functors of
// mgpu/core/detail/transformer_math.hpp over a grid (one thread per output element or row, each
// summing in a fixed order), the token-id check, and stream-ordered scratch memory.
#include <cuda_runtime.h>

#include <mgpu/core/detail/elementwise.hpp>
#include <mgpu/core/detail/transformer_math.hpp>
#include <mgpu/core/dtype.hpp>
#include <mgpu/core/error.hpp>

#include "kernels/op_support.cuh"
#include "kernels/transformer.hpp"

namespace mgpu::kernels {
namespace {

// (position << 32 | id bits) for an id outside [0, vocab) that is not `ignore`, else all ones.
struct BadToken {
  std::int32_t const* ids;
  std::int64_t vocab;
  std::int64_t ignore;
  __device__ unsigned long long operator()(std::int64_t i) const {
    std::int32_t const id = ids[i];
    if ((id >= 0 && id < vocab) || id == ignore) return ~0ull;
    return (static_cast<unsigned long long>(i) << 32) | static_cast<std::uint32_t>(id);
  }
};

}  // namespace

void find_bad_token(int ordinal, std::int32_t const* ids, std::int64_t n, std::int64_t vocab, std::int64_t ignore,
                    std::uint64_t* host_result, Scratch& scratch, void* stream) {
  find_first(ordinal, n, BadToken{ids, vocab, ignore}, host_result, scratch, stream);
}

// The functors src/ops/transformer.cpp launches.
#define MGPU_TRANSFORMER_FOR_TYPE(T)                                                             \
  template void each(int, std::int64_t, mgpu::detail::EmbeddingOp<T> const&, void*);             \
  template void each(int, std::int64_t, mgpu::detail::EmbeddingTokenGradOp<T> const&, void*);    \
  template void each(int, std::int64_t, mgpu::detail::EmbeddingPositionGradOp<T> const&, void*); \
  template void each(int, std::int64_t, mgpu::detail::AttentionForwardRow<T> const&, void*);     \
  template void each(int, std::int64_t, mgpu::detail::AttentionRowDot<T> const&, void*);         \
  template void each(int, std::int64_t, mgpu::detail::AttentionGradRow<T> const&, void*);        \
  template void each(int, std::int64_t, mgpu::detail::ConvertOp<T, float> const&, void*);        \
  template void each(int, std::int64_t, mgpu::detail::TokenCrossEntropyRow<T> const&, void*);    \
  template void each(int, std::int64_t, mgpu::detail::VocabShardEmbeddingOp<T> const&, void*);   \
  template void each(int, std::int64_t, mgpu::detail::VocabShardRowMax<T> const&, void*);        \
  template void each(int, std::int64_t, mgpu::detail::VocabShardRowSums<T> const&, void*);       \
  template void each(int, std::int64_t, mgpu::detail::VocabShardCrossEntropyRow<T> const&, void*);
MGPU_TRANSFORMER_FOR_TYPE(float)
MGPU_TRANSFORMER_FOR_TYPE(bfloat16)
MGPU_TRANSFORMER_FOR_TYPE(float16)
#undef MGPU_TRANSFORMER_FOR_TYPE
template void each(int, std::int64_t, mgpu::detail::TokenCountOp const&, void*);
template void each(int, std::int64_t, mgpu::detail::TokenScanOp const&, void*);
template void each(int, std::int64_t, mgpu::detail::TokenListOp const&, void*);
template void each(int, std::int64_t, mgpu::detail::RowLossSum const&, void*);

}  // namespace mgpu::kernels
