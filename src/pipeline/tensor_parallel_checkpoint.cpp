// Tensor-parallel stages and the whole model: a buffer laid out as the whole model's parameters
// (the parameters, or an optimizer's state) put together from replica 0's shards and split back
// over every pipeline's (gather_parameters, scatter_parameters), and checkpoint files in
// io::save_training's format through the whole model on the host, as TensorParallel's. A tied
// LM head's copy of its rank's wte rows is left out of the whole model and made from the rows: its
// parameters and its optimizer's state equal the embedding's rows' (their gradients are summed).
#include <algorithm>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <mgpu/core/error.hpp>
#include <mgpu/core/memory.hpp>
#include <mgpu/io/checkpoint.hpp>
#include <mgpu/parallel/tensor_parallel.hpp>
#include <mgpu/pipeline/pipeline.hpp>

#include "comm/agreement.hpp"
#include "pipeline/executor_impl.hpp"

namespace mgpu::pipeline {

namespace {

// wte in a buffer laid out as the whole model's parameters (nn::Embedding's first [V, C]); empty
// without an embedding.
std::span<float> whole_wte(nn::Sequential const& architecture, std::span<float> whole) {
  std::vector<nn::ParameterRange> const ranges = architecture.parameter_ranges();
  for (nn::ParameterRange const& r : ranges) {
    if (auto const* embedding = dynamic_cast<nn::Embedding const*>(&architecture.layer(r.layer)))
      return whole.subspan(static_cast<std::size_t>(r.begin),
                           static_cast<std::size_t>(embedding->vocab() * embedding->features()));
  }
  return {};
}

}  // namespace

void Executor::Impl::tensor_parallel_whole(std::span<float> whole, bool to_shards, ChunkBuffer const& buffer) {
  std::vector<nn::ParameterRange> const whole_ranges = architecture.parameter_ranges();
  std::span<float> const wte = whole_wte(architecture, whole);
  auto const host = Allocator::create({DeviceKind::host, 0});
  auto const chunk_count = static_cast<std::size_t>(schedule.chunks());
  auto const checked = [&](int p, int c) {
    Tensor const values = buffer(p, c);
    std::int64_t const expected = chunks[static_cast<std::size_t>(p)][static_cast<std::size_t>(c)].parameter_count();
    if (values.numel() != expected || values.dtype() != DType::float32)
      throw Error(Errc::invalid_argument,
                  "pipeline chunk " + std::to_string(c) + " of pipeline " + std::to_string(p) + ": a buffer of " +
                      std::to_string(values.numel()) + " " + std::string(to_string(values.dtype())) +
                      " values (expected float32, one per parameter of the chunk: " + std::to_string(expected) + ")");
    return values;
  };
  // Gathering across processes: every chunk of replica 0's pipelines broadcast over the world by
  // its rank, each process's first rank keeping a host copy ([p * chunks + c]).
  std::vector<Tensor> received;
  if (!to_shards && across) {
    for (int p = 0; p < tp; ++p) {
      for (std::size_t c = 0; c < chunk_count; ++c)
        received.push_back(
            Tensor::empty({chunks[static_cast<std::size_t>(p)][c].parameter_count()}, DType::float32, *host));
    }
    group->run([&](int local, Device, Stream& stream) {
      int const rank = first + local;
      for (int p = 0; p < tp; ++p) {
        for (int c = 0; c < schedule.chunks(); ++c) {
          int const owner = rank_at(p, schedule.device_of(c));
          Tensor const& copy = received[static_cast<std::size_t>(p) * chunk_count + static_cast<std::size_t>(c)];
          Tensor const values =
              rank == owner ? checked(p, c) : Tensor::empty(copy.shape(), DType::float32, group->allocator(local));
          comm->broadcast(rank, values, owner, stream);
          if (local == 0) copy_async(copy, values, stream);
        }
      }
    });
    group->synchronize();
  }
  for (int p = 0; p < (to_shards ? replicas : tp); ++p) {
    for (int c = 0; c < schedule.chunks(); ++c) {
      int const rank = rank_at(p, schedule.device_of(c));
      if (to_shards && !is_local(rank)) continue;  // another process's
      nn::Sequential const& chunk = chunks[static_cast<std::size_t>(p)][static_cast<std::size_t>(c)];
      Tensor const local = is_local(rank) ? checked(p, c) : Tensor{};
      Tensor const values = received.empty()
                                ? Tensor::empty({chunk.parameter_count()}, DType::float32, *host)
                                : received[static_cast<std::size_t>(p) * chunk_count + static_cast<std::size_t>(c)];
      Stream& stream = group->stream(is_local(rank) ? rank - first : 0);
      if (received.empty() && !to_shards) {
        copy_async(values, local, stream);
        stream.synchronize();
      }
      std::span<float> const flat = values.host_span<float>();
      std::vector<std::size_t> const origins = chunk_origins(p, c);
      for (nn::ParameterRange const& range : chunk.parameter_ranges()) {
        std::span<float> const shard =
            flat.subspan(static_cast<std::size_t>(range.begin), static_cast<std::size_t>(range.size()));
        std::size_t const layer = origins[range.layer];
        auto const w = std::find_if(whole_ranges.begin(), whole_ranges.end(),
                                    [layer](nn::ParameterRange const& r) { return r.layer == layer; });
        if (w == whole_ranges.end()) {  // not in the model: a tied head's copy of its rank's wte rows
          auto const* head = dynamic_cast<parallel::VocabParallelLMHead const*>(&chunk.layer(range.layer));
          if (head == nullptr || wte.empty())
            throw Error(Errc::invalid_argument,
                        "pipeline chunk " + std::to_string(c) + "'s " + chunk.layer(range.layer).name() +
                            " has parameters that the whole model's layer " + std::to_string(layer) +
                            " lacks (expected only a tied LM head's copy of wte's rows)");
          if (to_shards) {
            auto const begin = static_cast<std::size_t>(head->vocab_begin() * head->features());
            std::copy_n(wte.begin() + static_cast<std::ptrdiff_t>(begin), shard.size(), shard.begin());
          }
          continue;
        }
        std::span<float> const part =
            whole.subspan(static_cast<std::size_t>(w->begin), static_cast<std::size_t>(w->size()));
        if (auto const* sharded = dynamic_cast<parallel::ShardedLayer const*>(&chunk.layer(range.layer))) {
          sharded->copy_shard(part, shard, to_shards);
        } else if (to_shards) {
          std::copy(part.begin(), part.end(), shard.begin());
        } else if (p == 0) {  // replicated: rank 0's
          std::copy(shard.begin(), shard.end(), part.begin());
        }
      }
      if (to_shards) {
        copy_async(local, values, stream);
        stream.synchronize();
      }
    }
  }
}

void Executor::Impl::sync_local_chunks() {
  for (int p = 0; p < replicas; ++p) {
    for (int c = 0; c < schedule.chunks(); ++c) {
      int const rank = rank_at(p, schedule.device_of(c));
      if (is_local(rank)) chunk_of(rank, c).sync_parameters(group->stream(rank - first));
    }
  }
  group->synchronize();
}

void Executor::Impl::save_tensor_parallel(std::filesystem::path const& path, io::TrainingState const& training) {
  std::string const what = "Executor::save to " + path.string();
  // The whole model and its optimizer's state put together on the host (one process: a folder,
  // or a save across processes, writes boxes instead).
  ReplicaRecords const replica = replica_records(what);
  WholeModel whole(architecture, make_optimizer, options.seed);
  auto const element = [](auto& nested, int p, int c) -> auto& {
    return nested[static_cast<std::size_t>(p)][static_cast<std::size_t>(c)];
  };
  tensor_parallel_whole(whole.model.master_parameters().host_span<float>(), false,
                        [&](int p, int c) { return element(chunks, p, c).master_parameters(); });
  if (replica.buffers > 0) {
    std::vector<optim::NamedTensor> const into =
        whole.optimizer->prepare_state(whole.model.master_parameters(), *whole.allocator, whole.stream);
    whole.stream.synchronize();  // zeroed before the values are written
    if (into.size() != static_cast<std::size_t>(replica.buffers))
      throw Error(Errc::invalid_argument, what + ": the chunks' optimizers hold " + std::to_string(replica.buffers) +
                                              " state buffers (expected " + std::to_string(into.size()) +
                                              " as the whole model's optimizer of the same factory)");
    for (std::size_t k = 0; k < into.size(); ++k)
      tensor_parallel_whole(into[k].second.host_span<float>(), false,
                            [&](int p, int c) { return element(optimizers, p, c)->state().at(k).second; });
  }
  whole.model.set_rng_state(replica.rng);
  whole.model.set_rng_seeds(replica.seeds);
  whole.optimizer->set_steps(optimizers[0][0]->steps());
  io::Checkpoint out = io::training_checkpoint(whole.model, *whole.optimizer, training, whole.stream);
  if (options.loss_scaler) io::put_loss_scaler(out, options.loss_scaler->state());
  out.save(path);
}

io::TrainingState Executor::Impl::load_tensor_parallel(std::filesystem::path const& path) {
  std::string const source = path.string();
  group->synchronize();
  gather_whole();  // zero_stage 3: written whole, sharded by the next step
  // Everything read and verified into the whole model first (every process, from the same files):
  // the chunks change only once every process has.
  std::exception_ptr failure;
  std::optional<WholeModel> whole;
  io::TrainingState state;
  std::optional<optim::LossScaler::State> scaler;
  try {
    whole.emplace(architecture, make_optimizer, options.seed);
    io::Checkpoint const records = io::Checkpoint::load(path);
    if (options.loss_scaler) scaler = io::read_loss_scaler(records, source, *options.loss_scaler);
    state = io::load_training(records, source, whole->model, *whole->optimizer, *whole->allocator, whole->stream);
  } catch (...) {
    failure = std::current_exception();
  }
  comm::detail::agree(across ? comm.get() : nullptr, *group, failure, "Executor::load of " + source);
  auto const element = [](auto& nested, int p, int c) -> auto& {
    return nested[static_cast<std::size_t>(p)][static_cast<std::size_t>(c)];
  };
  tensor_parallel_whole(whole->model.master_parameters().host_span<float>(), true,
                        [&](int p, int c) { return element(chunks, p, c).master_parameters(); });
  sync_local_chunks();
  std::vector<optim::NamedTensor> const saved = whole->optimizer->state();  // none: the checkpoint held none
  std::vector<std::uint64_t> const rng = whole->model.rng_state();
  std::vector<std::uint64_t> const seeds = whole->model.rng_seeds();
  for (int p = 0; p < replicas; ++p) {
    for (int c = 0; c < schedule.chunks(); ++c) {
      int const rank = rank_at(p, schedule.device_of(c));
      if (!is_local(rank)) continue;  // another process loads it
      nn::Sequential& chunk = element(chunks, p, c);
      optim::Optimizer& optimizer = *element(optimizers, p, c);
      Stream& stream = group->stream(rank - first);
      if (saved.empty()) {
        for (auto const& [name, tensor] : optimizer.state()) fill_async(tensor, 0.0f, stream);
      } else {
        (void)optimizer.prepare_state(chunk.master_parameters(), group->allocator(rank - first), stream);
      }
      optimizer.set_steps(whole->optimizer->steps());
      set_chunk_rng(p, c, rng, seeds);
    }
  }
  group->synchronize();  // prepare_state's zeros written before the values
  for (std::size_t k = 0; k < saved.size(); ++k)
    tensor_parallel_whole(saved[k].second.host_span<float>(), true,
                          [&](int p, int c) { return element(optimizers, p, c)->state().at(k).second; });
  loaded_seeds = seeds;
  if (scaler) options.loss_scaler->set_state(*scaler);
  group->synchronize();
  if (!across) broken.clear();  // what a failed update left is replaced
  return state;
}

}  // namespace mgpu::pipeline
