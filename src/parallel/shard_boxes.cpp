// The boxes of the whole model's named tensors that a tensor-parallel shard or a pipeline chunk
// holds (shard_boxes.hpp).
#include <mgpu/parallel/shard_boxes.hpp>

#include <algorithm>
#include <cstring>

#include <mgpu/core/error.hpp>
#include <mgpu/core/memory.hpp>
#include <mgpu/nn/transformer.hpp>
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

// A layer of the whole model and the shard's layer holding (a part of) it.
struct Pair {
  nn::ParameterRange whole, shard;
};

// The boxes of whole's tensors in each pair's whole layer that its shard layer holds.
void append_boxes(nn::Sequential const& whole, nn::Sequential const& shard, std::vector<Pair> const& pairs, std::vector<ShardBox>& boxes) {
  std::vector<nn::TensorSpec> const tensors = whole.tensors();
  for (Pair const& pair : pairs) {
    nn::ParameterRange const& w = pair.whole;
    nn::ParameterRange const& s = pair.shard;
    auto const* sharded = dynamic_cast<ShardedLayer const*>(&shard.layer(s.layer));
    if (sharded == nullptr && w.size() != s.size())
      throw Error(Errc::invalid_argument, "layer " + std::to_string(s.layer) + " of a shard has " + std::to_string(s.size()) +
                                              " parameters (expected the whole model's layer " + std::to_string(w.layer) + "'s " +
                                              std::to_string(w.size()) + ", it is not sharded)");
    std::vector<std::int64_t> const at = held(sharded, w.size(), s.size());
    auto const first = std::lower_bound(tensors.begin(), tensors.end(), w.begin,
                                        [](nn::TensorSpec const& t, std::int64_t offset) { return t.offset < offset; });
    for (auto t = first; t != tensors.end() && t->offset < w.end; ++t) {
      nn::TensorSpec const& p = *t;
      std::int64_t const cols = p.shape.empty() ? 1 : p.shape.back();
      std::int64_t const rows = p.numel() / std::max<std::int64_t>(cols, 1);
      auto const index = [&](std::int64_t r, std::int64_t c) { return at[static_cast<std::size_t>(p.offset - w.begin + r * cols + c)]; };
      bool const whole_tensor = std::all_of(at.begin() + (p.offset - w.begin), at.begin() + (p.offset - w.begin + p.numel()),
                                            [](std::int64_t i) { return i >= 0; });
      // Each row's runs of held columns consecutive in the shard, computed once per row;
      // consecutive rows with the same runs make one box per run.
      std::vector<std::pair<std::int64_t, std::int64_t>> open_runs;  // begin, end
      std::vector<ShardBox> open;                                    // a box per run
      std::int64_t open_row = 0;
      auto const close = [&] {
        for (std::size_t k = 0; k < open.size(); ++k) {
          auto const [c0, c1] = open_runs[k];
          auto const count = static_cast<std::int64_t>(open[k].rows.size());
          open[k].box = p.shape.size() == 1 ? io::Box{{c0}, {c1 - c0}} : io::Box{{open_row, c0}, {count, c1 - c0}};
          boxes.push_back(std::move(open[k]));
        }
        open.clear();
      };
      std::vector<std::pair<std::int64_t, std::int64_t>> runs;
      for (std::int64_t r = 0; r < rows; ++r) {
        runs.clear();
        for (std::int64_t c = 0; c < cols; ++c) {
          std::int64_t const i = index(r, c);
          if (i < 0) continue;
          if (!runs.empty() && runs.back().second == c && index(r, c - 1) + 1 == i) ++runs.back().second;
          else runs.emplace_back(c, c + 1);
        }
        if (r == 0 || runs != open_runs) {
          close();
          open_runs = runs;
          open_row = r;
          for (std::size_t k = 0; k < runs.size(); ++k)
            open.push_back({.tensor = p.name, .shape = p.shape, .offset = p.offset, .box = {}, .whole = whole_tensor, .copy = false, .rows = {}});
        }
        for (std::size_t k = 0; k < runs.size(); ++k) open[k].rows.push_back(s.begin + index(r, runs[k].first));
      }
      close();
    }
  }
}

// A tied LM head's copy of rows [begin, end) of whole's wte (its first nn::Embedding's), at
// `range` of the shard: a copy box.
ShardBox wte_copy(nn::Sequential const& whole, nn::ParameterRange const& range, std::int64_t begin, std::int64_t end) {
  for (nn::ParameterRange const& r : whole.parameter_ranges()) {
    if (dynamic_cast<nn::Embedding const*>(&whole.layer(r.layer)) == nullptr) continue;
    for (nn::TensorSpec const& t : whole.tensors()) {
      if (t.offset != r.begin || t.shape.size() != 2 || end > t.shape[0] || range.size() != (end - begin) * t.shape[1]) continue;
      ShardBox b{.tensor = t.name, .shape = t.shape, .offset = t.offset, .box = {{begin, 0}, {end - begin, t.shape[1]}},
                 .whole = false, .copy = true, .rows = {}};
      for (std::int64_t row = 0; row < end - begin; ++row) b.rows.push_back(range.begin + row * t.shape[1]);
      return b;
    }
  }
  throw Error(Errc::invalid_argument, "a tied LM head's copy of wte rows [" + std::to_string(begin) + ", " + std::to_string(end) +
                                          ") without a matching embedding in the whole model (expected an nn::Embedding's wte)");
}

}  // namespace

std::vector<ShardBox> shard_boxes(nn::Sequential const& whole, nn::Sequential const& shard) {
  std::vector<nn::ParameterRange> const whole_ranges = whole.parameter_ranges();
  std::vector<nn::ParameterRange> const shard_ranges = shard.parameter_ranges();
  if (whole_ranges.size() != shard_ranges.size())
    throw Error(Errc::invalid_argument, "a tensor-parallel shard with " + std::to_string(shard_ranges.size()) +
                                            " layers of parameters (expected the whole model's " + std::to_string(whole_ranges.size()) + ")");
  std::vector<Pair> pairs;
  for (std::size_t l = 0; l < whole_ranges.size(); ++l) pairs.push_back({whole_ranges[l], shard_ranges[l]});
  std::vector<ShardBox> boxes;
  append_boxes(whole, shard, pairs, boxes);
  return boxes;
}

std::vector<ShardBox> shard_boxes(nn::Sequential const& whole, nn::Sequential const& shard, std::span<std::size_t const> origins) {
  if (origins.size() != shard.size())
    throw Error(Errc::invalid_argument, "shard_boxes with " + std::to_string(origins.size()) + " origins for a shard of " +
                                            std::to_string(shard.size()) + " layers (expected one per layer)");
  std::vector<nn::ParameterRange> const whole_ranges = whole.parameter_ranges();
  std::vector<Pair> pairs;
  std::vector<ShardBox> copies;
  for (nn::ParameterRange const& s : shard.parameter_ranges()) {
    std::size_t const origin = origins[s.layer];
    auto const w = std::find_if(whole_ranges.begin(), whole_ranges.end(), [origin](nn::ParameterRange const& r) { return r.layer == origin; });
    if (w == whole_ranges.end()) {  // no parameters in the whole model: a tied head's copy of wte
      nn::Layer const& layer = shard.layer(s.layer);
      if (auto const* head = dynamic_cast<nn::TiedLMHead const*>(&layer); head != nullptr && head->holds_weight()) {
        copies.push_back(wte_copy(whole, s, 0, head->vocab()));
      } else if (auto const* split = dynamic_cast<VocabParallelLMHead const*>(&layer); split != nullptr && split->holds_weight()) {
        copies.push_back(wte_copy(whole, s, split->vocab_begin(), split->vocab_end()));
      } else {
        throw Error(Errc::invalid_argument, "layer " + std::to_string(s.layer) + " (" + layer.name() + ") of a shard has " +
                                                std::to_string(s.size()) + " parameters that its origin, the whole model's layer " +
                                                std::to_string(origin) + ", lacks (expected only a tied LM head's copy of wte)");
      }
      continue;
    }
    if (std::any_of(pairs.begin(), pairs.end(), [origin](Pair const& p) { return p.whole.layer == origin; }))
      throw Error(Errc::invalid_argument, "two layers with parameters of a shard made from the whole model's layer " +
                                              std::to_string(origin) + " (expected one)");
    pairs.push_back({*w, s});
  }
  std::vector<ShardBox> boxes;
  append_boxes(whole, shard, pairs, boxes);
  boxes.insert(boxes.end(), std::make_move_iterator(copies.begin()), std::make_move_iterator(copies.end()));
  return boxes;
}

std::vector<std::pair<std::string, std::int64_t>> tensor_layout(nn::Sequential const& whole, std::string const& record) {
  std::vector<std::pair<std::string, std::int64_t>> layout;
  for (nn::TensorSpec const& t : whole.tensors()) layout.emplace_back(record + "/" + t.name, t.offset);
  return layout;
}

std::vector<float> box_values(ShardBox const& b, std::span<float const> shard) {
  std::vector<float> out;
  out.reserve(static_cast<std::size_t>(b.box.numel()));
  auto const length = static_cast<std::size_t>(b.box.lengths.back());
  for (std::int64_t const row : b.rows) {
    auto const from = shard.subspan(static_cast<std::size_t>(row), length);
    out.insert(out.end(), from.begin(), from.end());
  }
  return out;
}

void check_model_record(io::ShardedCheckpoint const& folder, io::Checkpoint const& records, std::string const& name,
                        std::int64_t total, std::string const& source) {
  bool const split = folder.has_pieces(name);
  if (!split && !records.contains(name)) throw Error(Errc::corrupt_data, source + ": no record '" + name + "' (expected one)");
  Shape const shape = split ? folder.shape(name) : records.get(name).shape;
  io::RecordType const type = split ? folder.type(name) : records.get(name).type;
  if (shape != Shape{total} || type != io::RecordType::float32)
    throw Error(Errc::invalid_argument, source + ": record '" + name + "' of shape " + mgpu::to_string(shape) + " (expected [" +
                                            std::to_string(total) + "] float32, a value per parameter of the model)");
}

void read_box_into(io::ShardedCheckpoint const& folder, io::Checkpoint const& records, std::string const& name,
                   ShardBox const& b, std::span<float> into, Stream& stream) {
  auto const length = static_cast<std::size_t>(b.box.lengths.back());
  if (folder.has_pieces(name)) {
    Tensor const values = Tensor::empty({b.box.numel()}, DType::float32, *Allocator::create({DeviceKind::host, 0}));
    folder.read_view(name, b.offset, b.shape, b.box, values, stream);
    std::span<float const> const got = values.host_span<float>();
    for (std::size_t r = 0; r < b.rows.size(); ++r)
      std::copy_n(got.begin() + static_cast<std::ptrdiff_t>(r * length), length, into.begin() + b.rows[r]);
    return;
  }
  // A whole record: each box row is consecutive in it (the box spans the last dimension's run).
  auto const* values = reinterpret_cast<float const*>(records.get(name).data.data()) + b.offset;
  std::size_t const rank = b.shape.size();
  std::vector<std::int64_t> index(rank, 0);  // within the box, the last dimension left at 0
  for (std::int64_t const row : b.rows) {
    std::int64_t at = 0;
    for (std::size_t d = 0; d < rank; ++d) at = at * b.shape[d] + b.box.offsets[d] + index[d];
    std::memcpy(into.data() + row, values + at, length * sizeof(float));
    for (std::size_t d = rank > 0 ? rank - 1 : 0; d-- > 0;) {
      if (++index[d] < b.box.lengths[d]) break;
      index[d] = 0;
    }
  }
}

}  // namespace mgpu::parallel
