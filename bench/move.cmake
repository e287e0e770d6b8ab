# duet-bench-move: moving a running request (KV pages, KDA state, pending replay rows) between two
# generation-worker processes through the transfer layer on the CPU, over shared memory and tcp,
# against memcpy; demo model and Kimi-Linear-48B cache dimensions (issue 37; bench/bench_move.c).
add_executable(duet-bench-move ${CMAKE_CURRENT_LIST_DIR}/bench_move.c)
duet_target_defaults(duet-bench-move)
target_compile_options(duet-bench-move PRIVATE -O2)
target_compile_definitions(duet-bench-move PRIVATE DUET_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
target_link_libraries(duet-bench-move PRIVATE duet_cache_bench duet_worker duet_transfer)
