# GPU test of the MLA cache write and paged attention kernels (kernels/cuda/mla.cu); without a
# CUDA device it skips the GPU cases and still checks the scratch size and the argument checks.
if(DUET_HAVE_CUDA)
  duet_add_test(test_cuda_mla SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cuda_mla.c
                LIBS duet_kernels_cuda TIMEOUT 300)
endif()
# The expanded (non-absorbed) prefill form: against a double reference, and against the
# absorbed path at Kimi Linear's shape with timings.
if(DUET_HAVE_CUDA)
  duet_add_test(test_cuda_mla_x SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cuda_mla_x.c
                LIBS duet_kernels_cuda TIMEOUT 300)
endif()
