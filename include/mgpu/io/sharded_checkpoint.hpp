// Sharded checkpoints: one checkpoint written in pieces by several writers (the processes of a job,
// or the ranks of a sharded state), each saving its own shard file, and read back by any number of
// readers, each taking the element ranges it needs from whichever shards hold them, so a job resumes
// on another process or device count.
//
// A folder holds one committed save: manifest.ckpt (a Checkpoint naming the save and its shard
// count) and shard-<save>-<i>-of-<n>.ckpt per writer (Checkpoint files: every record checksummed,
// written atomically). commit_shards() writes the manifest last, atomically, and only then removes
// the files of the previous save: a reader sees the previous save or the new one, never a mix, and a
// job that fails while writing loses nothing.
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
  /// Elements [begin, begin + values.numel()) of record `name`, whose whole tensor has `shape` (every
  /// writer passes the same shape), copied to the host through `stream` (synchronized). The pieces
  /// of all writers must cover the whole tensor once. Throws Error(invalid_argument) for a range
  /// outside the shape or a second piece of `name` at `begin`.
  void put_piece(std::string const& name, Shape const& shape, std::int64_t begin, Tensor const& values, Stream& stream);
  /// A whole record. Several writers may hold the same one; they must hold the same bytes.
  void put(std::string const& name, Tensor const& tensor, Stream& stream);
  void put(std::string const& name, std::vector<std::int64_t> const& values);
  void put(std::string const& name, std::vector<std::uint64_t> const& values);
  void put(std::string const& name, std::string const& text);
  /// A whole record as it is (e.g. one of a Checkpoint's records()).
  void put(Record record);

  /// Writes this shard, number `shard` of `shards`, of save `save_id` into `folder` (made if
  /// missing), atomically. Throws Error(invalid_argument) for a shard outside [0, shards) and
  /// Error(io) naming the file when it cannot be written.
  void save(std::filesystem::path const& folder, std::uint64_t save_id, int shard, int shards) const;

 private:
  Checkpoint checkpoint_;
};

/// The file of shard `shard` of `shards` of save `save_id` in `folder`.
std::filesystem::path shard_path(std::filesystem::path const& folder, std::uint64_t save_id, int shard, int shards);

/// Makes save `save_id` the folder's checkpoint. One writer calls it once every writer's save() has
/// returned (the caller's barrier): it checks that every shard file is there, writes the manifest
/// atomically, then removes other saves' shard files. Throws Error(io) naming a missing shard file
/// (the manifest then still names the previous save).
void commit_shards(std::filesystem::path const& folder, std::uint64_t save_id, int shards);

/// The save id that `folder`'s manifest names, or 0 when nothing is committed there (no manifest):
/// a writer's next save takes one more. Reads the manifest only. Throws Error(corrupt_data) naming
/// a manifest that is not one.
std::uint64_t committed_save_id(std::filesystem::path const& folder);

/// A committed sharded checkpoint. load() reads the manifest, every shard file's index of records
/// (Checkpoint::index: headers, no payloads) and the whole records, and verifies that the shards
/// agree on each record's shape and type and that each split record's pieces cover it exactly
/// once; a split record's pieces are read when read() or joined() needs them, each verified
/// against its checksum then, so a reader that takes its own ranges reads the pieces holding
/// them and no others.
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
  /// Copies elements [begin, begin + out.numel()) of split record `name` into `out` (its dtype must be
  /// the record's), through `stream` (synchronized). Throws Error(invalid_argument) naming the record
  /// for a missing one, another dtype or a range outside it.
  void read(std::string const& name, std::int64_t begin, Tensor const& out, Stream& stream) const;

  /// Whole records (written by put), from whichever shard holds them.
  [[nodiscard]] bool contains(std::string const& name) const noexcept { return whole_.contains(name); }
  [[nodiscard]] Checkpoint const& whole() const noexcept { return whole_; }

  /// Every record whole, as one Checkpoint file of the same save would hold them: the whole records,
  /// and each split record's pieces joined in element order, but for the split records named in
  /// `leave_out` (those a reader takes in ranges through read()).
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
