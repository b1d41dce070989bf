// The pipeline's checkpoint folders (format version 2, across processes too): each process writes
// the boxes of the whole model's named tensors that replica 0's chunks on its ranks hold, and reads
// its chunks' boxes from a folder of any layout. No one puts the whole model together.
#include <algorithm>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <mgpu/core/error.hpp>
#include <mgpu/core/memory.hpp>
#include <mgpu/io/checkpoint.hpp>
#include <mgpu/io/sharded_checkpoint.hpp>
#include <mgpu/parallel/shard_boxes.hpp>
#include <mgpu/pipeline/pipeline.hpp>

#include "comm/agreement.hpp"
#include "pipeline/executor_impl.hpp"

namespace mgpu::pipeline {

namespace {

std::vector<float> to_host(Tensor const& t, Stream& stream) {
  Tensor const copy = Tensor::empty({t.numel()}, DType::float32, *Allocator::create({DeviceKind::host, 0}));
  copy_async(copy, t, stream);
  stream.synchronize();
  std::span<float const> const values = copy.host_span<float>();
  return {values.begin(), values.end()};
}

void from_host(Tensor const& into, std::vector<float> const& values, Stream& stream) {
  Tensor const from = Tensor::empty({static_cast<std::int64_t>(values.size())}, DType::float32, *Allocator::create({DeviceKind::host, 0}));
  std::copy(values.begin(), values.end(), from.host_span<float>().begin());
  copy_async(into, from, stream);
  stream.synchronize();
}

}  // namespace

void Executor::Impl::save_boxes(std::filesystem::path const& folder, io::TrainingState const& training) {
  std::string const what = "Executor::save to the folder " + folder.string();
  ReplicaRecords const replica = replica_records(what);  // and the optimizers' agreement checked
  auto const write = [&](std::uint64_t save_id, int shard, int shards) {
    io::ShardWriter writer;
    auto const host = Allocator::create({DeviceKind::host, 0});
    Stream host_stream{Device{DeviceKind::host, 0}};
    for (int p = 0; p < replicas; ++p) {
      if (data_index(p) != 0) continue;  // replica 0's pipelines: one per tensor-parallel rank
      for (int c = 0; c < schedule.chunks(); ++c) {
        int const rank = rank_at(p, schedule.device_of(c));
        if (!is_local(rank)) continue;  // another process writes it
        auto const index = static_cast<std::size_t>(c);
        nn::Sequential const& chunk = chunks[static_cast<std::size_t>(p)][index];
        Stream& stream = group->stream(rank - first);
        std::vector<std::pair<std::string, std::vector<float>>> buffers{{"model.parameters", to_host(chunk.master_parameters(), stream)}};
        for (auto const& [name, tensor] : optimizers[static_cast<std::size_t>(p)][index]->state())
          buffers.emplace_back("optimizer." + name, to_host(tensor, stream));
        for (parallel::ShardBox const& b : parallel::shard_boxes(architecture, chunk, chunk_origins(p, c))) {
          if (b.copy || (b.whole && tp_index(p) != 0)) continue;  // the embedding's; a replicated tensor by rank 0
          Tensor const values = Tensor::empty({b.box.numel()}, DType::float32, *host);
          for (auto const& [record, buffer] : buffers) {
            std::vector<float> const mine = parallel::box_values(b, buffer);
            std::copy(mine.begin(), mine.end(), values.host_span<float>().begin());
            writer.put_box(record + "/" + b.tensor, b.shape, b.box, values, host_stream);
          }
        }
      }
    }
    if (first == 0) {  // the layouts and the other records (chunk 0 of replica 0 runs on world rank 0)
      std::int64_t const total = architecture.parameter_count();
      writer.put_layout("model.parameters", total, parallel::tensor_layout(architecture, "model.parameters"));
      for (auto const& [name, tensor] : optimizers[0][0]->state())
        writer.put_layout("optimizer." + name, total, parallel::tensor_layout(architecture, "optimizer." + name));
      nn::Sequential whole = architecture.clone();  // not materialized: the architecture and RNG state
      whole.set_rng_state(replica.rng);
      whole.set_rng_seeds(replica.seeds);
      io::Checkpoint records = io::training_metadata(whole, *optimizers[0][0], training);
      if (options.loss_scaler) io::put_loss_scaler(records, options.loss_scaler->state());
      for (io::Record const& record : records.records()) writer.put(record);
    }
    writer.save(folder, save_id, shard, shards);
  };
  comm::detail::save_in_shards(
      *comm, *group, what, [&] { return io::committed_save_id(folder) + 1; }, write,
      [&](std::uint64_t save_id, int shards) { io::commit_shards(folder, save_id, shards); });
}

io::TrainingState Executor::Impl::load_boxes(io::ShardedCheckpoint const& checkpoint) {
  group->synchronize();
  gather_optimizer_state();  // the boxes fill whole state buffers; the next step shards them again
  std::string const source = checkpoint.folder().string();
  io::Checkpoint const records = checkpoint.joined(checkpoint.split_names());  // the whole records
  std::int64_t const total = architecture.parameter_count();
  Stream host_stream{Device{DeviceKind::host, 0}};
  // Each local chunk's boxes, read once per tensor-parallel rank and chunk (every replica's alike),
  // everything verified before any chunk changes.
  struct Staged {
    std::vector<float> parameters;
    std::map<std::string, std::vector<float>> state;  // by record name
  };
  std::map<std::pair<int, int>, Staged> staged;
  io::TrainingRecords training;
  std::optional<optim::LossScaler::State> scaler;
  std::vector<std::string> state_names;  // the optimizer's records, as the checkpoint holds them
  std::exception_ptr failure;
  try {
    training = io::read_training_records(records, source, architecture, *optimizers[0][0]);
    if (options.loss_scaler) scaler = io::read_loss_scaler(records, source, *options.loss_scaler);
    parallel::check_model_record(checkpoint, records, "model.parameters", total, source);
    for (std::string const& name : checkpoint.split_names())
      if (name.starts_with("optimizer.")) state_names.push_back(name);
    for (io::Record const& r : records.records())
      if (r.name.starts_with("optimizer.") && r.type == io::RecordType::float32) state_names.push_back(r.name);
    for (std::string const& name : state_names) parallel::check_model_record(checkpoint, records, name, total, source);
    for (int p = 0; p < replicas; ++p) {
      for (int c = 0; c < schedule.chunks(); ++c) {
        if (!is_local(rank_at(p, schedule.device_of(c))) || staged.contains({tp_index(p), c})) continue;
        Staged& st = staged[{tp_index(p), c}];
        nn::Sequential const& chunk = chunks[static_cast<std::size_t>(p)][static_cast<std::size_t>(c)];
        auto const count = static_cast<std::size_t>(chunk.parameter_count());
        st.parameters.assign(count, 0.0f);
        for (std::string const& name : state_names) st.state[name].assign(count, 0.0f);
        for (parallel::ShardBox const& b : parallel::shard_boxes(architecture, chunk, chunk_origins(p, c))) {
          parallel::read_box_into(checkpoint, records, "model.parameters", b, st.parameters, host_stream);
          for (std::string const& name : state_names) parallel::read_box_into(checkpoint, records, name, b, st.state[name], host_stream);
        }
      }
    }
  } catch (...) {
    failure = std::current_exception();
  }
  comm::detail::agree(across ? comm.get() : nullptr, *group, failure, "Executor::load of " + source);
  for (int p = 0; p < replicas; ++p) {
    for (int c = 0; c < schedule.chunks(); ++c) {
      int const rank = rank_at(p, schedule.device_of(c));
      if (!is_local(rank)) continue;  // another process loads it
      Staged const& st = staged.at({tp_index(p), c});
      nn::Sequential& chunk = chunks[static_cast<std::size_t>(p)][static_cast<std::size_t>(c)];
      optim::Optimizer& optimizer = *optimizers[static_cast<std::size_t>(p)][static_cast<std::size_t>(c)];
      Stream& stream = group->stream(rank - first);
      from_host(chunk.master_parameters(), st.parameters, stream);
      chunk.sync_parameters(stream);
      std::vector<optim::NamedTensor> const mine =
          state_names.empty() ? optimizer.state() : optimizer.prepare_state(chunk.master_parameters(), group->allocator(rank - first), stream);
      stream.synchronize();
      for (auto const& [name, tensor] : mine) {
        auto const saved = st.state.find("optimizer." + name);
        if (saved == st.state.end()) {
          fill_async(tensor, 0.0f, stream);  // none saved (before a first step)
          stream.synchronize();
        } else {
          from_host(tensor, saved->second, stream);
        }
      }
      optimizer.set_steps(training.optimizer_steps);
      set_chunk_rng(p, c, training.rng, training.rng_seeds);
    }
  }
  return finish_load(training, scaler);
}

}  // namespace mgpu::pipeline
