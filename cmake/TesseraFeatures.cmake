# Configure-time feature detection against whatever libtorch was found.
# Every 1.13-vs-2.x difference is decided here (by compiling probes, never by
# comparing version numbers) and surfaced as macros in tessera/config.h
# (cmake/config.h.in says who reads which).
include(CheckCXXSourceCompiles)
include(CMakePushCheckState)

cmake_push_check_state(RESET)
set(CMAKE_REQUIRED_INCLUDES ${TORCH_INCLUDE_DIRS})
set(CMAKE_REQUIRED_DEFINITIONS -DUSE_C10D_GLOO)
# (the language level is CMAKE_CXX_STANDARD, which try_compile honours)
set(CMAKE_REQUIRED_QUIET ON)
# Probes only need to compile: linking libtorch into each would be slow.
set(CMAKE_TRY_COMPILE_TARGET_TYPE STATIC_LIBRARY)

# Gloo process group headers (libgloo-dev on Debian).
check_cxx_source_compiles("
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
int main() { return 0; }" TESSERA_HAS_GLOO)
if(NOT TESSERA_HAS_GLOO)
  message(FATAL_ERROR "Tessera needs c10d's ProcessGroupGloo headers (install libgloo-dev)")
endif()

# 2.x: ProcessGroupGloo derives from c10d::Backend; 1.13: from c10d::ProcessGroup.
check_cxx_source_compiles("
#include <type_traits>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
static_assert(std::is_base_of<c10d::Backend, c10d::ProcessGroupGloo>::value, \"\");
int main() { return 0; }" TESSERA_GLOO_IS_BACKEND)

# NCCL process group: only where this libtorch was built with CUDA + NCCL.
set(TESSERA_HAS_NCCL OFF)
if(TORCH_CUDA_LIBRARIES OR CUDA_FOUND OR CUDAToolkit_FOUND)
  set(CMAKE_REQUIRED_DEFINITIONS -DUSE_C10D_GLOO -DUSE_C10D_NCCL)
  check_cxx_source_compiles("
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
int main() { return 0; }" TESSERA_NCCL_HEADERS)
  if(TESSERA_NCCL_HEADERS)
    set(TESSERA_HAS_NCCL ON)
  endif()
endif()
cmake_pop_check_state()
unset(CMAKE_TRY_COMPILE_TARGET_TYPE)

set(TESSERA_HAS_CUDA OFF)
if(TORCH_CUDA_LIBRARIES OR CUDA_FOUND OR CUDAToolkit_FOUND)
  set(TESSERA_HAS_CUDA ON)
endif()

message(STATUS "Tessera: torch ${Torch_VERSION}; gloo-is-backend=${TESSERA_GLOO_IS_BACKEND} cuda=${TESSERA_HAS_CUDA} nccl=${TESSERA_HAS_NCCL}")
configure_file(${CMAKE_CURRENT_LIST_DIR}/config.h.in ${PROJECT_BINARY_DIR}/generated/tessera/config.h)
