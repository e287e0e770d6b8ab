/*
 * The router's worker registry (docs/architecture.md, "The wire"): a libuv TCP listener on its own
 * port (not the HTTP one), where context and generation workers connect, register, heartbeat and
 * exchange the request-path messages with the router core.
 *
 * Connection life. A worker connects and must send Register within the heartbeat timeout. The
 * registry answers RegisterAck: refused (and the connection closed once the ack is written) when
 * Register.version differs from DUET_PROTO_VERSION, the role is neither ctx nor gen, or the
 * model fingerprint differs from the expected one; accepted with a fresh worker id otherwise.
 * Every later frame must carry Envelope.version == DUET_PROTO_VERSION. A frame that does not
 * decode, a wrong version, a second Register or a body a worker may not send closes that one
 * connection (logged with the peer address); nothing else is affected.
 *
 * Fingerprint policy. options.fingerprint is what a worker must present. The router computes it
 * from its model folder with duet_model_fingerprint() of common/fingerprint.h (sha256 of
 * config.json and the safetensors index or header, the same function a worker runs on its own
 * copy); NULL or ""
 * means "adopt the first accepted worker's fingerprint" (for a router that has no copy of the
 * model), after which every worker must match that one. duet_registry_fingerprint() tells which.
 *
 * Liveness. Only Heartbeat (and Register) refresh a worker's deadline; a worker that sends no
 * heartbeat for heartbeat_timeout_ms is marked dead and its connection closed. A closed or reset
 * connection and a Deregister also mark it dead. Either way on_worker_down runs exactly once per
 * accepted worker, from the loop, after the state changed: the router core owns the requests and
 * retries or fails the ones that were on that worker. Dead workers stay listed (state DEAD) for
 * the admin API until the table is full, when the oldest dead entry is reused.
 *
 * Drain. duet_registry_set_draining() sends Drain / Undrain and moves the worker between UP and
 * DRAINING; a worker's own Heartbeat.draining also shows as DRAINING. Placement never picks a
 * draining worker; messages for requests already on it keep flowing.
 *
 * Prefix summaries. A worker with a prefix cache lists in each Heartbeat the hash of every prefix
 * it keeps (common/prefix_hash.h, over blocks of prefix_page_tokens tokens; at most
 * DUET_PROTO_PREFIX_HASHES). The registry keeps the latest list per worker, replaced by every
 * heartbeat (one without hashes clears it). A list that is too long, or hashes with a block size
 * of 0 or above DUET_REGISTRY_PREFIX_PAGE_TOKENS_MAX, leave that worker with no summary (the
 * operator is told once per worker). duet_registry_prefix_cached() turns the summaries into the
 * candidates' cached_tokens for one prompt.
 *
 * Messages. Every other body from an accepted worker (Reserved, Refused, Tokens, ...) goes to
 * on_message(worker_id, env): the callee may read env only during the call (the registry frees it
 * after). duet_registry_send() frames and queues an Envelope to a worker.
 *
 * Threads: everything on the loop thread given to duet_registry_start.
 */
#ifndef DUET_ROUTER_REGISTRY_H
#define DUET_ROUTER_REGISTRY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "common/status.h"
#include "common/strbuf.h"
#include "proto/frame.h"
#include "router/cluster/placement.h"

#define DUET_REGISTRY_NAME_MAX               64  /* worker_name bytes kept (longer names are cut) */
#define DUET_REGISTRY_FINGERPRINT_MAX        128 /* longest fingerprint accepted */
#define DUET_REGISTRY_PREFIX_PAGE_TOKENS_MAX (1u << 20) /* largest summary block size accepted */
#define DUET_REGISTRY_PREFIX_CHAINS          4 /* distinct block sizes a prompt is hashed for */

typedef struct duet_registry duet_registry_t;

/* A worker's work counters, or their increments between two heartbeats (Heartbeat fields 6-15). */
typedef struct {
    uint64_t decode_steps, decode_seq_steps, decoded_tokens, prefill_tokens;
    uint64_t suspensions, resumes; /* gen: requests suspended to host memory / resumed */
    /* cache.prefix (Heartbeat fields 24-27): prompts looked up, those that hit, prompt tokens
     * not prefilled thanks to a hit, entries dropped */
    uint64_t prefix_lookups, prefix_hits, prefix_tokens_saved, prefix_evictions;
    double step_seconds;
    /* speculative decoding: spec_step_tokens[i] verify steps emitted i + 1 tokens; drafts
     * proposed / kept at draft position j + 1 (entries past a heartbeat's own count are 0) */
    uint64_t spec_step_tokens[DUET_PROTO_SPEC_POSITIONS + 1];
    uint64_t spec_drafted[DUET_PROTO_SPEC_POSITIONS];
    uint64_t spec_accepted[DUET_PROTO_SPEC_POSITIONS];
} duet_worker_stats_t;

/* A gen worker's cache plan, as its heartbeats report it (Heartbeat fields 16-20; all 0 until
 * the first heartbeat, and from a worker without one). The router exports the sums over live
 * generation workers as gauges. */
typedef struct {
    uint64_t budget_bytes;
    uint64_t target_pages, target_bytes;
    uint64_t draft_pages, draft_bytes;
} duet_worker_cache_plan_t;

/* A copy of one worker's state, for callbacks and the query API. */
typedef struct {
    uint64_t id; /* registry-assigned, 1, 2, ...; never reused */
    duet_worker_role_t role;
    duet_worker_state_t state;
    char name[DUET_REGISTRY_NAME_MAX];
    char peer[64];     /* "ip:port" of the connection */
    uint32_t kv_pages; /* capacity, from Register */
    uint32_t page_tokens;
    uint32_t max_seqs;
    uint32_t max_batch_tokens;
    uint32_t free_pages; /* load, from the last Heartbeat (kv_pages until the first) */
    uint32_t free_state_slots, state_slots; /* KDA state pool, from the last Heartbeat (0 until
                                               the first) */
    uint32_t running;
    uint32_t queued;
    uint64_t queued_tokens;
    uint32_t inflight;          /* requests the router has on it (duet_registry_inflight_add) */
    uint64_t registered_ms;     /* uv_now at registration */
    uint64_t last_heartbeat_ms; /* uv_now at the last Heartbeat */
    duet_worker_stats_t stats;  /* work counters of the last Heartbeat (since worker start) */
    duet_worker_cache_plan_t cache_plan;   /* from the last Heartbeat */
    uint32_t prefix_entries, prefix_pages; /* its prefix cache now (Heartbeat fields 28-29) */
    uint32_t prefix_pages_evictable;       /* of those, held by no request (field 32) */
    /* for operators (Register fields 7-10, Heartbeat field 23; 0 / "" from older workers) */
    uint16_t metrics_port;      /* the worker's /metrics HTTP port (0 = none) */
    char device[16], dtype[16]; /* "cpu", "f32"; [A-Za-z0-9_.:-] only (others become '?') */
    uint64_t started_unix_ms;   /* the worker process's start, its wall clock */
    double busy_seconds;        /* time in forward steps since it started (the last Heartbeat) */
    double utilisation;         /* 0..1: busy time over wall time between its last two Heartbeats */
} duet_worker_info_t;

typedef void (*duet_registry_worker_cb)(const duet_worker_info_t *w, void *user);
typedef void (*duet_registry_stats_cb)(const duet_worker_info_t *w,
                                       const duet_worker_stats_t *delta, void *user);
typedef void (*duet_registry_down_cb)(const duet_worker_info_t *w, const char *reason, void *user);
typedef void (*duet_registry_message_cb)(uint64_t worker_id, const Duet__Envelope *env, void *user);
typedef void (*duet_registry_close_cb)(void *user);

typedef struct {
    const char *host;              /* address to bind ("127.0.0.1", "::") */
    uint16_t port;                 /* 0 = ephemeral; see duet_registry_port */
    uint32_t heartbeat_timeout_ms; /* no Heartbeat for this long = dead */
    const char *fingerprint;       /* expected model fingerprint; NULL/"" = adopt the first */
    size_t max_frame;              /* largest frame body accepted (0 = DUET_FRAME_MAX_DEFAULT) */
    size_t max_workers;            /* table size, live and dead (0 = 256) */

    duet_registry_worker_cb on_worker_up;    /* optional: accepted */
    duet_registry_down_cb on_worker_down;    /* optional: dead, with the reason */
    duet_registry_worker_cb on_worker_state; /* optional: UP <-> DRAINING */
    duet_registry_message_cb on_message;     /* required: request-path bodies */
    duet_registry_stats_cb on_stats;         /* optional: counter increments per heartbeat (a
                                                counter that went backwards counts from 0) */
    void *user;
} duet_registry_options_t;

/* Defaults: 127.0.0.1, port 0, heartbeat timeout 5000 ms, adopt the first fingerprint. */
void duet_registry_options_default(duet_registry_options_t *opts);

/*
 * Bind and listen on `loop`. Options are copied (strings too). DUET_ERR_INVALID for a missing
 * on_message or a zero timeout, DUET_ERR_IO (with detail) when the address cannot be bound.
 */
duet_status_t duet_registry_start(uv_loop_t *loop, const duet_registry_options_t *opts,
                                  duet_registry_t **reg_p);

/* The bound port. */
uint16_t duet_registry_port(const duet_registry_t *reg);

/*
 * Close the listener and every connection (no on_worker_down calls from here on), free the
 * registry once every handle is closed, then cb(user) (may be NULL). Call once.
 */
void duet_registry_close(duet_registry_t *reg, duet_registry_close_cb cb, void *user);

/* The fingerprint workers must present now ("" while adopting and nobody registered yet). */
const char *duet_registry_fingerprint(const duet_registry_t *reg);

/*
 * Frame `env` and queue it to worker `worker_id` (env->version is set to DUET_PROTO_VERSION by
 * the caller or left 0 to be filled here). DUET_ERR_NOT_FOUND when the worker is unknown or
 * dead, DUET_ERR_NOMEM.
 */
duet_status_t duet_registry_send(duet_registry_t *reg, uint64_t worker_id, Duet__Envelope *env);

/*
 * Drain (true) or undrain (false) a live worker: sends Drain/Undrain and sets its state.
 * DUET_ERR_NOT_FOUND for an unknown or dead worker.
 */
duet_status_t duet_registry_set_draining(duet_registry_t *reg, uint64_t worker_id, bool draining);

/* Mark worker dead now and close it (e.g. it broke the protocol of a request). No-op if dead. */
void duet_registry_kill(duet_registry_t *reg, uint64_t worker_id, const char *reason);

/* Adjust the router's in-flight count of a worker (delta +1 / -1; never below 0). */
void duet_registry_inflight_add(duet_registry_t *reg, uint64_t worker_id, int delta);

/* A copy of worker `worker_id`; DUET_ERR_NOT_FOUND when unknown. */
duet_status_t duet_registry_get(const duet_registry_t *reg, uint64_t worker_id,
                                duet_worker_info_t *info_p);

/* Number of workers of `role` (0 = any role) in `state`. */
size_t duet_registry_count(const duet_registry_t *reg, int role, duet_worker_state_t state);

/*
 * Call cb for every listed worker (live and dead), in id order. cb must not call back into the
 * registry's mutating functions.
 */
void duet_registry_foreach(const duet_registry_t *reg, duet_registry_worker_cb cb, void *user);

/*
 * Fill out[0..cap) with placement candidates (live workers only, cached_tokens 0) and return how
 * many were written (at most cap).
 */
size_t duet_registry_candidates(const duet_registry_t *reg, duet_placement_candidate_t *out,
                                size_t cap);

/*
 * One prompt's prefix hash chains (common/prefix_hash.h), one per block size the workers'
 * summaries use, each computed on first need and kept for the prompt's later picks. Set it up
 * with duet_prefix_prompt_init; duet_prefix_prompt_free releases the chains.
 */
typedef struct {
    const uint32_t *tokens; /* (n_tokens) the prompt, not owned */
    size_t n_tokens;
    struct {
        uint32_t page_tokens;
        size_t n;         /* hashes (0 also when they could not be allocated) */
        uint64_t *hashes; /* (n) owned */
    } chain[DUET_REGISTRY_PREFIX_CHAINS];
    size_t n_chains;
} duet_prefix_prompt_t;

/* A prompt with no chain computed yet; tokens must outlive it. */
void duet_prefix_prompt_init(duet_prefix_prompt_t *pp, const uint32_t *tokens, size_t n_tokens);
void duet_prefix_prompt_free(duet_prefix_prompt_t *pp);

/*
 * For each candidate c[0..n) of `role` (from duet_registry_candidates), set cached_tokens to the
 * tokens of pp's prompt that worker likely holds: k * its summary's block size for the longest k
 * whose chain hash is in its latest summary (0 without a summary or a match); candidates of
 * another role get 0. Hashes the prompt
 * once per block size (kept in pp); a prompt whose chain cannot be allocated, or a
 * (DUET_REGISTRY_PREFIX_CHAINS + 1)-th block size, counts as nothing cached.
 */
void duet_registry_prefix_cached(const duet_registry_t *reg, duet_worker_role_t role,
                                 duet_prefix_prompt_t *pp, duet_placement_candidate_t *c, size_t n);

/* "up", "draining", "dead"; "ctx", "gen". */
const char *duet_worker_state_name(duet_worker_state_t state);
const char *duet_worker_role_name(duet_worker_role_t role);

/*
 * Test seam (the fuzz target fuzz/fuzz_registry.c and its unit test): a registry with no listener
 * and no heartbeat timer, whose connections have no socket. duet__registry_feed hands len bytes
 * to the newest connection as one read (len 0: its EOF), opening a new one when there is none or
 * the newest is closing, as a worker connecting (one the registry refused closes at the next
 * feed, which then feeds nothing); every frame the registry writes is appended to
 * `out` instead. Otherwise exactly the registry of duet_registry_start: the same decoding,
 * validation, callbacks and close (duet_registry_close). Returns false when nothing was fed.
 */
duet_status_t duet__registry_start_fake(uv_loop_t *loop, const duet_registry_options_t *opts,
                                        duet_strbuf_t *out, duet_registry_t **reg_p);
bool duet__registry_feed(duet_registry_t *reg, const uint8_t *data, size_t len);

#endif
