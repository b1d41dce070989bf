// Deprecated: the trace simulator, trace files and synthetic traces
// moved to <mgpu/cluster/simulator.hpp>, namespace mgpu::cluster.
// This forwarding header and the names below in mgpu::sched remain for one release.
#pragma once

#include <mgpu/cluster/simulator.hpp>

namespace mgpu::sched {

using TraceColumns [[deprecated("moved to mgpu::cluster, <mgpu/cluster/simulator.hpp>")]] = cluster::TraceColumns;
using TraceShape [[deprecated("moved to mgpu::cluster, <mgpu/cluster/simulator.hpp>")]] = cluster::TraceShape;
using ServerSpec [[deprecated("moved to mgpu::cluster, <mgpu/cluster/simulator.hpp>")]] = cluster::ServerSpec;
using SimulationResult [[deprecated("moved to mgpu::cluster, <mgpu/cluster/simulator.hpp>")]] =
    cluster::SimulationResult;
// Functions cannot carry [[deprecated]] on a using-declaration; they are deprecated all the same.
using cluster::format_results;
using cluster::interarrival_for_load;
using cluster::make_servers;
using cluster::read_trace_csv;
using cluster::results_csv;
using cluster::simulate;
using cluster::synthetic_trace;
using cluster::write_trace_csv;

}  // namespace mgpu::sched
