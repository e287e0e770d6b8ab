/*
 * matmul_impl.h: the matmul's per-ISA block functions (internal to kernels/cpu and its tests).
 * matmul.c dispatches to one of them; matmul_scalar.c, matmul_avx2.c and matmul_avx512.c define
 * them, the vector files falling back to the scalar one where their instruction sets cannot be
 * compiled.
 */
#ifndef DUET_KERNELS_CPU_MATMUL_IMPL_H
#define DUET_KERNELS_CPU_MATMUL_IMPL_H

#include <stdint.h>

#include "kernels/kernels.h"

/* The matmul of one block of outputs y[m0:m1, n0:n1], one ISA each (w is [N, K], ldw = K). */
typedef void (*duet__matmul_block_fn)(duet_dtype_t dt, float *y, int64_t ldy, const float *x,
                                      int64_t ldx, int64_t m0, int64_t m1, const void *w,
                                      int64_t n0, int64_t n1, int64_t K, int accumulate);
void duet__matmul_block_scalar(duet_dtype_t dt, float *y, int64_t ldy, const float *x, int64_t ldx,
                               int64_t m0, int64_t m1, const void *w, int64_t n0, int64_t n1,
                               int64_t K, int accumulate);
void duet__matmul_block_avx2(duet_dtype_t dt, float *y, int64_t ldy, const float *x, int64_t ldx,
                             int64_t m0, int64_t m1, const void *w, int64_t n0, int64_t n1,
                             int64_t K, int accumulate);
void duet__matmul_block_avx512(duet_dtype_t dt, float *y, int64_t ldy, const float *x, int64_t ldx,
                               int64_t m0, int64_t m1, const void *w, int64_t n0, int64_t n1,
                               int64_t K, int accumulate);

#endif
