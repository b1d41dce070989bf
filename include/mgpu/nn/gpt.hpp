// A GPT-2-style language model as a Sequential, and its parameters under PyTorch's names.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <mgpu/core/tensor.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/nn/transformer.hpp>

namespace mgpu::nn {

/// The shape of a GPT. `bias` must be true. `recompute` changes memory and time, never results.
struct GptConfig {
  std::int64_t vocab = 256;
  std::int64_t block_size = 64;
  std::int64_t n_layer = 4;
  std::int64_t n_head = 4;
  std::int64_t n_embd = 128;
  float dropout = 0.0f;
  bool bias = true;
  Recompute recompute = Recompute::none;
};

/// The model: Embedding, Dropout, n_layer TransformerBlocks, LayerNorm and a TiedLMHead; ids int32
/// [B, T <= block_size] -> logits [B, T, vocab], GPT-2 initialisation. Throws
/// Error(invalid_argument) for a size < 1, n_head not dividing n_embd, dropout outside [0, 1) or
/// bias false.
[[nodiscard]] Sequential gpt(GptConfig const& config);

/// One parameter of a GPT: its PyTorch name and shape, its offset in the flat buffer, and whether
/// the buffer holds it transposed (a Linear weight, stored [in, out]).
struct GptParameter {
  std::string name;
  Shape shape;
  std::int64_t offset = 0;
  bool transposed = false;
  [[nodiscard]] std::int64_t numel() const noexcept;
};

/// Every parameter of gpt(config), in PyTorch's named_parameters() order (the tied LM head is
/// wte.weight).
[[nodiscard]] std::vector<GptParameter> gpt_parameters(GptConfig const& config);

/// The merged [begin, end) ranges of gpt(config)'s 2-D parameters in the flat buffer (AdamW's
/// decay_ranges): gpt(config).matrix_ranges().
[[nodiscard]] std::vector<std::pair<std::int64_t, std::int64_t>> gpt_decay_ranges(GptConfig const& config);

/// Writes `values`, laid out as PyTorch holds the parameter, into its place in `flat` (a model's
/// float32 host parameter or gradient buffer). Throws Error(invalid_argument) on a size mismatch.
void load_gpt_parameter(GptParameter const& parameter, std::span<float const> values, std::span<float> flat);
/// The parameter's elements from `flat`, laid out as PyTorch holds them.
[[nodiscard]] std::vector<float> read_gpt_parameter(GptParameter const& parameter, std::span<float const> flat);

}  // namespace mgpu::nn
