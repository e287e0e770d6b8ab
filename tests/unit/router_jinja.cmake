# The Jinja engine (router/api/jinja*.c) and its use as a chat template: origins through filters and
# methods, errors where jinja2 raises, refused templates, limits, fuzz, the OpenAI-JSON path with
# special tokens, and duet-chat-template's exit statuses. (What templates print is compared with
# jinja2 by the chat_template_oracle test, tests/integration/chat_template_oracle.cmake.)
duet_add_test(test_router_jinja SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_router_jinja.c
              LIBS duet_router_api TIMEOUT 120)
add_dependencies(test_router_jinja duet-chat-template)
