// The pipeline's chunks: tensor-parallel stages cut from a whole model split by styles, a
// tensor-parallel chunk's shard, and the LM head tied to the token embedding across chunks.
#include <mgpu/pipeline/pipeline.hpp>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <mgpu/core/error.hpp>
#include <mgpu/nn/transformer.hpp>
#include <mgpu/parallel/tensor_parallel.hpp>

#include "pipeline/executor_impl.hpp"

namespace mgpu::pipeline {

TensorParallelStages tensor_parallel_stages(nn::Sequential const& whole, parallel::TensorParallelPlan plan, int ranks,
                                            parallel::MakeLoss loss) {
  if (ranks < 1)
    throw Error(Errc::invalid_argument,
                "tensor_parallel_stages: " + std::to_string(ranks) + " tensor-parallel ranks (expected >= 1)");
  if (!loss) loss = parallel::vocab_parallel_loss(whole, "tensor_parallel_stages");
  bool const sequence_parallel = plan.sequence_parallel;
  // Rank `rank`'s shard of the whole model and the whole model's layer of each of its layers, and
  // the shard's layers [first, last) made from the whole model's [begin, end).
  struct Cut {
    nn::Sequential shard;
    std::vector<std::size_t> origins;
    std::size_t first = 0, last = 0;
  };
  auto const cut = [model = std::make_shared<nn::Sequential const>(whole.clone()), plan = std::move(plan)](
                       std::shared_ptr<comm::Communicator> const& comm, int rank, std::size_t begin, std::size_t end) {
    Cut out;
    out.shard = parallel::parallelize(*model, plan, comm, rank, &out.origins);
    out.first = static_cast<std::size_t>(std::lower_bound(out.origins.begin(), out.origins.end(), begin) - out.origins.begin());
    out.last = static_cast<std::size_t>(std::lower_bound(out.origins.begin(), out.origins.end(), end) - out.origins.begin());
    return out;
  };
  return {ranks,
          [cut](std::shared_ptr<comm::Communicator> const& comm, int rank, std::size_t begin, std::size_t end) {
            Cut const c = cut(comm, rank, begin, end);
            return c.shard.stage(c.first, c.last);
          },
          [loss = std::move(loss)](std::shared_ptr<comm::Communicator> const& comm, int rank) {
            return std::shared_ptr<nn::Loss const>(loss(comm, rank));
          },
          sequence_parallel,
          [cut](std::shared_ptr<comm::Communicator> const& comm, int rank, std::size_t begin, std::size_t end) {
            Cut const c = cut(comm, rank, begin, end);
            return std::vector<std::size_t>(c.origins.begin() + static_cast<std::ptrdiff_t>(c.first),
                                            c.origins.begin() + static_cast<std::ptrdiff_t>(c.last));
          }};
}

std::optional<Executor::Impl::Tie> Executor::Impl::find_tie(std::vector<nn::Sequential> const& pipeline_chunks) {
  auto const layer_offset = [](nn::Sequential const& chunk, std::size_t layer) {
    std::int64_t offset = 0;
    for (std::size_t i = 0; i < layer; ++i) offset += chunk.layer(i).parameter_count();
    return offset;
  };
  std::optional<Tie> tie;
  for (std::size_t h = 0; h < pipeline_chunks.size(); ++h) {
    nn::Sequential const& chunk = pipeline_chunks[h];
    for (std::size_t i = 0; i < chunk.size(); ++i) {
      auto const* head = dynamic_cast<nn::TiedLMHead const*>(&chunk.layer(i));
      auto const* split = dynamic_cast<parallel::VocabParallelLMHead const*>(&chunk.layer(i));
      if (!(head != nullptr && head->holds_weight()) && !(split != nullptr && split->holds_weight())) continue;
      if (tie)
        throw Error(Errc::invalid_argument, "a pipeline with two LM heads holding a copy of wte (expected at most one tied head)");
      // Whether `layer` is the embedding whose wte (rows) the head copies.
      auto const ties = [&](nn::Layer const& layer) {
        if (head != nullptr) {
          auto const* embedding = dynamic_cast<nn::Embedding const*>(&layer);
          return embedding != nullptr && embedding->vocab() == head->vocab() && embedding->features() == head->features();
        }
        auto const* embedding = dynamic_cast<parallel::VocabParallelEmbedding const*>(&layer);
        return embedding != nullptr && embedding->vocab_begin() == split->vocab_begin() &&
               embedding->vocab_end() == split->vocab_end() && embedding->features() == split->features();
      };
      for (std::size_t e = 0; e < pipeline_chunks.size() && !tie; ++e) {
        nn::Sequential const& other = pipeline_chunks[e];
        for (std::size_t j = 0; j < other.size(); ++j) {
          if (!ties(other.layer(j))) continue;
          tie = Tie{static_cast<int>(e), static_cast<int>(h), layer_offset(other, j), layer_offset(chunk, i), chunk.layer(i).parameter_count()};
          break;
        }
      }
      if (!tie)
        throw Error(Errc::invalid_argument, chunk.layer(i).name() + " in pipeline chunk " + std::to_string(h) +
                                                " without its token embedding in any chunk (expected the embedding it is tied to)");
    }
  }
  return tie;
}

nn::Sequential Executor::Impl::tensor_parallel_chunk(int r, std::size_t c) const {
  auto const chunks = static_cast<std::size_t>(schedule.chunks());
  nn::Sequential part =
      options.tensor_parallel.stage(tp_comms[static_cast<std::size_t>(data_index(r)) * chunks + c], tp_index(r), cuts[c], cuts[c + 1]);
  bool embedded = false;
  for (std::size_t i = 0; i < part.size(); ++i)
    embedded = embedded || dynamic_cast<parallel::VocabParallelEmbedding const*>(&part.layer(i)) != nullptr;
  for (std::size_t i = 0; i < part.size() && !embedded; ++i)
    if (auto* head = dynamic_cast<parallel::VocabParallelLMHead*>(&part.layer(i))) head->hold_weight();
  return part;
}

}  // namespace mgpu::pipeline
