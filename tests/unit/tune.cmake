# The autotuner (kernels/tune.h, issue 39): the profiling split over a fake group, the file, the
# CPU matmul's tactics (bit-identical), the engine's tune option.
duet_add_test(test_tune SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_tune.c
              LIBS duet_engine TIMEOUT 600)
