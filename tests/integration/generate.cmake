# duet-generate as a real process.
duet_add_test(test_generate_cli SOURCES ${PROJECT_SOURCE_DIR}/tests/integration/test_generate_cli.c
              LIBS PkgConfig::JANSSON m TIMEOUT 300)
add_dependencies(test_generate_cli duet-generate)
