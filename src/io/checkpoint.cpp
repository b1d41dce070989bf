// Checkpoint files: writing atomically, reading with full verification, and the training helpers.
#include <mgpu/io/checkpoint.hpp>

#include <algorithm>
#include <bit>
#include <limits>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <utility>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <mgpu/core/error.hpp>
#include <mgpu/io/sharded_checkpoint.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/optim/optim.hpp>

#include "core/backend.hpp"
#include "core/atomic_file.hpp"
#include "io/record_type.hpp"

namespace mgpu::io {

using detail::record_type;
using detail::type_name;
using detail::type_size;

namespace detail {
std::size_t type_size(RecordType type) {
  switch (type) {
    case RecordType::float32:
    case RecordType::int32: return 4;
    case RecordType::bfloat16:
    case RecordType::float16: return 2;
    case RecordType::int64:
    case RecordType::uint64: return 8;
    case RecordType::bytes: return 1;
  }
  return 0;
}

std::string type_name(RecordType type) {
  switch (type) {
    case RecordType::float32: return "float32";
    case RecordType::bfloat16: return "bfloat16";
    case RecordType::float16: return "float16";
    case RecordType::int32: return "int32";
    case RecordType::int64: return "int64";
    case RecordType::uint64: return "uint64";
    case RecordType::bytes: return "bytes";
  }
  return "unknown type " + std::to_string(static_cast<int>(type));
}

RecordType record_type(DType dtype) {
  switch (dtype) {
    case DType::bfloat16: return RecordType::bfloat16;
    case DType::float16: return RecordType::float16;
    case DType::int32: return RecordType::int32;
    case DType::float32: break;
  }
  return RecordType::float32;
}
}  // namespace detail

namespace {

constexpr char magic[8] = {'M', 'G', 'P', 'U', 'C', 'K', 'P', 'T'};
constexpr char end_magic[8] = {'M', 'G', 'P', 'U', '-', 'E', 'N', 'D'};

template <class T>
void append(std::vector<std::byte>& out, T const& value) {
  auto const* p = reinterpret_cast<std::byte const*>(&value);
  out.insert(out.end(), p, p + sizeof(T));
}

// A read of `n` bytes for `what` at byte `at` of `path`, past its end (`left` bytes remain).
[[noreturn]] void fail_truncated(std::string const& path, char const* what, std::size_t at, std::size_t n, std::size_t left) {
  throw Error(Errc::corrupt_data, path + ": truncated: " + what + " at byte " + std::to_string(at) + " needs " + std::to_string(n) +
                                      " bytes, " + std::to_string(left) + " left (expected a complete checkpoint)");
}

// A value of type T from a Reader or a FileReader (below).
template <class T, class Source>
T read_value(Source& source, char const* what) {
  T value;
  std::memcpy(&value, source.take(sizeof(T), what), sizeof(T));
  return value;
}

// Bounds-checked reading of a file image; errors name the file and the byte offset.
class Reader {
 public:
  Reader(std::vector<std::byte> const& bytes, std::size_t end, std::string path) : bytes_(bytes), end_(end), path_(std::move(path)) {}
  std::byte const* take(std::size_t n, char const* what) {
    if (n > end_ - at_) fail_truncated(path_, what, at_, n, end_ - at_);
    std::byte const* p = bytes_.data() + at_;
    at_ += n;
    return p;
  }
  [[nodiscard]] std::size_t offset() const noexcept { return at_; }

 private:
  std::vector<std::byte> const& bytes_;
  std::size_t end_;
  std::size_t at_ = 0;
  std::string path_;
};

[[noreturn]] void fail_io(std::string const& what, std::filesystem::path const& path) {
  throw Error(Errc::io, what + " " + path.string() + ": " + std::strerror(errno));
}

// A record's header from `r` (a Reader, or a FileReader that reads no payload), checked: a known
// type, extents >= 0, and a byte count that is the shape's. `r` is left at the payload.
template <class Source>
RecordEntry read_entry(Source& r, std::string const& name) {
  RecordEntry e;
  auto const name_length = read_value<std::uint32_t>(r, "a record name's length");
  auto const* chars = reinterpret_cast<char const*>(r.take(name_length, "a record name"));
  e.name.assign(chars, name_length);
  std::size_t const at = r.offset();
  e.type = static_cast<RecordType>(read_value<std::uint8_t>(r, "a record type"));
  if (type_size(e.type) == 0)
    throw Error(Errc::corrupt_data, name + ": record '" + e.name + "' has " + type_name(e.type) + " at byte " + std::to_string(at));
  auto const rank = read_value<std::uint8_t>(r, "a record rank");
  for (int d = 0; d < rank; ++d) {
    e.shape.push_back(read_value<std::int64_t>(r, "a record extent"));
    if (e.shape.back() < 0) throw Error(Errc::corrupt_data, name + ": record '" + e.name + "' has a negative extent");
  }
  e.size = read_value<std::uint64_t>(r, "a record size");
  e.checksum = read_value<std::uint64_t>(r, "a record checksum");
  // The shape's byte count, checked for overflow: extents come from the file.
  std::uint64_t expected = type_size(e.type);
  for (auto extent : e.shape) {
    if (__builtin_mul_overflow(expected, static_cast<std::uint64_t>(extent), &expected))
      throw Error(Errc::corrupt_data, name + ": record '" + e.name + "' has shape " + to_string(e.shape) + " of " + type_name(e.type) +
                                          " (expected at most 2^64 bytes)");
  }
  if (e.size != expected)
    throw Error(Errc::corrupt_data, name + ": record '" + e.name + "' holds " + std::to_string(e.size) + " bytes for " + type_name(e.type) +
                                        " " + to_string(e.shape) + " (expected " + std::to_string(expected) + ")");
  e.offset = r.offset();
  return e;
}

// Reads a file's headers in place, as Reader reads bytes in memory; skip() passes a payload by.
class FileReader {
 public:
  // Reads [start, end) of the file.
  FileReader(std::ifstream& in, std::size_t start, std::size_t end, std::filesystem::path const& path)
      : in_(in), end_(end), at_(start), path_(path) {
    in_.seekg(static_cast<std::streamoff>(start));
  }
  std::byte const* take(std::size_t n, char const* what) {
    check(n, what);
    buffer_.resize(n);
    in_.read(reinterpret_cast<char*>(buffer_.data()), static_cast<std::streamsize>(n));
    if (!in_) fail_io("reading", path_);
    at_ += n;
    return buffer_.data();
  }
  void skip(std::size_t n, char const* what) {
    check(n, what);
    at_ += n;
    in_.seekg(static_cast<std::streamoff>(at_));
  }
  [[nodiscard]] std::size_t offset() const noexcept { return at_; }

 private:
  void check(std::size_t n, char const* what) const {
    if (n > end_ - at_) fail_truncated(path_.string(), what, at_, n, end_ - at_);
  }
  std::ifstream& in_;
  std::size_t end_;
  std::size_t at_;
  std::filesystem::path const& path_;
  std::vector<std::byte> buffer_;
};

}  // namespace

Record& Checkpoint::slot(std::string const& name) {
  if (name.empty() || name.size() > 4096)
    throw Error(Errc::invalid_argument, "a checkpoint record named '" + name.substr(0, 64) + "' (expected 1 to 4096 characters)");
  auto it = std::find_if(records_.begin(), records_.end(), [&](Record const& r) { return r.name == name; });
  if (it != records_.end()) return *it;
  records_.push_back(Record{name, RecordType::bytes, {}, {}});
  return records_.back();
}

void Checkpoint::put(std::string const& name, Tensor const& tensor, Stream& stream) {
  if (!tensor.defined()) throw Error(Errc::invalid_argument, "checkpoint record '" + name + "' is an undefined tensor (expected a tensor)");
  Record& r = slot(name);
  r.type = record_type(tensor.dtype());
  r.shape = tensor.shape();
  r.data.resize(tensor.nbytes());
  if (tensor.nbytes() == 0) return;  // an empty tensor (a rank's empty shard): nothing to copy
  if (tensor.device().kind == DeviceKind::host) {
    stream.synchronize();  // work already enqueued may still write the tensor
    std::memcpy(r.data.data(), tensor.data(), tensor.nbytes());
    return;
  }
  Tensor staging = Tensor::empty(tensor.shape(), tensor.dtype(), mgpu::detail::host_staging_allocator());
  copy_async(staging, tensor, stream);
  stream.synchronize();
  std::memcpy(r.data.data(), staging.data(), tensor.nbytes());
}

void Checkpoint::put_values(std::string const& name, RecordType type, void const* values, std::size_t count) {
  Record& r = slot(name);
  r.type = type;
  r.shape = {static_cast<std::int64_t>(count)};
  r.data.resize(count * type_size(type));
  if (!r.data.empty()) std::memcpy(r.data.data(), values, r.data.size());
}

void Checkpoint::put(std::string const& name, std::vector<std::int64_t> const& values) {
  put_values(name, RecordType::int64, values.data(), values.size());
}

void Checkpoint::put(std::string const& name, std::vector<std::uint64_t> const& values) {
  put_values(name, RecordType::uint64, values.data(), values.size());
}

void Checkpoint::put(std::string const& name, std::string const& text) { put_values(name, RecordType::bytes, text.data(), text.size()); }

void Checkpoint::put(Record record) {
  std::size_t expected = type_size(record.type);
  for (std::int64_t e : record.shape) expected *= static_cast<std::size_t>(std::max<std::int64_t>(e, 0));
  if (type_size(record.type) == 0 || record.data.size() != expected ||
      std::any_of(record.shape.begin(), record.shape.end(), [](std::int64_t e) { return e < 0; }))
    throw Error(Errc::invalid_argument, "record '" + record.name + "' of " + type_name(record.type) + " " +
                                            to_string(record.shape) + " holding " + std::to_string(record.data.size()) +
                                            " bytes (expected " + std::to_string(expected) + ")");
  Record& r = slot(record.name);
  r = std::move(record);
}

bool Checkpoint::contains(std::string const& name) const noexcept {
  return std::any_of(records_.begin(), records_.end(), [&](Record const& r) { return r.name == name; });
}

Record const& Checkpoint::get(std::string const& name) const {
  auto it = std::find_if(records_.begin(), records_.end(), [&](Record const& r) { return r.name == name; });
  if (it == records_.end()) throw Error(Errc::invalid_argument, "the checkpoint has no record '" + name + "'");
  return *it;
}

namespace {
template <class T>
std::vector<T> values_of(Record const& r, RecordType expected) {
  if (r.type != expected)
    throw Error(Errc::invalid_argument, "checkpoint record '" + r.name + "' is " + type_name(r.type) + " (expected " + type_name(expected) + ")");
  std::vector<T> out(r.data.size() / sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), r.data.data(), out.size() * sizeof(T));  // an empty vector's data() may be null
  return out;
}
}  // namespace

std::vector<std::int64_t> Checkpoint::get_int64(std::string const& name) const { return values_of<std::int64_t>(get(name), RecordType::int64); }
std::vector<std::uint64_t> Checkpoint::get_uint64(std::string const& name) const {
  return values_of<std::uint64_t>(get(name), RecordType::uint64);
}
std::string Checkpoint::get_text(std::string const& name) const {
  auto const bytes = values_of<char>(get(name), RecordType::bytes);
  return {bytes.begin(), bytes.end()};
}

void Checkpoint::check_fits(std::string const& name, Tensor const& tensor) const {
  Record const& r = get(name);
  if (r.type != record_type(tensor.dtype()) || r.shape != tensor.shape())
    throw Error(Errc::invalid_argument, "checkpoint record '" + name + "' is " + type_name(r.type) + " " + to_string(r.shape) +
                                            " (expected " + std::string(to_string(tensor.dtype())) + " " + to_string(tensor.shape()) + ")");
}

void Checkpoint::copy_to(std::string const& name, Tensor const& tensor, Stream& stream) const {
  check_fits(name, tensor);
  Record const& r = get(name);
  if (r.data.empty()) return;  // an empty tensor: nothing to copy
  Tensor staging = Tensor::empty(tensor.shape(), tensor.dtype(), mgpu::detail::host_staging_allocator());
  std::memcpy(staging.data(), r.data.data(), r.data.size());
  copy_async(tensor, staging, stream);
  stream.synchronize();
}

void Checkpoint::save(std::filesystem::path const& path) const {
  std::size_t bytes = 8 + 4 + 4 + 8 + 8;
  for (Record const& r : records_) bytes += 4 + r.name.size() + 2 + 8 * r.shape.size() + 16 + r.data.size();
  std::vector<std::byte> out(reinterpret_cast<std::byte const*>(magic), reinterpret_cast<std::byte const*>(magic) + 8);
  out.reserve(bytes);  // one allocation for the whole image
  append(out, checkpoint_version);
  append(out, static_cast<std::uint32_t>(records_.size()));
  for (Record const& r : records_) {
    append(out, static_cast<std::uint32_t>(r.name.size()));
    out.insert(out.end(), reinterpret_cast<std::byte const*>(r.name.data()), reinterpret_cast<std::byte const*>(r.name.data()) + r.name.size());
    append(out, static_cast<std::uint8_t>(r.type));
    append(out, static_cast<std::uint8_t>(r.shape.size()));
    for (std::int64_t e : r.shape) append(out, e);
    append(out, static_cast<std::uint64_t>(r.data.size()));
    append(out, static_cast<std::uint64_t>(XXH64(r.data.data(), r.data.size(), 0)));
    out.insert(out.end(), r.data.begin(), r.data.end());
  }
  append(out, static_cast<std::uint64_t>(XXH64(out.data(), out.size(), 0)));
  out.insert(out.end(), reinterpret_cast<std::byte const*>(end_magic), reinterpret_cast<std::byte const*>(end_magic) + 8);

  mgpu::detail::write_file_atomically(path, out);
}

Checkpoint Checkpoint::load(std::filesystem::path const& path) {
  if (std::filesystem::is_directory(path))
    throw Error(Errc::invalid_argument,
                path.string() + ": a folder (expected a checkpoint file; a folder of shards is read by ShardedCheckpoint::load)");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail_io("opening", path);
  std::vector<std::byte> bytes;
  {
    std::vector<char> chars((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (in.bad()) fail_io("reading", path);
    bytes.resize(chars.size());
    if (!chars.empty()) std::memcpy(bytes.data(), chars.data(), chars.size());  // an empty vector's data() may be null
  }
  std::string const name = path.string();
  if (bytes.size() < 8 || std::memcmp(bytes.data(), magic, 8) != 0)
    throw Error(Errc::corrupt_data, name + ": not an mgpu checkpoint (expected the bytes \"MGPUCKPT\" at the start)");
  Reader header(bytes, bytes.size(), name);
  header.take(8, "magic");
  auto const version = read_value<std::uint32_t>(header, "the version");
  if (version != checkpoint_version)
    throw Error(Errc::corrupt_data, name + ": unknown checkpoint version " + std::to_string(version) + " (expected " +
                                        std::to_string(checkpoint_version) + ")");
  if (bytes.size() < 16 + 16 || std::memcmp(bytes.data() + bytes.size() - 8, end_magic, 8) != 0)
    throw Error(Errc::corrupt_data, name + ": truncated: " + std::to_string(bytes.size()) +
                                        " bytes without the end marker (expected a complete checkpoint ending in \"MGPU-END\")");
  std::size_t const body = bytes.size() - 16;
  std::uint64_t stored_sum = 0;
  std::memcpy(&stored_sum, bytes.data() + body, 8);
  if (XXH64(bytes.data(), body, 0) != stored_sum) {
    // Named by the damaged record when the damage lies in one (its own checksum fails too).
    std::string damaged;
    try {
      Reader scan(bytes, body, name);
      scan.take(12, "the header");
      auto const count = read_value<std::uint32_t>(scan, "the record count");
      for (std::uint32_t i = 0; i < count && damaged.empty(); ++i) {
        RecordEntry const entry = read_entry(scan, name);
        auto const* payload = scan.take(entry.size, "a record's data");
        if (XXH64(payload, entry.size, 0) != entry.checksum) damaged = entry.name;
      }
    } catch (Error const&) {  // the index itself is damaged: the whole file's checksum says so
    }
    throw Error(Errc::corrupt_data, name + ": checksum mismatch " +
                                        (damaged.empty() ? "over the file's " + std::to_string(body) + " bytes"
                                                         : "in record '" + damaged + "'") +
                                        " (the file is corrupted)");
  }

  Reader r(bytes, body, name);
  r.take(12, "the header");
  auto const records = read_value<std::uint32_t>(r, "the record count");
  Checkpoint checkpoint;
  for (std::uint32_t i = 0; i < records; ++i) {
    RecordEntry entry = read_entry(r, name);
    auto const* payload = r.take(entry.size, "a record's data");
    if (XXH64(payload, entry.size, 0) != entry.checksum)
      throw Error(Errc::corrupt_data, name + ": checksum mismatch in record '" + entry.name + "'");
    checkpoint.records_.push_back(
        {.name = std::move(entry.name), .type = entry.type, .shape = std::move(entry.shape), .data = {payload, payload + entry.size}});
  }
  if (r.offset() != body)
    throw Error(Errc::corrupt_data, name + ": " + std::to_string(body - r.offset()) + " unexpected bytes after the last record");
  return checkpoint;
}

std::vector<RecordEntry> Checkpoint::index(std::filesystem::path const& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) fail_io("opening", path);
  auto const size = static_cast<std::size_t>(in.tellg());
  std::string const name = path.string();
  char start[8] = {}, end[8] = {};
  in.seekg(0);
  in.read(start, 8);
  if (size < 8 || !in || std::memcmp(start, magic, 8) != 0)
    throw Error(Errc::corrupt_data, name + ": not an mgpu checkpoint (expected the bytes \"MGPUCKPT\" at the start)");
  if (size >= 16 + 16) {
    in.seekg(static_cast<std::streamoff>(size - 8));
    in.read(end, 8);
  }
  if (size < 16 + 16 || !in || std::memcmp(end, end_magic, 8) != 0)
    throw Error(Errc::corrupt_data, name + ": truncated: " + std::to_string(size) +
                                        " bytes without the end marker (expected a complete checkpoint ending in \"MGPU-END\")");
  FileReader r(in, 8, size - 16, path);
  auto const version = read_value<std::uint32_t>(r, "the version");
  if (version != checkpoint_version)
    throw Error(Errc::corrupt_data, name + ": unknown checkpoint version " + std::to_string(version) + " (expected " +
                                        std::to_string(checkpoint_version) + ")");
  auto const records = read_value<std::uint32_t>(r, "the record count");
  std::vector<RecordEntry> entries;
  for (std::uint32_t i = 0; i < records; ++i) {
    entries.push_back(read_entry(r, name));
    r.skip(entries.back().size, "a record's data");
  }
  if (r.offset() != size - 16)
    throw Error(Errc::corrupt_data, name + ": " + std::to_string(size - 16 - r.offset()) + " unexpected bytes after the last record");
  return entries;
}

Record Checkpoint::read_record(std::filesystem::path const& path, RecordEntry const& entry) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail_io("opening", path);
  Record record{.name = entry.name, .type = entry.type, .shape = entry.shape, .data = std::vector<std::byte>(entry.size)};
  in.seekg(static_cast<std::streamoff>(entry.offset));
  in.read(reinterpret_cast<char*>(record.data.data()), static_cast<std::streamsize>(entry.size));
  if (!in) fail_io("reading record '" + entry.name + "' of", path);
  if (XXH64(record.data.data(), record.data.size(), 0) != entry.checksum)
    throw Error(Errc::corrupt_data, path.string() + ": checksum mismatch in record '" + entry.name + "'");
  return record;
}

namespace {
std::string architecture(nn::Sequential const& model) {
  std::string out;
  for (std::size_t i = 0; i < model.size(); ++i) {
    if (i > 0) out += " | ";
    out += model.layer(i).name();
  }
  return out;
}
}  // namespace

Checkpoint training_checkpoint(nn::Sequential const& model, optim::Optimizer const& optimizer, TrainingState const& state, Stream& stream) {
  if (!model.master_parameters().defined()) throw Error(Errc::invalid_argument, "save_training before materialize (expected a materialized model)");
  Checkpoint c;
  c.put("model.architecture", architecture(model));
  c.put("model.parameters", model.master_parameters(), stream);
  c.put("model.rng", model.rng_state());
  c.put("model.rng_seeds", model.rng_seeds());
  c.put("optimizer.name", optimizer.name());
  c.put("optimizer.steps", std::vector<std::int64_t>{optimizer.steps()});
  for (auto const& [name, tensor] : optimizer.state()) c.put("optimizer." + name, tensor, stream);
  c.put("training", std::vector<std::int64_t>{state.step, state.epoch, state.batch});
  c.put("training.data_seed", std::vector<std::uint64_t>{state.data_seed});
  return c;
}

Checkpoint training_metadata(nn::Sequential const& model, optim::Optimizer const& optimizer, TrainingState const& state) {
  Checkpoint c;
  c.put("model.architecture", architecture(model));
  c.put("model.rng", model.rng_state());
  c.put("model.rng_seeds", model.rng_seeds());
  c.put("optimizer.name", optimizer.name());
  c.put("optimizer.steps", std::vector<std::int64_t>{optimizer.steps()});
  c.put("training", std::vector<std::int64_t>{state.step, state.epoch, state.batch});
  c.put("training.data_seed", std::vector<std::uint64_t>{state.data_seed});
  return c;
}

void save_training(std::filesystem::path const& path, nn::Sequential const& model, optim::Optimizer const& optimizer,
                   TrainingState const& state, Stream& stream) {
  Checkpoint const records = training_checkpoint(model, optimizer, state, stream);
  if (!std::filesystem::is_directory(path)) {
    records.save(path);
    return;
  }
  ShardWriter writer;  // a folder of shards (another layout's save): a one-shard save replacing it
  for (Record const& record : records.records()) writer.put(record);
  std::uint64_t const save_id = committed_save_id(path) + 1;
  writer.save(path, save_id, 0, 1);
  commit_shards(path, save_id, 1);
}

TrainingState load_training(std::filesystem::path const& path, nn::Sequential& model, optim::Optimizer& optimizer, Allocator& allocator,
                            Stream& stream) {
  if (!model.master_parameters().defined()) throw Error(Errc::invalid_argument, "load_training before materialize (expected a materialized model)");
  if (std::filesystem::is_directory(path))  // a folder of shards of any layout, its pieces and boxes joined
    return load_training(ShardedCheckpoint::load(path).joined(), path.string(), model, optimizer, allocator, stream);
  return load_training(Checkpoint::load(path), path.string(), model, optimizer, allocator, stream);
}

TrainingState load_training(Checkpoint const& c, std::string const& source, nn::Sequential& model, optim::Optimizer& optimizer,
                            Allocator& allocator, Stream& stream) {
  if (!model.master_parameters().defined()) throw Error(Errc::invalid_argument, "load_training before materialize (expected a materialized model)");
  // Verify everything before touching the model or the optimizer.
  TrainingRecords const records = read_training_records(c, source, model, optimizer);
  c.check_fits("model.parameters", model.master_parameters());
  bool has_state = false;
  for (Record const& r : c.records()) {
    if (!r.name.starts_with("optimizer.") || r.type != RecordType::float32) continue;
    has_state = true;
    c.check_fits(r.name, model.master_parameters());  // optimizer state is per parameter
  }
  // Only now is anything changed: state buffers are allocated (zeroed) if missing, then filled.
  if (has_state) {
    auto const state = optimizer.prepare_state(model.master_parameters(), allocator, stream);
    for (auto const& [name, tensor] : state) c.check_fits("optimizer." + name, tensor);
    for (auto const& [name, tensor] : state) c.copy_to("optimizer." + name, tensor, stream);
  } else {
    for (auto const& [name, tensor] : optimizer.state()) fill_async(tensor, 0.0f, stream);
  }
  c.copy_to("model.parameters", model.master_parameters(), stream);
  model.sync_parameters(stream);
  model.set_rng_state(records.rng);
  if (!records.rng_seeds.empty()) model.set_rng_seeds(records.rng_seeds);
  optimizer.set_steps(records.optimizer_steps);
  stream.synchronize();
  return records.state;
}

std::string to_string(RecordType type) { return detail::type_name(type); }

void put_loss_scaler(Checkpoint& checkpoint, optim::LossScaler::State const& state) {
  checkpoint.put("training.loss_scaler", std::vector<std::int64_t>{std::bit_cast<std::int32_t>(state.scale), state.good_steps, state.skipped});
}

std::optional<optim::LossScaler::State> read_loss_scaler(Checkpoint const& checkpoint, std::string const& source,
                                                         optim::LossScaler const& scaler) {
  for (char const* name : {"training.loss_scaler", "data_parallel.loss_scaler", "pipeline.loss_scaler"}) {
    if (!checkpoint.contains(name)) continue;
    auto const values = checkpoint.get_int64(name);
    if (values.size() != 3 || values[0] < std::numeric_limits<std::int32_t>::min() || values[0] > std::numeric_limits<std::int32_t>::max())
      throw Error(Errc::corrupt_data, source + ": malformed " + name + " record (expected the scale's bits, good steps and skipped steps)");
    optim::LossScaler::State const state{std::bit_cast<float>(static_cast<std::int32_t>(values[0])), values[1], values[2]};
    optim::LossScaler probe = scaler;
    try {
      probe.set_state(state);
    } catch (Error const& e) {
      throw Error(Errc::corrupt_data, source + ": " + std::string(e.message()));
    }
    return state;
  }
  return std::nullopt;
}

TrainingRecords read_training_records(Checkpoint const& c, std::string const& source, nn::Sequential const& model,
                                      optim::Optimizer const& optimizer) {
  std::string const file = source + ": ";
  std::string const arch = c.get_text("model.architecture");
  if (arch != architecture(model))
    throw Error(Errc::invalid_argument, file + "the model differs: the checkpoint holds '" + arch + "' (expected '" + architecture(model) + "')");
  auto rng = c.get_uint64("model.rng");
  if (rng.size() != model.size()) throw Error(Errc::corrupt_data, file + "model.rng has " + std::to_string(rng.size()) + " entries");
  // The dropout seeds (absent from files written before they were saved: the model keeps its own).
  std::vector<std::uint64_t> seeds;
  if (c.contains("model.rng_seeds")) {
    seeds = c.get_uint64("model.rng_seeds");
    std::size_t const expected = model.rng_seeds().size();
    if (seeds.size() != expected)
      throw Error(Errc::corrupt_data, file + "model.rng_seeds has " + std::to_string(seeds.size()) + " entries (expected " +
                                          std::to_string(expected) + ", the model's layers' seeds)");
  }
  std::string const kind = c.get_text("optimizer.name");
  if (kind != optimizer.name())
    throw Error(Errc::invalid_argument, file + "the optimizer differs: the checkpoint holds " + kind + " state (expected " + optimizer.name() + ")");
  auto const steps = c.get_int64("optimizer.steps");
  auto const training = c.get_int64("training");
  auto const seed = c.get_uint64("training.data_seed");
  if (steps.size() != 1 || training.size() != 3 || seed.size() != 1)
    throw Error(Errc::corrupt_data, file + "malformed optimizer.steps, training or training.data_seed record");
  return {std::move(rng), steps[0], {training[0], training[1], training[2], seed[0]}, std::move(seeds)};
}

}  // namespace mgpu::io
