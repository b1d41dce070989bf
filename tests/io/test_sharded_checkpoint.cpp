// Sharded checkpoints: pieces written by several writers read back whole or in any ranges (another
// writer count) or joined into one Checkpoint, whole records, commits that replace a save only once
// complete, and every kind of incomplete or damaged save rejected naming the file or record.
#include <mgpu/core/device_group.hpp>
#include <mgpu/io/sharded_checkpoint.hpp>

#include <unistd.h>

#include <cstdint>
#include <cstring>
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

namespace {

// The elements of `box` of a row-major tensor of `shape` whose element i is values[i], serially.
std::vector<float> box_of(std::vector<float> const& values, mgpu::Shape const& shape, io::Box const& box) {
  std::vector<float> out;
  std::size_t const rank = shape.size();
  std::vector<std::int64_t> index(rank, 0);
  for (std::int64_t n = 0; n < box.numel(); ++n) {
    std::int64_t flat = 0;
    for (std::size_t d = 0; d < rank; ++d) flat = flat * shape[d] + box.offsets[d] + index[d];
    out.push_back(values[static_cast<std::size_t>(flat)]);
    for (std::size_t d = rank; d-- > 0;) {
      if (++index[d] < box.lengths[d]) break;
      index[d] = 0;
    }
  }
  return out;
}

std::vector<float> read_box(Host& h, io::ShardedCheckpoint const& c, std::string const& name, io::Box const& box) {
  Tensor out = Tensor::empty({box.numel()}, DType::float32, h.group.allocator(0));
  c.read_box(name, box, out, h.stream);
  auto const span = out.host_span<float>();
  return {span.begin(), span.end()};
}

// Writes tensor "w" of `shape` (element i: i + 1) as `boxes`, box i by writer i, committed as save 1.
void write_boxes(Host& h, fs::path const& folder, mgpu::Shape const& shape, std::vector<io::Box> const& boxes) {
  auto const whole = iota(io::Box{{}, shape}.numel(), 1.0f);
  int const writers = static_cast<int>(boxes.size());
  for (int w = 0; w < writers; ++w) {
    io::ShardWriter shard;
    io::Box const& box = boxes[static_cast<std::size_t>(w)];
    shard.put_box("w", shape, box, h.floats(box_of(whole, shape, box)), h.stream);
    shard.save(folder, 1, w, writers);
  }
  io::commit_shards(folder, 1, writers);
}

}  // namespace

TEST_CASE("Sharded checkpoint: N-D boxes of four writers read back in any box or element range", "[io][sharded][box]") {
  Host h;
  TempDir dir;
  mgpu::Shape const shape{6, 8};
  auto const whole = iota(48, 1.0f);
  // A 2 x 2 grid of uneven boxes, as tensor-parallel column shards of row blocks hold them.
  std::vector<io::Box> const grid{{{0, 0}, {2, 3}}, {{0, 3}, {2, 5}}, {{2, 0}, {4, 3}}, {{2, 3}, {4, 5}}};
  write_boxes(h, dir.path, shape, grid);
  auto const c = io::ShardedCheckpoint::load(dir.path);
  CHECK(c.version() == io::sharded_checkpoint_version);
  CHECK(c.shape("w") == shape);
  CHECK(!c.split_by_elements("w"));
  REQUIRE(c.parts("w").size() == 4);
  CHECK(c.parts("w")[1].box == grid[1]);
  CHECK(c.parts("w")[1].shard == 1);
  CHECK(read_box(h, c, "w", io::whole_box(shape)) == whole);
  std::uint64_t const before = c.payload_bytes_read();
  // A box inside one writer's box reads that box only; one across all four reads all four.
  CHECK(read_box(h, c, "w", {{3, 4}, {2, 3}}) == box_of(whole, shape, {{3, 4}, {2, 3}}));
  CHECK(c.payload_bytes_read() - before == 20 * sizeof(float));
  for (io::Box const& box : {io::Box{{1, 2}, {4, 5}}, io::Box{{0, 7}, {6, 1}}, io::Box{{5, 0}, {1, 8}}, io::Box{{2, 2}, {0, 3}}})
    CHECK(read_box(h, c, "w", box) == box_of(whole, shape, box));
  // Element ranges of the flattened tensor (a reader split the old way), and joined() whole.
  CHECK(h.read(c, "w", 5, 20) == slice(whole, 5, 25));
  io::Checkpoint const all = c.joined();
  io::Record const& joined = all.get("w");
  CHECK(joined.shape == shape);
  CHECK(joined.data.size() == 48 * sizeof(float));
  CHECK(std::memcmp(joined.data.data(), whole.data(), joined.data.size()) == 0);

  // Three dimensions, split along the middle one, read in a box across the split.
  TempDir three;
  mgpu::Shape const cube{3, 4, 5};
  write_boxes(h, three.path, cube, {{{0, 0, 0}, {3, 1, 5}}, {{0, 1, 0}, {3, 3, 5}}});
  auto const d = io::ShardedCheckpoint::load(three.path);
  io::Box const across{{1, 0, 2}, {2, 3, 3}};
  CHECK(read_box(h, d, "w", across) == box_of(iota(60, 1.0f), cube, across));

  Tensor five = Tensor::empty({5}, DType::float32, h.group.allocator(0));
  REQUIRE_MGPU_ERROR(c.read_box("w", {{4, 0}, {3, 8}}, five, h.stream), Errc::invalid_argument,
                     "reading box [4:7, 0:8] of record 'w' into 5 elements (expected a box within its shape [6, 8]");
}

TEST_CASE("Sharded checkpoint: element ranges of a version-1 save read as boxes", "[io][sharded][box]") {
  Host h;
  TempDir dir;
  auto const whole = iota(35, 1.0f);
  write_save(h, dir.path, 3, whole, {0, 12, 12, 35});
  io::Checkpoint manifest;  // the manifest as version 1 wrote it
  manifest.put("format", std::string("mgpu-sharded-checkpoint-1"));
  manifest.put("save_id", std::vector<std::uint64_t>{3});
  manifest.put("shards", std::vector<std::int64_t>{3});
  manifest.save(dir.path / "manifest.ckpt");
  auto const c = io::ShardedCheckpoint::load(dir.path);
  CHECK(c.version() == 1);
  CHECK(c.split_by_elements("model.weight"));
  CHECK(c.parts("model.weight")[0].box == io::Box{{0}, {12}});
  io::Box const columns{{1, 2}, {5, 2}};
  CHECK(read_box(h, c, "model.weight", columns) == box_of(whole, {7, 5}, columns));
}

TEST_CASE("Sharded checkpoint: boxes that overlap or leave a hole are refused naming the tensor and box", "[io][sharded][box]") {
  Host h;
  mgpu::Shape const shape{4, 6};
  SECTION("an overlap") {
    TempDir dir;
    write_boxes(h, dir.path, shape, {{{0, 0}, {4, 4}}, {{1, 3}, {3, 3}}, {{0, 4}, {1, 2}}});
    REQUIRE_MGPU_ERROR(io::ShardedCheckpoint::load(dir.path), Errc::corrupt_data,
                       "tensor 'w' of shape [4, 6] in " + dir.path.string() +
                           ": boxes [0:4, 0:4] and [1:4, 3:6] overlap (expected its boxes to cover every element once)");
  }
  SECTION("a hole") {
    TempDir dir;
    write_boxes(h, dir.path, shape, {{{0, 0}, {4, 3}}, {{0, 3}, {2, 3}}});
    REQUIRE_MGPU_ERROR(io::ShardedCheckpoint::load(dir.path), Errc::corrupt_data,
                       "tensor 'w' of shape [4, 6] in " + dir.path.string() + ": box [2:4, 3:6] is in no shard (6 elements are in no box)");
  }
  SECTION("element ranges and boxes of one tensor") {
    TempDir dir;
    io::ShardWriter a;
    a.put_box("w", shape, {{0, 0}, {2, 6}}, h.floats(iota(12, 0.0f)), h.stream);
    a.save(dir.path, 1, 0, 2);
    io::ShardWriter b;
    b.put_piece("w", shape, 12, h.floats(iota(12, 0.0f)), h.stream);
    b.save(dir.path, 1, 1, 2);
    io::commit_shards(dir.path, 1, 2);
    REQUIRE_MGPU_ERROR(io::ShardedCheckpoint::load(dir.path), Errc::corrupt_data,
                       "record 'w' in " + dir.path.string() + " is split both in element ranges and in boxes");
  }
  SECTION("bad boxes are refused when written") {
    io::ShardWriter a;
    REQUIRE_MGPU_ERROR(a.put_box("w", shape, {{2, 0}, {3, 6}}, h.floats(iota(18, 0.0f)), h.stream), Errc::invalid_argument,
                       "box [2:5, 0:6] of 'w' (expected 2 offsets and lengths within its shape [4, 6])");
    REQUIRE_MGPU_ERROR(a.put_box("w", shape, {{0}, {4}}, h.floats(iota(4, 0.0f)), h.stream), Errc::invalid_argument,
                       "box [0:4] of 'w' (expected 2 offsets and lengths within its shape [4, 6])");
    REQUIRE_MGPU_ERROR(a.put_box("w", shape, {{0, 0}, {2, 2}}, h.floats(iota(5, 0.0f)), h.stream), Errc::invalid_argument,
                       "box [0:2, 0:2] of 'w' given 5 values (expected 4, the box's elements)");
    a.put_box("w", shape, {{0, 0}, {2, 2}}, h.floats(iota(4, 0.0f)), h.stream);
    REQUIRE_MGPU_ERROR(a.put_box("w", shape, {{0, 0}, {2, 2}}, h.floats(iota(4, 0.0f)), h.stream), Errc::invalid_argument,
                       "a second box of 'w' at [0:2, 0:2] (expected each box once)");
  }
}

TEST_CASE("Sharded checkpoint: a layout reads its boxed tensors as one flat record", "[io][sharded][box]") {
  Host h;
  TempDir dir;
  // Record "p" of 10 elements: tensor a [2, 3] (column boxes on two writers) then b [4] (halves).
  std::vector<float> const a{1, 2, 3, 4, 5, 6}, b{7, 8, 9, 10};
  auto const flat = iota(10, 1.0f);
  for (int w = 0; w < 2; ++w) {
    io::ShardWriter shard;
    io::Box const columns = w == 0 ? io::Box{{0, 0}, {2, 1}} : io::Box{{0, 1}, {2, 2}};
    shard.put_box("p/a", {2, 3}, columns, h.floats(box_of(a, {2, 3}, columns)), h.stream);
    shard.put_box("p/b", {4}, {{2 * w}, {2}}, h.floats(slice(b, 2 * w, 2 * w + 2)), h.stream);
    if (w == 0) shard.put_layout("p", 10, {{"p/a", 0}, {"p/b", 6}});
    shard.save(dir.path, 1, w, 2);
  }
  io::commit_shards(dir.path, 1, 2);
  auto const c = io::ShardedCheckpoint::load(dir.path);
  CHECK(c.split_names() == std::vector<std::string>{"p"});
  CHECK(c.is_layout("p"));
  CHECK(c.layout_tensors("p") == std::vector<std::string>{"p/a", "p/b"});
  CHECK(c.shape("p") == mgpu::Shape{10});
  CHECK(h.read(c, "p", 0, 10) == flat);
  CHECK(h.read(c, "p", 4, 4) == slice(flat, 4, 8));  // across the two tensors
  CHECK(read_box(h, c, "p/a", {{0, 1}, {2, 1}}) == std::vector<float>{2, 5});
  io::Checkpoint const joined = c.joined();
  CHECK(!joined.contains("p/a"));
  REQUIRE(joined.contains("p"));
  CHECK(std::memcmp(joined.get("p").data.data(), flat.data(), 10 * sizeof(float)) == 0);

  io::ShardWriter bad;
  REQUIRE_MGPU_ERROR(bad.put_layout("q", 10, {{"q/a", 2}}), Errc::invalid_argument,
                     "layout 'q': tensor 'q/a' at 2 (expected named tensors at increasing offsets from 0 below 10)");
  TempDir gap;
  io::ShardWriter shard;
  shard.put_box("q/a", {4}, {{0}, {4}}, h.floats(iota(4, 0.0f)), h.stream);
  shard.put_layout("q", 9, {{"q/a", 0}, {"q/b", 5}});
  shard.save(gap.path, 1, 0, 1);
  io::commit_shards(gap.path, 1, 1);
  REQUIRE_MGPU_ERROR(io::ShardedCheckpoint::load(gap.path), Errc::corrupt_data,
                     "layout 'q' in " + gap.path.string() + ": tensor 'q/b' is in no shard");
}
