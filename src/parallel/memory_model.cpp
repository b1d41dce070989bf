// The per-device memory model of a GPT training step (see memory_model.hpp for what it counts).
#include <mgpu/parallel/memory_model.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include <mgpu/core/device_group.hpp>
#include <mgpu/core/error.hpp>
#include <mgpu/core/memory.hpp>
#include <mgpu/nn/transformer.hpp>
#include <mgpu/parallel/tensor_parallel.hpp>

#include "parallel/gradient_sync.hpp"

namespace mgpu::parallel {
namespace {

// The allocator's bytes for a float32 tensor of `values` elements.
std::size_t floats(double values) {
  return Allocator::block_size(static_cast<std::size_t>(std::max(0.0, values)) * sizeof(float));
}

// The allocator's bytes for a copy of `values` elements in the 16-bit compute type `compute`; none
// for float32 compute (the masters are the tensors the layers use).
std::size_t copies(double values, DType compute) {
  if (compute == DType::float32) return 0;
  return Allocator::block_size(static_cast<std::size_t>(std::max(0.0, values)) * size_of(compute));
}

// What one transformer block keeps for backward, per tensor, for n tokens on one of t ranks (the
// split tensors hold 1/t of their columns; with sequence parallelism, s = t, the others hold 1/s
// of the tokens): LN1's output and statistics, qkv, the attention's output and log-sum-exp, the
// residual stream h, LN2's output and statistics, the MLP's pre-activation and GELU output, the
// block's output.
std::size_t block_bytes(double n, double c, double heads, double t, double s, nn::Recompute recompute) {
  if (recompute == nn::Recompute::full) return floats(n * c / s);  // its input: the previous block's output
  std::size_t bytes = floats(n * c / s) + floats(2 * n / s) + floats(3 * n * c / t) + floats(n * c / s) + floats(n * c / s) +
                      floats(2 * n / s) + 2 * floats(4 * n * c / t) + floats(n * c / s);
  if (recompute == nn::Recompute::none) bytes += floats(n * c / t) + floats(n * heads / t);
  return bytes;
}

// The parameter ranges of a tensor-parallel rank's shard of nn::gpt(config) (`model`) over `ranks`
// ranks, holding `vocab` rows of wte: its layers as the model's, each block 12C^2/T + 7C/T split
// and 6C replicated parameters, the embedding its rows and the positions; the model's own for one rank.
std::vector<nn::ParameterRange> shard_ranges(nn::Sequential const& model, nn::GptConfig const& config, int ranks, double vocab) {
  std::vector<nn::ParameterRange> ranges = model.parameter_ranges();
  if (ranks == 1) return ranges;
  std::int64_t const c = config.n_embd, t = ranks;
  std::int64_t offset = 0;
  for (nn::ParameterRange& r : ranges) {
    nn::Layer const& layer = model.layer(r.layer);
    std::int64_t size = r.size();
    if (dynamic_cast<nn::TransformerBlock const*>(&layer) != nullptr) {
      size = 12 * c * c / t + 7 * c / t + 6 * c;
    } else if (dynamic_cast<nn::Embedding const*>(&layer) != nullptr) {
      size = (static_cast<std::int64_t>(vocab) + config.block_size) * c;
    }
    r.begin = offset;
    r.end = offset += size;
  }
  return ranges;
}

// Each stage of each tensor-parallel rank of each replica of a pipeline (layout.cuts; replica a's
// rank r holds stage s on device (a * T + r) * stages + s, the executor's order), for `rows` rows of
// `config.block_size` tokens split over the replicas. A rank's stage holds its shard of each layer:
// a block 12C^2/T + 7C/T split and 6C replicated parameters, the embedding its vocab rows and the
// positions, the final LayerNorm 2C, and the LM head in a stage without the embedding a copy of its
// vocab rows of wte. With ZeRO-1 each replica keeps AdamW's state of 1/data_parallel of its chunk;
// ZeRO-2 holds what ZeRO-1 holds (the whole gradients, reduced in place, the owned ones packed at
// their front) and is predicted as ZeRO-1. ZeRO-3 holds the same gradients, and of the parameters
// the owned 1/data_parallel and at most two units (a block, the embedding, or the final LayerNorm
// and head), gathered per pass (with 16-bit compute their compute-type copies, and the float32
// staging of the one being gathered).
std::vector<GptMemory> predict_pipeline(nn::GptConfig const& config, std::int64_t rows, GptLayout const& layout,
                                        std::string const& what) {
  nn::Sequential const model = nn::gpt(config);
  std::vector<std::size_t> const& cuts = layout.cuts;
  bool increasing = cuts.size() >= 2 && cuts.front() == 0 && cuts.back() == model.size();
  for (std::size_t s = 1; s < cuts.size(); ++s) increasing = increasing && cuts[s] > cuts[s - 1];
  if (!increasing)
    throw Error(Errc::invalid_argument, what + " and " + std::to_string(cuts.size()) + " cuts (expected cuts from 0 to the model's " +
                                            std::to_string(model.size()) + " layers, increasing)");
  int const m = layout.micro_batches;
  std::vector<std::int64_t> const replica_rows = shard_sizes(rows, layout.data_parallel);  // as the executor splits them
  if (m < 1 || replica_rows.back() < m)
    throw Error(Errc::invalid_argument, what + " and " + std::to_string(m) +
                                            " micro-batches (expected 1 <= micro_batches <= each replica's rows)");
  auto const c = static_cast<double>(config.n_embd), heads = static_cast<double>(config.n_head);
  auto const block_size = static_cast<double>(config.block_size);
  int const ranks = layout.tensor_parallel;
  auto const t = static_cast<double>(ranks);
  double const split = layout.sequence_parallel ? t : 1.0;  // what holds 1/split of the tokens
  auto const stages = static_cast<int>(cuts.size()) - 1;
  std::vector<GptMemory> out;
  for (std::int64_t const replica : replica_rows) {
    std::vector<double> tokens;  // per micro-batch, split as the executor splits the rows
    for (std::int64_t const r : shard_sizes(replica, m)) tokens.push_back(static_cast<double>(r) * block_size);
    for (int r = 0; r < ranks; ++r) {
      auto const [vocab_begin, vocab_end] = vocab_shard(config.vocab, ranks, r);
      auto const vocab = static_cast<double>(vocab_end - vocab_begin);
      for (int s = 0; s < stages; ++s) {
        std::size_t const first = cuts[static_cast<std::size_t>(s)], end = cuts[static_cast<std::size_t>(s) + 1];
        double params = 0, blocks = 0;
        bool head = false;
        std::vector<double> units;  // ZeRO-3's: each block alone, the layers between blocks together
        bool in_block = true;
        auto const add = [&](double n, bool block) {
          params += n;
          if (block || in_block) units.push_back(0);
          units.back() += n;
          in_block = block;
        };
        for (std::size_t l = first; l < end; ++l) {
          nn::Layer const& layer = model.layer(l);
          if (dynamic_cast<nn::TransformerBlock const*>(&layer) != nullptr) {
            add(12 * c * c / t + 7 * c / t + 6 * c, true);
            blocks += 1;
          } else if (dynamic_cast<nn::Embedding const*>(&layer) != nullptr) {
            add((vocab + block_size) * c, false);
          } else if (dynamic_cast<nn::TiedLMHead const*>(&layer) != nullptr) {
            head = true;
            if (first > 0) add(vocab * c, false);  // its own copy of wte's rows
          } else {
            add(static_cast<double>(layer.parameter_count()), false);  // the final LayerNorm, dropout
          }
        }
        GptMemory g;
        g.parameters = g.gradients = floats(params) + copies(params, layout.compute);
        // ZeRO-1 over the replicas: a block of each bucket of the chunk (and its last few elements).
        auto const replicas = static_cast<double>(layout.data_parallel);
        bool const sharded = layout.data_parallel > 1 && layout.zero_stage >= 1;
        g.optimizer = 2 * floats(sharded ? std::ceil(params / replicas) + replicas : params);
        if (sharded && layout.zero_stage == 3 && !units.empty()) {
          std::sort(units.begin(), units.end(), std::greater<>());
          g.parameters = floats(std::ceil(params / replicas) + replicas);
          for (std::size_t u = 0; u < std::min<std::size_t>(2, units.size()); ++u)
            g.parameters += layout.compute == DType::float32 ? floats(units[u]) : copies(units[u], layout.compute);
          if (layout.compute != DType::float32) g.parameters += floats(units[0]);  // a gather's float32 staging
        }
        // The first micro-batches are the largest, and in flight together.
        int const in_flight = layout.gpipe ? m : std::min(m, stages - s);
        for (int i = 0; i < in_flight; ++i) {
          double const n = tokens[static_cast<std::size_t>(i)];
          g.activations += static_cast<std::size_t>(blocks) * block_bytes(n, c, heads, t, split, config.recompute) + floats(n * c / split);
          if (head) g.workspace += floats(n * c) + floats(2 * n) + floats(n * vocab);  // the final LayerNorm's, the logits'
        }
        if (config.recompute == nn::Recompute::full && blocks > 0)
          g.activations += block_bytes(tokens[0], c, heads, t, split, nn::Recompute::none) - floats(tokens[0] * c / split);
        g.workspace += floats(tokens[0] * (head ? std::max(8 * c / t - c, vocab) : 7 * c / t));
        out.push_back(g);
      }
    }
  }
  return out;
}

}  // namespace

std::vector<GptMemory> predict_gpt_memory(nn::GptConfig const& config, std::int64_t rows, GptLayout const& layout) {
  nn::Sequential const whole_model = nn::gpt(config);  // checks the config
  std::int64_t const whole = whole_model.parameter_count();
  int const replicas = layout.data_parallel, ranks = layout.tensor_parallel;
  std::string const what = "predict_gpt_memory with data_parallel " + std::to_string(replicas) + ", tensor_parallel " +
                           std::to_string(ranks) + ", zero_stage " + std::to_string(layout.zero_stage) + " and " +
                           std::to_string(rows) + " rows";
  if (replicas < 1 || ranks < 1)
    throw Error(Errc::invalid_argument, what + " (expected data_parallel >= 1 and tensor_parallel >= 1)");
  if (config.n_head % ranks != 0 || ranks > config.vocab)
    throw Error(Errc::invalid_argument, what + " for n_head " + std::to_string(config.n_head) + " and vocab " +
                                            std::to_string(config.vocab) +
                                            " (expected a tensor_parallel dividing n_head, at most the vocab)");
  if (layout.compute != DType::float32 && layout.compute != DType::bfloat16 && layout.compute != DType::float16)
    throw Error(Errc::invalid_argument, what + " in " + std::string(to_string(layout.compute)) + " (expected float32, bfloat16 or float16)");
  if (layout.zero_stage < 0 || layout.zero_stage > 3)
    throw Error(Errc::invalid_argument, what + " (expected zero_stage 0, 1, 2 or 3)");
  if (rows < replicas) throw Error(Errc::invalid_argument, what + " (expected at least one row per replica)");
  if (layout.sequence_parallel && (ranks < 2 || config.block_size % ranks != 0))
    throw Error(Errc::invalid_argument, what + " and sequence parallelism over block_size " + std::to_string(config.block_size) +
                                            " (expected tensor_parallel >= 2 dividing the block size)");
  if (!layout.cuts.empty()) return predict_pipeline(config, rows, layout, what);

  auto const c = static_cast<double>(config.n_embd), heads = static_cast<double>(config.n_head);
  auto const t = static_cast<double>(ranks), layers = static_cast<double>(config.n_layer);
  double const s = layout.sequence_parallel ? t : 1.0;
  // With ZeRO 1 to 3 over the replicas (of the whole model, or of each tensor-parallel rank's
  // shard) a rank owns 1/N of each bucket and its last (size mod N) elements; ZeRO-2 writes the
  // gradients into staging buffers: up to two of the largest bucket but the last (one per bucket
  // before the last), and one of the last; ZeRO-3 gathers the parameters into buffers of the same
  // sizes (two units' and the last's at the peak) and holds one unit's gradient staging at the
  // peak besides the last's. With 16-bit compute the layers use compute-type copies: of every
  // parameter up to ZeRO-2 and of every gradient (per unit with replicas, see below); ZeRO-3 gathers each unit in
  // float32 staging (one at a time) and keeps its compute-type copy, and each unit's gradients have
  // a compute-type copy besides their float32 staging. The owned gradients' memory comes with a
  // step's first reduce and the last bucket's staging with backward's start: counted at the peak,
  // which is an upper bound where the LM head's backward (before the first reduce) peaks, as in
  // models that the tied embedding dominates.
  bool const sharded = replicas > 1 && layout.zero_stage >= 1;
  DataParallelOptions options;
  options.zero_stage = layout.zero_stage;
  options.bucket_cap_bytes = layout.bucket_cap_bytes;
  options.first_bucket_cap_bytes = layout.first_bucket_cap_bytes;
  options.zero3_block_units = layout.zero3_block_units;
  std::vector<std::pair<std::size_t, std::size_t>> const parts = whole_model.structure_parts();
  std::vector<GptMemory> out;
  std::vector<std::int64_t> const replica_rows = shard_sizes(rows, replicas);  // as the executors split them
  for (int a = 0; a < replicas; ++a) {
    double const n = static_cast<double>(replica_rows[static_cast<std::size_t>(a)] * config.block_size);
    for (int r = 0; r < ranks; ++r) {
      auto const [begin, end] = vocab_shard(config.vocab, ranks, r);
      auto const vocab = static_cast<double>(end - begin);
      // Split: qkv and fc by columns, both projections by rows (their biases replicated), the
      // embedding by vocab rows; replicated: LayerNorms, positions, the final LayerNorm.
      double const params = ranks == 1 ? static_cast<double>(whole)
                                       : layers * (12 * c * c / t + 7 * c / t + 6 * c) + vocab * c +
                                             static_cast<double>(config.block_size) * c + 2 * c;
      double owned = 0, staging = 0, last_bucket = 0;
      std::size_t staging_buffers = 0;
      if (sharded) {
        std::vector<Bucket> const buckets = detail::plan_buckets(parts, shard_ranges(whole_model, config, ranks, vocab), options);
        for (std::size_t b = 0; b < buckets.size(); ++b) {
          owned += static_cast<double>(buckets[b].size() / replicas + buckets[b].size() % replicas);
          if (b + 1 < buckets.size()) staging = std::max(staging, static_cast<double>(buckets[b].size()));
        }
        last_bucket = static_cast<double>(buckets.back().size());
        staging_buffers = std::min<std::size_t>(2, buckets.size() - 1);
      }
      GptMemory m;
      DType const compute = layout.compute;
      // With replicas, 16-bit layers write their gradients into a buffer per unit
      // (GradientSync::unit_compute_gradients()) below ZeRO-3: at the peak the embedding unit's and
      // two blocks' (the one backward computes, the one before whose memory goes once unscaled).
      std::size_t gradient_copies = copies(params, compute);
      if (replicas > 1 && layout.zero_stage < 3 && compute != DType::float32) {
        std::vector<Bucket> const units = detail::plan_units(parts, shard_ranges(whole_model, config, ranks, vocab));
        double largest = 0;
        for (std::size_t u = 0; u + 1 < units.size(); ++u) largest = std::max(largest, static_cast<double>(units[u].size()));
        gradient_copies = std::min<std::size_t>(2, units.size() - 1) * copies(largest, compute) +
                          copies(static_cast<double>(units.back().size()), compute);
      }
      m.parameters = floats(params) + copies(params, compute);
      m.gradients = floats(params) + gradient_copies;
      m.optimizer = 2 * floats(sharded ? owned : params);
      if (sharded && layout.zero_stage >= 2)  // the owned gradients, and the staging buffers the layers write into
        m.gradients = floats(owned) + staging_buffers * floats(staging) + floats(last_bucket) + gradient_copies;
      if (sharded && layout.zero_stage == 3) {  // the owned parameters, and the units gathered at the peak
        std::size_t const units = std::min<std::size_t>(1, staging_buffers);
        if (compute == DType::float32) {
          m.parameters = floats(owned) + staging_buffers * floats(staging) + floats(last_bucket);
        } else {
          m.parameters = floats(owned) + staging_buffers * copies(staging, compute) + copies(last_bucket, compute) + units * floats(staging);
        }
        // ZeRO-3's units keep their gradients' staging from backward's start on them to their
        // reduce: at the peak (the last block's backward) one block's and the embedding's.
        m.gradients = floats(owned) + units * (floats(staging) + copies(staging, compute)) + floats(last_bucket) + copies(last_bucket, compute);
      }
      m.activations = static_cast<std::size_t>(layers) * block_bytes(n, c, heads, t, s, config.recompute);
      if (config.recompute == nn::Recompute::full)  // the rerun block, less its input
        m.activations += block_bytes(n, c, heads, t, s, nn::Recompute::none) - floats(n * c / s);
      // The final LayerNorm's output and statistics, the logits' (or their gradient's) and backward's
      // temporaries, as on a pipeline's last stage.
      m.workspace = floats(n * c) + floats(n * c) + floats(2 * n) + floats(n * vocab) + floats(n * std::max(8 * c / t - c, vocab));
      if (config.dropout > 0 && ranks == 1) m.workspace += floats(n * c);  // the embedding's Dropout writes a new tensor
      out.push_back(m);
    }
  }
  return out;
}

}  // namespace mgpu::parallel
