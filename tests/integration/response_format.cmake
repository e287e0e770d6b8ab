# response_format json_object through a real cluster (duet-router + duet-ctx + duet-gen, demo model)
# with the official `openai` client (tests/integration/response_format_cluster_test.py). Needs the
# tests' venv (tests/python/setup.sh): without it the test fails, it never skips.
add_test(NAME response_format_cluster
         COMMAND ${PROJECT_BINARY_DIR}/pyvenv/bin/python
                 ${PROJECT_SOURCE_DIR}/tests/integration/response_format_cluster_test.py
                 ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR}/models/duet-demo)
set_tests_properties(response_format_cluster PROPERTIES TIMEOUT 300 LABELS "integration;network"
                                                        RESOURCE_LOCK duet_cluster)
