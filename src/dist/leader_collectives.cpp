// The hierarchical leader's exchanges between processes (leader_collectives.hpp): for each
// collective kind the leaders' exchange (exchange.hpp: over MPI or Gloo) on float32 or byte
// staging buffers, the partials combined in process order (the same bits on every process); an
// all-reduce among three or more processes is a reduce-scatter and an all-gather from
// kSplitAllReduce elements on.
#include "dist/leader_collectives.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <mgpu/comm/reduce_op.hpp>
#include <mgpu/core/detail/elementwise.hpp>
#include <mgpu/core/detail/reduce_slice.hpp>

namespace mgpu::dist::detail {
namespace {

// Element conversions between a tensor's dtype and float32, where reductions happen.
void to_float(Tensor const& t, std::int64_t begin, std::int64_t count, float* out) {
  mgpu::detail::visit_dtype(t.dtype(), [&]<class T>(std::type_identity<T>) {
    T const* in = static_cast<T const*>(t.data()) + begin;
    for (std::int64_t i = 0; i < count; ++i) out[i] = static_cast<float>(in[i]);
  });
}

void from_float(float const* in, Tensor const& t, std::int64_t begin, std::int64_t count) {
  mgpu::detail::visit_dtype(t.dtype(), [&]<class T>(std::type_identity<T>) {
    T* out = static_cast<T*>(t.data()) + begin;
    for (std::int64_t i = 0; i < count; ++i) out[i] = T(in[i]);
  });
}

// out[i] = parts[0][i] (+) parts[1][i] (+) ... in process order, `stride` apart; avg divides by
// the world's size (the processes' partials are sums).
void combine_parts(comm::ReduceOp op, float const* parts, int count, std::int64_t stride, std::int64_t n,
                   int world_size, float* out) {
  // In blocks that stay in L1, each element combined in process order; two parts (the all-reduce
  // between 2 processes) in one pass.
  mgpu::detail::visit_reduce_op(op, [&]<comm::ReduceOp O>(std::integral_constant<comm::ReduceOp, O>) {
    if (count == 2) {
      float const* second = parts + stride;
#if !defined(__clang__)
#pragma GCC ivdep
#endif
      for (std::int64_t i = 0; i < n; ++i) out[i] = mgpu::detail::finish<O>(mgpu::detail::combine<O>(parts[i], second[i]), world_size);
      return;
    }
    constexpr std::int64_t block = 1024;
    float acc[block];
    for (std::int64_t b = 0; b < n; b += block) {
      std::int64_t const len = std::min(block, n - b);
      std::copy_n(parts + b, len, acc);
      for (int p = 1; p < count; ++p) {
        float const* part = parts + p * stride + b;
        for (std::int64_t i = 0; i < len; ++i) acc[i] = mgpu::detail::combine<O>(acc[i], part[i]);
      }
      for (std::int64_t i = 0; i < len; ++i) out[b + i] = mgpu::detail::finish<O>(acc[i], world_size);
    }
  });
}

// Combines `count` float32 partials of `n` elements each, contiguous in process order, into `out`.
void combine_into(comm::ReduceOp op, float const* parts, int count, std::int64_t n, int world_size, Tensor const& out) {
  if (out.dtype() == DType::float32) {
    combine_parts(op, parts, count, n, n, world_size, static_cast<float*>(out.data()));
    return;
  }
  auto mine = buffer<float>(static_cast<std::size_t>(n));
  combine_parts(op, parts, count, n, n, world_size, mine->data());
  from_float(mine->data(), out, 0, n);
}

// From this many elements on, an all-reduce among three or more leaders is a reduce-scatter and
// an all-gather (two rounds, 2 (P-1)/P of the data each way) instead of one all-gather of every
// partial ((P-1) times the data). Both combine each element in process order: the same bits.
constexpr std::int64_t kSplitAllReduce = std::int64_t{1} << 16;

}  // namespace

void Leader::operator()() const {
  std::string const what = call.name(rank);
  Link const& l = *link;
  l.state().throw_if_aborted(what);
  auto const start = Clock::now();
  l.exchange_headers(call, rank, what, start);
  if (call.kind == OpKind::barrier) return;
  std::int64_t const n = call.count;
  int const P = l.processes();
  int const p = l.process();
  std::size_t const element = size_of(call.dtype);
  Exchange& x = l.exchange();
  Step const step{what, start, call.seq, kData};
  auto const both = [](auto a, auto b) { return std::make_shared<std::pair<decltype(a), decltype(b)>>(a, b); };
  switch (call.kind) {
    case OpKind::all_reduce: {  // call.recv holds the process's partial
      if (P >= 3 && n >= kSplitAllReduce) {
        // Reduce-scatter then all-gather among the leaders: each receives every process's
        // partial of its 1/P block (all-to-all), combines it in process order and the blocks are
        // gathered: 2 (P-1)/P of the data in and out instead of (P-1) times it, in two rounds.
        auto mine = buffer<float>(static_cast<std::size_t>(n));
        to_float(call.recv, 0, n, mine->data());
        std::vector<std::int64_t> counts, offsets;
        for (int q = 0; q < P; ++q) {
          offsets.push_back(n * q / P);
          counts.push_back(n * (q + 1) / P - n * q / P);
        }
        std::int64_t const own = counts[static_cast<std::size_t>(p)];
        auto parts = buffer<float>(static_cast<std::size_t>(own * P));
        std::vector<std::int64_t> part_counts(static_cast<std::size_t>(P), own), part_offsets;
        for (int q = 0; q < P; ++q) part_offsets.push_back(own * q);
        x.all_to_all(l, step, both(mine, parts), mine->data(), counts, offsets, parts->data(), part_counts, part_offsets,
                     Unit::float32);
        combine_parts(call.op, parts->data(), P, own, own, l.world_size(), mine->data() + offsets[static_cast<std::size_t>(p)]);
        x.all_gather(l, Step{what, start, call.seq, kData2}, mine, mine->data(), Unit::float32, counts, offsets);
        from_float(mine->data(), call.recv, 0, n);
        break;
      }
      // Every process's partial gathered in place (this one's staged at its own offset), then
      // combined straight into call.recv when it holds float32.
      auto all = buffer<float>(static_cast<std::size_t>(n) * static_cast<std::size_t>(P));
      to_float(call.recv, 0, n, all->data() + static_cast<std::ptrdiff_t>(p) * n);
      std::vector<std::int64_t> counts(static_cast<std::size_t>(P), n), offsets;
      for (int q = 0; q < P; ++q) offsets.push_back(n * q);
      x.all_gather(l, step, all, all->data(), Unit::float32, counts, offsets);
      combine_into(call.op, all->data(), P, n, l.world_size(), call.recv);
      break;
    }
    case OpKind::reduce_scatter: {  // call.send: the partial over the world (W*n); call.recv: this process's blocks
                                    // (L*n)
      auto mine = buffer<float>(static_cast<std::size_t>(l.world_size() * n));
      std::int64_t const block = l.local_size(p) * n;
      auto all = buffer<float>(static_cast<std::size_t>(block * P));
      to_float(call.send, 0, l.world_size() * n, mine->data());
      std::vector<std::int64_t> send_counts, send_offsets, recv_counts, recv_offsets;
      for (int q = 0; q < P; ++q) {
        send_counts.push_back(l.local_size(q) * n);
        send_offsets.push_back(l.first(q) * n);
        recv_counts.push_back(block);
        recv_offsets.push_back(q * block);
      }
      x.all_to_all(l, step, both(mine, all), mine->data(), send_counts, send_offsets, all->data(), recv_counts,
                   recv_offsets, Unit::float32);
      combine_parts(call.op, all->data(), P, block, block, l.world_size(), mine->data());
      from_float(mine->data(), call.recv, 0, block);
      break;
    }
    case OpKind::all_gather: {  // call.recv: the whole result (W*n), this process's blocks filled
      std::int64_t const bytes = n * static_cast<std::int64_t>(element);
      auto all = buffer<std::byte>(static_cast<std::size_t>(l.world_size() * bytes));
      std::int64_t const own = l.local_size(p) * bytes;
      if (own > 0)
        std::memcpy(all->data() + l.first(p) * bytes, static_cast<std::byte const*>(call.recv.data()) + l.first(p) * bytes,
                    static_cast<std::size_t>(own));
      std::vector<std::int64_t> counts, offsets;
      for (int q = 0; q < P; ++q) {
        counts.push_back(l.local_size(q) * bytes);
        offsets.push_back(l.first(q) * bytes);
      }
      x.all_gather(l, step, all, all->data(), Unit::byte, counts, offsets);
      if (!all->empty()) std::memcpy(call.recv.data(), all->data(), all->size());
      break;
    }
    case OpKind::broadcast: {  // call.root: the root's process; call.recv: the buffer
      auto data = buffer<std::byte>(static_cast<std::size_t>(n) * element);
      if (p == call.root && !data->empty()) std::memcpy(data->data(), call.recv.data(), data->size());
      x.broadcast(l, step, data, data->data(), static_cast<std::int64_t>(data->size()), call.root);
      if (p != call.root && !data->empty()) std::memcpy(call.recv.data(), data->data(), data->size());
      break;
    }
    case OpKind::reduce: {  // call.root: the root's process; call.recv: the partial, the result on the root's process
      auto mine = buffer<float>(static_cast<std::size_t>(n));
      auto all = buffer<float>(p == call.root ? static_cast<std::size_t>(n * P) : 0);
      to_float(call.recv, 0, n, mine->data());
      x.gather(l, step, both(mine, all), mine->data(), all->data(), n, Unit::float32, call.root);
      if (p == call.root) {
        combine_parts(call.op, all->data(), P, n, n, l.world_size(), mine->data());
        from_float(mine->data(), call.recv, 0, n);
      }
      break;
    }
    default:
      break;
  }
}

}  // namespace mgpu::dist::detail
