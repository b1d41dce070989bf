// The transformer ops' kernels (src/kernels/transformer.hpp): the functors of
// mgpu/ops/detail/transformer_math.hpp over a grid (one thread per output element or row, each
// summing in a fixed order), and the token-id check.
#include <cuda_runtime.h>

#include <mgpu/core/detail/elementwise.hpp>
#include <mgpu/core/dtype.hpp>
#include <mgpu/core/error.hpp>
#include <mgpu/ops/detail/transformer_math.hpp>

#include "core/cuda_device_scope.hpp"
#include "kernels/elementwise.cuh"
#include "kernels/transformer.hpp"

namespace mgpu::kernels {
namespace {

constexpr int check_threads = 256;

// The smallest (position << 32 | id bits) over bad positions, by an integer atomicMin (the result
// does not depend on the order).
__global__ void find_bad_token_kernel(std::int32_t const* ids, std::int64_t n, std::int64_t vocab, std::int64_t ignore,
                                      unsigned long long* first) {
  std::int64_t const stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    std::int32_t const id = ids[i];
    if ((id < 0 || id >= vocab) && id != ignore) {
      auto const code = (static_cast<unsigned long long>(i) << 32) | static_cast<std::uint32_t>(id);
      atomicMin(first, code);
    }
  }
}

}  // namespace

template <class Op>
void transformer_each(int ordinal, std::int64_t n, Op const& op, void* stream) {
  detail::cuda::DeviceScope scope(ordinal);
  for_each_index(n, op, static_cast<cudaStream_t>(stream));
}

void find_bad_token(int ordinal, std::int32_t const* ids, std::int64_t n, std::int64_t vocab, std::int64_t ignore,
                    std::uint64_t* host_result, Scratch& scratch, void* stream) {
  detail::cuda::DeviceScope scope(ordinal);
  auto const s = static_cast<cudaStream_t>(stream);
  void* const first = scratch.allocate(sizeof(unsigned long long));
  MGPU_CUDA_CHECK(cudaMemsetAsync(first, 0xff, sizeof(unsigned long long), s));
  if (n > 0) {
    std::int64_t const wanted = (n + check_threads - 1) / check_threads;
    int const blocks = static_cast<int>(wanted < 65535 ? wanted : 65535);
    find_bad_token_kernel<<<blocks, check_threads, 0, s>>>(ids, n, vocab, ignore,
                                                           static_cast<unsigned long long*>(first));
    MGPU_CUDA_CHECK(cudaGetLastError());
  }
  MGPU_CUDA_CHECK(cudaMemcpyAsync(host_result, first, sizeof(std::uint64_t), cudaMemcpyDeviceToHost, s));
}

#define MGPU_TRANSFORMER_FOR_TYPE(T)                                                                        \
  template void transformer_each(int, std::int64_t, ops::detail::EmbeddingOp<T> const&, void*);             \
  template void transformer_each(int, std::int64_t, ops::detail::EmbeddingTokenGradOp<T> const&, void*);    \
  template void transformer_each(int, std::int64_t, ops::detail::EmbeddingPositionGradOp<T> const&, void*); \
  template void transformer_each(int, std::int64_t, ops::detail::AttentionForwardRow<T> const&, void*);     \
  template void transformer_each(int, std::int64_t, ops::detail::AttentionRowDot<T> const&, void*);         \
  template void transformer_each(int, std::int64_t, ops::detail::AttentionGradRow<T> const&, void*);        \
  template void transformer_each(int, std::int64_t, mgpu::detail::ConvertOp<T, float> const&, void*);       \
  template void transformer_each(int, std::int64_t, ops::detail::TokenCrossEntropyRow<T> const&, void*);
MGPU_TRANSFORMER_FOR_TYPE(float)
MGPU_TRANSFORMER_FOR_TYPE(bfloat16)
MGPU_TRANSFORMER_FOR_TYPE(float16)
#undef MGPU_TRANSFORMER_FOR_TYPE
template void transformer_each(int, std::int64_t, ops::detail::TokenCountOp const&, void*);
template void transformer_each(int, std::int64_t, ops::detail::TokenScanOp const&, void*);
template void transformer_each(int, std::int64_t, ops::detail::TokenListOp const&, void*);
template void transformer_each(int, std::int64_t, ops::detail::RowLossSum const&, void*);

}  // namespace mgpu::kernels
