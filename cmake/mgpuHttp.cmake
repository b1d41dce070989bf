# Finds cpp-httplib (Debian: libcpp-httplib-dev, a compiled library whose header needs the flags of
# its pkg-config file, read by pkgconf) for the metrics module's /metrics endpoint. Without it,
# metrics::HttpExporter says so when constructed; the textfile exporter works either way.
set(MGPU_METRICS_HTTP OFF)
find_package(PkgConfig QUIET)
if(PkgConfig_FOUND)
  pkg_check_modules(MGPU_HTTPLIB QUIET cpp-httplib)
endif()
if(MGPU_HTTPLIB_FOUND)
  set(MGPU_METRICS_HTTP ON)
  message(STATUS "mgpu: metrics over HTTP ON (cpp-httplib ${MGPU_HTTPLIB_VERSION})")
else()
  message(STATUS "mgpu: metrics over HTTP OFF (no cpp-httplib: expected libcpp-httplib-dev and pkgconf)")
endif()
