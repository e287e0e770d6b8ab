/*
 * Placement: which worker gets the next request (docs/architecture.md, "Admission, placement,
 * drain, admin API, metrics"). A pure module: no sockets, no clock, no allocation; the router
 * passes a snapshot of the registry (duet_placement_candidate_t) and gets back an index into it, so
 * every policy can be tested exhaustively on plain arrays.
 *
 * Order. The router picks a generation worker first (it must reserve the cache pages for the
 * whole request, or refuse), and only after the reservation a context worker; each pick is one
 * call with the role wanted. A worker that is draining or dead is never picked, nor one whose id
 * is in the caller's exclusion list (the gen workers that already refused this request, the ctx
 * worker whose prefill failed).
 *
 * Policies.
 *   round_robin   the eligible worker with the smallest id above the last one picked for that
 *                 role, wrapping around. Keyed by id rather than by array position, so workers
 *                 joining or leaving do not make it skip or repeat others.
 *   least_loaded  the eligible worker with the most free KV pages; ties go to the fewest queued
 *                 tokens, then to the fewest requests the router has in flight on it (heartbeats
 *                 lag, so this spreads a burst that arrives between two heartbeats), then to
 *                 round robin among the remaining ties.
 *
 * Cached prefixes (prefix_aware, the router's placement.prefix_aware). Each candidate says how
 * many of the prompt's tokens it likely holds already (cached_tokens: its prefix cache's summary,
 * registry.h). When prefix_aware is on and some eligible candidate has cached_tokens > 0, the
 * eligible worker with the least estimated work wins: queued_tokens + (prompt tokens -
 * cached_tokens), the prompt tokens being the same for every candidate, so the comparison is of
 * queued_tokens - cached_tokens. A cached prefix thus beats a shorter queue when it saves more
 * tokens than the queue is longer. Ties go to the policy's order above. When no eligible
 * candidate has a cached prefix (or prefix_aware is off) the policy is exactly as above. A
 * generation worker's cache counts only where it would prefill the request itself
 * (duet_placement_gen_cached).
 */
#ifndef DUET_ROUTER_PLACEMENT_H
#define DUET_ROUTER_PLACEMENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef enum {
    DUET_WORKER_ROLE_CTX = 1, /* = duet.WorkerRole.WORKER_ROLE_CTX */
    DUET_WORKER_ROLE_GEN = 2, /* = duet.WorkerRole.WORKER_ROLE_GEN */
} duet_worker_role_t;

typedef enum {
    DUET_WORKER_STATE_UP = 0,       /* registered, heartbeating, takes requests */
    DUET_WORKER_STATE_DRAINING = 1, /* finishes its requests, takes no new ones */
    DUET_WORKER_STATE_DEAD = 2,     /* heartbeat lost, connection closed or deregistered */
    DUET_WORKER_STATE_COUNT = 3,
} duet_worker_state_t;

typedef enum {
    DUET_PLACEMENT_ROUND_ROBIN = 0,
    DUET_PLACEMENT_LEAST_LOADED = 1,
} duet_placement_policy_t;

/* One worker as placement sees it. */
typedef struct {
    uint64_t id; /* the registry's worker id (never 0) */
    duet_worker_role_t role;
    duet_worker_state_t state;
    uint32_t free_pages;    /* from the last heartbeat */
    uint64_t queued_tokens; /* from the last heartbeat */
    uint32_t inflight;      /* requests the router has on it now */
    uint64_t cached_tokens; /* the prompt's tokens it likely holds (0 = none; prefix_aware) */
} duet_placement_candidate_t;

/* Placement state: the policy and the round-robin cursor per role. Embeddable. */
typedef struct {
    duet_placement_policy_t policy;
    bool prefix_aware;   /* weigh cached_tokens (see above); off after init, the caller sets it */
    uint64_t last_id[3]; /* indexed by role: the id picked last (0 = none yet) */
} duet_placement_t;

/* "round_robin" / "least_loaded" -> policy; DUET_ERR_INVALID (with detail) otherwise. */
duet_status_t duet_placement_policy_parse(const char *s, duet_placement_policy_t *policy_p);

/* "round_robin" / "least_loaded". */
const char *duet_placement_policy_name(duet_placement_policy_t policy);

/* Start with no history. */
void duet_placement_init(duet_placement_t *pl, duet_placement_policy_t policy);

/*
 * Pick a worker of `role` among c[0..n): *idx_p = its index in c. Workers whose id is in
 * exclude[0..n_exclude) are skipped (exclude may be NULL when n_exclude is 0). Updates the
 * round-robin cursor of that role. DUET_ERR_NOT_FOUND when no worker is eligible (*idx_p then
 * untouched); DUET_ERR_INVALID for a NULL c with n > 0 or a role that is neither ctx nor gen.
 */
duet_status_t duet_placement_pick(duet_placement_t *pl, duet_worker_role_t role,
                                  const duet_placement_candidate_t *c, size_t n,
                                  const uint64_t *exclude, size_t n_exclude, size_t *idx_p);

/*
 * A generation worker's cached tokens as placement weighs them. Its cache saves work only when it
 * prefills the request itself (Generate: the router's placement.local_prefill_tokens), which it
 * does when what its cache leaves of the prompt is shorter than local_prefill_tokens: then all of
 * `cached` counts, else none (a context worker prefills the prompt; 0 when local_prefill_tokens
 * is 0, the router never prefilling on a gen worker).
 */
uint64_t duet_placement_gen_cached(uint64_t prompt_tokens, uint64_t cached,
                                   uint64_t local_prefill_tokens);

#endif
