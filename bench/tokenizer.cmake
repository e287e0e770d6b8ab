# bench_tokenizer: encode/decode throughput of the tiktoken tokenizers on a text corpus.
add_executable(bench_tokenizer ${CMAKE_CURRENT_LIST_DIR}/bench_tokenizer.c)
duet_target_defaults(bench_tokenizer)
target_compile_definitions(bench_tokenizer PRIVATE DUET_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
target_link_libraries(bench_tokenizer PRIVATE duet_tokenizer)
