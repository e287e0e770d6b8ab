/*
 * The router's HTTP server (router/http/http.h) driven over real loopback sockets: the server and
 * the echo application (tests/tools/http_echo.h) run on a uv loop in a second thread, the test
 * speaks raw HTTP/1.x bytes to it. Covers keep-alive, pipelining in order (slow first), the limits
 * and their status codes, the timeouts, client aborts mid-stream, graceful shutdown, metrics, and a
 * deterministic fuzz run. Every test ends by closing the server and proving the loop closed clean
 * (no handle left, uv_loop_close == 0, no request context left in the app).
 */
#define _GNU_SOURCE /* memmem */
#include <criterion/criterion.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/metrics.h"
#include "router/http/http.h"
#include "tests/tools/http_echo.h"

/* ------------------------------------------------------------------ server in a thread */

typedef struct {
    uv_loop_t loop;
    uv_async_t stop;
    pthread_t thread;
    duet_http_server_t *srv;
    uint16_t port;
    duet_http_echo_t app;
    duet_http_options_t opts;
    atomic_int closed;
    bool running;
} harness_t;

static harness_t H;

static void h_on_closed(void *user)
{
    atomic_store(&H.closed, 1);
}

static void h_on_stop(uv_async_t *a)
{
    duet_http_server_close(H.srv, h_on_closed, NULL);
    uv_close((uv_handle_t *)a, NULL);
}

static void *h_thread(void *arg)
{
    uv_run(&H.loop, UV_RUN_DEFAULT);
    return NULL;
}

/* Options every test starts from: short timeouts so the suite is quick. */
static void h_options(duet_http_options_t *o)
{
    duet_http_options_default(o);
    o->header_timeout_ms = 3000;
    o->body_timeout_ms = 3000;
    o->idle_timeout_ms = 5000;
    o->linger_ms = 500;
    o->shutdown_grace_ms = 2000;
}

static void h_start_with(const duet_http_options_t *base)
{
    memset(&H, 0, sizeof(H));
    cr_assert_eq(uv_loop_init(&H.loop), 0);
    duet_http_echo_init(&H.app, &H.loop);
    H.opts = *base;
    H.opts.on_request = base->on_request != NULL ? base->on_request : duet_http_echo_on_request;
    H.opts.on_abort = base->on_abort != NULL ? base->on_abort : duet_http_echo_on_abort;
    H.opts.user = &H.app;
    cr_assert_eq(duet_http_server_start(&H.loop, &H.opts, &H.srv), DUET_OK);
    H.port = duet_http_server_port(H.srv);
    cr_assert_neq(H.port, 0);
    cr_assert_eq(uv_async_init(&H.loop, &H.stop, h_on_stop), 0);
    cr_assert_eq(pthread_create(&H.thread, NULL, h_thread, NULL), 0);
    H.running = true;
}

static void h_start(void)
{
    duet_http_options_t o;
    h_options(&o);
    h_start_with(&o);
}

static void count_handle(uv_handle_t *h, void *arg)
{
    (*(int *)arg)++;
}

/* Ask the loop thread to close the server, wait, and prove the loop is empty. */
static void h_stop(void)
{
    cr_assert(H.running);
    H.running = false;
    uv_async_send(&H.stop);
    pthread_join(H.thread, NULL);
    int n = 0;
    uv_walk(&H.loop, count_handle, &n);
    cr_assert_eq(n, 0, "%d handle(s) left open", n);
    cr_assert_eq(uv_loop_close(&H.loop), 0);
    cr_assert_eq(atomic_load(&H.closed), 1, "close callback not called");
    cr_assert_eq(atomic_load(&H.app.active), 0, "request contexts leaked");
    cr_assert_eq(atomic_load(&H.app.double_abort), 0, "on_abort called twice");
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* ------------------------------------------------------------------ raw client */

typedef struct {
    int fd;
    char *buf; /* received, not yet consumed */
    size_t len, cap;
    bool eof;
} client_t;

static void cli_timeout(client_t *c, int ms)
{
    struct timeval tv = {ms / 1000, (ms % 1000) * 1000};
    setsockopt(c->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
}

/* Connect to the server; -1 in c->fd when refused. */
static client_t cli_open_rcvbuf(int rcvbuf)
{
    client_t c = {0};
    c.fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert_geq(c.fd, 0);
    if (rcvbuf > 0)
        setsockopt(c.fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_port = htons(H.port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(connect(c.fd, (struct sockaddr *)&a, sizeof(a)), 0, "connect: %s",
                 strerror(errno));
    int one = 1;
    setsockopt(c.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    cli_timeout(&c, 5000);
    c.cap = 1 << 16;
    c.buf = malloc(c.cap);
    return c;
}

static client_t cli_open(void)
{
    return cli_open_rcvbuf(0);
}

static void cli_close(client_t *c)
{
    if (c->fd >= 0)
        close(c->fd);
    c->fd = -1;
    free(c->buf);
    c->buf = NULL;
}

/* Send all bytes; false when the server has closed. */
static bool cli_send_n(client_t *c, const char *s, size_t n)
{
    while (n > 0) {
        ssize_t w = send(c->fd, s, n, MSG_NOSIGNAL);
        if (w <= 0)
            return false;
        s += w;
        n -= (size_t)w;
    }
    return true;
}

static bool cli_send(client_t *c, const char *s)
{
    return cli_send_n(c, s, strlen(s));
}

/* Receive more bytes; false at EOF, reset or timeout. */
static bool cli_fill(client_t *c)
{
    if (c->eof)
        return false;
    if (c->len + 4096 > c->cap) {
        c->cap *= 2;
        c->buf = realloc(c->buf, c->cap);
    }
    ssize_t r = recv(c->fd, c->buf + c->len, c->cap - c->len, 0);
    if (r <= 0) {
        c->eof = true;
        return false;
    }
    c->len += (size_t)r;
    return true;
}

static void cli_consume(client_t *c, size_t n)
{
    memmove(c->buf, c->buf + n, c->len - n);
    c->len -= n;
}

typedef struct {
    int status;
    char head[4096];
    char *body; /* malloc'd, NUL-terminated */
    size_t body_len;
} resp_t;

static void resp_free(resp_t *r)
{
    free(r->body);
    r->body = NULL;
}

/* Value of header `name` in r->head (into out, cap bytes); false when absent. */
static bool resp_header(const resp_t *r, const char *name, char *out, size_t cap)
{
    const char *p = strstr(r->head, "\r\n");
    size_t nl = strlen(name);
    while (p != NULL && p[2] != '\0') {
        p += 2;
        const char *eol = strstr(p, "\r\n");
        if (eol == NULL)
            break;
        if ((size_t)(eol - p) > nl && strncasecmp(p, name, nl) == 0 && p[nl] == ':') {
            const char *v = p + nl + 1;
            while (*v == ' ')
                v++;
            size_t l = (size_t)(eol - v);
            if (l >= cap)
                l = cap - 1;
            memcpy(out, v, l);
            out[l] = '\0';
            return true;
        }
        p = eol;
    }
    return false;
}

/*
 * Read one response: 0 ok, -1 nothing at all came (EOF/reset/timeout), -2 truncated or
 * malformed. Bodies: Content-Length, chunked, or until EOF.
 */
static int cli_response(client_t *c, resp_t *r)
{
    memset(r, 0, sizeof(*r));
    char *end;
    for (;;) {
        end = c->len > 0 ? memmem(c->buf, c->len, "\r\n\r\n", 4) : NULL;
        if (end != NULL)
            break;
        if (!cli_fill(c))
            return c->len == 0 ? -1 : -2;
    }
    size_t hl = (size_t)(end - c->buf) + 4;
    if (hl >= sizeof(r->head))
        return -2;
    memcpy(r->head, c->buf, hl);
    r->head[hl] = '\0';
    cli_consume(c, hl);
    if (sscanf(r->head, "HTTP/1.%*d %d", &r->status) != 1)
        return -2;
    char v[64];
    if (resp_header(r, "Transfer-Encoding", v, sizeof(v))) {
        size_t cap = 1024, len = 0;
        r->body = malloc(cap);
        for (;;) {
            char *eol;
            while ((eol = c->len > 0 ? memmem(c->buf, c->len, "\r\n", 2) : NULL) == NULL)
                if (!cli_fill(c))
                    return -2;
            size_t sz = strtoul(c->buf, NULL, 16);
            cli_consume(c, (size_t)(eol - c->buf) + 2);
            while (c->len < sz + 2)
                if (!cli_fill(c))
                    return -2;
            if (len + sz + 1 > cap) {
                cap = (len + sz + 1) * 2;
                r->body = realloc(r->body, cap);
            }
            memcpy(r->body + len, c->buf, sz);
            len += sz;
            cli_consume(c, sz + 2);
            if (sz == 0)
                break;
        }
        r->body[len] = '\0';
        r->body_len = len;
        return 0;
    }
    size_t want = SIZE_MAX;
    if (resp_header(r, "Content-Length", v, sizeof(v)))
        want = strtoul(v, NULL, 10);
    while (want != SIZE_MAX ? c->len < want : cli_fill(c))
        if (want != SIZE_MAX && !cli_fill(c))
            return -2;
    size_t n = want != SIZE_MAX ? want : c->len;
    r->body = malloc(n + 1);
    memcpy(r->body, c->buf, n);
    r->body[n] = '\0';
    r->body_len = n;
    cli_consume(c, n);
    return 0;
}

/* The server closes the connection (EOF or reset) within ms, with nothing more to read. */
static bool cli_expect_eof(client_t *c, int ms)
{
    cli_timeout(c, ms);
    char b[256];
    for (;;) {
        ssize_t r = recv(c->fd, b, sizeof(b), 0);
        if (r == 0)
            return true;
        if (r < 0)
            return errno == ECONNRESET;
    }
}

/* One request on a fresh connection, one response; returns the status (or -1/-2). */
static int one_shot(const char *request, resp_t *r)
{
    client_t c = cli_open();
    cli_send(&c, request);
    int rc = cli_response(&c, r);
    cli_close(&c);
    return rc == 0 ? r->status : rc;
}

static int poll_until(atomic_ullong *v, unsigned long long want, int ms)
{
    double t0 = now_ms();
    while (atomic_load(v) != want && now_ms() - t0 < ms)
        sleep_ms(5);
    return atomic_load(v) == want;
}

#define GET(path) "GET " path " HTTP/1.1\r\nHost: t\r\n\r\n"

/* ------------------------------------------------------------------ tests */

Test(router_http, get_post_and_404, .timeout = 20)
{
    h_start();
    resp_t r;
    cr_assert_eq(one_shot(GET("/health"), &r), 200);
    cr_assert_str_eq(r.body, "ok\n");
    resp_free(&r);

    const char *post = "POST /echo?x=1&y=2 HTTP/1.1\r\nHost: t\r\nX-Empty:\r\nX-TEST: Mixed\r\n"
                       "Content-Type: text/plain\r\nContent-Length: 11\r\n\r\nhello world";
    cr_assert_eq(one_shot(post, &r), 200);
    cr_assert_str_eq(r.body, "hello world");
    char v[64];
    cr_assert(resp_header(&r, "X-Test-Echo", v, sizeof(v)));
    cr_assert_str_eq(v, "Mixed"); /* looked up as "x-test" */
    cr_assert(resp_header(&r, "X-Query", v, sizeof(v)));
    cr_assert_str_eq(v, "x=1&y=2");
    cr_assert(resp_header(&r, "X-Method", v, sizeof(v)));
    cr_assert_str_eq(v, "POST");
    cr_assert(resp_header(&r, "Content-Type", v, sizeof(v)));
    cr_assert_str_eq(v, "text/plain");
    resp_free(&r);

    cr_assert_eq(one_shot(GET("/nope"), &r), 404);
    resp_free(&r);
    h_stop();
}

Test(router_http, keep_alive_many_requests, .timeout = 20)
{
    h_start();
    client_t c = cli_open();
    for (int i = 0; i < 20; i++) {
        char req[128], want[16];
        snprintf(want, sizeof(want), "body%d", i);
        snprintf(req, sizeof(req),
                 "POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: %zu\r\n\r\n%s", strlen(want),
                 want);
        cr_assert(cli_send(&c, req));
        resp_t r;
        cr_assert_eq(cli_response(&c, &r), 0);
        cr_assert_eq(r.status, 200);
        cr_assert_str_eq(r.body, want);
        char v[32];
        cr_assert_not(resp_header(&r, "Connection", v, sizeof(v)));
        resp_free(&r);
    }
    cli_close(&c);
    h_stop();
}

Test(router_http, pipelined_in_order_slow_first, .timeout = 20)
{
    h_start();
    client_t c = cli_open();
    const char *batch =
        GET("/slow?ms=300") "POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nb1" GET(
            "/health") GET("/slow?ms=50")
            GET("/stream?n=3&ms=5") "HEAD /health HTTP/1.1\r\nHost: t\r\n\r\n"
                                    "POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: "
                                    "chunked\r\n\r\n"
                                    "2\r\nb2\r\n0\r\n\r\n";
    cr_assert(cli_send(&c, batch)); /* one send */
    const char *want[] = {
        "slow 300\n", "b1", "ok\n", "slow 50\n", "data: 0\n\ndata: 1\n\ndata: 2\n\n", "", "b2"};
    for (int i = 0; i < 7; i++) {
        resp_t r;
        if (i == 5) {
            /* HEAD: Content-Length of the GET body, but no body bytes. */
            char *end;
            while ((end = memmem(c.buf, c.len, "\r\n\r\n", 4)) == NULL)
                cr_assert(cli_fill(&c));
            cr_assert(strncmp(c.buf, "HTTP/1.1 200", 12) == 0);
            cr_assert(memmem(c.buf, (size_t)(end - c.buf), "Content-Length: 3", 17) != NULL);
            cli_consume(&c, (size_t)(end - c.buf) + 4);
            continue;
        }
        cr_assert_eq(cli_response(&c, &r), 0, "response %d", i);
        cr_assert_eq(r.status, 200, "response %d", i);
        cr_assert_str_eq(r.body, want[i], "response %d", i);
        resp_free(&r);
    }
    /* The connection stays usable after the batch. */
    cr_assert(cli_send(&c, GET("/health")));
    resp_t r;
    cr_assert_eq(cli_response(&c, &r), 0);
    cr_assert_eq(r.status, 200);
    resp_free(&r);
    cli_close(&c);
    h_stop();
}

Test(router_http, pipeline_limit_pauses_and_resumes, .timeout = 20)
{
    duet_http_options_t o;
    h_options(&o);
    o.max_pipeline = 2;
    h_start_with(&o);
    client_t c = cli_open();
    char batch[4096] = "";
    for (int i = 0; i < 10; i++) {
        char one[128];
        snprintf(one, sizeof(one), "GET /slow?ms=%d HTTP/1.1\r\nHost: t\r\n\r\n", 100 - 10 * i);
        strcat(batch, one);
    }
    cr_assert(cli_send(&c, batch));
    for (int i = 0; i < 10; i++) {
        resp_t r;
        char want[32];
        snprintf(want, sizeof(want), "slow %d\n", 100 - 10 * i);
        cr_assert_eq(cli_response(&c, &r), 0, "response %d", i);
        cr_assert_str_eq(r.body, want);
        resp_free(&r);
    }
    cli_close(&c);
    h_stop();
}

/* Send raw bytes; expect status `want` and then the connection closed. */
static void expect_error(const char *raw, size_t len, int want)
{
    client_t c = cli_open();
    cli_send_n(&c, raw, len);
    resp_t r;
    cr_assert_eq(cli_response(&c, &r), 0, "no response for error %d", want);
    cr_assert_eq(r.status, want, "got %d, want %d", r.status, want);
    char v[32];
    cr_assert(resp_header(&r, "Connection", v, sizeof(v)));
    cr_assert_str_eq(v, "close");
    resp_free(&r);
    cr_assert(cli_expect_eof(&c, 3000), "connection not closed after %d", want);
    cli_close(&c);
}

static void expect_error_str(const char *raw, int want)
{
    expect_error(raw, strlen(raw), want);
}

Test(router_http, malformed_requests, .timeout = 30)
{
    h_start();
    expect_error_str("GARBAGE\r\n\r\n", 400);
    expect_error_str("GET / HTTP/1.1\r\nHost t\r\n\r\n", 400);            /* no colon */
    expect_error_str("GET / HTTP/1.1\r\nHo\x01st: t\r\n\r\n", 400);       /* bad token */
    expect_error_str("GET /a b HTTP/1.1\r\nHost: t\r\n\r\n", 400);        /* space in URL */
    expect_error_str("GET / HTTP/1.1\r\nContent-Length: x\r\n\r\n", 400); /* bad length */
    expect_error_str("POST /echo HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked"
                     "\r\n\r\n1\r\na\r\n0\r\n\r\n",
                     400); /* smuggling */
    expect_error_str("GET / HTTP/2.0\r\nHost: t\r\n\r\n", 505);
    expect_error_str("CONNECT example.com:443 HTTP/1.1\r\nHost: t\r\n\r\n", 501);
    expect_error_str("POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip\r\n\r\n", 501);
    expect_error_str("POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
                     "0\r\n\r\n",
                     501);
    /* An error behind a pipelined slow request is answered after it, in order. */
    client_t c = cli_open();
    cli_send(&c, GET("/slow?ms=100") "BAD\r\n\r\n");
    resp_t r;
    cr_assert_eq(cli_response(&c, &r), 0);
    cr_assert_eq(r.status, 200);
    resp_free(&r);
    cr_assert_eq(cli_response(&c, &r), 0);
    cr_assert_eq(r.status, 400);
    resp_free(&r);
    cr_assert(cli_expect_eof(&c, 3000));
    cli_close(&c);
    /* The server still serves. */
    cr_assert_eq(one_shot(GET("/health"), &r), 200);
    resp_free(&r);
    h_stop();
}

Test(router_http, size_limits, .timeout = 30)
{
    duet_http_options_t o;
    h_options(&o);
    o.max_body_bytes = 1000;
    h_start_with(&o);
    /* Headers over 16 KiB: 431. */
    size_t big = 20 * 1024;
    char *raw = malloc(big + 256);
    int n = sprintf(raw, "GET / HTTP/1.1\r\nX-Big: ");
    memset(raw + n, 'a', big);
    strcpy(raw + n + big, "\r\n\r\n");
    expect_error(raw, strlen(raw), 431);
    /* More than 100 headers: 431. */
    n = sprintf(raw, "GET / HTTP/1.1\r\n");
    for (int i = 0; i < 120; i++)
        n += sprintf(raw + n, "X-H%d: v\r\n", i);
    strcpy(raw + n, "\r\n");
    expect_error(raw, strlen(raw), 431);
    /* URL over 8 KiB: 414. */
    n = sprintf(raw, "GET /");
    memset(raw + n, 'u', 9000);
    strcpy(raw + n + 9000, " HTTP/1.1\r\nHost: t\r\n\r\n");
    expect_error(raw, strlen(raw), 414);
    free(raw);
    /* Declared body over the limit: 413 at once, before the body is sent. */
    double t0 = now_ms();
    expect_error_str("POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 100000000\r\n\r\nabc", 413);
    cr_assert_lt(now_ms() - t0, 2000);
    /* Chunked body whose total goes over the limit: 413. */
    char chunk[800];
    memset(chunk, 'c', sizeof(chunk));
    client_t c = cli_open();
    cli_send(&c, "POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n");
    for (int i = 0; i < 2; i++) {
        cli_send(&c, "320\r\n");
        cli_send_n(&c, chunk, sizeof(chunk));
        cli_send(&c, "\r\n");
    }
    resp_t r;
    cr_assert_eq(cli_response(&c, &r), 0);
    cr_assert_eq(r.status, 413);
    resp_free(&r);
    cr_assert(cli_expect_eof(&c, 3000));
    cli_close(&c);
    /* Exactly at the limit is fine. */
    raw = malloc(2048);
    n = sprintf(raw, "POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n");
    memset(raw + n, 'b', 1000);
    raw[n + 1000] = '\0';
    cr_assert_eq(one_shot(raw, &r), 200);
    cr_assert_eq(r.body_len, 1000);
    resp_free(&r);
    free(raw);
    h_stop();
}

Test(router_http, chunked_request_body, .timeout = 20)
{
    h_start();
    client_t c = cli_open();
    cli_send(&c, "POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel");
    sleep_ms(50); /* split across reads */
    cli_send(&c, "lo\r\n6;ext=1\r\n world\r\n0\r\nTrailer: x\r\n\r\n");
    resp_t r;
    cr_assert_eq(cli_response(&c, &r), 0);
    cr_assert_eq(r.status, 200);
    cr_assert_str_eq(r.body, "hello world");
    resp_free(&r);
    cli_close(&c);
    h_stop();
}

Test(router_http, slow_client_cut_by_header_timeout, .timeout = 20)
{
    duet_http_options_t o;
    h_options(&o);
    o.header_timeout_ms = 500;
    h_start_with(&o);
    client_t c = cli_open();
    const char *req = "GET /health HTTP/1.1\r\nHost: t\r\nX-Dribble: "
                      "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n";
    double t0 = now_ms();
    bool answered = false;
    for (size_t i = 0; req[i] != '\0' && !answered; i++) {
        if (!cli_send_n(&c, req + i, 1))
            break;
        struct pollfd p = {c.fd, POLLIN, 0};
        answered = poll(&p, 1, 100) == 1;
    }
    double dt = now_ms() - t0;
    resp_t r;
    cr_assert_eq(cli_response(&c, &r), 0, "no answer to a dribbling client");
    cr_assert_eq(r.status, 408);
    resp_free(&r);
    cr_assert_geq(dt, 400);
    cr_assert_lt(dt, 2000, "cut after %.0f ms", dt);
    cr_assert(cli_expect_eof(&c, 3000));
    cli_close(&c);
    h_stop();
}

Test(router_http, body_timeout, .timeout = 20)
{
    duet_http_options_t o;
    h_options(&o);
    o.body_timeout_ms = 300;
    h_start_with(&o);
    client_t c = cli_open();
    double t0 = now_ms();
    cli_send(&c, "POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nabc");
    resp_t r;
    cr_assert_eq(cli_response(&c, &r), 0);
    cr_assert_eq(r.status, 408);
    cr_assert_geq(now_ms() - t0, 250);
    resp_free(&r);
    cr_assert(cli_expect_eof(&c, 3000));
    cli_close(&c);
    h_stop();
}

Test(router_http, idle_timeout_closes, .timeout = 20)
{
    duet_http_options_t o;
    h_options(&o);
    o.idle_timeout_ms = 200;
    h_start_with(&o);
    client_t c = cli_open();
    cli_send(&c, GET("/health"));
    resp_t r;
    cr_assert_eq(cli_response(&c, &r), 0);
    resp_free(&r);
    double t0 = now_ms();
    cr_assert(cli_expect_eof(&c, 3000));
    double dt = now_ms() - t0;
    cr_assert_geq(dt, 150);
    cr_assert_lt(dt, 1500);
    cli_close(&c);
    /* A connection that never sends anything is closed too. */
    c = cli_open();
    cr_assert(cli_expect_eof(&c, 3000));
    cli_close(&c);
    h_stop();
}

Test(router_http, sse_client_disconnect_aborts_once, .timeout = 20)
{
    h_start();
    client_t a = cli_open();
    cli_send(&a, GET("/stream?n=1000000&ms=5"));
    /* Read the head and a few events, then hang up. */
    while (memmem(a.buf, a.len, "data: 3\n\n", 9) == NULL)
        cr_assert(cli_fill(&a));
    cr_assert(memmem(a.buf, a.len, "Content-Type: text/event-stream", 31) != NULL);
    cr_assert(memmem(a.buf, a.len, "Cache-Control: no-cache", 23) != NULL);
    cr_assert(memmem(a.buf, a.len, "Transfer-Encoding: chunked", 26) != NULL);
    cli_close(&a);
    cr_assert(poll_until(&H.app.aborts, 1, 3000), "on_abort not called");
    /* Others are still served, while another stream runs. */
    client_t b = cli_open();
    cli_send(&b, GET("/stream?n=1000000&ms=5"));
    resp_t r;
    for (int i = 0; i < 5; i++) {
        cr_assert_eq(one_shot(GET("/health"), &r), 200);
        resp_free(&r);
    }
    cli_close(&b);
    cr_assert(poll_until(&H.app.aborts, 2, 3000));
    sleep_ms(50);
    cr_assert_eq(atomic_load(&H.app.aborts), 2);
    h_stop();
    cr_assert_eq(atomic_load(&H.app.aborts), 2);
}

Test(router_http, http10, .timeout = 20)
{
    h_start();
    client_t c = cli_open();
    cli_send(&c, "GET /health HTTP/1.0\r\n\r\n");
    resp_t r;
    cr_assert_eq(cli_response(&c, &r), 0);
    cr_assert_eq(r.status, 200);
    char v[32];
    cr_assert(resp_header(&r, "Connection", v, sizeof(v)));
    cr_assert_str_eq(v, "close");
    resp_free(&r);
    cr_assert(cli_expect_eof(&c, 3000));
    cli_close(&c);
    /* HTTP/1.0 keep-alive: two requests on one connection. */
    c = cli_open();
    for (int i = 0; i < 2; i++) {
        cli_send(&c, "GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n");
        cr_assert_eq(cli_response(&c, &r), 0);
        cr_assert(resp_header(&r, "Connection", v, sizeof(v)));
        cr_assert_str_eq(v, "keep-alive");
        resp_free(&r);
    }
    /* A stream to an HTTP/1.0 client: raw bytes, delimited by the close. */
    cli_send(&c, "GET /stream?n=2&ms=1 HTTP/1.0\r\nConnection: keep-alive\r\n\r\n");
    cr_assert_eq(cli_response(&c, &r), 0);
    cr_assert_str_eq(r.body, "data: 0\n\ndata: 1\n\n");
    resp_free(&r);
    cli_close(&c);
    h_stop();
}

Test(router_http, connection_close_honoured, .timeout = 20)
{
    h_start();
    client_t c = cli_open();
    cli_send(&c, "GET /slow?ms=50 HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n" GET("/health"));
    resp_t r;
    cr_assert_eq(cli_response(&c, &r), 0);
    cr_assert_str_eq(r.body, "slow 50\n");
    char v[32];
    cr_assert(resp_header(&r, "Connection", v, sizeof(v)));
    cr_assert_str_eq(v, "close");
    resp_free(&r);
    cr_assert(cli_expect_eof(&c, 3000)); /* the request after it is not answered */
    cr_assert_eq(c.len, 0);
    cli_close(&c);
    h_stop();
}

Test(router_http, max_connections, .timeout = 20)
{
    duet_http_options_t o;
    h_options(&o);
    o.max_connections = 2;
    h_start_with(&o);
    client_t a = cli_open(), b = cli_open();
    resp_t r;
    cli_send(&a, GET("/health"));
    cr_assert_eq(cli_response(&a, &r), 0);
    resp_free(&r);
    cli_send(&b, GET("/health"));
    cr_assert_eq(cli_response(&b, &r), 0);
    resp_free(&r);
    client_t c = cli_open();
    cli_send(&c, GET("/health"));
    int rc = cli_response(&c, &r);
    cr_assert(rc == -1 || (rc == 0 && r.status == 503), "third connection served (rc %d)", rc);
    if (rc == 0)
        resp_free(&r);
    cli_close(&c);
    cli_close(&a);
    /* A slot frees once the server has seen the close. */
    int status = 0;
    for (int i = 0; i < 100 && status != 200; i++) {
        sleep_ms(20);
        status = one_shot(GET("/health"), &r);
        if (status >= 0)
            resp_free(&r);
    }
    cr_assert_eq(status, 200);
    cli_close(&b);
    h_stop();
}

Test(router_http, release_unanswered_gets_500, .timeout = 20)
{
    h_start();
    resp_t r;
    cr_assert_eq(one_shot(GET("/release"), &r), 500);
    resp_free(&r);
    h_stop();
}

Test(router_http, graceful_shutdown_finishes_in_flight, .timeout = 20)
{
    h_start();
    client_t c = cli_open();
    cli_send(&c, GET("/slow?ms=300"));
    cr_assert(poll_until(&H.app.active, 1, 2000));
    H.running = false;
    uv_async_send(&H.stop);
    resp_t r;
    cr_assert_eq(cli_response(&c, &r), 0);
    cr_assert_str_eq(r.body, "slow 300\n");
    char v[32];
    cr_assert(resp_header(&r, "Connection", v, sizeof(v)));
    cr_assert_str_eq(v, "close");
    resp_free(&r);
    cr_assert(cli_expect_eof(&c, 3000));
    cli_close(&c);
    H.running = true;
    /* h_stop's async send is harmless: the handle is closing; join and check. */
    pthread_join(H.thread, NULL);
    int n = 0;
    uv_walk(&H.loop, count_handle, &n);
    cr_assert_eq(n, 0);
    cr_assert_eq(uv_loop_close(&H.loop), 0);
    cr_assert_eq(atomic_load(&H.closed), 1);
    cr_assert_eq(atomic_load(&H.app.aborts), 0);
}

Test(router_http, shutdown_deadline_aborts, .timeout = 20)
{
    duet_http_options_t o;
    h_options(&o);
    o.shutdown_grace_ms = 200;
    h_start_with(&o);
    client_t c = cli_open();
    cli_send(&c, GET("/slow?ms=10000"));
    cr_assert(poll_until(&H.app.active, 1, 2000));
    double t0 = now_ms();
    h_stop();
    cr_assert_lt(now_ms() - t0, 2000);
    cr_assert_eq(atomic_load(&H.app.aborts), 1);
    cr_assert(cli_expect_eof(&c, 1000));
    cli_close(&c);
}

Test(router_http, output_limit_aborts_stalled_stream, .timeout = 30)
{
    duet_http_options_t o;
    h_options(&o);
    o.max_output_bytes = 256 * 1024;
    h_start_with(&o);
    client_t c = cli_open_rcvbuf(4096);
    cli_send(&c, GET("/stream?n=100000&ms=1&size=65536"));
    /* Never read: the server must give up rather than buffer without bound. */
    cr_assert(poll_until(&H.app.aborts, 1, 20000), "stalled stream not aborted");
    cli_close(&c);
    resp_t r;
    cr_assert_eq(one_shot(GET("/health"), &r), 200);
    resp_free(&r);
    h_stop();
}

static const char *test_path_class(const char *path, void *user)
{
    return strcmp(path, "/health") == 0 ? "/health" : "other";
}

Test(router_http, metrics, .timeout = 20)
{
    duet_metrics_t *reg;
    cr_assert_eq(duet_metrics_create(&reg), DUET_OK);
    duet_http_options_t o;
    h_options(&o);
    const char *rl[] = {"method", "path", "status"};
    const char *cl[] = {"result"};
    cr_assert_eq(duet_metrics_counter_new(reg, "duet_http_requests_total", "r", rl, 3,
                                          &o.metrics.requests_total),
                 DUET_OK);
    cr_assert_eq(duet_metrics_counter_new(reg, "duet_http_bytes_in_total", "i", NULL, 0,
                                          &o.metrics.bytes_in_total),
                 DUET_OK);
    cr_assert_eq(duet_metrics_counter_new(reg, "duet_http_bytes_out_total", "o", NULL, 0,
                                          &o.metrics.bytes_out_total),
                 DUET_OK);
    cr_assert_eq(
        duet_metrics_gauge_new(reg, "duet_http_connections", "c", NULL, 0, &o.metrics.connections),
        DUET_OK);
    cr_assert_eq(duet_metrics_counter_new(reg, "duet_http_connections_total", "a", cl, 1,
                                          &o.metrics.connections_total),
                 DUET_OK);
    h_start_with(&o);
    resp_t r;
    client_t c = cli_open();
    for (int i = 0; i < 3; i++) {
        cli_send(&c, GET("/health"));
        cr_assert_eq(cli_response(&c, &r), 0);
        resp_free(&r);
    }
    cli_close(&c);
    cr_assert_eq(one_shot(GET("/x"), &r), 404);
    resp_free(&r);
    expect_error_str("BAD\r\n\r\n", 400);
    h_stop();
    char text[8192];
    size_t len;
    cr_assert_eq(duet_metrics_render_buf(reg, text, sizeof(text), &len), DUET_OK);
    cr_assert(
        strstr(text, "duet_http_requests_total{method=\"GET\",path=\"all\",status=\"200\"} 3"),
        "%s", text);
    cr_assert(
        strstr(text, "duet_http_requests_total{method=\"GET\",path=\"all\",status=\"404\"} 1"),
        "%s", text);
    cr_assert(strstr(text, "status=\"400\"} 1"), "%s", text);
    cr_assert(strstr(text, "duet_http_connections 0\n"), "%s", text);
    cr_assert(strstr(text, "duet_http_connections_total{result=\"accepted\"} 3"), "%s", text);
    const char *in = strstr(text, "\nduet_http_bytes_in_total ");
    cr_assert(in != NULL && atof(in + 26) > 100, "%s", text);
    duet_metrics_destroy(reg);
}

Test(router_http, metrics_path_class, .timeout = 20)
{
    duet_metrics_t *reg;
    cr_assert_eq(duet_metrics_create(&reg), DUET_OK);
    duet_http_options_t o;
    h_options(&o);
    const char *rl[] = {"method", "path", "status"};
    cr_assert_eq(duet_metrics_counter_new(reg, "duet_http_requests_total", "r", rl, 3,
                                          &o.metrics.requests_total),
                 DUET_OK);
    o.path_class = test_path_class;
    h_start_with(&o);
    resp_t r;
    cr_assert_eq(one_shot(GET("/health"), &r), 200);
    resp_free(&r);
    cr_assert_eq(one_shot(GET("/random/thing"), &r), 404);
    resp_free(&r);
    h_stop();
    char text[4096];
    size_t len;
    cr_assert_eq(duet_metrics_render_buf(reg, text, sizeof(text), &len), DUET_OK);
    cr_assert(strstr(text, "{method=\"GET\",path=\"/health\",status=\"200\"} 1"), "%s", text);
    cr_assert(strstr(text, "{method=\"GET\",path=\"other\",status=\"404\"} 1"), "%s", text);
    duet_metrics_destroy(reg);
}

Test(router_http, stream_at_head_buffers_later_answers, .timeout = 20)
{
    h_start();
    client_t c = cli_open();
    cli_send(&c, GET("/stream?n=5&ms=20") GET(
                     "/health") "POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nxyz");
    const char *want[] = {"data: 0\n\ndata: 1\n\ndata: 2\n\ndata: 3\n\ndata: 4\n\n", "ok\n", "xyz"};
    for (int i = 0; i < 3; i++) {
        resp_t r;
        cr_assert_eq(cli_response(&c, &r), 0);
        cr_assert_str_eq(r.body, want[i]);
        resp_free(&r);
    }
    cli_close(&c);
    h_stop();
}

/* ------------------------------------------------------------------ API contract */

static atomic_int api_result;      /* 1 = every check passed, -k = check k failed */
static atomic_int cancelled_after; /* on_abort saw writes refused with DUET_ERR_CANCELLED */

static void api_on_request(duet_http_request_t *req, void *user)
{
    if (strcmp(duet_http_request_path(req), "/api") != 0) {
        duet_http_echo_on_request(req, user);
        return;
    }
    int fail = 0;
    char v[16];
    const char *name, *value;
    duet_http_header_t inject = {"X-Bad", "a\r\nInjected: 1"};
    if (duet_http_respond(req, 200, NULL, &inject, 1, "x", 1) != DUET_ERR_INVALID)
        fail = 1;
    else if (duet_http_respond(req, 42, NULL, NULL, 0, NULL, 0) != DUET_ERR_INVALID)
        fail = 2;
    else if (duet_http_stream_write(req, "x", 1) != DUET_ERR_INVALID)
        fail = 3;
    else if (duet_http_stream_end(req) != DUET_ERR_INVALID)
        fail = 4;
    else if (strcmp(duet_http_request_method(req), "GET") != 0)
        fail = 5;
    else if (duet_http_request_header(req, "X-MULTI") == NULL ||
             strcmp(duet_http_request_header(req, "X-MULTI"), "a") != 0)
        fail = 6;
    else if (duet_http_request_header_count(req) != 3)
        fail = 7;
    else if (strncmp(duet_http_request_peer(req), "127.0.0.1:", 10) != 0)
        fail = 8;
    else if (duet_http_request_version_minor(req) != 1 || duet_http_request_id(req) == 0)
        fail = 9;
    else if (!duet_http_request_query_param(req, "k", v, sizeof(v)) || strcmp(v, "v") != 0)
        fail = 10;
    else if (!duet_http_request_query_param(req, "flag", v, sizeof(v)) || v[0] != '\0')
        fail = 11;
    else if (duet_http_request_query_param(req, "missing", v, sizeof(v)) ||
             duet_http_request_query_param(req, "k", v, 1))
        fail = 12;
    else if (strcmp(duet_http_request_url(req), "/api?k=v&flag&e=") != 0)
        fail = 13;
    else if (duet_http_request_header(req, "absent") != NULL)
        fail = 14;
    if (fail == 0) {
        duet_http_request_header_at(req, 2, &name, &value);
        if (strcmp(name, "x-multi") != 0 || strcmp(value, "b") != 0)
            fail = 15;
    }
    if (fail == 0 && duet_http_respond(req, 200, "text/plain", NULL, 0, "ok", 2) != DUET_OK)
        fail = 16;
    if (fail == 0 && duet_http_respond(req, 200, "text/plain", NULL, 0, "ok", 2) == DUET_OK)
        fail = 17;
    if (fail != 0)
        duet_http_respond(req, 500, "text/plain", NULL, 0, "fail", 4);
    atomic_store(&api_result, fail != 0 ? -fail : 1);
    duet_http_request_release(req);
}

static void api_on_abort(duet_http_request_t *req, void *user)
{
    if (duet_http_request_aborted(req) &&
        duet_http_respond(req, 200, NULL, NULL, 0, NULL, 0) == DUET_ERR_CANCELLED &&
        duet_http_sse_event(req, "x", 1) == DUET_ERR_CANCELLED)
        atomic_fetch_add(&cancelled_after, 1);
    duet_http_echo_on_abort(req, user);
}

Test(router_http, api_contract, .timeout = 20)
{
    duet_http_options_t o;
    h_options(&o);
    o.on_request = api_on_request;
    h_start_with(&o);
    resp_t r;
    cr_assert_eq(one_shot("GET /api?k=v&flag&e= HTTP/1.1\r\nHost: t\r\nX-Multi: a\r\n"
                          "x-multi: b\r\n\r\n",
                          &r),
                 200);
    cr_assert_str_eq(r.body, "ok");
    resp_free(&r);
    for (int i = 0; i < 200 && atomic_load(&api_result) == 0; i++)
        sleep_ms(5); /* set just after the answer went out */
    cr_assert_eq(atomic_load(&api_result), 1, "check %d failed", -atomic_load(&api_result));
    h_stop();
}

Test(router_http, disconnect_aborts_every_owed_request, .timeout = 20)
{
    duet_http_options_t o;
    h_options(&o);
    o.on_abort = api_on_abort;
    h_start_with(&o);
    client_t c = cli_open();
    cli_send(&c, GET("/slow?ms=5000") GET("/stream?n=100&ms=1000") GET("/health"));
    cr_assert(poll_until(&H.app.active, 2, 2000));
    cli_close(&c);
    cr_assert(poll_until(&H.app.aborts, 2, 3000));
    cr_assert_eq(atomic_load(&cancelled_after), 2);
    resp_t r;
    cr_assert_eq(one_shot(GET("/health"), &r), 200);
    resp_free(&r);
    h_stop();
    cr_assert_eq(atomic_load(&H.app.aborts), 2);
}

/* ------------------------------------------------------------------ fuzz */

static uint64_t rng_state;

static uint64_t rng(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static const char *const corpus[] = {
    GET("/health"),
    "POST /echo?a=b HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello",
    "POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    GET("/stream?n=3&ms=0") GET("/health"),
    GET("/slow?ms=5"),
    "GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
    "HEAD /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
    "GET /stream?n=2&ms=1 HTTP/1.1\r\nHost: t\r\nX-A: 1\r\nX-B: 2\r\n\r\n",
    "OPTIONS * HTTP/1.1\r\nHost: t\r\n\r\n",
    "GET http://h/echo?q HTTP/1.1\r\nHost: t\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n",
};

Test(router_http, fuzz_deterministic, .timeout = 120)
{
    duet_http_options_t o;
    h_options(&o);
    o.max_body_bytes = 4096;
    o.header_timeout_ms = 1000;
    o.body_timeout_ms = 1000;
    h_start_with(&o);
    rng_state = 0x9e3779b97f4a7c15ull;
    const char junk[] = "\r\n :;\t\x00\xff%?#/0123456789abcdefxGETPOSTchunked-Length";
    size_t n_corpus = sizeof(corpus) / sizeof(corpus[0]);
    char buf[4096];
    int answered = 0;
    const int iters = 3000;
    for (int it = 0; it < iters; it++) {
        size_t len;
        if (rng() % 8 == 0) { /* pure noise */
            len = rng() % 300;
            for (size_t i = 0; i < len; i++)
                buf[i] = (char)rng();
        } else {
            const char *base = corpus[rng() % n_corpus];
            len = strlen(base);
            memcpy(buf, base, len);
            int muts = 1 + (int)(rng() % 4);
            for (int m = 0; m < muts; m++) {
                size_t at = len > 0 ? rng() % len : 0;
                switch (rng() % 5) {
                case 0: /* flip a byte */
                    if (len > 0)
                        buf[at] = (char)rng();
                    break;
                case 1: /* plant a junk byte */
                    if (len > 0)
                        buf[at] = junk[rng() % (sizeof(junk) - 1)];
                    break;
                case 2: /* insert a run */
                    if (len + 64 < sizeof(buf)) {
                        size_t k = 1 + rng() % 40;
                        memmove(buf + at + k, buf + at, len - at);
                        for (size_t i = 0; i < k; i++)
                            buf[at + i] = junk[rng() % (sizeof(junk) - 1)];
                        len += k;
                    }
                    break;
                case 3: /* delete a run */
                    if (len > 0) {
                        size_t k = 1 + rng() % 20;
                        if (k > len - at)
                            k = len - at;
                        memmove(buf + at, buf + at + k, len - at - k);
                        len -= k;
                    }
                    break;
                case 4: /* truncate */
                    len = at;
                    break;
                }
            }
        }
        client_t c = cli_open();
        cli_timeout(&c, 3000);
        cli_send_n(&c, buf, len);
        shutdown(c.fd, SHUT_WR);
        /* Everything must end promptly: answered and closed, or just closed. */
        char rb[4096];
        ssize_t r;
        size_t got = 0;
        while ((r = recv(c.fd, rb, sizeof(rb), 0)) > 0)
            got += (size_t)r;
        cr_assert(r == 0 || errno == ECONNRESET, "iteration %d: %s", it,
                  r < 0 ? strerror(errno) : "?");
        answered += got > 0;
        cli_close(&c);
    }
    cr_assert_gt(answered, iters / 10);
    resp_t r;
    cr_assert_eq(one_shot(GET("/health"), &r), 200);
    resp_free(&r);
    h_stop();
}
