# response_format json_schema's automaton against the jsonschema package (the tests' venv,
# tests/python/setup.sh; without it the test fails, it never skips).
add_test(NAME json_schema_oracle
         COMMAND ${PROJECT_BINARY_DIR}/pyvenv/bin/python
                 ${PROJECT_SOURCE_DIR}/tests/integration/json_schema_oracle_test.py
                 ${PROJECT_BINARY_DIR})
set_tests_properties(json_schema_oracle PROPERTIES TIMEOUT 300 LABELS "integration")
