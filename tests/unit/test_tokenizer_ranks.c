/*
 * Rank-file tests: malformed tiktoken files are refused with errors naming file and line, and a
 * tiny hand-made vocabulary checks the merge rules themselves (lowest rank first, leftmost on
 * ties, a whole piece that is a token wins outright, as in tiktoken).
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tokenizer/tokenizer.h"

static char dir[] = "/tmp/duet_tok_ranks_XXXXXX";

static void setup(void)
{
    cr_assert_not_null(mkdtemp(dir));
}

static void teardown(void)
{
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    cr_assert_eq(system(cmd), 0);
}

static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

static void put_b64(FILE *f, const uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i += 3) {
        uint32_t w = (uint32_t)p[i] << 16;
        if (i + 1 < n)
            w |= (uint32_t)p[i + 1] << 8;
        if (i + 2 < n)
            w |= p[i + 2];
        fputc(b64[w >> 18 & 63], f);
        fputc(b64[w >> 12 & 63], f);
        fputc(i + 1 < n ? b64[w >> 6 & 63] : '=', f);
        fputc(i + 2 < n ? b64[w & 63] : '=', f);
    }
}

/* Write name: all 256 single bytes (ranks 0..255, byte `skip` left out when < 256), then extra. */
static const char *write_ranks(const char *name, int skip, const char *extra)
{
    static char path[256];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    for (int b = 0; b < 256; b++) {
        if (b == skip)
            continue;
        uint8_t byte = (uint8_t)b;
        put_b64(f, &byte, 1);
        fprintf(f, " %d\n", b);
    }
    fputs(extra, f);
    fclose(f);
    return path;
}

/* Expect creation to fail with st, and the error to mention each of the given substrings. */
static void expect_fail(const char *path, duet_status_t st, const char *what1, const char *what2)
{
    duet_tokenizer_t *tok = NULL;
    duet_status_t got = duet_tokenizer_create_tiktoken(path, "\\S+|\\s+", NULL, 0, &tok);
    cr_assert_eq(got, st, "%s: got %s (%s)", path, duet_status_name(got), duet_error_last());
    cr_assert_null(tok);
    cr_assert_not_null(strstr(duet_error_last(), path), "error names the file: %s",
                       duet_error_last());
    if (what1 != NULL)
        cr_assert_not_null(strstr(duet_error_last(), what1), "want \"%s\" in: %s", what1,
                           duet_error_last());
    if (what2 != NULL)
        cr_assert_not_null(strstr(duet_error_last(), what2), "want \"%s\" in: %s", what2,
                           duet_error_last());
}

TestSuite(tokenizer_ranks, .init = setup, .fini = teardown);

Test(tokenizer_ranks, malformed, .timeout = 30)
{
    char path[256];
    snprintf(path, sizeof(path), "%s/empty.tiktoken", dir);
    fclose(fopen(path, "wb"));
    expect_fail(path, DUET_ERR_FORMAT, "empty", NULL);
    snprintf(path, sizeof(path), "%s/blank.tiktoken", dir);
    FILE *f = fopen(path, "wb");
    fputs("\n\n\r\n", f);
    fclose(f);
    expect_fail(path, DUET_ERR_FORMAT, "empty", NULL);

    expect_fail(write_ranks("b64.tiktoken", 256, "YW*i 256\n"), DUET_ERR_FORMAT, ":257:", "base64");
    expect_fail(write_ranks("b64pad.tiktoken", 256, "Y=Ji 256\n"), DUET_ERR_FORMAT,
                ":257:", "base64");
    expect_fail(write_ranks("b64len.tiktoken", 256, "YWJ 256\n"), DUET_ERR_FORMAT,
                ":257:", "base64");
    expect_fail(write_ranks("norank.tiktoken", 256, "YWJj\n"), DUET_ERR_FORMAT,
                ":257:", "missing rank");
    expect_fail(write_ranks("norank2.tiktoken", 256, "YWJj \n"), DUET_ERR_FORMAT,
                ":257:", "missing rank");
    expect_fail(write_ranks("nan.tiktoken", 256, "YWJj 12a\n"), DUET_ERR_FORMAT,
                ":257:", "not a decimal");
    expect_fail(write_ranks("neg.tiktoken", 256, "YWJj -3\n"), DUET_ERR_FORMAT,
                ":257:", "not a decimal");
    expect_fail(write_ranks("twospace.tiktoken", 256, "YWJj  300\n"), DUET_ERR_FORMAT,
                ":257:", "not a decimal");
    expect_fail(write_ranks("big.tiktoken", 256, "YWJj 99999999999999999999\n"), DUET_ERR_FORMAT,
                ":257:", "larger");
    expect_fail(write_ranks("duprank.tiktoken", 256, "YWI= 300\nYWJj 300\n"), DUET_ERR_FORMAT,
                ":258:", "duplicate rank 300 (first at line 257)");
    expect_fail(write_ranks("dupbytes.tiktoken", 256, "YWI= 300\nYWI= 301\n"), DUET_ERR_FORMAT,
                ":258:", "duplicate token bytes");
    expect_fail(write_ranks("nobyte.tiktoken", 'q', ""), DUET_ERR_FORMAT, "0x71", NULL);

    char *huge = malloc(10000);
    memset(huge, 'Q', 9990);
    strcpy(huge + 9990, " 300\n");
    expect_fail(write_ranks("huge.tiktoken", 256, huge), DUET_ERR_FORMAT, ":257:", "longer");
    free(huge);

    snprintf(path, sizeof(path), "%s/missing.tiktoken", dir);
    expect_fail(path, DUET_ERR_IO, NULL, NULL);

    /* Special ids may not collide with ranks. */
    duet_tokenizer_t *tok = NULL;
    duet_tokenizer_special_t sp[] = {{"<|x|>", 255, 0}};
    cr_assert_eq(
        duet_tokenizer_create_tiktoken(write_ranks("ok.tiktoken", 256, ""), "\\S+", sp, 1, &tok),
        DUET_ERR_INVALID);
    /* A bad regex is refused; an unknown name needs a pattern. */
    cr_assert_eq(
        duet_tokenizer_create_tiktoken(write_ranks("ok.tiktoken", 256, ""), "(", NULL, 0, &tok),
        DUET_ERR_INVALID);
    cr_assert_eq(
        duet_tokenizer_create_tiktoken(write_ranks("ok.tiktoken", 256, ""), NULL, NULL, 0, &tok),
        DUET_ERR_NOT_FOUND);
    cr_assert_null(tok);
}

static void expect_ids(duet_tokenizer_t *tok, const char *text, const uint32_t *want, size_t n_want)
{
    uint32_t ids[64];
    size_t n = 0;
    cr_assert_eq(
        duet_tokenizer_encode(tok, text, strlen(text), DUET_TOKENIZER_ALLOW_SPECIAL, ids, 64, &n),
        DUET_OK);
    cr_assert_eq(n, n_want, "\"%s\": %zu ids, want %zu", text, n, n_want);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(ids[i], want[i], "\"%s\" id %zu: %u, want %u", text, i, ids[i], want[i]);
}

Test(tokenizer_ranks, merge_rules, .timeout = 30)
{
    /* 256 "aa", 257 "ab", 258 "bc", 259 "abc", 300 "xyz" (no "xy"/"yz"); CRLF and blank lines. */
    const char *path =
        write_ranks("tiny.tiktoken", 256, "YWE= 256\r\nYWI= 257\n\nYmM= 258\nYWJj 259\neHl6 300\n");
    duet_tokenizer_t *tok = NULL;
    duet_tokenizer_special_t sp[] = {{"<s>", 400, 0}};
    cr_assert_eq(duet_tokenizer_create_tiktoken(path, "\\S+|\\s+", sp, 1, &tok), DUET_OK, "%s",
                 duet_error_last());
    cr_assert_eq(duet_tokenizer_vocab_size(tok), 401);
    expect_ids(tok, "aaa", (uint32_t[]){256, 'a'}, 2); /* leftmost on a tie */
    expect_ids(tok, "aaaa", (uint32_t[]){256, 256}, 2);
    expect_ids(tok, "abc", (uint32_t[]){259}, 1);       /* whole piece is a token */
    expect_ids(tok, "abcd", (uint32_t[]){259, 'd'}, 2); /* ab (257) then ab+c (259) */
    expect_ids(tok, "xbc", (uint32_t[]){'x', 258}, 2);
    expect_ids(tok, "xyz", (uint32_t[]){300}, 1); /* no merge path, still whole */
    expect_ids(tok, "xyzz", (uint32_t[]){'x', 'y', 'z', 'z'}, 4);
    expect_ids(tok, "ab<s>aa", (uint32_t[]){257, 400, 256}, 3);
    duet_tokenizer_destroy(tok);
}
