/*
 * test_kernels_cpu_mla.c: the CPU's planned MLA attention (kernels/cpu/cpu_mla.h) against a naive
 * double-precision softmax written here, and against itself under every plan.
 *
 * Batches: skewed (one item of several thousand positions beside many of a few hundred), uniform,
 * and with verify items (5 query rows at the end of a context). The reference bound is the
 * rounding bound of the weighted sum: |lat_j - ref_j| <= 2e-5 * sum_s p_s |c_s,j| + 1e-7, with
 * p the reference's softmax weights (fp32 accumulation over a few thousand terms, a softmax and
 * a log-sum-exp merge per 256-position segment). Across plans (no split, per request at 1 to 64
 * units, one uniform count), page sizes, and an item alone against it in a batch, the outputs
 * must be bit-identical: the plan decides who computes a segment, never how.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <criterion/criterion.h>

#include "kernels/cpu/cpu_mla.h"
#include "kernels/kernels.h"

#define DUET_TEST_RNG_SEED 0x5eed5eedcafef00dull
#include "test_rng.h"

#define R  64 /* kv_lora_rank (small: the arithmetic does not depend on it) */
#define DR 16 /* qk_rope_head_dim */
#define NH 3  /* heads */

typedef struct {
    int64_t n_items, n_rows;
    int64_t *row0, *pos0;
    int32_t **pages;
    int32_t *page_store;
    float *kv; /* one layer: [pages][page_tokens][R + DR] */
    duet_kv_layout_t layout;
    float *qhat, *qr; /* [n_rows][NH][R], [n_rows][NH][DR] */
    float *tok;       /* [items][max positions][R + DR]: the cache's rows by position */
    int64_t max_pos;
} batch_t;

/* A batch of items with lens[i] positions each (their last rows[i] are the step's rows), the
 * cache's rows by position drawn once per item (the same for any page size), pages shuffled. */
static void batch_make(batch_t *b, const int64_t *lens, const int64_t *rows, int64_t n,
                       int64_t page_tokens, uint64_t seed)
{
    memset(b, 0, sizeof(*b));
    b->n_items = n;
    b->row0 = calloc((size_t)n + 1, sizeof(int64_t));
    b->pos0 = calloc((size_t)n, sizeof(int64_t));
    b->pages = calloc((size_t)n, sizeof(int32_t *));
    int64_t n_pages = 0;
    for (int64_t i = 0; i < n; i++) {
        b->row0[i + 1] = b->row0[i] + rows[i];
        b->pos0[i] = lens[i] - rows[i];
        n_pages += (lens[i] + page_tokens - 1) / page_tokens;
        b->max_pos = lens[i] > b->max_pos ? lens[i] : b->max_pos;
    }
    b->n_rows = b->row0[n];
    const int64_t td = R + DR;
    b->layout = (duet_kv_layout_t){
        .page_tokens = (uint64_t)page_tokens, .n_layers = 1, .token_bytes = (uint64_t)td * 4};
    b->kv = calloc((size_t)(n_pages * page_tokens * td), sizeof(float));
    b->page_store = malloc((size_t)n_pages * sizeof(int32_t));
    /* page ids in a scrambled order (an odd stride over the pool) */
    for (int64_t p = 0; p < n_pages; p++)
        b->page_store[p] = (int32_t)((p * 7 + 3) % n_pages);
    if (n_pages % 7 == 0)
        for (int64_t p = 0; p < n_pages; p++)
            b->page_store[p] = (int32_t)p;
    b->tok = malloc((size_t)(n * b->max_pos * td) * sizeof(float));
    rng_state = seed;
    int64_t used = 0;
    for (int64_t i = 0; i < n; i++) {
        b->pages[i] = b->page_store + used;
        used += (lens[i] + page_tokens - 1) / page_tokens;
        for (int64_t s = 0; s < lens[i]; s++) {
            float *t = b->tok + (i * b->max_pos + s) * td;
            for (int64_t j = 0; j < td; j++)
                t[j] = rng_f();
            float *dst =
                b->kv +
                ((int64_t)b->pages[i][s / page_tokens] * page_tokens + s % page_tokens) * td;
            memcpy(dst, t, sizeof(float) * (size_t)td);
        }
    }
    b->qhat = malloc((size_t)(b->n_rows * NH * R) * sizeof(float));
    b->qr = malloc((size_t)(b->n_rows * NH * DR) * sizeof(float));
    for (int64_t x = 0; x < b->n_rows * NH * R; x++)
        b->qhat[x] = rng_f();
    for (int64_t x = 0; x < b->n_rows * NH * DR; x++)
        b->qr[x] = rng_f();
}

static void batch_free(batch_t *b)
{
    free(b->row0);
    free(b->pos0);
    free(b->pages);
    free(b->page_store);
    free(b->kv);
    free(b->tok);
    free(b->qhat);
    free(b->qr);
}

/* Run the attention over b with `mode` aiming at `units` on a pool of `threads`; lat out. */
static void attend(const batch_t *b, int threads, duet_splitkv_mode_t mode, int64_t units,
                   float *lat, duet_cpu_mla_ws_t *ws_out)
{
    duet_kernels_t *k = NULL;
    cr_assert_eq(duet_kernels_create(DUET_DEVICE_CPU, threads, &k), DUET_OK);
    const duet_cpu_step_t st = {.n_items = b->n_items,
                                .n_rows = b->n_rows,
                                .item_row0 = b->row0,
                                .item_pos0 = b->pos0,
                                .item_pages = (const int32_t *const *)b->pages};
    const duet_cpu_mla_layer_t ly = {
        .kv_base = b->kv, .layout = b->layout, .layer = 0, .n_heads = NH, .r = R, .dr = DR};
    const int64_t per = duet_cpu_mla_scratch_floats(NH, R);
    float *scratch = malloc((size_t)(threads * per) * sizeof(float));
    duet_cpu_mla_ws_t ws = {.mode = mode, .units = units};
    for (int64_t x = 0; x < b->n_rows * NH * R; x++)
        lat[x] = NAN;
    cr_assert_eq(duet_cpu_mla_plan(k, &st, NH, R, &ws), DUET_OK, "%s", duet_error_last());
    duet_cpu_mla_attend(k, &st, &ly, b->qhat, b->qr, NH * DR, DR, 0.125f, lat, NULL, scratch, per,
                        &ws);
    if (ws_out != NULL) {
        *ws_out = ws; /* the caller frees it */
    } else {
        duet_cpu_mla_ws_free(&ws);
    }
    free(scratch);
    duet_kernels_destroy(k);
}

/* Every (row, head) against the double-precision softmax; returns the worst error / bound. */
static double check_reference(const batch_t *b, const float *lat)
{
    const int64_t td = R + DR;
    double worst = 0;
    double *p = malloc((size_t)b->max_pos * sizeof(double));
    for (int64_t i = 0; i < b->n_items; i++)
        for (int64_t row = b->row0[i]; row < b->row0[i + 1]; row++) {
            const int64_t last = b->pos0[i] + (row - b->row0[i]);
            for (int64_t h = 0; h < NH; h++) {
                const float *qh = b->qhat + (row * NH + h) * R, *q_r = b->qr + (row * NH + h) * DR;
                double mx = -INFINITY, sum = 0;
                for (int64_t s = 0; s <= last; s++) {
                    const float *t = b->tok + (i * b->max_pos + s) * td;
                    double a = 0;
                    for (int64_t j = 0; j < R; j++)
                        a += (double)qh[j] * t[j];
                    for (int64_t j = 0; j < DR; j++)
                        a += (double)q_r[j] * t[R + j];
                    p[s] = a * 0.125;
                    mx = p[s] > mx ? p[s] : mx;
                }
                for (int64_t s = 0; s <= last; s++)
                    sum += p[s] = exp(p[s] - mx);
                for (int64_t j = 0; j < R; j++) {
                    double ref = 0, mag = 0;
                    for (int64_t s = 0; s <= last; s++) {
                        const double c = b->tok[(i * b->max_pos + s) * td + j];
                        ref += p[s] / sum * c;
                        mag += p[s] / sum * fabs(c);
                    }
                    const double got = lat[(row * NH + h) * R + j];
                    const double bound = 2e-5 * mag + 1e-7, err = fabs(got - ref);
                    cr_assert(err <= bound,
                              "item %lld row %lld head %lld dim %lld: %.9g, reference %.9g "
                              "(error %.3g > bound %.3g)",
                              (long long)i, (long long)row, (long long)h, (long long)j, got, ref,
                              err, bound);
                    worst = err / bound > worst ? err / bound : worst;
                }
            }
        }
    free(p);
    return worst;
}

/* A skewed batch (one long item, many short, two verify items of 5 rows) and a uniform one. */
static const int64_t skew_lens[] = {4100, 300, 17, 256, 257, 90, 511, 1, 2000, 130, 60, 700};
static const int64_t skew_rows[] = {1, 1, 1, 1, 1, 5, 1, 1, 5, 1, 1, 1};
#define N_SKEW ((int64_t)(sizeof(skew_lens) / sizeof(skew_lens[0])))
static const int64_t uni_lens[] = {640, 641, 639, 640, 700, 600, 640, 655};
static const int64_t uni_rows[] = {1, 1, 1, 5, 1, 1, 1, 1};
#define N_UNI ((int64_t)(sizeof(uni_lens) / sizeof(uni_lens[0])))

static atomic_int seen[1000];
static atomic_int bad_range;

static void count_task(void *ctx, int64_t b, int64_t e, int tid)
{
    (void)ctx;
    (void)tid;
    if (e != b + 1)
        atomic_fetch_add(&bad_range, 1);
    atomic_fetch_add(&seen[b], 1);
}

Test(kernels_cpu_mla, parallel_each_runs_every_index_once, .timeout = 30)
{
    duet_kernels_t *k = NULL;
    cr_assert_eq(duet_kernels_create(DUET_DEVICE_CPU, 3, &k), DUET_OK);
    for (int rep = 0; rep < 20; rep++) {
        for (int i = 0; i < 1000; i++)
            atomic_store(&seen[i], 0);
        const int64_t n = 1 + rep * 47;
        duet_k_parallel_each(k, n, count_task, NULL);
        for (int64_t i = 0; i < 1000; i++)
            cr_assert_eq(atomic_load(&seen[i]), i < n ? 1 : 0, "index %lld of %lld", (long long)i,
                         (long long)n);
    }
    cr_assert_eq(atomic_load(&bad_range), 0, "every task is one index");
    duet_kernels_destroy(k);
}

Test(kernels_cpu_mla, skewed_and_uniform_batches_match_the_reference, .timeout = 120)
{
    const struct {
        const int64_t *lens, *rows;
        int64_t n;
    } bs[] = {{skew_lens, skew_rows, N_SKEW}, {uni_lens, uni_rows, N_UNI}};
    for (size_t c = 0; c < sizeof(bs) / sizeof(bs[0]); c++) {
        batch_t b;
        batch_make(&b, bs[c].lens, bs[c].rows, bs[c].n, 16, 11 + c);
        float *lat = malloc((size_t)(b.n_rows * NH * R) * sizeof(float));
        duet_cpu_mla_ws_t ws;
        attend(&b, 2, DUET_SPLITKV_PER_REQUEST, 64, lat, &ws);
        int split = 0;
        for (int64_t i = 0; i < b.n_items; i++)
            split += ws.plan.splits[i] > 1;
        cr_assert_gt(split, 0, "batch %zu: some item was split at 64 units", c);
        /* one-split items never reach the merge: no partials, no merge pairs */
        int64_t n_merge = 0;
        for (int64_t i = 0; i < b.n_items; i++) {
            cr_assert_eq(ws.part0[i] < 0, ws.plan.splits[i] == 1, "item %lld", (long long)i);
            n_merge += ws.plan.splits[i] > 1 ? bs[c].rows[i] : 0;
        }
        for (int64_t m = 0; m < n_merge; m++)
            cr_assert_gt(ws.plan.splits[ws.merge[2 * m]], 1, "merge pair %lld", (long long)m);
        duet_cpu_mla_ws_free(&ws);
        const double worst = check_reference(&b, lat);
        printf("[mla] batch %zu: %d items split, worst error %.3f of the bound\n", c, split, worst);
        free(lat);
        batch_free(&b);
    }
}

Test(kernels_cpu_mla, plan_threads_page_size_and_batch_never_change_a_bit, .timeout = 120)
{
    batch_t b;
    batch_make(&b, skew_lens, skew_rows, N_SKEW, 16, 5);
    const size_t bytes = (size_t)(b.n_rows * NH * R) * sizeof(float);
    float *want = malloc(bytes), *got = malloc(bytes);
    attend(&b, 1, DUET_SPLITKV_NONE, 1, want, NULL);
    const struct {
        int threads;
        duet_splitkv_mode_t mode;
        int64_t units;
    } runs[] = {
        {1, DUET_SPLITKV_PER_REQUEST, 1},   {2, DUET_SPLITKV_PER_REQUEST, 2},
        {3, DUET_SPLITKV_PER_REQUEST, 7},   {2, DUET_SPLITKV_PER_REQUEST, 64},
        {4, DUET_SPLITKV_PER_REQUEST, 256}, {2, DUET_SPLITKV_UNIFORM, 64},
        {2, DUET_SPLITKV_NONE, 2},
    };
    for (size_t i = 0; i < sizeof(runs) / sizeof(runs[0]); i++) {
        attend(&b, runs[i].threads, runs[i].mode, runs[i].units, got, NULL);
        cr_assert(memcmp(want, got, bytes) == 0, "run %zu (%d threads, mode %d, %lld units)", i,
                  runs[i].threads, (int)runs[i].mode, (long long)runs[i].units);
    }
    /* the same caches in 64-token and 7-token pages */
    const int64_t pts[] = {64, 7};
    for (size_t i = 0; i < 2; i++) {
        batch_t c;
        batch_make(&c, skew_lens, skew_rows, N_SKEW, pts[i], 5);
        attend(&c, 2, DUET_SPLITKV_PER_REQUEST, 64, got, NULL);
        cr_assert(memcmp(want, got, bytes) == 0, "%lld-token pages", (long long)pts[i]);
        batch_free(&c);
    }
    /* each item alone gives its rows' bits of the batch */
    for (int64_t i = 0; i < N_SKEW; i++) {
        batch_t one;
        batch_make(&one, skew_lens, skew_rows, N_SKEW, 16, 5); /* same draws */
        one.n_items = 1;
        one.row0[0] = 0;
        one.row0[1] = skew_rows[i];
        one.n_rows = skew_rows[i];
        one.pos0[0] = b.pos0[i];
        one.pages[0] = b.pages[i] - b.page_store + one.page_store;
        memmove(one.qhat, one.qhat + b.row0[i] * NH * R,
                sizeof(float) * (size_t)(one.n_rows * NH * R));
        memmove(one.qr, one.qr + b.row0[i] * NH * DR,
                sizeof(float) * (size_t)(one.n_rows * NH * DR));
        attend(&one, 2, DUET_SPLITKV_PER_REQUEST, 64, got, NULL);
        cr_assert(memcmp(want + b.row0[i] * NH * R, got,
                         sizeof(float) * (size_t)(one.n_rows * NH * R)) == 0,
                  "item %lld alone", (long long)i);
        one.n_items = N_SKEW; /* for batch_free: nothing else depends on it */
        batch_free(&one);
    }
    free(want);
    free(got);
    batch_free(&b);
}
