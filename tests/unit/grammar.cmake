# response_format json_schema: the schema compiler and automaton (grammar/json_schema.h).
duet_add_test(test_grammar_json_schema SOURCES ${PROJECT_SOURCE_DIR}/tests/unit/test_grammar_json_schema.c
              LIBS duet_grammar PkgConfig::JANSSON TIMEOUT 120)
