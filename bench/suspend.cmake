# duet-bench-suspend: suspend / resume of a request's cache on the CPU (snapshot save + close,
# open + restore) against memcpy, demo model and Kimi-Linear-48B cache dimensions (issue 37;
# bench/bench_suspend.c).
add_executable(duet-bench-suspend ${CMAKE_CURRENT_LIST_DIR}/bench_suspend.c)
duet_target_defaults(duet-bench-suspend)
target_compile_options(duet-bench-suspend PRIVATE -O2)
target_compile_definitions(duet-bench-suspend PRIVATE DUET_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
target_link_libraries(duet-bench-suspend PRIVATE duet_cache_bench duet_engine)
