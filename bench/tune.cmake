# duet-bench-tune: the autotuner's warm-up time at a model's load (bench/bench_tune.c; issue 39).
add_executable(duet-bench-tune ${CMAKE_CURRENT_LIST_DIR}/bench_tune.c)
duet_target_defaults(duet-bench-tune)
target_compile_definitions(duet-bench-tune PRIVATE DUET_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
target_link_libraries(duet-bench-tune PRIVATE duet_engine duet_group)
