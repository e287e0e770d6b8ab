/*
 * model_config.c: config.json → duet_model_config_t.
 *
 * transformers 5.17's KimiLinearConfig is the authority. Its quirks, reproduced here on purpose:
 *  - attribute_map aliases: the hub writes `num_expert_group`, `num_experts`,
 *    `num_experts_per_token`, `num_shared_experts`, `moe_renormalize`; transformers writes
 *    `n_group`, `num_local_experts`, `num_experts_per_tok`, `n_shared_experts`, `norm_topk_prob`.
 *    Both are accepted; when a file carries both spellings with different values we refuse it
 *    rather than guess which one the author meant.
 *  - KDA sizes come from `linear_attn_config.{head_dim,num_heads,short_conv_kernel_size}` when
 *    present, else from `linear_head_dim`, `linear_num_heads`, `linear_conv_kernel_dim`.
 *  - layer types: explicit `layer_types` > `linear_attn_config.{kda_layers,full_attn_layers}`
 *    (1-based) > default (full attention at every 4th layer from 0, layer 0 excluded).
 *    transformers silently falls back to the default when only one of the two lists is present;
 *    we refuse that, since such a file is certainly not what its author meant.
 *  - MLP types: explicit `mlp_layer_types` > `first_k_dense_replace` (default 1) combined with
 *    the hub's `moe_layer_freq` (default 1): sparse iff i >= first_k_dense_replace and
 *    i % moe_layer_freq == 0.
 *  - JSON null is treated as "absent" (the default applies), except `q_lora_rank: null`, which is
 *    its own default anyway (no low-rank query).
 *
 * Required keys: vocab_size, hidden_size, num_hidden_layers. Every other key has
 * KimiLinearConfig's default (the 48B model's values), which keeps tiny test configs short but
 * means a config must state the sizes that define its embedding and depth.
 *
 * Sizes are capped (see the DUET__CFG_MAX_* below) so that every product in
 * duet_model_config_n_params and in the loader's byte counts fits in int64 without checks.
 */
#include "engine/model_config.h"

#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/json.h"
#include "common/log.h"

#define CFG_MAX_VOCAB  ((int64_t)1 << 24) /* token ids are int32 */
#define CFG_MAX_DIM    ((int64_t)1 << 16) /* hidden size */
#define CFG_MAX_HEADS  ((int64_t)1 << 10)
#define CFG_MAX_HDIM   ((int64_t)1 << 12) /* any per-head or low-rank width */
#define CFG_MAX_INTER  ((int64_t)1 << 20) /* MLP widths */
#define CFG_MAX_EXPERT ((int64_t)1 << 12)
#define CFG_MAX_CONV   64
#define CFG_MAX_FILE   ((size_t)16 << 20)

typedef struct {
    const char *origin; /* file name for messages */
    const json_t *root;
} cfg_ctx_t;

/* The value of `key` in `obj`, NULL when absent or null. */
static const json_t *get_present(const json_t *obj, const char *key)
{
    const json_t *v = json_object_get(obj, key);
    if (v == NULL || json_is_null(v))
        return NULL;
    return v;
}

/*
 * Look `key` (and its alias, may be NULL) up in the root. Both present with different values
 * is a conflict. *v_p = the value or NULL, *name_p = the key it came from.
 */
static duet_status_t lookup_aliased(const cfg_ctx_t *c, const char *key, const char *alias,
                                    const json_t **v_p, const char **name_p)
{
    const json_t *a = get_present(c->root, key);
    const json_t *b = alias != NULL ? get_present(c->root, alias) : NULL;
    if (a != NULL && b != NULL && !json_equal((json_t *)a, (json_t *)b))
        return duet_error_set(DUET_ERR_FORMAT,
                              "%s: fields \"%s\" and \"%s\" are aliases but have different values",
                              c->origin, key, alias);
    *v_p = a != NULL ? a : b;
    *name_p = a != NULL ? key : alias;
    return DUET_OK;
}

static duet_status_t check_int(const cfg_ctx_t *c, const char *name, const json_t *v, int64_t min,
                               int64_t max, int64_t *out_p)
{
    if (!json_is_integer(v))
        return duet_error_set(DUET_ERR_FORMAT, "%s: field \"%s\": expected integer, got %s",
                              c->origin, name, duet_json_type_name(v));
    int64_t x = (int64_t)json_integer_value(v);
    if (x < min || x > max)
        return duet_error_set(DUET_ERR_RANGE,
                              "%s: field \"%s\": %" PRId64 " is outside [%" PRId64 ", %" PRId64 "]",
                              c->origin, name, x, min, max);
    *out_p = x;
    return DUET_OK;
}

/* Integer field with an optional alias; `required` = absent is an error, else `def`. */
static duet_status_t get_int(const cfg_ctx_t *c, const char *key, const char *alias, int required,
                             int64_t def, int64_t min, int64_t max, int64_t *out_p)
{
    const json_t *v;
    const char *name;
    duet_status_t st = lookup_aliased(c, key, alias, &v, &name);
    if (st != DUET_OK)
        return st;
    if (v == NULL) {
        if (required)
            return duet_error_set(DUET_ERR_FORMAT, "%s: required field \"%s\" is missing",
                                  c->origin, key);
        *out_p = def;
        return DUET_OK;
    }
    return check_int(c, name, v, min, max, out_p);
}

static duet_status_t check_real(const cfg_ctx_t *c, const char *name, const json_t *v, double min,
                                double max, float *out_p)
{
    if (!json_is_number(v))
        return duet_error_set(DUET_ERR_FORMAT, "%s: field \"%s\": expected number, got %s",
                              c->origin, name, duet_json_type_name(v));
    double x = json_number_value(v);
    if (!(x >= min && x <= max))
        return duet_error_set(DUET_ERR_RANGE, "%s: field \"%s\": %g is outside [%g, %g]", c->origin,
                              name, x, min, max);
    *out_p = (float)x;
    return DUET_OK;
}

static duet_status_t get_real(const cfg_ctx_t *c, const char *key, const char *alias, double def,
                              double min, double max, float *out_p)
{
    const json_t *v;
    const char *name;
    duet_status_t st = lookup_aliased(c, key, alias, &v, &name);
    if (st != DUET_OK)
        return st;
    if (v == NULL) {
        *out_p = (float)def;
        return DUET_OK;
    }
    return check_real(c, name, v, min, max, out_p);
}

static duet_status_t get_bool(const cfg_ctx_t *c, const char *key, const char *alias, int def,
                              int *out_p)
{
    const json_t *v;
    const char *name;
    duet_status_t st = lookup_aliased(c, key, alias, &v, &name);
    if (st != DUET_OK)
        return st;
    if (v == NULL) {
        *out_p = def;
        return DUET_OK;
    }
    if (!json_is_boolean(v))
        return duet_error_set(DUET_ERR_FORMAT, "%s: field \"%s\": expected boolean, got %s",
                              c->origin, name, duet_json_type_name(v));
    *out_p = json_is_true(v);
    return DUET_OK;
}

/* String field; *out_p = NULL when absent. */
static duet_status_t get_str(const cfg_ctx_t *c, const char *key, const char **out_p)
{
    const json_t *v = get_present(c->root, key);
    if (v == NULL) {
        *out_p = NULL;
        return DUET_OK;
    }
    if (!json_is_string(v))
        return duet_error_set(DUET_ERR_FORMAT, "%s: field \"%s\": expected string, got %s",
                              c->origin, key, duet_json_type_name(v));
    *out_p = json_string_value(v);
    return DUET_OK;
}

/* A token id: integer in [0, vocab) or absent/null (-1). */
static duet_status_t get_token(const cfg_ctx_t *c, const char *key, int64_t vocab, int32_t *out_p)
{
    int64_t x;
    duet_status_t st = get_int(c, key, NULL, 0, -1, 0, vocab - 1, &x);
    if (st != DUET_OK)
        return st;
    *out_p = (int32_t)x;
    return DUET_OK;
}

/* ---- layer types ---------------------------------------------------------------------------- */

static duet_status_t parse_layer_types(const cfg_ctx_t *c, const json_t *lac,
                                       duet_model_config_t *cfg)
{
    const int64_t L = cfg->num_layers;
    const json_t *lt = get_present(c->root, "layer_types");
    if (lt != NULL) {
        if (!json_is_array(lt))
            return duet_error_set(DUET_ERR_FORMAT,
                                  "%s: field \"layer_types\": expected array, got %s", c->origin,
                                  duet_json_type_name(lt));
        if ((int64_t)json_array_size(lt) != L)
            return duet_error_set(DUET_ERR_FORMAT,
                                  "%s: field \"layer_types\": %zu entries for %" PRId64 " layers",
                                  c->origin, json_array_size(lt), L);
        for (int64_t i = 0; i < L; i++) {
            const json_t *e = json_array_get(lt, (size_t)i);
            const char *s = json_is_string(e) ? json_string_value(e) : NULL;
            if (s != NULL && strcmp(s, "linear_attention") == 0)
                cfg->mixer[i] = DUET_MIXER_KDA;
            else if (s != NULL && strcmp(s, "full_attention") == 0)
                cfg->mixer[i] = DUET_MIXER_MLA;
            else
                return duet_error_set(DUET_ERR_FORMAT,
                                      "%s: field \"layer_types[%" PRId64
                                      "]\": expected \"linear_attention\" or \"full_attention\"",
                                      c->origin, i);
        }
        return DUET_OK;
    }

    const json_t *kda = lac != NULL ? get_present(lac, "kda_layers") : NULL;
    const json_t *full = lac != NULL ? get_present(lac, "full_attn_layers") : NULL;
    if (kda == NULL && full == NULL) {
        for (int64_t i = 0; i < L; i++)
            cfg->mixer[i] = (i != 0 && i % 4 == 0) ? DUET_MIXER_MLA : DUET_MIXER_KDA;
        return DUET_OK;
    }
    if (kda == NULL || full == NULL)
        return duet_error_set(DUET_ERR_FORMAT,
                              "%s: field \"linear_attn_config\": has \"%s\" but not \"%s\"",
                              c->origin, kda != NULL ? "kda_layers" : "full_attn_layers",
                              kda != NULL ? "full_attn_layers" : "kda_layers");

    int seen[DUET_MAX_LAYERS] = {0};
    const struct {
        const char *name;
        const json_t *list;
        duet_mixer_kind_t kind;
    } lists[2] = {{"full_attn_layers", full, DUET_MIXER_MLA}, {"kda_layers", kda, DUET_MIXER_KDA}};
    for (int l = 0; l < 2; l++) {
        if (!json_is_array(lists[l].list))
            return duet_error_set(DUET_ERR_FORMAT,
                                  "%s: field \"linear_attn_config.%s\": expected array, got %s",
                                  c->origin, lists[l].name, duet_json_type_name(lists[l].list));
        for (size_t j = 0; j < json_array_size(lists[l].list); j++) {
            const json_t *e = json_array_get(lists[l].list, j);
            char name[64];
            snprintf(name, sizeof(name), "linear_attn_config.%s[%zu]", lists[l].name, j);
            int64_t layer;
            duet_status_t st = check_int(c, name, e, 1, L, &layer); /* 1-based */
            if (st != DUET_OK)
                return st;
            if (seen[layer - 1])
                return duet_error_set(DUET_ERR_FORMAT,
                                      "%s: field \"%s\": layer %" PRId64
                                      " (1-based) is listed more than once",
                                      c->origin, name, layer);
            seen[layer - 1] = 1;
            cfg->mixer[layer - 1] = lists[l].kind;
        }
    }
    for (int64_t i = 0; i < L; i++)
        if (!seen[i])
            return duet_error_set(DUET_ERR_FORMAT,
                                  "%s: field \"linear_attn_config\": layer %" PRId64
                                  " (1-based) is in neither kda_layers nor full_attn_layers",
                                  c->origin, i + 1);
    return DUET_OK;
}

static duet_status_t parse_mlp_types(const cfg_ctx_t *c, duet_model_config_t *cfg)
{
    const int64_t L = cfg->num_layers;
    const json_t *mt = get_present(c->root, "mlp_layer_types");
    if (mt != NULL) {
        if (!json_is_array(mt))
            return duet_error_set(DUET_ERR_FORMAT,
                                  "%s: field \"mlp_layer_types\": expected array, got %s",
                                  c->origin, duet_json_type_name(mt));
        if ((int64_t)json_array_size(mt) != L)
            return duet_error_set(DUET_ERR_FORMAT,
                                  "%s: field \"mlp_layer_types\": %zu entries for %" PRId64
                                  " layers",
                                  c->origin, json_array_size(mt), L);
        for (int64_t i = 0; i < L; i++) {
            const json_t *e = json_array_get(mt, (size_t)i);
            const char *s = json_is_string(e) ? json_string_value(e) : NULL;
            if (s != NULL && strcmp(s, "dense") == 0)
                cfg->ffn[i] = DUET_FFN_DENSE;
            else if (s != NULL && strcmp(s, "sparse") == 0)
                cfg->ffn[i] = DUET_FFN_MOE;
            else
                return duet_error_set(DUET_ERR_FORMAT,
                                      "%s: field \"mlp_layer_types[%" PRId64
                                      "]\": expected \"dense\" or \"sparse\"",
                                      c->origin, i);
        }
        return DUET_OK;
    }
    int64_t first_dense, freq;
    duet_status_t st =
        get_int(c, "first_k_dense_replace", NULL, 0, 1, 0, (int64_t)1 << 30, &first_dense);
    if (st != DUET_OK)
        return st;
    st = get_int(c, "moe_layer_freq", NULL, 0, 1, 1, DUET_MAX_LAYERS, &freq);
    if (st != DUET_OK)
        return st;
    for (int64_t i = 0; i < L; i++)
        cfg->ffn[i] = (i >= first_dense && i % freq == 0) ? DUET_FFN_MOE : DUET_FFN_DENSE;
    return DUET_OK;
}

/* ---- the whole config ----------------------------------------------------------------------- */

/* n_kda_layers, n_mla_layers and n_moe_layers from the first num_layers entries of the plan. */
static void config_count_layers(duet_model_config_t *cfg)
{
    cfg->n_kda_layers = cfg->n_mla_layers = cfg->n_moe_layers = 0;
    for (int64_t i = 0; i < cfg->num_layers; i++) {
        if (cfg->mixer[i] == DUET_MIXER_KDA)
            cfg->n_kda_layers++;
        else
            cfg->n_mla_layers++;
        if (cfg->ffn[i] == DUET_FFN_MOE)
            cfg->n_moe_layers++;
    }
}

static duet_status_t parse_root(const cfg_ctx_t *c, duet_model_config_t *cfg)
{
    duet_status_t st;
    const char *s;

#define TRY(expr)                                                                                  \
    do {                                                                                           \
        st = (expr);                                                                               \
        if (st != DUET_OK)                                                                         \
            return st;                                                                             \
    } while (0)

    /* Identity and refusals first: a config we cannot run should say so before size errors. */
    TRY(get_str(c, "model_type", &s));
    if (s != NULL && strcmp(s, "kimi_linear") != 0)
        return duet_error_set(DUET_ERR_UNSUPPORTED,
                              "%s: field \"model_type\": \"%s\" is not supported (only "
                              "\"kimi_linear\")",
                              c->origin, s);
    snprintf(cfg->model_type, sizeof(cfg->model_type), "%s", "kimi_linear");

    int flag;
    TRY(get_bool(c, "mla_use_output_gate", NULL, 0, &flag));
    if (flag)
        return duet_error_set(DUET_ERR_UNSUPPORTED,
                              "%s: field \"mla_use_output_gate\": true is not supported (MLA "
                              "output gate is not implemented)",
                              c->origin);
    int64_t attn_res;
    TRY(get_int(c, "attn_res_block_size", NULL, 0, 0, INT64_MIN, INT64_MAX, &attn_res));
    if (attn_res > 0)
        return duet_error_set(DUET_ERR_UNSUPPORTED,
                              "%s: field \"attn_res_block_size\": %" PRId64
                              " is not supported (attention residual blocks are not implemented)",
                              c->origin, attn_res);
    TRY(get_str(c, "moe_router_activation_func", &s));
    if (s != NULL && strcmp(s, "sigmoid") != 0)
        return duet_error_set(DUET_ERR_UNSUPPORTED,
                              "%s: field \"moe_router_activation_func\": \"%s\" is not supported "
                              "(only \"sigmoid\")",
                              c->origin, s);

    /* Trunk. */
    TRY(get_int(c, "vocab_size", NULL, 1, 0, 1, CFG_MAX_VOCAB, &cfg->vocab_size));
    TRY(get_int(c, "hidden_size", NULL, 1, 0, 1, CFG_MAX_DIM, &cfg->hidden_size));
    TRY(get_int(c, "num_hidden_layers", NULL, 1, 0, 1, DUET_MAX_LAYERS, &cfg->num_layers));
    TRY(get_real(c, "rms_norm_eps", NULL, 1e-5, 0.0, 1.0, &cfg->rms_norm_eps));
    if (!(cfg->rms_norm_eps > 0.0f))
        return duet_error_set(DUET_ERR_RANGE, "%s: field \"rms_norm_eps\": must be positive",
                              c->origin);
    TRY(get_bool(c, "tie_word_embeddings", NULL, 0, &cfg->tie_word_embeddings));

    /* MLA. */
    TRY(get_int(c, "num_attention_heads", NULL, 0, 32, 1, CFG_MAX_HEADS, &cfg->mla_heads));
    int64_t kv_heads;
    TRY(get_int(c, "num_key_value_heads", NULL, 0, cfg->mla_heads, 1, CFG_MAX_HEADS, &kv_heads));
    if (kv_heads != cfg->mla_heads)
        return duet_error_set(DUET_ERR_UNSUPPORTED,
                              "%s: field \"num_key_value_heads\": %" PRId64
                              " differs from num_attention_heads %" PRId64
                              " (grouped MLA heads are not supported)",
                              c->origin, kv_heads, cfg->mla_heads);
    TRY(get_int(c, "qk_nope_head_dim", NULL, 0, 128, 1, CFG_MAX_HDIM, &cfg->qk_nope_head_dim));
    TRY(get_int(c, "qk_rope_head_dim", NULL, 0, 64, 0, CFG_MAX_HDIM, &cfg->qk_rope_head_dim));
    TRY(get_int(c, "v_head_dim", NULL, 0, 128, 1, CFG_MAX_HDIM, &cfg->v_head_dim));
    TRY(get_int(c, "kv_lora_rank", NULL, 0, 512, 1, CFG_MAX_HDIM, &cfg->kv_lora_rank));
    TRY(get_int(c, "q_lora_rank", NULL, 0, 0, 0, CFG_MAX_HDIM, &cfg->q_lora_rank));

    /* KDA: linear_attn_config wins over the flat transformers keys (as in KimiLinearConfig). */
    const json_t *lac = get_present(c->root, "linear_attn_config");
    if (lac != NULL && !json_is_object(lac))
        return duet_error_set(DUET_ERR_FORMAT,
                              "%s: field \"linear_attn_config\": expected object, got %s",
                              c->origin, duet_json_type_name(lac));
    TRY(get_int(c, "linear_num_heads", NULL, 0, 32, 1, CFG_MAX_HEADS, &cfg->kda_heads));
    TRY(get_int(c, "linear_head_dim", NULL, 0, 128, 1, CFG_MAX_HDIM, &cfg->kda_head_dim));
    TRY(get_int(c, "linear_conv_kernel_dim", NULL, 0, 4, 1, CFG_MAX_CONV, &cfg->conv_kernel));
    if (lac != NULL) {
        const cfg_ctx_t sub = {c->origin, lac};
        const struct {
            const char *key, *full;
            int64_t max;
            int64_t *dst;
        } kf[3] = {
            {"num_heads", "linear_attn_config.num_heads", CFG_MAX_HEADS, &cfg->kda_heads},
            {"head_dim", "linear_attn_config.head_dim", CFG_MAX_HDIM, &cfg->kda_head_dim},
            {"short_conv_kernel_size", "linear_attn_config.short_conv_kernel_size", CFG_MAX_CONV,
             &cfg->conv_kernel},
        };
        for (int i = 0; i < 3; i++) {
            const json_t *v = get_present(lac, kf[i].key);
            if (v != NULL)
                TRY(check_int(&sub, kf[i].full, v, 1, kf[i].max, kf[i].dst));
        }
    }

    /* FFN / MoE. */
    TRY(get_int(c, "intermediate_size", NULL, 0, 9216, 1, CFG_MAX_INTER, &cfg->dense_intermediate));
    TRY(get_int(c, "moe_intermediate_size", NULL, 0, 1024, 1, CFG_MAX_INTER,
                &cfg->moe_intermediate));
    TRY(get_int(c, "num_local_experts", "num_experts", 0, 256, 1, CFG_MAX_EXPERT, &cfg->n_experts));
    TRY(get_int(c, "num_experts_per_tok", "num_experts_per_token", 0, 8, 1, CFG_MAX_EXPERT,
                &cfg->top_k));
    TRY(get_int(c, "n_shared_experts", "num_shared_experts", 0, 1, 0, 64, &cfg->n_shared_experts));
    TRY(get_int(c, "n_group", "num_expert_group", 0, 1, 1, CFG_MAX_EXPERT, &cfg->n_group));
    TRY(get_int(c, "topk_group", NULL, 0, 1, 1, CFG_MAX_EXPERT, &cfg->topk_group));
    TRY(get_bool(c, "norm_topk_prob", "moe_renormalize", 1, &cfg->moe_renormalize));
    TRY(get_real(c, "routed_scaling_factor", NULL, 2.446, 0.0, 1e6, &cfg->routed_scaling_factor));

    TRY(get_str(c, "hidden_act", &s));
    if (s == NULL || strcmp(s, "silu") == 0) {
        cfg->act = DUET_ACT_SILU;
    } else if (strcmp(s, "situ") == 0) {
        cfg->act = DUET_ACT_SITU;
    } else {
        return duet_error_set(DUET_ERR_UNSUPPORTED,
                              "%s: field \"hidden_act\": \"%s\" is not supported (\"silu\" or "
                              "\"situ\")",
                              c->origin, s);
    }
    TRY(get_real(c, "situ_beta", "activation_situ_beta", 1.0, 1e-6, 1e6, &cfg->situ_beta));
    TRY(get_real(c, "situ_linear_beta", "activation_situ_linear_beta", 1.0, 1e-6, 1e6,
                 &cfg->situ_linear_beta));

    /* Tokens. */
    TRY(get_token(c, "bos_token_id", cfg->vocab_size, &cfg->bos_token_id));
    TRY(get_token(c, "pad_token_id", cfg->vocab_size, &cfg->pad_token_id));

    /* Layer plan. */
    TRY(parse_layer_types(c, lac, cfg));
    TRY(parse_mlp_types(c, cfg));
#undef TRY

    config_count_layers(cfg);

    /* Cross-field checks (only when MoE layers exist do expert counts matter). */
    if (cfg->n_experts % cfg->n_group != 0)
        return duet_error_set(DUET_ERR_RANGE,
                              "%s: field \"n_group\": %" PRId64
                              " does not divide the number of experts %" PRId64,
                              c->origin, cfg->n_group, cfg->n_experts);
    if (cfg->topk_group > cfg->n_group)
        return duet_error_set(DUET_ERR_RANGE,
                              "%s: field \"topk_group\": %" PRId64 " exceeds n_group %" PRId64,
                              c->origin, cfg->topk_group, cfg->n_group);
    if (cfg->top_k > cfg->n_experts)
        return duet_error_set(DUET_ERR_RANGE,
                              "%s: field \"num_experts_per_tok\": %" PRId64
                              " exceeds the number of experts %" PRId64,
                              c->origin, cfg->top_k, cfg->n_experts);
    int64_t kept = cfg->n_experts / cfg->n_group * cfg->topk_group;
    if (cfg->top_k > kept)
        return duet_error_set(DUET_ERR_RANGE,
                              "%s: field \"num_experts_per_tok\": %" PRId64 " exceeds the %" PRId64
                              " experts in the %" PRId64 " kept groups",
                              c->origin, cfg->top_k, kept, cfg->topk_group);
    return DUET_OK;
}

void duet_model_config_keep_layers(duet_model_config_t *cfg, int64_t n)
{
    if (n <= 0 || n >= cfg->num_layers)
        return;
    cfg->num_layers = n;
    config_count_layers(cfg);
}

duet_status_t duet_model_config_parse(const char *json_text, size_t len, const char *origin,
                                      duet_model_config_t *cfg_p)
{
    if (json_text == NULL || cfg_p == NULL)
        return duet_error_set(DUET_ERR_INVALID, "duet_model_config_parse: NULL argument");
    if (origin == NULL)
        origin = "config.json";

    json_error_t jerr;
    json_t *root = json_loadb(json_text, len, JSON_REJECT_DUPLICATES, &jerr);
    if (root == NULL)
        return DUET_FAIL(DUET_ERR_FORMAT, "%s:%d:%d: invalid JSON: %s", origin, jerr.line,
                         jerr.column, jerr.text);
    if (!json_is_object(root)) {
        json_decref(root);
        return DUET_FAIL(DUET_ERR_FORMAT, "%s: top level must be a JSON object", origin);
    }

    duet_model_config_t *cfg = calloc(1, sizeof(*cfg));
    if (cfg == NULL) {
        json_decref(root);
        return DUET_FAIL(DUET_ERR_NOMEM, "%s: out of memory", origin);
    }
    const cfg_ctx_t c = {origin, root};
    duet_status_t st = parse_root(&c, cfg);
    json_decref(root);
    if (st != DUET_OK) {
        DUET_LOG_ERROR("%s", duet_error_last());
        free(cfg);
        return st;
    }
    *cfg_p = *cfg;
    free(cfg);
    return DUET_OK;
}

duet_status_t duet_model_config_load(const char *dir, duet_model_config_t *cfg_p)
{
    char path[4096];
    int n = snprintf(path, sizeof(path), "%s/config.json", dir);
    if (n < 0 || (size_t)n >= sizeof(path))
        return DUET_FAIL(DUET_ERR_INVALID, "%s: path too long", dir);

    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return DUET_FAIL(errno == ENOENT ? DUET_ERR_NOT_FOUND : DUET_ERR_IO, "%s: %s", path,
                         strerror(errno));
    struct stat sb;
    if (fstat(fileno(f), &sb) != 0) {
        int e = errno;
        fclose(f);
        return DUET_FAIL(DUET_ERR_IO, "%s: %s", path, strerror(e));
    }
    if (sb.st_size < 0 || (uint64_t)sb.st_size > CFG_MAX_FILE) {
        fclose(f);
        return DUET_FAIL(DUET_ERR_RANGE, "%s: %lld bytes, over the 16 MiB cap for config.json",
                         path, (long long)sb.st_size);
    }
    size_t size = (size_t)sb.st_size;
    char *buf = malloc(size + 1);
    if (buf == NULL) {
        fclose(f);
        return DUET_FAIL(DUET_ERR_NOMEM, "%s: out of memory", path);
    }
    size_t got = fread(buf, 1, size, f);
    int bad = ferror(f);
    fclose(f);
    if (got != size || bad) {
        free(buf);
        return DUET_FAIL(DUET_ERR_IO, "%s: short read (%zu of %zu bytes)", path, got, size);
    }
    buf[size] = '\0';
    duet_status_t st = duet_model_config_parse(buf, size, path, cfg_p);
    free(buf);
    return st;
}

/* ---- sizes ---------------------------------------------------------------------------------- */

int64_t duet_model_config_n_params(const duet_model_config_t *cfg)
{
    const int64_t D = cfg->hidden_size, V = cfg->vocab_size;
    const int64_t H = cfg->kda_heads, K = cfg->kda_head_dim, HK = H * K, W = cfg->conv_kernel;
    const int64_t n = cfg->mla_heads, dn = cfg->qk_nope_head_dim, dr = cfg->qk_rope_head_dim;
    const int64_t dv = cfg->v_head_dim, r = cfg->kv_lora_rank, ql = cfg->q_lora_rank;
    const int64_t E = cfg->n_experts, I = cfg->moe_intermediate;
    const int64_t Is = I * cfg->n_shared_experts;

    const int64_t kda = 3 * HK * D /* q,k,v */ + 3 * HK * W /* convs */ + K * D + HK * K /* f */ +
                        HK /* dt_bias */ + H /* A_log */ + H * D /* b */ + K * D + HK * K /* g */ +
                        K /* o_norm */ + D * HK /* o */;
    const int64_t q = ql > 0 ? ql * D + ql + n * (dn + dr) * ql : n * (dn + dr) * D;
    const int64_t mla = q + (r + dr) * D + r + n * (dn + dv) * r + D * n * dv;
    const int64_t dense = 3 * D * cfg->dense_intermediate;
    const int64_t moe = E * D + E + E * 3 * I * D + 3 * Is * D;

    int64_t total = V * D /* embed */ + D /* final norm */ + (cfg->tie_word_embeddings ? 0 : V * D);
    for (int64_t i = 0; i < cfg->num_layers; i++) {
        total += 2 * D;
        total += cfg->mixer[i] == DUET_MIXER_KDA ? kda : mla;
        total += cfg->ffn[i] == DUET_FFN_MOE ? moe : dense;
    }
    return total;
}

void duet_model_config_describe(const duet_model_config_t *cfg, char *buf, size_t cap)
{
    if (buf == NULL || cap == 0)
        return;
    char q[48];
    if (cfg->q_lora_rank > 0)
        snprintf(q, sizeof(q), " q_lora=%" PRId64, cfg->q_lora_rank);
    else
        q[0] = '\0';
    snprintf(buf, cap,
             "%" PRId64 " layers (%" PRId64 " KDA, %" PRId64 " MLA; %" PRId64 " MoE), D=%" PRId64
             ", vocab=%" PRId64 ", KDA H=%" PRId64 " K=%" PRId64 " W=%" PRId64 ", MLA n=%" PRId64
             " dn=%" PRId64 " dr=%" PRId64 " dv=%" PRId64 " r=%" PRId64 "%s, MoE E=%" PRId64
             " top-%" PRId64 " I=%" PRId64 " shared=%" PRId64 " groups=%" PRId64 "/%" PRId64
             ", dense I=%" PRId64 ", act=%s, %.2f B params",
             cfg->num_layers, cfg->n_kda_layers, cfg->n_mla_layers, cfg->n_moe_layers,
             cfg->hidden_size, cfg->vocab_size, cfg->kda_heads, cfg->kda_head_dim, cfg->conv_kernel,
             cfg->mla_heads, cfg->qk_nope_head_dim, cfg->qk_rope_head_dim, cfg->v_head_dim,
             cfg->kv_lora_rank, q, cfg->n_experts, cfg->top_k, cfg->moe_intermediate,
             cfg->n_shared_experts, cfg->topk_group, cfg->n_group, cfg->dense_intermediate,
             cfg->act == DUET_ACT_SITU ? "situ" : "silu",
             (double)duet_model_config_n_params(cfg) / 1e9);
}
