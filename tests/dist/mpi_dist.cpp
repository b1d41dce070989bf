// The dist module across processes, run by ctest under mpirun (one process per entry of COUNTS):
//
//   mpi_dist collectives COUNTS      e.g. "2,1,2": process p drives COUNTS[p] host devices. Every
//                                    collective, dtype and reduce op of the communicator across
//                                    processes against float64 references that each process computes
//                                    from every rank's inputs; sends and receives across processes;
//                                    the world's device list. Exit status 0 when every check passed.
//   mpi_dist data_parallel COUNTS    parallel::DataParallel across the processes (each its own
//                                    rows of the global batch) against a DataParallel over as many
//                                    devices in one process, which every process runs itself:
//                                    bucketed, overlapped or not, sharded update or not, with
//                                    dropout or clipping; bitwise with one device per process.
//   mpi_dist checkpoint COUNTS FOLDER  DataParallel::save() across the processes into FOLDER mid-run
//                                    and load() of it across the processes and in one process on 3
//                                    devices, against an uninterrupted run in one process; with and
//                                    without the sharded update. A save mid-cycle is refused, a
//                                    damaged shard named.
//   mpi_dist pipeline COUNTS         pipeline::Executor with its stages on the processes' devices
//                                    (world rank g runs pipeline device g) against the same
//                                    executor over as many devices in one process, which every
//                                    process runs itself: GPipe and 1F1B, one stage per device or
//                                    data x pipeline grids, with dropout, clipping, float16 and a
//                                    loss scaler; the losses, each process's chunks and
//                                    gather_parameters() bitwise. And a GPT, its tied LM head in
//                                    another process.
//   mpi_dist pipeline_checkpoint COUNTS FOLDER  pipeline::Executor::save() across the processes
//                                    into FOLDER mid-run (a GPT over 2 stages, x 2 replicas on 4
//                                    devices) and load() of it across the processes and in one
//                                    process, against an uninterrupted run in one process. A
//                                    damaged shard named, an unwritable folder failing everywhere.
//   mpi_dist failure COUNTS          a step out of memory in the last process fails in every process,
//                                    and DataParallel, a GPT pipeline and TensorParallel go on.
//   mpi_dist tensor_parallel COUNTS  parallel::TensorParallel with its grid over the processes' devices
//                                    against one over as many devices in one process: tensor
//                                    parallelism alone and with 2 replicas, sequence parallelism,
//                                    dropout, clipping; bitwise where the reductions keep their order.
//   mpi_dist tensor_parallel_pipeline COUNTS  pipeline::Executor's data x tensor x pipeline grid over
//                                    the processes' devices (2, 4 or 8 in all) against one process's.
//   mpi_dist subsets COUNTS          subset communicators across processes (dist::make_communicator
//                                    over some world ranks): every collective over several subsets
//                                    against float64 references, two at once, bad lists refused.
//   mpi_dist subset_missing COUNTS PROCESS  every process but PROCESS makes a subset communicator
//                                    over every rank with a 3 s deadline: they must fail naming it.
//   mpi_dist subset_mismatch COUNTS PROCESS  the same, but PROCESS lists the ranks backwards.
//   mpi_dist stall COUNTS PROCESS    one all_reduce, then PROCESS stalls while the others start a
//                                    second one with a 3 s deadline: they must fail naming it.
//   mpi_dist exit COUNTS PROCESS     the same, but PROCESS exits (status 3) instead.
//   mpi_dist mismatch COUNTS PROCESS the same, but PROCESS passes 5 elements where the others pass 4.
//   mpi_dist mismatch_local COUNTS PROCESS  the same, but in every process its last rank passes 5
//                                    elements and its others 4.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include <mgpu/dist/dist.hpp>
#include <mgpu/io/sharded_checkpoint.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/parallel/data_parallel.hpp>
#include <mgpu/parallel/tensor_parallel.hpp>
#include <mgpu/pipeline/pipeline.hpp>

using mgpu::DType;
using mgpu::Tensor;
using mgpu::comm::ReduceOp;
using namespace std::chrono_literals;

namespace {

int failures = 0;
int checks = 0;
int process = 0;

#define EXPECT(condition, what)                                                                      \
  do {                                                                                               \
    ++checks;                                                                                        \
    if (!(condition)) {                                                                              \
      ++failures;                                                                                    \
      std::ostringstream text_;                                                                      \
      text_ << what;                                                                                 \
      std::fprintf(stderr, "process %d: FAILED %s: %s\n", process, #condition, text_.str().c_str()); \
    }                                                                                                \
  } while (false)

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

void store(Tensor const& t, std::int64_t i, double value) {
  switch (t.dtype()) {
    case DType::bfloat16:
      t.host_span<mgpu::bfloat16>()[static_cast<std::size_t>(i)] = mgpu::bfloat16(static_cast<float>(value));
      break;
    case DType::float16:
      t.host_span<mgpu::float16>()[static_cast<std::size_t>(i)] = mgpu::float16(static_cast<float>(value));
      break;
    default:
      t.host_span<float>()[static_cast<std::size_t>(i)] = static_cast<float>(value);
      break;
  }
}

double load(Tensor const& t, std::int64_t i) {
  switch (t.dtype()) {
    case DType::bfloat16:
      return static_cast<float>(t.host_span<mgpu::bfloat16>()[static_cast<std::size_t>(i)]);
    case DType::float16:
      return static_cast<float>(t.host_span<mgpu::float16>()[static_cast<std::size_t>(i)]);
    default:
      return t.host_span<float>()[static_cast<std::size_t>(i)];
  }
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

// A communicator over the world's ranks, or over a subset of them: this process's ranks of it
// (l from 0 to local() - 1) are its ranks rank(l), on the group's ranks `members` (empty: every
// rank of the group).
struct Setup {
  mgpu::dist::World world;
  mgpu::DeviceGroup& group;
  mgpu::comm::Communicator& comm;
  std::vector<int> members = {};
  int local() const { return members.empty() ? group.size() : static_cast<int>(members.size()); }
  int rank(int l) const { return comm.first_rank() + l; }
  int size() const { return comm.size(); }
  int member(int l) const { return members.empty() ? l : members[static_cast<std::size_t>(l)]; }
  // Runs fn(l, stream) on each of this process's ranks of the communicator, on its device's thread.
  template <class Fn>
  void run(Fn const& fn) const {
    group.run([&](int g, mgpu::Device, mgpu::Stream& stream) {
      for (int l = 0; l < local(); ++l) {
        if (member(l) == g) fn(l, stream);
      }
    });
  }
};

std::vector<Tensor> make(Setup const& s, std::int64_t count, DType dtype) {
  std::vector<Tensor> t;
  for (int l = 0; l < s.local(); ++l) t.push_back(Tensor::empty({count}, dtype, s.group.allocator(s.member(l))));
  return t;
}

void fill(Setup const& s, std::vector<Tensor> const& t, int seed, DType dtype) {
  for (int l = 0; l < s.local(); ++l) {
    for (std::int64_t i = 0; i < t[static_cast<std::size_t>(l)].numel(); ++i)
      store(t[static_cast<std::size_t>(l)], i, input(seed, s.rank(l), i, dtype));
  }
}

// n from 65536 elements on: among 3 or more processes the leaders reduce-scatter and all-gather.
// Between 2 processes of L ranks each, rank l leads elements [l n/L, (l+1) n/L) and the last rank
// also the n % L after them: n = 1, 37 and 4096 cover a rank with none, the leftovers and none.
void test_all_reduce(Setup const& s, DType dtype, ReduceOp op, int seed, bool in_place, std::int64_t n = 37) {
  auto send = make(s, n, dtype);
  auto recv = in_place ? send : make(s, n, dtype);
  fill(s, send, seed, dtype);
  s.run([&](int l, mgpu::Stream& stream) {
    s.comm.all_reduce(s.rank(l), send[static_cast<std::size_t>(l)], recv[static_cast<std::size_t>(l)], op, stream);
  });
  for (int l = 0; l < s.local(); ++l) {
    for (std::int64_t i = 0; i < n; ++i) {
      Reference const ref = reference(op, seed, s.size(), i, dtype);
      double const got = load(recv[static_cast<std::size_t>(l)], i);
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
    for (std::int64_t i = 0; i < n; ++i) {
      Reference const ref = reference(op, seed, s.size(), s.rank(l) * n + i, dtype);
      double const got = load(recv[static_cast<std::size_t>(l)], i);
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
  for (auto const& t : recv) {
    for (std::int64_t i = 0; i < n; ++i) store(t, i, 42.0);
  }
  s.run([&](int l, mgpu::Stream& stream) {
    s.comm.reduce(s.rank(l), send[static_cast<std::size_t>(l)], recv[static_cast<std::size_t>(l)], op, root, stream);
  });
  for (int l = 0; l < s.local(); ++l) {
    for (std::int64_t i = 0; i < n; ++i) {
      double const got = load(recv[static_cast<std::size_t>(l)], i);
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
    for (int r = 0; r < s.size(); ++r) {
      for (std::int64_t i = 0; i < n; ++i) {
        double const got = load(recv[static_cast<std::size_t>(l)], r * n + i);
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
    for (std::int64_t i = 0; i < n; ++i) {
      double const got = load(buffer[static_cast<std::size_t>(l)], i);
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
    for (std::int64_t i = 0; i < n; ++i) {
      double const got = load(recv[static_cast<std::size_t>(l)], i);
      EXPECT(got == input(seed, from, i, dtype),
             "ring recv on rank " << s.rank(l) << " from " << from << " [" << i << "] = " << got);
    }
  }
  // A large message (past any eager limit) one way, then a small one back.
  std::int64_t const big = 1 << 20;
  auto large = make(s, big, DType::float32);
  for (int l = 0; l < s.local(); ++l) {
    if (s.rank(l) == 0) {
      for (std::int64_t i = 0; i < big; ++i)
        store(large[static_cast<std::size_t>(l)], i, static_cast<double>(i % 1000));
    }
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
      bool same = true;
      for (std::int64_t i = 0; i < big; ++i)
        same = same && load(large[static_cast<std::size_t>(l)], i) == static_cast<double>(i % 1000);
      EXPECT(same, "the 4 MiB message from rank 0 to rank " << w - 1 << " arrived changed");
    }
    if (s.rank(l) == 0) {
      for (std::int64_t i = 0; i < n; ++i)
        EXPECT(load(recv[static_cast<std::size_t>(l)], i) == input(seed, w - 1, i, dtype), "reply [" << i << "]");
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
    for (std::int64_t i = 0; i < n; ++i) store(ref.back(), i, input(seed, r, i, DType::float32));
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

// A small MLP, with dropout (whose mask follows each row's place in the global batch) when asked.
mgpu::nn::Sequential dp_model(bool dropout) {
  mgpu::nn::Sequential model;
  model.add(std::make_unique<mgpu::nn::Linear>(6, 16));
  model.add(std::make_unique<mgpu::nn::ReLU>());
  if (dropout) model.add(std::make_unique<mgpu::nn::Dropout>(0.25f));
  model.add(std::make_unique<mgpu::nn::Linear>(16, 12));
  model.add(std::make_unique<mgpu::nn::ReLU>());
  model.add(std::make_unique<mgpu::nn::Linear>(12, 4));
  return model;
}

// `ids` with the last token of its last row set to `value`.
Tensor with_last_id(Tensor const& ids, std::int32_t value) {
  std::shared_ptr<mgpu::Allocator> const host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  Tensor copy = Tensor::empty(ids.shape(), DType::int32, *host);
  std::copy(ids.host_span<std::int32_t>().begin(), ids.host_span<std::int32_t>().end(), copy.host_span<std::int32_t>().begin());
  copy.host_span<std::int32_t>().back() = value;
  return copy;
}

std::vector<float> host_values(Tensor const& t, mgpu::Stream& stream) {
  std::shared_ptr<mgpu::Allocator> const host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  Tensor const copy = Tensor::empty(t.shape(), t.dtype(), *host);
  mgpu::copy_async(copy, t, stream);
  stream.synchronize();
  auto const span = copy.host_span<float>();
  return {span.begin(), span.end()};
}

// `count` batches of int32 token ids and their targets [rows, 8], each below `vocab`, drawn from `seed`.
struct TokenBatches {
  std::vector<Tensor> xs, ys;
};
TokenBatches token_batches(int count, std::int64_t rows, unsigned vocab, unsigned seed) {
  std::shared_ptr<mgpu::Allocator> const host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  std::mt19937 rng(seed);
  TokenBatches out;
  for (int b = 0; b < count; ++b) {
    for (auto* list : {&out.xs, &out.ys}) {
      list->push_back(Tensor::empty({rows, 8}, DType::int32, *host));
      for (std::int32_t& v : list->back().host_span<std::int32_t>()) v = static_cast<std::int32_t>(rng() % vocab);
    }
  }
  return out;
}

// The whole model's float32 weights as `executor` and `reference` gather them (gather_parameters()).
struct Gathered {
  std::vector<float> got, want;
};
Gathered gather_both(mgpu::pipeline::Executor& executor, mgpu::pipeline::Executor& reference, mgpu::nn::Sequential const& model) {
  std::shared_ptr<mgpu::Allocator> const host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  mgpu::Stream stream{mgpu::Device{mgpu::DeviceKind::host, 0}};
  mgpu::nn::Sequential whole = model.clone(), whole_reference = model.clone();
  mgpu::nn::Context ctx{*host, stream};
  whole.materialize(ctx, 1);
  whole_reference.materialize(ctx, 2);
  executor.gather_parameters(whole, stream);
  reference.gather_parameters(whole_reference, stream);
  return {host_values(whole.master_parameters(), stream), host_values(whole_reference.master_parameters(), stream)};
}

// AdamW for each pipeline chunk, decaying the chunk's weight matrices.
mgpu::pipeline::ChunkOptimizerFactory const chunk_adamw = [](mgpu::nn::Sequential const& chunk) {
  return std::make_unique<mgpu::optim::AdamW>(
      mgpu::optim::AdamWOptions{.lr = 0.01f, .weight_decay = 0.1f, .decay_ranges = chunk.matrix_ranges()});
};

// Whether `have` and `want` hold the same bits.
bool same_bits(std::vector<float> const& have, std::vector<float> const& want) {
  return have.size() == want.size() &&
         (have.empty() || std::memcmp(have.data(), want.data(), have.size() * sizeof(float)) == 0);
}

// Expects `call` to throw Error(invalid_argument) whose text has `needle`.
template <class Call>
void expect_refused(Call const& call, std::string const& needle, std::string const& what) {
  try {
    call();
    EXPECT(false, what << " was accepted");
  } catch (mgpu::Error const& e) {
    EXPECT(e.category() == mgpu::Errc::invalid_argument && std::string(e.what()).find(needle) != std::string::npos,
           what << ": " << e.what() << " (expected invalid_argument with '" << needle << "')");
  }
}

// Whether `have` is within `tolerance` (relative, per element) of `want`, or the same bits.
bool close_to(std::vector<float> const& have, std::vector<float> const& want, double tolerance) {
  if (tolerance == 0) return same_bits(have, want);
  if (have.size() != want.size()) return false;
  for (std::size_t i = 0; i < have.size(); ++i)
    if (!(std::abs(static_cast<double>(have[i]) - want[i]) <= tolerance * (1 + std::abs(want[i])))) return false;
  return true;
}

// The largest difference between `have` and `want` relative to 1 + |want| (infinity for other sizes).
double worst_difference(std::vector<float> const& have, std::vector<float> const& want) {
  if (have.size() != want.size()) return std::numeric_limits<double>::infinity();
  double worst = 0;
  for (std::size_t i = 0; i < have.size(); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(have[i]) - want[i]) / (1 + std::abs(want[i])));
  return worst;
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
    for (std::int64_t i = 0; i < n; ++i) {
      Reference ref{0, 0};
      for (int q = r % 2; q < w; q += 2) {
        ref.value += input(seed, q, i, DType::float32);
        ref.magnitude += std::abs(input(seed, q, i, DType::float32));
      }
      double const got = load(mine[static_cast<std::size_t>(l)], i);
      EXPECT(close(got, ref, DType::float32),
             "all_reduce over the ranks of rank " << r << "'s parity [" << i << "] = " << got << ", reference " << ref.value);
      Reference const whole = reference(ReduceOp::sum, seed + 1, w, i, DType::float32);
      EXPECT(close(load(all[static_cast<std::size_t>(l)], i), whole, DType::float32),
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

// DataParallel across the processes, each passing its rows of every global batch (those of its
// ranks in the reference's even split, so that every rank's shard is the same), against the
// reference over world.size() devices of this process.
void test_data_parallel(Setup const& s) {
  std::shared_ptr<mgpu::Allocator> host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  std::int64_t const rows = 29;  // uneven shards
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0, 1);
  std::vector<Tensor> xs, ys;
  for (int b = 0; b < 3; ++b) {
    xs.push_back(Tensor::empty({rows, 6}, DType::float32, *host));
    for (float& v : xs.back().host_span<float>()) v = normal(rng);
    ys.push_back(Tensor::empty({rows}, DType::float32, *host));
    for (float& v : ys.back().host_span<float>()) v = static_cast<float>(rng() % 4);
  }
  std::vector<std::int64_t> const shards = mgpu::shard_sizes(rows, s.size());
  std::int64_t begin = 0;
  for (int r = 0; r < s.rank(0); ++r) begin += shards[static_cast<std::size_t>(r)];
  std::int64_t end = begin;
  for (int l = 0; l < s.local(); ++l) end += shards[static_cast<std::size_t>(s.rank(l))];
  bool const one_each = s.world.processes == s.size();
  struct Config {
    bool overlap;
    int zero_stage;
    bool dropout;
    float clip_norm;  // the sharded update then sums each rank's squares over the world
    bool hook;        // bf16 compression
  };
  for (Config const c : {Config{true, 1, false, 0, false}, Config{false, 1, true, 0, false}, Config{true, 0, true, 0, false},
                         Config{true, 1, false, 0.5f, false}, Config{true, 2, true, 0.5f, false}, Config{true, 3, false, 0, false},
                         Config{true, 3, true, 0.5f, false}, Config{true, 0, false, 0, true}, Config{true, 1, true, 0.5f, true}}) {
    std::string const what = std::string("data_parallel overlap ") + (c.overlap ? "on" : "off") + ", zero_stage " +
                             std::to_string(c.zero_stage) + (c.dropout ? ", dropout" : "") +
                             (c.clip_norm > 0 ? ", clipping" : "") + (c.hook ? ", bf16 compression" : "");
    mgpu::parallel::DataParallelOptions options;
    options.bucket_cap_bytes = options.first_bucket_cap_bytes = 4;  // a bucket per layer
    options.overlap = c.overlap;
    options.zero_stage = c.zero_stage;
    options.clip_norm = c.clip_norm;
    if (c.hook) options.comm_hook = std::make_shared<mgpu::parallel::Bf16Compression>();
    options.comm.timeout = 60s;
    mgpu::optim::AdamW const adamw(mgpu::optim::AdamWOptions{.lr = 0.01f});
    mgpu::DeviceGroup one("host:" + std::to_string(s.size()));
    mgpu::parallel::DataParallel reference(dp_model(c.dropout), one, adamw, options);
    options.make_communicator = mgpu::dist::communicator_factory(s.world);
    if (c.hook) options.comm_hook = std::make_shared<mgpu::parallel::Bf16Compression>();  // its own residuals
    // Several devices in a process sum their bfloat16 buckets in the process first: another rounding.
    float const tolerance = c.hook ? 1e-3f : 1e-5f;
    mgpu::parallel::DataParallel dp(dp_model(c.dropout), s.group, adamw, options);
    EXPECT(dp.buckets().size() == 3, what << ": " << dp.buckets().size() << " buckets (expected 3)");
    for (std::size_t b = 0; b < xs.size(); ++b) {
      float const expected = reference.step(xs[b], ys[b]).loss;
      mgpu::parallel::DataParallelResult const got = dp.step(xs[b].slice(begin, end), ys[b].slice(begin, end));
      EXPECT(one_each ? got.loss == expected : std::abs(got.loss - expected) <= tolerance * std::abs(expected),
             what << ": step " << b << " loss " << got.loss << " (expected " << expected << ")");
      for (int l = 0; l < s.local(); ++l)
        EXPECT(got.rows[static_cast<std::size_t>(l)] == shards[static_cast<std::size_t>(s.rank(l))],
               what << ": rank " << s.rank(l) << " had " << got.rows[static_cast<std::size_t>(l)] << " rows");
    }
    std::vector<float> const want = host_values(reference.replica(0).master_parameters(), one.stream(0));
    for (int l = 0; l < s.local(); ++l) {
      std::vector<float> const have = host_values(dp.replica(l).master_parameters(), s.group.stream(l));
      double worst = 0;
      bool bitwise = have.size() == want.size();
      for (std::size_t i = 0; bitwise && i < have.size(); ++i) {
        bitwise = std::memcmp(&have[i], &want[i], sizeof(float)) == 0;
      }
      for (std::size_t i = 0; i < std::min(have.size(), want.size()); ++i)
        worst = std::max(worst, std::abs(static_cast<double>(have[i]) - want[i]) / (1 + std::abs(want[i])));
      EXPECT(one_each ? bitwise : worst <= tolerance, what << ": rank " << s.rank(l)
                                                      << "'s parameters differ from one process's by " << worst
                                                      << (one_each ? " (expected the same bits)" : ""));
    }
  }
  {
    // A bad label in the last process's rows (class 7 of 4): every process refuses the step at
    // once, that process naming the label, the others that process, and the run then goes on as
    // one process's that never saw the bad step (dropout on, so a moved RNG would show).
    std::string const what = "data_parallel: a bad label in the last process's rows";
    mgpu::parallel::DataParallelOptions options;
    options.comm.timeout = 60s;
    mgpu::optim::AdamW const adamw(mgpu::optim::AdamWOptions{.lr = 0.01f});
    mgpu::DeviceGroup one("host:" + std::to_string(s.size()));
    mgpu::parallel::DataParallel reference(dp_model(true), one, adamw, options);
    options.make_communicator = mgpu::dist::communicator_factory(s.world);
    mgpu::parallel::DataParallel dp(dp_model(true), s.group, adamw, options);
    int const bad_process = s.world.processes - 1;
    Tensor const labels = Tensor::empty({end - begin}, DType::float32, *host);
    std::copy(ys[0].host_span<float>().begin() + begin, ys[0].host_span<float>().begin() + end, labels.host_span<float>().begin());
    if (process == bad_process) labels.host_span<float>()[0] = 7;
    auto const start = std::chrono::steady_clock::now();
    std::string const needle = process == bad_process ? "label 7.000000 at row 0 (expected a class id in [0, 4))"
                                                      : "refused its part of the batch";
    expect_refused([&] { (void)dp.step(xs[0].slice(begin, end), labels); }, needle, what);
    double const waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT(waited < 10, what << ": refused after " << waited << " s (expected at once, not at the 60 s deadline)");
    for (std::size_t b = 0; b < xs.size(); ++b) {
      float const expected = reference.step(xs[b], ys[b]).loss;
      float const got = dp.step(xs[b].slice(begin, end), ys[b].slice(begin, end)).loss;
      EXPECT(one_each ? got == expected : std::abs(got - expected) <= 1e-5f * std::abs(expected),
             what << ": step " << b << " loss " << got << " (expected " << expected << ")");
    }
  }
  {
    // Rebalancing across processes: a cost model makes each rank of process p take p + 1 ms per
    // row. Before any step process_rows() splits by the weights given (the device counts), after
    // one by the measured speeds (process p: its devices / (p + 1)), the same on every process;
    // the run follows one process's losses whichever processes hold the rows.
    std::string const what = "data_parallel rebalancing across processes";
    mgpu::parallel::DataParallelOptions options;
    options.comm.timeout = 60s;
    mgpu::optim::AdamW const adamw(mgpu::optim::AdamWOptions{.lr = 0.01f});
    mgpu::DeviceGroup one("host:" + std::to_string(s.size()));
    mgpu::parallel::DataParallel reference(dp_model(false), one, adamw, options);
    options.make_communicator = mgpu::dist::communicator_factory(s.world);
    options.rebalance = true;
    options.rebalance_ewma = 1;
    options.rebalance_time = [p = process](int, std::int64_t shard_rows, double) {
      return static_cast<double>(shard_rows) * (p + 1);
    };
    mgpu::parallel::DataParallel dp(dp_model(false), s.group, adamw, options);
    std::vector<double> devices, speeds;
    for (int p = 0; p < s.world.processes; ++p) {
      devices.push_back(s.world.local_size(p));
      speeds.push_back(s.world.local_size(p) / (p + 1.0));
    }
    for (std::size_t b = 0; b < xs.size(); ++b) {
      std::vector<std::int64_t> const split = dp.process_rows(rows, devices);
      std::vector<std::int64_t> const want = mgpu::shard_sizes(rows, s.world.processes, b == 0 ? devices : speeds);
      EXPECT(split == want, what << ": step " << b << ": process " << process << " was given "
                                 << split[static_cast<std::size_t>(process)] << " rows (expected "
                                 << want[static_cast<std::size_t>(process)] << ")");
      std::int64_t first = 0;
      for (int p = 0; p < process; ++p) first += split[static_cast<std::size_t>(p)];
      std::int64_t const last = first + split[static_cast<std::size_t>(process)];
      float const expected = reference.step(xs[b], ys[b]).loss;
      float const got = dp.step(xs[b].slice(first, last), ys[b].slice(first, last)).loss;
      EXPECT(std::abs(got - expected) <= 1e-5f * std::abs(expected),
             what << ": step " << b << " loss " << got << " (expected " << expected << ")");
    }
    EXPECT(close_to(host_values(dp.replica(0).master_parameters(), s.group.stream(0)),
                    host_values(reference.replica(0).master_parameters(), one.stream(0)), 1e-5),
           what << ": the parameters differ from one process's");
    expect_refused([&] { (void)dp.process_rows(rows, {1.0}); }, "one per process", what + ": one weight");
  }
  // Not across processes: the scheduler's choice of ranks (a request), refused with the reason.
  mgpu::parallel::DataParallelOptions options;
  options.make_communicator = mgpu::dist::communicator_factory(s.world);
  options.request = mgpu::sched::Request{};
  expect_refused([&] { mgpu::parallel::DataParallel dp(dp_model(false), s.group, mgpu::optim::SGD(mgpu::optim::SgdOptions{}), options); },
                 "spans every device of every process", "a request across processes");
}

// DataParallel::save() across the processes mid-run into `folder` (the same on every process), and
// load() of it: resumed across the processes, and in one process over 3 devices, against an
// uninterrupted run over world.size() devices of this process; the same bits with one device per
// process (the same ranks and layout), within float32 tolerance otherwise. With the sharded update
// (each process writes its ranks' optimizer state) and without (process 0 writes it whole). Then a
// save mid accumulation cycle is refused, and a damaged shard names its file.
void test_checkpoint(Setup const& s, std::filesystem::path const& folder) {
  std::shared_ptr<mgpu::Allocator> host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  if (process == 0) std::filesystem::remove_all(folder);  // before any process writes (save() agrees first)
  std::int64_t const rows = 29;
  int const steps = 5;
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0, 1);
  std::vector<Tensor> xs, ys;
  for (int b = 0; b < steps; ++b) {
    xs.push_back(Tensor::empty({rows, 6}, DType::float32, *host));
    for (float& v : xs.back().host_span<float>()) v = normal(rng);
    ys.push_back(Tensor::empty({rows}, DType::float32, *host));
    for (float& v : ys.back().host_span<float>()) v = static_cast<float>(rng() % 4);
  }
  std::vector<std::int64_t> const shards = mgpu::shard_sizes(rows, s.size());
  std::int64_t begin = 0;
  for (int r = 0; r < s.rank(0); ++r) begin += shards[static_cast<std::size_t>(r)];
  std::int64_t end = begin;
  for (int l = 0; l < s.local(); ++l) end += shards[static_cast<std::size_t>(s.rank(l))];
  mgpu::optim::AdamW const adamw(mgpu::optim::AdamWOptions{.lr = 0.01f});
  struct Config {
    int zero_stage;
    int accumulation;  // 2: saved mid-cycle, each rank's accumulated gradients in the folder
    bool hook;         // bf16 compression: each rank's residuals in the folder
  };
  for (Config const c : {Config{1, 1, false}, Config{0, 1, false}, Config{1, 2, false}, Config{0, 1, true}}) {
    int const saved_at = c.accumulation == 2 ? 3 : 2;
    // 0: the same bits (one device per process); a process summing its devices' bfloat16 buckets
    // first rounds once more.
    double const across = s.world.processes == s.size() ? 0 : c.hook ? 1e-3 : 1e-5;
    mgpu::io::TrainingState const position{.step = saved_at, .epoch = 1, .batch = saved_at, .data_seed = 77};
    std::string const what = "checkpoint, zero_stage " + std::to_string(c.zero_stage) +
                             (c.accumulation > 1 ? ", saved mid accumulation cycle" : "") + (c.hook ? ", bf16 compression" : "");
    mgpu::parallel::DataParallelOptions options;
    options.bucket_cap_bytes = options.first_bucket_cap_bytes = 4;  // a bucket per layer
    options.zero_stage = c.zero_stage;
    options.accumulation_steps = c.accumulation;
    options.comm.timeout = 60s;
    auto const hook = [&] {  // each executor its own residuals
      options.comm_hook = c.hook ? std::make_shared<mgpu::parallel::Bf16Compression>() : nullptr;
      return options;
    };
    mgpu::DeviceGroup one("host:" + std::to_string(s.size()));
    mgpu::parallel::DataParallel reference(dp_model(true), one, adamw, hook());
    std::vector<float> losses;
    for (int b = 0; b < steps; ++b)
      losses.push_back(reference.step(xs[static_cast<std::size_t>(b)], ys[static_cast<std::size_t>(b)]).loss);
    std::vector<float> const want = host_values(reference.replica(0).master_parameters(), one.stream(0));
    // `dp` from step `from` on (its part of each batch: `first` to `last` rows) against the reference.
    auto const finish = [&](mgpu::parallel::DataParallel& dp, mgpu::DeviceGroup& group, int from, std::int64_t first,
                            std::int64_t last, double tolerance, std::string const& run) {
      for (int b = from; b < steps; ++b) {
        auto const u = static_cast<std::size_t>(b);
        float const loss = dp.step(xs[u].slice(first, last), ys[u].slice(first, last)).loss;
        EXPECT(close_to({loss}, {losses[u]}, tolerance),
               what << ", " << run << ": step " << b << " loss " << loss << " (expected " << losses[u] << ")");
      }
      for (int l = 0; l < group.size(); ++l)
        EXPECT(close_to(host_values(dp.replica(l).master_parameters(), group.stream(l)), want, tolerance),
               what << ", " << run << ": replica " << l << "'s parameters differ from the uninterrupted run's");
    };
    options.make_communicator = mgpu::dist::communicator_factory(s.world);
    {
      mgpu::parallel::DataParallel dp(dp_model(true), s.group, adamw, hook());
      for (int b = 0; b < saved_at; ++b)
        dp.step(xs[static_cast<std::size_t>(b)].slice(begin, end), ys[static_cast<std::size_t>(b)].slice(begin, end));
      dp.save(folder, position);
      finish(dp, s.group, saved_at, begin, end, across, "the run that saved");
    }
    mgpu::io::ShardedCheckpoint const written = mgpu::io::ShardedCheckpoint::load(folder);
    std::size_t const split = 2 + (c.accumulation > 1 ? 1 : 0) + (c.hook ? 1 : 0);
    EXPECT(written.shards() == s.world.processes && written.split_names().size() == split,
           what << ": " << written.shards() << " shards, " << written.split_names().size() << " split records (expected "
                << s.world.processes << " and " << split << ": AdamW's 2 and the per-rank rows)");
    {
      mgpu::parallel::DataParallel dp(dp_model(true), s.group, adamw, hook());
      mgpu::io::TrainingState const got = dp.load(folder);
      EXPECT(got.step == position.step && got.epoch == position.epoch && got.batch == position.batch &&
                 got.data_seed == position.data_seed,
             what << ": loaded step " << got.step << ", epoch " << got.epoch << ", batch " << got.batch << ", seed "
                  << got.data_seed);
      finish(dp, s.group, saved_at, begin, end, across, "resumed across the processes");
    }
    {
      options.make_communicator = nullptr;
      mgpu::DeviceGroup three("host:3");
      mgpu::parallel::DataParallel dp(dp_model(true), three, adamw, hook());
      dp.load(folder);
      // On another device count rank 0 takes the sum of the saved residuals: bf16's rounding then.
      finish(dp, three, saved_at, 0, rows, c.hook ? 1e-3 : 1e-5, "resumed in one process on 3 devices");
    }
  }
  mgpu::parallel::DataParallelOptions options;
  options.make_communicator = mgpu::dist::communicator_factory(s.world);
  options.comm.timeout = 60s;
  options.accumulation_steps = 2;
  options.zero_stage = 2;
  {
    mgpu::parallel::DataParallel dp(dp_model(false), s.group, adamw, options);
    dp.step(xs[0].slice(begin, end), ys[0].slice(begin, end));
    expect_refused([&] { dp.save(folder, mgpu::io::TrainingState{}); }, "accumulated micro-batches",
                   "a save across processes mid-cycle at zero_stage 2");
  }
  options.zero_stage = 1;
  // Each process damages its own copy: one byte near the end of shard 0 (process 0's, which holds
  // the whole records).
  std::filesystem::path const copy = folder.string() + "-damaged-" + std::to_string(process);
  std::filesystem::remove_all(copy);
  std::filesystem::copy(folder, copy);
  mgpu::io::ShardedCheckpoint const written = mgpu::io::ShardedCheckpoint::load(folder);
  std::filesystem::path const shard = mgpu::io::shard_path(copy, written.save_id(), 0, written.shards());
  {
    std::fstream file(shard, std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(-100, std::ios::end);
    char byte = 0;
    file.read(&byte, 1);
    byte = static_cast<char>(byte ^ 0x10);
    file.seekp(-100, std::ios::end);
    file.write(&byte, 1);
  }
  options.make_communicator = nullptr;
  options.accumulation_steps = 1;
  mgpu::DeviceGroup two("host:2");
  mgpu::parallel::DataParallel dp(dp_model(true), two, adamw, options);
  try {
    dp.load(copy);
    EXPECT(false, "a damaged shard was accepted");
  } catch (mgpu::Error const& e) {
    EXPECT(e.category() == mgpu::Errc::corrupt_data &&
               std::string(e.what()).find(shard.filename().string()) != std::string::npos,
           "a damaged shard: " << e.what() << " (expected corrupt_data naming " << shard.filename().string() << ")");
  }
  std::filesystem::remove_all(copy);
}

// The pipeline executor with its stages on every process's devices (one stage per pipeline
// device; with two replicas, a data x pipeline grid whose replicas sum their gradients across
// processes) against the same executor over world.size() devices of this process: every device
// computes the same chunk from the same inputs and the replicas' sums run in the same order, so
// the losses and parameters are the same bits however the devices are spread over processes.
void test_pipeline(Setup const& s) {
  namespace pp = mgpu::pipeline;
  std::shared_ptr<mgpu::Allocator> host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  std::int64_t const rows = 26;  // uneven micro-batches
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0, 1);
  std::vector<Tensor> xs, ys;
  for (int b = 0; b < 3; ++b) {
    xs.push_back(Tensor::empty({rows, 6}, DType::float32, *host));
    for (float& v : xs.back().host_span<float>()) v = normal(rng);
    ys.push_back(Tensor::empty({rows}, DType::float32, *host));
    for (float& v : ys.back().host_span<float>()) v = static_cast<float>(rng() % 4);
  }
  pp::OptimizerFactory const sgd = [] {
    return std::make_unique<mgpu::optim::SGD>(mgpu::optim::SgdOptions{.lr = 0.05f, .momentum = 0.9f});
  };
  for (int const replicas : {1, 2}) {
    int const devices = s.size() / replicas;
    if (s.size() % replicas != 0 || devices + 1 > static_cast<int>(dp_model(false).cut_points().size()))
      continue;  // a unit per stage
    struct Config {
      bool dropout;
      float clip_norm;  // the global norm then sums every process's chunks
      bool fp16;        // float16 compute with a loss scaler, whose overflow count does too
    };
    for (Config const config : {Config{false, 0, false}, Config{true, 0.05f, false}, Config{false, 0.05f, true}}) {
      bool const dropout = config.dropout;
      mgpu::nn::Sequential const model = dp_model(dropout);
      std::vector<std::size_t> const cuts = pp::partition(model, devices, std::vector<double>(model.size(), 1.0)).cuts;
      for (pp::Schedule const& schedule : {pp::gpipe(devices, 4), pp::one_f_one_b(devices, 4)}) {
        std::string const what = "pipeline " + schedule.name + " x " + std::to_string(replicas) + " replica(s)" +
                                 (dropout ? ", dropout" : "") + (config.clip_norm > 0 ? ", clipping" : "") +
                                 (config.fp16 ? ", float16 with a loss scaler" : "");
        pp::ExecutorOptions options{.seed = 7,
                                    .data_parallel = replicas,
                                    .timeout = 60s,
                                    .compute = config.fp16 ? DType::float16 : DType::float32,
                                    .clip_norm = config.clip_norm};
        if (config.fp16) options.loss_scaler.emplace();
        mgpu::DeviceGroup one("host:" + std::to_string(s.size()));
        pp::Executor reference(model, one, cuts, schedule, sgd, options);
        options.make_communicator = mgpu::dist::communicator_factory(s.world);
        pp::Executor executor(model, s.group, cuts, schedule, sgd, options);
        for (std::size_t b = 0; b < xs.size(); ++b) {
          float const expected = reference.step(xs[b], ys[b]);
          float const got = executor.step(xs[b], ys[b]);
          EXPECT(std::memcmp(&got, &expected, sizeof got) == 0,
                 what << ": step " << b << " loss " << got << " (expected " << expected << ")");
          EXPECT(executor.last_step_applied() == reference.last_step_applied(),
                 what << ": step " << b << " applied or skipped unlike one process");
        }
        if (config.fp16)
          EXPECT(executor.loss_scaler()->state().scale == reference.loss_scaler()->state().scale,
                 what << ": the loss scale differs");
        for (int l = 0; l < s.local(); ++l) {
          int const c = s.rank(l) % devices;  // one chunk per device
          int const replica = s.rank(l) / devices;
          bool const same = same_bits(host_values(executor.chunk(c, replica).master_parameters(), s.group.stream(l)),
                                      host_values(reference.chunk(c, replica).master_parameters(), one.stream(0)));
          EXPECT(same, what << ": chunk " << c << " of replica " << replica << " on world rank " << s.rank(l)
                            << " differs from one process's");
        }
        Gathered const weights = gather_both(executor, reference, model);
        EXPECT(same_bits(weights.got, weights.want), what << ": gather_parameters differs from one process's");
        int const remote = s.rank(0) == 0 ? s.size() - 1 : 0;
        expect_refused([&] { static_cast<void>(executor.chunk(remote % devices, remote / devices)); },
                       "another process", what + ": chunk of another process");
      }
    }
  }
  // A grid that is not the world's devices.
  mgpu::nn::Sequential const model = dp_model(false);
  pp::ExecutorOptions options{
      .seed = 7, .timeout = 60s, .make_communicator = mgpu::dist::communicator_factory(s.world)};
  std::vector<std::size_t> const all{0, model.size()};
  expect_refused([&] { pp::Executor(model, s.group, all, pp::gpipe(1, 2), sgd, options); },
                 "a world of " + std::to_string(s.size()), "a one-device pipeline over the world");
  // The processes past world rank 0 would run no stage: each of them names itself.
  std::string const idle = "this process, whose devices are world ranks [" + std::to_string(s.rank(0)) + ", " +
                           std::to_string(s.rank(0) + s.local()) + "), would run no stage";
  try {
    pp::Executor executor(model, s.group, all, pp::gpipe(1, 2), sgd, options);
    EXPECT(false, "a one-device pipeline over the world was accepted");
  } catch (mgpu::Error const& e) {
    bool const named = std::string(e.what()).find(idle) != std::string::npos;
    EXPECT(named == (s.rank(0) > 0), "a one-device pipeline over the world: " << e.what());
  }
}

// A data x tensor x pipeline grid over the world's devices (every process passing the whole
// batch) against the same grid in one process over as many devices: a GPT with dropout, its tied
// LM head in the last stage, 6 clipped AdamW steps, 1F1B over 2 stages (one stage over 2
// devices), tensor parallelism over 2 ranks, with 2 data-parallel replicas over 8 devices. The
// losses and gather_parameters() within 1e-5 of one process's (the tensor-parallel sums combine
// in another order when their ranks are in different processes, the clipping norm's too).
void test_tensor_parallel_pipeline(Setup const& s) {
  namespace pp = mgpu::pipeline;
  if (s.size() != 2 && s.size() != 4 && s.size() != 8) {
    std::fprintf(stderr, "usage: mpi_dist tensor_parallel_pipeline COUNTS (2, 4 or 8 devices in all)\n");
    std::exit(2);
  }
  std::shared_ptr<mgpu::Allocator> host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  mgpu::Stream host_stream{mgpu::Device{mgpu::DeviceKind::host, 0}};
  mgpu::nn::GptConfig const config{.vocab = 33, .block_size = 8, .n_layer = 2, .n_head = 2, .n_embd = 16, .dropout = 0.1f};
  mgpu::nn::Sequential const model = mgpu::nn::gpt(config);
  TokenBatches const batches = token_batches(6, 8, 33, 12);
  std::vector<Tensor> const& xs = batches.xs;
  std::vector<Tensor> const& ys = batches.ys;
  pp::ChunkOptimizerFactory const& adamw = chunk_adamw;
  int const replicas = s.size() == 8 ? 2 : 1;
  int const devices = s.size() / (2 * replicas);
  std::vector<std::size_t> const cuts = pp::partition(model, devices, std::vector<double>(model.size(), 1.0)).cuts;
  for (bool const sequence_parallel : {false, true}) {
    std::string const what = "pipeline of " + std::to_string(devices) + " stage(s) x tensor parallel 2 x " +
                             std::to_string(replicas) + " replica(s)" + (sequence_parallel ? ", sequence parallel" : "");
    pp::ExecutorOptions options{.seed = 5,
                                .data_parallel = replicas,
                                .timeout = 60s,
                                .clip_norm = 0.1f,
                                .tensor_parallel = pp::tensor_parallel_stages(config, 2, sequence_parallel)};
    mgpu::DeviceGroup one("host:" + std::to_string(s.size()));
    pp::Executor reference(model, one, cuts, pp::one_f_one_b(devices, 2), adamw, options);
    options.make_communicator = mgpu::dist::communicator_factory(s.world);
    options.make_subset_communicator = mgpu::dist::subset_communicator_factory(s.world);
    pp::Executor executor(model, s.group, cuts, pp::one_f_one_b(devices, 2), adamw, options);
    // A bad id is refused by every process before any action; the run below then follows the reference.
    expect_refused([&] { (void)executor.step(with_last_id(xs[0], -1), ys[0]); }, "token id -1 at row 7, position 7 of the batch",
                   what + ": a negative id");
    for (std::size_t b = 0; b < xs.size(); ++b) {
      float const expected = reference.step(xs[b], ys[b]);
      float const got = executor.step(xs[b], ys[b]);
      EXPECT(close_to({got}, {expected}, 1e-5), what << ": step " << b << " loss " << got << " (expected " << expected << ")");
    }
    Gathered const weights = gather_both(executor, reference, model);
    EXPECT(close_to(weights.got, weights.want, 1e-5), what << ": gather_parameters differs from one process's");
    // The reference's weights scattered into the shards across the processes gather back unchanged.
    mgpu::nn::Sequential whole = model.clone();
    mgpu::nn::Context ctx{*host, host_stream};
    whole.materialize(ctx, 1);
    reference.gather_parameters(whole, host_stream);
    executor.scatter_parameters(whole, host_stream);
    EXPECT(same_bits(gather_both(executor, reference, model).got, weights.want),
           what << ": scatter_parameters then gather_parameters changed the weights");
  }
  pp::ExecutorOptions options{.timeout = 60s,
                              .tensor_parallel = pp::tensor_parallel_stages(config, 2),
                              .make_communicator = mgpu::dist::communicator_factory(s.world)};
  options.data_parallel = replicas;
  expect_refused([&] { pp::Executor(model, s.group, cuts, pp::one_f_one_b(devices, 2), adamw, options); },
                 "without make_subset_communicator", "tensor-parallel stages across processes without a subset factory");
}

// Whether reductions over the world ranks `ranks` combine in the same order across processes as
// in one process: the ranks are all in one process, or each in its own.
bool same_order(mgpu::dist::World const& world, std::vector<int> const& ranks) {
  std::vector<int> processes;
  for (int const r : ranks) processes.push_back(world.devices[static_cast<std::size_t>(r)].process);
  std::sort(processes.begin(), processes.end());
  bool const one = processes.front() == processes.back();
  return one || std::adjacent_find(processes.begin(), processes.end()) == processes.end();
}

// parallel::TensorParallel with its A x T grid over the world's devices (each process passing the
// whole batch) against one over as many devices in one process, which every process runs itself:
// 12 AdamW steps with clipping, tensor parallelism alone or with 2 data-parallel replicas,
// sequence parallelism and dropout once each. The losses, this process's shards and
// gather_parameters() on every process are the same bits when every tensor- and data-parallel
// group lies in one process or has one rank in each (their reductions then combine in the same
// order), else the losses within 1e-5 and the weights within 1e-4.
void test_tensor_parallel(Setup const& s) {
  namespace par = mgpu::parallel;
  std::shared_ptr<mgpu::Allocator> host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  TokenBatches const batches = token_batches(12, 5, 32, 11);  // 5 rows: uneven over 2 replicas
  std::vector<Tensor> const& xs = batches.xs;
  std::vector<Tensor> const& ys = batches.ys;
  struct Layout {
    int replicas;
    bool sequence_parallel;
    float dropout;
  };
  for (Layout const c : {Layout{1, false, 0.0f}, Layout{1, true, 0.1f}, Layout{2, false, 0.0f}, Layout{2, true, 0.0f}}) {
    int const t_ranks = s.size() / c.replicas;
    if (s.size() % c.replicas != 0 || t_ranks < 2 || 4 % t_ranks != 0) continue;  // T divides the 4 heads
    mgpu::nn::GptConfig const config{
        .vocab = 32, .block_size = 8, .n_layer = 2, .n_head = 4, .n_embd = 16, .dropout = c.dropout};
    bool bitwise = true;
    for (int a = 0; a < c.replicas; ++a) {
      std::vector<int> group;
      for (int t = 0; t < t_ranks; ++t) group.push_back(a * t_ranks + t);
      bitwise = bitwise && same_order(s.world, group);
    }
    for (int t = 0; t < t_ranks; ++t) {
      std::vector<int> replicas;
      for (int a = 0; a < c.replicas; ++a) replicas.push_back(a * t_ranks + t);
      bitwise = bitwise && same_order(s.world, replicas);
    }
    std::string const what = "tensor parallel " + std::to_string(c.replicas) + " x " + std::to_string(t_ranks) +
                             (c.sequence_parallel ? ", sequence parallel" : "") + (c.dropout > 0 ? ", dropout" : "");
    par::TensorParallelOptions options{.seed = 5,
                                       .adamw = {.lr = 0.01f, .weight_decay = 0.1f},
                                       .clip_norm = 0.1f,
                                       .data_parallel = c.replicas,
                                       .sequence_parallel = c.sequence_parallel,
                                       .comm = {.timeout = 60s}};
    mgpu::DeviceGroup one("host:" + std::to_string(s.size()));
    par::TensorParallel reference(one, config, options);
    options.make_communicator = mgpu::dist::communicator_factory(s.world);
    options.make_subset_communicator = mgpu::dist::subset_communicator_factory(s.world);
    par::TensorParallel tp(s.group, config, options);
    EXPECT(tp.size() == s.size() && tp.data_parallel() == c.replicas && tp.tensor_parallel() == t_ranks,
           what << ": a grid of " << tp.data_parallel() << " x " << tp.tensor_parallel());
    // A bad id is refused by every process before any work; the run below then follows the reference.
    expect_refused([&] { (void)tp.step(with_last_id(xs[0], 32), ys[0]); }, "token id 32 at row 4, position 7 of the batch",
                   what + ": an id of the vocab's size");
    for (std::size_t b = 0; b < xs.size(); ++b) {
      double const want = reference.step(xs[b], ys[b]).loss;
      double const got = tp.step(xs[b], ys[b]).loss;
      EXPECT(bitwise ? got == want : std::abs(got - want) <= 1e-5 * std::abs(want),
             what << ": step " << b << " loss " << got << " (expected " << want << ")");
    }
    // Reductions in another order: the weights drift apart by about 1e-5 over the 12 AdamW steps
    // (its normalized step magnifies differences in small gradients), the losses much less.
    double const tolerance = bitwise ? 0 : 1e-4;
    for (int l = 0; l < s.local(); ++l) {
      std::vector<float> const have = host_values(tp.shard(l).master_parameters(), s.group.stream(l));
      std::vector<float> const want = host_values(reference.shard(s.rank(l)).master_parameters(), one.stream(s.rank(l)));
      EXPECT(close_to(have, want, tolerance), what << ": world rank " << s.rank(l) << "'s shard differs from one process's by "
                                                   << worst_difference(have, want));
    }
    std::vector<float> const have = tp.gather_parameters();
    std::vector<float> const want = reference.gather_parameters();
    EXPECT(close_to(have, want, tolerance),
           what << ": gather_parameters differs from one process's by " << worst_difference(have, want));
  }
  if (s.size() % 2 == 0) {
    par::TensorParallelOptions options{.data_parallel = 2, .make_communicator = mgpu::dist::communicator_factory(s.world)};
    expect_refused([&] { par::TensorParallel(s.group, mgpu::nn::GptConfig{.vocab = 32, .block_size = 8, .n_layer = 1, .n_head = 4, .n_embd = 16}, options); },
                   "without make_subset_communicator", "data_parallel 2 across processes without the subset factory");
  }
}

// A step that runs out of memory in the last process (its first device's memory limited, a batch
// 16 times larger) fails on every process, the others at their 3 s deadline at the latest; each
// process makes its communicators anew and the run goes on as one process's that never saw it:
// DataParallel (each process its rows), a GPT pipeline over the world's devices and TensorParallel
// over them. Each executor on a group of its own, since a failing rank aborts every communicator
// over its group.
void test_failure(Setup const& s) {
  namespace pp = mgpu::pipeline;
  namespace par = mgpu::parallel;
  std::shared_ptr<mgpu::Allocator> host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  bool const failing = process == s.world.processes - 1;
  std::string const devices = "host:" + std::to_string(s.local());
  // Runs `fail` (a step that must fail, out of memory in the failing process) with the failing
  // process's `limited` allocator at its current use plus a little.
  auto const expect_failed_step = [&](mgpu::Allocator& limited, std::string const& what, auto const& fail) {
    if (failing) limited.set_limit(limited.stats().reserved + (std::size_t{16} << 10));
    try {
      fail();
      EXPECT(false, what << ": the step did not fail");
    } catch (mgpu::Error const& e) {
      EXPECT(!failing || e.category() == mgpu::Errc::out_of_memory, what << ": " << e.what() << " (expected out_of_memory)");
    }
    if (failing) limited.set_limit(std::nullopt);
  };
  {
    std::string const what = "data_parallel";
    std::int64_t const rows = 29;
    std::mt19937 rng(9);
    std::normal_distribution<float> normal(0, 1);
    auto const random = [&](std::int64_t n, bool labels) {
      Tensor t = labels ? Tensor::empty({n}, DType::float32, *host) : Tensor::empty({n, 6}, DType::float32, *host);
      for (float& v : t.host_span<float>()) v = labels ? static_cast<float>(rng() % 4) : normal(rng);
      return t;
    };
    std::vector<Tensor> xs, ys;
    for (int b = 0; b < 3; ++b) {
      xs.push_back(random(rows, false));
      ys.push_back(random(rows, true));
    }
    std::vector<std::int64_t> const shards = mgpu::shard_sizes(rows, s.size());
    std::int64_t begin = 0;
    for (int r = 0; r < s.rank(0); ++r) begin += shards[static_cast<std::size_t>(r)];
    std::int64_t end = begin;
    for (int l = 0; l < s.local(); ++l) end += shards[static_cast<std::size_t>(s.rank(l))];
    Tensor const big_x = random(16 * (end - begin), false);
    Tensor const big_y = random(16 * (end - begin), true);
    mgpu::DeviceGroup own(devices);
    mgpu::parallel::DataParallelOptions options;
    options.comm.timeout = 3s;
    mgpu::optim::AdamW const adamw(mgpu::optim::AdamWOptions{.lr = 0.01f});
    mgpu::DeviceGroup one("host:" + std::to_string(s.size()));
    mgpu::parallel::DataParallel reference(dp_model(true), one, adamw, options);
    options.make_communicator = mgpu::dist::communicator_factory(s.world);
    mgpu::parallel::DataParallel dp(dp_model(true), own, adamw, options);
    auto const good_step = [&](std::size_t b) {
      float const expected = reference.step(xs[b], ys[b]).loss;
      float const got = dp.step(xs[b].slice(begin, end), ys[b].slice(begin, end)).loss;
      EXPECT(std::abs(got - expected) <= 1e-5f * std::abs(expected), what << ": step " << b << " loss " << got << " (expected " << expected << ")");
    };
    good_step(0);
    expect_failed_step(own.allocator(0), what, [&] {
      (void)(failing ? dp.step(big_x, big_y) : dp.step(xs[1].slice(begin, end), ys[1].slice(begin, end)));
    });
    for (std::size_t b = 1; b < xs.size(); ++b) good_step(b);
  }
  mgpu::nn::GptConfig const config{.vocab = 32, .block_size = 8, .n_layer = 2, .n_head = 2, .n_embd = 16, .dropout = 0.1f};
  TokenBatches const batches = token_batches(3, 4, 32, 21);
  TokenBatches const big = token_batches(1, 64, 32, 22);
  if (s.size() >= 2) {
    std::string const what = "GPT pipeline";
    mgpu::nn::Sequential const model = mgpu::nn::gpt(config);
    std::vector<std::size_t> const cuts = pp::partition(model, s.size(), std::vector<double>(model.size(), 1.0)).cuts;
    pp::ExecutorOptions options{.seed = 5, .timeout = 3s, .clip_norm = 0.1f, .loss = std::make_shared<mgpu::nn::TokenCrossEntropy>()};
    mgpu::DeviceGroup one("host:" + std::to_string(s.size()));
    pp::Executor reference(model, one, cuts, pp::one_f_one_b(s.size(), 2), chunk_adamw, options);
    options.make_communicator = mgpu::dist::communicator_factory(s.world);
    mgpu::DeviceGroup own(devices);
    pp::Executor executor(model, own, cuts, pp::one_f_one_b(s.size(), 2), chunk_adamw, options);
    auto const good_step = [&](std::size_t b) {
      float const expected = reference.step(batches.xs[b], batches.ys[b]);
      float const got = executor.step(batches.xs[b], batches.ys[b]);
      EXPECT(std::memcmp(&got, &expected, sizeof got) == 0, what << ": step " << b << " loss " << got << " (expected " << expected << ")");
    };
    good_step(0);
    expect_failed_step(own.allocator(0), what, [&] { (void)executor.step(big.xs[0], big.ys[0]); });
    for (std::size_t b = 1; b < batches.xs.size(); ++b) good_step(b);
  }
  if (s.size() == 2 || s.size() == 4) {  // ranks dividing the heads
    mgpu::nn::GptConfig tp_config = config;
    tp_config.n_head = 4;
    std::string const what = "tensor parallel";
    par::TensorParallelOptions options{.seed = 5, .adamw = {.lr = 0.01f}, .comm = {.timeout = 3s}};
    mgpu::DeviceGroup one("host:" + std::to_string(s.size()));
    par::TensorParallel reference(one, tp_config, options);
    options.make_communicator = mgpu::dist::communicator_factory(s.world);
    options.make_subset_communicator = mgpu::dist::subset_communicator_factory(s.world);
    mgpu::DeviceGroup own(devices);
    par::TensorParallel tp(own, tp_config, options);
    auto const good_step = [&](std::size_t b) {
      double const expected = reference.step(batches.xs[b], batches.ys[b]).loss;
      double const got = tp.step(batches.xs[b], batches.ys[b]).loss;
      EXPECT(std::abs(got - expected) <= 1e-5 * std::abs(expected), what << ": step " << b << " loss " << got << " (expected " << expected << ")");
    };
    good_step(0);
    expect_failed_step(own.allocator(0), what, [&] { (void)tp.step(big.xs[0], big.ys[0]); });
    for (std::size_t b = 1; b < batches.xs.size(); ++b) good_step(b);
  }
}

// A GPT pipelined over the world's devices (its tied LM head's copy of wte on another device, in
// another process where there are two; with two replicas, a data x pipeline grid), AdamW with
// clipping and dropout, against one process's executor: losses and chunks bitwise, also after
// loading that executor's checkpoint.
void test_pipeline_gpt(Setup const& s) {
  namespace pp = mgpu::pipeline;
  std::shared_ptr<mgpu::Allocator> host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  mgpu::nn::GptConfig const config{
      .vocab = 32, .block_size = 8, .n_layer = 2, .n_head = 2, .n_embd = 16, .dropout = 0.1f};
  mgpu::nn::Sequential const model = mgpu::nn::gpt(config);
  TokenBatches const batches = token_batches(3, 6, 32, 3);
  std::vector<Tensor> const& xs = batches.xs;
  std::vector<Tensor> const& ys = batches.ys;
  pp::ChunkOptimizerFactory const& adamw = chunk_adamw;
  for (int const replicas : {1, 2}) {
    int const devices = s.size() / replicas;
    if (s.size() % replicas != 0 || devices < 2) continue;  // the head on another device than the embedding
    std::string const what = "GPT pipeline x " + std::to_string(replicas) + " replica(s)";
    std::vector<std::size_t> const cuts = pp::partition(model, devices, std::vector<double>(model.size(), 1.0)).cuts;
    pp::ExecutorOptions options{.seed = 5,
                                .data_parallel = replicas,
                                .timeout = 60s,
                                .clip_norm = 0.1f,
                                .loss = std::make_shared<mgpu::nn::TokenCrossEntropy>()};
    mgpu::DeviceGroup one("host:" + std::to_string(s.size()));
    pp::Executor reference(model, one, cuts, pp::one_f_one_b(devices, 2), adamw, options);
    options.make_communicator = mgpu::dist::communicator_factory(s.world);
    pp::Executor executor(model, s.group, cuts, pp::one_f_one_b(devices, 2), adamw, options);
    // A bad id is refused by every process before any action; the run below then follows the reference.
    expect_refused([&] { (void)executor.step(with_last_id(xs[0], 32), ys[0]); }, "token id 32 at row 5, position 7 of the batch",
                   what + ": an id of the vocab's size");
    for (std::size_t b = 0; b < xs.size(); ++b) {
      float const expected = reference.step(xs[b], ys[b]);
      float const got = executor.step(xs[b], ys[b]);
      EXPECT(std::memcmp(&got, &expected, sizeof got) == 0,
             what << ": step " << b << " loss " << got << " (expected " << expected << ")");
    }
    for (int l = 0; l < s.local(); ++l) {
      int const c = s.rank(l) % devices;
      int const replica = s.rank(l) / devices;
      EXPECT(same_bits(host_values(executor.chunk(c, replica).master_parameters(), s.group.stream(l)),
                       host_values(reference.chunk(c, replica).master_parameters(), one.stream(0))),
             what << ": chunk " << c << " of replica " << replica << " differs from one process's");
    }
    // One process's checkpoint loads into the executor across processes (each process its chunks,
    // their AdamW state and RNG), which then steps as that process does.
    std::filesystem::path const file =
        std::filesystem::temp_directory_path() /
        ("mgpu_mpi_dist_gpt_" + std::to_string(::getpid()) + "_" + std::to_string(replicas) + ".ckpt");
    reference.save(file);
    pp::Executor resumed(model, s.group, cuts, pp::one_f_one_b(devices, 2), adamw, options);
    resumed.load(file);
    std::filesystem::remove(file);
    float const expected = reference.step(xs[0], ys[0]);
    float const got = resumed.step(xs[0], ys[0]);
    EXPECT(std::memcmp(&got, &expected, sizeof got) == 0,
           what << ": after load, loss " << got << " (expected " << expected << ")");
    for (int l = 0; l < s.local(); ++l) {
      int const c = s.rank(l) % devices;
      int const replica = s.rank(l) / devices;
      EXPECT(same_bits(host_values(resumed.chunk(c, replica).master_parameters(), s.group.stream(l)),
                       host_values(reference.chunk(c, replica).master_parameters(), one.stream(0))),
             what << ": after load, chunk " << c << " of replica " << replica << " differs from one process's");
    }
  }
}

// pipeline::Executor::save() across the processes into `folder` (the same on every process) at step
// 2 of 5 of a GPT pipelined over 2 stages (its tied LM head's copy of wte in the second stage, with
// AdamW, clipping and dropout; with two replicas where the world has 4 devices, replica 0 all in one
// process and the other process's shard empty), and load() of it: resumed across the processes,
// and in one process over as many devices, the same bits as an uninterrupted run in one process
// (the same ranks and layout); in one process on one device (one stage, another layout) within
// float32 tolerance; saved again into a folder in one process (one shard) and resumed from that;
// loaded by a DataParallel (the same records).
// Every process writes the chunks its ranks run, so the shards are the processes; a damaged shard
// names its file, and a save no process can write fails on every process.
void test_pipeline_checkpoint(Setup const& s, std::filesystem::path const& folder) {
  namespace pp = mgpu::pipeline;
  std::shared_ptr<mgpu::Allocator> host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  mgpu::Stream host_stream{mgpu::Device{mgpu::DeviceKind::host, 0}};
  if (process == 0) std::filesystem::remove_all(folder);  // before any process writes (save() agrees first)
  mgpu::nn::GptConfig const config{
      .vocab = 32, .block_size = 8, .n_layer = 2, .n_head = 2, .n_embd = 16, .dropout = 0.1f};
  mgpu::nn::Sequential const model = mgpu::nn::gpt(config);
  int const steps = 5, saved_at = 2;
  TokenBatches const batches = token_batches(steps, 6, 32, 4);
  std::vector<Tensor> const& xs = batches.xs;
  std::vector<Tensor> const& ys = batches.ys;
  pp::ChunkOptimizerFactory const& adamw = chunk_adamw;
  int const replicas = s.size() / 2;
  std::vector<std::size_t> const cuts = pp::partition(model, 2, std::vector<double>(model.size(), 1.0)).cuts;
  pp::ExecutorOptions options{.seed = 5,
                              .data_parallel = replicas,
                              .timeout = 60s,
                              .clip_norm = 0.1f,
                              .loss = std::make_shared<mgpu::nn::TokenCrossEntropy>()};
  mgpu::io::TrainingState const position{.step = saved_at, .epoch = 1, .batch = saved_at, .data_seed = 78};
  std::string const what = "pipeline checkpoint x " + std::to_string(replicas) + " replica(s)";
  mgpu::DeviceGroup one("host:" + std::to_string(s.size()));
  pp::Executor reference(model, one, cuts, pp::one_f_one_b(2, 2), adamw, options);
  std::vector<float> losses;
  for (int b = 0; b < steps; ++b) losses.push_back(reference.step(xs[static_cast<std::size_t>(b)], ys[static_cast<std::size_t>(b)]));
  mgpu::nn::Sequential whole = model.clone();
  mgpu::nn::Context ctx{*host, host_stream};
  whole.materialize(ctx, 1);
  reference.gather_parameters(whole, host_stream);
  std::vector<float> const want = host_values(whole.master_parameters(), host_stream);
  // `executor` from step `from` on against the uninterrupted run.
  auto const finish = [&](pp::Executor& executor, int from, double tolerance, std::string const& run) {
    for (int b = from; b < steps; ++b) {
      auto const u = static_cast<std::size_t>(b);
      float const loss = executor.step(xs[u], ys[u]);
      EXPECT(close_to({loss}, {losses[u]}, tolerance),
             what << ", " << run << ": step " << b << " loss " << loss << " (expected " << losses[u] << ")");
    }
    executor.gather_parameters(whole, host_stream);
    EXPECT(close_to(host_values(whole.master_parameters(), host_stream), want, tolerance),
           what << ", " << run << ": the parameters differ from the uninterrupted run's");
  };
  auto const loaded = [&](pp::Executor& executor, std::filesystem::path const& from, std::string const& run) {
    mgpu::io::TrainingState const got = executor.load(from);
    EXPECT(got.step == position.step && got.epoch == position.epoch && got.batch == position.batch &&
               got.data_seed == position.data_seed,
           what << ", " << run << ": loaded step " << got.step << ", epoch " << got.epoch << ", batch " << got.batch
                << ", seed " << got.data_seed);
  };
  options.make_communicator = mgpu::dist::communicator_factory(s.world);
  std::vector<float> at_save;  // the parameters saved
  {
    pp::Executor executor(model, s.group, cuts, pp::one_f_one_b(2, 2), adamw, options);
    for (int b = 0; b < saved_at; ++b) executor.step(xs[static_cast<std::size_t>(b)], ys[static_cast<std::size_t>(b)]);
    executor.save(folder, position);
    executor.gather_parameters(whole, host_stream);
    at_save = host_values(whole.master_parameters(), host_stream);
    finish(executor, saved_at, 0, "the run that saved");
    // Nothing can be written under a file: every process fails, none waits for another.
    try {
      executor.save("/dev/null/pipeline", position);
      EXPECT(false, what << ": a save under /dev/null was accepted");
    } catch (mgpu::Error const& e) {
      EXPECT(e.category() == mgpu::Errc::io, what << ": a save under /dev/null: " << e.what() << " (expected Error(io))");
    }
  }
  mgpu::io::ShardedCheckpoint const written = mgpu::io::ShardedCheckpoint::load(folder);
  EXPECT(written.shards() == s.world.processes && written.split_names().size() == 3,
         what << ": " << written.shards() << " shards, " << written.split_names().size()
              << " split records (expected " << s.world.processes << " and the parameters with AdamW's 2)");
  {
    pp::Executor executor(model, s.group, cuts, pp::one_f_one_b(2, 2), adamw, options);
    loaded(executor, folder, "resumed across the processes");
    finish(executor, saved_at, 0, "resumed across the processes");
  }
  {
    // Each process reads the pieces of the chunks its ranks run, and the tied head's process the
    // embedding's too (the head's copy of wte comes from wte): the parameters and AdamW's two
    // buffers, float32, no others.
    pp::Executor executor(model, s.group, cuts, pp::one_f_one_b(2, 2), adamw, options);
    mgpu::io::ShardedCheckpoint const opened = mgpu::io::ShardedCheckpoint::load(folder);
    std::uint64_t const before = opened.payload_bytes_read();
    EXPECT(executor.load(opened).step == position.step, what << ": load of an opened folder");
    std::vector<bool> needed(2, false);
    for (int l = 0; l < s.local(); ++l) needed[static_cast<std::size_t>(s.rank(l) % 2)] = true;
    needed[0] = needed[0] || needed[1];
    std::uint64_t elements = 0;
    for (std::size_t c = 0; c < 2; ++c) {
      for (std::size_t layer = cuts[c]; layer < cuts[c + 1] && needed[c]; ++layer)
        elements += static_cast<std::uint64_t>(model.layer(layer).parameter_count());
    }
    EXPECT(opened.payload_bytes_read() - before == 3 * sizeof(float) * elements,
           what << ": process " << process << " read " << opened.payload_bytes_read() - before
                << " bytes of pieces (expected " << 3 * sizeof(float) * elements << ": its chunks' "
                << (needed[1] ? "and the embedding's" : "only") << ")");
    finish(executor, saved_at, 0, "loaded from an opened folder");
  }
  options.make_communicator = nullptr;
  {
    mgpu::DeviceGroup same("host:" + std::to_string(s.size()));
    pp::Executor executor(model, same, cuts, pp::one_f_one_b(2, 2), adamw, options);
    loaded(executor, folder, "resumed in one process");
    // In one process, a save into an existing folder writes a one-shard save of the same records.
    std::filesystem::path const again = folder.string() + "-one-" + std::to_string(process);
    std::filesystem::remove_all(again);
    std::filesystem::create_directories(again);
    executor.save(again, position);
    EXPECT(mgpu::io::ShardedCheckpoint::load(again).shards() == 1, what << ": a save into a folder in one process");
    pp::Executor resaved(model, same, cuts, pp::one_f_one_b(2, 2), adamw, options);
    loaded(resaved, again, "saved again in one process");
    std::filesystem::remove_all(again);
    finish(executor, saved_at, 0, "resumed in one process");
    finish(resaved, saved_at, 0, "saved again in one process");
  }
  {
    options.data_parallel = 1;
    mgpu::DeviceGroup single("host:1");
    pp::Executor executor(model, single, {0, model.size()}, pp::gpipe(1, 2), adamw, options);
    loaded(executor, folder, "resumed on one device");
    finish(executor, saved_at, 1e-5, "resumed on one device");
  }
  {
    // The same records as DataParallel's: one loads the folder (each rank its owned elements of
    // the AdamW state, the parameters whole).
    mgpu::parallel::DataParallelOptions dp_options;
    dp_options.zero_stage = 1;
    mgpu::DeviceGroup two("host:2");
    mgpu::parallel::DataParallel dp(model.clone(), two, mgpu::optim::AdamW(mgpu::optim::AdamWOptions{.lr = 0.01f}), dp_options);
    mgpu::io::TrainingState const got = dp.load(folder);
    EXPECT(got.step == position.step, what << ": DataParallel loaded step " << got.step);
    for (int l = 0; l < two.size(); ++l)
      EXPECT(same_bits(host_values(dp.replica(l).master_parameters(), two.stream(l)), at_save),
             what << ": DataParallel's replica " << l << " differs from the parameters saved");
  }
  // A copy of the folder with one byte flipped near the end of shard `index` (in its last piece).
  auto const damaged = [&](std::filesystem::path const& copy, int index) {
    std::filesystem::remove_all(copy);
    std::filesystem::copy(folder, copy);
    std::filesystem::path const shard = mgpu::io::shard_path(copy, written.save_id(), index, written.shards());
    std::fstream file(shard, std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(-100, std::ios::end);
    char byte = 0;
    file.read(&byte, 1);
    byte = static_cast<char>(byte ^ 0x10);
    file.seekp(-100, std::ios::end);
    file.write(&byte, 1);
    return shard;
  };
  if (s.size() == 2 && s.local() == 1) {
    // One device per process: process 1's shard damaged, which only process 1 reads. It fails
    // naming the file, process 0 naming process 1, and both executors stay usable.
    options.make_communicator = mgpu::dist::communicator_factory(s.world);
    std::filesystem::path const copy = folder.string() + "-damaged";
    auto const barrier = mgpu::dist::make_communicator(s.world, s.group);
    std::filesystem::path shard;
    if (process == 0) shard = damaged(copy, 1);
    s.group.run([&](int l, mgpu::Device, mgpu::Stream& stream) { barrier->barrier(s.rank(l), stream); });
    s.group.synchronize();
    pp::Executor executor(model, s.group, cuts, pp::one_f_one_b(2, 2), adamw, options);
    try {
      executor.load(copy);
      EXPECT(false, what << ": process 1's damaged shard was accepted by process " << process);
    } catch (mgpu::Error const& e) {
      std::string const text = e.what();
      bool const named = process == 1 ? e.category() == mgpu::Errc::corrupt_data && text.find("shard-") != std::string::npos
                                      : e.category() == mgpu::Errc::io && text.find("world rank 1 failed") != std::string::npos;
      EXPECT(named, what << ": process 1's damaged shard, on process " << process << ": " << text);
    }
    loaded(executor, folder, "loaded after a failed load");
    finish(executor, saved_at, 0, "loaded after a failed load");
    s.group.run([&](int l, mgpu::Device, mgpu::Stream& stream) { barrier->barrier(s.rank(l), stream); });
    s.group.synchronize();
    if (process == 0) std::filesystem::remove_all(copy);
    options.make_communicator = nullptr;
  }
  // Each process damages its own copy: one byte near the end of shard 0 (process 0's).
  std::filesystem::path const copy = folder.string() + "-damaged-" + std::to_string(process);
  std::filesystem::path const shard = damaged(copy, 0);
  mgpu::DeviceGroup two("host:2");
  pp::Executor executor(model, two, cuts, pp::one_f_one_b(2, 2), adamw, options);
  try {
    executor.load(copy);
    EXPECT(false, what << ": a damaged shard was accepted");
  } catch (mgpu::Error const& e) {
    EXPECT(e.category() == mgpu::Errc::corrupt_data &&
               std::string(e.what()).find(shard.filename().string()) != std::string::npos,
           what << ": a damaged shard: " << e.what() << " (expected corrupt_data naming " << shard.filename().string() << ")");
  }
  std::filesystem::remove_all(copy);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(
        stderr,
        "usage: mpi_dist collectives|subsets|tensor_parallel|tensor_parallel_pipeline|data_parallel|failure|checkpoint|pipeline|pipeline_checkpoint|stall|exit|mismatch|"
        "mismatch_local|subset_missing|subset_mismatch COUNTS "
        "[PROCESS|FOLDER]\n");
    return 2;
  }
  std::string const mode = argv[1];
  std::vector<int> counts;
  for (std::stringstream list(argv[2]); list.good();) {
    std::string item;
    std::getline(list, item, ',');
    counts.push_back(std::stoi(item));
  }
  int const faulty = argc > 3 && mode != "checkpoint" && mode != "pipeline_checkpoint" ? std::atoi(argv[3]) : -1;
  try {
    mgpu::dist::Session session;
    mgpu::dist::Place const& place = session.place();
    process = place.rank;
    if (place.size != static_cast<int>(counts.size())) {
      std::fprintf(stderr, "process %d: %d processes, but COUNTS lists %zu\n", process, place.size, counts.size());
      return 2;
    }
    if (process == 0)
      std::printf("launcher %s, %d processes, MPI thread support '%s'\n",
                  std::string(mgpu::dist::to_string(place.launcher)).c_str(), place.size,
                  place.mpi_thread_level.c_str());
    mgpu::DeviceGroup group("host:" + std::to_string(counts[static_cast<std::size_t>(place.rank)]));
    mgpu::dist::World const world = mgpu::dist::make_world(group);
    test_world(world, counts, place);
    auto comm = mgpu::dist::make_communicator(world, group, {.timeout = 60s});
    EXPECT(comm->size() == world.size(), "communicator size " << comm->size());
    Setup const s{world, group, *comm};
    // The end of a mode: the communicator drained, this process's checks counted.
    auto const finish = [&] {
      comm->finalize();
      std::printf("process %d: %d of %d checks passed\n", process, checks - failures, checks);
      return failures == 0 ? 0 : 1;
    };
    if (mode == "pipeline") {
      test_pipeline(s);
      test_pipeline_gpt(s);
      return finish();
    }
    if (mode == "tensor_parallel_pipeline") {
      test_tensor_parallel_pipeline(s);
      return finish();
    }
    if (mode == "checkpoint") {
      if (argc < 4) {
        std::fprintf(stderr, "usage: mpi_dist checkpoint COUNTS FOLDER\n");
        return 2;
      }
      test_checkpoint(s, argv[3]);
      return finish();
    }
    if (mode == "pipeline_checkpoint") {
      if (argc < 4 || s.size() % 2 != 0) {
        std::fprintf(stderr, "usage: mpi_dist pipeline_checkpoint COUNTS FOLDER (an even number of devices)\n");
        return 2;
      }
      test_pipeline_checkpoint(s, argv[3]);
      return finish();
    }
    if (mode == "data_parallel") {
      test_data_parallel(s);
      return finish();
    }
    if (mode == "tensor_parallel") {
      test_tensor_parallel(s);
      return finish();
    }
    if (mode == "failure") {
      test_failure(s);
      return finish();
    }
    if (mode == "subsets") {
      test_subsets(s);
      return finish();
    }
    if (mode == "collectives") {
      int seed = 1;
      test_collectives(s, seed);
      group.run([&](int l, mgpu::Device, mgpu::Stream& stream) { comm->barrier(s.rank(l), stream); });
      bool one_each = true;
      for (int c : counts) one_each = one_each && c == 1;
      if (one_each) {
        test_matches_one_process(s, seed++, 101);
        test_matches_one_process(s, seed++, 70001);  // the leaders reduce-scatter and all-gather (3 or more processes)
      }
      // Communicators made two at a time and dropped (the next two take the shared memory these
      // left, between 2 processes on one host) all-reduce right.
      for (int round = 0; round < 3; ++round) {
        auto first = mgpu::dist::make_communicator(world, group);
        auto second = mgpu::dist::make_communicator(world, group);
        test_all_reduce(Setup{world, group, *first}, DType::float32, ReduceOp::sum, seed++, true, 5 * 65536 + 1);
        test_all_reduce(Setup{world, group, *second}, DType::bfloat16, ReduceOp::max, seed++, false, 65537);
        test_all_reduce(Setup{world, group, *first}, DType::float32, ReduceOp::avg, seed++, false, 3);
      }
      // A rank of another process is refused here, before any communication.
      int const remote = world.rank_of(0) == 0 ? world.size() - 1 : 0;
      Tensor const t = Tensor::empty({4}, DType::float32, group.allocator(0));
      try {
        comm->all_reduce(remote, t, t, ReduceOp::sum, group.stream(0));
        EXPECT(false, "all_reduce as rank " << remote << " of another process was accepted");
      } catch (mgpu::Error const& e) {
        EXPECT(e.category() == mgpu::Errc::invalid_argument &&
                   std::string(e.what()).find("belongs to process") != std::string::npos,
               "all_reduce as another process's rank: " << e.what());
      }
      return finish();
    }
    if (mode == "subset_missing" || mode == "subset_mismatch") {
      // Every process but `faulty` makes a subset communicator over every world rank (3 s deadline);
      // `faulty` never does, or passes the list backwards.
      std::vector<int> list;
      for (int r = 0; r < world.size(); ++r) list.push_back(r);
      if (process == faulty) {
        if (mode == "subset_missing") {
          std::this_thread::sleep_for(60s);  // mpirun ends it once another process fails
          return 0;
        }
        std::reverse(list.begin(), list.end());
      }
      auto subset = mgpu::dist::make_communicator(world, group, list, {.timeout = 3s});
      std::printf("process %d: made the subset communicator\n", process);
      return 0;
    }
    // A fault: one healthy all_reduce, then `faulty` stalls, exits, or passes another count in an
    // all_reduce of a second communicator, made right after it. Only a stall is meant to meet the
    // second one's deadline (3 s), which a process slowed by a busy machine does not reach between
    // two operations; setting up and the healthy all_reduce have 60 s.
    test_all_reduce(s, DType::float32, ReduceOp::sum, 1, false);
    auto second = mgpu::dist::make_communicator(world, group, {.timeout = mode == "stall" ? 3s : 60s});
    Setup const t{world, group, *second};
    if (mode == "mismatch" || mode == "mismatch_local") {
      // mismatch: `faulty` passes 5 elements, the others 4; mismatch_local: in every process, its
      // last rank passes 5 and the others 4.
      std::vector<Tensor> buffers;
      for (int l = 0; l < t.local(); ++l) {
        bool const more = mode == "mismatch" ? process == faulty : l == t.local() - 1;
        buffers.push_back(Tensor::empty({more ? 5 : 4}, DType::float32, group.allocator(t.member(l))));
      }
      group.run([&](int l, mgpu::Device, mgpu::Stream& stream) {
        second->all_reduce(t.rank(l), buffers[static_cast<std::size_t>(l)], buffers[static_cast<std::size_t>(l)],
                           ReduceOp::sum, stream);
      });
      std::printf("process %d: the mismatched all_reduce succeeded\n", process);
      return 0;
    }
    if (process == faulty) {
      if (mode == "exit") std::_Exit(3);
      std::this_thread::sleep_for(60s);  // mpirun ends it once another process fails
      return 0;
    }
    test_all_reduce(t, DType::float32, ReduceOp::sum, 2, false);
    std::printf("process %d: the collective succeeded without process %d\n", process, faulty);
    return 0;
  } catch (mgpu::Error const& e) {
    std::fprintf(stderr, "process %d: error: %s\n", process, e.what());
    std::fflush(stderr);
    return 1;
  }
}
