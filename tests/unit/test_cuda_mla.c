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
 * else in the pool changed), then attend with kv_splits 1, 3, 7, 64 (more splits than tiles:
 * most blocks see an empty range and must leave a neutral partial) and the planned count, each
 * compared with the reference computed from the cache as the GPU left it (for BF16 the
 * reference reads the same bf16-rounded rows); last, the new rows' slots are put back to their
 * old contents and kv_write + attend run back to back on one stream, as in a step (attend,
 * a programmatic dependent launch, copies older rows before its wait: it must still see the
 * new ones). Shapes cover n = 2, 6, 8, 32 and 40 heads (one to sixteen rows per block, a
 * partial second head group), r = 32 .. 512 and dr = 8 .. 64 (r + dr not a multiple of 16),
 * pages of 16 and 12 tokens, on the tensor-core path (BF16; tiles of 32 and of 64 positions;
 * Kimi's 512 + 64 has its own compiled-in kernel) and the CUDA-core path (F32, and BF16 forced
 * through it).
 *
 * Error measure. For output j of a (row, head), err = |lat_gpu − lat_ref| / S_j with
 * S_j = Σ_s p_s |c_s,j| (p the reference softmax): the output is a p-weighted mean, so both an
 * absolute score error δ (which perturbs every weight by ~δ relative) and the rounding of the
 * weighted sum are bounded by a multiple of S_j, not of |lat_j|, which can cancel to ~0.
 *   CUDA-core (fp32 math on exactly the cached values): scores are fp32 dot products of <= 576
 *     terms (here |score| <~ 10, Σ|q c| · scale <~ 30): typical error ~1e-6, the fp32 sums of
 *     <= 1003 weighted rows another ~1e-6 (worst-case bounds n·u·(…) are ~100× larger but need
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
 * Without a CUDA device (this build VM, CI) the GPU tests skip with a reason; the planner, the
 * scratch size and the argument checks run anyway (they touch no device). A last test times
 * attend (attention + split reducer) at Kimi Linear's shape (n = 32, r = 512, dr = 64, BF16):
 * decode at 32K context for batches 64, 8 and 1 and at 2K for batches 1 and 8 with the planned
 * splits, and a 1024-row prefill chunk ending at 8K. The calls are captured into a CUDA graph
 * (which also proves attend capturable) and timed with events; it prints microseconds and the
 * KV bytes read per second.
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
 * tile (0: the default, 32 or 64 positions). */
void duet__cuda_mla_force_simt(int on);
void duet__cuda_mla_tc_tile(int tk);
void duet__cuda_mla_tc_slots(int n);

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
    int simt;  /* force the CUDA-core kernel for a BF16 cache */
    int tile;  /* tensor-core tile (duet__cuda_mla_tc_tile), 0 = the default */
    int off;   /* q̂ and q this many floats past 16-byte alignment (the 4-byte copies of q) */
    int slots; /* slots per tensor-core block (duet__cuda_mla_tc_slots), 0 = chosen */
} cfg_t;

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

    /* ---- attend at several split counts ---- */
    const int planned = duet_cuda_mla_plan_splits(n_items, b.max_ctx, n_sms());
    /* the last run repeats the planned count with kv_write right before it (see below) */
    const int splits[6] = {1, 3, 7, 64, planned, planned};
    void *d_scratch = dev_alloc(duet_cuda_mla_scratch_bytes(R, n, r, planned > 64 ? planned : 64));
    float *lat = xmalloc(sizeof(float) * (size_t)R * n * r);
    const double tol = (dt == DUET_DTYPE_BF16 && !c->simt) ? TOL_TC : TOL_SIMT;
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    duet__cuda_mla_force_simt(c->simt);
    duet__cuda_mla_tc_tile(c->tile);
    duet__cuda_mla_tc_slots(c->slots);
    for (int k = 0; k < 6; k++) {
        CUDA_OK(cudaMemsetAsync(d_lat, 0xff, sizeof(float) * (size_t)R * n * r, stream)); /* NaN */
        if (k == 5) {
            /*
             * kv_write and attend back to back on one stream, as a step runs them: the new
             * rows' slots hold their old contents again, and attend (launched with
             * programmatic dependent launch where the device has it) may start copying older
             * rows while kv_write runs; it must still see every row kv_write writes.
             */
            CUDA_OK(cudaMemcpyAsync(d_pool, pool0, (size_t)pool_elems * esz, cudaMemcpyHostToDevice,
                                    stream));
            DUET_OK_OR_FAIL(duet_cuda_mla_kv_write(stream, &b.st, &ly, d_ckr, d_w, NORM_EPS));
        }
        DUET_OK_OR_FAIL(duet_cuda_mla_attend(stream, &b.st, &ly, d_qhat, d_mq + 16,
                                             (int64_t)n * dqk, dqk, scale, splits[k], d_lat,
                                             d_scratch));
        CUDA_OK(cudaStreamSynchronize(stream));
        CUDA_OK(cudaMemcpy(lat, d_lat, sizeof(float) * (size_t)R * n * r, cudaMemcpyDeviceToHost));
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
        printf("[cuda_mla] %-28s attend kv_splits %2d: max err %.3g (tol %.3g)%s\n", c->name,
               splits[k], err, tol,
               k == 4   ? " [planned]"
               : k == 5 ? " [planned, right after kv_write]"
                        : "");
        CHECK(bad == 0,
              "%s, kv_splits %d%s: %lld outputs over tolerance, worst %g at row %lld head "
              "%lld dim %lld (gpu %g, ref %g)",
              c->name, splits[k], k == 5 ? " after kv_write" : "", (long long)bad, err,
              (long long)(worst / ((int64_t)n * r)), (long long)(worst / r % n),
              (long long)(worst % r), lat[worst], ref[worst]);
    }
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

Test(cuda_mla, plan_and_scratch, .timeout = 30)
{
    /* short contexts are never split */
    CHECK(duet_cuda_mla_plan_splits(1, 100, 132) == 1);
    CHECK(duet_cuda_mla_plan_splits(64, 300, 132) == 1);
    CHECK(duet_cuda_mla_plan_splits(0, 32768, 132) == 1);
    CHECK(duet_cuda_mla_plan_splits(1, 32768, 0) == 1);
    /*
     * Every count is a power of two or the items' share of the SMs (a growing context changes
     * the plan, and so the engine's graph, only a few times) and every split range,
     * ceil(ctx / s) rounded up to 32 positions (both tensor-core tiles are multiples of it),
     * keeps >= 64 positions.
     */
    const int64_t items[] = {1, 2, 7, 8, 64, 100, 256};
    const int64_t ctxs[] = {512, 1000, 2049, 4096, 32768, 131072};
    for (int k = 0; k < 6; k++)
        for (int i = 0; i < 7; i++) {
            const int s = duet_cuda_mla_plan_splits(items[i], ctxs[k], 132);
            const int64_t range = ((ctxs[k] + s - 1) / s + 31) / 32 * 32;
            CHECK(s >= 1 && ((s & (s - 1)) == 0 || s == 132 / items[i]) && (s == 1 || range >= 64),
                  "items %lld ctx %lld -> %d (range %lld)", (long long)items[i], (long long)ctxs[k],
                  s, (long long)range);
        }
    /* a lone decode fills the GPU even at 2K (short ranges: the block's fixed cost dominated
     * with 256-position ranges); a full batch needs few splits */
    const int s1_2k = duet_cuda_mla_plan_splits(1, 2049, 132);
    const int s1 = duet_cuda_mla_plan_splits(1, 32768, 132);
    const int s8 = duet_cuda_mla_plan_splits(8, 32768, 132);
    const int s64 = duet_cuda_mla_plan_splits(64, 32768, 132);
    const int s1_past = duet_cuda_mla_plan_splits(1, 32800, 132);
    printf("[cuda_mla] planned splits, 132 SMs: batch 1 at 2K -> %d; at 32K: batch 1 -> %d, "
           "batch 8 -> %d, batch 64 -> %d; batch 1 at 32800 -> %d\n",
           s1_2k, s1, s8, s64, s1_past);
    CHECK(s1_2k >= 16, "%d", s1_2k);
    /* just past 32K, 128 splits round to 5 tiles of 64 on 103 blocks; the SM share to 4 on 129 */
    CHECK(s1_past == 132, "%d", s1_past);
    CHECK(s1 >= 64, "%d", s1);
    CHECK(s8 >= 8 && s8 <= 32, "%d", s8);
    CHECK(s64 >= 2 && s64 <= 8, "%d", s64);

    CHECK(duet_cuda_mla_scratch_bytes(64, 32, 512, 1) == 0);
    const size_t b3 = duet_cuda_mla_scratch_bytes(64, 32, 512, 3);
    CHECK(b3 >= (size_t)3 * 64 * 32 * (512 + 2) * sizeof(float));
    CHECK(duet_cuda_mla_scratch_bytes(64, 32, 512, 6) > b3);
}

Test(cuda_mla, rejects_bad_arguments, .timeout = 30)
{
    /* shape checks come before any device work, so these run without a GPU */
    int32_t dummy[4] = {0, 1, 0, 0};
    duet_cuda_step_t st = {.n_items = 1,
                           .n_rows = 1,
                           .max_item_tokens = 1,
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
    duet_status_t s = duet_cuda_mla_attend(0, &st, &ly, f, f, 4, 4, 1.0f, 1, f, NULL);
    CHECK(s == DUET_ERR_UNSUPPORTED, "r = 48: %s", duet_status_name(s));
    printf("[cuda_mla] r = 48 -> %s: %s\n", duet_status_name(s), duet_error_last());
    ly.r = 64;
    ly.dr = 12;
    s = duet_cuda_mla_kv_write(0, &st, &ly, f, f, 1e-6f);
    CHECK(s == DUET_ERR_UNSUPPORTED, "dr = 12: %s", duet_status_name(s));
    ly.r = 1024;
    ly.dr = 64;
    s = duet_cuda_mla_attend(0, &st, &ly, f, f, 4, 4, 1.0f, 1, f, NULL);
    CHECK(s == DUET_ERR_UNSUPPORTED, "r = 1024: %s", duet_status_name(s));
    ly.r = 64;
    ly.kv_dtype = DUET_DTYPE_F16;
    s = duet_cuda_mla_attend(0, &st, &ly, f, f, 4, 4, 1.0f, 1, f, NULL);
    CHECK(s == DUET_ERR_UNSUPPORTED, "F16 cache: %s", duet_status_name(s));
    ly.kv_dtype = DUET_DTYPE_F32;
    s = duet_cuda_mla_attend(0, &st, &ly, f, f, 4, 4, 1.0f, 0, f, NULL);
    CHECK(s == DUET_ERR_INVALID, "kv_splits 0: %s", duet_status_name(s));
    s = duet_cuda_mla_attend(0, &st, &ly, f, f, 4, 4, 1.0f, 2, f, NULL);
    CHECK(s == DUET_ERR_INVALID, "kv_splits 2 without scratch: %s", duet_status_name(s));
    s = duet_cuda_mla_attend(0, &st, &ly, f, f, 4, 4, 1.0f, 1, f + 1, NULL);
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
        {"n8 r128 dr64 bf16 tc", 8, 128, 64, 16, DUET_DTYPE_BF16, 0, 0, 0, 0},
        {"n8 r128 dr64 f32", 8, 128, 64, 16, DUET_DTYPE_F32, 0, 0, 0, 0},
        {"n8 r128 dr64 bf16 simt", 8, 128, 64, 16, DUET_DTYPE_BF16, 1, 0, 0, 0},
        {"n8 r128 dr64 bf16 tc32", 8, 128, 64, 16, DUET_DTYPE_BF16, 0, 32, 0, 0},
        {"n6 r64 dr8 bf16 tc", 6, 64, 8, 16, DUET_DTYPE_BF16, 0, 0, 0, 0},
        {"n6 r64 dr8 f32", 6, 64, 8, 16, DUET_DTYPE_F32, 0, 0, 0, 0},
        {"n6 r64 dr8 bf16 tc pt12", 6, 64, 8, 12, DUET_DTYPE_BF16, 0, 0, 0, 0}, /* pages not 2^k */
        {"n6 r64 dr8 bf16 tc slots16", 6, 64, 8, 16, DUET_DTYPE_BF16, 0, 0, 0, 16},
        {"n8 r128 dr64 bf16 tc slots32", 8, 128, 64, 16, DUET_DTYPE_BF16, 0, 0, 0, 32},
        {"n2 r32 dr8 bf16 tc", 2, 32, 8, 16, DUET_DTYPE_BF16, 0, 0, 0, 0},
        {"n2 r32 dr8 f32", 2, 32, 8, 16, DUET_DTYPE_F32, 0, 0, 0, 0},
    };
    run_cfgs(cfgs, (int)(sizeof(cfgs) / sizeof(cfgs[0])));
}

Test(cuda_mla, many_heads, .timeout = 300)
{
    const cfg_t cfgs[] = {
        {"n32 r64 dr16 bf16 tc", 32, 64, 16, 16, DUET_DTYPE_BF16, 0, 0, 0, 0},
        {"n32 r64 dr16 f32", 32, 64, 16, 16, DUET_DTYPE_F32, 0, 0, 0, 0},
        {"n40 r96 dr24 bf16 tc", 40, 96, 24, 16, DUET_DTYPE_BF16, 0, 0, 0, 0},
        {"n40 r96 dr24 f32", 40, 96, 24, 16, DUET_DTYPE_F32, 0, 0, 0, 0},
        {"n40 r96 dr24 bf16 tc32", 40, 96, 24, 16, DUET_DTYPE_BF16, 0, 32, 0, 0},
        {"n40 r96 dr24 bf16 tc unaligned", 40, 96, 24, 16, DUET_DTYPE_BF16, 0, 0, 1, 0},
        {"n40 r96 dr24 bf16 tc slots16", 40, 96, 24, 16, DUET_DTYPE_BF16, 0, 0, 0, 16},
        {"n32 r64 dr16 bf16 tc slots32", 32, 64, 16, 16, DUET_DTYPE_BF16, 0, 0, 0, 32},
    };
    run_cfgs(cfgs, (int)(sizeof(cfgs) / sizeof(cfgs[0])));
}

Test(cuda_mla, kimi_shape, .timeout = 300)
{
    const cfg_t cfgs[] = {
        {"n32 r512 dr64 bf16 tc", 32, 512, 64, 16, DUET_DTYPE_BF16, 0, 0, 0, 0},
        {"n32 r512 dr64 f32", 32, 512, 64, 16, DUET_DTYPE_F32, 0, 0, 0, 0},
        {"n32 r512 dr64 bf16 simt", 32, 512, 64, 16, DUET_DTYPE_BF16, 1, 0, 0, 0},
        {"n32 r512 dr64 bf16 tc32", 32, 512, 64, 16, DUET_DTYPE_BF16, 0, 32, 0, 0},
        {"n32 r512 dr64 bf16 tc unaligned", 32, 512, 64, 16, DUET_DTYPE_BF16, 0, 0, 1, 0},
        {"n32 r512 dr64 bf16 tc slots16", 32, 512, 64, 16, DUET_DTYPE_BF16, 0, 0, 0, 16},
        {"n32 r512 dr64 bf16 tc slots16 unaligned", 32, 512, 64, 16, DUET_DTYPE_BF16, 0, 0, 1, 16},
        {"n32 r512 dr64 bf16 tc slots32", 32, 512, 64, 16, DUET_DTYPE_BF16, 0, 0, 0, 32},
    };
    run_cfgs(cfgs, (int)(sizeof(cfgs) / sizeof(cfgs[0])));
}

/* ---- GPU timing -------------------------------------------------------------------------------
 */

typedef struct {
    const batch_t *b;
    const duet_cuda_mla_layer_t *ly;
    const float *qhat, *mq;
    int dqk, splits;
    float *lat;
    void *scratch;
} attend_args_t;

static duet_status_t attend_once(const attend_args_t *t, cudaStream_t s)
{
    return duet_cuda_mla_attend(s, &t->b->st, t->ly, t->qhat, t->mq + 16,
                                (int64_t)t->ly->n_heads * t->dqk, t->dqk, 0.07f, t->splits, t->lat,
                                t->scratch);
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
 * batches 64, 8 and 1 and at 2K for batches 1 and 8, with the planned splits, on every path
 * (both tensor-core tiles, and CUDA cores for decode), and a 1024-row prefill chunk ending at
 * 8K. Every cache byte is 0x3c (bf16 0.011474609375), so every output must equal that value
 * (equal scores, weights summing to 1): a check that the long split paths add up at full shape.
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
    /* (items, rows per item, pos0, kv_splits: 0 = planned) */
    const int cases[6][4] = {{64, 1, ctx - 1, 0}, {8, 1, ctx - 1, 0}, {1, 1, ctx - 1, 0},
                             {1, 1, 2048, 0},     {8, 1, 2048, 0},    {1, 1024, 8192 - 1024, 1}};
    for (int ci = 0; ci < 6; ci++) {
        const int B = cases[ci][0], T = cases[ci][1], pos0 = cases[ci][2];
        batch_t b;
        timing_batch(&b, B, T, pos0, ppi);
        const int splits =
            cases[ci][3] > 0 ? cases[ci][3] : duet_cuda_mla_plan_splits(B, b.max_ctx, n_sms());
        void *d_scr = dev_alloc(duet_cuda_mla_scratch_bytes(b.n_rows, n, r, splits) + 256);
        /* KV bytes the attention must read: every row's visible positions, once per block */
        double kv_bytes = 0.0;
        for (int t = 0; t < T; t++)
            kv_bytes += (double)B * (pos0 + t + 1) * td * 2;

        const char *paths[3] = {"tc, tile 32", "tc, tile 64", "CUDA cores"};
        const attend_args_t args = {&b, &ly, d_qhat, d_mq, dqk, splits, d_lat, d_scr};
        for (int path = 0; path < 3; path++) {
            if (path == 2 && T > 1)
                continue; /* the CUDA-core prefill is only slower; skip its seconds */
            duet__cuda_mla_force_simt(path == 2);
            duet__cuda_mla_tc_tile(path == 1 ? 64 : 32);
            double direct = 0.0;
            const double us = time_attend(&args, path == 2 ? 3 : 20, &direct);
            printf("[cuda_mla] timing n32 r512 dr64 bf16, %4d item(s) x %4d row(s) at ctx %5d, "
                   "kv_splits %3d, %-12s: %9.1f us (graph), %9.1f us (direct launches), "
                   "%7.1f GB/s of KV\n",
                   B, T, b.max_ctx, splits, paths[path], us, direct, kv_bytes / (us * 1e-6) / 1e9);
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
