/*
 * splitkv_check.h: what every split-KV plan must be, checked from its input alone, for the
 * planner's property tests (test_splitkv.c) and for duet-splitkv-plan's output read back from
 * its JSON (test_splitkv_cli.c), and the random steps both draw. The block counts, costs and
 * targets here are written from splitkv.h's contract, not taken from its helpers, so that a
 * change to a helper is seen.
 */
#ifndef DUET_TESTS_SPLITKV_CHECK_H
#define DUET_TESTS_SPLITKV_CHECK_H

#include <criterion/criterion.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/splitkv.h"
#include "tests/unit/test_rng.h" /* seeded by the including file's DUET_TEST_RNG_SEED */

/* KV blocks of an item of len positions: len over block_tokens, rounded up. */
static inline int64_t skv_ref_blocks(int64_t len, int64_t bt)
{
    return len / bt + (len % bt != 0);
}

/* An item's cost: blocks x rows, an item of no rows counted as one row. */
static inline int64_t skv_ref_rows(int64_t rows)
{
    return rows > 0 ? rows : 1;
}

/* The work items a step aims at: WAVES per unit, each counted once per head (rounded up). */
static inline int64_t skv_ref_want(int64_t heads, int64_t units)
{
    return (DUET_SPLITKV_WAVES * units + heads - 1) / heads;
}

/*
 * The invariants of every plan, any mode (splitkv.h): work0 brackets item i's work items, which
 * are item-major with splits 0, 1, ... in order; every block of every item is covered exactly
 * once and in order (a per-item bitmap); no work item is empty; splits[i] is item i's work-item
 * count (an empty item: split count 1 and no work items); an item of one split has one work
 * item over all its blocks; an item with more than DUET_SPLITKV_MAX_ROWS rows is never split;
 * no item has more splits than blocks or DUET_SPLITKV_MAX_SPLITS; n_work is within
 * duet_splitkv_max_work; NONE splits nothing. Failures stop the test, naming `what`.
 */
static inline void skv_check_plan(const duet_splitkv_in_t *in, const duet_splitkv_plan_t *p,
                                  const char *what)
{
    const int64_t n = in->n_items;
    cr_assert_eq(p->work0[0], 0, "%s: work0[0] = %d", what, p->work0[0]);
    cr_assert_eq(p->work0[n], p->n_work, "%s: work0[n] = %d, n_work %lld", what, p->work0[n],
                 (long long)p->n_work);
    cr_assert(p->n_work >= 0 && p->n_work <= duet_splitkv_max_work(n, in->heads, in->units),
              "%s: n_work %lld past max_work %lld", what, (long long)p->n_work,
              (long long)duet_splitkv_max_work(n, in->heads, in->units));
    int64_t most = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t b = skv_ref_blocks(in->lens[i], in->block_tokens);
        most = b > most ? b : most;
    }
    uint8_t *seen = malloc((size_t)(most > 0 ? most : 1));
    cr_assert_not_null(seen);
    for (int64_t i = 0; i < n; i++) {
        const int64_t b = skv_ref_blocks(in->lens[i], in->block_tokens);
        const int32_t s = p->splits[i], w0 = p->work0[i], w1 = p->work0[i + 1];
        cr_assert(w0 <= w1, "%s: item %lld: work0 %d > work0[next] %d", what, (long long)i, w0, w1);
        if (b == 0) {
            cr_assert(s == 1 && w0 == w1,
                      "%s: empty item %lld: %d splits, %d work items (want 1 and 0)", what,
                      (long long)i, s, w1 - w0);
            continue;
        }
        cr_assert_eq(w1 - w0, s, "%s: item %lld: %d splits but %d work items", what, (long long)i,
                     s, w1 - w0);
        cr_assert(s >= 1 && s <= b && s <= DUET_SPLITKV_MAX_SPLITS,
                  "%s: item %lld: %d splits of %lld blocks", what, (long long)i, s, (long long)b);
        if (in->rows[i] > DUET_SPLITKV_MAX_ROWS || in->mode == DUET_SPLITKV_NONE)
            cr_assert_eq(s, 1, "%s: item %lld (%lld rows, mode %d) split %d ways", what,
                         (long long)i, (long long)in->rows[i], (int)in->mode, s);
        memset(seen, 0, (size_t)b);
        int64_t next = 0; /* the first block the next work item must start at */
        for (int32_t w = w0; w < w1; w++) {
            const duet_splitkv_work_t *wk = &p->work[w];
            cr_assert(wk->item == i && wk->split == w - w0,
                      "%s: work[%d] is item %d split %d, want item %lld split %d", what, w,
                      wk->item, wk->split, (long long)i, w - w0);
            cr_assert(wk->block0 < wk->block1, "%s: work[%d] is empty: blocks [%d, %d)", what, w,
                      wk->block0, wk->block1);
            cr_assert(wk->block0 == next && wk->block1 <= b,
                      "%s: work[%d] covers [%d, %d), want it to start at %lld and end by %lld",
                      what, w, wk->block0, wk->block1, (long long)next, (long long)b);
            for (int32_t k = wk->block0; k < wk->block1; k++) {
                cr_assert(!seen[k], "%s: item %lld block %d covered twice", what, (long long)i, k);
                seen[k] = 1;
            }
            next = wk->block1;
        }
        for (int64_t k = 0; k < b; k++)
            cr_assert(seen[k], "%s: item %lld block %lld not covered", what, (long long)i,
                      (long long)k);
        if (s == 1)
            cr_assert(p->work[w0].block0 == 0 && p->work[w0].block1 == b,
                      "%s: item %lld of one split: [%d, %d) of %lld blocks", what, (long long)i,
                      p->work[w0].block0, p->work[w0].block1, (long long)b);
    }
    free(seen);
}

/* Random steps: the including file seeds rng_state. */
#define SKV_MAX_N 256

typedef struct {
    int64_t n;
    int64_t lens[SKV_MAX_N], rows[SKV_MAX_N];
    int64_t heads, bt, units;
} batch_t;

/* Uniform in [lo, hi]. */
static inline int64_t rng_in(int64_t lo, int64_t hi)
{
    return lo + (int64_t)(rng_u32() % (uint32_t)(hi - lo + 1));
}

/* Spread over magnitudes: below 2^k for k uniform in [0, max_bits]. */
static inline int64_t rng_log(int max_bits)
{
    const int k = (int)rng_in(0, max_bits);
    return k == 0 ? 0 : (int64_t)(rng_u32() % (1u << k));
}

/* One random batch: the length pattern and the row pattern are drawn independently. */
static inline void gen_batch(batch_t *b)
{
    switch (rng_in(0, 5)) {
    case 0: { /* skewed: one long request (~128K, sometimes up to 1M) beside short ones */
        b->n = rng_in(2, 128);
        for (int64_t i = 0; i < b->n; i++)
            b->lens[i] = rng_in(0, 512);
        b->lens[rng_in(0, b->n - 1)] = rng_in(0, 3) == 0 ? rng_in(65536, 1 << 20) : 131072;
        break;
    }
    case 1: { /* uniform: every request the same length */
        b->n = rng_in(1, 128);
        const int64_t len = rng_log(17);
        for (int64_t i = 0; i < b->n; i++)
            b->lens[i] = len;
        break;
    }
    case 2: /* every magnitude, a tenth empty */
        b->n = rng_in(1, SKV_MAX_N);
        for (int64_t i = 0; i < b->n; i++)
            b->lens[i] = rng_in(0, 9) == 0 ? 0 : rng_log(18);
        break;
    case 3: /* mostly empty items */
        b->n = rng_in(1, 64);
        for (int64_t i = 0; i < b->n; i++)
            b->lens[i] = rng_in(0, 4) == 0 ? rng_log(16) : 0;
        break;
    case 4: /* tiny steps, the empty step included */
        b->n = rng_in(0, 4);
        for (int64_t i = 0; i < b->n; i++)
            b->lens[i] = rng_in(0, 16);
        break;
    default: /* a few long requests among many short ones */
        b->n = rng_in(8, SKV_MAX_N);
        for (int64_t i = 0; i < b->n; i++)
            b->lens[i] = rng_in(0, 7) == 0 ? rng_in(16384, 262144) : rng_in(1, 2048);
        break;
    }
    const int rows_kind = (int)rng_in(0, 4);
    const int64_t k1 = rng_in(2, 9); /* k + 1 rows: k drafts verified */
    for (int64_t i = 0; i < b->n; i++) {
        switch (rows_kind) {
        case 0: /* decode */
            b->rows[i] = 1;
            break;
        case 1: /* every request verifies k drafts */
            b->rows[i] = k1;
            break;
        case 2: /* mixed draft lengths */
            b->rows[i] = rng_in(1, 9);
            break;
        case 3: /* prefill chunks among decodes */
            b->rows[i] = rng_in(0, 2) == 0 ? rng_in(17, 2048) : rng_in(1, 9);
            break;
        default: /* 0 rows, and both sides of 16 */
            b->rows[i] = rng_in(0, 18);
            break;
        }
    }
    b->heads = rng_in(0, 3) == 0 ? ((int64_t[]){1, 8, 32, 64, 128})[rng_in(0, 4)] : rng_in(1, 128);
    b->bt = rng_in(0, 3) == 0 ? ((int64_t[]){1, 16, 64, 128, 256})[rng_in(0, 4)] : rng_in(1, 256);
    b->units = rng_in(0, 3) == 0 ? ((int64_t[]){1, 2, 16, 132, 256})[rng_in(0, 4)] : rng_in(1, 256);
}

#endif
