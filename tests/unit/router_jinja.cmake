# Jinja subset renderer (router/jinja.c) and its use as a chat template: expressions, control
# flow, a Kimi-style template, segment origins, refused templates, fuzz and limits.
duet_add_test(test_router_jinja SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_router_jinja.c
              LIBS duet_router_api TIMEOUT 120)
