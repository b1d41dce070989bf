// device_group_demo: lists the devices of a group, shards a batch across them, runs a computation
// on every device at once (a float32 -> bfloat16 -> float32 round trip on each device's stream) and
// checks the gathered result against the same computation on one device.
//
//   device_group_demo --devices host:4 --rows 100000
#include <CLI/CLI.hpp>

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <mgpu/mgpu.hpp>

namespace {

// The per-device computation: out = float32(bfloat16(in)), converted on the stream's device.
void round_trip(mgpu::Tensor const& in, mgpu::Tensor const& out, mgpu::Allocator& allocator, mgpu::Stream& stream) {
  mgpu::Tensor low = mgpu::Tensor::empty(in.shape(), mgpu::DType::bfloat16, allocator);
  mgpu::convert_async(low, in, stream);
  mgpu::convert_async(out, low, stream);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Shard a batch across a device group and check the result against one device"};
  std::string spec;
  std::int64_t rows = 65536;
  std::int64_t cols = 256;
  bool weighted = false;
  unsigned seed = 1;
  app.add_option("--devices", spec, "device spec: auto, host:N, cuda, cuda:0,1 (default: $MGPU_DEVICES or auto)");
  app.add_option("--rows", rows, "rows in the batch")->check(CLI::NonNegativeNumber);
  app.add_option("--cols", cols, "columns in the batch")->check(CLI::PositiveNumber);
  app.add_flag("--weighted", weighted, "shard in proportion to each device's throughput hint");
  app.add_option("--seed", seed, "seed for the batch's values");
  CLI11_PARSE(app, argc, argv);

  try {
    mgpu::DeviceGroup group = spec.empty() ? mgpu::DeviceGroup() : mgpu::DeviceGroup(spec);
    auto const peers = mgpu::peer_access_matrix(group.devices());
    std::printf("mgpu %s: %d device(s)\n", mgpu::version, group.size());
    std::vector<double> weights;
    for (int rank = 0; rank < group.size(); ++rank) {
      auto const props = mgpu::properties(group.device(rank));
      weights.push_back(props.throughput_gflops);
      std::string peer_row;
      for (bool p : peers[static_cast<std::size_t>(rank)]) peer_row += p ? '1' : '.';
      std::printf("  rank %d  %-7s  %-48.48s  %10s  %8.0f GFLOP/s  peers %s\n", rank,
                  group.device(rank).to_string().c_str(), props.name.c_str(),
                  mgpu::format_bytes(props.memory_bytes).c_str(), props.throughput_gflops, peer_row.c_str());
    }
    if (!weighted) weights.clear();

    auto host = mgpu::Allocator::create(mgpu::Device{mgpu::DeviceKind::host, 0});
    mgpu::Tensor batch = mgpu::Tensor::empty({rows, cols}, mgpu::DType::float32, *host);
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 10.0f);
    for (float& v : batch.host_span<float>()) v = normal(rng);

    // Sharded: each rank gets its rows, computes on its device, and writes back into `result`.
    mgpu::Tensor result = mgpu::Tensor::empty({rows, cols}, mgpu::DType::float32, *host);
    std::vector<mgpu::Tensor> const inputs = group.scatter(batch, weights);
    std::vector<mgpu::Tensor> const outputs = group.shard(result, weights);
    std::vector<double> milliseconds(static_cast<std::size_t>(group.size()));
    group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
      auto const r = static_cast<std::size_t>(rank);
      mgpu::Event start;
      mgpu::Event end;
      start.record(stream);
      mgpu::Tensor local = mgpu::Tensor::empty(inputs[r].shape(), mgpu::DType::float32, group.allocator(rank));
      round_trip(inputs[r], local, group.allocator(rank), stream);
      mgpu::copy_async(outputs[r], local, stream);
      end.record(stream);
      end.synchronize();
      milliseconds[r] = mgpu::Event::elapsed_ms(start, end);
    });

    // Reference: the whole batch on one host device.
    mgpu::Stream reference_stream(mgpu::Device{mgpu::DeviceKind::host, 0});
    mgpu::Tensor expected = mgpu::Tensor::empty({rows, cols}, mgpu::DType::float32, *host);
    round_trip(batch, expected, *host, reference_stream);
    reference_stream.synchronize();

    auto const sizes = mgpu::shard_sizes(rows, group.size(), weights);
    for (int rank = 0; rank < group.size(); ++rank) {
      auto const r = static_cast<std::size_t>(rank);
      std::printf("  rank %d: %lld rows in %.2f ms\n", rank, static_cast<long long>(sizes[r]), milliseconds[r]);
    }
    bool const same = std::memcmp(result.data(), expected.data(), result.nbytes()) == 0;
    std::printf("sharded result %s the single-device result (%lld x %lld float32)\n",
                same ? "matches" : "DIFFERS FROM", static_cast<long long>(rows), static_cast<long long>(cols));
    return same ? 0 : 1;
  } catch (mgpu::Error const& e) {
    std::fprintf(stderr, "device_group_demo: %s\n", e.what());
    return 2;
  }
}
