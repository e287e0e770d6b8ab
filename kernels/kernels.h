/*
 * kernels.h: what every backend's kernels share (dtypes, tensor views, the device probe) and the
 * CPU backend's instance and ops.
 *
 * kernels/ has one folder per device, and a kernel is found under the same name in both:
 *   cpu/   the CPU backend: a duet_kernels_t (a thread pool) and the ops below (matmul, norms,
 *          activations, embedding), plus the mixers' kernels in cpu/cpu_kda.h, cpu/cpu_mla.h,
 *          cpu/cpu_moe.h, which take the step's description (cpu/cpu_step.h);
 *   cuda/  the CUDA backend: extern "C" functions that take a cudaStream_t (cuda/cuda_gemm.h,
 *          cuda_ops.h, cuda_kda.h, cuda_mla.h, over cuda_step.h); there is no duet_kernels_t for
 *          it, the stream is the instance.
 * Neither folder knows models, caches or batches of sequences: the engine's backends
 * (engine/backend_cpu.c, engine/backend_cuda.c, behind engine/backend.h) drive them. Activations
 * are plain fp32 buffers on the device; weights are duet_tensor_t values that carry dtype, device
 * and shape, because checkpoints store them as F32, BF16 or F16 and the ops convert on the fly
 * (fp32 math, fp32 accumulation). Ops never allocate: scratch comes from the caller.
 *
 * The CPU backend is the reference: every CUDA kernel is tested against it.
 */
#ifndef DUET_KERNELS_H
#define DUET_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "common/comm.h"
#include "common/status.h"
#include "kernels/tune.h"

typedef enum {
    DUET_DTYPE_F32 = 0,
    DUET_DTYPE_BF16 = 1,
    DUET_DTYPE_F16 = 2,
} duet_dtype_t;

typedef enum {
    DUET_DEVICE_CPU = 0,
    DUET_DEVICE_CUDA = 1,
} duet_device_kind_t;

#define DUET_TENSOR_MAX_DIMS 4

/* A view of memory. Never owns `data`. Row-major, contiguous. */
typedef struct {
    void *data; /* not owned; on `device` */
    duet_dtype_t dtype;
    duet_device_kind_t device;
    int ndim;
    int64_t shape[DUET_TENSOR_MAX_DIMS];
} duet_tensor_t;

/* Bytes per element: 4, 2, 2. */
size_t duet_dtype_size(duet_dtype_t dt);
/* "F32", "BF16", "F16". */
const char *duet_dtype_name(duet_dtype_t dt);
/* Elements in a tensor (product of shape). */
int64_t duet_tensor_numel(const duet_tensor_t *t);

static inline float duet_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

/* Round-to-nearest-even fp32 -> bf16 (NaN stays NaN). */
static inline uint16_t duet_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float duet_f16_to_f32(uint16_t h);
uint16_t duet_f32_to_f16(float f);

/* Convert n elements of `src` (any dtype, host memory) to fp32 `dst`. */
void duet_convert_to_f32(float *dst, const void *src, duet_dtype_t dt, int64_t n);

/*
 * Number of usable CUDA devices: 0 when the CUDA backend is not built in, when no driver is
 * installed, or when no device is visible.
 */
int duet_cuda_device_count(void);

/*
 * Whether this binary can run its CUDA kernels on the current device: a device is visible and
 * the build holds code for its compute capability (CMAKE_CUDA_ARCHITECTURES, 90 by default:
 * H100 / H200, and newer GPUs through the embedded PTX). 1 if so; else 0 with the reason in
 * why (when why != NULL, cap > 0), e.g. a GPU of compute capability 8.0 under a build for 9.0.
 */
int duet_cuda_device_usable(char *why, size_t cap);

/* ---- backend instance ------------------------------------------------------------------- */

typedef struct duet_kernels duet_kernels_t;

/*
 * Create a CPU backend instance: n_threads is the size of the worker pool including the calling
 * thread (0 = the number of online CPUs, or DUET_THREADS). DUET_DEVICE_CUDA returns
 * DUET_ERR_UNSUPPORTED: the CUDA kernels have no instance of this type (they take a stream).
 */
duet_status_t duet_kernels_create(duet_device_kind_t dev, int n_threads, duet_kernels_t **k_p);
void duet_kernels_destroy(duet_kernels_t *k); /* accepts NULL */
int duet_kernels_n_threads(const duet_kernels_t *k);
duet_device_kind_t duet_kernels_device(const duet_kernels_t *k);
/* CPU backend: the matmul's instruction-set path, "avx512", "avx2" or "scalar" (benchmarks, logs).
 * Chosen at create from the CPU; DUET_KERNELS_ISA=avx2|scalar in the environment caps it. */
const char *duet_kernels_cpu_isa(const duet_kernels_t *k);

/*
 * Run fn(ctx, begin, end, thread_idx) over [0, n) split into contiguous ranges of at least
 * `grain` items across the pool (the caller's thread takes part). Returns when all ranges are
 * done. thread_idx is in [0, n_threads) and can index per-thread scratch. The mixers' kernels
 * (kernels/cpu/kda.c, mla.c) run their per-(item, head) loops on it. Must not be called from
 * inside a task.
 */
typedef void (*duet_k_task_fn)(void *ctx, int64_t begin, int64_t end, int thread_idx);
void duet_k_parallel_for(duet_kernels_t *k, int64_t n, int64_t grain, duet_k_task_fn fn, void *ctx);

/*
 * The same with one task per index (fn(ctx, i, i + 1, thread_idx)), each claimed by the next free
 * thread: for work the caller has already cut into balanced pieces (kernels/splitkv.h), where
 * grouping neighbours into ranges would put the big pieces of one request on one thread.
 */
void duet_k_parallel_each(duet_kernels_t *k, int64_t n, duet_k_task_fn fn, void *ctx);

/* ---- ops ---------------------------------------------------------------------------------- */

/*
 * y[M, N] = x[M, K] · Wᵀ, W = w tensor of shape [N, K] (any dtype), fp32 accumulation.
 * ldx / ldy are the row strides of x and y in elements (>= K, >= N). If accumulate != 0,
 * y += x · Wᵀ instead of overwrite. `w` may be a view of rows of a larger matrix.
 */
duet_status_t duet_k_matmul(duet_kernels_t *k, float *y, int64_t ldy, const float *x, int64_t ldx,
                            int64_t M, const duet_tensor_t *w, int accumulate);

/* ---- the matmul's autotuning (kernels/tune.h; issue 39) ------------------------------------- */

/*
 * Let k's matmul take each shape's tactic from t (not owned; it must outlive its use by k, and
 * not change while k runs a matmul); NULL: the default split everywhere. A shape t does not hold
 * keeps the default. Every tactic gives the same bits (matmul.c).
 */
void duet_kernels_set_tuner(duet_kernels_t *k, const duet_tune_t *t);

/* One product the tuner should know: M rows of x against weight w (a CPU tensor of shape [N, K]).
 */
typedef struct {
    int64_t m;
    const duet_tensor_t *w;
} duet_k_matmul_shape_t;

/*
 * An empty tuner for k's matmul tactics on this machine (its description: the backend, ISA path
 * and thread count, so that a file saved under another is refused). Destroy with
 * duet_tune_destroy.
 */
duet_status_t duet_k_matmul_tuner_create(const duet_kernels_t *k, duet_tune_t **t_p);

/*
 * Profile the split tactics of duet_k_matmul on k for `n` products (shapes of the same key, the
 * same dtype, N, K and M bucket, are profiled once, at the most rows given for them) and keep the
 * fastest of each in t (duet_tune_run: collective over comm, NULL = alone). Each profile is real
 * calls of the matmul on the given weights and scratch inputs, the median of several runs. Does
 * not install t (duet_kernels_set_tuner). DUET_ERR_INVALID for a bad shape, DUET_ERR_NOMEM, or
 * the comm's error.
 */
duet_status_t duet_k_matmul_tune(duet_kernels_t *k, duet_tune_t *t,
                                 const duet_k_matmul_shape_t *shapes, int64_t n, duet_comm_t *comm,
                                 duet_tune_stats_t *stats);

/* y[M, D] = w ⊙ x / sqrt(mean(x²) + eps), per row; w is [D] any dtype. y may alias x. */
void duet_k_rmsnorm(duet_kernels_t *k, float *y, const float *x, const duet_tensor_t *w, int64_t M,
                    int64_t D, float eps);

/* out[i] = SiLU(gate[i]) * up[i], i < n. out may alias gate or up. */
void duet_k_silu_mul(duet_kernels_t *k, float *out, const float *gate, const float *up, int64_t n);

/* out[i] = β·tanh(g/β)·σ(g) * β_lin·tanh(u/β_lin) (SiTU), i < n. out may alias gate or up. */
void duet_k_situ_mul(duet_kernels_t *k, float *out, const float *gate, const float *up, int64_t n,
                     float beta, float beta_lin);

/* y[i] += x[i], i < n. */
void duet_k_add(duet_kernels_t *k, float *y, const float *x, int64_t n);

/* Gather embedding rows: out[t, :] = table[ids[t], :] (table [V, D], any dtype). */
void duet_k_embed(duet_kernels_t *k, float *out, const duet_tensor_t *table, const int32_t *ids,
                  int64_t n_ids);

#endif
