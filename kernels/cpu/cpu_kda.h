/*
 * cpu_kda.h: the KDA mixer's sequence-dependent parts on the CPU (docs/model.md, "KDA mixer"), the
 * reference that kernels/cuda/cuda_kda.h is tested against. Everything is fp32 and on the host.
 *
 * Two levels:
 *  - one head of one sequence: the recurrent and the chunked form of the delta-rule core
 *    (duet_cpu_kda_recurrent / duet_cpu_kda_chunked), which compute the same function; the
 *    chunked one is the prefill path;
 *  - a whole step (every item of a batch, every head) on the thread pool: conv, prep, core, out,
 *    in that order, as the CUDA kernels of the same names. Rows are laid out as on the GPU:
 *    proj / qkv [n_rows][3*H*K] (q | k | v), g [n_rows][H*K], beta [n_rows][H], gate and o
 *    [n_rows][H*K].
 *
 * Batch invariance (docs/architecture.md): an item's results depend only on its own rows, state
 * and, for the core, on its own token count (one token: recurrent; more: chunked, 64-token chunks
 * counted from its first row); never on the other items or the thread count.
 *
 * Verify items (speculative decoding, cpu_step.h) always take the recurrent form, row after row,
 * on a copy of S, with the conv reading the committed window: each row comes out bit for bit as
 * a one-token step after the rows before it would give it. Their pre-conv projections and their
 * k, v, g, β go to the item's replay block (common/cache_layout.h); duet_cpu_kda_replay later runs
 * the same recurrence over the accepted rows on S itself and rebuilds the windows from the
 * projections, so S and the windows end as the one-token steps would have left them, bit for bit.
 */
#ifndef DUET_KERNELS_CPU_KDA_H
#define DUET_KERNELS_CPU_KDA_H

#include <stdint.h>

#include "common/cache_layout.h"
#include "kernels/cpu/cpu_step.h"
#include "kernels/kernels.h"

#define DUET_KDA_CHUNK 64

/* ---- one head -------------------------------------------------------------------------------- */

/*
 * Inputs are the per-token vectors after the short conv, SiLU, L2 normalisation and query scaling:
 * q, k, g of K values, v of V values, beta a scalar. Rows of token t are at `x + t * stride` so the
 * caller can pass one head's columns of a [T, H*K] matrix. The state S (K x V, row i = key channel
 * i) is updated in place and on return is the state after the last token.
 */
typedef struct {
    const float *q;
    int64_t q_stride; /* [n][K] */
    const float *k;
    int64_t k_stride; /* [n][K] */
    const float *v;
    int64_t v_stride; /* [n][V] */
    const float *g;
    int64_t g_stride; /* [n][K] log-decay, <= 0 */
    const float *beta;
    int64_t beta_stride; /* [n] */
    float *o;
    int64_t o_stride; /* [n][V] output */
    int64_t n, K, V;
} duet_cpu_kda_head_io_t;

/* Token-by-token recurrence. */
void duet_cpu_kda_recurrent(const duet_cpu_kda_head_io_t *io, float *S);

/* Floats of scratch duet_cpu_kda_chunked needs for head sizes K, V. */
int64_t duet_cpu_kda_chunk_scratch_floats(int64_t K, int64_t V);

/* Chunked (WY/UT) form, chunks of DUET_KDA_CHUNK tokens; `scratch` has
 * duet_cpu_kda_chunk_scratch_floats(K, V) floats. */
void duet_cpu_kda_chunked(const duet_cpu_kda_head_io_t *io, float *S, float *scratch);

/* ---- a step ---------------------------------------------------------------------------------- */

/* One KDA layer's view of the state pool (the host pool's memory and layout) and of the replay
 * pool. H, K, W are the layout's heads, head_dim, conv_kernel; the layouts' elem_bytes must be 4,
 * the replay layout's heads and head_dim the state layout's. */
typedef struct {
    void *kda_base; /* the KDA pool */
    duet_kda_layout_t layout;
    int64_t layer;     /* this KDA layer's index among KDA layers */
    void *replay_base; /* the replay pool (block of slot i = the item's KDA slot); NULL when the
                          step has no verify items nor replays */
    duet_replay_layout_t replay; /* its layout */
} duet_cpu_kda_layer_t;

/* Floats of per-thread scratch duet_cpu_kda_core needs for verify items and duet_cpu_kda_replay
 * needs (a copy of one head's S and one output row), for head size K = V. */
int64_t duet_cpu_kda_verify_scratch_floats(int64_t K);

/*
 * Fold every item's st->item_replay[i] accepted rows (rows 0.. of its replay block) into its
 * state: the recurrent form over their k, v, g, β on S in the pool, then the conv windows keep the
 * last W-1 of (window, the rows' pre-conv projections). Items without replay rows are left alone;
 * does nothing when st->item_replay is NULL. scratch: as duet_cpu_kda_core's, each block at least
 * duet_cpu_kda_verify_scratch_floats(K) floats.
 */
void duet_cpu_kda_replay(duet_kernels_t *k, const duet_cpu_step_t *st,
                         const duet_cpu_kda_layer_t *ly, float *scratch,
                         int64_t scratch_per_thread);

/*
 * Causal depthwise conv + SiLU of every item's rows: qkv[row][ch] = SiLU(Σ_j taps[ch][j] ·
 * u[t - (W-1) + j][ch]) where u is the item's conv window (its W-1 earlier pre-conv inputs)
 * followed by its proj rows; then the window keeps the last W-1 pre-conv inputs, except for a
 * verify item, whose window stays and whose proj rows go to its replay rows. taps: fp32
 * [3*H*K][W]; W <= 64 (model_config.c refuses more).
 */
void duet_cpu_kda_conv(duet_kernels_t *k, const duet_cpu_step_t *st, const duet_cpu_kda_layer_t *ly,
                       const float *taps, const float *proj, float *qkv);

/*
 * Per row: g[i] = neg_A[i / K] · softplus(g[i] + dt_bias[i]) (in place), beta = σ(beta) (in
 * place), q and k of every head L2-normalised (eps 1e-6 inside the sqrt), q also scaled by K^-1/2
 * (in place in qkv). neg_A: [H] = -exp(A_log); dt_bias: [H*K].
 */
void duet_cpu_kda_prep(duet_kernels_t *k, int64_t n_rows, int64_t H, int64_t K, const float *neg_A,
                       const float *dt_bias, float *qkv, float *g, float *beta);

/*
 * The delta-rule core of every (item, head): reads q, k, v from qkv, g, beta; writes o; updates
 * the item's state S in the pool. Items of one new token take the recurrent form, longer ones the
 * chunked form. A verify item takes the recurrent form on a copy of S (the pool's stays) and
 * writes its rows' k, v, g, β to its replay rows. scratch: duet_kernels_n_threads(k) blocks of
 * scratch_per_thread >= duet_cpu_kda_chunk_scratch_floats(K, K) floats (and >=
 * duet_cpu_kda_verify_scratch_floats(K) with verify items), one per pool thread.
 */
void duet_cpu_kda_core(duet_kernels_t *k, const duet_cpu_step_t *st, const duet_cpu_kda_layer_t *ly,
                       const float *qkv, const float *g, const float *beta, float *o,
                       float *scratch, int64_t scratch_per_thread);

/* o[row][h*K + d] = o_norm[d] · o / sqrt(mean_d(o²) + eps) · σ(gate[row][h*K + d]), in place. */
void duet_cpu_kda_out(duet_kernels_t *k, int64_t n_rows, int64_t H, int64_t K, const float *o_norm,
                      float eps, const float *gate, float *o);

#endif
