# Resolves MGPU_WITH_NVML into MGPU_NVML: the metrics module reads a GPU's utilisation from NVML
# (metrics::Nvml), compiled against nvml.h and loading libnvidia-ml.so.1 with dlopen at run time
# (no link dependency: where the driver lacks it, the metric is absent). The header comes from
# the CUDA toolkit when it ships one, else from PyPI's nvidia-nvml-dev-cu12 wheel, which
# scripts/setup.sh installs under MGPU_NVML_ROOT (Debian main packages no NVML header).
set(MGPU_NVML OFF)
if(NOT MGPU_WITH_NVML MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "MGPU_WITH_NVML=${MGPU_WITH_NVML} (expected AUTO, ON or OFF)")
endif()
if(NOT MGPU_WITH_NVML STREQUAL "OFF")
  if(MGPU_CUDA_ENABLED)
    # Only these places: /usr/include/hwloc/nvml.h is hwloc's, another header of the same name.
    find_path(MGPU_NVML_INCLUDE_DIR nvml.h
              PATHS ${CUDAToolkit_INCLUDE_DIRS} "${MGPU_NVML_ROOT}/nvidia/nvml_dev/include"
              NO_DEFAULT_PATH)
    if(MGPU_NVML_INCLUDE_DIR)
      set(MGPU_NVML ON)
    endif()
  endif()
  if(NOT MGPU_NVML AND MGPU_WITH_NVML STREQUAL "ON")
    message(FATAL_ERROR "mgpu: MGPU_WITH_NVML=ON but no nvml.h (expected the CUDA backend, and nvml.h in the CUDA "
                        "toolkit or under MGPU_NVML_ROOT=${MGPU_NVML_ROOT}, where scripts/setup.sh installs it)")
  endif()
endif()
if(MGPU_NVML)
  message(STATUS "mgpu: NVML utilisation ON (${MGPU_NVML_INCLUDE_DIR}/nvml.h, libnvidia-ml.so.1 loaded at run time)")
else()
  message(STATUS "mgpu: NVML utilisation OFF (expected the CUDA backend and nvml.h: scripts/setup.sh; or MGPU_WITH_NVML=OFF)")
endif()
