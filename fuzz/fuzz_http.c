/*
 * Fuzz target: HTTP/1.1 requests as the router's server reads them from a client
 * (router/http/http.c through its test seam duet__http_server_start_fake: the real parser
 * callbacks, limits, response queue, pipelining and error answers, on one connection without a
 * socket). Small limits make every limit reachable: 1 KiB of headers, 8 headers, a 256-byte URL,
 * a 4 KiB body, 3 pipelined requests.
 *
 * Input: a byte seeding the read sizes, a byte choosing how the application answers each request
 * (at once, as an SSE stream, held and answered after the next read, or released unanswered),
 * then the bytes the client sends; the client's EOF follows them.
 * Checked besides no crash / sanitizer report / hang:
 *  - each request handed to the application is within the limits: URL, header count and bytes,
 *    body (NUL-terminated), a known method, a path that starts with '/', HTTP/1.0 or 1.1; query
 *    and header lookups stay inside their buffers;
 *  - what the server wrote is a valid stream of HTTP/1.1 responses (parsed with http-parser in
 *    response mode, HEAD answers without a body), in request order: the k-th carries the status
 *    the application gave the k-th request, and at most one more follows, the server's own error
 *    answer (400, 408, 413, 414, 431, 501, 505);
 *  - every request is released exactly once; on_abort comes only for requests still held.
 */
#include "fuzz/fuzz.h"
#include "fuzz/fuzz_loop.h"
#include "fuzz/http_check.h"

#include <uv.h>

#include "common/status.h"
#include "common/strbuf.h"
#include "router/http/http.h"
#include "router/http/http_impl.h"

#define MAX_HELD 64
#define MAX_REQS 4096

typedef struct {
    duet_http_request_t *held[MAX_HELD];
    size_t n_held;
    uint8_t policy;
    size_t n_reqs;
    int want_status[MAX_REQS]; /* what the application answered request k with */
    bool is_head[MAX_REQS];
    const duet_http_options_t *opts;
} app_t;

static void answer(duet_http_request_t *req, int status)
{
    char body[64];
    int n = snprintf(body, sizeof(body), "%s %s\n", duet_http_request_method(req),
                     status == 202 ? "later" : "now");
    const duet_http_header_t h = {"X-Fuzz", "1"};
    duet_status_t st = duet_http_respond(req, status, "text/plain", &h, 1, body, (size_t)n);
    FUZZ_CHECK(st == DUET_OK || st == DUET_ERR_CANCELLED, "respond: %d", (int)st);
}

static void check_request(const app_t *app, duet_http_request_t *req)
{
    const duet_http_options_t *o = app->opts;
    const char *m = duet_http_request_method(req);
    FUZZ_CHECK(m != NULL && m[0] >= 'A' && m[0] <= 'Z', "method \"%s\"", m);
    FUZZ_CHECK(strlen(duet_http_request_url(req)) <= o->max_url_bytes, "url of %zu bytes",
               strlen(duet_http_request_url(req)));
    FUZZ_CHECK(duet_http_request_path(req)[0] == '/', "path \"%s\"", duet_http_request_path(req));
    int minor = duet_http_request_version_minor(req);
    FUZZ_CHECK(minor == 0 || minor == 1, "HTTP/1.%d", minor);
    size_t nh = duet_http_request_header_count(req), bytes = 0;
    FUZZ_CHECK(nh <= o->max_headers, "%zu headers", nh);
    for (size_t i = 0; i < nh; i++) {
        const char *name, *value;
        duet_http_request_header_at(req, i, &name, &value);
        bytes += strlen(name) + strlen(value) + 4;
    }
    FUZZ_CHECK(bytes <= o->max_header_bytes, "%zu header bytes", bytes);
    size_t blen = 0;
    const char *body = duet_http_request_body(req, &blen);
    FUZZ_CHECK(blen <= o->max_body_bytes && body[blen] == '\0', "body of %zu bytes", blen);
    char small[4], big[300];
    if (duet_http_request_query_param(req, "a", small, sizeof(small)))
        FUZZ_CHECK(strlen(small) < sizeof(small), "query a");
    if (duet_http_request_query_param(req, "", big, sizeof(big)))
        FUZZ_CHECK(strlen(big) < sizeof(big), "query \"\"");
    (void)duet_http_request_header(req, "content-length");
    (void)duet_http_request_peer(req);
}

static void on_request(duet_http_request_t *req, void *user)
{
    app_t *app = user;
    check_request(app, req);
    size_t k = app->n_reqs++;
    FUZZ_CHECK(k < MAX_REQS, "too many requests");
    app->is_head[k] = strcmp(duet_http_request_method(req), "HEAD") == 0;
    int mode = (app->policy >> (2 * (k % 4))) & 3;
    if (mode == 2 && app->n_held == MAX_HELD)
        mode = 0;
    switch (mode) {
    case 0:
        app->want_status[k] = 200;
        answer(req, 200);
        duet_http_request_release(req);
        break;
    case 1: {
        app->want_status[k] = 200;
        const duet_http_header_t h = {"X-Stream", "sse"};
        if (duet_http_sse_begin(req, &h, 1) == DUET_OK &&
            duet_http_sse_event(req, "{\"a\":1}", 7) == DUET_OK)
            (void)duet_http_stream_end(req);
        duet_http_request_release(req);
        break;
    }
    case 2:
        app->want_status[k] = 202;
        duet_http_request_set_data(req, app);
        app->held[app->n_held++] = req;
        break;
    default:
        app->want_status[k] = 500; /* the server answers a request released unanswered */
        duet_http_request_release(req);
        break;
    }
}

/* Answer the held requests, newest first (the queue must still send them in order). */
static void answer_held(app_t *app)
{
    while (app->n_held > 0) {
        duet_http_request_t *req = app->held[--app->n_held];
        duet_http_request_set_data(req, NULL);
        if (!duet_http_request_aborted(req))
            answer(req, 202);
        duet_http_request_release(req);
    }
}

static void on_abort(duet_http_request_t *req, void *user)
{
    app_t *app = user;
    FUZZ_CHECK(duet_http_request_get_data(req) == app, "on_abort for a request not held");
    for (size_t i = 0; i < app->n_held; i++)
        if (app->held[i] == req) {
            app->held[i] = app->held[--app->n_held];
            duet_http_request_set_data(req, NULL);
            duet_http_request_release(req);
            return;
        }
    FUZZ_CHECK(false, "aborted request not in the held list");
}

/* ---- checking the response stream */

static bool resp_is_head(void *user, size_t k, int status)
{
    const app_t *app = user;
    if (k < app->n_reqs) {
        FUZZ_CHECK(status == app->want_status[k],
                   "response %zu: status %d, the application gave %d", k, status,
                   app->want_status[k]);
        return app->is_head[k];
    }
    FUZZ_CHECK(k == app->n_reqs, "response %zu for %zu requests", k, app->n_reqs);
    FUZZ_CHECK(status == 400 || status == 408 || status == 413 || status == 414 || status == 431 ||
                   status == 501 || status == 505 || status == 503,
               "server answer %d", status);
    return false;
}

static void check_responses(const app_t *app, const duet_strbuf_t *out)
{
    const fuzz_http_resp_cb_t cb = {.is_head = resp_is_head, .user = (void *)app};
    size_t n = fuzz_http_check_responses(out->data, out->len, &cb);
    FUZZ_CHECK(n <= app->n_reqs + 1, "%zu responses for %zu requests", n, app->n_reqs);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_quiet();
    uv_loop_t *loop = fuzz_loop();
    fuzz_in_t in = {data, size};
    uint32_t rng = fuzz_byte(&in) * 2654435761u + 7;
    static app_t app;
    memset(&app, 0, sizeof(app));
    app.policy = fuzz_byte(&in);

    duet_http_options_t o;
    duet_http_options_default(&o);
    o.max_header_bytes = 1024;
    o.max_headers = 8;
    o.max_url_bytes = 256;
    o.max_body_bytes = 4096;
    o.max_pipeline = 3;
    o.max_output_bytes = 64 * 1024;
    o.shutdown_grace_ms = 1;
    o.on_request = on_request;
    o.on_abort = on_abort;
    o.user = &app;
    app.opts = &o;
    duet_strbuf_t out;
    duet_strbuf_init(&out);
    duet_http_server_t *srv = NULL;
    FUZZ_CHECK(duet__http_server_start_fake(loop, &o, &out, &srv) == DUET_OK, "start");

    while (in.n > 0) {
        rng = rng * 1103515245u + 12345u;
        size_t chunk = 1 + (rng >> 16) % 512, len;
        const uint8_t *p = fuzz_take(&in, chunk, &len);
        if (!duet__http_server_feed(srv, (const char *)p, len)) {
            answer_held(&app); /* paused at max_pipeline: answers let it read again */
            uv_run(loop, UV_RUN_NOWAIT);
            if (!duet__http_server_feed(srv, (const char *)p, len))
                break;
        }
        uv_run(loop, UV_RUN_NOWAIT);
        if ((rng >> 8) & 1)
            answer_held(&app);
    }
    (void)duet__http_server_feed(srv, "", 0); /* the client's EOF */
    uv_run(loop, UV_RUN_NOWAIT);
    answer_held(&app);
    bool closed = false;
    duet_http_server_close(srv, fuzz_on_closed, &closed);
    while (!closed)
        uv_run(loop, UV_RUN_ONCE);
    FUZZ_CHECK(app.n_held == 0, "held requests left");
    check_responses(&app, &out);
    duet_strbuf_free(&out);
    return 0;
}
