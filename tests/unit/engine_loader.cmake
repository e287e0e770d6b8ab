# Checkpoint loader of engine/: config.json parsing, safetensors, weight binding.
# The tests build the loader sources directly (not duet_engine) so they do not depend on the
# state of the rest of the engine; st_writer.c is the shared safetensors writer for tests.
set(DUET_ENGINE_LOADER_SRC
    ${PROJECT_SOURCE_DIR}/engine/model_config.c
    ${PROJECT_SOURCE_DIR}/engine/checkpoint.c
    ${PROJECT_SOURCE_DIR}/engine/weights.c
    ${CMAKE_CURRENT_LIST_DIR}/st_writer.c)

duet_add_test(engine_config
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_engine_config.c ${DUET_ENGINE_LOADER_SRC}
  LIBS duet_kernels duet_common PkgConfig::JANSSON m
  TIMEOUT 120)

duet_add_test(engine_checkpoint
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_engine_checkpoint.c ${DUET_ENGINE_LOADER_SRC}
  LIBS duet_kernels duet_common PkgConfig::JANSSON m
  TIMEOUT 300)
