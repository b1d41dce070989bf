// The transformer ops (mgpu/ops/transformer.hpp): argument checks at the call, then the functors of
// mgpu/core/detail/transformer_math.hpp, run in a loop by one piece of work on a host stream's
// worker (attention: the tiled products of host_attention.cpp), or launched as kernels
// (src/kernels/transformer.cu) on a CUDA stream. Every output is
// summed in a fixed order, so results are bitwise reproducible.
#include "kernels/transformer.hpp"

#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <mgpu/config.hpp>
#include <mgpu/core/detail/elementwise.hpp>
#include <mgpu/core/detail/transformer_math.hpp>
#include <mgpu/core/error.hpp>
#include <mgpu/ops/transformer.hpp>

#include "core/backend.hpp"
#include "kernels/ops.hpp"
#include "ops/host_attention.hpp"
#include "ops/host_op_stats.hpp"

namespace mgpu::ops {
namespace {

std::string str(DType t) { return std::string(to_string(t)); }

// A defined tensor on the stream's device.
void check(Tensor const& t, char const* op, char const* role, Stream const& stream) {
  if (!t.defined())
    throw Error(Errc::invalid_argument, std::string(op) + ": " + role + " is undefined (expected a tensor)");
  if (t.device() != stream.device())
    throw Error(Errc::device, std::string(op) + ": " + role + " is on " + t.device().to_string() +
                                  " but the stream is on " + stream.device().to_string() +
                                  " (expected the stream's device)");
}

void check_dtype(Tensor const& t, DType expected, char const* op, char const* role) {
  if (t.dtype() != expected)
    throw Error(Errc::invalid_argument,
                std::string(op) + ": " + role + " is " + str(t.dtype()) + " (expected " + str(expected) + ")");
}

void check_shape(Tensor const& t, Shape const& expected, char const* op, char const* role) {
  if (t.shape() != expected)
    throw Error(Errc::invalid_argument, std::string(op) + ": " + role + " has shape " + to_string(t.shape()) +
                                            " (expected " + to_string(expected) + ")");
}

template <class T>
T* ptr(Tensor const& t) {
  return static_cast<T*>(t.data());
}

template <class Fn>
void visit(DType dtype, Fn&& fn) {
  mgpu::detail::visit_dtype(dtype, [&]<class T>(std::type_identity<T>) { fn(T{}); });
}

Error bad_id(char const* op, char const* what, std::int32_t id, std::int64_t position, std::int64_t vocab,
             std::string const& extra = {}) {
  return Error(Errc::invalid_argument, std::string(op) + ": " + what + " " + std::to_string(id) + " at position " +
                                           std::to_string(position) + " (expected a token id in [0, " +
                                           std::to_string(vocab) + ")" + extra + ")");
}

void check_attention(char const* op, Tensor const& qkv, Tensor const& y, Tensor const& lse, std::int64_t heads,
                     Stream const& stream, AttentionDropout const& dropout) {
  check(qkv, op, "qkv", stream);
  check(y, op, "y", stream);
  check(lse, op, "lse", stream);
  if (qkv.rank() != 3 || qkv.dim(2) % 3 != 0)
    throw Error(Errc::invalid_argument,
                std::string(op) + ": qkv has shape " + to_string(qkv.shape()) + " (expected [B, T, 3C])");
  std::int64_t const c = qkv.dim(2) / 3;
  if (heads < 1 || c % heads != 0)
    throw Error(Errc::invalid_argument, std::string(op) + ": " + std::to_string(heads) + " heads for " +
                                            std::to_string(c) +
                                            " features (expected heads >= 1 dividing the features)");
  check_shape(y, {qkv.dim(0), qkv.dim(1), c}, op, "y");
  check_dtype(y, qkv.dtype(), op, "y");
  check_shape(lse, {qkv.dim(0), heads, qkv.dim(1)}, op, "lse");
  check_dtype(lse, DType::float32, op, "lse");
  if (!(dropout.p >= 0.0f && dropout.p < 1.0f))
    throw Error(Errc::invalid_argument,
                std::string(op) + ": dropout " + std::to_string(dropout.p) + " (expected 0 <= p < 1)");
  if (dropout.heads != 0 && (dropout.head_offset < 0 || dropout.head_offset + heads > dropout.heads))
    throw Error(Errc::invalid_argument,
                std::string(op) + ": dropout over heads [" + std::to_string(dropout.head_offset) + ", " +
                    std::to_string(dropout.head_offset + heads) + ") of " + std::to_string(dropout.heads) +
                    " (expected the op's heads inside the model's, or heads 0)");
  if (dropout.heads == 0 && dropout.head_offset != 0)
    throw Error(Errc::invalid_argument, std::string(op) + ": dropout head_offset " +
                                            std::to_string(dropout.head_offset) +
                                            " with heads 0 (expected 0, or the model's heads)");
}

// The mask of `dropout` for the op's `heads` heads of t tokens.
detail::AttentionMask attention_mask(AttentionDropout const& dropout, std::int64_t heads, std::int64_t t) {
  return {dropout.p, dropout.seed,       dropout.row_offset, dropout.heads != 0 ? dropout.heads : heads,
          t,         dropout.head_offset};
}

// Runs body(each, scratch) with `scratch_words` 4-byte words of scratch memory, where each(n, op)
// calls op(i) for i in [0, n): on a host stream inside one piece of enqueued work, its time counted
// to `family` (host_op_seconds); on a CUDA stream
// as kernels over device scratch from the caching allocator of keep[0] (a tensor on the stream's
// device), released in stream order. The work is recorded as a use of the `keep` tensors (their
// blocks are reused in stream order, mgpu::detail::enqueue_using).
template <class Body>
void run(Stream& stream, HostOpFamily family, std::vector<Tensor> const& keep, std::size_t scratch_words,
         Body const& body) {
  if (stream.device().kind == DeviceKind::host) {
    mgpu::detail::enqueue_using(
        stream,
        [family, scratch_words, body] {
          host::timed(family, [&] {
            std::vector<std::uint32_t> scratch(scratch_words);
            body([](std::int64_t n, auto const& op) { mgpu::detail::for_each_index(n, op); },
                 static_cast<void*>(scratch.data()));
          });
        },
        keep);
    return;
  }
#if MGPU_CUDA_ENABLED
  int const ordinal = stream.device().index;
  void* const handle = stream.native_handle();
  mgpu::detail::ReleaseAfterOnExit const release(stream, keep);
  mgpu::detail::StreamScratch scratch(stream, keep.front());
  body([&](std::int64_t n, auto const& op) { kernels::each(ordinal, n, op, handle); },
       scratch_words > 0 ? scratch.allocate(4 * scratch_words) : nullptr);
#else
  throw Error(Errc::device, "transformer ops on " + stream.device().to_string() + " (this build has no CUDA backend)");
#endif
}

template <class T>
T* words(void* scratch, std::size_t offset) {
  return static_cast<T*>(static_cast<void*>(static_cast<std::uint32_t*>(scratch) + offset));
}

// Fails the stream with Error(invalid_argument) at the first of the n ids outside [0, vocab) that
// is not `ignore` (an int64 outside int32's range ignores nothing), naming it and its position.
void fail_on_bad_id(char const* op, char const* what, Tensor const& ids, std::int64_t n, std::int64_t vocab,
                    std::int64_t ignore, Stream& stream) {
  std::string const extra =
      ignore >= INT32_MIN && ignore <= INT32_MAX ? " or the ignore index " + std::to_string(ignore) : "";
  auto const bad = [op, what, vocab, extra](std::int32_t id, std::int64_t position) {
    return bad_id(op, what, id, position, vocab, extra);
  };
  if (stream.device().kind == DeviceKind::host) {
    mgpu::detail::enqueue_using(stream, [id = ptr<std::int32_t>(ids), n, vocab, ignore, bad] {
      for (std::int64_t i = 0; i < n; ++i)
        if ((id[i] < 0 || id[i] >= vocab) && id[i] != ignore) throw bad(id[i], i);
    }, ids);
    return;
  }
#if MGPU_CUDA_ENABLED
  // The GPU finds the first bad position; a host callback reads it back and fails the stream.
  auto found = std::make_shared<Buffer>(mgpu::detail::host_staging_allocator().allocate_pinned(sizeof(std::uint64_t)));
  {
    mgpu::detail::ReleaseAfterOnExit const release(stream, ids, *found);
    mgpu::detail::StreamScratch scratch(stream, ids);
    kernels::find_bad_token(stream.device().index, ptr<std::int32_t>(ids), n, vocab, ignore,
                            static_cast<std::uint64_t*>(found->data()), scratch, stream.native_handle());
  }
  stream.enqueue([found, bad] {
    std::uint64_t const code = *static_cast<std::uint64_t const*>(found->data());
    if (code == ~std::uint64_t{0}) return;
    throw bad(static_cast<std::int32_t>(static_cast<std::uint32_t>(code)), static_cast<std::int64_t>(code >> 32));
  });
#endif
}

constexpr std::int64_t no_ignore = std::int64_t{INT32_MIN} - 1;

// embedding and vocab_shard_embedding: ids int32 [B, T], wte [rows, C] (`wte_shape` names it in
// errors), wpe [P, C] with T <= P, y [B, T, C], all in wte's dtype. Returns {B, T, C}.
std::array<std::int64_t, 3> check_embedding(char const* op, Tensor const& ids, Tensor const& wte, Tensor const& wpe,
                                            Tensor const& y, char const* wte_shape, Stream& stream) {
  for (auto const& [t, role] : {std::pair{&ids, "ids"}, {&wte, "wte"}, {&wpe, "wpe"}, {&y, "y"}})
    check(*t, op, role, stream);
  check_dtype(ids, DType::int32, op, "ids");
  if (ids.rank() != 2)
    throw Error(Errc::invalid_argument,
                std::string(op) + ": ids have shape " + to_string(ids.shape()) + " (expected [B, T])");
  if (wte.rank() != 2 || wpe.rank() != 2 || wpe.dim(1) != wte.dim(1))
    throw Error(Errc::invalid_argument, std::string(op) + ": wte " + to_string(wte.shape()) + " and wpe " +
                                            to_string(wpe.shape()) + " (expected " + wte_shape + " and [P, C])");
  std::int64_t const batch = ids.dim(0), t = ids.dim(1), c = wte.dim(1);
  if (t > wpe.dim(0))
    throw Error(Errc::invalid_argument, std::string(op) + ": sequences of " + std::to_string(t) +
                                            " tokens (expected at most the " + std::to_string(wpe.dim(0)) +
                                            " positions of the block size)");
  check_dtype(wpe, wte.dtype(), op, "wpe");
  check_dtype(y, wte.dtype(), op, "y");
  check_shape(y, {batch, t, c}, op, "y");
  return {batch, t, c};
}

}  // namespace

void embedding(Tensor const& ids, Tensor const& wte, Tensor const& wpe, Tensor const& y, Stream& stream) {
  char const* op = "embedding";
  auto const dims = check_embedding(op, ids, wte, wpe, y, "[V, C]", stream);
  std::int64_t const batch = dims[0], t = dims[1], c = dims[2], vocab = wte.dim(0);
  fail_on_bad_id(op, "token id", ids, batch * t, vocab, no_ignore, stream);
  visit(wte.dtype(), [&]<class T>(T) {
    detail::EmbeddingOp<T> const e{ptr<std::int32_t>(ids), ptr<T>(wte), ptr<T>(wpe), ptr<T>(y), t, c, vocab};
    if (stream.device().kind == DeviceKind::host) {  // EmbeddingOp a row at a time: no index division per element
      mgpu::detail::enqueue_using(
          stream,
          [e, tokens = batch * t] {
            host::timed(HostOpFamily::embedding, [&] {
              for (std::int64_t n = 0; n < tokens; ++n) {
                std::int32_t const id = e.ids[n];
                T* out = e.y + n * e.c;
                if (id < 0 || id >= e.vocab) {
                  std::fill(out, out + e.c, T(NAN));
                  continue;
                }
                T const* token = e.wte + id * e.c;
                T const* position = e.wpe + (n % e.t) * e.c;
                for (std::int64_t j = 0; j < e.c; ++j)
                  out[j] = T(static_cast<float>(token[j]) + static_cast<float>(position[j]));
              }
            });
          },
          ids, wte, wpe, y);
      return;
    }
    run(stream, HostOpFamily::embedding, {ids, wte, wpe, y}, 0,
        [e, n = batch * t * c](auto const& each, void*) { each(n, e); });
  });
}

namespace {

// out [rows, c] (+)= for each n in [0, tokens) in order, g's row n added into out's row row_of(n)
// (none for -1), summed in float32: in place for float32, through a float32 copy per thread for
// 16-bit types (rounded once at the end, as the device ops).
template <class T, class RowOf>
void scatter_rows(T* out, std::int64_t rows, std::int64_t c, bool accumulate, std::int64_t tokens, RowOf const& row_of,
                  T const* g) {
  thread_local std::vector<float> copy;
  float* sums = nullptr;
  if constexpr (std::is_same_v<T, float>) {
    sums = out;
    if (!accumulate) std::fill(out, out + rows * c, 0.0f);
  } else {
    copy.resize(static_cast<std::size_t>(rows * c));
    sums = copy.data();
    for (std::int64_t i = 0; i < rows * c; ++i) sums[i] = accumulate ? static_cast<float>(out[i]) : 0.0f;
  }
  for (std::int64_t n = 0; n < tokens; ++n) {
    std::int64_t const row = row_of(n);
    if (row < 0) continue;
    float* to = sums + row * c;
    T const* from = g + n * c;
    for (std::int64_t e = 0; e < c; ++e) to[e] += static_cast<float>(from[e]);
  }
  if constexpr (!std::is_same_v<T, float>)
    for (std::int64_t i = 0; i < rows * c; ++i) out[i] = T(sums[i]);
}

// embedding_backward and vocab_shard_embedding_backward: dwte holds ids [begin, begin + its rows)
// of a vocab of `vocab`.
void embedding_grads(char const* op, Tensor const& ids, Tensor const& dy, Tensor const& dwte, Tensor const& dwpe,
                     std::int64_t begin, std::int64_t vocab, bool accumulate_wte, bool accumulate_wpe, Stream& stream) {
  for (auto const& [t, role] : {std::pair{&ids, "ids"}, {&dy, "dy"}, {&dwte, "dwte"}, {&dwpe, "dwpe"}})
    check(*t, op, role, stream);
  check_dtype(ids, DType::int32, op, "ids");
  if (ids.rank() != 2 || dwte.rank() != 2 || dwpe.rank() != 2 || ids.dim(1) > dwpe.dim(0) || dwpe.dim(1) != dwte.dim(1))
    throw Error(Errc::invalid_argument, std::string(op) + ": ids " + to_string(ids.shape()) + ", dwte " +
                                            to_string(dwte.shape()) + ", dwpe " + to_string(dwpe.shape()) +
                                            " (expected [B, T], [V, C] and [P, C] with T <= P)");
  std::int64_t const batch = ids.dim(0), t = ids.dim(1), c = dwte.dim(1), rows = dwte.dim(0),
                     positions_count = dwpe.dim(0);
  check_shape(dy, {batch, t, c}, op, "dy");
  check_dtype(dwte, dy.dtype(), op, "dwte");
  check_dtype(dwpe, dy.dtype(), op, "dwpe");
  fail_on_bad_id(op, "token id", ids, batch * t, vocab, no_ignore, stream);
  if (stream.device().kind == DeviceKind::host) {
    // One pass over the tokens adding each dy row into its id's row (and one over the positions),
    // vectorized along C: the device ops' sums in the same order (positions in order, from the
    // old value or 0), so the same results, without their vocab x tokens id scans.
    visit(dy.dtype(), [&]<class T>(T) {
      mgpu::detail::enqueue_using(
          stream,
          [id = ptr<std::int32_t>(ids), g = ptr<T>(dy), dwte = ptr<T>(dwte), dwpe = ptr<T>(dwpe), batch, t, c, rows,
           positions_count, begin, accumulate_wte, accumulate_wpe] {
            host::timed(HostOpFamily::embedding, [&] {
              scatter_rows(dwte, rows, c, accumulate_wte, batch * t, [&](std::int64_t n) {
                std::int64_t const row = static_cast<std::int64_t>(id[n]) - begin;
                return row >= 0 && row < rows ? row : std::int64_t{-1};
              }, g);
              scatter_rows(dwpe, positions_count, c, accumulate_wpe, batch * t, [t](std::int64_t n) { return n % t; }, g);
            });
          },
          ids, dy, dwte, dwpe);
    });
    return;
  }
  visit(dy.dtype(), [&]<class T>(T) {
    std::int32_t const* id = ptr<std::int32_t>(ids);
    detail::EmbeddingPositionGradOp<T> const position{ptr<T>(dy), ptr<T>(dwpe), batch, t, c, accumulate_wpe};
    auto const words_needed = static_cast<std::size_t>(rows + 1 + batch * t);
    run(stream, HostOpFamily::embedding, {ids, dy, dwte, dwpe}, words_needed, [=](auto const& each, void* scratch) {
      auto* offsets = words<std::int32_t>(scratch, 0);
      auto* positions = words<std::int32_t>(scratch, static_cast<std::size_t>(rows + 1));
      each(rows, detail::TokenCountOp{id, batch * t, offsets, begin});
      each(1, detail::TokenScanOp{offsets, rows});
      each(rows, detail::TokenListOp{id, batch * t, offsets, positions, begin});
      each(rows * c, detail::EmbeddingTokenGradOp<T>{offsets, positions, ptr<T>(dy), ptr<T>(dwte), c, accumulate_wte});
      each(positions_count * c, position);
    });
  });
}

// The rows [begin, begin + rows) of a vocab of `vocab` a vocab-parallel rank's ops work on.
void check_vocab_shard(char const* op, std::int64_t begin, std::int64_t rows, std::int64_t vocab) {
  if (begin < 0 || rows < 1 || begin + rows > vocab)
    throw Error(Errc::invalid_argument, std::string(op) + ": ids [" + std::to_string(begin) + ", " +
                                            std::to_string(begin + rows) + ") of a vocab of " + std::to_string(vocab) +
                                            " (expected a nonempty range inside [0, vocab))");
}

}  // namespace

void embedding_backward(Tensor const& ids, Tensor const& dy, Tensor const& dwte, Tensor const& dwpe,
                        bool accumulate_wte, bool accumulate_wpe, Stream& stream) {
  embedding_grads("embedding_backward", ids, dy, dwte, dwpe, 0, dwte.defined() && dwte.rank() == 2 ? dwte.dim(0) : 0,
                  accumulate_wte, accumulate_wpe, stream);
}

void vocab_shard_embedding(Tensor const& ids, Tensor const& wte, Tensor const& wpe, Tensor const& y, std::int64_t begin,
                           std::int64_t vocab, bool positions, Stream& stream) {
  char const* op = "vocab_shard_embedding";
  auto const dims = check_embedding(op, ids, wte, wpe, y, "[rows, C]", stream);
  std::int64_t const batch = dims[0], t = dims[1], c = dims[2], rows = wte.dim(0);
  check_vocab_shard(op, begin, rows, vocab);
  fail_on_bad_id(op, "token id", ids, batch * t, vocab, no_ignore, stream);
  visit(wte.dtype(), [&]<class T>(T) {
    detail::VocabShardEmbeddingOp<T> const e{
        ptr<std::int32_t>(ids), ptr<T>(wte), ptr<T>(wpe), ptr<T>(y), t, c, begin, rows, positions};
    run(stream, HostOpFamily::embedding, {ids, wte, wpe, y}, 0,
        [e, n = batch * t * c](auto const& each, void*) { each(n, e); });
  });
}

void vocab_shard_embedding_backward(Tensor const& ids, Tensor const& dy, Tensor const& dwte, Tensor const& dwpe,
                                    std::int64_t begin, std::int64_t vocab, bool accumulate_wte, bool accumulate_wpe,
                                    Stream& stream) {
  char const* op = "vocab_shard_embedding_backward";
  if (dwte.defined() && dwte.rank() == 2) check_vocab_shard(op, begin, dwte.dim(0), vocab);
  embedding_grads(op, ids, dy, dwte, dwpe, begin, vocab, accumulate_wte, accumulate_wpe, stream);
}

void causal_attention(Tensor const& qkv, Tensor const& y, Tensor const& lse, std::int64_t heads, Stream& stream,
                      AttentionDropout const& dropout) {
  check_attention("causal_attention", qkv, y, lse, heads, stream, dropout);
  std::int64_t const batch = qkv.dim(0), t = qkv.dim(1), c = qkv.dim(2) / 3;
  detail::AttentionShape const shape{t, c, heads};
  detail::AttentionMask const mask = attention_mask(dropout, heads, t);
  visit(qkv.dtype(), [&]<class T>(T) {
    if (stream.device().kind == DeviceKind::host) {
      AttentionTiles const tiles = host::attention_tiles();
      mgpu::detail::enqueue_using(
          stream,
          [q = ptr<T>(qkv), out = ptr<T>(y), l = ptr<float>(lse), batch, shape, mask, tiles] {
            host::timed(HostOpFamily::attention,
                        [&] { host::attention_forward(q, out, l, batch, shape, mask, tiles); });
          },
          qkv, y, lse);
      return;
    }
    run(stream, HostOpFamily::attention, {qkv, y, lse}, static_cast<std::size_t>(batch * t * c),
        [=](auto const& each, void* scratch) {
          each(batch * heads * t, detail::AttentionForwardRow<T>{ptr<T>(qkv), ptr<T>(y), ptr<float>(lse),
                                                                 words<float>(scratch, 0), shape, mask});
        });
  });
}

void causal_attention_backward(Tensor const& qkv, Tensor const& y, Tensor const& lse, Tensor const& dy,
                               Tensor const& dqkv, std::int64_t heads, Stream& stream,
                               AttentionDropout const& dropout) {
  char const* op = "causal_attention_backward";
  check_attention(op, qkv, y, lse, heads, stream, dropout);
  check(dy, op, "dy", stream);
  check(dqkv, op, "dqkv", stream);
  check_shape(dy, y.shape(), op, "dy");
  check_dtype(dy, y.dtype(), op, "dy");
  check_shape(dqkv, qkv.shape(), op, "dqkv");
  check_dtype(dqkv, qkv.dtype(), op, "dqkv");
  for (auto const& [t, role] : {std::pair{&qkv, "qkv"}, {&y, "y"}, {&dy, "dy"}}) {  // dqkv is written as they are read
    auto const* a = static_cast<char const*>(dqkv.data());
    auto const* b = static_cast<char const*>(t->data());
    if (a < b + t->nbytes() && b < a + dqkv.nbytes())
      throw Error(Errc::invalid_argument,
                  std::string(op) + ": dqkv overlaps " + role + " (expected dqkv in memory of its own)");
  }
  std::int64_t const batch = qkv.dim(0), t = qkv.dim(1), c = qkv.dim(2) / 3;
  detail::AttentionShape const shape{t, c, heads};
  detail::AttentionMask const mask = attention_mask(dropout, heads, t);
  std::int64_t const rows = batch * heads * t;
  visit(qkv.dtype(), [&]<class T>(T) {
    if (stream.device().kind == DeviceKind::host) {
      AttentionTiles const tiles = host::attention_tiles();
      mgpu::detail::enqueue_using(
          stream,
          [q = ptr<T>(qkv), out = ptr<T>(y), l = ptr<float>(lse), g = ptr<T>(dy), dq = ptr<T>(dqkv), batch, shape, mask,
           tiles] {
            host::timed(HostOpFamily::attention,
                        [&] { host::attention_backward(q, out, l, g, dq, batch, shape, mask, tiles); });
          },
          qkv, y, lse, dy, dqkv);
      return;
    }
    auto const words_needed = static_cast<std::size_t>(rows + batch * t * 3 * c);
    run(stream, HostOpFamily::attention, {qkv, y, lse, dy, dqkv}, words_needed, [=](auto const& each, void* scratch) {
      float* row_dot = words<float>(scratch, 0);
      float* dacc = words<float>(scratch, static_cast<std::size_t>(rows));
      each(rows, detail::AttentionRowDot<T>{ptr<T>(y), ptr<T>(dy), row_dot, shape});
      detail::AttentionGradRow<T> grad{ptr<T>(qkv), ptr<T>(dy), ptr<float>(lse), row_dot, dacc, shape, mask, false};
      each(rows, grad);
      grad.keys = true;
      each(rows, grad);
      each(batch * t * 3 * c, mgpu::detail::ConvertOp<T, float>{ptr<T>(dqkv), dacc});
    });
  });
}

namespace {

// A cross-entropy's int32 targets, one per row of `logits` (N rows).
void check_targets(char const* op, Tensor const& targets, std::int64_t n, Tensor const& logits, Stream& stream) {
  check(targets, op, "targets", stream);
  check_dtype(targets, DType::int32, op, "targets");
  if (targets.numel() != n)
    throw Error(Errc::invalid_argument, std::string(op) + ": " + std::to_string(targets.numel()) +
                                            " targets for logits " + to_string(logits.shape()) + " (expected " +
                                            std::to_string(n) + ", one per row)");
}

// A cross-entropy's outputs: dlogits shaped and typed as `logits`, a float32 loss of one element,
// and the divisor of the summed row losses, finite and > 0.
void check_loss_outputs(char const* op, Tensor const& logits, Tensor const& dlogits, Tensor const& loss, float divisor,
                        Stream& stream) {
  check(dlogits, op, "dlogits", stream);
  check(loss, op, "loss", stream);
  check_shape(dlogits, logits.shape(), op, "dlogits");
  check_dtype(dlogits, logits.dtype(), op, "dlogits");
  check_dtype(loss, DType::float32, op, "loss");
  if (loss.numel() != 1)
    throw Error(Errc::invalid_argument,
                std::string(op) + ": loss has shape " + to_string(loss.shape()) + " (expected one element)");
  if (!(divisor > 0.0f) || !std::isfinite(divisor))
    throw Error(Errc::invalid_argument,
                std::string(op) + ": divisor " + std::to_string(divisor) + " (expected a finite number > 0)");
}

}  // namespace

void token_cross_entropy(Tensor const& logits, Tensor const& targets, Tensor const& dlogits, Tensor const& loss,
                         float divisor, Stream& stream, std::int32_t ignore_index, float grad_scale) {
  char const* op = "token_cross_entropy";
  check(logits, op, "logits", stream);
  if (logits.rank() < 2 || logits.dim(logits.rank() - 1) < 1)
    throw Error(Errc::invalid_argument,
                std::string(op) + ": logits have shape " + to_string(logits.shape()) + " (expected [N, V])");
  std::int64_t const vocab = logits.dim(logits.rank() - 1);
  std::int64_t const n = logits.numel() / vocab;
  check_targets(op, targets, n, logits, stream);
  check_loss_outputs(op, logits, dlogits, loss, divisor, stream);
  fail_on_bad_id(op, "target", targets, n, vocab, ignore_index, stream);
  visit(logits.dtype(), [&]<class T>(T) {
    detail::TokenCrossEntropyRow<T> const row{
        ptr<T>(logits), ptr<std::int32_t>(targets), ptr<T>(dlogits), nullptr, vocab,
        ignore_index,   grad_scale / divisor};
    run(stream, HostOpFamily::loss, {logits, targets, dlogits, loss}, static_cast<std::size_t>(n),
        [=](auto const& each, void* scratch) {
          auto with_rows = row;
          with_rows.row_loss = words<float>(scratch, 0);
          each(n, with_rows);
          each(1, detail::RowLossSum{with_rows.row_loss, n, ptr<float>(loss), divisor});
        });
  });
}

namespace {

// The logits [N, cols] of a vocab-parallel cross-entropy pass and its float32 row statistics
// (`stats` per row); returns N.
std::int64_t check_vocab_shard_rows(char const* op, Tensor const& logits, Tensor const& stats, std::int64_t per_row,
                                    Stream& stream) {
  check(logits, op, "logits", stream);
  check(stats, op, per_row == 1 ? "max" : "sums", stream);
  if (logits.rank() < 2 || logits.dim(logits.rank() - 1) < 1)
    throw Error(Errc::invalid_argument,
                std::string(op) + ": logits have shape " + to_string(logits.shape()) + " (expected [N, V_r])");
  std::int64_t const n = logits.numel() / logits.dim(logits.rank() - 1);
  check_dtype(stats, DType::float32, op, per_row == 1 ? "max" : "sums");
  if (stats.numel() != n * per_row)
    throw Error(Errc::invalid_argument, std::string(op) + ": " + (per_row == 1 ? "max" : "sums") + " of shape " +
                                            to_string(stats.shape()) + " for logits " + to_string(logits.shape()) +
                                            " (expected " + std::to_string(n * per_row) + " float32 elements)");
  return n;
}

}  // namespace

void vocab_shard_row_max(Tensor const& logits, Tensor const& max, Stream& stream) {
  char const* op = "vocab_shard_row_max";
  std::int64_t const n = check_vocab_shard_rows(op, logits, max, 1, stream);
  visit(logits.dtype(), [&]<class T>(T) {
    detail::VocabShardRowMax<T> const row{ptr<T>(logits), ptr<float>(max), logits.dim(logits.rank() - 1)};
    run(stream, HostOpFamily::loss, {logits, max}, 0, [row, n](auto const& each, void*) { each(n, row); });
  });
}

void vocab_shard_row_sums(Tensor const& logits, Tensor const& targets, Tensor const& max, Tensor const& sums,
                          std::int64_t begin, Stream& stream) {
  char const* op = "vocab_shard_row_sums";
  std::int64_t const n = check_vocab_shard_rows(op, logits, sums, 2, stream);
  check_vocab_shard_rows(op, logits, max, 1, stream);
  check_targets(op, targets, n, logits, stream);
  visit(logits.dtype(), [&]<class T>(T) {
    detail::VocabShardRowSums<T> const row{ptr<T>(logits),   ptr<std::int32_t>(targets),    ptr<float>(max),
                                           ptr<float>(sums), logits.dim(logits.rank() - 1), begin};
    run(stream, HostOpFamily::loss, {logits, targets, max, sums}, 0,
        [row, n](auto const& each, void*) { each(n, row); });
  });
}

void vocab_shard_cross_entropy(Tensor const& logits, Tensor const& targets, Tensor const& max, Tensor const& sums,
                               Tensor const& dlogits, Tensor const& loss, std::int64_t begin, std::int64_t vocab,
                               float divisor, Stream& stream, std::int32_t ignore_index, float grad_scale) {
  char const* op = "vocab_shard_cross_entropy";
  std::int64_t const n = check_vocab_shard_rows(op, logits, max, 1, stream);
  check_vocab_shard_rows(op, logits, sums, 2, stream);
  check_targets(op, targets, n, logits, stream);
  std::int64_t const cols = logits.dim(logits.rank() - 1);
  check_vocab_shard(op, begin, cols, vocab);
  check_loss_outputs(op, logits, dlogits, loss, divisor, stream);
  fail_on_bad_id(op, "target", targets, n, vocab, ignore_index, stream);
  visit(logits.dtype(), [&]<class T>(T) {
    detail::VocabShardCrossEntropyRow<T> const row{ptr<T>(logits),
                                                   ptr<std::int32_t>(targets),
                                                   ptr<float>(max),
                                                   ptr<float>(sums),
                                                   ptr<T>(dlogits),
                                                   nullptr,
                                                   cols,
                                                   begin,
                                                   vocab,
                                                   ignore_index,
                                                   grad_scale / divisor};
    run(stream, HostOpFamily::loss, {logits, targets, max, sums, dlogits, loss}, static_cast<std::size_t>(n),
        [=](auto const& each, void* scratch) {
          auto with_rows = row;
          with_rows.row_loss = words<float>(scratch, 0);
          each(n, with_rows);
          each(1, detail::RowLossSum{with_rows.row_loss, n, ptr<float>(loss), divisor});
        });
  });
}

}  // namespace mgpu::ops
