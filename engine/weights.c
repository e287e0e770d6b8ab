/*
 * weights.c: bind the checkpoint's tensors to the model's named weights (docs/model.md, "Weights
 * and shapes"), checking each shape against the config.
 *
 * Every tensor goes through duet_checkpoint_get_shaped, which both validates the shape and marks
 * the tensor used, so afterwards the checkpoint knows which tensors no layer asked for (an MTP
 * head, a stray optimizer buffer, a mislabelled layer): those are reported in one warning line
 * rather than silently ignored. The per-expert tensor arrays of all MoE layers are carved from
 * one allocation (expert_slab) so freeing is one call and the arrays sit together in memory.
 *
 * Names: Moonshot's published checkpoints are the reference spelling, but transformers 5.17
 * loads more (conversion_mapping.py, "kimi_linear"), and its own save_pretrained writes one of
 * them, so a checkpoint that transformers loads is one duet loads. Per layer, in Moonshot's
 * spelling first:
 *   self_attn.{f_a_proj.weight,f_b_proj.weight,dt_bias,A_log}   or self_attn.forget_gate.*
 *   self_attn.{q,k,v}_conv1d.weight (HK, 1, W) each             or self_attn.conv1d.weight
 *                                                                  (3HK, 1, W): q, k, v rows
 *   dense MLP: mlp.{gate,up,down}_proj.weight                   or block_sparse_moe.* (what
 *                                                                  save_pretrained writes)
 *   MoE: block_sparse_moe.{gate.*,shared_experts.*,experts.*}   or mlp.*
 *   experts: experts.E.w1 / w3 (I, D), experts.E.w2 (D, I)      or experts.gate_up_proj
 *            (E, 2I, D): per expert I rows of w1 then I of w3, and experts.down_proj (E, D, I)
 * Each alternative is chosen per weight as transformers does (its renamings apply tensor by
 * tensor), but a weight present under two spellings, or a fused tensor next to any of the
 * split tensors it replaces, is refused: which copy the author meant is unknowable. Fused
 * tensors are bound as views of their rows (experts and conv rows are contiguous), no copies.
 */
#include "engine/weights.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

#define WEIGHTS_UNUSED_SHOWN 5
#define WEIGHTS_NAME_CAP     256

#define TRY(expr) DUET_TRY(expr)

// clang-format off
#define DIMS(...) (int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (int64_t[]){__VA_ARGS__}
// clang-format on

typedef char wname_t[WEIGHTS_NAME_CAP];

static void name_fmt(wname_t out, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void name_fmt(wname_t out, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(out, WEIGHTS_NAME_CAP, fmt, ap);
    va_end(ap);
}

/* Both spellings of one weight present: refuse, naming both tensors and their files. */
static duet_status_t two_spellings(const duet_checkpoint_t *ck, const char *a, const char *b)
{
    return duet_error_set(DUET_ERR_FORMAT,
                          "%s: tensor %s and %s: tensor %s are two spellings of the same weight "
                          "(Moonshot's and transformers' names); a checkpoint must hold one",
                          duet_checkpoint_tensor_file(ck, a), a, duet_checkpoint_tensor_file(ck, b),
                          b);
}

/*
 * Which of the spellings names[0..n) the checkpoint holds: *which_p = its index, or -1 when
 * none. Two present → DUET_ERR_FORMAT naming both.
 */
static duet_status_t pick(const duet_checkpoint_t *ck, int n, wname_t *names, int *which_p)
{
    int which = -1;
    for (int i = 0; i < n; i++) {
        if (duet_checkpoint_tensor_file(ck, names[i]) == NULL)
            continue;
        if (which >= 0)
            return two_spellings(ck, names[which], names[i]);
        which = i;
    }
    *which_p = which;
    return DUET_OK;
}

/* Absent under every spelling: name the first (Moonshot's) and the others. */
static duet_status_t missing(const duet_checkpoint_t *ck, int n, wname_t *names)
{
    char alts[3 * WEIGHTS_NAME_CAP] = "";
    size_t off = 0;
    for (int i = 1; i < n && off < sizeof(alts); i++)
        off += (size_t)snprintf(alts + off, sizeof(alts) - off, "%s%s", i > 1 ? ", " : " (nor ",
                                names[i]);
    if (n > 1 && off < sizeof(alts))
        snprintf(alts + off, sizeof(alts) - off, ")");
    return duet_error_set(DUET_ERR_NOT_FOUND, "%s: tensor %s not found in the checkpoint%s",
                          duet_checkpoint_where(ck), names[0], alts);
}

/* Bind the one of names[0..n) the checkpoint holds, with shape dims[0..ndim). */
static duet_status_t bind_alt(duet_checkpoint_t *ck, duet_tensor_t *t, int ndim,
                              const int64_t *dims, int n, wname_t *names)
{
    int which;
    TRY(pick(ck, n, names, &which));
    if (which < 0)
        return missing(ck, n, names);
    return duet_checkpoint_get_shaped(ck, names[which], ndim, dims, t);
}

/* Bind tensor printf(fmt, ...), which has one spelling only. */
static duet_status_t bind(duet_checkpoint_t *ck, duet_tensor_t *t, int ndim, const int64_t *dims,
                          const char *fmt, ...) __attribute__((format(printf, 5, 6)));
static duet_status_t bind(duet_checkpoint_t *ck, duet_tensor_t *t, int ndim, const int64_t *dims,
                          const char *fmt, ...)
{
    wname_t name;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof(name), fmt, ap);
    va_end(ap);
    return duet_checkpoint_get_shaped(ck, name, ndim, dims, t);
}

/* Tensor `sub` of layer l's FFN, under prefix `first` (the layer kind's Moonshot spelling) or
 * the other one; also with the expert index when e >= 0. */
static void ffn_names(wname_t names[2], int l, const char *first, const char *second, int64_t e,
                      const char *sub)
{
    const char *pre[2] = {first, second};
    for (int i = 0; i < 2; i++) {
        if (e >= 0)
            name_fmt(names[i], "model.layers.%d.%sexperts.%" PRId64 ".%s", l, pre[i], e, sub);
        else
            name_fmt(names[i], "model.layers.%d.%s%s", l, pre[i], sub);
    }
}

/* The elements of contiguous tensor `whole` from elem0 on, as a view of shape dims. */
static duet_tensor_t rows_view(const duet_tensor_t *whole, int64_t elem0, int ndim,
                               const int64_t *dims)
{
    duet_tensor_t v = *whole;
    v.data = (char *)whole->data + (size_t)elem0 * duet_dtype_size(whole->dtype);
    v.ndim = ndim;
    for (int i = 0; i < DUET_TENSOR_MAX_DIMS; i++)
        v.shape[i] = i < ndim ? dims[i] : 0;
    return v;
}

/*
 * A fused tensor (one of fused[0..n_fused), its spellings) that stands for the split tensors
 * split[0..n_split) (every spelling of each): *fused_p = which fused spelling is present, or
 * -1 when the split ones are to be bound. A fused tensor next to any split one is refused,
 * naming both.
 */
static duet_status_t pick_fused(const duet_checkpoint_t *ck, int n_fused, wname_t *fused,
                                int n_split, wname_t *split, int *fused_p)
{
    int f;
    TRY(pick(ck, n_fused, fused, &f));
    if (f >= 0)
        for (int i = 0; i < n_split; i++)
            if (duet_checkpoint_tensor_file(ck, split[i]) != NULL)
                return two_spellings(ck, split[i], fused[f]);
    *fused_p = f;
    return DUET_OK;
}

static duet_status_t bind_kda(duet_checkpoint_t *ck, const duet_model_config_t *c, int l,
                              duet_kda_weights_t *w)
{
    const int64_t D = c->hidden_size, H = c->kda_heads, K = c->kda_head_dim, HK = H * K;
    const int64_t W = c->conv_kernel;
    const char *p = "model.layers.%d.self_attn.%s";
    TRY(bind(ck, &w->q_proj, DIMS(HK, D), p, l, "q_proj.weight"));
    TRY(bind(ck, &w->k_proj, DIMS(HK, D), p, l, "k_proj.weight"));
    TRY(bind(ck, &w->v_proj, DIMS(HK, D), p, l, "v_proj.weight"));

    /* short convolutions: split (Moonshot) or fused (transformers' conv1d) */
    static const char *const conv_sub[3] = {"q_conv1d.weight", "k_conv1d.weight",
                                            "v_conv1d.weight"};
    duet_tensor_t *conv[3] = {&w->q_conv, &w->k_conv, &w->v_conv};
    wname_t split[3], fused[1];
    for (int i = 0; i < 3; i++)
        name_fmt(split[i], p, l, conv_sub[i]);
    name_fmt(fused[0], p, l, "conv1d.weight");
    int f;
    TRY(pick_fused(ck, 1, fused, 3, split, &f));
    if (f >= 0) {
        duet_tensor_t all;
        TRY(duet_checkpoint_get_shaped(ck, fused[0], DIMS(3 * HK, 1, W), &all));
        for (int i = 0; i < 3; i++)
            *conv[i] = rows_view(&all, i * HK * W, DIMS(HK, 1, W));
    } else {
        for (int i = 0; i < 3; i++) {
            wname_t nm[2]; /* the fused name only tells a missing tensor's message */
            memcpy(nm[0], split[i], sizeof(nm[0]));
            memcpy(nm[1], fused[0], sizeof(nm[1]));
            TRY(bind_alt(ck, conv[i], DIMS(HK, 1, W), 2, nm));
        }
    }

    /* the forget gate: flat (Moonshot) or under forget_gate. (transformers' module) */
    const struct {
        duet_tensor_t *t;
        const char *sub;
        int ndim;
        int64_t dims[4];
    } fg[4] = {
        {&w->f_a_proj, "f_a_proj.weight", 2, {K, D}},
        {&w->f_b_proj, "f_b_proj.weight", 2, {HK, K}},
        {&w->dt_bias, "dt_bias", 1, {HK}},
        {&w->A_log, "A_log", 4, {1, 1, H, 1}},
    };
    for (int i = 0; i < 4; i++) {
        wname_t nm[2];
        name_fmt(nm[0], "model.layers.%d.self_attn.%s", l, fg[i].sub);
        name_fmt(nm[1], "model.layers.%d.self_attn.forget_gate.%s", l, fg[i].sub);
        TRY(bind_alt(ck, fg[i].t, fg[i].ndim, fg[i].dims, 2, nm));
    }
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

#define PRE_MLP "mlp."
#define PRE_MOE "block_sparse_moe."

/* gate/up/down of a dense MLP or of the shared experts: `sub` ends before "gate_proj", the
 * FFN prefix is `first` or `second`. */
static duet_status_t bind_mlp(duet_checkpoint_t *ck, int64_t D, int64_t I, int l, const char *first,
                              const char *second, const char *sub, duet_mlp_weights_t *w)
{
    wname_t nm[2];
    char s[64];
    snprintf(s, sizeof(s), "%sgate_proj.weight", sub);
    ffn_names(nm, l, first, second, -1, s);
    TRY(bind_alt(ck, &w->gate_proj, DIMS(I, D), 2, nm));
    snprintf(s, sizeof(s), "%sup_proj.weight", sub);
    ffn_names(nm, l, first, second, -1, s);
    TRY(bind_alt(ck, &w->up_proj, DIMS(I, D), 2, nm));
    snprintf(s, sizeof(s), "%sdown_proj.weight", sub);
    ffn_names(nm, l, first, second, -1, s);
    TRY(bind_alt(ck, &w->down_proj, DIMS(D, I), 2, nm));
    return DUET_OK;
}

/*
 * The routed experts' w1 + w3 (gate, up) or w2 (down): per-expert tensors `subs` (1 or 2 of
 * them, with the expert index, either FFN prefix), or transformers' fused `fused_sub` of shape
 * (E, n_subs * rows, cols), expert e's tensor j being rows [j * rows, (j + 1) * rows) of e.
 */
static duet_status_t bind_experts(duet_checkpoint_t *ck, const duet_model_config_t *c, int l,
                                  int n_subs, const char *const *subs, duet_tensor_t *const *out,
                                  int64_t rows, int64_t cols, const char *fused_sub)
{
    const int64_t E = c->n_experts;
    wname_t fused[2];
    ffn_names(fused, l, PRE_MOE, PRE_MLP, -1, fused_sub);
    int f;
    TRY(pick(ck, 2, fused, &f));
    for (int64_t e = 0; e < E; e++)
        for (int j = 0; j < n_subs; j++) {
            wname_t nm[3]; /* nm[2], the fused name, only tells a missing tensor's message */
            ffn_names(nm, l, PRE_MOE, PRE_MLP, e, subs[j]);
            if (f >= 0) {
                TRY(pick_fused(ck, 2, fused, 2, nm, &f));
                continue;
            }
            memcpy(nm[2], fused[0], sizeof(nm[2]));
            TRY(bind_alt(ck, &out[j][e], DIMS(rows, cols), 3, nm));
        }
    if (f < 0)
        return DUET_OK;
    duet_tensor_t all;
    TRY(duet_checkpoint_get_shaped(ck, fused[f], DIMS(E, n_subs * rows, cols), &all));
    for (int64_t e = 0; e < E; e++)
        for (int j = 0; j < n_subs; j++)
            out[j][e] = rows_view(&all, (e * n_subs + j) * rows * cols, DIMS(rows, cols));
    return DUET_OK;
}

static duet_status_t bind_moe(duet_checkpoint_t *ck, const duet_model_config_t *c, int l,
                              duet_moe_weights_t *w)
{
    const int64_t D = c->hidden_size, E = c->n_experts, I = c->moe_intermediate;
    wname_t nm[2];
    ffn_names(nm, l, PRE_MOE, PRE_MLP, -1, "gate.weight");
    TRY(bind_alt(ck, &w->gate, DIMS(E, D), 2, nm));
    ffn_names(nm, l, PRE_MOE, PRE_MLP, -1, "gate.e_score_correction_bias");
    TRY(bind_alt(ck, &w->gate_bias, DIMS(E), 2, nm));

    static const char *const gate_up[2] = {"w1.weight", "w3.weight"};
    static const char *const down[1] = {"w2.weight"};
    duet_tensor_t *const gu_out[2] = {w->w1, w->w3};
    duet_tensor_t *const d_out[1] = {w->w2};
    TRY(bind_experts(ck, c, l, 2, gate_up, gu_out, I, D, "experts.gate_up_proj"));
    TRY(bind_experts(ck, c, l, 1, down, d_out, D, I, "experts.down_proj"));
    if (c->n_shared_experts > 0)
        TRY(bind_mlp(ck, D, I * c->n_shared_experts, l, PRE_MOE, PRE_MLP, "shared_experts.",
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
            TRY(bind_mlp(ck, D, c->dense_intermediate, l, PRE_MLP, PRE_MOE, "", &lw->mlp));
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
    free(w->copies);
    w->layers = NULL;
    w->expert_slab = NULL;
    w->copies = NULL;
}
