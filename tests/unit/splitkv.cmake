# The split-KV planner (kernels/splitkv.h): property tests over random batches, and
# duet-splitkv-plan's JSON checked against the library's plan and its bad inputs' messages.
duet_add_test(test_splitkv SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_splitkv.c
              LIBS duet_kernels TIMEOUT 240)
duet_add_test(test_splitkv_cli SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_splitkv_cli.c
              LIBS duet_kernels PkgConfig::JANSSON TIMEOUT 120)
target_compile_definitions(test_splitkv_cli PRIVATE
                           "DUET_SPLITKV_PLAN_BIN=\"$<TARGET_FILE:duet-splitkv-plan>\"")
add_dependencies(test_splitkv_cli duet-splitkv-plan)
