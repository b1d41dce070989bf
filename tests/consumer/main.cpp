// Shards a batch across two host devices and checks each rank saw its own rows.
#include <cstdio>
#include <mgpu/mgpu.hpp>

int main() {
  mgpu::DeviceGroup group("host:2");
  mgpu::Tensor batch = mgpu::Tensor::empty({5, 2}, mgpu::DType::float32, group.allocator(0));
  float next = 0;
  for (float& v : batch.host_span<float>()) v = next++;
  auto const parts = group.scatter(batch);
  float sums[2] = {0, 0};
  group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
    // In stream order, after the scatter's copy to this rank.
    stream.enqueue([&, rank] {
      for (float v : parts[static_cast<std::size_t>(rank)].host_span<float>()) sums[rank] += v;
    });
  });
  bool const ok = sums[0] == 0 + 1 + 2 + 3 + 4 + 5 && sums[1] == 6 + 7 + 8 + 9;
  std::printf("mgpu %s consumer: rank sums %g and %g: %s\n", mgpu::version, sums[0], sums[1], ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
