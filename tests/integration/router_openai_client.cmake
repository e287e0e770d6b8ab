# The official `openai` Python client (pinned in tests/python/requirements.txt, from the tests'
# venv that tests/python/setup.sh makes) against duet-router + duet-test-worker processes, then
# `promtool check metrics` on the router's /metrics. Fails (never skips) without the venv or promtool.
add_test(NAME router_openai_client
         COMMAND bash ${PROJECT_SOURCE_DIR}/tests/integration/run_openai_client_test.sh
                 ${PROJECT_BINARY_DIR})
set_tests_properties(router_openai_client PROPERTIES TIMEOUT 600 LABELS "integration;network")
