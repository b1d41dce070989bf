// The reduction at the heart of the shared-memory all-reduce: elements [begin, end) of every rank's
// input, combined in rank order, written to every rank's output. Each input is read once and each
// output written once. The CUDA kernel runs the per-element operator on a grid over a bounded
// pointer array; the host runs the same math in vectorized loops over any number of ranks. The
// element math of mgpu::ReduceOp, in core so that comm's host backend
// (src/comm/host_communicator.cpp) and the CUDA kernel (src/kernels/reduce.cu) share it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <type_traits>

#include <mgpu/core/dtype.hpp>
#include <mgpu/core/host_device.hpp>
#include <mgpu/core/reduce_op.hpp>

namespace mgpu::detail {

/// a combined with b under O.
template <ReduceOp O>
MGPU_HD inline float combine(float a, float b) {
  if constexpr (O == ReduceOp::min) {
    return b < a ? b : a;
  } else if constexpr (O == ReduceOp::max) {
    return b > a ? b : a;
  } else {
    return a + b;
  }
}

/// The combined value of `ranks` inputs as the operation's result (avg divides by the count).
template <ReduceOp O>
MGPU_HD inline float finish(float combined, int ranks) {
  if constexpr (O == ReduceOp::avg) {
    return combined / static_cast<float>(ranks);
  } else {
    return combined;
  }
}

/// Calls fn(std::integral_constant<ReduceOp, O>{}) for the runtime value `op`.
template <class Fn>
decltype(auto) visit_reduce_op(ReduceOp op, Fn&& fn) {
  switch (op) {
    case ReduceOp::avg: return fn(std::integral_constant<ReduceOp, ReduceOp::avg>{});
    case ReduceOp::min: return fn(std::integral_constant<ReduceOp, ReduceOp::min>{});
    case ReduceOp::max: return fn(std::integral_constant<ReduceOp, ReduceOp::max>{});
    case ReduceOp::sum: break;
  }
  return fn(std::integral_constant<ReduceOp, ReduceOp::sum>{});
}

/// The most ranks one CUDA reduction kernel reads (the size of its pointer arrays); the host form
/// has no such bound.
inline constexpr int max_reduce_ranks = 16;

/// Per-element form: out[q][i] = finish(in[0][i] (+) in[1][i] (+) ... ) for every output q.
template <Element T, ReduceOp O>
struct ReduceSlice {
  /// Elements in 16 bytes: what vector() reads from each input and writes to each output.
  static constexpr int lanes = 16 / static_cast<int>(sizeof(T));

  T const* in[max_reduce_ranks];
  T* out[max_reduce_ranks];
  int inputs;
  int outputs;

  MGPU_HD void operator()(std::int64_t i) const {
    float acc = static_cast<float>(in[0][i]);
    for (int p = 1; p < inputs; ++p) acc = combine<O>(acc, static_cast<float>(in[p][i]));
    T const result(finish<O>(acc, inputs));
    for (int q = 0; q < outputs; ++q) out[q][i] = result;
  }

  /// Elements [i, i + lanes), with one 16-byte load per input and one 16-byte store per output
  /// (every pointer + i on a 16-byte boundary): the same math as operator() on each element.
  MGPU_HD void vector(std::int64_t i) const {
    Pack const first = load(in[0] + i);
    float acc[lanes];
    for (int l = 0; l < lanes; ++l) acc[l] = static_cast<float>(first.v[l]);
    for (int p = 1; p < inputs; ++p) {
      Pack const next = load(in[p] + i);
      for (int l = 0; l < lanes; ++l) acc[l] = combine<O>(acc[l], static_cast<float>(next.v[l]));
    }
    Pack result;
    for (int l = 0; l < lanes; ++l) result.v[l] = T(finish<O>(acc[l], inputs));
    for (int q = 0; q < outputs; ++q) store(out[q] + i, result);
  }

 private:
  struct alignas(16) Pack {
    T v[lanes];
  };
  static_assert(sizeof(Pack) == 16);
  MGPU_HD static Pack load(T const* from) {
    Pack pack;
#ifdef __CUDA_ARCH__
    *reinterpret_cast<uint4*>(&pack) = *reinterpret_cast<uint4 const*>(from);  // one 128-bit load
#else
    for (int l = 0; l < lanes; ++l) pack.v[l] = from[l];
#endif
    return pack;
  }
  MGPU_HD static void store(T* to, Pack const& pack) {
#ifdef __CUDA_ARCH__
    *reinterpret_cast<uint4*>(to) = *reinterpret_cast<uint4 const*>(&pack);  // one 128-bit store
#else
    for (int l = 0; l < lanes; ++l) to[l] = pack.v[l];
#endif
  }
};

/// ReduceSlice over [begin, end) as count() work items for a grid: the head's elements one by one
/// up to the first 16-byte boundary, then whole vectors of `lanes` elements (ReduceSlice::vector),
/// then the tail's elements one by one. Vectors only when every input and output sits at the same
/// offset from a 16-byte boundary at `begin` (the head then brings them all onto one); otherwise
/// every item is one element.
template <Element T, ReduceOp O>
struct VectorReduceSlice {
  static constexpr int lanes = ReduceSlice<T, O>::lanes;

  ReduceSlice<T, O> slice;
  std::int64_t begin = 0;
  std::int64_t head = 0;     // the first vector's element (end when there are none)
  std::int64_t vectors = 0;  // whole vectors from `head`
  std::int64_t end = 0;

  VectorReduceSlice(ReduceSlice<T, O> const& s, std::int64_t first, std::int64_t last)
      : slice(s), begin(first), head(last), end(last) {
    auto const offset = [](void const* p) { return reinterpret_cast<std::uintptr_t>(p) % 16; };
    std::uintptr_t const at = offset(slice.in[0] + begin);
    bool lined_up = at % sizeof(T) == 0;
    for (int p = 1; p < slice.inputs; ++p) lined_up = lined_up && offset(slice.in[p] + begin) == at;
    for (int q = 0; q < slice.outputs; ++q) lined_up = lined_up && offset(slice.out[q] + begin) == at;
    if (!lined_up) return;
    head = std::min<std::int64_t>(end, begin + static_cast<std::int64_t>((16 - at) % 16 / sizeof(T)));
    vectors = (end - head) / lanes;
  }

  [[nodiscard]] std::int64_t count() const { return end - begin - vectors * (lanes - 1); }

  MGPU_HD void operator()(std::int64_t i) const {
    std::int64_t const heads = head - begin;
    if (i < heads) {
      slice(begin + i);
    } else if (i < heads + vectors) {
      slice.vector(head + (i - heads) * lanes);
    } else {
      slice(head + vectors * lanes + (i - heads - vectors));
    }
  }
};

/// Host form of a reduction's operands: one input pointer per rank and one output pointer per
/// receiving rank, any number of each. Read-only while a reduction runs; not owned.
template <Element T>
struct HostReduceOperands {
  std::span<T const* const> in;
  std::span<T* const> out;
};

namespace host {
// One fused pass for a fixed number of inputs and outputs: every input element is read once and
// every output element written once. Outputs may be inputs (in place) but only at the same index,
// so there is no loop-carried dependency (hence GCC's ivdep; Clang checks for overlap at run
// time). Pointers are copied to locals so the compiler does not reload them after each store.
template <Element T, ReduceOp O, int N, int M>
void fused(HostReduceOperands<T> const& r, std::int64_t begin, std::int64_t end) {
  T const* in[N];
  T* out[M];
  for (int p = 0; p < N; ++p) in[p] = r.in[p];
  for (int q = 0; q < M; ++q) out[q] = r.out[q];
#if !defined(__clang__)
#pragma GCC ivdep
#endif
  for (std::int64_t i = begin; i < end; ++i) {
    float acc = static_cast<float>(in[0][i]);
    for (int p = 1; p < N; ++p) acc = combine<O>(acc, static_cast<float>(in[p][i]));
    T const result(finish<O>(acc, N));
    for (int q = 0; q < M; ++q) out[q][i] = result;
  }
}

template <Element T, ReduceOp O, int N>
bool try_fused(HostReduceOperands<T> const& r, std::int64_t begin, std::int64_t end) {
  if (r.in.size() != N) return false;
  if (r.out.size() == N) {
    fused<T, O, N, N>(r, begin, end);
  } else if (r.out.size() == 1) {
    fused<T, O, N, 1>(r, begin, end);
  } else {
    return false;
  }
  return true;
}

// Any number of inputs and outputs, in blocks that stay in L1.
template <Element T, ReduceOp O>
void blocked(HostReduceOperands<T> const& r, std::int64_t begin, std::int64_t end) {
  constexpr std::int64_t block = 2048;
  int const inputs = static_cast<int>(r.in.size());
  float acc[block];
  for (std::int64_t b = begin; b < end; b += block) {
    std::int64_t const len = std::min(block, end - b);
    T const* first = r.in[0] + b;
    for (std::int64_t j = 0; j < len; ++j) acc[j] = static_cast<float>(first[j]);
    for (int p = 1; p < inputs; ++p) {
      T const* src = r.in[p] + b;
      for (std::int64_t j = 0; j < len; ++j) acc[j] = combine<O>(acc[j], static_cast<float>(src[j]));
    }
    for (T* const out : r.out) {
      T* dst = out + b;
      for (std::int64_t j = 0; j < len; ++j) dst[j] = T(finish<O>(acc[j], inputs));
    }
  }
}
}  // namespace host

/// Host form of ReduceSlice over [begin, end) for any number of inputs (at least one) and outputs:
/// the same element math in the same order, so the same results, with loops the compiler
/// vectorizes (fused for up to 8 ranks, blocked beyond). Called by one thread per slice.
template <Element T, ReduceOp O>
void reduce_slice_host(HostReduceOperands<T> const& r, std::int64_t begin, std::int64_t end) {
  bool const done = host::try_fused<T, O, 1>(r, begin, end) || host::try_fused<T, O, 2>(r, begin, end) ||
                    host::try_fused<T, O, 3>(r, begin, end) || host::try_fused<T, O, 4>(r, begin, end) ||
                    host::try_fused<T, O, 5>(r, begin, end) || host::try_fused<T, O, 6>(r, begin, end) ||
                    host::try_fused<T, O, 7>(r, begin, end) || host::try_fused<T, O, 8>(r, begin, end);
  if (!done) host::blocked<T, O>(r, begin, end);
}

}  // namespace mgpu::detail
