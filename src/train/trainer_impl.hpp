// The Trainer's state, shared by its construction (build.cpp) and its operations (trainer.cpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <mgpu/core/stream.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/train/trainer.hpp>

namespace mgpu::train {

// ParallelConfig::bucket_cap_bytes on the bucket caps of `o` (DataParallelOptions,
// TensorParallelOptions, parallel::GptLayout): when set, the cap, and the first bucket's no larger;
// 0 keeps o's defaults.
template <class Options>
void cap_buckets(Options& o, std::size_t cap) {
  if (cap == 0) return;
  o.bucket_cap_bytes = cap;
  o.first_bucket_cap_bytes = std::min(o.first_bucket_cap_bytes, cap);
}

struct Trainer::Impl {
  nn::GptConfig config;
  ParallelConfig parallel;
  TrainerOptions options;
  std::shared_ptr<parallel::Mesh> mesh;  // the devices as placed, and every communicator
  DeviceGroup& group;                     // the mesh's
  dist::World world;
  bool across = false;
  Layout layout;
  std::shared_ptr<metrics::Registry> metrics;
  std::vector<ChunkInfo> chunks;

  // The one model (a pipeline's whole float32 copy, the shards' gathered copy; moved into data
  // parallelism's replicas) on the first device, with its allocator, stream and optimizer.
  std::shared_ptr<Allocator> allocator;
  std::unique_ptr<Stream> stream;
  std::unique_ptr<nn::Context> ctx;
  std::optional<nn::Sequential> model;
  std::unique_ptr<optim::AdamW> optimizer;
  std::optional<optim::LossScaler> scaler;  // one device's
  nn::TokenCrossEntropy loss{};

  std::unique_ptr<parallel::DataParallel> data_parallel;
  std::unique_ptr<pipeline::Executor> pipeline;
  std::unique_ptr<parallel::TensorParallel> tensor;
  parallel::DataParallelResult last_dp{};
  // Across processes with data parallelism: each process's share of a batch's rows (its devices'
  // speeds).
  std::vector<double> process_weights;
  // What evaluation and the whole-model access read: the model, or data parallelism's replica 0.
  nn::Sequential* net = nullptr;
  std::unique_ptr<nn::Context> net_ctx;

  // The config validated and its mesh built over `group` (across processes with
  // options.across_processes), or the config validated against a user's mesh; then Impl.
  static std::unique_ptr<Impl> over_group(nn::GptConfig const& config, DeviceGroup group, ParallelConfig parallel,
                                          TrainerOptions options);
  static std::unique_ptr<Impl> over_mesh(nn::GptConfig const& config, std::shared_ptr<parallel::Mesh> mesh,
                                         ParallelConfig parallel, TrainerOptions options);
  Impl(nn::GptConfig const& config, std::shared_ptr<parallel::Mesh> mesh, dist::World world, ParallelConfig parallel,
       TrainerOptions options);
  // What every executor's options take alike: the seed, compute type, clip, loss scaler, metrics,
  // timeline and mesh.
  template <class Options>
  void set_common(Options& o) const;
  void build_data_parallel(optim::AdamWOptions const& adamw);
  void build_pipeline(optim::AdamWOptions const& adamw);
  void build_tensor_parallel(optim::AdamWOptions const& adamw);
  [[nodiscard]] Tensor on_device(Tensor const& host) const;
};

}  // namespace mgpu::train
