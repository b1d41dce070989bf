// The boxes of the whole model's named tensors that a tensor-parallel shard holds (shard_boxes.hpp).
#include <mgpu/parallel/shard_boxes.hpp>

#include <algorithm>

#include <mgpu/core/error.hpp>
#include <mgpu/parallel/tensor_parallel.hpp>

namespace mgpu::parallel {

namespace {

// For each element of a whole layer's `whole_size` parameters, its index in the shard layer's
// buffer (-1: not held), read off copy_shard with the shard's indices as values, in two halves of
// 12 and 24 bits so float32 holds them exactly.
std::vector<std::int64_t> held(ShardedLayer const* sharded, std::int64_t whole_size, std::int64_t shard_size) {
  std::vector<std::int64_t> at(static_cast<std::size_t>(whole_size), -1);
  if (sharded == nullptr) {
    for (std::int64_t i = 0; i < whole_size; ++i) at[static_cast<std::size_t>(i)] = i;
    return at;
  }
  if (shard_size >= (std::int64_t{1} << 36))
    throw Error(Errc::invalid_argument, "a sharded layer of " + std::to_string(shard_size) + " parameters (expected fewer than 2^36)");
  std::vector<float> whole(static_cast<std::size_t>(whole_size));
  std::vector<float> shard(static_cast<std::size_t>(shard_size));
  for (int half = 0; half < 2; ++half) {
    std::fill(whole.begin(), whole.end(), -1.0f);
    for (std::int64_t i = 0; i < shard_size; ++i) shard[static_cast<std::size_t>(i)] = static_cast<float>(half == 0 ? i & 4095 : i >> 12);
    sharded->copy_shard(whole, shard, false);
    for (std::size_t i = 0; i < whole.size(); ++i) {
      if (whole[i] < 0) continue;
      auto const part = static_cast<std::int64_t>(whole[i]);
      at[i] = half == 0 ? part : at[i] + (part << 12);
    }
  }
  return at;
}

}  // namespace

std::vector<ShardBox> shard_boxes(nn::Sequential const& whole, nn::Sequential const& shard) {
  std::vector<nn::ParameterRange> const whole_ranges = whole.parameter_ranges();
  std::vector<nn::ParameterRange> const shard_ranges = shard.parameter_ranges();
  if (whole_ranges.size() != shard_ranges.size())
    throw Error(Errc::invalid_argument, "a tensor-parallel shard with " + std::to_string(shard_ranges.size()) +
                                            " layers of parameters (expected the whole model's " + std::to_string(whole_ranges.size()) + ")");
  std::vector<nn::TensorSpec> const tensors = whole.tensors();
  std::vector<ShardBox> boxes;
  std::size_t next = 0;  // the first tensor not yet taken
  for (std::size_t l = 0; l < whole_ranges.size(); ++l) {
    nn::ParameterRange const& w = whole_ranges[l];
    nn::ParameterRange const& s = shard_ranges[l];
    auto const* sharded = dynamic_cast<ShardedLayer const*>(&shard.layer(s.layer));
    if (sharded == nullptr && w.size() != s.size())
      throw Error(Errc::invalid_argument, "layer " + std::to_string(s.layer) + " of a tensor-parallel shard has " +
                                              std::to_string(s.size()) + " parameters (expected the whole model's " +
                                              std::to_string(w.size()) + ", it is not sharded)");
    std::vector<std::int64_t> const at = held(sharded, w.size(), s.size());
    for (; next < tensors.size() && tensors[next].offset < w.end; ++next) {
      nn::TensorSpec const& p = tensors[next];
      Shape const& shape = p.shape;
      std::int64_t const cols = shape.empty() ? 1 : shape.back();
      std::int64_t const rows = p.numel() / std::max<std::int64_t>(cols, 1);
      auto const index = [&](std::int64_t r, std::int64_t c) { return at[static_cast<std::size_t>(p.offset - w.begin + r * cols + c)]; };
      // Each row's runs of held columns; consecutive rows with the same runs make one box per run.
      auto const runs_of = [&](std::int64_t r) {
        std::vector<std::pair<std::int64_t, std::int64_t>> runs;  // begin, end
        for (std::int64_t c = 0; c < cols; ++c) {
          if (index(r, c) < 0) continue;
          if (!runs.empty() && runs.back().second == c) ++runs.back().second;
          else runs.emplace_back(c, c + 1);
        }
        return runs;
      };
      bool const whole_tensor = std::all_of(at.begin() + (p.offset - w.begin), at.begin() + (p.offset - w.begin + p.numel()),
                                            [](std::int64_t i) { return i >= 0; });
      for (std::int64_t r = 0; r < rows;) {
        auto const runs = runs_of(r);
        std::int64_t end = r + 1;
        while (end < rows && runs_of(end) == runs) ++end;
        for (auto const& [c0, c1] : runs) {
          ShardBox b{.tensor = p.name, .shape = shape, .offset = p.offset, .box = {}, .whole = whole_tensor, .at = {}};
          b.box = shape.size() == 1 ? io::Box{{c0}, {c1 - c0}} : io::Box{{r, c0}, {end - r, c1 - c0}};
          for (std::int64_t i = r; i < end; ++i)
            for (std::int64_t c = c0; c < c1; ++c) b.at.push_back(s.begin + index(i, c));
          boxes.push_back(std::move(b));
        }
        r = end;
      }
    }
  }
  return boxes;
}

std::vector<std::pair<std::string, std::int64_t>> tensor_layout(nn::Sequential const& whole, std::string const& record) {
  std::vector<std::pair<std::string, std::int64_t>> layout;
  for (nn::TensorSpec const& t : whole.tensors()) layout.emplace_back(record + "/" + t.name, t.offset);
  return layout;
}

}  // namespace mgpu::parallel
