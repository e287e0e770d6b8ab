/*
 * cuda_mma.cuh: the tensor-core pieces the attention (mla.cu), the small-M GEMV (gemm.cu) and
 * KDA's chunked core (kda.cu) share (CUDA C++ only): one bf16 mma.m16n8k16 with fp32
 * accumulation, and the split of fp32 values into bf16 hi + lo pairs that lets such products keep
 * fp32 operands to 2^-16; one tf32 mma.m16n8k8, the rounding of an fp32 value to tf32 and its
 * split into two tf32 parts (three products of the parts keep fp32 operands to about 2^-21);
 * and the ldmatrix loads of their fragments from shared memory.
 */
#ifndef DUET_KERNELS_CUDA_MMA_CUH
#define DUET_KERNELS_CUDA_MMA_CUH

#include <stdint.h>

#include <cuda_bf16.h>

/* c (16×8 fp32) += a (16×16 bf16, row: fragment registers a0..a3) · b (16×8 bf16, col). */
static __device__ __forceinline__ void duet_mma_bf16(float c[4], uint32_t a0, uint32_t a1,
                                                     uint32_t a2, uint32_t a3, uint32_t b0,
                                                     uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/* The same with the A fragment as an array. */
static __device__ __forceinline__ void duet_mma_bf16(float c[4], const uint32_t a[4], uint32_t b0,
                                                     uint32_t b1)
{
    duet_mma_bf16(c, a[0], a[1], a[2], a[3], b0, b1);
}

/* x = hi + lo as two bf16: hi rounds x to 8 significant bits, lo the remainder, so
 * |x − hi − lo| <= 2^-16 |x| (duet_split_bf16x2 below does the same to two values at once). */
static __device__ __forceinline__ void duet_split_bf16(float x, __nv_bfloat16 *hi,
                                                       __nv_bfloat16 *lo)
{
    *hi = __float2bfloat16_rn(x);
    *lo = __float2bfloat16_rn(x - __bfloat162float(*hi));
}

/* (x0, x1) = hi + lo as two bf16 pairs, the first value in the low half as mma fragments want:
 * hi rounds each value to 8 significant bits, lo the remainder, so |x − hi − lo| <= 2^-16 |x|. */
static __device__ __forceinline__ void duet_split_bf16x2(float x0, float x1, uint32_t *hi,
                                                         uint32_t *lo)
{
    const __nv_bfloat16 h0 = __float2bfloat16_rn(x0), h1 = __float2bfloat16_rn(x1);
    const __nv_bfloat16 l0 = __float2bfloat16_rn(x0 - __bfloat162float(h0));
    const __nv_bfloat16 l1 = __float2bfloat16_rn(x1 - __bfloat162float(h1));
    *hi = (uint32_t)__bfloat16_as_ushort(h0) | ((uint32_t)__bfloat16_as_ushort(h1) << 16);
    *lo = (uint32_t)__bfloat16_as_ushort(l0) | ((uint32_t)__bfloat16_as_ushort(l1) << 16);
}

/* c (16×8 fp32) += a (16×8 tf32, row: a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4)) ·
 * b (8×8 tf32, col: b0 (t, g), b1 (t+4, g)), with g = lane / 4, t = lane % 4; c0..c3 are
 * (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1). */
static __device__ __forceinline__ void duet_mma_tf32(float c[4], const uint32_t a[4], uint32_t b0,
                                                     uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* x rounded to tf32 (10 explicit mantissa bits, round to nearest): within 2^-11 of x. */
static __device__ __forceinline__ uint32_t duet_round_tf32(float x)
{
    uint32_t b;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(b) : "f"(x));
    return b;
}

/* x = big + small as two tf32 values: big rounds x (duet_round_tf32), small the remainder, so
 * |x − big − small| <= 2^-22 |x| (up to subnormals). The three products big·big + big·small +
 * small·big of two such splits carry a product to about 2^-21. */
static __device__ __forceinline__ void duet_split_tf32(float x, uint32_t *big, uint32_t *small)
{
    const uint32_t b = duet_round_tf32(x);
    *big = b;
    *small = duet_round_tf32(x - __uint_as_float(b));
}

/* Four 8 × 8 matrices of 16-bit values (or 8 × 4 of 32-bit words: the bits move unchanged) from
 * shared memory by one ldmatrix: lane L gives the address of row L % 8 of matrix L / 8 (16-byte
 * aligned), and lane (g, t) gets the word t of row g of matrix i in v[i], g = lane / 4,
 * t = lane % 4. */
static __device__ __forceinline__ void duet_ldsm_x4(const void *p, uint32_t (&v)[4])
{
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
                 : "r"(s)
                 : "memory");
}

/* The same with each 8 × 8 matrix of 16-bit values transposed: lane (g, t) gets the values
 * (2t, g) and (2t + 1, g) of matrix i in v[i]. */
static __device__ __forceinline__ void duet_ldsm_x4_t(const void *p, uint32_t (&v)[4])
{
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
                 : "r"(s)
                 : "memory");
}

#endif
