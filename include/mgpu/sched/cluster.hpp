// Deprecated: the cluster-scale model (nodes, pods, their files, the synthetic generator)
// moved to <mgpu/cluster/cluster.hpp>, namespace mgpu::cluster.
// This forwarding header and the names below in mgpu::sched remain for one release.
#pragma once

#include <mgpu/cluster/cluster.hpp>

namespace mgpu::sched {

using NodeSpec [[deprecated("moved to mgpu::cluster, <mgpu/cluster/cluster.hpp>")]] = cluster::NodeSpec;
using Pod [[deprecated("moved to mgpu::cluster, <mgpu/cluster/cluster.hpp>")]] = cluster::Pod;
using NodeColumns [[deprecated("moved to mgpu::cluster, <mgpu/cluster/cluster.hpp>")]] = cluster::NodeColumns;
using PodColumns [[deprecated("moved to mgpu::cluster, <mgpu/cluster/cluster.hpp>")]] = cluster::PodColumns;
using ClusterShape [[deprecated("moved to mgpu::cluster, <mgpu/cluster/cluster.hpp>")]] = cluster::ClusterShape;
using PodShape [[deprecated("moved to mgpu::cluster, <mgpu/cluster/cluster.hpp>")]] = cluster::PodShape;
using Demand [[deprecated("moved to mgpu::cluster, <mgpu/cluster/cluster.hpp>")]] = cluster::Demand;
using Allocation [[deprecated("moved to mgpu::cluster, <mgpu/cluster/cluster.hpp>")]] = cluster::Allocation;
using Cluster [[deprecated("moved to mgpu::cluster, <mgpu/cluster/cluster.hpp>")]] = cluster::Cluster;
// Functions cannot carry [[deprecated]] on a using-declaration; they are deprecated all the same.
using cluster::read_nodes_csv;
using cluster::read_pods_csv;
using cluster::synthetic_cluster;
using cluster::synthetic_pods;
using cluster::write_nodes_csv;
using cluster::write_pods_csv;

}  // namespace mgpu::sched
