// llm.c's model file: reading into and writing from nn::gpt's flat parameter layout.
#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <mgpu/core/error.hpp>
#include <mgpu/core/memory.hpp>
#include <mgpu/io/llmc.hpp>

#include "core/atomic_file.hpp"

namespace mgpu::io {
namespace {

[[noreturn]] void corrupt(std::filesystem::path const& path, std::uint64_t byte, std::string const& what) {
  throw Error(Errc::corrupt_data, path.string() + ":byte " + std::to_string(byte) + ": " + what);
}

std::uint32_t le32(unsigned char const* p) {
  return std::uint32_t{p[0]} | (std::uint32_t{p[1]} << 8) | (std::uint32_t{p[2]} << 16) | (std::uint32_t{p[3]} << 24);
}

void put_le32(std::vector<std::byte>& out, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xffu));
}

// The header's fields from index 2 on, with the names messages use.
constexpr std::array<char const*, 6> field_names{"maxT (block_size)", "V (vocab)",  "L (n_layer)",
                                                 "NH (n_head)",       "C (n_embd)", "Vp (padded vocab)"};
constexpr std::int64_t max_size = std::int64_t{1} << 24;

// The per-layer tensors in llm.c's order, by their PyTorch names after "h.<l>.".
constexpr std::array<char const*, 12> layer_tensors{
    "ln_1.weight", "ln_1.bias", "attn_qkv.weight", "attn_qkv.bias", "attn_proj.weight", "attn_proj.bias",
    "ln_2.weight", "ln_2.bias", "mlp_fc.weight",   "mlp_fc.bias",   "mlp_proj.weight",  "mlp_proj.bias"};

// Every parameter in llm.c's file order (wte first, padded rows not included).
std::vector<nn::GptParameter> file_order(nn::GptConfig const& config) {
  std::map<std::string, nn::GptParameter> by_name;
  for (auto& p : nn::gpt_parameters(config)) by_name.emplace(p.name, p);
  std::vector<nn::GptParameter> out{by_name.at("wte.weight"), by_name.at("wpe.weight")};
  for (char const* name : layer_tensors)
    for (std::int64_t l = 0; l < config.n_layer; ++l) out.push_back(by_name.at("h." + std::to_string(l) + "." + name));
  out.push_back(by_name.at("ln_f.weight"));
  out.push_back(by_name.at("ln_f.bias"));
  return out;
}

std::int64_t parameter_count(nn::GptConfig const& c) {
  std::int64_t n = 0;
  for (auto const& p : nn::gpt_parameters(c)) n += p.numel();
  return n;
}

}  // namespace

LlmcModel read_llmc_model(std::filesystem::path const& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw Error(Errc::io, "cannot open " + path.string() + " (expected a readable llm.c model file)");
  auto const size = static_cast<std::uint64_t>(in.tellg());
  in.seekg(0);
  std::array<unsigned char, llmc_header_bytes> header{};
  in.read(reinterpret_cast<char*>(header.data()),
          static_cast<std::streamsize>(std::min<std::uint64_t>(size, header.size())));
  if (!in) throw Error(Errc::io, "cannot read " + path.string() + " (expected a readable llm.c model file)");
  auto const field = [&](std::size_t i) { return static_cast<std::int32_t>(le32(header.data() + 4 * i)); };
  if (size >= 4 && field(0) != llmc_model_magic)
    corrupt(path, 0,
            "magic " + std::to_string(field(0)) + " (expected " + std::to_string(llmc_model_magic) +
                ": a GPT-2 model file as llm.c's train_gpt2 writes it)");
  if (size < llmc_header_bytes)
    corrupt(path, size,
            "truncated header: the file has " + std::to_string(size) + " bytes (expected at least " +
                std::to_string(llmc_header_bytes) + ", 256 int32)");
  if (field(1) != llmc_model_version)
    corrupt(path, 4,
            "version " + std::to_string(field(1)) + " (expected " + std::to_string(llmc_model_version) +
                ": float32 parameters)");
  std::array<std::int64_t, 6> v{};
  for (std::size_t i = 0; i < v.size(); ++i) {
    v[i] = field(i + 2);
    if (v[i] < 1 || v[i] > max_size)
      corrupt(path, 4 * (i + 2),
              std::string(field_names[i]) + " " + std::to_string(v[i]) + " (expected 1 to " + std::to_string(max_size) +
                  ")");
  }
  LlmcModel model;
  model.config = {.vocab = v[1], .block_size = v[0], .n_layer = v[2], .n_head = v[3], .n_embd = v[4]};
  model.padded_vocab = v[5];
  if (model.config.n_embd % model.config.n_head != 0)
    corrupt(path, 24,
            "C (n_embd) " + std::to_string(v[4]) + " is not a multiple of NH (n_head) " + std::to_string(v[3]) +
                " (expected heads of equal width)");
  if (model.padded_vocab < model.config.vocab)
    corrupt(path, 28,
            "Vp (padded vocab) " + std::to_string(v[5]) + " below V (vocab) " + std::to_string(v[1]) +
                " (expected Vp >= V)");
  // The count is exact in double up to 2^53; above 2^60 floats it cannot fit a file (nor an int64 count of bytes).
  double const c = static_cast<double>(v[4]);
  double const estimate = (static_cast<double>(v[5]) + static_cast<double>(v[0])) * c +
                          static_cast<double>(v[2]) * (12.0 * c * c + 13.0 * c) + 2.0 * c;
  std::uint64_t const body = size - llmc_header_bytes;
  if (estimate > 0x1.0p60)
    corrupt(path, size,
            "truncated: the header describes about " + std::to_string(estimate) + " float32 parameters from byte " +
                std::to_string(llmc_header_bytes) + ", the file ends after " + std::to_string(body) + " bytes");
  // As nn::gpt_parameters counts them (layer by layer: 2C + 3C^2 + 3C + C^2 + C + 2C + 4C^2 + 4C + 4C^2 + C),
  // without building its table before the size is known to fit.
  std::int64_t const count = (v[5] + v[0]) * v[4] + v[2] * (12 * v[4] * v[4] + 13 * v[4]) + 2 * v[4];
  auto const expected = 4 * static_cast<std::uint64_t>(count);
  if (body < expected)
    corrupt(path, size,
            "truncated: the header describes " + std::to_string(count) + " float32 parameters (" +
                std::to_string(expected) + " bytes from byte " + std::to_string(llmc_header_bytes) +
                "), the file ends after " + std::to_string(body));
  if (body > expected)
    corrupt(path, llmc_header_bytes + expected,
            std::to_string(body - expected) + " bytes after the " + std::to_string(count) +
                " parameters the header describes (expected the file to end here)");
  std::vector<unsigned char> bytes(expected);
  in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(expected));
  if (!in)
    throw Error(Errc::io,
                "cannot read " + path.string() + " (expected " + std::to_string(expected) + " bytes of parameters)");
  model.parameters.resize(
      static_cast<std::size_t>(count - (model.padded_vocab - model.config.vocab) * model.config.n_embd));
  std::size_t at = 0;  // in floats, from the end of the header
  auto const take = [&](std::int64_t n) {
    std::vector<float> values(static_cast<std::size_t>(n));
    for (float& x : values) x = std::bit_cast<float>(le32(bytes.data() + 4 * at++));
    return values;
  };
  for (auto const& p : file_order(model.config)) {
    nn::load_gpt_parameter(p, take(p.numel()), model.parameters);
    if (p.name == "wte.weight")
      at += static_cast<std::size_t>((model.padded_vocab - model.config.vocab) * model.config.n_embd);
  }
  return model;
}

LlmcModel read_llmc_model(std::filesystem::path const& path, nn::GptConfig const& expected) {
  LlmcModel model = read_llmc_model(path);
  std::array<std::int64_t, 5> const want{expected.block_size, expected.vocab, expected.n_layer, expected.n_head,
                                         expected.n_embd};
  std::array<std::int64_t, 5> const got{model.config.block_size, model.config.vocab, model.config.n_layer,
                                        model.config.n_head, model.config.n_embd};
  for (std::size_t i = 0; i < want.size(); ++i)
    if (want[i] != got[i])
      throw Error(Errc::invalid_argument, path.string() + ":byte " + std::to_string(4 * (i + 2)) + ": " +
                                              field_names[i] + " " + std::to_string(got[i]) + " (expected " +
                                              std::to_string(want[i]) + ", the model's)");
  return model;
}

void write_llmc_model(std::filesystem::path const& path, nn::GptConfig const& config, std::span<float const> parameters,
                      std::int64_t padded_vocab) {
  std::int64_t const vp = padded_vocab == 0 ? config.vocab : padded_vocab;
  std::int64_t const count = parameter_count(config);
  if (static_cast<std::int64_t>(parameters.size()) != count || vp < config.vocab)
    throw Error(Errc::invalid_argument, "write_llmc_model " + path.string() + ": " + std::to_string(parameters.size()) +
                                            " parameters, padded vocab " + std::to_string(vp) + " (expected " +
                                            std::to_string(count) +
                                            " parameters and a padded vocab >= " + std::to_string(config.vocab) + ")");
  std::vector<std::byte> out;
  out.reserve(llmc_header_bytes + 4 * static_cast<std::size_t>(count + (vp - config.vocab) * config.n_embd));
  std::array<std::int64_t, 8> const header{llmc_model_magic, llmc_model_version, config.block_size, config.vocab,
                                           config.n_layer,   config.n_head,      config.n_embd,     vp};
  for (std::size_t i = 0; i < 256; ++i) put_le32(out, i < header.size() ? static_cast<std::uint32_t>(header[i]) : 0u);
  for (auto const& p : file_order(config)) {
    for (float const x : nn::read_gpt_parameter(p, parameters)) put_le32(out, std::bit_cast<std::uint32_t>(x));
    if (p.name == "wte.weight")
      for (std::int64_t i = 0; i < (vp - config.vocab) * config.n_embd; ++i) put_le32(out, 0u);
  }
  detail::write_file_atomically(path, out);
}

nn::GptConfig load_llmc_into(nn::Sequential& model, std::filesystem::path const& path, Stream& stream) {
  if (!model.materialized())
    throw Error(Errc::invalid_argument, "load_llmc_into before materialize (expected a materialized nn::gpt model)");
  LlmcModel const file = read_llmc_model(path);
  // The layers with parameters, by name and size (Dropout layers come and go with the dropout,
  // which the file does not hold).
  auto const with_parameters = [](nn::Sequential const& m) {
    std::vector<std::pair<std::string, std::int64_t>> layers;
    for (std::size_t l = 0; l < m.size(); ++l)
      if (m.layer(l).parameter_count() > 0) layers.emplace_back(m.layer(l).name(), m.layer(l).parameter_count());
    return layers;
  };
  auto const want = with_parameters(nn::gpt(file.config));
  auto const have = with_parameters(model);
  for (std::size_t i = 0; i < std::max(want.size(), have.size()); ++i) {
    if (i < want.size() && i < have.size() && want[i] == have[i]) continue;
    auto const describe = [](auto const& list, std::size_t at) {
      return at < list.size() ? list[at].first + " of " + std::to_string(list[at].second) + " parameters" : std::string("no layer");
    };
    throw Error(Errc::invalid_argument, path.string() + ": layer " + std::to_string(i) + " with parameters of the model is " +
                                            describe(have, i) + " (expected " + describe(want, i) +
                                            ", as gpt() of the file's config)");
  }
  auto const allocator = Allocator::create({DeviceKind::host, 0});
  Tensor const host = Tensor::empty({static_cast<std::int64_t>(file.parameters.size())}, DType::float32, *allocator);
  std::copy(file.parameters.begin(), file.parameters.end(), host.host_span<float>().begin());
  copy_async(model.master_parameters(), host, stream);
  model.sync_parameters(stream);
  stream.synchronize();
  return file.config;
}

}  // namespace mgpu::io
