// Host collectives against a serial float64 reference: every op x dtype x size x group size 1-8.
#include <mgpu/comm/communicator.hpp>

#include <cmath>
#include <cstring>
#include <random>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <type_traits>
#include <vector>

#include <mgpu/core/detail/reduce_slice.hpp>
#include <mgpu/core/detail/elementwise.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"

using mgpu::DType;
using mgpu::Tensor;
using mgpu::comm::ReduceOp;

namespace {

float to_dtype(float v, DType t) {
  if (t == DType::bfloat16) return static_cast<float>(mgpu::bfloat16(v));
  if (t == DType::float16) return static_cast<float>(mgpu::float16(v));
  return v;
}

float ulp(float v, DType t) {
  int const mantissa = t == DType::float32 ? 23 : t == DType::bfloat16 ? 7 : 10;
  return std::ldexp(1.0f, std::ilogb(std::max(std::fabs(v), 1e-4f)) - mantissa);
}

void fill(Tensor const& t, std::vector<float> const& values) {
  mgpu::detail::visit_dtype(t.dtype(), [&]<class T>(std::type_identity<T>) {
    auto s = t.host_span<T>();
    for (std::size_t i = 0; i < values.size(); ++i) s[i] = T(values[i]);
  });
}

std::vector<float> read(Tensor const& t) {
  std::vector<float> out(static_cast<std::size_t>(t.numel()));
  mgpu::detail::visit_dtype(t.dtype(), [&]<class T>(std::type_identity<T>) {
    auto s = t.host_span<T>();
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<float>(s[i]);
  });
  return out;
}

double reference_combine(ReduceOp op, std::vector<std::vector<float>> const& in, std::size_t i, std::size_t offset = 0) {
  double acc = in[0][offset + i];
  for (std::size_t p = 1; p < in.size(); ++p) {
    double const v = in[p][offset + i];
    acc = op == ReduceOp::min ? std::min(acc, v) : op == ReduceOp::max ? std::max(acc, v) : acc + v;
  }
  return op == ReduceOp::avg ? acc / static_cast<double>(in.size()) : acc;
}

// |got - expected| within float32 accumulation error plus one unit of the output type.
void require_close(float got, double expected, double magnitude, int ranks, DType t) {
  double const tolerance = ranks * std::ldexp(1.0, -23) * magnitude + ulp(static_cast<float>(expected), t);
  INFO("got " << got << ", expected " << expected << " (" << mgpu::to_string(t) << ", " << ranks << " ranks)");
  REQUIRE(std::fabs(got - expected) <= tolerance);
}

std::vector<std::vector<float>> random_inputs(int ranks, std::int64_t count, DType t, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<std::vector<float>> in(static_cast<std::size_t>(ranks), std::vector<float>(static_cast<std::size_t>(count)));
  for (auto& v : in) {
    for (auto& x : v) x = to_dtype(normal(rng), t);
  }
  return in;
}

struct Fixture {
  explicit Fixture(int n) : group("host:" + std::to_string(n)), comm(mgpu::comm::make_communicator(group)) {}
  Tensor make(int rank, std::int64_t count, DType t) { return Tensor::empty({count}, t, group.allocator(rank)); }
  mgpu::DeviceGroup group;
  std::unique_ptr<mgpu::comm::Communicator> comm;
};

}  // namespace

TEST_CASE("all_reduce: every op, dtype, size and group size against float64", "[comm][host]") {
  for (int n = 1; n <= 8; ++n) {
    Fixture f(n);
    CHECK(f.comm->backend() == mgpu::comm::Backend::host);
    for (DType t : {DType::float32, DType::bfloat16, DType::float16}) {
      for (std::int64_t count : {0, 1, 7, 13, 1000 + n}) {
        for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::min, ReduceOp::max}) {
          INFO(n << " ranks, " << count << " " << mgpu::to_string(t) << ", " << mgpu::comm::to_string(op));
          auto const in = random_inputs(n, count, t, static_cast<unsigned>(count * 31 + n));
          std::vector<Tensor> send;
          std::vector<Tensor> recv;
          for (int r = 0; r < n; ++r) {
            send.push_back(f.make(r, count, t));
            fill(send.back(), in[static_cast<std::size_t>(r)]);
            recv.push_back(count % 2 ? send.back() : f.make(r, count, t));  // odd counts run in place
          }
          f.group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
            f.comm->all_reduce(rank, send[static_cast<std::size_t>(rank)], recv[static_cast<std::size_t>(rank)], op, stream);
          });
          for (int r = 0; r < n; ++r) {
            auto const out = read(recv[static_cast<std::size_t>(r)]);
            for (std::size_t i = 0; i < out.size(); ++i) {
              double magnitude = 0;
              for (auto const& v : in) magnitude += std::fabs(v[i]);
              require_close(out[i], reference_combine(op, in, i), magnitude, n, t);
            }
            if (r > 0 && count > 0)
              REQUIRE(std::memcmp(recv[0].data(), recv[static_cast<std::size_t>(r)].data(), recv[0].nbytes()) == 0);
          }
        }
      }
    }
  }
}

TEST_CASE("reduce_scatter, all_gather, broadcast and reduce against float64", "[comm][host]") {
  for (int n = 1; n <= 8; ++n) {
    Fixture f(n);
    for (DType t : {DType::float32, DType::bfloat16, DType::float16}) {
      for (std::int64_t count : {0, 1, 7, 13, 1000 + n}) {
        INFO(n << " ranks, " << count << " " << mgpu::to_string(t));
        auto const in = random_inputs(n, count * n, t, static_cast<unsigned>(count + 7 * n));
        std::vector<Tensor> big;
        std::vector<Tensor> small;
        std::vector<Tensor> gathered;
        std::vector<Tensor> reduced;
        for (int r = 0; r < n; ++r) {
          big.push_back(f.make(r, count * n, t));
          fill(big.back(), in[static_cast<std::size_t>(r)]);
          small.push_back(f.make(r, count, t));
          gathered.push_back(f.make(r, count * n, t));
          reduced.push_back(f.make(r, count * n, t));
        }
        int const root = n - 1;
        f.group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
          auto const r = static_cast<std::size_t>(rank);
          f.comm->reduce_scatter(rank, big[r], small[r], ReduceOp::max, stream);
          f.comm->all_gather(rank, small[r], gathered[r], stream);
          f.comm->reduce(rank, big[r], reduced[r], ReduceOp::sum, root, stream);
          f.comm->broadcast(rank, big[r], root, stream);
        });
        for (int r = 0; r < n; ++r) {
          auto const mine = read(small[static_cast<std::size_t>(r)]);
          for (std::size_t i = 0; i < mine.size(); ++i)
            REQUIRE(mine[i] == reference_combine(ReduceOp::max, in, i, static_cast<std::size_t>(r * count)));
          auto const all = read(gathered[static_cast<std::size_t>(r)]);
          for (std::size_t i = 0; i < all.size(); ++i) REQUIRE(all[i] == reference_combine(ReduceOp::max, in, i));
          auto const copy = read(big[static_cast<std::size_t>(r)]);
          REQUIRE(copy == in[static_cast<std::size_t>(root)]);
        }
        auto const sum = read(reduced[static_cast<std::size_t>(root)]);
        for (std::size_t i = 0; i < sum.size(); ++i) {
          double magnitude = 0;
          for (auto const& v : in) magnitude += std::fabs(v[i]);
          require_close(sum[i], reference_combine(ReduceOp::sum, in, i), magnitude, n, t);
        }
      }
    }
  }
}

// ZeRO-style sharded updates run both in place: each rank's reduced block lands in its own slice of
// the bucket, and the gathered blocks fill the bucket around it.
TEST_CASE("reduce_scatter and all_gather in place against float64", "[comm][host]") {
  for (int n = 1; n <= 5; ++n) {
    Fixture f(n);
    for (std::int64_t count : {1, 9, 1000 + n}) {
      INFO(n << " ranks, " << count << " elements per rank");
      auto const in = random_inputs(n, count * n, DType::float32, static_cast<unsigned>(count + 3 * n));
      std::vector<Tensor> bucket;
      for (int r = 0; r < n; ++r) {
        bucket.push_back(f.make(r, count * n, DType::float32));
        fill(bucket.back(), in[static_cast<std::size_t>(r)]);
      }
      f.group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
        Tensor const& b = bucket[static_cast<std::size_t>(rank)];
        Tensor const mine = b.slice(rank * count, (rank + 1) * count);
        f.comm->reduce_scatter(rank, b, mine, ReduceOp::sum, stream);
        f.comm->all_gather(rank, mine, b, stream);
      });
      for (int r = 0; r < n; ++r) {
        auto const out = read(bucket[static_cast<std::size_t>(r)]);
        for (std::size_t i = 0; i < out.size(); ++i) {
          double magnitude = 0;
          for (auto const& v : in) magnitude += std::fabs(v[i]);
          require_close(out[i], reference_combine(ReduceOp::sum, in, i), magnitude, n, DType::float32);
        }
        if (r > 0) REQUIRE(std::memcmp(bucket[0].data(), bucket[static_cast<std::size_t>(r)].data(), bucket[0].nbytes()) == 0);
      }
    }
  }
}

// More ranks than the CUDA kernel's pointer arrays hold (and than the fused host loops unroll):
// the host path takes any count.
TEST_CASE("all_reduce, reduce and reduce_scatter at 17 and 33 ranks against a serial sum", "[comm][host]") {
  for (int n : {17, 33}) {
    Fixture f(n);
    for (DType t : {DType::float32, DType::bfloat16}) {
      std::int64_t const count = 3 * n + 5;  // uneven slices
      INFO(n << " ranks, " << mgpu::to_string(t));
      auto const in = random_inputs(n, count * n, t, static_cast<unsigned>(n));
      std::vector<Tensor> send;
      std::vector<Tensor> summed;
      std::vector<Tensor> reduced;
      std::vector<Tensor> scattered;
      for (int r = 0; r < n; ++r) {
        send.push_back(f.make(r, count * n, t));
        fill(send.back(), in[static_cast<std::size_t>(r)]);
        summed.push_back(f.make(r, count * n, t));
        reduced.push_back(f.make(r, count * n, t));
        scattered.push_back(f.make(r, count, t));
      }
      int const root = n / 2;
      f.group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
        auto const r = static_cast<std::size_t>(rank);
        f.comm->all_reduce(rank, send[r], summed[r], ReduceOp::sum, stream);
        f.comm->reduce(rank, send[r], reduced[r], ReduceOp::sum, root, stream);
        f.comm->reduce_scatter(rank, send[r], scattered[r], ReduceOp::sum, stream);
      });
      auto const check = [&](std::vector<float> const& got, std::size_t offset) {
        for (std::size_t i = 0; i < got.size(); ++i) {
          double expected = 0;
          double magnitude = 0;
          for (auto const& v : in) expected += v[offset + i], magnitude += std::fabs(v[offset + i]);
          require_close(got[i], expected, magnitude, n, t);
        }
      };
      for (int r = 0; r < n; ++r) {
        check(read(summed[static_cast<std::size_t>(r)]), 0);
        check(read(scattered[static_cast<std::size_t>(r)]), static_cast<std::size_t>(r * count));
      }
      check(read(reduced[static_cast<std::size_t>(root)]), 0);
    }
  }
}

TEST_CASE("Collectives of 64 MiB per rank", "[comm][host][large]") {
  constexpr std::int64_t count = (64 << 20) / 4;
  for (int n : {2, 3, 8}) {
    Fixture f(n);
    std::vector<Tensor> buffers;
    for (int r = 0; r < n; ++r) {
      buffers.push_back(f.make(r, count, DType::float32));
      auto s = buffers.back().host_span<float>();
      for (std::int64_t i = 0; i < count; ++i) s[static_cast<std::size_t>(i)] = static_cast<float>((i * (r + 3)) % 1024) - 512.0f;
    }
    f.group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
      f.comm->all_reduce(rank, buffers[static_cast<std::size_t>(rank)], buffers[static_cast<std::size_t>(rank)], ReduceOp::sum, stream);
    });
    for (int r = 0; r < n; ++r) {
      auto s = buffers[static_cast<std::size_t>(r)].host_span<float>();
      for (std::int64_t i = 0; i < count; i += 4093) {
        double expected = 0;
        for (int p = 0; p < n; ++p) expected += static_cast<double>((i * (p + 3)) % 1024) - 512.0;
        REQUIRE(s[static_cast<std::size_t>(i)] == expected);  // small integers: exact in float32
      }
    }
  }
  Fixture f(4);
  std::vector<Tensor> send;
  std::vector<Tensor> part;
  std::vector<Tensor> back;
  for (int r = 0; r < 4; ++r) {
    send.push_back(f.make(r, count, DType::float32));
    std::fill(send.back().host_span<float>().begin(), send.back().host_span<float>().end(), static_cast<float>(r + 1));
    part.push_back(f.make(r, count / 4, DType::float32));
    back.push_back(f.make(r, count, DType::float32));
  }
  f.group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
    auto const r = static_cast<std::size_t>(rank);
    f.comm->reduce_scatter(rank, send[r], part[r], ReduceOp::sum, stream);
    f.comm->all_gather(rank, part[r], back[r], stream);
  });
  for (auto const& t : back) {
    auto s = t.host_span<float>();
    REQUIRE(std::all_of(s.begin(), s.end(), [](float v) { return v == 10.0f; }));
  }
}

TEST_CASE("Host all_reduce is bitwise deterministic across runs and ranks", "[comm][host]") {
  Fixture f(5);
  constexpr std::int64_t count = 100003;
  auto const in = random_inputs(5, count, DType::float32, 11);
  std::vector<float> first;
  for (int run = 0; run < 3; ++run) {
    std::vector<Tensor> t;
    for (int r = 0; r < 5; ++r) {
      t.push_back(f.make(r, count, DType::float32));
      fill(t.back(), in[static_cast<std::size_t>(r)]);
    }
    f.group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
      f.comm->all_reduce(rank, t[static_cast<std::size_t>(rank)], t[static_cast<std::size_t>(rank)], ReduceOp::sum, stream);
    });
    for (auto const& x : t) {
      auto const v = read(x);
      if (first.empty()) first = v;
      REQUIRE(std::memcmp(v.data(), first.data(), v.size() * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("send/recv: a pipeline chain, and a ring exchange in a group", "[comm][host]") {
  Fixture f(4);
  std::vector<Tensor> a;
  std::vector<Tensor> b;
  for (int r = 0; r < 4; ++r) {
    a.push_back(f.make(r, 5, DType::float32));
    b.push_back(f.make(r, 5, DType::float32));
    std::fill(a.back().host_span<float>().begin(), a.back().host_span<float>().end(), static_cast<float>(r));
  }
  // Chain: rank 0 -> 1 -> 2 -> 3, each adding its rank in stream order.
  f.group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
    auto const r = static_cast<std::size_t>(rank);
    if (rank > 0) {
      f.comm->recv(rank, b[r], rank - 1, stream);
      stream.enqueue([&, r] {
        for (std::size_t i = 0; i < 5; ++i) a[r].host_span<float>()[i] += b[r].host_span<float>()[i];
      });
    }
    if (rank < 3) f.comm->send(rank, a[r], rank + 1, stream);
  });
  CHECK(a[3].host_span<float>()[4] == 0.0f + 1 + 2 + 3);

  // Ring: every rank sends right and receives from the left at the same time.
  f.group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
    auto const r = static_cast<std::size_t>(rank);
    f.comm->group_start(rank);
    f.comm->send(rank, a[r], (rank + 1) % 4, stream);
    f.comm->recv(rank, b[r], (rank + 3) % 4, stream);
    f.comm->group_end(rank);
  });
  for (int r = 0; r < 4; ++r) CHECK(b[static_cast<std::size_t>(r)].host_span<float>()[0] == a[static_cast<std::size_t>((r + 3) % 4)].host_span<float>()[0]);
}

// Waits (at most 10 s, so a broken protocol fails instead of hanging) until `flag` is set.
bool wait_for(std::atomic<bool> const& flag) {
  auto const deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!flag.load()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return true;
}

TEST_CASE("send/recv: a small send completes before its recv is posted, a large one waits for it", "[comm][host]") {
  Fixture f(2);
  std::int64_t const small = 1000;
  std::int64_t const large = (std::int64_t{3} << 20) / 4;  // 3 MiB of float32: eager alone, not beside another
  std::vector<Tensor> sent;
  for (std::int64_t n : {small, large, large, small}) {
    sent.push_back(f.make(0, n, DType::float32));
    auto s = sent.back().host_span<float>();
    for (std::size_t i = 0; i < s.size(); ++i) s[i] = static_cast<float>(sent.size() * 100000 + i % 1000);
  }
  std::vector<Tensor> got;
  for (Tensor const& t : sent) got.push_back(f.make(1, t.numel(), DType::float32));
  std::atomic<bool> first_two_sent{false}, third_posted{false}, recv_posted_early{false};
  f.group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
    if (rank == 0) {
      // The small and the first large send complete with no recv posted: both are eager.
      f.comm->send(0, sent[0], 1, stream);
      f.comm->send(0, sent[1], 1, stream);
      stream.synchronize();
      first_two_sent = true;
      // The channel holds 3 MiB still unreceived: the second large send waits for its recv.
      f.comm->send(0, sent[2], 1, stream);
      stream.synchronize();
      recv_posted_early = third_posted.load();
      f.comm->send(0, sent[3], 1, stream);
    } else {
      REQUIRE(wait_for(first_two_sent));
      f.comm->recv(1, got[0], 0, stream);
      f.comm->recv(1, got[1], 0, stream);
      third_posted = true;
      f.comm->recv(1, got[2], 0, stream);
      f.comm->recv(1, got[3], 0, stream);
    }
  });
  CHECK(recv_posted_early);
  for (std::size_t k = 0; k < sent.size(); ++k) {
    INFO("message " << k);
    CHECK(std::memcmp(got[k].host_span<float>().data(), sent[k].host_span<float>().data(), got[k].host_span<float>().size_bytes()) == 0);
  }
  CHECK_NOTHROW(f.comm->finalize());
}

TEST_CASE("barrier: no rank passes before every rank's earlier work is done", "[comm][host]") {
  Fixture f(6);
  std::atomic<int> before{0};
  std::vector<int> seen(6, -1);
  f.group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
    stream.enqueue([&, rank] {
      std::this_thread::sleep_for(std::chrono::milliseconds(rank * 5));
      ++before;
    });
    f.comm->barrier(rank, stream);
    stream.enqueue([&, rank] { seen[static_cast<std::size_t>(rank)] = before.load(); });
  });
  CHECK(seen == std::vector<int>(6, 6));
}

namespace {
// Runs VectorReduceSlice<T, O> over [begin, end) of `inputs` inputs and `outputs` outputs whose
// element 0 sits `shift[k]` elements past a 64-byte boundary (inputs first), and checks it against
// the element-by-element ReduceSlice: the same bits in [begin, end), nothing written outside it.
// Returns how many vectors it used.
template <class T, ReduceOp O>
std::int64_t check_vector_slice(int inputs, int outputs, std::vector<int> const& shift, std::int64_t begin,
                                std::int64_t end) {
  using mgpu::detail::ReduceSlice;
  using mgpu::detail::VectorReduceSlice;
  constexpr std::int64_t n = 300;
  constexpr std::size_t stride = 64 * 32;  // bytes per array, a multiple of 64
  static_assert(stride >= (n + 64) * sizeof(float));
  int const arrays = inputs + outputs;
  std::vector<unsigned char> fast_bytes(stride * static_cast<std::size_t>(arrays) + 64);
  std::vector<unsigned char> slow_bytes(fast_bytes.size());
  auto const base = [](std::vector<unsigned char>& bytes) {
    auto const at = reinterpret_cast<std::uintptr_t>(bytes.data());
    return bytes.data() + (64 - at % 64) % 64;
  };
  std::mt19937 rng(static_cast<unsigned>(inputs * 31 + outputs));
  std::uniform_real_distribution<float> value(-4.0f, 4.0f);
  ReduceSlice<T, O> fast{};
  ReduceSlice<T, O> slow{};
  fast.inputs = slow.inputs = inputs;
  fast.outputs = slow.outputs = outputs;
  for (int k = 0; k < arrays; ++k) {
    auto* const f = reinterpret_cast<T*>(base(fast_bytes) + stride * static_cast<std::size_t>(k)) +
                    shift[static_cast<std::size_t>(k)];
    auto* const s = reinterpret_cast<T*>(base(slow_bytes) + stride * static_cast<std::size_t>(k)) +
                    shift[static_cast<std::size_t>(k)];
    for (std::int64_t i = 0; i < n; ++i) f[i] = s[i] = T(k < inputs ? value(rng) : 99.0f);
    if (k < inputs) {
      fast.in[k] = f;
      slow.in[k] = s;
    } else {
      fast.out[k - inputs] = f;
      slow.out[k - inputs] = s;
    }
  }
  VectorReduceSlice<T, O> const vectorized(fast, begin, end);
  for (std::int64_t i = 0; i < vectorized.count(); ++i) vectorized(i);
  for (std::int64_t i = begin; i < end; ++i) slow(i);
  for (int q = 0; q < outputs; ++q) {
    for (std::int64_t i = 0; i < n; ++i) {
      INFO("output " << q << ", element " << i);
      REQUIRE(std::memcmp(&fast.out[q][i], &slow.out[q][i], sizeof(T)) == 0);
      if (i < begin || i >= end) REQUIRE(static_cast<float>(fast.out[q][i]) == 99.0f);
    }
  }
  return vectorized.vectors;
}
}  // namespace

TEST_CASE("The CUDA reduction's 16-byte vectors equal the element-by-element math, head and tail too",
          "[comm][reduce]") {
  auto const each_type_and_op = [](auto const& run) {
    mgpu::detail::visit_dtype(DType::float32, run);
    mgpu::detail::visit_dtype(DType::bfloat16, run);
    mgpu::detail::visit_dtype(DType::float16, run);
  };
  each_type_and_op([]<class T>(std::type_identity<T>) {
    constexpr std::int64_t lanes = 16 / sizeof(T);
    for (ReduceOp const op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::min, ReduceOp::max}) {
      mgpu::detail::visit_reduce_op(op, [&]<ReduceOp O>(std::integral_constant<ReduceOp, O>) {
        CAPTURE(sizeof(T), static_cast<int>(O));
        // Lined up at 0: whole vectors from the start, a tail after them.
        CHECK(check_vector_slice<T, O>(3, 3, {0, 0, 0, 0, 0, 0}, 0, 299) == 299 / lanes);
        // Lined up one element past a boundary: a head up to the next boundary, then vectors.
        std::int64_t const head = lanes - 1;
        CHECK(check_vector_slice<T, O>(4, 1, {1, 1, 1, 1, 1}, 0, 250) == (250 - head) / lanes);
        // A slice that starts inside the arrays (another rank's part of an all-reduce).
        CHECK(check_vector_slice<T, O>(2, 2, {0, 0, 0, 0}, 37, 211) > 0);
        // One input off by an element: no vectors, every element one by one.
        CHECK(check_vector_slice<T, O>(3, 2, {0, 1, 0, 0, 0}, 0, 300) == 0);
        // A slice shorter than its head: elements only.
        CHECK(check_vector_slice<T, O>(2, 1, {1, 1, 1}, 0, 1) == 0);
      });
    }
  });
}
