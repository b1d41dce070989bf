// The torchrun-style rendezvous: a job started with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
// (and no MPI) meets over TCP. Process 0 listens on MASTER_PORT, every other process connects to
// MASTER_ADDR:MASTER_PORT, and the connections stay open for the job's few exchanges: the world's
// device list, the NCCL unique id and Gloo's addresses. Nothing else travels here (NCCL carries the
// GPUs' bytes, Gloo the host devices').
// Internal: not installed.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <mgpu/comm/communicator.hpp>
#include <mgpu/dist/dist.hpp>

namespace mgpu::dist::detail {

/// Joins the rendezvous `place` describes (a torchrun-style place of several processes): process 0
/// waits for every other one to connect, the others connect (retrying while process 0 is not yet
/// listening). Within `timeout`, else Error(timeout) naming the processes not heard from (on
/// process 0) or the address not reached (on the others). Error(communication) for a port that
/// cannot be listened on, an address that does not resolve, or a process that says it is another
/// rank or of another job size than expected. Process-wide: leave_rendezvous() ends it.
void join_rendezvous(Place const& place, std::chrono::milliseconds timeout);

/// Whether this process has joined a rendezvous (and not left it).
bool in_rendezvous();

/// The address this process reaches the others through (its end of a rendezvous connection, as
/// text): where the Gloo transport listens. Throws Error(communication) when the system does not say.
std::string rendezvous_address();

/// rendezvous_exchange() as a function of the bytes, with `timeout` (Gloo's store).
std::vector<std::vector<std::byte>> rendezvous_all_gather(std::span<std::byte const> mine, std::chrono::milliseconds timeout);

/// Closes the connections. Never throws; does nothing without a rendezvous.
void leave_rendezvous() noexcept;

/// Every process hands its bytes and gets every process's, in process order (collective: every
/// process calls it, the same number of times; `what` names the exchange in errors). Waits at most
/// `timeout`: a process not heard from in time is an Error(timeout) naming it, a closed connection
/// an Error(communication).
std::vector<std::vector<std::byte>> rendezvous_exchange(std::string_view what, std::span<std::byte const> mine,
                                                        std::chrono::milliseconds timeout);

/// The world through the rendezvous (make_world's torchrun-style path).
World rendezvous_world(DeviceGroup const& group, Place const& place, std::chrono::milliseconds timeout);

/// make_communicator's torchrun-style path for GPUs: one NCCL communicator (process 0's unique id
/// through the rendezvous). Host devices are refused here: they go over Gloo where the build has it
/// (process_communicator.cpp), else they need MPI (mpirun or srun).
std::unique_ptr<comm::Communicator> rendezvous_communicator(World const& world, DeviceGroup& group,
                                                            comm::Options options);

}  // namespace mgpu::dist::detail
