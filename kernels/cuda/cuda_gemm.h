/*
 * cuda_gemm.h: the CUDA backend's GEMM, y[M, N] (+)= x[M, K] · W[N, K]ᵀ through cuBLASLt, with the
 * same row-major meaning as duet_k_matmul on the CPU (kernels.h), which is its reference.
 *
 * Host code is C11; this header is the extern "C" boundary (docs/architecture.md, "Module layout"):
 * every call takes the cudaStream_t it is queued on and returns a duet status, with the CUDA or
 * cuBLAS error named in duet_error_last(). All pointers are device pointers.
 *
 * Precision. Activations x and outputs y are fp32 (the engine's convention); W is F32, BF16 or
 * F16. We multiply A and B of one type (our reading of cublasLtMatmul's supported type
 * combinations is that fp32 x bf16 operands are not among them; not verified against NVIDIA's
 * table), so for a BF16 or F16 W the rows of x are first rounded on the device to W's dtype
 * (round-to-nearest-even) into a staging buffer owned by the handle, then multiplied on the tensor
 * cores with fp32 accumulation (CUBLAS_COMPUTE_32F) and fp32 output. The CPU path keeps x in fp32,
 * so the two differ by the rounding of x: at most 2^-8 (bf16) or 2^-11 (f16) of Σ|x·w| per output.
 * For an F32 W nothing is converted; DUET_CUDA_GEMM_TF32 lets cuBLASLt use TF32 tensor cores
 * (CUBLAS_COMPUTE_32F_FAST_TF32, ~2^-10 relative), without it the product is full fp32.
 *
 * Small M. For M <= 2 (small decode steps; M <= 8 for F32 W) with K % 8 == 0 and 16-byte aligned x
 * rows and W, the call runs duet's own weight-streaming GEMV instead (one warp per output, W read
 * once, x kept in fp32 and never rounded, fp32 accumulation; TF32 requests go to cuBLASLt): at
 * these sizes the cost is reading W, and cuBLASLt's launch plus the x conversion cost more than
 * that for the engine's smaller matrices. DUET_CUDA_NO_GEMV=1 disables it. Launched with
 * programmatic dependent launch (cuda_pdl.cuh), the GEMV issues its first loads of W before it
 * waits for the kernels ahead of it in the stream: W must be a weight, which no kernel of the
 * stream writes (x and y may come from the previous kernel). DUET_CUDA_WAIT_FIRST (cuda_util.h)
 * makes it wait first. For 3 <= M <= 8 with BF16 W (same alignment terms) a second kernel streams W
 * into the tensor cores (mma m16n8k16, the rows of x as its n side) with x split into bf16 hi + lo
 * pairs, so x is kept to 2^-16 instead of rounded to 2^-8, and no conversion runs;
 * DUET_CUDA_NO_TGEMV=1 sends those calls to cuBLASLt (DUET_CUDA_NO_GEMV=1 sends all).
 *
 * Tactics (kernels/tune.h, op DUET_TUNE_OP_CUDA_GEMM). Every call that reaches cuBLASLt runs one
 * of the first DUET_CUDA_GEMM_TACTICS algorithms cublasLtMatmulAlgoGetHeuristic returns for its
 * key: tactic t is the t-th. Without a tuner, or when the tuner has no entry for the shape (or its
 * tactic is past the count returned for this call), algo 0, the heuristic's first choice. All
 * tactics of a shape round x the same way (above) and multiply the same operands with fp32
 * accumulation: they differ only in the order and split of the fp32 sums (tiles, split-K), so they
 * agree to fp32 summation order, within the bounds above, but not bit for bit. The small-M paths
 * are not tactics (they keep x in fp32: other numerics): a shape whose calls take them is never
 * tuned (duet_cuda_gemm_tunable). Batched calls (duet_cuda_gemm_matmul_batched) are not tuned.
 *
 * Resources are made once, at create: the cuBLASLt handle, its workspace and the staging buffer
 * for x. Per call, cuBLASLt's descriptors and heuristic algorithm are looked up in a small cache
 * keyed by shape, strides, dtype and pointer alignment, so a steady-state call does no host-side
 * setup and no allocation. A handle is not thread-safe: use one per host thread (the stream may
 * differ per call; the workspace and staging buffer are then reused in stream order only, so
 * callers alternating streams must order them).
 */
#ifndef DUET_KERNELS_CUDA_GEMM_H
#define DUET_KERNELS_CUDA_GEMM_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cuda_runtime_api.h>

/* status.h and kernels.h are C headers without their own extern "C" guards. */
#ifdef __cplusplus
extern "C" {
#endif

#include "common/status.h"
#include "kernels/kernels.h"

typedef struct duet_cuda_gemm duet_cuda_gemm_t;

/* Flags for duet_cuda_gemm_matmul. */
enum {
    DUET_CUDA_GEMM_TF32 = 1 << 0, /* F32 weights: allow TF32 tensor cores (else exact fp32) */
};

/*
 * Create a GEMM handle on the current CUDA device: a cuBLASLt handle, `workspace_bytes` of
 * cuBLASLt workspace (0 = 32 MiB, what Hopper kernels want) and a staging buffer for
 * `max_x_elems` elements of x converted to 16 bits (M * K of the largest BF16/F16 call; 0 if
 * only F32 weights will be used). DUET_ERR_DEVICE when there is no usable device.
 */
duet_status_t duet_cuda_gemm_create(size_t workspace_bytes, int64_t max_x_elems,
                                    duet_cuda_gemm_t **g_p);
/* Frees everything create made (synchronises the device first). Accepts NULL. */
void duet_cuda_gemm_destroy(duet_cuda_gemm_t *g);

/*
 * y[M, N] = x[M, K] · Wᵀ (or y += ... if accumulate != 0) on `stream`, W = w of shape [N, K]
 * (a CUDA tensor, any dtype, rows contiguous: may be a view of rows of a larger matrix). ldx and
 * ldy are the row strides of x and y in elements (>= K, >= N). For BF16/F16 W, M * K must not
 * exceed the handle's max_x_elems (DUET_ERR_RANGE). Asynchronous: returns once queued.
 */
duet_status_t duet_cuda_gemm_matmul(duet_cuda_gemm_t *g, cudaStream_t stream, float *y, int64_t ldy,
                                    const float *x, int64_t ldx, int64_t M, const duet_tensor_t *w,
                                    int accumulate, unsigned flags);

/*
 * The GEMM alone, for an x already stored in W's dtype (x: M rows of ldx elements of w->dtype):
 * what duet_cuda_gemm_matmul runs after converting x. Benchmarks use it to time cuBLASLt by
 * itself; a caller that keeps its activations in bf16 can use it directly.
 */
duet_status_t duet_cuda_gemm_matmul_lowp(duet_cuda_gemm_t *g, cudaStream_t stream, float *y,
                                         int64_t ldy, const void *x, int64_t ldx, int64_t M,
                                         const duet_tensor_t *w, int accumulate, unsigned flags);

/*
 * Several products of the same row count in one call: ops[i] is y_i (+)= x_i · W_iᵀ as
 * duet_cuda_gemm_matmul would compute it. When every op takes the small-M GEMV path (see above)
 * they run as ONE kernel launch (at most DUET_CUDA_GEMV_MAX_SEGS ops; W dtypes may differ), which
 * is what a decode step at batch 1 needs: its time is set by launches, not bytes. Otherwise each
 * op is its own call. Ops must not write what another op of the call reads.
 */
#define DUET_CUDA_GEMV_MAX_SEGS 4
typedef struct {
    float *y;
    int64_t ldy;
    const float *x;
    int64_t ldx;
    const duet_tensor_t *w;
    int accumulate;
    /* Optional (NULL: none): x already rounded to bf16 by its producer, [M][K] contiguous
     * (K = w's columns), or split by duet_cuda_gemm_split_x / duet_cuda_rmsnorm_planes (its
     * planes, [3][M][K]). A BF16 w then multiplies plane 0 (x rounded as the call would round
     * it) on cuBLASLt, and an F32 w with w_bf16 takes the split form, whatever M: x itself is
     * not read (the GEMV paths of a few rows, which would read it, are skipped). Any other
     * weight (F16, F32 without w_bf16 or with TF32 asked for) reads x as usual. */
    const void *xs;
    /* Optional (NULL: none), for an F32 w whose every value is a bf16 value: the same matrix
     * as a BF16 tensor. With xs, and TF32 not asked for, the product is w_bf16 times each
     * plane on the tensor cores with fp32 accumulation, the smallest term first: every product
     * is exact, so the result is an fp32 sum of the same products as the F32 GEMM's, in
     * another order and at the BF16 rate. Without xs the F32 weight's own paths. */
    const duet_tensor_t *w_bf16;
} duet_cuda_gemm_op_t;
duet_status_t duet_cuda_gemm_matmul_multi(duet_cuda_gemm_t *g, cudaStream_t stream, int64_t M,
                                          const duet_cuda_gemm_op_t *ops, int n_ops,
                                          unsigned flags);

/*
 * x[M, K] (rows ldx apart) as three bf16 planes at xs, [3][M][K] contiguous: x0 = bf16(x) (the
 * rounding duet_cuda_convert_from_f32 does), x1 = bf16(x − x0), x2 = bf16(x − x0 − x1), each to
 * nearest even. x = x0 + x1 + x2 exactly for |x| >= 2^-110 (below, bf16's subnormals drop bits):
 * both differences are exact in fp32 and x − x0 spans at most 16 bits. Needs K % 8 == 0, ldx % 4
 * == 0 and 16-byte aligned x and xs (DUET_ERR_INVALID otherwise). Queued on `stream`.
 */
duet_status_t duet_cuda_gemm_split_x(void *xs, const float *x, int64_t ldx, int64_t M, int64_t K,
                                     cudaStream_t stream);
/* Rows from which splitting x for an op's w_bf16 pays (DUET_CUDA_GEMM_SPLIT_ROWS=R in the
 * environment, read once, moves it; R = 0: never): below it the F32 weight's own paths cost
 * less than the split and three GEMMs. */
#define DUET_CUDA_GEMM_SPLIT_ROWS 1024
/* Whether a caller should split x of M rows and K columns for an op with w_bf16 and `flags`:
 * M reaches the rows above, K % 8 == 0 and TF32 is not asked for. */
int duet_cuda_gemm_split_pays(int64_t M, int64_t K, unsigned flags);

/*
 * RMSNorm fused in front of a multi call: norm->y[m] = RMSNorm(norm->x[m]) ⊙ norm->w for m < M,
 * then the ops, which read the normalised rows (ops[i].x == norm->y, ldx == norm->ldy, K ==
 * norm->D). When every op takes the GEMV path (and x, w, y allow 16-byte access, x and y do not
 * overlap) this is ONE launch: each warp forms RMSNorm(x) ⊙ w on the fly while it walks its
 * weight row and applies the 1/rms scale to its sum, and every block stores a share of the
 * normalised rows at norm->y for later readers, so a decode step's norm costs no launch of its
 * own. Those rows are duet_cuda_rmsnorm's per-element rounding with a scale from an fp32 sum of
 * squares (the separate kernel sums in double), so rows and products agree with normalising first
 * to a few 1e-7 relative. Otherwise duet_cuda_rmsnorm then duet_cuda_gemm_matmul_multi.
 */
typedef struct {
    const float *x; /* M rows to normalise, ldx apart */
    int64_t ldx;
    const float *w; /* [D] */
    float *y;       /* M normalised rows, ldy apart: what the ops read */
    int64_t ldy;
    int64_t D;
    float eps;
    /* Nonzero: nothing reads y after the call but its ops. Where every op multiplies the rows
     * rounded in the staging (BF16 weights on cuBLASLt), y is then not written at all. */
    int y_unread;
} duet_cuda_gemm_norm_t;
duet_status_t duet_cuda_gemm_norm_multi(duet_cuda_gemm_t *g, cudaStream_t stream, int64_t M,
                                        const duet_cuda_gemm_norm_t *norm,
                                        const duet_cuda_gemm_op_t *ops, int n_ops, unsigned flags);
/*
 * B independent GEMMs in one call: for b < B, y_b[M, N] (+)= x_b[M, K] · W_bᵀ where W = w is a
 * 3-D CUDA tensor [B][N][K], x_b starts at x + b * stride_x and y_b at y + b * stride_y (rows ldx
 * and ldy apart). The engine's per-head MLA products (q̂ = W_UK[h]ᵀ q_nope_h, o_h = W_UV[h] ·
 * latent_h) are this with B = heads. For BF16/F16 W the M rows of x are converted over
 * (B-1)·stride_x + K columns, which must fit max_x_elems.
 */
duet_status_t duet_cuda_gemm_matmul_batched(duet_cuda_gemm_t *g, cudaStream_t stream, float *y,
                                            int64_t ldy, int64_t stride_y, const float *x,
                                            int64_t ldx, int64_t stride_x, int64_t M,
                                            const duet_tensor_t *w, int accumulate, unsigned flags);

/*
 * The handle's staging buffer (where it rounds x for a 16-bit W) when it holds `elems` 16-bit
 * values, else NULL. A producer of a BF16 op's x may leave it there rounded and pass it as the
 * op's xs, saving the conversion pass; it stays valid, in stream order, until the handle's
 * next call that converts an x.
 */
void *duet_cuda_gemm_staging(duet_cuda_gemm_t *g, int64_t elems);

/* Algorithms a tuned shape may choose from: the heuristic's first results (tune.h tactics). */
#define DUET_CUDA_GEMM_TACTICS 4

typedef struct duet_tune duet_tune_t; /* kernels/tune.h */

/*
 * Use `t` (NULL = none) for every later cuBLASLt call of `g`: a plain call of M rows and weight
 * [N, K] runs tactic duet_tune_get(t, {DUET_TUNE_OP_CUDA_GEMM, W's dtype, duet_tune_m_bucket(M),
 * N, K}) when that is >= 0 and below the algorithms returned for the call's key, else algo 0. The
 * tuner is read, not owned, and must outlive its use; set it before capturing CUDA graphs (a
 * captured call keeps the algorithm it was captured with).
 */
void duet_cuda_gemm_set_tuner(duet_cuda_gemm_t *g, const duet_tune_t *t);

/*
 * Whether duet_cuda_gemm_matmul of M rows of K columns against a `dtype` weight, with 16-byte
 * aligned contiguous operands and `flags`, goes to cuBLASLt (1) rather than a small-M GEMV (0):
 * the shapes that have tactics. Follows DUET_CUDA_NO_GEMV / DUET_CUDA_NO_TGEMV.
 */
int duet_cuda_gemm_tunable(duet_dtype_t dtype, int64_t M, int64_t K, unsigned flags);

/*
 * Time tactic `tactic` of the shape (dtype, M, N, K) with `flags`: `reps` cuBLASLt calls, after
 * one untimed call, between two CUDA events on `stream`, on contiguous 256-byte aligned operands
 * (x already in `dtype`: the conversion is the same for every tactic and is not timed) that the
 * handle allocates on first use, grows when a larger shape needs it and frees at destroy.
 * *seconds = the mean seconds of one call. Synchronises `stream`. A tactic past the count the
 * heuristic returned for the shape gives DUET_ERR_RANGE and *seconds = NaN (unusable, as
 * duet_tune_profile_fn wants). The engine's calls may differ from this form in their exact row
 * count (a bucket is profiled at one M), strides and pointer alignment, which cuBLASLt's
 * heuristic also sees: the chosen index then names that call's own t-th algorithm (still
 * correct, maybe not the fastest). Not for use during capture.
 */
duet_status_t duet_cuda_gemm_profile(duet_cuda_gemm_t *g, cudaStream_t stream, duet_dtype_t dtype,
                                     int64_t M, int64_t N, int64_t K, unsigned flags, int tactic,
                                     int reps, double *seconds);

/* Free the operands duet_cuda_gemm_profile allocated (after tuning; a later profile makes them
 * again). Synchronises the device. */
void duet_cuda_gemm_profile_free(duet_cuda_gemm_t *g);

/* Test hook: how many split-form products (duet_cuda_gemm_op_t's w_bf16) this process has
 * queued, on any handle. */
int64_t duet_cuda_gemm_split_count(void);

/* Test hook: the algorithm index (0 .. DUET_CUDA_GEMM_TACTICS - 1) the last cuBLASLt call of `g`
 * ran (profiling excluded), -1 before any. */
int duet_cuda_gemm_last_algo(const duet_cuda_gemm_t *g);

/*
 * dst[m, k] = (dtype) src[m * ld_src + k] for m < M, k < K, dst contiguous [M, K] in `dtype`
 * (BF16 or F16, round-to-nearest-even; F32 is a strided copy). Queued on `stream`.
 */
duet_status_t duet_cuda_convert_from_f32(void *dst, duet_dtype_t dtype, const float *src,
                                         int64_t ld_src, int64_t M, int64_t K, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
