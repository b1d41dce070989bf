// Several processes: this process's place in the job, the world's device list, and communicators
// across processes (over MPI or Gloo; NCCL for GPUs). The design is in docs/multi-process.md.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <mgpu/comm/communicator.hpp>
#include <mgpu/core/device.hpp>
#include <mgpu/core/device_group.hpp>

namespace mgpu::dist {

/// Who started the process, as its environment tells.
enum class Launcher {
  none,      ///< no launcher variables: a job of one process
  openmpi,   ///< OpenMPI's mpirun: OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK
  slurm,     ///< Slurm's srun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID
  torchrun,  ///< torchrun-style: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
};

std::string_view to_string(Launcher launcher) noexcept;

/// This process's place in the job.
struct Place {
  Launcher launcher = Launcher::none;
  int rank = 0;             ///< the process's index in [0, size)
  int size = 1;             ///< how many processes the job has
  int local_rank = 0;       ///< the process's index among those on its server
  std::string host;         ///< this server's host name (init() fills it; parse_environment() leaves it empty)
  std::string master_addr;  ///< torchrun-style MASTER_ADDR, when set
  int master_port = 0;      ///< torchrun-style MASTER_PORT, when set (else 0)
  /// The thread support MPI gave ("multiple", "serialized", ...), or "" without MPI.
  std::string mpi_thread_level;
};

/// A launcher's variables by name (what parse_environment() reads).
using Environment = std::map<std::string, std::string, std::less<>>;

/// The variables parse_environment() reads: OpenMPI's, then Slurm's, then torchrun-style.
std::vector<std::string> const& environment_variables();

/// The place that `environment` describes (a pure function). Throws Error(invalid_argument) naming
/// the variable, its value and what was expected: rank and size whole with 0 <= rank < size, local
/// rank in [0, size), MASTER_PORT in [1, 65535].
Place parse_environment(Environment const& environment);

/// Reads the launcher's environment and joins the job: initializes MPI under mpirun or srun (at
/// least MPI_THREAD_SERIALIZED), or meets over TCP at MASTER_ADDR:MASTER_PORT in a torchrun-style
/// job; MGPU_DIST_BACKEND (auto, gloo, mpi) picks host devices' transport. A second call returns
/// the same place. Throws Error(invalid_argument) for a bad environment or backend, or a job of
/// several processes that needs MPI in a build without it; Error(timeout) when the rendezvous
/// misses processes; Error(communication) when MPI or the rendezvous fails.
Place init();

/// Leaves the job: closes the rendezvous, finalizes MPI if init() initialized it (not after a
/// cross-process communicator failed; then exit with a failure status). Never throws; idempotent.
void finalize() noexcept;

/// init() for a scope, finalize() at its end.
class Session {
 public:
  Session() : place_(init()) {}
  ~Session() { finalize(); }
  Session(Session const&) = delete;
  Session& operator=(Session const&) = delete;
  [[nodiscard]] Place const& place() const noexcept { return place_; }

 private:
  Place place_;
};

/// One device of the world.
struct WorldDevice {
  int rank = 0;        ///< its rank in the world: its index in World::devices
  Device device;       ///< the device, as its own process names it
  int process = 0;     ///< the process that drives it
  int local_rank = 0;  ///< its rank in that process's DeviceGroup
  std::string host;    ///< the host name of that process's server
};

/// Every device of every process, process by process, each in its DeviceGroup's rank order.
struct World {
  int process = 0;    ///< this process
  int processes = 1;  ///< how many processes
  std::vector<WorldDevice> devices;

  [[nodiscard]] int size() const noexcept { return static_cast<int>(devices.size()); }
  /// The world rank of `process`'s first device.
  [[nodiscard]] int first_rank(int process) const;
  /// How many devices `process` drives.
  [[nodiscard]] int local_size(int process) const;
  /// The world rank of this process's local rank `local_rank`.
  [[nodiscard]] int rank_of(int local_rank) const { return first_rank(process) + local_rank; }
};

/// The world's device list, the same on every process; each passes its own DeviceGroup (at least
/// one device). Collective over the processes; needs init(). Throws Error(timeout) when the others
/// do not arrive within `timeout` (zero: comm::default_timeout()).
World make_world(DeviceGroup const& group, std::chrono::milliseconds timeout = std::chrono::milliseconds(0));

/// A communicator over every device of `world` (all host devices, or all CUDA GPUs): rank r is
/// world.devices[r], and each process calls the operations for its own ranks only, in the same
/// order. Results are bitwise deterministic; a process not heard from within options.timeout fails
/// the others with Error(timeout) naming it. Collectives may not be in a group_start() group.
/// Collective over the processes; `group` must be the one `world` was made from and outlive it.
/// Throws Error(invalid_argument) for other devices, a world of mixed kinds, a GPU listed twice
/// on a server, or another backend than automatic or the devices'; Error(device) without NCCL.
std::unique_ptr<comm::Communicator> make_communicator(World const& world, DeviceGroup& group,
                                                      comm::Options options = {});

/// A communicator over some ranks of `world`: its rank i is world rank world_ranks[i]. Only the
/// processes that drive those ranks call it, with the same list, in the same order as their other
/// subset communicators; each process's ranks must be next to each other in the list. CUDA GPUs
/// across processes get one NCCL communicator, its unique id from the subset's first process over
/// MPI or the job's Gloo context (a torchrun-style job without Gloo has neither). Needs
/// make_world(). Throws Error(timeout) naming a member not heard from, Error(invalid_argument) for
/// another list among the members, an empty list, a repeated or out-of-range rank, a process's
/// ranks apart, a list without this process's ranks, and as make_communicator(world, group,
/// options) does.
std::unique_ptr<comm::Communicator> make_communicator(World const& world, DeviceGroup& group,
                                                      std::vector<int> const& world_ranks, comm::Options options = {});

/// make_communicator(world, group, options) as a factory for the executors' make_communicator.
std::function<std::unique_ptr<comm::Communicator>(DeviceGroup&, comm::Options)> communicator_factory(World world);

/// make_communicator(world, group, world_ranks, options) as a factory (TensorParallelOptions).
using SubsetFactory =
    std::function<std::unique_ptr<comm::Communicator>(DeviceGroup&, std::vector<int> const&, comm::Options)>;
SubsetFactory subset_communicator_factory(World world);

}  // namespace mgpu::dist
