// mgpu_mpi_dist's tensor_parallel and tensor_parallel_pipeline modes (tests/dist/mpi_dist.cpp says what
// each checks): TensorParallel and the data x tensor x pipeline grid over the processes' devices.
#include <algorithm>
#include <cmath>
#include <memory>

#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/parallel/tensor_parallel.hpp>

#include "mpi_dist.hpp"

namespace mpi_dist {

namespace {

// Whether reductions over the world ranks `ranks` combine in the same order across processes as
// in one process: the ranks are all in one process, or each in its own.
bool same_order(mgpu::dist::World const& world, std::vector<int> const& ranks) {
  std::vector<int> processes;
  for (int const r : ranks) processes.push_back(world.devices[static_cast<std::size_t>(r)].process);
  std::sort(processes.begin(), processes.end());
  bool const one = processes.front() == processes.back();
  return one || std::adjacent_find(processes.begin(), processes.end()) == processes.end();
}

}  // namespace

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
                                .tensor_parallel = pp::tensor_parallel_stages(
                                    mgpu::nn::gpt(config), {.sequence_parallel = sequence_parallel}, 2)};
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
                              .tensor_parallel = pp::tensor_parallel_stages(mgpu::nn::gpt(config), {}, 2),
                              .make_communicator = mgpu::dist::communicator_factory(s.world)};
  options.data_parallel = replicas;
  expect_refused([&] { pp::Executor(model, s.group, cuts, pp::one_f_one_b(devices, 2), adamw, options); },
                 "without make_subset_communicator", "tensor-parallel stages across processes without a subset factory");
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
    par::TensorParallel reference(one, mgpu::nn::gpt(config), options);
    options.make_communicator = mgpu::dist::communicator_factory(s.world);
    options.make_subset_communicator = mgpu::dist::subset_communicator_factory(s.world);
    par::TensorParallel tp(s.group, mgpu::nn::gpt(config), options);
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
    expect_refused([&] { par::TensorParallel(s.group, mgpu::nn::gpt({.vocab = 32, .block_size = 8, .n_layer = 1, .n_head = 4, .n_embd = 16}), options); },
                   "without make_subset_communicator", "data_parallel 2 across processes without the subset factory");
  }
}

}  // namespace mpi_dist
