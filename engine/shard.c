/*
 * shard.c: a group rank's cut of the config and the weights (contract in shard.h). Row ranges are
 * views into the mmapped checkpoint, so a rank's process only ever reads its own rows; column
 * ranges (the projections that take the sharded dimension as input) are copied once, into one
 * allocation, and their source rows are not touched again.
 */
#include "engine/shard.h"

#include <stdlib.h>
#include <string.h>

duet_status_t duet_shard_make(const duet_model_config_t *c, int cp, int tp, int rank,
                              duet_shard_t *s)
{
    if (cp < 1 || tp < 1 || cp * tp > DUET_SHARD_MAX_RANKS)
        return duet_error_set(DUET_ERR_INVALID,
                              "helix: cp %d x tp %d: each at least 1 and at most %d ranks", cp, tp,
                              DUET_SHARD_MAX_RANKS);
    const int n = cp * tp;
    if (rank < 0 || rank >= n)
        return duet_error_set(DUET_ERR_INVALID, "helix: rank %d of a group of %d", rank, n);
    /* every rank holds at least one KDA head (its state pool and its transfer layout need one)
     * and attends with at least one MLA head */
    if (c->n_kda_layers > 0 && c->kda_heads % n != 0)
        return duet_error_set(DUET_ERR_INVALID,
                              "helix: %d ranks cannot share the model's %lld KDA heads evenly (the "
                              "cache transfer deals them out evenly)",
                              n, (long long)c->kda_heads);
    if (c->n_mla_layers > 0 && c->mla_heads < tp)
        return duet_error_set(DUET_ERR_INVALID,
                              "helix: tp %d, but the model has %lld MLA heads to share", tp,
                              (long long)c->mla_heads);
    memset(s, 0, sizeof(*s));
    s->rank = rank;
    s->size = n;
    s->cp = cp;
    s->tp = tp;
    s->c = rank / tp;
    s->t = rank % tp;
    s->kda_h0 = duet_shard_cut(c->kda_heads, n, rank);
    s->kda_h1 = duet_shard_cut(c->kda_heads, n, rank + 1);
    s->att_h0 = duet_shard_cut(c->mla_heads, tp, s->t);
    s->att_h1 = duet_shard_cut(c->mla_heads, tp, s->t + 1);
    const int64_t na = s->att_h1 - s->att_h0;
    s->own_h0 = s->att_h0 + duet_shard_cut(na, cp, s->c);
    s->own_h1 = s->att_h0 + duet_shard_cut(na, cp, s->c + 1);
    s->mlp_i0 = duet_shard_cut(c->dense_intermediate, n, rank);
    s->mlp_i1 = duet_shard_cut(c->dense_intermediate, n, rank + 1);
    const int64_t shared = c->moe_intermediate * c->n_shared_experts;
    s->shr_i0 = duet_shard_cut(shared, n, rank);
    s->shr_i1 = duet_shard_cut(shared, n, rank + 1);
    s->exp_e0 = duet_shard_cut(c->n_experts, n, rank);
    s->exp_e1 = duet_shard_cut(c->n_experts, n, rank + 1);
    return DUET_OK;
}

void duet_shard_config(const duet_model_config_t *full, const duet_shard_t *s,
                       duet_model_config_t *local)
{
    *local = *full;
    local->kda_heads = s->kda_h1 - s->kda_h0;
    local->mla_heads = s->att_h1 - s->att_h0;
    local->dense_intermediate = s->mlp_i1 - s->mlp_i0;
}

/* Rows [r0, r1) of a tensor's first dimension, as a view (any rank of tensor). */
static duet_tensor_t duet__rows(const duet_tensor_t *w, int64_t r0, int64_t r1)
{
    duet_tensor_t t = *w;
    const int64_t per = w->shape[0] > 0 ? duet_tensor_numel(w) / w->shape[0] : 0;
    t.data = (uint8_t *)w->data + (size_t)(r0 * per) * duet_dtype_size(w->dtype);
    t.shape[0] = r1 - r0;
    return t;
}

/* Bytes of columns [c0, c1) of every row of a 2-D tensor. */
static size_t duet__col_bytes(const duet_tensor_t *w, int64_t c0, int64_t c1)
{
    return (size_t)(w->shape[0] * (c1 - c0)) * duet_dtype_size(w->dtype);
}

/* Columns [c0, c1) of a 2-D tensor copied to *at (advanced past them). */
static duet_tensor_t duet__cols(const duet_tensor_t *w, int64_t c0, int64_t c1, uint8_t **at)
{
    const size_t es = duet_dtype_size(w->dtype), row = (size_t)w->shape[1] * es;
    const size_t take = (size_t)(c1 - c0) * es;
    duet_tensor_t t = *w;
    t.data = *at;
    t.shape[1] = c1 - c0;
    for (int64_t r = 0; r < w->shape[0]; r++)
        memcpy(*at + (size_t)r * take, (const uint8_t *)w->data + (size_t)r * row + c0 * es, take);
    *at += (duet__col_bytes(w, c0, c1) + 63) / 64 * 64;
    return t;
}

/* One pass over the layers: with at == NULL it counts the copies' bytes into *bytes, else it
 * fills local (whose layers and expert arrays are allocated) and copies. */
static void duet__shard_pass(const duet_model_config_t *c, const duet_weights_t *w,
                             const duet_shard_t *s, duet_weights_t *local, uint8_t *at,
                             size_t *bytes)
{
    const int64_t K = c->kda_head_dim, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim;
    const int64_t dv = c->v_head_dim, E = c->n_experts;
    size_t need = 0;
#define DUET__COLS(dst, src, c0, c1)                                                               \
    do {                                                                                           \
        if (at != NULL)                                                                            \
            (dst) = duet__cols(&(src), (c0), (c1), &at);                                           \
        else                                                                                       \
            need += (duet__col_bytes(&(src), (c0), (c1)) + 63) / 64 * 64;                          \
    } while (0)
    for (int64_t l = 0; l < c->num_layers; l++) {
        const duet_layer_weights_t *lw = &w->layers[l];
        duet_layer_weights_t *ll = at != NULL ? &local->layers[l] : NULL;
        duet_layer_weights_t scratch;
        if (ll == NULL)
            ll = &scratch;
        if (at != NULL) {
            duet_tensor_t *w1 = ll->moe.w1, *w2 = ll->moe.w2, *w3 = ll->moe.w3;
            *ll = *lw;
            ll->moe.w1 = w1, ll->moe.w2 = w2, ll->moe.w3 = w3;
        }
        if (c->mixer[l] == DUET_MIXER_KDA) {
            const duet_kda_weights_t *a = &lw->kda;
            duet_kda_weights_t *b = &ll->kda;
            const int64_t h0 = s->kda_h0, h1 = s->kda_h1;
            if (at != NULL) {
                b->q_proj = duet__rows(&a->q_proj, h0 * K, h1 * K);
                b->k_proj = duet__rows(&a->k_proj, h0 * K, h1 * K);
                b->v_proj = duet__rows(&a->v_proj, h0 * K, h1 * K);
                b->q_conv = duet__rows(&a->q_conv, h0 * K, h1 * K);
                b->k_conv = duet__rows(&a->k_conv, h0 * K, h1 * K);
                b->v_conv = duet__rows(&a->v_conv, h0 * K, h1 * K);
                b->f_b_proj = duet__rows(&a->f_b_proj, h0 * K, h1 * K);
                b->dt_bias = duet__rows(&a->dt_bias, h0 * K, h1 * K);
                b->b_proj = duet__rows(&a->b_proj, h0, h1);
                b->g_b_proj = duet__rows(&a->g_b_proj, h0 * K, h1 * K);
                /* A_log is (1, 1, H, 1): its heads are its elements */
                b->A_log.data = (uint8_t *)a->A_log.data + h0 * duet_dtype_size(a->A_log.dtype);
                b->A_log.shape[2] = h1 - h0;
            }
            DUET__COLS(b->o_proj, a->o_proj, h0 * K, h1 * K);
        } else {
            const duet_mla_weights_t *a = &lw->mla;
            duet_mla_weights_t *b = &ll->mla;
            const int64_t h0 = s->att_h0, h1 = s->att_h1;
            if (at != NULL) {
                if (c->q_lora_rank > 0)
                    b->q_b_proj = duet__rows(&a->q_b_proj, h0 * (dn + dr), h1 * (dn + dr));
                else
                    b->q_proj = duet__rows(&a->q_proj, h0 * (dn + dr), h1 * (dn + dr));
                b->kv_b_proj = duet__rows(&a->kv_b_proj, h0 * (dn + dv), h1 * (dn + dv));
            }
            DUET__COLS(b->o_proj, a->o_proj, s->own_h0 * dv, s->own_h1 * dv);
        }
        if (c->ffn[l] == DUET_FFN_MOE) {
            const duet_moe_weights_t *a = &lw->moe;
            duet_moe_weights_t *b = &ll->moe;
            for (int64_t e = 0; at != NULL && e < E; e++) {
                const int mine = e >= s->exp_e0 && e < s->exp_e1;
                b->w1[e] = a->w1[e];
                b->w2[e] = a->w2[e];
                b->w3[e] = a->w3[e];
                if (!mine)
                    b->w1[e].data = b->w2[e].data = b->w3[e].data = NULL;
            }
            if (c->n_shared_experts > 0) {
                if (at != NULL) {
                    b->shared.gate_proj = duet__rows(&a->shared.gate_proj, s->shr_i0, s->shr_i1);
                    b->shared.up_proj = duet__rows(&a->shared.up_proj, s->shr_i0, s->shr_i1);
                }
                DUET__COLS(b->shared.down_proj, a->shared.down_proj, s->shr_i0, s->shr_i1);
            }
        } else {
            const duet_mlp_weights_t *a = &lw->mlp;
            duet_mlp_weights_t *b = &ll->mlp;
            if (at != NULL) {
                b->gate_proj = duet__rows(&a->gate_proj, s->mlp_i0, s->mlp_i1);
                b->up_proj = duet__rows(&a->up_proj, s->mlp_i0, s->mlp_i1);
            }
            DUET__COLS(b->down_proj, a->down_proj, s->mlp_i0, s->mlp_i1);
        }
    }
#undef DUET__COLS
    if (bytes != NULL)
        *bytes = need;
}

duet_status_t duet_shard_weights(const duet_model_config_t *full, const duet_weights_t *w,
                                 const duet_shard_t *s, duet_weights_t *local)
{
    const int64_t L = full->num_layers, E = full->n_experts;
    memset(local, 0, sizeof(*local));
    local->embed_tokens = w->embed_tokens;
    local->norm = w->norm;
    local->lm_head = w->lm_head;
    if (s->rank != 0) /* only rank 0 computes logits */
        local->lm_head.data = NULL;
    size_t bytes = 0;
    duet__shard_pass(full, w, s, local, NULL, &bytes);
    local->layers = calloc((size_t)L, sizeof(*local->layers));
    local->expert_slab = E > 0 ? calloc((size_t)(3 * E * L), sizeof(duet_tensor_t)) : NULL;
    local->copies = bytes > 0 ? malloc(bytes) : NULL;
    if (local->layers == NULL || (E > 0 && local->expert_slab == NULL) ||
        (bytes > 0 && local->copies == NULL)) {
        duet_weights_free(local);
        return duet_error_set(DUET_ERR_NOMEM,
                              "helix: out of memory for the shard's weights "
                              "(%.1f MiB of column cuts)",
                              (double)bytes / 1048576.0);
    }
    for (int64_t l = 0; l < L && E > 0; l++) {
        local->layers[l].moe.w1 = local->expert_slab + 3 * E * l;
        local->layers[l].moe.w2 = local->layers[l].moe.w1 + E;
        local->layers[l].moe.w3 = local->layers[l].moe.w2 + E;
    }
    duet__shard_pass(full, w, s, local, local->copies, NULL);
    return DUET_OK;
}
