/*
 * cuda_act.cuh: the gated activation every CUDA kernel applies (CUDA C++ only): act(g) · u with
 * the CPU's expressions, operation for operation (kernels/cpu/ops.c), so that the act·mul kernel
 * and the expert kernels, which apply it in registers, store the same bits.
 */
#ifndef DUET_KERNELS_CUDA_ACT_CUH
#define DUET_KERNELS_CUDA_ACT_CUH

#include <math.h>

#include <cuda_runtime.h>

#include "kernels/cuda/cuda_ops.h"

/* act(g) · u for act = DUET_CUDA_ACT_SILU or DUET_CUDA_ACT_SITU (betas non-zero). */
static __device__ __forceinline__ float duet_act_apply(float g, float u, int act, float beta,
                                                       float beta_lin)
{
    if (act == DUET_CUDA_ACT_SILU)
        return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
    const float sig = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-g)));
    const float a = __fmul_rn(__fmul_rn(beta, tanhf(__fdiv_rn(g, beta))), sig);
    return __fmul_rn(a, __fmul_rn(beta_lin, tanhf(__fdiv_rn(u, beta_lin))));
}

#endif
