# Programs of this project (examples, benchmarks, test helpers) are written to build/bin
# and reuse the library's precompiled header.
set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/bin)

# tessera_add_program(NAME SOURCES...): an executable linked against the library.
function(tessera_add_program name)
  add_executable(${name} ${ARGN})
  target_link_libraries(${name} PRIVATE tessera)
  tessera_reuse_pch(${name})
endfunction()

function(tessera_reuse_pch name)
  if(TESSERA_USE_PCH)
    target_precompile_headers(${name} REUSE_FROM tessera_core)
  endif()
endfunction()

# add_subdirectory for every folder under `dir` that has a CMakeLists.txt; their
# executables (written as a user would, plain add_executable + target_link_libraries)
# get the shared precompiled header.
function(tessera_add_program_dirs dir)
  file(GLOB subdirs LIST_DIRECTORIES true CONFIGURE_DEPENDS ${dir}/*)
  foreach(d ${subdirs})
    if(IS_DIRECTORY ${d} AND EXISTS ${d}/CMakeLists.txt)
      add_subdirectory(${d})
      get_property(targets DIRECTORY ${d} PROPERTY BUILDSYSTEM_TARGETS)
      foreach(t ${targets})
        get_target_property(type ${t} TYPE)
        if(type STREQUAL "EXECUTABLE")
          tessera_reuse_pch(${t})
        endif()
      endforeach()
    endif()
  endforeach()
endfunction()
