/*
 * mla_x.cuh: what the expanded MLA prefill attention's two kernels share (CUDA C++ only):
 * mla.cu's mma.sync kernel, which runs everywhere, and mla_wgmma.cu's warpgroup-MMA kernel
 * (sm_90a alone). Both take blocks of 64 query rows of one head, each warp 16 rows, tiles of
 * 32 positions, a warp's scores in the mma accumulator layout: s[4i + c] is row g (c < 2) or
 * g + 8 (c >= 2) and position t0 + 8i + 2tg + (c & 1), g = lane / 4, tg = lane % 4; the output
 * accumulators likewise, o[4i + c] at value dim 8i + 2tg + (c & 1).
 */
#ifndef DUET_KERNELS_CUDA_MLA_X_CUH
#define DUET_KERNELS_CUDA_MLA_X_CUH

#include <math.h>
#include <stdint.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common/status.h"
#include "kernels/cuda/cuda_async.cuh"
#include "kernels/cuda/cuda_mma.cuh"
#include "kernels/cuda/cuda_pdl.cuh"

/* The expanded form's rows (cuda_mla.h): [v_hi | v_lo | k_hi | k_r | k_lo] */
#define DUET_MLA_X_DN    128                 /* qk_nope_head_dim = v_head_dim */
#define DUET_MLA_X_DR    64                  /* qk_rope_head_dim */
#define DUET_MLA_X_S0    (2 * DUET_MLA_X_DN) /* first key dim */
#define DUET_MLA_X_TD    (DUET_MLA_X_S0 + 2 * DUET_MLA_X_DN + DUET_MLA_X_DR) /* 576 */
#define DUET_MLA_XA_ROWS 64 /* query rows per block */
#define DUET_MLA_XA_TK   32 /* positions per tile */

/* 2^x, hardware approximation (~2 ulp); 2^-inf = 0. */
__device__ static inline float duet__mla_ex2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/*
 * Which rows block x of the grid owns, by warp 0 (lane = its lane): block x is the
 * (gridDim.x - 1 - x)-th block of 64 rows in item order (an item's longest rows first); the
 * warp scans the items' block counts and contexts (an item's expanded rows follow the previous
 * items'), as duet__mla_setup scans the counts for attend (kept apart: that scan sits in the
 * decode kernels, tuned as they are). blk gets {first row, end of the item's rows, the item's
 * first expanded row}, or blk[0] = -1 past the real count. Reads step metadata only, which the
 * host copies in before the step: callable before the PDL wait.
 */
__device__ static inline void duet__mla_xa_find(const int32_t *item_row0, int n_items,
                                                const int32_t *row_pos, int lane, int *blk)
{
    const unsigned full = 0xffffffffu;
    const int bx = (int)gridDim.x - 1 - (int)blockIdx.x;
    int nb = 0, nx = 0, found = 0;
    for (int i0 = 0; i0 < n_items && !found; i0 += 32) {
        const int i = i0 + lane;
        int r0 = 0, r1 = 0, cnt = 0, len = 0;
        if (i < n_items) {
            r0 = item_row0[i];
            r1 = item_row0[i + 1];
            cnt = (r1 - r0 + DUET_MLA_XA_ROWS - 1) / DUET_MLA_XA_ROWS;
            len = r1 > r0 ? row_pos[r1 - 1] + 1 : 0;
        }
        int ic = cnt, il = len;
        for (int o = 1; o < 32; o <<= 1) {
            const int yc = __shfl_up_sync(full, ic, o), yl = __shfl_up_sync(full, il, o);
            if (lane >= o) {
                ic += yc;
                il += yl;
            }
        }
        const int eb = nb + ic - cnt, ex = nx + il - len;
        const unsigned hit = __ballot_sync(full, cnt > 0 && bx >= eb && bx < eb + cnt);
        if (hit != 0) {
            const int src = __ffs(hit) - 1;
            if (lane == src) {
                blk[0] = r0 + (bx - eb) * DUET_MLA_XA_ROWS;
                blk[1] = r1;
                blk[2] = ex;
            }
            found = 1;
        }
        nb += __shfl_sync(full, ic, 31);
        nx += __shfl_sync(full, il, 31);
    }
    if (!found && lane == 0)
        blk[0] = -1;
}

/*
 * The 16-byte chunks of an expanded row that the products read: TERMS = 3 (the hi + lo splits)
 * read all 72 ([v_hi | v_lo | k_hi | k_r | k_lo], 8 dims each); TERMS = 1 (q, K, V and P each
 * rounded to bf16 once) reads v_hi, k_hi and k_r, 40 chunks, which a stage holds packed in that
 * order. Chunk c of a stage row is chunk col(c) of the expanded row; offsets in dims within a
 * stage row: V at 0 (v_lo at DN), k_hi at K, k_r at K + DN, k_lo at K + DN + DR.
 */
template <int TERMS> struct duet__mla_xa_cols {
    static_assert(TERMS == 1 || TERMS == 3, "one-term or split products");
    static constexpr int N =
        TERMS == 3 ? DUET_MLA_X_TD / 8 : (2 * DUET_MLA_X_DN + DUET_MLA_X_DR) / 8;
    static constexpr int K = TERMS == 3 ? DUET_MLA_X_S0 : DUET_MLA_X_DN;
    __device__ static constexpr int col(int c)
    {
        return TERMS == 3 || c < DUET_MLA_X_DN / 8 ? c : c + DUET_MLA_X_DN / 8;
    }
};

/*
 * Queue the copy of positions t0 .. t0 + 31 of a head's expanded rows (contiguous from src) by a
 * block of THREADS threads, each thread its share of the row chunks the products read
 * (duet__mla_xa_cols<TERMS>); stage chunk (row, c) goes to dst(row, c), the kernel's stage
 * layout (a shared-memory pointer or address). Positions >= L are zero-filled: P is 0 there,
 * and 0 · garbage could be NaN.
 */
template <int THREADS, int TERMS, typename Dst>
__device__ static __forceinline__ void duet__mla_xa_copy(const __nv_bfloat16 *src, int t0, int L,
                                                         Dst dst)
{
    typedef duet__mla_xa_cols<TERMS> Cols;
    constexpr int N = DUET_MLA_XA_TK * Cols::N / THREADS;
    static_assert(DUET_MLA_XA_TK * Cols::N % THREADS == 0, "whole chunks per thread");
#pragma unroll
    for (int k = 0; k < N; k++) {
        const int ch = threadIdx.x + k * THREADS, row = ch / Cols::N, c = ch - row * Cols::N;
        const int pos = t0 + row;
        const __nv_bfloat16 *s =
            src + (int64_t)(pos < L ? pos : 0) * DUET_MLA_X_TD + Cols::col(c) * 8;
        duet__cp_async16(dst(row, c), s, pos < L);
    }
}

/*
 * The start of a block (every thread): warp 0 finds the block's rows (duet__mla_xa_find, into
 * blk, shared), then the PDL wait and trigger. Returns 0 when the block has no rows (it may
 * exit); else the rows [row0, min(row0 + 64, n_rows)) of the item, L = its context for them
 * (positions 0 .. L - 1), this thread's rows r0 = row0 + 16 warp + g and r1 = r0 + 8 and their
 * positions p0, p1 (-1 past n_rows), and src = the item's expanded rows of this head.
 */
struct duet__mla_xa_rows_t {
    int row0, n_rows, L, r0, r1, p0, p1;
    const __nv_bfloat16 *src;
};

__device__ static inline int duet__mla_xa_begin(const __nv_bfloat16 *xkv, int64_t xstride,
                                                const int32_t *item_row0, int n_items,
                                                const int32_t *row_pos, int *blk,
                                                duet__mla_xa_rows_t *b)
{
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (warp == 0)
        duet__mla_xa_find(item_row0, n_items, row_pos, lane, blk);
    __syncthreads();
    b->row0 = blk[0];
    b->n_rows = blk[1];
    if (b->row0 < 0) {
        duet_pdl_wait(); /* every block waits: the grid completes after its predecessor */
        return 0;
    }
    b->L = row_pos[min(b->row0 + DUET_MLA_XA_ROWS, b->n_rows) - 1] + 1;
    b->r0 = b->row0 + 16 * warp + (lane >> 2);
    b->r1 = b->r0 + 8;
    b->p0 = b->r0 < b->n_rows ? row_pos[b->r0] : -1;
    b->p1 = b->r1 < b->n_rows ? row_pos[b->r1] : -1;
    duet_pdl_wait(); /* the expanded rows and q are written by earlier kernels */
    duet_pdl_trigger();
    b->src = xkv + ((int64_t)blockIdx.y * xstride + blk[2]) * DUET_MLA_X_TD;
    return 1;
}

/* A warp's q fragments for rows r0 (g) and r1 (g + 8), hi + lo of q · qscale over the 192 query
 * dims in 12 k-steps of 16 (one-term products use hi alone, bf16 of q · qscale): registers a0a1
 * (r0, 2tg), a2a3 (r1, 2tg), a4a5 (r0, 2tg + 8), a6a7 (r1, 2tg + 8), the mma.m16n8k16 A fragment
 * (and wgmma's, warp by warp); zero past n_rows. */
__device__ static inline void duet__mla_xa_q(const float *q, int64_t ldq, int64_t dq_stride,
                                             int head, float qscale, int r0, int r1, int n_rows,
                                             int tg, uint32_t (&qh)[12][4], uint32_t (&ql)[12][4])
{
#pragma unroll
    for (int j = 0; j < 12; j++)
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const int row = (x & 1) ? r1 : r0, col = 16 * j + 2 * tg + (x >> 1) * 8;
            float2 v = make_float2(0.0f, 0.0f);
            if (row < n_rows)
                v = *(const float2 *)(q + (int64_t)row * ldq + (int64_t)head * dq_stride + col);
            duet_split_bf16x2(v.x * qscale, v.y * qscale, &qh[j][x], &ql[j][x]);
        }
}

/*
 * One tile's online softmax over a warp's scores s (2^x units): positions past a row's own (p0
 * for row g, p1 for g + 8; -1 masks every position) are masked, the running max m and this
 * thread's share of the sum l updated, s replaced by the weights, and the factors the row's
 * accumulators must take returned in a0 (row g) and a1 (row g + 8). MASK false skips the mask,
 * for a tile the caller knows lies at or before both rows' positions (the same result).
 */
template <bool MASK = true>
__device__ static inline void duet__mla_xa_softmax(float (&s)[16], int t0, int tg, int p0, int p1,
                                                   float &m0, float &m1, float &l0, float &l1,
                                                   float &a0, float &a1)
{
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int tok = t0 + 8 * i + 2 * tg + (c & 1);
            if (MASK && tok > (c < 2 ? p0 : p1))
                s[4 * i + c] = -INFINITY;
            if (c < 2)
                mx0 = fmaxf(mx0, s[4 * i + c]);
            else
                mx1 = fmaxf(mx1, s[4 * i + c]);
        }
#pragma unroll
    for (int d = 1; d <= 2; d <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, d));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, d));
    }
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    a0 = mn0 == -INFINITY ? 1.0f : duet__mla_ex2(m0 - mn0);
    a1 = mn1 == -INFINITY ? 1.0f : duet__mla_ex2(m1 - mn1);
    const float b0 = mn0 == -INFINITY ? 0.0f : mn0, b1 = mn1 == -INFINITY ? 0.0f : mn1;
    m0 = mn0;
    m1 = mn1;
    float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        s[4 * i + 0] = duet__mla_ex2(s[4 * i + 0] - b0);
        s[4 * i + 1] = duet__mla_ex2(s[4 * i + 1] - b0);
        s[4 * i + 2] = duet__mla_ex2(s[4 * i + 2] - b1);
        s[4 * i + 3] = duet__mla_ex2(s[4 * i + 3] - b1);
        sum0 += s[4 * i + 0] + s[4 * i + 1];
        sum1 += s[4 * i + 2] + s[4 * i + 3];
    }
    l0 = l0 * a0 + sum0; /* this thread's share; the quad adds them up at the end */
    l1 = l1 * a1 + sum1;
}

/* The accumulators of rows g (o[4i], o[4i + 1]) and g + 8 times their factors a0, a1. */
__device__ static inline void duet__mla_xa_rescale(float (&o)[64], float a0, float a1)
{
#pragma unroll
    for (int i = 0; i < 16; i++) {
        o[4 * i] *= a0;
        o[4 * i + 1] *= a0;
        o[4 * i + 2] *= a1;
        o[4 * i + 3] *= a1;
    }
}

/* The weights of positions 16kk .. 16kk + 15 of the tile as A fragments, hi + lo (one-term
 * products use hi alone). */
__device__ static inline void duet__mla_xa_p(const float (&s)[16], int kk, uint32_t (&ph)[4],
                                             uint32_t (&pl)[4])
{
    const float *a = s + 8 * kk, *b = s + 8 * kk + 4;
    duet_split_bf16x2(a[0], a[1], &ph[0], &pl[0]);
    duet_split_bf16x2(a[2], a[3], &ph[1], &pl[1]);
    duet_split_bf16x2(b[0], b[1], &ph[2], &pl[2]);
    duet_split_bf16x2(b[2], b[3], &ph[3], &pl[3]);
}

/* The rows' outputs o / l into out [rows][n][128] (rows past n_rows are not written). */
__device__ static inline void duet__mla_xa_store(const float (&o)[64], float l0, float l1, int r0,
                                                 int r1, int n_rows, int n, int head, int tg,
                                                 float *out)
{
#pragma unroll
    for (int d = 1; d <= 2; d <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, d);
        l1 += __shfl_xor_sync(0xffffffffu, l1, d);
    }
    const float i0 = 1.0f / l0, i1 = 1.0f / l1;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        const int col = 8 * i + 2 * tg;
        if (r0 < n_rows)
            *(float2 *)(out + ((int64_t)r0 * n + head) * DUET_MLA_X_DN + col) =
                make_float2(o[4 * i] * i0, o[4 * i + 1] * i0);
        if (r1 < n_rows)
            *(float2 *)(out + ((int64_t)r1 * n + head) * DUET_MLA_X_DN + col) =
                make_float2(o[4 * i + 2] * i1, o[4 * i + 3] * i1);
    }
}

/*
 * mla_wgmma.cu's kernel, where duet__mla_wgmma_usable() says the current device runs its code
 * (sm_90a: H100 / H200): the grid and arguments of mla.cu's duet__mla_xattn_kernel, with
 * terms 1 or 3 (duet__mla_xa_cols) chosen at run time.
 */
int duet__mla_wgmma_usable(void);
duet_status_t duet__mla_xattn_wg(cudaStream_t stream, dim3 grid, int terms,
                                 const __nv_bfloat16 *xkv, int64_t xstride,
                                 const int32_t *item_row0, int n_items, const int32_t *row_pos,
                                 const float *q, int64_t ldq, int64_t dq_stride, float qscale,
                                 int n, float *out);

#endif
