/*
 * The JSON automaton of response_format (grammar/json_grammar.h) against jansson as the oracle:
 * valid texts accepted, invalid ones rejected at the first wrong byte, random walks through the
 * automaton parse whenever it says complete, random generated documents accepted, and the trie
 * mask equal to feeding every token on its own.
 */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "grammar/json_grammar.h"
#include "tokenizer/tokenizer.h"

/* Index of the first rejected byte, or -1 when all of text is accepted. */
static long first_reject(const char *text, size_t n, int top_object, duet_json_t *out)
{
    duet_json_t s;
    duet_json_init(&s, top_object);
    for (size_t i = 0; i < n; i++)
        if (!duet_json_feed(&s, (uint8_t)text[i]))
            return (long)i;
    if (out != NULL)
        *out = s;
    return -1;
}

static int jansson_parses(const char *text, size_t n)
{
    json_error_t err;
    json_t *j =
        json_loadb(text, n, JSON_DECODE_ANY | JSON_ALLOW_NUL | JSON_DECODE_INT_AS_REAL, &err);
    json_decref(j);
    return j != NULL;
}

Test(json_grammar, valid_texts_accepted)
{
    static const char *const ok[] = {
        "{}",
        "{\"a\":1}",
        "{ \"a\" : [1, 2.5, -0.5e+10, true, false, null, \"x\"] }",
        "{\"k\":{\"n\":{\"m\":[]}}}",
        "{\"s\":\"\\u00e9\\n\\t\\\"\\\\\\/\\ud83d\\ude00\"}",
        "{\"u\":\"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80\"}",
        "{\n  \"a\": 0\n}",
        "{\"e\":1E5,\"z\":0,\"n\":-12}",
    };
    for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
        duet_json_t s;
        cr_assert_eq(first_reject(ok[i], strlen(ok[i]), 1, &s), -1, "%s", ok[i]);
        cr_assert(duet_json_accepting(&s), "%s", ok[i]);
        cr_assert(jansson_parses(ok[i], strlen(ok[i])), "%s", ok[i]);
    }
    /* any value at the top when not asked for an object */
    static const char *const any[] = {"1", "-0.25", "\"s\"", "[1,[2]]", "true", "null", "1e99"};
    for (size_t i = 0; i < sizeof(any) / sizeof(any[0]); i++) {
        duet_json_t s;
        cr_assert_eq(first_reject(any[i], strlen(any[i]), 0, &s), -1, "%s", any[i]);
        cr_assert(duet_json_accepting(&s), "%s", any[i]);
    }
    /* prefixes are not complete */
    duet_json_t s;
    cr_assert_eq(first_reject("{\"a\":1", 6, 1, &s), -1);
    cr_assert_not(duet_json_accepting(&s));
}

Test(json_grammar, invalid_rejected_at_the_byte)
{
    static const struct {
        const char *text;
        long at;
        int top_object;
    } bad[] = {
        {"[1]", 0, 1},                      /* json_object: the top value is an object */
        {"{a:1}", 1, 1},                    /* unquoted key */
        {"{\"a\" 1}", 5, 1},                /* no colon */
        {"{\"a\":01}", 6, 1},               /* leading zero */
        {"{\"a\":1,}", 7, 1},               /* trailing comma */
        {"{\"a\":1.}", 7, 1},               /* fraction without digits */
        {"{\"a\":tru}", 8, 1},              /* broken literal */
        {"{\"a\":\"\x01\"}", 6, 1},         /* control byte in a string */
        {"{\"a\":\"\\x\"}", 7, 1},          /* bad escape */
        {"{\"a\":\"\\udc00\"}", 9, 1},      /* lone low surrogate: known after two hex digits */
        {"{\"a\":\"\\ud800x\"}", 12, 1},    /* high surrogate not followed by \u */
        {"{\"a\":\"\xc0\x80\"}", 6, 1},     /* overlong UTF-8 lead */
        {"{\"a\":\"\xed\xa0\x80\"}", 7, 1}, /* UTF-8 surrogate */
        {"{\"a\":\"\xe2\x82\"}", 8, 1},     /* truncated UTF-8 */
        {"{} ", 2, 1},                      /* nothing after the value */
        {" {}", 0, 1},                      /* nor before it */
        {"\n1", 0, 0},
        {"{}{}", 2, 1},
        {"{\"a\":1]", 6, 1},     /* wrong close */
        {"{\"a\":1e123}", 9, 1}, /* exponent digits limited */
        {"1 ", 1, 0},            /* a top-level number ends with the text */
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        long at = first_reject(bad[i].text, strlen(bad[i].text), bad[i].top_object, NULL);
        cr_assert_eq(at, bad[i].at, "%s: rejected at %ld, expected %ld", bad[i].text, at,
                     bad[i].at);
    }
    /* whitespace is bounded */
    char many[64] = "{";
    memset(many + 1, ' ', DUET_JSON_MAX_WS + 1);
    cr_assert_eq(first_reject(many, 1 + DUET_JSON_MAX_WS + 1, 1, NULL), 1 + DUET_JSON_MAX_WS);
    /* nesting is bounded */
    char deep[DUET_JSON_MAX_DEPTH + 2];
    memset(deep, '[', sizeof(deep));
    cr_assert_eq(first_reject(deep, sizeof(deep), 0, NULL), DUET_JSON_MAX_DEPTH);
}

/* Random walks: each step a random byte among those the state accepts (biased to end soon once
 * deep); every complete prefix must parse with jansson, and every parse of a random byte string
 * that the automaton accepted and called complete too. */
Test(json_grammar, random_walks_parse)
{
    srand(12345);
    char buf[4096];
    int completes = 0;
    for (int walk = 0; walk < 3000; walk++) {
        duet_json_t s;
        duet_json_init(&s, walk % 2);
        size_t n = 0;
        while (n < sizeof(buf) - 1) {
            uint8_t cand[256];
            int nc = 0;
            for (int c = 0; c < 256; c++) {
                duet_json_t t = s;
                if (duet_json_feed(&t, (uint8_t)c))
                    cand[nc++] = (uint8_t)c;
            }
            if (duet_json_accepting(&s)) {
                cr_assert(jansson_parses(buf, n), "complete but jansson refuses: %.*s", (int)n,
                          buf);
                completes++;
                if (nc == 0 || rand() % 4 == 0)
                    break;
            }
            cr_assert(nc > 0, "a dead state that is not complete: %.*s", (int)n, buf);
            /* prefer closing brackets and quotes so that walks end */
            uint8_t c = cand[rand() % nc];
            for (int k = 0; k < nc; k++)
                if ((cand[k] == '}' || cand[k] == ']' || cand[k] == '"') && rand() % 3 == 0)
                    c = cand[k];
            cr_assert(duet_json_feed(&s, c));
            buf[n++] = (char)c;
        }
    }
    cr_assert_gt(completes, 1000, "too few walks completed: %d", completes);
}

/* Random documents (within the automaton's limits) printed by jansson are accepted whole. */
static json_t *random_value(int depth)
{
    int k = rand() % (depth < 6 ? 8 : 5);
    switch (k) {
    case 0:
        return json_integer(rand() - RAND_MAX / 2);
    case 1:
        return json_real((double)rand() / 977.0 - 1000.0);
    case 2: {
        char s[16];
        int n = rand() % 8;
        for (int i = 0; i < n; i++)
            s[i] = (char)(1 + rand() % 126); /* control bytes get escaped */
        s[n] = 0;
        return json_string(s);
    }
    case 3:
        return rand() % 2 ? json_true() : json_false();
    case 4:
        return json_null();
    case 5:
    case 6: {
        json_t *o = json_object();
        int n = rand() % 4;
        for (int i = 0; i < n; i++) {
            char key[8];
            snprintf(key, sizeof(key), "k%d", rand() % 100);
            json_object_set_new(o, key, random_value(depth + 1));
        }
        return o;
    }
    default: {
        json_t *a = json_array();
        int n = rand() % 4;
        for (int i = 0; i < n; i++)
            json_array_append_new(a, random_value(depth + 1));
        return a;
    }
    }
}

Test(json_grammar, random_documents_accepted)
{
    srand(777);
    for (int i = 0; i < 2000; i++) {
        json_t *o = json_object();
        json_object_set_new(o, "v", random_value(0));
        size_t flags = i % 2 ? JSON_COMPACT : JSON_INDENT(1);
        char *text = json_dumps(o, flags | JSON_REAL_PRECISION(12));
        duet_json_t s;
        cr_assert_eq(first_reject(text, strlen(text), 1, &s), -1, "refused: %s", text);
        cr_assert(duet_json_accepting(&s), "not complete: %s", text);
        free(text);
        json_decref(o);
    }
}

/* A made-up vocabulary: the mask through the trie equals feeding each token alone. */
static const char *const VOCAB[] = {
    "{",   "}",   "[",    "]",    "\"",       ":",     ",",           " ",  "\n", "{\"",
    "\":", "\",", "true", "tr",   "ue",       "false", "null",        "0",  "1",  "12",
    "-",   ".",   "e",    "a",    "ab",       "\\",    "\\u",         "d8", "00", "\"}",
    "}}",  "1,",  "é",    "\xe2", "\x82\xac", "  ",    "<|special|>", "",
};
#define NV ((int64_t)(sizeof(VOCAB) / sizeof(VOCAB[0])))

static int vocab_bytes(void *user, uint32_t id, const uint8_t **p, size_t *n)
{
    (void)user;
    *p = (const uint8_t *)VOCAB[id];
    *n = strlen(VOCAB[id]);
    return 0;
}

static int vocab_special(void *user, uint32_t id)
{
    (void)user;
    return VOCAB[id][0] == '<';
}

Test(json_grammar, mask_matches_per_token_feed)
{
    duet_json_vocab_t *v;
    cr_assert_eq(duet_json_vocab_create(NV, vocab_bytes, vocab_special, NULL, &v), DUET_OK);
    srand(99);
    uint8_t ok[NV];
    int checked = 0;
    for (int walk = 0; walk < 300; walk++) {
        duet_json_t s;
        duet_json_init(&s, 1);
        for (int step = 0; step < 40; step++) {
            int64_t n_ok = duet_json_allowed(&s, v, ok);
            int64_t count = 0;
            for (int64_t id = 0; id < NV; id++) {
                duet_json_t t = s;
                size_t len = strlen(VOCAB[id]);
                int expect = len > 0 && !vocab_special(NULL, (uint32_t)id) &&
                             duet_json_feed_n(&t, (const uint8_t *)VOCAB[id], len);
                cr_assert_eq(ok[id], expect, "id %lld (%s)", (long long)id, VOCAB[id]);
                count += expect;
            }
            cr_assert_eq(n_ok, count);
            checked++;
            if (n_ok == 0)
                break;
            int64_t pick;
            do
                pick = rand() % NV;
            while (!ok[pick]);
            cr_assert(duet_json_feed_n(&s, (const uint8_t *)VOCAB[pick], strlen(VOCAB[pick])));
        }
    }
    cr_assert_gt(checked, 1000);
    duet_json_vocab_destroy(v);
}

/* o200k_base (200,019 ids, multi-byte pieces, partial UTF-8 pieces): the mask (with the plain
 * string ids taken from the bitmap) equals feeding each id alone, in states of every kind. */
static int tik_bytes(void *user, uint32_t id, const uint8_t **p, size_t *n)
{
    return duet_tokenizer_token_bytes(user, id, p, n) != DUET_OK;
}

static int tik_special(void *user, uint32_t id)
{
    return duet_tokenizer_is_special(user, id);
}

Test(json_grammar, mask_on_a_large_vocabulary, .timeout = 120)
{
    duet_tokenizer_t *tok = NULL;
    cr_assert_eq(duet_tokenizer_load(DUET_SOURCE_DIR "/data/tokenizers/o200k_base.tiktoken", &tok),
                 DUET_OK, "%s", duet_error_last());
    const int64_t V = duet_tokenizer_vocab_size(tok);
    duet_json_vocab_t *v;
    cr_assert_eq(duet_json_vocab_create(V, tik_bytes, tik_special, tok, &v), DUET_OK);
    uint8_t *ok = malloc((size_t)V);
    static const char *const prefixes[] = {
        "",
        "{",
        "{\"",
        "{\"name\": \"Jo",
        "{\"a\": 12",
        "{\"a\": [1, ",
        "{\"a\": {\"b\": tr",
        "{\"s\": \"caf\xc3",
        "{\"s\": \"\\u00",
        "{\"s\": \"\\ud83d",
        "{\"a\": -0.5e",
        "{\"a\":1}",
    };
    for (size_t i = 0; i < sizeof(prefixes) / sizeof(prefixes[0]); i++) {
        duet_json_t s;
        duet_json_init(&s, 1);
        cr_assert(duet_json_feed_n(&s, (const uint8_t *)prefixes[i], strlen(prefixes[i])));
        int64_t n = duet_json_allowed(&s, v, ok), count = 0;
        for (int64_t id = 0; id < V; id++) {
            const uint8_t *p;
            size_t len;
            int expect = 0;
            if (duet_tokenizer_token_bytes(tok, (uint32_t)id, &p, &len) == DUET_OK && len > 0 &&
                !duet_tokenizer_is_special(tok, (uint32_t)id)) {
                duet_json_t t = s;
                expect = duet_json_feed_n(&t, p, len);
            }
            cr_assert_eq(ok[id], expect, "state %s: id %lld", prefixes[i], (long long)id);
            count += expect;
        }
        cr_assert_eq(n, count);
    }
    free(ok);
    duet_json_vocab_destroy(v);
    duet_tokenizer_destroy(tok);
}
