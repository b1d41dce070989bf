// Fuzz target: read_llmc_model (src/io/llmc.cpp). The input is the model file; one that loads is
// written back and read again, and must give the same configuration and parameters, bit for bit.
#include <cstdlib>
#include <cstring>

#include <mgpu/io/llmc.hpp>

#include "fuzz_support.hpp"

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  auto const path = mgpu::fuzz::write_input("llmc", data, size);
  mgpu::fuzz::expect_load_or_error(path.string(), [&] {
    auto const model = mgpu::io::read_llmc_model(path);
    mgpu::io::write_llmc_model(path, model.config, model.parameters, model.padded_vocab);
    auto const again = mgpu::io::read_llmc_model(path, model.config);
    if (again.padded_vocab != model.padded_vocab || again.parameters.size() != model.parameters.size() ||
        std::memcmp(again.parameters.data(), model.parameters.data(), 4 * model.parameters.size()) != 0)
      std::abort();
  });
  return 0;
}
