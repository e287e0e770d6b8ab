/*
 * weights.c: bind the checkpoint's tensors to the model's named weights (docs/model.md, "Weights
 * and shapes"), checking each shape against the config.
 *
 * Every tensor goes through duet_checkpoint_get_shaped, which both validates the shape and marks
 * the tensor used, so afterwards the checkpoint knows which tensors no layer asked for (an MTP
 * head, a stray optimizer buffer, a mislabelled layer): those are reported in one warning line
 * rather than silently ignored. The per-expert tensor arrays of all MoE layers are carved from
 * one allocation (expert_slab) so freeing is one call and the arrays sit together in memory.
 */
#include "engine/weights.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

#define WEIGHTS_UNUSED_SHOWN 5

/* Bind tensor printf(fmt, ...) with the shape dims[0..ndim). */
static duet_status_t bind(duet_checkpoint_t *ck, duet_tensor_t *t, int ndim, const int64_t *dims,
                          const char *fmt, ...) __attribute__((format(printf, 5, 6)));
static duet_status_t bind(duet_checkpoint_t *ck, duet_tensor_t *t, int ndim, const int64_t *dims,
                          const char *fmt, ...)
{
    char name[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof(name), fmt, ap);
    va_end(ap);
    return duet_checkpoint_get_shaped(ck, name, ndim, dims, t);
}

// clang-format off
#define DIMS(...) (int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (int64_t[]){__VA_ARGS__}
// clang-format on

#define TRY(expr) DUET_TRY(expr)

static duet_status_t bind_kda(duet_checkpoint_t *ck, const duet_model_config_t *c, int l,
                              duet_kda_weights_t *w)
{
    const int64_t D = c->hidden_size, H = c->kda_heads, K = c->kda_head_dim, HK = H * K;
    const int64_t W = c->conv_kernel;
    const char *p = "model.layers.%d.self_attn.%s";
    TRY(bind(ck, &w->q_proj, DIMS(HK, D), p, l, "q_proj.weight"));
    TRY(bind(ck, &w->k_proj, DIMS(HK, D), p, l, "k_proj.weight"));
    TRY(bind(ck, &w->v_proj, DIMS(HK, D), p, l, "v_proj.weight"));
    TRY(bind(ck, &w->q_conv, DIMS(HK, 1, W), p, l, "q_conv1d.weight"));
    TRY(bind(ck, &w->k_conv, DIMS(HK, 1, W), p, l, "k_conv1d.weight"));
    TRY(bind(ck, &w->v_conv, DIMS(HK, 1, W), p, l, "v_conv1d.weight"));
    TRY(bind(ck, &w->f_a_proj, DIMS(K, D), p, l, "f_a_proj.weight"));
    TRY(bind(ck, &w->f_b_proj, DIMS(HK, K), p, l, "f_b_proj.weight"));
    TRY(bind(ck, &w->dt_bias, DIMS(HK), p, l, "dt_bias"));
    TRY(bind(ck, &w->A_log, DIMS(1, 1, H, 1), p, l, "A_log"));
    TRY(bind(ck, &w->b_proj, DIMS(H, D), p, l, "b_proj.weight"));
    TRY(bind(ck, &w->g_a_proj, DIMS(K, D), p, l, "g_a_proj.weight"));
    TRY(bind(ck, &w->g_b_proj, DIMS(HK, K), p, l, "g_b_proj.weight"));
    TRY(bind(ck, &w->o_norm, DIMS(K), p, l, "o_norm.weight"));
    TRY(bind(ck, &w->o_proj, DIMS(D, HK), p, l, "o_proj.weight"));
    return DUET_OK;
}

static duet_status_t bind_mla(duet_checkpoint_t *ck, const duet_model_config_t *c, int l,
                              duet_mla_weights_t *w)
{
    const int64_t D = c->hidden_size, n = c->mla_heads, dn = c->qk_nope_head_dim;
    const int64_t dr = c->qk_rope_head_dim, dv = c->v_head_dim, r = c->kv_lora_rank;
    const int64_t ql = c->q_lora_rank;
    const char *p = "model.layers.%d.self_attn.%s";
    if (ql > 0) {
        TRY(bind(ck, &w->q_a_proj, DIMS(ql, D), p, l, "q_a_proj.weight"));
        TRY(bind(ck, &w->q_a_layernorm, DIMS(ql), p, l, "q_a_layernorm.weight"));
        TRY(bind(ck, &w->q_b_proj, DIMS(n * (dn + dr), ql), p, l, "q_b_proj.weight"));
    } else {
        TRY(bind(ck, &w->q_proj, DIMS(n * (dn + dr), D), p, l, "q_proj.weight"));
    }
    TRY(bind(ck, &w->kv_a_proj_with_mqa, DIMS(r + dr, D), p, l, "kv_a_proj_with_mqa.weight"));
    TRY(bind(ck, &w->kv_a_layernorm, DIMS(r), p, l, "kv_a_layernorm.weight"));
    TRY(bind(ck, &w->kv_b_proj, DIMS(n * (dn + dv), r), p, l, "kv_b_proj.weight"));
    TRY(bind(ck, &w->o_proj, DIMS(D, n * dv), p, l, "o_proj.weight"));
    return DUET_OK;
}

/* gate/up/down of a dense MLP or of the shared experts; `prefix` ends before "gate_proj". */
static duet_status_t bind_mlp(duet_checkpoint_t *ck, int64_t D, int64_t I, int l,
                              const char *prefix, duet_mlp_weights_t *w)
{
    TRY(bind(ck, &w->gate_proj, DIMS(I, D), "model.layers.%d.%sgate_proj.weight", l, prefix));
    TRY(bind(ck, &w->up_proj, DIMS(I, D), "model.layers.%d.%sup_proj.weight", l, prefix));
    TRY(bind(ck, &w->down_proj, DIMS(D, I), "model.layers.%d.%sdown_proj.weight", l, prefix));
    return DUET_OK;
}

static duet_status_t bind_moe(duet_checkpoint_t *ck, const duet_model_config_t *c, int l,
                              duet_moe_weights_t *w)
{
    const int64_t D = c->hidden_size, E = c->n_experts, I = c->moe_intermediate;
    TRY(bind(ck, &w->gate, DIMS(E, D), "model.layers.%d.block_sparse_moe.gate.weight", l));
    TRY(bind(ck, &w->gate_bias, DIMS(E),
             "model.layers.%d.block_sparse_moe.gate.e_score_correction_bias", l));
    for (int64_t e = 0; e < E; e++) {
        const char *p = "model.layers.%d.block_sparse_moe.experts.%" PRId64 ".%s";
        TRY(bind(ck, &w->w1[e], DIMS(I, D), p, l, e, "w1.weight"));
        TRY(bind(ck, &w->w2[e], DIMS(D, I), p, l, e, "w2.weight"));
        TRY(bind(ck, &w->w3[e], DIMS(I, D), p, l, e, "w3.weight"));
    }
    if (c->n_shared_experts > 0)
        TRY(bind_mlp(ck, D, I * c->n_shared_experts, l, "block_sparse_moe.shared_experts.",
                     &w->shared));
    return DUET_OK;
}

static duet_status_t bind_all(duet_checkpoint_t *ck, const duet_model_config_t *c,
                              duet_weights_t *w)
{
    const int64_t D = c->hidden_size, V = c->vocab_size;
    TRY(bind(ck, &w->embed_tokens, DIMS(V, D), "model.embed_tokens.weight"));
    TRY(bind(ck, &w->norm, DIMS(D), "model.norm.weight"));
    if (c->tie_word_embeddings)
        w->lm_head = w->embed_tokens;
    else
        TRY(bind(ck, &w->lm_head, DIMS(V, D), "lm_head.weight"));

    int64_t slab_off = 0;
    for (int l = 0; l < (int)c->num_layers; l++) {
        duet_layer_weights_t *lw = &w->layers[l];
        TRY(bind(ck, &lw->input_layernorm, DIMS(D), "model.layers.%d.input_layernorm.weight", l));
        TRY(bind(ck, &lw->post_attention_layernorm, DIMS(D),
                 "model.layers.%d.post_attention_layernorm.weight", l));
        lw->mixer = c->mixer[l];
        if (lw->mixer == DUET_MIXER_KDA)
            TRY(bind_kda(ck, c, l, &lw->kda));
        else
            TRY(bind_mla(ck, c, l, &lw->mla));
        lw->ffn = c->ffn[l];
        if (lw->ffn == DUET_FFN_DENSE) {
            TRY(bind_mlp(ck, D, c->dense_intermediate, l, "mlp.", &lw->mlp));
        } else {
            lw->moe.w1 = w->expert_slab + slab_off;
            lw->moe.w2 = lw->moe.w1 + c->n_experts;
            lw->moe.w3 = lw->moe.w2 + c->n_experts;
            slab_off += 3 * c->n_experts;
            TRY(bind_moe(ck, c, l, &lw->moe));
        }
    }
    return DUET_OK;
}

static void warn_unused(const duet_checkpoint_t *ck)
{
    int64_t n = duet_checkpoint_n_unused(ck);
    if (n == 0)
        return;
    char buf[1024];
    size_t off = 0;
    buf[0] = '\0';
    for (int64_t i = 0; i < n && i < WEIGHTS_UNUSED_SHOWN && off < sizeof(buf); i++)
        off += (size_t)snprintf(buf + off, sizeof(buf) - off, "%s%s", i ? ", " : "",
                                duet_checkpoint_unused_name(ck, i));
    DUET_LOG_WARN("%" PRId64 " checkpoint tensor(s) not used by the config: %s%s", n, buf,
                  n > WEIGHTS_UNUSED_SHOWN ? ", ..." : "");
}

duet_status_t duet_weights_bind(duet_checkpoint_t *ck, const duet_model_config_t *cfg,
                                duet_weights_t *w_p)
{
    if (ck == NULL || cfg == NULL || w_p == NULL)
        return duet_error_set(DUET_ERR_INVALID, "duet_weights_bind: NULL argument");
    if (cfg->num_layers < 1 || cfg->num_layers > DUET_MAX_LAYERS)
        return DUET_FAIL(DUET_ERR_INVALID, "duet_weights_bind: %" PRId64 " layers",
                         cfg->num_layers);

    duet_weights_t w;
    memset(&w, 0, sizeof(w));
    w.layers = calloc((size_t)cfg->num_layers, sizeof(*w.layers));
    if (w.layers == NULL)
        return DUET_FAIL(DUET_ERR_NOMEM, "duet_weights_bind: out of memory");
    size_t n_slab = (size_t)(cfg->n_moe_layers * 3 * cfg->n_experts);
    if (n_slab > 0) {
        w.expert_slab = calloc(n_slab, sizeof(*w.expert_slab));
        if (w.expert_slab == NULL) {
            free(w.layers);
            return DUET_FAIL(DUET_ERR_NOMEM, "duet_weights_bind: out of memory");
        }
    }
    duet_status_t st = bind_all(ck, cfg, &w);
    if (st != DUET_OK) {
        DUET_LOG_ERROR("%s", duet_error_last());
        duet_weights_free(&w);
        return st;
    }
    warn_unused(ck);
    *w_p = w;
    return DUET_OK;
}

void duet_weights_free(duet_weights_t *w)
{
    if (w == NULL)
        return;
    free(w->layers);
    free(w->expert_slab);
    w->layers = NULL;
    w->expert_slab = NULL;
}
