/*
 * The router's HTTP server through its socketless test seam (router/http/http_impl.h:
 * duet__http_server_start_fake / duet__http_server_feed), which fuzz/fuzz_http.c drives: the seam
 * itself (reads in any split, responses in order in the output, the client's EOF), and the
 * malformed-input findings of the fuzz target as plain cases, each next to the reproducer kept
 * in fuzz/regressions/http/.
 */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/strbuf.h"
#include "router/http/http.h"
#include "router/http/http_impl.h"

#define MAX_REQS 8

/* What the application saw: copies, taken inside on_request. */
typedef struct {
    int n;
    char method[MAX_REQS][16];
    char path[MAX_REQS][1024];
    char query[MAX_REQS][1024];
    size_t n_headers[MAX_REQS];
    bool has_auth[MAX_REQS];
    char body[MAX_REQS][64];
    int minor[MAX_REQS];
    bool stream; /* answer with an SSE stream instead of a whole response */
} seen_t;

static void on_request(duet_http_request_t *req, void *user)
{
    seen_t *s = user;
    cr_assert_lt(s->n, MAX_REQS);
    int k = s->n++;
    snprintf(s->method[k], sizeof(s->method[k]), "%s", duet_http_request_method(req));
    snprintf(s->path[k], sizeof(s->path[k]), "%s", duet_http_request_path(req));
    snprintf(s->query[k], sizeof(s->query[k]), "%s", duet_http_request_query(req));
    s->minor[k] = duet_http_request_version_minor(req);
    s->n_headers[k] = duet_http_request_header_count(req);
    for (size_t i = 0; i < s->n_headers[k]; i++) {
        const char *name, *value;
        duet_http_request_header_at(req, i, &name, &value);
        cr_assert_leq(strlen(value), 64, "header %s", name);
    }
    s->has_auth[k] = duet_http_request_header(req, "Authorization") != NULL;
    size_t len = 0;
    const char *body = duet_http_request_body(req, &len);
    snprintf(s->body[k], sizeof(s->body[k]), "%.*s", (int)len, body);
    if (s->stream) {
        cr_assert_eq(duet_http_sse_begin(req, NULL, 0), DUET_OK);
        cr_assert_eq(duet_http_sse_event(req, "{\"a\":1}", 7), DUET_OK);
        cr_assert_eq(duet_http_stream_end(req), DUET_OK);
    } else {
        char answer[64];
        int n = snprintf(answer, sizeof(answer), "answer %d", k);
        cr_assert_eq(duet_http_respond(req, 200, "text/plain", NULL, 0, answer, (size_t)n),
                     DUET_OK);
    }
    duet_http_request_release(req);
}

static void on_closed(void *user)
{
    *(bool *)user = true;
}

/* Feed `bytes` in reads of `split` bytes (0 = one read), then the client's EOF; close the server
 * and the loop; *out gets everything the server wrote. */
static void run(const char *bytes, size_t split, seen_t *seen, duet_strbuf_t *out)
{
    uv_loop_t loop;
    cr_assert_eq(uv_loop_init(&loop), 0);
    duet_http_options_t o;
    duet_http_options_default(&o);
    o.on_request = on_request;
    o.user = seen;
    duet_strbuf_init(out);
    duet_http_server_t *srv = NULL;
    cr_assert_eq(duet__http_server_start_fake(&loop, &o, out, &srv), DUET_OK, "%s",
                 duet_error_last());
    size_t len = strlen(bytes);
    for (size_t at = 0; at < len;) {
        size_t n = split == 0 || len - at < split ? len - at : split;
        cr_assert(duet__http_server_feed(srv, bytes + at, n), "read at %zu refused", at);
        uv_run(&loop, UV_RUN_NOWAIT);
        at += n;
    }
    (void)duet__http_server_feed(srv, "", 0);
    bool closed = false;
    duet_http_server_close(srv, on_closed, &closed);
    while (!closed)
        uv_run(&loop, UV_RUN_ONCE);
    cr_assert_eq(uv_loop_close(&loop), 0, "a handle was left open");
}

Test(router_http_fake, pipelined_requests_answered_in_order_whatever_the_split, .timeout = 10)
{
    const char *reqs = "GET /a?x=1 HTTP/1.1\r\nHost: t\r\n\r\n"
                       "POST /b HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello"
                       "GET /c HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n";
    for (size_t split = 0; split <= 7; split++) {
        seen_t seen = {0};
        duet_strbuf_t out;
        run(reqs, split, &seen, &out);
        cr_assert_eq(seen.n, 3, "split %zu: %d requests", split, seen.n);
        cr_assert_str_eq(seen.path[0], "/a");
        cr_assert_str_eq(seen.query[0], "x=1");
        cr_assert_str_eq(seen.body[1], "hello");
        cr_assert_str_eq(seen.path[2], "/c");
        const char *a0 = strstr(out.data, "answer 0"), *a1 = strstr(out.data, "answer 1"),
                   *a2 = strstr(out.data, "answer 2");
        cr_assert(a0 != NULL && a1 > a0 && a2 > a1, "split %zu: %s", split, out.data);
        cr_assert_not_null(strstr(out.data, "Connection: close"));
        duet_strbuf_free(&out);
    }
}

/* Found by fuzz/fuzz_http (fuzz/regressions/http/trailer_value_unterminated): a chunked body's
 * trailer was stored as one more header, and its value was never NUL-terminated, so reading it
 * ran off the request's buffer; a trailer could also add an Authorization field after the body. */
Test(router_http_fake, trailers_are_not_merged_into_the_headers, .timeout = 10)
{
    seen_t seen = {0};
    duet_strbuf_t out;
    run("POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
        "5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nAuthorization: Bearer x\r\nX-Trailer: t\r\n\r\n"
        "GET /next HTTP/1.1\r\nHost: t\r\n\r\n",
        3, &seen, &out);
    cr_assert_eq(seen.n, 2);
    cr_assert_str_eq(seen.body[0], "hello world");
    cr_assert_eq(seen.n_headers[0], 2, "%zu headers: trailers were merged", seen.n_headers[0]);
    cr_assert(!seen.has_auth[0], "a trailer became the Authorization header");
    cr_assert_str_eq(seen.path[1], "/next");
    cr_assert_not_null(strstr(out.data, "answer 1"));
    duet_strbuf_free(&out);
}

/* Found by fuzz/fuzz_admin (fuzz/regressions/admin/long_url_path_copied_after_free): the path and
 * query were copied out of the request's buffer while that buffer grew, i.e. from freed memory,
 * once the URL was long enough to make it grow. */
Test(router_http_fake, long_url_split_into_path_and_query, .timeout = 10)
{
    char path[700], query[300], req[1200];
    memset(path, 'p', sizeof(path) - 1);
    path[0] = '/';
    path[sizeof(path) - 1] = '\0';
    memset(query, 'q', sizeof(query) - 1);
    query[sizeof(query) - 1] = '\0';
    snprintf(req, sizeof(req), "GET %s?%s HTTP/1.1\r\nHost: t\r\n\r\n", path, query);
    seen_t seen = {0};
    duet_strbuf_t out;
    run(req, 0, &seen, &out);
    cr_assert_eq(seen.n, 1);
    cr_assert_str_eq(seen.path[0], path);
    cr_assert_str_eq(seen.query[0], query);
    duet_strbuf_free(&out);
}

/* Found by fuzz/fuzz_http (fuzz/regressions/http/minor_version_above_one): "HTTP/1.5" came to the
 * application as minor version 5, where http.h promises 0 or 1. */
Test(router_http_fake, minor_versions_above_one_read_as_http_1_1, .timeout = 10)
{
    seen_t seen = {0};
    duet_strbuf_t out;
    run("GET /a HTTP/1.5\r\nHost: t\r\n\r\nGET /b HTTP/1.0\r\nHost: t\r\n\r\n", 0, &seen, &out);
    cr_assert_eq(seen.n, 2);
    cr_assert_eq(seen.minor[0], 1, "HTTP/1.5 read as 1.%d", seen.minor[0]);
    cr_assert_eq(seen.minor[1], 0);
    duet_strbuf_free(&out);
}

/* Found by fuzz/fuzz_http (fuzz/regressions/http/path_not_absolute): http-parser accepts
 * "*OPTIONS" as a request target, and the application got the path "*OPTIONS"; a path must be
 * absolute (RFC 9112, 3.2), so that is a 400 now. "*" alone (OPTIONS *) stays the path "/". */
Test(router_http_fake, request_target_path_must_be_absolute, .timeout = 10)
{
    seen_t seen = {0};
    duet_strbuf_t out;
    run("OPTIONS * HTTP/1.1\r\nHost: t\r\n\r\nOPTIONS *OPTIONS HTTP/1.1\r\nHost: t\r\n\r\n", 0,
        &seen, &out);
    cr_assert_eq(seen.n, 1, "%d requests reached the application", seen.n);
    cr_assert_str_eq(seen.path[0], "/");
    cr_assert_not_null(strstr(out.data, "HTTP/1.1 400 Bad Request"), "%s", out.data);
    duet_strbuf_free(&out);
}

/* Found by fuzz/fuzz_http (fuzz/regressions/http/head_answered_with_a_stream): a streamed answer
 * to a HEAD request sent its chunks, which a client reads as the start of the next response. */
Test(router_http_fake, streamed_answer_to_head_has_no_body, .timeout = 10)
{
    seen_t seen = {.stream = true};
    duet_strbuf_t out;
    run("HEAD /v1/completions HTTP/1.1\r\nHost: t\r\n\r\nGET /b HTTP/1.1\r\nHost: t\r\n\r\n", 0,
        &seen, &out);
    cr_assert_eq(seen.n, 2);
    const char *second = strstr(out.data + 1, "HTTP/1.1 200");
    cr_assert_not_null(second, "%s", out.data);
    const char *head_end = strstr(out.data, "\r\n\r\n");
    cr_assert_eq(head_end + 4, second, "bytes after the HEAD answer's head: %s", out.data);
    cr_assert_not_null(strstr(second, "data: {\"a\":1}"), "the GET lost its events");
    duet_strbuf_free(&out);
}
