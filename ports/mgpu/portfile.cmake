# Overlay port: builds mgpu from the checkout this port sits in.
#   vcpkg install mgpu[cuda,nccl] --overlay-ports=<mgpu>/ports
set(SOURCE_PATH "${CMAKE_CURRENT_LIST_DIR}/../..")

vcpkg_check_features(OUT_FEATURE_OPTIONS FEATURE_OPTIONS
  FEATURES
    cuda MGPU_WITH_CUDA
    nccl MGPU_WITH_NCCL)

vcpkg_cmake_configure(
  SOURCE_PATH "${SOURCE_PATH}"
  OPTIONS
    ${FEATURE_OPTIONS}
    -DMGPU_BUILD_TESTS=OFF
    -DMGPU_BUILD_EXAMPLES=OFF
    -DMGPU_BUILD_BENCH=OFF
    -DMGPU_NATIVE=OFF
    -DMGPU_HOST_GEMM=eigen  # a oneDNN found outside vcpkg would be an undeclared dependency
    -DMGPU_WITH_GLOO=OFF  # so would a Gloo
    -DMGPU_WITH_METRICS_HTTP=OFF  # so would a cpp-httplib: the port's metrics are the textfile's
    -DMGPU_WITH_NVML=OFF)  # and NVML's header from outside vcpkg: no GPU utilisation metric
vcpkg_cmake_install()
vcpkg_cmake_config_fixup(CONFIG_PATH lib/cmake/mgpu)

file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/debug/include" "${CURRENT_PACKAGES_DIR}/debug/share")
file(WRITE "${CURRENT_PACKAGES_DIR}/share/${PORT}/copyright"
  "mgpu has not chosen a license yet; until it does, see the project's repository for terms.\n")
file(INSTALL "${CMAKE_CURRENT_LIST_DIR}/usage" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}")
