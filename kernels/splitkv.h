/*
 * splitkv.h: per-request split-KV planning for MLA attention, one planner for both backends
 * (docs/architecture.md, "Split-KV planning").
 *
 * A step's items attend over very different lengths: one request at 128K beside dozens at a few
 * hundred. Splitting every item the same way either leaves the long one running alone at the end
 * or makes every short one pay for splits it does not need. The plan gives each item its own split
 * count: the step's cost (each item's KV blocks times its query rows) is cut into about
 * DUET_SPLITKV_WAVES waves of work per parallel unit (threads on the CPU, SMs on a GPU), counting
 * each work item once per head; an item whose cost is below one chunk stays whole. A work item is
 * a contiguous range of an item's KV blocks (pool pages on the GPU, the fixed attention segments
 * on the CPU); the work list covers every block of every item exactly once, and no work item is
 * empty. An item planned onto one split writes its output directly; only split items meet in the
 * log-sum-exp merge.
 *
 * Items with more than DUET_SPLITKV_MAX_ROWS query rows (prefill chunks) are never split: their
 * rows already give every unit work, and their partials would take rows times the memory.
 *
 * The helpers below are pure integer functions, written once for the host and the device
 * (DUET_SPLITKV_HD): the CPU builds the plan with duet_splitkv_plan, the CUDA backend computes the
 * same plan on the device in one launch from the step's lengths. The plan shapes only who computes
 * what; how a backend's arithmetic depends on it is the backend's (the CPU's is independent of the
 * plan, kernels/cpu/cpu_mla.h).
 */
#ifndef DUET_KERNELS_SPLITKV_H
#define DUET_KERNELS_SPLITKV_H

#include <stdint.h>

#include "common/status.h"

#if defined(__CUDACC__)
#define DUET_SPLITKV_HD __host__ __device__
#else
#define DUET_SPLITKV_HD
#endif

#define DUET_SPLITKV_WAVES      8    /* waves of work per parallel unit the plan aims at */
#define DUET_SPLITKV_MAX_ROWS   16   /* items with more query rows are never split */
#define DUET_SPLITKV_MAX_SPLITS 4096 /* splits of one item at most */
/* The most a step's cost may total, and the most heads and units: the planner's arithmetic
 * (cost plus chunk, units times waves) then stays far inside int64. */
#define DUET_SPLITKV_MAX_COST  (INT64_MAX / 4)
#define DUET_SPLITKV_MAX_UNITS INT32_MAX

/* How a step's split counts are chosen. */
typedef enum {
    DUET_SPLITKV_PER_REQUEST = 0, /* each item its own count (the default) */
    DUET_SPLITKV_UNIFORM = 1,     /* one count for the whole step, from (items, longest item):
                                     what the backends did before; kept for comparison */
    DUET_SPLITKV_NONE = 2,        /* never split */
} duet_splitkv_mode_t;

/* One work item: blocks [block0, block1) of item `item`, its split number `split`. */
typedef struct {
    int32_t item, split;
    int32_t block0, block1;
} duet_splitkv_work_t;

typedef struct {
    int64_t n_items;
    const int64_t *lens;  /* [n_items] KV positions the item's rows attend over (at most) */
    const int64_t *rows;  /* [n_items] query rows (1; k + 1 verifying drafts; a prefill chunk) */
    int64_t heads;        /* attention heads: each work item runs once per head */
    int64_t block_tokens; /* positions per KV block (page or segment) */
    int64_t units;        /* parallel units: threads, SMs */
    duet_splitkv_mode_t mode;
} duet_splitkv_in_t;

typedef struct {
    int32_t *splits;           /* [n_items] each item's split count (>= 1) */
    int32_t *work0;            /* [n_items + 1] item i's work items are [work0[i], work0[i+1]) */
    duet_splitkv_work_t *work; /* [n_work], item-major, splits in order */
    int64_t n_work;
    int64_t chunk; /* cost (blocks x rows) one work item aims at */
} duet_splitkv_plan_t;

/* KV blocks of an item of len positions (rounded up without forming len + block_tokens, which
 * could pass int64). */
DUET_SPLITKV_HD static inline int64_t duet_splitkv_blocks(int64_t len, int64_t block_tokens)
{
    return len <= 0 ? 0 : (len - 1) / block_tokens + 1;
}

/* The cost of an item of `blocks` KV blocks and `rows` query rows, what the chunks cut: blocks x
 * rows, an item of no rows counted as one row. */
DUET_SPLITKV_HD static inline int64_t duet_splitkv_cost(int64_t blocks, int64_t rows)
{
    return blocks * (rows > 0 ? rows : 1);
}

/* Work items the plan aims at: about DUET_SPLITKV_WAVES per unit, each counted once per head. */
DUET_SPLITKV_HD static inline int64_t duet_splitkv_want_work(int64_t heads, int64_t units)
{
    const int64_t tasks = DUET_SPLITKV_WAVES * (units > 0 ? units : 1);
    const int64_t h = heads > 0 ? heads : 1;
    const int64_t w = (tasks + h - 1) / h;
    return w > 0 ? w : 1;
}

/* The cost one work item aims at, from the step's total cost (sum of blocks x rows). */
DUET_SPLITKV_HD static inline int64_t duet_splitkv_chunk(int64_t total_cost, int64_t heads,
                                                         int64_t units)
{
    const int64_t w = duet_splitkv_want_work(heads, units);
    const int64_t c = (total_cost + w - 1) / w;
    return c > 0 ? c : 1;
}

/* Splits of an item of `blocks` KV blocks and `rows` query rows, per request: its cost over the
 * chunk, rounded up, at most one per block and DUET_SPLITKV_MAX_SPLITS; 1 for long prefill items.
 */
DUET_SPLITKV_HD static inline int32_t duet_splitkv_splits(int64_t blocks, int64_t rows,
                                                          int64_t chunk)
{
    if (blocks <= 1 || rows > DUET_SPLITKV_MAX_ROWS)
        return 1;
    int64_t s = (duet_splitkv_cost(blocks, rows) + chunk - 1) / chunk;
    if (s > blocks)
        s = blocks;
    if (s > DUET_SPLITKV_MAX_SPLITS)
        s = DUET_SPLITKV_MAX_SPLITS;
    return (int32_t)(s > 1 ? s : 1);
}

/* The uniform mode's one count for a step of n_items whose longest has max_blocks blocks: enough
 * splits of every item for the step to have the work items it aims at. */
DUET_SPLITKV_HD static inline int32_t duet_splitkv_uniform(int64_t n_items, int64_t max_blocks,
                                                           int64_t heads, int64_t units)
{
    const int64_t w = duet_splitkv_want_work(heads, units);
    int64_t s = n_items > 0 ? (w + n_items - 1) / n_items : 1;
    if (s > max_blocks)
        s = max_blocks;
    if (s > DUET_SPLITKV_MAX_SPLITS)
        s = DUET_SPLITKV_MAX_SPLITS;
    return (int32_t)(s > 1 ? s : 1);
}

/* Blocks [*b0, *b1) of split s of an item of `blocks` blocks cut `splits` ways (splits <= blocks:
 * never empty; sizes differ by at most one). */
DUET_SPLITKV_HD static inline void duet_splitkv_range(int64_t blocks, int32_t splits, int32_t s,
                                                      int64_t *b0, int64_t *b1)
{
    *b0 = blocks * s / splits;
    *b1 = blocks * (s + 1) / splits;
}

/* The most work items a plan of n_items items can have (size the work list with it): every item
 * one, plus what the chunking adds (at most the work items it aims at), in any mode. */
int64_t duet_splitkv_max_work(int64_t n_items, int64_t heads, int64_t units);

/*
 * Plan a step: fill plan->splits[n_items], plan->work0[n_items + 1] and plan->work (room for
 * work_cap entries; duet_splitkv_max_work is always enough). An item with no positions (len 0)
 * gets one split and no work items. DUET_ERR_INVALID for a bad input (n_items < 0, a negative
 * length or row count, heads / block_tokens / units < 1, heads or units past
 * DUET_SPLITKV_MAX_UNITS, a block index past int32, a total cost past DUET_SPLITKV_MAX_COST),
 * DUET_ERR_RANGE when work_cap is too small. Pure.
 */
duet_status_t duet_splitkv_plan(const duet_splitkv_in_t *in, duet_splitkv_plan_t *plan,
                                int64_t work_cap);

#endif
