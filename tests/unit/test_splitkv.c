/*
 * Property tests of the split-KV planner (kernels/splitkv.h): thousands of seeded random batches
 * (one long request beside many short ones, uniform ones, empty items, decode / draft-verify /
 * prefill rows, 1..128 heads, 1..256-position blocks, 1..256 units) planned in all three modes,
 * each plan checked against the contract (splitkv_check.h) and, per request, against the balance
 * bounds derived below from the planner's formulas; every bad input's DUET_ERR_INVALID; a work
 * list too small for the plan refused with DUET_ERR_RANGE and nothing written past it.
 */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/splitkv.h"

#define DUET_TEST_RNG_SEED 0x5eed5b117c0ffeeull
#include "tests/unit/splitkv_check.h"

#define SKV_BATCHES 4000

/* Plan storage sized by duet_splitkv_max_work. */
typedef struct {
    int32_t splits[SKV_MAX_N], work0[SKV_MAX_N + 1];
    duet_splitkv_work_t *work;
    int64_t cap;
} store_t;

static duet_splitkv_plan_t plan_batch(const batch_t *b, duet_splitkv_mode_t mode, store_t *st,
                                      duet_splitkv_in_t *in)
{
    *in = (duet_splitkv_in_t){.n_items = b->n,
                              .lens = b->lens,
                              .rows = b->rows,
                              .heads = b->heads,
                              .block_tokens = b->bt,
                              .units = b->units,
                              .mode = mode};
    st->cap = duet_splitkv_max_work(b->n, b->heads, b->units);
    st->work = malloc((size_t)st->cap * sizeof(*st->work));
    cr_assert_not_null(st->work);
    duet_splitkv_plan_t p = {.splits = st->splits, .work0 = st->work0, .work = st->work};
    const duet_status_t s = duet_splitkv_plan(in, &p, st->cap);
    cr_assert_eq(s, DUET_OK, "plan failed: %s", duet_error_last());
    return p;
}

/* What the random batches exercised, so that a property test cannot pass vacuously. */
typedef struct {
    int64_t plans, split_items, capped_by_blocks, prefill_items, empty_items, bound_b_batches;
    int64_t uniform_items, pieces_checked;
} seen_t;

/*
 * The balance bounds of a PER_REQUEST plan, from the formulas in splitkv.h. Notation: T the
 * step's cost (sum of c_i = b_i x r_i, r_i an item's rows with 0 counted as 1), W = want_work
 * = ceil(WAVES x units / heads), chunk = max(1, ceil(T / W)), and an item with r_i <= MAX_ROWS
 * and b_i >= 2 blocks gets s_i = min(ceil(c_i / chunk), b_i, MAX_SPLITS) pieces of floor or
 * ceil(b_i / s_i) blocks (duet_splitkv_range); every other item one piece.
 *
 * (0) The MAX_SPLITS cap never binds while W <= MAX_SPLITS: chunk >= T / W, so
 *     c_i / chunk <= W c_i / T <= W. The random batches have units <= 256, so W <= 2048.
 *
 * (A) No piece of an item with r <= MAX_ROWS costs more than chunk + r - 1.
 *     If s = ceil(c / chunk): s x chunk >= b r, so b / s <= chunk / r and the largest piece,
 *     ceil(b / s) blocks, is at most ceil(chunk / r) <= (chunk + r - 1) / r blocks: its cost
 *     is at most chunk + r - 1. If s = b < ceil(c / chunk): pieces of one block, cost
 *     r <= chunk + r - 1 since chunk >= 1. An item of one block: cost r, the same.
 *
 * (A') A piece of a split item (s >= 2) costs more than chunk / 2 - r.
 *     If s = ceil(c / chunk) >= 2: c > (s - 1) chunk >= s chunk / 2, and the smallest piece
 *     has floor(b / s) > b / s - 1 blocks, so it costs more than c / s - r > chunk / 2 - r.
 *     If s = b: then ceil(b r / chunk) > b means r > chunk, and chunk / 2 - r < 0 < r.
 *
 * (B) n_work x chunk >= sum over non-empty items of: min(c_i, b_i x chunk) if r_i <= MAX_ROWS,
 *     chunk otherwise.
 *     An item with r <= MAX_ROWS and b >= 2 has s = min(ceil(c / chunk), b) >= min(c, b chunk)
 *     / chunk (by (0)); b = 1 gives s = 1 = b; a longer-row item s = 1.
 *
 * (C) The headline: when every non-empty item has r_i <= MAX_ROWS, T >= W and chunk >= R (the
 *     most rows of any item, r_i counted as above; chunk >= R follows from T >= R x W), then
 *     2 x n_work x heads > WAVES x units: the step has at least half the waves it aims at.
 *     By (B) with c_i = b_i r_i <= b_i chunk, n_work x chunk >= T. chunk < T / W + 1 <= 2 T / W
 *     (T >= W), so n_work > T / chunk > W / 2, i.e. 2 n_work >= W + 1, and W x heads >= WAVES x
 *     units by W's rounding up: 2 n_work heads >= W heads + heads > WAVES units.
 *
 * (D) n_work <= (non-empty items) + W: s_i <= ceil(c_i / chunk) < c_i / chunk + 1 for an item
 *     of at most MAX_ROWS rows, 1 for the rest, and sum c_i / chunk = T / chunk <= W.
 */
static void check_per_request(const duet_splitkv_in_t *in, const duet_splitkv_plan_t *p,
                              seen_t *seen)
{
    const int64_t W = skv_ref_want(in->heads, in->units);
    int64_t T = 0, R = 1, nonempty = 0, need = 0;
    bool long_rows = false;
    for (int64_t i = 0; i < in->n_items; i++) {
        const int64_t b = skv_ref_blocks(in->lens[i], in->block_tokens);
        T += b * skv_ref_rows(in->rows[i]);
    }
    const int64_t chunk = (T + W - 1) / W > 0 ? (T + W - 1) / W : 1;
    cr_assert_eq(p->chunk, chunk, "chunk %lld, want ceil(T %lld / W %lld)", (long long)p->chunk,
                 (long long)T, (long long)W);
    cr_assert(W <= DUET_SPLITKV_MAX_SPLITS, "premise (0): W %lld", (long long)W);
    for (int64_t i = 0; i < in->n_items; i++) {
        const int64_t b = skv_ref_blocks(in->lens[i], in->block_tokens);
        const int64_t r = skv_ref_rows(in->rows[i]), c = b * r;
        if (b == 0)
            continue;
        nonempty++;
        if (in->rows[i] > DUET_SPLITKV_MAX_ROWS) {
            long_rows = true;
            need += chunk;
            continue;
        }
        R = r > R ? r : R;
        need += c < b * chunk ? c : b * chunk;
        const int32_t s = p->splits[i];
        for (int32_t w = p->work0[i]; w < p->work0[i + 1]; w++) {
            const int64_t cost = (int64_t)(p->work[w].block1 - p->work[w].block0) * r;
            cr_assert(cost <= chunk + r - 1,
                      "(A) item %lld (%lld blocks x %lld rows, %d splits): a piece costs %lld, "
                      "chunk %lld",
                      (long long)i, (long long)b, (long long)r, s, (long long)cost,
                      (long long)chunk);
            if (s >= 2)
                cr_assert(2 * (cost + r) > chunk,
                          "(A') item %lld: a piece of %lld against chunk %lld (%lld rows)",
                          (long long)i, (long long)cost, (long long)chunk, (long long)r);
            seen->pieces_checked++;
        }
        seen->capped_by_blocks += s >= 2 && s == b && (c + chunk - 1) / chunk > b;
    }
    cr_assert(p->n_work * chunk >= need, "(B) n_work %lld x chunk %lld < %lld",
              (long long)p->n_work, (long long)chunk, (long long)need);
    cr_assert(p->n_work <= nonempty + W, "(D) n_work %lld > %lld non-empty items + W %lld",
              (long long)p->n_work, (long long)nonempty, (long long)W);
    if (!long_rows && nonempty > 0 && T >= W && chunk >= R) {
        cr_assert(2 * p->n_work * in->heads > DUET_SPLITKV_WAVES * in->units,
                  "(C) %lld work items x %lld heads: under half of %d waves x %lld units "
                  "(T %lld, W %lld, chunk %lld, R %lld)",
                  (long long)p->n_work, (long long)in->heads, DUET_SPLITKV_WAVES,
                  (long long)in->units, (long long)T, (long long)W, (long long)chunk, (long long)R);
        seen->bound_b_batches++;
    }
}

/*
 * UNIFORM: one count S for the step, from the number of items n (empty ones included) and the
 * longest item's blocks B: S = ceil(W / n), at most B and MAX_SPLITS, at least 1; an item of
 * b blocks and at most MAX_ROWS rows gets min(S, b) (b >= 1). And when neither cap binds, S is
 * the fewest splits that give the step W work items: n S >= W > n (S - 1).
 */
static void check_uniform(const duet_splitkv_in_t *in, const duet_splitkv_plan_t *p, seen_t *seen)
{
    const int64_t n = in->n_items, W = skv_ref_want(in->heads, in->units);
    if (n == 0)
        return;
    int64_t B = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t b = skv_ref_blocks(in->lens[i], in->block_tokens);
        B = b > B ? b : B;
    }
    int64_t S = (W + n - 1) / n;
    const bool capped = S > B || S > DUET_SPLITKV_MAX_SPLITS;
    S = S > B ? B : S;
    S = S > DUET_SPLITKV_MAX_SPLITS ? DUET_SPLITKV_MAX_SPLITS : S;
    S = S < 1 ? 1 : S;
    if (!capped && S > 1)
        cr_assert(n * S >= W && n * (S - 1) < W, "S %lld for %lld items, W %lld", (long long)S,
                  (long long)n, (long long)W);
    int32_t common = 0; /* the count every item with at least S blocks shares */
    for (int64_t i = 0; i < n; i++) {
        const int64_t b = skv_ref_blocks(in->lens[i], in->block_tokens);
        if (b == 0 || in->rows[i] > DUET_SPLITKV_MAX_ROWS)
            continue;
        const int64_t want = S < b ? S : b;
        cr_assert_eq(p->splits[i], want, "uniform: item %lld (%lld blocks) split %d ways, S %lld",
                     (long long)i, (long long)b, p->splits[i], (long long)S);
        if (b >= S) {
            cr_assert(common == 0 || p->splits[i] == common,
                      "uniform: item %lld split %d ways, another %d", (long long)i, p->splits[i],
                      common);
            common = p->splits[i];
        }
        seen->uniform_items++;
    }
}

Test(splitkv, random_batches_keep_the_contract, .timeout = 240)
{
    rng_state = DUET_TEST_RNG_SEED;
    static batch_t b;
    seen_t seen = {0};
    static const duet_splitkv_mode_t modes[] = {DUET_SPLITKV_PER_REQUEST, DUET_SPLITKV_UNIFORM,
                                                DUET_SPLITKV_NONE};
    for (int k = 0; k < SKV_BATCHES; k++) {
        gen_batch(&b);
        for (size_t m = 0; m < 3; m++) {
            store_t st;
            duet_splitkv_in_t in;
            const duet_splitkv_plan_t p = plan_batch(&b, modes[m], &st, &in);
            char what[96];
            snprintf(what, sizeof(what), "batch %d (%lld items), mode %d", k, (long long)b.n,
                     (int)modes[m]);
            skv_check_plan(&in, &p, what);
            if (modes[m] == DUET_SPLITKV_PER_REQUEST) {
                check_per_request(&in, &p, &seen);
                for (int64_t i = 0; i < b.n; i++) {
                    seen.split_items += p.splits[i] > 1;
                    seen.prefill_items += b.rows[i] > DUET_SPLITKV_MAX_ROWS && b.lens[i] > 0;
                    seen.empty_items += b.lens[i] == 0;
                }
            } else if (modes[m] == DUET_SPLITKV_UNIFORM) {
                check_uniform(&in, &p, &seen);
            }
            seen.plans++;
            free(st.work);
        }
    }
    printf("[splitkv] %lld plans; per request: %lld split items (%lld capped by their blocks), "
           "%lld prefill items, %lld empty items, %lld pieces bounded, %lld batches with bound "
           "(C); uniform: %lld items\n",
           (long long)seen.plans, (long long)seen.split_items, (long long)seen.capped_by_blocks,
           (long long)seen.prefill_items, (long long)seen.empty_items,
           (long long)seen.pieces_checked, (long long)seen.bound_b_batches,
           (long long)seen.uniform_items);
    /* Every property was exercised, not passed for want of cases. */
    cr_assert(seen.split_items >= 1000 && seen.capped_by_blocks >= 20 &&
                  seen.prefill_items >= 1000 && seen.empty_items >= 1000 &&
                  seen.bound_b_batches >= 200 && seen.uniform_items >= 1000,
              "the random batches missed a case (counts above)");
}

/* The same input twice gives the same plan, byte for byte (the planner is pure). */
Test(splitkv, pure)
{
    rng_state = DUET_TEST_RNG_SEED ^ 0x1234;
    static batch_t b;
    for (int k = 0; k < 200; k++) {
        gen_batch(&b);
        store_t s1, s2;
        duet_splitkv_in_t in;
        const duet_splitkv_plan_t p1 = plan_batch(&b, DUET_SPLITKV_PER_REQUEST, &s1, &in);
        const duet_splitkv_plan_t p2 = plan_batch(&b, DUET_SPLITKV_PER_REQUEST, &s2, &in);
        cr_assert(p1.n_work == p2.n_work && p1.chunk == p2.chunk);
        cr_assert(memcmp(s1.splits, s2.splits, (size_t)b.n * sizeof(int32_t)) == 0);
        cr_assert(memcmp(s1.work0, s2.work0, (size_t)(b.n + 1) * sizeof(int32_t)) == 0);
        cr_assert(memcmp(s1.work, s2.work, (size_t)p1.n_work * sizeof(*s1.work)) == 0);
        free(s1.work);
        free(s2.work);
    }
}

/*
 * The example: one request at 128K (1024 blocks of 128) beside 63 of 100 positions,
 * 32 heads, 132 units. Per request, only the long one is split, into about its share of the
 * step's work items; uniform and none leave it whole, the whole step waiting on it.
 */
Test(splitkv, one_long_request_beside_short_ones)
{
    int64_t lens[64], rows[64];
    for (int i = 0; i < 64; i++) {
        lens[i] = i == 0 ? 131072 : 100;
        rows[i] = 1;
    }
    batch_t b = {.n = 64, .heads = 32, .bt = 128, .units = 132};
    memcpy(b.lens, lens, sizeof(lens));
    memcpy(b.rows, rows, sizeof(rows));
    store_t st;
    duet_splitkv_in_t in;
    duet_splitkv_plan_t p = plan_batch(&b, DUET_SPLITKV_PER_REQUEST, &st, &in);
    skv_check_plan(&in, &p, "issue example");
    const int64_t W = skv_ref_want(32, 132), T = 1024 + 63;
    const int64_t chunk = (T + W - 1) / W;
    cr_assert_eq(p.chunk, chunk);
    cr_assert_eq(p.splits[0], (1024 + chunk - 1) / chunk, "the long request: %d splits",
                 p.splits[0]);
    for (int i = 1; i < 64; i++)
        cr_assert_eq(p.splits[i], 1, "short request %d split %d ways", i, p.splits[i]);
    free(st.work);
    /* The uniform count comes from (64 items, W): ceil(W / 64) = 1 here, so nothing splits. */
    p = plan_batch(&b, DUET_SPLITKV_UNIFORM, &st, &in);
    cr_assert_eq(p.splits[0], (W + 63) / 64);
    cr_assert_eq(p.n_work, 64);
    free(st.work);
}

/* One item of a million blocks, one head, 65536 units: W = 2^19 work items, far more than one
 * item may be split into; the cap holds and the list still covers every block. */
Test(splitkv, max_splits_cap)
{
    batch_t b = {.n = 1, .heads = 1, .bt = 1, .units = 1 << 16};
    b.lens[0] = 1 << 20;
    b.rows[0] = 1;
    store_t st;
    duet_splitkv_in_t in;
    const duet_splitkv_plan_t p = plan_batch(&b, DUET_SPLITKV_PER_REQUEST, &st, &in);
    skv_check_plan(&in, &p, "max splits");
    cr_assert_eq(p.splits[0], DUET_SPLITKV_MAX_SPLITS);
    free(st.work);
    const duet_splitkv_plan_t u = plan_batch(&b, DUET_SPLITKV_UNIFORM, &st, &in);
    skv_check_plan(&in, &u, "max splits, uniform");
    cr_assert_eq(u.splits[0], DUET_SPLITKV_MAX_SPLITS);
    free(st.work);
}

/* The block count of a length near int64's end is formed without passing it. */
Test(splitkv, blocks_at_int64_end)
{
    cr_assert_eq(duet_splitkv_blocks(INT64_MAX, 1), INT64_MAX);
    cr_assert_eq(duet_splitkv_blocks(INT64_MAX, 2), INT64_MAX / 2 + 1);
    cr_assert_eq(duet_splitkv_blocks(INT64_MAX, INT64_MAX), 1);
    cr_assert_eq(duet_splitkv_blocks(INT64_MAX - 1, INT64_MAX), 1);
    cr_assert_eq(duet_splitkv_blocks(0, 7), 0);
    cr_assert_eq(duet_splitkv_blocks(-5, 7), 0);
    for (int64_t bt = 1; bt <= 300; bt++)
        for (int64_t len = 0; len <= 1000; len++)
            cr_assert_eq(duet_splitkv_blocks(len, bt), skv_ref_blocks(len, bt), "len %lld bt %lld",
                         (long long)len, (long long)bt);
}

/* Each bad input alone, in an otherwise good step: DUET_ERR_INVALID and a detail naming it. */
Test(splitkv, bad_inputs_are_invalid)
{
    int64_t lens[3] = {100, 4096, 0}, rows[3] = {1, 4, 1};
    int32_t splits[3], work0[4];
    duet_splitkv_work_t work[64];
    const duet_splitkv_in_t good = {.n_items = 3,
                                    .lens = lens,
                                    .rows = rows,
                                    .heads = 8,
                                    .block_tokens = 64,
                                    .units = 16,
                                    .mode = DUET_SPLITKV_PER_REQUEST};
    duet_splitkv_plan_t p = {.splits = splits, .work0 = work0, .work = work};
    cr_assert_eq(duet_splitkv_plan(&good, &p, 64), DUET_OK, "%s", duet_error_last());

    static const struct {
        const char *what;
        int field; /* which field of the input is bad */
        int64_t value;
        const char *says;
    } cases[] = {
        {"negative item count", 0, -1, "-1 items"},
        {"zero heads", 1, 0, "0 heads"},
        {"negative heads", 1, -3, "-3 heads"},
        {"heads past int32", 1, (int64_t)INT32_MAX + 1, "2147483648 heads"},
        {"heads at int64's end", 1, INT64_MAX, "heads"},
        {"zero block size", 2, 0, "0-token blocks"},
        {"negative block size", 2, -64, "-64-token blocks"},
        {"zero units", 3, 0, "0 units"},
        {"units past int32", 3, (int64_t)INT32_MAX + 1, "2147483648 units"},
        {"units at int64's end", 3, INT64_MAX, "units"},
        {"negative length", 4, -1, "item 1 has length -1"},
        {"negative rows", 5, -2, "-2 rows"},
        {"blocks past int32", 4, ((int64_t)INT32_MAX + 1) * 64, "blocks (more than int32)"},
        {"length at int64's end", 4, INT64_MAX, "blocks (more than int32)"},
        {"cost past the limit", 5, INT64_MAX / 2, "cost (blocks x rows) passes"},
        {"lens NULL", 6, 0, "items"},
        {"rows NULL", 7, 0, "items"},
    };
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        int64_t l2[3], r2[3];
        memcpy(l2, lens, sizeof(l2));
        memcpy(r2, rows, sizeof(r2));
        duet_splitkv_in_t in = good;
        in.lens = l2;
        in.rows = r2;
        switch (cases[k].field) {
        case 0:
            in.n_items = cases[k].value;
            break;
        case 1:
            in.heads = cases[k].value;
            break;
        case 2:
            in.block_tokens = cases[k].value;
            break;
        case 3:
            in.units = cases[k].value;
            break;
        case 4:
            l2[1] = cases[k].value;
            break;
        case 5:
            r2[1] = cases[k].value;
            break;
        case 6:
            in.lens = NULL;
            break;
        default:
            in.rows = NULL;
            break;
        }
        duet_error_clear();
        const duet_status_t st = duet_splitkv_plan(&in, &p, 64);
        cr_expect_eq(st, DUET_ERR_INVALID, "%s: status %s", cases[k].what, duet_status_name(st));
        cr_expect(strstr(duet_error_last(), cases[k].says) != NULL,
                  "%s: detail \"%s\" does not say \"%s\"", cases[k].what, duet_error_last(),
                  cases[k].says);
    }
    /* The cost limit is on the step's sum: items each under it but together past it. */
    int64_t big_l[4], big_r[4];
    for (int i = 0; i < 4; i++) {
        big_l[i] = (int64_t)INT32_MAX; /* INT32_MAX blocks of one position */
        big_r[i] = (int64_t)1 << 30;   /* each item ~2^61, under the limit by a little */
    }
    const duet_splitkv_in_t sum = {
        .n_items = 4, .lens = big_l, .rows = big_r, .heads = 1, .block_tokens = 1, .units = 1};
    int32_t s4[4], w4[5];
    duet_splitkv_plan_t p4 = {.splits = s4, .work0 = w4, .work = work};
    const duet_status_t st = duet_splitkv_plan(&sum, &p4, 64);
    cr_expect_eq(st, DUET_ERR_INVALID, "a step costing ~2^63: %s", duet_status_name(st));
    cr_expect(strstr(duet_error_last(), "at item 1") != NULL, "%s", duet_error_last());
}

/* The largest values the planner accepts plan without trouble (no overflow on the way): an
 * item of int32's most blocks, the most heads and units. The item's 2^31 blocks are too many
 * for skv_check_plan's bitmap; its pieces are checked to tile it instead. */
Test(splitkv, limits_accepted)
{
    int64_t lens[2] = {(int64_t)INT32_MAX * 1024, 1}, rows[2] = {16, 1};
    int32_t splits[2], work0[3];
    const duet_splitkv_in_t in = {.n_items = 2,
                                  .lens = lens,
                                  .rows = rows,
                                  .heads = DUET_SPLITKV_MAX_UNITS,
                                  .block_tokens = 1024,
                                  .units = DUET_SPLITKV_MAX_UNITS};
    const int64_t cap = duet_splitkv_max_work(2, in.heads, in.units);
    duet_splitkv_work_t *work = malloc((size_t)cap * sizeof(*work));
    cr_assert_not_null(work);
    duet_splitkv_plan_t p = {.splits = splits, .work0 = work0, .work = work};
    cr_assert_eq(duet_splitkv_plan(&in, &p, cap), DUET_OK, "%s", duet_error_last());
    cr_assert(splits[0] >= 2 && splits[1] == 1 && work0[0] == 0 && work0[1] == splits[0] &&
                  work0[2] == splits[0] + 1 && p.n_work == splits[0] + 1,
              "splits %d, %d; n_work %lld", splits[0], splits[1], (long long)p.n_work);
    int32_t next = 0;
    for (int32_t w = 0; w < splits[0]; w++) {
        cr_assert(work[w].item == 0 && work[w].split == w && work[w].block0 == next &&
                  work[w].block1 > next);
        next = work[w].block1;
    }
    cr_assert_eq(next, INT32_MAX);
    cr_assert(work[splits[0]].item == 1 && work[splits[0]].block0 == 0 &&
              work[splits[0]].block1 == 1);
    free(work);
}

/* A work list one entry too small: DUET_ERR_RANGE, and the entries past it untouched. */
Test(splitkv, work_cap_too_small)
{
    rng_state = DUET_TEST_RNG_SEED ^ 0xcafe;
    static batch_t b;
    int tried = 0;
    for (int k = 0; k < 500; k++) {
        gen_batch(&b);
        store_t st;
        duet_splitkv_in_t in;
        const duet_splitkv_plan_t full = plan_batch(&b, DUET_SPLITKV_PER_REQUEST, &st, &in);
        free(st.work);
        if (full.n_work == 0)
            continue;
        for (int64_t cap = full.n_work - 1; cap >= 0; cap = cap > 3 ? cap / 2 : cap - 1) {
            enum { CANARY = 16 };
            duet_splitkv_work_t *work = malloc((size_t)(cap + CANARY) * sizeof(*work));
            cr_assert_not_null(work);
            memset(work, 0xa5, (size_t)(cap + CANARY) * sizeof(*work));
            int32_t splits[SKV_MAX_N], work0[SKV_MAX_N + 1];
            duet_splitkv_plan_t p = {.splits = splits, .work0 = work0, .work = work};
            const duet_status_t s = duet_splitkv_plan(&in, &p, cap);
            cr_assert_eq(s, DUET_ERR_RANGE, "batch %d: cap %lld of %lld: %s", k, (long long)cap,
                         (long long)full.n_work, duet_status_name(s));
            const uint8_t *tail = (const uint8_t *)(work + cap);
            for (size_t j = 0; j < CANARY * sizeof(*work); j++)
                cr_assert_eq(tail[j], 0xa5, "batch %d: cap %lld: byte %zu past the cap written", k,
                             (long long)cap, j);
            free(work);
            tried++;
        }
        /* Exactly enough room is enough. */
        duet_splitkv_work_t *work = malloc((size_t)full.n_work * sizeof(*work));
        int32_t splits[SKV_MAX_N], work0[SKV_MAX_N + 1];
        duet_splitkv_plan_t p = {.splits = splits, .work0 = work0, .work = work};
        cr_assert_eq(duet_splitkv_plan(&in, &p, full.n_work), DUET_OK, "%s", duet_error_last());
        cr_assert_eq(p.n_work, full.n_work);
        free(work);
    }
    cr_assert(tried >= 1000, "only %d too-small lists tried", tried);
}

/* No items: no work, and work0[0] = 0. */
Test(splitkv, empty_step)
{
    int32_t work0[1] = {-1};
    duet_splitkv_work_t work[1];
    const duet_splitkv_in_t in = {.n_items = 0, .heads = 4, .block_tokens = 16, .units = 8};
    duet_splitkv_plan_t p = {.splits = NULL, .work0 = work0, .work = work};
    cr_assert_eq(duet_splitkv_plan(&in, &p, 0), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(p.n_work, 0);
    cr_assert_eq(work0[0], 0);
}
