# deploy/launcher: the cluster-file parser of `duet up` (pure: no processes, no sockets).
duet_add_test(test_launcher_cluster SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_launcher_cluster.c
              LIBS duet_launcher TIMEOUT 120)
