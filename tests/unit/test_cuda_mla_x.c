/*
 * test_cuda_mla_x.c: the expanded (non-absorbed) MLA prefill attention (cuda_mla.h: x_weights,
 * gather, x_pack, attend_x) against a CPU reference written here in double precision, and,
 * at Kimi Linear's shape, against the absorbed path the engine otherwise runs.
 *
 * reference: one item with positions 0 .. pos0 - 1 already cached (random bf16 rows in a pool
 * whose page ids are shuffled) and n_tok new rows at pos0 ..; random bf16 W_UK / W_UV. The GPU
 * runs what the engine runs: wkv from wuk_t and wuv (checked bit for bit), the cache rows
 * gathered in slices of 128 positions (checked bit for bit against the pool), the expansion
 * GEMM through cuBLASLt (bf16 weights, fp32 accumulation), x_pack, attend_x. The reference
 * forms K = W_UK c and V = W_UV c in double from the same bf16 values, then causal softmax
 * attention with scores (q_nope · K + q_r · k_r) · scale.
 * Error measure: err = |o_gpu − o_ref| / S_j with S_j = Σ_s p_s A_s,j, A_s,j = Σ_k |W_UV[j,k]
 * c_s,k| (p the reference softmax): o is a p-weighted mean of V, and each V is an fp32 GEMM sum
 * whose rounding scales with Σ|w c|, not with |V|, which can cancel to ~0 (test_cuda_mla's measure,
 * Σ p |c|, is this one for values read exactly from the cache). Sources of error: the GEMM's
 * fp32 sums of 512 exact products (~2^-24 · √512 of A), the hi + lo splits of K, V, q and P
 * (2^-16 relative at worst, of |V| <~ A / 10 here), fp32 softmax and sums over <= 1045
 * positions: ~1e-6 expected, tol 2e-5. A lost lo half of V costs 2^-9 |V| (~2e-4 of A), one of
 * K or q 2^-9 of each score (~1e-2 of a weight): both far over it.
 * The one-term products (prec BF16: bf16 q · scale · log2 e, k_hi, k_r, v_hi and P, one product
 * each) against a second double reference that takes the same bf16 operands (q rounded as the
 * kernel rounds it, K and V as the expanded rows the GPU holds, read back): what is left is P's
 * rounding to bf16 before P · V (the sum l adds the unrounded weights): bf16 keeps 8 significant
 * bits, so round to nearest moves a weight by at most 2^-8 of itself and o by at most 2^-8 of
 * S'_j = Σ_s p_s |v_hi s,j| / Σ_s p_s; plus fp32 sums and ex2.approx (~1e-6): tol 2^-8 + 2e-5.
 * A wrong head, row or position, or a dropped product, costs O(1).
 *
 * timing: the engine's two ways at Kimi Linear's shape (32 heads, r = 512, dr = 64, BF16
 * weights and cache) for chunks of 256 and 1024 rows ending at 8K, a whole 8K prompt and a
 * 256-row prompt: absorbed (q̂ GEMM, attend, W_UV GEMM) against expanded (gather + GEMM +
 * x_pack over every position, then attend_x), each timed with events (best of 3) and printed;
 * the outputs of the two are compared on every row: they differ by the absorbed path's bf16
 * rounding of q_nope and of the latent output before its GEMMs (2^-9 relative), so the bound is
 * 2e-2 of the largest |o|: it catches a wrong head, row or position, not rounding. The one-term
 * products are timed too (the engine's choice under BF16 compute) and held to the same bound.
 *
 * Both expanded-attention kernels: the mma.sync one everywhere, the wgmma one where the device
 * runs it (sm_90a), each against the reference (same tolerance) and timed side by side; at 8K
 * the two must agree within 2e-5 of the largest |o| (the same products summed in another
 * order: ~1e-6 expected; a lost lo half costs ~2^-9), in either precision.
 *
 * Without a CUDA device the GPU tests skip with a reason; the argument checks run anyway.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <criterion/criterion.h>
#include <cuda_runtime_api.h>

#include "kernels/cuda/cuda_gemm.h"
#include "kernels/cuda/cuda_mla.h"
#include "kernels/kernels.h"

#define DUET_TEST_RNG_SEED 0x2545f4914f6cdd1dull
#include "cuda_test_util.h"
#include "mla_test_batch.h"

/* mla.cu's test hooks: which expanded-attention kernel runs (0 chooses, 1 mma.sync, 2 wgmma),
 * and whether the device runs the wgmma one */
void duet__cuda_mla_x_kernel(int which);
int duet__cuda_mla_x_wgmma_usable(void);

#define R_LAT 512 /* kv_lora_rank */
#define DR    64  /* qk_rope_head_dim */
#define TD    (R_LAT + DR)
#define DN    128 /* qk_nope_head_dim = v_head_dim */
#define DQK   (DN + DR)
#define XTD   576 /* an expanded row */
#define TOL   2e-5
#define TOL1  (1.0 / 256 + 2e-5) /* one-term products */
#define SLICE 128                /* positions per gather / GEMM / pack */

/* A random value exact in bf16, and its bits. */
static float rng_bf16(float scale, uint16_t *bits)
{
    *bits = duet_f32_to_bf16(scale * rng_f());
    return duet_bf16_to_f32(*bits);
}

static void skip_without_device(void)
{
    skip_without_device_for("the MLA kernels are");
}

/* ---- a step of items (mla_test_batch.h) ------------------------------------------------- */

/* Item i's context (positions 0 .. its last row's). */
static int item_ctx(const batch_t *b, int i)
{
    return b->item_pos0[i] + b->item_row0[i + 1] - b->item_row0[i];
}

/* Where item i's expanded rows start: after the earlier items' contexts (i = n_items: all). */
static int item_x0(const batch_t *b, int i)
{
    int x = 0;
    for (int j = 0; j < i; j++)
        x += item_ctx(b, j);
    return x;
}

/* Element index of (item, position)'s row in a pool of one MLA layer, pages of pt rows. */
static size_t pool_row(const batch_t *b, int item, int pos, int pt)
{
    return ((size_t)b->item_pages[item * b->max_pages + pos / pt] * pt + pos % pt) * TD;
}

/* The weights: W_UK [n][DN][R_LAT] and W_UV [n][DN][R_LAT] as floats exact in bf16, their
 * device forms wuk_t [n][R_LAT][DN] and wuv (bf16), and wkv from x_weights. */
typedef struct {
    float *uk, *uv;
    void *d_wuk_t, *d_wuv, *d_wkv;
    duet_tensor_t wkv, wuk_t, wuv;
} weights_t;

static void weights_build(weights_t *w, int n, float scale)
{
    const size_t per = (size_t)n * DN * R_LAT;
    w->uk = xmalloc(sizeof(float) * per);
    w->uv = xmalloc(sizeof(float) * per);
    uint16_t *uk_t = xmalloc(2 * per), *uv = xmalloc(2 * per), bits;
    for (int h = 0; h < n; h++)
        for (int d = 0; d < DN; d++)
            for (int c = 0; c < R_LAT; c++) {
                const size_t i = ((size_t)h * DN + d) * R_LAT + c;
                w->uk[i] = rng_bf16(scale, &bits);
                uk_t[((size_t)h * R_LAT + c) * DN + d] = bits;
                w->uv[i] = rng_bf16(scale, &uv[i]);
            }
    w->d_wuk_t = dev_copy(uk_t, 2 * per);
    w->d_wuv = dev_copy(uv, 2 * per);
    w->d_wkv = dev_alloc(4 * per);
    DUET_OK_OR_FAIL(
        duet_cuda_mla_x_weights(0, DUET_DTYPE_BF16, w->d_wuk_t, w->d_wuv, n, R_LAT, w->d_wkv));
    /* wkv: W_UK's rows of every head, then W_UV's, bit for bit */
    uint16_t *got = xmalloc(4 * per);
    CUDA_OK(cudaMemcpy(got, w->d_wkv, 4 * per, cudaMemcpyDeviceToHost));
    int64_t diff = 0;
    for (size_t i = 0; i < per; i++) {
        diff += got[i] != duet_f32_to_bf16(w->uk[i]);
        diff += got[per + i] != uv[i];
    }
    CHECK(diff == 0, "x_weights: %lld of %zu values differ", (long long)diff, 2 * per);
    free(got);
    free(uk_t);
    free(uv);
    w->wkv = (duet_tensor_t){.data = w->d_wkv,
                             .dtype = DUET_DTYPE_BF16,
                             .device = DUET_DEVICE_CUDA,
                             .ndim = 2,
                             .shape = {2 * n * DN, R_LAT}};
    w->wuk_t = (duet_tensor_t){.data = w->d_wuk_t,
                               .dtype = DUET_DTYPE_BF16,
                               .device = DUET_DEVICE_CUDA,
                               .ndim = 3,
                               .shape = {n, R_LAT, DN}};
    w->wuv = (duet_tensor_t){.data = w->d_wuv,
                             .dtype = DUET_DTYPE_BF16,
                             .device = DUET_DEVICE_CUDA,
                             .ndim = 3,
                             .shape = {n, DN, R_LAT}};
}

static void weights_free(weights_t *w)
{
    cudaFree(w->d_wuk_t);
    cudaFree(w->d_wuv);
    cudaFree(w->d_wkv);
    free(w->uk);
    free(w->uv);
}

/* The expansion of every item's positions into xkv (item i's from row x0[i]), as the engine
 * runs it (gath: [SLICE][TD] fp32, kvb: [SLICE][2 n DN] fp32). */
static duet_status_t expand(cudaStream_t s, duet_cuda_gemm_t *g, const batch_t *b, int n,
                            const duet_cuda_mla_layer_t *ly, const weights_t *w, float *gath,
                            float *kvb, void *xkv, int64_t xstride)
{
    const int64_t ldkv = 2 * (int64_t)n * DN;
    for (int i = 0; i < b->n_items; i++)
        for (int64_t p0 = 0, L = item_ctx(b, i); p0 < L; p0 += SLICE) {
            const int64_t np = L - p0 < SLICE ? L - p0 : SLICE;
            duet_status_t st = duet_cuda_mla_gather(s, &b->st, ly, i, p0, np, gath);
            if (st == DUET_OK)
                st = duet_cuda_gemm_matmul(g, s, kvb, ldkv, gath, TD, np, &w->wkv, 0, 0);
            if (st == DUET_OK)
                st = duet_cuda_mla_x_pack(s, ly, kvb, ldkv, gath, item_x0(b, i) + p0, np, xkv,
                                          xstride);
            if (st != DUET_OK)
                return st;
        }
    return DUET_OK;
}

static duet_cuda_mla_layer_t layer_of(void *pool, int n, int pt)
{
    return (duet_cuda_mla_layer_t){.kv_base = pool,
                                   .kv_dtype = DUET_DTYPE_BF16,
                                   .kv_n_layers = 1,
                                   .page_tokens = pt,
                                   .layer = 0,
                                   .n_heads = n,
                                   .r = R_LAT,
                                   .dr = DR};
}

static void run_reference_case(int n, const item_spec_t *sp, int n_items, int pt)
{
    batch_t b;
    batch_build(&b, sp, n_items, pt);
    int max_tok = 0;
    for (int i = 0; i < n_items; i++)
        max_tok = sp[i].n_tok > max_tok ? sp[i].n_tok : max_tok;
    batch_upload(&b, max_tok);
    const int R = b.n_rows, total = item_x0(&b, n_items);
    const float scale = 1.0f / sqrtf((float)DQK);

    /* the pool: random bf16 rows on every page (the items' and two spare ones) */
    const size_t pool_elems = (size_t)b.n_pages * pt * TD;
    uint16_t *pool = xmalloc(2 * pool_elems);
    for (size_t i = 0; i < pool_elems; i++)
        pool[i] = duet_f32_to_bf16(1.5f * rng_f());
    void *d_pool = dev_copy(pool, 2 * pool_elems);
    weights_t w;
    weights_build(&w, n, 0.06f);
    float *q = xmalloc(sizeof(float) * (size_t)R * n * DQK);
    for (size_t i = 0; i < (size_t)R * n * DQK; i++)
        q[i] = 2.0f * rng_f();
    float *d_q = dev_copy(q, sizeof(float) * (size_t)R * n * DQK);

    const duet_cuda_mla_layer_t ly = layer_of(d_pool, n, pt);
    CHECK(duet_cuda_mla_x_shape(&ly, DN, DN), "Kimi's shape is the expanded one");
    duet_cuda_gemm_t *g = NULL;
    DUET_OK_OR_FAIL(duet_cuda_gemm_create(0, (int64_t)SLICE * TD, &g));
    const int64_t xstride = total + 5; /* wider than the items: a head's rows are xstride apart */
    void *d_x = dev_alloc(duet_cuda_mla_x_bytes(xstride, n));
    float *d_gath = dev_alloc(sizeof(float) * SLICE * TD);
    float *d_kvb = dev_alloc(sizeof(float) * SLICE * 2 * n * DN);
    float *d_o = dev_alloc(sizeof(float) * (size_t)R * n * DN);
    CUDA_OK(cudaMemset(d_o, 0xff, sizeof(float) * (size_t)R * n * DN)); /* NaN */

    /* gather alone, bit for bit: the last item's last slice */
    const int il = n_items - 1, L = item_ctx(&b, il);
    const int64_t g0 = L > SLICE ? L - SLICE : 0, gn = L - g0;
    DUET_OK_OR_FAIL(duet_cuda_mla_gather(0, &b.st, &ly, il, g0, gn, d_gath));
    float *gath = xmalloc(sizeof(float) * SLICE * TD);
    CUDA_OK(cudaMemcpy(gath, d_gath, sizeof(float) * (size_t)gn * TD, cudaMemcpyDeviceToHost));
    int64_t gdiff = 0;
    for (int64_t p = g0; p < L; p++)
        for (int j = 0; j < TD; j++)
            gdiff +=
                gath[(p - g0) * TD + j] != duet_bf16_to_f32(pool[pool_row(&b, il, (int)p, pt) + j]);
    CHECK(gdiff == 0, "gather: %lld values differ from the pool", (long long)gdiff);

    DUET_OK_OR_FAIL(expand(0, g, &b, n, &ly, &w, d_gath, d_kvb, d_x, xstride));
    /* each kernel the device runs, in each precision: o[p][0] mma.sync, o[p][1] wgmma (sm_90a);
     * p = 0 the split products (F32), 1 the one-term ones (BF16) */
    const int n_kern = duet__cuda_mla_x_wgmma_usable() ? 2 : 1;
    const duet_dtype_t precs[2] = {DUET_DTYPE_F32, DUET_DTYPE_BF16};
    float *o[2][2] = {{NULL, NULL}, {NULL, NULL}};
    for (int pi = 0; pi < 2; pi++)
        for (int k = 0; k < n_kern; k++) {
            CUDA_OK(cudaMemset(d_o, 0xff, sizeof(float) * (size_t)R * n * DN)); /* NaN */
            duet__cuda_mla_x_kernel(k + 1);
            const duet_status_t st = duet_cuda_mla_attend_x(
                0, &b.st, &ly, d_x, xstride, d_q, (int64_t)n * DQK, DQK, scale, precs[pi], d_o);
            duet__cuda_mla_x_kernel(0);
            DUET_OK_OR_FAIL(st);
            CUDA_OK(cudaDeviceSynchronize());
            o[pi][k] = xmalloc(sizeof(float) * (size_t)R * n * DN);
            CUDA_OK(cudaMemcpy(o[pi][k], d_o, sizeof(float) * (size_t)R * n * DN,
                               cudaMemcpyDeviceToHost));
        }
    /* the expanded rows as the GPU holds them: the one-term reference's K and V */
    const size_t xelems = (size_t)xstride * n * XTD;
    uint16_t *xrows = xmalloc(2 * xelems);
    CUDA_OK(cudaMemcpy(xrows, d_x, 2 * xelems, cudaMemcpyDeviceToHost));

    /* reference: K, V of every (item, position, head) in double, item i's from row x0[i] */
    const size_t T = (size_t)total;
    double *K = xmalloc(sizeof(double) * T * n * DN), *V = xmalloc(sizeof(double) * T * n * DN);
    double *kr = xmalloc(sizeof(double) * T * DR);
    double *A = xmalloc(sizeof(double) * T * n * DN); /* Σ_k |W_UV c| per V */
    for (int it = 0; it < n_items; it++)
        for (int p = 0; p < item_ctx(&b, it); p++) {
            const uint16_t *row = pool + pool_row(&b, it, p, pt);
            const size_t x = (size_t)item_x0(&b, it) + (size_t)p;
            double c[R_LAT];
            for (int j = 0; j < R_LAT; j++)
                c[j] = duet_bf16_to_f32(row[j]);
            for (int j = 0; j < DR; j++)
                kr[x * DR + j] = duet_bf16_to_f32(row[R_LAT + j]);
            for (int h = 0; h < n; h++)
                for (int d = 0; d < DN; d++) {
                    const float *uk = w.uk + ((size_t)h * DN + d) * R_LAT;
                    const float *uv = w.uv + ((size_t)h * DN + d) * R_LAT;
                    double sk = 0.0, sv = 0.0, sa = 0.0;
                    for (int j = 0; j < R_LAT; j++) {
                        sk += (double)uk[j] * c[j];
                        sv += (double)uv[j] * c[j];
                        sa += fabs((double)uv[j] * c[j]);
                    }
                    K[(x * n + h) * DN + d] = sk;
                    V[(x * n + h) * DN + d] = sv;
                    A[(x * n + h) * DN + d] = sa;
                }
        }
    double *sc = xmalloc(sizeof(double) * T), *sc1 = xmalloc(sizeof(double) * T);
    double err[2][2] = {{0.0, 0.0}, {0.0, 0.0}};
    int64_t bad[2][2] = {{0, 0}, {0, 0}};
    const float qscale = scale * 1.4426950408889634f; /* as attend_x scales q (2^x units) */
    for (int t = 0; t < R; t++) {
        const int it = b.row_item[t], pos = b.row_pos[t];
        const size_t x0 = (size_t)item_x0(&b, it);
        for (int h = 0; h < n; h++) {
            const float *qh = q + ((size_t)t * n + h) * DQK;
            double q1[DQK]; /* the one-term q: bf16 of q · qscale */
            for (int d = 0; d < DQK; d++)
                q1[d] = duet_bf16_to_f32(duet_f32_to_bf16(qh[d] * qscale));
            double mx = -INFINITY, mx1 = -INFINITY;
            for (int p = 0; p <= pos; p++) {
                const uint16_t *xr = xrows + ((size_t)h * xstride + x0 + p) * XTD;
                double acc = 0.0, acc1 = 0.0;
                for (int d = 0; d < DN; d++) {
                    acc += (double)qh[d] * K[((x0 + p) * n + h) * DN + d];
                    acc1 += q1[d] * duet_bf16_to_f32(xr[2 * DN + d]); /* k_hi */
                }
                for (int d = 0; d < DR; d++) {
                    acc += (double)qh[DN + d] * kr[(x0 + p) * DR + d];
                    acc1 += q1[DN + d] * duet_bf16_to_f32(xr[3 * DN + d]); /* k_r */
                }
                sc[p] = acc * (double)scale;
                sc1[p] = acc1; /* log2 units */
                mx = sc[p] > mx ? sc[p] : mx;
                mx1 = sc1[p] > mx1 ? sc1[p] : mx1;
            }
            double sum = 0.0, sum1 = 0.0;
            for (int p = 0; p <= pos; p++) {
                sum += (sc[p] = exp(sc[p] - mx));
                sum1 += (sc1[p] = exp2(sc1[p] - mx1));
            }
            for (int d = 0; d < DN; d++) {
                double ref = 0.0, S = 0.0, ref1 = 0.0, S1 = 0.0;
                for (int p = 0; p <= pos; p++) {
                    const size_t e = ((x0 + p) * n + h) * DN + d;
                    const double v1 = duet_bf16_to_f32(
                        xrows[((size_t)h * xstride + x0 + p) * XTD + d]); /* v_hi */
                    ref += sc[p] / sum * V[e];
                    S += sc[p] / sum * A[e];
                    ref1 += sc1[p] / sum1 * v1;
                    S1 += sc1[p] / sum1 * fabs(v1);
                }
                const double rf[2] = {ref, ref1}, sf[2] = {S, S1}, tol[2] = {TOL, TOL1};
                for (int pi = 0; pi < 2; pi++)
                    for (int k = 0; k < n_kern; k++) {
                        const double e =
                            fabs((double)o[pi][k][((size_t)t * n + h) * DN + d] - rf[pi]) / sf[pi];
                        if (!(e <= tol[pi]))
                            bad[pi][k]++;
                        if (!(e <= err[pi][k]))
                            err[pi][k] = e;
                    }
            }
        }
    }
    printf("[cuda_mla_x] n %d, %d item(s) (", n, n_items);
    for (int it = 0; it < n_items; it++)
        printf("%s%d + %d", it ? ", " : "", sp[it].pos0, sp[it].n_tok);
    printf(" rows), pages of %d: max err split %.3g mma.sync", pt, err[0][0]);
    if (n_kern > 1)
        printf(", %.3g wgmma", err[0][1]);
    printf(" (tol %.3g); one-term %.3g mma.sync", TOL, err[1][0]);
    if (n_kern > 1)
        printf(", %.3g wgmma", err[1][1]);
    printf(" (tol %.3g)\n", TOL1);
    for (int pi = 0; pi < 2; pi++)
        for (int k = 0; k < n_kern; k++)
            CHECK(bad[pi][k] == 0, "%s %s, n %d, %d items: %lld outputs over tolerance, worst %g",
                  pi ? "one-term" : "split", k ? "wgmma" : "mma.sync", n, n_items,
                  (long long)bad[pi][k], err[pi][k]);

    for (int pi = 0; pi < 2; pi++) {
        free(o[pi][0]);
        free(o[pi][1]);
    }
    free(xrows);
    free(sc1);
    free(sc);
    free(A);
    free(kr);
    free(V);
    free(K);
    free(gath);
    cudaFree(d_o);
    cudaFree(d_kvb);
    cudaFree(d_gath);
    cudaFree(d_x);
    duet_cuda_gemm_destroy(g);
    cudaFree(d_q);
    free(q);
    weights_free(&w);
    cudaFree(d_pool);
    free(pool);
    batch_free(&b);
}

/* ---- tests without a device ---------------------------------------------------------------------
 */

Test(cuda_mla_x, shape_and_bad_arguments, .timeout = 30)
{
    int pages[1] = {0};
    duet_cuda_step_t st = {.n_items = 2, .n_rows = 4, .max_pages = 1, .item_pages = pages};
    duet_cuda_mla_layer_t ly = layer_of(pages, 4, 16);
    CHECK(duet_cuda_mla_x_shape(&ly, DN, DN));
    CHECK(!duet_cuda_mla_x_shape(&ly, 64, DN), "dn 64 is not the expanded shape");
    CHECK(!duet_cuda_mla_x_shape(&ly, DN, 64), "dv 64 is not the expanded shape");
    CHECK(!duet_cuda_mla_x_shape(NULL, DN, DN));
    duet_cuda_mla_layer_t f32 = ly;
    f32.kv_dtype = DUET_DTYPE_F32;
    CHECK(!duet_cuda_mla_x_shape(&f32, DN, DN), "an F32 cache is not the expanded shape");
    duet_cuda_mla_layer_t dr32 = ly;
    dr32.dr = 32;
    CHECK(!duet_cuda_mla_x_shape(&dr32, DN, DN), "dr 32 is not the expanded shape");
    CHECK(duet_cuda_mla_x_bytes(10, 4) == (size_t)10 * 4 * XTD * 2);
    CHECK(duet_cuda_mla_x_bytes(0, 4) == 0 && duet_cuda_mla_x_bytes(10, 0) == 0);

    _Alignas(16) float f[4]; /* aligned as every pointer argument must be */
    const duet_dtype_t F32 = DUET_DTYPE_F32;
    CHECK(duet_cuda_mla_attend_x(0, &st, &ly, NULL, 16, f, 4, 4, 1.0f, F32, f) == DUET_ERR_INVALID);
    /* q rows not 8-byte aligned */
    CHECK(duet_cuda_mla_attend_x(0, &st, &ly, f, 16, f, 3, 4, 1.0f, F32, f) == DUET_ERR_INVALID);
    /* products in a precision it has no kernel for */
    CHECK(duet_cuda_mla_attend_x(0, &st, &ly, f, 16, f, 4, 4, 1.0f, DUET_DTYPE_F16, f) ==
          DUET_ERR_UNSUPPORTED);
    /* gather: an item past the step's */
    CHECK(duet_cuda_mla_gather(0, &st, &ly, 2, 0, 4, f) == DUET_ERR_INVALID);
    CHECK(duet_cuda_mla_gather(0, &st, &ly, -1, 0, 4, f) == DUET_ERR_INVALID);
    CHECK(duet_cuda_mla_attend_x(0, &st, &ly, f, 0, f, 4, 4, 1.0f, F32, f) == DUET_ERR_INVALID);
    CHECK(duet_cuda_mla_attend_x(0, &st, &dr32, f, 16, f, 4, 4, 1.0f, F32, f) ==
          DUET_ERR_UNSUPPORTED);
    /* gather past the item's pages (1 page of 16 positions) */
    CHECK(duet_cuda_mla_gather(0, &st, &ly, 0, 10, 7, f) == DUET_ERR_INVALID);
    CHECK(duet_cuda_mla_gather(0, &st, &ly, 0, -1, 2, f) == DUET_ERR_INVALID);
    CHECK(duet_cuda_mla_gather(0, &st, &ly, 0, 0, 4, NULL) == DUET_ERR_INVALID);
    /* pack past xstride, short rows, the wrong shape */
    CHECK(duet_cuda_mla_x_pack(0, &ly, f, 2 * 4 * DN, f, 10, 7, f, 16) == DUET_ERR_INVALID);
    CHECK(duet_cuda_mla_x_pack(0, &ly, f, 4 * DN, f, 0, 7, f, 16) == DUET_ERR_INVALID);
    CHECK(duet_cuda_mla_x_pack(0, &dr32, f, 2 * 4 * DN, f, 0, 7, f, 16) == DUET_ERR_UNSUPPORTED);
    CHECK(duet_cuda_mla_x_weights(0, DUET_DTYPE_BF16, NULL, f, 4, R_LAT, f) == DUET_ERR_INVALID);
    CHECK(duet_cuda_mla_x_weights(0, DUET_DTYPE_BF16, f, f, 4, 0, f) == DUET_ERR_INVALID);
    CHECK(duet_cuda_mla_x_weights(0, DUET_DTYPE_F16, f, f, 4, R_LAT, f) == DUET_ERR_UNSUPPORTED);
}

/* ---- against the double reference ----------------------------------------------------------- */

Test(cuda_mla_x, against_reference, .timeout = 300)
{
    skip_without_device();
    /* (cached, new) per item: a fresh prompt with a partial row block; a chunk after a cached
     * prefix, mid-page, several row blocks; a short tail over a long prefix (one row block,
     * many tiles); an odd page size; then steps of several items (the rows of each item
     * follow the previous ones' in xkv), one of them a decode row beside prefill chunks */
    const item_spec_t a[1] = {{0, 70}}, b[1] = {{100, 300}}, c[1] = {{1000, 45}}, d[1] = {{37, 64}};
    const item_spec_t m1[3] = {{0, 130}, {200, 64}, {5, 1}}, m2[2] = {{700, 70}, {0, 300}};
    run_reference_case(3, a, 1, 16);
    run_reference_case(4, b, 1, 16);
    run_reference_case(2, c, 1, 16);
    run_reference_case(5, d, 1, 12);
    run_reference_case(3, m1, 3, 16);
    run_reference_case(2, m2, 2, 12);
}

/* ---- timing at Kimi Linear's shape: absorbed against expanded ------------------------------ */

static double elapsed_us(cudaEvent_t a, cudaEvent_t b)
{
    float ms = 0.0f;
    CUDA_OK(cudaEventSynchronize(b));
    CUDA_OK(cudaEventElapsedTime(&ms, a, b));
    return 1e3 * ms;
}

Test(cuda_mla_x, timing_8k, .timeout = 300)
{
    skip_without_device();
    const int n = 32, pt = 64, reps = 3;
    const float scale = 1.0f / sqrtf((float)DQK);
    /* (cached, new): chunks of 256 and 1024 rows ending at 8K, a whole 8K prompt, 256 rows */
    const int cases[4][2] = {{8192 - 256, 256}, {8192 - 1024, 1024}, {0, 8192}, {0, 256}};
    weights_t w;
    weights_build(&w, n, 0.06f);
    duet_cuda_gemm_t *g = NULL;
    DUET_OK_OR_FAIL(duet_cuda_gemm_create(0, (int64_t)8192 * n * R_LAT, &g));
    const int max_l = 8192, max_r = 8192;
    /* every page a batch of max_l positions may draw (batch_build: 3 spare ones) */
    const size_t pool_elems = (size_t)(max_l / pt + 3) * pt * TD;
    uint16_t *pool = xmalloc(2 * pool_elems);
    for (size_t i = 0; i < pool_elems; i++)
        pool[i] = duet_f32_to_bf16(1.5f * rng_f());
    void *d_pool = dev_copy(pool, 2 * pool_elems);
    float *q = xmalloc(sizeof(float) * (size_t)max_r * n * DQK);
    for (size_t i = 0; i < (size_t)max_r * n * DQK; i++)
        q[i] = 2.0f * rng_f();
    float *d_q = dev_copy(q, sizeof(float) * (size_t)max_r * n * DQK);
    float *d_qhat = dev_alloc(sizeof(float) * (size_t)max_r * n * R_LAT);
    float *d_lat = dev_alloc(sizeof(float) * (size_t)max_r * n * R_LAT);
    float *d_oa = dev_alloc(sizeof(float) * (size_t)max_r * n * DN);
    /* [precision: split, one-term][kernel: mma.sync, wgmma] */
    const duet_dtype_t precs[2] = {DUET_DTYPE_F32, DUET_DTYPE_BF16};
    float *d_ox[2][2], *ox[2][2];
    for (int pi = 0; pi < 2; pi++)
        for (int k = 0; k < 2; k++) {
            d_ox[pi][k] = dev_alloc(sizeof(float) * (size_t)max_r * n * DN);
            ox[pi][k] = xmalloc(sizeof(float) * (size_t)max_r * n * DN);
        }
    void *d_x = dev_alloc(duet_cuda_mla_x_bytes(max_l, n));
    float *d_gath = dev_alloc(sizeof(float) * 1024 * TD);
    float *d_kvb = dev_alloc(sizeof(float) * 1024 * 2 * n * DN);
    float *oa = xmalloc(sizeof(float) * (size_t)max_r * n * DN);
    const duet_cuda_mla_layer_t ly = layer_of(d_pool, n, pt);
    cudaEvent_t e0, e1, e2;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    CUDA_OK(cudaEventCreate(&e2));

    for (int ci = 0; ci < 4; ci++) {
        batch_t it;
        const item_spec_t sp = {cases[ci][0], cases[ci][1]};
        batch_build(&it, &sp, 1, pt);
        batch_upload(&it, sp.n_tok);
        const int R = it.n_rows, L = item_ctx(&it, 0);
        const int n_kern = duet__cuda_mla_x_wgmma_usable() ? 2 : 1;
        /* the step's split-KV plan, once per step as the engine makes it (a prefill: unsplit) */
        const size_t scr_bytes = duet_cuda_mla_scratch_bytes(&ly, 1, R, it.st.max_split_rows);
        void *d_scr = dev_alloc(scr_bytes);
        DUET_OK_OR_FAIL(duet_cuda_mla_plan(0, &it.st, &ly, d_scr, scr_bytes));
        double best_a = 1e30, best_e = 1e30, best_k[2][2] = {{1e30, 1e30}, {1e30, 1e30}};
        for (int rep = 0; rep < reps; rep++) {
            /* absorbed, as the engine's MLA layer runs it */
            CUDA_OK(cudaEventRecord(e0, 0));
            DUET_OK_OR_FAIL(duet_cuda_gemm_matmul_batched(g, 0, d_qhat, (int64_t)n * R_LAT, R_LAT,
                                                          d_q, (int64_t)n * DQK, DQK, R, &w.wuk_t,
                                                          0, 0));
            DUET_OK_OR_FAIL(duet_cuda_mla_attend(0, &it.st, &ly, d_qhat, d_q + DN, (int64_t)n * DQK,
                                                 DQK, scale, d_lat, d_scr, scr_bytes));
            DUET_OK_OR_FAIL(duet_cuda_gemm_matmul_batched(g, 0, d_oa, (int64_t)n * DN, DN, d_lat,
                                                          (int64_t)n * R_LAT, R_LAT, R, &w.wuv, 0,
                                                          0));
            CUDA_OK(cudaEventRecord(e1, 0));
            const double ta = elapsed_us(e0, e1);
            /* expanded: every position, then the attention with each kernel */
            CUDA_OK(cudaEventRecord(e0, 0));
            const int64_t ldkv = 2 * (int64_t)n * DN;
            for (int64_t p0 = 0; p0 < L; p0 += 1024) {
                const int64_t np = L - p0 < 1024 ? L - p0 : 1024;
                DUET_OK_OR_FAIL(duet_cuda_mla_gather(0, &it.st, &ly, 0, p0, np, d_gath));
                DUET_OK_OR_FAIL(
                    duet_cuda_gemm_matmul(g, 0, d_kvb, ldkv, d_gath, TD, np, &w.wkv, 0, 0));
                DUET_OK_OR_FAIL(
                    duet_cuda_mla_x_pack(0, &ly, d_kvb, ldkv, d_gath, p0, np, d_x, max_l));
            }
            CUDA_OK(cudaEventRecord(e1, 0));
            const double te = elapsed_us(e0, e1);
            best_a = ta < best_a ? ta : best_a;
            best_e = te < best_e ? te : best_e;
            for (int pi = 0; pi < 2; pi++)
                for (int k = 0; k < n_kern; k++) {
                    duet__cuda_mla_x_kernel(k + 1);
                    CUDA_OK(cudaEventRecord(e1, 0));
                    const duet_status_t st =
                        duet_cuda_mla_attend_x(0, &it.st, &ly, d_x, max_l, d_q, (int64_t)n * DQK,
                                               DQK, scale, precs[pi], d_ox[pi][k]);
                    CUDA_OK(cudaEventRecord(e2, 0));
                    duet__cuda_mla_x_kernel(0);
                    DUET_OK_OR_FAIL(st);
                    const double tk = elapsed_us(e1, e2);
                    best_k[pi][k] = tk < best_k[pi][k] ? tk : best_k[pi][k];
                }
        }
        CUDA_OK(cudaMemcpy(oa, d_oa, sizeof(float) * (size_t)R * n * DN, cudaMemcpyDeviceToHost));
        double mx = 0.0, diff[2][2] = {{0.0, 0.0}, {0.0, 0.0}};
        for (size_t i = 0; i < (size_t)R * n * DN; i++)
            mx = fabs(oa[i]) > mx ? fabs(oa[i]) : mx;
        for (int pi = 0; pi < 2; pi++)
            for (int k = 0; k < n_kern; k++) {
                CUDA_OK(cudaMemcpy(ox[pi][k], d_ox[pi][k], sizeof(float) * (size_t)R * n * DN,
                                   cudaMemcpyDeviceToHost));
                for (size_t i = 0; i < (size_t)R * n * DN; i++) {
                    const double d = fabs((double)ox[pi][k][i] - (double)oa[i]);
                    diff[pi][k] = d <= diff[pi][k] ? diff[pi][k] : d; /* NaN propagates */
                }
            }
        /* the two kernels: the same products in another order, so within fp32 sums */
        double kdiff[2] = {0.0, 0.0};
        if (n_kern > 1)
            for (int pi = 0; pi < 2; pi++)
                for (size_t i = 0; i < (size_t)R * n * DN; i++) {
                    const double d = fabs((double)ox[pi][1][i] - (double)ox[pi][0][i]);
                    kdiff[pi] = d <= kdiff[pi] ? kdiff[pi] : d;
                }
        const int kl = n_kern - 1; /* the kernel the engine runs here */
        const double best_x = best_e + best_k[0][kl];
        printf("[cuda_mla_x] timing n32 r512 dr64 bf16, %4d rows at ctx %4d: absorbed (q̂ GEMM, "
               "attend, W_UV GEMM) %8.1f us, expanded %8.1f us (expansion of %d positions %.1f "
               "us, attention %.1f us): %.2fx; outputs differ by %.3g of max |o| %.3g\n",
               R, L, best_a, best_x, L, best_e, best_k[0][kl], best_a / best_x, diff[0][kl] / mx,
               mx);
        printf("[cuda_mla_x] timing, %4d rows at ctx %4d: one-term attention %8.1f us against "
               "split %.1f: %.2fx; one-term and absorbed differ by %.3g of max |o|\n",
               R, L, best_k[1][kl], best_k[0][kl], best_k[0][kl] / best_k[1][kl], diff[1][kl] / mx);
        if (n_kern > 1)
            for (int pi = 0; pi < 2; pi++)
                printf("[cuda_mla_x] timing, %4d rows at ctx %4d, %s: attention mma.sync %8.1f us, "
                       "wgmma %8.1f us: %.2fx; the two differ by %.3g of max |o|\n",
                       R, L, pi ? "one-term" : "split", best_k[pi][0], best_k[pi][1],
                       best_k[pi][0] / best_k[pi][1], kdiff[pi] / mx);
        for (int pi = 0; pi < 2; pi++) {
            for (int k = 0; k < n_kern; k++)
                CHECK(diff[pi][k] <= 2e-2 * mx,
                      "%s %s, %d rows at %d: expanded and absorbed differ by %g (max %g)",
                      pi ? "one-term" : "split", k ? "wgmma" : "mma.sync", R, L, diff[pi][k], mx);
            CHECK(kdiff[pi] <= 2e-5 * mx,
                  "%s, %d rows at %d: the wgmma and mma.sync kernels differ by %g (max %g)",
                  pi ? "one-term" : "split", R, L, kdiff[pi], mx);
        }
        cudaFree(d_scr);
        batch_free(&it);
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaEventDestroy(e2);
    for (int pi = 0; pi < 2; pi++)
        for (int k = 0; k < 2; k++) {
            free(ox[pi][k]);
            cudaFree(d_ox[pi][k]);
        }
    free(oa);
    cudaFree(d_kvb);
    cudaFree(d_gath);
    cudaFree(d_x);
    cudaFree(d_oa);
    cudaFree(d_lat);
    cudaFree(d_qhat);
    cudaFree(d_q);
    free(q);
    cudaFree(d_pool);
    free(pool);
    duet_cuda_gemm_destroy(g);
    weights_free(&w);
}
