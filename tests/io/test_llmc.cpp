// llm.c model files: a file assembled here from the PyTorch parity fixture in llm.c's documented
// order (independently of the reader's own table) loads into nn::gpt and gives the fixture's loss;
// the writer reproduces that file byte for byte; round trips; damaged and mismatched files.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <mgpu/io/llmc.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/ops/transformer.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/gpt_fixture.hpp"
#include "support/nn_env.hpp"

using mgpu::DType;
using mgpu::Errc;
using mgpu::Tensor;
using mgpu::test::Env;
namespace fs = std::filesystem;
namespace io = mgpu::io;
namespace nn = mgpu::nn;

namespace {

fs::path temp_file(std::string const& tag) {
  return fs::temp_directory_path() / ("mgpu-llmc-" + tag + "-" + std::to_string(std::random_device{}()) + ".bin");
}

std::vector<char> read_bytes(fs::path const& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(fs::path const& path, std::vector<char> const& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// The fixture's parameters as llm.c's train_gpt2.c lays them out: header [20240326, 3, maxT, V, L,
// NH, C, Vp], then wte (Vp rows, the padding zero), wpe, and per kind of layer tensor all layers
// stacked, then ln_f. PyTorch's (out, in) Linear weights are llm.c's layout as they are.
std::vector<char> llmc_bytes(mgpu::test::Fixture const& f, std::int32_t vp) {
  std::map<std::string, std::vector<float>> value;
  for (auto const& r : f.tensors) value[r.name] = r.value;
  std::vector<std::int32_t> header(256, 0);
  std::int32_t const fields[8] = {20240326, 3, f.block, f.vocab, f.n_layer, f.n_head, f.n_embd, vp};
  std::copy(std::begin(fields), std::end(fields), header.begin());
  std::vector<float> body = value["wte.weight"];
  body.resize(static_cast<std::size_t>(vp * f.n_embd), 0.0f);
  auto const append = [&](std::vector<float> const& v) { body.insert(body.end(), v.begin(), v.end()); };
  append(value["wpe.weight"]);
  for (char const* kind :
       {"ln_1.weight", "ln_1.bias", "attn_qkv.weight", "attn_qkv.bias", "attn_proj.weight", "attn_proj.bias",
        "ln_2.weight", "ln_2.bias", "mlp_fc.weight", "mlp_fc.bias", "mlp_proj.weight", "mlp_proj.bias"})
    for (std::int32_t l = 0; l < f.n_layer; ++l) append(value["h." + std::to_string(l) + "." + kind]);
  append(value["ln_f.weight"]);
  append(value["ln_f.bias"]);
  std::vector<char> bytes(4 * (header.size() + body.size()));
  std::memcpy(bytes.data(), header.data(), 4 * header.size());
  std::memcpy(bytes.data() + 4 * header.size(), body.data(), 4 * body.size());
  return bytes;
}

}  // namespace

TEST_CASE("llm.c model file: the parity fixture written in llm.c's layout loads into nn::gpt with the fixture's loss",
          "[io][llmc][gpt]") {
  mgpu::test::Fixture const f = mgpu::test::read_fixture(MGPU_GPT_FIXTURE);
  nn::GptConfig const config{
      .vocab = f.vocab, .block_size = f.block, .n_layer = f.n_layer, .n_head = f.n_head, .n_embd = f.n_embd};
  std::int32_t const vp = 320;  // padded as llm.c pads (to a multiple of 64 here; rows 256..319 zero)
  fs::path const file = temp_file("fixture");
  write_bytes(file, llmc_bytes(f, vp));
  io::LlmcModel const loaded = io::read_llmc_model(file, config);
  CHECK(loaded.padded_vocab == vp);
  CHECK(loaded.config.n_layer == 2);

  Env env;
  nn::Sequential model = nn::gpt(loaded.config);
  model.materialize(env.ctx, 0);
  auto const flat = model.parameters().host_span<float>();
  REQUIRE(loaded.parameters.size() == flat.size());
  std::copy(loaded.parameters.begin(), loaded.parameters.end(), flat.begin());
  Tensor inputs = Tensor::empty({f.batch, f.block}, DType::int32, *env.allocator);
  Tensor targets = Tensor::empty({f.batch, f.block}, DType::int32, *env.allocator);
  std::copy(f.inputs.begin(), f.inputs.end(), inputs.host_span<std::int32_t>().begin());
  std::copy(f.targets.begin(), f.targets.end(), targets.host_span<std::int32_t>().begin());
  Tensor const logits = model.forward(inputs, env.ctx);
  Tensor const dlogits = Tensor::empty(logits.shape(), DType::float32, *env.allocator);
  Tensor const loss = env.scalar();
  mgpu::ops::token_cross_entropy(logits, targets, dlogits, loss, static_cast<float>(f.batch * f.block), env.stream);
  env.stream.synchronize();
  INFO("loss " << loss.host_span<float>()[0] << ", PyTorch's " << f.loss);
  CHECK(std::abs(loss.host_span<float>()[0] - f.loss) <= 1e-4f * f.loss);

  // The writer gives back the same bytes (padding rows zero).
  fs::path const again = temp_file("again");
  io::write_llmc_model(again, loaded.config, loaded.parameters, vp);
  CHECK(read_bytes(again) == read_bytes(file));
  fs::remove(again);
  fs::remove(file);
}

TEST_CASE("llm.c model file: round trip of a random model, bit for bit, with and without padding", "[io][llmc]") {
  nn::GptConfig const config{.vocab = 11, .block_size = 5, .n_layer = 3, .n_head = 2, .n_embd = 4};
  Env env;
  nn::Sequential model = nn::gpt(config);
  model.materialize(env.ctx, 8);
  auto const flat = model.parameters().host_span<float>();
  for (std::int64_t const vp : {0, 16}) {
    fs::path const file = temp_file("round");
    io::write_llmc_model(file, config, flat, vp);
    io::LlmcModel const back = io::read_llmc_model(file);
    fs::remove(file);
    CHECK(back.padded_vocab == (vp == 0 ? 11 : 16));
    CHECK(back.config.vocab == 11);
    CHECK(back.config.block_size == 5);
    CHECK(back.config.n_head == 2);
    CHECK(std::vector<float>(flat.begin(), flat.end()) == back.parameters);
  }
  REQUIRE_MGPU_ERROR(io::write_llmc_model(temp_file("bad"), config, flat, 10), Errc::invalid_argument,
                     "a padded vocab >= 11");
  REQUIRE_MGPU_ERROR(io::write_llmc_model(temp_file("bad"), config, flat.first(5), 0), Errc::invalid_argument,
                     ": 5 parameters");
}

TEST_CASE("llm.c model file: damaged or mismatched files throw mgpu::Error naming the file and byte", "[io][llmc]") {
  nn::GptConfig const config{.vocab = 7, .block_size = 3, .n_layer = 1, .n_head = 1, .n_embd = 2};
  Env env;
  nn::Sequential model = nn::gpt(config);
  model.materialize(env.ctx, 1);
  fs::path const good = temp_file("good");
  io::write_llmc_model(good, config, model.parameters().host_span<float>(), 8);
  std::vector<char> const bytes = read_bytes(good);
  fs::path const file = temp_file("damaged");
  auto const damaged = [&](auto&& edit) {
    std::vector<char> b = bytes;
    edit(b);
    write_bytes(file, b);
  };
  auto const set = [](std::vector<char>& b, std::size_t field, std::int32_t value) {
    std::memcpy(b.data() + 4 * field, &value, 4);
  };
  damaged([&](auto& b) { set(b, 0, 20240520); });
  REQUIRE_MGPU_ERROR(io::read_llmc_model(file), Errc::corrupt_data, file.string() + ":byte 0: magic 20240520");
  damaged([&](auto& b) { set(b, 1, 5); });
  REQUIRE_MGPU_ERROR(io::read_llmc_model(file), Errc::corrupt_data, ":byte 4: version 5 (expected 3");
  damaged([&](auto& b) { b.resize(100); });
  REQUIRE_MGPU_ERROR(io::read_llmc_model(file), Errc::corrupt_data, ":byte 100: truncated header");
  damaged([&](auto& b) { b.pop_back(); });
  REQUIRE_MGPU_ERROR(io::read_llmc_model(file), Errc::corrupt_data,
                     ":byte " + std::to_string(bytes.size() - 1) + ": truncated");
  damaged([&](auto& b) { b.push_back(0); });
  REQUIRE_MGPU_ERROR(io::read_llmc_model(file), Errc::corrupt_data, "1 bytes after the");
  damaged([&](auto& b) { set(b, 7, 6); });
  REQUIRE_MGPU_ERROR(io::read_llmc_model(file), Errc::corrupt_data, ":byte 28: Vp (padded vocab) 6 below V (vocab) 7");
  damaged([&](auto& b) { set(b, 5, 3); });
  REQUIRE_MGPU_ERROR(io::read_llmc_model(file), Errc::corrupt_data, ":byte 24: C (n_embd) 2 is not a multiple of NH");
  damaged([&](auto& b) { set(b, 4, 1 << 24); });  // 2^24 layers: refused by the size, before any table is built
  REQUIRE_MGPU_ERROR(io::read_llmc_model(file), Errc::corrupt_data, "truncated: the header describes");
  damaged([&](auto& b) { set(b, 6, -2); });
  REQUIRE_MGPU_ERROR(io::read_llmc_model(file), Errc::corrupt_data, ":byte 24: C (n_embd) -2 (expected 1 to 16777216)");
  REQUIRE_MGPU_ERROR(
      io::read_llmc_model(good, nn::GptConfig{.vocab = 7, .block_size = 4, .n_layer = 1, .n_head = 1, .n_embd = 2}),
      Errc::invalid_argument, good.string() + ":byte 8: maxT (block_size) 3 (expected 4, the model's)");
  REQUIRE_MGPU_ERROR(io::read_llmc_model(temp_file("missing")), Errc::io, "cannot open");
  fs::remove(file);
  fs::remove(good);
}
