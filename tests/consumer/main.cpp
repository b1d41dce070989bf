// Shards a batch across two host devices and checks each rank saw its own rows; then runs one GEMM
// on a host stream (linking the host GEMM's backend, oneDNN or Eigen) and checks its result.
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
  // [[1, 2], [3, 4]] x [[5, 6], [7, 8]] = [[19, 22], [43, 50]]
  mgpu::Tensor a = mgpu::Tensor::empty({2, 2}, mgpu::DType::float32, group.allocator(0));
  mgpu::Tensor b = mgpu::Tensor::empty({2, 2}, mgpu::DType::float32, group.allocator(0));
  mgpu::Tensor c = mgpu::Tensor::empty({2, 2}, mgpu::DType::float32, group.allocator(0));
  for (int i = 0; i < 4; ++i) {
    a.host_span<float>()[static_cast<std::size_t>(i)] = static_cast<float>(i + 1);
    b.host_span<float>()[static_cast<std::size_t>(i)] = static_cast<float>(i + 5);
  }
  mgpu::ops::gemm(a, false, b, false, c, 1.0f, 0.0f, group.stream(0));
  group.stream(0).synchronize();
  auto const product = c.host_span<float>();
  bool const gemm_ok = product[0] == 19 && product[1] == 22 && product[2] == 43 && product[3] == 50;
  bool const ok = sums[0] == 0 + 1 + 2 + 3 + 4 + 5 && sums[1] == 6 + 7 + 8 + 9 && gemm_ok;
  std::printf("mgpu %s consumer: rank sums %g and %g, GEMM (%s) %s: %s\n", mgpu::version, sums[0], sums[1], mgpu::host_gemm_backend,
              gemm_ok ? "right" : "wrong", ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
