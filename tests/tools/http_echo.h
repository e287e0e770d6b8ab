/*
 * duet-http-echo's application: a handful of endpoints over router/http/http.h, for the HTTP
 * server's tests and benchmarks (not part of the router).
 *
 *   GET  /health                 200 "ok\n"
 *   ANY  /echo                   200 with the request body; headers X-Method, X-Query, and
 *                                X-Test-Echo (the request's X-Test header, looked up in lower case)
 *   GET  /slow?ms=N              200 "slow N\n" after an N ms timer
 *   GET  /stream?n=K&ms=M&size=S SSE: K events "data: <i>xxx..." (padded to S bytes), one every
 *                                M ms (M = 0: all at once), then the end of the stream
 *   GET  /release                released unanswered (the server answers 500)
 *   else                         404
 * Counters are atomics so a test thread may read them while the loop thread runs.
 */
#ifndef DUET_TESTS_TOOLS_HTTP_ECHO_H
#define DUET_TESTS_TOOLS_HTTP_ECHO_H

#include <stdatomic.h>
#include <stdint.h>
#include <uv.h>

#include "router/http/http.h"

typedef struct {
    uv_loop_t *loop;            /* not owned */
    atomic_ullong requests;     /* on_request calls */
    atomic_ullong aborts;       /* on_abort calls */
    atomic_ullong active;       /* requests answered asynchronously and not yet released */
    atomic_ullong double_abort; /* on_abort for a request already aborted: must stay 0 */
} duet_http_echo_t;

/* Zero the counters and remember the loop the timers run on. */
void duet_http_echo_init(duet_http_echo_t *app, uv_loop_t *loop);

/* The callbacks to put in duet_http_options_t (user = the duet_http_echo_t). */
void duet_http_echo_on_request(duet_http_request_t *req, void *user);
void duet_http_echo_on_abort(duet_http_request_t *req, void *user);

/* Path classes for the requests counter: the endpoints above, else "other". */
const char *duet_http_echo_path_class(const char *path, void *user);

#endif
