/*
 * cuda_mla.h: MLA attention over the paged latent cache on the GPU, weight-absorbed form
 * (docs/model.md "MLA mixer"; CPU reference: kernels/cpu/cpu_mla.h).
 * Kimi Linear's MLA has no rotary embedding: q_r and k_r are used as they are. All pointers are
 * device pointers; calls are queued on `stream`, never synchronise or allocate (graph-capturable)
 * and return a duet status.
 */
#ifndef DUET_KERNELS_CUDA_MLA_H
#define DUET_KERNELS_CUDA_MLA_H

#include <cuda_runtime_api.h>

#include "kernels/cuda/cuda_step.h"

#ifdef __cplusplus
extern "C" {
#endif

#include "common/status.h"
#include "kernels/kernels.h"

/* SMs per parallel unit of the attention's split-KV plan (kernels/splitkv.h aims at 8 waves of
 * work per unit; bench/RESULTS.md, "Split-KV planning", says why a unit is several SMs). */
#ifndef DUET_CUDA_MLA_SMS_PER_UNIT
#define DUET_CUDA_MLA_SMS_PER_UNIT 8
#endif

typedef struct {
    void *kv_base;         /* the KV pool */
    duet_dtype_t kv_dtype; /* F32 or BF16 */
    int64_t kv_n_layers;   /* MLA layers per page */
    int64_t page_tokens;
    int64_t layer;   /* this MLA layer's index among MLA layers */
    int64_t n_heads; /* n */
    int64_t r, dr;   /* kv_lora_rank, qk_rope_head_dim: td = r + dr */
} duet_cuda_mla_layer_t;

/*
 * For every row: c = RMSNorm(ckr[row][0:r]) · norm_w (eps), then [c | ckr[row][r:r+dr]] is
 * stored (rounded to kv_dtype) at the row's position (row_pos) in its item's pages. ckr is
 * [n_rows][r + dr] fp32 and is not modified.
 */
duet_status_t duet_cuda_mla_kv_write(cudaStream_t stream, const duet_cuda_step_t *st,
                                     const duet_cuda_mla_layer_t *ly, const float *ckr,
                                     const float *norm_w, float eps);

/*
 * Attention of every row and head over its item's positions 0 .. row_pos (causal, the row's own
 * token included, already written by kv_write): score_s = (q̂·c_s + q_r·k_r,s) · scale,
 * lat = softmax(score) · c. qhat: [n_rows][n][r]; q_r of head h at qr + row*ldqr + h*dqr_stride
 * (dr values); lat: [n_rows][n][r] out, 16-byte aligned.
 * Split-KV (kernels/splitkv.h): each item is cut into ranges of positions processed by
 * separate blocks as the step's plan says; a split item's partial (max, sum, acc) results are
 * merged by a reducer weighing them by exp(max_i - max) (log-sum-exp merge), an item planned
 * onto one split writes lat directly. Any plan gives the same result up to fp32 rounding.
 *
 * duet_cuda_mla_scratch_bytes: the scratch bytes (plan and partials) for any step of at most
 *   max_items items, max_rows rows and st->max_split_rows <= max_split_rows, for layers of ly's
 *   shape (n_heads, r, dr, kv dtype) on the current device (its SM count); 0 for a bad argument.
 *   It grows with each count, so one scratch sized for a CUDA-graph batch bucket's largest step
 *   (or for the engine's largest) serves every replay without reallocating. Partials take
 *   min(max_split_rows, 16) · (max_items + ~8 · SMs) · n_heads · r floats: what a step whose
 *   split items all have max_split_rows rows may need.
 * duet_cuda_mla_plan: the step's split-KV plan into `scratch` (16-byte aligned, at least
 *   duet_cuda_mla_scratch_bytes for the step's counts): one single-block kernel computing, from
 *   the step's metadata on the device (an item's KV length is its last row's position + 1), the
 *   plan duet_splitkv_plan computes in DUET_SPLITKV_PER_REQUEST mode with heads = the attention
 *   grid's head groups, units = the SMs / DUET_CUDA_MLA_SMS_PER_UNIT and blocks of 64 positions;
 * items of more than st->max_split_rows rows are planned unsplit. Call it once per step, after the
 * step's metadata is on the device and before the step's first attend; every layer's attend (same
 *   st, a layer of the same shape) reads it. The host never reads it (no sync; capturable).
 * duet_cuda_mla_attend: the attention by the plan in `scratch` (the plan of this step: attend
 *   does not check it). DUET_ERR_RANGE when the scratch is smaller than the step needs.
 */
size_t duet_cuda_mla_scratch_bytes(const duet_cuda_mla_layer_t *ly, int64_t max_items,
                                   int64_t max_rows, int64_t max_split_rows);
duet_status_t duet_cuda_mla_plan(cudaStream_t stream, const duet_cuda_step_t *st,
                                 const duet_cuda_mla_layer_t *ly, void *scratch,
                                 size_t scratch_bytes);
duet_status_t duet_cuda_mla_attend(cudaStream_t stream, const duet_cuda_step_t *st,
                                   const duet_cuda_mla_layer_t *ly, const float *qhat,
                                   const float *qr, int64_t ldqr, int64_t dqr_stride, float scale,
                                   float *lat, void *scratch, size_t scratch_bytes);

/*
 * The expanded (non-absorbed) form, for steps of long prefill chunks. The absorbed attend
 * multiplies each query by the whole latent row (r + dr = 576 dims for scores, r = 512 for
 * values); expanded, each head has its own keys and values, K_h = W_UK[h] c and V_h = W_UV[h] c
 * (dn = dv = 128), so a (query, position) pair costs 192 + 128 dims, at the price of expanding
 * the item's cached rows once per layer (one GEMM over its positions). The expanded rows are bf16
 * [v_hi | v_lo | k_hi | k_r | k_lo] (576 values: x = hi + lo to 2^-16 · |x|, as attend splits
 * q̂ and P), head h's row of position p at xkv + (h · xstride + p) · 576; attend_x runs them
 * flash-attention style (blocks of 64 query rows of one head, scores and softmax in registers).
 * Only for dn = dv = 128, dr = 64 and a BF16 cache (duet_cuda_mla_x_shape), which is Kimi
 * Linear's.
 *
 * x_weights: wkv [2 n · 128][r] = W_UK[h] (h = 0 .. n-1, from wuk_t [n][r][dn]) then wuv
 *   [n][dv][r], in `dtype` (F32 or BF16): the weight of the expansion GEMM
 *   [positions][n · 128 | n · 128] = c · wkvᵀ.
 * gather: item `item`'s cache rows at positions p0 .. p0 + np - 1 as fp32 [np][r + dr].
 * x_pack: from the GEMM's rows kv [np][ldkv] (K of head h at h · 128, V at n · 128 + h · 128)
 *   and the gathered rows ckr (k_r at r), the expanded rows p0 .. p0 + np - 1 of every head
 *   (p0 + np <= xstride; an item's position p goes to row x_i + p, below).
 * attend_x: every item's rows must be consecutive positions (row t at item_pos0 + t, as in
 *   every step), and its positions 0 .. its last row's (L_i of them) expanded in xkv from row
 *   x_i = L_0 + .. + L_(i-1) on (so the L_i sum to <= xstride); q of (row, head) at q + row · ldq +
 * head · dq_stride ([q_nope | q_r], 192 values, 8-byte aligned); o [n_rows][n][128] (16-byte
 * aligned) = softmax(scores) · V, the value the absorbed path's W_UV product gives. prec: F32
 * multiplies hi + lo splits of q, K, V and P (within 2^-16 of each product, as attend); BF16
 * rounds each to bf16 once and multiplies those alone (a third of the tensor-core products, the
 * precision of a bf16 model's attention: 2^-8 of each operand at most); anything else is
 * DUET_ERR_UNSUPPORTED. Launched with PDL; reads nothing before its wait but the step's metadata.
 */
int duet_cuda_mla_x_shape(const duet_cuda_mla_layer_t *ly, int64_t dn, int64_t dv);
size_t duet_cuda_mla_x_bytes(int64_t positions, int64_t n_heads);
duet_status_t duet_cuda_mla_x_weights(cudaStream_t stream, duet_dtype_t dtype, const void *wuk_t,
                                      const void *wuv, int64_t n, int64_t r, void *wkv);
duet_status_t duet_cuda_mla_gather(cudaStream_t stream, const duet_cuda_step_t *st,
                                   const duet_cuda_mla_layer_t *ly, int64_t item, int64_t p0,
                                   int64_t np, float *out);
duet_status_t duet_cuda_mla_x_pack(cudaStream_t stream, const duet_cuda_mla_layer_t *ly,
                                   const float *kv, int64_t ldkv, const float *ckr, int64_t p0,
                                   int64_t np, void *xkv, int64_t xstride);
duet_status_t duet_cuda_mla_attend_x(cudaStream_t stream, const duet_cuda_step_t *st,
                                     const duet_cuda_mla_layer_t *ly, const void *xkv,
                                     int64_t xstride, const float *q, int64_t ldq,
                                     int64_t dq_stride, float scale, duet_dtype_t prec, float *o);

#ifdef __cplusplus
}
#endif

#endif
