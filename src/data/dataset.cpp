// Datasets: CSV and IDX loaders, generators, splitting and normalization.
#include <mgpu/data/dataset.hpp>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <iterator>
#include <map>
#include <numbers>
#include <numeric>
#include <random>

#include <mgpu/core/error.hpp>

namespace mgpu::data {
namespace {

[[noreturn]] void corrupt(std::filesystem::path const& path, std::string const& where, std::string const& what) {
  throw Error(Errc::corrupt_data, path.string() + ":" + where + ": " + what);
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  if (s.size() >= 2 && s.front() == '"' && s.back() == '"') s = s.substr(1, s.size() - 2);
  return s;
}

std::optional<float> number(std::string_view s) {
  if (!s.empty() && s.front() == '+') s.remove_prefix(1);
  float value = 0;
  auto const [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (ec != std::errc{} || end != s.data() + s.size() || s.empty()) return std::nullopt;
  return value;
}

std::vector<std::string_view> fields(std::string_view line, char delimiter) {
  std::vector<std::string_view> out;
  std::size_t start = 0;
  while (true) {
    std::size_t const at = line.find(delimiter, start);
    out.push_back(trim(line.substr(start, at == std::string_view::npos ? std::string_view::npos : at - start)));
    if (at == std::string_view::npos) break;
    start = at + 1;
  }
  return out;
}

std::vector<unsigned char> read_bytes(std::filesystem::path const& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(Errc::io, "cannot open " + path.string() + " (expected a readable file)");
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::uint32_t big_endian(std::vector<unsigned char> const& b, std::size_t at) {
  return (std::uint32_t{b[at]} << 24) | (std::uint32_t{b[at + 1]} << 16) | (std::uint32_t{b[at + 2]} << 8) | b[at + 3];
}

// An IDX file's extents after checking its magic (unsigned bytes, `dims` dimensions) and size.
std::vector<std::int64_t> idx_extents(std::vector<unsigned char> const& b, std::filesystem::path const& path, unsigned dims, char const* kind) {
  if (b.size() < 4 || b[0] != 0 || b[1] != 0 || b[2] != 0x08 || b[3] != dims)
    corrupt(path, "byte 0", std::string("not an IDX ") + kind + " file (expected the magic number 0x0000080" + std::to_string(dims) +
                                ": unsigned bytes, " + std::to_string(dims) + " dimensions)");
  std::size_t const header = 4 + 4 * std::size_t{dims};
  if (b.size() < header)
    corrupt(path, "byte " + std::to_string(b.size()), "truncated header (expected " + std::to_string(header) + " bytes)");
  std::vector<std::int64_t> extents;
  std::uint64_t total = 1;
  bool overflow = false;
  for (unsigned d = 0; d < dims; ++d) {
    extents.push_back(big_endian(b, 4 + 4 * d));
    overflow = overflow || __builtin_mul_overflow(total, static_cast<std::uint64_t>(extents.back()), &total);
  }
  if (overflow)
    corrupt(path, "byte 4", "the header's extents multiply to more than 2^64 bytes (expected the size of the data that follows)");
  if (extents[0] < 1) corrupt(path, "byte 4", std::string("no ") + kind + " (expected at least one)");
  if (b.size() - header != total)
    corrupt(path, "byte " + std::to_string(header), "the header promises " + std::to_string(total) + " bytes of data, the file has " +
                                                        std::to_string(b.size() - header) + (b.size() - header < total ? " (truncated)" : ""));
  return extents;
}

std::int64_t class_count(std::vector<float> const& labels) {
  float top = -1;
  for (float l : labels) top = std::max(top, l);
  return static_cast<std::int64_t>(top) + 1;
}

}  // namespace

InMemoryDataset::InMemoryDataset(std::vector<float> features, std::vector<float> labels, std::int64_t feature_count, std::int64_t classes)
    : features_(std::move(features)), labels_(std::move(labels)), feature_count_(feature_count), classes_(classes) {
  if (feature_count < 1 || features_.size() != labels_.size() * static_cast<std::size_t>(feature_count))
    throw Error(Errc::invalid_argument, "a dataset of " + std::to_string(features_.size()) + " feature values and " +
                                            std::to_string(labels_.size()) + " labels with " + std::to_string(feature_count) +
                                            " features (expected labels x features values, features >= 1)");
  for (std::size_t i = 0; i < labels_.size() && classes > 0; ++i) {
    float const l = labels_[i];
    if (!(l >= 0) || l != std::floor(l) || l >= static_cast<float>(classes))
      throw Error(Errc::invalid_argument, "label " + std::to_string(l) + " of example " + std::to_string(i) + " (expected a class id in [0, " +
                                              std::to_string(classes) + "))");
  }
}

float InMemoryDataset::example(std::int64_t i, std::span<float> x) const {
  if (i < 0 || i >= size() || static_cast<std::int64_t>(x.size()) != feature_count_)
    throw Error(Errc::invalid_argument, "example " + std::to_string(i) + " into " + std::to_string(x.size()) + " floats (expected an index below " +
                                            std::to_string(size()) + " and " + std::to_string(feature_count_) + " floats)");
  std::copy_n(features_.begin() + i * feature_count_, feature_count_, x.begin());
  return labels_[static_cast<std::size_t>(i)];
}

InMemoryDataset InMemoryDataset::subset(std::span<std::int64_t const> rows) const {
  std::vector<float> f;
  std::vector<float> l;
  f.reserve(rows.size() * static_cast<std::size_t>(feature_count_));
  l.reserve(rows.size());
  for (std::int64_t r : rows) {
    if (r < 0 || r >= size())
      throw Error(Errc::invalid_argument, "subset row " + std::to_string(r) + " (expected below " + std::to_string(size()) + ")");
    auto const begin = features_.begin() + r * feature_count_;
    f.insert(f.end(), begin, begin + feature_count_);
    l.push_back(labels_[static_cast<std::size_t>(r)]);
  }
  InMemoryDataset out(std::move(f), std::move(l), feature_count_, classes_);
  out.class_names_ = class_names_;
  return out;
}

InMemoryDataset load_csv(std::filesystem::path const& path, CsvOptions const& options) {
  std::ifstream in(path);
  if (!in) throw Error(Errc::io, "cannot open " + path.string() + " (expected a readable CSV file)");
  std::vector<float> features;
  std::vector<std::string> raw_labels;
  std::int64_t columns = 0;
  std::int64_t label = 0;
  std::int64_t line_number = 0;
  std::int64_t first_line = 0;
  bool header_checked = false;
  std::string line;
  while (std::getline(in, line)) {
    ++line_number;
    if (trim(line).empty()) continue;
    auto const row = fields(line, options.delimiter);
    std::string const where = std::to_string(line_number);
    if (columns == 0) {
      columns = static_cast<std::int64_t>(row.size());
      first_line = line_number;
      if (columns < 2) corrupt(path, where, "1 column (expected at least one feature and a label, separated by '" + std::string(1, options.delimiter) + "')");
      label = options.label_column < 0 ? columns + options.label_column : options.label_column;
      if (label < 0 || label >= columns)
        throw Error(Errc::invalid_argument, path.string() + ": label column " + std::to_string(options.label_column) + " (expected -" +
                                                std::to_string(columns) + " to " + std::to_string(columns - 1) + " for " + std::to_string(columns) + " columns)");
      // The first line may be a header (auto-detected: a feature field that is not a number; a text
      // label alone is data). Data rows then set the column count: some headers list other things.
      if (!header_checked) {
        header_checked = true;
        bool header = false;
        for (std::int64_t c = 0; c < columns; ++c) header = header || (c != label && !number(row[static_cast<std::size_t>(c)]));
        if (options.header.value_or(header)) {
          columns = 0;
          continue;
        }
      }
    }
    if (static_cast<std::int64_t>(row.size()) != columns)
      corrupt(path, where, std::to_string(row.size()) + " fields (expected " + std::to_string(columns) + " as on line " + std::to_string(first_line) + ")");
    for (std::int64_t c = 0; c < columns; ++c) {
      std::string_view const f = row[static_cast<std::size_t>(c)];
      if (c == label) {
        raw_labels.emplace_back(f);
        continue;
      }
      auto const v = number(f);
      if (!v || !std::isfinite(*v))
        corrupt(path, where, "column " + std::to_string(c + 1) + " holds '" + std::string(f) + "' (expected a finite number)");
      features.push_back(*v);
    }
  }
  if (raw_labels.empty()) throw Error(Errc::corrupt_data, path.string() + ": no data rows (expected at least one)");

  std::vector<float> labels;
  std::vector<std::string> names;
  bool const numeric = std::all_of(raw_labels.begin(), raw_labels.end(), [](std::string const& s) { return number(s).has_value(); });
  if (!numeric && !options.classification)
    throw Error(Errc::corrupt_data, path.string() + ": text labels in a regression dataset (expected numbers in column " + std::to_string(label + 1) + ")");
  if (numeric) {
    for (std::size_t i = 0; i < raw_labels.size(); ++i) {
      float const v = *number(raw_labels[i]);
      if (options.classification && (!(v >= 0) || v != std::floor(v) || v > 1e6f))
        throw Error(Errc::corrupt_data, path.string() + ": data row " + std::to_string(i + 1) + ": label '" + raw_labels[i] +
                                            "' is not a class id (expected a whole number >= 0, or regression)");
      labels.push_back(v);
    }
  } else {
    std::map<std::string, float> ids;
    for (auto const& s : raw_labels) ids.emplace(s, 0.0f);
    for (auto& [name, id] : ids) {
      id = static_cast<float>(names.size());
      names.push_back(name);
    }
    for (auto const& s : raw_labels) labels.push_back(ids[s]);
  }
  std::int64_t const classes = options.classification ? (numeric ? class_count(labels) : static_cast<std::int64_t>(names.size())) : 0;
  InMemoryDataset out(std::move(features), std::move(labels), columns - 1, classes);
  out.set_class_names(std::move(names));
  return out;
}

InMemoryDataset load_idx(std::filesystem::path const& images, std::filesystem::path const& labels) {
  auto const img = read_bytes(images);
  auto const lab = read_bytes(labels);
  auto const image_extents = idx_extents(img, images, 3, "images");
  auto const label_extents = idx_extents(lab, labels, 1, "labels");
  if (image_extents[0] != label_extents[0])
    throw Error(Errc::corrupt_data, images.string() + " holds " + std::to_string(image_extents[0]) + " images but " + labels.string() +
                                        " holds " + std::to_string(label_extents[0]) + " labels (expected one label per image)");
  std::int64_t const pixels = image_extents[1] * image_extents[2];
  if (pixels < 1) corrupt(images, "byte 8", "images of " + std::to_string(image_extents[1]) + " x " + std::to_string(image_extents[2]) + " pixels");
  std::vector<float> features(img.begin() + 16, img.end());
  for (float& f : features) f /= 255.0f;
  std::vector<float> targets(lab.begin() + 8, lab.end());
  return {std::move(features), targets, pixels, class_count(targets)};
}

InMemoryDataset make_clusters(std::int64_t examples, std::int64_t features, std::int64_t classes, std::uint64_t seed, float separation) {
  if (examples < 1 || features < 1 || classes < 2)
    throw Error(Errc::invalid_argument, "make_clusters(" + std::to_string(examples) + ", " + std::to_string(features) + ", " + std::to_string(classes) +
                                            ") (expected examples >= 1, features >= 1, classes >= 2)");
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> centre(-1.0f, 1.0f);
  std::normal_distribution<float> noise(0.0f, 1.0f);
  std::vector<float> centres(static_cast<std::size_t>(classes * features));
  for (float& c : centres) c = separation * centre(rng);
  std::vector<float> x(static_cast<std::size_t>(examples * features));
  std::vector<float> y(static_cast<std::size_t>(examples));
  for (std::int64_t i = 0; i < examples; ++i) {
    std::int64_t const k = i % classes;
    y[static_cast<std::size_t>(i)] = static_cast<float>(k);
    for (std::int64_t d = 0; d < features; ++d)
      x[static_cast<std::size_t>(i * features + d)] = centres[static_cast<std::size_t>(k * features + d)] + noise(rng);
  }
  return {std::move(x), std::move(y), features, classes};
}

InMemoryDataset make_spirals(std::int64_t examples, std::int64_t classes, std::uint64_t seed, float noise) {
  if (examples < 1 || classes < 2)
    throw Error(Errc::invalid_argument, "make_spirals(" + std::to_string(examples) + ", " + std::to_string(classes) +
                                            ") (expected examples >= 1, classes >= 2)");
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> jitter(0.0f, noise);
  std::uniform_real_distribution<float> position(0.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(examples * 2));
  std::vector<float> y(static_cast<std::size_t>(examples));
  for (std::int64_t i = 0; i < examples; ++i) {
    std::int64_t const k = i % classes;
    float const t = position(rng);
    float const angle = 4.0f * t + 2.0f * std::numbers::pi_v<float> * static_cast<float>(k) / static_cast<float>(classes) + jitter(rng);
    x[static_cast<std::size_t>(2 * i)] = t * std::cos(angle);
    x[static_cast<std::size_t>(2 * i + 1)] = t * std::sin(angle);
    y[static_cast<std::size_t>(i)] = static_cast<float>(k);
  }
  return {std::move(x), std::move(y), 2, classes};
}

std::pair<InMemoryDataset, InMemoryDataset> split(InMemoryDataset const& data, double test_fraction, std::uint64_t seed) {
  if (!(test_fraction >= 0.0 && test_fraction < 1.0))
    throw Error(Errc::invalid_argument, "test fraction " + std::to_string(test_fraction) + " (expected 0 <= fraction < 1)");
  std::vector<std::int64_t> order(static_cast<std::size_t>(data.size()));
  std::iota(order.begin(), order.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(order.begin(), order.end(), rng);
  auto const test = static_cast<std::size_t>(std::llround(test_fraction * static_cast<double>(data.size())));
  if (test_fraction > 0 && (test == 0 || test == order.size()))
    throw Error(Errc::invalid_argument, "test fraction " + std::to_string(test_fraction) + " of " + std::to_string(data.size()) +
                                            " examples leaves an empty train or test set (expected both non-empty)");
  std::span<std::int64_t const> const all(order);
  return {data.subset(all.subspan(test)), data.subset(all.first(test))};
}

Normalizer Normalizer::fit(Dataset const& data) {
  std::int64_t const d = data.features();
  std::vector<double> sum(static_cast<std::size_t>(d));
  std::vector<double> sq(static_cast<std::size_t>(d));
  std::vector<float> x(static_cast<std::size_t>(d));
  for (std::int64_t i = 0; i < data.size(); ++i) {
    data.example(i, x);
    for (std::size_t j = 0; j < x.size(); ++j) {
      sum[j] += x[j];
      sq[j] += static_cast<double>(x[j]) * x[j];
    }
  }
  Normalizer n;
  auto const count = static_cast<double>(std::max<std::int64_t>(1, data.size()));
  for (std::size_t j = 0; j < x.size(); ++j) {
    double const mean = sum[j] / count;
    double const var = std::max(0.0, sq[j] / count - mean * mean);
    n.mean_.push_back(static_cast<float>(mean));
    n.inv_std_.push_back(var > 1e-12 ? static_cast<float>(1.0 / std::sqrt(var)) : 1.0f);
  }
  return n;
}

void Normalizer::apply(std::span<float> x) const {
  if (empty()) return;
  if (x.size() % mean_.size() != 0)
    throw Error(Errc::invalid_argument, "normalizing " + std::to_string(x.size()) + " values (expected a multiple of " +
                                            std::to_string(mean_.size()) + " features)");
  for (std::size_t i = 0; i < x.size(); ++i) {
    std::size_t const j = i % mean_.size();
    x[i] = (x[i] - mean_[j]) * inv_std_[j];
  }
}

}  // namespace mgpu::data
