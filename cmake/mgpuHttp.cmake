# Resolves MGPU_WITH_METRICS_HTTP into MGPU_METRICS_HTTP: cpp-httplib (Debian: libcpp-httplib-dev,
# a compiled library whose header needs the flags of its pkg-config file, read by pkgconf) serves
# the metrics module's /metrics endpoint. Without it, metrics::HttpExporter says so when
# constructed; the textfile exporter works either way.
set(MGPU_METRICS_HTTP OFF)
if(NOT MGPU_WITH_METRICS_HTTP MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "MGPU_WITH_METRICS_HTTP=${MGPU_WITH_METRICS_HTTP} (expected AUTO, ON or OFF)")
endif()
if(NOT MGPU_WITH_METRICS_HTTP STREQUAL "OFF")
  find_package(PkgConfig QUIET)
  if(PkgConfig_FOUND)
    pkg_check_modules(MGPU_HTTPLIB QUIET cpp-httplib)
  endif()
  if(MGPU_HTTPLIB_FOUND)
    set(MGPU_METRICS_HTTP ON)
  elseif(MGPU_WITH_METRICS_HTTP STREQUAL "ON")
    message(FATAL_ERROR "mgpu: MGPU_WITH_METRICS_HTTP=ON but no cpp-httplib (expected libcpp-httplib-dev and pkgconf)")
  endif()
endif()
if(MGPU_METRICS_HTTP)
  message(STATUS "mgpu: metrics over HTTP ON (cpp-httplib ${MGPU_HTTPLIB_VERSION})")
else()
  message(STATUS "mgpu: metrics over HTTP OFF (no cpp-httplib: expected libcpp-httplib-dev and pkgconf; or MGPU_WITH_METRICS_HTTP=OFF)")
endif()
