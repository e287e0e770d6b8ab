# The cluster end to end: duet-router + duet-ctx + duet-gen on loopback with the demo model,
# against duet-generate (tests/integration/test_cluster.c).
duet_add_test(test_cluster SOURCES ${PROJECT_SOURCE_DIR}/tests/integration/test_cluster.c
              LIBS PkgConfig::JANSSON Threads::Threads TIMEOUT 900 ARGS --filter "cluster/*")
add_dependencies(test_cluster duet-router duet-ctx duet-gen duet-generate duet-bench duet)
# One ctest entry per suite, never two at once (each runs its own clusters, 2 tests in
# parallel): the perf gates and the fault timings must not share 2 cores with another suite's
# clusters, and a failing suite is named by its entry.
set_tests_properties(test_cluster PROPERTIES RESOURCE_LOCK duet_cluster)
foreach(suite cluster_spec cluster_group cluster_netns)
  add_test(NAME test_${suite} COMMAND test_cluster --jobs 2 --tap=- --filter "${suite}/*")
  set_tests_properties(test_${suite} PROPERTIES TIMEOUT 900 RESOURCE_LOCK duet_cluster
                       ENVIRONMENT "DUET_SOURCE_DIR=${PROJECT_SOURCE_DIR};DUET_BINARY_DIR=${PROJECT_BINARY_DIR}")
endforeach()
# The cluster suite again with every worker's prefix cache on (cache.prefix; issue 43): the same
# answers, faults and page accounting (idle: free pages + the cache's = the pool).
add_test(NAME test_cluster_prefix COMMAND test_cluster --jobs 2 --tap=- --filter "cluster/*")
set_tests_properties(test_cluster_prefix PROPERTIES TIMEOUT 900 RESOURCE_LOCK duet_cluster
                     ENVIRONMENT "DUET_TEST_PREFIX_CACHE=1;DUET_SOURCE_DIR=${PROJECT_SOURCE_DIR};DUET_BINARY_DIR=${PROJECT_BINARY_DIR}")

# duet-ctx / duet-gen against malformed and out-of-order messages from a fake router (the test).
duet_add_test(test_worker_protocol SOURCES ${PROJECT_SOURCE_DIR}/tests/integration/test_worker_protocol.c
              LIBS duet_transfer TIMEOUT 300)
add_dependencies(test_worker_protocol duet-ctx duet-gen)
# the generation groups' mpirun (tests/integration/test_cluster.c, cluster_group)
target_compile_definitions(test_cluster PRIVATE DUET_MPIEXEC="${MPIEXEC_EXECUTABLE}")
