/*
 * Fuzz target: tokenizer files of a model folder (tokenizer/): the tiktoken rank file parser
 * (tiktoken.c), and in folder mode the files tokenizer/folder.c reads next to it.
 *
 * Input: a control byte, then the payload.
 *  mode 0: the payload is a rank file "NAME.tiktoken" of an unknown encoding, loaded with
 *          cl100k's split pattern and no specials (duet_tokenizer_create_tiktoken);
 *  mode 1: the payload is a Kimi "tiktoken.model" (Kimi's rules: contiguous ranks, its special
 *          range and run splitting);
 *  mode 2: a model folder: the payload is split at "\n--file--\n" into tiktoken.model,
 *          tokenizer_config.json, special_tokens_map.json, config.json and
 *          generation_config.json (missing pieces are absent files), then duet_tokenizer_load and
 *          duet_tokenizer_stop_ids on the folder.
 * Checked besides no crash / sanitizer report:
 *  - a refusal sets a detail and gives no tokenizer;
 *  - a loaded tokenizer round-trips: decode(encode(text)) == text, byte for byte, for a fixed
 *    multilingual text and for the input's own bytes, with and without special-token matching
 *    (every single byte is in the vocabulary, so any bytes encode), every id < vocab_size;
 *  - stop ids are inside the vocabulary, without repeats.
 */
#include "fuzz/fuzz.h"

#include "common/status.h"
#include "tokenizer/tokenizer.h"

static const char sample[] = "Hello, world! 123 caf\xc3\xa9 \xe4\xb8\xad\xe6\x96\x87 "
                             "\xf0\x9f\x98\x80  \t\n\r\n<|im_end|> x\xff\xfe";

static void round_trip(const duet_tokenizer_t *tok, const uint8_t *text, size_t len)
{
    for (unsigned flags = 0; flags <= DUET_TOKENIZER_ALLOW_SPECIAL;
         flags += DUET_TOKENIZER_ALLOW_SPECIAL) {
        size_t n = 0;
        duet_status_t st = duet_tokenizer_encode(tok, (const char *)text, len, flags, NULL, 0, &n);
        FUZZ_CHECK(st == DUET_OK || st == DUET_ERR_NO_SPACE, "encode: %s", duet_error_last());
        uint32_t *ids = malloc((n + 1) * sizeof(*ids));
        FUZZ_CHECK(ids != NULL, "oom");
        size_t n2 = 0;
        FUZZ_CHECK(duet_tokenizer_encode(tok, (const char *)text, len, flags, ids, n, &n2) ==
                           DUET_OK &&
                       n2 == n,
                   "encode: %s", duet_error_last());
        for (size_t i = 0; i < n; i++)
            FUZZ_CHECK(ids[i] < duet_tokenizer_vocab_size(tok), "id %u", ids[i]);
        char *back = malloc(len + 1);
        size_t blen = 0;
        FUZZ_CHECK(back != NULL, "oom");
        FUZZ_CHECK(duet_tokenizer_decode(tok, ids, n, back, len, &blen) == DUET_OK && blen == len &&
                       memcmp(back, text, len) == 0,
                   "decode(encode(%zu bytes)) gave %zu bytes (flags %u)", len, blen, flags);
        free(back);
        free(ids);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_quiet();
    fuzz_in_t in = {data, size};
    unsigned mode = fuzz_byte(&in) % 3;
    static const char *const folder_files[] = {"tiktoken.model", "tokenizer_config.json",
                                               "special_tokens_map.json", "config.json",
                                               "generation_config.json"};
    /* No file of an earlier input may stay: the folder loader looks at what is there. */
    fuzz_remove_file("fuzz_base.tiktoken");
    for (size_t i = 0; i < sizeof(folder_files) / sizeof(folder_files[0]); i++)
        fuzz_remove_file(folder_files[i]);
    duet_tokenizer_t *tok = NULL;
    duet_status_t st;
    duet_error_clear();
    if (mode == 0) {
        const char *path = fuzz_write_file("fuzz_base.tiktoken", in.p, in.n);
        static const duet_tokenizer_special_t none[1];
        st = duet_tokenizer_create_tiktoken(path, duet_tokenizer_pattern("cl100k_base"), none, 0,
                                            &tok);
    } else if (mode == 1) {
        const char *path = fuzz_write_file("tiktoken.model", in.p, in.n);
        st = duet_tokenizer_create_tiktoken(path, NULL, NULL, 0, &tok);
    } else {
        for (size_t i = 0; i < sizeof(folder_files) / sizeof(folder_files[0]); i++) {
            size_t len;
            bool more = in.n > 0;
            const uint8_t *p = fuzz_piece(&in, "\n--file--\n", &len);
            if (more || i == 0)
                fuzz_write_file(folder_files[i], p, len);
        }
        st = duet_tokenizer_load(fuzz_tmpdir(), &tok);
    }
    if (st != DUET_OK) {
        FUZZ_CHECK(st < 0 && tok == NULL && duet_error_last()[0] != '\0',
                   "refusal %d without a detail", (int)st);
        return 0;
    }
    FUZZ_CHECK(tok != NULL && duet_tokenizer_vocab_size(tok) >= 256, "vocab");
    round_trip(tok, (const uint8_t *)sample, sizeof(sample) - 1);
    round_trip(tok, data, size < 512 ? size : 512);
    if (mode == 2) {
        uint32_t ids[16];
        size_t n = 0;
        duet_error_clear();
        st = duet_tokenizer_stop_ids(fuzz_tmpdir(), tok, ids, 16, &n);
        if (st == DUET_OK) {
            FUZZ_CHECK(n <= 16, "%zu stop ids", n);
            for (size_t i = 0; i < n; i++) {
                FUZZ_CHECK(ids[i] < duet_tokenizer_vocab_size(tok), "stop id %u", ids[i]);
                for (size_t j = 0; j < i; j++)
                    FUZZ_CHECK(ids[i] != ids[j], "stop id %u twice", ids[i]);
            }
        } else {
            FUZZ_CHECK(st < 0 && duet_error_last()[0] != '\0', "stop ids refused without detail");
        }
    }
    duet_tokenizer_destroy(tok);
    return 0;
}
