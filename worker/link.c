/*
 * The worker side of the router connection; see worker/link.h.
 *
 * The handshake (connect with retries, Register, RegisterAck) is done with a blocking socket and
 * poll() before the loop runs: a worker has nothing else to do until it is registered. The
 * connected socket then moves into a uv_tcp_t.
 */
#include "worker/link.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "common/strbuf.h"
#include "proto/envelope.h"

struct duet_link {
    uv_loop_t *loop;
    uv_tcp_t tcp;
    uv_write_t wreq;
    duet_link_opts_t opts;
    duet_frame_decoder_t dec;
    duet_strbuf_t pending;  /* frames not yet handed to a write */
    duet_strbuf_t inflight; /* the bytes of the write in flight */
    bool writing;
    bool closed;                /* no more callbacks */
    bool closing;               /* uv_close called */
    uint32_t router_timeout_ms; /* RegisterAck.heartbeat_timeout_ms */
    char rbuf[65536];
};

static uint64_t link_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static duet_status_t link_connect_once(const char *host, const char *port, int *fd_p)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    int rc = getaddrinfo(host, port, &hints, &ai);
    if (rc != 0)
        return duet_error_set(DUET_ERR_INVALID, "cannot resolve router %s:%s: %s", host, port,
                              gai_strerror(rc));
    duet_status_t st = DUET_ERR_IO;
    for (struct addrinfo *a = ai; a != NULL; a = a->ai_next) {
        int fd = socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0)
            continue;
        if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
            *fd_p = fd;
            st = DUET_OK;
            break;
        }
        duet_error_set(DUET_ERR_IO, "cannot connect to the router at %s:%s: %s", host, port,
                       strerror(errno));
        close(fd);
    }
    freeaddrinfo(ai);
    return st;
}

static duet_status_t link_write_all(int fd, const uint8_t *p, size_t n)
{
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return duet_error_set(DUET_ERR_IO, "write to the router: %s", strerror(errno));
        p += w;
        n -= (size_t)w;
    }
    return DUET_OK;
}

/* Read until one Envelope is decoded (or the deadline). Bytes after it stay in the decoder. */
static duet_status_t link_read_one(int fd, duet_frame_decoder_t *dec, uint64_t deadline_ms,
                                   Duet__Envelope **env_p)
{
    uint8_t b;
    for (;;) {
        uint64_t now = link_now_ms();
        if (now >= deadline_ms)
            return duet_error_set(DUET_ERR_TIMEOUT, "no RegisterAck from the router");
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int r = poll(&p, 1, (int)(deadline_ms - now));
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            continue;
        /* one byte at a time: never read past the RegisterAck, whatever follows it belongs to
         * the loop (a handful of bytes, once per worker start) */
        ssize_t n = read(fd, &b, 1);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return duet_error_set(DUET_ERR_IO, "the router closed the connection during "
                                               "registration");
        size_t used = 0;
        Duet__Envelope *env = NULL;
        duet_status_t st = duet_frame_decoder_feed(dec, &b, (size_t)n, &used, &env);
        if (st < 0)
            return duet_error_set(DUET_ERR_FORMAT, "malformed frame from the router");
        if (env != NULL) {
            *env_p = env;
            return DUET_OK;
        }
    }
}

static void link_closed(duet_link_t *l, const char *reason);

static void link_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    duet_link_t *l = h->data;
    buf->base = l->rbuf;
    buf->len = sizeof(l->rbuf);
}

static void link_on_read(uv_stream_t *s, ssize_t n, const uv_buf_t *buf)
{
    duet_link_t *l = s->data;
    if (n < 0) {
        link_closed(l, n == UV_EOF ? "the router closed the connection" : uv_strerror((int)n));
        return;
    }
    const uint8_t *p = (const uint8_t *)buf->base;
    size_t m = (size_t)n;
    while (m > 0 && !l->closed) {
        size_t used = 0;
        Duet__Envelope *env = NULL;
        if (duet_frame_decoder_feed(&l->dec, p, m, &used, &env) < 0) {
            link_closed(l, "malformed frame from the router");
            return;
        }
        p += used;
        m -= used;
        if (env != NULL) {
            l->opts.on_message(env, l->opts.user);
            duet_envelope_free(env);
        }
    }
}

static void link_flush(duet_link_t *l);

static void link_on_write(uv_write_t *w, int status)
{
    duet_link_t *l = w->data;
    l->writing = false;
    l->inflight.len = 0;
    if (status < 0) {
        link_closed(l, uv_strerror(status));
        return;
    }
    link_flush(l);
}

static void link_flush(duet_link_t *l)
{
    if (l->writing || l->pending.len == 0 || l->closing)
        return;
    /* Write at once what the socket takes (also from inside a long step, where the loop cannot
     * run a write callback); only a remainder waits for uv_write. */
    uv_buf_t now = uv_buf_init(l->pending.data, (unsigned)l->pending.len);
    int n = uv_try_write((uv_stream_t *)&l->tcp, &now, 1);
    if (n < 0 && n != UV_EAGAIN) {
        link_closed(l, uv_strerror(n));
        return;
    }
    if (n < 0)
        n = 0;
    if ((size_t)n == l->pending.len) {
        l->pending.len = 0;
        return;
    }
    memmove(l->pending.data, l->pending.data + n, l->pending.len - (size_t)n);
    l->pending.len -= (size_t)n;
    duet_strbuf_t t = l->inflight;
    l->inflight = l->pending;
    l->pending = t;
    l->pending.len = 0;
    uv_buf_t b = uv_buf_init(l->inflight.data, (unsigned)l->inflight.len);
    l->wreq.data = l;
    int rc = uv_write(&l->wreq, (uv_stream_t *)&l->tcp, &b, 1, link_on_write);
    if (rc < 0) {
        link_closed(l, uv_strerror(rc));
        return;
    }
    l->writing = true;
}

static void link_free_cb(uv_handle_t *h)
{
    duet_link_t *l = h->data;
    duet_frame_decoder_free(&l->dec);
    duet_strbuf_free(&l->pending);
    duet_strbuf_free(&l->inflight);
    free(l);
}

static void link_closed(duet_link_t *l, const char *reason)
{
    if (l->closed)
        return;
    l->closed = true;
    uv_read_stop((uv_stream_t *)&l->tcp);
    if (l->opts.on_closed != NULL)
        l->opts.on_closed(reason, l->opts.user);
}

uint32_t duet_link_router_timeout_ms(const duet_link_t *link)
{
    return link->router_timeout_ms;
}

duet_status_t duet_link_open(uv_loop_t *loop, const duet_link_opts_t *opts, duet_link_t **link_p,
                             uint64_t *worker_id_p)
{
    char host[256];
    if (opts->router == NULL || strlen(opts->router) >= sizeof(host))
        return duet_error_set(DUET_ERR_INVALID, "router address missing or too long");
    snprintf(host, sizeof(host), "%s", opts->router);
    char *colon = strrchr(host, ':');
    if (colon == NULL || colon[1] == '\0')
        return duet_error_set(DUET_ERR_INVALID, "router address '%s' is not HOST:PORT",
                              opts->router);
    *colon = '\0';
    const char *port = colon + 1;
    if (host[0] == '[' && colon > host + 1 && colon[-1] == ']') { /* [::1]:8100 */
        memmove(host, host + 1, strlen(host));
        host[strlen(host) - 1] = '\0';
    }

    uint64_t deadline = link_now_ms() + opts->connect_timeout_ms;
    int fd = -1;
    duet_status_t st;
    uint64_t last_log = 0;
    for (;;) {
        st = link_connect_once(host, port, &fd);
        if (st == DUET_OK || st == DUET_ERR_INVALID)
            break;
        uint64_t now = link_now_ms();
        if (now >= deadline)
            return duet_error_set(DUET_ERR_TIMEOUT, "no router at %s after %u ms: %s", opts->router,
                                  opts->connect_timeout_ms, duet_error_last());
        if (now - last_log >= 5000) {
            DUET_LOG_INFO("waiting for the router at %s (%s)", opts->router, duet_error_last());
            last_log = now;
        }
        usleep(100 * 1000);
    }
    if (st < 0)
        return st;
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));

    duet_link_t *l = calloc(1, sizeof(*l));
    if (l == NULL) {
        close(fd);
        return duet_error_set(DUET_ERR_NOMEM, "link");
    }
    l->loop = loop;
    l->opts = *opts;
    duet_strbuf_init(&l->pending);
    duet_strbuf_init(&l->inflight);
    duet_frame_decoder_init(&l->dec, 0);

    Duet__Register reg = *opts->reg;
    reg.version = DUET_PROTO_VERSION;
    Duet__Envelope env = duet_envelope_register_(&reg);
    Duet__Envelope *ack = NULL;
    if ((st = duet_frame_append(&env, &l->pending)) < 0 ||
        (st = link_write_all(fd, (const uint8_t *)l->pending.data, l->pending.len)) < 0 ||
        (st = link_read_one(fd, &l->dec, link_now_ms() + opts->connect_timeout_ms + 5000, &ack)) <
            0)
        goto fail;
    l->pending.len = 0;
    if (ack->body_case != DUET__ENVELOPE__BODY_REGISTER_ACK) {
        st = duet_error_set(DUET_ERR_FORMAT, "the router answered Register with body %d",
                            (int)ack->body_case);
        goto fail;
    }
    if (!ack->register_ack->accepted) {
        st = duet_error_set(DUET_ERR_UNSUPPORTED, "the router refused this worker: %s",
                            ack->register_ack->reason != NULL ? ack->register_ack->reason : "");
        goto fail;
    }
    *worker_id_p = ack->register_ack->worker_id;
    l->router_timeout_ms = ack->register_ack->heartbeat_timeout_ms;
    duet_envelope_free(ack);
    ack = NULL;

    int rc = uv_tcp_init(loop, &l->tcp);
    if (rc == 0)
        rc = uv_tcp_open(&l->tcp, fd);
    if (rc < 0) {
        st = duet_error_set(DUET_ERR_IO, "libuv: %s", uv_strerror(rc));
        goto fail;
    }
    l->tcp.data = l;
    rc = uv_read_start((uv_stream_t *)&l->tcp, link_alloc, link_on_read);
    if (rc < 0) {
        uv_close((uv_handle_t *)&l->tcp, link_free_cb);
        return duet_error_set(DUET_ERR_IO, "libuv: %s", uv_strerror(rc));
    }
    *link_p = l;
    return DUET_OK;

fail:
    duet_envelope_free(ack);
    close(fd);
    duet_frame_decoder_free(&l->dec);
    duet_strbuf_free(&l->pending);
    duet_strbuf_free(&l->inflight);
    free(l);
    return st;
}

duet_status_t duet_link_send(duet_link_t *l, Duet__Envelope *env)
{
    if (l == NULL || l->closed || l->closing)
        return duet_error_set(DUET_ERR_IO, "the router connection is closed");
    env->version = DUET_PROTO_VERSION;
    duet_status_t st = duet_frame_append(env, &l->pending);
    if (st < 0)
        return st;
    link_flush(l);
    return DUET_OK;
}

size_t duet_link_pending(const duet_link_t *l)
{
    return l->pending.len + l->inflight.len;
}

void duet_link_close(duet_link_t *l, uint32_t flush_timeout_ms)
{
    if (l == NULL)
        return;
    uint64_t deadline = link_now_ms() + flush_timeout_ms;
    while (!l->closed && (l->writing || l->pending.len > 0) && link_now_ms() < deadline) {
        if (uv_run(l->loop, UV_RUN_NOWAIT) == 0)
            break;
        usleep(1000);
    }
    l->closed = true;
    l->closing = true;
    uv_close((uv_handle_t *)&l->tcp, link_free_cb);
}
