# duet-bench's pure modules: metric math, perf gates, the SSE stream reader (with a fuzz pass).
duet_add_test(test_bench_stats SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_bench_stats.c
              LIBS duet_bench_core TIMEOUT 60)
duet_add_test(test_bench_gates SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_bench_gates.c
              LIBS duet_bench_core TIMEOUT 60)
duet_add_test(test_bench_sse SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_bench_sse.c
              LIBS duet_bench_core TIMEOUT 180)
