/*
 * moe.cu: MoE routing (duet_cuda_moe_route) and the routed experts of one layer
 * (duet_cuda_moe_experts). CPU reference: kernels/cpu/moe.c (duet_cpu_moe_route) and
 * engine/backend_cpu.c (duet__moe_layer).
 *
 * Routing: a block of 256 threads computes the scores and choices of its rows together (one
 * row per block at decode sizes, up to 8 for prefill; at E = 256 one sigmoid per thread),
 * then a warp per row picks. The sigmoid is evaluated as
 * the CPU does, in float, with exp taken in double and rounded (glibc's expf is within 0.502
 * ulp, so the two agree to the last bit except in rare double-rounding cases); bit-equal
 * scores make the GPU pick the same experts. Each choice becomes an unsigned key that orders as
 * the CPU's pick does (larger first; the lower index breaks ties, as the CPU's strict > does);
 * each lane keeps the best key of its experts (e = lane + 32j), and a pick is two warp
 * reductions (max key, then min index with that key) after which only the lane that owned the
 * winner rescans its own experts. The bias is read before the PDL wait.
 *
 * Experts. The routing result exists only on the device, and everything must stay
 * graph-capturable, so the grouping of (row, k) pairs by expert is done on the device by a
 * plan kernel: count per expert, scan, scatter the pair ids into per-expert lists, and cut
 * each list into work items (slots of <= NR rows for the GEMV path, tiles of BM rows
 * for the tensor-core path). Grids are sized on the host for the worst case that T allows; the
 * blocks past the device-side item count exit at once. Each pair's expert output goes to its
 * own row of scratch (out[p], p = t * top_k + k) and a combine kernel adds
 * y[t] += Σ_k wts[t][k] · out[t * top_k + k] in k order, so y sees no float atomics and the
 * result is the same however rows were grouped. Up to DUET__MOE_TICKET_T tokens on the GEMV
 * path there is no combine kernel: gemv2's blocks cover 32 outputs (a slice) of their slot's
 * pairs, each (token, slice) has a ticket counter, and the block that brings it to the token's
 * pair count (every pair of the token has its slice in out) adds the slice into y in k order
 * with the combine kernel's arithmetic, so y is bit-identical to a separate combine, with one
 * kernel less at decode and in a k = 1 verify step.
 * A shared expert of the same shape (duet_cuda_experts_t's sw*) rides along on the GEMV path: at
 * T = 1 as one more slot, P, computed into row P of h and out; at T > 1 as expert E, whose list
 * the plan fills with pairs P + t (rows P + t of h and out). Its output is added after the
 * routed sum, so a decode or verify step has no separate shared MLP (its gate|up, act_mul and
 * down kernels).
 *
 * Two expert paths, picked on the host from T (the grid shapes depend on it anyway):
 *  - GEMV (decode; any dtype): a block handles one slot (one expert, up to 4 rows whose x rows
 *    sit in shared memory) and 8 gate/up outputs (phase 1) or 32 down outputs (phase 2); a
 *    warp reads whole weight rows with coalesced 16-byte loads that skip L1, converts to fp32
 *    and dots them with every row of the slot, fp32 accumulation, warp-shuffle reduction. An
 *    expert's slots sit next to each other in the grid, so its weights come from DRAM once
 *    per call and from L2 for its other slots. x and the activation h stay fp32, like the CPU
 *    path. At T = 1 there is nothing to group: the plan is skipped and slot p is pair p. With
 *    256 slots or more (T >= 32 at Kimi's dims), a block takes 4 of its slot's slices of
 *    outputs (duet__gemv_spb), so one slot lookup and one load of its x (or h) rows serve four
 *    times the weight rows.
 *    Phase 2 loads the first chunks of its W2 rows into registers and pulls the rest into L2
 *    while phase 1 finishes (W2 does not depend on it; an L2 prefetch of phase 1's rows right
 *    after the routing measured slower: bench/RESULTS.md, "MoE GEMV: no L2 prefetch of phase
 *    1's rows").
 *  - MMA (prefill; BF16 weights, D and I multiples of 32): per tile of BM rows of one expert,
 *    mma.sync m16n8k16 bf16 with fp32 accumulation, a cp.async pipeline (4 stages of k-steps
 *    of 32; 3 of 64 for the 64-row tiles where K allows, duet__mma_bk64), XOR-swizzled
 *    shared memory read with ldmatrix. Phase 1 computes the W1 and W3 tiles together and
 *    applies the activation in registers, storing h in bf16; phase 2 multiplies h by W2 into
 *    out. x (and h) are rounded to bf16 on this path, like the cuBLASLt GEMM (cuda_gemm.h).
 *    On an sm_90a device (H100 / H200) with D and I multiples of 64 the same tiles run on
 *    wgmma instead (moe_wgmma.cu; the same bits in every case tested, and faster:
 *    bench/RESULTS.md, "MoE prefill experts on wgmma"), the 128-row tiles on a persistent
 *    warp-specialised kernel whose tiles span 256 weight rows (duet__mma_ws).
 * The automatic choice takes MMA when the average rows per selected expert reaches 8 and the
 * weights are BF16 (at the real dims GEMV is far slower than MMA at T = 256, while T <= 64
 * never qualifies: bench/RESULTS.md, "MoE: when the MMA path takes over");
 * duet__cuda_moe_experts_path lets tests force either path.
 *
 * Every kernel here is launched with duet_pdl_launch (cuda_pdl.cuh) and follows its contract,
 * with exceptions inside the module, each written down where it happens: gemv2 reads its slot
 * (the plan or the routing) before its wait, to prefetch its W2 rows. That is safe because its
 * predecessor, gemv13, triggers only after its own wait, which returns once the plan (or the
 * routing, at T = 1) has completed: gemv2 cannot start before those writes are done. Likewise
 * the shared expert's early gate/up blocks read the router's input row, and the router kernel
 * its call count, before their waits.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_cvt.cuh"
#include "kernels/cuda/cuda_gemm.h"
#include "kernels/cuda/cuda_norm.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_pdl.cuh"
#include "kernels/cuda/moe_mma.cuh"

#define DUET__MODULE          "cuda moe" /* the prefix of this file's error details */
#define DUET__TRY(call, what) DUET_CUDA_TRY(call, DUET__MODULE, what)

/* `path` of duet__cuda_moe_experts_path: the low 4 bits pick the path; for tests and tuning,
 * bits 4..7 may force the GEMV slot size (1, 2, 4, 8), bits 8..11 the MMA tile height (1: 64,
 * 2: 128), bits 20..23 the GEMV slices per block at T > 1 (1: one, 2+: DUET__GV_SPB), and the
 * flags below (DUET__MOE_MMA_SYNC / _WGMMA pick the MMA kernels). (Programmatic dependent launch is
 * switched for the whole process by duet_cuda_pdl_set.) */
#define DUET__MOE_PATH_AUTO        0
#define DUET__MOE_PATH_GEMV        1
#define DUET__MOE_PATH_MMA         2
#define DUET__MOE_SEPARATE_COMBINE 0x2000 /* GEMV, T <= 2: the combine kernel, not tickets */
#define DUET__MOE_T1_DEEP          0x4000 /* GEMV, T = 1: the uncapped kernels (DUET__GV_U13_DEEP) */
#define DUET__MOE_SPB_SHIFT        20     /* GEMV, T > 1: the slices per block (see above) */
#define DUET__MOE_MMA_SYNC         0x1000000 /* MMA: the mma.sync kernels */
#define DUET__MOE_MMA_WGMMA        0x2000000 /* MMA: the wgmma kernels (an error where unusable) */
#define DUET__MOE_MMA_NO_WS        0x4000000 /* wgmma, 128-row tiles: not the warp-specialised kernel */

#define DUET__GV_WARPS     8 /* warps per GEMV block */
#define DUET__GV_THREADS   (DUET__GV_WARPS * 32)
#define DUET__GV_RI        1   /* phase 1: gate/up outputs per warp (W1 and W3 rows each) */
#define DUET__GV_RD        4   /* phase 2: down outputs per warp */
#define DUET__GV_NR        8   /* most rows (pairs) per GEMV slot: 4 by default, 8 when forced */
#define DUET__GV_UNROLL    2   /* 16-byte chunks per lane per weight row in flight */
#define DUET__GV_SPB       4   /* slices per block of the multi-slice kernels ... */
#define DUET__GV_SPB_SLOTS 256 /* ... from this many slots on (duet__gemv_spb) */
/* Up to this many tokens gemv2 adds into y through tickets instead of a combine kernel: from 5
 * tokens on, with dozens of slots, the tickets cost gemv2 more than the combine kernel takes
 * (bench/RESULTS.md, "MoE at T = 1: gemv2's tickets"). */
#define DUET__MOE_TICKET_T 2
/* Below this many tokens the combine kernel splits each row over blocks of this many threads
 * (its launch). */
#define DUET__COMBINE_SPLIT_T 128
#define DUET__COMBINE_PART    128
/* The multi-slice gate/up kernel capped at 64 registers, 4 blocks per SM (at 80 registers, 3 per
 * SM, it was slower than one slice per block). Its down kernel stays uncapped: at 3 per SM it
 * spills and was slower (bench/RESULTS.md, "MoE GEMV at T > 1: four slices per block"). */
#define DUET__GV_MULTI13_BLOCKS 4
/* At T = 1 (one row per slot) the 1-row kernels, with their registers capped so that 3 blocks
 * fit on an SM (80 registers). The real dims' rows are 9 (gate/up, D = 2304) and 4 (down,
 * I = 1024) chunks per lane. Capped, they beat the uncapped kernels (2 blocks per SM) with
 * 5 + 4 chunks in flight (DUET__GV_U13_DEEP / DUET__GV_U2_DEEP): the gain is in how they overlap
 * their neighbours in the step. Gate/up gives each warp 1 output (its W1 and W3 rows) with 5
 * chunks in flight (DUET__GV_U13_T1): twice the blocks of 2 outputs per warp, each warp done in
 * two passes instead of five, and no spill under the cap. The down kernel keeps 4 outputs per
 * warp: its blocks each end in a ticket, and twice the blocks cost more than the shorter warps
 * save. The slots of 4 rows (batch 8 and 64) take 1 gate/up output per warp too (64 registers,
 * 4 blocks per SM), with 2 chunks in flight. Measured: bench/RESULTS.md, "MoE GEMV at T = 1:
 * capped registers, one gate/up output per warp". */
#define DUET__GV_T1_BLOCKS 3
#define DUET__GV_U13_T1    5
#define DUET__GV_U2_T1     2
#define DUET__GV_U13_DEEP  5
#define DUET__GV_U2_DEEP   4
#define DUET__GV_SLICE     (DUET__GV_WARPS * DUET__GV_RD) /* gemv2 outputs per block (a slice) */
static_assert(DUET__GV_NR * DUET__GV_SLICE <= DUET__GV_THREADS,
              "gemv2 completes a slice per thread");

#define DUET__MMA_BK      32 /* k-step (64 for the 64-row tiles where K allows) */
#define DUET__MMA_STAGES  4
#define DUET__MMA_THREADS 256
/* stages in shared memory for a k-step of BK */
static constexpr __host__ __device__ int duet__mma_stages(int bk)
{
    return bk == 64 ? 3 : DUET__MMA_STAGES;
}

#define DUET__PLAN_THREADS 1024
/* A plan of at most this many pairs in one block runs with this many threads: its three block
 * scans and barriers cost a 1024-thread block more than the pairs need (bench/RESULTS.md, "MoE
 * plan: a small block for a few pairs"). */
#define DUET__PLAN_SMALL      256
#define DUET__PLAN_PAIRS      2048 /* pairs per plan block (the last may have more: below) */
#define DUET__PLAN_MAX_BLOCKS 64   /* at most this many plan blocks (and rows of counts) */

#define DUET__ROUTE_THREADS 256 /* per routing block: up to 8 rows */
#define DUET__ROUTE_UNROLL  8   /* scores per thread whose loads are in flight together */

static int duet__aligned16(const void *p)
{
    return ((uintptr_t)p & 15u) == 0;
}

/* ---- shared device helpers ----------------------------------------------------------------- */

/* The CPU's float sigmoid 1 / (1 + expf(-x)), with expf correctly rounded via double. */
static __device__ __forceinline__ float duet__sigmoid_cpu(float x)
{
    const float ex = (float)exp(-(double)x);
    return __fdiv_rn(1.0f, __fadd_rn(1.0f, ex));
}

/* Exclusive prefix sum of one int per thread over the block; *total_p gets the block's sum. */
static __device__ int duet__block_excl_scan(int v, int *total_p)
{
    __shared__ int warp_tot[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    int inc = v;
    for (int o = 1; o < 32; o <<= 1) {
        const int nb = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o)
            inc += nb;
    }
    __syncthreads(); /* warp_tot may still be read by a previous call */
    if (lane == 31)
        warp_tot[warp] = inc;
    __syncthreads();
    int base = 0, tot = 0;
    for (int w = 0; w < n_warps; w++) {
        if (w < warp)
            base += warp_tot[w];
        tot += warp_tot[w];
    }
    *total_p = tot;
    return base + inc - v;
}

/* ---- routing ------------------------------------------------------------------------------- */

/* Warp arg-max merge with the CPU's rule: larger value first, lower index on ties. i < 0 is
 * "no candidate". NaN values never win (the CPU's > never picks them either). */
static __device__ __forceinline__ void duet__pick_merge(float *v, int *i, float ov, int oi)
{
    if (oi >= 0 && (*i < 0 || ov > *v || (ov == *v && oi < *i))) {
        *v = ov;
        *i = oi;
    }
}

static __device__ __forceinline__ int duet__warp_pick(float v, int i)
{
    for (int o = 16; o > 0; o >>= 1)
        duet__pick_merge(&v, &i, __shfl_xor_sync(0xffffffffu, v, o),
                         __shfl_xor_sync(0xffffffffu, i, o));
    return i;
}

/*
 * The routing key of a choice: unsigned keys order as the CPU's pick does (a larger key is a
 * larger choice). -0 and +0 get one key (the CPU's > does not tell them apart), so the lower
 * index wins between them as between any tie. NaN gets 1, below every number (the CPU has no
 * rule for NaN choices; here they are picked last, lowest index first), and 0 marks a taken or
 * absent expert: every real number maps to 0x007fffff (-INF) or above.
 */
static __device__ __forceinline__ unsigned duet__route_key(float c)
{
    if (isnan(c))
        return 1u;
    const unsigned u = __float_as_uint(__fadd_rn(c, 0.0f)); /* -0 + +0 = +0 */
    return (u & 0x80000000u) != 0 ? ~u : u | 0x80000000u;
}

static __device__ __forceinline__ unsigned duet__warp_max_u32(unsigned v)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    for (int o = 16; o > 0; o >>= 1)
        v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
#else
    return __reduce_max_sync(0xffffffffu, v);
#endif
}

static __device__ __forceinline__ unsigned duet__warp_min_u32(unsigned v)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    for (int o = 16; o > 0; o >>= 1)
        v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
#else
    return __reduce_min_sync(0xffffffffu, v);
#endif
}

/* This lane's best key among its experts e = lane + 32j (the lowest such e on ties). */
static __device__ __forceinline__ unsigned duet__lane_best(const float *keys, int E, int lane,
                                                           int *e_p)
{
    unsigned bk = 0;
    int be = 0;
#pragma unroll 8
    for (int e = lane; e < E; e += 32) {
        const unsigned k = __float_as_uint(keys[e]);
        if (k > bk) {
            bk = k;
            be = e;
        }
    }
    *e_p = be;
    return bk;
}

/* This thread's first U bias values for duet__route_block<U> (n = rows × E). */
template <int U>
static __device__ __forceinline__ void duet__route_bias0(const float *bias, int E, int n,
                                                         float (&b0)[U])
{
#pragma unroll
    for (int j = 0; j < U; j++) {
        const int i = threadIdx.x + (int)blockDim.x * j;
        b0[j] = bias != NULL && i < n ? __ldg(bias + i % E) : 0.0f;
    }
}

/*
 * A block of DUET__ROUTE_THREADS threads routes R rows (R <= the block's warps): all its threads
 * compute the R rows' scores and choices together (at T = 1, one sigmoid per thread), then warp
 * r picks row r's experts. Shared memory per row: score[E], choice[E] (then the keys, stored as
 * float bit patterns), gscore[G], gkeep[G]. In the pick a lane only writes its own experts'
 * keys (e = lane + 32j).
 *
 * duet__route_block routes rows t0 .. t0 + R - 1 (logits read through L2: another block of the
 * same grid may have written them); b0 from duet__route_bias0. U scores per thread have their
 * loads in flight together: DUET__ROUTE_UNROLL for the routing kernel's rows, 1 in the router
 * kernel's last block, whose one row has a score per thread (E <= its 256 threads in the
 * model), so that its straight-line code stays short.
 */
template <int U>
static __device__ __forceinline__ void
duet__route_block(float *route_sh, const float *logits, const float *bias, const float (&b0)[U],
                  int t0, int R, int T, int E, int G, int topk_group, int top_k, int renorm,
                  float scale, int32_t *idx, float *wts)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n = min(R, T - t0) * E; /* the rows × E */
    const int nt = (int)blockDim.x;
    const float *lg = logits + (size_t)t0 * E; /* the rows are contiguous */
    for (int i0 = 0; i0 < n; i0 += nt * U) {
        float l[U], b[U];
#pragma unroll
        for (int j = 0; j < U; j++) {
            const int i = i0 + threadIdx.x + nt * j;
            l[j] = i < n ? __ldcg(lg + i) : 0.0f;
            b[j] = i0 == 0 ? b0[j] : bias != NULL && i < n ? __ldg(bias + i % E) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < U; j++) {
            const int i = i0 + threadIdx.x + nt * j;
            if (i < n) {
                const int r = i / E, e = i - r * E;
                float *sr = route_sh + (size_t)r * (2 * E + 2 * G);
                const float s = duet__sigmoid_cpu(l[j]);
                const float c = __fadd_rn(s, b[j]);
                sr[e] = s;
                sr[E + e] = G > 1 ? c : __uint_as_float(duet__route_key(c)); /* groups: later */
            }
        }
    }
    __syncthreads();
    const int t = t0 + warp;
    if (warp >= R || t >= T)
        return;
    float *score = route_sh + (size_t)warp * (2 * E + 2 * G);
    float *choice = score + E;
    float *gscore = choice + E;
    int *gkeep = (int *)(gscore + G);
    if (G > 1) {
        const int gs = E / G;
        for (int g = lane; g < G; g += 32) {
            float b1 = -INFINITY, b2 = -INFINITY;
            for (int e = g * gs; e < (g + 1) * gs; e++) {
                const float c = choice[e];
                if (c > b1) {
                    b2 = b1;
                    b1 = c;
                } else if (c > b2) {
                    b2 = c;
                }
            }
            gscore[g] = gs >= 2 ? __fadd_rn(b1, b2) : b1;
            gkeep[g] = 0;
        }
        __syncwarp();
        for (int k = 0; k < topk_group; k++) {
            float bv = 0.0f;
            int bi = -1;
            for (int g = lane; g < G; g += 32)
                if (!gkeep[g])
                    duet__pick_merge(&bv, &bi, gscore[g], g);
            bi = duet__warp_pick(bv, bi);
            if (lane == 0 && bi >= 0)
                gkeep[bi] = 1;
            __syncwarp();
        }
        for (int e = lane; e < E; e += 32)
            if (!gkeep[e / gs])
                choice[e] = -INFINITY;
        __syncwarp();
        for (int e = lane; e < E; e += 32)
            choice[e] = __uint_as_float(duet__route_key(choice[e]));
    }
    int be;
    unsigned bk = duet__lane_best(choice, E, lane, &be);

    /* Pick k: the largest key, the lowest expert among equal keys; its lane takes it and finds
     * its next best. Lane k keeps pick k; every lane adds the weights in k order, as the CPU
     * does. top_k <= E, so an untaken expert (key >= 1) is always left. */
    float sum = 0.0f, my_w = 0.0f;
    int my_i = 0;
    for (int k = 0; k < top_k; k++) {
        const unsigned m = duet__warp_max_u32(bk);
        const int w = (int)duet__warp_min_u32(bk == m ? (unsigned)be : 0xffffffffu);
        if ((w & 31) == lane) {
            choice[w] = __uint_as_float(0u);
            bk = duet__lane_best(choice, E, lane, &be);
        }
        const float s = score[w];
        if (lane == k) {
            my_i = w;
            my_w = s;
        }
        sum = __fadd_rn(sum, s);
    }
    if (lane < top_k) {
        if (renorm)
            my_w = __fdiv_rn(my_w, __fadd_rn(sum, 1e-20f));
        idx[(size_t)t * top_k + lane] = my_i;
        wts[(size_t)t * top_k + lane] = __fmul_rn(my_w, scale);
    }
}

/*
 * One row's routing by the router kernel's block 0 when there are no groups and a thread per
 * expert (G == 1, E <= blockDim.x; thread e has expert e's logit): thread e joins expert e's key
 * (duet__route_key of its choice, computed as duet__route_block computes it) with its index, so
 * that a larger key and, among equal keys, a lower index order first; each warp sorts its 32 in
 * registers (a bitonic sort over shuffles), its first top_k are the candidates, and a candidate's
 * rank among them is its pick number (the global top_k are among them: each one is in its warp's
 * top_k). The same picks in the same order as duet__route_block's top_k rounds of warp picks, and
 * the weights summed in k order with the same roundings. Shared memory: cand[nw · top_k] (nw = the
 * warps with experts), s_sh[E], pick[top_k] and pick_s[top_k] (the picks' scores).
 */
static __device__ __forceinline__ void duet__route_row_sorted(unsigned long long *cand, float *s_sh,
                                                              int *pick, float *pick_s, float logit,
                                                              float b, int E, int top_k, int renorm,
                                                              float scale, int32_t *idx, float *wts)
{
    const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = (E + 31) >> 5;
    unsigned long long v = 0; /* key 0 marks no expert: below every real one (>= 1) */
    if (tid < E) {
        const float sc = duet__sigmoid_cpu(logit);
        s_sh[tid] = sc;
        v = (unsigned long long)duet__route_key(__fadd_rn(sc, b)) << 32 |
            (0xffffffffu - (unsigned)tid);
    }
    if (warp < nw) {
#pragma unroll
        for (int k = 2; k <= 32; k <<= 1)
#pragma unroll
            for (int j = k >> 1; j > 0; j >>= 1) {
                const unsigned long long o = __shfl_xor_sync(0xffffffffu, v, j);
                v = ((lane & j) == 0) == ((lane & k) == 0) ? max(v, o) : min(v, o);
            }
        if (lane < top_k)
            cand[warp * top_k + lane] = v; /* lane r: the warp's r-th */
    }
    __syncthreads();
    const int nc = nw * top_k;
    for (int c = tid; c < nc; c += (int)blockDim.x) {
        const unsigned long long me = cand[c];
        int r = 0;
#pragma unroll 8
        for (int q = 0; q < nc; q++)
            r += cand[q] > me;
        if (r < top_k) { /* a real expert: there are at least top_k among the candidates */
            const int e = (int)(0xffffffffu - (unsigned)me);
            pick[r] = e;
            pick_s[r] = s_sh[e];
        }
    }
    __syncthreads();
    if (tid < top_k) {
        float sum = 0.0f;
#pragma unroll 8
        for (int k = 0; k < top_k; k++)
            sum = __fadd_rn(sum, pick_s[k]);
        float w = pick_s[tid];
        if (renorm)
            w = __fdiv_rn(w, __fadd_rn(sum, 1e-20f));
        idx[tid] = pick[tid];
        wts[tid] = __fmul_rn(w, scale);
    }
}

__global__ void __launch_bounds__(DUET__ROUTE_THREADS)
    duet__route_kernel(const float *logits, const float *bias, int T, int E, int G, int topk_group,
                       int top_k, int renorm, float scale, int R, int32_t *idx, float *wts)
{
    extern __shared__ float route_sh[];
    const int t0 = blockIdx.x * R;
    /* The bias is a weight: its first values load while the router GEMV finishes. */
    float b0[DUET__ROUTE_UNROLL];
    duet__route_bias0<DUET__ROUTE_UNROLL>(bias, E, min(R, T - t0) * E, b0);
    duet_pdl_wait(); /* the logits */
    duet_pdl_trigger();
    duet__route_block(route_sh, logits, bias, b0, t0, R, T, E, G, topk_group, top_k, renorm, scale,
                      idx, wts);
}

/* The routing's argument checks, for duet_cuda_moe_route and duet_cuda_moe_router_route (`who`
 * names the caller in the error); *per_row_p = the routing's shared memory per row. */
static duet_status_t duet__route_check(const char *who, const float *logits, int64_t T, int64_t E,
                                       int64_t n_group, int64_t topk_group, int64_t top_k,
                                       const int32_t *idx, const float *wts, size_t *per_row_p)
{
    const int64_t G = n_group > 0 ? n_group : 1;
    if (T < 0 || T > 0x7fffffff || E <= 0 || top_k <= 0 || top_k > E || E % G != 0 ||
        (G > 1 && (topk_group <= 0 || topk_group > G)) ||
        (T > 0 && (logits == NULL || idx == NULL || wts == NULL)))
        return duet_error_set(DUET_ERR_INVALID,
                              "cuda %s: bad arguments T=%lld E=%lld n_group=%lld "
                              "topk_group=%lld top_k=%lld",
                              who, (long long)T, (long long)E, (long long)n_group,
                              (long long)topk_group, (long long)top_k);
    if (top_k > 32)
        return duet_error_set(DUET_ERR_UNSUPPORTED, "cuda %s: top_k %lld > 32", who,
                              (long long)top_k);
    const size_t per_row = (size_t)(2 * E + 2 * G) * sizeof(float);
    if (per_row > 48 * 1024)
        return duet_error_set(DUET_ERR_UNSUPPORTED, "cuda %s: %lld experts is too many", who,
                              (long long)E);
    *per_row_p = per_row;
    return DUET_OK;
}

extern "C" duet_status_t duet_cuda_moe_route(cudaStream_t stream, const float *logits,
                                             const float *bias, int64_t T, int64_t E,
                                             int64_t n_group, int64_t topk_group, int64_t top_k,
                                             int renorm, float scale, int32_t *idx, float *wts)
{
    const int64_t G = n_group > 0 ? n_group : 1;
    size_t per_row;
    const duet_status_t st = duet__route_check("moe_route", logits, T, E, n_group, topk_group,
                                               top_k, idx, wts, &per_row);
    if (st != DUET_OK)
        return st;
    if (T == 0)
        return DUET_OK;
    /* Rows per block: one at decode sizes, so that T rows take as long as one, side by side on
     * T SMs (the double exp is bound by an SM's FP64 rate: bench/RESULTS.md, "MoE routing: one
     * row per block at decode sizes"); up to 8 for prefill. */
    int64_t R = (int64_t)((48 * 1024) / per_row);
    R = R < DUET__ROUTE_THREADS / 32 ? R : DUET__ROUTE_THREADS / 32;
    R = T <= 64 ? 1 : R;
    const unsigned blocks = (unsigned)((T + R - 1) / R);
    DUET__TRY(duet_pdl_launch(duet__route_kernel, dim3(blocks), dim3(DUET__ROUTE_THREADS),
                              per_row * (size_t)R, stream, logits, bias, (int)T, (int)E, (int)G,
                              (int)topk_group, (int)top_k, renorm, scale, (int)R, idx, wts),
              "route kernel launch");
    return DUET_OK;
}

/* ---- the router and the routing of up to 8 rows, one kernel (decode, verify) ----------------- */

/* Warps per router row, each with every DUET__RR_SPLIT-th 32 pieces: 8 (one row per block, 256
 * blocks) puts the router's fp32 rows in flight soonest, in a kernel on every MoE layer's serial
 * chain (bench/RESULTS.md, "Router kernel: 8 warps per router row"). */
#define DUET__RR_SPLIT 8
#define DUET__RR_ROWS  (DUET__ROUTE_THREADS / 32 / DUET__RR_SPLIT) /* router rows per block */
#define DUET__RR_U     3 /* float4 pieces per lane in flight: D = 2304 is 2.25 per lane */
/* Scores per thread in flight in block 0's routing when it takes duet__route_block (its U). With 8,
 * as the routing kernel has, the kernel's code is much larger, and one block runs it once per
 * layer from a cold instruction cache (bench/RESULTS.md, "Router kernel: one score per thread in
 * flight"). */
#define DUET__RR_ROUTE_U 1

/* One float4 piece of x into a running sum of squares, every rounding spelled out: the router
 * kernel and the shared expert's early gate/up blocks (duet__gemv13_shared_early) form the same
 * norm scale from the same pieces in the same order, so they must round alike. */
static __device__ __forceinline__ float duet__sumsq4(float ss, float4 v)
{
    return __fadd_rn(ss, __fadd_rn(__fadd_rn(__fmul_rn(v.x, v.x), __fmul_rn(v.y, v.y)),
                                   __fadd_rn(__fmul_rn(v.z, v.z), __fmul_rn(v.w, v.w))));
}

/* The norm scale from a row's DUET__RR_SPLIT warp sums of squares (sq[j · stride], warp j),
 * added in warp order: the router kernel and duet__gemv13_shared_early form it here alike. */
static __device__ __forceinline__ float duet__rr_scale(const float *sq, int stride, int D,
                                                       float eps)
{
    float s = sq[0];
    for (int j = 1; j < DUET__RR_SPLIT; j++)
        s += sq[j * stride];
    return duet_rms_scale((double)s, (double)D, eps);
}

typedef struct {
    const float *x, *nw, *w, *bias; /* x [T][D], norm weight [D], router [E][D] fp32, bias [E] */
    float *xn, *logits;             /* [T][D], [T][E] */
    int32_t *idx;                   /* [T][top_k] */
    float *wts;                     /* [T][top_k] */
    unsigned *count;                /* the calls so far (sync[0] of the API) */
    unsigned long long *slot;       /* [T][E] this call's logits, tagged with its count */
    int T, E, D, G, topk_group, top_k, renorm;
    float eps, scale;
    int early; /* the weights load before the PDL wait (duet_cuda_weights_early) */
} duet__rr_args_t;

/* This block's share of row m of xn = RMSNorm(x) ⊙ nw, rounded as duet_cuda_rmsnorm rounds it
 * (every block has the same scale: the same sums in the same order). */
static __device__ __forceinline__ void duet__rr_store_xn(const duet__rr_args_t &a, int m,
                                                         float scale)
{
    const int per = (a.D + (int)gridDim.x - 1) / (int)gridDim.x, k0 = (int)blockIdx.x * per;
    const float *x = a.x + (size_t)m * a.D;
    float *xn = a.xn + (size_t)m * a.D;
    for (int k = k0 + (int)threadIdx.x; k < a.D && k < k0 + per; k += (int)blockDim.x)
        xn[k] = duet_rms_apply(a.nw[k], x[k], scale);
}

/* A logit published with the call's tag in one 64-bit store: the word is its own flag. */
static __device__ __forceinline__ void duet__rr_publish(unsigned long long *slot, unsigned tag,
                                                        float v)
{
    const unsigned long long w = (unsigned long long)tag << 32 | __float_as_uint(v);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;\n" ::"l"(slot), "l"(w) : "memory");
#else
    *(volatile unsigned long long *)slot = w;
#endif
}

/* Expert e's logit once its block has published it with this call's tag. A tag that never comes
 * (a sync area shared by calls in flight at once, against cuda_ops.h) traps after about 10 s
 * instead of hanging: the launch fails with an error the caller sees. */
static __device__ __forceinline__ float duet__rr_collect(const unsigned long long *slot,
                                                         unsigned tag)
{
    unsigned long long w, t0 = 0;
    for (unsigned n = 0;; n++) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
        asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];\n" : "=l"(w) : "l"(slot) : "memory");
#else
        w = *(const volatile unsigned long long *)slot;
#endif
        if ((unsigned)(w >> 32) == tag)
            return __uint_as_float((unsigned)w);
        if ((n & 1023u) == 0) {
            unsigned long long t;
            asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
            if (n == 0)
                t0 = t;
            else if (t - t0 > 10000000000ull)
                __trap();
        }
    }
}

/*
 * Blocks of DUET__RR_ROWS router rows, DUET__RR_SPLIT warps per row: each warp dots its share
 * of the row with every x row ⊙ nw and sums x² over the same share, the block adds the shares in
 * order and scales by 1/rms (cuda_norm.cuh, as the fused-norm GEMV does). The router weights,
 * the norm weight and the routing bias (the routing blocks') load before the PDL wait, as
 * weights may; x after it, so that only x's round trip is on the wait-to-route path
 * (bench/RESULTS.md, "Router kernel: norm weight and bias before the PDL wait"). Each block
 * stores its share of every xn row.
 * Each block publishes its logits tagged with the call's number (duet__rr_publish) and exits,
 * but for blocks 0 .. T - 1: block m collects row m's E logits, spinning on the tags, and routes
 * the row: with no groups and a thread per expert by duet__route_row_sorted, else with
 * duet_cuda_moe_route's code. Only they wait, for blocks that never wait for anything, so the
 * grid makes progress however few of its blocks fit at once. The tag is the call count + 1 (0
 * skipped), which block 0 stores at its end for the next call (which reads it before its PDL
 * wait: see there). This replaced a ticket (each block's fence and atomic, the last block
 * routing after reloading the logits) and top_k rounds of warp picks, which made the path from
 * the router's wait to the gate/up blocks' release nearly twice as long (bench/RESULTS.md,
 * "Router kernel: tagged logits instead of a ticket"). MT: the most rows, 1 (decode at batch 1,
 * whose code stays as short as it was) or DUET_CUDA_ROUTER_MAX_T.
 */
template <int MT>
__global__ void __launch_bounds__(DUET__ROUTE_THREADS) duet__router_route_kernel(duet__rr_args_t a)
{
    extern __shared__ float route_sh[];
    __shared__ float part[DUET__ROUTE_THREADS / 32][MT][2];
    __shared__ float row_scale[MT];
    __shared__ unsigned long long cand[DUET__ROUTE_THREADS]; /* duet__route_row_sorted's */
    __shared__ float s_sh[DUET__ROUTE_THREADS];
    __shared__ int pick[32];
    __shared__ float pick_s[32];
    constexpr int U = DUET__RR_U, S = DUET__RR_SPLIT;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int q = warp % S, e = blockIdx.x * DUET__RR_ROWS + warp / S;
    const int nq = a.D / 4;
    const float4 *w4 = reinterpret_cast<const float4 *>(a.w + (size_t)min(e, a.E - 1) * a.D);
    const float4 *g4 = reinterpret_cast<const float4 *>(a.nw);
    float4 wv[U], gv[U];
    float b0[DUET__RR_ROUTE_U];
    if (!a.early)
        duet_pdl_wait();
#pragma unroll
    for (int u = 0; u < U; u++) {
        const int i = (q + S * u) * 32 + lane;
        wv[u] = i < nq ? __ldg(w4 + i) : make_float4(0.f, 0.f, 0.f, 0.f);
        gv[u] = i < nq ? __ldg(g4 + i) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    /* for the routing blocks' rows; the other blocks only zero b0 */
    duet__route_bias0<DUET__RR_ROUTE_U>((int)blockIdx.x < a.T ? a.bias : NULL, a.E, a.E, b0);
    /* The call's tag, before the wait, against the contract of cuda_pdl.cuh but safely: the
     * previous call's block 0 stored it, and that grid completed before the kernel this one
     * waits for could complete its own wait (every kernel of the step waits before it exits). */
    unsigned tag = *(volatile unsigned *)a.count + 1u;
    tag = tag != 0 ? tag : 1u; /* slots start zeroed */
    duet_pdl_wait();           /* x (a second wait returns at once) */
    duet_pdl_trigger();
    float dot[MT], ss[MT];
#pragma unroll
    for (int m = 0; m < MT; m++)
        dot[m] = ss[m] = 0.0f;
    for (int i0 = 0; i0 < nq; i0 += S * U * 32) {
        if (i0 > 0)
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int i = i0 + (q + S * u) * 32 + lane;
                wv[u] = i < nq ? __ldg(w4 + i) : make_float4(0.f, 0.f, 0.f, 0.f);
                gv[u] = i < nq ? __ldg(g4 + i) : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int i = i0 + (q + S * u) * 32 + lane;
            if (i < nq)
#pragma unroll
                for (int m = 0; m < MT; m++)
                    if (m < a.T) {
                        const float4 xv = reinterpret_cast<const float4 *>(a.x)[m * nq + i];
                        const float4 g = gv[u];
                        ss[m] = duet__sumsq4(ss[m], xv);
                        dot[m] += wv[u].x * (xv.x * g.x) + wv[u].y * (xv.y * g.y) +
                                  wv[u].z * (xv.z * g.z) + wv[u].w * (xv.w * g.w);
                    }
        }
    }
#pragma unroll
    for (int m = 0; m < MT; m++)
        if (m < a.T) {
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) {
                dot[m] += __shfl_xor_sync(0xffffffffu, dot[m], off);
                ss[m] += __shfl_xor_sync(0xffffffffu, ss[m], off);
            }
            if (lane == 0) {
                part[warp][m][0] = dot[m];
                part[warp][m][1] = ss[m];
            }
        }
    __syncthreads();
    if ((int)threadIdx.x < DUET__RR_ROWS * a.T) {
        const int r = threadIdx.x % DUET__RR_ROWS, m = threadIdx.x / DUET__RR_ROWS;
        const int er = blockIdx.x * DUET__RR_ROWS + r;
        float d = part[r * S][m][0];
        for (int j = 1; j < S; j++)
            d += part[r * S + j][m][0];
        const float sc = duet__rr_scale(&part[r * S][m][1], 2 * MT, a.D, a.eps);
        if (er < a.E)
            duet__rr_publish(a.slot + (size_t)m * a.E + er, tag, d * sc);
        if (r == 0)
            row_scale[m] = sc;
    }
    __syncthreads();
    for (int m = 0; m < a.T; m++)
        duet__rr_store_xn(a, m, row_scale[m]);
    if ((int)blockIdx.x >= a.T)
        return;
    const int m = blockIdx.x; /* this block routes row m */
    const unsigned long long *slot = a.slot + (size_t)m * a.E;
    float *lg = a.logits + (size_t)m * a.E;
    float l = 0.0f; /* expert threadIdx.x's logit (E <= blockDim.x) */
    for (int i = threadIdx.x; i < a.E; i += blockDim.x) {
        const float v = duet__rr_collect(slot + i, tag);
        lg[i] = v; /* duet__route_block reads them back: this thread's own stores */
        if (i == (int)threadIdx.x)
            l = v;
    }
    if (a.G == 1 && a.E <= (int)blockDim.x)
        duet__route_row_sorted(cand, s_sh, pick, pick_s, l, b0[0], a.E, a.top_k, a.renorm, a.scale,
                               a.idx + (size_t)m * a.top_k, a.wts + (size_t)m * a.top_k);
    else
        duet__route_block(route_sh, a.logits, a.bias, b0, m, 1, a.T, a.E, a.G, a.topk_group,
                          a.top_k, a.renorm, a.scale, a.idx, a.wts);
    if (m == 0 && threadIdx.x == 0)
        *(volatile unsigned *)a.count = tag;
}

extern "C" duet_status_t duet_cuda_moe_router_route(
    cudaStream_t stream, const float *x, int64_t T, const float *nw, float eps, const float *w,
    int64_t E, int64_t D, const float *bias, int64_t n_group, int64_t topk_group, int64_t top_k,
    int renorm, float scale, float *xn, float *logits, int32_t *idx, float *wts, int *sync)
{
    size_t per_row;
    const duet_status_t st = duet__route_check("moe_router_route", logits, T, E, n_group,
                                               topk_group, top_k, idx, wts, &per_row);
    if (st != DUET_OK)
        return st;
    if (T == 0)
        return DUET_OK;
    if (T > DUET_CUDA_ROUTER_MAX_T)
        return duet_error_set(DUET_ERR_INVALID,
                              "cuda moe_router_route: T = %lld rows (at most %d; more take the "
                              "router GEMM and duet_cuda_moe_route)",
                              (long long)T, DUET_CUDA_ROUTER_MAX_T);
    if (x == NULL || nw == NULL || w == NULL || xn == NULL || sync == NULL || D <= 0 ||
        D > 0x7fffffff / DUET_CUDA_ROUTER_MAX_T || D % 4 != 0 || !duet__aligned16(x) ||
        !duet__aligned16(nw) || !duet__aligned16(w) || ((uintptr_t)sync & 7u) != 0)
        return duet_error_set(DUET_ERR_INVALID,
                              "cuda moe_router_route: bad arguments (D=%lld: a multiple of 4, "
                              "x, the norm and router weights 16-byte aligned, sync 8-byte "
                              "aligned)",
                              (long long)D);
    if ((xn < x + T * D && x < xn + T * D) || (xn < nw + D && nw < xn + T * D))
        return duet_error_set(DUET_ERR_INVALID, "cuda moe_router_route: xn overlaps x or nw");
    duet__rr_args_t a = {.x = x,
                         .nw = nw,
                         .w = w,
                         .bias = bias,
                         .xn = xn,
                         .logits = logits,
                         .idx = idx,
                         .wts = wts,
                         .count = (unsigned *)sync,
                         .slot = (unsigned long long *)(sync + 2),
                         .T = (int)T,
                         .E = (int)E,
                         .D = (int)D,
                         .G = (int)(n_group > 0 ? n_group : 1),
                         .topk_group = (int)topk_group,
                         .top_k = (int)top_k,
                         .renorm = renorm,
                         .eps = eps,
                         .scale = scale,
                         .early = duet_cuda_weights_early()};
    /* a block per router row, and at least one per routed row */
    int64_t blocks = (E + DUET__RR_ROWS - 1) / DUET__RR_ROWS;
    blocks = blocks > T ? blocks : T;
    DUET__TRY(duet_pdl_launch(T == 1 ? duet__router_route_kernel<1>
                                     : duet__router_route_kernel<DUET_CUDA_ROUTER_MAX_T>,
                              dim3((unsigned)blocks), dim3(DUET__ROUTE_THREADS), per_row, stream,
                              a),
              "router-route kernel launch");
    return DUET_OK;
}

/* ---- plan: group (row, k) pairs by expert --------------------------------------------------- */

/* The token of pair p: p / top_k, or for the shared expert's row P + t, t. */
static __device__ __forceinline__ int duet__pair_row(const duet__moe_plan_t &pl, int p)
{
    return p < pl.P ? p / pl.top_k : p - pl.P;
}

/* The expert of pair p: idx[p] for the P routed pairs (-1 when out of range: the plan skips the
 * pair), E for the shared expert's rows P + t when it is folded in. */
static __device__ __forceinline__ int duet__pair_expert(const int32_t *idx, int P, int E, int p)
{
    if (p >= P)
        return E;
    const int e = idx[p];
    return e >= 0 && e < E ? e : -1;
}

/* Pairs [per · b, per · (b + 1)) ∩ [0, P) belong to plan block b. */
static __device__ __forceinline__ void duet__plan_range(int P, int per, int *p0, int *p1)
{
    *p0 = (int)blockIdx.x * per;
    *p1 = min(P, *p0 + per);
}

/* cnt[e] += the pairs of [p0, p1) of expert e (shared-memory atomics); invalid experts are
 * skipped. */
static __device__ __forceinline__ void duet__plan_count(const int32_t *idx, int P, int p0, int p1,
                                                        int E, int *cnt)
{
    for (int p = p0 + (int)threadIdx.x; p < p1; p += blockDim.x) {
        const int e = duet__pair_expert(idx, P, E, p);
        if (e >= 0)
            atomicAdd(&cnt[e], 1);
    }
}

/* The plan in several blocks, part 1: block b counts the experts of its pairs into hist[b][e],
 * e <= E (E: the shared expert's rows, pairs P .. Ps - 1). */
__global__ void __launch_bounds__(DUET__PLAN_THREADS)
    duet__moe_count_kernel(const int32_t *idx, int P, int Ps, int E, int per, int *hist)
{
    extern __shared__ int plan_sh[];
    const int En = E + 1;
    for (int e = threadIdx.x; e < En; e += blockDim.x)
        plan_sh[e] = 0;
    duet_pdl_wait(); /* the routing; the previous call's plan is done with hist */
    duet_pdl_trigger();
    __syncthreads();
    int p0, p1;
    duet__plan_range(Ps, per, &p0, &p1);
    duet__plan_count(idx, P, p0, p1, E, plan_sh);
    __syncthreads();
    for (int e = threadIdx.x; e < En; e += blockDim.x)
        hist[(int64_t)blockIdx.x * En + e] = plan_sh[e];
}

/*
 * One block per `per` pairs of the Ps (P routed ones, then the shared expert's rows as expert E
 * when it is folded in). A single block counts its pairs itself; with several, each sums
 * duet__moe_count_kernel's hist for every expert's total and for the pairs of that expert in
 * the blocks before it. Every block scans the totals, block 0 writes off, slots, tiles and meta,
 * and each block places its own pairs in their experts' lists after those of the blocks before.
 * The order of pairs inside one block's part of a list depends on atomics, which is harmless:
 * every pair's output is computed on its own with a fixed operation order, wherever it sits.
 */
__global__ void __launch_bounds__(DUET__PLAN_THREADS)
    duet__moe_plan_kernel(const int32_t *idx, int P, int Ps, int E, int nr, int bm, int per,
                          const int *hist, duet__moe_plan_t pl)
{
    extern __shared__ int plan_sh[];
    const int En = E + 1; /* the experts and the shared one's slot (no pairs unless folded in) */
    int *cnt = plan_sh, *cur = plan_sh + En;
    const int nb = (int)gridDim.x, b = (int)blockIdx.x;
    for (int e = threadIdx.x; e < En; e += blockDim.x)
        cnt[e] = cur[e] = 0;
    duet_pdl_wait(); /* the routing or the counts; the previous call's kernels are done with the
                      * scratch */
    duet_pdl_trigger();
    __syncthreads();
    int p0, p1;
    duet__plan_range(Ps, per, &p0, &p1);
    if (nb == 1) {
        duet__plan_count(idx, P, p0, p1, E, cnt);
    } else {
        for (int e = threadIdx.x; e < En; e += blockDim.x) {
            int tot = 0, before = 0;
            for (int j = 0; j < nb; j++) {
                const int c = hist[(int64_t)j * En + e];
                tot += c;
                before += j < b ? c : 0;
            }
            cnt[e] = tot;
            cur[e] = before;
        }
    }
    __syncthreads();
    const int chunk = (En + (int)blockDim.x - 1) / (int)blockDim.x;
    const int e0 = min(En, (int)threadIdx.x * chunk), e1 = min(En, e0 + chunk);
    int c = 0, s = 0, q = 0;
    for (int e = e0; e < e1; e++) {
        c += cnt[e];
        s += (cnt[e] + nr - 1) / nr;
        q += (cnt[e] + bm - 1) / bm;
    }
    int c_tot, s_tot, q_tot;
    int cb = duet__block_excl_scan(c, &c_tot);
    int sb = duet__block_excl_scan(s, &s_tot);
    int qb = duet__block_excl_scan(q, &q_tot);
    for (int e = e0; e < e1; e++) {
        const int n = cnt[e];
        cur[e] += cb;
        if (b == 0) {
            pl.off[e] = cb;
            for (int j = 0; j < n; j += nr)
                pl.slots[sb++] = make_int2(e, cb + j);
            for (int j = 0; j < n; j += bm)
                pl.tiles[qb++] = make_int2(e, cb + j);
        }
        cb += n;
    }
    if (b == 0 && threadIdx.x == 0) {
        pl.off[En] = c_tot;
        pl.meta[0] = s_tot;
        pl.meta[1] = q_tot;
        pl.meta[2] = pl.meta[3] = 0; /* the warp-specialised kernels' work counters */
    }
    __syncthreads();
    for (int p = p0 + (int)threadIdx.x; p < p1; p += blockDim.x) {
        const int e = duet__pair_expert(idx, P, E, p);
        if (e >= 0)
            pl.list[atomicAdd(&cur[e], 1)] = p;
    }
}

/* ---- GEMV path ------------------------------------------------------------------------------ */

/* Weight dtype tags: 16-byte chunks hold VEC elements. */
template <int DT> struct duet__wt;
template <> struct duet__wt<DUET_DTYPE_F32> {
    static constexpr int VEC = 4;
    static __device__ __forceinline__ void cvt(uint4 v, float *f)
    {
        f[0] = __uint_as_float(v.x);
        f[1] = __uint_as_float(v.y);
        f[2] = __uint_as_float(v.z);
        f[3] = __uint_as_float(v.w);
    }
};
template <> struct duet__wt<DUET_DTYPE_BF16> {
    static constexpr int VEC = 8;
    static __device__ __forceinline__ void cvt(uint4 v, float *f)
    {
        duet_cvt8_bf16(v, f);
    }
};
template <> struct duet__wt<DUET_DTYPE_F16> {
    static constexpr int VEC = 8;
    static __device__ __forceinline__ void cvt(uint4 v, float *f)
    {
        duet_cvt8_f16(v, f);
    }
};

/*
 * Shared-memory layout of one fp32 activation row of K elements for the GEMV dot products.
 * With 8-element chunks a lane needs elements [8c, 8c + 8) of chunk c; stored plainly, two
 * float4 reads 32 bytes apart per lane would conflict two ways, so the row is split into halves:
 * element 8c + 4h + j sits at h * K/2 + 4c + j, and each float4 read by the warp is contiguous.
 */
template <int VEC> static __device__ __forceinline__ int duet__xs_pos(int k, int K)
{
    if constexpr (VEC == 4)
        return k;
    return ((k >> 2) & 1) * (K >> 1) + ((k >> 3) << 2) + (k & 3);
}

/*
 * Load n rows (K fp32 each, 16-byte aligned; row r from src + row_of(r) * K) into xs, row r at
 * xs + r * K, in the layout above; all threads help. Each thread issues up to 4 loads before it
 * stores any, so a row of up to 4096 floats costs one memory round trip, not one per pass.
 */
template <int VEC, typename RowOf>
static __device__ __forceinline__ void duet__xs_load(float *xs, const float *src, int K, int n,
                                                     RowOf row_of)
{
    constexpr int U = 4;
    const int k4n = K / 4, total = n * k4n, step = (int)blockDim.x;
    for (int q0 = threadIdx.x; q0 < total; q0 += U * step) {
        float4 v[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int q = q0 + u * step, r = q / k4n, k4 = q - r * k4n;
            if (q < total)
                v[u] = reinterpret_cast<const float4 *>(src + (size_t)row_of(r) * K)[k4];
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int q = q0 + u * step, r = q / k4n, k4 = q - r * k4n;
            if (q < total)
                *reinterpret_cast<float4 *>(xs + (size_t)r * K + duet__xs_pos<VEC>(4 * k4, K)) =
                    v[u];
        }
    }
}

/* Ask L2 for bytes [from, bytes) of each of NW weight rows (one warp; no registers held). */
template <int NW>
static __device__ __forceinline__ void duet__prefetch_rows(const uint4 *const *w, size_t from,
                                                           size_t bytes, int lane)
{
    for (size_t off = from + (size_t)lane * 128; off < bytes; off += 32 * 128)
#pragma unroll
        for (int j = 0; j < NW; j++)
            asm volatile("prefetch.global.L2 [%0];\n" ::"l"((const char *)w[j] + off));
}

/* The first U chunks of each of a warp's NW weight rows (lane l: chunks l, l + 32, ...), loaded
 * ahead of the PDL wait by duet__load_first. */
template <int NW, int U> struct duet__wfirst {
    uint4 v[U][NW];
};

template <int NW, int U>
static __device__ __forceinline__ void duet__load_first(duet__wfirst<NW, U> &f,
                                                        const uint4 *const *w, int nchunk, int lane)
{
#pragma unroll
    for (int u = 0; u < U; u++)
#pragma unroll
        for (int j = 0; j < NW; j++)
            f.v[u][j] = lane + 32 * u < nchunk ? duet_ld_weight16(w[j] + lane + 32 * u)
                                               : make_uint4(0, 0, 0, 0);
}

/* One pass of duet__gemv_warp: chunks c0, c0 + 32, ... (U of them, those < nchunk) of the NW
 * rows, already loaded into wv. */
template <int DT, int NR, int NW, int U>
static __device__ __forceinline__ void duet__gemv_chunks(const uint4 (&wv)[U][NW], int c0,
                                                         int nchunk, const float *xs, int K, int n,
                                                         float (&acc)[NW][NR])
{
    constexpr int VEC = duet__wt<DT>::VEC;
#pragma unroll
    for (int u = 0; u < U; u++) {
        const int c = c0 + 32 * u;
        if (c >= nchunk)
            break;
        float wf[NW][VEC];
#pragma unroll
        for (int j = 0; j < NW; j++)
            duet__wt<DT>::cvt(wv[u][j], wf[j]);
#pragma unroll
        for (int r = 0; r < NR; r++) {
            /* padding rows (r >= n) repeat row n - 1; their sums are not stored */
            const float *xr = xs + (r < n ? r : n - 1) * K;
            float xv[VEC];
            const float4 lo = *reinterpret_cast<const float4 *>(xr + duet__xs_pos<VEC>(c * VEC, K));
            xv[0] = lo.x;
            xv[1] = lo.y;
            xv[2] = lo.z;
            xv[3] = lo.w;
            if constexpr (VEC == 8) {
                const float4 hi =
                    *reinterpret_cast<const float4 *>(xr + duet__xs_pos<VEC>(c * VEC + 4, K));
                xv[4] = hi.x;
                xv[5] = hi.y;
                xv[6] = hi.z;
                xv[7] = hi.w;
            }
#pragma unroll
            for (int j = 0; j < NW; j++)
#pragma unroll
                for (int v = 0; v < VEC; v++)
                    acc[j][r] = fmaf(wf[j][v], xv[v], acc[j][r]);
        }
    }
}

/*
 * One warp: acc[j][r] = W_j · xs_r for NW weight rows (global, 16-byte aligned, K elements) and
 * NR activation rows (shared, layout above). Lane l takes chunks l, l + 32, ...; fp32 FMA.
 * With PRE the first U chunks of each row are already in `first` (duet__load_first); the pass
 * that uses them is peeled off, so `first` stays in registers.
 */
template <int DT, int NR, int NW, int U, bool PRE>
static __device__ __forceinline__ void duet__gemv_warp(const uint4 *const *w, const float *xs,
                                                       int K, int n, int lane, float (&acc)[NW][NR],
                                                       const duet__wfirst<NW, U> &first)
{
    constexpr int VEC = duet__wt<DT>::VEC;
    const int nchunk = K / VEC;
#pragma unroll
    for (int j = 0; j < NW; j++)
#pragma unroll
        for (int r = 0; r < NR; r++)
            acc[j][r] = 0.0f;
    int c0 = lane;
    if constexpr (PRE) {
        duet__gemv_chunks<DT, NR, NW, U>(first.v, c0, nchunk, xs, K, n, acc);
        c0 += 32 * U;
    }
    for (; c0 < nchunk; c0 += 32 * U) {
        uint4 wv[U][NW];
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int j = 0; j < NW; j++)
                wv[u][j] = c0 + 32 * u < nchunk ? duet_ld_weight16(w[j] + c0 + 32 * u)
                                                : make_uint4(0, 0, 0, 0);
        duet__gemv_chunks<DT, NR, NW, U>(wv, c0, nchunk, xs, K, n, acc);
    }
#pragma unroll
    for (int j = 0; j < NW; j++)
#pragma unroll
        for (int r = 0; r < NR; r++)
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
                acc[j][r] += __shfl_xor_sync(0xffffffffu, acc[j][r], o);
}

/* Phase 1 for one warp: RI outputs i0.. of h for the slot's n rows (NR >= n, padding rows
 * repeat row n - 1 and are not stored). */
template <int DT, int NR, int U, bool PRE = false>
static __device__ __forceinline__ void
duet__gemv13_rows(const uint4 *const *w, const float *xs, int D, int I, int i0, int n,
                  const int *pairs, int act, float beta, float beta_lin, float *h, int lane,
                  const duet__wfirst<2 * DUET__GV_RI, U> &first)
{
    float acc[2 * DUET__GV_RI][NR];
    duet__gemv_warp<DT, NR, 2 * DUET__GV_RI, U, PRE>(w, xs, D, n, lane, acc, first);
#pragma unroll
    for (int j = 0; j < DUET__GV_RI; j++)
#pragma unroll
        for (int r = 0; r < NR; r++)
            if (lane == ((j * NR + r) & 31) && r < n && i0 + j < I)
                h[(size_t)pairs[r] * I + i0 + j] =
                    duet_act_apply(acc[j][r], acc[DUET__GV_RI + j][r], act, beta, beta_lin);
}

template <int DT, int NR, int U, bool PRE = false>
static __device__ __forceinline__ void
duet__gemv2_rows(const uint4 *const *w, const float *hs, int I, int D, int d0, int n,
                 const int *pairs, float *out, int lane, const duet__wfirst<DUET__GV_RD, U> &first)
{
    float acc[DUET__GV_RD][NR];
    duet__gemv_warp<DT, NR, DUET__GV_RD, U, PRE>(w, hs, I, n, lane, acc, first);
#pragma unroll
    for (int j = 0; j < DUET__GV_RD; j++)
#pragma unroll
        for (int r = 0; r < NR; r++)
            if (lane == ((j * NR + r) & 31) && r < n && d0 + j < D)
                out[(size_t)pairs[r] * D + d0 + j] = acc[j][r];
}

/* Phase 1 or 2 for a slot of n rows (1 <= n <= NRMAX): the rows function instantiated for the
 * fewest compiled rows that hold n (padding rows repeat row n - 1). */
template <int DT, int NRMAX, int U>
static __device__ __forceinline__ void
duet__gemv13_slot_rows(const uint4 *const *w, const float *xs, int D, int I, int i0, int n,
                       const int *pairs, int act, float beta, float beta_lin, float *h, int lane,
                       const duet__wfirst<2 * DUET__GV_RI, U> &first)
{
    if (NRMAX == 1 || n == 1)
        duet__gemv13_rows<DT, 1, U>(w, xs, D, I, i0, n, pairs, act, beta, beta_lin, h, lane, first);
    else if (NRMAX == 2 || n == 2)
        duet__gemv13_rows<DT, (NRMAX >= 2 ? 2 : 1), U>(w, xs, D, I, i0, n, pairs, act, beta,
                                                       beta_lin, h, lane, first);
    else if (NRMAX == 4 || n <= 4)
        duet__gemv13_rows<DT, (NRMAX >= 4 ? 4 : 1), U>(w, xs, D, I, i0, n, pairs, act, beta,
                                                       beta_lin, h, lane, first);
    else
        duet__gemv13_rows<DT, NRMAX, U>(w, xs, D, I, i0, n, pairs, act, beta, beta_lin, h, lane,
                                        first);
}

template <int DT, int NRMAX, int U>
static __device__ __forceinline__ void
duet__gemv2_slot_rows(const uint4 *const *w, const float *hs, int I, int D, int d0, int n,
                      const int *pairs, float *out, int lane,
                      const duet__wfirst<DUET__GV_RD, U> &first)
{
    if (NRMAX == 1 || n == 1)
        duet__gemv2_rows<DT, 1, U>(w, hs, I, D, d0, n, pairs, out, lane, first);
    else if (NRMAX == 2 || n == 2)
        duet__gemv2_rows<DT, (NRMAX >= 2 ? 2 : 1), U>(w, hs, I, D, d0, n, pairs, out, lane, first);
    else if (NRMAX == 4 || n <= 4)
        duet__gemv2_rows<DT, (NRMAX >= 4 ? 4 : 1), U>(w, hs, I, D, d0, n, pairs, out, lane, first);
    else
        duet__gemv2_rows<DT, NRMAX, U>(w, hs, I, D, d0, n, pairs, out, lane, first);
}

/*
 * The slot of this block: its row count n (-1 when past the device-side count), its expert in
 * *e_p and its pairs in `pairs` (padded to nrmax with the last one). Without a plan the block is
 * pair blockIdx.x alone, also when its expert id is invalid (then *e_p = -1: nothing to compute,
 * but gemv2's block still takes the pair's ticket); block P is the shared expert (*e_p = E).
 */
static __device__ __forceinline__ int duet__slot(const duet__moe_plan_t &pl, int nrmax, int bx,
                                                 int *e_p, int *pairs)
{
    if (pl.list == NULL) {
        if (threadIdx.x < (unsigned)nrmax)
            pairs[threadIdx.x] = bx;
        if (bx >= pl.P) { /* the shared expert's slot */
            *e_p = pl.E;
            return 1;
        }
        const int e = pl.idx[bx];
        *e_p = e >= 0 && e < pl.E ? e : -1;
        return 1;
    }
    if (bx >= pl.meta[0])
        return -1;
    const int2 sl = pl.slots[bx];
    const int n = min(nrmax, pl.off[sl.x + 1] - sl.y);
    if (threadIdx.x < (unsigned)nrmax)
        pairs[threadIdx.x] = pl.list[sl.y + min((int)threadIdx.x, n - 1)];
    *e_p = sl.x;
    return n;
}

/* A warp's W1 rows (w[0 .. RI)) and W3 rows (w[RI .. 2 RI)) for outputs i0.. of the expert
 * whose matrices start at row e0 of b1 and b3 (rows past I repeat row I - 1). */
static __device__ __forceinline__ void duet__gemv13_row_ptrs(const uint4 *(&w)[2 * DUET__GV_RI],
                                                             const void *b1, const void *b3,
                                                             size_t e0, int i0, int I, int D,
                                                             size_t es)
{
#pragma unroll
    for (int j = 0; j < DUET__GV_RI; j++) {
        const size_t row = e0 + min(i0 + j, I - 1);
        w[j] = reinterpret_cast<const uint4 *>((const char *)b1 + row * D * es);
        w[DUET__GV_RI + j] = reinterpret_cast<const uint4 *>((const char *)b3 + row * D * es);
    }
}

/* A warp's W2 rows d0 .. d0 + RD - 1 of the expert whose matrix starts at row e0 of b2 (rows
 * past D repeat row D - 1). */
static __device__ __forceinline__ void duet__gemv2_row_ptrs(const uint4 *(&w)[DUET__GV_RD],
                                                            const void *b2, size_t e0, int d0,
                                                            int I, int D, size_t es)
{
#pragma unroll
    for (int j = 0; j < DUET__GV_RD; j++) {
        const size_t row = e0 + min(d0 + j, D - 1);
        w[j] = reinterpret_cast<const uint4 *>((const char *)b2 + row * I * es);
    }
}

/* gemv2's tickets start at 0: every block of the gate/up grid clears its share, after its PDL
 * wait (the previous call's gemv2 read them). */
static __device__ __forceinline__ void duet__gemv13_clear_tickets(const duet__moe_plan_t &pl)
{
    if (pl.cnt != NULL) {
        const int nb = gridDim.x * gridDim.y, b = blockIdx.y * gridDim.x + blockIdx.x;
        for (int i = b * blockDim.x + threadIdx.x; i < pl.n_cnt; i += nb * blockDim.x)
            pl.cnt[i] = 0;
    }
}

/*
 * The shared expert's gate/up at T = 1, slice `by`, without waiting for the routing: its
 * weights are known, and its input x = RMSNorm(nx) ⊙ nw is formed here from nx, the residual
 * row that the router kernel reads (and stores xn from) — the same pieces summed in the same
 * order with the same roundings (duet__sumsq4, the warps' shuffles, the warps' sums in order,
 * duet_rms_scale, duet_rms_apply), so the same bits as the xn the routed slots read.
 * Before the wait, against the contract of cuda_pdl.cuh but safely, as gemv2 reads the plan:
 * this grid starts only once every router block has triggered, which each does after its own
 * wait, i.e. after the kernel that wrote nx completed; nothing in the step writes nx or row P of
 * h until this grid and its successor have completed. Measured: bench/RESULTS.md, "Shared
 * expert's gate/up beside the router".
 */
template <int DT, int U>
static __device__ __forceinline__ void
duet__gemv13_shared_early(const duet__moe_plan_t &pl, int by, int I, int D, int act, float beta,
                          float beta_lin, float *h, float *xs, int *pairs)
{
    static_assert(DUET__GV_WARPS == DUET__RR_SPLIT, "one warp per router row share");
    __shared__ float part[DUET__GV_WARPS], scale;
    constexpr int VEC = duet__wt<DT>::VEC, S = DUET__RR_SPLIT, RU = DUET__RR_U;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int i0 = (by * DUET__GV_WARPS + warp) * DUET__GV_RI;
    const size_t es = DT == DUET_DTYPE_F32 ? 4 : 2;
    const uint4 *w[2 * DUET__GV_RI];
    duet__gemv13_row_ptrs(w, pl.sw1, pl.sw3, 0, i0, I, D, es);
    duet__wfirst<2 * DUET__GV_RI, U> first;
    if (i0 < I)
        duet__load_first(first, w, D / VEC, lane);
    if (threadIdx.x == 0)
        pairs[0] = pl.P;
    const float4 *x4 = reinterpret_cast<const float4 *>(pl.nx);
    const int nq = D / 4;
    float ss = 0.0f;
    for (int q0 = 0; q0 < nq; q0 += S * RU * 32)
#pragma unroll
        for (int u = 0; u < RU; u++) {
            const int i = q0 + (warp + S * u) * 32 + lane;
            if (i < nq)
                ss = duet__sumsq4(ss, x4[i]);
        }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
        ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if (lane == 0)
        part[warp] = ss;
    __syncthreads();
    if (threadIdx.x == 0)
        scale = duet__rr_scale(part, 1, D, pl.eps);
    __syncthreads();
    for (int k = threadIdx.x; k < D; k += blockDim.x)
        xs[duet__xs_pos<VEC>(k, D)] = duet_rms_apply(pl.nw[k], pl.nx[k], scale);
    __syncthreads();
    if (i0 < I)
        duet__gemv13_rows<DT, 1, U, true>(w, xs, D, I, i0, 1, pairs, act, beta, beta_lin, h, lane,
                                          first);
    duet_pdl_wait();
    duet_pdl_trigger();
    duet__gemv13_clear_tickets(pl);
}

/* h[p][i] = act(W1[e][i] · x[t]) · (W3[e][i] · x[t]) for the slot's pairs p = (t, k). */
template <int DT, int NRMAX, int U>
static __device__ __forceinline__ void
duet__moe_gemv13_body(const void *w1, const void *w3, const float *x, duet__moe_plan_t pl, int I,
                      int D, int act, float beta, float beta_lin, float *h)
{
    extern __shared__ float4 gv_sh[];
    __shared__ int pairs[DUET__GV_NR];
    float *xs = reinterpret_cast<float *>(gv_sh);
    constexpr int VEC = duet__wt<DT>::VEC;
    int e, bx = (int)blockIdx.x, by = (int)blockIdx.y;
    if (NRMAX == 1 && pl.list == NULL && pl.shared && pl.nx != NULL && pl.early) {
        /* The shared expert's slices take the first block ids, so that they are the blocks
         * resident while the router runs, and start at once; the routed slots follow. */
        const int nsl = (int)gridDim.y, lin = (int)(blockIdx.y * gridDim.x + blockIdx.x);
        bx = lin < nsl ? pl.P : lin / nsl - 1;
        by = lin % nsl;
        if (bx == pl.P) {
            duet__gemv13_shared_early<DT, U>(pl, by, I, D, act, beta, beta_lin, h, xs, pairs);
            return;
        }
    }
    duet_pdl_wait(); /* the plan or the routing */
    duet_pdl_trigger();
    duet__gemv13_clear_tickets(pl);
    const int n = duet__slot(pl, NRMAX, bx, &e, pairs);
    if (n < 0 || e < 0)
        return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int i0 = (by * DUET__GV_WARPS + warp) * DUET__GV_RI;
    const size_t es = DT == DUET_DTYPE_F32 ? 4 : 2;
    const uint4 *w[2 * DUET__GV_RI];
    const size_t e0 = e == pl.E ? 0 : (size_t)e * I; /* first row of the expert's matrices */
    duet__gemv13_row_ptrs(w, e == pl.E ? pl.sw1 : w1, e == pl.E ? pl.sw3 : w3, e0, i0, I, D, es);
    /* One row per slot (T = 1): the first weight chunks go out before x's round trip, which
     * they do not need. (With more rows the registers they hold would cost occupancy.) An
     * uninitialised `first` is never read: only the PRE instantiation reads it. */
    constexpr bool PRE = NRMAX == 1;
    duet__wfirst<2 * DUET__GV_RI, U> first;
    const bool pre = PRE && pl.early && i0 < I;
    if (pre)
        duet__load_first(first, w, D / VEC, lane);
    __syncthreads();
    duet__xs_load<VEC>(xs, x, D, n, [&](int r) { return duet__pair_row(pl, pairs[r]); });
    __syncthreads();
    if (i0 >= I)
        return;
    const float *xsp = xs;
    if (PRE && pre)
        duet__gemv13_rows<DT, 1, U, PRE>(w, xsp, D, I, i0, n, pairs, act, beta, beta_lin, h, lane,
                                         first);
    else
        duet__gemv13_slot_rows<DT, NRMAX, U>(w, xsp, D, I, i0, n, pairs, act, beta, beta_lin, h,
                                             lane, first);
}

template <int DT, int NRMAX, int U>
__global__ void __launch_bounds__(DUET__GV_THREADS)
    duet__moe_gemv13_kernel(const void *w1, const void *w3, const float *x, duet__moe_plan_t pl,
                            int I, int D, int act, float beta, float beta_lin, float *h)
{
    duet__moe_gemv13_body<DT, NRMAX, U>(w1, w3, x, pl, I, D, act, beta, beta_lin, h);
}

/* The same at T = 1 (one row per slot), registers capped so that DUET__GV_T1_BLOCKS fit. */
template <int DT, int U>
__global__ void __launch_bounds__(DUET__GV_THREADS, DUET__GV_T1_BLOCKS)
    duet__moe_gemv13_t1_kernel(const void *w1, const void *w3, const float *x, duet__moe_plan_t pl,
                               int I, int D, int act, float beta, float beta_lin, float *h)
{
    duet__moe_gemv13_body<DT, 1, U>(w1, w3, x, pl, I, D, act, beta, beta_lin, h);
}

/* y[t][d] += Σ_k wts[t][k] · out[t * top_k + k][d], k in order, then the shared expert's
 * out[P + t][d] when it is folded in; a pair with an invalid expert adds nothing (the plan
 * skipped it too). The combine kernel's arithmetic, one element. */
static __device__ __forceinline__ float duet__combine_elem(float a, const float *out,
                                                           const int32_t *idx, const float *wts,
                                                           int64_t t, int top_k, int E, int D,
                                                           int d, int P, int shared)
{
    /* out's row exists for every pair (garbage for an invalid one, never used), so all loads
     * can be in flight together */
#pragma unroll 8
    for (int k = 0; k < top_k; k++) {
        const int64_t p = t * top_k + k;
        const int e = idx[p];
        const float w = wts[p], o = __ldcg(out + p * D + d); /* L2: other blocks' rows */
        if (e >= 0 && e < E)
            a = __fadd_rn(a, __fmul_rn(w, o));
    }
    if (shared)
        a = __fadd_rn(a, __ldcg(out + (P + t) * D + d));
    return a;
}

/*
 * out[p][d] = W2[e][d] · h[p] for the slot's pairs, on slice blockIdx.y (32 outputs); then, with
 * tickets (pl.cnt), y[t] += Σ_k wts[t][k] · out[t * top_k + k] on the slice for every row t
 * this block completes (see duet__moe_plan_t).
 */
template <int DT, int NRMAX, int U>
static __device__ __forceinline__ void duet__moe_gemv2_body(const void *w2, const float *h,
                                                            duet__moe_plan_t pl, int I, int D,
                                                            float *out, const float *wts, float *y)
{
    extern __shared__ float4 gv_sh[];
    __shared__ int pairs[DUET__GV_NR], done[DUET__GV_NR];
    float *hs = reinterpret_cast<float *>(gv_sh);
    constexpr int VEC = duet__wt<DT>::VEC;
    int e;
    /* Before the wait, against the contract of cuda_pdl.cuh but safely (see the file comment):
     * gemv13 triggered us after its wait, so the plan and the routing are complete. */
    const int n = duet__slot(pl, NRMAX, (int)blockIdx.x, &e, pairs);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int d0 = (blockIdx.y * DUET__GV_WARPS + warp) * DUET__GV_RD;
    const size_t es = DT == DUET_DTYPE_F32 ? 4 : 2;
    const uint4 *w[DUET__GV_RD];
    const size_t e0 = e < 0 || e == pl.E ? 0 : (size_t)e * D;
    duet__gemv2_row_ptrs(w, e == pl.E ? pl.sw2 : w2, e0, d0, I, D, es);
    /* While phase 1 finishes (W2 does not depend on it): at one row per slot (T = 1) the first
     * chunks of this warp's rows into registers and the rest into L2; with more rows per slot
     * (whose registers cost occupancy) the whole rows into L2. */
    constexpr bool PRE = NRMAX == 1;
    duet__wfirst<DUET__GV_RD, U> first;
    const bool pre = PRE && pl.early && n > 0 && e >= 0 && d0 < D;
    if (pre)
        duet__load_first(first, w, I / VEC, lane);
    if (n > 0 && e >= 0 && d0 < D)
        duet__prefetch_rows<DUET__GV_RD>(w, pre ? (size_t)32 * U * 16 : 0, (size_t)I * es, lane);
    duet_pdl_wait(); /* h, and the tickets gemv13 zeroed */
    duet_pdl_trigger();
    if (n < 0)
        return;
    if (e >= 0) {
        __syncthreads();
        duet__xs_load<VEC>(hs, h, I, n, [&](int r) { return pairs[r]; });
        __syncthreads();
        if (d0 < D) {
            if (PRE && pre)
                duet__gemv2_rows<DT, 1, U, PRE>(w, hs, I, D, d0, n, pairs, out, lane, first);
            else
                duet__gemv2_slot_rows<DT, NRMAX, U>(w, hs, I, D, d0, n, pairs, out, lane, first);
        }
    }
    if (pl.cnt == NULL)
        return;
    /* Tickets: this block's out slices are visible device-wide before it counts them (the
     * barrier orders every thread's stores before the counting thread's fence, which makes them
     * visible with its atomic: one fence per row, not one per thread, which measured a little
     * faster: bench/RESULTS.md, "MoE at T = 1: gemv2's tickets"); the block that completes a
     * row reads the other blocks' slices from L2. A row is complete when every pair of it has
     * counted: with the plan (T > 1) those with a valid expert, which it lists, plus the shared
     * expert's; without (T = 1) every pair, each its own slot. */
    __syncthreads();
    if (threadIdx.x < (unsigned)n) {
        __threadfence();
        const int t = duet__pair_row(pl, pairs[threadIdx.x]);
        int pairs_t = pl.top_k;
        if (pl.list != NULL)
            for (int k = 0; k < pl.top_k; k++)
                pairs_t -= duet__pair_expert(pl.idx, pl.P, pl.E, t * pl.top_k + k) < 0;
        const int c = atomicAdd(pl.cnt + (size_t)t * pl.n_slices + blockIdx.y, 1);
        done[threadIdx.x] = c == pairs_t + pl.shared - 1 ? t : -1;
        __threadfence();
    }
    __syncthreads();
    const int r = threadIdx.x / DUET__GV_SLICE,
              d = blockIdx.y * DUET__GV_SLICE + threadIdx.x % DUET__GV_SLICE;
    if (r < n && d < D && done[r] >= 0) {
        const int64_t t = done[r];
        float *yp = y + t * D + d;
        *yp = duet__combine_elem(*yp, out, pl.idx, wts, t, pl.top_k, pl.E, D, d, pl.P, pl.shared);
    }
}

template <int DT, int NRMAX, int U>
__global__ void __launch_bounds__(DUET__GV_THREADS)
    duet__moe_gemv2_kernel(const void *w2, const float *h, duet__moe_plan_t pl, int I, int D,
                           float *out, const float *wts, float *y)
{
    duet__moe_gemv2_body<DT, NRMAX, U>(w2, h, pl, I, D, out, wts, y);
}

/* The same at T = 1 (one row per slot), registers capped so that DUET__GV_T1_BLOCKS fit. */
template <int DT, int U>
__global__ void __launch_bounds__(DUET__GV_THREADS, DUET__GV_T1_BLOCKS)
    duet__moe_gemv2_t1_kernel(const void *w2, const float *h, duet__moe_plan_t pl, int I, int D,
                              float *out, const float *wts, float *y)
{
    duet__moe_gemv2_body<DT, 1, U>(w2, h, pl, I, D, out, wts, y);
}

/*
 * T > 1 with many slots (duet__gemv_spb): each block takes DUET__GV_SPB slices of its slot's
 * output rows, so that the slot's lookup and its activation rows' round trip through L2 serve
 * four times the weight rows. At T > 1 there are no tickets and no early weight loads, so these
 * are the kernels above without them (a folded shared expert's slots, expert E, as there); each
 * row's arithmetic is theirs (duet__gemv13_rows, duet__gemv2_rows), so the bits are the same.
 */
template <int DT, int NRMAX, int U, int SPB>
__global__ void __launch_bounds__(DUET__GV_THREADS, DUET__GV_MULTI13_BLOCKS)
    duet__moe_gemv13_multi_kernel(const void *w1, const void *w3, const float *x,
                                  duet__moe_plan_t pl, int I, int D, int act, float beta,
                                  float beta_lin, float *h)
{
    static_assert(NRMAX > 1, "T = 1 has its own kernels");
    extern __shared__ float4 gv_sh[];
    __shared__ int pairs[DUET__GV_NR];
    float *xs = reinterpret_cast<float *>(gv_sh);
    constexpr int VEC = duet__wt<DT>::VEC;
    const duet__wfirst<2 * DUET__GV_RI, U> none = {}; /* no early loads */
    int e;
    duet_pdl_wait(); /* the plan */
    duet_pdl_trigger();
    const int n = duet__slot(pl, NRMAX, (int)blockIdx.x, &e, pairs);
    if (n < 0 || e < 0)
        return;
    __syncthreads();
    duet__xs_load<VEC>(xs, x, D, n, [&](int r) { return duet__pair_row(pl, pairs[r]); });
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const size_t es = DT == DUET_DTYPE_F32 ? 4 : 2;
    for (int sl = 0; sl < SPB; sl++) {
        const int i0 = (((int)blockIdx.y * SPB + sl) * DUET__GV_WARPS + warp) * DUET__GV_RI;
        if (i0 >= I)
            return;
        const uint4 *w[2 * DUET__GV_RI];
        duet__gemv13_row_ptrs(w, e == pl.E ? pl.sw1 : w1, e == pl.E ? pl.sw3 : w3,
                              e == pl.E ? 0 : (size_t)e * I, i0, I, D, es);
        duet__gemv13_slot_rows<DT, NRMAX, U>(w, xs, D, I, i0, n, pairs, act, beta, beta_lin, h,
                                             lane, none);
    }
}

template <int DT, int NRMAX, int U, int SPB>
__global__ void __launch_bounds__(DUET__GV_THREADS)
    duet__moe_gemv2_multi_kernel(const void *w2, const float *h, duet__moe_plan_t pl, int I, int D,
                                 float *out, const float *wts, float *y)
{
    static_assert(NRMAX > 1, "T = 1 has its own kernels");
    extern __shared__ float4 gv_sh[];
    __shared__ int pairs[DUET__GV_NR];
    float *hs = reinterpret_cast<float *>(gv_sh);
    constexpr int VEC = duet__wt<DT>::VEC;
    const duet__wfirst<DUET__GV_RD, U> none = {};
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const size_t es = DT == DUET_DTYPE_F32 ? 4 : 2;
    int e;
    /* Before the wait, as in duet__moe_gemv2_body: the plan is complete; the weight rows of
     * every slice into L2 while phase 1 finishes. */
    const int n = duet__slot(pl, NRMAX, (int)blockIdx.x, &e, pairs);
    const uint4 *w[DUET__GV_RD];
    for (int sl = 0; sl < SPB; sl++) {
        const int d0 = (((int)blockIdx.y * SPB + sl) * DUET__GV_WARPS + warp) * DUET__GV_RD;
        if (n > 0 && e >= 0 && d0 < D) {
            duet__gemv2_row_ptrs(w, e == pl.E ? pl.sw2 : w2, e == pl.E ? 0 : (size_t)e * D, d0, I,
                                 D, es);
            duet__prefetch_rows<DUET__GV_RD>(w, 0, (size_t)I * es, lane);
        }
    }
    duet_pdl_wait(); /* h */
    duet_pdl_trigger();
    if (n < 0 || e < 0)
        return;
    __syncthreads();
    duet__xs_load<VEC>(hs, h, I, n, [&](int r) { return pairs[r]; });
    __syncthreads();
    for (int sl = 0; sl < SPB; sl++) {
        const int d0 = (((int)blockIdx.y * SPB + sl) * DUET__GV_WARPS + warp) * DUET__GV_RD;
        if (d0 >= D)
            return;
        duet__gemv2_row_ptrs(w, e == pl.E ? pl.sw2 : w2, e == pl.E ? 0 : (size_t)e * D, d0, I, D,
                             es);
        duet__gemv2_slot_rows<DT, NRMAX, U>(w, hs, I, D, d0, n, pairs, out, lane, none);
    }
}

/* ---- MMA path ------------------------------------------------------------------------------- */

static __device__ __forceinline__ void duet__ldmatrix_x4(unsigned addr, unsigned (&r)[4])
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

static __device__ __forceinline__ void duet__mma_bf16(float (&c)[4], const unsigned (&a)[4],
                                                      unsigned b0, unsigned b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/*
 * One tile of BM rows (pairs of one expert) × one block of weight rows, K in steps of BK (32
 * or 64, dividing K; duet__mma_stages(BK) of them in flight).
 * DUAL (phase 1): weight rows are 64 of W1 and the same 64 of W3 (B0, B1); the epilogue
 * applies act and stores h (bf16) at h_out[p][n]. Otherwise (phase 2): 128 rows of B0 = W2,
 * stored fp32 at o_out[p][n]. A row of pair p is A[(p / a_div)][:] (x for phase 1, h for 2).
 * 8 warps as 2 (M) × 4 (N): a warp owns BM/2 rows × 32 weight rows (DUAL: 16 of W1 + the
 * matching 16 of W3, so gate and up of one output land in the same thread).
 */
template <int BM, bool DUAL, int BK>
__global__ void __launch_bounds__(DUET__MMA_THREADS)
    duet__moe_mma_kernel(const __nv_bfloat16 *A, int a_div, const __nv_bfloat16 *B0,
                         const __nv_bfloat16 *B1, int N, int K, duet__moe_plan_t pl, int act,
                         float beta, float beta_lin, __nv_bfloat16 *h_out, float *o_out)
{
    using loader_t = duet__mma_loader<BM, BK, DUET__MMA_THREADS, DUAL>;
    constexpr int S = duet__mma_stages(BK), MT = BM / 32;
    constexpr int A_BYTES = loader_t::A_BYTES, STAGE = loader_t::STAGE;
    extern __shared__ float4 mma_sh[];
    __shared__ int rows[BM];

    const int e = duet__mma_tile<BM, DUET__MMA_THREADS>(pl, rows);
    if (e < 0)
        return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp >> 2, wn = warp & 3;

    const int n0 = blockIdx.x * (DUAL ? 64 : 128);
    const unsigned sbase = (unsigned)__cvta_generic_to_shared(mma_sh);

    const loader_t ld(rows, A, a_div, B0, B1, e, n0, N, K);
    const int KT = K / BK;
    ld.template prologue<S>(sbase, KT);

    float acc[MT][4][4];
#pragma unroll
    for (int mi = 0; mi < MT; mi++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int v = 0; v < 4; v++)
                acc[mi][j][v] = 0.0f;

    /* B-tile row of this warp's n8 tile pair (0,1) and (2,3). */
    const int brow0 = DUAL ? 16 * wn : 32 * wn;
    const int brow1 = DUAL ? 64 + 16 * wn : 32 * wn + 16;

    for (int kt = 0; kt < KT; kt++) {
        duet__cp_async_wait<S - 2>();
        __syncthreads(); /* stage kt landed for all; stage kt-1 is free to refill */
        if (kt + S - 1 < KT)
            ld.load(sbase + ((kt + S - 1) % S) * STAGE, kt + S - 1);
        duet__cp_async_commit();
        const unsigned st = sbase + (kt % S) * STAGE;
#pragma unroll
        for (int ks = 0; ks < BK / 16; ks++) {
            unsigned af[MT][4], bf[4][2];
#pragma unroll
            for (int mi = 0; mi < MT; mi++) {
                const int r = wm * (BM / 2) + mi * 16 + (lane & 15);
                duet__ldmatrix_x4(st + duet__swz<BK>(r, ks * 2 + (lane >> 4)), af[mi]);
            }
#pragma unroll
            for (int jp = 0; jp < 2; jp++) {
                const int r = (jp == 0 ? brow0 : brow1) + ((lane >> 4) << 3) + (lane & 7);
                unsigned q[4];
                duet__ldmatrix_x4(st + A_BYTES + duet__swz<BK>(r, ks * 2 + ((lane >> 3) & 1)), q);
                bf[2 * jp][0] = q[0];
                bf[2 * jp][1] = q[1];
                bf[2 * jp + 1][0] = q[2];
                bf[2 * jp + 1][1] = q[3];
            }
#pragma unroll
            for (int mi = 0; mi < MT; mi++)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    duet__mma_bf16(acc[mi][j], af[mi], bf[j][0], bf[j][1]);
        }
    }
    duet__cp_async_wait<0>();

#pragma unroll
    for (int mi = 0; mi < MT; mi++)
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int m = wm * (BM / 2) + mi * 16 + (lane >> 2) + half * 8;
            const int p = rows[m];
            if (p < 0)
                continue;
            if (DUAL) {
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const int n = n0 + 16 * wn + 8 * j + 2 * (lane & 3);
                    if (n >= N)
                        continue;
                    const float h0 = duet_act_apply(acc[mi][j][2 * half], acc[mi][j + 2][2 * half],
                                                    act, beta, beta_lin);
                    const float h1 =
                        duet_act_apply(acc[mi][j][2 * half + 1], acc[mi][j + 2][2 * half + 1], act,
                                       beta, beta_lin);
                    *reinterpret_cast<__nv_bfloat162 *>(h_out + (size_t)p * N + n) =
                        __floats2bfloat162_rn(h0, h1);
                }
            } else {
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const int n = n0 + 32 * wn + 8 * j + 2 * (lane & 3);
                    if (n >= N)
                        continue;
                    *reinterpret_cast<float2 *>(o_out + (size_t)p * N + n) =
                        make_float2(acc[mi][j][2 * half], acc[mi][j][2 * half + 1]);
                }
            }
        }
}

/* ---- combine -------------------------------------------------------------------------------- */

/* y[t] += Σ_k wts[t][k] · out[t * top_k + k], k in order, then out[P + t] when the shared
 * expert is folded in; a pair with an invalid expert adds nothing (the plan skipped it too).
 * Block (t, part) covers float4s part·blockDim.x + i of row t, striding by gridDim.y·blockDim.x.
 * D is a multiple of 4. */
__global__ void duet__moe_combine_kernel(float *y, const float *out, const int32_t *idx,
                                         const float *wts, int top_k, int E, int D, int P,
                                         int shared)
{
    const int64_t t = blockIdx.x;
    float4 *yr = reinterpret_cast<float4 *>(y + t * D);
    duet_pdl_wait(); /* out */
    duet_pdl_trigger();
    for (int d4 = (int)(blockIdx.y * blockDim.x + threadIdx.x); d4 < D / 4;
         d4 += (int)(gridDim.y * blockDim.x)) {
        float4 a = yr[d4];
        /* out's row exists for every pair (garbage for an invalid one, never used), so the
         * loads of all pairs can be in flight together */
#pragma unroll 8
        for (int k = 0; k < top_k; k++) {
            const int64_t p = t * top_k + k;
            const int e = idx[p];
            const float w = wts[p];
            const float4 o = reinterpret_cast<const float4 *>(out + p * D)[d4];
            if (e >= 0 && e < E) {
                a.x = __fadd_rn(a.x, __fmul_rn(w, o.x));
                a.y = __fadd_rn(a.y, __fmul_rn(w, o.y));
                a.z = __fadd_rn(a.z, __fmul_rn(w, o.z));
                a.w = __fadd_rn(a.w, __fmul_rn(w, o.w));
            }
        }
        if (shared) {
            const float4 o = reinterpret_cast<const float4 *>(out + (P + t) * D)[d4];
            a.x = __fadd_rn(a.x, o.x);
            a.y = __fadd_rn(a.y, o.y);
            a.z = __fadd_rn(a.z, o.z);
            a.w = __fadd_rn(a.w, o.w);
        }
        yr[d4] = a;
    }
}

/* ---- host side ------------------------------------------------------------------------------ */

typedef struct {
    size_t off, list, meta, slots, tiles, cnt, hist, xb, h, out, total;
    int64_t max_slots, max_tiles, n_slices;
} duet__moe_layout_t;

static size_t duet__align256(size_t n)
{
    return (n + 255) & ~(size_t)255;
}

/* Scratch carve-up for T rows: sizes grow with T, so a layout for T <= max_T fits in
 * duet_cuda_moe_scratch_bytes(max_T, ...). Every count allows for a folded shared expert (T more
 * pairs, one more list); slots are sized for nr = 1 and tiles for bm = 64, the smallest cuts
 * used. */
static duet__moe_layout_t duet__moe_layout(int64_t T, int64_t top_k, int64_t E, int64_t I,
                                           int64_t D)
{
    duet__moe_layout_t L;
    const int64_t P = T * top_k, Ps = P + T, A = P < E ? P : E;
    L.max_slots = Ps + A + 1;
    L.max_tiles = (Ps + 63) / 64 + A + 1;
    L.n_slices = (D + DUET__GV_SLICE - 1) / DUET__GV_SLICE;
    size_t at = 0;
    L.off = at;
    at += duet__align256((size_t)(E + 2) * sizeof(int));
    L.list = at;
    at += duet__align256((size_t)Ps * sizeof(int));
    L.meta = at;
    at += duet__align256(4 * sizeof(int));
    L.slots = at;
    at += duet__align256((size_t)L.max_slots * sizeof(int2));
    L.tiles = at;
    at += duet__align256((size_t)L.max_tiles * sizeof(int2));
    L.cnt = at; /* tickets: T <= DUET__MOE_TICKET_T only, one per row and slice */
    at += duet__align256((size_t)(T <= DUET__MOE_TICKET_T ? T : 1) * L.n_slices * sizeof(int));
    L.hist = at; /* the plan's counts per block and expert */
    at += duet__align256((size_t)DUET__PLAN_MAX_BLOCKS * (E + 1) * sizeof(int));
    L.xb = at;
    at += duet__align256((size_t)T * D * sizeof(__nv_bfloat16));
    L.h = at; /* P pairs' rows, then T for a folded shared expert */
    at += duet__align256((size_t)Ps * I * sizeof(float));
    L.out = at;
    at += duet__align256((size_t)Ps * D * sizeof(float));
    L.total = at;
    return L;
}

extern "C" size_t duet_cuda_moe_scratch_bytes(int64_t max_T, int64_t top_k, int64_t E, int64_t I,
                                              int64_t D)
{
    if (max_T < 0 || top_k < 0 || E < 0 || I < 0 || D < 0)
        return 0;
    return duet__moe_layout(max_T, top_k, E, I, D).total + 256; /* + 256: base alignment */
}

/* Phase 1 then phase 2 with the kernels k13, k2 (gemv2 also adds into y when the plan has
 * tickets); *optin13 / *optin2 remember the shared-memory opt-in per device. */
template <int NRMAX, int SPB, typename K13, typename K2>
static duet_status_t
duet__launch_gemv_k(K13 k13, K2 k2, unsigned long long *optin13, unsigned long long *optin2,
                    cudaStream_t stream, const duet_cuda_experts_t *ex, const float *x,
                    const duet__moe_plan_t &pl, int64_t max_slots, duet_cuda_act_t act, float beta,
                    float beta_lin, float *h, float *out, const float *wts, float *y)
{
    const int I = (int)ex->I, D = (int)ex->D;
    const size_t sm13 = (size_t)NRMAX * D * sizeof(float), sm2 = (size_t)NRMAX * I * sizeof(float);
    cudaError_t e;
    if ((e = duet__smem_optin(k13, optin13, DUET__SMEM_CAP)) != cudaSuccess ||
        (e = duet__smem_optin(k2, optin2, DUET__SMEM_CAP)) != cudaSuccess)
        return duet_cuda_status(e, DUET__MODULE, "gemv shared-memory opt-in");
    const int rows13 = DUET__GV_WARPS * DUET__GV_RI * SPB; /* gate/up outputs per block */
    dim3 g13((unsigned)max_slots, (unsigned)((I + rows13 - 1) / rows13));
    DUET__TRY(duet_pdl_launch(k13, g13, dim3(DUET__GV_THREADS), sm13, stream, ex->w1, ex->w3, x, pl,
                              I, D, (int)act, beta, beta_lin, h),
              "gemv gate/up kernel launch");
    dim3 g2((unsigned)max_slots, (unsigned)((pl.n_slices + SPB - 1) / SPB));
    DUET__TRY(duet_pdl_launch(k2, g2, dim3(DUET__GV_THREADS), sm2, stream, ex->w2, (const float *)h,
                              pl, I, D, out, wts, y),
              "gemv down kernel launch");
    return DUET_OK;
}

template <int DT, int NRMAX, int U13 = DUET__GV_UNROLL, int U2 = DUET__GV_UNROLL>
static duet_status_t
duet__launch_gemv(cudaStream_t stream, const duet_cuda_experts_t *ex, const float *x,
                  const duet__moe_plan_t &pl, int64_t max_slots, duet_cuda_act_t act, float beta,
                  float beta_lin, float *h, float *out, const float *wts, float *y)
{
    static unsigned long long optin13 = 0, optin2 = 0;
    return duet__launch_gemv_k<NRMAX, 1>(
        duet__moe_gemv13_kernel<DT, NRMAX, U13>, duet__moe_gemv2_kernel<DT, NRMAX, U2>, &optin13,
        &optin2, stream, ex, x, pl, max_slots, act, beta, beta_lin, h, out, wts, y);
}

/* T = 1: the kernels with capped registers, or with `deep` the uncapped ones with more of each
 * row in flight (the same arithmetic). */
template <int DT>
static duet_status_t
duet__launch_gemv_t1(bool deep, cudaStream_t stream, const duet_cuda_experts_t *ex, const float *x,
                     const duet__moe_plan_t &pl, int64_t max_slots, duet_cuda_act_t act, float beta,
                     float beta_lin, float *h, float *out, const float *wts, float *y)
{
    if (deep)
        return duet__launch_gemv<DT, 1, DUET__GV_U13_DEEP, DUET__GV_U2_DEEP>(
            stream, ex, x, pl, max_slots, act, beta, beta_lin, h, out, wts, y);
    static unsigned long long optin13 = 0, optin2 = 0;
    return duet__launch_gemv_k<1, 1>(duet__moe_gemv13_t1_kernel<DT, DUET__GV_U13_T1>,
                                     duet__moe_gemv2_t1_kernel<DT, DUET__GV_U2_T1>, &optin13,
                                     &optin2, stream, ex, x, pl, max_slots, act, beta, beta_lin, h,
                                     out, wts, y);
}

/* DUET_CUDA_MOE_T1_DEEP=1 in the environment (read once) takes the uncapped T = 1 kernels:
 * side-by-side runs. */
static bool duet__t1_deep_env(void)
{
    static int deep = -1;
    return duet_cuda_env_flag(&deep, "DUET_CUDA_MOE_T1_DEEP") != 0;
}

/*
 * Slices of output rows per GEMV block. Each block first looks up its slot and loads the slot's
 * activation rows (up to 4 × D floats, a round trip through L2) before any weight row: with many
 * slots (T > 1, the grid tens of thousands of short blocks) one block doing DUET__GV_SPB slices
 * for one lookup and one load streams more of the time; with few slots (fewer than 256) the
 * grid needs the blocks (bench/RESULTS.md, "MoE GEMV at T > 1: four slices per block"). The slot
 * count is the host's bound, min(P, P / 4 + min(P, E)) for P = T · top_k pairs: 64, 128, 256
 * and 384 at batch 8, 16, 32 and 64.
 */
static int duet__gemv_spb(int64_t max_slots, bool direct)
{
    return !direct && max_slots >= DUET__GV_SPB_SLOTS ? DUET__GV_SPB : 1;
}

/* The multi-slice kernels (T > 1, 4 rows per slot). */
template <int DT>
static duet_status_t duet__launch_gemv_multi(cudaStream_t stream, const duet_cuda_experts_t *ex,
                                             const float *x, const duet__moe_plan_t &pl,
                                             int64_t max_slots, duet_cuda_act_t act, float beta,
                                             float beta_lin, float *h, float *out, const float *wts,
                                             float *y)
{
    static unsigned long long optin13 = 0, optin2 = 0;
    return duet__launch_gemv_k<4, DUET__GV_SPB>(
        duet__moe_gemv13_multi_kernel<DT, 4, DUET__GV_UNROLL, DUET__GV_SPB>,
        duet__moe_gemv2_multi_kernel<DT, 4, DUET__GV_UNROLL, DUET__GV_SPB>, &optin13, &optin2,
        stream, ex, x, pl, max_slots, act, beta, beta_lin, h, out, wts, y);
}

/* The GEMV kernels for nrmax rows per slot; spb > 1 (duet__gemv_spb) takes the multi-slice
 * kernels, which exist for the default nrmax (4) only. */
template <int DT>
static duet_status_t
duet__launch_gemv_nr(int nrmax, int spb, bool direct, bool deep, cudaStream_t stream,
                     const duet_cuda_experts_t *ex, const float *x, const duet__moe_plan_t &pl,
                     int64_t max_slots, duet_cuda_act_t act, float beta, float beta_lin, float *h,
                     float *out, const float *wts, float *y)
{
    if (direct) /* T = 1: one row per slot */
        return duet__launch_gemv_t1<DT>(deep, stream, ex, x, pl, max_slots, act, beta, beta_lin, h,
                                        out, wts, y);
    switch (nrmax) {
    case 1:
        return duet__launch_gemv<DT, 1>(stream, ex, x, pl, max_slots, act, beta, beta_lin, h, out,
                                        wts, y);
    case 2:
        return duet__launch_gemv<DT, 2>(stream, ex, x, pl, max_slots, act, beta, beta_lin, h, out,
                                        wts, y);
    case 4:
        if (spb > 1)
            return duet__launch_gemv_multi<DT>(stream, ex, x, pl, max_slots, act, beta, beta_lin, h,
                                               out, wts, y);
        return duet__launch_gemv<DT, 4>(stream, ex, x, pl, max_slots, act, beta, beta_lin, h, out,
                                        wts, y);
    default:
        return duet__launch_gemv<DT, 8>(stream, ex, x, pl, max_slots, act, beta, beta_lin, h, out,
                                        wts, y);
    }
}

/* The 64-row tiles take k-steps of 64 where K allows (3 stages of 24 KB: half the barriers and
 * copy groups per multiply-add of 32 with 4 stages of 12 KB); the k order, and so every bit of
 * the result, is the same. The 128-row tiles keep 32: with 64 their 138 registers leave one
 * block per SM, which was slower (bench/RESULTS.md, "MoE MMA: k-steps of 64 for the 64-row
 * tiles"). DUET_CUDA_MOE_MMA_BK32=1 in the environment (read once) keeps 32 everywhere:
 * side-by-side runs. */
static bool duet__mma_bk64(void)
{
    static int bk32 = -1;
    return duet_cuda_env_flag(&bk32, "DUET_CUDA_MOE_MMA_BK32") == 0;
}

/*
 * Whether the MMA path runs the wgmma kernels: where the device runs them (sm_90a) and K of
 * both phases is a multiple of 64, unless `kind` forces mma.sync or DUET_CUDA_NO_WGMMA=1 is in
 * the environment (read once: side-by-side runs).
 */
static bool duet__mma_wgmma(int kind, int64_t D, int64_t I)
{
    static int off = -1;
    if (kind == DUET__MOE_MMA_SYNC || D % 64 != 0 || I % 64 != 0)
        return false;
    if (kind != DUET__MOE_MMA_WGMMA && duet_cuda_env_flag(&off, "DUET_CUDA_NO_WGMMA") != 0)
        return false;
    return duet__moe_wgmma_usable() != 0;
}

/*
 * Whether the wgmma path's 128-row tiles run the warp-specialised kernel (moe_wgmma.cu), unless
 * `path` has DUET__MOE_MMA_NO_WS or DUET_CUDA_MOE_NO_WS=1 is in the environment (read once:
 * side-by-side runs).
 */
static bool duet__mma_ws(int path)
{
    static int off = -1;
    return (path & DUET__MOE_MMA_NO_WS) == 0 &&
           duet_cuda_env_flag(&off, "DUET_CUDA_MOE_NO_WS") == 0;
}

/* One MMA phase: the kernel of tile height BM, phase DUAL and k-step BK on grid g. */
template <int BM, bool DUAL, int BK>
static duet_status_t
duet__launch_mma_bk(cudaStream_t stream, dim3 g, const __nv_bfloat16 *A, int a_div,
                    const __nv_bfloat16 *B0, const __nv_bfloat16 *B1, int N, int K,
                    const duet__moe_plan_t &pl, duet_cuda_act_t act, float beta, float beta_lin,
                    __nv_bfloat16 *h_out, float *o_out)
{
    static unsigned long long optin = 0;
    auto kernel = duet__moe_mma_kernel<BM, DUAL, BK>;
    const size_t smem = (size_t)duet__mma_stages(BK) * (BM + DUET__MMA_BROWS) * BK * 2;
    cudaError_t e = duet__smem_optin(kernel, &optin, DUET__SMEM_CAP);
    if (e != cudaSuccess)
        return duet_cuda_status(e, DUET__MODULE, "mma shared-memory opt-in");
    DUET__TRY(duet_pdl_launch(kernel, g, dim3(DUET__MMA_THREADS), smem, stream, A, a_div, B0, B1, N,
                              K, pl, (int)act, beta, beta_lin, h_out, o_out),
              DUAL ? "mma gate/up kernel launch" : "mma down kernel launch");
    return DUET_OK;
}

/* One MMA phase with its k-step: 64 for the 64-row tiles where K allows, else 32. */
template <int BM, bool DUAL>
static duet_status_t duet__launch_mma_k(cudaStream_t stream, dim3 g, const __nv_bfloat16 *A,
                                        int a_div, const __nv_bfloat16 *B0, const __nv_bfloat16 *B1,
                                        int N, int K, const duet__moe_plan_t &pl,
                                        duet_cuda_act_t act, float beta, float beta_lin,
                                        __nv_bfloat16 *h_out, float *o_out)
{
    if constexpr (BM == 64)
        if (K % 64 == 0 && duet__mma_bk64())
            return duet__launch_mma_bk<BM, DUAL, 64>(stream, g, A, a_div, B0, B1, N, K, pl, act,
                                                     beta, beta_lin, h_out, o_out);
    return duet__launch_mma_bk<BM, DUAL, DUET__MMA_BK>(stream, g, A, a_div, B0, B1, N, K, pl, act,
                                                       beta, beta_lin, h_out, o_out);
}

/* Both MMA phases for tiles of BM rows: with `wg` the wgmma kernels (moe_wgmma.cu; with `ws`
 * the warp-specialised one for BM = 128), else mma.sync's. */
template <int BM>
static duet_status_t
duet__launch_mma(cudaStream_t stream, const duet_cuda_experts_t *ex, const __nv_bfloat16 *xb,
                 const duet__moe_plan_t &pl, int64_t max_tiles, int top_k, duet_cuda_act_t act,
                 float beta, float beta_lin, __nv_bfloat16 *hb, float *out, bool wg, bool ws)
{
    const int I = (int)ex->I, D = (int)ex->D;
    const __nv_bfloat16 *w1 = (const __nv_bfloat16 *)ex->w1, *w3 = (const __nv_bfloat16 *)ex->w3;
    const __nv_bfloat16 *w2 = (const __nv_bfloat16 *)ex->w2;
    const dim3 g1((unsigned)((I + 63) / 64), (unsigned)max_tiles);
    const dim3 g2((unsigned)((D + 127) / 128), (unsigned)max_tiles);
    if (wg) {
        const duet_status_t st =
            duet__moe_wgmma_phase(stream, max_tiles, BM / 64, ws && BM == 128, true, xb, top_k, w1,
                                  w3, I, D, pl, act, beta, beta_lin, hb, NULL);
        if (st != DUET_OK)
            return st;
        return duet__moe_wgmma_phase(stream, max_tiles, BM / 64, ws && BM == 128, false, hb, 1, w2,
                                     w2, D, I, pl, act, beta, beta_lin, NULL, out);
    }
    const duet_status_t st = duet__launch_mma_k<BM, true>(stream, g1, xb, top_k, w1, w3, I, D, pl,
                                                          act, beta, beta_lin, hb, NULL);
    if (st != DUET_OK)
        return st;
    return duet__launch_mma_k<BM, false>(stream, g2, hb, 1, w2, w2, D, I, pl, act, beta, beta_lin,
                                         NULL, out);
}

/* The automatic path: MMA once the rows per selected expert average DUET__MOE_MMA_ROWS under
 * uniform routing (bench/RESULTS.md, "MoE: when the MMA path takes over"; at Kimi Linear's
 * shape from 16 rows on). DUET_CUDA_MOE_MMA_ROWS=R in the environment (read once) moves it. */
#define DUET__MOE_MMA_ROWS 1.25
static double duet__moe_mma_rows(void)
{
    static double rows = -1.0;
    if (rows < 0.0) {
        const char *v = getenv("DUET_CUDA_MOE_MMA_ROWS");
        const double r = v != NULL ? strtod(v, NULL) : 0.0;
        rows = r > 0.0 ? r : DUET__MOE_MMA_ROWS;
    }
    return rows;
}

extern "C" double duet_cuda_moe_touched(double rows, int64_t top_k, int64_t E)
{
    if (E < 1 || top_k < 1)
        return 0.0;
    return (double)E * (1.0 - pow(1.0 - (double)top_k / (double)E, rows));
}

extern "C" int duet_cuda_moe_auto_mma(int64_t T, int64_t top_k, int64_t E)
{
    if (T <= 1 || E < 1 || top_k < 1 || top_k > E)
        return 0; /* one row: the GEMV kernels */
    return (double)(T * top_k) >= duet__moe_mma_rows() * duet_cuda_moe_touched((double)T, top_k, E);
}

/* Whether the MMA kernels take these weights at all: BF16, D and I multiples of 32. */
static bool duet__mma_ok(const duet_cuda_experts_t *ex)
{
    return ex->dtype == DUET_DTYPE_BF16 && ex->D % 32 == 0 && ex->I % 32 == 0;
}

extern "C" int duet_cuda_moe_gemv_path(const duet_cuda_experts_t *ex, int64_t T, int64_t top_k)
{
    return ex != NULL && !(duet__mma_ok(ex) && duet_cuda_moe_auto_mma(T, top_k, ex->E));
}

/*
 * duet_cuda_moe_experts with the path chosen by the caller (DUET__MOE_PATH_*): the tests run
 * both paths on the same inputs. Internal; not in the header.
 */
extern "C" duet_status_t
duet__cuda_moe_experts_path(cudaStream_t stream, const duet_cuda_experts_t *ex, const float *x,
                            int64_t T, const int32_t *idx, const float *wts, int64_t top_k,
                            duet_cuda_act_t act, float beta, float beta_lin, float *y,
                            void *scratch, int path)
{
    if (ex == NULL || T < 0 || top_k <= 0 || ex->E <= 0 || ex->I <= 0 || ex->D <= 0 ||
        top_k > ex->E || T * (top_k + 1) > 0x7fffffff || ex->E > 0x7fffffff || ex->I > 0x7fffffff ||
        ex->D > 0x7fffffff)
        return duet_error_set(DUET_ERR_INVALID,
                              "cuda moe_experts: bad arguments T=%lld top_k=%lld E=%lld I=%lld "
                              "D=%lld",
                              (long long)T, (long long)top_k, ex ? (long long)ex->E : 0LL,
                              ex ? (long long)ex->I : 0LL, ex ? (long long)ex->D : 0LL);
    if (ex->dtype != DUET_DTYPE_F32 && ex->dtype != DUET_DTYPE_BF16 && ex->dtype != DUET_DTYPE_F16)
        return duet_error_set(DUET_ERR_INVALID, "cuda moe_experts: unknown dtype %d",
                              (int)ex->dtype);
    if (act != DUET_CUDA_ACT_SILU && act != DUET_CUDA_ACT_SITU)
        return duet_error_set(DUET_ERR_INVALID, "cuda moe_experts: unknown activation %d",
                              (int)act);
    if (act == DUET_CUDA_ACT_SITU && (beta == 0.0f || beta_lin == 0.0f))
        return duet_error_set(DUET_ERR_INVALID, "cuda moe_experts: SiTU needs non-zero betas");
    if (T == 0)
        return DUET_OK;
    if (x == NULL || idx == NULL || wts == NULL || y == NULL || scratch == NULL || ex->w1 == NULL ||
        ex->w2 == NULL || ex->w3 == NULL)
        return duet_error_set(DUET_ERR_INVALID, "cuda moe_experts: NULL operand");
    /* 16-byte weight and activation rows for the vector loads. */
    if (ex->D % 8 != 0 || ex->I % 8 != 0 || !duet__aligned16(ex->w1) || !duet__aligned16(ex->w2) ||
        !duet__aligned16(ex->w3) || !duet__aligned16(x) || !duet__aligned16(y))
        return duet_error_set(DUET_ERR_UNSUPPORTED,
                              "cuda moe_experts: D (%lld) and I (%lld) must be multiples of 8 "
                              "and x, y and the weights 16-byte aligned",
                              (long long)ex->D, (long long)ex->I);
    if ((size_t)2 * (ex->E + 1) * sizeof(int) > 48 * 1024) /* the plan's counts */
        return duet_error_set(DUET_ERR_UNSUPPORTED, "cuda moe_experts: %lld experts is too many",
                              (long long)ex->E);
    const int shared = ex->sw1 != NULL || ex->sw3 != NULL || ex->sw2 != NULL;
    if (shared &&
        (ex->sw1 == NULL || ex->sw3 == NULL || ex->sw2 == NULL || !duet__aligned16(ex->sw1) ||
         !duet__aligned16(ex->sw3) || !duet__aligned16(ex->sw2)))
        return duet_error_set(DUET_ERR_INVALID,
                              "cuda moe_experts: the shared expert needs all three matrices, "
                              "16-byte aligned");

    if ((ex->norm_x == NULL) != (ex->norm_w == NULL) ||
        (ex->norm_x != NULL && (!duet__aligned16(ex->norm_x) || !duet__aligned16(ex->norm_w) ||
                                ex->D % 4 != 0 || !(ex->norm_eps >= 0.0f))))
        return duet_error_set(DUET_ERR_INVALID,
                              "cuda moe_experts: norm_x and norm_w go together, 16-byte aligned, "
                              "with D a multiple of 4 (D=%lld) and eps >= 0",
                              (long long)ex->D);

    const int64_t E = ex->E, I = ex->I, D = ex->D, P = T * top_k, A = P < E ? P : E;
    const int mma_ok = duet__mma_ok(ex);
    const int force_nr = (path >> 4) & 0xf, force_bm = (path >> 8) & 0xf;
    const int force_spb = (path >> DUET__MOE_SPB_SHIFT) & 0xf;
    const int separate = (path & DUET__MOE_SEPARATE_COMBINE) != 0;
    const bool deep = (path & DUET__MOE_T1_DEEP) != 0 || duet__t1_deep_env();
    const int mma_kind = path & (DUET__MOE_MMA_SYNC | DUET__MOE_MMA_WGMMA);
    const bool ws = duet__mma_ws(path);
    path &= 0xf;
    if (path == DUET__MOE_PATH_MMA && !mma_ok)
        return duet_error_set(DUET_ERR_UNSUPPORTED,
                              "cuda moe_experts: the MMA path needs BF16 weights and D, I "
                              "multiples of 32");
    if (path == DUET__MOE_PATH_AUTO)
        path = duet_cuda_moe_gemv_path(ex, T, top_k) ? DUET__MOE_PATH_GEMV : DUET__MOE_PATH_MMA;
    if (shared && path != DUET__MOE_PATH_GEMV)
        return duet_error_set(DUET_ERR_INVALID,
                              "cuda moe_experts: a shared expert is folded in only on the GEMV "
                              "path (T = %lld takes the MMA kernels: duet_cuda_moe_gemv_path); "
                              "run it separately",
                              (long long)T);

    /*
     * GEMV slot size: 4 rows, fewer only if the rows would not fit in shared memory (more rows
     * per slot cost registers, and an expert's next slot runs alongside and finds its weights in
     * L2). T = 1 (direct, below) takes the 1-row kernels with their registers capped
     * (DUET__GV_T1_BLOCKS). Measured: bench/RESULTS.md, "MoE GEMV slot size".
     */
    int nrmax = 4;
    while (nrmax > 1 && (size_t)nrmax * (D > I ? D : I) * sizeof(float) > DUET__SMEM_CAP)
        nrmax /= 2;
    if (force_nr == 1 || force_nr == 2 || force_nr == 4 || force_nr == 8)
        nrmax = force_nr;
    if ((size_t)nrmax * (D > I ? D : I) * sizeof(float) > DUET__SMEM_CAP)
        return duet_error_set(DUET_ERR_UNSUPPORTED, "cuda moe_experts: D=%lld or I=%lld too large",
                              (long long)D, (long long)I);
    const int bm = force_bm == 1 ? 64 : force_bm == 2 ? 128 : P >= 96 * A ? 128 : 64;

    char *base = (char *)(((uintptr_t)scratch + 255) & ~(uintptr_t)255);
    const duet__moe_layout_t L = duet__moe_layout(T, top_k, E, I, D);
    duet__moe_plan_t pl;
    pl.off = (int *)(base + L.off);
    pl.list = (int *)(base + L.list);
    pl.meta = (int *)(base + L.meta);
    pl.slots = (int2 *)(base + L.slots);
    pl.tiles = (int2 *)(base + L.tiles);
    pl.idx = idx;
    pl.E = (int)E;
    pl.top_k = (int)top_k;
    pl.n_slices = (int)L.n_slices;
    pl.n_cnt = 0;
    pl.cnt = NULL;
    pl.P = (int)P;
    pl.shared = shared;
    pl.sw1 = ex->sw1;
    pl.sw3 = ex->sw3;
    pl.sw2 = ex->sw2;
    pl.early = duet_cuda_weights_early();
    pl.nx = NULL;
    pl.nw = NULL;
    pl.eps = ex->norm_eps;
    float *h = (float *)(base + L.h), *out = (float *)(base + L.out);

    /*
     * One token on the GEMV path needs no grouping: each pair is its own slot (direct mode). Up
     * to DUET__MOE_TICKET_T tokens gemv2 adds into y through its tickets, faster than the combine
     * kernel; blocks owning a slice of outputs for all top_k pairs, one-wave kernels streaming
     * weight chunks through shared memory, and one kernel for the router, the routing and both
     * phases were no better. Past that the combine kernel: there tickets cost a fence and an
     * atomic round trip in each of thousands of gemv2 blocks (bench/RESULTS.md, "MoE at T = 1:
     * gemv2's tickets").
     */
    const int direct = path == DUET__MOE_PATH_GEMV && T == 1;
    /* pairs the plan groups: the routed ones, then the shared expert's T rows (expert E) */
    const int64_t Ps = P + (shared && !direct ? T : 0);
    if (direct) {
        pl.list = NULL;
        if (shared) {
            pl.nx = ex->norm_x;
            pl.nw = ex->norm_w;
        }
    } else {
        /* a block per DUET__PLAN_PAIRS pairs: one block for every pair of a long prefill runs
         * on one SM (bench/RESULTS.md, "MoE plan: one block per 2048 pairs") */
        int nb = (int)((Ps + DUET__PLAN_PAIRS - 1) / DUET__PLAN_PAIRS);
        nb = nb < 1 ? 1 : nb > DUET__PLAN_MAX_BLOCKS ? DUET__PLAN_MAX_BLOCKS : nb;
        const int per = (int)((Ps + nb - 1) / nb);
        int *hist = (int *)(base + L.hist);
        if (nb > 1)
            DUET__TRY(duet_pdl_launch(duet__moe_count_kernel, dim3((unsigned)nb),
                                      dim3(DUET__PLAN_THREADS), (E + 1) * sizeof(int), stream, idx,
                                      (int)P, (int)Ps, (int)E, per, hist),
                      "count kernel launch");
        const int threads =
            nb == 1 && Ps <= DUET__PLAN_SMALL ? DUET__PLAN_SMALL : DUET__PLAN_THREADS;
        DUET__TRY(duet_pdl_launch(duet__moe_plan_kernel, dim3((unsigned)nb), dim3(threads),
                                  2 * (E + 1) * sizeof(int), stream, idx, (int)P, (int)Ps, (int)E,
                                  nrmax, bm, per, (const int *)hist, pl),
                  "plan kernel launch");
    }

    duet_status_t st;
    if (path == DUET__MOE_PATH_MMA) {
        const bool wg = duet__mma_wgmma(mma_kind, D, I);
        if (mma_kind == DUET__MOE_MMA_WGMMA && !wg)
            return duet_error_set(DUET_ERR_UNSUPPORTED,
                                  "cuda moe_experts: the wgmma kernels need an sm_90a device "
                                  "(H100 / H200) and D, I multiples of 64 (D=%lld, I=%lld)",
                                  (long long)D, (long long)I);
        const __nv_bfloat16 *xb = (const __nv_bfloat16 *)ex->xb;
        if (xb == NULL) { /* round x here */
            __nv_bfloat16 *xr = (__nv_bfloat16 *)(base + L.xb);
            const duet_status_t st =
                duet_cuda_convert_from_f32(xr, DUET_DTYPE_BF16, x, D, T, D, stream);
            if (st != DUET_OK)
                return st;
            xb = xr;
        }
        int64_t max_tiles = (P + bm - 1) / bm + A; /* each expert's last tile may be partial */
        max_tiles = max_tiles < P ? max_tiles : P;
        if (max_tiles > 65535)
            return duet_error_set(DUET_ERR_UNSUPPORTED,
                                  "cuda moe_experts: T * top_k = %lld is too many rows",
                                  (long long)P);
        if (bm == 128)
            st = duet__launch_mma<128>(stream, ex, xb, pl, max_tiles, (int)top_k, act, beta,
                                       beta_lin, (__nv_bfloat16 *)h, out, wg, ws);
        else
            st = duet__launch_mma<64>(stream, ex, xb, pl, max_tiles, (int)top_k, act, beta,
                                      beta_lin, (__nv_bfloat16 *)h, out, wg, ws);
    } else {
        /* each expert's last slot may be partial (the shared expert's too) */
        int64_t max_slots = (Ps + nrmax - 1) / nrmax + A + shared;
        max_slots = max_slots < Ps ? max_slots : Ps;
        if (direct)
            max_slots = P + shared;
        const int spb = force_spb > 0 && !direct ? (force_spb > 1 ? DUET__GV_SPB : 1)
                                                 : duet__gemv_spb(max_slots, direct);
        /* tickets only on the one-slice kernels: the multi-slice ones have none */
        if (!separate && T <= DUET__MOE_TICKET_T && spb == 1) {
            pl.cnt = (int *)(base + L.cnt);
            pl.n_cnt = (int)(T * L.n_slices);
        }
        switch (ex->dtype) {
        case DUET_DTYPE_BF16:
            st = duet__launch_gemv_nr<DUET_DTYPE_BF16>(nrmax, spb, direct, deep, stream, ex, x, pl,
                                                       max_slots, act, beta, beta_lin, h, out, wts,
                                                       y);
            break;
        case DUET_DTYPE_F16:
            st = duet__launch_gemv_nr<DUET_DTYPE_F16>(nrmax, spb, direct, deep, stream, ex, x, pl,
                                                      max_slots, act, beta, beta_lin, h, out, wts,
                                                      y);
            break;
        default:
            st = duet__launch_gemv_nr<DUET_DTYPE_F32>(nrmax, spb, direct, deep, stream, ex, x, pl,
                                                      max_slots, act, beta, beta_lin, h, out, wts,
                                                      y);
            break;
        }
    }
    if (st != DUET_OK)
        return st;
    if (pl.cnt != NULL)
        return DUET_OK; /* gemv2 added into y */
    /* A block per row fills the GPU at prefill sizes. A few rows (verify steps, small batches)
     * split each row over blocks of DUET__COMBINE_PART threads, so that their loads spread over
     * many SMs instead of queueing in a few (bench/RESULTS.md, "MoE combine: a few rows over
     * many blocks"). */
    const bool split = T < DUET__COMBINE_SPLIT_T;
    const int threads = split ? DUET__COMBINE_PART : 256;
    const int parts = split ? (int)(D / 4 + threads - 1) / threads : 1;
    DUET__TRY(duet_pdl_launch(duet__moe_combine_kernel, dim3((unsigned)T, (unsigned)parts),
                              dim3(threads), 0, stream, y, (const float *)out, idx, wts, (int)top_k,
                              (int)E, (int)D, (int)P, shared),
              "combine kernel launch");
    return DUET_OK;
}

/* For tests: whether the MMA path with nothing forced runs the wgmma kernels at D and I. */
extern "C" int duet__cuda_moe_wgmma_default(int64_t D, int64_t I)
{
    return duet__mma_wgmma(0, D, I) ? 1 : 0;
}

extern "C" duet_status_t duet_cuda_moe_experts(cudaStream_t stream, const duet_cuda_experts_t *ex,
                                               const float *x, int64_t T, const int32_t *idx,
                                               const float *wts, int64_t top_k, duet_cuda_act_t act,
                                               float beta, float beta_lin, float *y, void *scratch)
{
    return duet__cuda_moe_experts_path(stream, ex, x, T, idx, wts, top_k, act, beta, beta_lin, y,
                                       scratch, DUET__MOE_PATH_AUTO);
}
