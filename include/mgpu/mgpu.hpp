// mgpu: in-process multi-GPU training. Include this one header for the whole public API.
#pragma once

#include <mgpu/comm/communicator.hpp>
#include <mgpu/config.hpp>
#include <mgpu/core/device.hpp>
#include <mgpu/core/device_group.hpp>
#include <mgpu/core/dtype.hpp>
#include <mgpu/core/error.hpp>
#include <mgpu/core/memory.hpp>
#include <mgpu/core/stream.hpp>
#include <mgpu/core/tensor.hpp>
#include <mgpu/data/dataset.hpp>
#include <mgpu/data/loader.hpp>
#include <mgpu/io/checkpoint.hpp>
#include <mgpu/nn/layers.hpp>
#include <mgpu/nn/optim.hpp>
#include <mgpu/nn/train.hpp>
#include <mgpu/ops/ops.hpp>
#include <mgpu/parallel/pipeline.hpp>
#include <mgpu/parallel/schedule.hpp>
#include <mgpu/sched/job_queue.hpp>
#include <mgpu/sched/live.hpp>
#include <mgpu/sched/planning.hpp>
#include <mgpu/sched/scheduler.hpp>
#include <mgpu/sched/simulator.hpp>
#include <mgpu/sched/types.hpp>
#include <mgpu/trace/timeline.hpp>
