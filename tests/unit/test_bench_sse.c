/*
 * duet-bench's streaming reader (bench/serving_sse.h): router-shaped completions and chat
 * streams give the same result fed whole or one byte at a time (with "\n", "\r\n" and "\r" line
 * ends); the generated text; text-chunk times and ITL; usage; every kind of malformed input fails
 * with a reason; and a few thousand random mutations of a valid stream, fed in random pieces, never
 * crash and end either complete or failed with a reason.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "bench/serving_sse.h"

/* What the router sends for a 3-token completion with include_usage. */
static const char *completions_stream =
    "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,"
    "\"text\":\"dl\",\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n"
    "data: {\"id\":\"cmpl-1\",\"choices\":[{\"index\":0,\"text\":\"r\\u00e9\","
    "\"finish_reason\":null}],\"usage\":null}\n\n"
    ": a comment line\n"
    "data: {\"id\":\"cmpl-1\",\"choices\":[{\"index\":0,\"text\":\"w\",\"finish_reason\":null}],"
    "\"usage\":null}\n\n"
    "data: {\"id\":\"cmpl-1\",\"choices\":[{\"index\":0,\"text\":\"\",\"finish_reason\":"
    "\"length\"}],\"usage\":null}\n\n"
    "data: {\"id\":\"cmpl-1\",\"choices\":[],\"usage\":{\"prompt_tokens\":12,"
    "\"completion_tokens\":4,\"total_tokens\":16}}\n\n"
    "data: [DONE]\n\n";

static const char *chat_stream =
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n"
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\n\n"
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"b\"}}]}\n\n"
    "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n"
    "data: [DONE]\n\n";

/* Replace every "\n" of text with eol. */
static char *with_eol(const char *text, const char *eol)
{
    size_t n = 0, el = strlen(eol);
    for (const char *p = text; *p; p++)
        n += *p == '\n' ? el : 1;
    char *out = malloc(n + 1), *o = out;
    for (const char *p = text; *p; p++) {
        if (*p == '\n') {
            memcpy(o, eol, el);
            o += el;
        } else {
            *o++ = *p;
        }
    }
    *o = '\0';
    return out;
}

/* Feed whole, or in pieces of `step` bytes with time = byte offset. */
static duet_status_t feed(serving_stream_t *s, const char *text, size_t step)
{
    size_t n = strlen(text);
    if (step == 0)
        return serving_stream_feed(s, text, n, 1000);
    for (size_t at = 0; at < n; at += step) {
        size_t k = n - at < step ? n - at : step;
        duet_status_t st = serving_stream_feed(s, text + at, k, (uint64_t)(at + 1));
        if (st != DUET_OK)
            return st;
    }
    return DUET_OK;
}

Test(bench_sse, completions_stream_whole_and_bytewise_all_line_ends)
{
    const char *eols[] = {"\n", "\r\n", "\r"};
    for (int e = 0; e < 3; e++) {
        char *text = with_eol(completions_stream, eols[e]);
        for (size_t step = 0; step <= 3; step++) {
            serving_stream_t s;
            serving_stream_init(&s);
            cr_assert_eq(feed(&s, text, step), DUET_OK, "eol %d step %zu: %s", e, step, s.error);
            cr_assert_eq(serving_stream_finish(&s), DUET_OK, "%s", s.error);
            cr_assert(s.done);
            cr_assert_eq(s.n_text_chunks, 3, "eol %d step %zu", e, step);
            cr_assert_eq(s.n_itl, 2);
            cr_assert(s.has_usage);
            cr_assert_eq(s.usage_completion_tokens, 4);
            cr_assert_eq(s.usage_prompt_tokens, 12);
            cr_assert_eq(s.text_len, 6, "the generated text, chunks joined");
            cr_assert_str_eq(s.text, "dlr\xc3\xa9w");
            if (step == 1) {
                /* the first text chunk counts when the byte ending its blank line arrives */
                static const char *blank[] = {"\n\n", "\r\n\r\n", "\r\r"};
                static const size_t last[] = {1, 2, 1}; /* offset of that byte in blank[] */
                const char *end1 = strstr(text, blank[e]);
                uint64_t at = (uint64_t)(end1 - text) + last[e] + 1;
                cr_assert_eq(s.first_text_ns, at, "eol %d: %lu vs %lu", e,
                             (unsigned long)s.first_text_ns, (unsigned long)at);
            }
            serving_stream_free(&s);
        }
        free(text);
    }
}

Test(bench_sse, chat_stream_role_chunk_is_not_text)
{
    serving_stream_t s;
    serving_stream_init(&s);
    cr_assert_eq(feed(&s, chat_stream, 1), DUET_OK, "%s", s.error);
    cr_assert_eq(serving_stream_finish(&s), DUET_OK, "%s", s.error);
    cr_assert_eq(s.n_text_chunks, 2);
    cr_assert_str_eq(s.text, "ab");
    cr_assert(!s.has_usage);
    serving_stream_free(&s);
}

Test(bench_sse, text_chunk_times_and_itl)
{
    const char *ev = "data: {\"choices\":[{\"text\":\"x\"}]}\n\n";
    serving_stream_t s;
    serving_stream_init(&s);
    cr_assert_eq(serving_stream_feed(&s, ev, strlen(ev), 100000000), DUET_OK);
    cr_assert_eq(serving_stream_feed(&s, ev, strlen(ev), 125000000), DUET_OK);
    /* an event split across two reads counts at the read that completes it */
    cr_assert_eq(serving_stream_feed(&s, ev, 10, 130000000), DUET_OK);
    cr_assert_eq(serving_stream_feed(&s, ev + 10, strlen(ev) - 10, 175000000), DUET_OK);
    cr_assert_eq(serving_stream_feed(&s, "data: [DONE]\n\n", 14, 176000000), DUET_OK);
    cr_assert_eq(serving_stream_finish(&s), DUET_OK);
    cr_assert_eq(s.first_text_ns, 100000000);
    cr_assert_eq(s.n_itl, 2);
    cr_assert_float_eq(s.itl_ms[0], 25.0, 1e-9);
    cr_assert_float_eq(s.itl_ms[1], 50.0, 1e-9);
    serving_stream_free(&s);
}

Test(bench_sse, multi_line_data_and_ignored_fields)
{
    const char *t = "id: 1\nretry: 10\nevent: message\ndata: {\"choices\":\ndata: "
                    "[{\"text\":\"hi\"}]}\n\nfoo\n\ndata:[DONE]\n\n";
    serving_stream_t s;
    serving_stream_init(&s);
    cr_assert_eq(feed(&s, t, 1), DUET_OK, "%s", s.error);
    cr_assert_eq(serving_stream_finish(&s), DUET_OK, "%s", s.error);
    cr_assert_eq(s.n_text_chunks, 1);
    serving_stream_free(&s);
}

/* Each malformed stream fails (while feeding or at finish) with a reason containing want. */
static void fails(const char *text, const char *want)
{
    for (size_t step = 0; step <= 1; step++) {
        serving_stream_t s;
        serving_stream_init(&s);
        duet_status_t st = feed(&s, text, step);
        if (st == DUET_OK)
            st = serving_stream_finish(&s);
        cr_assert_neq(st, DUET_OK, "accepted: %s", text);
        cr_assert(s.failed);
        cr_assert(strstr(s.error, want) != NULL, "%s: got \"%s\", want \"%s\"", text, s.error,
                  want);
        /* once failed, input is ignored */
        cr_assert_neq(serving_stream_feed(&s, "data: [DONE]\n\n", 14, 1), DUET_OK);
        serving_stream_free(&s);
    }
}

Test(bench_sse, malformed_streams_fail_with_a_reason)
{
    fails("data: {\"choices\":[{\"text\":\"a\"}]\n\n", "malformed JSON");
    fails("data: [1,2]\n\n", "not a JSON object");
    fails("data: {\"choices\":{}}\n\n", "choices is an object");
    fails("data: {\"choices\":[1]}\n\n", "choices[0] is not an object");
    fails("data: {\"choices\":[{\"text\":5}]}\n\n", "not a string");
    fails("data: {\"choices\":[{\"delta\":\"x\"}]}\n\n", "delta is not an object");
    fails("data: {\"id\":\"x\"}\n\n", "neither choices nor usage");
    fails("data: {\"choices\":[],\"usage\":{\"completion_tokens\":\"4\"}}\n\n", "usage");
    fails("data: {\"choices\":[],\"usage\":{\"completion_tokens\":-1}}\n\n", "usage");
    fails("data: {\"error\":{\"message\":\"worker lost\",\"type\":\"server_error\"}}\n\n",
          "server error event: worker lost");
    fails("event: error\ndata: {\"choices\":[]}\n\n", "event: error");
    fails("data: {\"choices\":[{\"text\":\"a\"}]}\n\n", "ended before [DONE]");
    fails("data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choices\":[{\"text\":\"a\"}]}",
          "ended before [DONE]");
    fails("data: [DONE]\n\ndata: {\"choices\":[]}\n\n", "data after [DONE]");
    fails("data: [DONE]\n\ntrailing", "data after [DONE]");
    fails("data: {\"a\":1,\"a\":2}\n\n", "malformed JSON");
    fails("", "ended before [DONE]");
}

Test(bench_sse, overlong_line_fails)
{
    size_t n = SERVING_SSE_MAX_LINE + 10;
    char *big = malloc(n + 1);
    memset(big, 'x', n);
    big[n] = '\0';
    memcpy(big, "data: ", 6);
    serving_stream_t s;
    serving_stream_init(&s);
    cr_assert_neq(serving_stream_feed(&s, big, n, 1), DUET_OK);
    cr_assert(strstr(s.error, "line over") != NULL, "%s", s.error);
    serving_stream_free(&s);
    free(big);
}

Test(bench_sse, fuzzed_mutations_never_crash, .timeout = 120)
{
    const char *base[] = {completions_stream, chat_stream};
    srand(12345);
    int n_ok = 0, n_failed = 0;
    for (int iter = 0; iter < 4000; iter++) {
        const char *src = base[iter % 2];
        size_t n = strlen(src);
        char *m = malloc(n + 64);
        memcpy(m, src, n);
        int muts = 1 + rand() % 4;
        for (int k = 0; k < muts; k++) {
            size_t at = (size_t)rand() % n;
            switch (rand() % 5) {
            case 0:
                m[at] = (char)(rand() % 256);
                break; /* replace */
            case 1:
                m[at] = "{}[]\":,\n\r\\ 0"[rand() % 13];
                break; /* structural */
            case 2:
                memmove(m + at, m + at + 1, n - at - 1);
                n--;
                break; /* delete */
            case 3:    /* insert */
                memmove(m + at + 1, m + at, n - at);
                m[at] = "\n\r:{\"[DONE]"[rand() % 11];
                n++;
                break;
            default:
                n = at;
                break; /* truncate */
            }
            if (n == 0)
                break;
        }
        serving_stream_t s;
        serving_stream_init(&s);
        duet_status_t st = DUET_OK;
        for (size_t at = 0; at < n && st == DUET_OK;) { /* random piece sizes */
            size_t k = 1 + (size_t)rand() % 40;
            if (k > n - at)
                k = n - at;
            st = serving_stream_feed(&s, m + at, k, (uint64_t)at);
            at += k;
        }
        if (st == DUET_OK)
            st = serving_stream_finish(&s);
        if (st == DUET_OK) {
            cr_assert(s.done && !s.failed);
            n_ok++;
        } else {
            cr_assert(s.failed && s.error[0] != '\0', "failure without a reason");
            n_failed++;
        }
        serving_stream_free(&s);
        free(m);
    }
    cr_log_info("fuzz: %d complete, %d failed with a reason", n_ok, n_failed);
    cr_assert_gt(n_failed, 1000, "the mutations should break most streams");
}
