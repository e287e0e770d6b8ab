/*
 * Placement policies (see placement.h). Linear scans over the snapshot: a cluster has tens of
 * workers, and a scan with explicit tie-breaks is easy to check against the contract.
 */
#include "router/cluster/placement.h"

#include <stdbool.h>
#include <string.h>

duet_status_t duet_placement_policy_parse(const char *s, duet_placement_policy_t *policy_p)
{
    if (s != NULL && strcmp(s, "round_robin") == 0) {
        *policy_p = DUET_PLACEMENT_ROUND_ROBIN;
        return DUET_OK;
    }
    if (s != NULL && strcmp(s, "least_loaded") == 0) {
        *policy_p = DUET_PLACEMENT_LEAST_LOADED;
        return DUET_OK;
    }
    return duet_error_set(DUET_ERR_INVALID,
                          "placement policy \"%s\": expected round_robin or least_loaded",
                          s != NULL ? s : "(null)");
}

const char *duet_placement_policy_name(duet_placement_policy_t policy)
{
    return policy == DUET_PLACEMENT_LEAST_LOADED ? "least_loaded" : "round_robin";
}

void duet_placement_init(duet_placement_t *pl, duet_placement_policy_t policy)
{
    memset(pl, 0, sizeof(*pl));
    pl->policy = policy;
}

static bool placement_eligible(const duet_placement_candidate_t *c, duet_worker_role_t role,
                               const uint64_t *exclude, size_t n_exclude)
{
    if (c->role != role || c->state != DUET_WORKER_STATE_UP || c->id == 0)
        return false;
    for (size_t i = 0; i < n_exclude; i++)
        if (exclude[i] == c->id)
            return false;
    return true;
}

/*
 * Round-robin order relative to the cursor: ids above `last` come first (smallest first), then
 * the ids at or below it. Returns true when id a comes before id b.
 */
static bool placement_rr_before(uint64_t a, uint64_t b, uint64_t last)
{
    bool a_after = a > last, b_after = b > last;
    if (a_after != b_after)
        return a_after;
    return a < b;
}

/* -1 when a is a better least_loaded choice than b, 1 when worse, 0 when tied on load. */
static int placement_load_cmp(const duet_placement_candidate_t *a,
                              const duet_placement_candidate_t *b)
{
    if (a->free_pages != b->free_pages)
        return a->free_pages > b->free_pages ? -1 : 1;
    if (a->queued_tokens != b->queued_tokens)
        return a->queued_tokens < b->queued_tokens ? -1 : 1;
    if (a->inflight != b->inflight)
        return a->inflight < b->inflight ? -1 : 1;
    return 0;
}

/*
 * -1 when a is less estimated work than b under prefix awareness (queued_tokens - cached_tokens,
 * compared without overflow as queued_a + cached_b against queued_b + cached_a), 1 when more.
 */
static int placement_work_cmp(const duet_placement_candidate_t *a,
                              const duet_placement_candidate_t *b)
{
    const unsigned __int128 wa = (unsigned __int128)a->queued_tokens + b->cached_tokens;
    const unsigned __int128 wb = (unsigned __int128)b->queued_tokens + a->cached_tokens;
    return wa < wb ? -1 : wa > wb ? 1 : 0;
}

duet_status_t duet_placement_pick(duet_placement_t *pl, duet_worker_role_t role,
                                  const duet_placement_candidate_t *c, size_t n,
                                  const uint64_t *exclude, size_t n_exclude, size_t *idx_p)
{
    if ((c == NULL && n > 0) || (exclude == NULL && n_exclude > 0) ||
        (role != DUET_WORKER_ROLE_CTX && role != DUET_WORKER_ROLE_GEN))
        return duet_error_set(DUET_ERR_INVALID, "placement: bad arguments");
    uint64_t last = pl->last_id[role];
    bool by_cache = false; /* some eligible worker holds part of the prompt */
    if (pl->prefix_aware)
        for (size_t i = 0; i < n && !by_cache; i++)
            by_cache =
                c[i].cached_tokens > 0 && placement_eligible(&c[i], role, exclude, n_exclude);
    size_t best = n;
    for (size_t i = 0; i < n; i++) {
        if (!placement_eligible(&c[i], role, exclude, n_exclude))
            continue;
        if (best == n) {
            best = i;
            continue;
        }
        int cmp = by_cache ? placement_work_cmp(&c[i], &c[best]) : 0;
        if (cmp == 0 && pl->policy == DUET_PLACEMENT_LEAST_LOADED)
            cmp = placement_load_cmp(&c[i], &c[best]);
        if (cmp < 0 || (cmp == 0 && placement_rr_before(c[i].id, c[best].id, last)))
            best = i;
    }
    if (best == n)
        return duet_error_set(DUET_ERR_NOT_FOUND, "placement: no live %s worker",
                              role == DUET_WORKER_ROLE_GEN ? "generation" : "context");
    pl->last_id[role] = c[best].id;
    *idx_p = best;
    return DUET_OK;
}

uint64_t duet_placement_gen_cached(uint64_t prompt_tokens, uint64_t cached,
                                   uint64_t local_prefill_tokens)
{
    if (cached == 0 || cached > prompt_tokens)
        return 0; /* a summary never names the whole prompt (one token is left to prefill) */
    return prompt_tokens - cached < local_prefill_tokens ? cached : 0;
}
