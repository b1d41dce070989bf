// A GPT-2-style language model as a Sequential, and where each of its parameters (by the names a
// PyTorch GPT uses) lies in the model's flat parameter buffer, for loading weights written by
// PyTorch (and comparing gradients with it).
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

/// The shape of a GPT. `bias` must be true: Linear and LayerNorm always carry a bias here.
/// `recompute`: what each TransformerBlock keeps for backward (see Recompute); it changes memory
/// and time, never the results.
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

/// The model: Embedding (token + position), Dropout, n_layer TransformerBlocks, the final
/// LayerNorm and a TiedLMHead; ids int32 [B, T] (T <= block_size) -> logits [B, T, vocab].
/// GPT-2 initialisation: weights N(0, 0.02), the residual projections N(0, 0.02 / sqrt(2 n_layer)),
/// biases 0, LayerNorm 1 and 0. Throws Error(invalid_argument) for a size < 1, n_head not dividing
/// n_embd, dropout outside [0, 1) or bias false.
[[nodiscard]] Sequential gpt(GptConfig const& config);

/// One parameter tensor of a GPT under its PyTorch name: its PyTorch shape (Linear weights are
/// (out, in)), and where its elements start in the flat buffer. `transposed`: the buffer holds it
/// transposed (a Linear weight, stored [in, out]).
struct GptParameter {
  std::string name;
  Shape shape;
  std::int64_t offset = 0;
  bool transposed = false;
  [[nodiscard]] std::int64_t numel() const noexcept;
};

/// Every parameter of gpt(config), in PyTorch's named_parameters() order: wte.weight, wpe.weight,
/// then per layer l h.l.ln_1.weight, h.l.ln_1.bias, h.l.attn_qkv.weight, h.l.attn_qkv.bias,
/// h.l.attn_proj.weight, h.l.attn_proj.bias, h.l.ln_2.weight, h.l.ln_2.bias, h.l.mlp_fc.weight,
/// h.l.mlp_fc.bias, h.l.mlp_proj.weight, h.l.mlp_proj.bias; then ln_f.weight, ln_f.bias. The tied
/// LM head has no entry of its own (it is wte.weight).
[[nodiscard]] std::vector<GptParameter> gpt_parameters(GptConfig const& config);

/// The [begin, end) ranges of the flat buffer holding gpt(config)'s 2-D parameters (wte, wpe and the
/// Linear weights), adjacent ones merged: AdamW's decay_ranges for weight decay on those only, as
/// nanoGPT and the PyTorch peer do (biases and LayerNorm parameters get none; the embeddings do):
/// gpt(config).matrix_ranges(). A pipeline stage's are its own Sequential::matrix_ranges().
[[nodiscard]] std::vector<std::pair<std::int64_t, std::int64_t>> gpt_decay_ranges(GptConfig const& config);

/// Writes `values`, laid out as PyTorch holds the parameter, into its place in `flat` (a model's
/// float32 host parameter or gradient buffer). Throws Error(invalid_argument) on a size mismatch.
void load_gpt_parameter(GptParameter const& parameter, std::span<float const> values, std::span<float> flat);
/// The parameter's elements from `flat`, laid out as PyTorch holds them.
[[nodiscard]] std::vector<float> read_gpt_parameter(GptParameter const& parameter, std::span<float const> flat);

}  // namespace mgpu::nn
