/*
 * test_kernels_cuda.c: the cuBLASLt GEMM (kernels/cuda/cuda_gemm.h) against the CPU reference
 * duet_k_matmul on the same inputs: M in {1, 3, 64, 257}, N and K including non-multiples of
 * 8/16, padded strides and a weight that is a misaligned view of rows of a larger matrix,
 * accumulate on and off, BF16 / F16 / F32 weights (F32 with TF32 off and on). Without a CUDA
 * device (this build VM, CI) the GPU tests skip with a reason and the error test checks that
 * create fails cleanly instead.
 *
 * Error measure. For each output, err = |y_gpu - y_cpu| / S with S = Σ_k |x_k·w_k| (+ |y0| when
 * accumulating): the rounding bound of a dot product is proportional to S, not to |y|, which
 * can cancel to ~0. The tolerances follow from what differs between the two paths:
 *   BF16 W: the GPU rounds x to bf16 (unit roundoff 2^-8), the CPU keeps x in fp32 and widens W
 *           exactly, so each product differs by at most 2^-8 relative: tol 2^-8 + 2e-5.
 *   F16 W:  the same with f16's unit roundoff 2^-11: tol 2^-11 + 2e-5.
 *   F32 W, TF32 off: both fp32 with fp32 accumulation in different orders; the difference is a
 *           few ulps times sqrt(K) in practice (the worst-case bound K·2^-24 is 1.4e-4 at
 *           K = 2304): tol 2e-5.
 *   F32 W, TF32 on: both x and W rounded to TF32 (10 stored bits, 2^-11 each, 2^-10 if
 *           truncated): tol 2^-9 + 2e-5.
 * The 2e-5 term covers the fp32 accumulation-order difference; an absolute 1e-6 covers
 * outputs whose S is itself tiny (f16 subnormals in x). Each case prints its max error on stdout
 * (`--verbose` / `ctest -V`), and a summary per dtype closes the run.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <criterion/criterion.h>

#include "kernels/cuda/cuda_gemm.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/kernels.h"

#define DUET_TEST_RNG_SEED 0x2545f4914f6cdd1dull
#include "cuda_test_util.h"

static void skip_without_device(void)
{
    skip_without_device_for("the cuBLASLt GEMM is");
}

/* ---- errors -----------------------------------------------------------------------------------
 */

Test(kernels_cuda, create_and_errors, .timeout = 60)
{
    duet_cuda_gemm_t *g = NULL;
    duet_status_t st = duet_cuda_gemm_create(0, 16, &g);
    if (duet_cuda_device_count() == 0) {
        /* No device: a clear status and message, no crash, no handle. */
        CHECK(st == DUET_ERR_DEVICE, "got %s", duet_status_name(st));
        CHECK(g == NULL);
        CHECK(strstr(duet_error_last(), "no CUDA device") != NULL, "%s", duet_error_last());
        printf("[kernels_cuda] no device: create -> %s: %s\n", duet_status_name(st),
               duet_error_last());
        return;
    }
    CHECK(st == DUET_OK, "create: %s", duet_error_last());

    float *y = dev_alloc(64 * sizeof(float)), *x = dev_alloc(64 * sizeof(float));
    uint16_t host_w[16];
    duet_tensor_t w = {.data = host_w,
                       .dtype = DUET_DTYPE_BF16,
                       .device = DUET_DEVICE_CPU,
                       .ndim = 2,
                       .shape = {4, 4}};
    /* A CPU weight is refused. */
    st = duet_cuda_gemm_matmul(g, 0, y, 4, x, 4, 2, &w, 0, 0);
    CHECK(st == DUET_ERR_INVALID, "%s", duet_status_name(st));
    /* Bad strides are refused. */
    w.device = DUET_DEVICE_CUDA;
    w.data = dev_alloc(16 * sizeof(uint16_t));
    st = duet_cuda_gemm_matmul(g, 0, y, 3, x, 4, 2, &w, 0, 0);
    CHECK(st == DUET_ERR_INVALID, "%s", duet_status_name(st));
    /* x larger than the staging buffer (16 elements) is refused with RANGE, naming the fix. */
    st = duet_cuda_gemm_matmul(g, 0, y, 4, x, 4, 5, &w, 0, 0);
    CHECK(st == DUET_ERR_RANGE, "%s", duet_status_name(st));
    CHECK(strstr(duet_error_last(), "max_x_elems") != NULL, "%s", duet_error_last());
    /* An F32 weight needs no staging. */
    w.dtype = DUET_DTYPE_F32;
    cudaFree(w.data);
    w.data = dev_alloc(16 * sizeof(float));
    st = duet_cuda_gemm_matmul(g, 0, y, 4, x, 4, 5, &w, 0, 0);
    CHECK(st == DUET_OK, "%s: %s", duet_status_name(st), duet_error_last());
    CUDA_OK(cudaDeviceSynchronize());
    cudaFree(w.data);
    cudaFree(x);
    cudaFree(y);
    duet_cuda_gemm_destroy(g);
    duet_cuda_gemm_destroy(NULL);
}

/* ---- GEMM vs CPU --------------------------------------------------------------------------------
 */

typedef struct {
    duet_dtype_t dt;
    unsigned flags;
    const char *name;
    double tol;
} gemm_mode_t;

typedef struct {
    double max_err; /* max |gpu - cpu| / S over outputs */
    double max_rel; /* max |gpu - cpu| / |cpu| over outputs with |cpu| >= 1e-2 S (for reading) */
} err_t;

/*
 * One case: W = rows [row0, row0 + N) of a [N + row0, K] matrix, x [M, ldx], y [M, ldy];
 * returns the errors against duet_k_matmul on the same inputs.
 */
static err_t run_case(duet_kernels_t *cpu, duet_cuda_gemm_t *g, const gemm_mode_t *md, int64_t M,
                      int64_t N, int64_t K, int64_t ldx, int64_t ldy, int64_t row0, int accumulate)
{
    size_t es = duet_dtype_size(md->dt);
    int64_t wrows = N + row0;
    uint8_t *w = xmalloc((size_t)(wrows * K) * es);
    float *wf = xmalloc((size_t)(wrows * K) * sizeof(float)); /* W widened, for S */
    for (int64_t i = 0; i < wrows * K; i++) {
        float v = rng_f();
        if (md->dt == DUET_DTYPE_F32) {
            ((float *)w)[i] = v;
            wf[i] = v;
        } else if (md->dt == DUET_DTYPE_BF16) {
            ((uint16_t *)w)[i] = duet_f32_to_bf16(v);
            wf[i] = duet_bf16_to_f32(((uint16_t *)w)[i]);
        } else {
            ((uint16_t *)w)[i] = duet_f32_to_f16(v);
            wf[i] = duet_f16_to_f32(((uint16_t *)w)[i]);
        }
    }
    float *x = xmalloc((size_t)(M * ldx) * sizeof(float));
    float *y0 = xmalloc((size_t)(M * ldy) * sizeof(float));
    float *yc = xmalloc((size_t)(M * ldy) * sizeof(float));
    float *yg = xmalloc((size_t)(M * ldy) * sizeof(float));
    for (int64_t i = 0; i < M * ldx; i++)
        x[i] = rng_f();
    for (int64_t i = 0; i < M * ldy; i++)
        y0[i] = rng_f();
    memcpy(yc, y0, (size_t)(M * ldy) * sizeof(float));

    duet_tensor_t wc = {.data = w + (size_t)(row0 * K) * es,
                        .dtype = md->dt,
                        .device = DUET_DEVICE_CPU,
                        .ndim = 2,
                        .shape = {N, K}};
    duet_status_t st = duet_k_matmul(cpu, yc, ldy, x, ldx, M, &wc, accumulate);
    CHECK(st == DUET_OK, "cpu matmul: %s", duet_error_last());

    uint8_t *dw = dev_alloc((size_t)(wrows * K) * es);
    float *dx = dev_alloc((size_t)(M * ldx) * sizeof(float));
    float *dy = dev_alloc((size_t)(M * ldy) * sizeof(float));
    CUDA_OK(cudaMemcpy(dw, w, (size_t)(wrows * K) * es, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dx, x, (size_t)(M * ldx) * sizeof(float), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dy, y0, (size_t)(M * ldy) * sizeof(float), cudaMemcpyHostToDevice));
    duet_tensor_t wd = wc;
    wd.data = dw + (size_t)(row0 * K) * es;
    wd.device = DUET_DEVICE_CUDA;
    st = duet_cuda_gemm_matmul(g, 0, dy, ldy, dx, ldx, M, &wd, accumulate, md->flags);
    CHECK(st == DUET_OK, "cuda matmul %s M=%lld N=%lld K=%lld: %s", md->name, (long long)M,
          (long long)N, (long long)K, duet_error_last());
    CUDA_OK(cudaMemcpy(yg, dy, (size_t)(M * ldy) * sizeof(float), cudaMemcpyDeviceToHost));

    err_t e = {0, 0};
    for (int64_t m = 0; m < M; m++) {
        for (int64_t n = 0; n < ldy; n++) {
            size_t i = (size_t)(m * ldy + n);
            if (n >= N) { /* padding between rows must be untouched */
                CHECK(yg[i] == y0[i], "padding y[%lld, %lld] written", (long long)m, (long long)n);
                continue;
            }
            const float *wr = wf + (row0 + n) * K;
            double S = accumulate ? fabs(y0[i]) : 0.0;
            for (int64_t k = 0; k < K; k++)
                S += fabs((double)x[m * ldx + k] * wr[k]);
            double d = fabs((double)yg[i] - yc[i]);
            CHECK(d <= md->tol * S + 1e-6,
                  "%s M=%lld N=%lld K=%lld acc=%d y[%lld, %lld]: gpu %.9g cpu %.9g S %.4g",
                  md->name, (long long)M, (long long)N, (long long)K, accumulate, (long long)m,
                  (long long)n, yg[i], yc[i], S);
            if (S > 0 && d / S > e.max_err)
                e.max_err = d / S;
            if (fabs(yc[i]) >= 1e-2 * S && S > 0 && d / fabs(yc[i]) > e.max_rel)
                e.max_rel = d / fabs(yc[i]);
        }
    }
    cudaFree(dy);
    cudaFree(dx);
    cudaFree(dw);
    free(yg);
    free(yc);
    free(y0);
    free(x);
    free(wf);
    free(w);
    return e;
}

Test(kernels_cuda, matmul_vs_cpu, .timeout = 600)
{
    skip_without_device();

    static const gemm_mode_t modes[] = {
        {DUET_DTYPE_BF16, 0, "BF16", 1.0 / 256 + 2e-5},
        {DUET_DTYPE_F16, 0, "F16", 1.0 / 2048 + 2e-5},
        {DUET_DTYPE_F32, 0, "F32", 2e-5},
        {DUET_DTYPE_F32, DUET_CUDA_GEMM_TF32, "F32+TF32", 1.0 / 512 + 2e-5},
    };
    static const int64_t Ms[] = {1, 3, 64, 257};
    static const struct {
        int64_t N, K;
    } shapes[] = {{1, 1}, {8, 16}, {17, 33}, {64, 64}, {129, 250}, {1000, 515}, {384, 2304}};

    duet_kernels_t *cpu = NULL;
    duet_status_t st = duet_kernels_create(DUET_DEVICE_CPU, 0, &cpu);
    CHECK(st == DUET_OK, "cpu create: %s", duet_error_last());
    duet_cuda_gemm_t *g = NULL;
    st = duet_cuda_gemm_create(0, 257 * (2304 + 7), &g);
    CHECK(st == DUET_OK, "cuda create: %s", duet_error_last());

    printf("[kernels_cuda] cuBLASLt GEMM vs CPU duet_k_matmul; err = max |gpu-cpu| / sum|x*w|, "
           "rel = max |gpu-cpu| / |cpu|\n");
    for (size_t mi = 0; mi < sizeof(modes) / sizeof(modes[0]); mi++) {
        const gemm_mode_t *md = &modes[mi];
        double worst = 0, worst_rel = 0;
        int n_case = 0;
        for (size_t si = 0; si < sizeof(shapes) / sizeof(shapes[0]); si++) {
            for (size_t a = 0; a < sizeof(Ms) / sizeof(Ms[0]); a++) {
                int64_t M = Ms[a], N = shapes[si].N, K = shapes[si].K;
                /* Every other case: padded strides and a weight view one row in (misaligned). */
                int odd = (int)((si + a) & 1);
                int64_t ldx = odd ? K + 3 : K, ldy = odd ? N + 5 : N, row0 = odd ? 1 : 0;
                err_t e0 = run_case(cpu, g, md, M, N, K, ldx, ldy, row0, 0);
                err_t e1 = run_case(cpu, g, md, M, N, K, ldx, ldy, row0, 1);
                printf("[kernels_cuda] %-8s M=%-3lld N=%-4lld K=%-4lld %s err acc0 %.2e acc1 %.2e "
                       "rel %.2e/%.2e (tol %.1e)\n",
                       md->name, (long long)M, (long long)N, (long long)K,
                       odd ? "strided" : "dense  ", e0.max_err, e1.max_err, e0.max_rel, e1.max_rel,
                       md->tol);
                worst = fmax(worst, fmax(e0.max_err, e1.max_err));
                worst_rel = fmax(worst_rel, fmax(e0.max_rel, e1.max_rel));
                n_case += 2;
            }
        }
        printf("[kernels_cuda] SUMMARY %-8s %d cases: max err %.3e (tol %.2e), max rel %.3e\n",
               md->name, n_case, worst, md->tol, worst_rel);
        fflush(stdout);
    }
    duet_cuda_gemm_destroy(g);
    duet_kernels_destroy(cpu);
}

/* The same call twice (second from the algorithm cache) gives bit-identical results. */
Test(kernels_cuda, cached_call_is_deterministic, .timeout = 60)
{
    skip_without_device();
    const int64_t M = 64, N = 200, K = 96;
    duet_cuda_gemm_t *g = NULL;
    duet_status_t st = duet_cuda_gemm_create(0, M * K, &g);
    CHECK(st == DUET_OK, "create: %s", duet_error_last());
    uint16_t *w = xmalloc((size_t)(N * K) * sizeof(*w));
    float *x = xmalloc((size_t)(M * K) * sizeof(*x));
    float *y1 = xmalloc((size_t)(M * N) * sizeof(*y1)),
          *y2 = xmalloc((size_t)(M * N) * sizeof(*y2));
    for (int64_t i = 0; i < N * K; i++)
        w[i] = duet_f32_to_bf16(rng_f());
    for (int64_t i = 0; i < M * K; i++)
        x[i] = rng_f();
    void *dw = dev_alloc((size_t)(N * K) * sizeof(*w));
    float *dx = dev_alloc((size_t)(M * K) * sizeof(*x)), *dy = dev_alloc((size_t)(M * N) * 4);
    CUDA_OK(cudaMemcpy(dw, w, (size_t)(N * K) * sizeof(*w), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dx, x, (size_t)(M * K) * sizeof(*x), cudaMemcpyHostToDevice));
    duet_tensor_t wd = {.data = dw,
                        .dtype = DUET_DTYPE_BF16,
                        .device = DUET_DEVICE_CUDA,
                        .ndim = 2,
                        .shape = {N, K}};
    CHECK(duet_cuda_gemm_matmul(g, 0, dy, N, dx, K, M, &wd, 0, 0) == DUET_OK, "%s",
          duet_error_last());
    CUDA_OK(cudaMemcpy(y1, dy, (size_t)(M * N) * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemset(dy, 0xff, (size_t)(M * N) * 4));
    CHECK(duet_cuda_gemm_matmul(g, 0, dy, N, dx, K, M, &wd, 0, 0) == DUET_OK, "%s",
          duet_error_last());
    CUDA_OK(cudaMemcpy(y2, dy, (size_t)(M * N) * 4, cudaMemcpyDeviceToHost));
    CHECK(memcmp(y1, y2, (size_t)(M * N) * 4) == 0, "cached call differs");
    cudaFree(dy);
    cudaFree(dx);
    cudaFree(dw);
    free(y2);
    free(y1);
    free(x);
    free(w);
    duet_cuda_gemm_destroy(g);
}

/*
 * duet_cuda_gemm_matmul_batched (per-head MLA products) and duet_cuda_gemm_matmul_multi (a
 * decode step's products of one input) against duet_k_matmul entry by entry: M = 1 and 2 take
 * the GEMV (one launch); at M = 5 the BF16 products take the tensor-core GEMV and the F32 one
 * cuBLASLt (a multi call of mixed paths runs one call per product). Same S-relative measure and
 * tolerances as above (BF16:
 * 2^-8 + 2e-5, which the GEMV, keeping x in fp32, is far inside; F32: 2e-5).
 */
static double check_rows(const float *g, const float *c, const float *x, int64_t ldx,
                         const float *wf, int64_t M, int64_t N, int64_t K, int64_t ldy, double tol,
                         const char *what)
{
    double worst = 0;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            double S = 0;
            for (int64_t k = 0; k < K; k++)
                S += fabs((double)x[m * ldx + k] * wf[n * K + k]);
            double d = fabs((double)g[m * ldy + n] - c[m * ldy + n]);
            CHECK(d <= tol * S + 1e-6, "%s M=%lld y[%lld, %lld]: gpu %.9g cpu %.9g", what,
                  (long long)M, (long long)m, (long long)n, g[m * ldy + n], c[m * ldy + n]);
            worst = S > 0 && d / S > worst ? d / S : worst;
        }
    return worst;
}

/* Random BF16 weights [B][N][K] (*wf_p: their exact fp32 values) and the CPU's products
 * yc + b·sy = x + b·sx times entry b, rows ldx / ldy apart. */
static uint16_t *bf16_weights_and_ref(duet_kernels_t *cpu, int64_t B, int64_t N, int64_t K,
                                      const float *x, int64_t ldx, int64_t sx, int64_t M, float *yc,
                                      int64_t ldy, int64_t sy, float **wf_p)
{
    uint16_t *w = xmalloc((size_t)(B * N * K) * 2);
    float *wf = xmalloc((size_t)(B * N * K) * 4);
    for (int64_t i = 0; i < B * N * K; i++) {
        w[i] = duet_f32_to_bf16(rng_f());
        wf[i] = duet_bf16_to_f32(w[i]);
    }
    for (int64_t b = 0; b < B; b++) {
        duet_tensor_t wc = {.data = w + b * N * K,
                            .dtype = DUET_DTYPE_BF16,
                            .device = DUET_DEVICE_CPU,
                            .ndim = 2,
                            .shape = {N, K}};
        CHECK(duet_k_matmul(cpu, yc + b * sy, ldy, x + b * sx, ldx, M, &wc, 0) == DUET_OK);
    }
    *wf_p = wf;
    return w;
}

/* An accumulating F32 product y2 (+)= x · W2ᵀ beside others in a multi call: random W2 [N2][K]
 * and y2, the CPU's result, device copies and the op reading the device x. */
typedef struct {
    int64_t N2, K, M;
    float *w2, *y2c, *dw2, *dy2;
    duet_tensor_t wd;
} f32_acc_op_t;

static duet_cuda_gemm_op_t f32_acc_op_make(f32_acc_op_t *o, duet_kernels_t *cpu, int64_t N2,
                                           int64_t K, const float *x, const float *dx, int64_t ldx,
                                           int64_t M)
{
    o->N2 = N2, o->K = K, o->M = M;
    o->w2 = xmalloc((size_t)(N2 * K) * 4);
    o->y2c = xmalloc((size_t)(M * N2) * 4);
    for (int64_t i = 0; i < N2 * K; i++)
        o->w2[i] = rng_f();
    for (int64_t i = 0; i < M * N2; i++)
        o->y2c[i] = rng_f();
    o->dw2 = dev_copy(o->w2, (size_t)(N2 * K) * 4);
    o->dy2 = dev_copy(o->y2c, (size_t)(M * N2) * 4);
    duet_tensor_t wc = {.data = o->w2,
                        .dtype = DUET_DTYPE_F32,
                        .device = DUET_DEVICE_CPU,
                        .ndim = 2,
                        .shape = {N2, K}};
    CHECK(duet_k_matmul(cpu, o->y2c, N2, x, ldx, M, &wc, 1) == DUET_OK);
    o->wd = wc;
    o->wd.data = o->dw2;
    o->wd.device = DUET_DEVICE_CUDA;
    return (duet_cuda_gemm_op_t){
        .y = o->dy2, .ldy = N2, .x = dx, .ldx = ldx, .w = &o->wd, .accumulate = 1};
}

/* The device result against the CPU's (its S excludes y0, so 2e-5 relative plus 1e-5); frees. */
static double f32_acc_op_check(f32_acc_op_t *o, const float *x, int64_t ldx, const char *what)
{
    float *y2g = xmalloc((size_t)(o->M * o->N2) * 4);
    CUDA_OK(cudaMemcpy(y2g, o->dy2, (size_t)(o->M * o->N2) * 4, cudaMemcpyDeviceToHost));
    const double e =
        check_rows(y2g, o->y2c, x, ldx, o->w2, o->M, o->N2, o->K, o->N2, 2e-5 + 1e-5, what);
    cudaFree(o->dw2), cudaFree(o->dy2);
    free(o->w2), free(o->y2c), free(y2g);
    return e;
}

Test(kernels_cuda, batched_and_multi_vs_cpu, .timeout = 120)
{
    skip_without_device();
    duet_kernels_t *cpu = NULL;
    duet_cuda_gemm_t *g = NULL;
    CHECK(duet_kernels_create(DUET_DEVICE_CPU, 1, &cpu) == DUET_OK);
    CHECK(duet_cuda_gemm_create(0, 1 << 16, &g) == DUET_OK, "%s", duet_error_last());
    const int64_t B = 3, N = 40, K = 48, sx = 56, ldx = B * sx, sy = N, ldy = B * N;
    const double tol = 1.0 / 256 + 2e-5;
    double worst_b = 0, worst_m = 0;
    for (int64_t M = 1; M <= 5; M += M == 2 ? 3 : 1) {
        /* batched, BF16 W [B][N][K] */
        float *wf, *x = xmalloc((size_t)(M * ldx) * 4);
        float *yc = xmalloc((size_t)(M * ldy) * 4), *yg = xmalloc((size_t)(M * ldy) * 4);
        for (int64_t i = 0; i < M * ldx; i++)
            x[i] = rng_f();
        uint16_t *w = bf16_weights_and_ref(cpu, B, N, K, x, ldx, sx, M, yc, ldy, sy, &wf);
        void *dw = dev_copy(w, (size_t)(B * N * K) * 2);
        float *dx = dev_copy(x, (size_t)(M * ldx) * 4), *dy = dev_alloc((size_t)(M * ldy) * 4);
        duet_tensor_t wd = {.data = dw,
                            .dtype = DUET_DTYPE_BF16,
                            .device = DUET_DEVICE_CUDA,
                            .ndim = 3,
                            .shape = {B, N, K}};
        duet_status_t st =
            duet_cuda_gemm_matmul_batched(g, 0, dy, ldy, sy, dx, ldx, sx, M, &wd, 0, 0);
        CHECK(st == DUET_OK, "batched M=%lld: %s", (long long)M, duet_error_last());
        CUDA_OK(cudaMemcpy(yg, dy, (size_t)(M * ldy) * 4, cudaMemcpyDeviceToHost));
        for (int64_t b = 0; b < B; b++) {
            double e = check_rows(yg + b * sy, yc + b * sy, x + b * sx, ldx, wf + b * N * K, M, N,
                                  K, ldy, tol, "batched");
            worst_b = e > worst_b ? e : worst_b;
        }

        /* multi: an F32 and a BF16 weight reading x, the second accumulating */
        const int64_t N2 = 24;
        duet_tensor_t w1c = {.data = w,
                             .dtype = DUET_DTYPE_BF16,
                             .device = DUET_DEVICE_CPU,
                             .ndim = 2,
                             .shape = {N, K}};
        CHECK(duet_k_matmul(cpu, yc, N, x, ldx, M, &w1c, 0) == DUET_OK);
        duet_tensor_t w1d = {.data = dw,
                             .dtype = DUET_DTYPE_BF16,
                             .device = DUET_DEVICE_CUDA,
                             .ndim = 2,
                             .shape = {N, K}};
        f32_acc_op_t acc;
        const duet_cuda_gemm_op_t ops[2] = {{.y = dy, .ldy = N, .x = dx, .ldx = ldx, .w = &w1d},
                                            f32_acc_op_make(&acc, cpu, N2, K, x, dx, ldx, M)};
        st = duet_cuda_gemm_matmul_multi(g, 0, M, ops, 2, 0);
        CHECK(st == DUET_OK, "multi M=%lld: %s", (long long)M, duet_error_last());
        CUDA_OK(cudaMemcpy(yg, dy, (size_t)(M * N) * 4, cudaMemcpyDeviceToHost));
        double e1 = check_rows(yg, yc, x, ldx, wf, M, N, K, N, tol, "multi bf16");
        double e2 = f32_acc_op_check(&acc, x, ldx, "multi f32 acc");
        worst_m = e1 > worst_m ? e1 : worst_m;
        worst_m = e2 > worst_m ? e2 : worst_m;
        cudaFree(dw);
        cudaFree(dx);
        cudaFree(dy);
        free(w), free(wf), free(x), free(yc), free(yg);
    }
    printf("batched (B=3) max err %.3g, multi max err %.3g (M = 1, 2: GEMV; 5: tensor-core GEMV "
           "and cuBLASLt)\n",
           worst_b, worst_m);
    duet_cuda_gemm_destroy(g);
    duet_kernels_destroy(cpu);
}

/*
 * The GEMV's wide launches against duet_k_matmul: products with many outputs take 2 or 4
 * outputs per warp (at least 3200 / 6400 rows in the launch), whose last warp repeats the
 * final row and must not store it; segments of different weight types share one launch. N is
 * never a multiple of the rows per block and K leaves part of the last round of pieces empty.
 * Same tolerances as above (BF16 2^-8 + 2e-5 of S, F32 2e-5, accumulated F32 + 1e-5).
 */
Test(kernels_cuda, gemv_wide_launches_vs_cpu, .timeout = 300)
{
    skip_without_device();
    duet_kernels_t *cpu = NULL;
    duet_cuda_gemm_t *g = NULL;
    CHECK(duet_kernels_create(DUET_DEVICE_CPU, 1, &cpu) == DUET_OK);
    CHECK(duet_cuda_gemm_create(0, 1 << 20, &g) == DUET_OK, "%s", duet_error_last());
    const double tol16 = 1.0 / 256 + 2e-5;
    /* {N of the BF16 op, N of the accumulated F32 op (0: none), K, batch entries} */
    const int64_t shapes[][4] = {{6403, 37, 264, 1},
                                 {3205, 0, 1032, 1},
                                 {130, 0, 136, 50},
                                 {7001, 0, 2304, 1},
                                 {1601, 1603, 72, 1}};
    double worst = 0;
    int cases = 0;
    for (size_t si = 0; si < sizeof(shapes) / sizeof(shapes[0]); si++) {
        const int64_t N = shapes[si][0], N2 = shapes[si][1], K = shapes[si][2], B = shapes[si][3];
        for (int64_t M = 1; M <= 2; M++) {
            const int64_t ldx = B * K + 4, ldy = B * N;
            float *wf, *x = xmalloc((size_t)(M * ldx) * 4);
            float *yc = xmalloc((size_t)(M * ldy) * 4), *yg = xmalloc((size_t)(M * ldy) * 4);
            for (int64_t i = 0; i < M * ldx; i++)
                x[i] = rng_f();
            uint16_t *w = bf16_weights_and_ref(cpu, B, N, K, x, ldx, K, M, yc, ldy, N, &wf);
            void *dw = dev_copy(w, (size_t)(B * N * K) * 2);
            float *dx = dev_copy(x, (size_t)(M * ldx) * 4), *dy = dev_alloc((size_t)(M * ldy) * 4);
            f32_acc_op_t acc;
            duet_status_t st;
            if (B > 1) {
                duet_tensor_t wd = {.data = dw,
                                    .dtype = DUET_DTYPE_BF16,
                                    .device = DUET_DEVICE_CUDA,
                                    .ndim = 3,
                                    .shape = {B, N, K}};
                st = duet_cuda_gemm_matmul_batched(g, 0, dy, ldy, N, dx, ldx, K, M, &wd, 0, 0);
            } else {
                duet_tensor_t wd = {.data = dw,
                                    .dtype = DUET_DTYPE_BF16,
                                    .device = DUET_DEVICE_CUDA,
                                    .ndim = 2,
                                    .shape = {N, K}};
                duet_cuda_gemm_op_t ops[2] = {{.y = dy, .ldy = ldy, .x = dx, .ldx = ldx, .w = &wd}};
                if (N2 > 0)
                    ops[1] = f32_acc_op_make(&acc, cpu, N2, K, x, dx, ldx, M);
                st = duet_cuda_gemm_matmul_multi(g, 0, M, ops, N2 > 0 ? 2 : 1, 0);
            }
            CHECK(st == DUET_OK, "N=%lld K=%lld B=%lld M=%lld: %s", (long long)N, (long long)K,
                  (long long)B, (long long)M, duet_error_last());
            CUDA_OK(cudaMemcpy(yg, dy, (size_t)(M * ldy) * 4, cudaMemcpyDeviceToHost));
            for (int64_t b = 0; b < B; b++) {
                const double e = check_rows(yg + b * N, yc + b * N, x + b * K, ldx, wf + b * N * K,
                                            M, N, K, ldy, tol16, "wide bf16");
                worst = e > worst ? e : worst;
            }
            if (N2 > 0) {
                const double e = f32_acc_op_check(&acc, x, ldx, "wide f32 acc");
                worst = e > worst ? e : worst;
            }
            cudaFree(dw), cudaFree(dx), cudaFree(dy);
            free(w), free(wf), free(x), free(yc), free(yg);
            cases++;
        }
    }
    printf("gemv wide launches: %d cases (2 and 4 outputs per warp, mixed weight types), max "
           "err/S %.3g\n",
           cases, worst);
    duet_cuda_gemm_destroy(g);
    duet_kernels_destroy(cpu);
}

/*
 * The tensor-core GEMV (3 <= M <= 8 rows, BF16 weights) against duet_k_matmul. It keeps x in fp32
 * in effect (each value split into bf16 hi + lo, |x − hi − lo| <= 2^-16 |x|, both multiplied
 * exactly and summed in fp32), so it must meet 2^-16 + 2e-5 of S, S = Σ|x·w| (+ |y0| when
 * accumulating), 100× tighter than the BF16 tolerance of cuBLASLt's rounded x (an output that
 * lost its lo half, or a column, a row or an x row mapped wrongly, is far outside). Shapes: N
 * not a multiple of the tile; K not a multiple of the 32-column step (and 8, the least it
 * takes); both tile forms (on the H200's 132 SMs): 8-row tiles, W on the mma's n side, for the
 * launches whose 16-row tiles fill too few warps even split 8 ways (2304 × 4096 as o_proj,
 * 2600 × 2304 and 16 × 9216 split 8 ways, 13 tiles × 3 batch entries × 1000 columns 4 ways, 130 ×
 * 136 × 5 entries and 37 × 72 unsplit, the multi call), and 16-row tiles; a tile's columns split
 * over the warps of a block that meet in shared memory, in slices of at least 128 columns: 8
 * (4500 × 2200, the last tile and slice short), 4 (4500 × 1000, two tiles per block), 2 (6403 ×
 * 264 and 16000 × 264, four tiles per block); batched entries; a multi call of three BF16
 * products in one launch (one accumulating); M = 3, 5, 6 and 8, plus 9, which goes to cuBLASLt
 * and must still meet the BF16 tolerance. Each call runs twice and must give the same bits.
 */
Test(kernels_cuda, tgemv_vs_cpu, .timeout = 300)
{
    skip_without_device();
    duet_kernels_t *cpu = NULL;
    duet_cuda_gemm_t *g = NULL;
    CHECK(duet_kernels_create(DUET_DEVICE_CPU, 1, &cpu) == DUET_OK);
    CHECK(duet_cuda_gemm_create(0, 1 << 20, &g) == DUET_OK, "%s", duet_error_last());
    /* DUET_CUDA_NO_GEMV / NO_TGEMV (side-by-side runs) send these calls to cuBLASLt */
    int no_gemv = -1, no_tgemv = -1;
    const int tc_off = duet_cuda_env_flag(&no_gemv, "DUET_CUDA_NO_GEMV") ||
                       duet_cuda_env_flag(&no_tgemv, "DUET_CUDA_NO_TGEMV");
    const double tol16 = 1.0 / 256 + 2e-5, tol_tg = tc_off ? tol16 : ldexp(1.0, -16) + 2e-5;
    /* {N, K, batch entries} */
    const int64_t shapes[][3] = {{37, 72, 1},     {16, 8, 1},      {2304, 4096, 1}, {16, 9216, 1},
                                 {2600, 2304, 1}, {130, 136, 5},   {6403, 264, 1},  {100, 1000, 3},
                                 {4500, 1000, 1}, {16000, 264, 1}, {4500, 2200, 1}};
    const int64_t Ms[] = {3, 5, 6, 8, 9};
    double worst = 0;
    int cases = 0;
    for (size_t si = 0; si < sizeof(shapes) / sizeof(shapes[0]); si++) {
        const int64_t N = shapes[si][0], K = shapes[si][1], B = shapes[si][2];
        for (size_t mi = 0; mi < sizeof(Ms) / sizeof(Ms[0]); mi++) {
            const int64_t M = Ms[mi], ldx = B * K + 4, ldy = B * N + 3;
            const int acc = (int)((si + mi) & 1);
            const double tol = M <= 8 ? tol_tg : tol16; /* M = 9: cuBLASLt */
            float *wf, *x = xmalloc((size_t)(M * ldx) * 4);
            float *y0 = xmalloc((size_t)(M * ldy) * 4), *yc = xmalloc((size_t)(M * ldy) * 4);
            float *yg = xmalloc((size_t)(M * ldy) * 4), *yg2 = xmalloc((size_t)(M * ldy) * 4);
            for (int64_t i = 0; i < M * ldx; i++)
                x[i] = rng_f();
            for (int64_t i = 0; i < M * ldy; i++)
                y0[i] = rng_f();
            uint16_t *w = bf16_weights_and_ref(cpu, B, N, K, x, ldx, K, M, yc, ldy, N, &wf);
            if (acc) /* the reference of y0 + x·Wᵀ */
                for (int64_t i = 0; i < M * ldy; i++)
                    yc[i] += (i % ldy) < B * N ? y0[i] : 0.0f;
            void *dw = dev_copy(w, (size_t)(B * N * K) * 2);
            float *dx = dev_copy(x, (size_t)(M * ldx) * 4);
            float *dy = dev_copy(y0, (size_t)(M * ldy) * 4);
            for (int rep = 0; rep < 2; rep++) {
                CUDA_OK(cudaMemcpy(dy, y0, (size_t)(M * ldy) * 4, cudaMemcpyHostToDevice));
                /* [B][N][K] for the batched call, [N][K] for the plain one */
                duet_tensor_t wd = {.data = dw,
                                    .dtype = DUET_DTYPE_BF16,
                                    .device = DUET_DEVICE_CUDA,
                                    .ndim = B > 1 ? 3 : 2,
                                    .shape = {B > 1 ? B : N, B > 1 ? N : K, B > 1 ? K : 0}};
                const duet_status_t st =
                    B > 1 ? duet_cuda_gemm_matmul_batched(g, 0, dy, ldy, N, dx, ldx, K, M, &wd, acc,
                                                          0)
                          : duet_cuda_gemm_matmul(g, 0, dy, ldy, dx, ldx, M, &wd, acc, 0);
                CHECK(st == DUET_OK, "N=%lld K=%lld B=%lld M=%lld: %s", (long long)N, (long long)K,
                      (long long)B, (long long)M, duet_error_last());
                CUDA_OK(
                    cudaMemcpy(rep ? yg2 : yg, dy, (size_t)(M * ldy) * 4, cudaMemcpyDeviceToHost));
            }
            for (int64_t m = 0; m < M; m++)
                for (int64_t n = 0; n < ldy; n++) {
                    const int64_t i = m * ldy + n;
                    if (n >= B * N) {
                        CHECK(yg[i] == y0[i], "padding y[%lld, %lld] written", (long long)m,
                              (long long)n);
                        continue;
                    }
                    const int64_t b = n / N, r = n % N;
                    double S = acc ? fabs(y0[i]) : 0.0;
                    for (int64_t k = 0; k < K; k++)
                        S += fabs((double)x[m * ldx + b * K + k] * wf[(b * N + r) * K + k]);
                    const double d = fabs((double)yg[i] - yc[i]);
                    CHECK(d <= tol * S + 1e-6,
                          "N=%lld K=%lld B=%lld M=%lld acc=%d y[%lld, %lld]: gpu %.9g cpu %.9g "
                          "S %.4g",
                          (long long)N, (long long)K, (long long)B, (long long)M, acc, (long long)m,
                          (long long)n, yg[i], yc[i], S);
                    if (M <= 8)
                        worst = S > 0 && d / S > worst ? d / S : worst;
                }
            CHECK(memcmp(yg, yg2, (size_t)(M * ldy) * 4) == 0,
                  "N=%lld K=%lld M=%lld: a second call gave other bits", (long long)N, (long long)K,
                  (long long)M);
            cudaFree(dw), cudaFree(dx), cudaFree(dy);
            free(w), free(wf), free(x), free(y0), free(yc), free(yg), free(yg2);
            cases++;
        }
    }

    /* one multi launch: q|k|v-like BF16 products of one x, the last accumulating */
    for (int64_t M = 3; M <= 8; M += 5) {
        const int64_t K = 264, Ns[3] = {100, 37, 64}, ldx = K;
        float *x = xmalloc((size_t)(M * ldx) * 4);
        for (int64_t i = 0; i < M * ldx; i++)
            x[i] = rng_f();
        float *dx = dev_copy(x, (size_t)(M * ldx) * 4);
        float *wf[3], *yc[3], *dy[3];
        uint16_t *w[3];
        void *dw[3];
        duet_tensor_t wd[3];
        duet_cuda_gemm_op_t ops[3];
        for (int o = 0; o < 3; o++) {
            yc[o] = xmalloc((size_t)(M * Ns[o]) * 4);
            w[o] = bf16_weights_and_ref(cpu, 1, Ns[o], K, x, ldx, K, M, yc[o], Ns[o], 0, &wf[o]);
            dw[o] = dev_copy(w[o], (size_t)(Ns[o] * K) * 2);
            float *y0 = xmalloc((size_t)(M * Ns[o]) * 4);
            for (int64_t i = 0; i < M * Ns[o]; i++)
                y0[i] = o == 2 ? rng_f() : 0.0f;
            if (o == 2)
                for (int64_t i = 0; i < M * Ns[o]; i++)
                    yc[o][i] += y0[i];
            dy[o] = dev_copy(y0, (size_t)(M * Ns[o]) * 4);
            free(y0);
            wd[o] = (duet_tensor_t){.data = dw[o],
                                    .dtype = DUET_DTYPE_BF16,
                                    .device = DUET_DEVICE_CUDA,
                                    .ndim = 2,
                                    .shape = {Ns[o], K}};
            ops[o] = (duet_cuda_gemm_op_t){
                .y = dy[o], .ldy = Ns[o], .x = dx, .ldx = ldx, .w = &wd[o], .accumulate = o == 2};
        }
        CHECK(duet_cuda_gemm_matmul_multi(g, 0, M, ops, 3, 0) == DUET_OK, "multi: %s",
              duet_error_last());
        for (int o = 0; o < 3; o++) {
            float *yg = xmalloc((size_t)(M * Ns[o]) * 4);
            CUDA_OK(cudaMemcpy(yg, dy[o], (size_t)(M * Ns[o]) * 4, cudaMemcpyDeviceToHost));
            /* (S leaves out y0 for the accumulated op: 1e-5 more, as f32_acc_op_check) */
            const double e = check_rows(yg, yc[o], x, ldx, wf[o], M, Ns[o], K, Ns[o],
                                        tol_tg + (o == 2 ? 1e-5 : 0.0), "tgemv multi");
            worst = e > worst ? e : worst;
            cudaFree(dw[o]), cudaFree(dy[o]);
            free(yg), free(w[o]), free(wf[o]), free(yc[o]);
        }
        cudaFree(dx);
        free(x);
        cases++;
    }
    printf("tensor-core gemv: %d cases (M 3..8, split and whole columns, batched, multi), max "
           "err/S %.3g (tol %.3g)\n",
           cases, worst, tol_tg);
    duet_cuda_gemm_destroy(g);
    duet_kernels_destroy(cpu);
}

/*
 * duet_cuda_gemm_norm_multi against its definition: duet_cuda_rmsnorm, then
 * duet_cuda_gemm_matmul_multi on the normalised rows. The fused launch (M <= 2) forms the norm on
 * the fly and scales each sum at the end, so it may differ from the two-call path by rounding:
 * its scale comes from an fp32 sum of D = 2304 squares (the separate kernel sums in double),
 * ~1e-7 relative typically and at most ~2e-6 (72 sequential terms per lane, then 32), so stored
 * rows must agree within 4e-6 relative and products within 4e-6 · S, S = Σ|W|·|xn| (+ |y0|
 * when accumulating) — far below what a wrong scale or a missed element makes (≥ 1e-3 here). M = 3
 * to 5 and an in-place norm (x == y) take the two-call path and must be bit-identical, also where
 * both ops are BF16 and matmul_multi runs them as one tensor-core GEMV launch. The F32 op alone
 * too (a router: 5 blocks, which store the normalised rows between them). Programmatic dependent
 * launch off and on: PDL changes no arithmetic.
 */
static void norm_multi_run(int64_t N1)
{
    duet_cuda_gemm_t *g = NULL;
    CHECK(duet_cuda_gemm_create(0, 1 << 16, &g) == DUET_OK, "%s", duet_error_last());
    const int64_t D = 2304, N2 = 40, ld = D + 8;
    uint16_t *w1 = xmalloc((size_t)(N1 * D) * 2);
    float *w1f = xmalloc((size_t)(N1 * D) * 4), *w2 = xmalloc((size_t)(N2 * D) * 4),
          *nw = xmalloc((size_t)D * 4), *w2bf = xmalloc((size_t)(N2 * D) * 4);
    uint16_t *w2b = xmalloc((size_t)(N2 * D) * 2);
    for (int64_t i = 0; i < N1 * D; i++) {
        w1[i] = duet_f32_to_bf16(rng_f());
        w1f[i] = duet_bf16_to_f32(w1[i]);
    }
    for (int64_t i = 0; i < N2 * D; i++) {
        w2[i] = rng_f();
        w2b[i] = duet_f32_to_bf16(w2[i]);
        w2bf[i] = duet_bf16_to_f32(w2b[i]);
    }
    for (int64_t i = 0; i < D; i++)
        nw[i] = 1.0f + 0.5f * rng_f();
    void *dw1 = dev_copy(w1, (size_t)(N1 * D) * 2);
    float *dw2 = dev_copy(w2, (size_t)(N2 * D) * 4), *dnw = dev_copy(nw, (size_t)D * 4);
    void *dw2b = dev_copy(w2b, (size_t)(N2 * D) * 2);
    duet_tensor_t t1 = {.data = dw1,
                        .dtype = DUET_DTYPE_BF16,
                        .device = DUET_DEVICE_CUDA,
                        .ndim = 2,
                        .shape = {N1, D}};
    duet_tensor_t t2 = {.data = dw2,
                        .dtype = DUET_DTYPE_F32,
                        .device = DUET_DEVICE_CUDA,
                        .ndim = 2,
                        .shape = {N2, D}};
    duet_tensor_t t2b = t2;
    t2b.data = dw2b;
    t2b.dtype = DUET_DTYPE_BF16;
    int cases = 0;
    double worst_row = 0, worst_y = 0;
    for (int pdl = 0; pdl <= 1; pdl++)
        for (int mode = 0; mode < 3; mode++) { /* both ops, the F32 one alone, two BF16 ops */
            const int f32 = mode == 1;
            duet_cuda_pdl_set(pdl);
            for (int64_t M = 1; M <= 5; M++)
                for (int in_place = 0; in_place <= 1; in_place++) {
                    float *x = xmalloc((size_t)(M * ld) * 4), *y0 = xmalloc((size_t)(M * N2) * 4);
                    for (int64_t i = 0; i < M * ld; i++)
                        x[i] = 3.0f * rng_f();
                    for (int64_t i = 0; i < M * N2; i++)
                        y0[i] = rng_f();
                    float *res[2][3];
                    for (int fused = 0; fused <= 1; fused++) {
                        float *dx = dev_copy(x, (size_t)(M * ld) * 4);
                        float *dn = in_place ? dx : dev_alloc((size_t)(M * ld) * 4);
                        float *dy1 = dev_alloc((size_t)(M * N1) * 4);
                        float *dy2 = dev_copy(y0, (size_t)(M * N2) * 4);
                        const duet_cuda_gemm_op_t ops[2] = {
                            {.y = dy1, .ldy = N1, .x = dn, .ldx = ld, .w = &t1},
                            {.y = dy2,
                             .ldy = N2,
                             .x = dn,
                             .ldx = ld,
                             .w = mode == 2 ? &t2b : &t2,
                             .accumulate = 1}};
                        const duet_cuda_gemm_norm_t nrm = {
                            .x = dx, .ldx = ld, .w = dnw, .y = dn, .ldy = ld, .D = D, .eps = 1e-5f};
                        duet_status_t st;
                        if (fused) {
                            st = duet_cuda_gemm_norm_multi(g, 0, M, &nrm, ops + f32, 2 - f32, 0);
                        } else {
                            st = duet_cuda_rmsnorm(0, dn, ld, dx, ld, dnw, M, D, 1e-5f);
                            if (st == DUET_OK)
                                st = duet_cuda_gemm_matmul_multi(g, 0, M, ops + f32, 2 - f32, 0);
                        }
                        CHECK(st == DUET_OK, "M=%lld fused=%d: %s", (long long)M, fused,
                              duet_error_last());
                        res[fused][0] = xmalloc((size_t)(M * ld) * 4);
                        res[fused][1] = xmalloc((size_t)(M * N1) * 4);
                        res[fused][2] = xmalloc((size_t)(M * N2) * 4);
                        CUDA_OK(cudaMemcpy(res[fused][0], dn, (size_t)(M * ld) * 4,
                                           cudaMemcpyDeviceToHost));
                        CUDA_OK(cudaMemcpy(res[fused][1], dy1, (size_t)(M * N1) * 4,
                                           cudaMemcpyDeviceToHost));
                        CUDA_OK(cudaMemcpy(res[fused][2], dy2, (size_t)(M * N2) * 4,
                                           cudaMemcpyDeviceToHost));
                        if (!in_place)
                            cudaFree(dn);
                        cudaFree(dx);
                        cudaFree(dy1);
                        cudaFree(dy2);
                    }
                    /* the two-call path both times */
                    const int exact = M > 2 || in_place;
                    for (int64_t m = 0; m < M; m++) {
                        const float *a = res[1][0] + m * ld, *b = res[0][0] + m * ld;
                        for (int64_t k = 0; k < D; k++) {
                            const double d = fabs((double)a[k] - b[k]),
                                         r = d / (fabs(b[k]) + 1e-30);
                            CHECK(
                                exact ? d == 0 : d <= 4e-6 * fabs(b[k]),
                                "row %lld col %lld: fused %.9g two-call %.9g (M=%lld in_place=%d)",
                                (long long)m, (long long)k, a[k], b[k], (long long)M, in_place);
                            worst_row = r > worst_row ? r : worst_row;
                        }
                        CHECK(fabs((double)b[0] - x[m * ld]) > 0 || x[m * ld] == 0,
                              "row %lld was not normalised", (long long)m);
                    }
                    for (int op = f32; op < 2; op++) {
                        const int64_t N = op ? N2 : N1;
                        const float *wf = op ? (mode == 2 ? w2bf : w2) : w1f;
                        for (int64_t m = 0; m < M; m++)
                            for (int64_t nn = 0; nn < N; nn++) {
                                double S = op ? fabs(y0[m * N2 + nn]) : 0;
                                for (int64_t k = 0; k < D; k++)
                                    S += fabs((double)wf[nn * D + k] * res[0][0][m * ld + k]);
                                const double a = res[1][1 + op][m * N + nn],
                                             b = res[0][1 + op][m * N + nn], d = fabs(a - b);
                                CHECK(exact ? d == 0 : d <= 4e-6 * S,
                                      "op %d y[%lld, %lld]: fused %.9g two-call %.9g S %.3g", op,
                                      (long long)m, (long long)nn, a, b, S);
                                worst_y = d / S > worst_y ? d / S : worst_y;
                            }
                    }
                    for (int f = 0; f < 2; f++)
                        for (int j = 0; j < 3; j++)
                            free(res[f][j]);
                    free(x), free(y0);
                    cases++;
                }
        }
    duet_cuda_pdl_set(-1);
    { /* bad arguments are refused before anything is queued */
        float *bx = dev_alloc((size_t)D * 4), *by = dev_alloc((size_t)D * 4),
              *bo = dev_alloc((size_t)N1 * 4);
        const duet_cuda_gemm_op_t op = {.y = bo, .ldy = N1, .x = by, .ldx = D, .w = &t1};
        duet_cuda_gemm_norm_t bad = {
            .x = bx, .ldx = D, .w = dnw, .y = by, .ldy = D, .D = 0, .eps = 1e-5f};
        CHECK(duet_cuda_gemm_norm_multi(g, 0, 1, &bad, &op, 1, 0) == DUET_ERR_INVALID,
              "D = 0 must be refused");
        bad.D = D;
        bad.ldx = D - 1;
        CHECK(duet_cuda_gemm_norm_multi(g, 0, 1, &bad, &op, 1, 0) == DUET_ERR_INVALID,
              "ldx < D must be refused");
        bad.ldx = D;
        bad.w = NULL;
        CHECK(duet_cuda_gemm_norm_multi(g, 0, 1, &bad, &op, 1, 0) == DUET_ERR_INVALID,
              "a NULL norm weight must be refused");
        cudaFree(bx), cudaFree(by), cudaFree(bo);
    }
    printf("norm_multi (N = %lld + 40): %d cases; fused vs rmsnorm + multi: rows max rel %.3g, "
           "products max err/S %.3g (two-call cases bit-identical)\n",
           (long long)N1, cases, worst_row, worst_y);
    cudaFree(dw1), cudaFree(dw2), cudaFree(dw2b), cudaFree(dnw);
    free(w1), free(w1f), free(w2), free(w2b), free(w2bf), free(nw);
    duet_cuda_gemm_destroy(g);
}

/* 100 + 40 outputs: one per warp; 6500 + 40: four per warp, mixed weight types in the launch. */
Test(kernels_cuda, norm_multi_vs_norm_then_multi, .timeout = 300)
{
    skip_without_device();
    norm_multi_run(100);
    norm_multi_run(6500);
}

/*
 * duet_cuda_gemm_matmul_multi on the cuBLASLt path (M = 64 rows) with ops that share x: the first
 * op on an x converts it to bf16 and the next ops on the same x use the staged copy; an op on
 * another x converts that one, and a later op on the first x must convert it again. Each product
 * must equal the same op run alone through duet_cuda_gemm_matmul, bit for bit (the same cuBLASLt
 * call on the same bf16 rows), accumulating ones included.
 */
/* The norm of norm_multi_rounds_in_the_norm: rows of x into y, ld apart, with y_unread. */
static duet_cuda_gemm_norm_t unread_norm(const float *x, float *y, const float *w, int64_t ld,
                                         int64_t D)
{
    return (duet_cuda_gemm_norm_t){
        .x = x, .ldx = ld, .w = w, .y = y, .ldy = ld, .D = D, .eps = 1e-5f, .y_unread = 1};
}

/*
 * At cuBLASLt sizes the norm of duet_cuda_gemm_norm_multi leaves its rows rounded to bf16 in the
 * staging for the BF16 ops (duet_cuda_rmsnorm_planes), instead of a conversion pass: the normed
 * rows and every product must equal duet_cuda_rmsnorm then duet_cuda_gemm_matmul_multi bit for
 * bit — a BF16 op and an accumulating F32 op on the rows, a BF16 op on other rows between them,
 * in place and strided, D a multiple of 8 and not (the one-element conversion). With y_unread
 * the rows are still written while the F32 op reads them, and not at all when the BF16 op alone
 * does (its product unchanged).
 */
Test(kernels_cuda, norm_multi_rounds_in_the_norm, .timeout = 120)
{
    skip_without_device();
    duet_cuda_gemm_t *g = NULL;
    CHECK(duet_cuda_gemm_create(0, 1 << 20, &g) == DUET_OK, "%s", duet_error_last());
    const int64_t M = 64, N = 96, Ds[2] = {2304, 100};
    for (int di = 0; di < 2; di++)
        for (int in_place = 0; in_place <= 1; in_place++) {
            const int64_t D = Ds[di], ld = D + 4;
            float *x = xmalloc((size_t)(M * ld) * 4), *o = xmalloc((size_t)(M * ld) * 4);
            float *nw = xmalloc((size_t)D * 4), *wf = xmalloc((size_t)(N * D) * 4);
            float *y0 = xmalloc((size_t)(M * N) * 4);
            uint16_t *wb = xmalloc((size_t)(N * D) * 2);
            for (int64_t i = 0; i < M * ld; i++) {
                x[i] = 3.0f * rng_f();
                o[i] = rng_f();
            }
            for (int64_t i = 0; i < D; i++)
                nw[i] = 1.0f + 0.5f * rng_f();
            for (int64_t i = 0; i < N * D; i++) {
                wb[i] = duet_f32_to_bf16(rng_f());
                wf[i] = rng_f();
            }
            for (int64_t i = 0; i < M * N; i++)
                y0[i] = rng_f();
            duet_tensor_t tb = {.data = dev_copy(wb, (size_t)(N * D) * 2),
                                .dtype = DUET_DTYPE_BF16,
                                .device = DUET_DEVICE_CUDA,
                                .ndim = 2,
                                .shape = {N, D}};
            duet_tensor_t tf = tb;
            tf.data = dev_copy(wf, (size_t)(N * D) * 4);
            tf.dtype = DUET_DTYPE_F32;
            float *dnw = dev_copy(nw, (size_t)D * 4), *dother = dev_copy(o, (size_t)(M * ld) * 4);
            float *got[2][4];
            for (int way = 0; way < 2; way++) {
                float *dx = dev_copy(x, (size_t)(M * ld) * 4);
                float *dn = in_place ? dx : dev_alloc((size_t)(M * ld) * 4);
                float *dy[3] = {dev_alloc((size_t)(M * N) * 4), dev_alloc((size_t)(M * N) * 4),
                                dev_copy(y0, (size_t)(M * N) * 4)};
                const duet_cuda_gemm_op_t ops[3] = {
                    {.y = dy[0], .ldy = N, .x = dn, .ldx = ld, .w = &tb},
                    {.y = dy[1], .ldy = N, .x = dother, .ldx = ld, .w = &tb},
                    {.y = dy[2], .ldy = N, .x = dn, .ldx = ld, .w = &tf, .accumulate = 1}};
                /* y_unread: the F32 op still reads y, so it must be written */
                const duet_cuda_gemm_norm_t nrm = unread_norm(dx, dn, dnw, ld, D);
                if (way == 0) {
                    DUET_OK_OR_FAIL(duet_cuda_rmsnorm(0, dn, ld, dx, ld, dnw, M, D, 1e-5f));
                    DUET_OK_OR_FAIL(duet_cuda_gemm_matmul_multi(g, 0, M, ops, 3, 0));
                } else {
                    DUET_OK_OR_FAIL(duet_cuda_gemm_norm_multi(g, 0, M, &nrm, ops, 3, 0));
                }
                got[way][0] = xmalloc((size_t)(M * ld) * 4);
                CUDA_OK(cudaMemcpy(got[way][0], dn, (size_t)(M * ld) * 4, cudaMemcpyDeviceToHost));
                for (int i = 0; i < 3; i++) {
                    got[way][i + 1] = xmalloc((size_t)(M * N) * 4);
                    CUDA_OK(cudaMemcpy(got[way][i + 1], dy[i], (size_t)(M * N) * 4,
                                       cudaMemcpyDeviceToHost));
                    cudaFree(dy[i]);
                }
                if (!in_place)
                    cudaFree(dn);
                cudaFree(dx);
            }
            for (int64_t m = 0; m < M; m++)
                CHECK(memcmp(got[0][0] + m * ld, got[1][0] + m * ld, (size_t)D * 4) == 0,
                      "D=%lld in place %d: normed row %lld differs", (long long)D, in_place,
                      (long long)m);
            for (int i = 1; i < 4; i++)
                CHECK(memcmp(got[0][i], got[1][i], (size_t)(M * N) * 4) == 0,
                      "D=%lld in place %d: op %d differs from norm then multi", (long long)D,
                      in_place, i - 1);
            /* y_unread with the BF16 op alone: y is left as it was, the product the same */
            if (!in_place) {
                float *dx = dev_copy(x, (size_t)(M * ld) * 4);
                float *dn = dev_alloc((size_t)(M * ld) * 4), *dy = dev_alloc((size_t)(M * N) * 4);
                CUDA_OK(cudaMemset(dn, 0xff, (size_t)(M * ld) * 4));
                const duet_cuda_gemm_op_t op = {.y = dy, .ldy = N, .x = dn, .ldx = ld, .w = &tb};
                const duet_cuda_gemm_norm_t nrm = unread_norm(dx, dn, dnw, ld, D);
                DUET_OK_OR_FAIL(duet_cuda_gemm_norm_multi(g, 0, M, &nrm, &op, 1, 0));
                float *yu = xmalloc((size_t)(M * N) * 4), *nu = xmalloc((size_t)(M * ld) * 4);
                CUDA_OK(cudaMemcpy(yu, dy, (size_t)(M * N) * 4, cudaMemcpyDeviceToHost));
                CUDA_OK(cudaMemcpy(nu, dn, (size_t)(M * ld) * 4, cudaMemcpyDeviceToHost));
                CHECK(memcmp(yu, got[0][1], (size_t)(M * N) * 4) == 0,
                      "D=%lld: the product with y unread differs", (long long)D);
                int64_t written = 0;
                for (int64_t i = 0; i < M * ld; i++)
                    written += !isnan(nu[i]);
                CHECK(written == 0, "D=%lld: y unread, yet %lld values written", (long long)D,
                      (long long)written);
                free(yu), free(nu);
                cudaFree(dx), cudaFree(dn), cudaFree(dy);
            }
            printf("[kernels_cuda] norm_multi M=%lld D=%lld%s: rows and 3 products equal to norm "
                   "then multi\n",
                   (long long)M, (long long)D, in_place ? " (in place)" : "");
            for (int w = 0; w < 2; w++)
                for (int i = 0; i < 4; i++)
                    free(got[w][i]);
            cudaFree(tb.data), cudaFree(tf.data), cudaFree(dnw), cudaFree(dother);
            free(x), free(o), free(nw), free(wf), free(y0), free(wb);
        }
    duet_cuda_gemm_destroy(g);
}

Test(kernels_cuda, multi_shares_conversion, .timeout = 120)
{
    skip_without_device();
    duet_cuda_gemm_t *g = NULL;
    CHECK(duet_cuda_gemm_create(0, 1 << 20, &g) == DUET_OK, "%s", duet_error_last());
    const int64_t M = 64, K = 256, N = 96, ld = K + 4;
    float *x[2], *dx[2], *y0 = xmalloc((size_t)(M * N) * 4);
    for (int v = 0; v < 2; v++) {
        x[v] = xmalloc((size_t)(M * ld) * 4);
        for (int64_t i = 0; i < M * ld; i++)
            x[v][i] = rng_f();
        dx[v] = dev_copy(x[v], (size_t)(M * ld) * 4);
    }
    for (int64_t i = 0; i < M * N; i++)
        y0[i] = rng_f();
    enum { NOPS = 4 };
    static const int which_x[NOPS] = {0, 0, 1, 0}, acc[NOPS] = {0, 1, 0, 1};
    uint16_t *w = xmalloc((size_t)(N * K) * 2);
    void *dw[NOPS];
    duet_tensor_t t[NOPS];
    float *dy[NOPS];
    duet_cuda_gemm_op_t ops[NOPS];
    for (int i = 0; i < NOPS; i++) {
        for (int64_t k = 0; k < N * K; k++)
            w[k] = duet_f32_to_bf16(rng_f());
        dw[i] = dev_copy(w, (size_t)(N * K) * 2);
        t[i] = (duet_tensor_t){.data = dw[i],
                               .dtype = DUET_DTYPE_BF16,
                               .device = DUET_DEVICE_CUDA,
                               .ndim = 2,
                               .shape = {N, K}};
        dy[i] = dev_alloc((size_t)(M * N) * 4);
        ops[i] = (duet_cuda_gemm_op_t){
            .y = dy[i], .ldy = N, .x = dx[which_x[i]], .ldx = ld, .w = &t[i], .accumulate = acc[i]};
    }
    float *got[2][NOPS];
    for (int alone = 0; alone <= 1; alone++) {
        for (int i = 0; i < NOPS; i++)
            CUDA_OK(cudaMemcpy(dy[i], y0, (size_t)(M * N) * 4, cudaMemcpyHostToDevice));
        if (alone)
            for (int i = 0; i < NOPS; i++)
                CHECK(duet_cuda_gemm_matmul(g, 0, dy[i], N, ops[i].x, ld, M, &t[i], acc[i], 0) ==
                          DUET_OK,
                      "op %d alone: %s", i, duet_error_last());
        else
            CHECK(duet_cuda_gemm_matmul_multi(g, 0, M, ops, NOPS, 0) == DUET_OK, "multi: %s",
                  duet_error_last());
        for (int i = 0; i < NOPS; i++) {
            got[alone][i] = xmalloc((size_t)(M * N) * 4);
            CUDA_OK(cudaMemcpy(got[alone][i], dy[i], (size_t)(M * N) * 4, cudaMemcpyDeviceToHost));
        }
    }
    for (int i = 0; i < NOPS; i++) {
        CHECK(memcmp(got[0][i], got[1][i], (size_t)(M * N) * 4) == 0,
              "op %d (x %d, accumulate %d): the multi call differs from the op alone", i,
              which_x[i], acc[i]);
        CHECK(memcmp(got[1][i], y0, (size_t)(M * N) * 4) != 0, "op %d wrote nothing", i);
        free(got[0][i]), free(got[1][i]);
        cudaFree(dw[i]), cudaFree(dy[i]);
    }
    for (int v = 0; v < 2; v++)
        free(x[v]), cudaFree(dx[v]);
    free(w), free(y0);
    duet_cuda_gemm_destroy(g);
}

/*
 * duet_cuda_argmax_split (many blocks per row) against the CPU's rule — the first index of the
 * largest value — and the one-block duet_cuda_argmax: vocabularies from 1 to 163840 (chunk edges,
 * V not a multiple of 4), a row stride that breaks 16-byte alignment, ties planted across chunks
 * (the lower index must win), -inf entries, and 300 rows at once.
 */
Test(kernels_cuda, argmax_split_first_max, .timeout = 120)
{
    skip_without_device();
    const int64_t Vs[] = {1, 3, 1023, 1024, 1025, 4099, 131072, 163840, 163841};
    int rows_checked = 0;
    for (size_t vi = 0; vi < sizeof(Vs) / sizeof(Vs[0]); vi++)
        for (int odd = 0; odd <= 1; odd++) {
            const int64_t V = Vs[vi], ld = V + odd, M = V > 100000 ? 5 : 300;
            float *h = xmalloc((size_t)(M * ld) * 4);
            for (int64_t i = 0; i < M * ld; i++)
                h[i] = rng_f();
            for (int64_t m = 0; m < M; m++) {
                float *r = h + m * ld;
                if (m % 3 == 1 && V > 2) { /* a tie between two chunks: the first must win */
                    const int64_t a = (int64_t)(rng_u32() % (uint32_t)(V / 2)),
                                  b = V / 2 + (int64_t)(rng_u32() % (uint32_t)(V - V / 2));
                    r[a] = r[b] = 2.0f;
                }
                if (m % 5 == 2)
                    for (int64_t k = 0; k < V; k += 7)
                        r[k] = -INFINITY;
            }
            int32_t *want = xmalloc((size_t)M * 4), *got = xmalloc((size_t)M * 4),
                    *one = xmalloc((size_t)M * 4);
            for (int64_t m = 0; m < M; m++) {
                int64_t bi = 0;
                for (int64_t k = 1; k < V; k++)
                    if (h[m * ld + k] > h[m * ld + bi])
                        bi = k;
                want[m] = (int32_t)bi;
            }
            float *dl = dev_copy(h, (size_t)(M * ld) * 4);
            int32_t *dout = dev_alloc((size_t)M * 4), *done = dev_alloc((size_t)M * 4);
            void *scr = dev_alloc(duet_cuda_argmax_scratch_bytes(M));
            CHECK(duet_cuda_argmax_split(0, dl, ld, V, M, dout, scr) == DUET_OK, "%s",
                  duet_error_last());
            CHECK(duet_cuda_argmax(0, dl, ld, V, M, done) == DUET_OK, "%s", duet_error_last());
            CUDA_OK(cudaMemcpy(got, dout, (size_t)M * 4, cudaMemcpyDeviceToHost));
            CUDA_OK(cudaMemcpy(one, done, (size_t)M * 4, cudaMemcpyDeviceToHost));
            for (int64_t m = 0; m < M; m++) {
                CHECK(got[m] == want[m], "V=%lld ld=%lld row %lld: split %d, CPU %d", (long long)V,
                      (long long)ld, (long long)m, got[m], want[m]);
                CHECK(one[m] == want[m], "V=%lld row %lld: one-block %d, CPU %d", (long long)V,
                      (long long)m, one[m], want[m]);
            }
            rows_checked += (int)M;
            cudaFree(dl), cudaFree(dout), cudaFree(done), cudaFree(scr);
            free(h), free(want), free(got), free(one);
        }
    CHECK(duet_cuda_argmax_split(0, NULL, 10, 10, 1, NULL, NULL) == DUET_ERR_INVALID);
    printf("argmax_split: %d rows equal to the CPU's first maximum\n", rows_checked);
}

/* bf16 round to nearest even of a finite float, as __float2bfloat16_rn does. */
static uint16_t host_bf16_rne(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/*
 * duet_cuda_convert_from_f32 to bf16 / f16: the 8-wide path (K a multiple of 8, 16-byte aligned
 * rows) and the one-element path (the same values at a stride that is not) must give the same
 * bits, and bf16 must equal the host's round to nearest even. Values span normal, subnormal,
 * huge (bf16 rounding up to infinity, f16 overflow), ±0 and exact ties.
 */
Test(kernels_cuda, convert_paths_agree, .timeout = 60)
{
    skip_without_device();
    const int64_t shapes[][2] = {{1, 8}, {3, 2304}, {37, 4096}, {2048, 96}, {5, 1000}};
    for (size_t si = 0; si < sizeof(shapes) / sizeof(shapes[0]); si++) {
        const int64_t M = shapes[si][0], K = shapes[si][1], ld2 = K + 1;
        float *h = xmalloc((size_t)(M * K) * 4), *h2 = xmalloc((size_t)(M * ld2) * 4);
        for (int64_t i = 0; i < M * K; i++) {
            const uint32_t kind = rng_u32() % 8;
            float v = rng_f();
            if (kind == 1)
                v *= 1e-39f; /* subnormal */
            else if (kind == 2)
                v *= 3.4e38f; /* near FLT_MAX: bf16 may round to inf */
            else if (kind == 3)
                v *= 70000.0f; /* beyond f16's range */
            else if (kind == 4) {
                uint32_t u = (rng_u32() & 0xffff0000u) | 0x8000u; /* a bf16 tie */
                memcpy(&v, &u, 4);
                if (!isfinite(v))
                    v = 1.0f;
            } else if (kind == 5)
                v = (i & 1) ? -0.0f : 0.0f;
            h[i] = v;
        }
        for (int64_t m = 0; m < M; m++)
            memcpy(h2 + m * ld2, h + m * K, (size_t)K * 4);
        float *d1 = dev_copy(h, (size_t)(M * K) * 4), *d2 = dev_copy(h2, (size_t)(M * ld2) * 4);
        uint16_t *o1 = dev_alloc((size_t)(M * K) * 2), *o2 = dev_alloc((size_t)(M * K) * 2);
        uint16_t *g1 = xmalloc((size_t)(M * K) * 2), *g2 = xmalloc((size_t)(M * K) * 2);
        const duet_dtype_t dts[2] = {DUET_DTYPE_BF16, DUET_DTYPE_F16};
        for (int di = 0; di < 2; di++) {
            CHECK(duet_cuda_convert_from_f32(o1, dts[di], d1, K, M, K, 0) == DUET_OK, "%s",
                  duet_error_last());
            CHECK(duet_cuda_convert_from_f32(o2, dts[di], d2, ld2, M, K, 0) == DUET_OK, "%s",
                  duet_error_last());
            CUDA_OK(cudaMemcpy(g1, o1, (size_t)(M * K) * 2, cudaMemcpyDeviceToHost));
            CUDA_OK(cudaMemcpy(g2, o2, (size_t)(M * K) * 2, cudaMemcpyDeviceToHost));
            int64_t diff = 0, host_diff = 0;
            for (int64_t i = 0; i < M * K; i++) {
                diff += g1[i] != g2[i];
                if (dts[di] == DUET_DTYPE_BF16)
                    host_diff += g1[i] != host_bf16_rne(h[i]);
            }
            printf("[kernels_cuda] convert %s M=%lld K=%lld: %lld elements differ between the "
                   "paths, %lld from the host's rounding (both must be 0)\n",
                   duet_dtype_name(dts[di]), (long long)M, (long long)K, (long long)diff,
                   (long long)host_diff);
            CHECK(diff == 0 && host_diff == 0, "convert %s M=%lld K=%lld", duet_dtype_name(dts[di]),
                  (long long)M, (long long)K);
        }
        cudaFree(d1), cudaFree(d2), cudaFree(o1), cudaFree(o2);
        free(h), free(h2), free(g1), free(g2);
    }
}

/*
 * x split into three bf16 planes (duet_cuda_gemm_split_x) and an F32 weight with a BF16 twin
 * (duet_cuda_gemm_op_t's xs and w_bf16). The planes: plane 0 is the host's round to nearest even
 * of x, bit for bit, and x0 + x1 + x2 == x exactly for every element (x spread over 2^±12, so
 * that x1 and x2 are rarely 0). The split product against a double reference, S-relative as
 * above: within fp32 accumulation error (2e-5, the F32 tolerance) and at most 4x the fp32
 * GEMM's own worst error plus 1e-7, where rounding x to bf16 (the plain BF16 product, measured
 * here too) is off by ~2^-9, so a lost plane would fail it; accumulate adds to y. A BF16 op
 * reading plane 0 equals the op converting x itself, bit for bit, and at 2 rows never reads x;
 * an op with w_bf16 but no xs, or with TF32 asked for, is the F32 weight's own path, bit for
 * bit. duet_cuda_gemm_split_pays, and the refusals of split_x and of a twin of the wrong shape
 * or dtype.
 */
Test(kernels_cuda, split_x_products_keep_fp32, .timeout = 300)
{
    skip_without_device();
    duet_cuda_gemm_t *g = NULL;
    const int64_t M = 1061, N = 200, K = 520, ld = K + 4, N2 = 64;
    CHECK(duet_cuda_gemm_create(0, M * K, &g) == DUET_OK, "%s", duet_error_last());
    float *x = xmalloc((size_t)(M * ld) * 4), *wf = xmalloc((size_t)(N * K) * 4);
    uint16_t *wb = xmalloc((size_t)(N * K) * 2), *w2 = xmalloc((size_t)(N2 * K) * 2);
    uint16_t *planes = xmalloc((size_t)(3 * M * K) * 2);
    for (int64_t i = 0; i < M * ld; i++)
        x[i] = rng_f() * ldexpf(1.0f, (int)(rng_u32() % 25) - 12);
    for (int64_t i = 0; i < N * K; i++) {
        wb[i] = duet_f32_to_bf16(rng_f());
        wf[i] = duet_bf16_to_f32(wb[i]);
    }
    for (int64_t i = 0; i < N2 * K; i++)
        w2[i] = duet_f32_to_bf16(rng_f());
    float *dx = dev_copy(x, (size_t)(M * ld) * 4);
    void *dxs = dev_alloc((size_t)(3 * M * K) * 2);
    DUET_OK_OR_FAIL(duet_cuda_gemm_split_x(dxs, dx, ld, M, K, 0));
    CUDA_OK(cudaMemcpy(planes, dxs, (size_t)(3 * M * K) * 2, cudaMemcpyDeviceToHost));
    int64_t nonzero2 = 0;
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++) {
            const int64_t i = m * K + k;
            const float v = x[m * ld + k];
            CHECK(planes[i] == host_bf16_rne(v), "plane 0 [%lld, %lld] is not x rounded",
                  (long long)m, (long long)k);
            const double sum = (double)duet_bf16_to_f32(planes[i]) +
                               duet_bf16_to_f32(planes[M * K + i]) +
                               duet_bf16_to_f32(planes[2 * M * K + i]);
            CHECK(sum == (double)v, "[%lld, %lld]: the planes sum to %.17g, x is %.9g",
                  (long long)m, (long long)k, sum, v);
            nonzero2 += planes[2 * M * K + i] != 0 && planes[2 * M * K + i] != 0x8000;
        }
    CHECK(nonzero2 > M * K / 2, "only %lld of %lld third terms are nonzero", (long long)nonzero2,
          (long long)(M * K));

    duet_tensor_t tf = {.data = dev_copy(wf, (size_t)(N * K) * 4),
                        .dtype = DUET_DTYPE_F32,
                        .device = DUET_DEVICE_CUDA,
                        .ndim = 2,
                        .shape = {N, K}};
    duet_tensor_t tb = tf, t2 = tf;
    tb.data = dev_copy(wb, (size_t)(N * K) * 2);
    tb.dtype = DUET_DTYPE_BF16;
    t2.data = dev_copy(w2, (size_t)(N2 * K) * 2);
    t2.dtype = DUET_DTYPE_BF16;
    t2.shape[0] = N2;
    const size_t yb = (size_t)(M * N) * 4, y2b = (size_t)(M * N2) * 4;
    float *dy = dev_alloc(yb), *dy2 = dev_alloc(y2b);
    float *ys = xmalloc(yb), *yf = xmalloc(yb), *yp = xmalloc(yb), *ya = xmalloc(yb),
          *y2m = xmalloc(y2b), *y2a = xmalloc(y2b), *y0 = xmalloc(yb);
    for (int64_t i = 0; i < M * N; i++)
        y0[i] = rng_f();
    duet_cuda_gemm_op_t split = {
        .y = dy, .ldy = N, .x = dx, .ldx = ld, .w = &tf, .xs = dxs, .w_bf16 = &tb};
    duet_cuda_gemm_op_t plain = split;
    plain.xs = NULL;
    plain.w_bf16 = NULL;

    /* the split, the fp32 GEMM, the plain BF16 product, the split accumulating onto y0 */
    const int64_t calls = duet_cuda_gemm_split_count();
    DUET_OK_OR_FAIL(duet_cuda_gemm_matmul_multi(g, 0, M, &split, 1, 0));
    CUDA_OK(cudaMemcpy(ys, dy, yb, cudaMemcpyDeviceToHost));
    CHECK(duet_cuda_gemm_split_count() == calls + 1, "the split op did not take the split form");
    DUET_OK_OR_FAIL(duet_cuda_gemm_matmul_multi(g, 0, M, &plain, 1, 0));
    CUDA_OK(cudaMemcpy(yf, dy, yb, cudaMemcpyDeviceToHost));
    DUET_OK_OR_FAIL(duet_cuda_gemm_matmul(g, 0, dy, N, dx, ld, M, &tb, 0, 0));
    CUDA_OK(cudaMemcpy(yp, dy, yb, cudaMemcpyDeviceToHost));
    split.accumulate = 1;
    CUDA_OK(cudaMemcpy(dy, y0, yb, cudaMemcpyHostToDevice));
    DUET_OK_OR_FAIL(duet_cuda_gemm_matmul_multi(g, 0, M, &split, 1, 0));
    CUDA_OK(cudaMemcpy(ya, dy, yb, cudaMemcpyDeviceToHost));
    split.accumulate = 0;
    double es = 0, ef = 0, ep = 0, ea = 0;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            double ref = 0, S = 0;
            for (int64_t k = 0; k < K; k++) {
                const double p = (double)x[m * ld + k] * wf[n * K + k];
                ref += p;
                S += fabs(p);
            }
            const int64_t i = m * N + n;
            es = fmax(es, fabs(ys[i] - ref) / S);
            ef = fmax(ef, fabs(yf[i] - ref) / S);
            ep = fmax(ep, fabs(yp[i] - ref) / S);
            ea = fmax(ea, fabs(ya[i] - (ref + y0[i])) / (S + fabs(y0[i])));
        }
    printf("[kernels_cuda] split x, M=%lld N=%lld K=%lld: max S-relative error %.3g (fp32 GEMM "
           "%.3g, x rounded to bf16 %.3g, accumulating %.3g)\n",
           (long long)M, (long long)N, (long long)K, es, ef, ep, ea);
    CHECK(es <= 2e-5 && es <= 4 * ef + 1e-7, "split error %g (fp32 GEMM %g)", es, ef);
    CHECK(ea <= 2e-5, "accumulating split error %g", ea);
    CHECK(ep > 1e-4, "x rounded to bf16 only %g off: the check above could not tell", ep);

    /* no planes, or TF32 asked for: the F32 weight's own path */
    for (int c = 0; c < 2; c++) {
        const unsigned flags = c == 0 ? 0 : DUET_CUDA_GEMM_TF32;
        duet_cuda_gemm_op_t op = split;
        if (c == 0)
            op.xs = NULL;
        DUET_OK_OR_FAIL(duet_cuda_gemm_matmul_multi(g, 0, M, &op, 1, flags));
        CUDA_OK(cudaMemcpy(ys, dy, yb, cudaMemcpyDeviceToHost));
        DUET_OK_OR_FAIL(duet_cuda_gemm_matmul_multi(g, 0, M, &plain, 1, flags));
        CUDA_OK(cudaMemcpy(yf, dy, yb, cudaMemcpyDeviceToHost));
        CHECK(memcmp(ys, yf, yb) == 0, "%s: the op with w_bf16 differs from the F32 op",
              c == 0 ? "no planes" : "TF32");
    }

    /* a BF16 op reading plane 0, beside the split op, against it converting x itself */
    DUET_OK_OR_FAIL(duet_cuda_gemm_matmul(g, 0, dy2, N2, dx, ld, M, &t2, 0, 0));
    CUDA_OK(cudaMemcpy(y2a, dy2, y2b, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemset(dy2, 0, y2b));
    const duet_cuda_gemm_op_t two[2] = {
        {.y = dy2, .ldy = N2, .x = dx, .ldx = ld, .w = &t2, .xs = dxs}, split};
    DUET_OK_OR_FAIL(duet_cuda_gemm_matmul_multi(g, 0, M, two, 2, 0));
    CUDA_OK(cudaMemcpy(y2m, dy2, y2b, cudaMemcpyDeviceToHost));
    CHECK(memcmp(y2m, y2a, y2b) == 0, "the BF16 op on plane 0 differs from it converting x");

    /* a BF16 op with xs at 2 rows (a GEMV's size) multiplies plane 0 and never reads x: x all
     * NaN here, the result that of cuBLASLt on the plane */
    {
        float *dnan = dev_alloc((size_t)(2 * ld) * 4);
        CUDA_OK(cudaMemset(dnan, 0xff, (size_t)(2 * ld) * 4));
        const duet_cuda_gemm_op_t small = {
            .y = dy2, .ldy = N2, .x = dnan, .ldx = ld, .w = &t2, .xs = dxs};
        DUET_OK_OR_FAIL(duet_cuda_gemm_matmul_multi(g, 0, 2, &small, 1, 0));
        CUDA_OK(cudaMemcpy(y2m, dy2, (size_t)(2 * N2) * 4, cudaMemcpyDeviceToHost));
        DUET_OK_OR_FAIL(duet_cuda_gemm_matmul_lowp(g, 0, dy2, N2, dxs, K, 2, &t2, 0, 0));
        CUDA_OK(cudaMemcpy(y2a, dy2, (size_t)(2 * N2) * 4, cudaMemcpyDeviceToHost));
        CHECK(memcmp(y2m, y2a, (size_t)(2 * N2) * 4) == 0 && isfinite(y2m[0]),
              "a 2-row BF16 op with xs is not cuBLASLt on plane 0");
        cudaFree(dnan);
    }

    /* a twin that is not w's shape in BF16 is refused, naming it */
    {
        duet_cuda_gemm_op_t bad = split;
        bad.w_bf16 = &t2; /* N2 rows, not N */
        CHECK(duet_cuda_gemm_matmul_multi(g, 0, M, &bad, 1, 0) == DUET_ERR_INVALID);
        CHECK(strstr(duet_error_last(), "w_bf16") != NULL, "%s", duet_error_last());
        bad.w_bf16 = &tf; /* F32, not BF16 */
        CHECK(duet_cuda_gemm_matmul_multi(g, 0, M, &bad, 1, 0) == DUET_ERR_INVALID);
    }

    /* when splitting pays, and what split_x refuses */
    CHECK(duet_cuda_gemm_split_pays(DUET_CUDA_GEMM_SPLIT_ROWS, 2304, 0) == 1);
    CHECK(duet_cuda_gemm_split_pays(DUET_CUDA_GEMM_SPLIT_ROWS - 1, 2304, 0) == 0);
    CHECK(duet_cuda_gemm_split_pays(8192, 2300, 0) == 0);
    CHECK(duet_cuda_gemm_split_pays(8192, 2304, DUET_CUDA_GEMM_TF32) == 0);
    CHECK(duet_cuda_gemm_split_x(dxs, dx, ld, M, K - 4, 0) == DUET_ERR_INVALID);
    CHECK(duet_cuda_gemm_split_x(dxs, dx + 1, ld, M, K, 0) == DUET_ERR_INVALID);
    CHECK(duet_cuda_gemm_split_x((char *)dxs + 2, dx, ld, M, K, 0) == DUET_ERR_INVALID);
    CHECK(duet_cuda_gemm_split_x(dxs, dx, K - 8, M, K, 0) == DUET_ERR_INVALID);
    CHECK(duet_cuda_gemm_split_x(NULL, dx, ld, M, K, 0) == DUET_ERR_INVALID);
    CHECK(strstr(duet_error_last(), "split_x") != NULL, "%s", duet_error_last());

    cudaFree(dx), cudaFree(dxs), cudaFree(tf.data), cudaFree(tb.data), cudaFree(t2.data),
        cudaFree(dy), cudaFree(dy2);
    free(x), free(wf), free(wb), free(w2), free(planes), free(ys), free(yf), free(yp), free(ya),
        free(y2m), free(y2a), free(y0);
    duet_cuda_gemm_destroy(g);
}
