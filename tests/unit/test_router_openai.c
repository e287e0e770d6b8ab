/*
 * OpenAI API layer tests: every validation rule (good and bad bodies, with the error's status,
 * code, param and JSON shape), the chat template's exact ids (and that special-token text typed
 * by a user stays text), response objects and SSE sequences parsed back as a client would, the
 * streaming text state (stop strings across tokens, UTF-8 split across byte tokens, EOS, length),
 * and a deterministic fuzz of the parser.
 */
#define _GNU_SOURCE /* memmem */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/strbuf.h"
#include "router/api/openai.h"

static const char *const specials[] = {"<|bos|>", "<|eos|>"};
enum { BOS = 256, EOS = 257 };

static const duet_oai_limits_t lim = {
    .model_name = "duet-demo",
    .max_tokens_default = 16,
    .max_tokens_cap = 512,
    .max_body_bytes = 1 << 16,
    .vocab_size = 258,
    .max_prompt_tokens = 0,
    .max_context = 1024,
    .max_messages = 0,
};

static duet_tokenizer_t *byte_tok(void)
{
    duet_tokenizer_t *tok = NULL;
    cr_assert_eq(duet_tokenizer_create_byte(specials, 2, &tok), DUET_OK, "%s", duet_error_last());
    return tok;
}

static duet_status_t parse(duet_oai_endpoint_t ep, const char *body, duet_oai_request_t *req,
                           duet_oai_error_t *err)
{
    return duet_oai_request_parse(&lim, ep, body, strlen(body), req, err);
}

/* The error serialises to {"error":{message,type,param,code}} with exactly those four keys. */
static void check_error_json(const duet_oai_error_t *err)
{
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    cr_assert_eq(duet_oai_error_json(err, &sb), DUET_OK);
    json_error_t je;
    json_t *root = json_loads(sb.data, 0, &je);
    cr_assert_not_null(root, "bad error JSON: %s (%s)", sb.data, je.text);
    json_t *e = json_object_get(root, "error");
    cr_assert(json_is_object(e), "%s", sb.data);
    cr_assert_eq(json_object_size(e), 4, "%s", sb.data);
    cr_assert(json_is_string(json_object_get(e, "message")), "%s", sb.data);
    cr_assert(json_string_length(json_object_get(e, "message")) > 0, "%s", sb.data);
    cr_assert(json_is_string(json_object_get(e, "type")), "%s", sb.data);
    json_t *param = json_object_get(e, "param"), *code = json_object_get(e, "code");
    cr_assert(json_is_string(param) || json_is_null(param), "%s", sb.data);
    cr_assert(json_is_string(code) || json_is_null(code), "%s", sb.data);
    if (err->param[0] != '\0')
        cr_assert_str_eq(json_string_value(param), err->param);
    else
        cr_assert(json_is_null(param));
    json_decref(root);
    duet_strbuf_free(&sb);
}

/* ---------------------------------------------------------------- good bodies */

Test(router_openai, completion_fields, .timeout = 10)
{
    duet_oai_request_t r;
    duet_oai_error_t e;
    const char *body =
        "{\"model\":\"duet-demo\",\"prompt\":\"Once upon\",\"max_tokens\":32,\"temperature\":0,"
        "\"top_p\":0.5,\"seed\":-7,\"stop\":[\"\\n\\n\",\"END\"],\"ignore_eos\":true,\"stream\":"
        "true,"
        "\"stream_options\":{\"include_usage\":true},\"n\":1,\"user\":\"u1\",\"frequency_penalty\":"
        "0,"
        "\"presence_penalty\":0.0,\"best_of\":1,\"echo\":false,\"logprobs\":null,\"top_k\":-1,"
        "\"suffix\":\"\",\"logit_bias\":{}}";
    cr_assert_eq(parse(DUET_OAI_ENDPOINT_COMPLETIONS, body, &r, &e), DUET_OK, "%s", e.message);
    cr_assert_eq(r.endpoint, DUET_OAI_ENDPOINT_COMPLETIONS);
    cr_assert_str_eq(r.prompt, "Once upon");
    cr_assert_eq(r.prompt_len, 9);
    cr_assert_null(r.prompt_ids);
    cr_assert_eq(r.max_tokens, 32);
    cr_assert_eq(r.temperature, 0.0);
    cr_assert_eq(r.top_p, 0.5);
    cr_assert_eq(r.top_k, 0);
    cr_assert(r.has_seed);
    cr_assert_eq(r.seed, -7);
    cr_assert_eq(r.n_stop, 2);
    cr_assert_str_eq(r.stop[0], "\n\n");
    cr_assert_eq(r.stop_len[1], 3);
    cr_assert(r.ignore_eos && r.stream && r.include_usage);
    cr_assert_str_eq(r.user, "u1");
    cr_assert_eq(r.n, 1);
    duet_oai_request_free(&r);
    /* n > 1 with best_of = n */
    cr_assert_eq(parse(DUET_OAI_ENDPOINT_COMPLETIONS,
                       "{\"model\":\"duet-demo\",\"prompt\":\"x\",\"n\":16,\"best_of\":16}", &r,
                       &e),
                 DUET_OK, "%s", e.message);
    cr_assert_eq(r.n, 16);
    cr_assert_eq(r.best_of, 16);
    duet_oai_request_free(&r);
    /* best_of > n: n returned of best_of run (not streamed); chat has no best_of */
    cr_assert_eq(parse(DUET_OAI_ENDPOINT_COMPLETIONS,
                       "{\"model\":\"duet-demo\",\"prompt\":\"x\",\"n\":2,\"best_of\":5}", &r, &e),
                 DUET_OK, "%s", e.message);
    cr_assert(r.n == 2 && r.best_of == 5);
    duet_oai_request_free(&r);

    /* Defaults. */
    cr_assert_eq(
        parse(DUET_OAI_ENDPOINT_COMPLETIONS, "{\"model\":\"duet-demo\",\"prompt\":\"x\"}", &r, &e),
        DUET_OK);
    cr_assert_eq(r.max_tokens, lim.max_tokens_default);
    cr_assert_eq(r.temperature, 1.0);
    cr_assert_eq(r.top_p, 1.0);
    cr_assert(!r.has_seed && !r.stream && !r.include_usage && !r.ignore_eos);
    cr_assert_eq(r.n_stop, 0);
    cr_assert_null(r.user);
    duet_oai_request_free(&r);

    /* Nulls mean absent. */
    cr_assert_eq(parse(DUET_OAI_ENDPOINT_COMPLETIONS,
                       "{\"model\":\"duet-demo\",\"prompt\":\"x\",\"max_tokens\":null,"
                       "\"temperature\":null,\"stop\":null,\"stream_options\":null,\"n\":null}",
                       &r, &e),
                 DUET_OK, "%s", e.message);
    cr_assert_eq(r.max_tokens, lim.max_tokens_default);
    duet_oai_request_free(&r);
}

Test(router_openai, completion_prompt_forms, .timeout = 10)
{
    duet_oai_request_t r;
    duet_oai_error_t e;
    cr_assert_eq(parse(DUET_OAI_ENDPOINT_COMPLETIONS,
                       "{\"model\":\"duet-demo\",\"prompt\":[256,72,105]}", &r, &e),
                 DUET_OK, "%s", e.message);
    cr_assert_null(r.prompt);
    cr_assert_eq(r.n_prompt_ids, 3);
    cr_assert_eq(r.prompt_ids[0], 256);
    cr_assert_eq(r.prompt_ids[2], 105);
    duet_oai_request_free(&r);

    cr_assert_eq(parse(DUET_OAI_ENDPOINT_COMPLETIONS,
                       "{\"model\":\"duet-demo\",\"prompt\":[\"only one\"]}", &r, &e),
                 DUET_OK);
    cr_assert_str_eq(r.prompt, "only one");
    duet_oai_request_free(&r);

    cr_assert_eq(parse(DUET_OAI_ENDPOINT_COMPLETIONS,
                       "{\"model\":\"duet-demo\",\"prompt\":[[1,2]]}", &r, &e),
                 DUET_OK);
    cr_assert_eq(r.n_prompt_ids, 2);
    duet_oai_request_free(&r);

    /* NUL characters in strings are refused by the JSON reader (a 400, not a truncation). */
    cr_assert_eq(parse(DUET_OAI_ENDPOINT_COMPLETIONS,
                       "{\"model\":\"duet-demo\",\"prompt\":\"a\\u0000b\"}", &r, &e),
                 DUET_ERR_INVALID);
    cr_assert_eq(e.http_status, 400);
    check_error_json(&e);
}

Test(router_openai, chat_fields_and_content_parts, .timeout = 10)
{
    duet_oai_request_t r;
    duet_oai_error_t e;
    const char *body =
        "{\"model\":\"duet-demo\",\"messages\":["
        "{\"role\":\"developer\",\"content\":\"Be brief.\"},"
        "{\"role\":\"user\",\"name\":\"bob\",\"content\":[{\"type\":\"text\",\"text\":\"Hello, \"},"
        "{\"type\":\"text\",\"text\":\"world\"}]},"
        "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[]},"
        "{\"role\":\"system\",\"content\":[]}],"
        "\"max_tokens\":100,\"max_completion_tokens\":7,\"stop\":\"bye\",\"stream\":true,"
        "\"stream_options\":{\"include_usage\":false},\"logprobs\":false,\"tool_choice\":\"none\","
        "\"tools\":[],\"response_format\":{\"type\":\"text\"},\"modalities\":[\"text\"],"
        "\"store\":false,\"metadata\":{\"k\":\"v\"},\"parallel_tool_calls\":true,"
        "\"top_logprobs\":0}";
    cr_assert_eq(parse(DUET_OAI_ENDPOINT_CHAT, body, &r, &e), DUET_OK, "%s", e.message);
    cr_assert_eq(r.n_messages, 4);
    cr_assert_eq(r.messages[0].role, DUET_OAI_ROLE_SYSTEM);
    cr_assert_str_eq(r.messages[0].content, "Be brief.");
    cr_assert_eq(r.messages[1].role, DUET_OAI_ROLE_USER);
    cr_assert_str_eq(r.messages[1].content, "Hello, world");
    cr_assert_eq(r.messages[1].content_len, 12);
    cr_assert_eq(r.messages[2].role, DUET_OAI_ROLE_ASSISTANT);
    cr_assert_str_eq(r.messages[2].content, "");
    cr_assert_str_eq(r.messages[3].content, "");
    cr_assert_eq(r.max_tokens, 7, "max_completion_tokens wins over max_tokens");
    cr_assert_eq(r.n_stop, 1);
    cr_assert_str_eq(r.stop[0], "bye");
    cr_assert(r.stream && !r.include_usage);
    cr_assert_null(r.response_format, "text is free output");
    duet_oai_request_free(&r);
    const char *jo = "{\"model\":\"duet-demo\",\"messages\":[{\"role\":\"user\",\"content\":"
                     "\"hi\"}],\"response_format\":{\"type\":\"json_object\"}}";
    cr_assert_eq(parse(DUET_OAI_ENDPOINT_CHAT, jo, &r, &e), DUET_OK, "%s", e.message);
    cr_assert_str_eq(r.response_format, "json_object");
    duet_oai_request_free(&r);
    const char *js =
        "{\"model\":\"duet-demo\",\"messages\":[{\"role\":\"user\",\"content\":"
        "\"hi\"}],\"response_format\":{\"type\":\"json_schema\",\"json_schema\":"
        "{\"name\":\"p\",\"strict\":true,\"schema\":{\"type\":\"object\",\"properties\":"
        "{\"b\":{\"type\":\"integer\"},\"a\":{\"enum\":[\"x\"]}},\"required\":[\"b\"]}}}}";
    cr_assert_eq(parse(DUET_OAI_ENDPOINT_CHAT, js, &r, &e), DUET_OK, "%s", e.message);
    cr_assert_str_eq(r.response_format, "json_schema");
    /* the schema travels compact, its properties in the client's order */
    cr_assert_str_eq(r.json_schema, "{\"type\":\"object\",\"properties\":{\"b\":{\"type\":"
                                    "\"integer\"},\"a\":{\"enum\":[\"x\"]}},\"required\":[\"b\"]}");
    duet_oai_request_free(&r);
}

/* ---------------------------------------------------------------- bad bodies */

typedef struct {
    duet_oai_endpoint_t ep;
    const char *body;
    int status;
    const char *code;   /* NULL = null */
    const char *param;  /* NULL = null */
    const char *needle; /* a substring the message must hold (NULL = none) */
} bad_case_t;

#define C   DUET_OAI_ENDPOINT_COMPLETIONS
#define H   DUET_OAI_ENDPOINT_CHAT
#define M   "\"model\":\"duet-demo\","
#define MSG "\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]"

static const bad_case_t bad_cases[] = {
    /* body */
    {C, "", 400, NULL, NULL, "parse"},
    {C, "not json", 400, NULL, NULL, "parse"},
    {C, "[1,2]", 400, NULL, NULL, "JSON object"},
    {C, "{\"model\":\"duet-demo\",\"model\":\"duet-demo\",\"prompt\":\"x\"}", 400, NULL, NULL,
     "duplicate"},
    {C, "{" M "\"prompt\":\"x\",\"bogus\":1}", 400, "unrecognized_argument", "bogus", "bogus"},
    {C, "{" M MSG "}", 400, "unrecognized_argument", "messages", NULL},
    {H, "{" M MSG ",\"prompt\":\"x\"}", 400, "unrecognized_argument", "prompt", NULL},
    /* model */
    {C, "{\"prompt\":\"x\"}", 400, "missing_required_parameter", "model", "model"},
    {C, "{\"model\":null,\"prompt\":\"x\"}", 400, "missing_required_parameter", "model", NULL},
    {C, "{\"model\":7,\"prompt\":\"x\"}", 400, "invalid_type", "model", NULL},
    {C, "{\"model\":\"gpt-4\",\"prompt\":\"x\"}", 404, "model_not_found", "model", "gpt-4"},
    {H, "{\"model\":\"duet-demo2\"," MSG "}", 404, "model_not_found", "model", NULL},
    /* prompt */
    {C, "{" M "\"max_tokens\":3}", 400, "missing_required_parameter", "prompt", NULL},
    {C, "{" M "\"prompt\":5}", 400, "invalid_type", "prompt", NULL},
    {C, "{" M "\"prompt\":[]}", 400, "invalid_value", "prompt", NULL},
    {C, "{" M "\"prompt\":[\"a\",\"b\"]}", 400, "unsupported_value", "prompt", "Batched"},
    {C, "{" M "\"prompt\":[[1],[2]]}", 400, "unsupported_value", "prompt", NULL},
    {C, "{" M "\"prompt\":[1,\"a\"]}", 400, "invalid_type", "prompt[1]", NULL},
    {C, "{" M "\"prompt\":[1,258]}", 400, "invalid_value", "prompt[1]", "258"},
    {C, "{" M "\"prompt\":[-1]}", 400, "invalid_value", "prompt[0]", NULL},
    {C, "{" M "\"prompt\":[[]]}", 400, "invalid_value", "prompt[0]", NULL},
    {C, "{" M "\"prompt\":[{}]}", 400, "invalid_type", "prompt[0]", NULL},
    /* messages */
    {H, "{" M "\"max_tokens\":3}", 400, "missing_required_parameter", "messages", NULL},
    {H, "{" M "\"messages\":[]}", 400, "invalid_value", "messages", NULL},
    {H, "{" M "\"messages\":{}}", 400, "invalid_type", "messages", NULL},
    {H, "{" M "\"messages\":[\"hi\"]}", 400, "invalid_type", "messages[0]", NULL},
    {H, "{" M "\"messages\":[{\"content\":\"hi\"}]}", 400, "missing_required_parameter",
     "messages[0].role", NULL},
    {H,
     "{" M "\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"tool\",\"content\":"
     "\"x\"}]}",
     400, "invalid_value", "messages[1].role", "'tool'"},
    {H, "{" M "\"messages\":[{\"role\":\"robot\",\"content\":\"x\"}]}", 400, "invalid_value",
     "messages[0].role", "robot"},
    {H, "{" M "\"messages\":[{\"role\":3,\"content\":\"x\"}]}", 400, "invalid_type",
     "messages[0].role", NULL},
    {H, "{" M "\"messages\":[{\"role\":\"user\"}]}", 400, "missing_required_parameter",
     "messages[0].content", NULL},
    {H, "{" M "\"messages\":[{\"role\":\"user\",\"content\":5}]}", 400, "invalid_type",
     "messages[0].content", NULL},
    {H,
     "{" M "\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},"
     "{\"type\":\"image_url\",\"image_url\":{\"url\":\"http://x\"}}]}]}",
     400, "unsupported_value", "messages[0].content[1].type", "image_url"},
    {H, "{" M "\"messages\":[{\"role\":\"user\",\"content\":[{\"text\":\"a\"}]}]}", 400,
     "missing_required_parameter", "messages[0].content[0].type", NULL},
    {H, "{" M "\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\"}]}]}", 400,
     "missing_required_parameter", "messages[0].content[0].text", NULL},
    {H, "{" M "\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":1}]}]}",
     400, "invalid_type", "messages[0].content[0].text", NULL},
    {H, "{" M "\"messages\":[{\"role\":\"user\",\"content\":[\"a\"]}]}", 400, "invalid_type",
     "messages[0].content[0]", NULL},
    {H, "{" M "\"messages\":[{\"role\":\"user\",\"content\":\"a\",\"tool_call_id\":\"t\"}]}", 400,
     "unsupported_parameter", "messages[0].tool_call_id", NULL},
    {H, "{" M "\"messages\":[{\"role\":\"user\",\"content\":\"a\",\"mood\":\"x\"}]}", 400,
     "unrecognized_argument", "messages[0].mood", NULL},
    /* max tokens */
    {C, "{" M "\"prompt\":\"x\",\"max_tokens\":0}", 400, "invalid_value", "max_tokens", NULL},
    {C, "{" M "\"prompt\":\"x\",\"max_tokens\":513}", 400, "invalid_value", "max_tokens", "512"},
    {C, "{" M "\"prompt\":\"x\",\"max_tokens\":1.5}", 400, "invalid_type", "max_tokens", NULL},
    {C, "{" M "\"prompt\":\"x\",\"max_tokens\":\"5\"}", 400, "invalid_type", "max_tokens", NULL},
    {C, "{" M "\"prompt\":\"x\",\"max_completion_tokens\":5}", 400, "unrecognized_argument",
     "max_completion_tokens", NULL},
    {H, "{" M MSG ",\"max_completion_tokens\":-1}", 400, "invalid_value", "max_completion_tokens",
     NULL},
    {H, "{" M MSG ",\"max_tokens\":0,\"max_completion_tokens\":5}", 400, "invalid_value",
     "max_tokens", NULL},
    /* sampling */
    {C, "{" M "\"prompt\":\"x\",\"temperature\":2.5}", 400, "invalid_value", "temperature", NULL},
    {C, "{" M "\"prompt\":\"x\",\"temperature\":-0.1}", 400, "invalid_value", "temperature", NULL},
    {C, "{" M "\"prompt\":\"x\",\"temperature\":\"hot\"}", 400, "invalid_type", "temperature",
     NULL},
    {C, "{" M "\"prompt\":\"x\",\"top_p\":0}", 400, "invalid_value", "top_p", NULL},
    {C, "{" M "\"prompt\":\"x\",\"top_p\":1.01}", 400, "invalid_value", "top_p", NULL},
    {C, "{" M "\"prompt\":\"x\",\"top_k\":-2}", 400, "invalid_value", "top_k", NULL},
    {C, "{" M "\"prompt\":\"x\",\"seed\":1.0}", 400, "invalid_type", "seed", NULL},
    {C, "{" M "\"prompt\":\"x\",\"ignore_eos\":1}", 400, "invalid_type", "ignore_eos", NULL},
    {C, "{" M "\"prompt\":\"x\",\"skip_special_tokens\":\"no\"}", 400, "invalid_type",
     "skip_special_tokens", NULL},
    {H, "{" M MSG ",\"skip_special_tokens\":0}", 400, "invalid_type", "skip_special_tokens", NULL},
    {C, "{" M "\"prompt\":\"x\",\"user\":5}", 400, "invalid_type", "user", NULL},
    /* n */
    {C, "{" M "\"prompt\":\"x\",\"n\":17}", 400, "invalid_value", "n", "[1, 16]"},
    {H, "{" M MSG ",\"n\":0}", 400, "invalid_value", "n", NULL},
    {H, "{" M MSG ",\"n\":2.5}", 400, "invalid_type", "n", NULL},
    {C, "{" M "\"prompt\":\"x\",\"n\":3,\"best_of\":2}", 400, "invalid_value", "best_of", NULL},
    {C, "{" M "\"prompt\":\"x\",\"best_of\":17}", 400, "invalid_value", "best_of", NULL},
    {C, "{" M "\"prompt\":\"x\",\"best_of\":\"2\"}", 400, "invalid_type", "best_of", NULL},
    /* stop */
    {C, "{" M "\"prompt\":\"x\",\"stop\":\"\"}", 400, "invalid_value", "stop", NULL},
    {C, "{" M "\"prompt\":\"x\",\"stop\":[\"a\",\"\"]}", 400, "invalid_value", "stop[1]", NULL},
    {C, "{" M "\"prompt\":\"x\",\"stop\":[\"a\",\"b\",\"c\",\"d\",\"e\"]}", 400, "invalid_value",
     "stop", NULL},
    {C, "{" M "\"prompt\":\"x\",\"stop\":[1]}", 400, "invalid_type", "stop[0]", NULL},
    {C, "{" M "\"prompt\":\"x\",\"stop\":5}", 400, "invalid_type", "stop", NULL},
    /* stream */
    {C, "{" M "\"prompt\":\"x\",\"stream\":\"yes\"}", 400, "invalid_type", "stream", NULL},
    {C, "{" M "\"prompt\":\"x\",\"stream_options\":{\"include_usage\":true}}", 400, "invalid_value",
     "stream_options", "only allowed when 'stream'"},
    {C, "{" M "\"prompt\":\"x\",\"stream\":false,\"stream_options\":{}}", 400, "invalid_value",
     "stream_options", NULL},
    {H, "{" M MSG ",\"stream\":true,\"stream_options\":{\"include_usage\":1}}", 400, "invalid_type",
     "stream_options.include_usage", NULL},
    {H, "{" M MSG ",\"stream\":true,\"stream_options\":{\"x\":true}}", 400, "unrecognized_argument",
     "stream_options.x", NULL},
    {H, "{" M MSG ",\"stream\":true,\"stream_options\":[]}", 400, "invalid_type", "stream_options",
     NULL},
    /* unsupported */
    /* logprobs and logit processing (router/api/openai_logprobs.c) */
    {H, "{" M MSG ",\"logprobs\":1}", 400, "invalid_type", "logprobs", NULL},
    {C, "{" M "\"prompt\":\"x\",\"logprobs\":6}", 400, "invalid_value", "logprobs", NULL},
    {C, "{" M "\"prompt\":\"x\",\"logprobs\":true}", 400, "invalid_type", "logprobs", NULL},
    {H, "{" M MSG ",\"top_logprobs\":3}", 400, "invalid_value", "top_logprobs", "requires"},
    {H, "{" M MSG ",\"logprobs\":true,\"top_logprobs\":21}", 400, "invalid_value", "top_logprobs",
     NULL},
    {H, "{" M MSG ",\"logit_bias\":{\"50256\":-100}}", 400, "invalid_value", "logit_bias.50256",
     NULL},
    {H, "{" M MSG ",\"logit_bias\":{\"-1\":1}}", 400, "invalid_value", "logit_bias.-1", NULL},
    {H, "{" M MSG ",\"logit_bias\":{\"5\":100.5}}", 400, "invalid_value", "logit_bias.5", NULL},
    {H, "{" M MSG ",\"logit_bias\":{\"5\":\"1\"}}", 400, "invalid_type", "logit_bias.5", NULL},
    {H, "{" M MSG ",\"logit_bias\":[]}", 400, "invalid_type", "logit_bias", NULL},
    /* tools: malformed, then well formed for a model without a tool format (duet's template) */
    {H, "{" M MSG ",\"tools\":[{\"type\":\"function\"}]}", 400, "missing_required_parameter",
     "tools[0].function", NULL},
    {H, "{" M MSG ",\"tools\":\"f\"}", 400, "invalid_type", "tools", NULL},
    {H, "{" M MSG ",\"tools\":[5]}", 400, "invalid_type", "tools[0]", NULL},
    {H, "{" M MSG ",\"tools\":[{\"type\":\"retrieval\",\"function\":{\"name\":\"f\"}}]}", 400,
     "invalid_value", "tools[0].type", NULL},
    {H, "{" M MSG ",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"a b\"}}]}", 400,
     "invalid_value", "tools[0].function.name", NULL},
    {H, "{" M MSG ",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"\"}}]}", 400,
     "invalid_value", "tools[0].function.name", NULL},
    {H,
     "{" M MSG ",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":"
     "\"x1234567890123456789012345678901234567890123456789012345678901234\"}}]}",
     400, "invalid_value", "tools[0].function.name", NULL},
    {H,
     "{" M MSG ",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\","
     "\"parameters\":\"x\"}}]}",
     400, "invalid_type", "tools[0].function.parameters", NULL},
    {H,
     "{" M MSG ",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\","
     "\"description\":5}}]}",
     400, "invalid_type", "tools[0].function.description", NULL},
    {H,
     "{" M MSG ",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\","
     "\"strict\":\"yes\"}}]}",
     400, "invalid_type", "tools[0].function.strict", NULL},
    {H, "{" M MSG ",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"x\":1}}]}",
     400, "unrecognized_argument", "tools[0].function", NULL},
    {H, "{" M MSG ",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"},\"x\":1}]}",
     400, "unrecognized_argument", "tools[0]", NULL},
    {H, "{" M MSG ",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}]}", 400,
     "unsupported_parameter", "tools", "duet's format"},
    {H,
     "{" M MSG ",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],"
     "\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"g\"}}}",
     400, "invalid_value", "tool_choice", "'g'"},
    {H,
     "{" M MSG ",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],"
     "\"tool_choice\":{\"type\":\"function\"}}",
     400, "invalid_value", "tool_choice", NULL},
    {H, "{" M MSG ",\"tool_choice\":5}", 400, "invalid_type", "tool_choice", NULL},
    {H, "{" M MSG ",\"tool_choice\":\"sometimes\"}", 400, "invalid_value", "tool_choice", NULL},
    {H,
     "{" M MSG ",\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"f\"},"
     "\"x\":1}}",
     400, "unrecognized_argument", "tool_choice", NULL},
    {H, "{" M MSG ",\"frequency_penalty\":2.5}", 400, "invalid_value", "frequency_penalty", NULL},
    {C, "{" M "\"prompt\":\"x\",\"presence_penalty\":-2.01}", 400, "invalid_value",
     "presence_penalty", NULL},
    {C, "{" M "\"prompt\":\"x\",\"presence_penalty\":\"0\"}", 400, "invalid_type",
     "presence_penalty", NULL},
    {C, "{" M "\"prompt\":\"x\",\"repetition_penalty\":0}", 400, "invalid_value",
     "repetition_penalty", NULL},
    {C, "{" M "\"prompt\":\"x\",\"max_tokens\":4,\"min_tokens\":5}", 400, "invalid_value",
     "min_tokens", NULL},
    {C, "{" M "\"prompt\":\"x\",\"max_tokens\":0}", 400, "invalid_value", "max_tokens", "echo"},
    {C, "{" M "\"prompt\":\"x\",\"echo\":1}", 400, "invalid_type", "echo", NULL},
    {C, "{" M "\"prompt\":\"x\",\"stop_token_ids\":[3,258]}", 400, "invalid_value",
     "stop_token_ids[1]", NULL},
    {C, "{" M "\"prompt\":\"x\",\"stop_token_ids\":[\"3\"]}", 400, "invalid_type",
     "stop_token_ids[0]", NULL},
    {C, "{" M "\"prompt\":\"x\",\"stop_token_ids\":[1,2,3,4,5,6,7,8,9]}", 400, "invalid_value",
     "stop_token_ids", NULL},
    {H, "{" M MSG ",\"functions\":[{}]}", 400, "unsupported_parameter", "functions", NULL},
    {H, "{" M MSG ",\"function_call\":\"auto\"}", 400, "unsupported_parameter", "function_call",
     NULL},
    {H, "{" M MSG ",\"tool_choice\":\"required\"}", 400, "invalid_value", "tool_choice",
     "no 'tools'"},
    {H, "{" M MSG ",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{}}}", 400,
     "invalid_value", "response_format.json_schema.name", NULL},
    {H, "{" M MSG ",\"response_format\":{\"type\":\"json_schema\"}}", 400,
     "missing_required_parameter", "response_format.json_schema", NULL},
    {H,
     "{" M MSG ",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"n\"}}}",
     400, "missing_required_parameter", "response_format.json_schema.schema", NULL},
    {H,
     "{" M MSG ",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"n\","
     "\"schema\":{\"type\":\"string\",\"format\":\"uri\"}}}}",
     400, "unsupported_value", "response_format.json_schema.schema", "'format'"},
    {H,
     "{" M MSG ",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"n\","
     "\"schema\":{},\"other\":1}}}",
     400, "unrecognized_argument", "response_format.json_schema", "other"},
    {H,
     "{" M MSG ",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"n\","
     "\"schema\":{},\"strict\":\"yes\"}}}",
     400, "invalid_type", "response_format.json_schema.strict", NULL},
    {H,
     "{" M MSG ",\"ignore_eos\":true,\"response_format\":{\"type\":\"json_schema\","
     "\"json_schema\":{\"name\":\"n\",\"schema\":{}}}}",
     400, "unsupported_value", "ignore_eos", "JSON"},
    {H, "{" M MSG ",\"response_format\":{\"type\":\"yaml\"}}", 400, "invalid_value",
     "response_format.type", NULL},
    {H, "{" M MSG ",\"response_format\":{}}", 400, "missing_required_parameter",
     "response_format.type", NULL},
    {H, "{" M MSG ",\"response_format\":\"json_object\"}", 400, "invalid_type", "response_format",
     NULL},
    {H, "{" M MSG ",\"response_format\":{\"type\":\"json_object\",\"strict\":true}}", 400,
     "unrecognized_argument", "response_format", "strict"},
    {H, "{" M MSG ",\"ignore_eos\":true,\"response_format\":{\"type\":\"json_object\"}}", 400,
     "unsupported_value", "ignore_eos", "JSON"},
    {C, "{" M "\"prompt\":\"x\",\"response_format\":{\"type\":\"json_object\"}}", 400,
     "unrecognized_argument", "response_format", NULL},
    {H, "{" M MSG ",\"modalities\":[\"text\",\"audio\"]}", 400, "unsupported_parameter",
     "modalities", NULL},
    {H, "{" M MSG ",\"audio\":{}}", 400, "unsupported_parameter", "audio", NULL},
    {C, "{" M "\"prompt\":\"x\",\"presence_penalty\":\"0\"}", 400, "invalid_type",
     "presence_penalty", NULL},
    {C, "{" M "\"prompt\":\"x\",\"best_of\":2,\"stream\":true}", 400, "invalid_value", "best_of",
     "cannot be streamed"},
    {C, "{" M "\"prompt\":\"x\",\"suffix\":\"end\"}", 400, "unsupported_parameter", "suffix", NULL},
};

/* Every bad case under api.strict; without it, the same but for unknown top-level fields (the
 * cases whose code is unrecognized_argument and whose param is a top-level name), which
 * unknown_fields_ignored covers. */
Test(router_openai, validation_errors, .timeout = 30)
{
    duet_oai_limits_t strict = lim;
    strict.strict = true;
    for (size_t k = 0; k < 2 * sizeof(bad_cases) / sizeof(bad_cases[0]); k++) {
        const size_t i = k / 2;
        const bad_case_t *c = &bad_cases[i];
        const bool top_unknown = c->code != NULL && strcmp(c->code, "unrecognized_argument") == 0 &&
                                 c->param != NULL && strpbrk(c->param, ".[") == NULL;
        if (k % 2 == 1 && top_unknown)
            continue;
        duet_oai_request_t r;
        duet_oai_error_t e;
        memset(&e, 0, sizeof(e));
        duet_status_t st = duet_oai_request_parse(k % 2 == 0 ? &strict : &lim, c->ep, c->body,
                                                  strlen(c->body), &r, &e);
        cr_assert_neq(st, DUET_OK, "case %zu accepted: %s", i, c->body);
        cr_assert_eq(e.http_status, c->status, "case %zu (%s): status %d: %s", i, c->body,
                     e.http_status, e.message);
        cr_assert_str_eq(e.type, "invalid_request_error", "case %zu", i);
        cr_assert_str_eq(e.code, c->code != NULL ? c->code : "", "case %zu (%s): code %s: %s", i,
                         c->body, e.code, e.message);
        cr_assert_str_eq(e.param, c->param != NULL ? c->param : "", "case %zu (%s): param %s: %s",
                         i, c->body, e.param, e.message);
        if (c->needle != NULL)
            cr_assert(strstr(e.message, c->needle) != NULL, "case %zu: \"%s\" lacks \"%s\"", i,
                      e.message, c->needle);
        /* The request is zeroed on failure, and freeing it is harmless. */
        cr_assert_null(r.prompt);
        cr_assert_null(r.messages);
        duet_oai_request_free(&r);
        check_error_json(&e);
    }
}

/* With a Jinja template, the history may hold tool calls and tool results; their shapes are
 * checked, and the template reads the request's own JSON. With duet's format they stay a 400. */
Test(router_openai, tool_history_with_jinja_template, .timeout = 10)
{
    duet_oai_limits_t jl = lim;
    jl.jinja_template = true;
    static const char ok[] =
        "{\"model\":\"duet-demo\",\"messages\":[{\"role\":\"user\",\"content\":\"w?\"},"
        "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"c1\",\"type\":"
        "\"function\",\"function\":{\"name\":\"get\",\"arguments\":\"{\\\"a\\\": 1}\"}}]},"
        "{\"role\":\"tool\",\"tool_call_id\":\"c1\",\"name\":\"get\",\"content\":\"7\"}]}";
    duet_oai_request_t r;
    duet_oai_error_t e;
    memset(&e, 0, sizeof(e));
    cr_assert_eq(duet_oai_request_parse(&jl, DUET_OAI_ENDPOINT_CHAT, ok, strlen(ok), &r, &e),
                 DUET_OK, "%s", e.message);
    cr_assert_eq(r.n_messages, 3);
    cr_assert_not_null(r.messages_json);

    /* The template sees the calls and the result as they came in. */
    duet_tokenizer_t *tok = byte_tok();
    const char *src = "{% for m in messages %}{{ m.role }}"
                      "{% for c in m.tool_calls or [] %}({{ c.id }}:{{ c.function.name }} "
                      "{{ c.function.arguments }}){% endfor %}"
                      "{% if m.role == 'tool' %}[{{ m.tool_call_id }}={{ m.content }}]{% endif %};"
                      "{% endfor %}{% if add_generation_prompt %}<|bos|>{% endif %}";
    duet_oai_template_t *t = NULL;
    cr_assert_eq(duet_oai_template_create_jinja(src, strlen(src), "t", NULL, tok, &t), DUET_OK,
                 "%s", duet_error_last());
    uint32_t *ids = NULL;
    size_t n = 0;
    cr_assert_eq(duet_oai_request_tokens(&r, &jl, t, tok, &ids, &n, &e), DUET_OK, "%s", e.message);
    const char want[] = "user;assistant(c1:get {\"a\": 1});tool[c1=7];";
    cr_assert_eq(n, strlen(want) + 1);
    for (size_t i = 0; i < n - 1; i++)
        cr_assert_eq(ids[i], (uint32_t)(unsigned char)want[i], "id %zu", i);
    cr_assert_eq(ids[n - 1], BOS);
    free(ids);
    duet_oai_request_free(&r);

    /* A template that raises makes a 400 in its own words. */
    duet_oai_template_t *strict = NULL;
    const char *raise = "{% if messages|length > 1 %}{{ raise_exception('one message only') }}"
                        "{% endif %}x";
    cr_assert_eq(duet_oai_template_create_jinja(raise, strlen(raise), "s", NULL, tok, &strict),
                 DUET_OK);
    cr_assert_eq(duet_oai_request_parse(&jl, DUET_OAI_ENDPOINT_CHAT, ok, strlen(ok), &r, &e),
                 DUET_OK);
    cr_assert_eq(duet_oai_request_tokens(&r, &jl, strict, tok, &ids, &n, &e), DUET_ERR_INVALID);
    cr_assert_eq(e.http_status, 400);
    cr_assert(strstr(e.message, "cannot render these messages: one message only") != NULL, "%s",
              e.message);
    check_error_json(&e);
    duet_oai_request_free(&r);
    duet_oai_template_destroy(strict);
    duet_oai_template_destroy(t);
    duet_tokenizer_destroy(tok);

    /* Shapes: each refused with the param that is wrong. */
#define TM "{\"model\":\"duet-demo\",\"messages\":["
    static const struct {
        const char *body, *code, *param;
    } bad[] = {
        {TM "{\"role\":\"tool\",\"content\":\"7\"}]}", "missing_required_parameter",
         "messages[0].tool_call_id"},
        {TM "{\"role\":\"tool\",\"tool_call_id\":\"c\"}]}", "missing_required_parameter",
         "messages[0].content"},
        {TM "{\"role\":\"tool\",\"tool_call_id\":5,\"content\":\"x\"}]}", "invalid_type",
         "messages[0].tool_call_id"},
        {TM "{\"role\":\"user\",\"content\":\"a\",\"tool_calls\":[{\"id\":\"c\"}]}]}",
         "unsupported_parameter", "messages[0].tool_calls"},
        {TM "{\"role\":\"assistant\",\"tool_calls\":{}}]}", "invalid_type",
         "messages[0].tool_calls"},
        {TM "{\"role\":\"assistant\",\"tool_calls\":[{\"type\":\"function\",\"function\":"
            "{\"name\":\"f\",\"arguments\":\"{}\"}}]}]}",
         "missing_required_parameter", "messages[0].tool_calls[0].id"},
        {TM "{\"role\":\"assistant\",\"tool_calls\":[{\"id\":\"c\",\"type\":\"code\",\"function\":"
            "{\"name\":\"f\",\"arguments\":\"{}\"}}]}]}",
         "invalid_value", "messages[0].tool_calls[0].type"},
        {TM "{\"role\":\"assistant\",\"tool_calls\":[{\"id\":\"c\",\"type\":\"function\"}]}]}",
         "missing_required_parameter", "messages[0].tool_calls[0].function"},
        {TM "{\"role\":\"assistant\",\"tool_calls\":[{\"id\":\"c\",\"type\":\"function\","
            "\"function\":{\"name\":\"f\",\"arguments\":{}}}]}]}",
         "invalid_type", "messages[0].tool_calls[0].function.arguments"},
        {TM "{\"role\":\"assistant\",\"tool_calls\":[{\"id\":\"c\",\"type\":\"function\","
            "\"function\":{\"name\":\"f\",\"arguments\":\"{}\",\"x\":1}}]}]}",
         "unrecognized_argument", "messages[0].tool_calls[0].function"},
        {TM "{\"role\":\"critic\",\"content\":\"x\"}]}", "invalid_value", "messages[0].role"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        memset(&e, 0, sizeof(e));
        cr_assert_neq(duet_oai_request_parse(&jl, DUET_OAI_ENDPOINT_CHAT, bad[i].body,
                                             strlen(bad[i].body), &r, &e),
                      DUET_OK, "accepted: %s", bad[i].body);
        cr_assert_eq(e.http_status, 400);
        cr_assert_str_eq(e.code, bad[i].code, "%s: %s", bad[i].body, e.message);
        cr_assert_str_eq(e.param, bad[i].param, "%s: %s", bad[i].body, e.message);
        cr_assert_null(r.messages_json);
        check_error_json(&e);
    }
#undef TM
    /* The same history with duet's own format: the tool message is a clear 400. */
    memset(&e, 0, sizeof(e));
    cr_assert_neq(parse(DUET_OAI_ENDPOINT_CHAT, ok, &r, &e), DUET_OK);
    cr_assert_eq(e.http_status, 400);
    cr_assert(strstr(e.message, "duet's format") != NULL, "%s", e.message);
}

Test(router_openai, unknown_fields_ignored, .timeout = 10)
{
    duet_oai_request_t r;
    duet_oai_error_t e;
    /* unknown fields, and a field of the other endpoint, are listed and otherwise ignored */
    const char *body = "{\"model\":\"duet-demo\",\"prompt\":\"x\",\"bogus\":{\"a\":[1]},"
                       "\"messages\":7,\"guided_json\":null,\"max_tokens\":3}";
    cr_assert_eq(parse(DUET_OAI_ENDPOINT_COMPLETIONS, body, &r, &e), DUET_OK, "%s", e.message);
    cr_assert_eq(r.max_tokens, 3);
    cr_assert_eq(json_array_size(r.ignored_fields), 3);
    const char *want[] = {"bogus", "messages", "guided_json"};
    for (size_t i = 0; i < 3; i++)
        cr_assert_str_eq(json_string_value(json_array_get(r.ignored_fields, i)), want[i]);
    duet_oai_request_free(&r);
    cr_assert_null(r.ignored_fields);
    /* known fields keep their checks: an unknown field does not hide a bad known one */
    cr_assert_neq(parse(DUET_OAI_ENDPOINT_CHAT,
                        "{\"model\":\"duet-demo\",\"messages\":[{\"role\":\"user\","
                        "\"content\":\"hi\"}],\"x_y\":1,\"audio\":{\"voice\":\"x\"}}",
                        &r, &e),
                  DUET_OK);
    cr_assert_str_eq(e.code, "unsupported_parameter");
    cr_assert_str_eq(e.param, "audio");
    /* a known request has no list */
    cr_assert_eq(
        parse(DUET_OAI_ENDPOINT_COMPLETIONS, "{\"model\":\"duet-demo\",\"prompt\":\"x\"}", &r, &e),
        DUET_OK);
    cr_assert_null(r.ignored_fields);
    duet_oai_request_free(&r);
    /* api.strict refuses the first unknown one */
    duet_oai_limits_t strict = lim;
    strict.strict = true;
    cr_assert_neq(
        duet_oai_request_parse(&strict, DUET_OAI_ENDPOINT_COMPLETIONS, body, strlen(body), &r, &e),
        DUET_OK);
    cr_assert_eq(e.http_status, 400);
    cr_assert_str_eq(e.code, "unrecognized_argument");
    cr_assert_str_eq(e.param, "bogus");
    check_error_json(&e);
}

Test(router_openai, body_too_large_is_413, .timeout = 10)
{
    duet_oai_limits_t small = lim;
    small.max_body_bytes = 16;
    const char *body = "{\"model\":\"duet-demo\",\"prompt\":\"a long prompt\"}";
    duet_oai_request_t r;
    duet_oai_error_t e;
    cr_assert_eq(
        duet_oai_request_parse(&small, DUET_OAI_ENDPOINT_COMPLETIONS, body, strlen(body), &r, &e),
        DUET_ERR_RANGE);
    cr_assert_eq(e.http_status, 413);
    check_error_json(&e);
}

Test(router_openai, messages_over_the_limit, .timeout = 10)
{
    duet_oai_limits_t l2 = lim;
    l2.max_messages = 2;
    const char *body =
        "{\"model\":\"duet-demo\",\"messages\":[{\"role\":\"user\",\"content\":\"a\"},"
        "{\"role\":\"user\",\"content\":\"b\"},{\"role\":\"user\",\"content\":\"c\"}]}";
    duet_oai_request_t r;
    duet_oai_error_t e;
    cr_assert_neq(duet_oai_request_parse(&l2, DUET_OAI_ENDPOINT_CHAT, body, strlen(body), &r, &e),
                  DUET_OK);
    cr_assert_eq(e.http_status, 400);
    cr_assert_str_eq(e.param, "messages");
}

Test(router_openai, error_json_escapes_and_truncates, .timeout = 10)
{
    duet_oai_error_t e;
    char big[2000];
    memset(big, 'a', sizeof(big));
    memcpy(big + 500, "\xc3\xa9\xc3\xa9\xc3\xa9", 6); /* é straddles the 512-byte cut */
    big[sizeof(big) - 1] = '\0';
    duet_oai_error_make(&e, 503, "server_error", NULL, "p\"q", "%s \"quoted\" \x01 \xff", big);
    cr_assert_eq(e.http_status, 503);
    cr_assert_lt(strlen(e.message), sizeof(e.message));
    check_error_json(&e);

    duet_oai_error_make(&e, 429, "rate_limit_error", "busy", NULL, "line\n\"two\"\\ \xff tail");
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    cr_assert_eq(duet_oai_error_json(&e, &sb), DUET_OK);
    cr_assert_str_eq(sb.data,
                     "{\"error\":{\"message\":\"line\\n\\\"two\\\"\\\\ \xef\xbf\xbd tail\","
                     "\"type\":\"rate_limit_error\",\"param\":null,\"code\":\"busy\"}}");
    duet_strbuf_free(&sb);
    duet_strbuf_init(&sb);
    cr_assert_eq(duet_oai_sse_error(&e, &sb), DUET_OK);
    cr_assert(strncmp(sb.data, "data: {\"error\":", 15) == 0);
    cr_assert_str_eq(sb.data + sb.len - 2, "\n\n");
    duet_strbuf_free(&sb);
}

/* ---------------------------------------------------------------- chat template */

static void expect_ids(const uint32_t *ids, size_t n, const uint32_t *want_head, size_t n_head,
                       const char *want_bytes)
{
    size_t nb = strlen(want_bytes);
    cr_assert_eq(n, n_head + nb, "got %zu ids, want %zu", n, n_head + nb);
    for (size_t i = 0; i < n_head; i++)
        cr_assert_eq(ids[i], want_head[i], "id %zu: %u != %u", i, ids[i], want_head[i]);
    for (size_t i = 0; i < nb; i++)
        cr_assert_eq(ids[n_head + i], (uint8_t)want_bytes[i], "id %zu: %u != '%c'", n_head + i,
                     ids[n_head + i], want_bytes[i]);
}

Test(router_openai, default_chat_template_bytes, .timeout = 10)
{
    duet_tokenizer_t *tok = byte_tok();
    duet_oai_template_t *t = NULL;
    cr_assert_eq(duet_oai_template_create(NULL, 0, "default", tok, &t), DUET_OK);
    const char *body =
        "{\"model\":\"duet-demo\",\"messages\":[{\"role\":\"developer\",\"content\":\"Be brief.\"},"
        "{\"role\":\"user\",\"content\":\"Hi <|eos|> there <|bos|>\"},"
        "{\"role\":\"assistant\",\"content\":\"Hello\"},{\"role\":\"user\",\"content\":\"2+2?\"}]}";
    duet_oai_request_t r;
    duet_oai_error_t e;
    cr_assert_eq(parse(DUET_OAI_ENDPOINT_CHAT, body, &r, &e), DUET_OK, "%s", e.message);
    uint32_t *ids = NULL;
    size_t n = 0;
    cr_assert_eq(duet_oai_request_tokens(&r, &lim, t, tok, &ids, &n, &e), DUET_OK, "%s", e.message);
    const uint32_t head[] = {BOS};
    expect_ids(ids, n, head, 1,
               "system: Be brief.\nuser: Hi <|eos|> there <|bos|>\nassistant: Hello\nuser: "
               "2+2?\nassistant: ");
    /* The user's "<|eos|>" / "<|bos|>" stayed text: one special id, the template's BOS. */
    size_t n_special = 0;
    for (size_t i = 0; i < n; i++)
        n_special += ids[i] >= 256;
    cr_assert_eq(n_special, 1);
    free(ids);

    /* Same through the lower-level call. */
    cr_assert_eq(duet_oai_chat_prompt(t, tok, r.messages, 1, &ids, &n), DUET_OK);
    expect_ids(ids, n, head, 1, "system: Be brief.\nassistant: ");
    free(ids);
    duet_oai_request_free(&r);
    duet_oai_template_destroy(t);
    duet_tokenizer_destroy(tok);
}

Test(router_openai, custom_template, .timeout = 10)
{
    duet_tokenizer_t *tok = byte_tok();
    duet_oai_template_t *t = NULL;
    const char *json = "{\"duet_chat_template\":1,\"prefix\":\"<|bos|>[\","
                       "\"message\":\"{role}={{{content}}}<|eos|>\",\"user\":\"U:{content}|\","
                       "\"generation_prompt\":\"]A:\",\"completion_prefix\":\"\"}";
    cr_assert_eq(duet_oai_template_create(json, strlen(json), "test.json", tok, &t), DUET_OK, "%s",
                 duet_error_last());
    duet_oai_message_t msgs[2] = {
        {DUET_OAI_ROLE_SYSTEM, (char *)"s<|eos|>", 8},
        {DUET_OAI_ROLE_USER, (char *)"u", 1},
    };
    uint32_t *ids = NULL;
    size_t n = 0;
    cr_assert_eq(duet_oai_chat_prompt(t, tok, msgs, 2, &ids, &n), DUET_OK);
    /* <bos> "[system={s<|eos|>}" <eos> "U:u|]A:" */
    const char *a = "[system={s<|eos|>}", *b = "U:u|]A:";
    cr_assert_eq(n, 1 + strlen(a) + 1 + strlen(b));
    cr_assert_eq(ids[0], BOS);
    for (size_t i = 0; i < strlen(a); i++)
        cr_assert_eq(ids[1 + i], (uint8_t)a[i]);
    cr_assert_eq(ids[1 + strlen(a)], EOS);
    for (size_t i = 0; i < strlen(b); i++)
        cr_assert_eq(ids[2 + strlen(a) + i], (uint8_t)b[i]);
    free(ids);

    /* completion_prefix "" = the text prompt alone. */
    cr_assert_eq(duet_oai_completion_prompt(t, tok, "<|bos|>x", 8, &ids, &n), DUET_OK);
    expect_ids(ids, n, NULL, 0, "<|bos|>x");
    free(ids);
    duet_oai_template_destroy(t);

    /* Refusals. */
    const char *bad[] = {
        "{\"duet_chat_template\":1,\"message\":\"{rol}\"}",
        "{\"duet_chat_template\":1,\"message\":\"{content\"}",
        "{\"duet_chat_template\":1,\"message\":\"a}b\"}",
        "{\"duet_chat_template\":1,\"prefix\":\"{content}\"}",
        "{\"duet_chat_template\":1,\"extra\":\"x\"}",
        "{\"duet_chat_template\":1,\"message\":5}",
        "{\"duet_chat_template\":2}",
        "{\"message\":\"x\"}",
        "{\"chat_template\":\"{% for m in messages %}{{ m.content }}{% endfor %}\"}",
        "[]",
        "{",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        t = NULL;
        cr_assert_neq(duet_oai_template_create(bad[i], strlen(bad[i]), "bad.json", tok, &t),
                      DUET_OK, "accepted %s", bad[i]);
        cr_assert_null(t);
        cr_assert(strstr(duet_error_last(), "bad.json") != NULL, "%s", duet_error_last());
    }
    cr_assert_eq(duet_oai_template_create(bad[8], strlen(bad[8]), "bad.json", tok, &t),
                 DUET_ERR_UNSUPPORTED);
    cr_assert(strstr(duet_error_last(), "Jinja") != NULL);
    duet_tokenizer_destroy(tok);
}

static void write_file(const char *dir, const char *name, const char *text)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
}

Test(router_openai, template_load_from_model_folder, .timeout = 10)
{
    duet_tokenizer_t *tok = byte_tok();
    char dir[] = "/tmp/duet_oai_tplXXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    duet_oai_template_t *t = NULL;
    duet_oai_message_t m = {DUET_OAI_ROLE_USER, (char *)"hi", 2};
    uint32_t *ids = NULL;
    size_t n = 0;
    const uint32_t head[] = {BOS};

    /* Nothing there: the default. */
    cr_assert_eq(duet_oai_template_load(dir, tok, &t), DUET_OK);
    cr_assert_eq(duet_oai_chat_prompt(t, tok, &m, 1, &ids, &n), DUET_OK);
    expect_ids(ids, n, head, 1, "user: hi\nassistant: ");
    free(ids);
    duet_oai_template_destroy(t);

    /* A tokenizer_config.json without a template changes nothing; its Jinja template is used
     * (router/api/jinja.c); a malformed one is refused at load with the file and line:column. */
    write_file(dir, "tokenizer_config.json", "{\"bos_token\":\"<|bos|>\"}");
    cr_assert_eq(duet_oai_template_load(dir, tok, &t), DUET_OK);
    duet_oai_template_destroy(t);
    t = NULL;
    write_file(dir, "tokenizer_config.json",
               "{\"chat_template\":\"{% for m in messages %}[{{ m.role }}]{{ m.content }}"
               "{% endfor %}{% if add_generation_prompt %}>{% endif %}\"}");
    cr_assert_eq(duet_oai_template_load(dir, tok, &t), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(duet_oai_chat_prompt(t, tok, &m, 1, &ids, &n), DUET_OK);
    expect_ids(ids, n, NULL, 0, "[user]hi>");
    free(ids);
    duet_oai_template_destroy(t);
    t = NULL;
    write_file(dir, "tokenizer_config.json", "{\"chat_template\":\"{% if %}x{% endif %}\"}");
    cr_assert_neq(duet_oai_template_load(dir, tok, &t), DUET_OK);
    cr_assert_null(t);
    cr_assert(strstr(duet_error_last(), "tokenizer_config.json") != NULL, "%s", duet_error_last());
    cr_assert(strstr(duet_error_last(), ":1:") != NULL, "%s", duet_error_last());
    char tc_path[600];
    snprintf(tc_path, sizeof(tc_path), "%s/tokenizer_config.json", dir);
    unlink(tc_path);

    /* Our own file wins. */
    write_file(
        dir, "chat_template.json",
        "{\"duet_chat_template\":1,\"message\":\"<{content}>\",\"generation_prompt\":\"=\"}");
    cr_assert_eq(duet_oai_template_load(dir, tok, &t), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(duet_oai_chat_prompt(t, tok, &m, 1, &ids, &n), DUET_OK);
    expect_ids(ids, n, NULL, 0, "<hi>=");
    free(ids);
    duet_oai_template_destroy(t);

    char path[600];
    snprintf(path, sizeof(path), "%s/chat_template.json", dir);
    unlink(path);
    snprintf(path, sizeof(path), "%s/tokenizer_config.json", dir);
    unlink(path);
    rmdir(dir);

    /* The default needs <|bos|>. */
    duet_tokenizer_t *plain = NULL;
    cr_assert_eq(duet_tokenizer_create_byte(NULL, 0, &plain), DUET_OK);
    t = NULL;
    cr_assert_eq(duet_oai_template_create(NULL, 0, "default", plain, &t), DUET_ERR_NOT_FOUND);
    duet_tokenizer_destroy(plain);
    duet_tokenizer_destroy(tok);
}

/* A demo-like model folder: byte tokenizer with "add_bos" (or not) and config.json's bos id. */
static void demo_folder(char *dir, bool add_bos, bool bos_id)
{
    cr_assert_not_null(mkdtemp(dir));
    write_file(
        dir, "duet_tokenizer.json",
        add_bos
            ? "{\"type\": \"byte\", \"specials\": [\"<|bos|>\", \"<|eos|>\"], \"add_bos\": true}"
            : "{\"type\": \"byte\", \"specials\": [\"<|bos|>\", \"<|eos|>\"]}");
    write_file(dir, "config.json", bos_id ? "{\"bos_token_id\": 256}" : "{}");
}

static void rm_demo_folder(const char *dir)
{
    char path[600];
    snprintf(path, sizeof(path), "%s/duet_tokenizer.json", dir);
    unlink(path);
    snprintf(path, sizeof(path), "%s/config.json", dir);
    unlink(path);
    rmdir(dir);
}

/* A text prompt starts with the bos id exactly when the folder's tokenizer adds one (the rule
 * duet-generate follows: duet_tokenizer_prompt_bos), whatever the template. */
Test(router_openai, completion_prompt_bos_follows_the_folder, .timeout = 10)
{
    duet_oai_request_t r;
    duet_oai_error_t e;
    uint32_t *ids = NULL;
    size_t n = 0;
    const uint32_t head[] = {BOS};
    for (int add = 0; add < 2; add++) {
        char dir[] = "/tmp/duet_oai_bosXXXXXX";
        demo_folder(dir, add, true);
        duet_tokenizer_t *tok = NULL;
        duet_oai_template_t *t = NULL;
        cr_assert_eq(duet_tokenizer_load(dir, &tok), DUET_OK, "%s", duet_error_last());
        cr_assert_eq(duet_oai_template_load(dir, tok, &t), DUET_OK, "%s", duet_error_last());
        cr_assert_eq(parse(DUET_OAI_ENDPOINT_COMPLETIONS,
                           "{\"model\":\"duet-demo\",\"prompt\":\"ab\"}", &r, &e),
                     DUET_OK);
        cr_assert_eq(duet_oai_request_tokens(&r, &lim, t, tok, &ids, &n, &e), DUET_OK);
        expect_ids(ids, n, head, add ? 1 : 0, "ab");
        free(ids);
        duet_oai_request_free(&r);
        duet_oai_template_destroy(t);
        duet_tokenizer_destroy(tok);
        rm_demo_folder(dir);
    }
    /* add_bos with no bos id anywhere: refused at load, naming what is missing. */
    char dir[] = "/tmp/duet_oai_bosXXXXXX";
    demo_folder(dir, true, false);
    duet_tokenizer_t *tok = NULL;
    duet_oai_template_t *t = NULL;
    cr_assert_eq(duet_tokenizer_load(dir, &tok), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(duet_oai_template_load(dir, tok, &t), DUET_ERR_NOT_FOUND);
    cr_assert_null(t);
    cr_assert(strstr(duet_error_last(), "bos_token_id") != NULL, "%s", duet_error_last());
    duet_tokenizer_destroy(tok);
    rm_demo_folder(dir);
}

Test(router_openai, completion_prompt_tokens_and_context, .timeout = 10)
{
    char dir[] = "/tmp/duet_oai_cmpXXXXXX";
    demo_folder(dir, true, true);
    duet_tokenizer_t *tok = NULL;
    cr_assert_eq(duet_tokenizer_load(dir, &tok), DUET_OK, "%s", duet_error_last());
    duet_oai_template_t *t = NULL;
    cr_assert_eq(duet_oai_template_load(dir, tok, &t), DUET_OK, "%s", duet_error_last());
    rm_demo_folder(dir);
    duet_oai_request_t r;
    duet_oai_error_t e;
    uint32_t *ids = NULL;
    size_t n = 0;
    const uint32_t head[] = {BOS};

    cr_assert_eq(parse(DUET_OAI_ENDPOINT_COMPLETIONS,
                       "{\"model\":\"duet-demo\",\"prompt\":\"a<|eos|>\"}", &r, &e),
                 DUET_OK);
    cr_assert_eq(duet_oai_request_tokens(&r, &lim, t, tok, &ids, &n, &e), DUET_OK);
    expect_ids(ids, n, head, 1, "a<|eos|>");
    free(ids);
    duet_oai_request_free(&r);

    /* Token ids go through untouched (no BOS added). */
    cr_assert_eq(parse(DUET_OAI_ENDPOINT_COMPLETIONS,
                       "{\"model\":\"duet-demo\",\"prompt\":[104,105]}", &r, &e),
                 DUET_OK);
    cr_assert_eq(duet_oai_request_tokens(&r, &lim, t, tok, &ids, &n, &e), DUET_OK);
    expect_ids(ids, n, NULL, 0, "hi");
    free(ids);
    duet_oai_request_free(&r);

    /* prompt + max_tokens over the context. */
    cr_assert_eq(parse(DUET_OAI_ENDPOINT_COMPLETIONS,
                       "{\"model\":\"duet-demo\",\"prompt\":\"abcdefghij\",\"max_tokens\":500}", &r,
                       &e),
                 DUET_OK);
    duet_oai_limits_t l2 = lim;
    l2.max_context = 510;
    cr_assert_eq(duet_oai_request_tokens(&r, &l2, t, tok, &ids, &n, &e), DUET_ERR_INVALID);
    cr_assert_eq(e.http_status, 400);
    cr_assert_str_eq(e.code, "context_length_exceeded");
    cr_assert(strstr(e.message, "511") != NULL, "%s", e.message);
    l2.max_context = 511;
    cr_assert_eq(duet_oai_request_tokens(&r, &l2, t, tok, &ids, &n, &e), DUET_OK);
    free(ids);
    l2.max_prompt_tokens = 10;
    cr_assert_eq(duet_oai_request_tokens(&r, &l2, t, tok, &ids, &n, &e), DUET_ERR_INVALID);
    cr_assert_str_eq(e.param, "prompt");
    duet_oai_request_free(&r);

    /* An empty prompt with an empty prefix is refused. */
    duet_oai_template_t *t0 = NULL;
    const char *j = "{\"duet_chat_template\":1}";
    cr_assert_eq(duet_oai_template_create(j, strlen(j), "t0", tok, &t0), DUET_OK);
    cr_assert_eq(
        parse(DUET_OAI_ENDPOINT_COMPLETIONS, "{\"model\":\"duet-demo\",\"prompt\":\"\"}", &r, &e),
        DUET_OK);
    cr_assert_eq(duet_oai_request_tokens(&r, &lim, t0, tok, &ids, &n, &e), DUET_ERR_INVALID);
    cr_assert_str_eq(e.code, "invalid_value");
    duet_oai_request_free(&r);
    duet_oai_template_destroy(t0);
    duet_oai_template_destroy(t);
    duet_tokenizer_destroy(tok);
}

/* ---------------------------------------------------------------- responses */

static const duet_oai_resp_meta_t chat_meta = {
    .endpoint = DUET_OAI_ENDPOINT_CHAT,
    .id = "chatcmpl-0000000000000007",
    .model = "duet-demo",
    .created = 1700000000,
    .include_usage = true,
};

Test(router_openai, response_json_parses_back, .timeout = 10)
{
    char id[40];
    duet_oai_response_id(DUET_OAI_ENDPOINT_COMPLETIONS, 42, id, sizeof(id));
    cr_assert_str_eq(id, "cmpl-000000000000002a");
    duet_oai_response_id(DUET_OAI_ENDPOINT_CHAT, 7, id, sizeof(id));
    cr_assert_str_eq(id, chat_meta.id);

    for (int ep = 0; ep < 2; ep++) {
        duet_oai_resp_meta_t m = chat_meta;
        m.endpoint = (duet_oai_endpoint_t)ep;
        m.include_usage = false;
        duet_strbuf_t sb;
        duet_strbuf_init(&sb);
        const char text[] = "Hi \"there\"\n\xf0\x9f\x98\x80 \x01";
        cr_assert_eq(
            duet_oai_response_json(&m, text, sizeof(text) - 1, DUET_OAI_FINISH_LENGTH, 5, 3, &sb),
            DUET_OK);
        json_error_t je;
        json_t *root = json_loads(sb.data, 0, &je);
        cr_assert_not_null(root, "%s: %s", sb.data, je.text);
        cr_assert_str_eq(json_string_value(json_object_get(root, "id")), m.id);
        cr_assert_str_eq(json_string_value(json_object_get(root, "object")),
                         ep == 1 ? "chat.completion" : "text_completion");
        cr_assert_eq(json_integer_value(json_object_get(root, "created")), 1700000000);
        cr_assert_str_eq(json_string_value(json_object_get(root, "model")), "duet-demo");
        json_t *choices = json_object_get(root, "choices");
        cr_assert_eq(json_array_size(choices), 1);
        json_t *c0 = json_array_get(choices, 0);
        cr_assert_eq(json_integer_value(json_object_get(c0, "index")), 0);
        cr_assert(json_is_null(json_object_get(c0, "logprobs")));
        cr_assert_str_eq(json_string_value(json_object_get(c0, "finish_reason")), "length");
        json_t *t;
        if (ep == 1) {
            json_t *msg = json_object_get(c0, "message");
            cr_assert_str_eq(json_string_value(json_object_get(msg, "role")), "assistant");
            t = json_object_get(msg, "content");
        } else {
            t = json_object_get(c0, "text");
        }
        cr_assert_eq(json_string_length(t), sizeof(text) - 1);
        cr_assert(memcmp(json_string_value(t), text, sizeof(text) - 1) == 0);
        json_t *u = json_object_get(root, "usage");
        cr_assert_eq(json_integer_value(json_object_get(u, "prompt_tokens")), 5);
        cr_assert_eq(json_integer_value(json_object_get(u, "completion_tokens")), 3);
        cr_assert_eq(json_integer_value(json_object_get(u, "total_tokens")), 8);
        json_decref(root);
        duet_strbuf_free(&sb);
    }
}

/* Split "data: X\n\n" events; returns their count, payloads in ev[]. */
static size_t sse_split(const char *s, char ev[][1024], size_t max)
{
    size_t n = 0;
    while (*s != '\0' && n < max) {
        cr_assert(strncmp(s, "data: ", 6) == 0, "event does not start with 'data: ': %s", s);
        const char *end = strstr(s, "\n\n");
        cr_assert_not_null(end, "unterminated event: %s", s);
        size_t len = (size_t)(end - s - 6);
        cr_assert_lt(len, 1024);
        memcpy(ev[n], s + 6, len);
        ev[n][len] = '\0';
        cr_assert_null(memchr(ev[n], '\n', len), "newline inside an event");
        n++;
        s = end + 2;
    }
    return n;
}

Test(router_openai, sse_chat_with_usage, .timeout = 10)
{
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    cr_assert_eq(duet_oai_sse_begin(&chat_meta, &sb), DUET_OK);
    cr_assert_eq(duet_oai_sse_delta(&chat_meta, "Hel", 3, &sb), DUET_OK);
    cr_assert_eq(duet_oai_sse_delta(&chat_meta, "", 0, &sb), DUET_OK); /* nothing */
    cr_assert_eq(duet_oai_sse_delta(&chat_meta, "lo", 2, &sb), DUET_OK);
    cr_assert_eq(duet_oai_sse_end(&chat_meta, DUET_OAI_FINISH_STOP, 9, 2, &sb), DUET_OK);
    char ev[8][1024];
    size_t n = sse_split(sb.data, ev, 8);
    cr_assert_eq(n, 6, "%s", sb.data);
    cr_assert_str_eq(ev[5], "[DONE]");
    const char *want_content[3] = {"", "Hel", "lo"};
    for (size_t i = 0; i < 5; i++) {
        json_error_t je;
        json_t *c = json_loads(ev[i], 0, &je);
        cr_assert_not_null(c, "%s: %s", ev[i], je.text);
        cr_assert_str_eq(json_string_value(json_object_get(c, "object")), "chat.completion.chunk");
        cr_assert_str_eq(json_string_value(json_object_get(c, "id")), chat_meta.id);
        cr_assert_str_eq(json_string_value(json_object_get(c, "model")), "duet-demo");
        cr_assert(json_is_integer(json_object_get(c, "created")));
        json_t *choices = json_object_get(c, "choices");
        json_t *usage = json_object_get(c, "usage");
        cr_assert_not_null(usage, "include_usage: every chunk has a usage key");
        if (i < 4) {
            cr_assert(json_is_null(usage));
            cr_assert_eq(json_array_size(choices), 1);
            json_t *c0 = json_array_get(choices, 0);
            json_t *delta = json_object_get(c0, "delta");
            cr_assert(json_is_object(delta));
            if (i == 0)
                cr_assert_str_eq(json_string_value(json_object_get(delta, "role")), "assistant");
            else
                cr_assert_null(json_object_get(delta, "role"));
            if (i < 3) {
                cr_assert_str_eq(json_string_value(json_object_get(delta, "content")),
                                 want_content[i]);
                cr_assert(json_is_null(json_object_get(c0, "finish_reason")));
            } else {
                cr_assert_eq(json_object_size(delta), 0);
                cr_assert_str_eq(json_string_value(json_object_get(c0, "finish_reason")), "stop");
            }
        } else {
            cr_assert(json_is_array(choices) && json_array_size(choices) == 0);
            cr_assert_eq(json_integer_value(json_object_get(usage, "prompt_tokens")), 9);
            cr_assert_eq(json_integer_value(json_object_get(usage, "completion_tokens")), 2);
            cr_assert_eq(json_integer_value(json_object_get(usage, "total_tokens")), 11);
        }
        json_decref(c);
    }
    duet_strbuf_free(&sb);
}

Test(router_openai, sse_completions_without_usage, .timeout = 10)
{
    duet_oai_resp_meta_t m = chat_meta;
    m.endpoint = DUET_OAI_ENDPOINT_COMPLETIONS;
    m.id = "cmpl-1";
    m.include_usage = false;
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    cr_assert_eq(duet_oai_sse_begin(&m, &sb), DUET_OK);
    cr_assert_eq(sb.len, 0, "no role chunk for completions");
    cr_assert_eq(duet_oai_sse_delta(&m, "a\nb", 3, &sb), DUET_OK);
    cr_assert_eq(duet_oai_sse_end(&m, DUET_OAI_FINISH_LENGTH, 1, 1, &sb), DUET_OK);
    cr_assert_str_eq(
        sb.data,
        "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1700000000,\"model\":"
        "\"duet-demo\",\"choices\":[{\"index\":0,\"text\":\"a\\nb\",\"logprobs\":null,"
        "\"finish_reason\":null}]}\n\n"
        "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1700000000,\"model\":"
        "\"duet-demo\",\"choices\":[{\"index\":0,\"text\":\"\",\"logprobs\":null,"
        "\"finish_reason\":\"length\"}]}\n\n"
        "data: [DONE]\n\n");
    duet_strbuf_free(&sb);
}

/* n choices: the body lists them by index; interleaved chunks carry theirs, one usage + [DONE]. */
Test(router_openai, n_choices_response_and_sse, .timeout = 10)
{
    duet_oai_resp_meta_t m = chat_meta;
    m.include_usage = false;
    const char *calls = "[{\"id\":\"functions.f:0\",\"type\":\"function\",\"function\":"
                        "{\"name\":\"f\",\"arguments\":\"{}\"}}]";
    const duet_oai_choice_t c[3] = {{"a", 1, DUET_OAI_FINISH_STOP, NULL, NULL},
                                    {"bb", 2, DUET_OAI_FINISH_LENGTH, NULL, NULL},
                                    {"", 0, DUET_OAI_FINISH_TOOL_CALLS, calls, NULL}};
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    cr_assert_eq(duet_oai_response_json_n(&m, c, 3, 4, 6, &sb), DUET_OK);
    json_error_t je;
    json_t *root = json_loads(sb.data, 0, &je);
    cr_assert_not_null(root, "%s: %s", sb.data, je.text);
    json_t *choices = json_object_get(root, "choices");
    cr_assert_eq(json_array_size(choices), 3, "%s", sb.data);
    for (size_t i = 0; i < 3; i++) {
        json_t *ci = json_array_get(choices, i);
        cr_assert_eq(json_integer_value(json_object_get(ci, "index")), (json_int_t)i);
        json_t *msg = json_object_get(ci, "message");
        if (i < 2) {
            cr_assert_str_eq(json_string_value(json_object_get(msg, "content")), c[i].text);
            cr_assert_null(json_object_get(msg, "tool_calls"));
        } else { /* tool calls without text: content null */
            cr_assert(json_is_null(json_object_get(msg, "content")), "%s", sb.data);
            json_t *tc = json_array_get(json_object_get(msg, "tool_calls"), 0);
            cr_assert_str_eq(json_string_value(json_object_get(tc, "id")), "functions.f:0");
        }
        cr_assert_str_eq(json_string_value(json_object_get(ci, "finish_reason")),
                         duet_oai_finish_name(c[i].finish));
    }
    cr_assert_eq(
        json_integer_value(json_object_get(json_object_get(root, "usage"), "total_tokens")), 10);
    json_decref(root);
    duet_strbuf_free(&sb);

    /* streaming: choice 1 then 0 interleaved, then the stream's end */
    duet_oai_resp_meta_t m0 = chat_meta, m1 = chat_meta;
    m1.index = 1;
    duet_strbuf_init(&sb);
    duet_oai_sse_begin(&m1, &sb);
    duet_oai_sse_delta(&m1, "x", 1, &sb);
    duet_oai_sse_begin(&m0, &sb);
    duet_oai_sse_delta(&m0, "y", 1, &sb);
    duet_oai_sse_finish(&m1, DUET_OAI_FINISH_STOP, &sb);
    duet_oai_sse_finish(&m0, DUET_OAI_FINISH_LENGTH, &sb);
    cr_assert_eq(duet_oai_sse_done(&m0, 3, 2, &sb), DUET_OK);
    char ev[10][1024];
    size_t n = sse_split(sb.data, ev, 10);
    cr_assert_eq(n, 8, "%s", sb.data);
    const int want_index[6] = {1, 1, 0, 0, 1, 0};
    for (size_t i = 0; i < 6; i++) {
        json_t *e = json_loads(ev[i], 0, &je);
        cr_assert_not_null(e, "%s", ev[i]);
        json_t *c0 = json_array_get(json_object_get(e, "choices"), 0);
        cr_assert_eq(json_integer_value(json_object_get(c0, "index")), want_index[i], "%s", ev[i]);
        json_decref(e);
    }
    cr_assert(
        strstr(ev[6], "\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2") !=
            NULL,
        "%s", ev[6]);
    cr_assert_str_eq(ev[7], "[DONE]");
    duet_strbuf_free(&sb);
}

/* ---------------------------------------------------------------- streaming text */

typedef struct {
    char text[4096];
    size_t len;
    size_t n_deltas; /* non-empty deltas */
    duet_oai_finish_t finish;
    size_t fed;
} run_t;

/* Feed ids until the stream finishes (or they run out), collecting the deltas. */
static run_t run_ids(duet_oai_stream_t *s, const uint32_t *ids, size_t n)
{
    run_t r;
    memset(&r, 0, sizeof(r));
    for (size_t i = 0; i < n && r.finish == DUET_OAI_FINISH_NONE; i++) {
        const char *t;
        size_t len;
        cr_assert_eq(duet_oai_stream_feed(s, ids[i], &t, &len, &r.finish), DUET_OK, "%s",
                     duet_error_last());
        cr_assert_lt(r.len + len, sizeof(r.text));
        memcpy(r.text + r.len, t, len);
        r.len += len;
        r.n_deltas += len > 0;
        r.fed++;
    }
    r.text[r.len] = '\0';
    return r;
}

static run_t run_text(duet_oai_stream_t *s, const char *text, uint32_t tail)
{
    uint32_t ids[4096];
    size_t n = strlen(text);
    for (size_t i = 0; i < n; i++)
        ids[i] = (uint8_t)text[i];
    if (tail != UINT32_MAX)
        ids[n++] = tail;
    return run_ids(s, ids, n);
}

static duet_oai_stream_t *make_stream(duet_tokenizer_t *tok, const char *body)
{
    duet_oai_request_t r;
    duet_oai_error_t e;
    cr_assert_eq(parse(DUET_OAI_ENDPOINT_COMPLETIONS, body, &r, &e), DUET_OK, "%s", e.message);
    duet_oai_stream_t *s = NULL;
    const uint32_t eos = EOS;
    cr_assert_eq(duet_oai_stream_create(tok, &r, &eos, 1, true, &s), DUET_OK);
    duet_oai_request_free(&r);
    return s;
}

#define BODY(extra) "{\"model\":\"duet-demo\",\"prompt\":\"x\",\"max_tokens\":512" extra "}"

Test(router_openai, stream_stop_strings, .timeout = 10)
{
    duet_tokenizer_t *tok = byte_tok();

    /* Split across tokens (byte tokens: every byte is a token). */
    duet_oai_stream_t *s = make_stream(tok, BODY(",\"stop\":\"END\""));
    run_t r = run_text(s, "hello ENDING", UINT32_MAX);
    cr_assert_str_eq(r.text, "hello ");
    cr_assert_eq(r.finish, DUET_OAI_FINISH_STOP);
    cr_assert_eq(r.fed, 9, "ends at the token that completes the stop string");
    cr_assert_eq(duet_oai_stream_n_tokens(s), 9);
    const char *kept;
    size_t kept_len;
    duet_oai_stream_text(s, &kept, &kept_len);
    cr_assert_eq(kept_len, 6);
    cr_assert(memcmp(kept, "hello ", 6) == 0);
    /* Feeding after the end is refused. */
    const char *t;
    size_t len;
    duet_oai_finish_t f;
    cr_assert_eq(duet_oai_stream_feed(s, 'x', &t, &len, &f), DUET_ERR_INVALID);
    duet_oai_stream_destroy(s);

    /* A partial match is held, then released when it turns out not to be a stop. */
    s = make_stream(tok, BODY(",\"stop\":\"END\""));
    const char *in = "EN EN";
    for (size_t i = 0; i < strlen(in); i++) {
        cr_assert_eq(duet_oai_stream_feed(s, (uint8_t)in[i], &t, &len, &f), DUET_OK);
        const char *want[] = {"", "", "EN ", "", ""};
        cr_assert_eq(len, strlen(want[i]), "token %zu", i);
        cr_assert(memcmp(t, want[i], len) == 0);
    }
    cr_assert_eq(duet_oai_stream_finish(s, DUET_OAI_FINISH_LENGTH, &t, &len, &f), DUET_OK);
    cr_assert_eq(len, 2);
    cr_assert(memcmp(t, "EN", 2) == 0);
    cr_assert_eq(f, DUET_OAI_FINISH_LENGTH);
    duet_oai_stream_destroy(s);

    /* Multiple stop strings: the earliest in the text wins; overlapping prefixes. */
    s = make_stream(tok, BODY(",\"stop\":[\"abcd\",\"bcx\",\"\\n\\n\"]"));
    r = run_text(s, "xxabcbcx tail", UINT32_MAX);
    cr_assert_str_eq(r.text, "xxabc");
    cr_assert_eq(r.finish, DUET_OAI_FINISH_STOP);
    duet_oai_stream_destroy(s);
    s = make_stream(tok, BODY(",\"stop\":[\"abcd\",\"bcx\",\"\\n\\n\"]"));
    r = run_text(s, "one\ntwo\n\nthree", UINT32_MAX);
    cr_assert_str_eq(r.text, "one\ntwo");
    duet_oai_stream_destroy(s);

    /* Stop at the very start: nothing is emitted. */
    s = make_stream(tok, BODY(",\"stop\":[\"Q\",\"zz\"]"));
    r = run_text(s, "Qrest", UINT32_MAX);
    cr_assert_eq(r.len, 0);
    cr_assert_eq(r.n_deltas, 0);
    cr_assert_eq(r.finish, DUET_OAI_FINISH_STOP);
    cr_assert_eq(r.fed, 1);
    duet_oai_stream_destroy(s);

    /* A stop string completed by the max_tokens-th token: "stop" wins over "length". */
    s = make_stream(tok,
                    "{\"model\":\"duet-demo\",\"prompt\":\"x\",\"max_tokens\":4,\"stop\":\"cd\"}");
    r = run_text(s, "abcdef", UINT32_MAX);
    cr_assert_str_eq(r.text, "ab");
    cr_assert_eq(r.finish, DUET_OAI_FINISH_STOP);
    duet_oai_stream_destroy(s);

    /* Held text at the length limit is released. */
    s = make_stream(tok,
                    "{\"model\":\"duet-demo\",\"prompt\":\"x\",\"max_tokens\":4,\"stop\":\"cde\"}");
    r = run_text(s, "abcdef", UINT32_MAX);
    cr_assert_str_eq(r.text, "abcd");
    cr_assert_eq(r.finish, DUET_OAI_FINISH_LENGTH);
    duet_oai_stream_destroy(s);

    /* A multi-byte stop string split across byte tokens. */
    s = make_stream(tok, BODY(",\"stop\":\"\\u00e9t\\u00e9\""));
    r = run_text(s, "l'\xc3\xa9t\xc3\xa9 dernier", UINT32_MAX);
    cr_assert_str_eq(r.text, "l'");
    duet_oai_stream_destroy(s);
    duet_tokenizer_destroy(tok);
}

Test(router_openai, stream_utf8_eos_length, .timeout = 10)
{
    duet_tokenizer_t *tok = byte_tok();

    /* A 4-byte emoji over four byte tokens comes out whole, in one delta. */
    duet_oai_stream_t *s = make_stream(tok, BODY(""));
    const char *t;
    size_t len;
    duet_oai_finish_t f;
    const char emoji[] = "\xf0\x9f\x98\x80";
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(duet_oai_stream_feed(s, (uint8_t)emoji[i], &t, &len, &f), DUET_OK);
        cr_assert_eq(len, i < 3 ? 0u : 4u, "byte %d", i);
    }
    cr_assert(memcmp(t, emoji, 4) == 0);
    /* EOS ends with "stop"; EOS produces no text, and counts as a token. */
    run_t r = run_text(s, "\xc3\xa9!", EOS);
    cr_assert_str_eq(r.text, "\xc3\xa9!");
    cr_assert_eq(r.finish, DUET_OAI_FINISH_STOP);
    cr_assert_eq(duet_oai_stream_n_tokens(s), 4 + 3 + 1);
    duet_oai_stream_destroy(s);

    /* An unfinished character at EOS becomes U+FFFD. */
    s = make_stream(tok, BODY(""));
    r = run_text(s, "a\xe2\x82", EOS);
    cr_assert_str_eq(r.text, "a\xef\xbf\xbd");
    duet_oai_stream_destroy(s);

    /* ignore_eos: EOS is an ordinary (silent) token; max_tokens ends with "length". */
    s = make_stream(tok, "{\"model\":\"duet-demo\",\"prompt\":\"x\",\"max_tokens\":5,"
                         "\"ignore_eos\":true}");
    const uint32_t ids[] = {'a', EOS, 'b', EOS, 'c', 'd'};
    r = run_ids(s, ids, 6);
    cr_assert_str_eq(r.text, "abc");
    cr_assert_eq(r.finish, DUET_OAI_FINISH_LENGTH);
    cr_assert_eq(r.fed, 5);
    duet_oai_stream_destroy(s);

    /* Length with a character unfinished at the limit. */
    s = make_stream(tok, "{\"model\":\"duet-demo\",\"prompt\":\"x\",\"max_tokens\":2}");
    r = run_text(s, "a\xc3\xa9", UINT32_MAX);
    cr_assert_str_eq(r.text, "a\xef\xbf\xbd");
    cr_assert_eq(r.finish, DUET_OAI_FINISH_LENGTH);
    duet_oai_stream_destroy(s);

    /* An id outside the vocabulary is an error that leaves the stream usable. */
    s = make_stream(tok, BODY(""));
    cr_assert_eq(duet_oai_stream_feed(s, 999, &t, &len, &f), DUET_ERR_RANGE);
    cr_assert_eq(duet_oai_stream_n_tokens(s), 0);
    cr_assert_eq(duet_oai_stream_feed(s, 'z', &t, &len, &f), DUET_OK);
    cr_assert_eq(len, 1);
    duet_oai_stream_destroy(s);
    duet_tokenizer_destroy(tok);
}

/*
 * skip_special_tokens (vLLM's request field, default true) on both endpoints, and a generated
 * special id that is no stop id through the output path: no error, no text by default, its text
 * with skip_special_tokens false; the stop id ends the choice and never adds text.
 */
Test(router_openai, skip_special_tokens, .timeout = 10)
{
    duet_oai_request_t r;
    duet_oai_error_t e;
    for (int ep = DUET_OAI_ENDPOINT_COMPLETIONS; ep <= DUET_OAI_ENDPOINT_CHAT; ep++) {
        const char *input = ep == DUET_OAI_ENDPOINT_CHAT ? MSG : "\"prompt\":\"x\"";
        const char *tails[] = {"", ",\"skip_special_tokens\":null", ",\"skip_special_tokens\":true",
                               ",\"skip_special_tokens\":false"};
        for (int t = 0; t < 4; t++) {
            char body[256];
            snprintf(body, sizeof(body), "{" M "%s%s}", input, tails[t]);
            cr_assert_eq(parse((duet_oai_endpoint_t)ep, body, &r, &e), DUET_OK, "%s: %s", body,
                         e.message);
            cr_assert_eq(r.skip_special_tokens, t != 3, "%s", body);
            duet_oai_request_free(&r);
        }
    }

    duet_tokenizer_t *tok = byte_tok();
    const uint32_t gen[] = {'a', BOS, 'b', BOS, EOS, 'z'};
    const char *want[2] = {"a<|bos|>b<|bos|>", "ab"};
    for (int skip = 0; skip <= 1; skip++) {
        duet_oai_stream_t *st =
            make_stream(tok, skip ? BODY("") : BODY(",\"skip_special_tokens\":false"));
        run_t got = run_ids(st, gen, 6);
        cr_assert_str_eq(got.text, want[skip]);
        cr_assert_eq(got.finish, DUET_OAI_FINISH_STOP);
        cr_assert_eq(got.fed, 5, "the stop id ends the choice");
        cr_assert_eq(duet_oai_stream_n_tokens(st), 5);
        const char *text;
        size_t len;
        duet_oai_stream_text(st, &text, &len);
        cr_assert(len == strlen(want[skip]) && memcmp(text, want[skip], len) == 0);

        /* the bytes a client gets: one JSON body, and SSE deltas */
        duet_oai_resp_meta_t m = {.endpoint = DUET_OAI_ENDPOINT_COMPLETIONS,
                                  .id = "cmpl-1",
                                  .model = "duet-demo",
                                  .created = 1};
        duet_strbuf_t sb;
        duet_strbuf_init(&sb);
        cr_assert_eq(duet_oai_response_json(&m, text, len, got.finish, 1, 5, &sb), DUET_OK);
        json_t *root = json_loadb(sb.data, sb.len, 0, NULL);
        cr_assert_not_null(root, "%s", sb.data);
        json_t *choice = json_array_get(json_object_get(root, "choices"), 0);
        cr_assert_str_eq(json_string_value(json_object_get(choice, "text")), want[skip]);
        cr_assert_str_eq(json_string_value(json_object_get(choice, "finish_reason")), "stop");
        json_decref(root);
        duet_strbuf_free(&sb);
        duet_oai_stream_destroy(st);
    }
    duet_tokenizer_destroy(tok);
}

/* Random token streams: emitted text == the reference (whole decode, cut at the first stop). */
Test(router_openai, stream_matches_reference, .timeout = 30)
{
    duet_tokenizer_t *tok = byte_tok();
    uint64_t seed = 99;
    const char alphabet[] = "ab\xc3\xa9\n";
    bool ok = true;
    for (int iter = 0; iter < 2000 && ok; iter++) {
        duet_oai_stream_t *s = make_stream(tok, BODY(",\"stop\":[\"ab\\n\",\"\\u00e9\\u00e9a\"]"));
        char in[64];
        size_t n = 0;
        for (; n < 40; n++) {
            seed = seed * 6364136223846793005ull + 1442695040888963407ull;
            in[n] = alphabet[(seed >> 33) % 5];
        }
        in[n] = '\0';
        run_t r = run_text(s, in, EOS);
        /* Reference: the first stop occurrence in the input (valid UTF-8 by construction except
         * where a lone byte of é is picked, so compare only on valid prefixes). */
        const char *c1 = strstr(in, "ab\n"), *c2 = strstr(in, "\xc3\xa9\xc3\xa9"
                                                              "a");
        const char *cut = c1 == NULL ? c2 : (c2 == NULL || c1 < c2 ? c1 : c2);
        size_t ref_len = cut != NULL ? (size_t)(cut - in) : n;
        bool valid = true;
        for (size_t i = 0; i < ref_len; i++) {
            uint8_t b = (uint8_t)in[i];
            if (b == 0xc3)
                valid = valid && i + 1 < ref_len && (uint8_t)in[i + 1] == 0xa9, i++;
            else if (b == 0xa9)
                valid = false;
        }
        if (valid)
            ok = r.len == ref_len && memcmp(r.text, in, ref_len) == 0 &&
                 r.finish == DUET_OAI_FINISH_STOP;
        cr_assert(ok, "iter %d: in \"%s\" out \"%s\"", iter, in, r.text);
        duet_oai_stream_destroy(s);
    }
    duet_tokenizer_destroy(tok);
}

/* ---------------------------------------------------------------- fuzz */

static uint64_t rng_next(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return *s >> 33;
}

static const char *const fuzz_seeds[] = {
    "{\"model\":\"duet-demo\",\"prompt\":\"hi\",\"max_tokens\":5,\"stop\":[\"a\"],\"stream\":true,"
    "\"stream_options\":{\"include_usage\":true}}",
    "{\"model\":\"duet-demo\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\","
    "\"text\":\"x\"}]},{\"role\":\"assistant\",\"content\":\"y\"}],\"temperature\":0.7,\"top_p\":"
    "0.9,\"seed\":3,\"n\":1,\"logprobs\":false,\"tools\":[]}",
    "{\"model\":\"duet-demo\",\"prompt\":[1,2,3],\"logit_bias\":{},\"user\":\"u\"}",
};

static const char *const fuzz_tokens[] = {
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
    "null",
    "true",
    "false",
    "0",
    "-1",
    "1e309",
    "2.5",
    "\"model\"",
    "\"prompt\"",
    "\"messages\"",
    "\"role\"",
    "\"content\"",
    "\"stop\"",
    "\"n\"",
    "\"\\u0000\"",
    "\"\\ud800\"",
    "\"\xff\"",
    "\"duet-demo\"",
    "9223372036854775807",
    "{\"type\":\"text\",\"text\":\"t\"}",
    "[[]]",
    "\"max_tokens\"",
    "\"stream_options\"",
};

/*
 * An accepted request must tokenize, and its stream, fed random ids, must never emit a stop string,
 * must emit valid UTF-8 (it round-trips through jansson), and must end by max_tokens.
 */
static void fuzz_generate(duet_tokenizer_t *tok, duet_oai_template_t *tmpl,
                          const duet_oai_request_t *r, uint64_t *seed)
{
    uint32_t *ids = NULL;
    size_t n = 0;
    duet_oai_error_t e;
    duet_status_t st = duet_oai_request_tokens(r, &lim, tmpl, tok, &ids, &n, &e);
    cr_assert(st == DUET_OK || e.http_status == 400, "tokens: %s", e.message);
    free(ids);
    duet_oai_stream_t *s = NULL;
    const uint32_t eos = EOS;
    cr_assert_eq(duet_oai_stream_create(tok, r, &eos, 1, true, &s), DUET_OK);
    char out[8192];
    size_t out_len = 0;
    duet_oai_finish_t f = DUET_OAI_FINISH_NONE;
    for (uint32_t i = 0; i < 600 && f == DUET_OAI_FINISH_NONE; i++) {
        const char *t;
        size_t len;
        uint32_t id = (uint32_t)(rng_next(seed) % 40 == 0 ? EOS : rng_next(seed) % 256);
        cr_assert_eq(duet_oai_stream_feed(s, id, &t, &len, &f), DUET_OK);
        cr_assert_lt(out_len + len, sizeof(out));
        memcpy(out + out_len, t, len);
        out_len += len;
    }
    cr_assert_neq(f, DUET_OAI_FINISH_NONE);
    cr_assert_leq(duet_oai_stream_n_tokens(s), r->max_tokens);
    for (size_t k = 0; k < r->n_stop; k++)
        cr_assert_null(memmem(out, out_len, r->stop[k], r->stop_len[k]));
    json_t *js = json_stringn(out, out_len);
    cr_assert_not_null(js, "stream emitted ill-formed UTF-8");
    json_decref(js);
    const char *kept;
    size_t kept_len;
    duet_oai_stream_text(s, &kept, &kept_len);
    cr_assert(kept_len == out_len && memcmp(kept, out, out_len) == 0);
    duet_oai_stream_destroy(s);
}

Test(router_openai, fuzz_parsers, .timeout = 120)
{
    duet_tokenizer_t *tok = byte_tok();
    duet_oai_template_t *tmpl = NULL;
    cr_assert_eq(duet_oai_template_create(NULL, 0, "default", tok, &tmpl), DUET_OK);
    uint64_t seed = 20240601;
    char buf[4096];
    size_t n_ok = 0, n_err = 0;
    for (int iter = 0; iter < 6000; iter++) {
        size_t len;
        duet_oai_endpoint_t ep = (duet_oai_endpoint_t)(rng_next(&seed) % 2);
        uint64_t kind = rng_next(&seed) % 3;
        if (kind == 0) {
            /* Random bytes with JSON punctuation mixed in. */
            len = rng_next(&seed) % 200;
            for (size_t i = 0; i < len; i++) {
                uint64_t v = rng_next(&seed);
                buf[i] = (v & 3) == 0 ? "{}[]\":,"[v % 7] : (char)(v >> 8);
            }
        } else {
            /* A seed with a few mutations: byte flips, deletions, token insertions. */
            size_t which = rng_next(&seed) % 3;
            const char *s = fuzz_seeds[which];
            ep = which == 1 ? DUET_OAI_ENDPOINT_CHAT : DUET_OAI_ENDPOINT_COMPLETIONS;
            len = strlen(s);
            memcpy(buf, s, len);
            int muts = (int)(rng_next(&seed) % 4);
            for (int m = 0; m < muts && len > 0; m++) {
                size_t at = rng_next(&seed) % len;
                uint64_t op = rng_next(&seed) % 3;
                if (op == 0) {
                    buf[at] = (char)rng_next(&seed);
                } else if (op == 1) {
                    size_t d = 1 + rng_next(&seed) % 8;
                    d = d > len - at ? len - at : d;
                    memmove(buf + at, buf + at + d, len - at - d);
                    len -= d;
                } else {
                    const char *t = fuzz_tokens[rng_next(&seed) %
                                                (sizeof(fuzz_tokens) / sizeof(fuzz_tokens[0]))];
                    size_t tl = strlen(t);
                    if (len + tl < sizeof(buf)) {
                        memmove(buf + at + tl, buf + at, len - at);
                        memcpy(buf + at, t, tl);
                        len += tl;
                    }
                }
            }
        }
        duet_oai_request_t r;
        duet_oai_error_t e;
        memset(&e, 0, sizeof(e));
        duet_status_t st = duet_oai_request_parse(&lim, ep, buf, len, &r, &e);
        if (st == DUET_OK) {
            n_ok++;
            bool sane =
                (r.max_tokens >= 1 || (r.lp.echo && !r.stream)) &&
                r.max_tokens <= lim.max_tokens_cap && r.n_stop <= DUET_OAI_MAX_STOP &&
                (ep == DUET_OAI_ENDPOINT_CHAT ? r.n_messages > 0
                                              : (r.prompt != NULL) != (r.prompt_ids != NULL));
            cr_assert(sane, "accepted an insane request: %.*s", (int)len, buf);
            fuzz_generate(tok, tmpl, &r, &seed);
            duet_oai_request_free(&r);
        } else {
            n_err++;
            if (!(e.http_status == 400 || e.http_status == 404 || e.http_status == 413))
                cr_assert_fail("iter %d: status %d for %.*s", iter, e.http_status, (int)len, buf);
            check_error_json(&e);
        }
    }
    cr_log_info("fuzz: %zu accepted, %zu refused", n_ok, n_err);
    cr_assert_gt(n_ok, 50, "mutations should leave some bodies valid");
    cr_assert_gt(n_err, 3000);
    duet_oai_template_destroy(tmpl);
    duet_tokenizer_destroy(tok);
}
