// Fuzz target: load_csv (src/data/dataset.cpp). The first byte picks the options (header
// auto/yes/no, label column, delimiter, classification or regression); the rest is the file.
#include <mgpu/data/dataset.hpp>

#include <vector>

#include "fuzz_support.hpp"

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  if (size < 1) return 0;
  mgpu::data::CsvOptions options;
  std::uint8_t const mode = data[0];
  if ((mode & 3) == 1) options.header = true;
  if ((mode & 3) == 2) options.header = false;
  options.label_column = (mode & 4) ? 0 : -1;
  options.delimiter = (mode & 8) ? ';' : ',';
  options.classification = (mode & 16) == 0;
  auto const path = mgpu::fuzz::write_input("csv", data + 1, size - 1);
  mgpu::fuzz::expect_load_or_error(path.string(), [&] {
    auto const set = mgpu::data::load_csv(path, options);
    std::vector<float> x(static_cast<std::size_t>(set.features()));
    for (std::int64_t i = 0; i < set.size(); ++i) (void)set.example(i, x);
  });
  return 0;
}
