// Sharded checkpoints: a shard is a Checkpoint whose records are "piece:<begin>:<name>" (elements of
// a split record from <begin>, one-dimensional), "box:<o0>,<o1>,...:<name>" (the box of a split
// record at those offsets, shaped as the box; version 2), "shape:<name>" (the split record's whole
// shape, as int64) and "whole:<name>" (whole records); the manifest is a Checkpoint of the save's id,
// its shard count and the format's name with its version.
#include <mgpu/io/sharded_checkpoint.hpp>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string_view>
#include <system_error>
#include <utility>

#include <mgpu/core/error.hpp>

#include "core/backend.hpp"
#include "io/boxes.hpp"
#include "io/record_type.hpp"

namespace mgpu::io {
namespace {

constexpr std::string_view format_prefix = "mgpu-sharded-checkpoint-";
constexpr std::string_view piece_prefix = "piece:";
constexpr std::string_view box_prefix = "box:";
constexpr std::string_view layout_prefix = "layout:";
constexpr std::string_view shape_prefix = "shape:";
constexpr std::string_view whole_prefix = "whole:";

std::filesystem::path manifest_path(std::filesystem::path const& folder) { return folder / "manifest.ckpt"; }

using detail::numel_of;
using detail::Run;

std::string format_name(int version) { return std::string(format_prefix) + std::to_string(version); }

// "<o0>,<o1>,...": the offsets of a box record's name; nullopt when it is not that.
std::optional<std::vector<std::int64_t>> parse_offsets(std::string_view text) {
  std::vector<std::int64_t> offsets;
  if (text.empty()) return offsets;
  for (std::size_t at = 0;;) {
    std::size_t const comma = std::min(text.find(',', at), text.size());
    std::string_view const number = text.substr(at, comma - at);
    if (number.empty() || number.size() > 18 || !std::all_of(number.begin(), number.end(), [](char ch) { return ch >= '0' && ch <= '9'; }))
      return std::nullopt;
    offsets.push_back(std::stoll(std::string(number)));
    if (comma == text.size()) return offsets;
    at = comma + 1;
  }
}

std::string offsets_text(std::vector<std::int64_t> const& offsets) {
  std::string text;
  for (std::size_t d = 0; d < offsets.size(); ++d) text += (d ? "," : "") + std::to_string(offsets[d]);
  return text;
}

// Whether `file` is a shard file of some save ("shard-<save>-<i>-of-<n>.ckpt").
bool is_shard_file(std::string const& file) {
  return file.rfind("shard-", 0) == 0 && file.size() > 5 && file.substr(file.size() - 5) == ".ckpt";
}

struct Manifest {
  std::uint64_t save_id = 0;
  int shards = 0;
  int version = 0;
};

// The save id, shard count and version of a manifest file.
Manifest read_manifest(std::filesystem::path const& manifest_file) {
  Checkpoint const manifest = Checkpoint::load(manifest_file);
  std::string const where = manifest_file.string();
  int version = 0;
  if (manifest.contains("format")) {
    std::string const format = manifest.get_text("format");
    for (int v = 1; v <= sharded_checkpoint_version; ++v) {
      if (format == format_name(v)) version = v;
    }
  }
  if (version == 0 || !manifest.contains("save_id") || !manifest.contains("shards"))
    throw Error(Errc::corrupt_data, where + ": not a sharded checkpoint's manifest (expected format '" + format_name(1) +
                                        "' to '" + format_name(sharded_checkpoint_version) + "', save_id and shards)");
  auto const ids = manifest.get_uint64("save_id");
  auto const counts = manifest.get_int64("shards");
  if (ids.size() != 1 || counts.size() != 1 || counts[0] < 1 || counts[0] > (1 << 20))
    throw Error(Errc::corrupt_data, where + ": a manifest with " + std::to_string(ids.size()) + " save ids and " +
                                        std::to_string(counts.size()) +
                                        " shard counts (expected one of each, 1 to 2^20 shards)");
  return {ids[0], static_cast<int>(counts[0]), version};
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

void ShardWriter::put_box(std::string const& name, Shape const& shape, Box const& box, Tensor const& values, Stream& stream) {
  if (numel_of(shape) < 0)
    throw Error(Errc::invalid_argument, "box of '" + name + "' of a tensor of shape " + to_string(shape) +
                                            " (expected extents >= 0 whose product fits in 64 bits)");
  if (!within(box, shape))
    throw Error(Errc::invalid_argument, "box " + to_string(box) + " of '" + name + "' (expected " +
                                            std::to_string(shape.size()) + " offsets and lengths within its shape " +
                                            to_string(shape) + ")");
  if (!values.defined() || values.numel() != box.numel())
    throw Error(Errc::invalid_argument, "box " + to_string(box) + " of '" + name + "' given " +
                                            std::to_string(values.defined() ? values.numel() : 0) + " values (expected " +
                                            std::to_string(box.numel()) + ", the box's elements)");
  std::string const key = std::string(box_prefix) + offsets_text(box.offsets) + ":" + name;
  if (checkpoint_.contains(key))
    throw Error(Errc::invalid_argument, "a second box of '" + name + "' at " + to_string(box) + " (expected each box once)");
  checkpoint_.put(key, values.reshape(box.lengths), stream);
  checkpoint_.put(std::string(shape_prefix) + name, std::vector<std::int64_t>(shape.begin(), shape.end()));
}

void ShardWriter::put_layout(std::string const& name, std::int64_t numel,
                             std::vector<std::pair<std::string, std::int64_t>> const& tensors) {
  std::string text = std::to_string(numel) + "\n";
  std::int64_t last = -1;
  for (auto const& [tensor, offset] : tensors) {
    if (offset <= last || (last < 0 && offset != 0) || offset >= numel || tensor.empty() || tensor.find('\n') != std::string::npos)
      throw Error(Errc::invalid_argument, "layout '" + name + "': tensor '" + tensor + "' at " + std::to_string(offset) +
                                              " (expected named tensors at increasing offsets from 0 below " +
                                              std::to_string(numel) + ")");
    last = offset;
    text += std::to_string(offset) + " " + tensor + "\n";
  }
  checkpoint_.put(std::string(layout_prefix) + name, text);
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
  manifest.put("format", format_name(sharded_checkpoint_version));
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
  return read_manifest(manifest_file).save_id;
}

ShardedCheckpoint ShardedCheckpoint::load(std::filesystem::path const& folder) {
  std::filesystem::path const manifest_file = manifest_path(folder);
  if (!std::filesystem::is_regular_file(manifest_file))
    throw Error(Errc::io, "no sharded checkpoint in " + folder.string() + ": " + manifest_file.filename().string() +
                              " is missing (expected a committed save: commit_shards writes it last)");
  Manifest const manifest = read_manifest(manifest_file);
  ShardedCheckpoint c;
  c.folder_ = folder;
  c.save_id_ = manifest.save_id;
  c.shards_ = manifest.shards;
  c.version_ = manifest.version;
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
        split.flat = true;
        if (r.shape[0] > 0) split.pieces.push_back({Box{{begin}, {r.shape[0]}}, i, r});  // an empty piece (a writer with none) holds nothing
      } else if (key.rfind(layout_prefix, 0) == 0) {
        std::string const name(key.substr(layout_prefix.size()));
        Checkpoint one;
        one.put(Checkpoint::read_record(file, r));
        *c.bytes_read_ += r.size;
        std::string const text = one.get_text(r.name);
        Layout layout;
        std::size_t at = 0;
        bool good = true;
        auto const number = [&](char end) {
          std::size_t const stop = text.find(end, at);
          std::string_view const digits = stop == std::string::npos ? std::string_view{} : std::string_view(text).substr(at, stop - at);
          good = good && !digits.empty() && digits.size() < 19 && std::all_of(digits.begin(), digits.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
          at = stop == std::string::npos ? text.size() : stop + 1;
          return good ? std::stoll(std::string(digits)) : std::int64_t{0};
        };
        layout.shape = {number('\n')};
        while (good && at < text.size()) {
          std::int64_t const offset = number(' ');
          std::size_t const stop = text.find('\n', at);
          good = good && stop != std::string::npos && stop > at;
          if (good) layout.tensors.emplace_back(offset, text.substr(at, stop - at));
          at = stop == std::string::npos ? text.size() : stop + 1;
        }
        if (!good)
          throw Error(Errc::corrupt_data, source + ": layout record '" + r.name +
                                              "' (expected its element count, then a line '<offset> <tensor>' per tensor)");
        if (auto const seen = c.layouts_.find(name); seen != c.layouts_.end()) {
          if (seen->second.shape != layout.shape || seen->second.tensors != layout.tensors)
            throw Error(Errc::corrupt_data, source + ": layout '" + name + "' differs from another shard's (expected the same in every shard)");
          continue;
        }
        c.layouts_[name] = std::move(layout);
      } else if (key.rfind(box_prefix, 0) == 0) {
        std::string_view const rest = key.substr(box_prefix.size());
        std::size_t const colon = rest.find(':');
        auto const offsets = colon == std::string_view::npos ? std::nullopt : parse_offsets(rest.substr(0, colon));
        if (!offsets || offsets->size() != r.shape.size())
          throw Error(Errc::corrupt_data, source + ": a box record named '" + r.name +
                                              "' (expected box:<offset>,...:<record>, an offset per dimension of its shape " +
                                              to_string(r.shape) + ")");
        auto& split = c.split_[std::string(rest.substr(colon + 1))];
        split.boxed = true;
        Box box{*offsets, r.shape};
        if (box.numel() > 0) split.pieces.push_back({std::move(box), i, r});  // a writer with none of it
      } else {
        throw Error(Errc::corrupt_data, source + ": record '" + r.name + "' is not part of a sharded checkpoint");
      }
    }
  }
  for (auto const& [name, layout] : c.layouts_) {
    std::int64_t covered = 0;
    for (auto const& [offset, tensor] : layout.tensors) {
      auto const it = c.split_.find(tensor);
      if (it == c.split_.end())
        throw Error(Errc::corrupt_data, "layout '" + name + "' in " + folder.string() + ": tensor '" + tensor +
                                            "' is in no shard (expected every tensor of the layout written in boxes)");
      if (offset != covered)
        throw Error(Errc::corrupt_data, "layout '" + name + "' in " + folder.string() + ": tensor '" + tensor + "' at " +
                                            std::to_string(offset) + " (expected " + std::to_string(covered) +
                                            ", the tensors laid end to end)");
      covered += std::max<std::int64_t>(numel_of(it->second.shape), 0);
    }
    if (covered != layout.shape[0])
      throw Error(Errc::corrupt_data, "layout '" + name + "' in " + folder.string() + ": tensors of " + std::to_string(covered) +
                                          " elements (expected " + std::to_string(layout.shape[0]) + ")");
  }
  for (auto& [name, split] : c.split_) {
    if (!split.shaped)
      throw Error(Errc::corrupt_data, "record '" + name + "' in " + folder.string() +
                                          " has pieces but no shard gives its shape (expected a shape:" + name + " record)");
    if (split.flat && split.boxed)
      throw Error(Errc::corrupt_data, "record '" + name + "' in " + folder.string() +
                                          " is split both in element ranges and in boxes (expected one or the other)");
    std::sort(split.pieces.begin(), split.pieces.end(), [](Piece const& a, Piece const& b) { return a.box.offsets < b.box.offsets; });
    if (!split.pieces.empty()) split.type = split.pieces.front().entry.type;
    std::int64_t const whole = numel_of(split.shape);
    if (whole < 0)
      throw Error(Errc::corrupt_data, "record '" + name + "' in " + folder.string() + " has shape " +
                                          to_string(split.shape) + " (expected extents >= 0 whose product fits in 64 bits)");
    for (Piece const& p : split.pieces) {
      if (p.entry.type != split.type)
        throw Error(Errc::corrupt_data, "record '" + name + "' in " + folder.string() + " has pieces of " +
                                            detail::type_name(split.type) + " and of " +
                                            detail::type_name(p.entry.type) + " (expected one type)");
    }
    if (split.boxed) {
      std::vector<Box> boxes;
      for (Piece const& p : split.pieces) boxes.push_back(p.box);
      detail::check_tiling(folder.string(), name, split.shape, boxes);
      continue;
    }
    std::int64_t covered = 0;
    for (Piece const& p : split.pieces) {
      std::int64_t const begin = p.box.offsets[0];
      if (begin != covered)
        throw Error(Errc::corrupt_data,
                    "record '" + name + "' in " + folder.string() + ": elements " +
                        (begin > covered ? "[" + std::to_string(covered) + ", " + std::to_string(begin) + ") are in no shard"
                                         : "from " + std::to_string(begin) + " are in two pieces") +
                        " (expected the pieces to cover its " + std::to_string(whole) + " elements once)");
      covered += p.box.lengths[0];
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
  for (std::string const& name : split_names()) {
    if (std::find(leave_out.begin(), leave_out.end(), name) != leave_out.end()) continue;
    Record record{.name = name, .type = type(name), .shape = shape(name), .data = {}};
    std::int64_t const count = numel_of(record.shape);
    record.data.resize(static_cast<std::size_t>(count) * detail::type_size(record.type));
    read_range(name, 0, count, record.data.data());
    all.put(std::move(record));
  }
  return all;
}

void ShardedCheckpoint::gather(Split const& split, std::vector<Run> const& to, Box const* bounds, std::byte* destination) const {
  if (to.empty()) return;
  std::int64_t const first = to.front().global;
  std::int64_t const last = to.back().global + to.back().length;  // past the end
  std::size_t const element = detail::type_size(split.type);
  for (Piece const& p : split.pieces) {
    // A box that misses `bounds` (or a piece outside the runs' span) is not read.
    if (split.boxed && bounds != nullptr && !detail::overlaps(p.box, *bounds)) continue;
    std::vector<Run> const from =
        split.flat ? std::vector<Run>{{p.box.offsets[0], p.box.lengths[0], 0}} : detail::box_runs(split.shape, p.box);
    if (from.empty() || from.back().global + from.back().length <= first || from.front().global >= last) continue;
    // Whether any run of the part meets one of `to` before reading its payload.
    std::int64_t const overlap = detail::copy_overlap(from, nullptr, to, nullptr, 0);
    if (overlap == 0) continue;
    std::vector<std::byte> const bytes = payload(p);
    detail::copy_overlap(from, bytes.data(), to, destination, element);
  }
}

std::vector<std::byte> ShardedCheckpoint::payload(Piece const& piece) const {
  Record record = Checkpoint::read_record(shard_path(folder_, save_id_, piece.shard, shards_), piece.entry);
  *bytes_read_ += piece.entry.size;
  return std::move(record.data);
}

std::vector<std::string> ShardedCheckpoint::split_names() const {
  std::vector<std::string> names;
  std::vector<std::string> parts;  // the layouts' tensors
  for (auto const& [name, layout] : layouts_) {
    names.push_back(name);
    for (auto const& entry : layout.tensors) parts.push_back(entry.second);
  }
  std::sort(parts.begin(), parts.end());
  for (auto const& entry : split_) {
    if (!std::binary_search(parts.begin(), parts.end(), entry.first)) names.push_back(entry.first);
  }
  std::sort(names.begin(), names.end());
  return names;
}

Shape const& ShardedCheckpoint::shape(std::string const& name) const {
  if (auto const layout = layouts_.find(name); layout != layouts_.end()) return layout->second.shape;
  auto const it = split_.find(name);
  if (it == split_.end())
    throw Error(Errc::invalid_argument, "sharded checkpoint record '" + name +
                                            "' is missing (expected a record written by put_piece, put_box or put_layout)");
  return it->second.shape;
}

RecordType ShardedCheckpoint::type(std::string const& name) const {
  (void)shape(name);  // names a missing record
  if (auto const layout = layouts_.find(name); layout != layouts_.end())
    return layout->second.tensors.empty() ? RecordType::float32 : split_.at(layout->second.tensors.front().second).type;
  return split_.at(name).type;
}

void ShardedCheckpoint::check_output(std::string const& name, Tensor const& out) const {
  RecordType const record_type = type(name);
  if (!out.defined() || detail::record_type(out.dtype()) != record_type)
    throw Error(Errc::invalid_argument, "reading record '" + name + "' of " + detail::type_name(record_type) + " into " +
                                            (out.defined() ? std::string(to_string(out.dtype())) : std::string("an undefined tensor")) +
                                            " (expected a tensor of the record's type)");
}

void ShardedCheckpoint::read(std::string const& name, std::int64_t begin, Tensor const& out, Stream& stream) const {
  Shape const& whole_shape = shape(name);
  check_output(name, out);
  std::int64_t const count = out.numel();
  std::int64_t const whole = numel_of(whole_shape);
  if (begin < 0 || begin + count > whole)
    throw Error(Errc::invalid_argument, "reading elements [" + std::to_string(begin) + ", " + std::to_string(begin + count) +
                                            ") of record '" + name + "' (expected a range within its " +
                                            std::to_string(whole) + " elements, shape " + to_string(whole_shape) + ")");
  Tensor staging = Tensor::empty({count}, out.dtype(), mgpu::detail::host_staging_allocator());
  read_range(name, begin, count, static_cast<std::byte*>(staging.data()));
  copy_async(out.reshape({count}), staging, stream);
  stream.synchronize();
}

void ShardedCheckpoint::read_range(std::string const& name, std::int64_t begin, std::int64_t count, std::byte* destination) const {
  if (count == 0) return;
  auto const layout = layouts_.find(name);
  if (layout == layouts_.end()) return gather(split_.at(name), {{begin, count, 0}}, nullptr, destination);
  std::size_t const element = detail::type_size(type(name));
  for (auto const& [offset, tensor] : layout->second.tensors) {  // the tensors the range meets
    std::int64_t const end = offset + numel_of(split_.at(tensor).shape);
    std::int64_t const from = std::max(begin, offset), to = std::min(begin + count, end);
    if (from < to) read_range(tensor, from - offset, to - from, destination + static_cast<std::size_t>(from - begin) * element);
  }
}

std::vector<std::string> ShardedCheckpoint::layout_tensors(std::string const& name) const {
  auto const layout = layouts_.find(name);
  if (layout == layouts_.end())
    throw Error(Errc::invalid_argument, "sharded checkpoint layout '" + name + "' is missing (expected a record written by put_layout)");
  std::vector<std::string> names;
  for (auto const& entry : layout->second.tensors) names.push_back(entry.second);
  return names;
}

void ShardedCheckpoint::read_box(std::string const& name, Box const& box, Tensor const& out, Stream& stream) const {
  Shape const& whole_shape = shape(name);
  check_output(name, out);
  if (!within(box, whole_shape) || out.numel() != box.numel())
    throw Error(Errc::invalid_argument, "reading box " + to_string(box) + " of record '" + name + "' into " +
                                            std::to_string(out.numel()) + " elements (expected a box within its shape " +
                                            to_string(whole_shape) + " and a tensor of its elements)");
  std::int64_t const count = out.numel();
  Tensor staging = Tensor::empty({count}, out.dtype(), mgpu::detail::host_staging_allocator());
  auto* destination = static_cast<std::byte*>(staging.data());
  if (is_layout(name)) {
    read_range(name, box.offsets[0], count, destination);  // one-dimensional: a range
  } else {
    gather(split_.at(name), detail::box_runs(whole_shape, box), &box, destination);
  }
  copy_async(out.reshape({count}), staging, stream);
  stream.synchronize();
}

void ShardedCheckpoint::read_view(std::string const& name, std::int64_t offset, Shape const& view, Box const& box,
                                  Tensor const& out, Stream& stream) const {
  std::int64_t const total = numel_of(shape(name));
  std::int64_t const count = numel_of(view);
  if (offset < 0 || count < 0 || offset > total - count)
    throw Error(Errc::invalid_argument, "reading a view " + to_string(view) + " at element " + std::to_string(offset) + " of record '" +
                                            name + "' (expected it within the record's " + std::to_string(total) + " elements)");
  if (auto const layout = layouts_.find(name); layout != layouts_.end()) {
    for (auto const& [at, tensor] : layout->second.tensors) {
      if (at == offset && split_.at(tensor).shape == view) return read_box(tensor, box, out, stream);
    }
  }
  RecordType const record_type = type(name);
  if (!out.defined() || detail::record_type(out.dtype()) != record_type || !within(box, view) || out.numel() != box.numel())
    throw Error(Errc::invalid_argument, "reading box " + to_string(box) + " of a view " + to_string(view) + " of record '" + name +
                                            "' of " + detail::type_name(record_type) + " into " +
                                            std::to_string(out.defined() ? out.numel() : 0) +
                                            " elements (expected a box within the view and a tensor of its elements and type)");
  std::size_t const element = detail::type_size(record_type);
  Tensor staging = Tensor::empty({box.numel()}, out.dtype(), mgpu::detail::host_staging_allocator());
  auto* destination = static_cast<std::byte*>(staging.data());
  std::vector<Run> runs = detail::box_runs(view, box);
  if (auto const layout = layouts_.find(name); layout != layouts_.end()) {
    for (Run const& run : runs) {
      read_range(name, offset + run.global, run.length, destination + static_cast<std::size_t>(run.local) * element);
    }
  } else {
    for (Run& run : runs) run.global += offset;
    gather(split_.at(name), runs, nullptr, destination);
  }
  copy_async(out.reshape({box.numel()}), staging, stream);
  stream.synchronize();
}

std::vector<ShardedCheckpoint::Part> ShardedCheckpoint::parts(std::string const& name) const {
  if (is_layout(name) || !split_.contains(name))
    throw Error(Errc::invalid_argument, "sharded checkpoint record '" + name + "' (expected a split record that is no layout)");
  std::vector<Part> parts;
  for (Piece const& p : split_.at(name).pieces) parts.push_back({p.box, p.shard});
  return parts;
}

bool ShardedCheckpoint::split_by_elements(std::string const& name) const {
  (void)shape(name);  // names a missing record
  return !is_layout(name) && split_.at(name).flat;
}

}  // namespace mgpu::io
