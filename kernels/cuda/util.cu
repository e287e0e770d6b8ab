/*
 * util.cu: the helpers of cuda_util.h.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/cuda_pdl.cuh"

#define DUET__MODULE          "cuda" /* the prefix of this file's error details */
#define DUET__TRY(call, what) DUET_CUDA_TRY(call, DUET__MODULE, what)

static unsigned duet__grid(int64_t n, int threads)
{
    int64_t b = (n + threads - 1) / threads;
    return (unsigned)(b < 65535 * 16 ? (b > 0 ? b : 1) : 65535 * 16);
}

/* splitmix64 of (seed, i): a counter-based generator, so any thread can draw element i. */
__device__ static inline float duet__hash_uniform(uint64_t seed, uint64_t i)
{
    uint64_t z = seed + 0x9e3779b97f4a7c15ull * (i + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (float)(z >> 40) * (2.0f / 16777216.0f) - 1.0f; /* 24 bits → [-1, 1) */
}

template <typename T> __device__ static inline T duet__store(float v);
template <> __device__ inline float duet__store<float>(float v)
{
    return v;
}
template <> __device__ inline __nv_bfloat16 duet__store<__nv_bfloat16>(float v)
{
    return __float2bfloat16_rn(v);
}
template <> __device__ inline __half duet__store<__half>(float v)
{
    return __float2half_rn(v);
}

template <typename T>
__global__ static void duet__fill_random_kernel(T *p, int64_t n, uint64_t seed, float scale,
                                                float offset)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        p[i] = duet__store<T>(offset + scale * duet__hash_uniform(seed, (uint64_t)i));
}

extern "C" duet_status_t duet_cuda_fill_random(cudaStream_t stream, void *p, duet_dtype_t dtype,
                                               int64_t n, uint64_t seed, float scale, float offset)
{
    if (n < 0 || (n > 0 && p == NULL))
        return duet_error_set(DUET_ERR_INVALID, "cuda fill: bad arguments");
    if (n == 0)
        return DUET_OK;
    const int th = 256;
    switch (dtype) {
    case DUET_DTYPE_F32:
        duet__fill_random_kernel<<<duet__grid(n, th), th, 0, stream>>>((float *)p, n, seed, scale,
                                                                       offset);
        break;
    case DUET_DTYPE_BF16:
        duet__fill_random_kernel<<<duet__grid(n, th), th, 0, stream>>>((__nv_bfloat16 *)p, n, seed,
                                                                       scale, offset);
        break;
    case DUET_DTYPE_F16:
        duet__fill_random_kernel<<<duet__grid(n, th), th, 0, stream>>>((__half *)p, n, seed, scale,
                                                                       offset);
        break;
    default:
        return duet_error_set(DUET_ERR_INVALID, "cuda fill: unknown dtype %d", (int)dtype);
    }
    DUET__TRY(cudaGetLastError(), "fill launch");
    return DUET_OK;
}

__global__ static void duet__gather_kernel(float *dst, const float *src, int64_t D,
                                           const int32_t *rows, int64_t n)
{
    duet_pdl_wait(); /* inputs come from earlier kernels of the step */
    duet_pdl_trigger();
    for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
        const float *s = src + (int64_t)rows[i] * D;
        float *d = dst + i * D;
        for (int64_t j = threadIdx.x; j < D; j += blockDim.x)
            d[j] = s[j];
    }
}

extern "C" duet_status_t duet_cuda_gather_rows(cudaStream_t stream, float *dst, const float *src,
                                               int64_t D, const int32_t *rows, int64_t n)
{
    if (n < 0 || D < 0)
        return duet_error_set(DUET_ERR_INVALID, "cuda gather: bad arguments");
    if (n == 0 || D == 0)
        return DUET_OK;
    DUET__TRY(duet_pdl_launch(duet__gather_kernel, dim3((unsigned)(n < 65535 ? n : 65535)),
                              dim3(256), 0, stream, dst, src, D, rows, n),
              "gather launch");
    return DUET_OK;
}

/* p[i] = F()(p[i]) for i < n, in place (the elementwise maps below). */
template <typename F> __global__ static void duet__map_kernel(float *p, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        p[i] = F()(p[i]);
}

template <typename F>
static duet_status_t duet__map(cudaStream_t stream, float *p, int64_t n, const char *what)
{
    if (n <= 0)
        return DUET_OK;
    duet__map_kernel<F><<<duet__grid(n, 256), 256, 0, stream>>>(p, n);
    DUET__TRY(cudaGetLastError(), what);
    return DUET_OK;
}

struct duet__round_bf16_op {
    __device__ float operator()(float v) const
    {
        return __bfloat162float(__float2bfloat16_rn(v));
    }
};

struct duet__neg_exp_op {
    __device__ float operator()(float v) const
    {
        return -expf(v);
    }
};

extern "C" duet_status_t duet_cuda_round_bf16(cudaStream_t stream, float *p, int64_t n)
{
    return duet__map<duet__round_bf16_op>(stream, p, n, "round_bf16 launch");
}

extern "C" duet_status_t duet_cuda_neg_exp(cudaStream_t stream, float *p, int64_t n)
{
    return duet__map<duet__neg_exp_op>(stream, p, n, "neg_exp launch");
}

extern "C" duet_status_t duet_cuda_copy_bandwidth(size_t bytes, int iters, double *bytes_per_s)
{
    void *a = NULL, *b = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    duet_status_t st = DUET_OK;
    cudaError_t ce;
    float ms = 0.0f;
    if (bytes == 0 || iters <= 0 || bytes_per_s == NULL)
        return duet_error_set(DUET_ERR_INVALID, "cuda bandwidth: bad arguments");
#define DUET__BW(call, what)                                                                       \
    do {                                                                                           \
        if ((ce = (call)) != cudaSuccess) {                                                        \
            st = duet_cuda_status(ce, DUET__MODULE, what);                                         \
            goto out;                                                                              \
        }                                                                                          \
    } while (0)
    DUET__BW(cudaMalloc(&a, bytes), "bandwidth cudaMalloc");
    DUET__BW(cudaMalloc(&b, bytes), "bandwidth cudaMalloc");
    DUET__BW(cudaMemset(a, 1, bytes), "bandwidth memset");
    DUET__BW(cudaEventCreate(&e0), "event");
    DUET__BW(cudaEventCreate(&e1), "event");
    DUET__BW(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice), "warm-up copy");
    DUET__BW(cudaEventRecord(e0, 0), "event record");
    for (int i = 0; i < iters; i++)
        DUET__BW(cudaMemcpyAsync(i % 2 ? a : b, i % 2 ? b : a, bytes, cudaMemcpyDeviceToDevice, 0),
                 "copy");
    DUET__BW(cudaEventRecord(e1, 0), "event record");
    DUET__BW(cudaEventSynchronize(e1), "event sync");
    DUET__BW(cudaEventElapsedTime(&ms, e0, e1), "elapsed");
    *bytes_per_s = 2.0 * (double)bytes * iters / ((double)ms * 1e-3);
#undef DUET__BW
out:
    if (e0 != NULL)
        cudaEventDestroy(e0);
    if (e1 != NULL)
        cudaEventDestroy(e1);
    cudaFree(a);
    cudaFree(b);
    return st;
}

/* ---- programmatic dependent launch switch (cuda_pdl.cuh) ------------------------------------ */

static int duet__pdl_forced = -1; /* -1: the default below; 0 / 1: duet_cuda_pdl_set */
static int duet__pdl_default = -1;

extern "C" int duet_cuda_pdl_enabled(void)
{
    if (duet__pdl_forced >= 0)
        return duet__pdl_forced;
    if (duet__pdl_default < 0) {
        int dev = 0, major = 0, no_pdl = -1;
        duet__pdl_default =
            !duet_cuda_env_flag(&no_pdl, "DUET_CUDA_NO_PDL") &&
            cudaGetDevice(&dev) == cudaSuccess &&
            cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
            major >= 9;
        (void)cudaGetLastError();
    }
    return duet__pdl_default;
}

extern "C" void duet_cuda_pdl_set(int on)
{
    duet__pdl_forced = on < 0 ? -1 : on != 0;
}

extern "C" int duet_cuda_env_flag(int *cache, const char *name)
{
    if (*cache < 0) {
        /* Set to anything but "" or "0": a switch written =0 must not turn itself on. */
        const char *v = getenv(name);
        *cache = v != NULL && v[0] != '\0' && strcmp(v, "0") != 0;
    }
    return *cache;
}

extern "C" int duet_cuda_weights_early(void)
{
    static int wait_first = -1;
    return !duet_cuda_env_flag(&wait_first, "DUET_CUDA_WAIT_FIRST");
}

extern "C" int duet_cuda_sm_count(void)
{
    static int counts[64]; /* per device; 0: not asked yet (racing first calls store the same) */
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
        (void)cudaGetLastError(); /* that call's own error: not a launch's */
        return 0;
    }
    if (dev >= 0 && dev < 64 && counts[dev] > 0)
        return counts[dev];
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n < 0) {
        (void)cudaGetLastError();
        return 0;
    }
    if (dev >= 0 && dev < 64)
        counts[dev] = n;
    return n;
}
