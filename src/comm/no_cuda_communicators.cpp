// The CUDA backends' factories in a build without CUDA: they say what the build lacks.
#include <mgpu/core/error.hpp>

#include "comm/cuda_communicators.hpp"

namespace mgpu::comm::detail {

std::unique_ptr<Communicator> make_nccl_communicator(DeviceGroup&, std::vector<int> const&, std::chrono::milliseconds) {
  throw Error(Errc::device, "the nccl backend: mgpu was built without CUDA (configure with MGPU_WITH_CUDA=ON)");
}

std::unique_ptr<Communicator> make_cuda_peer_communicator(DeviceGroup&, std::vector<int> const&, std::chrono::milliseconds) {
  throw Error(Errc::device, "the cuda_peer backend: mgpu was built without CUDA (configure with MGPU_WITH_CUDA=ON)");
}

std::vector<std::byte> nccl_unique_id() {
  throw Error(Errc::device, "the nccl backend: mgpu was built without CUDA (configure with MGPU_WITH_CUDA=ON)");
}

std::unique_ptr<Communicator> make_nccl_world_communicator(DeviceGroup&, std::vector<int> const&, int, int,
                                                           std::vector<std::byte> const&, std::chrono::milliseconds) {
  throw Error(Errc::device, "the nccl backend: mgpu was built without CUDA (configure with MGPU_WITH_CUDA=ON)");
}

}  // namespace mgpu::comm::detail
