/*
 * matmul_scalar.c: the portable matmul path (any CPU; the vector paths fall back to it where
 * their instruction sets cannot be compiled).
 */
#include "kernels/cpu/matmul_impl.h"

/* Portable path: 8 partial sums per dot product (the order the vector paths use, roughly). */
void duet__matmul_block_scalar(duet_dtype_t dt, float *y, int64_t ldy, const float *x, int64_t ldx,
                               int64_t m0, int64_t m1, const void *w, int64_t n0, int64_t n1,
                               int64_t K, int accumulate)
{
    for (int64_t n = n0; n < n1; n++) {
        const float *wf = (const float *)w + n * K;
        const uint16_t *wh = (const uint16_t *)w + n * K;
        for (int64_t m = m0; m < m1; m++) {
            const float *xr = x + m * ldx;
            float p[8] = {0};
            int64_t k = 0;
            float wv[8];
            for (; k + 8 <= K; k += 8) {
                for (int j = 0; j < 8; j++)
                    wv[j] = dt == DUET_DTYPE_F32    ? wf[k + j]
                            : dt == DUET_DTYPE_BF16 ? duet_bf16_to_f32(wh[k + j])
                                                    : duet_f16_to_f32(wh[k + j]);
                for (int j = 0; j < 8; j++)
                    p[j] += xr[k + j] * wv[j];
            }
            float s = ((p[0] + p[4]) + (p[1] + p[5])) + ((p[2] + p[6]) + (p[3] + p[7]));
            for (; k < K; k++) {
                float wk = dt == DUET_DTYPE_F32    ? wf[k]
                           : dt == DUET_DTYPE_BF16 ? duet_bf16_to_f32(wh[k])
                                                   : duet_f16_to_f32(wh[k]);
                s += xr[k] * wk;
            }
            y[m * ldy + n] = accumulate ? y[m * ldy + n] + s : s;
        }
    }
}
