/*
 * backend_cuda.c: the CUDA backend (the table of engine/backend.h): the forward pass on an NVIDIA
 * GPU, through the kernels of kernels/cuda. The step is the CPU backend's (engine/backend_cpu.c)
 * with the same row layout, kernel for loop:
 *   embed → per layer: RMSNorm → mixer (KDA: 5 GEMMs, conv, prep, core, out-norm, o_proj that
 *   accumulates into the residual; MLA: q / kv_a GEMMs, kv_a norm + page write, per-head
 *   absorbed W_UK (one batched GEMM), paged attention with split-KV, per-head W_UV (batched),
 *   o_proj into the residual) → RMSNorm → FFN (dense MLP, or router GEMM + device routing +
 *   grouped experts + shared expert) → final norm of the logits rows, lm_head, sampling.
 * Residual adds are the GEMMs' accumulate epilogue (β = 1), so no separate add kernel runs.
 * q, k, v projections are one GEMM over a concatenated weight, f_a and g_a another.
 *
 * What lives on the device, allocated once at create: every weight (converted to the compute
 * dtype, F32 or BF16; the MoE router stays fp32 so routing ties resolve as on the CPU), the KV and
 * KDA pools (laid out as the host pools, common/cache_layout.h, with one spare page and one spare
 * state slot beyond the host pools' ids: the padding items of a CUDA-graph batch bucket write
 * there), the step workspace, the GEMM handle and its workspace. The front end's host pools keep
 * doing the bookkeeping (page and slot ids); their memory is only touched as a staging mirror when
 * a worker asks for it (mirror_in: seq_set_filled copies a received sequence host → device;
 * mirror_out: each layer's new KV / state is copied device → host on a copy stream, overlapping
 * the next layer's compute, before the layer hook runs).
 *
 * A pure decode step (every item one token, logits of the last row or a sampled token) runs as a
 * CUDA graph captured once per (batch bucket = next power of two, sampling kind) and replayed
 * with the step's metadata copied in first; other steps are queued kernel by kernel. The MLA
 * split-KV plan is part of the step (computed on the device from the metadata: kernels/splitkv.h),
 * so a graph serves every context length. Every step ends with one stream synchronisation.
 *
 * Speculative decoding (spec_rows > 0): the replay pool lives on the device too. A verify item's
 * rows go through the MLA and FFN layers as a short chunk (split-KV plans items of up to
 * spec_rows rows) and through KDA's verify kernel (cuda_kda.h); the accepted rows of earlier
 * verify items are folded in at the start of a sequence's next step, every KDA layer in one
 * launch, or by seq_replay.
 *
 * In a build without the CUDA backend the table still exists (the front end names it for
 * --device cuda and its dtypes): its probe says why and its create refuses.
 */
#include "engine/backend_cuda.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "engine/backend.h"
#include "engine/sampler.h"

/* Whether this process can run the CUDA backend (backend.h's probe). */
static int duet__cuda_probe(char *why, size_t cap)
{
    if (duet_cuda_device_usable(why, cap))
        return 1;
    return duet_cuda_device_count() > 0 ? -1 : 0;
}

#ifndef DUET_HAVE_CUDA

static duet_status_t duet__cuda_create(const duet_backend_model_t *bm, duet_backend_t **be_p)
{
    (void)bm, (void)be_p;
    return duet_error_set(DUET_ERR_UNSUPPORTED, "this build has no CUDA backend (nvcc was not "
                                                "found when it was configured)");
}

#else /* DUET_HAVE_CUDA */

#include <cuda_runtime_api.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_gemm.h"
#include "kernels/cuda/cuda_kda.h"
#include "kernels/cuda/cuda_mla.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_step.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/splitkv.h"
#include "kernels/tune.h"

#define DUET__MLA_X_MIN_ROWS 256  /* the expanded MLA form: rows per position (duet__mla_x_step) */
#define DUET__MLA_X_SLICE    1024 /* ... positions per expansion GEMM */
#define DUET__MLA_X_CAP      8192 /* ... positions it holds beyond max_batch_tokens (see xcap) */
/* MLA split-KV splits items of at most this many new tokens: decode items, and with speculation
 * verify items (spec_rows, at most DUET_SPLITKV_MAX_ROWS). A prompt chunk of 2 .. 16 tokens is
 * rare, while the partials grow with the rows (16 would take 16 times the memory, about 1 GiB at
 * Kimi Linear's shape on an H200: cuda_mla.h, duet_cuda_mla_scratch_bytes). */
#define DUET__MLA_SPLIT_ROWS 1

/* DUET_CUDA_NO_MLA_X=1 keeps every step on the absorbed MLA form (side-by-side comparisons);
 * the test hooks below override it */
static int duet__no_mla_x = -1, duet__mla_x_force = -1;
static int duet__no_kda_tc = -1; /* DUET_CUDA_NO_KDA_TC=1: the FMA sequential kernel in BF16 too */
static int duet__kda_split = -1; /* DUET_CUDA_KDA_SPLIT=1: split tf32 products in BF16 */
static int duet__mla_x_split = -1; /* DUET_CUDA_MLA_X_SPLIT=1: split products in BF16 too */
static int64_t duet__mla_x_steps, duet__verify_graph_steps, duet__mixed_graph_steps;
static int duet__verify_pad = -2; /* DUET_CUDA_VERIFY_PAD (duet__pad_pays); -2: not read yet */

void duet_backend_cuda_mla_x_set(int on)
{
    duet__mla_x_force = on;
}

int64_t duet_backend_cuda_verify_graph_steps(void)
{
    return duet__verify_graph_steps;
}

int64_t duet_backend_cuda_mixed_graph_steps(void)
{
    return duet__mixed_graph_steps;
}

void duet_backend_cuda_verify_pad_set(int on)
{
    duet__verify_pad = on < 0 ? -1 : on != 0;
}

int64_t duet_backend_cuda_mla_x_steps(void)
{
    return duet__mla_x_steps;
}

#define DUET_CUDA_MAX_GRAPHS 128

typedef struct {
    duet_tensor_t qkv;  /* (3*H*K, D): q | k | v projections */
    duet_tensor_t fg_a; /* (2*K, D): f_a | g_a */
    duet_tensor_t b;    /* (H, D) */
    duet_tensor_t f_b;  /* (H*K, K) */
    duet_tensor_t g_b;  /* (H*K, K) */
    duet_tensor_t o;    /* (D, H*K) */
    float *taps;        /* (3*H*K, W) fp32 */
    float *dt_bias, *neg_A, *o_norm;
} duet__dkda_t;

typedef struct {
    duet_tensor_t q, q_a, q_b; /* q (n*dqk, D) or q_a (ql, D) + q_b (n*dqk, ql) */
    float *q_a_norm;
    duet_tensor_t kv_a; /* (r+dr, D) */
    float *kv_a_norm;
    duet_tensor_t wuk_t; /* (n, r, dn) */
    duet_tensor_t wuv;   /* (n, dv, r) */
    duet_tensor_t wkv;   /* (2*n*128, r): W_UK[h] rows, then wuv's (the expanded form only) */
    duet_tensor_t o;     /* (D, n*dv) */
} duet__dmla_t;

typedef struct {
    duet_tensor_t gu;   /* (2*I, D): gate_proj rows then up_proj rows, one GEMM */
    duet_tensor_t down; /* (D, I) */
} duet__dmlp_t;

typedef struct {
    float *in_norm, *post_norm;
    duet__dkda_t kda;
    duet__dmla_t mla;
    duet__dmlp_t mlp; /* dense FFN, or the shared expert of a MoE layer */
    int has_shared;
    duet_tensor_t router;    /* (E, D) fp32 */
    duet_tensor_t router_bf; /* the same as BF16 when every value is a bf16 value, else no data:
                              * the prefill router's split form (cuda_gemm.h, w_bf16) */
    float *router_bias;
    duet_cuda_experts_t ex;
} duet__dlayer_t;

typedef struct {
    int bucket, sampled;
    int rows; /* 1: a decode graph; else a verify graph's verify items' rows (verify items have 2..)
               */
    int plain; /* a verify graph's one-row plain items */
    cudaGraphExec_t exec;
} duet__graph_t;

/* Offsets (in int32 units) of the step metadata inside its one host / device block. */
typedef struct {
    size_t item_row0, item_pos0, item_slot, item_pages, item_verify, item_replay, row_item, row_pos,
        tokens, logit_rows, params, total;
} duet__meta_layout_t;

typedef struct duet_cuda_model duet_cuda_model_t;

struct duet_cuda_model {
    duet_backend_t base;
    duet_backend_model_t bm; /* what it was created from (front-end pointers) */
    duet_model_config_t cfg;
    duet_model_opts_t opts;
    duet_dtype_t wdt; /* compute dtype of the weights */
    int64_t layer_sub[DUET_MAX_LAYERS];
    cudaStream_t stream, copy_stream;
    cudaEvent_t *layer_done, *copy_done; /* [num_layers] for mirror_out */
    duet_cuda_gemm_t *gemm;
    unsigned gemm_flags;
    duet_tune_t *tuner; /* opts.tune: the GEMM's chosen cuBLASLt algorithms (gemm reads it) */
    int64_t tune_m[DUET_TUNE_M_BUCKETS]; /* the M profiled for each bucket (duet__cuda_tune) */
    int64_t tune_head_rows;              /* ... at most this many for lm_head's shape */
    int n_sms;

    /* allocations, freed in reverse at destroy */
    void **allocs;
    int64_t n_allocs, cap_allocs;
    size_t dev_bytes;

    duet_tensor_t embed, lm_head;
    float *final_norm;
    duet__dlayer_t *layers;

    /* pools: the host pools' layouts (common/cache_layout.h), which the device pools share */
    duet_kv_pool_t *kv_host;
    duet_kda_pool_t *kda_host;
    duet_kv_layout_t kv_layout;
    duet_kda_layout_t kda_layout;
    void *kv_dev;
    size_t kv_dev_bytes, kv_page_bytes, kv_token_bytes;
    int64_t kv_spare_page;
    float *kda_dev;
    size_t kda_dev_bytes, kda_slot_bytes;
    int64_t kda_layer_floats;
    int32_t kda_spare_slot;
    int64_t max_pages;
    /* the KDA replay pool (speculative decoding): the host pool's layout, on the device */
    duet_replay_pool_t *replay_host;
    float *replay_dev;
    size_t replay_dev_bytes, replay_slot_bytes;
    int64_t replay_rows;
    int64_t
        split_rows; /* MLA split-KV splits items of at most this many rows (DUET__MLA_SPLIT_ROWS) */

    /* workspace (fp32 unless said) */
    int64_t T, imax_items, logit_rows_cap;
    float *x, *xn, *proj, *qkv, *fg, *gk, *beta, *gate, *o, *mq, *mqa, *ckr, *qhat, *lat, *f1,
        *router, *topk_w, *logits;
    int32_t *topk_idx, *token_out;
    int *route_sync;      /* duet_cuda_moe_router_route's (DUET_CUDA_ROUTER_SYNC_INTS(E)) */
    int32_t *token_out_h; /* pinned */
    void *kda_scratch, *mla_scratch, *moe_scratch, *sample_scratch, *argmax_scratch;
    void *xsplit; /* [3][T][D] bf16: xn's planes for the router's split form (NULL: none) */
    size_t mla_scratch_bytes;
    /* the expanded MLA form for long prefill chunks (duet__mla_x_step): on when the shapes
     * allow it; xkv holds xcap positions of every head = max(T, min(max_seq_len,
     * DUET__MLA_X_CAP)), so chunks after the first of a prompt up to 8K positions take it too
     * (302 MB at Kimi-Linear-48B's 32 heads); xgath / xkvb hold one slice of the expansion */
    int mla_x;
    /* the expanded attention's products (duet_cuda_mla_attend_x's prec): the compute dtype,
     * unless DUET_CUDA_MLA_X_SPLIT=1 asks for the split (F32) ones under BF16 */
    duet_dtype_t mla_x_prec;
    /* how KDA's chunked core multiplies (duet_cuda_kda_layer_t.tc): FMA for F32 compute, one
     * tf32 term for BF16 unless DUET_CUDA_KDA_SPLIT=1 (split) or DUET_CUDA_NO_KDA_TC=1 (FMA) */
    duet_cuda_kda_tc_t kda_tc;
    int64_t xcap, xslice; /* xslice <= T: the GEMM's staging holds T rows of x */
    void *xkv;
    float *xgath, *xkvb;
    int64_t *xctx; /* host [max_seqs]: the step's items' contexts when it takes the form */

    /* step metadata: pinned host block → device block, one copy per step */
    duet__meta_layout_t ml;
    int32_t *meta_h, *meta_d;
    duet_cuda_step_t step; /* device pointers into meta_d; counts set per step */

    duet__graph_t graphs[DUET_CUDA_MAX_GRAPHS];
    int n_graphs;
    int mirrored; /* host pools registered as pinned memory */
};

/* ---- errors and allocation ---------------------------------------------------------------- */

static duet_status_t duet__cu(cudaError_t e, const char *what)
{
    return duet_cuda_status(e, "cuda model", what);
}

#define TRY(expr)      DUET_TRY(expr)
#define CU(call, what) TRY(duet__cu((call), (what)))

static duet_status_t duet__dalloc(duet_cuda_model_t *dm, size_t bytes, void **p)
{
    if (bytes == 0)
        bytes = 16;
    if (dm->n_allocs == dm->cap_allocs) {
        int64_t cap = dm->cap_allocs ? dm->cap_allocs * 2 : 256;
        void **a = realloc(dm->allocs, sizeof(void *) * (size_t)cap);
        if (a == NULL)
            return duet_error_set(DUET_ERR_NOMEM, "cuda model: out of host memory");
        dm->allocs = a;
        dm->cap_allocs = cap;
    }
    cudaError_t e = cudaMalloc(p, bytes);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return duet_error_set(DUET_ERR_NOMEM,
                              "cuda model: cannot allocate %.1f MiB of device memory (%.1f GiB "
                              "held so far): %s",
                              (double)bytes / 1048576.0, (double)dm->dev_bytes / 1073741824.0,
                              cudaGetErrorString(e));
    }
    dm->allocs[dm->n_allocs++] = *p;
    dm->dev_bytes += bytes;
    return DUET_OK;
}

static duet_status_t duet__dalloc_f(duet_cuda_model_t *dm, int64_t n, float **p)
{
    return duet__dalloc(dm, sizeof(float) * (size_t)(n > 0 ? n : 1), (void **)p);
}

/* Byte offsets into the KV / KDA pools, the same on the host and the device (the layout of
 * common/cache_layout.h; the pools' sizes were checked when the host pools were made). */
static size_t duet__kv_off(const duet_cuda_model_t *dm, int64_t page, int64_t layer, int64_t slot)
{
    uint64_t off = 0;
    (void)duet_kv_layout_offset(&dm->kv_layout, (uint64_t)page, (uint64_t)layer, (uint64_t)slot,
                                &off);
    return (size_t)off;
}

static size_t duet__kda_off(const duet_cuda_model_t *dm, int64_t slot, int64_t layer)
{
    uint64_t off = 0;
    (void)duet_kda_layout_state_offset(&dm->kda_layout, (uint64_t)slot, (uint64_t)layer, 0, &off);
    return (size_t)off;
}

/* ---- weights -------------------------------------------------------------------------------- */

/* A device tensor of `dt` with the given shape, allocated. */
static duet_status_t duet__dtensor(duet_cuda_model_t *dm, duet_dtype_t dt, int ndim,
                                   const int64_t *shape, duet_tensor_t *t)
{
    memset(t, 0, sizeof(*t));
    t->dtype = dt;
    t->device = DUET_DEVICE_CUDA;
    t->ndim = ndim;
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        t->shape[i] = shape[i];
        n *= shape[i];
    }
    return duet__dalloc(dm, (size_t)n * duet_dtype_size(dt), &t->data);
}

/* Copy n host fp32 values into device memory of dtype dt at element offset `at`. */
static duet_status_t duet__upload_f32(void *dst, duet_dtype_t dt, int64_t at, const float *src,
                                      int64_t n)
{
    size_t es = duet_dtype_size(dt);
    void *buf = (void *)src;
    if (dt != DUET_DTYPE_F32) {
        buf = malloc((size_t)n * es);
        if (buf == NULL)
            return duet_error_set(DUET_ERR_NOMEM, "cuda model: out of host memory");
        uint16_t *h = buf;
        for (int64_t i = 0; i < n; i++)
            h[i] = dt == DUET_DTYPE_BF16 ? duet_f32_to_bf16(src[i]) : duet_f32_to_f16(src[i]);
    }
    cudaError_t e =
        cudaMemcpy((uint8_t *)dst + (size_t)at * es, buf, (size_t)n * es, cudaMemcpyHostToDevice);
    if (buf != src)
        free(buf);
    return duet__cu(e, "weight upload");
}

/* Rows of a host tensor (any dtype) to fp32, then into dst at element offset `at`. */
static duet_status_t duet__upload_tensor(void *dst, duet_dtype_t dt, int64_t at,
                                         const duet_tensor_t *src)
{
    int64_t n = duet_tensor_numel(src);
    if (src->dtype == dt) { /* stored as computed: no conversion */
        size_t es = duet_dtype_size(dt);
        return duet__cu(cudaMemcpy((uint8_t *)dst + (size_t)at * es, src->data, (size_t)n * es,
                                   cudaMemcpyHostToDevice),
                        "weight upload");
    }
    float *f = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    if (f == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "cuda model: out of host memory");
    duet_convert_to_f32(f, src->data, src->dtype, n);
    duet_status_t st = duet__upload_f32(dst, dt, at, f, n);
    free(f);
    return st;
}

/*
 * A device weight built from host tensors stacked along rows (srcs[i] are [rows_i][cols]), or,
 * with w == NULL, filled with uniform(-a, a), a = sqrt(3 / cols) (unit-variance outputs).
 */
static duet_status_t duet__weight(duet_cuda_model_t *dm, int from_host, duet_dtype_t dt,
                                  const duet_tensor_t *const *srcs, int n_src, int64_t rows,
                                  int64_t cols, uint64_t *seed, duet_tensor_t *t)
{
    int64_t shape[2] = {rows, cols};
    TRY(duet__dtensor(dm, dt, 2, shape, t));
    if (!from_host)
        return duet_cuda_fill_random(dm->stream, t->data, dt, rows * cols, (*seed)++,
                                     sqrtf(3.0f / (float)cols), 0.0f);
    int64_t at = 0;
    for (int i = 0; i < n_src; i++) {
        TRY(duet__upload_tensor(t->data, dt, at, srcs[i]));
        at += duet_tensor_numel(srcs[i]);
    }
    if (at != rows * cols)
        return duet_error_set(DUET_ERR_INVALID,
                              "cuda model: weight of %lld values for a %lld x "
                              "%lld matrix",
                              (long long)at, (long long)rows, (long long)cols);
    return DUET_OK;
}

/* Whether every value of host tensor t is a bf16 value (BF16, or F32 with its low 16 bits 0). */
static int duet__bf16_valued(const duet_tensor_t *t)
{
    if (t == NULL || t->data == NULL)
        return 0;
    if (t->dtype == DUET_DTYPE_BF16)
        return 1;
    if (t->dtype != DUET_DTYPE_F32)
        return 0;
    const uint32_t *u = t->data;
    const int64_t n = duet_tensor_numel(t);
    for (int64_t i = 0; i < n; i++)
        if (u[i] & 0xffffu)
            return 0;
    return 1;
}

/* An fp32 vector: from host fp32 values, from a host tensor, or constant / random. */
static duet_status_t duet__vec(duet_cuda_model_t *dm, const float *host_f32,
                               const duet_tensor_t *host_t, int64_t n, uint64_t *seed, float scale,
                               float offset, float **p)
{
    TRY(duet__dalloc_f(dm, n, p));
    if (host_f32 != NULL)
        return duet__upload_f32(*p, DUET_DTYPE_F32, 0, host_f32, n);
    if (host_t != NULL && host_t->data != NULL)
        return duet__upload_tensor(*p, DUET_DTYPE_F32, 0, host_t);
    return duet_cuda_fill_random(dm->stream, *p, DUET_DTYPE_F32, n, (*seed)++, scale, offset);
}

static duet_status_t duet__mlp_weights(duet_cuda_model_t *dm, const duet_mlp_weights_t *hw,
                                       int64_t I, uint64_t *seed, duet__dmlp_t *d)
{
    const int64_t D = dm->cfg.hidden_size;
    const duet_tensor_t *gu[2] = {hw ? &hw->gate_proj : NULL, hw ? &hw->up_proj : NULL};
    const duet_tensor_t *dn = hw ? &hw->down_proj : NULL;
    TRY(duet__weight(dm, hw != NULL, dm->wdt, gu, 2, 2 * I, D, seed, &d->gu));
    return duet__weight(dm, hw != NULL, dm->wdt, &dn, 1, D, I, seed, &d->down);
}

static duet_status_t duet__layer_weights(duet_cuda_model_t *dm, int64_t l, const duet_weights_t *w,
                                         const duet_backend_f32_t *f32, uint64_t *seed)
{
    const duet_model_config_t *c = &dm->cfg;
    const duet_layer_weights_t *lw = w != NULL ? &w->layers[l] : NULL;
    const duet_backend_f32_t *lf = f32 != NULL ? &f32[l] : NULL;
    duet__dlayer_t *d = &dm->layers[l];
    const int64_t D = c->hidden_size, H = c->kda_heads, K = c->kda_head_dim, HK = H * K;
    const int fh = w != NULL;

    TRY(duet__vec(dm, NULL, lw ? &lw->input_layernorm : NULL, D, seed, 0.0f, 1.0f, &d->in_norm));
    TRY(duet__vec(dm, NULL, lw ? &lw->post_attention_layernorm : NULL, D, seed, 0.0f, 1.0f,
                  &d->post_norm));
    if (c->mixer[l] == DUET_MIXER_KDA) {
        const duet_kda_weights_t *kw = lw ? &lw->kda : NULL;
        duet__dkda_t *k = &d->kda;
        const duet_tensor_t *qkv[3] = {kw ? &kw->q_proj : NULL, kw ? &kw->k_proj : NULL,
                                       kw ? &kw->v_proj : NULL};
        const duet_tensor_t *fga[2] = {kw ? &kw->f_a_proj : NULL, kw ? &kw->g_a_proj : NULL};
        const duet_tensor_t *b = kw ? &kw->b_proj : NULL, *fb = kw ? &kw->f_b_proj : NULL,
                            *gb = kw ? &kw->g_b_proj : NULL, *o = kw ? &kw->o_proj : NULL;
        TRY(duet__weight(dm, fh, dm->wdt, qkv, 3, 3 * HK, D, seed, &k->qkv));
        TRY(duet__weight(dm, fh, dm->wdt, fga, 2, 2 * K, D, seed, &k->fg_a));
        TRY(duet__weight(dm, fh, dm->wdt, &b, 1, H, D, seed, &k->b));
        TRY(duet__weight(dm, fh, dm->wdt, &fb, 1, HK, K, seed, &k->f_b));
        TRY(duet__weight(dm, fh, dm->wdt, &gb, 1, HK, K, seed, &k->g_b));
        TRY(duet__weight(dm, fh, dm->wdt, &o, 1, D, HK, seed, &k->o));
        TRY(duet__vec(dm, lf ? lf->conv_w : NULL, NULL, 3 * HK * c->conv_kernel, seed, 0.5f, 0.0f,
                      &k->taps));
        TRY(duet__vec(dm, lf ? lf->dt_bias : NULL, NULL, HK, seed, 0.5f, 0.0f, &k->dt_bias));
        TRY(duet__vec(dm, lf ? lf->neg_A : NULL, NULL, H, seed, 0.5f, -1.0f, &k->neg_A));
        TRY(duet__vec(dm, lf ? lf->o_norm : NULL, NULL, K, seed, 0.0f, 1.0f, &k->o_norm));
    } else {
        const duet_mla_weights_t *mw = lw ? &lw->mla : NULL;
        duet__dmla_t *m = &dm->layers[l].mla;
        const int64_t n = c->mla_heads, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim,
                      dv = c->v_head_dim, r = c->kv_lora_rank, dqk = dn + dr;
        if (c->q_lora_rank > 0) {
            const duet_tensor_t *qa = mw ? &mw->q_a_proj : NULL, *qb = mw ? &mw->q_b_proj : NULL;
            TRY(duet__weight(dm, fh, dm->wdt, &qa, 1, c->q_lora_rank, D, seed, &m->q_a));
            TRY(duet__weight(dm, fh, dm->wdt, &qb, 1, n * dqk, c->q_lora_rank, seed, &m->q_b));
            TRY(duet__vec(dm, NULL, mw ? &mw->q_a_layernorm : NULL, c->q_lora_rank, seed, 0.0f,
                          1.0f, &m->q_a_norm));
        } else {
            const duet_tensor_t *q = mw ? &mw->q_proj : NULL;
            TRY(duet__weight(dm, fh, dm->wdt, &q, 1, n * dqk, D, seed, &m->q));
        }
        const duet_tensor_t *kva = mw ? &mw->kv_a_proj_with_mqa : NULL,
                            *o = mw ? &mw->o_proj : NULL;
        TRY(duet__weight(dm, fh, dm->wdt, &kva, 1, r + dr, D, seed, &m->kv_a));
        TRY(duet__vec(dm, NULL, mw ? &mw->kv_a_layernorm : NULL, r, seed, 0.0f, 1.0f,
                      &m->kv_a_norm));
        TRY(duet__weight(dm, fh, dm->wdt, &o, 1, D, n * dv, seed, &m->o));
        int64_t s_uk[3] = {n, r, dn}, s_uv[3] = {n, dv, r};
        TRY(duet__dtensor(dm, dm->wdt, 3, s_uk, &m->wuk_t));
        TRY(duet__dtensor(dm, dm->wdt, 3, s_uv, &m->wuv));
        if (!fh) {
            TRY(duet_cuda_fill_random(dm->stream, m->wuk_t.data, dm->wdt, n * r * dn, (*seed)++,
                                      sqrtf(3.0f / (float)dn), 0.0f));
            TRY(duet_cuda_fill_random(dm->stream, m->wuv.data, dm->wdt, n * dv * r, (*seed)++,
                                      sqrtf(3.0f / (float)r), 0.0f));
        } else {
            TRY(duet__upload_f32(m->wuk_t.data, dm->wdt, 0, lf->wuk_t, n * r * dn));
            /* W_UV[h] = rows h*(dn+dv)+dn .. +dv of kv_b_proj (n*(dn+dv), r) */
            const duet_tensor_t *kvb = &mw->kv_b_proj;
            float *f = malloc(sizeof(float) * (size_t)(n * (dn + dv) * r));
            float *g = malloc(sizeof(float) * (size_t)(n * dv * r));
            if (f == NULL || g == NULL) {
                free(f);
                free(g);
                return duet_error_set(DUET_ERR_NOMEM, "cuda model: out of host memory");
            }
            duet_convert_to_f32(f, kvb->data, kvb->dtype, n * (dn + dv) * r);
            for (int64_t h = 0; h < n; h++)
                memcpy(g + h * dv * r, f + (h * (dn + dv) + dn) * r,
                       sizeof(float) * (size_t)(dv * r));
            duet_status_t st = duet__upload_f32(m->wuv.data, dm->wdt, 0, g, n * dv * r);
            free(f);
            free(g);
            TRY(st);
        }
        if (dm->mla_x) {
            int64_t s_kv[2] = {2 * n * dn, r};
            TRY(duet__dtensor(dm, dm->wdt, 2, s_kv, &m->wkv));
            TRY(duet_cuda_mla_x_weights(dm->stream, dm->wdt, m->wuk_t.data, m->wuv.data, n, r,
                                        m->wkv.data));
        }
    }
    if (c->ffn[l] == DUET_FFN_MOE) {
        const duet_moe_weights_t *mw = lw ? &lw->moe : NULL;
        const int64_t E = c->n_experts, I = c->moe_intermediate;
        const duet_tensor_t *rg = mw ? &mw->gate : NULL;
        TRY(duet__weight(dm, fh, DUET_DTYPE_F32, &rg, 1, E, D, seed, &d->router));
        /* The checkpoints store the router in bf16 (and random weights mirror them): its values
         * are then bf16 values, which the prefill router multiplies on the tensor cores, where
         * the workspace has room for the split x (duet__alloc_workspace). */
        if (!fh)
            TRY(duet_cuda_round_bf16(dm->stream, d->router.data, E * D));
        if ((!fh || duet__bf16_valued(rg)) && duet_cuda_gemm_split_pays(dm->T, D, 0)) {
            int64_t s_r[2] = {E, D};
            TRY(duet__dtensor(dm, DUET_DTYPE_BF16, 2, s_r, &d->router_bf));
            TRY(duet_cuda_convert_from_f32(d->router_bf.data, DUET_DTYPE_BF16, d->router.data, D, E,
                                           D, dm->stream));
        }
        TRY(duet__vec(dm, lf ? lf->moe_bias : NULL, NULL, E, seed, 0.0f, 0.0f, &d->router_bias));
        /* experts contiguous: w1, w3 [E][I][D], w2 [E][D][I] */
        duet_tensor_t t1, t3, t2;
        int64_t s13[3] = {E, I, D}, s2[3] = {E, D, I};
        TRY(duet__dtensor(dm, dm->wdt, 3, s13, &t1));
        TRY(duet__dtensor(dm, dm->wdt, 3, s13, &t3));
        TRY(duet__dtensor(dm, dm->wdt, 3, s2, &t2));
        if (fh) {
            for (int64_t e = 0; e < E; e++) {
                TRY(duet__upload_tensor(t1.data, dm->wdt, e * I * D, &mw->w1[e]));
                TRY(duet__upload_tensor(t3.data, dm->wdt, e * I * D, &mw->w3[e]));
                TRY(duet__upload_tensor(t2.data, dm->wdt, e * D * I, &mw->w2[e]));
            }
        } else {
            TRY(duet_cuda_fill_random(dm->stream, t1.data, dm->wdt, E * I * D, (*seed)++,
                                      sqrtf(3.0f / (float)D), 0.0f));
            TRY(duet_cuda_fill_random(dm->stream, t3.data, dm->wdt, E * I * D, (*seed)++,
                                      sqrtf(3.0f / (float)D), 0.0f));
            TRY(duet_cuda_fill_random(dm->stream, t2.data, dm->wdt, E * D * I, (*seed)++,
                                      sqrtf(3.0f / (float)I), 0.0f));
        }
        d->ex = (duet_cuda_experts_t){
            .w1 = t1.data, .w3 = t3.data, .w2 = t2.data, .dtype = dm->wdt, .E = E, .I = I, .D = D};
        if (c->n_shared_experts > 0) {
            d->has_shared = 1;
            TRY(duet__mlp_weights(dm, mw ? &mw->shared : NULL, I * c->n_shared_experts, seed,
                                  &d->mlp));
        }
    } else {
        TRY(duet__mlp_weights(dm, lw ? &lw->mlp : NULL, c->dense_intermediate, seed, &d->mlp));
    }
    return DUET_OK;
}

/* ---- create -----------------------------------------------------------------------------------
 */

static int64_t duet__pow2_at_least(int64_t n)
{
    int64_t p = 1;
    while (p < n)
        p *= 2;
    return p;
}

/* MLA layer `sub` (its index among the MLA layers) as the attention kernels see it. */
static duet_cuda_mla_layer_t duet__mla_ly(const duet_cuda_model_t *dm, int64_t sub)
{
    const duet_model_config_t *c = &dm->cfg;
    return (duet_cuda_mla_layer_t){.kv_base = dm->kv_dev,
                                   .kv_dtype = duet_kv_pool_desc(dm->kv_host)->dtype,
                                   .kv_n_layers = c->n_mla_layers,
                                   .page_tokens = dm->opts.page_tokens,
                                   .layer = sub,
                                   .n_heads = c->mla_heads,
                                   .r = c->kv_lora_rank,
                                   .dr = c->qk_rope_head_dim};
}

static duet_status_t duet__alloc_workspace(duet_cuda_model_t *dm)
{
    const duet_model_config_t *c = &dm->cfg;
    const int64_t T = dm->T, D = c->hidden_size, H = c->kda_heads, K = c->kda_head_dim, HK = H * K,
                  n = c->mla_heads, dqk = c->qk_nope_head_dim + c->qk_rope_head_dim,
                  r = c->kv_lora_rank, dr = c->qk_rope_head_dim, V = c->vocab_size;
    const int has_kda = c->n_kda_layers > 0, has_mla = c->n_mla_layers > 0;
    int64_t imax = c->dense_intermediate;
    if (c->n_moe_layers > 0 && c->moe_intermediate * c->n_shared_experts > imax)
        imax = c->moe_intermediate * c->n_shared_experts;
    const int64_t omax = (has_kda && HK > n * c->v_head_dim) || !has_mla ? HK : n * c->v_head_dim;
    const int64_t E = c->n_experts > 0 ? c->n_experts : 1, TK = c->top_k > 0 ? c->top_k : 1;

    TRY(duet__dalloc_f(dm, T * D, &dm->x));
    TRY(duet__dalloc_f(dm, T * D, &dm->xn));
    if (has_kda) {
        TRY(duet__dalloc_f(dm, T * 3 * HK, &dm->proj));
        TRY(duet__dalloc_f(dm, T * 3 * HK, &dm->qkv));
        TRY(duet__dalloc_f(dm, T * 2 * K, &dm->fg));
        TRY(duet__dalloc_f(dm, T * HK, &dm->gk));
        TRY(duet__dalloc_f(dm, T * H, &dm->beta));
        TRY(duet__dalloc_f(dm, T * HK, &dm->gate));
        TRY(duet__dalloc(dm, duet_cuda_kda_scratch_bytes(dm->imax_items, T, H, K),
                         &dm->kda_scratch));
    }
    TRY(duet__dalloc_f(dm, T * omax, &dm->o));
    if (has_mla) {
        TRY(duet__dalloc_f(dm, T * n * dqk, &dm->mq));
        if (c->q_lora_rank > 0)
            TRY(duet__dalloc_f(dm, T * c->q_lora_rank, &dm->mqa));
        TRY(duet__dalloc_f(dm, T * (r + dr), &dm->ckr));
        TRY(duet__dalloc_f(dm, T * n * r, &dm->qhat));
        TRY(duet__dalloc_f(dm, T * n * r, &dm->lat));
        /* the split-KV plan and partials of any step (a graph bucket's included: sized once,
         * so replays never reallocate); only one-token items are split (duet__cuda_forward) */
        const duet_cuda_mla_layer_t ly = duet__mla_ly(dm, 0);
        dm->mla_scratch_bytes = duet_cuda_mla_scratch_bytes(
            &ly, dm->imax_items, T > dm->imax_items ? T : dm->imax_items, dm->split_rows);
        TRY(duet__dalloc(dm, dm->mla_scratch_bytes, &dm->mla_scratch));
        if (dm->mla_x) {
            const int64_t sl = T < DUET__MLA_X_SLICE ? T : DUET__MLA_X_SLICE;
            dm->xslice = sl;
            dm->xctx = calloc((size_t)dm->opts.max_seqs, sizeof(int64_t));
            if (dm->xctx == NULL)
                return duet_error_set(DUET_ERR_NOMEM, "cuda model: out of host memory");
            TRY(duet__dalloc(dm, duet_cuda_mla_x_bytes(dm->xcap, n), &dm->xkv));
            TRY(duet__dalloc_f(dm, sl * (r + dr), &dm->xgath));
            TRY(duet__dalloc_f(dm, sl * 2 * n * c->v_head_dim, &dm->xkvb));
        }
    }
    TRY(duet__dalloc_f(dm, T * 2 * imax, &dm->f1)); /* [T][gate | up] */
    if (c->n_moe_layers > 0) {
        TRY(duet__dalloc_f(dm, T * E, &dm->router));
        TRY(duet__dalloc_f(dm, T * TK, &dm->topk_w));
        TRY(duet__dalloc(dm, sizeof(int32_t) * (size_t)(T * TK), (void **)&dm->topk_idx));
        const size_t sync_bytes = sizeof(int) * (size_t)DUET_CUDA_ROUTER_SYNC_INTS(E);
        TRY(duet__dalloc(dm, sync_bytes, (void **)&dm->route_sync));
        /* on the model's stream, which does not wait for the legacy one */
        CU(cudaMemsetAsync(dm->route_sync, 0, sync_bytes, dm->stream), "router sync");
        TRY(duet__dalloc(dm, duet_cuda_moe_scratch_bytes(T, TK, E, c->moe_intermediate, D),
                         &dm->moe_scratch));
        if (duet_cuda_gemm_split_pays(T, D, 0)) /* the router's split x (duet__moe_layer) */
            TRY(duet__dalloc(dm, 3 * sizeof(uint16_t) * (size_t)(T * D), &dm->xsplit));
    }
    /* logits: as many rows as fit in 1 GiB, at least one per sequence of a bucket */
    int64_t cap = ((int64_t)1 << 28) / (V > 0 ? V : 1);
    if (dm->opts.logit_rows_cap > 0 && dm->opts.logit_rows_cap < cap)
        cap = dm->opts.logit_rows_cap;
    if (cap < dm->imax_items)
        cap = dm->imax_items;
    if (cap > T)
        cap = T > dm->imax_items ? T : dm->imax_items;
    dm->logit_rows_cap = cap;
    TRY(duet__dalloc_f(dm, cap * V, &dm->logits));
    TRY(duet__dalloc(dm, duet_cuda_sample_scratch_bytes(dm->imax_items, V), &dm->sample_scratch));
    TRY(duet__dalloc(dm, duet_cuda_argmax_scratch_bytes(cap < 65535 ? cap : 65535),
                     &dm->argmax_scratch));
    /* one token slot per logits row a step can have (T rows + a bucket's padding) */
    TRY(duet__dalloc(dm, sizeof(int32_t) * (size_t)(T + dm->imax_items), (void **)&dm->token_out));
    CU(cudaMallocHost((void **)&dm->token_out_h, sizeof(int32_t) * (size_t)(T + dm->imax_items)),
       "pinned token buffer");

    /* metadata block */
    duet__meta_layout_t *ml = &dm->ml;
    const int64_t I = dm->imax_items;
    size_t at = 0;
#define DUET__META(field, n_i32)                                                                   \
    do {                                                                                           \
        ml->field = at;                                                                            \
        at += ((size_t)(n_i32) + 31) / 32 * 32; /* 128-byte aligned parts */                       \
    } while (0)
    DUET__META(item_row0, I + 1);
    DUET__META(item_pos0, I);
    DUET__META(item_slot, I);
    DUET__META(item_verify, I);
    DUET__META(item_replay, I);
    DUET__META(row_item, T + I);
    DUET__META(row_pos, T + I);
    DUET__META(tokens, T + I);
    DUET__META(logit_rows, T + I);
    DUET__META(params, (T + I) * (sizeof(duet_cuda_sample_params_t) / sizeof(int32_t)));
    DUET__META(item_pages, I * (dm->max_pages > 0 ? dm->max_pages : 1));
#undef DUET__META
    ml->total = at;
    CU(cudaMallocHost((void **)&dm->meta_h, sizeof(int32_t) * at), "pinned metadata");
    memset(dm->meta_h, 0, sizeof(int32_t) * at);
    TRY(duet__dalloc(dm, sizeof(int32_t) * at, (void **)&dm->meta_d));
    dm->step.item_row0 = dm->meta_d + ml->item_row0;
    dm->step.item_pos0 = dm->meta_d + ml->item_pos0;
    dm->step.item_slot = dm->meta_d + ml->item_slot;
    dm->step.item_pages = dm->meta_d + ml->item_pages;
    dm->step.max_pages = (int32_t)(dm->max_pages > 0 ? dm->max_pages : 1);
    dm->step.row_item = dm->meta_d + ml->row_item;
    dm->step.row_pos = dm->meta_d + ml->row_pos;
    if (dm->replay_host != NULL) {
        dm->step.item_verify = dm->meta_d + ml->item_verify;
        dm->step.item_replay = dm->meta_d + ml->item_replay;
    }
    return DUET_OK;
}

static duet_status_t duet__create_pools(duet_cuda_model_t *dm)
{
    if (dm->kv_host != NULL) {
        const duet_kv_pool_desc_t *kd = duet_kv_pool_desc(dm->kv_host);
        uint64_t page = 0;
        dm->kv_layout = duet_kv_pool_layout(dm->kv_host);
        (void)duet_kv_layout_page_bytes(&dm->kv_layout, &page); /* the host pool's, bounded */
        dm->kv_token_bytes = (size_t)dm->kv_layout.token_bytes;
        dm->kv_page_bytes = (size_t)page;
        dm->kv_spare_page = kd->n_pages;
        dm->kv_dev_bytes = dm->kv_page_bytes * (size_t)(kd->n_pages + 1);
        TRY(duet__dalloc(dm, dm->kv_dev_bytes, &dm->kv_dev));
        CU(cudaMemsetAsync(dm->kv_dev, 0, dm->kv_dev_bytes, dm->stream), "zero KV pool");
    }
    if (dm->kda_host != NULL) {
        const duet_kda_pool_desc_t *sd = duet_kda_pool_desc(dm->kda_host);
        uint64_t layer = 0, slot = 0;
        dm->kda_layout = duet_kda_pool_layout(dm->kda_host);
        (void)duet_kda_layout_layer_bytes(&dm->kda_layout, &layer); /* the host pool's, bounded */
        (void)duet_kda_layout_slot_bytes(&dm->kda_layout, &slot);
        dm->kda_layer_floats = (int64_t)(layer / sizeof(float));
        dm->kda_slot_bytes = (size_t)slot;
        dm->kda_spare_slot = (int32_t)sd->n_slots;
        dm->kda_dev_bytes = dm->kda_slot_bytes * (size_t)(sd->n_slots + 1);
        TRY(duet__dalloc(dm, dm->kda_dev_bytes, (void **)&dm->kda_dev));
        CU(cudaMemsetAsync(dm->kda_dev, 0, dm->kda_dev_bytes, dm->stream), "zero KDA pool");
    }
    if (dm->replay_host != NULL) {
        const duet_replay_layout_t rl = duet_replay_pool_layout(dm->replay_host);
        uint64_t slot = 0;
        (void)duet_replay_layout_slot_bytes(&rl, &slot); /* the host pool's, bounded */
        dm->replay_rows = (int64_t)rl.rows;
        dm->replay_slot_bytes = (size_t)slot;
        /* the spare slot's too: a graph bucket's padding items are verify-free but address it */
        dm->replay_dev_bytes = dm->replay_slot_bytes * (size_t)(dm->kda_spare_slot + 1);
        TRY(duet__dalloc(dm, dm->replay_dev_bytes, (void **)&dm->replay_dev));
        CU(cudaMemsetAsync(dm->replay_dev, 0, dm->replay_dev_bytes, dm->stream),
           "zero replay pool");
    }
    /* Staging mirrors: pin the host pools so the copies are asynchronous DMA. Memory the
     * transport already registered (or that cannot be pinned) still works, synchronously. */
    if (dm->opts.mirror_in || dm->opts.mirror_out) {
        void *b[2] = {dm->kv_host ? duet_kv_pool_base(dm->kv_host) : NULL,
                      dm->kda_host ? duet_kda_pool_base(dm->kda_host) : NULL};
        size_t n[2] = {dm->kv_host ? duet_kv_pool_bytes(dm->kv_host) : 0,
                       dm->kda_host ? duet_kda_pool_bytes(dm->kda_host) : 0};
        for (int i = 0; i < 2; i++) {
            if (b[i] == NULL)
                continue;
            cudaError_t e = cudaHostRegister(b[i], n[i], cudaHostRegisterDefault);
            if (e == cudaSuccess) {
                dm->mirrored |= 1 << i;
            } else {
                (void)cudaGetLastError();
                DUET_LOG_WARN("cuda model: cannot pin the host %s pool (%s); staging copies "
                              "will not overlap",
                              i == 0 ? "KV" : "KDA", cudaGetErrorString(e));
            }
        }
    }
    return DUET_OK;
}

static void duet__cuda_destroy(duet_backend_t *be);

/* ---- autotuning (opts.tune): the GEMM's cuBLASLt algorithm per shape ------------------------ */

/* duet_tune_profile_fn over duet_cuda_gemm_profile: the median of 3 means of 10 calls. */
static double duet__cuda_tune_profile(void *user, const duet_tune_key_t *key, int tactic)
{
    duet_cuda_model_t *dm = user;
    /* the bucket's representative M (duet__cuda_tune); lm_head's calls have fewer rows */
    int64_t M = dm->tune_m[key->m];
    if (key->dtype == (int32_t)dm->lm_head.dtype && key->n == dm->lm_head.shape[0] &&
        key->k == dm->lm_head.shape[1] && M > dm->tune_head_rows)
        M = dm->tune_head_rows;
    double t[3];
    for (int i = 0; i < 3; i++)
        if (duet_cuda_gemm_profile(dm->gemm, dm->stream, (duet_dtype_t)key->dtype, M, key->n,
                                   key->k, dm->gemm_flags, tactic, 10, &t[i]) != DUET_OK)
            return NAN; /* no such algorithm for the shape (or it failed): unusable */
    double lo = fmin(t[0], fmin(t[1], t[2])), hi = fmax(t[0], fmax(t[1], t[2]));
    return t[0] + t[1] + t[2] - lo - hi;
}

/* Register shape (w, rows up to m_cap) for every M bucket the engine reaches whose calls go to
 * cuBLASLt (the GEMV sizes have no tactics), judged at the row count profiled (the bucket's,
 * capped at m_cap). */
static duet_status_t duet__cuda_tune_add(duet_cuda_model_t *dm, const duet_tensor_t *w,
                                         int64_t m_cap)
{
    static const int tactics[DUET_CUDA_GEMM_TACTICS] = {0, 1, 2, 3};
    if (w->data == NULL || w->ndim != 2)
        return DUET_OK;
    for (int32_t b = 0; b < DUET_TUNE_M_BUCKETS; b++) {
        const int64_t lo = b == 0 ? 1 : duet_tune_m_bucket_max(b - 1) + 1;
        const int64_t m = dm->tune_m[b] < m_cap ? dm->tune_m[b] : m_cap;
        if (lo > m_cap || !duet_cuda_gemm_tunable(w->dtype, m, w->shape[1], dm->gemm_flags))
            continue;
        const duet_tune_key_t key = {.op = DUET_TUNE_OP_CUDA_GEMM,
                                     .dtype = (int32_t)w->dtype,
                                     .m = b,
                                     .n = w->shape[0],
                                     .k = w->shape[1]};
        duet_status_t st = duet_tune_add(dm->tuner, &key, tactics, DUET_CUDA_GEMM_TACTICS);
        if (st != DUET_OK)
            return st;
    }
    return DUET_OK;
}

/*
 * opts.tune: load opts.tune_file when it exists, else profile cuBLASLt's first
 * DUET_CUDA_GEMM_TACTICS algorithms for every weight GEMM of the forward (duet_cuda_gemm_matmul's
 * plain calls: projections, FFN, router, lm_head; the per-head MLA products are batched and not
 * tuned) at each M bucket the engine reaches, one representative M per bucket (its top, capped
 * at the most rows a step has), and save the table there. Then the GEMM handle uses it. Runs at
 * create, before any decode graph is captured (a graph keeps the algorithms it captured).
 */
static duet_status_t duet__cuda_tune(duet_cuda_model_t *dm)
{
    const duet_model_opts_t *o = &dm->opts;
    const duet_model_config_t *c = &dm->cfg;
    struct cudaDeviceProp prop;
    duet_status_t st = duet__cu(cudaGetDeviceProperties(&prop, 0), "device properties");
    if (st != DUET_OK)
        return st;
    char machine[300];
    snprintf(machine, sizeof(machine), "%s cuda", prop.name);
    duet_tune_space_t sp = {0};
    sp.n_tactics[DUET_TUNE_OP_CUDA_GEMM] = DUET_CUDA_GEMM_TACTICS;
    if ((st = duet_tune_create(&sp, machine, &dm->tuner)) != DUET_OK)
        return st;
    if (o->tune_file != NULL) {
        st = duet_tune_load_group(dm->tuner, o->tune_file, o->comm);
        if (st == DUET_OK) {
            DUET_LOG_INFO("cuda model: %lld tuned GEMM shapes from %s",
                          (long long)duet_tune_count(dm->tuner), o->tune_file);
            duet_cuda_gemm_set_tuner(dm->gemm, dm->tuner);
            return DUET_OK;
        }
        if (st != DUET_ERR_NOT_FOUND)
            return st;
    }

    /* rows of a step: decode batches padded to graph buckets, prefills up to max_batch_tokens */
    const int64_t rows = dm->T > dm->imax_items ? dm->T : dm->imax_items;
    for (int32_t b = 0; b < DUET_TUNE_M_BUCKETS; b++) {
        const int64_t hi = duet_tune_m_bucket_max(b);
        dm->tune_m[b] = hi < rows ? hi : rows;
    }
    dm->tune_head_rows = dm->logit_rows_cap < rows ? dm->logit_rows_cap : rows;
#define ADD(w, cap)                                                                                \
    do {                                                                                           \
        if ((st = duet__cuda_tune_add(dm, (w), (cap))) != DUET_OK)                                 \
            return st;                                                                             \
    } while (0)
    for (int64_t l = 0; l < c->num_layers; l++) {
        const duet__dlayer_t *w = &dm->layers[l];
        ADD(&w->kda.qkv, rows);
        ADD(&w->kda.fg_a, rows);
        ADD(&w->kda.b, rows);
        ADD(&w->kda.f_b, rows);
        ADD(&w->kda.g_b, rows);
        ADD(&w->kda.o, rows);
        ADD(&w->mla.q, rows);
        ADD(&w->mla.q_a, rows);
        ADD(&w->mla.q_b, rows);
        ADD(&w->mla.kv_a, rows);
        ADD(&w->mla.wkv, rows);
        ADD(&w->mla.o, rows);
        ADD(&w->mlp.gu, rows);
        ADD(&w->mlp.down, rows);
        ADD(&w->router, rows);
    }
    ADD(&dm->lm_head, dm->tune_head_rows);
#undef ADD
    duet_tune_stats_t stats;
    st = duet_tune_run(dm->tuner, o->comm, duet__cuda_tune_profile, dm, &stats);
    duet_cuda_gemm_profile_free(dm->gemm); /* up to max_batch_tokens rows of the widest GEMM */
    if (st != DUET_OK)
        return st;
    DUET_LOG_INFO("cuda model: tuned %lld GEMM shapes (%lld pairs, %lld profiled here) in %.3f s",
                  (long long)stats.shapes, (long long)stats.pairs, (long long)stats.profiled,
                  stats.seconds);
    if (o->tune_file != NULL && (st = duet_tune_save(dm->tuner, o->tune_file)) != DUET_OK)
        return st;
    duet_cuda_gemm_set_tuner(dm->gemm, dm->tuner);
    return DUET_OK;
}

static duet_status_t duet__cuda_create(const duet_backend_model_t *bm, duet_backend_t **be_p)
{
    const duet_model_config_t *cfg = bm->cfg;
    const duet_model_opts_t *opts = bm->opts;
    const duet_weights_t *w = bm->w;
    duet_kv_pool_t *kv = bm->kv;
    duet_backend_f32_t *f32 = NULL; /* the checkpoint's fp32 vectors, until uploaded */
    char why[256];
    duet_status_t st;
    if (!duet_cuda_device_usable(why, sizeof(why)))
        return duet_error_set(DUET_ERR_DEVICE, "--device cuda: %s", why);
    if (opts->compute_dtype != DUET_DTYPE_F32 && opts->compute_dtype != DUET_DTYPE_BF16)
        return duet_error_set(DUET_ERR_INVALID, "cuda model: compute dtype must be F32 or BF16");
    if (w != NULL && (st = duet_backend_f32_prepare(cfg, w, &f32)) != DUET_OK)
        return st;
    duet_cuda_model_t *dm = calloc(1, sizeof(*dm));
    if (dm == NULL) {
        duet_backend_f32_free(cfg, f32);
        return duet_error_set(DUET_ERR_NOMEM, "cuda model: out of host memory");
    }
    dm->base.ops = &duet_backend_cuda_ops;
    dm->bm = *bm;
    dm->cfg = *cfg;
    dm->opts = *opts;
    dm->wdt = opts->compute_dtype;
    dm->kv_host = kv;
    dm->kda_host = bm->kda;
    dm->replay_host = bm->replay; /* NULL without KDA layers too */
    dm->split_rows =
        opts->spec_rows > DUET__MLA_SPLIT_ROWS ? opts->spec_rows : DUET__MLA_SPLIT_ROWS;
    if (dm->split_rows > DUET_SPLITKV_MAX_ROWS)
        dm->split_rows = DUET_SPLITKV_MAX_ROWS;
    dm->max_pages = bm->max_pages_per_seq;
    memcpy(dm->layer_sub, bm->layer_sub, sizeof(int64_t) * (size_t)cfg->num_layers);
    dm->T = opts->max_batch_tokens;
    dm->imax_items = duet__pow2_at_least(opts->max_seqs);
    if (dm->wdt != DUET_DTYPE_BF16 || duet_cuda_env_flag(&duet__no_kda_tc, "DUET_CUDA_NO_KDA_TC"))
        dm->kda_tc = DUET_CUDA_KDA_FMA;
    else if (duet_cuda_env_flag(&duet__kda_split, "DUET_CUDA_KDA_SPLIT"))
        dm->kda_tc = DUET_CUDA_KDA_TC_SPLIT;
    else
        dm->kda_tc = DUET_CUDA_KDA_TC_ONE;
    dm->mla_x_prec =
        duet_cuda_env_flag(&duet__mla_x_split, "DUET_CUDA_MLA_X_SPLIT") ? DUET_DTYPE_F32 : dm->wdt;
    {
        /* (no KV pool: no MLA layers, and the form stays off) */
        const duet_cuda_mla_layer_t xl = {.kv_dtype = kv != NULL ? duet_kv_pool_desc(kv)->dtype
                                                                 : DUET_DTYPE_F32,
                                          .r = cfg->kv_lora_rank,
                                          .dr = cfg->qk_rope_head_dim};
        const int want = duet__mla_x_force >= 0
                             ? duet__mla_x_force
                             : !duet_cuda_env_flag(&duet__no_mla_x, "DUET_CUDA_NO_MLA_X");
        dm->mla_x = want && cfg->n_mla_layers > 0 && dm->T >= DUET__MLA_X_MIN_ROWS &&
                    duet_cuda_mla_x_shape(&xl, cfg->qk_nope_head_dim, cfg->v_head_dim);
        const int64_t cap =
            opts->max_seq_len < DUET__MLA_X_CAP ? opts->max_seq_len : DUET__MLA_X_CAP;
        dm->xcap = dm->T > cap ? dm->T : cap;
    }
    dm->gemm_flags = 0; /* fp32 weights: exact fp32 products (TF32 off) */

#define STEP(expr)                                                                                 \
    do {                                                                                           \
        if ((st = (expr)) != DUET_OK)                                                              \
            goto fail;                                                                             \
    } while (0)
    STEP(duet__cu(cudaSetDevice(0), "cudaSetDevice"));
    STEP(duet__cu(cudaDeviceGetAttribute(&dm->n_sms, cudaDevAttrMultiProcessorCount, 0),
                  "device attributes"));
    STEP(duet__cu(cudaStreamCreateWithFlags(&dm->stream, cudaStreamNonBlocking), "stream"));
    STEP(duet__cu(cudaStreamCreateWithFlags(&dm->copy_stream, cudaStreamNonBlocking), "stream"));
    dm->layer_done = calloc((size_t)cfg->num_layers, sizeof(cudaEvent_t));
    dm->copy_done = calloc((size_t)cfg->num_layers, sizeof(cudaEvent_t));
    dm->layers = calloc((size_t)cfg->num_layers, sizeof(duet__dlayer_t));
    if (dm->layer_done == NULL || dm->copy_done == NULL || dm->layers == NULL) {
        st = duet_error_set(DUET_ERR_NOMEM, "cuda model: out of host memory");
        goto fail;
    }
    for (int64_t l = 0; l < cfg->num_layers; l++) {
        STEP(duet__cu(cudaEventCreateWithFlags(&dm->layer_done[l], cudaEventDisableTiming),
                      "event"));
        STEP(
            duet__cu(cudaEventCreateWithFlags(&dm->copy_done[l], cudaEventDisableTiming), "event"));
    }

    {
        const int64_t D = cfg->hidden_size, HK = cfg->kda_heads * cfg->kda_head_dim;
        const int64_t n = cfg->mla_heads, dqk = cfg->qk_nope_head_dim + cfg->qk_rope_head_dim;
        int64_t width = D;
        int64_t cand[] = {3 * HK,
                          n * dqk,
                          n * cfg->kv_lora_rank,
                          n * cfg->v_head_dim,
                          cfg->dense_intermediate,
                          cfg->moe_intermediate * cfg->n_shared_experts,
                          cfg->q_lora_rank,
                          2 * cfg->kda_head_dim};
        for (size_t i = 0; i < sizeof(cand) / sizeof(cand[0]); i++)
            if (cand[i] > width)
                width = cand[i];
        STEP(duet_cuda_gemm_create(0, dm->wdt == DUET_DTYPE_F32 ? 0 : dm->T * width, &dm->gemm));
    }

    uint64_t s = bm->seed;
    {
        const duet_tensor_t *et = w ? &w->embed_tokens : NULL, *lh = w ? &w->lm_head : NULL;
        STEP(duet__weight(dm, w != NULL, dm->wdt, &et, 1, cfg->vocab_size, cfg->hidden_size, &s,
                          &dm->embed));
        if (w != NULL && w->lm_head.data == w->embed_tokens.data)
            dm->lm_head = dm->embed;
        else
            STEP(duet__weight(dm, w != NULL, dm->wdt, &lh, 1, cfg->vocab_size, cfg->hidden_size, &s,
                              &dm->lm_head));
        STEP(duet__vec(dm, NULL, w ? &w->norm : NULL, cfg->hidden_size, &s, 0.0f, 1.0f,
                       &dm->final_norm));
    }
    for (int64_t l = 0; l < cfg->num_layers; l++) {
        STEP(duet__layer_weights(dm, l, w, f32, &s));
        if (w == NULL && l % 4 == 3)
            DUET_LOG_INFO("cuda model: random weights for layer %lld / %lld (%.1f GiB)",
                          (long long)l + 1, (long long)cfg->num_layers,
                          (double)dm->dev_bytes / 1073741824.0);
    }
    STEP(duet__create_pools(dm));
    STEP(duet__alloc_workspace(dm));
    STEP(duet__cu(cudaStreamSynchronize(dm->stream), "weights ready"));
    if (opts->tune)
        STEP(duet__cuda_tune(dm));
#undef STEP
    DUET_LOG_INFO("cuda model ready: %s weights, %.2f GiB on the device, %d SMs, graphs %s",
                  duet_dtype_name(dm->wdt), (double)dm->dev_bytes / 1073741824.0, dm->n_sms,
                  dm->opts.cuda_graphs ? "on" : "off");
    duet_backend_f32_free(cfg, f32);
    *be_p = &dm->base;
    return DUET_OK;

fail:
    duet_backend_f32_free(cfg, f32);
    duet__cuda_destroy(&dm->base);
    return st;
}

static void duet__cuda_destroy(duet_backend_t *be)
{
    duet_cuda_model_t *dm = (duet_cuda_model_t *)be;
    if (dm == NULL)
        return;
    if (dm->stream != NULL)
        cudaStreamSynchronize(dm->stream);
    for (int i = 0; i < dm->n_graphs; i++)
        cudaGraphExecDestroy(dm->graphs[i].exec);
    if (dm->mirrored & 1)
        cudaHostUnregister(duet_kv_pool_base(dm->kv_host));
    if (dm->mirrored & 2)
        cudaHostUnregister(duet_kda_pool_base(dm->kda_host));
    duet_cuda_gemm_destroy(dm->gemm);
    duet_tune_destroy(dm->tuner);
    for (int64_t i = dm->n_allocs - 1; i >= 0; i--)
        cudaFree(dm->allocs[i]);
    free(dm->allocs);
    if (dm->meta_h != NULL)
        cudaFreeHost(dm->meta_h);
    if (dm->token_out_h != NULL)
        cudaFreeHost(dm->token_out_h);
    if (dm->layer_done != NULL)
        for (int64_t l = 0; l < dm->cfg.num_layers; l++) {
            if (dm->layer_done[l] != NULL)
                cudaEventDestroy(dm->layer_done[l]);
            if (dm->copy_done[l] != NULL)
                cudaEventDestroy(dm->copy_done[l]);
        }
    free(dm->layer_done);
    free(dm->copy_done);
    free(dm->layers);
    free(dm->xctx);
    if (dm->copy_stream != NULL)
        cudaStreamDestroy(dm->copy_stream);
    if (dm->stream != NULL)
        cudaStreamDestroy(dm->stream);
    free(dm);
}

static void duet__cuda_pool_mem(const duet_backend_t *be, duet_model_pool_t which,
                                duet_backend_pool_mem_t *out)
{
    const duet_cuda_model_t *dm = (const duet_cuda_model_t *)be;
    memset(out, 0, sizeof(*out));
    out->on_device = 1;
    if (which == DUET_MODEL_POOL_KV) {
        out->base = dm->kv_dev;
        out->bytes = dm->kv_dev_bytes;
    } else if (which == DUET_MODEL_POOL_KDA) {
        out->base = dm->kda_dev;
        out->bytes = dm->kda_dev_bytes;
    } else if (which == DUET_MODEL_POOL_REPLAY) {
        out->base = dm->replay_dev;
        out->bytes = dm->replay_dev_bytes;
    }
}

static void duet__cuda_describe(const duet_backend_t *be, char *buf, size_t cap)
{
    const duet_cuda_model_t *dm = (const duet_cuda_model_t *)be;
    snprintf(buf, cap, "cuda, %s weights, %s KV, graphs %s",
             duet_dtype_name(dm->opts.compute_dtype), duet_dtype_name(dm->opts.kv_dtype),
             dm->opts.cuda_graphs ? "on" : "off");
}

/* ---- sequences ------------------------------------------------------------------------------ */

static duet_status_t duet__cuda_seq_open(duet_backend_t *be, const duet_seq_t *seq)
{
    duet_cuda_model_t *dm = (duet_cuda_model_t *)be;
    /* The host pool is only a staging mirror: zeroed (so a dump of a fresh sequence is
     * deterministic) only when it is mirrored. */
    if (dm->kv_host != NULL && (dm->opts.mirror_in || dm->opts.mirror_out))
        duet_kv_pool_zero_pages(dm->kv_host, seq->pages, seq->n_pages);
    for (int64_t p = 0; p < seq->n_pages; p++)
        CU(cudaMemsetAsync((uint8_t *)dm->kv_dev + duet__kv_off(dm, seq->pages[p], 0, 0), 0,
                           dm->kv_page_bytes, dm->stream),
           "zero pages");
    if (dm->kda_dev != NULL && seq->kda_slot >= 0)
        CU(cudaMemsetAsync((uint8_t *)dm->kda_dev + duet__kda_off(dm, seq->kda_slot, 0), 0,
                           dm->kda_slot_bytes, dm->stream),
           "zero state slot");
    /* a transfer writing these pages from outside the stream must not race the zeroing */
    if (dm->opts.device_pools_shared)
        return duet__cu(cudaStreamSynchronize(dm->stream), "zero pages");
    return DUET_OK;
}

static duet_status_t duet__cuda_seq_set_filled(duet_backend_t *be, const duet_seq_t *seq,
                                               int64_t n_tokens)
{
    duet_cuda_model_t *dm = (duet_cuda_model_t *)be;
    if (!dm->opts.mirror_in)
        return DUET_OK;
    if (dm->kv_dev != NULL && n_tokens > 0) {
        const int64_t PT = dm->opts.page_tokens, np = (n_tokens + PT - 1) / PT;
        for (int64_t p = 0; p < np; p++) {
            size_t off = duet__kv_off(dm, seq->pages[p], 0, 0);
            CU(cudaMemcpyAsync((uint8_t *)dm->kv_dev + off,
                               (uint8_t *)duet_kv_pool_base(dm->kv_host) + off, dm->kv_page_bytes,
                               cudaMemcpyHostToDevice, dm->stream),
               "KV pages host → device");
        }
    }
    if (dm->kda_dev != NULL && seq->kda_slot >= 0) {
        size_t off = duet__kda_off(dm, seq->kda_slot, 0);
        CU(cudaMemcpyAsync((uint8_t *)dm->kda_dev + off,
                           (uint8_t *)duet_kda_pool_base(dm->kda_host) + off, dm->kda_slot_bytes,
                           cudaMemcpyHostToDevice, dm->stream),
           "KDA state host → device");
    }
    if (dm->replay_dev != NULL && seq->n_replay > 0) { /* a moved request's accepted rows */
        const size_t off = dm->replay_slot_bytes * (size_t)seq->kda_slot;
        CU(cudaMemcpyAsync((uint8_t *)dm->replay_dev + off,
                           (uint8_t *)duet_replay_pool_base(dm->replay_host) + off,
                           dm->replay_slot_bytes, cudaMemcpyHostToDevice, dm->stream),
           "replay rows host → device");
    }
    return duet__cu(cudaStreamSynchronize(dm->stream), "staging copy");
}

static duet_status_t duet__cuda_seq_state_copy(duet_backend_t *be, const duet_seq_t *seq, void *buf,
                                               int to_host)
{
    duet_cuda_model_t *dm = (duet_cuda_model_t *)be;
    if (dm->kda_dev == NULL || seq->kda_slot < 0)
        return DUET_OK;
    const size_t off = duet__kda_off(dm, seq->kda_slot, 0);
    uint8_t *dev = (uint8_t *)dm->kda_dev + off;
    /* on the step stream: after the steps queued before it, before the ones queued after */
    if (to_host)
        CU(cudaMemcpyAsync(buf, dev, dm->kda_slot_bytes, cudaMemcpyDeviceToHost, dm->stream),
           "KDA state device → host");
    else
        CU(cudaMemcpyAsync(dev, buf, dm->kda_slot_bytes, cudaMemcpyHostToDevice, dm->stream),
           "KDA state host → device");
    CU(cudaStreamSynchronize(dm->stream), "KDA state copy");
    /* a mirrored host pool stays the device's copy of the slot */
    if (!to_host && (dm->opts.mirror_in || dm->opts.mirror_out))
        memcpy((uint8_t *)duet_kda_pool_base(dm->kda_host) + off, buf, dm->kda_slot_bytes);
    return DUET_OK;
}

static duet_status_t duet__cuda_seq_kv_copy(duet_backend_t *be, const duet_seq_t *seq,
                                            int64_t n_pages, void *buf, int to_host)
{
    duet_cuda_model_t *dm = (duet_cuda_model_t *)be;
    if (dm->kv_dev == NULL)
        return DUET_OK;
    const bool mirrored = dm->opts.mirror_in || dm->opts.mirror_out;
    for (int64_t p = 0; p < n_pages; p++) {
        /* a page's layers are contiguous in the layout: one copy per page */
        const size_t off = duet__kv_off(dm, seq->pages[p], 0, 0);
        uint8_t *dev = (uint8_t *)dm->kv_dev + off;
        uint8_t *host = buf != NULL ? (uint8_t *)buf + p * dm->kv_page_bytes
                                    : (uint8_t *)duet_kv_pool_base(dm->kv_host) + off;
        if (to_host)
            CU(cudaMemcpyAsync(host, dev, dm->kv_page_bytes, cudaMemcpyDeviceToHost, dm->stream),
               "KV pages device → host");
        else
            CU(cudaMemcpyAsync(dev, host, dm->kv_page_bytes, cudaMemcpyHostToDevice, dm->stream),
               "KV pages host → device");
        if (!to_host && mirrored && buf != NULL)
            memcpy((uint8_t *)duet_kv_pool_base(dm->kv_host) + off, host, dm->kv_page_bytes);
    }
    CU(cudaStreamSynchronize(dm->stream), "KV pages copy");
    return DUET_OK;
}

/* Fold step st's items' accepted rows into their state, every KDA layer (cuda_kda.h). */
static duet_status_t duet__replay(duet_cuda_model_t *dm, const duet_cuda_step_t *st)
{
    const duet_model_config_t *c = &dm->cfg;
    const duet_cuda_kda_layer_t ly = {.kda_base = dm->kda_dev,
                                      .kda_n_layers = c->n_kda_layers,
                                      .kda_layer_floats = dm->kda_layer_floats,
                                      .H = c->kda_heads,
                                      .K = c->kda_head_dim,
                                      .W = c->conv_kernel,
                                      .replay_base = dm->replay_dev,
                                      .replay_rows = dm->replay_rows};
    return duet_cuda_kda_replay(dm->stream, st, &ly);
}

/* The replay-only commit: the step's replay for one item and no rows, on the step stream. */
static duet_status_t duet__cuda_seq_replay(duet_backend_t *be, const duet_seq_t *seq)
{
    duet_cuda_model_t *dm = (duet_cuda_model_t *)be;
    if (dm->replay_dev == NULL || seq->kda_slot < 0)
        return duet_error_set(DUET_ERR_INVALID, "cuda model: no replay pool to commit from");
    const duet__meta_layout_t *ml = &dm->ml;
    int32_t *mh = dm->meta_h;
    mh[ml->item_row0] = mh[ml->item_row0 + 1] = 0;
    mh[ml->item_slot] = seq->kda_slot;
    mh[ml->item_replay] = (int32_t)seq->n_replay;
    mh[ml->item_verify] = 0;
    /* the first fields only: item_row0 .. item_replay lie before the rows' arrays */
    CU(cudaMemcpyAsync(dm->meta_d, mh, sizeof(int32_t) * ml->row_item, cudaMemcpyHostToDevice,
                       dm->stream),
       "replay metadata");
    duet_cuda_step_t st = dm->step;
    st.n_items = 1;
    st.n_rows = 0;
    TRY(duet__replay(dm, &st));
    return duet__cu(cudaStreamSynchronize(dm->stream), "replay");
}

/* ---- the step ------------------------------------------------------------------------------- */

/*
 * Whether a step's MLA layers take the expanded form (cuda_mla.h) rather than the absorbed one,
 * and if so each item's context into dm->xctx and their sum returned (0: absorbed). Each layer
 * expands every position of every item, which the cheaper attention repays at a few hundred
 * rows per position, whatever the context (bench/RESULTS.md, "MLA prefill: when a step takes
 * the expanded form"). So: sum_i rows_i · ctx_i >= DUET__MLA_X_MIN_ROWS · sum_i ctx_i (one item:
 * a chunk of >= 256 rows; a decode item beside a prefill chunk counts its whole context against
 * its one row), and the contexts fit xkv (xcap positions).
 */
static int64_t duet__mla_x_step(duet_cuda_model_t *dm, const duet_batch_item_t *items,
                                int64_t n_items)
{
    if (!dm->mla_x || n_items > dm->opts.max_seqs)
        return 0;
    int64_t total = 0;
    double work = 0.0;
    for (int64_t i = 0; i < n_items; i++) {
        const int64_t ctx = items[i].seq->n_tokens + items[i].n_tokens;
        dm->xctx[i] = ctx;
        total += ctx;
        work += (double)items[i].n_tokens * (double)ctx;
    }
    return total <= dm->xcap && work >= (double)DUET__MLA_X_MIN_ROWS * (double)total ? total : 0;
}

typedef struct {
    int64_t n_items, n_rows, n_logit_rows;
    int sample;      /* 0 none, 1 argmax, 2 full sampling rule */
    int64_t x_ctx;   /* > 0: the MLA layers take the expanded form, dm->xctx[i] positions per
                      * item (this many in all) */
    int replay;      /* fold items' accepted rows first (duet_cuda_kda_replay) */
    int rows, plain; /* a graph's key beside n_items and sample (duet__graph_t) */
} duet__shape_t;

/* Where a BF16 w multiplies T rows on cuBLASLt, the GEMM's staging, for the producer of its x
 * to leave the rows there in bf16 (the op's xs); else NULL, and x is read as usual. */
static void *duet__bf16_x(duet_cuda_gemm_t *g, const duet_tensor_t *w, int64_t T, unsigned flags)
{
    const int64_t K = w->shape[1];
    return w->dtype == DUET_DTYPE_BF16 && duet_cuda_gemm_tunable(DUET_DTYPE_BF16, T, K, flags)
               ? duet_cuda_gemm_staging(g, T * K)
               : NULL;
}

/*
 * Each block's first projections read xn = RMSNorm(x) of the layer's norm `nrm`: they go through
 * duet_cuda_gemm_norm_multi, which at decode sizes normalises inside the projection's own launch
 * (and stores xn for the block's later readers) and otherwise runs the norm first.
 */
static duet_status_t duet__kda_layer(duet_cuda_model_t *dm, const duet__shape_t *sh, int64_t l,
                                     const duet_cuda_gemm_norm_t *nrm)
{
    const duet_model_config_t *c = &dm->cfg;
    const duet__dkda_t *w = &dm->layers[l].kda;
    const int64_t T = sh->n_rows, D = c->hidden_size, H = c->kda_heads, K = c->kda_head_dim,
                  HK = H * K;
    cudaStream_t s = dm->stream;
    duet_cuda_gemm_t *g = dm->gemm;
    const unsigned f = dm->gemm_flags;
    duet_cuda_kda_layer_t ly = {.kda_base = dm->kda_dev,
                                .kda_n_layers = c->n_kda_layers,
                                .kda_layer_floats = dm->kda_layer_floats,
                                .layer = dm->layer_sub[l],
                                .H = H,
                                .K = K,
                                .W = c->conv_kernel,
                                .tc = dm->kda_tc,
                                .replay_base = dm->replay_dev,
                                .replay_rows = dm->replay_rows};
    /* projections of xn, then the two low-rank second halves: one launch each at decode sizes */
    const duet_cuda_gemm_op_t in[3] = {
        {.y = dm->proj, .ldy = 3 * HK, .x = dm->xn, .ldx = D, .w = &w->qkv},
        {.y = dm->fg, .ldy = 2 * K, .x = dm->xn, .ldx = D, .w = &w->fg_a},
        {.y = dm->beta, .ldy = H, .x = dm->xn, .ldx = D, .w = &w->b}};
    TRY(duet_cuda_gemm_norm_multi(g, s, T, nrm, in, 3, f));
    const duet_cuda_gemm_op_t lr[2] = {
        {.y = dm->gk, .ldy = HK, .x = dm->fg, .ldx = 2 * K, .w = &w->f_b},
        {.y = dm->gate, .ldy = HK, .x = dm->fg + K, .ldx = 2 * K, .w = &w->g_b}};
    TRY(duet_cuda_gemm_matmul_multi(g, s, T, lr, 2, f));
    /* conv → window roll → prep → core → out-norm × σ(gate): one kernel at decode sizes */
    const duet_cuda_kda_weights_t kw = {.taps = w->taps,
                                        .neg_A = w->neg_A,
                                        .dt_bias = w->dt_bias,
                                        .o_norm = w->o_norm,
                                        .eps = c->rms_norm_eps};
    /* where o_proj multiplies on cuBLASLt, out leaves its rows in bf16 in the GEMM's staging */
    void *ob = duet__bf16_x(g, &w->o, T, f);
    TRY(duet_cuda_kda_chain(s, &dm->step, &ly, &kw, dm->proj, dm->gate, dm->qkv, dm->gk, dm->beta,
                            dm->o, ob, dm->kda_scratch));
    const duet_cuda_gemm_op_t op = {
        .y = dm->x, .ldy = D, .x = dm->o, .ldx = HK, .w = &w->o, .accumulate = 1, .xs = ob};
    return duet_cuda_gemm_matmul_multi(g, s, T, &op, 1, f);
}

static duet_status_t duet__mla_layer(duet_cuda_model_t *dm, const duet__shape_t *sh, int64_t l,
                                     const duet_cuda_gemm_norm_t *nrm)
{
    const duet_model_config_t *c = &dm->cfg;
    const duet__dmla_t *w = &dm->layers[l].mla;
    const int64_t T = sh->n_rows, D = c->hidden_size, n = c->mla_heads;
    const int64_t dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim, dv = c->v_head_dim;
    const int64_t r = c->kv_lora_rank, dqk = dn + dr;
    cudaStream_t s = dm->stream;
    duet_cuda_gemm_t *g = dm->gemm;
    const unsigned f = dm->gemm_flags;
    const duet_cuda_mla_layer_t ly = duet__mla_ly(dm, dm->layer_sub[l]);
    if (c->q_lora_rank > 0) {
        const int64_t ql = c->q_lora_rank;
        const duet_cuda_gemm_op_t ops[2] = {
            {.y = dm->mqa, .ldy = ql, .x = dm->xn, .ldx = D, .w = &w->q_a},
            {.y = dm->ckr, .ldy = r + dr, .x = dm->xn, .ldx = D, .w = &w->kv_a}};
        TRY(duet_cuda_gemm_norm_multi(g, s, T, nrm, ops, 2, f));
        TRY(duet_cuda_rmsnorm(s, dm->mqa, ql, dm->mqa, ql, w->q_a_norm, T, ql, DUET_MLA_NORM_EPS));
        TRY(duet_cuda_gemm_matmul(g, s, dm->mq, n * dqk, dm->mqa, ql, T, &w->q_b, 0, f));
    } else {
        const duet_cuda_gemm_op_t ops[2] = {
            {.y = dm->mq, .ldy = n * dqk, .x = dm->xn, .ldx = D, .w = &w->q},
            {.y = dm->ckr, .ldy = r + dr, .x = dm->xn, .ldx = D, .w = &w->kv_a}};
        TRY(duet_cuda_gemm_norm_multi(g, s, T, nrm, ops, 2, f));
    }
    TRY(duet_cuda_mla_kv_write(s, &dm->step, &ly, dm->ckr, w->kv_a_norm, DUET_MLA_NORM_EPS));
    const float scale = 1.0f / sqrtf((float)dqk);
    if (sh->x_ctx > 0) {
        /* expanded: K_h, V_h of every position of every item (slices of the cache through one
         * GEMM each; item i's rows follow item i-1's), then attention at 192 + 128 dims per
         * head straight into o */
        const int64_t ldkv = 2 * n * dv;
        for (int64_t i = 0, x0 = 0; i < sh->n_items; x0 += dm->xctx[i], i++)
            for (int64_t p0 = 0; p0 < dm->xctx[i]; p0 += dm->xslice) {
                const int64_t np = dm->xctx[i] - p0 < dm->xslice ? dm->xctx[i] - p0 : dm->xslice;
                TRY(duet_cuda_mla_gather(s, &dm->step, &ly, i, p0, np, dm->xgath));
                TRY(duet_cuda_gemm_matmul(g, s, dm->xkvb, ldkv, dm->xgath, r + dr, np, &w->wkv, 0,
                                          f));
                TRY(duet_cuda_mla_x_pack(s, &ly, dm->xkvb, ldkv, dm->xgath, x0 + p0, np, dm->xkv,
                                         dm->xcap));
            }
        TRY(duet_cuda_mla_attend_x(s, &dm->step, &ly, dm->xkv, dm->xcap, dm->mq, n * dqk, dqk,
                                   scale, dm->mla_x_prec, dm->o));
    } else {
        /* absorbed: q̂_h = W_UK[h]ᵀ q_nope_h, all heads in one batched GEMM; attention over the
         * latent rows; o_h = W_UV[h] · latent_h */
        TRY(duet_cuda_gemm_matmul_batched(g, s, dm->qhat, n * r, r, dm->mq, n * dqk, dqk, T,
                                          &w->wuk_t, 0, f));
        TRY(duet_cuda_mla_attend(s, &dm->step, &ly, dm->qhat, dm->mq + dn, n * dqk, dqk, scale,
                                 dm->lat, dm->mla_scratch, dm->mla_scratch_bytes));
        TRY(duet_cuda_gemm_matmul_batched(g, s, dm->o, n * dv, dv, dm->lat, n * r, r, T, &w->wuv, 0,
                                          f));
    }
    return duet_cuda_gemm_matmul(g, s, dm->x, D, dm->o, n * dv, T, &w->o, 1, f);
}

/* act(gate) ⊙ up and the down projection into the residual, f1 = [T][gate | up] computed. */
static duet_status_t duet__mlp_rest(duet_cuda_model_t *dm, const duet__dmlp_t *w, int64_t T)
{
    const duet_model_config_t *c = &dm->cfg;
    const int64_t D = c->hidden_size, I = w->down.shape[1];
    cudaStream_t s = dm->stream;
    const duet_cuda_act_t act = c->act == DUET_ACT_SITU ? DUET_CUDA_ACT_SITU : DUET_CUDA_ACT_SILU;
    /* where down multiplies on cuBLASLt, its x goes to the GEMM's staging in bf16 at once */
    void *hb = duet__bf16_x(dm->gemm, &w->down, T, dm->gemm_flags);
    if (hb != NULL)
        TRY(duet_cuda_act_mul_bf16(s, hb, dm->f1, dm->f1 + I, T, I, 2 * I, act, c->situ_beta,
                                   c->situ_linear_beta));
    else
        TRY(duet_cuda_act_mul(s, dm->f1, dm->f1 + I, T, I, 2 * I, act, c->situ_beta,
                              c->situ_linear_beta));
    const duet_cuda_gemm_op_t op = {
        .y = dm->x, .ldy = D, .x = dm->f1, .ldx = 2 * I, .w = &w->down, .accumulate = 1, .xs = hb};
    return duet_cuda_gemm_matmul_multi(dm->gemm, s, T, &op, 1, dm->gemm_flags);
}

static duet_status_t duet__mlp(duet_cuda_model_t *dm, const duet__dmlp_t *w, int64_t T,
                               const duet_cuda_gemm_norm_t *nrm)
{
    const int64_t D = dm->cfg.hidden_size, I = w->down.shape[1];
    const duet_cuda_gemm_op_t op = {.y = dm->f1, .ldy = 2 * I, .x = dm->xn, .ldx = D, .w = &w->gu};
    TRY(duet_cuda_gemm_norm_multi(dm->gemm, dm->stream, T, nrm, &op, 1, dm->gemm_flags));
    return duet__mlp_rest(dm, w, T);
}

/* Switches for side-by-side comparisons of decode and verify steps (duet_cuda_env_flag):
 * DUET_CUDA_NO_SHARED_FOLD keeps the shared expert a separate MLP, DUET_CUDA_NO_ROUTER_ROUTE
 * the router GEMV and the routing two kernels (up to DUET_CUDA_ROUTER_MAX_T rows), and at T = 1
 * DUET_CUDA_NO_SHARED_EARLY the folded shared expert's gate/up waiting for the routing with the
 * routed slots. */
static int duet__no_shared_fold = -1, duet__no_router_route = -1, duet__no_shared_early = -1;

static duet_status_t duet__moe_layer(duet_cuda_model_t *dm, const duet__shape_t *sh, int64_t l,
                                     const duet_cuda_gemm_norm_t *nrm)
{
    const duet_model_config_t *c = &dm->cfg;
    const duet__dlayer_t *w = &dm->layers[l];
    const int64_t T = sh->n_rows, D = c->hidden_size, E = c->n_experts;
    cudaStream_t s = dm->stream;
    /* Rows on the experts' GEMV kernels (decode, verify) with a shared expert shaped like the
     * routed ones (n_shared_experts = 1): they compute it as one more expert (cuda_ops.h), so
     * no separate MLP. */
    duet_cuda_experts_t ex = w->ex;
    const int fold = w->has_shared && duet_cuda_moe_gemv_path(&ex, T, c->top_k) &&
                     w->mlp.down.shape[1] == ex.I && w->mlp.gu.dtype == ex.dtype &&
                     !duet_cuda_env_flag(&duet__no_shared_fold, "DUET_CUDA_NO_SHARED_FOLD");
    if (fold) {
        const size_t half = (size_t)ex.I * (size_t)D * duet_dtype_size(w->mlp.gu.dtype);
        ex.sw1 = w->mlp.gu.data;
        ex.sw3 = (const uint8_t *)w->mlp.gu.data + half;
        ex.sw2 = w->mlp.down.data;
    }
    const int64_t G = c->n_group > 0 ? c->n_group : 1;
    const duet_cuda_gemm_op_t sgu = {
        .y = dm->f1, .ldy = 2 * w->mlp.down.shape[1], .x = dm->xn, .ldx = D, .w = &w->mlp.gu};
    if (T <= DUET_CUDA_ROUTER_MAX_T && D % 4 == 0 && nrm->ldx == D && nrm->ldy == D &&
        !duet_cuda_env_flag(&duet__no_router_route, "DUET_CUDA_NO_ROUTER_ROUTE")) {
        /* a few rows: the norm, the router and the routing in one kernel (its float4 loads want
         * D % 4 == 0 and rows D apart; other shapes take the two-kernel path below) */
        TRY(duet_cuda_moe_router_route(s, nrm->x, T, nrm->w, nrm->eps, w->router.data, E, D,
                                       w->router_bias, G, c->topk_group, c->top_k,
                                       c->moe_renormalize, c->routed_scaling_factor, nrm->y,
                                       dm->router, dm->topk_idx, dm->topk_w, dm->route_sync));
        if (w->has_shared && !fold)
            TRY(duet_cuda_gemm_matmul_multi(dm->gemm, s, T, &sgu, 1, dm->gemm_flags));
        /* the folded shared expert forms xn itself and runs beside the router (cuda_ops.h) */
        if (fold && T == 1 && nrm->y == dm->xn &&
            !duet_cuda_env_flag(&duet__no_shared_early, "DUET_CUDA_NO_SHARED_EARLY")) {
            ex.norm_x = nrm->x;
            ex.norm_w = nrm->w;
            ex.norm_eps = nrm->eps;
        }
    } else {
        /* the router and the shared expert's gate|up read the same xn: one launch at decode
         * sizes. From DUET_CUDA_GEMM_SPLIT_ROWS rows, a router of bf16 values takes xn's split
         * form on the tensor cores, whose plane 0 (xn rounded to bf16) the shared expert's
         * gate|up and the experts read too (cuda_gemm.h). */
        const int n_ops = w->has_shared && !fold ? 2 : 1;
        const unsigned flags = n_ops == 2 ? dm->gemm_flags : 0;
        const int split = w->router_bf.data != NULL && dm->xsplit != NULL && nrm->y == dm->xn &&
                          nrm->ldy == D && duet_cuda_gemm_split_pays(T, D, flags);
        duet_cuda_gemm_op_t ops[2] = {
            {.y = dm->router, .ldy = E, .x = dm->xn, .ldx = D, .w = &w->router}, sgu};
        if (split) {
            /* with BF16 weights the ops read the planes and the experts' MMA path plane 0: then
             * nothing reads xn itself (the GEMV path would) */
            float *y = dm->wdt == DUET_DTYPE_BF16 && !duet_cuda_moe_gemv_path(&ex, T, c->top_k)
                           ? NULL
                           : nrm->y;
            TRY(duet_cuda_rmsnorm_planes(s, y, nrm->ldy, nrm->x, nrm->ldx, nrm->w, T, D, nrm->eps,
                                         dm->xsplit, 3));
            ops[0].xs = ops[1].xs = dm->xsplit;
            ops[0].w_bf16 = &w->router_bf;
            ex.xb = dm->xsplit;
            TRY(duet_cuda_gemm_matmul_multi(dm->gemm, s, T, ops, n_ops, flags));
        } else {
            TRY(duet_cuda_gemm_norm_multi(dm->gemm, s, T, nrm, ops, n_ops, flags));
        }
        TRY(duet_cuda_moe_route(s, dm->router, w->router_bias, T, E, G, c->topk_group, c->top_k,
                                c->moe_renormalize, c->routed_scaling_factor, dm->topk_idx,
                                dm->topk_w));
    }
    TRY(duet_cuda_moe_experts(s, &ex, dm->xn, T, dm->topk_idx, dm->topk_w, c->top_k,
                              c->act == DUET_ACT_SITU ? DUET_CUDA_ACT_SITU : DUET_CUDA_ACT_SILU,
                              c->situ_beta, c->situ_linear_beta, dm->x, dm->moe_scratch));
    if (w->has_shared && !fold)
        return duet__mlp_rest(dm, &w->mlp, T);
    return DUET_OK;
}

/* Queue device → host copies of layer l's new KV / state of every item (mirror_out). */
static duet_status_t duet__mirror_out(duet_cuda_model_t *dm, const duet_batch_item_t *items,
                                      int64_t n_items, int64_t l)
{
    const duet_model_config_t *c = &dm->cfg;
    const int64_t sub = dm->layer_sub[l];
    cudaStream_t cs = dm->copy_stream;
    CU(cudaEventRecord(dm->layer_done[l], dm->stream), "event");
    CU(cudaStreamWaitEvent(cs, dm->layer_done[l], 0), "event wait");
    for (int64_t i = 0; i < n_items; i++) {
        const duet_seq_t *seq = items[i].seq;
        if (c->mixer[l] == DUET_MIXER_KDA) {
            size_t off = duet__kda_off(dm, seq->kda_slot, sub);
            CU(cudaMemcpyAsync(
                   (uint8_t *)duet_kda_pool_base(dm->kda_host) + off, (uint8_t *)dm->kda_dev + off,
                   (size_t)dm->kda_layer_floats * sizeof(float), cudaMemcpyDeviceToHost, cs),
               "KDA state device → host");
        } else {
            const int64_t PT = dm->opts.page_tokens;
            int64_t pos = seq->n_tokens, end = seq->n_tokens + items[i].n_tokens;
            while (pos < end) {
                int64_t in_page = PT - pos % PT, n = end - pos < in_page ? end - pos : in_page;
                size_t off = duet__kv_off(dm, seq->pages[pos / PT], sub, pos % PT);
                CU(cudaMemcpyAsync((uint8_t *)duet_kv_pool_base(dm->kv_host) + off,
                                   (uint8_t *)dm->kv_dev + off, (size_t)n * dm->kv_token_bytes,
                                   cudaMemcpyDeviceToHost, cs),
                   "KV rows device → host");
                pos += n;
            }
        }
    }
    CU(cudaEventRecord(dm->copy_done[l], cs), "event");
    return DUET_OK;
}

/*
 * Next tokens of logits rows [0, M) (row stride V) into out, with the step's parameters of those
 * rows: argmax (kind 1) or the sampling rule (kind 2), in pieces of at most imax_items rows, the
 * rows the sampler's scratch was sized for.
 */
static duet_status_t duet__draw(duet_cuda_model_t *dm, int kind, const float *logits, int64_t M,
                                const duet_cuda_sample_params_t *par, int32_t *out)
{
    const int64_t V = dm->cfg.vocab_size;
    if (kind == 1) {
        for (int64_t r0 = 0; r0 < M; r0 += 65535) {
            const int64_t m = M - r0 < 65535 ? M - r0 : 65535;
            TRY(duet_cuda_argmax_split(dm->stream, logits + r0 * V, V, V, m, out + r0,
                                       dm->argmax_scratch));
        }
        return DUET_OK;
    }
    for (int64_t r0 = 0; r0 < M; r0 += dm->imax_items) {
        const int64_t m = M - r0 < dm->imax_items ? M - r0 : dm->imax_items;
        TRY(duet_cuda_sample(dm->stream, logits + r0 * V, V, V, m, par + r0, out + r0,
                             dm->sample_scratch));
    }
    return DUET_OK;
}

/* Tell the caller layer l's mixer outputs are final (model.h's layer hook contract). */
static void duet__run_hook(const duet_cuda_model_t *dm, duet_model_layer_hook_fn hook,
                           void *hook_user, int64_t l)
{
    const duet_backend_batch_t b = {.hook = hook, .hook_user = hook_user};
    duet_backend_layer_done(&dm->bm, &b, l);
}

/* Rows of logits an item owns in a step: its last row (LAST, TOKEN; and NONE in a graph step,
 * whose fixed shape computes one per item), all its rows (ALL), else none. */
static int64_t duet__logit_rows(const duet_batch_item_t *it, int use_graph)
{
    switch (it->logits_mode) {
    case DUET_LOGITS_LAST:
    case DUET_LOGITS_TOKEN:
        return 1;
    case DUET_LOGITS_ALL:
    case DUET_LOGITS_ARGMAX:
        return it->n_tokens;
    default:
        return use_graph ? 1 : 0;
    }
}

/*
 * Queue the whole step on dm->stream. With `hook` (not under graph capture), layer l's hook runs
 * once layer l's outputs are final in the host mirror (mirror_out) or on the device, one layer
 * behind the queueing so the GPU keeps working while the host waits.
 */
static duet_status_t duet__enqueue(duet_cuda_model_t *dm, const duet__shape_t *sh,
                                   const duet_batch_item_t *items, duet_model_layer_hook_fn hook,
                                   void *hook_user)
{
    const duet_model_config_t *c = &dm->cfg;
    const int64_t T = sh->n_rows, D = c->hidden_size, V = c->vocab_size;
    cudaStream_t s = dm->stream;
    const int mirror = dm->opts.mirror_out && hook != NULL;
    int64_t pending = -1; /* layer whose hook has not run yet */

    if (sh->replay) {
        /* accepted rows of earlier verify items, every KDA layer at once: each layer's replay
         * only has to come before that layer's conv and core */
        TRY(duet__replay(dm, &dm->step));
    }
    if (c->n_mla_layers > 0 && sh->x_ctx == 0) {
        /* the split-KV plan every absorbed MLA layer's attend reads */
        const duet_cuda_mla_layer_t ly = duet__mla_ly(dm, 0);
        TRY(duet_cuda_mla_plan(s, &dm->step, &ly, dm->mla_scratch, dm->mla_scratch_bytes));
    }
    TRY(duet_cuda_embed(s, dm->x, dm->embed.data, dm->embed.dtype, D, dm->meta_d + dm->ml.tokens,
                        T));
    for (int64_t l = 0; l < c->num_layers; l++) {
        const duet__dlayer_t *w = &dm->layers[l];
        /* the mixers read xn only through their first projections (duet__kda_layer,
         * duet__mla_layer), the dense MLP through its gate|up; the MoE layer's experts read it
         * too (the layer itself decides when they do not) */
        const duet_cuda_gemm_norm_t in_norm = {.x = dm->x,
                                               .ldx = D,
                                               .w = w->in_norm,
                                               .y = dm->xn,
                                               .ldy = D,
                                               .D = D,
                                               .eps = c->rms_norm_eps,
                                               .y_unread = 1};
        TRY(c->mixer[l] == DUET_MIXER_KDA ? duet__kda_layer(dm, sh, l, &in_norm)
                                          : duet__mla_layer(dm, sh, l, &in_norm));
        if (mirror)
            TRY(duet__mirror_out(dm, items, sh->n_items, l));
        else if (hook != NULL)
            CU(cudaEventRecord(dm->layer_done[l], s), "event");
        if (hook != NULL && pending >= 0) {
            CU(cudaEventSynchronize(mirror ? dm->copy_done[pending] : dm->layer_done[pending]),
               "layer wait");
            duet__run_hook(dm, hook, hook_user, pending);
        }
        pending = l;
        const duet_cuda_gemm_norm_t post_norm = {.x = dm->x,
                                                 .ldx = D,
                                                 .w = w->post_norm,
                                                 .y = dm->xn,
                                                 .ldy = D,
                                                 .D = D,
                                                 .eps = c->rms_norm_eps,
                                                 .y_unread = c->ffn[l] != DUET_FFN_MOE};
        TRY(c->ffn[l] == DUET_FFN_MOE ? duet__moe_layer(dm, sh, l, &post_norm)
                                      : duet__mlp(dm, &w->mlp, T, &post_norm));
    }
    if (hook != NULL && pending >= 0) {
        CU(cudaEventSynchronize(mirror ? dm->copy_done[pending] : dm->layer_done[pending]),
           "layer wait");
        duet__run_hook(dm, hook, hook_user, pending);
    }
    if (sh->n_logit_rows > 0 && sh->n_logit_rows == T && T <= dm->logit_rows_cap) {
        /* every row is a logits row (a decode step): the gather would be the identity, and the
         * final norm rides in the head's GEMV like every layer's norm in its first projection
         * (its 160k warps each redo the fp32 sum of squares; bench/RESULTS.md, "The final norm
         * in the head's GEMV"). */
        const duet_cuda_gemm_norm_t fn = {.x = dm->x,
                                          .ldx = D,
                                          .w = dm->final_norm,
                                          .y = dm->xn,
                                          .ldy = D,
                                          .D = D,
                                          .eps = c->rms_norm_eps};
        const duet_cuda_gemm_op_t head = {
            .y = dm->logits, .ldy = V, .x = dm->xn, .ldx = D, .w = &dm->lm_head};
        TRY(duet_cuda_gemm_norm_multi(dm->gemm, s, T, &fn, &head, 1, dm->gemm_flags));
    } else if (sh->n_logit_rows > 0 && sh->n_logit_rows <= dm->logit_rows_cap) {
        TRY(duet_cuda_gather_rows(s, dm->xn, dm->x, D, dm->meta_d + dm->ml.logit_rows,
                                  sh->n_logit_rows));
        TRY(duet_cuda_rmsnorm(s, dm->xn, D, dm->xn, D, dm->final_norm, sh->n_logit_rows, D,
                              c->rms_norm_eps));
        TRY(duet_cuda_gemm_matmul(dm->gemm, s, dm->logits, V, dm->xn, D, sh->n_logit_rows,
                                  &dm->lm_head, 0, dm->gemm_flags));
    }
    if (sh->n_logit_rows > 0 && sh->n_logit_rows <= dm->logit_rows_cap) {
        if (sh->sample != 0)
            TRY(duet__draw(dm, sh->sample, dm->logits, sh->n_logit_rows,
                           (const duet_cuda_sample_params_t *)(dm->meta_d + dm->ml.params),
                           dm->token_out));
    }
    return DUET_OK;
}

static duet_status_t duet__graph_launch(duet_cuda_model_t *dm, const duet__shape_t *sh)
{
    duet__graph_t *gr = NULL;
    for (int i = 0; i < dm->n_graphs; i++)
        if (dm->graphs[i].bucket == sh->n_items && dm->graphs[i].sampled == sh->sample &&
            dm->graphs[i].rows == sh->rows && dm->graphs[i].plain == sh->plain)
            gr = &dm->graphs[i];
    if (gr == NULL) {
        if (dm->n_graphs == DUET_CUDA_MAX_GRAPHS) { /* full: drop the oldest */
            cudaGraphExecDestroy(dm->graphs[0].exec);
            memmove(dm->graphs, dm->graphs + 1, sizeof(dm->graphs[0]) * (DUET_CUDA_MAX_GRAPHS - 1));
            dm->n_graphs--;
        }
        cudaGraph_t graph = NULL;
        CU(cudaStreamBeginCapture(dm->stream, cudaStreamCaptureModeThreadLocal), "begin capture");
        duet_status_t st = duet__enqueue(dm, sh, NULL, NULL, NULL);
        cudaError_t e = cudaStreamEndCapture(dm->stream, &graph);
        TRY(st);
        CU(e, "end capture");
        cudaGraphExec_t exec = NULL;
        e = cudaGraphInstantiate(&exec, graph, 0);
        cudaGraphDestroy(graph);
        CU(e, "graph instantiate");
        gr = &dm->graphs[dm->n_graphs++];
        gr->bucket = (int)sh->n_items;
        gr->sampled = sh->sample;
        gr->rows = sh->rows;
        gr->plain = sh->plain;
        gr->exec = exec;
        DUET_LOG_DEBUG("cuda model: captured the %s graph for %d sequences of %d rows (%d plain)",
                       gr->rows > 1 ? "verify" : "decode", gr->bucket, gr->rows, gr->plain);
    }
    CU(cudaGraphLaunch(gr->exec, dm->stream), "graph launch");
    return DUET_OK;
}

/* In a verify graph's step (every row a logits row, in row order), the first logits row of real
 * item i whose nl logits rows are the last of its own rows. */
static int64_t duet__logit_row0(const duet_cuda_model_t *dm, const duet_batch_item_t *it, int64_t i,
                                int64_t nl)
{
    return dm->meta_h[dm->ml.item_row0 + i] + it->n_tokens - nl;
}

/* A verify graph pads verify items only when the padding rows are expected to stream at most this
 * many bytes of expert weights that the step's own rows do not (about 15 µs at the H200's copy
 * rate, against the 0.3 ms a graph saved the demo model's mixed steps: bench/RESULTS.md, "Mixed
 * verify steps"). */
#define DUET__PAD_MAX_BYTES (64.0 * 1024 * 1024)

/* Whether padding a step's verify items with pad rows beside its own rows (real of them) costs
 * less than running it kernel by kernel saves: at most as many rows again, and the experts the
 * padding rows route to beyond the real rows' (uniform routing, as duet-bench-model-cuda's
 * roofline counts them) within DUET__PAD_MAX_BYTES. DUET_CUDA_VERIFY_PAD=0 never pads, another
 * non-empty value always does (docs/switches.md). */
static int duet__pad_pays(const duet_cuda_model_t *dm, int64_t real, int64_t pad)
{
    if (duet__verify_pad == -2) {
        const char *v = getenv("DUET_CUDA_VERIFY_PAD");
        duet__verify_pad = v == NULL || v[0] == '\0' ? -1 : strcmp(v, "0") != 0;
    }
    if (duet__verify_pad >= 0)
        return duet__verify_pad;
    const duet_model_config_t *c = &dm->cfg;
    if (pad > real)
        return 0;
    if (c->n_experts <= 0 || c->n_moe_layers <= 0)
        return 1;
    const double experts = duet_cuda_moe_touched((double)(real + pad), c->top_k, c->n_experts) -
                           duet_cuda_moe_touched((double)real, c->top_k, c->n_experts);
    const double expert_bytes = 3.0 * (double)c->hidden_size * (double)c->moe_intermediate *
                                (dm->wdt == DUET_DTYPE_F32 ? 4.0 : 2.0);
    return experts * expert_bytes * (double)c->n_moe_layers <= DUET__PAD_MAX_BYTES;
}

/* Whether every verify item of a step can be padded to rows rows in a verify graph: the
 * positions of its padding rows must fit its row of the page table. */
static int duet__pad_fits(const duet_cuda_model_t *dm, const duet_batch_item_t *items,
                          int64_t n_items, int64_t rows)
{
    if (dm->kv_host == NULL) /* no MLA layers: no pages */
        return 1;
    const int64_t cap = dm->step.max_pages * dm->opts.page_tokens;
    for (int64_t i = 0; i < n_items; i++)
        if (items[i].verify && items[i].seq->n_tokens + rows > cap)
            return 0;
    return 1;
}

/* A padded item's page table row pg up to position end: the padding rows' KV goes to the
 * item's own pages past its rows (positions no one reads before they are written again, as a
 * rejected draft's) and, past its last page, to the spare page. */
static void duet__pad_pages(const duet_cuda_model_t *dm, int32_t *pg, const duet_seq_t *seq,
                            int64_t end)
{
    const int64_t PT = dm->opts.page_tokens, need = (end + PT - 1) / PT;
    for (int64_t p = seq->n_pages; p < need; p++)
        pg[p] = (int32_t)dm->kv_spare_page;
}

static duet_status_t duet__cuda_forward(duet_backend_t *be, const duet_backend_batch_t *bt)
{
    duet_cuda_model_t *dm = (duet_cuda_model_t *)be;
    duet_batch_item_t *items = bt->items;
    const int64_t n_items = bt->n_items;
    duet_model_layer_hook_fn hook = bt->hook;
    void *hook_user = bt->hook_user;
    const duet_model_config_t *c = &dm->cfg;
    const duet__meta_layout_t *ml = &dm->ml;
    int32_t *mh = dm->meta_h;
    int64_t max_tokens = 1, chunk_tokens = 1, split_rows = 0, n_logits = 0;
    int any_sampled = 0, any_token = 0, any_all = 0, any_verify = 0, any_replay = 0;
    int64_t n_plain = 0, vrows = 0; /* plain items; the most rows of a verify item */
    int64_t n_rows_real = 0;        /* the items' own rows */
    int mixed_ok = 1;               /* every plain item has one row */

    for (int64_t i = 0; i < n_items; i++) {
        const duet_batch_item_t *it = &items[i];
        if (it->n_tokens > max_tokens)
            max_tokens = it->n_tokens;
        if (it->n_tokens <= dm->split_rows && it->n_tokens > split_rows)
            split_rows = it->n_tokens;
        any_all |= it->logits_mode == DUET_LOGITS_ALL;
        any_verify |= it->verify != 0;
        any_replay |= it->seq->n_replay > 0;
        if (!it->verify && it->n_tokens > chunk_tokens)
            chunk_tokens = it->n_tokens;
        if (it->verify && it->n_tokens > vrows)
            vrows = it->n_tokens;
        n_rows_real += it->n_tokens;
        n_plain += !it->verify;
        mixed_ok &= it->verify || it->n_tokens == 1;
        any_token |= it->logits_mode == DUET_LOGITS_ARGMAX; /* drawn greedily, row by row */
        if (it->logits_mode == DUET_LOGITS_TOKEN) {
            any_token = 1;
            any_sampled |= !duet_sampling_greedy(&it->sampling);
        }
    }
    /* A pure decode step of at most a bucket of sequences runs as a graph, and so does a step of
     * verify items of one length vrows beside one-row plain items (speculation's steady state),
     * the bucket's padding items being one-row plain items on the spare page and slot: the graph
     * depends only on (bucket, vrows, verify items). Verify items of different lengths join it
     * padded to vrows rows that compute like rejected drafts (duet__pad_pages says where their
     * KV goes; no output of the item's own rows depends on them) when that pays
     * (duet__pad_pays: for a small model, not at Kimi-Linear-48B's size). */
    const int64_t bucket = duet__pow2_at_least(n_items), n_verify = n_items - n_plain;
    int64_t grows = 0; /* rows per (verify) item of the step's graph; 0: no graph */
    if (dm->opts.cuda_graphs && !(dm->opts.mirror_out && hook != NULL) &&
        n_items <= dm->imax_items) {
        const int64_t R = n_verify * vrows + (bucket - n_verify);
        const int64_t pad_rows = n_verify * vrows + n_plain - n_rows_real; /* with mixed_ok */
        if (max_tokens == 1 && !any_all && !any_verify)
            grows = 1;
        else if (any_verify && mixed_ok && vrows <= dm->split_rows &&
                 vrows <= dm->opts.page_tokens && R <= dm->T && R <= dm->logit_rows_cap &&
                 (pad_rows == 0 || (duet__pad_pays(dm, n_rows_real, pad_rows) &&
                                    duet__pad_fits(dm, items, n_items, vrows))))
            grows = vrows;
    }
    const int use_graph = grows > 0, graph_verify = use_graph && any_verify;
    const int64_t n_eff = use_graph ? bucket : n_items;

    /* metadata (padding items of a bucket use the spare page and slot) */
    int64_t row = 0;
    duet_cuda_sample_params_t *pp = (duet_cuda_sample_params_t *)(mh + ml->params);
    for (int64_t i = 0; i < n_eff; i++) {
        const int real = i < n_items;
        const duet_batch_item_t *it = real ? &items[i] : NULL;
        const int64_t nt = !real ? 1 : graph_verify && it->verify ? grows : it->n_tokens;
        const int64_t pos0 = real ? it->seq->n_tokens : 0;
        mh[ml->item_row0 + i] = (int32_t)row;
        mh[ml->item_pos0 + i] = (int32_t)pos0;
        mh[ml->item_slot + i] =
            real ? (it->seq->kda_slot >= 0 ? it->seq->kda_slot : 0) : dm->kda_spare_slot;
        mh[ml->item_verify + i] = real ? it->verify != 0 : 0;
        mh[ml->item_replay + i] = real ? (int32_t)it->seq->n_replay : 0;
        int32_t *pg = mh + ml->item_pages + i * dm->step.max_pages;
        if (dm->kv_host != NULL) {
            if (real) {
                memcpy(pg, it->seq->pages, sizeof(int32_t) * (size_t)it->seq->n_pages);
                duet__pad_pages(dm, pg, it->seq, pos0 + nt);
            } else {
                pg[0] = (int32_t)dm->kv_spare_page;
            }
        }
        const int64_t nreal = real ? it->n_tokens : nt; /* rows past it: padding */
        for (int64_t t = 0; t < nt; t++, row++) {
            mh[ml->row_item + row] = (int32_t)i;
            mh[ml->row_pos + row] = (int32_t)(pos0 + t);
            mh[ml->tokens + row] = real && t < nreal ? it->tokens[t] : 0;
        }
        /* the item's logits rows are the last nl of its own rows, each with sampling parameters
         * (greedy, and ignored, unless the item draws its token here); in a verify graph every
         * row is a logits row, padding rows too, in row order (duet__enqueue's head then needs
         * no gather; duet__logit_row0 finds an item's) */
        const int64_t end = row - (nt - nreal);
        const int64_t nl = real ? duet__logit_rows(it, use_graph) : 1;
        const int64_t l0 = graph_verify ? row - nt : end - nl, nemit = graph_verify ? nt : nl;
        for (int64_t t = 0; t < nemit; t++) {
            duet_cuda_sample_params_t p = {.temperature = 0.0f, .top_k = 0, .top_p = 1.0f, .u = 0};
            const int own = l0 + t >= end - nl && l0 + t < end;
            if (real && own && it->logits_mode == DUET_LOGITS_TOKEN) {
                p.temperature = it->sampling.temperature;
                p.top_k =
                    (int32_t)(it->sampling.top_k > INT32_MAX ? INT32_MAX : it->sampling.top_k);
                p.top_p = it->sampling.top_p;
                p.u = it->u;
            }
            mh[ml->logit_rows + n_logits] = (int32_t)(l0 + t);
            pp[n_logits++] = p;
        }
    }
    mh[ml->item_row0 + n_eff] = (int32_t)row;

    duet__shape_t sh = {.n_items = n_eff,
                        .n_rows = row,
                        .n_logit_rows = n_logits,
                        .sample = any_token ? (any_sampled ? 2 : 1) : 0,
                        .rows = (int)grows,
                        .plain = graph_verify ? (int)(n_eff - n_verify) : 0};
    sh.x_ctx = use_graph ? 0 : duet__mla_x_step(dm, items, n_items);
    /* a graph launches the replay whenever the model has a pool, as its shape is fixed */
    sh.replay = dm->replay_dev != NULL && (use_graph || any_replay);
    duet__mla_x_steps += sh.x_ctx > 0;
    dm->step.n_items = (int32_t)n_eff;
    dm->step.n_rows = (int32_t)row;
    dm->step.max_item_tokens = (int32_t)chunk_tokens;
    dm->step.max_split_rows = (int32_t)split_rows;
    dm->step.any_verify = any_verify;
    dm->step.all_verify = any_verify && n_verify == n_eff; /* a bucket's padding items are plain */

    CU(cudaMemcpyAsync(dm->meta_d, mh, sizeof(int32_t) * ml->total, cudaMemcpyHostToDevice,
                       dm->stream),
       "step metadata");
    if (use_graph) {
        TRY(duet__graph_launch(dm, &sh));
        duet__verify_graph_steps += graph_verify;
        duet__mixed_graph_steps +=
            graph_verify && (n_plain > 0 || row != n_rows_real + (n_eff - n_items));
    } else if (n_logits <= dm->logit_rows_cap) {
        TRY(duet__enqueue(dm, &sh, items, hook, hook_user));
    } else {
        /* more logits rows than the buffer holds (DUET_LOGITS_ALL of a long chunk): the body
         * once without logits, then the head in slices */
        duet__shape_t body = sh;
        body.n_logit_rows = 0;
        TRY(duet__enqueue(dm, &body, items, hook, hook_user));
    }

    /* outputs: copy logits rows to the items' buffers, tokens to theirs */
    const int64_t V = c->vocab_size, D = c->hidden_size;
    int64_t lr = 0; /* logits row of the next item (outside verify graphs) */
    for (int64_t done = 0; done < n_logits;) {
        int64_t slice = n_logits - done;
        if (n_logits > dm->logit_rows_cap) { /* sliced head */
            slice = slice < dm->logit_rows_cap ? slice : dm->logit_rows_cap;
            TRY(duet_cuda_gather_rows(dm->stream, dm->xn, dm->x, D,
                                      dm->meta_d + ml->logit_rows + done, slice));
            TRY(duet_cuda_rmsnorm(dm->stream, dm->xn, D, dm->xn, D, dm->final_norm, slice, D,
                                  c->rms_norm_eps));
            TRY(duet_cuda_gemm_matmul(dm->gemm, dm->stream, dm->logits, V, dm->xn, D, slice,
                                      &dm->lm_head, 0, dm->gemm_flags));
            /* the slice's tokens, as the unsliced step draws them in duet__enqueue */
            if (sh.sample != 0)
                TRY(duet__draw(dm, sh.sample, dm->logits, slice,
                               (const duet_cuda_sample_params_t *)(dm->meta_d + ml->params) + done,
                               dm->token_out + done));
        }
        /* walk the items whose logits rows fall in [done, done + slice) */
        for (int64_t i = 0; i < n_items; i++) {
            duet_batch_item_t *it = &items[i];
            const int64_t nr = duet__logit_rows(it, use_graph);
            const int64_t first = graph_verify ? duet__logit_row0(dm, it, i, nr) : lr;
            const int64_t last = first + nr; /* this item's rows [first, last) */
            lr += nr;
            if (it->logits_mode != DUET_LOGITS_LAST && it->logits_mode != DUET_LOGITS_ALL)
                continue;
            int64_t a = first > done ? first : done, b = last < done + slice ? last : done + slice;
            if (a >= b)
                continue;
            CU(cudaMemcpyAsync(it->logits + (a - first) * V, dm->logits + (a - done) * V,
                               sizeof(float) * (size_t)((b - a) * V), cudaMemcpyDeviceToHost,
                               dm->stream),
               "logits device → host");
        }
        lr = 0;
        done += slice;
        if (n_logits > dm->logit_rows_cap)
            CU(cudaStreamSynchronize(dm->stream), "logits slice");
    }
    if (any_token)
        CU(cudaMemcpyAsync(dm->token_out_h, dm->token_out, sizeof(int32_t) * (size_t)n_logits,
                           cudaMemcpyDeviceToHost, dm->stream),
           "tokens device → host");
    CU(cudaStreamSynchronize(dm->stream), "step");
    if (any_token) {
        int64_t k = 0;
        for (int64_t i = 0; i < n_items; i++) {
            duet_batch_item_t *it = &items[i];
            if (graph_verify)
                k = duet__logit_row0(dm, it, i, duet__logit_rows(it, use_graph));
            if (it->logits_mode == DUET_LOGITS_TOKEN)
                *it->token_out = dm->token_out_h[k];
            else if (it->logits_mode == DUET_LOGITS_ARGMAX)
                memcpy(it->token_out, dm->token_out_h + k, sizeof(int32_t) * (size_t)it->n_tokens);
            k += duet__logit_rows(it, use_graph);
        }
    }
    /* a graph step has no hook points inside: report every layer as done now */
    if (use_graph && hook != NULL)
        for (int64_t l = 0; l < c->num_layers; l++)
            duet__run_hook(dm, hook, hook_user, l);
    return DUET_OK;
}

#endif /* DUET_HAVE_CUDA */

const duet_backend_ops_t duet_backend_cuda_ops = {
    .name = "cuda",
    .device = DUET_DEVICE_CUDA,
    .compute_dtypes =
        DUET_BACKEND_DTYPE_BIT(DUET_DTYPE_F32) | DUET_BACKEND_DTYPE_BIT(DUET_DTYPE_BF16),
    .kv_dtypes = DUET_BACKEND_DTYPE_BIT(DUET_DTYPE_F32) | DUET_BACKEND_DTYPE_BIT(DUET_DTYPE_BF16),
    .caps = DUET_BACKEND_CAP_RANDOM_WEIGHTS | DUET_BACKEND_CAP_TUNE | DUET_BACKEND_CAP_VERIFY,
    .probe = duet__cuda_probe,
    .create = duet__cuda_create,
#ifdef DUET_HAVE_CUDA
    .destroy = duet__cuda_destroy,
    .describe = duet__cuda_describe,
    .seq_open = duet__cuda_seq_open,
    .seq_set_filled = duet__cuda_seq_set_filled,
    .seq_close = NULL,
    .forward = duet__cuda_forward,
    .pool_mem = duet__cuda_pool_mem,
    .seq_state_copy = duet__cuda_seq_state_copy,
    .seq_kv_copy = duet__cuda_seq_kv_copy,
    .seq_replay = duet__cuda_seq_replay,
#else /* create refuses, so no instance reaches the rest */
#endif
};
