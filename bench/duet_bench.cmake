# duet-bench: the serving benchmark client (OpenAI HTTP, vLLM's metric definitions, perf gates).
# duet_bench_core holds the pure parts (stats, SSE reader, gates, accuracy scoring and test) the
# unit tests link; the executable adds the libuv + http-parser client. router/ and router/http/ find libuv and
# http-parser in their own directory scopes, so they are looked up again here (the cached paths
# make that free).
pkg_check_modules(DUET_BENCH_LIBUV REQUIRED IMPORTED_TARGET libuv)
find_path(HTTP_PARSER_INCLUDE_DIR http_parser.h REQUIRED)
find_library(HTTP_PARSER_LIBRARY http_parser REQUIRED)

add_library(duet_bench_core STATIC ${CMAKE_CURRENT_LIST_DIR}/serving_stats.c
                                   ${CMAKE_CURRENT_LIST_DIR}/serving_sse.c
                                   ${CMAKE_CURRENT_LIST_DIR}/serving_gates.c
                                   ${CMAKE_CURRENT_LIST_DIR}/serving_accuracy.c)
duet_target_defaults(duet_bench_core)
target_link_libraries(duet_bench_core PUBLIC duet_common PkgConfig::JANSSON m)

add_executable(duet-bench ${CMAKE_CURRENT_LIST_DIR}/duet_bench.c
                          ${CMAKE_CURRENT_LIST_DIR}/serving_http.c)
duet_target_defaults(duet-bench)
target_include_directories(duet-bench PRIVATE ${HTTP_PARSER_INCLUDE_DIR})
target_link_libraries(duet-bench PRIVATE duet_bench_core PkgConfig::DUET_BENCH_LIBUV
                                         ${HTTP_PARSER_LIBRARY})
