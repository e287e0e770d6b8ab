/*
 * Byte tokenizer and streaming detokenizer tests: byte round trips on random data, special
 * tokens (recognised only when allowed, longest match first), and the detokenizer's promise that
 * a stream of ids becomes valid UTF-8 equal to the whole decode, however characters are split.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tokenizer.h"

static const char *const specials[] = {"<|bos|>", "<|eos|>", "<|eos|>x", "<|pad|>"};

static duet_tokenizer_t *byte_tok(void)
{
    duet_tokenizer_t *tok = NULL;
    cr_assert_eq(duet_tokenizer_create_byte(specials, 4, &tok), DUET_OK, "%s", duet_error_last());
    return tok;
}

Test(tokenizer_byte, round_trip_random, .timeout = 30)
{
    duet_tokenizer_t *tok = byte_tok();
    cr_assert_eq(duet_tokenizer_vocab_size(tok), 260);
    uint64_t s = 12345;
    char text[4096], out[4096];
    uint32_t ids[4096];
    bool ok = true;
    for (int iter = 0; iter < 500 && ok; iter++) {
        size_t len = (size_t)(iter * 7919) % sizeof(text);
        for (size_t i = 0; i < len; i++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            text[i] = (char)(s >> 56);
        }
        size_t n = 0, out_len = 0;
        ok = duet_tokenizer_encode(tok, text, len, 0, ids, 4096, &n) == DUET_OK && n == len;
        for (size_t i = 0; ok && i < n; i++)
            ok = ids[i] == (uint8_t)text[i];
        ok = ok && duet_tokenizer_decode(tok, ids, n, out, sizeof(out), &out_len) == DUET_OK &&
             out_len == len && memcmp(out, text, len) == 0;
    }
    cr_assert(ok, "byte round trip failed");
    duet_tokenizer_destroy(tok);
}

Test(tokenizer_byte, specials, .timeout = 30)
{
    duet_tokenizer_t *tok = byte_tok();
    uint32_t id = 0;
    cr_assert_eq(duet_tokenizer_special_id(tok, "<|bos|>", &id), DUET_OK);
    cr_assert_eq(id, 256);
    cr_assert_eq(duet_tokenizer_special_id(tok, "<|pad|>", &id), DUET_OK);
    cr_assert_eq(id, 259);
    cr_assert(duet_tokenizer_is_special(tok, 257));
    cr_assert(!duet_tokenizer_is_special(tok, 255));

    const char *text = "<|bos|>hi<|eos|>x<|eos";
    uint32_t ids[64];
    size_t n = 0;
    cr_assert_eq(
        duet_tokenizer_encode(tok, text, strlen(text), DUET_TOKENIZER_ALLOW_SPECIAL, ids, 64, &n),
        DUET_OK);
    /* <|bos|> h i <|eos|>x (the longer special wins) < | e o s */
    uint32_t want[] = {256, 'h', 'i', 258, '<', '|', 'e', 'o', 's'};
    cr_assert_eq(n, sizeof(want) / sizeof(want[0]));
    cr_assert(memcmp(ids, want, sizeof(want)) == 0);
    cr_assert_eq(duet_tokenizer_encode(tok, text, strlen(text), 0, ids, 64, &n), DUET_OK);
    cr_assert_eq(n, strlen(text), "without ALLOW_SPECIAL every byte is a token");

    char out[64];
    size_t len = 0;
    uint32_t seq[] = {256, 'o', 'k', 257};
    cr_assert_eq(duet_tokenizer_decode(tok, seq, 4, out, sizeof(out), &len), DUET_OK);
    cr_assert(len == 16 && memcmp(out, "<|bos|>ok<|eos|>", 16) == 0);
    uint32_t bad[] = {'a', 260};
    cr_assert_eq(duet_tokenizer_decode(tok, bad, 2, out, sizeof(out), &len), DUET_ERR_RANGE);
    cr_assert_not_null(strstr(duet_error_last(), "260"), "%s", duet_error_last());

    duet_tokenizer_t *t2 = NULL;
    const char *dup[] = {"<a>", "<a>"};
    cr_assert_eq(duet_tokenizer_create_byte(dup, 2, &t2), DUET_ERR_INVALID);
    const char *empty[] = {""};
    cr_assert_eq(duet_tokenizer_create_byte(empty, 1, &t2), DUET_ERR_INVALID);
    cr_assert_null(t2);
    cr_assert_eq(duet_tokenizer_create_byte(NULL, 0, &t2), DUET_OK);
    cr_assert_eq(duet_tokenizer_vocab_size(t2), 256);
    cr_assert_eq(duet_tokenizer_special_id(t2, "<|bos|>", &id), DUET_ERR_NOT_FOUND);
    duet_tokenizer_destroy(t2);
    duet_tokenizer_destroy(tok);
}

/* Feed ids one by one; return everything emitted (feeds + flush). */
static size_t stream(duet_detok_t *d, const uint32_t *ids, size_t n, char *out)
{
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        const char *p;
        size_t len;
        if (duet_detok_feed(d, ids[i], &p, &len) != DUET_OK)
            cr_assert_fail("feed %u: %s", ids[i], duet_error_last());
        memcpy(out + total, p, len);
        total += len;
    }
    const char *p;
    size_t len;
    cr_assert_eq(duet_detok_flush(d, &p, &len), DUET_OK);
    memcpy(out + total, p, len);
    return total + len;
}

Test(tokenizer_byte, detok_multibyte_split, .timeout = 30)
{
    duet_tokenizer_t *tok = byte_tok();
    duet_detok_t *d = NULL;
    cr_assert_eq(duet_detok_create(tok, 0, &d), DUET_OK);
    /* "é世🌍" one byte per id: nothing comes out until a character is complete. */
    const char *text = "a\xc3\xa9\xe4\xb8\x96\xf0\x9f\x8c\x8d";
    size_t expect_len[] = {1, 0, 2, 0, 0, 3, 0, 0, 0, 4};
    for (size_t i = 0; i < strlen(text); i++) {
        const char *p;
        size_t len;
        cr_assert_eq(duet_detok_feed(d, (uint8_t)text[i], &p, &len), DUET_OK);
        cr_assert_eq(len, expect_len[i], "byte %zu: emitted %zu", i, len);
    }
    const char *p;
    size_t len;
    cr_assert_eq(duet_detok_flush(d, &p, &len), DUET_OK);
    cr_assert_eq(len, 0);

    /* An unfinished character at the end becomes one U+FFFD at flush. */
    cr_assert_eq(duet_detok_feed(d, 0xe4, &p, &len), DUET_OK);
    cr_assert_eq(duet_detok_feed(d, 0xb8, &p, &len), DUET_OK);
    cr_assert_eq(len, 0);
    cr_assert_eq(duet_detok_flush(d, &p, &len), DUET_OK);
    cr_assert(len == 3 && memcmp(p, "\xef\xbf\xbd", 3) == 0);

    /* Ill-formed: stray continuation, overlong C0 80, surrogate ED A0 80, truncated then ASCII. */
    uint32_t bad[] = {0x80, 0xc0, 0x80, 0xed, 0xa0, 0x80, 0xe4, 'x', 0xf4, 0x90};
    char out[256];
    size_t n = stream(d, bad, sizeof(bad) / sizeof(bad[0]), out);
    /* 80→FFFD; C0→FFFD; 80→FFFD; ED→FFFD(A0 invalid after ED); A0→FFFD; 80→FFFD;
     * E4 x→FFFD x; F4→FFFD (90 invalid after F4); 90→FFFD */
    const char *want = "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"
                       "\xef\xbf\xbdx\xef\xbf\xbd\xef\xbf\xbd";
    cr_assert_eq(n, strlen(want), "got %zu bytes", n);
    cr_assert(memcmp(out, want, n) == 0);

    /* Skipping specials, and unknown ids. */
    duet_detok_t *ds = NULL;
    cr_assert_eq(duet_detok_create(tok, DUET_DETOK_SKIP_SPECIAL, &ds), DUET_OK);
    uint32_t ids[] = {256, 'h', 'i', 257};
    n = stream(ds, ids, 4, out);
    cr_assert(n == 2 && memcmp(out, "hi", 2) == 0);
    n = stream(d, ids, 4, out);
    cr_assert(n == 16 && memcmp(out, "<|bos|>hi<|eos|>", 16) == 0);
    cr_assert_eq(duet_detok_feed(d, 9999, &p, &len), DUET_ERR_RANGE);
    duet_detok_destroy(ds);
    duet_detok_destroy(d);
    duet_detok_destroy(NULL);
    duet_tokenizer_destroy(tok);
}

Test(tokenizer_byte, detok_bpe_stream_equals_decode, .timeout = 60)
{
    duet_tokenizer_t *tok = NULL;
    cr_assert_eq(duet_tokenizer_create_tiktoken(
                     DUET_SOURCE_DIR "/data/tokenizers/cl100k_base.tiktoken", NULL, NULL, 0, &tok),
                 DUET_OK);
    /* cl100k splits these emoji and CJK characters across tokens (see TestPlans: 11410 229 ...) */
    const char *text = "Hola 🇪🇸 こんにちは、世界！ 안녕하세요 🌍🎉 done";
    uint32_t ids[256];
    size_t n = 0;
    cr_assert_eq(duet_tokenizer_encode(tok, text, strlen(text), 0, ids, 256, &n), DUET_OK);
    duet_detok_t *d = NULL;
    cr_assert_eq(duet_detok_create(tok, 0, &d), DUET_OK);
    char out[1024];
    size_t split = 0, total = 0;
    for (size_t i = 0; i < n; i++) {
        const char *p;
        size_t len;
        const uint8_t *tb;
        size_t tl;
        cr_assert_eq(duet_detok_feed(d, ids[i], &p, &len), DUET_OK);
        duet_tokenizer_token_bytes(tok, ids[i], &tb, &tl);
        if (len != tl)
            split++; /* this token ended or began mid-character */
        memcpy(out + total, p, len);
        total += len;
    }
    const char *p;
    size_t len;
    cr_assert_eq(duet_detok_flush(d, &p, &len), DUET_OK);
    cr_assert_eq(len, 0);
    cr_assert_gt(split, 0, "the text should split characters across tokens");
    cr_assert_eq(total, strlen(text));
    cr_assert(memcmp(out, text, total) == 0);
    duet_detok_destroy(d);
    duet_tokenizer_destroy(tok);
}
