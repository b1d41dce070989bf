// Checkpoints: named, typed, shaped records in a versioned binary file, each with an xxHash64
// checksum, plus one over the whole file; written atomically, verified before anything is handed
// out. The format and its records: docs/checkpoints.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <mgpu/core/memory.hpp>
#include <mgpu/core/stream.hpp>
#include <mgpu/core/tensor.hpp>
#include <mgpu/optim/optim.hpp>

namespace mgpu::nn {
class Sequential;
}
namespace mgpu::optim {
class Optimizer;
}

namespace mgpu::io {

/// The element type of a record: tensor dtypes, plus integers and bytes for metadata.
enum class RecordType : std::uint8_t { float32 = 0, bfloat16 = 1, float16 = 2, int32 = 3, int64 = 16, uint64 = 17, bytes = 18 };
/// "float32", "bytes", ... or "unknown type N".
[[nodiscard]] std::string to_string(RecordType type);
using mgpu::to_string;  // shapes and dtypes, beside record types

struct Record {
  std::string name;
  RecordType type = RecordType::bytes;
  Shape shape;
  std::vector<std::byte> data;
};

/// The format version this build writes and reads.
inline constexpr std::uint32_t checkpoint_version = 1;

/// A record of a checkpoint file without its payload: what Checkpoint::index reads, and where the
/// payload lies (Checkpoint::read_record reads it).
struct RecordEntry {
  std::string name;
  RecordType type = RecordType::bytes;
  Shape shape;
  std::uint64_t offset = 0;  ///< of the payload, in bytes from the file's start
  std::uint64_t size = 0;
  std::uint64_t checksum = 0;  ///< XXH64 of the payload
};

class Checkpoint {
 public:
  /// Adds (or replaces) a record: a tensor (copied to the host through `stream`, which is
  /// synchronized), integers, or text.
  void put(std::string const& name, Tensor const& tensor, Stream& stream);
  void put(std::string const& name, std::vector<std::int64_t> const& values);
  void put(std::string const& name, std::vector<std::uint64_t> const& values);
  void put(std::string const& name, std::string const& text);
  /// Adds (or replaces) a record as it is. Throws Error(invalid_argument) when its bytes do not
  /// match its type and shape, or its name is empty or longer than 4096 characters.
  void put(Record record);

  [[nodiscard]] bool contains(std::string const& name) const noexcept;
  /// The record; throws Error(invalid_argument) naming a missing one.
  [[nodiscard]] Record const& get(std::string const& name) const;
  [[nodiscard]] std::vector<std::int64_t> get_int64(std::string const& name) const;
  [[nodiscard]] std::vector<std::uint64_t> get_uint64(std::string const& name) const;
  [[nodiscard]] std::string get_text(std::string const& name) const;
  /// Throws Error(invalid_argument) unless record `name` fits `tensor` (same shape and dtype),
  /// naming both; copy_to() checks the same, then copies the record into the tensor.
  void check_fits(std::string const& name, Tensor const& tensor) const;
  void copy_to(std::string const& name, Tensor const& tensor, Stream& stream) const;
  [[nodiscard]] std::vector<Record> const& records() const noexcept { return records_; }

  /// Writes the file atomically; throws Error(io) naming the path and the failing call.
  void save(std::filesystem::path const& path) const;
  /// Reads and verifies a file. Throws Error(io) when it cannot be read, Error(corrupt_data) naming the
  /// path and what is wrong: not a checkpoint, an unknown version, truncated (with the byte
  /// offset), a checksum mismatch (with the record); Error(invalid_argument) for a folder.
  static Checkpoint load(std::filesystem::path const& path);
  /// The records' headers without payloads, checked as load() checks them but for the checksums
  /// (format, version, end marker, types, shapes against byte counts, payloads within the file).
  static std::vector<RecordEntry> index(std::filesystem::path const& path);
  /// One record's payload, read from `path` at `entry` (from index()) and verified against its
  /// checksum. Throws Error(io) when it cannot be read, Error(corrupt_data) naming the path and the
  /// record on a mismatch.
  static Record read_record(std::filesystem::path const& path, RecordEntry const& entry);

 private:
  Record& slot(std::string const& name);
  // A one-dimensional record of `count` elements of `type` copied from `values`.
  void put_values(std::string const& name, RecordType type, void const* values, std::size_t count);
  std::vector<Record> records_;
};

/// Where a training run stands besides the model and optimizer.
struct TrainingState {
  std::int64_t step = 0;
  std::int64_t epoch = 0;
  /// Batches of the current epoch already taken (resume continues from the next one).
  std::int64_t batch = 0;
  /// The data order's seed (the loader's shuffle is a function of seed and epoch).
  std::uint64_t data_seed = 0;
};

/// The records save_training writes, for a caller that adds its own (an executor's state) before
/// saving them in one file.
Checkpoint training_checkpoint(nn::Sequential const& model, optim::Optimizer const& optimizer, TrainingState const& state, Stream& stream);

/// The records training_checkpoint writes but the parameters and the optimizer's state, for a writer
/// whose ranks hold those in parts (each rank's boxes of the named tensors): `model` (materialized or
/// not) gives the architecture and the RNG state, `optimizer` its kind and step count.
Checkpoint training_metadata(nn::Sequential const& model, optim::Optimizer const& optimizer, TrainingState const& state);

/// Saves one logical model (its float32 master parameters; a data-parallel group saves one
/// replica), the optimizer's state and step count, the model's RNG state and `state`. Into an
/// existing folder of shards (ShardedCheckpoint): a one-shard save of the same records, committed.
void save_training(std::filesystem::path const& path, nn::Sequential const& model, optim::Optimizer const& optimizer,
                   TrainingState const& state, Stream& stream);

/// Loads what save_training wrote into a materialized model (any device, compute type) and optimizer,
/// verifying everything first: on an error nothing changes and the Error names the mismatch. No
/// optimizer state in the file (saved before a first step): zeroed. `path` may be a folder of
/// shards (ShardedCheckpoint) of any layout, read joined as one file.
TrainingState load_training(std::filesystem::path const& path, nn::Sequential& model, optim::Optimizer& optimizer,
                            Allocator& allocator, Stream& stream);
/// The same from a checkpoint already read (`source` names it in errors).
TrainingState load_training(Checkpoint const& checkpoint, std::string const& source, nn::Sequential& model, optim::Optimizer& optimizer,
                            Allocator& allocator, Stream& stream);

/// A dynamic loss scaler's state (scale, good steps, skipped steps) as the record
/// training.loss_scaler, which every executor writes and reads, so a float16 run resumes on any layout.
void put_loss_scaler(Checkpoint& checkpoint, optim::LossScaler::State const& state);
/// The loss scaler's state saved in `checkpoint` (training.loss_scaler, or the data_parallel. or
/// pipeline.loss_scaler of files written before it), checked against `scaler`'s settings; nullopt
/// when none was saved. Throws Error(corrupt_data) naming `source` for a malformed record or a state
/// the scaler refuses. Changes nothing.
std::optional<optim::LossScaler::State> read_loss_scaler(Checkpoint const& checkpoint, std::string const& source,
                                                         optim::LossScaler const& scaler);

/// The records load_training reads besides the parameters and the optimizer's state.
struct TrainingRecords {
  std::vector<std::uint64_t> rng;   ///< model.rng: each layer's RNG state
  std::int64_t optimizer_steps = 0;  ///< optimizer.steps
  TrainingState state;
  /// model.rng_seeds: the layers' rng_seeds(), one after the other (empty in a file from before
  /// they were saved: the model keeps its own).
  std::vector<std::uint64_t> rng_seeds;
};
/// Reads them from `checkpoint`, verified as load_training does against `model`'s architecture and
/// `optimizer`'s kind, for a reader taking the parameters and state in parts. Throws as load_training.
TrainingRecords read_training_records(Checkpoint const& checkpoint, std::string const& source, nn::Sequential const& model,
                                      optim::Optimizer const& optimizer);

}  // namespace mgpu::io
