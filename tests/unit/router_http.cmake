# The router's HTTP server core, driven over loopback sockets (server + echo app in a thread).
duet_add_test(router_http SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_router_http.c
              LIBS duet_test_http_echo duet_router_http Threads::Threads TIMEOUT 300)
# The same server through its socketless test seam (the one fuzz/fuzz_http.c drives), with the
# fuzz findings as plain cases.
duet_add_test(router_http_fake SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_router_http_fake.c
              LIBS duet_router_http TIMEOUT 60)
