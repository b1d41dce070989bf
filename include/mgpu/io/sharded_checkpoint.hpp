// Sharded checkpoints: a folder of one committed save, written as a shard file per writer and a
// manifest, read by any number of readers in element ranges or N-D boxes of the global tensors.
// Guide: docs/checkpoints.md.
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

namespace detail {
struct Run;
}

/// A box of an N-D tensor: its first index and its extent along each of the tensor's dimensions.
struct Box {
  std::vector<std::int64_t> offsets;
  Shape lengths;
  /// The elements it holds; -1 for a negative extent or a count past int64.
  [[nodiscard]] std::int64_t numel() const noexcept;
  friend bool operator==(Box const&, Box const&) = default;
};
/// "[0:4, 8:16]": begin:end along each dimension.
[[nodiscard]] std::string to_string(Box const& box);
/// The box of the whole tensor of `shape`.
[[nodiscard]] Box whole_box(Shape const& shape);
/// Whether `box` has `shape`'s rank and lies within it.
[[nodiscard]] bool within(Box const& box, Shape const& shape) noexcept;

/// The format this build writes ("mgpu-sharded-checkpoint-<N>"); it reads version 1 too.
inline constexpr int sharded_checkpoint_version = 2;

/// One writer's shard: pieces of records split across writers, and whole records.
class ShardWriter {
 public:
  /// Elements [begin, begin + values.numel()) of record `name` of whole `shape` (the same for every
  /// writer; the writers' pieces cover it once), copied through `stream` (synchronized). Throws
  /// Error(invalid_argument) for a range outside the shape or a second piece at `begin`.
  void put_piece(std::string const& name, Shape const& shape, std::int64_t begin, Tensor const& values, Stream& stream);
  /// Box `box` of tensor `name` of global `shape` (the same for every writer, whose boxes tile it
  /// once): `values` holds its box.numel() elements row-major, copied through `stream`
  /// (synchronized). Throws Error(invalid_argument) for a box of another rank or outside the shape,
  /// another value count, or a second box at the same offsets.
  void put_box(std::string const& name, Shape const& shape, Box const& box, Tensor const& values, Stream& stream);
  /// Record `name` as a layout: a 1-D record of `numel` elements made of split tensors (put_box,
  /// named "<name>/<tensor>") laid end to end at their offsets, as a model's flat buffer holds them;
  /// read as one split record (read(), joined()) or each tensor in boxes. Throws
  /// Error(invalid_argument) for offsets that are not increasing from 0.
  void put_layout(std::string const& name, std::int64_t numel, std::vector<std::pair<std::string, std::int64_t>> const& tensors);
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

/// A committed sharded checkpoint: load() reads the manifest, indexes and whole records and verifies
/// that each split record's pieces or boxes cover it once; a piece or box is read (and verified)
/// only when needed.
class ShardedCheckpoint {
 public:
  /// Throws Error(io) when the folder has no manifest (nothing committed) or a shard file cannot be
  /// read, Error(corrupt_data) naming the file or the record and what is wrong.
  static ShardedCheckpoint load(std::filesystem::path const& folder);

  /// The folder it was loaded from.
  [[nodiscard]] std::filesystem::path const& folder() const noexcept { return folder_; }
  [[nodiscard]] std::uint64_t save_id() const noexcept { return save_id_; }
  [[nodiscard]] int shards() const noexcept { return shards_; }
  /// The manifest's format version (1 or 2).
  [[nodiscard]] int version() const noexcept { return version_; }

  /// Whether `name` is a split record (written by put_piece or put_box, or a layout).
  [[nodiscard]] bool has_pieces(std::string const& name) const noexcept {
    return split_.count(name) != 0 || layouts_.count(name) != 0;
  }
  /// The split records' names, sorted: layouts and the records that are no layout's tensors.
  [[nodiscard]] std::vector<std::string> split_names() const;
  /// A split record's whole shape; throws Error(invalid_argument) naming a missing one.
  [[nodiscard]] Shape const& shape(std::string const& name) const;
  /// A split record's element type; throws as shape() does.
  [[nodiscard]] RecordType type(std::string const& name) const;
  /// Copies elements [begin, begin + out.numel()) of split record `name` into `out` through `stream`
  /// (synchronized). Throws Error(invalid_argument) for a missing record, another dtype, a bad range.
  void read(std::string const& name, std::int64_t begin, Tensor const& out, Stream& stream) const;
  /// Copies box `box` of split record `name` into `out` (row-major) through `stream` (synchronized),
  /// reading only what overlaps it. Throws as read() does, and for a box outside the record's shape.
  void read_box(std::string const& name, Box const& box, Tensor const& out, Stream& stream) const;

  /// Copies box `box` of the tensor of shape `view` at elements [offset, ...) of split record or
  /// layout `name` into `out` (row-major) through `stream` (synchronized), reading only what overlaps
  /// it. Throws as read_box() does, and for a view past the record's elements.
  void read_view(std::string const& name, std::int64_t offset, Shape const& view, Box const& box, Tensor const& out,
                 Stream& stream) const;

  /// Where a split record's parts lie: each piece's or box's shard and box (a piece of put_piece as
  /// a one-dimensional box of the flattened record), in the order a reader finds them.
  struct Part {
    Box box;
    int shard = 0;
  };
  [[nodiscard]] std::vector<Part> parts(std::string const& name) const;
  /// Whether `name` is a layout (put_layout); its tensors' names, in their order within it.
  [[nodiscard]] bool is_layout(std::string const& name) const noexcept { return layouts_.count(name) != 0; }
  [[nodiscard]] std::vector<std::string> layout_tensors(std::string const& name) const;
  /// Whether `name` was split in element ranges of the flattened record (put_piece) rather than boxes.
  [[nodiscard]] bool split_by_elements(std::string const& name) const;

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
    Box box;  // {begin}, {numel} over the flattened record for an element range
    int shard = 0;
    RecordEntry entry;
  };
  // Throws Error(invalid_argument) unless `out` is a tensor of record `name`'s element type.
  void check_output(std::string const& name, Tensor const& out) const;
  // A piece's payload, read from its shard file and verified.
  [[nodiscard]] std::vector<std::byte> payload(Piece const& piece) const;
  struct Split {
    Shape shape;
    bool shaped = false;  // a shard gave the shape
    RecordType type = RecordType::float32;
    bool flat = false;          // element ranges (pieces), not boxes
    bool boxed = false;         // a shard gave boxes
    std::vector<Piece> pieces;  // sorted by offsets, covering the record once
  };
  // Copies the split record's elements in `to` (runs of the flattened record; `bounds`: their box
  // when `boxed`) into `destination`, reading the parts that overlap them.
  void gather(Split const& split, std::vector<detail::Run> const& to, Box const* bounds, std::byte* destination) const;
  std::filesystem::path folder_;
  std::uint64_t save_id_ = 0;
  int shards_ = 0;
  int version_ = sharded_checkpoint_version;
  std::map<std::string, Split> split_;
  struct Layout {
    Shape shape;                                            // {numel}
    std::vector<std::pair<std::int64_t, std::string>> tensors;  // offset, tensor; increasing, end to end
  };
  std::map<std::string, Layout> layouts_;
  // Elements [begin, begin + count) of split record or layout `name` (checked) into `destination`.
  void read_range(std::string const& name, std::int64_t begin, std::int64_t count, std::byte* destination) const;
  Checkpoint whole_;
  std::unique_ptr<std::atomic<std::uint64_t>> bytes_read_ = std::make_unique<std::atomic<std::uint64_t>>(0);
};

}  // namespace mgpu::io
