# GPU test of the KDA kernels (kernels/cuda/kda.cu) against the CPU reference chain; built
# whenever nvcc is found, skipping its GPU cases without a CUDA device. engine/kda.c (the CPU
# core) is compiled in directly so the test does not pull in the whole engine.
if(DUET_HAVE_CUDA)
  duet_add_test(test_cuda_kda
                SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cuda_kda.c ${PROJECT_SOURCE_DIR}/engine/kda.c
                LIBS duet_kernels_cuda TIMEOUT 300)
endif()
