// TensorParallel's checkpoints, in the one format every layout reads: saved by DP 2 x TP 2 (with
// dropout, so the RNG state matters) and loaded into the same layout the curve continues bit for
// bit; loaded into one device and into TP 4 it continues as the uninterrupted run within float32
// rounding; a one-device checkpoint loaded into TP 2 continues as the one device; a folder save
// loads too; another model or a damaged file is refused, naming it, with the shards unchanged.
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <mgpu/core/device_group.hpp>
#include <mgpu/io/checkpoint.hpp>
#include <mgpu/io/sharded_checkpoint.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/comm/communicator.hpp>
#include <mgpu/parallel/data_parallel.hpp>
#include <mgpu/parallel/shard_boxes.hpp>
#include <mgpu/parallel/tensor_parallel.hpp>
#include <mgpu/pipeline/pipeline.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/nn_env.hpp"
#include "support/temp_path.hpp"

namespace fs = std::filesystem;
namespace nn = mgpu::nn;
namespace par = mgpu::parallel;
using mgpu::test::Env;
using mgpu::test::OneDeviceGpt;
using mgpu::test::worst_relative;
using mgpu::test::TokenBatch;

namespace {

// A folder of its own under the temporary folder, removed with everything in it at the end.
struct TempDir {
  fs::path path = mgpu::test::temp_path("mgpu-tp-checkpoint");
  TempDir() {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

nn::GptConfig const config{.vocab = 64, .block_size = 16, .n_layer = 2, .n_head = 4, .n_embd = 32, .dropout = 0.1f};
mgpu::optim::AdamWOptions const adamw{.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .weight_decay = 0.1f};
float const clip = 0.5f;

std::vector<TokenBatch> batches(Env& env, int count) { return mgpu::test::rule_batches(env, count, 4, config, 500); }

par::TensorParallelOptions options(int replicas, std::uint64_t seed = 7) {
  return {.seed = seed, .adamw = adamw, .clip_norm = clip, .data_parallel = replicas};
}

std::vector<double> run(par::TensorParallel& tp, std::vector<TokenBatch> const& bs, std::size_t from, std::size_t to) {
  std::vector<double> out;
  for (std::size_t s = from; s < to; ++s) out.push_back(tp.step(bs[s].ids, bs[s].targets).loss);
  return out;
}

// DP 2 x TP 2 saving to `path` (a file or a folder) after 3 of the 6 batches: the uninterrupted
// run's losses of steps 3..5.
std::vector<double> save_dp2_tp2_at_3(std::vector<TokenBatch> const& bs, fs::path const& path) {
  mgpu::DeviceGroup group("host:4");
  par::TensorParallel tp(group, nn::gpt(config), options(2));
  (void)run(tp, bs, 0, 3);
  tp.save(path, {.step = 3});
  return run(tp, bs, 3, 6);
}

// Flips a byte in the middle of `file`.
void flip_middle_byte(fs::path const& file) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(0, std::ios::end);
  auto const size = static_cast<std::streamoff>(f.tellg());
  f.seekg(size / 2);
  char byte = 0;
  f.read(&byte, 1);
  byte = static_cast<char>(byte ^ 0x40);
  f.seekp(size / 2);
  f.write(&byte, 1);
}

}  // namespace

TEST_CASE("a DP 2 x TP 2 checkpoint continues bit for bit, and on one device and TP 4 as the uninterrupted run",
          "[parallel][tensor][checkpoint]") {
  Env env;
  auto const bs = batches(env, 6);
  TempDir dir;
  fs::path const file = dir.path / "tp.ckpt";
  std::vector<double> const rest = save_dp2_tp2_at_3(bs, file);
  SECTION("the same layout, from other weights: bit for bit") {
    mgpu::DeviceGroup group("host:4");
    par::TensorParallel tp(group, nn::gpt(config), options(2, 99));
    CHECK(tp.load(file).step == 3);
    CHECK(run(tp, bs, 3, 6) == rest);
  }
  SECTION("TP 4") {
    mgpu::DeviceGroup group("host:4");
    par::TensorParallel tp(group, nn::gpt(config), options(1, 99));
    tp.load(file);
    CHECK(worst_relative(run(tp, bs, 3, 6), rest) < 1e-5);
  }
  SECTION("one device") {
    OneDeviceGpt one(env, config, 99, adamw);
    CHECK(mgpu::io::load_training(file, one.model, one.opt, *env.allocator, env.stream).step == 3);
    CHECK(worst_relative(one.steps(bs, 3, 6, clip), rest) < 1e-5);
  }
}

TEST_CASE("a one-device checkpoint loads into TP 2, which continues as the one device", "[parallel][tensor][checkpoint]") {
  Env env;
  auto const bs = batches(env, 5);
  TempDir dir;
  fs::path const file = dir.path / "one.ckpt";
  OneDeviceGpt one(env, config, 3, adamw);
  (void)one.steps(bs, 0, 2, clip);
  mgpu::io::save_training(file, one.model, one.opt, {.step = 2}, env.stream);
  std::vector<double> const want = one.steps(bs, 2, 5, clip);

  mgpu::DeviceGroup group("host:2");
  par::TensorParallel tp(group, nn::gpt(config), options(1));
  CHECK(tp.load(file).step == 2);
  CHECK(worst_relative(run(tp, bs, 2, 5), want) < 1e-5);
}

TEST_CASE("TensorParallel saves into a folder and refuses another model or a damaged file, unchanged",
          "[parallel][tensor][checkpoint]") {
  Env env;
  auto const bs = batches(env, 4);
  TempDir dir;
  mgpu::DeviceGroup group("host:2");
  par::TensorParallel tp(group, nn::gpt(config), options(1));
  (void)run(tp, bs, 0, 2);
  fs::path const folder = dir.path / "folder";
  fs::create_directories(folder);
  tp.save(folder, {.step = 2});
  fs::path const file = dir.path / "tp.ckpt";
  tp.save(file, {.step = 2});
  std::vector<float> const before = tp.gather_parameters();
  std::vector<double> const rest = run(tp, bs, 2, 4);

  par::TensorParallel from_folder(group, nn::gpt(config), options(1, 11));
  CHECK(from_folder.load(folder).step == 2);
  CHECK(from_folder.gather_parameters() == before);
  CHECK(run(from_folder, bs, 2, 4) == rest);

  nn::GptConfig other = config;
  other.n_layer = 1;
  par::TensorParallel small(group, nn::gpt(other), options(1, 11));
  std::vector<float> const small_before = small.gather_parameters();
  REQUIRE_MGPU_ERROR(small.load(file), mgpu::Errc::invalid_argument, "the model differs");
  CHECK(small.gather_parameters() == small_before);

  flip_middle_byte(file);  // in the parameters' payload
  par::TensorParallel damaged(group, nn::gpt(config), options(1, 11));
  std::vector<float> const damaged_before = damaged.gather_parameters();
  REQUIRE_MGPU_ERROR(damaged.load(file), mgpu::Errc::corrupt_data, file.string());
  CHECK(damaged.gather_parameters() == damaged_before);
}

TEST_CASE("a DP 2 x TP 2 folder holds each rank's boxes, and continues on TP 4, TP 2 and one device", "[parallel][tensor][checkpoint][box]") {
  Env env;
  auto const bs = batches(env, 6);
  TempDir dir;
  fs::path const folder = dir.path / "boxes";
  fs::create_directories(folder);
  std::vector<double> const rest = save_dp2_tp2_at_3(bs, folder);
  {  // replica 0's two ranks wrote a shard each: a column split's two boxes, a replicated tensor once
    mgpu::io::ShardedCheckpoint const c = mgpu::io::ShardedCheckpoint::load(folder);
    CHECK(c.shards() == 2);
    CHECK(c.is_layout("model.parameters"));
    CHECK(!c.whole().contains("model.parameters"));
    std::string const qkv = "model.parameters/h.0.attn_qkv.weight";
    REQUIRE(c.has_pieces(qkv));
    CHECK(c.shape(qkv) == mgpu::Shape{32, 96});
    auto const parts = c.parts(qkv);
    REQUIRE(parts.size() == 6);  // q, k and v's columns of each rank
    CHECK(to_string(parts[0].box) == "[0:32, 0:16]");  // rank 0's 2 of the 4 heads of q: 16 of its 32 columns
    CHECK(to_string(parts[1].box) == "[0:32, 16:32]");  // rank 1's
    CHECK(c.parts("model.parameters/0.wpe.weight").size() == 1);
    CHECK(c.parts("optimizer.m/0.wte.weight").size() == 2);  // the vocab's rows
  }
  SECTION("TP 4") {
    mgpu::DeviceGroup group("host:4");
    par::TensorParallel tp(group, nn::gpt(config), options(1, 99));
    CHECK(tp.load(folder).step == 3);
    CHECK(worst_relative(run(tp, bs, 3, 6), rest) < 1e-5);
  }
  SECTION("the same layout: bit for bit") {
    mgpu::DeviceGroup group("host:4");
    par::TensorParallel tp(group, nn::gpt(config), options(2, 99));
    tp.load(folder);
    CHECK(run(tp, bs, 3, 6) == rest);
  }
  SECTION("one device, through the folder joined") {
    OneDeviceGpt one(env, config, 99, adamw);
    CHECK(mgpu::io::load_training(mgpu::io::ShardedCheckpoint::load(folder).joined(), folder.string(), one.model, one.opt,
                                  *env.allocator, env.stream)
              .step == 3);
    CHECK(worst_relative(one.steps(bs, 3, 6, clip), rest) < 1e-5);
  }
  SECTION("a 2-stage pipeline x DP 2 with ZeRO-1, and DataParallel ZeRO-1 x 2: the boxes read as the flat records") {
    auto const chunk_adamw = [](nn::Sequential const& chunk) {
      mgpu::optim::AdamWOptions o = adamw;
      o.decay_ranges = chunk.matrix_ranges();
      return std::make_unique<mgpu::optim::AdamW>(o);
    };
    mgpu::DeviceGroup four("host:4");
    mgpu::pipeline::Executor pipe(nn::gpt(config), four, {0, 3, 6}, mgpu::pipeline::one_f_one_b(2, 2), chunk_adamw,
                                  {.seed = 99, .data_parallel = 2, .zero_stage = 1, .clip_norm = clip,
                                   .loss = std::make_shared<nn::TokenCrossEntropy const>()});
    CHECK(pipe.load(folder).step == 3);
    std::vector<double> got;
    for (std::size_t s = 3; s < 6; ++s) got.push_back(pipe.step(bs[s].ids, bs[s].targets));
    CHECK(worst_relative(got, rest) < 1e-5);

    mgpu::DeviceGroup two("host:2");
    mgpu::optim::AdamWOptions o = adamw;
    o.decay_ranges = nn::gpt_decay_ranges(config);
    par::DataParallelOptions dp_options;
    dp_options.zero_stage = 1;
    dp_options.seed = 99;
    dp_options.clip_norm = clip;
    dp_options.loss = std::make_shared<nn::TokenCrossEntropy const>();
    par::DataParallel dp(nn::gpt(config), two, mgpu::optim::AdamW(o), dp_options);
    CHECK(dp.load(folder).step == 3);
    got.clear();
    for (std::size_t s = 3; s < 6; ++s) got.push_back(dp.step(bs[s].ids, bs[s].targets).loss);
    CHECK(worst_relative(got, rest) < 1e-5);
  }
  SECTION("a damaged box names its file and tensor") {
    fs::path shard;
    for (auto const& entry : fs::directory_iterator(folder))
      if (entry.path().filename().string().ends_with("-1-of-2.ckpt")) shard = entry.path();
    REQUIRE(!shard.empty());
    flip_middle_byte(shard);  // inside one of rank 1's boxes' payloads
    mgpu::DeviceGroup group("host:2");
    par::TensorParallel tp(group, nn::gpt(config), options(1, 99));
    std::vector<float> const before = tp.gather_parameters();
    REQUIRE_MGPU_ERROR(tp.load(folder), mgpu::Errc::corrupt_data, shard.string() + ": checksum mismatch in record 'box:");
    CHECK(tp.gather_parameters() == before);
  }
}

TEST_CASE("a rank of TP 2 reads its own boxes of a TP 2 folder: about half the model's bytes", "[parallel][tensor][checkpoint][box]") {
  Env env;
  auto const bs = batches(env, 2);
  TempDir dir;
  mgpu::DeviceGroup group("host:2");
  par::TensorParallel tp(group, nn::gpt(config), options(1));
  (void)run(tp, bs, 0, 2);
  tp.save(dir.path, {.step = 2});
  std::vector<float> const whole = tp.gather_parameters();
  std::shared_ptr<mgpu::comm::Communicator> const comm = mgpu::comm::make_communicator(group);
  nn::Sequential const shard = par::parallelize(nn::gpt(config), {}, comm, 1);  // rank 1's layout
  auto const c = mgpu::io::ShardedCheckpoint::load(dir.path);
  std::uint64_t const at_load = c.payload_bytes_read();
  std::int64_t elements = 0;
  auto const host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  for (par::ShardBox const& b : par::shard_boxes(nn::gpt(config), shard)) {
    mgpu::Tensor const out = mgpu::Tensor::empty({b.box.numel()}, mgpu::DType::float32, *host);
    c.read_view("model.parameters", b.offset, b.shape, b.box, out, env.stream);
    // The box's elements of the whole model, serially: rows of the last dimension.
    std::int64_t const cols = b.shape.back();
    std::int64_t const rows = b.shape.size() == 1 ? 1 : b.box.lengths[0];
    std::int64_t const row0 = b.shape.size() == 1 ? 0 : b.box.offsets[0];
    std::vector<float> want;
    for (std::int64_t r = row0; r < row0 + rows; ++r)
      for (std::int64_t k = b.box.offsets.back(); k < b.box.offsets.back() + b.box.lengths.back(); ++k)
        want.push_back(whole[static_cast<std::size_t>(b.offset + r * cols + k)]);
    auto const got = out.host_span<float>();
    CHECK(std::vector<float>(got.begin(), got.end()) == want);
    elements += b.box.numel();
  }
  double const model_bytes = static_cast<double>(whole.size() * sizeof(float));
  // Exactly its boxes (the saving layout's), about half the model: the split half plus the replicated.
  CHECK(c.payload_bytes_read() - at_load == static_cast<std::uint64_t>(elements) * sizeof(float));
  CHECK(static_cast<double>(c.payload_bytes_read() - at_load) < 0.55 * model_bytes);
  CHECK(static_cast<double>(c.payload_bytes_read() - at_load) > 0.45 * model_bytes);
}
