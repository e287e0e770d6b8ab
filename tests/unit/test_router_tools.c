/*
 * Tool calling (router/api/tools.c): Kimi K2's tool-call format parsed out of a choice's text.
 * The token streams are built from a Kimi-layout tokenizer (tiktoken.model of the 256 bytes, its
 * special range 256..513 with the tool-call markers named as in Kimi's tokenizer_config.json,
 * "special": false, so shown under skip_special_tokens as transformers shows them) and go
 * through the choice's text stream (duet_oai_stream_*) one id at a time, as the router feeds
 * them; the parser's result must not depend on how the text is cut (checked byte by byte), the
 * JSON it writes must parse, and every malformed section must end cleanly (dropped or content),
 * never as a half call.
 */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/strbuf.h"
#include "router/api/openai.h"
#include "router/api/tools.h"

static char g_dir[64];
static duet_tokenizer_t *tok;

enum { SEC_BEGIN = 258, SEC_END, CALL_BEGIN, ARG_BEGIN, CALL_END, IM_END };

static void put(const char *name, const char *text)
{
    char path[256];
    snprintf(path, sizeof(path), "%s/%s", g_dir, name);
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
}

static void setup(void)
{
    snprintf(g_dir, sizeof(g_dir), "/tmp/duet-tools-XXXXXX");
    cr_assert_not_null(mkdtemp(g_dir));
    static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    char *ranks = malloc(256 * 16), *p = ranks;
    for (int b = 0; b < 256; b++)
        p += sprintf(p, "%c%c== %d\n", b64[b >> 2], b64[(b & 3) << 4], b);
    put("tiktoken.model", ranks);
    free(ranks);
    put("tokenizer_config.json",
        "{\"added_tokens_decoder\": {"
        "\"256\": {\"content\": \"[BOS]\", \"special\": true},"
        "\"257\": {\"content\": \"[EOS]\", \"special\": true},"
        "\"258\": {\"content\": \"<|tool_calls_section_begin|>\", \"special\": false},"
        "\"259\": {\"content\": \"<|tool_calls_section_end|>\", \"special\": false},"
        "\"260\": {\"content\": \"<|tool_call_begin|>\", \"special\": false},"
        "\"261\": {\"content\": \"<|tool_call_argument_begin|>\", \"special\": false},"
        "\"262\": {\"content\": \"<|tool_call_end|>\", \"special\": false},"
        "\"263\": {\"content\": \"<|im_end|>\", \"special\": true}},"
        " \"bos_token\": \"[BOS]\", \"eos_token\": \"[EOS]\"}");
    cr_assert_eq(duet_tokenizer_load(g_dir, &tok), DUET_OK, "%s", duet_error_last());
}

static void teardown(void)
{
    duet_tokenizer_destroy(tok);
    const char *names[] = {"tiktoken.model", "tokenizer_config.json"};
    for (size_t i = 0; i < 2; i++) {
        char path[256];
        snprintf(path, sizeof(path), "%s/%s", g_dir, names[i]);
        unlink(path);
    }
    rmdir(g_dir);
}

TestSuite(router_tools, .init = setup, .fini = teardown);

/* What a parse gave: the content, the calls (from the events: streamed), the final JSON. */
typedef struct {
    char content[1024];
    size_t content_len;
    char ids[4][64], names[4][64], args[4][256];
    uint32_t n_started;
    uint32_t n_done;
    char calls_json[2048];
} got_t;

static void collect(got_t *g, const duet_oai_tp_event_t *ev, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        const duet_oai_tp_event_t *e = &ev[i];
        if (e->kind == DUET_OAI_TP_CONTENT) {
            cr_assert_lt(g->content_len + e->len, sizeof(g->content));
            memcpy(g->content + g->content_len, e->text, e->len);
            g->content_len += e->len;
        } else if (e->kind == DUET_OAI_TP_CALL) {
            cr_assert_eq(e->call, g->n_started, "calls are numbered in order");
            cr_assert_lt(e->call, 4);
            snprintf(g->ids[e->call], 64, "%.*s", (int)e->len, e->text);
            snprintf(g->names[e->call], 64, "%.*s", (int)e->name_len, e->name);
            g->n_started++;
        } else {
            cr_assert_lt(e->call, g->n_started, "arguments of a call that began");
            size_t at = strlen(g->args[e->call]);
            cr_assert_lt(at + e->len, 256);
            memcpy(g->args[e->call] + at, e->text, e->len);
            g->args[e->call][at + e->len] = '\0';
        }
        /* every delta object is valid JSON */
        if (e->kind != DUET_OAI_TP_CONTENT) {
            duet_strbuf_t sb;
            duet_strbuf_init(&sb);
            cr_assert_eq(duet_oai_tool_delta_json(e, &sb), DUET_OK);
            json_t *d = json_loads(sb.data, 0, NULL);
            cr_assert_not_null(d, "%s", sb.data);
            json_decref(d);
            duet_strbuf_free(&sb);
        }
    }
}

static void finish(got_t *g, duet_oai_toolparse_t *tp)
{
    g->n_done = duet_oai_toolparse_n_calls(tp);
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    cr_assert_eq(duet_oai_toolparse_calls_json(tp, &sb), DUET_OK);
    cr_assert_lt(sb.len, sizeof(g->calls_json));
    memcpy(g->calls_json, sb.data, sb.len + 1);
    duet_strbuf_free(&sb);
    const char *c;
    size_t cl;
    duet_oai_toolparse_content(tp, &c, &cl);
    cr_assert_eq(cl, g->content_len, "the kept content is what was emitted");
    cr_assert(memcmp(c, g->content, cl) == 0);
}

/* Parse `text` fed in pieces of `piece` bytes (0: all at once). */
static void parse_text(const char *text, size_t piece, got_t *g)
{
    memset(g, 0, sizeof(*g));
    duet_oai_toolparse_t *tp = NULL;
    cr_assert_eq(duet_oai_toolparse_create(&tp), DUET_OK);
    size_t len = strlen(text), step = piece > 0 ? piece : (len > 0 ? len : 1);
    const duet_oai_tp_event_t *ev;
    size_t n;
    for (size_t at = 0; at < len; at += step) {
        size_t k = len - at < step ? len - at : step;
        cr_assert_eq(duet_oai_toolparse_feed(tp, text + at, k, false, &ev, &n), DUET_OK);
        collect(g, ev, n);
    }
    cr_assert_eq(duet_oai_toolparse_feed(tp, NULL, 0, true, &ev, &n), DUET_OK);
    collect(g, ev, n);
    finish(g, tp);
    cr_assert_eq(duet_oai_toolparse_feed(tp, "x", 1, false, &ev, &n), DUET_ERR_INVALID,
                 "fed after the end");
    duet_oai_toolparse_destroy(tp);
}

/* The same text every way it can be cut: all at once, and in pieces of 1..7 bytes. */
static void parse_all_ways(const char *text, got_t *g)
{
    parse_text(text, 0, g);
    for (size_t piece = 1; piece <= 7; piece++) {
        got_t h;
        parse_text(text, piece, &h);
        cr_assert_eq(h.content_len, g->content_len, "piece %zu: %s", piece, text);
        cr_assert(memcmp(h.content, g->content, g->content_len) == 0, "piece %zu", piece);
        cr_assert_str_eq(h.calls_json, g->calls_json, "piece %zu", piece);
        cr_assert_eq(h.n_started, g->n_started);
    }
}

#define KIMI_TEXT                                                                                  \
    "Let me check. <|tool_calls_section_begin|>\n<|tool_call_begin|>functions.get_weather:0"       \
    "<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|>\n"                         \
    "<|tool_call_begin|> functions.search:1 <|tool_call_argument_begin|> {\"q\": \"a b\"}  "       \
    "<|tool_call_end|><|tool_calls_section_end|>"

Test(router_tools, kimi_token_stream_through_the_text_stream)
{
    /* the markers are single special ids of the tokenizer, shown under skip_special_tokens */
    uint32_t ids[512];
    size_t n = 0;
    cr_assert_eq(duet_tokenizer_encode(tok, KIMI_TEXT, strlen(KIMI_TEXT),
                                       DUET_TOKENIZER_ALLOW_SPECIAL, ids, 511, &n),
                 DUET_OK);
    size_t n_markers = 0;
    for (size_t i = 0; i < n; i++)
        n_markers += ids[i] >= SEC_BEGIN && ids[i] <= CALL_END;
    cr_assert_eq(n_markers, 8);
    ids[n++] = IM_END; /* the model's stop id */

    /* as the router: ids -> the choice's text stream (skip_special_tokens on, <|im_end|> as
     * EOS) -> the tool-call parser */
    duet_oai_request_t req;
    memset(&req, 0, sizeof(req));
    req.max_tokens = 1000;
    req.skip_special_tokens = true;
    const uint32_t eos = IM_END;
    duet_oai_stream_t *s = NULL;
    cr_assert_eq(duet_oai_stream_create(tok, &req, &eos, 1, false, &s), DUET_OK);
    duet_oai_toolparse_t *tp = NULL;
    cr_assert_eq(duet_oai_toolparse_create(&tp), DUET_OK);
    got_t g;
    memset(&g, 0, sizeof(g));
    duet_oai_finish_t fin = DUET_OAI_FINISH_NONE;
    for (size_t i = 0; i < n && fin == DUET_OAI_FINISH_NONE; i++) {
        const char *t;
        size_t len;
        cr_assert_eq(duet_oai_stream_feed(s, ids[i], &t, &len, &fin), DUET_OK);
        const duet_oai_tp_event_t *ev;
        size_t ne;
        cr_assert_eq(duet_oai_toolparse_feed(tp, t, len, fin != DUET_OAI_FINISH_NONE, &ev, &ne),
                     DUET_OK);
        collect(&g, ev, ne);
    }
    cr_assert_eq(fin, DUET_OAI_FINISH_STOP);
    finish(&g, tp);
    duet_oai_toolparse_destroy(tp);
    duet_oai_stream_destroy(s);

    cr_assert_eq(g.content_len, 14);
    cr_assert(memcmp(g.content, "Let me check. ", 14) == 0);
    cr_assert_eq(g.n_done, 2);
    cr_assert_str_eq(g.ids[0], "functions.get_weather:0");
    cr_assert_str_eq(g.names[0], "get_weather");
    cr_assert_str_eq(g.args[0], "{\"city\": \"Paris\"}");
    cr_assert_str_eq(g.ids[1], "functions.search:1");
    cr_assert_str_eq(g.names[1], "search");
    cr_assert_str_eq(g.args[1], "{\"q\": \"a b\"}", "blanks around the arguments trimmed");
    /* the final array as a client reads it */
    json_t *a = json_loads(g.calls_json, 0, NULL);
    cr_assert(json_is_array(a) && json_array_size(a) == 2, "%s", g.calls_json);
    json_t *c1 = json_array_get(a, 1);
    cr_assert_str_eq(json_string_value(json_object_get(c1, "id")), "functions.search:1");
    cr_assert_str_eq(json_string_value(json_object_get(c1, "type")), "function");
    json_t *f = json_object_get(c1, "function");
    cr_assert_str_eq(json_string_value(json_object_get(f, "name")), "search");
    cr_assert_str_eq(json_string_value(json_object_get(f, "arguments")), "{\"q\": \"a b\"}");
    json_decref(a);

    /* and the text cut anywhere gives the same */
    got_t h;
    parse_all_ways(KIMI_TEXT, &h);
    cr_assert_str_eq(h.calls_json, g.calls_json);
}

Test(router_tools, malformed_tool_call_text)
{
    got_t g;
    /* no section: all content, markers' look-alikes included */
    parse_all_ways("plain <|tool_call_begin|> text <|tool", &g);
    cr_assert_eq(g.n_done, 0);
    cr_assert_str_eq(g.content, "plain <|tool_call_begin|> text <|tool");
    cr_assert_str_eq(g.calls_json, "[]");
    /* an empty section; text after its end is content again */
    parse_all_ways("a<|tool_calls_section_begin|> junk <|tool_calls_section_end|>b", &g);
    cr_assert_eq(g.n_done, 0);
    cr_assert_str_eq(g.content, "ab");
    /* the output ends inside a call's arguments: the call is dropped */
    parse_all_ways("<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
                   "<|tool_call_argument_begin|>{\"x\": 1",
                   &g);
    cr_assert_eq(g.n_started, 1);
    cr_assert_eq(g.n_done, 0);
    cr_assert_str_eq(g.calls_json, "[]");
    /* ... or inside the id */
    parse_all_ways("<|tool_calls_section_begin|><|tool_call_begin|>functions.f", &g);
    cr_assert_eq(g.n_started, 0);
    /* an id without the argument marker, longer than any id: skipped, the next call kept */
    char big[2048];
    int at = snprintf(big, sizeof(big), "<|tool_calls_section_begin|><|tool_call_begin|>");
    for (int i = 0; i < 300; i++)
        big[at++] = 'x';
    snprintf(big + at, sizeof(big) - (size_t)at,
             "<|tool_call_end|><|tool_call_begin|>g:3<|tool_call_argument_begin|>[]"
             "<|tool_call_end|>");
    parse_all_ways(big, &g);
    cr_assert_eq(g.n_done, 1);
    cr_assert_str_eq(g.ids[0], "g:3");
    cr_assert_str_eq(g.names[0], "g", "an id without 'functions.'");
    /* ids without ':' or with dots; empty arguments; ill-formed UTF-8 and control bytes in the
     * arguments still make valid JSON */
    parse_all_ways(
        "<|tool_calls_section_begin|><|tool_call_begin|>a.b.c<|tool_call_argument_begin|>"
        "<|tool_call_end|><|tool_call_begin|>functions.h:1<|tool_call_argument_begin|>"
        "\xff\x01\"<|tool_call_end|>",
        &g);
    cr_assert_eq(g.n_done, 2);
    cr_assert_str_eq(g.names[0], "c");
    cr_assert_str_eq(g.args[0], "");
    json_t *a = json_loads(g.calls_json, 0, NULL);
    cr_assert_not_null(a, "%s", g.calls_json);
    cr_assert_str_eq(json_string_value(json_object_get(
                         json_object_get(json_array_get(a, 1), "function"), "arguments")),
                     "\xef\xbf\xbd\x01\"");
    json_decref(a);
    /* a second section later in the text */
    parse_all_ways("<|tool_calls_section_begin|><|tool_call_begin|>f:0<|tool_call_argument_begin|>1"
                   "<|tool_call_end|><|tool_calls_section_end|> and "
                   "<|tool_calls_section_begin|><|tool_call_begin|>f:1<|tool_call_argument_begin|>2"
                   "<|tool_call_end|>",
                   &g);
    cr_assert_eq(g.n_done, 2);
    cr_assert_str_eq(g.content, " and ");
    cr_assert_str_eq(g.args[1], "2");
}
