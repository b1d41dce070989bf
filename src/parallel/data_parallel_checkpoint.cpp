// DataParallel's checkpoints: the executor's own records (the position in the accumulation cycle,
// each rank's accumulated gradients, the loss scaler, the comm hook's state) beside those of
// io::training_checkpoint, verified on load against this executor and restored on any rank count.
// Across processes (or into a folder) a checkpoint is a folder of io::ShardWriter shards, one per
// process: process 0's holds the whole records, every process's the optimizer state of the elements
// its ranks own.
#include <mgpu/parallel/data_parallel.hpp>

#include <algorithm>
#include <bit>
#include <cstring>
#include <exception>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <mgpu/core/error.hpp>
#include <mgpu/io/checkpoint.hpp>
#include <mgpu/io/sharded_checkpoint.hpp>

#include "core/backend.hpp"
#include "parallel/data_parallel_impl.hpp"

namespace mgpu::parallel {

namespace {
constexpr char const* accumulation_record = "data_parallel.accumulation";
constexpr char const* accumulator_record = "data_parallel.accumulator";
constexpr char const* hook_record = "data_parallel.comm_hook";
constexpr char const* hook_state_record = "data_parallel.comm_hook.state";

// A float32 [ranks, parameters] record as one flat host tensor.
Tensor host_copy(io::Record const& record) {
  Tensor t = Tensor::empty({static_cast<std::int64_t>(record.data.size() / sizeof(float))}, DType::float32, mgpu::detail::host_staging_allocator());
  if (!record.data.empty()) std::memcpy(t.data(), record.data.data(), record.data.size());
  return t;
}

// Where element `begin` of the parameters lies in an optimizer state packed over the `owned` ranges.
std::int64_t packed_offset(std::vector<std::pair<std::int64_t, std::int64_t>> const& owned, std::int64_t begin) {
  std::int64_t offset = 0;
  for (auto const& [first, end] : owned) {
    if (begin >= first && begin < end) return offset + (begin - first);
    offset += end - first;
  }
  throw Error(Errc::invalid_argument, "element " + std::to_string(begin) +
                                          " is in none of the optimizer's owned ranges (expected the ranges the "
                                          "sharded update laid its state out for)");
}

}  // namespace

void DataParallel::Impl::save_state(io::Checkpoint& checkpoint, io::ShardWriter* pieces) {
  int const k = options.accumulation_steps;
  std::int64_t const position = micro_steps % k;
  if (position > 0 && !state[0]->accumulator.defined())
    throw Error(Errc::invalid_argument,
                "DataParallel::save after " + std::to_string(position) + " of " + std::to_string(k) +
                    " accumulated micro-batches at zero_stage " + std::to_string(options.zero_stage) +
                    " (expected a save at the end of an accumulation cycle: "
                    "sharded gradients mid-cycle are not saved yet)");
  checkpoint.put(accumulation_record, std::vector<std::int64_t>{k, position});
  auto const n = static_cast<std::int64_t>(state.size());
  std::int64_t const count = state[0]->model.parameter_count();
  Allocator& host = mgpu::detail::host_staging_allocator();
  // A [ranks, parameters] record of a row per rank: this process's rows whole, or as its pieces of
  // the world's rows.
  auto const put_rows = [&](char const* name, Tensor const& rows) {
    if (pieces == nullptr) return checkpoint.put(name, rows.reshape({n, count}), group->stream(0));
    comm::Communicator const& comm = sync->communicator();
    for (std::int64_t r = 0; r < n; ++r)
      pieces->put_piece(name, {comm.size(), count}, (comm.first_rank() + r) * count, rows.slice(r * count, (r + 1) * count),
                        group->stream(0));
  };
  if (position > 0) {  // each rank's share of the accumulated gradients
    Tensor const rows = Tensor::empty({n * count}, DType::float32, host);
    for (std::int64_t r = 0; r < n; ++r)
      copy_async(rows.slice(r * count, (r + 1) * count), state[static_cast<std::size_t>(r)]->accumulator, group->stream(static_cast<int>(r)));
    group->synchronize();
    put_rows(accumulator_record, rows);
  }
  if (auto const& scaler = state[0]->scaler) io::put_loss_scaler(checkpoint, scaler->state());
  if (CommHook* hook = options.comm_hook.get()) {
    Tensor const rows = Tensor::empty({n * count}, DType::float32, host);
    std::fill(rows.host_span<float>().begin(), rows.host_span<float>().end(), 0.0f);
    // Into a folder every process writes its rows (zeros before the first reduce), so that the
    // pieces cover the record whatever each process holds.
    if (sync->copy_hook_state(rows) || pieces != nullptr) {
      group->synchronize();
      checkpoint.put(hook_record, hook->name());
      put_rows(hook_state_record, rows);
    }
  }
}

DataParallel::Impl::Saved DataParallel::Impl::verify_state(io::Checkpoint const& c, std::string const& source) const {
  Saved saved;
  std::string const file = source + ": ";
  int const k = options.accumulation_steps;
  if (c.contains(accumulation_record)) {
    auto const cycle = c.get_int64(accumulation_record);
    if (cycle.size() != 2 || cycle[0] < 1 || cycle[1] < 0 || cycle[1] >= cycle[0])
      throw Error(Errc::corrupt_data, file + "malformed " + accumulation_record + " record (expected the cycle's length and position in it)");
    saved.position = cycle[1];
    if (saved.position > 0 && cycle[0] != k)
      throw Error(Errc::invalid_argument, file + "saved after " + std::to_string(saved.position) + " of " + std::to_string(cycle[0]) +
                                              " accumulated micro-batches (expected accumulation_steps = " + std::to_string(cycle[0]) +
                                              " to resume it, not " + std::to_string(k) + ", or a checkpoint saved at the end of a cycle)");
    if (saved.position > 0 && !state[0]->accumulator.defined())
      throw Error(Errc::invalid_argument, file + "saved after " + std::to_string(saved.position) + " of " + std::to_string(k) +
                                              " accumulated micro-batches (expected a checkpoint saved at the end of a cycle at "
                                              "zero_stage " + std::to_string(options.zero_stage) + ": sharded gradients do not resume mid-cycle yet)");
  }
  // Records sized by the model are checked only when its parameters fit: otherwise load_training
  // refuses the file and names the architecture.
  std::int64_t const count = state[0]->model.parameter_count();
  if (!c.contains("model.parameters") || c.get("model.parameters").shape != Shape{count}) return saved;
  auto const rows = [&](char const* name) {
    io::Record const& r = c.get(name);
    if (r.type != io::RecordType::float32 || r.shape.size() != 2 || r.shape[0] < 1 || r.shape[1] != count)
      throw Error(Errc::corrupt_data, file + "record '" + name + "' of shape " + to_string(r.shape) + " (expected float32 [ranks, " +
                                          std::to_string(count) + "], a row of the model's parameters per rank that saved it)");
    return host_copy(r);
  };
  if (saved.position > 0) saved.accumulator = rows(accumulator_record);
  if (state[0]->scaler) saved.scaler = io::read_loss_scaler(c, source, *state[0]->scaler);
  if (options.comm_hook && c.contains(hook_state_record) && c.get_text(hook_record) == options.comm_hook->name())
    saved.hook_state = rows(hook_state_record);
  return saved;
}

void DataParallel::Impl::restore_state(Saved const& saved) {
  auto const n = static_cast<std::int64_t>(state.size());
  std::int64_t const count = state[0]->model.parameter_count();
  Allocator& host = mgpu::detail::host_staging_allocator();
  Tensor const zeros = Tensor::empty({count}, DType::float32, host);
  std::fill(zeros.host_span<float>().begin(), zeros.host_span<float>().end(), 0.0f);
  // Rank r's row of what `ranks` ranks saved: its own on as many ranks of the world; on another
  // count, world rank 0 takes the sum of the rows (what every rank would have added) and the
  // others none.
  comm::Communicator const& comm = sync->communicator();
  auto const share = [&](Tensor const& all, std::int64_t r) {
    std::int64_t const ranks = all.numel() / count;
    std::int64_t const rank = comm.first_rank() + r;
    if (ranks == comm.size()) return all.slice(rank * count, (rank + 1) * count);
    if (rank > 0) return zeros;
    Tensor const sum = Tensor::empty({count}, DType::float32, host);
    auto const in = all.host_span<float>();
    auto const out = sum.host_span<float>();
    for (std::int64_t i = 0; i < count; ++i) {
      float total = 0;
      for (std::int64_t row = 0; row < ranks; ++row) total += in[static_cast<std::size_t>(row * count + i)];
      out[static_cast<std::size_t>(i)] = total;
    }
    return sum;
  };
  for (std::int64_t r = 0; r < n; ++r) {
    Rank& st = *state[static_cast<std::size_t>(r)];
    Stream& stream = group->stream(static_cast<int>(r));
    if (st.accumulator.defined()) copy_async(st.accumulator, saved.position > 0 ? share(saved.accumulator, r) : zeros, stream);
    st.scaler = options.loss_scaler;
    if (st.scaler && saved.scaler) st.scaler->set_state(*saved.scaler);
    if (options.comm_hook) sync->set_hook_state(static_cast<int>(r), saved.hook_state.defined() ? share(saved.hook_state, r) : zeros);
  }
  sync->synchronize();
  group->synchronize();
  micro_steps = saved.position;
}

void DataParallel::Impl::save_shards(std::filesystem::path const& folder, io::TrainingState const& training) {
  std::string const what = "DataParallel::save to the folder " + folder.string();
  comm::Communicator& comm = sync->communicator();
  bool const leader = comm.first_rank() == 0;
  auto const write = [&](std::uint64_t save_id, int shard, int shards) {
    io::ShardWriter writer;
    // The executor's records: every process its ranks' rows (accumulated gradients mid-cycle, the
    // comm hook's state), process 0 the rest.
    io::Checkpoint whole;
    save_state(whole, &writer);
    if (leader) {  // the whole records: replica 0's, as in one process, less the optimizer state
      Rank& first = *state[0];
      io::Checkpoint const training_records = io::training_checkpoint(first.model, *first.optimizer, training, group->stream(0));
      for (io::Record const& record : training_records.records()) whole.put(record);
      for (io::Record const& record : whole.records())
        if (!record.name.starts_with("optimizer.") || record.type != io::RecordType::float32) writer.put(record);
    }
    std::int64_t const count = state[0]->model.parameter_count();
    for (std::size_t r = 0; r < state.size(); ++r) {
      optim::Optimizer const& optimizer = *state[r]->optimizer;
      Stream& stream = group->stream(static_cast<int>(r));
      auto const& owned = optimizer.state_ranges();
      for (auto const& [name, tensor] : optimizer.state()) {
        if (owned.empty()) {  // the whole state: world rank 0 writes it
          if (leader && r == 0) writer.put_piece("optimizer." + name, {count}, 0, tensor, stream);
          continue;
        }
        // The elements this rank updates and counts (those that every rank updates, rank 0's).
        for (nn::ElementRange const& range : sync->rank(static_cast<int>(r)).owned()) {
          if (!range.counted || range.begin == range.end) continue;
          std::int64_t const at = packed_offset(owned, range.begin);
          writer.put_piece("optimizer." + name, {count}, range.begin, tensor.slice(at, at + (range.end - range.begin)),
                           stream);
        }
      }
    }
    writer.save(folder, save_id, shard, shards);
  };
  comm::detail::save_in_shards(
      comm, *group, what, [&] { return io::committed_save_id(folder) + 1; }, write,
      [&](std::uint64_t save_id, int shards) { io::commit_shards(folder, save_id, shards); });
}

io::TrainingState DataParallel::Impl::load_shards(std::filesystem::path const& folder) {
  io::ShardedCheckpoint const sharded = io::ShardedCheckpoint::load(folder);
  std::string const file = folder.string() + ": ";
  std::int64_t const count = state[0]->model.parameter_count();
  std::vector<std::string> optimizer_state;  // the split records of the optimizer's state
  for (std::string const& name : sharded.split_names()) {
    if (!name.starts_with("optimizer.")) continue;
    if (sharded.shape(name) != Shape{count})
      throw Error(Errc::invalid_argument, file + "record '" + name + "' of shape " + to_string(sharded.shape(name)) +
                                              " (expected [" + std::to_string(count) +
                                              "], a value per parameter of the model)");
    optimizer_state.push_back(name);
  }
  io::Checkpoint const records = sharded.joined(optimizer_state);  // all but the optimizer's state
  Saved const saved = verify_state(records, folder.string());
  io::TrainingState training;
  for (std::size_t r = 0; r < state.size(); ++r) {  // the model, RNG and step count; the state zeroed
    int const rank = static_cast<int>(r);
    training = io::load_training(records, folder.string(), state[r]->model, *state[r]->optimizer, group->allocator(rank),
                                 group->stream(rank));
  }
  // Each rank's optimizer state in the sharded update's layout, read from the folder's pieces: the
  // elements it owns (all of them without the sharded update), never the whole state.
  for (std::size_t r = 0; r < state.size() && !optimizer_state.empty(); ++r) {
    int const rank = static_cast<int>(r);
    optim::Optimizer& optimizer = *state[r]->optimizer;
    Stream& stream = group->stream(rank);
    sync->rank(rank).shard_optimizer_state(optimizer, group->allocator(rank), stream);
    std::vector<optim::NamedTensor> const buffers =
        optimizer.prepare_state(state[r]->model.master_parameters(), group->allocator(rank), stream);
    std::vector<std::pair<std::int64_t, std::int64_t>> const owned =
        optimizer.state_ranges().empty() ? std::vector<std::pair<std::int64_t, std::int64_t>>{{0, count}} : optimizer.state_ranges();
    for (auto const& [name, tensor] : buffers) {
      if (!sharded.has_pieces("optimizer." + name))
        throw Error(Errc::corrupt_data, file + "no record 'optimizer." + name + "' (expected the " + optimizer.name() +
                                            " state that the other optimizer records belong to)");
      std::int64_t at = 0;
      for (auto const& [begin, end] : owned) {
        sharded.read("optimizer." + name, begin, tensor.slice(at, at + (end - begin)), stream);
        at += end - begin;
      }
    }
  }
  restore_state(saved);
  broken.clear();
  return training;
}

void DataParallel::save(std::filesystem::path const& path, io::TrainingState const& state) {
  Impl& im = *impl_;
  im.check_usable("DataParallel::save");
  im.sync->synchronize();
  im.group->synchronize();
  im.sync->gather_whole();  // zero_stage 3: the whole model, saved as the other stages save it
  if (im.across_processes() || std::filesystem::is_directory(path)) {
    im.save_shards(path, state);
    return;
  }
  im.sync->gather_optimizer_state(im.optimizers());
  io::Checkpoint checkpoint = io::training_checkpoint(im.state[0]->model, *im.state[0]->optimizer, state, im.group->stream(0));
  im.save_state(checkpoint);
  checkpoint.save(path);
}

io::TrainingState DataParallel::load(std::filesystem::path const& path) {
  Impl& im = *impl_;
  im.sync->synchronize();
  im.group->synchronize();
  im.sync->gather_whole();  // zero_stage 3: loaded whole, sharded again by the next step
  if (std::filesystem::is_directory(path)) return im.load_shards(path);
  io::Checkpoint const checkpoint = io::Checkpoint::load(path);
  Impl::Saved const saved = im.verify_state(checkpoint, path.string());
  // Every rank's optimizer state whole, as the file holds it (sharded again by the next step).
  im.sync->gather_optimizer_state(im.optimizers());
  io::TrainingState state;
  for (std::size_t r = 0; r < im.state.size(); ++r) {
    int const rank = static_cast<int>(r);
    state = io::load_training(checkpoint, path.string(), im.state[r]->model, *im.state[r]->optimizer, im.group->allocator(rank),
                              im.group->stream(rank));
  }
  im.restore_state(saved);
  im.broken.clear();
  return state;
}

}  // namespace mgpu::parallel
