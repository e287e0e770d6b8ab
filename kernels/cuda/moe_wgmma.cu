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
 * The build compiles this file for sm_90a alone (kernels/CMakeLists.txt). On any other device
 * the code does not load, cudaFuncGetAttributes says so, and duet__moe_wgmma_usable() returns 0.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_pdl.cuh"
#include "kernels/cuda/cuda_wgmma.cuh"
#include "kernels/cuda/moe_mma.cuh"

#define DUET__MODULE          "cuda moe" /* the prefix of this file's error details */
#define DUET__WG_STAGES       3          /* 3 × 32 KB at 128-row tiles: two blocks per SM */
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
template <int WG, bool DUAL>
__global__ void __launch_bounds__(128 * WG, 2)
    duet__moe_wgmma_kernel(const __nv_bfloat16 *A, int a_div, const __nv_bfloat16 *B0,
                           const __nv_bfloat16 *B1, int N, int K, duet__moe_plan_t pl, int act,
                           float beta, float beta_lin, __nv_bfloat16 *h_out, float *o_out)
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
        duet__wg_fence();
#pragma unroll
        for (int ks = 0; ks < BK / 16; ks++)
            duet__wgmma_m64n128k16(d, duet__wg_desc(st + wg * 64 * 128 + ks * 32),
                                   duet__wg_desc(st + A_BYTES + ks * 32));
        duet__wg_commit();
        duet__wg_wait0();
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
                    __floats2bfloat162_rn(duet_act_apply(g[0], u[0], act, beta, beta_lin),
                                          duet_act_apply(g[1], u[1], act, beta, beta_lin));
            } else {
                *reinterpret_cast<float2 *>(o_out + (size_t)p * N + n) = make_float2(g[0], g[1]);
            }
        }
    }
}

template <int WG, bool DUAL>
static duet_status_t duet__wgmma_launch(cudaStream_t stream, int64_t max_tiles,
                                        const __nv_bfloat16 *A, int a_div, const __nv_bfloat16 *B0,
                                        const __nv_bfloat16 *B1, int N, int K,
                                        const duet__moe_plan_t &pl, duet_cuda_act_t act, float beta,
                                        float beta_lin, __nv_bfloat16 *h_out, float *o_out)
{
    static unsigned long long optin = 0;
    auto kernel = duet__moe_wgmma_kernel<WG, DUAL>;
    /* + 1 KB: the kernel moves its stages up to the next 1024-byte boundary */
    const size_t smem =
        (size_t)DUET__WG_STAGES * duet__mma_loader<64 * WG, 64, 128 * WG, DUAL>::STAGE + 1024;
    cudaError_t e = duet__smem_optin(kernel, &optin, DUET__SMEM_CAP);
    if (e != cudaSuccess)
        return duet_cuda_status(e, DUET__MODULE, "wgmma shared-memory opt-in");
    const int per = DUAL ? 64 : 128; /* outputs per block */
    const dim3 g((unsigned)((N + per - 1) / per), (unsigned)max_tiles);
    DUET__TRY(duet_pdl_launch(kernel, g, dim3(128 * WG), smem, stream, A, a_div, B0, B1, N, K, pl,
                              (int)act, beta, beta_lin, h_out, o_out),
              DUAL ? "wgmma gate/up kernel launch" : "wgmma down kernel launch");
    return DUET_OK;
}

duet_status_t duet__moe_wgmma_phase(cudaStream_t stream, int64_t max_tiles, int wg, bool dual,
                                    const __nv_bfloat16 *A, int a_div, const __nv_bfloat16 *B0,
                                    const __nv_bfloat16 *B1, int N, int K,
                                    const duet__moe_plan_t &pl, duet_cuda_act_t act, float beta,
                                    float beta_lin, __nv_bfloat16 *h_out, float *o_out)
{
    if ((wg != 1 && wg != 2) || K % 64 != 0)
        return duet_error_set(DUET_ERR_INVALID, "cuda moe: wgmma tiles of %d warpgroups, K=%d", wg,
                              K);
    if (wg == 2)
        return dual ? duet__wgmma_launch<2, true>(stream, max_tiles, A, a_div, B0, B1, N, K, pl,
                                                  act, beta, beta_lin, h_out, o_out)
                    : duet__wgmma_launch<2, false>(stream, max_tiles, A, a_div, B0, B1, N, K, pl,
                                                   act, beta, beta_lin, h_out, o_out);
    return dual ? duet__wgmma_launch<1, true>(stream, max_tiles, A, a_div, B0, B1, N, K, pl, act,
                                              beta, beta_lin, h_out, o_out)
                : duet__wgmma_launch<1, false>(stream, max_tiles, A, a_div, B0, B1, N, K, pl, act,
                                               beta, beta_lin, h_out, o_out);
}

/* Whether the current device runs this file's code (duet__wg_usable). */
int duet__moe_wgmma_usable(void)
{
    static unsigned long long asked = 0, usable = 0;
    return duet__wg_usable(duet__moe_wgmma_kernel<1, true>, &asked, &usable);
}
