/*
 * Admission control for the router: how many requests run at once, how many may wait, and who
 * is told "no" and with which status (docs/architecture.md: the router never queues unboundedly).
 *
 * Model. A request is an opaque, non-NULL handle chosen by the caller (its request context).
 * duet_admission_try_admit gives one of five verdicts:
 *   ADMIT               run it now; call duet_admission_release when it ends, however it ends.
 *   QUEUED              admission holds it in a FIFO queue until one of: it is handed back to run
 *                       (duet_admission_release / duet_admission_pop_ready), its deadline passes
 *                       (duet_admission_expire), or the caller withdraws it
 * (duet_admission_cancel). Exactly one of these ends its stay in the queue. REJECT_FULL         the
 * queue is full: answer 429 with Retry-After (result.retry_after_s). REJECT_PAUSED       an
 * operator paused admission: answer 503 with Retry-After. REJECT_NO_CAPACITY  no live generation
 * worker exists: answer 503 with Retry-After at once instead of queueing a request nobody can
 * serve. A rejected request is not remembered; nothing more is owed for it.
 *
 * Expired queued requests are answered with 503 (DUET_ADMISSION_EXPIRED_HTTP_STATUS), not 504: the
 * request was never started, so it is safe to retry, and the cause is overload, which is what 503
 * + Retry-After says. 504 would suggest an upstream worker took the request and then hung.
 *
 * Promotion. A queued request runs when in_flight is below the limit, admission is not paused,
 * generation capacity exists and no hold is on (duet_admission_requeue). The limit is max_inflight,
 * or the number of requests the live generation workers hold at once
 * (duet_admission_set_worker_slots) when that is smaller: a request past what the workers hold
 * would only be refused there, so it waits here instead. The workers can still be fuller than that
 * count says (a slot held past its request's end); a request they all refuse goes back to the head
 * of the queue (duet_admission_requeue) and a hold stops promotions until the workers' retry hint
 * has passed or a running request ends. The queue is FIFO, and a new request takes a free slot at
 * once only when no queued request that may still run is ahead of it; a queued request whose
 * deadline has passed is never handed out to run (it is skipped and left for
 * duet_admission_expire), so the caller should expire before promoting, e.g. from one timer armed
 * at duet_admission_next_deadline. After duet_admission_resume, duet_admission_set_limits,
 * duet_admission_set_capacity(true), more worker slots or the end of a hold (a periodic timer sees
 * it) several queued requests may become runnable at once: call duet_admission_pop_ready in a loop.
 *
 * Limits change at run time. Lowering max_inflight below the current in-flight count never
 * touches running requests: promotions simply stop until enough of them end. Lowering max_queue
 * below the current queue length keeps every queued request; new ones are refused until the
 * queue is shorter than the limit.
 *
 * Threads and cost. Single-threaded: every call from the router's loop thread. No allocation
 * except when set_limits raises max_queue (the node pool grows then). Cancel is a linear search
 * of the queue, and expire a linear walk, both bounded by max_queue.
 *
 * Metrics (when options.metrics is set), registered in duet_admission_create:
 *   duet_router_inflight                          gauge
 *   duet_router_queue_depth                       gauge
 *   duet_router_admission_admitted_total          counter: requests that started running
 *   duet_router_admission_rejected_total{reason}  counter: queue_full, paused, no_capacity, expired
 *   duet_router_admission_cancelled_total         counter: queued requests withdrawn by the caller
 *   duet_router_admission_requeued_total          counter: running requests sent back (requeue)
 */
#ifndef DUET_ROUTER_ADMISSION_H
#define DUET_ROUTER_ADMISSION_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/config.h"
#include "common/metrics.h"
#include "common/status.h"

typedef struct duet_admission duet_admission_t;

/* Upper bounds accepted by create and set_limits. */
#define DUET_ADMISSION_MAX_INFLIGHT 1000000u
#define DUET_ADMISSION_MAX_QUEUE    1000000u

/* HTTP status for each rejection (see the file comment for why expiry is 503). */
#define DUET_ADMISSION_FULL_HTTP_STATUS        429
#define DUET_ADMISSION_PAUSED_HTTP_STATUS      503
#define DUET_ADMISSION_NO_CAPACITY_HTTP_STATUS 503
#define DUET_ADMISSION_EXPIRED_HTTP_STATUS     503

typedef enum {
    DUET_ADMISSION_ADMIT = 0,
    DUET_ADMISSION_QUEUED = 1,
    DUET_ADMISSION_REJECT_FULL = 2,
    DUET_ADMISSION_REJECT_PAUSED = 3,
    DUET_ADMISSION_REJECT_NO_CAPACITY = 4,
} duet_admission_verdict_t;

/* Rejection reasons, as counted and exported (label values of the rejected counter). */
typedef enum {
    DUET_ADMISSION_REASON_QUEUE_FULL = 0,
    DUET_ADMISSION_REASON_PAUSED = 1,
    DUET_ADMISSION_REASON_NO_CAPACITY = 2,
    DUET_ADMISSION_REASON_EXPIRED = 3,
    DUET_ADMISSION_REASON_COUNT = 4,
} duet_admission_reason_t;

typedef struct {
    duet_admission_verdict_t verdict;
    int http_status;        /* 0 for ADMIT / QUEUED, else 429 or 503 */
    uint32_t retry_after_s; /* REJECT_*: value for the Retry-After header, >= 1; 0 otherwise */
} duet_admission_result_t;

typedef struct {
    uint32_t max_inflight;         /* requests running at once, 1..DUET_ADMISSION_MAX_INFLIGHT */
    uint32_t max_queue;            /* requests waiting, 0..DUET_ADMISSION_MAX_QUEUE (0: no queue) */
    bool has_capacity;             /* initial "a live generation worker exists" */
    uint32_t paused_retry_after_s; /* Retry-After for paused / no capacity / expired, >= 1 */
    uint32_t max_retry_after_s;    /* cap on the queue-full estimate, >= 1 */
    duet_metrics_t *metrics;       /* optional registry for the metrics above; not owned */
} duet_admission_options_t;

/*
 * Defaults: 64 in flight, 256 queued, has_capacity = false (the router reports capacity once a
 * generation worker registers, so a router without workers answers 503 at once instead of
 * queueing), Retry-After 5 s when paused, queue-full estimate capped at 60 s, no metrics.
 */
void duet_admission_options_default(duet_admission_options_t *opts);

/*
 * Create an admission controller. DUET_ERR_RANGE (with detail) for limits out of range,
 * DUET_ERR_INVALID when metric registration fails (e.g. the families already exist in that
 * registry), DUET_ERR_NOMEM.
 */
duet_status_t duet_admission_create(const duet_admission_options_t *opts, duet_admission_t **adm_p);

/* Free it. Queued handles are forgotten (the caller owns them). Accepts NULL. */
void duet_admission_destroy(duet_admission_t *adm);

/*
 * Decide on a new request `handle` (non-NULL, not currently queued) that arrived at now_ms and
 * may wait in the queue until deadline_ms (absolute, same clock; a deadline <= now_ms still
 * admits when a slot is free but is never queued: it is rejected as full). DUET_ERR_INVALID for a
 * NULL handle; otherwise DUET_OK and *res_p.
 */
duet_status_t duet_admission_try_admit(duet_admission_t *adm, void *handle, uint64_t now_ms,
                                       uint64_t deadline_ms, duet_admission_result_t *res_p);

/*
 * A running request ended (any outcome). If that frees a slot and a queued request may run, it
 * is moved to running and returned in *next_p (the caller starts it now) with true; else false
 * and *next_p = NULL. Releasing with nothing in flight is a programming error (asserted).
 */
bool duet_admission_release(duet_admission_t *adm, uint64_t now_ms, void **next_p);

/*
 * Hand out one more queued request that may run now (see Promotion above), moving it to
 * running: true and *handle_p; false and NULL when none may. Call in a loop after resume,
 * set_limits and set_capacity(true).
 */
bool duet_admission_pop_ready(duet_admission_t *adm, uint64_t now_ms, void **handle_p);

/*
 * Running request `handle` could not start after all: every generation worker refused it for
 * want of room. It leaves the running count and waits again at the head of the queue (it was
 * first in line) until deadline_ms; nothing is promoted, and no new request admitted past the
 * queue, before hold_until_ms unless a running request ends first (duet_admission_release),
 * since the workers have just said they are full. DUET_ERR_RANGE when the queue is full or
 * deadline_ms <= now_ms: nothing changes and the caller refuses the request. Requeueing a
 * request that is not running is a programming error.
 */
duet_status_t duet_admission_requeue(duet_admission_t *adm, void *handle, uint64_t now_ms,
                                     uint64_t deadline_ms, uint64_t hold_until_ms);

/* Called once per expired request, after it left the queue; may call back into admission. */
typedef void (*duet_admission_expired_cb)(void *handle, uint64_t waited_ms, void *user);

/*
 * Remove every queued request whose deadline is <= now_ms, in queue order, calling cb for each
 * (answer it with DUET_ADMISSION_EXPIRED_HTTP_STATUS). Returns how many expired.
 */
size_t duet_admission_expire(duet_admission_t *adm, uint64_t now_ms, duet_admission_expired_cb cb,
                             void *user);

/* The earliest deadline in the queue (to arm a timer): true and *deadline_p, false if empty. */
bool duet_admission_next_deadline(const duet_admission_t *adm, uint64_t *deadline_p);

/*
 * The client of a queued request went away: forget it. DUET_OK, or DUET_ERR_NOT_FOUND when
 * `handle` is not queued (already promoted, expired or never queued; nothing changes).
 */
duet_status_t duet_admission_cancel(duet_admission_t *adm, void *handle);

/* Operator pause: new requests get REJECT_PAUSED; queued ones wait (resume or deadline). */
void duet_admission_pause(duet_admission_t *adm);
void duet_admission_resume(duet_admission_t *adm);

/* Whether a live generation worker exists (the router reports every change). */
void duet_admission_set_capacity(duet_admission_t *adm, bool has_capacity);

/*
 * How many requests the live generation workers hold at once (the sum of their batch.max_seqs;
 * the router reports every change); 0: no bound beyond max_inflight. Lowering it never touches
 * running requests: promotions stop until enough of them end.
 */
void duet_admission_set_worker_slots(duet_admission_t *adm, uint32_t slots);

/*
 * New limits, effective at once (see the file comment). DUET_ERR_RANGE with detail for values
 * out of range, DUET_ERR_NOMEM when the queue cannot grow; the limits are unchanged then.
 */
duet_status_t duet_admission_set_limits(duet_admission_t *adm, uint32_t max_inflight,
                                        uint32_t max_queue);

typedef struct {
    uint32_t in_flight, queued;
    uint32_t max_inflight, max_queue;
    uint32_t worker_slots; /* as last set (0: none) */
    uint32_t limit;        /* in flight at most: max_inflight, or worker_slots when smaller */
    bool paused, has_capacity;
    uint64_t admitted_total; /* requests that started running (at once or from the queue) */
    uint64_t queued_total;   /* requests that entered the queue */
    uint64_t cancelled_total;
    uint64_t requeued_total; /* running requests sent back to the queue (requeue) */
    uint64_t hold_until_ms;  /* promotions wait until then (0: no hold) */
    uint64_t rejected_total[DUET_ADMISSION_REASON_COUNT];
} duet_admission_stats_t;

void duet_admission_stats(const duet_admission_t *adm, duet_admission_stats_t *stats_p);

/* "queue_full", "paused", "no_capacity", "expired". */
const char *duet_admission_reason_name(duet_admission_reason_t reason);

/* "admit", "queued", "reject_full", "reject_paused", "reject_no_capacity". */
const char *duet_admission_verdict_name(duet_admission_verdict_t verdict);

/*
 * Config keys for the router's table (see --help), to splice into its duet_config_key_t array:
 *   admission.max_inflight, admission.max_queue, admission.queue_timeout_ms (how long a request
 *   may wait in the queue: the caller's deadline_ms = now + this).
 */
#define DUET_ADMISSION_CONFIG_KEYS                                                                 \
    {.name = "admission.max_inflight",                                                             \
     .type = DUET_CONFIG_INT,                                                                      \
     .def = "64",                                                                                  \
     .help = "requests running at once (more wait in the queue)",                                  \
     .min = "1",                                                                                   \
     .max = "1000000"},                                                                            \
        {.name = "admission.max_queue",                                                            \
         .type = DUET_CONFIG_INT,                                                                  \
         .def = "256",                                                                             \
         .help = "requests waiting for a slot; more get 429 with Retry-After",                     \
         .min = "0",                                                                               \
         .max = "1000000"},                                                                        \
    {                                                                                              \
        .name = "admission.queue_timeout_ms", .type = DUET_CONFIG_INT, .def = "30000",             \
        .help = "longest wait in the admission queue before 503", .min = "1", .max = "3600000"     \
    }

#endif
