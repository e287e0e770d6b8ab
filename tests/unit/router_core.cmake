# The router's core modules: placement (pure) and the worker registry (libuv, over loopback).
duet_add_test(test_router_placement SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_router_placement.c
              LIBS duet_router_placement TIMEOUT 120)
duet_add_test(test_router_registry SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_router_registry.c
              LIBS duet_router_registry Threads::Threads TIMEOUT 120)
# The socketless test seams of the registry and the admin API (what fuzz/fuzz_registry.c and
# fuzz/fuzz_admin.c drive).
duet_add_test(test_router_seams SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_router_seams.c
              LIBS duet_router_registry duet_router_admin TIMEOUT 60)
