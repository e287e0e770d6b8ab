# duet-bench's pure modules: metric math, perf gates, accuracy scoring and its t-test, the SSE
# stream reader (with a fuzz pass).
duet_add_test(test_bench_stats SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_bench_stats.c
              LIBS duet_bench_core TIMEOUT 60)
duet_add_test(test_bench_gates SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_bench_gates.c
              LIBS duet_bench_core TIMEOUT 60)
duet_add_test(test_bench_accuracy SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_bench_accuracy.c
              LIBS duet_bench_core TIMEOUT 60)
duet_add_test(test_bench_sse SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_bench_sse.c
              LIBS duet_bench_core TIMEOUT 180)
# tools/trace_step.py (the CUPTI trace's per-kernel table) on a synthetic trace with malformed
# lines; needs only python3, which deploy/install-deps.sh installs.
find_package(Python3 REQUIRED COMPONENTS Interpreter)
add_test(NAME test_trace_step
         COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/test_trace_step.py)
set_tests_properties(test_trace_step PROPERTIES TIMEOUT 60)
