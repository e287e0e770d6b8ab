# The cluster end to end: duet-router + duet-ctx + duet-gen on loopback with the demo model,
# against duet-generate (tests/integration/test_cluster.c).
duet_add_test(test_cluster SOURCES ${PROJECT_SOURCE_DIR}/tests/integration/test_cluster.c
              LIBS PkgConfig::JANSSON Threads::Threads TIMEOUT 900)
add_dependencies(test_cluster duet-router duet-ctx duet-gen duet-generate duet-bench duet)

# duet-ctx / duet-gen against malformed and out-of-order messages from a fake router (the test).
duet_add_test(test_worker_protocol SOURCES ${PROJECT_SOURCE_DIR}/tests/integration/test_worker_protocol.c
              LIBS duet_transfer TIMEOUT 300)
add_dependencies(test_worker_protocol duet-ctx duet-gen)
# the generation groups' mpirun (tests/integration/test_cluster.c, cluster_group)
target_compile_definitions(test_cluster PRIVATE DUET_MPIEXEC="${MPIEXEC_EXECUTABLE}")
