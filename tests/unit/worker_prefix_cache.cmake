# The prefix cache's bookkeeping over a real KV pool (worker/prefix_cache.h, issue 43).
duet_add_test(test_worker_prefix_cache SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_worker_prefix_cache.c
              LIBS duet_worker TIMEOUT 300)
