# duet-bench-splitkv: the CPU's MLA decode attention, skewed batch against balanced, under each
# split-KV plan (issue 38; bench/bench_splitkv.c).
add_executable(duet-bench-splitkv ${CMAKE_CURRENT_LIST_DIR}/bench_splitkv.c)
duet_target_defaults(duet-bench-splitkv)
target_link_libraries(duet-bench-splitkv PRIVATE duet_kernels duet_common)
# duet-bench-splitkv-cuda: the same comparison for the CUDA MLA decode attention at
# Kimi-Linear-48B's shape (bench/bench_splitkv_cuda.c). Built whenever nvcc is found; without a
# device it exits 0.
if(DUET_HAVE_CUDA)
  add_executable(duet-bench-splitkv-cuda ${CMAKE_CURRENT_LIST_DIR}/bench_splitkv_cuda.c)
  duet_target_defaults(duet-bench-splitkv-cuda)
  target_link_libraries(duet-bench-splitkv-cuda PRIVATE duet_kernels_cuda duet_common)
endif()
