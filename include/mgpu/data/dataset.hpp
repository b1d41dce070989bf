// Datasets: labelled examples with float32 features, loaded from CSV or MNIST IDX files or made by
// seeded generators, split into train and test sets, and normalized with statistics of the
// training set. Malformed files throw Error(corrupt_data) naming the file and the line or byte.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace mgpu::data {

/// A labelled dataset. Labels are class ids 0..classes()-1 stored as float (classes() > 0), or
/// real-valued regression targets (classes() == 0).
class Dataset {
 public:
  virtual ~Dataset() = default;
  [[nodiscard]] virtual std::int64_t size() const = 0;
  [[nodiscard]] virtual std::int64_t features() const = 0;
  [[nodiscard]] virtual std::int64_t classes() const = 0;
  /// Copies example i's features into x (features() floats) and returns its label.
  virtual float example(std::int64_t i, std::span<float> x) const = 0;
};

/// A dataset held in memory, row-major.
class InMemoryDataset final : public Dataset {
 public:
  InMemoryDataset() = default;
  /// Throws Error(invalid_argument) when the sizes disagree or a label is not a class id below
  /// `classes` (when classes > 0).
  InMemoryDataset(std::vector<float> features, std::vector<float> labels, std::int64_t feature_count, std::int64_t classes);
  std::int64_t size() const override { return static_cast<std::int64_t>(labels_.size()); }
  std::int64_t features() const override { return feature_count_; }
  std::int64_t classes() const override { return classes_; }
  float example(std::int64_t i, std::span<float> x) const override;
  [[nodiscard]] std::span<float const> feature_data() const noexcept { return features_; }
  [[nodiscard]] std::span<float const> labels() const noexcept { return labels_; }
  /// Class names when labels were text in the file (class id = index), else empty.
  [[nodiscard]] std::vector<std::string> const& class_names() const noexcept { return class_names_; }
  void set_class_names(std::vector<std::string> names) { class_names_ = std::move(names); }
  /// The examples at `rows`, in that order.
  [[nodiscard]] InMemoryDataset subset(std::span<std::int64_t const> rows) const;

 private:
  std::vector<float> features_;
  std::vector<float> labels_;
  std::int64_t feature_count_ = 0;
  std::int64_t classes_ = 0;
  std::vector<std::string> class_names_;
};

struct CsvOptions {
  /// The label's column; negative counts from the end (-1: the last).
  std::int64_t label_column = -1;
  /// Whether the first line names the columns; unset: a header when its fields are not all numbers.
  std::optional<bool> header{};
  char delimiter = ',';
  /// Classification (labels become class ids: whole numbers as they are, text labels numbered in
  /// sorted order) or regression (labels must be numbers).
  bool classification = true;
};

/// Loads a numeric CSV file (label column numeric or text).
InMemoryDataset load_csv(std::filesystem::path const& path, CsvOptions const& options = {});

/// Loads MNIST-format IDX files: images (magic 0x00000803, unsigned bytes, N x rows x cols) and
/// labels (magic 0x00000801, N unsigned bytes). Pixels become floats in [0, 1].
InMemoryDataset load_idx(std::filesystem::path const& images, std::filesystem::path const& labels);

/// `classes` Gaussian clusters in `features` dimensions: centres drawn uniformly in [-1, 1]^d times
/// `separation`, unit-variance noise; deterministic for a seed. Example i belongs to class i % classes.
InMemoryDataset make_clusters(std::int64_t examples, std::int64_t features, std::int64_t classes, std::uint64_t seed,
                              float separation = 3.0f);
/// Interleaved 2-D spirals, one arm per class, with noise; deterministic for a seed.
InMemoryDataset make_spirals(std::int64_t examples, std::int64_t classes, std::uint64_t seed, float noise = 0.1f);

/// A seeded random split: (train, test) with round(test_fraction * size) test examples.
std::pair<InMemoryDataset, InMemoryDataset> split(InMemoryDataset const& data, double test_fraction, std::uint64_t seed);

/// Per-feature standardization x' = (x - mean) / std, with statistics from one dataset (the
/// training set) applied to any other. Constant features get std 1.
class Normalizer {
 public:
  Normalizer() = default;
  static Normalizer fit(Dataset const& data);
  void apply(std::span<float> x) const;
  [[nodiscard]] bool empty() const noexcept { return mean_.empty(); }
  [[nodiscard]] std::vector<float> const& mean() const noexcept { return mean_; }
  [[nodiscard]] std::vector<float> const& inv_std() const noexcept { return inv_std_; }

 private:
  std::vector<float> mean_;
  std::vector<float> inv_std_;
};

}  // namespace mgpu::data
