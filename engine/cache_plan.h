/*
 * The cache plan (docs/architecture.md, "Cache pools", "The cache plan"): how one memory budget
 * is split between a generation worker's cache pools before any of them exists.
 *
 * A speculating worker holds the target's pools (MLA KV pages, KDA state slots, KDA replay rows)
 * and the draft model's (the same three kinds). The KDA state and replay pools are sized by
 * batch.max_seqs alone (one slot per running request) and are not divisible, so they come out of
 * the budget first; what is left is the KV budget, split between the two KV pools in proportion
 * to their bytes per token (so both hold the same number of tokens), then:
 *  - the draft share is capped (cache.draft_kv_budget_gib; 0 = no cap), the excess going to the
 *    target;
 *  - the draft share never drops below its floor: every running request (batch.max_seqs) at
 *    cache.max_seq_len + spec.k tokens, in whole draft pages (the floor wins over the cap);
 *  - the target keeps at least one request at cache.max_seq_len;
 *  - pages are whole: each pool rounds its bytes down to pages; what the draft's rounding leaves
 *    goes to the target, what the target's leaves is unused.
 * Without a drafter everything after the fixed pools is the target's. A budget too small for the
 * fixed pools, the target's minimum and the draft floor together is an error naming the keys
 * (the target's minimum only for cache.budget_gib: an implied budget holds any cache.kv_pages,
 * a small pool being how a worker is made to suspend requests).
 *
 * When no budget is given (cache.budget_gib 0) the budget is what the pools would take today:
 * the fixed pools, cache.kv_pages target pages (or its default) and the draft's default pool, so
 * a worker configured as before keeps about the same pools.
 *
 * Pure arithmetic on numbers from the model configs (layouts from common/cache_layout.h, via the
 * pools' own descriptors: duet_model_pool_descs), no I/O and no model loading, so that
 * duet-gen --print-cache-plan and the tests can compute it without weights.
 */
#ifndef DUET_ENGINE_CACHE_PLAN_H
#define DUET_ENGINE_CACHE_PLAN_H

#include <stdbool.h>
#include <stdint.h>

#include "common/cache_layout.h"
#include "common/status.h"
#include "common/strbuf.h"
#include "engine/model.h"
#include "engine/spec.h"

/* One model's pools, as the plan sees them. */
typedef struct {
    duet_kv_layout_t kv;         /* n_layers 0: no MLA layers, no KV pool */
    duet_kda_layout_t kda;       /* n_layers 0: no KDA state */
    duet_replay_layout_t replay; /* n_layers or rows 0: no replay pool */
    int64_t seq_tokens;          /* tokens one request may hold: the target's minimum is one
                                    such request, the draft's floor max_seqs of them */
    int64_t kv_pages;            /* KV pages the pool has without a budget (> 0) */
} duet_cache_plan_pool_in_t;

typedef struct {
    uint64_t budget_bytes;    /* cache.budget_gib in bytes; 0 = implied by the pools' kv_pages */
    uint64_t draft_cap_bytes; /* cache.draft_kv_budget_gib in bytes; 0 = no cap */
    int64_t max_seqs;         /* batch.max_seqs (>= 1): KDA / replay slots, the draft floor */
    bool has_draft;           /* a draft model (spec.method draft) */
    duet_cache_plan_pool_in_t target, draft;
} duet_cache_plan_in_t;

/* One pool's share. */
typedef struct {
    uint64_t token_bytes; /* KV bytes of one token, every MLA layer */
    uint64_t page_tokens;
    uint64_t page_bytes;   /* KV bytes of one page, every MLA layer (0: no KV pool) */
    int64_t pages;         /* KV pages */
    uint64_t bytes;        /* pages * page_bytes */
    int64_t min_pages;     /* target: one request; draft: the floor */
    uint64_t min_bytes;    /* min_pages * page_bytes */
    uint64_t kda_bytes;    /* KDA state: max_seqs slots */
    uint64_t replay_bytes; /* KDA replay rows: max_seqs slots */
} duet_cache_plan_pool_t;

typedef struct {
    uint64_t budget_bytes;
    bool budget_implied;        /* no cache.budget_gib: what the kv_pages imply */
    uint64_t fixed_bytes;       /* KDA state + replay of both models, taken first */
    uint64_t kv_budget_bytes;   /* budget - fixed */
    uint64_t draft_share_bytes; /* the draft's proportional share, before cap / floor / pages */
    uint64_t draft_cap_bytes;   /* as given (0 = none) */
    bool cap_bound;             /* the cap lowered the draft's share */
    bool floor_bound;           /* the floor raised it (above the share or the cap) */
    bool target_min_bound;      /* the target's minimum lowered it */
    uint64_t unused_bytes;      /* budget - fixed - both pools' bytes (page rounding) */
    bool has_draft;
    duet_cache_plan_pool_t target, draft; /* draft all 0 without a drafter */
} duet_cache_plan_t;

/*
 * The plan for in (see the file comment). Errors: DUET_ERR_INVALID for inputs that cannot
 * describe pools (max_seqs < 1, a page or sequence of 0 tokens), DUET_ERR_RANGE when the budget
 * is smaller than the fixed pools + the target's minimum + the draft floor (the message names
 * cache.budget_gib / cache.kv_pages, batch.max_seqs, cache.max_seq_len, the page sizes and every
 * number), or when a pool's pages or bytes would not fit (more than INT32_MAX pages, 64-bit
 * overflow). *plan is written on DUET_OK only.
 */
duet_status_t duet_cache_plan_compute(const duet_cache_plan_in_t *in, duet_cache_plan_t *plan);

/*
 * The plan's inputs from the model configs and options (no files read): target config tc loaded
 * with to (its page_tokens, kv_pages, max_seqs, max_seq_len, spec_rows, kv_dtype), and, when so
 * is spec.method draft, the draft config dc with the options duet_spec_create loads it with
 * (duet_spec_draft_opts). The budget and the cap are given in bytes (0: implied / none).
 */
void duet_cache_plan_inputs(const duet_model_config_t *tc, const duet_model_opts_t *to,
                            const duet_model_config_t *dc, const duet_spec_opts_t *so,
                            uint64_t budget_bytes, uint64_t draft_cap_bytes,
                            duet_cache_plan_in_t *in);

/* The plan as one JSON object (the format of duet-gen --print-cache-plan; docs/architecture.md),
 * appended to sb. DUET_ERR_NOMEM. */
duet_status_t duet_cache_plan_json(const duet_cache_plan_t *plan, duet_strbuf_t *sb);

/* Bytes of a GiB count (cache.budget_gib, cache.draft_kv_budget_gib: finite, >= 0), rounded
 * down; UINT64_MAX when it does not fit. */
uint64_t duet_cache_plan_gib_bytes(double gib);

#endif
