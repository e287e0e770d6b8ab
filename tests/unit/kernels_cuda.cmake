# GPU tests of the CUDA kernels (kernels/cuda), built whenever nvcc is found; without a CUDA
# device (the build VM, CI) they skip with a reason.
if(DUET_HAVE_CUDA)
  duet_add_test(test_kernels_cuda SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_kernels_cuda.c
                LIBS duet_kernels_cuda TIMEOUT 600)
endif()
# The GEMM's tactics (tune op cuda_gemm): every cuBLASLt algorithm against the CPU reference, the
# tuner's choice, profiling (skips without a device).
if(DUET_HAVE_CUDA)
  duet_add_test(test_cuda_tune SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cuda_tune.c
                LIBS duet_kernels_cuda TIMEOUT 600)
endif()
