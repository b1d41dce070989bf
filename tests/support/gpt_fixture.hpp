// The PyTorch parity fixture (tests/data/gpt_fixture_L2H2C32T16B2.bin) read into memory.
//
// Format (little-endian): char[8] "GPTFIX01"; int32[8] version, n_layer, n_head, n_embd, block T,
// vocab V, batch B, steps S; int32 n_tensors; int32 inputs[B T]; int32 targets[B T]; float32
// logits[B T V]; float32 loss; float32 losses[S] (the loss before each of S AdamW steps on the same
// batch: lr 1e-3, betas 0.9 / 0.95, eps 1e-8, no weight decay); then per tensor, in PyTorch's
// named_parameters order: int32 name length, the name, int32 ndim, int32 shape[ndim], float32
// values, float32 gradient.
#pragma once

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <mgpu/core/tensor.hpp>

#include "support/catch.hpp"

namespace mgpu::test {

struct Fixture {
  std::int32_t n_layer = 0, n_head = 0, n_embd = 0, block = 0, vocab = 0, batch = 0, steps = 0;
  std::vector<std::int32_t> inputs, targets;
  std::vector<float> logits;
  float loss = 0;
  std::vector<float> losses;
  struct Record {
    std::string name;
    mgpu::Shape shape;
    std::vector<float> value, grad;
  };
  std::vector<Record> tensors;
};

inline Fixture read_fixture(std::string const& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  std::vector<char> const bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::size_t at = 0;
  auto take = [&](void* dst, std::size_t n) {
    REQUIRE(at + n <= bytes.size());
    std::memcpy(dst, bytes.data() + at, n);
    at += n;
  };
  auto i32 = [&] {
    std::int32_t v = 0;
    take(&v, 4);
    return v;
  };
  auto floats = [&](std::size_t n) {
    std::vector<float> v(n);
    take(v.data(), 4 * n);
    return v;
  };
  char magic[8];
  take(magic, 8);
  REQUIRE(std::string(magic, 8) == "GPTFIX01");
  Fixture f;
  REQUIRE(i32() == 1);
  f.n_layer = i32(), f.n_head = i32(), f.n_embd = i32(), f.block = i32(), f.vocab = i32(), f.batch = i32(),
  f.steps = i32();
  std::int32_t const n_tensors = i32();
  auto const tokens = static_cast<std::size_t>(f.batch * f.block);
  f.inputs.resize(tokens);
  f.targets.resize(tokens);
  take(f.inputs.data(), 4 * tokens);
  take(f.targets.data(), 4 * tokens);
  f.logits = floats(tokens * static_cast<std::size_t>(f.vocab));
  f.loss = floats(1)[0];
  f.losses = floats(static_cast<std::size_t>(f.steps));
  for (std::int32_t k = 0; k < n_tensors; ++k) {
    Fixture::Record r;
    r.name.resize(static_cast<std::size_t>(i32()));
    take(r.name.data(), r.name.size());
    std::int32_t const ndim = i32();
    std::size_t n = 1;
    for (std::int32_t d = 0; d < ndim; ++d) {
      r.shape.push_back(i32());
      n *= static_cast<std::size_t>(r.shape.back());
    }
    r.value = floats(n);
    r.grad = floats(n);
    f.tensors.push_back(std::move(r));
  }
  REQUIRE(at == bytes.size());
  return f;
}

}  // namespace mgpu::test
