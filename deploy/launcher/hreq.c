/*
 * A non-blocking HTTP/1.1 request for the launcher; see hreq.h for the contract.
 *
 * The response is kept whole in one buffer and re-parsed after each read: responses here are a
 * few hundred bytes (health, models, one completion), so simplicity wins over incremental
 * parsing. A chunked body is decoded into a second buffer once it is complete.
 */
#define _GNU_SOURCE
#include "deploy/launcher/hreq.h"

#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/strbuf.h"

#define HREQ_MAX_RESPONSE ((size_t)4 << 20)

typedef enum {
    HREQ_CONNECTING = 0,
    HREQ_SENDING = 1,
    HREQ_RECEIVING = 2,
    HREQ_DONE = 3,
} hreq_state_t;

struct duet_hreq {
    int fd;
    hreq_state_t state;
    char where[300]; /* "host:port" for messages */
    char *out;       /* (out_len) the request bytes, owned */
    size_t out_len, out_at;
    duet_strbuf_t in;   /* the response so far */
    duet_strbuf_t body; /* the decoded body once complete */
    int status;
};

/* Connect a non-blocking socket to the first address of host:port that takes one. */
static duet_status_t hreq_connect(const char *host, int port, const char *where, int *fd_p)
{
    char service[16];
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    snprintf(service, sizeof(service), "%d", port);
    int rc = getaddrinfo(host, service, &hints, &ai);
    if (rc != 0)
        return duet_error_set(DUET_ERR_NOT_FOUND, "%s: cannot resolve: %s", where,
                              gai_strerror(rc));
    duet_status_t st = duet_error_set(DUET_ERR_IO, "%s: no address", where);
    for (struct addrinfo *a = ai; a != NULL; a = a->ai_next) {
        int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0) {
            st = duet_error_set(DUET_ERR_IO, "%s: socket: %s", where, strerror(errno));
            continue;
        }
        if (connect(fd, a->ai_addr, a->ai_addrlen) == 0 || errno == EINPROGRESS) {
            *fd_p = fd;
            st = DUET_OK;
            break;
        }
        st = duet_error_set(DUET_ERR_IO, "%s: connect: %s", where, strerror(errno));
        close(fd);
    }
    freeaddrinfo(ai);
    return st;
}

duet_status_t duet_hreq_start(const char *host, int port, const char *method, const char *path,
                              const char *body, duet_hreq_t **req_p)
{
    duet_hreq_t *req = calloc(1, sizeof(*req));
    if (req == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "out of memory");
    req->fd = -1;
    snprintf(req->where, sizeof(req->where), "%s%s%s:%d", strchr(host, ':') != NULL ? "[" : "",
             host, strchr(host, ':') != NULL ? "]" : "", port);
    int n =
        asprintf(&req->out,
                 "%s %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\nUser-Agent: duet-up\r\n"
                 "Accept: application/json\r\n%s%s%zu\r\n\r\n%s",
                 method, path, req->where, body != NULL ? "Content-Type: application/json\r\n" : "",
                 "Content-Length: ", body != NULL ? strlen(body) : 0, body != NULL ? body : "");
    if (n < 0) {
        req->out = NULL;
        duet_hreq_destroy(req);
        return duet_error_set(DUET_ERR_NOMEM, "out of memory");
    }
    req->out_len = (size_t)n;
    duet_status_t st = hreq_connect(host, port, req->where, &req->fd);
    if (st != DUET_OK) {
        duet_hreq_destroy(req);
        return st;
    }
    *req_p = req;
    return DUET_OK;
}

int duet_hreq_fd(const duet_hreq_t *req)
{
    return req->fd;
}

short duet_hreq_events(const duet_hreq_t *req)
{
    return req->state == HREQ_RECEIVING ? POLLIN : POLLOUT;
}

/* Find header `name` in the head (before the blank line); its value, or NULL. */
static const char *hreq_header(const char *head, size_t head_len, const char *name, size_t *len_p)
{
    size_t nl = strlen(name);
    const char *p = memchr(head, '\n', head_len); /* skip the status line */
    const char *end = head + head_len;
    while (p != NULL && p + 1 < end) {
        p++;
        const char *eol = memchr(p, '\n', (size_t)(end - p));
        if (eol == NULL)
            eol = end;
        if ((size_t)(eol - p) > nl && strncasecmp(p, name, nl) == 0 && p[nl] == ':') {
            const char *v = p + nl + 1;
            while (v < eol && (*v == ' ' || *v == '\t'))
                v++;
            const char *ve = eol;
            while (ve > v && (ve[-1] == '\r' || ve[-1] == ' ' || ve[-1] == '\t'))
                ve--;
            *len_p = (size_t)(ve - v);
            return v;
        }
        p = eol < end ? eol : NULL;
    }
    return NULL;
}

/*
 * Decode a chunked body from s[0..n) into out. DUET_ERR_BUSY while incomplete, DUET_ERR_FORMAT
 * when malformed.
 */
static duet_status_t hreq_dechunk(const char *s, size_t n, duet_strbuf_t *out)
{
    size_t at = 0;
    duet_strbuf_free(out);
    for (;;) {
        const char *eol = memchr(s + at, '\n', n - at);
        if (eol == NULL)
            return DUET_ERR_BUSY;
        char *end = NULL;
        size_t size = (size_t)strtoull(s + at, &end, 16);
        if (end == s + at || size > HREQ_MAX_RESPONSE)
            return DUET_ERR_FORMAT;
        at = (size_t)(eol - s) + 1;
        if (size == 0)
            return DUET_OK; /* trailers, if any, do not matter here */
        if (n - at < size + 2)
            return DUET_ERR_BUSY;
        duet_strbuf_append(out, s + at, size);
        at += size;
        if (s[at] == '\r')
            at++;
        if (at >= n || s[at] != '\n')
            return DUET_ERR_FORMAT;
        at++;
    }
}

/*
 * Parse what arrived. eof: the server closed. DUET_ERR_BUSY until the response is whole.
 */
static duet_status_t hreq_parse(duet_hreq_t *req, bool eof)
{
    const char *s = req->in.data != NULL ? req->in.data : "";
    size_t n = req->in.len;
    const char *blank = memmem(s, n, "\r\n\r\n", 4);
    if (blank == NULL)
        return eof ? duet_error_set(DUET_ERR_FORMAT, "%s: %s", req->where,
                                    n == 0 ? "connection closed without a response"
                                           : "truncated response head")
                   : DUET_ERR_BUSY;
    size_t head_len = (size_t)(blank - s) + 2;
    int minor = 0, status = 0;
    if (sscanf(s, "HTTP/1.%d %3d", &minor, &status) != 2 || status < 100 || status > 599)
        return duet_error_set(DUET_ERR_FORMAT, "%s: malformed status line", req->where);
    const char *b = blank + 4;
    size_t bn = n - (size_t)(b - s);
    size_t vl = 0;
    const char *te = hreq_header(s, head_len, "Transfer-Encoding", &vl);
    if (te != NULL && vl >= 7 && strncasecmp(te + vl - 7, "chunked", 7) == 0) {
        duet_status_t st = hreq_dechunk(b, bn, &req->body);
        if (st == DUET_ERR_BUSY && eof)
            return duet_error_set(DUET_ERR_FORMAT, "%s: truncated chunked body", req->where);
        if (st == DUET_ERR_FORMAT)
            return duet_error_set(DUET_ERR_FORMAT, "%s: malformed chunked body", req->where);
        if (st != DUET_OK)
            return st;
    } else {
        const char *cl = hreq_header(s, head_len, "Content-Length", &vl);
        if (cl != NULL) {
            size_t want = (size_t)strtoull(cl, NULL, 10);
            if (bn < want)
                return eof ? duet_error_set(DUET_ERR_FORMAT,
                                            "%s: truncated body (%zu of %zu "
                                            "bytes)",
                                            req->where, bn, want)
                           : DUET_ERR_BUSY;
            bn = want;
        } else if (!eof) {
            return DUET_ERR_BUSY; /* the body ends when the server closes */
        }
        duet_strbuf_free(&req->body);
        duet_strbuf_append(&req->body, b, bn);
        duet_strbuf_puts(&req->body, "");
    }
    if (duet_strbuf_status(&req->body) != DUET_OK)
        return duet_error_set(DUET_ERR_NOMEM, "%s: out of memory", req->where);
    req->status = status;
    req->state = HREQ_DONE;
    return DUET_OK;
}

duet_status_t duet_hreq_step(duet_hreq_t *req)
{
    if (req->state == HREQ_CONNECTING) {
        int err = 0;
        socklen_t l = sizeof(err);
        if (getsockopt(req->fd, SOL_SOCKET, SO_ERROR, &err, &l) != 0)
            err = errno;
        if (err == EINPROGRESS || err == EALREADY)
            return DUET_ERR_BUSY;
        if (err != 0)
            return duet_error_set(DUET_ERR_IO, "%s: connect: %s", req->where, strerror(err));
        req->state = HREQ_SENDING;
    }
    while (req->state == HREQ_SENDING) {
        ssize_t w = send(req->fd, req->out + req->out_at, req->out_len - req->out_at, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return DUET_ERR_BUSY;
        if (w < 0)
            return duet_error_set(DUET_ERR_IO, "%s: send: %s", req->where, strerror(errno));
        req->out_at += (size_t)w;
        if (req->out_at == req->out_len)
            req->state = HREQ_RECEIVING;
    }
    while (req->state == HREQ_RECEIVING) {
        char buf[16384];
        ssize_t r = recv(req->fd, buf, sizeof(buf), 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return DUET_ERR_BUSY;
        if (r < 0)
            return duet_error_set(DUET_ERR_IO, "%s: recv: %s", req->where, strerror(errno));
        if (r > 0 && req->in.len + (size_t)r > HREQ_MAX_RESPONSE)
            return duet_error_set(DUET_ERR_RANGE, "%s: response over %zu bytes", req->where,
                                  HREQ_MAX_RESPONSE);
        if (r > 0 && duet_strbuf_append(&req->in, buf, (size_t)r) != DUET_OK)
            return duet_error_set(DUET_ERR_NOMEM, "%s: out of memory", req->where);
        duet_status_t st = hreq_parse(req, r == 0);
        if (st != DUET_ERR_BUSY)
            return st;
    }
    return req->state == HREQ_DONE ? DUET_OK : DUET_ERR_BUSY;
}

int duet_hreq_status(const duet_hreq_t *req)
{
    return req->status;
}

const char *duet_hreq_body(const duet_hreq_t *req, size_t *len_p)
{
    if (len_p != NULL)
        *len_p = req->body.len;
    return req->body.data != NULL ? req->body.data : "";
}

void duet_hreq_destroy(duet_hreq_t *req)
{
    if (req == NULL)
        return;
    if (req->fd >= 0)
        close(req->fd);
    free(req->out);
    duet_strbuf_free(&req->in);
    duet_strbuf_free(&req->body);
    free(req);
}

bool duet_hreq_port_open(const char *host, int port, int timeout_ms)
{
    int fd = -1;
    if (hreq_connect(host, port, "probe", &fd) != DUET_OK)
        return false;
    struct pollfd p = {.fd = fd, .events = POLLOUT};
    int r;
    while ((r = poll(&p, 1, timeout_ms)) < 0 && errno == EINTR)
        ;
    int err = r > 0 ? 0 : ETIMEDOUT;
    socklen_t l = sizeof(err);
    if (r > 0 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &l) != 0)
        err = errno;
    close(fd);
    duet_error_clear();
    return err == 0;
}
