# Install rules and the exported package: find_package(mgpu CONFIG) gives mgpu::mgpu.
if(NOT MGPU_INSTALL)
  return()
endif()
include(CMakePackageConfigHelpers)

install(TARGETS mgpu EXPORT mgpuTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY include/mgpu DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(FILES "${PROJECT_BINARY_DIR}/include/mgpu/config.hpp" DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/mgpu)

set(MGPU_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/mgpu)
install(EXPORT mgpuTargets NAMESPACE mgpu:: DESTINATION ${MGPU_INSTALL_CMAKEDIR})
configure_package_config_file(cmake/mgpuConfig.cmake.in "${PROJECT_BINARY_DIR}/mgpuConfig.cmake"
  INSTALL_DESTINATION ${MGPU_INSTALL_CMAKEDIR})
write_basic_package_version_file("${PROJECT_BINARY_DIR}/mgpuConfigVersion.cmake"
  COMPATIBILITY SameMinorVersion)
install(FILES "${PROJECT_BINARY_DIR}/mgpuConfig.cmake" "${PROJECT_BINARY_DIR}/mgpuConfigVersion.cmake"
              cmake/FindNCCL.cmake
        DESTINATION ${MGPU_INSTALL_CMAKEDIR})
