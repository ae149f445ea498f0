# The C++ standard to compile with: C++17 (Tessera's own level) unless the libtorch found
# cannot be included at C++17, then C++20. Decided by compiling ATen's umbrella header,
# never by comparing version numbers. Sets CMAKE_CXX_STANDARD before any target exists.
include(CheckCXXSourceCompiles)
include(CMakePushCheckState)

function(tessera_probe_standard std out)
  cmake_push_check_state(RESET)
  set(CMAKE_REQUIRED_INCLUDES ${TORCH_INCLUDE_DIRS})
  set(CMAKE_CXX_STANDARD ${std})  # try_compile honours it (CMP0067)
  set(CMAKE_REQUIRED_QUIET ON)
  set(CMAKE_TRY_COMPILE_TARGET_TYPE STATIC_LIBRARY)
  check_cxx_source_compiles("
#include <ATen/ATen.h>
int main() { return 0; }" ${out})
  cmake_pop_check_state()
endfunction()

if(NOT DEFINED TESSERA_CXX_STANDARD)
  tessera_probe_standard(17 TESSERA_TORCH_BUILDS_AT_CXX17)
  if(TESSERA_TORCH_BUILDS_AT_CXX17)
    set(std 17)
  else()
    tessera_probe_standard(20 TESSERA_TORCH_BUILDS_AT_CXX20)
    if(NOT TESSERA_TORCH_BUILDS_AT_CXX20)
      message(FATAL_ERROR "the libtorch headers at ${TORCH_INCLUDE_DIRS} compile neither as C++17 nor as "
                          "C++20 with ${CMAKE_CXX_COMPILER} (see CMakeFiles/CMakeError.log)")
    endif()
    set(std 20)
  endif()
  set(TESSERA_CXX_STANDARD ${std} CACHE STRING "C++ standard (probed: the lowest of 17, 20 that libtorch accepts)")
endif()
set(CMAKE_CXX_STANDARD ${TESSERA_CXX_STANDARD})
message(STATUS "Tessera: C++${TESSERA_CXX_STANDARD}")
