/*
 * One HTTP/1.1 request as a non-blocking state machine, for `duet up`'s health checks and its
 * sample completion.
 *
 * Why not a blocking client: while a request waits, the launcher must keep reading its
 * children's output pipes; a child blocked on a full pipe could be the very process the request
 * waits for. So the caller polls duet_hreq_fd() for duet_hreq_events() together with the pipes
 * and calls duet_hreq_step() when it is ready. Timeouts are the caller's (destroy the request).
 *
 * The request is sent with "Connection: close"; the response ends at Content-Length or at end
 * of file, and a chunked body is decoded. Responses over 4 MiB are refused.
 */
#ifndef DUET_DEPLOY_LAUNCHER_HREQ_H
#define DUET_DEPLOY_LAUNCHER_HREQ_H

#include <stdbool.h>
#include <stddef.h>

#include "common/status.h"

typedef struct duet_hreq duet_hreq_t;

/*
 * Start `method path` to host:port (a numeric address or a name) with an optional JSON body
 * (NULL = none). The connection is opened non-blocking. DUET_ERR_IO / DUET_ERR_NOT_FOUND (name
 * does not resolve) / DUET_ERR_NOMEM, with a detail naming host:port.
 */
duet_status_t duet_hreq_start(const char *host, int port, const char *method, const char *path,
                              const char *body, duet_hreq_t **req_p);

/* The socket to poll, and the events (POLLOUT while sending, POLLIN while receiving). */
int duet_hreq_fd(const duet_hreq_t *req);
short duet_hreq_events(const duet_hreq_t *req);

/*
 * Make progress after the socket was ready. DUET_ERR_BUSY: not done yet, poll again.
 * DUET_OK: the response is complete (duet_hreq_status, duet_hreq_body). Anything else: the
 * request failed (connection refused or reset, malformed response); the detail says why.
 */
duet_status_t duet_hreq_step(duet_hreq_t *req);

/* The response's status code and body (NUL-terminated, owned by req); valid after DUET_OK. */
int duet_hreq_status(const duet_hreq_t *req);
const char *duet_hreq_body(const duet_hreq_t *req, size_t *len_p);

/* Close and free. Accepts NULL. */
void duet_hreq_destroy(duet_hreq_t *req);

/*
 * Whether something accepts TCP connections on host:port within timeout_ms (a blocking probe,
 * for start-up checks where nothing else needs the time).
 */
bool duet_hreq_port_open(const char *host, int port, int timeout_ms);

#endif
