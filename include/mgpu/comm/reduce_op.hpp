// The reduction operators of the collectives: mgpu::ReduceOp (mgpu/core/reduce_op.hpp, below comm
// so that the CUDA kernels share it), named here as comm::ReduceOp.
#pragma once

#include <mgpu/core/reduce_op.hpp>

namespace mgpu::comm {

using mgpu::ReduceOp;
using mgpu::to_string;

}  // namespace mgpu::comm
