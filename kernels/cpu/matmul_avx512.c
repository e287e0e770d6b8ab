/*
 * matmul_avx512.c: the matmul tiles for AVX-512 F/BW/VL + FMA + F16C (16 fp32 lanes, 32 vector
 * registers: 4 x 4 tiles). Compiled with those -m flags (kernels/CMakeLists.txt); reached only
 * through duet__isa_detect, so the binary still runs on CPUs without them.
 */
#include "kernels/cpu/matmul_impl.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#include <math.h>

/*
 * Horizontal sums of four vectors as one __m128 {sum a, sum b, sum c, sum d}: unpack/shuffle
 * so each 128-bit lane holds partials of all four, then fold the lanes (13 ops instead of ~32).
 */
static inline __attribute__((always_inline)) __m128 duet__vsum4_512(__m512 a, __m512 b, __m512 c,
                                                                    __m512 d)
{
    __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xee));
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

typedef __m512 duet__v;
#define DUET__VL       16
#define DUET__MR_MAX   4
#define DUET__VZERO()  _mm512_setzero_ps()
#define DUET__VLOAD(p) _mm512_loadu_ps(p)
#define DUET__VLOAD_BF16(p)                                                                        \
    _mm512_castsi512_ps(                                                                           \
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define DUET__VLOAD_F16(p)      _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define DUET__VFMA(a, b, c)     _mm512_fmadd_ps((a), (b), (c))
#define DUET__VSUM4(a, b, c, d) duet__vsum4_512((a), (b), (c), (d))
#define DUET__BLOCK_FN          duet__matmul_block_avx512

#include "kernels/cpu/matmul_tmpl.h"

#else

void duet__matmul_block_avx512(duet_dtype_t dt, float *y, int64_t ldy, const float *x, int64_t ldx,
                               int64_t m0, int64_t m1, const void *w, int64_t n0, int64_t n1,
                               int64_t K, int accumulate)
{
    duet__matmul_block_scalar(dt, y, ldy, x, ldx, m0, m1, w, n0, n1, K, accumulate);
}

#endif
