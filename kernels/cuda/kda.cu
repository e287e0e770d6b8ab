/*
 * kda.cu: the KDA mixer's sequence-dependent kernels (cuda_kda.h has the contract; the CPU
 * reference is engine/model.c duet__kda_*_task and engine/kda.c).
 *
 * conv: one thread per (channel, run of consecutive rows) slides the last W-1 inputs along in
 *   registers (starting from the item's window), so runs are independent of each other and
 *   each input is read once. A second launch then rolls each (item, channel) window
 *   forward: a separate kernel because the first one still reads the old windows.
 * prep / out: one warp per (row, head); lanes stride over the head's K channels.
 * core, recurrent (items of one token, the decode path): the state is the traffic, 64 KiB per
 *   head at K = V = 128. Column x of S evolves on its own (o[x], the delta u[x] and S[:, x] only
 *   need column x plus the shared q, k, g), so a block of 32 columns x 8 row groups loads each
 *   element of S once into a register, decays it, forms the two column sums Σ S k and Σ S q
 *   (8-way shared-memory reduction), and writes S back once: o = Σ_d S'[d] q[d] + u (k·q).
 * core, chunked (items of 2+ tokens): one block per (item, head), 4·K threads, chunks of 64
 *   tokens in order; when that leaves SMs idle, one block per (item, head, slice of the columns),
 *   each doing the shared steps 1-4 (the kernel's numbering) and steps 5-8 for its own columns
 *   (duet__kda_vsplit); with scratch, L and Aqk of every chunk come from duet__kda_lqk_kernel,
 *   which computes them for all chunks in parallel beforehand (they do not depend on S), and
 *   load with the chunk. Thread (x, dq) keeps the quarter dq of column x of S in registers for the
 *   whole item, so S is read and written once per item. Per chunk, in shared memory:
 *     Γ     cumulative log-decay, stored in log2 units so every decay is one ex2;
 *     L     L[i][j] = -β_i Σ_d k_i k_j e^{Γi−Γj} (j < i), Aqk[i][j] = Σ_d q_i k_j e^{Γi−Γj}
 *           (j <= i): each pairwise decay is exp2 of a *difference* Γi − Γj <= 0 (clamped to <= 0
 *           so the masked j > i half cannot overflow either), never a ratio of exponentials,
 *           the property engine/kda.c's header asks for (e^{Γ} alone underflows within a chunk);
 *     Y     = β V − (β e^Γ ⊙ K) S,    V_new = (I − L)^{-1} Y by forward substitution,
 *     O     = (e^Γ ⊙ Q) S + Aqk V_new,    S ← e^{Γlast} S + (e^{Γlast−Γ} ⊙ K)ᵀ V_new.
 *   Γ is an fp32 running sum, so a decay carries an absolute error of about |Γ|·2^-24 in its
 *   exponent (as in the usual chunked GPU kernels); the CPU's products of per-token decays do
 *   not, which is where the two differ most when decays are large within a chunk.
 *   This is engine/kda.c's U − W S = T(βV) − T(βe^Γ K) S with T applied once, to Y. Everything
 *   after L and Aqk is local to a column of V, whose four quarter-owners sit in one warp, so
 *   those phases need shuffles and no block barriers; V_new never leaves registers.
 * The core's kernels are templated on K (16, 32, ..., 128) so the register arrays are static.
 * chain, decode (duet_cuda_kda_chain with one token per item): at batch 1 the five kernels above
 *   are ~21 us of mostly launch and dependency latency for ~2 MB, so one kernel does all of it:
 *   a thread-block cluster per (item, head), one block per 32-channel slice (the recurrent
 *   kernel's blocks), exchanging the head's q, k, g and then o through distributed shared memory
 *   so each block can take the head-wide norms. Prefill and large decode batches (over
 *   DUET_KDA_FUSED_MAX_CLUSTERS (item, head) pairs) keep the separate kernels.
 * Every kernel launches with programmatic dependent launch (cuda_pdl.cuh): before its wait it
 * only reads weights and the step's metadata, and prefetches the state S into L2 (only this
 * layer's core writes S, and a prefetch cannot return stale data).
 */
#include <stdlib.h>

#include <cuda_runtime.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_kda.h"
#include "kernels/cuda/cuda_pdl.cuh"

#define DUET__MODULE          "cuda kda" /* the prefix of this file's error details */
#define DUET__TRY(call, what) DUET_CUDA_TRY(call, DUET__MODULE, what)

#define DUET_KDA_C      64 /* chunk length, engine/kda.h DUET_KDA_CHUNK */
#define DUET_KDA_MAX_K  128
#define DUET_KDA_MAX_W  8
#define DUET_KDA_L2_EPS 1e-6f /* engine/model.c DUET_L2_EPS */
#define DUET_LOG2E      1.4426950408889634f
/* The chain fuses a decode step only up to this many (item, head) clusters. Measured on an H200
 * (ncu, H = 32, K = 128): at 1 item the fused kernel takes 7.3 us against 17.0 for the five
 * separate kernels, at 8 items 17.9 against 25.3, but at 64 items 133 against 123: its blocks
 * live longer (three cluster barriers, serial phases), so once there are many waves the state
 * streams more slowly than in the recurrent kernel. Interpolated, the two cross near 1000. */
#define DUET_KDA_FUSED_MAX_CLUSTERS 768

/* ---- argument checks ---------------------------------------------------------------------- */

/* Shapes every kernel here supports; the core also needs K % 16 == 0 (checked where used). */
static duet_status_t duet__kda_check(const duet_cuda_kda_layer_t *ly, const char *what)
{
    if (ly == NULL || ly->kda_base == NULL || ly->H < 1 || ly->K < 1 || ly->W < 1 ||
        ly->layer < 0 || ly->layer >= ly->kda_n_layers ||
        ly->kda_layer_floats < ly->H * ly->K * ly->K + 3 * ly->H * ly->K * (ly->W - 1))
        return duet_error_set(DUET_ERR_INVALID, "cuda kda %s: bad layer description", what);
    if (ly->K > DUET_KDA_MAX_K || ly->W > DUET_KDA_MAX_W)
        return duet_error_set(DUET_ERR_UNSUPPORTED,
                              "cuda kda %s: K = %lld, W = %lld (supported: K <= %d, W <= %d)", what,
                              (long long)ly->K, (long long)ly->W, DUET_KDA_MAX_K, DUET_KDA_MAX_W);
    return DUET_OK;
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
 * new input x, in the CPU loop's order. The conv kernel and the decode chain both call it, so
 * the chain's conv is the conv kernel's bit for bit. */
__device__ static inline float duet__kda_conv_out(const float (&tp)[DUET_KDA_MAX_W - 1],
                                                  const float (&u)[DUET_KDA_MAX_W - 1], float tlast,
                                                  float x, int64_t W)
{
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < DUET_KDA_MAX_W - 1; j++)
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

/* 4-byte asynchronous global → shared copy; with ok false nothing is read and *dst becomes 0. */
__device__ static inline void duet__cp_async4(float *dst, const float *src, bool ok)
{
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src),
                 "r"(ok ? 4 : 0)
                 : "memory");
}

__device__ static inline void duet__cp_async_wait_all(void)
{
    asm volatile("cp.async.wait_all;\n" ::: "memory");
}

/* a[t] for a runtime t of a register array (a chain of selects: a dynamic index would move the
 * array to local memory), and a[t] = v. */
template <int N> __device__ static inline float duet__pick(const float (&a)[N], int t)
{
    float v = a[0];
#pragma unroll
    for (int p = 1; p < N; p++)
        v = p == t ? a[p] : v;
    return v;
}

template <int N> __device__ static inline void duet__put(float (&a)[N], int t, float v)
{
#pragma unroll
    for (int p = 0; p < N; p++)
        a[p] = p == t ? v : a[p];
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

/* The KDA layer block of (slot, layer): S [H][K][V], then the windows [3*H*K][W-1]. */
__device__ static inline float *duet__kda_block(const duet_cuda_kda_layer_t &ly, int32_t slot)
{
    return ly.kda_base + ((int64_t)slot * ly.kda_n_layers + ly.layer) * ly.kda_layer_floats;
}

/* ---- conv --------------------------------------------------------------------------------- */

/* qkv[row][ch] = SiLU(Σ_j taps[ch][j] · u[t-(W-1)+j][ch]); u is the window then the item's rows.
 * Summation order j = 0..W-1, as the CPU loop. A thread runs down R consecutive rows of one
 * channel with the last W-1 inputs in registers, so each input is loaded once and the row's
 * item is looked up only when the rows cross into the next item (R = 1 for decode batches, where
 * every row is its own item and parallelism matters more). The arrays are sized for W <= 8 and
 * indexed statically; positions past W-2 are ignored. */
#ifndef DUET_KDA_CONV_AHEAD
/* A thread's rows whose inputs it loads before using any. H200, 8-layer prefill of 2048 /
 * 8192 tokens side by side in one command: 24.63 / 24.65 and 111.5 / 112.3 ms against 24.73 /
 * 24.73 and 111.6 / 112.8 with 1 (a round trip per row). */
#define DUET_KDA_CONV_AHEAD 4
#endif
__global__ static void duet__kda_conv_kernel(duet_cuda_step_t st, duet_cuda_kda_layer_t ly,
                                             const float *__restrict__ taps,
                                             const float *__restrict__ proj,
                                             float *__restrict__ qkv, int R)
{
    const int64_t C3 = 3 * ly.H * ly.K, W = ly.W, HKK = ly.H * ly.K * ly.K;
    const int64_t ch = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const bool on = ch < C3;
    float tp[DUET_KDA_MAX_W - 1]; /* weights: loaded ahead of the wait */
#pragma unroll
    for (int j = 0; j < DUET_KDA_MAX_W - 1; j++)
        tp[j] = on && j < W - 1 ? taps[ch * W + j] : 0.0f;
    const float tlast = on ? taps[ch * W + W - 1] : 0.0f;
    duet_pdl_wait(); /* proj */
    duet_pdl_trigger();
    if (!on)
        return;
    for (int64_t ra = (int64_t)blockIdx.y * R; ra < st.n_rows; ra += (int64_t)gridDim.y * R) {
        const int64_t rb = ra + R < st.n_rows ? ra + R : st.n_rows;
        int32_t it = st.row_item[ra];
        int64_t r0 = st.item_row0[it], r1 = st.item_row0[it + 1];
        const float *win = duet__kda_block(ly, st.item_slot[it]) + HKK + ch * (W - 1);
        float u[DUET_KDA_MAX_W - 1]; /* u[j]: input at t-(W-1)+j for the next row t */
#pragma unroll
        for (int j = 0; j < DUET_KDA_MAX_W - 1; j++) {
            const int64_t tau = (ra - r0) - (W - 1) + j;
            u[j] = j >= W - 1 ? 0.0f : tau >= 0 ? proj[(r0 + tau) * C3 + ch] : win[(W - 1) + tau];
        }
        for (int64_t rg = ra; rg < rb; rg += DUET_KDA_CONV_AHEAD) {
            /* the group's inputs first, all in flight together: they do not depend on the
             * items, only the windows do */
            float xg[DUET_KDA_CONV_AHEAD];
#pragma unroll
            for (int g = 0; g < DUET_KDA_CONV_AHEAD; g++)
                xg[g] = rg + g < rb ? proj[(rg + g) * C3 + ch] : 0.0f;
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
                    win = duet__kda_block(ly, st.item_slot[it]) + HKK + ch * (W - 1);
#pragma unroll
                    for (int j = 0; j < DUET_KDA_MAX_W - 1; j++)
                        u[j] = j < W - 1 ? win[j] : 0.0f;
                }
                const float x = xg[g];
                qkv[row * C3 + ch] = duet__kda_conv_out(tp, u, tlast, x, W);
#pragma unroll
                for (int j = 0; j < DUET_KDA_MAX_W - 1; j++)
                    u[j] = j == W - 2 ? x : (j + 1 < DUET_KDA_MAX_W - 1 ? u[j + 1] : u[j]);
            }
        }
    }
}

/* The new window of (item, channel) is concat(window, inputs)[n .. n+W-1). */
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

extern "C" duet_status_t duet_cuda_kda_conv(cudaStream_t stream, const duet_cuda_step_t *st,
                                            const duet_cuda_kda_layer_t *ly, const float *taps,
                                            const float *proj, float *qkv)
{
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
    dim3 grid(duet__blocks(C3, th, 1 << 30), duet__blocks(st->n_rows, R, 65535));
    DUET__TRY(duet_pdl_launch(duet__kda_conv_kernel, grid, dim3(th), 0, stream, *st, *ly, taps,
                              proj, qkv, R),
              "conv launch");
    if (ly->W > 1) {
        dim3 wgrid(duet__blocks(C3, th, 1 << 30), duet__blocks(st->n_items, 1, 65535));
        DUET__TRY(
            duet_pdl_launch(duet__kda_window_kernel, wgrid, dim3(th), 0, stream, *st, *ly, proj),
            "conv window launch");
    }
    return DUET_OK;
}

/* ---- prep --------------------------------------------------------------------------------- */

__global__ static void duet__kda_prep_kernel(int64_t n_rows, int64_t H, int64_t K,
                                             const float *neg_A, const float *dt_bias, float *qkv,
                                             float *g, float *beta)
{
    const int lane = threadIdx.x & 31;
    const int64_t HK = H * K, C3 = 3 * HK;
    const int64_t warps = (int64_t)gridDim.x * (blockDim.x / 32);
    const float scale = 1.0f / sqrtf((float)K);
    duet_pdl_wait(); /* qkv, g, beta */
    duet_pdl_trigger();
    for (int64_t wi = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; wi < n_rows * H;
         wi += warps) {
        const int64_t row = wi / H, h = wi % H;
        float *gr = g + row * HK + h * K;
        const float nA = neg_A[h];
        for (int64_t d = lane; d < K; d += 32)
            gr[d] = nA * duet__softplus(gr[d] + dt_bias[h * K + d]);
        if (lane == 0)
            beta[row * H + h] = duet__sigmoid(beta[row * H + h]);
        for (int part = 0; part < 2; part++) {
            float *x = qkv + row * C3 + part * HK + h * K;
            float ss = 0.0f;
            for (int64_t d = lane; d < K; d += 32)
                ss += x[d] * x[d];
            ss = duet__warp_sum(ss);
            float inv = 1.0f / sqrtf(ss + DUET_KDA_L2_EPS);
            if (part == 0)
                inv *= scale;
            for (int64_t d = lane; d < K; d += 32)
                x[d] *= inv;
        }
    }
}

extern "C" duet_status_t duet_cuda_kda_prep(cudaStream_t stream, int64_t n_rows,
                                            const duet_cuda_kda_layer_t *ly, const float *neg_A,
                                            const float *dt_bias, float *qkv, float *g, float *beta)
{
    if (ly == NULL || ly->H < 1 || ly->K < 1 || n_rows < 0)
        return duet_error_set(DUET_ERR_INVALID, "cuda kda prep: bad arguments");
    if (n_rows == 0)
        return DUET_OK;
    const int th = 256;
    DUET__TRY(duet_pdl_launch(duet__kda_prep_kernel,
                              dim3(duet__blocks(n_rows * ly->H, th / 32, 1 << 20)), dim3(th), 0,
                              stream, n_rows, ly->H, ly->K, neg_A, dt_bias, qkv, g, beta),
              "prep launch");
    return DUET_OK;
}

/* ---- out ---------------------------------------------------------------------------------- */

__global__ static void duet__kda_out_kernel(int64_t n_rows, int64_t H, int64_t K,
                                            const float *o_norm, float eps, const float *gate,
                                            float *o)
{
    const int lane = threadIdx.x & 31;
    const int64_t warps = (int64_t)gridDim.x * (blockDim.x / 32);
    duet_pdl_wait(); /* o, gate */
    duet_pdl_trigger();
    for (int64_t wi = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; wi < n_rows * H;
         wi += warps) {
        float *x = o + wi * K; /* row * HK + h * K */
        const float *gt = gate + wi * K;
        float ss = 0.0f;
        for (int64_t d = lane; d < K; d += 32)
            ss += x[d] * x[d];
        ss = duet__warp_sum(ss);
        const float inv = 1.0f / sqrtf(ss / (float)K + eps);
        for (int64_t d = lane; d < K; d += 32)
            x[d] = o_norm[d] * (x[d] * inv) * duet__sigmoid(gt[d]);
    }
}

extern "C" duet_status_t duet_cuda_kda_out(cudaStream_t stream, int64_t n_rows, int64_t H,
                                           int64_t K, const float *o_norm, float eps,
                                           const float *gate, float *o)
{
    if (H < 1 || K < 1 || n_rows < 0)
        return duet_error_set(DUET_ERR_INVALID, "cuda kda out: bad arguments");
    if (n_rows == 0)
        return DUET_OK;
    const int th = 256;
    DUET__TRY(duet_pdl_launch(duet__kda_out_kernel,
                              dim3(duet__blocks(n_rows * H, th / 32, 1 << 20)), dim3(th), 0, stream,
                              n_rows, H, K, o_norm, eps, gate, o),
              "out launch");
    return DUET_OK;
}

/* ---- core: recurrent (items of one token) ------------------------------------------------- */

typedef struct {
    duet_cuda_step_t st;
    duet_cuda_kda_layer_t ly;
    const float *qkv, *g, *beta;
    float *o;
    /* The chunks' L and Aqk, computed ahead by duet__kda_lqk_kernel (NULL: the chunked kernel
     * computes them itself): [slot][H][2][C][LR], slot = duet__kda_lqk_slot. */
    float *lqk;
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
    const bool one = a.st.item_row0[it + 1] - row == 1;
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

/* ---- core: chunked (items of 2+ tokens) --------------------------------------------------- */

/*
 * Shared-memory layout of the chunked kernel (floats). Rows of Q, K, G are KR = K + 20 floats
 * and channel d sits at col(d) = d + 4·(d / (K/4)): a 4-float gap after each quarter. Readers
 * are float4 loads in two patterns, (a) 32 lanes on 32 rows at the same d and (b) 4 quarter
 * owners on one row; the odd KR/4 and the gaps put both on distinct 16-byte bank groups. The L
 * and Aqk rows (LR = 80) hold their 64 entries grouped by index mod 4, (i & 3)·20 + (i >> 2), so
 * the owner of residue dq reads its 16 entries as four float4 loads.
 */
template <int K> struct duet__kda_chunk_layout {
    static constexpr int C = DUET_KDA_C, V = K, Kq = K / 4, KR = K + 20, VR = V + 8, LR = 80;
    static constexpr int Q = 0, KK = Q + C * KR, G = KK + C * KR, VV = G + C * KR, L = VV + C * VR,
                         A = L + C * LR, B = A + C * LR, GL = B + C, FLOATS = GL + K;
    __device__ static constexpr int col(int d)
    {
        return d + 4 * (d / Kq);
    }
    __device__ static constexpr int grp(int i)
    {
        return (i & 3) * 20 + (i >> 2);
    }
};

/* Where chunk c of item it keeps its L and Aqk in duet__kda_core_args_t.lqk: rows r0.. of an
 * item start at slot r0 / C + it, so the slots of consecutive items never overlap, and every
 * slot is below n_rows / C + n_items + 1 (duet_cuda_kda_scratch_bytes). */
static __device__ __forceinline__ int64_t duet__kda_lqk_slot(const duet__kda_core_args_t &a,
                                                             int64_t it, int c)
{
    return (int64_t)a.st.item_row0[it] / DUET_KDA_C + it + c;
}

/* Step 1 of a chunk: rows row0 .. row0 + n - 1 of head h into sQ, sK, sG (and sV with v), β into
 * sB; rows past n are zero (β = 0, k = 0, g = 0 change nothing). The copies are asynchronous
 * (cp.async, zero-filled past n), so all of them are in flight at once instead of one round
 * trip per loop iteration; the function returns once they (and any cp.async the thread issued
 * before) have landed, after a block barrier. */
template <int K>
static __device__ __forceinline__ void duet__kda_chunk_load(const duet__kda_core_args_t &a,
                                                            int64_t row0, int n, int64_t h,
                                                            float *sm, bool with_v)
{
    typedef duet__kda_chunk_layout<K> Ly;
    constexpr int C = Ly::C, KR = Ly::KR, VR = Ly::VR, NT = 4 * K;
    const int64_t H = a.ly.H, HK = H * K, C3 = 3 * HK;
    const int tid = threadIdx.x;
    for (int idx = tid; idx < C * K; idx += NT) {
        const int i = idx / K, d = idx % K, c = i * KR + Ly::col(d);
        const bool ok = i < n;
        const int64_t row = row0 + (ok ? i : 0);
        const float *qr = a.qkv + row * C3 + h * K + d;
        duet__cp_async4(&sm[Ly::Q + c], qr, ok);
        duet__cp_async4(&sm[Ly::KK + c], qr + HK, ok);
        if (with_v)
            duet__cp_async4(&sm[Ly::VV + i * VR + d], qr + 2 * HK, ok);
        duet__cp_async4(&sm[Ly::G + c], a.g + row * HK + h * K + d, ok);
    }
    if (tid < C)
        sm[Ly::B + tid] = tid < n ? a.beta[(row0 + tid) * H + h] : 0.0f;
    duet__cp_async_wait_all();
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

/* Step 3: L and Aqk from sQ, sK, sG (Γ), sB. Task (ih, jg): lanes on rows i = 32·ih + lane,
 * columns j = 4·jg .. +3. Tasks wholly above the diagonal (ih = 0, jg >= 8) only write their
 * zeros. */
template <int K> static __device__ __forceinline__ void duet__kda_chunk_lqk(float *sm)
{
    typedef duet__kda_chunk_layout<K> Ly;
    constexpr int KR = Ly::KR, LR = Ly::LR, NW = 4 * K / 32;
    const float *sQ = sm + Ly::Q, *sK = sm + Ly::KK, *sG = sm + Ly::G, *sB = sm + Ly::B;
    float *sL = sm + Ly::L, *sA = sm + Ly::A;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int task = warp; task < 32; task += NW) {
        const int ih = task >> 4, jg = task & 15, i = ih * 32 + lane, j0 = jg * 4;
        float skk[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sqk[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (!(ih == 0 && jg >= 8)) {
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
        }
        const float bi = sB[i];
#pragma unroll
        for (int jj = 0; jj < 4; jj++) {
            const int j = j0 + jj;
            sA[i * LR + Ly::grp(j)] = j <= i ? sqk[jj] : 0.0f;
            sL[j * LR + Ly::grp(i)] = j < i ? -bi * skk[jj] : 0.0f;
        }
    }
    __syncthreads();
}

/*
 * L and Aqk of every chunk, ahead of the chunked kernel: they need only the chunk's q, k, g and
 * β, not S, so they need not wait for the chunk before in that kernel's sequential loop. One
 * block per (item, chunk) × head, with the chunked kernel's code and layout; it stores the two
 * [C][LR] arrays at the chunk's slot, where the chunked kernel loads them back with its chunk.
 */
template <int K>
__global__ static void __launch_bounds__(4 * K) duet__kda_lqk_kernel(duet__kda_core_args_t a)
{
    typedef duet__kda_chunk_layout<K> Ly;
    constexpr int C = Ly::C, LR = Ly::LR, NT = 4 * K;
    const int64_t it = blockIdx.x / a.max_chunks, h = blockIdx.y;
    const int c = (int)(blockIdx.x % a.max_chunks);
    const int64_t r0 = a.st.item_row0[it], n_tok = a.st.item_row0[it + 1] - r0;
    duet_pdl_wait(); /* qkv, g, beta */
    duet_pdl_trigger();
    if (n_tok < 2 || (int64_t)c * C >= n_tok)
        return;
    extern __shared__ float4 duet__kda_smem4[];
    float *sm = reinterpret_cast<float *>(duet__kda_smem4);
    const int n = n_tok - (int64_t)c * C < C ? (int)(n_tok - (int64_t)c * C) : C;
    duet__kda_chunk_load<K>(a, r0 + (int64_t)c * C, n, h, sm, false);
    duet__kda_chunk_gamma<K>(sm);
    duet__kda_chunk_lqk<K>(sm);
    float4 *dst = reinterpret_cast<float4 *>(a.lqk + (duet__kda_lqk_slot(a, it, c) * a.ly.H + h) *
                                                         (2 * C * LR));
    const float4 *src = reinterpret_cast<const float4 *>(sm + Ly::L);
    for (int idx = threadIdx.x; idx < 2 * C * LR / 4; idx += NT)
        dst[idx] = src[idx];
}

template <int K>
__global__ static void __launch_bounds__(4 * K) duet__kda_chunk_kernel(duet__kda_core_args_t a)
{
    typedef duet__kda_chunk_layout<K> Ly;
    constexpr int C = Ly::C, V = K, Kq = Ly::Kq, KR = Ly::KR, VR = Ly::VR, LR = Ly::LR;
    constexpr int NT = 4 * K;
    const int64_t H = a.ly.H, HK = H * K;
    const int64_t it = blockIdx.x / H, h = blockIdx.x % H;
    const int64_t r0 = a.st.item_row0[it], n_tok = a.st.item_row0[it + 1] - r0;
    duet_pdl_wait(); /* qkv, g, beta (and L, Aqk from duet__kda_lqk_kernel) */
    duet_pdl_trigger();
    if (n_tok < 2)
        return;

    extern __shared__ float4 duet__kda_smem4[];
    float *sm = reinterpret_cast<float *>(duet__kda_smem4);
    float *sQ = sm + Ly::Q;   /* [C][KR] q, then q e^Γ */
    float *sK = sm + Ly::KK;  /* [C][KR] k, then k e^{Γlast−Γ} */
    float *sG = sm + Ly::G;   /* [C][KR] Γ·log2(e), then β k e^Γ */
    float *sV = sm + Ly::VV;  /* [C][VR] v */
    float *sL = sm + Ly::L;   /* [C (j)][LR (grp i)] L[i][j], zero for i <= j */
    float *sA = sm + Ly::A;   /* [C (i)][LR (grp j)] Aqk[i][j], zero for j > i */
    float *sB = sm + Ly::B;   /* [C] β */
    float *sGl = sm + Ly::GL; /* [K] Γ of the chunk's last row, log2 units */

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int dq = lane & 3, x = warp * 8 + (lane >> 2); /* column x, quarter dq of S */
    const int qoff = dq * (Kq + 4);                      /* col(dq·Kq) */
    /* This block's slice of the columns (whole warps): it owns those columns of S and of o. */
    const bool owns = x / (V / (int)gridDim.y) == (int)blockIdx.y;
    float *S = duet__kda_block(a.ly, a.st.item_slot[it]) + h * K * V;
    float s[Kq]; /* S[dq·Kq + r][x] */
#pragma unroll
    for (int r = 0; r < Kq; r++)
        s[r] = owns ? S[(int64_t)(dq * Kq + r) * V + x] : 0.0f;

    for (int64_t c0 = 0; c0 < n_tok; c0 += C) {
        const int n = n_tok - c0 < C ? (int)(n_tok - c0) : C;
        /* 1-3: the chunk, Γ, L and Aqk; with a.lqk, L and Aqk (sA follows sL) were computed
         * ahead by duet__kda_lqk_kernel and load along with the chunk. */
        if (a.lqk != NULL) {
            const float *src =
                a.lqk + (duet__kda_lqk_slot(a, it, (int)(c0 / C)) * H + h) * (2 * C * LR);
            for (int idx = tid; idx < 2 * C * LR; idx += NT)
                duet__cp_async4(&sL[idx], src + idx, true);
        }
        duet__kda_chunk_load<K>(a, r0 + c0, n, h, sm, true);
        duet__kda_chunk_gamma<K>(sm);
        if (a.lqk == NULL)
            duet__kda_chunk_lqk<K>(sm);

        /* 4. In place: Q ← q e^Γ, K ← k e^{Γlast−Γ}, G ← β k e^Γ. */
        for (int idx = tid; idx < C * K; idx += NT) {
            const int i = idx / K, d = idx % K, c = i * KR + Ly::col(d);
            const float gam = sG[c], k = sK[c], eg = duet__ex2(gam);
            sQ[c] = sQ[c] * eg;
            sK[c] = k * duet__ex2(sGl[d] - gam);
            sG[c] = sB[i] * k * eg;
        }
        __syncthreads();

        /* 5. Column-local from here (the four quarter owners of column x share a warp), and
         * only over the row blocks that hold tokens (rows past n are zero throughout); only
         * the warps of this block's columns take part.
         * Y[i][x] = β_i v_i[x] − Σ_d (β k e^Γ)[i][d] S[d][x]; the owner of row i (i mod 4 = dq)
         * keeps it in y[i / 4]. Row blocks run in a loop, not unrolled (code size); y is only
         * ever indexed statically, a runtime block index t goes through duet__pick/duet__put. */
        if (owns) {
            const int nb = (n + 3) / 4;
            float y[C / 4];
#pragma unroll
            for (int t = 0; t < C / 4; t++)
                y[t] = 0.0f;
#pragma unroll 1
            for (int t = 0; t < nb; t++) {
                float mine = 0.0f;
#pragma unroll
                for (int m = 0; m < 4; m++) {
                    const int i = 4 * t + m;
                    const float *w = &sG[i * KR + qoff];
                    float acc = 0.0f;
#pragma unroll
                    for (int r = 0; r < Kq; r += 4) {
                        const float4 w4 = *reinterpret_cast<const float4 *>(&w[r]);
                        acc += w4.x * s[r] + w4.y * s[r + 1] + w4.z * s[r + 2] + w4.w * s[r + 3];
                    }
                    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
                    acc += __shfl_xor_sync(0xffffffffu, acc, 2);
                    if (m == dq)
                        mine = sB[i] * sV[i * VR + x] - acc;
                }
                duet__put<C / 4>(y, t, mine);
            }
            /* 6. V_new = Y + L V_new, row by row: once row j is final it is broadcast from its
             * owner and added into every row (L[i][j] is zero for i <= j, so finished rows stay).
             * `cur` tracks the current block's row of this owner, whose y slot has a runtime index.
             */
#pragma unroll 1
            for (int t = 0; t < nb; t++) {
                float cur = duet__pick<C / 4>(y, t);
#pragma unroll
                for (int m = 0; m < 4; m++) {
                    const int j = 4 * t + m;
                    const float vj = __shfl_sync(0xffffffffu, cur, (lane & ~3) | m);
                    const float *l = &sL[j * LR + dq * 20];
#pragma unroll
                    for (int u = 0; u < C / 4; u += 4) {
                        const float4 l4 = *reinterpret_cast<const float4 *>(&l[u]);
                        y[u] += l4.x * vj;
                        y[u + 1] += l4.y * vj;
                        y[u + 2] += l4.z * vj;
                        y[u + 3] += l4.w * vj;
                    }
                    cur += l[t] * vj;
                }
            }
            /* 7. O[i][x] = Σ_d (q e^Γ)[i][d] S[d][x] + Σ_j Aqk[i][j] V_new[j][x]: each owner adds
             * its quarter of d and its residue class of j, the shuffles finish the sum. Four rows
             * at a time, so their sums and shuffles overlap. */
            float *orow = a.o + (r0 + c0) * HK + h * K + x;
#pragma unroll 1
            for (int t = 0; t < nb; t++) {
#pragma unroll
                for (int m = 0; m < 4; m++) {
                    const int i = 4 * t + m;
                    const float *qe = &sQ[i * KR + qoff];
                    const float *ar = &sA[i * LR + dq * 20];
                    float acc = 0.0f;
#pragma unroll
                    for (int r = 0; r < Kq; r += 4) {
                        const float4 q4 = *reinterpret_cast<const float4 *>(&qe[r]);
                        acc += q4.x * s[r] + q4.y * s[r + 1] + q4.z * s[r + 2] + q4.w * s[r + 3];
                    }
#pragma unroll
                    for (int u = 0; u < C / 4; u += 4) {
                        const float4 a4 = *reinterpret_cast<const float4 *>(&ar[u]);
                        acc += a4.x * y[u] + a4.y * y[u + 1] + a4.z * y[u + 2] + a4.w * y[u + 3];
                    }
                    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
                    acc += __shfl_xor_sync(0xffffffffu, acc, 2);
                    if (m == dq && i < n)
                        orow[(int64_t)i * HK] = acc;
                }
            }
            /* 8. S ← e^{Γlast} S + Σ_i (k e^{Γlast−Γ})[i][d] V_new[i][x]. */
#pragma unroll
            for (int r = 0; r < Kq; r++)
                s[r] *= duet__ex2(sGl[dq * Kq + r]);
#pragma unroll 1
            for (int t = 0; t < nb; t++) {
                const float cur = duet__pick<C / 4>(y, t);
#pragma unroll
                for (int m = 0; m < 4; m++) {
                    const int i = 4 * t + m;
                    const float vi = __shfl_sync(0xffffffffu, cur, (lane & ~3) | m);
                    const float *kd = &sK[i * KR + qoff];
#pragma unroll
                    for (int r = 0; r < Kq; r += 4) {
                        const float4 k4 = *reinterpret_cast<const float4 *>(&kd[r]);
                        s[r] += k4.x * vi;
                        s[r + 1] += k4.y * vi;
                        s[r + 2] += k4.z * vi;
                        s[r + 3] += k4.w * vi;
                    }
                }
            }
        }
        __syncthreads(); /* the next chunk overwrites the shared buffers */
    }
    if (owns)
#pragma unroll
        for (int r = 0; r < Kq; r++)
            S[(int64_t)(dq * Kq + r) * V + x] = s[r];
}

/* ---- core: dispatch ----------------------------------------------------------------------- */

extern "C" size_t duet_cuda_kda_scratch_bytes(int64_t max_items, int64_t max_rows, int64_t H,
                                              int64_t K)
{
    (void)K; /* the L and Aqk arrays are [C][LR] whatever K is */
    if (max_items < 0 || max_rows < 0 || H < 0)
        return 0;
    const int64_t slots = max_rows / DUET_KDA_C + max_items + 1; /* duet__kda_lqk_slot */
    return sizeof(float) * (size_t)(slots * H) * 2 * DUET_KDA_C * duet__kda_chunk_layout<16>::LR;
}

/* The chunked kernel's dynamic shared memory exceeds the 48 KiB default, so it must be allowed
 * once per device; done on the first call (a host-side attribute, not a stream operation). */
template <int K> static duet_status_t duet__kda_chunk_smem_allow(size_t bytes)
{
    static int done[64];
    int dev = 0;
    DUET__TRY(cudaGetDevice(&dev), "cudaGetDevice");
    if (dev >= 0 && dev < 64 && __atomic_load_n(&done[dev], __ATOMIC_ACQUIRE))
        return DUET_OK;
    DUET__TRY(cudaFuncSetAttribute(duet__kda_chunk_kernel<K>,
                                   cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes),
              "chunk kernel shared-memory attribute");
    DUET__TRY(cudaFuncSetAttribute(duet__kda_lqk_kernel<K>,
                                   cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes),
              "L, Aqk kernel shared-memory attribute");
    if (dev >= 0 && dev < 64)
        __atomic_store_n(&done[dev], 1, __ATOMIC_RELEASE);
    return DUET_OK;
}

/*
 * Column slices per (item, head) for the chunked kernel. Its column-local phases (from Y on)
 * are most of a chunk's time, and one block per (item, head) leaves most SMs idle in a single
 * prefill (32 heads on 132 SMs): with slices, the blocks of one head each redo the shared
 * phases (L, Aqk, the decayed q / k) and run the column phases for their own columns only, so
 * every column's arithmetic is unchanged. Slices double while the blocks still fit on the SMs
 * and a slice stays whole warps of columns (a multiple of 8: the phases shuffle across a warp).
 * DUET_CUDA_KDA_NO_SPLIT=1 keeps one block per (item, head), for side-by-side measurements;
 * tests force a count with duet__cuda_kda_split_set (0: automatic).
 */
static int duet__kda_split_forced = 0;

extern "C" void duet__cuda_kda_split_set(int vs)
{
    duet__kda_split_forced = vs;
}

static unsigned duet__kda_vsplit(const duet__kda_core_args_t &a, int K)
{
    static int no_split = -1;
    duet_cuda_env_flag(&no_split, "DUET_CUDA_KDA_NO_SPLIT");
    const int f = duet__kda_split_forced;
    if (f > 0) /* a forced count that does not cut whole warps of columns falls back to 1 */
        return K % (8 * f) == 0 ? (unsigned)f : 1u;
    const int n_sms = duet_cuda_sm_count();
    if (no_split || n_sms < 1)
        return 1;
    const int64_t pairs = a.st.n_items * a.ly.H;
    unsigned vs = 1;
    while (K % (16 * (int)vs) == 0 && pairs * 2 * vs <= n_sms)
        vs *= 2;
    return vs;
}

template <int K>
static duet_status_t duet__kda_core_launch(cudaStream_t stream, const duet__kda_core_args_t &a)
{
    const int64_t H = a.ly.H;
    dim3 rgrid((unsigned)(a.st.n_items * H), (unsigned)((K + 31) / 32));
    DUET__TRY(
        duet_pdl_launch(duet__kda_recur_kernel<K>, rgrid, dim3(32, DUET_KDA_RY), 0, stream, a),
        "recurrent core launch");
    if (a.st.max_item_tokens > 1) {
        const size_t bytes = sizeof(float) * (size_t)duet__kda_chunk_layout<K>::FLOATS;
        duet_status_t s = duet__kda_chunk_smem_allow<K>(bytes);
        if (s != DUET_OK)
            return s;
        if (a.lqk != NULL)
            DUET__TRY(duet_pdl_launch(duet__kda_lqk_kernel<K>,
                                      dim3((unsigned)(a.st.n_items * a.max_chunks), (unsigned)H),
                                      dim3(4 * K), bytes, stream, a),
                      "L, Aqk kernel launch");
        DUET__TRY(duet_pdl_launch(duet__kda_chunk_kernel<K>,
                                  dim3((unsigned)(a.st.n_items * H), duet__kda_vsplit(a, K)),
                                  dim3(4 * K), bytes, stream, a),
                  "chunked core launch");
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
    /* With scratch, L and Aqk of every chunk are computed ahead, in parallel (unless
     * DUET_CUDA_KDA_NO_AHEAD is set, for side-by-side measurements). */
    static int no_ahead = -1;
    duet_cuda_env_flag(&no_ahead, "DUET_CUDA_KDA_NO_AHEAD");
    const int64_t max_chunks = (st->max_item_tokens + DUET_KDA_C - 1) / DUET_KDA_C;
    if ((int64_t)st->n_items * max_chunks > 0x7fffffff || ly->H > 65535)
        return duet_error_set(DUET_ERR_RANGE, "cuda kda core: %d items of up to %d tokens",
                              st->n_items, st->max_item_tokens);
    const duet__kda_core_args_t a = {*st,
                                     *ly,
                                     qkv,
                                     g,
                                     beta,
                                     o,
                                     scratch != NULL && !no_ahead ? (float *)scratch : NULL,
                                     (int)max_chunks};
    switch (ly->K) {
    case 16:
        return duet__kda_core_launch<16>(stream, a);
    case 32:
        return duet__kda_core_launch<32>(stream, a);
    case 48:
        return duet__kda_core_launch<48>(stream, a);
    case 64:
        return duet__kda_core_launch<64>(stream, a);
    case 80:
        return duet__kda_core_launch<80>(stream, a);
    case 96:
        return duet__kda_core_launch<96>(stream, a);
    case 112:
        return duet__kda_core_launch<112>(stream, a);
    default:
        return duet__kda_core_launch<128>(stream, a);
    }
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
     * round trip overlaps the previous kernel. H200, 27 layers at batch 1, side by side in one
     * command, three runs: 2.544 / 2.536 / 2.540 ms/step at 2K against 2.561 / 2.552 / 2.552
     * with the loads after the wait (and an L2 prefetch of S before it), 2.709 / 2.697 / 2.703
     * against 2.721 / 2.712 / 2.715 at 32K. */
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
        ss = duet__warp_sum(ss);
        float inv = 1.0f / sqrtf(ss + DUET_KDA_L2_EPS);
        if (ty == 0)
            inv *= 1.0f / sqrtf((float)K);
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

template <int K>
static duet_status_t duet__kda_decode_launch(cudaStream_t stream, const duet__kda_chain_args_t &a)
{
    const unsigned cl = (unsigned)((K + 31) / 32);
    dim3 grid((unsigned)(a.st.n_items * a.ly.H), cl);
    cudaLaunchAttribute cluster; /* (1, cl, 1) blocks share their shared memory */
    memset(&cluster, 0, sizeof(cluster));
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = 1;
    cluster.val.clusterDim.y = cl;
    cluster.val.clusterDim.z = 1;
    DUET__TRY(duet_pdl_launch_attr(duet__kda_decode_kernel<K>, grid, dim3(32, DUET_KDA_RY), 0,
                                   stream, &cluster, a),
              "decode chain launch");
    return DUET_OK;
}

extern "C" duet_status_t duet_cuda_kda_chain(cudaStream_t stream, const duet_cuda_step_t *st,
                                             const duet_cuda_kda_layer_t *ly,
                                             const duet_cuda_kda_weights_t *w, const float *proj,
                                             const float *gate, float *qkv, float *g, float *beta,
                                             float *o, void *scratch)
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
    const bool small =
        st->max_item_tokens == 1 && (int64_t)st->n_items * ly->H <= DUET_KDA_FUSED_MAX_CLUSTERS;
    int clusters = 0;
    if (small && (s = duet__kda_clusters(&clusters)) != DUET_OK)
        return s;
    if (!small || !clusters) { /* prefill, large batches, no clusters: the separate kernels */
        if ((s = duet_cuda_kda_conv(stream, st, ly, w->taps, proj, qkv)) != DUET_OK ||
            (s = duet_cuda_kda_prep(stream, st->n_rows, ly, w->neg_A, w->dt_bias, qkv, g, beta)) !=
                DUET_OK ||
            (s = duet_cuda_kda_core(stream, st, ly, qkv, g, beta, o, scratch)) != DUET_OK)
            return s;
        return duet_cuda_kda_out(stream, st->n_rows, ly->H, ly->K, w->o_norm, w->eps, gate, o);
    }
    const duet__kda_chain_args_t a = {*st, *ly, *w, proj, gate, qkv, g, beta, o};
    switch (ly->K) {
    case 16:
        return duet__kda_decode_launch<16>(stream, a);
    case 32:
        return duet__kda_decode_launch<32>(stream, a);
    case 48:
        return duet__kda_decode_launch<48>(stream, a);
    case 64:
        return duet__kda_decode_launch<64>(stream, a);
    case 80:
        return duet__kda_decode_launch<80>(stream, a);
    case 96:
        return duet__kda_decode_launch<96>(stream, a);
    case 112:
        return duet__kda_decode_launch<112>(stream, a);
    default:
        return duet__kda_decode_launch<128>(stream, a);
    }
}
