/*
 * cuda_cvt.cuh: one 16-byte piece of 16-bit weights (8 values) to fp32, exactly (CUDA C++ only).
 * The weight-streaming GEMVs (gemm.cu, moe.cu) load such pieces and convert them in registers.
 */
#ifndef DUET_KERNELS_CUDA_CVT_CUH
#define DUET_KERNELS_CUDA_CVT_CUH

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <string.h>

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
