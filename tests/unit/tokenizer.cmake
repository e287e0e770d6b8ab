# Tokenizer tests (engine/tokenizer): the library alone, as the router links it.
duet_add_test(test_tokenizer_bpe SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_tokenizer_bpe.c
              LIBS duet_tokenizer TIMEOUT 300)
duet_add_test(test_tokenizer_byte SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_tokenizer_byte.c
              LIBS duet_tokenizer TIMEOUT 120)
duet_add_test(test_tokenizer_ranks SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_tokenizer_ranks.c
              LIBS duet_tokenizer TIMEOUT 120)
