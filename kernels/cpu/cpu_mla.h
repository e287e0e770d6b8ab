/*
 * cpu_mla.h: MLA attention over the paged latent cache on the CPU, weight-absorbed form
 * (docs/model.md, "MLA mixer"), the reference that kernels/cuda/cuda_mla.h is tested against.
 * Kimi Linear's MLA has no rotary embedding: q_r and k_r are used as they are. Host pointers,
 * fp32, an F32 KV pool; the work runs per (item, head) on the thread pool.
 *
 * Split-KV (kernels/splitkv.h): each step is planned per request, in units of fixed segments of
 * DUET_CPU_MLA_SEG positions: a long item's segments are cut into several work items that run in
 * parallel, short items stay whole. A task is one (work item, query row) for every head at once:
 * MLA's heads share the latent rows, so each row is read once per task, not once per head. The
 * arithmetic does not depend on that cut: every (row, head) computes each segment's (max, sum of
 * exp, weighted sum of c) in position order, and folds the segments in order with one log-sum-exp
 * merge function, whether the segments were computed by one task (which folds them itself and
 * writes the row directly) or by several (whose partials the merge pass folds).
 *
 * Batch invariance (docs/architecture.md): a row's result depends only on its own queries and its
 * sequence's cache; segments are cut in positions, sums run in position order and segments fold
 * in order, so neither the batch, its plan nor the page size changes a bit.
 */
#ifndef DUET_KERNELS_CPU_MLA_H
#define DUET_KERNELS_CPU_MLA_H

#include <stdint.h>

#include "common/cache_layout.h"
#include "kernels/cpu/cpu_step.h"
#include "kernels/kernels.h"
#include "kernels/splitkv.h"

/* Positions per attention segment: the unit of the CPU's plans and of its arithmetic (a constant:
 * the numbers must not depend on the batch or the machine). */
#define DUET_CPU_MLA_SEG 256

/* One MLA layer's view of the KV pool (the host pool's memory and layout; token_bytes must be
 * (r + dr) * 4: an F32 pool). */
typedef struct {
    void *kv_base; /* the KV pool */
    duet_kv_layout_t layout;
    int64_t layer;   /* this MLA layer's index among MLA layers */
    int64_t n_heads; /* n */
    int64_t r, dr;   /* kv_lora_rank, qk_rope_head_dim: a token's row is [c | k_r] */
} duet_cpu_mla_layer_t;

/*
 * A Helix rank's share of the KV (engine/shard.h): of a sequence's global pages it holds those
 * with index j % cp == c, as its pages 0, 1, ... in order (seq->pages is that list). Its tokens
 * are then a dense run of "local" positions, and the positions a row at global position p sees
 * are a prefix of them (duet_cpu_mla_local_len): attention runs over local positions unchanged.
 * cp <= 1: every page.
 */
typedef struct {
    int64_t cp, c;
    int64_t page_tokens;
} duet_cpu_mla_shard_t;

/* Local tokens among global positions 0 .. pos - 1 (pos tokens), for shard sh (NULL: pos). */
static inline int64_t duet_cpu_mla_local_len(const duet_cpu_mla_shard_t *sh, int64_t pos)
{
    if (sh == NULL || sh->cp <= 1 || pos <= 0)
        return pos;
    const int64_t P = sh->page_tokens, last = pos - 1, gp = last / P;
    int64_t n = (gp > sh->c ? (gp - sh->c - 1) / sh->cp + 1 : 0) * P;
    if (gp % sh->cp == sh->c)
        n += last % P + 1;
    return n;
}

/*
 * For every row: c = RMSNorm(ckr[row][0:r]; norm_w, eps) in place, then [c | ckr[row][r:r+dr]] is
 * stored at the row's position in its item's pages (on a shard: only rows whose page it holds).
 * ckr is [n_rows][r + dr]; norm_w is [r], any dtype. sh: NULL = every page.
 */
void duet_cpu_mla_kv_write(duet_kernels_t *k, const duet_cpu_step_t *st,
                           const duet_cpu_mla_layer_t *ly, const duet_cpu_mla_shard_t *sh,
                           float *ckr, const duet_tensor_t *norm_w, float eps);

/*
 * The attention's plan and partials, kept between steps by the caller (zero it first; free with
 * duet_cpu_mla_ws_free). mode and units may be set before a step; the rest is grown as steps
 * need and is not for the caller.
 */
typedef struct {
    duet_splitkv_mode_t mode;   /* PER_REQUEST (0, the default); the others for comparison */
    int64_t units;              /* parallel units the plan aims at; 0 = the pool's threads */
    duet_cpu_mla_shard_t shard; /* a Helix rank's share of the pages (zeroed: every page) */
    duet_splitkv_plan_t plan;
    int64_t *lens, *rows, *part0; /* [cap_items]; lens in local positions */
    int64_t cap_items, cap_work;
    float *part; /* the split items' partials: (m, l, acc[r]) per (segment, row, head) */
    int64_t cap_part;
    int64_t *merge; /* (item, row) pairs of the split items' rows */
    int64_t cap_merge;
    int64_t *tasks; /* (work item, row) pairs: the step's tasks */
    int64_t cap_tasks;
    int64_t n_tasks, n_merge; /* the planned step's tasks and merge pairs */
    int64_t heads, r;         /* the shape it was planned for */
} duet_cpu_mla_ws_t;

void duet_cpu_mla_ws_free(duet_cpu_mla_ws_t *ws); /* frees the buffers; accepts a zeroed one */

/* Floats of per-thread scratch duet_cpu_mla_attend needs for n_heads heads of latent rank r. */
int64_t duet_cpu_mla_scratch_floats(int64_t n_heads, int64_t r);

/*
 * Plan step st for MLA layers of n_heads heads and latent rank r into ws (kernels/splitkv.h):
 * the work list, the split items' partials and the tasks. Once per step: every MLA layer of the
 * step runs on the same plan. DUET_ERR_NOMEM when ws cannot grow.
 */
duet_status_t duet_cpu_mla_plan(duet_kernels_t *k, const duet_cpu_step_t *st, int64_t n_heads,
                                int64_t r, duet_cpu_mla_ws_t *ws);

/*
 * Attention of every row and head over its item's positions 0 .. its own (causal, the row's own
 * token included, already written by kv_write): score_s = (q̂·c_s + q_r·k_r,s) · scale,
 * lat = softmax(score) · c. qhat: [n_rows][n][r]; q_r of head h at qr + row*ldqr + h*dqr_stride
 * (dr values); lat: [n_rows][n][r] out. scratch: duet_kernels_n_threads(k) blocks of
 * scratch_per_thread floats, each at least duet_cpu_mla_scratch_floats(n, r). ws: st's plan
 * (duet_cpu_mla_plan, for ly's heads and rank).
 *
 * On a shard (ws->shard) a row attends to the positions it sees that the rank holds; lse (NULL
 * = not wanted, [n_rows][n]) gets each (row, head)'s log-sum-exp of its scores, the weight of
 * this partial result in the merge of the ranks' (engine/backend_cpu.c). A row that sees none of
 * the rank's positions gets lat 0 and lse -inf.
 */
void duet_cpu_mla_attend(duet_kernels_t *k, const duet_cpu_step_t *st,
                         const duet_cpu_mla_layer_t *ly, const float *qhat, const float *qr,
                         int64_t ldqr, int64_t dqr_stride, float scale, float *lat, float *lse,
                         float *scratch, int64_t scratch_per_thread, const duet_cpu_mla_ws_t *ws);

#endif
