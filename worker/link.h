/*
 * A worker's connection to the router (docs/architecture.md, "The wire"): TCP on the worker's libuv
 * loop, frames of proto/frame.h. Shared by duet-ctx and duet-gen.
 *
 * duet_link_open() connects (retrying while the router is not up yet, up to a timeout), sends
 * Register, waits for RegisterAck (a refusal comes back as DUET_ERR_UNSUPPORTED with the router's
 * reason), and only then joins the loop: from there on every Envelope the router sends is given
 * to on_message (the callee may read it during the call only) and a closed or broken connection
 * to on_closed, once.
 *
 * Sending never blocks and never allocates per message: frames are appended to a pending buffer
 * that goes out in one write when the previous write completed; both buffers are reused.
 */
#ifndef DUET_WORKER_LINK_H
#define DUET_WORKER_LINK_H

#include <stdint.h>

#include <uv.h>

#include "common/status.h"
#include "proto/frame.h"

typedef struct duet_link duet_link_t;

typedef void (*duet_link_message_cb)(const Duet__Envelope *env, void *user);
typedef void (*duet_link_closed_cb)(const char *reason, void *user);

typedef struct {
    const char *router;          /* "HOST:PORT" of the router's worker port */
    uint32_t connect_timeout_ms; /* keep retrying the connect this long */
    const Duet__Register *reg;   /* sent first; reg->version is filled in */
    duet_link_message_cb on_message;
    duet_link_closed_cb on_closed;
    void *user;
} duet_link_opts_t;

/*
 * Connect, register and join `loop`. *worker_id_p = the router's id for this worker;
 * duet_link_router_timeout_ms() then says how long the router waits for a heartbeat.
 * DUET_ERR_INVALID (bad address), DUET_ERR_TIMEOUT (no router within the timeout),
 * DUET_ERR_UNSUPPORTED (the router refused: the detail carries its reason), DUET_ERR_IO.
 */
duet_status_t duet_link_open(uv_loop_t *loop, const duet_link_opts_t *opts, duet_link_t **link_p,
                             uint64_t *worker_id_p);

/* The router's heartbeat timeout from its RegisterAck (0 when it did not say). */
uint32_t duet_link_router_timeout_ms(const duet_link_t *link);

/* Queue `env` (version set here). DUET_ERR_IO once the link is closed. */
duet_status_t duet_link_send(duet_link_t *link, Duet__Envelope *env);

/* Bytes queued and not yet written (for tests and back-pressure checks). */
size_t duet_link_pending(const duet_link_t *link);

/*
 * Flush what is queued (bounded by timeout_ms, running the loop), then close; on_closed is not
 * called for a close asked for here. The link is freed once its handle closed. Accepts NULL.
 */
void duet_link_close(duet_link_t *link, uint32_t flush_timeout_ms);

#endif
