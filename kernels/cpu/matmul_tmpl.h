/*
 * matmul_tmpl.h: the blocked matmul body, instantiated once per instruction set by
 * matmul_avx2.c and matmul_avx512.c (each compiled with its own -m flags; only called after
 * duet__isa_detect says the CPU has them). The includer defines:
 *
 *   DUET__VL              fp32 lanes per vector        duet__v             the vector type
 *   DUET__VZERO()         zero vector                  DUET__VLOAD(p)      fp32 load (unaligned)
 *   DUET__VLOAD_BF16(p)   16-bit load + widen to fp32  DUET__VLOAD_F16(p)  same for binary16
 *   DUET__VFMA(a, b, c)   a * b + c
 *   DUET__VSUM4(a, b, c, d)  __m128 of the four horizontal sums (NR is a multiple of 4)
 *   DUET__MR_MAX          rows of x per tile (4 or 2)  DUET__BLOCK_FN      the exported name
 *
 * Form: y[m, n] = dot(x[m, :], W[n, :]). Both operands are contiguous along K, so a tile keeps
 * MR x NR vector accumulators of partial dot products, loads MR x-vectors and NR w-vectors per
 * step (w widened to fp32 exactly), and reduces horizontally once per K block. M = 1 (decode) uses
 * a 1 x 8 tile so that eight independent FMA chains hide the FMA latency while W streams from
 * memory. For large M and K the loop is blocked so that a 64 x 1024 block of x stays in L2 while
 * the tiles of W pass through L1.
 */

#define DUET__AI static inline __attribute__((always_inline))

DUET__AI duet__v duet__vload_w(const duet_dtype_t dt, const void *w, int64_t i)
{
    if (dt == DUET_DTYPE_F32)
        return DUET__VLOAD((const float *)w + i);
    if (dt == DUET_DTYPE_BF16)
        return DUET__VLOAD_BF16((const uint16_t *)w + i);
    return DUET__VLOAD_F16((const uint16_t *)w + i);
}

DUET__AI float duet__sload_w(const duet_dtype_t dt, const void *w, int64_t i)
{
    if (dt == DUET_DTYPE_F32)
        return ((const float *)w)[i];
    if (dt == DUET_DTYPE_BF16)
        return duet_bf16_to_f32(((const uint16_t *)w)[i]);
    return duet_f16_to_f32(((const uint16_t *)w)[i]);
}

/*
 * y[0:MR, 0:nr_valid] (+)= x[0:MR, 0:kn] · w[0:nr_valid, 0:kn]ᵀ. Rows of w past nr_valid repeat
 * the last valid row (computed, not stored), so edges need no separate code.
 */
DUET__AI void duet__tile(const int MR, const int NR, const duet_dtype_t dt, float *y, int64_t ldy,
                         const float *x, int64_t ldx, const void *w, int64_t ldw, int nr_valid,
                         int64_t kn, int add)
{
    const size_t es = dt == DUET_DTYPE_F32 ? 4 : 2;
    const float *xr[DUET__MR_MAX];
    const void *wr[8];
    duet__v acc[DUET__MR_MAX][8];
    float s[DUET__MR_MAX][8];

#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
        xr[i] = x + i * ldx;
#pragma GCC unroll 8
    for (int j = 0; j < NR; j++)
        wr[j] = (const char *)w + (size_t)(j < nr_valid ? j : nr_valid - 1) * (size_t)ldw * es;
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
        for (int j = 0; j < NR; j++)
            acc[i][j] = DUET__VZERO();

    int64_t k = 0;
    for (; k + DUET__VL <= kn; k += DUET__VL) {
        duet__v xv[DUET__MR_MAX];
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++)
            xv[i] = DUET__VLOAD(xr[i] + k);
#pragma GCC unroll 8
        for (int j = 0; j < NR; j++) {
            duet__v wv = duet__vload_w(dt, wr[j], k);
#pragma GCC unroll 8
            for (int i = 0; i < MR; i++)
                acc[i][j] = DUET__VFMA(xv[i], wv, acc[i][j]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
        for (int j = 0; j < NR; j += 4) /* four sums per shuffle tree */
            _mm_storeu_ps(&s[i][j],
                          DUET__VSUM4(acc[i][j], acc[i][j + 1], acc[i][j + 2], acc[i][j + 3]));
    for (; k < kn; k++) {
#pragma GCC unroll 8
        for (int j = 0; j < NR; j++) {
            float wv = duet__sload_w(dt, wr[j], k);
#pragma GCC unroll 8
            for (int i = 0; i < MR; i++) /* fmaf: never left to contraction, which differs
                                            between the MR x NR instantiations */
                s[i][j] = fmaf(xr[i][k], wv, s[i][j]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < nr_valid; j++)
            y[i * ldy + j] = add ? y[i * ldy + j] + s[i][j] : s[i][j];
}

DUET__AI void duet__block(const duet_dtype_t dt, float *y, int64_t ldy, const float *x, int64_t ldx,
                          int64_t m0, int64_t m1, const void *w, int64_t n0, int64_t n1, int64_t K,
                          int accumulate)
{
    const size_t es = dt == DUET_DTYPE_F32 ? 4 : 2;
    /* K blocking never depends on the row count, so a row's sums are the same for any M (batch
     * invariance: a request gets the same logits alone or in a batch). */
    const int64_t KB = K <= 1536 ? K : 1024;
    const int64_t MB = 64;

    for (int64_t kb = 0; kb < K; kb += KB) {
        int64_t kn = K - kb < KB ? K - kb : KB;
        int add = accumulate || kb > 0;
        for (int64_t mb = m0; mb < m1; mb += MB) {
            int64_t me = m1 - mb < MB ? m1 : mb + MB;
            if (me - mb == 1) {
                for (int64_t n = n0; n < n1; n += 8) {
                    int nr = n1 - n < 8 ? (int)(n1 - n) : 8;
                    duet__tile(1, 8, dt, y + mb * ldy + n, ldy, x + mb * ldx + kb, ldx,
                               (const char *)w + ((size_t)n * (size_t)K + (size_t)kb) * es, K, nr,
                               kn, add);
                }
                continue;
            }
            for (int64_t n = n0; n < n1; n += 4) {
                int nr = n1 - n < 4 ? (int)(n1 - n) : 4;
                const void *wn = (const char *)w + ((size_t)n * (size_t)K + (size_t)kb) * es;
                for (int64_t m = mb; m < me; m += DUET__MR_MAX) {
                    int64_t rows = me - m < DUET__MR_MAX ? me - m : DUET__MR_MAX;
                    float *yt = y + m * ldy + n;
                    const float *xt = x + m * ldx + kb;
                    switch (rows) {
#if DUET__MR_MAX >= 4
                    case 4:
                        duet__tile(4, 4, dt, yt, ldy, xt, ldx, wn, K, nr, kn, add);
                        break;
                    case 3:
                        duet__tile(3, 4, dt, yt, ldy, xt, ldx, wn, K, nr, kn, add);
                        break;
#endif
                    case 2:
                        duet__tile(2, 4, dt, yt, ldy, xt, ldx, wn, K, nr, kn, add);
                        break;
                    default:
                        duet__tile(1, 4, dt, yt, ldy, xt, ldx, wn, K, nr, kn, add);
                        break;
                    }
                }
            }
        }
    }
}

void DUET__BLOCK_FN(duet_dtype_t dt, float *y, int64_t ldy, const float *x, int64_t ldx, int64_t m0,
                    int64_t m1, const void *w, int64_t n0, int64_t n1, int64_t K, int accumulate)
{
    switch (dt) {
    case DUET_DTYPE_F32:
        duet__block(DUET_DTYPE_F32, y, ldy, x, ldx, m0, m1, w, n0, n1, K, accumulate);
        break;
    case DUET_DTYPE_BF16:
        duet__block(DUET_DTYPE_BF16, y, ldy, x, ldx, m0, m1, w, n0, n1, K, accumulate);
        break;
    case DUET_DTYPE_F16:
        duet__block(DUET_DTYPE_F16, y, ldy, x, ldx, m0, m1, w, n0, n1, K, accumulate);
        break;
    }
}
