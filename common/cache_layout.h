/*
 * cache_layout.h: the byte layout of the cache pools, spelled once (docs/architecture.md,
 * "Cache pools").
 *
 * Four parties address the pools: the pools themselves (engine/cache.c), the CPU mixers that read
 * and write them (kernels/cpu/kda.c, mla.c), the CUDA backend's staging mirrors
 * (engine/backend_cuda.c), and the transfer planner (transfer/plan.c), which maps one process's
 * layout onto another's. They all take their sizes and offsets from here, so the layout cannot
 * drift between them. It sits in common/ because neither transfer/ nor kernels/ includes an
 * engine header.
 *
 * Every function multiplies in 64 bits with overflow checks and returns false on overflow (and
 * for a conv kernel of 0), leaving *r untouched; so a layout that came from outside (a peer's
 * reservation) is checked with the same arithmetic that addresses local memory. Callers whose
 * layout was validated when the pool was made may ignore the result.
 *
 * MLA KV pool: pages of page_tokens tokens. A page holds every MLA layer of its tokens, each layer
 * one contiguous block, so one RMA put moves one layer of one page:
 *
 *   offset(page p, layer l, token slot s) = ((p * n_layers + l) * page_tokens + s) * token_bytes
 *   a token's row: [ c (kv_lora_rank values, after kv_a_layernorm) | k_r (qk_rope_head_dim) ]
 *
 * KDA state pool: one slot per running sequence, every KDA layer of it:
 *
 *   offset(slot i, layer l) = (i * n_layers + l) * layer_bytes
 *   layer block = [ S: [H][K][V] (V = K; row k of head h holds S_h[k, :]) |
 *                   conv windows: [3][H*K][W-1] (q, k, v; the last W-1 pre-conv inputs of each
 *                   channel, oldest first) ]
 *   layer_bytes = (H*K*K + 3*H*K*(W-1)) * elem_bytes
 *
 * KDA replay pool (speculative decoding, only with spec_rows > 0): per KDA state slot and KDA
 * layer, `rows` (= spec_rows) rows, one per row of the slot's last verify item, each holding what
 * folding that token into S and the conv windows needs:
 *
 *   offset(slot i, layer l, row r) = ((i * n_layers + l) * rows + r) * row_bytes
 *   a row = [ proj: [3][H*K] pre-conv q, k, v (what the conv windows keep) | k: [H*K] and
 *             v: [H*K] post-conv, normalised | g: [H*K] log decay | beta: [H] ]
 *   row_bytes = (6*H*K + H) * elem_bytes; field f starts f*H*K elements into the row
 *   (DUET_REPLAY_FIELD_*)
 *
 * It is transferred only with a running request that moves between generation workers: its
 * accepted rows not yet folded into the KDA pool (rows [0, n_replay) of each layer of its slot)
 * travel with its state (transfer/plan.h, DUET_XFER_SEG_REPLAY) and are folded in at the target
 * (duet_model_seq_set_received). A context worker's sequences never have such rows; suspend
 * folds them in first (duet_model_seq_commit).
 *
 * Header-only (pure arithmetic, inlined where offsets are taken per item and head).
 */
#ifndef DUET_COMMON_CACHE_LAYOUT_H
#define DUET_COMMON_CACHE_LAYOUT_H

#include <stdbool.h>
#include <stdint.h>

typedef struct {
    uint64_t page_tokens; /* tokens per page */
    uint64_t n_layers;    /* MLA layers per page */
    uint64_t token_bytes; /* one token's row in one layer: (kv_lora_rank + rope dim) * elem size */
} duet_kv_layout_t;

typedef struct {
    uint64_t n_layers;    /* KDA layers per slot */
    uint64_t heads;       /* H held in this pool (a tensor-parallel rank holds H / N) */
    uint64_t head_dim;    /* K = V */
    uint64_t conv_kernel; /* W (>= 1) */
    uint64_t elem_bytes;  /* bytes per state element: 4 (fp32) */
} duet_kda_layout_t;

typedef struct {
    uint64_t n_layers;   /* KDA layers per slot */
    uint64_t heads;      /* H */
    uint64_t head_dim;   /* K = V */
    uint64_t rows;       /* rows per (slot, layer): the most rows of one verify item */
    uint64_t elem_bytes; /* 4 (fp32) */
} duet_replay_layout_t;

/* Where each field of a replay row starts, in units of H*K elements. */
#define DUET_REPLAY_FIELD_PROJ 0u /* [3][H*K] */
#define DUET_REPLAY_FIELD_K    3u /* [H*K] */
#define DUET_REPLAY_FIELD_V    4u /* [H*K] */
#define DUET_REPLAY_FIELD_G    5u /* [H*K] */
#define DUET_REPLAY_FIELD_BETA 6u /* [H] */

static inline bool duet__layout_mul(uint64_t a, uint64_t b, uint64_t *r)
{
    return !__builtin_mul_overflow(a, b, r);
}

static inline bool duet__layout_add(uint64_t a, uint64_t b, uint64_t *r)
{
    return !__builtin_add_overflow(a, b, r);
}

/* Bytes of one (page, layer) block: page_tokens * token_bytes. */
static inline bool duet_kv_layout_block_bytes(const duet_kv_layout_t *l, uint64_t *r)
{
    uint64_t b;
    if (!duet__layout_mul(l->page_tokens, l->token_bytes, &b))
        return false;
    *r = b;
    return true;
}

/* Bytes of one page, all its layers: n_layers blocks. */
static inline bool duet_kv_layout_page_bytes(const duet_kv_layout_t *l, uint64_t *r)
{
    uint64_t b, p;
    if (!duet_kv_layout_block_bytes(l, &b) || !duet__layout_mul(b, l->n_layers, &p))
        return false;
    *r = p;
    return true;
}

/* Byte offset, from the pool's base, of token slot `slot` of (page, layer). */
static inline bool duet_kv_layout_offset(const duet_kv_layout_t *l, uint64_t page, uint64_t layer,
                                         uint64_t slot, uint64_t *r)
{
    uint64_t o;
    if (!duet__layout_mul(page, l->n_layers, &o) || !duet__layout_add(o, layer, &o) ||
        !duet__layout_mul(o, l->page_tokens, &o) || !duet__layout_add(o, slot, &o) ||
        !duet__layout_mul(o, l->token_bytes, &o))
        return false;
    *r = o;
    return true;
}

/* Bytes of the states S of n_heads consecutive heads: n_heads * K * K * elem. */
static inline bool duet_kda_layout_state_bytes(const duet_kda_layout_t *l, uint64_t n_heads,
                                               uint64_t *r)
{
    uint64_t b;
    if (!duet__layout_mul(n_heads, l->head_dim, &b) || !duet__layout_mul(b, l->head_dim, &b) ||
        !duet__layout_mul(b, l->elem_bytes, &b))
        return false;
    *r = b;
    return true;
}

/* Bytes of the conv windows of n_channels consecutive channels: n_channels * (W-1) * elem. */
static inline bool duet_kda_layout_conv_bytes(const duet_kda_layout_t *l, uint64_t n_channels,
                                              uint64_t *r)
{
    uint64_t b;
    if (l->conv_kernel == 0 || !duet__layout_mul(n_channels, l->conv_kernel - 1, &b) ||
        !duet__layout_mul(b, l->elem_bytes, &b))
        return false;
    *r = b;
    return true;
}

/* Bytes of one (slot, layer) block: S of every head, then the three conv windows. */
static inline bool duet_kda_layout_layer_bytes(const duet_kda_layout_t *l, uint64_t *r)
{
    uint64_t s, hk, c;
    if (!duet_kda_layout_state_bytes(l, l->heads, &s) ||
        !duet__layout_mul(l->heads, l->head_dim, &hk) || !duet__layout_mul(hk, 3, &hk) ||
        !duet_kda_layout_conv_bytes(l, hk, &c) || !duet__layout_add(s, c, &s))
        return false;
    *r = s;
    return true;
}

/* Bytes of one slot, all its layers. */
static inline bool duet_kda_layout_slot_bytes(const duet_kda_layout_t *l, uint64_t *r)
{
    uint64_t b;
    if (!duet_kda_layout_layer_bytes(l, &b) || !duet__layout_mul(b, l->n_layers, &b))
        return false;
    *r = b;
    return true;
}

/* Byte offset, from the pool's base, of head `head`'s S in (slot, layer). */
static inline bool duet_kda_layout_state_offset(const duet_kda_layout_t *l, uint64_t slot,
                                                uint64_t layer, uint64_t head, uint64_t *r)
{
    uint64_t lb, o, h;
    if (!duet_kda_layout_layer_bytes(l, &lb) || !duet__layout_mul(slot, l->n_layers, &o) ||
        !duet__layout_add(o, layer, &o) || !duet__layout_mul(o, lb, &o) ||
        !duet_kda_layout_state_bytes(l, head, &h) || !duet__layout_add(o, h, &o))
        return false;
    *r = o;
    return true;
}

/* Byte offset, from the pool's base, of channel `channel` (< H*K) of conv window `which`
 * (0 = q, 1 = k, 2 = v) in (slot, layer). */
static inline bool duet_kda_layout_conv_offset(const duet_kda_layout_t *l, uint64_t slot,
                                               uint64_t layer, uint64_t which, uint64_t channel,
                                               uint64_t *r)
{
    uint64_t o, ch, c;
    if (!duet_kda_layout_state_offset(l, slot, layer, l->heads, &o) ||
        !duet__layout_mul(l->heads, l->head_dim, &ch) || !duet__layout_mul(ch, which, &ch) ||
        !duet__layout_add(ch, channel, &ch) || !duet_kda_layout_conv_bytes(l, ch, &c) ||
        !duet__layout_add(o, c, &o))
        return false;
    *r = o;
    return true;
}

/* Bytes of one replay row: (6*H*K + H) * elem. */
static inline bool duet_replay_layout_row_bytes(const duet_replay_layout_t *l, uint64_t *r)
{
    uint64_t b;
    if (!duet__layout_mul(l->heads, l->head_dim, &b) || !duet__layout_mul(b, 6, &b) ||
        !duet__layout_add(b, l->heads, &b) || !duet__layout_mul(b, l->elem_bytes, &b))
        return false;
    *r = b;
    return true;
}

/* Bytes of one (slot, layer) block: rows * row_bytes. */
static inline bool duet_replay_layout_layer_bytes(const duet_replay_layout_t *l, uint64_t *r)
{
    uint64_t b;
    if (!duet_replay_layout_row_bytes(l, &b) || !duet__layout_mul(b, l->rows, &b))
        return false;
    *r = b;
    return true;
}

/* Bytes of one slot, all its layers. */
static inline bool duet_replay_layout_slot_bytes(const duet_replay_layout_t *l, uint64_t *r)
{
    uint64_t b;
    if (!duet_replay_layout_layer_bytes(l, &b) || !duet__layout_mul(b, l->n_layers, &b))
        return false;
    *r = b;
    return true;
}

/* Byte offset, from the pool's base, of row `row` of (slot, layer). */
static inline bool duet_replay_layout_row_offset(const duet_replay_layout_t *l, uint64_t slot,
                                                 uint64_t layer, uint64_t row, uint64_t *r)
{
    uint64_t rb, o;
    if (!duet_replay_layout_row_bytes(l, &rb) || !duet__layout_mul(slot, l->n_layers, &o) ||
        !duet__layout_add(o, layer, &o) || !duet__layout_mul(o, l->rows, &o) ||
        !duet__layout_add(o, row, &o) || !duet__layout_mul(o, rb, &o))
        return false;
    *r = o;
    return true;
}

/* Byte offset, inside a row, of field `field` (DUET_REPLAY_FIELD_*): field * H*K * elem. */
static inline bool duet_replay_layout_field_offset(const duet_replay_layout_t *l, uint64_t field,
                                                   uint64_t *r)
{
    uint64_t b;
    if (!duet__layout_mul(l->heads, l->head_dim, &b) || !duet__layout_mul(b, field, &b) ||
        !duet__layout_mul(b, l->elem_bytes, &b))
        return false;
    *r = b;
    return true;
}

#endif
