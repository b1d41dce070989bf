// The boxes of the whole model's named tensors that a tensor-parallel shard or a pipeline chunk
// holds: what each rank writes of a checkpoint folder and reads back. Guide: docs/checkpoints.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <mgpu/core/stream.hpp>
#include <mgpu/io/checkpoint.hpp>
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
  /// A tied LM head's copy of wte rows: read into the shard, written by the embedding's holder only.
  bool copy = false;
  /// For each row of the box (one for a 1-D tensor): the index in the shard's flat parameter buffer
  /// of its first element; a row's box.lengths.back() elements follow one another there.
  std::vector<std::int64_t> rows;
};

/// Every box of `whole`'s tensors that `shard` (a TensorParallel rank's model, its layers matching
/// whole's in order) holds, in the flat buffer's order, read off the ShardedLayers' copy_shard.
/// Throws Error(invalid_argument) when the shard's layers do not match whole's.
[[nodiscard]] std::vector<ShardBox> shard_boxes(nn::Sequential const& whole, nn::Sequential const& shard);

/// The same for a part of the whole model (a pipeline chunk): `origins[j]` is the index in `whole`
/// of shard layer j's origin (parallelize's origins). A tied LM head's copy of wte rows is a `copy`
/// box. Throws Error(invalid_argument) for origins of another length, a layer whose origin's
/// parameters do not match, or two layers with parameters of one origin.
[[nodiscard]] std::vector<ShardBox> shard_boxes(nn::Sequential const& whole, nn::Sequential const& shard,
                                                std::span<std::size_t const> origins);

/// `whole`'s named tensors laid end to end (put_layout's list), each as "<record>/<name>".
[[nodiscard]] std::vector<std::pair<std::string, std::int64_t>> tensor_layout(nn::Sequential const& whole, std::string const& record);

/// Box `b`'s elements of a shard's flat buffer `shard`, row-major.
[[nodiscard]] std::vector<float> box_values(ShardBox const& b, std::span<float const> shard);

/// Throws unless record `name` (split in `folder`, or whole in `records`) holds a float32 value
/// per parameter of a model of `total`: Error(corrupt_data) naming `source` and a missing record,
/// Error(invalid_argument) naming its shape.
void check_model_record(io::ShardedCheckpoint const& folder, io::Checkpoint const& records, std::string const& name,
                        std::int64_t total, std::string const& source);

/// Reads box `b` of the float32 record `name` (a value per parameter of the whole model: split in
/// `folder`'s boxes, ranges or layout, or whole in `records`) into a shard's flat buffer `into`,
/// reading only what overlaps the box. Throws as ShardedCheckpoint::read_view does.
void read_box_into(io::ShardedCheckpoint const& folder, io::Checkpoint const& records, std::string const& name,
                   ShardBox const& b, std::span<float> into, Stream& stream);

}  // namespace mgpu::parallel
