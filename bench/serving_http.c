/*
 * HTTP/1.1 client for duet-bench; the contract is in serving_http.h.
 *
 * Life of a request: tcp init -> connect -> write the request and start reading -> parse ->
 * (message complete | EOF | error | abort) -> uv_close -> on_done from the close callback. Every
 * path to the end goes through http_finish(), which records the first reason and closes once.
 */
#include "bench/serving_http.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define HTTP_READ_BUF (64 * 1024)

/* One read buffer for the whole loop: reads are parsed before the next one starts. */
static char http_rbuf[HTTP_READ_BUF];

static void http_on_close(uv_handle_t *h)
{
    serving_http_req_t *req = h->data;
    free(req->out); /* a pending write's buffer: its callback ran before this one */
    req->out = NULL;
    req->cbs->on_done(req, req->error[0] != '\0' ? req->error : NULL);
}

/* End the request: keep the first reason (NULL = success) and close the handle once. */
static void http_finish(serving_http_req_t *req, const char *reason)
{
    if (req->closing)
        return;
    req->closing = true;
    if (reason != NULL && req->error[0] == '\0')
        snprintf(req->error, sizeof(req->error), "%s", reason);
    uv_close((uv_handle_t *)&req->tcp, http_on_close);
}

void serving_http_abort(serving_http_req_t *req, const char *fmt, ...)
{
    if (req->closing)
        return;
    char why[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof(why), fmt, ap);
    va_end(ap);
    http_finish(req, why);
}

/* ---------------------------------------------------------------- parser callbacks */

static int http_on_header_field(http_parser *p, const char *at, size_t len)
{
    serving_http_req_t *req = p->data;
    req->in_content_type = len == 12 && strncasecmp(at, "content-type", 12) == 0;
    return 0;
}

static int http_on_header_value(http_parser *p, const char *at, size_t len)
{
    serving_http_req_t *req = p->data;
    if (req->in_content_type) {
        size_t have = strlen(req->content_type);
        size_t room = sizeof(req->content_type) - 1 - have;
        size_t n = len < room ? len : room;
        memcpy(req->content_type + have, at, n);
        req->content_type[have + n] = '\0';
    }
    return 0;
}

static int http_on_headers_complete(http_parser *p)
{
    serving_http_req_t *req = p->data;
    req->cbs->on_headers(req, (int)p->status_code, req->content_type);
    return req->closing ? -1 : 0;
}

static int http_on_body(http_parser *p, const char *at, size_t len)
{
    serving_http_req_t *req = p->data;
    req->cbs->on_body(req, at, len, req->read_ns);
    return req->closing ? -1 : 0;
}

static int http_on_message_complete(http_parser *p)
{
    serving_http_req_t *req = p->data;
    req->complete = true;
    return 0;
}

static const http_parser_settings http_settings = {
    .on_header_field = http_on_header_field,
    .on_header_value = http_on_header_value,
    .on_headers_complete = http_on_headers_complete,
    .on_body = http_on_body,
    .on_message_complete = http_on_message_complete,
};

/* ---------------------------------------------------------------- socket callbacks */

static void http_on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    *buf = uv_buf_init(http_rbuf, sizeof(http_rbuf));
}

static void http_on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    serving_http_req_t *req = s->data;
    if (req->closing || nread == 0)
        return;
    if (nread < 0) {
        if (nread != UV_EOF) {
            char why[128];
            snprintf(why, sizeof(why), "read: %s", uv_strerror((int)nread));
            http_finish(req, why);
            return;
        }
        /* EOF: lets the parser end a body delimited by the connection close */
        http_parser_execute(&req->parser, &http_settings, NULL, 0);
        if (req->closing)
            return;
        http_finish(req, req->complete ? NULL : "connection closed before the response ended");
        return;
    }
    req->read_ns = uv_hrtime();
    size_t n = http_parser_execute(&req->parser, &http_settings, buf->base, (size_t)nread);
    if (req->closing)
        return; /* a callback aborted */
    if (n != (size_t)nread || HTTP_PARSER_ERRNO(&req->parser) != HPE_OK) {
        char why[160];
        snprintf(why, sizeof(why), "malformed HTTP response: %s",
                 http_errno_description(HTTP_PARSER_ERRNO(&req->parser)));
        http_finish(req, why);
        return;
    }
    if (req->complete)
        http_finish(req, NULL);
}

static void http_on_write(uv_write_t *w, int status)
{
    serving_http_req_t *req = w->data;
    free(req->out);
    req->out = NULL;
    if (status < 0 && !req->closing) {
        char why[128];
        snprintf(why, sizeof(why), "write: %s", uv_strerror(status));
        http_finish(req, why);
    }
}

static void http_on_connect(uv_connect_t *c, int status)
{
    serving_http_req_t *req = c->data;
    if (req->closing)
        return;
    if (status < 0) {
        char why[128];
        snprintf(why, sizeof(why), "connect: %s", uv_strerror(status));
        http_finish(req, why);
        return;
    }
    uv_buf_t b = uv_buf_init(req->out, (unsigned)strlen(req->out));
    req->write.data = req;
    int e = uv_write(&req->write, (uv_stream_t *)&req->tcp, &b, 1, http_on_write);
    if (e == 0)
        e = uv_read_start((uv_stream_t *)&req->tcp, http_on_alloc, http_on_read);
    if (e != 0) {
        char why[128];
        snprintf(why, sizeof(why), "write: %s", uv_strerror(e));
        http_finish(req, why);
    }
}

/* ---------------------------------------------------------------- public */

duet_status_t serving_http_resolve(uv_loop_t *loop, const char *host, int port,
                                   struct sockaddr_storage *addr_p)
{
    char service[16];
    snprintf(service, sizeof(service), "%d", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
    uv_getaddrinfo_t gai;
    int e = uv_getaddrinfo(loop, &gai, NULL, host, service, &hints);
    if (e != 0)
        return duet_error_set(DUET_ERR_NOT_FOUND, "cannot resolve %s: %s", host, uv_strerror(e));
    memset(addr_p, 0, sizeof(*addr_p));
    memcpy(addr_p, gai.addrinfo->ai_addr, gai.addrinfo->ai_addrlen);
    uv_freeaddrinfo(gai.addrinfo);
    return DUET_OK;
}

duet_status_t serving_http_start(uv_loop_t *loop, serving_http_req_t *req,
                                 const struct sockaddr *addr, const char *host_hdr,
                                 const char *method, const char *path, const char *body,
                                 size_t body_len, const serving_http_cbs_t *cbs, void *arg)
{
    memset(req, 0, sizeof(*req));
    req->arg = arg;
    req->cbs = cbs;
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    duet_strbuf_printf(&sb,
                       "%s %s HTTP/1.1\r\nHost: %s\r\nUser-Agent: duet-bench\r\n"
                       "Accept: */*\r\nConnection: close\r\n",
                       method, path, host_hdr);
    if (body != NULL)
        duet_strbuf_printf(&sb, "Content-Type: application/json\r\nContent-Length: %zu\r\n",
                           body_len);
    duet_strbuf_puts(&sb, "\r\n");
    if (body != NULL)
        duet_strbuf_append(&sb, body, body_len);
    if (duet_strbuf_status(&sb) != DUET_OK) {
        duet_strbuf_free(&sb);
        return duet_error_set(DUET_ERR_NOMEM, "request bytes");
    }
    req->out = duet_strbuf_detach(&sb);
    if (req->out == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "request bytes");
    http_parser_init(&req->parser, HTTP_RESPONSE);
    req->parser.data = req;
    int e = uv_tcp_init(loop, &req->tcp);
    if (e != 0) {
        free(req->out);
        req->out = NULL;
        return duet_error_set(DUET_ERR_TRANSPORT, "uv_tcp_init: %s", uv_strerror(e));
    }
    req->tcp.data = req;
    req->connect.data = req;
    uv_tcp_nodelay(&req->tcp, 1);
    e = uv_tcp_connect(&req->connect, &req->tcp, addr, http_on_connect);
    if (e != 0) {
        char why[128];
        snprintf(why, sizeof(why), "connect: %s", uv_strerror(e));
        http_finish(req, why); /* on_done follows from the close callback */
    }
    return DUET_OK;
}

/* ---------------------------------------------------------------- blocking requests */

typedef struct {
    int status;
    duet_strbuf_t *body;
    bool done;
    char error[256];
} http_get_t;

static void http_get_headers(serving_http_req_t *req, int status, const char *ct)
{
    ((http_get_t *)req->arg)->status = status;
}

static void http_get_body(serving_http_req_t *req, const char *data, size_t len, uint64_t now)
{
    http_get_t *g = req->arg;
    if (g->body->len + len > (64u << 20)) {
        serving_http_abort(req, "response body over 64 MiB");
        return;
    }
    duet_strbuf_append(g->body, data, len);
}

static void http_get_done(serving_http_req_t *req, const char *error)
{
    http_get_t *g = req->arg;
    g->done = true;
    if (error != NULL)
        snprintf(g->error, sizeof(g->error), "%s", error);
}

static void http_get_timeout(uv_timer_t *t)
{
    serving_http_abort(t->data, "timed out");
}

duet_status_t serving_http_fetch(uv_loop_t *loop, const struct sockaddr *addr, const char *host_hdr,
                                 const char *method, const char *path, const char *body,
                                 size_t body_len, uint64_t timeout_ms, int *status_p,
                                 duet_strbuf_t *resp)
{
    static const serving_http_cbs_t cbs = {http_get_headers, http_get_body, http_get_done};
    http_get_t g = {.status = 0, .body = resp};
    serving_http_req_t req;
    duet_status_t st =
        serving_http_start(loop, &req, addr, host_hdr, method, path, body, body_len, &cbs, &g);
    if (st != DUET_OK)
        return st;
    uv_timer_t timer;
    uv_timer_init(loop, &timer);
    timer.data = &req;
    uv_timer_start(&timer, http_get_timeout, timeout_ms, 0);
    while (!g.done)
        uv_run(loop, UV_RUN_ONCE);
    uv_close((uv_handle_t *)&timer, NULL);
    uv_run(loop, UV_RUN_NOWAIT); /* let the timer's close finish before it leaves scope */
    if (g.error[0] != '\0')
        return duet_error_set(DUET_ERR_TRANSPORT, "%s %s: %s", method, path, g.error);
    if (duet_strbuf_status(resp) != DUET_OK)
        return duet_error_set(DUET_ERR_NOMEM, "%s %s: body", method, path);
    *status_p = g.status;
    return DUET_OK;
}

duet_status_t serving_http_get(uv_loop_t *loop, const struct sockaddr *addr, const char *host_hdr,
                               const char *path, uint64_t timeout_ms, int *status_p,
                               duet_strbuf_t *body)
{
    return serving_http_fetch(loop, addr, host_hdr, "GET", path, NULL, 0, timeout_ms, status_p,
                              body);
}
