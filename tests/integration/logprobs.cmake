# Log-probabilities and logit processing through a real cluster (duet-router + duet-ctx + duet-gen,
# demo model) against duet-generate, and chat logprobs through the official `openai` client
# (tests/integration/logprobs_cluster_test.py). Needs the tests' venv (tests/python/setup.sh):
# without it the test fails, it never skips.
add_test(NAME logprobs_cluster
         COMMAND ${PROJECT_BINARY_DIR}/pyvenv/bin/python
                 ${PROJECT_SOURCE_DIR}/tests/integration/logprobs_cluster_test.py
                 ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR}/models/duet-demo)
set_tests_properties(logprobs_cluster PROPERTIES TIMEOUT 300 LABELS "integration;network"
                                                 RESOURCE_LOCK duet_cluster)
