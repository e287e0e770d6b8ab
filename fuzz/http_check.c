/* See http_check.h. */
#include "fuzz/http_check.h"

#include <http_parser.h>
#include <strings.h>

#include "common/strbuf.h"
#include "fuzz/fuzz.h"

typedef struct {
    const fuzz_http_resp_cb_t *cb;
    size_t n_done, n_started;
    duet_strbuf_t field, ctype, body;
    bool in_ctype, in_value;
} resp_t;

static int on_begin(http_parser *p)
{
    resp_t *r = p->data;
    r->in_value = true;
    r->ctype.len = 0;
    r->body.len = 0;
    if (r->ctype.data != NULL)
        r->ctype.data[0] = '\0';
    if (r->body.data != NULL)
        r->body.data[0] = '\0';
    return 0;
}

static int on_field(http_parser *p, const char *at, size_t len)
{
    resp_t *r = p->data;
    if (r->in_value) { /* a new field */
        r->field.len = 0;
        r->in_value = false;
    }
    duet_strbuf_append(&r->field, at, len);
    return 0;
}

static int on_value(http_parser *p, const char *at, size_t len)
{
    resp_t *r = p->data;
    if (!r->in_value) {
        r->in_ctype = r->field.data != NULL && r->field.len == 12 &&
                      strncasecmp(r->field.data, "content-type", 12) == 0;
        r->in_value = true;
    }
    if (r->in_ctype)
        duet_strbuf_append(&r->ctype, at, len);
    return 0;
}

static int on_headers(http_parser *p)
{
    resp_t *r = p->data;
    size_t k = r->n_started++;
    r->field.len = 0;
    r->in_value = true;
    if (r->cb->is_head != NULL && r->cb->is_head(r->cb->user, k, (int)p->status_code))
        return 1;
    return 0;
}

static int on_body(http_parser *p, const char *at, size_t len)
{
    resp_t *r = p->data;
    duet_strbuf_append(&r->body, at, len);
    return 0;
}

static int on_complete(http_parser *p)
{
    resp_t *r = p->data;
    FUZZ_CHECK(duet_strbuf_status(&r->body) == DUET_OK, "oom");
    if (r->cb->on_response != NULL)
        r->cb->on_response(r->cb->user, r->n_done, (int)p->status_code,
                           r->ctype.data != NULL ? r->ctype.data : "",
                           r->body.data != NULL ? r->body.data : "", r->body.len);
    r->n_done++;
    return 0;
}

size_t fuzz_http_check_responses(const char *out, size_t len, const fuzz_http_resp_cb_t *cb)
{
    http_parser_settings s;
    memset(&s, 0, sizeof(s));
    s.on_message_begin = on_begin;
    s.on_header_field = on_field;
    s.on_header_value = on_value;
    s.on_headers_complete = on_headers;
    s.on_body = on_body;
    s.on_message_complete = on_complete;
    http_parser p;
    http_parser_init(&p, HTTP_RESPONSE);
    resp_t r = {.cb = cb};
    duet_strbuf_init(&r.field);
    duet_strbuf_init(&r.ctype);
    duet_strbuf_init(&r.body);
    p.data = &r;
    size_t n = http_parser_execute(&p, &s, out != NULL ? out : "", len);
    FUZZ_CHECK(n == len && HTTP_PARSER_ERRNO(&p) == HPE_OK,
               "the server wrote an invalid response stream (%s at byte %zu of %zu)",
               http_errno_name(HTTP_PARSER_ERRNO(&p)), n, len);
    http_parser_execute(&p, &s, NULL, 0); /* EOF ends a response framed by the close */
    duet_strbuf_free(&r.field);
    duet_strbuf_free(&r.ctype);
    duet_strbuf_free(&r.body);
    return r.n_done;
}
