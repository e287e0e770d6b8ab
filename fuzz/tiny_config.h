/*
 * The smallest model config the loader takes (one KDA layer with a dense MLP, widths of 2-4):
 * fuzz_safetensors binds checkpoints against it and fuzz/make_seeds.c writes seed checkpoints for
 * it, so both read it from here.
 */
#ifndef DUET_FUZZ_TINY_CONFIG_H
#define DUET_FUZZ_TINY_CONFIG_H

#define FUZZ_TINY_CONFIG                                                                           \
    "{\"model_type\": \"kimi_linear\", \"vocab_size\": 4, \"hidden_size\": 4, "                    \
    "\"num_hidden_layers\": 1, \"num_attention_heads\": 1, \"num_key_value_heads\": 1, "           \
    "\"qk_nope_head_dim\": 2, \"qk_rope_head_dim\": 2, \"v_head_dim\": 2, \"kv_lora_rank\": 2, "   \
    "\"linear_num_heads\": 1, \"linear_head_dim\": 2, \"linear_conv_kernel_dim\": 2, "             \
    "\"intermediate_size\": 4, \"moe_intermediate_size\": 2, \"num_experts\": 2, "                 \
    "\"num_experts_per_token\": 1, \"first_k_dense_replace\": 1}"

#endif
