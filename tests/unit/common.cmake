# Criterion suites for common/ (status, config, JSON helpers, metrics, UTF-8, cache layout).
duet_add_test(common_status SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_common_status.c
              LIBS duet_common TIMEOUT 60)
duet_add_test(common_config SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_common_config.c
              LIBS duet_common TIMEOUT 120)
duet_add_test(common_json SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_common_json.c
              LIBS duet_common TIMEOUT 120)
duet_add_test(common_metrics SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_common_metrics.c
              LIBS duet_common TIMEOUT 120)
duet_add_test(common_utf8 SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_common_utf8.c
              LIBS duet_common TIMEOUT 60)
duet_add_test(common_cache_layout SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_common_cache_layout.c
              LIBS duet_common TIMEOUT 60)
duet_add_test(common_log SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_common_log.c
              LIBS duet_common PkgConfig::JANSSON TIMEOUT 60)
duet_add_test(common_prefix_hash SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_common_prefix_hash.c
              LIBS duet_common TIMEOUT 60)
