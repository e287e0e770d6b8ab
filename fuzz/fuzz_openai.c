/*
 * Fuzz target: the body of POST /v1/completions and /v1/chat/completions (router/api/openai.c:
 * duet_oai_request_parse), then what the router does with a request that parsed: its prompt ids
 * (duet_oai_request_tokens, through duet's default chat template or a small Jinja one, with a
 * byte tokenizer), and the text stream of a choice with the request's stop strings
 * (duet_oai_stream_*), serialised as the response and the SSE events.
 *
 * Input: a control byte (bit 0: chat endpoint; bit 1: the model's template is Jinja; bit 2: the
 * model has Kimi K2's tool-call format; bit 3: the body goes to /tokenize (bit 0 clear) or
 * /detokenize (set) instead, router/api/tokenize.h), then the body. Checked besides no crash /
 * sanitizer report:
 *  - a refusal is a 400 / 404 / 413 with a message, its zeroed request, and serialises as JSON
 *    that jansson parses (also as an SSE event);
 *  - a parsed request keeps the documented limits: the endpoint's fields only, max_tokens in
 *    [1, cap], temperature in [0, 2], top_p in (0, 1], top_k >= 0, at most 4 stop strings of
 *    1..256 bytes, prompt text valid UTF-8, prompt ids < vocab, messages <= the cap, include_usage
 *    only with stream;
 *  - its prompt, when it tokenizes, is 1..max_prompt_tokens ids inside the vocabulary, and with
 *    max_tokens within max_context;
 *  - fed its own prompt ids as the "generated" ids, the choice's text never contains a stop
 *    string, ends by max_tokens at the latest, and the response and SSE bytes are valid JSON;
 *  - with tools offered, that text through the tool-call parser (router/api/tools.h) gives
 *    valid JSON deltas, chunks and tool_calls, whatever it holds;
 *  - /tokenize and /detokenize answer JSON or an OpenAI error (400 / 404 / 413).
 */
#include "fuzz/fuzz.h"

#include <jansson.h>

#include "common/status.h"
#include "common/strbuf.h"
#include "common/utf8.h"
#include "router/api/chat_template.h"
#include "router/api/openai.h"
#include "router/api/tokenize.h"
#include "router/api/tools.h"
#include "tokenizer/tokenizer.h"

static duet_tokenizer_t *tok;
static duet_oai_template_t *tmpl_duet, *tmpl_jinja;

static const char jinja_text[] =
    "{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}";

static void setup(void)
{
    if (tok != NULL)
        return;
    fuzz_quiet();
    const char *specials[] = {"<|bos|>", "<|eos|>"};
    FUZZ_CHECK(duet_tokenizer_create_byte(specials, 2, &tok) == DUET_OK, "tokenizer");
    FUZZ_CHECK(duet_oai_template_create(NULL, 0, "default", tok, &tmpl_duet) == DUET_OK,
               "default template: %s", duet_error_last());
    FUZZ_CHECK(duet_oai_template_create_jinja(jinja_text, sizeof(jinja_text) - 1, "fuzz.jinja",
                                              NULL, tok, &tmpl_jinja) == DUET_OK,
               "jinja template: %s", duet_error_last());
}

static void check_json(const duet_strbuf_t *sb, const char *what)
{
    json_error_t e;
    json_t *j = json_loadb(sb->data != NULL ? sb->data : "", sb->len, JSON_ALLOW_NUL, &e);
    FUZZ_CHECK(j != NULL, "%s is not JSON (%s): %.*s", what, e.text, (int)sb->len, sb->data);
    json_decref(j);
}

/* Every "data: X\n\n" event of sb is JSON (or [DONE]). */
static void check_sse(const duet_strbuf_t *sb)
{
    const char *p = sb->data != NULL ? sb->data : "", *end = p + sb->len;
    while (p < end) {
        FUZZ_CHECK(end - p >= 8 && strncmp(p, "data: ", 6) == 0, "SSE event prefix");
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        FUZZ_CHECK(nl != NULL && nl + 1 < end && nl[1] == '\n', "SSE event end");
        const char *d = p + 6;
        if (!(nl - d == 6 && memcmp(d, "[DONE]", 6) == 0)) {
            duet_strbuf_t one = {.data = (char *)d, .len = (size_t)(nl - d)};
            check_json(&one, "an SSE event");
        }
        p = nl + 2;
    }
}

static bool contains(const char *hay, size_t hn, const char *needle, size_t nn)
{
    for (size_t i = 0; nn > 0 && i + nn <= hn; i++)
        if (memcmp(hay + i, needle, nn) == 0)
            return true;
    return false;
}

/* Text through the tool-call parser; its content and tool-call deltas into sse. */
static void tool_feed(duet_oai_toolparse_t *tp, const duet_oai_resp_meta_t *meta, const char *text,
                      size_t len, bool end, duet_strbuf_t *sse)
{
    const duet_oai_tp_event_t *ev;
    size_t n;
    FUZZ_CHECK(duet_oai_toolparse_feed(tp, text, len, end, &ev, &n) == DUET_OK, "tool feed");
    for (size_t i = 0; i < n; i++) {
        if (ev[i].kind == DUET_OAI_TP_CONTENT) {
            FUZZ_CHECK(duet_oai_sse_delta(meta, ev[i].text, ev[i].len, sse) == DUET_OK, "delta");
            continue;
        }
        duet_strbuf_t d;
        duet_strbuf_init(&d);
        FUZZ_CHECK(duet_oai_tool_delta_json(&ev[i], &d) == DUET_OK, "tool delta");
        check_json(&d, "a tool-call delta");
        FUZZ_CHECK(duet_oai_sse_delta_json(meta, d.data, d.len, sse) == DUET_OK, "tool chunk");
        duet_strbuf_free(&d);
    }
}

/* /tokenize or /detokenize: JSON, or an OpenAI error. */
static void check_tokenize(const duet_oai_limits_t *lim, bool detok, const char *body, size_t len)
{
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    duet_oai_error_t err;
    memset(&err, 0, sizeof(err));
    duet_status_t st = detok ? duet_oai_detokenize(lim, tok, body, len, &sb, &err)
                             : duet_oai_tokenize(lim, tmpl_duet, tok, body, len, &sb, &err);
    if (st == DUET_OK) {
        check_json(&sb, detok ? "/detokenize" : "/tokenize");
    } else {
        FUZZ_CHECK(err.http_status == 400 || err.http_status == 404 || err.http_status == 413,
                   "tokenize status %d", err.http_status);
        FUZZ_CHECK(sb.len == 0, "a refused tokenize wrote a body");
    }
    duet_strbuf_free(&sb);
}

static void check_stream(const duet_oai_request_t *req, const duet_oai_limits_t *lim,
                         const uint32_t *ids, size_t n)
{
    uint32_t eos = 257;
    duet_oai_stream_t *s = NULL;
    FUZZ_CHECK(duet_oai_stream_create(tok, req, &eos, 1, true, &s) == DUET_OK, "stream: %s",
               duet_error_last());
    const duet_oai_resp_meta_t meta = {.endpoint = req->endpoint,
                                       .id = "cmpl-fuzz",
                                       .model = lim->model_name,
                                       .created = 1700000000,
                                       .include_usage = req->include_usage};
    duet_strbuf_t sse;
    duet_strbuf_init(&sse);
    FUZZ_CHECK(duet_oai_sse_begin(&meta, &sse) == DUET_OK, "sse begin");
    duet_oai_toolparse_t *tp = NULL;
    if (req->tools != NULL)
        FUZZ_CHECK(duet_oai_toolparse_create(&tp) == DUET_OK, "tool parser");
    duet_oai_finish_t fin = DUET_OAI_FINISH_NONE;
    size_t fed = 0;
    for (size_t i = 0; i < n && fin == DUET_OAI_FINISH_NONE; i++) {
        const char *text;
        size_t len;
        FUZZ_CHECK(duet_oai_stream_feed(s, ids[i], &text, &len, &fin) == DUET_OK, "feed: %s",
                   duet_error_last());
        fed++;
        FUZZ_CHECK(duet_oai_sse_delta(&meta, text, len, &sse) == DUET_OK, "sse delta");
        if (tp != NULL)
            tool_feed(tp, &meta, text, len, false, &sse);
    }
    if (fin == DUET_OAI_FINISH_NONE) {
        const char *text;
        size_t len;
        FUZZ_CHECK(duet_oai_stream_finish(s, DUET_OAI_FINISH_LENGTH, &text, &len, &fin) == DUET_OK,
                   "finish");
        FUZZ_CHECK(duet_oai_sse_delta(&meta, text, len, &sse) == DUET_OK, "sse delta");
    }
    if (tp != NULL) {
        tool_feed(tp, &meta, NULL, 0, true, &sse);
        duet_strbuf_t calls;
        duet_strbuf_init(&calls);
        FUZZ_CHECK(duet_oai_toolparse_calls_json(tp, &calls) == DUET_OK, "tool_calls");
        check_json(&calls, "tool_calls");
        const char *c;
        size_t cl;
        duet_oai_toolparse_content(tp, &c, &cl);
        const duet_oai_choice_t ch = {.text = c,
                                      .len = cl,
                                      .finish = DUET_OAI_FINISH_TOOL_CALLS,
                                      .tool_calls_json = calls.data != NULL ? calls.data : "[]"};
        duet_strbuf_t body;
        duet_strbuf_init(&body);
        FUZZ_CHECK(duet_oai_response_json_n(&meta, &ch, 1, (uint32_t)n, 1, &body) == DUET_OK,
                   "tool response");
        check_json(&body, "the tool-call response");
        duet_strbuf_free(&body);
        duet_strbuf_free(&calls);
        duet_oai_toolparse_destroy(tp);
    }
    FUZZ_CHECK(fed <= req->max_tokens, "fed %zu ids past max_tokens %u", fed, req->max_tokens);
    FUZZ_CHECK(fin == DUET_OAI_FINISH_STOP || fin == DUET_OAI_FINISH_LENGTH, "finish %d", (int)fin);
    const char *text;
    size_t len;
    duet_oai_stream_text(s, &text, &len);
    for (size_t i = 0; i < req->n_stop; i++)
        FUZZ_CHECK(!contains(text, len, req->stop[i], req->stop_len[i]),
                   "the text holds stop string %zu", i);
    FUZZ_CHECK(duet_oai_sse_end(&meta, fin, (uint32_t)n, duet_oai_stream_n_tokens(s), &sse) ==
                   DUET_OK,
               "sse end");
    check_sse(&sse);
    duet_strbuf_free(&sse);
    duet_strbuf_t body;
    duet_strbuf_init(&body);
    FUZZ_CHECK(duet_oai_response_json(&meta, text, len, fin, (uint32_t)n,
                                      duet_oai_stream_n_tokens(s), &body) == DUET_OK,
               "response");
    check_json(&body, "the response");
    duet_strbuf_free(&body);
    duet_oai_stream_destroy(s);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    setup();
    fuzz_in_t in = {data, size};
    uint8_t ctl = fuzz_byte(&in);
    const duet_oai_endpoint_t ep =
        (ctl & 1) ? DUET_OAI_ENDPOINT_CHAT : DUET_OAI_ENDPOINT_COMPLETIONS;
    const bool jinja = (ctl & 2) != 0;
    const duet_oai_limits_t lim = {.model_name = "duet-demo",
                                   .max_tokens_default = 16,
                                   .max_tokens_cap = 64,
                                   .max_body_bytes = 64 * 1024,
                                   .vocab_size = duet_tokenizer_vocab_size(tok),
                                   .max_prompt_tokens = 2048,
                                   .max_context = 4096,
                                   .max_messages = 64,
                                   .jinja_template = jinja,
                                   .tool_calls = (ctl & 4) != 0};
    if ((ctl & 8) != 0) {
        check_tokenize(&lim, (ctl & 1) != 0, (const char *)in.p, in.n);
        return 0;
    }
    duet_oai_request_t req;
    duet_oai_error_t err;
    memset(&err, 0, sizeof(err));
    duet_status_t st = duet_oai_request_parse(&lim, ep, (const char *)in.p, in.n, &req, &err);
    if (st != DUET_OK) {
        FUZZ_CHECK(st == DUET_ERR_INVALID || st == DUET_ERR_RANGE, "status %d", (int)st);
        FUZZ_CHECK(err.http_status == 400 || err.http_status == 404 || err.http_status == 413,
                   "http status %d", err.http_status);
        FUZZ_CHECK((st == DUET_ERR_RANGE) == (err.http_status == 413), "413 iff RANGE");
        FUZZ_CHECK(err.message[0] != '\0' && err.type[0] != '\0', "empty error");
        FUZZ_CHECK(req.prompt == NULL && req.messages == NULL && req.n_stop == 0,
                   "request not zeroed");
        duet_strbuf_t sb;
        duet_strbuf_init(&sb);
        FUZZ_CHECK(duet_oai_error_json(&err, &sb) == DUET_OK, "error json");
        check_json(&sb, "the error");
        duet_strbuf_free(&sb);
        FUZZ_CHECK(duet_oai_sse_error(&err, &sb) == DUET_OK, "sse error");
        check_sse(&sb);
        duet_strbuf_free(&sb);
        return 0;
    }
    FUZZ_CHECK(req.endpoint == ep, "endpoint");
    FUZZ_CHECK(req.max_tokens >= 1 && req.max_tokens <= lim.max_tokens_cap, "max_tokens %u",
               req.max_tokens);
    FUZZ_CHECK(req.temperature >= 0 && req.temperature <= 2, "temperature %g", req.temperature);
    FUZZ_CHECK(req.top_p > 0 && req.top_p <= 1, "top_p %g", req.top_p);
    FUZZ_CHECK(req.top_k >= 0, "top_k %lld", (long long)req.top_k);
    FUZZ_CHECK(req.n_stop <= DUET_OAI_MAX_STOP, "n_stop %zu", req.n_stop);
    for (size_t i = 0; i < req.n_stop; i++)
        FUZZ_CHECK(req.stop[i] != NULL && req.stop_len[i] >= 1 &&
                       req.stop_len[i] <= DUET_OAI_MAX_STOP_LEN,
                   "stop %zu of %zu bytes", i, req.stop_len[i]);
    FUZZ_CHECK(req.stream || !req.include_usage, "include_usage without stream");
    FUZZ_CHECK(req.n >= 1 && req.n <= DUET_OAI_MAX_N, "n %u", req.n);
    FUZZ_CHECK(req.tools == NULL || (ep == DUET_OAI_ENDPOINT_CHAT && jinja && lim.tool_calls &&
                                     req.tool_choice != DUET_OAI_TOOL_CHOICE_NONE &&
                                     !req.skip_special_tokens && json_array_size(req.tools) >= 1 &&
                                     json_array_size(req.tools) <= DUET_OAI_MAX_TOOLS),
               "tools offered where they cannot be");
    if (ep == DUET_OAI_ENDPOINT_COMPLETIONS) {
        FUZZ_CHECK((req.prompt != NULL) != (req.prompt_ids != NULL), "one prompt form");
        FUZZ_CHECK(req.messages == NULL && req.n_messages == 0, "messages on completions");
        if (req.prompt != NULL)
            FUZZ_CHECK(duet_utf8_valid(req.prompt, req.prompt_len) &&
                           req.prompt[req.prompt_len] == '\0',
                       "prompt text");
        for (size_t i = 0; i < req.n_prompt_ids; i++)
            FUZZ_CHECK(req.prompt_ids[i] < lim.vocab_size, "prompt id %u", req.prompt_ids[i]);
    } else {
        FUZZ_CHECK(req.prompt == NULL && req.prompt_ids == NULL, "prompt on chat");
        FUZZ_CHECK(req.n_messages >= 1 && req.n_messages <= lim.max_messages, "%zu messages",
                   req.n_messages);
        FUZZ_CHECK(req.messages_json != NULL &&
                       json_array_size(req.messages_json) == req.n_messages,
                   "messages_json");
        for (size_t i = 0; i < req.n_messages; i++)
            FUZZ_CHECK(req.messages[i].role < DUET_OAI_ROLE_COUNT &&
                           duet_utf8_valid(req.messages[i].content, req.messages[i].content_len),
                       "message %zu", i);
    }

    uint32_t *ids = NULL;
    size_t n = 0;
    memset(&err, 0, sizeof(err));
    st = duet_oai_request_tokens(&req, &lim, jinja ? tmpl_jinja : tmpl_duet, tok, &ids, &n, &err);
    if (st == DUET_OK) {
        FUZZ_CHECK(n >= 1 && n <= lim.max_prompt_tokens, "%zu prompt ids", n);
        FUZZ_CHECK(n + req.max_tokens <= lim.max_context, "context");
        for (size_t i = 0; i < n; i++)
            FUZZ_CHECK(ids[i] < lim.vocab_size, "id %u", ids[i]);
        check_stream(&req, &lim, ids, n);
    } else {
        FUZZ_CHECK(err.http_status >= 400 && err.message[0] != '\0', "tokens refused: %d %s",
                   err.http_status, err.message);
    }
    free(ids);
    duet_oai_request_free(&req);
    return 0;
}
