// The Trainer's construction: the config validated, its mesh over the devices, then the executor
// the layout calls for.
#include <algorithm>
#include <numeric>
#include <utility>

#include <mgpu/comm/mesh.hpp>
#include <mgpu/nn/transformer.hpp>
#include <mgpu/sched/live.hpp>
#include <mgpu/sched/planning.hpp>

#include "train/trainer_impl.hpp"

namespace mgpu::train {

namespace {

// Each layer's forward + backward FLOPs for a micro-batch of `rows` sequences (3x the forward's
// multiply-adds x 2; element-wise layers count one pass), the costs the stages are cut by; a
// block's recomputation adds its attention core's forward (selective) or its whole forward (full).
pipeline::LayerProfile layer_costs(nn::Sequential const& model, nn::GptConfig const& c, std::int64_t rows) {
  auto const tokens = static_cast<double>(rows * c.block_size);
  auto const t = static_cast<double>(c.block_size), w = static_cast<double>(c.n_embd);
  pipeline::LayerProfile profile;
  for (std::size_t l = 0; l < model.size(); ++l) {
    nn::Layer const& layer = model.layer(l);
    double forward = tokens * w;  // embedding lookup, dropout, LayerNorm: one pass
    double rerun = 0;
    if (auto const* block = dynamic_cast<nn::TransformerBlock const*>(&layer)) {
      double const core = 2 * tokens * t * w;    // causal QK^T and PV
      forward = 2 * tokens * 12 * w * w + core;  // and four Linears (12 C^2)
      rerun = block->recompute() == nn::Recompute::full        ? forward
              : block->recompute() == nn::Recompute::selective ? core
                                                               : 0.0;
    } else if (dynamic_cast<nn::TiedLMHead const*>(&layer) != nullptr) {
      forward = 2 * tokens * w * static_cast<double>(c.vocab);
    }
    profile.seconds.push_back(3 * forward + rerun);  // FLOPs in the seconds' place: partition() compares them only
    profile.parameter_bytes.push_back(static_cast<double>(layer.parameter_count()) * sizeof(float));
    profile.activation_bytes.push_back(0.0);  // not modelled: the stages are cut by time
  }
  return profile;
}

// This process's group as a world of one process.
dist::World local_world(DeviceGroup const& group) {
  dist::World world;
  for (int r = 0; r < group.size(); ++r)
    world.devices.push_back({.rank = r, .device = group.device(r), .process = 0, .local_rank = r, .host = {}});
  return world;
}

}  // namespace

std::vector<pipeline::StageDevice> stage_devices(dist::World const& world, int stages) {
  double fastest = 0;
  for (dist::WorldDevice const& d : world.devices) fastest = std::max(fastest, d.device.speed);
  std::vector<pipeline::StageDevice> devices(static_cast<std::size_t>(stages), pipeline::StageDevice{.speed = 1.0});
  for (dist::WorldDevice const& d : world.devices) {
    double& speed = devices[static_cast<std::size_t>(d.rank % stages)].speed;
    speed = std::min(speed, d.device.speed / fastest);
  }
  return devices;
}

namespace {

// The mesh dp x tp x pp a config lays over `devices` (plain data parallelism: dp over all of them).
comm::DeviceMesh mesh_layout(ParallelConfig const& parallel, int devices) {
  bool const pipelined = parallel.pipelined();
  int const dp = !pipelined && parallel.tp == 1 ? devices : parallel.dp;
  return comm::DeviceMesh({{"dp", dp}, {"tp", parallel.tp}, {"pp", pipelined ? parallel.stages : 1}});
}

void validate(nn::GptConfig config, ParallelConfig const& parallel, TrainerOptions const& options, int devices) {
  if (parallel.recompute) config.recompute = *parallel.recompute;
  parallel.validate(config, {.batch_size = options.batch_size,
                             .devices = devices,
                             .spelling = options.spelling,
                             .devices_text = options.devices_text});
}

}  // namespace

std::unique_ptr<Trainer::Impl> Trainer::Impl::over_group(nn::GptConfig const& config, DeviceGroup group,
                                                         ParallelConfig parallel, TrainerOptions options) {
  dist::World world = options.across_processes ? dist::make_world(group) : local_world(group);
  validate(config, parallel, options, world.size());
  comm::DeviceMesh layout = mesh_layout(parallel, world.size());
  std::shared_ptr<parallel::Mesh> mesh;
  if (world.processes > 1) {
    mesh = std::make_shared<parallel::Mesh>(std::move(group), std::move(layout),
                                            parallel::MeshOptions{.make_communicator = dist::communicator_factory(world),
                                                                  .make_subset_communicator = dist::subset_communicator_factory(world)});
  } else {
    mesh = std::make_shared<parallel::Mesh>(std::move(group), std::move(layout));
    if (!mesh->placement().empty())  // the world of the devices as placed
      world = options.across_processes ? dist::make_world(mesh->group()) : local_world(mesh->group());
  }
  return std::make_unique<Impl>(config, std::move(mesh), std::move(world), std::move(parallel), std::move(options));
}

std::unique_ptr<Trainer::Impl> Trainer::Impl::over_mesh(nn::GptConfig const& config, std::shared_ptr<parallel::Mesh> mesh,
                                                        ParallelConfig parallel, TrainerOptions options) {
  if (!mesh) throw Error(Errc::invalid_argument, "Trainer: a null mesh (expected one built over the devices)");
  dist::World world = mesh->across() ? dist::make_world(mesh->group()) : local_world(mesh->group());
  validate(config, parallel, options, world.size());
  mesh->check(mesh->group(), mesh_layout(parallel, world.size()), "Trainer");
  return std::make_unique<Impl>(config, std::move(mesh), std::move(world), std::move(parallel), std::move(options));
}

Trainer::Impl::Impl(nn::GptConfig const& gpt, std::shared_ptr<parallel::Mesh> devices, dist::World devices_world,
                    ParallelConfig parallel_config, TrainerOptions trainer_options)
    : config(gpt),
      parallel(std::move(parallel_config)),
      options(std::move(trainer_options)),
      mesh(std::move(devices)),
      group(mesh->group()),
      world(std::move(devices_world)) {
  if (parallel.recompute) config.recompute = *parallel.recompute;
  bool const pipelined = parallel.pipelined();
  across = world.processes > 1;

  Device const device = group.device(0);
  allocator = Allocator::create(device);
  stream = std::make_unique<Stream>(device);
  ctx = std::make_unique<nn::Context>(nn::Context{*allocator, *stream});
  model.emplace(nn::gpt(config));
  model->materialize(*ctx, options.seed, pipelined ? DType::float32 : parallel.compute);
  if (!options.initial_parameters.empty()) set_parameters(*model, options.initial_parameters, *stream);
  optim::AdamWOptions adamw = options.adamw;
  adamw.decay_ranges = model->matrix_ranges();
  optimizer = std::make_unique<optim::AdamW>(adamw);

  bool const data_parallel_layout = !pipelined && parallel.tp == 1 && world.size() > 1;
  layout.tp = parallel.tp;
  layout.dp = data_parallel_layout ? world.size() : parallel.dp;
  layout.stages = pipelined ? parallel.stages : 1;
  bool const tensor_layout = !pipelined && parallel.tp > 1;
  layout.zero = data_parallel_layout || (tensor_layout && parallel.dp > 1) ? parallel.zero.value_or(1) : 0;
  if (pipelined && parallel.dp > 1) layout.zero = parallel.zero.value_or(1);  // a pipeline's replicas
  if (!options.metrics_job.empty())
    metrics = std::make_shared<metrics::Registry>(
        options.metrics_job, metrics::Layout{.dp = layout.dp, .tp = layout.tp, .pp = layout.stages, .zero = layout.zero});
  if (data_parallel_layout) build_data_parallel(adamw);
  if (pipelined) build_pipeline(adamw);
  if (parallel.tp > 1 && !pipelined) build_tensor_parallel(adamw);
  if (data_parallel) {
    net = &data_parallel->replica(0);
    data_parallel->reshard();  // ZeRO: what that gathered whole back to each rank's shards
    net_ctx = std::make_unique<nn::Context>(nn::Context{group.allocator(0), group.stream(0)});
  } else {
    net = &*model;
    net_ctx = std::make_unique<nn::Context>(nn::Context{*allocator, *stream});
  }
  if (data_parallel && across) {  // each process's rows: shares by its devices' speeds
    process_weights.assign(static_cast<std::size_t>(world.processes), 0.0);
    for (dist::WorldDevice const& d : world.devices) process_weights[static_cast<std::size_t>(d.process)] += d.device.speed;
  }
  if (parallel.loss_scaler && !data_parallel && !pipeline && !tensor) scaler.emplace();

  layout.micro_batches = pipeline ? pipeline->schedule().micro_batches : 1;
  layout.schedule = pipeline ? pipeline->schedule().name : data_parallel ? "data-parallel" : tensor ? "tensor-parallel" : "none";
}

template <class Options>
void Trainer::Impl::set_common(Options& o) const {
  o.seed = options.seed;
  o.compute = parallel.compute;
  o.clip_norm = parallel.clip_norm;
  if (parallel.loss_scaler) o.loss_scaler.emplace();
  o.metrics = metrics;
  o.timeline = options.timeline;
  o.mesh = mesh;
}

void Trainer::Impl::build_data_parallel(optim::AdamWOptions const& adamw) {
  parallel::DataParallelOptions o;
  set_common(o);
  o.zero_stage = parallel.zero.value_or(1);
  cap_buckets(o, parallel.bucket_cap_bytes);
  o.zero3_block_units = parallel.bucket_cap_bytes == 0;  // ZeRO-3's units: a block each, or the buckets
  o.loss = std::make_shared<nn::TokenCrossEntropy>();
  data_parallel = std::make_unique<parallel::DataParallel>(std::move(*model), group, optim::AdamW(adamw), std::move(o));
  model.reset();
}

// Stages cut by FLOPs for the devices' speeds, an AdamW per chunk decaying its own weight matrices,
// and the model's weights (its seed's, or the initial parameters) copied into the chunks.
void Trainer::Impl::build_pipeline(optim::AdamWOptions const& adamw) {
  std::string const name = parallel.pipeline_schedule();
  pipeline::Schedule schedule = name == "layer-split" ? pipeline::layer_split(parallel.stages)
                                                      : pipeline::make_schedule(name, parallel.stages, parallel.micro_batches, parallel.chunks);
  std::int64_t const micro_rows = std::max<std::int64_t>(1, options.batch_size / (schedule.micro_batches * parallel.dp));
  pipeline::LayerProfile const costs = layer_costs(*model, config, micro_rows);
  pipeline::Partition const plan =
      pipeline::partition(*model, schedule, costs,
                          across ? stage_devices(world, schedule.devices) : pipeline::stage_devices(group, schedule.devices),
                          {.optimizer_states = 2});
  std::vector<std::size_t> const cuts = parallel.cuts.empty() ? plan.cuts : parallel.cuts;
  pipeline::ExecutorOptions o{
      .data_parallel = parallel.dp, .zero_stage = layout.zero, .loss = std::make_shared<nn::TokenCrossEntropy>()};
  set_common(o);
  if (parallel.tp > 1)
    o.tensor_parallel =
        pipeline::tensor_parallel_stages(*model, {.sequence_parallel = parallel.sequence_parallel}, parallel.tp);
  pipeline = std::make_unique<pipeline::Executor>(
      *model, group, cuts, std::move(schedule),
      [adamw](nn::Sequential const& chunk) {
        optim::AdamWOptions chunk_options = adamw;
        chunk_options.decay_ranges = chunk.matrix_ranges();
        return std::make_unique<optim::AdamW>(chunk_options);
      },
      std::move(o));
  pipeline->scatter_parameters(*model, *stream);
  for (std::size_t c = 0; c + 1 < cuts.size(); ++c) {
    ChunkInfo chunk{.begin = cuts[c], .end = cuts[c + 1], .device = plan.device[c]};
    for (std::size_t l = cuts[c]; l < cuts[c + 1]; ++l)
      chunk.flops += costs.seconds[l], chunk.parameter_bytes += costs.parameter_bytes[l];
    chunks.push_back(chunk);
  }
}

// The shards materialized from the seed (the model's weights), or set from the initial parameters.
void Trainer::Impl::build_tensor_parallel(optim::AdamWOptions const& adamw) {
  optim::AdamWOptions shard_adamw = adamw;
  shard_adamw.decay_ranges.clear();  // each shard decays its own 2-D weights
  parallel::TensorParallelOptions o{.adamw = shard_adamw,
                                    .data_parallel = parallel.dp,
                                    .zero_stage = layout.zero,
                                    .sequence_parallel = parallel.sequence_parallel};
  set_common(o);  // across processes the mesh is the grid over the world's devices, each process passing the whole batch
  cap_buckets(o, parallel.bucket_cap_bytes);
  tensor = std::make_unique<parallel::TensorParallel>(group, nn::gpt(config), std::move(o));
  if (!options.initial_parameters.empty()) tensor->scatter_parameters(options.initial_parameters);
}

}  // namespace mgpu::train
