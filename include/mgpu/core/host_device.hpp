// MGPU_HD marks functions that compile for both the host and CUDA devices, so element math is
// written once and tested on the CPU.
#pragma once

#if defined(__CUDACC__)
#define MGPU_HD __host__ __device__
#else
#define MGPU_HD
#endif
