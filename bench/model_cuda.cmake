# duet-bench-model-cuda: the CUDA engine at a real model's dimensions with random device weights:
# decode step time vs the memory roofline, prefill tok/s vs cuBLASLt (bench/bench_model_cuda.c).
if(DUET_HAVE_CUDA)
  add_executable(duet-bench-model-cuda ${CMAKE_CURRENT_LIST_DIR}/bench_model_cuda.c)
  duet_target_defaults(duet-bench-model-cuda)
  target_link_libraries(duet-bench-model-cuda PRIVATE duet_engine duet_kernels_cuda m)
endif()
