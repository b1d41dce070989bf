# mgpu_probe_package(<package> <found-var> <problem-var>): runs find_package(<package> CONFIG
# REQUIRED) in a child CMake run and tells whether it succeeded, and if not, why in one line.
# A package's own config file may call find_package(... REQUIRED) for a dependency of its own that a
# machine lacks (Debian's dnnl-config.cmake does for OpenCL, which libdnnl-dev only recommends).
# In this configure that would be a fatal error no QUIET can catch; in the child run it fails alone,
# so an optional dependency can fall back. The child sees the same search settings, including each
# CMAKE_DISABLE_FIND_PACKAGE_<name>.
function(mgpu_probe_package package found_var problem_var)
  set(dir "${PROJECT_BINARY_DIR}/CMakeFiles/mgpu-probe-${package}")
  file(WRITE "${dir}/src/CMakeLists.txt"
    "cmake_minimum_required(VERSION ${CMAKE_MINIMUM_REQUIRED_VERSION})\n"
    "project(mgpu_probe_${package} LANGUAGES CXX)\n"
    "find_package(${package} CONFIG REQUIRED)\n")
  set(args "-DCMAKE_CXX_COMPILER=${CMAKE_CXX_COMPILER}")
  get_cmake_property(variables CACHE_VARIABLES)
  foreach(variable IN LISTS variables)
    if(variable MATCHES "^(CMAKE_(DISABLE|REQUIRE)_FIND_PACKAGE_.*|CMAKE_PREFIX_PATH|CMAKE_FIND_ROOT_PATH|CMAKE_SYSTEM_PREFIX_PATH|CMAKE_MAKE_PROGRAM|.*_DIR|.*_ROOT)$")
      list(APPEND args "-D${variable}=${${variable}}")
    endif()
  endforeach()
  file(REMOVE_RECURSE "${dir}/build")
  execute_process(COMMAND "${CMAKE_COMMAND}" -S "${dir}/src" -B "${dir}/build" -G "${CMAKE_GENERATOR}" ${args}
    RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE output)
  if(result EQUAL 0)
    set(${found_var} TRUE PARENT_SCOPE)
    set(${problem_var} "" PARENT_SCOPE)
    return()
  endif()
  # The first paragraph of the first error, e.g. "Could NOT find OpenCL (missing: ...)", on one line.
  string(REGEX MATCH "CMake Error[^\n]*\n[ \t\n]*([^\n]+(\n[ \t]+[^ \t\n][^\n]*)*)" _ "${output}")
  string(REGEX REPLACE "[ \t\n]+" " " reason "${CMAKE_MATCH_1}")
  string(STRIP "${reason}" reason)
  if(reason STREQUAL "")
    set(reason "see ${dir}")
  endif()
  set(${found_var} FALSE PARENT_SCOPE)
  set(${problem_var} "${reason}" PARENT_SCOPE)
endfunction()
