# `duet up` as a real process, with duet-test-worker (test tool) standing in for the workers.
duet_add_test(test_launcher_up SOURCES ${PROJECT_SOURCE_DIR}/tests/integration/test_launcher_up.c
              TIMEOUT 300)
add_dependencies(test_launcher_up duet duet-router duet-test-worker duetctl)
