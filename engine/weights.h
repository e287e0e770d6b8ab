/*
 * The model's weights as views into the mmapped checkpoint, named and shaped as Moonshot's
 * checkpoints name them (docs/model.md, "Weights and shapes"). Large matrices stay in their stored
 * dtype (F32/BF16/F16) and the kernels convert on the fly; nothing is copied here. Binding
 * validates every tensor's shape against the config, so a checkpoint that loads is a checkpoint the
 * forward pass can run.
 */
#ifndef DUET_ENGINE_WEIGHTS_H
#define DUET_ENGINE_WEIGHTS_H

#include "engine/checkpoint.h"
#include "engine/model_config.h"
#include "kernels/kernels.h"

typedef struct {
    duet_tensor_t q_proj;   /* (H*K, D) */
    duet_tensor_t k_proj;   /* (H*K, D) */
    duet_tensor_t v_proj;   /* (H*K, D) */
    duet_tensor_t q_conv;   /* (H*K, 1, W)  q_conv1d.weight */
    duet_tensor_t k_conv;   /* (H*K, 1, W) */
    duet_tensor_t v_conv;   /* (H*K, 1, W) */
    duet_tensor_t f_a_proj; /* (K, D) */
    duet_tensor_t f_b_proj; /* (H*K, K) */
    duet_tensor_t dt_bias;  /* (H*K) */
    duet_tensor_t A_log;    /* (1, 1, H, 1) */
    duet_tensor_t b_proj;   /* (H, D) */
    duet_tensor_t g_a_proj; /* (K, D) */
    duet_tensor_t g_b_proj; /* (H*K, K) */
    duet_tensor_t o_norm;   /* (K) */
    duet_tensor_t o_proj;   /* (D, H*K) */
} duet_kda_weights_t;

typedef struct {
    duet_tensor_t q_proj;             /* (n*(dn+dr), D); absent (data NULL) when q_lora_rank > 0 */
    duet_tensor_t q_a_proj;           /* (q_lora, D); only with q_lora_rank > 0 */
    duet_tensor_t q_a_layernorm;      /* (q_lora) */
    duet_tensor_t q_b_proj;           /* (n*(dn+dr), q_lora) */
    duet_tensor_t kv_a_proj_with_mqa; /* (r+dr, D) */
    duet_tensor_t kv_a_layernorm;     /* (r) */
    duet_tensor_t kv_b_proj;          /* (n*(dn+dv), r): per head dn rows W_UK then dv rows W_UV */
    duet_tensor_t o_proj;             /* (D, n*dv) */
} duet_mla_weights_t;

typedef struct {
    duet_tensor_t gate_proj; /* (I, D) */
    duet_tensor_t up_proj;   /* (I, D) */
    duet_tensor_t down_proj; /* (D, I) */
} duet_mlp_weights_t;

typedef struct {
    duet_tensor_t gate;        /* (E, D)  block_sparse_moe.gate.weight */
    duet_tensor_t gate_bias;   /* (E)     block_sparse_moe.gate.e_score_correction_bias */
    duet_tensor_t *w1;         /* [E] each (I, D) gate; array owned by duet_weights_t */
    duet_tensor_t *w2;         /* [E] each (D, I) down */
    duet_tensor_t *w3;         /* [E] each (I, D) up */
    duet_mlp_weights_t shared; /* (I*n_shared, D) ...; block_sparse_moe.shared_experts */
} duet_moe_weights_t;

typedef struct {
    duet_tensor_t input_layernorm;          /* (D) */
    duet_tensor_t post_attention_layernorm; /* (D) */
    duet_mixer_kind_t mixer;
    duet_kda_weights_t kda; /* valid when mixer == KDA */
    duet_mla_weights_t mla; /* valid when mixer == MLA */
    duet_ffn_kind_t ffn;
    duet_mlp_weights_t mlp; /* valid when ffn == DENSE */
    duet_moe_weights_t moe; /* valid when ffn == MOE */
} duet_layer_weights_t;

typedef struct {
    duet_tensor_t embed_tokens;   /* (V, D) */
    duet_tensor_t norm;           /* (D) */
    duet_tensor_t lm_head;        /* (V, D); = embed_tokens when tied */
    duet_layer_weights_t *layers; /* [num_layers], owned */
    duet_tensor_t *expert_slab;   /* owned storage behind every moe.w1/w2/w3 array */
    void *copies;                 /* owned: a group rank's column cuts (engine/shard.h) */
} duet_weights_t;

/*
 * Bind and validate every tensor the config requires. Missing tensor → DUET_ERR_NOT_FOUND, wrong
 * shape → DUET_ERR_FORMAT, each with a detail naming file and tensor. Tensors the config does
 * not use are logged as a warning (one line with the count and the first few names).
 * w_p is written only on success; release with duet_weights_free.
 */
duet_status_t duet_weights_bind(duet_checkpoint_t *ck, const duet_model_config_t *cfg,
                                duet_weights_t *w_p);
void duet_weights_free(duet_weights_t *w); /* accepts NULL and zeroed structs */

#endif
