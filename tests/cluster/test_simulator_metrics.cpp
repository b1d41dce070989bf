// The simulator's metrics (mean and p95 JCT, makespan, queueing delay, utilization, energy) against
// small traces whose schedules are worked out by hand in the comments.
#include <mgpu/cluster/simulator.hpp>

#include "support/catch.hpp"

using namespace mgpu::cluster;
using namespace mgpu::sched;

namespace {

Job job(int id, double submit, double duration, double gpus) {
  Job j;
  j.id = id;
  j.submit = submit;
  j.duration = duration;
  j.gpus = gpus;
  return j;
}

}  // namespace

TEST_CASE("Simulator metrics match a four-job trace computed by hand", "[cluster][simulator]") {
  // One server of two speed-1 GPUs, FIFO:
  //   job 1: submitted at 0, 10 s on 2 GPUs  -> runs 0..10                JCT 10, waits 0
  //   job 2: submitted at 1,  4 s on 1 GPU   -> waits for job 1, 10..14   JCT 13, waits 9
  //   job 3: submitted at 2,  6 s on 1 GPU   -> beside job 2, 10..16      JCT 14, waits 8
  //   job 4: submitted at 20, 5 s on 2 GPUs  -> runs 20..25               JCT 5,  waits 0
  // mean JCT 42/4 = 10.5; p95 (nearest rank: ceil(0.95 * 4) = 4th of 5, 10, 13, 14) = 14;
  // makespan 25; mean queueing delay 17/4 = 4.25; busy GPU-seconds 20 + 4 + 6 + 10 = 40 of 2 x 25.
  std::vector<Job> const jobs{job(1, 0, 10, 2), job(2, 1, 4, 1), job(3, 2, 6, 1), job(4, 20, 5, 2)};
  auto const servers = make_servers({{.gpus = 2, .max_watts = 400, .idle_watts = 60}});
  SimulationResult const r = simulate(jobs, servers, QueuePolicy{});
  CHECK(r.jobs == 4);
  CHECK(r.unfinished == 0);
  CHECK(r.preemptions == 0);
  CHECK(r.mean_jct == Approx(10.5));
  CHECK(r.p95_jct == Approx(14.0));
  CHECK(r.makespan == Approx(25.0));
  CHECK(r.mean_queueing_delay == Approx(4.25));
  CHECK(r.utilization == Approx(40.0 / 50.0));
  // At full power every busy GPU draws 400 W: 40 GPU-seconds x 400 W = 16 kJ.
  CHECK(r.energy_kwh == Approx(40.0 * 400.0 / 3.6e6));
}

TEST_CASE("Simulator p95 JCT is the nearest-rank percentile, not the maximum", "[cluster][simulator]") {
  // Twenty 1-second jobs submitted together on one GPU run back to back: job k (0-based) waits k
  // seconds and finishes at k + 1. JCTs 1..20: mean 10.5, p95 = 19th value = 19 (the maximum is 20),
  // mean queueing delay (0 + ... + 19) / 20 = 9.5, makespan 20, the GPU busy all the time.
  std::vector<Job> jobs;
  for (int k = 0; k < 20; ++k) jobs.push_back(job(k + 1, 100, 1, 1));
  SimulationResult const r = simulate(jobs, make_servers({{.gpus = 1}}), QueuePolicy{});
  CHECK(r.unfinished == 0);
  CHECK(r.mean_jct == Approx(10.5));
  CHECK(r.p95_jct == Approx(19.0));
  CHECK(r.makespan == Approx(20.0));  // from the first submission, not from time 0
  CHECK(r.mean_queueing_delay == Approx(9.5));
  CHECK(r.utilization == Approx(1.0));
}

TEST_CASE("Simulator metrics scale durations by the GPUs' speed", "[cluster][simulator]") {
  // Durations are seconds on a speed-1 GPU; on a speed-2 GPU:
  //   job 1: submitted at 0, 10 s of work -> runs 0..5   JCT 5, waits 0
  //   job 2: submitted at 1,  4 s of work -> runs 5..7   JCT 6, waits 4
  // mean JCT 5.5, p95 (ceil(0.95 * 2) = 2nd of 5, 6) = 6, makespan 7, mean delay 2, always busy.
  std::vector<Job> const jobs{job(1, 0, 10, 1), job(2, 1, 4, 1)};
  SimulationResult const r = simulate(jobs, make_servers({{.gpus = 1, .speed = 2.0}}), QueuePolicy{});
  CHECK(r.unfinished == 0);
  CHECK(r.mean_jct == Approx(5.5));
  CHECK(r.p95_jct == Approx(6.0));
  CHECK(r.makespan == Approx(7.0));
  CHECK(r.mean_queueing_delay == Approx(2.0));
  CHECK(r.utilization == Approx(1.0));
}
