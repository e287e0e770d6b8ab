# duet-bench-group: a Helix generation group's decode step at long contexts against one process
# (issue 39; bench/bench_group.c); run the group under mpirun.
add_executable(duet-bench-group ${CMAKE_CURRENT_LIST_DIR}/bench_group.c)
duet_target_defaults(duet-bench-group)
target_compile_definitions(duet-bench-group PRIVATE DUET_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
target_link_libraries(duet-bench-group PRIVATE duet_cache_bench duet_engine duet_group duet_common)
