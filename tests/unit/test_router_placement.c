/*
 * router/cluster/placement.c: both policies on hand-made cases (draining and dead workers are
 * never picked, exclusions, ties, round robin across membership changes) and exhaustively against
 * an independent reference over every small cluster shape: up to 5 workers, every role/state mix,
 * loads from a small set, and a sequence of picks per shape so the round-robin cursor is covered.
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

/* ---------------------------------------------------------------- exhaustive vs. a reference */

/* Reference: sort the eligible workers by (load key, rr order) with a plain selection. */
static int ref_pick(int policy, uint64_t last, duet_worker_role_t role,
                    const duet_placement_candidate_t *c, size_t n, const uint64_t *ex, size_t nex)
{
    int best = -1;
    for (size_t i = 0; i < n; i++) {
        int ok = c[i].role == role && c[i].state == UP;
        for (size_t j = 0; j < nex; j++)
            ok = ok && c[i].id != ex[j];
        if (!ok)
            continue;
        if (best < 0) {
            best = (int)i;
            continue;
        }
        const duet_placement_candidate_t *a = &c[i], *b = &c[best];
        /* a tuple compared lexicographically; smaller wins */
        long long ka[4] = {0, 0, 0, 0}, kb[4] = {0, 0, 0, 0};
        if (policy == DUET_PLACEMENT_LEAST_LOADED) {
            ka[0] = -(long long)a->free_pages;
            kb[0] = -(long long)b->free_pages;
            ka[1] = (long long)a->queued_tokens;
            kb[1] = (long long)b->queued_tokens;
            ka[2] = a->inflight;
            kb[2] = b->inflight;
        }
        /* round robin: ids above last first, as (0, id), then (1, id) */
        ka[3] = (a->id > last ? 0 : 1000000) + (long long)a->id;
        kb[3] = (b->id > last ? 0 : 1000000) + (long long)b->id;
        int less = 0;
        for (int k = 0; k < 4; k++)
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
    size_t checked = 0;
    for (int policy = 0; policy < 2; policy++)
        for (size_t n = 0; n <= 5; n++) {
            /* per worker: role (2) x state (3) x pages (3) x queued (2) = 36 combos; 36^n is too
               many for n = 5, so walk every role/state mix (6^n) with loads from a counter */
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
                }
                for (int excl = 0; excl < 2; excl++) {
                    duet_placement_t pl;
                    duet_placement_init(&pl, (duet_placement_policy_t)policy);
                    uint64_t ex[1] = {n > 0 ? c[0].id : 0};
                    size_t nex = (size_t)excl;
                    uint64_t last[3] = {0, 0, 0};
                    for (int step = 0; step < 2 * (int)n + 1; step++) {
                        duet_worker_role_t role = step % 3 == 2 ? CTX : GEN;
                        int want = ref_pick(policy, last[role], role, c, n, ex, nex);
                        size_t got = 99;
                        duet_status_t st =
                            duet_placement_pick(&pl, role, c, n, nex ? ex : NULL, nex, &got);
                        if (want < 0) {
                            cr_assert_eq(st, DUET_ERR_NOT_FOUND, "policy %d n %zu m %zu", policy, n,
                                         m);
                        } else {
                            cr_assert_eq(st, DUET_OK);
                            cr_assert_eq(got, (size_t)want, "policy %d n %zu m %zu step %d", policy,
                                         n, m, step);
                            cr_assert_eq(c[got].state, UP);
                            last[role] = c[got].id;
                        }
                        checked++;
                    }
                }
            }
        }
    cr_log_info("%zu picks checked against the reference", checked);
    cr_assert_gt(checked, 100000);
}
