# duet-bench-kernels: GFLOP/s and weight bandwidth of the CPU matmul (bench/bench_kernels.c).
add_executable(duet-bench-kernels ${CMAKE_CURRENT_LIST_DIR}/bench_kernels.c)
duet_target_defaults(duet-bench-kernels)
target_compile_options(duet-bench-kernels PRIVATE -O2)
target_link_libraries(duet-bench-kernels PRIVATE duet_kernels)
