// The host GEMM's dispatch and counts, and its Eigen backend: Eigen's blocked float32 kernel with
// packing buffers kept per thread; 16-bit storage is widened to float32, multiplied and rounded.
#include "ops/host_gemm.hpp"

#include <Eigen/Core>

#include <algorithm>
#include <chrono>
#include <vector>

#include <mgpu/config.hpp>
#include <mgpu/core/detail/elementwise.hpp>
#include <mgpu/core/detail/training_math.hpp>
#include <mgpu/ops/ops.hpp>

#include "ops/host_op_stats.hpp"

namespace mgpu::ops {
namespace host {
namespace {

using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatrixMap = Eigen::Map<Matrix>;
using ConstMatrixMap = Eigen::Map<Matrix const>;

thread_local HostGemmStats thread_stats;

// Eigen's product expressions allocate their packing buffers on every call, and on a worker
// thread's malloc arena that costs page faults each time (about 10% of a training step). This
// runs Eigen's own blocked kernel with the buffers kept per thread instead.
class ReusedBlocking : public Eigen::internal::level3_blocking<float, float> {
 public:
  ReusedBlocking(Eigen::Index rows, Eigen::Index cols, Eigen::Index depth) {
    m_mc = rows;
    m_nc = cols;
    m_kc = depth;
    Eigen::internal::computeProductBlockingSizes<float, float, 1>(m_kc, m_mc, m_nc, Eigen::Index{1});
    thread_local std::vector<float, Eigen::aligned_allocator<float>> buffer;
    std::size_t const a = static_cast<std::size_t>(m_mc * m_kc);
    std::size_t const b = static_cast<std::size_t>(m_kc * m_nc);
    std::size_t const padded_a = (a + 63) / 64 * 64;  // keeps block B 256-byte aligned
    if (buffer.size() < padded_a + b) buffer.resize(padded_a + b);
    m_blockA = buffer.data();
    m_blockB = buffer.data() + padded_a;
  }
};

// Column-major C^T [n, m] += alpha op(B)^T op(A)^T, which is row-major C += alpha op(A) op(B).
template <int BOrder, int AOrder>
void blocked_gemm(Eigen::Index m, Eigen::Index n, Eigen::Index k, float const* a, Eigen::Index lda, float const* b, Eigen::Index ldb,
                  float* c, float alpha) {
  ReusedBlocking blocking(n, m, k);
  Eigen::internal::general_matrix_matrix_product<Eigen::Index, float, BOrder, false, float, AOrder, false, Eigen::ColMajor, 1>::run(
      n, m, k, b, ldb, a, lda, c, 1, n, alpha, blocking, nullptr);
}

// The float32 call: C's starting value (beta C, or the bias rows), the product accumulated onto
// it, then the activation.
void float32_gemm(GemmCall const& g, float const* a, float const* b, float* c, float const* bias) {
  MatrixMap C(c, g.m, g.n);
  if (bias != nullptr) C.rowwise() = Eigen::Map<Eigen::RowVectorXf const>(bias, g.n);
  else if (g.beta == 0.0f) C.setZero();
  else if (g.beta != 1.0f) C *= g.beta;
  if (g.m > 0 && g.n > 0 && g.k > 0) {
    // Row-major B [k, n] read column-major is B^T; a transposed B [n, k] read row-major is B^T too.
    Eigen::Index const lda = g.transpose_a ? g.m : g.k;
    Eigen::Index const ldb = g.transpose_b ? g.k : g.n;
    if (!g.transpose_b && !g.transpose_a) blocked_gemm<Eigen::ColMajor, Eigen::ColMajor>(g.m, g.n, g.k, a, lda, b, ldb, c, g.alpha);
    else if (!g.transpose_b) blocked_gemm<Eigen::ColMajor, Eigen::RowMajor>(g.m, g.n, g.k, a, lda, b, ldb, c, g.alpha);
    else if (!g.transpose_a) blocked_gemm<Eigen::RowMajor, Eigen::ColMajor>(g.m, g.n, g.k, a, lda, b, ldb, c, g.alpha);
    else blocked_gemm<Eigen::RowMajor, Eigen::RowMajor>(g.m, g.n, g.k, a, lda, b, ldb, c, g.alpha);
  }
  if (g.relu) C = C.cwiseMax(0.0f);
}

}  // namespace

void eigen_gemm(GemmCall const& call) {
  if (call.dtype == DType::float32) {
    float32_gemm(call, static_cast<float const*>(call.a), static_cast<float const*>(call.b), static_cast<float*>(call.c),
                 static_cast<float const*>(call.bias));
    return;
  }
  mgpu::detail::visit_dtype(call.dtype, [&]<class T>(std::type_identity<T>) {
    auto widen = [](void const* p, std::int64_t count) {
      std::vector<float> out(static_cast<std::size_t>(count));
      for (std::int64_t i = 0; i < count; ++i) out[static_cast<std::size_t>(i)] = detail::load(static_cast<T const*>(p), i);
      return out;
    };
    std::vector<float> const a = widen(call.a, call.m * call.k);
    std::vector<float> const b = widen(call.b, call.k * call.n);
    std::vector<float> const bias = call.bias != nullptr ? widen(call.bias, call.n) : std::vector<float>{};
    std::vector<float> c = call.beta != 0.0f && call.bias == nullptr ? widen(call.c, call.m * call.n)
                                                                     : std::vector<float>(static_cast<std::size_t>(call.m * call.n));
    float32_gemm(call, a.data(), b.data(), c.data(), call.bias != nullptr ? bias.data() : nullptr);
    for (std::int64_t i = 0; i < call.m * call.n; ++i) detail::store(static_cast<T*>(call.c), i, c[static_cast<std::size_t>(i)]);
  });
}

void gemm(GemmCall const& call) {
  auto const start = std::chrono::steady_clock::now();
#if MGPU_HOST_GEMM_ONEDNN
  if (!onednn_gemm(call)) eigen_gemm(call);
#else
  eigen_gemm(call);
#endif
  thread_stats.calls += 1;
  thread_stats.flops += 2.0 * static_cast<double>(call.m) * static_cast<double>(call.n) * static_cast<double>(call.k);
  thread_stats.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (call.gelu_out != nullptr)  // the shared functor (as on CUDA), counted as an activation
    timed(HostOpFamily::activation, [&] {
      mgpu::detail::visit_dtype(call.dtype, [&]<class T>(std::type_identity<T>) {
        mgpu::detail::for_each_index(
            call.m * call.n,
            detail::ActivationOp<T, detail::Gelu>{static_cast<T const*>(call.c), static_cast<T*>(call.gelu_out)});
      });
    });
}

}  // namespace host

HostGemmStats host_gemm_stats() noexcept { return host::thread_stats; }

}  // namespace mgpu::ops
