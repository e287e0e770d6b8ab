# duet-router with duet-test-worker processes (test tool) on loopback.
duet_add_test(test_router_cluster SOURCES ${PROJECT_SOURCE_DIR}/tests/integration/test_router_cluster.c
              TIMEOUT 300)
add_dependencies(test_router_cluster duet-router duet-test-worker)
