// What the translation units of mgpu_mpi_dist share (mpi_dist.cpp holds main() and says what each mode
// checks): the counted checks, the communicator a mode runs over, the executor modes' helpers.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include <mgpu/dist/dist.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/pipeline/pipeline.hpp>

namespace mpi_dist {

using mgpu::DType;
using mgpu::Tensor;
using mgpu::comm::ReduceOp;
using namespace std::chrono_literals;

// This process's checks, those that failed, and its rank among the processes.
inline int failures = 0;
inline int checks = 0;
inline int process = 0;

#define EXPECT(condition, what)                                                                      \
  do {                                                                                               \
    ++::mpi_dist::checks;                                                                            \
    if (!(condition)) {                                                                              \
      ++::mpi_dist::failures;                                                                        \
      std::ostringstream text_;                                                                      \
      text_ << what;                                                                                 \
      std::fprintf(stderr, "process %d: FAILED %s: %s\n", ::mpi_dist::process, #condition,          \
                   text_.str().c_str());                                                             \
    }                                                                                                \
  } while (false)

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

// mpi_dist_collectives.cpp: the collectives, the world and subset communicators.
void test_all_reduce(Setup const& s, DType dtype, ReduceOp op, int seed, bool in_place, std::int64_t n = 37);
void test_collectives(Setup const& s, int& seed);
void test_matches_one_process(Setup const& s, int seed, std::int64_t n);
void test_world(mgpu::dist::World const& world, std::vector<int> const& counts, mgpu::dist::Place const& place);
void test_subsets(Setup const& s);
// parallel::Mesh across processes: one communicator per group, made once, reducing over its ranks.
void test_mesh(Setup const& s);

// mpi_dist_data_parallel.cpp
void test_data_parallel(Setup const& s);
void test_checkpoint(Setup const& s, std::filesystem::path const& folder);

// mpi_dist_pipeline.cpp
void test_pipeline(Setup const& s);
void test_pipeline_gpt(Setup const& s);
void test_pipeline_checkpoint(Setup const& s, std::filesystem::path const& folder);

// mpi_dist_tensor_parallel.cpp
void test_tensor_parallel(Setup const& s);
void test_tensor_parallel_pipeline(Setup const& s);

// mpi_dist_failure.cpp
void test_failure(Setup const& s);

// mpi_dist_support.cpp: what the executors' modes share.
// A small MLP, with dropout (whose mask follows each row's place in the global batch) when asked.
mgpu::nn::Sequential dp_model(bool dropout);
// `ids` with the last token of its last row set to `value`.
Tensor with_last_id(Tensor const& ids, std::int32_t value);
std::vector<float> host_values(Tensor const& t, mgpu::Stream& stream);
// `count` batches of int32 token ids and their targets [rows, 8], each below `vocab`, drawn from `seed`.
struct TokenBatches {
  std::vector<Tensor> xs, ys;
};
TokenBatches token_batches(int count, std::int64_t rows, unsigned vocab, unsigned seed);
// The whole model's float32 weights as `executor` and `reference` gather them (gather_parameters()).
struct Gathered {
  std::vector<float> got, want;
};
Gathered gather_both(mgpu::pipeline::Executor& executor, mgpu::pipeline::Executor& reference,
                     mgpu::nn::Sequential const& model);
// AdamW for each pipeline chunk, decaying the chunk's weight matrices.
extern mgpu::pipeline::ChunkOptimizerFactory const chunk_adamw;
// Whether `have` and `want` hold the same bits.
bool same_bits(std::vector<float> const& have, std::vector<float> const& want);
// Whether `have` is within `tolerance` (relative, per element) of `want`, or the same bits.
bool close_to(std::vector<float> const& have, std::vector<float> const& want, double tolerance);
// The largest difference between `have` and `want` relative to 1 + |want| (infinity for other sizes).
double worst_difference(std::vector<float> const& have, std::vector<float> const& want);

}  // namespace mpi_dist
