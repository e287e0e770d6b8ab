/*
 * mla_wgmma.cu: the expanded MLA prefill attention (cuda_mla.h, duet_cuda_mla_attend_x) with
 * Hopper's warpgroup MMA (sm_90a only; mla.cu chooses between it and its mma.sync kernel).
 *
 * The block is mla.cu's duet__mla_xattn_kernel's: 64 query rows of one head, one warpgroup
 * (warp w owns rows 16w ..), tiles of 32 positions through 3 shared-memory stages, the same
 * products (TERMS = 3, the splits: q · k = qh · kh + ql · kh + qh · kl over the nope dims, qh ·
 * kr + ql · kr over the rope dims, P · v = Ph · vh + Pl · vh + Ph · vl, two blocks per SM;
 * TERMS = 1, qh · kh, qh · kr and Ph · vh alone, three blocks per SM), the same online softmax
 * in registers (mla_x.cuh). What differs is how the products reach the tensor cores. There each
 * warp loads every K and V fragment of the tile from shared memory with ldmatrix for its own 16
 * rows and issues m16n8k16 products: 4 warps read the tile 4 times, and shared memory was that
 * kernel's busiest pipe. Here q and P stay in registers as the A operand and the tile goes to
 * the tensor cores once per warpgroup through shared-memory descriptors: wgmma m64n32k16 for the
 * scores (B = K rows, K-major) and m64n128k16 for P · V (B = V rows, MN-major: the transposed
 * form). Its outputs equal the mma.sync kernel's bit for bit in every case test_cuda_mla_x runs,
 * and it is faster, though still at about half the dense bf16 rate. Issuing tile t + 1's scores
 * before tile t's softmax gained too little for a second loop: the two blocks per SM already
 * cover each other's softmax (bench/RESULTS.md, "MLA prefill attention on wgmma", with the
 * other forms tried).
 *
 * A stage holds a tile's 32 expanded rows as column blocks of 64 dims, each 32 rows of 128
 * bytes in cuda_wgmma.cuh's swizzled layout: for the split products 9 (v_hi 0-1, v_lo 2-3, k_hi
 * 4-5, k_r 6, k_lo 7-8), for the one-term products 5 (v_hi 0-1, k_hi 2-3, k_r 4; a smaller stage,
 * so three blocks share an SM). The scores' k-step j reads block K / 64 + j / 4 (k_lo: 3 blocks
 * on) 32 (j % 4) bytes into its rows; P · V's k-step kk reads rows 16kk .. of blocks 0-1 (v_lo:
 * 2-3), the second 64 dims one block (4 KB) on.
 *
 * The build compiles this file for sm_90a alone (kernels/CMakeLists.txt). On any other device
 * the code does not load, cudaFuncGetAttributes says so, and duet__mla_wgmma_usable() returns 0.
 */
#include <math.h>
#include <stdint.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_mla.h"
#include "kernels/cuda/cuda_pdl.cuh"
#include "kernels/cuda/cuda_wgmma.cuh"
#include "kernels/cuda/mla_x.cuh"

#define DUET__MODULE     "cuda mla" /* the prefix of this file's error details */
#define DUET__XW_STAGES  3
#define DUET__XW_BLOCK   (DUET_MLA_XA_TK * 128) /* one column block, bytes */
#define DUET__XW_THREADS 128

/* A stage of the TERMS-term kernel: the chunks it reads as whole column blocks of 8 chunks (9
 * blocks, 36 KB, or 5, 20 KB); the shared memory with the 1024-byte alignment; blocks per SM. */
template <int TERMS> struct duet__xw_shape {
    typedef duet__mla_xa_cols<TERMS> Cols;
    static_assert(Cols::N % 8 == 0, "whole column blocks");
    static constexpr int STAGE = Cols::N / 8 * DUET__XW_BLOCK,
                         SMEM = DUET__XW_STAGES * STAGE + 1024;
    static constexpr int PER_SM = TERMS == 3 ? 2 : 3;
};

/* s (64 × 32 fp32, this thread's 16) += A (64 × 16, registers) · B (16 × 32, K-major). */
static __device__ __forceinline__ void duet__wgmma_s(float (&d)[16], const uint32_t (&a)[4],
                                                     unsigned long long db)
{
    DUET__WG_ASM("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
                 "{%16, %17, %18, %19}, %20, 1, 1, 1, 0;\n"
                 : DUET__WG_R8(0), DUET__WG_R8(8)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

/* o (64 × 128 fp32, this thread's 64) += A (64 × 16, registers) · B (16 × 128, MN-major). */
static __device__ __forceinline__ void duet__wgmma_o(float (&d)[64], const uint32_t (&a)[4],
                                                     unsigned long long db)
{
    DUET__WG_ASM("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " DUET__WG_D64
                 "{%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
                 : DUET__WG_OUT64
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

/*
 * Queue the copy of positions t0 .. t0 + 31 of a head's rows into the stage at shared address
 * st (the swizzled column blocks; positions >= L zero-filled, as mla_x.cuh's copy does). A
 * thread takes chunk c8 = thread % 8 of stage rows r = thread / 8 and r + 16 in every column
 * block: both rows sit at the same swizzled offset (16 is a multiple of the swizzle's 8-row
 * period), so a tile costs a thread two source rows and every copy's addresses are those plus
 * constants. mla_x.cuh's copy, general over the layout (mla.cu's kernel keeps it), worked out
 * both addresses of each chunk, about 40% of this kernel's instructions (bench/RESULTS.md, "MLA
 * prefill attention: fewer instructions per tile").
 */
template <int TERMS>
static __device__ __forceinline__ void duet__xw_load(unsigned st, const __nv_bfloat16 *src, int t0,
                                                     int L)
{
    typedef duet__mla_xa_cols<TERMS> Cols;
    static_assert(DUET__XW_THREADS == 8 * DUET_MLA_XA_TK / 2, "a thread per chunk of 16 rows");
    const int c8 = threadIdx.x & 7, r = threadIdx.x >> 3, p0 = t0 + r, p1 = p0 + 16;
    const bool ok0 = p0 < L, ok1 = p1 < L;
    const unsigned d = st + (unsigned)(r * 128 + ((c8 ^ (r & 7)) << 4));
    const __nv_bfloat16 *s0 = src + (int64_t)(ok0 ? p0 : 0) * DUET_MLA_X_TD + c8 * 8;
    const __nv_bfloat16 *s1 = src + (int64_t)(ok1 ? p1 : 0) * DUET_MLA_X_TD + c8 * 8;
#pragma unroll
    for (int b = 0; b < Cols::N / 8; b++) {
        /* Cols::col moves whole blocks: block b's chunks are consecutive in the expanded row */
        const int col = Cols::col(8 * b) * 8;
        duet__cp_async16(d + b * DUET__XW_BLOCK, s0 + col, ok0);
        duet__cp_async16(d + b * DUET__XW_BLOCK + 16 * 128, s1 + col, ok1);
    }
}

/* Issue s = q · k over the tile at shared address st (committed, not waited for). */
template <int TERMS>
static __device__ __forceinline__ void duet__xw_scores(float (&s)[16], const uint32_t (&qh)[12][4],
                                                       const uint32_t (&ql)[12][4], unsigned st)
{
    constexpr int KB = duet__mla_xa_cols<TERMS>::K / 64; /* k_hi's first block */
#pragma unroll
    for (int i = 0; i < 16; i++)
        s[i] = 0.0f;
    duet__wg_fence();
#pragma unroll
    for (int j = 0; j < 12; j++) {
        /* k_hi (j < 8) or k_r (j >= 8): blocks KB + j / 4; k_lo: 3 blocks on */
        const unsigned kb = st + (KB + j / 4) * DUET__XW_BLOCK + 32 * (j % 4);
        duet__wgmma_s(s, qh[j], duet__wg_desc(kb));
        if (TERMS == 3) {
            duet__wgmma_s(s, ql[j], duet__wg_desc(kb));
            if (j < 8)
                duet__wgmma_s(s, qh[j], duet__wg_desc(kb + 3 * DUET__XW_BLOCK));
        }
    }
    duet__wg_commit();
}

/* The tile's online softmax (mla_x.cuh; MASK false: no position of the tile is past a row's
 * own), o rescaled, the weights as A fragments ph + pl. Past a row's first tiles its max seldom
 * moves, and a factor of 1 leaves o as it is, so a warp whose factors are all 1 skips the 64
 * products (2% of this kernel; mla.cu's kernel measured slower with the same skip). */
template <bool MASK>
static __device__ __forceinline__ void
duet__xw_softmax(float (&s)[16], float (&o)[64], int t0, int tg, int p0, int p1, float &m0,
                 float &m1, float &l0, float &l1, uint32_t (&ph)[2][4], uint32_t (&pl)[2][4])
{
    float a0, a1;
    duet__mla_xa_softmax<MASK>(s, t0, tg, p0, p1, m0, m1, l0, l1, a0, a1);
    if (!__all_sync(0xffffffffu, a0 == 1.0f && a1 == 1.0f))
        duet__mla_xa_rescale(o, a0, a1);
    duet__mla_xa_p(s, 0, ph[0], pl[0]);
    duet__mla_xa_p(s, 1, ph[1], pl[1]);
}

/* Issue o += P · (v_hi + v_lo) (TERMS = 1: P · v_hi) over the tile at st, k-steps of 16
 * positions (committed). */
template <int TERMS>
static __device__ __forceinline__ void duet__xw_pv(float (&o)[64], const uint32_t (&ph)[2][4],
                                                   const uint32_t (&pl)[2][4], unsigned st)
{
    duet__wg_fence();
#pragma unroll
    for (int kk = 0; kk < 2; kk++) {
        const unsigned vb = st + kk * 16 * 128; /* rows 16kk .. of blocks 0, 1 */
        duet__wgmma_o(o, ph[kk], duet__wg_desc(vb, DUET__XW_BLOCK));
        if (TERMS == 3) {
            duet__wgmma_o(o, pl[kk], duet__wg_desc(vb, DUET__XW_BLOCK));
            duet__wgmma_o(o, ph[kk], duet__wg_desc(vb + 2 * DUET__XW_BLOCK, DUET__XW_BLOCK));
        }
    }
    duet__wg_commit();
}

template <int TERMS>
__global__ static void __launch_bounds__(DUET__XW_THREADS, duet__xw_shape<TERMS>::PER_SM)
    duet__mla_xattn_wg_kernel(const __nv_bfloat16 *xkv, int64_t xstride, const int32_t *item_row0,
                              int n_items, const int32_t *row_pos, const float *q, int64_t ldq,
                              int64_t dq_stride, float qscale, int n, float *out)
{
    constexpr int STAGE = duet__xw_shape<TERMS>::STAGE;
    extern __shared__ __align__(16) unsigned char duet__xw_smem[];
    __shared__ int s_blk[3]; /* first row, end of the item's rows, item's first expanded row */
    const int tg = threadIdx.x & 3, head = blockIdx.y, TK = DUET_MLA_XA_TK, S = DUET__XW_STAGES;
    /* stages start on 1024 bytes (the swizzle's period); the launch adds 1 KB for this */
    const unsigned sbase = ((unsigned)__cvta_generic_to_shared(duet__xw_smem) + 1023u) & ~1023u;

    duet__mla_xa_rows_t b; /* which item and rows (mla_x.cuh); blocks without rows exit */
    if (!duet__mla_xa_begin(xkv, xstride, item_row0, n_items, row_pos, s_blk, &b))
        return;
    const int L = b.L, r0 = b.r0, r1 = b.r1, n_rows = b.n_rows;
    const __nv_bfloat16 *src = b.src;
    const int n_tiles = (L + TK - 1) / TK;
#pragma unroll
    for (int st = 0; st < S - 1; st++) {
        if (st < n_tiles)
            duet__xw_load<TERMS>(sbase + st * STAGE, src, st * TK, L);
        duet__cp_async_commit();
    }

    uint32_t qh[12][4], ql[12][4];
    duet__mla_xa_q(q, ldq, dq_stride, head, qscale, r0, r1, n_rows, tg, qh, ql);

    float o[64], m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
#pragma unroll
    for (int i = 0; i < 64; i++)
        o[i] = 0.0f;

    /* Every warp runs every tile (wgmma is the warpgroup's): a warp whose rows all precede a
     * tile gets every score masked, weights 0 and factors 1. Tiles before tm lie at or before
     * every row's position, and need no mask. */
    const int minp = min(b.p0, b.p1); /* -1: a row past n_rows, every tile masked */
    const int tm = (int)__reduce_min_sync(0xffffffffu, (unsigned)(minp < 0 ? 0 : (minp + 1) / TK));
    float s[16];
    uint32_t ph[2][4], pl[2][4];
    for (int t = 0; t < n_tiles; t++) {
        duet__cp_async_wait<S - 2>();
        duet__fence_proxy_async();
        __syncthreads(); /* tile t landed for all; every wgmma on tile t - 1's stage is done */
        {
            const int tn = t + S - 1;
            if (tn < n_tiles)
                duet__xw_load<TERMS>(sbase + (tn % S) * STAGE, src, tn * TK, L);
            duet__cp_async_commit();
        }
        const unsigned st = sbase + (t % S) * STAGE;
        duet__xw_scores<TERMS>(s, qh, ql, st);
        duet__wg_wait<0>();
        duet__wg_fence_operands(s);
        if (t < tm)
            duet__xw_softmax<false>(s, o, t * TK, tg, b.p0, b.p1, m0, m1, l0, l1, ph, pl);
        else
            duet__xw_softmax<true>(s, o, t * TK, tg, b.p0, b.p1, m0, m1, l0, l1, ph, pl);
        duet__xw_pv<TERMS>(o, ph, pl, st);
        duet__wg_wait<0>();
        duet__wg_fence_operands(o);
    }
    duet__cp_async_wait<0>(); /* no copy may land in shared memory after the block exits */
    duet__mla_xa_store(o, l0, l1, r0, r1, n_rows, n, head, tg, out);
}

template <int TERMS>
static duet_status_t duet__xw_launch(cudaStream_t stream, dim3 grid, const __nv_bfloat16 *xkv,
                                     int64_t xstride, const int32_t *item_row0, int n_items,
                                     const int32_t *row_pos, const float *q, int64_t ldq,
                                     int64_t dq_stride, float qscale, int n, float *out)
{
    static unsigned long long optin = 0;
    const auto kernel = duet__mla_xattn_wg_kernel<TERMS>;
    const int smem = duet__xw_shape<TERMS>::SMEM;
    DUET_CUDA_TRY(duet__smem_optin(kernel, &optin, smem), DUET__MODULE,
                  "attend_x wgmma shared-memory opt-in");
    DUET_CUDA_TRY(duet_pdl_launch(kernel, grid, dim3(DUET__XW_THREADS), smem, stream, xkv, xstride,
                                  item_row0, n_items, row_pos, q, ldq, dq_stride, qscale, n, out),
                  DUET__MODULE, "attend_x wgmma launch");
    return DUET_OK;
}

duet_status_t duet__mla_xattn_wg(cudaStream_t stream, dim3 grid, int terms,
                                 const __nv_bfloat16 *xkv, int64_t xstride,
                                 const int32_t *item_row0, int n_items, const int32_t *row_pos,
                                 const float *q, int64_t ldq, int64_t dq_stride, float qscale,
                                 int n, float *out)
{
    return (terms == 1 ? duet__xw_launch<1> : duet__xw_launch<3>)(stream, grid, xkv, xstride,
                                                                  item_row0, n_items, row_pos, q,
                                                                  ldq, dq_stride, qscale, n, out);
}

/* Whether the current device runs this file's code (duet__wg_usable). */
int duet__mla_wgmma_usable(void)
{
    static unsigned long long asked = 0, usable = 0;
    return duet__wg_usable(duet__mla_xattn_wg_kernel<3>, &asked, &usable);
}
