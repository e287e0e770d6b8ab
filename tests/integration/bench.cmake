# duet-bench against duet-router + duet-test-worker processes (test tool) on loopback.
duet_add_test(test_bench_serving SOURCES ${PROJECT_SOURCE_DIR}/tests/integration/test_bench_serving.c
              LIBS PkgConfig::JANSSON TIMEOUT 300)
add_dependencies(test_bench_serving duet-bench duet-router duet-test-worker)
