// The launcher's environment read into a process's place (a pure function, fed fake
// environments), and the dist module in a job of one process. Several processes: mpi_dist.cpp,
// run under mpirun.
#include <cstdlib>
#include <string>
#include <vector>

#include <mgpu/dist/dist.hpp>

#include "support/catch.hpp"
#include "support/expect_error.hpp"

using mgpu::Errc;
using mgpu::dist::Environment;
using mgpu::dist::Launcher;
using mgpu::dist::parse_environment;

TEST_CASE("No launcher variables: a job of one process", "[dist]") {
  auto const place = parse_environment({{"PATH", "/usr/bin"}});
  CHECK(place.launcher == Launcher::none);
  CHECK(place.rank == 0);
  CHECK(place.size == 1);
  CHECK(place.local_rank == 0);
}

TEST_CASE("Each launcher's variables give the place", "[dist]") {
  auto const ompi = parse_environment(
      {{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}});
  CHECK(ompi.launcher == Launcher::openmpi);
  CHECK((ompi.rank == 3 && ompi.size == 4 && ompi.local_rank == 1));

  auto const slurm = parse_environment({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "2"}});
  CHECK(slurm.launcher == Launcher::slurm);
  CHECK((slurm.rank == 5 && slurm.size == 8 && slurm.local_rank == 2));

  auto const torchrun = parse_environment(
      {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"MASTER_ADDR", "node7"}, {"MASTER_PORT", "29500"}});
  CHECK(torchrun.launcher == Launcher::torchrun);
  CHECK((torchrun.rank == 1 && torchrun.size == 2 && torchrun.local_rank == 0));
  CHECK(torchrun.master_addr == "node7");
  CHECK(torchrun.master_port == 29500);
  CHECK(torchrun.host.empty());  // init() fills it, not the pure parse
}

TEST_CASE("OpenMPI's variables win over Slurm's and torchrun's (mpirun inside a Slurm allocation)", "[dist]") {
  Environment const env{{"SLURM_PROCID", "0"},         {"SLURM_NTASKS", "1"}, {"OMPI_COMM_WORLD_RANK", "1"},
                        {"OMPI_COMM_WORLD_SIZE", "2"}, {"RANK", "0"},         {"WORLD_SIZE", "1"}};
  auto const place = parse_environment(env);
  CHECK(place.launcher == Launcher::openmpi);
  CHECK((place.rank == 1 && place.size == 2 && place.local_rank == 0));  // no local rank variable: 0
  auto const slurm =
      parse_environment({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "3"}, {"RANK", "0"}, {"WORLD_SIZE", "1"}});
  CHECK(slurm.launcher == Launcher::slurm);
  CHECK(slurm.rank == 1);
}

TEST_CASE("Bad launcher variables name the variable, its value and what was expected", "[dist]") {
  REQUIRE_MGPU_ERROR(parse_environment({{"OMPI_COMM_WORLD_RANK", "x"}, {"OMPI_COMM_WORLD_SIZE", "2"}}),
                     Errc::invalid_argument, "OMPI_COMM_WORLD_RANK='x' (expected a whole number in [0, 2)");
  REQUIRE_MGPU_ERROR(parse_environment({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "0"}}), Errc::invalid_argument,
                     "SLURM_NTASKS='0' (expected a whole number of processes >= 1)");
  REQUIRE_MGPU_ERROR(parse_environment({{"RANK", "-1"}, {"WORLD_SIZE", "2"}}), Errc::invalid_argument, "RANK='-1'");
  REQUIRE_MGPU_ERROR(parse_environment({{"RANK", "0"}, {"WORLD_SIZE", " 2"}}), Errc::invalid_argument,
                     "WORLD_SIZE=' 2'");
  REQUIRE_MGPU_ERROR(parse_environment({{"RANK", "0"}, {"WORLD_SIZE", "99999999999"}}), Errc::invalid_argument,
                     "WORLD_SIZE='99999999999'");
  REQUIRE_MGPU_ERROR(parse_environment({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}),
                     Errc::invalid_argument, "MASTER_PORT='70000' (expected a port in [1, 65535])");
  REQUIRE_MGPU_ERROR(parse_environment({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", ""}}),
                     Errc::invalid_argument, "MASTER_ADDR=''");
  REQUIRE_MGPU_ERROR(parse_environment({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "2"}}),
                     Errc::invalid_argument, "LOCAL_RANK='2' (expected a whole number in [0, 2), WORLD_SIZE being 2)");
}

TEST_CASE("A rank at or past the size is inconsistent, and a launcher needs both rank and size", "[dist]") {
  REQUIRE_MGPU_ERROR(parse_environment({{"OMPI_COMM_WORLD_RANK", "4"}, {"OMPI_COMM_WORLD_SIZE", "4"}}),
                     Errc::invalid_argument,
                     "OMPI_COMM_WORLD_RANK='4' (expected a whole number in [0, 4), OMPI_COMM_WORLD_SIZE being 4)");
  REQUIRE_MGPU_ERROR(parse_environment({{"SLURM_PROCID", "3"}}), Errc::invalid_argument,
                     "SLURM_PROCID is set but SLURM_NTASKS is not (expected both, or neither)");
  REQUIRE_MGPU_ERROR(parse_environment({{"WORLD_SIZE", "2"}}), Errc::invalid_argument,
                     "WORLD_SIZE is set but RANK is not");
}

TEST_CASE("In a job of one process the world is the DeviceGroup and the communicator is the in-process one", "[dist]") {
  Environment own;
  for (auto const& name : mgpu::dist::environment_variables()) {
    if (char const* value = std::getenv(name.c_str())) own.emplace(name, value);
  }
  if (parse_environment(own).size != 1) MGPU_SKIP("this test process was started by a launcher of several processes");
  auto const place = mgpu::dist::init();
  CHECK(place.size == 1);
  CHECK(!place.host.empty());
  CHECK(mgpu::dist::init().host == place.host);  // a second call: the same place
  mgpu::DeviceGroup group("host:3");
  auto const world = mgpu::dist::make_world(group);
  REQUIRE(world.size() == 3);
  CHECK(world.processes == 1);
  for (int r = 0; r < 3; ++r) {
    CHECK(world.devices[static_cast<std::size_t>(r)].rank == r);
    CHECK(world.devices[static_cast<std::size_t>(r)].device == group.device(r));
    CHECK(world.devices[static_cast<std::size_t>(r)].local_rank == r);
    CHECK(world.devices[static_cast<std::size_t>(r)].host == place.host);
  }
  CHECK(world.first_rank(0) == 0);
  CHECK(world.local_size(0) == 3);
  REQUIRE_MGPU_ERROR(world.local_size(1), Errc::invalid_argument, "process 1 (expected a process in [0, 1))");
  auto comm = mgpu::dist::make_communicator(world, group);
  CHECK(comm->size() == 3);
  std::vector<mgpu::Tensor> buffers;
  for (int r = 0; r < 3; ++r) {
    buffers.push_back(mgpu::Tensor::empty({5}, mgpu::DType::float32, group.allocator(r)));
    for (int i = 0; i < 5; ++i)
      buffers.back().host_span<float>()[static_cast<std::size_t>(i)] = static_cast<float>(r * 10 + i);
  }
  group.run([&](int r, mgpu::Device, mgpu::Stream& s) {
    comm->all_reduce(r, buffers[static_cast<std::size_t>(r)], buffers[static_cast<std::size_t>(r)],
                     mgpu::comm::ReduceOp::sum, s);
  });
  for (int r = 0; r < 3; ++r) {
    for (int i = 0; i < 5; ++i)
      CHECK(buffers[static_cast<std::size_t>(r)].host_span<float>()[static_cast<std::size_t>(i)] == 30.0f + 3 * i);
  }
  comm->finalize();

  mgpu::DeviceGroup other("host:2");
  REQUIRE_MGPU_ERROR(mgpu::dist::make_communicator(world, other), Errc::invalid_argument,
                     "the DeviceGroup has 2 device(s) starting with host:0, the world lists 3 for this process");
}

TEST_CASE("Across processes a world is all host devices or all distinct GPUs per server", "[dist]") {
  using mgpu::Device;
  using mgpu::DeviceKind;
  mgpu::DeviceGroup group("host:1");
  auto const world_of = [](std::vector<mgpu::dist::WorldDevice> devices) {
    mgpu::dist::World world;
    world.processes = 2;
    world.devices = std::move(devices);
    return world;
  };
  Device const host0{DeviceKind::host, 0};
  Device const gpu0{DeviceKind::cuda, 0};
  Device const gpu1{DeviceKind::cuda, 1};
  REQUIRE_MGPU_ERROR(mgpu::dist::make_communicator(world_of({{0, host0, 0, 0, "a"}, {1, gpu0, 1, 0, "b"}}), group),
                     Errc::invalid_argument,
                     "world rank 1 is cuda:0 on process 1, world rank 0 is host:0 (expected one kind of device across "
                     "processes: host devices over MPI or CUDA GPUs over NCCL)");
  REQUIRE_MGPU_ERROR(
      mgpu::dist::make_communicator(world_of({{0, gpu0, 0, 0, "a"}, {1, gpu1, 0, 1, "a"}, {2, gpu1, 1, 0, "a"}}), group),
      Errc::invalid_argument,
      "world ranks 1 and 2 are both cuda:1 on server a (expected distinct GPUs on a server: NCCL cannot have two "
      "ranks on one GPU)");
  // The same GPU index on two servers is two GPUs: the world passes, and then this process's group
  // (a host device) is not the one the world lists for it.
  REQUIRE_MGPU_ERROR(mgpu::dist::make_communicator(world_of({{0, gpu0, 0, 0, "a"}, {1, gpu0, 1, 0, "b"}}), group),
                     Errc::invalid_argument, "the DeviceGroup has 1 device(s) starting with host:0, the world lists 1");
}
