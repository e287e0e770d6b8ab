# duet-bench-grammar: the per-step cost of response_format's vocabulary mask (json_object and
# json_schema) on a tokenizer's vocabulary.
add_executable(duet-bench-grammar ${CMAKE_CURRENT_LIST_DIR}/bench_grammar.c)
duet_target_defaults(duet-bench-grammar)
target_compile_definitions(duet-bench-grammar PRIVATE DUET_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
target_link_libraries(duet-bench-grammar PRIVATE duet_grammar duet_tokenizer)
