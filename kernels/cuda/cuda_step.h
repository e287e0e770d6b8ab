/*
 * cuda_step.h: what the CUDA kernels of one engine step know about the batch (device arrays).
 *
 * One step stacks the new tokens of n_items sequences into n_rows rows (item i owns rows
 * [item_row0[i], item_row0[i+1])). Every array below is in device memory and is rewritten before
 * each step at a fixed address, so a step captured as a CUDA graph reads the current batch; the
 * two counts are host values fixed for a captured graph (a batch bucket). Padding items of a
 * bucket point at a spare sequence (its own KDA slot and KV page) and are computed like any
 * other, so kernels need no special case for them.
 *
 * Cache addressing (common/cache_layout.h defines the layouts; all pointers device pointers):
 *   KV block of (page p, MLA layer l) = kv_base + ((p * kv_n_layers + l) * page_tokens) * td
 *     elements of kv_dtype, td = kv_lora_rank + qk_rope_head_dim; a token's row = [c | k_r].
 *   KDA layer block of (slot s, KDA layer l) = kda_base + (s * kda_n_layers + l) * kda_layer_floats
 *     floats = [ S: [H][K][V] fp32 | conv windows: [3][H*K][W-1] fp32, oldest input first ].
 */
#ifndef DUET_KERNELS_CUDA_STEP_H
#define DUET_KERNELS_CUDA_STEP_H

#include <stdint.h>

typedef struct {
    int32_t n_items;           /* host value */
    int32_t n_rows;            /* host value: sum of the items' new tokens */
    int32_t max_item_tokens;   /* host value: >= every item's new tokens, verify items aside
                                  (1 = decode and verify items only) */
    int32_t max_split_rows;    /* host value: MLA split-KV splits items of at most this many
                                  new tokens (and at most DUET_SPLITKV_MAX_ROWS), and sizes its
                                  partials by it: 1 = decode items, 0 = none */
    const int32_t *item_row0;  /* [n_items + 1] first row of each item; item_row0[n] = n_rows */
    const int32_t *item_pos0;  /* [n_items] tokens in the item's caches before this step */
    const int32_t *item_slot;  /* [n_items] KDA state slot */
    const int32_t *item_pages; /* [n_items][max_pages]: the item's KV page ids, in order */
    int32_t max_pages;         /* host value: row stride of item_pages */
    const int32_t *row_item;   /* [n_rows] item of each row */
    const int32_t *row_pos;    /* [n_rows] position of the row's token in its sequence */
    /* Speculative decoding (both NULL without a replay pool): */
    const int32_t *item_verify; /* [n_items] nonzero: a verify item (cuda_kda.h "Verify items") */
    const int32_t *item_replay; /* [n_items] accepted rows to fold into the item's state first */
    int32_t any_verify;         /* host value: some item of the step is a verify item */
    int32_t all_verify;         /* host value: every item is one (no recurrent core to run) */
} duet_cuda_step_t;

#endif
