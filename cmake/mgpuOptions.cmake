# Build options. Tests, examples and benchmarks are on only when mgpu is the top-level project.
include(GNUInstallDirs)

set(MGPU_WITH_CUDA AUTO CACHE STRING "Build the CUDA backend (AUTO: when a CUDA compiler is found)")
set_property(CACHE MGPU_WITH_CUDA PROPERTY STRINGS AUTO ON OFF)
set(MGPU_WITH_NCCL AUTO CACHE STRING "Use NCCL for GPU collectives (AUTO: when CUDA is on and NCCL is found)")
set_property(CACHE MGPU_WITH_NCCL PROPERTY STRINGS AUTO ON OFF)
set(MGPU_WITH_MPI AUTO CACHE STRING "Use MPI for the dist module's processes (AUTO: when MPI is found)")
set_property(CACHE MGPU_WITH_MPI PROPERTY STRINGS AUTO ON OFF)
set(MGPU_HOST_GEMM AUTO CACHE STRING "Host GEMM backend: onednn (oneDNN's matmul primitive), eigen, or AUTO (oneDNN when found)")
set_property(CACHE MGPU_HOST_GEMM PROPERTY STRINGS AUTO onednn eigen)

option(MGPU_BUILD_TESTS "Build mgpu's tests" ${PROJECT_IS_TOP_LEVEL})
option(MGPU_BUILD_EXAMPLES "Build mgpu's examples" ${PROJECT_IS_TOP_LEVEL})
option(MGPU_BUILD_BENCH "Build mgpu's benchmarks" ${PROJECT_IS_TOP_LEVEL})
option(MGPU_BUILD_FUZZERS "Build mgpu's libFuzzer targets (Clang; see scripts/fuzz.sh)" OFF)
option(MGPU_NATIVE "Compile the library, examples and benchmarks with -march=native (packages: OFF)" ${PROJECT_IS_TOP_LEVEL})
option(MGPU_WERROR "Treat warnings in the library itself as errors (CI)" OFF)
option(MGPU_INSTALL "Generate mgpu's install rules" ON)
