# The refusal of a GPU the build has no code for (kernels/cuda/device.cu): the probe compiled
# again, for sm_80 SASS only (no PTX), into its own test, so on any device other than compute
# capability 8.x it must say "no" and name the flag to rebuild with. Built whenever nvcc is
# found; skips without a CUDA device.
if(DUET_HAVE_CUDA)
  duet_add_test(test_cuda_arch
                SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cuda_arch.c
                        ${PROJECT_SOURCE_DIR}/kernels/cuda/device.cu
                LIBS duet_common CUDA::cudart_static TIMEOUT 120)
  set_target_properties(test_cuda_arch PROPERTIES CUDA_ARCHITECTURES 80-real)
endif()
