/*
 * test_cuda_mla.c: the MLA cache write and paged attention kernels (kernels/cuda/cuda_mla.h)
 * against a CPU reference written here in double precision.
 *
 * Each case builds a mixed batch over a pool whose page ids are shuffled (an item's pages are
 * neither contiguous nor in order), two MLA layers per page (the kernels use the second), and
 * positions before each item's pos0 already holding random cache rows: decode items with
 * contexts 1, exactly one page, one past a page, exactly one 64-position tile, two tiles and
 * ~1000 (many tiles and splits), and prefill items of 3 .. 20 rows starting mid-page at pos0 > 0
 * and at 0. It runs kv_write, checks the written rows against the CPU RMSNorm (and that nothing
 * else in the pool changed), then the step's split-KV plan (duet_cuda_mla_plan) and attend with
 * the plan's units at the SMs (for these small steps a chunk of one 64-position block: every
 * multi-block item of <= 16 rows is cut block by block, verify-like items too) and at 1 and 5
 * (chunks of many blocks), each compared with the reference computed from the cache as the GPU
 * left it (for BF16 the reference reads the same bf16-rounded rows), each plan copied back and
 * compared field by field with the host's duet_splitkv_plan (kernels/splitkv.h), the scratch
 * filled with NaN before every plan (a merge reading a partial no block wrote shows); last, the
 * new rows' slots are put back to their old contents and kv_write + plan + attend run back to
 * back on one stream, as in a step (attend, a programmatic dependent launch, copies older rows
 * before its wait: it must still see the new ones). Shapes cover n = 2, 6, 8, 32 and 40 heads
 * (one to sixteen rows per block, a partial second head group), r = 32 .. 512 and dr = 8 .. 64
 * (r + dr not a multiple of 16), pages of 16 and 12 tokens, on the tensor-core path (BF16;
 * tiles of 32 and of 64 positions; blocks of 16 slots; Kimi's 512 + 64 has its own compiled-in
 * kernel) and the CUDA-core path (F32, and BF16 forced through it). More steps: a skewed one
 * (one long decode among many short ones, verify items of 4 and 16 rows) and a uniform one;
 * one whose items all fit one block (every item on one split: the merge must leave them alone)
 * and the mixed one with max_split_rows = 0 (nothing split, no merge). The plan alone is
 * compared with the host's on 40 random steps (skewed, uniform, verify rows, prefill and empty
 * items, over 512 items; several head and unit counts).
 *
 * Error measure. For output j of a (row, head), err = |lat_gpu − lat_ref| / S_j with
 * S_j = Σ_s p_s |c_s,j| (p the reference softmax): the output is a p-weighted mean, so both an
 * absolute score error δ (which perturbs every weight by ~δ relative) and the rounding of the
 * weighted sum are bounded by a multiple of S_j, not of |lat_j|, which can cancel to ~0.
 *   CUDA-core (fp32 math on exactly the cached values): scores are fp32 dot products of <= 576
 *     terms (here |score| <~ 10, Σ|q c| · scale <~ 30): typical error ~1e-6, the fp32 sums of
 *     <= 2501 weighted rows another ~1e-6 (worst-case bounds n·u·(…) are ~100× larger but need
 *     every rounding to go the same way): tol 5e-5.
 *   tensor cores (BF16): the cached rows are exact in bf16; q̂ and P are split into hi + lo bf16
 *     pairs (|x − hi − lo| <= 2^-16 |x| at worst, ~2^-18 typically), so the extra error is at
 *     most 2^-16 relative on each product and weight (~1e-5 on err at these magnitudes, under
 *     4e-5 at worst) on top of the fp32 terms: tol 1e-4.
 *     Rounding q̂ to bf16 alone would put err near 2^-9 · |score| ≈ 1e-2: the tolerance catches
 *     a lost lo half.
 * kv_write: F32 rows equal the CPU's fp32 RMSNorm to 2^-22 relative (the scale is formed in
 * double on both sides, summed in different orders); BF16 rows are within half a bf16 ulp
 * (2^-8 relative) of the CPU's fp32 value, plus 2^-22 for that fp32 difference.
 *
 * Without a CUDA device (this build VM, CI) the GPU tests skip with a reason; the scratch size
 * and the argument checks run anyway (they touch no device). A last test times attend
 * (attention + split reducer) at Kimi Linear's shape (n = 32, r = 512, dr = 64, BF16): decode at
 * 32K context for batches 64, 8 and 1 and at 2K for batches 1 and 8 with the step's plan, and a
 * 1024-row prefill chunk ending at 8K. The calls are captured into a CUDA graph (which also
 * proves attend capturable) and timed with events; it prints microseconds and the KV bytes read
 * per second.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <criterion/criterion.h>
#include <cuda_runtime_api.h>

#include "kernels/cuda/cuda_mla.h"
#include "kernels/kernels.h"

#define DUET_TEST_RNG_SEED 0x9e3779b97f4a7c15ull
#include "cuda_test_util.h"
#include "mla_test_batch.h"

/* mla.cu test hooks: 1 routes BF16 caches through the CUDA-core kernel too; the tensor-core
 * tile (0: the default, 32 or 64 positions); 16-slot tensor-core blocks; the plan's units (0:
 * the SMs); what a step is planned with and where its plan lies in the scratch. */
void duet__cuda_mla_force_simt(int on);
void duet__cuda_mla_tc_tile(int tk);
void duet__cuda_mla_tc_slots(int n);
void duet__cuda_mla_plan_units(int units);
void duet__cuda_mla_plan_mode(int mode);
duet_status_t duet__cuda_mla_plan_where(const duet_cuda_step_t *st, const duet_cuda_mla_layer_t *ly,
                                        void *scratch, size_t scratch_bytes, int64_t shape[5],
                                        void *where[4]);

#define TOL_SIMT 5e-5
#define TOL_TC   1e-4
#define DN       128 /* qk_nope_head_dim: only sets the scale and q_r's stride */
#define NORM_EPS 1e-6f
#define N_LAYERS 2 /* MLA layers per page; the kernels run on the second */
#define LAYER    1

static void skip_without_device(void)
{
    skip_without_device_for("the MLA kernels are");
}

static int n_sms(void)
{
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess || v < 1)
        return 132;
    return v;
}

/* The units the engine's plans aim at: the SMs, DUET_CUDA_MLA_SMS_PER_UNIT to a unit. */
static int default_units(void)
{
    const int u = n_sms() / DUET_CUDA_MLA_SMS_PER_UNIT;
    return u > 0 ? u : 1;
}

/* One cache element as a float. */
static float kv_get(const void *pool, duet_dtype_t dt, int64_t i)
{
    return dt == DUET_DTYPE_F32 ? ((const float *)pool)[i]
                                : duet_bf16_to_f32(((const uint16_t *)pool)[i]);
}

/* ---- the mixed batch ------------------------------------------------------------------------ */

/* PT = 16 (12 in one case), attention tiles of 32 or 64 positions. */
static const item_spec_t MIXED[] = {
    {0, 1},    /* context 1 */
    {15, 1},   /* context 16: exactly one page */
    {37, 9},   /* prefill continuing mid-page */
    {16, 1},   /* context 17: first position of a new page */
    {1000, 1}, /* long decode: 16 tiles, every split busy */
    {63, 1},   /* context 64: exactly one tile */
    {0, 20},   /* fresh prefill of 20 rows (two row blocks when 16 rows share a block) */
    {127, 1},  /* context 128: page and tile boundary */
    {996, 3},  /* long prefill tail, crossing a tile boundary */
    {5, 1},    {250, 6},
};
#define N_MIXED ((int)(sizeof(MIXED) / sizeof(MIXED[0])))

typedef struct {
    const char *name;
    int n, r, dr, pt;
    duet_dtype_t dt;
    int simt;      /* force the CUDA-core kernel for a BF16 cache */
    int tile;      /* tensor-core tile (duet__cuda_mla_tc_tile), 0 = the default */
    int off;       /* q̂ and q this many floats past 16-byte alignment (the 4-byte copies of q) */
    int slots;     /* 16: tensor-core blocks of 16 slots (duet__cuda_mla_tc_slots), else 32 */
    int no_split;  /* max_split_rows = 0: nothing is split (and no merge runs) */
    int one_split; /* the batch must be planned with every item on one split */
} cfg_t;

/* The attention grid's head groups (the plan's `heads`) and rows per block, from the kernel
 * choice: blocks of 32 query slots, of 16 on the tensor cores with 64-position tiles when the
 * test hook asks; min(n, slots) heads of one row per block, the slots / heads rows. */
static void grid_of(int n, int r, int dr, duet_dtype_t dt, int simt, int tile, int slots,
                    int64_t *hg, int *rb)
{
    const int tc = dt == DUET_DTYPE_BF16 && !simt && ((r + dr + 15) & ~15) <= 576;
    const int sl = tc && tile != 32 && slots == 16 ? 16 : 32;
    const int hb = n < sl ? n : sl;
    *hg = (n + hb - 1) / hb;
    *rb = sl / hb;
}

/* ---- the plan ------------------------------------------------------------------------------- */

/* A step's plan as the device left it, and what it was planned with. */
typedef struct {
    int n_items;
    int64_t n_work, n_tasks, chunk;
    int64_t heads, units, block_tokens, max_work, max_tasks;
    int32_t *splits, *work0;
    duet_splitkv_work_t *work;
} plan_t;

static void plan_fetch(plan_t *p, const batch_t *b, const duet_cuda_mla_layer_t *ly,
                       void *d_scratch, size_t bytes)
{
    int64_t shape[5], hdr[3];
    void *where[4];
    DUET_OK_OR_FAIL(duet__cuda_mla_plan_where(&b->st, ly, d_scratch, bytes, shape, where));
    CUDA_OK(cudaMemcpy(hdr, where[0], sizeof(hdr), cudaMemcpyDeviceToHost));
    p->n_items = b->n_items;
    p->n_work = hdr[0];
    p->n_tasks = hdr[1];
    p->chunk = hdr[2];
    p->heads = shape[0];
    p->units = shape[1];
    p->block_tokens = shape[2];
    p->max_work = shape[3];
    p->max_tasks = shape[4];
    CHECK(p->n_work >= 0 && p->n_work <= p->max_work, "%lld work items, room for %lld",
          (long long)p->n_work, (long long)p->max_work);
    CHECK(p->n_tasks >= 0 && p->n_tasks <= p->max_tasks, "%lld tasks, room for %lld",
          (long long)p->n_tasks, (long long)p->max_tasks);
    const int n = b->n_items;
    p->splits = xmalloc(sizeof(int32_t) * (size_t)n);
    p->work0 = xmalloc(sizeof(int32_t) * (size_t)(n + 1));
    p->work = xmalloc(sizeof(duet_splitkv_work_t) * (size_t)p->n_work);
    CUDA_OK(cudaMemcpy(p->splits, where[1], sizeof(int32_t) * (size_t)n, cudaMemcpyDeviceToHost));
    CUDA_OK(
        cudaMemcpy(p->work0, where[2], sizeof(int32_t) * (size_t)(n + 1), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(p->work, where[3], sizeof(duet_splitkv_work_t) * (size_t)p->n_work,
                       cudaMemcpyDeviceToHost));
}

static void plan_free(plan_t *p)
{
    free(p->splits);
    free(p->work0);
    free(p->work);
}

/*
 * The device's plan against the host's duet_splitkv_plan (DUET_SPLITKV_PER_REQUEST) of the same
 * step, every field: the parameters chosen here (heads: the grid's head groups; units; blocks of
 * 64 positions, the default tensor-core tile), each item's length its last row's position + 1.
 * Also the task count: every work item once per block of rb rows of its item.
 */
static void plan_check(const char *what, const plan_t *p, const batch_t *b, int64_t heads,
                       int64_t units, int rb, duet_splitkv_mode_t mode)
{
    const int n = b->n_items;
    CHECK(p->heads == heads && p->units == units && p->block_tokens == 64,
          "%s: planned with heads %lld units %lld blocks %lld, expected %lld %lld 64", what,
          (long long)p->heads, (long long)p->units, (long long)p->block_tokens, (long long)heads,
          (long long)units);
    int64_t *lens = xmalloc(sizeof(int64_t) * (size_t)n),
            *rows = xmalloc(sizeof(int64_t) * (size_t)n);
    for (int i = 0; i < n; i++) {
        rows[i] = b->item_row0[i + 1] - b->item_row0[i];
        lens[i] = rows[i] > 0 ? b->item_pos0[i] + rows[i] : 0;
    }
    const duet_splitkv_in_t in = {.n_items = n,
                                  .lens = lens,
                                  .rows = rows,
                                  .heads = heads,
                                  .block_tokens = 64,
                                  .units = units,
                                  .mode = mode};
    const int64_t cap = duet_splitkv_max_work(n, heads, units);
    CHECK(p->max_work == cap, "%s: work list of %lld, expected %lld", what, (long long)p->max_work,
          (long long)cap);
    duet_splitkv_plan_t hp = {.splits = xmalloc(sizeof(int32_t) * (size_t)n),
                              .work0 = xmalloc(sizeof(int32_t) * (size_t)(n + 1)),
                              .work = xmalloc(sizeof(duet_splitkv_work_t) * (size_t)cap)};
    DUET_OK_OR_FAIL(duet_splitkv_plan(&in, &hp, cap));
    CHECK(p->n_work == hp.n_work && p->chunk == hp.chunk,
          "%s: device %lld work items (chunk %lld), host %lld (chunk %lld)", what,
          (long long)p->n_work, (long long)p->chunk, (long long)hp.n_work, (long long)hp.chunk);
    int64_t tasks = 0;
    for (int i = 0; i <= n; i++) {
        CHECK(p->work0[i] == hp.work0[i], "%s: work0[%d] %d, host %d", what, i, p->work0[i],
              hp.work0[i]);
        if (i == n)
            break;
        CHECK(p->splits[i] == hp.splits[i],
              "%s: item %d (%lld positions, %lld rows): %d splits, "
              "host %d",
              what, i, (long long)lens[i], (long long)rows[i], p->splits[i], hp.splits[i]);
        tasks += (int64_t)(hp.work0[i + 1] - hp.work0[i]) * ((rows[i] + rb - 1) / rb);
    }
    for (int64_t w = 0; w < hp.n_work; w++) {
        const duet_splitkv_work_t d = p->work[w], h = hp.work[w];
        CHECK(
            d.item == h.item && d.split == h.split && d.block0 == h.block0 && d.block1 == h.block1,
            "%s: work %lld: device (%d, %d, %d .. %d), host (%d, %d, %d .. %d)", what, (long long)w,
            d.item, d.split, d.block0, d.block1, h.item, h.split, h.block0, h.block1);
    }
    CHECK(p->n_tasks == tasks, "%s: %lld tasks, expected %lld", what, (long long)p->n_tasks,
          (long long)tasks);
    free(hp.splits);
    free(hp.work0);
    free(hp.work);
    free(lens);
    free(rows);
}

/* ---- the case runner ------------------------------------------------------------------------ */

static int64_t kv_index(const batch_t *b, int item, int pos, int pt, int td)
{
    const int64_t page = b->item_pages[item * b->max_pages + pos / pt];
    return ((page * N_LAYERS + LAYER) * pt + pos % pt) * td;
}

static void run_case(const cfg_t *c, const item_spec_t *items, int n_items)
{
    const int n = c->n, r = c->r, dr = c->dr, td = r + dr, pt = c->pt, dqk = 16 + dr;
    const duet_dtype_t dt = c->dt;
    const size_t esz = duet_dtype_size(dt);
    const float scale = 1.0f / sqrtf((float)(DN + dr));
    int max_tok = 1;
    for (int i = 0; i < n_items; i++)
        max_tok = items[i].n_tok > max_tok ? items[i].n_tok : max_tok;

    batch_t b;
    batch_build(&b, items, n_items, pt);
    batch_upload(&b, max_tok);
    const int R = b.n_rows;
    const int64_t pool_elems = (int64_t)b.n_pages * N_LAYERS * pt * td;

    /* the pool: random rows everywhere (earlier tokens of every item, and garbage elsewhere) */
    unsigned char *pool0 = xmalloc((size_t)pool_elems * esz);
    unsigned char *pool1 = xmalloc((size_t)pool_elems * esz);
    for (int64_t i = 0; i < pool_elems; i++) {
        const float v = 1.5f * rng_f();
        if (dt == DUET_DTYPE_F32)
            ((float *)pool0)[i] = v;
        else
            ((uint16_t *)pool0)[i] = duet_f32_to_bf16(v);
    }
    float *ckr = xmalloc(sizeof(float) * (size_t)R * td);
    float *norm_w = xmalloc(sizeof(float) * (size_t)r);
    float *qhat = xmalloc(sizeof(float) * (size_t)R * n * r);
    float *mq = xmalloc(sizeof(float) * (size_t)R * n * dqk);
    for (int64_t i = 0; i < (int64_t)R * td; i++)
        ckr[i] = 2.0f * rng_f();
    for (int i = 0; i < r; i++)
        norm_w[i] = 1.0f + 0.5f * rng_f();
    for (int64_t i = 0; i < (int64_t)R * n * r; i++)
        qhat[i] = 3.0f * rng_f();
    for (int64_t i = 0; i < (int64_t)R * n * dqk; i++)
        mq[i] = 3.0f * rng_f();

    void *d_pool = dev_copy(pool0, (size_t)pool_elems * esz);
    float *d_ckr = dev_copy(ckr, sizeof(float) * (size_t)R * td);
    float *d_w = dev_copy(norm_w, sizeof(float) * (size_t)r);
    float *d_qhat0 = dev_alloc(sizeof(float) * ((size_t)R * n * r + (size_t)c->off));
    float *d_mq0 = dev_alloc(sizeof(float) * ((size_t)R * n * dqk + (size_t)c->off));
    float *d_lat = dev_alloc(sizeof(float) * (size_t)R * n * r); /* attend wants it aligned */
    float *d_qhat = d_qhat0 + c->off, *d_mq = d_mq0 + c->off;
    CUDA_OK(cudaMemcpy(d_qhat, qhat, sizeof(float) * (size_t)R * n * r, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_mq, mq, sizeof(float) * (size_t)R * n * dqk, cudaMemcpyHostToDevice));

    const duet_cuda_mla_layer_t ly = {.kv_base = d_pool,
                                      .kv_dtype = dt,
                                      .kv_n_layers = N_LAYERS,
                                      .page_tokens = pt,
                                      .layer = LAYER,
                                      .n_heads = n,
                                      .r = r,
                                      .dr = dr};

    /* ---- kv_write ---- */
    DUET_OK_OR_FAIL(duet_cuda_mla_kv_write(0, &b.st, &ly, d_ckr, d_w, NORM_EPS));
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(pool1, d_pool, (size_t)pool_elems * esz, cudaMemcpyDeviceToHost));
    unsigned char *written = xmalloc((size_t)pool_elems);
    memset(written, 0, (size_t)pool_elems);
    double w_err = 0.0;
    const double w_tol = dt == DUET_DTYPE_F32 ? ldexp(1.0, -22) : ldexp(1.0, -8) + ldexp(1.0, -22);
    for (int row = 0; row < R; row++) {
        const float *x = ckr + (int64_t)row * td;
        double ss = 0.0;
        for (int j = 0; j < r; j++)
            ss += (double)x[j] * (double)x[j];
        const float sc = (float)(1.0 / sqrt(ss / (double)r + (double)NORM_EPS));
        const int64_t base = kv_index(&b, b.row_item[row], b.row_pos[row], pt, td);
        for (int j = 0; j < td; j++) {
            const float want = j < r ? norm_w[j] * (x[j] * sc) : x[j];
            const float got = kv_get(pool1, dt, base + j);
            const double e = fabs((double)got - (double)want) / (fabs((double)want) + 1e-30);
            w_err = e > w_err ? e : w_err;
            written[base + j] = 1;
        }
    }
    int64_t stray = 0;
    for (int64_t i = 0; i < pool_elems; i++)
        if (!written[i] && memcmp(pool0 + i * esz, pool1 + i * esz, esz) != 0)
            stray++;
    printf("[cuda_mla] %-28s kv_write: %d rows, max rel err %.3g (tol %.3g), %lld stray writes\n",
           c->name, R, w_err, w_tol, (long long)stray);
    CHECK(w_err <= w_tol, "%s: kv_write error %g", c->name, w_err);
    CHECK(stray == 0, "%s: kv_write touched %lld other elements", c->name, (long long)stray);

    /* ---- reference attention (double), from the cache as the GPU left it ---- */
    double *ref = xmalloc(sizeof(double) * (size_t)R * n * r);
    double *S = xmalloc(sizeof(double) * (size_t)R * n * r);
    double *sc = xmalloc(sizeof(double) * (size_t)b.max_ctx);
    double *cv = xmalloc(sizeof(double) * (size_t)b.max_ctx * td);
    for (int row = 0; row < R; row++) {
        const int item = b.row_item[row], pos = b.row_pos[row];
        for (int s = 0; s <= pos; s++) {
            const int64_t base = kv_index(&b, item, s, pt, td);
            for (int j = 0; j < td; j++)
                cv[(int64_t)s * td + j] = kv_get(pool1, dt, base + j);
        }
        for (int h = 0; h < n; h++) {
            const float *qh = qhat + ((int64_t)row * n + h) * r;
            const float *qr = mq + ((int64_t)row * n + h) * dqk + 16;
            double mx = -INFINITY;
            for (int s = 0; s <= pos; s++) {
                const double *kv = cv + (int64_t)s * td;
                double acc = 0.0;
                for (int j = 0; j < r; j++)
                    acc += (double)qh[j] * kv[j];
                for (int j = 0; j < dr; j++)
                    acc += (double)qr[j] * kv[r + j];
                sc[s] = acc * (double)scale;
                mx = sc[s] > mx ? sc[s] : mx;
            }
            double sum = 0.0;
            for (int s = 0; s <= pos; s++) {
                sc[s] = exp(sc[s] - mx);
                sum += sc[s];
            }
            double *o = ref + ((int64_t)row * n + h) * r, *sa = S + ((int64_t)row * n + h) * r;
            for (int j = 0; j < r; j++)
                o[j] = sa[j] = 0.0;
            for (int s = 0; s <= pos; s++) {
                const double p = sc[s] / sum;
                const double *kv = cv + (int64_t)s * td;
                for (int j = 0; j < r; j++) {
                    o[j] += p * kv[j];
                    sa[j] += p * fabs(kv[j]);
                }
            }
        }
    }

    /* ---- plan + attend: the SMs as units (a chunk of one block for this small batch: every
     * multi-block item of <= 16 rows is cut block by block), and coarser plans ---- */
    duet__cuda_mla_force_simt(c->simt);
    duet__cuda_mla_tc_tile(c->tile);
    duet__cuda_mla_tc_slots(c->slots);
    if (c->no_split)
        b.st.max_split_rows = 0;
    const int units[4] = {0, 1, 5, 0}; /* the last run repeats the first after kv_write */
    size_t bytes = 0;
    for (int k = 0; k < 3; k++) {
        duet__cuda_mla_plan_units(units[k]);
        const size_t nb = duet_cuda_mla_scratch_bytes(&ly, n_items, R, b.st.max_split_rows);
        bytes = nb > bytes ? nb : bytes;
    }
    void *d_scratch = dev_alloc(bytes);
    float *lat = xmalloc(sizeof(float) * (size_t)R * n * r);
    const double tol = (dt == DUET_DTYPE_BF16 && !c->simt) ? TOL_TC : TOL_SIMT;
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    for (int k = 0; k < 4; k++) {
        duet__cuda_mla_plan_units(units[k]);
        /* NaN outputs and scratch: every output must be written, and nothing may read a
         * partial no block wrote (a one-split item's, or a split that saw none of a row) */
        CUDA_OK(cudaMemsetAsync(d_lat, 0xff, sizeof(float) * (size_t)R * n * r, stream));
        CUDA_OK(cudaMemsetAsync(d_scratch, 0xff, bytes, stream));
        if (k == 3) {
            /*
             * kv_write, plan and attend back to back on one stream, as a step runs them: the
             * new rows' slots hold their old contents again, and attend (launched with
             * programmatic dependent launch where the device has it) may start copying older
             * rows while kv_write runs; it must still see every row kv_write writes.
             */
            CUDA_OK(cudaMemcpyAsync(d_pool, pool0, (size_t)pool_elems * esz, cudaMemcpyHostToDevice,
                                    stream));
            DUET_OK_OR_FAIL(duet_cuda_mla_kv_write(stream, &b.st, &ly, d_ckr, d_w, NORM_EPS));
        }
        DUET_OK_OR_FAIL(duet_cuda_mla_plan(stream, &b.st, &ly, d_scratch, bytes));
        DUET_OK_OR_FAIL(duet_cuda_mla_attend(stream, &b.st, &ly, d_qhat, d_mq + 16,
                                             (int64_t)n * dqk, dqk, scale, d_lat, d_scratch,
                                             bytes));
        CUDA_OK(cudaStreamSynchronize(stream));
        CUDA_OK(cudaMemcpy(lat, d_lat, sizeof(float) * (size_t)R * n * r, cudaMemcpyDeviceToHost));
        plan_t pl;
        plan_fetch(&pl, &b, &ly, d_scratch, bytes);
        char what[96];
        snprintf(what, sizeof(what), "%s, units %d", c->name, units[k]);
        int64_t hg;
        int rb;
        grid_of(n, r, dr, dt, c->simt, c->tile, c->slots, &hg, &rb);
        if (c->no_split) {
            /* nothing may be split, whatever the chunk: one work item per item */
            for (int i = 0; i < n_items; i++)
                CHECK(pl.splits[i] == 1, "%s: item %d has %d splits", what, i, pl.splits[i]);
            CHECK(pl.n_work == n_items, "%s: %lld work items", what, (long long)pl.n_work);
        } else
            plan_check(what, &pl, &b, hg, units[k] > 0 ? units[k] : default_units(), rb,
                       DUET_SPLITKV_PER_REQUEST);
        int split_items = 0;
        for (int i = 0; i < n_items; i++)
            split_items += pl.splits[i] > 1;
        if (c->one_split)
            CHECK(split_items == 0, "%s: %d items split, none should", what, split_items);
        double err = 0.0;
        int64_t bad = 0, worst = 0;
        for (int64_t i = 0; i < (int64_t)R * n * r; i++) {
            const double e = fabs((double)lat[i] - ref[i]) / S[i];
            if (!(e <= tol))
                bad++;
            if (!(e <= err)) {
                err = e;
                worst = i;
            }
        }
        printf("[cuda_mla] %-28s attend, units %3d: %3lld work items, %2d items split, chunk "
               "%lld: max err %.3g (tol %.3g)%s\n",
               c->name, units[k], (long long)pl.n_work, split_items, (long long)pl.chunk, err, tol,
               k == 3 ? " [right after kv_write]" : "");
        CHECK(bad == 0,
              "%s%s: %lld outputs over tolerance, worst %g at row %lld head %lld dim %lld (gpu "
              "%g, ref %g)",
              what, k == 3 ? " after kv_write" : "", (long long)bad, err,
              (long long)(worst / ((int64_t)n * r)), (long long)(worst / r % n),
              (long long)(worst % r), lat[worst], ref[worst]);
        plan_free(&pl);
    }
    duet__cuda_mla_plan_units(0);
    CUDA_OK(cudaStreamDestroy(stream));
    duet__cuda_mla_force_simt(0);
    duet__cuda_mla_tc_tile(0);
    duet__cuda_mla_tc_slots(0);

    cudaFree(d_scratch);
    cudaFree(d_lat);
    cudaFree(d_mq0);
    cudaFree(d_qhat0);
    cudaFree(d_w);
    cudaFree(d_ckr);
    cudaFree(d_pool);
    free(lat);
    free(cv);
    free(sc);
    free(S);
    free(ref);
    free(written);
    free(mq);
    free(qhat);
    free(norm_w);
    free(ckr);
    free(pool1);
    free(pool0);
    batch_free(&b);
}

/* ---- tests without a device ----------------------------------------------------------------- */

/*
 * The scratch: a layout computed on the host alone. What it must hold for a step is checked
 * from the planner's bounds (splitkv.h): the work list of duet_splitkv_max_work entries, and
 * partials of min(max_split_rows, 16) rows per work item, each n (r + 2) floats; it must grow
 * with every count (one scratch sized for a bucket's largest step serves all its steps).
 */
Test(cuda_mla, scratch_bytes, .timeout = 30)
{
    duet_cuda_mla_layer_t ly = {.kv_base = NULL,
                                .kv_dtype = DUET_DTYPE_BF16,
                                .kv_n_layers = 1,
                                .page_tokens = 16,
                                .layer = 0,
                                .n_heads = 32,
                                .r = 512,
                                .dr = 64};
    duet__cuda_mla_plan_units(7); /* the device's SM count does not matter here */
    const int64_t w = duet_splitkv_max_work(64, 1, 7); /* 32 heads: one 32-slot head group */
    const size_t part = (size_t)w * 32 * (512 + 2) * sizeof(float);
    const size_t b0 = duet_cuda_mla_scratch_bytes(&ly, 64, 64, 0);
    const size_t b1 = duet_cuda_mla_scratch_bytes(&ly, 64, 64, 1);
    const size_t b16 = duet_cuda_mla_scratch_bytes(&ly, 64, 512, 16);
    printf("[cuda_mla] scratch, 32 heads r 512, 7 units: 64 items split_rows 0 -> %zu bytes, 1 -> "
           "%zu, 64 items 512 rows split_rows 16 -> %zu\n",
           b0, b1, b16);
    /* the plan alone is small; each partial row per work item adds n (r + 2) floats */
    CHECK(b0 > 0 && b0 < 64 * 1024, "%zu", b0);
    /* (and the grid's bound on tasks grows by the 56 extra splits one row each may add) */
    CHECK(b1 >= b0 + part && b1 <= b0 + part + 4096, "%zu vs %zu + %zu", b1, b0, part);
    CHECK(b16 >= b0 + 16 * part, "%zu", b16);
    CHECK(duet_cuda_mla_scratch_bytes(&ly, 64, 512, 99) == b16); /* rows over 16 never split */
    /* grows with every count */
    const int64_t dims[6][3] = {{1, 1, 1},  {2, 2, 1},   {2, 40, 1},
                                {8, 40, 4}, {8, 400, 4}, {300, 400, 16}};
    size_t prev = 0;
    for (int k = 0; k < 6; k++) {
        const size_t bk = duet_cuda_mla_scratch_bytes(&ly, dims[k][0], dims[k][1], dims[k][2]);
        CHECK(bk >= prev, "%lld items %lld rows split rows %lld: %zu after %zu",
              (long long)dims[k][0], (long long)dims[k][1], (long long)dims[k][2], bk, prev);
        prev = bk;
    }
    CHECK(duet_cuda_mla_scratch_bytes(NULL, 8, 8, 1) == 0);
    CHECK(duet_cuda_mla_scratch_bytes(&ly, -1, 8, 1) == 0);
    duet__cuda_mla_plan_units(0);
}

Test(cuda_mla, rejects_bad_arguments, .timeout = 30)
{
    /* shape checks come before any device work, so these run without a GPU */
    int32_t dummy[4] = {0, 1, 0, 0};
    duet_cuda_step_t st = {.n_items = 1,
                           .n_rows = 1,
                           .max_item_tokens = 1,
                           .max_split_rows = 1,
                           .item_row0 = dummy,
                           .item_pos0 = dummy,
                           .item_slot = dummy,
                           .item_pages = dummy,
                           .max_pages = 1,
                           .row_item = dummy,
                           .row_pos = dummy};
    _Alignas(16) float f[8] = {0.0f};
    duet_cuda_mla_layer_t ly = {.kv_base = f,
                                .kv_dtype = DUET_DTYPE_BF16,
                                .kv_n_layers = 1,
                                .page_tokens = 16,
                                .layer = 0,
                                .n_heads = 4,
                                .r = 48,
                                .dr = 8};
    duet_status_t s = duet_cuda_mla_attend(0, &st, &ly, f, f, 4, 4, 1.0f, f, NULL, 0);
    CHECK(s == DUET_ERR_UNSUPPORTED, "r = 48: %s", duet_status_name(s));
    printf("[cuda_mla] r = 48 -> %s: %s\n", duet_status_name(s), duet_error_last());
    ly.r = 64;
    ly.dr = 12;
    s = duet_cuda_mla_kv_write(0, &st, &ly, f, f, 1e-6f);
    CHECK(s == DUET_ERR_UNSUPPORTED, "dr = 12: %s", duet_status_name(s));
    ly.r = 1024;
    ly.dr = 64;
    s = duet_cuda_mla_attend(0, &st, &ly, f, f, 4, 4, 1.0f, f, NULL, 0);
    CHECK(s == DUET_ERR_UNSUPPORTED, "r = 1024: %s", duet_status_name(s));
    s = duet_cuda_mla_plan(0, &st, &ly, f, sizeof(f));
    CHECK(s == DUET_ERR_UNSUPPORTED, "plan, r = 1024: %s", duet_status_name(s));
    ly.r = 64;
    ly.kv_dtype = DUET_DTYPE_F16;
    s = duet_cuda_mla_attend(0, &st, &ly, f, f, 4, 4, 1.0f, f, NULL, 0);
    CHECK(s == DUET_ERR_UNSUPPORTED, "F16 cache: %s", duet_status_name(s));
    ly.kv_dtype = DUET_DTYPE_F32;
    /* the scratch: missing, too small, misaligned; a negative max_split_rows */
    s = duet_cuda_mla_attend(0, &st, &ly, f, f, 4, 4, 1.0f, f, NULL, 0);
    CHECK(s == DUET_ERR_RANGE, "attend without scratch: %s", duet_status_name(s));
    printf("[cuda_mla] attend without scratch -> %s: %s\n", duet_status_name(s), duet_error_last());
    s = duet_cuda_mla_plan(0, &st, &ly, f, sizeof(f));
    CHECK(s == DUET_ERR_RANGE, "plan into %zu bytes: %s", sizeof(f), duet_status_name(s));
    const size_t need = duet_cuda_mla_scratch_bytes(&ly, 1, 1, 1);
    CHECK(need > sizeof(f), "%zu", need);
    s = duet_cuda_mla_attend(0, &st, &ly, f, f, 4, 4, 1.0f, f, f, need - 1);
    CHECK(s == DUET_ERR_RANGE, "attend, scratch 1 byte short: %s", duet_status_name(s));
    s = duet_cuda_mla_plan(0, &st, &ly, (char *)f + 4, need);
    CHECK(s == DUET_ERR_RANGE, "plan, scratch off 16-byte alignment: %s", duet_status_name(s));
    st.max_split_rows = -1;
    s = duet_cuda_mla_plan(0, &st, &ly, f, need);
    CHECK(s == DUET_ERR_INVALID, "max_split_rows -1: %s", duet_status_name(s));
    st.max_split_rows = 1;
    s = duet_cuda_mla_attend(0, &st, &ly, f, f, 4, 4, 1.0f, f + 1, f, need);
    CHECK(s == DUET_ERR_INVALID, "lat off 16-byte alignment: %s", duet_status_name(s));
    ly.layer = 1;
    s = duet_cuda_mla_kv_write(0, &st, &ly, f, f, 1e-6f);
    CHECK(s == DUET_ERR_INVALID, "layer out of range: %s", duet_status_name(s));
}

/* ---- GPU correctness --------------------------------------------------------------------------
 */

static void run_cfgs(const cfg_t *cfgs, int n)
{
    skip_without_device();
    for (int i = 0; i < n; i++)
        run_case(&cfgs[i], MIXED, N_MIXED);
}

Test(cuda_mla, small_heads, .timeout = 300)
{
    const cfg_t cfgs[] = {
        {"n8 r128 dr64 bf16 tc", 8, 128, 64, 16, DUET_DTYPE_BF16, 0, 0, 0, 0, 0, 0},
        {"n8 r128 dr64 f32", 8, 128, 64, 16, DUET_DTYPE_F32, 0, 0, 0, 0, 0, 0},
        {"n8 r128 dr64 bf16 simt", 8, 128, 64, 16, DUET_DTYPE_BF16, 1, 0, 0, 0, 0, 0},
        {"n8 r128 dr64 bf16 tc32", 8, 128, 64, 16, DUET_DTYPE_BF16, 0, 32, 0, 0, 0, 0},
        {"n6 r64 dr8 bf16 tc", 6, 64, 8, 16, DUET_DTYPE_BF16, 0, 0, 0, 0, 0, 0},
        {"n6 r64 dr8 f32", 6, 64, 8, 16, DUET_DTYPE_F32, 0, 0, 0, 0, 0, 0},
        {"n6 r64 dr8 bf16 tc pt12", 6, 64, 8, 12, DUET_DTYPE_BF16, 0, 0, 0, 0, 0,
         0}, /* pages not 2^k */
        {"n6 r64 dr8 bf16 tc slots16", 6, 64, 8, 16, DUET_DTYPE_BF16, 0, 0, 0, 16, 0, 0},
        {"n8 r128 dr64 bf16 tc slots32", 8, 128, 64, 16, DUET_DTYPE_BF16, 0, 0, 0, 32, 0, 0},
        {"n2 r32 dr8 bf16 tc", 2, 32, 8, 16, DUET_DTYPE_BF16, 0, 0, 0, 0, 0, 0},
        {"n2 r32 dr8 f32", 2, 32, 8, 16, DUET_DTYPE_F32, 0, 0, 0, 0, 0, 0},
    };
    run_cfgs(cfgs, (int)(sizeof(cfgs) / sizeof(cfgs[0])));
}

Test(cuda_mla, many_heads, .timeout = 300)
{
    const cfg_t cfgs[] = {
        {"n32 r64 dr16 bf16 tc", 32, 64, 16, 16, DUET_DTYPE_BF16, 0, 0, 0, 0, 0, 0},
        {"n32 r64 dr16 f32", 32, 64, 16, 16, DUET_DTYPE_F32, 0, 0, 0, 0, 0, 0},
        {"n40 r96 dr24 bf16 tc", 40, 96, 24, 16, DUET_DTYPE_BF16, 0, 0, 0, 0, 0, 0},
        {"n40 r96 dr24 f32", 40, 96, 24, 16, DUET_DTYPE_F32, 0, 0, 0, 0, 0, 0},
        {"n40 r96 dr24 bf16 tc32", 40, 96, 24, 16, DUET_DTYPE_BF16, 0, 32, 0, 0, 0, 0},
        {"n40 r96 dr24 bf16 tc unaligned", 40, 96, 24, 16, DUET_DTYPE_BF16, 0, 0, 1, 0, 0, 0},
        {"n40 r96 dr24 bf16 tc slots16", 40, 96, 24, 16, DUET_DTYPE_BF16, 0, 0, 0, 16, 0, 0},
        {"n32 r64 dr16 bf16 tc slots32", 32, 64, 16, 16, DUET_DTYPE_BF16, 0, 0, 0, 32, 0, 0},
    };
    run_cfgs(cfgs, (int)(sizeof(cfgs) / sizeof(cfgs[0])));
}

Test(cuda_mla, kimi_shape, .timeout = 300)
{
    const cfg_t cfgs[] = {
        {"n32 r512 dr64 bf16 tc", 32, 512, 64, 16, DUET_DTYPE_BF16, 0, 0, 0, 0, 0, 0},
        {"n32 r512 dr64 f32", 32, 512, 64, 16, DUET_DTYPE_F32, 0, 0, 0, 0, 0, 0},
        {"n32 r512 dr64 bf16 simt", 32, 512, 64, 16, DUET_DTYPE_BF16, 1, 0, 0, 0, 0, 0},
        {"n32 r512 dr64 bf16 tc32", 32, 512, 64, 16, DUET_DTYPE_BF16, 0, 32, 0, 0, 0, 0},
        {"n32 r512 dr64 bf16 tc unaligned", 32, 512, 64, 16, DUET_DTYPE_BF16, 0, 0, 1, 0, 0, 0},
        {"n32 r512 dr64 bf16 tc slots16", 32, 512, 64, 16, DUET_DTYPE_BF16, 0, 0, 0, 16, 0, 0},
        {"n32 r512 dr64 bf16 tc slots16 unaligned", 32, 512, 64, 16, DUET_DTYPE_BF16, 0, 0, 1, 16,
         0, 0},
        {"n32 r512 dr64 bf16 tc slots32", 32, 512, 64, 16, DUET_DTYPE_BF16, 0, 0, 0, 32, 0, 0},
    };
    run_cfgs(cfgs, (int)(sizeof(cfgs) / sizeof(cfgs[0])));
}

/* ---- the per-request plan ----------------------------------------------------------------- */

/*
 * The device's plan equals duet_splitkv_plan (PER_REQUEST) on random steps, every field
 * (plan_check), for several head counts (one or two head groups, up to 16 rows per block), unit
 * counts (the SMs; 1, 7: chunks of many blocks; 2048: a chunk of one block, so a 300K
 * context hits DUET_SPLITKV_MAX_SPLITS) and 16-slot blocks. Steps: skewed (one long item and
 * many short ones), uniform, verify rows (2 .. 16 rows per item), prefill items (17 .. 300 rows:
 * never split) with items of no rows, and over 512 items (the planner's scans take several
 * passes of its 512 threads). Only the step's metadata goes to the device.
 */
Test(cuda_mla, device_plan_equals_host, .timeout = 300)
{
    skip_without_device();
    void *d_dummy = dev_alloc(64); /* the pool: the planner never reads it */
    const int heads[4] = {32, 8, 40, 2};
    const int units[4] = {0, 1, 7, 2048};
    item_spec_t *items = xmalloc(sizeof(item_spec_t) * 1000);
    for (int trial = 0; trial < 40; trial++) {
        const int kind = trial % 5, n = heads[trial / 5 % 4], u = units[trial % 4];
        const int slots = trial % 7 == 3 ? 16 : 0;
        int n_items = 0, max_tok = 1;
        switch (kind) {
        case 0: { /* skewed */
            items[n_items++] =
                (item_spec_t){u == 2048 ? 300000 : 20000 + (int)(rng_u32() % 100000), 1};
            const int k = 1 + (int)(rng_u32() % 100);
            for (int i = 0; i < k; i++)
                items[n_items++] = (item_spec_t){(int)(rng_u32() % 2000), 1};
            break;
        }
        case 1: { /* uniform */
            const int k = 1 + (int)(rng_u32() % 128), ctx = (int)(rng_u32() % 20000);
            for (int i = 0; i < k; i++)
                items[n_items++] = (item_spec_t){ctx, 1};
            break;
        }
        case 2: { /* verify rows */
            const int k = 1 + (int)(rng_u32() % 64);
            for (int i = 0; i < k; i++)
                items[n_items++] =
                    (item_spec_t){(int)(rng_u32() % 30000), 2 + (int)(rng_u32() % 15)};
            break;
        }
        case 3: { /* prefill items, items of no rows, decode */
            const int k = 2 + (int)(rng_u32() % 40);
            for (int i = 0; i < k; i++) {
                const int v = (int)(rng_u32() % 3);
                items[n_items++] =
                    v == 0   ? (item_spec_t){(int)(rng_u32() % 5000), 17 + (int)(rng_u32() % 284)}
                    : v == 1 ? (item_spec_t){0, 0}
                             : (item_spec_t){(int)(rng_u32() % 5000), 1 + (int)(rng_u32() % 16)};
            }
            break;
        }
        default: { /* many items */
            const int k = 513 + (int)(rng_u32() % 400);
            for (int i = 0; i < k; i++)
                items[n_items++] = (item_spec_t){(int)(rng_u32() % 3000), 1 + (i % 17 == 0)};
            break;
        }
        }
        for (int i = 0; i < n_items; i++)
            max_tok = items[i].n_tok > max_tok ? items[i].n_tok : max_tok;
        batch_t b;
        batch_build(&b, items, n_items, 64);
        batch_upload(&b, max_tok);
        const duet_cuda_mla_layer_t ly = {.kv_base = d_dummy,
                                          .kv_dtype = DUET_DTYPE_BF16,
                                          .kv_n_layers = 1,
                                          .page_tokens = 64,
                                          .layer = 0,
                                          .n_heads = n,
                                          .r = 512,
                                          .dr = 64};
        duet__cuda_mla_plan_units(u);
        duet__cuda_mla_tc_slots(slots);
        const size_t bytes =
            duet_cuda_mla_scratch_bytes(&ly, n_items, b.n_rows, b.st.max_split_rows);
        void *d_scratch = dev_alloc(bytes);
        CUDA_OK(cudaMemset(d_scratch, 0xff, bytes));
        int64_t hg;
        int rb;
        grid_of(n, 512, 64, DUET_DTYPE_BF16, 0, 0, slots, &hg, &rb);
        char what[128];
        /* the modes measured against the engine's (bench/bench_splitkv_cuda.c), then its own */
        const duet_splitkv_mode_t other[2] = {DUET_SPLITKV_UNIFORM, DUET_SPLITKV_NONE};
        for (int m = 0; m < 2; m++) {
            duet__cuda_mla_plan_mode(other[m]);
            CUDA_OK(cudaMemset(d_scratch, 0xff, bytes));
            DUET_OK_OR_FAIL(duet_cuda_mla_plan(0, &b.st, &ly, d_scratch, bytes));
            CUDA_OK(cudaDeviceSynchronize());
            plan_t po;
            plan_fetch(&po, &b, &ly, d_scratch, bytes);
            snprintf(what, sizeof(what),
                     "trial %d (kind %d, %d items, %d heads, units %d, mode %d)", trial, kind,
                     n_items, n, u, (int)other[m]);
            plan_check(what, &po, &b, hg, u > 0 ? u : default_units(), rb, other[m]);
            plan_free(&po);
        }
        duet__cuda_mla_plan_mode(DUET_SPLITKV_PER_REQUEST);
        CUDA_OK(cudaMemset(d_scratch, 0xff, bytes));
        DUET_OK_OR_FAIL(duet_cuda_mla_plan(0, &b.st, &ly, d_scratch, bytes));
        CUDA_OK(cudaDeviceSynchronize());
        plan_t pl;
        plan_fetch(&pl, &b, &ly, d_scratch, bytes);
        snprintf(what, sizeof(what), "trial %d (kind %d, %d items, %d heads, units %d, slots %d)",
                 trial, kind, n_items, n, u, slots);
        plan_check(what, &pl, &b, hg, u > 0 ? u : default_units(), rb, DUET_SPLITKV_PER_REQUEST);
        int split = 0, most = 0;
        for (int i = 0; i < n_items; i++) {
            split += pl.splits[i] > 1;
            most = pl.splits[i] > most ? pl.splits[i] : most;
        }
        printf("[cuda_mla] plan %s: %lld work items (room %lld), %lld tasks (room %lld), chunk "
               "%lld, %d items split, at most %d ways\n",
               what, (long long)pl.n_work, (long long)pl.max_work, (long long)pl.n_tasks,
               (long long)pl.max_tasks, (long long)pl.chunk, split, most);
        plan_free(&pl);
        cudaFree(d_scratch);
        batch_free(&b);
    }
    duet__cuda_mla_plan_units(0);
    duet__cuda_mla_tc_slots(0);
    free(items);
    cudaFree(d_dummy);
}

/* A skewed step: one long decode beside many short ones, verify items (4 and 16 rows) and a
 * prefill of 20 rows; the long one is cut many ways, most short ones stay whole. */
static const item_spec_t SKEWED[] = {
    {2500, 1}, {3, 1}, {17, 1},  {40, 1},  {63, 1}, {64, 1}, {90, 1},  {128, 1},
    {150, 1},  {7, 1}, {31, 1},  {200, 1}, {11, 1}, {77, 1}, {300, 4}, {500, 16},
    {45, 20},  {0, 1}, {130, 1}, {250, 1}, {5, 1},  {99, 1}, {33, 1},  {64, 4},
};
#define N_SKEWED ((int)(sizeof(SKEWED) / sizeof(SKEWED[0])))

/* A uniform step: 16 decode items and 8 verify items of 5 rows at the same context. */
static const item_spec_t UNIFORM[] = {
    {700, 1}, {700, 1}, {700, 1}, {700, 1}, {700, 1}, {700, 1}, {700, 1}, {700, 1},
    {700, 1}, {700, 1}, {700, 1}, {700, 1}, {700, 1}, {700, 1}, {700, 1}, {700, 1},
    {700, 5}, {700, 5}, {700, 5}, {700, 5}, {700, 5}, {700, 5}, {700, 5}, {700, 5},
};
#define N_UNIFORM ((int)(sizeof(UNIFORM) / sizeof(UNIFORM[0])))

/* Every item within one 64-position block, so every plan puts each on one split, rows 1 .. 16. */
static const item_spec_t ONE_BLOCK[] = {
    {0, 1}, {10, 1}, {63, 1}, {20, 4}, {48, 16}, {5, 9}, {62, 2}, {31, 1}, {0, 16}, {40, 1},
};
#define N_ONE_BLOCK ((int)(sizeof(ONE_BLOCK) / sizeof(ONE_BLOCK[0])))

/* The per-request plan's attention on skewed and uniform steps with verify rows, against the
 * reference (run_case: every plan also checked against the host's). */
Test(cuda_mla, skewed_and_uniform_steps, .timeout = 300)
{
    skip_without_device();
    const cfg_t cfgs[] = {
        {"n32 r512 dr64 bf16 tc", 32, 512, 64, 16, DUET_DTYPE_BF16, 0, 0, 0, 0, 0, 0},
        {"n8 r128 dr64 f32", 8, 128, 64, 16, DUET_DTYPE_F32, 0, 0, 0, 0, 0, 0},
        {"n40 r96 dr24 bf16 tc", 40, 96, 24, 16, DUET_DTYPE_BF16, 0, 0, 0, 0, 0, 0},
        {"n32 r64 dr16 bf16 tc slots16", 32, 64, 16, 16, DUET_DTYPE_BF16, 0, 0, 0, 16, 0, 0},
    };
    for (int i = 0; i < (int)(sizeof(cfgs) / sizeof(cfgs[0])); i++) {
        run_case(&cfgs[i], SKEWED, N_SKEWED);
        run_case(&cfgs[i], UNIFORM, N_UNIFORM);
    }
}

/*
 * Items planned onto one split write lat themselves and the merge leaves them alone: with the
 * scratch full of NaN (run_case poisons it before every plan), a merge that read their
 * partials would write NaN. ONE_BLOCK: every item on one split (checked), the reducer launched
 * and returning for each row; MIXED with max_split_rows = 0: nothing split, no reducer.
 */
Test(cuda_mla, one_split_items_skip_the_merge, .timeout = 300)
{
    skip_without_device();
    const cfg_t one[] = {
        {"one block n32 r64 bf16 tc", 32, 64, 16, 16, DUET_DTYPE_BF16, 0, 0, 0, 0, 0, 1},
        {"one block n8 r128 f32", 8, 128, 64, 16, DUET_DTYPE_F32, 0, 0, 0, 0, 0, 1},
    };
    for (int i = 0; i < 2; i++)
        run_case(&one[i], ONE_BLOCK, N_ONE_BLOCK);
    const cfg_t none[] = {
        {"unsplit n32 r512 bf16 tc", 32, 512, 64, 16, DUET_DTYPE_BF16, 0, 0, 0, 0, 1, 0},
        {"unsplit n6 r64 f32", 6, 64, 8, 16, DUET_DTYPE_F32, 0, 0, 0, 0, 1, 0},
    };
    for (int i = 0; i < 2; i++)
        run_case(&none[i], MIXED, N_MIXED);
}

/* ---- GPU timing -------------------------------------------------------------------------------
 */

typedef struct {
    const batch_t *b;
    const duet_cuda_mla_layer_t *ly;
    const float *qhat, *mq;
    int dqk;
    float *lat;
    void *scratch;
    size_t bytes;
} attend_args_t;

/* One layer's attend of a step planned before (the engine plans once per step). */
static duet_status_t attend_once(const attend_args_t *t, cudaStream_t s)
{
    return duet_cuda_mla_attend(s, &t->b->st, t->ly, t->qhat, t->mq + 16,
                                (int64_t)t->ly->n_heads * t->dqk, t->dqk, 0.07f, t->lat, t->scratch,
                                t->bytes);
}

/*
 * Microseconds per attend: `iters` calls captured into one CUDA graph (GPU time only, and proof
 * that attend is capturable: no sync, allocation or host read inside), and *direct_us the same
 * calls launched one by one (adds the host's launch cost when it exceeds the GPU's).
 */
static double time_attend(const attend_args_t *t, int iters, double *direct_us)
{
    cudaStream_t s;
    cudaEvent_t e0, e1;
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    for (int it = 0; it < 2; it++) /* warm-up; opts the kernels into their shared memory */
        DUET_OK_OR_FAIL(attend_once(t, s));
    float ms = 0.0f;
    CUDA_OK(cudaEventRecord(e0, s));
    for (int it = 0; it < iters; it++)
        DUET_OK_OR_FAIL(attend_once(t, s));
    CUDA_OK(cudaEventRecord(e1, s));
    CUDA_OK(cudaEventSynchronize(e1));
    CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
    *direct_us = 1e3 * ms / iters;

    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    duet_status_t st = DUET_OK;
    for (int it = 0; it < iters && st == DUET_OK; it++)
        st = attend_once(t, s);
    const cudaError_t ce = cudaStreamEndCapture(s, &graph);
    CHECK(st == DUET_OK, "attend under capture: %s: %s", duet_status_name(st), duet_error_last());
    CHECK(ce == cudaSuccess, "capture: %s", cudaGetErrorString(ce));
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_OK(cudaGraphLaunch(exec, s)); /* warm-up */
    CUDA_OK(cudaEventRecord(e0, s));
    CUDA_OK(cudaGraphLaunch(exec, s));
    CUDA_OK(cudaEventRecord(e1, s));
    CUDA_OK(cudaEventSynchronize(e1));
    CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaStreamDestroy(s);
    return 1e3 * ms / iters;
}

/* n_items items of rows_per_item new rows each at positions pos0 ..; item i owns pages i·ppi .. */
static void timing_batch(batch_t *b, int n_items, int rows_per_item, int pos0, int ppi)
{
    memset(b, 0, sizeof(*b));
    const int R = n_items * rows_per_item;
    b->n_items = n_items;
    b->n_rows = R;
    b->max_pages = ppi;
    b->max_ctx = pos0 + rows_per_item;
    b->item_row0 = xmalloc(sizeof(int32_t) * (size_t)(n_items + 1));
    b->item_pos0 = xmalloc(sizeof(int32_t) * (size_t)n_items);
    b->item_slot = xmalloc(sizeof(int32_t) * (size_t)n_items);
    b->item_pages = xmalloc(sizeof(int32_t) * (size_t)n_items * ppi);
    b->row_item = xmalloc(sizeof(int32_t) * (size_t)R);
    b->row_pos = xmalloc(sizeof(int32_t) * (size_t)R);
    for (int i = 0; i <= n_items; i++)
        b->item_row0[i] = i * rows_per_item;
    for (int i = 0; i < n_items; i++) {
        b->item_pos0[i] = pos0;
        b->item_slot[i] = i;
        for (int p = 0; p < ppi; p++)
            b->item_pages[i * ppi + p] = i * ppi + p;
        for (int t = 0; t < rows_per_item; t++) {
            b->row_item[i * rows_per_item + t] = i;
            b->row_pos[i * rows_per_item + t] = pos0 + t;
        }
    }
    batch_upload(b, rows_per_item);
}

/*
 * attend at Kimi Linear's shape, BF16 cache: decode (one row per item) at 32K context for
 * batches 64, 8 and 1 and at 2K for batches 1 and 8, with the step's per-request plan, on every
 * path (both tensor-core tiles, and CUDA cores for decode), and a 1024-row prefill chunk ending
 * at 8K (never split). Every cache byte is 0x3c (bf16 0.011474609375), so every output must equal
 * that value (equal scores, weights summing to 1): a check that the long split paths add up at full
 * shape.
 */
Test(cuda_mla, timing_32k, .timeout = 300)
{
    skip_without_device();
    const int n = 32, r = 512, dr = 64, td = r + dr, pt = 64, ctx = 32768, max_b = 64;
    const int ppi = ctx / pt; /* pages per item */
    const int max_rows = 1024;
    const size_t pool_bytes = (size_t)max_b * ppi * pt * td * 2;
    void *d_pool = dev_alloc(pool_bytes);
    CUDA_OK(cudaMemset(d_pool, 0x3c, pool_bytes));
    const float expect = duet_bf16_to_f32(0x3c3c);

    const int dqk = 16 + dr;
    float *qhat = xmalloc(sizeof(float) * (size_t)max_rows * n * r);
    float *mq = xmalloc(sizeof(float) * (size_t)max_rows * n * dqk);
    for (int64_t i = 0; i < (int64_t)max_rows * n * r; i++)
        qhat[i] = 3.0f * rng_f();
    for (int64_t i = 0; i < (int64_t)max_rows * n * dqk; i++)
        mq[i] = 3.0f * rng_f();
    float *d_qhat = dev_copy(qhat, sizeof(float) * (size_t)max_rows * n * r);
    float *d_mq = dev_copy(mq, sizeof(float) * (size_t)max_rows * n * dqk);
    float *d_lat = dev_alloc(sizeof(float) * (size_t)max_rows * n * r);
    float *lat = xmalloc(sizeof(float) * (size_t)max_rows * n * r);

    const duet_cuda_mla_layer_t ly = {.kv_base = d_pool,
                                      .kv_dtype = DUET_DTYPE_BF16,
                                      .kv_n_layers = 1,
                                      .page_tokens = pt,
                                      .layer = 0,
                                      .n_heads = n,
                                      .r = r,
                                      .dr = dr};
    /* (items, rows per item, pos0) */
    const int cases[6][3] = {{64, 1, ctx - 1}, {8, 1, ctx - 1}, {1, 1, ctx - 1},
                             {1, 1, 2048},     {8, 1, 2048},    {1, 1024, 8192 - 1024}};
    for (int ci = 0; ci < 6; ci++) {
        const int B = cases[ci][0], T = cases[ci][1], pos0 = cases[ci][2];
        batch_t b;
        timing_batch(&b, B, T, pos0, ppi);
        const size_t bytes = duet_cuda_mla_scratch_bytes(&ly, B, b.n_rows, b.st.max_split_rows);
        void *d_scr = dev_alloc(bytes);
        DUET_OK_OR_FAIL(duet_cuda_mla_plan(0, &b.st, &ly, d_scr, bytes));
        CUDA_OK(cudaDeviceSynchronize());
        plan_t pl;
        plan_fetch(&pl, &b, &ly, d_scr, bytes);
        /* KV bytes the attention must read: every row's visible positions, once per block */
        double kv_bytes = 0.0;
        for (int t = 0; t < T; t++)
            kv_bytes += (double)B * (pos0 + t + 1) * td * 2;

        const char *paths[3] = {"tc, tile 32", "tc, tile 64", "CUDA cores"};
        const attend_args_t args = {&b, &ly, d_qhat, d_mq, dqk, d_lat, d_scr, bytes};
        for (int path = 0; path < 3; path++) {
            if (path == 2 && T > 1)
                continue; /* the CUDA-core prefill is only slower; skip its seconds */
            duet__cuda_mla_force_simt(path == 2);
            duet__cuda_mla_tc_tile(path == 1 ? 64 : 32);
            double direct = 0.0;
            const double us = time_attend(&args, path == 2 ? 3 : 20, &direct);
            printf("[cuda_mla] timing n32 r512 dr64 bf16, %4d item(s) x %4d row(s) at ctx %5d, "
                   "%4lld work items (item 0: %4d splits), %-12s: %9.1f us (graph), %9.1f us "
                   "(direct launches), %7.1f GB/s of KV\n",
                   B, T, b.max_ctx, (long long)pl.n_work, pl.splits[0], paths[path], us, direct,
                   kv_bytes / (us * 1e-6) / 1e9);
            CUDA_OK(cudaMemcpy(lat, d_lat, sizeof(float) * (size_t)b.n_rows * n * r,
                               cudaMemcpyDeviceToHost));
            double err = 0.0;
            for (int64_t i = 0; i < (int64_t)b.n_rows * n * r; i++) {
                const double e = fabs((double)lat[i] - expect) / expect;
                err = e <= err ? err : e;
            }
            CHECK(err <= 1e-5, "%d x %d %s: flat-cache output off by %g", B, T, paths[path], err);
        }
        duet__cuda_mla_tc_tile(0);
        duet__cuda_mla_force_simt(0);
        plan_free(&pl);
        cudaFree(d_scr);
        batch_free(&b);
    }
    free(lat);
    free(mq);
    free(qhat);
    cudaFree(d_lat);
    cudaFree(d_mq);
    cudaFree(d_qhat);
    cudaFree(d_pool);
}
