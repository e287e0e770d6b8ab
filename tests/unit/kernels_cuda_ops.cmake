# GPU tests of the CUDA ops (kernels/cuda/cuda_ops.h: elementwise ops, MoE routing and experts,
# sampling) against the CPU kernels and the engine's sampler. Built whenever nvcc is found;
# without a CUDA device (the build VM, CI) they skip with a reason.
if(DUET_HAVE_CUDA)
  duet_add_test(test_cuda_ops SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cuda_ops.c
                LIBS duet_kernels_cuda duet_engine TIMEOUT 300)
endif()
