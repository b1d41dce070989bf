// The Trainer's operations: one step, evaluation, checkpoints and the whole model, dispatched to
// the executor its layout runs.
#include <algorithm>
#include <cstdio>

#include <mgpu/data/evaluate.hpp>
#include <mgpu/io/checkpoint.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/ops/ops.hpp>

#include "train/trainer_impl.hpp"

namespace mgpu::train {

std::vector<float> host_parameters(nn::Sequential const& model, Stream& stream) {
  Tensor const& p = model.master_parameters();
  if (p.device().kind == DeviceKind::host) {
    stream.synchronize();
    auto const s = p.host_span<float>();
    return {s.begin(), s.end()};
  }
  auto host = Allocator::create({DeviceKind::host, 0});
  Tensor const copy = Tensor::empty(p.shape(), DType::float32, *host);
  copy_async(copy, p, stream);
  stream.synchronize();
  auto const s = copy.host_span<float>();
  return {s.begin(), s.end()};
}

void set_parameters(nn::Sequential& model, std::span<float const> values, Stream& stream) {
  if (static_cast<std::int64_t>(values.size()) != model.master_parameters().numel())
    throw Error(Errc::invalid_argument, std::to_string(values.size()) + " parameters for a model of " +
                                            std::to_string(model.master_parameters().numel()) + " (expected as many)");
  auto host = Allocator::create({DeviceKind::host, 0});
  Tensor const src = Tensor::empty({static_cast<std::int64_t>(values.size())}, DType::float32, *host);
  std::copy(values.begin(), values.end(), src.host_span<float>().begin());
  copy_async(model.master_parameters(), src, stream);
  model.sync_parameters(stream);
  stream.synchronize();
}

Tensor Trainer::Impl::on_device(Tensor const& host) const {
  if (group.device(0).kind == DeviceKind::host) return host;
  Tensor t = Tensor::empty(host.shape(), host.dtype(), *allocator);
  copy_async(t, host, *stream);
  return t;
}

Trainer::Trainer(nn::GptConfig const& config, DeviceGroup group, ParallelConfig parallel, TrainerOptions options)
    : impl_(Impl::over_group(config, std::move(group), std::move(parallel), std::move(options))) {}

Trainer::Trainer(nn::GptConfig const& config, std::shared_ptr<parallel::Mesh> mesh, ParallelConfig parallel, TrainerOptions options)
    : impl_(Impl::over_mesh(config, std::move(mesh), std::move(parallel), std::move(options))) {}

Trainer::~Trainer() = default;

Trainer::StepResult Trainer::step(Tensor const& inputs, Tensor const& targets, float lr_scale) {
  Impl& m = *impl_;
  if (m.data_parallel) {
    if (m.process_weights.size() > 1) {  // this process's rows
      std::vector<std::int64_t> const rows =
          shard_sizes(inputs.dim(0), static_cast<int>(m.process_weights.size()), m.process_weights);
      std::int64_t begin = 0;
      for (int p = 0; p < m.world.process; ++p) begin += rows[static_cast<std::size_t>(p)];
      std::int64_t const end = begin + rows[static_cast<std::size_t>(m.world.process)];
      m.last_dp = m.data_parallel->step(inputs.slice(begin, end), targets.slice(begin, end), lr_scale);
    } else {
      m.last_dp = m.data_parallel->step(inputs, targets, lr_scale);
    }
    return {m.last_dp.loss, m.last_dp.applied};
  }
  if (m.pipeline) {
    float const loss = m.pipeline->step(inputs, targets, lr_scale);
    return {loss, m.pipeline->last_step_applied()};
  }
  if (m.tensor) {
    parallel::TensorParallel::StepResult const r = m.tensor->step(inputs, targets, lr_scale);
    return {static_cast<float>(r.loss), r.applied};
  }
  std::int64_t const skipped = m.scaler ? m.scaler->skipped() : 0;
  nn::StepOptions const options{.lr_scale = lr_scale,
                                .clip_norm = m.parallel.clip_norm,
                                .scaler = m.scaler ? &*m.scaler : nullptr,
                                .timeline = m.options.timeline.get()};
  nn::StepResult const r =
      nn::train_step(*m.model, *m.optimizer, m.on_device(inputs), m.on_device(targets), m.loss, *m.ctx, options);
  float const loss = ops::item(r.loss, *m.stream);  // synchronizes
  return {loss, !m.scaler || m.scaler->skipped() == skipped};
}

double Trainer::evaluate(data::TokenLoader const& loader, std::int64_t windows) {
  nn::Sequential& whole = gather();
  double const loss = data::evaluate_lm(whole, loader, windows, *impl_->net_ctx);
  if (impl_->data_parallel) impl_->data_parallel->reshard();
  return loss;
}

void Trainer::save(std::filesystem::path const& path, io::TrainingState const& state) {
  Impl& m = *impl_;
  if (m.data_parallel) {
    m.data_parallel->save(path, state);
    m.data_parallel->reshard();
  } else if (m.pipeline) {
    m.pipeline->save(path, state);
  } else if (m.tensor) {
    m.tensor->save(path, state);
  } else {
    io::save_training(path, *m.model, *m.optimizer, state, *m.stream);
  }
}

io::TrainingState Trainer::load(std::filesystem::path const& path) {
  Impl& m = *impl_;
  if (m.data_parallel) {
    io::TrainingState const state = m.data_parallel->load(path);
    m.data_parallel->reshard();
    return state;
  }
  if (m.pipeline) return m.pipeline->load(path);
  if (m.tensor) return m.tensor->load(path);
  return io::load_training(path, *m.model, *m.optimizer, *m.allocator, *m.stream);
}

nn::Sequential& Trainer::gather() {
  Impl& m = *impl_;
  if (m.data_parallel) return m.data_parallel->replica(0);  // ZeRO: the shards gathered into the whole model
  if (m.pipeline) m.pipeline->gather_parameters(*m.model, *m.stream);
  if (m.tensor) set_parameters(*m.model, m.tensor->gather_parameters(), *m.stream);
  return *m.net;
}

std::vector<float> Trainer::parameters() {
  std::vector<float> values = host_parameters(gather(), impl_->net_ctx->stream);
  if (impl_->data_parallel) impl_->data_parallel->reshard();
  return values;
}

void Trainer::scatter(std::span<float const> whole) {
  Impl& m = *impl_;
  if (m.tensor) {
    m.tensor->scatter_parameters(whole);
    return;
  }
  if (m.data_parallel) {
    throw Error(Errc::invalid_argument,
                "scatter of whole parameters into data parallelism's replicas (expected the initial parameters of "
                "TrainerOptions, or load(): the replicas and their shards are made from them)");
  }
  set_parameters(*m.model, whole, *m.stream);
  if (m.pipeline) m.pipeline->scatter_parameters(*m.model, *m.stream);
}

nn::Context& Trainer::context() noexcept { return *impl_->net_ctx; }

std::vector<Allocator*> Trainer::allocators() {
  Impl& m = *impl_;
  std::vector<Allocator*> out;
  if (!m.data_parallel && !m.pipeline && !m.tensor) return {m.allocator.get()};
  for (int r = 0; r < m.group.size(); ++r) out.push_back(&m.group.allocator(r));
  return out;
}

std::optional<std::vector<parallel::GptMemory>> Trainer::predicted_memory() const {
  Impl const& m = *impl_;
  parallel::GptLayout layout{.data_parallel = m.layout.dp,
                             .tensor_parallel = m.parallel.tp,
                             .zero_stage = m.layout.zero,
                             .zero3_block_units = m.parallel.bucket_cap_bytes == 0 || m.tensor != nullptr,  // TP: a unit per block
                             .cuts = m.pipeline ? m.pipeline->cuts() : std::vector<std::size_t>{},
                             .micro_batches = m.layout.micro_batches,
                             .passes = m.pipeline ? pipeline::memory_passes(m.pipeline->schedule())
                                                  : std::vector<std::vector<parallel::GptPass>>{},
                             .sequence_parallel = m.parallel.sequence_parallel,
                             .compute = m.parallel.compute};
  if (m.data_parallel || m.tensor) cap_buckets(layout, m.parallel.bucket_cap_bytes);  // the executors' buckets
  std::vector<parallel::GptMemory> whole = parallel::predict_gpt_memory(m.config, m.options.batch_size, layout);
  if (!m.across) return whole;
  // Across processes the layout's devices are the world's, in rank order: this process's own.
  std::vector<parallel::GptMemory> own;
  for (dist::WorldDevice const& d : m.world.devices)
    if (d.process == m.world.process && d.rank < static_cast<int>(whole.size())) own.push_back(whole[static_cast<std::size_t>(d.rank)]);
  return own;
}

Layout const& Trainer::layout() const noexcept { return impl_->layout; }
std::shared_ptr<metrics::Registry> const& Trainer::metrics() const noexcept { return impl_->metrics; }
ParallelConfig const& Trainer::config() const noexcept { return impl_->parallel; }
nn::GptConfig const& Trainer::model_config() const noexcept { return impl_->config; }
std::string const& Trainer::placement() const noexcept { return impl_->mesh->placement(); }
std::shared_ptr<parallel::Mesh> const& Trainer::mesh() const noexcept { return impl_->mesh; }
std::vector<ChunkInfo> const& Trainer::chunks() const noexcept { return impl_->chunks; }
DeviceGroup& Trainer::group() noexcept { return impl_->group; }
dist::World const& Trainer::world() const noexcept { return impl_->world; }
std::int64_t Trainer::parameter_count() const { return impl_->net->parameter_count(); }
parallel::DataParallel* Trainer::data_parallel() noexcept { return impl_->data_parallel.get(); }
parallel::TensorParallel* Trainer::tensor_parallel() noexcept { return impl_->tensor.get(); }
pipeline::Executor* Trainer::pipeline() noexcept { return impl_->pipeline.get(); }

parallel::DataParallelResult const* Trainer::last_data_parallel_step() const noexcept {
  return impl_->data_parallel ? &impl_->last_dp : nullptr;
}

optim::LossScaler const* Trainer::loss_scaler() const noexcept {
  Impl const& m = *impl_;
  if (m.data_parallel) return m.data_parallel->loss_scaler();
  if (m.pipeline) return m.pipeline->loss_scaler();
  if (m.tensor) return m.tensor->loss_scaler();
  return m.scaler ? &*m.scaler : nullptr;
}

std::string Trainer::describe() const {
  Impl const& m = *impl_;
  Layout const& l = m.layout;
  char text[300];
  if (m.pipeline)
    std::snprintf(text, sizeof text, "%s over %d stage(s) x %d replica(s) x %d tensor-parallel rank(s), %d micro-batches",
                  l.schedule.c_str(), m.parallel.stages, m.parallel.dp, m.parallel.tp, l.micro_batches);
  else if (m.data_parallel)
    std::snprintf(text, sizeof text, "data parallel over %d devices, ZeRO-%d", l.dp, l.zero);
  else if (m.tensor)
    std::snprintf(text, sizeof text, "tensor parallel: %d replica(s) x %d rank(s)%s, ZeRO-%d", l.dp, l.tp,
                  m.parallel.sequence_parallel ? ", sequence parallel" : "", l.zero);
  else
    std::snprintf(text, sizeof text, "one device, %s", m.group.device(0).to_string().c_str());
  return std::string(text) + " (" + std::string(to_string(m.parallel.compute)) + ")";
}

}  // namespace mgpu::train
