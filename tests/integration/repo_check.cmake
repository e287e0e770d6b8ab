# The repository stands alone (tests/repo_check.sh): no outside paths, cited docs exist, data
# folders name their sources.
add_test(NAME repo_standalone COMMAND bash ${PROJECT_SOURCE_DIR}/tests/repo_check.sh
                                      ${PROJECT_SOURCE_DIR})
set_tests_properties(repo_standalone PROPERTIES TIMEOUT 60)
