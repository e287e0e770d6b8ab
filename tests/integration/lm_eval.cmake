# EleutherAI's lm-evaluation-harness (lm-eval's local-completions model) through a real cluster
# (duet-router + duet-ctx + duet-gen, demo model) on the tiny tasks in tests/data/lm_eval, its
# log-likelihoods, accuracies and generations against duet-generate
# (tests/integration/lm_eval_test.py). Needs lm-eval and transformers in the tests' venv
# (tests/python/requirements-lm-eval.txt, made by tests/python/setup.sh): skipped (exit 77) with a message
# only when the venv lacks them; without the venv at all it fails.
add_test(NAME lm_eval_cluster
         COMMAND ${PROJECT_BINARY_DIR}/pyvenv/bin/python
                 ${PROJECT_SOURCE_DIR}/tests/integration/lm_eval_test.py
                 ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR}/models/duet-demo)
set_tests_properties(lm_eval_cluster PROPERTIES TIMEOUT 300 LABELS "integration;network"
                                                RESOURCE_LOCK duet_cluster SKIP_RETURN_CODE 77)
