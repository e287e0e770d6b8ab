/*
 * Model-folder tokenizer tests (tokenizer/folder.c): duet_tokenizer.json and Kimi's layout
 * (tiktoken.model + tokenizer_config.json + special_tokens_map.json) load as documented, every
 * malformed file is refused with an error naming the file and the field, special tokens are
 * recognised only when allowed and named as tokenization_kimi.py names them, skip_special_tokens
 * drops what transformers drops, a generated special id that is no stop id never errors in the
 * streaming detokenizer, and the stop ids are the union of config.json's and
 * generation_config.json's eos_token_id and the eos token.
 *
 * The Kimi folders here use a small rank file (the 256 bytes, then "ab" and "cd": ranks 0..257),
 * so Kimi's special range is 258..515.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tokenizer/tokenizer.h"

enum { N_RANKS = 258, FIRST = N_RANKS, LAST = N_RANKS + 257 };

static char g_dir[256];

static void make_dir(void)
{
    snprintf(g_dir, sizeof(g_dir), "/tmp/duet-tok-folder-XXXXXX");
    cr_assert_not_null(mkdtemp(g_dir));
}

static void put(const char *name, const char *text)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", g_dir, name);
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "%s", path);
    fwrite(text, 1, strlen(text), f);
    fclose(f);
}

static void drop(const char *name)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", g_dir, name);
    unlink(path);
}

static void remove_dir(void)
{
    const char *names[] = {"tiktoken.model",          "tokenizer.model", "tokenizer_config.json",
                           "special_tokens_map.json", "config.json",     "generation_config.json",
                           "duet_tokenizer.json"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        drop(names[i]);
    rmdir(g_dir);
}

/* The 256 single bytes (rank = byte) and "ab" (256), "cd" (257), plus `extra` lines. */
static void put_ranks(const char *name, const char *extra)
{
    static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    size_t cap = 256 * 16 + 256 + strlen(extra);
    char *text = malloc(cap), *p = text;
    for (int b = 0; b < 256; b++)
        p += sprintf(p, "%c%c== %d\n", b64[b >> 2], b64[(b & 3) << 4], b);
    p += sprintf(p, "YWI= 256\nY2Q= 257\n%s", extra);
    put(name, text);
    free(text);
}

/* A Kimi folder: ranks, and a tokenizer_config.json with these added tokens and bos / eos. */
static const char *kimi_config =
    "{\"added_tokens_decoder\": {"
    "\"258\": {\"content\": \"[BOS]\", \"lstrip\": false, \"special\": true},"
    "\"259\": {\"content\": \"[EOS]\", \"special\": true},"
    "\"260\": {\"content\": \"<|im_end|>\", \"special\": true},"
    "\"261\": {\"content\": \"<|tool_call_begin|>\", \"special\": false},"
    "\"264\": {\"content\": \"<|im_middle|>\"}},"
    " \"bos_token\": \"[BOS]\", \"eos_token\": {\"content\": \"[EOS]\", \"special\": true},"
    " \"model_max_length\": 1000000000000000019884624838656}";

static duet_tokenizer_t *load_ok(void)
{
    duet_tokenizer_t *tok = NULL;
    cr_assert_eq(duet_tokenizer_load(g_dir, &tok), DUET_OK, "%s", duet_error_last());
    return tok;
}

/* duet_tokenizer_load refuses the folder with `want`, and the message names `file` and `field`. */
static void expect_refused(duet_status_t want, const char *file, const char *field)
{
    duet_tokenizer_t *tok = NULL;
    duet_status_t st = duet_tokenizer_load(g_dir, &tok);
    cr_assert_eq(st, want, "status %d, want %d: %s", st, want, duet_error_last());
    cr_assert_null(tok);
    cr_assert(strstr(duet_error_last(), file) != NULL, "\"%s\" does not name %s", duet_error_last(),
              file);
    if (field != NULL)
        cr_assert(strstr(duet_error_last(), field) != NULL, "\"%s\" does not name %s",
                  duet_error_last(), field);
}

static size_t encode(const duet_tokenizer_t *tok, const char *text, unsigned flags, uint32_t *ids,
                     size_t cap)
{
    size_t n = 0;
    cr_assert_eq(duet_tokenizer_encode(tok, text, strlen(text), flags, ids, cap, &n), DUET_OK, "%s",
                 duet_error_last());
    return n;
}

/* ---------------------------------------------------------------- duet_tokenizer.json */

Test(tokenizer_folder, byte_json, .timeout = 10)
{
    make_dir();
    put("duet_tokenizer.json",
        "{\"type\": \"byte\", \"specials\": [\"<|bos|>\", \"<|eos|>\"], \"add_bos\": true}");
    put_ranks("tiktoken.model", ""); /* duet_tokenizer.json comes first */
    duet_tokenizer_t *tok = load_ok();
    cr_assert_eq(duet_tokenizer_vocab_size(tok), 258);
    cr_assert(duet_tokenizer_add_bos(tok));
    uint32_t id;
    cr_assert_eq(duet_tokenizer_special_id(tok, "<|eos|>", &id), DUET_OK);
    cr_assert_eq(id, 257);
    cr_assert(duet_tokenizer_is_skipped(tok, 257));
    cr_assert_eq(duet_tokenizer_bos_id(tok, &id), DUET_ERR_NOT_FOUND);
    duet_tokenizer_destroy(tok);

    put("duet_tokenizer.json", "{\"type\": \"byte\"}");
    tok = load_ok();
    cr_assert_eq(duet_tokenizer_vocab_size(tok), 256);
    cr_assert(!duet_tokenizer_add_bos(tok));
    duet_tokenizer_destroy(tok);

    static const struct {
        const char *json;
        duet_status_t st;
        const char *field;
    } bad[] = {
        {"{\"type\": \"byte\"", DUET_ERR_FORMAT, NULL},
        {"[1]", DUET_ERR_FORMAT, "object"},
        {"{\"type\": \"byte\", \"type\": \"byte\"}", DUET_ERR_FORMAT, "duplicate"},
        {"{\"specials\": []}", DUET_ERR_NOT_FOUND, "type"},
        {"{\"type\": 1}", DUET_ERR_FORMAT, "type"},
        {"{\"type\": \"bpe\"}", DUET_ERR_UNSUPPORTED, "type"},
        {"{\"type\": \"byte\", \"add_bos\": 1}", DUET_ERR_FORMAT, "add_bos"},
        {"{\"type\": \"byte\", \"specials\": \"<|bos|>\"}", DUET_ERR_FORMAT, "specials"},
        {"{\"type\": \"byte\", \"specials\": [\"<|bos|>\", 7]}", DUET_ERR_FORMAT, "specials[1]"},
        {"{\"type\": \"byte\", \"specials\": [\"\"]}", DUET_ERR_FORMAT, "specials[0]"},
        {"{\"type\": \"byte\", \"specials\": [\"a\\u0000b\"]}", DUET_ERR_FORMAT, "u0000"},
        {"{\"type\": \"byte\", \"specials\": [\"<x>\", \"<x>\"]}", DUET_ERR_INVALID, "twice"},
        {"{\"type\": \"byte\", \"add_eos\": true}", DUET_ERR_FORMAT, "add_eos"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        put("duet_tokenizer.json", bad[i].json);
        expect_refused(bad[i].st, "duet_tokenizer.json", bad[i].field);
    }
    remove_dir();
}

/* ---------------------------------------------------------------- Kimi's layout */

Test(tokenizer_folder, kimi_specials_named_and_recognised_only_when_allowed, .timeout = 10)
{
    make_dir();
    put_ranks("tiktoken.model", "");
    put("tokenizer_config.json", kimi_config);
    put("special_tokens_map.json", "{\"bos_token\": {\"content\": \"[BOS]\"}, "
                                   "\"eos_token\": \"<|im_end|>\", \"pad_token\": null}");
    duet_tokenizer_t *tok = load_ok();
    cr_assert_eq(duet_tokenizer_vocab_size(tok), LAST + 1);

    /* every id of the special range, named as tokenization_kimi.py names it */
    for (uint32_t id = FIRST; id <= LAST; id++) {
        const uint8_t *p;
        size_t len;
        cr_assert_eq(duet_tokenizer_token_bytes(tok, id, &p, &len), DUET_OK);
        char want[64];
        const char *named[] = {"[BOS]", "[EOS]", "<|im_end|>", "<|tool_call_begin|>"};
        if (id - FIRST < 4)
            snprintf(want, sizeof(want), "%s", named[id - FIRST]);
        else if (id == 264)
            snprintf(want, sizeof(want), "<|im_middle|>");
        else
            snprintf(want, sizeof(want), "<|reserved_token_%u|>", id);
        cr_assert(len == strlen(want) && memcmp(p, want, len) == 0, "id %u: \"%.*s\", want %s", id,
                  (int)len, (const char *)p, want);
        cr_assert(duet_tokenizer_is_special(tok, id), "id %u", id);
    }
    cr_assert(!duet_tokenizer_is_special(tok, 257));
    cr_assert_eq(duet_tokenizer_token_bytes(tok, LAST + 1, &(const uint8_t *){NULL}, &(size_t){0}),
                 DUET_ERR_RANGE);

    /* skipped: "special": true or absent; shown: "special": false and the unnamed reserved ids */
    cr_assert(duet_tokenizer_is_skipped(tok, 258));
    cr_assert(duet_tokenizer_is_skipped(tok, 260));
    cr_assert(duet_tokenizer_is_skipped(tok, 264));
    cr_assert(!duet_tokenizer_is_skipped(tok, 261));
    cr_assert(!duet_tokenizer_is_skipped(tok, 300));
    cr_assert(!duet_tokenizer_is_skipped(tok, 'a'));

    /* bos from special_tokens_map.json ({"content"}), eos too: the map wins over the config */
    uint32_t id;
    cr_assert_eq(duet_tokenizer_bos_id(tok, &id), DUET_OK);
    cr_assert_eq(id, 258);
    cr_assert_eq(duet_tokenizer_eos_id(tok, &id), DUET_OK);
    cr_assert_eq(id, 260);
    cr_assert(!duet_tokenizer_add_bos(tok));

    /* special text is recognised only when allowed; otherwise it is ordinary bytes */
    const char *text = "ab<|im_end|>cd<|reserved_token_300|>";
    uint32_t ids[64];
    size_t n = encode(tok, text, DUET_TOKENIZER_ALLOW_SPECIAL, ids, 64);
    const uint32_t want_allowed[] = {256, 260, 257, 300};
    cr_assert_eq(n, 4);
    cr_assert_arr_eq(ids, want_allowed, sizeof(want_allowed));
    n = encode(tok, text, 0, ids, 64);
    cr_assert_gt(n, 4);
    for (size_t i = 0; i < n; i++)
        cr_assert(!duet_tokenizer_is_special(tok, ids[i]), "id %u at %zu", ids[i], i);
    char out[128];
    size_t out_len = 0;
    cr_assert_eq(duet_tokenizer_decode(tok, ids, n, out, sizeof(out), &out_len), DUET_OK);
    cr_assert(out_len == strlen(text) && memcmp(out, text, out_len) == 0);
    duet_tokenizer_destroy(tok);

    /* without special_tokens_map.json the config's {"content"} eos counts; tokenizer.model is
     * read when tiktoken.model is absent */
    drop("special_tokens_map.json");
    drop("tiktoken.model");
    put_ranks("tokenizer.model", "");
    tok = load_ok();
    cr_assert_eq(duet_tokenizer_eos_id(tok, &id), DUET_OK);
    cr_assert_eq(id, 259);
    duet_tokenizer_destroy(tok);

    /* no tokenizer_config.json: all 258 ids reserved, no bos / eos */
    drop("tokenizer_config.json");
    tok = load_ok();
    cr_assert_eq(duet_tokenizer_special_id(tok, "<|reserved_token_258|>", &id), DUET_OK);
    cr_assert_eq(id, 258);
    cr_assert_eq(duet_tokenizer_eos_id(tok, &id), DUET_ERR_NOT_FOUND);
    duet_tokenizer_destroy(tok);
    remove_dir();
}

Test(tokenizer_folder, kimi_bad_files_name_the_file_and_field, .timeout = 30)
{
    static const struct {
        const char *config; /* tokenizer_config.json */
        duet_status_t st;
        const char *field;
    } bad[] = {
        {"{\"added_tokens_decoder\": {", DUET_ERR_FORMAT, NULL},
        {"[]", DUET_ERR_FORMAT, "object"},
        {"{\"added_tokens_decoder\": []}", DUET_ERR_FORMAT, "added_tokens_decoder"},
        {"{\"added_tokens_decoder\": {\"x258\": {\"content\": \"<a>\"}}}", DUET_ERR_FORMAT, "x258"},
        {"{\"added_tokens_decoder\": {\"-1\": {\"content\": \"<a>\"}}}", DUET_ERR_FORMAT, "-1"},
        {"{\"added_tokens_decoder\": {\"0258\": {\"content\": \"<a>\"}}}", DUET_ERR_FORMAT, "0258"},
        {"{\"added_tokens_decoder\": {\"99999999999\": {\"content\": \"<a>\"}}}", DUET_ERR_FORMAT,
         "99999999999"},
        {"{\"added_tokens_decoder\": {\"258\": \"<a>\"}}", DUET_ERR_FORMAT, "258"},
        {"{\"added_tokens_decoder\": {\"258\": {\"special\": true}}}", DUET_ERR_FORMAT,
         "258.content"},
        {"{\"added_tokens_decoder\": {\"258\": {\"content\": 5}}}", DUET_ERR_FORMAT, "258.content"},
        {"{\"added_tokens_decoder\": {\"258\": {\"content\": \"\"}}}", DUET_ERR_FORMAT,
         "258.content"},
        {"{\"added_tokens_decoder\": {\"258\": {\"content\": \"<\\u0000>\"}}}", DUET_ERR_FORMAT,
         "u0000"},
        {"{\"added_tokens_decoder\": {\"258\": {\"content\": \"<a>\", \"special\": \"yes\"}}}",
         DUET_ERR_FORMAT, "258.special"},
        {"{\"added_tokens_decoder\": {\"257\": {\"content\": \"<a>\"}}}", DUET_ERR_INVALID,
         "a rank"},
        {"{\"added_tokens_decoder\": {\"516\": {\"content\": \"<a>\"}}}", DUET_ERR_INVALID,
         "outside"},
        {"{\"added_tokens_decoder\": {\"258\": {\"content\": \"<a>\"}, \"259\": {\"content\": "
         "\"<a>\"}}}",
         DUET_ERR_INVALID, "twice"},
        {"{\"added_tokens_decoder\": {\"258\": {\"content\": \"<|reserved_token_259|>\"}}}",
         DUET_ERR_INVALID, "twice"},
        {"{\"added_tokens_decoder\": {}, \"bos_token\": 5}", DUET_ERR_FORMAT, "bos_token"},
        {"{\"added_tokens_decoder\": {}, \"eos_token\": {\"text\": \"[EOS]\"}}", DUET_ERR_FORMAT,
         "eos_token.content"},
        {"{\"added_tokens_decoder\": {}, \"eos_token\": \"[EOS]\"}", DUET_ERR_FORMAT, "eos_token"},
    };
    make_dir();
    put_ranks("tiktoken.model", "");
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        put("tokenizer_config.json", bad[i].config);
        expect_refused(bad[i].st, "tokenizer_config.json", bad[i].field);
    }
    /* a text over 1024 bytes */
    char *big = malloc(4096);
    char *p = big + sprintf(big, "{\"added_tokens_decoder\": {\"258\": {\"content\": \"");
    memset(p, 'x', 1100);
    strcpy(p + 1100, "\"}}}");
    put("tokenizer_config.json", big);
    free(big);
    expect_refused(DUET_ERR_FORMAT, "tokenizer_config.json", "258.content");

    /* special_tokens_map.json: malformed, wrong type, a text that is no special token */
    put("tokenizer_config.json", kimi_config);
    put("special_tokens_map.json", "{\"bos_token\": ");
    expect_refused(DUET_ERR_FORMAT, "special_tokens_map.json", NULL);
    put("special_tokens_map.json", "{\"bos_token\": [\"[BOS]\"]}");
    expect_refused(DUET_ERR_FORMAT, "special_tokens_map.json", "bos_token");
    put("special_tokens_map.json", "{\"eos_token\": {\"content\": \"</s>\"}}");
    expect_refused(DUET_ERR_FORMAT, "special_tokens_map.json", "</s>");
    drop("special_tokens_map.json");

    /* a file over 16 MiB is refused before it is read */
    char path[512];
    snprintf(path, sizeof(path), "%s/tokenizer_config.json", g_dir);
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    cr_assert_eq(ftruncate(fileno(f), (17 << 20)), 0);
    fclose(f);
    expect_refused(DUET_ERR_RANGE, "tokenizer_config.json", NULL);
    put("tokenizer_config.json", kimi_config);

    /* ranks with a gap: Kimi numbers its specials from the rank count */
    put_ranks("tiktoken.model", "ZWY= 259\n");
    expect_refused(DUET_ERR_FORMAT, "tiktoken.model", "0..N-1");
    /* a malformed rank file is named with its line */
    put_ranks("tiktoken.model", "!!!! 258\n");
    expect_refused(DUET_ERR_FORMAT, "tiktoken.model:259", "base64");
    remove_dir();
}

/* A generated special id that is no stop id: the detokenizer never errors, and skip_special_tokens
 * decides whether its text is part of the output. */
Test(tokenizer_folder, detok_generated_specials, .timeout = 10)
{
    make_dir();
    put_ranks("tiktoken.model", "");
    put("tokenizer_config.json", kimi_config);
    duet_tokenizer_t *tok = load_ok();
    const uint32_t gen[] = {256, 260, 261, 300, LAST, 'x', 258, 257};
    const char *want_skip = "ab<|tool_call_begin|><|reserved_token_300|><|reserved_token_515|>xcd";
    const char *want_all = "ab<|im_end|><|tool_call_begin|><|reserved_token_300|>"
                           "<|reserved_token_515|>x[BOS]cd";
    for (int skip = 0; skip <= 1; skip++) {
        duet_detok_t *d = NULL;
        cr_assert_eq(duet_detok_create(tok, skip ? DUET_DETOK_SKIP_SPECIAL : 0, &d), DUET_OK);
        char out[256];
        size_t n_out = 0;
        for (size_t i = 0; i < sizeof(gen) / sizeof(gen[0]); i++) {
            const char *t;
            size_t len;
            cr_assert_eq(duet_detok_feed(d, gen[i], &t, &len), DUET_OK, "id %u: %s", gen[i],
                         duet_error_last());
            memcpy(out + n_out, t, len);
            n_out += len;
        }
        out[n_out] = '\0';
        cr_assert_str_eq(out, skip ? want_skip : want_all);
        duet_detok_destroy(d);
    }
    duet_tokenizer_destroy(tok);
    remove_dir();
}

/* ---------------------------------------------------------------- stop ids */

static size_t stops(const duet_tokenizer_t *tok, uint32_t *ids, size_t cap)
{
    size_t n = 0;
    cr_assert_eq(duet_tokenizer_stop_ids(g_dir, tok, ids, cap, &n), DUET_OK, "%s",
                 duet_error_last());
    return n;
}

static void expect_stop_refused(const duet_tokenizer_t *tok, size_t cap, duet_status_t want,
                                const char *file, const char *field)
{
    uint32_t ids[8];
    size_t n = 99;
    duet_status_t st = duet_tokenizer_stop_ids(g_dir, tok, ids, cap, &n);
    cr_assert_eq(st, want, "status %d, want %d: %s", st, want, duet_error_last());
    cr_assert_eq(n, 99);
    cr_assert(strstr(duet_error_last(), file) != NULL, "\"%s\" lacks %s", duet_error_last(), file);
    cr_assert(strstr(duet_error_last(), field) != NULL, "\"%s\" lacks %s", duet_error_last(),
              field);
}

Test(tokenizer_folder, stop_ids_union, .timeout = 10)
{
    make_dir();
    uint32_t ids[8];
    cr_assert_eq(stops(NULL, ids, 8), 0); /* no files: no stop ids */

    put("config.json", "{\"eos_token_id\": 260, \"vocab_size\": 516}");
    cr_assert_eq(stops(NULL, ids, 8), 1);
    cr_assert_eq(ids[0], 260);

    /* generation_config.json's list joins, repeats dropped, config.json's first */
    put("generation_config.json", "{\"eos_token_id\": [259, 260, 7]}");
    const uint32_t want3[] = {260, 259, 7};
    cr_assert_eq(stops(NULL, ids, 8), 3);
    cr_assert_arr_eq(ids, want3, sizeof(want3));

    /* the tokenizer's eos token joins last */
    put_ranks("tiktoken.model", "");
    put("tokenizer_config.json", "{\"added_tokens_decoder\": {\"262\": {\"content\": \"[EOS]\"}},"
                                 " \"eos_token\": \"[EOS]\"}");
    duet_tokenizer_t *tok = load_ok();
    const uint32_t want4[] = {260, 259, 7, 262};
    cr_assert_eq(stops(tok, ids, 8), 4);
    cr_assert_arr_eq(ids, want4, sizeof(want4));

    /* null and absent fields add nothing */
    put("config.json", "{\"eos_token_id\": null}");
    put("generation_config.json", "{\"bos_token_id\": 1}");
    cr_assert_eq(stops(NULL, ids, 8), 0);
    /* an integer in generation_config.json, a list in config.json */
    put("config.json", "{\"eos_token_id\": [5, 6]}");
    put("generation_config.json", "{\"eos_token_id\": 6}");
    const uint32_t want2[] = {5, 6};
    cr_assert_eq(stops(NULL, ids, 8), 2);
    cr_assert_arr_eq(ids, want2, sizeof(want2));

    /* bad values name the file and the field */
    put("config.json", "{\"eos_token_id\": \"2\"}");
    expect_stop_refused(NULL, 8, DUET_ERR_FORMAT, "config.json", "eos_token_id");
    put("config.json", "{\"eos_token_id\": 2.0}");
    expect_stop_refused(NULL, 8, DUET_ERR_FORMAT, "config.json", "eos_token_id");
    put("config.json", "{\"eos_token_id\": true}");
    expect_stop_refused(NULL, 8, DUET_ERR_FORMAT, "config.json", "eos_token_id");
    put("config.json", "{\"eos_token_id\": -1}");
    expect_stop_refused(NULL, 8, DUET_ERR_RANGE, "config.json", "eos_token_id");
    put("config.json", "{\"eos_token_id\": 5}");
    put("generation_config.json", "{\"eos_token_id\": [1, \"x\"]}");
    expect_stop_refused(NULL, 8, DUET_ERR_FORMAT, "generation_config.json", "eos_token_id[1]");
    put("generation_config.json", "{\"eos_token_id\": [1, 516]}"); /* outside the vocabulary */
    expect_stop_refused(tok, 8, DUET_ERR_RANGE, "generation_config.json", "eos_token_id[1]");
    put("generation_config.json", "{\"eos_token_id\": [1, 16777216]}");
    expect_stop_refused(NULL, 8, DUET_ERR_RANGE, "generation_config.json", "eos_token_id[1]");
    put("generation_config.json", "{\"eos_token_id\": [1, 2, 3]}"); /* 4 ids, room for 3 */
    expect_stop_refused(NULL, 3, DUET_ERR_RANGE, "generation_config.json", "more than 3");
    put("generation_config.json", "{\"eos_token_id\": [1, 2");
    expect_stop_refused(NULL, 8, DUET_ERR_FORMAT, "generation_config.json", ":1:");
    put("generation_config.json", "[1]");
    expect_stop_refused(NULL, 8, DUET_ERR_FORMAT, "generation_config.json", "object");
    duet_tokenizer_destroy(tok);
    remove_dir();
}

/* ---------------------------------------------------------------- Kimi's encode, ill-formed UTF-8
 */

/*
 * Kimi's run splitting counts characters; here each byte of ill-formed UTF-8 counts as one
 * non-whitespace character (Python never sees such text, so this rule is duet's). With "aa" as
 * a token, where the 25000-character cut falls is visible in the ids. And any bytes still
 * round-trip.
 */
Test(tokenizer_folder, kimi_split_counts_ill_formed_bytes, .timeout = 60)
{
    make_dir();
    put_ranks("tiktoken.model", "YWE= 258\n"); /* "aa" */
    duet_tokenizer_t *tok = load_ok();
    enum { RUN = 25000 };
    char *text = malloc(3 * RUN);
    uint32_t *ids = malloc(3 * RUN * sizeof(*ids));

    /* "\xff" + 25000 "a": 25001 non-whitespace characters, cut before the last "a" */
    text[0] = '\xff';
    memset(text + 1, 'a', RUN);
    size_t n = 0;
    cr_assert_eq(duet_tokenizer_encode(tok, text, RUN + 1, 0, ids, 3 * RUN, &n), DUET_OK);
    cr_assert_eq(n, 1 + (RUN - 1) / 2 + 1 + 1, "%zu ids", n);
    cr_assert_eq(ids[0], 0xff);
    cr_assert_eq(ids[1], 258);
    cr_assert_eq(ids[n - 2], 'a');
    cr_assert_eq(ids[n - 1], 'a');
    /* a space instead: 25000 letters, no cut, all pairs */
    text[0] = ' ';
    cr_assert_eq(duet_tokenizer_encode(tok, text, RUN + 1, 0, ids, 3 * RUN, &n), DUET_OK);
    cr_assert_eq(n, 1 + RUN / 2);

    /* random bytes, valid UTF-8 or not, long runs included: decode(encode(x)) == x */
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    char *back = malloc(3 * RUN);
    for (int round = 0; round < 200; round++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        size_t len = round < 4 ? (size_t)(RUN + 7 * round) : (size_t)(rng >> 33) % 300;
        for (size_t i = 0; i < len; i++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            static const char pick[] = {' ', 'a', '\n', '\xff', '\xc3', '\xa9', '\xe4', '<', '|'};
            text[i] = round < 4         ? pick[round]
                      : (rng >> 60) < 8 ? pick[(rng >> 40) % 9]
                                        : (char)(rng >> 24);
        }
        for (unsigned flags = 0; flags <= DUET_TOKENIZER_ALLOW_SPECIAL; flags++) {
            cr_assert_eq(duet_tokenizer_encode(tok, text, len, flags, ids, 3 * RUN, &n), DUET_OK,
                         "round %d: %s", round, duet_error_last());
            size_t back_len = 0;
            cr_assert_eq(duet_tokenizer_decode(tok, ids, n, back, 3 * RUN, &back_len), DUET_OK);
            cr_assert(back_len == len && memcmp(back, text, len) == 0, "round %d", round);
        }
    }
    free(back);
    free(ids);
    free(text);
    duet_tokenizer_destroy(tok);
    remove_dir();
}
