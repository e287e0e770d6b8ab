# bench/soak's short form (docs/soak.md): a local cluster (router, 2 ctx, 2 gen, the demo model)
# under a seeded stream of requests of every kind while workers are killed, stalled, restarted,
# drained and admission paused; once without speculation and once with prompt lookup. Every
# request ends once with a result or a named cause, completed answers equal duet-generate's,
# the router's counts add up, every pool is full again, no process grew or crashed. 3-4
# minutes on 2 cores; the long form (10,000 requests per mode) is a benchmark (bench/RESULTS.md).
# Needs the tests' venv (tests/python/setup.sh): fails, never skips, without it.
add_test(NAME soak_short
         COMMAND ${PROJECT_SOURCE_DIR}/bench/soak --build ${PROJECT_BINARY_DIR} --requests 1000
                 --seed 41)
# its cluster must not share the 2 cores with another suite's clusters (test_cluster's fault
# timings, perf gates)
set_tests_properties(soak_short PROPERTIES TIMEOUT 600 RESOURCE_LOCK duet_cluster
                     LABELS "integration;soak")
