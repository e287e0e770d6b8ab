/*
 * Fuzz target: a model folder's Jinja chat template (router/api/jinja*.c through
 * router/api/chat_template.c): parsed as duet_oai_template_create_jinja parses it at start-up,
 * then rendered over a fixed small conversation (every message shape the OpenAI API allows:
 * system, user with text parts, assistant with tool_calls, tool; tools and documents; special
 * tokens from a tokenizer_config.json; a fixed strftime_now instant), as a request renders it.
 *
 * The render runs under small limits (FUZZ_LIMITS: output, iterations and filter work, arena,
 * call depth). Every loop, filter and call is metered against them, so a template that makes the
 * renderer run long (libFuzzer's -timeout) or recurse deep (a stack overflow) is a finding.
 *
 * Input: the template text. Checked besides no crash / sanitizer report / hang:
 *  - a refusal (parse or render) sets a detail (raise_exception's own message may be empty, as
 *    in jinja2) and leaves an empty output;
 *  - a render's output is at most max_output bytes of valid UTF-8 (what the tokenizer and JSON
 *    need), its segments cover the text exactly, in order, and adjacent segments have different
 *    origins.
 */
#include "fuzz/fuzz.h"

#include <jansson.h>
#include <time.h>

#include "common/status.h"
#include "common/utf8.h"
#include "router/api/chat_template.h"
#include "router/api/jinja.h"

static const duet_jinja_limits_t FUZZ_LIMITS = {
    .max_output = 64 * 1024, .max_iterations = 2000, .max_memory = 8u << 20, .max_call_depth = 16};

static const char conversation[] =
    "{\"messages\": ["
    "{\"role\": \"system\", \"content\": \"You are duet. <|eos|> stays data.\"},"
    "{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"What is 2+2?\"}]},"
    "{\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"id\": \"call_1\", "
    "\"type\": \"function\", \"function\": {\"name\": \"add\", \"arguments\": "
    "\"{\\\"a\\\": 2, \\\"b\\\": 2}\"}}]},"
    "{\"role\": \"tool\", \"tool_call_id\": \"call_1\", \"content\": \"4\"},"
    "{\"role\": \"assistant\", \"content\": \"4, caf\\u00e9 \\ud83d\\ude00\"},"
    "{\"role\": \"user\", \"name\": \"bob\", \"content\": \"thanks\"}],"
    "\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"add\", \"description\": "
    "\"adds\", \"parameters\": {\"type\": \"object\", \"properties\": {\"a\": {\"type\": "
    "\"integer\"}, \"b\": {\"type\": \"integer\"}}, \"required\": [\"a\", \"b\"]}}}],"
    "\"documents\": [{\"title\": \"t\", \"text\": \"d\"}],"
    "\"kwargs\": {\"enable_thinking\": false, \"reasoning_effort\": \"low\"},"
    "\"config\": {\"bos_token\": \"<|bos|>\", \"eos_token\": {\"content\": \"<|eos|>\"}, "
    "\"additional_special_tokens\": [\"<|im_start|>\", \"<|im_end|>\"]}}";

static json_t *ctx;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_quiet();
    if (ctx == NULL) {
        json_error_t e;
        ctx = json_loads(conversation, 0, &e);
        FUZZ_CHECK(ctx != NULL, "conversation: %s", e.text);
    }
    duet_oai_template_t *tmpl = NULL;
    duet_error_clear();
    duet_status_t st = duet_oai_template_create_jinja((const char *)data, size, "fuzz.jinja",
                                                      json_object_get(ctx, "config"), NULL, &tmpl);
    if (st != DUET_OK) {
        FUZZ_CHECK(st < 0 && tmpl == NULL && duet_error_last()[0] != '\0',
                   "refusal %d without a detail", (int)st);
        return 0;
    }
    const struct tm now = {.tm_year = 125, .tm_mon = 0, .tm_mday = 2, .tm_hour = 3, .tm_min = 4};
    for (int gen = 0; gen < 2; gen++) {
        const duet_oai_chat_t chat = {.messages = json_object_get(ctx, "messages"),
                                      .tools = gen ? json_object_get(ctx, "tools") : NULL,
                                      .documents = gen ? json_object_get(ctx, "documents") : NULL,
                                      .kwargs = gen ? json_object_get(ctx, "kwargs") : NULL,
                                      .add_generation_prompt = gen != 0,
                                      .now = &now};
        duet_jinja_output_t out;
        duet_error_clear();
        st = duet__oai_template_render_limits(tmpl, &chat, &FUZZ_LIMITS, &out);
        if (st != DUET_OK) {
            /* raise_exception(msg)'s detail is msg exactly, which may be empty (as in jinja2) */
            FUZZ_CHECK(st < 0 && (duet_error_last()[0] != '\0' || st == DUET_ERR_FORMAT),
                       "render refusal %d without a detail", (int)st);
            FUZZ_CHECK(out.text.len == 0 && out.n_segs == 0, "output left after a refusal");
            continue;
        }
        FUZZ_CHECK(out.text.len <= FUZZ_LIMITS.max_output, "%zu bytes of output", out.text.len);
        size_t at = 0;
        for (size_t i = 0; i < out.n_segs; i++) {
            const duet_jinja_segment_t *sg = &out.segs[i];
            FUZZ_CHECK(sg->off == at && sg->len > 0, "segment %zu at %zu+%zu, expected at %zu", i,
                       sg->off, sg->len, at);
            FUZZ_CHECK(sg->origin == DUET_JINJA_ORIGIN_TEMPLATE ||
                           sg->origin == DUET_JINJA_ORIGIN_DATA,
                       "origin %d", (int)sg->origin);
            FUZZ_CHECK(i == 0 || sg->origin != out.segs[i - 1].origin,
                       "adjacent segments %zu, %zu share an origin", i - 1, i);
            at += sg->len;
        }
        FUZZ_CHECK(at == out.text.len, "segments cover %zu of %zu bytes", at, out.text.len);
        FUZZ_CHECK(duet_utf8_valid(out.text.data != NULL ? out.text.data : "", out.text.len),
                   "the output is not valid UTF-8");
        duet_jinja_output_free(&out);
    }
    duet_oai_template_destroy(tmpl);
    return 0;
}
