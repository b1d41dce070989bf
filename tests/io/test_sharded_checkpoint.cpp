// Sharded checkpoints: pieces written by several writers read back whole or in any ranges (another
// writer count) or joined into one Checkpoint, whole records, commits that replace a save only once
// complete, and every kind of incomplete or damaged save rejected naming the file or record.
#include <mgpu/core/device_group.hpp>
#include <mgpu/io/sharded_checkpoint.hpp>

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "support/catch.hpp"
#include "support/expect_error.hpp"

using mgpu::DType;
using mgpu::Errc;
using mgpu::Tensor;
namespace fs = std::filesystem;
namespace io = mgpu::io;

namespace {

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("mgpu-sharded-" + std::to_string(::getpid()) + "-" + std::to_string(counter()++));
  ~TempDir() { fs::remove_all(path); }
  static int& counter() {
    static int n = 0;
    return n;
  }
};

struct Host {
  mgpu::DeviceGroup group{"host:1"};
  mgpu::Stream& stream = group.stream(0);

  Tensor floats(std::vector<float> const& values) {
    Tensor t = Tensor::empty({static_cast<std::int64_t>(values.size())}, DType::float32, group.allocator(0));
    for (std::size_t i = 0; i < values.size(); ++i) t.host_span<float>()[i] = values[i];
    return t;
  }
  std::vector<float> read(io::ShardedCheckpoint const& c, std::string const& name, std::int64_t begin, std::int64_t count) {
    Tensor out = Tensor::empty({count}, DType::float32, group.allocator(0));
    c.read(name, begin, out, stream);
    auto const span = out.host_span<float>();
    return {span.begin(), span.end()};
  }
};

std::vector<float> iota(std::int64_t n, float start) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = start + static_cast<float>(i);
  return v;
}

std::vector<float> slice(std::vector<float> const& v, std::int64_t begin, std::int64_t end) {
  return {v.begin() + begin, v.begin() + end};
}

// Writes `whole` (shape {rows, 5}) split at `cuts` over cuts.size() - 1 writers, plus the step as a
// whole record on every writer and a text on writer 0; commits save `id`.
void write_save(Host& h, fs::path const& folder, std::uint64_t id, std::vector<float> const& whole,
                std::vector<std::int64_t> const& cuts) {
  int const writers = static_cast<int>(cuts.size()) - 1;
  mgpu::Shape const shape{static_cast<std::int64_t>(whole.size()) / 5, 5};
  for (int w = 0; w < writers; ++w) {
    io::ShardWriter shard;
    auto const b = cuts[static_cast<std::size_t>(w)];
    auto const e = cuts[static_cast<std::size_t>(w) + 1];
    shard.put_piece("model.weight", shape, b, h.floats(slice(whole, b, e)), h.stream);
    shard.put("step", std::vector<std::int64_t>{static_cast<std::int64_t>(id)});
    if (w == 0) shard.put("note", std::string("save ") + std::to_string(id));
    shard.save(folder, id, w, writers);
  }
  io::commit_shards(folder, id, writers);
}

}  // namespace

TEST_CASE("Sharded checkpoint: pieces of three writers read back whole and in ranges across pieces", "[io][sharded]") {
  Host h;
  TempDir dir;
  auto const whole = iota(35, 1.0f);
  write_save(h, dir.path, 7, whole, {0, 12, 12, 35});  // the second writer holds nothing
  auto const c = io::ShardedCheckpoint::load(dir.path);
  CHECK(c.save_id() == 7);
  CHECK(c.shards() == 3);
  CHECK(c.has_pieces("model.weight"));
  CHECK(c.shape("model.weight") == mgpu::Shape{7, 5});
  CHECK(h.read(c, "model.weight", 0, 35) == whole);
  // Two readers splitting it their own way, and a range inside one piece.
  CHECK(h.read(c, "model.weight", 0, 20) == slice(whole, 0, 20));
  CHECK(h.read(c, "model.weight", 20, 15) == slice(whole, 20, 35));
  CHECK(h.read(c, "model.weight", 3, 4) == slice(whole, 3, 7));
  CHECK(c.whole().get_int64("step") == std::vector<std::int64_t>{7});
  CHECK(c.whole().get_text("note") == "save 7");
  CHECK(c.split_names() == std::vector<std::string>{"model.weight"});

  Tensor wrong = Tensor::empty({4}, DType::int32, h.group.allocator(0));
  REQUIRE_MGPU_ERROR(c.read("model.weight", 0, wrong, h.stream), Errc::invalid_argument,
                     "reading record 'model.weight' of float32 into int32 (expected a tensor of the record's type)");
  Tensor four = Tensor::empty({4}, DType::float32, h.group.allocator(0));
  REQUIRE_MGPU_ERROR(c.read("model.weight", 33, four, h.stream), Errc::invalid_argument,
                     "reading elements [33, 37) of record 'model.weight' (expected a range within its 35 elements, shape [7, 5])");
  REQUIRE_MGPU_ERROR(c.read("missing", 0, four, h.stream), Errc::invalid_argument,
                     "sharded checkpoint record 'missing' is missing");
}

TEST_CASE("Sharded checkpoint: a reader reads the pieces holding its ranges and no others", "[io][sharded]") {
  Host h;
  TempDir dir;
  auto const whole = iota(40, 1.0f);
  write_save(h, dir.path, 2, whole, {0, 10, 20, 30, 40});  // four writers of 10 elements each
  auto const c = io::ShardedCheckpoint::load(dir.path);
  // load() reads the whole records (the step from one shard: every shard holds the same) and the
  // shapes, no piece.
  std::uint64_t const at_load = c.payload_bytes_read();
  CHECK(at_load == sizeof(std::int64_t) + std::string("save 2").size() + 4 * 2 * sizeof(std::int64_t));
  // A reader of the third writer's range reads that piece only; one across two pieces reads both.
  CHECK(h.read(c, "model.weight", 20, 10) == slice(whole, 20, 30));
  CHECK(c.payload_bytes_read() - at_load == 10 * sizeof(float));
  CHECK(h.read(c, "model.weight", 5, 10) == slice(whole, 5, 15));
  CHECK(c.payload_bytes_read() - at_load == 30 * sizeof(float));
}

TEST_CASE("Sharded checkpoint: joined() holds every record whole, as one Checkpoint file of them", "[io][sharded]") {
  Host h;
  TempDir dir;
  auto const whole = iota(35, -3.0f);
  write_save(h, dir.path, 2, whole, {0, 12, 12, 30, 35});  // the second writer holds nothing
  io::Checkpoint const joined = io::ShardedCheckpoint::load(dir.path).joined();
  io::Checkpoint want;  // what one writer puts in one file
  want.put("model.weight", h.floats(whole).reshape({7, 5}), h.stream);
  want.put("step", std::vector<std::int64_t>{2});
  want.put("note", std::string("save 2"));
  REQUIRE(joined.records().size() == want.records().size());
  for (io::Record const& w : want.records()) {
    io::Record const& got = joined.get(w.name);
    CHECK((got.type == w.type && got.shape == w.shape && got.data == w.data));
  }
  // A split record left out, for a reader that takes it in ranges.
  io::Checkpoint const rest = io::ShardedCheckpoint::load(dir.path).joined({"model.weight"});
  CHECK(!rest.contains("model.weight"));
  CHECK(rest.records().size() == 2);
  CHECK(rest.get_text("note") == "save 2");
}

TEST_CASE("Sharded checkpoint: records of a Checkpoint put whole as they are", "[io][sharded]") {
  Host h;
  TempDir dir;
  io::Checkpoint records;
  records.put("model.parameters", h.floats({1.5f, -2.0f, 3.25f}).reshape({3, 1}), h.stream);
  records.put("training", std::vector<std::int64_t>{4, 1, 2});
  records.put("model.rng", std::vector<std::uint64_t>{7, 9});
  records.put("optimizer.name", std::string("adamw"));
  io::ShardWriter shard;
  for (io::Record const& r : records.records()) shard.put(r);
  shard.save(dir.path, 1, 0, 1);
  io::commit_shards(dir.path, 1, 1);
  auto const c = io::ShardedCheckpoint::load(dir.path);
  CHECK(c.split_names().empty());
  REQUIRE(c.whole().records().size() == records.records().size());
  for (io::Record const& want : records.records()) {
    io::Record const& got = c.whole().get(want.name);
    CHECK((got.type == want.type && got.shape == want.shape && got.data == want.data));
  }
  // A manifest that is not one is refused by committed_save_id too.
  records.save(dir.path / "manifest.ckpt");
  REQUIRE_MGPU_ERROR(io::committed_save_id(dir.path), Errc::corrupt_data,
                     "manifest.ckpt: not a sharded checkpoint's manifest");
}

TEST_CASE("Sharded checkpoint: a new save replaces the old one only once committed", "[io][sharded]") {
  Host h;
  TempDir dir;
  auto const first = iota(20, 0.0f);
  auto const second = iota(20, 100.0f);
  CHECK(io::committed_save_id(dir.path) == 0);  // nothing committed: the next save is 1
  write_save(h, dir.path, 1, first, {0, 10, 20});
  CHECK(io::committed_save_id(dir.path) == 1);

  // A job that dies after writing some shards of save 2 and before committing: save 1 is intact.
  io::ShardWriter partial;
  partial.put_piece("model.weight", {4, 5}, 0, h.floats(slice(second, 0, 7)), h.stream);
  partial.save(dir.path, 2, 0, 3);
  REQUIRE_MGPU_ERROR(io::commit_shards(dir.path, 2, 3), Errc::io, "shard-2-1-of-3.ckpt is missing");
  CHECK(h.read(io::ShardedCheckpoint::load(dir.path), "model.weight", 0, 20) == first);
  CHECK(io::committed_save_id(dir.path) == 1);

  // Save 2 on another writer count, committed: it is read, and save 1's files are gone.
  write_save(h, dir.path, 2, second, {0, 7, 13, 20});
  auto const c = io::ShardedCheckpoint::load(dir.path);
  CHECK(c.save_id() == 2);
  CHECK(io::committed_save_id(dir.path) == 2);
  CHECK(h.read(c, "model.weight", 0, 20) == second);
  CHECK(!fs::exists(io::shard_path(dir.path, 1, 0, 2)));
  CHECK(fs::exists(io::shard_path(dir.path, 2, 0, 3)));
}

TEST_CASE("Sharded checkpoint: incomplete or damaged saves are rejected naming the file or record", "[io][sharded]") {
  Host h;
  auto const whole = iota(15, 1.0f);

  SECTION("nothing committed") {
    TempDir dir;
    io::ShardWriter shard;
    shard.put_piece("w", {15}, 0, h.floats(whole), h.stream);
    shard.save(dir.path, 1, 0, 1);
    REQUIRE_MGPU_ERROR(io::ShardedCheckpoint::load(dir.path), Errc::io,
                       "manifest.ckpt is missing (expected a committed save: commit_shards writes it last)");
  }
  SECTION("a shard file removed after the commit") {
    TempDir dir;
    write_save(h, dir.path, 3, iota(10, 0.0f), {0, 5, 10});
    fs::remove(io::shard_path(dir.path, 3, 1, 2));
    REQUIRE_MGPU_ERROR(io::ShardedCheckpoint::load(dir.path), Errc::io,
                       "shard-3-1-of-2.ckpt is missing (the manifest names save 3 of 2 shards)");
  }
  SECTION("a damaged byte in a shard's record header") {
    TempDir dir;
    write_save(h, dir.path, 3, iota(10, 0.0f), {0, 5, 10});
    fs::path const file = io::shard_path(dir.path, 3, 1, 2);
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(50);  // the first record's size: header 16, name 4 + 20, type, rank, one extent
    f.put('\x55');
    f.close();
    REQUIRE_MGPU_ERROR(io::ShardedCheckpoint::load(dir.path), Errc::corrupt_data,
                       "shard-3-1-of-2.ckpt: record 'piece:5:model.weight' holds");
  }
  SECTION("a damaged byte in a piece: found when a reader reads it, naming the file and record") {
    TempDir dir;
    auto const values = iota(10, 0.0f);
    write_save(h, dir.path, 3, values, {0, 5, 10});
    fs::path const file = io::shard_path(dir.path, 3, 1, 2);
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(70);  // within the first record's payload (bytes 66 to 85)
    f.put('\x55');
    f.close();
    auto const c = io::ShardedCheckpoint::load(dir.path);
    CHECK(h.read(c, "model.weight", 0, 5) == slice(values, 0, 5));  // the other shard's piece
    Tensor out = Tensor::empty({3}, DType::float32, h.group.allocator(0));
    REQUIRE_MGPU_ERROR(c.read("model.weight", 4, out, h.stream), Errc::corrupt_data,
                       "shard-3-1-of-2.ckpt: checksum mismatch in record 'piece:5:model.weight'");
    REQUIRE_MGPU_ERROR((void)c.joined(), Errc::corrupt_data, "checksum mismatch in record 'piece:5:model.weight'");
  }
  SECTION("pieces that leave a gap, or overlap") {
    TempDir dir;
    io::ShardWriter a;
    a.put_piece("w", {15}, 0, h.floats(slice(whole, 0, 5)), h.stream);
    a.save(dir.path, 4, 0, 2);
    io::ShardWriter b;
    b.put_piece("w", {15}, 8, h.floats(slice(whole, 8, 15)), h.stream);
    b.save(dir.path, 4, 1, 2);
    io::commit_shards(dir.path, 4, 2);
    REQUIRE_MGPU_ERROR(io::ShardedCheckpoint::load(dir.path), Errc::corrupt_data,
                       "record 'w' in " + dir.path.string() +
                           ": elements [5, 8) are in no shard (expected the pieces to cover its 15 elements once)");
    io::ShardWriter c;
    c.put_piece("w", {15}, 3, h.floats(slice(whole, 3, 15)), h.stream);
    c.save(dir.path, 4, 1, 2);
    REQUIRE_MGPU_ERROR(io::ShardedCheckpoint::load(dir.path), Errc::corrupt_data,
                       "elements from 3 are in two pieces");
  }
  SECTION("shards that disagree on a shape or a whole record") {
    TempDir dir;
    io::ShardWriter a;
    a.put_piece("w", {15}, 0, h.floats(slice(whole, 0, 5)), h.stream);
    a.put("step", std::vector<std::int64_t>{1});
    a.save(dir.path, 5, 0, 2);
    io::ShardWriter b;
    b.put_piece("w", {3, 5}, 5, h.floats(slice(whole, 5, 15)), h.stream);
    b.put("step", std::vector<std::int64_t>{1});
    b.save(dir.path, 5, 1, 2);
    io::commit_shards(dir.path, 5, 2);
    REQUIRE_MGPU_ERROR(io::ShardedCheckpoint::load(dir.path), Errc::corrupt_data,
                       "record 'w' has shape [3, 5], another shard says [15] (expected the same shape in every shard)");
    io::ShardWriter c;
    c.put_piece("w", {15}, 5, h.floats(slice(whole, 5, 15)), h.stream);
    c.put("step", std::vector<std::int64_t>{2});
    c.save(dir.path, 5, 1, 2);
    REQUIRE_MGPU_ERROR(io::ShardedCheckpoint::load(dir.path), Errc::corrupt_data,
                       "record 'step' differs from the one in");
  }
  SECTION("a shape past 64 bits of elements") {
    TempDir dir;
    io::Checkpoint shard;  // what a damaged or forged shard could hold
    shard.put("piece:0:w", h.floats(slice(whole, 0, 15)), h.stream);
    shard.put("shape:w", std::vector<std::int64_t>{std::int64_t{1} << 40, std::int64_t{1} << 40});
    fs::create_directories(dir.path);
    shard.save(io::shard_path(dir.path, 6, 0, 1));
    io::commit_shards(dir.path, 6, 1);
    REQUIRE_MGPU_ERROR(io::ShardedCheckpoint::load(dir.path), Errc::corrupt_data,
                       "has shape [1099511627776, 1099511627776] (expected extents >= 0 whose product fits in 64 bits)");
  }
  SECTION("bad pieces and shard numbers are refused when written") {
    io::ShardWriter a;
    REQUIRE_MGPU_ERROR(a.put_piece("w", {15}, 10, h.floats(slice(whole, 0, 6)), h.stream), Errc::invalid_argument,
                       "piece of 'w' at element 10 with 6 elements (expected a defined tensor within the record's 15 "
                       "elements, shape [15])");
    REQUIRE_MGPU_ERROR(a.put_piece("w", {-1, 15}, 0, h.floats(slice(whole, 0, 6)), h.stream), Errc::invalid_argument,
                       "piece of 'w' of a record of shape [-1, 15] (expected extents >= 0 whose product fits in 64 bits)");
    a.put_piece("w", {15}, 0, h.floats(slice(whole, 0, 6)), h.stream);
    REQUIRE_MGPU_ERROR(a.put_piece("w", {15}, 0, h.floats(slice(whole, 0, 6)), h.stream), Errc::invalid_argument,
                       "a second piece of 'w' at element 0 (expected each piece once)");
    REQUIRE_MGPU_ERROR(a.save(fs::temp_directory_path(), 1, 2, 2), Errc::invalid_argument,
                       "shard 2 of 2 (expected 0 <= shard < shards)");
  }
}
