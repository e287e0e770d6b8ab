# duet-bench against duet-router + duet-test-worker processes (test tool) on loopback.
duet_add_test(test_bench_serving SOURCES ${PROJECT_SOURCE_DIR}/tests/integration/test_bench_serving.c
              LIBS PkgConfig::JANSSON TIMEOUT 300)
add_dependencies(test_bench_serving duet-bench duet-router duet-test-worker)
# duet-bench --accuracy against a FAKE echo + logprobs server (a Python http.server whose
# log-probabilities follow a known rule), and bench/accuracy_docs.py; python3's stdlib only.
find_package(Python3 REQUIRED COMPONENTS Interpreter)
add_test(NAME test_bench_accuracy_fake
         COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/test_bench_accuracy.py
                 $<TARGET_FILE:duet-bench> ${PROJECT_SOURCE_DIR})
set_tests_properties(test_bench_accuracy_fake PROPERTIES TIMEOUT 120)
