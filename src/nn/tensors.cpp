// The layers' parameters as named tensors (Layer::tensors, Sequential::tensors).
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include <mgpu/core/error.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/nn/transformer.hpp>

namespace mgpu::nn {

namespace {

// `tensors` with `prefix` before each name and `offset` added to each offset.
void append(std::vector<TensorSpec>& out, std::vector<TensorSpec> tensors, std::string const& prefix, std::int64_t offset) {
  for (TensorSpec& t : tensors) out.push_back({prefix + t.name, std::move(t.shape), offset + t.offset});
}

}  // namespace

std::vector<TensorSpec> Layer::tensors() const {
  std::int64_t const count = parameter_count();
  if (count == 0) return {};
  return {{"parameters", {count}, 0}};
}

std::vector<TensorSpec> CausalSelfAttention::tensors() const {
  std::vector<TensorSpec> out;
  append(out, qkv_.tensors(), "qkv.", 0);
  append(out, proj_.tensors(), "proj.", qkv_.parameter_count());
  return out;
}

std::vector<TensorSpec> TransformerBlock::tensors() const {
  std::vector<TensorSpec> out;
  std::int64_t offset = 0;
  for (auto const& [layer, prefix] : std::initializer_list<std::pair<Layer const*, char const*>>{
           {&ln1_, "ln_1."}, {&attn_, "attn_"}, {&ln2_, "ln_2."}, {&fc_, "mlp_fc."}, {&proj_, "mlp_proj."}}) {
    append(out, layer->tensors(), prefix, offset);
    offset += layer->parameter_count();
  }
  return out;
}

std::vector<TensorSpec> TiedLMHead::tensors() const {
  if (!holds_weight_) return {};
  return {{"wte.weight", {vocab_, features_}, 0}};
}

std::vector<TensorSpec> Sequential::tensors() const {
  std::vector<TensorSpec> out;
  std::int64_t offset = 0;
  std::int64_t blocks = 0;
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    Layer const& layer = *layers_[i];
    std::string const prefix = layer.block() ? "h." + std::to_string(blocks++) + "." : std::to_string(i) + ".";
    std::int64_t covered = 0;
    for (TensorSpec const& t : layer.tensors()) {
      if (t.offset != covered)
        throw Error(Errc::invalid_argument, "layer " + std::to_string(i) + " (" + layer.name() + ") tensor '" + t.name +
                                                "' at offset " + std::to_string(t.offset) + " (expected " +
                                                std::to_string(covered) + ": a layer's tensors lie end to end)");
      covered += t.numel();
    }
    if (covered != layer.parameter_count())
      throw Error(Errc::invalid_argument, "layer " + std::to_string(i) + " (" + layer.name() + ") names " +
                                              std::to_string(covered) + " elements of its parameters (expected " +
                                              std::to_string(layer.parameter_count()) + ")");
    append(out, layer.tensors(), prefix, offset);
    offset += layer.parameter_count();
  }
  return out;
}

}  // namespace mgpu::nn
