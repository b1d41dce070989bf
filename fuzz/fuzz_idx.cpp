// Fuzz target: load_idx (src/data/dataset.cpp). The first two bytes give the images file's
// length (little-endian, clamped to the input); the images file follows, then the labels file.
#include <mgpu/data/dataset.hpp>

#include <algorithm>
#include <vector>

#include "fuzz_support.hpp"

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  if (size < 2) return 0;
  std::size_t const images = std::min<std::size_t>(size - 2, data[0] | (std::size_t{data[1]} << 8));
  auto const image_path = mgpu::fuzz::write_input("idx-images", data + 2, images);
  auto const label_path = mgpu::fuzz::write_input("idx-labels", data + 2 + images, size - 2 - images);
  // Errors name one of the two files; both paths share this prefix.
  std::string const prefix = image_path.string().substr(0, image_path.string().size() - std::string("images").size());
  mgpu::fuzz::expect_load_or_error(prefix, [&] {
    auto const set = mgpu::data::load_idx(image_path, label_path);
    std::vector<float> x(static_cast<std::size_t>(set.features()));
    for (std::int64_t i = 0; i < set.size(); ++i) (void)set.example(i, x);
  });
  return 0;
}
