// The GPT layouts the resilience tests drive alike: one device, data parallel with and without
// clipping, every pipeline schedule, a data x pipeline grid (and ZeRO-3 over it), tensor parallel with and without
// replicas (and ZeRO-2 and 3 over them) and tensor-parallel stages, each seen through its step (a
// small GPT with dropout, so a step that moved the RNG shows in the next losses).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <mgpu/core/device_group.hpp>
#include <mgpu/core/memory.hpp>
#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/loss.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/optim/optim.hpp>
#include <mgpu/parallel/data_parallel.hpp>
#include <mgpu/parallel/tensor_parallel.hpp>
#include <mgpu/pipeline/pipeline.hpp>

#include "support/nn_env.hpp"

namespace mgpu::test::layouts {

inline nn::GptConfig const config{.vocab = 64, .block_size = 8, .n_layer = 2, .n_head = 2, .n_embd = 16, .dropout = 0.1f};
inline std::uint64_t const seed = 5;
inline optim::AdamWOptions const adamw{.lr = 3e-3f, .weight_decay = 0.1f};

/// One executor seen through its step: the batch's loss, or an Error.
using Step = std::function<double(Tensor const& ids, Tensor const& targets, float lr_scale)>;

/// An executor and the allocator of its last device (a test may limit it to make a step fail).
struct Trainer {
  Step step;
  std::shared_ptr<void> keep;  // the executor, its devices and their streams (the executor destroyed first)
  Allocator* last = nullptr;
};

struct Layout {
  std::string name;
  std::function<Trainer()> make;  // a fresh executor (with its devices) each call
};

inline pipeline::ChunkOptimizerFactory chunk_adamw() {
  return [](nn::Sequential const& chunk) {
    optim::AdamWOptions o = adamw;
    o.decay_ranges = chunk.matrix_ranges();
    return std::make_unique<optim::AdamW>(o);
  };
}

inline std::vector<Layout> all();

/// The layouts whose names start with `family` ("one device", "data parallel", "pipeline",
/// "tensor"): a test case each, so that each stays short under the sanitizers.
inline std::vector<Layout> of(std::string const& family) {
  std::vector<Layout> chosen;
  for (Layout& layout : all())
    if (layout.name.rfind(family, 0) == 0) chosen.push_back(std::move(layout));
  return chosen;
}

inline std::vector<Layout> all() {
  namespace pp = mgpu::pipeline;
  namespace par = mgpu::parallel;
  auto const loss = std::make_shared<nn::TokenCrossEntropy const>();
  std::vector<Layout> list;
  list.push_back({"one device", [] {
                    struct One {
                      std::shared_ptr<Allocator> allocator = Allocator::create({DeviceKind::host, 0});
                      Stream stream{Device{DeviceKind::host, 0}};
                      nn::Context ctx{*allocator, stream};
                      nn::Sequential model = nn::gpt(config);
                      optim::AdamW opt{adamw};
                    };
                    auto one = std::make_shared<One>();
                    one->model.materialize(one->ctx, seed);
                    Step step = [one = one.get()](Tensor const& ids, Tensor const& targets, float lr_scale) {
                      nn::TokenCrossEntropy const token_loss;
                      nn::StepResult const r = nn::train_step(one->model, one->opt, ids, targets, token_loss, one->ctx, {.lr_scale = lr_scale});
                      return static_cast<double>(ops::item(r.loss, one->stream));
                    };
                    return Trainer{step, one, one->allocator.get()};
                  }});
  for (float clip : {0.0f, 0.5f}) {
    list.push_back({"data parallel over host:2, clip " + std::to_string(clip), [loss, clip] {
                      auto group = std::make_shared<DeviceGroup>("host:2");
                      auto dp = std::make_shared<par::DataParallel>(nn::gpt(config), *group, optim::AdamW(adamw),
                                                                    par::DataParallelOptions{.seed = seed, .clip_norm = clip, .loss = loss});
                      Step step = [dp = dp.get()](Tensor const& ids, Tensor const& targets, float lr_scale) {
                        return static_cast<double>(dp->step(ids, targets, lr_scale).loss);
                      };
                      return Trainer{step, std::make_shared<std::pair<decltype(group), decltype(dp)>>(group, dp), &group->allocator(1)};
                    }});
  }
  // Pipelines: every schedule on 2 devices (interleaved: 2 chunks per device), and a 2 x 2 grid.
  struct Pipe {
    std::string name;
    int replicas;
    pp::Schedule schedule;
    std::vector<std::size_t> cuts;  // of gpt(config): Embedding, Dropout, 2 blocks, LayerNorm, head
    int zero = 0;                   // ExecutorOptions::zero_stage over the replicas
  };
  std::vector<Pipe> const pipes = {{"1f1b", 1, pp::one_f_one_b(2, 2), {0, 3, 6}},
                                   {"gpipe", 1, pp::gpipe(2, 4), {0, 3, 6}},
                                   {"zb", 1, pp::zero_bubble_h1(2, 4), {0, 3, 6}},
                                   {"interleaved", 1, pp::interleaved_one_f_one_b(2, 2, 2), {0, 2, 3, 4, 6}},
                                   {"1f1b, 2 replicas", 2, pp::one_f_one_b(2, 2), {0, 3, 6}},
                                   {"1f1b, 2 replicas, ZeRO-3", 2, pp::one_f_one_b(2, 2), {0, 3, 6}, 3}};
  for (Pipe const& p : pipes) {
    list.push_back({"pipeline " + p.name, [loss, p] {
                      auto group = std::make_shared<DeviceGroup>("host:" + std::to_string(2 * p.replicas));
                      auto ex = std::make_shared<pp::Executor>(
                          nn::gpt(config), *group, p.cuts, p.schedule, chunk_adamw(),
                          pp::ExecutorOptions{.seed = seed, .data_parallel = p.replicas, .zero_stage = p.zero, .clip_norm = 0.5f, .loss = loss});
                      Step step = [ex = ex.get()](Tensor const& ids, Tensor const& targets, float lr_scale) {
                        return static_cast<double>(ex->step(ids, targets, lr_scale));
                      };
                      return Trainer{step, std::make_shared<std::pair<decltype(group), decltype(ex)>>(group, ex),
                                     &group->allocator(group->size() - 1)};
                    }});
  }
  for (int dp : {1, 2}) {
    for (float clip : {0.0f, 0.5f}) {
      list.push_back({"tensor parallel 2 x " + std::to_string(dp) + " replicas, clip " + std::to_string(clip), [dp, clip] {
                        auto group = std::make_shared<DeviceGroup>("host:" + std::to_string(2 * dp));
                        auto tp = std::make_shared<par::TensorParallel>(
                            *group, mgpu::nn::gpt(config), par::TensorParallelOptions{.seed = seed, .adamw = adamw, .clip_norm = clip, .data_parallel = dp});
                        Step step = [tp = tp.get()](Tensor const& ids, Tensor const& targets, float lr_scale) {
                          return tp->step(ids, targets, lr_scale).loss;
                        };
                        return Trainer{step, std::make_shared<std::pair<decltype(group), decltype(tp)>>(group, tp),
                                       &group->allocator(group->size() - 1)};
                      }});
    }
  }
  for (int zero : {2, 3}) {  // ZeRO over the replicas, clipping (2) and the update at the commit point (3)
    list.push_back({"tensor parallel 2 x 2 replicas, ZeRO-" + std::to_string(zero), [zero] {
                      auto group = std::make_shared<DeviceGroup>("host:4");
                      auto tp = std::make_shared<par::TensorParallel>(
                          *group, mgpu::nn::gpt(config),
                          par::TensorParallelOptions{
                              .seed = seed, .adamw = adamw, .clip_norm = zero == 2 ? 0.5f : 0.0f, .data_parallel = 2, .zero_stage = zero});
                      Step step = [tp = tp.get()](Tensor const& ids, Tensor const& targets, float lr_scale) {
                        return tp->step(ids, targets, lr_scale).loss;
                      };
                      return Trainer{step, std::make_shared<std::pair<decltype(group), decltype(tp)>>(group, tp),
                                     &group->allocator(group->size() - 1)};
                    }});
  }
  list.push_back({"tensor-parallel stages: 2 stages x 2 ranks", [] {
                    auto group = std::make_shared<DeviceGroup>("host:4");
                    auto ex = std::make_shared<pp::Executor>(
                        nn::gpt(config), *group, std::vector<std::size_t>{0, 3, 6}, pp::one_f_one_b(2, 2), chunk_adamw(),
                        pp::ExecutorOptions{.seed = seed, .clip_norm = 0.5f, .tensor_parallel = pp::tensor_parallel_stages(mgpu::nn::gpt(config), {}, 2)});
                    Step step = [ex = ex.get()](Tensor const& ids, Tensor const& targets, float lr_scale) {
                      return static_cast<double>(ex->step(ids, targets, lr_scale));
                    };
                    return Trainer{step, std::make_shared<std::pair<decltype(group), decltype(ex)>>(group, ex),
                                   &group->allocator(group->size() - 1)};
                  }});
  return list;
}

}  // namespace mgpu::test::layouts
