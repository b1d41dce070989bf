// llm.c's GPT-2 model file (train_gpt2.c's checkpoint, float32 version 3), read into and written
// from the flat parameter buffer of nn::gpt, so weights move between llm.c, a PyTorch export and
// this library.
//
// Format (little-endian): a header of 256 int32 [20240326, 3, maxT, V, L, NH, C, Vp, 0...], then
// float32 tensors in llm.c's order, layers stacked: wte (Vp, C), wpe (maxT, C), ln1w (L, C), ln1b
// (L, C), qkvw (L, 3C, C), qkvb (L, 3C), attprojw (L, C, C), attprojb (L, C), ln2w (L, C), ln2b
// (L, C), fcw (L, 4C, C), fcb (L, 4C), fcprojw (L, C, 4C), fcprojb (L, C), lnfw (C), lnfb (C).
// Linear weights are (out, in) as in PyTorch. The vocabulary is padded to Vp >= V rows: rows V to
// Vp - 1 of wte are ignored on reading and written as zeros.
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

/// Reads and verifies an llm.c model file. Throws Error(io) when it cannot be read and
/// Error(corrupt_data) naming the file and the byte offset for: a file shorter than the header, a
/// bad magic or version, a header size < 1 (or above 2^24), n_head not dividing n_embd, Vp < V, or
/// a file size other than the header plus the parameters the header describes (truncated or
/// trailing bytes). Safe to call from any thread.
LlmcModel read_llmc_model(std::filesystem::path const& path);
/// The same, also checking the header against `expected` (vocab, block_size, n_layer, n_head and
/// n_embd; dropout is not in the file): a mismatch throws Error(invalid_argument) naming the file,
/// the field, its byte offset and both values.
LlmcModel read_llmc_model(std::filesystem::path const& path, nn::GptConfig const& expected);

/// Reads the llm.c model file at `path` into `model`, a materialized nn::gpt of the file's
/// architecture (any dropout, device and compute type), in one call: its float32 master parameters
/// and their compute-type copy, ordered on `stream`, which it synchronizes. Returns the file's
/// config. Throws as read_llmc_model, and Error(invalid_argument) naming the first layer that
/// differs for a model that is not gpt(the file's config) (its layers with parameters compared by
/// name and size), changing nothing.
nn::GptConfig load_llmc_into(nn::Sequential& model, std::filesystem::path const& path, Stream& stream);

/// Writes `parameters` (gpt(config)'s flat float32 layout, parameter_count elements) as an llm.c
/// model file at `path`, atomically, with Vp = padded_vocab (0: V; otherwise >= V). Throws
/// Error(invalid_argument) for a size mismatch or Vp < V, Error(io) when the file cannot be written.
void write_llmc_model(std::filesystem::path const& path, nn::GptConfig const& config, std::span<float const> parameters,
                      std::int64_t padded_vocab = 0);

}  // namespace mgpu::io
