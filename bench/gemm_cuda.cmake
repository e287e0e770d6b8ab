# duet-bench-gemm-cuda: TFLOP/s of the cuBLASLt GEMM on prefill shapes and D2D copy bandwidth
# (bench/bench_gemm_cuda.c). Built whenever nvcc is found; without a device it exits 0.
if(DUET_HAVE_CUDA)
  add_executable(duet-bench-gemm-cuda ${CMAKE_CURRENT_LIST_DIR}/bench_gemm_cuda.c)
  duet_target_defaults(duet-bench-gemm-cuda)
  target_compile_options(duet-bench-gemm-cuda PRIVATE -O2)
  target_link_libraries(duet-bench-gemm-cuda PRIVATE duet_kernels_cuda)
endif()
