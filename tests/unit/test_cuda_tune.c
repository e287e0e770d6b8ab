/*
 * test_cuda_tune.c: the CUDA GEMM's tactics (kernels/cuda/cuda_gemm.h "Tactics", tune op
 * cuda_gemm): tactic t is cuBLASLt's t-th heuristic algorithm for the call's shape.
 *
 *  - Every usable tactic of a few shapes (BF16 and F32 W; M = 16 and M = 200, buckets 9-16 and
 *    65+) against the CPU reference duet_k_matmul, with the bounds test_kernels_cuda.c derives
 *    (err = |y_gpu - y_cpu| / Σ|x·w| per output: BF16 2^-8 + 2e-5, the rounding of x; F32 with
 *    TF32 off 2e-5, fp32 summation order). A tactic changes only the fp32 summation order, so
 *    every tactic meets the default's bound.
 *  - The tuner decides the algorithm: with an entry for the shape the call runs that tactic
 *    (duet_cuda_gemm_last_algo), with an entry past the shape's count, for another bucket or
 *    without a tuner, algo 0.
 *  - duet_cuda_gemm_profile: a time for each usable tactic, DUET_ERR_RANGE and NaN past the count.
 *  - duet_cuda_gemm_tunable: which row counts reach cuBLASLt (the GEMVs' are not tactics).
 * Each case prints its tactics' timings and errors (`--verbose`, `ctest -V`). Without a device
 * the tests skip with a reason. The engine with tune on: test_engine_cuda.c,
 * engine_cuda/tuned_equals_untuned.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <criterion/criterion.h>

#include "kernels/cuda/cuda_gemm.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/kernels.h"
#include "kernels/tune.h"

#define DUET_TEST_RNG_SEED 0x9e3779b97f4a7c15ull
#include "cuda_test_util.h"

static void skip_without_device(void)
{
    skip_without_device_for("the GEMM's tactics are");
}

/* A tuner of the cuda_gemm op holding tactic `tac` for (dt, bucket of M, N, K). */
static duet_tune_t *tuner_with(duet_dtype_t dt, int64_t M, int64_t N, int64_t K, int tac)
{
    duet_tune_space_t sp = {0};
    sp.n_tactics[DUET_TUNE_OP_CUDA_GEMM] = DUET_CUDA_GEMM_TACTICS;
    duet_tune_t *t = NULL;
    DUET_OK_OR_FAIL(duet_tune_create(&sp, "test cuda", &t));
    static const char *const buckets[] = {"1", "2-4", "5-8", "9-16", "17-64", "65+"};
    char text[256];
    snprintf(text, sizeof(text), "duet-tune 1 test cuda\ncuda_gemm %s %s %lld %lld %d\n",
             duet_dtype_name(dt), buckets[duet_tune_m_bucket(M)], (long long)N, (long long)K, tac);
    DUET_OK_OR_FAIL(duet_tune_load_text(t, text, strlen(text), "test"));
    return t;
}

typedef struct {
    duet_dtype_t dt;
    int64_t M, N, K;
    double tol;
} tcase_t;

static const tcase_t cases[] = {
    {DUET_DTYPE_BF16, 16, 384, 256, 0x1p-8 + 2e-5},
    {DUET_DTYPE_BF16, 200, 1000, 512, 0x1p-8 + 2e-5},
    {DUET_DTYPE_F32, 16, 384, 256, 2e-5},
    {DUET_DTYPE_F32, 200, 1000, 512, 2e-5},
    {DUET_DTYPE_BF16, 200, 4096, 2048, 0x1p-8 + 2e-5},
};

Test(cuda_tune, tunable_sizes)
{
    /* no device needed: the routing is host code */
    cr_expect_eq(duet_cuda_gemm_tunable(DUET_DTYPE_BF16, 1, 256, 0), 0, "GEMV");
    cr_expect_eq(duet_cuda_gemm_tunable(DUET_DTYPE_BF16, 8, 256, 0), 0, "tensor-core GEMV");
    cr_expect_eq(duet_cuda_gemm_tunable(DUET_DTYPE_BF16, 9, 256, 0), 1);
    cr_expect_eq(duet_cuda_gemm_tunable(DUET_DTYPE_F32, 8, 256, 0), 0, "GEMV up to 8 F32 rows");
    cr_expect_eq(duet_cuda_gemm_tunable(DUET_DTYPE_F32, 9, 256, 0), 1);
    cr_expect_eq(duet_cuda_gemm_tunable(DUET_DTYPE_F32, 1, 256, DUET_CUDA_GEMM_TF32), 1,
                 "TF32 goes to cuBLASLt");
    cr_expect_eq(duet_cuda_gemm_tunable(DUET_DTYPE_BF16, 1, 250, 0), 1, "K % 8 != 0");
}

Test(cuda_tune, every_tactic_matches_cpu_and_the_tuner_picks_it, .timeout = 600)
{
    skip_without_device();
    duet_kernels_t *cpu = NULL;
    DUET_OK_OR_FAIL(duet_kernels_create(DUET_DEVICE_CPU, 0, &cpu));
    duet_cuda_gemm_t *g = NULL;
    DUET_OK_OR_FAIL(duet_cuda_gemm_create(0, 200 * 2048, &g));
    cudaStream_t s;
    CUDA_OK(cudaStreamCreate(&s));
    int multi = 0; /* shapes with more than one algorithm */
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        const tcase_t *tc = &cases[c];
        const int64_t M = tc->M, N = tc->N, K = tc->K;
        CHECK(duet_cuda_gemm_tunable(tc->dt, M, K, 0));
        const size_t es = duet_dtype_size(tc->dt);
        uint8_t *w = xmalloc((size_t)(N * K) * es);
        float *wf = xmalloc((size_t)(N * K) * sizeof(float));
        for (int64_t i = 0; i < N * K; i++) {
            float v = rng_f();
            if (tc->dt == DUET_DTYPE_F32) {
                ((float *)w)[i] = wf[i] = v;
            } else {
                ((uint16_t *)w)[i] = duet_f32_to_bf16(v);
                wf[i] = duet_bf16_to_f32(((uint16_t *)w)[i]);
            }
        }
        float *x = xmalloc((size_t)(M * K) * sizeof(float));
        float *yc = xmalloc((size_t)(M * N) * sizeof(float));
        float *yg = xmalloc((size_t)(M * N) * sizeof(float));
        for (int64_t i = 0; i < M * K; i++)
            x[i] = rng_f();
        duet_tensor_t wc = {
            .data = w, .dtype = tc->dt, .device = DUET_DEVICE_CPU, .ndim = 2, .shape = {N, K}};
        DUET_OK_OR_FAIL(duet_k_matmul(cpu, yc, N, x, K, M, &wc, 0));
        double *S = xmalloc((size_t)(M * N) * sizeof(double));
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) {
                double a = 0;
                for (int64_t k = 0; k < K; k++)
                    a += fabs((double)x[m * K + k] * wf[n * K + k]);
                S[m * N + n] = a;
            }
        duet_tensor_t wd = wc;
        wd.device = DUET_DEVICE_CUDA;
        wd.data = dev_copy(w, (size_t)(N * K) * es);
        float *dx = dev_copy(x, (size_t)(M * K) * sizeof(float));
        float *dy = dev_alloc((size_t)(M * N) * sizeof(float));

        /* the count: profile every tactic; past it, RANGE and NaN */
        int count = 0;
        double secs[DUET_CUDA_GEMM_TACTICS + 1];
        for (int t = 0; t <= DUET_CUDA_GEMM_TACTICS; t++) {
            duet_status_t st = duet_cuda_gemm_profile(g, s, tc->dt, M, N, K, 0, t, 20, &secs[t]);
            if (st == DUET_OK) {
                CHECK(count == t, "tactic %d usable after an unusable one", t);
                CHECK(isfinite(secs[t]) && secs[t] > 0, "tactic %d: %g s", t, secs[t]);
                count++;
            } else {
                CHECK(st == DUET_ERR_RANGE, "tactic %d: %s: %s", t, duet_status_name(st),
                      duet_error_last());
                CHECK(isnan(secs[t]), "tactic %d past the count: %g", t, secs[t]);
            }
        }
        CHECK(count >= 1 && count <= DUET_CUDA_GEMM_TACTICS, "%d algorithms", count);
        multi += count > 1;

        /* no tuner: algo 0 */
        DUET_OK_OR_FAIL(duet_cuda_gemm_matmul(g, s, dy, N, dx, K, M, &wd, 0, 0));
        CHECK(duet_cuda_gemm_last_algo(g) == 0);
        for (int t = 0; t < DUET_CUDA_GEMM_TACTICS; t++) {
            duet_tune_t *tu = tuner_with(tc->dt, M, N, K, t);
            duet_cuda_gemm_set_tuner(g, tu);
            CUDA_OK(cudaMemsetAsync(dy, 0xff, (size_t)(M * N) * sizeof(float), s)); /* NaNs */
            DUET_OK_OR_FAIL(duet_cuda_gemm_matmul(g, s, dy, N, dx, K, M, &wd, 0, 0));
            const int ran = duet_cuda_gemm_last_algo(g);
            CHECK(ran == (t < count ? t : 0), "tuned to %d of %d, ran %d", t, count, ran);
            CUDA_OK(cudaStreamSynchronize(s));
            CUDA_OK(cudaMemcpy(yg, dy, (size_t)(M * N) * sizeof(float), cudaMemcpyDeviceToHost));
            double max_err = 0;
            for (int64_t i = 0; i < M * N; i++) {
                double d = fabs((double)yg[i] - yc[i]);
                CHECK(d <= tc->tol * S[i] + 1e-6,
                      "%s M=%lld N=%lld K=%lld tactic %d y[%lld]: gpu "
                      "%.9g cpu %.9g S %.4g",
                      duet_dtype_name(tc->dt), (long long)M, (long long)N, (long long)K, t,
                      (long long)i, yg[i], yc[i], S[i]);
                if (S[i] > 0 && d / S[i] > max_err)
                    max_err = d / S[i];
            }
            if (t < count)
                printf("[cuda_tune] %-4s M=%-4lld N=%-5lld K=%-5lld tactic %d of %d: %8.2f us, "
                       "max err %.3g of Σ|x·w| (bound %.3g)\n",
                       duet_dtype_name(tc->dt), (long long)M, (long long)N, (long long)K, t, count,
                       secs[t] * 1e6, max_err, tc->tol);
            duet_cuda_gemm_set_tuner(g, NULL);
            duet_tune_destroy(tu);
        }
        /* an entry for another bucket does not apply */
        duet_tune_t *tu = tuner_with(tc->dt, M > 64 ? 16 : 200, N, K, count - 1);
        duet_cuda_gemm_set_tuner(g, tu);
        DUET_OK_OR_FAIL(duet_cuda_gemm_matmul(g, s, dy, N, dx, K, M, &wd, 0, 0));
        CHECK(duet_cuda_gemm_last_algo(g) == 0, "another bucket's entry applied");
        duet_cuda_gemm_set_tuner(g, NULL);
        duet_tune_destroy(tu);
        CUDA_OK(cudaStreamSynchronize(s));

        cudaFree(dy);
        cudaFree(dx);
        cudaFree(wd.data);
        free(S);
        free(yg);
        free(yc);
        free(x);
        free(wf);
        free(w);
    }
    printf("[cuda_tune] %d of %zu shapes have more than one algorithm\n", multi,
           sizeof(cases) / sizeof(cases[0]));
    duet_cuda_gemm_profile_free(g);
    CUDA_OK(cudaStreamDestroy(s));
    duet_cuda_gemm_destroy(g);
    duet_kernels_destroy(cpu);
}

Test(cuda_tune, profile_refuses_bad_arguments, .timeout = 60)
{
    skip_without_device();
    duet_cuda_gemm_t *g = NULL;
    DUET_OK_OR_FAIL(duet_cuda_gemm_create(0, 0, &g));
    double t = 0;
    CHECK(duet_cuda_gemm_profile(g, 0, DUET_DTYPE_BF16, 0, 16, 16, 0, 0, 1, &t) ==
          DUET_ERR_INVALID);
    CHECK(isnan(t));
    CHECK(duet_cuda_gemm_profile(g, 0, DUET_DTYPE_BF16, 16, 16, 16, 0, -1, 1, &t) ==
          DUET_ERR_INVALID);
    CHECK(duet_cuda_gemm_profile(g, 0, DUET_DTYPE_BF16, 16, 16, 16, 0, DUET_CUDA_GEMM_TACTICS, 1,
                                 &t) == DUET_ERR_RANGE);
    CHECK(isnan(t));
    CHECK(duet_cuda_gemm_last_algo(g) == -1, "profiling is not a call");
    duet_cuda_gemm_destroy(g);
}
