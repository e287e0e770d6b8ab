# GPU test of the KDA kernels (kernels/cuda/kda.cu) against the CPU reference chain; built
# whenever nvcc is found, skipping its GPU cases without a CUDA device. The CPU core
# (kernels/cpu/kda.c) comes with duet_kernels, which duet_kernels_cuda links.
if(DUET_HAVE_CUDA)
  duet_add_test(test_cuda_kda SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cuda_kda.c
                LIBS duet_kernels_cuda TIMEOUT 300)
endif()
