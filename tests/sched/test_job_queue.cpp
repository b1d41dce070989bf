// The job queue and the simulator: preemption, fair share, reservation, fractional packing, traces.
#include <mgpu/cluster/simulator.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "support/catch.hpp"
#include "support/expect_error.hpp"
#include "support/temp_path.hpp"

using namespace mgpu::cluster;
using namespace mgpu::sched;
using mgpu::Errc;

namespace {
std::vector<NodeState> one_server(int gpus) { return make_servers({{.gpus = gpus}}); }

// Runs the queue until every job is done, returning each job's start and finish.
struct Timeline {
  std::map<int, double> start;
  std::map<int, double> finish;
  int preemptions = 0;
};

Timeline run(std::vector<Job> jobs, std::vector<NodeState> servers, QueuePolicy policy) {
  JobQueue queue(std::move(servers), Scheduler::default_profile(), std::move(policy));
  Timeline t;
  std::map<int, double> ends;
  std::size_t next = 0;
  while (next < jobs.size() || !ends.empty()) {
    double now = next < jobs.size() ? jobs[next].submit : 1e300;
    for (auto const& [id, e] : ends) now = std::min(now, e);
    for (auto it = ends.begin(); it != ends.end();) {
      if (it->second <= now) {
        queue.finish(it->first, now);
        t.finish[it->first] = now;
        it = ends.erase(it);
      } else {
        ++it;
      }
    }
    while (next < jobs.size() && jobs[next].submit <= now) queue.submit(jobs[next++]);
    for (auto const& e : queue.schedule(now)) {
      if (e.kind == JobEvent::start) {
        t.start.try_emplace(e.job, now);
        ends[e.job] = *queue.expected_finish(e.job);
      } else if (e.kind == JobEvent::preempt) {
        ends.erase(e.job);
      }
    }
    if (ends.empty() && next == jobs.size() && queue.pending() > 0) break;  // stuck
  }
  t.preemptions = queue.preemptions();
  return t;
}
}  // namespace

TEST_CASE("Priority preempts, and the preempted job loses no work", "[sched][queue]") {
  std::vector<Job> jobs = {{.id = 0, .submit = 0, .duration = 100, .gpus = 2, .priority = 0},
                           {.id = 1, .submit = 10, .duration = 20, .gpus = 1, .priority = 5}};
  QueuePolicy policy{.name = "preempt", .preemption = true};
  Timeline const t = run(jobs, one_server(2), policy);
  CHECK(t.preemptions == 1);
  CHECK(t.start.at(1) == 10);           // started at once, by preempting job 0
  CHECK(t.finish.at(1) == 30);
  CHECK(t.finish.at(0) == Approx(120));  // 10 s done before, 90 s after job 1: nothing redone
  Timeline const fifo = run(jobs, one_server(2), {.name = "fifo"});
  CHECK(fifo.start.at(1) == 100);
}

TEST_CASE("Fair share bounds a small tenant's wait behind a big one", "[sched][queue]") {
  std::vector<Job> jobs;
  for (int i = 0; i < 100; ++i) jobs.push_back({.id = i, .submit = 0, .duration = 50, .gpus = 1, .tenant = "big"});
  jobs.push_back({.id = 100, .submit = 1, .duration = 50, .gpus = 1, .tenant = "small"});
  Timeline const fair = run(jobs, one_server(4), {.name = "fair", .fair_share = true});
  Timeline const fifo = run(jobs, one_server(4), {.name = "fifo"});
  CHECK(fair.start.at(100) <= 50);     // the next GPU that frees up
  CHECK(fifo.start.at(100) >= 1000);   // behind all of the big tenant's jobs
}

TEST_CASE("Reservation lets a 4-GPU job start despite a steady stream of 1-GPU jobs", "[sched][queue]") {
  std::vector<Job> jobs;
  for (int i = 0; i < 200; ++i) jobs.push_back({.id = i, .submit = 10.0 * i, .duration = 35, .gpus = 1});
  jobs.push_back({.id = 1000, .submit = 5, .duration = 20, .gpus = 4});
  std::stable_sort(jobs.begin(), jobs.end(), [](Job const& a, Job const& b) { return a.submit < b.submit; });
  Timeline const greedy = run(jobs, one_server(4), {.name = "greedy"});
  Timeline const reserved = run(jobs, one_server(4), {.name = "reserve", .reservation = true});
  CHECK(reserved.start.at(1000) <= 60);  // once the jobs running at t=5 end
  CHECK((!greedy.start.contains(1000) || greedy.start.at(1000) > 1000));  // starved while the stream lasts
}

TEST_CASE("Fractional jobs share GPUs; the fragmentation score keeps whole GPUs free", "[sched][queue]") {
  std::vector<Job> jobs = {{.id = 0, .submit = 0, .duration = 100, .gpus = 0.5},
                           {.id = 1, .submit = 1, .duration = 100, .gpus = 0.5},
                           {.id = 2, .submit = 2, .duration = 100, .gpus = 1}};
  Timeline const t = run(jobs, one_server(2), {.name = "frag", .fragmentation_aware = true});
  CHECK(t.start.at(1) == 1);  // packed beside job 0 ...
  CHECK(t.start.at(2) == 2);  // ... so the whole-GPU job finds a free GPU at once
}

TEST_CASE("Jobs no server can run are rejected clearly", "[sched][queue]") {
  JobQueue queue(one_server(4), Scheduler::default_profile(), {});
  REQUIRE_MGPU_ERROR(queue.submit({.id = 7, .gpus = 0}), Errc::invalid_argument, "job 7 can never run");
  REQUIRE_MGPU_ERROR(queue.submit({.id = 8, .gpus = 16}), Errc::invalid_argument, "the node has 4");
  REQUIRE_MGPU_ERROR(queue.submit({.id = 9, .memory_bytes = -5}), Errc::invalid_argument, "expected >= 0");
  REQUIRE_MGPU_ERROR(queue.finish(3, 0), Errc::invalid_argument, "not running");
}

TEST_CASE("Traces: CSV with column mapping, malformed rows, synthetic shapes", "[sched][trace]") {
  auto const dir = mgpu::test::temp_path("mgpu_trace_test");
  std::filesystem::create_directories(dir);
  {
    std::ofstream out(dir / "public.csv");
    out << "job,start_time,end_time,num_gpu,gpu_model,qos,user,cpu\n"
        << "a,0,100,1,V100,0,alice,4\n"
        << "b,5,65,0.5,,1,bob,2\n"
        << "c,7,1007,8,A100|V100,0,alice,32\n";
  }
  TraceColumns columns{.submit = "start_time", .duration = "", .end = "end_time", .gpus = "num_gpu",
                       .gpu_type = "gpu_model", .priority = "qos", .tenant = "user", .memory_gb = ""};
  auto const jobs = read_trace_csv(dir / "public.csv", columns);
  REQUIRE(jobs.size() == 3);
  CHECK(jobs[1].duration == 60);
  CHECK(jobs[1].gpus == 0.5);
  CHECK(jobs[1].priority == 1);
  CHECK(jobs[2].gpu_type == "A100|V100");
  CHECK(jobs[0].tenant == "alice");
  REQUIRE_MGPU_ERROR(read_trace_csv(dir / "public.csv"), Errc::corrupt_data, "public.csv:1: no column named 'submit_time'");
  {
    std::ofstream out(dir / "bad.csv");
    out << "submit_time,duration,gpus\n0,10,1\n5,ten,1\n";
  }
  REQUIRE_MGPU_ERROR(read_trace_csv(dir / "bad.csv"), Errc::corrupt_data, "bad.csv:3: column 'duration' is 'ten' (expected a number)");
  REQUIRE_MGPU_ERROR(read_trace_csv(dir / "missing.csv"), Errc::io, "cannot read trace");
  {
    std::ofstream out(dir / "cpu_only.csv");
    out << "submit_time,duration,gpus\n0,10,1\n5,10,0\n";
  }
  REQUIRE_MGPU_ERROR(read_trace_csv(dir / "cpu_only.csv"), Errc::corrupt_data, "cpu_only.csv:3: asks for 0 GPUs");
  REQUIRE_MGPU_ERROR(read_trace_csv(dir / "cpu_only.csv"), Errc::corrupt_data, "schedule_jobs --pods");
  // A priority beyond int was an undefined float-to-int conversion.
  {
    std::ofstream out(dir / "priority.csv");
    out << "submit_time,duration,gpus,priority\n0,10,1,-7\n1,10,1,1e10\n";
  }
  REQUIRE_MGPU_ERROR(read_trace_csv(dir / "priority.csv"), Errc::corrupt_data,
                     "priority.csv:3: column 'priority' is '1e10' (expected a whole number that fits an int)");
  {
    std::ofstream out(dir / "fraction.csv");
    out << "submit_time,duration,gpus,priority\n0,10,1,2.5\n";
  }
  REQUIRE_MGPU_ERROR(read_trace_csv(dir / "fraction.csv"), Errc::corrupt_data, "fraction.csv:2: column 'priority' is '2.5'");

  auto const synthetic = synthetic_trace({.jobs = 2000, .seed = 3});
  write_trace_csv(dir / "synthetic.csv", synthetic);
  auto const back = read_trace_csv(dir / "synthetic.csv");
  REQUIRE(back.size() == 2000);
  CHECK(back[10].gpus == synthetic[10].gpus);
  int single = 0;
  std::vector<double> durations;
  for (auto const& j : synthetic) {
    single += j.gpus == 1 ? 1 : 0;
    durations.push_back(j.duration);
  }
  std::sort(durations.begin(), durations.end());
  CHECK(single > 1200);                                   // mostly 1-GPU jobs
  CHECK(durations[1980] > 10 * durations[1000]);          // heavy tail: p99 far above the median
  std::filesystem::remove_all(dir);
}

TEST_CASE("The simulator compares policies on a synthetic trace", "[sched][sim]") {
  auto const jobs = synthetic_trace({.jobs = 200, .mean_interarrival_seconds = 150, .seed = 9});
  auto const servers = make_servers({{.gpus = 8}, {.gpus = 8, .type = "V100", .speed = 0.6}});
  std::vector<SimulationResult> results;
  for (auto const& policy : standard_policies()) results.push_back(simulate(jobs, servers, policy));
  for (auto const& r : results) {
    INFO(r.policy);
    CHECK(r.unfinished == 0);
    CHECK(r.jobs == 200);
    CHECK(r.utilization > 0.0);
    CHECK(r.utilization <= 1.0);
    CHECK(r.p95_jct >= r.mean_jct * 0.5);
    CHECK(r.jain_fairness > 0.0);
    CHECK(r.jain_fairness <= 1.0 + 1e-9);
  }
  CHECK(results[1].preemptions > 0);  // priority+preempt does preempt on this trace
  CHECK(results[0].preemptions == 0);
  auto const table = format_results(results);
  CHECK_THAT(table, MGPU_TEST_CONTAINS("reserve+backfill"));
  CHECK_THAT(results_csv(results), MGPU_TEST_CONTAINS("policy,jobs,unfinished"));
}

TEST_CASE("The energy-aware policy trades completion time for energy", "[sched][sim]") {
  auto const jobs = synthetic_trace({.jobs = 120, .mean_interarrival_seconds = 400, .seed = 4});
  auto const servers = make_servers({{.gpus = 8}});
  QueuePolicy fifo;
  QueuePolicy energy_aware{.name = "energy-aware", .energy_aware = true};
  auto const plain = simulate(jobs, servers, fifo);
  auto const saving = simulate(jobs, servers, energy_aware);
  CHECK(saving.unfinished == 0);
  CHECK(saving.energy_kwh < 0.8 * plain.energy_kwh);
  CHECK(saving.mean_jct > plain.mean_jct);
  // Without settable limits the energy-aware policy runs at full power.
  auto const fixed = simulate(jobs, make_servers({{.gpus = 8, .min_power_limit = 0}}), energy_aware);
  CHECK(fixed.energy_kwh == Approx(plain.energy_kwh).epsilon(0.05));
}
