// The whole model as one device holds it, assembled from the chunks of replica 0 and spread back
// over every replica's chunks: its parameters (gather_parameters, scatter_parameters) and the
// executor's checkpoints to a file (io::save_training's format). Folders, across processes too,
// hold each rank's boxes of the named tensors (box_checkpoint.cpp); tensor-parallel stages' files
// go through the whole model (tensor_parallel_checkpoint.cpp).
#include <mgpu/io/checkpoint.hpp>
#include <mgpu/io/sharded_checkpoint.hpp>
#include <mgpu/pipeline/pipeline.hpp>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <mgpu/core/error.hpp>
#include <mgpu/core/memory.hpp>

#include "comm/agreement.hpp"
#include "pipeline/executor_impl.hpp"

namespace mgpu::pipeline {

WholeModel::WholeModel(nn::Sequential const& architecture, ChunkOptimizerFactory const& make, std::uint64_t seed)
    : model(architecture.clone()) {
  nn::Context ctx{*allocator, stream};
  model.materialize(ctx, seed);
  stream.synchronize();  // the group's streams write into it next
  optimizer = make(model);
  if (!optimizer)
    throw Error(Errc::invalid_argument, "the pipeline's optimizer factory returned no optimizer for the whole model "
                                        "(expected a new optimizer from every call: checkpoints make one)");
}

std::vector<Executor::Impl::Span> Executor::Impl::whole_spans() const {
  std::vector<Span> out;
  std::int64_t offset = 0;
  for (int c = 0; c < schedule.chunks(); ++c) {
    std::int64_t count = chunks[0][static_cast<std::size_t>(c)].parameter_count();
    if (tie && c == tie->head_chunk) count -= tie->elements;
    out.push_back({offset, count});
    offset += count;
  }
  return out;
}

void Executor::Impl::to_whole(int c, Tensor const& chunk_buffer, Tensor const& whole, Stream& stream) const {
  Span const s = whole_spans()[static_cast<std::size_t>(c)];
  copy_async(whole.slice(s.offset, s.offset + s.count), chunk_buffer.slice(0, s.count), stream);
}

std::vector<Executor::Impl::Part> Executor::Impl::chunk_parts(int c) const {
  std::vector<Span> const at = whole_spans();
  Span const s = at[static_cast<std::size_t>(c)];
  std::vector<Part> parts{{s.offset, 0, s.count}};
  std::int64_t const copy = chunks[0][static_cast<std::size_t>(c)].parameter_count() - s.count;  // a tied head's copy of wte
  if (copy > 0) parts.push_back({at[static_cast<std::size_t>(tie->embedding_chunk)].offset + tie->embedding_offset, s.count, copy});
  return parts;
}

void Executor::Impl::from_whole(int c, Tensor const& whole, Tensor const& chunk_buffer, Stream& stream) const {
  for (Part const& p : chunk_parts(c))
    copy_async(chunk_buffer.slice(p.chunk_begin, p.chunk_begin + p.count), whole.slice(p.whole_begin, p.whole_begin + p.count), stream);
}

namespace {
void check_whole(nn::Sequential const& whole, std::int64_t expected, char const* call) {
  if (whole.parameter_count() != expected)
    throw Error(Errc::invalid_argument, std::string(call) + " with a model of " + std::to_string(whole.parameter_count()) +
                                            " parameters (expected the executor's model: " + std::to_string(expected) + ")");
}
}  // namespace

void Executor::gather_parameters(nn::Sequential& whole, Stream& stream) {
  Impl& m = *impl_;
  m.gather_whole();  // zero_stage 3: the next step shards them again
  if (m.tp > 1) {
    check_whole(whole, m.architecture.parameter_count(), "Executor::gather_parameters");
    stream.synchronize();
    m.group->synchronize();
    Tensor const values = Tensor::empty({whole.parameter_count()}, DType::float32, *Allocator::create({DeviceKind::host, 0}));
    m.tensor_parallel_whole(values.host_span<float>(), false, [&m](int p, int c) {
      return m.chunks[static_cast<std::size_t>(p)][static_cast<std::size_t>(c)].master_parameters();
    });
    copy_async(whole.master_parameters(), values, stream);
    whole.sync_parameters(stream);
    stream.synchronize();
    return;
  }
  check_whole(whole, m.whole_spans().back().offset + m.whole_spans().back().count, "Executor::gather_parameters");
  stream.synchronize();  // whole's own work done before the chunks' streams write into it
  m.group->synchronize();
  if (m.across) {
    // Each chunk's owner broadcasts its parameters over the world; this process's first rank
    // copies them into `whole`.
    m.group->run([&](int local, Device, Stream& rank_stream) {
      int const rank = m.first + local;
      for (int c = 0; c < m.schedule.chunks(); ++c) {
        nn::Sequential const& chunk = m.chunks[0][static_cast<std::size_t>(c)];
        int const owner = m.schedule.device_of(c);
        Tensor const buffer = rank == owner
                                  ? chunk.master_parameters()
                                  : Tensor::empty({chunk.parameter_count()}, DType::float32, m.group->allocator(local));
        m.comm->broadcast(rank, buffer, owner, rank_stream);
        if (local == 0) m.to_whole(c, buffer, whole.master_parameters(), rank_stream);
      }
    });
  } else {
    for (int c = 0; c < m.schedule.chunks(); ++c)
      m.to_whole(c, m.chunks[0][static_cast<std::size_t>(c)].master_parameters(), whole.master_parameters(),
                 m.group->stream(m.schedule.device_of(c)));
  }
  m.group->synchronize();
  whole.sync_parameters(stream);
  stream.synchronize();
}

void Executor::scatter_parameters(nn::Sequential const& whole, Stream& stream) {
  Impl& m = *impl_;
  m.gather_whole();  // zero_stage 3: written whole, sharded by the next step
  if (m.tp > 1) {
    check_whole(whole, m.architecture.parameter_count(), "Executor::scatter_parameters");
    m.group->synchronize();
    Tensor const values = Tensor::empty({whole.parameter_count()}, DType::float32, *Allocator::create({DeviceKind::host, 0}));
    copy_async(values, whole.master_parameters(), stream);
    stream.synchronize();
    m.tensor_parallel_whole(values.host_span<float>(), true, [&m](int p, int c) {
      return m.chunks[static_cast<std::size_t>(p)][static_cast<std::size_t>(c)].master_parameters();
    });
    m.sync_local_chunks();
    return;
  }
  check_whole(whole, m.whole_spans().back().offset + m.whole_spans().back().count, "Executor::scatter_parameters");
  stream.synchronize();
  m.group->synchronize();
  for (int r = 0; r < m.replicas; ++r) {
    for (int c = 0; c < m.schedule.chunks(); ++c) {
      int const rank = m.rank_at(r, m.schedule.device_of(c));
      if (!m.is_local(rank)) continue;  // another process's
      nn::Sequential& chunk = m.chunks[static_cast<std::size_t>(r)][static_cast<std::size_t>(c)];
      Stream& chunk_stream = m.group->stream(rank - m.first);
      m.from_whole(c, whole.master_parameters(), chunk.master_parameters(), chunk_stream);
      chunk.sync_parameters(chunk_stream);
    }
  }
  m.group->synchronize();
}

std::vector<std::size_t> Executor::Impl::chunk_origins(int p, int c) const {
  auto const index = static_cast<std::size_t>(c);
  nn::Sequential const& chunk = chunks[static_cast<std::size_t>(p)][index];
  if (tp > 1 && options.tensor_parallel.origins) {
    std::vector<std::size_t> origins = options.tensor_parallel.origins(
        tp_comms[static_cast<std::size_t>(data_index(p) * schedule.chunks() + c)], tp_index(p), cuts[index], cuts[index + 1]);
    if (origins.size() != chunk.size() ||
        std::any_of(origins.begin(), origins.end(), [&](std::size_t o) { return o < cuts[index] || o >= cuts[index + 1]; }))
      throw Error(Errc::invalid_argument, "pipeline chunk " + std::to_string(c) + ": the tensor-parallel stages' origins name " +
                                              std::to_string(origins.size()) + " layers (expected one per layer of the chunk's " +
                                              std::to_string(chunk.size()) + ", each in the model's [" + std::to_string(cuts[index]) +
                                              ", " + std::to_string(cuts[index + 1]) + "))");
    return origins;
  }
  if (chunk.size() != cuts[index + 1] - cuts[index])
    throw Error(Errc::invalid_argument, "pipeline chunk " + std::to_string(c) + " of " + std::to_string(chunk.size()) +
                                            " layers made from the model's " + std::to_string(cuts[index + 1] - cuts[index]) +
                                            " (expected TensorParallelStages::origins naming each layer's)");
  std::vector<std::size_t> origins(chunk.size());
  for (std::size_t j = 0; j < origins.size(); ++j) origins[j] = cuts[index] + j;
  return origins;
}

namespace {
// Where each layer's rng_seeds() begin among the model's ([size()]: their count).
std::vector<std::size_t> seed_offsets(nn::Sequential const& model) {
  std::vector<std::size_t> at(model.size() + 1, 0);
  for (std::size_t l = 0; l < model.size(); ++l) at[l + 1] = at[l] + model.layer(l).rng_seeds().size();
  return at;
}
}  // namespace

void Executor::Impl::set_chunk_rng(int p, int c, std::vector<std::uint64_t> const& rng, std::vector<std::uint64_t> const& seeds) {
  nn::Sequential& chunk = chunks[static_cast<std::size_t>(p)][static_cast<std::size_t>(c)];
  std::vector<std::size_t> const origins = chunk_origins(p, c);
  std::vector<std::uint64_t> state(chunk.size());
  for (std::size_t j = 0; j < origins.size(); ++j) state[j] = rng.at(origins[j]);
  chunk.set_rng_state(state);
  if (seeds.empty()) return;
  std::vector<std::size_t> const at = seed_offsets(architecture);
  std::vector<std::uint64_t> mine;
  for (std::size_t j = 0; j < origins.size(); ++j) {
    std::vector<std::uint64_t> const own = chunk.layer(j).rng_seeds();
    std::size_t const o = origins[j];
    if (own.size() == at[o + 1] - at[o]) {
      mine.insert(mine.end(), seeds.begin() + static_cast<std::ptrdiff_t>(at[o]), seeds.begin() + static_cast<std::ptrdiff_t>(at[o + 1]));
    } else {
      mine.insert(mine.end(), own.begin(), own.end());  // a layer a style added: its own
    }
  }
  chunk.set_rng_seeds(mine);
}

Executor::Impl::ReplicaRecords Executor::Impl::replica_records(std::string const& what) {
  // Every rank's view of replica 0's chunks it runs: the number of state buffers of their
  // optimizers (-1 for none), and their layers' RNG states and seeds at their origins' places
  // (zero elsewhere; of the layers made from one, the last: layers a style adds come first).
  std::size_t const layers = architecture.size();
  std::vector<std::size_t> const seed_at = seed_offsets(architecture);
  std::size_t const per_rank = 1 + 2 * layers + 2 * seed_at[layers];
  std::vector<std::vector<std::int32_t>> words(static_cast<std::size_t>(group->size()));
  for (int local = 0; local < group->size(); ++local) {
    std::vector<std::int32_t>& mine = words[static_cast<std::size_t>(local)];
    std::vector<std::uint64_t> rng(layers, 0);
    std::vector<std::uint64_t> seeds(seed_at[layers], 0);
    std::int32_t buffers = -1;
    for (int c = 0; c < schedule.chunks(); ++c) {
      if (schedule.device_of(c) != first + local) continue;
      auto const index = static_cast<std::size_t>(c);
      auto const count = static_cast<std::int32_t>(optimizers[0][index]->state().size());
      buffers = buffers < 0 || buffers == count ? count : -2;  // -2: this rank's chunks disagree
      nn::Sequential const& chunk = chunks[0][index];
      std::vector<std::uint64_t> const state = chunk.rng_state();
      std::vector<std::size_t> const origins = chunk_origins(0, c);
      for (std::size_t j = 0; j < origins.size(); ++j) {
        std::size_t const o = origins[j];
        rng[o] = state[j];
        std::vector<std::uint64_t> const own = chunk.layer(j).rng_seeds();
        if (own.size() == seed_at[o + 1] - seed_at[o]) std::copy(own.begin(), own.end(), seeds.begin() + static_cast<std::ptrdiff_t>(seed_at[o]));
      }
    }
    mine.push_back(buffers);
    for (std::uint64_t const v : rng) comm::detail::append_words(mine, v);
    for (std::uint64_t const v : seeds) comm::detail::append_words(mine, v);
  }
  std::vector<std::int32_t> const all = comm::detail::all_gather_words(*comm, *group, words);
  ReplicaRecords out{.buffers = -1, .rng = std::vector<std::uint64_t>(layers, 0), .seeds = std::vector<std::uint64_t>(seed_at[layers], 0)};
  std::int32_t& buffers = out.buffers;
  for (int c = 0; c < schedule.chunks(); ++c) {
    std::size_t const at = static_cast<std::size_t>(schedule.device_of(c)) * per_rank;
    std::int32_t const count = all[at];
    if (count == -2 || (buffers >= 0 && count != buffers))
      throw Error(Errc::invalid_argument,
                  what + ": pipeline chunk " + std::to_string(c) + "'s optimizer has " +
                      (count < 0 ? "another number of state buffers than a chunk on its device"
                                 : std::to_string(count) + " state buffers, chunk 0's " + std::to_string(buffers)) +
                      " (expected as many in every chunk: optimizers of one factory, stepped together)");
    buffers = count;
    auto const index = static_cast<std::size_t>(c);
    for (std::size_t l = cuts[index]; l < cuts[index + 1]; ++l) out.rng[l] = comm::detail::read_words<std::uint64_t>(all, at + 1 + 2 * l);
    for (std::size_t k = seed_at[cuts[index]]; k < seed_at[cuts[index + 1]]; ++k)
      out.seeds[k] = comm::detail::read_words<std::uint64_t>(all, at + 1 + 2 * layers + 2 * k);
  }
  buffers = std::max(buffers, 0);
  return out;
}

void Executor::save(std::filesystem::path const& path, io::TrainingState const& state) {
  impl_->check_usable("save");
  Impl& m = *impl_;
  m.group->synchronize();
  m.gather_optimizer_state();  // with zero_stage 1 each replica holds its blocks' state; the next step shards it again
  if (m.across || std::filesystem::is_directory(path)) {
    m.save_boxes(path, state);
    return;
  }
  if (m.tp > 1) {
    m.save_tensor_parallel(path, state);
    return;
  }
  WholeModel whole(m.architecture, m.make_optimizer, m.options.seed);
  std::vector<optim::NamedTensor> const first_state = m.optimizers[0][0]->state();
  std::vector<optim::NamedTensor> state_of_whole;
  if (!first_state.empty()) {
    state_of_whole = whole.optimizer->prepare_state(whole.model.master_parameters(), *whole.allocator, whole.stream);
    whole.stream.synchronize();  // zeroed before the chunks' streams copy into it
  }
  std::vector<std::uint64_t> rng;
  for (int c = 0; c < m.schedule.chunks(); ++c) {
    auto const index = static_cast<std::size_t>(c);
    nn::Sequential const& chunk = m.chunks[0][index];
    Stream& stream = m.group->stream(m.schedule.device_of(c));
    m.to_whole(c, chunk.master_parameters(), whole.model.master_parameters(), stream);
    std::vector<optim::NamedTensor> const mine = m.optimizers[0][index]->state();
    if (mine.size() != state_of_whole.size())
      throw Error(Errc::invalid_argument, "pipeline chunk " + std::to_string(c) + "'s optimizer has " + std::to_string(mine.size()) +
                                              " state buffers (expected " + std::to_string(state_of_whole.size()) +
                                              " as the whole model's optimizer of the same factory)");
    for (std::size_t i = 0; i < mine.size(); ++i) m.to_whole(c, mine[i].second, state_of_whole[i].second, stream);
    std::vector<std::uint64_t> const part = chunk.rng_state();
    rng.insert(rng.end(), part.begin(), part.end());
  }
  m.group->synchronize();
  whole.model.set_rng_state(rng);
  if (!m.loaded_seeds.empty()) whole.model.set_rng_seeds(m.loaded_seeds);
  whole.optimizer->set_steps(m.optimizers[0][0]->steps());
  io::Checkpoint checkpoint = io::training_checkpoint(whole.model, *whole.optimizer, state, whole.stream);
  if (m.options.loss_scaler) io::put_loss_scaler(checkpoint, m.options.loss_scaler->state());
  checkpoint.save(path);
}

io::TrainingState Executor::load(std::filesystem::path const& path) {
  if (std::filesystem::is_directory(path)) return load(io::ShardedCheckpoint::load(path));
  if (impl_->tp > 1) return impl_->load_tensor_parallel(path);
  return impl_->load_records(io::Checkpoint::load(path), path.string());
}

io::TrainingState Executor::load(io::ShardedCheckpoint const& checkpoint) { return impl_->load_boxes(checkpoint); }

io::TrainingState Executor::Impl::load_records(io::Checkpoint const& records, std::string const& source) {
  group->synchronize();
  gather_optimizer_state();  // the records fill whole state buffers; the next step shards them again
  std::string const file = source + ": ";
  std::vector<Span> const spans = whole_spans();
  std::int64_t const total = spans.back().offset + spans.back().count;
  auto const host = Allocator::create({DeviceKind::host, 0});
  Stream host_stream{Device{DeviceKind::host, 0}};
  // A float32 record of a value per parameter of the whole model.
  auto const check_shape = [&](std::string const& name) {
    if (!records.contains(name)) throw Error(Errc::corrupt_data, file + "no record '" + name + "' (expected one)");
    Shape const shape = records.get(name).shape;
    if (shape != Shape{total} || records.get(name).type != io::RecordType::float32)
      throw Error(Errc::invalid_argument, file + "record '" + name + "' of shape " + mgpu::to_string(shape) + " (expected [" +
                                              std::to_string(total) + "] float32, a value per parameter of the model)");
  };
  // Elements [begin, begin + out.numel()) of such a record into host tensor `out`.
  auto const read = [&](std::string const& name, std::int64_t begin, Tensor const& out) {
    if (out.numel() == 0) return;  // a chunk without parameters of its own (a tied head alone)
    std::memcpy(out.data(), records.get(name).data.data() + begin * static_cast<std::int64_t>(sizeof(float)), out.nbytes());
  };
  // Everything verified, and this process's chunks' parts read into host buffers (each chunk once,
  // whichever replicas run it here), before any chunk changes.
  struct Staged {
    Tensor parameters;
    std::unique_ptr<optim::Optimizer> optimizer;  // its state: the chunk's, read
  };
  std::vector<Staged> staged(static_cast<std::size_t>(schedule.chunks()));
  io::TrainingRecords training;
  std::optional<optim::LossScaler::State> scaler;
  bool has_state = false;
  std::exception_ptr failure;
  try {
    training = io::read_training_records(records, source, architecture, *optimizers[0][0]);
    if (options.loss_scaler) scaler = io::read_loss_scaler(records, source, *options.loss_scaler);
    check_shape("model.parameters");
    std::vector<std::string> state_names;  // the optimizer's, as the checkpoint holds them
    for (io::Record const& r : records.records())
      if (r.name.starts_with("optimizer.") && r.type == io::RecordType::float32) state_names.push_back(r.name);
    for (std::string const& name : state_names) check_shape(name);
    has_state = !state_names.empty();
    for (int c = 0; c < schedule.chunks(); ++c) {
      int r = 0;
      while (r < replicas && !is_local(rank_at(r, schedule.device_of(c)))) ++r;
      if (r == replicas) continue;  // no replica's chunk c runs here
      Staged& st = staged[static_cast<std::size_t>(c)];
      nn::Sequential const& chunk = chunks[static_cast<std::size_t>(r)][static_cast<std::size_t>(c)];
      st.parameters = Tensor::empty({chunk.parameter_count()}, DType::float32, *host);
      // A tied head's copy of wte from the embedding's chunk when that was read here already
      // (chunks go in order, the embedding's first), else from the record.
      Staged const* embedding = tie && c == tie->head_chunk ? &staged[static_cast<std::size_t>(tie->embedding_chunk)] : nullptr;
      std::vector<Part> const parts = chunk_parts(c);
      // `name`'s parts into `out`; `from_embedding`: the embedding chunk's buffer of the same name.
      auto const read_parts = [&](std::string const& name, Tensor const& out, Tensor const& from_embedding) {
        for (std::size_t i = 0; i < parts.size(); ++i) {
          Part const& p = parts[i];
          Tensor const to = out.slice(p.chunk_begin, p.chunk_begin + p.count);
          if (i == 0 || !from_embedding.defined()) {
            read(name, p.whole_begin, to);
          } else {
            copy_async(to, from_embedding.slice(tie->embedding_offset, tie->embedding_offset + p.count), host_stream);
            host_stream.synchronize();
          }
        }
      };
      bool const copy_wte = embedding != nullptr && embedding->parameters.defined();
      read_parts("model.parameters", st.parameters, copy_wte ? embedding->parameters : Tensor{});
      if (!has_state) continue;
      st.optimizer = make_optimizer(chunk);
      if (!st.optimizer)
        throw Error(Errc::invalid_argument, "the pipeline's optimizer factory returned no optimizer for chunk " +
                                                std::to_string(c) + " (expected a new optimizer from every call: load() makes one)");
      std::vector<optim::NamedTensor> const buffers = st.optimizer->prepare_state(st.parameters, *host, host_stream);
      host_stream.synchronize();  // zeroed before they are read into
      for (std::size_t i = 0; i < buffers.size(); ++i) {
        std::string const name = "optimizer." + buffers[i].first;
        if (std::find(state_names.begin(), state_names.end(), name) == state_names.end())
          throw Error(Errc::corrupt_data, file + "no record '" + name + "' (expected the " + st.optimizer->name() +
                                              " state that the other optimizer records belong to)");
        read_parts(name, buffers[i].second, copy_wte ? embedding->optimizer->state()[i].second : Tensor{});
      }
    }
  } catch (...) {
    failure = std::current_exception();
  }
  comm::detail::agree(across ? comm.get() : nullptr, *group, failure, "Executor::load of " + source);
  for (int r = 0; r < replicas; ++r) {
    for (int c = 0; c < schedule.chunks(); ++c) {
      int const rank = rank_at(r, schedule.device_of(c));
      if (!is_local(rank)) continue;  // another process loads it
      auto const index = static_cast<std::size_t>(c);
      Staged const& st = staged[index];
      nn::Sequential& chunk = chunks[static_cast<std::size_t>(r)][index];
      optim::Optimizer& optimizer = *optimizers[static_cast<std::size_t>(r)][index];
      Stream& stream = group->stream(rank - first);
      copy_async(chunk.master_parameters(), st.parameters, stream);
      chunk.sync_parameters(stream);
      if (has_state) {
        std::vector<optim::NamedTensor> const loaded = st.optimizer->state();
        std::vector<optim::NamedTensor> const mine =
            optimizer.prepare_state(chunk.master_parameters(), group->allocator(rank - first), stream);
        for (std::size_t i = 0; i < mine.size(); ++i) copy_async(mine[i].second, loaded[i].second, stream);
      } else {
        for (auto const& [name, tensor] : optimizer.state()) fill_async(tensor, 0.0f, stream);
      }
      optimizer.set_steps(training.optimizer_steps);
      set_chunk_rng(r, c, training.rng, training.rng_seeds);
    }
  }
  return finish_load(training, scaler);
}

io::TrainingState Executor::Impl::finish_load(io::TrainingRecords const& training,
                                              std::optional<optim::LossScaler::State> const& scaler) {
  if (!training.rng_seeds.empty()) loaded_seeds = training.rng_seeds;
  if (scaler) options.loss_scaler->set_state(*scaler);
  group->synchronize();
  if (!across) broken.clear();  // what a failed update left is replaced
  return training.state;
}

}  // namespace mgpu::pipeline
