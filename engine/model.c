/*
 * model.c: the model front end (contract in model.h): what does not depend on the device. It
 * loads the config and the checkpoint, binds the weights, makes the host cache pools and the
 * sequence table, validates every batch, and hands the device's part to a backend through the
 * table of engine/backend.h (backend_cpu.c, backend_cuda.c), which it picks by opts.device and
 * never asks about again: whatever differs between devices (dtypes, random weights, what opening a
 * sequence or filling it from outside means for the device's memory) is a field or an op of the
 * table. The forward pass itself is the backend's; docs/model.md says what it computes.
 */
#include "engine/model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "engine/backend.h"
#include "engine/checkpoint.h"
#include "engine/shard.h"
#include "engine/weights.h"

struct duet_model {
    duet_model_config_t cfg;
    /* a Helix group's rank (opts.comm): its shard, and the config and weights it holds (the
     * pools and the backend are made from these); alone, lcfg == cfg and lw is unused */
    int grouped;
    duet_shard_t shard;
    duet_model_config_t lcfg;
    duet_weights_t lw; /* owned tables and column copies; rows are views into w's */
    duet_model_opts_t opts;
    duet_checkpoint_t *ck;      /* owned; weights are views into its mmaps (NULL: random weights) */
    duet_weights_t w;           /* owned tables */
    duet_kv_pool_t *kv;         /* owned, NULL when there are no MLA layers */
    duet_kda_pool_t *kda;       /* owned, NULL when there are no KDA layers */
    duet_replay_pool_t *replay; /* owned, NULL without spec_rows or KDA layers */
    int64_t layer_sub[DUET_MAX_LAYERS];  /* index among layers of the same mixer */
    const duet_backend_ops_t *ops;       /* the backend of opts.device */
    duet_backend_model_t bm;             /* what `be` was created from: points into this struct */
    duet_backend_t *be;                  /* owned */
    duet_model_layer_hook_fn layer_hook; /* NULL = none */
    void *layer_hook_user;

    /* sequence table */
    int64_t max_pages_per_seq;
    int32_t *page_table; /* (max_seqs, max_pages_per_seq), owned */
    uint8_t *seq_used;   /* (max_seqs), owned */
};

void duet_model_opts_default(duet_model_opts_t *opts)
{
    memset(opts, 0, sizeof(*opts));
    opts->n_threads = 0;
    opts->max_batch_tokens = 512;
    opts->max_seqs = 8;
    opts->max_seq_len = 4096;
    opts->page_tokens = 128;
    opts->kv_pages = 0;
    opts->device = DUET_DEVICE_CPU;
    opts->dtype = DUET_MODEL_DTYPE_AUTO;
    opts->compute_dtype = DUET_DTYPE_F32;
    opts->kv_dtype = DUET_DTYPE_F32;
    opts->cuda_graphs = 1;
}

duet_status_t duet_model_device_parse(const char *s, duet_device_kind_t *dev_p)
{
    const duet_backend_ops_t *ops =
        s != NULL && strcmp(s, "auto") == 0 ? duet_backend_pick_auto() : duet_backend_find_name(s);
    if (ops == NULL)
        return duet_error_set(DUET_ERR_INVALID, "device '%s': expected auto, cpu or cuda",
                              s != NULL ? s : "(null)");
    *dev_p = ops->device;
    return DUET_OK;
}

const char *duet_model_device_name(duet_device_kind_t dev)
{
    const duet_backend_ops_t *ops = duet_backend_find(dev);
    return ops != NULL ? ops->name : "?";
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
    const duet_backend_ops_t *ops = duet_backend_find(dev);
    if (ops == NULL ||
        (ckpt != DUET_DTYPE_F32 && ckpt != DUET_DTYPE_BF16 && ckpt != DUET_DTYPE_F16) ||
        (unsigned)req > DUET_MODEL_DTYPE_BF16)
        return duet_error_set(
            DUET_ERR_INVALID,
            "dtype: device %d, checkpoint dtype %d, request %d: not a known value", (int)dev,
            (int)ckpt, (int)req);
    /* auto follows the checkpoint; what the backend does not compute in becomes f32, which every
     * backend computes in (an f16 checkpoint is never rounded to bf16) */
    const duet_dtype_t want = req == DUET_MODEL_DTYPE_AUTO   ? ckpt
                              : req == DUET_MODEL_DTYPE_BF16 ? DUET_DTYPE_BF16
                                                             : DUET_DTYPE_F32;
    *out_p = (ops->compute_dtypes & DUET_BACKEND_DTYPE_BIT(want)) != 0 ? want : DUET_DTYPE_F32;
    return DUET_OK;
}

void duet_model_describe_backend(const duet_model_t *m, char *buf, size_t cap)
{
    m->ops->describe(m->be, buf, cap);
}

void duet_model_device_pools(duet_model_t *m, void **kv, size_t *kv_bytes, void **kda,
                             size_t *kda_bytes)
{
    duet_backend_pool_mem_t pk = {0}, ps = {0};
    m->ops->pool_mem(m->be, DUET_MODEL_POOL_KV, &pk);
    m->ops->pool_mem(m->be, DUET_MODEL_POOL_KDA, &ps);
    *kv = pk.on_device ? pk.base : NULL;
    *kv_bytes = pk.on_device ? pk.bytes : 0;
    *kda = ps.on_device ? ps.base : NULL;
    *kda_bytes = ps.on_device ? ps.bytes : 0;
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

duet_replay_pool_t *duet_model_replay_pool(duet_model_t *m)
{
    return m->replay;
}

/* ---- load ---------------------------------------------------------------------------------- */

static duet_status_t duet__check_opts(const duet_model_opts_t *opts)
{
    if (opts->max_batch_tokens <= 0 || opts->max_seqs <= 0 || opts->max_seq_len <= 0 ||
        opts->page_tokens <= 0 || opts->kv_pages < 0 || opts->n_threads < 0)
        return DUET_FAIL(DUET_ERR_INVALID,
                         "model: invalid options (batch tokens %lld, seqs %lld, "
                         "seq len %lld, page tokens %lld, pages %lld)",
                         (long long)opts->max_batch_tokens, (long long)opts->max_seqs,
                         (long long)opts->max_seq_len, (long long)opts->page_tokens,
                         (long long)opts->kv_pages);
    const duet_backend_ops_t *ops = duet_backend_find(opts->device);
    if (ops == NULL)
        return DUET_FAIL(DUET_ERR_INVALID, "model: unknown device %d", (int)opts->device);
    if ((unsigned)opts->kv_dtype > DUET_DTYPE_F16 ||
        (ops->kv_dtypes & DUET_BACKEND_DTYPE_BIT(opts->kv_dtype)) == 0)
        return DUET_FAIL(DUET_ERR_UNSUPPORTED,
                         "model: KV cache dtype %s is not supported on %s "
                         "(F32 everywhere, BF16 on cuda)",
                         duet_dtype_name(opts->kv_dtype), ops->name);
    if ((unsigned)opts->dtype > DUET_MODEL_DTYPE_BF16)
        return DUET_FAIL(DUET_ERR_INVALID, "model: unknown dtype request %d", (int)opts->dtype);
    if (opts->tune != 0 && (ops->caps & DUET_BACKEND_CAP_TUNE) == 0)
        return DUET_FAIL(
            DUET_ERR_UNSUPPORTED,
            "model: autotuning (tune) has no tactics on the %s backend yet (cpu and cuda "
            "have)",
            ops->name);
    if (opts->spec_rows != 0) {
        if ((ops->caps & DUET_BACKEND_CAP_VERIFY) == 0)
            return DUET_FAIL(DUET_ERR_UNSUPPORTED,
                             "model: speculative decoding (spec_rows %lld) needs verify rows, "
                             "which the %s backend does not compute yet (cpu does)",
                             (long long)opts->spec_rows, ops->name);
        if (opts->spec_rows < 2)
            return DUET_FAIL(DUET_ERR_INVALID,
                             "model: spec_rows %lld: 0 (no speculation) or at least 2 (the next "
                             "token and one draft)",
                             (long long)opts->spec_rows);
        if (opts->spec_rows > opts->max_batch_tokens || opts->spec_rows > opts->max_seq_len)
            return DUET_FAIL(DUET_ERR_RANGE,
                             "model: spec_rows %lld is more than a step (max_batch_tokens %lld) "
                             "or a sequence (max_seq_len %lld) holds",
                             (long long)opts->spec_rows, (long long)opts->max_batch_tokens,
                             (long long)opts->max_seq_len);
    }
    return DUET_OK;
}

void duet_model_pool_descs(const duet_model_config_t *c, const duet_model_opts_t *opts,
                           duet_kv_pool_desc_t *kv, duet_kda_pool_desc_t *kda,
                           duet_replay_pool_desc_t *replay)
{
    const int64_t pages_per_seq = (opts->max_seq_len + opts->page_tokens - 1) / opts->page_tokens;
    *kv = (duet_kv_pool_desc_t){
        .page_tokens = opts->page_tokens,
        .n_pages = opts->kv_pages > 0 ? opts->kv_pages : opts->max_seqs * pages_per_seq,
        .n_layers = c->n_mla_layers,
        .token_dim = c->kv_lora_rank + c->qk_rope_head_dim,
        .dtype = opts->kv_dtype,
    };
    *kda = (duet_kda_pool_desc_t){
        .n_slots = opts->max_seqs,
        .n_layers = c->n_kda_layers,
        .heads = c->kda_heads,
        .head_dim = c->kda_head_dim,
        .conv_kernel = c->conv_kernel,
    };
    *replay = (duet_replay_pool_desc_t){
        .n_slots = opts->max_seqs,
        .n_layers = opts->spec_rows > 0 ? c->n_kda_layers : 0,
        .heads = c->kda_heads,
        .head_dim = c->kda_head_dim,
        .rows = opts->spec_rows,
    };
}

/* Pools, sequence table and the backend, once m->cfg, m->opts (compute dtype resolved) and, for a
 * checkpoint, m->w are set. from_checkpoint == 0: random device weights from `seed`. */
static duet_status_t duet__model_finish(duet_model_t *m, int from_checkpoint, uint64_t seed)
{
    const duet_model_config_t *c = &m->lcfg;
    const duet_model_opts_t opts = m->opts;
    duet_status_t st;

    int64_t n_kda = 0, n_mla = 0;
    for (int64_t l = 0; l < c->num_layers; l++)
        m->layer_sub[l] = c->mixer[l] == DUET_MIXER_KDA ? n_kda++ : n_mla++;

    m->max_pages_per_seq = (opts.max_seq_len + opts.page_tokens - 1) / opts.page_tokens;
    if (m->grouped)
        m->max_pages_per_seq = duet_shard_local_pages(&m->shard, m->max_pages_per_seq);
    duet_kv_pool_desc_t kd;
    duet_kda_pool_desc_t sd;
    duet_replay_pool_desc_t rd;
    duet_model_pool_descs(c, &opts, &kd, &sd, &rd);
    if (n_mla > 0) {
        if (opts.pool_alloc != NULL) {
            size_t bytes = duet_kv_pool_bytes_needed(&kd);
            kd.mem = opts.pool_alloc(opts.pool_alloc_user, DUET_MODEL_POOL_KV, bytes);
            if (kd.mem == NULL)
                return DUET_FAIL(DUET_ERR_NOMEM, "model: the KV pool allocator gave no %zu bytes",
                                 bytes);
        }
        if ((st = duet_kv_pool_create(&kd, &m->kv)) != DUET_OK)
            return st;
    }
    if (n_kda > 0) {
        if (opts.pool_alloc != NULL) {
            size_t bytes = duet_kda_pool_bytes_needed(&sd);
            sd.mem = opts.pool_alloc(opts.pool_alloc_user, DUET_MODEL_POOL_KDA, bytes);
            if (sd.mem == NULL)
                return DUET_FAIL(DUET_ERR_NOMEM, "model: the KDA pool allocator gave no %zu bytes",
                                 bytes);
        }
        if ((st = duet_kda_pool_create(&sd, &m->kda)) != DUET_OK)
            return st;
        if (rd.n_layers > 0) {
            size_t bytes = duet_replay_pool_bytes_needed(&rd);
            if (opts.pool_alloc != NULL && bytes != SIZE_MAX) { /* create refuses an overflow */
                rd.mem = opts.pool_alloc(opts.pool_alloc_user, DUET_MODEL_POOL_REPLAY, bytes);
                if (rd.mem == NULL)
                    return DUET_FAIL(DUET_ERR_NOMEM,
                                     "model: the replay pool allocator gave no %zu bytes", bytes);
            }
            if ((st = duet_replay_pool_create(&rd, &m->replay)) != DUET_OK)
                return st;
        }
    }
    m->page_table = calloc((size_t)(opts.max_seqs * m->max_pages_per_seq), sizeof(int32_t));
    m->seq_used = calloc((size_t)opts.max_seqs, 1);
    if (m->page_table == NULL || m->seq_used == NULL)
        return DUET_FAIL(DUET_ERR_NOMEM, "model: out of memory");

    m->bm = (duet_backend_model_t){.cfg = &m->lcfg,
                                   .opts = &m->opts,
                                   .w = from_checkpoint ? (m->grouped ? &m->lw : &m->w) : NULL,
                                   .shard = m->grouped ? &m->shard : NULL,
                                   .comm = m->grouped ? m->opts.comm : NULL,
                                   .seed = seed,
                                   .kv = m->kv,
                                   .kda = m->kda,
                                   .replay = m->replay,
                                   .max_pages_per_seq = m->max_pages_per_seq,
                                   .layer_sub = m->layer_sub};
    if ((st = m->ops->create(&m->bm, &m->be)) != DUET_OK)
        return st;
    char be[160];
    duet_model_describe_backend(m, be, sizeof(be));
    if (m->grouped)
        DUET_LOG_INFO("model: helix rank %d of cp %d x tp %d: KDA heads [%lld, %lld), MLA heads "
                      "[%lld, %lld) attended and [%lld, %lld) projected, experts [%lld, %lld)",
                      m->shard.rank, m->shard.cp, m->shard.tp, (long long)m->shard.kda_h0,
                      (long long)m->shard.kda_h1, (long long)m->shard.att_h0,
                      (long long)m->shard.att_h1, (long long)m->shard.own_h0,
                      (long long)m->shard.own_h1, (long long)m->shard.exp_e0,
                      (long long)m->shard.exp_e1);
    DUET_LOG_INFO("model ready: %s, %lld KV pages of %lld tokens, %lld state slots%s", be,
                  (long long)(m->kv != NULL ? duet_kv_pool_desc(m->kv)->n_pages : 0),
                  (long long)opts.page_tokens, (long long)opts.max_seqs,
                  opts.spec_rows > 0 ? ", verify rows" : "");
    if (m->replay != NULL)
        DUET_LOG_INFO("model: KDA replay pool of %lld rows per slot and layer, %.1f MiB",
                      (long long)opts.spec_rows,
                      (double)duet_replay_pool_bytes(m->replay) / 1048576.0);
    return DUET_OK;
}

/* A group rank (opts.comm with more than one rank): its shard, config and weights. */
static duet_status_t duet__model_group(duet_model_t *m)
{
    const duet_model_opts_t *o = &m->opts;
    const int cp = o->helix_cp > 0 ? o->helix_cp : 1, tp = o->helix_tp > 0 ? o->helix_tp : 1;
    if (o->comm == NULL || o->comm->size <= 1) {
        if (cp * tp > 1)
            return DUET_FAIL(DUET_ERR_INVALID,
                             "model: helix cp %d x tp %d needs a communicator of as many ranks", cp,
                             tp);
        return DUET_OK;
    }
    if (cp * tp != o->comm->size)
        return DUET_FAIL(DUET_ERR_INVALID, "model: helix cp %d x tp %d is not the group's %d ranks",
                         cp, tp, o->comm->size);
    if (o->device != DUET_DEVICE_CPU)
        return DUET_FAIL(DUET_ERR_UNSUPPORTED,
                         "model: a helix group computes on the cpu backend (the %s backend has no "
                         "sharded forward yet)",
                         m->ops->name);
    if (o->spec_rows > 0)
        return DUET_FAIL(DUET_ERR_UNSUPPORTED,
                         "model: speculative decoding (spec_rows) in a helix group is not built");
    duet_status_t st;
    if ((st = duet_shard_make(&m->cfg, cp, tp, o->comm->rank, &m->shard)) != DUET_OK ||
        (st = duet_shard_weights(&m->cfg, &m->w, &m->shard, &m->lw)) != DUET_OK)
        return st;
    duet_shard_config(&m->cfg, &m->shard, &m->lcfg);
    m->grouped = 1;
    return DUET_OK;
}

duet_status_t duet_model_load(const char *dir, const duet_model_opts_t *opts_in, duet_model_t **m_p)
{
    duet_status_t st;
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
    m->ops = duet_backend_find(opts.device);

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
    if (opts.dtype == DUET_MODEL_DTYPE_BF16 && m->opts.compute_dtype != DUET_DTYPE_BF16)
        DUET_LOG_WARN("--dtype bf16 applies to cuda: the %s backend computes in %s (and reads "
                      "the %s weights as they are)",
                      m->ops->name, duet_dtype_name(m->opts.compute_dtype), duet_dtype_name(ck_dt));
    DUET_LOG_INFO("dtype %s: %s checkpoint, %s compute on %s", duet_model_dtype_name(opts.dtype),
                  duet_dtype_name(ck_dt), duet_dtype_name(m->opts.compute_dtype), m->ops->name);
    m->lcfg = m->cfg;
    if ((st = duet__model_group(m)) != DUET_OK || (st = duet__model_finish(m, 1, 0)) != DUET_OK)
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
    const duet_backend_ops_t *ops = duet_backend_find(opts->device);
    if ((ops->caps & DUET_BACKEND_CAP_RANDOM_WEIGHTS) == 0)
        return DUET_FAIL(DUET_ERR_UNSUPPORTED,
                         "model: random weights are generated on the "
                         "device, which the %s backend does not do (cuda does)",
                         ops->name);
    if (opts->dtype == DUET_MODEL_DTYPE_AUTO)
        return DUET_FAIL(DUET_ERR_INVALID, "model: random weights have no checkpoint dtype for "
                                           "dtype auto to follow: ask for f32 or bf16");
    duet_model_t *m = calloc(1, sizeof(*m));
    if (m == NULL)
        return DUET_FAIL(DUET_ERR_NOMEM, "model: out of memory");
    m->opts = *opts;
    m->cfg = *cfg;
    m->lcfg = *cfg;
    m->ops = ops;
    if (opts->comm != NULL && opts->comm->size > 1) {
        free(m);
        return DUET_FAIL(DUET_ERR_UNSUPPORTED, "model: a helix group loads a checkpoint (random "
                                               "weights are for one device)");
    }
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
    if (m->be != NULL)
        m->ops->destroy(m->be);
    free(m->page_table);
    free(m->seq_used);
    duet_replay_pool_destroy(m->replay);
    duet_kda_pool_destroy(m->kda);
    duet_kv_pool_destroy(m->kv);
    duet_weights_free(&m->lw);
    duet_weights_free(&m->w);
    duet_checkpoint_close(m->ck);
    free(m);
}

/* ---- sequences ------------------------------------------------------------------------------ */

/* Pages holding n_tokens tokens (0 without MLA layers). */
static int64_t duet__kv_pages_of(const duet_model_t *m, int64_t n_tokens)
{
    return m->kv != NULL ? (n_tokens + m->opts.page_tokens - 1) / m->opts.page_tokens : 0;
}

/* This rank's pages of a sequence of n_tokens tokens (duet__kv_pages_of alone). */
static int64_t duet__kv_local_pages_of(const duet_model_t *m, int64_t n_tokens)
{
    const int64_t g = duet__kv_pages_of(m, n_tokens);
    return m->grouped ? duet_shard_local_pages(&m->shard, g) : g;
}

/* duet_model_seq_open, its first n_shared pages `shared` (each gaining a holder, never zeroed)
 * and its KDA slot a copy of kda_state when given. */
static duet_status_t duet__seq_open(duet_model_t *m, int64_t max_tokens, const int32_t *shared,
                                    int64_t n_shared, const void *kda_state, duet_seq_t *seq_p)
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
    const int64_t n_pages = duet__kv_local_pages_of(m, max_tokens);
    if (n_shared > n_pages)
        return duet_error_set(DUET_ERR_RANGE, "a shared prefix of %lld pages in a sequence of %lld",
                              (long long)n_shared, (long long)n_pages);
    int32_t *pages = m->page_table + (int64_t)id * m->max_pages_per_seq;
    if (m->kv != NULL) {
        duet_status_t st = duet_kv_pool_alloc(m->kv, n_pages - n_shared, pages + n_shared);
        if (st != DUET_OK)
            return st;
        if (n_shared > 0) {
            memcpy(pages, shared, sizeof(*pages) * (size_t)n_shared);
            duet_kv_pool_ref(m->kv, shared, n_shared);
        }
    }
    int32_t slot = -1;
    if (m->kda != NULL) {
        duet_status_t st = duet_kda_pool_alloc(m->kda, &slot);
        if (st != DUET_OK) {
            if (m->kv != NULL)
                duet_kv_pool_free(m->kv, pages, n_pages);
            return st;
        }
        if (kda_state != NULL) /* the host slot; a device's copy is written after seq_open */
            memcpy(duet_kda_pool_state(m->kda, slot, 0), kda_state,
                   duet_kda_pool_slot_bytes(m->kda));
    }
    /* the backend readies the pages the sequence will write: not the shared ones */
    duet_seq_t tmp = {
        .id = id, .kda_slot = slot, .pages = pages + n_shared, .n_pages = n_pages - n_shared};
    duet_status_t st = m->ops->seq_open(m->be, &tmp);
    duet_backend_pool_mem_t ps = {0};
    m->ops->pool_mem(m->be, DUET_MODEL_POOL_KDA, &ps);
    if (st == DUET_OK && kda_state != NULL && ps.on_device) /* seq_open zeroed the slot there */
        st = m->ops->seq_state_copy(m->be, &tmp, (void *)kda_state, 0);
    if (st != DUET_OK) {
        if (m->kv != NULL)
            duet_kv_pool_free(m->kv, pages, n_pages);
        if (m->kda != NULL)
            duet_kda_pool_free(m->kda, slot);
        return st;
    }
    m->seq_used[id] = 1;
    seq_p->id = id;
    seq_p->n_tokens = m->kv != NULL ? n_shared * m->opts.page_tokens : 0;
    seq_p->n_pending = 0;
    seq_p->n_replay = 0;
    seq_p->pages = pages;
    seq_p->n_pages = n_pages;
    seq_p->kda_slot = slot;
    seq_p->cap_tokens =
        m->kv != NULL ? duet__kv_pages_of(m, max_tokens) * m->opts.page_tokens : max_tokens;
    return DUET_OK;
}

duet_status_t duet_model_seq_open(duet_model_t *m, int64_t max_tokens, duet_seq_t *seq_p)
{
    return duet__seq_open(m, max_tokens, NULL, 0, NULL, seq_p);
}

/* Shared pages are the same page ids in a device's KV pool, so they need nothing there; a KDA
 * state on a device is copied in and out by the backend's seq_state_copy. */
duet_status_t duet_model_prefix_supported(const duet_model_t *m, const char *what)
{
    duet_backend_pool_mem_t ps = {0};
    m->ops->pool_mem(m->be, DUET_MODEL_POOL_KDA, &ps);
    if (m->kv == NULL || m->grouped || (ps.on_device && m->ops->seq_state_copy == NULL))
        return duet_error_set(DUET_ERR_UNSUPPORTED,
                              "%s: the prefix cache needs MLA layers, one rank, and a %s backend "
                              "that can copy a KDA state",
                              what, m->ops->name);
    return DUET_OK;
}

duet_status_t duet_model_seq_open_prefix(duet_model_t *m, int64_t max_tokens, const int32_t *shared,
                                         int64_t n_shared, const void *kda_state, duet_seq_t *seq_p)
{
    duet_status_t st = duet_model_prefix_supported(m, "seq_open_prefix");
    if (st != DUET_OK)
        return st;
    if (n_shared < 0 || (n_shared > 0 && shared == NULL) ||
        (m->kda != NULL && n_shared > 0 && kda_state == NULL))
        return duet_error_set(DUET_ERR_INVALID, "seq_open_prefix: a prefix without its pages or "
                                                "KDA state");
    return duet__seq_open(m, max_tokens, shared, n_shared, kda_state, seq_p);
}

static duet_status_t duet__seq_state_copy(const duet_model_t *m, const duet_seq_t *seq, void *buf,
                                          int to_host);

duet_status_t duet_model_seq_kda_read(const duet_model_t *m, const duet_seq_t *seq, void *dst)
{
    duet_status_t st = duet_model_prefix_supported(m, "seq_kda_read");
    if (st != DUET_OK)
        return st;
    if (seq == NULL || seq->id < 0 || seq->n_pending != 0 || seq->n_replay != 0)
        return duet_error_set(DUET_ERR_INVALID, "seq_kda_read: not an open sequence with its "
                                                "state committed");
    return m->kda != NULL ? duet__seq_state_copy(m, seq, dst, 1) : DUET_OK;
}

size_t duet_model_kda_state_bytes(const duet_model_t *m)
{
    return m->kda != NULL ? duet_kda_pool_slot_bytes(m->kda) : 0;
}

static int duet__seq_is_open(const duet_model_t *m, const duet_seq_t *seq)
{
    return seq != NULL && seq->id >= 0 && seq->id < m->opts.max_seqs && m->seq_used[seq->id];
}

/* set_filled with n_replay accepted rows in the host replay pool (set_received checked them):
 * seq->n_replay is set before the backend takes the sequence, so it knows whether to take rows. */
static duet_status_t duet__seq_fill(duet_model_t *m, duet_seq_t *seq, int64_t n_tokens,
                                    int64_t n_replay)
{
    if (!duet__seq_is_open(m, seq))
        return duet_error_set(DUET_ERR_INVALID, "set_filled: not an open sequence");
    if (n_tokens < 0 || n_tokens > seq->cap_tokens || seq->n_tokens != 0 || seq->n_pending != 0)
        return duet_error_set(DUET_ERR_RANGE,
                              "set_filled: %lld tokens into a sequence of capacity %lld holding "
                              "%lld (and %lld pending)",
                              (long long)n_tokens, (long long)seq->cap_tokens,
                              (long long)seq->n_tokens, (long long)seq->n_pending);
    seq->n_replay = n_replay;
    if (m->ops->seq_set_filled != NULL) {
        duet_status_t st = m->ops->seq_set_filled(m->be, seq, n_tokens);
        if (st != DUET_OK) {
            seq->n_replay = 0;
            return st;
        }
    }
    seq->n_tokens = n_tokens;
    return DUET_OK;
}

duet_status_t duet_model_seq_set_filled(duet_model_t *m, duet_seq_t *seq, int64_t n_tokens)
{
    return duet__seq_fill(m, seq, n_tokens, 0);
}

duet_status_t duet_model_seq_set_received(duet_model_t *m, duet_seq_t *seq, int64_t n_tokens,
                                          int64_t n_replay)
{
    if (n_replay == 0)
        return duet_model_seq_set_filled(m, seq, n_tokens);
    if (!duet__seq_is_open(m, seq))
        return duet_error_set(DUET_ERR_INVALID, "set_received: not an open sequence");
    if (n_replay < 0)
        return duet_error_set(DUET_ERR_RANGE, "set_received: n_replay %lld is negative",
                              (long long)n_replay);
    if (!(m->ops->caps & DUET_BACKEND_CAP_VERIFY))
        return duet_error_set(DUET_ERR_UNSUPPORTED,
                              "set_received: the %s backend cannot take %lld replay rows (no "
                              "verify rows, no host replay pool)",
                              m->ops->name, (long long)n_replay);
    if (m->kda == NULL || m->replay == NULL)
        return duet_error_set(
            DUET_ERR_INVALID, "set_received: %lld replay rows into a model without %s",
            (long long)n_replay, m->kda == NULL ? "KDA layers" : "a replay pool (spec_rows 0)");
    if (n_replay > n_tokens || n_replay > m->opts.spec_rows)
        return duet_error_set(
            DUET_ERR_RANGE, "set_received: %lld replay rows of %lld tokens (spec_rows %lld)",
            (long long)n_replay, (long long)n_tokens, (long long)m->opts.spec_rows);
    return duet__seq_fill(m, seq, n_tokens, n_replay);
}

duet_status_t duet_model_seq_accept(duet_model_t *m, duet_seq_t *seq, int64_t n_rows)
{
    if (!duet__seq_is_open(m, seq))
        return duet_error_set(DUET_ERR_INVALID, "accept: not an open sequence");
    if (seq->n_pending == 0)
        return duet_error_set(DUET_ERR_INVALID,
                              "accept: sequence %d has no verify rows pending (no verify item "
                              "since its last accept)",
                              seq->id);
    if (n_rows < 1 || n_rows > seq->n_pending)
        return duet_error_set(DUET_ERR_RANGE,
                              "accept: %lld rows of sequence %d's verify item of %lld: keep "
                              "1..%lld",
                              (long long)n_rows, seq->id, (long long)seq->n_pending,
                              (long long)seq->n_pending);
    DUET_ASSERT(seq->n_replay == 0); /* the verify forward folded the earlier ones */
    seq->n_tokens += n_rows;
    seq->n_replay = m->kda != NULL ? n_rows : 0;
    seq->n_pending = 0;
    return DUET_OK;
}

duet_status_t duet_model_seq_commit(duet_model_t *m, duet_seq_t *seq)
{
    if (!duet__seq_is_open(m, seq))
        return duet_error_set(DUET_ERR_INVALID, "commit: not an open sequence");
    if (seq->n_pending != 0)
        return duet_error_set(DUET_ERR_INVALID,
                              "commit: sequence %d has %lld verify rows pending: accept them "
                              "first",
                              seq->id, (long long)seq->n_pending);
    if (seq->n_replay == 0)
        return DUET_OK;
    if (m->ops->seq_replay == NULL) /* only a backend with verify rows makes replay rows */
        return duet_error_set(DUET_ERR_UNSUPPORTED, "commit: the %s backend has no replay",
                              m->ops->name);
    duet_status_t st = m->ops->seq_replay(m->be, seq);
    if (st != DUET_OK)
        return st;
    seq->n_replay = 0;
    return DUET_OK;
}

size_t duet_model_seq_state_bytes(const duet_model_t *m)
{
    return m->kda != NULL ? duet_kda_pool_slot_bytes(m->kda) : 0;
}

/* Copy seq's KDA slot to buf (to_host 1) or back (0): the host pool when it is the backend's
 * state, else the backend's seq_state_copy. */
static duet_status_t duet__seq_state_copy(const duet_model_t *m, const duet_seq_t *seq, void *buf,
                                          int to_host)
{
    duet_backend_pool_mem_t pm = {0};
    m->ops->pool_mem(m->be, DUET_MODEL_POOL_KDA, &pm);
    if (!pm.on_device) {
        uint8_t *slot = (uint8_t *)duet_kda_pool_state(m->kda, seq->kda_slot, 0);
        const size_t bytes = duet_kda_pool_slot_bytes(m->kda);
        if (to_host)
            memcpy(buf, slot, bytes);
        else
            memcpy(slot, buf, bytes);
        return DUET_OK;
    }
    if (m->ops->seq_state_copy == NULL)
        return duet_error_set(DUET_ERR_UNSUPPORTED,
                              "the %s backend cannot copy a sequence's KDA state to or from the "
                              "host",
                              m->ops->name);
    return m->ops->seq_state_copy(m->be, seq, buf, to_host);
}

duet_status_t duet_model_seq_state_save(duet_model_t *m, const duet_seq_t *seq, void *buf)
{
    if (!duet__seq_is_open(m, seq))
        return duet_error_set(DUET_ERR_INVALID, "state save: not an open sequence");
    if (seq->n_replay != 0)
        return duet_error_set(DUET_ERR_INVALID,
                              "state save: sequence %d has %lld accepted rows not yet in its "
                              "state: commit them first (duet_model_seq_commit)",
                              seq->id, (long long)seq->n_replay);
    return m->kda != NULL ? duet__seq_state_copy(m, seq, buf, 1) : DUET_OK;
}

duet_status_t duet_model_seq_state_restore(duet_model_t *m, duet_seq_t *seq, const void *buf)
{
    if (!duet__seq_is_open(m, seq))
        return duet_error_set(DUET_ERR_INVALID, "state restore: not an open sequence");
    if (m->kda != NULL) {
        duet_status_t st = duet__seq_state_copy(m, seq, (void *)buf, 0);
        if (st != DUET_OK)
            return st;
    }
    seq->n_pending = 0;
    seq->n_replay = 0;
    return DUET_OK;
}

duet_status_t duet_model_seq_truncate(duet_model_t *m, duet_seq_t *seq, int64_t n_tokens,
                                      const void *state)
{
    if (!duet__seq_is_open(m, seq))
        return duet_error_set(DUET_ERR_INVALID, "truncate: not an open sequence");
    if (m->kda != NULL && state == NULL)
        return duet_error_set(DUET_ERR_INVALID,
                              "truncate: the model has KDA layers, whose recurrent state cannot "
                              "be rolled back: pass the state saved at the point rolled back to "
                              "(duet_model_seq_state_save)");
    if (n_tokens < 0 || n_tokens > seq->n_tokens)
        return duet_error_set(
            DUET_ERR_RANGE, "truncate: a sequence of %lld tokens to %lld: expected 0..%lld",
            (long long)seq->n_tokens, (long long)n_tokens, (long long)seq->n_tokens);
    duet_status_t st = duet_model_seq_state_restore(m, seq, state);
    if (st != DUET_OK)
        return st;
    seq->n_tokens = n_tokens;
    return DUET_OK;
}

duet_status_t duet_model_seq_grow(duet_model_t *m, duet_seq_t *seq, int64_t max_tokens)
{
    if (!duet__seq_is_open(m, seq))
        return duet_error_set(DUET_ERR_INVALID, "grow: not an open sequence");
    if (max_tokens > m->opts.max_seq_len)
        return duet_error_set(DUET_ERR_RANGE,
                              "grow: a sequence of %lld tokens: the model holds "
                              "at most %lld",
                              (long long)max_tokens, (long long)m->opts.max_seq_len);
    if (max_tokens <= seq->cap_tokens)
        return DUET_OK;
    if (m->kv == NULL) { /* no pages: the capacity is a number */
        seq->cap_tokens = max_tokens;
        return DUET_OK;
    }
    const int64_t want = duet__kv_local_pages_of(m, max_tokens);
    const int64_t add = want - seq->n_pages;
    int32_t *fresh = seq->pages + seq->n_pages; /* the table row has max_pages_per_seq entries */
    duet_status_t st = duet_kv_pool_alloc(m->kv, add, fresh);
    if (st != DUET_OK)
        return st;
    /* as seq_open: stale KV is never read, but a dump of the sequence stays deterministic */
    duet_kv_pool_zero_pages(m->kv, fresh, add);
    seq->n_pages = want;
    seq->cap_tokens = duet__kv_pages_of(m, max_tokens) * m->opts.page_tokens;
    return DUET_OK;
}

size_t duet_model_seq_snapshot_bytes(const duet_model_t *m, int64_t n_tokens)
{
    size_t kv = 0;
    if (m->kv != NULL)
        kv = (size_t)duet__kv_local_pages_of(m, n_tokens) *
             (size_t)duet_kv_pool_desc(m->kv)->n_layers * duet_kv_pool_block_bytes(m->kv);
    return kv + duet_model_seq_state_bytes(m);
}

/* Copy the first n_pages pages of seq, every MLA layer, to buf (to_host 1) or back (0): the host
 * pool itself, else the backend's seq_kv_copy (DUET_ERR_UNSUPPORTED without one). buf NULL, only
 * with a device pool: each page to / from its own place in the host pool. */
static duet_status_t duet__seq_kv_copy(duet_model_t *m, const duet_seq_t *seq, int64_t n_pages,
                                       uint8_t *buf, int to_host)
{
    if (m->kv == NULL || n_pages == 0)
        return DUET_OK;
    duet_backend_pool_mem_t pm = {0};
    m->ops->pool_mem(m->be, DUET_MODEL_POOL_KV, &pm);
    if (pm.on_device) {
        if (m->ops->seq_kv_copy == NULL)
            return duet_error_set(DUET_ERR_UNSUPPORTED,
                                  "the %s backend keeps the KV cache where a snapshot cannot "
                                  "copy it from",
                                  m->ops->name);
        return m->ops->seq_kv_copy(m->be, seq, n_pages, buf, to_host);
    }
    const int64_t layers = duet_kv_pool_desc(m->kv)->n_layers;
    const size_t block = duet_kv_pool_block_bytes(m->kv);
    for (int64_t p = 0; p < n_pages; p++)
        for (int64_t l = 0; l < layers; l++, buf += block) {
            void *at = duet_kv_pool_block(m->kv, seq->pages[p], l);
            if (to_host)
                memcpy(buf, at, block);
            else
                memcpy(at, buf, block);
        }
    return DUET_OK;
}

duet_status_t duet_model_seq_snapshot_save(duet_model_t *m, duet_seq_t *seq, void *buf)
{
    if (!duet__seq_is_open(m, seq))
        return duet_error_set(DUET_ERR_INVALID, "snapshot: not an open sequence");
    duet_status_t st = duet_model_seq_commit(m, seq); /* refuses pending rows */
    if (st != DUET_OK)
        return st;
    const int64_t n_pages = duet__kv_local_pages_of(m, seq->n_tokens);
    if ((st = duet__seq_kv_copy(m, seq, n_pages, buf, 1)) != DUET_OK)
        return st;
    const size_t kv_bytes =
        duet_model_seq_snapshot_bytes(m, seq->n_tokens) - duet_model_seq_state_bytes(m);
    return duet_model_seq_state_save(m, seq, (uint8_t *)buf + kv_bytes);
}

duet_status_t duet_model_seq_sync_host(duet_model_t *m, duet_seq_t *seq)
{
    if (!duet__seq_is_open(m, seq))
        return duet_error_set(DUET_ERR_INVALID, "sync host: not an open sequence");
    if (seq->n_pending != 0)
        return duet_error_set(DUET_ERR_INVALID,
                              "sync host: sequence %d has %lld verify rows pending: accept them "
                              "first",
                              seq->id, (long long)seq->n_pending);
    duet_backend_pool_mem_t pm = {0};
    duet_status_t st = DUET_OK;
    if (m->replay != NULL && seq->n_replay > 0) {
        /* rows in a device replay pool cannot travel from the host one: fold them in */
        m->ops->pool_mem(m->be, DUET_MODEL_POOL_REPLAY, &pm);
        if (pm.on_device && (st = duet_model_seq_commit(m, seq)) != DUET_OK)
            return st;
    }
    if (m->kv != NULL) {
        m->ops->pool_mem(m->be, DUET_MODEL_POOL_KV, &pm);
        if (pm.on_device) /* every page into its own place in the host pool (buf NULL) */
            st = duet__seq_kv_copy(m, seq, duet__kv_local_pages_of(m, seq->n_tokens), NULL, 1);
    }
    if (st == DUET_OK && m->kda != NULL && seq->kda_slot >= 0) {
        m->ops->pool_mem(m->be, DUET_MODEL_POOL_KDA, &pm);
        if (pm.on_device)
            st = duet__seq_state_copy(m, seq, duet_kda_pool_state(m->kda, seq->kda_slot, 0), 1);
    }
    return st;
}

duet_status_t duet_model_seq_snapshot_restore(duet_model_t *m, duet_seq_t *seq, const void *buf,
                                              int64_t n_tokens)
{
    if (!duet__seq_is_open(m, seq))
        return duet_error_set(DUET_ERR_INVALID, "snapshot restore: not an open sequence");
    if (n_tokens < 0 || n_tokens > seq->cap_tokens || seq->n_tokens != 0 || seq->n_pending != 0)
        return duet_error_set(DUET_ERR_RANGE,
                              "snapshot restore: %lld tokens into a sequence of capacity %lld "
                              "holding %lld (and %lld pending)",
                              (long long)n_tokens, (long long)seq->cap_tokens,
                              (long long)seq->n_tokens, (long long)seq->n_pending);
    const int64_t n_pages = duet__kv_local_pages_of(m, n_tokens);
    duet_status_t st = duet__seq_kv_copy(m, seq, n_pages, (uint8_t *)buf, 0);
    if (st != DUET_OK)
        return st;
    const size_t kv_bytes =
        duet_model_seq_snapshot_bytes(m, n_tokens) - duet_model_seq_state_bytes(m);
    if ((st = duet_model_seq_state_restore(m, seq, (const uint8_t *)buf + kv_bytes)) != DUET_OK)
        return st;
    return duet_model_seq_set_filled(m, seq, n_tokens);
}

void duet_model_set_layer_hook(duet_model_t *m, duet_model_layer_hook_fn fn, void *user)
{
    m->layer_hook = fn;
    m->layer_hook_user = user;
}

void duet_model_seq_close(duet_model_t *m, duet_seq_t *seq)
{
    if (seq == NULL || seq->id < 0)
        return;
    DUET_ASSERT(seq->id < m->opts.max_seqs && m->seq_used[seq->id]);
    if (m->ops->seq_close != NULL)
        m->ops->seq_close(m->be, seq);
    if (m->kv != NULL)
        duet_kv_pool_free(m->kv, seq->pages, seq->n_pages);
    if (m->kda != NULL)
        duet_kda_pool_free(m->kda, seq->kda_slot);
    m->seq_used[seq->id] = 0;
    seq->id = -1;
    seq->n_pages = 0;
    seq->n_pending = 0;
    seq->n_replay = 0;
}

/* ---- forward -------------------------------------------------------------------------------- */

/* A verify item's own rules (model.h, duet_batch_item_t.verify). */
static duet_status_t duet__validate_verify(const duet_model_t *m, const duet_batch_item_t *it,
                                           int64_t i)
{
    if (it->verify != 1)
        return duet_error_set(DUET_ERR_INVALID, "forward: item %lld: verify is %d, not 0 or 1",
                              (long long)i, it->verify);
    if ((m->ops->caps & DUET_BACKEND_CAP_VERIFY) == 0)
        return duet_error_set(DUET_ERR_UNSUPPORTED,
                              "forward: item %lld is a verify item, which the %s backend does "
                              "not compute yet",
                              (long long)i, m->ops->name);
    if (m->opts.spec_rows == 0)
        return duet_error_set(DUET_ERR_INVALID,
                              "forward: item %lld is a verify item, but the model was loaded "
                              "without spec_rows",
                              (long long)i);
    if (it->logits_mode != DUET_LOGITS_ALL && it->logits_mode != DUET_LOGITS_ARGMAX)
        return duet_error_set(DUET_ERR_INVALID,
                              "forward: item %lld: a verify item wants the logits of every row "
                              "(DUET_LOGITS_ALL) or their arg-maxes (DUET_LOGITS_ARGMAX)",
                              (long long)i);
    if (it->n_tokens < 2 || it->n_tokens > m->opts.spec_rows)
        return duet_error_set(DUET_ERR_RANGE,
                              "forward: item %lld: a verify item of %lld rows: 2..spec_rows "
                              "(%lld)",
                              (long long)i, (long long)it->n_tokens, (long long)m->opts.spec_rows);
    return DUET_OK;
}

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
        if (it->seq->n_pending != 0)
            return duet_error_set(DUET_ERR_INVALID,
                                  "forward: item %lld: sequence %d has %lld verify rows pending: "
                                  "accept them first (duet_model_seq_accept)",
                                  (long long)i, it->seq->id, (long long)it->seq->n_pending);
        if (it->verify != 0) {
            duet_status_t st = duet__validate_verify(m, it, i);
            if (st != DUET_OK)
                return st;
        }
        if (it->seq->n_tokens + it->n_tokens > it->seq->cap_tokens)
            return duet_error_set(DUET_ERR_RANGE,
                                  "forward: item %lld: %lld + %lld tokens exceed the sequence's "
                                  "%lld reserved",
                                  (long long)i, (long long)it->seq->n_tokens,
                                  (long long)it->n_tokens, (long long)it->seq->cap_tokens);
        if (m->grouped && m->shard.rank != 0 && it->logits_mode != DUET_LOGITS_NONE)
            return duet_error_set(DUET_ERR_INVALID,
                                  "forward: item %lld asks rank %d of a helix group for logits: "
                                  "only rank 0 holds the LM head",
                                  (long long)i, m->shard.rank);
        if (it->logits_mode == DUET_LOGITS_ARGMAX) {
            if (it->token_out == NULL)
                return duet_error_set(DUET_ERR_INVALID,
                                      "forward: item %lld wants its rows' arg-maxes but has "
                                      "nowhere to put them",
                                      (long long)i);
        } else if (it->logits_mode == DUET_LOGITS_TOKEN) {
            if (it->token_out == NULL)
                return duet_error_set(DUET_ERR_INVALID,
                                      "forward: item %lld wants a token but "
                                      "has nowhere to put it",
                                      (long long)i);
            duet_status_t st = duet_sampling_validate(&it->sampling);
            if (st != DUET_OK)
                return st;
        } else if (it->logits_mode != DUET_LOGITS_NONE && it->logits == NULL)
            return duet_error_set(DUET_ERR_INVALID,
                                  "forward: item %lld wants logits but has "
                                  "no buffer",
                                  (long long)i);
        for (int64_t t = 0; t < it->n_tokens; t++)
            if (it->tokens[t] < 0 || it->tokens[t] >= m->cfg.vocab_size)
                return duet_error_set(DUET_ERR_RANGE,
                                      "forward: item %lld: token %d outside the "
                                      "vocabulary [0, %lld)",
                                      (long long)i, it->tokens[t], (long long)m->cfg.vocab_size);
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
    int64_t rows = 0;
    duet_status_t s = duet__validate_batch(m, items, n_items, &rows);
    if (s != DUET_OK)
        return s;
    const duet_backend_batch_t b = {.items = items,
                                    .n_items = n_items,
                                    .n_rows = rows,
                                    .hook = m->layer_hook,
                                    .hook_user = m->layer_hook_user};
    if ((s = m->ops->forward(m->be, &b)) != DUET_OK)
        return s;
    for (int64_t i = 0; i < n_items; i++) {
        duet_seq_t *seq = items[i].seq;
        if (items[i].verify)
            seq->n_pending = items[i].n_tokens;
        else
            seq->n_tokens += items[i].n_tokens;
        seq->n_replay = 0; /* folded in before the item's rows */
    }
    return DUET_OK;
}
