// Words, failures and shard numbers agreed between the processes of a job (see agreement.hpp).
#include "comm/agreement.hpp"

#include <mgpu/core/error.hpp>
#include <mgpu/core/tensor.hpp>

#include "core/backend.hpp"

namespace mgpu::comm::detail {

std::vector<std::int32_t> all_gather_words(Communicator& comm, DeviceGroup& group,
                                           std::vector<std::vector<std::int32_t>> const& words) {
  int const first = comm.first_rank();
  auto const k = static_cast<std::int64_t>(words.front().size());
  std::int64_t const total = k * comm.size();
  Allocator& host = mgpu::detail::host_staging_allocator();
  std::vector<Tensor> staged, sends, recvs;
  // Carried as float32 (what communicators take), whose all_gather copies the bits as they are.
  for (std::size_t r = 0; r < words.size(); ++r) {
    staged.push_back(Tensor::empty({total}, DType::float32, host));
    std::memcpy(staged.back().data(), words[r].data(), words[r].size() * sizeof(std::int32_t));
    sends.push_back(Tensor::empty({k}, DType::float32, group.allocator(static_cast<int>(r))));
    recvs.push_back(Tensor::empty({total}, DType::float32, group.allocator(static_cast<int>(r))));
  }
  group.run([&](int rank, Device, Stream& stream) {
    auto const r = static_cast<std::size_t>(rank);
    copy_async(sends[r], staged[r].slice(0, k), stream);
    comm.all_gather(first + rank, sends[r], recvs[r], stream);
    copy_async(staged[r], recvs[r], stream);
  });
  group.synchronize();
  std::vector<std::int32_t> all(static_cast<std::size_t>(total));
  std::memcpy(all.data(), staged[0].data(), all.size() * sizeof(std::int32_t));
  return all;
}

void agree(Communicator& comm, DeviceGroup& group, std::exception_ptr failure, std::string const& what) {
  std::vector<std::int32_t> const all = all_gather_words(
      comm, group, std::vector<std::vector<std::int32_t>>(static_cast<std::size_t>(group.size()), {failure ? 1 : 0}));
  if (failure) std::rethrow_exception(failure);
  for (std::size_t rank = 0; rank < all.size(); ++rank)
    if (all[rank] != 0)
      throw Error(Errc::io, what + ": the process of world rank " + std::to_string(rank) +
                                " failed (its error names why); rank " + std::to_string(comm.first_rank()) +
                                "'s process stops too");
}

void agree(Communicator* comm, DeviceGroup& group, std::exception_ptr failure, std::string const& what) {
  if (comm != nullptr) return agree(*comm, group, std::move(failure), what);
  if (failure) std::rethrow_exception(failure);
}

void save_in_shards(Communicator& comm, DeviceGroup& group, std::string const& what,
                    std::function<std::uint64_t()> const& next_save_id,
                    std::function<void(std::uint64_t save_id, int shard, int shards)> const& write,
                    std::function<void(std::uint64_t save_id, int shards)> const& commit) {
  bool const leader = comm.first_rank() == 0;
  // The save's id (world rank 0's, read before anyone commits), and this process's shard: the
  // processes in the order of their first ranks.
  std::uint64_t next = 0;
  std::exception_ptr failure;
  try {
    if (leader) next = next_save_id();
  } catch (...) {
    failure = std::current_exception();
  }
  agree(comm, group, failure, what);
  std::vector<std::int32_t> words{comm.first_rank()};
  append_words(words, next);
  std::vector<std::int32_t> const all =
      all_gather_words(comm, group, std::vector<std::vector<std::int32_t>>(static_cast<std::size_t>(group.size()), words));
  std::uint64_t const save_id = read_words<std::uint64_t>(all, 1);
  int shard = 0, shards = 0;
  for (std::size_t at = 0; at < all.size(); at += 3) {
    if (at > 0 && all[at] == all[at - 3]) continue;
    if (all[at] == comm.first_rank()) shard = shards;
    ++shards;
  }
  try {
    write(save_id, shard, shards);
  } catch (...) {
    failure = std::current_exception();
  }
  agree(comm, group, failure, what);
  try {
    if (leader) commit(save_id, shards);
  } catch (...) {
    failure = std::current_exception();
  }
  agree(comm, group, failure, what);  // every process returns once the save is committed
}

}  // namespace mgpu::comm::detail
