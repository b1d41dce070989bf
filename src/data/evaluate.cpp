// evaluate_lm: the mean per-token cross-entropy over a token stream's first block windows.
#include <mgpu/data/evaluate.hpp>

#include <algorithm>
#include <string>

#include <mgpu/core/error.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/ops/transformer.hpp>

namespace mgpu::data {

double evaluate_lm(nn::Sequential& model, TokenLoader const& loader, std::int64_t windows, nn::Context& ctx) {
  auto const& options = loader.options();
  if (!options.sequential)
    throw Error(Errc::invalid_argument,
                "evaluate_lm with a sampling loader (expected a sequential one: the first windows are defined only "
                "for the in-order walk)");
  if (windows < 1 || windows > loader.windows())
    throw Error(Errc::invalid_argument, "evaluate_lm over " + std::to_string(windows) + " windows (expected 1 to the " +
                                            std::to_string(loader.windows()) + " the data holds)");
  auto host = Allocator::create({DeviceKind::host, 0});
  bool const on_host = ctx.allocator.device().kind == DeviceKind::host;
  double total = 0;
  model.train(false);
  nn::Context eval{ctx.allocator, ctx.stream, 0, 0, false, /*keep_for_backward=*/false};  // no backward follows
  try {
    for (std::int64_t first = 0; first < windows; first += options.batch) {
      std::int64_t const rows = std::min(options.batch, windows - first);
      TokenBatch const batch = loader.rows(first / options.batch, 0, rows, on_host ? ctx.allocator : *host);
      Tensor x = batch.x, y = batch.y;
      if (!on_host) {
        x = Tensor::empty(batch.x.shape(), DType::int32, ctx.allocator);
        y = Tensor::empty(batch.y.shape(), DType::int32, ctx.allocator);
        copy_async(x, batch.x, ctx.stream);
        copy_async(y, batch.y, ctx.stream);
      }
      Tensor const logits = model.forward(x, eval);
      Tensor const dlogits = Tensor::empty(logits.shape(), logits.dtype(), ctx.allocator);
      Tensor const loss = Tensor::empty({1}, DType::float32, ctx.allocator);
      auto const tokens = static_cast<float>(y.numel());
      ops::token_cross_entropy(logits, y, dlogits, loss, tokens, ctx.stream);
      total += static_cast<double>(ops::item(loss, ctx.stream)) * static_cast<double>(tokens);
    }
  } catch (...) {
    model.train(true);
    throw;
  }
  model.train(true);
  return total / static_cast<double>(windows * options.block);
}

}  // namespace mgpu::data
