/*
 * OpenAI API layer (see openai.h): request validation, prompt tokens, streaming text with stop
 * strings, and the response bytes.
 *
 * Responses are written by hand into a strbuf rather than built as jansson trees: they are made
 * once per generated token, their shape is fixed, and writing them directly keeps the key order
 * and the bytes exactly what the tests (and the clients) see. Every string goes through one
 * escaper that also repairs ill-formed UTF-8, so no input can make us send invalid JSON.
 *
 * Requests are parsed with jansson (duplicate keys refused) and checked field by field against a
 * table of every field the endpoint knows; error messages follow OpenAI's wording where one
 * exists ("Invalid type for 'x': ...", "Unsupported parameter: 'x' ...") so clients that match
 * on them keep working. The log-probability and logit-processing fields are parsed and their
 * JSON written by openai_logprobs.c (duet_oai_lp_parse; meta.logprobs_json); this file only calls
 * it and puts that JSON where "logprobs" goes.
 */
#define _GNU_SOURCE /* memmem */
#include "router/api/openai.h"

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/json.h"
#include "common/log.h"
#include "common/utf8.h"
#include "router/api/openai_logprobs.h"
#include "router/api/response_format.h"

#define OAI_DEFAULT_MAX_MESSAGES 1024

/* ---------------------------------------------------------------- UTF-8 */

/* Copy src into dst[cap], truncated at a character boundary. */
static void oai_copy_trunc(char *dst, size_t cap, const char *src)
{
    size_t n = strlen(src);
    if (n >= cap) {
        n = cap - 1;
        size_t start = n;
        while (start > 0 && n - start < 3 && ((uint8_t)src[start - 1] & 0xc0) == 0x80)
            start--;
        if (start > 0 && ((uint8_t)src[start - 1] & 0x80) != 0 &&
            duet_utf8_char((const uint8_t *)src + start - 1, n - start + 1, NULL) != n - start + 1)
            n = start - 1;
    }
    memcpy(dst, src, n);
    dst[n] = '\0';
}

duet_status_t duet_oai_json_string(duet_strbuf_t *out, const char *s, size_t len)
{
    static const char hex[] = "0123456789abcdef";
    const uint8_t *p = (const uint8_t *)s;
    duet_strbuf_append(out, "\"", 1);
    size_t run = 0; /* start of the pending run of bytes copied as they are */
    for (size_t i = 0; i < len;) {
        uint8_t c = p[i];
        if (c >= 0x20 && c != '"' && c != '\\' && c < 0x80) {
            i++;
            continue;
        }
        size_t cl = c < 0x80 ? 1 : duet_utf8_char(p + i, len - i, NULL);
        if (cl > 1) {
            i += cl;
            continue;
        }
        duet_strbuf_append(out, s + run, i - run);
        if (cl == 0) {
            duet_strbuf_append(out, "\xef\xbf\xbd", 3); /* U+FFFD */
        } else if (c == '"' || c == '\\') {
            char e[2] = {'\\', (char)c};
            duet_strbuf_append(out, e, 2);
        } else if (c == '\n') {
            duet_strbuf_append(out, "\\n", 2);
        } else if (c == '\r') {
            duet_strbuf_append(out, "\\r", 2);
        } else if (c == '\t') {
            duet_strbuf_append(out, "\\t", 2);
        } else {
            char e[6] = {'\\', 'u', '0', '0', hex[c >> 4], hex[c & 15]};
            duet_strbuf_append(out, e, 6);
        }
        i++;
        run = i;
    }
    duet_strbuf_append(out, s + run, len - run);
    duet_strbuf_append(out, "\"", 1);
    return duet_strbuf_status(out);
}

/* A JSON string or null (for "" or NULL). */
static void oai_json_string_or_null(duet_strbuf_t *out, const char *s)
{
    if (s == NULL || s[0] == '\0')
        duet_strbuf_puts(out, "null");
    else
        duet_oai_json_string(out, s, strlen(s));
}

/* ---------------------------------------------------------------- errors */

const char *duet_oai_finish_name(duet_oai_finish_t f)
{
    switch (f) {
    case DUET_OAI_FINISH_STOP:
        return "stop";
    case DUET_OAI_FINISH_LENGTH:
        return "length";
    case DUET_OAI_FINISH_TOOL_CALLS:
        return "tool_calls";
    case DUET_OAI_FINISH_NONE:
        break;
    }
    return NULL;
}

static duet_status_t oai_error_vmake(duet_oai_error_t *err, int http_status, const char *type,
                                     const char *code, const char *param, const char *fmt,
                                     va_list ap)
{
    char msg[1024];
    vsnprintf(msg, sizeof(msg), fmt, ap);
    err->http_status = http_status;
    oai_copy_trunc(err->type, sizeof(err->type), type != NULL ? type : "invalid_request_error");
    oai_copy_trunc(err->code, sizeof(err->code), code != NULL ? code : "");
    oai_copy_trunc(err->param, sizeof(err->param), param != NULL ? param : "");
    oai_copy_trunc(err->message, sizeof(err->message), msg);
    return DUET_ERR_INVALID;
}

duet_status_t duet_oai_error_make(duet_oai_error_t *err, int http_status, const char *type,
                                  const char *code, const char *param, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    duet_status_t st = oai_error_vmake(err, http_status, type, code, param, fmt, ap);
    va_end(ap);
    return st;
}

duet_status_t duet_oai_error_json(const duet_oai_error_t *err, duet_strbuf_t *out)
{
    duet_strbuf_puts(out, "{\"error\":{\"message\":");
    duet_oai_json_string(out, err->message, strnlen(err->message, sizeof(err->message)));
    duet_strbuf_puts(out, ",\"type\":");
    oai_json_string_or_null(out, err->type);
    duet_strbuf_puts(out, ",\"param\":");
    oai_json_string_or_null(out, err->param);
    duet_strbuf_puts(out, ",\"code\":");
    oai_json_string_or_null(out, err->code);
    duet_strbuf_puts(out, "}}");
    return duet_strbuf_status(out);
}

duet_status_t duet_oai_sse_error(const duet_oai_error_t *err, duet_strbuf_t *out)
{
    duet_strbuf_puts(out, "data: ");
    duet_oai_error_json(err, out);
    duet_strbuf_puts(out, "\n\n");
    return duet_strbuf_status(out);
}

/* ---------------------------------------------------------------- request parsing */

typedef struct {
    const duet_oai_limits_t *lim;
    duet_oai_endpoint_t ep;
    json_t *root;
    duet_oai_request_t *req;
    duet_oai_error_t *err;
} oai_parse_t;

#define OAI_EP_COMPL (1u << DUET_OAI_ENDPOINT_COMPLETIONS)
#define OAI_EP_CHAT  (1u << DUET_OAI_ENDPOINT_CHAT)
#define OAI_EP_BOTH  (OAI_EP_COMPL | OAI_EP_CHAT)

/* How a field is treated. */
typedef enum {
    OAI_F_USED = 0, /* read by its own code below */
    OAI_F_ANY,      /* accepted and ignored whatever its value */
    OAI_F_FALSE,    /* false accepted; true unsupported */
    OAI_F_ZERO,     /* 0 accepted; any other number unsupported */
    OAI_F_ONE,      /* 1 accepted; any other number unsupported */
    OAI_F_EMPTY,    /* empty (of json type `jtype`) accepted; anything else unsupported */
    OAI_F_NEVER,    /* any non-null value unsupported */
    OAI_F_CUSTOM,   /* modalities: see oai_check_custom */
} oai_field_kind_t;

typedef struct {
    const char *name;
    unsigned endpoints;
    oai_field_kind_t kind;
    json_type jtype; /* OAI_F_EMPTY only */
} oai_field_t;

/* Every field of the two endpoints. Anything else is "Unrecognized request argument". */
static const oai_field_t oai_fields[] = {
    {"model", OAI_EP_BOTH, OAI_F_USED, 0},
    {"prompt", OAI_EP_COMPL, OAI_F_USED, 0},
    {"messages", OAI_EP_CHAT, OAI_F_USED, 0},
    {"max_tokens", OAI_EP_BOTH, OAI_F_USED, 0},
    {"max_completion_tokens", OAI_EP_CHAT, OAI_F_USED, 0},
    {"temperature", OAI_EP_BOTH, OAI_F_USED, 0},
    {"top_p", OAI_EP_BOTH, OAI_F_USED, 0},
    {"top_k", OAI_EP_BOTH, OAI_F_USED, 0},
    {"seed", OAI_EP_BOTH, OAI_F_USED, 0},
    {"stop", OAI_EP_BOTH, OAI_F_USED, 0},
    {"ignore_eos", OAI_EP_BOTH, OAI_F_USED, 0},
    {"skip_special_tokens", OAI_EP_BOTH, OAI_F_USED, 0},
    {"stream", OAI_EP_BOTH, OAI_F_USED, 0},
    {"stream_options", OAI_EP_BOTH, OAI_F_USED, 0},
    {"n", OAI_EP_BOTH, OAI_F_USED, 0},
    {"user", OAI_EP_BOTH, OAI_F_USED, 0},
    {"parallel_tool_calls", OAI_EP_CHAT, OAI_F_ANY, 0},
    {"store", OAI_EP_CHAT, OAI_F_ANY, 0},
    {"metadata", OAI_EP_CHAT, OAI_F_ANY, 0},
    {"service_tier", OAI_EP_BOTH, OAI_F_ANY, 0},
    /* read by duet_oai_lp_parse (openai_logprobs.c) */
    {"echo", OAI_EP_COMPL, OAI_F_USED, 0},
    {"logprobs", OAI_EP_BOTH, OAI_F_USED, 0},
    {"frequency_penalty", OAI_EP_BOTH, OAI_F_USED, 0},
    {"presence_penalty", OAI_EP_BOTH, OAI_F_USED, 0},
    {"top_logprobs", OAI_EP_CHAT, OAI_F_USED, 0},
    {"repetition_penalty", OAI_EP_BOTH, OAI_F_USED, 0},
    {"logit_bias", OAI_EP_BOTH, OAI_F_USED, 0},
    {"min_tokens", OAI_EP_BOTH, OAI_F_USED, 0},
    {"stop_token_ids", OAI_EP_BOTH, OAI_F_USED, 0},
    {"min_p", OAI_EP_BOTH, OAI_F_ZERO, 0},
    {"best_of", OAI_EP_COMPL, OAI_F_USED, 0},
    {"tools", OAI_EP_CHAT, OAI_F_USED, 0},
    {"functions", OAI_EP_CHAT, OAI_F_EMPTY, JSON_ARRAY},
    {"suffix", OAI_EP_COMPL, OAI_F_EMPTY, JSON_STRING},
    {"function_call", OAI_EP_CHAT, OAI_F_NEVER, 0},
    {"audio", OAI_EP_CHAT, OAI_F_NEVER, 0},
    {"prediction", OAI_EP_CHAT, OAI_F_NEVER, 0},
    {"reasoning_effort", OAI_EP_CHAT, OAI_F_NEVER, 0},
    {"web_search_options", OAI_EP_CHAT, OAI_F_NEVER, 0},
    {"tool_choice", OAI_EP_CHAT, OAI_F_USED, 0},
    {"response_format", OAI_EP_CHAT, OAI_F_USED, 0}, /* response_format.c */
    {"modalities", OAI_EP_CHAT, OAI_F_CUSTOM, 0},
};
#define OAI_N_FIELDS (sizeof(oai_fields) / sizeof(oai_fields[0]))

static const oai_field_t *oai_field_find(duet_oai_endpoint_t ep, const char *name)
{
    for (size_t i = 0; i < OAI_N_FIELDS; i++)
        if ((oai_fields[i].endpoints & (1u << ep)) != 0 && strcmp(oai_fields[i].name, name) == 0)
            return &oai_fields[i];
    return NULL;
}

/* "an integer", "a number", ...: for "expected X" messages. */
static const char *oai_got(const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT:
        return "an object";
    case JSON_ARRAY:
        return "an array";
    case JSON_STRING:
        return "a string";
    case JSON_INTEGER:
        return "an integer";
    case JSON_REAL:
        return "a decimal number";
    case JSON_TRUE:
    case JSON_FALSE:
        return "a boolean";
    case JSON_NULL:
        return "null";
    }
    return "something else";
}

static duet_status_t oai_bad_type(oai_parse_t *p, const char *param, const char *want,
                                  const json_t *v)
{
    return duet_oai_error_make(p->err, 400, NULL, "invalid_type", param,
                               "Invalid type for '%s': expected %s, but got %s instead.", param,
                               want, oai_got(v));
}

static duet_status_t oai_bad_value(oai_parse_t *p, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static duet_status_t oai_bad_value(oai_parse_t *p, const char *param, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    duet_status_t st = oai_error_vmake(p->err, 400, NULL, "invalid_value", param, fmt, ap);
    va_end(ap);
    return st;
}

static duet_status_t oai_missing(oai_parse_t *p, const char *param)
{
    return duet_oai_error_make(p->err, 400, NULL, "missing_required_parameter", param,
                               "Missing required parameter: '%s'.", param);
}

static duet_status_t oai_unsupported(oai_parse_t *p, const char *param, const char *why)
{
    return duet_oai_error_make(p->err, 400, NULL, "unsupported_parameter", param,
                               "Unsupported parameter: '%s' is not supported by this server%s%s.",
                               param, why[0] != '\0' ? " " : "", why);
}

static duet_status_t oai_nomem(oai_parse_t *p)
{
    duet_oai_error_make(p->err, 500, "server_error", NULL, NULL,
                        "The server ran out of memory while reading the request.");
    return DUET_ERR_NOMEM;
}

/* The value of an optional field: NULL when absent or JSON null. */
static json_t *oai_opt(const oai_parse_t *p, const char *key)
{
    json_t *v = json_object_get(p->root, key);
    return json_is_null(v) ? NULL : v;
}

static char *oai_strdup(const char *s, size_t len)
{
    char *d = malloc(len + 1);
    if (d != NULL) {
        memcpy(d, s, len);
        d[len] = '\0';
    }
    return d;
}

static duet_status_t oai_int_field(oai_parse_t *p, const char *key, int64_t *v_p, bool *present_p)
{
    json_t *v = oai_opt(p, key);
    *present_p = v != NULL;
    if (v == NULL)
        return DUET_OK;
    if (!json_is_integer(v))
        return oai_bad_type(p, key, "an integer", v);
    *v_p = json_integer_value(v);
    return DUET_OK;
}

static duet_status_t oai_num_field(oai_parse_t *p, const char *key, double *v_p, bool *present_p)
{
    json_t *v = oai_opt(p, key);
    *present_p = v != NULL;
    if (v == NULL)
        return DUET_OK;
    if (!json_is_number(v))
        return oai_bad_type(p, key, "a number", v);
    *v_p = json_number_value(v);
    return DUET_OK;
}

static duet_status_t oai_bool_field(oai_parse_t *p, const char *key, bool *v_p)
{
    json_t *v = oai_opt(p, key);
    if (v == NULL)
        return DUET_OK;
    if (!json_is_boolean(v))
        return oai_bad_type(p, key, "a boolean", v);
    *v_p = json_is_true(v);
    return DUET_OK;
}

/* ---- model */

static duet_status_t oai_parse_model(oai_parse_t *p)
{
    json_t *v = oai_opt(p, "model");
    if (v == NULL)
        return oai_missing(p, "model");
    if (!json_is_string(v))
        return oai_bad_type(p, "model", "a string", v);
    const char *name = p->lim->model_name != NULL ? p->lim->model_name : "";
    if (json_string_length(v) != strlen(name) || strcmp(json_string_value(v), name) != 0)
        return duet_oai_error_make(p->err, 404, NULL, "model_not_found", "model",
                                   "The model `%.200s` does not exist or you do not have access "
                                   "to it. This server serves `%.200s`.",
                                   json_string_value(v), name);
    return DUET_OK;
}

/* ---- prompt (completions) */

static duet_status_t oai_prompt_ids(oai_parse_t *p, const json_t *arr, const char *param)
{
    size_t n = json_array_size(arr);
    duet_oai_request_t *req = p->req;
    if (p->lim->max_prompt_tokens > 0 && n > p->lim->max_prompt_tokens)
        return duet_oai_error_make(p->err, 400, NULL, "context_length_exceeded", param,
                                   "The prompt has %zu tokens; this server accepts at most %zu.", n,
                                   p->lim->max_prompt_tokens);
    req->prompt_ids = malloc(n * sizeof(*req->prompt_ids));
    if (req->prompt_ids == NULL)
        return oai_nomem(p);
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(arr, i);
        char where[64];
        snprintf(where, sizeof(where), "%s[%zu]", param, i);
        if (!json_is_integer(e))
            return oai_bad_type(p, where, "an integer token id", e);
        json_int_t id = json_integer_value(e);
        uint32_t vocab = p->lim->vocab_size > 0 ? p->lim->vocab_size : DUET_TOKENIZER_MAX_ID + 1;
        if (id < 0 || id >= (json_int_t)vocab)
            return oai_bad_value(p, where,
                                 "Invalid token id %" JSON_INTEGER_FORMAT
                                 " in '%s': ids must be in [0, %u).",
                                 id, where, vocab);
        req->prompt_ids[i] = (uint32_t)id;
    }
    req->n_prompt_ids = n;
    return DUET_OK;
}

static duet_status_t oai_parse_prompt(oai_parse_t *p)
{
    json_t *v = oai_opt(p, "prompt");
    duet_oai_request_t *req = p->req;
    if (v == NULL)
        return oai_missing(p, "prompt");
    if (json_is_array(v)) {
        size_t n = json_array_size(v);
        if (n == 0)
            return oai_bad_value(p, "prompt", "Invalid 'prompt': the array is empty.");
        json_t *first = json_array_get(v, 0);
        if (json_is_integer(first))
            return oai_prompt_ids(p, v, "prompt");
        if (!json_is_string(first) && !json_is_array(first))
            return oai_bad_type(p, "prompt[0]", "a string, a token id or an array of token ids",
                                first);
        if (n > 1)
            return duet_oai_error_make(p->err, 400, NULL, "unsupported_value", "prompt",
                                       "Batched prompts (%zu in one request) are not supported: "
                                       "send one request per prompt.",
                                       n);
        if (json_is_array(first)) {
            if (json_array_size(first) == 0)
                return oai_bad_value(p, "prompt[0]", "Invalid 'prompt[0]': the array is empty.");
            return oai_prompt_ids(p, first, "prompt[0]");
        }
        v = first;
    } else if (!json_is_string(v)) {
        return oai_bad_type(p, "prompt", "a string or an array of token ids", v);
    }
    req->prompt_len = json_string_length(v);
    req->prompt = oai_strdup(json_string_value(v), req->prompt_len);
    return req->prompt != NULL ? DUET_OK : oai_nomem(p);
}

/* ---- messages (chat) */

static duet_status_t oai_parse_content(oai_parse_t *p, size_t i, const json_t *c,
                                       duet_oai_message_t *m)
{
    char where[96];
    snprintf(where, sizeof(where), "messages[%zu].content", i);
    if (json_is_string(c)) {
        m->content_len = json_string_length(c);
        m->content = oai_strdup(json_string_value(c), m->content_len);
        return m->content != NULL ? DUET_OK : oai_nomem(p);
    }
    if (!json_is_array(c))
        return oai_bad_type(p, where, "a string or an array of content parts", c);
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    duet_status_t st = DUET_OK;
    size_t j;
    json_t *part;
    json_array_foreach(c, j, part)
    {
        char pw[128];
        snprintf(pw, sizeof(pw), "%s[%zu]", where, j);
        if (!json_is_object(part)) {
            st = oai_bad_type(p, pw, "an object", part);
            break;
        }
        json_t *type = json_object_get(part, "type");
        char tw[136];
        snprintf(tw, sizeof(tw), "%s.type", pw);
        if (type == NULL) {
            st = oai_missing(p, tw);
            break;
        }
        if (!json_is_string(type)) {
            st = oai_bad_type(p, tw, "a string", type);
            break;
        }
        if (strcmp(json_string_value(type), "text") != 0) {
            st = duet_oai_error_make(p->err, 400, NULL, "unsupported_value", tw,
                                     "Content part type '%.64s' in '%s' is not supported: this "
                                     "model reads text only (type 'text').",
                                     json_string_value(type), pw);
            break;
        }
        json_t *text = json_object_get(part, "text");
        snprintf(tw, sizeof(tw), "%s.text", pw);
        if (text == NULL || json_is_null(text)) {
            st = oai_missing(p, tw);
            break;
        }
        if (!json_is_string(text)) {
            st = oai_bad_type(p, tw, "a string", text);
            break;
        }
        if (duet_strbuf_append(&sb, json_string_value(text), json_string_length(text)) != DUET_OK) {
            st = oai_nomem(p);
            break;
        }
    }
    if (st == DUET_OK) {
        m->content_len = sb.len;
        m->content = duet_strbuf_detach(&sb);
        if (m->content == NULL)
            st = oai_nomem(p);
    }
    duet_strbuf_free(&sb);
    return st;
}

/* Message keys other than role/content/name: null (or an empty array) unless the template is
 * Jinja, where an assistant's tool_calls and a tool message's tool_call_id carry the history. */
static const char *const oai_msg_null_keys[] = {"tool_calls", "tool_call_id", "function_call",
                                                "refusal", "audio"};

/* A string field of `obj` at where.key that must be present (and not empty when nonempty). */
static duet_status_t oai_need_string(oai_parse_t *p, const json_t *obj, const char *where,
                                     const char *key, bool nonempty)
{
    char kw[256];
    snprintf(kw, sizeof(kw), "%s.%s", where, key);
    const json_t *v = json_object_get(obj, key);
    if (v == NULL || json_is_null(v))
        return oai_missing(p, kw);
    if (!json_is_string(v))
        return oai_bad_type(p, kw, "a string", v);
    if (nonempty && json_string_length(v) == 0)
        return oai_bad_value(p, kw, "Invalid '%s': empty string. Expected a non-empty string.", kw);
    return DUET_OK;
}

/* An assistant's tool_calls: [{id, type: "function", function: {name, arguments}}, ...]. */
static duet_status_t oai_parse_tool_calls(oai_parse_t *p, const char *where, const json_t *v)
{
    char kw[160];
    snprintf(kw, sizeof(kw), "%s.tool_calls", where);
    if (!json_is_array(v))
        return oai_bad_type(p, kw, "an array of tool calls", v);
    size_t i;
    const json_t *tc;
    json_array_foreach(v, i, tc)
    {
        char cw[200], fw[224];
        snprintf(cw, sizeof(cw), "%s[%zu]", kw, i);
        if (!json_is_object(tc))
            return oai_bad_type(p, cw, "an object", tc);
        const char *key;
        json_t *val;
        json_object_foreach((json_t *)tc, key, val)
        {
            if (strcmp(key, "id") != 0 && strcmp(key, "type") != 0 && strcmp(key, "function") != 0)
                return duet_oai_error_make(p->err, 400, NULL, "unrecognized_argument", cw,
                                           "Unrecognized argument in '%s': '%.48s'.", cw, key);
        }
        duet_status_t st = oai_need_string(p, tc, cw, "id", true);
        if (st == DUET_OK)
            st = oai_need_string(p, tc, cw, "type", false);
        if (st != DUET_OK)
            return st;
        if (strcmp(json_string_value(json_object_get(tc, "type")), "function") != 0) {
            snprintf(fw, sizeof(fw), "%s.type", cw);
            return oai_bad_value(p, fw,
                                 "Invalid value for '%s': '%.64s'. Supported values are: "
                                 "'function'.",
                                 fw, json_string_value(json_object_get(tc, "type")));
        }
        const json_t *fn = json_object_get(tc, "function");
        snprintf(fw, sizeof(fw), "%s.function", cw);
        if (fn == NULL || json_is_null(fn))
            return oai_missing(p, fw);
        if (!json_is_object(fn))
            return oai_bad_type(p, fw, "an object", fn);
        json_object_foreach((json_t *)fn, key, val)
        {
            if (strcmp(key, "name") != 0 && strcmp(key, "arguments") != 0)
                return duet_oai_error_make(p->err, 400, NULL, "unrecognized_argument", fw,
                                           "Unrecognized argument in '%s': '%.48s'.", fw, key);
        }
        if ((st = oai_need_string(p, fn, fw, "name", true)) != DUET_OK ||
            (st = oai_need_string(p, fn, fw, "arguments", false)) != DUET_OK)
            return st;
    }
    return DUET_OK;
}

static duet_status_t oai_parse_message(oai_parse_t *p, size_t i, const json_t *msg,
                                       duet_oai_message_t *m)
{
    char where[96];
    snprintf(where, sizeof(where), "messages[%zu]", i);
    if (!json_is_object(msg))
        return oai_bad_type(p, where, "an object", msg);
    const bool jinja = p->lim->jinja_template;

    char rw[112];
    snprintf(rw, sizeof(rw), "%s.role", where);
    json_t *role = json_object_get(msg, "role");
    if (role == NULL || json_is_null(role))
        return oai_missing(p, rw);
    if (!json_is_string(role))
        return oai_bad_type(p, rw, "a string", role);
    const char *r = json_string_value(role);
    bool tool = false;
    if (strcmp(r, "system") == 0 || strcmp(r, "developer") == 0)
        m->role = DUET_OAI_ROLE_SYSTEM;
    else if (strcmp(r, "user") == 0)
        m->role = DUET_OAI_ROLE_USER;
    else if (strcmp(r, "assistant") == 0)
        m->role = DUET_OAI_ROLE_ASSISTANT;
    else if (strcmp(r, "tool") == 0 && jinja)
        m->role = DUET_OAI_ROLE_USER, tool = true; /* role is only read by duet's format */
    else if (strcmp(r, "tool") == 0)
        return oai_bad_value(p, rw,
                             "Invalid value for '%s': 'tool'. This model's chat template "
                             "(duet's format) has no tool messages; supported values are: "
                             "'system', 'developer', 'user' and 'assistant'.",
                             rw);
    else
        return oai_bad_value(p, rw,
                             "Invalid value for '%s': '%.64s'. Supported values are: 'system', "
                             "'developer', 'user'%s.",
                             rw, r, jinja ? ", 'assistant' and 'tool'" : " and 'assistant'");

    bool has_calls = false;
    const char *key;
    json_t *val;
    json_object_foreach((json_t *)msg, key, val)
    {
        char kw[160];
        snprintf(kw, sizeof(kw), "%s.%.48s", where, key);
        if (strcmp(key, "role") == 0 || strcmp(key, "content") == 0)
            continue;
        if (strcmp(key, "name") == 0) {
            if (!json_is_string(val) && !json_is_null(val))
                return oai_bad_type(p, kw, "a string", val);
            continue;
        }
        bool known = false;
        for (size_t k = 0; k < sizeof(oai_msg_null_keys) / sizeof(oai_msg_null_keys[0]); k++)
            known = known || strcmp(key, oai_msg_null_keys[k]) == 0;
        if (!known)
            return duet_oai_error_make(p->err, 400, NULL, "unrecognized_argument", kw,
                                       "Unrecognized argument in a message: '%s'.", kw);
        if (json_is_null(val) || (json_is_array(val) && json_array_size(val) == 0))
            continue;
        if (jinja && m->role == DUET_OAI_ROLE_ASSISTANT && !tool &&
            strcmp(key, "tool_calls") == 0) {
            duet_status_t st = oai_parse_tool_calls(p, where, val);
            if (st != DUET_OK)
                return st;
            has_calls = true;
            continue;
        }
        if (jinja && tool && strcmp(key, "tool_call_id") == 0) {
            if (!json_is_string(val))
                return oai_bad_type(p, kw, "a string", val);
            continue;
        }
        if (strcmp(key, "tool_calls") == 0 || strcmp(key, "tool_call_id") == 0)
            return oai_unsupported(p, kw,
                                   jinja ? (strcmp(key, "tool_calls") == 0
                                                ? "(only in an assistant message)"
                                                : "(only in a tool message)")
                                         : "(this model's chat template, duet's format, has no "
                                           "tool calls)");
        return oai_unsupported(p, kw, "(no audio or refusal content in the history)");
    }
    if (tool) {
        duet_status_t st = oai_need_string(p, msg, where, "tool_call_id", false);
        if (st != DUET_OK)
            return st;
    }

    json_t *content = json_object_get(msg, "content");
    if (content == NULL || json_is_null(content)) {
        if (m->role != DUET_OAI_ROLE_ASSISTANT || tool) {
            char cw[112];
            snprintf(cw, sizeof(cw), "%s.content", where);
            return oai_missing(p, cw);
        }
        (void)has_calls; /* an assistant turn may be tool calls alone, or empty */
        m->content = oai_strdup("", 0);
        m->content_len = 0;
        return m->content != NULL ? DUET_OK : oai_nomem(p);
    }
    return oai_parse_content(p, i, content, m);
}

static duet_status_t oai_parse_messages(oai_parse_t *p)
{
    json_t *v = oai_opt(p, "messages");
    duet_oai_request_t *req = p->req;
    if (v == NULL)
        return oai_missing(p, "messages");
    if (!json_is_array(v))
        return oai_bad_type(p, "messages", "an array", v);
    size_t n = json_array_size(v);
    size_t cap = p->lim->max_messages > 0 ? p->lim->max_messages : OAI_DEFAULT_MAX_MESSAGES;
    if (n == 0)
        return oai_bad_value(p, "messages",
                             "Invalid 'messages': empty array. Expected an array "
                             "with at least one message.");
    if (n > cap)
        return oai_bad_value(p, "messages",
                             "Invalid 'messages': %zu messages; this server accepts at most %zu.",
                             n, cap);
    req->messages = calloc(n, sizeof(*req->messages));
    if (req->messages == NULL)
        return oai_nomem(p);
    for (size_t i = 0; i < n; i++) {
        duet_status_t st = oai_parse_message(p, i, json_array_get(v, i), &req->messages[i]);
        req->n_messages = i + 1; /* so that free() sees what this message allocated */
        if (st != DUET_OK)
            return st;
    }
    /* A Jinja template reads the conversation as the OpenAI JSON it came in. */
    req->messages_json = json_incref(v);
    return DUET_OK;
}

/* ---- sampling and stopping */

static duet_status_t oai_parse_max_tokens(oai_parse_t *p)
{
    const char *keys[2] = {"max_tokens", "max_completion_tokens"};
    duet_oai_request_t *req = p->req;
    req->max_tokens = p->lim->max_tokens_default < p->lim->max_tokens_cap
                          ? p->lim->max_tokens_default
                          : p->lim->max_tokens_cap;
    for (int k = 0; k < 2; k++) {
        if (k == 1 && p->ep != DUET_OAI_ENDPOINT_CHAT)
            break;
        int64_t v = 0;
        bool present = false;
        duet_status_t st = oai_int_field(p, keys[k], &v, &present);
        if (st != DUET_OK)
            return st;
        if (!present)
            continue;
        /* 0 scores the prompt without generating: a completion with echo only */
        const bool scoring = v == 0 && p->ep == DUET_OAI_ENDPOINT_COMPLETIONS &&
                             json_is_true(json_object_get(p->root, "echo"));
        if (v < 1 && !scoring)
            return oai_bad_value(p, keys[k],
                                 "Invalid '%s': integer below minimum value. Expected a value >= "
                                 "1 (0 only with echo), but got %" PRId64 " instead.",
                                 keys[k], v);
        if (v > (int64_t)p->lim->max_tokens_cap)
            return oai_bad_value(p, keys[k],
                                 "Invalid '%s': %" PRId64 " is too large. This server generates "
                                 "at most %u tokens per request.",
                                 keys[k], v, p->lim->max_tokens_cap);
        req->max_tokens = (uint32_t)v; /* max_completion_tokens (read second) wins */
    }
    return DUET_OK;
}

/* n in [1, DUET_OAI_MAX_N]; completions' best_of in [n, DUET_OAI_MAX_N] (n when absent). */
static duet_status_t oai_parse_n(oai_parse_t *p)
{
    int64_t n = 1, best_of = 0;
    bool present = false, has_best = false;
    duet_status_t st = oai_int_field(p, "n", &n, &present);
    if (st != DUET_OK)
        return st;
    if (n < 1 || n > DUET_OAI_MAX_N)
        return oai_bad_value(p, "n",
                             "Invalid 'n': %" PRId64 ". Expected a value in [1, %d] (choices "
                             "per request on this server).",
                             n, DUET_OAI_MAX_N);
    p->req->n = p->req->best_of = (uint32_t)n;
    if (p->ep != DUET_OAI_ENDPOINT_COMPLETIONS)
        return DUET_OK;
    if ((st = oai_int_field(p, "best_of", &best_of, &has_best)) != DUET_OK || !has_best)
        return st;
    if (best_of < n || best_of > DUET_OAI_MAX_N)
        return oai_bad_value(p, "best_of",
                             "Invalid 'best_of': %" PRId64 ". Expected a value in [n, %d] (n = "
                             "%" PRId64 ").",
                             best_of, DUET_OAI_MAX_N, n);
    p->req->best_of = (uint32_t)best_of;
    return DUET_OK;
}

static duet_status_t oai_parse_sampling(oai_parse_t *p)
{
    duet_oai_request_t *req = p->req;
    bool present;
    duet_status_t st;
    req->temperature = 1.0;
    req->top_p = 1.0;
    if ((st = oai_num_field(p, "temperature", &req->temperature, &present)) != DUET_OK)
        return st;
    if (present && !(req->temperature >= 0.0 && req->temperature <= 2.0))
        return oai_bad_value(p, "temperature",
                             "Invalid 'temperature': %g is out of range. Expected a value in "
                             "[0, 2].",
                             req->temperature);
    if ((st = oai_num_field(p, "top_p", &req->top_p, &present)) != DUET_OK)
        return st;
    if (present && !(req->top_p > 0.0 && req->top_p <= 1.0))
        return oai_bad_value(p, "top_p",
                             "Invalid 'top_p': %g is out of range. Expected a value in (0, 1].",
                             req->top_p);
    int64_t k = 0;
    if ((st = oai_int_field(p, "top_k", &k, &present)) != DUET_OK)
        return st;
    if (present && k < -1)
        return oai_bad_value(p, "top_k",
                             "Invalid 'top_k': %" PRId64 ". Expected -1 or 0 (no limit) or a "
                             "positive integer.",
                             k);
    req->top_k = k < 0 ? 0 : k;
    if ((st = oai_int_field(p, "seed", &req->seed, &req->has_seed)) != DUET_OK)
        return st;

    if ((st = oai_parse_n(p)) != DUET_OK)
        return st;
    if ((st = oai_bool_field(p, "ignore_eos", &req->ignore_eos)) != DUET_OK)
        return st;
    req->skip_special_tokens = true;
    if ((st = oai_bool_field(p, "skip_special_tokens", &req->skip_special_tokens)) != DUET_OK)
        return st;

    json_t *u = oai_opt(p, "user");
    if (u != NULL) {
        if (!json_is_string(u))
            return oai_bad_type(p, "user", "a string", u);
        req->user = oai_strdup(json_string_value(u), json_string_length(u));
        if (req->user == NULL)
            return oai_nomem(p);
    }
    return DUET_OK;
}

static duet_status_t oai_add_stop(oai_parse_t *p, const json_t *s, const char *where)
{
    duet_oai_request_t *req = p->req;
    if (!json_is_string(s))
        return oai_bad_type(p, where, "a string", s);
    size_t len = json_string_length(s);
    if (len == 0)
        return oai_bad_value(p, where, "Invalid '%s': stop strings must not be empty.", where);
    if (len > DUET_OAI_MAX_STOP_LEN)
        return oai_bad_value(p, where,
                             "Invalid '%s': a stop string of %zu bytes is too long (at most %d).",
                             where, len, DUET_OAI_MAX_STOP_LEN);
    req->stop[req->n_stop] = oai_strdup(json_string_value(s), len);
    if (req->stop[req->n_stop] == NULL)
        return oai_nomem(p);
    req->stop_len[req->n_stop++] = len;
    return DUET_OK;
}

static duet_status_t oai_parse_stop(oai_parse_t *p)
{
    json_t *v = oai_opt(p, "stop");
    if (v == NULL)
        return DUET_OK;
    if (json_is_string(v))
        return oai_add_stop(p, v, "stop");
    if (!json_is_array(v))
        return oai_bad_type(p, "stop", "a string or an array of strings", v);
    if (json_array_size(v) > DUET_OAI_MAX_STOP)
        return oai_bad_value(p, "stop", "Invalid 'stop': %zu stop strings; at most %d are allowed.",
                             json_array_size(v), DUET_OAI_MAX_STOP);
    size_t i;
    json_t *s;
    json_array_foreach(v, i, s)
    {
        char where[32];
        snprintf(where, sizeof(where), "stop[%zu]", i);
        duet_status_t st = oai_add_stop(p, s, where);
        if (st != DUET_OK)
            return st;
    }
    return DUET_OK;
}

static duet_status_t oai_parse_stream(oai_parse_t *p)
{
    duet_oai_request_t *req = p->req;
    duet_status_t st = oai_bool_field(p, "stream", &req->stream);
    if (st != DUET_OK)
        return st;
    json_t *so = oai_opt(p, "stream_options");
    if (so == NULL)
        return DUET_OK;
    if (!json_is_object(so))
        return oai_bad_type(p, "stream_options", "an object", so);
    if (!req->stream)
        return oai_bad_value(p, "stream_options",
                             "The 'stream_options' parameter is only allowed when 'stream' is "
                             "enabled.");
    const char *key;
    json_t *val;
    json_object_foreach(so, key, val)
    {
        char where[96];
        snprintf(where, sizeof(where), "stream_options.%.64s", key);
        bool include = strcmp(key, "include_usage") == 0;
        if (!include && strcmp(key, "include_obfuscation") != 0)
            return duet_oai_error_make(p->err, 400, NULL, "unrecognized_argument", where,
                                       "Unrecognized argument: '%s'.", where);
        if (json_is_null(val))
            continue;
        if (!json_is_boolean(val))
            return oai_bad_type(p, where, "a boolean", val);
        if (include)
            req->include_usage = json_is_true(val);
    }
    return DUET_OK;
}

/* modalities ["text"]. */
static duet_status_t oai_check_custom(oai_parse_t *p, const char *key, const json_t *v)
{
    if (!json_is_array(v))
        return oai_bad_type(p, key, "an array", v);
    for (size_t i = 0; i < json_array_size(v); i++) {
        json_t *m = json_array_get(v, i);
        if (!json_is_string(m) || strcmp(json_string_value(m), "text") != 0)
            return oai_unsupported(p, key, "(text only)");
    }
    return DUET_OK;
}

/* Fields accepted for their harmless values only. */
static duet_status_t oai_check_harmless(oai_parse_t *p)
{
    for (size_t i = 0; i < OAI_N_FIELDS; i++) {
        const oai_field_t *f = &oai_fields[i];
        if ((f->endpoints & (1u << p->ep)) == 0 || f->kind == OAI_F_USED || f->kind == OAI_F_ANY)
            continue;
        json_t *v = oai_opt(p, f->name);
        if (v == NULL)
            continue;
        switch (f->kind) {
        case OAI_F_FALSE:
            if (!json_is_boolean(v))
                return oai_bad_type(p, f->name, "a boolean", v);
            if (json_is_true(v))
                return oai_unsupported(p, f->name, "");
            break;
        case OAI_F_ZERO:
        case OAI_F_ONE:
            if (!json_is_number(v))
                return oai_bad_type(p, f->name, "a number", v);
            if (json_number_value(v) != (f->kind == OAI_F_ZERO ? 0.0 : 1.0))
                return oai_unsupported(p, f->name,
                                       f->kind == OAI_F_ZERO ? "(only 0 is accepted)"
                                                             : "(only 1 is accepted)");
            break;
        case OAI_F_EMPTY:
            if (json_typeof(v) != f->jtype) {
                const char *want = f->jtype == JSON_OBJECT  ? "an object"
                                   : f->jtype == JSON_ARRAY ? "an array"
                                                            : "a string";
                return oai_bad_type(p, f->name, want, v);
            }
            if (json_object_size(v) != 0 || json_array_size(v) != 0 ||
                (json_is_string(v) && json_string_length(v) != 0))
                return oai_unsupported(p, f->name, "");
            break;
        case OAI_F_NEVER:
            return oai_unsupported(p, f->name, "");
        case OAI_F_CUSTOM: {
            duet_status_t st = oai_check_custom(p, f->name, v);
            if (st != DUET_OK)
                return st;
            break;
        }
        case OAI_F_USED:
        case OAI_F_ANY:
            break;
        }
    }
    return DUET_OK;
}

/* Top-level fields the endpoint does not define: a 400 under lim->strict, else their names go to
 * req->ignored_fields. */
static duet_status_t oai_unknown_fields(oai_parse_t *p)
{
    const char *key;
    json_t *val;
    json_object_foreach(p->root, key, val)
    {
        if (oai_field_find(p->ep, key) != NULL)
            continue;
        if (p->lim->strict)
            return duet_oai_error_make(p->err, 400, NULL, "unrecognized_argument", key,
                                       "Unrecognized request argument supplied: %.100s", key);
        if (p->req->ignored_fields == NULL && (p->req->ignored_fields = json_array()) == NULL)
            return oai_nomem(p);
        if (json_array_append_new(p->req->ignored_fields, json_string_nocheck(key)) != 0)
            return oai_nomem(p);
    }
    return DUET_OK;
}

void duet_oai_request_free(duet_oai_request_t *req)
{
    if (req == NULL)
        return;
    free(req->prompt);
    free(req->prompt_ids);
    for (size_t i = 0; i < req->n_messages; i++)
        free(req->messages[i].content);
    free(req->messages);
    json_decref(req->messages_json);
    for (size_t i = 0; i < req->n_stop; i++)
        free(req->stop[i]);
    free(req->user);
    free(req->json_schema);
    json_decref(req->ignored_fields);
    json_decref(req->tools);
    duet_oai_lp_params_free(&req->lp);
    memset(req, 0, sizeof(*req));
}

duet_status_t duet_oai_request_parse(const duet_oai_limits_t *lim, duet_oai_endpoint_t endpoint,
                                     const char *body, size_t len, duet_oai_request_t *req_p,
                                     duet_oai_error_t *err_p)
{
    duet_oai_request_t req;
    memset(&req, 0, sizeof(req));
    req.endpoint = endpoint;
    oai_parse_t p = {.lim = lim, .ep = endpoint, .req = &req, .err = err_p};
    if (req_p != NULL)
        memset(req_p, 0, sizeof(*req_p));
    if (err_p == NULL)
        return DUET_ERR_INVALID;
    if (lim == NULL || req_p == NULL || (body == NULL && len > 0) ||
        (endpoint != DUET_OAI_ENDPOINT_COMPLETIONS && endpoint != DUET_OAI_ENDPOINT_CHAT)) {
        duet_oai_error_make(err_p, 500, "server_error", NULL, NULL, "Internal error.");
        return DUET_ERR_INVALID;
    }
    if (lim->max_body_bytes > 0 && len > lim->max_body_bytes) {
        duet_oai_error_make(err_p, 413, NULL, "request_too_large", NULL,
                            "The request body of %zu bytes is larger than the limit of %zu "
                            "bytes.",
                            len, lim->max_body_bytes);
        return DUET_ERR_RANGE;
    }
    duet_status_t st =
        duet_json_load_buffer(body != NULL ? body : "", len, "request body", (size_t)-1, &p.root);
    if (st != DUET_OK) {
        duet_oai_error_make(err_p, 400, NULL, NULL, NULL,
                            "We could not parse the JSON body of your request: %s. (The body "
                            "must be a JSON object; see https://platform.openai.com/docs/api-"
                            "reference.)",
                            duet_error_last());
        return DUET_ERR_INVALID;
    }
    if (!json_is_object(p.root)) {
        st =
            duet_oai_error_make(err_p, 400, NULL, NULL, NULL,
                                "The request body must be a JSON object, not %s.", oai_got(p.root));
        goto fail;
    }

    if ((st = oai_unknown_fields(&p)) != DUET_OK)
        goto fail;
    if ((st = oai_parse_model(&p)) != DUET_OK)
        goto fail;
    st = endpoint == DUET_OAI_ENDPOINT_CHAT ? oai_parse_messages(&p) : oai_parse_prompt(&p);
    if (st == DUET_OK)
        st = oai_parse_max_tokens(&p);
    if (st == DUET_OK)
        st = oai_parse_sampling(&p);
    if (st == DUET_OK && endpoint == DUET_OAI_ENDPOINT_CHAT) /* after skip_special_tokens */
        st = duet__oai_parse_tools(lim, p.root, &req, err_p);
    if (st == DUET_OK)
        st = oai_parse_stop(&p);
    if (st == DUET_OK)
        st = oai_parse_stream(&p);
    if (st == DUET_OK && req.stream && req.best_of > req.n) /* ranked once all have finished */
        st = duet_oai_error_make(err_p, 400, NULL, "invalid_value", "best_of",
                                 "best_of > n cannot be streamed: the best choices are known "
                                 "only once every one has finished.");
    if (st == DUET_OK)
        st = duet_oai_lp_parse(p.root, lim, &req, err_p);
    if (st == DUET_OK && endpoint == DUET_OAI_ENDPOINT_CHAT)
        st = duet_oai_rf_parse(p.root, &req, err_p);
    if (st == DUET_OK)
        st = oai_check_harmless(&p);
    if (st != DUET_OK)
        goto fail;
    json_decref(p.root);
    *req_p = req;
    return DUET_OK;

fail:
    json_decref(p.root);
    duet_oai_request_free(&req);
    return st;
}

/* ---------------------------------------------------------------- prompt tokens */

duet_status_t duet_oai_request_tokens(const duet_oai_request_t *req, const duet_oai_limits_t *lim,
                                      const duet_oai_template_t *tmpl, const duet_tokenizer_t *tok,
                                      uint32_t **ids_p, size_t *n_p, duet_oai_error_t *err_p)
{
    if (req == NULL || lim == NULL || ids_p == NULL || n_p == NULL || err_p == NULL)
        return DUET_ERR_INVALID;
    const bool chat = req->endpoint == DUET_OAI_ENDPOINT_CHAT;
    const char *param = chat ? "messages" : "prompt";
    uint32_t *ids = NULL;
    size_t n = 0;
    duet_status_t st;
    if (chat && duet_oai_template_is_jinja(tmpl) && req->messages_json != NULL) {
        duet_oai_chat_t c = {
            .messages = req->messages_json, .tools = req->tools, .add_generation_prompt = true};
        st = duet_oai_chat_prompt_json(tmpl, tok, &c, &ids, &n);
        if (st != DUET_OK && st != DUET_ERR_NOMEM && st != DUET_ERR_INTERNAL) {
            /* The template refused these messages (its raise_exception, or an error where
             * jinja2 raises): the request's fault, said in the template's own words. */
            return duet_oai_error_make(err_p, 400, NULL, "invalid_value", param,
                                       "The model's chat template cannot render these messages: "
                                       "%s",
                                       duet_error_last());
        }
    } else if (chat) {
        st = duet_oai_chat_prompt(tmpl, tok, req->messages, req->n_messages, &ids, &n);
    } else if (req->prompt_ids != NULL) {
        n = req->n_prompt_ids;
        ids = malloc((n > 0 ? n : 1) * sizeof(*ids));
        st = ids != NULL ? DUET_OK : DUET_ERR_NOMEM;
        if (ids != NULL && n > 0)
            memcpy(ids, req->prompt_ids, n * sizeof(*ids));
    } else {
        st = duet_oai_completion_prompt(tmpl, tok, req->prompt, req->prompt_len, &ids, &n);
    }
    if (st != DUET_OK) {
        duet_oai_error_make(err_p, 500, "server_error", NULL, NULL,
                            "The prompt could not be tokenized: %s", duet_error_last());
        return st;
    }
    if (n == 0)
        st = duet_oai_error_make(err_p, 400, NULL, "invalid_value", param,
                                 "The prompt is empty: it must have at least one token.");
    else if (lim->max_prompt_tokens > 0 && n > lim->max_prompt_tokens)
        st = duet_oai_error_make(err_p, 400, NULL, "context_length_exceeded", param,
                                 "The prompt has %zu tokens; this server accepts at most %zu. "
                                 "Please reduce the length of the %s.",
                                 n, lim->max_prompt_tokens, chat ? "messages" : "prompt");
    else if (lim->max_context > 0 && n + req->max_tokens > lim->max_context)
        st = duet_oai_error_make(err_p, 400, NULL, "context_length_exceeded", param,
                                 "This model's maximum context length is %zu tokens. However, "
                                 "you requested %zu tokens (%zu in the %s, %u in the "
                                 "completion). Please reduce the length of the %s or completion.",
                                 lim->max_context, n + req->max_tokens, n, param, req->max_tokens,
                                 param);
    if (st != DUET_OK) {
        free(ids);
        return st;
    }
    *ids_p = ids;
    *n_p = n;
    return DUET_OK;
}

/* ---------------------------------------------------------------- streaming text */

struct duet_oai_stream {
    duet_detok_t *detok; /* owned */
    uint32_t eos[DUET_OAI_MAX_EOS];
    size_t n_eos;
    bool ignore_eos;
    uint32_t max_tokens;
    uint32_t n_tokens; /* ids fed */
    duet_oai_finish_t finish;
    char stop[DUET_OAI_MAX_STOP][DUET_OAI_MAX_STOP_LEN];
    size_t stop_len[DUET_OAI_MAX_STOP];
    size_t n_stop;
    char *held; /* (cap) text not yet emitted: it may begin a stop string; owned */
    size_t held_len;
    char *out; /* (cap) the delta of the last call; owned */
    size_t out_len;
    size_t cap;
    bool keep_text;
    duet_strbuf_t text; /* everything emitted, when keep_text */
};

duet_status_t duet_oai_stream_create(const duet_tokenizer_t *tok, const duet_oai_request_t *req,
                                     const uint32_t *eos_ids, size_t n_eos, bool keep_text,
                                     duet_oai_stream_t **s_p)
{
    if (tok == NULL || req == NULL || s_p == NULL || (eos_ids == NULL && n_eos > 0) ||
        n_eos > DUET_OAI_MAX_EOS || req->n_stop > DUET_OAI_MAX_STOP)
        return DUET_FAIL(DUET_ERR_INVALID, "oai stream: bad arguments");
    duet_oai_stream_t *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return DUET_FAIL(DUET_ERR_NOMEM, "oai stream: no memory");
    duet_status_t st =
        duet_detok_create(tok, req->skip_special_tokens ? DUET_DETOK_SKIP_SPECIAL : 0, &s->detok);
    if (st != DUET_OK)
        goto fail_detok;
    size_t max_stop = 0;
    for (size_t i = 0; i < req->n_stop; i++) {
        if (req->stop_len[i] == 0 || req->stop_len[i] > DUET_OAI_MAX_STOP_LEN) {
            st = DUET_FAIL(DUET_ERR_INVALID, "oai stream: stop string %zu has a bad length", i);
            goto fail_bufs;
        }
        memcpy(s->stop[i], req->stop[i], req->stop_len[i]);
        s->stop_len[i] = req->stop_len[i];
        max_stop = req->stop_len[i] > max_stop ? req->stop_len[i] : max_stop;
    }
    s->n_stop = req->n_stop;
    /* Held text (< longest stop) + one token's text (as the detokenizer may grow it) + a flush. */
    s->cap = max_stop + 3 * (duet_tokenizer_max_token_len(tok) + 4) + 16;
    s->held = malloc(s->cap);
    s->out = malloc(s->cap);
    if (s->held == NULL || s->out == NULL) {
        st = DUET_FAIL(DUET_ERR_NOMEM, "oai stream: no memory");
        goto fail_bufs;
    }
    if (n_eos > 0)
        memcpy(s->eos, eos_ids, n_eos * sizeof(*eos_ids));
    s->n_eos = n_eos;
    s->ignore_eos = req->ignore_eos;
    s->max_tokens = req->max_tokens > 0 ? req->max_tokens : 1;
    s->keep_text = keep_text;
    duet_strbuf_init(&s->text);
    *s_p = s;
    return DUET_OK;

fail_bufs:
    free(s->out);
    free(s->held);
    duet_detok_destroy(s->detok);
fail_detok:
    free(s);
    return st;
}

void duet_oai_stream_destroy(duet_oai_stream_t *s)
{
    if (s == NULL)
        return;
    duet_strbuf_free(&s->text);
    free(s->out);
    free(s->held);
    duet_detok_destroy(s->detok);
    free(s);
}

uint32_t duet_oai_stream_n_tokens(const duet_oai_stream_t *s)
{
    return s->n_tokens;
}

void duet_oai_stream_text(const duet_oai_stream_t *s, const char **text_p, size_t *len_p)
{
    *text_p = s->text.data != NULL ? s->text.data : "";
    *len_p = s->text.len;
}

static duet_status_t oai_stream_hold(duet_oai_stream_t *s, const char *t, size_t n)
{
    if (n > s->cap - s->held_len)
        return DUET_FAIL(DUET_ERR_INTERNAL, "oai stream: held text overflows (%zu + %zu > %zu)",
                         s->held_len, n, s->cap);
    memcpy(s->held + s->held_len, t, n);
    s->held_len += n;
    return DUET_OK;
}

/* Move the first n held bytes to the output. */
static duet_status_t oai_stream_emit(duet_oai_stream_t *s, size_t n)
{
    memcpy(s->out, s->held, n);
    s->out_len = n;
    memmove(s->held, s->held + n, s->held_len - n);
    s->held_len -= n;
    if (s->keep_text && n > 0 && duet_strbuf_append(&s->text, s->out, n) != DUET_OK)
        return DUET_FAIL(DUET_ERR_NOMEM, "oai stream: no memory for the response text");
    return DUET_OK;
}

/*
 * Look for stop strings in the held text and emit what is safe. `end` = the choice ends now with
 * that reason unless a stop string cuts it first (NONE = it goes on).
 */
static duet_status_t oai_stream_settle(duet_oai_stream_t *s, duet_oai_finish_t end)
{
    size_t cut = SIZE_MAX;
    for (size_t i = 0; i < s->n_stop; i++) {
        const char *hit = memmem(s->held, s->held_len, s->stop[i], s->stop_len[i]);
        if (hit != NULL && (size_t)(hit - s->held) < cut)
            cut = (size_t)(hit - s->held);
    }
    if (cut != SIZE_MAX) {
        duet_status_t st = oai_stream_emit(s, cut);
        s->held_len = 0;
        s->finish = DUET_OAI_FINISH_STOP;
        return st;
    }
    if (end != DUET_OAI_FINISH_NONE) {
        s->finish = end;
        return oai_stream_emit(s, s->held_len);
    }
    /* Hold the longest suffix that is a proper prefix of some stop string. */
    size_t keep = 0;
    for (size_t i = 0; i < s->n_stop; i++) {
        size_t k = s->stop_len[i] - 1 < s->held_len ? s->stop_len[i] - 1 : s->held_len;
        for (; k > keep; k--)
            if (memcmp(s->held + s->held_len - k, s->stop[i], k) == 0)
                break;
        if (k > keep)
            keep = k;
    }
    return oai_stream_emit(s, s->held_len - keep);
}

static duet_status_t oai_stream_end(duet_oai_stream_t *s, duet_oai_finish_t end)
{
    const char *t;
    size_t n;
    duet_status_t st = duet_detok_flush(s->detok, &t, &n);
    if (st == DUET_OK)
        st = oai_stream_hold(s, t, n);
    if (st == DUET_OK)
        st = oai_stream_settle(s, end);
    return st;
}

duet_status_t duet_oai_stream_feed(duet_oai_stream_t *s, uint32_t id, const char **text_p,
                                   size_t *len_p, duet_oai_finish_t *finish_p)
{
    if (s == NULL || text_p == NULL || len_p == NULL || finish_p == NULL)
        return DUET_FAIL(DUET_ERR_INVALID, "oai stream: NULL argument");
    if (s->finish != DUET_OAI_FINISH_NONE)
        return DUET_FAIL(DUET_ERR_INVALID, "oai stream: token %u fed after the end", id);
    s->out_len = 0;
    bool eos = false;
    for (size_t i = 0; i < s->n_eos && !s->ignore_eos; i++)
        eos = eos || s->eos[i] == id;
    duet_status_t st;
    if (eos) {
        s->n_tokens++;
        st = oai_stream_end(s, DUET_OAI_FINISH_STOP);
    } else {
        const char *t;
        size_t n;
        st = duet_detok_feed(s->detok, id, &t, &n);
        if (st != DUET_OK)
            return st;
        s->n_tokens++;
        st = oai_stream_hold(s, t, n);
        /* At the last token, end: a stop string it completes still wins over "length". */
        if (st == DUET_OK)
            st = s->n_tokens >= s->max_tokens ? oai_stream_end(s, DUET_OAI_FINISH_LENGTH)
                                              : oai_stream_settle(s, DUET_OAI_FINISH_NONE);
    }
    if (st != DUET_OK)
        return st;
    *text_p = s->out;
    *len_p = s->out_len;
    *finish_p = s->finish;
    return DUET_OK;
}

duet_status_t duet_oai_stream_finish(duet_oai_stream_t *s, duet_oai_finish_t finish,
                                     const char **text_p, size_t *len_p,
                                     duet_oai_finish_t *finish_p)
{
    if (s == NULL || text_p == NULL || len_p == NULL || finish_p == NULL ||
        finish == DUET_OAI_FINISH_NONE)
        return DUET_FAIL(DUET_ERR_INVALID, "oai stream: bad arguments to finish");
    if (s->finish != DUET_OAI_FINISH_NONE)
        return DUET_FAIL(DUET_ERR_INVALID, "oai stream: finished twice");
    s->out_len = 0;
    duet_status_t st = oai_stream_end(s, finish);
    if (st != DUET_OK)
        return st;
    *text_p = s->out;
    *len_p = s->out_len;
    *finish_p = s->finish;
    return DUET_OK;
}

/* ---------------------------------------------------------------- responses */

void duet_oai_response_id(duet_oai_endpoint_t endpoint, uint64_t req_id, char *buf, size_t cap)
{
    snprintf(buf, cap, "%s-%016" PRIx64, endpoint == DUET_OAI_ENDPOINT_CHAT ? "chatcmpl" : "cmpl",
             req_id);
}

static const char *oai_object(const duet_oai_resp_meta_t *m, bool chunk)
{
    if (m->endpoint == DUET_OAI_ENDPOINT_CHAT)
        return chunk ? "chat.completion.chunk" : "chat.completion";
    return "text_completion";
}

/* {"id":...,"object":...,"created":...,"model":..., — up to the "choices" key. */
static void oai_head(duet_strbuf_t *out, const duet_oai_resp_meta_t *m, bool chunk)
{
    const char *id = m->id != NULL ? m->id : "";
    const char *model = m->model != NULL ? m->model : "";
    duet_strbuf_puts(out, "{\"id\":");
    duet_oai_json_string(out, id, strlen(id));
    duet_strbuf_printf(out, ",\"object\":\"%s\",\"created\":%" PRId64 ",\"model\":",
                       oai_object(m, chunk), m->created);
    duet_oai_json_string(out, model, strlen(model));
    duet_strbuf_puts(out, ",\"choices\":");
}

static void oai_finish_value(duet_strbuf_t *out, duet_oai_finish_t f)
{
    const char *name = duet_oai_finish_name(f);
    if (name != NULL)
        duet_strbuf_printf(out, "\"%s\"", name);
    else
        duet_strbuf_puts(out, "null");
}

/* "logprobs":<json or null>,"finish_reason": */
static void oai_logprobs_value(duet_strbuf_t *out, const char *json)
{
    duet_strbuf_puts(out, "\"logprobs\":");
    duet_strbuf_puts(out, json != NULL ? json : "null");
    duet_strbuf_puts(out, ",\"finish_reason\":");
}

static void oai_usage(duet_strbuf_t *out, uint32_t prompt_tokens, uint32_t completion_tokens)
{
    duet_strbuf_printf(
        out, "{\"prompt_tokens\":%u,\"completion_tokens\":%u,\"total_tokens\":%" PRIu64 "}",
        prompt_tokens, completion_tokens, (uint64_t)prompt_tokens + completion_tokens);
}

duet_status_t duet_oai_response_json(const duet_oai_resp_meta_t *m, const char *text, size_t len,
                                     duet_oai_finish_t finish, uint32_t prompt_tokens,
                                     uint32_t completion_tokens, duet_strbuf_t *out)
{
    const duet_oai_choice_t c = {
        .text = text, .len = len, .finish = finish, .logprobs_json = m->logprobs_json};
    return duet_oai_response_json_n(m, &c, 1, prompt_tokens, completion_tokens, out);
}

duet_status_t duet_oai_response_json_n(const duet_oai_resp_meta_t *m,
                                       const duet_oai_choice_t *choices, size_t n,
                                       uint32_t prompt_tokens, uint32_t completion_tokens,
                                       duet_strbuf_t *out)
{
    oai_head(out, m, false);
    duet_strbuf_puts(out, "[");
    for (size_t i = 0; i < n; i++) {
        const duet_oai_choice_t *c = &choices[i];
        duet_strbuf_printf(out, "%s{\"index\":%zu,", i > 0 ? "," : "", i);
        if (m->endpoint == DUET_OAI_ENDPOINT_CHAT) {
            duet_strbuf_puts(out, "\"message\":{\"role\":\"assistant\",\"content\":");
            if (c->tool_calls_json != NULL && c->len == 0)
                duet_strbuf_puts(out, "null");
            else
                duet_oai_json_string(out, c->text, c->len);
            if (c->tool_calls_json != NULL) {
                duet_strbuf_puts(out, ",\"tool_calls\":");
                duet_strbuf_puts(out, c->tool_calls_json);
            }
            duet_strbuf_puts(out, "},");
        } else {
            duet_strbuf_puts(out, "\"text\":");
            duet_oai_json_string(out, c->text, c->len);
            duet_strbuf_puts(out, ",");
        }
        oai_logprobs_value(out, c->logprobs_json);
        oai_finish_value(out, c->finish);
        duet_strbuf_puts(out, "}");
    }
    duet_strbuf_puts(out, "],\"usage\":");
    oai_usage(out, prompt_tokens, completion_tokens);
    duet_strbuf_puts(out, "}");
    return duet_strbuf_status(out);
}

/*
 * One SSE chunk with one choice. Chat: delta = {"role":"assistant","content":""} (role chunk),
 * {"content": text} or {} (finish chunk), or with role and text both set, text itself (a delta
 * object as JSON). Completions: "text".
 */
static duet_status_t oai_chunk(const duet_oai_resp_meta_t *m, bool role, const char *text,
                               size_t len, duet_oai_finish_t finish, duet_strbuf_t *out)
{
    duet_strbuf_puts(out, "data: ");
    oai_head(out, m, true);
    duet_strbuf_printf(out, "[{\"index\":%u,", m->index);
    if (m->endpoint == DUET_OAI_ENDPOINT_CHAT) {
        if (role && text != NULL) { /* a delta object given as JSON */
            duet_strbuf_puts(out, "\"delta\":");
            duet_strbuf_append(out, text, len);
            duet_strbuf_puts(out, ",");
        } else if (role)
            duet_strbuf_puts(out, "\"delta\":{\"role\":\"assistant\",\"content\":\"\"},");
        else if (text != NULL) {
            duet_strbuf_puts(out, "\"delta\":{\"content\":");
            duet_oai_json_string(out, text, len);
            duet_strbuf_puts(out, "},");
        } else
            duet_strbuf_puts(out, "\"delta\":{},");
    } else {
        duet_strbuf_puts(out, "\"text\":");
        duet_oai_json_string(out, text != NULL ? text : "", text != NULL ? len : 0);
        duet_strbuf_puts(out, ",");
    }
    oai_logprobs_value(out, role ? NULL : m->logprobs_json);
    oai_finish_value(out, finish);
    duet_strbuf_puts(out, "}]");
    if (m->include_usage)
        duet_strbuf_puts(out, ",\"usage\":null");
    duet_strbuf_puts(out, "}\n\n");
    return duet_strbuf_status(out);
}

duet_status_t duet_oai_sse_begin(const duet_oai_resp_meta_t *m, duet_strbuf_t *out)
{
    if (m->endpoint != DUET_OAI_ENDPOINT_CHAT)
        return duet_strbuf_status(out);
    return oai_chunk(m, true, NULL, 0, DUET_OAI_FINISH_NONE, out);
}

duet_status_t duet_oai_sse_delta(const duet_oai_resp_meta_t *m, const char *text, size_t len,
                                 duet_strbuf_t *out)
{
    if (len == 0)
        return duet_strbuf_status(out);
    return oai_chunk(m, false, text, len, DUET_OAI_FINISH_NONE, out);
}

duet_status_t duet_oai_sse_end(const duet_oai_resp_meta_t *m, duet_oai_finish_t finish,
                               uint32_t prompt_tokens, uint32_t completion_tokens,
                               duet_strbuf_t *out)
{
    duet_oai_sse_finish(m, finish, out);
    return duet_oai_sse_done(m, prompt_tokens, completion_tokens, out);
}

duet_status_t duet_oai_sse_finish(const duet_oai_resp_meta_t *m, duet_oai_finish_t finish,
                                  duet_strbuf_t *out)
{
    return oai_chunk(m, false, NULL, 0, finish, out);
}

duet_status_t duet_oai_sse_delta_json(const duet_oai_resp_meta_t *m, const char *delta, size_t len,
                                      duet_strbuf_t *out)
{
    return oai_chunk(m, true, delta, len, DUET_OAI_FINISH_NONE, out);
}

duet_status_t duet_oai_sse_done(const duet_oai_resp_meta_t *m, uint32_t prompt_tokens,
                                uint32_t completion_tokens, duet_strbuf_t *out)
{
    if (m->include_usage) {
        duet_strbuf_puts(out, "data: ");
        oai_head(out, m, true);
        duet_strbuf_puts(out, "[],\"usage\":");
        oai_usage(out, prompt_tokens, completion_tokens);
        duet_strbuf_puts(out, "}\n\n");
    }
    duet_strbuf_puts(out, "data: [DONE]\n\n");
    return duet_strbuf_status(out);
}
