// The dist module across processes, run by ctest under mpirun (one process per entry of COUNTS):
//
//   mpi_dist collectives COUNTS      e.g. "2,1,2": process p drives COUNTS[p] host devices. Every
//                                    collective, dtype and reduce op of the communicator across
//                                    processes against float64 references that each process computes
//                                    from every rank's inputs; sends and receives across processes;
//                                    the world's device list. Exit status 0 when every check passed.
//   mpi_dist data_parallel COUNTS    parallel::DataParallel across the processes (each its own
//                                    rows of the global batch) against a DataParallel over as many
//                                    devices in one process, which every process runs itself:
//                                    bucketed, overlapped or not, sharded update or not, with
//                                    dropout or clipping; bitwise with one device per process.
//   mpi_dist checkpoint COUNTS FOLDER  DataParallel::save() across the processes into FOLDER mid-run
//                                    and load() of it across the processes and in one process on 3
//                                    devices, against an uninterrupted run in one process; with and
//                                    without the sharded update. A save mid-cycle is refused, a
//                                    damaged shard named.
//   mpi_dist pipeline COUNTS         pipeline::Executor with its stages on the processes' devices
//                                    (world rank g runs pipeline device g) against the same
//                                    executor over as many devices in one process, which every
//                                    process runs itself: GPipe and 1F1B, one stage per device or
//                                    data x pipeline grids, with dropout, clipping, float16 and a
//                                    loss scaler; the losses, each process's chunks and
//                                    gather_parameters() bitwise. And a GPT, its tied LM head in
//                                    another process.
//   mpi_dist pipeline_checkpoint COUNTS FOLDER  pipeline::Executor::save() across the processes
//                                    into FOLDER mid-run (a GPT over 2 stages, x 2 replicas on 4
//                                    devices) and load() of it across the processes and in one
//                                    process, against an uninterrupted run in one process. A
//                                    damaged shard named, an unwritable folder failing everywhere.
//   mpi_dist failure COUNTS          a step out of memory in the last process fails in every process,
//                                    and DataParallel, a GPT pipeline and TensorParallel go on.
//   mpi_dist tensor_parallel COUNTS  parallel::TensorParallel with its grid over the processes' devices
//                                    against one over as many devices in one process: tensor
//                                    parallelism alone and with 2 replicas, sequence parallelism,
//                                    dropout, clipping; bitwise where the reductions keep their order.
//   mpi_dist tensor_parallel_pipeline COUNTS  pipeline::Executor's data x tensor x pipeline grid over
//                                    the processes' devices (2, 4 or 8 in all) against one process's.
//   mpi_dist subsets COUNTS          subset communicators across processes (dist::make_communicator
//                                    over some world ranks): every collective over several subsets
//                                    against float64 references, two at once, bad lists refused.
//   mpi_dist mesh COUNTS             parallel::Mesh dp 2 x tp (world / 2) over the processes: one
//                                    communicator per group, the same on a second ask, all-reduces
//                                    along tp and dp against float64 sums over the group's ranks; a
//                                    dimension it lacks and a mesh larger than the world refused.
//   mpi_dist subset_missing COUNTS PROCESS  every process but PROCESS makes a subset communicator
//                                    over every rank with a 3 s deadline: they must fail naming it.
//   mpi_dist subset_mismatch COUNTS PROCESS  the same, but PROCESS lists the ranks backwards.
//   mpi_dist stall COUNTS PROCESS    one all_reduce, then PROCESS stalls while the others start a
//                                    second one with a 3 s deadline: they must fail naming it.
//   mpi_dist exit COUNTS PROCESS     the same, but PROCESS exits (status 3) instead.
//   mpi_dist mismatch COUNTS PROCESS the same, but PROCESS passes 5 elements where the others pass 4.
//   mpi_dist mismatch_local COUNTS PROCESS  the same, but in every process its last rank passes 5
//                                    elements and its others 4.
// main() runs the fault modes here; the others are in mpi_dist_<job>.cpp (mpi_dist.hpp).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <mgpu/dist/dist.hpp>

#include "mpi_dist.hpp"

using namespace mpi_dist;

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(
        stderr,
        "usage: mpi_dist collectives|subsets|mesh|tensor_parallel|tensor_parallel_pipeline|data_parallel|failure|checkpoint|pipeline|pipeline_checkpoint|stall|exit|mismatch|"
        "mismatch_local|subset_missing|subset_mismatch COUNTS "
        "[PROCESS|FOLDER]\n");
    return 2;
  }
  std::string const mode = argv[1];
  std::vector<int> counts;
  for (std::stringstream list(argv[2]); list.good();) {
    std::string item;
    std::getline(list, item, ',');
    counts.push_back(std::stoi(item));
  }
  int const faulty = argc > 3 && mode != "checkpoint" && mode != "pipeline_checkpoint" ? std::atoi(argv[3]) : -1;
  try {
    mgpu::dist::Session session;
    mgpu::dist::Place const& place = session.place();
    process = place.rank;
    if (place.size != static_cast<int>(counts.size())) {
      std::fprintf(stderr, "process %d: %d processes, but COUNTS lists %zu\n", process, place.size, counts.size());
      return 2;
    }
    if (process == 0)
      std::printf("launcher %s, %d processes, MPI thread support '%s'\n",
                  std::string(mgpu::dist::to_string(place.launcher)).c_str(), place.size,
                  place.mpi_thread_level.c_str());
    mgpu::DeviceGroup group("host:" + std::to_string(counts[static_cast<std::size_t>(place.rank)]));
    mgpu::dist::World const world = mgpu::dist::make_world(group);
    test_world(world, counts, place);
    auto comm = mgpu::dist::make_communicator(world, group, {.timeout = 60s});
    EXPECT(comm->size() == world.size(), "communicator size " << comm->size());
    Setup const s{world, group, *comm};
    // The end of a mode: the communicator drained, this process's checks counted.
    auto const finish = [&] {
      comm->finalize();
      std::printf("process %d: %d of %d checks passed\n", process, checks - failures, checks);
      return failures == 0 ? 0 : 1;
    };
    if (mode == "pipeline") {
      test_pipeline(s);
      test_pipeline_gpt(s);
      return finish();
    }
    if (mode == "tensor_parallel_pipeline") {
      test_tensor_parallel_pipeline(s);
      return finish();
    }
    if (mode == "checkpoint") {
      if (argc < 4) {
        std::fprintf(stderr, "usage: mpi_dist checkpoint COUNTS FOLDER\n");
        return 2;
      }
      test_checkpoint(s, argv[3]);
      return finish();
    }
    if (mode == "pipeline_checkpoint") {
      if (argc < 4 || s.size() % 2 != 0) {
        std::fprintf(stderr, "usage: mpi_dist pipeline_checkpoint COUNTS FOLDER (an even number of devices)\n");
        return 2;
      }
      test_pipeline_checkpoint(s, argv[3]);
      return finish();
    }
    if (mode == "data_parallel") {
      test_data_parallel(s);
      return finish();
    }
    if (mode == "tensor_parallel") {
      test_tensor_parallel(s);
      return finish();
    }
    if (mode == "failure") {
      test_failure(s);
      return finish();
    }
    if (mode == "mesh") {
      test_mesh(s);
      return finish();
    }
    if (mode == "subsets") {
      test_subsets(s);
      return finish();
    }
    if (mode == "collectives") {
      int seed = 1;
      test_collectives(s, seed);
      group.run([&](int l, mgpu::Device, mgpu::Stream& stream) { comm->barrier(s.rank(l), stream); });
      bool one_each = true;
      for (int c : counts) one_each = one_each && c == 1;
      if (one_each) {
        test_matches_one_process(s, seed++, 101);
        test_matches_one_process(s, seed++, 70001);  // the leaders reduce-scatter and all-gather (3 or more processes)
      }
      // Communicators made two at a time and dropped (the next two take the shared memory these
      // left, between 2 processes on one host) all-reduce right.
      for (int round = 0; round < 3; ++round) {
        auto first = mgpu::dist::make_communicator(world, group);
        auto second = mgpu::dist::make_communicator(world, group);
        test_all_reduce(Setup{world, group, *first}, DType::float32, ReduceOp::sum, seed++, true, 5 * 65536 + 1);
        test_all_reduce(Setup{world, group, *second}, DType::bfloat16, ReduceOp::max, seed++, false, 65537);
        test_all_reduce(Setup{world, group, *first}, DType::float32, ReduceOp::avg, seed++, false, 3);
      }
      // A rank of another process is refused here, before any communication.
      int const remote = world.rank_of(0) == 0 ? world.size() - 1 : 0;
      Tensor const t = Tensor::empty({4}, DType::float32, group.allocator(0));
      try {
        comm->all_reduce(remote, t, t, ReduceOp::sum, group.stream(0));
        EXPECT(false, "all_reduce as rank " << remote << " of another process was accepted");
      } catch (mgpu::Error const& e) {
        EXPECT(e.category() == mgpu::Errc::invalid_argument &&
                   std::string(e.what()).find("belongs to process") != std::string::npos,
               "all_reduce as another process's rank: " << e.what());
      }
      return finish();
    }
    if (mode == "subset_missing" || mode == "subset_mismatch") {
      // Every process but `faulty` makes a subset communicator over every world rank (3 s deadline);
      // `faulty` never does, or passes the list backwards.
      std::vector<int> list;
      for (int r = 0; r < world.size(); ++r) list.push_back(r);
      if (process == faulty) {
        if (mode == "subset_missing") {
          std::this_thread::sleep_for(60s);  // mpirun ends it once another process fails
          return 0;
        }
        std::reverse(list.begin(), list.end());
      }
      auto subset = mgpu::dist::make_communicator(world, group, list, {.timeout = 3s});
      std::printf("process %d: made the subset communicator\n", process);
      return 0;
    }
    // A fault: one healthy all_reduce, then `faulty` stalls, exits, or passes another count in an
    // all_reduce of a second communicator, made right after it. Only a stall is meant to meet the
    // second one's deadline (3 s), which a process slowed by a busy machine does not reach between
    // two operations; setting up and the healthy all_reduce have 60 s.
    test_all_reduce(s, DType::float32, ReduceOp::sum, 1, false);
    auto second = mgpu::dist::make_communicator(world, group, {.timeout = mode == "stall" ? 3s : 60s});
    Setup const t{world, group, *second};
    if (mode == "mismatch" || mode == "mismatch_local") {
      // mismatch: `faulty` passes 5 elements, the others 4; mismatch_local: in every process, its
      // last rank passes 5 and the others 4.
      std::vector<Tensor> buffers;
      for (int l = 0; l < t.local(); ++l) {
        bool const more = mode == "mismatch" ? process == faulty : l == t.local() - 1;
        buffers.push_back(Tensor::empty({more ? 5 : 4}, DType::float32, group.allocator(t.member(l))));
      }
      group.run([&](int l, mgpu::Device, mgpu::Stream& stream) {
        second->all_reduce(t.rank(l), buffers[static_cast<std::size_t>(l)], buffers[static_cast<std::size_t>(l)],
                           ReduceOp::sum, stream);
      });
      std::printf("process %d: the mismatched all_reduce succeeded\n", process);
      return 0;
    }
    if (process == faulty) {
      if (mode == "exit") std::_Exit(3);
      std::this_thread::sleep_for(60s);  // mpirun ends it once another process fails
      return 0;
    }
    test_all_reduce(t, DType::float32, ReduceOp::sum, 2, false);
    std::printf("process %d: the collective succeeded without process %d\n", process, faulty);
    return 0;
  } catch (mgpu::Error const& e) {
    std::fprintf(stderr, "process %d: error: %s\n", process, e.what());
    std::fflush(stderr);
    return 1;
  }
}
