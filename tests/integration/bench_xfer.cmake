# duet-bench-xfer across two throwaway network namespaces joined by a veth (--netns,
# --net-devices): exit 0, the KV bytes its --quick schedule moves, the veth's counters moved by at
# least those; and its errors (tests/integration/test_bench_xfer_netns.sh). Skips (77) only
# without root or ip netns. Its tcp transfers keep both cores busy for a few seconds: never beside
# the cluster suites, whose perf gates and fault timings must not share the cores.
add_test(NAME test_bench_xfer_netns
         COMMAND bash ${PROJECT_SOURCE_DIR}/tests/integration/test_bench_xfer_netns.sh
                 ${PROJECT_BINARY_DIR})
set_tests_properties(test_bench_xfer_netns PROPERTIES TIMEOUT 60 SKIP_RETURN_CODE 77
                     RESOURCE_LOCK duet_cluster LABELS "integration;network")
