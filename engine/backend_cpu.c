/*
 * backend_cpu.c: the CPU backend (the table of engine/backend.h), the forward pass of Kimi Linear
 * that every other backend is tested against (docs/model.md is the specification,
 * transformers 5.17's KimiLinearForCausalLM the reference it is tested against).
 *
 * Shape of one step: the batch's new tokens are stacked into T rows. Every projection, norm and
 * FFN runs once over all T rows with the kernels of kernels/kernels.h; the mixers' per-sequence
 * parts run per (sequence, head) on the thread pool (kernels/cpu/cpu_kda.h, cpu_mla.h). The
 * caches are the front end's host pools themselves. Choices worth knowing:
 * - MLA always runs in the weight-absorbed form (prefill too): queries are mapped into the
 *   latent space with W_UK, attention runs over the cached latent c and k_r (r + dr dims), and
 *   W_UV is applied once to the r-dim result. It is the same function as transformers' expanded
 *   form up to fp32 rounding, and it is the only form that reads the paged cache directly.
 * - KDA uses the recurrent form for single-token steps and the chunked form otherwise, as
 *   transformers does for decode vs. prefill.
 * - Norm eps: layer norms and the KDA output norm use rms_norm_eps; q_a_layernorm and
 *   kv_a_layernorm use DUET_MLA_NORM_EPS.
 * - Small per-layer vectors (norm weights aside, which the kernels read in any dtype) are fp32
 *   copies made once at create (duet_backend_f32_prepare); big matrices stay in their stored dtype
 *   and the GEMM converts them.
 * - Batch invariance: every kernel computes a row the same way for any row count and thread count
 *   (docs/architecture.md), so an item's results do not depend on the rest of its batch.
 * - Verify items (speculative decoding, model.h): only the KDA mixer treats them differently
 *   (kernels/cpu/cpu_kda.h: recurrent form on a copy of the state, rows into the replay pool); MLA
 *   already computes every row of an item as a one-row step at its position would, and writes its
 *   tentative KV rows past n_tokens, where the next tokens overwrite those that are not accepted.
 *   A sequence's accepted rows are replayed into its state at the start of each KDA layer.
 */
#include "engine/backend.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "engine/sampler.h"
#include "kernels/cpu/cpu_kda.h"
#include "kernels/cpu/cpu_mla.h"
#include "kernels/cpu/cpu_moe.h"
#include "kernels/cpu/cpu_step.h"

typedef struct {
    duet_backend_t base;
    duet_backend_model_t bm; /* what it was created from (front-end pointers) */
    duet_kernels_t *k;       /* owned */
    duet_tune_t *tuner;      /* owned; opts.tune: k's matmul tactics (set on k) */
    duet_backend_f32_t *f32; /* owned, [num_layers] */
    duet_sampler_t *sampler; /* owned; DUET_LOGITS_TOKEN */
    float *tok_logits;       /* (vocab) logits of a DUET_LOGITS_TOKEN item, or of one ARGMAX row */

    /* the step's description for the mixers' kernels: arrays of T + 1 / T entries, owned */
    int64_t *item_row0;         /* (T + 1) first row of each item of the current step */
    int64_t *item_pos0;         /* (T) */
    int32_t *item_slot;         /* (T) */
    const int32_t **item_pages; /* (T) */
    int32_t *item_verify;       /* (T) */
    int64_t *item_replay;       /* (T) */

    /* workspace: one allocation, carved; T = max_batch_tokens */
    float *ws;                /* owned */
    float *x;                 /* (T, D) residual stream */
    float *xn;                /* (T, D) normed input of a sub-layer */
    float *proj;              /* (T, 3*H*K) KDA pre-conv q|k|v */
    float *qkv;               /* (T, 3*H*K) KDA post-conv q|k|v */
    float *fa;                /* (T, K) */
    float *gk;                /* (T, H*K) KDA log decay g */
    float *beta;              /* (T, H) */
    float *ga;                /* (T, K) */
    float *gate;              /* (T, H*K) output gate pre-activation */
    float *o;                 /* (T, max(H*K, n*dv)) mixer output before o_proj */
    float *mq;                /* (T, n*(dn+dr)) MLA queries */
    float *mqa;               /* (T, q_lora) */
    float *ckr;               /* (T, r+dr) */
    float *qhat;              /* (T, n, r) absorbed queries */
    float *lat;               /* (T, n, r) attention result in latent space */
    float *f1;                /* (T, Imax) FFN gate */
    float *f2;                /* (T, Imax) FFN up */
    float *router;            /* (T, E) */
    int32_t *topk_idx;        /* (T, top_k) */
    float *topk_w;            /* (T, top_k) */
    int32_t *exp_rows;        /* (T * top_k) rows grouped by expert */
    float *exp_wts;           /* (T * top_k) */
    int64_t *exp_off;         /* (E + 1) */
    float *xg;                /* (T, D) gathered rows of one expert */
    float *eo;                /* (T, D) expert output */
    float *thr_scratch;       /* (n_threads, per_thread) */
    int64_t per_thread;       /* floats of scratch per thread */
    duet_cpu_mla_ws_t mla_ws; /* the step's MLA split-KV plan and partials (duet__cpu_forward) */

    /* a Helix group's rank (bm.shard): the sub-layers' partial outputs are summed over the group
     * before they join the residual; MLA's partial attention is exchanged and merged per head */
    float *y;      /* (T, D) this rank's part of a sub-layer's output */
    float *red;    /* (size, T, D) the all-reduce's scratch */
    float *lse;    /* (T, n_att) log-sum-exp of each partial attention row */
    float *a2a_tx; /* (T, n_att, r + 1) partial attention rows by destination rank */
    float *a2a_rx; /* (cp, T, n_own, r + 1) every rank's partials of the heads merged here */
} duet__cpu_t;

static duet_tensor_t duet__f32_view(float *data, int64_t rows, int64_t cols)
{
    duet_tensor_t t = {.data = data,
                       .dtype = DUET_DTYPE_F32,
                       .device = DUET_DEVICE_CPU,
                       .ndim = 2,
                       .shape = {rows, cols}};
    return t;
}

/* Rows [r0, r0 + n) of a 2-D weight, as a view. */
static duet_tensor_t duet__row_view(const duet_tensor_t *w, int64_t r0, int64_t n)
{
    duet_tensor_t t = *w;
    int64_t cols = w->shape[w->ndim - 1];
    t.data = (uint8_t *)w->data + (size_t)(r0 * cols) * duet_dtype_size(w->dtype);
    t.ndim = 2;
    t.shape[0] = n;
    t.shape[1] = cols;
    return t;
}

/* ---- a group's sums ------------------------------------------------------------------------ */

/* The residual's input from a sub-layer: alone, where its last GEMM accumulates (x itself); in a
 * group, this rank's part (y), which duet__join then sums over the group into x. */
static float *duet__out(duet__cpu_t *b)
{
    return b->bm.shard != NULL ? b->y : b->x;
}

/* In a group: x += the sum over the ranks of their y (T rows), the same bits on every rank. */
static duet_status_t duet__join(duet__cpu_t *b, int64_t T)
{
    if (b->bm.shard == NULL)
        return DUET_OK;
    const int64_t n = T * b->bm.cfg->hidden_size;
    duet_comm_t *cm = b->bm.comm;
    duet_status_t s = cm->ops->allreduce_sum_f32(cm, b->y, n, b->red);
    if (s != DUET_OK)
        return s;
    for (int64_t i = 0; i < n; i++)
        b->x[i] += b->y[i];
    return DUET_OK;
}

/* ---- create ---------------------------------------------------------------------------------- */

static duet_status_t duet__cpu_alloc_ws(duet__cpu_t *b)
{
    const duet_model_config_t *c = b->bm.cfg;
    const int64_t T = b->bm.opts->max_batch_tokens, D = c->hidden_size;
    const int64_t HK = c->kda_heads * c->kda_head_dim, K = c->kda_head_dim;
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
    const int64_t omax =
        (has_kda ? HK : 0) > (has_mla ? n * c->v_head_dim : 0) ? HK : n * c->v_head_dim;
    const int64_t E = c->n_experts > 0 ? c->n_experts : 1, tk = c->top_k > 0 ? c->top_k : 1;
    const int64_t nthr = duet_kernels_n_threads(b->k);
    const int64_t grp = b->bm.shard != NULL, gsize = grp ? b->bm.shard->size : 0;
    const int64_t gcp = grp ? b->bm.shard->cp : 0;

    /* Per-thread scratch: KDA chunk scratch, or one MLA segment's scores and partial. */
    int64_t per = 64;
    if (has_kda) {
        int64_t s = duet_cpu_kda_chunk_scratch_floats(K, K);
        if (s > per)
            per = s;
    }
    if (has_mla && duet_cpu_mla_scratch_floats(n, r) > per)
        per = duet_cpu_mla_scratch_floats(n, r);
    if (b->bm.replay != NULL && duet_cpu_kda_verify_scratch_floats(K) > per)
        per = duet_cpu_kda_verify_scratch_floats(K);
    b->per_thread = per;

    struct {
        float **p;
        int64_t n;
    } parts[] = {
        {&b->x, T * D},
        {&b->xn, T * D},
        {&b->proj, has_kda * T * 3 * HK},
        {&b->qkv, has_kda * T * 3 * HK},
        {&b->fa, has_kda * T * K},
        {&b->gk, has_kda * T * HK},
        {&b->beta, has_kda * T * c->kda_heads},
        {&b->ga, has_kda * T * K},
        {&b->gate, has_kda * T * HK},
        {&b->o, T * omax},
        {&b->mq, has_mla * T * n * dqk},
        {&b->mqa, has_mla * T * c->q_lora_rank},
        {&b->ckr, has_mla * T * (r + dr)},
        {&b->qhat, has_mla * T * n * r},
        {&b->lat, has_mla * T * n * r},
        {&b->f1, T * imax},
        {&b->f2, T * imax},
        {&b->router, T * E},
        {&b->topk_w, T * tk},
        {&b->exp_wts, T * tk},
        {&b->xg, T * D},
        {&b->eo, T * D},
        {&b->thr_scratch, nthr * per},
        {&b->y, grp * T * D},
        {&b->red, grp * gsize * T * D},
        {&b->lse, grp * has_mla * T * n},
        {&b->a2a_tx, grp * has_mla * T * n * (r + 1)},
        {&b->a2a_rx, grp * has_mla * gcp * T * n * (r + 1)},
    };
    int64_t total = 0;
    for (size_t i = 0; i < sizeof(parts) / sizeof(parts[0]); i++)
        total += (parts[i].n + 15) / 16 * 16;
    b->ws = calloc((size_t)total, sizeof(float));
    b->topk_idx = calloc((size_t)(T * tk), sizeof(int32_t));
    b->exp_rows = calloc((size_t)(T * tk), sizeof(int32_t));
    b->exp_off = calloc((size_t)(E + 1), sizeof(int64_t));
    b->item_row0 = calloc((size_t)(T + 1), sizeof(int64_t));
    b->item_pos0 = calloc((size_t)T, sizeof(int64_t));
    b->item_slot = calloc((size_t)T, sizeof(int32_t));
    b->item_pages = calloc((size_t)T, sizeof(*b->item_pages));
    b->item_verify = calloc((size_t)T, sizeof(int32_t));
    b->item_replay = calloc((size_t)T, sizeof(int64_t));
    if (b->ws == NULL || b->topk_idx == NULL || b->exp_rows == NULL || b->exp_off == NULL ||
        b->item_row0 == NULL || b->item_pos0 == NULL || b->item_slot == NULL ||
        b->item_pages == NULL || b->item_verify == NULL || b->item_replay == NULL)
        return DUET_FAIL(DUET_ERR_NOMEM, "model: cannot allocate %.1f MiB of workspace",
                         (double)total * 4.0 / 1048576.0);
    float *cur = b->ws;
    for (size_t i = 0; i < sizeof(parts) / sizeof(parts[0]); i++) {
        *parts[i].p = cur;
        cur += (parts[i].n + 15) / 16 * 16;
    }
    DUET_LOG_DEBUG("model: workspace %.1f MiB for %lld rows", (double)total * 4.0 / 1048576.0,
                   (long long)T);
    return DUET_OK;
}

static void duet__cpu_destroy(duet_backend_t *be)
{
    duet__cpu_t *b = (duet__cpu_t *)be;
    if (b == NULL)
        return;
    duet_backend_f32_free(b->bm.cfg, b->f32);
    duet_cpu_mla_ws_free(&b->mla_ws);
    free(b->ws);
    free(b->topk_idx);
    free(b->exp_rows);
    free(b->exp_off);
    free(b->item_row0);
    free(b->item_pos0);
    free(b->item_slot);
    free(b->item_pages);
    free(b->item_verify);
    free(b->item_replay);
    duet_sampler_destroy(b->sampler);
    free(b->tok_logits);
    duet_kernels_destroy(b->k);
    duet_tune_destroy(b->tuner);
    free(b);
}

/* ---- autotuning ------------------------------------------------------------------------------ */

/* Append w (a copy of the view) to the list of decode matmul weights. */
static duet_status_t duet__tune_push(duet_tensor_t **ws, int64_t *n, int64_t *cap,
                                     const duet_tensor_t *w)
{
    if (*n == *cap) {
        int64_t nc = *cap > 0 ? *cap * 2 : 64;
        duet_tensor_t *p = realloc(*ws, sizeof(*p) * (size_t)nc);
        if (p == NULL)
            return DUET_FAIL(DUET_ERR_NOMEM, "model: out of memory");
        *ws = p;
        *cap = nc;
    }
    if (w->data != NULL) /* a group rank's weights another rank holds (experts, the LM head) */
        (*ws)[(*n)++] = *w;
    return DUET_OK;
}

/*
 * opts.tune: profile k's matmul tactics for every weight the forward pass multiplies by (the
 * layer functions above, in their order) at decode's row counts, one per M bucket up to
 * max_seqs (kernels/tune.h), or load them from opts.tune_file; then set them on k. Experts share
 * a shape: the first one held stands for them all. In a group every rank must list the same
 * shapes (the tuner refuses otherwise): the LM head, rank 0's alone, is left out there, and the
 * cuts must be even (a rank without an expert, or an uneven cut, fails the load, saying so).
 */
static duet_status_t duet__cpu_tune(duet__cpu_t *b)
{
    const duet_model_config_t *c = b->bm.cfg;
    const duet_weights_t *w = b->bm.w;
    const duet_model_opts_t *o = b->bm.opts;
    duet_tensor_t *ws = NULL;
    duet_k_matmul_shape_t *sh = NULL;
    int64_t n = 0, cap = 0;
    duet_status_t st;

    if ((st = duet_k_matmul_tuner_create(b->k, &b->tuner)) != DUET_OK)
        return st;
    if (o->tune_file != NULL) {
        st = duet_tune_load_group(b->tuner, o->tune_file, o->comm);
        if (st == DUET_OK) {
            DUET_LOG_INFO("model: %lld tuned shapes from %s", (long long)duet_tune_count(b->tuner),
                          o->tune_file);
            duet_kernels_set_tuner(b->k, b->tuner);
            return DUET_OK;
        }
        if (st != DUET_ERR_NOT_FOUND)
            return st;
    }

#define DUET__PUSH(t)                                                                              \
    do {                                                                                           \
        if ((st = duet__tune_push(&ws, &n, &cap, (t))) != DUET_OK)                                 \
            goto done;                                                                             \
    } while (0)
    for (int64_t l = 0; l < c->num_layers; l++) {
        const duet_layer_weights_t *lw = &w->layers[l];
        if (lw->mixer == DUET_MIXER_KDA) {
            const duet_kda_weights_t *kw = &lw->kda;
            DUET__PUSH(&kw->q_proj);
            DUET__PUSH(&kw->k_proj);
            DUET__PUSH(&kw->v_proj);
            DUET__PUSH(&kw->f_a_proj);
            DUET__PUSH(&kw->f_b_proj);
            DUET__PUSH(&kw->b_proj);
            DUET__PUSH(&kw->g_a_proj);
            DUET__PUSH(&kw->g_b_proj);
            DUET__PUSH(&kw->o_proj);
        } else {
            const duet_mla_weights_t *mw = &lw->mla;
            const int64_t dn = c->qk_nope_head_dim, dv = c->v_head_dim, r = c->kv_lora_rank;
            if (c->q_lora_rank > 0) {
                DUET__PUSH(&mw->q_a_proj);
                DUET__PUSH(&mw->q_b_proj);
            } else {
                DUET__PUSH(&mw->q_proj);
            }
            DUET__PUSH(&mw->kv_a_proj_with_mqa);
            duet_tensor_t wt = duet__f32_view(b->f32[l].wuk_t, r, dn);
            duet_tensor_t wuv = duet__row_view(&mw->kv_b_proj, dn, dv);
            DUET__PUSH(&wt);
            DUET__PUSH(&wuv);
            DUET__PUSH(&mw->o_proj);
        }
        if (lw->ffn == DUET_FFN_MOE) {
            const duet_moe_weights_t *ew = &lw->moe;
            DUET__PUSH(&ew->gate);
            int64_t e0 = 0;
            while (e0 + 1 < c->n_experts && ew->w1[e0].data == NULL)
                e0++;
            DUET__PUSH(&ew->w1[e0]);
            DUET__PUSH(&ew->w3[e0]);
            DUET__PUSH(&ew->w2[e0]);
            if (c->n_shared_experts > 0) {
                DUET__PUSH(&ew->shared.gate_proj);
                DUET__PUSH(&ew->shared.up_proj);
                DUET__PUSH(&ew->shared.down_proj);
            }
        } else {
            DUET__PUSH(&lw->mlp.gate_proj);
            DUET__PUSH(&lw->mlp.up_proj);
            DUET__PUSH(&lw->mlp.down_proj);
        }
    }
    if (b->bm.shard == NULL)
        DUET__PUSH(&w->lm_head);
#undef DUET__PUSH

    /* decode's row counts: one per M bucket that max_seqs reaches (its top, or max_seqs) */
    int64_t ms[DUET_TUNE_M_BUCKETS], n_m = 0;
    for (int32_t bk = 0; bk < DUET_TUNE_M_BUCKETS; bk++) {
        int64_t lo = bk == 0 ? 1 : duet_tune_m_bucket_max(bk - 1) + 1;
        if (lo > o->max_seqs)
            break;
        int64_t hi = duet_tune_m_bucket_max(bk);
        ms[n_m++] = hi < o->max_seqs ? hi : o->max_seqs;
    }
    sh = malloc(sizeof(*sh) * (size_t)(n * n_m > 0 ? n * n_m : 1));
    if (sh == NULL) {
        st = DUET_FAIL(DUET_ERR_NOMEM, "model: out of memory");
        goto done;
    }
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < n_m; j++)
            sh[i * n_m + j] = (duet_k_matmul_shape_t){.m = ms[j], .w = &ws[i]};
    duet_tune_stats_t stats;
    if ((st = duet_k_matmul_tune(b->k, b->tuner, sh, n * n_m, o->comm, &stats)) != DUET_OK)
        goto done;
    DUET_LOG_INFO("model: tuned %lld matmul shapes (%lld pairs, %lld profiled here) in %.3f s",
                  (long long)stats.shapes, (long long)stats.pairs, (long long)stats.profiled,
                  stats.seconds);
    if (o->tune_file != NULL && (st = duet_tune_save(b->tuner, o->tune_file)) != DUET_OK)
        goto done;
    duet_kernels_set_tuner(b->k, b->tuner);

done:
    free(ws);
    free(sh);
    return st;
}

static duet_status_t duet__cpu_create(const duet_backend_model_t *bm, duet_backend_t **be_p)
{
    if (bm->w == NULL)
        return DUET_FAIL(DUET_ERR_UNSUPPORTED,
                         "model: the cpu backend computes a checkpoint's "
                         "weights only (random weights are generated on a CUDA device)");
    duet__cpu_t *b = calloc(1, sizeof(*b));
    if (b == NULL)
        return DUET_FAIL(DUET_ERR_NOMEM, "model: out of memory");
    b->base.ops = &duet_backend_cpu_ops;
    b->bm = *bm;
    duet_status_t st;
    /* DUET_LOGITS_TOKEN: the sampler and one row of logits */
    if ((st = duet_sampler_create(bm->cfg->vocab_size, &b->sampler)) != DUET_OK)
        goto fail;
    b->tok_logits = malloc(sizeof(float) * (size_t)bm->cfg->vocab_size);
    if (b->tok_logits == NULL) {
        st = DUET_FAIL(DUET_ERR_NOMEM, "model: out of memory");
        goto fail;
    }
    if ((st = duet_kernels_create(DUET_DEVICE_CPU, bm->opts->n_threads, &b->k)) != DUET_OK ||
        (st = duet_backend_f32_prepare(bm->cfg, bm->w, &b->f32)) != DUET_OK ||
        (st = duet__cpu_alloc_ws(b)) != DUET_OK)
        goto fail;
    if (bm->shard != NULL)
        b->mla_ws.shard = (duet_cpu_mla_shard_t){
            .cp = bm->shard->cp, .c = bm->shard->c, .page_tokens = bm->opts->page_tokens};
    if (bm->opts->tune && (st = duet__cpu_tune(b)) != DUET_OK)
        goto fail;
    *be_p = &b->base;
    return DUET_OK;

fail:
    duet__cpu_destroy(&b->base);
    return st;
}

static void duet__cpu_describe(const duet_backend_t *be, char *buf, size_t cap)
{
    const duet__cpu_t *b = (const duet__cpu_t *)be;
    snprintf(buf, cap, "cpu, %d threads (%s)", duet_kernels_n_threads(b->k),
             duet_kernels_cpu_isa(b->k));
}

/* ---- sequences ------------------------------------------------------------------------------- */

static duet_status_t duet__cpu_seq_open(duet_backend_t *be, const duet_seq_t *seq)
{
    duet__cpu_t *b = (duet__cpu_t *)be;
    /* Stale KV of earlier owners is never read (attention stops at n_tokens), but zero anyway so
     * a cache dump of a fresh sequence is deterministic. */
    if (b->bm.kv != NULL)
        duet_kv_pool_zero_pages(b->bm.kv, seq->pages, seq->n_pages);
    return DUET_OK;
}

static void duet__cpu_pool_mem(const duet_backend_t *be, duet_model_pool_t which,
                               duet_backend_pool_mem_t *out)
{
    const duet__cpu_t *b = (const duet__cpu_t *)be;
    memset(out, 0, sizeof(*out));
    if (which == DUET_MODEL_POOL_KV && b->bm.kv != NULL) {
        out->base = duet_kv_pool_base(b->bm.kv);
        out->bytes = duet_kv_pool_bytes(b->bm.kv);
    } else if (which == DUET_MODEL_POOL_KDA && b->bm.kda != NULL) {
        out->base = duet_kda_pool_base(b->bm.kda);
        out->bytes = duet_kda_pool_bytes(b->bm.kda);
    } else if (which == DUET_MODEL_POOL_REPLAY && b->bm.replay != NULL) {
        out->base = duet_replay_pool_base(b->bm.replay);
        out->bytes = duet_replay_pool_bytes(b->bm.replay);
    }
}

/* ---- mixers ---------------------------------------------------------------------------------- */

/* KDA layer l's view of the state and replay pools. */
static duet_cpu_kda_layer_t duet__kda_view(const duet__cpu_t *b, int64_t l)
{
    duet_cpu_kda_layer_t ly = {.kda_base = duet_kda_pool_base(b->bm.kda),
                               .layout = duet_kda_pool_layout(b->bm.kda),
                               .layer = b->bm.layer_sub[l]};
    if (b->bm.replay != NULL) {
        ly.replay_base = duet_replay_pool_base(b->bm.replay);
        ly.replay = duet_replay_pool_layout(b->bm.replay);
    }
    return ly;
}

static duet_status_t duet__kda_layer(duet__cpu_t *b, const duet_cpu_step_t *st, int64_t l)
{
    const duet_model_config_t *c = b->bm.cfg;
    const duet_kda_weights_t *w = &b->bm.w->layers[l].kda;
    const duet_backend_f32_t *kf = &b->f32[l];
    const int64_t T = st->n_rows, H = c->kda_heads, K = c->kda_head_dim, HK = H * K, C3 = 3 * HK;
    const int64_t D = c->hidden_size;
    duet_kernels_t *k = b->k;
    duet_status_t s;

    if ((s = duet_k_matmul(k, b->proj, C3, b->xn, D, T, &w->q_proj, 0)) != DUET_OK ||
        (s = duet_k_matmul(k, b->proj + HK, C3, b->xn, D, T, &w->k_proj, 0)) != DUET_OK ||
        (s = duet_k_matmul(k, b->proj + 2 * HK, C3, b->xn, D, T, &w->v_proj, 0)) != DUET_OK ||
        (s = duet_k_matmul(k, b->fa, K, b->xn, D, T, &w->f_a_proj, 0)) != DUET_OK ||
        (s = duet_k_matmul(k, b->gk, HK, b->fa, K, T, &w->f_b_proj, 0)) != DUET_OK ||
        (s = duet_k_matmul(k, b->beta, H, b->xn, D, T, &w->b_proj, 0)) != DUET_OK ||
        (s = duet_k_matmul(k, b->ga, K, b->xn, D, T, &w->g_a_proj, 0)) != DUET_OK ||
        (s = duet_k_matmul(k, b->gate, HK, b->ga, K, T, &w->g_b_proj, 0)) != DUET_OK)
        return s;
    const duet_cpu_kda_layer_t ly = duet__kda_view(b, l);
    /* accepted rows of earlier verify items first: the conv and core below continue from them */
    duet_cpu_kda_replay(k, st, &ly, b->thr_scratch, b->per_thread);
    duet_cpu_kda_conv(k, st, &ly, kf->conv_w, b->proj, b->qkv);
    duet_cpu_kda_prep(k, T, H, K, kf->neg_A, kf->dt_bias, b->qkv, b->gk, b->beta);
    duet_cpu_kda_core(k, st, &ly, b->qkv, b->gk, b->beta, b->o, b->thr_scratch, b->per_thread);
    duet_cpu_kda_out(k, T, H, K, kf->o_norm, c->rms_norm_eps, b->gate, b->o);
    if ((s = duet_k_matmul(k, duet__out(b), D, b->o, HK, T, &w->o_proj, b->bm.shard == NULL)) !=
        DUET_OK)
        return s;
    return duet__join(b, T);
}

/*
 * Helix: each rank of t's cp ranks attended t's heads over its own pages (b->lat, b->lse); one
 * all-to-all gives each of them every rank's partials of the heads it owns, merged by their
 * log-sum-exp in rank order into b->lat as (T, n_own, r).
 */
static duet_status_t duet__mla_exchange(duet__cpu_t *b, int64_t T)
{
    const duet_shard_t *sh = b->bm.shard;
    const int64_t n = sh->att_h1 - sh->att_h0, r = b->bm.cfg->kv_lora_rank, R = r + 1;
    const int64_t no = sh->own_h1 - sh->own_h0;
    size_t tx_b[DUET_SHARD_MAX_RANKS] = {0}, tx_o[DUET_SHARD_MAX_RANKS] = {0};
    size_t rx_b[DUET_SHARD_MAX_RANKS] = {0}, rx_o[DUET_SHARD_MAX_RANKS] = {0};
    /* pack: to rank (c', t) the rows of the heads c' owns, each [lat | lse] */
    float *tx = b->a2a_tx;
    for (int cc = 0; cc < sh->cp; cc++) {
        const int64_t a = duet_shard_cut(n, sh->cp, cc), e = duet_shard_cut(n, sh->cp, cc + 1);
        const int dst = cc * sh->tp + sh->t;
        tx_o[dst] = (size_t)(tx - b->a2a_tx) * sizeof(float);
        for (int64_t row = 0; row < T; row++)
            for (int64_t h = a; h < e; h++, tx += R) {
                memcpy(tx, b->lat + (row * n + h) * r, sizeof(float) * (size_t)r);
                tx[r] = b->lse[row * n + h];
            }
        tx_b[dst] = (size_t)(T * (e - a) * R) * sizeof(float);
        rx_o[dst] = (size_t)(cc * T * no * R) * sizeof(float);
        rx_b[dst] = (size_t)(T * no * R) * sizeof(float);
    }
    duet_comm_t *cm = b->bm.comm;
    duet_status_t s = cm->ops->alltoallv(cm, b->a2a_tx, tx_b, tx_o, b->a2a_rx, rx_b, rx_o);
    if (s != DUET_OK)
        return s;
    /* merge: out = sum_c exp(lse_c - m) lat_c / sum_c exp(lse_c - m), ranks in order */
    for (int64_t row = 0; row < T; row++)
        for (int64_t h = 0; h < no; h++) {
            float m = -INFINITY;
            for (int cc = 0; cc < sh->cp; cc++) {
                const float l = b->a2a_rx[((cc * T + row) * no + h) * R + r];
                m = l > m ? l : m;
            }
            float *out = b->lat + (row * no + h) * r, den = 0.0f;
            memset(out, 0, sizeof(float) * (size_t)r);
            if (m == -INFINITY) /* no rank saw a position: cannot happen for a causal row */
                continue;
            for (int cc = 0; cc < sh->cp; cc++) {
                const float *p = b->a2a_rx + ((cc * T + row) * no + h) * R;
                if (p[r] == -INFINITY)
                    continue;
                const float wgt = expf(p[r] - m);
                den += wgt;
                for (int64_t j = 0; j < r; j++)
                    out[j] += wgt * p[j];
            }
            const float inv = 1.0f / den;
            for (int64_t j = 0; j < r; j++)
                out[j] *= inv;
        }
    return DUET_OK;
}

static duet_status_t duet__mla_layer(duet__cpu_t *b, const duet_cpu_step_t *st, int64_t l)
{
    const duet_model_config_t *c = b->bm.cfg;
    const duet_mla_weights_t *w = &b->bm.w->layers[l].mla;
    const int64_t T = st->n_rows, D = c->hidden_size, n = c->mla_heads;
    const int64_t dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim, dv = c->v_head_dim;
    const int64_t r = c->kv_lora_rank, dqk = dn + dr, td = r + dr;
    const float *wuk_t = b->f32[l].wuk_t;
    duet_kernels_t *k = b->k;
    duet_status_t s;

    if (c->q_lora_rank > 0) {
        const int64_t ql = c->q_lora_rank;
        if ((s = duet_k_matmul(k, b->mqa, ql, b->xn, D, T, &w->q_a_proj, 0)) != DUET_OK)
            return s;
        duet_k_rmsnorm(k, b->mqa, b->mqa, &w->q_a_layernorm, T, ql, DUET_MLA_NORM_EPS);
        s = duet_k_matmul(k, b->mq, n * dqk, b->mqa, ql, T, &w->q_b_proj, 0);
    } else {
        s = duet_k_matmul(k, b->mq, n * dqk, b->xn, D, T, &w->q_proj, 0);
    }
    if (s != DUET_OK)
        return s;
    if ((s = duet_k_matmul(k, b->ckr, td, b->xn, D, T, &w->kv_a_proj_with_mqa, 0)) != DUET_OK)
        return s;
    const duet_cpu_mla_layer_t ly = {.kv_base = duet_kv_pool_base(b->bm.kv),
                                     .layout = duet_kv_pool_layout(b->bm.kv),
                                     .layer = b->bm.layer_sub[l],
                                     .n_heads = n,
                                     .r = r,
                                     .dr = dr};
    /* c ← RMSNorm(c), then [c | k_r] goes into the sequence's page slot. */
    duet_cpu_mla_kv_write(k, st, &ly, &b->mla_ws.shard, b->ckr, &w->kv_a_layernorm,
                          DUET_MLA_NORM_EPS);
    /* q̂_h = W_UK[h]ᵀ q_nope_h for every row */
    for (int64_t h = 0; h < n; h++) {
        duet_tensor_t wt = duet__f32_view((float *)wuk_t + h * r * dn, r, dn);
        if ((s = duet_k_matmul(k, b->qhat + h * r, n * r, b->mq + h * dqk, n * dqk, T, &wt, 0)) !=
            DUET_OK)
            return s;
    }
    duet_cpu_mla_attend(k, st, &ly, b->qhat, b->mq + dn, n * dqk, dqk, 1.0f / sqrtf((float)dqk),
                        b->lat, b->bm.shard != NULL ? b->lse : NULL, b->thr_scratch, b->per_thread,
                        &b->mla_ws);
    /* heads [h0, h1) of the attended ones go on: all of them alone, this rank's merged share in
     * a group (their latent rows then in b->lat with a row stride of n_own heads) */
    int64_t h0 = 0, h1 = n;
    if (b->bm.shard != NULL) {
        h0 = b->bm.shard->own_h0 - b->bm.shard->att_h0;
        h1 = b->bm.shard->own_h1 - b->bm.shard->att_h0;
        if ((s = duet__mla_exchange(b, T)) != DUET_OK)
            return s;
    }
    const int64_t no = h1 - h0, ldl = b->bm.shard != NULL ? no * r : n * r;
    /* o_h = W_UV[h] · latent_h */
    for (int64_t h = h0; h < h1; h++) {
        duet_tensor_t wuv = duet__row_view(&w->kv_b_proj, h * (dn + dv) + dn, dv);
        const float *lat = b->lat + (b->bm.shard != NULL ? (h - h0) * r : h * r);
        if ((s = duet_k_matmul(k, b->o + (h - h0) * dv, no * dv, lat, ldl, T, &wuv, 0)) != DUET_OK)
            return s;
    }
    if (no == 0)
        memset(b->y, 0, sizeof(float) * (size_t)(T * D));
    else if ((s = duet_k_matmul(k, duet__out(b), D, b->o, no * dv, T, &w->o_proj,
                                b->bm.shard == NULL)) != DUET_OK)
        return s;
    return duet__join(b, T);
}

/* ---- FFN ------------------------------------------------------------------------------------- */

static void duet__act_mul(duet__cpu_t *b, float *gate, const float *up, int64_t n)
{
    const duet_model_config_t *c = b->bm.cfg;
    if (c->act == DUET_ACT_SITU)
        duet_k_situ_mul(b->k, gate, gate, up, n, c->situ_beta, c->situ_linear_beta);
    else
        duet_k_silu_mul(b->k, gate, gate, up, n);
}

/* y += down(act(gate x) ⊙ up x) for M rows of x (row stride D). */
static duet_status_t duet__mlp(duet__cpu_t *b, const duet_mlp_weights_t *w, float *y,
                               const float *x, int64_t M, float *f1, float *f2)
{
    const int64_t D = b->bm.cfg->hidden_size, I = w->gate_proj.shape[0];
    duet_status_t s;
    if ((s = duet_k_matmul(b->k, f1, I, x, D, M, &w->gate_proj, 0)) != DUET_OK ||
        (s = duet_k_matmul(b->k, f2, I, x, D, M, &w->up_proj, 0)) != DUET_OK)
        return s;
    duet__act_mul(b, f1, f2, M * I);
    return duet_k_matmul(b->k, y, D, f1, I, M, &w->down_proj, 1);
}

/* Rows routed each on its own (duet_cpu_moe_route), grouped by expert with a counting sort; each
 * expert runs over its gathered rows and its outputs are added into the residual in expert order,
 * then the shared expert. */
static duet_status_t duet__moe_layer(duet__cpu_t *b, int64_t T, int64_t l)
{
    const duet_model_config_t *c = b->bm.cfg;
    const duet_moe_weights_t *w = &b->bm.w->layers[l].moe;
    const int64_t D = c->hidden_size, E = c->n_experts, TK = c->top_k;
    const int64_t I = c->moe_intermediate;
    duet_status_t s;

    if ((s = duet_k_matmul(b->k, b->router, E, b->xn, D, T, &w->gate, 0)) != DUET_OK)
        return s;
    duet_cpu_moe_route(b->router, b->f32[l].moe_bias, T, E, c->n_group, c->topk_group, TK,
                       c->moe_renormalize, c->routed_scaling_factor, b->topk_idx, b->topk_w);
    /* group (row, weight) pairs by expert: counting sort */
    memset(b->exp_off, 0, sizeof(int64_t) * (size_t)(E + 1));
    for (int64_t i = 0; i < T * TK; i++)
        b->exp_off[b->topk_idx[i] + 1]++;
    for (int64_t e = 0; e < E; e++)
        b->exp_off[e + 1] += b->exp_off[e];
    for (int64_t i = 0; i < T * TK; i++) {
        int64_t e = b->topk_idx[i];
        int64_t at = b->exp_off[e]++;
        b->exp_rows[at] = (int32_t)(i / TK);
        b->exp_wts[at] = b->topk_w[i];
    }
    for (int64_t e = E; e > 0; e--)
        b->exp_off[e] = b->exp_off[e - 1];
    b->exp_off[0] = 0;

    float *out = duet__out(b);
    for (int64_t e = 0; e < E; e++) {
        const int64_t a = b->exp_off[e], M = b->exp_off[e + 1] - a;
        if (M == 0 || w->w1[e].data == NULL) /* no rows, or another group rank's expert */
            continue;
        for (int64_t i = 0; i < M; i++)
            memcpy(b->xg + i * D, b->xn + (int64_t)b->exp_rows[a + i] * D,
                   sizeof(float) * (size_t)D);
        if ((s = duet_k_matmul(b->k, b->f1, I, b->xg, D, M, &w->w1[e], 0)) != DUET_OK ||
            (s = duet_k_matmul(b->k, b->f2, I, b->xg, D, M, &w->w3[e], 0)) != DUET_OK)
            return s;
        duet__act_mul(b, b->f1, b->f2, M * I);
        if ((s = duet_k_matmul(b->k, b->eo, D, b->f1, I, M, &w->w2[e], 0)) != DUET_OK)
            return s;
        for (int64_t i = 0; i < M; i++) {
            float *y = out + (int64_t)b->exp_rows[a + i] * D;
            const float *eo = b->eo + i * D;
            const float wt = b->exp_wts[a + i];
            for (int64_t d = 0; d < D; d++)
                y[d] += wt * eo[d];
        }
    }
    if (c->n_shared_experts > 0)
        return duet__mlp(b, &w->shared, out, b->xn, T, b->f1, b->f2);
    return DUET_OK;
}

/* ---- forward --------------------------------------------------------------------------------- */

static duet_status_t duet__cpu_forward(duet_backend_t *be, const duet_backend_batch_t *bt)
{
    duet__cpu_t *b = (duet__cpu_t *)be;
    const duet_model_config_t *c = b->bm.cfg;
    const duet_weights_t *w = b->bm.w;
    duet_batch_item_t *items = bt->items;
    const int64_t D = c->hidden_size, rows = bt->n_rows, n_items = bt->n_items;
    duet_status_t s;

    duet_cpu_step_t st = {.n_items = n_items,
                          .n_rows = rows,
                          .item_row0 = b->item_row0,
                          .item_pos0 = b->item_pos0,
                          .item_slot = b->item_slot,
                          .item_pages = b->item_pages,
                          .item_verify = b->item_verify,
                          .item_replay = b->item_replay};
    b->item_row0[0] = 0;
    for (int64_t i = 0; i < n_items; i++) {
        b->item_row0[i + 1] = b->item_row0[i] + items[i].n_tokens;
        b->item_pos0[i] = items[i].seq->n_tokens;
        b->item_slot[i] = items[i].seq->kda_slot;
        b->item_pages[i] = items[i].seq->pages;
        b->item_verify[i] = items[i].verify;
        b->item_replay[i] = items[i].seq->n_replay;
    }

    /* one split-KV plan serves every MLA layer of the step */
    if (c->n_mla_layers > 0 &&
        (s = duet_cpu_mla_plan(b->k, &st, c->mla_heads, c->kv_lora_rank, &b->mla_ws)) != DUET_OK)
        return s;
    for (int64_t i = 0; i < n_items; i++)
        duet_k_embed(b->k, b->x + b->item_row0[i] * D, &w->embed_tokens, items[i].tokens,
                     items[i].n_tokens);

    for (int64_t l = 0; l < c->num_layers; l++) {
        const duet_layer_weights_t *lw = &w->layers[l];
        duet_k_rmsnorm(b->k, b->xn, b->x, &lw->input_layernorm, rows, D, c->rms_norm_eps);
        s = c->mixer[l] == DUET_MIXER_KDA ? duet__kda_layer(b, &st, l) : duet__mla_layer(b, &st, l);
        if (s != DUET_OK)
            return s;
        duet_backend_layer_done(&b->bm, bt, l);
        duet_k_rmsnorm(b->k, b->xn, b->x, &lw->post_attention_layernorm, rows, D, c->rms_norm_eps);
        if (b->bm.shard != NULL) /* the FFN's parts accumulate into y */
            memset(b->y, 0, sizeof(float) * (size_t)(rows * D));
        if (c->ffn[l] == DUET_FFN_MOE)
            s = duet__moe_layer(b, rows, l);
        else
            s = duet__mlp(b, &lw->mlp, duet__out(b), b->xn, rows, b->f1, b->f2);
        if (s != DUET_OK || (s = duet__join(b, rows)) != DUET_OK)
            return s;
    }

    for (int64_t i = 0; i < n_items; i++) {
        duet_batch_item_t *it = &items[i];
        int64_t r0 = b->item_row0[i], nr = 0;
        if (it->logits_mode == DUET_LOGITS_LAST || it->logits_mode == DUET_LOGITS_TOKEN) {
            r0 = b->item_row0[i + 1] - 1;
            nr = 1;
        } else if (it->logits_mode == DUET_LOGITS_ALL) {
            nr = it->n_tokens;
        }
        if (it->logits_mode == DUET_LOGITS_ARGMAX) { /* row by row through the one-row buffer */
            r0 = b->item_row0[i];
            duet_k_rmsnorm(b->k, b->xn + r0 * D, b->x + r0 * D, &w->norm, it->n_tokens, D,
                           c->rms_norm_eps);
            for (int64_t t = 0; t < it->n_tokens; t++) {
                s = duet_k_matmul(b->k, b->tok_logits, c->vocab_size, b->xn + (r0 + t) * D, D, 1,
                                  &w->lm_head, 0);
                if (s != DUET_OK)
                    return s;
                it->token_out[t] = duet_argmax(b->tok_logits, c->vocab_size);
            }
            continue;
        }
        if (nr > 0) {
            duet_k_rmsnorm(b->k, b->xn + r0 * D, b->x + r0 * D, &w->norm, nr, D, c->rms_norm_eps);
            float *dst = it->logits_mode == DUET_LOGITS_TOKEN ? b->tok_logits : it->logits;
            s = duet_k_matmul(b->k, dst, c->vocab_size, b->xn + r0 * D, D, nr, &w->lm_head, 0);
            if (s != DUET_OK)
                return s;
            if (it->logits_mode == DUET_LOGITS_TOKEN)
                *it->token_out = duet_sampler_sample_u(b->sampler, &it->sampling, it->u, dst);
        }
    }
    return DUET_OK;
}

/* The replay-only commit: duet__kda_layer's replay for one sequence and no new rows. */
static duet_status_t duet__cpu_seq_replay(duet_backend_t *be, const duet_seq_t *seq)
{
    duet__cpu_t *b = (duet__cpu_t *)be;
    const duet_model_config_t *c = b->bm.cfg;
    const int64_t row0[2] = {0, 0}, pos0 = seq->n_tokens, replay = seq->n_replay;
    const int32_t slot = seq->kda_slot, verify = 0;
    const int32_t *pages = seq->pages;
    const duet_cpu_step_t st = {.n_items = 1,
                                .n_rows = 0,
                                .item_row0 = row0,
                                .item_pos0 = &pos0,
                                .item_slot = &slot,
                                .item_pages = &pages,
                                .item_verify = &verify,
                                .item_replay = &replay};
    if (b->bm.replay == NULL)
        return DUET_FAIL(DUET_ERR_INVALID, "model: no replay pool to commit from");
    for (int64_t l = 0; l < c->num_layers; l++)
        if (c->mixer[l] == DUET_MIXER_KDA) {
            const duet_cpu_kda_layer_t ly = duet__kda_view(b, l);
            duet_cpu_kda_replay(b->k, &st, &ly, b->thr_scratch, b->per_thread);
        }
    return DUET_OK;
}

static int duet__cpu_probe(char *why, size_t cap)
{
    (void)why, (void)cap;
    return 1;
}

const duet_backend_ops_t duet_backend_cpu_ops = {
    .name = "cpu",
    .device = DUET_DEVICE_CPU,
    .compute_dtypes = DUET_BACKEND_DTYPE_BIT(DUET_DTYPE_F32),
    .kv_dtypes = DUET_BACKEND_DTYPE_BIT(DUET_DTYPE_F32),
    .caps = DUET_BACKEND_CAP_VERIFY | DUET_BACKEND_CAP_TUNE,
    .probe = duet__cpu_probe,
    .create = duet__cpu_create,
    .destroy = duet__cpu_destroy,
    .describe = duet__cpu_describe,
    .seq_open = duet__cpu_seq_open,
    .seq_set_filled = NULL, /* the host pools are the caches */
    .seq_close = NULL,
    .seq_replay = duet__cpu_seq_replay,
    .forward = duet__cpu_forward,
    .pool_mem = duet__cpu_pool_mem,
    .seq_state_copy = NULL, /* the host pools are the caches: the front end copies them */
    .seq_kv_copy = NULL,
};
