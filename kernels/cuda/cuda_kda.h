/*
 * cuda_kda.h: the KDA mixer's sequence-dependent parts on the GPU (docs/model.md "KDA mixer"; the
 * CPU reference is kernels/cpu/cpu_kda.h, the same four parts). All pointers are device
 * pointers, every call is queued on `stream` and returns a duet status (DUET_ERR_DEVICE naming
 * the CUDA error on a launch failure). None of these synchronises or
 * allocates, so all can be captured in a CUDA graph. fp32 everywhere; the state stays fp32. Layout
 * of the rows (as the CPU path): proj / qkv are [n_rows][3*H*K] (q | k | v), g is [n_rows][H*K],
 * beta [n_rows][H], gate and o [n_rows][H*K].
 */
#ifndef DUET_KERNELS_CUDA_KDA_H
#define DUET_KERNELS_CUDA_KDA_H

#include <cuda_runtime_api.h>

#include "kernels/cuda/cuda_step.h"

#ifdef __cplusplus
extern "C" {
#endif

#include "common/status.h"

/* The chunked core's state products: fp32 FMA; on the tensor cores as tf32 products of fp32
 * values split in two (about 2^-21 per product, against fp32 FMA's 2^-24); or as one tf32
 * product of the values rounded to tf32 (2^-11 per operand, finer than bf16's 2^-8). The engine
 * takes the one-term form for BF16 compute, where a bf16 model's own products round its
 * operands to bf16. */
typedef enum {
    DUET_CUDA_KDA_FMA = 0,
    DUET_CUDA_KDA_TC_SPLIT = 1,
    DUET_CUDA_KDA_TC_ONE = 2,
} duet_cuda_kda_tc_t;

typedef struct {
    float *kda_base;          /* the KDA pool */
    int64_t kda_n_layers;     /* KDA layers per slot */
    int64_t kda_layer_floats; /* H*K*V + 3*H*K*(W-1) */
    int64_t layer;            /* this KDA layer's index among KDA layers */
    int64_t H, K, W;          /* heads, head dim (= V), conv kernel size */
    /* How the chunked core's state products (items of 2+ tokens) run: a duet_cuda_kda_tc_t. */
    int tc;
    /* The KDA replay pool (speculative decoding; common/cache_layout.h, fp32): replay_rows rows
     * per (slot, KDA layer), kda_n_layers layers per slot, each row (6*H*K + H) floats. NULL:
     * none, and the step has no verify items nor replay rows. */
    float *replay_base;
    int64_t replay_rows;
} duet_cuda_kda_layer_t;

/*
 * Verify items (speculative decoding; st->item_verify, the CPU reference kernels/cpu/cpu_kda.h):
 * a verify item's rows read the committed state and window and leave them as they are. The conv
 * writes its rows' pre-conv projections to its replay rows instead of rolling the window; the core
 * runs the recurrent form row after row on a register copy of S (each row the same arithmetic as
 * a one-token step of the recurrent kernel and the decode chain, which are bit-identical) and
 * writes its rows' k, v, g, β to the replay rows. duet_cuda_kda_replay later folds accepted rows
 * in with the same arithmetic, so S and the windows end as that many one-token steps over the
 * stored rows would leave them, bit for bit.
 */

/*
 * Fold every item's st->item_replay[i] accepted rows (rows 0.. of its replay block) into its state,
 * in every KDA layer of the pool (ly->kda_n_layers) in one launch (ly->layer is ignored): the
 * recurrent form over their k, v, g, β on S, then each window keeps the last W-1 of (window, the
 * rows' projections). Items with none are left alone; does nothing without st->item_replay.
 */
duet_status_t duet_cuda_kda_replay(cudaStream_t stream, const duet_cuda_step_t *st,
                                   const duet_cuda_kda_layer_t *ly);

/*
 * Causal depthwise conv + SiLU of every item's rows: qkv[row][ch] = SiLU(Σ_j taps[ch][j] ·
 * u[t - (W-1) + j][ch]) where u is the item's conv window (W-1 earlier pre-conv inputs) followed
 * by its proj rows; then the window keeps the last W-1 pre-conv inputs (a verify item's stays and
 * its proj rows go to its replay rows). taps: fp32 [3*H*K][W].
 * Supports W <= 8 and K <= 128 (DUET_ERR_UNSUPPORTED otherwise).
 */
duet_status_t duet_cuda_kda_conv(cudaStream_t stream, const duet_cuda_step_t *st,
                                 const duet_cuda_kda_layer_t *ly, const float *taps,
                                 const float *proj, float *qkv);

/*
 * Per row: g[i] = neg_A[i / K] · softplus(g[i] + dt_bias[i]) (in place), beta = σ(beta) (in
 * place), q and k of every head L2-normalised (eps 1e-6 inside the sqrt), q also scaled by K^-1/2
 * (in place in qkv). neg_A: [H] = -exp(A_log); dt_bias: [H*K]. K <= 128 (DUET_ERR_UNSUPPORTED
 * otherwise).
 */
duet_status_t duet_cuda_kda_prep(cudaStream_t stream, int64_t n_rows,
                                 const duet_cuda_kda_layer_t *ly, const float *neg_A,
                                 const float *dt_bias, float *qkv, float *g, float *beta);

/*
 * The delta-rule core of every (item, head): reads q, k, v from qkv, g, beta; writes o
 * [n_rows][H*K]; updates the item's state S in the pool. Items with one new token use the
 * recurrent form, longer items the chunked form (chunks of 64), as the CPU path does (a verify
 * item the recurrent form on a copy of S, its k, v, g, β to its replay rows); both are
 * the same function. `scratch` has duet_cuda_kda_scratch_bytes(max_items, max_rows, H, K) bytes
 * for steps of at most max_items items and max_rows rows (about 161 KB per 64 rows and head at
 * K = 128): there the chunked form leaves, for every chunk in parallel, everything that does not
 * depend on the state, before its sequential pass. A step with an item of more than one token
 * and no scratch is refused (DUET_ERR_INVALID); a pure decode step may pass NULL. K must be a
 * multiple of 16 in [16, 128] (DUET_ERR_UNSUPPORTED otherwise) and g <= 0.
 */
size_t duet_cuda_kda_scratch_bytes(int64_t max_items, int64_t max_rows, int64_t H, int64_t K);
duet_status_t duet_cuda_kda_core(cudaStream_t stream, const duet_cuda_step_t *st,
                                 const duet_cuda_kda_layer_t *ly, const float *qkv, const float *g,
                                 const float *beta, float *o, void *scratch);

/* o[row][h*K + d] = o_norm[d] · o / sqrt(mean_d(o²) + eps) · σ(gate[row][h*K + d]), in place;
 * K <= 128 (DUET_ERR_UNSUPPORTED otherwise). */
duet_status_t duet_cuda_kda_out(cudaStream_t stream, int64_t n_rows, int64_t H, int64_t K,
                                const float *o_norm, float eps, const float *gate, float *o);

/* A KDA layer's weights the chain reads (device pointers, not owned). */
typedef struct {
    const float *taps;    /* [3*H*K][W] conv taps */
    const float *neg_A;   /* [H] -exp(A_log) */
    const float *dt_bias; /* [H*K] */
    const float *o_norm;  /* [K] out-norm weight */
    float eps;            /* out-norm epsilon (rms_norm_eps) */
} duet_cuda_kda_weights_t;

/*
 * The mixer after its projections, in one call: conv, prep, core and out with the arguments the
 * four calls above take (n_rows = st->n_rows). Same results and the same buffers written: qkv
 * (from proj), g and beta (prepared in place), o (normed and gated), the items' S and windows.
 * ob (NULL: none): out's rows go there instead, rounded to bf16 (nearest even), [n_rows][H·K]
 * contiguous, for a BF16 o_proj to read without a conversion (cuda_gemm.h, an op's xs); o then
 * holds the core's output, and the chain runs the four kernels.
 * A pure decode step (st->max_item_tokens == 1, no verify item, no ob) of at most 768 (item,
 * head) pairs on a device with thread-block clusters (sm_90+) runs as one kernel, bit-identical to
 * the four calls and more than twice as fast at batch 1; so does a step of verify items beside
 * one-token items (st->max_item_tokens == 1, ob or not) of at most 64 (item, head) pairs when
 * ly->replay_rows <= 9, the rows a verify item can have at 8 drafts. Anything else runs the four
 * calls, which are faster from a few waves of clusters on (kda.cu, DUET_KDA_FUSED_MAX_CLUSTERS,
 * DUET_KDA_VERIFY_MAX_CLUSTERS). Needs K a multiple of 16 in [16, 128] and W <= 8
 * (DUET_ERR_UNSUPPORTED otherwise).
 */
duet_status_t duet_cuda_kda_chain(cudaStream_t stream, const duet_cuda_step_t *st,
                                  const duet_cuda_kda_layer_t *ly, const duet_cuda_kda_weights_t *w,
                                  const float *proj, const float *gate, float *qkv, float *g,
                                  float *beta, float *o, void *ob, void *scratch);

#ifdef __cplusplus
}
#endif

#endif
