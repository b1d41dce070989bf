// Sharded checkpoints: a shard is a Checkpoint whose records are "piece:<begin>:<name>" (elements of
// a split record from <begin>, one-dimensional), "shape:<name>" (the split record's whole shape, as
// int64) and "whole:<name>" (whole records); the manifest is a Checkpoint of the save's id, its shard
// count and the format's name.
#include <mgpu/io/sharded_checkpoint.hpp>

#include <algorithm>
#include <cstring>
#include <string_view>
#include <system_error>
#include <utility>

#include <mgpu/core/error.hpp>

#include "core/backend.hpp"
#include "io/record_type.hpp"

namespace mgpu::io {
namespace {

constexpr char format_name[] = "mgpu-sharded-checkpoint-1";
constexpr std::string_view piece_prefix = "piece:";
constexpr std::string_view shape_prefix = "shape:";
constexpr std::string_view whole_prefix = "whole:";

std::filesystem::path manifest_path(std::filesystem::path const& folder) { return folder / "manifest.ckpt"; }

// The elements of `shape`, or -1 for a negative extent or a count past int64 (a shape read from a
// damaged file, or a caller's mistake).
std::int64_t numel_of(Shape const& shape) {
  std::int64_t n = 1;
  for (std::int64_t e : shape) {
    if (e < 0 || __builtin_mul_overflow(n, e, &n)) return -1;
  }
  return n;
}

// Whether `file` is a shard file of some save ("shard-<save>-<i>-of-<n>.ckpt").
bool is_shard_file(std::string const& file) {
  return file.rfind("shard-", 0) == 0 && file.size() > 5 && file.substr(file.size() - 5) == ".ckpt";
}

// The save id and shard count of a manifest file.
std::pair<std::uint64_t, int> read_manifest(std::filesystem::path const& manifest_file) {
  Checkpoint const manifest = Checkpoint::load(manifest_file);
  std::string const where = manifest_file.string();
  if (!manifest.contains("format") || manifest.get_text("format") != format_name || !manifest.contains("save_id") ||
      !manifest.contains("shards"))
    throw Error(Errc::corrupt_data, where + ": not a sharded checkpoint's manifest (expected format '" +
                                        std::string(format_name) + "', save_id and shards)");
  auto const ids = manifest.get_uint64("save_id");
  auto const counts = manifest.get_int64("shards");
  if (ids.size() != 1 || counts.size() != 1 || counts[0] < 1 || counts[0] > (1 << 20))
    throw Error(Errc::corrupt_data, where + ": a manifest with " + std::to_string(ids.size()) + " save ids and " +
                                        std::to_string(counts.size()) +
                                        " shard counts (expected one of each, 1 to 2^20 shards)");
  return {ids[0], static_cast<int>(counts[0])};
}

}  // namespace

void ShardWriter::put_piece(std::string const& name, Shape const& shape, std::int64_t begin, Tensor const& values,
                            Stream& stream) {
  std::int64_t const whole = numel_of(shape);
  if (whole < 0)
    throw Error(Errc::invalid_argument, "piece of '" + name + "' of a record of shape " + to_string(shape) +
                                            " (expected extents >= 0 whose product fits in 64 bits)");
  if (!values.defined() || begin < 0 || begin + values.numel() > whole)
    throw Error(Errc::invalid_argument, "piece of '" + name + "' at element " + std::to_string(begin) + " with " +
                                            std::to_string(values.defined() ? values.numel() : 0) +
                                            " elements (expected a defined tensor within the record's " +
                                            std::to_string(whole) + " elements, shape " + to_string(shape) + ")");
  std::string const key = std::string(piece_prefix) + std::to_string(begin) + ":" + name;
  if (checkpoint_.contains(key))
    throw Error(Errc::invalid_argument, "a second piece of '" + name + "' at element " + std::to_string(begin) +
                                            " (expected each piece once)");
  checkpoint_.put(key, values.reshape({values.numel()}), stream);
  checkpoint_.put(std::string(shape_prefix) + name, std::vector<std::int64_t>(shape.begin(), shape.end()));
}

void ShardWriter::put(std::string const& name, Tensor const& tensor, Stream& stream) {
  checkpoint_.put(std::string(whole_prefix) + name, tensor, stream);
}
void ShardWriter::put(std::string const& name, std::vector<std::int64_t> const& values) {
  checkpoint_.put(std::string(whole_prefix) + name, values);
}
void ShardWriter::put(std::string const& name, std::vector<std::uint64_t> const& values) {
  checkpoint_.put(std::string(whole_prefix) + name, values);
}
void ShardWriter::put(std::string const& name, std::string const& text) {
  checkpoint_.put(std::string(whole_prefix) + name, text);
}
void ShardWriter::put(Record record) {
  record.name = std::string(whole_prefix) + record.name;
  checkpoint_.put(std::move(record));
}

std::filesystem::path shard_path(std::filesystem::path const& folder, std::uint64_t save_id, int shard, int shards) {
  return folder / ("shard-" + std::to_string(save_id) + "-" + std::to_string(shard) + "-of-" + std::to_string(shards) + ".ckpt");
}

void ShardWriter::save(std::filesystem::path const& folder, std::uint64_t save_id, int shard, int shards) const {
  if (shards < 1 || shard < 0 || shard >= shards)
    throw Error(Errc::invalid_argument, "shard " + std::to_string(shard) + " of " + std::to_string(shards) +
                                            " (expected 0 <= shard < shards)");
  std::error_code error;
  std::filesystem::create_directories(folder, error);
  if (error) throw Error(Errc::io, "creating the checkpoint folder " + folder.string() + ": " + error.message());
  checkpoint_.save(shard_path(folder, save_id, shard, shards));
}

void commit_shards(std::filesystem::path const& folder, std::uint64_t save_id, int shards) {
  if (shards < 1) throw Error(Errc::invalid_argument, std::to_string(shards) + " shards (expected at least 1)");
  std::vector<std::string> keep;
  for (int i = 0; i < shards; ++i) {
    std::filesystem::path const file = shard_path(folder, save_id, i, shards);
    if (!std::filesystem::is_regular_file(file))
      throw Error(Errc::io, "committing save " + std::to_string(save_id) + ": " + file.string() +
                                " is missing (expected every writer's save() to have returned first)");
    keep.push_back(file.filename().string());
  }
  Checkpoint manifest;
  manifest.put("format", std::string(format_name));
  manifest.put("save_id", std::vector<std::uint64_t>{save_id});
  manifest.put("shards", std::vector<std::int64_t>{shards});
  manifest.save(manifest_path(folder));
  // The manifest names the new save: the files of others are no longer read.
  std::error_code error;
  for (auto const& entry : std::filesystem::directory_iterator(folder, error)) {
    std::string const file = entry.path().filename().string();
    if (is_shard_file(file) && std::find(keep.begin(), keep.end(), file) == keep.end())
      std::filesystem::remove(entry.path(), error);  // a leftover costs space only
  }
}

std::uint64_t committed_save_id(std::filesystem::path const& folder) {
  std::filesystem::path const manifest_file = manifest_path(folder);
  if (!std::filesystem::exists(manifest_file)) return 0;
  return read_manifest(manifest_file).first;
}

ShardedCheckpoint ShardedCheckpoint::load(std::filesystem::path const& folder) {
  std::filesystem::path const manifest_file = manifest_path(folder);
  if (!std::filesystem::is_regular_file(manifest_file))
    throw Error(Errc::io, "no sharded checkpoint in " + folder.string() + ": " + manifest_file.filename().string() +
                              " is missing (expected a committed save: commit_shards writes it last)");
  auto const [save_id, shards] = read_manifest(manifest_file);
  ShardedCheckpoint c;
  c.folder_ = folder;
  c.save_id_ = save_id;
  c.shards_ = shards;
  std::map<std::string, std::pair<std::string, RecordEntry>> whole_from;  // whole record -> the file that gave it, its entry
  for (int i = 0; i < c.shards_; ++i) {
    std::filesystem::path const file = shard_path(folder, c.save_id_, i, c.shards_);
    if (!std::filesystem::is_regular_file(file))
      throw Error(Errc::io, file.string() + " is missing (the manifest names save " + std::to_string(c.save_id_) +
                                " of " + std::to_string(c.shards_) + " shards)");
    std::string const source = file.string();
    for (RecordEntry const& r : Checkpoint::index(file)) {
      std::string_view const key = r.name;
      if (key.rfind(whole_prefix, 0) == 0) {
        std::string const name(key.substr(whole_prefix.size()));
        if (auto const first = whole_from.find(name); first != whole_from.end()) {
          RecordEntry const& e = first->second.second;
          if (e.type != r.type || e.shape != r.shape || e.size != r.size || e.checksum != r.checksum)
            throw Error(Errc::corrupt_data, source + ": record '" + name + "' differs from the one in " + first->second.first +
                                                " (expected the same bytes in every shard)");
          continue;
        }
        Record record = Checkpoint::read_record(file, r);
        *c.bytes_read_ += r.size;
        record.name = name;
        c.whole_.put(std::move(record));
        whole_from[name] = {source, r};
      } else if (key.rfind(shape_prefix, 0) == 0) {
        std::string const name(key.substr(shape_prefix.size()));
        Checkpoint one;
        one.put(Checkpoint::read_record(file, r));
        *c.bytes_read_ += r.size;
        auto const extents = one.get_int64(r.name);
        Shape const shape(extents.begin(), extents.end());
        Split& split = c.split_[name];
        if (!split.shaped) {
          split.shape = shape;
          split.shaped = true;
        } else if (split.shape != shape) {
          throw Error(Errc::corrupt_data, source + ": record '" + name + "' has shape " + to_string(shape) +
                                              ", another shard says " + to_string(split.shape) +
                                              " (expected the same shape in every shard)");
        }
      } else if (key.rfind(piece_prefix, 0) == 0) {
        std::string_view const rest = key.substr(piece_prefix.size());
        std::size_t const colon = rest.find(':');
        std::int64_t begin = -1;
        if (colon != std::string_view::npos && colon > 0 && colon < 19 &&
            std::all_of(rest.begin(), rest.begin() + static_cast<std::ptrdiff_t>(colon), [](char ch) { return ch >= '0' && ch <= '9'; }))
          begin = std::stoll(std::string(rest.substr(0, colon)));
        if (begin < 0 || r.shape.size() != 1)
          throw Error(Errc::corrupt_data, source + ": a piece record named '" + r.name +
                                              "' (expected piece:<first element>:<record>, one-dimensional)");
        auto& split = c.split_[std::string(rest.substr(colon + 1))];
        if (r.shape[0] > 0) split.pieces.push_back({begin, r.shape[0], i, r});  // an empty piece (a writer with none) holds nothing
      } else {
        throw Error(Errc::corrupt_data, source + ": record '" + r.name + "' is not part of a sharded checkpoint");
      }
    }
  }
  for (auto& [name, split] : c.split_) {
    if (!split.shaped)
      throw Error(Errc::corrupt_data, "record '" + name + "' in " + folder.string() +
                                          " has pieces but no shard gives its shape (expected a shape:" + name + " record)");
    std::sort(split.pieces.begin(), split.pieces.end(), [](Piece const& a, Piece const& b) { return a.begin < b.begin; });
    if (!split.pieces.empty()) split.type = split.pieces.front().entry.type;
    std::int64_t const whole = numel_of(split.shape);
    if (whole < 0)
      throw Error(Errc::corrupt_data, "record '" + name + "' in " + folder.string() + " has shape " +
                                          to_string(split.shape) + " (expected extents >= 0 whose product fits in 64 bits)");
    std::int64_t covered = 0;
    for (Piece const& p : split.pieces) {
      if (p.entry.type != split.type)
        throw Error(Errc::corrupt_data, "record '" + name + "' in " + folder.string() + " has pieces of " +
                                            detail::type_name(split.type) + " and of " +
                                            detail::type_name(p.entry.type) + " (expected one type)");
      if (p.begin != covered)
        throw Error(Errc::corrupt_data,
                    "record '" + name + "' in " + folder.string() + ": elements " +
                        (p.begin > covered ? "[" + std::to_string(covered) + ", " + std::to_string(p.begin) + ") are in no shard"
                                           : "from " + std::to_string(p.begin) + " are in two pieces") +
                        " (expected the pieces to cover its " + std::to_string(whole) + " elements once)");
      covered += p.numel;
    }
    if (covered != whole)
      throw Error(Errc::corrupt_data, "record '" + name + "' in " + folder.string() + ": elements [" +
                                          std::to_string(std::min(covered, whole)) + ", " +
                                          std::to_string(std::max(covered, whole)) + ") " +
                                          (covered < whole ? "are in no shard" : "lie past its shape " + to_string(split.shape)) +
                                          " (expected the pieces to cover its " + std::to_string(whole) + " elements once)");
  }
  return c;
}

Checkpoint ShardedCheckpoint::joined(std::vector<std::string> const& leave_out) const {
  Checkpoint all = whole_;
  for (auto const& [name, split] : split_) {
    if (std::find(leave_out.begin(), leave_out.end(), name) != leave_out.end()) continue;
    Record record{.name = name, .type = split.type, .shape = split.shape, .data = {}};
    for (Piece const& p : split.pieces) {
      std::vector<std::byte> const bytes = payload(p);
      record.data.insert(record.data.end(), bytes.begin(), bytes.end());
    }
    all.put(std::move(record));
  }
  return all;
}

std::vector<std::byte> ShardedCheckpoint::payload(Piece const& piece) const {
  Record record = Checkpoint::read_record(shard_path(folder_, save_id_, piece.shard, shards_), piece.entry);
  *bytes_read_ += piece.entry.size;
  return std::move(record.data);
}

std::vector<std::string> ShardedCheckpoint::split_names() const {
  std::vector<std::string> names;
  for (auto const& entry : split_) names.push_back(entry.first);
  return names;
}

Shape const& ShardedCheckpoint::shape(std::string const& name) const {
  auto const it = split_.find(name);
  if (it == split_.end())
    throw Error(Errc::invalid_argument, "sharded checkpoint record '" + name + "' is missing (expected a record written by put_piece)");
  return it->second.shape;
}

RecordType ShardedCheckpoint::type(std::string const& name) const {
  (void)shape(name);  // names a missing record
  return split_.at(name).type;
}

void ShardedCheckpoint::read(std::string const& name, std::int64_t begin, Tensor const& out, Stream& stream) const {
  Shape const& whole_shape = shape(name);
  Split const& split = split_.at(name);
  if (!out.defined() || detail::record_type(out.dtype()) != split.type)
    throw Error(Errc::invalid_argument, "reading record '" + name + "' of " + detail::type_name(split.type) + " into " +
                                            (out.defined() ? std::string(to_string(out.dtype())) : std::string("an undefined tensor")) +
                                            " (expected a tensor of the record's type)");
  std::int64_t const count = out.numel();
  std::int64_t const whole = numel_of(whole_shape);
  if (begin < 0 || begin + count > whole)
    throw Error(Errc::invalid_argument, "reading elements [" + std::to_string(begin) + ", " + std::to_string(begin + count) +
                                            ") of record '" + name + "' (expected a range within its " +
                                            std::to_string(whole) + " elements, shape " + to_string(whole_shape) + ")");
  std::size_t const element = detail::type_size(split.type);
  Tensor staging = Tensor::empty({count}, out.dtype(), mgpu::detail::host_staging_allocator());
  auto* dst = static_cast<std::byte*>(staging.data());
  // The first piece that ends past `begin`, then every piece up to the range's end.
  auto it = std::upper_bound(split.pieces.begin(), split.pieces.end(), begin,
                             [](std::int64_t at, Piece const& p) { return at < p.begin; });
  if (it != split.pieces.begin()) --it;
  for (std::int64_t at = begin; at < begin + count; ++it) {
    std::int64_t const piece_end = it->begin + it->numel;
    std::int64_t const take = std::min(piece_end, begin + count) - at;
    std::vector<std::byte> const bytes = payload(*it);
    std::memcpy(dst + static_cast<std::size_t>(at - begin) * element, bytes.data() + static_cast<std::size_t>(at - it->begin) * element,
                static_cast<std::size_t>(take) * element);
    at += take;
  }
  copy_async(out.reshape({count}), staging, stream);
  stream.synchronize();
}

}  // namespace mgpu::io
