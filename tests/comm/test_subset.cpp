// Communicators over subsets of a group's ranks: two disjoint subsets reduce at once, each rank in
// its own subset's rank numbering, beside a communicator over the whole group.
#include <mgpu/comm/communicator.hpp>
#include <mgpu/core/device_group.hpp>

#include <vector>

#include "support/catch.hpp"
#include "support/expect_error.hpp"

using mgpu::Tensor;

TEST_CASE("subset communicators reduce over their ranks only", "[comm][host]") {
  mgpu::DeviceGroup group("host:4");
  std::vector<std::vector<int>> const subsets{{0, 2}, {3, 1}};
  std::vector<std::unique_ptr<mgpu::comm::Communicator>> comms;
  for (auto const& s : subsets) comms.push_back(mgpu::comm::make_communicator(group, s));
  auto whole = mgpu::comm::make_communicator(group);
  CHECK(comms[0]->size() == 2);
  std::vector<Tensor> sub(4), all(4);
  group.run([&](int rank, mgpu::Device, mgpu::Stream& stream) {
    int const which = rank == 0 || rank == 2 ? 0 : 1;
    int const sub_rank = rank == subsets[static_cast<std::size_t>(which)][0] ? 0 : 1;
    sub[static_cast<std::size_t>(rank)] = Tensor::empty({5}, mgpu::DType::float32, group.allocator(rank));
    all[static_cast<std::size_t>(rank)] = Tensor::empty({5}, mgpu::DType::float32, group.allocator(rank));
    for (int i = 0; i < 5; ++i) {
      sub[static_cast<std::size_t>(rank)].host_span<float>()[static_cast<std::size_t>(i)] = static_cast<float>((rank + 1) * (i + 1));
      all[static_cast<std::size_t>(rank)].host_span<float>()[static_cast<std::size_t>(i)] = static_cast<float>(rank * 10 + i);
    }
    comms[static_cast<std::size_t>(which)]->all_reduce(sub_rank, sub[static_cast<std::size_t>(rank)], sub[static_cast<std::size_t>(rank)],
                                                       mgpu::comm::ReduceOp::sum, stream);
    whole->all_reduce(rank, all[static_cast<std::size_t>(rank)], all[static_cast<std::size_t>(rank)], mgpu::comm::ReduceOp::max, stream);
  });
  for (int rank = 0; rank < 4; ++rank) {
    float const members = rank == 0 || rank == 2 ? 1 + 3 : 4 + 2;  // (rank + 1) summed over the subset
    for (int i = 0; i < 5; ++i) {
      CHECK(sub[static_cast<std::size_t>(rank)].host_span<float>()[static_cast<std::size_t>(i)] == members * static_cast<float>(i + 1));
      CHECK(all[static_cast<std::size_t>(rank)].host_span<float>()[static_cast<std::size_t>(i)] == static_cast<float>(30 + i));
    }
  }
  REQUIRE_MGPU_ERROR(mgpu::comm::make_communicator(group, std::vector<int>{}), mgpu::Errc::invalid_argument, "over no ranks");
  REQUIRE_MGPU_ERROR(mgpu::comm::make_communicator(group, std::vector<int>{1, 1}), mgpu::Errc::invalid_argument, "rank 1 twice");
  REQUIRE_MGPU_ERROR(mgpu::comm::make_communicator(group, std::vector<int>{0, 4}), mgpu::Errc::invalid_argument,
                     "rank 4 of a group of 4 (expected ranks in [0, 4))");
}
