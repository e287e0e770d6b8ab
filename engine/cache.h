/*
 * Cache pools (docs/architecture.md, "Cache pools"). Every pool is allocated once at start-up
 * (the KV and KDA pools later registered with UCX once) and handed out per request; nothing is
 * allocated on the hot path.
 *
 * The byte layout of both pools (which MLA layer of which page, where S and the conv windows of a
 * KDA slot sit) is defined once, in common/cache_layout.h; duet_kv_pool_layout /
 * duet_kda_pool_layout give a pool's numbers for it. KV elements are of the descriptor's dtype
 * (F32 on the CPU), the KDA state is fp32. The conv windows hold the last W-1 *pre-conv*
 * projections of each channel (zeros at sequence start), which is exactly what the causal
 * depthwise conv needs to continue the sequence.
 */
#ifndef DUET_ENGINE_CACHE_H
#define DUET_ENGINE_CACHE_H

#include <stddef.h>
#include <stdint.h>

#include "common/cache_layout.h"
#include "common/status.h"
#include "kernels/kernels.h"

typedef struct {
    int64_t page_tokens; /* tokens per page (default 128) */
    int64_t n_pages;
    int64_t n_layers;   /* MLA layers */
    int64_t token_dim;  /* kv_lora_rank + qk_rope_head_dim */
    duet_dtype_t dtype; /* F32 on the CPU */
    void *mem;          /* NULL = the pool allocates; else caller memory of at least
                           duet_kv_pool_bytes_needed() bytes, zeroed, 64-byte aligned,
                           not owned (e.g. a UCX-allocated segment that receives puts) */
} duet_kv_pool_desc_t;

typedef struct duet_kv_pool duet_kv_pool_t;

duet_status_t duet_kv_pool_create(const duet_kv_pool_desc_t *desc, duet_kv_pool_t **pool_p);
/* Bytes of the pool's one allocation for desc (what desc->mem must hold). */
size_t duet_kv_pool_bytes_needed(const duet_kv_pool_desc_t *desc);
void duet_kv_pool_destroy(duet_kv_pool_t *pool); /* accepts NULL */
const duet_kv_pool_desc_t *duet_kv_pool_desc(const duet_kv_pool_t *pool);

/* Take n pages (all or nothing). DUET_ERR_NO_SPACE when fewer than n are free. */
duet_status_t duet_kv_pool_alloc(duet_kv_pool_t *pool, int64_t n, int32_t *pages_out);
/* Give up one hold on each page (it returns to the pool with its last holder); a page id out of
 * range or already free is an invariant violation (asserts). */
void duet_kv_pool_free(duet_kv_pool_t *pool, const int32_t *pages, int64_t n);
int64_t duet_kv_pool_n_free(const duet_kv_pool_t *pool);
/* One more holder of each of pages[0..n) (each allocated): a page goes back to the pool when
 * every holder has freed it (the prefix cache shares a prompt's pages with later requests). */
void duet_kv_pool_ref(duet_kv_pool_t *pool, const int32_t *pages, int64_t n);
/* Holders of a page: 0 when it is free. */
int32_t duet_kv_pool_holders(const duet_kv_pool_t *pool, int32_t page);
/* Base of the pool's one allocation and its size (for registration with a transport). */
void *duet_kv_pool_base(const duet_kv_pool_t *pool);
size_t duet_kv_pool_bytes(const duet_kv_pool_t *pool);
/* Bytes of one (page, layer) block = page_tokens * token_dim * elem size. */
size_t duet_kv_pool_block_bytes(const duet_kv_pool_t *pool);
/* Pointer to token slot 0 of (page, layer). */
void *duet_kv_pool_block(const duet_kv_pool_t *pool, int32_t page, int64_t layer);
/* The pool's layout (common/cache_layout.h). */
duet_kv_layout_t duet_kv_pool_layout(const duet_kv_pool_t *pool);
/* The layout a pool made from desc has, without making it (the cache plan sizes pools from it). */
duet_kv_layout_t duet_kv_pool_desc_layout(const duet_kv_pool_desc_t *desc);
/* Zero every layer of pages[0..n) (a fresh sequence's pages, so a cache dump is deterministic). */
void duet_kv_pool_zero_pages(duet_kv_pool_t *pool, const int32_t *pages, int64_t n);

typedef struct {
    int64_t n_slots;
    int64_t n_layers;    /* KDA layers */
    int64_t heads;       /* H */
    int64_t head_dim;    /* K = V */
    int64_t conv_kernel; /* W */
    void *mem;           /* as duet_kv_pool_desc_t.mem, duet_kda_pool_bytes_needed() bytes */
} duet_kda_pool_desc_t;

typedef struct duet_kda_pool duet_kda_pool_t;

duet_status_t duet_kda_pool_create(const duet_kda_pool_desc_t *desc, duet_kda_pool_t **pool_p);
size_t duet_kda_pool_bytes_needed(const duet_kda_pool_desc_t *desc);
void duet_kda_pool_destroy(duet_kda_pool_t *pool); /* accepts NULL */
const duet_kda_pool_desc_t *duet_kda_pool_desc(const duet_kda_pool_t *pool);
/* Take a slot, zeroed (state of an empty sequence). DUET_ERR_NO_SPACE when none is free. */
duet_status_t duet_kda_pool_alloc(duet_kda_pool_t *pool, int32_t *slot_p);
void duet_kda_pool_free(duet_kda_pool_t *pool, int32_t slot);
int64_t duet_kda_pool_n_free(const duet_kda_pool_t *pool);
void *duet_kda_pool_base(const duet_kda_pool_t *pool);
size_t duet_kda_pool_bytes(const duet_kda_pool_t *pool);
size_t duet_kda_pool_layer_bytes(const duet_kda_pool_t *pool);
/* Bytes of one slot: every KDA layer's block, contiguous from duet_kda_pool_state(slot, 0). */
size_t duet_kda_pool_slot_bytes(const duet_kda_pool_t *pool);
/* S of (slot, KDA layer): fp32 [H][K][V]; the conv windows follow at + H*K*V floats. */
float *duet_kda_pool_state(const duet_kda_pool_t *pool, int32_t slot, int64_t layer);
float *duet_kda_pool_conv(const duet_kda_pool_t *pool, int32_t slot, int64_t layer);
/* The pool's layout (common/cache_layout.h). */
duet_kda_layout_t duet_kda_pool_layout(const duet_kda_pool_t *pool);
/* The layout a pool made from desc has, without making it. */
duet_kda_layout_t duet_kda_pool_desc_layout(const duet_kda_pool_desc_t *desc);

/*
 * The KDA replay pool (speculative decoding): per KDA state slot and KDA layer, `rows` rows of
 * what folding one verified token into S and the conv windows needs (common/cache_layout.h).
 * Its blocks are addressed by the KDA slot of the sequence they belong to, so it hands out
 * nothing of its own. A running request moved between generation workers brings its pending
 * rows along (transfer/plan.h), so on a generation worker it is registered with UCX like the
 * other two.
 */
typedef struct {
    int64_t n_slots;  /* = the KDA pool's */
    int64_t n_layers; /* KDA layers */
    int64_t heads;    /* H */
    int64_t head_dim; /* K = V */
    int64_t rows;     /* rows per (slot, layer): spec_rows */
    void *mem;        /* as duet_kv_pool_desc_t.mem, duet_replay_pool_bytes_needed() bytes */
} duet_replay_pool_desc_t;

typedef struct duet_replay_pool duet_replay_pool_t;

/* DUET_ERR_INVALID for a bad or overflowing descriptor, DUET_ERR_NOMEM. */
duet_status_t duet_replay_pool_create(const duet_replay_pool_desc_t *desc,
                                      duet_replay_pool_t **pool_p);
/* Bytes of the pool for desc; SIZE_MAX when they overflow. */
size_t duet_replay_pool_bytes_needed(const duet_replay_pool_desc_t *desc);
void duet_replay_pool_destroy(duet_replay_pool_t *pool); /* accepts NULL */
const duet_replay_pool_desc_t *duet_replay_pool_desc(const duet_replay_pool_t *pool);
void *duet_replay_pool_base(const duet_replay_pool_t *pool);
size_t duet_replay_pool_bytes(const duet_replay_pool_t *pool);
/* Row `row` of (slot, KDA layer): fp32 [6*H*K + H], fields at DUET_REPLAY_FIELD_* * H*K. */
float *duet_replay_pool_row(const duet_replay_pool_t *pool, int32_t slot, int64_t layer,
                            int64_t row);
/* The pool's layout (common/cache_layout.h). */
duet_replay_layout_t duet_replay_pool_layout(const duet_replay_pool_t *pool);
/* The layout a pool made from desc has, without making it. */
duet_replay_layout_t duet_replay_pool_desc_layout(const duet_replay_pool_desc_t *desc);

#endif
