/*
 * Internals of the HTTP server (router/http/http.c): the connection and request structs, and a
 * test seam. Only http.c reads the structs; it is a separate header so the layout and the
 * ownership rules read in one place. The seam (at the end) is for the fuzz targets and the unit
 * test that runs the server's request parsing without sockets.
 *
 * Lifetimes.
 *  - A connection (http_conn_t) owns a TCP handle and a timer; it is freed in the close callback
 *    of the last of the two (conn_on_handle_close), never earlier, so any libuv callback that
 *    still fires (write, shutdown, read) finds it alive; such callbacks test `closing` first.
 *  - A request has two owners, each a flag: `in_conn` (it sits in its connection's response
 *    queue) and `app_held` (the application has not released it). It is freed when both are
 *    false, by whichever side drops the last one. `conn` is NULL once the request left its
 *    connection (answered and flushed, or its connection closed).
 *  - on_abort runs only from the connection's close callback, so it never re-enters the
 *    application while the application is inside one of our calls.
 */
#ifndef DUET_ROUTER_HTTP_IMPL_H
#define DUET_ROUTER_HTTP_IMPL_H

#include <http_parser.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "common/metrics.h"
#include "common/strbuf.h"
#include "router/http/http.h"

typedef struct duet__http_link {
    struct duet__http_link *prev, *next;
} duet__http_link_t;

typedef struct http_conn http_conn_t;

/* Offsets of one header's name and value inside duet_http_request_t.text. */
typedef struct {
    uint32_t name;
    uint32_t value;
} http_hdr_off_t;

struct duet_http_request {
    duet_http_request_t *next; /* response queue of the connection; owned by it */
    http_conn_t *conn;         /* NULL once the request left its connection */
    uint64_t id;
    void *data; /* the application's pointer */

    /* Parsed request. text holds "url\0name\0value\0...name\0value\0path\0query\0". */
    char *text; /* heap, owned */
    size_t text_len, text_cap;
    http_hdr_off_t *hdrs; /* heap, owned, n_hdrs used of cap_hdrs */
    size_t n_hdrs, cap_hdrs;
    size_t url_len;
    uint32_t path_off, query_off;
    char *body; /* heap, owned, NUL-terminated once complete; NULL when empty */
    size_t body_len, body_cap;
    const char *method; /* static (http_method_str) or "unknown" */
    int minor;
    char peer[64];

    /* Response. out buffers the bytes of a response that is not yet at the queue head. */
    char *out; /* heap, owned */
    size_t out_len, out_cap;
    int status;
    bool internal;    /* an error response made by the server, never shown to the app */
    bool is_head;     /* HEAD: no body bytes in the response */
    bool keep_alive;  /* what the request asked for (http_should_keep_alive) */
    bool close_after; /* the connection closes after this response */
    bool started;     /* status line emitted */
    bool streaming;
    bool chunked;
    bool ended; /* last byte emitted (maybe still buffered in out) */
    bool aborted;
    bool abort_notified;
    bool app_held;
    bool in_conn;
};

typedef enum {
    HTTP_RD_PARSE = 0, /* bytes go to the parser */
    HTTP_RD_DISCARD,   /* no more requests on this connection: bytes are dropped */
    HTTP_RD_LINGER,    /* our FIN is sent: drop bytes until the client's EOF or the timer */
} http_rd_mode_t;

typedef enum {
    HTTP_MSG_NONE = 0, /* between requests */
    HTTP_MSG_HEADERS,
    HTTP_MSG_BODY,
} http_msg_state_t;

typedef enum {
    HTTP_TIMER_NONE = 0,
    HTTP_TIMER_HEADER,
    HTTP_TIMER_BODY,
    HTTP_TIMER_IDLE,
    HTTP_TIMER_FLUSH,  /* waiting for our last writes before the FIN */
    HTTP_TIMER_LINGER, /* after the FIN */
} http_timer_kind_t;

typedef enum {
    HTTP_HS_URL = 0,
    HTTP_HS_FIELD,
    HTTP_HS_VALUE,
} http_hdr_state_t;

struct http_conn {
    uv_tcp_t tcp;
    uv_timer_t timer;
    uv_shutdown_t shutdown_req;
    http_parser parser;
    duet_http_server_t *srv;
    duet__http_link_t link;        /* srv->conns */
    duet__http_link_t resume_link; /* srv->resume while resume_queued */

    duet_http_request_t *cur;    /* being parsed, not yet queued; owned */
    duet_http_request_t *q_head; /* response queue, oldest first */
    duet_http_request_t *q_tail;
    size_t q_len;
    char *pend; /* heap, owned: unparsed bytes held while the queue is full */
    size_t pend_len;

    http_msg_state_t msg_state;
    http_hdr_state_t hdr_state;
    size_t hdr_bytes; /* request line + headers of cur so far */
    int err_status;   /* set by a parser callback before it fails the parse */
    bool te_bad;      /* cur named a transfer coding we do not support */
    uint64_t msg_deadline;

    http_rd_mode_t rd_mode;
    http_timer_kind_t timer_kind;
    uint64_t timer_deadline;
    size_t out_bytes; /* unsent: pending uv_writes + bytes buffered in queued requests + cork */
    /* bytes for the socket held to the end of the loop turn (srv->corked): what one turn's
     * callbacks write to a connection (a burst of stream chunks) goes out in one syscall */
    char *cork; /* heap, owned */
    size_t cork_len, cork_cap;
    duet__http_link_t cork_link; /* srv->corked while cork_len > 0 */
    int handles_open;

    bool reading;
    bool paused;     /* parser paused because the queue is full; reading stopped */
    bool want_close; /* no more requests will be parsed; close when the queue drains */
    bool shutting;   /* uv_shutdown issued */
    bool eof;        /* the client sent its FIN */
    bool closing;    /* uv_close issued */
    bool rejected;   /* over max_connections: 503 and close */
    bool resume_queued;
    char peer[64];
};

/* ------------------------------------------------------------------ test seam */

/*
 * A server with no listener and exactly one connection, which has no socket: its reads come from
 * duet__http_server_feed and every byte it writes is appended to `out` at once (so the whole
 * response stream is in `out`, in order). Everything else is the real server: the parser and its
 * limits, the response queue, pipelining, pausing at max_pipeline, error answers, timers (run the
 * loop to fire them), on_request / on_abort. Shutting the write side down is not possible without
 * a socket, so where the server would send its FIN and linger the connection closes at once.
 * Close it with duet_http_server_close as any server. Options as duet_http_server_start (host and
 * port are not used); DUET_ERR_INVALID for a missing `out`.
 */
duet_status_t duet__http_server_start_fake(uv_loop_t *loop, const duet_http_options_t *opts,
                                           duet_strbuf_t *out, duet_http_server_t **srv_p);

/*
 * Hand len bytes to the fake server's connection as one read from its socket; len 0 is the
 * client's EOF. Returns false (and takes nothing) when the connection is not reading: paused at
 * max_pipeline until responses go out, after an EOF, or closed.
 */
bool duet__http_server_feed(duet_http_server_t *srv, const char *data, size_t len);

#endif
