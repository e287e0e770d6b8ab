/*
 * moe_wgmma.cu: the MoE expert MMA phases with Hopper's warpgroup MMA (sm_90a only; moe.cu
 * chooses between them and its mma.sync kernel).
 *
 * The tiles are moe.cu's duet__moe_mma_kernel's: 64 · WG rows (pairs of one expert, from the
 * plan) × 128 weight rows (64 of W1 + the same 64 of W3 in phase 1, 128 of W2 in phase 2),
 * K in steps of 64 through a cp.async pipeline of DUET__WG_STAGES stages. Each warpgroup (4
 * warps) multiplies its 64 rows by the stage's 128 weight rows with wgmma.mma_async m64n128k16:
 * both operands go from shared memory to the tensor cores, with no ldmatrix and no per-warp
 * fragments, which is what held mma.sync back (bench/RESULTS.md, "MoE prefill experts on
 * wgmma"). The stage layout is duet__swz<64>'s: 128-byte rows whose 16-byte chunks are XOR-ed
 * with the row's low 3 bits, which is the hardware's 128-byte swizzle when a tile starts on 1024
 * bytes; the k-slice ks of a tile is addressed by moving the descriptor's start 32 · ks bytes
 * into the row.
 *
 * The 128-row tiles run by default on duet__moe_ws_kernel instead: persistent, warp-specialised
 * (a copying warpgroup, two multiplying ones, mbarriers between them), 256 weight rows per
 * tile; the same stage layout and the same bits (bench/RESULTS.md, "MoE prefill experts:
 * warp-specialised tiles").
 *
 * The build compiles this file for sm_90a alone (kernels/CMakeLists.txt). On any other device
 * the code does not load, cudaFuncGetAttributes says so, and duet__moe_wgmma_usable() returns 0.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_pdl.cuh"
#include "kernels/cuda/cuda_wgmma.cuh"
#include "kernels/cuda/moe_mma.cuh"

#define DUET__MODULE     "cuda moe" /* the prefix of this file's error details */
#define DUET__WG_STAGES  3          /* 3 × 32 KB at 128-row tiles: two blocks per SM */
#define DUET__WS_STAGES  4          /* warp-specialised tiles: 4 × 48 KB, one block per SM */
#define DUET__WS_THREADS 384        /* ... a copying warpgroup and two multiplying ones */
#define DUET__WS_PITCH   40         /* ... words per staging row (32 + 8: fewer conflicts) */
/* ... their shared memory: the stages (from 1024 bytes on), 16 staging rows per multiplying warp */
#define DUET__WS_SMEM         (DUET__WS_STAGES * (128 + 256) * 64 * 2 + 1024 + 8 * 16 * DUET__WS_PITCH * 4)
#define DUET__TRY(call, what) DUET_CUDA_TRY(call, DUET__MODULE, what)

/* d (64 × 128 fp32, this thread's 64) += A (64 × 16) · B (16 × 128), both from shared memory. */
static __device__ __forceinline__ void duet__wgmma_m64n128k16(float (&d)[64], unsigned long long da,
                                                              unsigned long long db)
{
    DUET__WG_ASM("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " DUET__WG_D64
                 "%64, %65, 1, 1, 1, 0, 0;\n"
                 : DUET__WG_OUT64
                 : "l"(da), "l"(db));
}

/* d (64 × 256 fp32, this thread's 128) += A (64 × 16) · B (16 × 256), both from shared memory. */
static __device__ __forceinline__ void
duet__wgmma_m64n256k16(float (&d)[128], unsigned long long da, unsigned long long db)
{
    DUET__WG_ASM("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " DUET__WG_D128
                 "%128, %129, 1, 1, 1, 0, 0;\n"
                 : DUET__WG_OUT128
                 : "l"(da), "l"(db));
}

/*
 * One k-step of 64 as one committed group: this warpgroup's 64 rows of A (at shared address a,
 * swizzled 128-byte rows) times the stage's weight rows at b, 128 or 256 of them by the size of
 * d (64 or 128 accumulators per thread), four k-slices of 16.
 */
template <int NACC>
static __device__ __forceinline__ void duet__wg_kstep(float (&d)[NACC], unsigned a, unsigned b)
{
    static_assert(NACC == 64 || NACC == 128, "m64n128 or m64n256");
    /* a k-slice 32 bytes on is 2 more in the descriptors' start field (16-byte units): shared
     * addresses stay below 2^18, so the field never carries */
    const unsigned long long da = duet__wg_desc(a), db = duet__wg_desc(b);
    duet__wg_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ks++) {
        if constexpr (NACC == 64)
            duet__wgmma_m64n128k16(d, da + 2 * ks, db + 2 * ks);
        else
            duet__wgmma_m64n256k16(d, da + 2 * ks, db + 2 * ks);
    }
    duet__wg_commit();
}

/*
 * One tile of 64 · WG rows (pairs of one expert) × 128 weight rows, as duet__moe_mma_kernel:
 * with DUAL, 64 rows of W1 and the same 64 of W3, the activation applied in registers and h
 * stored in bf16; else 128 rows of W2 into out in fp32. K is a multiple of 64. WG warpgroups;
 * warpgroup g owns rows [64g, 64g + 64) of the tile and all 128 weight rows. A thread's
 * accumulator d[4j + v] is tile row 64g + 16 · warp + lane / 4 + 8 · (v / 2) and weight row
 * 8j + 2 · (lane % 4) + v % 2 of the stage (DUAL: gate j < 8, its up at j + 8).
 *
 * Each k-step waits for its products before the next barrier (no group left in flight), so
 * that with 3 stages two 128-row-tile blocks fit on an SM and cover each other's waits: deeper
 * pipelines with a group in flight, and tiles of 256 weight rows, measured slower
 * (bench/RESULTS.md, "MoE prefill experts on wgmma").
 */
template <int WG, bool DUAL, int ACT>
__global__ void __launch_bounds__(128 * WG, 2)
    duet__moe_wgmma_kernel(const __nv_bfloat16 *A, int a_div, const __nv_bfloat16 *B0,
                           const __nv_bfloat16 *B1, int N, int K, duet__moe_plan_t pl, float beta,
                           float beta_lin, __nv_bfloat16 *h_out, float *o_out)
{
    constexpr int BM = 64 * WG, NT = 128 * WG, S = DUET__WG_STAGES, BK = 64;
    using loader_t = duet__mma_loader<BM, BK, NT, DUAL>;
    constexpr int A_BYTES = loader_t::A_BYTES, STAGE = loader_t::STAGE;
    extern __shared__ float4 mma_sh[];
    __shared__ int rows[BM];

    const int e = duet__mma_tile<BM, NT>(pl, rows);
    if (e < 0)
        return;
    const int tid = threadIdx.x, lane = tid & 31, warp = (tid >> 5) & 3, wg = tid >> 7;

    const int n0 = blockIdx.x * (DUAL ? 64 : 128);
    /* stages start on 1024 bytes (the swizzle's period); the launch adds 1 KB for this */
    const unsigned sbase = ((unsigned)__cvta_generic_to_shared(mma_sh) + 1023u) & ~1023u;

    const loader_t ld(rows, A, a_div, B0, B1, e, n0, N, K);
    const int KT = K / BK;
    ld.template prologue<S>(sbase, KT);

    float d[64];
#pragma unroll
    for (int i = 0; i < 64; i++)
        d[i] = 0.0f;
    duet__wg_fence_operands(d);

    for (int kt = 0; kt < KT; kt++) {
        duet__cp_async_wait<S - 2>();
        duet__fence_proxy_async();
        __syncthreads(); /* k-step kt landed for all; every warpgroup is done with kt - 1's stage */
        if (kt + S - 1 < KT)
            ld.load(sbase + ((kt + S - 1) % S) * STAGE, kt + S - 1);
        duet__cp_async_commit();
        const unsigned st = sbase + (kt % S) * STAGE;
        duet__wg_kstep(d, st + wg * 64 * 128, st + A_BYTES);
        duet__wg_wait<0>();
    }
    duet__wg_fence_operands(d);
    duet__cp_async_wait<0>();

#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int m = wg * 64 + warp * 16 + (lane >> 2) + half * 8;
        const int p = rows[m];
        if (p < 0)
            continue;
#pragma unroll
        for (int j = 0; j < (DUAL ? 8 : 16); j++) {
            const int n = n0 + 8 * j + 2 * (lane & 3);
            if (n >= N)
                continue;
            const float *g = &d[4 * j + 2 * half];
            if (DUAL) {
                const float *u = g + 32; /* the up row's group, j + 8 */
                *reinterpret_cast<__nv_bfloat162 *>(h_out + (size_t)p * N + n) =
                    __floats2bfloat162_rn(duet_act_apply(g[0], u[0], ACT, beta, beta_lin),
                                          duet_act_apply(g[1], u[1], ACT, beta, beta_lin));
            } else {
                *reinterpret_cast<float2 *>(o_out + (size_t)p * N + n) = make_float2(g[0], g[1]);
            }
        }
    }
}

/*
 * The 128-row tiles with warp-specialised roles, persistent: a block per SM takes work items in
 * order from a counter (pl.meta[2] for gate/up, [3] for down; the plan zeroes both), so items
 * close in order run close in time: item w is column tile w % nx of MMA tile w / nx, and the
 * items of one expert share its weights in L2 (a fixed share per block drifted apart and read
 * them from DRAM again: bench/RESULTS.md, "MoE prefill experts: warp-specialised tiles"). An
 * item is 128 rows (pairs of one expert) × 256 weight rows (DUAL: 128 of W1 from n0 and the
 * same 128 of W3; else 256 of W2), K in steps of 64 through DUET__WS_STAGES stages of 48 KB.
 *
 * Warpgroup 0 only copies: each of its threads fills its share of a stage once the
 * multiplying warps have released it (empty[s]), and its copies arrive on full[s] when they
 * land (cp.async's mbarrier arrival), so the copier runs up to S k-steps ahead, into the next
 * item while the multiplying warps store this one. Its thread 0 also arrives once, after
 * writing item[s] (the item whose k-step fills stage s, or -1: no more items, with the tile's
 * list start, rows and n0, so the multiplying warps wait on no load of the plan). Warpgroups 1
 * and 2 only multiply, 64 rows each by all 256 weight rows (m64n256k16), with one k-step's
 * products in flight: a stage goes back to the copier as soon as the products that read it are
 * done, and no block-wide barrier stops the tensor cores. A warpgroup whose 64 rows are all
 * past its expert's list (an expert's last tile, often) skips its products but keeps the
 * barriers' count. Both roles count k-steps across items (q): stage q % S, phase q / S. The
 * rows of a thread's accumulators are duet__moe_wgmma_kernel's; its weight row of d[4j + v] is
 * 8j + 2 · (lane % 4) + v % 2 (DUAL: gate j < 16, its up at j + 16).
 */
template <bool DUAL, int ACT>
__global__ void __launch_bounds__(DUET__WS_THREADS, 1)
    duet__moe_ws_kernel(const __nv_bfloat16 *A, int a_div, const __nv_bfloat16 *B0,
                        const __nv_bfloat16 *B1, int N, int K, int nx, duet__moe_plan_t pl,
                        float beta, float beta_lin, __nv_bfloat16 *h_out, float *o_out)
{
    constexpr int BM = 128, BN = 256, BK = 64, S = DUET__WS_STAGES;
    constexpr int A_BYTES = BM * BK * 2, STAGE = A_BYTES + BN * BK * 2;
    static_assert(DUET__WS_SMEM == 1024 + S * STAGE + 8 * 16 * DUET__WS_PITCH * 4,
                  "the launch's shared memory is this layout: 1 KB of alignment, the stages, "
                  "the staging rows");
    extern __shared__ float4 mma_sh[];
    __shared__ unsigned long long full[S], empty[S];
    __shared__ int4 item[S]; /* (w, list start, rows, n0) of the item whose k-step fills stage s */
    __shared__ int next[2];

    if (threadIdx.x == 0)
        for (int s = 0; s < S; s++) {
            duet__mbar_init(&full[s], 128 + 1); /* every copier thread's copies, and item[s] */
            duet__mbar_init(&empty[s], 8);      /* every multiplying warp */
        }
    __syncthreads();
    duet_pdl_wait(); /* the plan and A (x in bf16, or h) */
    duet_pdl_trigger();
    const int n_items = pl.meta[1] * nx, KT = K / BK;
    const int tid = threadIdx.x, wg = tid >> 7, t = tid & 127;
    const unsigned sbase = ((unsigned)__cvta_generic_to_shared(mma_sh) + 1023u) & ~1023u;
    char *gbase = (char *)mma_sh + (sbase - (unsigned)__cvta_generic_to_shared(mma_sh));
    int q = 0; /* k-steps of this block so far */

    if (wg == 0) {
        for (int it = 0;; it++) {
            if (t == 0)
                next[it & 1] = atomicAdd(pl.meta + (DUAL ? 2 : 3), 1);
            duet__bar_sync(1, 128); /* the copiers alone; next[] alternates, so one suffices */
            const int w = next[it & 1] < n_items ? next[it & 1] : -1;
            const int2 tl = pl.tiles[w < 0 ? 0 : w / nx];
            const int n_r = w < 0 ? 0 : duet__tile_rows<BM>(pl, tl);
            const int n0 = (w < 0 ? 0 : w % nx) * (DUAL ? BN / 2 : BN);
            /* duet__mma_loader's copies, written out: as a loader here the kernel spilled */
            const int c = t & 7, r0 = t >> 3;
            const unsigned d0 = duet__swz<BK>(r0, c);
            const __nv_bfloat16 *src[24];
            bool ok[24];
#pragma unroll
            for (int j = 0; j < 24; j++) {
                const int r = r0 + 16 * (j & 7); /* A's rows, then 2 × 8 weight rows */
                if (j < 8) {
                    ok[j] = r < n_r;
                    src[j] = ok[j] ? A + (size_t)(pl.list[tl.y + r] / a_div) * K + c * 8 : A;
                } else {
                    const int rb = r + 128 * (j >= 16), n = DUAL ? n0 + r : n0 + rb;
                    ok[j] = n < N;
                    src[j] = ok[j]
                                 ? (DUAL && j >= 16 ? B1 : B0) + ((size_t)tl.x * N + n) * K + c * 8
                                 : B0;
                }
            }
            for (int kt = 0; kt < (w < 0 ? 1 : KT); kt++, q++) {
                const int s = q % S;
                if (q >= S)
                    duet__mbar_wait(&empty[s], (unsigned)((q / S - 1) & 1));
                if (t == 0 && kt == 0)
                    item[s] = make_int4(w, tl.y, n_r, n0);
                if (w >= 0) {
#pragma unroll
                    for (int j = 0; j < 24; j++) /* rows 16 apart: the same swizzle (d0) */
                        duet__cp_async16(sbase + s * STAGE + d0 + 16 * 128 * j,
                                         src[j] + (ok[j] ? kt * BK : 0), ok[j]);
                }
                duet__cp_async_arrive(&full[s]); /* once these copies have landed */
                if (t == 0)
                    duet__mbar_arrive(&full[s]); /* item[s] */
            }
            if (w < 0)
                break;
        }
        duet__cp_async_wait_all();
        return;
    }

    const int g = wg - 1, lane = tid & 31, warp = (tid >> 5) & 3, m0 = g * 64 + warp * 16;
    for (;;) {
        duet__mbar_wait(&full[q % S], (unsigned)((q / S) & 1));
        const int4 its = item[q % S];
        const int w = its.x, start = its.y, n_r = its.z, n0 = its.w;
        if (w < 0)
            break;
        const bool busy = g * 64 < n_r;
        /* lane l < 16: the pair of the warp's row l, loaded now and stored after the products */
        const int myp = busy && lane < 16 && m0 + lane < n_r ? pl.list[start + m0 + lane] : -1;
        float d[128];
#pragma unroll
        for (int i = 0; i < 128; i++)
            d[i] = 0.0f;
        duet__wg_fence_operands(d);
        for (int kt = 0; kt < KT; kt++, q++) {
            const int s = q % S;
            if (kt > 0)
                duet__mbar_wait(&full[s], (unsigned)((q / S) & 1));
            if (busy) {
                duet__fence_proxy_async(); /* the copies were the generic proxy's */
                const unsigned st = sbase + s * STAGE;
                duet__wg_kstep(d, st + g * 64 * 128, st + A_BYTES);
                duet__wg_wait<1>(); /* k-step q - 1's products are done: its stage is free */
            }
            if (kt > 0 && lane == 0)
                duet__mbar_arrive(&empty[(q - 1) % S]);
        }
        duet__wg_wait<0>();
        duet__wg_fence_operands(d);
        if (lane == 0)
            duet__mbar_arrive(&empty[(q - 1) % S]);
        if (!busy)
            continue;

        /*
         * The warp's 16 rows go out through its staging rows, a chunk of columns at a time:
         * the accumulators land there in their own layout, and every store then writes 128
         * contiguous bytes of one row, instead of 16 or 32 bytes of eight rows (which cost as
         * much as the products: bench/RESULTS.md, "MoE prefill experts: warp-specialised
         * tiles").
         */
        float *stg = (float *)(gbase + S * STAGE) + (g * 4 + warp) * 16 * DUET__WS_PITCH;
        constexpr int CJ = DUAL ? 8 : 4; /* j's per chunk: 64 bf16 or 32 fp32 columns */
#pragma unroll
        for (int j0 = 0; j0 < (DUAL ? 16 : 32); j0 += CJ) {
            if (n0 + 8 * j0 >= N) /* N is a multiple of 64: a chunk is all in or all out */
                continue;
            __syncwarp();
#pragma unroll
            for (int jj = 0; jj < CJ; jj++)
#pragma unroll
                for (int half = 0; half < 2; half++) {
                    const int rr = (lane >> 2) + 8 * half, col = 8 * jj + 2 * (lane & 3);
                    const float *v = &d[4 * (j0 + jj) + 2 * half];
                    if (DUAL) {
                        const float *u = v + 64; /* the up row's group, j + 16 */
                        const __nv_bfloat162 h =
                            __floats2bfloat162_rn(duet_act_apply(v[0], u[0], ACT, beta, beta_lin),
                                                  duet_act_apply(v[1], u[1], ACT, beta, beta_lin));
                        *reinterpret_cast<__nv_bfloat162 *>(stg + rr * DUET__WS_PITCH + col / 2) =
                            h;
                    } else {
                        *reinterpret_cast<float2 *>(stg + rr * DUET__WS_PITCH + col) =
                            make_float2(v[0], v[1]);
                    }
                }
            __syncwarp();
#pragma unroll
            for (int pass = 0; pass < 4; pass++) {
                const int rr = pass * 4 + (lane >> 3);
                const int p = __shfl_sync(0xffffffffu, myp, rr);
                const float4 val =
                    *reinterpret_cast<const float4 *>(stg + rr * DUET__WS_PITCH + 4 * (lane & 7));
                if (p < 0)
                    continue;
                if (DUAL)
                    *reinterpret_cast<float4 *>(h_out + (size_t)p * N + n0 + 8 * j0 +
                                                8 * (lane & 7)) = val;
                else
                    *reinterpret_cast<float4 *>(o_out + (size_t)p * N + n0 + 8 * j0 +
                                                4 * (lane & 7)) = val;
            }
        }
    }
}

template <bool DUAL, int ACT>
static duet_status_t duet__ws_launch(cudaStream_t stream, int64_t max_tiles, const __nv_bfloat16 *A,
                                     int a_div, const __nv_bfloat16 *B0, const __nv_bfloat16 *B1,
                                     int N, int K, const duet__moe_plan_t &pl, float beta,
                                     float beta_lin, __nv_bfloat16 *h_out, float *o_out)
{
    static unsigned long long optin = 0;
    auto kernel = duet__moe_ws_kernel<DUAL, ACT>;
    const size_t smem = DUET__WS_SMEM;
    cudaError_t e = duet__smem_optin(kernel, &optin, DUET__WS_SMEM);
    if (e != cudaSuccess)
        return duet_cuda_status(e, DUET__MODULE, "wgmma shared-memory opt-in");
    const int per = DUAL ? 128 : 256; /* outputs per item */
    const int nx = (N + per - 1) / per;
    const int64_t items = max_tiles * nx, sms = duet_cuda_sm_count();
    const unsigned blocks = (unsigned)(sms > 0 && sms < items ? sms : items);
    DUET__TRY(duet_pdl_launch(kernel, dim3(blocks), dim3(DUET__WS_THREADS), smem, stream, A, a_div,
                              B0, B1, N, K, nx, pl, beta, beta_lin, h_out, o_out),
              DUAL ? "wgmma gate/up kernel launch" : "wgmma down kernel launch");
    return DUET_OK;
}

template <int WG, bool DUAL, int ACT>
static duet_status_t duet__wgmma_launch(cudaStream_t stream, int64_t max_tiles,
                                        const __nv_bfloat16 *A, int a_div, const __nv_bfloat16 *B0,
                                        const __nv_bfloat16 *B1, int N, int K,
                                        const duet__moe_plan_t &pl, float beta, float beta_lin,
                                        __nv_bfloat16 *h_out, float *o_out)
{
    static unsigned long long optin = 0;
    auto kernel = duet__moe_wgmma_kernel<WG, DUAL, ACT>;
    /* + 1 KB: the kernel moves its stages up to the next 1024-byte boundary */
    const size_t smem =
        (size_t)DUET__WG_STAGES * duet__mma_loader<64 * WG, 64, 128 * WG, DUAL>::STAGE + 1024;
    cudaError_t e = duet__smem_optin(kernel, &optin, DUET__SMEM_CAP);
    if (e != cudaSuccess)
        return duet_cuda_status(e, DUET__MODULE, "wgmma shared-memory opt-in");
    const int per = DUAL ? 64 : 128; /* outputs per block */
    const dim3 g((unsigned)((N + per - 1) / per), (unsigned)max_tiles);
    DUET__TRY(duet_pdl_launch(kernel, g, dim3(128 * WG), smem, stream, A, a_div, B0, B1, N, K, pl,
                              beta, beta_lin, h_out, o_out),
              DUAL ? "wgmma gate/up kernel launch" : "wgmma down kernel launch");
    return DUET_OK;
}

/* One phase on the kernel that wg and ws pick, its activation ACT. */
template <bool DUAL, int ACT>
static duet_status_t duet__phase_launch(cudaStream_t stream, int64_t max_tiles, int wg, bool ws,
                                        const __nv_bfloat16 *A, int a_div, const __nv_bfloat16 *B0,
                                        const __nv_bfloat16 *B1, int N, int K,
                                        const duet__moe_plan_t &pl, float beta, float beta_lin,
                                        __nv_bfloat16 *h_out, float *o_out)
{
    if (ws)
        return duet__ws_launch<DUAL, ACT>(stream, max_tiles, A, a_div, B0, B1, N, K, pl, beta,
                                          beta_lin, h_out, o_out);
    if (wg == 2)
        return duet__wgmma_launch<2, DUAL, ACT>(stream, max_tiles, A, a_div, B0, B1, N, K, pl, beta,
                                                beta_lin, h_out, o_out);
    return duet__wgmma_launch<1, DUAL, ACT>(stream, max_tiles, A, a_div, B0, B1, N, K, pl, beta,
                                            beta_lin, h_out, o_out);
}

duet_status_t duet__moe_wgmma_phase(cudaStream_t stream, int64_t max_tiles, int wg, bool ws,
                                    bool dual, const __nv_bfloat16 *A, int a_div,
                                    const __nv_bfloat16 *B0, const __nv_bfloat16 *B1, int N, int K,
                                    const duet__moe_plan_t &pl, duet_cuda_act_t act, float beta,
                                    float beta_lin, __nv_bfloat16 *h_out, float *o_out)
{
    /* ws: the staged stores take 32 or 64 columns at a time, all inside N or all past it */
    if ((wg != 1 && wg != 2) || (ws && (wg != 2 || N % 64 != 0)) || K % 64 != 0)
        return duet_error_set(DUET_ERR_INVALID,
                              "cuda moe: wgmma tiles of %d warpgroups%s, N=%d, K=%d", wg,
                              ws ? " (warp-specialised)" : "", N, K);
    /* the activation a template argument: an instance's epilogue holds one kind's code, not
     * every kind's (bench/RESULTS.md, "MoE prefill experts: warp-specialised tiles"); the down
     * phase has none */
    if (!dual)
        return duet__phase_launch<false, DUET_CUDA_ACT_SILU>(
            stream, max_tiles, wg, ws, A, a_div, B0, B1, N, K, pl, beta, beta_lin, h_out, o_out);
    if (act == DUET_CUDA_ACT_SITU)
        return duet__phase_launch<true, DUET_CUDA_ACT_SITU>(
            stream, max_tiles, wg, ws, A, a_div, B0, B1, N, K, pl, beta, beta_lin, h_out, o_out);
    return duet__phase_launch<true, DUET_CUDA_ACT_SILU>(stream, max_tiles, wg, ws, A, a_div, B0, B1,
                                                        N, K, pl, beta, beta_lin, h_out, o_out);
}

/* Whether the current device runs this file's code (duet__wg_usable). */
int duet__moe_wgmma_usable(void)
{
    static unsigned long long asked = 0, usable = 0;
    return duet__wg_usable(duet__moe_wgmma_kernel<1, true, DUET_CUDA_ACT_SILU>, &asked, &usable);
}
