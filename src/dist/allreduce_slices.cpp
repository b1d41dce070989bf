// The all-reduce by slices (allreduce_slices.hpp): each slice leader's pieces reduced inside the
// process in rank order, swapped over MPI (a send and a receive per piece, the first posted before
// the headers are checked) or through the pair's shared-memory rings, and combined in process
// order into every local rank's output.
#include "dist/allreduce_slices.hpp"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <type_traits>
#include <utility>

#include <mgpu/core/detail/elementwise.hpp>
#include <mgpu/core/detail/reduce_slice.hpp>

namespace mgpu::dist::detail {
namespace {

// The number of pieces of a slice of n elements (an empty slice has one, empty).
std::int64_t piece_count(std::int64_t n) { return std::max<std::int64_t>(1, (n + kSlicePiece - 1) / kSlicePiece); }

// out[i] = in[0][begin + i] (+) in[1][begin + i] (+) ... for i < n, in float32, in rank order.
template <class T, comm::ReduceOp O>
void reduce_local(std::vector<T const*> const& in, std::int64_t begin, std::int64_t n, float* out) {
  T const* first = in[0] + begin;
  if (in.size() == 1) {
    for (std::int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(first[i]);
    return;
  }
  T const* second = in[1] + begin;
  for (std::int64_t i = 0; i < n; ++i)
    out[i] = mgpu::detail::combine<O>(static_cast<float>(first[i]), static_cast<float>(second[i]));
  for (std::size_t q = 2; q < in.size(); ++q) {
    T const* part = in[q] + begin;
    for (std::int64_t i = 0; i < n; ++i) out[i] = mgpu::detail::combine<O>(out[i], static_cast<float>(part[i]));
  }
}

// out[q][begin + i] = finish(first[i] (+) second[i]) for every output q and i < n.
template <class T, comm::ReduceOp O>
void combine_two(float const* first, float const* second, std::int64_t begin, std::int64_t n, int world_size,
                 std::vector<T*> const& out) {
  constexpr std::int64_t block = 1024;
  float result[block];
  for (std::int64_t b = 0; b < n; b += block) {
    std::int64_t const len = std::min(block, n - b);
    for (std::int64_t i = 0; i < len; ++i)
      result[i] = mgpu::detail::finish<O>(mgpu::detail::combine<O>(first[b + i], second[b + i]), world_size);
    for (T* const o : out) {
      T* const to = o + begin + b;
      for (std::int64_t i = 0; i < len; ++i) to[i] = T(result[i]);
    }
  }
}

}  // namespace

void SliceLeader::operator()() const {
  std::string const what = call.name(rank);
  Link const& l = *link;
  l.state().throw_if_aborted(what);
  auto const start = Clock::now();
  std::vector<Posted> const& all = *posted;
  for (std::size_t q = 0; q < all.size(); ++q) {
    Posted const& other = all[q];
    auto const mismatch = [&](char const* field, std::string const& theirs, std::string const& mine) {
      l.fail(Errc::invalid_argument, what + ": rank " + std::to_string(first + static_cast<int>(q)) + " passed " +
                                         field + " " + theirs + ", rank " + std::to_string(rank) + " passed " + mine +
                                         " (expected the same on every rank)");
    };
    if (other.count != call.count) mismatch("element count", std::to_string(other.count), std::to_string(call.count));
    if (other.dtype != call.dtype)
      mismatch("dtype", std::string(mgpu::to_string(other.dtype)), std::string(mgpu::to_string(call.dtype)));
    if (other.op != call.op)
      mismatch("reduce op", std::string(to_string(other.op)), std::string(to_string(call.op)));
  }
  mpi_count(count, what);
  mgpu::detail::visit_dtype(call.dtype, [&]<class T>(std::type_identity<T>) {
    std::vector<T const*> in;
    std::vector<T*> out;
    for (Posted const& r : all) {
      in.push_back(static_cast<T const*>(r.send) + begin);
      out.push_back(static_cast<T*>(r.recv) + begin);
    }
    mgpu::detail::visit_reduce_op(call.op, [&]<comm::ReduceOp O>(std::integral_constant<comm::ReduceOp, O>) {
      if (rings) {
        through_rings<T, O>(what, start, in, out);
      } else {
        over_mpi<T, O>(what, start, in, out);
      }
    });
  });
}

template <class T, comm::ReduceOp O>
void SliceLeader::over_mpi(std::string const& what, Clock::time_point start, std::vector<T const*> const& in,
                           std::vector<T*> const& out) const {
  Link const& l = *link;
  int const p = l.process();
  int const peer = 1 - p;
  float* const mine = static_cast<float*>(parts.data()) + p * count;
  float* const theirs = static_cast<float*>(parts.data()) + peer * count;
  std::int64_t const pieces = piece_count(count);
  auto keep = std::make_shared<Tensor>(parts);
  Requests requests;
  std::vector<std::size_t> received;  // each piece's receive
  auto const combine = [&](std::int64_t k) {
    l.wait_exchange(requests, what, start, received[static_cast<std::size_t>(k)]);
    std::int64_t const at = k * kSlicePiece;
    combine_two<T, O>(p == 0 ? mine + at : theirs + at, p == 0 ? theirs + at : mine + at, at, length(k),
                      l.world_size(), out);
  };
  for (std::int64_t k = 0; k < pieces; ++k) {
    std::int64_t const at = k * kSlicePiece;
    int const n = static_cast<int>(length(k));
    reduce_local<T, partial_op(O)>(in, at, n, mine + at);
    requests.add(peer, Requests::Kind::send, keep, "MPI_Isend",
                 [&](MPI_Request* r) { return MPI_Isend(mine + at, n, MPI_FLOAT, peer, slice, l.data, r); });
    received.push_back(requests.add(peer, Requests::Kind::receive, keep, "MPI_Irecv", [&](MPI_Request* r) {
      return MPI_Irecv(theirs + at, n, MPI_FLOAT, peer, slice, l.data, r);
    }));
    // The first piece is posted before the headers are checked, so the exchange takes one
    // round trip; a mismatch is named from the headers before any data is awaited.
    if (k == 0) l.exchange_headers(call, rank, what, start, slice);
    if (k > 0) combine(k - 1);
  }
  combine(pieces - 1);
  l.wait_exchange(requests, what, start);
}

template <class T, comm::ReduceOp O>
void SliceLeader::through_rings(std::string const& what, Clock::time_point start,
                                std::vector<T const*> const& in, std::vector<T*> const& out) const {
  Link const& l = *link;
  SharedRings& r = *rings;
  int const p = l.process();
  int const peer = 1 - p;
  auto const pieces = static_cast<std::uint64_t>(piece_count(count));
  std::uint64_t const base = r.pieces(slice);
  std::atomic_ref<std::uint64_t> const my_ready(*r.ready(p, slice));
  std::atomic_ref<std::uint64_t> const my_consumed(*r.consumed(p, slice));
  std::atomic_ref<std::uint64_t> const their_ready(*r.ready(peer, slice));
  std::atomic_ref<std::uint64_t> const their_consumed(*r.consumed(peer, slice));
  std::uint64_t made = 0;
  std::uint64_t combined = 0;
  // Makes every piece it may: true if any.
  auto const make = [&] {
    bool any = false;
    while (made < pieces && made < combined + SharedRings::slots &&
           base + made < their_consumed.load(std::memory_order_acquire) + SharedRings::slots) {
      auto const k = static_cast<std::int64_t>(made);
      reduce_local<T, partial_op(O)>(in, k * kSlicePiece, length(k), r.slot(p, slice, base + made));
      my_ready.store(base + ++made, std::memory_order_release);
      any = true;
    }
    return any;
  };
  // The first pieces are made while the headers travel; neither process combines anything
  // before it has checked the other's header.
  make();
  l.exchange_headers(call, rank, what, start, slice);
  for (int polls = 0; combined < pieces;) {
    bool moved = make();
    if (combined < made && their_ready.load(std::memory_order_acquire) > base + combined) {
      auto const k = static_cast<std::int64_t>(combined);
      float const* const mine = r.slot(p, slice, base + combined);
      float const* const theirs = r.slot(peer, slice, base + combined);
      combine_two<T, O>(p == 0 ? mine : theirs, p == 0 ? theirs : mine, k * kSlicePiece, length(k), l.world_size(),
                        out);
      my_consumed.store(base + ++combined, std::memory_order_release);
      moved = true;
    }
    if (moved) {
      polls = 0;
      continue;
    }
    l.state().throw_if_aborted(what);
    if (Clock::now() >= start + l.timeout())
      l.fail(Errc::timeout, what + " waited " + format_duration(Clock::now() - start) + " for " + l.describe(peer) +
                                " to share piece " + std::to_string(combined + 1) + " of " + std::to_string(pieces) +
                                " (expected it within the " + format_duration(l.timeout()) + " deadline; " +
                                comm::timeout_env_var + " sets it in seconds)");
    back_off(polls++);
  }
  r.pieces(slice) = base + pieces;
}

}  // namespace mgpu::dist::detail
