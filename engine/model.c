/*
 * The forward pass of Kimi Linear on the CPU backend (docs/model.md is the specification,
 * transformers 5.17's KimiLinearForCausalLM the reference it is tested against).
 *
 * Shape of one step: the batch's new tokens are stacked into T rows. Every projection, norm and
 * FFN runs once over all T rows; the mixers' per-sequence parts run per (sequence, head) on the
 * thread pool. Choices worth knowing:
 * - MLA always runs in the weight-absorbed form (prefill too): queries are mapped into the
 *   latent space with W_UK, attention runs over the cached latent c and k_r (r + dr dims), and
 *   W_UV is applied once to the r-dim result. It is the same function as transformers' expanded
 *   form up to fp32 rounding, and it is the only form that reads the paged cache directly.
 * - KDA uses the recurrent form for single-token steps and the chunked form otherwise, as
 *   transformers does for decode vs. prefill.
 * - Norm eps: layer norms and the KDA output norm use rms_norm_eps; q_a_layernorm and
 *   kv_a_layernorm use 1e-6, because transformers builds them with its default eps.
 * - Small per-layer vectors (norm weights, conv taps, dt_bias, A_log, router bias) are converted
 *   to fp32 once at load; big matrices stay in their stored dtype and the GEMM converts them.
 */
#include "engine/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "engine/checkpoint.h"
#include "engine/kda.h"
#include "engine/model_cuda.h"
#include "engine/weights.h"

#define DUET_MLA_NORM_EPS 1e-6f /* q_a_layernorm / kv_a_layernorm (transformers' default) */
#define DUET_L2_EPS       1e-6f

typedef struct {
    float *conv_w; /* (3*H*K, W) q, k, v taps, fp32, owned */
    float *dt_bias; /* (H*K) */
    float *neg_A;   /* (H) = -exp(A_log) */
    float *o_norm;  /* (K) */
} duet__kda_f32_t;

typedef struct {
    float        *wuk_t;   /* (n, r, dn): W_UK[h]ᵀ, fp32, owned */
    duet_tensor_t wuk_t_h; /* template view of one head's (r, dn), data set per head */
} duet__mla_f32_t;

typedef struct {
    float *bias; /* (E) e_score_correction_bias, fp32, owned */
} duet__moe_f32_t;

struct duet_model {
    duet_model_config_t cfg;
    duet_model_opts_t   opts;
    duet_checkpoint_t  *ck;      /* owned; weights are views into its mmaps */
    duet_weights_t      w;       /* owned tables */
    duet_kernels_t     *k;       /* owned */
    duet_kv_pool_t     *kv;      /* owned, NULL when there are no MLA layers */
    duet_kda_pool_t    *kda;     /* owned, NULL when there are no KDA layers */
    int64_t             layer_sub[DUET_MAX_LAYERS]; /* index among layers of the same mixer */
    duet__kda_f32_t    *kda_f32; /* [num_layers], owned */
    duet__mla_f32_t    *mla_f32; /* [num_layers], owned */
    duet__moe_f32_t    *moe_f32; /* [num_layers], owned */
    duet_cuda_model_t  *dev;     /* owned; the CUDA forward pass, NULL on the CPU */
    duet_sampler_t     *sampler; /* owned; DUET_LOGITS_TOKEN on the CPU */
    float              *tok_logits; /* (vocab) logits of a DUET_LOGITS_TOKEN item, CPU */
    duet_model_layer_hook_fn layer_hook; /* NULL = none */
    void                    *layer_hook_user;

    /* sequence table */
    int64_t  max_pages_per_seq;
    int32_t *page_table; /* (max_seqs, max_pages_per_seq), owned */
    uint8_t *seq_used;   /* (max_seqs), owned */

    /* workspace: one allocation, carved; T = max_batch_tokens */
    float  *ws;          /* owned */
    float  *x;           /* (T, D) residual stream */
    float  *xn;          /* (T, D) normed input of a sub-layer */
    float  *proj;        /* (T, 3*H*K) KDA pre-conv q|k|v */
    float  *qkv;         /* (T, 3*H*K) KDA post-conv q|k|v */
    float  *fa;          /* (T, K) */
    float  *gk;          /* (T, H*K) KDA log decay g */
    float  *beta;        /* (T, H) */
    float  *ga;          /* (T, K) */
    float  *gate;        /* (T, H*K) output gate pre-activation */
    float  *o;           /* (T, max(H*K, n*dv)) mixer output before o_proj */
    float  *mq;          /* (T, n*(dn+dr)) MLA queries */
    float  *mqa;         /* (T, q_lora) */
    float  *ckr;         /* (T, r+dr) */
    float  *qhat;        /* (T, n, r) absorbed queries */
    float  *lat;         /* (T, n, r) attention result in latent space */
    float  *f1;          /* (T, Imax) FFN gate */
    float  *f2;          /* (T, Imax) FFN up */
    float  *router;      /* (T, E) */
    int32_t *topk_idx;   /* (T, top_k) */
    float   *topk_w;     /* (T, top_k) */
    int32_t *exp_rows;   /* (T * top_k) rows grouped by expert */
    float   *exp_wts;    /* (T * top_k) */
    int64_t *exp_off;    /* (E + 1) */
    float   *xg;         /* (T, D) gathered rows of one expert */
    float   *eo;         /* (T, D) expert output */
    float   *thr_scratch; /* (n_threads, per_thread) */
    int64_t  per_thread;  /* floats of scratch per thread */
    int64_t *item_row0;   /* (T + 1) first row of each item of the current step */
};

/* ---- small helpers --------------------------------------------------------------------- */

/* Hot per-head loops get AVX2/FMA and AVX-512 clones beside the baseline (picked at load). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DUET_MODEL_CLONES __attribute__((target_clones("avx512f", "arch=haswell", "default")))
#else
#define DUET_MODEL_CLONES
#endif

/* Dot product with 8 independent partial sums: the explicit lanes let the compiler vectorise
 * without reassociating (no -ffast-math). */
static inline float duet__dot(const float *a, const float *b, int64_t n)
{
    float   acc[8] = {0};
    int64_t i      = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++)
            acc[k] += a[i + k] * b[i + k];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++)
        s += a[i] * b[i];
    return s;
}

static float *duet__to_f32(const duet_tensor_t *t)
{
    int64_t n = duet_tensor_numel(t);
    float  *p = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    if (p != NULL)
        duet_convert_to_f32(p, t->data, t->dtype, n);
    return p;
}

static duet_tensor_t duet__f32_view(float *data, int64_t rows, int64_t cols)
{
    duet_tensor_t t = {.data = data, .dtype = DUET_DTYPE_F32, .device = DUET_DEVICE_CPU,
                       .ndim = 2, .shape = {rows, cols}};
    return t;
}

/* Rows [r0, r0 + n) of a 2-D weight, as a view. */
static duet_tensor_t duet__row_view(const duet_tensor_t *w, int64_t r0, int64_t n)
{
    duet_tensor_t t = *w;
    int64_t       cols = w->shape[w->ndim - 1];
    t.data     = (uint8_t *)w->data + (size_t)(r0 * cols) * duet_dtype_size(w->dtype);
    t.ndim     = 2;
    t.shape[0] = n;
    t.shape[1] = cols;
    return t;
}

static inline float duet__sigmoid(float x)
{
    return 1.0f / (1.0f + expf(-x));
}

static inline float duet__silu(float x)
{
    return x / (1.0f + expf(-x));
}

static inline float duet__softplus(float x)
{
    return x > 20.0f ? x : log1pf(expf(x));
}

void duet_model_opts_default(duet_model_opts_t *opts)
{
    memset(opts, 0, sizeof(*opts));
    opts->n_threads        = 0;
    opts->max_batch_tokens = 512;
    opts->max_seqs         = 8;
    opts->max_seq_len      = 4096;
    opts->page_tokens      = 128;
    opts->kv_pages         = 0;
    opts->device           = DUET_DEVICE_CPU;
    opts->dtype            = DUET_MODEL_DTYPE_AUTO;
    opts->compute_dtype    = DUET_DTYPE_F32;
    opts->kv_dtype         = DUET_DTYPE_F32;
    opts->cuda_graphs      = 1;
}

duet_status_t duet_model_device_parse(const char *s, duet_device_kind_t *dev_p)
{
    if (s != NULL && strcmp(s, "cpu") == 0) {
        *dev_p = DUET_DEVICE_CPU;
    } else if (s != NULL && strcmp(s, "cuda") == 0) {
        *dev_p = DUET_DEVICE_CUDA;
    } else if (s != NULL && strcmp(s, "auto") == 0) {
        /* a visible GPU this build has no code for: the CPU, and say why */
        char why[256];
        *dev_p = DUET_DEVICE_CPU;
        if (duet_cuda_device_usable(why, sizeof(why)))
            *dev_p = DUET_DEVICE_CUDA;
        else if (duet_cuda_device_count() > 0)
            DUET_LOG_WARN("--device auto: %s; running on the CPU", why);
    } else {
        return duet_error_set(DUET_ERR_INVALID, "device '%s': expected auto, cpu or cuda",
                              s != NULL ? s : "(null)");
    }
    return DUET_OK;
}

const char *duet_model_device_name(duet_device_kind_t dev)
{
    return dev == DUET_DEVICE_CUDA ? "cuda" : "cpu";
}

static const char *const duet__model_dtype_names[] = {"auto", "f32", "bf16"};

duet_status_t duet_model_dtype_parse(const char *s, duet_model_dtype_t *dt_p)
{
    for (int i = 0; s != NULL && i < 3; i++)
        if (strcmp(s, duet__model_dtype_names[i]) == 0) {
            *dt_p = (duet_model_dtype_t)i;
            return DUET_OK;
        }
    return duet_error_set(DUET_ERR_INVALID, "dtype '%s': expected auto, f32 or bf16",
                          s != NULL ? s : "(null)");
}

const char *duet_model_dtype_name(duet_model_dtype_t dt)
{
    return (unsigned)dt < 3 ? duet__model_dtype_names[dt] : "?";
}

duet_status_t duet_model_dtype_resolve(duet_device_kind_t dev, duet_dtype_t ckpt,
                                       duet_model_dtype_t req, duet_dtype_t *out_p)
{
    if ((dev != DUET_DEVICE_CPU && dev != DUET_DEVICE_CUDA) ||
        (ckpt != DUET_DTYPE_F32 && ckpt != DUET_DTYPE_BF16 && ckpt != DUET_DTYPE_F16) ||
        (unsigned)req > DUET_MODEL_DTYPE_BF16)
        return duet_error_set(DUET_ERR_INVALID,
                              "dtype: device %d, checkpoint dtype %d, request %d: not a known value",
                              (int)dev, (int)ckpt, (int)req);
    if (dev == DUET_DEVICE_CPU)
        *out_p = DUET_DTYPE_F32;
    else if (req == DUET_MODEL_DTYPE_AUTO)
        *out_p = ckpt == DUET_DTYPE_BF16 ? DUET_DTYPE_BF16 : DUET_DTYPE_F32;
    else
        *out_p = req == DUET_MODEL_DTYPE_BF16 ? DUET_DTYPE_BF16 : DUET_DTYPE_F32;
    return DUET_OK;
}

void duet_model_describe_backend(const duet_model_t *m, char *buf, size_t cap)
{
    if (m->dev != NULL)
        snprintf(buf, cap, "cuda, %s weights, %s KV, graphs %s",
                 duet_dtype_name(m->opts.compute_dtype), duet_dtype_name(m->opts.kv_dtype),
                 m->opts.cuda_graphs ? "on" : "off");
    else
        snprintf(buf, cap, "cpu, %d threads (%s)", duet_kernels_n_threads(m->k),
                 duet_kernels_cpu_isa(m->k));
}

void duet_model_device_pools(duet_model_t *m, void **kv, size_t *kv_bytes, void **kda,
                             size_t *kda_bytes)
{
    *kv = *kda = NULL;
    *kv_bytes = *kda_bytes = 0;
    if (m->dev != NULL)
        duet_cuda_model_pools(m->dev, kv, kv_bytes, kda, kda_bytes);
}

const duet_model_config_t *duet_model_config(const duet_model_t *m)
{
    return &m->cfg;
}

const duet_model_opts_t *duet_model_opts(const duet_model_t *m)
{
    return &m->opts;
}

duet_kv_pool_t *duet_model_kv_pool(duet_model_t *m)
{
    return m->kv;
}

duet_kda_pool_t *duet_model_kda_pool(duet_model_t *m)
{
    return m->kda;
}

/* ---- load ---------------------------------------------------------------------------- */

static duet_status_t duet__model_prepare_f32(duet_model_t *m)
{
    const duet_model_config_t *c = &m->cfg;
    const int64_t              HK = c->kda_heads * c->kda_head_dim, W = c->conv_kernel;

    m->kda_f32 = calloc((size_t)c->num_layers, sizeof(*m->kda_f32));
    m->mla_f32 = calloc((size_t)c->num_layers, sizeof(*m->mla_f32));
    m->moe_f32 = calloc((size_t)c->num_layers, sizeof(*m->moe_f32));
    if (m->kda_f32 == NULL || m->mla_f32 == NULL || m->moe_f32 == NULL)
        return DUET_FAIL(DUET_ERR_NOMEM, "model: out of memory");
    for (int64_t l = 0; l < c->num_layers; l++) {
        const duet_layer_weights_t *lw = &m->w.layers[l];
        if (c->mixer[l] == DUET_MIXER_KDA) {
            duet__kda_f32_t *kf = &m->kda_f32[l];
            kf->conv_w          = malloc(sizeof(float) * (size_t)(3 * HK * W));
            kf->dt_bias         = duet__to_f32(&lw->kda.dt_bias);
            kf->neg_A           = duet__to_f32(&lw->kda.A_log);
            kf->o_norm          = duet__to_f32(&lw->kda.o_norm);
            if (kf->conv_w == NULL || kf->dt_bias == NULL || kf->neg_A == NULL ||
                kf->o_norm == NULL)
                return DUET_FAIL(DUET_ERR_NOMEM, "model: out of memory");
            duet_convert_to_f32(kf->conv_w, lw->kda.q_conv.data, lw->kda.q_conv.dtype, HK * W);
            duet_convert_to_f32(kf->conv_w + HK * W, lw->kda.k_conv.data, lw->kda.k_conv.dtype,
                                HK * W);
            duet_convert_to_f32(kf->conv_w + 2 * HK * W, lw->kda.v_conv.data,
                                lw->kda.v_conv.dtype, HK * W);
            for (int64_t h = 0; h < c->kda_heads; h++)
                kf->neg_A[h] = -expf(kf->neg_A[h]);
        } else {
            const int64_t n = c->mla_heads, dn = c->qk_nope_head_dim, dv = c->v_head_dim,
                          r = c->kv_lora_rank;
            duet__mla_f32_t *mf = &m->mla_f32[l];
            float           *kvb = duet__to_f32(&lw->mla.kv_b_proj); /* (n*(dn+dv), r) */
            mf->wuk_t            = malloc(sizeof(float) * (size_t)(n * r * dn));
            if (kvb == NULL || mf->wuk_t == NULL) {
                free(kvb);
                return DUET_FAIL(DUET_ERR_NOMEM, "model: out of memory");
            }
            for (int64_t h = 0; h < n; h++)
                for (int64_t i = 0; i < dn; i++)
                    for (int64_t j = 0; j < r; j++)
                        mf->wuk_t[(h * r + j) * dn + i] = kvb[(h * (dn + dv) + i) * r + j];
            free(kvb);
            mf->wuk_t_h = duet__f32_view(mf->wuk_t, r, dn);
        }
        if (c->ffn[l] == DUET_FFN_MOE) {
            m->moe_f32[l].bias = duet__to_f32(&lw->moe.gate_bias);
            if (m->moe_f32[l].bias == NULL)
                return DUET_FAIL(DUET_ERR_NOMEM, "model: out of memory");
        }
    }
    return DUET_OK;
}

static duet_status_t duet__model_alloc_ws(duet_model_t *m)
{
    const duet_model_config_t *c  = &m->cfg;
    const int64_t              T  = m->opts.max_batch_tokens, D = c->hidden_size;
    const int64_t              HK = c->kda_heads * c->kda_head_dim, K = c->kda_head_dim;
    const int64_t n = c->mla_heads, dqk = c->qk_nope_head_dim + c->qk_rope_head_dim,
                  r = c->kv_lora_rank, dr = c->qk_rope_head_dim;
    int64_t imax = c->dense_intermediate;
    if (c->n_moe_layers > 0) {
        if (c->moe_intermediate * c->n_shared_experts > imax)
            imax = c->moe_intermediate * c->n_shared_experts;
        if (c->moe_intermediate > imax)
            imax = c->moe_intermediate;
    }
    const int64_t has_kda = c->n_kda_layers > 0, has_mla = c->n_mla_layers > 0;
    const int64_t omax    = (has_kda ? HK : 0) > (has_mla ? n * c->v_head_dim : 0)
                                ? HK
                                : n * c->v_head_dim;
    const int64_t E = c->n_experts > 0 ? c->n_experts : 1, tk = c->top_k > 0 ? c->top_k : 1;
    const int64_t nthr = duet_kernels_n_threads(m->k);

    /* Per-thread scratch: KDA chunk scratch, or MLA scores over a whole sequence. */
    int64_t per = 64;
    if (has_kda) {
        int64_t s = duet_kda_chunk_scratch_floats(K, K);
        if (s > per)
            per = s;
    }
    if (has_mla && m->opts.max_seq_len + 64 > per)
        per = m->opts.max_seq_len + 64;
    m->per_thread = per;

    struct {
        float **p;
        int64_t n;
    } parts[] = {
        {&m->x, T * D},
        {&m->xn, T * D},
        {&m->proj, has_kda * T * 3 * HK},
        {&m->qkv, has_kda * T * 3 * HK},
        {&m->fa, has_kda * T * K},
        {&m->gk, has_kda * T * HK},
        {&m->beta, has_kda * T * c->kda_heads},
        {&m->ga, has_kda * T * K},
        {&m->gate, has_kda * T * HK},
        {&m->o, T * omax},
        {&m->mq, has_mla * T * n * dqk},
        {&m->mqa, has_mla * T * c->q_lora_rank},
        {&m->ckr, has_mla * T * (r + dr)},
        {&m->qhat, has_mla * T * n * r},
        {&m->lat, has_mla * T * n * r},
        {&m->f1, T * imax},
        {&m->f2, T * imax},
        {&m->router, T * E},
        {&m->topk_w, T * tk},
        {&m->exp_wts, T * tk},
        {&m->xg, T * D},
        {&m->eo, T * D},
        {&m->thr_scratch, nthr * per},
    };
    int64_t total = 0;
    for (size_t i = 0; i < sizeof(parts) / sizeof(parts[0]); i++)
        total += (parts[i].n + 15) / 16 * 16;
    m->ws = calloc((size_t)total, sizeof(float));
    m->topk_idx = calloc((size_t)(T * tk), sizeof(int32_t));
    m->exp_rows = calloc((size_t)(T * tk), sizeof(int32_t));
    m->exp_off  = calloc((size_t)(E + 1), sizeof(int64_t));
    m->item_row0 = calloc((size_t)(T + 1), sizeof(int64_t));
    if (m->ws == NULL || m->topk_idx == NULL || m->exp_rows == NULL || m->exp_off == NULL ||
        m->item_row0 == NULL)
        return DUET_FAIL(DUET_ERR_NOMEM, "model: cannot allocate %.1f MiB of workspace",
                         (double)total * 4.0 / 1048576.0);
    float *cur = m->ws;
    for (size_t i = 0; i < sizeof(parts) / sizeof(parts[0]); i++) {
        *parts[i].p = cur;
        cur += (parts[i].n + 15) / 16 * 16;
    }
    DUET_LOG_DEBUG("model: workspace %.1f MiB for %lld rows", (double)total * 4.0 / 1048576.0,
                   (long long)T);
    return DUET_OK;
}

static duet_status_t duet__check_opts(const duet_model_opts_t *opts)
{
    if (opts->max_batch_tokens <= 0 || opts->max_seqs <= 0 || opts->max_seq_len <= 0 ||
        opts->page_tokens <= 0 || opts->kv_pages < 0 || opts->n_threads < 0)
        return DUET_FAIL(DUET_ERR_INVALID, "model: invalid options (batch tokens %lld, seqs %lld, "
                         "seq len %lld, page tokens %lld, pages %lld)",
                         (long long)opts->max_batch_tokens, (long long)opts->max_seqs,
                         (long long)opts->max_seq_len, (long long)opts->page_tokens,
                         (long long)opts->kv_pages);
    if (opts->device != DUET_DEVICE_CPU && opts->device != DUET_DEVICE_CUDA)
        return DUET_FAIL(DUET_ERR_INVALID, "model: unknown device %d", (int)opts->device);
    if (opts->kv_dtype != DUET_DTYPE_F32 &&
        !(opts->kv_dtype == DUET_DTYPE_BF16 && opts->device == DUET_DEVICE_CUDA))
        return DUET_FAIL(DUET_ERR_UNSUPPORTED, "model: KV cache dtype %s is not supported on %s "
                         "(F32 everywhere, BF16 on cuda)", duet_dtype_name(opts->kv_dtype),
                         duet_model_device_name(opts->device));
    if ((unsigned)opts->dtype > DUET_MODEL_DTYPE_BF16)
        return DUET_FAIL(DUET_ERR_INVALID, "model: unknown dtype request %d", (int)opts->dtype);
    return DUET_OK;
}

/* Pools, sequence table, sampler and the backend, once m->cfg (and m->w for a checkpoint) are
 * set. from_checkpoint == 0: random device weights from `seed`. */
static duet_status_t duet__model_finish(duet_model_t *m, int from_checkpoint, uint64_t seed)
{
    const duet_model_config_t *c    = &m->cfg;
    const duet_model_opts_t    opts = m->opts;
    duet_status_t              st;

    int64_t n_kda = 0, n_mla = 0;
    for (int64_t l = 0; l < c->num_layers; l++)
        m->layer_sub[l] = c->mixer[l] == DUET_MIXER_KDA ? n_kda++ : n_mla++;

    m->max_pages_per_seq = (opts.max_seq_len + opts.page_tokens - 1) / opts.page_tokens;
    if (n_mla > 0) {
        duet_kv_pool_desc_t kd = {
            .page_tokens = opts.page_tokens,
            .n_pages     = opts.kv_pages > 0 ? opts.kv_pages : opts.max_seqs * m->max_pages_per_seq,
            .n_layers    = n_mla,
            .token_dim   = c->kv_lora_rank + c->qk_rope_head_dim,
            .dtype       = opts.kv_dtype,
        };
        if (opts.pool_alloc != NULL) {
            size_t bytes = duet_kv_pool_bytes_needed(&kd);
            kd.mem       = opts.pool_alloc(opts.pool_alloc_user, DUET_MODEL_POOL_KV, bytes);
            if (kd.mem == NULL)
                return DUET_FAIL(DUET_ERR_NOMEM, "model: the KV pool allocator gave no %zu bytes",
                                 bytes);
        }
        if ((st = duet_kv_pool_create(&kd, &m->kv)) != DUET_OK)
            return st;
    }
    if (n_kda > 0) {
        duet_kda_pool_desc_t sd = {
            .n_slots     = opts.max_seqs,
            .n_layers    = n_kda,
            .heads       = c->kda_heads,
            .head_dim    = c->kda_head_dim,
            .conv_kernel = c->conv_kernel,
        };
        if (opts.pool_alloc != NULL) {
            size_t bytes = duet_kda_pool_bytes_needed(&sd);
            sd.mem       = opts.pool_alloc(opts.pool_alloc_user, DUET_MODEL_POOL_KDA, bytes);
            if (sd.mem == NULL)
                return DUET_FAIL(DUET_ERR_NOMEM, "model: the KDA pool allocator gave no %zu bytes",
                                 bytes);
        }
        if ((st = duet_kda_pool_create(&sd, &m->kda)) != DUET_OK)
            return st;
    }
    m->page_table = calloc((size_t)(opts.max_seqs * m->max_pages_per_seq), sizeof(int32_t));
    m->seq_used   = calloc((size_t)opts.max_seqs, 1);
    if (m->page_table == NULL || m->seq_used == NULL)
        return DUET_FAIL(DUET_ERR_NOMEM, "model: out of memory");
    if (opts.device == DUET_DEVICE_CPU) {
        /* DUET_LOGITS_TOKEN on the CPU: the sampler and one row of logits (CUDA draws on the
         * device) */
        if ((st = duet_sampler_create(c->vocab_size, &m->sampler)) != DUET_OK)
            return st;
        m->tok_logits = malloc(sizeof(float) * (size_t)c->vocab_size);
        if (m->tok_logits == NULL)
            return DUET_FAIL(DUET_ERR_NOMEM, "model: out of memory");
        if ((st = duet_kernels_create(DUET_DEVICE_CPU, opts.n_threads, &m->k)) != DUET_OK ||
            (st = duet__model_prepare_f32(m)) != DUET_OK ||
            (st = duet__model_alloc_ws(m)) != DUET_OK)
            return st;
    } else {
        duet_cuda_model_host_t host, *hp = NULL;
        float **arr = NULL;
        if (from_checkpoint) {
            if ((st = duet__model_prepare_f32(m)) != DUET_OK)
                return st;
            const int64_t L = c->num_layers;
            arr = calloc((size_t)(6 * L), sizeof(float *));
            if (arr == NULL)
                return DUET_FAIL(DUET_ERR_NOMEM, "model: out of memory");
            for (int64_t l = 0; l < L; l++) {
                arr[l]         = m->kda_f32[l].conv_w;
                arr[L + l]     = m->kda_f32[l].dt_bias;
                arr[2 * L + l] = m->kda_f32[l].neg_A;
                arr[3 * L + l] = m->kda_f32[l].o_norm;
                arr[4 * L + l] = m->mla_f32[l].wuk_t;
                arr[5 * L + l] = m->moe_f32[l].bias;
            }
            host = (duet_cuda_model_host_t){.conv_w = arr, .dt_bias = arr + L,
                                            .neg_A = arr + 2 * L, .o_norm = arr + 3 * L,
                                            .wuk_t = arr + 4 * L, .moe_bias = arr + 5 * L};
            hp = &host;
        }
        st = duet_cuda_model_create(c, &opts, from_checkpoint ? &m->w : NULL, hp, seed, m->kv,
                                    m->kda, m->max_pages_per_seq, m->layer_sub, &m->dev);
        free(arr);
        if (st != DUET_OK)
            return st;
    }
    char be[160];
    duet_model_describe_backend(m, be, sizeof(be));
    DUET_LOG_INFO("model ready: %s, %lld KV pages of %lld tokens, %lld state slots", be,
                  (long long)(m->kv != NULL ? duet_kv_pool_desc(m->kv)->n_pages : 0),
                  (long long)opts.page_tokens, (long long)opts.max_seqs);
    return DUET_OK;
}

duet_status_t duet_model_load(const char *dir, const duet_model_opts_t *opts_in,
                              duet_model_t **m_p)
{
    duet_status_t     st;
    duet_model_opts_t opts;
    if (opts_in != NULL)
        opts = *opts_in;
    else
        duet_model_opts_default(&opts);
    if ((st = duet__check_opts(&opts)) != DUET_OK)
        return st;

    duet_model_t *m = calloc(1, sizeof(*m));
    if (m == NULL)
        return DUET_FAIL(DUET_ERR_NOMEM, "model: out of memory");
    m->opts = opts;

    st = duet_model_config_load(dir, &m->cfg);
    if (st != DUET_OK)
        goto err;
    char desc[512];
    duet_model_config_describe(&m->cfg, desc, sizeof(desc));
    DUET_LOG_INFO("model %s: %s", dir, desc);

    if ((st = duet_checkpoint_open(dir, &m->ck)) != DUET_OK ||
        (st = duet_weights_bind(m->ck, &m->cfg, &m->w)) != DUET_OK)
        goto err;
    const duet_dtype_t ck_dt = duet_checkpoint_dtype(m->ck);
    if ((st = duet_model_dtype_resolve(opts.device, ck_dt, opts.dtype, &m->opts.compute_dtype)) !=
        DUET_OK)
        goto err;
    if (opts.device == DUET_DEVICE_CPU && opts.dtype == DUET_MODEL_DTYPE_BF16)
        DUET_LOG_WARN("--dtype bf16 applies to cuda: the CPU engine computes in f32 (and reads "
                      "the %s weights as they are)",
                      duet_dtype_name(ck_dt));
    DUET_LOG_INFO("dtype %s: %s checkpoint, %s compute on %s", duet_model_dtype_name(opts.dtype),
                  duet_dtype_name(ck_dt), duet_dtype_name(m->opts.compute_dtype),
                  duet_model_device_name(opts.device));
    if ((st = duet__model_finish(m, 1, 0)) != DUET_OK)
        goto err;
    *m_p = m;
    return DUET_OK;

err:
    duet_model_free(m);
    return st;
}

duet_status_t duet_model_create_random(const duet_model_config_t *cfg,
                                       const duet_model_opts_t *opts, uint64_t seed,
                                       duet_model_t **m_p)
{
    duet_status_t st;
    if ((st = duet__check_opts(opts)) != DUET_OK)
        return st;
    if (opts->device != DUET_DEVICE_CUDA)
        return DUET_FAIL(DUET_ERR_UNSUPPORTED, "model: random weights are generated on a CUDA "
                         "device only");
    if (opts->dtype == DUET_MODEL_DTYPE_AUTO)
        return DUET_FAIL(DUET_ERR_INVALID, "model: random weights have no checkpoint dtype for "
                         "dtype auto to follow: ask for f32 or bf16");
    duet_model_t *m = calloc(1, sizeof(*m));
    if (m == NULL)
        return DUET_FAIL(DUET_ERR_NOMEM, "model: out of memory");
    m->opts = *opts;
    m->cfg  = *cfg;
    /* the checkpoint dtype does not matter for an explicit request */
    if ((st = duet_model_dtype_resolve(opts->device, DUET_DTYPE_F32, opts->dtype,
                                       &m->opts.compute_dtype)) != DUET_OK) {
        free(m);
        return st;
    }
    if ((st = duet__model_finish(m, 0, seed)) != DUET_OK) {
        duet_model_free(m);
        return st;
    }
    *m_p = m;
    return DUET_OK;
}

void duet_model_free(duet_model_t *m)
{
    if (m == NULL)
        return;
    if (m->kda_f32 != NULL)
        for (int64_t l = 0; l < m->cfg.num_layers; l++) {
            free(m->kda_f32[l].conv_w);
            free(m->kda_f32[l].dt_bias);
            free(m->kda_f32[l].neg_A);
            free(m->kda_f32[l].o_norm);
        }
    if (m->mla_f32 != NULL)
        for (int64_t l = 0; l < m->cfg.num_layers; l++)
            free(m->mla_f32[l].wuk_t);
    if (m->moe_f32 != NULL)
        for (int64_t l = 0; l < m->cfg.num_layers; l++)
            free(m->moe_f32[l].bias);
    free(m->kda_f32);
    free(m->mla_f32);
    free(m->moe_f32);
    free(m->ws);
    free(m->topk_idx);
    free(m->exp_rows);
    free(m->exp_off);
    free(m->item_row0);
    free(m->page_table);
    free(m->seq_used);
    duet_cuda_model_destroy(m->dev);
    duet_sampler_destroy(m->sampler);
    free(m->tok_logits);
    duet_kda_pool_destroy(m->kda);
    duet_kv_pool_destroy(m->kv);
    duet_kernels_destroy(m->k);
    duet_weights_free(&m->w);
    duet_checkpoint_close(m->ck);
    free(m);
}

/* ---- sequences ------------------------------------------------------------------------ */

duet_status_t duet_model_seq_open(duet_model_t *m, int64_t max_tokens, duet_seq_t *seq_p)
{
    if (max_tokens <= 0 || max_tokens > m->opts.max_seq_len)
        return duet_error_set(DUET_ERR_RANGE, "sequence of %lld tokens: the model holds 1..%lld",
                              (long long)max_tokens, (long long)m->opts.max_seq_len);
    int32_t id = -1;
    for (int64_t i = 0; i < m->opts.max_seqs; i++)
        if (!m->seq_used[i]) {
            id = (int32_t)i;
            break;
        }
    if (id < 0)
        return duet_error_set(DUET_ERR_NO_SPACE, "all %lld sequence slots are in use",
                              (long long)m->opts.max_seqs);
    int64_t  n_pages = 0;
    int32_t *pages   = m->page_table + (int64_t)id * m->max_pages_per_seq;
    if (m->kv != NULL) {
        n_pages          = (max_tokens + m->opts.page_tokens - 1) / m->opts.page_tokens;
        duet_status_t st = duet_kv_pool_alloc(m->kv, n_pages, pages);
        if (st != DUET_OK)
            return st;
        /* Stale KV of earlier owners is never read (attention stops at n_tokens), but zero
         * anyway so a cache dump of a fresh sequence is deterministic. A CUDA model's host pool
         * is only a staging mirror: touched only when mirrored. */
        const int host_zero = m->dev == NULL || m->opts.mirror_in || m->opts.mirror_out;
        for (int64_t p = 0; host_zero && p < n_pages; p++)
            memset(duet_kv_pool_block(m->kv, pages[p], 0), 0,
                   duet_kv_pool_block_bytes(m->kv) * (size_t)duet_kv_pool_desc(m->kv)->n_layers);
    }
    int32_t slot = -1;
    if (m->kda != NULL) {
        duet_status_t st = duet_kda_pool_alloc(m->kda, &slot);
        if (st != DUET_OK) {
            if (m->kv != NULL)
                duet_kv_pool_free(m->kv, pages, n_pages);
            return st;
        }
    }
    if (m->dev != NULL) {
        duet_seq_t tmp = {.pages = pages, .n_pages = n_pages, .kda_slot = slot};
        duet_status_t st = duet_cuda_model_seq_opened(m->dev, &tmp);
        if (st != DUET_OK) {
            if (m->kv != NULL)
                duet_kv_pool_free(m->kv, pages, n_pages);
            if (m->kda != NULL)
                duet_kda_pool_free(m->kda, slot);
            return st;
        }
    }
    m->seq_used[id] = 1;
    seq_p->id         = id;
    seq_p->n_tokens   = 0;
    seq_p->pages      = pages;
    seq_p->n_pages    = n_pages;
    seq_p->kda_slot   = slot;
    seq_p->cap_tokens = m->kv != NULL ? n_pages * m->opts.page_tokens : max_tokens;
    return DUET_OK;
}

duet_status_t duet_model_seq_set_filled(duet_model_t *m, duet_seq_t *seq, int64_t n_tokens)
{
    if (seq == NULL || seq->id < 0 || seq->id >= m->opts.max_seqs || !m->seq_used[seq->id])
        return duet_error_set(DUET_ERR_INVALID, "set_filled: not an open sequence");
    if (n_tokens < 0 || n_tokens > seq->cap_tokens || seq->n_tokens != 0)
        return duet_error_set(DUET_ERR_RANGE,
                              "set_filled: %lld tokens into a sequence of capacity %lld holding "
                              "%lld", (long long)n_tokens, (long long)seq->cap_tokens,
                              (long long)seq->n_tokens);
    if (m->dev != NULL) {
        duet_status_t st = duet_cuda_model_seq_filled(m->dev, seq, n_tokens);
        if (st != DUET_OK)
            return st;
    }
    seq->n_tokens = n_tokens;
    return DUET_OK;
}

void duet_model_set_layer_hook(duet_model_t *m, duet_model_layer_hook_fn fn, void *user)
{
    m->layer_hook      = fn;
    m->layer_hook_user = user;
}

void duet_model_seq_close(duet_model_t *m, duet_seq_t *seq)
{
    if (seq == NULL || seq->id < 0)
        return;
    DUET_ASSERT(seq->id < m->opts.max_seqs && m->seq_used[seq->id]);
    if (m->kv != NULL)
        duet_kv_pool_free(m->kv, seq->pages, seq->n_pages);
    if (m->kda != NULL)
        duet_kda_pool_free(m->kda, seq->kda_slot);
    m->seq_used[seq->id] = 0;
    seq->id              = -1;
    seq->n_pages         = 0;
}

/* ---- forward: shared state of one step ------------------------------------------------- */

typedef struct {
    duet_model_t            *m;
    const duet_batch_item_t *items;
    int64_t                  n_items;
    int64_t                  n_rows;
    int64_t                 *row0; /* (n_items + 1): first row of item i; model workspace */
} duet__step_t;

typedef struct {
    duet__step_t *st;
    int64_t       layer;
} duet__layer_ctx_t;

static inline const duet_batch_item_t *duet__item(const duet__step_t *st, int64_t i)
{
    return &st->items[i];
}

/* ---- KDA ----------------------------------------------------------------------------- */

/* Causal depthwise conv + SiLU over one (item, block of channels), then the window keeps the
 * last W-1 pre-conv inputs. Tokens run outside and channels inside, so rows are read
 * contiguously and the channel loop vectorises. */
#define DUET_CONV_BLOCK 64

DUET_MODEL_CLONES
static void duet__kda_conv_task(void *vctx, int64_t b, int64_t e, int tid)
{
    duet__layer_ctx_t         *lc = vctx;
    duet__step_t              *st = lc->st;
    duet_model_t              *m  = st->m;
    const duet_model_config_t *c  = &m->cfg;
    const int64_t C3 = 3 * c->kda_heads * c->kda_head_dim, W = c->conv_kernel;
    const int64_t nblk = (C3 + DUET_CONV_BLOCK - 1) / DUET_CONV_BLOCK;
    const float  *taps = m->kda_f32[lc->layer].conv_w;
    const int64_t sub  = m->layer_sub[lc->layer];

    for (int64_t idx = b; idx < e; idx++) {
        const int64_t            it = idx / nblk, c0 = (idx % nblk) * DUET_CONV_BLOCK;
        const int64_t            nc = C3 - c0 < DUET_CONV_BLOCK ? C3 - c0 : DUET_CONV_BLOCK;
        const duet_batch_item_t *item = duet__item(st, it);
        const int64_t            r0 = st->row0[it], n = item->n_tokens;
        float *win = duet_kda_pool_conv(m->kda, item->seq->kda_slot, sub); /* [C3][W-1] */
        /* the window transposed to [W-1][block] so every input row is contiguous */
        float hist[64][DUET_CONV_BLOCK]; /* W - 1 < 64, checked when the config is parsed */
        for (int64_t j = 0; j < W - 1; j++)
            for (int64_t ch = 0; ch < nc; ch++)
                hist[j][ch] = win[(c0 + ch) * (W - 1) + j];
        for (int64_t t = 0; t < n; t++) {
            float acc[DUET_CONV_BLOCK];
            for (int64_t ch = 0; ch < nc; ch++)
                acc[ch] = 0.0f;
            for (int64_t j = 0; j < W; j++) {
                int64_t      tau = t - (W - 1) + j;
                const float *u   = tau >= 0 ? m->proj + (r0 + tau) * C3 + c0 : hist[(W - 1) + tau];
                for (int64_t ch = 0; ch < nc; ch++)
                    acc[ch] += taps[(c0 + ch) * W + j] * u[ch];
            }
            float *out = m->qkv + (r0 + t) * C3 + c0;
            for (int64_t ch = 0; ch < nc; ch++)
                out[ch] = duet__silu(acc[ch]);
        }
        /* concat = window (W-1) ++ inputs (n); the new window is concat[n .. n+W-1) */
        for (int64_t j = 0; j < W - 1; j++) {
            int64_t      i   = n + j;
            const float *src = i < W - 1 ? hist[i] : m->proj + (r0 + i - (W - 1)) * C3 + c0;
            for (int64_t ch = 0; ch < nc; ch++)
                win[(c0 + ch) * (W - 1) + j] = src[ch];
        }
    }
}

/* Per row: g = -exp(A_log)·softplus(f_b f_a x + dt_bias), β = σ(b x), q,k L2-normalised,
 * q scaled by K^-1/2. */
static void duet__kda_prep_task(void *vctx, int64_t b, int64_t e, int tid)
{
    duet__layer_ctx_t         *lc = vctx;
    duet_model_t              *m  = lc->st->m;
    const duet_model_config_t *c  = &m->cfg;
    const int64_t H = c->kda_heads, K = c->kda_head_dim, HK = H * K, C3 = 3 * HK;
    const duet__kda_f32_t *kf    = &m->kda_f32[lc->layer];
    const float            scale = 1.0f / sqrtf((float)K);

    for (int64_t row = b; row < e; row++) {
        float *g = m->gk + row * HK;
        for (int64_t h = 0; h < H; h++)
            for (int64_t d = 0; d < K; d++) {
                int64_t i = h * K + d;
                g[i]      = kf->neg_A[h] * duet__softplus(g[i] + kf->dt_bias[i]);
            }
        float *beta = m->beta + row * H;
        for (int64_t h = 0; h < H; h++)
            beta[h] = duet__sigmoid(beta[h]);
        for (int64_t part = 0; part < 2; part++) {
            float *v = m->qkv + row * C3 + part * HK;
            for (int64_t h = 0; h < H; h++) {
                float *x  = v + h * K;
                float  ss = 0.0f;
                for (int64_t d = 0; d < K; d++)
                    ss += x[d] * x[d];
                float inv = 1.0f / sqrtf(ss + DUET_L2_EPS);
                if (part == 0)
                    inv *= scale;
                for (int64_t d = 0; d < K; d++)
                    x[d] *= inv;
            }
        }
    }
}

static void duet__kda_core_task(void *vctx, int64_t b, int64_t e, int tid)
{
    duet__layer_ctx_t         *lc = vctx;
    duet__step_t              *st = lc->st;
    duet_model_t              *m  = st->m;
    const duet_model_config_t *c  = &m->cfg;
    const int64_t H = c->kda_heads, K = c->kda_head_dim, HK = H * K, C3 = 3 * HK;
    const int64_t sub = m->layer_sub[lc->layer];

    for (int64_t idx = b; idx < e; idx++) {
        const int64_t            it = idx / H, h = idx % H;
        const duet_batch_item_t *item = duet__item(st, it);
        const int64_t            r0   = st->row0[it];
        duet_kda_head_io_t       io   = {
                    .q = m->qkv + r0 * C3 + h * K,          .q_stride = C3,
                    .k = m->qkv + r0 * C3 + HK + h * K,     .k_stride = C3,
                    .v = m->qkv + r0 * C3 + 2 * HK + h * K, .v_stride = C3,
                    .g = m->gk + r0 * HK + h * K,           .g_stride = HK,
                    .beta = m->beta + r0 * H + h,           .beta_stride = H,
                    .o = m->o + r0 * HK + h * K,            .o_stride = HK,
                    .n = item->n_tokens, .K = K, .V = K,
        };
        float *S = duet_kda_pool_state(m->kda, item->seq->kda_slot, sub) + h * K * K;
        if (item->n_tokens == 1)
            duet_kda_recurrent(&io, S);
        else
            duet_kda_chunked(&io, S, m->thr_scratch + (int64_t)tid * m->per_thread);
    }
}

/* o ← o_norm_w ⊙ o / sqrt(mean(o²) + eps) ⊙ σ(gate), per (row, head). */
static void duet__kda_out_task(void *vctx, int64_t b, int64_t e, int tid)
{
    duet__layer_ctx_t         *lc = vctx;
    duet_model_t              *m  = lc->st->m;
    const duet_model_config_t *c  = &m->cfg;
    const int64_t H = c->kda_heads, K = c->kda_head_dim, HK = H * K;
    const float  *w = m->kda_f32[lc->layer].o_norm;

    for (int64_t row = b; row < e; row++)
        for (int64_t h = 0; h < H; h++) {
            float       *o  = m->o + row * HK + h * K;
            const float *gt = m->gate + row * HK + h * K;
            float        ss = 0.0f;
            for (int64_t d = 0; d < K; d++)
                ss += o[d] * o[d];
            float inv = 1.0f / sqrtf(ss / (float)K + c->rms_norm_eps);
            for (int64_t d = 0; d < K; d++)
                o[d] = w[d] * (o[d] * inv) * duet__sigmoid(gt[d]);
        }
}

static duet_status_t duet__kda_layer(duet__step_t *st, int64_t l)
{
    duet_model_t              *m  = st->m;
    const duet_model_config_t *c  = &m->cfg;
    const duet_kda_weights_t  *w  = &m->w.layers[l].kda;
    const int64_t T = st->n_rows, H = c->kda_heads, K = c->kda_head_dim, HK = H * K, C3 = 3 * HK;
    const int64_t D = c->hidden_size;
    duet__layer_ctx_t lc = {.st = st, .layer = l};
    duet_status_t     s;

    if ((s = duet_k_matmul(m->k, m->proj, C3, m->xn, D, T, &w->q_proj, 0)) != DUET_OK ||
        (s = duet_k_matmul(m->k, m->proj + HK, C3, m->xn, D, T, &w->k_proj, 0)) != DUET_OK ||
        (s = duet_k_matmul(m->k, m->proj + 2 * HK, C3, m->xn, D, T, &w->v_proj, 0)) != DUET_OK ||
        (s = duet_k_matmul(m->k, m->fa, K, m->xn, D, T, &w->f_a_proj, 0)) != DUET_OK ||
        (s = duet_k_matmul(m->k, m->gk, HK, m->fa, K, T, &w->f_b_proj, 0)) != DUET_OK ||
        (s = duet_k_matmul(m->k, m->beta, H, m->xn, D, T, &w->b_proj, 0)) != DUET_OK ||
        (s = duet_k_matmul(m->k, m->ga, K, m->xn, D, T, &w->g_a_proj, 0)) != DUET_OK ||
        (s = duet_k_matmul(m->k, m->gate, HK, m->ga, K, T, &w->g_b_proj, 0)) != DUET_OK)
        return s;
    duet_k_parallel_for(m->k, st->n_items * ((C3 + DUET_CONV_BLOCK - 1) / DUET_CONV_BLOCK), 1,
                        duet__kda_conv_task, &lc);
    duet_k_parallel_for(m->k, T, 4, duet__kda_prep_task, &lc);
    duet_k_parallel_for(m->k, st->n_items * H, 1, duet__kda_core_task, &lc);
    duet_k_parallel_for(m->k, T, 8, duet__kda_out_task, &lc);
    return duet_k_matmul(m->k, m->x, D, m->o, HK, T, &w->o_proj, 1);
}

/* ---- MLA ----------------------------------------------------------------------------- */

/* Attention over the latent cache for one (item, head): every new token t of the item attends
 * to positions 0 .. pos+t. Scores in r + dr dims, result in r dims (absorbed form). */
DUET_MODEL_CLONES
static void duet__mla_attn_task(void *vctx, int64_t b, int64_t e, int tid)
{
    duet__layer_ctx_t         *lc = vctx;
    duet__step_t              *st = lc->st;
    duet_model_t              *m  = st->m;
    const duet_model_config_t *c  = &m->cfg;
    const int64_t n = c->mla_heads, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim;
    const int64_t r = c->kv_lora_rank, dqk = dn + dr, td = r + dr, PT = m->opts.page_tokens;
    const int64_t sub   = m->layer_sub[lc->layer];
    const float   scale = 1.0f / sqrtf((float)dqk);
    float        *sc    = m->thr_scratch + (int64_t)tid * m->per_thread;

    for (int64_t idx = b; idx < e; idx++) {
        const int64_t            it = idx / n, h = idx % n;
        const duet_batch_item_t *item = duet__item(st, it);
        const duet_seq_t        *seq  = item->seq;
        const int64_t            r0 = st->row0[it], pos0 = seq->n_tokens;
        for (int64_t t = 0; t < item->n_tokens; t++) {
            const int64_t row  = r0 + t, last = pos0 + t;
            const float  *qh   = m->qhat + (row * n + h) * r;
            const float  *qr   = m->mq + row * n * dqk + h * dqk + dn;
            float         mx   = -INFINITY;
            /* keys page by page: one block lookup per page, contiguous tokens inside */
            for (int64_t p0 = 0; p0 <= last; p0 += PT) {
                const float  *blk = (const float *)duet_kv_pool_block(m->kv, seq->pages[p0 / PT], sub);
                const int64_t ns  = last - p0 + 1 < PT ? last - p0 + 1 : PT;
                for (int64_t s = 0; s < ns; s++) {
                    const float *kv  = blk + s * td;
                    float        acc = (duet__dot(qh, kv, r) + duet__dot(qr, kv + r, dr)) * scale;
                    sc[p0 + s]       = acc;
                    mx               = acc > mx ? acc : mx;
                }
            }
            float sum = 0.0f;
            for (int64_t s = 0; s <= last; s++) {
                sc[s] = expf(sc[s] - mx);
                sum += sc[s];
            }
            float *out = m->lat + (row * n + h) * r;
            for (int64_t j = 0; j < r; j++)
                out[j] = 0.0f;
            for (int64_t p0 = 0; p0 <= last; p0 += PT) {
                const float  *blk = (const float *)duet_kv_pool_block(m->kv, seq->pages[p0 / PT], sub);
                const int64_t ns  = last - p0 + 1 < PT ? last - p0 + 1 : PT;
                for (int64_t s = 0; s < ns; s++) {
                    const float *kv = blk + s * td;
                    const float  p  = sc[p0 + s];
                    for (int64_t j = 0; j < r; j++)
                        out[j] += p * kv[j];
                }
            }
            float inv = 1.0f / sum;
            for (int64_t j = 0; j < r; j++)
                out[j] *= inv;
        }
    }
}

static duet_status_t duet__mla_layer(duet__step_t *st, int64_t l)
{
    duet_model_t              *m  = st->m;
    const duet_model_config_t *c  = &m->cfg;
    const duet_mla_weights_t  *w  = &m->w.layers[l].mla;
    duet__mla_f32_t           *mf = &m->mla_f32[l];
    const int64_t T = st->n_rows, D = c->hidden_size, n = c->mla_heads;
    const int64_t dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim, dv = c->v_head_dim;
    const int64_t r = c->kv_lora_rank, dqk = dn + dr, td = r + dr, PT = m->opts.page_tokens;
    const int64_t sub = m->layer_sub[l];
    duet__layer_ctx_t lc = {.st = st, .layer = l};
    duet_status_t     s;

    if (c->q_lora_rank > 0) {
        const int64_t ql = c->q_lora_rank;
        if ((s = duet_k_matmul(m->k, m->mqa, ql, m->xn, D, T, &w->q_a_proj, 0)) != DUET_OK)
            return s;
        duet_k_rmsnorm(m->k, m->mqa, m->mqa, &w->q_a_layernorm, T, ql, DUET_MLA_NORM_EPS);
        s = duet_k_matmul(m->k, m->mq, n * dqk, m->mqa, ql, T, &w->q_b_proj, 0);
    } else {
        s = duet_k_matmul(m->k, m->mq, n * dqk, m->xn, D, T, &w->q_proj, 0);
    }
    if (s != DUET_OK)
        return s;
    if ((s = duet_k_matmul(m->k, m->ckr, td, m->xn, D, T, &w->kv_a_proj_with_mqa, 0)) != DUET_OK)
        return s;
    /* c ← RMSNorm(c), then [c | k_r] goes into the sequence's page slot. */
    for (int64_t it = 0; it < st->n_items; it++) {
        const duet_batch_item_t *item = duet__item(st, it);
        for (int64_t t = 0; t < item->n_tokens; t++) {
            const int64_t row = st->row0[it] + t, pos = item->seq->n_tokens + t;
            float        *src = m->ckr + row * td;
            duet_k_rmsnorm(m->k, src, src, &w->kv_a_layernorm, 1, r, DUET_MLA_NORM_EPS);
            float *dst = (float *)duet_kv_pool_block(m->kv, item->seq->pages[pos / PT], sub) +
                         (pos % PT) * td;
            memcpy(dst, src, sizeof(float) * (size_t)td);
        }
    }
    /* q̂_h = W_UK[h]ᵀ q_nope_h for every row */
    for (int64_t h = 0; h < n; h++) {
        duet_tensor_t wt = mf->wuk_t_h;
        wt.data          = mf->wuk_t + h * r * dn;
        if ((s = duet_k_matmul(m->k, m->qhat + h * r, n * r, m->mq + h * dqk, n * dqk, T, &wt, 0)) !=
            DUET_OK)
            return s;
    }
    duet_k_parallel_for(m->k, st->n_items * n, 1, duet__mla_attn_task, &lc);
    /* o_h = W_UV[h] · latent_h */
    for (int64_t h = 0; h < n; h++) {
        duet_tensor_t wuv = duet__row_view(&w->kv_b_proj, h * (dn + dv) + dn, dv);
        if ((s = duet_k_matmul(m->k, m->o + h * dv, n * dv, m->lat + h * r, n * r, T, &wuv, 0)) !=
            DUET_OK)
            return s;
    }
    return duet_k_matmul(m->k, m->x, D, m->o, n * dv, T, &w->o_proj, 1);
}

/* ---- FFN ----------------------------------------------------------------------------- */

static void duet__act_mul(duet_model_t *m, float *gate, const float *up, int64_t n)
{
    if (m->cfg.act == DUET_ACT_SITU)
        duet_k_situ_mul(m->k, gate, gate, up, n, m->cfg.situ_beta, m->cfg.situ_linear_beta);
    else
        duet_k_silu_mul(m->k, gate, gate, up, n);
}

/* y += down(act(gate x) ⊙ up x) for M rows of x (row stride D). */
static duet_status_t duet__mlp(duet_model_t *m, const duet_mlp_weights_t *w, float *y,
                               const float *x, int64_t M, float *f1, float *f2)
{
    const int64_t D = m->cfg.hidden_size, I = w->gate_proj.shape[0];
    duet_status_t s;
    if ((s = duet_k_matmul(m->k, f1, I, x, D, M, &w->gate_proj, 0)) != DUET_OK ||
        (s = duet_k_matmul(m->k, f2, I, x, D, M, &w->up_proj, 0)) != DUET_OK)
        return s;
    duet__act_mul(m, f1, f2, M * I);
    return duet_k_matmul(m->k, y, D, f1, I, M, &w->down_proj, 1);
}

/* Route one row: sigmoid scores, bias for choice, group-limited top-k, renormalise, scale. */
static void duet__route_row(const duet_model_config_t *c, const float *logits, const float *bias,
                            int32_t *idx, float *wts)
{
    const int64_t E = c->n_experts, G = c->n_group > 0 ? c->n_group : 1, gs = E / G;
    float         score[E], choice[E];
    for (int64_t e = 0; e < E; e++) {
        score[e]  = 1.0f / (1.0f + expf(-logits[e]));
        choice[e] = score[e] + bias[e];
    }
    if (G > 1) {
        float   gscore[G];
        uint8_t keep[G];
        for (int64_t g = 0; g < G; g++) {
            float b1 = -INFINITY, b2 = -INFINITY;
            for (int64_t e = g * gs; e < (g + 1) * gs; e++) {
                if (choice[e] > b1) {
                    b2 = b1;
                    b1 = choice[e];
                } else if (choice[e] > b2) {
                    b2 = choice[e];
                }
            }
            gscore[g] = gs >= 2 ? b1 + b2 : b1;
            keep[g]   = 0;
        }
        for (int64_t k = 0; k < c->topk_group; k++) {
            int64_t best = -1;
            for (int64_t g = 0; g < G; g++)
                if (!keep[g] && (best < 0 || gscore[g] > gscore[best]))
                    best = g;
            keep[best] = 1;
        }
        for (int64_t e = 0; e < E; e++)
            if (!keep[e / gs])
                choice[e] = -INFINITY;
    }
    float sum = 0.0f;
    for (int64_t k = 0; k < c->top_k; k++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t j = 0; j < k; j++)
                taken |= idx[j] == e;
            if (!taken && (best < 0 || choice[e] > choice[best]))
                best = e;
        }
        idx[k] = (int32_t)best;
        wts[k] = score[best];
        sum += wts[k];
    }
    for (int64_t k = 0; k < c->top_k; k++) {
        if (c->moe_renormalize)
            wts[k] /= sum + 1e-20f;
        wts[k] *= c->routed_scaling_factor;
    }
}

static duet_status_t duet__moe_layer(duet__step_t *st, int64_t l)
{
    duet_model_t              *m  = st->m;
    const duet_model_config_t *c  = &m->cfg;
    const duet_moe_weights_t  *w  = &m->w.layers[l].moe;
    const int64_t T = st->n_rows, D = c->hidden_size, E = c->n_experts, TK = c->top_k;
    const int64_t I = c->moe_intermediate;
    duet_status_t s;

    if ((s = duet_k_matmul(m->k, m->router, E, m->xn, D, T, &w->gate, 0)) != DUET_OK)
        return s;
    for (int64_t row = 0; row < T; row++)
        duet__route_row(c, m->router + row * E, m->moe_f32[l].bias, m->topk_idx + row * TK,
                        m->topk_w + row * TK);
    /* group (row, weight) pairs by expert: counting sort */
    memset(m->exp_off, 0, sizeof(int64_t) * (size_t)(E + 1));
    for (int64_t i = 0; i < T * TK; i++)
        m->exp_off[m->topk_idx[i] + 1]++;
    for (int64_t e = 0; e < E; e++)
        m->exp_off[e + 1] += m->exp_off[e];
    for (int64_t i = 0; i < T * TK; i++) {
        int64_t e        = m->topk_idx[i];
        int64_t at       = m->exp_off[e]++;
        m->exp_rows[at]  = (int32_t)(i / TK);
        m->exp_wts[at]   = m->topk_w[i];
    }
    for (int64_t e = E; e > 0; e--)
        m->exp_off[e] = m->exp_off[e - 1];
    m->exp_off[0] = 0;

    for (int64_t e = 0; e < E; e++) {
        const int64_t a = m->exp_off[e], M = m->exp_off[e + 1] - a;
        if (M == 0)
            continue;
        for (int64_t i = 0; i < M; i++)
            memcpy(m->xg + i * D, m->xn + (int64_t)m->exp_rows[a + i] * D, sizeof(float) * (size_t)D);
        if ((s = duet_k_matmul(m->k, m->f1, I, m->xg, D, M, &w->w1[e], 0)) != DUET_OK ||
            (s = duet_k_matmul(m->k, m->f2, I, m->xg, D, M, &w->w3[e], 0)) != DUET_OK)
            return s;
        duet__act_mul(m, m->f1, m->f2, M * I);
        if ((s = duet_k_matmul(m->k, m->eo, D, m->f1, I, M, &w->w2[e], 0)) != DUET_OK)
            return s;
        for (int64_t i = 0; i < M; i++) {
            float       *y  = m->x + (int64_t)m->exp_rows[a + i] * D;
            const float *eo = m->eo + i * D;
            const float  wt = m->exp_wts[a + i];
            for (int64_t d = 0; d < D; d++)
                y[d] += wt * eo[d];
        }
    }
    if (c->n_shared_experts > 0)
        return duet__mlp(m, &w->shared, m->x, m->xn, T, m->f1, m->f2);
    return DUET_OK;
}

/* ---- forward ------------------------------------------------------------------------- */

static duet_status_t duet__validate_batch(duet_model_t *m, const duet_batch_item_t *items,
                                          int64_t n_items, int64_t *rows_p)
{
    int64_t rows = 0;
    if (n_items <= 0)
        return duet_error_set(DUET_ERR_INVALID, "forward: empty batch");
    for (int64_t i = 0; i < n_items; i++) {
        const duet_batch_item_t *it = &items[i];
        if (it->seq == NULL || it->seq->id < 0)
            return duet_error_set(DUET_ERR_INVALID, "forward: item %lld has no open sequence",
                                  (long long)i);
        if (it->n_tokens <= 0 || it->tokens == NULL)
            return duet_error_set(DUET_ERR_INVALID, "forward: item %lld has no tokens",
                                  (long long)i);
        if (it->seq->n_tokens + it->n_tokens > it->seq->cap_tokens)
            return duet_error_set(DUET_ERR_RANGE,
                                  "forward: item %lld: %lld + %lld tokens exceed the sequence's "
                                  "%lld reserved", (long long)i, (long long)it->seq->n_tokens,
                                  (long long)it->n_tokens, (long long)it->seq->cap_tokens);
        if (it->logits_mode == DUET_LOGITS_TOKEN) {
            if (it->token_out == NULL)
                return duet_error_set(DUET_ERR_INVALID, "forward: item %lld wants a token but "
                                      "has nowhere to put it", (long long)i);
            duet_status_t st = duet_sampling_validate(&it->sampling);
            if (st != DUET_OK)
                return st;
        } else if (it->logits_mode != DUET_LOGITS_NONE && it->logits == NULL)
            return duet_error_set(DUET_ERR_INVALID, "forward: item %lld wants logits but has "
                                  "no buffer", (long long)i);
        for (int64_t t = 0; t < it->n_tokens; t++)
            if (it->tokens[t] < 0 || it->tokens[t] >= m->cfg.vocab_size)
                return duet_error_set(DUET_ERR_RANGE, "forward: item %lld: token %d outside the "
                                      "vocabulary [0, %lld)", (long long)i, it->tokens[t],
                                      (long long)m->cfg.vocab_size);
        for (int64_t j = 0; j < i; j++)
            if (items[j].seq == it->seq)
                return duet_error_set(DUET_ERR_INVALID, "forward: sequence %d appears twice",
                                      it->seq->id);
        rows += it->n_tokens;
    }
    if (rows > m->opts.max_batch_tokens)
        return duet_error_set(DUET_ERR_RANGE, "forward: %lld tokens exceed max_batch_tokens %lld",
                              (long long)rows, (long long)m->opts.max_batch_tokens);
    *rows_p = rows;
    return DUET_OK;
}

duet_status_t duet_model_forward(duet_model_t *m, duet_batch_item_t *items, int64_t n_items)
{
    const duet_model_config_t *c = &m->cfg;
    const int64_t              D = c->hidden_size;
    int64_t                    rows = 0;
    duet_status_t              s = duet__validate_batch(m, items, n_items, &rows);
    if (s != DUET_OK)
        return s;

    if (m->dev != NULL) {
        s = duet_cuda_model_forward(m->dev, items, n_items, rows, m->layer_hook,
                                    m->layer_hook_user);
        if (s != DUET_OK)
            return s;
        for (int64_t i = 0; i < n_items; i++)
            items[i].seq->n_tokens += items[i].n_tokens;
        return DUET_OK;
    }

    duet__step_t  step = {.m = m, .items = items, .n_items = n_items, .n_rows = rows,
                          .row0 = m->item_row0};
    duet__step_t *st   = &step;
    st->row0[0] = 0;
    for (int64_t i = 0; i < n_items; i++)
        st->row0[i + 1] = st->row0[i] + items[i].n_tokens;

    for (int64_t i = 0; i < n_items; i++)
        duet_k_embed(m->k, m->x + st->row0[i] * D, &m->w.embed_tokens, items[i].tokens,
                     items[i].n_tokens);

    for (int64_t l = 0; l < c->num_layers; l++) {
        const duet_layer_weights_t *lw = &m->w.layers[l];
        duet_k_rmsnorm(m->k, m->xn, m->x, &lw->input_layernorm, rows, D, c->rms_norm_eps);
        s = c->mixer[l] == DUET_MIXER_KDA ? duet__kda_layer(st, l) : duet__mla_layer(st, l);
        if (s != DUET_OK)
            return s;
        if (m->layer_hook != NULL)
            m->layer_hook(m->layer_hook_user, l,
                          c->mixer[l] == DUET_MIXER_KDA ? -1 : m->layer_sub[l],
                          c->mixer[l] == DUET_MIXER_KDA ? m->layer_sub[l] : -1);
        duet_k_rmsnorm(m->k, m->xn, m->x, &lw->post_attention_layernorm, rows, D, c->rms_norm_eps);
        if (c->ffn[l] == DUET_FFN_MOE)
            s = duet__moe_layer(st, l);
        else
            s = duet__mlp(m, &lw->mlp, m->x, m->xn, rows, m->f1, m->f2);
        if (s != DUET_OK)
            return s;
    }

    for (int64_t i = 0; i < n_items; i++) {
        duet_batch_item_t *it = &items[i];
        int64_t            r0 = st->row0[i], nr = 0;
        if (it->logits_mode == DUET_LOGITS_LAST || it->logits_mode == DUET_LOGITS_TOKEN) {
            r0 = st->row0[i + 1] - 1;
            nr = 1;
        } else if (it->logits_mode == DUET_LOGITS_ALL) {
            nr = it->n_tokens;
        }
        if (nr > 0) {
            duet_k_rmsnorm(m->k, m->xn + r0 * D, m->x + r0 * D, &m->w.norm, nr, D, c->rms_norm_eps);
            float *dst = it->logits_mode == DUET_LOGITS_TOKEN ? m->tok_logits : it->logits;
            s = duet_k_matmul(m->k, dst, c->vocab_size, m->xn + r0 * D, D, nr, &m->w.lm_head, 0);
            if (s != DUET_OK)
                return s;
            if (it->logits_mode == DUET_LOGITS_TOKEN)
                *it->token_out = duet_sampler_sample_u(m->sampler, &it->sampling, it->u, dst);
        }
        it->seq->n_tokens += it->n_tokens;
    }
    return DUET_OK;
}
