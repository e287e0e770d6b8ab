/*
 * matmul.c: duet_k_matmul on the CPU: argument checks, the split of y into tasks for the pool,
 * and the choice of instruction-set path (the paths themselves: matmul_scalar.c, matmul_avx2.c,
 * matmul_avx512.c); and the split's tactics for the autotuner (kernels/tune.h).
 *
 * By default work is split over N (rows of W) in chunks of at least 16 rows, several chunks per
 * thread so that a slow thread is covered by the others; for M > 64 also over M in chunks of 64
 * rows, so a prefill's block of x stays in cache while W streams past it. Products below ~64k
 * multiply-adds run on the calling thread: waking the pool would cost more. Which split is fastest
 * depends on the shape and the machine, so with a tuner set (duet_kernels_set_tuner) a tuned shape
 * takes its tactic instead: running inline, or N chunks of whole g-row granules (g = 16 .. 128)
 * with 1, 2 or 4 chunks per thread. Every tactic gives the same bits: the block functions compute
 * each y[m, n] by one fixed sequence of operations whatever block it falls in (matmul_tmpl.h: the
 * K blocking does not depend on the rows, the per-lane FMA chains and the horizontal sum are the
 * same for every tile shape; matmul_scalar.c: per element), so the split only moves work between
 * threads (tests/unit/test_tune.c checks each tactic on each ISA path).
 */
#include <string.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

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

/* Tactics: 0 runs on the calling thread; 1 + 3 * gi + ti splits N into chunks of whole
 * granules of duet__mm_gran[gi] rows with duet__mm_tpt[ti] chunks per thread (M > 64 also in
 * chunks of about 64 rows). The default split is tactic 3 (16 rows, 4 per thread). */
static const int64_t duet__mm_gran[4] = {16, 32, 64, 128};
static const int64_t duet__mm_tpt[3] = {1, 2, 4};
#define DUET__MM_DEFAULT_POOLED 3

int duet__matmul_tactic_for(const struct duet_kernels *k, int64_t M, const duet_tensor_t *w)
{
    duet_tune_key_t key = {.op = DUET_TUNE_OP_CPU_MATMUL,
                           .dtype = (int32_t)w->dtype,
                           .m = duet_tune_m_bucket(M),
                           .n = w->shape[0],
                           .k = w->shape[1]};
    return duet_tune_get(k->tuner, &key);
}

/* Run job j (its fn and operands set) with `tactic`; -1 is the default choice. */
static void duet__matmul_split(struct duet_kernels *k, duet__mm_job_t *j, int tactic)
{
    const int64_t M = j->M, N = j->N, K = j->K;
    if (tactic < 0 || tactic >= DUET__MM_TACTICS) {
        double work = (double)M * (double)N * (double)K;
        tactic = work < 65536.0 ? 0 : DUET__MM_DEFAULT_POOLED;
    }
    if (k->n_threads == 1 || tactic == 0) {
        j->fn(j->dt, j->y, j->ldy, j->x, j->ldx, 0, M, j->w, 0, N, K, j->accumulate);
        return;
    }
    const int64_t gran = duet__mm_gran[(tactic - 1) / 3], tpt = duet__mm_tpt[(tactic - 1) % 3];
    int64_t target = (int64_t)k->n_threads * tpt;
    int64_t n_m = M > 64 ? duet__cdiv(M, 64) : 1;
    if (n_m > target)
        n_m = target;
    int64_t n_n = duet__cdiv(target, n_m);
    if (n_n > duet__cdiv(N, gran))
        n_n = duet__cdiv(N, gran);
    j->mc = duet__cdiv(M, n_m);
    j->nc = duet__cdiv(duet__cdiv(N, n_n), gran) * gran; /* whole granules per chunk */
    j->n_nchunks = duet__cdiv(N, j->nc);
    duet__pool_run(k, duet__cdiv(M, j->mc) * j->n_nchunks, duet__mm_task, j);
}

duet_status_t duet__matmul_tactic(struct duet_kernels *k, float *y, int64_t ldy, const float *x,
                                  int64_t ldx, int64_t M, const duet_tensor_t *w, int accumulate,
                                  int tactic)
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

    if (tactic == DUET__MM_LOOKUP)
        tactic = k->tuner != NULL ? duet__matmul_tactic_for(k, M, w) : -1;
    duet__matmul_split(k, &j, tactic);
    return DUET_OK;
}

duet_status_t duet_k_matmul(duet_kernels_t *k, float *y, int64_t ldy, const float *x, int64_t ldx,
                            int64_t M, const duet_tensor_t *w, int accumulate)
{
    return duet__matmul_tactic(k, y, ldy, x, ldx, M, w, accumulate, DUET__MM_LOOKUP);
}

/* ---- autotuning ------------------------------------------------------------------------------ */

void duet_kernels_set_tuner(duet_kernels_t *k, const duet_tune_t *t)
{
    k->tuner = t;
}

duet_status_t duet_k_matmul_tuner_create(const duet_kernels_t *k, duet_tune_t **t_p)
{
    duet_tune_space_t sp = {0};
    sp.n_tactics[DUET_TUNE_OP_CPU_MATMUL] = DUET__MM_TACTICS;
    char machine[128];
    snprintf(machine, sizeof(machine), "cpu isa=%s threads=%d", duet__isa_name(k->isa),
             k->n_threads);
    return duet_tune_create(&sp, machine, t_p);
}

/* What the profile callback runs: one product per registered key. */
typedef struct {
    duet_tune_key_t key;
    int64_t m;
    const duet_tensor_t *w;
} duet__mm_prof_shape_t;

typedef struct {
    duet_kernels_t *k;
    duet__mm_prof_shape_t *sh;
    int64_t n_sh;
    float *x, *y;
} duet__mm_prof_t;

static double duet__mm_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int duet__mm_dbl_cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double duet__mm_profile(void *user, const duet_tune_key_t *key, int tactic)
{
    const duet__mm_prof_t *p = user;
    const duet__mm_prof_shape_t *s = NULL;
    for (int64_t i = 0; i < p->n_sh && s == NULL; i++)
        if (duet_tune_key_cmp(&p->sh[i].key, key) == 0)
            s = &p->sh[i];
    if (s == NULL)
        return NAN;
    const int64_t N = s->w->shape[0], K = s->w->shape[1];
    /* one warm call (caches, the pool awake), then 5 samples of enough calls for ~200 us each */
    double t0 = duet__mm_now();
    if (duet__matmul_tactic(p->k, p->y, N, p->x, K, s->m, s->w, 0, tactic) != DUET_OK)
        return NAN;
    double one = duet__mm_now() - t0;
    int64_t inner = one > 0 ? (int64_t)(2e-4 / one) : 1000;
    inner = inner < 1 ? 1 : inner > 1000 ? 1000 : inner;
    double samples[5];
    for (int r = 0; r < 5; r++) {
        t0 = duet__mm_now();
        for (int64_t i = 0; i < inner; i++)
            (void)duet__matmul_tactic(p->k, p->y, N, p->x, K, s->m, s->w, 0, tactic);
        samples[r] = (duet__mm_now() - t0) / (double)inner;
    }
    qsort(samples, 5, sizeof(double), duet__mm_dbl_cmp);
    return samples[2];
}

duet_status_t duet_k_matmul_tune(duet_kernels_t *k, duet_tune_t *t,
                                 const duet_k_matmul_shape_t *shapes, int64_t n, duet_comm_t *comm,
                                 duet_tune_stats_t *stats)
{
    duet__mm_prof_t p = {.k = k};
    duet_status_t st = DUET_OK;
    int64_t xmax = 1, ymax = 1;
    int tactics[DUET__MM_TACTICS];
    /* one thread: the pool never runs, every tactic is the inline one */
    const int n_tac = k->n_threads == 1 ? 1 : DUET__MM_TACTICS;
    for (int i = 0; i < n_tac; i++)
        tactics[i] = i;

    p.sh = calloc((size_t)(n > 0 ? n : 1), sizeof(*p.sh));
    if (p.sh == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "matmul tune: out of memory");
    for (int64_t i = 0; i < n; i++) {
        const duet_tensor_t *w = shapes[i].w;
        if (w == NULL || w->ndim != 2 || w->device != DUET_DEVICE_CPU ||
            duet_dtype_size(w->dtype) == 0 || shapes[i].m < 1 || w->shape[0] < 1 ||
            w->shape[1] < 1) {
            st = duet_error_set(DUET_ERR_INVALID,
                                "matmul tune: shape %lld is not an M >= 1 "
                                "product with a 2-D CPU weight",
                                (long long)i);
            goto done;
        }
        duet_tune_key_t key = {.op = DUET_TUNE_OP_CPU_MATMUL,
                               .dtype = (int32_t)w->dtype,
                               .m = duet_tune_m_bucket(shapes[i].m),
                               .n = w->shape[0],
                               .k = w->shape[1]};
        int64_t at = 0;
        while (at < p.n_sh && duet_tune_key_cmp(&p.sh[at].key, &key) != 0)
            at++;
        if (at == p.n_sh) {
            p.sh[p.n_sh++] = (duet__mm_prof_shape_t){.key = key, .m = shapes[i].m, .w = w};
            if ((st = duet_tune_add(t, &key, tactics, n_tac)) != DUET_OK)
                goto done;
        } else if (shapes[i].m > p.sh[at].m) {
            p.sh[at].m = shapes[i].m;
        }
        if (p.sh[at].m * w->shape[1] > xmax)
            xmax = p.sh[at].m * w->shape[1];
        if (p.sh[at].m * w->shape[0] > ymax)
            ymax = p.sh[at].m * w->shape[0];
    }
    p.x = malloc(sizeof(float) * (size_t)xmax);
    p.y = malloc(sizeof(float) * (size_t)ymax);
    if (p.x == NULL || p.y == NULL) {
        st = duet_error_set(DUET_ERR_NOMEM, "matmul tune: out of memory");
        goto done;
    }
    /* small finite inputs: the timing must not depend on denormals or NaNs */
    for (int64_t i = 0; i < xmax; i++)
        p.x[i] = (float)((i * 37) % 101 - 50) * (1.0f / 64.0f);
    st = duet_tune_run(t, comm, duet__mm_profile, &p, stats);

done:
    free(p.sh);
    free(p.x);
    free(p.y);
    return st;
}
