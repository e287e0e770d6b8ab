/*
 * cpu_mla.h: MLA attention over the paged latent cache on the CPU, weight-absorbed form
 * (docs/model.md, "MLA mixer"), the reference that kernels/cuda/cuda_mla.h is tested against.
 * Kimi Linear's MLA has no rotary embedding: q_r and k_r are used as they are. Host pointers,
 * fp32, an F32 KV pool; the work runs per (item, head) on the thread pool.
 *
 * Batch invariance (docs/architecture.md): a row's result depends only on its own queries and its
 * sequence's cache; the sums over positions run in position order, so neither the batch nor the
 * page size changes a bit.
 */
#ifndef DUET_KERNELS_CPU_MLA_H
#define DUET_KERNELS_CPU_MLA_H

#include <stdint.h>

#include "common/cache_layout.h"
#include "kernels/cpu/cpu_step.h"
#include "kernels/kernels.h"

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
 * For every row: c = RMSNorm(ckr[row][0:r]; norm_w, eps) in place, then [c | ckr[row][r:r+dr]] is
 * stored at the row's position in its item's pages. ckr is [n_rows][r + dr]; norm_w is [r], any
 * dtype.
 */
void duet_cpu_mla_kv_write(duet_kernels_t *k, const duet_cpu_step_t *st,
                           const duet_cpu_mla_layer_t *ly, float *ckr, const duet_tensor_t *norm_w,
                           float eps);

/*
 * Attention of every row and head over its item's positions 0 .. its own (causal, the row's own
 * token included, already written by kv_write): score_s = (q̂·c_s + q_r·k_r,s) · scale,
 * lat = softmax(score) · c. qhat: [n_rows][n][r]; q_r of head h at qr + row*ldqr + h*dqr_stride
 * (dr values); lat: [n_rows][n][r] out. scratch: duet_kernels_n_threads(k) blocks of
 * scratch_per_thread floats, each at least the longest context of the step.
 */
void duet_cpu_mla_attend(duet_kernels_t *k, const duet_cpu_step_t *st,
                         const duet_cpu_mla_layer_t *ly, const float *qhat, const float *qr,
                         int64_t ldqr, int64_t dqr_stride, float scale, float *lat, float *scratch,
                         int64_t scratch_per_thread);

#endif
