// bench_mpi_allreduce: the OpenMPI baseline for bench_collectives, which launches it through mpirun.
// For each size in bytes on the command line, prints "bytes seconds" where seconds is the median
// (over 5 rounds) of the slowest rank's time per in-place MPI_Allreduce (float sum).
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "bench_quick.hpp"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  for (int a = 1; a < argc; ++a) {
    long const bytes = std::atol(argv[a]);
    std::vector<float> buffer(static_cast<std::size_t>(bytes) / sizeof(float), 1.0f);
    int const count = static_cast<int>(buffer.size());
    int const iterations = bench::baseline_repetitions(bytes);
    MPI_Allreduce(MPI_IN_PLACE, buffer.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    std::vector<double> rounds;
    for (int round = 0; round < bench::baseline_rounds(); ++round) {
      MPI_Barrier(MPI_COMM_WORLD);
      double const start = MPI_Wtime();
      for (int i = 0; i < iterations; ++i)
        MPI_Allreduce(MPI_IN_PLACE, buffer.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      double const mine = (MPI_Wtime() - start) / iterations;
      double slowest = 0;
      MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      rounds.push_back(slowest);
    }
    std::nth_element(rounds.begin(), rounds.begin() + bench::baseline_rounds() / 2, rounds.end());
    if (rank == 0) std::printf("%ld %.9g\n", bytes, rounds[static_cast<std::size_t>(bench::baseline_rounds() / 2)]);
  }
  MPI_Finalize();
  return 0;
}
