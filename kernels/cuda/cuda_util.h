/*
 * cuda_util.h: small device helpers the engine's CUDA path needs beside the kernels proper:
 * deterministic random fill (weights of a benchmark model generated on the device), constant
 * fill, row gather, and the device-to-device copy bandwidth probe the roofline is built on.
 * All pointers are device pointers; calls are queued on `stream` and return a duet status.
 */
#ifndef DUET_KERNELS_CUDA_UTIL_H
#define DUET_KERNELS_CUDA_UTIL_H

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "common/status.h"
#include "kernels/kernels.h"

/* p[i] = offset + scale · u_i, u_i uniform in [-1, 1) from a counter hash of (seed, i), stored in
 * `dtype` (rounded to nearest even). The same (seed, n) gives the same values on any device. */
duet_status_t duet_cuda_fill_random(cudaStream_t stream, void *p, duet_dtype_t dtype, int64_t n,
                                    uint64_t seed, float scale, float offset);

/* dst[i][:] = src[rows[i]][:] for i < n, D floats per row (row strides D). */
duet_status_t duet_cuda_gather_rows(cudaStream_t stream, float *dst, const float *src, int64_t D,
                                    const int32_t *rows, int64_t n);

/* p[i] = (float)bf16(p[i]) for i < n, rounded to nearest even, in place: fp32 values that a
 * bf16 tensor holds exactly (random weights shaped like a checkpoint's bf16 ones). */
duet_status_t duet_cuda_round_bf16(cudaStream_t stream, float *p, int64_t n);

/* p[i] = -exp(p[i]) for i < n, fp32 in place (A_log → -A, as the CPU path prepares it). */
duet_status_t duet_cuda_neg_exp(cudaStream_t stream, float *p, int64_t n);

/*
 * Device-to-device copy bandwidth: times `iters` cudaMemcpyAsync of `bytes` (after one warm-up)
 * with CUDA events and returns bytes read + written per second in *bytes_per_s. Synchronous;
 * allocates and frees its two buffers.
 */
duet_status_t duet_cuda_copy_bandwidth(size_t bytes, int iters, double *bytes_per_s);

/*
 * Whether step kernels launch with programmatic dependent launch (cuda_pdl.cuh): on when the
 * current device is sm_90 or newer, unless DUET_CUDA_NO_PDL is set in the environment or
 * duet_cuda_pdl_set(0) was called (a test compares both ways: PDL changes no arithmetic).
 * duet_cuda_pdl_set(-1) returns to the default. Not thread-safe against concurrent launches.
 */
int duet_cuda_pdl_enabled(void);
void duet_cuda_pdl_set(int on);

/*
 * Whether the GEMV and MoE kernels issue their first weight loads before their PDL wait (the
 * contract of cuda_pdl.cuh allows reading weights there), so that round trip overlaps the
 * previous kernel: on unless DUET_CUDA_WAIT_FIRST is set (side-by-side comparisons; the
 * arithmetic is the same either way).
 */
int duet_cuda_weights_early(void);

/* The current device's SM count, asked once per device (0 when CUDA cannot tell); launch-shape
 * rules call it per launch. */
int duet_cuda_sm_count(void);

/*
 * Whether the environment variable `name` is set, read once into *cache (a static the caller
 * starts at -1; racing first calls store the same value). The switches that restore an older
 * path for side-by-side measurements (DUET_CUDA_NO_GEMV, DUET_CUDA_NO_TGEMV, ...) use it.
 */
int duet_cuda_env_flag(int *cache, const char *name);

#ifdef __cplusplus
}
#endif

#endif
