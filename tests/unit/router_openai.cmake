# OpenAI API layer (router/api/openai.c, router/api/chat_template.c): validation, chat template,
# responses, streaming text, parser fuzz. The library alone, as the router links it.
duet_add_test(test_router_openai SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_router_openai.c
              LIBS duet_router_api TIMEOUT 180)
duet_add_test(test_router_tokenize SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_router_tokenize.c
              LIBS duet_router_api TIMEOUT 60)
duet_add_test(test_router_tools SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_router_tools.c
              LIBS duet_router_api TIMEOUT 60)
# Log-probabilities and logit processing fields (router/api/openai_logprobs.c): parsing and
# OpenAI's JSON shapes, checked by parsing the output back.
duet_add_test(test_router_openai_logprobs
              SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_router_openai_logprobs.c
              LIBS duet_router_api PkgConfig::JANSSON TIMEOUT 60)
