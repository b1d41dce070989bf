// Deprecated: the cluster placement policies and the fill and replay experiments
// moved to <mgpu/cluster/policy.hpp>, namespace mgpu::cluster.
// This forwarding header and the names below in mgpu::sched remain for one release.
#pragma once

#include <mgpu/cluster/policy.hpp>

namespace mgpu::sched {

using FitPolicy [[deprecated("moved to mgpu::cluster, <mgpu/cluster/policy.hpp>")]] = cluster::FitPolicy;
using TieRule [[deprecated("moved to mgpu::cluster, <mgpu/cluster/policy.hpp>")]] = cluster::TieRule;
using PodType [[deprecated("moved to mgpu::cluster, <mgpu/cluster/policy.hpp>")]] = cluster::PodType;
using TargetOptions [[deprecated("moved to mgpu::cluster, <mgpu/cluster/policy.hpp>")]] = cluster::TargetOptions;
using Placer [[deprecated("moved to mgpu::cluster, <mgpu/cluster/policy.hpp>")]] = cluster::Placer;
using FillOptions [[deprecated("moved to mgpu::cluster, <mgpu/cluster/policy.hpp>")]] = cluster::FillOptions;
using FillPoint [[deprecated("moved to mgpu::cluster, <mgpu/cluster/policy.hpp>")]] = cluster::FillPoint;
using FillResult [[deprecated("moved to mgpu::cluster, <mgpu/cluster/policy.hpp>")]] = cluster::FillResult;
using ReplayResult [[deprecated("moved to mgpu::cluster, <mgpu/cluster/policy.hpp>")]] = cluster::ReplayResult;
// Functions cannot carry [[deprecated]] on a using-declaration; they are deprecated all the same.
using cluster::all_fit_policies;
using cluster::fill;
using cluster::fill_csv;
using cluster::fit_policy_named;
using cluster::format_fill;
using cluster::format_replay;
using cluster::name_of;
using cluster::node_fragmentation;
using cluster::replay;
using cluster::replay_csv;
using cluster::target_workload;
using cluster::tie_rule_named;

}  // namespace mgpu::sched
