// Sequential's flat buffers: materializing the parameters, binding ranges of them to other
// buffers (ZeRO's shards and units, 16-bit copies), unscaling the gradients and syncing 16-bit
// copies from the float32 masters.
#include <mgpu/nn/layers.hpp>

#include <iterator>
#include <map>
#include <string>

#include <mgpu/core/error.hpp>
#include <mgpu/ops/ops.hpp>

#include "core/backend.hpp"

namespace mgpu::nn {

void Sequential::bind_layers(Tensor const& params, Tensor const& grads) {
  for (ParameterRange const& r : parameter_ranges()) layers_[r.layer]->bind(params.slice(r.begin, r.end), grads.slice(r.begin, r.end));
}

void Sequential::materialize(Context& ctx, std::uint64_t seed, DType compute) {
  std::int64_t const total = parameter_count();
  // Initialise into float32 host memory, one RNG stream per layer (layers do not shift each other).
  Tensor init = Tensor::empty({total}, DType::float32, mgpu::detail::host_staging_allocator());
  bind_layers(init, init);
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + first_layer_ + i);
    layers_[i]->initialize(rng);
  }
  master_params_ = Tensor::empty({total}, DType::float32, ctx.allocator);
  copy_async(master_params_, init, ctx.stream);
  master_grads_ = ops::zeros({total}, ctx.allocator, ctx.stream);
  compute_ = compute;
  bound_grads_.clear();
  bound_compute_grads_.clear();
  bound_params_.clear();
  if (compute == DType::float32) {
    params_ = master_params_;
    grads_ = master_grads_;
  } else {
    params_ = Tensor::empty({total}, compute, ctx.allocator);
    convert_async(params_, master_params_, ctx.stream);
    grads_ = Tensor::empty({total}, compute, ctx.allocator);
    fill_async(grads_, 0.0f, ctx.stream);
  }
  bind_layers(params_, grads_);
  for (auto& layer : layers_) layer->link(*this);
  ctx.stream.synchronize();  // `init` is read by the copy above
}

void Sequential::check_binding(std::string const& what, std::int64_t begin, std::int64_t end, Tensor const& buffer, bool masters) const {
  check_materialized(what.c_str());
  bool const typed = buffer.defined() && (masters ? buffer.dtype() == DType::float32 || buffer.dtype() == compute_type()
                                                  : buffer.dtype() == compute_type());
  if (!typed || buffer.numel() != end - begin) {
    std::string const types = masters && compute_type() != DType::float32 ? " float32 or " + std::string(to_string(compute_type())) : " float32";
    std::string const type = masters ? types : " " + std::string(to_string(compute_type()));
    throw Error(Errc::invalid_argument, what + ": a buffer of " + std::to_string(buffer.defined() ? buffer.numel() : 0) + " " +
                                            std::string(to_string(buffer.dtype())) + " values (expected " +
                                            std::to_string(end - begin) + type + ")");
  }
  for (ParameterRange const& r : parameter_ranges()) {
    bool const inside = r.begin >= begin && r.end <= end;
    bool const outside = r.end <= begin || r.begin >= end;
    if (!inside && !outside)
      throw Error(Errc::invalid_argument, what + " cuts layer " + std::to_string(r.layer) + "'s parameters [" +
                                              std::to_string(r.begin) + ", " + std::to_string(r.end) +
                                              ") (expected whole layers)");
  }
}

namespace {
// Records that [begin, end) now lives in `buffer`, forgetting the ranges bound before that overlap it.
void record_binding(std::map<std::int64_t, std::pair<std::int64_t, Tensor>>& bound, std::int64_t begin, std::int64_t end,
                    Tensor const& buffer) {
  for (auto it = bound.begin(); it != bound.end();) it = it->first < end && it->second.first > begin ? bound.erase(it) : std::next(it);
  bound[begin] = {end, buffer};
}

// The elements [begin, end) of the flat buffer `flat`, or of the buffer bound to them.
Tensor bound_slice(std::map<std::int64_t, std::pair<std::int64_t, Tensor>> const& bound, Tensor const& flat, std::int64_t begin,
                   std::int64_t end, char const* what) {
  if (bound.empty()) return flat.slice(begin, end);
  auto it = bound.upper_bound(begin);
  if (it == bound.begin() || std::prev(it)->second.first < end)
    throw Error(Errc::invalid_argument, std::string(what) + " of [" + std::to_string(begin) + ", " + std::to_string(end) +
                                            ") (expected elements bound together)");
  --it;
  return it->second.second.slice(begin - it->first, end - it->first);
}
}  // namespace

void Sequential::bind_gradients(std::int64_t begin, std::int64_t end, Tensor const& grads) {
  check_binding("bind_gradients of [" + std::to_string(begin) + ", " + std::to_string(end) + ")", begin, end, grads, true);
  bool const sixteen = compute_type() != DType::float32;
  if (sixteen && grads.dtype() != DType::float32) {  // the layers' compute-type gradients
    record_binding(bound_compute_grads_, begin, end, grads);
    grads_ = Tensor{};
  } else {  // the float32 master gradients (with float32 compute the layers' too)
    record_binding(bound_grads_, begin, end, grads);
    master_grads_ = Tensor{};
    if (sixteen) return;
    grads_ = Tensor{};
  }
  rebind_layers(begin, end);
}

void Sequential::bind_parameters(std::int64_t begin, std::int64_t end, Tensor const& params) {
  check_binding("bind_parameters of [" + std::to_string(begin) + ", " + std::to_string(end) + ")", begin, end, params, false);
  bool const sixteen = compute_type() != DType::float32;
  if (begin == 0 && end == parameter_count()) {  // whole again
    bound_params_.clear();
    params_ = params;
    master_params_ = sixteen ? Tensor{} : params;  // 16-bit: the caller keeps the masters (bind_master_parameters())
  } else {
    record_binding(bound_params_, begin, end, params);
    params_ = Tensor{};
    master_params_ = Tensor{};  // with 16-bit compute too: the sync that binds them keeps the masters
  }
  rebind_layers(begin, end);
}

void Sequential::bind_master_parameters(Tensor const& masters) {
  check_materialized("bind_master_parameters");
  if (!masters.defined() || masters.dtype() != DType::float32 || masters.numel() != parameter_count())
    throw Error(Errc::invalid_argument, "bind_master_parameters: a buffer of " + std::to_string(masters.defined() ? masters.numel() : 0) +
                                            " " + std::string(to_string(masters.dtype())) + " values (expected " +
                                            std::to_string(parameter_count()) + " float32)");
  if (compute_type() == DType::float32) {
    bind_parameters(0, parameter_count(), masters);
    return;
  }
  master_params_ = masters;
}

void Sequential::rebind_layers(std::int64_t begin, std::int64_t end) {
  for (ParameterRange const& r : parameter_ranges())
    if (r.begin >= begin && r.end <= end) layers_[r.layer]->bind(layer_parameters(r.begin, r.end), layer_gradients(r.begin, r.end));
  for (auto& layer : layers_) layer->link(*this);
}

Tensor Sequential::master_gradients(std::int64_t begin, std::int64_t end) const {
  return bound_slice(bound_grads_, master_grads_, begin, end, "master_gradients");
}

Tensor Sequential::layer_parameters(std::int64_t begin, std::int64_t end) const {
  return bound_slice(bound_params_, params_, begin, end, "parameters");
}

Tensor Sequential::layer_gradients(std::int64_t begin, std::int64_t end) const {
  if (compute_type() == DType::float32) return bound_slice(bound_grads_, grads_, begin, end, "gradients");
  return bound_slice(bound_compute_grads_, grads_, begin, end, "gradients");
}

void Sequential::unscale_gradients(float factor, Stream& stream, std::int64_t begin, std::int64_t end) {
  if (end < 0) {
    if (bound_grads_.empty()) {
      unscale_gradients(factor, stream, 0, parameter_count());
    } else {  // float32 gradients in the buffers bind_gradients gave
      for (auto const& [first, bound] : bound_grads_) unscale_gradients(factor, stream, first, bound.first);
    }
    return;
  }
  Tensor const master = master_gradients(begin, end);
  Tensor const computed = layer_gradients(begin, end);
  if (computed.shares_storage(master)) {
    if (factor != 1.0f) ops::scale(master, factor, stream);
  } else {
    ops::scale_convert(master, computed, factor, stream);
  }
}

void Sequential::sync_parameters(Stream& stream, std::int64_t begin, std::int64_t end) {
  if (compute_type() == DType::float32) return;  // the same buffers (or, bound elsewhere, float32 too)
  if (end < 0) end = master_params_.numel();
  convert_async(params_.slice(begin, end), master_params_.slice(begin, end), stream);
}

}  // namespace mgpu::nn
