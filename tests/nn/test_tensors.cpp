// The layers' named tensors (Layer::tensors, Sequential::tensors) against gpt_parameters' names,
// shapes and offsets (the llm.c / PyTorch layout, listed by hand) and an MLP's widths.
#include <memory>
#include <string>
#include <vector>

#include <mgpu/nn/gpt.hpp>
#include <mgpu/nn/layers.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"

namespace nn = mgpu::nn;
using mgpu::Errc;
using mgpu::Tensor;

namespace {

// A layer of 6 parameters that names only 4 of them.
class Misnamed final : public nn::Layer {
 public:
  std::string name() const override { return "Misnamed"; }
  std::int64_t parameter_count() const override { return 6; }
  std::vector<nn::TensorSpec> tensors() const override { return {{"weight", {2, 2}, 0}}; }
  Tensor forward(Tensor const& x, nn::Context&) override { return x; }
  Tensor backward(Tensor const& dy, nn::Context&) override { return dy; }
  std::unique_ptr<nn::Layer> clone() const override { return std::make_unique<Misnamed>(); }
};

}  // namespace

TEST_CASE("Sequential::tensors names a GPT's tensors as gpt_parameters does, at the same offsets and buffer shapes",
          "[nn][gpt]") {
  nn::GptConfig const config{.vocab = 13, .block_size = 6, .n_layer = 3, .n_head = 2, .n_embd = 8};
  nn::Sequential const model = nn::gpt(config);
  std::vector<nn::TensorSpec> const tensors = model.tensors();
  std::vector<nn::GptParameter> const want = nn::gpt_parameters(config);
  REQUIRE(tensors.size() == want.size());
  std::string const ln_f = std::to_string(model.size() - 2) + ".";  // the final LayerNorm's index
  for (std::size_t i = 0; i < want.size(); ++i) {
    nn::GptParameter const& p = want[i];
    std::string name = p.name;
    if (name.starts_with("wte.") || name.starts_with("wpe.")) name = "0." + name;
    if (name.starts_with("ln_f.")) name = ln_f + name.substr(5);
    INFO(p.name);
    CHECK(tensors[i].name == name);
    CHECK(tensors[i].offset == p.offset);
    CHECK(tensors[i].shape == (p.transposed ? mgpu::Shape{p.shape[1], p.shape[0]} : p.shape));
  }
}

TEST_CASE("Sequential::tensors of an MLP: each Linear's weight [in, out] then bias, prefixed by its layer index",
          "[nn]") {
  nn::Sequential const model = nn::Sequential::mlp({4, 8, 3});
  std::vector<nn::TensorSpec> const want{
      {"0.weight", {4, 8}, 0}, {"0.bias", {8}, 32}, {"2.weight", {8, 3}, 40}, {"2.bias", {3}, 64}};
  CHECK(model.tensors() == want);
  std::int64_t covered = 0;
  for (nn::TensorSpec const& t : model.tensors()) covered += t.numel();
  CHECK(covered == model.parameter_count());
}

TEST_CASE("Sequential::tensors refuses a layer whose tensors do not cover its parameters", "[nn]") {
  nn::Sequential model;
  model.add(std::make_unique<nn::Linear>(2, 3));
  model.add(std::make_unique<Misnamed>());
  REQUIRE_MGPU_ERROR(model.tensors(), Errc::invalid_argument, "layer 1 (Misnamed) names 4 elements of its parameters (expected 6)");
}
