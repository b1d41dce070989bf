// The boxes of the whole model's named tensors that a tensor-parallel shard holds: what each rank
// writes of a checkpoint folder and reads back. Guide: docs/checkpoints.md.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <mgpu/io/sharded_checkpoint.hpp>
#include <mgpu/nn/layers.hpp>

namespace mgpu::parallel {

/// A box of one of the whole model's tensors that a shard holds.
struct ShardBox {
  std::string tensor;         ///< its name in the whole model (nn::Sequential::tensors)
  Shape shape;                ///< the tensor's whole shape as the flat buffer holds it (a Linear weight [in, out])
  std::int64_t offset = 0;    ///< the tensor's first element in the whole model's flat buffer
  io::Box box;                ///< within `shape`
  bool whole = false;         ///< the shard holds the whole tensor (every rank does: replicated)
  /// For each element of the box, row-major: its index in the shard's flat parameter buffer.
  std::vector<std::int64_t> at;
};

/// Every box of `whole`'s tensors (nn::Sequential::tensors) that `shard` (a TensorParallel rank's
/// model: its layers match whole's, ShardedLayers hold parts) holds, in the flat buffer's order.
/// What a ShardedLayer holds is read off its copy_shard. Neither model need be materialized.
/// Throws Error(invalid_argument) when the shard's layers do not match whole's.
[[nodiscard]] std::vector<ShardBox> shard_boxes(nn::Sequential const& whole, nn::Sequential const& shard);

/// `whole`'s named tensors laid end to end (put_layout's list), each as "<record>/<name>".
[[nodiscard]] std::vector<std::pair<std::string, std::int64_t>> tensor_layout(nn::Sequential const& whole, std::string const& record);

}  // namespace mgpu::parallel
