/*
 * The router's admin API (docs/architecture.md, "Admission, placement, drain, admin API, metrics"):
 * a second HTTP listener, loopback by default, on which operators (usually through duetctl) list
 * workers, drain and undrain them, and pause, resume or re-size admission. Every request must carry
 * "Authorization: Bearer <token>"; the token is compared in constant time. Starting without a token
 * is refused unless the caller says insecure_no_token explicitly (--admin.insecure-no-token).
 *
 * Endpoints (all JSON; errors are {"error": {"code": <status>, "message": "..."}}):
 *   GET  /admin/workers                   {"workers": [{"id", "name", "role", "state",
 *                                          "address", "device", "dtype", "uptime_s",
 *                                          "heartbeat_age_ms", "utilisation", "metrics_port",
 *                                          "load": {"free_pages", "kv_pages",
 *                                          "free_state_slots", "state_slots", "running",
 *                                          "queued", "prefix_pages", "prefix_entries"}}]}
 *   POST /admin/workers/{name}/drain      {"worker", "state": "draining", "idle": bool}
 *        ?wait=1[&timeout_s=S]            answer only once the worker has no running requests
 *                                         (200, "idle": true), or 504 after S seconds (default
 *                                         drain_wait_timeout_ms; the worker stays draining)
 *        ?migrate=1                       a generation worker's running requests move to other
 *                                         generation workers instead of finishing there
 *                                         ("migrate": true in the answer; 409 for a ctx worker)
 *   POST /admin/workers/{name}/undrain    {"worker", "state": "live"}
 *   GET  /admin/admission                 {"paused", "has_capacity", "in_flight", "queued",
 *                                          "max_inflight", "max_queue", "worker_slots" (the
 *                                          live generation workers' batch.max_seqs summed),
 *                                          "limit" (in flight at most: the smaller of the two
 *                                          above, worker_slots 0 aside), "admitted_total",
 *                                          "queued_total", "cancelled_total",
 *                                          "requeued_total",
 *                                          "rejected_total": {"queue_full", "paused", ...}}
 *   POST /admin/admission/pause           the admission object after the change
 *   POST /admin/admission/resume          same
 *   POST /admin/admission                 body {"max_inflight": N, "max_queue": N} (either or
 *                                         both; no other keys); the admission object
 *   GET  /admin/log-level                 {"level": "info"}: the router's log level
 *   POST /admin/log-level                 body {"level": "debug"}: set it now, on the router and
 *                                         (ops->log_level_changed) its live workers;
 *                                         {"level", "previous", "workers": <how many told>}
 * Status codes: 401 missing/wrong token (with WWW-Authenticate: Bearer), 404 unknown path or
 * worker, 405 wrong method (with Allow), 400 bad JSON or values, 409 when the router refuses the
 * operation in the worker's state (e.g. drain of a dead worker), 503 while the admin API shuts
 * down.
 *
 * The admin module knows nothing of the registry: the router passes an ops table. Everything
 * runs on the router's loop thread, ops included.
 */
#ifndef DUET_ROUTER_ADMIN_H
#define DUET_ROUTER_ADMIN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "common/config.h"
#include "common/log.h"
#include "common/status.h"
#include "common/strbuf.h"
#include "router/cluster/admission.h"

typedef struct duet_admin duet_admin_t;

#define DUET_ADMIN_DEFAULT_PORT 8081

typedef enum {
    DUET_ADMIN_WORKER_LIVE = 0,
    DUET_ADMIN_WORKER_DRAINING = 1,
    DUET_ADMIN_WORKER_DEAD = 2,
} duet_admin_worker_state_t;

/* "live", "draining", "dead". */
const char *duet_admin_worker_state_name(duet_admin_worker_state_t state);

/* One worker as the admin API shows it; strings are borrowed for the duration of the visit. */
typedef struct {
    uint64_t id;
    const char *name; /* unique, e.g. "gen-0" */
    const char *role; /* "gen" or "ctx" */
    duet_admin_worker_state_t state;
    int64_t free_pages;                    /* from the last heartbeat */
    int64_t kv_pages;                      /* the pool's pages (Register) */
    int64_t free_state_slots, state_slots; /* KDA state pool, from the last heartbeat */
    int64_t running;
    int64_t queued;
    int64_t prefix_pages, prefix_entries; /* its prefix cache (cache.prefix): pages held, entries */
    /* for `duetctl status` (0 / NULL when the worker did not say: Register fields 7-10) */
    const char *address;      /* "ip:port" its connection to the router came from */
    const char *device;       /* "cpu", "cuda" */
    const char *dtype;        /* "f32", "bf16" */
    int64_t uptime_s;         /* since the worker process started (else since it registered) */
    int64_t heartbeat_age_ms; /* since its last heartbeat */
    double utilisation;       /* 0..1: time in forward steps over wall time, last heartbeat */
    int64_t metrics_port;     /* its /metrics port, 0 = none */
} duet_admin_worker_info_t;

typedef void (*duet_admin_worker_visit_cb)(const duet_admin_worker_info_t *info, void *visit_user);

/*
 * A drain with wait finished: DUET_OK when the worker has no running requests any more, or an
 * error when it never will (DUET_ERR_CANCELLED: undrained; DUET_ERR_TRANSPORT: the worker died;
 * the admin answers 409 with duet_error_last()-style detail from `detail`, may be NULL).
 */
typedef void (*duet_admin_drain_done_cb)(void *done_user, duet_status_t st, const char *detail);

/*
 * What the router provides. `ctx` is passed to every op. Status returns: DUET_ERR_NOT_FOUND for
 * an unknown worker (404), any other error is 409 with duet_error_last() as the message.
 */
typedef struct {
    /* Call visit once per known worker, in a stable order. Required. */
    void (*list_workers)(void *ctx, duet_admin_worker_visit_cb visit, void *visit_user);
    /*
     * Mark the worker draining (idempotent). When done_cb is not NULL the caller waits: the
     * router calls done_cb(done_user, ...) exactly once later, or from inside drain when the
     * worker is already idle, unless drain_forget(ctx, done_user) is called first. When drain
     * fails, done_cb is never called. migrate: also move the worker's running requests to other
     * generation workers (an error for a worker that is not a generation worker). Required.
     */
    duet_status_t (*drain)(void *ctx, const char *name, bool migrate,
                           duet_admin_drain_done_cb done_cb, void *done_user);
    /* The admin gives up waiting (timeout, client gone, shutdown): never call done_cb for
     * done_user after this returns. Required. */
    void (*drain_forget)(void *ctx, void *done_user);
    /* Back to live (idempotent). Required. */
    duet_status_t (*undrain)(void *ctx, const char *name);
    /*
     * Admission was resumed or its limits changed: queued requests may be able to run now (the
     * router runs its duet_admission_pop_ready loop). Optional.
     */
    void (*admission_changed)(void *ctx);
    /* The process's log level was set to `level` (POST /admin/log-level): pass it on to the
     * workers; returns how many were told. Optional. */
    size_t (*log_level_changed)(void *ctx, duet_log_level_t level);
} duet_admin_ops_t;

typedef struct {
    const char *host;               /* bind address, default "127.0.0.1" */
    uint16_t port;                  /* default DUET_ADMIN_DEFAULT_PORT; 0 = ephemeral */
    const char *token;              /* bearer token (copied); NULL or "" needs insecure_no_token */
    bool insecure_no_token;         /* accept every request without a token (testing only) */
    uint32_t drain_wait_timeout_ms; /* default wait for ?wait=1, default 60 s */
    uint32_t max_drain_wait_timeout_ms; /* cap on ?timeout_s, default 1 h */

    const duet_admin_ops_t *ops; /* required; must outlive the admin */
    void *ops_ctx;
    duet_admission_t *admission; /* required; not owned, must outlive the admin */
} duet_admin_options_t;

void duet_admin_options_default(duet_admin_options_t *opts);

/*
 * Start the admin API on `loop`. DUET_ERR_INVALID (with a clear detail) when the token is empty
 * without insecure_no_token, or a required op / the admission handle is missing; DUET_ERR_IO when
 * the address cannot be bound.
 */
duet_status_t duet_admin_start(uv_loop_t *loop, const duet_admin_options_t *opts,
                               duet_admin_t **admin_p);

/* The bound port. */
uint16_t duet_admin_port(const duet_admin_t *admin);

/*
 * The admin file: where `duet up` leaves its router's admin URL and token so that a plain
 * `duetctl status` on the same machine reaches it (docs/observability.md). Two lines,
 * "url=http://HOST:PORT" and "token=TOKEN", mode 0600.
 *
 * duet_admin_file_path: $DUET_ADMIN_FILE, else $HOME/.duet/admin; false when neither is set.
 * duet_admin_file_write: write it (its folder made 0700 when missing), replacing what was there.
 * duet_admin_file_read: url and token from it ("" for a line that is absent); DUET_ERR_IO when it
 * cannot be read, DUET_ERR_FORMAT (with detail) for a line that is neither, a value with a
 * control character or one too long for its buffer, or a file over 4 KiB.
 */
bool duet_admin_file_path(char *out, size_t cap);
duet_status_t duet_admin_file_write(const char *path, const char *url, const char *token);
duet_status_t duet_admin_file_read(const char *path, char *url, size_t url_cap, char *token,
                                   size_t token_cap);

/*
 * Stop: waiting drains are answered 503 (and forgotten with drain_forget), the listener closes
 * gracefully, and cb(user) runs once every handle is closed and the admin is freed.
 */
void duet_admin_close(duet_admin_t *admin, void (*cb)(void *user), void *user);

/*
 * Config keys for the router's table, to splice into its duet_config_key_t array: admin.host,
 * admin.port, admin.token (secret; env DUET_ADMIN_TOKEN), admin.insecure_no_token (flag
 * --admin.insecure-no-token), admin.drain_wait_timeout_s.
 */
#define DUET_ADMIN_CONFIG_KEYS                                                                     \
    {.name = "admin.host",                                                                         \
     .type = DUET_CONFIG_STRING,                                                                   \
     .def = "127.0.0.1",                                                                           \
     .help = "admin API bind address (keep it on loopback)"},                                      \
        {.name = "admin.port",                                                                     \
         .type = DUET_CONFIG_INT,                                                                  \
         .def = "8081",                                                                            \
         .help = "admin API port",                                                                 \
         .min = "0",                                                                               \
         .max = "65535"},                                                                          \
        {.name = "admin.token",                                                                    \
         .type = DUET_CONFIG_STRING,                                                               \
         .def = "",                                                                                \
         .help = "bearer token the admin API requires",                                            \
         .secret = true},                                                                          \
        {.name = "admin.insecure_no_token",                                                        \
         .type = DUET_CONFIG_BOOL,                                                                 \
         .def = "false",                                                                           \
         .help = "run the admin API without a token (testing only)"},                              \
    {                                                                                              \
        .name = "admin.drain_wait_timeout_s", .type = DUET_CONFIG_INT, .def = "60",                \
        .help = "how long drain --wait waits by default", .min = "1", .max = "3600"                \
    }

/*
 * Fill opts' host, port, token, insecure_no_token and drain_wait_timeout_ms from a configuration
 * declared with DUET_ADMIN_CONFIG_KEYS (strings stay owned by cfg). Other fields are untouched.
 */
void duet_admin_options_from_config(duet_admin_options_t *opts, const duet_config_t *cfg);

/*
 * Test seam (the fuzz target fuzz/fuzz_admin.c and its unit test): the admin API on the HTTP
 * server's socketless fake (router/http/http_impl.h, duet__http_server_start_fake): one client
 * connection whose bytes come from duet__admin_feed (len 0 = the client's EOF; false when the
 * connection does not read) and whose responses are appended to `out`. Otherwise exactly
 * duet_admin_start: the same checks, routes, ops and waiters; close it with duet_admin_close.
 */
duet_status_t duet__admin_start_fake(uv_loop_t *loop, const duet_admin_options_t *opts,
                                     duet_strbuf_t *out, duet_admin_t **admin_p);
bool duet__admin_feed(duet_admin_t *admin, const char *data, size_t len);

#endif
