/*
 * cuda_cvt.cuh: one 16-byte piece of 16-bit weights (8 values) to fp32, exactly (CUDA C++ only),
 * the load the weight-streaming GEMVs (gemm.cu, moe.cu) bring such pieces in with before they
 * convert them in registers, and the split of an fp32 value into bf16 terms.
 */
#ifndef DUET_KERNELS_CUDA_CVT_CUH
#define DUET_KERNELS_CUDA_CVT_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <string.h>

/*
 * The first P (1..3) terms of x's split into bf16 terms, each rounded to nearest even from
 * what the terms before it left: h[0] = bf16(x), h[1] = bf16(x − h[0]), h[2] = bf16(x − h[0] −
 * h[1]). The differences are exact in fp32, and with P = 3 the terms sum to x exactly
 * (cuda_gemm.h, duet_cuda_gemm_split_x, says why).
 */
template <int P>
static __device__ __forceinline__ void duet_bf16_split(float x, __nv_bfloat16 (&h)[P])
{
    static_assert(P >= 1 && P <= 3, "one to three terms");
#pragma unroll
    for (int t = 0; t < P; t++) {
        h[t] = __float2bfloat16_rn(x);
        x -= __bfloat162float(h[t]);
    }
}

/*
 * A 16-byte piece of weights, read around L1 (ld.global.nc.L1::no_allocate): a step reads each
 * weight once, and pieces allocated in L1 would evict what a block does reuse there (x, the norm
 * weight). They still pass through L2, where a block reading the same rows alongside finds them.
 * Faster than __ldg, and without the hint to fetch 256-byte L2 sectors faster than with it
 * (bench/RESULTS.md, "Weight loads around L1").
 */
static __device__ __forceinline__ uint4 duet_ld_weight16(const void *p)
{
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

/* bf16 is the upper half of an fp32: each value's bits move into place. */
static __device__ __forceinline__ void duet_cvt8_bf16(uint4 v, float *f)
{
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        f[2 * k] = __uint_as_float(w[k] << 16);
        f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    }
}

static __device__ __forceinline__ void duet_cvt8_f16(uint4 v, float *f)
{
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        __half2 h;
        memcpy(&h, &w[k], sizeof(h));
        const float2 p = __half22float2(h);
        f[2 * k] = p.x;
        f[2 * k + 1] = p.y;
    }
}

#endif
