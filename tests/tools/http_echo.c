/*
 * duet-http-echo's endpoints (see http_echo.h). Asynchronous answers keep a context with a timer;
 * the context is freed, and the request released, in the timer's close callback, whether the
 * answer finished or the client went away (on_abort).
 */
#include "tests/tools/http_echo.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

typedef struct {
    uv_timer_t timer;
    duet_http_echo_t *app;
    duet_http_request_t *req; /* the app's reference, released in echo_ctx_on_close */
    int i, n;
    size_t size;
    bool stream;
    bool closing;
} echo_ctx_t;

void duet_http_echo_init(duet_http_echo_t *app, uv_loop_t *loop)
{
    app->loop = loop;
    atomic_init(&app->requests, 0);
    atomic_init(&app->aborts, 0);
    atomic_init(&app->active, 0);
    atomic_init(&app->double_abort, 0);
}

const char *duet_http_echo_path_class(const char *path, void *user)
{
    static const char *const known[] = {"/health", "/echo", "/slow", "/stream", "/release"};
    for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++)
        if (strcmp(path, known[i]) == 0)
            return known[i];
    return "other";
}

static void echo_ctx_on_close(uv_handle_t *h)
{
    echo_ctx_t *ctx = h->data;
    duet_http_request_set_data(ctx->req, NULL);
    duet_http_request_release(ctx->req);
    atomic_fetch_sub(&ctx->app->active, 1);
    free(ctx);
}

static void echo_ctx_done(echo_ctx_t *ctx)
{
    if (ctx->closing)
        return;
    ctx->closing = true;
    uv_timer_stop(&ctx->timer);
    uv_close((uv_handle_t *)&ctx->timer, echo_ctx_on_close);
}

/* Write event i of a stream, padded with 'x' to ctx->size bytes. */
static duet_status_t echo_event(echo_ctx_t *ctx, int i)
{
    char small[64];
    int l = snprintf(small, sizeof(small), "%d", i);
    size_t n = ctx->size > (size_t)l ? ctx->size : (size_t)l;
    char *buf = n <= sizeof(small) ? small : malloc(n);
    if (buf == NULL)
        return DUET_ERR_NOMEM;
    if (buf != small)
        memcpy(buf, small, (size_t)l);
    memset(buf + l, 'x', n - (size_t)l);
    duet_status_t st = duet_http_sse_event(ctx->req, buf, n);
    if (buf != small)
        free(buf);
    return st;
}

static void echo_on_timer(uv_timer_t *t)
{
    echo_ctx_t *ctx = t->data;
    if (!ctx->stream) {
        char body[64];
        int l = snprintf(body, sizeof(body), "slow %d\n", ctx->n);
        duet_http_respond(ctx->req, 200, "text/plain", NULL, 0, body, (size_t)l);
        echo_ctx_done(ctx);
        return;
    }
    if (echo_event(ctx, ctx->i++) != DUET_OK) {
        /* The request is aborted: on_abort is still to come and cleans up. */
        uv_timer_stop(&ctx->timer);
        return;
    }
    if (ctx->i >= ctx->n) {
        duet_http_stream_end(ctx->req);
        echo_ctx_done(ctx);
    }
}

static long query_long(duet_http_request_t *req, const char *name, long dflt, long max)
{
    char v[32];
    if (!duet_http_request_query_param(req, name, v, sizeof(v)))
        return dflt;
    char *end = NULL;
    long x = strtol(v, &end, 10);
    if (end == v || *end != '\0' || x < 0)
        return dflt;
    return x > max ? max : x;
}

static echo_ctx_t *echo_ctx_new(duet_http_echo_t *app, duet_http_request_t *req)
{
    echo_ctx_t *ctx = calloc(1, sizeof(*ctx));
    if (ctx == NULL)
        return NULL;
    ctx->app = app;
    ctx->req = req;
    uv_timer_init(app->loop, &ctx->timer);
    ctx->timer.data = ctx;
    duet_http_request_set_data(req, ctx);
    atomic_fetch_add(&app->active, 1);
    return ctx;
}

void duet_http_echo_on_request(duet_http_request_t *req, void *user)
{
    duet_http_echo_t *app = user;
    atomic_fetch_add(&app->requests, 1);
    const char *path = duet_http_request_path(req);
    if (strcmp(path, "/health") == 0) {
        duet_http_respond(req, 200, "text/plain", NULL, 0, "ok\n", 3);
    } else if (strcmp(path, "/echo") == 0) {
        size_t len = 0;
        const char *body = duet_http_request_body(req, &len);
        const char *ct = duet_http_request_header(req, "content-type");
        const char *test = duet_http_request_header(req, "x-test");
        duet_http_header_t h[3] = {
            {"X-Method", duet_http_request_method(req)},
            {"X-Query", duet_http_request_query(req)},
            {"X-Test-Echo", test != NULL ? test : "-"},
        };
        if (duet_http_respond(req, 200, ct != NULL ? ct : "application/octet-stream", h, 3, body,
                              len) == DUET_ERR_INVALID)
            duet_http_respond(req, 400, "text/plain", NULL, 0, "bad header\n", 11);
    } else if (strcmp(path, "/slow") == 0) {
        echo_ctx_t *ctx = echo_ctx_new(app, req);
        if (ctx == NULL)
            goto oom;
        ctx->n = (int)query_long(req, "ms", 100, 60 * 1000);
        uv_timer_start(&ctx->timer, echo_on_timer, (uint64_t)ctx->n, 0);
        return; /* released in echo_ctx_on_close */
    } else if (strcmp(path, "/stream") == 0) {
        int n = (int)query_long(req, "n", 3, 1000 * 1000 * 1000);
        long ms = query_long(req, "ms", 10, 60 * 1000);
        size_t size = (size_t)query_long(req, "size", 0, 1 << 20);
        if (duet_http_sse_begin(req, NULL, 0) != DUET_OK)
            goto done;
        if (ms == 0) {
            if (n > 100 * 1000)
                n = 100 * 1000; /* a synchronous loop: keep it bounded */
            echo_ctx_t tmp = {.req = req, .size = size};
            int i = 0;
            while (i < n && echo_event(&tmp, i) == DUET_OK)
                i++;
            if (i == n)
                duet_http_stream_end(req);
            goto done;
        }
        echo_ctx_t *ctx = echo_ctx_new(app, req);
        if (ctx == NULL)
            goto oom;
        ctx->stream = true;
        ctx->n = n;
        ctx->size = size;
        if (n == 0) {
            duet_http_stream_end(req);
            echo_ctx_done(ctx);
            return;
        }
        uv_timer_start(&ctx->timer, echo_on_timer, (uint64_t)ms, (uint64_t)ms);
        return;
    } else if (strcmp(path, "/release") == 0) {
        /* released unanswered on purpose */
    } else {
        duet_http_respond(req, 404, "text/plain", NULL, 0, "not found\n", 10);
    }
done:
    duet_http_request_release(req);
    return;
oom:
    duet_http_respond(req, 503, "text/plain", NULL, 0, "out of memory\n", 14);
    duet_http_request_release(req);
}

void duet_http_echo_on_abort(duet_http_request_t *req, void *user)
{
    duet_http_echo_t *app = user;
    atomic_fetch_add(&app->aborts, 1);
    echo_ctx_t *ctx = duet_http_request_get_data(req);
    if (ctx == NULL) {
        atomic_fetch_add(&app->double_abort, 1); /* every async request has a context */
        return;
    }
    DUET_RLOG_DEBUG(duet_http_request_id(req), "echo: client went away");
    echo_ctx_done(ctx);
}
