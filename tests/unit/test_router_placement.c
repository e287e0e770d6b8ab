/*
 * router/cluster/placement.c: both policies on hand-made cases (draining and dead workers are
 * never picked, exclusions, ties, round robin across membership changes) and exhaustively against
 * an independent reference over every small cluster shape: up to 5 workers, every role/state mix,
 * loads from a small set, and a sequence of picks per shape so the round-robin cursor is covered.
 * Prefix awareness likewise: cache against load, ties, exclusions, and off = the plain policy.
 */
#include <criterion/criterion.h>
#include <stdlib.h>

#include "router/cluster/placement.h"

#define GEN DUET_WORKER_ROLE_GEN
#define CTX DUET_WORKER_ROLE_CTX
#define UP  DUET_WORKER_STATE_UP
#define DRN DUET_WORKER_STATE_DRAINING
#define DED DUET_WORKER_STATE_DEAD

static size_t pick(duet_placement_t *pl, duet_worker_role_t role,
                   const duet_placement_candidate_t *c, size_t n)
{
    size_t idx = 999;
    cr_assert_eq(duet_placement_pick(pl, role, c, n, NULL, 0, &idx), DUET_OK);
    return idx;
}

Test(placement, policy_names)
{
    duet_placement_policy_t p;
    cr_assert_eq(duet_placement_policy_parse("round_robin", &p), DUET_OK);
    cr_assert_eq(p, DUET_PLACEMENT_ROUND_ROBIN);
    cr_assert_eq(duet_placement_policy_parse("least_loaded", &p), DUET_OK);
    cr_assert_eq(p, DUET_PLACEMENT_LEAST_LOADED);
    cr_assert_eq(duet_placement_policy_parse("random", &p), DUET_ERR_INVALID);
    cr_assert_eq(duet_placement_policy_parse(NULL, &p), DUET_ERR_INVALID);
    cr_assert_str_eq(duet_placement_policy_name(DUET_PLACEMENT_LEAST_LOADED), "least_loaded");
    cr_assert_str_eq(duet_placement_policy_name(DUET_PLACEMENT_ROUND_ROBIN), "round_robin");
}

Test(placement, round_robin_cycles_and_skips_draining_dead_and_other_role)
{
    duet_placement_candidate_t c[] = {
        {.id = 3, .role = GEN, .state = UP},  {.id = 1, .role = GEN, .state = UP},
        {.id = 2, .role = GEN, .state = DRN}, {.id = 4, .role = CTX, .state = UP},
        {.id = 5, .role = GEN, .state = DED}, {.id = 6, .role = GEN, .state = UP},
    };
    duet_placement_t pl;
    duet_placement_init(&pl, DUET_PLACEMENT_ROUND_ROBIN);
    uint64_t want[] = {1, 3, 6, 1, 3, 6};
    for (size_t i = 0; i < 6; i++)
        cr_assert_eq(c[pick(&pl, GEN, c, 6)].id, want[i], "pick %zu", i);
    cr_assert_eq(c[pick(&pl, CTX, c, 6)].id, 4); /* its own cursor */
    cr_assert_eq(c[pick(&pl, GEN, c, 6)].id, 1);
}

Test(placement, round_robin_survives_membership_changes)
{
    duet_placement_candidate_t c[] = {
        {.id = 1, .role = GEN, .state = UP},
        {.id = 2, .role = GEN, .state = UP},
        {.id = 3, .role = GEN, .state = UP},
    };
    duet_placement_t pl;
    duet_placement_init(&pl, DUET_PLACEMENT_ROUND_ROBIN);
    cr_assert_eq(c[pick(&pl, GEN, c, 3)].id, 1);
    cr_assert_eq(c[pick(&pl, GEN, c, 3)].id, 2);
    /* worker 2 (the last picked) leaves: the next is still 3, not a restart at 1 */
    duet_placement_candidate_t d[] = {c[0], c[2]};
    cr_assert_eq(d[pick(&pl, GEN, d, 2)].id, 3);
    cr_assert_eq(d[pick(&pl, GEN, d, 2)].id, 1);
}

Test(placement, least_loaded_order_of_keys)
{
    duet_placement_candidate_t c[] = {
        {.id = 1, .role = GEN, .state = UP, .free_pages = 10, .queued_tokens = 0},
        {.id = 2, .role = GEN, .state = UP, .free_pages = 50, .queued_tokens = 900},
        {.id = 3, .role = GEN, .state = UP, .free_pages = 50, .queued_tokens = 100, .inflight = 4},
        {.id = 4, .role = GEN, .state = UP, .free_pages = 50, .queued_tokens = 100, .inflight = 2},
        {.id = 5, .role = GEN, .state = DRN, .free_pages = 999},
        {.id = 6, .role = GEN, .state = DED, .free_pages = 999},
        {.id = 7, .role = CTX, .state = UP, .free_pages = 999},
    };
    duet_placement_t pl;
    duet_placement_init(&pl, DUET_PLACEMENT_LEAST_LOADED);
    cr_assert_eq(c[pick(&pl, GEN, c, 7)].id, 4); /* most pages, fewest queued, fewest inflight */
    c[3].inflight = 4;                           /* 3 and 4 now tie: round robin after 4 */
    cr_assert_eq(c[pick(&pl, GEN, c, 7)].id, 3);
    cr_assert_eq(c[pick(&pl, GEN, c, 7)].id, 4);
}

Test(placement, exclusions_and_nothing_eligible)
{
    duet_placement_candidate_t c[] = {
        {.id = 1, .role = GEN, .state = UP},
        {.id = 2, .role = GEN, .state = UP},
        {.id = 3, .role = CTX, .state = DRN},
    };
    duet_placement_t pl;
    duet_placement_init(&pl, DUET_PLACEMENT_LEAST_LOADED);
    uint64_t ex[] = {1};
    size_t idx = 77;
    cr_assert_eq(duet_placement_pick(&pl, GEN, c, 3, ex, 1, &idx), DUET_OK);
    cr_assert_eq(c[idx].id, 2);
    uint64_t ex2[] = {1, 2};
    idx = 77;
    cr_assert_eq(duet_placement_pick(&pl, GEN, c, 3, ex2, 2, &idx), DUET_ERR_NOT_FOUND);
    cr_assert_eq(idx, 77, "out-param untouched on failure");
    cr_assert_eq(duet_placement_pick(&pl, CTX, c, 3, NULL, 0, &idx), DUET_ERR_NOT_FOUND);
    cr_assert_eq(duet_placement_pick(&pl, GEN, NULL, 0, NULL, 0, &idx), DUET_ERR_NOT_FOUND);
    cr_assert_eq(duet_placement_pick(&pl, GEN, NULL, 2, NULL, 0, &idx), DUET_ERR_INVALID);
    cr_assert_eq(duet_placement_pick(&pl, (duet_worker_role_t)0, c, 3, NULL, 0, &idx),
                 DUET_ERR_INVALID);
}

/* ---------------------------------------------------------------- cached prefixes */

Test(placement, prefix_cache_beats_load_when_it_saves_more)
{
    /* estimated work: 1: 100 queued + the whole prompt; 2: 150 queued + the prompt - 64 */
    duet_placement_candidate_t c[] = {
        {.id = 1, .role = CTX, .state = UP, .free_pages = 90, .queued_tokens = 100},
        {.id = 2,
         .role = CTX,
         .state = UP,
         .free_pages = 10,
         .queued_tokens = 150,
         .cached_tokens = 64},
    };
    for (int policy = 0; policy < 2; policy++) {
        duet_placement_t pl;
        duet_placement_init(&pl, (duet_placement_policy_t)policy);
        pl.prefix_aware = true;
        for (int i = 0; i < 3; i++) /* every time, whatever the round-robin cursor */
            cr_assert_eq(c[pick(&pl, CTX, c, 2)].id, 2, "policy %d pick %d", policy, i);
    }
}

Test(placement, load_wins_when_the_queue_is_longer_than_the_saving)
{
    duet_placement_candidate_t c[] = {
        {.id = 1, .role = CTX, .state = UP, .free_pages = 10, .queued_tokens = 100},
        {.id = 2,
         .role = CTX,
         .state = UP,
         .free_pages = 90,
         .queued_tokens = 165,
         .cached_tokens = 64},
        {.id = 3, .role = CTX, .state = UP, .free_pages = 10, .queued_tokens = 101},
    };
    for (int policy = 0; policy < 2; policy++) {
        duet_placement_t pl;
        duet_placement_init(&pl, (duet_placement_policy_t)policy);
        pl.prefix_aware = true;
        for (int i = 0; i < 3; i++) /* 100 < 165 - 64 = 101 (worker 3 too) */
            cr_assert_eq(c[pick(&pl, CTX, c, 3)].id, 1, "policy %d pick %d", policy, i);
    }
}

Test(placement, prefix_ties_fall_to_the_policy)
{
    /* 1 and 2 tie on estimated work (100 - 0 = 164 - 64); 3 is more work */
    duet_placement_candidate_t c[] = {
        {.id = 1, .role = GEN, .state = UP, .free_pages = 10, .queued_tokens = 100},
        {.id = 2,
         .role = GEN,
         .state = UP,
         .free_pages = 20,
         .queued_tokens = 164,
         .cached_tokens = 64},
        {.id = 3, .role = GEN, .state = UP, .free_pages = 99, .queued_tokens = 200},
    };
    duet_placement_t pl;
    duet_placement_init(&pl, DUET_PLACEMENT_ROUND_ROBIN);
    pl.prefix_aware = true;
    uint64_t want[] = {1, 2, 1, 2};
    for (size_t i = 0; i < 4; i++)
        cr_assert_eq(c[pick(&pl, GEN, c, 3)].id, want[i], "round robin pick %zu", i);
    duet_placement_init(&pl, DUET_PLACEMENT_LEAST_LOADED);
    pl.prefix_aware = true;
    for (size_t i = 0; i < 3; i++) /* more free pages */
        cr_assert_eq(c[pick(&pl, GEN, c, 3)].id, 2, "least loaded pick %zu", i);
}

Test(placement, prefix_respects_exclusions_draining_and_role)
{
    duet_placement_candidate_t c[] = {
        {.id = 1, .role = CTX, .state = UP, .queued_tokens = 500},
        {.id = 2, .role = CTX, .state = DRN, .cached_tokens = 400},
        {.id = 3, .role = CTX, .state = UP, .queued_tokens = 500, .cached_tokens = 300},
        {.id = 4, .role = GEN, .state = UP, .cached_tokens = 900},
        {.id = 5, .role = CTX, .state = DED, .cached_tokens = 900},
        {.id = 6, .role = CTX, .state = UP, .queued_tokens = 250},
    };
    duet_placement_t pl;
    duet_placement_init(&pl, DUET_PLACEMENT_ROUND_ROBIN);
    pl.prefix_aware = true;
    /* 3: 500 - 300 = 200 beats 6's 250 and 1's 500; 2, 4 and 5 hold more but may not be picked */
    for (int i = 0; i < 3; i++)
        cr_assert_eq(c[pick(&pl, CTX, c, 6)].id, 3, "pick %d", i);
    /* 3 excluded: no eligible worker holds anything, so plain round robin after 3 */
    uint64_t ex[] = {3};
    uint64_t want[] = {6, 1, 6};
    for (size_t i = 0; i < 3; i++) {
        size_t idx = 99;
        cr_assert_eq(duet_placement_pick(&pl, CTX, c, 6, ex, 1, &idx), DUET_OK);
        cr_assert_eq(c[idx].id, want[i], "excluded: pick %zu", i);
    }
}

Test(placement, off_or_nothing_cached_is_the_plain_policy)
{
    duet_placement_candidate_t c[] = {
        {.id = 1, .role = CTX, .state = UP, .queued_tokens = 50},
        {.id = 2, .role = CTX, .state = UP, .cached_tokens = 999},
        {.id = 3, .role = CTX, .state = UP, .queued_tokens = 10},
    };
    duet_placement_t pl;
    duet_placement_init(&pl, DUET_PLACEMENT_ROUND_ROBIN); /* prefix_aware off after init */
    uint64_t want[] = {1, 2, 3, 1};
    for (size_t i = 0; i < 4; i++)
        cr_assert_eq(c[pick(&pl, CTX, c, 3)].id, want[i], "off: pick %zu", i);
    /* on, but the only cached worker is excluded: plain round robin among the others */
    duet_placement_init(&pl, DUET_PLACEMENT_ROUND_ROBIN);
    pl.prefix_aware = true;
    uint64_t ex[] = {2};
    uint64_t want2[] = {1, 3, 1, 3};
    for (size_t i = 0; i < 4; i++) {
        size_t idx = 99;
        cr_assert_eq(duet_placement_pick(&pl, CTX, c, 3, ex, 1, &idx), DUET_OK);
        cr_assert_eq(c[idx].id, want2[i], "excluded cache: pick %zu", i);
    }
}

Test(placement, gen_cache_counts_only_where_it_prefills_locally)
{
    /* prompt 100 tokens, local prefill below 20 tokens: 96 cached leaves 4 (local), 80 leaves 20
     * (not local: a ctx worker prefills it all) */
    cr_assert_eq(duet_placement_gen_cached(100, 96, 20), 96);
    cr_assert_eq(duet_placement_gen_cached(100, 81, 20), 81);
    cr_assert_eq(duet_placement_gen_cached(100, 80, 20), 0);
    cr_assert_eq(duet_placement_gen_cached(100, 96, 0), 0, "never local");
    cr_assert_eq(duet_placement_gen_cached(10, 0, 20), 0, "nothing cached");
    cr_assert_eq(duet_placement_gen_cached(10, 8, 20), 8, "a short prompt is local anyway");
    cr_assert_eq(duet_placement_gen_cached(10, 11, 20), 0, "more than the prompt: nonsense");
}

/* ---------------------------------------------------------------- exhaustive vs. a reference */

/* Reference: sort the eligible workers by (load key, rr order) with a plain selection. */
static int ref_eligible(const duet_placement_candidate_t *c, duet_worker_role_t role,
                        const uint64_t *ex, size_t nex)
{
    int ok = c->role == role && c->state == UP;
    for (size_t j = 0; j < nex; j++)
        ok = ok && c->id != ex[j];
    return ok;
}

static int ref_pick(int policy, int aware, uint64_t last, duet_worker_role_t role,
                    const duet_placement_candidate_t *c, size_t n, const uint64_t *ex, size_t nex)
{
    int cached = 0; /* prefix awareness applies: an eligible worker holds part of the prompt */
    for (size_t i = 0; i < n; i++)
        cached |= aware && ref_eligible(&c[i], role, ex, nex) && c[i].cached_tokens > 0;
    int best = -1;
    for (size_t i = 0; i < n; i++) {
        if (!ref_eligible(&c[i], role, ex, nex))
            continue;
        if (best < 0) {
            best = (int)i;
            continue;
        }
        const duet_placement_candidate_t *a = &c[i], *b = &c[best];
        /* a tuple compared lexicographically; smaller wins */
        long long ka[5] = {0, 0, 0, 0, 0}, kb[5] = {0, 0, 0, 0, 0};
        if (cached) { /* estimated work, less the prompt every candidate shares */
            ka[0] = (long long)a->queued_tokens - (long long)a->cached_tokens;
            kb[0] = (long long)b->queued_tokens - (long long)b->cached_tokens;
        }
        if (policy == DUET_PLACEMENT_LEAST_LOADED) {
            ka[1] = -(long long)a->free_pages;
            kb[1] = -(long long)b->free_pages;
            ka[2] = (long long)a->queued_tokens;
            kb[2] = (long long)b->queued_tokens;
            ka[3] = a->inflight;
            kb[3] = b->inflight;
        }
        /* round robin: ids above last first, as (0, id), then (1, id) */
        ka[4] = (a->id > last ? 0 : 1000000) + (long long)a->id;
        kb[4] = (b->id > last ? 0 : 1000000) + (long long)b->id;
        int less = 0;
        for (int k = 0; k < 5; k++)
            if (ka[k] != kb[k]) {
                less = ka[k] < kb[k];
                break;
            }
        if (less)
            best = (int)i;
    }
    return best;
}

Test(placement, exhaustive_against_reference, .timeout = 120)
{
    static const uint32_t pages[] = {0, 7, 7};
    static const uint64_t queued[] = {0, 5};
    static const uint64_t cached[] = {0, 0, 5, 3}; /* queued 5 - cached 5 ties 0 - 0 */
    size_t checked = 0;
    for (int aware = 0; aware < 2; aware++)
        for (int policy = 0; policy < 2; policy++)
            for (size_t n = 0; n <= 5; n++) {
                /* per worker: role (2) x state (3) x pages (3) x queued (2) = 36 combos; 36^n is
                   too many for n = 5, so walk every role/state mix (6^n) with loads from a counter
                 */
                size_t combos = 1;
                for (size_t i = 0; i < n; i++)
                    combos *= 6;
                for (size_t m = 0; m < combos; m++) {
                    duet_placement_candidate_t c[5];
                    size_t x = m;
                    for (size_t i = 0; i < n; i++) {
                        size_t rs = x % 6;
                        x /= 6;
                        c[i].id = (uint64_t)((i * 3 + m) % 5 + 1 + 5 * i); /* distinct */
                        c[i].role = rs % 2 ? GEN : CTX;
                        c[i].state = (duet_worker_state_t)(rs / 2);
                        c[i].free_pages = pages[(m + i) % 3];
                        c[i].queued_tokens = queued[(m / 3 + i) % 2];
                        c[i].inflight = (uint32_t)((m + 2 * i) % 2);
                        c[i].cached_tokens = cached[(m / 2 + 3 * i) % 4];
                    }
                    for (int excl = 0; excl < 2; excl++) {
                        duet_placement_t pl;
                        duet_placement_init(&pl, (duet_placement_policy_t)policy);
                        pl.prefix_aware = aware;
                        uint64_t ex[1] = {n > 0 ? c[0].id : 0};
                        size_t nex = (size_t)excl;
                        uint64_t last[3] = {0, 0, 0};
                        for (int step = 0; step < 2 * (int)n + 1; step++) {
                            duet_worker_role_t role = step % 3 == 2 ? CTX : GEN;
                            int want = ref_pick(policy, aware, last[role], role, c, n, ex, nex);
                            size_t got = 99;
                            duet_status_t st =
                                duet_placement_pick(&pl, role, c, n, nex ? ex : NULL, nex, &got);
                            if (want < 0) {
                                cr_assert_eq(st, DUET_ERR_NOT_FOUND,
                                             "aware %d policy %d n %zu m %zu", aware, policy, n, m);
                            } else {
                                cr_assert_eq(st, DUET_OK);
                                cr_assert_eq(got, (size_t)want,
                                             "aware %d policy %d n %zu m %zu step %d", aware,
                                             policy, n, m, step);
                                cr_assert_eq(c[got].state, UP);
                                last[role] = c[got].id;
                            }
                            checked++;
                        }
                    }
                }
            }
    cr_log_info("%zu picks checked against the reference", checked);
    cr_assert_gt(checked, 200000);
}
