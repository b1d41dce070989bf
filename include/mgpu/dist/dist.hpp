// Several processes, one per server (or per socket, or per GPU): where this process sits among the
// job's processes (read from the launcher's environment), the world's device list, and a
// communicator over every device of every process. MPI (built with MGPU_WITH_MPI) carries the
// bootstrap and the host bytes, or Gloo (MGPU_WITH_GLOO) in a torchrun-style job; without MPI only
// a job of one process, or a torchrun-style job of GPUs, works.
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
  /// The thread support MPI gave ("multiple", "serialized", "funneled" or "single"), or "" when
  /// MPI is not in use (a job of one process, or a build without MPI).
  std::string mpi_thread_level;
};

/// A launcher's variables by name (what parse_environment() reads).
using Environment = std::map<std::string, std::string, std::less<>>;

/// The variables parse_environment() reads, in the order it looks for launchers: OpenMPI's first,
/// then Slurm's, then torchrun-style.
std::vector<std::string> const& environment_variables();

/// The place that `environment` describes; a pure function (init() passes the process's
/// environment). A launcher counts when its rank or size variable is set; then both must be whole
/// numbers with 0 <= rank < size, and the local rank (0 when unset) one with 0 <= local rank <
/// size; MASTER_PORT must be in [1, 65535]. Throws Error(invalid_argument) naming the variable,
/// its value and what was expected.
Place parse_environment(Environment const& environment);

/// Reads the launcher's environment and joins the job: under mpirun or srun it initializes MPI
/// (asking for MPI_THREAD_MULTIPLE, and needing at least MPI_THREAD_SERIALIZED: mgpu calls MPI from
/// several threads, one at a time) unless the program already did, and checks that MPI's rank and
/// size agree with the environment. A torchrun-style job of several processes (no MPI) meets over
/// TCP instead: process 0 listens on MASTER_PORT and waits for every other process to connect to
/// MASTER_ADDR:MASTER_PORT (within comm::default_timeout(), else Error(timeout) naming the ranks
/// missing, or the address not reached); that rendezvous carries make_world's exchange, the NCCL
/// unique id and the addresses of the job's Gloo context (host devices' bytes go over Gloo, in a
/// build with MGPU_WITH_GLOO). MGPU_DIST_BACKEND picks the transport of host devices: auto (unset:
/// Gloo in a torchrun-style job, MPI under mpirun or srun), gloo (under mpirun or srun too), or mpi;
/// another value, mpi in a torchrun-style job, or gloo in a build without Gloo is an
/// Error(invalid_argument). A second call returns the same place. Throws Error(invalid_argument) for a bad environment (a torchrun-style job of several
/// processes without MASTER_ADDR or MASTER_PORT, too) and for an mpirun or srun job of several
/// processes in a build without MPI; Error(communication) when MPI or the rendezvous fails.
Place init();

/// Leaves the job: closes the rendezvous's connections, finalizes MPI if init() initialized it. When a cross-process communicator failed
/// (a peer timed out or the communicator was aborted) it leaves MPI as it is, since MPI_Finalize
/// would wait for the peers that failed; the process should then exit with a failure status. Never
/// throws; a second call does nothing.
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

/// Every device of every process, process by process (process 0's devices first, each process's in
/// its DeviceGroup's rank order): world rank r is the r-th device.
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

/// The world's device list: every process calls it with its own DeviceGroup (at least one device
/// each; the counts may differ) and gets the same list (over MPI, or the torchrun-style rendezvous).
/// Where host devices go over Gloo, the first call also connects the job's Gloo context (a TCP
/// connection between every two processes, on the address this process reaches process 0 from, or
/// its host name under mpirun; their addresses through the same exchange). Collective over the
/// processes; waits at
/// most `timeout` (zero: comm::default_timeout()) for the others, then throws Error(timeout). Needs
/// init() first.
World make_world(DeviceGroup const& group, std::chrono::milliseconds timeout = std::chrono::milliseconds(0));

/// A communicator over every device of `world` (host devices, or CUDA GPUs), with comm's
/// Communicator interface: rank r is world.devices[r], and each process calls the operations for
/// its own ranks only (world.rank_of(local rank), with that device's stream), in the same order as
/// a single-process communicator. Collectives are hierarchical: the process's ranks combine through
/// an in-process host communicator, one leader per process (its local rank 0) exchanges over MPI
/// (or over Gloo: a torchrun-style job, or MGPU_DIST_BACKEND=gloo; see init()), and the result goes
/// back inside the process; over MPI, an all-reduce between 2 processes with as many ranks
/// each goes by slices instead: every local rank reduces 1/L of the buffer over its process's ranks,
/// swaps that with the same rank of the other process piece by piece, and writes the combined slice
/// into every local rank's output, through an MPI shared-memory window where the two processes share
/// a host (MGPU_DIST_SHM=0 turns it off; a communicator takes over the window one dropped before it
/// left between the same processes, and finalize() frees them), else over MPI point-to-point. Reductions combine in float32 in process order,
/// so every rank gets bitwise identical results, run after run; with one device per process an
/// all-reduce equals a single process's host communicator over as many devices, bit for bit. send/recv between
/// processes go over MPI point-to-point (a send completes once MPI is done with its data: a small one at once, as MPI
/// sends it eagerly, a large one once the receive has matched it; finalize() checks for unreceived sends only between
/// ranks of this process), or over Gloo (a send completes once the receive has taken it). A collective may not be part of a group_start()/group_end() group (sends and receives may).
///
/// CUDA GPUs (every device of the world one, no two the same GPU of a server): one NCCL communicator
/// over all of them (the nccl backend's deadlines, abort and watchdog), its unique id made by process 0
/// and broadcast over MPI or the torchrun-style rendezvous; each process creates and drives its own
/// ranks' NCCL communicators, and NCCL carries the bytes between servers. A world mixing host devices
/// and GPUs is refused, and so are host devices across the processes of a torchrun-style job in a
/// build without Gloo (they need MPI there).
///
/// Deadlines: every MPI or Gloo wait ends by options.timeout (zero: comm::default_timeout()); a
/// process not heard from in time makes the others fail with Error(timeout) naming the operation
/// and the process(es), and aborts the communicator; over Gloo, a process whose connection closed
/// (it exited or was killed) is named at once in an Error(communication). Making one over Gloo
/// waits twice the deadline for the others (as making one over MPI does). The ranks
/// inside a process wait for their leader's exchange with twice that deadline, so the leader's
/// error (naming the processes) is what they report. Collective over the processes (it sets up
/// MPI communicators); `group` must be the DeviceGroup `world` was made from and outlive the
/// communicator. Throws Error(invalid_argument) for other devices, a world of mixed kinds or a GPU
/// listed twice on a server, and for a backend other than automatic or the one the devices use (host,
/// nccl); Error(device) when the build has no NCCL.
std::unique_ptr<comm::Communicator> make_communicator(World const& world, DeviceGroup& group,
                                                      comm::Options options = {});

/// A communicator over some ranks of `world`, as comm::make_communicator(group, ranks, options)
/// within one process: its rank i is world rank world_ranks[i]. Every process that drives one of
/// those ranks calls it (only those), with the same list, and such processes make their subset
/// communicators in the same order; each calls the operations for its own ranks only (i from
/// first_rank() on, one per rank it drives, in the list's order). The list names each process's
/// ranks next to each other (e.g. {0, 2} and {1, 3} over 2 processes of 2 devices; {3, 2} too,
/// not {0, 2, 1}). A subset within this process is an in-process subset communicator
/// (comm::make_communicator(group, its local ranks, options)); one across processes is the whole
/// world's scheme over the member processes (host devices only, for now): their ranks combine
/// inside each process, one leader per member process exchanges over an MPI communicator among the
/// members (over Gloo: the job's context, its messages told apart by the list and how many
/// communicators over it this process made before), with the same reduction order, deadlines, abort and error naming (processes by their
/// place in the job, ranks by their place in the subset). Making one first exchanges the list
/// among the members, polled against options.timeout (zero: comm::default_timeout()): a member
/// not heard from in time is named in an Error(timeout), another list in an Error(invalid_argument).
/// Several may be used at once, each with its own call order. Throws Error(invalid_argument) for
/// an empty list, a repeated or out-of-range rank, a process's ranks apart in the list, a list
/// without this process's ranks, CUDA GPUs across processes (not yet: make_communicator(world,
/// group) serves them), and as make_communicator(world, group, options) does. Needs make_world()
/// first.
std::unique_ptr<comm::Communicator> make_communicator(World const& world, DeviceGroup& group,
                                                      std::vector<int> const& world_ranks, comm::Options options = {});

/// make_communicator(world, group, options) as a function of the group and options, for an executor
/// to make (and remake) its communicator across processes: parallel::DataParallelOptions's,
/// pipeline::ExecutorOptions's and parallel::TensorParallelOptions's make_communicator.
std::function<std::unique_ptr<comm::Communicator>(DeviceGroup&, comm::Options)> communicator_factory(World world);

/// A subset communicator over world ranks as a function of the group: make_communicator(world,
/// group, world_ranks, options), for parallel::TensorParallelOptions::make_subset_communicator.
using SubsetFactory =
    std::function<std::unique_ptr<comm::Communicator>(DeviceGroup&, std::vector<int> const&, comm::Options)>;
SubsetFactory subset_communicator_factory(World world);

}  // namespace mgpu::dist
