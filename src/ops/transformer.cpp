// Host implementations of the transformer ops (mgpu/ops/transformer.hpp): argument checks at the
// call, then one piece of work on the host stream's worker. Loops run in a fixed order, so results
// are bitwise reproducible.
#include <mgpu/ops/transformer.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <mgpu/core/detail/elementwise.hpp>
#include <mgpu/core/error.hpp>
#include <mgpu/ops/detail/math.hpp>

namespace mgpu::ops {
namespace {

std::string str(DType t) { return std::string(to_string(t)); }

// A defined tensor of `dtype` (or any float type when dtype is float32 and `any_float`) on the
// stream's device, and a host stream.
void check(Tensor const& t, char const* op, char const* role, Stream const& stream) {
  if (!t.defined()) throw Error(Errc::invalid_argument, std::string(op) + ": " + role + " is undefined (expected a tensor)");
  if (t.device() != stream.device())
    throw Error(Errc::device, std::string(op) + ": " + role + " is on " + t.device().to_string() + " but the stream is on " +
                                  stream.device().to_string() + " (expected the stream's device)");
}

void check_host(char const* op, Stream const& stream) {
  if (stream.device().kind != DeviceKind::host)
    throw Error(Errc::device, std::string("ops::") + op + " on " + stream.device().to_string() +
                                  " (expected a host device: its CUDA kernel is not written yet)");
}

void check_dtype(Tensor const& t, DType expected, char const* op, char const* role) {
  if (t.dtype() != expected)
    throw Error(Errc::invalid_argument, std::string(op) + ": " + role + " is " + str(t.dtype()) + " (expected " + str(expected) + ")");
}

void check_shape(Tensor const& t, Shape const& expected, char const* op, char const* role) {
  if (t.shape() != expected)
    throw Error(Errc::invalid_argument, std::string(op) + ": " + role + " has shape " + to_string(t.shape()) + " (expected " +
                                            to_string(expected) + ")");
}

template <class T>
T* ptr(Tensor const& t) {
  return static_cast<T*>(t.data());
}

template <class Fn>
void visit(DType dtype, Fn&& fn) {
  mgpu::detail::visit_dtype(dtype, [&]<class T>(std::type_identity<T>) { fn(T{}); });
}

Error bad_id(char const* op, char const* what, std::int32_t id, std::int64_t position, std::int64_t vocab, std::string const& extra = {}) {
  return Error(Errc::invalid_argument, std::string(op) + ": " + what + " " + std::to_string(id) + " at position " +
                                           std::to_string(position) + " (expected a token id in [0, " + std::to_string(vocab) + ")" +
                                           extra + ")");
}

// Whether attention-dropout element (b, h, i, j) of a [B, heads, T, T] batch is kept.
struct DropMask {
  AttentionDropout d;
  std::int64_t heads, t;
  [[nodiscard]] bool kept(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const {
    auto const counter = static_cast<std::uint64_t>((((d.row_offset + b) * heads + h) * t + i) * t + j);
    return detail::uniform01(d.seed, counter) < 1.0f - d.p;
  }
};

void check_attention(char const* op, Tensor const& qkv, Tensor const& y, Tensor const& lse, std::int64_t heads, Stream const& stream,
                     AttentionDropout const& dropout) {
  check_host(op, stream);
  check(qkv, op, "qkv", stream);
  check(y, op, "y", stream);
  check(lse, op, "lse", stream);
  if (qkv.rank() != 3 || qkv.dim(2) % 3 != 0)
    throw Error(Errc::invalid_argument, std::string(op) + ": qkv has shape " + to_string(qkv.shape()) + " (expected [B, T, 3C])");
  std::int64_t const c = qkv.dim(2) / 3;
  if (heads < 1 || c % heads != 0)
    throw Error(Errc::invalid_argument, std::string(op) + ": " + std::to_string(heads) + " heads for " + std::to_string(c) +
                                            " features (expected heads >= 1 dividing the features)");
  check_shape(y, {qkv.dim(0), qkv.dim(1), c}, op, "y");
  check_dtype(y, qkv.dtype(), op, "y");
  check_shape(lse, {qkv.dim(0), heads, qkv.dim(1)}, op, "lse");
  check_dtype(lse, DType::float32, op, "lse");
  if (!(dropout.p >= 0.0f && dropout.p < 1.0f))
    throw Error(Errc::invalid_argument, std::string(op) + ": dropout " + std::to_string(dropout.p) + " (expected 0 <= p < 1)");
}

// Keys are visited in tiles of this many: one rescale of the running sums per tile.
constexpr std::int64_t key_tile = 64;

template <class T>
void attention_forward(T const* qkv, T* y, float* lse, std::int64_t batch, std::int64_t t, std::int64_t c, std::int64_t heads,
                       AttentionDropout const& dropout) {
  std::int64_t const d = c / heads;
  float const scale = 1.0f / std::sqrt(static_cast<float>(d));
  float const keep_scale = 1.0f / (1.0f - dropout.p);
  DropMask const mask{dropout, heads, t};
  std::vector<float> q(static_cast<std::size_t>(d));
  std::vector<float> acc(static_cast<std::size_t>(d));
  std::vector<float> s(static_cast<std::size_t>(key_tile));
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t h = 0; h < heads; ++h) {
      for (std::int64_t i = 0; i < t; ++i) {
        T const* qi = qkv + (b * t + i) * 3 * c + h * d;
        for (std::int64_t e = 0; e < d; ++e) q[static_cast<std::size_t>(e)] = static_cast<float>(qi[e]) * scale;
        std::fill(acc.begin(), acc.end(), 0.0f);
        float m = -std::numeric_limits<float>::infinity();
        float l = 0.0f;
        for (std::int64_t j0 = 0; j0 <= i; j0 += key_tile) {
          std::int64_t const j1 = std::min(i + 1, j0 + key_tile);
          float tile_max = -std::numeric_limits<float>::infinity();
          for (std::int64_t j = j0; j < j1; ++j) {
            T const* kj = qkv + (b * t + j) * 3 * c + c + h * d;
            float dot = 0.0f;
            for (std::int64_t e = 0; e < d; ++e) dot += q[static_cast<std::size_t>(e)] * static_cast<float>(kj[e]);
            s[static_cast<std::size_t>(j - j0)] = dot;
            tile_max = std::max(tile_max, dot);
          }
          float const m_new = std::max(m, tile_max);
          float const correction = std::exp(m - m_new);  // 0 on the first tile (m = -inf)
          l *= correction;
          for (float& a : acc) a *= correction;
          for (std::int64_t j = j0; j < j1; ++j) {
            float p = std::exp(s[static_cast<std::size_t>(j - j0)] - m_new);
            l += p;
            if (dropout.p > 0.0f) {
              if (!mask.kept(b, h, i, j)) continue;
              p *= keep_scale;
            }
            T const* vj = qkv + (b * t + j) * 3 * c + 2 * c + h * d;
            for (std::int64_t e = 0; e < d; ++e) acc[static_cast<std::size_t>(e)] += p * static_cast<float>(vj[e]);
          }
          m = m_new;
        }
        T* yi = y + (b * t + i) * c + h * d;
        for (std::int64_t e = 0; e < d; ++e) yi[e] = T(acc[static_cast<std::size_t>(e)] / l);
        lse[(b * heads + h) * t + i] = m + std::log(l);
      }
    }
  }
}

template <class T>
void attention_backward(T const* qkv, T const* y, float const* lse, T const* dy, T* dqkv, std::int64_t batch, std::int64_t t,
                        std::int64_t c, std::int64_t heads, AttentionDropout const& dropout) {
  std::int64_t const d = c / heads;
  auto const du = static_cast<std::size_t>(d);
  float const scale = 1.0f / std::sqrt(static_cast<float>(d));
  float const keep_scale = 1.0f / (1.0f - dropout.p);
  DropMask const mask{dropout, heads, t};
  std::vector<float> dq(du);
  std::vector<float> dk(static_cast<std::size_t>(t) * du);
  std::vector<float> dv(static_cast<std::size_t>(t) * du);
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t h = 0; h < heads; ++h) {
      std::fill(dk.begin(), dk.end(), 0.0f);
      std::fill(dv.begin(), dv.end(), 0.0f);
      for (std::int64_t i = 0; i < t; ++i) {
        T const* qi = qkv + (b * t + i) * 3 * c + h * d;
        T const* dyi = dy + (b * t + i) * c + h * d;
        T const* yi = y + (b * t + i) * c + h * d;
        float row_dot = 0.0f;  // sum over j of P_ij dP_ij = dy_i . y_i
        for (std::int64_t e = 0; e < d; ++e) row_dot += static_cast<float>(dyi[e]) * static_cast<float>(yi[e]);
        float const row_lse = lse[(b * heads + h) * t + i];
        std::fill(dq.begin(), dq.end(), 0.0f);
        for (std::int64_t j = 0; j <= i; ++j) {
          T const* kj = qkv + (b * t + j) * 3 * c + c + h * d;
          T const* vj = qkv + (b * t + j) * 3 * c + 2 * c + h * d;
          float score = 0.0f;
          float dp = 0.0f;
          for (std::int64_t e = 0; e < d; ++e) {
            score += static_cast<float>(qi[e]) * static_cast<float>(kj[e]);
            dp += static_cast<float>(dyi[e]) * static_cast<float>(vj[e]);
          }
          float const p = std::exp(score * scale - row_lse);
          float const z = dropout.p > 0.0f ? (mask.kept(b, h, i, j) ? keep_scale : 0.0f) : 1.0f;
          float const ds = p * (z * dp - row_dot) * scale;
          float* dkj = dk.data() + static_cast<std::size_t>(j) * du;
          float* dvj = dv.data() + static_cast<std::size_t>(j) * du;
          for (std::int64_t e = 0; e < d; ++e) {
            auto const eu = static_cast<std::size_t>(e);
            dvj[eu] += p * z * static_cast<float>(dyi[e]);
            dq[eu] += ds * static_cast<float>(kj[e]);
            dkj[eu] += ds * static_cast<float>(qi[e]);
          }
        }
        T* dqi = dqkv + (b * t + i) * 3 * c + h * d;
        for (std::int64_t e = 0; e < d; ++e) dqi[e] = T(dq[static_cast<std::size_t>(e)]);
      }
      for (std::int64_t j = 0; j < t; ++j) {
        T* dkj = dqkv + (b * t + j) * 3 * c + c + h * d;
        T* dvj = dqkv + (b * t + j) * 3 * c + 2 * c + h * d;
        for (std::int64_t e = 0; e < d; ++e) {
          dkj[e] = T(dk[static_cast<std::size_t>(j) * du + static_cast<std::size_t>(e)]);
          dvj[e] = T(dv[static_cast<std::size_t>(j) * du + static_cast<std::size_t>(e)]);
        }
      }
    }
  }
}

}  // namespace

void embedding(Tensor const& ids, Tensor const& wte, Tensor const& wpe, Tensor const& y, Stream& stream) {
  char const* op = "embedding";
  check_host(op, stream);
  for (auto const& [t, role] : {std::pair{&ids, "ids"}, {&wte, "wte"}, {&wpe, "wpe"}, {&y, "y"}}) check(*t, op, role, stream);
  check_dtype(ids, DType::int32, op, "ids");
  if (ids.rank() != 2) throw Error(Errc::invalid_argument, std::string(op) + ": ids have shape " + to_string(ids.shape()) + " (expected [B, T])");
  if (wte.rank() != 2 || wpe.rank() != 2 || wpe.dim(1) != wte.dim(1))
    throw Error(Errc::invalid_argument, std::string(op) + ": wte " + to_string(wte.shape()) + " and wpe " + to_string(wpe.shape()) +
                                            " (expected [V, C] and [P, C])");
  std::int64_t const batch = ids.dim(0), t = ids.dim(1), c = wte.dim(1), vocab = wte.dim(0);
  if (t > wpe.dim(0))
    throw Error(Errc::invalid_argument, std::string(op) + ": sequences of " + std::to_string(t) + " tokens (expected at most the " +
                                            std::to_string(wpe.dim(0)) + " positions of the block size)");
  check_dtype(wpe, wte.dtype(), op, "wpe");
  check_dtype(y, wte.dtype(), op, "y");
  check_shape(y, {batch, t, c}, op, "y");
  visit(wte.dtype(), [&]<class T>(T) {
    stream.enqueue([ids, wte, wpe, y, batch, t, c, vocab] {
      std::int32_t const* id = ptr<std::int32_t>(ids);
      for (std::int64_t n = 0; n < batch * t; ++n) {
        if (id[n] < 0 || id[n] >= vocab) throw bad_id("embedding", "token id", id[n], n, vocab);
        T const* tok = ptr<T>(wte) + id[n] * c;
        T const* pos = ptr<T>(wpe) + (n % t) * c;
        T* out = ptr<T>(y) + n * c;
        for (std::int64_t e = 0; e < c; ++e) out[e] = T(static_cast<float>(tok[e]) + static_cast<float>(pos[e]));
      }
    });
  });
}

void embedding_backward(Tensor const& ids, Tensor const& dy, Tensor const& dwte, Tensor const& dwpe, bool accumulate_wte,
                        bool accumulate_wpe, Stream& stream) {
  char const* op = "embedding_backward";
  check_host(op, stream);
  for (auto const& [t, role] : {std::pair{&ids, "ids"}, {&dy, "dy"}, {&dwte, "dwte"}, {&dwpe, "dwpe"}}) check(*t, op, role, stream);
  check_dtype(ids, DType::int32, op, "ids");
  if (ids.rank() != 2 || dwte.rank() != 2 || dwpe.rank() != 2 || ids.dim(1) > dwpe.dim(0) || dwpe.dim(1) != dwte.dim(1))
    throw Error(Errc::invalid_argument, std::string(op) + ": ids " + to_string(ids.shape()) + ", dwte " + to_string(dwte.shape()) +
                                            ", dwpe " + to_string(dwpe.shape()) + " (expected [B, T], [V, C] and [P, C] with T <= P)");
  std::int64_t const batch = ids.dim(0), t = ids.dim(1), c = dwte.dim(1), vocab = dwte.dim(0), positions = dwpe.dim(0);
  check_shape(dy, {batch, t, c}, op, "dy");
  check_dtype(dwte, dy.dtype(), op, "dwte");
  check_dtype(dwpe, dy.dtype(), op, "dwpe");
  visit(dy.dtype(), [&]<class T>(T) {
    stream.enqueue([ids, dy, dwte, dwpe, accumulate_wte, accumulate_wpe, batch, t, c, vocab, positions] {
      std::int32_t const* id = ptr<std::int32_t>(ids);
      T const* g = ptr<T>(dy);
      // Sums in float32, rows in position order; one row of dwte per id, written back once.
      std::vector<float> wte_sum(static_cast<std::size_t>(vocab * c), 0.0f);
      std::vector<char> touched(static_cast<std::size_t>(vocab), 0);
      std::vector<float> wpe_sum(static_cast<std::size_t>(positions * c), 0.0f);
      for (std::int64_t n = 0; n < batch * t; ++n) {
        if (id[n] < 0 || id[n] >= vocab) throw bad_id("embedding_backward", "token id", id[n], n, vocab);
        float* row = wte_sum.data() + static_cast<std::size_t>(id[n] * c);
        float* pos = wpe_sum.data() + static_cast<std::size_t>((n % t) * c);
        touched[static_cast<std::size_t>(id[n])] = 1;
        for (std::int64_t e = 0; e < c; ++e) {
          auto const v = static_cast<float>(g[n * c + e]);
          row[e] += v;
          pos[e] += v;
        }
      }
      T* dw = ptr<T>(dwte);
      for (std::int64_t v = 0; v < vocab; ++v) {
        if (accumulate_wte && touched[static_cast<std::size_t>(v)] == 0) continue;
        for (std::int64_t e = 0; e < c; ++e) {
          float const base = accumulate_wte ? static_cast<float>(dw[v * c + e]) : 0.0f;
          dw[v * c + e] = T(base + wte_sum[static_cast<std::size_t>(v * c + e)]);
        }
      }
      T* dp = ptr<T>(dwpe);
      for (std::int64_t i = 0; i < positions * c; ++i) {
        float const base = accumulate_wpe ? static_cast<float>(dp[i]) : 0.0f;
        dp[i] = T(base + wpe_sum[static_cast<std::size_t>(i)]);
      }
    });
  });
}

void causal_attention(Tensor const& qkv, Tensor const& y, Tensor const& lse, std::int64_t heads, Stream& stream,
                      AttentionDropout const& dropout) {
  check_attention("causal_attention", qkv, y, lse, heads, stream, dropout);
  std::int64_t const batch = qkv.dim(0), t = qkv.dim(1), c = qkv.dim(2) / 3;
  visit(qkv.dtype(), [&]<class T>(T) {
    stream.enqueue([qkv, y, lse, batch, t, c, heads, dropout] {
      attention_forward(ptr<T const>(qkv), ptr<T>(y), ptr<float>(lse), batch, t, c, heads, dropout);
    });
  });
}

void causal_attention_backward(Tensor const& qkv, Tensor const& y, Tensor const& lse, Tensor const& dy, Tensor const& dqkv,
                               std::int64_t heads, Stream& stream, AttentionDropout const& dropout) {
  char const* op = "causal_attention_backward";
  check_attention(op, qkv, y, lse, heads, stream, dropout);
  check(dy, op, "dy", stream);
  check(dqkv, op, "dqkv", stream);
  check_shape(dy, y.shape(), op, "dy");
  check_dtype(dy, y.dtype(), op, "dy");
  check_shape(dqkv, qkv.shape(), op, "dqkv");
  check_dtype(dqkv, qkv.dtype(), op, "dqkv");
  std::int64_t const batch = qkv.dim(0), t = qkv.dim(1), c = qkv.dim(2) / 3;
  visit(qkv.dtype(), [&]<class T>(T) {
    stream.enqueue([qkv, y, lse, dy, dqkv, batch, t, c, heads, dropout] {
      attention_backward(ptr<T const>(qkv), ptr<T const>(y), ptr<float const>(lse), ptr<T const>(dy), ptr<T>(dqkv), batch, t, c,
                         heads, dropout);
    });
  });
}

void token_cross_entropy(Tensor const& logits, Tensor const& targets, Tensor const& dlogits, Tensor const& loss, float divisor,
                         Stream& stream, std::int32_t ignore_index, float grad_scale) {
  char const* op = "token_cross_entropy";
  check_host(op, stream);
  for (auto const& [t, role] : {std::pair{&logits, "logits"}, {&targets, "targets"}, {&dlogits, "dlogits"}, {&loss, "loss"}})
    check(*t, op, role, stream);
  check_dtype(targets, DType::int32, op, "targets");
  check_dtype(loss, DType::float32, op, "loss");
  if (logits.rank() < 2 || logits.dim(logits.rank() - 1) < 1)
    throw Error(Errc::invalid_argument, std::string(op) + ": logits have shape " + to_string(logits.shape()) + " (expected [N, V])");
  std::int64_t const vocab = logits.dim(logits.rank() - 1);
  std::int64_t const n = logits.numel() / vocab;
  if (targets.numel() != n)
    throw Error(Errc::invalid_argument, std::string(op) + ": " + std::to_string(targets.numel()) + " targets for logits " +
                                            to_string(logits.shape()) + " (expected " + std::to_string(n) + ", one per row)");
  check_shape(dlogits, logits.shape(), op, "dlogits");
  check_dtype(dlogits, logits.dtype(), op, "dlogits");
  if (loss.numel() != 1) throw Error(Errc::invalid_argument, std::string(op) + ": loss has shape " + to_string(loss.shape()) + " (expected one element)");
  if (!(divisor > 0.0f) || !std::isfinite(divisor))
    throw Error(Errc::invalid_argument, std::string(op) + ": divisor " + std::to_string(divisor) + " (expected a finite number > 0)");
  visit(logits.dtype(), [&]<class T>(T) {
    stream.enqueue([logits, targets, dlogits, loss, divisor, ignore_index, grad_scale, vocab, n] {
      T const* x = ptr<T const>(logits);
      T* dx = ptr<T>(dlogits);
      std::int32_t const* target = ptr<std::int32_t>(targets);
      float const g = grad_scale / divisor;
      double total = 0.0;
      for (std::int64_t i = 0; i < n; ++i) {
        T const* row = x + i * vocab;
        T* drow = dx + i * vocab;
        if (target[i] == ignore_index) {
          std::fill(drow, drow + vocab, T(0.0f));
          continue;
        }
        if (target[i] < 0 || target[i] >= vocab)
          throw bad_id("token_cross_entropy", "target", target[i], i, vocab, " or the ignore index " + std::to_string(ignore_index));
        float max = -std::numeric_limits<float>::infinity();
        for (std::int64_t j = 0; j < vocab; ++j) max = std::max(max, static_cast<float>(row[j]));
        float sum = 0.0f;
        for (std::int64_t j = 0; j < vocab; ++j) sum += std::exp(static_cast<float>(row[j]) - max);
        float const log_sum = max + std::log(sum);
        total += static_cast<double>(log_sum - static_cast<float>(row[target[i]]));
        for (std::int64_t j = 0; j < vocab; ++j) {
          float const p = std::exp(static_cast<float>(row[j]) - log_sum);
          drow[j] = T((p - (j == target[i] ? 1.0f : 0.0f)) * g);
        }
      }
      *ptr<float>(loss) = static_cast<float>(total / static_cast<double>(divisor));
    });
  });
}

}  // namespace mgpu::ops
