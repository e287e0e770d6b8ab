/*
 * cuda_act.cuh: the gated activations' arithmetic (CUDA C++ only), shared by duet_cuda_act_mul
 * (ops.cu) and the GEMV that forms act(gate) ⊙ up on the fly (gemm.cu), so both give the CPU's
 * values operation for operation (kernels/cpu/ops.c).
 */
#ifndef DUET_KERNELS_CUDA_ACT_CUH
#define DUET_KERNELS_CUDA_ACT_CUH

#include <math.h>

#include "kernels/cuda/cuda_ops.h"

/* act(g) · u for SiLU, or SiTU's β·tanh(g/β)·σ(g) · β_lin·tanh(u/β_lin). */
static __device__ __forceinline__ float duet_act_gate(float g, float u, int act, float beta,
                                                      float beta_lin)
{
    if (act == DUET_CUDA_ACT_SILU)
        return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
    const float sig = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-g)));
    const float a = __fmul_rn(__fmul_rn(beta, tanhf(__fdiv_rn(g, beta))), sig);
    return __fmul_rn(a, __fmul_rn(beta_lin, tanhf(__fdiv_rn(u, beta_lin))));
}

#endif
