// The per-device memory model of a GPT training step (see memory_model.hpp for what it counts).
#include <mgpu/parallel/memory_model.hpp>

#include <algorithm>
#include <functional>
#include <cmath>
#include <string>

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

// The allocator's bytes for a tensor of `values` elements of `bytes` each.
std::size_t elements(double values, std::size_t bytes) {
  return Allocator::block_size(static_cast<std::size_t>(std::max(0.0, values)) * bytes);
}

// The allocator's bytes for a copy of `values` elements in the 16-bit compute type `compute`; none
// for float32 compute (the masters are the tensors the layers use).
std::size_t copies(double values, DType compute) {
  if (compute == DType::float32) return 0;
  return elements(values, size_of(compute));
}

// What one transformer block keeps for backward, per tensor, for n tokens on one of t ranks (the
// split tensors hold 1/t of their columns; with sequence parallelism, s = t, the others hold 1/s
// of the tokens), in e-byte elements of the compute type (the statistics in float32): LN1's
// output and statistics, qkv, the attention's output and log-sum-exp, the residual stream h,
// LN2's output and statistics, the MLP's pre-activation and GELU output, the block's output.
std::size_t block_bytes(double n, double c, double heads, double t, double s, nn::Recompute recompute, std::size_t e) {
  auto v = [e](double values) { return elements(values, e); };
  if (recompute == nn::Recompute::full) return v(n * c / s);  // its input: the previous block's output
  std::size_t bytes = v(n * c / s) + floats(2 * n / s) + v(3 * n * c / t) + v(n * c / s) + v(n * c / s) + floats(2 * n / s) +
                      2 * v(4 * n * c / t) + v(n * c / s);
  if (recompute == nn::Recompute::none) bytes += v(n * c / t) + floats(n * heads / t);
  return bytes;
}

// What one block keeps between its backward_input and backward_weight (a zero-bubble schedule's
// split backward), for n tokens on one of t ranks: each Linear's input (LN1's output, the
// attention's output, LN2's output, the GELU output) and its output's gradient (qkv's, the
// projection's, fc's, the MLP projection's), in e-byte elements.
std::size_t block_weight_bytes(double n, double c, double t, std::size_t e) {
  auto v = [e](double values) { return elements(values, e); };
  return v(n * c) + v(n * c / t) + v(n * c) + v(4 * n * c / t) + v(3 * n * c / t) + v(n * c) + v(4 * n * c / t) + v(n * c);
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

// GPipe's or 1F1B's passes on each of `devices` devices, one chunk each (`gpipe`: every forward,
// then every backward in order; 1F1B: devices - d forwards, then a backward and a forward in turn).
std::vector<std::vector<GptPass>> default_passes(int devices, int micro_batches, bool gpipe) {
  std::vector<std::vector<GptPass>> out(static_cast<std::size_t>(devices));
  for (int d = 0; d < devices; ++d) {
    std::vector<GptPass>& passes = out[static_cast<std::size_t>(d)];
    int const warmup = gpipe ? micro_batches : std::min(micro_batches, devices - d);
    int forward = 0, backward = 0;
    for (; forward < warmup; ++forward) passes.push_back({GptPass::Kind::forward, forward, d});
    for (; backward < micro_batches; ++backward) {
      passes.push_back({GptPass::Kind::backward, backward, d});
      if (forward < micro_batches) passes.push_back({GptPass::Kind::forward, forward++, d});
    }
  }
  return out;
}

// Each device of each tensor-parallel rank of each replica of a pipeline (layout.cuts; replica a's
// rank r holds pipeline device d on device (a * T + r) * devices + d, the executor's order), for
// `rows` rows of `config.block_size` tokens split over the replicas. A rank's chunk holds its shard
// of each layer: a block 12C^2/T + 7C/T split and 6C replicated parameters, the embedding its vocab
// rows and the positions, the final LayerNorm 2C, and the LM head in a chunk without the embedding
// a copy of its vocab rows of wte. With ZeRO-1 each replica keeps AdamW's state of 1/data_parallel
// of its chunks; ZeRO-2 holds what ZeRO-1 holds (the whole gradients, reduced in place, the owned
// ones packed at their front); ZeRO-3 holds the same gradients, and of the parameters the owned
// 1/data_parallel of its chunks and at most two units (a block, or the layers between blocks
// together: the embedding, the final LayerNorm and head), gathered per pass (with 16-bit compute
// their compute-type copies, and the float32 staging of the one being gathered). Each device's
// passes are walked in order: a forward keeps its micro-batch's activations, a backward frees them
// (a backward_input keeps what backward_weight needs, until it runs), and the peak is the largest
// sum at a backward's start with that backward's temporaries.
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
  auto const chunks = static_cast<int>(cuts.size()) - 1;
  std::vector<std::vector<GptPass>> const passes = layout.passes.empty() ? default_passes(chunks, m, layout.gpipe) : layout.passes;
  auto const devices = static_cast<int>(passes.size());
  {  // each chunk's forward and backward of each micro-batch once, on its device, in that order
    std::vector<int> seen(static_cast<std::size_t>(chunks) * static_cast<std::size_t>(m) * 4, 0);
    bool valid = chunks % devices == 0;
    for (int d = 0; valid && d < devices; ++d) {
      for (GptPass const& p : passes[static_cast<std::size_t>(d)]) {
        valid = valid && p.chunk >= 0 && p.chunk < chunks && p.chunk % devices == d && p.micro_batch >= 0 && p.micro_batch < m;
        if (!valid) break;
        std::size_t const at = (static_cast<std::size_t>(p.chunk) * static_cast<std::size_t>(m) + static_cast<std::size_t>(p.micro_batch)) * 4;
        // A backward after its forward, a backward_weight after its backward_input.
        if (p.kind == GptPass::Kind::backward || p.kind == GptPass::Kind::backward_input) valid = seen[at] == 1;
        if (p.kind == GptPass::Kind::backward_weight) valid = seen[at + 2] == 1;
        ++seen[at + static_cast<std::size_t>(p.kind)];
      }
    }
    for (std::size_t i = 0; valid && i < seen.size(); i += 4)
      valid = seen[i] == 1 && (seen[i + 1] == 1 ? seen[i + 2] + seen[i + 3] == 0 : seen[i + 1] == 0 && seen[i + 2] == 1 && seen[i + 3] == 1);
    if (!valid)
      throw Error(Errc::invalid_argument, what + ", " + std::to_string(chunks) + " chunks and passes over " + std::to_string(devices) +
                                              " devices (expected each chunk c's forward and backward, or backward_input and "
                                              "backward_weight, of each of the " +
                                              std::to_string(m) + " micro-batches once, in that order, on device c % devices)");
  }
  auto const c = static_cast<double>(config.n_embd), heads = static_cast<double>(config.n_head);
  auto const block_size = static_cast<double>(config.block_size);
  int const ranks = layout.tensor_parallel;
  auto const t = static_cast<double>(ranks);
  double const split = layout.sequence_parallel ? t : 1.0;  // what holds 1/split of the tokens
  std::size_t const e = size_of(layout.compute);            // the activations' element bytes
  auto v = [e](double values) { return elements(values, e); };
  std::vector<GptMemory> out;
  for (std::int64_t const replica : replica_rows) {
    std::vector<double> tokens;  // per micro-batch, split as the executor splits the rows
    for (std::int64_t const r : shard_sizes(replica, m)) tokens.push_back(static_cast<double>(r) * block_size);
    for (int r = 0; r < ranks; ++r) {
      auto const [vocab_begin, vocab_end] = vocab_shard(config.vocab, ranks, r);
      auto const vocab = static_cast<double>(vocab_end - vocab_begin);
      // Per chunk: its parameters, blocks, and whether it holds the LM head.
      std::vector<double> params(static_cast<std::size_t>(chunks), 0.0), blocks(static_cast<std::size_t>(chunks), 0.0);
      std::vector<char> head(static_cast<std::size_t>(chunks), 0);
      std::vector<std::vector<double>> units(static_cast<std::size_t>(chunks));  // ZeRO-3's: each block alone, the layers between blocks together
      for (int k = 0; k < chunks; ++k) {
        auto const ck = static_cast<std::size_t>(k);
        bool in_block = true;
        auto const add = [&](double n, bool block) {
          params[ck] += n;
          if (block || in_block) units[ck].push_back(0);
          units[ck].back() += n;
          in_block = block;
        };
        for (std::size_t l = cuts[ck]; l < cuts[ck + 1]; ++l) {
          nn::Layer const& layer = model.layer(l);
          if (dynamic_cast<nn::TransformerBlock const*>(&layer) != nullptr) {
            add(12 * c * c / t + 7 * c / t + 6 * c, true);
            blocks[ck] += 1;
          } else if (dynamic_cast<nn::Embedding const*>(&layer) != nullptr) {
            add((vocab + block_size) * c, false);
          } else if (dynamic_cast<nn::TiedLMHead const*>(&layer) != nullptr) {
            head[ck] = 1;
            if (cuts[ck] > 0) add(vocab * c, false);  // its own copy of wte's rows
          } else {
            add(static_cast<double>(layer.parameter_count()), false);  // the final LayerNorm, dropout
          }
        }
      }
      // What chunk k keeps for backward of a micro-batch of n tokens (its blocks', its input, the
      // head's final LayerNorm output and statistics and logits), what it keeps from
      // backward_input to backward_weight (the blocks' Linear inputs and output gradients, the
      // embedding's output gradient, the head's input and logits' gradient; nothing for
      // tensor-parallel layers, whose backward_input is their whole backward), and backward's
      // temporaries (with full recomputation the rerun block, less its input).
      auto kept = [&](int k, double n) {
        auto const ck = static_cast<std::size_t>(k);
        std::size_t bytes = static_cast<std::size_t>(blocks[ck]) * block_bytes(n, c, heads, t, split, config.recompute, e) + v(n * c / split);
        if (head[ck] != 0) bytes += v(n * c) + floats(2 * n) + v(n * vocab);
        return bytes;
      };
      auto weight_kept = [&](int k, double n) -> std::size_t {
        if (ranks > 1) return 0;  // tensor-parallel layers run their whole backward in backward_input
        auto const ck = static_cast<std::size_t>(k);
        std::size_t bytes = static_cast<std::size_t>(blocks[ck]) * block_weight_bytes(n, c, t, e);
        if (cuts[ck] == 0) bytes += v(n * c);                        // the embedding's output gradient
        if (head[ck] != 0) bytes += v(n * c) + v(n * vocab);        // the head's input and the logits' gradient
        return bytes;
      };
      auto temporaries = [&](int k, double n) {
        auto const ck = static_cast<std::size_t>(k);
        std::size_t bytes = v(n * (head[ck] != 0 ? std::max(8 * c / t - c, vocab) : 7 * c / t));
        if (config.recompute == nn::Recompute::full && blocks[ck] > 0)
          bytes += block_bytes(n, c, heads, t, split, nn::Recompute::none, e) - v(n * c / split);
        return bytes;
      };
      for (int d = 0; d < devices; ++d) {
        GptMemory g;
        std::size_t owned_state = 0;
        auto const replicas = static_cast<double>(layout.data_parallel);
        bool const sharded = layout.data_parallel > 1 && layout.zero_stage >= 1;
        std::size_t owned_parameters = 0;
        std::vector<double> device_units;
        for (int k = d; k < chunks; k += devices) {
          double const p = params[static_cast<std::size_t>(k)];
          g.gradients += floats(p) + copies(p, layout.compute);
          // ZeRO-1 over the replicas: a block of each bucket of the chunk (and its last few elements).
          owned_state += 2 * floats(sharded ? std::ceil(p / replicas) + replicas : p);
          owned_parameters += floats(std::ceil(p / replicas) + replicas);
          device_units.insert(device_units.end(), units[static_cast<std::size_t>(k)].begin(), units[static_cast<std::size_t>(k)].end());
        }
        g.parameters = g.gradients;
        if (sharded && layout.zero_stage == 3 && !device_units.empty()) {  // the owned pieces and the two largest units
          std::sort(device_units.begin(), device_units.end(), std::greater<>());
          g.parameters = owned_parameters;
          for (std::size_t u = 0; u < std::min<std::size_t>(2, device_units.size()); ++u)
            g.parameters += layout.compute == DType::float32 ? floats(device_units[u]) : copies(device_units[u], layout.compute);
          if (layout.compute != DType::float32) g.parameters += floats(device_units[0]);  // a gather's float32 staging
        }
        g.optimizer = owned_state;
        // Walk the passes: the live bytes, and the peak at each backward's start with its temporaries.
        std::size_t live = 0, peak_live = 0, peak_temp = 0;
        for (GptPass const& p : passes[static_cast<std::size_t>(d)]) {
          double const n = tokens[static_cast<std::size_t>(p.micro_batch)];
          switch (p.kind) {
            case GptPass::Kind::forward: live += kept(p.chunk, n); break;
            case GptPass::Kind::backward:
            case GptPass::Kind::backward_input: {
              std::size_t const temp = temporaries(p.chunk, n);
              if (live + temp > peak_live + peak_temp) peak_live = live, peak_temp = temp;
              live -= kept(p.chunk, n);
              if (p.kind == GptPass::Kind::backward_input) live += weight_kept(p.chunk, n);
              break;
            }
            case GptPass::Kind::backward_weight: live -= weight_kept(p.chunk, n); break;
          }
        }
        g.activations = peak_live;
        g.workspace = peak_temp;
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
  // float32 staging (one at a time, gone by the peak) and keeps its compute-type copy, and each unit's gradients have
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
      // (GradientSync::unit_compute_gradients()) below ZeRO-3: at the peak (the last block's
      // backward) the embedding unit's and that block's (a unit's goes when backward enters the next).
      std::size_t gradient_copies = copies(params, compute);
      if (replicas > 1 && layout.zero_stage < 3 && compute != DType::float32) {
        std::vector<Bucket> const units = detail::plan_units(parts, shard_ranges(whole_model, config, ranks, vocab));
        double largest = 0;
        for (std::size_t u = 0; u + 1 < units.size(); ++u) largest = std::max(largest, static_cast<double>(units[u].size()));
        gradient_copies = std::min<std::size_t>(1, units.size() - 1) * copies(largest, compute) +
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
          m.parameters = floats(owned) + staging_buffers * copies(staging, compute) + copies(last_bucket, compute);
        }
        // ZeRO-3's units keep their gradients' staging from backward's start on them to their
        // reduce: at the peak (the last block's backward) one block's and the embedding's.
        m.gradients = floats(owned) + units * (floats(staging) + copies(staging, compute)) + floats(last_bucket) + copies(last_bucket, compute);
      }
      std::size_t const e = size_of(compute);  // the activations' element bytes
      auto v = [e](double values) { return elements(values, e); };
      m.activations = static_cast<std::size_t>(layers) * block_bytes(n, c, heads, t, s, config.recompute, e);
      if (config.recompute == nn::Recompute::full)  // the rerun block, less its input
        m.activations += block_bytes(n, c, heads, t, s, nn::Recompute::none, e) - v(n * c / s);
      // The final LayerNorm's output and statistics, the logits' (or their gradient's) and backward's
      // temporaries, as on a pipeline's last stage.
      m.workspace = v(n * c) + v(n * c) + floats(2 * n) + v(n * vocab) + v(n * std::max(8 * c / t - c, vocab));
      if (config.dropout > 0 && ranks == 1) m.workspace += v(n * c);  // the embedding's Dropout writes a new tensor
      out.push_back(m);
    }
  }
  return out;
}

}  // namespace mgpu::parallel
