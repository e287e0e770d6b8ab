/*
 * moe_mma.cuh: what moe.cu's expert kernels and moe_wgmma.cu's share (CUDA C++ only): the plan
 * that groups (row, k) pairs by expert, the activation, the swizzled layout of the
 * MMA tiles' shared-memory stages, and the wgmma kernels' entry points. moe_wgmma.cu is compiled
 * for sm_90a alone (its instructions exist nowhere else), so the two live in separate files.
 */
#ifndef DUET_KERNELS_CUDA_MOE_MMA_CUH
#define DUET_KERNELS_CUDA_MOE_MMA_CUH

#include <math.h>
#include <stdint.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/status.h"
#include "kernels/cuda/cuda_act.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_pdl.cuh"
#include "kernels/cuda/cuda_wgmma.cuh"

#define DUET__MMA_BROWS 128          /* weight rows per stage: 64 of W1 + 64 of W3, or 128 of W2 */
#define DUET__SMEM_CAP  (200 * 1024) /* opt-in dynamic shared memory we allow a kernel */

/* meta[0] = number of GEMV slots, meta[1] = number of MMA tiles, meta[2] and [3] the
 * warp-specialised wgmma kernels' work counters (gate/up, down; zeroed by the plan). With list ==
 * NULL (T = 1 on the GEMV path) there is no plan: slot p is pair p alone, its expert idx[p].
 *
 * gemv2's tickets (T = 1 only): cnt[s] counts the pairs whose slice s of out is written; the
 * gemv2 block that brings it to top_k (top_k + 1 with the shared expert) adds the slice into y.
 * gemv13 zeroes the counters; every pair, valid or not, has its gemv2 block. */
typedef struct {
    int *off;                      /* [E + 2] start of each expert's list (E: the shared one) */
    int *list;                     /* [P + T] pair ids grouped by expert */
    int *meta;                     /* [4] */
    int2 *slots;                   /* [max_slots] (expert, list start), <= nr rows each */
    int2 *tiles;                   /* [max_tiles] (expert, list start), <= bm rows each */
    const int32_t *idx;            /* [P] the routing */
    int *cnt;                      /* [n_slices] gemv2 tickets, or NULL: no tickets */
    int E, top_k, n_slices, n_cnt; /* n_cnt = n_slices (T = 1) */
    int P;                         /* T * top_k pairs */
    /* The shared expert folded in (the GEMV path): as expert id E, at T = 1 (no plan) slot P
     * into row P of h and out, at T > 1 the plan's list of pairs P + t into rows P + t;
     * combining adds it after the routed sum, weight 1. */
    int shared;
    const void *sw1, *sw3, *sw2;
    int early; /* weight loads before x / the PDL wait (duet_cuda_weights_early) */
    /* With the shared expert folded in and these set (duet_cuda_experts_t's norm_x, norm_w,
     * norm_eps): its gate/up blocks form x = RMSNorm(nx) ⊙ nw themselves and run ahead of the
     * PDL wait (duet__gemv13_shared_early). */
    const float *nx, *nw;
    float eps;
} duet__moe_plan_t;

/* Byte offset of 16-byte chunk c of row r in a [rows][BK] bf16 tile. BK = 32: 64-byte rows,
 * chunk c (0..3) XOR-ed with bits 1..2 of the row; BK = 64: 128-byte rows, chunk c (0..7)
 * XOR-ed with bits 0..2. Either way ldmatrix's 8 rows of one chunk hit 8 distinct bank groups. */
template <int BK> static __device__ __forceinline__ unsigned duet__swz(int r, int c)
{
    if constexpr (BK == 64)
        return (unsigned)(r * 128 + ((c ^ (r & 7)) << 4));
    return (unsigned)(r * 64 + ((c ^ ((r >> 1) & 3)) << 4));
}

/* The rows of plan tile tl (expert, list start): at most BM, fewer in an expert's last tile. */
template <int BM>
static __device__ __forceinline__ int duet__tile_rows(const duet__moe_plan_t &pl, int2 tl)
{
    return min(BM, pl.off[tl.x + 1] - tl.y);
}

/*
 * The start of an MMA tile's block (NT threads), after its PDL wait (the plan and A): rows[m]
 * gets the pair of row m of tile blockIdx.y (-1 past its expert's list) and the tile's expert is
 * returned; -1 when the plan has fewer tiles than the grid (the block has nothing to do).
 */
template <int BM, int NT>
static __device__ __forceinline__ int duet__mma_tile(const duet__moe_plan_t &pl, int *rows)
{
    duet_pdl_wait(); /* the plan and A (x in bf16, or h) */
    duet_pdl_trigger();
    if ((int)blockIdx.y >= pl.meta[1])
        return -1;
    const int2 tl = pl.tiles[blockIdx.y];
    const int n_r = duet__tile_rows<BM>(pl, tl);
    for (int m = threadIdx.x; m < BM; m += NT)
        rows[m] = m < n_r ? pl.list[tl.y + m] : -1;
    __syncthreads();
    return tl.x;
}

/*
 * The copies that fill one k-step of an MMA tile's shared-memory stage, each thread's share
 * worked out once: BM rows of A (row r is A[rows[r] / a_div], zero where rows[r] < 0) then the
 * DUET__MMA_BROWS weight rows (DUAL: 64 rows of B0 from n0, then the same 64 of B1; else 128 of
 * B0; zero past N) of expert e, BK columns each, laid out by duet__swz<BK>, B after A's
 * A_BYTES. NT threads.
 */
template <int BM, int BK, int NT, bool DUAL> struct duet__mma_loader {
    static constexpr int CPR = BK / 8; /* 16-byte chunks per row */
    static constexpr int A_CH = BM * CPR / NT, B_CH = DUET__MMA_BROWS * CPR / NT;
    static constexpr int A_BYTES = BM * BK * 2, STAGE = A_BYTES + DUET__MMA_BROWS * BK * 2;
    /* a thread's rows are NT / CPR apart, a multiple of the swizzle's 8-row period (duet__swz),
     * so its chunk sits at the same place in each of them: one offset serves every copy */
    static constexpr int STEP = NT / CPR * BK * 2;
    static_assert((NT / CPR) % 8 == 0, "rows a multiple of 8 apart");
    const __nv_bfloat16 *src[A_CH + B_CH];
    bool ok[A_CH + B_CH];
    unsigned d0; /* the chunk's offset in the first row */

    __device__ __forceinline__ duet__mma_loader(const int *rows, const __nv_bfloat16 *A, int a_div,
                                                const __nv_bfloat16 *B0, const __nv_bfloat16 *B1,
                                                int e, int n0, int N, int K)
    {
        d0 = duet__swz<BK>((int)threadIdx.x / CPR, (int)threadIdx.x % CPR);
#pragma unroll
        for (int j = 0; j < A_CH + B_CH; j++) {
            const bool is_a = j < A_CH;
            const int q = (int)threadIdx.x + NT * (is_a ? j : j - A_CH), r = q / CPR, c = q % CPR;
            if (is_a) {
                const int p = rows[r];
                ok[j] = p >= 0;
                src[j] = ok[j] ? A + (size_t)(p / a_div) * K + c * 8 : A;
            } else {
                const int n = DUAL ? n0 + (r & 63) : n0 + r;
                ok[j] = n < N;
                src[j] = ok[j] ? (DUAL && r >= 64 ? B1 : B0) + ((size_t)e * N + n) * K + c * 8 : B0;
            }
        }
    }

    /* k-step kt into the stage at shared address s (not committed) */
    __device__ __forceinline__ void load(unsigned s, int kt) const
    {
#pragma unroll
        for (int j = 0; j < A_CH + B_CH; j++)
            duet__cp_async16(s + d0 + (j < A_CH ? j * STEP : A_BYTES + (j - A_CH) * STEP),
                             src[j] + (ok[j] ? kt * BK : 0), ok[j]);
    }

    /* The pipeline's start: k-steps 0 .. S - 2 into stages 0 .. S - 2 from sbase, one commit
     * group each (empty past KT k-steps). */
    template <int S> __device__ __forceinline__ void prologue(unsigned sbase, int KT) const
    {
#pragma unroll
        for (int s = 0; s < S - 1; s++) {
            if (s < KT)
                load(sbase + s * STAGE, s);
            duet__cp_async_commit();
        }
    }
};

/*
 * The wgmma form of one MMA phase (moe_wgmma.cu): tiles of 64 · wg rows (wg 1 or 2, the plan's
 * tile height), the operands of duet__moe_mma_kernel, K a multiple of 64; with ws (wg 2 only)
 * the warp-specialised kernel, whose tiles span 256 weight rows instead of 128. Only when
 * duet__moe_wgmma_usable() says the current device runs that code (sm_90a: H100 / H200).
 */
int duet__moe_wgmma_usable(void);
duet_status_t duet__moe_wgmma_phase(cudaStream_t stream, int64_t max_tiles, int wg, bool ws,
                                    bool dual, const __nv_bfloat16 *A, int a_div,
                                    const __nv_bfloat16 *B0, const __nv_bfloat16 *B1, int N, int K,
                                    const duet__moe_plan_t &pl, duet_cuda_act_t act, float beta,
                                    float beta_lin, __nv_bfloat16 *h_out, float *o_out);

#endif
