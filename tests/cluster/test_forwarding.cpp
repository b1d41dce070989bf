// The deprecated forwarding headers at the cluster module's old paths (mgpu/sched/cluster.hpp,
// cluster_policy.hpp, simulator.hpp) still compile and name the same entities in mgpu::sched.
#include <type_traits>

#include <mgpu/sched/cluster.hpp>
#include <mgpu/sched/cluster_policy.hpp>
#include <mgpu/sched/simulator.hpp>

#include "support/catch.hpp"

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
static_assert(std::is_same_v<mgpu::sched::Cluster, mgpu::cluster::Cluster>);
static_assert(std::is_same_v<mgpu::sched::FitPolicy, mgpu::cluster::FitPolicy>);
static_assert(std::is_same_v<mgpu::sched::SimulationResult, mgpu::cluster::SimulationResult>);
#pragma GCC diagnostic pop

TEST_CASE("The old mgpu::sched names of the cluster module call the mgpu::cluster functions", "[cluster]") {
  CHECK(mgpu::sched::name_of(mgpu::cluster::FitPolicy::fgd) == "fgd");
  CHECK(mgpu::sched::all_fit_policies() == mgpu::cluster::all_fit_policies());
}
