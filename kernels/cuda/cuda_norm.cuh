/*
 * cuda_norm.cuh: the two roundings every RMSNorm of the CUDA path shares (CUDA C++ only).
 *
 * RMSNorm(x) ⊙ w over n values is computed in several kernels, each summing x² its own way
 * (duet_cuda_rmsnorm and the MLA kv_write in double, the fused-norm GEMV and the router kernel
 * in fp32 along their dot products). From that sum on they must agree to the bit, so that a row
 * one kernel stores as xn equals what another would have stored: the scale is 1/sqrt(Σ/n + eps)
 * taken in double and rounded once to fp32, and each element is w · (x · scale), two fp32
 * products rounded in that order (kernels/cpu/ops.c's order).
 */
#ifndef DUET_KERNELS_CUDA_NORM_CUH
#define DUET_KERNELS_CUDA_NORM_CUH

#include <cuda_runtime.h>

/* 1/rms of a row of n values whose squares sum to sum_sq. */
static __device__ __forceinline__ float duet_rms_scale(double sum_sq, double n, float eps)
{
    return (float)(1.0 / sqrt(sum_sq / n + (double)eps));
}

/* One element of the normalised row: w · (x · scale). */
static __device__ __forceinline__ float duet_rms_apply(float w, float x, float scale)
{
    return __fmul_rn(w, __fmul_rn(x, scale));
}

#endif
