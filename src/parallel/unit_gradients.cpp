// The gradient sync's per-unit compute-type gradients (GradientSync::unit_compute_gradients()): a
// 16-bit model's layers write their gradients into a buffer per unit whose memory comes and goes
// with backward, so a rank does not hold a whole 16-bit copy of the float32 gradients.
#include "parallel/gradient_sync.hpp"

#include <cstddef>
#include <cstdint>

#include "core/backend.hpp"

namespace mgpu::parallel::detail {

void RankSync::unit_compute_gradients_before(std::size_t layer, bool backward, Stream& compute) {
  if (grad_unit_buffers_.empty()) {  // the first pass: a buffer per unit in place of the flat buffer
    grad_units_ = plan_units(model_);
    for (std::size_t u = 0; u < grad_units_.size(); ++u) {
      Tensor const buffer = Tensor::empty({grad_units_[u].size()}, model_.compute_type(), allocator(), compute);
      model_.bind_gradients(grad_units_[u].begin, grad_units_[u].end, buffer);
      grad_unit_buffers_.push_back(buffer);
      grad_unit_held_.push_back(u + 1 == grad_units_.size());
      if (u + 1 < grad_units_.size()) {
        mgpu::detail::BufferInternals::release_memory(buffer);
      } else {
        fill_async(buffer, 0.0f, compute);
      }
    }
  }
  std::size_t const count = grad_units_.size();
  if (!backward) {
    if (layer == 0) grad_units_entered_ = 0;  // a new forward
    return;
  }
  for (; grad_units_entered_ < count && layer <= grad_units_[grad_units_entered_].last_layer; ++grad_units_entered_) {
    std::size_t const u = grad_units_entered_;
    if (u >= 1 && grad_unit_held_[u - 1]) {  // its gradients are unscaled: done with
      mgpu::detail::BufferInternals::record_use(compute, grad_unit_buffers_[u - 1]);
      mgpu::detail::BufferInternals::release_memory(grad_unit_buffers_[u - 1]);
      grad_unit_held_[u - 1] = false;
    }
    if (!grad_unit_held_[u]) {
      Tensor const& buffer = grad_unit_buffers_[u];
      mgpu::detail::BufferInternals::acquire_memory(buffer, static_cast<std::size_t>(buffer.numel()) * size_of(buffer.dtype()),
                                                    allocator(), compute);
      grad_unit_held_[u] = true;
    }
  }
}

}  // namespace mgpu::parallel::detail
