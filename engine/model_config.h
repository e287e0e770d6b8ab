/*
 * The model's hyper-parameters, parsed from a checkpoint's config.json.
 *
 * Two spellings exist and both load (docs/model.md, "Config spellings"): transformers'
 * (`layer_types`, `mlp_layer_types`, `linear_num_heads`, `linear_head_dim`,
 * `linear_conv_kernel_dim`, `n_group`, `num_experts_per_tok`, ...) and the hub's, as Moonshot ships
 * it (`linear_attn_config` with 1-based `kda_layers` / `full_attn_layers`, `head_dim`, `num_heads`,
 * `short_conv_kernel_size`; `first_k_dense_replace`, `moe_layer_freq`, `num_experts`,
 * `num_experts_per_token`, `num_shared_experts`, `num_expert_group`, `moe_renormalize`, ...).
 * Resolution follows transformers 5.17's KimiLinearConfig: explicit `layer_types` wins over
 * `linear_attn_config`, which wins over the default (full attention at every 4th layer counting
 * from 0, layer 0 excluded). Every field is validated (positive sizes, divisibility, layer lists in
 * range, no layer both KDA and MLA); features this engine does not implement are refused, never
 * ignored.
 */
#ifndef DUET_ENGINE_MODEL_CONFIG_H
#define DUET_ENGINE_MODEL_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define DUET_MAX_LAYERS 256

typedef enum {
    DUET_MIXER_KDA = 0, /* "linear_attention" */
    DUET_MIXER_MLA = 1, /* "full_attention" */
} duet_mixer_kind_t;

typedef enum {
    DUET_FFN_DENSE = 0, /* "dense": mlp.{gate,up,down}_proj */
    DUET_FFN_MOE = 1,   /* "sparse": block_sparse_moe.* */
} duet_ffn_kind_t;

typedef enum {
    DUET_ACT_SILU = 0,
    DUET_ACT_SITU = 1, /* hidden_act "situ": K3-style experts; see docs/model.md "FFN" */
} duet_act_kind_t;

typedef struct {
    char model_type[64]; /* "kimi_linear" */
    int64_t vocab_size;
    int64_t hidden_size; /* D */
    int64_t num_layers;
    float rms_norm_eps;
    int tie_word_embeddings; /* 0 for Kimi; 1 = lm_head shares embed_tokens */

    /* MLA (full attention), NoPE */
    int64_t mla_heads;        /* num_attention_heads, n */
    int64_t qk_nope_head_dim; /* dn */
    int64_t qk_rope_head_dim; /* dr (no rotary is applied; the name is historical) */
    int64_t v_head_dim;       /* dv */
    int64_t kv_lora_rank;     /* r */
    int64_t q_lora_rank;      /* 0 = q_proj, else q_a_proj/q_a_layernorm/q_b_proj */

    /* KDA (linear attention) */
    int64_t kda_heads;    /* H */
    int64_t kda_head_dim; /* K = V */
    int64_t conv_kernel;  /* W (4) */

    /* FFN */
    int64_t dense_intermediate; /* intermediate_size of the dense MLP layers */
    int64_t n_experts;          /* E */
    int64_t top_k;              /* experts per token */
    int64_t moe_intermediate;   /* I */
    int64_t n_shared_experts;   /* shared expert width = I * n_shared_experts */
    int64_t n_group;            /* num_expert_group (1 = no grouping) */
    int64_t topk_group;
    int moe_renormalize;
    float routed_scaling_factor;
    duet_act_kind_t act;
    float situ_beta;        /* SiTU gate beta */
    float situ_linear_beta; /* SiTU up beta */

    int32_t bos_token_id; /* -1 when absent */
    int32_t pad_token_id; /* -1 when absent */
    /* eos_token_id is not read here: the ids that end a generation (config.json's and
     * generation_config.json's, united) come from duet_tokenizer_stop_ids, their one reader */

    duet_mixer_kind_t mixer[DUET_MAX_LAYERS];
    duet_ffn_kind_t ffn[DUET_MAX_LAYERS];
    int64_t n_kda_layers;
    int64_t n_mla_layers;
    int64_t n_moe_layers;
} duet_model_config_t;

/*
 * Parse config.json text. `origin` names the file in error messages. On failure returns
 * DUET_ERR_FORMAT / DUET_ERR_RANGE / DUET_ERR_UNSUPPORTED with a detail (duet_error_last) that
 * names the file and the field. cfg_p is written only on success.
 * Required keys: vocab_size, hidden_size, num_hidden_layers; every other key defaults to
 * KimiLinearConfig's value (the 48B model's), except token ids, which default to -1 / none.
 * JSON null counts as absent.
 */
duet_status_t duet_model_config_parse(const char *json_text, size_t len, const char *origin,
                                      duet_model_config_t *cfg_p);

/* Read and parse DIR/config.json (refuses files over 16 MiB). */
duet_status_t duet_model_config_load(const char *dir, duet_model_config_t *cfg_p);

/* Keep only the first n layers (n <= 0 or n >= num_layers: all), with the layer counts
 * recomputed: benchmarks at a real model's dimensions but fewer layers. */
void duet_model_config_keep_layers(duet_model_config_t *cfg, int64_t n);

/* Total parameter count implied by the config (for logs and the 48B size check). */
int64_t duet_model_config_n_params(const duet_model_config_t *cfg);

/* One-line summary for logs: "27 layers (20 KDA, 7 MLA), D=2304, ...". */
void duet_model_config_describe(const duet_model_config_t *cfg, char *buf, size_t cap);

#endif
