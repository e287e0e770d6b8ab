/*
 * cpu_step.h: what the CPU mixers of one engine step know about the batch (host arrays), the CPU
 * twin of kernels/cuda/cuda_step.h.
 *
 * One step stacks the new tokens of n_items sequences into n_rows rows: item i owns rows
 * [item_row0[i], item_row0[i + 1]), its tokens at positions item_pos0[i] .. of its sequence. The
 * caches are addressed through common/cache_layout.h (the kernels' *_layer_t carry the pool's
 * base and layout). Every array is the caller's and is only read.
 *
 * Speculative decoding (the KDA kernels; cuda_step.h has no twin of these yet): a *verify* item's
 * rows are tentative: they are computed from its committed KDA state, which stays as it is, and
 * what folding each row in needs goes to its replay block (cpu_kda.h). An item with `replay`
 * rows has that many accepted rows of an earlier verify in its replay block, folded into its
 * state before its own rows (duet_cpu_kda_replay).
 */
#ifndef DUET_KERNELS_CPU_STEP_H
#define DUET_KERNELS_CPU_STEP_H

#include <stdint.h>

typedef struct {
    int64_t n_items;
    int64_t n_rows;                   /* sum of the items' new tokens */
    const int64_t *item_row0;         /* [n_items + 1] first row of each item; [n_items] = n_rows */
    const int64_t *item_pos0;         /* [n_items] tokens in the item's caches before this step */
    const int32_t *item_slot;         /* [n_items] KDA state slot */
    const int32_t *const *item_pages; /* [n_items] the item's KV page ids, in order */
    const int32_t *item_verify;       /* [n_items] 1: tentative rows; NULL = none */
    const int64_t *item_replay;       /* [n_items] accepted rows to fold in first; NULL = none */
} duet_cpu_step_t;

#endif
