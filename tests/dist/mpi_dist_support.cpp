// What mgpu_mpi_dist's executor modes share (declared, with what each does, in mpi_dist.hpp).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>

#include <mgpu/optim/optim.hpp>

#include "mpi_dist.hpp"

namespace mpi_dist {

mgpu::nn::Sequential dp_model(bool dropout) {
  mgpu::nn::Sequential model;
  model.add(std::make_unique<mgpu::nn::Linear>(6, 16));
  model.add(std::make_unique<mgpu::nn::ReLU>());
  if (dropout) model.add(std::make_unique<mgpu::nn::Dropout>(0.25f));
  model.add(std::make_unique<mgpu::nn::Linear>(16, 12));
  model.add(std::make_unique<mgpu::nn::ReLU>());
  model.add(std::make_unique<mgpu::nn::Linear>(12, 4));
  return model;
}

Tensor with_last_id(Tensor const& ids, std::int32_t value) {
  std::shared_ptr<mgpu::Allocator> const host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  Tensor copy = Tensor::empty(ids.shape(), DType::int32, *host);
  std::copy(ids.host_span<std::int32_t>().begin(), ids.host_span<std::int32_t>().end(), copy.host_span<std::int32_t>().begin());
  copy.host_span<std::int32_t>().back() = value;
  return copy;
}

std::vector<float> host_values(Tensor const& t, mgpu::Stream& stream) {
  std::shared_ptr<mgpu::Allocator> const host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  Tensor const copy = Tensor::empty(t.shape(), t.dtype(), *host);
  mgpu::copy_async(copy, t, stream);
  stream.synchronize();
  auto const span = copy.host_span<float>();
  return {span.begin(), span.end()};
}

TokenBatches token_batches(int count, std::int64_t rows, unsigned vocab, unsigned seed) {
  std::shared_ptr<mgpu::Allocator> const host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  std::mt19937 rng(seed);
  TokenBatches out;
  for (int b = 0; b < count; ++b) {
    for (auto* list : {&out.xs, &out.ys}) {
      list->push_back(Tensor::empty({rows, 8}, DType::int32, *host));
      for (std::int32_t& v : list->back().host_span<std::int32_t>()) v = static_cast<std::int32_t>(rng() % vocab);
    }
  }
  return out;
}

Gathered gather_both(mgpu::pipeline::Executor& executor, mgpu::pipeline::Executor& reference, mgpu::nn::Sequential const& model) {
  std::shared_ptr<mgpu::Allocator> const host = mgpu::Allocator::create({mgpu::DeviceKind::host, 0});
  mgpu::Stream stream{mgpu::Device{mgpu::DeviceKind::host, 0}};
  mgpu::nn::Sequential whole = model.clone(), whole_reference = model.clone();
  mgpu::nn::Context ctx{*host, stream};
  whole.materialize(ctx, 1);
  whole_reference.materialize(ctx, 2);
  executor.gather_parameters(whole, stream);
  reference.gather_parameters(whole_reference, stream);
  return {host_values(whole.master_parameters(), stream), host_values(whole_reference.master_parameters(), stream)};
}

mgpu::pipeline::ChunkOptimizerFactory const chunk_adamw = [](mgpu::nn::Sequential const& chunk) {
  return std::make_unique<mgpu::optim::AdamW>(
      mgpu::optim::AdamWOptions{.lr = 0.01f, .weight_decay = 0.1f, .decay_ranges = chunk.matrix_ranges()});
};

bool same_bits(std::vector<float> const& have, std::vector<float> const& want) {
  return have.size() == want.size() &&
         (have.empty() || std::memcmp(have.data(), want.data(), have.size() * sizeof(float)) == 0);
}

bool close_to(std::vector<float> const& have, std::vector<float> const& want, double tolerance) {
  if (tolerance == 0) return same_bits(have, want);
  if (have.size() != want.size()) return false;
  for (std::size_t i = 0; i < have.size(); ++i)
    if (!(std::abs(static_cast<double>(have[i]) - want[i]) <= tolerance * (1 + std::abs(want[i])))) return false;
  return true;
}

double worst_difference(std::vector<float> const& have, std::vector<float> const& want) {
  if (have.size() != want.size()) return std::numeric_limits<double>::infinity();
  double worst = 0;
  for (std::size_t i = 0; i < have.size(); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(have[i]) - want[i]) / (1 + std::abs(want[i])));
  return worst;
}

}  // namespace mpi_dist
