/*
 * cuda_ops.h: the engine's elementwise ops, norms, MoE routing and experts, and sampling on the
 * GPU. CPU references: kernels/cpu/ops.c, kernels/cpu/moe.c, engine/backend_cpu.c
 * (duet__moe_layer), engine/sampler.c. All pointers are device pointers; calls are queued on
 * `stream`, return a duet status (DUET_ERR_DEVICE naming the CUDA error) and, unless said
 * otherwise, never synchronise or allocate (graph-capturable). Activations are fp32; weight
 * matrices are F32, BF16 or F16.
 */
#ifndef DUET_KERNELS_CUDA_OPS_H
#define DUET_KERNELS_CUDA_OPS_H

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "common/status.h"
#include "kernels/kernels.h"

/* out[t][:] = table[ids[t]][:] as fp32; table [V][D] of `dtype`. */
duet_status_t duet_cuda_embed(cudaStream_t stream, float *out, const void *table,
                              duet_dtype_t dtype, int64_t D, const int32_t *ids, int64_t n);

/* y[m][:] = w ⊙ x[m][:] / sqrt(mean(x[m]²) + eps); w fp32 [D]; row strides ldy, ldx; y may be x. */
duet_status_t duet_cuda_rmsnorm(cudaStream_t stream, float *y, int64_t ldy, const float *x,
                                int64_t ldx, const float *w, int64_t M, int64_t D, float eps);

/* duet_cuda_rmsnorm, the rows also left at xs as `planes` (1 or 3) bf16 planes, [planes][M][D]
 * contiguous: what duet_cuda_gemm_split_x makes of y (plane 0 alone with 1), the same bits,
 * without a pass over y of its own. y may be NULL: the planes only. */
duet_status_t duet_cuda_rmsnorm_planes(cudaStream_t stream, float *y, int64_t ldy, const float *x,
                                       int64_t ldx, const float *w, int64_t M, int64_t D, float eps,
                                       void *xs, int planes);

/* Fused residual + norm: x[m] += a[m] (when a != NULL), then y[m] = RMSNorm(x[m]) · w. */
duet_status_t duet_cuda_add_rmsnorm(cudaStream_t stream, float *y, float *x, const float *a,
                                    const float *w, int64_t M, int64_t D, float eps);

typedef enum { DUET_CUDA_ACT_SILU = 0, DUET_CUDA_ACT_SITU = 1 } duet_cuda_act_t;
/* gate[m][i] = act(gate[m][i]) · up[m][i] for m < M, i < I (row strides ld). SiTU: see kernels.h.
 */
duet_status_t duet_cuda_act_mul(cudaStream_t stream, float *gate, const float *up, int64_t M,
                                int64_t I, int64_t ld, duet_cuda_act_t act, float beta,
                                float beta_lin);
/* The same values rounded to bf16 (nearest even) into hb[m][i], [M][I] contiguous, gate left as
 * it is: a BF16 down projection's x without a conversion (cuda_gemm.h, an op's xs). */
duet_status_t duet_cuda_act_mul_bf16(cudaStream_t stream, void *hb, const float *gate,
                                     const float *up, int64_t M, int64_t I, int64_t ld,
                                     duet_cuda_act_t act, float beta, float beta_lin);

/*
 * MoE routing, per row (kernels/cpu/cpu_moe.h duet_cpu_moe_route): score = σ(logit), choice = score
 * + bias, group-limited (n_group groups; a group's score = sum of its best two choices, or its best
 * if a group has one expert; keep the topk_group best groups), top_k experts by choice (first index
 * on ties), weights = score (renormalised to sum 1 when renorm), times scale. logits [T][E]; idx,
 * wts [T][top_k], in descending choice order.
 */
duet_status_t duet_cuda_moe_route(cudaStream_t stream, const float *logits, const float *bias,
                                  int64_t T, int64_t E, int64_t n_group, int64_t topk_group,
                                  int64_t top_k, int renorm, float scale, int32_t *idx, float *wts);

/*
 * 1 to DUET_CUDA_ROUTER_MAX_T rows (decode at small batches, a verify step's rows) in one kernel:
 * xn = RMSNorm(x) ⊙ nw (x, xn [T][D]; stored, rounded as duet_cuda_rmsnorm rounds it), logits =
 * W · xn for the fp32 router W [E][D] (logits [T][E]), then duet_cuda_moe_route's rule on them
 * into idx, wts [T][top_k]. The logits' sums are fp32 in their own order (like the fused-norm
 * GEMV's); the picks from given logits are the route kernel's, bit for bit. `sync`:
 * DUET_CUDA_ROUTER_SYNC_INTS(E) device ints, 8-byte aligned, zeroed before the first call, then
 * left to the calls (sync[0] counts them; the rest carries each call's logits between its
 * blocks); one per stream of calls.
 */
#define DUET_CUDA_ROUTER_MAX_T        8
#define DUET_CUDA_ROUTER_SYNC_INTS(E) (2 + 2 * DUET_CUDA_ROUTER_MAX_T * (int64_t)(E))
duet_status_t duet_cuda_moe_router_route(cudaStream_t stream, const float *x, int64_t T,
                                         const float *nw, float eps, const float *w, int64_t E,
                                         int64_t D, const float *bias, int64_t n_group,
                                         int64_t topk_group, int64_t top_k, int renorm, float scale,
                                         float *xn, float *logits, int32_t *idx, float *wts,
                                         int *sync);

/* The routed experts of one MoE layer, stored contiguously on the device. */
typedef struct {
    const void *w1;     /* [E][I][D] gate_proj */
    const void *w3;     /* [E][I][D] up_proj */
    const void *w2;     /* [E][D][I] down_proj */
    duet_dtype_t dtype; /* of all three */
    int64_t E, I, D;
    /* Optional shared expert of the same dtype and I (all NULL: none): gate_proj [I][D],
     * up_proj [I][D], down_proj [D][I]. Only a call on the GEMV kernels takes one
     * (duet_cuda_moe_gemv_path: decode and verify steps, where a separate MLP costs three
     * kernels more): y then also gets its output, with weight 1, after the routed sum, as
     * engine/backend_cpu.c adds it. A call on the MMA kernels is refused. */
    const void *sw1, *sw3, *sw2;
    /* Optional, with the shared expert at T = 1 (both NULL: none): the call's x is
     * RMSNorm(norm_x) ⊙ norm_w with norm_eps as duet_cuda_moe_router_route stores it (norm_x
     * [D] and norm_w [D] fp32, 16-byte aligned, D a multiple of 4). The shared expert's gate/up
     * then forms that row itself, the same bits, and runs without waiting for the routing (with
     * PDL, beside the router kernel). The caller guarantees x is that row. */
    const float *norm_x, *norm_w;
    float norm_eps;
    /* Optional (NULL: none): the call's x already rounded to bf16, [T][D] contiguous, as
     * duet_cuda_gemm_split_x's plane 0 holds it. The MMA path then reads it instead of
     * rounding x itself (the same values); the GEMV path keeps reading x. */
    const void *xb;
} duet_cuda_experts_t;

/*
 * y[t] += Σ_k wts[t][k] · W2[e] (act(W1[e] x[t]) ⊙ W3[e] x[t]), e = idx[t][k], for t < T; x is
 * [T][D] fp32 (row stride D), y [T][D]. fp32 accumulation; the sum over k is in k order (the
 * result does not depend on how rows are grouped). Rows are grouped by expert on the device, so
 * each selected expert's weights are read once per call whatever T is. `scratch` has
 * duet_cuda_moe_scratch_bytes(max_T, top_k, E, I, D) bytes.
 */
size_t duet_cuda_moe_scratch_bytes(int64_t max_T, int64_t top_k, int64_t E, int64_t I, int64_t D);
/* Distinct experts `rows` rows route to in expectation when each picks top_k of E uniformly:
 * E·(1 − (1 − top_k/E)^rows); 0 without experts. The one count of "experts a step reads" behind
 * duet_cuda_moe_auto_mma, the CUDA backend's verify padding and duet-bench-model-cuda's roofline.
 */
double duet_cuda_moe_touched(double rows, int64_t top_k, int64_t E);
/* Whether duet_cuda_moe_experts runs T rows on the MMA kernels (BF16 weights, D and I multiples of
 * 32, tensor cores, x rounded to bf16) rather than the GEMV ones (x kept in fp32): from an expected
 * 1.25 rows per selected expert under uniform routing on, never for one row. */
int duet_cuda_moe_auto_mma(int64_t T, int64_t top_k, int64_t E);
/* Whether duet_cuda_moe_experts runs T rows of these experts on the GEMV kernels (any dtype, not
 * duet_cuda_moe_auto_mma's case): the calls that can take a shared expert. */
int duet_cuda_moe_gemv_path(const duet_cuda_experts_t *ex, int64_t T, int64_t top_k);
duet_status_t duet_cuda_moe_experts(cudaStream_t stream, const duet_cuda_experts_t *ex,
                                    const float *x, int64_t T, const int32_t *idx, const float *wts,
                                    int64_t top_k, duet_cuda_act_t act, float beta, float beta_lin,
                                    float *y, void *scratch);

/* out[m] = index of the largest logits[m * ld + v], v < V (first index on ties). */
duet_status_t duet_cuda_argmax(cudaStream_t stream, const float *logits, int64_t ld, int64_t V,
                               int64_t M, int32_t *out);

/* The same result from many blocks per row (the one-block kernel is latency-bound on a 160k
 * vocabulary): two launches, scratch of duet_cuda_argmax_scratch_bytes(M) bytes, M <= 65535. */
size_t duet_cuda_argmax_scratch_bytes(int64_t max_M);
duet_status_t duet_cuda_argmax_split(cudaStream_t stream, const float *logits, int64_t ld,
                                     int64_t V, int64_t M, int32_t *out, void *scratch);

/*
 * Sampling with engine/sampler.c's rule, one row per request: temperature <= 0 or top_k == 1 →
 * argmax; else candidates sorted by logit descending (ties: lower index first), cut to top_k
 * (0 = all), p_i = exp((l_i - l_max) / T), nucleus = shortest prefix whose normalised mass reaches
 * top_p, then the first candidate whose running mass exceeds u · (kept mass). `u` is the
 * request's uniform draw for this token (duet_rng_uniform on the host), so the host keeps each
 * request's RNG stream and a seeded request draws the same tokens on either device (up to
 * rounding of the sums). params: device array of M rows. `scratch` has
 * duet_cuda_sample_scratch_bytes(max_M, V) bytes.
 */
typedef struct {
    float temperature;
    int32_t top_k;
    float top_p;
    float u;
} duet_cuda_sample_params_t;
size_t duet_cuda_sample_scratch_bytes(int64_t max_M, int64_t V);
duet_status_t duet_cuda_sample(cudaStream_t stream, const float *logits, int64_t ld, int64_t V,
                               int64_t M, const duet_cuda_sample_params_t *params, int32_t *out,
                               void *scratch);

#ifdef __cplusplus
}
#endif

#endif
