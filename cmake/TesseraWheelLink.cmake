# A torch wheel finds its CUDA libraries (PyPI's nvidia-* packages) through $ORIGIN RPATHs
# in its own libraries. The linker does not get there first when -rpath names the CUDA
# toolkit's folder, and would resolve libtorch_cuda's NCCL symbols against the toolkit's
# older libnccl. tessera_wheel_link_options(VAR) sets VAR to the -rpath-link option that
# points it at the libraries the program loads at run time (empty for other libtorch
# builds). Used by the build and by the installed TesseraConfig.cmake alike.
function(tessera_wheel_link_options out)
  set(opts "")
  get_filename_component(lib_dir "${TORCH_LIBRARY}" DIRECTORY)
  file(GLOB dirs LIST_DIRECTORIES true "${lib_dir}/../../nvidia/*/lib")
  if(dirs)
    list(JOIN dirs ":" path)
    set(opts "LINKER:-rpath-link,${path}")
  endif()
  set(${out} "${opts}" PARENT_SCOPE)
endfunction()
