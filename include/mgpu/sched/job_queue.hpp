// JobQueue: several training jobs sharing one or more servers' GPUs. Priority classes with
// preemption (a preempted job keeps its progress and is requeued), weighted fair share between
// tenants, gang allocation, fractional GPU sharing with a fragmentation-aware score, and a
// reservation with backfill so large jobs are not starved. Placement itself is the Scheduler's.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include <mgpu/sched/planning.hpp>
#include <mgpu/sched/scheduler.hpp>

namespace mgpu::sched {

/// A training job: `gpus` whole GPUs on one server (gang), or a fraction of one.
struct Job {
  int id = 0;
  double submit = 0;
  double duration = 0;  ///< seconds of work on a speed-1 GPU
  double gpus = 1;
  std::string gpu_type{};  ///< allowed types, '|'-separated; empty: any
  int priority = 0;
  std::string tenant{};
  double memory_bytes = 0;
  bool preemptible = true;
  std::string task_type{};
};

/// How the queue orders and admits jobs.
struct QueuePolicy {
  std::string name = "fifo";
  bool preemption = false;      ///< higher priority may preempt lower, preemptible jobs
  bool fair_share = false;      ///< within a priority, the tenant with the least weighted service first
  bool shortest_first = false;  ///< within a priority, the shortest predicted job first
  bool reservation = false;     ///< the blocked head job reserves GPUs; others backfill around it
  bool fragmentation_aware = false;  ///< fractional jobs go where they leave the least unusable share
  bool energy_aware = false;  ///< the energy plugin places jobs and caps power (jobs run slower, on less energy)
  std::map<std::string, double> tenant_weights{};  ///< fair-share weights (default 1)
};

/// The policies the simulator compares by default.
std::vector<QueuePolicy> standard_policies();

/// A job started, finished or preempted.
struct JobEvent {
  enum Kind { start, finish, preempt } kind;
  int job;
  int server;
  std::vector<int> devices{};
  double time;
  /// For a start: the power the job's devices draw, in watts (their limits, else max_watts).
  double watts = 0;
};

class JobQueue {
 public:
  /// `servers` report their devices' state; `scheduler` places jobs; `predictor` (optional,
  /// outlives the queue) gives shortest-first estimates and learns from finished jobs.
  JobQueue(std::vector<NodeState> servers, Scheduler scheduler, QueuePolicy policy, RuntimePredictor* predictor = nullptr);

  /// Queues a job. Throws Error(invalid_argument) for one no server could ever run (0 GPUs, more
  /// GPUs than a server has, negative memory).
  void submit(Job const& job);
  /// Marks a running job done at `now` and frees its GPUs.
  void finish(int job_id, double now);
  /// Starts (and, with preemption, preempts) what the policy allows at `now`; returns the events.
  std::vector<JobEvent> schedule(double now);

  /// When a running job would finish at its devices' speed, or nullopt if it is not running.
  [[nodiscard]] std::optional<double> expected_finish(int job_id) const;
  [[nodiscard]] std::size_t pending() const noexcept { return pending_.size(); }
  [[nodiscard]] std::size_t running() const noexcept { return running_.size(); }
  [[nodiscard]] std::vector<NodeState> const& servers() const noexcept { return servers_; }
  [[nodiscard]] int preemptions() const noexcept { return preemptions_; }

 private:
  struct Running {
    Job job;
    int server;
    Placement placement;
    double started;
    double remaining_at_start;  // seconds of speed-1 work left when it started
    double speed;
  };

  Request request_for(Job const& job, double remaining) const;
  std::optional<std::pair<int, Placement>> place(Job const& job, double remaining, std::vector<int> const& reserved,
                                                 double reserved_until, double now) const;
  void start(Job const& job, double remaining, int server, Placement const& placement, double now, std::vector<JobEvent>& events);
  bool try_preempt(Job const& job, double remaining, double now, std::vector<JobEvent>& events);
  double tenant_service(std::string const& tenant, double now) const;

  std::vector<NodeState> servers_;
  Scheduler scheduler_;
  QueuePolicy policy_;
  RuntimePredictor* predictor_;
  std::vector<std::pair<Job, double>> pending_;  // job, remaining work
  std::map<int, Running> running_;
  std::map<std::string, double> service_{};  // finished or preempted GPU-seconds per tenant
  int preemptions_ = 0;
};

/// fragmentation: for fractional requests, prefers the device where the placement raises the
/// expected unusable share least, given the fractions requests tend to ask for (cf. Fragmentation
/// Gradient Descent, ATC'23). `typical` maps a request fraction to its frequency.
std::unique_ptr<ScorePlugin> fragmentation(std::map<double, double> typical);

}  // namespace mgpu::sched
