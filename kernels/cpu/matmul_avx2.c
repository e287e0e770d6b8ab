/*
 * matmul_avx2.c: the matmul tiles for AVX2 + FMA + F16C (8 fp32 lanes, 16 vector registers:
 * 2 x 4 tiles). Compiled with those -m flags (kernels/CMakeLists.txt); reached only through
 * duet__isa_detect.
 */
#include "kernels/cpu/matmul_impl.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#include <math.h>

/* Horizontal sums of four vectors as one __m128 {sum a, sum b, sum c, sum d}. */
static inline __attribute__((always_inline)) __m128 duet__vsum4_256(__m256 a, __m256 b, __m256 c,
                                                                    __m256 d)
{
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

typedef __m256 duet__v;
#define DUET__VL       8
#define DUET__MR_MAX   2
#define DUET__VZERO()  _mm256_setzero_ps()
#define DUET__VLOAD(p) _mm256_loadu_ps(p)
#define DUET__VLOAD_BF16(p)                                                                        \
    _mm256_castsi256_ps(                                                                           \
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define DUET__VLOAD_F16(p)      _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define DUET__VFMA(a, b, c)     _mm256_fmadd_ps((a), (b), (c))
#define DUET__VSUM4(a, b, c, d) duet__vsum4_256((a), (b), (c), (d))
#define DUET__BLOCK_FN          duet__matmul_block_avx2

#include "kernels/cpu/matmul_tmpl.h"

#else

void duet__matmul_block_avx2(duet_dtype_t dt, float *y, int64_t ldy, const float *x, int64_t ldx,
                             int64_t m0, int64_t m1, const void *w, int64_t n0, int64_t n1,
                             int64_t K, int accumulate)
{
    duet__matmul_block_scalar(dt, y, ldy, x, ldx, m0, m1, w, n0, n1, K, accumulate);
}

#endif
