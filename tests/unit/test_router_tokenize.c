/*
 * vLLM's /tokenize and /detokenize (router/api/tokenize.c): the ids of a prompt and of messages
 * written out by hand for a byte tokenizer and duet's default template (so independent of the
 * code under test), messages tokenized exactly as /v1/chat/completions tokenizes them, decoding
 * special ids as text, and a 400 naming the parameter for every malformed body.
 */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "common/strbuf.h"
#include "router/api/tokenize.h"

static const char *const specials[] = {"<|bos|>", "<|eos|>"};
enum { BOS = 256, EOS = 257 };

static const duet_oai_limits_t lim = {
    .model_name = "duet-demo",
    .max_tokens_default = 16,
    .max_tokens_cap = 512,
    .max_body_bytes = 1 << 16,
    .vocab_size = 258,
    .max_context = 1024,
};

static duet_tokenizer_t *tok;
static duet_oai_template_t *tmpl;

static void setup(void)
{
    cr_assert_eq(duet_tokenizer_create_byte(specials, 2, &tok), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(duet_oai_template_create(NULL, 0, "default", tok, &tmpl), DUET_OK);
}

static void teardown(void)
{
    duet_oai_template_destroy(tmpl);
    duet_tokenizer_destroy(tok);
}

TestSuite(router_tokenize, .init = setup, .fini = teardown);

/* Tokenize `body` (must succeed) and check count, max_model_len and tokens = head ids + bytes. */
static void expect_tokens(const char *body, const uint32_t *head, size_t n_head, const char *bytes)
{
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    duet_oai_error_t e;
    cr_assert_eq(duet_oai_tokenize(&lim, tmpl, tok, body, strlen(body), &sb, &e), DUET_OK, "%s: %s",
                 body, e.message);
    json_error_t je;
    json_t *root = json_loads(sb.data, 0, &je);
    cr_assert_not_null(root, "%s", sb.data);
    cr_assert_eq(json_object_size(root), 3, "%s", sb.data);
    json_t *ids = json_object_get(root, "tokens");
    size_t nb = strlen(bytes);
    cr_assert_eq(json_integer_value(json_object_get(root, "count")), (json_int_t)(n_head + nb));
    cr_assert_eq(json_integer_value(json_object_get(root, "max_model_len")), 1024);
    cr_assert_eq(json_array_size(ids), n_head + nb, "%s", sb.data);
    for (size_t i = 0; i < n_head + nb; i++)
        cr_assert_eq(json_integer_value(json_array_get(ids, i)),
                     i < n_head ? head[i] : (uint8_t)bytes[i - n_head], "id %zu: %s", i, sb.data);
    json_decref(root);
    duet_strbuf_free(&sb);
}

Test(router_tokenize, prompt_and_messages)
{
    const uint32_t bos[] = {BOS};
    expect_tokens("{\"model\":\"duet-demo\",\"prompt\":\"hi <|eos|>\"}", NULL, 0, "hi <|eos|>");
    expect_tokens("{\"prompt\":\"hi\",\"add_special_tokens\":false}", NULL, 0, "hi");
    expect_tokens("{\"prompt\":\"\"}", NULL, 0, "");
    expect_tokens("{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}", bos, 1,
                  "user: hi\nassistant: ");
    expect_tokens("{\"model\":null,\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],"
                  "\"add_generation_prompt\":false,\"unknown_field\":1}",
                  bos, 1, "user: hi\n");

    /* messages give exactly the ids /v1/chat/completions sends */
    const char *chat = "{\"model\":\"duet-demo\",\"messages\":[{\"role\":\"system\",\"content\":"
                       "\"s\"},{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},"
                       "{\"type\":\"text\",\"text\":\"b\"}]}]}";
    duet_oai_request_t r;
    duet_oai_error_t e;
    cr_assert_eq(duet_oai_request_parse(&lim, DUET_OAI_ENDPOINT_CHAT, chat, strlen(chat), &r, &e),
                 DUET_OK, "%s", e.message);
    uint32_t *ids = NULL;
    size_t n = 0;
    cr_assert_eq(duet_oai_request_tokens(&r, &lim, tmpl, tok, &ids, &n, &e), DUET_OK);
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    cr_assert_eq(duet_oai_tokenize(&lim, tmpl, tok, chat, strlen(chat), &sb, &e), DUET_OK);
    json_t *root = json_loads(sb.data, 0, NULL);
    json_t *got = json_object_get(root, "tokens");
    cr_assert_eq(json_array_size(got), n);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(json_integer_value(json_array_get(got, i)), ids[i]);
    json_decref(root);
    duet_strbuf_free(&sb);
    free(ids);
    duet_oai_request_free(&r);
}

Test(router_tokenize, detokenize_round_trip)
{
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    duet_oai_error_t e;
    const char *body = "{\"model\":\"duet-demo\",\"tokens\":[256,104,105,10,34,257,195]}";
    cr_assert_eq(duet_oai_detokenize(&lim, tok, body, strlen(body), &sb, &e), DUET_OK, "%s",
                 e.message);
    /* special ids as their text; a lone 0xC3 byte is ill-formed: U+FFFD */
    cr_assert_str_eq(sb.data, "{\"prompt\":\"<|bos|>hi\\n\\\"<|eos|>\xef\xbf\xbd\"}");
    duet_strbuf_free(&sb);
    duet_strbuf_init(&sb);
    cr_assert_eq(duet_oai_detokenize(&lim, tok, "{\"tokens\":[]}", 13, &sb, &e), DUET_OK);
    cr_assert_str_eq(sb.data, "{\"prompt\":\"\"}");
    duet_strbuf_free(&sb);
}

typedef struct {
    bool detok;
    const char *body;
    int status;
    const char *param; /* NULL = null */
} bad_t;

static const bad_t bad[] = {
    {false, "", 400, NULL},
    {false, "[1]", 400, NULL},
    {false, "{\"prompt\":\"a\",\"prompt\":\"b\"}", 400, NULL},
    {false, "{}", 400, "prompt"},
    {false, "{\"prompt\":\"a\",\"messages\":[]}", 400, "messages"},
    {false, "{\"prompt\":5}", 400, "prompt"},
    {false, "{\"prompt\":[1,2]}", 400, "prompt"},
    {false, "{\"model\":\"gpt-4\",\"prompt\":\"a\"}", 404, "model"},
    {false, "{\"model\":3,\"prompt\":\"a\"}", 400, "model"},
    {false, "{\"prompt\":\"a\",\"add_special_tokens\":\"yes\"}", 400, "add_special_tokens"},
    {false, "{\"prompt\":\"a\",\"tools\":[]}", 400, "tools"},
    {false, "{\"messages\":{}}", 400, "messages"},
    {false, "{\"messages\":[]}", 400, "messages"},
    {false, "{\"messages\":[{\"role\":\"robot\",\"content\":\"x\"}]}", 400, "messages[0].role"},
    {false, "{\"messages\":[{\"role\":\"user\"}]}", 400, "messages[0].content"},
    {false, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"add_generation_prompt\":1}",
     400, "add_generation_prompt"},
    {true, "{}", 400, "tokens"},
    {true, "{\"tokens\":null}", 400, "tokens"},
    {true, "{\"tokens\":\"abc\"}", 400, "tokens"},
    {true, "{\"tokens\":[1,\"a\"]}", 400, "tokens[1]"},
    {true, "{\"tokens\":[-1]}", 400, "tokens[0]"},
    {true, "{\"tokens\":[1,258]}", 400, "tokens[1]"},
    {true, "{\"tokens\":[1.0]}", 400, "tokens[0]"},
    {true, "{\"tokens\":[99999999999999999]}", 400, "tokens[0]"},
    {true, "{\"model\":\"other\",\"tokens\":[1]}", 404, "model"},
    {true, "not json", 400, NULL},
};

Test(router_tokenize, malformed_bodies)
{
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        const bad_t *c = &bad[i];
        duet_strbuf_t sb;
        duet_strbuf_init(&sb);
        duet_oai_error_t e;
        memset(&e, 0, sizeof(e));
        duet_status_t st =
            c->detok ? duet_oai_detokenize(&lim, tok, c->body, strlen(c->body), &sb, &e)
                     : duet_oai_tokenize(&lim, tmpl, tok, c->body, strlen(c->body), &sb, &e);
        cr_assert_neq(st, DUET_OK, "case %zu accepted: %s", i, c->body);
        cr_assert_eq(e.http_status, c->status, "case %zu (%s): %d %s", i, c->body, e.http_status,
                     e.message);
        cr_assert_str_eq(e.param, c->param != NULL ? c->param : "", "case %zu (%s): %s", i, c->body,
                         e.message);
        cr_assert_eq(sb.len, 0, "case %zu wrote a response", i);
        duet_strbuf_free(&sb);
    }
    /* api.strict refuses unknown fields; a body over the limit is a 413 */
    duet_oai_limits_t l = lim;
    l.strict = true;
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    duet_oai_error_t e;
    const char *body = "{\"prompt\":\"a\",\"return_tokens_as\":1}";
    cr_assert_neq(duet_oai_tokenize(&l, tmpl, tok, body, strlen(body), &sb, &e), DUET_OK);
    cr_assert_str_eq(e.param, "return_tokens_as");
    l.max_body_bytes = 8;
    cr_assert_eq(duet_oai_detokenize(&l, tok, "{\"tokens\":[1]}", 14, &sb, &e), DUET_ERR_RANGE);
    cr_assert_eq(e.http_status, 413);
    duet_strbuf_free(&sb);
}
