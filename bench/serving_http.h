/*
 * A minimal HTTP/1.1 client on libuv + http-parser for duet-bench: one request per TCP
 * connection ("Connection: close"), the response status and body handed to callbacks as they
 * arrive (http-parser removes the chunked framing), and exactly one completion callback per
 * request, called from the TCP handle's close callback so the caller may reuse or free the
 * request memory there.
 *
 * One connection per request keeps the timing honest and the state machine small: the server
 * sees the same connect + request a fresh client would, and no pipelining or pooling decides
 * which request waits for which.
 */
#ifndef DUET_BENCH_SERVING_HTTP_H
#define DUET_BENCH_SERVING_HTTP_H

#include <http_parser.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>
#include <uv.h>

#include "common/status.h"
#include "common/strbuf.h"

typedef struct serving_http_req serving_http_req_t;

typedef struct {
    /* Headers are complete: status code and Content-Type ("" when none). May call abort. */
    void (*on_headers)(serving_http_req_t *req, int status, const char *content_type);
    /* Body bytes (without chunk framing) from a read that arrived at now_ns. May call abort. */
    void (*on_body)(serving_http_req_t *req, const char *data, size_t len, uint64_t now_ns);
    /*
     * The request is over and its handle closed: error is NULL when the whole response was
     * received, else the reason (connect failure, reset, malformed HTTP, abort reason).
     */
    void (*on_done)(serving_http_req_t *req, const char *error);
} serving_http_cbs_t;

/* Embedded by the caller; fields are private to serving_http.c except `arg`. */
struct serving_http_req {
    void *arg; /* the caller's */
    uv_tcp_t tcp;
    uv_connect_t connect;
    uv_write_t write;
    http_parser parser;
    const serving_http_cbs_t *cbs; /* not owned */
    char *out;                     /* owned: the request bytes until written */
    char content_type[128];
    bool in_content_type; /* the header field being parsed is Content-Type */
    bool complete;        /* the parser saw the end of the message */
    bool closing;
    uint64_t read_ns; /* arrival time of the read being parsed */
    char error[256];  /* "" unless failed */
};

/* Resolve host:port once (blocking; before the benchmark starts). */
duet_status_t serving_http_resolve(uv_loop_t *loop, const char *host, int port,
                                   struct sockaddr_storage *addr_p);

/*
 * Start one request: connect, send `method path` with Host host_hdr and the body (JSON, may be
 * NULL), read the response. Returns DUET_OK when started (on_done will follow exactly once),
 * else an error (nothing started, no callback).
 */
duet_status_t serving_http_start(uv_loop_t *loop, serving_http_req_t *req,
                                 const struct sockaddr *addr, const char *host_hdr,
                                 const char *method, const char *path, const char *body,
                                 size_t body_len, const serving_http_cbs_t *cbs, void *arg);

/* Stop the request with a reason (printf format); on_done follows with it. No-op when closing. */
void serving_http_abort(serving_http_req_t *req, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/*
 * `method path` with an optional JSON body, waiting for the whole answer while running the loop
 * (call only while no other request is on it). *status_p receives the status, resp the bytes
 * (64 MiB at most). DUET_ERR_TRANSPORT (with detail) when no complete response came within
 * timeout_ms.
 */
duet_status_t serving_http_fetch(uv_loop_t *loop, const struct sockaddr *addr, const char *host_hdr,
                                 const char *method, const char *path, const char *body,
                                 size_t body_len, uint64_t timeout_ms, int *status_p,
                                 duet_strbuf_t *resp);

/* serving_http_fetch of `GET path` without a body. */
duet_status_t serving_http_get(uv_loop_t *loop, const struct sockaddr *addr, const char *host_hdr,
                               const char *path, uint64_t timeout_ms, int *status_p,
                               duet_strbuf_t *body);

#endif
