# Tokenizer tests (tokenizer): the library alone, as the router links it.
duet_add_test(test_tokenizer_bpe SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_tokenizer_bpe.c
              LIBS duet_tokenizer TIMEOUT 300)
duet_add_test(test_tokenizer_byte SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_tokenizer_byte.c
              LIBS duet_tokenizer TIMEOUT 120)
duet_add_test(test_tokenizer_ranks SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_tokenizer_ranks.c
              LIBS duet_tokenizer TIMEOUT 120)

# Kimi's tokenizer against the reference: tiktoken (the tests' venv, pinned in
# tests/python/requirements.txt) with tokenization_kimi.py's split pattern, specials and encode
# rules, on a folder in Kimi's exact layout built by the harness; duet's side is
# tokenizer_oracle_driver, which loads the folder as the router does. Fails without the venv.
add_executable(tokenizer_oracle_driver ${CMAKE_CURRENT_LIST_DIR}/tokenizer_oracle_driver.c)
duet_target_defaults(tokenizer_oracle_driver)
target_link_libraries(tokenizer_oracle_driver PRIVATE duet_tokenizer)
add_test(NAME tokenizer_kimi_oracle
         COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/run_tokenizer_kimi_oracle.sh ${PROJECT_BINARY_DIR}
                 $<TARGET_FILE:tokenizer_oracle_driver>)
set_tests_properties(tokenizer_kimi_oracle PROPERTIES TIMEOUT 300)

# Model folders: duet_tokenizer.json and Kimi's layout (every malformed file refused with the file
# and field named), special tokens recognised only when allowed and named as Kimi names them,
# skip_special_tokens, generated specials through the detokenizer, the stop-id union.
duet_add_test(test_tokenizer_folder SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_tokenizer_folder.c
              LIBS duet_tokenizer TIMEOUT 120)
