/*
 * cuda_cvt.cuh: one 16-byte piece of 16-bit weights (8 values) to fp32, exactly (CUDA C++ only),
 * and the load the weight-streaming GEMVs (gemm.cu, moe.cu) bring such pieces in with before they
 * convert them in registers.
 */
#ifndef DUET_KERNELS_CUDA_CVT_CUH
#define DUET_KERNELS_CUDA_CVT_CUH

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <string.h>

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
