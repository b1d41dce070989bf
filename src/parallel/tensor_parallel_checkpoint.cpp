// TensorParallel and the whole model: the shards' buffers put together in its layout and
// split back (gather_parameters, scatter_parameters), and checkpoints: a file in io::save_training's
// format (the whole model put together), or a folder in which each rank writes its own boxes of the
// named tensors and reads only the boxes it holds, from a folder of any layout.
#include <mgpu/parallel/tensor_parallel.hpp>

#include <algorithm>
#include <exception>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <mgpu/core/error.hpp>
#include <mgpu/io/checkpoint.hpp>
#include <mgpu/io/sharded_checkpoint.hpp>
#include <mgpu/parallel/shard_boxes.hpp>

#include "comm/agreement.hpp"
#include "parallel/tensor_parallel_impl.hpp"

namespace mgpu::parallel {

namespace {

// Calls fn(whole layer span, shard layer span, sharded layer or nullptr) for each layer with
// parameters.
template <typename Fn>
void for_each_layer(nn::Sequential const& shard, std::span<float> params,
                    std::vector<nn::ParameterRange> const& whole_ranges, std::span<float> whole, Fn&& fn) {
  std::vector<nn::ParameterRange> const ranges = shard.parameter_ranges();
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    nn::ParameterRange const& s = ranges[i];
    nn::ParameterRange const& w = whole_ranges[i];
    fn(whole.subspan(static_cast<std::size_t>(w.begin), static_cast<std::size_t>(w.size())),
       params.subspan(static_cast<std::size_t>(s.begin), static_cast<std::size_t>(s.size())),
       dynamic_cast<ShardedLayer const*>(&shard.layer(s.layer)));
  }
}

// The whole model and its optimizer on the host, as one device would train them: what a checkpoint
// is written from and read into.
struct Whole {
  std::shared_ptr<Allocator> allocator = Allocator::create(Device{DeviceKind::host, 0});
  Stream stream{Device{DeviceKind::host, 0}};
  nn::Sequential model;
  std::unique_ptr<optim::Optimizer> optimizer;

  explicit Whole(nn::Sequential const& whole, TensorParallelOptions const& options) : model(whole.clone()) {
    nn::Context ctx{*allocator, stream};
    model.materialize(ctx, options.seed);
    stream.synchronize();
    if (options.optimizer) {
      optimizer = options.optimizer(model);
      if (!optimizer)
        throw Error(Errc::invalid_argument, "TensorParallel's optimizer factory returned no optimizer for the whole model "
                                            "(expected a new optimizer from every call: checkpoints make one)");
    } else {
      optim::AdamWOptions adamw = options.adamw;
      adamw.decay_ranges = model.matrix_ranges();  // as the shards decay their 2-D weights
      optimizer = std::make_unique<optim::AdamW>(adamw);
    }
  }
};

}  // namespace

std::vector<float> TensorParallel::Impl::to_whole(ShardBuffer const& buffer) {
  nn::Sequential const& whole_model = this->whole;
  std::vector<float> whole(static_cast<std::size_t>(whole_model.parameter_count()));
  auto const check = [&](Tensor const& t, nn::Sequential const& shard) {
    if (t.numel() != shard.parameter_count() || t.dtype() != DType::float32)
      throw Error(Errc::invalid_argument, "TensorParallel: a shard's buffer of " + std::to_string(t.numel()) +
                                              " values (expected float32, one per parameter of the shard: " +
                                              std::to_string(shard.parameter_count()) + ")");
  };
  // Replica 0's shards: in one process its own; across processes every rank's buffer (padded to
  // the largest) all-gathered over the world, laid out by shards made here for each index.
  std::vector<nn::Sequential> layouts;
  std::vector<float> gathered;
  std::int64_t padded = 0;
  if (world) {
    std::shared_ptr<comm::Communicator> const& comm = comms[static_cast<std::size_t>(mesh.coordinate(first, "dp"))];
    for (int t = 0; t < ranks; ++t) {
      layouts.push_back(make_shard(comm, t));
      padded = std::max(padded, layouts.back().parameter_count());
    }
    group->run([&](int rank, Device /*device*/, Stream& stream) {
      Allocator& allocator = group->allocator(rank);
      nn::Sequential const& shard = shards[static_cast<std::size_t>(rank)];
      Tensor const values = buffer(rank);
      check(values, shard);
      Tensor const mine = Tensor::empty({padded}, DType::float32, allocator);
      fill_async(mine, 0.0f, stream);
      copy_async(mine.slice(0, shard.parameter_count()), values, stream);
      Tensor const all = Tensor::empty({padded * mesh.size()}, DType::float32, allocator);
      world->all_gather(first + rank, mine, all, stream);
      if (rank == 0) gathered = detail::host_copy(all, stream);
    });
  }
  // Rank 0 last, so the replicated parameters are its.
  for (int t = ranks - 1; t >= 0; --t) {
    int const rank = mesh.at("tp", 0, t);  // replica 0's
    nn::Sequential const& shard = world ? layouts[static_cast<std::size_t>(t)] : shards[static_cast<std::size_t>(rank)];
    std::vector<float> values;
    if (world) {
      auto const begin = gathered.begin() + static_cast<std::ptrdiff_t>(rank * padded);
      values.assign(begin, begin + static_cast<std::ptrdiff_t>(shard.parameter_count()));
    } else {
      Tensor const mine = buffer(rank);
      check(mine, shard);
      values = detail::host_copy(mine, group->stream(rank));
    }
    for_each_layer(shard, values, whole_model.parameter_ranges(), whole,
                   [](std::span<float> w, std::span<float> s, ShardedLayer const* sharded) {
                     if (sharded != nullptr) {
                       sharded->copy_shard(w, s, false);
                     } else {
                       std::copy(s.begin(), s.end(), w.begin());
                     }
                   });
  }
  return whole;
}

void TensorParallel::Impl::from_whole(std::span<float const> values, ShardBuffer const& buffer) {
  nn::Sequential const& whole_model = this->whole;
  std::vector<float> whole(values.begin(), values.end());
  auto const host = Allocator::create({DeviceKind::host, 0});
  for (int rank = 0; rank < group->size(); ++rank) {
    nn::Sequential& shard = shards[static_cast<std::size_t>(rank)];
    Tensor const mine = buffer(rank);
    if (mine.numel() != shard.parameter_count())
      throw Error(Errc::invalid_argument, "TensorParallel: a shard's buffer of " + std::to_string(mine.numel()) +
                                              " values (expected one per parameter of the shard: " +
                                              std::to_string(shard.parameter_count()) + ")");
    Tensor const part = Tensor::empty({shard.parameter_count()}, DType::float32, *host);
    for_each_layer(shard, part.host_span<float>(), whole_model.parameter_ranges(), whole,
                   [](std::span<float> w, std::span<float> s, ShardedLayer const* sharded) {
                     if (sharded != nullptr) {
                       sharded->copy_shard(w, s, true);
                     } else {
                       std::copy(w.begin(), w.end(), s.begin());
                     }
                   });
    Stream& stream = group->stream(rank);
    copy_async(mine, part, stream);
    stream.synchronize();
  }
}

std::vector<float> TensorParallel::gather_parameters() {
  Impl& im = *impl_;
  im.gather_whole();  // zero_stage 3
  return im.to_whole([&im](int rank) { return im.shards[static_cast<std::size_t>(rank)].master_parameters(); });
}

void TensorParallel::scatter_parameters(std::span<float const> values) {
  Impl& im = *impl_;
  auto const expected = im.whole.parameter_count();
  if (values.size() != static_cast<std::size_t>(expected))
    throw Error(Errc::invalid_argument, "TensorParallel::scatter_parameters: " + std::to_string(values.size()) +
                                            " values (expected the whole model's " + std::to_string(expected) + ")");
  im.gather_whole();  // zero_stage 3: the next step keeps the owned parameters of these
  im.from_whole(values, [&im](int rank) { return im.shards[static_cast<std::size_t>(rank)].master_parameters(); });
  for (int rank = 0; rank < im.group->size(); ++rank) {
    Stream& stream = im.group->stream(rank);
    im.shards[static_cast<std::size_t>(rank)].sync_parameters(stream);
    stream.synchronize();
  }
}

void TensorParallel::save(std::filesystem::path const& path, io::TrainingState const& state) {
  Impl& im = *impl_;
  if (!im.broken.empty()) throw Error(Errc::invalid_argument, "TensorParallel::save: " + im.broken);
  im.group->synchronize();
  im.gather_optimizer_state();  // ZeRO: every rank's whole (the next step shards it again)
  if (im.world || std::filesystem::is_directory(path)) return im.save_boxes(path, state);
  nn::Sequential const& shard = im.shards[0];
  // The optimizers are stepped together: every rank holds as many state buffers, whole ones.
  std::vector<optim::NamedTensor> const state_buffers = im.optimizers[0]->state();
  Whole whole(im.whole, im.options);
  if (shard.size() != whole.model.size())
    throw Error(Errc::invalid_argument, "TensorParallel::save: a shard of " + std::to_string(shard.size()) +
                                            " layers (expected the whole model's " + std::to_string(whole.model.size()) + ")");
  // The whole model lives on the host: its buffers are filled directly.
  auto const fill = [](Tensor const& into, std::vector<float> const& values) {
    std::copy(values.begin(), values.end(), into.host_span<float>().begin());
  };
  fill(whole.model.master_parameters(), gather_parameters());
  if (!state_buffers.empty()) {
    std::vector<optim::NamedTensor> const into = whole.optimizer->prepare_state(whole.model.master_parameters(), *whole.allocator, whole.stream);
    for (std::size_t k = 0; k < state_buffers.size(); ++k) {
      std::vector<float> const values = im.to_whole([&im, k](int rank) {
        std::vector<optim::NamedTensor> const mine = im.optimizers[static_cast<std::size_t>(rank)]->state();
        if (mine.size() <= k)
          throw Error(Errc::invalid_argument, "TensorParallel::save: rank " + std::to_string(rank) + "'s optimizer holds " +
                                                  std::to_string(mine.size()) + " state buffers (expected as many as rank 0's)");
        return mine[k].second;
      });
      whole.stream.synchronize();  // prepare_state's zeros written before the values
      fill(into[k].second, values);
    }
  }
  whole.model.set_rng_state(shard.rng_state());  // every rank's layers draw as the whole model's do
  whole.model.set_rng_seeds(shard.rng_seeds());
  whole.optimizer->set_steps(im.optimizers[0]->steps());
  whole.stream.synchronize();
  io::Checkpoint records = io::training_checkpoint(whole.model, *whole.optimizer, state, whole.stream);
  if (im.scalers[0]) io::put_loss_scaler(records, im.scalers[0]->state());
  records.save(path);
}

void TensorParallel::Impl::save_boxes(std::filesystem::path const& path, io::TrainingState const& state) {
  Impl& im = *this;
  im.gather_whole();  // zero_stage 3: every shard's parameters whole
  // Replica 0's ranks of this process, each writing its boxes of the named tensors (a replicated
  // tensor: its tensor-parallel rank 0); the first of them also the layouts and the other records.
  std::vector<int> mine;  // local ranks
  for (int t = 0; t < im.ranks; ++t) {
    int const local = im.mesh.at("tp", 0, t) - im.first;
    if (local >= 0 && local < im.group->size()) mine.push_back(local);
  }
  // In one process a shard per rank; across processes a shard per process, its ranks'.
  std::vector<io::ShardWriter> writers(im.world ? 1 : mine.size());
  for (std::size_t i = 0; i < mine.size(); ++i) {
    io::ShardWriter& writer = writers[im.world ? 0 : i];
    int const local = mine[i];
    auto const r = static_cast<std::size_t>(local);
    Stream& stream = im.group->stream(local);
    bool const first_rank = im.first + local == im.mesh.at("tp", 0, 0);
    std::vector<std::pair<std::string, std::vector<float>>> buffers{
        {"model.parameters", detail::host_copy(im.shards[r].master_parameters(), stream)}};
    for (auto const& [name, tensor] : im.optimizers[r]->state()) buffers.emplace_back("optimizer." + name, detail::host_copy(tensor, stream));
    auto const host = Allocator::create({DeviceKind::host, 0});
    Stream host_stream{Device{DeviceKind::host, 0}};
    nn::Sequential const& whole_model = im.whole;  // not materialized: the names and layout
    for (ShardBox const& b : shard_boxes(whole_model, im.shards[r])) {
      if (b.whole && !first_rank) continue;  // replicated: written once
      Tensor const values = Tensor::empty({b.box.numel()}, DType::float32, *host);
      for (auto const& [record, buffer] : buffers) {
        std::vector<float> const mine = box_values(b, buffer);
        std::copy(mine.begin(), mine.end(), values.host_span<float>().begin());
        writer.put_box(record + "/" + b.tensor, b.shape, b.box, values, host_stream);
      }
    }
    if (!first_rank) continue;
    std::int64_t const total = whole_model.parameter_count();
    for (auto const& entry : buffers) writer.put_layout(entry.first, total, tensor_layout(whole_model, entry.first));
    nn::Sequential whole = im.whole.clone();  // not materialized: the architecture and RNG state
    whole.set_rng_state(im.shards[r].rng_state());
    whole.set_rng_seeds(im.shards[r].rng_seeds());
    io::Checkpoint records = io::training_metadata(whole, *im.optimizers[r], state);
    if (im.scalers[r]) io::put_loss_scaler(records, im.scalers[r]->state());
    for (io::Record const& record : records.records()) writer.put(record);
  }
  if (!im.world) {  // a shard per rank
    std::uint64_t const save_id = io::committed_save_id(path) + 1;
    for (std::size_t i = 0; i < writers.size(); ++i) writers[i].save(path, save_id, static_cast<int>(i), static_cast<int>(writers.size()));
    io::commit_shards(path, save_id, static_cast<int>(writers.size()));
    return;
  }
  // Across processes every process calls save with the same path.
  auto const write = [&](std::uint64_t save_id, int index, int count) { writers[0].save(path, save_id, index, count); };
  comm::detail::save_in_shards(
      *im.world, *im.group, "TensorParallel::save to the folder " + path.string(), [&] { return io::committed_save_id(path) + 1; },
      write, [&](std::uint64_t save_id, int count) { io::commit_shards(path, save_id, count); });
}

io::TrainingState TensorParallel::load(std::filesystem::path const& path) {
  Impl& im = *impl_;
  if (!im.broken.empty()) throw Error(Errc::invalid_argument, "TensorParallel::load: " + im.broken);
  im.group->synchronize();
  im.gather_optimizer_state();  // ZeRO: laid out whole to be filled (the next step shards it again)
  // Read and verify everything into the whole model first (every process, from the same files):
  // the shards change only once every process has.
  if (std::filesystem::is_directory(path)) {
    std::optional<io::ShardedCheckpoint> folder;
    std::exception_ptr failure;
    try {
      folder.emplace(io::ShardedCheckpoint::load(path));
    } catch (...) {
      failure = std::current_exception();
    }
    comm::detail::agree(im.world.get(), *im.group, failure, "TensorParallel::load from " + path.string());
    return im.load_boxes(*folder);
  }
  std::exception_ptr failure;
  std::optional<Whole> whole;
  io::TrainingState state;
  std::optional<optim::LossScaler::State> scaler;
  try {
    whole.emplace(im.whole, im.options);
    io::Checkpoint const records = io::Checkpoint::load(path);
    if (whole->model.size() != im.shards[0].size())
      throw Error(Errc::invalid_argument, "TensorParallel::load: a shard of " + std::to_string(im.shards[0].size()) +
                                              " layers (expected the whole model's " + std::to_string(whole->model.size()) + ")");
    if (im.scalers[0]) scaler = io::read_loss_scaler(records, path.string(), *im.scalers[0]);
    state = io::load_training(records, path.string(), whole->model, *whole->optimizer, *whole->allocator, whole->stream);
  } catch (...) {
    failure = std::current_exception();
  }
  comm::detail::agree(im.world.get(), *im.group, failure, "TensorParallel::load from " + path.string());
  std::vector<float> const parameters = detail::host_copy(whole->model.master_parameters(), whole->stream);
  scatter_parameters(parameters);
  std::vector<optim::NamedTensor> const saved = whole->optimizer->state();  // none: the checkpoint held none
  for (int rank = 0; rank < im.group->size(); ++rank) {
    auto const r = static_cast<std::size_t>(rank);
    Stream& stream = im.group->stream(rank);
    std::vector<optim::NamedTensor> const mine =
        saved.empty() ? im.optimizers[r]->state()
                      : im.optimizers[r]->prepare_state(im.shards[r].master_parameters(), im.group->allocator(rank), stream);
    if (saved.empty())
      for (auto const& [name, tensor] : mine) fill_async(tensor, 0.0f, stream);
    stream.synchronize();
    im.shards[r].set_rng_state(whole->model.rng_state());
    im.shards[r].set_rng_seeds(whole->model.rng_seeds());
    im.optimizers[r]->set_steps(whole->optimizer->steps());
    if (scaler) im.scalers[r]->set_state(*scaler);
  }
  for (std::size_t k = 0; k < saved.size(); ++k) {
    std::vector<float> const values = detail::host_copy(saved[k].second, whole->stream);
    im.from_whole(values, [&im, k](int rank) { return im.optimizers[static_cast<std::size_t>(rank)]->state()[k].second; });
  }
  return state;
}

io::TrainingState TensorParallel::Impl::load_boxes(io::ShardedCheckpoint const& checkpoint) {
  std::string const source = checkpoint.folder().string();
  io::Checkpoint const records = checkpoint.joined(checkpoint.split_names());  // the whole records
  std::int64_t const total = whole.parameter_count();
  auto const host = Allocator::create({DeviceKind::host, 0});
  Stream host_stream{Device{DeviceKind::host, 0}};
  auto const check = [&](std::string const& name) { check_model_record(checkpoint, records, name, total, source); };
  // Everything verified and every rank's boxes read before any rank changes.
  struct Staged {
    std::vector<float> parameters;
    std::map<std::string, std::vector<float>> state;  // by record name
  };
  std::vector<Staged> staged(static_cast<std::size_t>(group->size()));
  io::TrainingRecords training;
  std::optional<optim::LossScaler::State> scaler;
  std::vector<std::string> state_names;  // the optimizer's records, as the checkpoint holds them
  std::exception_ptr failure;
  try {
    training = io::read_training_records(records, source, whole, *optimizers[0]);
    if (scalers[0]) scaler = io::read_loss_scaler(records, source, *scalers[0]);
    check("model.parameters");
    for (std::string const& name : checkpoint.split_names())
      if (name.starts_with("optimizer.")) state_names.push_back(name);
    for (io::Record const& r : records.records())
      if (r.name.starts_with("optimizer.") && r.type == io::RecordType::float32) state_names.push_back(r.name);
    for (std::string const& name : state_names) check(name);
    nn::Sequential const& whole_model = whole;  // not materialized: the names and layout
    for (std::size_t r = 0; r < staged.size(); ++r) {
      auto const count = static_cast<std::size_t>(shards[r].parameter_count());
      staged[r].parameters.assign(count, 0.0f);
      for (std::string const& name : state_names) staged[r].state[name].assign(count, 0.0f);
      for (ShardBox const& b : shard_boxes(whole_model, shards[r])) {
        read_box_into(checkpoint, records, "model.parameters", b, staged[r].parameters, host_stream);
        for (std::string const& name : state_names) read_box_into(checkpoint, records, name, b, staged[r].state[name], host_stream);
      }
    }
  } catch (...) {
    failure = std::current_exception();
  }
  comm::detail::agree(world.get(), *group, failure, "TensorParallel::load from " + source);
  gather_whole();  // zero_stage 3: the next step keeps the owned parameters of these
  for (int rank = 0; rank < group->size(); ++rank) {
    auto const r = static_cast<std::size_t>(rank);
    Stream& stream = group->stream(rank);
    Allocator& allocator = group->allocator(rank);
    auto const put = [&](Tensor const& into, std::vector<float> const& values) {
      Tensor const from = Tensor::empty({static_cast<std::int64_t>(values.size())}, DType::float32, *host);
      std::copy(values.begin(), values.end(), from.host_span<float>().begin());
      copy_async(into, from, stream);
      stream.synchronize();
    };
    put(shards[r].master_parameters(), staged[r].parameters);
    shards[r].sync_parameters(stream);
    std::vector<optim::NamedTensor> const mine =
        state_names.empty() ? optimizers[r]->state() : optimizers[r]->prepare_state(shards[r].master_parameters(), allocator, stream);
    stream.synchronize();
    for (auto const& [name, tensor] : mine) {
      auto const saved = staged[r].state.find("optimizer." + name);
      if (saved == staged[r].state.end()) {
        fill_async(tensor, 0.0f, stream);  // none saved (before a first step)
        stream.synchronize();
      } else {
        put(tensor, saved->second);
      }
    }
    shards[r].set_rng_state(training.rng);
    if (!training.rng_seeds.empty()) shards[r].set_rng_seeds(training.rng_seeds);
    optimizers[r]->set_steps(training.optimizer_steps);
    if (scaler) scalers[r]->set_state(*scaler);
  }
  return training.state;
}

}  // namespace mgpu::parallel
