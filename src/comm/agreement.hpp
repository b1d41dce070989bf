// What the processes of a job exchange besides tensors, through a communicator over every
// process's ranks: a few words from every rank, whether any process failed (so that none waits for
// one that failed), and a save written as one shard per process (the executors' checkpoints across
// processes). Internal: not installed.
#pragma once

#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include <mgpu/comm/communicator.hpp>
#include <mgpu/core/device_group.hpp>

namespace mgpu::comm::detail {

// 64-bit values as pairs of 32-bit words, for all_gather_words.
template <class T>
void append_words(std::vector<std::int32_t>& words, T value) {
  static_assert(sizeof(T) == 8);
  std::int32_t halves[2];
  std::memcpy(halves, &value, sizeof value);
  words.insert(words.end(), halves, halves + 2);
}
template <class T>
T read_words(std::vector<std::int32_t> const& words, std::size_t at) {
  static_assert(sizeof(T) == 8);
  T value;
  std::memcpy(&value, words.data() + at, sizeof value);
  return value;
}

// Every rank's `words` (one list per rank of `group`, as many words on every rank of the world),
// from every process, in `comm`'s rank order; `comm` spans `group`'s ranks from comm.first_rank().
std::vector<std::int32_t> all_gather_words(Communicator& comm, DeviceGroup& group,
                                           std::vector<std::vector<std::int32_t>> const& words);

// Throws, on every process, the first failing process's error: this process's `failure` (rethrown)
// or an Error(io) naming the world rank of the process that failed. Every process calls it at the
// same point, so none waits in a later collective for one that failed.
void agree(Communicator& comm, DeviceGroup& group, std::exception_ptr failure, std::string const& what);
// The same where `comm` may be null (one process): then only this process's `failure` is rethrown.
void agree(Communicator* comm, DeviceGroup& group, std::exception_ptr failure, std::string const& what);

// A save written as one shard per process, every step agreed on by every process: world rank 0's
// process takes the save's id (`next_save_id`, e.g. one more than the folder's committed one); every
// process writes its shard (`write(save_id, shard, shards)`: the processes numbered in the order of
// their first ranks); once all have, world rank 0's process commits it (`commit(save_id, shards)`).
// Returns on every process once the save is committed; throws on every process when any step
// failed on any process (`what` names the save).
void save_in_shards(Communicator& comm, DeviceGroup& group, std::string const& what,
                    std::function<std::uint64_t()> const& next_save_id,
                    std::function<void(std::uint64_t save_id, int shard, int shards)> const& write,
                    std::function<void(std::uint64_t save_id, int shards)> const& commit);

}  // namespace mgpu::comm::detail
