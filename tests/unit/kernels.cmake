# Unit tests of the kernels module (CPU backend).
duet_add_test(test_kernels_cpu SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_kernels_cpu.c
              LIBS duet_kernels TIMEOUT 600)
