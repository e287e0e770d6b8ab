/*
 * ops.cu: the per-row and element-wise ops of cuda_ops.h (embedding gather, RMSNorm, fused
 * residual + RMSNorm, gated activations). CPU reference: kernels/cpu/ops.c.
 *
 * All of these are memory-bound, so each is one plain kernel: a block per row for the norms
 * and the gather, a grid-stride loop for the activations. Numerics follow the CPU closely:
 * RMSNorm sums squares in double (the CPU does too) and rounds the scale once to fp32, the
 * activations use the accurate expf/tanhf (not the __expf intrinsics), so results agree with
 * the CPU to a few ulps.
 */
#include <math.h>
#include <stdint.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_act.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_cvt.cuh"
#include "kernels/cuda/cuda_norm.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_pdl.cuh"

#define DUET__MODULE "cuda ops" /* the prefix of this file's error details */

#define DUET__ROW_THREADS 256

static duet_status_t duet__launched(cudaError_t e, const char *what)
{
    return e == cudaSuccess ? DUET_OK : duet_cuda_status(e, DUET__MODULE, what);
}

/* ---- block reductions ---------------------------------------------------------------------- */

/* Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the sum. */
static __device__ double duet__block_sum_f64(double v)
{
    __shared__ double part[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads(); /* part[] may still be read by a previous call */
    if (lane == 0)
        part[warp] = v;
    __syncthreads();
    double s = 0.0;
    for (int w = 0; w < n_warps; w++) /* fixed order: the result does not depend on timing */
        s += part[w];
    return s;
}

/* ---- embed --------------------------------------------------------------------------------- */

template <typename T> static __device__ __forceinline__ float duet__to_f32(T v);
template <> __device__ __forceinline__ float duet__to_f32<float>(float v)
{
    return v;
}
template <> __device__ __forceinline__ float duet__to_f32<__nv_bfloat16>(__nv_bfloat16 v)
{
    return __bfloat162float(v);
}
template <> __device__ __forceinline__ float duet__to_f32<__half>(__half v)
{
    return __half2float(v);
}

/* One block per id. The engine validates ids against the vocabulary (the table's row count is
 * not passed); a negative id, which can only be a bug upstream, gives a zero row. */
template <typename T>
__global__ void duet__embed_kernel(float *out, const T *table, int64_t D, const int32_t *ids)
{
    const int64_t t = blockIdx.x;
    duet_pdl_wait(); /* inputs come from earlier kernels of the step */
    duet_pdl_trigger();
    const int32_t id = ids[t];
    float *o = out + t * D;
    if (id < 0) {
        for (int64_t d = threadIdx.x; d < D; d += blockDim.x)
            o[d] = 0.0f;
        return;
    }
    const T *row = table + (int64_t)id * D;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x)
        o[d] = duet__to_f32<T>(row[d]);
}

extern "C" duet_status_t duet_cuda_embed(cudaStream_t stream, float *out, const void *table,
                                         duet_dtype_t dtype, int64_t D, const int32_t *ids,
                                         int64_t n)
{
    if (n < 0 || D < 0 || n > 0x7fffffff ||
        (n > 0 && D > 0 && (out == NULL || table == NULL || ids == NULL)))
        return duet_error_set(DUET_ERR_INVALID, "cuda embed: bad arguments n=%lld D=%lld",
                              (long long)n, (long long)D);
    if (n == 0 || D == 0)
        return DUET_OK;
    cudaError_t e;
    switch (dtype) {
    case DUET_DTYPE_F32:
        e = duet_pdl_launch(duet__embed_kernel<float>, dim3((unsigned)n), dim3(DUET__ROW_THREADS),
                            0, stream, out, (const float *)table, D, ids);
        break;
    case DUET_DTYPE_BF16:
        e = duet_pdl_launch(duet__embed_kernel<__nv_bfloat16>, dim3((unsigned)n),
                            dim3(DUET__ROW_THREADS), 0, stream, out, (const __nv_bfloat16 *)table,
                            D, ids);
        break;
    case DUET_DTYPE_F16:
        e = duet_pdl_launch(duet__embed_kernel<__half>, dim3((unsigned)n), dim3(DUET__ROW_THREADS),
                            0, stream, out, (const __half *)table, D, ids);
        break;
    default:
        return duet_error_set(DUET_ERR_INVALID, "cuda embed: unknown dtype %d", (int)dtype);
    }
    return duet__launched(e, "embed kernel launch");
}

/* ---- rmsnorm ------------------------------------------------------------------------------- */

/*
 * One block per row. With ADD the row of x is first updated in place (x += a), which is what the
 * fused residual + norm needs. Each thread reads and writes only its own elements, so y may be
 * x: the only cross-thread step is the reduction, finished before any write to y. A thread's
 * elements are d = t, t + 256, ... in that order (the sum's order, so the bits: U, the elements
 * a thread loads per pass, does not change it). The loads of a pass all go out before the first
 * store: with the stores in between (x += a writes x, and y may be x or a) the compiler could
 * not hoist the next load above a store, and a 2304-wide row cost nine round trips in a row
 * (bench/RESULTS.md, "Row norm: a pass of loads before any store"). A row of at most U · 256
 * stays in registers for the output pass, w loaded before the PDL wait, and U is the smallest
 * instance that holds it, so more blocks fit on an SM (bench/RESULTS.md, "Row norm: the row in
 * registers").
 */
#define DUET__NORM_U 12 /* the largest instance: wider rows take several passes */

/* One pass's loads: p[k] = pp[d] for d = d0 + k·step below D (0 elsewhere). */
template <int U>
__device__ static __forceinline__ void duet__norm_pass_load(float (&p)[U], const float *pp, int d0,
                                                            int step, int D)
{
#pragma unroll
    for (int k = 0; k < U; k++) {
        const int d = d0 + k * step;
        p[k] = d < D ? pp[d] : 0.0f;
    }
}

/* y[d] = v (unless P > 0 and yr is NULL), and with P > 0 its first P bf16 terms at xs[t · plane
 * + d] (duet_bf16_split). */
template <int P>
__device__ static __forceinline__ void duet__norm_store(float *yr, __nv_bfloat16 *xr, int64_t plane,
                                                        int d, float v)
{
    if (P == 0 || yr != NULL)
        yr[d] = v;
    if constexpr (P > 0) {
        __nv_bfloat16 h[P];
        duet_bf16_split<P>(v, h);
#pragma unroll
        for (int t = 0; t < P; t++)
            xr[t * plane + d] = h[t];
    }
}

/* U < DUET__NORM_U: the launch makes sure a row fits one pass (D <= U · blockDim.x). P > 0: the
 * rows also leave as P bf16 planes at xs (duet_cuda_rmsnorm_planes). */
template <int U, bool ADD, int P>
__global__ void __launch_bounds__(DUET__ROW_THREADS)
    duet__rmsnorm_kernel(float *y, int64_t ldy, float *x, int64_t ldx, const float *a,
                         const float *w, int D, float eps, __nv_bfloat16 *xs, int64_t plane)
{
    const int t = threadIdx.x, step = blockDim.x, pass = U * step;
    const bool one = U < DUET__NORM_U || D <= pass; /* the whole row in registers */
    float v[U], u[U], wv[U];
    if (one)
        duet__norm_pass_load<U>(wv, w, t, step, D); /* weights: before the wait */
    duet_pdl_wait(); /* inputs come from earlier kernels of the step */
    duet_pdl_trigger();
    float *xr = x + (int64_t)blockIdx.x * ldx;
    float *yr = y != NULL ? y + (int64_t)blockIdx.x * ldy : NULL; /* NULL: planes only */
    __nv_bfloat16 *sr = P > 0 ? xs + (int64_t)blockIdx.x * D : NULL;
    const float *ar = ADD ? a + (int64_t)blockIdx.x * D : NULL;
    double ss = 0.0;
    for (int d0 = t; d0 < D; d0 += pass) {
        duet__norm_pass_load<U>(v, xr, d0, step, D);
        if (ADD)
            duet__norm_pass_load<U>(u, ar, d0, step, D);
#pragma unroll
        for (int k = 0; k < U; k++) {
            const int d = d0 + k * step;
            if (d < D) {
                if (ADD) {
                    v[k] = __fadd_rn(v[k], u[k]);
                    xr[d] = v[k];
                }
                ss += (double)v[k] * (double)v[k];
            }
        }
    }
    ss = duet__block_sum_f64(ss);
    const float scale = duet_rms_scale(ss, (double)D, eps);
    if (one) {
#pragma unroll
        for (int k = 0; k < U; k++) {
            const int d = t + k * step;
            if (d < D)
                duet__norm_store<P>(yr, sr, plane, d, duet_rms_apply(wv[k], v[k], scale));
        }
        return;
    }
    if constexpr (U == DUET__NORM_U) /* only the largest instance takes rows of several passes */
        for (int d0 = t; d0 < D; d0 += pass) {
            duet__norm_pass_load<U>(wv, w, d0, step, D);
            duet__norm_pass_load<U>(v, xr, d0, step, D);
#pragma unroll
            for (int k = 0; k < U; k++) {
                const int d = d0 + k * step;
                if (d < D)
                    duet__norm_store<P>(yr, sr, plane, d, duet_rms_apply(wv[k], v[k], scale));
            }
        }
}

/* Instance U of the kernel, with or without a, with P planes (0, 1 or 3; a only with 0). */
template <int U>
static cudaError_t duet__rmsnorm_as(cudaStream_t stream, dim3 g, float *y, int64_t ldy, float *x,
                                    int64_t ldx, const float *a, const float *w, int D, float eps,
                                    __nv_bfloat16 *xs, int P)
{
    const dim3 b(DUET__ROW_THREADS);
    const int64_t plane = (int64_t)g.x * D;
    if (a != NULL)
        return duet_pdl_launch(duet__rmsnorm_kernel<U, true, 0>, g, b, 0, stream, y, ldy, x, ldx, a,
                               w, D, eps, xs, plane);
    if (P == 3)
        return duet_pdl_launch(duet__rmsnorm_kernel<U, false, 3>, g, b, 0, stream, y, ldy, x, ldx,
                               a, w, D, eps, xs, plane);
    if (P == 1)
        return duet_pdl_launch(duet__rmsnorm_kernel<U, false, 1>, g, b, 0, stream, y, ldy, x, ldx,
                               a, w, D, eps, xs, plane);
    return duet_pdl_launch(duet__rmsnorm_kernel<U, false, 0>, g, b, 0, stream, y, ldy, x, ldx, a, w,
                           D, eps, xs, plane);
}

/* The widest row the kernel takes: an index plus one pass stays below 2^31. */
#define DUET__NORM_MAX_D (0x7fffffff - DUET__NORM_U * DUET__ROW_THREADS)

/* The norm over M rows of D (a != NULL: x += a first), on the smallest instance that holds a
 * row. */
static duet_status_t duet__rmsnorm_launch(cudaStream_t stream, float *y, int64_t ldy, float *x,
                                          int64_t ldx, const float *a, const float *w, int64_t M,
                                          int64_t D, float eps, __nv_bfloat16 *xs, int P)
{
    if (D > DUET__NORM_MAX_D)
        return duet_error_set(DUET_ERR_RANGE, "cuda %s: rows of D=%lld (at most %d)",
                              a != NULL ? "add_rmsnorm" : "rmsnorm", (long long)D,
                              DUET__NORM_MAX_D);
    const int t = DUET__ROW_THREADS, d = (int)D;
    const dim3 g((unsigned)M);
    const cudaError_t e =
        d <= 4 * t ? duet__rmsnorm_as<4>(stream, g, y, ldy, x, ldx, a, w, d, eps, xs, P)
        : d <= 9 * t
            ? duet__rmsnorm_as<9>(stream, g, y, ldy, x, ldx, a, w, d, eps, xs, P)
            : duet__rmsnorm_as<DUET__NORM_U>(stream, g, y, ldy, x, ldx, a, w, d, eps, xs, P);
    return duet__launched(e, a != NULL ? "add_rmsnorm kernel launch" : "rmsnorm kernel launch");
}

/* duet_cuda_rmsnorm with P planes at xs (0: none), its arguments checked under `name`. */
static duet_status_t duet__rmsnorm_checked(const char *name, cudaStream_t stream, float *y,
                                           int64_t ldy, const float *x, int64_t ldx, const float *w,
                                           int64_t M, int64_t D, float eps, void *xs, int P)
{
    if (M < 0 || D < 0 || M > 0x7fffffff || ldx < D || (y != NULL && ldy < D) ||
        (M > 0 && D > 0 &&
         ((y == NULL && P == 0) || x == NULL || w == NULL || (P > 0 && xs == NULL))))
        return duet_error_set(DUET_ERR_INVALID,
                              "cuda %s: bad arguments M=%lld D=%lld ldx=%lld ldy=%lld", name,
                              (long long)M, (long long)D, (long long)ldx, (long long)ldy);
    if (M == 0 || D == 0)
        return DUET_OK;
    /* x is only read without a; the kernel's x is non-const for the fused variant. */
    return duet__rmsnorm_launch(stream, y, ldy, (float *)x, ldx, NULL, w, M, D, eps,
                                (__nv_bfloat16 *)xs, P);
}

extern "C" duet_status_t duet_cuda_rmsnorm(cudaStream_t stream, float *y, int64_t ldy,
                                           const float *x, int64_t ldx, const float *w, int64_t M,
                                           int64_t D, float eps)
{
    return duet__rmsnorm_checked("rmsnorm", stream, y, ldy, x, ldx, w, M, D, eps, NULL, 0);
}

extern "C" duet_status_t duet_cuda_rmsnorm_planes(cudaStream_t stream, float *y, int64_t ldy,
                                                  const float *x, int64_t ldx, const float *w,
                                                  int64_t M, int64_t D, float eps, void *xs,
                                                  int planes)
{
    if (planes != 1 && planes != 3)
        return duet_error_set(DUET_ERR_INVALID, "cuda rmsnorm_planes: %d planes (1 or 3)", planes);
    return duet__rmsnorm_checked("rmsnorm_planes", stream, y, ldy, x, ldx, w, M, D, eps, xs,
                                 planes);
}

extern "C" duet_status_t duet_cuda_add_rmsnorm(cudaStream_t stream, float *y, float *x,
                                               const float *a, const float *w, int64_t M, int64_t D,
                                               float eps)
{
    if (M < 0 || D < 0 || M > 0x7fffffff ||
        (M > 0 && D > 0 && (y == NULL || x == NULL || w == NULL)))
        return duet_error_set(DUET_ERR_INVALID, "cuda add_rmsnorm: bad arguments M=%lld D=%lld",
                              (long long)M, (long long)D);
    if (M == 0 || D == 0)
        return DUET_OK;
    return duet__rmsnorm_launch(stream, y, D, x, D, a, w, M, D, eps, NULL, 0);
}

/* ---- gated activations --------------------------------------------------------------------- */

/* Rows m = blockIdx.y, + gridDim.y, ...; a thread takes VEC adjacent columns of its row (VEC =
 * 4: float4 accesses, the launch checks alignment), so each load moves VEC values and no
 * thread divides its index by I. H16: the results go to hb[m][i] as bf16 (nearest even), gate
 * untouched. */
template <int VEC, bool H16>
__global__ void duet__act_mul_kernel(float *gate, const float *up, int64_t M, int64_t I, int64_t ld,
                                     int act, float beta, float beta_lin, __nv_bfloat16 *hb)
{
    const int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    duet_pdl_wait(); /* inputs come from earlier kernels of the step */
    duet_pdl_trigger();
    if (i >= I)
        return;
    for (int64_t m = blockIdx.y; m < M; m += gridDim.y) {
        float *gr = gate + m * ld + i;
        const float *ur = up + m * ld + i;
        float v[VEC];
        if constexpr (VEC == 4) {
            const float4 g = *reinterpret_cast<const float4 *>(gr);
            const float4 u = *reinterpret_cast<const float4 *>(ur);
            v[0] = duet_act_apply(g.x, u.x, act, beta, beta_lin);
            v[1] = duet_act_apply(g.y, u.y, act, beta, beta_lin);
            v[2] = duet_act_apply(g.z, u.z, act, beta, beta_lin);
            v[3] = duet_act_apply(g.w, u.w, act, beta, beta_lin);
        } else {
            v[0] = duet_act_apply(gr[0], ur[0], act, beta, beta_lin);
        }
        if constexpr (H16) {
#pragma unroll
            for (int k = 0; k < VEC; k++)
                hb[m * I + i + k] = __float2bfloat16_rn(v[k]);
        } else if constexpr (VEC == 4) {
            *reinterpret_cast<float4 *>(gr) = make_float4(v[0], v[1], v[2], v[3]);
        } else {
            gr[0] = v[0];
        }
    }
}

/* duet_cuda_act_mul, or with hb != NULL duet_cuda_act_mul_bf16. */
static duet_status_t duet__act_mul(cudaStream_t stream, float *gate, const float *up, int64_t M,
                                   int64_t I, int64_t ld, duet_cuda_act_t act, float beta,
                                   float beta_lin, __nv_bfloat16 *hb)
{
    if (M < 0 || I < 0 || ld < I || (M > 0 && I > 0 && (gate == NULL || up == NULL)))
        return duet_error_set(DUET_ERR_INVALID, "cuda act_mul: bad arguments M=%lld I=%lld ld=%lld",
                              (long long)M, (long long)I, (long long)ld);
    if (act != DUET_CUDA_ACT_SILU && act != DUET_CUDA_ACT_SITU)
        return duet_error_set(DUET_ERR_INVALID, "cuda act_mul: unknown activation %d", (int)act);
    if (act == DUET_CUDA_ACT_SITU && (beta == 0.0f || beta_lin == 0.0f))
        return duet_error_set(DUET_ERR_INVALID, "cuda act_mul: SiTU needs non-zero betas");
    if (M == 0 || I == 0)
        return DUET_OK;
    const int threads = 256;
    const bool vec = I % 4 == 0 && ld % 4 == 0 && (((uintptr_t)gate | (uintptr_t)up) & 15) == 0;
    const int64_t per = vec ? 4 : 1, bx = (I + threads * per - 1) / (threads * per);
    if (bx > 0x7fffffff)
        return duet_error_set(DUET_ERR_RANGE,
                              "cuda act_mul: I=%lld needs more than 2^31 - 1 blocks of a row",
                              (long long)I);
    const dim3 grid((unsigned)bx, (unsigned)(M < 65535 ? M : 65535)), b(threads);
    cudaError_t e;
    if (hb != NULL)
        e = vec ? duet_pdl_launch(duet__act_mul_kernel<4, true>, grid, b, 0, stream, gate, up, M, I,
                                  ld, (int)act, beta, beta_lin, hb)
                : duet_pdl_launch(duet__act_mul_kernel<1, true>, grid, b, 0, stream, gate, up, M, I,
                                  ld, (int)act, beta, beta_lin, hb);
    else
        e = vec ? duet_pdl_launch(duet__act_mul_kernel<4, false>, grid, b, 0, stream, gate, up, M,
                                  I, ld, (int)act, beta, beta_lin, hb)
                : duet_pdl_launch(duet__act_mul_kernel<1, false>, grid, b, 0, stream, gate, up, M,
                                  I, ld, (int)act, beta, beta_lin, hb);
    return duet__launched(e, "act_mul kernel launch");
}

extern "C" duet_status_t duet_cuda_act_mul(cudaStream_t stream, float *gate, const float *up,
                                           int64_t M, int64_t I, int64_t ld, duet_cuda_act_t act,
                                           float beta, float beta_lin)
{
    return duet__act_mul(stream, gate, up, M, I, ld, act, beta, beta_lin, NULL);
}

extern "C" duet_status_t duet_cuda_act_mul_bf16(cudaStream_t stream, void *hb, const float *gate,
                                                const float *up, int64_t M, int64_t I, int64_t ld,
                                                duet_cuda_act_t act, float beta, float beta_lin)
{
    if (M > 0 && I > 0 && hb == NULL)
        return duet_error_set(DUET_ERR_INVALID, "cuda act_mul_bf16: NULL output");
    /* gate is only read with hb; the kernel's gate is non-const for the in-place form */
    return duet__act_mul(stream, (float *)gate, up, M, I, ld, act, beta, beta_lin,
                         (__nv_bfloat16 *)hb);
}
