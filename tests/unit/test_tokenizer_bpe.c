/*
 * Tiktoken BPE tests: every cl100k_base and o200k_base case of tiktoken's TestPlans.txt must
 * encode to exactly tiktoken's ids and decode back; special tokens only when allowed; output
 * sizing; pathological pieces; and a deterministic fuzz run (random bytes, valid and not).
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tokenizer.h"

#define TOK_DIR DUET_SOURCE_DIR "/data/tokenizers/"

static duet_tokenizer_t *load(const char *name)
{
    char path[1024];
    snprintf(path, sizeof(path), TOK_DIR "%s.tiktoken", name);
    duet_tokenizer_t *tok = NULL;
    duet_status_t st = duet_tokenizer_create_tiktoken(path, NULL, NULL, 0, &tok);
    cr_assert_eq(st, DUET_OK, "load %s: %s", path, duet_error_last());
    return tok;
}

static char *slurp(const char *path, size_t *len_p)
{
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    cr_assert_eq(fread(buf, 1, (size_t)n, f), (size_t)n);
    buf[n] = '\0';
    fclose(f);
    *len_p = (size_t)n;
    return buf;
}

/* Encode text, check it equals want[0..n_want), decode and check the round trip. */
static void check_case(duet_tokenizer_t *tok, const char *enc, size_t idx, const char *text,
                       size_t len, const uint32_t *want, size_t n_want)
{
    uint32_t ids[4096];
    size_t n = 0;
    duet_status_t st = duet_tokenizer_encode(tok, text, len, 0, ids, 4096, &n);
    if (st != DUET_OK)
        cr_assert_fail("%s case %zu: %s", enc, idx, duet_error_last());
    bool same = n == n_want && memcmp(ids, want, n * sizeof(*ids)) == 0;
    if (!same) {
        fprintf(stderr, "%s case %zu \"%.*s\": got", enc, idx, (int)len, text);
        for (size_t i = 0; i < n; i++)
            fprintf(stderr, " %u", ids[i]);
        fprintf(stderr, "\n  want");
        for (size_t i = 0; i < n_want; i++)
            fprintf(stderr, " %u", want[i]);
        fprintf(stderr, "\n");
    }
    if (!same)
        cr_assert_fail("%s case %zu: ids differ from tiktoken's", enc, idx);
    char out[16384];
    size_t out_len = 0;
    st = duet_tokenizer_decode(tok, ids, n, out, sizeof(out), &out_len);
    if (st != DUET_OK)
        cr_assert_fail("%s case %zu decode: %s", enc, idx, duet_error_last());
    if (out_len != len || memcmp(out, text, len) != 0)
        cr_assert_fail("%s case %zu: round trip differs", enc, idx);
}

Test(tokenizer_bpe, testplans, .timeout = 120)
{
    duet_tokenizer_t *cl = load("cl100k_base");
    duet_tokenizer_t *o2 = load("o200k_base");
    size_t len = 0;
    char *data = slurp(TOK_DIR "TestPlans.txt", &len);
    size_t n_blocks_ours = 0, n_checked = 0, n_skipped = 0;
    size_t n_cl = 0, n_o2 = 0;
    char *enc = NULL, *sample = NULL;
    size_t sample_len = 0;
    char *line = data;
    while (line < data + len) {
        char *nl = strchr(line, '\n');
        char *end = nl != NULL ? nl : data + len;
        *end = '\0';
        if (strncmp(line, "EncodingName: ", 14) == 0) {
            enc = line + 14;
            sample = NULL;
            if (strcmp(enc, "cl100k_base") == 0 || strcmp(enc, "o200k_base") == 0)
                n_blocks_ours++;
        } else if (strncmp(line, "Sample: ", 8) == 0 || strcmp(line, "Sample:") == 0) {
            sample = line[7] == ' ' ? line + 8 : line + 7;
            sample_len = (size_t)(end - sample);
        } else if (strncmp(line, "Encoded: [", 10) == 0) {
            if (enc == NULL || sample == NULL)
                cr_assert_fail("Encoded: without EncodingName/Sample");
            uint32_t want[4096];
            size_t n_want = 0;
            char *p = line + 10;
            while (*p != ']' && *p != '\0') {
                char *q;
                unsigned long v = strtoul(p, &q, 10);
                if (q == p || n_want == 4096) /* no cr_assert in loops: see round_trip() */
                    cr_assert_fail("bad Encoded: line \"%s\"", line);
                want[n_want++] = (uint32_t)v;
                p = q;
                while (*p == ',' || *p == ' ')
                    p++;
            }
            if (strcmp(enc, "cl100k_base") == 0) {
                check_case(cl, enc, n_cl++, sample, sample_len, want, n_want);
                n_checked++;
            } else if (strcmp(enc, "o200k_base") == 0) {
                check_case(o2, enc, n_o2++, sample, sample_len, want, n_want);
                n_checked++;
            } else {
                n_skipped++;
            }
            enc = sample = NULL;
        }
        line = end + 1;
    }
    printf("TestPlans.txt: %zu cases checked and passed (cl100k_base %zu, o200k_base %zu); "
           "%zu r50k/p50k cases skipped (no rank files shipped for them)\n",
           n_checked, n_cl, n_o2, n_skipped);
    fflush(stdout);
    cr_assert_gt(n_checked, 0);
    cr_assert_eq(n_checked, n_blocks_ours, "checked %zu of %zu cl100k/o200k blocks", n_checked,
                 n_blocks_ours);
    free(data);
    duet_tokenizer_destroy(o2);
    duet_tokenizer_destroy(cl);
}

Test(tokenizer_bpe, specials_only_when_allowed, .timeout = 60)
{
    duet_tokenizer_t *tok = load("cl100k_base");
    uint32_t eot = 0;
    cr_assert_eq(duet_tokenizer_special_id(tok, "<|endoftext|>", &eot), DUET_OK);
    cr_assert_eq(eot, 100257);
    cr_assert_eq(duet_tokenizer_special_id(tok, "<|nope|>", &eot), DUET_ERR_NOT_FOUND);
    cr_assert_eq(duet_tokenizer_vocab_size(tok), 100277);
    cr_assert(duet_tokenizer_is_special(tok, 100257));
    cr_assert(!duet_tokenizer_is_special(tok, 100256)); /* a gap, not a token */
    cr_assert(!duet_tokenizer_is_special(tok, 15339));

    const char *text = "hello<|endoftext|> world";
    uint32_t ids[64];
    size_t n = 0;
    cr_assert_eq(
        duet_tokenizer_encode(tok, text, strlen(text), DUET_TOKENIZER_ALLOW_SPECIAL, ids, 64, &n),
        DUET_OK);
    cr_assert_eq(n, 3);
    cr_assert_eq(ids[0], 15339);
    cr_assert_eq(ids[1], 100257);
    cr_assert_eq(ids[2], 1917); /* " world" */

    cr_assert_eq(duet_tokenizer_encode(tok, text, strlen(text), 0, ids, 64, &n), DUET_OK);
    cr_assert_gt(n, 3);
    for (size_t i = 0; i < n; i++)
        cr_assert_neq(ids[i], 100257, "special recognised without ALLOW_SPECIAL");
    char out[128];
    size_t out_len = 0;
    cr_assert_eq(duet_tokenizer_decode(tok, ids, n, out, sizeof(out), &out_len), DUET_OK);
    cr_assert(out_len == strlen(text) && memcmp(out, text, out_len) == 0);

    /* Decoding a special gives its text; an id in a gap or past the end is refused. */
    uint32_t sp[2] = {100257, 100276};
    cr_assert_eq(duet_tokenizer_decode(tok, sp, 2, out, sizeof(out), &out_len), DUET_OK);
    cr_assert(out_len == 28 && memcmp(out, "<|endoftext|><|endofprompt|>", 28) == 0);
    uint32_t bad[2] = {15339, 100256};
    cr_assert_eq(duet_tokenizer_decode(tok, bad, 2, out, sizeof(out), &out_len), DUET_ERR_RANGE);
    cr_assert_not_null(strstr(duet_error_last(), "100256"), "%s", duet_error_last());
    bad[1] = 5000000;
    cr_assert_eq(duet_tokenizer_decode(tok, bad, 2, out, sizeof(out), &out_len), DUET_ERR_RANGE);
    const uint8_t *p;
    size_t pl;
    cr_assert_eq(duet_tokenizer_token_bytes(tok, 15339, &p, &pl), DUET_OK);
    cr_assert(pl == 5 && memcmp(p, "hello", 5) == 0);
    cr_assert_eq(duet_tokenizer_token_bytes(tok, 100256, &p, &pl), DUET_ERR_RANGE);
    duet_tokenizer_destroy(tok);
}

Test(tokenizer_bpe, output_sizing, .timeout = 60)
{
    duet_tokenizer_t *tok = load("o200k_base");
    const char *text = "The quick brown fox jumps over the lazy dog.";
    size_t need = 0;
    cr_assert_eq(duet_tokenizer_encode(tok, text, strlen(text), 0, NULL, 0, &need),
                 DUET_ERR_NO_SPACE);
    cr_assert_gt(need, 2);
    uint32_t ids[64], ids2[64];
    size_t n = 0;
    cr_assert_eq(duet_tokenizer_encode(tok, text, strlen(text), 0, ids, 2, &n), DUET_ERR_NO_SPACE);
    cr_assert_eq(n, need);
    cr_assert_eq(duet_tokenizer_encode(tok, text, strlen(text), 0, ids2, need, &n), DUET_OK);
    cr_assert_eq(n, need);
    cr_assert(memcmp(ids, ids2, 2 * sizeof(*ids)) == 0, "a short buffer gets the prefix");
    char out[8];
    size_t out_len = 0;
    cr_assert_eq(duet_tokenizer_decode(tok, ids2, n, out, sizeof(out), &out_len),
                 DUET_ERR_NO_SPACE);
    cr_assert_eq(out_len, strlen(text));
    cr_assert(memcmp(out, text, sizeof(out)) == 0);
    cr_assert_eq(duet_tokenizer_encode(tok, "", 0, 0, NULL, 0, &n), DUET_OK);
    cr_assert_eq(n, 0);
    cr_assert_eq(duet_tokenizer_encode(tok, NULL, 5, 0, ids, 64, &n), DUET_ERR_INVALID);
    duet_tokenizer_destroy(tok);
}

/* Round trip of arbitrary bytes through encode/decode; ids must be ordinary (no specials). */
static void round_trip(duet_tokenizer_t *tok, const char *text, size_t len, uint32_t *ids,
                       size_t cap, char *out, size_t out_cap)
{
    /* Plain checks first, one assertion after: ctest runs with --full-stats, where every
     * passing cr_assert is reported, and millions of them would dominate the run. */
    size_t n = 0;
    duet_status_t st = duet_tokenizer_encode(tok, text, len, 0, ids, cap, &n);
    if (st != DUET_OK)
        cr_assert_fail("encode %zu bytes: %s", len, duet_error_last());
    bool ok = n <= len;
    for (size_t i = 0; ok && i < n; i++)
        ok = !duet_tokenizer_is_special(tok, ids[i]);
    size_t out_len = 0;
    st = duet_tokenizer_decode(tok, ids, n, out, out_cap, &out_len);
    if (st != DUET_OK)
        cr_assert_fail("decode: %s", duet_error_last());
    ok = ok && out_len == len && memcmp(out, text, len) == 0;
    if (!ok)
        cr_assert_fail("round trip of %zu bytes differs (or specials / too many ids)", len);
}

Test(tokenizer_bpe, long_pieces, .timeout = 60)
{
    duet_tokenizer_t *tok = load("cl100k_base");
    size_t len = 1 << 18;
    char *text = malloc(len);
    uint32_t *ids = malloc(len * sizeof(*ids));
    char *out = malloc(len);
    /* One letter repeated: a single 256 KiB piece; quadratic merging would take minutes. */
    memset(text, 'a', len);
    round_trip(tok, text, len, ids, len, out, len);
    /* Whitespace and digit runs, ill-formed bytes, mixed. */
    memset(text, ' ', len);
    round_trip(tok, text, len, ids, len, out, len);
    text[len - 1] = 'x';
    round_trip(tok, text, len, ids, len, out, len);
    for (size_t i = 0; i < len; i++)
        text[i] = (char)(0x80 + i % 64);
    round_trip(tok, text, len, ids, len, out, len);
    for (size_t i = 0; i < len; i++)
        text[i] = "9\n\r \xe4\xb8\x96z'"[i % 9];
    round_trip(tok, text, len, ids, len, out, len);
    free(out);
    free(ids);
    free(text);
    duet_tokenizer_destroy(tok);
}

static uint64_t rng_state = 0x243f6a8885a308d3ull;

static uint32_t rng(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 11);
}

/* Append code point c as UTF-8. */
static size_t put_utf8(char *p, uint32_t c)
{
    if (c < 0x80) {
        p[0] = (char)c;
        return 1;
    }
    if (c < 0x800) {
        p[0] = (char)(0xc0 | c >> 6);
        p[1] = (char)(0x80 | (c & 0x3f));
        return 2;
    }
    if (c < 0x10000) {
        p[0] = (char)(0xe0 | c >> 12);
        p[1] = (char)(0x80 | ((c >> 6) & 0x3f));
        p[2] = (char)(0x80 | (c & 0x3f));
        return 3;
    }
    p[0] = (char)(0xf0 | c >> 18);
    p[1] = (char)(0x80 | ((c >> 12) & 0x3f));
    p[2] = (char)(0x80 | ((c >> 6) & 0x3f));
    p[3] = (char)(0x80 | (c & 0x3f));
    return 4;
}

static uint32_t random_code_point(void)
{
    static const uint32_t picks[] = {' ',     '\n',   '\r',   '\t',   '\'',   's',  'A',  '1',
                                     '.',     '/',    0xa0,   0x3000, 0x2028, 0x85, 0xe9, 0x4e16,
                                     0x1f30d, 0x0301, 0x0410, 0x0e01, 0xac00, 0x17f};
    switch (rng() % 4) {
    case 0:
        return picks[rng() % (sizeof(picks) / sizeof(picks[0]))];
    case 1:
        return 0x20 + rng() % 0x5f;
    case 2: {
        uint32_t c = rng() % 0x10000;
        return c >= 0xd800 && c <= 0xdfff ? 'x' : c;
    }
    default: {
        uint32_t c = rng() % 0x110000;
        return c >= 0xd800 && c <= 0xdfff ? 'y' : c;
    }
    }
}

Test(tokenizer_bpe, fuzz, .timeout = 120)
{
    duet_tokenizer_t *toks[2] = {load("cl100k_base"), load("o200k_base")};
    char text[1024], out[1024];
    uint32_t ids[1024];
    size_t n_valid = 0, n_invalid = 0;
    for (int iter = 0; iter < 4000; iter++) {
        duet_tokenizer_t *tok = toks[iter % 2];
        size_t len = 0, target = rng() % 200;
        bool valid = (iter % 3) != 0;
        while (len < target) {
            if (valid)
                len += put_utf8(text + len, random_code_point());
            else if (rng() % 2 == 0)
                text[len++] = (char)(rng() & 0xff); /* raw bytes: mostly ill-formed */
            else
                len += put_utf8(text + len, random_code_point());
        }
        if (valid)
            n_valid++;
        else
            n_invalid++;
        /* valid or not, encoding is lossless (the header's promise) */
        round_trip(tok, text, len, ids, 1024, out, sizeof(out));
        /* and with specials allowed (none in random text, but the scan must not misbehave) */
        size_t n = 0;
        if (duet_tokenizer_encode(tok, text, len, DUET_TOKENIZER_ALLOW_SPECIAL, ids, 1024, &n) !=
            DUET_OK)
            cr_assert_fail("encode with specials allowed: %s", duet_error_last());
    }
    printf("fuzz: %zu valid UTF-8 and %zu mixed/ill-formed strings round-tripped\n", n_valid,
           n_invalid);
    duet_tokenizer_destroy(toks[0]);
    duet_tokenizer_destroy(toks[1]);
}

Test(tokenizer_bpe, load_by_path, .timeout = 60)
{
    duet_tokenizer_t *tok = NULL;
    cr_assert_eq(duet_tokenizer_load(TOK_DIR "o200k_base.tiktoken", &tok), DUET_OK, "%s",
                 duet_error_last());
    cr_assert_eq(duet_tokenizer_vocab_size(tok), 200019);
    uint32_t id = 0;
    cr_assert_eq(duet_tokenizer_special_id(tok, "<|endofprompt|>", &id), DUET_OK);
    cr_assert_eq(id, 200018);
    duet_tokenizer_destroy(tok);
    /* the shared folder holds two *.tiktoken files: ambiguous */
    tok = NULL;
    cr_assert_eq(duet_tokenizer_load(TOK_DIR, &tok), DUET_ERR_NOT_FOUND);
    cr_assert_null(tok);
    cr_assert_eq(duet_tokenizer_load("/nonexistent/x.tiktoken", &tok), DUET_ERR_IO);
    cr_assert_not_null(duet_tokenizer_pattern("cl100k_base"));
    cr_assert_not_null(duet_tokenizer_pattern("kimi"));
    cr_assert_null(duet_tokenizer_pattern("nope"));
    duet_tokenizer_destroy(NULL);
}
