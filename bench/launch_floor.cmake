# duet-bench-launch-floor: the fastest a batch-1 decode step could run as the CUDA engine's
# sequence of kernels if each only streamed its bytes (bench/bench_launch_floor.cu). Built
# whenever nvcc is found; without a device it exits 0.
if(DUET_HAVE_CUDA)
  add_executable(duet-bench-launch-floor ${CMAKE_CURRENT_LIST_DIR}/bench_launch_floor.cu)
  duet_target_defaults(duet-bench-launch-floor)
  target_link_libraries(duet-bench-launch-floor PRIVATE duet_engine duet_kernels_cuda)
endif()
