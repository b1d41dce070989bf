// mgpu_mpi_dist's collectives and subsets modes (tests/dist/mpi_dist.cpp says what each checks): every
// collective against float64 references, the world's device list, subset communicators.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

#include <mgpu/parallel/mesh.hpp>

#include "mpi_dist.hpp"

namespace mpi_dist {

namespace {

// Rank r's i-th input of test `seed`, in [-1, 1), rounded to `dtype` as stored.
double input(int seed, int rank, std::int64_t i, DType dtype) {
  std::uint64_t x = static_cast<std::uint64_t>(seed) * 1000003u + static_cast<std::uint64_t>(rank) * 7919u +
                    static_cast<std::uint64_t>(i) * 104729u;
  x ^= x >> 13;
  x *= 0x9E3779B97F4A7C15ull;
  x ^= x >> 29;
  float const value = static_cast<float>(static_cast<double>(x % 2000001) / 1000000.0 - 1.0);
  switch (dtype) {
    case DType::bfloat16:
      return static_cast<float>(mgpu::bfloat16(value));
    case DType::float16:
      return static_cast<float>(mgpu::float16(value));
    default:
      return value;
  }
}

double epsilon(DType dtype) {
  switch (dtype) {
    case DType::bfloat16:
      return std::ldexp(1.0, -8);
    case DType::float16:
      return std::ldexp(1.0, -11);
    default:
      return std::ldexp(1.0, -23);
  }
}

// Calls f with t's elements as a span of its dtype's type.
template <class F>
void with_span(Tensor const& t, F&& f) {
  switch (t.dtype()) {
    case DType::bfloat16:
      f(t.host_span<mgpu::bfloat16>());
      break;
    case DType::float16:
      f(t.host_span<mgpu::float16>());
      break;
    default:
      f(t.host_span<float>());
      break;
  }
}

// t[i] = value(i) for every element, rounded to t's dtype. One span per tensor: these loops cover
// millions of elements, and a span per element cost more than the collectives under the sanitizers.
template <class F>
void store(Tensor const& t, F&& value) {
  with_span(t, [&](auto span) {
    using T = typename decltype(span)::value_type;
    for (std::size_t i = 0; i < span.size(); ++i) span[i] = T(static_cast<float>(value(static_cast<std::int64_t>(i))));
  });
}

// t's elements as float64.
std::vector<double> load(Tensor const& t) {
  std::vector<double> v;
  with_span(t, [&](auto span) {
    v.reserve(span.size());
    for (auto const x : span) v.push_back(static_cast<float>(x));
  });
  return v;
}

// The float64 reference of `op` over every rank's inputs at index i.
struct Reference {
  double value;
  double magnitude;  // sum of |inputs|: scales the tolerance
};
Reference reference(ReduceOp op, int seed, int ranks, std::int64_t i, DType dtype) {
  double acc = input(seed, 0, i, dtype);
  double magnitude = std::abs(acc);
  for (int r = 1; r < ranks; ++r) {
    double const x = input(seed, r, i, dtype);
    magnitude += std::abs(x);
    if (op == ReduceOp::min)
      acc = std::min(acc, x);
    else if (op == ReduceOp::max)
      acc = std::max(acc, x);
    else
      acc += x;
  }
  if (op == ReduceOp::avg) acc /= ranks;
  return {acc, magnitude};
}

// The reduction's partials are rounded to the dtype inside each process and once more at the end.
bool close(double got, Reference const& ref, DType dtype) {
  return std::abs(got - ref.value) <= 3 * epsilon(dtype) * ref.magnitude + 1e-30;
}

std::vector<Tensor> make(Setup const& s, std::int64_t count, DType dtype) {
  std::vector<Tensor> t;
  for (int l = 0; l < s.local(); ++l) t.push_back(Tensor::empty({count}, dtype, s.group.allocator(s.member(l))));
  return t;
}

void fill(Setup const& s, std::vector<Tensor> const& t, int seed, DType dtype) {
  for (int l = 0; l < s.local(); ++l)
    store(t[static_cast<std::size_t>(l)], [&](std::int64_t i) { return input(seed, s.rank(l), i, dtype); });
}

// This process's ranks of the subset `list` of world ranks, as its group's ranks, in the list's order.
std::vector<int> members_of(mgpu::dist::World const& world, std::vector<int> const& list) {
  std::vector<int> members;
  for (int const r : list) {
    mgpu::dist::WorldDevice const& d = world.devices[static_cast<std::size_t>(r)];
    if (d.process == world.process) members.push_back(d.local_rank);
  }
  return members;
}

}  // namespace

// n from 65536 elements on: among 3 or more processes the leaders reduce-scatter and all-gather.
// Between 2 processes of L ranks each, rank l leads elements [l n/L, (l+1) n/L) and the last rank
// also the n % L after them: n = 1, 37 and 4096 cover a rank with none, the leftovers and none.
void test_all_reduce(Setup const& s, DType dtype, ReduceOp op, int seed, bool in_place, std::int64_t n) {
  auto send = make(s, n, dtype);
  auto recv = in_place ? send : make(s, n, dtype);
  fill(s, send, seed, dtype);
  s.run([&](int l, mgpu::Stream& stream) {
    s.comm.all_reduce(s.rank(l), send[static_cast<std::size_t>(l)], recv[static_cast<std::size_t>(l)], op, stream);
  });
  for (int l = 0; l < s.local(); ++l) {
    std::vector<double> const result = load(recv[static_cast<std::size_t>(l)]);
    for (std::int64_t i = 0; i < n; ++i) {
      Reference const ref = reference(op, seed, s.size(), i, dtype);
      double const got = result[static_cast<std::size_t>(i)];
      EXPECT(close(got, ref, dtype), "all_reduce " << mgpu::comm::to_string(op) << " " << mgpu::to_string(dtype)
                                                   << (in_place ? " in place" : "") << " rank " << s.rank(l) << " ["
                                                   << i << "] = " << got << ", reference " << ref.value);
    }
  }
  // Every rank of every process holds the same bits: gather every rank's result and compare.
  auto gathered = make(s, n * s.size(), dtype);
  s.run([&](int l, mgpu::Stream& stream) {
    s.comm.all_gather(s.rank(l), recv[static_cast<std::size_t>(l)], gathered[static_cast<std::size_t>(l)], stream);
  });
  std::size_t const bytes = static_cast<std::size_t>(n) * mgpu::size_of(dtype);
  for (int r = 1; r < s.size(); ++r) {
    auto const* base = static_cast<char const*>(gathered[0].data());
    EXPECT(std::memcmp(base, base + static_cast<std::size_t>(r) * bytes, bytes) == 0,
           "all_reduce " << mgpu::comm::to_string(op) << " " << mgpu::to_string(dtype) << ": rank " << r
                         << "'s result differs in its bits from rank 0's");
  }
}

void test_reduce_scatter(Setup const& s, DType dtype, ReduceOp op, int seed) {
  std::int64_t const n = 11;
  auto send = make(s, n * s.size(), dtype);
  auto recv = make(s, n, dtype);
  fill(s, send, seed, dtype);
  s.run([&](int l, mgpu::Stream& stream) {
    s.comm.reduce_scatter(s.rank(l), send[static_cast<std::size_t>(l)], recv[static_cast<std::size_t>(l)], op, stream);
  });
  for (int l = 0; l < s.local(); ++l) {
    std::vector<double> const result = load(recv[static_cast<std::size_t>(l)]);
    for (std::int64_t i = 0; i < n; ++i) {
      Reference const ref = reference(op, seed, s.size(), s.rank(l) * n + i, dtype);
      double const got = result[static_cast<std::size_t>(i)];
      EXPECT(close(got, ref, dtype), "reduce_scatter " << mgpu::comm::to_string(op) << " " << mgpu::to_string(dtype)
                                                       << " rank " << s.rank(l) << " [" << i << "] = " << got
                                                       << ", reference " << ref.value);
    }
  }
}

void test_reduce(Setup const& s, DType dtype, ReduceOp op, int root, int seed) {
  std::int64_t const n = 23;
  auto send = make(s, n, dtype);
  auto recv = make(s, n, dtype);
  fill(s, send, seed, dtype);
  for (auto const& t : recv) store(t, [](std::int64_t) { return 42.0; });
  s.run([&](int l, mgpu::Stream& stream) {
    s.comm.reduce(s.rank(l), send[static_cast<std::size_t>(l)], recv[static_cast<std::size_t>(l)], op, root, stream);
  });
  for (int l = 0; l < s.local(); ++l) {
    std::vector<double> const result = load(recv[static_cast<std::size_t>(l)]);
    for (std::int64_t i = 0; i < n; ++i) {
      double const got = result[static_cast<std::size_t>(i)];
      if (s.rank(l) == root) {
        Reference const ref = reference(op, seed, s.size(), i, dtype);
        EXPECT(close(got, ref, dtype), "reduce " << mgpu::comm::to_string(op) << " " << mgpu::to_string(dtype)
                                                 << " to root " << root << " [" << i << "] = " << got << ", reference "
                                                 << ref.value);
      } else {
        EXPECT(got == 42.0, "reduce to root " << root << " wrote rank " << s.rank(l) << "'s recv");
      }
    }
  }
}

void test_all_gather(Setup const& s, DType dtype, int seed, bool in_place) {
  std::int64_t const n = 9;
  auto recv = make(s, n * s.size(), dtype);
  std::vector<Tensor> send;
  if (in_place) {
    for (int l = 0; l < s.local(); ++l)
      send.push_back(recv[static_cast<std::size_t>(l)].slice(s.rank(l) * n, (s.rank(l) + 1) * n));
  } else {
    send = make(s, n, dtype);
  }
  fill(s, send, seed, dtype);
  s.run([&](int l, mgpu::Stream& stream) {
    s.comm.all_gather(s.rank(l), send[static_cast<std::size_t>(l)], recv[static_cast<std::size_t>(l)], stream);
  });
  for (int l = 0; l < s.local(); ++l) {
    std::vector<double> const result = load(recv[static_cast<std::size_t>(l)]);
    for (int r = 0; r < s.size(); ++r) {
      for (std::int64_t i = 0; i < n; ++i) {
        double const got = result[static_cast<std::size_t>(r * n + i)];
        EXPECT(got == input(seed, r, i, dtype), "all_gather " << mgpu::to_string(dtype) << (in_place ? " in place" : "")
                                                              << " rank " << s.rank(l) << " block " << r << " [" << i
                                                              << "] = " << got);
      }
    }
  }
}

void test_broadcast(Setup const& s, DType dtype, int root, int seed) {
  std::int64_t const n = 13;
  auto buffer = make(s, n, dtype);
  fill(s, buffer, seed, dtype);
  s.run([&](int l, mgpu::Stream& stream) {
    s.comm.broadcast(s.rank(l), buffer[static_cast<std::size_t>(l)], root, stream);
  });
  for (int l = 0; l < s.local(); ++l) {
    std::vector<double> const result = load(buffer[static_cast<std::size_t>(l)]);
    for (std::int64_t i = 0; i < n; ++i) {
      double const got = result[static_cast<std::size_t>(i)];
      EXPECT(got == input(seed, root, i, dtype),
             "broadcast from " << root << " rank " << s.rank(l) << " [" << i << "] = " << got);
    }
  }
}

// Every rank sends to the next rank and receives from the previous one in a group (a ring that
// crosses the processes), then rank 0 and the last rank exchange without a group, one after the other.
void test_send_recv(Setup const& s, DType dtype, int seed) {
  std::int64_t const n = 17;
  int const w = s.size();
  auto send = make(s, n, dtype);
  auto recv = make(s, n, dtype);
  fill(s, send, seed, dtype);
  s.run([&](int l, mgpu::Stream& stream) {
    int const r = s.rank(l);
    s.comm.group_start(r);
    s.comm.send(r, send[static_cast<std::size_t>(l)], (r + 1) % w, stream);
    s.comm.recv(r, recv[static_cast<std::size_t>(l)], (r + w - 1) % w, stream);
    s.comm.group_end(r);
  });
  for (int l = 0; l < s.local(); ++l) {
    int const from = (s.rank(l) + w - 1) % w;
    std::vector<double> const result = load(recv[static_cast<std::size_t>(l)]);
    for (std::int64_t i = 0; i < n; ++i) {
      double const got = result[static_cast<std::size_t>(i)];
      EXPECT(got == input(seed, from, i, dtype),
             "ring recv on rank " << s.rank(l) << " from " << from << " [" << i << "] = " << got);
    }
  }
  // A large message (past any eager limit) one way, then a small one back.
  std::int64_t const big = 1 << 20;
  auto large = make(s, big, DType::float32);
  for (int l = 0; l < s.local(); ++l) {
    if (s.rank(l) == 0) store(large[static_cast<std::size_t>(l)], [](std::int64_t i) { return static_cast<double>(i % 1000); });
  }
  s.run([&](int l, mgpu::Stream& stream) {
    int const r = s.rank(l);
    if (r == 0) {
      s.comm.send(r, large[static_cast<std::size_t>(l)], w - 1, stream);
      s.comm.recv(r, recv[static_cast<std::size_t>(l)], w - 1, stream);
    } else if (r == w - 1) {
      s.comm.recv(r, large[static_cast<std::size_t>(l)], 0, stream);
      s.comm.send(r, send[static_cast<std::size_t>(l)], 0, stream);
    }
  });
  for (int l = 0; l < s.local(); ++l) {
    if (s.rank(l) == w - 1) {
      std::vector<double> const arrived = load(large[static_cast<std::size_t>(l)]);
      bool same = true;
      for (std::int64_t i = 0; i < big; ++i) same = same && arrived[static_cast<std::size_t>(i)] == static_cast<double>(i % 1000);
      EXPECT(same, "the 4 MiB message from rank 0 to rank " << w - 1 << " arrived changed");
    }
    if (s.rank(l) == 0) {
      std::vector<double> const reply = load(recv[static_cast<std::size_t>(l)]);
      for (std::int64_t i = 0; i < n; ++i)
        EXPECT(reply[static_cast<std::size_t>(i)] == input(seed, w - 1, i, dtype), "reply [" << i << "]");
    }
  }
}

// Every collective, dtype and reduce op over `s`'s communicator (2 ranks or more), seeds from `seed` on.
void test_collectives(Setup const& s, int& seed) {
  for (DType dtype : {DType::float32, DType::bfloat16, DType::float16}) {
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::min, ReduceOp::max}) {
      test_all_reduce(s, dtype, op, seed++, false);
      test_reduce_scatter(s, dtype, op, seed++);
    }
    test_all_reduce(s, dtype, ReduceOp::sum, seed++, true);
    for (std::int64_t n : {1, 4096}) test_all_reduce(s, dtype, ReduceOp::max, seed++, true, n);
    test_all_reduce(s, dtype, dtype == DType::float32 ? ReduceOp::avg : ReduceOp::sum, seed++, false, 70001);
    // Slices of more pieces (65536 elements each) than an all-reduce between two processes
    // keeps in flight, in place and not.
    test_all_reduce(s, dtype, ReduceOp::sum, seed++, dtype == DType::bfloat16, 10 * 65536 + 3);
    for (int root : {0, s.size() - 1, s.size() / 2}) test_reduce(s, dtype, ReduceOp::sum, root, seed++);
    test_reduce(s, dtype, ReduceOp::max, 1, seed++);
    test_all_gather(s, dtype, seed++, false);
    test_all_gather(s, dtype, seed++, true);
    for (int root : {0, s.size() - 1, 1}) test_broadcast(s, dtype, root, seed++);
    test_send_recv(s, dtype, seed++);
  }
}

// With one device per process, the all-reduce equals an in-process host communicator's over as
// many devices, bit for bit: both combine the ranks in rank order in float32.
void test_matches_one_process(Setup const& s, int seed, std::int64_t n) {
  auto send = make(s, n, DType::float32);
  fill(s, send, seed, DType::float32);
  s.group.run([&](int l, mgpu::Device, mgpu::Stream& stream) {
    s.comm.all_reduce(s.rank(l), send[static_cast<std::size_t>(l)], send[static_cast<std::size_t>(l)], ReduceOp::sum,
                      stream);
  });
  mgpu::DeviceGroup all("host:" + std::to_string(s.size()));
  auto one = mgpu::comm::make_communicator(all);
  std::vector<Tensor> ref;
  for (int r = 0; r < s.size(); ++r) {
    ref.push_back(Tensor::empty({n}, DType::float32, all.allocator(r)));
    store(ref.back(), [&](std::int64_t i) { return input(seed, r, i, DType::float32); });
  }
  all.run([&](int r, mgpu::Device, mgpu::Stream& stream) {
    one->all_reduce(r, ref[static_cast<std::size_t>(r)], ref[static_cast<std::size_t>(r)], ReduceOp::sum, stream);
  });
  one->finalize();
  EXPECT(std::memcmp(send[0].data(), ref[0].data(), static_cast<std::size_t>(n) * 4) == 0,
         "the all_reduce across processes differs in its bits from one process's over host:" << s.size());
}

void test_world(mgpu::dist::World const& world, std::vector<int> const& counts, mgpu::dist::Place const& place) {
  EXPECT(world.processes == static_cast<int>(counts.size()), "processes " << world.processes);
  EXPECT(world.process == place.rank, "process " << world.process);
  int rank = 0;
  for (int p = 0; p < static_cast<int>(counts.size()); ++p) {
    EXPECT(world.first_rank(p) == rank, "first rank of process " << p);
    EXPECT(world.local_size(p) == counts[static_cast<std::size_t>(p)], "local size of process " << p);
    for (int l = 0; l < counts[static_cast<std::size_t>(p)]; ++l, ++rank) {
      auto const& d = world.devices[static_cast<std::size_t>(rank)];
      EXPECT(d.rank == rank && d.process == p && d.local_rank == l &&
                 d.device == (mgpu::Device{mgpu::DeviceKind::host, l}),
             "world device " << rank << ": rank " << d.rank << ", process " << d.process << ", local rank "
                             << d.local_rank << ", " << d.device.to_string());
      EXPECT(d.host == place.host,
             "world device " << rank << " on host " << d.host << " (expected " << place.host << ": one machine)");
    }
  }
  EXPECT(world.size() == rank, "world size " << world.size());
}

// Subset communicators over the world's ranks (dist::make_communicator(world, group, ranks)), each
// made by the processes that drive its ranks only: the even and the odd ranks (interleaved across
// the processes), every rank from the last to the first, the ranks of one process (an in-process
// communicator), and with 3 processes the first and the last rank (the middle processes make
// none). Every collective over each against float64 references, sends and receives across
// processes within it; then two subsets (the even and the odd ranks) used at once with the world's
// communicator; then the lists refused before any communication.
void test_subsets(Setup const& s) {
  mgpu::dist::World const& world = s.world;
  int const w = world.size();
  std::vector<std::vector<int>> lists(2);
  for (int r = 0; r < w; ++r) lists[static_cast<std::size_t>(r % 2)].push_back(r);
  std::vector<int> backwards;
  for (int r = w - 1; r >= 0; --r) backwards.push_back(r);
  lists.push_back(backwards);
  for (int p = 0; p < world.processes; ++p) {
    if (world.local_size(p) < 2) continue;
    std::vector<int> inside;
    for (int l = 0; l < world.local_size(p); ++l) inside.push_back(world.first_rank(p) + l);
    lists.push_back(inside);
    break;
  }
  if (world.processes > 2) lists.push_back({0, w - 1});
  for (std::size_t index = 0; index < lists.size(); ++index) {
    std::vector<int> const& list = lists[index];
    int seed = 1000 * static_cast<int>(index + 1);  // the same on the processes, whichever subsets they skip
    std::vector<int> const members = members_of(world, list);
    if (members.empty() || list.size() < 2) continue;
    auto comm = mgpu::dist::make_communicator(world, s.group, list, {.timeout = 60s});
    EXPECT(comm->size() == static_cast<int>(list.size()), "subset communicator size " << comm->size());
    int const first = static_cast<int>(std::find(list.begin(), list.end(), world.rank_of(members[0])) - list.begin());
    EXPECT(comm->first_rank() == first,
           "the subset's first rank on process " << process << ": " << comm->first_rank() << " (expected " << first << ")");
    Setup const t{world, s.group, *comm, members};
    int const checked = checks;
    test_collectives(t, seed);
    std::printf("process %d: subset of %zu ranks from world rank %d: %d checks\n", process, list.size(), list[0],
                checks - checked);
    comm->finalize();
  }
  // Two subsets at once, on the world's communicator too: each rank all-reduces over its parity's
  // ranks and then over the world, in one run (both subsets' leaders exchange meanwhile).
  std::vector<std::unique_ptr<mgpu::comm::Communicator>> parity(2);
  for (int q = 0; q < 2; ++q) {
    if (!members_of(world, lists[static_cast<std::size_t>(q)]).empty())
      parity[static_cast<std::size_t>(q)] =
          mgpu::dist::make_communicator(world, s.group, lists[static_cast<std::size_t>(q)], {.timeout = 60s});
  }
  std::int64_t const n = 29;
  int const seed = 99;
  auto mine = make(s, n, DType::float32);
  auto all = make(s, n, DType::float32);
  fill(s, mine, seed, DType::float32);
  fill(s, all, seed + 1, DType::float32);
  s.run([&](int l, mgpu::Stream& stream) {
    int const r = s.rank(l);
    parity[static_cast<std::size_t>(r % 2)]->all_reduce(r / 2, mine[static_cast<std::size_t>(l)],
                                                        mine[static_cast<std::size_t>(l)], ReduceOp::sum, stream);
    s.comm.all_reduce(r, all[static_cast<std::size_t>(l)], all[static_cast<std::size_t>(l)], ReduceOp::sum, stream);
  });
  for (int l = 0; l < s.local(); ++l) {
    int const r = s.rank(l);
    std::vector<double> const parity_sum = load(mine[static_cast<std::size_t>(l)]);
    std::vector<double> const world_sum = load(all[static_cast<std::size_t>(l)]);
    for (std::int64_t i = 0; i < n; ++i) {
      Reference ref{0, 0};
      for (int q = r % 2; q < w; q += 2) {
        ref.value += input(seed, q, i, DType::float32);
        ref.magnitude += std::abs(input(seed, q, i, DType::float32));
      }
      double const got = parity_sum[static_cast<std::size_t>(i)];
      EXPECT(close(got, ref, DType::float32),
             "all_reduce over the ranks of rank " << r << "'s parity [" << i << "] = " << got << ", reference " << ref.value);
      Reference const whole = reference(ReduceOp::sum, seed + 1, w, i, DType::float32);
      EXPECT(close(world_sum[static_cast<std::size_t>(i)], whole, DType::float32),
             "all_reduce over the world, meanwhile, on rank " << r << " [" << i << "]");
    }
  }
  for (auto& c : parity) {
    if (c) c->finalize();
  }
  // Refused before any communication.
  int const other = world.processes > 1 ? world.first_rank((world.process + 1) % world.processes) : 0;
  expect_refused([&] { (void)mgpu::dist::make_communicator(world, s.group, std::vector<int>{}); }, "no world ranks", "an empty list");
  expect_refused([&] { (void)mgpu::dist::make_communicator(world, s.group, {0, w}); }, "expected world ranks in [0, ",
                 "an out-of-range rank");
  expect_refused([&] { (void)mgpu::dist::make_communicator(world, s.group, {0, 0}); }, "twice", "a repeated rank");
  if (world.processes > 1) {
    expect_refused([&] { (void)mgpu::dist::make_communicator(world, s.group, {other}); }, "which drives none of them",
                   "a list without this process's ranks");
    if (world.local_size(0) > 1)
      expect_refused([&] { (void)mgpu::dist::make_communicator(world, s.group, {0, w - 1, 1}); },
                     "lists process 0's ranks apart", "a process's ranks apart in the list");
  }
}

void test_mesh(Setup const& s) {
  mgpu::dist::World const& world = s.world;
  int const w = world.size();
  if (w % 2 != 0) {
    EXPECT(false, "the mesh mode over a world of " << w << " devices (expected an even count)");
    return;
  }
  int const tp = w / 2;
  mgpu::parallel::MeshOptions const options{.comm = {.timeout = 60s},
                                            .make_communicator = mgpu::dist::communicator_factory(world),
                                            .make_subset_communicator = mgpu::dist::subset_communicator_factory(world)};
  auto const mesh = std::make_shared<mgpu::parallel::Mesh>(mgpu::DeviceGroup("host:" + std::to_string(s.group.size())),
                                                           mgpu::comm::DeviceMesh({{"dp", 2}, {"tp", tp}}), options);
  mgpu::DeviceGroup& group = mesh->group();
  int const first = world.rank_of(0);
  EXPECT(mesh->across() == (world.processes > 1), "the mesh across processes: " << mesh->across());
  EXPECT(mesh->first_rank() == first, "the mesh's first rank " << mesh->first_rank() << " (expected " << first << ")");
  // One communicator per group, the same object on a second ask; ranks g and h share one along
  // tp when g / tp == h / tp, along dp when g % tp == h % tp.
  for (std::string_view const dim : {"tp", "dp"}) {
    for (int l = 0; l < group.size(); ++l) {
      int const g = first + l;
      mgpu::comm::Communicator& c = mesh->communicator(g, dim);
      EXPECT(&c == &mesh->communicator(g, dim), "rank " << g << "'s " << dim << " communicator made twice");
      EXPECT(c.size() == (dim == "tp" ? tp : 2), "rank " << g << "'s " << dim << " communicator of " << c.size());
      for (int m = 0; m < group.size(); ++m) {
        int const h = first + m;
        bool const together = dim == "tp" ? g / tp == h / tp : g % tp == h % tp;
        EXPECT((&c == &mesh->communicator(h, dim)) == together, "ranks " << g << " and " << h << " along " << dim);
      }
    }
  }
  int groups = 1;  // the communicator over every rank, made with the mesh; then the groups this process drives
  for (int a = 0; a < 2; ++a) {
    bool driven = false;
    for (int t = 0; t < tp; ++t) driven = driven || mesh->drives(a * tp + t);
    groups += driven ? 1 : 0;
  }
  for (int t = 0; t < tp; ++t) groups += mesh->drives(t) || mesh->drives(tp + t) ? 1 : 0;
  EXPECT(mesh->made() == groups, "the mesh made " << mesh->made() << " communicators (expected " << groups << ")");
  std::int64_t const n = 23;
  int const seed = 77;
  std::vector<Tensor> along_tp(static_cast<std::size_t>(group.size())), along_dp(along_tp.size());
  group.run([&](int l, mgpu::Device, mgpu::Stream& stream) {
    int const g = first + l;
    for (Tensor* t : {&along_tp[static_cast<std::size_t>(l)], &along_dp[static_cast<std::size_t>(l)]}) {
      *t = Tensor::empty({n}, DType::float32, group.allocator(l));
      for (std::int64_t i = 0; i < n; ++i)
        t->host_span<float>()[static_cast<std::size_t>(i)] = static_cast<float>(input(seed, g, i, DType::float32));
    }
    Tensor const& a = along_tp[static_cast<std::size_t>(l)];
    Tensor const& b = along_dp[static_cast<std::size_t>(l)];
    mesh->communicator(g, "tp").all_reduce(g % tp, a, a, ReduceOp::sum, stream);
    mesh->communicator(g, "dp").all_reduce(g / tp, b, b, ReduceOp::sum, stream);
  });
  group.synchronize();
  for (int l = 0; l < group.size(); ++l) {
    int const g = first + l;
    std::vector<double> const got_tp = load(along_tp[static_cast<std::size_t>(l)]);
    std::vector<double> const got_dp = load(along_dp[static_cast<std::size_t>(l)]);
    for (std::int64_t i = 0; i < n; ++i) {
      Reference by_tp{0, 0}, by_dp{0, 0};  // serial sums over the group's ranks
      for (int u = 0; u < tp; ++u) {
        by_tp.value += input(seed, g / tp * tp + u, i, DType::float32);
        by_tp.magnitude += std::abs(input(seed, g / tp * tp + u, i, DType::float32));
      }
      for (int a = 0; a < 2; ++a) {
        by_dp.value += input(seed, a * tp + g % tp, i, DType::float32);
        by_dp.magnitude += std::abs(input(seed, a * tp + g % tp, i, DType::float32));
      }
      EXPECT(close(got_tp[static_cast<std::size_t>(i)], by_tp, DType::float32),
             "all_reduce over rank " << g << "'s tp group [" << i << "], reference " << by_tp.value);
      EXPECT(close(got_dp[static_cast<std::size_t>(i)], by_dp, DType::float32),
             "all_reduce over rank " << g << "'s dp group [" << i << "], reference " << by_dp.value);
    }
  }
  mesh->communicator(first, "tp").finalize();
  mesh->communicator(first, "dp").finalize();
  // Refused: a dimension the mesh lacks, a mesh of another size than the world's device count.
  expect_refused([&] { (void)mesh->communicator(first, "pp"); }, "pp", "a dimension the mesh lacks");
  expect_refused(
      [&] {
        mgpu::parallel::Mesh const other(mgpu::DeviceGroup("host:" + std::to_string(s.group.size())),
                                         mgpu::comm::DeviceMesh({{"dp", w + 2}}), options);
      },
      "a mesh of " + std::to_string(w + 2) + " ranks (dp " + std::to_string(w + 2) + ") over a world of " + std::to_string(w) +
          " devices",
      "a mesh larger than the world");
}

}  // namespace mpi_dist
