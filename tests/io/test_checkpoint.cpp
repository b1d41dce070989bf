// Checkpoints: bitwise round trips, resuming equals not stopping, N devices to M, and every kind of
// bad file rejected with its message while the model stays untouched.
#include <mgpu/core/device_group.hpp>
#include <mgpu/io/checkpoint.hpp>
#include <mgpu/io/sharded_checkpoint.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/optim/optim.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/nn_env.hpp"

using mgpu::DType;
using mgpu::Tensor;
using mgpu::test::as_double;
using mgpu::test::Env;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("mgpu-ckpt-" + std::to_string(::getpid()) + "-" + std::to_string(counter()++));
  TempDir() { fs::create_directories(path); }
  ~TempDir() { fs::remove_all(path); }
  static int& counter() {
    static int n = 0;
    return n;
  }
};

std::vector<char> read_file(fs::path const& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_file(fs::path const& p, std::vector<char> const& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::vector<float> values(Tensor const& t) {
  auto s = t.host_span<float>();
  return {s.begin(), s.end()};
}

// A small model trained a few AdamW steps on fixed data.
struct Run {
  Env env;
  mgpu::nn::Sequential model = mgpu::nn::Sequential::mlp({3, 8, 2});
  mgpu::optim::AdamW adam{{.lr = 0.05f}};
  Tensor x = env.random({16, 3}, 1);
  Tensor y = env.make({16}, {0, 1, 1, 0, 1, 0, 0, 1, 1, 1, 0, 0, 1, 0, 1, 0});
  explicit Run(std::uint64_t seed) { model.materialize(env.ctx, seed); }
  void steps(int n) {
    for (int i = 0; i < n; ++i) mgpu::nn::classification_step(model, adam, x, y, env.ctx);
    env.stream.synchronize();
  }
};

}  // namespace

TEST_CASE("A checkpoint round trip is bitwise exact, and resuming equals never stopping", "[io]") {
  TempDir dir;
  fs::path const file = dir.path / "run.ckpt";
  Run a(1);
  a.steps(3);
  mgpu::io::save_training(file, a.model, a.adam, {.step = 3, .epoch = 1, .batch = 2, .data_seed = 77}, a.env.stream);
  CHECK(std::distance(fs::directory_iterator(dir.path), fs::directory_iterator()) == 1);  // no temporary left behind

  Run b(2);  // other initial weights
  auto const state = mgpu::io::load_training(file, b.model, b.adam, *b.env.allocator, b.env.stream);
  CHECK(state.step == 3);
  CHECK(state.epoch == 1);
  CHECK(state.batch == 2);
  CHECK(state.data_seed == 77);
  CHECK(b.adam.steps() == 3);
  CHECK(values(b.model.parameters()) == values(a.model.parameters()));
  REQUIRE(b.adam.state().size() == 2);
  for (std::size_t i = 0; i < 2; ++i) CHECK(values(b.adam.state()[i].second) == values(a.adam.state()[i].second));
  a.steps(2);
  b.steps(2);
  CHECK(values(b.model.parameters()) == values(a.model.parameters()));
}

TEST_CASE("A checkpoint written from one device loads on others and in another compute type", "[io]") {
  TempDir dir;
  fs::path const file = dir.path / "model.ckpt";
  Run a(1);
  a.steps(2);
  mgpu::io::save_training(file, a.model, a.adam, {}, a.env.stream);
  mgpu::DeviceGroup group("host:3");
  for (int rank = 0; rank < group.size(); ++rank) {
    mgpu::nn::Context ctx{group.allocator(rank), group.stream(rank)};
    auto replica = mgpu::nn::Sequential::mlp({3, 8, 2});
    replica.materialize(ctx, 100 + static_cast<std::uint64_t>(rank), rank == 2 ? DType::bfloat16 : DType::float32);
    mgpu::optim::AdamW adam;
    mgpu::io::load_training(file, replica, adam, ctx.allocator, ctx.stream);
    CHECK(values(replica.master_parameters()) == values(a.model.parameters()));
  }
}

TEST_CASE("load_training reads a folder of shards as one file, save_training into it saves one shard, Checkpoint::load refuses a folder", "[io][sharded]") {
  TempDir dir;
  Run a(1);
  a.steps(3);
  // Two writers: the parameters and the first moment split by element range, the rest whole.
  mgpu::io::Checkpoint const records = mgpu::io::training_checkpoint(a.model, a.adam, {.step = 3, .data_seed = 5}, a.env.stream);
  mgpu::io::ShardWriter writers[2];
  for (mgpu::io::Record const& r : records.records()) {
    if (r.name != "model.parameters" && r.name != "optimizer.m") {
      writers[1].put(r);
      continue;
    }
    Tensor const whole = r.name == "model.parameters" ? a.model.parameters() : a.adam.state()[0].second;
    std::int64_t const half = whole.numel() / 2;
    writers[0].put_piece(r.name, whole.shape(), 0, whole.slice(0, half), a.env.stream);
    writers[1].put_piece(r.name, whole.shape(), half, whole.slice(half, whole.numel()), a.env.stream);
  }
  fs::path const folder = dir.path / "run";
  for (int w = 0; w < 2; ++w) writers[w].save(folder, 1, w, 2);
  mgpu::io::commit_shards(folder, 1, 2);

  Run b(2);  // other initial weights
  CHECK(mgpu::io::load_training(folder, b.model, b.adam, *b.env.allocator, b.env.stream).step == 3);
  CHECK(values(b.model.parameters()) == values(a.model.parameters()));
  REQUIRE(b.adam.state().size() == 2);
  for (std::size_t i = 0; i < 2; ++i) CHECK(values(b.adam.state()[i].second) == values(a.adam.state()[i].second));
  a.steps(2);
  b.steps(2);
  CHECK(values(b.model.parameters()) == values(a.model.parameters()));
  // Saved into the folder again: a one-shard save, committed, that loads as the model was.
  mgpu::io::save_training(folder, b.model, b.adam, {.step = 5, .data_seed = 5}, b.env.stream);
  CHECK(mgpu::io::committed_save_id(folder) == 2);
  CHECK(mgpu::io::ShardedCheckpoint::load(folder).shards() == 1);
  Run c(3);
  CHECK(mgpu::io::load_training(folder, c.model, c.adam, *c.env.allocator, c.env.stream).step == 5);
  CHECK(values(c.model.parameters()) == values(b.model.parameters()));
  REQUIRE_MGPU_ERROR((void)mgpu::io::Checkpoint::load(folder), mgpu::Errc::invalid_argument, "run: a folder (expected a checkpoint file");
}

TEST_CASE("Bad checkpoints are rejected with the reason and leave the model untouched", "[io]") {
  TempDir dir;
  fs::path const file = dir.path / "good.ckpt";
  Run a(1);
  a.steps(1);
  mgpu::io::save_training(file, a.model, a.adam, {}, a.env.stream);
  auto const good = read_file(file);
  Run b(5);
  auto const before = values(b.model.parameters());
  auto const load = [&](fs::path const& p) { mgpu::io::load_training(p, b.model, b.adam, *b.env.allocator, b.env.stream); };
  auto const variant = [&](std::string const& name, std::vector<char> bytes) {
    fs::path const p = dir.path / name;
    write_file(p, bytes);
    return p;
  };

  std::vector<char> flipped = good;
  flipped[flipped.size() / 2] ^= 0x10;
  REQUIRE_MGPU_ERROR(load(variant("flipped", flipped)), mgpu::Errc::corrupt_data, "checksum mismatch");
  REQUIRE_MGPU_ERROR(load(variant("truncated", {good.begin(), good.begin() + static_cast<long>(good.size() / 2)})), mgpu::Errc::corrupt_data,
                     "truncated");
  REQUIRE_MGPU_ERROR(load(variant("text", {'h', 'e', 'l', 'l', 'o', '\n', '!', '!', '!', '!'})), mgpu::Errc::corrupt_data,
                     "not an mgpu checkpoint");
  // An empty file (found by fuzz/fuzz_checkpoint: a null pointer passed to memcpy, which UBSan reports).
  REQUIRE_MGPU_ERROR(load(variant("empty", {})), mgpu::Errc::corrupt_data, "not an mgpu checkpoint");
  std::vector<char> future = good;
  future[8] = 99;
  REQUIRE_MGPU_ERROR(load(variant("future", future)), mgpu::Errc::corrupt_data, "unknown checkpoint version 99 (expected 1)");
  REQUIRE_MGPU_ERROR(load(dir.path / "missing"), mgpu::Errc::io, "opening");

  Env env;
  auto wider = mgpu::nn::Sequential::mlp({3, 9, 2});
  wider.materialize(env.ctx, 1);
  mgpu::optim::AdamW adam;
  REQUIRE_MGPU_ERROR(mgpu::io::load_training(file, wider, adam, *env.allocator, env.stream), mgpu::Errc::invalid_argument,
                     "the model differs: the checkpoint holds 'Linear(3, 8) | ReLU | Linear(8, 2)' (expected 'Linear(3, 9) | ReLU | Linear(9, 2)')");
  mgpu::optim::SGD sgd;
  REQUIRE_MGPU_ERROR(mgpu::io::load_training(file, b.model, sgd, *b.env.allocator, b.env.stream), mgpu::Errc::invalid_argument,
                     "the checkpoint holds adamw state (expected sgd)");
  CHECK(sgd.state().empty());
  CHECK(values(b.model.parameters()) == before);
  CHECK(b.adam.steps() == 0);

  mgpu::io::Checkpoint c = mgpu::io::Checkpoint::load(file);
  c.put("model.parameters", std::vector<std::int64_t>{1, 2});
  c.save(dir.path / "retyped");
  REQUIRE_MGPU_ERROR(load(dir.path / "retyped"), mgpu::Errc::invalid_argument,
                     "checkpoint record 'model.parameters' is int64 [2] (expected float32 [50])");
  CHECK(values(b.model.parameters()) == before);
  REQUIRE_MGPU_ERROR(c.save(dir.path / "no-such-dir" / "x.ckpt"), mgpu::Errc::io, "creating");
}

TEST_CASE("A checkpoint record whose shape overflows is rejected before its size is used", "[io]") {
  // A well-formed file (valid checksum) with one float32 record of shape [2^62, 8] and no data:
  // 2^65 elements, whose byte count was an overflowing signed product.
  std::vector<char> bytes;
  auto const put = [&](auto value) {
    char raw[sizeof(value)];
    std::memcpy(raw, &value, sizeof(value));
    bytes.insert(bytes.end(), raw, raw + sizeof(value));
  };
  for (char c : std::string("MGPUCKPT")) bytes.push_back(c);
  put(mgpu::io::checkpoint_version);
  put(std::uint32_t{1});
  put(std::uint32_t{1});
  bytes.push_back('w');
  put(static_cast<std::uint8_t>(mgpu::io::RecordType::float32));
  put(std::uint8_t{2});
  put(std::int64_t{1} << 62);
  put(std::int64_t{8});
  put(std::uint64_t{0});
  put(std::uint64_t{0});
  put(static_cast<std::uint64_t>(XXH64(bytes.data(), bytes.size(), 0)));
  for (char c : std::string("MGPU-END")) bytes.push_back(c);
  TempDir dir;
  write_file(dir.path / "huge.ckpt", bytes);
  REQUIRE_MGPU_ERROR(mgpu::io::Checkpoint::load(dir.path / "huge.ckpt"), mgpu::Errc::corrupt_data,
                     "record 'w' has shape [4611686018427387904, 8] of float32 (expected at most 2^64 bytes)");
}

TEST_CASE("A checkpoint's index lists its records without their payloads; read_record reads one, verified", "[io]") {
  mgpu::io::Checkpoint c;
  c.put("a", std::vector<std::int64_t>{1, 2, 3});
  c.put("text", std::string("hello"));
  c.put("b", std::vector<std::uint64_t>{7});
  TempDir dir;
  fs::path const file = dir.path / "c.ckpt";
  c.save(file);
  std::vector<mgpu::io::RecordEntry> const index = mgpu::io::Checkpoint::index(file);
  REQUIRE(index.size() == 3);
  mgpu::io::Checkpoint const loaded = mgpu::io::Checkpoint::load(file);
  for (std::size_t i = 0; i < index.size(); ++i) {
    mgpu::io::Record const& want = loaded.records()[i];
    CHECK(index[i].name == want.name);
    CHECK(index[i].type == want.type);
    CHECK(index[i].shape == want.shape);
    CHECK(index[i].size == want.data.size());
    mgpu::io::Record const got = mgpu::io::Checkpoint::read_record(file, index[i]);
    CHECK(got.data == want.data);
  }
  // A damaged payload: the whole file no longer loads; the index still reads, and only that record
  // fails, naming it.
  std::vector<char> bytes = read_file(file);
  bytes[index[1].offset + 1] ^= 0x20;
  write_file(file, bytes);
  REQUIRE_MGPU_ERROR(mgpu::io::Checkpoint::load(file), mgpu::Errc::corrupt_data, "checksum mismatch");
  std::vector<mgpu::io::RecordEntry> const again = mgpu::io::Checkpoint::index(file);
  REQUIRE(again.size() == 3);
  CHECK(mgpu::io::Checkpoint::read_record(file, again[0]).data == loaded.records()[0].data);
  REQUIRE_MGPU_ERROR(mgpu::io::Checkpoint::read_record(file, again[1]), mgpu::Errc::corrupt_data,
                     "c.ckpt: checksum mismatch in record 'text'");
  // A truncated file has no index.
  bytes.resize(bytes.size() - 3);
  write_file(file, bytes);
  REQUIRE_MGPU_ERROR(mgpu::io::Checkpoint::index(file), mgpu::Errc::corrupt_data, "without the end marker");
  REQUIRE_MGPU_ERROR(mgpu::io::Checkpoint::index(dir.path / "missing.ckpt"), mgpu::Errc::io, "missing.ckpt");
}
