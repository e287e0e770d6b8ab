/*
 * mla.c: MLA's cache write and paged attention on the CPU (contract in cpu_mla.h). Scores are
 * taken over the latent rows (r + dr dims) and the softmax-weighted sum stays in the r-dim latent
 * space: W_UK and W_UV are applied by the caller's GEMMs, before and after.
 */
#include "kernels/cpu/cpu_mla.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/cpu/isa.h"

/* Dot product with 8 independent partial sums: the explicit lanes let the compiler vectorise
 * without reassociating (no -ffast-math). */
static inline float duet__dot(const float *a, const float *b, int64_t n)
{
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++)
            acc[k] += a[i + k] * b[i + k];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++)
        s += a[i] * b[i];
    return s;
}

/* Token slot 0 of (page, this layer). */
static float *duet__mla_block(const duet_cpu_mla_layer_t *ly, int32_t page)
{
    uint64_t off = 0;
    (void)duet_kv_layout_offset(&ly->layout, (uint64_t)page, (uint64_t)ly->layer, 0, &off);
    return (float *)((uint8_t *)ly->kv_base + off);
}

void duet_cpu_mla_kv_write(duet_kernels_t *k, const duet_cpu_step_t *st,
                           const duet_cpu_mla_layer_t *ly, const duet_cpu_mla_shard_t *sh,
                           float *ckr, const duet_tensor_t *norm_w, float eps)
{
    const int64_t cp = sh != NULL && sh->cp > 1 ? sh->cp : 1, c = cp > 1 ? sh->c : 0;
    const int64_t r = ly->r, td = ly->r + ly->dr, PT = (int64_t)ly->layout.page_tokens;
    for (int64_t it = 0; it < st->n_items; it++) {
        const int64_t r0 = st->item_row0[it], n = st->item_row0[it + 1] - r0;
        for (int64_t t = 0; t < n; t++) {
            const int64_t row = r0 + t, pos = st->item_pos0[it] + t;
            float *src = ckr + row * td;
            if ((pos / PT) % cp != c) /* another rank's page */
                continue;
            duet_k_rmsnorm(k, src, src, norm_w, 1, r, eps);
            float *dst = duet__mla_block(ly, st->item_pages[it][pos / PT / cp]) + (pos % PT) * td;
            memcpy(dst, src, sizeof(float) * (size_t)td);
        }
    }
}

/* ---- planned attention ------------------------------------------------------------------- */

/* One partial: a segment's (m, l) then acc[r]. */
#define DUET__MLA_PART(r) ((r) + 2)
/* Latent rows of a segment taken for every head in turn (32 x 576 fp32 = 72 KiB) */
#define DUET__MLA_SUB 32

int64_t duet_cpu_mla_scratch_floats(int64_t n_heads, int64_t r)
{
    return n_heads * (DUET_CPU_MLA_SEG + DUET__MLA_PART(r) + 2);
}

void duet_cpu_mla_ws_free(duet_cpu_mla_ws_t *ws)
{
    free(ws->plan.splits);
    free(ws->plan.work0);
    free(ws->plan.work);
    free(ws->lens);
    free(ws->rows);
    free(ws->part0);
    free(ws->part);
    free(ws->merge);
    free(ws->tasks);
    memset(ws, 0, sizeof(*ws));
}

/* Grow *p to n elements of `size` bytes; false when out of memory (*p unchanged). */
static bool duet__grow(void **p, int64_t *cap, int64_t n, size_t size)
{
    if (n <= *cap)
        return true;
    int64_t c = *cap > 0 ? *cap : 16;
    while (c < n)
        c *= 2;
    void *q = realloc(*p, (size_t)c * size);
    if (q == NULL)
        return false;
    *p = q;
    *cap = c;
    return true;
}

typedef struct {
    const duet_cpu_step_t *st;
    const duet_cpu_mla_layer_t *ly;
    const duet_cpu_mla_ws_t *ws;
    const float *qhat, *qr;
    int64_t ldqr, dqr_stride;
    float scale;
    float *lat, *lse;
    float *scratch;
    int64_t per_thread;
} duet__mla_attn_ctx_t;

/*
 * Segment `seg` of one query row, every head, whose newest position is `last`: for head h its
 * scores' max m, the sum l of exp(score - m) and acc = sum of exp(score - m) * c, all in position
 * order, into parts + h * (r + 2) ([m, l, acc[r]]); a segment wholly after `last` gets l = 0.
 * Every head in one pass, because MLA's heads share the latent rows: each row is read once. qh:
 * the row's q-hat [n][r]; q_r of head h at qr + h * dqr_stride. sc: n * DUET_CPU_MLA_SEG floats.
 * One function for every caller, so a segment's bits never depend on who computes it.
 */
DUET__CPU_CLONES __attribute__((noinline)) static void
duet__mla_segment(const duet_cpu_mla_layer_t *ly, const int32_t *pages, const float *qh,
                  const float *qr, int64_t dqr_stride, float scale, int64_t seg, int64_t last,
                  float *sc, float *parts)
{
    const int64_t n = ly->n_heads, r = ly->r, dr = ly->dr, td = r + dr, P = DUET__MLA_PART(r);
    const int64_t PT = (int64_t)ly->layout.page_tokens, p0 = seg * DUET_CPU_MLA_SEG;
    for (int64_t h = 0; h < n; h++) {
        float *part = parts + h * P;
        part[0] = -INFINITY;
        part[1] = 0.0f;
        for (int64_t j = 0; j < r; j++)
            part[2 + j] = 0.0f;
    }
    if (p0 > last)
        return;
    const int64_t p1 = last + 1 < p0 + DUET_CPU_MLA_SEG ? last + 1 : p0 + DUET_CPU_MLA_SEG;
    /* The rows in sub-blocks of DUET__MLA_SUB, each sub-block for every head in turn: a head's
     * q-hat and accumulator stay in L1 while the sub-block's rows stay in L2 (every head reading
     * the whole segment's rows, or every head's accumulator per row, would not fit). */
    const float *kv[DUET__MLA_SUB];
    for (int64_t q0 = p0; q0 < p1; q0 += DUET__MLA_SUB) {
        const int64_t nq = p1 - q0 < DUET__MLA_SUB ? p1 - q0 : DUET__MLA_SUB;
        for (int64_t i = 0; i < nq; i++)
            kv[i] = duet__mla_block(ly, pages[(q0 + i) / PT]) + ((q0 + i) % PT) * td;
        for (int64_t h = 0; h < n; h++) {
            const float *qhh = qh + h * r, *qrh = qr + h * dqr_stride;
            float *sch = sc + h * DUET_CPU_MLA_SEG + (q0 - p0), mx = parts[h * P];
            for (int64_t i = 0; i < nq; i++) {
                const float a = (duet__dot(qhh, kv[i], r) + duet__dot(qrh, kv[i] + r, dr)) * scale;
                sch[i] = a;
                mx = a > mx ? a : mx;
            }
            parts[h * P] = mx;
        }
    }
    for (int64_t h = 0; h < n; h++) {
        float *w = sc + h * DUET_CPU_MLA_SEG, sum = 0.0f;
        const float mx = parts[h * P];
        for (int64_t p = 0; p < p1 - p0; p++) {
            w[p] = expf(w[p] - mx);
            sum += w[p];
        }
        parts[h * P + 1] = sum;
    }
    for (int64_t q0 = p0; q0 < p1; q0 += DUET__MLA_SUB) {
        const int64_t nq = p1 - q0 < DUET__MLA_SUB ? p1 - q0 : DUET__MLA_SUB;
        for (int64_t i = 0; i < nq; i++)
            kv[i] = duet__mla_block(ly, pages[(q0 + i) / PT]) + ((q0 + i) % PT) * td;
        for (int64_t h = 0; h < n; h++) {
            const float *w = sc + h * DUET_CPU_MLA_SEG + (q0 - p0);
            float *acc = parts + h * P + 2;
            for (int64_t i = 0; i < nq; i++) /* position order, per output element */
                for (int64_t j = 0; j < r; j++)
                    acc[j] += w[i] * kv[i][j];
        }
    }
}

/*
 * Fold segment partial `part` into the running (state[0] = M, state[1] = L, out[r] = ACC) of one
 * (row, head); first: it is segment 0 (copied). Segments with l = 0 (past the row) change nothing.
 * One function for both the whole-item tasks and the merge pass: the same bits either way.
 */
DUET__CPU_CLONES __attribute__((noinline)) static void
duet__mla_fold(float *state, float *out, const float *part, int64_t r, int first)
{
    if (first) {
        state[0] = part[0];
        state[1] = part[1];
        memcpy(out, part + 2, sizeof(float) * (size_t)r);
        return;
    }
    if (part[1] == 0.0f)
        return;
    const float m = state[0] > part[0] ? state[0] : part[0];
    const float a = expf(state[0] - m), b = expf(part[0] - m);
    state[0] = m;
    state[1] = state[1] * a + part[1] * b;
    for (int64_t j = 0; j < r; j++)
        out[j] = out[j] * a + part[2 + j] * b;
}

/* out /= L: the row's result; its log-sum-exp M + log L into *lse when wanted. */
static void duet__mla_finish(const float *state, float *out, int64_t r, float *lse)
{
    const float inv = 1.0f / state[1];
    for (int64_t j = 0; j < r; j++)
        out[j] *= inv;
    if (lse != NULL)
        *lse = state[0] + logf(state[1]);
}

/* A row that sees none of a shard's positions: nothing to attend, weight 0 in the merge. */
static void duet__mla_empty(float *out, int64_t r, float *lse)
{
    memset(out, 0, sizeof(float) * (size_t)r);
    if (lse != NULL)
        *lse = -INFINITY;
}

/* Task (work item, row) idx of the step: one query row, every head, over the work's segments; an
 * item of one split folds them into its output, a split one leaves its partials. */
static void duet__mla_work_task(void *vctx, int64_t b, int64_t e, int tid)
{
    const duet__mla_attn_ctx_t *cx = vctx;
    const duet_cpu_step_t *st = cx->st;
    const duet_cpu_mla_layer_t *ly = cx->ly;
    const duet_cpu_mla_ws_t *ws = cx->ws;
    const int64_t n = ly->n_heads, r = ly->r, P = DUET__MLA_PART(r);
    float *sc = cx->scratch + (int64_t)tid * cx->per_thread, *tmp = sc + n * DUET_CPU_MLA_SEG;
    float *state = tmp + n * P;
    for (int64_t idx = b; idx < e; idx++) {
        const duet_splitkv_work_t *wk = &ws->plan.work[ws->tasks[2 * idx]];
        const int64_t t = ws->tasks[2 * idx + 1], it = wk->item;
        const int64_t row = st->item_row0[it] + t;
        const int64_t last = duet_cpu_mla_local_len(&ws->shard, st->item_pos0[it] + t + 1) - 1;
        const int64_t segs = duet_splitkv_blocks(ws->lens[it], DUET_CPU_MLA_SEG);
        const float *qh = cx->qhat + row * n * r, *q_r = cx->qr + row * cx->ldqr;
        if (ws->plan.splits[it] > 1) {
            for (int64_t g = wk->block0; g < wk->block1; g++)
                duet__mla_segment(ly, st->item_pages[it], qh, q_r, cx->dqr_stride, cx->scale, g,
                                  last, sc, ws->part + ws->part0[it] + (t * segs + g) * n * P);
            continue;
        }
        for (int64_t g = 0; g < wk->block1 && g * DUET_CPU_MLA_SEG <= last; g++) {
            duet__mla_segment(ly, st->item_pages[it], qh, q_r, cx->dqr_stride, cx->scale, g, last,
                              sc, tmp);
            for (int64_t h = 0; h < n; h++)
                duet__mla_fold(state + 2 * h, cx->lat + (row * n + h) * r, tmp + h * P, r, g == 0);
        }
        for (int64_t h = 0; h < n; h++) {
            float *lse = cx->lse != NULL ? cx->lse + row * n + h : NULL;
            if (last < 0)
                duet__mla_empty(cx->lat + (row * n + h) * r, r, lse);
            else
                duet__mla_finish(state + 2 * h, cx->lat + (row * n + h) * r, r, lse);
        }
    }
}

/* The merge of split items: one (item row, head) per index, its partials folded in order. */
static void duet__mla_merge_task(void *vctx, int64_t b, int64_t e, int tid)
{
    const duet__mla_attn_ctx_t *cx = vctx;
    const duet_cpu_step_t *st = cx->st;
    const duet_cpu_mla_ws_t *ws = cx->ws;
    const int64_t n = cx->ly->n_heads, r = cx->ly->r, P = DUET__MLA_PART(r);
    (void)tid;
    for (int64_t idx = b; idx < e; idx++) {
        const int64_t m = idx / n, h = idx % n, it = ws->merge[2 * m], t = ws->merge[2 * m + 1];
        const int64_t row = st->item_row0[it] + t;
        const int64_t last = duet_cpu_mla_local_len(&ws->shard, st->item_pos0[it] + t + 1) - 1;
        float *lse = cx->lse != NULL ? cx->lse + row * n + h : NULL;
        const int64_t segs = duet_splitkv_blocks(ws->lens[it], DUET_CPU_MLA_SEG);
        float state[2];
        float *out = cx->lat + (row * n + h) * r;
        for (int64_t g = 0; g < segs && g * DUET_CPU_MLA_SEG <= last; g++)
            duet__mla_fold(state, out, ws->part + ws->part0[it] + ((t * segs + g) * n + h) * P, r,
                           g == 0);
        if (last < 0)
            duet__mla_empty(out, r, lse);
        else
            duet__mla_finish(state, out, r, lse);
    }
}

/* Room for a step of n items in every per-item array of ws (one capacity for all of them). */
static bool duet__ws_items(duet_cpu_mla_ws_t *ws, int64_t n)
{
    if (n <= ws->cap_items)
        return true;
    int64_t c = ws->cap_items > 0 ? ws->cap_items : 16;
    while (c < n)
        c *= 2;
    int64_t *lens = realloc(ws->lens, (size_t)c * sizeof(int64_t));
    ws->lens = lens != NULL ? lens : ws->lens;
    int64_t *rows = realloc(ws->rows, (size_t)c * sizeof(int64_t));
    ws->rows = rows != NULL ? rows : ws->rows;
    int64_t *part0 = realloc(ws->part0, (size_t)c * sizeof(int64_t));
    ws->part0 = part0 != NULL ? part0 : ws->part0;
    int32_t *splits = realloc(ws->plan.splits, (size_t)c * sizeof(int32_t));
    ws->plan.splits = splits != NULL ? splits : ws->plan.splits;
    int32_t *work0 = realloc(ws->plan.work0, (size_t)(c + 1) * sizeof(int32_t));
    ws->plan.work0 = work0 != NULL ? work0 : ws->plan.work0;
    if (lens == NULL || rows == NULL || part0 == NULL || splits == NULL || work0 == NULL)
        return false; /* the arrays that grew stay valid; cap_items still bounds them all */
    ws->cap_items = c;
    return true;
}

duet_status_t duet_cpu_mla_plan(duet_kernels_t *k, const duet_cpu_step_t *st, int64_t n_heads,
                                int64_t r, duet_cpu_mla_ws_t *ws)
{
    const int64_t ni = st->n_items, n = n_heads, P = DUET__MLA_PART(r);
    const int64_t units = ws->units > 0 ? ws->units : duet_kernels_n_threads(k);
    if (!duet__ws_items(ws, ni) ||
        !duet__grow((void **)&ws->plan.work, &ws->cap_work, duet_splitkv_max_work(ni, 1, units),
                    sizeof(duet_splitkv_work_t)))
        return duet_error_set(DUET_ERR_NOMEM,
                              "MLA attention: out of memory for the plan of %lld items",
                              (long long)ni);
    for (int64_t i = 0; i < ni; i++) {
        ws->rows[i] = st->item_row0[i + 1] - st->item_row0[i];
        ws->lens[i] = duet_cpu_mla_local_len(&ws->shard, st->item_pos0[i] + ws->rows[i]);
    }
    const duet_splitkv_in_t in = {.n_items = ni,
                                  .lens = ws->lens,
                                  .rows = ws->rows,
                                  .heads = 1, /* a task covers every head */
                                  .block_tokens = DUET_CPU_MLA_SEG,
                                  .units = units,
                                  .mode = ws->mode};
    duet_status_t s = duet_splitkv_plan(&in, &ws->plan, ws->cap_work);
    if (s != DUET_OK)
        return s;
    /* the split items' partials, and the (item, row) pairs the merge folds */
    int64_t parts = 0, n_merge = 0;
    for (int64_t i = 0; i < ni; i++) {
        ws->part0[i] = -1;
        if (ws->plan.splits[i] == 1)
            continue;
        ws->part0[i] = parts * P;
        parts += duet_splitkv_blocks(ws->lens[i], DUET_CPU_MLA_SEG) * ws->rows[i] * n;
        n_merge += ws->rows[i];
    }
    if (!duet__grow((void **)&ws->part, &ws->cap_part, parts * P, sizeof(float)) ||
        !duet__grow((void **)&ws->merge, &ws->cap_merge, 2 * n_merge, sizeof(int64_t)))
        return duet_error_set(DUET_ERR_NOMEM,
                              "MLA attention: out of memory for %lld split partials",
                              (long long)parts);
    for (int64_t i = 0, m = 0; i < ni; i++)
        for (int64_t t = 0; ws->plan.splits[i] > 1 && t < ws->rows[i]; t++, m++) {
            ws->merge[2 * m] = i;
            ws->merge[2 * m + 1] = t;
        }
    /* one task per (work item, row): a task covers every head (they share the latent rows) */
    int64_t n_tasks = 0;
    for (int64_t w = 0; w < ws->plan.n_work; w++)
        n_tasks += ws->rows[ws->plan.work[w].item];
    if (!duet__grow((void **)&ws->tasks, &ws->cap_tasks, 2 * n_tasks, sizeof(int64_t)))
        return duet_error_set(DUET_ERR_NOMEM, "MLA attention: out of memory for %lld tasks",
                              (long long)n_tasks);
    for (int64_t w = 0, x = 0; w < ws->plan.n_work; w++)
        for (int64_t t = 0; t < ws->rows[ws->plan.work[w].item]; t++, x++) {
            ws->tasks[2 * x] = w;
            ws->tasks[2 * x + 1] = t;
        }
    ws->n_tasks = n_tasks;
    ws->n_merge = n_merge;
    ws->heads = n_heads;
    ws->r = r;
    return DUET_OK;
}

void duet_cpu_mla_attend(duet_kernels_t *k, const duet_cpu_step_t *st,
                         const duet_cpu_mla_layer_t *ly, const float *qhat, const float *qr,
                         int64_t ldqr, int64_t dqr_stride, float scale, float *lat, float *lse,
                         float *scratch, int64_t scratch_per_thread, const duet_cpu_mla_ws_t *ws)
{
    DUET_ASSERT(ws->heads == ly->n_heads && ws->r == ly->r); /* planned for this shape */
    duet__mla_attn_ctx_t cx = {.st = st,
                               .ly = ly,
                               .ws = ws,
                               .qhat = qhat,
                               .qr = qr,
                               .ldqr = ldqr,
                               .dqr_stride = dqr_stride,
                               .scale = scale,
                               .lat = lat,
                               .lse = lse,
                               .scratch = scratch,
                               .per_thread = scratch_per_thread};
    duet_k_parallel_each(k, ws->n_tasks, duet__mla_work_task, &cx);
    if (ws->n_merge > 0)
        duet_k_parallel_for(k, ws->n_merge * ly->n_heads, 1, duet__mla_merge_task, &cx);
    /* items the plan gave no work: none of their positions is held here (a shard) */
    for (int64_t it = 0; it < st->n_items; it++) {
        if (ws->lens[it] > 0)
            continue;
        for (int64_t row = st->item_row0[it]; row < st->item_row0[it + 1]; row++)
            for (int64_t h = 0; h < ly->n_heads; h++)
                duet__mla_empty(lat + (row * ly->n_heads + h) * ly->r, ly->r,
                                lse != NULL ? lse + row * ly->n_heads + h : NULL);
    }
}
