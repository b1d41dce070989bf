// nn::gpt and the PyTorch names of its parameters.
#include <cmath>
#include <memory>
#include <string>

#include <mgpu/core/error.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/transformer.hpp>

namespace mgpu::nn {
namespace {

void check_config(GptConfig const& c) {
  std::string const text = "GptConfig{vocab " + std::to_string(c.vocab) + ", block_size " +
                           std::to_string(c.block_size) + ", n_layer " + std::to_string(c.n_layer) + ", n_head " +
                           std::to_string(c.n_head) + ", n_embd " + std::to_string(c.n_embd) + ", dropout " +
                           std::to_string(c.dropout) + "}";
  if (c.vocab < 1 || c.block_size < 1 || c.n_layer < 1 || c.n_head < 1 || c.n_embd < 1 || c.n_embd % c.n_head != 0)
    throw Error(Errc::invalid_argument, text + " (expected sizes >= 1 and n_head dividing n_embd)");
  if (!(c.dropout >= 0.0f && c.dropout < 1.0f))
    throw Error(Errc::invalid_argument, text + " (expected 0 <= dropout < 1)");
  if (!c.bias)
    throw Error(Errc::invalid_argument,
                text + " with bias false (expected bias true: Linear and LayerNorm layers always have a bias)");
}

}  // namespace

Sequential gpt(GptConfig const& config) {
  check_config(config);
  float const proj_std = 0.02f / std::sqrt(2.0f * static_cast<float>(config.n_layer));
  Sequential model;
  model.add(std::make_unique<Embedding>(config.vocab, config.block_size, config.n_embd));
  model.add(std::make_unique<Dropout>(config.dropout));
  for (std::int64_t l = 0; l < config.n_layer; ++l)
    model.add(
        std::make_unique<TransformerBlock>(config.n_embd, config.n_head, config.dropout, proj_std, config.recompute));
  model.add(std::make_unique<LayerNorm>(config.n_embd));
  model.add(std::make_unique<TiedLMHead>(config.vocab, config.n_embd));
  return model;
}

std::int64_t GptParameter::numel() const noexcept {
  std::int64_t n = 1;
  for (std::int64_t const d : shape) n *= d;
  return n;
}

std::vector<GptParameter> gpt_parameters(GptConfig const& config) {
  check_config(config);
  std::int64_t const c = config.n_embd;
  std::vector<GptParameter> out;
  std::int64_t offset = 0;
  auto const add = [&](std::string name, Shape shape, bool transposed = false) {
    GptParameter p{std::move(name), std::move(shape), offset, transposed};
    offset += p.numel();
    out.push_back(std::move(p));
  };
  add("wte.weight", {config.vocab, c});
  add("wpe.weight", {config.block_size, c});
  for (std::int64_t l = 0; l < config.n_layer; ++l) {
    std::string const h = "h." + std::to_string(l) + ".";
    add(h + "ln_1.weight", {c});
    add(h + "ln_1.bias", {c});
    add(h + "attn_qkv.weight", {3 * c, c}, true);
    add(h + "attn_qkv.bias", {3 * c});
    add(h + "attn_proj.weight", {c, c}, true);
    add(h + "attn_proj.bias", {c});
    add(h + "ln_2.weight", {c});
    add(h + "ln_2.bias", {c});
    add(h + "mlp_fc.weight", {4 * c, c}, true);
    add(h + "mlp_fc.bias", {4 * c});
    add(h + "mlp_proj.weight", {c, 4 * c}, true);
    add(h + "mlp_proj.bias", {c});
  }
  add("ln_f.weight", {c});
  add("ln_f.bias", {c});
  return out;
}

std::vector<std::pair<std::int64_t, std::int64_t>> gpt_decay_ranges(GptConfig const& config) {
  return gpt(config).matrix_ranges();
}

void load_gpt_parameter(GptParameter const& p, std::span<float const> values, std::span<float> flat) {
  auto const n = static_cast<std::size_t>(p.numel());
  if (values.size() != n || flat.size() < static_cast<std::size_t>(p.offset) + n)
    throw Error(Errc::invalid_argument, "load_gpt_parameter " + p.name + ": " + std::to_string(values.size()) +
                                            " values into a buffer of " + std::to_string(flat.size()) + " (expected " +
                                            std::to_string(n) + " values at offset " + std::to_string(p.offset) + ")");
  float* dst = flat.data() + p.offset;
  if (!p.transposed) {
    std::copy(values.begin(), values.end(), dst);
    return;
  }
  std::int64_t const rows = p.shape[0], cols = p.shape[1];  // PyTorch (out, in); the buffer holds [in, out]
  for (std::int64_t o = 0; o < rows; ++o)
    for (std::int64_t i = 0; i < cols; ++i) dst[i * rows + o] = values[static_cast<std::size_t>(o * cols + i)];
}

std::vector<float> read_gpt_parameter(GptParameter const& p, std::span<float const> flat) {
  auto const n = static_cast<std::size_t>(p.numel());
  if (flat.size() < static_cast<std::size_t>(p.offset) + n)
    throw Error(Errc::invalid_argument, "read_gpt_parameter " + p.name + ": a buffer of " +
                                            std::to_string(flat.size()) + " (expected at least " +
                                            std::to_string(static_cast<std::size_t>(p.offset) + n) + " elements)");
  float const* src = flat.data() + p.offset;
  std::vector<float> values(n);
  if (!p.transposed) {
    std::copy(src, src + n, values.begin());
    return values;
  }
  std::int64_t const rows = p.shape[0], cols = p.shape[1];
  for (std::int64_t o = 0; o < rows; ++o)
    for (std::int64_t i = 0; i < cols; ++i) values[static_cast<std::size_t>(o * cols + i)] = src[i * rows + o];
  return values;
}

}  // namespace mgpu::nn
