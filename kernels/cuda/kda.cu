/*
 * kda.cu: the KDA mixer's sequence-dependent kernels (cuda_kda.h has the contract; the CPU
 * reference is kernels/cpu/kda.c).
 *
 * conv: one thread per (channel, run of consecutive rows) slides the last W-1 inputs along in
 *   registers (starting from the item's window), so runs are independent of each other and
 *   each input is read once. A second launch then rolls each (item, channel) window
 *   forward: a separate kernel because the first one still reads the old windows. Verify
 *   items' windows stay; the conv itself stores their inputs to their replay rows.
 * prep / out: one warp per (row, head); lanes stride over the head's K channels. Where the conv
 *   runs four channels per thread at K = 128 (a warp: one head's q, k or v), duet_cuda_kda_chain's
 *   conv normalises q and k itself, to the bit as prep would, and prep takes only g and β: one
 *   pass over q and k less.
 * core, recurrent (items of one token, the decode path): the state is the traffic, 64 KiB per
 *   head at K = V = 128. Column x of S evolves on its own (o[x], the delta u[x] and S[:, x] only
 *   need column x plus the shared q, k, g), so a block of 32 columns x 8 row groups loads each
 *   element of S once into a register, decays it, forms the two column sums Σ S k and Σ S q
 *   (8-way shared-memory reduction), and writes S back once: o = Σ_d S'[d] q[d] + u (k·q).
 * core, chunked (items of 2+ tokens), chunks of 64 tokens, in two kernels:
 *   - ahead (duet__kda_wy_kernel): everything that does not depend on the state, for every
 *     chunk in parallel, one block per (item, chunk) × head, into the caller's scratch:
 *     Γ     cumulative log-decay, stored in log2 units so every decay is one ex2;
 *     L     L[i][j] = -β_i Σ_d k_i k_j e^{Γi−Γj} (j < i), Aqk[i][j] = Σ_d q_i k_j e^{Γi−Γj}
 *           (j <= i): each pairwise decay is exp2 of a *difference* Γi − Γj <= 0 (clamped to <= 0
 *           so the masked j > i half cannot overflow either), never a ratio of exponentials,
 *           the property kernels/cpu/kda.c's header asks for (e^{Γ} alone underflows within a
 * chunk); when j lies in an earlier 16-row sub-chunk than i, as the product of two such differences
 * through the last row of j's sub-chunk (duet__kda_chunk_kr), so that the exponentials are per
 * (row, channel) there, not per (pair, channel); Qe = e^Γ ⊙ Q,  Kd = e^{Γlast−Γ} ⊙ K,  and with T =
 * (I − L)^{-1}  U = T (β V),  Wt = T (β e^Γ ⊙ K), by forward substitution down the chunk's rows,
 * one column of a right-hand side per thread (T itself is never formed);
 *   - sequential (duet__kda_seq_kernel): one block per (item, head, 32 columns of S), the
 *     block's columns of S in shared memory for the whole item, per chunk in order
 *     V_new = U − Wt S,    O = Qe S + Aqk V_new,    S ← e^{Γlast} S + Kdᵀ V_new:
 *     three small products spread over 16 warps, where the chunk loop used to carry the
 *     triangular solve on 4 warps per block (kernels/cpu/kda.c's U − W S = T(βV) − T(βe^Γ K) S,
 *     there with T applied once, to Y = βV − W S; the same algebra, rounded differently).
 *     duet__kda_seq_tc_kernel does the same three products on the tensor cores, as tf32 products
 *     of split fp32 values or of the values rounded to tf32 (the layer's `tc`; the engine takes
 *     the rounded form for BF16 compute).
 *     Measured: bench/RESULTS.md, "KDA chunked core: ahead and sequential kernels".
 *   Γ is an fp32 running sum, so a decay carries an absolute error of about |Γ|·2^-24 in its
 *   exponent (as in the usual chunked GPU kernels); the CPU's products of per-token decays do
 *   not, which is where the two differ most when decays are large within a chunk.
 * The core's kernels are templated on K (16, 32, ..., 128) so the register arrays are static.
 * chain, decode (duet_cuda_kda_chain with one token per item): at batch 1 the five kernels above
 *   are mostly launch and dependency latency for ~2 MB, so one kernel does all of it: a
 *   thread-block cluster per (item, head), one block per 32-channel slice (the recurrent
 *   kernel's blocks), exchanging the head's q, k, g and then o through distributed shared memory
 *   so each block can take the head-wide norms. Prefill and large decode batches (over
 *   DUET_KDA_FUSED_MAX_CLUSTERS (item, head) pairs) keep the separate kernels.
 * chain, verify (speculative decoding: verify items beside one-token items, at most
 *   DUET_KDA_VERIFY_MAX_CLUSTERS pairs): the same layout in one kernel, each cluster taking its
 *   item's rows in turn on a register copy of S (duet__kda_verify_chain_kernel).
 * Every kernel launches with programmatic dependent launch (cuda_pdl.cuh): before its wait it
 * only reads weights and the step's metadata, and prefetches the state S into L2 (only this
 * layer's core writes S, and a prefetch cannot return stale data); the chain instead loads its
 * columns of S and its conv windows into registers before its wait (duet__kda_decode_kernel).
 */
#include <stdlib.h>

#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_async.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_kda.h"
#include "kernels/cuda/cuda_mma.cuh"
#include "kernels/cuda/cuda_pdl.cuh"
#include "kernels/cuda/cuda_util.h"

#define DUET__MODULE          "cuda kda" /* the prefix of this file's error details */
#define DUET__TRY(call, what) DUET_CUDA_TRY(call, DUET__MODULE, what)

#define DUET_KDA_C           64  /* chunk length, kernels/cpu/cpu_kda.h DUET_KDA_CHUNK */
#define DUET_KDA_SEQ_THREADS 512 /* 16 warps: 4 quarters of d x 4 groups of 16 rows */
#define DUET_KDA_SEQ_COLS    32  /* columns of S (and of v, o) per block: one per lane */
#define DUET_KDA_MAX_K       128
#define DUET_KDA_MAX_W       8
#define DUET_KDA_L2_EPS      1e-6f /* kernels/cpu/kda.c DUET_L2_EPS */
#define DUET_LOG2E           1.4426950408889634f
/* The chain fuses a decode step only up to this many (item, head) clusters: its blocks live
 * longer (three cluster barriers, serial phases), so once there are many waves the state streams
 * more slowly than in the recurrent kernel (bench/RESULTS.md, "KDA decode chain: one kernel up
 * to 768 (item, head) pairs"). */
#define DUET_KDA_FUSED_MAX_CLUSTERS 768
/* The most rows of a verify item the verify chain kernel takes: drafts + 1 at engine/spec.h's
 * DUET_SPEC_MAX_K = 8. More replay rows per slot than this keep the separate kernels. */
#define DUET_KDA_VERIFY_ROWS 9
/* ... and the most (item, head) clusters: its rows run one after another in each cluster, which
 * pays while the separate kernels are mostly latency, at one or two items of 32 heads, not from
 * four on (bench/RESULTS.md, "KDA verify chain: one kernel for one or two items"). */
#define DUET_KDA_VERIFY_MAX_CLUSTERS 64

/* ---- argument checks ---------------------------------------------------------------------- */

/* Shapes every kernel here supports; the core also needs K % 16 == 0 (checked where used). */
static duet_status_t duet__kda_check(const duet_cuda_kda_layer_t *ly, const char *what)
{
    if (ly == NULL || ly->kda_base == NULL || ly->H < 1 || ly->K < 1 || ly->W < 1 ||
        ly->layer < 0 || ly->layer >= ly->kda_n_layers ||
        ly->kda_layer_floats < ly->H * ly->K * ly->K + 3 * ly->H * ly->K * (ly->W - 1))
        return duet_error_set(DUET_ERR_INVALID, "cuda kda %s: bad layer description", what);
    if (ly->tc != DUET_CUDA_KDA_FMA && ly->tc != DUET_CUDA_KDA_TC_SPLIT &&
        ly->tc != DUET_CUDA_KDA_TC_ONE)
        return duet_error_set(DUET_ERR_INVALID, "cuda kda %s: tc = %d is no duet_cuda_kda_tc_t",
                              what, ly->tc);
    if (ly->K > DUET_KDA_MAX_K || ly->W > DUET_KDA_MAX_W)
        return duet_error_set(DUET_ERR_UNSUPPORTED,
                              "cuda kda %s: K = %lld, W = %lld (supported: K <= %d, W <= %d)", what,
                              (long long)ly->K, (long long)ly->W, DUET_KDA_MAX_K, DUET_KDA_MAX_W);
    return DUET_OK;
}

/* Test hook (tests/unit/test_cuda_kda.c): nonzero runs the general conv kernel (one channel per
 * thread, W read at run time). */
static int duet__kda_conv_scalar = 0;

extern "C" void duet__cuda_kda_conv_scalar(int on)
{
    duet__kda_conv_scalar = on;
}

/* Test hooks: nonzero runs duet_cuda_kda_chain as its separate kernels at every step; how many
 * verify chain kernels have been launched (so a test knows which path it compared). */
static int duet__kda_fused_off = 0;
static long duet__kda_verify_chains = 0;

extern "C" void duet__cuda_kda_fused_off(int on)
{
    duet__kda_fused_off = on;
}

extern "C" long duet__cuda_kda_verify_chains(void)
{
    return __atomic_load_n(&duet__kda_verify_chains, __ATOMIC_RELAXED);
}

/* Test hook: nonzero leaves q and k of duet_cuda_kda_chain's separate kernels to prep. */
static int duet__kda_conv_norm_off = 0;

extern "C" void duet__cuda_kda_conv_norm_off(int on)
{
    duet__kda_conv_norm_off = on;
}

static unsigned duet__blocks(int64_t n, int per_block, int64_t cap)
{
    int64_t b = (n + per_block - 1) / per_block;
    return (unsigned)(b < 1 ? 1 : (b > cap ? cap : b));
}

/* ---- small device helpers ----------------------------------------------------------------- */

__device__ static inline float duet__sigmoid(float x)
{
    return 1.0f / (1.0f + expf(-x));
}

__device__ static inline float duet__silu(float x)
{
    return x / (1.0f + expf(-x));
}

/* One conv output: SiLU(Σ_j tp[j] · u[j] + tlast · x) over the W - 1 earlier inputs u and the
 * new input x (N >= W - 1 slots, those past W - 2 ignored), in the CPU loop's order. The conv
 * kernel and the decode chain both call it, so the chain's conv is the conv kernel's bit for
 * bit. */
template <int N>
__device__ static inline float duet__kda_conv_out(const float (&tp)[N], const float (&u)[N],
                                                  float tlast, float x, int64_t W)
{
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < N; j++)
        if (j < W - 1)
            acc += tp[j] * u[j];
    acc += tlast * x;
    return duet__silu(acc);
}

__device__ static inline float duet__softplus(float x)
{
    return x > 20.0f ? x : log1pf(expf(x));
}

/* 2^x with one MUFU instruction (relative error ~2^-22; results below 2^-126 flush to 0, which
 * only happens where the true decay is already negligible). */
__device__ static inline float duet__ex2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* A hint that the 128-byte line at p will be read soon: it is fetched into L2. Never changes
 * what a later load returns (L2 is where global memory is coherent), so it may target data an
 * earlier kernel is still writing. */
__device__ static inline void duet__prefetch_l2(const float *p)
{
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

__device__ static inline float duet__warp_sum(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* What prep multiplies a head's q (part 0) or k (part 1) by, from the head's sum of squares:
 * every path that normalises q and k takes its sum in prep's order (lane l adds d = l, l + 32,
 * ... in turn, then duet__warp_sum) and this factor, so that they agree to the bit. */
__device__ static inline float duet__kda_l2_factor(float ss, int part, int64_t K)
{
    float inv = 1.0f / sqrtf(ss + DUET_KDA_L2_EPS);
    if (part == 0)
        inv *= 1.0f / sqrtf((float)K);
    return inv;
}

/* The KDA layer block of (slot, layer): S [H][K][V], then the windows [3*H*K][W-1]. */
__device__ static inline float *duet__kda_block(const duet_cuda_kda_layer_t &ly, int32_t slot)
{
    return ly.kda_base + ((int64_t)slot * ly.kda_n_layers + ly.layer) * ly.kda_layer_floats;
}

/* Row `row` of (slot, KDA layer `layer`)'s replay block: [proj 3HK | k HK | v HK | g HK | β H]
 * (common/cache_layout.h, DUET_REPLAY_FIELD_*). */
__device__ static inline float *duet__kda_replay_row(const duet_cuda_kda_layer_t &ly, int32_t slot,
                                                     int64_t layer, int64_t row)
{
    const int64_t RF = 6 * ly.H * ly.K + ly.H;
    return ly.replay_base + (((int64_t)slot * ly.kda_n_layers + layer) * ly.replay_rows + row) * RF;
}

__device__ static inline bool duet__kda_is_verify(const duet_cuda_step_t &st, int64_t it)
{
    return st.item_verify != NULL && st.item_verify[it] != 0;
}

/* ---- conv --------------------------------------------------------------------------------- */

/* qkv[row][ch] = SiLU(Σ_j taps[ch][j] · u[t-(W-1)+j][ch]); u is the window then the item's rows.
 * Summation order j = 0..W-1, as the CPU loop. A thread runs down R consecutive rows of VEC
 * adjacent channels (VEC = 4: 16-byte loads and stores; the launch checks alignment) with the
 * last W-1 inputs in registers, so each input is loaded once and the row's item is looked up
 * only when the rows cross into the next item (R = 1 for decode batches, where every row is its
 * own item and parallelism matters more). The arrays are sized for W = WC, or for W <= 8 when
 * WC = 0 (W read at run time; positions past W-2 ignored), and indexed statically: sized for
 * 8, a thread holds 14 more registers per channel, which cost warps per SM and so loads in
 * flight (bench/RESULTS.md, "KDA conv: registers for W = 4, four channels per thread"). Each
 * channel's arithmetic is the same whatever VEC and WC. A verify item's inputs are stored to its
 * replay rows here too (RP), so a step whose items all verify needs no window kernel. */
#ifndef DUET_KDA_CONV_AHEAD
/* A thread's rows whose inputs it loads before using any, so that their round trips overlap
 * (bench/RESULTS.md, "KDA conv: four rows' inputs loaded ahead"). */
#define DUET_KDA_CONV_AHEAD 4
#endif

/* VEC consecutive floats at p (16-byte aligned when VEC = 4) into v. */
template <int VEC> __device__ static inline void duet__kda_ldv(const float *p, float (&v)[VEC])
{
    if constexpr (VEC == 4) {
        const float4 x = *reinterpret_cast<const float4 *>(p);
        v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
    } else {
#pragma unroll
        for (int c = 0; c < VEC; c++)
            v[c] = p[c];
    }
}

/* NORM (VEC = 4, K = 128: a warp's 128 channels are one head's q, k or v): each row's q and k
 * leave normalised as prep would leave them, bit for bit (duet__kda_l2_factor); lane m forms
 * prep's lane-m sum from channels m, m + 32, m + 64, m + 96, which lanes m/4 + 8j hold. */
template <int VEC> __device__ static inline void duet__kda_conv_norm(float (&y)[VEC], int part)
{
    static_assert(VEC == 4, "one head of 128 channels per warp");
    const int lane = threadIdx.x & 31, src = lane >> 2, c = lane & 3;
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const float a0 = __shfl_sync(0xffffffffu, y[0], src + 8 * j);
        const float a1 = __shfl_sync(0xffffffffu, y[1], src + 8 * j);
        const float a2 = __shfl_sync(0xffffffffu, y[2], src + 8 * j);
        const float a3 = __shfl_sync(0xffffffffu, y[3], src + 8 * j);
        const float x = c == 0 ? a0 : c == 1 ? a1 : c == 2 ? a2 : a3;
        ss += x * x;
    }
    const float inv = duet__kda_l2_factor(duet__warp_sum(ss), part, 128);
#pragma unroll
    for (int k = 0; k < VEC; k++)
        y[k] *= inv;
}

template <int VEC, int WC, bool NORM, bool RP>
__device__ static __forceinline__ void
duet__kda_conv_body(const duet_cuda_step_t &st, const duet_cuda_kda_layer_t &ly,
                    const float *__restrict__ taps, const float *__restrict__ proj,
                    float *__restrict__ qkv, int R)
{
    constexpr int WM = WC > 0 ? WC - 1 : DUET_KDA_MAX_W - 1; /* the window's registers */
    const int64_t C3 = 3 * ly.H * ly.K, W = WC > 0 ? WC : ly.W, HKK = ly.H * ly.K * ly.K;
    const int64_t ch0 = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    const bool on = ch0 < C3;      /* VEC divides C3 */
    float tp[VEC][WM], tlast[VEC]; /* weights: loaded ahead of the wait */
#pragma unroll
    for (int c = 0; c < VEC; c++) {
#pragma unroll
        for (int j = 0; j < WM; j++)
            tp[c][j] = on && j < W - 1 ? taps[(ch0 + c) * W + j] : 0.0f;
        tlast[c] = on ? taps[(ch0 + c) * W + W - 1] : 0.0f;
    }
    duet_pdl_wait(); /* proj */
    duet_pdl_trigger();
    if (!on)
        return;
    for (int64_t ra = (int64_t)blockIdx.y * R; ra < st.n_rows; ra += (int64_t)gridDim.y * R) {
        const int64_t rb = ra + R < st.n_rows ? ra + R : st.n_rows;
        int32_t it = st.row_item[ra];
        int64_t r0 = st.item_row0[it], r1 = st.item_row0[it + 1];
        const float *win = duet__kda_block(ly, st.item_slot[it]) + HKK + ch0 * (W - 1);
        bool ver = RP && duet__kda_is_verify(st, it); /* its inputs go to its replay rows */
        float u[VEC][WM]; /* u[c][j]: channel c's input at t-(W-1)+j for the next row t */
#pragma unroll
        for (int j = 0; j < WM; j++) {
            const int64_t tau = (ra - r0) - (W - 1) + j;
            if (j < W - 1 && tau >= 0) { /* a row of the item: VEC channels in one load */
                float xj[VEC];
                duet__kda_ldv<VEC>(proj + (r0 + tau) * C3 + ch0, xj);
#pragma unroll
                for (int c = 0; c < VEC; c++)
                    u[c][j] = xj[c];
            } else {
#pragma unroll
                for (int c = 0; c < VEC; c++)
                    u[c][j] = j < W - 1 ? win[c * (W - 1) + (W - 1) + tau] : 0.0f;
            }
        }
        for (int64_t rg = ra; rg < rb; rg += DUET_KDA_CONV_AHEAD) {
            /* the group's inputs first, all in flight together: they do not depend on the
             * items, only the windows do */
            float xg[DUET_KDA_CONV_AHEAD][VEC];
#pragma unroll
            for (int g = 0; g < DUET_KDA_CONV_AHEAD; g++) {
                if (rg + g < rb)
                    duet__kda_ldv<VEC>(proj + (rg + g) * C3 + ch0, xg[g]);
                else
#pragma unroll
                    for (int c = 0; c < VEC; c++)
                        xg[g][c] = 0.0f;
            }
#pragma unroll
            for (int g = 0; g < DUET_KDA_CONV_AHEAD; g++) {
                const int64_t row = rg + g;
                if (row >= rb)
                    break;
                if (row >= r1) { /* the next item starts here: its inputs so far are its window */
                    do {
                        it++;
                        r0 = r1;
                        r1 = st.item_row0[it + 1];
                    } while (row >= r1);
                    win = duet__kda_block(ly, st.item_slot[it]) + HKK + ch0 * (W - 1);
                    ver = RP && duet__kda_is_verify(st, it);
#pragma unroll
                    for (int c = 0; c < VEC; c++)
#pragma unroll
                        for (int j = 0; j < WM; j++)
                            u[c][j] = j < W - 1 ? win[c * (W - 1) + j] : 0.0f;
                }
                if (RP && ver) { /* (rows of RF floats: 4-byte aligned only) */
                    float *rr = duet__kda_replay_row(ly, st.item_slot[it], ly.layer, row - r0);
#pragma unroll
                    for (int c = 0; c < VEC; c++)
                        rr[ch0 + c] = xg[g][c];
                }
                float y[VEC];
#pragma unroll
                for (int c = 0; c < VEC; c++) {
                    const float x = xg[g][c];
                    y[c] = duet__kda_conv_out(tp[c], u[c], tlast[c], x, W);
#pragma unroll
                    for (int j = 0; j < WM; j++)
                        u[c][j] = j == W - 2 ? x : (j + 1 < WM ? u[c][j + 1] : u[c][j]);
                }
                if constexpr (NORM) /* (the part is the same for the whole warp) */
                    if (ch0 < 2 * C3 / 3)
                        duet__kda_conv_norm<VEC>(y, ch0 < C3 / 3 ? 0 : 1);
                if constexpr (VEC == 4)
                    *reinterpret_cast<float4 *>(qkv + row * C3 + ch0) =
                        make_float4(y[0], y[1], y[2], y[3]);
                else
#pragma unroll
                    for (int c = 0; c < VEC; c++)
                        qkv[row * C3 + ch0 + c] = y[c];
            }
        }
    }
}

template <int VEC, int WC, bool RP>
__global__ static void
duet__kda_conv_kernel(duet_cuda_step_t st, duet_cuda_kda_layer_t ly, const float *__restrict__ taps,
                      const float *__restrict__ proj, float *__restrict__ qkv, int R)
{
    duet__kda_conv_body<VEC, WC, false, RP>(st, ly, taps, proj, qkv, R);
}

/* The fast kernel with NORM, its registers capped so that three blocks fit on an SM (the
 * shuffles would otherwise leave room for two) */
template <bool RP>
__global__ static void __launch_bounds__(256, 3)
    duet__kda_conv_norm_kernel(duet_cuda_step_t st, duet_cuda_kda_layer_t ly,
                               const float *__restrict__ taps, const float *__restrict__ proj,
                               float *__restrict__ qkv, int R)
{
    duet__kda_conv_body<4, 4, true, RP>(st, ly, taps, proj, qkv, R);
}

/* The new window of (item, channel) is concat(window, inputs)[n .. n+W-1). A verify item's
 * window stays (the conv kernels wrote its inputs to its replay rows). */
__global__ static void duet__kda_window_kernel(duet_cuda_step_t st, duet_cuda_kda_layer_t ly,
                                               const float *proj)
{
    const int64_t C3 = 3 * ly.H * ly.K, W = ly.W;
    const int64_t ch = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    duet_pdl_wait(); /* the conv kernel still reads the old windows */
    duet_pdl_trigger();
    if (ch >= C3)
        return;
    for (int64_t it = blockIdx.y; it < st.n_items; it += gridDim.y) {
        const int64_t r0 = st.item_row0[it], n = st.item_row0[it + 1] - r0;
        if (duet__kda_is_verify(st, it))
            continue;
        float *win = duet__kda_block(ly, st.item_slot[it]) + ly.H * ly.K * ly.K + ch * (W - 1);
        float old[DUET_KDA_MAX_W];
        for (int64_t j = 0; j < W - 1; j++)
            old[j] = win[j];
        for (int64_t j = 0; j < W - 1; j++) {
            const int64_t i = n + j;
            win[j] = i < W - 1 ? old[i] : proj[(r0 + i - (W - 1)) * C3 + ch];
        }
    }
}

/* duet_cuda_kda_conv; with norm, where the fast kernel runs at K = 128 it also normalises q and
 * k as prep would (NORM) and sets *normed. */
static duet_status_t duet__kda_conv(cudaStream_t stream, const duet_cuda_step_t *st,
                                    const duet_cuda_kda_layer_t *ly, const float *taps,
                                    const float *proj, float *qkv, bool norm, bool *normed)
{
    *normed = false;
    duet_status_t s = duet__kda_check(ly, "conv");
    if (s != DUET_OK)
        return s;
    if (st == NULL || st->n_items < 0 || st->n_rows < 0)
        return duet_error_set(DUET_ERR_INVALID, "cuda kda conv: bad step");
    if (st->n_rows == 0 || st->n_items == 0)
        return DUET_OK;
    const int th = 256;
    const int64_t C3 = 3 * ly->H * ly->K;
    const int R = st->n_rows >= 4096 ? 16 : st->n_rows >= 256 ? st->n_rows / 256 : 1;
    /* Kimi Linear's W = 4 with registers for 4, four channels per thread where the rows allow
     * 16-byte accesses; any other W (and the test hook) the general kernel */
    const bool fast = !duet__kda_conv_scalar && ly->W == 4 && C3 % 4 == 0 &&
                      (((uintptr_t)proj | (uintptr_t)qkv) & 15) == 0;
    dim3 grid(duet__blocks(fast ? C3 / 4 : C3, th, 1 << 30), duet__blocks(st->n_rows, R, 65535));
    /* RP: the variants that also store verify items' inputs to their replay rows (only verify
     * steps take them: the pointer arithmetic costs the others registers) */
    auto go = [&](auto rp) {
        constexpr bool RP = decltype(rp)::value;
        if (fast && norm && ly->K == 128 && !duet__kda_conv_norm_off) {
            *normed = true;
            return duet_pdl_launch(duet__kda_conv_norm_kernel<RP>, grid, dim3(th), 0, stream, *st,
                                   *ly, taps, proj, qkv, R);
        }
        if (fast)
            return duet_pdl_launch(duet__kda_conv_kernel<4, 4, RP>, grid, dim3(th), 0, stream, *st,
                                   *ly, taps, proj, qkv, R);
        return duet_pdl_launch(duet__kda_conv_kernel<1, 0, RP>, grid, dim3(th), 0, stream, *st, *ly,
                               taps, proj, qkv, R);
    };
    DUET__TRY(st->any_verify ? go(std::true_type{}) : go(std::false_type{}), "conv launch");
    if (ly->W > 1 && !st->all_verify) { /* windows to roll */
        dim3 wgrid(duet__blocks(C3, th, 1 << 30), duet__blocks(st->n_items, 1, 65535));
        DUET__TRY(
            duet_pdl_launch(duet__kda_window_kernel, wgrid, dim3(th), 0, stream, *st, *ly, proj),
            "conv window launch");
    }
    return DUET_OK;
}

extern "C" duet_status_t duet_cuda_kda_conv(cudaStream_t stream, const duet_cuda_step_t *st,
                                            const duet_cuda_kda_layer_t *ly, const float *taps,
                                            const float *proj, float *qkv)
{
    bool normed;
    return duet__kda_conv(stream, st, ly, taps, proj, qkv, false, &normed);
}

/*
 * f(std::integral_constant<int, k>()) for k = K: the one list of the head sizes the templated
 * kernels are built for (multiples of 16 up to DUET_KDA_MAX_K); other() for any other K.
 */
template <typename F, typename G> static auto duet__kda_with_k(int64_t K, F &&f, G &&other)
{
    static_assert(DUET_KDA_MAX_K == 128, "the list below ends at DUET_KDA_MAX_K");
    switch (K) {
    case 16:
        return f(std::integral_constant<int, 16>());
    case 32:
        return f(std::integral_constant<int, 32>());
    case 48:
        return f(std::integral_constant<int, 48>());
    case 64:
        return f(std::integral_constant<int, 64>());
    case 80:
        return f(std::integral_constant<int, 80>());
    case 96:
        return f(std::integral_constant<int, 96>());
    case 112:
        return f(std::integral_constant<int, 112>());
    case 128:
        return f(std::integral_constant<int, 128>());
    default:
        return other();
    }
}

/* The launchers' other(): a K that their checks let through, which no kernel is built for. */
static duet_status_t duet__kda_no_k(int64_t K)
{
    return duet_error_set(DUET_ERR_UNSUPPORTED, "cuda kda: no kernel for K = %lld", (long long)K);
}

/* ---- prep --------------------------------------------------------------------------------- */

/* A lane's elements of a row of K <= DUET_KDA_MAX_K floats: d = lane + 32j for j < this. */
#define DUET__KDA_LANE_N (DUET_KDA_MAX_K / 32)

/* Lane `lane`'s elements d = lane + 32j < K of a row into v (0 past K), all loads in flight
 * together: the row kernels below load a row's inputs before any store, instead of one round
 * trip per element behind stores the compiler cannot move them past. */
__device__ static __forceinline__ void duet__kda_lane_row(const float *p, int lane, int64_t K,
                                                          float (&v)[DUET__KDA_LANE_N])
{
#pragma unroll
    for (int j = 0; j < DUET__KDA_LANE_N; j++)
        v[j] = lane + 32 * j < K ? p[lane + 32 * j] : 0.0f;
}

/* Rows a prep warp loads before it stores any (its rows' g rows in flight together). */
#define DUET__KDA_PREP_ROWS 2

/*
 * g ← −exp(A_log) · softplus(g + dt_bias), β ← σ(β), and with QK q and k L2-normalised, per
 * (row, head). A warp keeps one head (blockIdx.y · warps per block + warp), so
 * its dt_bias and −exp(A_log) are loaded once, and walks the rows blockIdx.x, + gridDim.x, ...
 * DUET__KDA_PREP_ROWS at a time: no division per (row, head), and the next rows' loads in flight
 * while a row's results are formed. QK = false: g and β only (the conv normalised q and k:
 * duet__kda_conv_norm_kernel).
 */
template <bool QK>
__global__ static void duet__kda_prep_kernel(int64_t n_rows, int64_t H, int64_t K,
                                             const float *neg_A, const float *dt_bias, float *qkv,
                                             float *g, float *beta)
{
    constexpr int N = DUET__KDA_LANE_N, RW = DUET__KDA_PREP_ROWS;
    const int lane = threadIdx.x & 31;
    const int64_t HK = H * K, C3 = 3 * HK;
    const int64_t h = (int64_t)blockIdx.y * (blockDim.x / 32) + threadIdx.x / 32;
    float bv[N], nA = 0.0f;
    if (h < H) { /* weights: loaded before the wait */
        duet__kda_lane_row(dt_bias + h * K, lane, K, bv);
        nA = neg_A[h];
    }
    duet_pdl_wait(); /* qkv, g, beta */
    duet_pdl_trigger();
    if (h >= H)
        return;
    for (int64_t r0 = (int64_t)blockIdx.x * RW; r0 < n_rows; r0 += (int64_t)gridDim.x * RW) {
        float gv[RW][N];
#pragma unroll
        for (int i = 0; i < RW; i++)
            if (r0 + i < n_rows)
                duet__kda_lane_row(g + (r0 + i) * HK + h * K, lane, K, gv[i]);
#pragma unroll
        for (int i = 0; i < RW; i++) {
            const int64_t row = r0 + i;
            if (row >= n_rows)
                break;
            float *gr = g + row * HK + h * K;
#pragma unroll
            for (int j = 0; j < N; j++)
                if (lane + 32 * j < K)
                    gr[lane + 32 * j] = nA * duet__softplus(gv[i][j] + bv[j]);
            if (lane == 0)
                beta[row * H + h] = duet__sigmoid(beta[row * H + h]);
            for (int part = 0; QK && part < 2; part++) {
                float *x = qkv + row * C3 + part * HK + h * K;
                float xv[N], ss = 0.0f;
                duet__kda_lane_row(x, lane, K, xv);
#pragma unroll
                for (int j = 0; j < N; j++)
                    ss += xv[j] * xv[j]; /* 0 past K: the same sum */
                const float inv = duet__kda_l2_factor(duet__warp_sum(ss), part, K);
#pragma unroll
                for (int j = 0; j < N; j++)
                    if (lane + 32 * j < K)
                        x[lane + 32 * j] = xv[j] * inv;
            }
        }
    }
}

/* duet_cuda_kda_prep, with q and k left alone when !qk (the conv normalised them). */
static duet_status_t duet__kda_prep(cudaStream_t stream, int64_t n_rows,
                                    const duet_cuda_kda_layer_t *ly, const float *neg_A,
                                    const float *dt_bias, float *qkv, float *g, float *beta,
                                    bool qk)
{
    if (ly == NULL || ly->H < 1 || ly->K < 1 || n_rows < 0)
        return duet_error_set(DUET_ERR_INVALID, "cuda kda prep: bad arguments");
    if (ly->K > DUET_KDA_MAX_K)
        return duet_error_set(DUET_ERR_UNSUPPORTED, "cuda kda prep: K = %lld (supported: <= %d)",
                              (long long)ly->K, DUET_KDA_MAX_K);
    if (ly->H > 65535 * 8)
        return duet_error_set(DUET_ERR_UNSUPPORTED, "cuda kda prep: H = %lld (supported: <= %d)",
                              (long long)ly->H, 65535 * 8);
    if (n_rows == 0)
        return DUET_OK;
    /* about two waves of blocks, each warp then walking its share of the rows */
    const int th = 256, wpb = th / 32, sms = duet_cuda_sm_count();
    const unsigned gy = (unsigned)((ly->H + wpb - 1) / wpb);
    const int64_t cap = (int64_t)(sms > 0 ? sms : 16) * 16 / gy;
    const dim3 grid(duet__blocks(n_rows, DUET__KDA_PREP_ROWS, cap > 1 ? cap : 1), gy);
    DUET__TRY(duet_pdl_launch(qk ? duet__kda_prep_kernel<true> : duet__kda_prep_kernel<false>, grid,
                              dim3(th), 0, stream, n_rows, ly->H, ly->K, neg_A, dt_bias, qkv, g,
                              beta),
              "prep launch");
    return DUET_OK;
}

extern "C" duet_status_t duet_cuda_kda_prep(cudaStream_t stream, int64_t n_rows,
                                            const duet_cuda_kda_layer_t *ly, const float *neg_A,
                                            const float *dt_bias, float *qkv, float *g, float *beta)
{
    return duet__kda_prep(stream, n_rows, ly, neg_A, dt_bias, qkv, g, beta, true);
}

/* ---- out ---------------------------------------------------------------------------------- */

/* o ← o_norm · RMSNorm(o) · σ(gate) per (row, head), one warp each; with ob the results go
 * there as bf16 instead (duet_cuda_kda_chain's ob) and o is left as it was. */
__global__ static void duet__kda_out_kernel(int64_t n_rows, int64_t H, int64_t K,
                                            const float *o_norm, float eps, const float *gate,
                                            float *o, __nv_bfloat16 *ob)
{
    constexpr int N = DUET__KDA_LANE_N;
    const int lane = threadIdx.x & 31;
    const int64_t warps = (int64_t)gridDim.x * (blockDim.x / 32);
    float nv[N]; /* o_norm: the same for every row */
    duet__kda_lane_row(o_norm, lane, K, nv);
    duet_pdl_wait(); /* o, gate */
    duet_pdl_trigger();
    for (int64_t wi = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; wi < n_rows * H;
         wi += warps) {
        float *x = o + wi * K; /* row * HK + h * K */
        float xv[N], gv[N], ss = 0.0f;
        duet__kda_lane_row(x, lane, K, xv);
        duet__kda_lane_row(gate + wi * K, lane, K, gv);
#pragma unroll
        for (int j = 0; j < N; j++)
            ss += xv[j] * xv[j]; /* 0 past K: the same sum */
        ss = duet__warp_sum(ss);
        const float inv = 1.0f / sqrtf(ss / (float)K + eps);
#pragma unroll
        for (int j = 0; j < N; j++)
            if (lane + 32 * j < K) {
                const float v = nv[j] * (xv[j] * inv) * duet__sigmoid(gv[j]);
                if (ob != NULL) /* (uniform per launch) */
                    ob[wi * K + lane + 32 * j] = __float2bfloat16_rn(v);
                else
                    x[lane + 32 * j] = v;
            }
    }
}

/* duet_cuda_kda_out, into ob as bf16 instead of o in place when ob != NULL (the chain's ob). */
static duet_status_t duet__kda_out(cudaStream_t stream, int64_t n_rows, int64_t H, int64_t K,
                                   const float *o_norm, float eps, const float *gate, float *o,
                                   __nv_bfloat16 *ob)
{
    if (H < 1 || K < 1 || n_rows < 0)
        return duet_error_set(DUET_ERR_INVALID, "cuda kda out: bad arguments");
    if (K > DUET_KDA_MAX_K)
        return duet_error_set(DUET_ERR_UNSUPPORTED, "cuda kda out: K = %lld (supported: <= %d)",
                              (long long)K, DUET_KDA_MAX_K);
    if (n_rows == 0)
        return DUET_OK;
    const int th = 256;
    DUET__TRY(duet_pdl_launch(duet__kda_out_kernel,
                              dim3(duet__blocks(n_rows * H, th / 32, 1 << 20)), dim3(th), 0, stream,
                              n_rows, H, K, o_norm, eps, gate, o, ob),
              "out launch");
    return DUET_OK;
}

extern "C" duet_status_t duet_cuda_kda_out(cudaStream_t stream, int64_t n_rows, int64_t H,
                                           int64_t K, const float *o_norm, float eps,
                                           const float *gate, float *o)
{
    return duet__kda_out(stream, n_rows, H, K, o_norm, eps, gate, o, NULL);
}

/* ---- core: recurrent (items of one token) ------------------------------------------------- */

typedef struct {
    duet_cuda_step_t st;
    duet_cuda_kda_layer_t ly;
    const float *qkv, *g, *beta;
    float *o;
    /* What the chunked form needs of every chunk apart from the state, formed ahead by
     * duet__kda_wy_kernel: [slot][H][duet__kda_wy_layout<K>::FLOATS], slot = duet__kda_wy_slot
     * (the caller's scratch). */
    float *wy;
    int max_chunks; /* of any item: ceil(max_item_tokens / C) */
} duet__kda_core_args_t;

#define DUET_KDA_RY 8 /* row groups of the recurrent kernel's block (32 columns x 8) */

/*
 * One decode step on the rows a thread holds (S[ty + 8r][x], r < RPT) — shared by the recurrent
 * kernel and the decode chain: decay them by se = exp(g), then the column's kv = Σ_d S[d]·k[d]
 * and qs = Σ_d S[d]·q[d] (decayed S) and kq = Σ_d k[d]·q[d], reduced over the block's row
 * groups in a fixed order through red. Ends with every thread holding the three sums.
 */
template <int RPT>
static __device__ __forceinline__ void
duet__kda_decay_dots(float (&s)[RPT], const float *se, const float *sk, const float *sq,
                     float (&red)[3][DUET_KDA_RY][33], int tx, int ty, float *kv, float *qs,
                     float *kq)
{
    float pk = 0.0f, pq = 0.0f, pkq = 0.0f;
#pragma unroll
    for (int r = 0; r < RPT; r++) {
        const int d = ty + DUET_KDA_RY * r;
        s[r] *= se[d];
        pk += s[r] * sk[d];
        pq += s[r] * sq[d];
        pkq += sk[d] * sq[d];
    }
    red[0][ty][tx] = pk;
    red[1][ty][tx] = pq;
    red[2][ty][tx] = pkq;
    __syncthreads();
    float a = 0.0f, b = 0.0f, c = 0.0f;
#pragma unroll
    for (int y = 0; y < DUET_KDA_RY; y++) {
        a += red[0][y][tx];
        b += red[1][y][tx];
        c += red[2][y][tx];
    }
    *kv = a, *qs = b, *kq = c;
}

/* The delta-rule update of the same rows: S[d][x] = s[d] + k[d]·u. */
template <int RPT>
static __device__ __forceinline__ void duet__kda_state_store(float *S, int V, int x, int ty,
                                                             const float (&s)[RPT], const float *sk,
                                                             float u)
{
#pragma unroll
    for (int r = 0; r < RPT; r++) {
        const int d = ty + DUET_KDA_RY * r;
        S[(int64_t)d * V + x] = s[r] + sk[d] * u;
    }
}

/* Block (item·H + h, column slice of 32); thread (tx, ty) holds S[ty + 8r][x], r < K/8. */
template <int K>
__global__ static void __launch_bounds__(32 * DUET_KDA_RY)
    duet__kda_recur_kernel(duet__kda_core_args_t a)
{
    constexpr int V = K, RPT = K / DUET_KDA_RY;
    const int64_t H = a.ly.H, HK = H * K, C3 = 3 * HK;
    const int64_t it = blockIdx.x / H, h = blockIdx.x % H;
    /* The step's metadata is written before the step: it may be read ahead of the wait. */
    const int64_t row = a.st.item_row0[it];
    const bool one = a.st.item_row0[it + 1] - row == 1 && !duet__kda_is_verify(a.st, it);
    __shared__ float sq[K], sk[K], se[K];
    __shared__ float red[3][DUET_KDA_RY][33];
    const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * 32 + tx;
    const int x = blockIdx.y * 32 + tx;
    const bool active = x < V;
    float *S = duet__kda_block(a.ly, a.st.item_slot[it]) + h * K * V;
    if (one && tid < K) /* only this kernel writes S: pull this block's columns towards L2 */
        duet__prefetch_l2(&S[(int64_t)tid * V + blockIdx.y * 32]);
    duet_pdl_wait(); /* qkv, g, beta */
    duet_pdl_trigger();
    if (!one)
        return;
    float s[RPT];
    /* The state loads go out first: they need nothing from the barrier below. */
#pragma unroll
    for (int r = 0; r < RPT; r++)
        s[r] = active ? S[(int64_t)(ty + DUET_KDA_RY * r) * V + x] : 0.0f;
    for (int d = tid; d < K; d += 32 * DUET_KDA_RY) {
        sq[d] = a.qkv[row * C3 + h * K + d];
        sk[d] = a.qkv[row * C3 + HK + h * K + d];
        se[d] = expf(a.g[row * HK + h * K + d]);
    }
    __syncthreads();

    float kv, qs, kq;
    duet__kda_decay_dots<RPT>(s, se, sk, sq, red, tx, ty, &kv, &qs, &kq);
    if (!active)
        return;
    const float u = a.beta[row * H + h] * (a.qkv[row * C3 + 2 * HK + h * K + x] - kv);
    if (ty == 0)
        a.o[row * HK + h * K + x] = qs + u * kq;
    duet__kda_state_store<RPT>(S, V, x, ty, s, sk, u);
}

/*
 * n rows of the recurrence on the block's columns of S, held in s (the recurrent kernel's thread
 * layout), left in s: per row the recurrent kernel's arithmetic, so each row is a one-token step
 * bit for bit. Row t's q, k, v are at q/k/v + t·ls, g at g + t·lg, β at beta[t·lb]; its output
 * to o + t·lo (o NULL: none). Every thread of the block calls it (barriers inside).
 */
template <int K>
static __device__ __forceinline__ void
duet__kda_recur_rows(float (&s)[K / DUET_KDA_RY], int64_t n, const float *q, const float *k,
                     const float *v, int64_t ls, const float *g, int64_t lg, const float *beta,
                     int64_t lb, float *o, int64_t lo, float *sq, float *sk, float *se,
                     float (&red)[3][DUET_KDA_RY][33], int tx, int ty, int x, bool active)
{
    constexpr int RPT = K / DUET_KDA_RY;
    const int tid = ty * 32 + tx;
    for (int64_t t = 0; t < n; t++) {
        for (int d = tid; d < K; d += 32 * DUET_KDA_RY) {
            sq[d] = q[t * ls + d];
            sk[d] = k[t * ls + d];
            se[d] = expf(g[t * lg + d]);
        }
        __syncthreads();
        float kv, qs, kq;
        duet__kda_decay_dots<RPT>(s, se, sk, sq, red, tx, ty, &kv, &qs, &kq);
        const float u = active ? beta[t * lb] * (v[t * ls + x] - kv) : 0.0f;
        if (o != NULL && active && ty == 0)
            o[t * lo + x] = qs + u * kq;
#pragma unroll
        for (int r = 0; r < RPT; r++) {
            const int d = ty + DUET_KDA_RY * r;
            s[r] = s[r] + sk[d] * u; /* duet__kda_state_store's value */
        }
        __syncthreads(); /* sq, sk, se and red are rewritten for the next row */
    }
}

/* Verify items: the recurrent kernel's block layout; S is read, never written; block y = 0 also
 * writes the rows' k, v, g, β to the replay rows (the conv wrote their proj). */
template <int K>
__global__ static void __launch_bounds__(32 * DUET_KDA_RY)
    duet__kda_verify_kernel(duet__kda_core_args_t a)
{
    constexpr int V = K, RPT = K / DUET_KDA_RY;
    const int64_t H = a.ly.H, HK = H * K, C3 = 3 * HK;
    const int64_t it = blockIdx.x / H, h = blockIdx.x % H;
    const int64_t row = a.st.item_row0[it], n = a.st.item_row0[it + 1] - row;
    const bool verify = duet__kda_is_verify(a.st, it);
    __shared__ float sq[K], sk[K], se[K];
    __shared__ float red[3][DUET_KDA_RY][33];
    const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * 32 + tx;
    const int x = blockIdx.y * 32 + tx;
    const bool active = x < V;
    const int32_t slot = a.st.item_slot[it];
    const float *S = duet__kda_block(a.ly, slot) + h * K * V;
    duet_pdl_wait(); /* qkv, g, beta */
    duet_pdl_trigger();
    if (!verify)
        return;
    float s[RPT];
#pragma unroll
    for (int r = 0; r < RPT; r++)
        s[r] = active ? S[(int64_t)(ty + DUET_KDA_RY * r) * V + x] : 0.0f;
    const float *q = a.qkv + row * C3 + h * K;
    duet__kda_recur_rows<K>(s, n, q, q + HK, q + 2 * HK, C3, a.g + row * HK + h * K, HK,
                            a.beta + row * H + h, H, a.o + row * HK + h * K, HK, sq, sk, se, red,
                            tx, ty, x, active);
    if (blockIdx.y != 0)
        return;
    for (int64_t t = 0; t < n; t++) {
        float *rr = duet__kda_replay_row(a.ly, slot, a.ly.layer, t);
        const int64_t r = row + t;
        for (int d = tid; d < K; d += 32 * DUET_KDA_RY) {
            rr[3 * HK + h * K + d] = a.qkv[r * C3 + HK + h * K + d];
            rr[4 * HK + h * K + d] = a.qkv[r * C3 + 2 * HK + h * K + d];
            rr[5 * HK + h * K + d] = a.g[r * HK + h * K + d];
        }
        if (tid == 0)
            rr[6 * HK + h] = a.beta[r * H + h];
    }
}

/* Block (item·H + h, column slice of 32, KDA layer): fold the item's accepted rows into S, then
 * (block y = 0) roll the head's q, k, v windows over their projections. */
template <int K>
__global__ static void __launch_bounds__(32 * DUET_KDA_RY)
    duet__kda_replay_kernel(duet_cuda_step_t st, duet_cuda_kda_layer_t ly)
{
    constexpr int V = K, RPT = K / DUET_KDA_RY;
    const int64_t H = ly.H, HK = H * K, W1 = ly.W - 1, RF = 6 * HK + H;
    const int64_t it = blockIdx.x / H, h = blockIdx.x % H, layer = blockIdx.z;
    __shared__ float sq[K], sk[K], se[K];
    __shared__ float red[3][DUET_KDA_RY][33];
    const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * 32 + tx;
    const int x = blockIdx.y * 32 + tx;
    const bool active = x < V;
    duet_pdl_wait(); /* the replay rows and the state (earlier steps' kernels) */
    duet_pdl_trigger();
    const int64_t n = st.item_replay[it];
    if (n <= 0)
        return;
    const int32_t slot = st.item_slot[it];
    float *blk = ly.kda_base + ((int64_t)slot * ly.kda_n_layers + layer) * ly.kda_layer_floats;
    float *S = blk + h * K * V;
    float s[RPT];
#pragma unroll
    for (int r = 0; r < RPT; r++)
        s[r] = active ? S[(int64_t)(ty + DUET_KDA_RY * r) * V + x] : 0.0f;
    const float *rows = duet__kda_replay_row(ly, slot, layer, 0);
    const float *kr = rows + 3 * HK + h * K;
    /* q is not stored: the state update does not read it, so k stands in and no output is kept */
    duet__kda_recur_rows<K>(s, n, kr, kr, rows + 4 * HK + h * K, RF, rows + 5 * HK + h * K, RF,
                            rows + 6 * HK + h, RF, NULL, 0, sq, sk, se, red, tx, ty, x, active);
    if (active)
#pragma unroll
        for (int r = 0; r < RPT; r++)
            S[(int64_t)(ty + DUET_KDA_RY * r) * V + x] = s[r];
    if (blockIdx.y != 0 || W1 == 0)
        return;
    /* window ++ projections, keep the last W-1 */
    for (int idx = tid; idx < 3 * K; idx += 32 * DUET_KDA_RY) {
        const int64_t c = (idx / K) * HK + h * K + idx % K;
        float *win = blk + H * K * V + c * W1;
        float old[DUET_KDA_MAX_W];
        for (int64_t j = 0; j < W1; j++)
            old[j] = win[j];
        for (int64_t j = 0; j < W1; j++) {
            const int64_t i = n + j;
            win[j] = i < W1 ? old[i] : rows[(i - W1) * RF + c];
        }
    }
}

template <int K>
static duet_status_t duet__kda_replay_launch(cudaStream_t stream, const duet_cuda_step_t &st,
                                             const duet_cuda_kda_layer_t &ly)
{
    dim3 grid((unsigned)(st.n_items * ly.H), (unsigned)((K + 31) / 32), (unsigned)ly.kda_n_layers);
    DUET__TRY(
        duet_pdl_launch(duet__kda_replay_kernel<K>, grid, dim3(32, DUET_KDA_RY), 0, stream, st, ly),
        "replay launch");
    return DUET_OK;
}

extern "C" duet_status_t duet_cuda_kda_replay(cudaStream_t stream, const duet_cuda_step_t *st,
                                              const duet_cuda_kda_layer_t *ly)
{
    duet_status_t s = duet__kda_check(ly, "replay");
    if (s != DUET_OK)
        return s;
    if (ly->K % 16 != 0)
        return duet_error_set(DUET_ERR_UNSUPPORTED,
                              "cuda kda replay: K = %lld is not a multiple of 16",
                              (long long)ly->K);
    if (st == NULL || st->n_items < 0)
        return duet_error_set(DUET_ERR_INVALID, "cuda kda replay: bad step");
    if (st->item_replay == NULL || st->n_items == 0)
        return DUET_OK;
    if (ly->replay_base == NULL || ly->replay_rows < 1)
        return duet_error_set(DUET_ERR_INVALID, "cuda kda replay: no replay pool");
    if ((int64_t)st->n_items * ly->H > 0x7fffffff || ly->kda_n_layers > 65535)
        return duet_error_set(DUET_ERR_RANGE,
                              "cuda kda replay: %d items x %lld heads x %lld layers", st->n_items,
                              (long long)ly->H, (long long)ly->kda_n_layers);
    return duet__kda_with_k(
        ly->K,
        [&](auto k) { return duet__kda_replay_launch<decltype(k)::value>(stream, *st, *ly); },
        [&] { return duet__kda_no_k(ly->K); });
}

/* ---- core: chunked (items of 2+ tokens) --------------------------------------------------- */

/* Sub-chunks of 16 rows: a pairwise decay e^{Γi−Γj} with j in an earlier sub-chunk than i
 * factors through Γe, Γ of the last row of j's sub-chunk, into e^{Γi−Γe} · e^{Γe−Γj}, both
 * exponents <= 0 (Γ never increases down a chunk: g <= 0), so neither factor can overflow and
 * each is computed once per (row, channel) instead of once per (pair, channel). */
#define DUET_KDA_SUB 16

/*
 * Shared-memory layout of the ahead kernel (floats), where a chunk's Γ, L, Aqk and the products
 * with (I − L)^{-1} are formed. Rows of Q, K, G are KR = K + 20 floats and channel d sits at
 * col(d) = d + 4·(d / (K/4)): a 4-float gap after each quarter. Readers are float4 loads in two
 * patterns, (a) 32 lanes on 32 rows at the same d and (b) 4 quarter owners on one row; the odd
 * KR/4 and the gaps put both on distinct 16-byte bank groups. L and Aqk are row-major with rows of
 * LP = C + 4 floats: the forward substitution reads row i of L four entries at a time, the same
 * address in every lane, and Aqk leaves as float4 copies.
 */
template <int K> struct duet__kda_chunk_layout {
    static constexpr int C = DUET_KDA_C, V = K, Kq = K / 4, KR = K + 20, VR = V + 8, LP = C + 4;
    static constexpr int Q = 0, KK = Q + C * KR, G = KK + C * KR, VV = G + C * KR, L = VV + C * VR,
                         A = L + C * LP, B = A + C * LP, GL = B + C, KRD = GL + K;
    static constexpr int FLOATS = KRD + C * KR; /* KRD: sKr, for L and Aqk */
    __device__ static constexpr int col(int d)
    {
        return d + 4 * (d / Kq);
    }
};

/* What the ahead kernel leaves for the sequential kernel, per (chunk, head), in floats: the
 * chunk's Wt = T (β k e^Γ) and Qe = q e^Γ as [C][PA] rows (T = (I − L)^{-1}), Aqk as [C][PQ]
 * rows, Kd = k e^{Γlast−Γ} as [C][PD] rows, e^{Γlast} per channel, then U = T (β v) by slices
 * of XS columns, [ceil(K / XS)][C][PS]; Qe, Kd, Wt and Aqk rounded to tf32 for
 * DUET_CUDA_KDA_TC_ONE. The rows are padded as the sequential kernels keep them in shared memory
 * (the pads are never read), so that each of a chunk's three copy groups (Wt and a slice of U;
 * Qe and Aqk; Kd and e^{Γlast}) is one or two whole ranges. Rows past the chunk's tokens are
 * zero, and so are a last slice's columns past K. Every offset is a multiple of 4 floats
 * (K % 16 == 0). */
template <int K> struct duet__kda_wy_layout {
    static constexpr int C = DUET_KDA_C, XS = DUET_KDA_SEQ_COLS, NSL = (K + XS - 1) / XS;
    static constexpr int PA = K + 4, PD = K + 8, PQ = C + 4, PS = XS + 8;
    static constexpr int WT = 0, QE = WT + C * PA, A = QE + C * PA, KD = A + C * PQ,
                         GL = KD + C * PD, U = GL + K, FLOATS = U + NSL * C * PS;
};

/* Where chunk c of item it keeps its duet__kda_wy_layout block: rows r0.. of an item start at
 * slot r0 / C + it, so the slots of consecutive items never overlap, and every slot is below
 * n_rows / C + n_items + 1 (duet_cuda_kda_scratch_bytes). */
static __device__ __forceinline__ int64_t duet__kda_wy_slot(const duet__kda_core_args_t &a,
                                                            int64_t it, int c)
{
    return (int64_t)a.st.item_row0[it] / DUET_KDA_C + it + c;
}

/* The duet__kda_wy_layout block of chunk c of item it, head h, in the caller's scratch. */
template <int K>
static __device__ __forceinline__ float *duet__kda_wy_block(const duet__kda_core_args_t &a,
                                                            int64_t it, int64_t h, int c)
{
    constexpr int64_t F = duet__kda_wy_layout<K>::FLOATS;
    return a.wy + h * F + duet__kda_wy_slot(a, it, c) * (a.ly.H * F);
}

/* Step 1 of a chunk: rows row0 .. row0 + n - 1 of head h into sQ, sK, sG and sV, β into sB;
 * rows past n are zero (β = 0, k = 0, g = 0 change nothing). The copies are asynchronous
 * (cp.async, zero-filled past n), so all of them are in flight at once instead of one round
 * trip per loop iteration, 16 bytes each (4 channels: a quarter of a row never straddles the
 * layout's gaps) when qkv and g are 16-byte aligned, else 4. q, k and g go in one group and v
 * in a second: the function returns once the first group (and any cp.async the thread issued
 * before) has landed, after a block barrier, and v lands while steps 2-3 run
 * (duet__kda_chunk_scale waits for it). */
template <int K>
static __device__ __forceinline__ void
duet__kda_chunk_load(const duet__kda_core_args_t &a, int64_t row0, int n, int64_t h, float *sm)
{
    typedef duet__kda_chunk_layout<K> Ly;
    constexpr int C = Ly::C, KR = Ly::KR, VR = Ly::VR, NT = 4 * K;
    const int64_t H = a.ly.H, HK = H * K, C3 = 3 * HK;
    const int tid = threadIdx.x;
    const bool wide = (((uintptr_t)a.qkv | (uintptr_t)a.g) & 15) == 0; /* uniform per launch */
    const int step = wide ? 4 : 1;
    for (int part = 0; part < 2; part++) { /* q, k, g; then v */
        for (int idx = tid * step; idx < C * K; idx += NT * step) {
            const int i = idx / K, d = idx % K, c = i * KR + Ly::col(d);
            const bool ok = i < n;
            const int64_t row = row0 + (ok ? i : 0);
            const float *qr = a.qkv + row * C3 + h * K + d, *gr = a.g + row * HK + h * K + d;
            if (part == 1) {
                if (wide)
                    duet__cp_async16(&sm[Ly::VV + i * VR + d], qr + 2 * HK, ok);
                else
                    duet__cp_async4(&sm[Ly::VV + i * VR + d], qr + 2 * HK, ok);
            } else if (wide) {
                duet__cp_async16(&sm[Ly::Q + c], qr, ok);
                duet__cp_async16(&sm[Ly::KK + c], qr + HK, ok);
                duet__cp_async16(&sm[Ly::G + c], gr, ok);
            } else {
                duet__cp_async4(&sm[Ly::Q + c], qr, ok);
                duet__cp_async4(&sm[Ly::KK + c], qr + HK, ok);
                duet__cp_async4(&sm[Ly::G + c], gr, ok);
            }
        }
        duet__cp_async_commit();
    }
    if (tid < C)
        sm[Ly::B + tid] = tid < n ? a.beta[(row0 + tid) * H + h] : 0.0f;
    duet__cp_async_wait<1>();
    __syncthreads();
}

/* Step 2: Γ = cumulative sum of g down the chunk, per channel, then to log2 units (sG, and the
 * last row's in sGl). */
template <int K> static __device__ __forceinline__ void duet__kda_chunk_gamma(float *sm)
{
    typedef duet__kda_chunk_layout<K> Ly;
    constexpr int C = Ly::C, KR = Ly::KR;
    const int tid = threadIdx.x;
    if (tid < K) {
        float *sG = sm + Ly::G;
        const int cd = Ly::col(tid);
        float acc = 0.0f;
        for (int i = 0; i < C; i++) {
            acc += sG[i * KR + cd];
            sG[i * KR + cd] = acc * DUET_LOG2E;
        }
        sm[Ly::GL + tid] = acc * DUET_LOG2E;
    }
    __syncthreads();
}

/* One channel's term of L and Aqk: t = k_j e^{min(Γi−Γj, 0)} (log2 units), skk += k_i t,
 * sqk += q_i t. */
static __device__ __forceinline__ void duet__kda_lqk_term(float ki, float qi, float kj, float gi,
                                                          float gj, float &skk, float &sqk)
{
    const float t = kj * duet__ex2(fminf(gi - gj, 0.0f));
    skk += ki * t;
    sqk += qi * t;
}

/* Step 3a: sKr[j] = k_j e^{min(Γe−Γj, 0)} (log2 units), Γe the last row of j's sub-chunk. */
template <int K> static __device__ __forceinline__ void duet__kda_chunk_kr(float *sm)
{
    typedef duet__kda_chunk_layout<K> Ly;
    constexpr int C = Ly::C, KR = Ly::KR, NT = 4 * K;
    const float *sK = sm + Ly::KK, *sG = sm + Ly::G;
    float *sKr = sm + Ly::KRD;
    for (int idx = 4 * threadIdx.x; idx < C * K; idx += 4 * NT) {
        const int j = idx / K, cd = Ly::col(idx % K), c = j * KR + cd;
        const int ce = (j | (DUET_KDA_SUB - 1)) * KR + cd;
        const float4 k = *reinterpret_cast<const float4 *>(&sK[c]);
        const float4 gj = *reinterpret_cast<const float4 *>(&sG[c]);
        const float4 ge = *reinterpret_cast<const float4 *>(&sG[ce]);
        *reinterpret_cast<float4 *>(&sKr[c]) = make_float4(
            k.x * duet__ex2(fminf(ge.x - gj.x, 0.0f)), k.y * duet__ex2(fminf(ge.y - gj.y, 0.0f)),
            k.z * duet__ex2(fminf(ge.z - gj.z, 0.0f)), k.w * duet__ex2(fminf(ge.w - gj.w, 0.0f)));
    }
    __syncthreads();
}

/* The lqk tasks (sub-chunk of rows si, 8 columns jh) as si · 8 + jh, ordered so that 16 warps
 * share the work evenly: the 8 diagonal tasks (pairwise decays) first, one per warp, then the
 * 12 below the diagonal (one decay per row and channel) and the 12 above it (zeros only). */
__constant__ static const unsigned char duet__kda_lqk_tasks[32] = {
    0 * 8 + 0, 0 * 8 + 1, 1 * 8 + 2, 1 * 8 + 3, 2 * 8 + 4, 2 * 8 + 5, 3 * 8 + 6, 3 * 8 + 7,
    1 * 8 + 0, 1 * 8 + 1, 2 * 8 + 0, 2 * 8 + 1, 2 * 8 + 2, 2 * 8 + 3, 3 * 8 + 0, 3 * 8 + 1,
    0 * 8 + 2, 0 * 8 + 3, 0 * 8 + 4, 0 * 8 + 5, 0 * 8 + 6, 0 * 8 + 7, 1 * 8 + 4, 1 * 8 + 5,
    3 * 8 + 2, 3 * 8 + 3, 3 * 8 + 4, 3 * 8 + 5, 1 * 8 + 6, 1 * 8 + 7, 2 * 8 + 6, 2 * 8 + 7};

/* Step 3b: L and Aqk from sQ, sK, sG (Γ), sKr, sB. Task (si, jh): lanes on rows i = 16·si +
 * lane % 16, columns j = 8·jh + 4·(lane / 16) .. +3, all in sub-chunk sj = jh / 2. Below the
 * diagonal (sj < si) each term is (k_i e^{Γi−Γe}) · sKr[j]; on it, k_j e^{min(Γi−Γj, 0)} per
 * pair; above it (sj > si) the task only writes its zeros. */
template <int K> static __device__ __forceinline__ void duet__kda_chunk_lqk(float *sm)
{
    typedef duet__kda_chunk_layout<K> Ly;
    constexpr int KR = Ly::KR, LP = Ly::LP, NW = 4 * K / 32;
    static_assert(DUET_KDA_C == 4 * DUET_KDA_SUB, "4 sub-chunks of 16 rows, 8 tasks each");
    const float *sQ = sm + Ly::Q, *sK = sm + Ly::KK, *sG = sm + Ly::G, *sB = sm + Ly::B;
    const float *sKr = sm + Ly::KRD;
    float *sL = sm + Ly::L, *sA = sm + Ly::A;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int task = warp; task < 32; task += NW) {
        const int tk = duet__kda_lqk_tasks[task], si = tk >> 3, jh = tk & 7, sj = jh >> 1;
        const int i = DUET_KDA_SUB * si + (lane & 15), j0 = 8 * jh + 4 * (lane >> 4);
        float skk[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sqk[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (sj == si) {
#pragma unroll 2
            for (int d = 0; d < K; d += 4) {
                const int cd = Ly::col(d);
                const float4 ki = *reinterpret_cast<const float4 *>(&sK[i * KR + cd]);
                const float4 qi = *reinterpret_cast<const float4 *>(&sQ[i * KR + cd]);
                const float4 gi = *reinterpret_cast<const float4 *>(&sG[i * KR + cd]);
#pragma unroll
                for (int jj = 0; jj < 4; jj++) {
                    const int j = j0 + jj;
                    const float4 kj = *reinterpret_cast<const float4 *>(&sK[j * KR + cd]);
                    const float4 gj = *reinterpret_cast<const float4 *>(&sG[j * KR + cd]);
                    duet__kda_lqk_term(ki.x, qi.x, kj.x, gi.x, gj.x, skk[jj], sqk[jj]);
                    duet__kda_lqk_term(ki.y, qi.y, kj.y, gi.y, gj.y, skk[jj], sqk[jj]);
                    duet__kda_lqk_term(ki.z, qi.z, kj.z, gi.z, gj.z, skk[jj], sqk[jj]);
                    duet__kda_lqk_term(ki.w, qi.w, kj.w, gi.w, gj.w, skk[jj], sqk[jj]);
                }
            }
        } else if (sj < si) {
            const int e = DUET_KDA_SUB * sj + DUET_KDA_SUB - 1; /* the row Γe comes from */
#pragma unroll 1
            for (int d = 0; d < K; d += 4) {
                const int cd = Ly::col(d);
                const float4 ki = *reinterpret_cast<const float4 *>(&sK[i * KR + cd]);
                const float4 qi = *reinterpret_cast<const float4 *>(&sQ[i * KR + cd]);
                const float4 gi = *reinterpret_cast<const float4 *>(&sG[i * KR + cd]);
                const float4 ge = *reinterpret_cast<const float4 *>(&sG[e * KR + cd]);
                const float4 el = make_float4(
                    duet__ex2(fminf(gi.x - ge.x, 0.0f)), duet__ex2(fminf(gi.y - ge.y, 0.0f)),
                    duet__ex2(fminf(gi.z - ge.z, 0.0f)), duet__ex2(fminf(gi.w - ge.w, 0.0f)));
                const float4 kl = make_float4(ki.x * el.x, ki.y * el.y, ki.z * el.z, ki.w * el.w);
                const float4 ql = make_float4(qi.x * el.x, qi.y * el.y, qi.z * el.z, qi.w * el.w);
#pragma unroll
                for (int jj = 0; jj < 4; jj++) {
                    const float4 kr = *reinterpret_cast<const float4 *>(&sKr[(j0 + jj) * KR + cd]);
                    skk[jj] += kl.x * kr.x;
                    sqk[jj] += ql.x * kr.x;
                    skk[jj] += kl.y * kr.y;
                    sqk[jj] += ql.y * kr.y;
                    skk[jj] += kl.z * kr.z;
                    sqk[jj] += ql.z * kr.z;
                    skk[jj] += kl.w * kr.w;
                    sqk[jj] += ql.w * kr.w;
                }
            }
        }
        const float bi = sB[i];
#pragma unroll
        for (int jj = 0; jj < 4; jj++) {
            const int j = j0 + jj;
            sA[i * LP + j] = j <= i ? sqk[jj] : 0.0f;
            sL[i * LP + j] = j < i ? -bi * skk[jj] : 0.0f;
        }
    }
    __syncthreads();
}

/* Step 4, in place: Q ← q e^Γ, K ← k e^{Γlast−Γ}, G ← β k e^Γ (the row's decayed k, scaled by
 * its β: the W of Y = β v − W S); and v landed for every thread. */
template <int K> static __device__ __forceinline__ void duet__kda_chunk_scale(float *sm)
{
    typedef duet__kda_chunk_layout<K> Ly;
    constexpr int C = Ly::C, KR = Ly::KR, NT = 4 * K;
    duet__cp_async_wait<0>(); /* this thread's v copies (duet__kda_chunk_load): the barrier at
                               * the end publishes them for the solve */
    float *sQ = sm + Ly::Q, *sK = sm + Ly::KK, *sG = sm + Ly::G;
    const float *sB = sm + Ly::B, *sGl = sm + Ly::GL;
    for (int idx = 4 * threadIdx.x; idx < C * K; idx += 4 * NT) { /* 4 channels at a time */
        const int i = idx / K, d = idx % K, c = i * KR + Ly::col(d);
        const float4 gam = *reinterpret_cast<const float4 *>(&sG[c]);
        const float4 k = *reinterpret_cast<const float4 *>(&sK[c]);
        const float4 q = *reinterpret_cast<const float4 *>(&sQ[c]);
        const float4 gl = *reinterpret_cast<const float4 *>(&sGl[d]);
        const float4 eg =
            make_float4(duet__ex2(gam.x), duet__ex2(gam.y), duet__ex2(gam.z), duet__ex2(gam.w));
        const float b = sB[i];
        *reinterpret_cast<float4 *>(&sQ[c]) =
            make_float4(q.x * eg.x, q.y * eg.y, q.z * eg.z, q.w * eg.w);
        *reinterpret_cast<float4 *>(&sK[c]) =
            make_float4(k.x * duet__ex2(gl.x - gam.x), k.y * duet__ex2(gl.y - gam.y),
                        k.z * duet__ex2(gl.z - gam.z), k.w * duet__ex2(gl.w - gam.w));
        *reinterpret_cast<float4 *>(&sG[c]) =
            make_float4(b * k.x * eg.x, b * k.y * eg.y, b * k.z * eg.z, b * k.w * eg.w);
    }
    __syncthreads();
}

/* x rounded to tf32 (duet_round_tf32) if round, else x: the ahead kernel's Qe, Kd, Wt and Aqk
 * for the sequential kernel that multiplies them once as tf32 (DUET_CUDA_KDA_TC_ONE), rounded
 * once here instead of at every use. */
static __device__ __forceinline__ float duet__kda_tf32_if(float x, bool round)
{
    return round ? __uint_as_float(duet_round_tf32(x)) : x;
}
static __device__ __forceinline__ float4 duet__kda_tf32_if(float4 v, bool round)
{
    return make_float4(duet__kda_tf32_if(v.x, round), duet__kda_tf32_if(v.y, round),
                       duet__kda_tf32_if(v.z, round), duet__kda_tf32_if(v.w, round));
}

/*
 * Step 5: U = T (β v) and Wt = T (β k e^Γ), T = (I − L)^{-1}, as the solution X of (I − L) X = B
 * by forward substitution down the chunk's rows, x_i = b_i + Σ_{j<i} L[i][j] x_j: thread tid < K
 * owns column tid of U, thread K + x column x of Wt, its C values in registers (so no thread
 * waits on another); the four running sums by j mod 4 keep the chain from x_{i−1} to x_i short.
 * Stores the columns at the wy block's U and WT (out), Wt rounded to tf32 if tf32. Rows past
 * the chunk's tokens have b = 0 (β = 0) and L = 0, so they stay zero.
 */
template <int K>
static __device__ __forceinline__ void duet__kda_chunk_solve(const float *sm, float *out, bool tf32)
{
    typedef duet__kda_chunk_layout<K> Ly;
    typedef duet__kda_wy_layout<K> Wy;
    constexpr int C = Ly::C, KR = Ly::KR, VR = Ly::VR, LP = Ly::LP;
    const int x = threadIdx.x % K;
    const bool wt = threadIdx.x >= K;
    const float *sL = sm + Ly::L;
    float y[C];
#pragma unroll
    for (int i = 0; i < C; i++)
        y[i] = wt ? sm[Ly::G + i * KR + Ly::col(x)] : sm[Ly::B + i] * sm[Ly::VV + i * VR + x];
#pragma unroll
    for (int i = 1; i < C; i++) {
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < i; j += 4) {
            const float4 l = *reinterpret_cast<const float4 *>(&sL[i * LP + j]);
            acc[0] += l.x * y[j];
            if (j + 1 < i)
                acc[1] += l.y * y[j + 1];
            if (j + 2 < i)
                acc[2] += l.z * y[j + 2];
            if (j + 3 < i)
                acc[3] += l.w * y[j + 3];
        }
        y[i] += (acc[0] + acc[1]) + (acc[2] + acc[3]);
    }
    float *o = wt ? out + Wy::WT + x : out + Wy::U + (x / Wy::XS) * C * Wy::PS + x % Wy::XS;
    const int pitch = wt ? Wy::PA : Wy::PS;
    const bool round = tf32 && wt;
#pragma unroll
    for (int i = 0; i < C; i++)
        o[i * pitch] = duet__kda_tf32_if(y[i], round);
}

/*
 * Everything of a chunk that does not depend on the state, for every chunk in parallel ahead of
 * the sequential kernel. One block per (item, chunk) × head, 4·K threads: the chunk, Γ, L and
 * Aqk, the decayed q and k (steps 1-4), then U = T (β v) and Wt = T (β k e^Γ), T = (I − L)^{-1}
 * (duet__kda_chunk_solve, on the first 2·K threads while the others store Qe, Kd, Aqk and
 * e^{Γlast}), so that the state-dependent part of a chunk is V_new = U − Wt S, three products and
 * no triangular solve. Stores the duet__kda_wy_layout block at the chunk's slot.
 */
template <int K>
__global__ static void __launch_bounds__(4 * K) duet__kda_wy_kernel(duet__kda_core_args_t a)
{
    typedef duet__kda_chunk_layout<K> Ly;
    typedef duet__kda_wy_layout<K> Wy;
    constexpr int C = Ly::C, KR = Ly::KR, LP = Ly::LP, NS = 2 * K, NT = 4 * K;
    static_assert(NS % 32 == 0, "the solving threads are whole warps");
    const int64_t it = blockIdx.x / a.max_chunks, h = blockIdx.y;
    const int c = (int)(blockIdx.x % a.max_chunks);
    const int64_t r0 = a.st.item_row0[it], n_tok = a.st.item_row0[it + 1] - r0;
    duet_pdl_wait(); /* qkv, g, beta; and the sequential kernel before this one still reads the
                      * scratch */
    duet_pdl_trigger();
    if (n_tok < 2 || (int64_t)c * C >= n_tok || duet__kda_is_verify(a.st, it))
        return;
    extern __shared__ float4 duet__kda_smem4[];
    float *sm = reinterpret_cast<float *>(duet__kda_smem4);
    const int n = n_tok - (int64_t)c * C < C ? (int)(n_tok - (int64_t)c * C) : C;
    duet__kda_chunk_load<K>(a, r0 + (int64_t)c * C, n, h, sm);
    duet__kda_chunk_gamma<K>(sm);
    duet__kda_chunk_kr<K>(sm);
    duet__kda_chunk_lqk<K>(sm);
    duet__kda_chunk_scale<K>(sm);

    float *out = duet__kda_wy_block<K>(a, it, h, c);
    const bool tf32 = a.ly.tc == DUET_CUDA_KDA_TC_ONE; /* uniform per launch */
    if (threadIdx.x < NS) {
        duet__kda_chunk_solve<K>(sm, out, tf32);
        return;
    }
    const int t = threadIdx.x - NS;
    for (int idx = 4 * t; idx < C * K; idx += 4 * (NT - NS)) {
        const int i = idx / K, d = idx % K, cc = i * KR + Ly::col(d);
        *reinterpret_cast<float4 *>(&out[Wy::QE + i * Wy::PA + d]) =
            duet__kda_tf32_if(*reinterpret_cast<const float4 *>(&sm[Ly::Q + cc]), tf32);
        *reinterpret_cast<float4 *>(&out[Wy::KD + i * Wy::PD + d]) =
            duet__kda_tf32_if(*reinterpret_cast<const float4 *>(&sm[Ly::KK + cc]), tf32);
    }
    for (int idx = 4 * t; idx < C * C; idx += 4 * (NT - NS))
        *reinterpret_cast<float4 *>(&out[Wy::A + (idx / C) * Wy::PQ + idx % C]) = duet__kda_tf32_if(
            *reinterpret_cast<const float4 *>(&sm[Ly::A + (idx / C) * LP + idx % C]), tf32);
    if constexpr (K % Wy::XS != 0) { /* the last slice of U: its columns past K */
        constexpr int XL = K % Wy::XS;
        float *ul = out + Wy::U + (Wy::NSL - 1) * C * Wy::PS;
        for (int idx = t; idx < C * (Wy::XS - XL); idx += NT - NS)
            ul[(idx / (Wy::XS - XL)) * Wy::PS + XL + idx % (Wy::XS - XL)] = 0.0f;
    }
    for (int d = t; d < K; d += NT - NS)
        out[Wy::GL + d] = duet__ex2(sm[Ly::GL + d]);
}

/* Σ_r w[r] · s[r] over one quarter of a row (Kq floats, 16-byte aligned), four at a time: the
 * sequential kernel's row-times-S sums of phases 1 and 2. */
template <int Kq>
static __device__ __forceinline__ float duet__kda_quarter_dot(const float *w, const float (&s)[Kq])
{
    float acc = 0.0f;
#pragma unroll
    for (int r = 0; r < Kq; r += 4) {
        const float4 w4 = *reinterpret_cast<const float4 *>(&w[r]);
        acc += w4.x * s[r] + w4.y * s[r + 1] + w4.z * s[r + 2] + w4.w * s[r + 3];
    }
    return acc;
}

/* The four quarters' partial sums of one (row, column) in the sequential kernel's RED buffer
 * (rd points at quarter 0's; quarters lie `stride` floats apart), added in quarter order. */
static __device__ __forceinline__ float duet__kda_quarters_sum(const float *rd, int stride)
{
    return (rd[0] + rd[stride]) + (rd[2 * stride] + rd[3 * stride]);
}

/*
 * Shared-memory layout of the sequential kernel (floats): the chunk's Wt, Qe, Aqk, Kd and
 * e^{Γlast} as the wy block holds them (padded rows), this block's slice of U ([C][PS]), the
 * block's columns of S ([K][32]), the four quarters' partial sums ([4][C][32]), V_new ([C][32])
 * and the copies' three mbarriers.
 */
template <int K> struct duet__kda_seq_layout {
    typedef duet__kda_wy_layout<K> Wy;
    static constexpr int C = DUET_KDA_C, XS = DUET_KDA_SEQ_COLS;
    /* the wy block's arrays and pitches (duet__kda_seq_fetch), then one slice of U */
    static constexpr int PA = Wy::PA, PD = Wy::PD, PQ = Wy::PQ, PS = Wy::PS;
    static constexpr int WT = Wy::WT, QE = Wy::QE, A = Wy::A, KD = Wy::KD, GL = Wy::GL, U = Wy::U,
                         S = U + C * PS, RED = S + K * XS, VN = RED + 4 * C * XS, BAR = VN + C * XS,
                         FLOATS = BAR + 8; /* BAR: 3 mbarriers */
};

/* Group `part` of a chunk's wy block (slot; NULL: none) into shared memory laid out as Ly
 * (duet__kda_seq_layout or duet__kda_tc_layout, which keep the wy block's first arrays at the
 * same offsets and pitches, then one slice of U) by the bulk copy engine, counted on bar[part]:
 * 0 = Wt and this block's slice of U, 1 = Qe and Aqk, 2 = Kd and e^{Γlast}. Thread 0 alone
 * acts: it arrives expecting the group's bytes and starts one copy per range, so a chunk's
 * 112 KB take four instructions instead of seven thousand 16-byte copies. The sequential
 * kernels start each group as soon as the chunk before has finished with its buffers (a block
 * barrier after their last reads) and wait for phase c % 2 of bar[part] before chunk c reads
 * them. */
template <int K, typename Ly>
static __device__ __forceinline__ void duet__kda_seq_fetch(const float *slot, int x0, float *sm,
                                                           unsigned long long *bar, int part)
{
    typedef duet__kda_wy_layout<K> Wy;
    static_assert(Ly::WT == Wy::WT && Ly::QE == Wy::QE && Ly::A == Wy::A && Ly::KD == Wy::KD &&
                      Ly::GL == Wy::GL && Ly::U == Wy::U,
                  "shared memory starts as the wy block");
    constexpr unsigned F = sizeof(float), SLICE = F * Wy::C * Wy::PS;
    if (slot == NULL || threadIdx.x != 0)
        return;
    duet__fence_proxy_async(); /* the block's reads of the buffers came first */
    if (part == 0) {
        duet__mbar_arrive_tx(bar, F * (Wy::QE - Wy::WT) + SLICE);
        duet__bulk_copy(sm + Wy::WT, slot + Wy::WT, F * (Wy::QE - Wy::WT), bar);
        duet__bulk_copy(sm + Wy::U, slot + Wy::U + (x0 / Wy::XS) * Wy::C * Wy::PS, SLICE, bar);
    } else {
        const int from = part == 1 ? Wy::QE : Wy::KD, to = part == 1 ? Wy::KD : Wy::U;
        duet__mbar_arrive_tx(bar + part, F * (to - from));
        duet__bulk_copy(sm + from, slot + from, F * (to - from), bar + part);
    }
}

/* The sequential kernels' setup of their copies, by the whole block: the three mbarriers of
 * duet__kda_seq_fetch, then the first chunk's groups started. */
template <int K, typename Ly>
static __device__ __forceinline__ void duet__kda_seq_start(const float *slot, int x0, float *sm,
                                                           unsigned long long *bar)
{
    if (threadIdx.x == 0) {
        for (int part = 0; part < 3; part++)
            duet__mbar_init(bar + part, 1);
        duet__mbar_init_fence();
    }
    __syncthreads();
    for (int part = 0; part < 3; part++)
        duet__kda_seq_fetch<K, Ly>(slot, x0, sm, bar, part);
}

/*
 * The state-dependent part of the chunked form: block (item·H + h, slice of 32 columns of S),
 * chunks in order, from the wy blocks the ahead kernel left. Per chunk, with S = this block's
 * columns of the state (shared memory), thread (quarter dq, row group rg, lane = column):
 *   1. V_new = U − Wt S: each thread sums its quarter of d for its 16 rows, the four quarters
 *      meet in shared memory and are added in quarter order;
 *   2. O = Qe S + Aqk V_new, the same way (each quarter also takes 16 of the j of Aqk V_new);
 *   3. S ← e^{Γlast} S + Kdᵀ V_new, each thread K/16 rows of S in its column.
 * Phases 2 and 3 share the stretch between two barriers (four per chunk). The copies of the next
 * chunk's arrays start as soon as each buffer's last reader is past a barrier (three groups per
 * chunk, duet__kda_seq_fetch), so they overlap the rest of this chunk.
 */
template <int K>
__global__ static void __launch_bounds__(DUET_KDA_SEQ_THREADS, 1)
    duet__kda_seq_kernel(duet__kda_core_args_t a)
{
    typedef duet__kda_seq_layout<K> Sy;
    constexpr int C = Sy::C, XS = Sy::XS, V = K, Kq = K / 4, DW = K / 16, NT = DUET_KDA_SEQ_THREADS;
    const int64_t H = a.ly.H, HK = H * K;
    const int64_t it = blockIdx.x / H, h = blockIdx.x % H;
    const int64_t r0 = a.st.item_row0[it], n_tok = a.st.item_row0[it + 1] - r0;
    duet_pdl_wait(); /* the wy blocks (the ahead kernel) */
    duet_pdl_trigger();
    if (n_tok < 2 || duet__kda_is_verify(a.st, it)) /* verify items: the recurrent kernel */
        return;

    extern __shared__ float4 duet__kda_smem4[];
    float *sm = reinterpret_cast<float *>(duet__kda_smem4);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int dq = warp & 3, i0 = (warp >> 2) * 16; /* phases 1-2: quarter of d, first row */
    const int x0 = (int)blockIdx.y * XS, x = x0 + lane;
    float *S = duet__kda_block(a.ly, a.st.item_slot[it]) + h * K * V;
    unsigned long long *bar = reinterpret_cast<unsigned long long *>(sm + Sy::BAR);
    for (int idx = tid; idx < K * XS; idx += NT) { /* seen after the first chunk's barrier */
        const int d = idx / XS, l = idx % XS;
        sm[Sy::S + idx] = x0 + l < V ? S[(int64_t)d * V + x0 + l] : 0.0f;
    }
    const int64_t nch = (n_tok + C - 1) / C;
    const float *wy0 = duet__kda_wy_block<K>(a, it, h, 0); /* chunk c's block: wy0 + c · HF */
    const int64_t HF = H * duet__kda_wy_layout<K>::FLOATS;
    duet__kda_seq_start<K, Sy>(wy0, x0, sm, bar);

    for (int64_t c = 0; c < nch; c++) {
        const int n = n_tok - c * C < C ? (int)(n_tok - c * C) : C;
        const float *next = c + 1 < nch ? wy0 + (c + 1) * HF : NULL;
        const unsigned ph = (unsigned)(c & 1);
        duet__mbar_wait(bar + 0, ph); /* group 0: Wt, U */
        __syncthreads();
        float s[Kq]; /* S[dq·Kq + r][x] */
#pragma unroll
        for (int r = 0; r < Kq; r++)
            s[r] = sm[Sy::S + (dq * Kq + r) * XS + lane];

            /* 1. Quarter dq of Σ_d Wt[i][d] S[d][x] for rows i0 .. i0 + 15, into RED[dq]. */
#pragma unroll 2
        for (int m = 0; m < 16; m++)
            sm[Sy::RED + (dq * C + i0 + m) * XS + lane] =
                i0 < n ? duet__kda_quarter_dot<Kq>(sm + Sy::WT + (i0 + m) * Sy::PA + dq * Kq, s)
                       : 0.0f;
        __syncthreads();
#pragma unroll
        for (int m = 0; m < 4; m++) { /* rows 4·warp .. +3: V_new = U − the quarters' sum */
            const int i = 4 * warp + m;
            const float *rd = sm + Sy::RED + i * XS + lane;
            sm[Sy::VN + i * XS + lane] =
                sm[Sy::U + i * Sy::PS + lane] - duet__kda_quarters_sum(rd, C * XS);
        }
        duet__mbar_wait(bar + 1, ph); /* groups 1 and 2: Qe, Aqk, Kd, e^{Γlast} */
        duet__mbar_wait(bar + 2, ph);
        __syncthreads();
        duet__kda_seq_fetch<K, Sy>(next, x0, sm, bar, 0);

        /* 2. Quarter dq of Σ_d Qe[i][d] S[d][x] + Σ_{j in 16dq..16dq+15} Aqk[i][j] V_new[j][x]. */
        float vq[16];
#pragma unroll
        for (int jj = 0; jj < 16; jj++)
            vq[jj] = sm[Sy::VN + (16 * dq + jj) * XS + lane];
#pragma unroll 2
        for (int m = 0; m < 16; m++) {
            float acc = 0.0f, acc2 = 0.0f;
            if (i0 < n) {
                acc = duet__kda_quarter_dot<Kq>(sm + Sy::QE + (i0 + m) * Sy::PA + dq * Kq, s);
                const float *ar = sm + Sy::A + (i0 + m) * Sy::PQ + 16 * dq;
#pragma unroll
                for (int jj = 0; jj < 16; jj += 4) {
                    const float4 a4 = *reinterpret_cast<const float4 *>(&ar[jj]);
                    acc2 +=
                        a4.x * vq[jj] + a4.y * vq[jj + 1] + a4.z * vq[jj + 2] + a4.w * vq[jj + 3];
                }
            }
            sm[Sy::RED + (dq * C + i0 + m) * XS + lane] = acc + acc2;
        }
        /* 3. S[d][x] ← e^{Γlast[d]} S[d][x] + Σ_i Kd[i][d] V_new[i][x] for d = DW·warp .. +DW−1,
         * before the same barrier as phase 2: that reads S from registers, this rewrites each
         * thread's own elements of S in shared memory. */
        float sn[DW];
#pragma unroll
        for (int t = 0; t < DW; t++) {
            const int d = DW * warp + t;
            sn[t] = sm[Sy::S + d * XS + lane] * sm[Sy::GL + d];
        }
#pragma unroll 4
        for (int i = 0; i < n; i++) {
            const float v = sm[Sy::VN + i * XS + lane];
            const float *kd = sm + Sy::KD + i * Sy::PD + DW * warp;
            if constexpr (DW % 4 == 0) { /* 16-byte aligned: one broadcast load per 4 rows */
#pragma unroll
                for (int t = 0; t < DW; t += 4) {
                    const float4 k4 = *reinterpret_cast<const float4 *>(&kd[t]);
                    sn[t] += k4.x * v;
                    sn[t + 1] += k4.y * v;
                    sn[t + 2] += k4.z * v;
                    sn[t + 3] += k4.w * v;
                }
            } else {
#pragma unroll
                for (int t = 0; t < DW; t++)
                    sn[t] += kd[t] * v;
            }
        }
#pragma unroll
        for (int t = 0; t < DW; t++)
            sm[Sy::S + (DW * warp + t) * XS + lane] = sn[t];
        __syncthreads();
        if (x < V)
#pragma unroll
            for (int m = 0; m < 4; m++) {
                const int i = 4 * warp + m;
                const float *rd = sm + Sy::RED + i * XS + lane;
                if (i < n)
                    a.o[(r0 + c * C + i) * HK + h * K + x] = duet__kda_quarters_sum(rd, C * XS);
            }
        duet__kda_seq_fetch<K, Sy>(next, x0, sm, bar, 1);
        duet__kda_seq_fetch<K, Sy>(next, x0, sm, bar, 2);
    }
    for (int idx = tid; idx < K * XS; idx += NT) {
        const int d = idx / XS, l = idx % XS;
        if (x0 + l < V)
            S[(int64_t)d * V + x0 + l] = sm[Sy::S + idx];
    }
}

/*
 * The sequential kernel's three products on the tensor cores (duet_cuda_kda_layer_t.tc): the
 * same block (item·H + h, slice of 32 columns of S) and chunk recurrence, each product an
 * mma.m16n8k8 over tf32. With TERMS = 3 (DUET_CUDA_KDA_TC_SPLIT) the fp32 operands are kept as
 * big + small splits (three products each, small terms first; cuda_mma.cuh), so the error stays
 * near fp32's (about 2^-21 per product) while the FMA kernel above is bound by shared-memory
 * traffic and issue slots; with TERMS = 1 (DUET_CUDA_KDA_TC_ONE) each operand is rounded to
 * tf32 once and multiplied once, and the small arrays are neither written nor read (the ahead
 * kernel stores Qe, Kd, Wt and Aqk already rounded then). With g = lane / 4 and t = lane % 4 the
 * fragment coordinates, per chunk:
 *   1. Wt S: warp w takes rows 16(w/4).., columns 16((w/2)%2).. and every other k-step (from
 *      w%2); the two halves meet in RED, and V_new = U − (half 0 + half 1) is stored split (VB,
 *      VS) for the next two products;
 *   2. O = Qe S + Aqk V_new, the same tiles and halves (Aqk's k-steps only up to the tile's
 *      diagonal), added the same way;
 *   3. S ← e^{Γlast} S + Kdᵀ V_new: S lives in registers as the C fragments of warp w's tiles
 *      (rows 16(w/2).., columns 16(w%2)..) for the whole item, in fp32; each chunk stores it
 *      split (SB, SS) as the B operand of products 1 and 2.
 * The B operands (S and V_new) are stored transposed, column by column, so that one ldmatrix
 * brings a k-step's fragments of both 8-column tiles, as one brings Wt's, Qe's and Aqk's A
 * fragments; Kdᵀ's are four loads. Row strides are padded so that the 8 rows of an ldmatrix,
 * and the fragment loads, meet distinct banks. Rows of a chunk past its tokens are zero in every
 * wy array (duet__kda_wy_layout), so they add nothing.
 */
template <int K> struct duet__kda_tc_layout {
    typedef duet__kda_wy_layout<K> Wy;
    static constexpr int C = DUET_KDA_C, XS = DUET_KDA_SEQ_COLS;
    /* the wy block's arrays and pitches (duet__kda_seq_fetch: Qe and Wt read along k = channel,
     * Kd along the row index), one slice of U, the halves (32 columns); S's split [XS][K] and
     * V_new's [XS][C], transposed */
    static constexpr int PA = Wy::PA, PD = Wy::PD, PQ = Wy::PQ, PS = Wy::PS, PT = K + 4, PV = C + 4;
    static constexpr int WT = Wy::WT, QE = Wy::QE, A = Wy::A, KD = Wy::KD, GL = Wy::GL, U = Wy::U,
                         VB = U + C * PS, VS = VB + XS * PV, SB = VS + XS * PV, SS = SB + XS * PT,
                         RED = SS + XS * PT, BAR = RED + 2 * C * PS,
                         FLOATS = BAR + 8; /* BAR: 3 mbarriers */
};

/* Lane offsets (floats) of duet_ldsm_x4 into a [rows][P] array at a tile's first row and
 * k-step: for an A fragment (rows m, k along the row) the tiles are (rows 0-7, k 0-3), (8-15,
 * 0-3), (0-7, 4-7), (8-15, 4-7), giving a0..a3; for the B fragments of two 8-column tiles
 * stored transposed (rows n) they are (n 0-7, k 0-3), (0-7, 4-7), (8-15, 0-3), (8-15, 4-7),
 * giving b0, b1 of tile 0 and b0, b1 of tile 1. */
template <int P> static __device__ __forceinline__ int duet__kda_ldsm_a(int lane)
{
    const int i = lane >> 3;
    return ((lane & 7) + 8 * (i & 1)) * P + 4 * (i >> 1);
}
template <int P> static __device__ __forceinline__ int duet__kda_ldsm_b(int lane)
{
    const int i = lane >> 3;
    return ((lane & 7) + 8 * (i >> 1)) * P + 4 * (i & 1);
}

/* acc[j] += A · B_j for the warp's two 8-column tiles j: A's fragment a (TERMS = 3: fp32 words,
 * split here; TERMS = 1: tf32 words as they are), B_j's b0, b1 at bb[2j], bb[2j + 1] (and the
 * small terms' at bs). TERMS = 3: three tf32 products each, the small terms first. */
template <int TERMS>
static __device__ __forceinline__ void duet__kda_tc_mma(float (&acc)[2][4], const uint32_t (&a)[4],
                                                        const uint32_t (&bb)[4],
                                                        const uint32_t (&bs)[4])
{
    static_assert(TERMS == 1 || TERMS == 3, "one term or the split's three");
    if constexpr (TERMS == 3) {
        uint32_t ab[4], as[4];
#pragma unroll
        for (int q = 0; q < 4; q++)
            duet_split_tf32(__uint_as_float(a[q]), &ab[q], &as[q]);
#pragma unroll
        for (int j = 0; j < 2; j++) {
            duet_mma_tf32(acc[j], as, bb[2 * j], bb[2 * j + 1]);
            duet_mma_tf32(acc[j], ab, bs[2 * j], bs[2 * j + 1]);
            duet_mma_tf32(acc[j], ab, bb[2 * j], bb[2 * j + 1]);
        }
    } else {
#pragma unroll
        for (int j = 0; j < 2; j++)
            duet_mma_tf32(acc[j], a, bb[2 * j], bb[2 * j + 1]);
    }
}

/* One k-step with both fragments by ldmatrix: A at pa (duet__kda_ldsm_a's offset added), B at
 * pb / ps (duet__kda_ldsm_b's; ps only for TERMS = 3). */
template <int TERMS>
static __device__ __forceinline__ void duet__kda_tc_step(float (&acc)[2][4], const float *pa,
                                                         const float *pb, const float *ps)
{
    uint32_t a[4], bb[4], bs[4];
    duet_ldsm_x4(pa, a);
    duet_ldsm_x4(pb, bb);
    if constexpr (TERMS == 3)
        duet_ldsm_x4(ps, bs);
    duet__kda_tc_mma<TERMS>(acc, a, bb, bs);
}

/* The C fragments of the warp's two tiles (rows r, r + 8; columns c + 8j, + 1) into a [rows][P]
 * array. */
template <int P>
static __device__ __forceinline__ void duet__kda_tc_put(float *dst, int r, int c,
                                                        const float (&acc)[2][4])
{
#pragma unroll
    for (int j = 0; j < 2; j++) {
        *reinterpret_cast<float2 *>(dst + r * P + c + 8 * j) = make_float2(acc[j][0], acc[j][1]);
        *reinterpret_cast<float2 *>(dst + (r + 8) * P + c + 8 * j) =
            make_float2(acc[j][2], acc[j][3]);
    }
}

/* v split (TERMS = 3, duet_split_tf32) into *big and *small, or (TERMS = 1) rounded to tf32 into
 * *big, as float bits. */
template <int TERMS>
static __device__ __forceinline__ void duet__kda_tc_round(float v, float *big, float *small)
{
    uint32_t b, sm;
    if constexpr (TERMS == 3) {
        duet_split_tf32(v, &b, &sm);
        *small = __uint_as_float(sm);
    } else {
        b = duet_round_tf32(v);
    }
    *big = __uint_as_float(b);
}

template <int K, int TERMS>
__global__ static void __launch_bounds__(DUET_KDA_SEQ_THREADS, 1)
    duet__kda_seq_tc_kernel(duet__kda_core_args_t a)
{
    typedef duet__kda_tc_layout<K> Ly;
    constexpr int C = Ly::C, V = K, PS = Ly::PS, PT = Ly::PT, PV = Ly::PV, KS = K / 8;
    static_assert(Ly::XS == 32 && DUET_KDA_SEQ_THREADS == 16 * 32 && C == 4 * 16,
                  "V_new: a column per lane, four rows per warp");
    const int64_t H = a.ly.H, HK = H * K;
    const int64_t it = blockIdx.x / H, h = blockIdx.x % H;
    const int64_t r0 = a.st.item_row0[it], n_tok = a.st.item_row0[it + 1] - r0;
    duet_pdl_wait(); /* the wy blocks (the ahead kernel) */
    duet_pdl_trigger();
    if (n_tok < 2 || duet__kda_is_verify(a.st, it)) /* verify items: the recurrent kernel */
        return;

    extern __shared__ float4 duet__kda_smem4[];
    float *sm = reinterpret_cast<float *>(duet__kda_smem4);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    /* products 1 and 2: rows 16·mt.., columns 16·nh.., k-steps kh, kh + 2, ... */
    const int mt = warp >> 2, nh = (warp >> 1) & 1, kh = warp & 1;
    const int ra = 16 * mt + g, c1 = 16 * nh;
    /* product 3 and the state: rows 16·md.. of S (md < K/16), columns 16·ns.. */
    const int md = warp >> 1, ns = warp & 1, cs = 16 * ns;
    const bool own = md < K / 16;
    /* the reductions: thread tid adds row tid / 8, columns 4·(tid % 8) .. + 3 */
    const int rr = tid >> 3, rc = 4 * (tid & 7);
    const int x0 = (int)blockIdx.y * Ly::XS;
    float *S = duet__kda_block(a.ly, a.st.item_slot[it]) + h * K * V;
    const bool o16 = ((uintptr_t)a.o & 15) == 0; /* uniform per launch */
    /* this lane's ldmatrix rows: Wt, Qe (pitch PA) and Aqk at the warp's row tile; S's split
     * (k = d) and V_new's (k = row) at the warp's column tiles */
    const int la = 16 * mt * Ly::PA + duet__kda_ldsm_a<Ly::PA>(lane);
    const int lq = 16 * mt * Ly::PQ + duet__kda_ldsm_a<Ly::PQ>(lane);
    const int ls = c1 * PT + duet__kda_ldsm_b<PT>(lane);
    const int lv = c1 * PV + duet__kda_ldsm_b<PV>(lane), lv3 = cs * PV + duet__kda_ldsm_b<PV>(lane);

    /* the warp's tiles of S: sr[j][q] = S[16·md + g + 8·(q/2)][x0 + cs + 8j + 2t + q%2] */
    float sr[2][4];
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int d = 16 * md + g + 8 * (q >> 1), x = x0 + cs + 8 * j + 2 * t + (q & 1);
            sr[j][q] = own && x < V ? S[(int64_t)d * V + x] : 0.0f;
        }
    const int64_t nch = (n_tok + C - 1) / C;
    unsigned long long *bar = reinterpret_cast<unsigned long long *>(sm + Ly::BAR);
    const float *wy0 = duet__kda_wy_block<K>(a, it, h, 0); /* chunk c's block: wy0 + c · HF */
    const int64_t HF = H * duet__kda_wy_layout<K>::FLOATS;
    duet__kda_seq_start<K, Ly>(wy0, x0, sm, bar);

    for (int64_t c = 0; c < nch; c++) {
        const int n = n_tok - c * C < C ? (int)(n_tok - c * C) : C;
        const float *next = c + 1 < nch ? wy0 + (c + 1) * HF : NULL;
        const unsigned ph = (unsigned)(c & 1);
        if (own) /* S's split, transposed: the B operand of products 1 and 2 */
#pragma unroll
            for (int j = 0; j < 2; j++)
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const int off =
                        (cs + 8 * j + 2 * t + (q & 1)) * PT + 16 * md + g + 8 * (q >> 1);
                    duet__kda_tc_round<TERMS>(sr[j][q], sm + Ly::SB + off, sm + Ly::SS + off);
                }
        duet__mbar_wait(bar + 0, ph); /* group 0: Wt, U */
        __syncthreads();

        /* 1. this warp's half of Wt S, into RED[kh] */
        if (16 * mt < n) {
            float acc[2][4] = {};
#pragma unroll
            for (int ks = kh; ks < KS; ks += 2)
                duet__kda_tc_step<TERMS>(acc, sm + Ly::WT + la + 8 * ks, sm + Ly::SB + ls + 8 * ks,
                                         sm + Ly::SS + ls + 8 * ks);
            duet__kda_tc_put<PS>(sm + Ly::RED + kh * C * PS, ra, c1 + 2 * t, acc);
        }
        __syncthreads();
        { /* V_new = U − (half 0 + half 1), 0 past n; split, transposed: lane = column, the
           * warp's four rows */
            float4 vb, vs;
            float *pb = &vb.x, *ps = &vs.x;
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int i = 4 * warp + e;
                float v = 0.0f;
                if (i < n)
                    v = sm[Ly::U + i * PS + lane] -
                        (sm[Ly::RED + i * PS + lane] + sm[Ly::RED + C * PS + i * PS + lane]);
                duet__kda_tc_round<TERMS>(v, pb + e, ps + e);
            }
            *reinterpret_cast<float4 *>(sm + Ly::VB + lane * PV + 4 * warp) = vb;
            if constexpr (TERMS == 3)
                *reinterpret_cast<float4 *>(sm + Ly::VS + lane * PV + 4 * warp) = vs;
        }
        duet__mbar_wait(bar + 1, ph); /* groups 1 and 2: Qe, Aqk, Kd, e^{Γlast} */
        duet__mbar_wait(bar + 2, ph);
        __syncthreads();
        duet__kda_seq_fetch<K, Ly>(next, x0, sm, bar, 0); /* Wt and U are read */

        /* 2. this warp's half of Qe S + Aqk V_new (Aqk is 0 past the diagonal), into RED[kh] */
        if (16 * mt < n) {
            float acc[2][4] = {};
#pragma unroll
            for (int ks = kh; ks < KS; ks += 2)
                duet__kda_tc_step<TERMS>(acc, sm + Ly::QE + la + 8 * ks, sm + Ly::SB + ls + 8 * ks,
                                         sm + Ly::SS + ls + 8 * ks);
            for (int ks = kh; ks <= 2 * mt + 1; ks += 2)
                duet__kda_tc_step<TERMS>(acc, sm + Ly::A + lq + 8 * ks, sm + Ly::VB + lv + 8 * ks,
                                         sm + Ly::VS + lv + 8 * ks);
            duet__kda_tc_put<PS>(sm + Ly::RED + kh * C * PS, ra, c1 + 2 * t, acc);
        }
        /* 3. S ← e^{Γlast} S + Kdᵀ V_new on the warp's tiles of S (A[d][i] = Kd[i][d]) */
        if (own) {
            float acc[2][4] = {};
            for (int kk = 0; kk < n; kk += 8) {
                const float *ka = sm + Ly::KD + (kk + t) * Ly::PD + 16 * md + g;
                const uint32_t af[4] = {__float_as_uint(ka[0]), __float_as_uint(ka[8]),
                                        __float_as_uint(ka[4 * Ly::PD]),
                                        __float_as_uint(ka[4 * Ly::PD + 8])};
                uint32_t bb[4], bs[4];
                duet_ldsm_x4(sm + Ly::VB + lv3 + kk, bb);
                if constexpr (TERMS == 3)
                    duet_ldsm_x4(sm + Ly::VS + lv3 + kk, bs);
                duet__kda_tc_mma<TERMS>(acc, af, bb, bs);
            }
            const float e0 = sm[Ly::GL + 16 * md + g], e1 = sm[Ly::GL + 16 * md + g + 8];
#pragma unroll
            for (int j = 0; j < 2; j++) {
                sr[j][0] = sr[j][0] * e0 + acc[j][0];
                sr[j][1] = sr[j][1] * e0 + acc[j][1];
                sr[j][2] = sr[j][2] * e1 + acc[j][2];
                sr[j][3] = sr[j][3] * e1 + acc[j][3];
            }
        }
        __syncthreads(); /* every read of the splits, Qe, Aqk, Kd and e^{Γlast} is done */
        if (rr < n && x0 + rc < V) { /* O = half 0 + half 1 */
            const float4 h0 = *reinterpret_cast<const float4 *>(sm + Ly::RED + rr * PS + rc);
            const float4 h1 =
                *reinterpret_cast<const float4 *>(sm + Ly::RED + C * PS + rr * PS + rc);
            const float4 ov = make_float4(h0.x + h1.x, h0.y + h1.y, h0.z + h1.z, h0.w + h1.w);
            float *o = a.o + (r0 + c * C + rr) * HK + h * K + x0 + rc;
            if (o16) {
                *reinterpret_cast<float4 *>(o) = ov;
            } else {
                o[0] = ov.x;
                o[1] = ov.y;
                o[2] = ov.z;
                o[3] = ov.w;
            }
        }
        duet__kda_seq_fetch<K, Ly>(next, x0, sm, bar, 1);
        duet__kda_seq_fetch<K, Ly>(next, x0, sm, bar, 2);
    }
    if (own)
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int d = 16 * md + g + 8 * (q >> 1), x = x0 + cs + 8 * j + 2 * t + (q & 1);
                if (x < V)
                    S[(int64_t)d * V + x] = sr[j][q];
            }
}

/* ---- core: dispatch ----------------------------------------------------------------------- */

extern "C" size_t duet_cuda_kda_scratch_bytes(int64_t max_items, int64_t max_rows, int64_t H,
                                              int64_t K)
{
    if (max_items < 0 || max_rows < 0 || H < 0 || K < 0)
        return 0;
    const int64_t slots = max_rows / DUET_KDA_C + max_items + 1; /* duet__kda_wy_slot */
    /* wy_layout's FLOATS; 0 where there is no chunked form (duet_cuda_kda_core refuses K) */
    const int64_t per = duet__kda_with_k(
        K, [](auto k) { return (int64_t)duet__kda_wy_layout<decltype(k)::value>::FLOATS; },
        [] { return (int64_t)0; });
    return sizeof(float) * (size_t)(slots * H) * (size_t)per;
}

/* The chunked form's kernels need more dynamic shared memory than the 48 KiB default, which must
 * be allowed once per device; done on the first call (a host-side attribute, not a stream
 * operation). */
template <int K>
static duet_status_t duet__kda_chunk_smem_allow(size_t wy_bytes, size_t seq_bytes, size_t tc_bytes)
{
    static int done[64];
    int dev = 0;
    DUET__TRY(cudaGetDevice(&dev), "cudaGetDevice");
    if (dev >= 0 && dev < 64 && __atomic_load_n(&done[dev], __ATOMIC_ACQUIRE))
        return DUET_OK;
    DUET__TRY(cudaFuncSetAttribute(duet__kda_wy_kernel<K>,
                                   cudaFuncAttributeMaxDynamicSharedMemorySize, (int)wy_bytes),
              "ahead kernel shared-memory attribute");
    DUET__TRY(cudaFuncSetAttribute(duet__kda_seq_kernel<K>,
                                   cudaFuncAttributeMaxDynamicSharedMemorySize, (int)seq_bytes),
              "sequential kernel shared-memory attribute");
    DUET__TRY(cudaFuncSetAttribute(duet__kda_seq_tc_kernel<K, 3>,
                                   cudaFuncAttributeMaxDynamicSharedMemorySize, (int)tc_bytes),
              "tensor-core sequential kernel shared-memory attribute");
    DUET__TRY(cudaFuncSetAttribute(duet__kda_seq_tc_kernel<K, 1>,
                                   cudaFuncAttributeMaxDynamicSharedMemorySize, (int)tc_bytes),
              "tensor-core sequential kernel shared-memory attribute");
    if (dev >= 0 && dev < 64)
        __atomic_store_n(&done[dev], 1, __ATOMIC_RELEASE);
    return DUET_OK;
}

template <int K>
static duet_status_t duet__kda_core_launch(cudaStream_t stream, const duet__kda_core_args_t &a)
{
    const int64_t H = a.ly.H;
    dim3 rgrid((unsigned)(a.st.n_items * H), (unsigned)((K + 31) / 32));
    if (!a.st.all_verify)
        DUET__TRY(
            duet_pdl_launch(duet__kda_recur_kernel<K>, rgrid, dim3(32, DUET_KDA_RY), 0, stream, a),
            "recurrent core launch");
    if (a.st.any_verify)
        DUET__TRY(
            duet_pdl_launch(duet__kda_verify_kernel<K>, rgrid, dim3(32, DUET_KDA_RY), 0, stream, a),
            "verify core launch");
    if (a.st.max_item_tokens > 1) {
        const size_t wy_bytes = sizeof(float) * (size_t)duet__kda_chunk_layout<K>::FLOATS;
        const size_t seq_bytes = sizeof(float) * (size_t)duet__kda_seq_layout<K>::FLOATS;
        const size_t tc_bytes = sizeof(float) * (size_t)duet__kda_tc_layout<K>::FLOATS;
        duet_status_t s = duet__kda_chunk_smem_allow<K>(wy_bytes, seq_bytes, tc_bytes);
        if (s != DUET_OK)
            return s;
        DUET__TRY(duet_pdl_launch(duet__kda_wy_kernel<K>,
                                  dim3((unsigned)(a.st.n_items * a.max_chunks), (unsigned)H),
                                  dim3(4 * K), wy_bytes, stream, a),
                  "ahead kernel launch");
        const dim3 sgrid((unsigned)(a.st.n_items * H),
                         (unsigned)((K + DUET_KDA_SEQ_COLS - 1) / DUET_KDA_SEQ_COLS));
        if (a.ly.tc == DUET_CUDA_KDA_TC_SPLIT)
            DUET__TRY(duet_pdl_launch(duet__kda_seq_tc_kernel<K, 3>, sgrid,
                                      dim3(DUET_KDA_SEQ_THREADS), tc_bytes, stream, a),
                      "tensor-core sequential kernel launch");
        else if (a.ly.tc == DUET_CUDA_KDA_TC_ONE)
            DUET__TRY(duet_pdl_launch(duet__kda_seq_tc_kernel<K, 1>, sgrid,
                                      dim3(DUET_KDA_SEQ_THREADS), tc_bytes, stream, a),
                      "tensor-core sequential kernel launch");
        else
            DUET__TRY(duet_pdl_launch(duet__kda_seq_kernel<K>, sgrid, dim3(DUET_KDA_SEQ_THREADS),
                                      seq_bytes, stream, a),
                      "sequential kernel launch");
    }
    return DUET_OK;
}

extern "C" duet_status_t duet_cuda_kda_core(cudaStream_t stream, const duet_cuda_step_t *st,
                                            const duet_cuda_kda_layer_t *ly, const float *qkv,
                                            const float *g, const float *beta, float *o,
                                            void *scratch)
{
    duet_status_t s = duet__kda_check(ly, "core");
    if (s != DUET_OK)
        return s;
    if (ly->K % 16 != 0)
        return duet_error_set(DUET_ERR_UNSUPPORTED,
                              "cuda kda core: K = %lld is not a multiple of 16", (long long)ly->K);
    if (st == NULL || st->n_items < 0 || st->n_rows < 0)
        return duet_error_set(DUET_ERR_INVALID, "cuda kda core: bad step");
    if (st->n_items == 0 || st->n_rows == 0)
        return DUET_OK;
    if ((int64_t)st->n_items * ly->H > 0x7fffffff)
        return duet_error_set(DUET_ERR_RANGE, "cuda kda core: %d items x %lld heads", st->n_items,
                              (long long)ly->H);
    if (st->max_item_tokens > 1 && scratch == NULL)
        return duet_error_set(DUET_ERR_INVALID,
                              "cuda kda core: items of %d tokens need the chunked form's scratch "
                              "(duet_cuda_kda_scratch_bytes), got NULL",
                              st->max_item_tokens);
    if (st->any_verify && (st->item_verify == NULL || ly->replay_base == NULL))
        return duet_error_set(DUET_ERR_INVALID,
                              "cuda kda core: verify items without a replay pool");
    const int64_t max_chunks = (st->max_item_tokens + DUET_KDA_C - 1) / DUET_KDA_C;
    if ((int64_t)st->n_items * max_chunks > 0x7fffffff || ly->H > 65535)
        return duet_error_set(DUET_ERR_RANGE, "cuda kda core: %d items of up to %d tokens",
                              st->n_items, st->max_item_tokens);
    const duet__kda_core_args_t a = {*st, *ly, qkv, g, beta, o, (float *)scratch, (int)max_chunks};
    return duet__kda_with_k(
        ly->K, [&](auto k) { return duet__kda_core_launch<decltype(k)::value>(stream, a); },
        [&] { return duet__kda_no_k(ly->K); });
}

/* ---- chain: conv → prep → core → out, fused for decode batches ---------------------------- */

/* Distributed shared memory and the cluster barrier (sm_90). The arrive/wait pair is split so a
 * block can announce it is done with its peers' shared memory and keep working until it must
 * know they are done with its own. Every thread of each block executes both, once per phase. */
__device__ static inline void duet__cluster_arrive(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release;\n" ::: "memory");
#endif
}

__device__ static inline void duet__cluster_wait(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory");
#endif
}

/* *p in the shared memory of the cluster's block `rank` (p is this block's copy of the array). */
__device__ static inline float duet__dsmem_load(const float *p, unsigned rank)
{
    float v = 0.0f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const unsigned local = (unsigned)__cvta_generic_to_shared(p);
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(remote) : "memory");
#endif
    return v;
}

typedef struct {
    duet_cuda_step_t st;
    duet_cuda_kda_layer_t ly;
    duet_cuda_kda_weights_t w;
    const float *proj, *gate;
    float *qkv, *g, *beta, *o;
    __nv_bfloat16 *ob; /* the verify chain's out rows in bf16 instead of o (NULL: into o) */
} duet__kda_chain_args_t;

/*
 * The whole chain for items of one token. Cluster (item, head) of ceil(K/32) blocks; block j
 * owns channel slice [32j, 32j+32) of q, k, v and g, and the same slice of S's columns, with the
 * recurrent kernel's thread layout (32 columns x 8 row groups, S in registers).
 *   1. its slice of the conv + SiLU (conv kernel's arithmetic) and of the window roll, g and β
 *      (prep's), into its shared memory;
 *   2. cluster barrier; every block gathers the head's q, k and g from its peers' shared memory,
 *      L2-normalises q and k (prep's lane-strided sums, so bit-identical), and runs the
 *      recurrent kernel's update on its columns;
 *   3. cluster barrier; every block gathers the head's o and applies the out kernel's RMS norm
 *      and gate to its columns; a last barrier keeps each block's shared memory alive until its
 *      peers have read it.
 * Every element is computed by the same expression as in the separate kernels, so the results
 * are the unfused chain's bit for bit. It writes what the chain writes: qkv, g, β, o, S and the
 * windows. Items without exactly one token (only zero-token ones can reach it) change nothing.
 */
template <int K>
__global__ static void __launch_bounds__(32 * DUET_KDA_RY)
    duet__kda_decode_kernel(duet__kda_chain_args_t a)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    constexpr int V = K, RPT = K / DUET_KDA_RY;
    const int64_t H = a.ly.H, HK = H * K, C3 = 3 * HK, W = a.ly.W, HKK = H * K * K;
    const int64_t it = blockIdx.x / H, h = blockIdx.x % H;
    const int j = blockIdx.y; /* rank in the cluster (cluster dims (1, gridDim.y, 1)) */
    const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * 32 + tx;
    const int x = j * 32 + tx; /* this thread's channel (phase 1) and column of S */
    const bool active = x < K;
    __shared__ float sx[4][32]; /* this slice: q, k before the norm, v, g prepared */
    __shared__ float sq[K], sk[K], se[K], sall[K], so[32], sinv[2], sbeta;
    __shared__ float red[3][DUET_KDA_RY][33];

    /* Ahead of the wait: the step's metadata, weights, and this block's columns of S and its
     * conv windows, into registers: only this layer's chain writes them, and earlier steps'
     * chains have completed (cuda_pdl.cuh allows inputs no kernel of the step writes). So their
     * round trip overlaps the previous kernel (bench/RESULTS.md, "KDA decode chain: state
     * loaded before the PDL wait"). */
    const int64_t row = a.st.item_row0[it];
    const bool one = a.st.item_row0[it + 1] - row == 1;
    float *blk = duet__kda_block(a.ly, a.st.item_slot[it]);
    float *S = blk + h * K * V;
    const int64_t ch = (int64_t)ty * HK + h * K + x; /* phase 1, ty < 3: q, k or v channel */
    float tp[DUET_KDA_MAX_W - 1], tlast = 0.0f, wgt = 0.0f;
#pragma unroll
    for (int jj = 0; jj < DUET_KDA_MAX_W - 1; jj++)
        tp[jj] = ty < 3 && active && jj < W - 1 ? a.w.taps[ch * W + jj] : 0.0f;
    if (ty < 3 && active)
        tlast = a.w.taps[ch * W + W - 1];
    else if (ty == 3 && active)
        wgt = a.w.dt_bias[h * K + x];
    else if (ty == 4 && active)
        wgt = a.w.o_norm[x];
    const float nA = a.w.neg_A[h];

    float s[RPT], wu[DUET_KDA_MAX_W - 1];
#pragma unroll
    for (int r = 0; r < RPT; r++)
        s[r] = one && active ? S[(int64_t)(ty + DUET_KDA_RY * r) * V + x] : 0.0f;
    float *win = blk + HKK + ch * (W - 1); /* q, k, v channels (ty < 3) only */
#pragma unroll
    for (int jj = 0; jj < DUET_KDA_MAX_W - 1; jj++)
        wu[jj] = one && active && ty < 3 && jj < W - 1 ? win[jj] : 0.0f;

    duet_pdl_wait(); /* proj, g, beta, gate */
    duet_pdl_trigger();

    /* 1. conv + SiLU and window roll (ty 0..2), g (ty 3), β (thread 5·32). */
    if (one && active && ty < 3) {
        const float xin = a.proj[row * C3 + ch];
        const float y = duet__kda_conv_out(tp, wu, tlast, xin, W);
        sx[ty][tx] = y;
        if (ty == 2)
            a.qkv[row * C3 + ch] = y;
#pragma unroll
        for (int jj = 0; jj < DUET_KDA_MAX_W - 1; jj++)
            if (jj < W - 1)
                win[jj] = jj == W - 2 ? xin : wu[jj + 1 < DUET_KDA_MAX_W - 1 ? jj + 1 : jj];
    } else if (one && active && ty == 3) {
        float *gp = a.g + row * HK + h * K + x;
        const float gv = nA * duet__softplus(*gp + wgt);
        sx[3][tx] = gv;
        *gp = gv; /* in place: only this thread reads or writes this element */
    }
    if (tid == 5 * 32)
        sbeta = one ? duet__sigmoid(a.beta[row * H + h]) : 0.0f;
    duet__cluster_arrive(); /* every block has read the raw β before block 0 overwrites it */
    duet__cluster_wait();

    /* 2. The head's q, k, g from the slices' owners; norms as prep (lane-strided, then the
     * butterfly), then the recurrent update. */
    if (tid < K) {
        const unsigned owner = (unsigned)tid >> 5;
        sq[tid] = duet__dsmem_load(&sx[0][tid & 31], owner);
        sk[tid] = duet__dsmem_load(&sx[1][tid & 31], owner);
        se[tid] = expf(duet__dsmem_load(&sx[3][tid & 31], owner));
    }
    __syncthreads();
    if (ty < 2) {
        const float *xv = ty == 0 ? sq : sk;
        float ss = 0.0f;
        for (int d = tx; d < K; d += 32)
            ss += xv[d] * xv[d];
        const float inv = duet__kda_l2_factor(duet__warp_sum(ss), ty, K);
        if (tx == 0)
            sinv[ty] = inv;
    }
    __syncthreads();
    if (tid < K) {
        sq[tid] *= sinv[0];
        sk[tid] *= sinv[1];
    }
    if (one && active && ty < 2)
        a.qkv[row * C3 + ch] = sx[ty][tx] * sinv[ty];
    if (one && j == 0 && tid == 0)
        a.beta[row * H + h] = sbeta;
    __syncthreads();

    float kv, qs, kq;
    duet__kda_decay_dots<RPT>(s, se, sk, sq, red, tx, ty, &kv, &qs, &kq);
    const float u = sbeta * (sx[2][tx] - kv);
    if (ty == 0)
        so[tx] = qs + u * kq;
    if (one && active) {
        duet__kda_state_store<RPT>(S, V, x, ty, s, sk, u);
    }
    duet__cluster_arrive(); /* so is complete in every block */
    duet__cluster_wait();

    /* 3. The head's o, then out's norm and gate on this block's columns. */
    if (tid < K)
        sall[tid] = duet__dsmem_load(&so[tid & 31], (unsigned)tid >> 5);
    duet__cluster_arrive(); /* done with the peers' shared memory */
    __syncthreads();
    if (ty == 4) {
        float ss = 0.0f;
        for (int d = tx; d < K; d += 32)
            ss += sall[d] * sall[d];
        ss = duet__warp_sum(ss);
        const float inv = 1.0f / sqrtf(ss / (float)K + a.w.eps);
        if (one && active) {
            const int64_t e = row * HK + h * K + x;
            a.o[e] = wgt * (sall[x] * inv) * duet__sigmoid(a.gate[e]);
        }
    }
    duet__cluster_wait(); /* the peers are done with this block's shared memory */
#else
    (void)a;
#endif
}

/*
 * The chain for a step of verify items (up to NR rows each) beside items of one token, in the
 * decode kernel's layout (cluster (item, head), block j owning channel slice j and the same
 * columns of S). A verify item reads its S and window and leaves them as they are: block j
 * convolves its slice of every row in turn (its inputs to the item's replay rows), prepares g
 * and β of every row; after one cluster barrier each block gathers every row's q, k and g,
 * normalises them, runs the rows' recurrence on a register copy of its columns, and writes the
 * rows' k, v, g, β slices to the replay rows; after a second, the out norm and gate of every row
 * (a warp per row). An item of one token that is no verify item is the decode kernel's step,
 * S and window written. Every element comes from the separate kernels' expressions in their
 * order (the verify kernel's row loop, duet__kda_recur_rows), so the results are theirs bit for
 * bit; with a.ob the out rows go there in bf16, as the out kernel's. Other items (no rows, or a
 * plain item of more) change nothing: the launcher sends only steps without them.
 */
template <int K, int NR>
__global__ static void __launch_bounds__(32 * DUET_KDA_RY)
    duet__kda_verify_chain_kernel(duet__kda_chain_args_t a)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    constexpr int V = K, RPT = K / DUET_KDA_RY;
    const int64_t H = a.ly.H, HK = H * K, C3 = 3 * HK, W = a.ly.W, HKK = H * K * K;
    const int64_t it = blockIdx.x / H, h = blockIdx.x % H;
    const int j = blockIdx.y; /* rank in the cluster */
    const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * 32 + tx;
    const int x = j * 32 + tx;
    const bool active = x < K;
    __shared__ float sx[NR][4][32]; /* per row, this slice: q, k before the norm, v, g */
    __shared__ float sq[NR][K], sk[NR][K], se[NR][K], sall[NR][K], so[NR][32];
    __shared__ float sinv[NR][2], sbeta[NR];
    __shared__ float red[3][DUET_KDA_RY][33];

    /* Ahead of the wait, as the decode kernel: metadata, weights, S's columns and the window
     * (only this layer's chain writes them; the step's replay kernel has completed). */
    const int64_t row = a.st.item_row0[it];
    const int64_t n_it = a.st.item_row0[it + 1] - row;
    const bool ver = duet__kda_is_verify(a.st, it);
    const int n = ver ? (n_it <= NR ? (int)n_it : 0) : (n_it == 1 ? 1 : 0); /* uniform */
    const int32_t slot = a.st.item_slot[it];
    float *blk = duet__kda_block(a.ly, slot);
    float *S = blk + h * K * V;
    const int64_t ch = (int64_t)ty * HK + h * K + x; /* ty < 3: q, k or v channel */
    float tp[DUET_KDA_MAX_W - 1], tlast = 0.0f, gb = 0.0f, on = 0.0f;
#pragma unroll
    for (int jj = 0; jj < DUET_KDA_MAX_W - 1; jj++)
        tp[jj] = ty < 3 && active && jj < W - 1 ? a.w.taps[ch * W + jj] : 0.0f;
    if (ty < 3 && active)
        tlast = a.w.taps[ch * W + W - 1];
    else if (ty == 3 && active)
        gb = a.w.dt_bias[h * K + x];
    if (active)
        on = a.w.o_norm[x];
    const float nA = a.w.neg_A[h];
    float s[RPT], u[DUET_KDA_MAX_W - 1];
#pragma unroll
    for (int r = 0; r < RPT; r++)
        s[r] = n > 0 && active ? S[(int64_t)(ty + DUET_KDA_RY * r) * V + x] : 0.0f;
    float *win = blk + HKK + ch * (W - 1);
#pragma unroll
    for (int jj = 0; jj < DUET_KDA_MAX_W - 1; jj++)
        u[jj] = n > 0 && active && ty < 3 && jj < W - 1 ? win[jj] : 0.0f;

    duet_pdl_wait(); /* proj, g, beta, gate */
    duet_pdl_trigger();
    if (n == 0) /* the whole cluster: nothing to do, no barrier to meet */
        return;

    /* 1. conv + SiLU of every row with the window rolled in registers (ty 0..2), g (ty 3),
     * β (thread 5·32). */
    if (active && ty < 3) {
        for (int t = 0; t < n; t++) {
            const float xin = a.proj[(row + t) * C3 + ch];
            if (ver)
                duet__kda_replay_row(a.ly, slot, a.ly.layer, t)[ch] = xin;
            const float y = duet__kda_conv_out(tp, u, tlast, xin, W);
            sx[t][ty][tx] = y;
            if (ty == 2)
                a.qkv[(row + t) * C3 + ch] = y;
#pragma unroll
            for (int jj = 0; jj < DUET_KDA_MAX_W - 1; jj++)
                if (jj < W - 1)
                    u[jj] = jj == W - 2 ? xin : u[jj + 1 < DUET_KDA_MAX_W - 1 ? jj + 1 : jj];
        }
        if (!ver)
#pragma unroll
            for (int jj = 0; jj < DUET_KDA_MAX_W - 1; jj++)
                if (jj < W - 1)
                    win[jj] = u[jj];
    } else if (active && ty == 3) {
        for (int t = 0; t < n; t++) {
            float *gp = a.g + (row + t) * HK + h * K + x;
            const float gv = nA * duet__softplus(*gp + gb);
            sx[t][3][tx] = gv;
            *gp = gv;
        }
    }
    if (tid == 5 * 32)
        for (int t = 0; t < n; t++)
            sbeta[t] = duet__sigmoid(a.beta[(row + t) * H + h]);
    duet__cluster_arrive(); /* every block has read the raw β before block 0 overwrites it */
    duet__cluster_wait();

    /* 2. Every row's q, k, g from the slices' owners, the norms (a warp per row and part, prep's
     * lane-strided sums), the rows' k, v, g, β to the replay rows, then the recurrence. */
    for (int i = tid; i < n * K; i += 32 * DUET_KDA_RY) {
        const int t = i / K, d = i % K;
        const unsigned owner = (unsigned)d >> 5;
        sq[t][d] = duet__dsmem_load(&sx[t][0][d & 31], owner);
        sk[t][d] = duet__dsmem_load(&sx[t][1][d & 31], owner);
        se[t][d] = expf(duet__dsmem_load(&sx[t][3][d & 31], owner));
    }
    __syncthreads();
    for (int w = ty; w < 2 * n; w += DUET_KDA_RY) {
        const int t = w >> 1, part = w & 1;
        const float *xv = part == 0 ? sq[t] : sk[t];
        float ss = 0.0f;
        for (int d = tx; d < K; d += 32)
            ss += xv[d] * xv[d];
        const float inv = duet__kda_l2_factor(duet__warp_sum(ss), part, K);
        if (tx == 0)
            sinv[t][part] = inv;
    }
    __syncthreads();
    for (int i = tid; i < n * K; i += 32 * DUET_KDA_RY) {
        const int t = i / K, d = i % K;
        sq[t][d] *= sinv[t][0];
        sk[t][d] *= sinv[t][1];
    }
    if (active && ty < 4)
        for (int t = 0; t < n; t++) {
            const float v = ty < 2 ? sx[t][ty][tx] * sinv[t][ty] : sx[t][ty][tx];
            if (ty < 2)
                a.qkv[(row + t) * C3 + ch] = v;
            if (ver && ty > 0) /* k, v, g: replay fields 3, 4, 5 */
                duet__kda_replay_row(a.ly, slot, a.ly.layer, t)[(2 + ty) * HK + h * K + x] = v;
        }
    if (j == 0 && tid == 0)
        for (int t = 0; t < n; t++) {
            a.beta[(row + t) * H + h] = sbeta[t];
            if (ver)
                duet__kda_replay_row(a.ly, slot, a.ly.layer, t)[6 * HK + h] = sbeta[t];
        }
    __syncthreads();

    for (int t = 0; t < n; t++) {
        float kv, qs, kq;
        duet__kda_decay_dots<RPT>(s, se[t], sk[t], sq[t], red, tx, ty, &kv, &qs, &kq);
        const float uu = sbeta[t] * (sx[t][2][tx] - kv);
        if (ty == 0) {
            so[t][tx] = qs + uu * kq;
            if (a.ob != NULL && active) /* o keeps the core's output, as with the four calls */
                a.o[(row + t) * HK + h * K + x] = qs + uu * kq;
        }
#pragma unroll
        for (int r = 0; r < RPT; r++) {
            const int d = ty + DUET_KDA_RY * r;
            s[r] = s[r] + sk[t][d] * uu; /* duet__kda_state_store's value */
        }
        __syncthreads(); /* red is rewritten by the next row */
    }
    if (!ver && active)
#pragma unroll
        for (int r = 0; r < RPT; r++)
            S[(int64_t)(ty + DUET_KDA_RY * r) * V + x] = s[r];
    duet__cluster_arrive(); /* so is complete in every block */
    duet__cluster_wait();

    /* 3. Every row's o, then out's norm and gate on this block's columns, a warp per row. */
    for (int i = tid; i < n * K; i += 32 * DUET_KDA_RY)
        sall[i / K][i % K] = duet__dsmem_load(&so[i / K][i % K & 31], (unsigned)(i % K) >> 5);
    duet__cluster_arrive(); /* done with the peers' shared memory */
    __syncthreads();
    for (int t = ty; t < n; t += DUET_KDA_RY) {
        float ss = 0.0f;
        for (int d = tx; d < K; d += 32)
            ss += sall[t][d] * sall[t][d];
        ss = duet__warp_sum(ss);
        const float inv = 1.0f / sqrtf(ss / (float)K + a.w.eps);
        if (active) {
            const int64_t e = (row + t) * HK + h * K + x;
            const float v = on * (sall[t][x] * inv) * duet__sigmoid(a.gate[e]);
            if (a.ob != NULL)
                a.ob[e] = __float2bfloat16_rn(v);
            else
                a.o[e] = v;
        }
    }
    duet__cluster_wait(); /* the peers are done with this block's shared memory */
#else
    (void)a;
#endif
}

/* Whether the current device launches thread-block clusters (sm_90+); asked once per device. */
static duet_status_t duet__kda_clusters(int *ok_p)
{
    static int known[64]; /* 0 unknown, 1 no, 2 yes */
    int dev = 0;
    DUET__TRY(cudaGetDevice(&dev), "cudaGetDevice");
    if (dev >= 0 && dev < 64) {
        const int k = __atomic_load_n(&known[dev], __ATOMIC_ACQUIRE);
        if (k != 0) {
            *ok_p = k == 2;
            return DUET_OK;
        }
    }
    int v = 0;
    DUET__TRY(cudaDeviceGetAttribute(&v, cudaDevAttrClusterLaunch, dev), "cluster attribute");
    if (dev >= 0 && dev < 64)
        __atomic_store_n(&known[dev], v ? 2 : 1, __ATOMIC_RELEASE);
    *ok_p = v != 0;
    return DUET_OK;
}

/* The decode kernel, or with verify the verify chain kernel: a cluster per (item, head). */
template <int K>
static duet_status_t duet__kda_decode_launch(cudaStream_t stream, const duet__kda_chain_args_t &a,
                                             bool verify)
{
    const unsigned cl = (unsigned)((K + 31) / 32);
    dim3 grid((unsigned)(a.st.n_items * a.ly.H), cl);
    cudaLaunchAttribute cluster; /* (1, cl, 1) blocks share their shared memory */
    memset(&cluster, 0, sizeof(cluster));
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = 1;
    cluster.val.clusterDim.y = cl;
    cluster.val.clusterDim.z = 1;
    if (verify) {
        DUET__TRY(duet_pdl_launch_attr(duet__kda_verify_chain_kernel<K, DUET_KDA_VERIFY_ROWS>, grid,
                                       dim3(32, DUET_KDA_RY), 0, stream, &cluster, a),
                  "verify chain launch");
        __atomic_fetch_add(&duet__kda_verify_chains, 1, __ATOMIC_RELAXED);
    } else
        DUET__TRY(duet_pdl_launch_attr(duet__kda_decode_kernel<K>, grid, dim3(32, DUET_KDA_RY), 0,
                                       stream, &cluster, a),
                  "decode chain launch");
    return DUET_OK;
}

extern "C" duet_status_t duet_cuda_kda_chain(cudaStream_t stream, const duet_cuda_step_t *st,
                                             const duet_cuda_kda_layer_t *ly,
                                             const duet_cuda_kda_weights_t *w, const float *proj,
                                             const float *gate, float *qkv, float *g, float *beta,
                                             float *o, void *ob, void *scratch)
{
    duet_status_t s = duet__kda_check(ly, "chain");
    if (s != DUET_OK)
        return s;
    if (ly->K % 16 != 0)
        return duet_error_set(DUET_ERR_UNSUPPORTED,
                              "cuda kda chain: K = %lld is not a multiple of 16", (long long)ly->K);
    if (st == NULL || st->n_items < 0 || st->n_rows < 0 || w == NULL)
        return duet_error_set(DUET_ERR_INVALID, "cuda kda chain: bad step or weights");
    if (st->n_items == 0 || st->n_rows == 0)
        return DUET_OK;
    if ((int64_t)st->n_items * ly->H > 0x7fffffff)
        return duet_error_set(DUET_ERR_RANGE, "cuda kda chain: %d items x %lld heads", st->n_items,
                              (long long)ly->H);
    /* one kernel: decode steps, and steps of verify items (of at most DUET_KDA_VERIFY_ROWS rows:
     * the replay rows bound them) beside one-token items */
    const bool few = st->max_item_tokens == 1 && !duet__kda_fused_off &&
                     (int64_t)st->n_items * ly->H <= DUET_KDA_FUSED_MAX_CLUSTERS;
    const bool small = few && !st->any_verify && ob == NULL;
    const bool verify = few && st->any_verify && ly->replay_base != NULL &&
                        ly->replay_rows <= DUET_KDA_VERIFY_ROWS &&
                        (int64_t)st->n_items * ly->H <= DUET_KDA_VERIFY_MAX_CLUSTERS;
    int clusters = 0;
    if ((small || verify) && (s = duet__kda_clusters(&clusters)) != DUET_OK)
        return s;
    /* prefill, large batches, no clusters: the separate kernels, q and k normalised in the conv
     * where it can */
    if (!(small || verify) || !clusters) {
        bool normed;
        if ((s = duet__kda_conv(stream, st, ly, w->taps, proj, qkv, true, &normed)) != DUET_OK ||
            (s = duet__kda_prep(stream, st->n_rows, ly, w->neg_A, w->dt_bias, qkv, g, beta,
                                !normed)) != DUET_OK ||
            (s = duet_cuda_kda_core(stream, st, ly, qkv, g, beta, o, scratch)) != DUET_OK)
            return s;
        return duet__kda_out(stream, st->n_rows, ly->H, ly->K, w->o_norm, w->eps, gate, o,
                             (__nv_bfloat16 *)ob);
    }
    const duet__kda_chain_args_t a = {*st, *ly, *w,   proj, gate,
                                      qkv, g,   beta, o,    (__nv_bfloat16 *)ob};
    return duet__kda_with_k(
        ly->K,
        [&](auto k) { return duet__kda_decode_launch<decltype(k)::value>(stream, a, verify); },
        [&] { return duet__kda_no_k(ly->K); });
}
