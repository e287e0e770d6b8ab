# duet-bench-splitkv: the CPU's MLA decode attention, skewed batch against balanced, under each
# split-KV plan (issue 38; bench/bench_splitkv.c).
add_executable(duet-bench-splitkv ${CMAKE_CURRENT_LIST_DIR}/bench_splitkv.c)
duet_target_defaults(duet-bench-splitkv)
target_link_libraries(duet-bench-splitkv PRIVATE duet_kernels duet_common)
