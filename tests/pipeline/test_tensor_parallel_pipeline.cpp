// A data x tensor x pipeline grid (pipeline::Executor with tensor-parallel stages) on host
// devices: TP 2 x PP 2 (GPipe, 1F1B, interleaved, ZB-H1), DP 2 x TP 2 x PP 2 (GPipe and 1F1B,
// uneven rows), TP 4 x PP 2 and with sequence parallelism TP 2 x PP 2 and DP 2 x TP 2 x PP 2 give
// the one-device GPT's loss curve over 20 AdamW steps with clipping and its weights (gathered from
// the shards), so does a vocab of 67 over 2 ranks, and with dropout its losses (with sequence
// parallelism too); weights scattered into the shards gather back unchanged; the last
// stage's copy of each rank's wte rows stays bitwise the first stage's, and the replicated
// parameters bitwise equal across the ranks; a grid that does not match the group,
// a rank count that does not divide the heads are refused; a whole MLP split by styles (column,
// row, gathered column) trains on TP 2 x PP 2 as one device (checkpoints:
// test_tensor_parallel_checkpoint.cpp).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <mgpu/core/device_group.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/parallel/tensor_parallel.hpp>
#include <mgpu/pipeline/pipeline.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/nn_env.hpp"

using mgpu::DType;
using mgpu::Tensor;
using mgpu::test::as_double;
using mgpu::test::worst_relative;
using mgpu::test::Env;
namespace nn = mgpu::nn;
namespace par = mgpu::parallel;
namespace pp = mgpu::pipeline;

namespace {

nn::GptConfig const config{.vocab = 64, .block_size = 16, .n_layer = 2, .n_head = 4, .n_embd = 32};
std::uint64_t const seed = 7;
std::int64_t const batch = 7;  // uneven over 2 replicas and over micro-batches
int const steps = 20;
float const clip = 0.5f;  // below the gradients' norm (checked below), so steps clip
mgpu::optim::AdamWOptions const adamw{.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .weight_decay = 0.1f};
// As the tensor-parallel and pipeline tests' bound: float32 rounding of other summation orders.
double const curve_tolerance = 1e-5;

using Batch = mgpu::test::TokenBatch;

std::vector<Batch> make_batches(Env& env, std::int64_t vocab = config.vocab) {
  std::vector<Batch> batches;
  for (int s = 0; s < steps; ++s)
    batches.push_back(mgpu::test::rule_batch(env, batch, config.block_size, vocab, 300 + static_cast<unsigned>(s)));
  return batches;
}

// The global L2 norm of the one-device model's gradients for a batch (nothing updated).
double gradient_norm(Env& env, Batch const& b) { return mgpu::test::gpt_gradient_norm(env, config, seed, b); }

struct Curve {
  std::vector<double> losses, weights;  // and the weights after the last step
};

// The one-device model's losses (AdamW decaying gpt_decay_ranges, clipped) and weights.
Curve one_device_curve(Env& env, nn::GptConfig const& c, std::vector<Batch> const& batches) {
  mgpu::test::GptCurve const curve = mgpu::test::gpt_one_device_curve(env, c, seed, adamw, clip, batches);
  return {curve.losses, std::vector<double>(curve.weights.begin(), curve.weights.end())};
}

// AdamW decaying each chunk's own weight matrices (the shards' embedding rows, split Linear
// weights and the head's copy of wte), as the one device decays gpt_decay_ranges.
pp::ChunkOptimizerFactory chunk_adamw() {
  return [](nn::Sequential const& chunk) {
    mgpu::optim::AdamWOptions options = adamw;
    options.decay_ranges = chunk.matrix_ranges();
    return std::make_unique<mgpu::optim::AdamW>(options);
  };
}

struct Grid {
  std::string name;
  pp::Schedule schedule;
  std::vector<std::size_t> cuts;
  int data_parallel;
  int ranks = 2;  // tensor-parallel
  bool sequence_parallel = false;
};


double worst_difference(std::vector<double> const& got, std::vector<double> const& want) {
  REQUIRE(got.size() == want.size());
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]));
  return worst;
}

// Runs `grid` over `batches`: its loss curve and the weights gathered
// after it, having checked that the shards hold the seed's model (gathered), that weights
// scattered into them gather back unchanged, and that after the steps the tied copies and the
// replicated parameters are bitwise equal.
Curve grid_curve(Env& env, Grid const& grid, nn::GptConfig const& c, std::vector<Batch> const& batches) {
  int const ranks = grid.ranks;
  mgpu::DeviceGroup group("host:" + std::to_string(grid.schedule.devices * ranks * grid.data_parallel));
  pp::Executor ex(nn::gpt(c), group, grid.cuts, grid.schedule, chunk_adamw(),
                  {.seed = seed,
                   .data_parallel = grid.data_parallel,
                   .clip_norm = clip,
                   .tensor_parallel =
                       pp::tensor_parallel_stages(nn::gpt(c), {.sequence_parallel = grid.sequence_parallel}, ranks)});
  nn::Sequential whole = nn::gpt(c);
  whole.materialize(env.ctx, seed + 1);
  std::vector<double> const other = as_double(whole.master_parameters());
  ex.gather_parameters(whole, env.stream);
  nn::Sequential fresh = nn::gpt(c);
  fresh.materialize(env.ctx, seed);
  CHECK(as_double(whole.master_parameters()) == as_double(fresh.master_parameters()));
  nn::Sequential scattered = nn::gpt(c);
  scattered.materialize(env.ctx, seed + 1);
  ex.scatter_parameters(scattered, env.stream);
  ex.gather_parameters(whole, env.stream);
  CHECK(as_double(whole.master_parameters()) == other);
  ex.scatter_parameters(fresh, env.stream);  // back to the seed's weights
  std::vector<double> losses;
  for (Batch const& b : batches) losses.push_back(ex.step(b.ids, b.targets));
  group.synchronize();
  int const last = ex.schedule().chunks() - 1;
  int const pipelines = ranks * grid.data_parallel;
  for (int p = 0; p < pipelines; ++p) {
    CAPTURE(p);
    // The last stage's head holds a copy of the rank's wte rows, still the first stage's.
    nn::Sequential& head_chunk = ex.chunk(last, p);
    auto const* head = dynamic_cast<par::VocabParallelLMHead const*>(&head_chunk.layer(head_chunk.size() - 1));
    REQUIRE(head != nullptr);
    REQUIRE(head->holds_weight());
    std::int64_t const rows = (head->vocab_end() - head->vocab_begin()) * c.n_embd;
    std::int64_t const n = head_chunk.parameter_count();
    CHECK(as_double(ex.chunk(0, p).master_parameters().slice(0, rows)) ==
          as_double(head_chunk.master_parameters().slice(n - rows, n)));
    // Every chunk's replicated parameters are pipeline 0's, bit for bit (the head's copy of the
    // rank's rows aside): the chunks' ranges pair up, the split ones differing in size when the
    // ranks' vocab rows do.
    for (int chunk = 0; chunk <= last; ++chunk) {
      nn::Sequential& mine = ex.chunk(chunk, p);
      nn::Sequential& first = ex.chunk(chunk, 0);
      std::vector<double> const values = as_double(mine.master_parameters());
      std::vector<double> const firsts = as_double(first.master_parameters());
      std::vector<nn::ElementRange> const ranges = par::norm_ranges(mine, false, true);
      std::vector<nn::ElementRange> const first_ranges = par::norm_ranges(first, false, true);
      REQUIRE(ranges.size() == first_ranges.size());
      for (std::size_t k = 0; k < ranges.size(); ++k) {
        if (!ranges[k].counted || (chunk == last && ranges[k].begin == n - rows)) continue;  // split, or the copy
        auto const at = [](std::vector<double> const& v, nn::ElementRange const& r) {
          return std::vector<double>(v.begin() + r.begin, v.begin() + r.end);
        };
        if (at(values, ranges[k]) != at(firsts, first_ranges[k]))
          FAIL("chunk " << chunk << ": replicated elements [" << ranges[k].begin << ", " << ranges[k].end
                        << ") differ from pipeline 0's");
      }
    }
  }
  ex.gather_parameters(whole, env.stream);
  return {losses, as_double(whole.master_parameters())};
}

}  // namespace

TEST_CASE("a data x tensor x pipeline grid trains a GPT as one device: TP 2 x PP 2, DP 2 x TP 2 x PP 2, TP 4 x PP 2",
          "[pipeline][tensor]") {
  Env env;
  std::vector<Batch> const batches = make_batches(env);
  REQUIRE(gradient_norm(env, batches[0]) > 2 * clip);  // the steps do clip
  Curve const want = one_device_curve(env, config, batches);
  REQUIRE(want.losses.back() < 0.8 * want.losses.front());  // it learns
  std::vector<Grid> const grids{
      {"TP 2 x PP 2, gpipe", pp::gpipe(2, 3), {0, 3, 6}, 1},
      {"TP 2 x PP 2, 1f1b", pp::one_f_one_b(2, 3), {0, 3, 6}, 1},
      {"TP 2 x PP 2, interleaved 2 x 2 chunks", pp::interleaved_one_f_one_b(2, 2, 2), {0, 2, 3, 4, 6}, 1},
      {"TP 2 x PP 2, zb-h1", pp::zero_bubble_h1(2, 3), {0, 3, 6}, 1},
      {"DP 2 x TP 2 x PP 2, gpipe", pp::gpipe(2, 2), {0, 3, 6}, 2},
      {"DP 2 x TP 2 x PP 2, 1f1b", pp::one_f_one_b(2, 2), {0, 4, 6}, 2},
      {"TP 4 x PP 2, 1f1b", pp::one_f_one_b(2, 3), {0, 3, 6}, 1, 4},
      {"TP 2 x PP 2, 1f1b, sequence parallel", pp::one_f_one_b(2, 3), {0, 3, 6}, 1, 2, true},
      {"TP 2 x PP 2, gpipe, sequence parallel, the head alone", pp::gpipe(2, 3), {0, 5, 6}, 1, 2, true},
      {"DP 2 x TP 2 x PP 2, 1f1b, sequence parallel", pp::one_f_one_b(2, 2), {0, 4, 6}, 2, 2, true},
  };
  for (Grid const& grid : grids) {
    CAPTURE(grid.name);
    Curve const got = grid_curve(env, grid, config, batches);
    double const worst = worst_relative(got.losses, want.losses);
    double const weights = worst_difference(got.weights, want.weights);
    WARN(grid.name << ": worst relative loss difference " << worst << ", weights " << weights);
    CHECK(worst <= curve_tolerance);
    CHECK(weights < 5e-5);  // measured 1.2e-5 at worst (AdamW scales rounding noise up), as in TP alone
  }
}

TEST_CASE("with dropout a tensor x pipeline grid drops what one device drops", "[pipeline][tensor]") {
  nn::GptConfig dropped = config;
  dropped.dropout = 0.2f;
  Env env;
  std::vector<Batch> const batches = make_batches(env);
  std::vector<double> const want = one_device_curve(env, dropped, batches).losses;
  std::vector<double> const undropped = one_device_curve(env, config, batches).losses;
  REQUIRE(std::abs(want[0] - undropped[0]) > 1e-3 * undropped[0]);  // the dropout changes the loss
  for (Grid const& grid : {Grid{"TP 2 x PP 2, 1f1b", pp::one_f_one_b(2, 3), {0, 3, 6}, 1},
                           Grid{"DP 2 x TP 2 x PP 2, gpipe", pp::gpipe(2, 2), {0, 3, 6}, 2},
                           Grid{"TP 2 x PP 2, 1f1b, sequence parallel", pp::one_f_one_b(2, 3), {0, 3, 6}, 1, 2, true}}) {
    CAPTURE(grid.name);
    double const worst = worst_relative(grid_curve(env, grid, dropped, batches).losses, want);
    WARN(grid.name << " with dropout: worst relative loss difference " << worst);
    CHECK(worst <= curve_tolerance);
  }
}

TEST_CASE("a tensor x pipeline grid over a vocab the ranks do not divide trains as one device", "[pipeline][tensor]") {
  // Rank 0 holds 33 ids and rank 1 34: the last stage's copies of their rows differ in size.
  nn::GptConfig odd = config;
  odd.vocab = 67;
  Env env;
  std::vector<Batch> const batches = make_batches(env, odd.vocab);
  Curve const want = one_device_curve(env, odd, batches);
  Curve const got = grid_curve(env, {"TP 2 x PP 2, 1f1b", pp::one_f_one_b(2, 3), {0, 3, 6}, 1}, odd, batches);
  double const worst = worst_relative(got.losses, want.losses);
  WARN("vocab 67: worst relative loss difference " << worst);
  CHECK(worst <= curve_tolerance);
  CHECK(worst_difference(got.weights, want.weights) < 5e-5);
}

TEST_CASE("a tensor x pipeline grid trains any Sequential split by styles as one device", "[pipeline][tensor]") {
  // Column then row, then column-parallel with gathered outputs twice, cut between the pairs.
  nn::Sequential const model = nn::Sequential::mlp({8, 16, 8, 16, 8}, "gelu");
  par::TensorParallelPlan const plan{.styles = {{0, par::column_parallel()},
                                                {2, par::row_parallel()},
                                                {4, par::column_parallel(true)},
                                                {6, par::column_parallel(true)}}};
  auto const mse = [](std::shared_ptr<mgpu::comm::Communicator> const&, int) {
    return std::make_unique<nn::MeanSquaredError>();
  };
  auto const sgd = [] { return std::make_unique<mgpu::optim::SGD>(mgpu::optim::SgdOptions{.lr = 0.5f}); };
  Env env;
  nn::Sequential one = model.clone();
  one.materialize(env.ctx, seed);
  auto const optimizer = sgd();
  nn::MeanSquaredError const loss;
  mgpu::DeviceGroup group("host:4");
  pp::Executor ex(model, group, {0, 4, 7}, pp::one_f_one_b(2, 2), pp::OptimizerFactory(sgd),
                  {.seed = seed, .tensor_parallel = pp::tensor_parallel_stages(model, plan, 2, mse)});
  std::vector<double> got, want;
  for (unsigned s = 0; s < 3; ++s) {
    Tensor const x = env.random({6, 8}, 10 + s), y = env.random({6, 8}, 20 + s);
    want.push_back(mgpu::ops::item(nn::train_step(one, *optimizer, x, y, loss, env.ctx).loss, env.stream));
    got.push_back(ex.step(x, y));
  }
  CHECK(worst_relative(got, want) <= curve_tolerance);
  REQUIRE(want.back() < want.front());  // the steps change the model
  nn::Sequential whole = model.clone();
  whole.materialize(env.ctx, seed + 1);
  ex.gather_parameters(whole, env.stream);
  CHECK(worst_difference(as_double(whole.master_parameters()), as_double(one.master_parameters())) < 1e-5);
  REQUIRE_MGPU_ERROR(pp::tensor_parallel_stages(model, plan, 2), mgpu::Errc::invalid_argument,
                     "tensor_parallel_stages: a model whose last layer is Linear(16, 8) without a loss");
  REQUIRE_MGPU_ERROR(pp::Executor(model, group, {0, 4, 7}, pp::one_f_one_b(2, 2), pp::OptimizerFactory(sgd),
                                  {.tensor_parallel = pp::tensor_parallel_stages(model, {}, 2, mse)}),
                     mgpu::Errc::invalid_argument, "parallelize: layer 0 (Linear(8, 16)) has no tensor-parallel style");
}

TEST_CASE("a tensor x pipeline grid refuses a group of another size and heads the ranks do not divide",
          "[pipeline][tensor]") {
  mgpu::DeviceGroup group("host:4");
  nn::Sequential const model = nn::gpt(config);
  pp::TensorParallelStages const stages = pp::tensor_parallel_stages(model, {}, 2);
  REQUIRE_MGPU_ERROR(pp::Executor(model, group, {0, 3, 6}, pp::one_f_one_b(2, 2), chunk_adamw(),
                                  {.data_parallel = 2, .tensor_parallel = stages}),
                     mgpu::Errc::invalid_argument, "expected devices x replicas x tensor-parallel ranks = the group's size");
  mgpu::DeviceGroup six("host:6");
  REQUIRE_MGPU_ERROR(pp::Executor(model, six, {0, 3, 6}, pp::one_f_one_b(2, 2), chunk_adamw(),
                                  {.tensor_parallel = pp::tensor_parallel_stages(model, {}, 3)}),
                     mgpu::Errc::invalid_argument,
                     "TensorParallelBlock(32 features, 4 heads, 3 ranks) (expected heads dividing the features and the "
                     "ranks dividing the heads)");
}
