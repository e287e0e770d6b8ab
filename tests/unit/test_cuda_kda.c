/*
 * test_cuda_kda.c: the KDA kernels of kernels/cuda/cuda_kda.h against a CPU reference of the same
 * chain. The reference mirrors kernels/cpu/kda.c (the conv, prep and out tasks) loop for loop and
 * calls its head-level core (recurrent for 1-token items, chunked otherwise),
 * on a host copy of the KDA pool with the same layout.
 *
 * Batches mix 1-token decode items with items of 2..200 tokens that cross chunk boundaries, start
 * from random nonzero states and conv windows, live in scattered slots of a pool with two KDA
 * layers (the test uses layer 1), and run for two steps (the second all-decode) so that the
 * carried state and windows are checked too. A separate test checks that the GPU's chunked and
 * recurrent forms agree (one 150-token item versus 150 one-token steps), one replays the chain
 * as a captured CUDA graph, and one only times the kernels at the real model's shapes.
 *
 * duet_cuda_kda_chain (the four calls in one, a single fused kernel for decode steps, q and k
 * normalised in the conv for prefill at K = 128) is checked the same way against the CPU
 * reference, and against the four separate calls launched without programmatic dependent launch
 * from the same pool (results and every pool element, TOL_FUSED = 0: the fused kernels compute
 * each element with the same expressions),
 * at batch 1, at several items, for every cluster size (K = 16 .. 128), W from 1 to 8, and on
 * prefill / mixed steps and a large decode batch (where it runs the separate kernels), plus a
 * captured graph.
 *
 * Error measure: max |gpu − cpu| over a tensor divided by max |cpu| of that tensor (a rounding
 * error scales with the magnitudes summed, not with an element that may cancel to ~0). Both
 * sides are fp32 and compute the same sums in different orders; the GPU also takes the decays
 * with ex2.approx (~2^-22 relative) from Γ·log2(e), which adds an absolute error of about
 * |Γ|·2^-24 to each exponent, i.e. a relative error of ~1e-6..1e-5 on a decay at Γ of tens.
 * Tolerances:
 *   windows            0      (copies of inputs);
 *   qkv, g, β (prep)   1e-5   (elementwise maps and length-K sums: a few ulps);
 *   o before the norm  1e-4   and S 1e-4: dot products of K <= 128 terms, 64x64 triangular
 *                      solves and up to 200 tokens of state carried, each step a few ulps of
 *                      the magnitudes involved; 1e-4 leaves a 10x margin over the ~1e-5 seen
 *                      from decay rounding, while any indexing or algebra error is O(1);
 *   o after the norm   1e-3   (the per-head RMS norm divides by the head's own magnitude, which
 *                      can be well below the tensor's maximum, and amplifies the error by that
 *                      ratio).
 * The chunked core with one-term tf32 products (DUET_CUDA_KDA_TC_ONE, what BF16 compute runs)
 * rounds each operand of its three state products to 10 mantissa bits (2^-11 relative), so its
 * o before the norm and S are held to 2^-8 = 3.9e-3 instead (TOL_CORE_TF32): bf16's own rounding
 * of an operand, which every product of a bf16 model's KDA takes, and about 16 times the tf32
 * rounding of each product; o after the norm 10 times that (TOL_OUT_TF32), as TOL_OUT is to
 * TOL_CORE.
 * Without a CUDA device (the build VM, CI) every GPU test skips with a reason; the argument
 * checks run everywhere because they fail before touching the device.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <criterion/criterion.h>
#include <cuda_runtime_api.h>

#include "kernels/cpu/cpu_kda.h"
#include "kernels/cuda/cuda_kda.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/kernels.h"

#define DUET_TEST_RNG_SEED 0x9e3779b97f4a7c15ull
#include "cuda_test_util.h"

/* kda.cu's test hooks: nonzero runs the conv one channel per thread; nonzero leaves q and k of the
 * chain's separate kernels to prep instead of the conv */
void duet__cuda_kda_conv_scalar(int on);
void duet__cuda_kda_conv_norm_off(int on);
/* ... nonzero runs the chain as its separate kernels; the verify chain kernels launched so far */
void duet__cuda_kda_fused_off(int on);
long duet__cuda_kda_verify_chains(void);

#define TOL_EXACT     0.0
#define TOL_PREP      1e-5
#define TOL_CORE      1e-4
#define TOL_OUT       1e-3
#define TOL_CORE_TF32 3.90625e-3 /* 2^-8 */
#define TOL_OUT_TF32  3.90625e-2
#define TOL_FUSED     0.0 /* chain vs the four calls: the fused kernels repeat their expressions */

/* ---- helpers ------------------------------------------------------------------------------ */

/* Uniform in [lo, hi). */
static float rng_range(float lo, float hi)
{
    return lo + (hi - lo) * (float)(rng_u32() & 0xffffff) / 16777216.0f;
}

static void fill(float *p, size_t n, float lo, float hi)
{
    for (size_t i = 0; i < n; i++)
        p[i] = rng_range(lo, hi);
}

static void skip_without_device(void)
{
    skip_without_device_for("the KDA kernels are");
}

/* max |a − b| / max |b| (see the file comment); infinity when a holds a NaN or an infinity. */
static double rel_err(const float *a, const float *b, size_t n)
{
    double md = 0.0, mx = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (!isfinite(d))
            return INFINITY;
        md = d > md ? d : md;
        mx = fabs((double)b[i]) > mx ? fabs((double)b[i]) : mx;
    }
    return md / (mx > 0.0 ? mx : 1.0);
}

static void expect_close(const char *what, const char *tensor, const float *gpu, const float *cpu,
                         size_t n, double tol)
{
    double e = rel_err(gpu, cpu, n);
    printf("[cuda_kda] %-28s %-10s max rel err %.3e (tol %.0e)\n", what, tensor, e, tol);
    fflush(stdout);
    CHECK(e <= tol, "%s: %s error %.3e above %.0e", what, tensor, e, tol);
}

static float ref_sigmoid(float x)
{
    return 1.0f / (1.0f + expf(-x));
}

static float ref_silu(float x)
{
    return x / (1.0f + expf(-x));
}

static float ref_softplus(float x)
{
    return x > 20.0f ? x : log1pf(expf(x));
}

/* ---- one problem: weights, a pool, a batch --------------------------------------------------- */

typedef struct {
    const char *name;
    int64_t H, K, W;
    int n_items;
    int n_tok[16];
    float alog_lo, alog_hi; /* A_log range: decays per token −exp(A_log)·softplus(·) */
    int tc;                 /* duet_cuda_kda_layer_t.tc: how the chunked core multiplies */
} kda_shape_t;

typedef struct {
    kda_shape_t sh;
    int64_t HK, C3, layer_floats, n_layers, layer;
    int32_t n_slots, n_rows, max_tok;
    /* host */
    int32_t *row0, *pos0, *slot, *pages, *row_item, *row_pos; /* batch metadata */
    float *pool;                                              /* reference pool, all slots */
    size_t pool_floats;
    float *taps, *neg_A, *dt_bias, *o_norm; /* (3HK, W), (H), (HK), (K) */
    float *proj, *graw, *braw, *gate;       /* (T, 3HK), (T, HK), (T, H), (T, HK) */
    float *qkv, *g, *beta, *o_pre, *o;      /* reference results */
    float eps;
    /* device */
    float *d_pool, *d_taps, *d_neg_A, *d_dt_bias, *d_o_norm;
    float *d_proj, *d_graw, *d_braw, *d_gate, *d_qkv, *d_g, *d_beta, *d_o;
    void *d_scr;     /* the chunked form's scratch, duet_cuda_kda_scratch_bytes of the batch */
    int32_t *d_meta; /* row0 | pos0 | slot | pages | row_item | row_pos */
    duet_cuda_step_t st;
    duet_cuda_kda_layer_t ly;
} kda_case_t;

static float *ref_block(kda_case_t *c, int32_t slot)
{
    return c->pool + ((int64_t)slot * c->n_layers + c->layer) * c->layer_floats;
}

/* The step of n items and T rows whose device metadata is packed as row0 (n + 1) | pos0 | slot |
 * pages (n each) | row_item | row_pos (T each), one page per item. */
static duet_cuda_step_t step_of(const int32_t *d_meta, int n, int64_t T, int max_tok)
{
    return (duet_cuda_step_t){.n_items = n,
                              .n_rows = (int32_t)T,
                              .max_item_tokens = max_tok,
                              .item_row0 = d_meta,
                              .item_pos0 = d_meta + n + 1,
                              .item_slot = d_meta + 2 * n + 1,
                              .item_pages = d_meta + 3 * n + 1,
                              .max_pages = 1,
                              .row_item = d_meta + 4 * n + 1,
                              .row_pos = d_meta + 4 * n + 1 + T};
}

/* Batch metadata and fresh step inputs for the item lengths n_tok (host and device). */
static void case_batch(kda_case_t *c, const int *n_tok)
{
    const kda_shape_t *s = &c->sh;
    int32_t T = 0, mx = 0;
    for (int i = 0; i < s->n_items; i++) {
        c->row0[i] = T;
        T += n_tok[i];
        mx = n_tok[i] > mx ? n_tok[i] : mx;
    }
    c->row0[s->n_items] = T;
    c->n_rows = T;
    c->max_tok = mx;
    for (int i = 0; i < s->n_items; i++)
        for (int32_t r = c->row0[i]; r < c->row0[i + 1]; r++) {
            c->row_item[r] = i;
            c->row_pos[r] = c->pos0[i] + (r - c->row0[i]);
        }

    free(c->proj), free(c->graw), free(c->braw), free(c->gate);
    free(c->qkv), free(c->g), free(c->beta), free(c->o_pre), free(c->o);
    c->proj = xmalloc(sizeof(float) * (size_t)(T * c->C3));
    c->graw = xmalloc(sizeof(float) * (size_t)(T * c->HK));
    c->braw = xmalloc(sizeof(float) * (size_t)(T * s->H));
    c->gate = xmalloc(sizeof(float) * (size_t)(T * c->HK));
    c->qkv = xmalloc(sizeof(float) * (size_t)(T * c->C3));
    c->g = xmalloc(sizeof(float) * (size_t)(T * c->HK));
    c->beta = xmalloc(sizeof(float) * (size_t)(T * s->H));
    c->o_pre = xmalloc(sizeof(float) * (size_t)(T * c->HK));
    c->o = xmalloc(sizeof(float) * (size_t)(T * c->HK));
    fill(c->proj, (size_t)(T * c->C3), -1.0f, 1.0f);
    fill(c->graw, (size_t)(T * c->HK), -4.0f, 2.0f);
    fill(c->braw, (size_t)(T * s->H), -3.0f, 3.0f);
    fill(c->gate, (size_t)(T * c->HK), -3.0f, 3.0f);

    cudaFree(c->d_proj), cudaFree(c->d_graw), cudaFree(c->d_braw), cudaFree(c->d_gate);
    cudaFree(c->d_qkv), cudaFree(c->d_g), cudaFree(c->d_beta), cudaFree(c->d_o);
    c->d_proj = dev_copy(c->proj, sizeof(float) * (size_t)(T * c->C3));
    c->d_graw = dev_copy(c->graw, sizeof(float) * (size_t)(T * c->HK));
    c->d_braw = dev_copy(c->braw, sizeof(float) * (size_t)(T * s->H));
    c->d_gate = dev_copy(c->gate, sizeof(float) * (size_t)(T * c->HK));
    c->d_qkv = dev_alloc(sizeof(float) * (size_t)(T * c->C3));
    c->d_g = dev_alloc(sizeof(float) * (size_t)(T * c->HK));
    c->d_beta = dev_alloc(sizeof(float) * (size_t)(T * s->H));
    c->d_o = dev_alloc(sizeof(float) * (size_t)(T * c->HK));
    cudaFree(c->d_scr);
    c->d_scr = dev_alloc(duet_cuda_kda_scratch_bytes(s->n_items, T, s->H, s->K));

    const int n = s->n_items;
    int32_t *m = xmalloc(sizeof(int32_t) * (size_t)(4 * n + 1 + 2 * T));
    memcpy(m, c->row0, sizeof(int32_t) * (size_t)(n + 1));
    memcpy(m + n + 1, c->pos0, sizeof(int32_t) * (size_t)n);
    memcpy(m + 2 * n + 1, c->slot, sizeof(int32_t) * (size_t)n);
    memcpy(m + 3 * n + 1, c->pages, sizeof(int32_t) * (size_t)n);
    memcpy(m + 4 * n + 1, c->row_item, sizeof(int32_t) * (size_t)T);
    memcpy(m + 4 * n + 1 + T, c->row_pos, sizeof(int32_t) * (size_t)T);
    cudaFree(c->d_meta);
    c->d_meta = dev_copy(m, sizeof(int32_t) * (size_t)(4 * n + 1 + 2 * T));
    free(m);
    c->st = step_of(c->d_meta, n, T, mx);
}

static void case_init(kda_case_t *c, const kda_shape_t *sh)
{
    memset(c, 0, sizeof(*c));
    c->sh = *sh;
    const int64_t H = sh->H, K = sh->K, W = sh->W, n = sh->n_items;
    c->HK = H * K;
    c->C3 = 3 * c->HK;
    c->layer_floats = H * K * K + c->C3 * (W - 1);
    c->n_layers = 2;
    c->layer = 1;
    c->n_slots = (int32_t)n + 2; /* slots 0 and n+1 stay unused: must come back untouched */
    c->eps = 1e-6f;
    c->pool_floats = (size_t)(c->n_slots * c->n_layers * c->layer_floats);
    c->pool = xmalloc(sizeof(float) * c->pool_floats);
    fill(c->pool, c->pool_floats, -1.0f, 1.0f);

    c->row0 = xmalloc(sizeof(int32_t) * (size_t)(n + 1));
    c->pos0 = xmalloc(sizeof(int32_t) * (size_t)n);
    c->slot = xmalloc(sizeof(int32_t) * (size_t)n);
    c->pages = xmalloc(sizeof(int32_t) * (size_t)n);
    int64_t T = 0;
    for (int i = 0; i < n; i++)
        T += sh->n_tok[i];
    c->row_item = xmalloc(sizeof(int32_t) * (size_t)(T + 2 * n)); /* room for a decode step */
    c->row_pos = xmalloc(sizeof(int32_t) * (size_t)(T + 2 * n));
    for (int i = 0; i < n; i++) {
        c->pos0[i] = 3 + 17 * i;
        c->slot[i] = (int32_t)(n - i); /* reversed, 1..n */
        c->pages[i] = 0;
    }

    c->taps = xmalloc(sizeof(float) * (size_t)(c->C3 * W));
    c->neg_A = xmalloc(sizeof(float) * (size_t)H);
    c->dt_bias = xmalloc(sizeof(float) * (size_t)c->HK);
    c->o_norm = xmalloc(sizeof(float) * (size_t)K);
    fill(c->taps, (size_t)(c->C3 * W), -0.6f, 0.6f);
    for (int64_t h = 0; h < H; h++)
        c->neg_A[h] = -expf(rng_range(sh->alog_lo, sh->alog_hi));
    fill(c->dt_bias, (size_t)c->HK, -1.0f, 1.0f);
    fill(c->o_norm, (size_t)K, 0.5f, 1.5f);

    c->d_pool = dev_copy(c->pool, sizeof(float) * c->pool_floats);
    c->d_taps = dev_copy(c->taps, sizeof(float) * (size_t)(c->C3 * W));
    c->d_neg_A = dev_copy(c->neg_A, sizeof(float) * (size_t)H);
    c->d_dt_bias = dev_copy(c->dt_bias, sizeof(float) * (size_t)c->HK);
    c->d_o_norm = dev_copy(c->o_norm, sizeof(float) * (size_t)K);
    c->ly = (duet_cuda_kda_layer_t){.kda_base = c->d_pool,
                                    .kda_n_layers = c->n_layers,
                                    .kda_layer_floats = c->layer_floats,
                                    .layer = c->layer,
                                    .H = H,
                                    .K = K,
                                    .W = W,
                                    .tc = sh->tc};
}

static void case_free(kda_case_t *c)
{
    free(c->row0), free(c->pos0), free(c->slot), free(c->pages), free(c->row_item);
    free(c->row_pos), free(c->pool), free(c->taps), free(c->neg_A), free(c->dt_bias);
    free(c->o_norm), free(c->proj), free(c->graw), free(c->braw), free(c->gate), free(c->qkv);
    free(c->g), free(c->beta), free(c->o_pre), free(c->o);
    cudaFree(c->d_pool), cudaFree(c->d_taps), cudaFree(c->d_neg_A), cudaFree(c->d_dt_bias);
    cudaFree(c->d_o_norm), cudaFree(c->d_proj), cudaFree(c->d_graw), cudaFree(c->d_braw);
    cudaFree(c->d_gate), cudaFree(c->d_qkv), cudaFree(c->d_g), cudaFree(c->d_beta);
    cudaFree(c->d_o), cudaFree(c->d_meta), cudaFree(c->d_scr);
}

/* ---- CPU reference chain (kernels/cpu/kda.c's loops and core) ----------------------------------
 */

static void ref_step(kda_case_t *c)
{
    const int64_t H = c->sh.H, K = c->sh.K, W = c->sh.W, HK = c->HK, C3 = c->C3;
    const int64_t T = c->n_rows;

    /* conv + SiLU, then the window keeps the last W-1 pre-conv inputs */
    for (int it = 0; it < c->sh.n_items; it++) {
        const int64_t r0 = c->row0[it], n = c->row0[it + 1] - r0;
        float *win = ref_block(c, c->slot[it]) + H * K * K; /* [C3][W-1] */
        for (int64_t ch = 0; ch < C3; ch++) {
            float *wc = win + ch * (W - 1);
            for (int64_t t = 0; t < n; t++) {
                float acc = 0.0f;
                for (int64_t j = 0; j < W; j++) {
                    int64_t tau = t - (W - 1) + j;
                    float u = tau >= 0 ? c->proj[(r0 + tau) * C3 + ch] : wc[(W - 1) + tau];
                    acc += c->taps[ch * W + j] * u;
                }
                c->qkv[(r0 + t) * C3 + ch] = ref_silu(acc);
            }
            float old[8];
            for (int64_t j = 0; j < W - 1; j++)
                old[j] = wc[j];
            for (int64_t j = 0; j < W - 1; j++) {
                int64_t i = n + j;
                wc[j] = i < W - 1 ? old[i] : c->proj[(r0 + i - (W - 1)) * C3 + ch];
            }
        }
    }

    /* prep */
    const float scale = 1.0f / sqrtf((float)K);
    memcpy(c->g, c->graw, sizeof(float) * (size_t)(T * HK));
    memcpy(c->beta, c->braw, sizeof(float) * (size_t)(T * H));
    for (int64_t row = 0; row < T; row++) {
        float *g = c->g + row * HK;
        for (int64_t h = 0; h < H; h++)
            for (int64_t d = 0; d < K; d++) {
                int64_t i = h * K + d;
                g[i] = c->neg_A[h] * ref_softplus(g[i] + c->dt_bias[i]);
            }
        for (int64_t h = 0; h < H; h++)
            c->beta[row * H + h] = ref_sigmoid(c->beta[row * H + h]);
        for (int64_t part = 0; part < 2; part++)
            for (int64_t h = 0; h < H; h++) {
                float *x = c->qkv + row * C3 + part * HK + h * K;
                float ss = 0.0f;
                for (int64_t d = 0; d < K; d++)
                    ss += x[d] * x[d];
                float inv = 1.0f / sqrtf(ss + 1e-6f);
                if (part == 0)
                    inv *= scale;
                for (int64_t d = 0; d < K; d++)
                    x[d] *= inv;
            }
    }

    /* core */
    float *scratch = xmalloc(sizeof(float) * (size_t)duet_cpu_kda_chunk_scratch_floats(K, K));
    for (int it = 0; it < c->sh.n_items; it++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t r0 = c->row0[it];
            duet_cpu_kda_head_io_t io = {
                .q = c->qkv + r0 * C3 + h * K,
                .q_stride = C3,
                .k = c->qkv + r0 * C3 + HK + h * K,
                .k_stride = C3,
                .v = c->qkv + r0 * C3 + 2 * HK + h * K,
                .v_stride = C3,
                .g = c->g + r0 * HK + h * K,
                .g_stride = HK,
                .beta = c->beta + r0 * H + h,
                .beta_stride = H,
                .o = c->o_pre + r0 * HK + h * K,
                .o_stride = HK,
                .n = c->row0[it + 1] - r0,
                .K = K,
                .V = K,
            };
            float *S = ref_block(c, c->slot[it]) + h * K * K;
            if (io.n == 1)
                duet_cpu_kda_recurrent(&io, S);
            else
                duet_cpu_kda_chunked(&io, S, scratch);
        }
    free(scratch);

    /* out */
    memcpy(c->o, c->o_pre, sizeof(float) * (size_t)(T * HK));
    for (int64_t row = 0; row < T; row++)
        for (int64_t h = 0; h < H; h++) {
            float *o = c->o + row * HK + h * K;
            const float *gt = c->gate + row * HK + h * K;
            float ss = 0.0f;
            for (int64_t d = 0; d < K; d++)
                ss += o[d] * o[d];
            float inv = 1.0f / sqrtf(ss / (float)K + c->eps);
            for (int64_t d = 0; d < K; d++)
                o[d] = c->o_norm[d] * (o[d] * inv) * ref_sigmoid(gt[d]);
        }
}

/* ---- GPU chain ---------------------------------------------------------------------------- */

/* g and β are prepared in place, so each run starts from copies of the raw projections. */
static void gpu_step_enqueue(kda_case_t *c, cudaStream_t s, float *o_pre_host)
{
    const int64_t T = c->n_rows;
    CUDA_OK(cudaMemcpyAsync(c->d_g, c->d_graw, sizeof(float) * (size_t)(T * c->HK),
                            cudaMemcpyDeviceToDevice, s));
    CUDA_OK(cudaMemcpyAsync(c->d_beta, c->d_braw, sizeof(float) * (size_t)(T * c->sh.H),
                            cudaMemcpyDeviceToDevice, s));
    DUET_OK_OR_FAIL(duet_cuda_kda_conv(s, &c->st, &c->ly, c->d_taps, c->d_proj, c->d_qkv));
    DUET_OK_OR_FAIL(
        duet_cuda_kda_prep(s, T, &c->ly, c->d_neg_A, c->d_dt_bias, c->d_qkv, c->d_g, c->d_beta));
    DUET_OK_OR_FAIL(
        duet_cuda_kda_core(s, &c->st, &c->ly, c->d_qkv, c->d_g, c->d_beta, c->d_o, c->d_scr));
    if (o_pre_host != NULL)
        CUDA_OK(cudaMemcpyAsync(o_pre_host, c->d_o, sizeof(float) * (size_t)(T * c->HK),
                                cudaMemcpyDeviceToHost, s));
    DUET_OK_OR_FAIL(
        duet_cuda_kda_out(s, T, c->sh.H, c->sh.K, c->d_o_norm, c->eps, c->d_gate, c->d_o));
}

/* The core's tolerance for the chunked form's products `tc` (the file comment). */
static double tol_core(int tc)
{
    return tc == DUET_CUDA_KDA_TC_ONE ? TOL_CORE_TF32 : TOL_CORE;
}

/* Compare everything the GPU produced with the reference just computed. */
static void compare_step(kda_case_t *c, const char *what, const float *o_pre_gpu)
{
    const int64_t T = c->n_rows, H = c->sh.H, K = c->sh.K;
    const double tc = tol_core(c->sh.tc),
                 to = c->sh.tc == DUET_CUDA_KDA_TC_ONE ? TOL_OUT_TF32 : TOL_OUT;
    float *qkv = xmalloc(sizeof(float) * (size_t)(T * c->C3));
    float *g = xmalloc(sizeof(float) * (size_t)(T * c->HK));
    float *beta = xmalloc(sizeof(float) * (size_t)(T * H));
    float *o = xmalloc(sizeof(float) * (size_t)(T * c->HK));
    float *pool = xmalloc(sizeof(float) * c->pool_floats);
    CUDA_OK(cudaMemcpy(qkv, c->d_qkv, sizeof(float) * (size_t)(T * c->C3), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(g, c->d_g, sizeof(float) * (size_t)(T * c->HK), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(beta, c->d_beta, sizeof(float) * (size_t)(T * H), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(o, c->d_o, sizeof(float) * (size_t)(T * c->HK), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(pool, c->d_pool, sizeof(float) * c->pool_floats, cudaMemcpyDeviceToHost));

    expect_close(what, "qkv", qkv, c->qkv, (size_t)(T * c->C3), TOL_PREP);
    expect_close(what, "g", g, c->g, (size_t)(T * c->HK), TOL_PREP);
    expect_close(what, "beta", beta, c->beta, (size_t)(T * H), TOL_PREP);
    if (o_pre_gpu != NULL)
        expect_close(what, "o (core)", o_pre_gpu, c->o_pre, (size_t)(T * c->HK), tc);
    expect_close(what, "o (out)", o, c->o, (size_t)(T * c->HK), to);

    /* Per (slot, layer) block: S and windows of the batch's slots; every other block (slot 0,
     * slot n+1, layer 0 of every slot) must be bit-identical to the reference, i.e. untouched. */
    double e_s = 0.0, e_w = 0.0;
    int untouched_ok = 1;
    for (int32_t sl = 0; sl < c->n_slots; sl++)
        for (int64_t l = 0; l < c->n_layers; l++) {
            const size_t off = (size_t)((sl * c->n_layers + l) * c->layer_floats);
            const int used = l == c->layer && sl >= 1 && sl <= c->sh.n_items;
            if (!used) {
                untouched_ok &=
                    memcmp(pool + off, c->pool + off, sizeof(float) * (size_t)c->layer_floats) == 0;
                continue;
            }
            double es = rel_err(pool + off, c->pool + off, (size_t)(H * K * K));
            double ew = rel_err(pool + off + H * K * K, c->pool + off + H * K * K,
                                (size_t)(c->layer_floats - H * K * K));
            e_s = es > e_s ? es : e_s;
            e_w = ew > e_w ? ew : e_w;
        }
    printf("[cuda_kda] %-28s %-10s max rel err %.3e (tol %.0e)\n", what, "S", e_s, tc);
    printf("[cuda_kda] %-28s %-10s max rel err %.3e (tol %.0e)\n", what, "windows", e_w, TOL_EXACT);
    fflush(stdout);
    CHECK(e_s <= tc, "%s: S error %.3e", what, e_s);
    CHECK(e_w <= TOL_EXACT, "%s: window error %.3e", what, e_w);
    CHECK(untouched_ok, "%s: a pool block outside the batch changed", what);
    free(qkv), free(g), free(beta), free(o), free(pool);
}

/* Step 1 with the shape's item lengths, step 2 all-decode (pure recurrent launch). */
static void run_chain(const kda_shape_t *sh)
{
    kda_case_t c;
    cudaStream_t s;
    char what[96];
    case_init(&c, sh);
    CUDA_OK(cudaStreamCreate(&s));
    for (int step = 0; step < 2; step++) {
        int n_tok[16];
        for (int i = 0; i < sh->n_items; i++)
            n_tok[i] = step == 0 ? sh->n_tok[i] : 1;
        case_batch(&c, n_tok);
        float *o_pre = xmalloc(sizeof(float) * (size_t)(c.n_rows * c.HK));
        gpu_step_enqueue(&c, s, o_pre);
        CUDA_OK(cudaStreamSynchronize(s));
        ref_step(&c);
        snprintf(what, sizeof(what), "%s step %d (T=%d)", sh->name, step + 1, c.n_rows);
        compare_step(&c, what, o_pre);
        free(o_pre);
        for (int i = 0; i < sh->n_items; i++)
            c.pos0[i] += n_tok[i];
    }
    CUDA_OK(cudaStreamDestroy(s));
    case_free(&c);
}

/* ---- the chain entry point ---------------------------------------------------------------- */

static void chain_enqueue(kda_case_t *c, cudaStream_t s, void *ob)
{
    const int64_t T = c->n_rows;
    const duet_cuda_kda_weights_t w = {.taps = c->d_taps,
                                       .neg_A = c->d_neg_A,
                                       .dt_bias = c->d_dt_bias,
                                       .o_norm = c->d_o_norm,
                                       .eps = c->eps};
    CUDA_OK(cudaMemcpyAsync(c->d_g, c->d_graw, sizeof(float) * (size_t)(T * c->HK),
                            cudaMemcpyDeviceToDevice, s));
    CUDA_OK(cudaMemcpyAsync(c->d_beta, c->d_braw, sizeof(float) * (size_t)(T * c->sh.H),
                            cudaMemcpyDeviceToDevice, s));
    DUET_OK_OR_FAIL(duet_cuda_kda_chain(s, &c->st, &c->ly, &w, c->d_proj, c->d_gate, c->d_qkv,
                                        c->d_g, c->d_beta, c->d_o, ob, c->d_scr));
}

/* Host copies of everything a step writes. */
typedef struct {
    float *qkv, *g, *beta, *o, *pool;
} gpu_out_t;

static void gpu_out_get(kda_case_t *c, gpu_out_t *r)
{
    const int64_t T = c->n_rows;
    const size_t nq = (size_t)(T * c->C3), ng = (size_t)(T * c->HK), nb = (size_t)(T * c->sh.H);
    r->qkv = xmalloc(sizeof(float) * nq);
    r->g = xmalloc(sizeof(float) * ng);
    r->beta = xmalloc(sizeof(float) * nb);
    r->o = xmalloc(sizeof(float) * ng);
    r->pool = xmalloc(sizeof(float) * c->pool_floats);
    CUDA_OK(cudaMemcpy(r->qkv, c->d_qkv, sizeof(float) * nq, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(r->g, c->d_g, sizeof(float) * ng, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(r->beta, c->d_beta, sizeof(float) * nb, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(r->o, c->d_o, sizeof(float) * ng, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(r->pool, c->d_pool, sizeof(float) * c->pool_floats, cudaMemcpyDeviceToHost));
}

static void gpu_out_free(gpu_out_t *r)
{
    free(r->qkv), free(r->g), free(r->beta), free(r->o), free(r->pool);
}

/* As run_chain, through duet_cuda_kda_chain; each step first runs the four separate calls
 * (programmatic dependent launch off) from the same pool and compares the two GPU paths, then
 * the chain once more with ob, whose bf16 rows must be the separate calls' o rounded. */
static void run_chain_fused(const kda_shape_t *sh)
{
    kda_case_t c;
    cudaStream_t s;
    char what[96];
    case_init(&c, sh);
    CUDA_OK(cudaStreamCreate(&s));
    const size_t pool_bytes = sizeof(float) * c.pool_floats;
    float *d_save = dev_alloc(pool_bytes);
    for (int step = 0; step < 2; step++) {
        int n_tok[16];
        for (int i = 0; i < sh->n_items; i++)
            n_tok[i] = step == 0 ? sh->n_tok[i] : 1;
        case_batch(&c, n_tok);
        const size_t nq = (size_t)(c.n_rows * c.C3), ng = (size_t)(c.n_rows * c.HK);
        const size_t nb = (size_t)(c.n_rows * sh->H);

        CUDA_OK(cudaMemcpy(d_save, c.d_pool, pool_bytes, cudaMemcpyDeviceToDevice));
        duet_cuda_pdl_set(0);
        gpu_step_enqueue(&c, s, NULL);
        CUDA_OK(cudaStreamSynchronize(s));
        duet_cuda_pdl_set(-1);
        gpu_out_t sep, fus;
        gpu_out_get(&c, &sep);
        CUDA_OK(cudaMemcpy(c.d_pool, d_save, pool_bytes, cudaMemcpyDeviceToDevice));
        CUDA_OK(cudaMemset(c.d_qkv, 0, sizeof(float) * nq));
        CUDA_OK(cudaMemset(c.d_o, 0, sizeof(float) * ng));

        chain_enqueue(&c, s, NULL);
        CUDA_OK(cudaStreamSynchronize(s));
        ref_step(&c);
        snprintf(what, sizeof(what), "%s chain step %d (T=%d)", sh->name, step + 1, c.n_rows);
        compare_step(&c, what, NULL);
        gpu_out_get(&c, &fus);
        expect_close(what, "qkv ~sep", fus.qkv, sep.qkv, nq, TOL_FUSED);
        expect_close(what, "g ~sep", fus.g, sep.g, ng, TOL_FUSED);
        expect_close(what, "beta ~sep", fus.beta, sep.beta, nb, TOL_FUSED);
        expect_close(what, "o ~sep", fus.o, sep.o, ng, TOL_FUSED);
        expect_close(what, "pool ~sep", fus.pool, sep.pool, c.pool_floats, TOL_FUSED);
        /* again with ob: the four kernels, out's rows rounded to bf16 into ob, the same bits */
        CUDA_OK(cudaMemcpy(c.d_pool, d_save, pool_bytes, cudaMemcpyDeviceToDevice));
        uint16_t *d_ob = dev_alloc(sizeof(uint16_t) * ng), *ob = xmalloc(sizeof(uint16_t) * ng);
        chain_enqueue(&c, s, d_ob);
        CUDA_OK(cudaStreamSynchronize(s));
        CUDA_OK(cudaMemcpy(ob, d_ob, sizeof(uint16_t) * ng, cudaMemcpyDeviceToHost));
        size_t n_diff = 0;
        for (size_t i = 0; i < ng; i++)
            n_diff += ob[i] != duet_f32_to_bf16(sep.o[i]);
        CHECK(n_diff == 0, "%s: %zu of %zu values of ob are not the separate calls' o rounded",
              what, n_diff, ng);
        cudaFree(d_ob);
        free(ob);
        gpu_out_free(&sep);
        gpu_out_free(&fus);
        for (int i = 0; i < sh->n_items; i++)
            c.pos0[i] += n_tok[i];
    }
    cudaFree(d_save);
    CUDA_OK(cudaStreamDestroy(s));
    case_free(&c);
}

/* ---- tests -------------------------------------------------------------------------------- */

Test(cuda_kda, bad_shapes_refused, .timeout = 30)
{
    float dummy = 0.0f;
    duet_cuda_step_t st = {.n_items = 1, .n_rows = 1, .max_item_tokens = 1};
    duet_cuda_kda_layer_t ly = {.kda_base = &dummy,
                                .kda_n_layers = 1,
                                .kda_layer_floats = 1 << 20,
                                .layer = 0,
                                .H = 2,
                                .K = 24,
                                .W = 4};
    duet_status_t r = duet_cuda_kda_core(0, &st, &ly, NULL, NULL, NULL, NULL, NULL);
    CHECK(r == DUET_ERR_UNSUPPORTED, "K=24: %s", duet_status_name(r));
    CHECK(strstr(duet_error_last(), "multiple of 16") != NULL, "%s", duet_error_last());
    ly.K = 256;
    r = duet_cuda_kda_core(0, &st, &ly, NULL, NULL, NULL, NULL, NULL);
    CHECK(r == DUET_ERR_UNSUPPORTED, "K=256: %s", duet_status_name(r));
    ly.K = 64;
    ly.W = 9;
    r = duet_cuda_kda_conv(0, &st, &ly, NULL, NULL, NULL);
    CHECK(r == DUET_ERR_UNSUPPORTED, "W=9: %s", duet_status_name(r));
    ly.W = 4;
    ly.layer = 1; /* only one layer per slot */
    r = duet_cuda_kda_conv(0, &st, &ly, NULL, NULL, NULL);
    CHECK(r == DUET_ERR_INVALID, "layer out of range: %s", duet_status_name(r));
    ly.layer = 0;
    ly.tc = 3; /* no duet_cuda_kda_tc_t */
    r = duet_cuda_kda_core(0, &st, &ly, NULL, NULL, NULL, NULL, NULL);
    CHECK(r == DUET_ERR_INVALID, "tc = 3: %s", duet_status_name(r));
    CHECK(strstr(duet_error_last(), "tc = 3") != NULL, "%s", duet_error_last());
    ly.tc = DUET_CUDA_KDA_FMA;
    /* Nothing to do is not an error and launches nothing. */
    ly.layer = 0;
    st.n_rows = 0;
    st.n_items = 0;
    CHECK(duet_cuda_kda_core(0, &st, &ly, NULL, NULL, NULL, NULL, NULL) == DUET_OK);
    CHECK(duet_cuda_kda_prep(0, 0, &ly, NULL, NULL, NULL, NULL, NULL) == DUET_OK);
    CHECK(duet_cuda_kda_out(0, 0, 2, 64, NULL, 1e-6f, NULL, NULL) == DUET_OK);
    /* A lane of the row kernels holds at most four of a head's elements: K <= 128. */
    r = duet_cuda_kda_out(0, 1, 2, 129, NULL, 1e-6f, NULL, NULL);
    CHECK(r == DUET_ERR_UNSUPPORTED, "out K=129: %s", duet_status_name(r));
    ly.K = 129;
    r = duet_cuda_kda_prep(0, 1, &ly, NULL, NULL, NULL, NULL, NULL);
    CHECK(r == DUET_ERR_UNSUPPORTED, "prep K=129: %s", duet_status_name(r));
    CHECK(duet_cuda_kda_scratch_bytes(8, 64, 2, 129) == 0);
    CHECK(duet_cuda_kda_scratch_bytes(8, 64, 2, 24) == 0);
    ly.K = 64;
    CHECK(duet_cuda_kda_scratch_bytes(8, 64, 2, 64) < ((size_t)1 << 30));
    const duet_cuda_kda_weights_t w = {.eps = 1e-6f};
    st.n_rows = 1;
    st.n_items = 1;
    ly.K = 24;
    r = duet_cuda_kda_chain(0, &st, &ly, &w, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL);
    CHECK(r == DUET_ERR_UNSUPPORTED, "chain K=24: %s", duet_status_name(r));
    ly.K = 64;
    r = duet_cuda_kda_chain(0, &st, &ly, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL);
    CHECK(r == DUET_ERR_INVALID, "chain without weights: %s", duet_status_name(r));
    st.n_rows = 0;
    st.n_items = 0;
    CHECK(duet_cuda_kda_chain(0, &st, &ly, &w, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL) ==
          DUET_OK);
}

Test(cuda_kda, chain_small_heads, .timeout = 120)
{
    skip_without_device();
    const kda_shape_t a = {"H2 K16 W4", 2, 16, 4, 6, {1, 5, 1, 64, 65, 130}, -2.0f, 0.5f, 0};
    const kda_shape_t b = {"H4 K32 W2", 4, 32, 2, 3, {2, 1, 100}, -2.0f, 0.5f, 0};
    const kda_shape_t d = {"H2 K48 W8", 2, 48, 8, 4, {1, 7, 64, 3}, -2.0f, 0.5f, 0};
    run_chain(&a);
    run_chain(&b);
    run_chain(&d);
}

Test(cuda_kda, chain_k64_k128, .timeout = 120)
{
    skip_without_device();
    const kda_shape_t a = {"H3 K64 W4", 3, 64, 4, 7, {1, 1, 200, 2, 63, 1, 129}, -2.0f, 0.5f, 0};
    const kda_shape_t b = {"H2 K128 W4", 2, 128, 4, 4, {1, 70, 1, 3}, -2.0f, 0.5f, 0};
    const kda_shape_t d = {"H2 K128 W4 (1 item)", 2, 128, 4, 1, {190}, -2.0f, 0.5f, 0};
    run_chain(&a);
    run_chain(&b);
    run_chain(&d);
}

/* Slow decays (long memory: Γ stays small, S accumulates) and fast ones (−exp(A_log) of 4.5 to
 * 12, Γ reaches −100s within a chunk, so e^Γ underflows: the chunked form must stay finite). */
Test(cuda_kda, chain_decay_extremes, .timeout = 120)
{
    skip_without_device();
    const kda_shape_t slow = {"H2 K64 slow decay", 2, 64, 4, 3, {1, 150, 66}, -6.0f, -4.0f, 0};
    const kda_shape_t fast = {"H2 K64 fast decay", 2, 64, 4, 3, {1, 150, 66}, 1.5f, 2.5f, 0};
    run_chain(&slow);
    run_chain(&fast);
}

/* The chain entry point at batch 1 with the real model's heads (both steps decode). */
Test(cuda_kda, chain_decode_batch1, .timeout = 120)
{
    skip_without_device();
    const kda_shape_t a = {"H32 K128 W4 b1", 32, 128, 4, 1, {1}, -2.0f, 0.5f, 0};
    run_chain_fused(&a);
}

/* Decode batches of several items, every cluster size (K/32 rounded up: 1 to 4 blocks, full and
 * partial last blocks) and W from 1 (no window) to 8. */
Test(cuda_kda, chain_decode_items, .timeout = 120)
{
    skip_without_device();
    const kda_shape_t a = {"H4 K128 W4 b9", 4,    128, 4, 9, {1, 1, 1, 1, 1, 1, 1, 1, 1},
                           -2.0f,           0.5f, 0};
    const kda_shape_t b = {"H2 K48 W8 b3", 2, 48, 8, 3, {1, 1, 1}, -2.0f, 0.5f, 0};
    const kda_shape_t d = {"H3 K80 W2 b5", 3, 80, 2, 5, {1, 1, 1, 1, 1}, -2.0f, 0.5f, 0};
    const kda_shape_t e = {"H2 K16 W1 b2", 2, 16, 1, 2, {1, 1}, -2.0f, 0.5f, 0};
    const kda_shape_t f = {"H2 K112 W3 b4", 2, 112, 3, 4, {1, 1, 1, 1}, 1.5f, 2.5f, 0};
    const kda_shape_t g = {"H5 K96 W4 b2", 5, 96, 4, 2, {1, 1}, -6.0f, -4.0f, 0};
    /* 13 x 64 (item, head) pairs: more than the fused kernel takes, so the separate kernels */
    const kda_shape_t l = {"H64 K16 W4 b13 (separate)",
                           64,
                           16,
                           4,
                           13,
                           {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1},
                           -2.0f,
                           0.5f,
                           0};
    run_chain_fused(&a);
    run_chain_fused(&b);
    run_chain_fused(&d);
    run_chain_fused(&e);
    run_chain_fused(&f);
    run_chain_fused(&g);
    run_chain_fused(&l);
}

/* Prefill and mixed steps (the separate kernels), each followed by a decode step (fused). */
Test(cuda_kda, chain_prefill, .timeout = 120)
{
    skip_without_device();
    const kda_shape_t a = {"H3 K64 W4 mixed", 3, 64, 4, 4, {1, 70, 1, 3}, -2.0f, 0.5f, 0};
    const kda_shape_t b = {"H2 K128 W4 prefill", 2, 128, 4, 1, {130}, -2.0f, 0.5f, 0};
    const kda_shape_t d = {"H2 K128 W4 mixed", 2, 128, 4, 4, {1, 70, 1, 3}, -2.0f, 0.5f, 0};
    run_chain_fused(&a);
    run_chain_fused(&b);
    run_chain_fused(&d);
}

/* Whether the n floats at dev equal host's to the bit. */
static int device_equals(const float *host, const float *dev, size_t n)
{
    float *h = xmalloc(sizeof(float) * n);
    CUDA_OK(cudaMemcpy(h, dev, sizeof(float) * n, cudaMemcpyDeviceToHost));
    const int same = memcmp(h, host, sizeof(float) * n) == 0;
    free(h);
    return same;
}

/* The GPU's two forms of the core on the same inputs: one item of n tokens (chunked) versus n
 * one-token steps (recurrent), both from the same nonzero state; and the CPU recurrence. */
static void forms_agree(int64_t H, int64_t K, int64_t n, int tc)
{
    const int64_t HK = H * K, C3 = 3 * HK, lf = H * K * K + C3 * 3;
    float *qkv = xmalloc(sizeof(float) * (size_t)(n * C3)),
          *g = xmalloc(sizeof(float) * (size_t)(n * HK));
    float *beta = xmalloc(sizeof(float) * (size_t)(n * H)),
          *pool = xmalloc(sizeof(float) * (size_t)lf);
    fill(qkv, (size_t)(n * C3), -1.0f, 1.0f);
    fill(beta, (size_t)(n * H), 0.05f, 0.95f);
    fill(pool, (size_t)lf, -1.0f, 1.0f);
    for (int64_t i = 0; i < n * HK; i++)
        g[i] = -expf(rng_range(-5.0f, 1.0f)); /* decays from ~1 down to e^-2.7 per token */
    for (int64_t r = 0; r < n; r++)           /* q, k L2-normalised, q scaled */
        for (int part = 0; part < 2; part++)
            for (int64_t h = 0; h < H; h++) {
                float *x = qkv + r * C3 + part * HK + h * K;
                float ss = 0.0f;
                for (int64_t d = 0; d < K; d++)
                    ss += x[d] * x[d];
                float inv = 1.0f / sqrtf(ss + 1e-6f) / (part == 0 ? sqrtf((float)K) : 1.0f);
                for (int64_t d = 0; d < K; d++)
                    x[d] *= inv;
            }

    float *d_qkv = dev_copy(qkv, sizeof(float) * (size_t)(n * C3));
    float *d_g = dev_copy(g, sizeof(float) * (size_t)(n * HK));
    float *d_beta = dev_copy(beta, sizeof(float) * (size_t)(n * H));
    float *d_pool_a = dev_copy(pool, sizeof(float) * (size_t)lf);
    float *d_pool_b = dev_copy(pool, sizeof(float) * (size_t)lf);
    float *d_oa = dev_alloc(sizeof(float) * (size_t)(n * HK));
    float *d_ob = dev_alloc(sizeof(float) * (size_t)(n * HK));
    /* step_of's layout, one item in slot 0 of a one-slot pool: row0[2] | pos0 | slot | page |
     * row_item, row_pos (zeros). a: the n tokens at once; b: one token (pos0 is not read). */
    const size_t meta_a_bytes = sizeof(int32_t) * (size_t)(5 + 2 * n);
    int32_t *meta_a = xmalloc(meta_a_bytes);
    memset(meta_a, 0, meta_a_bytes);
    meta_a[1] = (int32_t)n;
    int32_t *d_meta_a = dev_copy(meta_a, meta_a_bytes);
    int32_t meta_b[7] = {0, 1, 5, 0, 0, 0, 0};
    int32_t *d_meta_b = dev_copy(meta_b, sizeof(meta_b));

    duet_cuda_kda_layer_t ly = {.kda_base = d_pool_a,
                                .kda_n_layers = 1,
                                .kda_layer_floats = lf,
                                .layer = 0,
                                .H = H,
                                .K = K,
                                .W = 4,
                                .tc = tc};
    const duet_cuda_step_t chunked = step_of(d_meta_a, 1, n, (int)n);
    duet_cuda_step_t st = chunked;
    /* The chunked form needs its scratch; without it the call is refused before any launch. */
    duet_status_t refused = duet_cuda_kda_core(0, &st, &ly, d_qkv, d_g, d_beta, d_oa, NULL);
    CHECK(refused == DUET_ERR_INVALID, "a chunked step without scratch returned %d", refused);
    const size_t scr_bytes = duet_cuda_kda_scratch_bytes(1, n, H, K);
    void *d_scr = dev_alloc(scr_bytes);
    DUET_OK_OR_FAIL(duet_cuda_kda_core(0, &st, &ly, d_qkv, d_g, d_beta, d_oa, d_scr));

    ly.kda_base = d_pool_b;
    st = step_of(d_meta_b, 1, 1, 1);
    for (int64_t t = 0; t < n; t++)
        DUET_OK_OR_FAIL(duet_cuda_kda_core(0, &st, &ly, d_qkv + t * C3, d_g + t * HK,
                                           d_beta + t * H, d_ob + t * HK, NULL));
    CUDA_OK(cudaDeviceSynchronize());

    /* The chunked form again from the same state, with the scratch the first run left: the
     * same results to the bit (nothing depends on timing or on what the scratch held). The
     * first run must also have left the pool's conv windows (past the heads' states) alone. */
    float *d_pool_c = dev_copy(pool, sizeof(float) * (size_t)lf);
    float *d_oc = dev_alloc(sizeof(float) * (size_t)(n * HK));
    ly.kda_base = d_pool_c;
    st = chunked;
    DUET_OK_OR_FAIL(duet_cuda_kda_core(0, &st, &ly, d_qkv, d_g, d_beta, d_oc, d_scr));
    CUDA_OK(cudaDeviceSynchronize());

    float *oa = xmalloc(sizeof(float) * (size_t)(n * HK)),
          *ob = xmalloc(sizeof(float) * (size_t)(n * HK));
    float *sa = xmalloc(sizeof(float) * (size_t)lf), *sb = xmalloc(sizeof(float) * (size_t)lf);
    float *oc = xmalloc(sizeof(float) * (size_t)(n * HK));
    CUDA_OK(cudaMemcpy(oa, d_oa, sizeof(float) * (size_t)(n * HK), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(ob, d_ob, sizeof(float) * (size_t)(n * HK), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(sa, d_pool_a, sizeof(float) * (size_t)lf, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(sb, d_pool_b, sizeof(float) * (size_t)lf, cudaMemcpyDeviceToHost));
    {
        int untouched = 1;
        for (int64_t i = H * K * K; i < lf; i++)
            untouched &= memcmp(&sa[i], &pool[i], sizeof(float)) == 0;
        CHECK(untouched, "the chunked core wrote past the heads' states");
    }
    for (int64_t h = 0; h < H; h++) {
        duet_cpu_kda_head_io_t io = {.q = qkv + h * K,
                                     .q_stride = C3,
                                     .k = qkv + HK + h * K,
                                     .k_stride = C3,
                                     .v = qkv + 2 * HK + h * K,
                                     .v_stride = C3,
                                     .g = g + h * K,
                                     .g_stride = HK,
                                     .beta = beta + h,
                                     .beta_stride = H,
                                     .o = oc + h * K,
                                     .o_stride = HK,
                                     .n = n,
                                     .K = K,
                                     .V = K};
        duet_cpu_kda_recurrent(&io, pool + h * K * K);
    }
    char what[64];
    snprintf(what, sizeof(what), "forms%s H%lld K%lld n=%lld",
             tc == DUET_CUDA_KDA_TC_ONE ? " tc1"
             : tc                       ? " tc"
                                        : "",
             (long long)H, (long long)K, (long long)n);
    {
        const size_t no = (size_t)(n * HK), ns = (size_t)(H * K * K);
        const int same = device_equals(oa, d_oc, no) && device_equals(sa, d_pool_c, ns);
        printf("[cuda_kda] %s: the chunked form run twice (scratch %zu bytes): o and S %s\n", what,
               scr_bytes, same ? "bit-identical" : "DIFFER");
        CHECK(same, "%s: a second chunked run changed the result", what);
    }
    expect_close(what, "o chk~rec", oa, ob, (size_t)(n * HK), tol_core(tc));
    expect_close(what, "S chk~rec", sa, sb, (size_t)(H * K * K), tol_core(tc));
    expect_close(what, "o rec~cpu", ob, oc, (size_t)(n * HK), TOL_CORE);
    expect_close(what, "S rec~cpu", sb, pool, (size_t)(H * K * K), TOL_CORE);

    free(qkv), free(g), free(beta), free(pool), free(meta_a), free(oa), free(ob), free(sa);
    free(sb), free(oc);
    cudaFree(d_qkv), cudaFree(d_g), cudaFree(d_beta), cudaFree(d_pool_a), cudaFree(d_pool_b);
    cudaFree(d_oa), cudaFree(d_ob), cudaFree(d_meta_a), cudaFree(d_meta_b);
    cudaFree(d_pool_c), cudaFree(d_oc), cudaFree(d_scr);
}

Test(cuda_kda, chunked_equals_recurrent, .timeout = 120)
{
    skip_without_device();
    forms_agree(2, 128, 150, 0);
    forms_agree(3, 32, 150, 0);
    forms_agree(1, 80, 65, 0);
    forms_agree(2, 128, 150, DUET_CUDA_KDA_TC_SPLIT);
    forms_agree(3, 32, 150, DUET_CUDA_KDA_TC_SPLIT);
    forms_agree(1, 80, 65, DUET_CUDA_KDA_TC_SPLIT);
    forms_agree(2, 48, 200, DUET_CUDA_KDA_TC_SPLIT);
    forms_agree(2, 128, 150, DUET_CUDA_KDA_TC_ONE);
    forms_agree(1, 80, 65, DUET_CUDA_KDA_TC_ONE);
}

/* The chunked core with its state products on the tensor cores (duet_cuda_kda_layer_t.tc), each
 * shape twice: tf32 products of split fp32 values against the same CPU reference and tolerances
 * as the FMA form, then one-term products against TOL_CORE_TF32 / TOL_OUT_TF32. Every K the core
 * takes (one full or partial 32-column block up to four), items crossing chunk boundaries beside
 * decode items, a chunk of one row past a full one (65, 129), and decays from slow to
 * underflowing. */
Test(cuda_kda, chunked_tensor_cores, .timeout = 120)
{
    skip_without_device();
    const kda_shape_t shapes[] = {
        {"tc H2 K16 W4", 2, 16, 4, 6, {1, 5, 1, 64, 65, 130}, -2.0f, 0.5f, 1},
        {"tc H4 K32 W2", 4, 32, 2, 3, {2, 1, 100}, -2.0f, 0.5f, 1},
        {"tc H2 K48 W8", 2, 48, 8, 4, {1, 7, 64, 3}, -2.0f, 0.5f, 1},
        {"tc H3 K64 W4", 3, 64, 4, 7, {1, 1, 200, 2, 63, 1, 129}, -2.0f, 0.5f, 1},
        {"tc H2 K80 W4", 2, 80, 4, 3, {17, 1, 140}, -2.0f, 0.5f, 1},
        {"tc H2 K96 W4", 2, 96, 4, 2, {2, 96}, -2.0f, 0.5f, 1},
        {"tc H2 K112 W3", 2, 112, 3, 2, {66, 129}, -2.0f, 0.5f, 1},
        {"tc H2 K128 W4", 2, 128, 4, 4, {1, 70, 1, 3}, -2.0f, 0.5f, 1},
        {"tc H2 K128 W4 (1 item)", 2, 128, 4, 1, {190}, -2.0f, 0.5f, 1},
        {"tc H2 K64 slow decay", 2, 64, 4, 3, {1, 150, 66}, -6.0f, -4.0f, 1},
        {"tc H2 K128 fast decay", 2, 128, 4, 3, {1, 150, 66}, 1.5f, 2.5f, 1},
    };
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) {
        run_chain(&shapes[i]);
        kda_shape_t one = shapes[i];
        char name[64];
        snprintf(name, sizeof(name), "tc1%s", shapes[i].name + 2);
        one.name = name;
        one.tc = DUET_CUDA_KDA_TC_ONE;
        run_chain(&one);
    }
}

/* The chain captured once as a CUDA graph (global capture mode: any call that is illegal while
 * capturing fails) and launched twice; the reference runs the same step twice. */
Test(cuda_kda, graph_capture, .timeout = 120)
{
    skip_without_device();
    const kda_shape_t sh = {"graph H2 K64 W4", 2, 64, 4, 4, {1, 90, 1, 2}, -2.0f, 0.5f, 0};
    kda_case_t c;
    cudaStream_t s;
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    case_init(&c, &sh);
    case_batch(&c, sh.n_tok);
    CUDA_OK(cudaStreamCreate(&s));
    CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    gpu_step_enqueue(&c, s, NULL);
    CUDA_OK(cudaStreamEndCapture(s, &graph));
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    for (int rep = 0; rep < 2; rep++) {
        CUDA_OK(cudaGraphLaunch(exec, s));
        CUDA_OK(cudaStreamSynchronize(s));
        ref_step(&c);
        compare_step(&c, rep == 0 ? "graph launch 1" : "graph launch 2", NULL);
    }
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
    CUDA_OK(cudaStreamDestroy(s));
    case_free(&c);
}

/* duet_cuda_kda_chain captured as a graph: a decode step (the fused kernel) and a mixed one. */
static void chain_graph(const kda_shape_t *sh)
{
    kda_case_t c;
    cudaStream_t s;
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    char what[96];
    case_init(&c, sh);
    case_batch(&c, sh->n_tok);
    CUDA_OK(cudaStreamCreate(&s));
    CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    chain_enqueue(&c, s, NULL);
    CUDA_OK(cudaStreamEndCapture(s, &graph));
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    for (int rep = 0; rep < 2; rep++) {
        CUDA_OK(cudaGraphLaunch(exec, s));
        CUDA_OK(cudaStreamSynchronize(s));
        ref_step(&c);
        snprintf(what, sizeof(what), "%s launch %d", sh->name, rep + 1);
        compare_step(&c, what, NULL);
    }
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
    CUDA_OK(cudaStreamDestroy(s));
    case_free(&c);
}

Test(cuda_kda, chain_graph_capture, .timeout = 120)
{
    skip_without_device();
    const kda_shape_t a = {"graph chain H2 K128 decode", 2, 128, 4, 3, {1, 1, 1}, -2.0f, 0.5f, 0};
    const kda_shape_t b = {"graph chain H2 K64 mixed", 2, 64, 4, 4, {1, 90, 1, 2}, -2.0f, 0.5f, 0};
    chain_graph(&a);
    chain_graph(&b);
}

/*
 * The real model's head shape (H = 32, K = V = 128, W = 4) on the device, for the timing tests:
 * zeroed buffers for n_items sequences of n_tok new tokens each (sequence i in state slot i + 1,
 * at position 0), their step metadata and the layer.
 */
typedef struct {
    int64_t H, K, HK, C3, T, lf;
    float *pool, *proj, *qkv, *g, *b, *o, *gate, *taps, *w;
    void *scr; /* the chunked form's scratch */
    int32_t *meta;
    duet_cuda_step_t st;
    duet_cuda_kda_layer_t ly;
} real_shape_t;

static float *dev_zeros(size_t floats)
{
    float *p = dev_alloc(sizeof(float) * floats);
    CUDA_OK(cudaMemset(p, 0, sizeof(float) * floats));
    return p;
}

static void real_shape_alloc(real_shape_t *r, int n_items, int n_tok)
{
    const int64_t H = 32, K = 128, HK = H * K, C3 = 3 * HK, T = (int64_t)n_items * n_tok;
    *r = (real_shape_t){.H = H, .K = K, .HK = HK, .C3 = C3, .T = T, .lf = H * K * K + C3 * 3};
    r->pool = dev_zeros((size_t)((n_items + 1) * r->lf));
    r->proj = dev_zeros((size_t)(T * C3));
    r->qkv = dev_zeros((size_t)(T * C3));
    r->g = dev_zeros((size_t)(T * HK));
    r->b = dev_zeros((size_t)(T * H));
    r->o = dev_zeros((size_t)(T * HK));
    r->gate = dev_zeros((size_t)(T * HK));
    r->taps = dev_zeros((size_t)(C3 * 4));
    r->w = dev_zeros((size_t)HK);
    r->scr = dev_alloc(duet_cuda_kda_scratch_bytes(n_items, T, H, K));
    const int n = n_items;
    int32_t *m = xmalloc(sizeof(int32_t) * (size_t)(4 * n + 1 + 2 * T));
    for (int i = 0; i <= n; i++)
        m[i] = i * n_tok;
    for (int i = 0; i < n; i++) {
        m[n + 1 + i] = 0;
        m[2 * n + 1 + i] = i + 1;
        m[3 * n + 1 + i] = 0;
    }
    for (int64_t row = 0; row < T; row++) {
        m[4 * n + 1 + row] = (int32_t)(row / n_tok);
        m[4 * n + 1 + T + row] = (int32_t)(row % n_tok);
    }
    r->meta = dev_copy(m, sizeof(int32_t) * (size_t)(4 * n + 1 + 2 * T));
    free(m);
    r->st = step_of(r->meta, n, T, n_tok);
    r->ly = (duet_cuda_kda_layer_t){.kda_base = r->pool,
                                    .kda_n_layers = 1,
                                    .kda_layer_floats = r->lf,
                                    .layer = 0,
                                    .H = H,
                                    .K = K,
                                    .W = 4};
}

static void real_shape_free(real_shape_t *r)
{
    cudaFree(r->pool), cudaFree(r->proj), cudaFree(r->qkv), cudaFree(r->g), cudaFree(r->b);
    cudaFree(r->o), cudaFree(r->gate), cudaFree(r->taps), cudaFree(r->w), cudaFree(r->meta);
    cudaFree(r->scr);
}

/* Milliseconds of `iters` back-to-back duet_cuda_kda_core calls on r, after one warm-up call. */
static float core_ms(real_shape_t *r, int iters, cudaEvent_t e0, cudaEvent_t e1)
{
    float ms = 0.0f;
    DUET_OK_OR_FAIL(duet_cuda_kda_core(0, &r->st, &r->ly, r->qkv, r->g, r->b, r->o, r->scr));
    CUDA_OK(cudaEventRecord(e0, 0));
    for (int i = 0; i < iters; i++)
        DUET_OK_OR_FAIL(duet_cuda_kda_core(0, &r->st, &r->ly, r->qkv, r->g, r->b, r->o, r->scr));
    CUDA_OK(cudaEventRecord(e1, 0));
    CUDA_OK(cudaEventSynchronize(e1));
    CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
    return ms;
}

/* Timings at the real model's head shape (H = 32, K = V = 128, W = 4); prints them, and checks
 * that the conv's two thread shapes agree bit for bit. */
Test(cuda_kda, timing_real_shape, .timeout = 120)
{
    skip_without_device();
    const int cases[][2] = {{64, 1}, {256, 1}, {1, 4096}, {8, 512}};
    for (size_t ci = 0; ci < sizeof(cases) / sizeof(cases[0]); ci++) {
        const int n_items = cases[ci][0], n_tok = cases[ci][1];
        real_shape_t r;
        real_shape_alloc(&r, n_items, n_tok);
        const int64_t H = r.H, K = r.K, C3 = r.C3, T = r.T;
        float *h_proj = xmalloc(sizeof(float) * (size_t)(T * C3));
        fill(h_proj, (size_t)(T * C3), -1.0f, 1.0f);
        CUDA_OK(
            cudaMemcpy(r.proj, h_proj, sizeof(float) * (size_t)(T * C3), cudaMemcpyHostToDevice));
        CUDA_OK(
            cudaMemcpy(r.qkv, h_proj, sizeof(float) * (size_t)(T * C3), cudaMemcpyHostToDevice));
        free(h_proj);
        /* Random conv taps (zeros would make every conv output SiLU(0) = 0 and the bit-for-bit
         * checks below vacuous). */
        float *h_taps = xmalloc(sizeof(float) * (size_t)(C3 * 4));
        fill(h_taps, (size_t)(C3 * 4), -0.5f, 0.5f);
        CUDA_OK(
            cudaMemcpy(r.taps, h_taps, sizeof(float) * (size_t)(C3 * 4), cudaMemcpyHostToDevice));
        free(h_taps);
        /* Prepared inputs: prep once on random qkv (neg_A = 0, so g = 0: no decay). */
        DUET_OK_OR_FAIL(duet_cuda_kda_prep(0, T, &r.ly, r.w, r.w, r.qkv, r.g, r.b));
        cudaEvent_t e0, e1;
        CUDA_OK(cudaEventCreate(&e0));
        CUDA_OK(cudaEventCreate(&e1));
        const int iters = n_tok == 1 ? 50 : 5;
        float ms_conv = 0.0f, ms_out = 0.0f;
        const float ms_core = core_ms(&r, iters, e0, e1);
        /* the conv four channels per thread (the launch's choice here) and one (the hook),
         * timed side by side; their outputs must be equal bit for bit (the same arithmetic per
         * channel) */
        float ms_conv1 = 0.0f;
        const size_t nq = (size_t)(T * C3);
        float *q4 = xmalloc(sizeof(float) * nq), *q1 = xmalloc(sizeof(float) * nq);
        for (int v = 0; v < 2; v++) {
            duet__cuda_kda_conv_scalar(v);
            CUDA_OK(cudaEventRecord(e0, 0));
            for (int i = 0; i < iters; i++)
                DUET_OK_OR_FAIL(duet_cuda_kda_conv(0, &r.st, &r.ly, r.taps, r.proj, r.qkv));
            CUDA_OK(cudaEventRecord(e1, 0));
            CUDA_OK(cudaEventSynchronize(e1));
            CUDA_OK(cudaEventElapsedTime(v ? &ms_conv1 : &ms_conv, e0, e1));
            CUDA_OK(cudaMemcpy(v ? q1 : q4, r.qkv, sizeof(float) * nq, cudaMemcpyDeviceToHost));
        }
        duet__cuda_kda_conv_scalar(0);
        CHECK(memcmp(q4, q1, sizeof(float) * nq) == 0,
              "%d items x %d tokens: the conv differs between 4 channels per thread and 1", n_items,
              n_tok);
        free(q4);
        free(q1);
        CUDA_OK(cudaEventRecord(e0, 0));
        for (int i = 0; i < iters; i++)
            DUET_OK_OR_FAIL(duet_cuda_kda_out(0, T, H, K, r.w, 1e-6f, r.g, r.o));
        CUDA_OK(cudaEventRecord(e1, 0));
        CUDA_OK(cudaEventSynchronize(e1));
        CUDA_OK(cudaEventElapsedTime(&ms_out, e0, e1));
        float ms_tc = 0.0f, ms_tc1 = 0.0f; /* the chunked core on the tensor cores */
        if (n_tok > 1) {
            r.ly.tc = DUET_CUDA_KDA_TC_SPLIT;
            ms_tc = core_ms(&r, iters, e0, e1);
            r.ly.tc = DUET_CUDA_KDA_TC_ONE;
            ms_tc1 = core_ms(&r, iters, e0, e1);
            r.ly.tc = DUET_CUDA_KDA_FMA;
        }
        /* The chain at prefill with q and k normalised in the conv (its choice at K = 128) and,
         * with the hook, in prep: from the same pool and inputs equal bit for bit (qkv, g, β, o
         * and the pool), then timed side by side. */
        float ms_chain[2] = {0.0f, 0.0f};
        if (n_tok > 1) {
            const size_t ng = (size_t)(T * r.HK), nb = (size_t)(T * H),
                         np = (size_t)((n_items + 1) * r.lf);
            float *h_w = xmalloc(sizeof(float) * ng); /* neg_A, dt_bias, o_norm: nonzero */
            fill(h_w, (size_t)r.HK, -1.0f, -0.1f);
            CUDA_OK(cudaMemcpy(r.w, h_w, sizeof(float) * (size_t)r.HK, cudaMemcpyHostToDevice));
            fill(h_w, ng, -1.0f, 1.0f);
            float *g0 = dev_copy(h_w, sizeof(float) * ng), *b0 = dev_copy(h_w, sizeof(float) * nb);
            CUDA_OK(cudaMemcpy(r.gate, h_w, sizeof(float) * ng, cudaMemcpyHostToDevice));
            free(h_w);
            const duet_cuda_kda_weights_t w = {
                .taps = r.taps, .neg_A = r.w, .dt_bias = r.w, .o_norm = r.w, .eps = 1e-6f};
            float *got[2][5];
            for (int v = 0; v < 2; v++) {
                duet__cuda_kda_conv_norm_off(v);
                CUDA_OK(cudaMemset(r.pool, 0, sizeof(float) * np));
                CUDA_OK(cudaMemcpy(r.g, g0, sizeof(float) * ng, cudaMemcpyDeviceToDevice));
                CUDA_OK(cudaMemcpy(r.b, b0, sizeof(float) * nb, cudaMemcpyDeviceToDevice));
                DUET_OK_OR_FAIL(duet_cuda_kda_chain(0, &r.st, &r.ly, &w, r.proj, r.gate, r.qkv, r.g,
                                                    r.b, r.o, NULL, r.scr));
                const float *src[5] = {r.qkv, r.g, r.b, r.o, r.pool};
                const size_t n[5] = {nq, ng, nb, ng, np};
                for (int k = 0; k < 5; k++) {
                    got[v][k] = xmalloc(sizeof(float) * n[k]);
                    CUDA_OK(cudaMemcpy(got[v][k], src[k], sizeof(float) * n[k],
                                       cudaMemcpyDeviceToHost));
                }
                CUDA_OK(cudaEventRecord(e0, 0));
                for (int i = 0; i < iters; i++)
                    DUET_OK_OR_FAIL(duet_cuda_kda_chain(0, &r.st, &r.ly, &w, r.proj, r.gate, r.qkv,
                                                        r.g, r.b, r.o, NULL, r.scr));
                CUDA_OK(cudaEventRecord(e1, 0));
                CUDA_OK(cudaEventSynchronize(e1));
                CUDA_OK(cudaEventElapsedTime(&ms_chain[v], e0, e1));
            }
            duet__cuda_kda_conv_norm_off(0);
            static const char *names[5] = {"qkv", "g", "beta", "o", "pool"};
            const size_t n[5] = {nq, ng, nb, ng, np};
            for (int k = 0; k < 5; k++) {
                CHECK(memcmp(got[0][k], got[1][k], sizeof(float) * n[k]) == 0,
                      "%d items x %d tokens: the chain's %s differs with q, k normalised in prep",
                      n_items, n_tok, names[k]);
                free(got[0][k]);
                free(got[1][k]);
            }
            cudaFree(g0);
            cudaFree(b0);
        }
        const double us = 1e3 * ms_core / iters;
        const double state_gb = 2.0 * (double)n_items * (double)(H * K * K * 4) / 1e9;
        printf("[cuda_kda] timing H32 K128: %4d items x %4d tokens: core %9.1f us (%.0f GB/s of "
               "state, %.0f tok/s), conv %.1f us (one channel per thread %.1f), out %.1f us\n",
               n_items, n_tok, us, state_gb / (us * 1e-6), (double)T / (us * 1e-6),
               1e3 * ms_conv / iters, 1e3 * ms_conv1 / iters, 1e3 * ms_out / iters);
        if (n_tok > 1)
            printf("[cuda_kda] timing H32 K128: %4d items x %4d tokens: core on the tensor cores "
                   "%9.1f us split, %9.1f us one term; chain %9.1f us (q, k normalised in prep "
                   "%9.1f)\n",
                   n_items, n_tok, 1e3 * ms_tc / iters, 1e3 * ms_tc1 / iters,
                   1e3 * ms_chain[0] / iters, 1e3 * ms_chain[1] / iters);
        fflush(stdout);
        CUDA_OK(cudaEventDestroy(e0));
        CUDA_OK(cudaEventDestroy(e1));
        real_shape_free(&r);
    }
}

/* A decode step at the real model's head shape (H = 32, K = V = 128, W = 4) for n_items items:
 * the four separate calls versus duet_cuda_kda_chain, back to back in a stream as the engine
 * queues them; prints only (under Nsight Compute the per-kernel times come from its report). */
Test(cuda_kda, timing_chain_decode, .timeout = 120)
{
    skip_without_device();
    const int batches[] = {1, 8, 64};
    for (size_t bi = 0; bi < sizeof(batches) / sizeof(batches[0]); bi++) {
        const int n = batches[bi];
        real_shape_t r; /* zero weights (g = 0, q = k = 0): values stay finite however often */
        real_shape_alloc(&r, n, 1);
        const int64_t H = r.H, K = r.K, T = r.T;
        const duet_cuda_kda_weights_t w = {
            .taps = r.taps, .neg_A = r.w, .dt_bias = r.w, .o_norm = r.w, .eps = 1e-6f};
        cudaEvent_t e0, e1;
        CUDA_OK(cudaEventCreate(&e0));
        CUDA_OK(cudaEventCreate(&e1));
        const int iters = 20;
        float ms_sep = 0.0f, ms_chain = 0.0f;
        DUET_OK_OR_FAIL(duet_cuda_kda_chain(0, &r.st, &r.ly, &w, r.proj, r.gate, r.qkv, r.g, r.b,
                                            r.o, NULL, NULL));
        CUDA_OK(cudaEventRecord(e0, 0));
        for (int i = 0; i < iters; i++) {
            DUET_OK_OR_FAIL(duet_cuda_kda_conv(0, &r.st, &r.ly, r.taps, r.proj, r.qkv));
            DUET_OK_OR_FAIL(duet_cuda_kda_prep(0, T, &r.ly, r.w, r.w, r.qkv, r.g, r.b));
            DUET_OK_OR_FAIL(duet_cuda_kda_core(0, &r.st, &r.ly, r.qkv, r.g, r.b, r.o, NULL));
            DUET_OK_OR_FAIL(duet_cuda_kda_out(0, T, H, K, r.w, 1e-6f, r.gate, r.o));
        }
        CUDA_OK(cudaEventRecord(e1, 0));
        CUDA_OK(cudaEventSynchronize(e1));
        CUDA_OK(cudaEventElapsedTime(&ms_sep, e0, e1));
        CUDA_OK(cudaEventRecord(e0, 0));
        for (int i = 0; i < iters; i++)
            DUET_OK_OR_FAIL(duet_cuda_kda_chain(0, &r.st, &r.ly, &w, r.proj, r.gate, r.qkv, r.g,
                                                r.b, r.o, NULL, NULL));
        CUDA_OK(cudaEventRecord(e1, 0));
        CUDA_OK(cudaEventSynchronize(e1));
        CUDA_OK(cudaEventElapsedTime(&ms_chain, e0, e1));
        printf("[cuda_kda] timing decode chain H32 K128 W4, %2d items: separate %.1f us, chain "
               "%.1f us per step\n",
               n, 1e3 * ms_sep / iters, 1e3 * ms_chain / iters);
        fflush(stdout);
        CUDA_OK(cudaEventDestroy(e0));
        CUDA_OK(cudaEventDestroy(e1));
        real_shape_free(&r);
    }
}

/* ---- verify items and the replay (speculative decoding) --------------------------------------
 *
 * The claim of cuda_kda.h's "Verify items": a verify item's rows and a later replay of its first
 * j rows give what j one-token steps over the same inputs give, to the bit. Here a step of
 * verify items (beside a plain decode item) runs through duet_cuda_kda_chain on pool B, and the
 * same rows run as one-token decode steps (the fused chain kernel) on pool A:
 *   - every verify row's output equals its one-token step's, bit for bit (TOL_EXACT);
 *   - after the verify step the verify items' S and windows are untouched (bit for bit);
 *   - the replay rows hold the inputs (proj) and the prepared k, v, g, β of the steps, bit for bit;
 *   - after duet_cuda_kda_replay of j rows, S and the windows equal pool A after j steps, bit for
 *     bit, for j = 1 and j = all rows; slots the step does not name stay untouched. (The pool has
 *     one KDA layer: the replay folds every layer's rows, and a verify writes every layer's.)
 */
typedef struct {
    int64_t H, K, W, HK, C3, lf, RF, rows;
    int32_t n_slots;
    float *d_pool, *d_replay, *d_taps, *d_neg_A, *d_dt_bias, *d_o_norm;
    duet_cuda_kda_weights_t w;
    duet_cuda_kda_layer_t ly;
    /* vcase_init's host originals (the pools' floats pool_f, rep_f) and batch: verify items of
     * n_row[0..nv) rows in slots 1..nv, a decode item of one row in slot nv + 1, item i's input
     * rows from in_row[i] of proj, graw, braw, gate (total rows) */
    size_t pool_f, rep_f;
    float *pool0, *rep0, *taps, *neg_A, *dt_bias, *o_norm;
    int nv;
    int32_t slot[8], n_row[8], in_row[8], verify[8], total;
    float *proj, *graw, *braw, *gate;
} vcase_t;

/* One step of n items on the device: item i takes rows[i] rows of the host inputs starting at
 * in_row[i] (proj, graw, braw, gate), in slot slot[i], verify[i], replay[i] rows folded first.
 * Writes the step's o (T x HK) and prepared qkv, g, β to the host arrays given (may be NULL);
 * with ob_h the chain's out rows go to a bf16 buffer (its ob), copied there. The step's
 * max_item_tokens leaves verify items aside, as the engine's does (cuda_step.h). */
static void vstep(const vcase_t *v, int n, const int32_t *slot, const int32_t *rows,
                  const int32_t *in_row, const int32_t *verify, const int32_t *replay,
                  const float *proj, const float *graw, const float *braw, const float *gate,
                  float *o_h, float *qkv_h, float *g_h, float *beta_h, uint16_t *ob_h)
{
    int32_t T = 0, mx = 1, any_v = 0, any_r = 0;
    for (int i = 0; i < n; i++) {
        T += rows[i];
        if (!verify[i])
            mx = rows[i] > mx ? rows[i] : mx;
        any_v |= verify[i];
        any_r |= replay[i] > 0;
    }
    /* row0 | pos0 | slot | pages | row_item | row_pos | verify | replay */
    const size_t nm = (size_t)(6 * n + 1 + 2 * T);
    int32_t *m = xmalloc(sizeof(int32_t) * nm);
    int32_t *row0 = m, *pos0 = m + n + 1, *sl = m + 2 * n + 1, *pg = m + 3 * n + 1;
    int32_t *ri = m + 4 * n + 1, *rp = ri + T, *vf = rp + T, *rr = vf + n;
    float *p = xmalloc(sizeof(float) * (size_t)(T * v->C3)),
          *gr = xmalloc(sizeof(float) * (size_t)(T * v->HK));
    float *br = xmalloc(sizeof(float) * (size_t)(T * v->H)),
          *ga = xmalloc(sizeof(float) * (size_t)(T * v->HK));
    for (int i = 0, t = 0; i < n; i++) {
        row0[i] = t;
        pos0[i] = 10;
        sl[i] = slot[i];
        pg[i] = 0;
        vf[i] = verify[i];
        rr[i] = replay[i];
        for (int r = 0; r < rows[i]; r++, t++) {
            ri[t] = i;
            rp[t] = 10 + r;
            const int64_t src = in_row[i] + r;
            memcpy(p + t * v->C3, proj + src * v->C3, sizeof(float) * (size_t)v->C3);
            memcpy(gr + t * v->HK, graw + src * v->HK, sizeof(float) * (size_t)v->HK);
            memcpy(br + t * v->H, braw + src * v->H, sizeof(float) * (size_t)v->H);
            memcpy(ga + t * v->HK, gate + src * v->HK, sizeof(float) * (size_t)v->HK);
        }
    }
    row0[n] = T;
    int32_t *d_m = dev_copy(m, sizeof(int32_t) * nm);
    float *d_p = dev_copy(p, sizeof(float) * (size_t)(T * v->C3));
    float *d_g = dev_copy(gr, sizeof(float) * (size_t)(T * v->HK));
    float *d_b = dev_copy(br, sizeof(float) * (size_t)(T * v->H));
    float *d_ga = dev_copy(ga, sizeof(float) * (size_t)(T * v->HK));
    float *d_qkv = dev_alloc(sizeof(float) * (size_t)(T * v->C3));
    float *d_o = dev_alloc(sizeof(float) * (size_t)(T * v->HK));
    void *d_scr = dev_alloc(duet_cuda_kda_scratch_bytes(n, T, v->H, v->K));
    uint16_t *d_ob = ob_h != NULL ? dev_alloc(sizeof(uint16_t) * (size_t)(T * v->HK)) : NULL;
    duet_cuda_step_t st = step_of(d_m, n, T, mx);
    st.item_verify = d_m + 4 * n + 1 + 2 * T;
    st.item_replay = st.item_verify + n;
    st.any_verify = any_v;
    if (any_r)
        CHECK(duet_cuda_kda_replay(NULL, &st, &v->ly) == DUET_OK, "replay: %s", duet_error_last());
    CHECK(duet_cuda_kda_chain(NULL, &st, &v->ly, &v->w, d_p, d_ga, d_qkv, d_g, d_b, d_o, d_ob,
                              d_scr) == DUET_OK,
          "chain: %s", duet_error_last());
    CUDA_OK(cudaDeviceSynchronize());
    if (ob_h != NULL) {
        CUDA_OK(
            cudaMemcpy(ob_h, d_ob, sizeof(uint16_t) * (size_t)(T * v->HK), cudaMemcpyDeviceToHost));
        cudaFree(d_ob);
    }
    if (o_h != NULL)
        CUDA_OK(cudaMemcpy(o_h, d_o, sizeof(float) * (size_t)(T * v->HK), cudaMemcpyDeviceToHost));
    if (qkv_h != NULL)
        CUDA_OK(
            cudaMemcpy(qkv_h, d_qkv, sizeof(float) * (size_t)(T * v->C3), cudaMemcpyDeviceToHost));
    if (g_h != NULL)
        CUDA_OK(cudaMemcpy(g_h, d_g, sizeof(float) * (size_t)(T * v->HK), cudaMemcpyDeviceToHost));
    if (beta_h != NULL)
        CUDA_OK(
            cudaMemcpy(beta_h, d_b, sizeof(float) * (size_t)(T * v->H), cudaMemcpyDeviceToHost));
    cudaFree(d_m), cudaFree(d_p), cudaFree(d_g), cudaFree(d_b), cudaFree(d_ga), cudaFree(d_qkv);
    cudaFree(d_o), cudaFree(d_scr);
    free(m), free(p), free(gr), free(br), free(ga);
}

static void *dev_to_host(const void *d, size_t bytes)
{
    void *h = xmalloc(bytes);
    CUDA_OK(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost));
    return h;
}

/* A verify case of nv verify items of n_ver[i] rows (see vcase_t): random weights, pool (the
 * device's a copy of pool0), stale replay rows (every read row must have been written) and
 * inputs, one KDA layer of H heads of size K, conv width W, 8 replay rows per slot. */
static void vcase_init(vcase_t *v, int64_t H, int64_t K, int64_t W, int nv, const int *n_ver)
{
    *v = (vcase_t){.H = H, .K = K, .W = W, .HK = H * K, .C3 = 3 * H * K, .rows = 8, .nv = nv};
    v->lf = H * K * K + v->C3 * (W - 1), v->RF = 6 * v->HK + H;
    v->n_slots = nv + 3; /* slot 0 and the last stay unused */
    v->pool_f = (size_t)(v->n_slots * v->lf);
    v->rep_f = (size_t)(v->n_slots * v->rows * v->RF);
    v->pool0 = xmalloc(sizeof(float) * v->pool_f);
    fill(v->pool0, v->pool_f, -1.0f, 1.0f);
    v->taps = xmalloc(sizeof(float) * (size_t)(v->C3 * W));
    v->neg_A = xmalloc(sizeof(float) * (size_t)H);
    v->dt_bias = xmalloc(sizeof(float) * (size_t)v->HK);
    v->o_norm = xmalloc(sizeof(float) * (size_t)K);
    fill(v->taps, (size_t)(v->C3 * W), -0.6f, 0.6f);
    for (int64_t h = 0; h < H; h++)
        v->neg_A[h] = -expf(rng_range(-2.0f, 0.5f));
    fill(v->dt_bias, (size_t)v->HK, -1.0f, 1.0f);
    fill(v->o_norm, (size_t)K, 0.5f, 1.5f);
    v->d_taps = dev_copy(v->taps, sizeof(float) * (size_t)(v->C3 * W));
    v->d_neg_A = dev_copy(v->neg_A, sizeof(float) * (size_t)H);
    v->d_dt_bias = dev_copy(v->dt_bias, sizeof(float) * (size_t)v->HK);
    v->d_o_norm = dev_copy(v->o_norm, sizeof(float) * (size_t)K);
    v->w = (duet_cuda_kda_weights_t){.taps = v->d_taps,
                                     .neg_A = v->d_neg_A,
                                     .dt_bias = v->d_dt_bias,
                                     .o_norm = v->d_o_norm,
                                     .eps = 1e-6f};
    v->rep0 = xmalloc(sizeof(float) * v->rep_f);
    fill(v->rep0, v->rep_f, -9.0f, 9.0f);
    v->d_replay = dev_copy(v->rep0, sizeof(float) * v->rep_f);
    v->d_pool = dev_copy(v->pool0, sizeof(float) * v->pool_f);
    v->ly = (duet_cuda_kda_layer_t){.kda_base = v->d_pool,
                                    .kda_n_layers = 1,
                                    .kda_layer_floats = v->lf,
                                    .layer = 0,
                                    .H = H,
                                    .K = K,
                                    .W = W,
                                    .replay_base = v->d_replay,
                                    .replay_rows = v->rows};
    for (int i = 0; i <= nv; i++) {
        v->slot[i] = i + 1;
        v->n_row[i] = i < nv ? n_ver[i] : 1;
        v->in_row[i] = v->total;
        v->verify[i] = i < nv;
        v->total += v->n_row[i];
    }
    const size_t T = (size_t)v->total;
    v->proj = xmalloc(sizeof(float) * T * (size_t)v->C3);
    v->graw = xmalloc(sizeof(float) * T * (size_t)v->HK);
    v->braw = xmalloc(sizeof(float) * T * (size_t)H);
    v->gate = xmalloc(sizeof(float) * T * (size_t)v->HK);
    fill(v->proj, T * (size_t)v->C3, -1.0f, 1.0f);
    fill(v->graw, T * (size_t)v->HK, -4.0f, 2.0f);
    fill(v->braw, T * (size_t)H, -3.0f, 3.0f);
    fill(v->gate, T * (size_t)v->HK, -3.0f, 3.0f);
}

static void vcase_free(vcase_t *v)
{
    free(v->pool0), free(v->rep0), free(v->taps), free(v->neg_A), free(v->dt_bias);
    free(v->o_norm), free(v->proj), free(v->graw), free(v->braw), free(v->gate);
    cudaFree(v->d_pool), cudaFree(v->d_replay), cudaFree(v->d_taps), cudaFree(v->d_neg_A);
    cudaFree(v->d_dt_bias), cudaFree(v->d_o_norm);
}

/* The verify step of v (its verify items beside its decode item) through duet_cuda_kda_chain as
 * one kernel and as the separate kernels (the hook), each from v's pool and replay rows: every
 * output equal bit for bit, o, qkv, g, β, the pool and the replay rows; then both again with ob,
 * the bf16 out rows and o (the core's output) equal. Leaves v's pool and replay rows as they
 * were. On a device with thread-block clusters the first runs must be the verify chain kernel. */
static void verify_fused_vs_separate(vcase_t *v)
{
    const int n = v->nv + 1;
    const int32_t zero[8] = {0};
    const size_t T = (size_t)v->total, nq = T * (size_t)v->C3, ng = T * (size_t)v->HK;
    const size_t nb = T * (size_t)v->H;
    int dev = 0, clusters = 0;
    CUDA_OK(cudaGetDevice(&dev));
    CUDA_OK(cudaDeviceGetAttribute(&clusters, cudaDevAttrClusterLaunch, dev));
    for (int use_ob = 0; use_ob < 2; use_ob++) {
        float *o[2], *qkv[2], *g[2], *b[2], *pool[2], *rep[2];
        uint16_t *ob[2] = {NULL, NULL};
        for (int sep = 0; sep < 2; sep++) {
            CUDA_OK(
                cudaMemcpy(v->d_pool, v->pool0, sizeof(float) * v->pool_f, cudaMemcpyHostToDevice));
            CUDA_OK(
                cudaMemcpy(v->d_replay, v->rep0, sizeof(float) * v->rep_f, cudaMemcpyHostToDevice));
            o[sep] = xmalloc(sizeof(float) * ng), qkv[sep] = xmalloc(sizeof(float) * nq);
            g[sep] = xmalloc(sizeof(float) * ng), b[sep] = xmalloc(sizeof(float) * nb);
            if (use_ob)
                ob[sep] = xmalloc(sizeof(uint16_t) * ng);
            const long before = duet__cuda_kda_verify_chains();
            duet__cuda_kda_fused_off(sep);
            vstep(v, n, v->slot, v->n_row, v->in_row, v->verify, zero, v->proj, v->graw, v->braw,
                  v->gate, o[sep], qkv[sep], g[sep], b[sep], ob[sep]);
            duet__cuda_kda_fused_off(0);
            const long ran = duet__cuda_kda_verify_chains() - before;
            CHECK(ran == (sep == 0 && clusters ? 1 : 0),
                  "the %s step launched %ld verify chain kernels", sep ? "separate" : "fused", ran);
            pool[sep] = dev_to_host(v->d_pool, sizeof(float) * v->pool_f);
            rep[sep] = dev_to_host(v->d_replay, sizeof(float) * v->rep_f);
        }
        const char *what = use_ob ? "verify chain with ob" : "verify chain";
        expect_close(what, "o ~sep", o[0], o[1], ng, TOL_FUSED);
        expect_close(what, "qkv ~sep", qkv[0], qkv[1], nq, TOL_FUSED);
        expect_close(what, "g ~sep", g[0], g[1], ng, TOL_FUSED);
        expect_close(what, "beta ~sep", b[0], b[1], nb, TOL_FUSED);
        CHECK(memcmp(pool[0], pool[1], sizeof(float) * v->pool_f) == 0,
              "%s: the pools differ from the separate kernels'", what);
        CHECK(memcmp(rep[0], rep[1], sizeof(float) * v->rep_f) == 0,
              "%s: the replay rows differ from the separate kernels'", what);
        if (use_ob)
            CHECK(memcmp(ob[0], ob[1], sizeof(uint16_t) * ng) == 0,
                  "%s: the bf16 out rows differ from the separate kernels'", what);
        printf("[cuda_kda] %s H%lld K%lld W%lld, %d verify items: %s equal to the separate "
               "kernels, bit for bit\n",
               what, (long long)v->H, (long long)v->K, (long long)v->W, v->nv,
               clusters ? "one kernel" : "(no clusters: the separate kernels twice)");
        for (int sep = 0; sep < 2; sep++)
            free(o[sep]), free(qkv[sep]), free(g[sep]), free(b[sep]), free(pool[sep]),
                free(rep[sep]), free(ob[sep]);
    }
    CUDA_OK(cudaMemcpy(v->d_pool, v->pool0, sizeof(float) * v->pool_f, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(v->d_replay, v->rep0, sizeof(float) * v->rep_f, cudaMemcpyHostToDevice));
}

/* Verify items of n_ver[0..nv) rows in slots 1..nv and a plain decode item in slot nv+1, then
 * replays of j = 1 and j = all rows, against one-token steps (see above). */
static void verify_case(int64_t H, int64_t K, int64_t W, int nv, const int *n_ver)
{
    vcase_t v;
    vcase_init(&v, H, K, W, nv, n_ver);
    verify_fused_vs_separate(&v);
    const size_t pool_f = v.pool_f, rep_f = v.rep_f;
    const float *pool0 = v.pool0, *proj = v.proj, *graw = v.graw, *braw = v.braw, *gate = v.gate;
    const int32_t *slot = v.slot, *rows = v.n_row, *in_row = v.in_row, total = v.total;
    const int32_t replay[8] = {0};
    float *d_poolA = dev_copy(pool0, sizeof(float) * pool_f); /* A: one-token steps; B: v.d_pool */

    /* B: the verify step */
    float *oB = xmalloc(sizeof(float) * (size_t)(total * v.HK)),
          *qkvB = xmalloc(sizeof(float) * (size_t)(total * v.C3));
    float *gB = xmalloc(sizeof(float) * (size_t)(total * v.HK)),
          *bB = xmalloc(sizeof(float) * (size_t)(total * H));
    vstep(&v, nv + 1, slot, rows, in_row, v.verify, replay, proj, graw, braw, gate, oB, qkvB, gB,
          bB, NULL);
    float *poolB = dev_to_host(v.d_pool, sizeof(float) * pool_f);
    float *repB = dev_to_host(v.d_replay, sizeof(float) * rep_f);
    for (int i = 0; i < nv; i++) { /* committed state and windows untouched */
        const size_t at = (size_t)(slot[i] * v.lf);
        CHECK(memcmp(poolB + at, pool0 + at, sizeof(float) * (size_t)v.lf) == 0,
              "verify item %d changed its committed state", i);
        for (int r = 0; r < rows[i]; r++) { /* replay rows: the inputs and the prepared values */
            const float *row = repB + (slot[i] * v.rows + r) * v.RF;
            const int64_t t = in_row[i] + r;
            CHECK(memcmp(row, proj + t * v.C3, sizeof(float) * (size_t)v.C3) == 0,
                  "replay proj row %d", r);
            CHECK(memcmp(row + 3 * v.HK, qkvB + t * v.C3 + v.HK, sizeof(float) * (size_t)v.HK) == 0,
                  "replay k row %d", r);
            CHECK(memcmp(row + 4 * v.HK, qkvB + t * v.C3 + 2 * v.HK,
                         sizeof(float) * (size_t)v.HK) == 0,
                  "replay v row %d", r);
            CHECK(memcmp(row + 5 * v.HK, gB + t * v.HK, sizeof(float) * (size_t)v.HK) == 0,
                  "replay g row %d", r);
            CHECK(memcmp(row + 6 * v.HK, bB + t * H, sizeof(float) * (size_t)H) == 0,
                  "replay beta row %d", r);
        }
    }

    /* A: every item's rows as one-token steps (pool A), keeping the pool after each step */
    float **after = xmalloc(sizeof(float *) * (size_t)(total + 1));
    float *oA = xmalloc(sizeof(float) * (size_t)(total * v.HK));
    v.ly.kda_base = d_poolA;
    const int32_t one = 1, zero = 0;
    for (int i = 0; i <= nv; i++)
        for (int r = 0; r < rows[i]; r++) {
            const int32_t src = in_row[i] + r;
            vstep(&v, 1, &slot[i], &one, &src, &zero, &zero, proj, graw, braw, gate,
                  oA + (size_t)src * v.HK, NULL, NULL, NULL, NULL);
            after[src] = dev_to_host(d_poolA, sizeof(float) * pool_f);
        }
    expect_close("verify vs one-token steps", "o", oB, oA, (size_t)(total * v.HK), TOL_EXACT);
    /* the decode item beside the verify items went on as usual */
    const size_t dat = (size_t)(slot[nv] * v.lf);
    CHECK(memcmp(poolB + dat, after[in_row[nv]] + dat, sizeof(float) * (size_t)v.lf) == 0,
          "the decode item's state differs from its one-token step's");

    /* replays: j = 1, then (on a fresh copy of B) j = all rows */
    for (int pass = 0; pass < 2; pass++) {
        CUDA_OK(cudaMemcpy(v.d_pool, poolB, sizeof(float) * pool_f, cudaMemcpyHostToDevice));
        v.ly.kda_base = v.d_pool;
        int32_t rep[8] = {0};
        for (int i = 0; i < nv; i++)
            rep[i] = pass == 0 ? 1 : rows[i];
        int32_t zrows[8] = {0}, zv[8] = {0};
        vstep(&v, nv, slot, zrows, in_row, zv, rep, proj, graw, braw, gate, NULL, NULL, NULL, NULL,
              NULL);
        float *got = dev_to_host(v.d_pool, sizeof(float) * pool_f);
        for (int i = 0; i < nv; i++) {
            const size_t at = (size_t)(slot[i] * v.lf);
            const float *want = after[in_row[i] + rep[i] - 1] + at;
            CHECK(memcmp(got + at, want, sizeof(float) * (size_t)(H * K * K)) == 0,
                  "item %d: S after a replay of %d rows differs from %d one-token steps", i, rep[i],
                  rep[i]);
            CHECK(memcmp(got + at + H * K * K, want + H * K * K,
                         sizeof(float) * (size_t)(v.lf - H * K * K)) == 0,
                  "item %d: windows after a replay of %d rows differ", i, rep[i]);
        }
        for (int32_t s2 = 0; s2 < v.n_slots; s2 += v.n_slots - 1) /* unused slots */
            CHECK(memcmp(got + (size_t)(s2 * v.lf), pool0 + (size_t)(s2 * v.lf),
                         sizeof(float) * (size_t)v.lf) == 0,
                  "unused slot %d changed", s2);
        printf("[cuda_kda] verify H%lld K%lld W%lld: replay of %s rows bit-exact\n", (long long)H,
               (long long)K, (long long)W, pass == 0 ? "1" : "all");
        free(got);
    }
    for (int i = 0; i < total; i++)
        free(after[i]);
    free(after), free(oA), free(oB), free(qkvB), free(gB), free(bB), free(poolB), free(repB);
    cudaFree(d_poolA);
    vcase_free(&v);
}

/* ---- verify items and the replay against the CPU backend's kernels ---------------------------
 *
 * The same verify step (verify items beside a plain decode item) through the CPU step kernels
 * (kernels/cpu/cpu_kda.h: conv, prep, core, out, then duet_cpu_kda_replay) and through
 * duet_cuda_kda_chain / duet_cuda_kda_replay, from the same pool and inputs:
 *   - both leave the verify items' committed S and windows as they were (bit for bit);
 *   - the replay rows' pre-conv projections, what the windows are rebuilt from, are equal bit for
 *     bit; their k, v, g, β (after expf, log1pf, sqrtf, which the two libraries round
 *     differently) within TOL_PREP;
 *   - after a replay of 1 and of all rows, the windows are equal bit for bit and S within
 *     TOL_CORE; the decode item's window bit for bit, its S within TOL_CORE; o within TOL_OUT.
 * The tolerances are the ones the CPU-vs-GPU chain tests above use (max |a − b| / max |b|).
 */
static void verify_vs_cpu_case(int64_t H, int64_t K, int64_t W, int nv, const int *n_ver)
{
    vcase_t v;
    vcase_init(&v, H, K, W, nv, n_ver);
    const int64_t HK = v.HK, C3 = v.C3, lf = v.lf, RF = v.RF, SR = v.rows;
    const size_t pool_f = v.pool_f, rep_f = v.rep_f;
    const float *pool0 = v.pool0, *proj = v.proj, *graw = v.graw, *braw = v.braw, *gate = v.gate;
    const int32_t *slot = v.slot, *rows = v.n_row, *in_row = v.in_row, T = v.total;
    const int n = nv + 1;
    const int32_t zero[8] = {0};

    /* the CPU step's view of the batch */
    int64_t row0[9], pos0[8], vf64[8], rep64[8];
    int32_t page = 0;
    const int32_t *pages[8];
    for (int i = 0; i < n; i++) {
        row0[i] = in_row[i];
        pos0[i] = 10; /* as vstep's */
        vf64[i] = 0;
        pages[i] = &page;
    }
    row0[n] = T;

    /* CPU */
    duet_kernels_t *kc = NULL;
    CHECK(duet_kernels_create(DUET_DEVICE_CPU, 2, &kc) == DUET_OK, "kernels: %s",
          duet_error_last());
    float *poolC = xmalloc(sizeof(float) * pool_f), *repC = xmalloc(sizeof(float) * rep_f);
    memcpy(poolC, pool0, sizeof(float) * pool_f);
    memcpy(repC, v.rep0, sizeof(float) * rep_f);
    duet_cpu_kda_layer_t cly = {.kda_base = poolC,
                                .layout = {.n_layers = 1,
                                           .heads = (uint64_t)H,
                                           .head_dim = (uint64_t)K,
                                           .conv_kernel = (uint64_t)W,
                                           .elem_bytes = 4},
                                .layer = 0,
                                .replay_base = repC,
                                .replay = {.n_layers = 1,
                                           .heads = (uint64_t)H,
                                           .head_dim = (uint64_t)K,
                                           .rows = SR,
                                           .elem_bytes = 4}};
    duet_cpu_step_t cst = {.n_items = n,
                           .n_rows = T,
                           .item_row0 = row0,
                           .item_pos0 = pos0,
                           .item_slot = slot,
                           .item_pages = pages,
                           .item_verify = v.verify,
                           .item_replay = vf64};
    int64_t per = duet_cpu_kda_chunk_scratch_floats(K, K);
    if (duet_cpu_kda_verify_scratch_floats(K) > per)
        per = duet_cpu_kda_verify_scratch_floats(K);
    float *scr = xmalloc(sizeof(float) * (size_t)(per * duet_kernels_n_threads(kc)));
    float *qkvC = xmalloc(sizeof(float) * (size_t)(T * C3)),
          *gC = xmalloc(sizeof(float) * (size_t)(T * HK));
    float *bC = xmalloc(sizeof(float) * (size_t)(T * H)),
          *oC = xmalloc(sizeof(float) * (size_t)(T * HK));
    memcpy(gC, graw, sizeof(float) * (size_t)(T * HK));
    memcpy(bC, braw, sizeof(float) * (size_t)(T * H));
    duet_cpu_kda_conv(kc, &cst, &cly, v.taps, proj, qkvC);
    duet_cpu_kda_prep(kc, T, H, K, v.neg_A, v.dt_bias, qkvC, gC, bC);
    duet_cpu_kda_core(kc, &cst, &cly, qkvC, gC, bC, oC, scr, per);
    duet_cpu_kda_out(kc, T, H, K, v.o_norm, v.w.eps, gate, oC);

    /* GPU: the same step */
    float *oG = xmalloc(sizeof(float) * (size_t)(T * HK));
    vstep(&v, n, slot, rows, in_row, v.verify, zero, proj, graw, braw, gate, oG, NULL, NULL, NULL,
          NULL);
    float *poolG = dev_to_host(v.d_pool, sizeof(float) * pool_f);
    float *repG = dev_to_host(v.d_replay, sizeof(float) * rep_f);

    printf("[cuda_kda] verify vs cpu H%lld K%lld W%lld:\n", (long long)H, (long long)K,
           (long long)W);
    expect_close("verify step vs cpu", "o", oG, oC, (size_t)(T * HK), TOL_OUT);
    for (int i = 0; i < nv; i++) {
        const size_t at = (size_t)(slot[i] * lf);
        CHECK(memcmp(poolC + at, pool0 + at, sizeof(float) * (size_t)lf) == 0 &&
                  memcmp(poolG + at, pool0 + at, sizeof(float) * (size_t)lf) == 0,
              "verify item %d: a backend changed its committed state", i);
        for (int r = 0; r < rows[i]; r++) {
            const size_t ro = (size_t)((slot[i] * SR + r) * RF);
            CHECK(memcmp(repG + ro, repC + ro, sizeof(float) * (size_t)C3) == 0,
                  "item %d replay row %d: the pre-conv projections differ", i, r);
            expect_close("replay row vs cpu", "k v g beta", repG + ro + C3, repC + ro + C3,
                         (size_t)(RF - C3), TOL_PREP);
        }
    }
    const size_t dat = (size_t)(slot[nv] * lf);
    expect_close("decode item vs cpu", "S", poolG + dat, poolC + dat, (size_t)(H * K * K),
                 TOL_CORE);
    CHECK(memcmp(poolG + dat + H * K * K, poolC + dat + H * K * K,
                 sizeof(float) * (size_t)(lf - H * K * K)) == 0,
          "the decode item's windows differ from the cpu's");

    /* replays of 1 and of every row, each from the state after the verify step */
    for (int pass = 0; pass < 2; pass++) {
        int32_t rep32[8] = {0}, zrows[8] = {0};
        int64_t zr0[9] = {0};
        for (int i = 0; i < nv; i++)
            rep32[i] = (int32_t)(rep64[i] = pass == 0 ? 1 : rows[i]);
        float *pc = xmalloc(sizeof(float) * pool_f);
        memcpy(pc, poolC, sizeof(float) * pool_f);
        cly.kda_base = pc;
        duet_cpu_step_t rst = {.n_items = nv,
                               .n_rows = 0,
                               .item_row0 = zr0,
                               .item_pos0 = pos0,
                               .item_slot = slot,
                               .item_pages = pages,
                               .item_verify = NULL,
                               .item_replay = rep64};
        duet_cpu_kda_replay(kc, &rst, &cly, scr, per);
        CUDA_OK(cudaMemcpy(v.d_pool, poolG, sizeof(float) * pool_f, cudaMemcpyHostToDevice));
        vstep(&v, nv, slot, zrows, in_row, zero, rep32, proj, graw, braw, gate, NULL, NULL, NULL,
              NULL, NULL);
        float *pg = dev_to_host(v.d_pool, sizeof(float) * pool_f);
        for (int i = 0; i < nv; i++) {
            const size_t at = (size_t)(slot[i] * lf);
            expect_close(pass == 0 ? "replay of 1 row vs cpu" : "replay of all rows vs cpu", "S",
                         pg + at, pc + at, (size_t)(H * K * K), TOL_CORE);
            CHECK(memcmp(pg + at + H * K * K, pc + at + H * K * K,
                         sizeof(float) * (size_t)(lf - H * K * K)) == 0,
                  "item %d: windows after a replay of %d rows differ from the cpu's", i, rep32[i]);
        }
        free(pc), free(pg);
    }
    duet_kernels_destroy(kc);
    free(poolC), free(repC), free(scr), free(qkvC), free(gC), free(bC), free(oC), free(oG);
    free(poolG), free(repG);
    vcase_free(&v);
}

Test(cuda_kda, verify_and_replay_against_the_cpu, .timeout = 120)
{
    skip_without_device();
    const int a[2] = {3, 5}, b[1] = {8}, c[3] = {2, 1, 4};
    verify_vs_cpu_case(2, 64, 4, 2, a);
    verify_vs_cpu_case(4, 128, 4, 1, b);
    verify_vs_cpu_case(3, 48, 8, 3, c);
    verify_vs_cpu_case(2, 32, 1, 2, a);
}

Test(cuda_kda, verify_and_replay_equal_one_token_steps, .timeout = 120)
{
    skip_without_device();
    const int a[2] = {3, 5}, b[1] = {8}, c[3] = {2, 1, 4};
    verify_case(2, 64, 4, 2, a);  /* two verify items and a decode item */
    verify_case(4, 128, 4, 1, b); /* Kimi Linear's head size, the most rows */
    verify_case(3, 48, 8, 3, c);  /* a partial column slice, W = 8, a one-row verify item */
    verify_case(2, 32, 1, 2, a);  /* no conv window */
}
