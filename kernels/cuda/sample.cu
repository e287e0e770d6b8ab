/*
 * sample.cu: greedy argmax (duet_cuda_argmax) and sampling with the CPU's rule
 * (duet_cuda_sample). CPU reference: engine/sampler.c.
 *
 * The CPU sorts the candidates by logit (descending, lower index first on ties), keeps the
 * first top_k, takes p_i = expf((l_i - l_max) / T) in float, sums in double, cuts the nucleus
 * where the running sum of p_i / sum first reaches top_p, and returns the first candidate whose
 * running mass exceeds u · (kept mass). The order of the candidates matters, so the GPU sorts
 * too, in three steps, all queued on the stream (no host reads, no allocation):
 *
 *  1. prep, one block per row: arg-max (greedy rows are answered here), then the candidates
 *     are compacted in index order as (descending-order key, index) pairs: only the row's head
 *     (see the prep kernel) when it provably holds the decision, which is the usual case, else
 *     the whole row. Candidates with z = (l - l_max) / T below -(60 + log2 V) ln 2 are always
 *     left out: together they hold less than 2^-60 of the mass (each has p < 2^-60 / V and
 *     sum >= 1, the maximum's own p), below double's rounding of the sums, and one of them can
 *     never be returned since u < 1 - 2^-24 and top_p < 1 - 2^-25 stop the scans before it.
 *  2. cub's segmented radix sort (stable, so equal logits stay in index order: the CPU's tie
 *     rule) on the 32-bit keys, one segment per row.
 *  3. select, one block per row: p_i recomputed exactly as the CPU does (expf via a correctly
 *     rounded double exp; glibc's expf is within 0.502 ulp, so p_i agree to the last bit
 *     except in rare double-rounding cases), the sums and running sums in double in tiles of
 *     8 candidates per thread: each thread adds its 8 in order, a block scan adds the
 *     threads' totals. Only the summation order differs from the CPU's left-to-right loop, so
 *     a token differs only when u · mass (or top_p) falls within ~1e-16 relative of a boundary.
 */
#include <limits.h>
#include <math.h>
#include <stdint.h>

#include <cub/device/device_segmented_radix_sort.cuh>
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_pdl.cuh"

#define DUET__MODULE "cuda sample" /* the prefix of this file's error details */

#define DUET__SAMPLE_THREADS 1024
#define DUET__SAMPLE_PER_T   8                 /* candidates per thread per select tile */
#define DUET__SAMPLE_CUB     ((size_t)1 << 20) /* scratch reserved for cub's temp storage */
#define DUET__SAMPLE_BINS    4096              /* key histogram: the keys' top 12 bits */
#define DUET__SAMPLE_HEAD    16384             /* most candidates in a row's head */

/* ---- block helpers ------------------------------------------------------------------------- */

/* (value, index) order of the CPU's argmax: larger value first, then lower index. */
static __device__ __forceinline__ void duet__argmax_merge(float *v, int *i, float ov, int oi)
{
    if (oi >= 0 && (*i < 0 || ov > *v || (ov == *v && oi < *i))) {
        *v = ov;
        *i = oi;
    }
}

/* Elements [i0, i0 + 4) of row, 16-byte loaded when the row is aligned (`vec`); past V: 0. The
 * passes over a row give each thread groups of 4 consecutive elements, blockDim.x groups apart,
 * so a thread sees its indices in increasing order. */
static __device__ __forceinline__ void duet__load4(const float *row, int V, bool vec, int i0,
                                                   float (&l)[4])
{
    if (vec && i0 + 3 < V) {
        const float4 v = *reinterpret_cast<const float4 *>(row + i0);
        l[0] = v.x;
        l[1] = v.y;
        l[2] = v.z;
        l[3] = v.w;
    } else {
#pragma unroll
        for (int j = 0; j < 4; j++)
            l[j] = i0 + j < V ? row[i0 + j] : 0.0f;
    }
}

/* Arg-max of row[0, V) over the block; every thread gets the index. Each thread scans its
 * elements in increasing order with a strict >, so it keeps its first maximum. */
static __device__ int duet__block_argmax(const float *row, int V)
{
    __shared__ float sv[32];
    __shared__ int si[32];
    const bool vec = ((uintptr_t)row & 15) == 0;
    float best = 0.0f;
    int bi = -1;
#pragma unroll 4
    for (int i0 = 4 * (int)threadIdx.x; i0 < V; i0 += 4 * (int)blockDim.x) {
        float l[4];
        duet__load4(row, V, vec, i0, l);
#pragma unroll
        for (int j = 0; j < 4; j++)
            if (i0 + j < V && (bi < 0 || l[j] > best)) {
                best = l[j];
                bi = i0 + j;
            }
    }
    for (int o = 16; o > 0; o >>= 1)
        duet__argmax_merge(&best, &bi, __shfl_xor_sync(0xffffffffu, best, o),
                           __shfl_xor_sync(0xffffffffu, bi, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) {
        sv[warp] = best;
        si[warp] = bi;
    }
    __syncthreads();
    best = sv[0];
    bi = si[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); w++)
        duet__argmax_merge(&best, &bi, sv[w], si[w]);
    return bi < 0 ? 0 : bi;
}

/* Exclusive prefix sum over the block of one value per thread; *total_p gets the sum. The
 * warp totals are combined in a fixed order, so results do not depend on timing. */
template <typename T> static __device__ T duet__block_scan(T v, T *total_p)
{
    __shared__ T warp_tot[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    T inc = v;
    for (int o = 1; o < 32; o <<= 1) {
        const T nb = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o)
            inc += nb;
    }
    __syncthreads();
    if (lane == 31)
        warp_tot[warp] = inc;
    __syncthreads();
    T base = 0, tot = 0;
    for (int w = 0; w < n_warps; w++) {
        if (w < warp)
            base += warp_tot[w];
        tot += warp_tot[w];
    }
    *total_p = tot;
    return base + (inc - v);
}

/* ---- keys ---------------------------------------------------------------------------------- */

/* Ascending key = descending logit; -0 is taken as +0 (the CPU compares them equal). */
static __device__ __forceinline__ uint32_t duet__desc_key(float f)
{
    uint32_t u = f == 0.0f ? 0u : __float_as_uint(f);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ~u;
}

static __device__ __forceinline__ float duet__key_logit(uint32_t k)
{
    const uint32_t u = ~k;
    return __uint_as_float((u & 0x80000000u) ? (u & 0x7fffffffu) : ~u);
}

/* The CPU's p = expf((l - mx) * inv_t), expf correctly rounded via double. */
static __device__ __forceinline__ float duet__prob(float l, float mx, float inv_t)
{
    return (float)exp((double)__fmul_rn(__fsub_rn(l, mx), inv_t));
}

static __device__ __forceinline__ bool duet__greedy(const duet_cuda_sample_params_t &p)
{
    return p.temperature <= 0.0f || p.top_k == 1;
}

/* ---- argmax -------------------------------------------------------------------------------- */

__global__ void duet__argmax_kernel(const float *logits, int64_t ld, int V, int32_t *out)
{
    duet_pdl_wait(); /* logits and parameters come from earlier work of the step */
    duet_pdl_trigger();
    const int bi = duet__block_argmax(logits + (int64_t)blockIdx.x * ld, V);
    if (threadIdx.x == 0)
        out[blockIdx.x] = bi;
}

extern "C" duet_status_t duet_cuda_argmax(cudaStream_t stream, const float *logits, int64_t ld,
                                          int64_t V, int64_t M, int32_t *out)
{
    if (M < 0 || V <= 0 || V > 0x7fffffff || ld < V || M > 0x7fffffff ||
        (M > 0 && (logits == NULL || out == NULL)))
        return duet_error_set(DUET_ERR_INVALID, "cuda argmax: bad arguments M=%lld V=%lld ld=%lld",
                              (long long)M, (long long)V, (long long)ld);
    if (M == 0)
        return DUET_OK;
    cudaError_t e = duet_pdl_launch(duet__argmax_kernel, dim3((unsigned)M),
                                    dim3(DUET__SAMPLE_THREADS), 0, stream, logits, ld, (int)V, out);
    return e == cudaSuccess ? DUET_OK : duet_cuda_status(e, DUET__MODULE, "argmax kernel launch");
}

/*
 * The same arg-max spread over many blocks (one block alone reads a 160k-entry row slowly:
 * bench/RESULTS.md, "Arg-max over many blocks; sampling sorts only the head"):
 * block (c, r) takes chunk c of row r (DUET__AM_CHUNK-aligned, so 16-byte loads stay aligned)
 * and writes its first maximum; one warp per row then merges the chunks with the CPU's order
 * (larger value, then lower index), which gives the row's first maximum as the one-block kernel
 * does.
 */
#define DUET__AM_THREADS 256
#define DUET__AM_CHUNKS  128

static int64_t duet__am_chunk(int64_t V)
{
    int64_t L = (V + DUET__AM_CHUNKS - 1) / DUET__AM_CHUNKS;
    L = (L + 3) / 4 * 4;
    return L < 1024 ? 1024 : L;
}

__global__ void __launch_bounds__(DUET__AM_THREADS)
    duet__argmax_part_kernel(const float *logits, int64_t ld, int V, int L, int C, float *pv,
                             int32_t *pi)
{
    const int c = blockIdx.x, r = blockIdx.y, c0 = c * L;
    duet_pdl_wait(); /* the logits */
    duet_pdl_trigger();
    const int len = V - c0 < L ? V - c0 : L;
    const int bi = duet__block_argmax(logits + (int64_t)r * ld + c0, len);
    if (threadIdx.x == 0) {
        pv[(int64_t)r * C + c] = logits[(int64_t)r * ld + c0 + bi];
        pi[(int64_t)r * C + c] = c0 + bi;
    }
}

__global__ void duet__argmax_merge_kernel(const float *pv, const int32_t *pi, int C, int32_t *out)
{
    const int r = blockIdx.x, lane = threadIdx.x;
    duet_pdl_wait(); /* the partial maxima */
    duet_pdl_trigger();
    float best = 0.0f;
    int bi = -1;
    for (int c = lane; c < C; c += 32)
        duet__argmax_merge(&best, &bi, pv[(int64_t)r * C + c], pi[(int64_t)r * C + c]);
    for (int o = 16; o > 0; o >>= 1)
        duet__argmax_merge(&best, &bi, __shfl_xor_sync(0xffffffffu, best, o),
                           __shfl_xor_sync(0xffffffffu, bi, o));
    if (lane == 0)
        out[r] = bi < 0 ? 0 : bi;
}

extern "C" size_t duet_cuda_argmax_scratch_bytes(int64_t max_M)
{
    return max_M <= 0 ? 0 : (size_t)max_M * DUET__AM_CHUNKS * 8 + 256;
}

extern "C" duet_status_t duet_cuda_argmax_split(cudaStream_t stream, const float *logits,
                                                int64_t ld, int64_t V, int64_t M, int32_t *out,
                                                void *scratch)
{
    if (M < 0 || V <= 0 || V > 0x7fffffff || ld < V || M > 65535 ||
        (M > 0 && (logits == NULL || out == NULL || scratch == NULL)))
        return duet_error_set(DUET_ERR_INVALID,
                              "cuda argmax_split: bad arguments M=%lld V=%lld ld=%lld",
                              (long long)M, (long long)V, (long long)ld);
    if (M == 0)
        return DUET_OK;
    const int64_t L = duet__am_chunk(V), C = (V + L - 1) / L;
    float *pv = (float *)(((uintptr_t)scratch + 255) & ~(uintptr_t)255);
    int32_t *pi = (int32_t *)(pv + M * C);
    cudaError_t e = duet_pdl_launch(duet__argmax_part_kernel, dim3((unsigned)C, (unsigned)M),
                                    dim3(DUET__AM_THREADS), 0, stream, logits, ld, (int)V, (int)L,
                                    (int)C, pv, pi);
    if (e == cudaSuccess)
        e = duet_pdl_launch(duet__argmax_merge_kernel, dim3((unsigned)M), dim3(32), 0, stream,
                            (const float *)pv, (const int32_t *)pi, (int)C, out);
    return e == cudaSuccess ? DUET_OK : duet_cuda_status(e, DUET__MODULE, "argmax kernel launch");
}

/* ---- sampling ------------------------------------------------------------------------------ */

/*
 * Step 1, one block per row r. Greedy rows get their token and an empty segment. Others write
 * their candidates (z >= zmin) as (key, index) at keys/vals[r * V + j], j < n_r, in index order,
 * and the segment [r * V, r * V + n_r).
 *
 * The head. Sorting a whole row of 160k candidates in one block is far too slow for a decode
 * step (bench/RESULTS.md, "Arg-max over many blocks; sampling sorts only the head"), while the
 * draw almost always lands among the largest few hundred. So a histogram of the candidates'
 * keys (top 12 bits: sign, exponent, 3 mantissa bits) finds the longest run of top bins holding
 * at most DUET__SAMPLE_HEAD candidates, a prefix of the sorted order; only that head is written
 * when it provably contains the decision: top_k <= head size, or (no top_k) its mass exceeds
 * top_p · sum (nucleus) or u · sum (no nucleus) with a 1e-6 margin for summation order. The
 * mass of the rest, which the CPU's sum includes, goes to tail[r] (double). Otherwise the whole
 * row is written, tail[r] = 0.
 */
__global__ void __launch_bounds__(DUET__SAMPLE_THREADS)
    duet__sample_prep_kernel(const float *logits, int64_t ld, int V,
                             const duet_cuda_sample_params_t *params, int32_t *out, uint32_t *keys,
                             int32_t *vals, int *seg_begin, int *seg_end, double *tail)
{
    __shared__ int hist[DUET__SAMPLE_BINS];
    __shared__ int head_bin, head_n;
    const int r = blockIdx.x;
    duet_pdl_wait(); /* logits and parameters come from earlier work of the step */
    duet_pdl_trigger();
    const float *row = logits + (int64_t)r * ld;
    const bool vec = ((uintptr_t)row & 15) == 0;
    const int lane = threadIdx.x & 31;
    const duet_cuda_sample_params_t p = params[r];
    const int bi = duet__block_argmax(row, V);
    const int b0 = r * V;
    if (threadIdx.x == 0) {
        out[r] = bi; /* the answer for greedy rows, and for rows left with no candidate */
        tail[r] = 0.0;
    }
    if (duet__greedy(p)) {
        if (threadIdx.x == 0) {
            seg_begin[r] = b0;
            seg_end[r] = b0;
        }
        return;
    }
    const float mx = row[bi];
    const float inv_t = __fdiv_rn(1.0f, p.temperature);
    const float zmin = -(60.0f + log2f((float)V)) * 0.69314718f;
    const int step = 4 * (int)blockDim.x; /* every lane runs every iteration (warp shuffles) */

    /* histogram of the candidates' key bins; lanes with equal bins add once per warp */
    for (int b = threadIdx.x; b < DUET__SAMPLE_BINS; b += blockDim.x)
        hist[b] = 0;
    if (threadIdx.x == 0) {
        head_bin = -1;
        head_n = 0;
    }
    __syncthreads();
    for (int t0 = 0; t0 < V; t0 += step) {
        const int i0 = t0 + 4 * (int)threadIdx.x;
        float l[4];
        duet__load4(row, V, vec, i0, l);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const bool c = i0 + j < V && __fmul_rn(__fsub_rn(l[j], mx), inv_t) >= zmin;
            const unsigned bin = c ? duet__desc_key(l[j]) >> 20 : DUET__SAMPLE_BINS;
            const unsigned m = __match_any_sync(0xffffffffu, bin);
            if (bin < DUET__SAMPLE_BINS && lane == __ffs(m) - 1)
                atomicAdd(&hist[bin], __popc(m));
        }
    }
    __syncthreads();
    {
        constexpr int PER = DUET__SAMPLE_BINS / DUET__SAMPLE_THREADS;
        int c = 0, tot;
        for (int j = 0; j < PER; j++)
            c += hist[PER * threadIdx.x + j];
        int run = duet__block_scan<int>(c, &tot), cand = -1, cand_n = 0;
        for (int j = 0; j < PER; j++) {
            run += hist[PER * threadIdx.x + j];
            if (run <= DUET__SAMPLE_HEAD) {
                cand = PER * threadIdx.x + j;
                cand_n = run;
            }
        }
        if (cand >= 0)
            atomicMax(&head_bin, cand);
        __syncthreads();
        if (cand >= 0 && cand == head_bin)
            head_n = cand_n;
        __syncthreads();
    }
    const int hb = head_bin;
    const bool limited = p.top_k > 0 && p.top_k < V;
    bool head = hb >= 0 && limited && p.top_k <= head_n;
    double rest = 0.0;
    if (hb >= 0 && !limited) {
        double hs = 0.0, ts = 0.0, tot;
        for (int t0 = 0; t0 < V; t0 += step) {
            const int i0 = t0 + 4 * (int)threadIdx.x;
            float l[4];
            duet__load4(row, V, vec, i0, l);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                if (i0 + j >= V || __fmul_rn(__fsub_rn(l[j], mx), inv_t) < zmin)
                    continue;
                const double pv = (double)duet__prob(l[j], mx, inv_t);
                if ((int)(duet__desc_key(l[j]) >> 20) <= hb)
                    hs += pv;
                else
                    ts += pv;
            }
        }
        (void)duet__block_scan<double>(hs, &tot);
        hs = tot;
        (void)duet__block_scan<double>(ts, &tot);
        ts = tot;
        const double need = (p.top_p < 1.0f ? (double)p.top_p : (double)p.u) * (hs + ts);
        if (hs > need * (1.0 + 1e-6)) {
            head = true;
            rest = ts;
        }
    }

    int base = 0;
    for (int t0 = 0; t0 < V; t0 += step) {
        const int i0 = t0 + 4 * (int)threadIdx.x;
        float l[4];
        bool keep[4];
        int c = 0;
        duet__load4(row, V, vec, i0, l);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            keep[j] = i0 + j < V && __fmul_rn(__fsub_rn(l[j], mx), inv_t) >= zmin &&
                      (!head || (int)(duet__desc_key(l[j]) >> 20) <= hb);
            c += keep[j];
        }
        int tot;
        int at = base + duet__block_scan<int>(c, &tot);
#pragma unroll
        for (int j = 0; j < 4; j++)
            if (keep[j]) {
                keys[b0 + at] = duet__desc_key(l[j]);
                vals[b0 + at] = i0 + j;
                at++;
            }
        base += tot;
    }
    if (threadIdx.x == 0) {
        seg_begin[r] = b0;
        seg_end[r] = b0 + base;
        tail[r] = rest;
    }
}

/*
 * The first i in [0, n) whose running sum of w(i) (in order, double) satisfies
 * (ge ? acc >= thr : acc > thr), or -1. w(i) = p[i] * scale. Tiles of 8 consecutive
 * candidates per thread: the thread's own 8 in order, the threads' totals by a block scan.
 */
static __device__ int duet__block_first_cross(const float *p, int n, double scale, double thr,
                                              bool ge, bool div)
{
    __shared__ int found;
    if (threadIdx.x == 0)
        found = INT_MAX;
    double carry = 0.0;
    for (int t0 = 0; t0 < n; t0 += DUET__SAMPLE_PER_T * (int)blockDim.x) {
        const int i0 = t0 + DUET__SAMPLE_PER_T * (int)threadIdx.x;
        double w[DUET__SAMPLE_PER_T], s = 0.0;
#pragma unroll
        for (int j = 0; j < DUET__SAMPLE_PER_T; j++) {
            w[j] = i0 + j < n ? (div ? (double)p[i0 + j] / scale : (double)p[i0 + j]) : 0.0;
            s += w[j];
        }
        double tot;
        double acc = carry + duet__block_scan<double>(s, &tot);
#pragma unroll
        for (int j = 0; j < DUET__SAMPLE_PER_T; j++) {
            if (i0 + j >= n)
                break;
            acc += w[j];
            if (ge ? acc >= thr : acc > thr) {
                atomicMin(&found, i0 + j);
                break;
            }
        }
        carry += tot;
        __syncthreads();
        if (found != INT_MAX)
            break;
    }
    __syncthreads();
    const int i = found;
    __syncthreads(); /* everyone has read `found` before a next call resets it */
    return i == INT_MAX ? -1 : i;
}

/* Σ p[0, n) in double, tiles as above. */
static __device__ double duet__block_sum(const float *p, int n)
{
    double total = 0.0;
    for (int t0 = 0; t0 < n; t0 += DUET__SAMPLE_PER_T * (int)blockDim.x) {
        const int i0 = t0 + DUET__SAMPLE_PER_T * (int)threadIdx.x;
        double s = 0.0;
#pragma unroll
        for (int j = 0; j < DUET__SAMPLE_PER_T; j++)
            if (i0 + j < n)
                s += (double)p[i0 + j];
        double tot;
        (void)duet__block_scan<double>(s, &tot);
        total += tot;
    }
    return total;
}

/* Step 3: probabilities, nucleus and the draw on the sorted candidates of row r. */
__global__ void __launch_bounds__(DUET__SAMPLE_THREADS)
    duet__sample_select_kernel(int V, const duet_cuda_sample_params_t *params, const uint32_t *keys,
                               const int32_t *vals, const int *seg_begin, const int *seg_end,
                               const double *tail, float *prob, int32_t *out)
{
    const int r = blockIdx.x;
    duet_pdl_wait(); /* logits and parameters come from earlier work of the step */
    duet_pdl_trigger();
    const duet_cuda_sample_params_t p = params[r];
    if (duet__greedy(p))
        return;
    const int b0 = seg_begin[r];
    int n = seg_end[r] - b0;
    const uint32_t *k = keys + b0;
    float *pr = prob + b0;
    if (p.top_k > 0 && p.top_k < V && p.top_k < n)
        n = p.top_k;
    if (n == 0) /* a non-finite maximum (all -inf, or +inf): keep prep's arg-max */
        return;
    const float mx = duet__key_logit(k[0]);
    const float inv_t = __fdiv_rn(1.0f, p.temperature);
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        pr[i] = duet__prob(duet__key_logit(k[i]), mx, inv_t);
    __syncthreads();
    const double sum = duet__block_sum(pr, n) + tail[r]; /* tail: candidates past the head */
    int keep = n;
    double kept = sum;
    if (p.top_p < 1.0f) {
        const int i = duet__block_first_cross(pr, n, sum, (double)p.top_p, true, true);
        if (i >= 0) {
            keep = i + 1;
            kept = duet__block_sum(pr, keep);
        }
    }
    const double target = (double)p.u * kept;
    int i = duet__block_first_cross(pr, keep, 1.0, target, false, false);
    if (i < 0)
        i = keep - 1;
    if (threadIdx.x == 0)
        out[r] = vals[b0 + i];
}

typedef struct {
    size_t keys0, keys1, vals0, vals1, begin, end, tail, cub, total;
} duet__sample_layout_t;

static size_t duet__align256(size_t n)
{
    return (n + 255) & ~(size_t)255;
}

static duet__sample_layout_t duet__sample_layout(int64_t M, int64_t V)
{
    duet__sample_layout_t L;
    const size_t nv = duet__align256((size_t)M * V * 4), nm = duet__align256((size_t)M * 4);
    L.keys0 = 0;
    L.keys1 = L.keys0 + nv;
    L.vals0 = L.keys1 + nv;
    L.vals1 = L.vals0 + nv;
    L.begin = L.vals1 + nv;
    L.end = L.begin + nm;
    L.tail = L.end + nm;
    L.cub = L.tail + duet__align256((size_t)M * sizeof(double));
    L.total = L.cub + DUET__SAMPLE_CUB;
    return L;
}

extern "C" size_t duet_cuda_sample_scratch_bytes(int64_t max_M, int64_t V)
{
    if (max_M < 0 || V < 0)
        return 0;
    return duet__sample_layout(max_M, V).total + 256; /* + 256: base alignment */
}

extern "C" duet_status_t duet_cuda_sample(cudaStream_t stream, const float *logits, int64_t ld,
                                          int64_t V, int64_t M,
                                          const duet_cuda_sample_params_t *params, int32_t *out,
                                          void *scratch)
{
    if (M < 0 || V <= 0 || ld < V || M * V > 0x7fffffff ||
        (M > 0 && (logits == NULL || params == NULL || out == NULL || scratch == NULL)))
        return duet_error_set(DUET_ERR_INVALID, "cuda sample: bad arguments M=%lld V=%lld ld=%lld",
                              (long long)M, (long long)V, (long long)ld);
    if (M == 0)
        return DUET_OK;
    char *base = (char *)(((uintptr_t)scratch + 255) & ~(uintptr_t)255);
    const duet__sample_layout_t L = duet__sample_layout(M, V);
    uint32_t *k0 = (uint32_t *)(base + L.keys0), *k1 = (uint32_t *)(base + L.keys1);
    int32_t *v0 = (int32_t *)(base + L.vals0), *v1 = (int32_t *)(base + L.vals1);
    int *sb = (int *)(base + L.begin), *se = (int *)(base + L.end);
    double *tl = (double *)(base + L.tail);
    cudaError_t e;

    e = duet_pdl_launch(duet__sample_prep_kernel, dim3((unsigned)M), dim3(DUET__SAMPLE_THREADS), 0,
                        stream, logits, ld, (int)V, params, out, k0, v0, sb, se, tl);
    if (e != cudaSuccess)
        return duet_cuda_status(e, DUET__MODULE, "prep kernel launch");

    cub::DoubleBuffer<uint32_t> keys(k0, k1);
    cub::DoubleBuffer<int32_t> vals(v0, v1);
    size_t tmp = 0;
    e = cub::DeviceSegmentedRadixSort::SortPairs(NULL, tmp, keys, vals, (int)(M * V), (int)M, sb,
                                                 se, 0, 32, stream);
    if (e != cudaSuccess)
        return duet_cuda_status(e, DUET__MODULE, "cub sort size query");
    if (tmp > DUET__SAMPLE_CUB)
        return duet_error_set(DUET_ERR_INTERNAL,
                              "cuda sample: cub wants %zu bytes of temp storage, %zu reserved", tmp,
                              DUET__SAMPLE_CUB);
    tmp = DUET__SAMPLE_CUB;
    e = cub::DeviceSegmentedRadixSort::SortPairs(base + L.cub, tmp, keys, vals, (int)(M * V),
                                                 (int)M, sb, se, 0, 32, stream);
    if (e != cudaSuccess)
        return duet_cuda_status(e, DUET__MODULE, "cub segmented sort");

    /* The sort's other key buffer is free again: it holds the probabilities. */
    e = duet_pdl_launch(duet__sample_select_kernel, dim3((unsigned)M), dim3(DUET__SAMPLE_THREADS),
                        0, stream, (int)V, params, (const uint32_t *)keys.Current(),
                        (const int32_t *)vals.Current(), (const int *)sb, (const int *)se,
                        (const double *)tl, (float *)keys.Alternate(), out);
    if (e != cudaSuccess)
        return duet_cuda_status(e, DUET__MODULE, "select kernel launch");
    return DUET_OK;
}
