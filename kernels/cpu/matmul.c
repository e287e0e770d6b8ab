/*
 * matmul.c: duet_k_matmul on the CPU: argument checks, the split of y into tasks for the pool,
 * and the choice of instruction-set path (the paths themselves: matmul_scalar.c, matmul_avx2.c,
 * matmul_avx512.c).
 *
 * Work is split over N (rows of W) in chunks of at least 16 rows, several chunks per thread so
 * that a slow thread is covered by the others; for M > 64 also over M in chunks of 64 rows, so a
 * prefill's block of x stays in cache while W streams past it. Products below ~64k multiply-adds
 * run on the calling thread: waking the pool would cost more.
 */
#include <string.h>

#include "common/log.h"
#include "kernels/cpu/cpu_impl.h"
#include "kernels/cpu/matmul_impl.h"

typedef struct {
    duet__matmul_block_fn fn;
    duet_dtype_t dt;
    float *y;
    int64_t ldy;
    const float *x;
    int64_t ldx;
    int64_t M, N, K;
    const void *w;
    int accumulate;
    int64_t mc, nc;    /* chunk sizes */
    int64_t n_nchunks; /* chunks along N */
} duet__mm_job_t;

static void duet__mm_task(void *ctx, int64_t t, int thread_idx)
{
    const duet__mm_job_t *j = ctx;
    int64_t mi = t / j->n_nchunks, ni = t % j->n_nchunks;
    int64_t m0 = mi * j->mc, m1 = m0 + j->mc < j->M ? m0 + j->mc : j->M;
    int64_t n0 = ni * j->nc, n1 = n0 + j->nc < j->N ? n0 + j->nc : j->N;
    j->fn(j->dt, j->y, j->ldy, j->x, j->ldx, m0, m1, j->w, n0, n1, j->K, j->accumulate);
}

static int64_t duet__cdiv(int64_t a, int64_t b)
{
    return (a + b - 1) / b;
}

duet_status_t duet_k_matmul(duet_kernels_t *k, float *y, int64_t ldy, const float *x, int64_t ldx,
                            int64_t M, const duet_tensor_t *w, int accumulate)
{
    if (w == NULL || w->ndim != 2 || w->device != DUET_DEVICE_CPU || duet_dtype_size(w->dtype) == 0)
        return duet_error_set(DUET_ERR_INVALID,
                              "matmul: weight must be a 2-D CPU tensor of F32, BF16 or F16");
    int64_t N = w->shape[0], K = w->shape[1];
    if (M < 0 || N < 0 || K < 0 || ldx < K || ldy < N)
        return duet_error_set(
            DUET_ERR_INVALID, "matmul: bad shape M=%lld N=%lld K=%lld ldx=%lld ldy=%lld",
            (long long)M, (long long)N, (long long)K, (long long)ldx, (long long)ldy);
    if (M == 0 || N == 0)
        return DUET_OK;
    if (K == 0) {
        if (!accumulate)
            for (int64_t m = 0; m < M; m++)
                memset(y + m * ldy, 0, (size_t)N * sizeof(*y));
        return DUET_OK;
    }

    duet__mm_job_t j = {
        .dt = w->dtype,
        .y = y,
        .ldy = ldy,
        .x = x,
        .ldx = ldx,
        .M = M,
        .N = N,
        .K = K,
        .w = w->data,
        .accumulate = accumulate,
    };
    switch (k->isa) {
    case DUET__ISA_AVX512:
        j.fn = duet__matmul_block_avx512;
        break;
    case DUET__ISA_AVX2:
        j.fn = duet__matmul_block_avx2;
        break;
    default:
        j.fn = duet__matmul_block_scalar;
        break;
    }

    double work = (double)M * (double)N * (double)K;
    if (k->n_threads == 1 || work < 65536.0) {
        j.fn(j.dt, y, ldy, x, ldx, 0, M, j.w, 0, N, K, accumulate);
        return DUET_OK;
    }

    int64_t target = (int64_t)k->n_threads * 4;
    int64_t n_m = M > 64 ? duet__cdiv(M, 64) : 1;
    if (n_m > target)
        n_m = target;
    int64_t n_n = duet__cdiv(target, n_m);
    if (n_n > duet__cdiv(N, 16))
        n_n = duet__cdiv(N, 16);
    j.mc = duet__cdiv(M, n_m);
    j.nc = duet__cdiv(duet__cdiv(N, n_n), 16) * 16; /* whole tiles per chunk */
    j.n_nchunks = duet__cdiv(N, j.nc);
    duet__pool_run(k, duet__cdiv(M, j.mc) * j.n_nchunks, duet__mm_task, &j);
    return DUET_OK;
}
