/*
 * Tool calling (see tools.h): the request's "tools" and "tool_choice", and Kimi K2's tool-call
 * format parsed out of a choice's text as it streams.
 */
#include "router/api/tools.h"

#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "common/log.h"
#include "router/api/openai.h"

/* ---------------------------------------------------------------- the request */

/* An object's keys must be among `known` (NULL-terminated). */
static duet_status_t tl_keys(const json_t *obj, const char *where, const char *const *known,
                             duet_oai_error_t *err)
{
    const char *key;
    json_t *val;
    json_object_foreach((json_t *)obj, key, val)
    {
        bool ok = false;
        for (size_t i = 0; known[i] != NULL && !ok; i++)
            ok = strcmp(key, known[i]) == 0;
        if (!ok)
            return duet_oai_error_make(err, 400, NULL, "unrecognized_argument", where,
                                       "Unrecognized argument in '%s': '%.48s'.", where, key);
    }
    return DUET_OK;
}

/* A function name as OpenAI allows it: 1..64 of [a-zA-Z0-9_-]. */
static bool tl_name_ok(const char *s, size_t len)
{
    if (len == 0 || len > 64)
        return false;
    for (size_t i = 0; i < len; i++)
        if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= 'A' && s[i] <= 'Z') ||
              (s[i] >= '0' && s[i] <= '9') || s[i] == '_' || s[i] == '-'))
            return false;
    return true;
}

static duet_status_t tl_tool(const json_t *t, size_t i, duet_oai_error_t *err)
{
    static const char *const tool_keys[] = {"type", "function", NULL};
    static const char *const fn_keys[] = {"name", "description", "parameters", "strict", NULL};
    char w[64], fw[96], kw[128];
    snprintf(w, sizeof(w), "tools[%zu]", i);
    if (!json_is_object(t))
        return duet_oai_error_make(err, 400, NULL, "invalid_type", w,
                                   "Invalid type for '%s': expected an object.", w);
    duet_status_t st = tl_keys(t, w, tool_keys, err);
    if (st != DUET_OK)
        return st;
    const json_t *type = json_object_get(t, "type");
    snprintf(kw, sizeof(kw), "%s.type", w);
    if (!json_is_string(type) || strcmp(json_string_value(type), "function") != 0)
        return duet_oai_error_make(err, 400, NULL, "invalid_value", kw,
                                   "Invalid value for '%s': expected 'function'.", kw);
    const json_t *fn = json_object_get(t, "function");
    snprintf(fw, sizeof(fw), "%s.function", w);
    if (!json_is_object(fn))
        return duet_oai_error_make(err, 400, NULL,
                                   fn == NULL ? "missing_required_parameter" : "invalid_type", fw,
                                   "'%s' must be an object {name, description?, parameters?}.", fw);
    if ((st = tl_keys(fn, fw, fn_keys, err)) != DUET_OK)
        return st;
    const json_t *name = json_object_get(fn, "name");
    snprintf(kw, sizeof(kw), "%s.name", fw);
    if (!json_is_string(name) || !tl_name_ok(json_string_value(name), json_string_length(name)))
        return duet_oai_error_make(err, 400, NULL, "invalid_value", kw,
                                   "Invalid '%s': a function name is 1 to 64 letters, digits, "
                                   "'_' or '-'.",
                                   kw);
    const json_t *v = json_object_get(fn, "description");
    snprintf(kw, sizeof(kw), "%s.description", fw);
    if (v != NULL && !json_is_null(v) && !json_is_string(v))
        return duet_oai_error_make(err, 400, NULL, "invalid_type", kw,
                                   "Invalid type for '%s': expected a string.", kw);
    v = json_object_get(fn, "parameters");
    snprintf(kw, sizeof(kw), "%s.parameters", fw);
    if (v != NULL && !json_is_null(v) && !json_is_object(v))
        return duet_oai_error_make(err, 400, NULL, "invalid_type", kw,
                                   "Invalid type for '%s': expected a JSON Schema object.", kw);
    v = json_object_get(fn, "strict");
    snprintf(kw, sizeof(kw), "%s.strict", fw);
    if (v != NULL && !json_is_null(v) && !json_is_boolean(v))
        return duet_oai_error_make(err, 400, NULL, "invalid_type", kw,
                                   "Invalid type for '%s': expected a boolean.", kw);
    return DUET_OK;
}

/* Whether tools (a validated array) has a function named `name`. */
static bool tl_has(const json_t *tools, const char *name)
{
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t)
    {
        const char *n = json_string_value(json_object_get(json_object_get(t, "function"), "name"));
        if (n != NULL && strcmp(n, name) == 0)
            return true;
    }
    return false;
}

static duet_status_t tl_choice(const json_t *tc, bool have_tools, const json_t *tools,
                               duet_oai_request_t *req, duet_oai_error_t *err)
{
    if (json_is_string(tc)) {
        const char *s = json_string_value(tc);
        if (strcmp(s, "auto") == 0)
            req->tool_choice = DUET_OAI_TOOL_CHOICE_AUTO;
        else if (strcmp(s, "none") == 0)
            req->tool_choice = DUET_OAI_TOOL_CHOICE_NONE;
        else if (strcmp(s, "required") == 0)
            req->tool_choice = DUET_OAI_TOOL_CHOICE_REQUIRED;
        else
            return duet_oai_error_make(err, 400, NULL, "invalid_value", "tool_choice",
                                       "Invalid value for 'tool_choice': '%.64s'. Supported "
                                       "values are: 'none', 'auto', 'required' and "
                                       "{\"type\": \"function\", \"function\": {\"name\": ...}}.",
                                       s);
    } else if (json_is_object(tc)) {
        static const char *const keys[] = {"type", "function", NULL};
        static const char *const fn_keys[] = {"name", NULL};
        const json_t *type = json_object_get(tc, "type"), *fn = json_object_get(tc, "function");
        const json_t *name = json_object_get(fn, "name");
        duet_status_t st = tl_keys(tc, "tool_choice", keys, err);
        if (st == DUET_OK && json_is_object(fn))
            st = tl_keys(fn, "tool_choice.function", fn_keys, err);
        if (st != DUET_OK)
            return st;
        if (!json_is_string(type) || strcmp(json_string_value(type), "function") != 0 ||
            !json_is_string(name))
            return duet_oai_error_make(err, 400, NULL, "invalid_value", "tool_choice",
                                       "Invalid 'tool_choice': expected {\"type\": \"function\", "
                                       "\"function\": {\"name\": \"...\"}}.");
        if (!have_tools || !tl_has(tools, json_string_value(name)))
            return duet_oai_error_make(err, 400, NULL, "invalid_value", "tool_choice",
                                       "Invalid 'tool_choice': the function '%.64s' is not among "
                                       "'tools'.",
                                       json_string_value(name));
        req->tool_choice = DUET_OAI_TOOL_CHOICE_NAMED;
    } else {
        return duet_oai_error_make(err, 400, NULL, "invalid_type", "tool_choice",
                                   "Invalid type for 'tool_choice': expected a string or an "
                                   "object.");
    }
    if (req->tool_choice == DUET_OAI_TOOL_CHOICE_REQUIRED && !have_tools)
        return duet_oai_error_make(err, 400, NULL, "invalid_value", "tool_choice",
                                   "'tool_choice' is 'required' but no 'tools' were given.");
    return DUET_OK;
}

duet_status_t duet__oai_parse_tools(const duet_oai_limits_t *lim, const json_t *root,
                                    duet_oai_request_t *req, duet_oai_error_t *err)
{
    const json_t *tools = json_object_get(root, "tools");
    const json_t *tc = json_object_get(root, "tool_choice");
    tools = json_is_null(tools) ? NULL : tools;
    tc = json_is_null(tc) ? NULL : tc;
    req->tool_choice = DUET_OAI_TOOL_CHOICE_AUTO;
    if (tools != NULL && !json_is_array(tools))
        return duet_oai_error_make(err, 400, NULL, "invalid_type", "tools",
                                   "Invalid type for 'tools': expected an array of tools.");
    const bool have = tools != NULL && json_array_size(tools) > 0;
    if (have && json_array_size(tools) > DUET_OAI_MAX_TOOLS)
        return duet_oai_error_make(err, 400, NULL, "invalid_value", "tools",
                                   "Invalid 'tools': %zu tools; at most %d are accepted.",
                                   json_array_size(tools), DUET_OAI_MAX_TOOLS);
    for (size_t i = 0; have && i < json_array_size(tools); i++) {
        duet_status_t st = tl_tool(json_array_get(tools, i), i, err);
        if (st != DUET_OK)
            return st;
    }
    if (tc != NULL) {
        duet_status_t st = tl_choice(tc, have, tools, req, err);
        if (st != DUET_OK)
            return st;
    }
    if (!have || req->tool_choice == DUET_OAI_TOOL_CHOICE_NONE)
        return DUET_OK; /* nothing offered: the template sees no tools */
    if (!lim->jinja_template || !lim->tool_calls)
        return duet_oai_error_make(
            err, 400, NULL, "unsupported_parameter", "tools",
            "Unsupported parameter: 'tools' is not supported by this model: %s.",
            !lim->jinja_template ? "its chat template (duet's format) has no tool format"
                                 : "its tokenizer has no Kimi K2 tool-call tokens, the one "
                                   "tool-call format this server parses");
    req->tools = json_incref((json_t *)tools);
    req->skip_special_tokens = false; /* the markers must reach the parser, as vLLM's asks */
    return DUET_OK;
}

/* ---------------------------------------------------------------- the output */

typedef enum {
    TP_CONTENT = 0, /* before a section (or after one) */
    TP_SECTION,     /* inside a section, between calls */
    TP_ID,          /* after a call's begin: its id */
    TP_ARGS,        /* after the argument marker: its arguments */
    TP_DONE,        /* fed with end */
} tp_state_t;

typedef struct {
    char id[DUET_OAI_MAX_TOOL_ID_LEN + 1];
    size_t name_off, name_len; /* the name inside id */
    duet_strbuf_t args;
} tp_call_t;

struct duet_oai_toolparse {
    tp_state_t state;
    duet_strbuf_t buf;     /* text not yet settled */
    duet_strbuf_t content; /* all content emitted */
    tp_call_t *calls;      /* (n_calls started, cap_calls) */
    uint32_t n_calls, n_done, cap_calls;
    bool args_started; /* TP_ARGS: non-blank argument text seen */
    duet_oai_tp_event_t *ev;
    size_t n_ev, cap_ev;
    duet_strbuf_t scratch; /* event texts of one feed live here (offsets fixed up at the end) */
};

duet_status_t duet_oai_toolparse_create(duet_oai_toolparse_t **tp_p)
{
    duet_oai_toolparse_t *tp = calloc(1, sizeof(*tp));
    if (tp == NULL)
        return DUET_FAIL(DUET_ERR_NOMEM, "tool parser: no memory");
    duet_strbuf_init(&tp->buf);
    duet_strbuf_init(&tp->content);
    duet_strbuf_init(&tp->scratch);
    *tp_p = tp;
    return DUET_OK;
}

void duet_oai_toolparse_destroy(duet_oai_toolparse_t *tp)
{
    if (tp == NULL)
        return;
    for (uint32_t i = 0; i < tp->n_calls; i++)
        duet_strbuf_free(&tp->calls[i].args);
    free(tp->calls);
    free(tp->ev);
    duet_strbuf_free(&tp->buf);
    duet_strbuf_free(&tp->content);
    duet_strbuf_free(&tp->scratch);
    free(tp);
}

uint32_t duet_oai_toolparse_n_calls(const duet_oai_toolparse_t *tp)
{
    return tp->n_done;
}

void duet_oai_toolparse_content(const duet_oai_toolparse_t *tp, const char **text_p, size_t *len_p)
{
    *text_p = tp->content.data != NULL ? tp->content.data : "";
    *len_p = tp->content.len;
}

/* An event whose text (and name) are copied into scratch; text pointers are set at the end of
 * the feed (scratch may move while it grows): offsets are kept in the pointers meanwhile. */
static duet_status_t tp_event(duet_oai_toolparse_t *tp, duet_oai_tp_kind_t kind, uint32_t call,
                              const char *text, size_t len, const char *name, size_t name_len)
{
    if (tp->n_ev == tp->cap_ev) {
        size_t cap = tp->cap_ev > 0 ? 2 * tp->cap_ev : 8;
        duet_oai_tp_event_t *ev = realloc(tp->ev, cap * sizeof(*ev));
        if (ev == NULL)
            return DUET_FAIL(DUET_ERR_NOMEM, "tool parser: no memory");
        tp->ev = ev;
        tp->cap_ev = cap;
    }
    duet_oai_tp_event_t *e = &tp->ev[tp->n_ev++];
    e->kind = kind;
    e->call = call;
    e->text = (const char *)(uintptr_t)tp->scratch.len;
    e->len = len;
    duet_strbuf_append(&tp->scratch, text, len);
    e->name = (const char *)(uintptr_t)tp->scratch.len;
    e->name_len = name_len;
    duet_strbuf_append(&tp->scratch, name, name_len);
    return duet_strbuf_status(&tp->scratch);
}

static duet_status_t tp_content(duet_oai_toolparse_t *tp, const char *s, size_t n)
{
    if (n == 0)
        return DUET_OK;
    if (duet_strbuf_append(&tp->content, s, n) != DUET_OK)
        return DUET_FAIL(DUET_ERR_NOMEM, "tool parser: no memory");
    return tp_event(tp, DUET_OAI_TP_CONTENT, 0, s, n, "", 0);
}

static bool tp_blank(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

/* Where marker m starts in s[0..n) (n when absent) and how many trailing bytes of s may begin
 * it (*hold). */
static size_t tp_find(const char *s, size_t n, const char *m, size_t *hold)
{
    size_t ml = strlen(m);
    for (size_t i = 0; i + ml <= n; i++)
        if (memcmp(s + i, m, ml) == 0) {
            *hold = 0;
            return i;
        }
    size_t k = ml - 1 < n ? ml - 1 : n;
    for (; k > 0; k--)
        if (memcmp(s + n - k, m, k) == 0)
            break;
    *hold = k;
    return n;
}

/* Drop the first n bytes of the buffer. */
static void tp_consume(duet_oai_toolparse_t *tp, size_t n)
{
    if (n == 0)
        return;
    memmove(tp->buf.data, tp->buf.data + n, tp->buf.len - n);
    tp->buf.len -= n;
    tp->buf.data[tp->buf.len] = '\0';
}

/* A call's id "functions.NAME:IDX" (blanks trimmed): its name is what lies between the last '.'
 * before the first ':' and that ':' (vLLM's reading); without ':' the whole id after its last '.'.
 */
static duet_status_t tp_call_begin(duet_oai_toolparse_t *tp, const char *id, size_t len)
{
    while (len > 0 && tp_blank(id[0]))
        id++, len--;
    while (len > 0 && tp_blank(id[len - 1]))
        len--;
    if (tp->n_calls == tp->cap_calls) {
        uint32_t cap = tp->cap_calls > 0 ? 2 * tp->cap_calls : 4;
        tp_call_t *c = realloc(tp->calls, cap * sizeof(*c));
        if (c == NULL)
            return DUET_FAIL(DUET_ERR_NOMEM, "tool parser: no memory");
        tp->calls = c;
        tp->cap_calls = cap;
    }
    tp_call_t *c = &tp->calls[tp->n_calls];
    memset(c, 0, sizeof(*c));
    memcpy(c->id, id, len);
    c->id[len] = '\0';
    const char *colon = memchr(c->id, ':', len);
    size_t end = colon != NULL ? (size_t)(colon - c->id) : len, start = end;
    while (start > 0 && c->id[start - 1] != '.')
        start--;
    c->name_off = start;
    c->name_len = end - start;
    duet_strbuf_init(&c->args);
    tp->n_calls++;
    tp->args_started = false;
    return tp_event(tp, DUET_OAI_TP_CALL, tp->n_calls - 1, c->id, len, c->id + start, c->name_len);
}

static duet_status_t tp_args(duet_oai_toolparse_t *tp, const char *s, size_t n)
{
    if (!tp->args_started)
        while (n > 0 && tp_blank(s[0]))
            s++, n--;
    if (n == 0)
        return DUET_OK;
    tp->args_started = true;
    tp_call_t *c = &tp->calls[tp->n_calls - 1];
    if (duet_strbuf_append(&c->args, s, n) != DUET_OK)
        return DUET_FAIL(DUET_ERR_NOMEM, "tool parser: no memory");
    return tp_event(tp, DUET_OAI_TP_ARGS, tp->n_calls - 1, s, n, "", 0);
}

/* Settle as much of the buffer as can be; `end`: all of it. */
static duet_status_t tp_run(duet_oai_toolparse_t *tp, bool end)
{
    duet_status_t st = DUET_OK;
    for (;;) {
        const char *b = tp->buf.data != NULL ? tp->buf.data : "";
        size_t n = tp->buf.len, hold = 0, at;
        switch (tp->state) {
        case TP_CONTENT:
            at = tp_find(b, n, DUET_OAI_TOOL_SECTION_BEGIN, &hold);
            if (at == n) {
                size_t emit = end ? n : n - hold;
                st = tp_content(tp, b, emit);
                tp_consume(tp, emit);
                return st;
            }
            if ((st = tp_content(tp, b, at)) != DUET_OK)
                return st;
            tp_consume(tp, at + strlen(DUET_OAI_TOOL_SECTION_BEGIN));
            tp->state = TP_SECTION;
            break;
        case TP_SECTION: {
            size_t h1, h2;
            size_t call = tp_find(b, n, DUET_OAI_TOOL_CALL_BEGIN, &h1);
            size_t sec = tp_find(b, n, DUET_OAI_TOOL_SECTION_END, &h2);
            if (call == n && sec == n) { /* text between calls is dropped */
                size_t keep = end ? 0 : (h1 > h2 ? h1 : h2);
                tp_consume(tp, n - keep);
                return DUET_OK;
            }
            if (call < sec) {
                tp_consume(tp, call + strlen(DUET_OAI_TOOL_CALL_BEGIN));
                tp->state = TP_ID;
            } else {
                tp_consume(tp, sec + strlen(DUET_OAI_TOOL_SECTION_END));
                tp->state = TP_CONTENT;
            }
            break;
        }
        case TP_ID:
            at = tp_find(b, n, DUET_OAI_TOOL_ARG_BEGIN, &hold);
            if (at == n || at > DUET_OAI_MAX_TOOL_ID_LEN) {
                if (at == n && n <= DUET_OAI_MAX_TOOL_ID_LEN + strlen(DUET_OAI_TOOL_ARG_BEGIN) &&
                    !end)
                    return DUET_OK; /* the id goes on */
                /* no id that long: not a call; look for the next one */
                tp->state = TP_SECTION;
                if (end) {
                    tp_consume(tp, n);
                    return DUET_OK;
                }
                break;
            }
            if ((st = tp_call_begin(tp, b, at)) != DUET_OK)
                return st;
            tp_consume(tp, at + strlen(DUET_OAI_TOOL_ARG_BEGIN));
            tp->state = TP_ARGS;
            break;
        case TP_ARGS: {
            at = tp_find(b, n, DUET_OAI_TOOL_CALL_END, &hold);
            size_t upto = at;
            if (at == n && end) { /* the output ended inside the call: it is dropped */
                tp_consume(tp, n);
                return DUET_OK;
            }
            /* trailing blanks wait: they are trimmed when the call ends here */
            size_t keep_to = at == n ? n - hold : at;
            size_t stop = keep_to;
            while (stop > 0 && tp_blank(b[stop - 1]))
                stop--;
            if ((st = tp_args(tp, b, stop)) != DUET_OK)
                return st;
            if (at == n) {
                tp_consume(tp, stop);
                return DUET_OK;
            }
            tp_consume(tp, upto + strlen(DUET_OAI_TOOL_CALL_END));
            tp->n_done = tp->n_calls;
            tp->state = TP_SECTION;
            break;
        }
        case TP_DONE:
            return DUET_OK;
        }
    }
}

duet_status_t duet_oai_toolparse_feed(duet_oai_toolparse_t *tp, const char *text, size_t len,
                                      bool end, const duet_oai_tp_event_t **ev_p, size_t *n_p)
{
    if (tp->state == TP_DONE)
        return duet_error_set(DUET_ERR_INVALID, "tool parser: fed after the end");
    tp->n_ev = 0;
    tp->scratch.len = 0;
    if (len > 0 && duet_strbuf_append(&tp->buf, text, len) != DUET_OK)
        return DUET_FAIL(DUET_ERR_NOMEM, "tool parser: no memory");
    duet_status_t st = tp_run(tp, end);
    if (st != DUET_OK)
        return st;
    if (end) {
        /* a call begun but not ended is dropped (its events were already out: the client sees
         * it cut, with the choice's finish_reason) */
        if (tp->n_calls > tp->n_done) {
            duet_strbuf_free(&tp->calls[tp->n_calls - 1].args);
            tp->n_calls = tp->n_done;
        }
        tp->state = TP_DONE;
    }
    for (size_t i = 0; i < tp->n_ev; i++) { /* offsets into scratch become pointers */
        tp->ev[i].text = tp->scratch.data + (uintptr_t)tp->ev[i].text;
        tp->ev[i].name = tp->scratch.data + (uintptr_t)tp->ev[i].name;
    }
    *ev_p = tp->ev;
    *n_p = tp->n_ev;
    return DUET_OK;
}

duet_status_t duet_oai_toolparse_calls_json(const duet_oai_toolparse_t *tp, duet_strbuf_t *out)
{
    duet_strbuf_puts(out, "[");
    for (uint32_t i = 0; i < tp->n_done; i++) {
        const tp_call_t *c = &tp->calls[i];
        duet_strbuf_puts(out, i > 0 ? ",{\"id\":" : "{\"id\":");
        duet_oai_json_string(out, c->id, strlen(c->id));
        duet_strbuf_puts(out, ",\"type\":\"function\",\"function\":{\"name\":");
        duet_oai_json_string(out, c->id + c->name_off, c->name_len);
        duet_strbuf_puts(out, ",\"arguments\":");
        duet_oai_json_string(out, c->args.data != NULL ? c->args.data : "", c->args.len);
        duet_strbuf_puts(out, "}}");
    }
    duet_strbuf_puts(out, "]");
    return duet_strbuf_status(out);
}

duet_status_t duet_oai_tool_delta_json(const duet_oai_tp_event_t *ev, duet_strbuf_t *out)
{
    duet_strbuf_printf(out, "{\"tool_calls\":[{\"index\":%u,", ev->call);
    if (ev->kind == DUET_OAI_TP_CALL) {
        duet_strbuf_puts(out, "\"id\":");
        duet_oai_json_string(out, ev->text, ev->len);
        duet_strbuf_puts(out, ",\"type\":\"function\",\"function\":{\"name\":");
        duet_oai_json_string(out, ev->name, ev->name_len);
        duet_strbuf_puts(out, ",\"arguments\":\"\"}}]}");
    } else {
        duet_strbuf_puts(out, "\"function\":{\"arguments\":");
        duet_oai_json_string(out, ev->text, ev->len);
        duet_strbuf_puts(out, "}}]}");
    }
    return duet_strbuf_status(out);
}
