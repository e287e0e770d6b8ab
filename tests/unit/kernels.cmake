# Unit tests of the kernels module (CPU backend).
duet_add_test(test_kernels_cpu SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_kernels_cpu.c
              LIBS duet_kernels TIMEOUT 600)
# The CPU's planned MLA attention: a double-precision reference, and bit-identity across plans.
duet_add_test(test_kernels_cpu_mla SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_kernels_cpu_mla.c
              LIBS duet_kernels TIMEOUT 300)
