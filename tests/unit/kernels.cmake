# Unit tests of the kernels module (CPU backend).
duet_add_test(test_kernels_cpu SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_kernels_cpu.c
              LIBS duet_kernels TIMEOUT 600)
# The CPU's planned MLA attention: a double-precision reference, and bit-identity across plans.
duet_add_test(test_kernels_cpu_mla SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_kernels_cpu_mla.c
              LIBS duet_kernels TIMEOUT 300)
# The pool's checks of test_kernels_cpu as a plain program (tests/unit/pool_checks.h), the form
# that runs under ThreadSanitizer, which cannot host Criterion (docs/sanitizers.md).
add_executable(test_pool_threads ${CMAKE_CURRENT_LIST_DIR}/test_pool_threads.c)
duet_target_defaults(test_pool_threads)
target_link_libraries(test_pool_threads PRIVATE duet_kernels Threads::Threads)
add_test(NAME pool_threads COMMAND test_pool_threads)
set_tests_properties(pool_threads PROPERTIES TIMEOUT 300)
