# duet_cache_bench: what the request-cache benchmarks (duet-bench-suspend, duet-bench-move)
# share (bench/cache_bench.h): the clock, medians, --contexts, and the small checkpoint with
# Kimi-Linear-48B's cache dimensions that st_writer.c writes.
add_library(duet_cache_bench STATIC ${CMAKE_CURRENT_LIST_DIR}/cache_bench.c
                                    ${PROJECT_SOURCE_DIR}/tests/unit/st_writer.c)
duet_target_defaults(duet_cache_bench)
target_link_libraries(duet_cache_bench PUBLIC duet_engine)
