# Engine: KDA core, sampler, and the forward pass against transformers' fixtures.
duet_add_test(test_engine_kda SOURCES ${PROJECT_SOURCE_DIR}/tests/unit/test_engine_kda.c
              LIBS duet_engine TIMEOUT 300)
duet_add_test(test_engine_sampler SOURCES ${PROJECT_SOURCE_DIR}/tests/unit/test_engine_sampler.c
              LIBS duet_engine TIMEOUT 120)
# response_format's JSON automaton and vocabulary mask, jansson as the oracle.
duet_add_test(test_engine_json_grammar SOURCES ${PROJECT_SOURCE_DIR}/tests/unit/test_engine_json_grammar.c
              LIBS duet_engine duet_tokenizer PkgConfig::JANSSON TIMEOUT 120)
duet_add_test(test_engine_golden SOURCES ${PROJECT_SOURCE_DIR}/tests/unit/test_engine_golden.c
              LIBS duet_engine PkgConfig::JANSSON TIMEOUT 900)
duet_add_test(test_engine_dtype SOURCES ${PROJECT_SOURCE_DIR}/tests/unit/test_engine_dtype.c
              LIBS duet_engine TIMEOUT 60)
duet_add_test(test_engine_cache SOURCES ${PROJECT_SOURCE_DIR}/tests/unit/test_engine_cache.c
              LIBS duet_engine TIMEOUT 120)
# The CUDA forward pass against the same fixtures (built with the CUDA backend; skips without a
# device).
if(DUET_HAVE_CUDA)
  duet_add_test(test_engine_cuda SOURCES ${PROJECT_SOURCE_DIR}/tests/unit/test_engine_cuda.c
                LIBS duet_engine PkgConfig::JANSSON TIMEOUT 900)
endif()
# Speculative decoding's engine part (verify items, accept, replay, commit, truncate) against
# plain decode on the same fixtures and the demo model.
duet_add_test(test_engine_spec SOURCES ${PROJECT_SOURCE_DIR}/tests/unit/test_engine_spec.c
              ${PROJECT_SOURCE_DIR}/tests/unit/st_writer.c
              LIBS duet_engine PkgConfig::JANSSON TIMEOUT 900)
# Speculative decoding's host side: prompt lookup, acceptance, the distribution it keeps.
duet_add_test(test_engine_accept SOURCES ${PROJECT_SOURCE_DIR}/tests/unit/test_engine_accept.c
              LIBS duet_engine TIMEOUT 300)
# duet-generate's loop (engine/generate.h) with speculation against plain decoding: greedy token
# for token on the fixtures and the demo model, alone and in mixed batches, max_tokens / stop
# ids, and sampling's distribution (a chi-square test on the demo model).
duet_add_test(test_engine_generate SOURCES ${PROJECT_SOURCE_DIR}/tests/unit/test_engine_generate.c
              ${PROJECT_SOURCE_DIR}/tests/unit/st_writer.c
              LIBS duet_engine PkgConfig::JANSSON TIMEOUT 600)
# The cache plan (engine/cache_plan.h): a hand-computed table of budgets, caps, floors and page
# sizes, and duet-gen --print-cache-plan against the pure function on the demo model + drafter.
duet_add_test(test_engine_cache_plan SOURCES ${PROJECT_SOURCE_DIR}/tests/unit/test_engine_cache_plan.c
              LIBS duet_engine PkgConfig::JANSSON TIMEOUT 120)
add_dependencies(test_engine_cache_plan duet-gen)
# A Helix group rank's cut (engine/shard.h): cuts, dealt pages, sharded weights, refusals.
duet_add_test(test_engine_shard SOURCES ${PROJECT_SOURCE_DIR}/tests/unit/test_engine_shard.c
              LIBS duet_engine TIMEOUT 60)
