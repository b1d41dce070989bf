// The dist module's Gloo transport, its runtime (internal: not installed): which jobs use it, the
// job's one Gloo context (TCP, a full mesh between the processes) connected by make_world through
// the job's existing exchange (the torchrun-style rendezvous, or MPI: no second rendezvous), and the Gloo
// exchange of each communicator across processes (exchange_gloo.cpp). In a build without Gloo
// (no_gloo.cpp) no job uses it.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <mgpu/dist/dist.hpp>

#include "dist/common.hpp"
#include "dist/exchange.hpp"

namespace gloo {
class Context;
}  // namespace gloo

namespace mgpu::dist::detail {

/// The variable that picks the transport of host devices across processes: "gloo", "mpi" or
/// "auto" (unset: Gloo in a torchrun-style job, MPI under mpirun or srun).
inline constexpr char const* backend_env_var = "MGPU_DIST_BACKEND";

/// Whether the host bytes of the job `place` describes go over Gloo: a torchrun-style job of several
/// processes, or MGPU_DIST_BACKEND=gloo. Throws Error(invalid_argument) for another value than
/// gloo, mpi or auto, mpi in a torchrun-style job (no MPI there), and gloo in a build without Gloo.
bool gloo_wanted(Place const& place);

/// Every process's bytes, in process order (collective over every process of the job).
using AllGather = std::function<std::vector<std::vector<std::byte>>(std::span<std::byte const>)>;

/// Connects the job's Gloo context: every process listens on `address` (an address of this server
/// that the others reach) and connects to every other one, the addresses shared by one
/// `all_gather` (the job's exchange: no second rendezvous). Collective over every process, once (make_world's first call); waits at most
/// `timeout`, then Error(timeout); Error(communication) when Gloo fails.
void gloo_connect(Place const& place, std::string const& address, AllGather const& all_gather,
                  std::chrono::milliseconds timeout);

/// Whether gloo_connect() made the job's context.
bool gloo_connected();

/// The job's context (null before gloo_connect()).
std::shared_ptr<gloo::Context> gloo_context();

/// Drops the job's context (finalize()); after a failure it stays, as Gloo's threads may still
/// write into what the failed exchanges left behind. Never throws.
void gloo_leave(bool failed) noexcept;

/// The Gloo exchange of a communicator over `subset` (Subset::processes: the job's processes, the
/// context's ranks). Messages are matched by a slot: the communicator's number (from its list of
/// world ranks and how many communicators over that list this process made before), the round
/// and the call's number. Needs gloo_connect() first.
std::shared_ptr<Exchange> make_gloo_exchange(Subset const& subset);

}  // namespace mgpu::dist::detail
