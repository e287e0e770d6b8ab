/*
 * Incremental SSE + OpenAI stream reader; the contract is in serving_sse.h.
 *
 * Bytes are copied into a line buffer until a line ends, so a piece boundary anywhere (inside
 * "\r\n" too, via prev_cr) gives the same result as one big piece; the unit tests check this by
 * feeding every input one byte at a time. Event data is decoded with jansson only when the event
 * ends, so the JSON parser always sees whole payloads.
 */
#include "bench/serving_sse.h"

#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void serving_stream_init(serving_stream_t *s)
{
    memset(s, 0, sizeof(*s));
}

void serving_stream_free(serving_stream_t *s)
{
    if (s == NULL)
        return;
    free(s->line);
    free(s->data);
    free(s->itl_ms);
    free(s->text);
    serving_stream_init(s);
}

duet_status_t serving_stream_fail(serving_stream_t *s, const char *fmt, ...)
{
    if (s->failed)
        return DUET_ERR_FORMAT;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->error, sizeof(s->error), fmt, ap);
    va_end(ap);
    s->failed = true;
    return DUET_ERR_FORMAT;
}

/* Make room for `need` bytes in a growable buffer. */
static bool sse_reserve(char **buf, size_t *cap, size_t need)
{
    if (need <= *cap)
        return true;
    size_t ncap = *cap != 0 ? *cap : 256;
    while (ncap < need)
        ncap *= 2;
    char *p = realloc(*buf, ncap);
    if (p == NULL)
        return false;
    *buf = p;
    *cap = ncap;
    return true;
}

static duet_status_t sse_text_chunk(serving_stream_t *s, uint64_t now_ns)
{
    if (s->n_text_chunks == 0) {
        s->first_text_ns = now_ns;
    } else {
        if (s->n_itl == s->itl_cap) {
            size_t ncap = s->itl_cap != 0 ? s->itl_cap * 2 : 64;
            double *p = realloc(s->itl_ms, ncap * sizeof(*p));
            if (p == NULL) {
                serving_stream_fail(s, "out of memory");
                return DUET_ERR_NOMEM;
            }
            s->itl_ms = p;
            s->itl_cap = ncap;
        }
        uint64_t gap = now_ns >= s->last_text_ns ? now_ns - s->last_text_ns : 0;
        s->itl_ms[s->n_itl++] = (double)gap / 1e6;
    }
    s->last_text_ns = now_ns;
    s->n_text_chunks++;
    return DUET_OK;
}

/* A non-negative integer field of usage that fits in 32 bits. */
static bool sse_usage_field(json_t *usage, const char *key, uint32_t *v_p)
{
    json_t *v = json_object_get(usage, key);
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > UINT32_MAX)
        return false;
    *v_p = (uint32_t)json_integer_value(v);
    return true;
}

/* The message of an {"error": ...} payload, for the failure reason. */
static const char *sse_error_message(json_t *err)
{
    if (json_is_string(err))
        return json_string_value(err);
    json_t *m = json_object_get(err, "message");
    return json_is_string(m) ? json_string_value(m) : "(no message)";
}

static duet_status_t sse_chunk(serving_stream_t *s, json_t *root, uint64_t now_ns)
{
    json_t *err = json_object_get(root, "error");
    if (err != NULL && !json_is_null(err))
        return serving_stream_fail(s, "server error event: %.200s", sse_error_message(err));
    if (s->event_error)
        return serving_stream_fail(s, "server error event (event: error)");

    json_t *usage = json_object_get(root, "usage");
    if (usage != NULL && !json_is_null(usage)) {
        uint32_t c = 0, p = 0;
        if (!json_is_object(usage) || !sse_usage_field(usage, "completion_tokens", &c))
            return serving_stream_fail(s, "usage without a valid completion_tokens");
        s->has_usage = true;
        s->usage_completion_tokens = c;
        if (sse_usage_field(usage, "prompt_tokens", &p))
            s->usage_prompt_tokens = p;
    }

    json_t *choices = json_object_get(root, "choices");
    if (choices == NULL) {
        if (usage == NULL || json_is_null(usage))
            return serving_stream_fail(s, "chunk with neither choices nor usage");
        return DUET_OK;
    }
    if (!json_is_array(choices))
        return serving_stream_fail(s, "choices is %s, not an array",
                                   json_is_object(choices) ? "an object" : "not an array");
    bool text = false;
    for (size_t i = 0; i < json_array_size(choices); i++) {
        json_t *c = json_array_get(choices, i);
        if (!json_is_object(c))
            return serving_stream_fail(s, "choices[%zu] is not an object", i);
        json_t *t = json_object_get(c, "text");
        if (t == NULL) {
            json_t *delta = json_object_get(c, "delta");
            if (delta != NULL && !json_is_object(delta))
                return serving_stream_fail(s, "choices[%zu].delta is not an object", i);
            t = json_object_get(delta, "content");
        }
        if (t != NULL && !json_is_null(t) && !json_is_string(t))
            return serving_stream_fail(s, "choices[%zu] text/content is not a string", i);
        if (json_is_string(t) && json_string_length(t) > 0) {
            size_t n = json_string_length(t);
            if (!sse_reserve(&s->text, &s->text_cap, s->text_len + n + 1))
                return serving_stream_fail(s, "out of memory for the generated text");
            memcpy(s->text + s->text_len, json_string_value(t), n);
            s->text_len += n;
            s->text[s->text_len] = '\0';
            text = true;
        }
    }
    return text ? sse_text_chunk(s, now_ns) : DUET_OK;
}

/* A blank line: dispatch the event assembled so far. */
static duet_status_t sse_dispatch(serving_stream_t *s, uint64_t now_ns)
{
    bool had = s->has_data;
    s->has_data = false;
    size_t len = s->data_len;
    s->data_len = 0;
    if (!had) {
        s->event_error = false;
        return DUET_OK; /* comments or unknown fields only */
    }
    const char *d = s->data != NULL ? s->data : "";
    if (s->done)
        return serving_stream_fail(s, "data after [DONE]");
    if (len == 6 && memcmp(d, "[DONE]", 6) == 0) {
        if (s->event_error)
            return serving_stream_fail(s, "server error event (event: error)");
        s->done = true;
        return DUET_OK;
    }
    json_error_t jerr;
    json_t *root = json_loadb(d, len, JSON_REJECT_DUPLICATES, &jerr);
    if (root == NULL)
        return serving_stream_fail(s, "malformed JSON in SSE data: %s (at %d)", jerr.text,
                                   jerr.position);
    duet_status_t st;
    if (!json_is_object(root))
        st = serving_stream_fail(s, "SSE data is not a JSON object");
    else
        st = sse_chunk(s, root, now_ns);
    json_decref(root);
    s->event_error = false;
    return st;
}

/* One complete line (without its terminator). */
static duet_status_t sse_line(serving_stream_t *s, const char *l, size_t n, uint64_t now_ns)
{
    if (n == 0)
        return sse_dispatch(s, now_ns);
    if (l[0] == ':')
        return DUET_OK;
    const char *colon = memchr(l, ':', n);
    size_t flen = colon != NULL ? (size_t)(colon - l) : n;
    const char *v = colon != NULL ? colon + 1 : l + n;
    size_t vlen = n - (size_t)(v - l);
    if (vlen > 0 && v[0] == ' ') {
        v++;
        vlen--;
    }
    if (flen == 4 && memcmp(l, "data", 4) == 0) {
        size_t need = s->data_len + vlen + 2;
        if (need > 4 * (size_t)SERVING_SSE_MAX_LINE)
            return serving_stream_fail(s, "SSE event data over %u bytes", 4 * SERVING_SSE_MAX_LINE);
        if (!sse_reserve(&s->data, &s->data_cap, need))
            return serving_stream_fail(s, "out of memory"), DUET_ERR_NOMEM;
        if (s->has_data)
            s->data[s->data_len++] = '\n';
        memcpy(s->data + s->data_len, v, vlen);
        s->data_len += vlen;
        s->data[s->data_len] = '\0';
        s->has_data = true;
    } else if (flen == 5 && memcmp(l, "event", 5) == 0) {
        s->event_error = vlen == 5 && memcmp(v, "error", 5) == 0;
    }
    return DUET_OK;
}

duet_status_t serving_stream_feed(serving_stream_t *s, const char *data, size_t len,
                                  uint64_t now_ns)
{
    if (s->failed)
        return DUET_ERR_FORMAT;
    for (size_t i = 0; i < len; i++) {
        char c = data[i];
        if (s->prev_cr) {
            s->prev_cr = false;
            if (c == '\n')
                continue;
        }
        if (c == '\n' || c == '\r') {
            s->prev_cr = c == '\r';
            duet_status_t st = sse_line(s, s->line != NULL ? s->line : "", s->line_len, now_ns);
            s->line_len = 0;
            if (st != DUET_OK)
                return st;
            continue;
        }
        /* copy the run up to the next line end in one go */
        size_t j = i;
        while (j < len && data[j] != '\n' && data[j] != '\r')
            j++;
        size_t run = j - i;
        if (s->line_len + run > SERVING_SSE_MAX_LINE)
            return serving_stream_fail(s, "SSE line over %u bytes", SERVING_SSE_MAX_LINE);
        if (!sse_reserve(&s->line, &s->line_cap, s->line_len + run + 1))
            return serving_stream_fail(s, "out of memory"), DUET_ERR_NOMEM;
        memcpy(s->line + s->line_len, data + i, run);
        s->line_len += run;
        i = j - 1;
    }
    return DUET_OK;
}

duet_status_t serving_stream_finish(serving_stream_t *s)
{
    if (s->failed)
        return DUET_ERR_FORMAT;
    if (s->done && s->line_len == 0 && !s->has_data)
        return DUET_OK;
    if (s->done)
        return serving_stream_fail(s, "data after [DONE]");
    return serving_stream_fail(s, "stream ended before [DONE] (%u text chunks received)",
                               s->n_text_chunks);
}
