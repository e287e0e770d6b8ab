/*
 * HTTP/1.1 server on libuv + http-parser; the contract is in http.h, the structs and their
 * lifetimes in http_impl.h.
 *
 * Choices worth knowing:
 *  - Every response, including the server's own error answers, goes through the connection's
 *    response queue, so pipelined answers can never be reordered. Only the queue head writes to
 *    the socket; the others buffer in their request until they reach the head.
 *  - When the queue holds max_pipeline requests, the parser is paused at the end of a message,
 *    the unparsed rest of the read is kept and reading stops. Parsing resumes from a uv_idle
 *    callback, never from inside an application call, so on_request never re-enters the app.
 *  - Header and body timeouts are absolute deadlines from the first byte of the request and from
 *    the end of its headers: a client that dribbles one byte at a time cannot keep them alive.
 *  - A client EOF while a response is owed aborts the requests (how a client cancel reaches
 *    the workers); a half-closed client that still wants its answer is not supported.
 *  - Server-initiated closes send a FIN after the last response and then drain the client's
 *    unread bytes for linger_ms, so the client sees the response (e.g. a 413 sent before the
 *    body was read) instead of a reset.
 * - Writes are corked: the bytes for a connection collect in its cork and go out from a uv_check
 *   callback at the end of the loop turn (before a FIN, at once), so a burst of stream chunks
 *   (a worker's Tokens frames for many tokens, read at once) costs one syscall, not one each.
 *   Then uv_try_write first and only the unsent rest queued with uv_write (docs/platform.md
 *   "libuv 1.44": one syscall fewer per response).
 */
#include "router/http/http.h"

#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common/log.h"
#include "common/strbuf.h"
#include "router/http/http_impl.h"

#define HTTP_READ_BUF     (64 * 1024)
#define HTTP_METRIC_CACHE 64

typedef struct {
    const char *method;
    const char *cls;
    int status;
    duet_metric_t *m;
} http_metric_slot_t;

struct duet_http_server {
    uv_loop_t *loop; /* not owned */
    uv_tcp_t listener;
    uv_timer_t grace_timer;
    uv_idle_t resume_idle;
    uv_check_t cork_check; /* flushes srv->corked at the end of each loop turn */
    duet_http_options_t opts;
    http_parser_settings settings;
    duet__http_link_t conns;  /* every http_conn_t not yet freed */
    duet__http_link_t resume; /* connections whose parsing waits to resume */
    duet__http_link_t corked; /* connections with bytes in their cork */
    size_t n_open;            /* http_conn_t alive (rejected ones included) */
    size_t n_active;          /* accepted connections not yet closing */
    uint64_t next_id;
    uint16_t port;
    int handles_open;
    bool closing;
    bool finishing;
    duet_http_close_cb close_cb;
    void *close_user;

    duet_strbuf_t *fake_out; /* duet__http_server_start_fake: no listener, writes land here */

    duet_metric_t *m_bytes_in, *m_bytes_out, *m_conns, *m_accepted, *m_rejected;
    http_metric_slot_t metric_cache[HTTP_METRIC_CACHE];

    char rbuf[HTTP_READ_BUF]; /* one read at a time on the loop thread: shared by connections */
};

typedef struct {
    uv_write_t req;
    size_t len;
    char data[]; /* the unsent tail, owned */
} http_write_t;

static void conn_flush(http_conn_t *conn);
static void conn_close(http_conn_t *conn);
static void conn_finish(http_conn_t *conn);
static void conn_update_timer(http_conn_t *conn);
static void conn_parse(http_conn_t *conn, const char *data, size_t len);
static void conn_read_on(http_conn_t *conn);
static int conn_read_start(http_conn_t *conn);
static void conn_on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf);
static void server_on_resume(uv_idle_t *idle);
static void server_maybe_finish(duet_http_server_t *srv);

/* ------------------------------------------------------------------ small helpers */

static void link_init(duet__http_link_t *l)
{
    l->prev = l;
    l->next = l;
}

static void link_push(duet__http_link_t *head, duet__http_link_t *l)
{
    l->prev = head->prev;
    l->next = head;
    head->prev->next = l;
    head->prev = l;
}

static void link_remove(duet__http_link_t *l)
{
    l->prev->next = l->next;
    l->next->prev = l->prev;
    link_init(l);
}

#define CONN_OF(l, field) ((http_conn_t *)((char *)(l)-offsetof(http_conn_t, field)))

/* Grow *buf (cap *cap) to hold at least need bytes; false on allocation failure. */
static bool grow(char **buf, size_t *cap, size_t need)
{
    if (need <= *cap)
        return true;
    size_t c = *cap ? *cap : 256;
    while (c < need)
        c *= 2;
    char *p = realloc(*buf, c);
    if (p == NULL)
        return false;
    *buf = p;
    *cap = c;
    return true;
}

const char *duet_http_status_reason(int status)
{
    switch (status) {
    case 100:
        return "Continue";
    case 101:
        return "Switching Protocols";
    case 200:
        return "OK";
    case 201:
        return "Created";
    case 202:
        return "Accepted";
    case 204:
        return "No Content";
    case 206:
        return "Partial Content";
    case 301:
        return "Moved Permanently";
    case 302:
        return "Found";
    case 304:
        return "Not Modified";
    case 307:
        return "Temporary Redirect";
    case 400:
        return "Bad Request";
    case 401:
        return "Unauthorized";
    case 403:
        return "Forbidden";
    case 404:
        return "Not Found";
    case 405:
        return "Method Not Allowed";
    case 408:
        return "Request Timeout";
    case 409:
        return "Conflict";
    case 411:
        return "Length Required";
    case 413:
        return "Content Too Large";
    case 414:
        return "URI Too Long";
    case 415:
        return "Unsupported Media Type";
    case 422:
        return "Unprocessable Content";
    case 429:
        return "Too Many Requests";
    case 431:
        return "Request Header Fields Too Large";
    case 499:
        return "Client Closed Request";
    case 500:
        return "Internal Server Error";
    case 501:
        return "Not Implemented";
    case 502:
        return "Bad Gateway";
    case 503:
        return "Service Unavailable";
    case 504:
        return "Gateway Timeout";
    case 505:
        return "HTTP Version Not Supported";
    default:
        return "Unknown";
    }
}

/* ------------------------------------------------------------------ metrics */

static duet_metric_t *metric_single(duet_metric_family_t *fam)
{
    return fam != NULL ? duet_metrics_single(fam) : NULL;
}

static duet_metric_t *metric_child1(duet_metric_family_t *fam, const char *value)
{
    duet_metric_t *m = NULL;
    if (fam != NULL && duet_metrics_child(fam, &value, 1, &m) != DUET_OK)
        m = NULL;
    return m;
}

static void metric_add(duet_metric_t *m, double v)
{
    if (m != NULL)
        duet_metrics_counter_add(m, v);
}

/* Count one response started. The label child is looked up once per tuple and then cached. */
static void metric_count_request(duet_http_server_t *srv, duet_http_request_t *req, int status)
{
    duet_metric_family_t *fam = srv->opts.metrics.requests_total;
    if (fam == NULL)
        return;
    const char *method = req->method;
    const char *cls = "invalid";
    if (!req->internal)
        cls = srv->opts.path_class != NULL
                  ? srv->opts.path_class(duet_http_request_path(req), srv->opts.user)
                  : "all";
    if (cls == NULL)
        cls = "other";
    uintptr_t h = ((uintptr_t)method >> 3) ^ ((uintptr_t)cls >> 3) ^ (uintptr_t)status * 31u;
    http_metric_slot_t *slot = &srv->metric_cache[h % HTTP_METRIC_CACHE];
    if (slot->m == NULL || slot->status != status || strcmp(slot->method, method) != 0 ||
        strcmp(slot->cls, cls) != 0) {
        char code[16];
        snprintf(code, sizeof(code), "%d", status);
        const char *values[3] = {method, cls, code};
        duet_metric_t *m = NULL;
        if (duet_metrics_child(fam, values, 3, &m) != DUET_OK)
            return;
        slot->method = method;
        slot->cls = cls;
        slot->status = status;
        slot->m = m;
    }
    duet_metrics_counter_inc(slot->m);
}

/* ------------------------------------------------------------------ requests */

static duet_http_request_t *req_new(http_conn_t *conn)
{
    duet_http_request_t *req = calloc(1, sizeof(*req));
    if (req == NULL)
        return NULL;
    req->conn = conn;
    req->id = ++conn->srv->next_id;
    req->method = "unknown";
    req->minor = 1;
    memcpy(req->peer, conn->peer, sizeof(req->peer));
    return req;
}

static void req_free(duet_http_request_t *req)
{
    if (req == NULL)
        return;
    free(req->text);
    free(req->hdrs);
    free(req->body);
    free(req->out);
    free(req);
}

static bool req_text_append(duet_http_request_t *req, const char *s, size_t n)
{
    if (!grow(&req->text, &req->text_cap, req->text_len + n + 1))
        return false;
    memcpy(req->text + req->text_len, s, n);
    req->text_len += n;
    return true;
}

static bool req_text_nul(duet_http_request_t *req)
{
    return req_text_append(req, "", 1);
}

static void conn_enqueue(http_conn_t *conn, duet_http_request_t *req)
{
    req->next = NULL;
    req->in_conn = true;
    if (conn->q_tail != NULL)
        conn->q_tail->next = req;
    else
        conn->q_head = req;
    conn->q_tail = req;
    conn->q_len++;
}

/* ------------------------------------------------------------------ writing */

static void conn_on_write(uv_write_t *w, int status)
{
    http_write_t *wr = (http_write_t *)w;
    http_conn_t *conn = w->handle->data;
    conn->out_bytes -= wr->len;
    free(wr);
    if (status < 0 && status != UV_ECANCELED) {
        DUET_LOG_DEBUG("http: write to %s failed: %s", conn->peer, uv_strerror(status));
        conn_close(conn);
    }
}

/*
 * Hand the cork to the socket: uv_try_write first, the unsent rest copied into one uv_write.
 * A write error closes the connection (which aborts what is in flight).
 */
static void conn_uncork(http_conn_t *conn)
{
    if (conn->cork_len == 0)
        return;
    link_remove(&conn->cork_link);
    const size_t total = conn->cork_len;
    conn->cork_len = 0;
    conn->out_bytes -= total;
    if (conn->closing)
        return;
    uv_buf_t one = uv_buf_init(conn->cork, (unsigned)total);
    const uv_buf_t *bufs = &one;
    const unsigned n = 1;
    int r = uv_try_write((uv_stream_t *)&conn->tcp, bufs, n);
    if (r == UV_EAGAIN || r == UV_ENOSYS) {
        r = 0;
    } else if (r < 0) {
        DUET_LOG_DEBUG("http: write to %s failed: %s", conn->peer, uv_strerror(r));
        conn_close(conn);
        return;
    }
    size_t sent = (size_t)r;
    if (sent == total)
        return;
    size_t rest = total - sent;
    http_write_t *wr = malloc(sizeof(*wr) + rest);
    if (wr == NULL) {
        DUET_LOG_ERROR("http: out of memory queueing %zu bytes to %s", rest, conn->peer);
        conn_close(conn);
        return;
    }
    wr->len = rest;
    size_t skip = sent, at = 0;
    for (unsigned i = 0; i < n; i++) {
        size_t l = bufs[i].len;
        if (skip >= l) {
            skip -= l;
            continue;
        }
        memcpy(wr->data + at, bufs[i].base + skip, l - skip);
        at += l - skip;
        skip = 0;
    }
    uv_buf_t b = uv_buf_init(wr->data, (unsigned)rest);
    int e = uv_write(&wr->req, (uv_stream_t *)&conn->tcp, &b, 1, conn_on_write);
    if (e < 0) {
        free(wr);
        DUET_LOG_DEBUG("http: write to %s failed: %s", conn->peer, uv_strerror(e));
        conn_close(conn);
        return;
    }
    conn->out_bytes += rest;
}

static void server_on_cork_check(uv_check_t *check)
{
    duet_http_server_t *srv = check->data;
    while (srv->corked.next != &srv->corked) {
        http_conn_t *conn = CONN_OF(srv->corked.next, cork_link);
        conn_uncork(conn); /* a closed conn is freed by its close callback, not here */
        if (conn->cork_cap > 64 * 1024) { /* a big response once: do not keep its buffer */
            free(conn->cork);
            conn->cork = NULL;
            conn->cork_cap = 0;
        }
    }
    uv_check_stop(check);
}

/* Queue bytes for the socket in the connection's cork (sent at the end of the loop turn). */
static void conn_send(http_conn_t *conn, const uv_buf_t *bufs, unsigned n)
{
    if (conn->closing)
        return;
    size_t total = 0;
    for (unsigned i = 0; i < n; i++)
        total += bufs[i].len;
    if (total == 0)
        return;
    metric_add(conn->srv->m_bytes_out, (double)total);
    if (conn->srv->fake_out != NULL) { /* the test seam's socket takes everything at once */
        for (unsigned i = 0; i < n; i++)
            if (duet_strbuf_append(conn->srv->fake_out, bufs[i].base, bufs[i].len) != DUET_OK) {
                conn_close(conn);
                return;
            }
        return;
    }
    if (!grow(&conn->cork, &conn->cork_cap, conn->cork_len + total)) {
        DUET_LOG_ERROR("http: out of memory queueing %zu bytes to %s", total, conn->peer);
        conn_close(conn);
        return;
    }
    for (unsigned i = 0; i < n; i++) {
        memcpy(conn->cork + conn->cork_len, bufs[i].base, bufs[i].len);
        conn->cork_len += bufs[i].len;
    }
    conn->out_bytes += total;
    if (conn->cork_len == total) { /* it was empty: not listed yet */
        link_push(&conn->srv->corked, &conn->cork_link);
        uv_check_start(&conn->srv->cork_check, server_on_cork_check);
    }
}

/* Emit response bytes of req: straight to the socket at the queue head, else buffered. */
static bool req_emit(duet_http_request_t *req, const uv_buf_t *bufs, unsigned n)
{
    http_conn_t *conn = req->conn;
    if (req == conn->q_head) {
        conn_send(conn, bufs, n);
        return true;
    }
    size_t total = 0;
    for (unsigned i = 0; i < n; i++)
        total += bufs[i].len;
    if (!grow(&req->out, &req->out_cap, req->out_len + total))
        return false;
    for (unsigned i = 0; i < n; i++) {
        memcpy(req->out + req->out_len, bufs[i].base, bufs[i].len);
        req->out_len += bufs[i].len;
    }
    conn->out_bytes += total;
    return true;
}

static bool header_ok(const char *s)
{
    return s != NULL && strpbrk(s, "\r\n") == NULL;
}

/*
 * Write the status line and headers of req into a buffer (stack when small) and emit them with
 * `body` (len bytes, may be 0). framing: 0 = Content-Length, 1 = chunked, 2 = none (raw stream).
 */
static duet_status_t req_emit_head(duet_http_request_t *req, int status, const char *ctype,
                                   const duet_http_header_t *hdrs, size_t n_hdrs, int framing,
                                   size_t content_length, const void *body, size_t len)
{
    size_t need = 160 + (ctype ? strlen(ctype) : 0);
    for (size_t i = 0; i < n_hdrs; i++)
        need += strlen(hdrs[i].name) + strlen(hdrs[i].value) + 4;
    char stack[1024];
    char *buf = need <= sizeof(stack) ? stack : malloc(need);
    if (buf == NULL)
        return DUET_FAIL(DUET_ERR_NOMEM, "http: response head of %zu bytes", need);
    bool no_body = status < 200 || status == 204 || status == 304;
    size_t at =
        (size_t)snprintf(buf, need, "HTTP/1.1 %d %s\r\n", status, duet_http_status_reason(status));
    if (ctype != NULL)
        at += (size_t)snprintf(buf + at, need - at, "Content-Type: %s\r\n", ctype);
    for (size_t i = 0; i < n_hdrs; i++)
        at += (size_t)snprintf(buf + at, need - at, "%s: %s\r\n", hdrs[i].name, hdrs[i].value);
    if (framing == 0 && !no_body)
        at += (size_t)snprintf(buf + at, need - at, "Content-Length: %zu\r\n", content_length);
    else if (framing == 1)
        at += (size_t)snprintf(buf + at, need - at, "Transfer-Encoding: chunked\r\n");
    if (req->close_after)
        at += (size_t)snprintf(buf + at, need - at, "Connection: close\r\n");
    else if (req->minor == 0)
        at += (size_t)snprintf(buf + at, need - at, "Connection: keep-alive\r\n");
    at += (size_t)snprintf(buf + at, need - at, "\r\n");
    DUET_ASSERT(at < need);

    uv_buf_t bufs[2] = {uv_buf_init(buf, (unsigned)at), uv_buf_init((char *)body, (unsigned)len)};
    bool ok = req_emit(req, bufs, len > 0 ? 2 : 1);
    if (buf != stack)
        free(buf);
    return ok ? DUET_OK : DUET_FAIL(DUET_ERR_NOMEM, "http: buffering a response");
}

/* Checks shared by the response calls; DUET_OK when req may start a response. */
static duet_status_t req_check_start(duet_http_request_t *req, int status, const char *ctype,
                                     const duet_http_header_t *hdrs, size_t n_hdrs)
{
    if (req->aborted || req->conn == NULL || req->conn->closing)
        return req->ended ? DUET_ERR_INVALID : DUET_ERR_CANCELLED;
    if (req->started)
        return duet_error_set(DUET_ERR_INVALID, "http: request %llu already answered",
                              (unsigned long long)req->id);
    if (status < 100 || status > 599)
        return duet_error_set(DUET_ERR_INVALID, "http: status %d out of range", status);
    if (ctype != NULL && !header_ok(ctype))
        return duet_error_set(DUET_ERR_INVALID, "http: bad content type");
    if (n_hdrs > 0 && hdrs == NULL)
        return duet_error_set(DUET_ERR_INVALID, "http: headers missing");
    for (size_t i = 0; i < n_hdrs; i++)
        if (!header_ok(hdrs[i].name) || hdrs[i].name[0] == '\0' || strchr(hdrs[i].name, ':') ||
            !header_ok(hdrs[i].value))
            return duet_error_set(DUET_ERR_INVALID, "http: bad response header");
    return DUET_OK;
}

/* Decide whether the connection closes after this response, just before its head is written. */
static void req_decide_close(duet_http_request_t *req)
{
    http_conn_t *conn = req->conn;
    if (!req->keep_alive)
        req->close_after = true;
    if (conn->srv->closing && req->next == NULL)
        req->close_after = true;
}

static duet_status_t respond_whole(duet_http_request_t *req, int status, const char *ctype,
                                   const duet_http_header_t *hdrs, size_t n_hdrs, const void *body,
                                   size_t len)
{
    duet_status_t st = req_check_start(req, status, ctype, hdrs, n_hdrs);
    if (st != DUET_OK)
        return st;
    http_conn_t *conn = req->conn;
    req_decide_close(req);
    req->started = true;
    req->status = status;
    metric_count_request(conn->srv, req, status);
    bool no_body = req->is_head || status < 200 || status == 204 || status == 304;
    st = req_emit_head(req, status, ctype, hdrs, n_hdrs, 0, len, no_body ? NULL : body,
                       no_body ? 0 : len);
    req->ended = true;
    if (st != DUET_OK) {
        conn_close(conn);
        return st;
    }
    conn_flush(conn);
    return DUET_OK;
}

/* ------------------------------------------------------------------ public request API */

const char *duet_http_request_method(const duet_http_request_t *req)
{
    return req->method;
}

const char *duet_http_request_url(const duet_http_request_t *req)
{
    return req->text != NULL ? req->text : "";
}

const char *duet_http_request_path(const duet_http_request_t *req)
{
    return req->path_off != 0 ? req->text + req->path_off : "/";
}

const char *duet_http_request_query(const duet_http_request_t *req)
{
    return req->query_off != 0 ? req->text + req->query_off : "";
}

bool duet_http_request_query_param(const duet_http_request_t *req, const char *name, char *buf,
                                   size_t cap)
{
    const char *q = duet_http_request_query(req);
    size_t nl = strlen(name);
    while (*q != '\0') {
        const char *end = strchr(q, '&');
        size_t l = end != NULL ? (size_t)(end - q) : strlen(q);
        if (l >= nl && strncmp(q, name, nl) == 0 && (l == nl || q[nl] == '=')) {
            const char *v = l == nl ? q + nl : q + nl + 1;
            size_t vl = l == nl ? 0 : l - nl - 1;
            if (vl + 1 > cap)
                return false;
            memcpy(buf, v, vl);
            buf[vl] = '\0';
            return true;
        }
        q += l;
        if (*q == '&')
            q++;
    }
    return false;
}

const char *duet_http_request_header(const duet_http_request_t *req, const char *name)
{
    for (size_t i = 0; i < req->n_hdrs; i++)
        if (strcasecmp(req->text + req->hdrs[i].name, name) == 0)
            return req->text + req->hdrs[i].value;
    return NULL;
}

/* Compare in time that depends only on the expected token's length. */
static bool http_token_equal(const char *want, size_t want_len, const char *got, size_t got_len)
{
    unsigned diff = (unsigned)(want_len ^ got_len);
    for (size_t i = 0; i < want_len; i++) {
        unsigned char g = got_len > 0 ? (unsigned char)got[i % got_len] : 0;
        diff |= (unsigned)((unsigned char)want[i] ^ g);
    }
    return diff == 0;
}

duet_http_auth_t duet_http_request_bearer(const duet_http_request_t *req, const char *token,
                                          size_t len)
{
    const char *v = duet_http_request_header(req, "Authorization");
    if (v == NULL)
        return DUET_HTTP_AUTH_MISSING;
    while (*v == ' ' || *v == '\t')
        v++;
    bool bearer = strncasecmp(v, "Bearer", 6) == 0 && (v[6] == ' ' || v[6] == '\t');
    const char *tok = bearer ? v + 7 : "";
    while (*tok == ' ' || *tok == '\t')
        tok++;
    size_t n = strlen(tok);
    while (n > 0 && (tok[n - 1] == ' ' || tok[n - 1] == '\t'))
        n--;
    return bearer && http_token_equal(token, len, tok, n) ? DUET_HTTP_AUTH_OK
                                                          : DUET_HTTP_AUTH_INVALID;
}

size_t duet_http_request_header_count(const duet_http_request_t *req)
{
    return req->n_hdrs;
}

void duet_http_request_header_at(const duet_http_request_t *req, size_t i, const char **name_p,
                                 const char **value_p)
{
    DUET_ASSERT(i < req->n_hdrs);
    *name_p = req->text + req->hdrs[i].name;
    *value_p = req->text + req->hdrs[i].value;
}

const char *duet_http_request_body(const duet_http_request_t *req, size_t *len_p)
{
    if (len_p != NULL)
        *len_p = req->body_len;
    return req->body != NULL ? req->body : "";
}

const char *duet_http_request_peer(const duet_http_request_t *req)
{
    return req->peer;
}

int duet_http_request_version_minor(const duet_http_request_t *req)
{
    return req->minor;
}

uint64_t duet_http_request_id(const duet_http_request_t *req)
{
    return req->id;
}

void duet_http_request_set_data(duet_http_request_t *req, void *data)
{
    req->data = data;
}

void *duet_http_request_get_data(const duet_http_request_t *req)
{
    return req->data;
}

bool duet_http_request_aborted(const duet_http_request_t *req)
{
    return req->aborted;
}

void duet_http_request_release(duet_http_request_t *req)
{
    DUET_ASSERT(req->app_held);
    http_conn_t *conn = req->conn;
    if (conn != NULL && !conn->closing && !req->ended && !req->aborted) {
        if (!req->started) {
            DUET_RLOG_WARN(req->id, "http: request released unanswered; answering 500");
            static const char msg[] = "internal error: request not answered\n";
            respond_whole(req, 500, "text/plain", NULL, 0, msg, sizeof(msg) - 1);
        } else {
            DUET_RLOG_WARN(req->id, "http: stream released before its end; closing");
            conn_close(conn);
        }
    }
    req->app_held = false;
    if (!req->in_conn)
        req_free(req);
}

/* ------------------------------------------------------------------ public response API */

duet_status_t duet_http_respond(duet_http_request_t *req, int status, const char *content_type,
                                const duet_http_header_t *headers, size_t n_headers,
                                const void *body, size_t len)
{
    if (len > 0 && body == NULL)
        return duet_error_set(DUET_ERR_INVALID, "http: body missing");
    return respond_whole(req, status, content_type, headers, n_headers, body, len);
}

duet_status_t duet_http_stream_begin(duet_http_request_t *req, int status, const char *content_type,
                                     const duet_http_header_t *headers, size_t n_headers)
{
    duet_status_t st = req_check_start(req, status, content_type, headers, n_headers);
    if (st != DUET_OK)
        return st;
    http_conn_t *conn = req->conn;
    req->chunked = req->minor >= 1;
    if (!req->chunked) {
        /* HTTP/1.0 has no chunks: the end of the stream is the end of the connection. */
        req->close_after = true;
    }
    req_decide_close(req);
    req->started = true;
    req->streaming = true;
    req->status = status;
    metric_count_request(conn->srv, req, status);
    st = req_emit_head(req, status, content_type, headers, n_headers, req->chunked ? 1 : 2, 0, NULL,
                       0);
    if (st != DUET_OK)
        conn_close(conn);
    return st;
}

/* Checks shared by stream writes; DUET_OK when req may write a chunk. */
static duet_status_t stream_check(duet_http_request_t *req)
{
    if (req->aborted || req->conn == NULL || req->conn->closing)
        return req->ended ? DUET_ERR_INVALID : DUET_ERR_CANCELLED;
    if (!req->streaming || req->ended)
        return duet_error_set(DUET_ERR_INVALID, "http: request %llu has no open stream",
                              (unsigned long long)req->id);
    return DUET_OK;
}

duet_status_t duet_http_stream_write(duet_http_request_t *req, const void *data, size_t len)
{
    duet_status_t st = stream_check(req);
    if (st != DUET_OK || len == 0 || req->is_head) /* a HEAD answer has no body */
        return st;
    http_conn_t *conn = req->conn;
    size_t max = conn->srv->opts.max_output_bytes;
    if (conn->out_bytes > 0 && conn->out_bytes + len > max) {
        DUET_RLOG_INFO(req->id, "http: %s is not reading (%zu bytes unsent); aborting", conn->peer,
                       conn->out_bytes);
        conn_close(conn);
        return duet_error_set(DUET_ERR_NO_SPACE, "http: client %s is not reading", req->peer);
    }
    char hex[24];
    uv_buf_t bufs[3];
    unsigned n = 0;
    if (req->chunked) {
        int hl = snprintf(hex, sizeof(hex), "%zx\r\n", len);
        bufs[n++] = uv_buf_init(hex, (unsigned)hl);
    }
    bufs[n++] = uv_buf_init((char *)data, (unsigned)len);
    if (req->chunked)
        bufs[n++] = uv_buf_init("\r\n", 2);
    if (!req_emit(req, bufs, n)) {
        conn_close(conn);
        return DUET_FAIL(DUET_ERR_NOMEM, "http: buffering a chunk of %zu bytes", len);
    }
    return DUET_OK;
}

duet_status_t duet_http_stream_end(duet_http_request_t *req)
{
    duet_status_t st = stream_check(req);
    if (st != DUET_OK)
        return st;
    http_conn_t *conn = req->conn;
    if (req->chunked && !req->is_head) {
        uv_buf_t b = uv_buf_init("0\r\n\r\n", 5);
        if (!req_emit(req, &b, 1)) {
            conn_close(conn);
            return DUET_FAIL(DUET_ERR_NOMEM, "http: buffering the last chunk");
        }
    }
    req->ended = true;
    conn_flush(conn);
    return DUET_OK;
}

duet_status_t duet_http_sse_begin(duet_http_request_t *req, const duet_http_header_t *headers,
                                  size_t n_headers)
{
    duet_http_header_t stack[16];
    duet_http_header_t *all = n_headers + 1 <= 16 ? stack : malloc((n_headers + 1) * sizeof(*all));
    if (all == NULL)
        return DUET_FAIL(DUET_ERR_NOMEM, "http: SSE headers");
    all[0] = (duet_http_header_t){"Cache-Control", "no-cache"};
    for (size_t i = 0; i < n_headers; i++)
        all[i + 1] = headers[i];
    duet_status_t st = duet_http_stream_begin(req, 200, "text/event-stream", all, n_headers + 1);
    if (all != stack)
        free(all);
    return st;
}

duet_status_t duet_http_sse_event(duet_http_request_t *req, const char *data, size_t len)
{
    duet_status_t st = stream_check(req);
    if (st != DUET_OK)
        return st;
    /* One "data: " line per line of data (SSE joins them back with '\n'), then a blank line. */
    size_t lines = 1;
    for (size_t i = 0; i < len; i++)
        lines += data[i] == '\n';
    size_t need = len + lines * 7 + 1;
    char stack[1024];
    char *buf = need <= sizeof(stack) ? stack : malloc(need);
    if (buf == NULL)
        return DUET_FAIL(DUET_ERR_NOMEM, "http: SSE event of %zu bytes", len);
    size_t at = 0;
    const char *p = data, *end = data + len;
    for (;;) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *stop = nl != NULL ? nl : end;
        size_t l = (size_t)(stop - p);
        if (l > 0 && p[l - 1] == '\r')
            l--;
        memcpy(buf + at, "data: ", 6);
        at += 6;
        memcpy(buf + at, p, l);
        at += l;
        buf[at++] = '\n';
        if (nl == NULL)
            break;
        p = nl + 1;
    }
    buf[at++] = '\n';
    DUET_ASSERT(at <= need);
    st = duet_http_stream_write(req, buf, at);
    if (buf != stack)
        free(buf);
    return st;
}

/* ------------------------------------------------------------------ server-made answers */

/*
 * Answer the request being received with an error and stop reading requests: the partial
 * request is dropped, the error is queued behind the responses still owed, and the connection
 * closes after it.
 */
static void conn_fail(http_conn_t *conn, int status)
{
    if (conn->closing || conn->shutting)
        return;
    duet_http_request_t *req = conn->cur;
    const char *method = req != NULL ? req->method : "unknown";
    req_free(conn->cur);
    conn->cur = NULL;
    conn->msg_state = HTTP_MSG_NONE;
    conn->want_close = true;
    conn->rd_mode = HTTP_RD_DISCARD;
    if (conn->paused) {
        conn->paused = false;
        free(conn->pend);
        conn->pend = NULL;
        conn->pend_len = 0;
    }
    DUET_LOG_DEBUG("http: %s: answering %d and closing", conn->peer, status);
    req = req_new(conn);
    if (req == NULL) {
        conn_close(conn);
        return;
    }
    req->internal = true;
    req->method = method;
    req->keep_alive = false;
    conn_enqueue(conn, req);
    char body[96];
    int bl = snprintf(body, sizeof(body), "%d %s\n", status, duet_http_status_reason(status));
    if (respond_whole(req, status, "text/plain", NULL, 0, body, (size_t)bl) != DUET_OK)
        return;
    conn_read_on(conn); /* the queue may still owe answers: keep noticing a client EOF */
}

/* ------------------------------------------------------------------ parser callbacks */

static int on_message_begin(http_parser *p)
{
    http_conn_t *conn = p->data;
    DUET_ASSERT(conn->cur == NULL);
    conn->cur = req_new(conn);
    if (conn->cur == NULL) {
        conn->err_status = 503;
        return -1;
    }
    conn->msg_state = HTTP_MSG_HEADERS;
    conn->msg_deadline = uv_now(conn->srv->loop) + conn->srv->opts.header_timeout_ms;
    conn->hdr_state = HTTP_HS_URL;
    conn->hdr_bytes = 0;
    conn->te_bad = false;
    return 0;
}

static int fail_cb(http_conn_t *conn, int status)
{
    conn->err_status = status;
    return -1;
}

static int count_header_bytes(http_conn_t *conn, size_t len)
{
    conn->hdr_bytes += len;
    if (conn->hdr_bytes > conn->srv->opts.max_header_bytes)
        return fail_cb(conn, 431);
    return 0;
}

static int on_url(http_parser *p, const char *at, size_t len)
{
    http_conn_t *conn = p->data;
    duet_http_request_t *req = conn->cur;
    req->url_len += len;
    if (req->url_len > conn->srv->opts.max_url_bytes)
        return fail_cb(conn, 414);
    if (count_header_bytes(conn, len) != 0)
        return -1;
    return req_text_append(req, at, len) ? 0 : fail_cb(conn, 503);
}

/* Is every coding in this Transfer-Encoding value one we decode (chunked, identity)? */
static bool te_supported(const char *v)
{
    while (*v != '\0') {
        while (*v == ' ' || *v == '\t' || *v == ',')
            v++;
        const char *s = v;
        while (*v != '\0' && *v != ',' && *v != ' ' && *v != '\t' && *v != ';')
            v++;
        size_t l = (size_t)(v - s);
        if (l > 0 && !(l == 7 && strncasecmp(s, "chunked", 7) == 0) &&
            !(l == 8 && strncasecmp(s, "identity", 8) == 0))
            return false;
        while (*v != '\0' && *v != ',') /* parameters */
            v++;
    }
    return true;
}

/* Terminate the string being collected (URL or a header value) and check a finished value. */
static bool end_text(http_conn_t *conn)
{
    duet_http_request_t *req = conn->cur;
    if (!req_text_nul(req))
        return false;
    if (conn->hdr_state == HTTP_HS_VALUE) {
        http_hdr_off_t *h = &req->hdrs[req->n_hdrs - 1];
        if (strcasecmp(req->text + h->name, "transfer-encoding") == 0 &&
            !te_supported(req->text + h->value))
            conn->te_bad = true;
    }
    return true;
}

static int on_header_field(http_parser *p, const char *at, size_t len)
{
    http_conn_t *conn = p->data;
    duet_http_request_t *req = conn->cur;
    if (conn->msg_state == HTTP_MSG_BODY) /* a trailer of a chunked body: counted, dropped */
        return count_header_bytes(conn, len);
    if (conn->hdr_state != HTTP_HS_FIELD) {
        if (!end_text(conn))
            return fail_cb(conn, 503);
        if (req->n_hdrs >= conn->srv->opts.max_headers)
            return fail_cb(conn, 431);
        if (req->n_hdrs == req->cap_hdrs) {
            size_t c = req->cap_hdrs ? req->cap_hdrs * 2 : 16;
            http_hdr_off_t *h = realloc(req->hdrs, c * sizeof(*h));
            if (h == NULL)
                return fail_cb(conn, 503);
            req->hdrs = h;
            req->cap_hdrs = c;
        }
        req->hdrs[req->n_hdrs].name = (uint32_t)req->text_len;
        req->hdrs[req->n_hdrs].value = (uint32_t)req->text_len;
        req->n_hdrs++;
        conn->hdr_state = HTTP_HS_FIELD;
        if (count_header_bytes(conn, 4) != 0) /* ": " and CRLF */
            return -1;
    }
    if (count_header_bytes(conn, len) != 0)
        return -1;
    return req_text_append(req, at, len) ? 0 : fail_cb(conn, 503);
}

static int on_header_value(http_parser *p, const char *at, size_t len)
{
    http_conn_t *conn = p->data;
    duet_http_request_t *req = conn->cur;
    if (conn->msg_state == HTTP_MSG_BODY) /* a trailer's value */
        return count_header_bytes(conn, len);
    if (conn->hdr_state != HTTP_HS_VALUE) {
        if (!req_text_nul(req))
            return fail_cb(conn, 503);
        req->hdrs[req->n_hdrs - 1].value = (uint32_t)req->text_len;
        conn->hdr_state = HTTP_HS_VALUE;
    }
    if (count_header_bytes(conn, len) != 0)
        return -1;
    return req_text_append(req, at, len) ? 0 : fail_cb(conn, 503);
}

/*
 * Split the URL into path and query (stored after the headers in req->text). The pieces are
 * copied from req->text itself, so the room for them is made first: growing after taking a
 * pointer into the buffer would copy from freed memory.
 */
static bool split_url(duet_http_request_t *req, int is_connect)
{
    if (req->url_len == 1 && req->text[0] == '*')
        return true; /* OPTIONS *: path stays "/" */
    struct http_parser_url u;
    http_parser_url_init(&u);
    if (http_parser_parse_url(req->text, req->url_len, is_connect, &u) != 0)
        return false;
    const bool has_path = (u.field_set & (1 << UF_PATH)) != 0;
    const bool has_query = (u.field_set & (1 << UF_QUERY)) != 0;
    /* http-parser takes "*x" for a path; a request target's path is absolute (RFC 9112, 3.2) */
    if (has_path && req->text[u.field_data[UF_PATH].off] != '/')
        return false;
    size_t need = req->text_len + 1;
    if (has_path)
        need += u.field_data[UF_PATH].len + 1;
    if (has_query)
        need += u.field_data[UF_QUERY].len + 1;
    if (!grow(&req->text, &req->text_cap, need))
        return false;
    if (has_path) {
        uint32_t off = (uint32_t)req->text_len;
        if (!req_text_append(req, req->text + u.field_data[UF_PATH].off,
                             u.field_data[UF_PATH].len) ||
            !req_text_nul(req))
            return false;
        req->path_off = off;
    }
    if (has_query) {
        uint32_t off = (uint32_t)req->text_len;
        if (!req_text_append(req, req->text + u.field_data[UF_QUERY].off,
                             u.field_data[UF_QUERY].len) ||
            !req_text_nul(req))
            return false;
        req->query_off = off;
    }
    return true;
}

static int on_headers_complete(http_parser *p)
{
    http_conn_t *conn = p->data;
    duet_http_request_t *req = conn->cur;
    const duet_http_options_t *o = &conn->srv->opts;
    if (req->text == NULL && !req_text_append(req, "", 0))
        return fail_cb(conn, 503);
    if (!end_text(conn))
        return fail_cb(conn, 503);
    req->method = http_method_str((enum http_method)p->method);
    /* HTTP/1.x above 1.1 is read as 1.1 (RFC 9110, 2.5), the highest this server speaks */
    req->minor = p->http_minor > 1 ? 1 : p->http_minor;
    if (conn->te_bad)
        return fail_cb(conn, 501);
    if (p->method == HTTP_CONNECT)
        return fail_cb(conn, 501);
    if (p->http_major != 1)
        return fail_cb(conn, 505);
    bool chunked = (p->flags & F_CHUNKED) != 0;
    if (!chunked && p->content_length != ULLONG_MAX) {
        if (p->content_length > o->max_body_bytes)
            return fail_cb(conn, 413);
        if (p->content_length > 0) {
            if (!grow(&req->body, &req->body_cap, (size_t)p->content_length + 1))
                return fail_cb(conn, 503);
        }
    }
    if (!split_url(req, 0))
        return fail_cb(conn, 400);
    req->keep_alive = http_should_keep_alive(p) != 0;
    req->is_head = p->method == HTTP_HEAD;
    conn->msg_state = HTTP_MSG_BODY;
    conn->msg_deadline = uv_now(conn->srv->loop) + o->body_timeout_ms;
    return 0;
}

static int on_body(http_parser *p, const char *at, size_t len)
{
    http_conn_t *conn = p->data;
    duet_http_request_t *req = conn->cur;
    if (req->body_len + len > conn->srv->opts.max_body_bytes)
        return fail_cb(conn, 413);
    if (!grow(&req->body, &req->body_cap, req->body_len + len + 1))
        return fail_cb(conn, 503);
    memcpy(req->body + req->body_len, at, len);
    req->body_len += len;
    return 0;
}

static int on_message_complete(http_parser *p)
{
    http_conn_t *conn = p->data;
    duet_http_server_t *srv = conn->srv;
    duet_http_request_t *req = conn->cur;
    conn->cur = NULL;
    conn->msg_state = HTTP_MSG_NONE;
    if (req->body != NULL)
        req->body[req->body_len] = '\0';
    conn_enqueue(conn, req);
    if (!req->keep_alive) {
        /* The last request of this connection: later bytes are not parsed. */
        conn->want_close = true;
        http_parser_pause(p, 1);
    }
    req->app_held = true;
    srv->opts.on_request(req, srv->opts.user);
    /* Stop after this message when the connection is going away or the queue is full. */
    if (conn->closing || conn->want_close || conn->q_len >= srv->opts.max_pipeline)
        http_parser_pause(p, 1);
    return 0;
}

/* ------------------------------------------------------------------ connection */

static void conn_on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    http_conn_t *conn = h->data;
    *buf = uv_buf_init(conn->srv->rbuf, sizeof(conn->srv->rbuf));
}

static int status_of_parse_error(http_conn_t *conn, enum http_errno e)
{
    if (conn->err_status != 0)
        return conn->err_status;
    switch (e) {
    case HPE_HEADER_OVERFLOW:
        return 431;
    case HPE_INVALID_TRANSFER_ENCODING:
        /* http-parser refuses a request whose last coding is not chunked before we see the
         * end of its headers; tell an unknown coding (501) from a misplaced one (400). */
        if (conn->cur != NULL && conn->hdr_state == HTTP_HS_VALUE && end_text(conn) && conn->te_bad)
            return 501;
        return 400;
    default:
        return 400;
    }
}

static void conn_parse(http_conn_t *conn, const char *data, size_t len)
{
    duet_http_server_t *srv = conn->srv;
    while (len > 0) {
        conn->err_status = 0;
        size_t n = http_parser_execute(&conn->parser, &srv->settings, data, len);
        if (conn->closing)
            return;
        enum http_errno e = HTTP_PARSER_ERRNO(&conn->parser);
        if (e == HPE_PAUSED) {
            if (conn->want_close) {
                if (conn->rd_mode == HTTP_RD_PARSE)
                    conn->rd_mode = HTTP_RD_DISCARD;
                return;
            }
            /* The queue is full: keep the rest for later and stop reading. */
            data += n;
            len -= n;
            if (len > 0) {
                conn->pend = malloc(len);
                if (conn->pend == NULL) {
                    conn_close(conn);
                    return;
                }
                memcpy(conn->pend, data, len);
                conn->pend_len = len;
            }
            conn->paused = true;
            if (conn->reading) {
                uv_read_stop((uv_stream_t *)&conn->tcp);
                conn->reading = false;
            }
            return;
        }
        if (e != HPE_OK) {
            int status = status_of_parse_error(conn, e);
            DUET_LOG_DEBUG("http: %s: parse error %s", conn->peer, http_errno_name(e));
            conn_fail(conn, status);
            return;
        }
        if (n >= len)
            return;
        if (n == 0) { /* cannot happen; never spin */
            conn_fail(conn, 400);
            return;
        }
        /* An Upgrade request stops the parser after its message; we ignore upgrades. */
        data += n;
        len -= n;
    }
}

/* Start reading the socket; the test seam's connection has none (its reads come from
 * duet__http_server_feed), so there it succeeds without doing anything. */
static int conn_read_start(http_conn_t *conn)
{
    if (conn->srv->fake_out != NULL)
        return 0;
    return uv_read_start((uv_stream_t *)&conn->tcp, conn_on_alloc, conn_on_read);
}

static void conn_on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    http_conn_t *conn = s->data;
    if (conn->closing)
        return;
    if (nread > 0) {
        metric_add(conn->srv->m_bytes_in, (double)nread);
        if (conn->rd_mode == HTTP_RD_PARSE)
            conn_parse(conn, buf->base, (size_t)nread);
        conn_update_timer(conn);
        return;
    }
    if (nread == 0)
        return;
    if (nread != UV_EOF) {
        DUET_LOG_DEBUG("http: read from %s: %s", conn->peer, uv_strerror((int)nread));
        conn_close(conn);
        return;
    }
    conn->eof = true;
    uv_read_stop(s);
    conn->reading = false;
    if (conn->shutting) {
        /* Lingering ends at the client's EOF; while our writes flush, on_shutdown closes. */
        if (conn->rd_mode == HTTP_RD_LINGER && conn->timer_kind == HTTP_TIMER_LINGER)
            conn_close(conn);
        return;
    }
    if (conn->q_len > 0 || conn->msg_state != HTTP_MSG_NONE) {
        DUET_LOG_DEBUG("http: %s closed with %zu response(s) owed", conn->peer, conn->q_len);
        conn_close(conn);
        return;
    }
    conn_finish(conn);
}

/* Make sure the connection reads (to parse, discard or notice the client's EOF). */
static void conn_read_on(http_conn_t *conn)
{
    if (conn->closing || conn->reading || conn->eof || conn->paused)
        return;
    int e = conn_read_start(conn);
    if (e < 0) {
        conn_close(conn);
        return;
    }
    conn->reading = true;
}

static void conn_on_timer(uv_timer_t *t)
{
    http_conn_t *conn = t->data;
    http_timer_kind_t kind = conn->timer_kind;
    conn->timer_kind = HTTP_TIMER_NONE;
    switch (kind) {
    case HTTP_TIMER_HEADER:
    case HTTP_TIMER_BODY:
        DUET_LOG_DEBUG("http: %s: %s timeout", conn->peer,
                       kind == HTTP_TIMER_HEADER ? "header" : "body");
        conn_fail(conn, 408);
        conn_update_timer(conn);
        break;
    case HTTP_TIMER_IDLE:
        conn_finish(conn);
        break;
    case HTTP_TIMER_FLUSH:
    case HTTP_TIMER_LINGER:
        conn_close(conn);
        break;
    case HTTP_TIMER_NONE:
        break;
    }
}

static void conn_set_timer(http_conn_t *conn, http_timer_kind_t kind, uint64_t deadline)
{
    uint64_t now = uv_now(conn->srv->loop);
    if (kind == HTTP_TIMER_NONE) {
        if (conn->timer_kind != HTTP_TIMER_NONE)
            uv_timer_stop(&conn->timer);
        conn->timer_kind = HTTP_TIMER_NONE;
        return;
    }
    if (kind == conn->timer_kind && deadline == conn->timer_deadline)
        return;
    conn->timer_kind = kind;
    conn->timer_deadline = deadline;
    uv_timer_start(&conn->timer, conn_on_timer, deadline > now ? deadline - now : 0, 0);
}

/* Arm the timer the connection's state calls for (not while shutting down: see conn_finish). */
static void conn_update_timer(http_conn_t *conn)
{
    if (conn->closing || conn->shutting)
        return;
    const duet_http_options_t *o = &conn->srv->opts;
    if (conn->rd_mode == HTTP_RD_PARSE && conn->msg_state == HTTP_MSG_HEADERS)
        conn_set_timer(conn, HTTP_TIMER_HEADER, conn->msg_deadline);
    else if (conn->rd_mode == HTTP_RD_PARSE && conn->msg_state == HTTP_MSG_BODY)
        conn_set_timer(conn, HTTP_TIMER_BODY, conn->msg_deadline);
    else if (conn->q_len == 0 && !conn->paused)
        conn_set_timer(conn, HTTP_TIMER_IDLE, uv_now(conn->srv->loop) + o->idle_timeout_ms);
    else
        conn_set_timer(conn, HTTP_TIMER_NONE, 0);
}

static void conn_schedule_resume(http_conn_t *conn)
{
    duet_http_server_t *srv = conn->srv;
    if (conn->resume_queued)
        return;
    conn->resume_queued = true;
    link_push(&srv->resume, &conn->resume_link);
    uv_idle_start(&srv->resume_idle, server_on_resume);
}

/*
 * Send what the queue head has buffered, pop every finished response, and close when the
 * last one owed is out and no more requests will come.
 */
static void conn_flush(http_conn_t *conn)
{
    while (!conn->closing && conn->q_head != NULL) {
        duet_http_request_t *req = conn->q_head;
        if (req->out_len > 0) {
            uv_buf_t b = uv_buf_init(req->out, (unsigned)req->out_len);
            conn->out_bytes -= req->out_len;
            req->out_len = 0;
            conn_send(conn, &b, 1);
            free(req->out);
            req->out = NULL;
            req->out_cap = 0;
            if (conn->closing)
                return;
        }
        if (!req->ended)
            break;
        conn->q_head = req->next;
        if (conn->q_head == NULL)
            conn->q_tail = NULL;
        conn->q_len--;
        req->next = NULL;
        req->conn = NULL;
        req->in_conn = false;
        bool close_after = req->close_after;
        if (!req->app_held)
            req_free(req);
        if (close_after) {
            conn_finish(conn);
            return;
        }
    }
    if (conn->closing)
        return;
    if (conn->q_len == 0 && conn->want_close) {
        conn_finish(conn);
        return;
    }
    if (conn->paused && conn->q_len < conn->srv->opts.max_pipeline)
        conn_schedule_resume(conn);
    conn_update_timer(conn);
}

static void conn_resume(http_conn_t *conn)
{
    if (conn->closing || conn->shutting || !conn->paused ||
        conn->q_len >= conn->srv->opts.max_pipeline)
        return;
    conn->paused = false;
    http_parser_pause(&conn->parser, 0);
    char *data = conn->pend;
    size_t len = conn->pend_len;
    conn->pend = NULL;
    conn->pend_len = 0;
    if (len > 0)
        conn_parse(conn, data, len);
    free(data);
    if (conn->closing)
        return;
    if (!conn->paused && !conn->reading && !conn->eof) {
        if (conn_read_start(conn) == 0)
            conn->reading = true;
    }
    conn_update_timer(conn);
}

static void server_on_resume(uv_idle_t *idle)
{
    duet_http_server_t *srv = idle->data;
    uv_idle_stop(idle);
    while (srv->resume.next != &srv->resume) {
        http_conn_t *conn = CONN_OF(srv->resume.next, resume_link);
        link_remove(&conn->resume_link);
        conn->resume_queued = false;
        conn_resume(conn);
    }
}

static void conn_on_shutdown(uv_shutdown_t *sreq, int status)
{
    http_conn_t *conn = sreq->data;
    if (conn->closing)
        return;
    if (status < 0 || conn->eof) {
        conn_close(conn);
        return;
    }
    /* Our FIN is out: drain what the client still sends until its EOF or linger_ms. */
    conn->rd_mode = HTTP_RD_LINGER;
    if (!conn->reading) {
        if (conn_read_start(conn) != 0) {
            conn_close(conn);
            return;
        }
        conn->reading = true;
    }
    conn_set_timer(conn, HTTP_TIMER_LINGER, uv_now(conn->srv->loop) + conn->srv->opts.linger_ms);
}

/*
 * Graceful close: no more requests, every request still queued is aborted (its response can
 * not follow a FIN), pending writes flush, then FIN and linger. Bounded by the FLUSH timer.
 */
static void conn_finish(http_conn_t *conn)
{
    if (conn->closing || conn->shutting)
        return;
    conn->shutting = true;
    conn->want_close = true;
    if (conn->rd_mode == HTTP_RD_PARSE)
        conn->rd_mode = HTTP_RD_DISCARD;
    for (duet_http_request_t *r = conn->q_head; r != NULL; r = r->next)
        if (!r->ended)
            r->aborted = true;
    if (conn->resume_queued) {
        link_remove(&conn->resume_link);
        conn->resume_queued = false;
    }
    conn_uncork(conn); /* the FIN follows the last byte */
    if (conn->closing)
        return;
    conn->shutdown_req.data = conn;
    int e = uv_shutdown(&conn->shutdown_req, (uv_stream_t *)&conn->tcp, conn_on_shutdown);
    if (e < 0) {
        conn_close(conn);
        return;
    }
    conn_set_timer(conn, HTTP_TIMER_FLUSH,
                   uv_now(conn->srv->loop) + conn->srv->opts.idle_timeout_ms);
}

static void conn_destroy(http_conn_t *conn)
{
    duet_http_server_t *srv = conn->srv;
    /* Tell the application about every response it still owed, then drop our references. */
    while (conn->q_head != NULL) {
        duet_http_request_t *req = conn->q_head;
        conn->q_head = req->next;
        req->next = NULL;
        if (req->app_held && !req->ended && !req->abort_notified) {
            req->abort_notified = true;
            req->aborted = true;
            if (srv->opts.on_abort != NULL)
                srv->opts.on_abort(req, srv->opts.user);
        }
        req->conn = NULL;
        req->in_conn = false;
        if (!req->app_held)
            req_free(req);
    }
    conn->q_tail = NULL;
    conn->q_len = 0;
    req_free(conn->cur);
    free(conn->pend);
    free(conn->cork);
    link_remove(&conn->link);
    srv->n_open--;
    free(conn);
    server_maybe_finish(srv);
}

static void conn_on_handle_close(uv_handle_t *h)
{
    http_conn_t *conn = h->data;
    if (--conn->handles_open == 0)
        conn_destroy(conn);
}

/* Hard close: everything still owed is aborted (on_abort runs from the close callback). */
static void conn_close(http_conn_t *conn)
{
    if (conn->closing)
        return;
    conn->closing = true;
    duet_http_server_t *srv = conn->srv;
    link_remove(&conn->cork_link); /* a hard close drops what is not sent */
    conn->out_bytes -= conn->cork_len;
    conn->cork_len = 0;
    for (duet_http_request_t *r = conn->q_head; r != NULL; r = r->next)
        if (!r->ended)
            r->aborted = true;
    if (conn->resume_queued) {
        link_remove(&conn->resume_link);
        conn->resume_queued = false;
    }
    if (!conn->rejected) {
        srv->n_active--;
        if (srv->m_conns != NULL)
            duet_metrics_gauge_dec(srv->m_conns);
    }
    uv_close((uv_handle_t *)&conn->tcp, conn_on_handle_close);
    uv_close((uv_handle_t *)&conn->timer, conn_on_handle_close);
}

static void conn_set_peer(http_conn_t *conn)
{
    struct sockaddr_storage ss;
    int len = sizeof(ss);
    snprintf(conn->peer, sizeof(conn->peer), "?");
    if (uv_tcp_getpeername(&conn->tcp, (struct sockaddr *)&ss, &len) != 0)
        return;
    char ip[INET6_ADDRSTRLEN] = "";
    if (ss.ss_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)&ss;
        uv_ip4_name(a, ip, sizeof(ip));
        snprintf(conn->peer, sizeof(conn->peer), "%s:%u", ip, ntohs(a->sin_port));
    } else if (ss.ss_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)&ss;
        uv_ip6_name(a, ip, sizeof(ip));
        snprintf(conn->peer, sizeof(conn->peer), "[%s]:%u", ip, ntohs(a->sin6_port));
    }
}

/* A connection's struct and handles, counted as open (not yet accepted). */
static http_conn_t *conn_new(duet_http_server_t *srv)
{
    http_conn_t *conn = calloc(1, sizeof(*conn));
    if (conn == NULL)
        return NULL;
    conn->srv = srv;
    link_init(&conn->resume_link);
    link_init(&conn->cork_link);
    uv_tcp_init(srv->loop, &conn->tcp);
    uv_timer_init(srv->loop, &conn->timer);
    conn->tcp.data = conn;
    conn->timer.data = conn;
    conn->handles_open = 2;
    link_push(&srv->conns, &conn->link);
    srv->n_open++;
    return conn;
}

/* An accepted connection: count it and make its request parser. */
static void conn_begin(http_conn_t *conn)
{
    duet_http_server_t *srv = conn->srv;
    srv->n_active++;
    metric_add(srv->m_accepted, 1);
    if (srv->m_conns != NULL)
        duet_metrics_gauge_inc(srv->m_conns);
    http_parser_init(&conn->parser, HTTP_REQUEST);
    conn->parser.data = conn;
}

static void server_on_connection(uv_stream_t *listener, int status)
{
    duet_http_server_t *srv = listener->data;
    if (status < 0) {
        DUET_LOG_WARN("http: accept: %s", uv_strerror(status));
        return;
    }
    http_conn_t *conn = conn_new(srv);
    if (conn == NULL) {
        DUET_LOG_ERROR("http: out of memory accepting a connection");
        return;
    }
    int e = uv_accept(listener, (uv_stream_t *)&conn->tcp);
    if (e < 0 || srv->n_active >= srv->opts.max_connections) {
        conn->rejected = true;
        if (e == 0) {
            static const char busy[] = "HTTP/1.1 503 Service Unavailable\r\nContent-Type: "
                                       "text/plain\r\nContent-Length: 25\r\nConnection: close\r\n"
                                       "Retry-After: 1\r\n\r\ntoo many connections, bye";
            uv_buf_t b = uv_buf_init((char *)busy, sizeof(busy) - 1);
            (void)uv_try_write((uv_stream_t *)&conn->tcp, &b, 1);
            metric_add(srv->m_rejected, 1);
            DUET_LOG_DEBUG("http: over %zu connections: refused one", srv->opts.max_connections);
        } else {
            DUET_LOG_WARN("http: accept: %s", uv_strerror(e));
        }
        conn_close(conn);
        return;
    }
    conn_begin(conn);
    uv_tcp_nodelay(&conn->tcp, 1);
    conn_set_peer(conn);
    e = conn_read_start(conn);
    if (e < 0) {
        conn_close(conn);
        return;
    }
    conn->reading = true;
    conn_update_timer(conn);
}

/* ------------------------------------------------------------------ server */

void duet_http_options_default(duet_http_options_t *o)
{
    memset(o, 0, sizeof(*o));
    o->host = "127.0.0.1";
    o->port = 0;
    o->backlog = 511;
    o->max_header_bytes = 16 * 1024;
    o->max_headers = 100;
    o->max_url_bytes = 8 * 1024;
    o->max_body_bytes = 4 * 1024 * 1024;
    o->max_pipeline = 16;
    o->max_connections = 1024;
    o->max_output_bytes = 1024 * 1024;
    o->header_timeout_ms = 10 * 1000;
    o->body_timeout_ms = 30 * 1000;
    o->idle_timeout_ms = 60 * 1000;
    o->linger_ms = 1000;
    o->shutdown_grace_ms = 10 * 1000;
}

static void server_on_handle_close(uv_handle_t *h)
{
    duet_http_server_t *srv = h->data;
    if (--srv->handles_open > 0)
        return;
    duet_http_close_cb cb = srv->close_cb;
    void *user = srv->close_user;
    free(srv);
    if (cb != NULL)
        cb(user);
}

static void server_maybe_finish(duet_http_server_t *srv)
{
    if (!srv->closing || srv->finishing || srv->n_open > 0)
        return;
    srv->finishing = true;
    uv_close((uv_handle_t *)&srv->grace_timer, server_on_handle_close);
    uv_close((uv_handle_t *)&srv->resume_idle, server_on_handle_close);
    uv_close((uv_handle_t *)&srv->cork_check, server_on_handle_close);
}

static void server_on_grace(uv_timer_t *t)
{
    duet_http_server_t *srv = t->data;
    size_t cut = 0;
    for (duet__http_link_t *l = srv->conns.next; l != &srv->conns; l = l->next) {
        http_conn_t *conn = CONN_OF(l, link);
        if (!conn->closing) {
            cut++;
            conn_close(conn);
        }
    }
    if (cut > 0)
        DUET_LOG_INFO("http: shutdown grace over: cut %zu connection(s)", cut);
}

static duet_status_t options_check(uv_loop_t *loop, const duet_http_options_t *opts)
{
    if (loop == NULL || opts == NULL || opts->on_request == NULL || opts->host == NULL)
        return DUET_FAIL(DUET_ERR_INVALID, "http: loop, options, host and on_request required");
    if (opts->max_header_bytes == 0 || opts->max_headers == 0 || opts->max_url_bytes == 0 ||
        opts->max_pipeline == 0 || opts->max_connections == 0 || opts->max_output_bytes == 0 ||
        opts->header_timeout_ms == 0 || opts->body_timeout_ms == 0 || opts->idle_timeout_ms == 0)
        return DUET_FAIL(DUET_ERR_INVALID, "http: limits and timeouts must be positive");
    if (opts->max_url_bytes > UINT32_MAX / 2 || opts->max_header_bytes > UINT32_MAX / 2)
        return DUET_FAIL(DUET_ERR_INVALID, "http: header limits too large");
    return DUET_OK;
}

/* The server without its listener: parser callbacks, metrics, the grace timer, the resume idle. */
static duet_http_server_t *server_new(uv_loop_t *loop, const duet_http_options_t *opts)
{
    duet_http_server_t *srv = calloc(1, sizeof(*srv));
    if (srv == NULL)
        return NULL;
    srv->loop = loop;
    srv->opts = *opts;
    link_init(&srv->conns);
    link_init(&srv->resume);
    link_init(&srv->corked);
    srv->settings.on_message_begin = on_message_begin;
    srv->settings.on_url = on_url;
    srv->settings.on_header_field = on_header_field;
    srv->settings.on_header_value = on_header_value;
    srv->settings.on_headers_complete = on_headers_complete;
    srv->settings.on_body = on_body;
    srv->settings.on_message_complete = on_message_complete;

    const duet_http_metrics_t *m = &opts->metrics;
    srv->m_bytes_in = metric_single(m->bytes_in_total);
    srv->m_bytes_out = metric_single(m->bytes_out_total);
    srv->m_conns = metric_single(m->connections);
    srv->m_accepted = metric_child1(m->connections_total, "accepted");
    srv->m_rejected = metric_child1(m->connections_total, "rejected");

    uv_timer_init(loop, &srv->grace_timer);
    srv->grace_timer.data = srv;
    uv_idle_init(loop, &srv->resume_idle);
    srv->resume_idle.data = srv;
    uv_check_init(loop, &srv->cork_check);
    srv->cork_check.data = srv;
    srv->handles_open = 3;
    return srv;
}

duet_status_t duet_http_server_start(uv_loop_t *loop, const duet_http_options_t *opts,
                                     duet_http_server_t **srv_p)
{
    duet_status_t st = options_check(loop, opts);
    if (st != DUET_OK)
        return st;

    /* libuv writes with write(2): a peer's reset must be EPIPE, not a fatal signal. */
    struct sigaction sa;
    if (sigaction(SIGPIPE, NULL, &sa) == 0 && sa.sa_handler == SIG_DFL)
        signal(SIGPIPE, SIG_IGN);

    struct sockaddr_storage addr;
    if (uv_ip4_addr(opts->host, opts->port, (struct sockaddr_in *)&addr) != 0 &&
        uv_ip6_addr(opts->host, opts->port, (struct sockaddr_in6 *)&addr) != 0)
        return DUET_FAIL(DUET_ERR_INVALID, "http: bad listen address '%s'", opts->host);

    duet_http_server_t *srv = server_new(loop, opts);
    if (srv == NULL)
        return DUET_FAIL(DUET_ERR_NOMEM, "http: server");
    uv_tcp_init(loop, &srv->listener);
    srv->listener.data = srv;
    srv->handles_open++;
    int e = uv_tcp_bind(&srv->listener, (const struct sockaddr *)&addr, 0);
    if (e == 0)
        e = uv_listen((uv_stream_t *)&srv->listener, opts->backlog, server_on_connection);
    if (e == 0) {
        struct sockaddr_storage bound;
        int len = sizeof(bound);
        e = uv_tcp_getsockname(&srv->listener, (struct sockaddr *)&bound, &len);
        if (e == 0)
            srv->port =
                ntohs(bound.ss_family == AF_INET ? ((struct sockaddr_in *)&bound)->sin_port
                                                 : ((struct sockaddr_in6 *)&bound)->sin6_port);
    }
    if (e != 0) {
        st = DUET_FAIL(DUET_ERR_IO, "http: listen on %s:%u: %s", opts->host, opts->port,
                       uv_strerror(e));
        /* The handles are freed by their close callbacks; the loop must run once more. */
        srv->closing = true;
        srv->finishing = true;
        uv_close((uv_handle_t *)&srv->listener, server_on_handle_close);
        uv_close((uv_handle_t *)&srv->grace_timer, server_on_handle_close);
        uv_close((uv_handle_t *)&srv->resume_idle, server_on_handle_close);
        uv_close((uv_handle_t *)&srv->cork_check, server_on_handle_close);
        return st;
    }
    DUET_LOG_INFO("http: listening on %s:%u", opts->host, srv->port);
    *srv_p = srv;
    return DUET_OK;
}

duet_status_t duet__http_server_start_fake(uv_loop_t *loop, const duet_http_options_t *opts,
                                           duet_strbuf_t *out, duet_http_server_t **srv_p)
{
    duet_status_t st = options_check(loop, opts);
    if (st != DUET_OK)
        return st;
    if (out == NULL)
        return DUET_FAIL(DUET_ERR_INVALID, "http: the fake server needs an output buffer");
    duet_http_server_t *srv = server_new(loop, opts);
    if (srv == NULL)
        return DUET_FAIL(DUET_ERR_NOMEM, "http: server");
    srv->fake_out = out;
    http_conn_t *conn = conn_new(srv);
    if (conn == NULL) {
        srv->closing = true;
        server_maybe_finish(srv);
        return DUET_FAIL(DUET_ERR_NOMEM, "http: connection");
    }
    conn_begin(conn);
    snprintf(conn->peer, sizeof(conn->peer), "fake:0");
    conn->reading = true; /* as after uv_read_start: the seam delivers the reads */
    conn_update_timer(conn);
    *srv_p = srv;
    return DUET_OK;
}

bool duet__http_server_feed(duet_http_server_t *srv, const char *data, size_t len)
{
    DUET_ASSERT(srv->fake_out != NULL);
    if (srv->conns.next == &srv->conns)
        return false;
    http_conn_t *conn = CONN_OF(srv->conns.next, link);
    if (conn->closing || !conn->reading)
        return false;
    uv_buf_t buf = uv_buf_init((char *)data, (unsigned)len);
    conn_on_read((uv_stream_t *)&conn->tcp, len > 0 ? (ssize_t)len : UV_EOF, &buf);
    return true;
}

uint16_t duet_http_server_port(const duet_http_server_t *srv)
{
    return srv->port;
}

size_t duet_http_server_connections(const duet_http_server_t *srv)
{
    return srv->n_active;
}

void duet_http_server_close(duet_http_server_t *srv, duet_http_close_cb cb, void *user)
{
    DUET_ASSERT(!srv->closing);
    srv->closing = true;
    srv->close_cb = cb;
    srv->close_user = user;
    if (srv->fake_out == NULL)
        uv_close((uv_handle_t *)&srv->listener, server_on_handle_close);
    uv_timer_start(&srv->grace_timer, server_on_grace, srv->opts.shutdown_grace_ms, 0);
    for (duet__http_link_t *l = srv->conns.next, *next; l != &srv->conns; l = next) {
        next = l->next;
        http_conn_t *conn = CONN_OF(l, link);
        if (conn->closing || conn->shutting)
            continue;
        conn->want_close = true;
        if (conn->rd_mode == HTTP_RD_PARSE) {
            /* A request still arriving is dropped; what is queued is answered. */
            conn->rd_mode = HTTP_RD_DISCARD;
            req_free(conn->cur);
            conn->cur = NULL;
            conn->msg_state = HTTP_MSG_NONE;
            free(conn->pend);
            conn->pend = NULL;
            conn->pend_len = 0;
            conn->paused = false;
            if (conn->resume_queued) {
                link_remove(&conn->resume_link);
                conn->resume_queued = false;
            }
            if (!conn->reading && !conn->eof && conn_read_start(conn) == 0)
                conn->reading = true;
        }
        if (conn->q_len == 0)
            conn_finish(conn);
        else
            conn_update_timer(conn);
    }
    server_maybe_finish(srv);
}
