/*
 * The router's HTTP/1.1 server: a libuv TCP listener, one http-parser per connection, and a small
 * handler API on which the OpenAI endpoints, /metrics and the admin API are built.
 *
 * Model. The application registers one on_request callback. Each complete request (headers and
 * the whole body, contiguous) is handed to it as an opaque duet_http_request_t; the application
 * answers at any later time from the loop thread, either with a whole response
 * (duet_http_respond) or with a streamed one (duet_http_stream_begin / _write / _end, chunked
 * transfer encoding; duet_http_sse_* for Server-Sent Events). A connection may carry several
 * pipelined requests at once; their responses go out strictly in request order, whatever order
 * the application finishes them in (later responses are buffered until the earlier ones end).
 *
 * Ownership. on_request hands the application one reference to the request; it keeps the handle
 * valid (method, path, headers, body, peer) until the application calls
 * duet_http_request_release() exactly once. Releasing before the response has ended is allowed:
 * a request that was never answered gets a 500, a half-streamed response cuts the connection.
 *
 * Aborts. When the connection of a request goes away before the application ended its response
 * (client disconnect or reset, a write error, the per-connection output limit, a timeout, or the
 * shutdown deadline), on_abort(req, user) is called exactly once for that request, never from
 * inside one of the calls below (it runs from the loop). From the moment of the abort every
 * response call on the request is a no-op returning DUET_ERR_CANCELLED; the handle itself stays
 * valid until released. Requests the application has already released get no on_abort; so an
 * application that still holds a request when a call fails with DUET_ERR_CANCELLED or
 * DUET_ERR_NO_SPACE can leave its cleanup to on_abort, which is still to come (unless it
 * already came).
 *
 * A client EOF while responses are owed counts as a disconnect (half-closed clients that still
 * wait for an answer are not supported): that is how a client's cancel reaches the workers. While
 * a connection has max_pipeline requests queued it is not read, so a disconnect is then noticed
 * at the next write.
 *
 * Trailer fields after a chunked body are read and dropped, never merged into the headers (RFC
 * 9110, 6.5: a client must not be able to add, say, an Authorization field after the body); their
 * bytes count against max_header_bytes.
 *
 * Limits and timeouts (duet_http_options_t) answer with the matching status and close the
 * connection: malformed request 400, header timeout / body timeout 408, body too large 413 (sent
 * at once, the body is not read), URL too long 414, headers too large or too many 431,
 * unsupported Transfer-Encoding or CONNECT 501, HTTP major version other than 1 505;
 * connections over the maximum get a best-effort 503 and are closed. Error responses are queued
 * behind the responses still owed on the connection.
 *
 * Threads. Everything runs on the loop thread given to duet_http_server_start; no function here
 * may be called from another thread.
 */
#ifndef DUET_ROUTER_HTTP_H
#define DUET_ROUTER_HTTP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "common/metrics.h"
#include "common/status.h"

typedef struct duet_http_server duet_http_server_t;   /* one listener and its connections */
typedef struct duet_http_request duet_http_request_t; /* one request, refcounted */

/* One extra response header. Neither string may contain CR or LF. */
typedef struct {
    const char *name;
    const char *value;
} duet_http_header_t;

/* A complete request arrived; the application now owns one reference (see above). */
typedef void (*duet_http_request_cb)(duet_http_request_t *req, void *user);
/* The request's connection went away before its response ended; called at most once. */
typedef void (*duet_http_abort_cb)(duet_http_request_t *req, void *user);
/* The server is closed and freed (duet_http_server_close). */
typedef void (*duet_http_close_cb)(void *user);
/*
 * Map a request path to a bounded label for the requests counter ("/v1/completions", "other").
 * Must return a string that lives as long as the server (a literal). NULL = every path is "all".
 */
typedef const char *(*duet_http_path_class_cb)(const char *path, void *user);

/*
 * Optional metric families (NULL = not exported), created by the caller in its registry with
 * exactly these shapes:
 *   requests_total     counter, labels {method, path, status}: one per response started
 *   bytes_in_total     counter, no labels: bytes read from clients
 *   bytes_out_total    counter, no labels: bytes handed to the kernel or queued for it
 *   connections        gauge, no labels: open client connections
 *   connections_total  counter, labels {result}: "accepted" or "rejected" (over the maximum)
 */
typedef struct {
    duet_metric_family_t *requests_total;
    duet_metric_family_t *bytes_in_total;
    duet_metric_family_t *bytes_out_total;
    duet_metric_family_t *connections;
    duet_metric_family_t *connections_total;
} duet_http_metrics_t;

typedef struct {
    const char *host; /* address to bind, IPv4 or IPv6 literal ("127.0.0.1", "::") */
    uint16_t port;    /* 0 = ephemeral; see duet_http_server_port */
    int backlog;      /* listen(2) backlog */

    size_t max_header_bytes; /* request line + all headers */
    size_t max_headers;      /* header count */
    size_t max_url_bytes;    /* request target */
    size_t max_body_bytes;   /* after de-chunking */
    size_t max_pipeline;     /* requests queued per connection before reading pauses */
    size_t max_connections;  /* open client connections */
    size_t max_output_bytes; /* unsent response bytes per connection before a stream aborts */

    uint32_t header_timeout_ms; /* first byte of a request to the end of its headers */
    uint32_t body_timeout_ms;   /* end of headers to the end of the body */
    uint32_t idle_timeout_ms;   /* keep-alive: no request in flight and none arriving */
    uint32_t linger_ms;         /* after our FIN, how long unread client bytes are drained */
    uint32_t shutdown_grace_ms; /* duet_http_server_close: in-flight responses may finish */

    duet_http_request_cb on_request; /* required */
    duet_http_abort_cb on_abort;     /* optional */
    void *user;                      /* passed to the callbacks */

    duet_http_path_class_cb path_class; /* optional, see above */
    duet_http_metrics_t metrics;        /* optional families, see above */
} duet_http_options_t;

/*
 * Defaults: host 127.0.0.1, port 0, backlog 511, 16 KiB headers, 100 headers, 8 KiB URL,
 * 4 MiB body, 16 pipelined, 1024 connections, 1 MiB output, timeouts: header 10 s, body 30 s,
 * idle 60 s, linger 1 s, shutdown grace 10 s. No callbacks, no metrics.
 */
void duet_http_options_default(duet_http_options_t *opts);

/*
 * Bind, listen and start accepting on `loop`. Options are copied (the metric families and the
 * callbacks' user pointer must outlive the server). Sets SIGPIPE to ignored if it was at its
 * default, since libuv writes with write(2) and a client reset must not kill the process.
 * DUET_ERR_INVALID for a missing on_request or zero limits; DUET_ERR_IO (with detail) when the
 * address cannot be bound.
 */
duet_status_t duet_http_server_start(uv_loop_t *loop, const duet_http_options_t *opts,
                                     duet_http_server_t **srv_p);

/* The bound port (the ephemeral one when the options asked for 0). */
uint16_t duet_http_server_port(const duet_http_server_t *srv);

/* Open client connections right now. */
size_t duet_http_server_connections(const duet_http_server_t *srv);

/*
 * Graceful shutdown: stop accepting, stop reading new requests, let the responses in flight
 * finish (later responses carry "Connection: close"), close idle connections; once
 * shutdown_grace_ms has passed, the remaining connections are cut (their requests get on_abort).
 * When every handle is closed the server is freed and cb(user) runs (cb may be NULL). Calling it
 * twice is a programming error (asserted).
 */
void duet_http_server_close(duet_http_server_t *srv, duet_http_close_cb cb, void *user);

/* ------------------------------------------------------------------ the request handle */

/* Method name ("GET", "POST", ...). */
const char *duet_http_request_method(const duet_http_request_t *req);
/* The request target as sent ("/v1/models?x=1"). */
const char *duet_http_request_url(const duet_http_request_t *req);
/* Path without query or fragment ("/v1/models"); "/" when the target had none. */
const char *duet_http_request_path(const duet_http_request_t *req);
/* Query string without '?' ("x=1"); "" when none. */
const char *duet_http_request_query(const duet_http_request_t *req);
/*
 * Copy the value of query parameter `name` (not URL-decoded) into buf (cap bytes, NUL-terminated)
 * and return true; false when absent or it does not fit.
 */
bool duet_http_request_query_param(const duet_http_request_t *req, const char *name, char *buf,
                                   size_t cap);
/* Value of the first header named `name` (case-insensitive), NULL when absent. */
const char *duet_http_request_header(const duet_http_request_t *req, const char *name);
/* Header count and the i-th header in arrival order (i < count, asserted). */
size_t duet_http_request_header_count(const duet_http_request_t *req);
void duet_http_request_header_at(const duet_http_request_t *req, size_t i, const char **name_p,
                                 const char **value_p);
/* What duet_http_request_bearer found. */
typedef enum {
    DUET_HTTP_AUTH_OK = 0,  /* "Authorization: Bearer <token>" with the expected token */
    DUET_HTTP_AUTH_MISSING, /* no Authorization header */
    DUET_HTTP_AUTH_INVALID, /* another scheme, or another token */
} duet_http_auth_t;

/*
 * Check the request's "Authorization: Bearer <token>" (scheme case-insensitive, blanks around the
 * token ignored) against `token` (len bytes). The comparison takes time that depends only on
 * len, not on where a wrong token differs.
 */
duet_http_auth_t duet_http_request_bearer(const duet_http_request_t *req, const char *token,
                                          size_t len);
/* The complete body (de-chunked), NUL-terminated for convenience; *len_p gets its length. */
const char *duet_http_request_body(const duet_http_request_t *req, size_t *len_p);
/* The client's address as "ip:port" ("[v6]:port"). */
const char *duet_http_request_peer(const duet_http_request_t *req);
/* HTTP minor version: 0 for HTTP/1.0, 1 for HTTP/1.1. */
int duet_http_request_version_minor(const duet_http_request_t *req);
/* A server-unique id (1, 2, ...), for logs. */
uint64_t duet_http_request_id(const duet_http_request_t *req);
/* One application pointer per request (NULL until set), e.g. found again in on_abort. */
void duet_http_request_set_data(duet_http_request_t *req, void *data);
void *duet_http_request_get_data(const duet_http_request_t *req);
/* True once the request is aborted (its response calls are no-ops). */
bool duet_http_request_aborted(const duet_http_request_t *req);

/* Drop the application's reference (exactly once per on_request). See the file comment. */
void duet_http_request_release(duet_http_request_t *req);

/* ------------------------------------------------------------------ responding */

/*
 * Answer with a whole response: status (100..599), content_type (NULL = none), n_headers extra
 * headers, and len body bytes (copied; omitted for HEAD requests, 204 and 304). The server adds
 * Content-Length and Connection. DUET_ERR_CANCELLED after an abort; DUET_ERR_INVALID when a
 * response was already started or an argument is bad (CR/LF in a header, status out of range).
 */
duet_status_t duet_http_respond(duet_http_request_t *req, int status, const char *content_type,
                                const duet_http_header_t *headers, size_t n_headers,
                                const void *body, size_t len);

/*
 * Start a streamed response: status line and headers now, then chunks. HTTP/1.1 clients get
 * "Transfer-Encoding: chunked"; HTTP/1.0 clients get the raw bytes and the connection closes at
 * the end. A HEAD request gets the head only: the writes and the end send no body bytes. Errors
 * as duet_http_respond.
 */
duet_status_t duet_http_stream_begin(duet_http_request_t *req, int status, const char *content_type,
                                     const duet_http_header_t *headers, size_t n_headers);

/*
 * Send len bytes as one chunk (len 0 is a no-op). DUET_ERR_NO_SPACE when the connection's unsent
 * bytes would exceed max_output_bytes (the client is not reading): the request is aborted (the
 * connection is cut and on_abort follows). DUET_ERR_CANCELLED after an abort, DUET_ERR_INVALID
 * when no stream was begun or it already ended.
 */
duet_status_t duet_http_stream_write(duet_http_request_t *req, const void *data, size_t len);

/* End the stream (terminating chunk). Errors as duet_http_stream_write. */
duet_status_t duet_http_stream_end(duet_http_request_t *req);

/*
 * Server-Sent Events: begin a 200 stream with "Content-Type: text/event-stream",
 * "Cache-Control: no-cache" and the extra headers; then each event is "data: <data>\n\n" in one
 * chunk. `data` must not contain a newline (DUET_ERR_INVALID): one event = one data line, which
 * is what the OpenAI streaming format uses. End with duet_http_stream_end.
 */
duet_status_t duet_http_sse_begin(duet_http_request_t *req, const duet_http_header_t *headers,
                                  size_t n_headers);
duet_status_t duet_http_sse_event(duet_http_request_t *req, const char *data, size_t len);

/* Reason phrase of a status code ("Not Found"); "Unknown" for codes we do not name. */
const char *duet_http_status_reason(int status);

#endif
