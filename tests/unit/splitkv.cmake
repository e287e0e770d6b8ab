# The split-KV planner (kernels/splitkv.h): property tests over random batches.
duet_add_test(test_splitkv SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_splitkv.c
              LIBS duet_kernels TIMEOUT 240)
