/*
 * Transfer plans: which bytes of the sender's pools go where in the receiver's reserved pools.
 *
 * A pure function of two layouts and two page lists; it knows pages, layers and byte ranges, not
 * models (docs/architecture.md, "Cache pools"). The cache layouts it maps are the engine's pools',
 * defined once in common/cache_layout.h (KV: one block per (page, MLA layer); KDA: one block per
 * (slot, KDA layer), S of every head then the q, k, v conv windows); a duet_xfer_layout_t is their
 * numbers as a reservation carries them.
 *
 * The two sides may use different page sizes (e.g. 64-token context pages into 128-token
 * generation pages); the last page of either side may be partial. A destination may be a Helix
 * group of N = cp * tp ranks (rank r = c * tp + t; engine/shard.h), each with its own
 * reservation. MLA KV pages are dealt round-robin by the *destination* page index over the
 * kv_ranks = cp KV shards: global dest page j belongs to shard c = j % kv_ranks and is sent to
 * every one of the N / kv_ranks ranks of that c, as each one's local page j / kv_ranks (kv_ranks
 * = N: every rank its own pages; kv_ranks = 1: every rank all of them). The KDA state is sharded
 * by heads over all N ranks (rank i holds heads [i*H/N, (i+1)*H/N) of S and the matching
 * channels of each of the q, k, v conv windows, laid out on the rank exactly as a pool with H/N
 * heads).
 *
 * A running request that moves between generation workers (src.n_replay > 0) also carries the
 * accepted speculative rows not yet folded into its KDA state: rows [0, n_replay) of each KDA
 * layer of its slot in the KDA replay pool (common/cache_layout.h), one DUET_XFER_SEG_REPLAY
 * entry per KDA layer, into the same rows of the destination slot. Only into one rank (a move
 * into a Helix group is not built); the two sides' replay pools may hold different numbers of
 * rows per (slot, layer), n_replay must fit both. A context worker's transfer has n_replay 0.
 *
 * Entries are grouped by layer in order (all MLA layer 0 entries, then layer 1, ...; then the
 * KDA entries, each KDA layer's group its state, conv windows and replay rows), so the sender can
 * start layer L as soon as layer L is ready. Within a layer, adjacent byte ranges of one pool
 * that are contiguous on both sides are merged into one entry.
 */
#ifndef DUET_TRANSFER_PLAN_H
#define DUET_TRANSFER_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "common/cache_layout.h"
#include "common/status.h"

#define DUET_XFER_MAX_RANKS 64

/* kv_ranks as given, or group_size for 0 (the wire's and the arguments' "every rank its own
 * pages"). */
static inline uint32_t duet_xfer_kv_ranks_or(uint32_t kv_ranks, uint32_t group_size)
{
    return kv_ranks != 0 ? kv_ranks : group_size;
}

/* The KV shard (a Helix rank's c) that `rank` of a group of group_size ranks holds when the
 * pages are dealt over kv_ranks shards: rank / (group_size / kv_ranks). kv_ranks must be in
 * [1, group_size] and divide it (the callers validate that first). */
static inline uint32_t duet_xfer_kv_shard_of(uint32_t rank, uint32_t group_size, uint32_t kv_ranks)
{
    return rank / (group_size / kv_ranks);
}

/* Pages of `global_pages` that KV shard `shard` of kv_ranks holds (global page j is shard
 * j % kv_ranks's local page j / kv_ranks). */
static inline uint64_t duet_xfer_kv_shard_pages(uint64_t global_pages, uint32_t kv_ranks,
                                                uint32_t shard)
{
    return global_pages / kv_ranks + (shard < global_pages % kv_ranks);
}

/* Byte layout of one side's pools (the "page header" the reservation carries). */
typedef struct {
    uint32_t page_tokens;  /* tokens per KV page */
    uint32_t n_mla_layers; /* layers in the KV pool */
    uint32_t token_bytes;  /* bytes per token per layer: (kv_lora_rank + rope) * elem size */
    uint32_t n_kda_layers; /* layers in the KDA pool (0 = none) */
    uint32_t kda_heads;    /* heads held in this pool (H on the sender, H/N on a CP rank) */
    uint32_t kda_head_dim; /* K = V */
    uint32_t conv_kernel;  /* W */
    uint32_t state_elem;   /* bytes per state element: 4 (fp32) */
    uint32_t replay_rows;  /* rows per (KDA slot, KDA layer) of the replay pool, each
                              (6*H*K + H) * state_elem bytes (common/cache_layout.h);
                              0 = no replay pool */
} duet_xfer_layout_t;

/* What a destination rank reserved for one request. */
typedef struct {
    const int32_t *pages; /* local page ids, in sequence order; not owned */
    uint32_t n_pages;
    int32_t kda_slot; /* -1 when no KDA state is sent */
} duet_xfer_dest_t;

/* What the sender holds for the request. */
typedef struct {
    const int32_t *pages; /* source page ids, in sequence order; not owned */
    uint32_t n_pages;
    int32_t kda_slot;  /* -1 when no KDA state is sent */
    uint64_t n_tokens; /* tokens of KV to move (<= n_pages * page_tokens) */
    uint32_t n_replay; /* accepted rows not yet folded into the KDA state: rows [0, n_replay)
                          of each KDA layer of kda_slot in the replay pool (0 = none) */
} duet_xfer_src_t;

typedef enum {
    DUET_XFER_SEG_KV = 0,     /* MLA KV bytes; `layer` is the MLA layer */
    DUET_XFER_SEG_KDA = 1,    /* KDA state / conv bytes; `layer` is the KDA layer */
    DUET_XFER_SEG_REPLAY = 2, /* KDA replay rows; `layer` is the KDA layer */
} duet_xfer_seg_kind_t;

typedef struct {
    uint8_t kind; /* duet_xfer_seg_kind_t */
    uint8_t rank; /* destination rank in the group */
    uint16_t layer;
    uint64_t src_off; /* byte offset from the sender pool's base (KV, KDA or replay pool by
                         kind) */
    uint64_t dst_off; /* byte offset from the destination rank's pool base */
    uint64_t len;     /* bytes */
} duet_xfer_entry_t;

typedef struct {
    duet_xfer_entry_t *entries; /* owned */
    size_t n_entries;
    size_t cap;
    size_t *layer_first; /* owned, [n_mla_layers + n_kda_layers + 1]: entries of layer
                            group g are [layer_first[g], layer_first[g+1]) with KV layers
                            first, then KDA layers (state, conv and replay entries) */
    uint64_t bytes_per_rank[DUET_XFER_MAX_RANKS]; /* [n_ranks] used, rest 0 */
    uint64_t total_bytes; /* every rank's bytes (a KV page sent to two ranks counts twice) */
    size_t n_groups;      /* layer groups: n_mla_layers + n_kda_layers */
    size_t layer_cap;     /* size_t allocated at layer_first (so it can be reused) */
} duet_xfer_plan_t;

/*
 * Build the plan for moving `src` (laid out as `src_layout`) into a group of `n_ranks`
 * destinations (dst[r] laid out as dst_layout[r]) whose KV pages are dealt over kv_ranks shards
 * (0 = n_ranks; see the file comment). Validates everything and refuses with a clear message
 * (DUET_ERR_INVALID / DUET_ERR_RANGE): token_bytes / layer counts / head_dim / kernel / elem
 * differing between the sides, kda_heads not divisible by n_ranks or not matching a rank's
 * layout, too few destination pages for n_tokens on some rank (its shard's pages), page ids
 * negative, n_ranks outside [1, DUET_XFER_MAX_RANKS], kv_ranks above n_ranks or not dividing it;
 * and for replay rows (src.n_replay > 0): more than one rank, no KDA
 * layers or no slot, n_replay above n_tokens or above either side's replay_rows. The plan is built
 * into *plan_p (which must be zeroed or previously built; buffers are reused and grown). Pure:
 * touches no pool memory.
 */
duet_status_t duet_xfer_plan_build(const duet_xfer_layout_t *src_layout, const duet_xfer_src_t *src,
                                   const duet_xfer_layout_t *dst_layout,
                                   const duet_xfer_dest_t *dst, uint32_t n_ranks, uint32_t kv_ranks,
                                   duet_xfer_plan_t *plan_p);

void duet_xfer_plan_free(duet_xfer_plan_t *plan); /* frees buffers; accepts zeroed */

/* Pool sizes implied by a layout, for validating a remote base + length. UINT64_MAX when the
 * product overflows 64 bits (such a layout is refused by the plan builder and the reservation
 * decoder). The KDA size of a layout with n_kda_layers = 0 is 0. */
uint64_t duet_xfer_layout_kv_page_bytes(const duet_xfer_layout_t *l);  /* all layers of a page */
uint64_t duet_xfer_layout_kda_slot_bytes(const duet_xfer_layout_t *l); /* all layers of a slot */
/* The replay pool's layout (common/cache_layout.h) that l describes: its KDA layers, heads and
 * head dim, replay_rows rows, state_elem bytes per element. */
duet_replay_layout_t duet_xfer_layout_replay(const duet_xfer_layout_t *l);
/* The replay pool's rows of one slot, all KDA layers (0 without KDA layers or replay_rows). */
uint64_t duet_xfer_layout_replay_slot_bytes(const duet_xfer_layout_t *l);
/* What a transfer with n_replay moves of the replay pool: n_replay rows of every KDA layer. */
uint64_t duet_xfer_layout_replay_bytes(const duet_xfer_layout_t *l, uint32_t n_replay);

#endif
