// llm.c's GPT-2 model file (float32 version 3) to and from nn::gpt's flat parameter buffer. The
// format: docs/checkpoints.md, "llm.c model files".
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <vector>

#include <mgpu/core/stream.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/layers.hpp>

namespace mgpu::io {

inline constexpr std::int32_t llmc_model_magic = 20240326;
/// The float32 version (llm.c's version 5 holds bfloat16 and is not read).
inline constexpr std::int32_t llmc_model_version = 3;
inline constexpr std::size_t llmc_header_bytes = 256 * 4;

struct LlmcModel {
  /// block_size = maxT, vocab = V, n_layer, n_head, n_embd from the header (dropout 0, bias true).
  nn::GptConfig config;
  /// Vp, the padded vocabulary of the file.
  std::int64_t padded_vocab = 0;
  /// The parameters in gpt(config)'s flat buffer layout (see nn::gpt_parameters).
  std::vector<float> parameters;
};

/// Reads and verifies an llm.c model file; any thread. Throws Error(io) when it cannot be read, and
/// Error(corrupt_data) naming the file and byte offset for a short file, a bad magic or version, a
/// header size < 1 or > 2^24, n_head not dividing n_embd, Vp < V, or a size the header disagrees with.
LlmcModel read_llmc_model(std::filesystem::path const& path);
/// The same, checking the header against `expected` (all but dropout): a mismatch throws
/// Error(invalid_argument) naming the file, the field, its offset and both values.
LlmcModel read_llmc_model(std::filesystem::path const& path, nn::GptConfig const& expected);

/// Reads the file into `model`, a materialized nn::gpt of its architecture (any dropout, device,
/// compute type), on `stream`, which it synchronizes; returns the file's config. Throws as
/// read_llmc_model, or Error(invalid_argument) naming the first layer that differs, changing nothing.
nn::GptConfig load_llmc_into(nn::Sequential& model, std::filesystem::path const& path, Stream& stream);

/// Writes `parameters` (gpt(config)'s flat float32 layout) as an llm.c file, atomically, with Vp =
/// padded_vocab (0: V). Throws Error(invalid_argument) for a size mismatch or Vp < V, Error(io).
void write_llmc_model(std::filesystem::path const& path, nn::GptConfig const& config, std::span<float const> parameters,
                      std::int64_t padded_vocab = 0);

}  // namespace mgpu::io
