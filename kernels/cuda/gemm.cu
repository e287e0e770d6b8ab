/*
 * gemm.cu: duet_cuda_gemm_*, the cuBLASLt GEMM behind cuda_gemm.h (read that header for the
 * contract and the precision choices).
 *
 * Layout. duet's matrices are row-major; cuBLASLt's are column-major. A row-major [R, C] matrix
 * with row stride ld is, byte for byte, a column-major [C, R] matrix with leading dimension ld.
 * So the row-major product y[M, N] = x[M, K] · W[N, K]ᵀ is, in column-major terms,
 *     yᶜ[N, M] = Wᶜ[K, N]ᵀ · xᶜ[K, M]
 * i.e. cuBLASLt's D = op(A) · op(B) with A = W (K×N, lda = K, op = T), B = x (K×M, ldb = ldx,
 * op = N), C = D = y (N×M, ldc = ldy), m = N, n = M, k = K. This "TN" form is also the layout
 * cuBLASLt's Hopper kernels prefer. accumulate is β = 1 with C = D = y (cuBLASLt reads C before
 * it writes D element by element, which it supports in place), else β = 0.
 *
 * Algorithm cache. Building the descriptors and running the heuristic costs tens of
 * microseconds of host time, as much as a decode-sized GEMM. Each distinct (dtype, compute type,
 * M, N, K, ldx, ldy, pointer alignments) gets one entry holding its descriptors and the
 * heuristic's first DUET_CUDA_GEMM_TACTICS choices (the first is the default; a tuner may pick
 * another, see "Tactics" in cuda_gemm.h); the cache is a small array searched linearly (a
 * forward pass has a few dozen shapes) and evicts round-robin when full. α/β are not part of
 * the key: the heuristic does not see them. Pointer alignments are: cuBLASLt assumes 256-byte
 * aligned operands unless told otherwise, and a weight view into a larger matrix or an offset row
 * of y may be less aligned, so the alignment of each pointer (capped at 256) is passed as a
 * preference and keyed on.
 */
#include <math.h>
#include <stdlib.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cublasLt.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_cvt.cuh"
#include "kernels/cuda/cuda_gemm.h"
#include "kernels/cuda/cuda_mma.cuh"
#include "kernels/cuda/cuda_norm.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_pdl.cuh"
#include "kernels/tune.h"

#define DUET__MODULE          "cuda gemm" /* the prefix of this file's error details */
#define DUET__TRY(call, what) DUET_CUDA_TRY(call, DUET__MODULE, what)

#define DUET_CUDA_GEMM_CACHE    64
#define DUET_CUDA_GEMM_WS_BYTES ((size_t)32 << 20)

typedef struct {
    int valid;
    /* key */
    duet_dtype_t dtype;
    cublasComputeType_t compute;
    int64_t M, N, K, ldx, ldy;
    int32_t batch;                        /* 1 = a plain GEMM */
    int64_t stride_w, stride_x, stride_y; /* element offsets between batch entries */
    unsigned align_a, align_b, align_c;
    /* value: owned by the entry, destroyed on eviction or at handle destroy */
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, lc;                 /* A = W, B = x, C = D = y */
    cublasLtMatmulAlgo_t algo[DUET_CUDA_GEMM_TACTICS]; /* the heuristic's results, best first */
    int n_algo;                                        /* 1 .. DUET_CUDA_GEMM_TACTICS */
} duet__gemm_entry_t;

struct duet_cuda_gemm {
    cublasLtHandle_t lt;
    void *workspace; /* device, owned, ws_bytes */
    size_t ws_bytes;
    void *stage; /* device, owned, stage_elems 16-bit elements of x */
    int64_t stage_elems;
    duet__gemm_entry_t cache[DUET_CUDA_GEMM_CACHE];
    int next_evict;           /* round-robin victim when the cache is full */
    const duet_tune_t *tuner; /* chosen algorithms per shape (NULL: algo 0 always) */
    int last_algo;            /* the algorithm index of the last cuBLASLt call (test hook) */
    /* duet_cuda_gemm_profile's operands, grown on demand (device, owned) */
    void *prof_x, *prof_w;
    float *prof_y;
    size_t prof_x_bytes, prof_w_bytes, prof_y_bytes;
    cudaEvent_t prof_ev[2];
};

/* ---- errors ------------------------------------------------------------------------------- */

static duet_status_t duet__lt_fail(cublasStatus_t s, const char *what)
{
    duet_status_t st = DUET_ERR_DEVICE;
    if (s == CUBLAS_STATUS_ALLOC_FAILED)
        st = DUET_ERR_NOMEM;
    else if (s == CUBLAS_STATUS_NOT_SUPPORTED || s == CUBLAS_STATUS_ARCH_MISMATCH)
        st = DUET_ERR_UNSUPPORTED;
    else if (s == CUBLAS_STATUS_INVALID_VALUE)
        st = DUET_ERR_INVALID;
    return duet_error_set(st, "cuda gemm: %s: cuBLASLt %s (%d)", what, cublasLtGetStatusString(s),
                          (int)s);
}

#ifndef DUET_CONVERT8
#define DUET_CONVERT8 1
#endif

/* ---- x conversion ------------------------------------------------------------------------- */

template <typename T> __device__ T duet__from_f32(float v);
template <> __device__ __nv_bfloat16 duet__from_f32<__nv_bfloat16>(float v)
{
    return __float2bfloat16_rn(v);
}
template <> __device__ __half duet__from_f32<__half>(float v)
{
    return __float2half_rn(v);
}
template <> __device__ float duet__from_f32<float>(float v)
{
    return v;
}

/* One thread per element; blocks tile K along x and rows along y (grid-strided past 65535). */
template <typename T>
__global__ void duet__convert_kernel(T *dst, const float *src, int64_t ld_src, int64_t M, int64_t K)
{
    int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    duet_pdl_wait(); /* src, and the staging buffer the previous GEMM read */
    duet_pdl_trigger();
    if (k >= K)
        return;
    for (int64_t m = blockIdx.y; m < M; m += gridDim.y)
        dst[m * K + k] = duet__from_f32<T>(src[m * ld_src + k]);
}

/*
 * The same for 16-bit T with K, ld_src and both pointers multiples of 8 elements / 16 bytes:
 * each thread takes 8 consecutive elements of a row (two float4 loads, one 16-byte store),
 * grid-strided over all M · K / 8 of them; every element is rounded by the same duet__from_f32.
 * One element per thread spread each row over K / 256 blocks that each moved a kilobyte, at a
 * fraction of the copy rate; this form takes about 4% off a prefill (bench/RESULTS.md, "fp32 →
 * 16-bit conversion, 8 elements per thread"). -DDUET_CONVERT8=0 builds only the one-element form.
 */
template <typename T>
__global__ void duet__convert8_kernel(T *dst, const float *src, int64_t ld_src, int64_t M,
                                      int64_t K8)
{
    static_assert(sizeof(T) == 2, "16-bit destinations");
    duet_pdl_wait(); /* src, and the staging buffer the previous GEMM read */
    duet_pdl_trigger();
    const int64_t n = M * K8, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const int64_t m = i / K8, k = (i - m * K8) * 8;
        const float4 a = *reinterpret_cast<const float4 *>(src + m * ld_src + k);
        const float4 b = *reinterpret_cast<const float4 *>(src + m * ld_src + k + 4);
        union {
            T h[8];
            uint4 u;
        } o;
        o.h[0] = duet__from_f32<T>(a.x), o.h[1] = duet__from_f32<T>(a.y);
        o.h[2] = duet__from_f32<T>(a.z), o.h[3] = duet__from_f32<T>(a.w);
        o.h[4] = duet__from_f32<T>(b.x), o.h[5] = duet__from_f32<T>(b.y);
        o.h[6] = duet__from_f32<T>(b.z), o.h[7] = duet__from_f32<T>(b.w);
        *reinterpret_cast<uint4 *>(dst + m * K8 * 8 + k) = o.u;
    }
}

/* duet_cuda_gemm_split_x's kernel: plane t of xs gets term t (cuda_gemm.h says why the three
 * sum to x exactly). Same access pattern as duet__convert8_kernel, whose value plane 0 is. */
__global__ void duet__split3_kernel(__nv_bfloat16 *xs, const float *x, int64_t ldx, int64_t M,
                                    int64_t K8)
{
    duet_pdl_wait(); /* x, and the planes the previous GEMM read */
    duet_pdl_trigger();
    const int64_t n = M * K8, stride = (int64_t)gridDim.x * blockDim.x, plane = n * 8;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const int64_t m = i / K8, k = (i - m * K8) * 8;
        const float4 a = *reinterpret_cast<const float4 *>(x + m * ldx + k);
        const float4 b = *reinterpret_cast<const float4 *>(x + m * ldx + k + 4);
        const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        union {
            __nv_bfloat16 h[8];
            uint4 u;
        } o[3];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            __nv_bfloat16 h[3];
            duet_bf16_split<3>(v[j], h);
            o[0].h[j] = h[0], o[1].h[j] = h[1], o[2].h[j] = h[2];
        }
#pragma unroll
        for (int t = 0; t < 3; t++)
            *reinterpret_cast<uint4 *>(xs + t * plane + i * 8) = o[t].u;
    }
}

extern "C" duet_status_t duet_cuda_gemm_split_x(void *xs, const float *x, int64_t ldx, int64_t M,
                                                int64_t K, cudaStream_t stream)
{
    if (M < 0 || K < 0 || ldx < K || K % 8 != 0 || ldx % 4 != 0 ||
        (M > 0 && K > 0 &&
         (xs == NULL || x == NULL || ((uintptr_t)xs & 15u) || ((uintptr_t)x & 15u))))
        return duet_error_set(DUET_ERR_INVALID,
                              "cuda gemm split_x: M=%lld K=%lld ldx=%lld (K and ldx multiples of "
                              "8 and 4, 16-byte aligned x and xs)",
                              (long long)M, (long long)K, (long long)ldx);
    if (M == 0 || K == 0)
        return DUET_OK;
    const int64_t n = M * (K / 8), per_block = 256;
    const int sms = duet_cuda_sm_count();
    int64_t blocks = (n + per_block - 1) / per_block, cap = (int64_t)(sms > 0 ? sms : 16) * 8;
    blocks = blocks < cap ? blocks : cap;
    DUET__TRY(duet_pdl_launch(duet__split3_kernel, dim3((unsigned)blocks),
                              dim3((unsigned)per_block), 0, stream, (__nv_bfloat16 *)xs, x, ldx, M,
                              K / 8),
              "split kernel launch");
    return DUET_OK;
}

extern "C" duet_status_t duet_cuda_convert_from_f32(void *dst, duet_dtype_t dtype, const float *src,
                                                    int64_t ld_src, int64_t M, int64_t K,
                                                    cudaStream_t stream)
{
    if (M < 0 || K < 0 || ld_src < K || (M > 0 && K > 0 && (dst == NULL || src == NULL)))
        return duet_error_set(DUET_ERR_INVALID, "cuda convert: bad shape M=%lld K=%lld ld=%lld",
                              (long long)M, (long long)K, (long long)ld_src);
    if (M == 0 || K == 0)
        return DUET_OK;
    if ((dtype == DUET_DTYPE_BF16 || dtype == DUET_DTYPE_F16) && K % 8 == 0 && ld_src % 4 == 0 &&
        (uintptr_t)src % 16 == 0 && (uintptr_t)dst % 16 == 0 && DUET_CONVERT8) {
        const int64_t n = M * (K / 8), per_block = 256;
        const int sms = duet_cuda_sm_count();
        int64_t blocks = (n + per_block - 1) / per_block, cap = (int64_t)(sms > 0 ? sms : 16) * 8;
        blocks = blocks < cap ? blocks : cap;
        cudaError_t e = dtype == DUET_DTYPE_BF16
                            ? duet_pdl_launch(duet__convert8_kernel<__nv_bfloat16>,
                                              dim3((unsigned)blocks), dim3((unsigned)per_block), 0,
                                              stream, (__nv_bfloat16 *)dst, src, ld_src, M, K / 8)
                            : duet_pdl_launch(duet__convert8_kernel<__half>, dim3((unsigned)blocks),
                                              dim3((unsigned)per_block), 0, stream, (__half *)dst,
                                              src, ld_src, M, K / 8);
        DUET__TRY(e, "convert kernel launch");
        return DUET_OK;
    }
    const int threads = 256;
    dim3 grid((unsigned)((K + threads - 1) / threads), (unsigned)(M < 65535 ? M : 65535));
    cudaError_t e;
    switch (dtype) {
    case DUET_DTYPE_BF16:
        e = duet_pdl_launch(duet__convert_kernel<__nv_bfloat16>, grid, dim3(threads), 0, stream,
                            (__nv_bfloat16 *)dst, src, ld_src, M, K);
        break;
    case DUET_DTYPE_F16:
        e = duet_pdl_launch(duet__convert_kernel<__half>, grid, dim3(threads), 0, stream,
                            (__half *)dst, src, ld_src, M, K);
        break;
    case DUET_DTYPE_F32:
        e = duet_pdl_launch(duet__convert_kernel<float>, grid, dim3(threads), 0, stream,
                            (float *)dst, src, ld_src, M, K);
        break;
    default:
        return duet_error_set(DUET_ERR_INVALID, "cuda convert: unknown dtype %d", (int)dtype);
    }
    DUET__TRY(e, "convert kernel launch");
    return DUET_OK;
}

/* ---- small-M path: a weight-streaming GEMV ------------------------------------------------ */

/*
 * For M <= 2 rows (small decode steps) the product is bound by reading W once, and cuBLASLt's
 * kernels plus the x conversion launch cost more than the read itself for the engine's smaller
 * matrices. This kernel gives each warp 1, 2 or 4 output rows (duet__gemv_run picks): lanes stream
 * W's rows in 16-byte pieces (8 bf16 / f16 values, or 2 x 4 fp32), multiply with every x row
 * (fp32, from L1/L2: x is small) and reduce with shuffles; W is read exactly once, x is never
 * rounded (so it is at least as accurate as the converted path). Each warp reads every x row from
 * L1 per 16-byte piece of W, so the cost grows with M: at batch 8 it lost to cuBLASLt, hence the
 * cap at 2 (3 to 8 rows of BF16 weights take the tensor-core GEMV below). F32 weights take it up
 * to 8 rows, where cuBLASLt has only a SIMT sgemm (bench/RESULTS.md, "GEMV: up to 2 rows, 8 for
 * F32 weights"). Used when K % 8 == 0 and x, ldx and W allow 16-byte loads; otherwise cuBLASLt.
 * The fused norm (duet_cuda_gemm_norm_multi) stays at 2 rows.
 */
#define DUET_GEMV_MAX_M 2
#ifndef DUET_GEMV_MAX_M_F32
#define DUET_GEMV_MAX_M_F32 8 /* F32 weights: up to 8 rows (see above) */
#endif
#define DUET_GEMV_WARPS 8

/* One matrix of a (multi-)GEMV launch: y[m][n] (+)= Σ_k W[n][k] x[m][k], blocks [b0, b0 + nb). */
typedef struct {
    float *y;
    const float *x;
    const void *w;
    int64_t ldy, ldx, N, K;
    int dtype; /* duet_dtype_t */
    int accumulate;
    unsigned b0;
    /* a batch of B same-shape products (B = 1: one matrix): entry b reads W + b·N·K, x + b·sx
     * and writes y + b·sy; each entry has nb blocks */
    int64_t sx, sy;
    unsigned B, nb;
} duet__gemv_seg_t;

typedef struct {
    duet__gemv_seg_t seg[DUET_CUDA_GEMV_MAX_SEGS];
    int n;
    /* Fused RMSNorm (nx != NULL, duet_cuda_gemm_norm_multi): every segment reads x = RMSNorm(nx)
     * ⊙ nw (K == D), formed on the fly (duet__gemv_rows); each block also stores a share of the
     * normalised rows at ny for later kernels. */
    const float *nx, *nw;
    float *ny;
    int64_t ldnx, ldny, D;
    float eps;
    int wait_first; /* wait for x before the first weight loads (duet_cuda_weights_early) */
} duet__gemv_args_t;

/* What a GEMV forms before its products: nothing, or x as the fused RMSNorm (NORM; see
 * duet__gemv_rows). */
enum { DUET__PRO_NONE, DUET__PRO_NORM };

/* Eight weights as loaded (one 16-byte piece for 16-bit types, two for fp32; around L1, see
 * duet_ld_weight16), converted later: loads of several pieces can be in flight before the first
 * is used. */
template <typename WT> struct duet__wraw {
    uint4 v;
    __device__ inline void load(const WT *p)
    {
        v = duet_ld_weight16(p);
    }
    __device__ inline void zero(void)
    {
        v = make_uint4(0, 0, 0, 0);
    }
    __device__ inline void cvt(float *f) const;
};
template <> __device__ inline void duet__wraw<__nv_bfloat16>::cvt(float *f) const
{
    duet_cvt8_bf16(v, f);
}
template <> __device__ inline void duet__wraw<__half>::cvt(float *f) const
{
    duet_cvt8_f16(v, f);
}
template <> struct duet__wraw<float> {
    float4 a, b;
    __device__ inline void load(const float *p)
    {
        const uint4 u = duet_ld_weight16(p), w = duet_ld_weight16(p + 4);
        a = make_float4(__uint_as_float(u.x), __uint_as_float(u.y), __uint_as_float(u.z),
                        __uint_as_float(u.w));
        b = make_float4(__uint_as_float(w.x), __uint_as_float(w.y), __uint_as_float(w.z),
                        __uint_as_float(w.w));
    }
    __device__ inline void zero(void)
    {
        a = b = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    __device__ inline void cvt(float *f) const
    {
        f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w;
        f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
    }
};

/* Block blockIdx.x's share of normalised row m (x: its source row, K = D floats, 16-byte
 * aligned like ny's rows) at ny: float4 pieces, a lane's loads before its stores. */
__device__ static inline void duet__gemv_store_norm(const duet__gemv_args_t &args, int m, int64_t K,
                                                    const float *x, float scale, int lane)
{
    const int64_t q4 = K / 4, per = (q4 + gridDim.x - 1) / gridDim.x;
    const int64_t i0 = (int64_t)blockIdx.x * per, i1 = min(q4, i0 + per);
    const float4 *x4 = (const float4 *)x, *w4 = (const float4 *)args.nw;
    float4 *y4 = (float4 *)(args.ny + m * args.ldny);
    for (int64_t i = i0 + lane; i < i1; i += 64) {
        const bool two = i + 32 < i1;
        const float4 a = x4[i], g = w4[i];
        float4 b = a, h = g;
        if (two) {
            b = x4[i + 32];
            h = w4[i + 32];
        }
        y4[i] = make_float4(duet_rms_apply(g.x, a.x, scale), duet_rms_apply(g.y, a.y, scale),
                            duet_rms_apply(g.z, a.z, scale), duet_rms_apply(g.w, a.w, scale));
        if (two)
            y4[i + 32] =
                make_float4(duet_rms_apply(h.x, b.x, scale), duet_rms_apply(h.y, b.y, scale),
                            duet_rms_apply(h.z, b.z, scale), duet_rms_apply(h.w, b.w, scale));
    }
}

/*
 * R consecutive outputs n0.. of a segment (one warp): y[m][n] (+)= Σ_k W[n][k]·x[m][k] for m < M.
 * Lane l takes the 8-element pieces l, l + 32, ... of every row, U pieces of each of the R rows
 * in flight at once; each piece of x (and of the norm weight) is read once for the R rows.
 * Rows past N repeat row N - 1 and are not stored. Every output's sum runs over the same pieces
 * in the same order whatever R and U are, so they do not change a bit of the result.
 *
 * With NORM (duet_cuda_gemm_norm_multi) x is RMSNorm(nx) ⊙ nw, computed without a pass of its
 * own: every warp already walks its rows over all K = D columns, so it multiplies W with nx ⊙ nw
 * and sums nx² on the way, then scales its dot products by 1/sqrt(Σ/D + eps) at the end: no
 * shared memory, no block barrier, no prologue latency. The sum is fp32 (~1e-7 relative over a
 * few thousand squares): in double, its conversions in every warp made the fused projection
 * far slower than the plain one (bench/RESULTS.md, "Fused norm: sum of squares in fp32").
 * Warp 0 of every block (which always has outputs: a block exists for its first row) also
 * stores its share of the normalised rows, w·(x·scale) as duet_cuda_rmsnorm rounds them, for
 * later kernels (duet__gemv_store_norm). The product differs from normalising first by the rounding
 * of one multiplication per term (the scale is applied to the sum instead of to each x).
 */
template <typename WT, int MR, int PRO, int R, int U>
__device__ static inline void duet__gemv_rows(const duet__gemv_args_t &args,
                                              const duet__gemv_seg_t &sg, int M, int64_t n0,
                                              int lane)
{
    constexpr bool NORM = PRO == DUET__PRO_NORM;
    const WT *wr[R];
#pragma unroll
    for (int r = 0; r < R; r++)
        wr[r] = (const WT *)sg.w + (n0 + r < sg.N ? n0 + r : sg.N - 1) * sg.K;
    const float *x = NORM ? args.nx : sg.x;
    const int64_t ldx = NORM ? args.ldnx : sg.ldx;
    float acc[R][MR], ss[MR];
#pragma unroll
    for (int m = 0; m < MR; m++) {
        ss[m] = 0.0f;
#pragma unroll
        for (int r = 0; r < R; r++)
            acc[r][m] = 0.0f;
    }
    bool waited = args.wait_first != 0;
    if (waited) {
        duet_pdl_wait();
        duet_pdl_trigger();
    }
    for (int64_t k0 = (int64_t)lane * 8; k0 < sg.K; k0 += 256 * U) {
        duet__wraw<WT> wv[U][R];
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (k0 + 256 * u < sg.K)
                    wv[u][r].load(wr[r] + k0 + 256 * u);
                else
                    wv[u][r].zero();
            }
        if (!waited) { /* the first pieces are in flight: now wait for x (see the kernel) */
            duet_pdl_wait();
            duet_pdl_trigger();
            waited = true;
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t k = k0 + 256 * u;
            if (k >= sg.K)
                break;
            float4 g0, g1;
            if (NORM) {
                g0 = *(const float4 *)(args.nw + k);
                g1 = *(const float4 *)(args.nw + k + 4);
            }
#pragma unroll
            for (int m = 0; m < MR; m++) {
                if (m < M) {
                    float4 a = *(const float4 *)(x + m * ldx + k);
                    float4 b = *(const float4 *)(x + m * ldx + k + 4);
                    if (NORM) {
                        ss[m] += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w + b.x * b.x +
                                 b.y * b.y + b.z * b.z + b.w * b.w;
                        a = make_float4(a.x * g0.x, a.y * g0.y, a.z * g0.z, a.w * g0.w);
                        b = make_float4(b.x * g1.x, b.y * g1.y, b.z * g1.z, b.w * g1.w);
                    }
#pragma unroll
                    for (int r = 0; r < R; r++) {
                        float wf[8];
                        wv[u][r].cvt(wf);
                        acc[r][m] += wf[0] * a.x + wf[1] * a.y + wf[2] * a.z + wf[3] * a.w +
                                     wf[4] * b.x + wf[5] * b.y + wf[6] * b.z + wf[7] * b.w;
                    }
                }
            }
        }
    }
    if (!waited) { /* a lane with no piece of the row */
        duet_pdl_wait();
        duet_pdl_trigger();
    }
#pragma unroll
    for (int m = 0; m < MR; m++) {
        float scale = 1.0f;
        if (NORM) {
            float q = ss[m];
#pragma unroll
            for (int off = 16; off > 0; off >>= 1)
                q += __shfl_xor_sync(0xffffffffu, q, off);
            scale = duet_rms_scale((double)q, (double)sg.K, args.eps);
            if (threadIdx.x < 32 && m < M) /* warp 0 of every block has outputs: see above */
                duet__gemv_store_norm(args, m, sg.K, x + m * ldx, scale, lane);
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
            float v = acc[r][m];
#pragma unroll
            for (int off = 16; off > 0; off >>= 1)
                v += __shfl_xor_sync(0xffffffffu, v, off);
            acc[r][m] = NORM ? v * scale : v;
        }
    }
    if (lane == 0)
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int m = 0; m < MR; m++)
                if (m < M && n0 + r < sg.N) {
                    float *yp = sg.y + m * sg.ldy + n0 + r;
                    *yp = sg.accumulate ? *yp + acc[r][m] : acc[r][m];
                }
}

/* One output block of a segment whose weights are of type WT: NORM or not. */
template <typename WT, int MR, int R, int U>
__device__ static inline void duet__gemv_pro(const duet__gemv_args_t &args,
                                             const duet__gemv_seg_t &sg, int M, int64_t n0,
                                             int lane)
{
    if (args.nx != NULL)
        duet__gemv_rows<WT, MR, DUET__PRO_NORM, R, U>(args, sg, M, n0, lane);
    else
        duet__gemv_rows<WT, MR, DUET__PRO_NONE, R, U>(args, sg, M, n0, lane);
}

#define DUET__GEMV_ANY_DT (-1) /* segments of different weight types in one launch */

/* The segment holding launch unit u (a block of the GEMV, a 16-row tile of the tensor-core
 * GEMV: seg.b0 and seg.nb count those units), its pointers moved to u's batch entry; j is u's
 * index within that entry. */
__device__ static __forceinline__ duet__gemv_seg_t duet__gemv_seg_of(const duet__gemv_args_t &args,
                                                                     unsigned u, unsigned &j)
{
    int si = 0;
    while (si + 1 < args.n && u >= args.seg[si + 1].b0)
        si++;
    duet__gemv_seg_t sg = args.seg[si];
    const unsigned local = u - sg.b0, b = local / sg.nb;
    j = local % sg.nb;
    if (b > 0) {
        const size_t es = sg.dtype == DUET_DTYPE_F32 ? 4 : 2;
        sg.w = (const uint8_t *)sg.w + (size_t)b * (size_t)(sg.N * sg.K) * es;
        sg.x += (int64_t)b * sg.sx;
        sg.y += (int64_t)b * sg.sy;
    }
    return sg;
}

/*
 * Blocks of DUET_GEMV_WARPS warps, R outputs per warp (sg.nb blocks per product). DT is the
 * weight type of every segment, or DUET__GEMV_ANY_DT (each segment's own, picked per block):
 * a kernel per type holds only that type's registers (fp32 pieces take twice as many).
 */
template <int MR, int DT, int R, int U>
__global__ void __launch_bounds__(32 * DUET_GEMV_WARPS)
    duet__gemv_kernel(const __grid_constant__ duet__gemv_args_t args, int M)
{
    unsigned j;
    const duet__gemv_seg_t sg = duet__gemv_seg_of(args, blockIdx.x, j);
    const int lane = threadIdx.x & 31;
    const int64_t n0 = ((int64_t)j * DUET_GEMV_WARPS + (threadIdx.x >> 5)) * R;
    /* x (and y when accumulating) come from earlier kernels: duet__gemv_rows waits for them
     * once its first weight pieces are in flight (weights are what the PDL contract lets a
     * kernel read before its wait), so that round trip overlaps the predecessor's tail. */
    if (n0 >= sg.N) {
        duet_pdl_wait();
        duet_pdl_trigger();
        return;
    }
    const int dt = DT == DUET__GEMV_ANY_DT ? sg.dtype : DT;
    if (dt == DUET_DTYPE_BF16)
        duet__gemv_pro<__nv_bfloat16, MR, R, U>(args, sg, M, n0, lane);
    else if (dt == DUET_DTYPE_F16)
        duet__gemv_pro<__half, MR, R, U>(args, sg, M, n0, lane);
    else
        duet__gemv_pro<float, MR, R, U>(args, sg, M, n0, lane);
}

/* Lay the segments out in launch units of `rows` rows of W (a GEMV block, a tensor-core tile):
 * each one's first unit b0 and units per batch entry nb (B = 0 counts as one entry); the total. */
static unsigned duet__gemv_layout(duet__gemv_args_t *args, int64_t rows)
{
    unsigned units = 0;
    for (int i = 0; i < args->n; i++) {
        duet__gemv_seg_t *sg = &args->seg[i];
        if (sg->B == 0)
            sg->B = 1;
        sg->b0 = units;
        sg->nb = (unsigned)((sg->N + rows - 1) / rows);
        units += sg->nb * sg->B;
    }
    return units;
}

template <int DT, int R, int U>
static cudaError_t duet__gemv_launch(cudaStream_t stream, int64_t M, duet__gemv_args_t *args)
{
    const unsigned blocks = duet__gemv_layout(args, DUET_GEMV_WARPS * R);
    if (M == 1)
        return duet_pdl_launch(duet__gemv_kernel<1, DT, R, U>, dim3(blocks),
                               dim3(32 * DUET_GEMV_WARPS), 0, stream, *args, 1);
    if (M > DUET_GEMV_MAX_M) { /* F32 weights only (duet__gemv_fits) */
        if constexpr (DT == DUET_DTYPE_F32)
            return duet_pdl_launch(duet__gemv_kernel<DUET_GEMV_MAX_M_F32, DT, R, U>, dim3(blocks),
                                   dim3(32 * DUET_GEMV_WARPS), 0, stream, *args, (int)M);
        return cudaErrorInvalidValue;
    }
    return duet_pdl_launch(duet__gemv_kernel<DUET_GEMV_MAX_M, DT, R, U>, dim3(blocks),
                           dim3(32 * DUET_GEMV_WARPS), 0, stream, *args, (int)M);
}

/* The weight type of every segment, or DUET__GEMV_ANY_DT when they differ. */
static int duet__gemv_dt(const duet__gemv_args_t *args)
{
    int dt = args->seg[0].dtype;
    for (int i = 1; i < args->n; i++)
        if (args->seg[i].dtype != dt)
            dt = DUET__GEMV_ANY_DT;
    return dt;
}

template <int R, int U>
static cudaError_t duet__gemv_launch_r(cudaStream_t stream, int64_t M, duet__gemv_args_t *args)
{
    switch (duet__gemv_dt(args)) {
    case DUET_DTYPE_BF16:
        return duet__gemv_launch<DUET_DTYPE_BF16, R, U>(stream, M, args);
    case DUET_DTYPE_F16:
        return duet__gemv_launch<DUET_DTYPE_F16, R, U>(stream, M, args);
    case DUET_DTYPE_F32:
        return duet__gemv_launch<DUET_DTYPE_F32, R, U>(stream, M, args);
    default:
        return duet__gemv_launch<DUET__GEMV_ANY_DT, R, U>(stream, M, args);
    }
}

/*
 * Whether the 4-outputs-per-warp kernel's blocks for these segments fill at least 95% of one wave
 * of the current device (its SMs × the blocks of that kernel that fit on one; at batch 1 with
 * 16-bit weights its 80 registers allow 3). Below that, 2 per warp (64 registers, 4 blocks per
 * SM, twice the blocks) keeps more of the GPU busy. The occupancy is asked once per kernel, the
 * SM count once per device (duet_cuda_sm_count).
 * DUET_CUDA_GEMV_NO_WAVE=1 in the environment (read once; side-by-side runs) answers yes always.
 */
template <int MR, int DT> static int duet__gemv_r4_per_sm(void)
{
    static int per_sm = 0; /* racing first calls store the same value */
    if (per_sm == 0) {
        int n = 0;
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, duet__gemv_kernel<MR, DT, 4, 2>,
                                                          32 * DUET_GEMV_WARPS, 0) != cudaSuccess) {
            (void)cudaGetLastError(); /* that call's own error: not a launch's */
            n = 0;
        }
        per_sm = n > 0 ? n : -1;
    }
    return per_sm;
}

template <int DT> static int duet__gemv_r4_per_sm_m(int64_t M)
{
    if constexpr (DT == DUET_DTYPE_F32)
        if (M > DUET_GEMV_MAX_M)
            return duet__gemv_r4_per_sm<DUET_GEMV_MAX_M_F32, DT>();
    return M == 1 ? duet__gemv_r4_per_sm<1, DT>() : duet__gemv_r4_per_sm<DUET_GEMV_MAX_M, DT>();
}

static int duet__gemv_r4_fills(int64_t M, const duet__gemv_args_t *args)
{
    static int off = -1;
    if (duet_cuda_env_flag(&off, "DUET_CUDA_GEMV_NO_WAVE"))
        return 1;
    int per_sm;
    int64_t blocks = 0;
    for (int i = 0; i < args->n; i++)
        blocks += (int64_t)args->seg[i].B *
                  ((args->seg[i].N + 4 * DUET_GEMV_WARPS - 1) / (4 * DUET_GEMV_WARPS));
    switch (duet__gemv_dt(args)) {
    case DUET_DTYPE_BF16:
        per_sm = duet__gemv_r4_per_sm_m<DUET_DTYPE_BF16>(M);
        break;
    case DUET_DTYPE_F16:
        per_sm = duet__gemv_r4_per_sm_m<DUET_DTYPE_F16>(M);
        break;
    case DUET_DTYPE_F32:
        per_sm = duet__gemv_r4_per_sm_m<DUET_DTYPE_F32>(M);
        break;
    default:
        per_sm = duet__gemv_r4_per_sm_m<DUET__GEMV_ANY_DT>(M);
        break;
    }
    const int n_sms = duet_cuda_sm_count();
    if (per_sm < 1 || n_sms < 1)
        return 1; /* unknown: the rows alone decide */
    return blocks * 100 >= (int64_t)per_sm * n_sms * 95;
}

/*
 * Launch the segments (each checked by duet__gemv_fits) as one kernel. Outputs per warp: 4 (two
 * pieces of each row in flight) when that still makes DUET__GEMV_MIN_BLOCKS blocks and fills a
 * wave (duet__gemv_r4_fills), else 2 when that makes DUET__GEMV_MIN_BLOCKS blocks, else 1 (four
 * pieces in flight). Wide products gain from more outputs per warp (more loads in flight, each
 * piece of x read once for all of them) as long as the blocks still fill a wave; short ones
 * (o_proj, the downs) need every warp they can get (bench/RESULTS.md, "GEMV: outputs per warp").
 */
#define DUET__GEMV_MIN_BLOCKS 200

static cudaError_t duet__gemv_run(cudaStream_t stream, int64_t M, duet__gemv_args_t *args)
{
    args->wait_first = !duet_cuda_weights_early();
    int64_t rows = 0; /* warps' worth of outputs, over every segment and batch entry */
    for (int i = 0; i < args->n; i++) {
        if (args->seg[i].B == 0)
            args->seg[i].B = 1;
        rows += (int64_t)args->seg[i].B * args->seg[i].N;
    }
    if (args->n == 0 || rows == 0)
        return cudaSuccess;
    const int64_t min_rows = (int64_t)DUET__GEMV_MIN_BLOCKS * DUET_GEMV_WARPS;
    if (rows >= 4 * min_rows && duet__gemv_r4_fills(M, args))
        return duet__gemv_launch_r<4, 2>(stream, M, args);
    if (rows >= 2 * min_rows)
        return duet__gemv_launch_r<2, 2>(stream, M, args);
    return duet__gemv_launch_r<1, 4>(stream, M, args);
}

/* DUET_CUDA_NO_GEMV=1 in the environment sends every call to cuBLASLt (comparisons). */
static int duet__gemv_disabled(void)
{
    static int off = -1;
    return duet_cuda_env_flag(&off, "DUET_CUDA_NO_GEMV");
}

/* What both weight-streaming GEMVs need of a call of B products [N, K]: 16-byte loads of every
 * x row (and batch entry) and of W, K in whole 8-element pieces, sizes that fit their indexing. */
static int duet__stream_loads_ok(const float *x, int64_t ldx, int64_t stride_x, int64_t B,
                                 const void *w_data, int64_t N, int64_t K)
{
    return N > 0 && K % 8 == 0 && K <= INT32_MAX && ldx % 4 == 0 && (B == 1 || stride_x % 4 == 0) &&
           B <= 65535 && ((uintptr_t)x & 15u) == 0 && ((uintptr_t)w_data & 15u) == 0;
}

/* ---- 3 to 8 rows of BF16 weights: the weight stream through the tensor cores ----------------- */

/*
 * Through cuBLASLt, batch-8 decode spent several times the streaming time of their 0.7 GB of
 * weights on the dense products, their split-K reductions and the conversions of x
 * (bench/RESULTS.md, "GEMV on the tensor cores for 3 to 8 rows"). The FMA GEMV above is no
 * answer past 2 rows (each 16-byte piece of W would meet M rows of x from L1), but the tensor
 * cores take up to 8 rows as the n side of mma.m16n8k16 at no cost that matters.
 *
 * A warp owns a tile of 16 rows of W (one m16 tile) and a slice of its columns. Lane (g, tg)
 * loads 16 bytes (8 columns) of rows g and g + 8 at the same columns, 8·tg past the step's base:
 * once the columns are renumbered (a dot product does not care in which order its k run) those
 * are its A fragments of two k16 steps as loaded: step one takes columns 0-3 of the lane's 8 as
 * the fragment's k = 2tg, 2tg+1, 2tg+8, 2tg+9, step two columns 4-7. The same renumbering of x
 * gives the B fragments: lane (g, tg) reads 8 values of x's row g at those columns. So W goes
 * from memory to the tensor cores with no shuffle and no shared memory, each row read in 64-byte
 * runs by four lanes. The warp works in stages of DUET_TGEMV_U steps and loads the next stage
 * before it multiplies this one, so its loads are in flight while it splits x and multiplies
 * (bench/RESULTS.md, "GEMV on the tensor cores for 3 to 8 rows").
 * x stays fp32 in effect: each value is split into bf16 hi + lo (|x − hi − lo| <= 2^-16 |x|:
 * two roundings to 8 significant bits) and both are multiplied, so each product is within
 * 2^-16 of fp32's (cuBLASLt's path rounds x to bf16: 2^-8).
 * When the tiles alone make too few warps to keep HBM busy, the S warps of a block split one
 * tile's columns (S = 1, 2, 4 or 8: the fewest that make DUET_TGEMV_WANT warps per SM) and meet
 * in shared memory, added in slice order, so the result depends on the shape only. Where even 8
 * slices fall short (o_proj: 144 tiles of 16 rows, one block on most SMs), the tiles are 8 rows
 * of W on the mma's n side instead (duet__tgemv_kernel<8>), twice the warps.
 * 9 to 16 rows (two n8 tiles) measured slower than cuBLASLt at batch 16, so they stay there.
 * PDL as in the GEMV: the first weight steps are issued before the wait.
 */
#define DUET_TGEMV_MIN_M     3
#define DUET_TGEMV_MAX_M     8
#define DUET_TGEMV_WARPS     8
#define DUET_TGEMV_U         2   /* 32-column steps of W per stage; two stages in flight per warp */
#define DUET_TGEMV_BLOCKS    3   /* blocks per SM: registers capped at 80 */
#define DUET_TGEMV_WANT      16  /* warps per SM the slices aim for ... */
#define DUET_TGEMV_MIN_SLICE 128 /* ... in slices of at least this many columns */

/*
 * Tiles of TR rows: a segment's start seg.b0 and seg.nb per batch entry count tiles; S warps per
 * tile, DUET_TGEMV_WARPS / S tiles per block. TR = 16: W is the m16 side, lane (g, tg) loads
 * rows g and g + 8, x's hi and lo are two B fragments. TR = 8, for launches whose 16-row tiles
 * leave the GPU short of warps even split 8 ways (o_proj at 144 tiles): W is the n8 side, lane
 * (g, tg) loads row g only, and A's rows 0-7 are x's hi, rows 8-15 its lo, so one mma takes
 * both halves and each output is its hi row's sum plus its lo row's. TR = 8 stages twice the
 * steps, so a lane keeps as many bytes in flight in both forms.
 */
template <int TR>
__global__ void __launch_bounds__(32 * DUET_TGEMV_WARPS, DUET_TGEMV_BLOCKS)
    duet__tgemv_kernel(const __grid_constant__ duet__gemv_args_t args, int M, int S, unsigned tiles)
{
    static_assert(TR == 16 || TR == 8, "tiles of 16 or 8 rows of W");
    constexpr int NW = TR / 8;                  /* rows of W per lane */
    constexpr int U = DUET_TGEMV_U * (16 / TR); /* 32-column steps per stage */
    __shared__ float red[DUET_TGEMV_WARPS][4][32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;
    const unsigned tile = blockIdx.x * (unsigned)(DUET_TGEMV_WARPS / S) + (unsigned)(warp / S);
    const int slice = warp % S;
    const bool live = tile < tiles; /* warp-uniform */
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    duet__gemv_seg_t sg = args.seg[0];
    int64_t n0 = 0;
    if (live) {
        unsigned j;
        sg = duet__gemv_seg_of(args, tile, j);
        n0 = (int64_t)j * TR;
        const int64_t ks = ((sg.K + S - 1) / S + 31) / 32 * 32;
        const int64_t k_beg = slice * ks, k_end = min(sg.K, k_beg + ks);
        const __nv_bfloat16 *wr[NW];
#pragma unroll
        for (int r = 0; r < NW; r++)
            wr[r] = (const __nv_bfloat16 *)sg.w + min(n0 + g + 8 * r, sg.N - 1) * sg.K;
        const bool xok = g < M; /* x rows past M are zeros, never read */
        const float *xr = sg.x + (int64_t)(xok ? g : 0) * sg.ldx;
        bool waited = args.wait_first != 0;
        if (waited) {
            duet_pdl_wait();
            duet_pdl_trigger();
        }
        uint4 wv[NW][U]; /* this stage's pieces; the next stage's load before its MMAs */
        auto load = [&](int64_t kb, uint4(&pv)[NW][U]) {
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int64_t k = kb + 32 * u + 8 * tg;
#pragma unroll
                for (int r = 0; r < NW; r++)
                    pv[r][u] = k < k_end ? duet_ld_weight16(wr[r] + k) : make_uint4(0, 0, 0, 0);
            }
        };
        load(k_beg, wv);
        for (int64_t kb = k_beg; kb < k_end; kb += 32 * U) {
            uint4 nv[NW][U];
            load(kb + 32 * U, nv);
            if (!waited) { /* the first steps are in flight: now wait for x */
                duet_pdl_wait();
                duet_pdl_trigger();
                waited = true;
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                if (kb + 32 * u >= k_end) /* warp-uniform */
                    break;
                const int64_t k = kb + 32 * u + 8 * tg;
                const bool in = k < k_end && xok;
                float4 x0 = make_float4(0.0f, 0.0f, 0.0f, 0.0f), x1 = x0;
                if (in) {
                    x0 = *(const float4 *)(xr + k);
                    x1 = *(const float4 *)(xr + k + 4);
                }
                uint32_t h0, l0, h1, l1, h2, l2, h3, l3;
                duet_split_bf16x2(x0.x, x0.y, &h0, &l0);
                duet_split_bf16x2(x0.z, x0.w, &h1, &l1);
                duet_split_bf16x2(x1.x, x1.y, &h2, &l2);
                duet_split_bf16x2(x1.z, x1.w, &h3, &l3);
                const uint4 a = wv[0][u];
                if constexpr (TR == 16) {
                    const uint4 b = wv[NW - 1][u];
                    duet_mma_bf16(acc, a.x, b.x, a.y, b.y, h0, h1);
                    duet_mma_bf16(acc, a.x, b.x, a.y, b.y, l0, l1);
                    duet_mma_bf16(acc, a.z, b.z, a.w, b.w, h2, h3);
                    duet_mma_bf16(acc, a.z, b.z, a.w, b.w, l2, l3);
                } else {
                    duet_mma_bf16(acc, h0, l0, h1, l1, a.x, a.y);
                    duet_mma_bf16(acc, h2, l2, h3, l3, a.z, a.w);
                }
            }
#pragma unroll
            for (int u = 0; u < U; u++)
#pragma unroll
                for (int r = 0; r < NW; r++)
                    wv[r][u] = nv[r][u];
        }
        if (!waited) { /* a slice with no columns */
            duet_pdl_wait();
            duet_pdl_trigger();
        }
    } else {
        duet_pdl_wait(); /* every warp waits: the grid completes after its predecessor */
        duet_pdl_trigger();
    }
    if (S > 1) { /* the slices meet in shared memory, added in slice order */
#pragma unroll
        for (int c = 0; c < 4; c++)
            red[warp][c][lane] = acc[c];
        __syncthreads();
        if (slice == 0)
            for (int s = 1; s < S; s++)
#pragma unroll
                for (int c = 0; c < 4; c++)
                    acc[c] += red[warp + s][c][lane];
    }
    if (!live || slice != 0)
        return;
    if constexpr (TR == 16) {
        /* c0, c1: row n0 + g, x rows 2tg and 2tg + 1; c2, c3: row n0 + g + 8 */
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int m = 2 * tg + (c & 1);
            const int64_t n = n0 + g + 8 * (c >> 1);
            if (m < M && n < sg.N) {
                float *yp = sg.y + m * sg.ldy + n;
                *yp = sg.accumulate ? *yp + acc[c] : acc[c];
            }
        }
    } else {
        /* c0, c1: x row g's hi against rows n0 + 2tg, n0 + 2tg + 1; c2, c3: its lo */
#pragma unroll
        for (int c = 0; c < 2; c++) {
            const int64_t n = n0 + 2 * tg + c;
            if (g < M && n < sg.N) {
                float *yp = sg.y + g * sg.ldy + n;
                const float v = acc[c] + acc[c + 2];
                *yp = sg.accumulate ? *yp + v : v;
            }
        }
    }
}

/* DUET_CUDA_TGEMV_ROWS16=1 in the environment keeps every launch on 16-row tiles (side-by-side
 * runs). */
static int duet__tgemv_rows16(void)
{
    static int on = -1;
    return duet_cuda_env_flag(&on, "DUET_CUDA_TGEMV_ROWS16");
}

/* Launch the segments (each checked by duet__tgemv_fits) as one kernel: 16-row tiles, or 8-row
 * ones when 16-row tiles split 8 ways make fewer than DUET_TGEMV_WANT warps per SM; the segments'
 * tile offsets; the fewest warps per tile (1, 2, 4, 8) that give DUET_TGEMV_WANT warps per SM,
 * but no slice under DUET_TGEMV_MIN_SLICE columns: KDA's f_b|g_b (K = 128) split 8 ways left each
 * warp one step and the block's meeting in shared memory (bench/RESULTS.md, "GEMV on the tensor
 * cores for 3 to 8 rows"). */
static cudaError_t duet__tgemv_run(cudaStream_t stream, int64_t M, duet__gemv_args_t *args)
{
    args->wait_first = !duet_cuda_weights_early();
    const int n_sms = duet_cuda_sm_count();
    const int64_t want = (int64_t)(n_sms > 0 ? n_sms : 132) * DUET_TGEMV_WANT;
    unsigned tiles = duet__gemv_layout(args, 16);
    if (args->n == 0 || tiles == 0)
        return cudaSuccess;
    const bool rows8 = (int64_t)tiles * DUET_TGEMV_WARPS < want && !duet__tgemv_rows16();
    if (rows8)
        tiles = duet__gemv_layout(args, 8);
    int64_t kmax = 0; /* the longest row: no slice of it shorter than DUET_TGEMV_MIN_SLICE */
    for (int i = 0; i < args->n; i++)
        kmax = args->seg[i].K > kmax ? args->seg[i].K : kmax;
    int S = 1;
    while (S < DUET_TGEMV_WARPS && (int64_t)tiles * S < want &&
           kmax >= (int64_t)2 * S * DUET_TGEMV_MIN_SLICE)
        S *= 2;
    const unsigned per_block = DUET_TGEMV_WARPS / S;
    const dim3 grid((tiles + per_block - 1) / per_block), block(32 * DUET_TGEMV_WARPS);
    if (rows8)
        return duet_pdl_launch(duet__tgemv_kernel<8>, grid, block, 0, stream, *args, (int)M, S,
                               tiles);
    return duet_pdl_launch(duet__tgemv_kernel<16>, grid, block, 0, stream, *args, (int)M, S, tiles);
}

/* DUET_CUDA_NO_TGEMV=1 in the environment sends these calls to cuBLASLt (comparisons), as
 * DUET_CUDA_NO_GEMV=1 does with every call. */
static int duet__tgemv_disabled(void)
{
    static int off = -1;
    return duet_cuda_env_flag(&off, "DUET_CUDA_NO_TGEMV");
}

/* Whether the tensor-core GEMV takes a call of B products [N, K] of M rows: BF16 W, 3 <= M <= 8,
 * K % 8 == 0, 16-byte loads of x and W, tile counts that fit its indexing. */
static int duet__tgemv_fits(const float *x, int64_t ldx, int64_t stride_x, int64_t B, int64_t M,
                            const void *w_data, duet_dtype_t dt, int64_t N, int64_t K)
{
    return dt == DUET_DTYPE_BF16 && M >= DUET_TGEMV_MIN_M && M <= DUET_TGEMV_MAX_M &&
           duet__stream_loads_ok(x, ldx, stride_x, B, w_data, N, K) &&
           (N + 7) / 8 * B <= (int64_t)1 << 30 && !duet__tgemv_disabled() && !duet__gemv_disabled();
}

/*
 * Whether the GEMV path takes a call of B products [N, K] (B = 1: a plain one): every 16-byte
 * load it makes is aligned, sizes fit its indexing, and no TF32 was asked for.
 */
static int duet__gemv_fits(const float *x, int64_t ldx, int64_t stride_x, int64_t B, int64_t M,
                           const void *w_data, duet_dtype_t dt, int64_t N, int64_t K,
                           unsigned flags)
{
    return M >= 1 && M <= (dt == DUET_DTYPE_F32 ? DUET_GEMV_MAX_M_F32 : DUET_GEMV_MAX_M) &&
           duet__stream_loads_ok(x, ldx, stride_x, B, w_data, N, K) &&
           (dt != DUET_DTYPE_F32 || !(flags & DUET_CUDA_GEMM_TF32)) && !duet__gemv_disabled();
}

/* One (possibly batched) product on the GEMV path, checked by duet__gemv_fits. */
static duet_status_t duet__gemv_one(int tc, cudaStream_t stream, float *y, int64_t ldy,
                                    int64_t stride_y, const float *x, int64_t ldx, int64_t stride_x,
                                    int64_t M, const void *w_data, duet_dtype_t dt, int64_t N,
                                    int64_t K, int64_t B, int accumulate)
{
    duet__gemv_args_t args;
    memset(&args, 0, sizeof(args));
    args.n = 1;
    args.seg[0] = (duet__gemv_seg_t){.y = y,
                                     .x = x,
                                     .w = w_data,
                                     .ldy = ldy,
                                     .ldx = ldx,
                                     .N = N,
                                     .K = K,
                                     .dtype = (int)dt,
                                     .accumulate = accumulate,
                                     .sx = stride_x,
                                     .sy = stride_y,
                                     .B = (unsigned)B};
    DUET__TRY(tc ? duet__tgemv_run(stream, M, &args) : duet__gemv_run(stream, M, &args),
              "gemv launch");
    return DUET_OK;
}

/* ---- handle ------------------------------------------------------------------------------- */

static void duet__entry_clear(duet__gemm_entry_t *e)
{
    if (!e->valid)
        return;
    cublasLtMatrixLayoutDestroy(e->lc);
    cublasLtMatrixLayoutDestroy(e->lb);
    cublasLtMatrixLayoutDestroy(e->la);
    cublasLtMatmulDescDestroy(e->desc);
    e->valid = 0;
}

extern "C" duet_status_t duet_cuda_gemm_create(size_t workspace_bytes, int64_t max_x_elems,
                                               duet_cuda_gemm_t **g_p)
{
    if (g_p == NULL || max_x_elems < 0)
        return duet_error_set(DUET_ERR_INVALID, "cuda gemm: bad create arguments");
    if (workspace_bytes == 0)
        workspace_bytes = DUET_CUDA_GEMM_WS_BYTES;

    int n_dev = 0;
    cudaError_t ce = cudaGetDeviceCount(&n_dev);
    if (ce != cudaSuccess || n_dev == 0) {
        (void)cudaGetLastError();
        return duet_error_set(DUET_ERR_DEVICE, "cuda gemm: no CUDA device (%s)",
                              ce != cudaSuccess ? cudaGetErrorString(ce) : "none visible");
    }

    duet_status_t st;
    cublasStatus_t ls;
    duet_cuda_gemm_t *g = (duet_cuda_gemm_t *)calloc(1, sizeof(*g));
    if (g == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "cuda gemm: out of host memory");
    ls = cublasLtCreate(&g->lt);
    if (ls != CUBLAS_STATUS_SUCCESS) {
        st = duet__lt_fail(ls, "cublasLtCreate");
        goto free_g;
    }
    ce = cudaMalloc(&g->workspace, workspace_bytes);
    if (ce != cudaSuccess) {
        st = duet_cuda_status(ce, DUET__MODULE, "workspace cudaMalloc");
        goto destroy_lt;
    }
    g->ws_bytes = workspace_bytes;
    if (max_x_elems > 0) {
        ce = cudaMalloc(&g->stage, (size_t)max_x_elems * sizeof(uint16_t));
        if (ce != cudaSuccess) {
            st = duet_cuda_status(ce, DUET__MODULE, "staging cudaMalloc");
            goto free_workspace;
        }
    }
    g->stage_elems = max_x_elems;
    g->last_algo = -1;
    *g_p = g;
    return DUET_OK;

free_workspace:
    cudaFree(g->workspace);
destroy_lt:
    cublasLtDestroy(g->lt);
free_g:
    free(g);
    return st;
}

extern "C" void duet_cuda_gemm_destroy(duet_cuda_gemm_t *g)
{
    if (g == NULL)
        return;
    for (int i = 0; i < DUET_CUDA_GEMM_CACHE; i++)
        duet__entry_clear(&g->cache[i]);
    cudaFree(g->stage); /* cudaFree waits for work still using the buffers */
    cudaFree(g->prof_x);
    cudaFree(g->prof_w);
    cudaFree(g->prof_y);
    for (int i = 0; i < 2; i++)
        if (g->prof_ev[i] != NULL)
            cudaEventDestroy(g->prof_ev[i]);
    cudaFree(g->workspace);
    cublasLtDestroy(g->lt);
    free(g);
}

/* ---- the GEMM ----------------------------------------------------------------------------- */

static unsigned duet__align_of(const void *p)
{
    uintptr_t u = (uintptr_t)p;
    uintptr_t a = u & (~u + 1); /* lowest set bit */
    return a == 0 || a > 256 ? 256u : (unsigned)a;
}

static cudaDataType_t duet__cuda_type(duet_dtype_t dt)
{
    return dt == DUET_DTYPE_BF16 ? CUDA_R_16BF : dt == DUET_DTYPE_F16 ? CUDA_R_16F : CUDA_R_32F;
}

/* Build the descriptors and pick the algorithm for e's key (already filled in). */
static duet_status_t duet__entry_build(duet_cuda_gemm_t *g, duet__gemm_entry_t *e)
{
    cublasStatus_t s;
    duet_status_t st;
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t res[DUET_CUDA_GEMM_TACTICS];
    int n_res = 0;
    cudaDataType_t in_t = duet__cuda_type(e->dtype);
    cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;

    e->desc = NULL;
    e->la = e->lb = e->lc = NULL;
#define DUET__LT(call, what)                                                                       \
    do {                                                                                           \
        s = (call);                                                                                \
        if (s != CUBLAS_STATUS_SUCCESS) {                                                          \
            st = duet__lt_fail(s, what);                                                           \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)
    DUET__LT(cublasLtMatmulDescCreate(&e->desc, e->compute, CUDA_R_32F), "matmul desc");
    DUET__LT(
        cublasLtMatmulDescSetAttribute(e->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)),
        "transa");
    DUET__LT(
        cublasLtMatmulDescSetAttribute(e->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)),
        "transb");
    DUET__LT(cublasLtMatrixLayoutCreate(&e->la, in_t, (uint64_t)e->K, (uint64_t)e->N, e->K),
             "layout A (W)");
    DUET__LT(cublasLtMatrixLayoutCreate(&e->lb, in_t, (uint64_t)e->K, (uint64_t)e->M, e->ldx),
             "layout B (x)");
    DUET__LT(cublasLtMatrixLayoutCreate(&e->lc, CUDA_R_32F, (uint64_t)e->N, (uint64_t)e->M, e->ldy),
             "layout C (y)");
    if (e->batch > 1) {
        cublasLtMatrixLayout_t ls[3] = {e->la, e->lb, e->lc};
        int64_t strides[3] = {e->stride_w, e->stride_x, e->stride_y};
        for (int i = 0; i < 3; i++) {
            DUET__LT(cublasLtMatrixLayoutSetAttribute(ls[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                      &e->batch, sizeof(e->batch)),
                     "batch count");
            DUET__LT(cublasLtMatrixLayoutSetAttribute(ls[i],
                                                      CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                      &strides[i], sizeof(strides[i])),
                     "batch stride");
        }
    }

    DUET__LT(cublasLtMatmulPreferenceCreate(&pref), "preference");
    DUET__LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                  &g->ws_bytes, sizeof(g->ws_bytes)),
             "preference workspace");
    {
        uint32_t aa = e->align_a, ab = e->align_b, ac = e->align_c;
        DUET__LT(cublasLtMatmulPreferenceSetAttribute(
                     pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aa, sizeof(aa)),
                 "preference align A");
        DUET__LT(cublasLtMatmulPreferenceSetAttribute(
                     pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ab, sizeof(ab)),
                 "preference align B");
        DUET__LT(cublasLtMatmulPreferenceSetAttribute(
                     pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ac, sizeof(ac)),
                 "preference align C");
        DUET__LT(cublasLtMatmulPreferenceSetAttribute(
                     pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ac, sizeof(ac)),
                 "preference align D");
    }
    DUET__LT(cublasLtMatmulAlgoGetHeuristic(g->lt, e->desc, e->la, e->lb, e->lc, e->lc, pref,
                                            DUET_CUDA_GEMM_TACTICS, res, &n_res),
             "heuristic");
#undef DUET__LT
    if (n_res < 1) {
        st = duet_error_set(DUET_ERR_UNSUPPORTED,
                            "cuda gemm: cuBLASLt has no algorithm for %s M=%lld N=%lld K=%lld "
                            "ldx=%lld ldy=%lld (alignment %u/%u/%u)",
                            duet_dtype_name(e->dtype), (long long)e->M, (long long)e->N,
                            (long long)e->K, (long long)e->ldx, (long long)e->ldy, e->align_a,
                            e->align_b, e->align_c);
        goto fail;
    }
    cublasLtMatmulPreferenceDestroy(pref);
    e->n_algo = n_res < DUET_CUDA_GEMM_TACTICS ? n_res : DUET_CUDA_GEMM_TACTICS;
    for (int i = 0; i < e->n_algo; i++)
        e->algo[i] = res[i].algo;
    e->valid = 1;
    return DUET_OK;

fail:
    if (pref != NULL)
        cublasLtMatmulPreferenceDestroy(pref);
    if (e->lc != NULL)
        cublasLtMatrixLayoutDestroy(e->lc);
    if (e->lb != NULL)
        cublasLtMatrixLayoutDestroy(e->lb);
    if (e->la != NULL)
        cublasLtMatrixLayoutDestroy(e->la);
    if (e->desc != NULL)
        cublasLtMatmulDescDestroy(e->desc);
    e->valid = 0;
    return st;
}

static duet_status_t duet__entry_get(duet_cuda_gemm_t *g, const duet__gemm_entry_t *key,
                                     duet__gemm_entry_t **e_p)
{
    duet__gemm_entry_t *free_slot = NULL;
    for (int i = 0; i < DUET_CUDA_GEMM_CACHE; i++) {
        duet__gemm_entry_t *e = &g->cache[i];
        if (!e->valid) {
            if (free_slot == NULL)
                free_slot = e;
            continue;
        }
        if (e->dtype == key->dtype && e->compute == key->compute && e->M == key->M &&
            e->N == key->N && e->K == key->K && e->ldx == key->ldx && e->ldy == key->ldy &&
            e->batch == key->batch && e->stride_w == key->stride_w &&
            e->stride_x == key->stride_x && e->stride_y == key->stride_y &&
            e->align_a == key->align_a && e->align_b == key->align_b &&
            e->align_c == key->align_c) {
            *e_p = e;
            return DUET_OK;
        }
    }
    if (free_slot == NULL) {
        free_slot = &g->cache[g->next_evict];
        g->next_evict = (g->next_evict + 1) % DUET_CUDA_GEMM_CACHE;
        duet__entry_clear(free_slot);
    }
    *free_slot = *key;
    free_slot->valid = 0;
    duet_status_t st = duet__entry_build(g, free_slot);
    if (st != DUET_OK)
        return st;
    *e_p = free_slot;
    return DUET_OK;
}

static duet_status_t duet__check_w(const duet_tensor_t *w, int64_t M, int64_t ldx, int64_t ldy,
                                   const void *x, const float *y)
{
    if (w == NULL || w->ndim != 2 || w->device != DUET_DEVICE_CUDA ||
        duet_dtype_size(w->dtype) == 0)
        return duet_error_set(DUET_ERR_INVALID,
                              "cuda gemm: weight must be a 2-D CUDA tensor of F32, BF16 or F16");
    int64_t N = w->shape[0], K = w->shape[1];
    if (M < 0 || N < 0 || K < 0 || ldx < K || ldy < N)
        return duet_error_set(
            DUET_ERR_INVALID, "cuda gemm: bad shape M=%lld N=%lld K=%lld ldx=%lld ldy=%lld",
            (long long)M, (long long)N, (long long)K, (long long)ldx, (long long)ldy);
    if (M > 0 && N > 0 && (y == NULL || (K > 0 && (x == NULL || w->data == NULL))))
        return duet_error_set(DUET_ERR_INVALID, "cuda gemm: NULL operand");
    return DUET_OK;
}

/*
 * The low-precision-input GEMM over `batch` matrices (checked by the callers) with algorithm
 * `tactic` of its entry: -1 = the tuner's choice for a plain (batch 1) call, else algo 0; >= 0 =
 * that one (duet_cuda_gemm_profile), DUET_ERR_RANGE past the entry's count.
 */
static duet_status_t duet__matmul_lowp_t(duet_cuda_gemm_t *g, cudaStream_t stream, float *y,
                                         int64_t ldy, int64_t stride_y, const void *x, int64_t ldx,
                                         int64_t stride_x, int64_t M, const void *w_data,
                                         duet_dtype_t w_dtype, int64_t N, int64_t K, int32_t batch,
                                         int accumulate, unsigned flags, int tactic)
{
    if (M == 0 || N == 0 || batch == 0)
        return DUET_OK;
    if (K == 0) { /* an empty sum: y = 0, or y unchanged */
        if (!accumulate)
            for (int32_t b = 0; b < batch; b++)
                DUET__TRY(cudaMemset2DAsync(y + b * stride_y, (size_t)ldy * sizeof(float), 0,
                                            (size_t)N * sizeof(float), (size_t)M, stream),
                          "zero y");
        return DUET_OK;
    }

    duet__gemm_entry_t key;
    memset(&key, 0, sizeof(key));
    key.dtype = w_dtype;
    key.compute = w_dtype == DUET_DTYPE_F32 && (flags & DUET_CUDA_GEMM_TF32)
                      ? CUBLAS_COMPUTE_32F_FAST_TF32
                      : CUBLAS_COMPUTE_32F;
    key.M = M;
    key.N = N;
    key.K = K;
    key.ldx = ldx;
    key.ldy = ldy;
    key.batch = batch;
    key.stride_w = batch > 1 ? N * K : 0;
    key.stride_x = batch > 1 ? stride_x : 0;
    key.stride_y = batch > 1 ? stride_y : 0;
    key.align_a = duet__align_of(w_data);
    key.align_b = duet__align_of(x);
    key.align_c = duet__align_of(y);
    if (batch > 1) { /* every batch entry's pointer must meet the alignment claimed */
        size_t es = duet_dtype_size(w_dtype);
        unsigned a = duet__align_of((const void *)(uintptr_t)(N * K * es));
        key.align_a = key.align_a < a ? key.align_a : a;
        a = duet__align_of((const void *)(uintptr_t)(stride_x * es));
        key.align_b = key.align_b < a ? key.align_b : a;
        a = duet__align_of((const void *)(uintptr_t)(stride_y * sizeof(float)));
        key.align_c = key.align_c < a ? key.align_c : a;
    }
    duet__gemm_entry_t *e;
    duet_status_t st = duet__entry_get(g, &key, &e);
    if (st != DUET_OK)
        return st;

    int a = tactic;
    if (a < 0) { /* the tuner's key: batched calls (per-head MLA) are not tuned */
        const duet_tune_key_t tk = {.op = DUET_TUNE_OP_CUDA_GEMM,
                                    .dtype = (int32_t)w_dtype,
                                    .m = duet_tune_m_bucket(M),
                                    .n = N,
                                    .k = K};
        a = batch == 1 ? duet_tune_get(g->tuner, &tk) : -1;
        if (a < 0 || a >= e->n_algo)
            a = 0;
    } else if (a >= e->n_algo) {
        return duet_error_set(DUET_ERR_RANGE,
                              "cuda gemm: tactic %d of %s M=%lld N=%lld K=%lld: cuBLASLt "
                              "returned %d algorithms",
                              tactic, duet_dtype_name(w_dtype), (long long)M, (long long)N,
                              (long long)K, e->n_algo);
    }
    g->last_algo = a;
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    cublasStatus_t s =
        cublasLtMatmul(g->lt, e->desc, &alpha, w_data, e->la, x, e->lb, &beta, y, e->lc, y, e->lc,
                       &e->algo[a], g->workspace, g->ws_bytes, stream);
    if (s != CUBLAS_STATUS_SUCCESS)
        return duet__lt_fail(s, "cublasLtMatmul");
    return DUET_OK;
}

static duet_status_t duet__matmul_lowp(duet_cuda_gemm_t *g, cudaStream_t stream, float *y,
                                       int64_t ldy, int64_t stride_y, const void *x, int64_t ldx,
                                       int64_t stride_x, int64_t M, const void *w_data,
                                       duet_dtype_t w_dtype, int64_t N, int64_t K, int32_t batch,
                                       int accumulate, unsigned flags)
{
    return duet__matmul_lowp_t(g, stream, y, ldy, stride_y, x, ldx, stride_x, M, w_data, w_dtype, N,
                               K, batch, accumulate, flags, -1);
}

extern "C" duet_status_t duet_cuda_gemm_matmul_lowp(duet_cuda_gemm_t *g, cudaStream_t stream,
                                                    float *y, int64_t ldy, const void *x,
                                                    int64_t ldx, int64_t M, const duet_tensor_t *w,
                                                    int accumulate, unsigned flags)
{
    if (g == NULL)
        return duet_error_set(DUET_ERR_INVALID, "cuda gemm: NULL handle");
    duet_status_t st = duet__check_w(w, M, ldx, ldy, x, y);
    if (st != DUET_OK)
        return st;
    return duet__matmul_lowp(g, stream, y, ldy, 0, x, ldx, 0, M, w->data, w->dtype, w->shape[0],
                             w->shape[1], 1, accumulate, flags);
}

extern "C" duet_status_t
duet_cuda_gemm_matmul_batched(duet_cuda_gemm_t *g, cudaStream_t stream, float *y, int64_t ldy,
                              int64_t stride_y, const float *x, int64_t ldx, int64_t stride_x,
                              int64_t M, const duet_tensor_t *w, int accumulate, unsigned flags)
{
    if (g == NULL)
        return duet_error_set(DUET_ERR_INVALID, "cuda gemm: NULL handle");
    if (w == NULL || w->ndim != 3 || w->device != DUET_DEVICE_CUDA ||
        duet_dtype_size(w->dtype) == 0 || w->shape[0] < 0 || w->shape[0] > INT32_MAX)
        return duet_error_set(DUET_ERR_INVALID,
                              "cuda gemm: batched weight must be a 3-D CUDA tensor [B][N][K]");
    const int64_t B = w->shape[0], N = w->shape[1], K = w->shape[2];
    /* the batch entries' x columns span `width` elements of each row */
    const int64_t width = B > 0 ? (B - 1) * stride_x + K : 0;
    if (M < 0 || N < 0 || K < 0 || stride_x < 0 || stride_y < 0 || ldx < width ||
        ldy < (B > 0 ? (B - 1) * stride_y + N : 0) || (B > 1 && (stride_x < K || stride_y < N)))
        return duet_error_set(DUET_ERR_INVALID,
                              "cuda gemm: bad batched shape B=%lld M=%lld N=%lld K=%lld ldx=%lld "
                              "stride_x=%lld ldy=%lld stride_y=%lld",
                              (long long)B, (long long)M, (long long)N, (long long)K,
                              (long long)ldx, (long long)stride_x, (long long)ldy,
                              (long long)stride_y);
    if (M == 0 || N == 0 || B == 0)
        return DUET_OK;
    if (x == NULL || y == NULL || w->data == NULL)
        return duet_error_set(DUET_ERR_INVALID, "cuda gemm: NULL operand");
    if (duet__gemv_fits(x, ldx, stride_x, B, M, w->data, w->dtype, N, K, flags))
        return duet__gemv_one(0, stream, y, ldy, stride_y, x, ldx, stride_x, M, w->data, w->dtype,
                              N, K, B, accumulate);
    if (duet__tgemv_fits(x, ldx, stride_x, B, M, w->data, w->dtype, N, K))
        return duet__gemv_one(1, stream, y, ldy, stride_y, x, ldx, stride_x, M, w->data, w->dtype,
                              N, K, B, accumulate);
    if (w->dtype == DUET_DTYPE_F32)
        return duet__matmul_lowp(g, stream, y, ldy, stride_y, x, ldx, stride_x, M, w->data,
                                 w->dtype, N, K, (int32_t)B, accumulate, flags);
    if (M * width > g->stage_elems)
        return duet_error_set(DUET_ERR_RANGE,
                              "cuda gemm: x of %lld x %lld exceeds the staging buffer (%lld "
                              "elements; raise max_x_elems at create)",
                              (long long)M, (long long)width, (long long)g->stage_elems);
    duet_status_t st = duet_cuda_convert_from_f32(g->stage, w->dtype, x, ldx, M, width, stream);
    if (st != DUET_OK)
        return st;
    return duet__matmul_lowp(g, stream, y, ldy, stride_y, g->stage, width, stride_x, M, w->data,
                             w->dtype, N, K, (int32_t)B, accumulate, flags);
}

/* DUET_CUDA_GEMM_SPLIT_ROWS, or the environment's value (read once). */
static int64_t duet__split_rows(void)
{
    static int64_t rows = -1;
    if (rows < 0) {
        const char *v = getenv("DUET_CUDA_GEMM_SPLIT_ROWS");
        char *end = NULL;
        const long long r = v != NULL ? strtoll(v, &end, 10) : -1;
        rows = v != NULL && end != v && *end == '\0' && r >= 0 ? (int64_t)r
                                                               : DUET_CUDA_GEMM_SPLIT_ROWS;
    }
    return rows;
}

extern "C" int duet_cuda_gemm_split_pays(int64_t M, int64_t K, unsigned flags)
{
    const int64_t rows = duet__split_rows();
    return rows > 0 && M >= rows && K > 0 && K % 8 == 0 && !(flags & DUET_CUDA_GEMM_TF32);
}

static int64_t duet__split_count; /* duet_cuda_gemm_split_count (host threads: a test hook) */

extern "C" int64_t duet_cuda_gemm_split_count(void)
{
    return __atomic_load_n(&duet__split_count, __ATOMIC_RELAXED);
}

/*
 * duet_cuda_gemm_matmul and one op of a multi call. Where the product takes cuBLASLt with a
 * 16-bit W it reads x from the staging in W's dtype: converted here, or, with `staged` set, left
 * there by the caller's earlier call on the same x (rows, stride, dtype and K). With xs, a BF16
 * W multiplies plane 0 on cuBLASLt and an F32 W with its BF16 twin wb takes the split form
 * (unless TF32 is asked for), whatever M: neither reads x. *converted (may be NULL) says whether
 * this call wrote the staging.
 */
static duet_status_t duet__matmul(duet_cuda_gemm_t *g, cudaStream_t stream, float *y, int64_t ldy,
                                  const float *x, int64_t ldx, int64_t M, const duet_tensor_t *w,
                                  const void *xs, const duet_tensor_t *wb, int accumulate,
                                  unsigned flags, int staged, int *converted)
{
    if (converted != NULL)
        *converted = 0;
    if (g == NULL)
        return duet_error_set(DUET_ERR_INVALID, "cuda gemm: NULL handle");
    duet_status_t st = duet__check_w(w, M, ldx, ldy, x, y);
    if (st != DUET_OK)
        return st;
    const int64_t N = w->shape[0], K = w->shape[1];
    if (xs != NULL && w->dtype == DUET_DTYPE_BF16) /* x rounded already: plane 0 */
        return duet_cuda_gemm_matmul_lowp(g, stream, y, ldy, xs, K, M, w, accumulate, flags);
    if (xs != NULL && wb != NULL && w->dtype == DUET_DTYPE_F32 && !(flags & DUET_CUDA_GEMM_TF32)) {
        if (wb->dtype != DUET_DTYPE_BF16 || wb->ndim != 2 || wb->device != DUET_DEVICE_CUDA ||
            wb->data == NULL || wb->shape[0] != N || wb->shape[1] != K)
            return duet_error_set(DUET_ERR_INVALID,
                                  "cuda gemm: w_bf16 must be a CUDA BF16 tensor of w's shape");
        __atomic_add_fetch(&duet__split_count, 1, __ATOMIC_RELAXED);
        const __nv_bfloat16 *p = (const __nv_bfloat16 *)xs;
        /* plane 2, then 1, then 0 into y: the small terms' sums first */
        for (int t = 2; t >= 0; t--) {
            st = duet__matmul_lowp(g, stream, y, ldy, 0, p + t * M * K, K, 0, M, wb->data,
                                   DUET_DTYPE_BF16, N, K, 1, accumulate || t < 2, flags);
            if (st != DUET_OK)
                return st;
        }
        return DUET_OK;
    }
    if (duet__gemv_fits(x, ldx, 0, 1, M, w->data, w->dtype, N, K, flags))
        return duet__gemv_one(0, stream, y, ldy, 0, x, ldx, 0, M, w->data, w->dtype, N, K, 1,
                              accumulate);
    if (duet__tgemv_fits(x, ldx, 0, 1, M, w->data, w->dtype, N, K))
        return duet__gemv_one(1, stream, y, ldy, 0, x, ldx, 0, M, w->data, w->dtype, N, K, 1,
                              accumulate);
    if (w->dtype == DUET_DTYPE_F32)
        return duet_cuda_gemm_matmul_lowp(g, stream, y, ldy, x, ldx, M, w, accumulate, flags);

    if (!staged) {
        if (M * K > g->stage_elems)
            return duet_error_set(DUET_ERR_RANGE,
                                  "cuda gemm: x of %lld x %lld exceeds the staging buffer (%lld "
                                  "elements; raise max_x_elems at create)",
                                  (long long)M, (long long)K, (long long)g->stage_elems);
        st = duet_cuda_convert_from_f32(g->stage, w->dtype, x, ldx, M, K, stream);
        if (st != DUET_OK)
            return st;
        if (converted != NULL)
            *converted = 1;
    }
    return duet_cuda_gemm_matmul_lowp(g, stream, y, ldy, g->stage, K, M, w, accumulate, flags);
}

extern "C" duet_status_t duet_cuda_gemm_matmul(duet_cuda_gemm_t *g, cudaStream_t stream, float *y,
                                               int64_t ldy, const float *x, int64_t ldx, int64_t M,
                                               const duet_tensor_t *w, int accumulate,
                                               unsigned flags)
{
    return duet__matmul(g, stream, y, ldy, x, ldx, M, w, NULL, NULL, accumulate, flags, 0, NULL);
}

/* The GEMV launch arguments of multi-call ops (already checked to fit the GEMV path). */
static void duet__ops_args(const duet_cuda_gemm_op_t *ops, int n_ops, duet__gemv_args_t *args)
{
    memset(args, 0, sizeof(*args));
    args->n = n_ops;
    for (int i = 0; i < n_ops; i++)
        args->seg[i] = (duet__gemv_seg_t){.y = ops[i].y,
                                          .x = ops[i].x,
                                          .w = ops[i].w->data,
                                          .ldy = ops[i].ldy,
                                          .ldx = ops[i].ldx,
                                          .N = ops[i].w->shape[0],
                                          .K = ops[i].w->shape[1],
                                          .dtype = (int)ops[i].w->dtype,
                                          .accumulate = ops[i].accumulate};
}

/*
 * Whether ops (checked, M rows) run as one launch: 1 on the GEMV, 2 on the tensor-core GEMV,
 * 0 if each op is its own call.
 */
static int duet__multi_one_launch(int64_t M, const duet_cuda_gemm_op_t *ops, int n_ops,
                                  unsigned flags)
{
    int fits = n_ops <= DUET_CUDA_GEMV_MAX_SEGS, fits_tc = fits;
    for (int i = 0; i < n_ops; i++) {
        const int64_t N = ops[i].w->shape[0], K = ops[i].w->shape[1];
        if (ops[i].xs != NULL) /* read on cuBLASLt only */
            return 0;
        fits = fits && duet__gemv_fits(ops[i].x, ops[i].ldx, 0, 1, M, ops[i].w->data,
                                       ops[i].w->dtype, N, K, flags);
        fits_tc = fits_tc && duet__tgemv_fits(ops[i].x, ops[i].ldx, 0, 1, M, ops[i].w->data,
                                              ops[i].w->dtype, N, K);
    }
    return fits ? 1 : fits_tc ? 2 : 0;
}

/* The ops in one launch of the kind duet__multi_one_launch picked (one: 1 or 2). */
static duet_status_t duet__multi_launch(cudaStream_t stream, int64_t M,
                                        const duet_cuda_gemm_op_t *ops, int n_ops, int one)
{
    duet__gemv_args_t args;
    duet__ops_args(ops, n_ops, &args);
    DUET__TRY(one == 1 ? duet__gemv_run(stream, M, &args) : duet__tgemv_run(stream, M, &args),
              "multi gemv launch");
    return DUET_OK;
}

/*
 * The ops of a multi call, one call each. Ops on the same x rows (one norm's output, say) share
 * its conversion: the staging still holds it, as no op writes what another reads. pre != NULL:
 * the staging already holds pre's rows (pre_ld apart, pre_k columns) rounded to bf16, which a
 * BF16 op on those rows reads as its own conversion (duet_cuda_gemm_norm_multi's norm left it).
 */
static duet_status_t duet__multi_calls(duet_cuda_gemm_t *g, cudaStream_t stream, int64_t M,
                                       const duet_cuda_gemm_op_t *ops, int n_ops, unsigned flags,
                                       const float *pre, int64_t pre_ld, int64_t pre_k)
{
    const duet_cuda_gemm_op_t *staged = NULL; /* the op whose x the staging holds */
    for (int i = 0; i < n_ops; i++) {
        const duet_cuda_gemm_op_t *op = &ops[i];
        const int same = staged != NULL
                             ? staged->x == op->x && staged->ldx == op->ldx &&
                                   staged->w->dtype == op->w->dtype &&
                                   staged->w->shape[1] == op->w->shape[1]
                             : pre != NULL && pre == op->x && pre_ld == op->ldx &&
                                   op->w->dtype == DUET_DTYPE_BF16 && op->w->shape[1] == pre_k;
        int converted;
        duet_status_t st = duet__matmul(g, stream, op->y, op->ldy, op->x, op->ldx, M, op->w, op->xs,
                                        op->w_bf16, op->accumulate, flags, same, &converted);
        if (st != DUET_OK)
            return st;
        if (converted)
            staged = op;
    }
    return DUET_OK;
}

extern "C" duet_status_t duet_cuda_gemm_matmul_multi(duet_cuda_gemm_t *g, cudaStream_t stream,
                                                     int64_t M, const duet_cuda_gemm_op_t *ops,
                                                     int n_ops, unsigned flags)
{
    if (g == NULL || ops == NULL || n_ops < 0)
        return duet_error_set(DUET_ERR_INVALID, "cuda gemm: bad multi arguments");
    for (int i = 0; i < n_ops; i++) {
        duet_status_t st = duet__check_w(ops[i].w, M, ops[i].ldx, ops[i].ldy, ops[i].x, ops[i].y);
        if (st != DUET_OK)
            return st;
    }
    const int one = duet__multi_one_launch(M, ops, n_ops, flags);
    if (one == 0) /* one call each (cuBLASLt, or a GEMV alone) */
        return duet__multi_calls(g, stream, M, ops, n_ops, flags, NULL, 0, 0);
    return duet__multi_launch(stream, M, ops, n_ops, one);
}

extern "C" duet_status_t duet_cuda_gemm_norm_multi(duet_cuda_gemm_t *g, cudaStream_t stream,
                                                   int64_t M, const duet_cuda_gemm_norm_t *norm,
                                                   const duet_cuda_gemm_op_t *ops, int n_ops,
                                                   unsigned flags)
{
    if (g == NULL || norm == NULL || ops == NULL || n_ops < 0 || M < 0 || norm->D <= 0 ||
        norm->ldx < norm->D || norm->ldy < norm->D ||
        (M > 0 && (norm->x == NULL || norm->w == NULL || norm->y == NULL)))
        return duet_error_set(DUET_ERR_INVALID, "cuda gemm: bad norm_multi arguments");
    if (M == 0)
        return DUET_OK;
    /* Fused only at GEMV sizes (up to 2 rows, whatever the weight type: the F32 router's 3 to
     * 8 rows fused measured slower than a norm kernel and the GEMV, bench/RESULTS.md, "MoE at 2
     * to 8 rows") with every op reading the normalised rows, 16-byte loads and stores of nx, nw
     * and ny, and x and y apart (each block writes a share of y while the others read x). */
    const float *x0 = norm->x, *x1 = norm->x + (M - 1) * norm->ldx + norm->D;
    const float *y0 = norm->y, *y1 = norm->y + (M - 1) * norm->ldy + norm->D;
    int fused = M <= DUET_GEMV_MAX_M && n_ops >= 1 && n_ops <= DUET_CUDA_GEMV_MAX_SEGS &&
                norm->ldx % 4 == 0 && norm->ldy % 4 == 0 && ((uintptr_t)norm->y & 15u) == 0 &&
                ((uintptr_t)norm->x & 15u) == 0 && ((uintptr_t)norm->w & 15u) == 0 &&
                (x1 <= y0 || y1 <= x0);
    for (int i = 0; i < n_ops; i++) {
        duet_status_t st = duet__check_w(ops[i].w, M, ops[i].ldx, ops[i].ldy, ops[i].x, ops[i].y);
        if (st != DUET_OK)
            return st;
        fused = fused && ops[i].x == norm->y && ops[i].ldx == norm->ldy && ops[i].xs == NULL &&
                ops[i].w->shape[1] == norm->D &&
                duet__gemv_fits(ops[i].x, ops[i].ldx, 0, 1, M, ops[i].w->data, ops[i].w->dtype,
                                ops[i].w->shape[0], ops[i].w->shape[1], flags);
    }
    if (!fused) {
        /* One call per op: where one of them would round the rows to bf16 for cuBLASLt, the
         * norm leaves them rounded in the staging as it stores them (the same values), and no
         * conversion pass runs. */
        const int one = duet__multi_one_launch(M, ops, n_ops, flags);
        int round = one == 0 && M * norm->D <= g->stage_elems;
        int any = 0, all = 1; /* ops reading the staged rows: any of them, all of them */
        for (int i = 0; round && i < n_ops; i++) {
            const duet_cuda_gemm_op_t *op = &ops[i];
            const int64_t N = op->w->shape[0], K = op->w->shape[1];
            const int staged = op->x == norm->y && op->ldx == norm->ldy &&
                               op->w->dtype == DUET_DTYPE_BF16 && K == norm->D && op->xs == NULL;
            any = any || staged;
            all =
                all && staged &&
                !duet__gemv_fits(op->x, op->ldx, 0, 1, M, op->w->data, op->w->dtype, N, K, flags) &&
                !duet__tgemv_fits(op->x, op->ldx, 0, 1, M, op->w->data, op->w->dtype, N, K);
        }
        round = round && any;
        /* the caller reads y nowhere else and no op reads it either: only the staged rows */
        float *ny = round && all && norm->y_unread ? NULL : norm->y;
        duet_status_t st =
            round ? duet_cuda_rmsnorm_planes(stream, ny, norm->ldy, norm->x, norm->ldx, norm->w, M,
                                             norm->D, norm->eps, g->stage, 1)
                  : duet_cuda_rmsnorm(stream, norm->y, norm->ldy, norm->x, norm->ldx, norm->w, M,
                                      norm->D, norm->eps);
        if (st != DUET_OK)
            return st;
        /* then the ops as duet_cuda_gemm_matmul_multi runs them: one launch where they fit */
        if (one == 0)
            return duet__multi_calls(g, stream, M, ops, n_ops, flags, round ? norm->y : NULL,
                                     norm->ldy, norm->D);
        return duet__multi_launch(stream, M, ops, n_ops, one);
    }
    duet__gemv_args_t args;
    duet__ops_args(ops, n_ops, &args);
    args.nx = norm->x;
    args.ldnx = norm->ldx;
    args.nw = norm->w;
    args.ny = norm->y;
    args.ldny = norm->ldy;
    args.D = norm->D;
    args.eps = norm->eps;
    DUET__TRY(duet__gemv_run(stream, M, &args), "norm gemv launch");
    return DUET_OK;
}

extern "C" void *duet_cuda_gemm_staging(duet_cuda_gemm_t *g, int64_t elems)
{
    return g != NULL && elems >= 0 && elems <= g->stage_elems ? g->stage : NULL;
}

/* ---- tactics ------------------------------------------------------------------------------ */

extern "C" void duet_cuda_gemm_set_tuner(duet_cuda_gemm_t *g, const duet_tune_t *t)
{
    if (g != NULL)
        g->tuner = t;
}

extern "C" int duet_cuda_gemm_last_algo(const duet_cuda_gemm_t *g)
{
    return g != NULL ? g->last_algo : -1;
}

extern "C" int duet_cuda_gemm_tunable(duet_dtype_t dtype, int64_t M, int64_t K, unsigned flags)
{
    /* the routing of duet_cuda_gemm_matmul for 256-byte aligned, contiguous operands */
    const void *al = (const void *)(uintptr_t)256;
    return M >= 1 && K >= 1 &&
           !duet__gemv_fits((const float *)al, K, 0, 1, M, al, dtype, 1, K, flags) &&
           !duet__tgemv_fits((const float *)al, K, 0, 1, M, al, dtype, 1, K);
}

/* Make *p at least `bytes` long (contents: a small finite constant in every dtype). */
static duet_status_t duet__prof_buf(void **p, size_t *have, size_t bytes, cudaStream_t stream)
{
    if (*have >= bytes)
        return DUET_OK;
    cudaFree(*p);
    *p = NULL;
    *have = 0;
    DUET__TRY(cudaMalloc(p, bytes), "profile cudaMalloc");
    *have = bytes;
    /* 0x3c bytes: about 0.0115 as bf16, f16 (1.06) and fp32 alike, never NaN or Inf */
    DUET__TRY(cudaMemsetAsync(*p, 0x3c, bytes, stream), "profile memset");
    return DUET_OK;
}

extern "C" void duet_cuda_gemm_profile_free(duet_cuda_gemm_t *g)
{
    if (g == NULL)
        return;
    cudaFree(g->prof_x); /* cudaFree waits for work still using them */
    cudaFree(g->prof_w);
    cudaFree(g->prof_y);
    g->prof_x = g->prof_w = NULL;
    g->prof_y = NULL;
    g->prof_x_bytes = g->prof_w_bytes = g->prof_y_bytes = 0;
}

extern "C" duet_status_t duet_cuda_gemm_profile(duet_cuda_gemm_t *g, cudaStream_t stream,
                                                duet_dtype_t dtype, int64_t M, int64_t N, int64_t K,
                                                unsigned flags, int tactic, int reps,
                                                double *seconds)
{
    if (seconds != NULL)
        *seconds = NAN;
    if (g == NULL || seconds == NULL || M < 1 || N < 1 || K < 1 || tactic < 0 || reps < 1 ||
        duet_dtype_size(dtype) == 0)
        return duet_error_set(DUET_ERR_INVALID, "cuda gemm: bad profile arguments");
    const size_t es = duet_dtype_size(dtype);
    duet_status_t st;
    if ((st = duet__prof_buf(&g->prof_x, &g->prof_x_bytes, (size_t)(M * K) * es, stream)) !=
            DUET_OK ||
        (st = duet__prof_buf(&g->prof_w, &g->prof_w_bytes, (size_t)(N * K) * es, stream)) !=
            DUET_OK ||
        (st = duet__prof_buf((void **)&g->prof_y, &g->prof_y_bytes, (size_t)(M * N) * sizeof(float),
                             stream)) != DUET_OK)
        return st;
    for (int i = 0; i < 2; i++)
        if (g->prof_ev[i] == NULL)
            DUET__TRY(cudaEventCreate(&g->prof_ev[i]), "profile event");
    const int saved = g->last_algo;
    /* one untimed call: builds the entry (descriptors, heuristic) and warms the kernel */
    st = duet__matmul_lowp_t(g, stream, g->prof_y, N, 0, g->prof_x, K, 0, M, g->prof_w, dtype, N, K,
                             1, 0, flags, tactic);
    if (st != DUET_OK) {
        g->last_algo = saved;
        return st; /* DUET_ERR_RANGE: no such tactic for the shape */
    }
    DUET__TRY(cudaEventRecord(g->prof_ev[0], stream), "profile event record");
    for (int r = 0; r < reps && st == DUET_OK; r++)
        st = duet__matmul_lowp_t(g, stream, g->prof_y, N, 0, g->prof_x, K, 0, M, g->prof_w, dtype,
                                 N, K, 1, 0, flags, tactic);
    g->last_algo = saved;
    if (st != DUET_OK)
        return st;
    DUET__TRY(cudaEventRecord(g->prof_ev[1], stream), "profile event record");
    DUET__TRY(cudaEventSynchronize(g->prof_ev[1]), "profile event sync");
    float ms = 0.0f;
    DUET__TRY(cudaEventElapsedTime(&ms, g->prof_ev[0], g->prof_ev[1]), "profile elapsed");
    *seconds = (double)ms * 1e-3 / reps;
    return DUET_OK;
}
