// Sharded checkpoints: a folder of one committed save, written as a shard file per writer and a
// manifest, read by any number of readers in element ranges. Guide: docs/checkpoints.md.
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <mgpu/core/stream.hpp>
#include <mgpu/core/tensor.hpp>
#include <mgpu/io/checkpoint.hpp>

namespace mgpu::io {

/// One writer's shard: pieces of records split across writers, and whole records.
class ShardWriter {
 public:
  /// Elements [begin, begin + values.numel()) of record `name` of whole `shape` (the same for every
  /// writer; the writers' pieces cover it once), copied through `stream` (synchronized). Throws
  /// Error(invalid_argument) for a range outside the shape or a second piece at `begin`.
  void put_piece(std::string const& name, Shape const& shape, std::int64_t begin, Tensor const& values, Stream& stream);
  /// A whole record. Several writers may hold the same one; they must hold the same bytes.
  void put(std::string const& name, Tensor const& tensor, Stream& stream);
  void put(std::string const& name, std::vector<std::int64_t> const& values);
  void put(std::string const& name, std::vector<std::uint64_t> const& values);
  void put(std::string const& name, std::string const& text);
  /// A whole record as it is (e.g. one of a Checkpoint's records()).
  void put(Record record);

  /// Writes shard `shard` of `shards` of save `save_id` into `folder` (made if missing), atomically.
  /// Throws Error(invalid_argument) for a shard outside [0, shards), Error(io) naming the file.
  void save(std::filesystem::path const& folder, std::uint64_t save_id, int shard, int shards) const;

 private:
  Checkpoint checkpoint_;
};

/// The file of shard `shard` of `shards` of save `save_id` in `folder`.
std::filesystem::path shard_path(std::filesystem::path const& folder, std::uint64_t save_id, int shard, int shards);

/// Makes save `save_id` the folder's checkpoint; one writer, after every save() returned. Checks every
/// shard file is there, writes the manifest atomically, then removes other saves' files. Throws
/// Error(io) naming a missing shard file (the previous save stays committed).
void commit_shards(std::filesystem::path const& folder, std::uint64_t save_id, int shards);

/// The save id `folder`'s manifest names (0: none; the next save takes one more). Throws
/// Error(corrupt_data) naming a manifest that is not one.
std::uint64_t committed_save_id(std::filesystem::path const& folder);

/// A committed sharded checkpoint: load() reads the manifest, the shards' indexes and the whole
/// records, and verifies the shards agree and each split record's pieces cover it once; a piece is
/// read, and verified, only when read() or joined() needs it.
class ShardedCheckpoint {
 public:
  /// Throws Error(io) when the folder has no manifest (nothing committed) or a shard file cannot be
  /// read, Error(corrupt_data) naming the file or the record and what is wrong.
  static ShardedCheckpoint load(std::filesystem::path const& folder);

  /// The folder it was loaded from.
  [[nodiscard]] std::filesystem::path const& folder() const noexcept { return folder_; }
  [[nodiscard]] std::uint64_t save_id() const noexcept { return save_id_; }
  [[nodiscard]] int shards() const noexcept { return shards_; }

  /// Whether `name` is a split record (written by put_piece).
  [[nodiscard]] bool has_pieces(std::string const& name) const noexcept { return split_.count(name) != 0; }
  /// The split records' names, sorted.
  [[nodiscard]] std::vector<std::string> split_names() const;
  /// A split record's whole shape; throws Error(invalid_argument) naming a missing one.
  [[nodiscard]] Shape const& shape(std::string const& name) const;
  /// A split record's element type; throws as shape() does.
  [[nodiscard]] RecordType type(std::string const& name) const;
  /// Copies elements [begin, begin + out.numel()) of split record `name` into `out` through `stream`
  /// (synchronized). Throws Error(invalid_argument) for a missing record, another dtype, a bad range.
  void read(std::string const& name, std::int64_t begin, Tensor const& out, Stream& stream) const;

  /// Whole records (written by put), from whichever shard holds them.
  [[nodiscard]] bool contains(std::string const& name) const noexcept { return whole_.contains(name); }
  [[nodiscard]] Checkpoint const& whole() const noexcept { return whole_; }

  /// Every record whole, as one Checkpoint file would hold them, but the split records in `leave_out`.
  [[nodiscard]] Checkpoint joined(std::vector<std::string> const& leave_out = {}) const;
  /// The payload bytes read so far: the whole records' and shapes' at load(), and the pieces'
  /// that read() and joined() read (a piece read twice counts twice).
  [[nodiscard]] std::uint64_t payload_bytes_read() const noexcept { return bytes_read_->load(); }

 private:
  struct Piece {
    std::int64_t begin = 0;
    std::int64_t numel = 0;
    int shard = 0;
    RecordEntry entry;
  };
  // A piece's payload, read from its shard file and verified.
  [[nodiscard]] std::vector<std::byte> payload(Piece const& piece) const;
  struct Split {
    Shape shape;
    bool shaped = false;  // a shard gave the shape
    RecordType type = RecordType::float32;
    std::vector<Piece> pieces;  // sorted by begin, covering the record once
  };
  std::filesystem::path folder_;
  std::uint64_t save_id_ = 0;
  int shards_ = 0;
  std::map<std::string, Split> split_;
  Checkpoint whole_;
  std::unique_ptr<std::atomic<std::uint64_t>> bytes_read_ = std::make_unique<std::atomic<std::uint64_t>>(0);
};

}  // namespace mgpu::io
