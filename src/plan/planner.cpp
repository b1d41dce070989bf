// The layout planner: the step-time model, the enumeration of layouts, and the measurement of a
// GPT's costs on a device group (see planner.hpp).
#include <mgpu/plan/planner.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <random>
#include <thread>

#include <mgpu/comm/communicator.hpp>
#include <mgpu/core/error.hpp>
#include <mgpu/core/memory.hpp>
#include <mgpu/core/tensor.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/nn/transformer.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/parallel/data_parallel.hpp>
#include <mgpu/parallel/memory_model.hpp>
#include <mgpu/parallel/tensor_parallel.hpp>
#include <mgpu/parallel/zero_stages.hpp>
#include <mgpu/pipeline/pipeline.hpp>

namespace mgpu::plan {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

double median(std::vector<double> values) {
  std::nth_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(values.size() / 2), values.end());
  return values[values.size() / 2];
}

// The least-squares line through (tokens, seconds); through the origin's slope for one size.
CostLine fit(std::vector<double> const& tokens, std::vector<double> const& seconds) {
  auto const n = static_cast<double>(tokens.size());
  double const mx = std::accumulate(tokens.begin(), tokens.end(), 0.0) / n;
  double const my = std::accumulate(seconds.begin(), seconds.end(), 0.0) / n;
  double sxx = 0, sxy = 0;
  for (std::size_t i = 0; i < tokens.size(); ++i) sxx += (tokens[i] - mx) * (tokens[i] - mx), sxy += (tokens[i] - mx) * (seconds[i] - my);
  if (sxx <= 0) return {0, my / mx};
  CostLine line{0, sxy / sxx};
  line.fixed = my - line.per_token * mx;
  if (line.fixed < 0) line = {0, my / mx};  // noise: no overhead rather than a negative one
  if (line.per_token < 0) line = {my, 0};
  return line;
}

parallel::GptLayout memory_layout(Layout const& layout) {
  return {.data_parallel = layout.data_parallel,
          .tensor_parallel = layout.tensor_parallel,
          .zero_stage = layout.zero_stage,
          .cuts = layout.cuts,
          .micro_batches = layout.micro_batches,
          .sequence_parallel = layout.sequence_parallel};
}

nn::GptConfig with_recompute(nn::GptConfig config, nn::Recompute recompute) {
  config.recompute = recompute;
  return config;
}

GroupCost const* group_cost(std::vector<GroupCost> const& costs, int ranks) {
  for (GroupCost const& c : costs)
    if (c.ranks == ranks) return &c;
  return nullptr;
}

// Each layer's predicted forward + backward seconds for a micro-batch of `tokens` on one rank, in
// seconds of a device of its own: one device's lines (the embedding's on the embedding, the
// blocks' on each block, the head's on the head); or a measured group's (`group`: tensor-parallel
// ranks, or data-parallel replicas), its block on each block and the rest of its step on the head,
// scaled by `busy` (a rank's share of a device's compute when measured sharing it), with a
// recomputing block's extra work over the `split` ranks that share a block, slowed as the group's
// measured block is against one device's alone (ranks that share a machine's memory and caches).
std::vector<double> layer_seconds(nn::Sequential const& model, GptCosts const& costs, nn::Recompute recompute, double tokens,
                                  GroupCost const* group = nullptr, double busy = 1, double split = 1) {
  auto const r = static_cast<int>(recompute);
  double const alone = costs.block[0].at(tokens);
  double const slowdown = group == nullptr || alone <= 0 ? 1.0 : std::max(1.0, busy * group->block.at(tokens) * split / alone);
  std::vector<double> seconds;
  for (std::size_t l = 0; l < model.size(); ++l) {
    nn::Layer const& layer = model.layer(l);
    if (dynamic_cast<nn::TransformerBlock const*>(&layer) != nullptr) {
      seconds.push_back(group == nullptr ? costs.block[r].at(tokens)
                                         : busy * group->block.at(tokens) + (costs.block[r].at(tokens) - alone) / split * slowdown);
    } else if (dynamic_cast<nn::Embedding const*>(&layer) != nullptr) {
      seconds.push_back(group == nullptr ? costs.embedding.at(tokens) : 0.0);  // within the rest, on the head
    } else if (dynamic_cast<nn::TiedLMHead const*>(&layer) != nullptr) {
      seconds.push_back(group == nullptr ? costs.head.at(tokens) : busy * group->rest.at(tokens));
    } else {
      seconds.push_back(0.0);  // dropout, the final LayerNorm: within the embedding's and the head's lines
    }
    // Lines fitted to timings of a loaded machine (and recomputation's difference to none) can dip
    // below zero at a small batch: no layer costs less than nothing.
    seconds.back() = std::max(0.0, seconds.back());
  }
  return seconds;
}

// An all-reduce of `bytes` over `ranks` ranks.
double all_reduce_seconds(GptCosts const& costs, double bytes, int ranks) {
  if (ranks < 2) return 0;
  auto const n = static_cast<double>(ranks);
  return costs.collective_seconds + bytes * 2 * (n - 1) / n / costs.collective_bytes_per_second;
}

// The rows of a replica's largest micro-batch, in tokens.
double micro_batch_tokens(nn::GptConfig const& config, std::int64_t rows, Layout const& layout) {
  std::int64_t const replica = shard_sizes(rows, layout.data_parallel).front();
  return static_cast<double>(shard_sizes(replica, layout.micro_batches).front() * config.block_size);
}

}  // namespace

std::string to_string(Layout const& layout) {
  std::string text = "dp " + std::to_string(layout.data_parallel) + " x tp " + std::to_string(layout.tensor_parallel) + " x pp " +
                     std::to_string(layout.stages);
  if (layout.stages > 1) text += ", " + std::to_string(layout.micro_batches) + " micro-batches";
  if (layout.sequence_parallel) text += ", sequence parallel";
  if (layout.data_parallel > 1 && parallel::max_zero_stage(DType::float32, layout.stages > 1) >= 0)  // replicas with a stage
    text += ", ZeRO " + std::to_string(layout.zero_stage);
  return text + ", recompute " + std::string(nn::to_string(layout.recompute));
}

double predict_step_seconds(nn::GptConfig const& config, std::int64_t rows, Layout const& layout, GptCosts const& costs) {
  nn::GptConfig const c = with_recompute(config, layout.recompute);
  // Checks the layout, and gives each device's parameters and owned optimizer state.
  std::vector<parallel::GptMemory> const memory = parallel::predict_gpt_memory(c, rows, memory_layout(layout));
  // The same without ZeRO: each device's whole parameters (of its shard or stage).
  parallel::GptLayout replicated_layout = memory_layout(layout);
  replicated_layout.zero_stage = 0;
  std::vector<parallel::GptMemory> const replicated =
      layout.zero_stage == 0 ? memory : parallel::predict_gpt_memory(c, rows, replicated_layout);
  if (layout.stages != (layout.cuts.empty() ? 1 : static_cast<int>(layout.cuts.size()) - 1))
    throw Error(Errc::invalid_argument, "predict_step_seconds with " + std::to_string(layout.stages) + " stages and " +
                                            std::to_string(layout.cuts.size()) +
                                            " cuts (expected stages + 1 cuts for a pipeline, none for one stage)");
  int const d = layout.data_parallel, t = layout.tensor_parallel, s = layout.stages, m = layout.micro_batches;
  double const tokens = micro_batch_tokens(c, rows, layout);
  nn::Sequential const model = nn::gpt(c);
  auto const devices = static_cast<double>(d * t * s);
  double const shared = costs.concurrency > 0 ? std::min(devices, static_cast<double>(costs.concurrency)) : devices;
  // Measured groups: tensor-parallel ranks (required), or data-parallel replicas alone (when
  // measured: their step holds ZeRO-1's update and collectives).
  GroupCost const* group = nullptr;
  if (t > 1) {
    group = group_cost(costs.tensor_parallel, t);
    if (group == nullptr)
      throw Error(Errc::invalid_argument, "predict_step_seconds with tensor_parallel " + std::to_string(t) +
                                              " (expected costs.tensor_parallel to hold its costs)");
  } else if (d > 1 && s == 1) {
    group = group_cost(costs.data_parallel, d);
  }
  bool const measured_replicas = t == 1 && group != nullptr;
  int const ranks = t > 1 ? t : d;
  double const busy = costs.concurrency > 0 ? std::min(1.0, static_cast<double>(costs.concurrency) / ranks) : 1.0;
  // Each device's update of its owned elements (of its shard or stage; 1/d of them with ZeRO over
  // d replicas). A measured data-parallel step updated 1/d of the parameters (ZeRO-1): ZeRO-0
  // updates the rest too.
  double update = 0, updates = 0, gradient_bytes = 0;
  for (std::size_t i = 0; i < memory.size(); ++i) {
    double owned = static_cast<double>(memory[i].optimizer) / (2 * sizeof(float)) * costs.update_seconds_per_element;
    if (measured_replicas) owned = layout.zero_stage == 0 ? owned * (1 - 1.0 / d) : 0.0;
    update = std::max(update, owned);
    updates += owned;
    gradient_bytes = std::max(gradient_bytes, static_cast<double>(replicated[i].parameters));
  }
  // Each device's compute in seconds of a device of its own: the critical path, and the work of
  // every device. The largest replica's micro-batches (the first ones the largest): the first
  // passes every stage, the others follow at the slowest stage's pace.
  double path = 0, work = 0;
  std::vector<std::size_t> const cuts = layout.cuts.empty() ? std::vector<std::size_t>{0, model.size()} : layout.cuts;
  std::vector<std::int64_t> const micro = shard_sizes(shard_sizes(rows, d).front(), m);
  for (std::size_t b = 0; b < micro.size(); ++b) {
    std::vector<double> const seconds = layer_seconds(model, costs, layout.recompute, static_cast<double>(micro[b] * c.block_size),
                                                      group, busy, t);
    double sum = 0, slowest = 0;
    for (std::size_t i = 0; i + 1 < cuts.size(); ++i) {
      double const stage = std::accumulate(seconds.begin() + static_cast<std::ptrdiff_t>(cuts[i]),
                                           seconds.begin() + static_cast<std::ptrdiff_t>(cuts[i + 1]), 0.0);
      sum += stage, slowest = std::max(slowest, stage);
    }
    path += b == 0 ? sum : slowest;
    work += static_cast<double>(d * t) * sum;
  }
  double step = std::max(path + update, (work + updates) / shared);

  // The replicas' gradients (of the whole model, or of each tensor-parallel rank's shard, over the
  // d replicas): all-reduced in buckets (25 MiB, the first 1 MiB), or reduce-scattered and
  // all-gathered with ZeRO; ZeRO-3's buckets are its units (a block each, the embedding, the
  // final LayerNorm), it all-gathers every unit's parameters before forward and units 2 to B - 2
  // again in backward (an all-gather: half an all-reduce's bytes).
  if (d > 1) {
    double const buckets = layout.zero_stage == 3 ? static_cast<double>(c.n_layer + 2)
                                                  : 1 + std::ceil(gradient_bytes / static_cast<double>(std::size_t{25} << 20));
    double const calls = layout.zero_stage > 0 ? 2 * buckets : buckets;
    if (!measured_replicas) step += all_reduce_seconds(costs, gradient_bytes, d) + (calls - 1) * costs.collective_seconds;
    if (layout.zero_stage == 3) {
      double const gathers = 1 + std::max(0.0, buckets - 4) / buckets;
      step += gathers * (all_reduce_seconds(costs, gradient_bytes, d) / 2 + (buckets - 1) * costs.collective_seconds);
    }
  }
  double const activation_bytes = tokens * static_cast<double>(c.n_embd) * sizeof(float);
  if (s > 1)  // each micro-batch's activations forward and gradients back, on the path
    step += 2 * (m + s - 1) * (costs.collective_seconds + activation_bytes / costs.collective_bytes_per_second);
  return step;
}

Plan plan_gpt(nn::GptConfig const& config, std::int64_t rows, int devices, GptCosts const& costs, PlanOptions const& options) {
  nn::Sequential const model = nn::gpt(config);  // checks the config
  if (devices < 1 || rows < 1)
    throw Error(Errc::invalid_argument, "plan_gpt over " + std::to_string(devices) + " devices for " + std::to_string(rows) +
                                            " rows (expected at least one of each)");
  std::size_t const cut_points = model.cut_points().size() - 1;  // the most stages
  Plan plan;
  std::size_t smallest = std::numeric_limits<std::size_t>::max();
  std::string smallest_layout;
  // The ZeRO stages to weigh over d replicas (float32: the memory model's), as the trainer runs
  // them (parallel::max_zero_stage: 0 to 3).
  auto const most_zero = [&](int d, bool pipeline) {
    return d > 1 && options.zero ? std::max(0, parallel::max_zero_stage(DType::float32, pipeline)) : 0;
  };
  auto const weigh = [&](Layout const& layout) {
    ++plan.considered;
    nn::GptConfig const c = with_recompute(config, layout.recompute);
    std::size_t peak = 0;
    for (parallel::GptMemory const& m : parallel::predict_gpt_memory(c, rows, memory_layout(layout))) peak = std::max(peak, m.total());
    if (peak < smallest) smallest = peak, smallest_layout = to_string(layout);
    if (peak > options.memory_bytes) return;
    plan.candidates.push_back({layout, peak, predict_step_seconds(config, rows, layout, costs)});
  };
  for (int t = 1; t <= devices; ++t) {
    if (devices % t != 0 || config.n_head % t != 0 || t > config.vocab ||
        (t > 1 && (!options.tensor_parallel || group_cost(costs.tensor_parallel, t) == nullptr)))
      continue;
    for (int s = 1; s <= devices / t; ++s) {
      int const d = devices / t / s;
      if ((devices / t) % s != 0 || static_cast<std::size_t>(s) > cut_points || (s > 1 && !options.pipeline)) continue;
      std::int64_t const replica_rows = rows / d;  // the smallest replica's
      if (replica_rows < 1) continue;
      for (nn::Recompute const recompute : {nn::Recompute::none, nn::Recompute::selective, nn::Recompute::full}) {
        if (s == 1) {
          for (bool const sequence_parallel : {false, true}) {
            if (sequence_parallel && (t == 1 || config.block_size % t != 0)) continue;
            for (int zero = 0; zero <= most_zero(d, false); ++zero)
              weigh({.data_parallel = d, .tensor_parallel = t, .zero_stage = zero, .sequence_parallel = sequence_parallel,
                     .recompute = recompute});
          }
          continue;
        }
        for (int k = 1; k <= 4 && s * k <= replica_rows; k *= 2) {
          Layout layout{.data_parallel = d, .tensor_parallel = t, .stages = s, .recompute = recompute, .micro_batches = s * k};
          // Stages cut where the predicted times balance, as pipeline::partition cuts for the executor.
          GroupCost const* const tensor = t > 1 ? group_cost(costs.tensor_parallel, t) : nullptr;
          std::vector<double> const seconds =
              layer_seconds(model, costs, recompute, micro_batch_tokens(config, rows, layout), tensor, 1.0, t);
          pipeline::LayerProfile const profile{seconds, std::vector<double>(seconds.size(), 0.0), std::vector<double>(seconds.size(), 0.0)};
          layout.cuts = pipeline::partition(model, pipeline::one_f_one_b(s, layout.micro_batches), profile,
                                            std::vector<pipeline::StageDevice>(static_cast<std::size_t>(s)))
                            .cuts;
          for (bool const sequence_parallel : {false, true}) {
            if (sequence_parallel && (t == 1 || config.block_size % t != 0)) continue;
            for (int zero = 0; zero <= most_zero(d, true); ++zero) {
              layout.sequence_parallel = sequence_parallel, layout.zero_stage = zero;
              weigh(layout);
            }
          }
        }
      }
    }
  }
  if (plan.considered == 0)
    throw Error(Errc::invalid_argument, "plan_gpt: no layout over " + std::to_string(devices) + " devices for " +
                                            std::to_string(rows) + " rows and n_head " + std::to_string(config.n_head) +
                                            " (expected a data-parallel degree at most the rows, a tensor-parallel one dividing "
                                            "n_head, or a pipeline's stages x micro-batches at most a replica's rows)");
  if (plan.candidates.empty())
    throw Error(Errc::out_of_memory, "plan_gpt: none of " + std::to_string(plan.considered) + " layouts over " +
                                         std::to_string(devices) + " devices fits " + std::to_string(options.memory_bytes) +
                                         " bytes per device (the smallest, " + smallest_layout + ", needs " +
                                         std::to_string(smallest) + ")");
  std::stable_sort(plan.candidates.begin(), plan.candidates.end(), [](Candidate const& a, Candidate const& b) {
    return a.step_seconds != b.step_seconds ? a.step_seconds < b.step_seconds : a.peak_bytes < b.peak_bytes;
  });
  return plan;
}

GptCosts measure_gpt_costs(nn::GptConfig const& config, DeviceGroup& group, std::vector<std::int64_t> const& rows, int repeats) {
  (void)nn::gpt(config);  // checks the config
  if (rows.empty() || *std::min_element(rows.begin(), rows.end()) < 1 || repeats < 1)
    throw Error(Errc::invalid_argument, "measure_gpt_costs with " + std::to_string(rows.size()) + " row counts and " +
                                            std::to_string(repeats) + " repeats (expected at least one count, each >= 1, and repeats >= 1)");
  GptCosts costs;
  int hosts = 0;
  for (Device const& device : group.devices()) hosts += device.kind == DeviceKind::host ? 1 : 0;
  if (hosts > 0) costs.concurrency = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  auto host = Allocator::create({DeviceKind::host, 0});
  std::mt19937 rng(1);
  // Random ids (rows [0, r)) and targets (rows [r, 2r)) in host memory.
  auto const batch = [&](std::int64_t r) {
    Tensor const ids = Tensor::empty({2 * r, config.block_size}, DType::int32, *host);
    std::uniform_int_distribution<std::int32_t> token(0, static_cast<std::int32_t>(config.vocab) - 1);
    for (std::int32_t& id : ids.host_span<std::int32_t>()) id = token(rng);
    return ids;
  };

  std::vector<double> tokens;
  for (std::int64_t const r : rows) tokens.push_back(static_cast<double>(r * config.block_size));
  std::vector<double> block[3], embedding, head;
  double update = 0;
  group.run([&](int rank, Device device, Stream& stream) {
    if (rank != 0) return;
    Allocator& allocator = group.allocator(0);
    nn::Context ctx{allocator, stream};
    nn::TokenCrossEntropy const loss;
    for (nn::Recompute const recompute : {nn::Recompute::none, nn::Recompute::selective, nn::Recompute::full}) {
      nn::Sequential model = nn::gpt(with_recompute(config, recompute));
      model.materialize(ctx, 1);
      for (std::int64_t const r : rows) {
        Tensor const ids_host = batch(r);
        Tensor const ids = device.kind == DeviceKind::host ? ids_host : Tensor::empty(ids_host.shape(), DType::int32, allocator);
        if (device.kind != DeviceKind::host) copy_async(ids, ids_host, stream);
        Tensor const x = ids.slice(0, r), y = ids.slice(r, 2 * r);
        // One pass: forward, the loss and backward, waiting for each layer when `per_layer` (its
        // seconds added to `layer`), or for the whole pass; returns the pass's seconds.
        auto const pass = [&](bool per_layer, std::vector<double>& layer) {
          stream.synchronize();
          auto const start = Clock::now();
          Tensor h = x;
          for (std::size_t l = 0; l < model.size(); ++l) {
            auto const begin = Clock::now();
            h = model.layer(l).forward(h, ctx);
            if (per_layer) stream.synchronize(), layer[l] += seconds_since(begin);
          }
          auto const begin = Clock::now();
          Tensor const dh = Tensor::empty(h.shape(), h.dtype(), allocator);
          Tensor const value = Tensor::empty({1}, DType::float32, allocator);
          loss.compute(h, y, dh, value, r * config.block_size, 1.0f, allocator, stream);
          if (per_layer) stream.synchronize(), layer.back() += seconds_since(begin);  // the loss with the head
          Tensor g = dh;
          for (std::size_t l = model.size(); l-- > 0;) {
            auto const back = Clock::now();
            g = model.layer(l).backward(g, ctx);
            if (per_layer) stream.synchronize(), layer[l] += seconds_since(back);
          }
          stream.synchronize();
          return seconds_since(start);
        };
        std::vector<std::vector<double>> layer(model.size());
        std::vector<double> whole;
        for (int k = 0; k <= repeats; ++k) {  // the first passes make the caches, primitives and buffers
          std::vector<double> one(model.size(), 0.0);
          double const synchronized = pass(true, one);
          double const free_running = pass(false, one);
          if (k == 0) continue;
          // The layers' shares of the pass, scaled to the pass that does not wait for each layer.
          for (std::size_t l = 0; l < model.size(); ++l) layer[l].push_back(one[l] * free_running / synchronized);
          whole.push_back(free_running);
        }
        double blocks = 0, embed = 0, tail = 0;
        for (std::size_t l = 0; l < model.size(); ++l) {
          nn::Layer const& which = model.layer(l);
          double const s = median(layer[l]);
          if (dynamic_cast<nn::TransformerBlock const*>(&which) != nullptr) {
            blocks += s / static_cast<double>(config.n_layer);
          } else if (l + 2 >= model.size()) {  // the final LayerNorm and the head
            tail += s;
          } else {
            embed += s;
          }
        }
        block[static_cast<int>(recompute)].push_back(blocks);
        if (recompute != nn::Recompute::none) continue;
        embedding.push_back(embed), head.push_back(tail);
      }
      if (recompute != nn::Recompute::none) continue;
      // AdamW over the whole model.
      optim::AdamW adamw(optim::AdamWOptions{});
      std::vector<double> steps;
      for (int k = 0; k <= repeats; ++k) {
        stream.synchronize();
        auto const start = Clock::now();
        adamw.step(model.master_parameters(), model.master_gradients(), allocator, stream);
        stream.synchronize();
        if (k > 0) steps.push_back(seconds_since(start));
      }
      update = median(steps) / static_cast<double>(model.parameter_count());
    }
  });
  for (int r = 0; r < 3; ++r) costs.block[r] = fit(tokens, block[r]);
  costs.embedding = fit(tokens, embedding);
  costs.head = fit(tokens, head);
  costs.update_seconds_per_element = update;

  // A parallel step over the first n devices, on models of one and of two blocks: `step(executor
  // made by make(devices, config), ids, targets)` for `rows` rows per rank's batch (`replicas`
  // times as many in all). Its cost: the fastest of the steps (a step waits for every rank, so a
  // rank slowed by other work on the machine slows the whole step); a block is the difference.
  auto const measure_group = [&](int n, int replicas, auto const& make) {
    DeviceGroup devices(std::vector<Device>(group.devices().begin(), group.devices().begin() + n));
    std::vector<double> step[2];
    for (int blocks = 1; blocks <= 2; ++blocks) {
      nn::GptConfig c = config;
      c.n_layer = blocks;
      auto executor = make(devices, c);
      for (std::int64_t const r : rows) {
        std::int64_t const all = r * replicas;
        Tensor const ids = batch(all);
        double fastest = std::numeric_limits<double>::infinity();
        for (int k = 0; k <= std::max(repeats, 5); ++k) {
          auto const start = Clock::now();
          (void)executor->step(ids.slice(0, all), ids.slice(all, 2 * all));
          if (k > 0) fastest = std::min(fastest, seconds_since(start));
        }
        step[blocks - 1].push_back(fastest);
      }
    }
    std::vector<double> one_block, rest;
    for (std::size_t i = 0; i < rows.size(); ++i) {
      one_block.push_back(std::max(0.0, step[1][i] - step[0][i]));
      rest.push_back(std::max(0.0, step[0][i] - one_block.back()));
    }
    return GroupCost{n, fit(tokens, one_block), fit(tokens, rest)};
  };
  for (int n = 2; n <= group.size(); ++n) {
    if (group.size() % n != 0) continue;
    if (config.n_head % n == 0 && n <= config.vocab)
      costs.tensor_parallel.push_back(measure_group(n, 1, [](DeviceGroup& devices, nn::GptConfig const& c) {
        return std::make_unique<parallel::TensorParallel>(devices, nn::gpt(c),
                                                          parallel::TensorParallelOptions{.clip_norm = 1.0f});
      }));
    costs.data_parallel.push_back(measure_group(n, n, [](DeviceGroup& devices, nn::GptConfig const& c) {
      parallel::DataParallelOptions options;
      options.clip_norm = 1.0f;
      options.loss = std::make_shared<nn::TokenCrossEntropy>();
      return std::make_unique<parallel::DataParallel>(nn::gpt(c), devices, optim::AdamW(optim::AdamWOptions{}), std::move(options));
    }));
  }

  if (group.size() > 1) {  // all-reduces over the whole group: one value, then 1 Mi values
    std::unique_ptr<comm::Communicator> const communicator = comm::make_communicator(group);
    for (std::int64_t const values : {std::int64_t{1}, std::int64_t{1} << 20}) {
      std::vector<Tensor> buffers;
      for (int r = 0; r < group.size(); ++r) buffers.push_back(ops::zeros({values}, group.allocator(r), group.stream(r)));
      std::vector<double> runs;
      for (int k = 0; k <= 2 * repeats; ++k) {
        group.synchronize();
        auto const start = Clock::now();
        group.run([&](int r, Device, Stream& stream) {
          communicator->all_reduce(r, buffers[static_cast<std::size_t>(r)], buffers[static_cast<std::size_t>(r)], comm::ReduceOp::sum,
                                   stream);
        });
        group.synchronize();
        if (k > 0) runs.push_back(seconds_since(start));
      }
      double const seconds = median(runs);
      if (values == 1) {
        costs.collective_seconds = seconds;
      } else {
        auto const n = static_cast<double>(group.size());
        double const bus = static_cast<double>(values) * sizeof(float) * 2 * (n - 1) / n;
        costs.collective_bytes_per_second = bus / std::max(seconds - costs.collective_seconds, 1e-9);
      }
    }
  }
  return costs;
}

}  // namespace mgpu::plan
