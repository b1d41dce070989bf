// The boxes of the whole model's named tensors that a tensor-parallel shard holds: what each rank
// writes of a checkpoint folder and reads back. Guide: docs/checkpoints.md.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <mgpu/io/sharded_checkpoint.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/layers.hpp>

namespace mgpu::parallel {

/// A box of one of gpt(config)'s tensors that a shard holds.
struct ShardBox {
  std::string tensor;         ///< gpt_parameters' name
  Shape shape;                ///< the tensor's whole shape as the flat buffer holds it (a Linear weight [in, out])
  std::int64_t offset = 0;    ///< the tensor's first element in gpt(config)'s flat buffer
  io::Box box;                ///< within `shape`
  bool whole = false;         ///< the shard holds the whole tensor (every rank does: replicated)
  /// For each element of the box, row-major: its index in the shard's flat parameter buffer.
  std::vector<std::int64_t> at;
};

/// Every box of gpt(config)'s tensors that `shard` (a TensorParallel rank's model: its layers
/// match gpt(config)'s, ShardedLayers hold parts) holds, in the flat buffer's order. What a
/// ShardedLayer holds is read off its copy_shard. Throws Error(invalid_argument) when the shard's
/// layers do not match, or gpt_parameters does not lay the tensors end to end.
[[nodiscard]] std::vector<ShardBox> shard_boxes(nn::GptConfig const& config, nn::Sequential const& shard);

/// The named tensors laid end to end (put_layout's list), each as "<record>/<name>".
[[nodiscard]] std::vector<std::pair<std::string, std::int64_t>> tensor_layout(nn::GptConfig const& config, std::string const& record);

}  // namespace mgpu::parallel
