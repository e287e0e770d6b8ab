/*
 * test_cuda_ops.c: the CUDA ops of kernels/cuda/cuda_ops.h against their CPU references on the
 * same inputs: embedding gather, RMSNorm (plain, strided, in place, fused with the residual),
 * the gated activations (kernels/cpu/ops.c); MoE routing (kernels/cpu/moe.c's
 * duet_cpu_moe_route) and the routed experts (engine/backend_cpu.c duet__moe_layer's algorithm
 * built from duet_k_matmul and the CPU activations); argmax and sampling (engine/sampler.c,
 * duet_sampler_sample with the same u from duet_rng_uniform). Without a CUDA device (the build
 * VM, CI) every test skips with a reason. Each test prints its max error (`--verbose`); the
 * `bench` tests print timings at the real model's sizes.
 *
 * Error measures and tolerances are stated where each comparison is made.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <criterion/criterion.h>
#include <cuda_runtime_api.h>

#include "engine/sampler.h"
#include "kernels/cpu/cpu_moe.h"
#include "kernels/cuda/cuda_gemm.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/kernels.h"

#define DUET_TEST_RNG_SEED 0x2545f4914f6cdd1dull
#include "cuda_test_util.h"

/* moe.cu's internal entry point that forces the expert path (0 auto, 1 GEMV, 2 MMA, plus the
 * flags below). */
duet_status_t duet__cuda_moe_experts_path(cudaStream_t stream, const duet_cuda_experts_t *ex,
                                          const float *x, int64_t T, const int32_t *idx,
                                          const float *wts, int64_t top_k, duet_cuda_act_t act,
                                          float beta, float beta_lin, float *y, void *scratch,
                                          int path);

/* 1 when the MMA path with nothing forced runs moe.cu's wgmma kernels at these D and I (an
 * sm_90a device, multiples of 64, DUET_CUDA_NO_WGMMA unset), else 0 (mma.sync). */
int duet__cuda_moe_wgmma_default(int64_t D, int64_t I);

/* PATH_NO_PDL is this file's: moe_call turns programmatic dependent launch off around the call
 * (duet_cuda_pdl_set). PATH_SEPARATE is moe.cu's: up to 2 rows on the GEMV path, the combine
 * kernel after gemv2 instead of gemv2 adding into y through tickets (past 2 rows, and on the
 * multi-slice kernels, the GEMV path always launches the combine kernel). PATH_DEEP is moe.cu's
 * too: at T = 1 on the GEMV path, the expert kernels without their register cap, with more of each
 * row in flight. PATH_EARLY is this file's: moe_case passes the norm's source row
 * (duet_cuda_experts_t's norm_x, norm_w), so that the folded shared expert forms its input itself
 * and runs ahead of the routing. */
enum {
    PATH_AUTO = 0,
    PATH_GEMV = 1,
    PATH_MMA = 2,
    PATH_NO_PDL = 0x1000,
    PATH_SEPARATE = 0x2000,
    PATH_DEEP = 0x4000,
    PATH_EARLY = 0x10000,
    PATH_XB = 0x20000,     /* this file's: x handed over rounded already (experts_t's xb), as plane
                              0 of duet_cuda_gemm_split_x */
    PATH_SYNC = 0x1000000, /* the MMA path's mma.sync kernels */
    PATH_WG = 0x2000000,   /* the MMA path's wgmma kernels (refused where unusable) */
    PATH_NO_WS = 0x4000000 /* wgmma's 128-row tiles on the two-warpgroup kernel, not the
                              warp-specialised one */
};
/* the MMA path with its tile height forced (moe.cu's path bits 8..11) */
#define MMA_BM(bm) (PATH_MMA | ((bm) == 64 ? 1 << 8 : 2 << 8))
/* the GEMV path at T > 1 with 1 slice of output rows per block, or (n > 1) 4 (moe.cu's bits
 * 20..23; its own choice is 1, or 4 from 256 slots on) */
#define GEMV_SPB(n) (PATH_GEMV | ((n) << 20))

/* Roughly normal (sum of four uniforms, variance 4/3 scaled to 1). */
static float rng_n(void)
{
    return (rng_f() + rng_f() + rng_f() + rng_f()) * 0.8660254f;
}

static void host_copy(void *h, const void *d, size_t n)
{
    CUDA_OK(cudaMemcpy(h, d, n, cudaMemcpyDeviceToHost));
}

static void skip_without_device(void)
{
    skip_without_device_for("the CUDA ops are");
}

static duet_kernels_t *cpu_create(void)
{
    duet_kernels_t *k = NULL;
    DUET_OK_OR_FAIL(duet_kernels_create(DUET_DEVICE_CPU, 0, &k));
    return k;
}

static uint16_t to_dtype16(float v, duet_dtype_t dt)
{
    return dt == DUET_DTYPE_BF16 ? duet_f32_to_bf16(v) : duet_f32_to_f16(v);
}

static duet_status_t moe_call(cudaStream_t st, const duet_cuda_experts_t *ex, const float *x,
                              int64_t T, const int32_t *idx, const float *wts, int64_t K,
                              duet_cuda_act_t act, float beta, float beta_lin, float *y,
                              void *scratch, int path)
{
    if (path & PATH_NO_PDL)
        duet_cuda_pdl_set(0);
    const duet_status_t s =
        duet__cuda_moe_experts_path(st, ex, x, T, idx, wts, K, act, beta, beta_lin, y, scratch,
                                    path & ~(PATH_NO_PDL | PATH_EARLY));
    if (path & PATH_NO_PDL)
        duet_cuda_pdl_set(-1);
    return s;
}

/* ---- embed ----------------------------------------------------------------------------------- */

/* The gather only widens: results must be bit-equal. */
Test(cuda_ops, embed, .timeout = 60)
{
    skip_without_device();
    const int64_t V = 1000, D = 136, n = 77;
    const duet_dtype_t dts[] = {DUET_DTYPE_F32, DUET_DTYPE_BF16, DUET_DTYPE_F16};
    duet_kernels_t *cpu = cpu_create();
    int32_t *ids = xmalloc(sizeof(*ids) * n);
    for (int64_t t = 0; t < n; t++)
        ids[t] = (int32_t)(rng_u32() % V);
    ids[0] = 0;
    ids[1] = (int32_t)(V - 1);
    int32_t *dids = dev_copy(ids, sizeof(*ids) * n);
    for (size_t k = 0; k < sizeof(dts) / sizeof(dts[0]); k++) {
        const size_t es = duet_dtype_size(dts[k]);
        uint8_t *tab = xmalloc(es * V * D);
        for (int64_t i = 0; i < V * D; i++) {
            float v = rng_f() * 3.0f;
            if (dts[k] == DUET_DTYPE_F32)
                ((float *)tab)[i] = v;
            else
                ((uint16_t *)tab)[i] = to_dtype16(v, dts[k]);
        }
        duet_tensor_t t = {
            .data = tab, .dtype = dts[k], .device = DUET_DEVICE_CPU, .ndim = 2, .shape = {V, D}};
        float *ref = xmalloc(sizeof(float) * n * D), *got = xmalloc(sizeof(float) * n * D);
        duet_k_embed(cpu, ref, &t, ids, n);
        void *dtab = dev_copy(tab, es * V * D);
        float *dout = dev_alloc(sizeof(float) * n * D);
        DUET_OK_OR_FAIL(duet_cuda_embed(0, dout, dtab, dts[k], D, dids, n));
        host_copy(got, dout, sizeof(float) * n * D);
        double maxd = 0;
        for (int64_t i = 0; i < n * D; i++)
            maxd = fmax(maxd, fabs((double)got[i] - ref[i]));
        printf("[cuda_ops] embed %-4s max |gpu-cpu| = %g (must be 0)\n", duet_dtype_name(dts[k]),
               maxd);
        CHECK(maxd == 0.0, "embed %s differs", duet_dtype_name(dts[k]));
        cudaFree(dout);
        cudaFree(dtab);
        free(got);
        free(ref);
        free(tab);
    }
    cudaFree(dids);
    free(ids);
    duet_kernels_destroy(cpu);
}

/* ---- rmsnorm --------------------------------------------------------------------------------- */

/*
 * Both sides sum squares in double and round the scale once to fp32, then y = w · (x · scale)
 * in fp32: only the summation order differs (~1e-16 relative), which flips the fp32 scale by one
 * ulp at worst, so each output may differ by 1 ulp of the scale plus its own rounding:
 * tolerance 3e-7 relative (2.5 ulps).
 */
#define RMS_TOL 3e-7

static double rel_err(float got, float ref)
{
    double d = fabs((double)got - ref), s = fabs((double)ref);
    return s > 1e-30 ? d / s : d;
}

Test(cuda_ops, rmsnorm, .timeout = 60)
{
    skip_without_device();
    duet_kernels_t *cpu = cpu_create();
    /* D picks the kernel's instance: 4, 9 or 12 elements per thread, 3500 in two passes */
    const int64_t Ms[] = {1, 33}, Ds[] = {100, 1536, 2304, 3500};
    for (size_t a = 0; a < 2; a++)
        for (size_t b = 0; b < 4; b++) {
            const int64_t M = Ms[a], D = Ds[b], ldx = D + 8, ldy = D + 4;
            const float eps = 1e-6f;
            float *x = xmalloc(sizeof(float) * M * ldx), *w = xmalloc(sizeof(float) * D);
            float *xc = xmalloc(sizeof(float) * M * D), *ref = xmalloc(sizeof(float) * M * D);
            float *got = xmalloc(sizeof(float) * M * ldy);
            for (int64_t i = 0; i < M * ldx; i++)
                x[i] = rng_f() * (float)(1 + (i % 7));
            for (int64_t i = 0; i < D; i++)
                w[i] = 1.0f + 0.5f * rng_f();
            for (int64_t m = 0; m < M; m++)
                memcpy(xc + m * D, x + m * ldx, sizeof(float) * D);
            duet_tensor_t wt = {.data = w,
                                .dtype = DUET_DTYPE_F32,
                                .device = DUET_DEVICE_CPU,
                                .ndim = 1,
                                .shape = {D}};
            duet_k_rmsnorm(cpu, ref, xc, &wt, M, D, eps);

            float *dx = dev_copy(x, sizeof(float) * M * ldx), *dw = dev_copy(w, sizeof(float) * D);
            float *dy = dev_alloc(sizeof(float) * M * ldy);
            DUET_OK_OR_FAIL(duet_cuda_rmsnorm(0, dy, ldy, dx, ldx, dw, M, D, eps));
            host_copy(got, dy, sizeof(float) * M * ldy);
            double e1 = 0;
            for (int64_t m = 0; m < M; m++)
                for (int64_t d = 0; d < D; d++)
                    e1 = fmax(e1, rel_err(got[m * ldy + d], ref[m * D + d]));
            /* in place, y = x with x's stride */
            DUET_OK_OR_FAIL(duet_cuda_rmsnorm(0, dx, ldx, dx, ldx, dw, M, D, eps));
            float *got2 = xmalloc(sizeof(float) * M * ldx);
            host_copy(got2, dx, sizeof(float) * M * ldx);
            double e2 = 0;
            for (int64_t m = 0; m < M; m++)
                for (int64_t d = 0; d < D; d++)
                    e2 = fmax(e2, rel_err(got2[m * ldx + d], ref[m * D + d]));
            printf("[cuda_ops] rmsnorm M=%lld D=%lld: max rel err strided %.2e in-place %.2e "
                   "(tol %.1e)\n",
                   (long long)M, (long long)D, e1, e2, RMS_TOL);
            CHECK(e1 <= RMS_TOL && e2 <= RMS_TOL, "rmsnorm M=%lld D=%lld", (long long)M,
                  (long long)D);
            cudaFree(dy);
            cudaFree(dw);
            cudaFree(dx);
            free(got2);
            free(got);
            free(ref);
            free(xc);
            free(w);
            free(x);
        }
    duet_kernels_destroy(cpu);
}

/* The norms refuse what they cannot run before touching the device (no device needed): missing
 * rows or weights, strides below D, and rows wider than the kernel's 32-bit indices take. */
/*
 * duet_cuda_rmsnorm_planes against duet_cuda_rmsnorm on the same rows: y bit for bit (strided,
 * and in place), and plane t equal to the t-th bf16 term of y as the host splits it (round to
 * nearest even, then the exact remainder), bit for bit, for 1 and 3 planes; every instance of
 * the kernel (D = 100, 1536, 2304, and 3500 in two passes). Bad plane counts are refused.
 */
Test(cuda_ops, rmsnorm_planes, .timeout = 60)
{
    skip_without_device();
    const int64_t M = 33, Ds[] = {100, 1536, 2304, 3500};
    for (size_t b = 0; b < 4; b++)
        for (int P = 1; P <= 3; P += 2)
            for (int in_place = 0; in_place <= 1; in_place++) {
                const int64_t D = Ds[b], ld = D + 8;
                const float eps = 1e-6f;
                float *x = xmalloc(sizeof(float) * M * ld), *w = xmalloc(sizeof(float) * D);
                for (int64_t i = 0; i < M * ld; i++)
                    x[i] = rng_f() * (float)(1 + (i % 7));
                for (int64_t i = 0; i < D; i++)
                    w[i] = 1.0f + 0.5f * rng_f();
                float *dx = dev_copy(x, sizeof(float) * M * ld),
                      *dw = dev_copy(w, sizeof(float) * D);
                float *dref = dev_alloc(sizeof(float) * M * ld);
                float *dy = in_place ? dx : dev_alloc(sizeof(float) * M * ld);
                uint16_t *dxs = dev_alloc(sizeof(uint16_t) * 3 * M * D);
                DUET_OK_OR_FAIL(duet_cuda_rmsnorm(0, dref, ld, dx, ld, dw, M, D, eps));
                DUET_OK_OR_FAIL(duet_cuda_rmsnorm_planes(0, dy, ld, dx, ld, dw, M, D, eps, dxs, P));
                float *ref = xmalloc(sizeof(float) * M * ld),
                      *got = xmalloc(sizeof(float) * M * ld);
                uint16_t *xs = xmalloc(sizeof(uint16_t) * 3 * M * D);
                host_copy(ref, dref, sizeof(float) * M * ld);
                host_copy(got, dy, sizeof(float) * M * ld);
                host_copy(xs, dxs, sizeof(uint16_t) * P * M * D);
                for (int64_t m = 0; m < M; m++)
                    for (int64_t d = 0; d < D; d++) {
                        const float y = ref[m * ld + d];
                        CHECK(memcmp(&got[m * ld + d], &y, 4) == 0,
                              "D=%lld P=%d in place %d: y[%lld][%lld] %.9g, rmsnorm %.9g",
                              (long long)D, P, in_place, (long long)m, (long long)d,
                              got[m * ld + d], y);
                        float r = y;
                        for (int t = 0; t < P; t++) {
                            const uint16_t h = duet_f32_to_bf16(r);
                            CHECK(xs[t * M * D + m * D + d] == h,
                                  "D=%lld P=%d: plane %d [%lld][%lld] %04x, host %04x",
                                  (long long)D, P, t, (long long)m, (long long)d,
                                  xs[t * M * D + m * D + d], h);
                            r -= duet_bf16_to_f32(h);
                        }
                    }
                printf("[cuda_ops] rmsnorm_planes D=%lld planes %d%s: y and planes bit-exact\n",
                       (long long)D, P, in_place ? " (in place)" : "");
                if (!in_place)
                    cudaFree(dy);
                cudaFree(dxs), cudaFree(dref), cudaFree(dw), cudaFree(dx);
                free(xs), free(got), free(ref), free(w), free(x);
            }
    float one = 1.0f;
    CHECK(duet_cuda_rmsnorm_planes(0, &one, 1, &one, 1, &one, 1, 1, 1e-6f, &one, 2) ==
          DUET_ERR_INVALID);
    CHECK(duet_cuda_rmsnorm_planes(0, &one, 1, &one, 1, &one, 1, 1, 1e-6f, NULL, 1) ==
          DUET_ERR_INVALID);
    /* planes only (y NULL): the same planes, and nothing else written */
    {
        const int64_t M2 = 5, D2 = 2304;
        float *x = xmalloc(sizeof(float) * M2 * D2), *w = xmalloc(sizeof(float) * D2);
        for (int64_t i = 0; i < M2 * D2; i++)
            x[i] = rng_f();
        for (int64_t i = 0; i < D2; i++)
            w[i] = 1.0f + 0.5f * rng_f();
        float *dx = dev_copy(x, sizeof(float) * M2 * D2), *dw = dev_copy(w, sizeof(float) * D2);
        float *dy = dev_alloc(sizeof(float) * M2 * D2);
        uint16_t *da = dev_alloc(sizeof(uint16_t) * 3 * M2 * D2),
                 *db = dev_alloc(sizeof(uint16_t) * 3 * M2 * D2);
        DUET_OK_OR_FAIL(duet_cuda_rmsnorm_planes(0, dy, D2, dx, D2, dw, M2, D2, 1e-6f, da, 3));
        DUET_OK_OR_FAIL(duet_cuda_rmsnorm_planes(0, NULL, D2, dx, D2, dw, M2, D2, 1e-6f, db, 3));
        uint16_t *a = xmalloc(sizeof(uint16_t) * 3 * M2 * D2),
                 *b = xmalloc(sizeof(uint16_t) * 3 * M2 * D2);
        host_copy(a, da, sizeof(uint16_t) * 3 * M2 * D2);
        host_copy(b, db, sizeof(uint16_t) * 3 * M2 * D2);
        CHECK(memcmp(a, b, sizeof(uint16_t) * 3 * M2 * D2) == 0, "planes without y differ");
        CHECK(duet_cuda_rmsnorm(0, NULL, D2, dx, D2, dw, M2, D2, 1e-6f) == DUET_ERR_INVALID,
              "rmsnorm without y");
        cudaFree(dx), cudaFree(dw), cudaFree(dy), cudaFree(da), cudaFree(db);
        free(x), free(w), free(a), free(b);
    }
}

Test(cuda_ops, rmsnorm_bad_arguments, .timeout = 30)
{
    float f[8] = {0};
    CHECK(duet_cuda_rmsnorm(0, f, 4, f, 3, f, 1, 4, 1e-6f) == DUET_ERR_INVALID, "ldx < D");
    CHECK(duet_cuda_rmsnorm(0, f, 3, f, 4, f, 1, 4, 1e-6f) == DUET_ERR_INVALID, "ldy < D");
    CHECK(duet_cuda_rmsnorm(0, f, 4, f, 4, NULL, 1, 4, 1e-6f) == DUET_ERR_INVALID, "no w");
    CHECK(duet_cuda_rmsnorm(0, f, 4, f, 4, f, -1, 4, 1e-6f) == DUET_ERR_INVALID, "M < 0");
    CHECK(duet_cuda_add_rmsnorm(0, NULL, f, f, f, 1, 4, 1e-6f) == DUET_ERR_INVALID, "no y");
    const int64_t wide = (int64_t)1 << 31; /* 2^31 values in a row */
    const duet_status_t st = duet_cuda_rmsnorm(0, f, wide, f, wide, f, 1, wide, 1e-6f);
    printf("[cuda_ops] rmsnorm refuses a row of 2^31: %s (%s)\n", duet_status_name(st),
           duet_error_last());
    CHECK(st == DUET_ERR_RANGE && strstr(duet_error_last(), "cuda rmsnorm") != NULL,
          "a row of 2^31: %s", duet_status_name(st));
    CHECK(duet_cuda_add_rmsnorm(0, f, f, f, f, 1, 0x7fffffff, 1e-6f) == DUET_ERR_RANGE &&
              strstr(duet_error_last(), "cuda add_rmsnorm") != NULL,
          "add: a row of 2^31 - 1");
    CHECK(duet_cuda_rmsnorm(0, f, 4, f, 4, f, 0, 4, 1e-6f) == DUET_OK, "no rows: nothing");
}

/* x += a is one fp32 addition on both sides (bit-equal); y as for rmsnorm. */
Test(cuda_ops, add_rmsnorm, .timeout = 60)
{
    skip_without_device();
    duet_kernels_t *cpu = cpu_create();
    const int64_t M = 17, D = 2304;
    const float eps = 1e-5f;
    for (int with_a = 0; with_a < 2; with_a++) {
        float *x = xmalloc(sizeof(float) * M * D), *a = xmalloc(sizeof(float) * M * D);
        float *w = xmalloc(sizeof(float) * D), *ref = xmalloc(sizeof(float) * M * D);
        float *gx = xmalloc(sizeof(float) * M * D), *gy = xmalloc(sizeof(float) * M * D);
        for (int64_t i = 0; i < M * D; i++) {
            x[i] = rng_f() * 4.0f;
            a[i] = rng_f();
        }
        for (int64_t i = 0; i < D; i++)
            w[i] = rng_f();
        float *dx = dev_copy(x, sizeof(float) * M * D), *da = dev_copy(a, sizeof(float) * M * D);
        float *dw = dev_copy(w, sizeof(float) * D), *dy = dev_alloc(sizeof(float) * M * D);
        DUET_OK_OR_FAIL(duet_cuda_add_rmsnorm(0, dy, dx, with_a ? da : NULL, dw, M, D, eps));
        if (with_a)
            for (int64_t i = 0; i < M * D; i++)
                x[i] += a[i];
        duet_tensor_t wt = {
            .data = w, .dtype = DUET_DTYPE_F32, .device = DUET_DEVICE_CPU, .ndim = 1, .shape = {D}};
        duet_k_rmsnorm(cpu, ref, x, &wt, M, D, eps);
        host_copy(gx, dx, sizeof(float) * M * D);
        host_copy(gy, dy, sizeof(float) * M * D);
        double ex = 0, ey = 0;
        for (int64_t i = 0; i < M * D; i++) {
            ex = fmax(ex, fabs((double)gx[i] - x[i]));
            ey = fmax(ey, rel_err(gy[i], ref[i]));
        }
        printf("[cuda_ops] add_rmsnorm a=%s: max |x diff| %g (must be 0), y max rel err %.2e "
               "(tol %.1e)\n",
               with_a ? "yes " : "NULL", ex, ey, RMS_TOL);
        CHECK(ex == 0.0 && ey <= RMS_TOL, "add_rmsnorm");
        cudaFree(dy);
        cudaFree(dw);
        cudaFree(da);
        cudaFree(dx);
        free(gy);
        free(gx);
        free(ref);
        free(w);
        free(a);
        free(x);
    }
    duet_kernels_destroy(cpu);
}

/* ---- activations ----------------------------------------------------------------------------- */

/*
 * Same expressions on both sides; CUDA's expf and tanhf are within 2 ulps (glibc's within ~1),
 * and the errors of at most five roundings and two transcendentals add up: tolerance 2e-6
 * relative (~16 ulps), on outputs of magnitude > 1e-30.
 */
#define ACT_TOL 2e-6

/* act_mul refuses what it cannot run before touching the device (no device needed): a row
 * stride below I, missing rows, an unknown activation, SiTU without its betas, and a row too
 * long for one grid row of blocks. */
Test(cuda_ops, act_mul_bad_arguments, .timeout = 30)
{
    _Alignas(16) float f[4] = {0};
    const duet_cuda_act_t silu = DUET_CUDA_ACT_SILU, situ = DUET_CUDA_ACT_SITU;
    CHECK(duet_cuda_act_mul(0, f, f, 1, 4, 3, silu, 1.0f, 1.0f) == DUET_ERR_INVALID, "ld < I");
    CHECK(duet_cuda_act_mul(0, NULL, f, 1, 4, 4, silu, 1.0f, 1.0f) == DUET_ERR_INVALID, "no gate");
    CHECK(duet_cuda_act_mul(0, f, NULL, 1, 4, 4, silu, 1.0f, 1.0f) == DUET_ERR_INVALID, "no up");
    CHECK(duet_cuda_act_mul(0, f, f, -1, 4, 4, silu, 1.0f, 1.0f) == DUET_ERR_INVALID, "M < 0");
    CHECK(duet_cuda_act_mul(0, f, f, 1, 4, 4, (duet_cuda_act_t)7, 1.0f, 1.0f) == DUET_ERR_INVALID,
          "unknown activation");
    CHECK(duet_cuda_act_mul(0, f, f, 1, 4, 4, situ, 0.0f, 1.0f) == DUET_ERR_INVALID, "beta 0");
    CHECK(duet_cuda_act_mul(0, f, f, 1, 4, 4, situ, 1.0f, 0.0f) == DUET_ERR_INVALID, "beta_lin 0");
    const int64_t huge = (int64_t)1 << 42; /* 2^32 blocks of 4 x 256 columns */
    CHECK(duet_cuda_act_mul(0, f, f, 1, huge, huge, silu, 1.0f, 1.0f) == DUET_ERR_RANGE,
          "a row of 2^42 columns");
    CHECK(duet_cuda_act_mul(0, f, f, 0, 4, 4, silu, 1.0f, 1.0f) == DUET_OK, "no rows: nothing");
}

/* (rows, I, ld): four columns per thread (I and ld multiples of 4), and one (odd I and ld) */
Test(cuda_ops, act_mul, .timeout = 60)
{
    skip_without_device();
    duet_kernels_t *cpu = cpu_create();
    const int64_t shapes[2][3] = {{7, 300, 320}, {5, 301, 303}};
    const float beta = 2.5f, beta_lin = 7.0f;
    for (int si = 0; si < 4; si++) {
        const int act = si & 1;
        const int64_t M = shapes[si / 2][0], I = shapes[si / 2][1], ld = shapes[si / 2][2];
        float *g = xmalloc(sizeof(float) * M * ld), *u = xmalloc(sizeof(float) * M * ld);
        float *ref = xmalloc(sizeof(float) * M * I), *got = xmalloc(sizeof(float) * M * ld);
        for (int64_t i = 0; i < M * ld; i++) {
            g[i] = rng_f() * 12.0f;
            u[i] = rng_f() * 12.0f;
        }
        for (int64_t m = 0; m < M; m++) {
            if (act == DUET_CUDA_ACT_SILU)
                duet_k_silu_mul(cpu, ref + m * I, g + m * ld, u + m * ld, I);
            else
                duet_k_situ_mul(cpu, ref + m * I, g + m * ld, u + m * ld, I, beta, beta_lin);
        }
        float *dg = dev_copy(g, sizeof(float) * M * ld), *du = dev_copy(u, sizeof(float) * M * ld);
        DUET_OK_OR_FAIL(
            duet_cuda_act_mul(0, dg, du, M, I, ld, (duet_cuda_act_t)act, beta, beta_lin));
        host_copy(got, dg, sizeof(float) * M * ld);
        double e = 0;
        for (int64_t m = 0; m < M; m++) {
            for (int64_t i = 0; i < I; i++)
                e = fmax(e, rel_err(got[m * ld + i], ref[m * I + i]));
            for (int64_t i = I; i < ld; i++) /* padding untouched */
                CHECK(got[m * ld + i] == g[m * ld + i], "padding written");
        }
        printf("[cuda_ops] act_mul %s, %lld x %lld (ld %lld): max rel err %.2e (tol %.1e)\n",
               act == DUET_CUDA_ACT_SILU ? "SiLU" : "SiTU", (long long)M, (long long)I,
               (long long)ld, e, ACT_TOL);
        CHECK(e <= ACT_TOL, "act_mul %d", act);
        /* the bf16 form from the original gate: those values rounded, gate left as it was */
        CUDA_OK(cudaMemcpy(dg, g, sizeof(float) * M * ld, cudaMemcpyHostToDevice));
        uint16_t *dh = dev_alloc(sizeof(uint16_t) * M * I), *h = xmalloc(sizeof(uint16_t) * M * I);
        DUET_OK_OR_FAIL(
            duet_cuda_act_mul_bf16(0, dh, dg, du, M, I, ld, (duet_cuda_act_t)act, beta, beta_lin));
        host_copy(h, dh, sizeof(uint16_t) * M * I);
        float *g2 = xmalloc(sizeof(float) * M * ld);
        host_copy(g2, dg, sizeof(float) * M * ld);
        CHECK(memcmp(g2, g, sizeof(float) * M * ld) == 0, "act_mul_bf16 wrote gate");
        for (int64_t m = 0; m < M; m++)
            for (int64_t i = 0; i < I; i++)
                CHECK(h[m * I + i] == duet_f32_to_bf16(got[m * ld + i]),
                      "act_mul_bf16 [%lld][%lld]: %04x, act_mul's value rounded %04x", (long long)m,
                      (long long)i, h[m * I + i], duet_f32_to_bf16(got[m * ld + i]));
        CHECK(duet_cuda_act_mul_bf16(0, NULL, dg, du, M, I, ld, (duet_cuda_act_t)act, beta,
                                     beta_lin) == DUET_ERR_INVALID);
        cudaFree(dh);
        free(h);
        free(g2);
        cudaFree(du);
        cudaFree(dg);
        free(got);
        free(ref);
        free(u);
        free(g);
    }
    duet_kernels_destroy(cpu);
}

/* ---- routing --------------------------------------------------------------------------------- */

/* The CPU's routing of one row (kernels/cpu/moe.c, the reference of duet_cuda_moe_route). */
static void route_ref(const float *logits, const float *bias, int64_t E, int64_t n_group,
                      int64_t topk_group, int64_t top_k, int renorm, float scale, int32_t *idx,
                      float *wts)
{
    duet_cpu_moe_route(logits, bias, 1, E, n_group, topk_group, top_k, renorm, scale, idx, wts);
}

/*
 * The sigmoid is evaluated the CPU's way with a correctly rounded exp, so scores are bit-equal
 * except in rare double-rounding cases of glibc's expf (< 0.502 ulp), and the choices with them:
 * expert ids must be equal, weights equal to 1e-6 relative (a 1-ulp score and the
 * renormalising sum). Logits and biases are coarse multiples so many choices tie exactly:
 * ties must go to the lower index, as on the CPU. Cases: Kimi-Linear's router (256, top 8,
 * no groups), DeepSeek-V3's (256 in 8 groups, keep 4), Kimi K2's 384 experts, 1000 experts
 * (several loads per lane), groups that leave fewer experts than top_k (the rest are picked
 * among the -inf choices, lowest index first), top_k 32; each at T = 1, 4, 37 (a row per
 * block) and 100 (several rows per block); without a bias (NULL) in the even cases.
 */
Test(cuda_ops, moe_route, .timeout = 60)
{
    skip_without_device();
    static const struct {
        int64_t E, G, tg, k;
        int renorm;
        float scale;
    } cases[] = {{256, 1, 1, 8, 1, 2.446f}, {64, 8, 3, 6, 0, 1.0f},   {72, 24, 5, 4, 1, 1.0f},
                 {16, 16, 4, 3, 1, 0.5f},   {256, 8, 4, 8, 1, 2.5f},  {40, 1, 1, 32, 0, 1.0f},
                 {384, 1, 1, 8, 1, 2.827f}, {1000, 1, 1, 8, 0, 1.0f}, {16, 8, 1, 5, 1, 1.0f},
                 {384, 12, 3, 16, 1, 1.5f}};
    static const int64_t Ts[] = {1, 4, 37, 100}; /* 100: several rows per block */
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++)
        for (size_t ti = 0; ti < sizeof(Ts) / sizeof(Ts[0]); ti++) {
            const int64_t E = cases[c].E, K = cases[c].k, T = Ts[ti];
            float *lg = xmalloc(sizeof(float) * T * E), *bias = xmalloc(sizeof(float) * E);
            for (int64_t i = 0; i < T * E; i++)
                lg[i] = (float)((int)(rng_u32() % 33) - 16) / 4.0f;
            for (int64_t t = 0; t < E; t++) /* row 0: all equal, so picks are 0..k-1 by index */
                lg[t] = 0.5f;
            for (int64_t e = 0; e < E; e++)
                bias[e] = (c & 1) ? (float)((int)(rng_u32() % 9) - 4) / 64.0f : 0.0f;
            int32_t *ri = xmalloc(sizeof(int32_t) * T * K), *gi = xmalloc(sizeof(int32_t) * T * K);
            float *rw = xmalloc(sizeof(float) * T * K), *gw = xmalloc(sizeof(float) * T * K);
            for (int64_t t = 0; t < T; t++)
                route_ref(lg + t * E, bias, E, cases[c].G, cases[c].tg, K, cases[c].renorm,
                          cases[c].scale, ri + t * K, rw + t * K);
            float *dl = dev_copy(lg, sizeof(float) * T * E);
            float *db = (c & 1) ? dev_copy(bias, sizeof(float) * E) : NULL;
            int32_t *di = dev_alloc(sizeof(int32_t) * T * K);
            float *dw = dev_alloc(sizeof(float) * T * K);
            DUET_OK_OR_FAIL(duet_cuda_moe_route(0, dl, db, T, E, cases[c].G, cases[c].tg, K,
                                                cases[c].renorm, cases[c].scale, di, dw));
            host_copy(gi, di, sizeof(int32_t) * T * K);
            host_copy(gw, dw, sizeof(float) * T * K);
            int n_idx_diff = 0;
            double e = 0;
            for (int64_t i = 0; i < T * K; i++) {
                n_idx_diff += gi[i] != ri[i];
                e = fmax(e, rel_err(gw[i], rw[i]));
            }
            printf("[cuda_ops] moe_route E=%lld n_group=%lld topk_group=%lld k=%lld T=%lld%s: %d "
                   "expert ids differ (must be 0), weights max rel err %.2e (tol 1e-6)\n",
                   (long long)E, (long long)cases[c].G, (long long)cases[c].tg, (long long)K,
                   (long long)T, db == NULL ? " (no bias)" : "", n_idx_diff, e);
            CHECK(n_idx_diff == 0 && e <= 1e-6, "route case %zu T=%lld", c, (long long)T);
            if (cases[c].G == 1 && !(c & 1)) /* no bias: row 0's choices all tie */
                for (int64_t k = 0; k < K; k++)
                    CHECK(gi[k] == k, "tie row: pick %lld is %d", (long long)k, gi[k]);
            cudaFree(dw);
            cudaFree(di);
            cudaFree(db);
            cudaFree(dl);
            free(gw);
            free(rw);
            free(gi);
            free(ri);
            free(bias);
            free(lg);
        }
}

/*
 * duet_cuda_moe_router_route: the norm, the router and the routing of T rows in one kernel.
 * References, in double on the host: xn = nw · x / rms(x), within 1e-6 relative per element
 * (the kernel's scale comes from an fp32 sum of squares); logits = W · xn, within 1e-5 of
 * S = Σ |W| |xn| (fp32 sums in another order, a few ulps · sqrt(D) in the worst case; a wrong
 * row or scale is off by ~1). The picks must equal route_ref's on the kernel's own logits, as
 * in moe_route. Three calls in a row, and a CUDA graph replayed twice, must all agree bit for
 * bit and advance the call count in sync[0] by one each (block 0 of each call stores it, and the
 * next call tags its logits with it: a stale logit would hang or misroute). Cases: the real
 * dims, groups, an odd E (a half-empty last block), D not a multiple of 8, D longer than one
 * pass of loads (4100), no bias, top_k = 32 (every warp's 32 sorted keys are candidates), and
 * rows repeated in pairs so that choices tie (the lower index first, at E = 256 and at E = 200,
 * a partial last warp); each with T = 1 (decode at batch 1) and some with 5 or 8 rows (a verify
 * step's, batch 8: block m routes row m); then the argument checks.
 */
Test(cuda_ops, moe_router_route, .timeout = 120)
{
    skip_without_device();
    static const struct {
        int64_t E, D, G, tg, k;
        int renorm, bias;
        float scale;
        int ties;   /* rows 4j + 1 repeat rows 4j (and their bias): equal choices */
        int64_t T2; /* a second row count, or 0 */
    } cases[] = {{256, 2304, 1, 1, 8, 1, 1, 2.446f, 0, 5}, {64, 2304, 8, 3, 6, 0, 1, 1.0f, 0, 8},
                 {37, 100, 1, 1, 4, 1, 0, 1.0f, 0, 8},     {384, 4100, 12, 3, 16, 1, 1, 1.5f, 0, 3},
                 {256, 2304, 8, 4, 8, 1, 0, 2.5f, 0, 0},   {256, 2304, 1, 1, 32, 1, 1, 1.0f, 0, 2},
                 {256, 2304, 1, 1, 8, 1, 1, 2.446f, 1, 8}, {200, 512, 1, 1, 8, 0, 1, 1.0f, 1, 0},
                 {256, 2304, 1, 1, 32, 1, 0, 1.0f, 1, 0},  {4, 64, 1, 1, 2, 1, 1, 1.0f, 0, 8}};
    cudaStream_t st;
    CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    for (size_t c = 0; c < 2 * sizeof(cases) / sizeof(cases[0]); c++) {
        const size_t ci = c / 2;
        const int64_t E = cases[ci].E, D = cases[ci].D, K = cases[ci].k;
        const int64_t T = c % 2 == 0 ? 1 : cases[ci].T2;
        if (T == 0)
            continue;
        const float eps = 1e-6f;
        float *x = xmalloc(sizeof(float) * T * D), *nw = xmalloc(sizeof(float) * D);
        float *w = xmalloc(sizeof(float) * E * D), *bias = xmalloc(sizeof(float) * E);
        for (int64_t i = 0; i < T * D; i++)
            x[i] = rng_n() * 3.0f;
        for (int64_t i = 0; i < D; i++)
            nw[i] = 1.0f + 0.3f * rng_f();
        for (int64_t i = 0; i < E * D; i++)
            w[i] = rng_f() / sqrtf((float)D);
        for (int64_t e = 0; e < E; e++)
            bias[e] = cases[ci].bias ? (float)((int)(rng_u32() % 9) - 4) / 64.0f : 0.0f;
        for (int64_t e = 1; cases[ci].ties && e < E; e += 4) {
            memcpy(w + e * D, w + (e - 1) * D, sizeof(float) * D);
            bias[e] = bias[e - 1];
        }
        float *dx = dev_copy(x, sizeof(float) * T * D), *dnw = dev_copy(nw, sizeof(float) * D);
        float *dwr = dev_copy(w, sizeof(float) * E * D);
        float *db = cases[ci].bias ? dev_copy(bias, sizeof(float) * E) : NULL;
        float *dxn = dev_alloc(sizeof(float) * T * D), *dlg = dev_alloc(sizeof(float) * T * E);
        int32_t *di = dev_alloc(sizeof(int32_t) * T * K);
        float *dwt = dev_alloc(sizeof(float) * T * K);
        const size_t sync_bytes = sizeof(int) * (size_t)DUET_CUDA_ROUTER_SYNC_INTS(E);
        int *dsync = dev_alloc(sync_bytes);
        /* on st: a memset on the legacy stream would not order before st's kernels (st does
         * not block on it), and one landing after the first call's tags hangs the next */
        CUDA_OK(cudaMemsetAsync(dsync, 0, sync_bytes, st));
        const int64_t nfirst = T * (D + E + K);
        float *xn = xmalloc(sizeof(float) * T * D), *lg = xmalloc(sizeof(float) * T * E);
        float *gw = xmalloc(sizeof(float) * T * K), *rw = xmalloc(sizeof(float) * K);
        int32_t *gi = xmalloc(sizeof(int32_t) * T * K), *ri = xmalloc(sizeof(int32_t) * K);
        float *first = xmalloc(sizeof(float) * nfirst);
        int32_t *first_i = xmalloc(sizeof(int32_t) * T * K);
        cudaGraph_t g = NULL;
        cudaGraphExec_t ge = NULL;
        for (int call = 0; call < 5; call++) { /* 3 plain calls, then 2 graph replays */
            CUDA_OK(cudaMemsetAsync(dlg, 0xff, sizeof(float) * T * E, st));
            CUDA_OK(cudaMemsetAsync(di, 0xff, sizeof(int32_t) * T * K, st));
            if (call == 3) {
                CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
                DUET_OK_OR_FAIL(duet_cuda_moe_router_route(
                    st, dx, T, dnw, eps, dwr, E, D, db, cases[ci].G, cases[ci].tg, K,
                    cases[ci].renorm, cases[ci].scale, dxn, dlg, di, dwt, dsync));
                CUDA_OK(cudaStreamEndCapture(st, &g));
                CUDA_OK(cudaGraphInstantiate(&ge, g, 0));
            }
            if (call >= 3)
                CUDA_OK(cudaGraphLaunch(ge, st));
            else
                DUET_OK_OR_FAIL(duet_cuda_moe_router_route(
                    st, dx, T, dnw, eps, dwr, E, D, db, cases[ci].G, cases[ci].tg, K,
                    cases[ci].renorm, cases[ci].scale, dxn, dlg, di, dwt, dsync));
            CUDA_OK(cudaStreamSynchronize(st));
            int count = -1;
            host_copy(xn, dxn, sizeof(float) * T * D);
            host_copy(lg, dlg, sizeof(float) * T * E);
            host_copy(gi, di, sizeof(int32_t) * T * K);
            host_copy(gw, dwt, sizeof(float) * T * K);
            host_copy(&count, dsync, sizeof(int));
            CHECK(count == call + 1, "case %zu T=%lld call %d: the call count is %d", ci,
                  (long long)T, call, count);
            if (call == 0) {
                memcpy(first, xn, sizeof(float) * T * D);
                memcpy(first + T * D, lg, sizeof(float) * T * E);
                memcpy(first + T * (D + E), gw, sizeof(float) * T * K);
                memcpy(first_i, gi, sizeof(int32_t) * T * K);
                continue;
            }
            CHECK(memcmp(first, xn, sizeof(float) * T * D) == 0 &&
                      memcmp(first + T * D, lg, sizeof(float) * T * E) == 0 &&
                      memcmp(first + T * (D + E), gw, sizeof(float) * T * K) == 0 &&
                      memcmp(first_i, gi, sizeof(int32_t) * T * K) == 0,
                  "case %zu T=%lld: call %d%s differs from the first", ci, (long long)T, call,
                  call >= 3 ? " (graph replay)" : "");
        }
        double e_xn = 0, e_lg = 0, e_w = 0;
        int n_idx_diff = 0;
        for (int64_t t = 0; t < T; t++) {
            const float *xt = x + t * D;
            double ss = 0;
            for (int64_t i = 0; i < D; i++)
                ss += (double)xt[i] * xt[i];
            const double inv = 1.0 / sqrt(ss / (double)D + eps);
            for (int64_t i = 0; i < D; i++) {
                const double r = (double)nw[i] * xt[i] * inv;
                e_xn = fmax(e_xn, fabs(xn[t * D + i] - r) / (fabs(r) + 1e-30));
            }
            for (int64_t e = 0; e < E; e++) {
                double r = 0, S = 0;
                for (int64_t i = 0; i < D; i++) {
                    const double v = (double)nw[i] * xt[i] * inv;
                    r += (double)w[e * D + i] * v;
                    S += fabs((double)w[e * D + i] * v);
                }
                e_lg = fmax(e_lg, fabs(lg[t * E + e] - r) / S);
            }
            route_ref(lg + t * E, bias, E, cases[ci].G, cases[ci].tg, K, cases[ci].renorm,
                      cases[ci].scale, ri, rw);
            for (int64_t k = 0; k < K; k++) {
                n_idx_diff += gi[t * K + k] != ri[k];
                e_w = fmax(e_w, rel_err(gw[t * K + k], rw[k]));
            }
        }
        printf("[cuda_ops] moe_router_route T=%lld E=%lld D=%lld n_group=%lld k=%lld%s%s: xn max "
               "rel err %.2e (tol 1e-6), logits max err/S %.2e (tol 1e-5), %d expert ids differ "
               "from the routing of its logits (must be 0), weights max rel err %.2e (tol "
               "1e-6); 3 calls and 2 graph replays bit-identical, the call count advanced\n",
               (long long)T, (long long)E, (long long)D, (long long)cases[ci].G, (long long)K,
               cases[ci].bias ? "" : " (no bias)", cases[ci].ties ? " (tied pairs)" : "", e_xn,
               e_lg, n_idx_diff, e_w);
        CHECK(e_xn <= 1e-6 && e_lg <= 1e-5 && n_idx_diff == 0 && e_w <= 1e-6,
              "router_route case %zu T=%lld", ci, (long long)T);
        cudaGraphExecDestroy(ge);
        cudaGraphDestroy(g);
        free(first_i);
        free(first);
        free(ri);
        free(gi);
        free(rw);
        free(gw);
        free(lg);
        free(xn);
        cudaFree(dsync);
        cudaFree(dwt);
        cudaFree(di);
        cudaFree(dlg);
        cudaFree(dxn);
        cudaFree(db);
        cudaFree(dwr);
        cudaFree(dnw);
        cudaFree(dx);
        free(bias);
        free(w);
        free(nw);
        free(x);
    }
    /* refused before any device access: D not a multiple of 4, a misaligned x, no sync, a
     * misaligned sync, xn over x, top_k > E */
    {
        float *buf = dev_alloc(sizeof(float) * 4096);
        int32_t *ib = dev_alloc(sizeof(int32_t) * 64);
        int *tk = dev_alloc(sizeof(int) * (size_t)DUET_CUDA_ROUTER_SYNC_INTS(256) + 4);
        const struct {
            const float *x;
            float *xn;
            int64_t T, D, k;
            int *sync;
            const char *what;
        } bad[] = {{buf, buf + 2048, 1, 102, 8, tk, "D = 102"},
                   {buf + 1, buf + 2048, 1, 100, 8, tk, "x not 16-byte aligned"},
                   {buf, buf + 2048, 1, 100, 8, NULL, "no sync"},
                   {buf, buf + 2048, 1, 100, 8, tk + 1, "sync not 8-byte aligned"},
                   {buf, buf + 50, 1, 100, 8, tk, "xn overlaps x"},
                   {buf, buf + 250, 3, 100, 8, tk, "xn overlaps x's third row"},
                   {buf, buf + 2048, 9, 100, 8, tk, "T = 9"},
                   {buf, buf + 2048, 1, 100, 300, tk, "top_k > E"}};
        for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
            duet_status_t rs = duet_cuda_moe_router_route(
                0, bad[i].x, bad[i].T, buf + 1024, 1e-6f, buf, 256, bad[i].D, NULL, 1, 1, bad[i].k,
                1, 1.0f, bad[i].xn, buf + 3000, ib, buf + 3500, bad[i].sync);
            printf("[cuda_ops] moe_router_route refuses %s: %s (%s)\n", bad[i].what,
                   duet_status_name(rs), duet_error_last());
            CHECK(rs == DUET_ERR_INVALID, "%s: %s", bad[i].what, duet_status_name(rs));
            CHECK(strstr(duet_error_last(), "moe_router_route") != NULL,
                  "%s: the error does not name the call: %s", bad[i].what, duet_error_last());
        }
        cudaFree(tk);
        cudaFree(ib);
        cudaFree(buf);
    }
    CUDA_OK(cudaStreamDestroy(st));
}

/* ---- MoE experts ----------------------------------------------------------------------------- */

/*
 * Expert weights. Expert e's matrix m (0 = W1, 1 = W3, 2 = W2) is a window of one random pool,
 * starting (3e + m) · 7919 elements in: every expert differs (a window shifted by a prime is
 * not a row permutation), yet making E = 256 experts of 2304 × 1024 costs one pool of ~8M
 * values rather than 1.8G. The device gets the same matrices stored contiguously
 * ([E][I][D] etc.), as duet_cuda_experts_t wants, by device-to-device copies from the pool.
 * The windows of expert E make the shared expert (dsw), which moe_case folds in on request.
 */
#define POOL_STRIDE 7919

typedef struct {
    duet_dtype_t dt;
    int64_t E, I, D;
    size_t es;
    uint8_t *pool;          /* host */
    uint8_t *apool;         /* host, |pool| (sign bit cleared), for the error bound */
    void *dpool;            /* device */
    void *dw[3];            /* device [E][I][D], [E][I][D], [E][D][I] */
    void *dsw[3];           /* device: the shared expert's [I][D], [I][D], [D][I] */
    duet_cuda_experts_t ex; /* without the shared expert */
} experts_t;

/* Whether moe.cu's automatic choice takes the MMA path for T rows of X at top_k K: BF16 weights,
 * D and I multiples of 32, and duet_cuda_moe_auto_mma's rows per expert. */
static int auto_mma(const experts_t *X, int64_t T, int64_t K)
{
    const duet_cuda_experts_t *e = &X->ex;
    return e->dtype == DUET_DTYPE_BF16 && e->D % 32 == 0 && e->I % 32 == 0 &&
           duet_cuda_moe_auto_mma(T, K, e->E);
}

static size_t pool_off(int64_t e, int m)
{
    return (size_t)(3 * e + m) * POOL_STRIDE;
}

static void experts_make(experts_t *X, duet_dtype_t dt, int64_t E, int64_t I, int64_t D)
{
    memset(X, 0, sizeof(*X));
    X->dt = dt;
    X->E = E;
    X->I = I;
    X->D = D;
    X->es = duet_dtype_size(dt);
    const size_t n = pool_off(E + 1, 0) + (size_t)I * D;
    X->pool = xmalloc(n * X->es);
    X->apool = xmalloc(n * X->es);
    const float s = 2.0f / sqrtf((float)(D > I ? D : I));
    for (size_t i = 0; i < n; i++) {
        const float v = rng_f() * s;
        if (dt == DUET_DTYPE_F32) {
            ((float *)X->pool)[i] = v;
            ((float *)X->apool)[i] = fabsf(v);
        } else {
            const uint16_t h = to_dtype16(v, dt);
            ((uint16_t *)X->pool)[i] = h;
            ((uint16_t *)X->apool)[i] = h & 0x7fff;
        }
    }
    X->dpool = dev_copy(X->pool, n * X->es);
    const size_t mat = (size_t)I * D * X->es;
    for (int m = 0; m < 3; m++) {
        X->dw[m] = dev_alloc(mat * E);
        for (int64_t e = 0; e < E; e++)
            CUDA_OK(cudaMemcpy((uint8_t *)X->dw[m] + mat * e,
                               (uint8_t *)X->dpool + pool_off(e, m) * X->es, mat,
                               cudaMemcpyDeviceToDevice));
        X->dsw[m] = dev_alloc(mat);
        CUDA_OK(cudaMemcpy(X->dsw[m], (uint8_t *)X->dpool + pool_off(E, m) * X->es, mat,
                           cudaMemcpyDeviceToDevice));
    }
    X->ex = (duet_cuda_experts_t){
        .w1 = X->dw[0], .w3 = X->dw[1], .w2 = X->dw[2], .dtype = dt, .E = E, .I = I, .D = D};
}

static void experts_free(experts_t *X)
{
    for (int m = 0; m < 3; m++) {
        cudaFree(X->dw[m]);
        cudaFree(X->dsw[m]);
    }
    cudaFree(X->dpool);
    free(X->apool);
    free(X->pool);
}

/* Host view of expert e's matrix m (abs: |W|); e = E is the shared expert. */
static duet_tensor_t expert_w(const experts_t *X, int64_t e, int m, int abs)
{
    duet_tensor_t t = {.data = (abs ? X->apool : X->pool) + pool_off(e, m) * X->es,
                       .dtype = X->dt,
                       .device = DUET_DEVICE_CPU,
                       .ndim = 2,
                       .shape = {m == 2 ? X->D : X->I, m == 2 ? X->I : X->D}};
    return t;
}

/* Random routing: top_k distinct experts per row, positive weights. */
static void make_routing(int64_t T, int64_t E, int64_t K, int32_t *idx, float *wts)
{
    for (int64_t t = 0; t < T; t++)
        for (int64_t k = 0; k < K; k++) {
            int32_t e;
            int dup;
            do {
                e = (int32_t)(rng_u32() % E);
                dup = 0;
                for (int64_t j = 0; j < k; j++)
                    dup |= idx[t * K + j] == e;
            } while (dup);
            idx[t * K + k] = e;
            wts[t * K + k] = 0.05f + 0.5f * (rng_f() + 1.0f);
        }
}

typedef struct {
    duet_cuda_act_t act;
    float beta, beta_lin;
} act_cfg_t;

static float act_scalar(const act_cfg_t *a, float g)
{
    const float sig = 1.0f / (1.0f + expf(-g));
    return a->act == DUET_CUDA_ACT_SILU ? g * sig : a->beta * tanhf(g / a->beta) * sig;
}

/*
 * The reference: engine/backend_cpu.c duet__moe_layer's algorithm on the CPU backend (rows grouped
 * by expert, duet_k_matmul, the CPU activation, y += w · out), starting from y0.
 *
 * With it, a bound scale per output: S[t][d] = Σ_k |w_k| Σ_i |W2[d][i]| B_i with
 *   B_i = |h_i| + L · |u_i| · Sg_i + |act(g_i)| · Su_i,   Sg = |W1| |x|, Su = |W3| |x|,
 * L = max |act'| (SiLU 1.1, SiTU 1 + β/4). A relative perturbation of at most ε of every x_j
 * (in g and u) and of every h_i moves the output by at most ε · S to first order, so
 * |gpu - cpu| / S measures the error in units of such roundings, whatever cancellation.
 * With `shared`, the shared expert (expert E's windows) comes last for every row, weight 1, as
 * duet__moe_layer adds it after the routed experts.
 */
static void moe_ref(duet_kernels_t *cpu, const experts_t *X, const float *x, int64_t T,
                    const int32_t *idx, const float *wts, int64_t K, const act_cfg_t *a, float *y,
                    double *S, int shared)
{
    const int64_t E = X->E, I = X->I, D = X->D;
    const double L = a->act == DUET_CUDA_ACT_SILU ? 1.1 : 1.0 + a->beta / 4.0;
    int32_t *rows = xmalloc(sizeof(int32_t) * T * K);
    float *wr = xmalloc(sizeof(float) * T * K);
    float *xg = xmalloc(sizeof(float) * T * K * D), *xa = xmalloc(sizeof(float) * T * K * D);
    float *f1 = xmalloc(sizeof(float) * T * K * I), *f2 = xmalloc(sizeof(float) * T * K * I);
    float *sg = xmalloc(sizeof(float) * T * K * I), *su = xmalloc(sizeof(float) * T * K * I);
    float *bnd = xmalloc(sizeof(float) * T * K * I);
    float *eo = xmalloc(sizeof(float) * T * K * D), *eb = xmalloc(sizeof(float) * T * K * D);
    for (int64_t i = 0; i < T * D; i++)
        S[i] = 0.0;
    for (int64_t e = 0; e < E + (shared ? 1 : 0); e++) {
        int64_t M = 0;
        for (int64_t p = 0; p < T * K && e < E; p++)
            if (idx[p] == e) {
                rows[M] = (int32_t)(p / K);
                wr[M] = wts[p];
                M++;
            }
        for (int64_t t = 0; t < T && e == E; t++) { /* the shared expert */
            rows[M] = (int32_t)t;
            wr[M] = 1.0f;
            M++;
        }
        if (M == 0)
            continue;
        for (int64_t r = 0; r < M; r++)
            for (int64_t d = 0; d < D; d++) {
                xg[r * D + d] = x[(int64_t)rows[r] * D + d];
                xa[r * D + d] = fabsf(xg[r * D + d]);
            }
        duet_tensor_t w1 = expert_w(X, e, 0, 0), w3 = expert_w(X, e, 1, 0),
                      w2 = expert_w(X, e, 2, 0);
        duet_tensor_t a1 = expert_w(X, e, 0, 1), a3 = expert_w(X, e, 1, 1),
                      a2 = expert_w(X, e, 2, 1);
        DUET_OK_OR_FAIL(duet_k_matmul(cpu, f1, I, xg, D, M, &w1, 0));
        DUET_OK_OR_FAIL(duet_k_matmul(cpu, f2, I, xg, D, M, &w3, 0));
        DUET_OK_OR_FAIL(duet_k_matmul(cpu, sg, I, xa, D, M, &a1, 0));
        DUET_OK_OR_FAIL(duet_k_matmul(cpu, su, I, xa, D, M, &a3, 0));
        for (int64_t i = 0; i < M * I; i++) /* the bound needs g and u before act_mul */
            bnd[i] = (float)(L * fabs((double)f2[i]) * sg[i] +
                             fabs((double)act_scalar(a, f1[i])) * su[i]);
        if (a->act == DUET_CUDA_ACT_SILU)
            duet_k_silu_mul(cpu, f1, f1, f2, M * I);
        else
            duet_k_situ_mul(cpu, f1, f1, f2, M * I, a->beta, a->beta_lin);
        for (int64_t i = 0; i < M * I; i++)
            bnd[i] += fabsf(f1[i]);
        DUET_OK_OR_FAIL(duet_k_matmul(cpu, eo, D, f1, I, M, &w2, 0));
        DUET_OK_OR_FAIL(duet_k_matmul(cpu, eb, D, bnd, I, M, &a2, 0));
        for (int64_t r = 0; r < M; r++) {
            float *yr = y + (int64_t)rows[r] * D;
            double *Sr = S + (int64_t)rows[r] * D;
            for (int64_t d = 0; d < D; d++) {
                yr[d] += wr[r] * eo[r * D + d];
                Sr[d] += fabs((double)wr[r]) * eb[r * D + d];
            }
        }
    }
    free(eb);
    free(eo);
    free(bnd);
    free(su);
    free(sg);
    free(f2);
    free(f1);
    free(xa);
    free(xg);
    free(wr);
    free(rows);
}

/*
 * Tolerances, in units of S above:
 *   GEMV path (x and h in fp32, weights widened exactly): the two sides differ only in the
 *     order of fp32 accumulation, a few ulps times sqrt(K) in practice: 2e-5 (as the cuBLASLt
 *     GEMM test for fp32).
 *   MMA path: x and h are rounded to bf16 (unit roundoff 2^-8) on the GPU, so the first-order
 *     bound is 2^-8; plus 2e-5 for accumulation order.
 * The y0 term (y is accumulated into) is exact up to the final fp32 rounding: |y| · 1e-6.
 */
#define MOE_TOL_GEMV 2e-5
#define MOE_TOL_MMA  (1.0 / 256 + 2e-5)

/*
 * S is a worst case (no cancellation anywhere), 100-1000 times the typical size of the update
 * at these dims, so a second, typical-case check: the RMS of the error over the RMS of the
 * update y - y0 must stay below 1e-5 on the GEMV path (fp32 rounding) and 1e-2 on the MMA path
 * (bf16 rounding of x and h, 2^-9 relative on average per operand). A wrong expert, row or k
 * gives ~1.
 */
#define MOE_RMS_GEMV 1e-5
#define MOE_RMS_MMA  1e-2

static const char *path_name(int path)
{
    static char buf[64];
    const int p = path & 0xf;
    snprintf(buf, sizeof(buf), "%s%s%s%s%s%s%s%s%s",
             p == PATH_GEMV  ? "gemv"
             : p == PATH_MMA ? "mma"
                             : "auto",
             path & PATH_SYNC ? "-sync" : "", path & PATH_WG ? "-wgmma" : "",
             path & PATH_NO_WS ? "-nows" : "", path & PATH_NO_PDL ? "-nopdl" : "",
             path & PATH_SEPARATE ? "-sepcomb" : "", path & PATH_DEEP ? "-deep" : "",
             path & PATH_EARLY ? "-early" : "", path & PATH_XB ? "-xb" : "");
    return buf;
}

/* Which kernels a path runs, for the bit-for-bit comparisons: 0 GEMV, 1 mma.sync, 2 wgmma. */
static int path_family(int path, int auto_is_mma, const experts_t *X)
{
    const int p = path & 0xf;
    if (!(p == PATH_MMA || (p == PATH_AUTO && auto_is_mma)))
        return 0;
    if (path & (PATH_SYNC | PATH_WG))
        return path & PATH_WG ? 2 : 1;
    return duet__cuda_moe_wgmma_default(X->D, X->I) ? 2 : 1;
}

/*
 * Runs one configuration on the given paths; returns the max error over them. With n_bad > 0,
 * that many pairs get an invalid expert id (-1 or E), which must add nothing (the reference
 * skips them). Every GEMV-path variant (PDL off, a separate combine kernel instead of gemv2's
 * tickets up to T = 2, the uncapped T = 1 kernels, the automatic choice where it is GEMV) must give
 * bit-identical y: each pair's dot products have one operation order, and y gets Σ_k in k order
 * with the combine kernel's arithmetic. The same holds among the MMA-path variants of one
 * kind (mma.sync, wgmma); the two kinds may round their sums differently (both against the
 * reference, and the count of outputs where they differ is printed). With
 * `shared` the call also folds in the shared expert (T = 1, GEMV paths only); with shared == 2
 * x is the row duet_cuda_moe_router_route stores, xn = RMSNorm(nx) ⊙ nw of a random nx and nw
 * (through a small random router), and PATH_EARLY paths pass nx and nw as well: the shared
 * expert's blocks then form xn themselves, which must give the same bits.
 */
static double moe_case(duet_kernels_t *cpu, const experts_t *X, int64_t T, int64_t K,
                       const act_cfg_t *a, const int *paths, int n_paths, int auto_is_mma,
                       int n_bad, int shared)
{
    const int64_t E = X->E, D = X->D, I = X->I;
    float *x = xmalloc(sizeof(float) * T * D), *y0 = xmalloc(sizeof(float) * T * D);
    float *yr = xmalloc(sizeof(float) * T * D), *yg = xmalloc(sizeof(float) * T * D);
    double *S = xmalloc(sizeof(double) * T * D);
    int32_t *idx = xmalloc(sizeof(int32_t) * T * K);
    float *wts = xmalloc(sizeof(float) * T * K);
    for (int64_t i = 0; i < T * D; i++) {
        x[i] = rng_n();
        y0[i] = rng_f();
    }
    float *dnx = NULL, *dnw = NULL;
    const float eps = 1e-6f;
    if (shared == 2) { /* x = the router kernel's xn of a random row (T = 1) */
        const int64_t Er = 8, Kr = 2;
        float *nw = xmalloc(sizeof(float) * D), *wr = xmalloc(sizeof(float) * Er * D);
        for (int64_t i = 0; i < D; i++) {
            x[i] *= 3.0f;
            nw[i] = 1.0f + 0.3f * rng_f();
        }
        for (int64_t i = 0; i < Er * D; i++)
            wr[i] = rng_f() / sqrtf((float)D);
        dnx = dev_copy(x, sizeof(float) * D);
        dnw = dev_copy(nw, sizeof(float) * D);
        float *dwr = dev_copy(wr, sizeof(float) * Er * D), *dxn = dev_alloc(sizeof(float) * D);
        float *dlg = dev_alloc(sizeof(float) * Er), *dw2 = dev_alloc(sizeof(float) * Kr);
        int32_t *di2 = dev_alloc(sizeof(int32_t) * Kr);
        const size_t sync_bytes = sizeof(int) * (size_t)DUET_CUDA_ROUTER_SYNC_INTS(Er);
        int *dsync = dev_alloc(sync_bytes);
        CUDA_OK(cudaMemset(dsync, 0, sync_bytes));
        DUET_OK_OR_FAIL(duet_cuda_moe_router_route(0, dnx, 1, dnw, eps, dwr, Er, D, NULL, 1, 1, Kr,
                                                   1, 1.0f, dxn, dlg, di2, dw2, dsync));
        host_copy(x, dxn, sizeof(float) * D);
        cudaFree(dsync);
        cudaFree(di2);
        cudaFree(dw2);
        cudaFree(dlg);
        cudaFree(dxn);
        cudaFree(dwr);
        free(wr);
        free(nw);
    }
    make_routing(T, E, K, idx, wts);
    for (int j = 0; j < n_bad; j++)
        idx[(rng_u32() % T) * K + rng_u32() % K] = (j & 1) ? (int32_t)E : -1;
    memcpy(yr, y0, sizeof(float) * T * D);
    moe_ref(cpu, X, x, T, idx, wts, K, a, yr, S, shared);
    duet_cuda_experts_t ex = X->ex;
    if (shared) {
        ex.sw1 = X->dsw[0];
        ex.sw3 = X->dsw[1];
        ex.sw2 = X->dsw[2];
    }

    float *dx = dev_copy(x, sizeof(float) * T * D), *dy = dev_alloc(sizeof(float) * T * D);
    int32_t *di = dev_copy(idx, sizeof(int32_t) * T * K);
    float *dwt = dev_copy(wts, sizeof(float) * T * K);
    const size_t sb = duet_cuda_moe_scratch_bytes(T, K, E, I, D);
    void *scratch = dev_alloc(sb);
    float *yfirst[3] = {xmalloc(sizeof(float) * T * D), xmalloc(sizeof(float) * T * D),
                        xmalloc(sizeof(float) * T * D)};
    int first_path[3] = {-1, -1, -1}; /* the path yfirst[fam] holds, per family */
    void *dxs = NULL;                 /* PATH_XB's planes */
    double worst = 0;
    for (int pi = 0; pi < n_paths; pi++) {
        const int path = paths[pi];
        const int fam = path_family(path, auto_is_mma, X), mma = fam != 0;
        const double tol = mma ? MOE_TOL_MMA : MOE_TOL_GEMV;
        CUDA_OK(cudaMemcpy(dy, y0, sizeof(float) * T * D, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemset(scratch, 0xff, sb)); /* no reliance on zeroed scratch */
        duet_cuda_experts_t exp = ex;
        if (path & PATH_EARLY) {
            CHECK(dnx != NULL, "PATH_EARLY needs shared == 2");
            exp.norm_x = dnx;
            exp.norm_w = dnw;
            exp.norm_eps = eps;
        }
        if (path & PATH_XB) {
            if (dxs == NULL)
                dxs = dev_alloc(3 * sizeof(uint16_t) * (size_t)(T * D));
            DUET_OK_OR_FAIL(duet_cuda_gemm_split_x(dxs, dx, D, T, D, 0));
            exp.xb = dxs;
        }
        DUET_OK_OR_FAIL(
            moe_call(0, &exp, dx, T, di, dwt, K, a->act, a->beta, a->beta_lin, dy, scratch, path));
        host_copy(yg, dy, sizeof(float) * T * D);
        if (first_path[fam] < 0) {
            memcpy(yfirst[fam], yg, sizeof(float) * T * D);
            first_path[fam] = path;
            const int other = fam == 2 ? 1 : fam == 1 ? 2 : 0;
            if (other != 0 && first_path[other] >= 0) {
                int64_t n_diff = 0;
                for (int64_t i = 0; i < T * D; i++)
                    n_diff += memcmp(&yg[i], &yfirst[other][i], sizeof(float)) != 0;
                printf("[cuda_ops] moe_experts %-4s T=%-4lld wgmma vs mma.sync: %lld of %lld "
                       "outputs differ (allowed: summation order)\n",
                       duet_dtype_name(X->dt), (long long)T, (long long)n_diff, (long long)(T * D));
            }
        } else {
            int64_t n_diff = 0;
            for (int64_t i = 0; i < T * D; i++)
                n_diff += memcmp(&yg[i], &yfirst[fam][i], sizeof(float)) != 0;
            char first[64];
            snprintf(first, sizeof(first), "%s", path_name(first_path[fam]));
            printf("[cuda_ops] moe_experts %-4s T=%-4lld %s vs %s: %lld of %lld outputs differ "
                   "(must be 0)\n",
                   duet_dtype_name(X->dt), (long long)T, path_name(path), first, (long long)n_diff,
                   (long long)(T * D));
            CHECK(n_diff == 0, "moe T=%lld: %s is not bit-identical to %s", (long long)T,
                  path_name(path), first);
        }
        const double rms_tol = mma ? MOE_RMS_MMA : MOE_RMS_GEMV;
        double e = 0, se = 0, su = 0;
        int64_t at = 0;
        for (int64_t i = 0; i < T * D; i++) {
            const double d = fabs((double)yg[i] - yr[i]);
            const double n = S[i] + 1e-6 * fabs((double)yr[i]) + 1e-30;
            CHECK(isfinite(yg[i]), "non-finite output at %lld", (long long)i);
            if (d / n > e) {
                e = d / n;
                at = i;
            }
            se += d * d;
            su += ((double)yr[i] - y0[i]) * ((double)yr[i] - y0[i]);
        }
        const double rms = sqrt(se / (su + 1e-300));
        printf("[cuda_ops] moe_experts %-4s %-4s %s E=%lld k=%lld D=%lld I=%lld T=%-4lld: max "
               "err/S %.2e (tol %.1e), rms err/rms update %.2e (tol %.0e)%s%s\n",
               duet_dtype_name(X->dt), path_name(path),
               a->act == DUET_CUDA_ACT_SILU ? "SiLU" : "SiTU", (long long)E, (long long)K,
               (long long)D, (long long)I, (long long)T, e, tol, rms, rms_tol,
               n_bad > 0 ? " (invalid ids)" : "", shared ? " (shared expert folded in)" : "");
        fflush(stdout);
        CHECK(e <= tol, "moe %s %s T=%lld: y[%lld] gpu %.9g cpu %.9g S %.3g",
              duet_dtype_name(X->dt), path_name(path), (long long)T, (long long)at, yg[at], yr[at],
              S[at]);
        CHECK(rms <= rms_tol, "moe %s %s T=%lld: rms error %.3g", duet_dtype_name(X->dt),
              path_name(path), (long long)T, rms);
        worst = fmax(worst, e);
    }
    free(yfirst[2]);
    free(yfirst[1]);
    free(yfirst[0]);
    cudaFree(dxs);
    cudaFree(dnw);
    cudaFree(dnx);
    cudaFree(scratch);
    cudaFree(dwt);
    cudaFree(di);
    cudaFree(dy);
    cudaFree(dx);
    free(wts);
    free(idx);
    free(S);
    free(yg);
    free(yr);
    free(y0);
    free(x);
    return worst;
}

/* Small dims, T in {1, 2, 5, 64, 300}, BF16 on both paths (and the GEMV path's variants, which
 * must agree bit for bit, among them 1 and 4 slices per block), F32 and F16 on the GEMV path;
 * some invalid expert ids. */
Test(cuda_ops, moe_experts_small, .timeout = 300)
{
    skip_without_device();
    duet_kernels_t *cpu = cpu_create();
    const int64_t E = 8, K = 2, D = 128, I = 96;
    const int64_t Ts[] = {1, 2, 5, 64, 300};
    const act_cfg_t silu = {DUET_CUDA_ACT_SILU, 0, 0}, situ = {DUET_CUDA_ACT_SITU, 2.0f, 6.0f};
    const duet_dtype_t dts[] = {DUET_DTYPE_BF16, DUET_DTYPE_F32, DUET_DTYPE_F16};
    for (size_t di = 0; di < 3; di++) {
        experts_t X;
        experts_make(&X, dts[di], E, I, D);
        for (size_t ti = 0; ti < sizeof(Ts) / sizeof(Ts[0]); ti++) {
            const int64_t T = Ts[ti];
            const int am = auto_mma(&X, T, K);
            static const int bf16_paths[] = {PATH_AUTO,
                                             PATH_GEMV,
                                             PATH_MMA,
                                             PATH_GEMV | PATH_NO_PDL,
                                             PATH_GEMV | PATH_SEPARATE,
                                             PATH_GEMV | PATH_SEPARATE | PATH_NO_PDL,
                                             PATH_MMA | PATH_NO_PDL,
                                             PATH_GEMV | PATH_DEEP,
                                             GEMV_SPB(1),
                                             GEMV_SPB(4) | PATH_NO_PDL};
            static const int other_paths[] = {PATH_AUTO, PATH_GEMV | PATH_SEPARATE};
            if (dts[di] == DUET_DTYPE_BF16)
                moe_case(cpu, &X, T, K, &silu, bf16_paths, 10, am, 0, 0);
            else
                moe_case(cpu, &X, T, K, &silu, other_paths, 2, am, 0, 0);
            if (dts[di] == DUET_DTYPE_BF16 && T == 64)
                moe_case(cpu, &X, T, K, &situ, bf16_paths, 10, am, 0, 0);
            /* invalid expert ids: skipped by the plan, the tickets and the combine */
            if (dts[di] == DUET_DTYPE_BF16 && T <= 64)
                moe_case(cpu, &X, T, K, &silu, bf16_paths, 10, am, T == 1 ? 1 : 3, 0);
            /* the shared expert folded in (T = 1): tickets, the combine kernel, PDL off; with
             * an invalid expert id too, whose block must still count its ticket */
            if (T == 1) {
                static const int fold_paths[] = {PATH_AUTO, PATH_GEMV | PATH_SEPARATE,
                                                 PATH_GEMV | PATH_NO_PDL, PATH_GEMV | PATH_DEEP};
                moe_case(cpu, &X, T, K, &silu, fold_paths, 4, 0, 0, 1);
                moe_case(cpu, &X, T, K, &situ, fold_paths, 4, 0, 1, 1);
                /* ... and its gate/up ahead of the routing, forming xn itself */
                static const int early_paths[] = {
                    PATH_AUTO, PATH_AUTO | PATH_EARLY, PATH_GEMV | PATH_SEPARATE | PATH_EARLY,
                    PATH_GEMV | PATH_NO_PDL | PATH_EARLY, PATH_GEMV | PATH_DEEP | PATH_EARLY};
                moe_case(cpu, &X, T, K, &silu, early_paths, 5, 0, 0, 2);
                moe_case(cpu, &X, T, K, &situ, early_paths, 5, 0, 1, 2);
            }
            /* at T > 1 the plan lists its rows as one more expert (the GEMV path forced: at
             * these dims the automatic choice for 5 rows or more is MMA, which refuses it),
             * with 1 and 4 slices per block, PDL off, invalid expert ids */
            if (T > 1) {
                static const int fold_n[] = {PATH_GEMV, PATH_GEMV | PATH_NO_PDL, GEMV_SPB(4),
                                             GEMV_SPB(1) | PATH_NO_PDL};
                moe_case(cpu, &X, T, K, &silu, fold_n, 4, 0, 0, 1);
                if (dts[di] == DUET_DTYPE_BF16)
                    moe_case(cpu, &X, T, K, &situ, fold_n, 4, 0, 3, 1);
            }
        }
        experts_free(&X);
    }
    /* D and I multiples of 64: the 64-row MMA tiles take k-steps of 64 in both phases (above,
     * I = 96 keeps the down phase at 32), the 128-row tiles 32; both tile heights forced, with
     * mma.sync and, where the device runs them, wgmma (which needs these multiples of 64): its
     * 128-row tiles on both kernels, the warp-specialised one with a down phase (K = 128) of
     * fewer k-steps than its copiers keep in flight and D = 192 filling 3/4 of its 256 weight
     * rows. T = 1000 gives each expert about 250 rows: two 128-row tiles, the second partial;
     * T = 2500 about 625 rows: five, each block of the warp-specialised kernel taking several. */
    {
        static const int tiles[] = {PATH_AUTO,
                                    PATH_GEMV,
                                    MMA_BM(64) | PATH_SYNC,
                                    MMA_BM(128) | PATH_SYNC,
                                    MMA_BM(64) | PATH_SYNC | PATH_NO_PDL,
                                    MMA_BM(64),
                                    MMA_BM(128),
                                    MMA_BM(64) | PATH_WG,
                                    MMA_BM(128) | PATH_WG | PATH_NO_PDL,
                                    MMA_BM(128) | PATH_WG | PATH_NO_WS};
        const int n_tiles = duet__cuda_moe_wgmma_default(192, 128) ? 10 : 7;
        experts_t X;
        experts_make(&X, DUET_DTYPE_BF16, E, 128, 192);
        moe_case(cpu, &X, 64, K, &silu, tiles, n_tiles, auto_mma(&X, 64, K), 0, 0);
        moe_case(cpu, &X, 300, K, &silu, tiles, n_tiles, auto_mma(&X, 300, K), 3, 0);
        moe_case(cpu, &X, 300, K, &situ, tiles, n_tiles, auto_mma(&X, 300, K), 0, 0);
        moe_case(cpu, &X, 1000, K, &silu, tiles, n_tiles, auto_mma(&X, 1000, K), 3, 0);
        moe_case(cpu, &X, 2500, K, &silu, tiles, n_tiles, auto_mma(&X, 2500, K), 3, 0);
        experts_free(&X);
    }
    /* slices that do not fill the last block at 4 per block: I = 40 (5 gate/up slices of 8
     * rows), D = 72 (3 down slices of 32), every weight dtype; not on the MMA path (32 divides
     * neither) */
    for (size_t di = 0; di < 3; di++) {
        static const int spb[] = {GEMV_SPB(1), GEMV_SPB(4), GEMV_SPB(4) | PATH_NO_PDL};
        experts_t X;
        experts_make(&X, dts[di], E, 40, 72);
        moe_case(cpu, &X, 64, K, &silu, spb, 3, 0, 0, 0);
        moe_case(cpu, &X, 300, K, &silu, spb, 3, 0, 3, 0);
        experts_free(&X);
    }
    /* top_k 10 (more pairs than gemv2 has warps; at T = 1 one of them invalid) */
    {
        static const int decode[] = {PATH_AUTO, PATH_GEMV | PATH_SEPARATE};
        experts_t X;
        experts_make(&X, DUET_DTYPE_BF16, 16, I, D);
        moe_case(cpu, &X, 1, 10, &silu, decode, 2, 0, 1, 0);
        moe_case(cpu, &X, 3, 10, &silu, decode, 2, auto_mma(&X, 3, 10), 0, 0);
        experts_free(&X);
    }
    /* the shared expert with the plan in two blocks (3000 pairs with its rows) */
    {
        static const int fold_n[] = {PATH_GEMV, GEMV_SPB(4) | PATH_NO_PDL};
        experts_t X;
        experts_make(&X, DUET_DTYPE_BF16, E, I, D);
        moe_case(cpu, &X, 1000, K, &silu, fold_n, 2, 0, 3, 1);
        experts_free(&X);
    }
    /* a shared expert is refused where it cannot be folded in: the MMA path (forced, or the
     * automatic choice at T = 64 here), or one of its matrices missing */
    {
        experts_t X;
        experts_make(&X, DUET_DTYPE_BF16, 4, 32, 32);
        float *buf = X.dw[0];
        duet_cuda_experts_t ex = X.ex;
        ex.sw1 = X.dsw[0];
        ex.sw3 = X.dsw[1];
        ex.sw2 = X.dsw[2];
        CHECK(duet_cuda_moe_gemv_path(&ex, 1, 1) && duet_cuda_moe_gemv_path(&ex, 2, 1) &&
                  !duet_cuda_moe_gemv_path(&ex, 64, 1),
              "GEMV path at T = 1 and 2, MMA at 64 (E = 4, top 1)");
        const struct {
            int64_t T;
            int path, drop;
        } bad[] = {{64, PATH_AUTO, 0},
                   {2, PATH_MMA, 0},
                   {1, PATH_AUTO, 1},
                   {1, PATH_AUTO, 2},
                   {1, PATH_AUTO, 3}};
        for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
            duet_cuda_experts_t e2 = ex;
            if (bad[i].drop == 1)
                e2.sw3 = NULL;
            if (bad[i].drop == 2) /* the norm's row without its weight */
                e2.norm_x = buf;
            if (bad[i].drop == 3) { /* misaligned */
                e2.norm_x = buf + 1;
                e2.norm_w = buf;
            }
            duet_status_t st =
                duet__cuda_moe_experts_path(0, &e2, buf, bad[i].T, (int32_t *)buf, buf, 1,
                                            DUET_CUDA_ACT_SILU, 0, 0, buf, buf, bad[i].path);
            printf("[cuda_ops] moe_experts shared expert, T=%lld path %d%s: %s (%s)\n",
                   (long long)bad[i].T, bad[i].path,
                   bad[i].drop == 1   ? ", up_proj missing"
                   : bad[i].drop == 2 ? ", norm_x without norm_w"
                   : bad[i].drop == 3 ? ", norm_x misaligned"
                                      : "",
                   duet_status_name(st), duet_error_last());
            CHECK(st == DUET_ERR_INVALID, "%s", duet_status_name(st));
        }
        experts_free(&X);
    }
    /* the MMA path refuses weights it has no kernel for */
    {
        experts_t X;
        experts_make(&X, DUET_DTYPE_F32, 2, 32, 32);
        /* any device buffers will do: the call must refuse before touching them */
        float *buf = X.dw[0];
        duet_status_t st = duet__cuda_moe_experts_path(
            0, &X.ex, buf, 1, (int32_t *)buf, buf, 1, DUET_CUDA_ACT_SILU, 0, 0, buf, buf, PATH_MMA);
        CHECK(st == DUET_ERR_UNSUPPORTED, "%s", duet_status_name(st));
        experts_free(&X);
    }
    /* ... and the wgmma kernels where they cannot run: I = 96 is no multiple of 64 (and on a
     * device without sm_90a code, any shape) */
    {
        experts_t X;
        experts_make(&X, DUET_DTYPE_BF16, 2, 96, 128);
        float *buf = X.dw[0];
        duet_status_t st =
            duet__cuda_moe_experts_path(0, &X.ex, buf, 1, (int32_t *)buf, buf, 1,
                                        DUET_CUDA_ACT_SILU, 0, 0, buf, buf, PATH_MMA | PATH_WG);
        printf("[cuda_ops] moe_experts wgmma forced at I=96: %s (%s)\n", duet_status_name(st),
               duet_error_last());
        CHECK(st == DUET_ERR_UNSUPPORTED, "%s", duet_status_name(st));
        experts_free(&X);
    }
    duet_kernels_destroy(cpu);
}

/* The real model's dims: D = 2304, I = 1024, E = 256, top 8, BF16; T = 64 on both paths (and
 * without programmatic dependent launch; on the GEMV path, 384 slots, so 4 slices per block,
 * and forced to 1), T = 600 on both paths (the plan in several blocks; x also handed over as
 * bf16, PATH_XB, which the MMA path must read to the same bits), T = 1 and 8 on the
 * automatic (GEMV) path, which must match its variants bit for bit (separate combine kernel, no
 * PDL, at T = 1 the uncapped kernels); the shared expert folded in at T = 2, 5 and 8. */
Test(cuda_ops, moe_experts_real_dims, .timeout = 300)
{
    skip_without_device();
    duet_kernels_t *cpu = cpu_create();
    experts_t X;
    experts_make(&X, DUET_DTYPE_BF16, 256, 1024, 2304);
    const act_cfg_t silu = {DUET_CUDA_ACT_SILU, 0, 0};
    static const int paths[] = {
        PATH_AUTO,   PATH_MMA,   PATH_MMA | PATH_SYNC, PATH_GEMV | PATH_NO_PDL,
        GEMV_SPB(1), GEMV_SPB(4)};
    static const int decode[] = {PATH_AUTO, PATH_GEMV | PATH_SEPARATE, PATH_GEMV | PATH_NO_PDL,
                                 PATH_GEMV | PATH_DEEP};
    moe_case(cpu, &X, 64, 8, &silu, paths, 6, auto_mma(&X, 64, 8), 0, 0);
    /* 4800 pairs: the plan in three blocks after the count kernel (moe.cu, DUET__PLAN_PAIRS),
     * with and without PDL, its tiles on both MMA kernels and its slots on the GEMV path */
    static const int prefill[] = {PATH_AUTO,
                                  PATH_MMA | PATH_SYNC,
                                  MMA_BM(128) | PATH_SYNC,
                                  MMA_BM(128),
                                  MMA_BM(64),
                                  PATH_MMA | PATH_NO_PDL,
                                  PATH_GEMV,
                                  MMA_BM(128) | PATH_NO_WS,
                                  MMA_BM(128) | PATH_XB,
                                  PATH_GEMV | PATH_XB};
    moe_case(cpu, &X, 600, 8, &silu, prefill, 10, auto_mma(&X, 600, 8), 0, 0);
    moe_case(cpu, &X, 1, 8, &silu, decode, 4, 0, 0, 0);
    moe_case(cpu, &X, 1, 8, &silu, decode, 4, 0, 0, 1); /* the decode step's shared expert */
    static const int early[] = {PATH_AUTO, PATH_AUTO | PATH_EARLY,
                                PATH_GEMV | PATH_NO_PDL | PATH_EARLY,
                                PATH_GEMV | PATH_SEPARATE | PATH_EARLY};
    moe_case(cpu, &X, 1, 8, &silu, early, 4, 0, 0, 2); /* ... ahead of the routing */
    moe_case(cpu, &X, 8, 8, &silu, decode, 4, 0, 0, 0);
    /* the shared expert at T > 1 (a k = 4 verify row block, batch 8) on the GEMV path, which
     * the automatic choice takes there (duet_cuda_moe_gemv_path) */
    CHECK(duet_cuda_moe_gemv_path(&X.ex, 5, 8) && duet_cuda_moe_gemv_path(&X.ex, 8, 8),
          "the GEMV kernels take 5 and 8 rows at the real dims");
    static const int verify[] = {PATH_AUTO, PATH_GEMV | PATH_NO_PDL, GEMV_SPB(4)};
    moe_case(cpu, &X, 5, 8, &silu, verify, 3, 0, 0, 1);
    /* a k = 1 verify: 2 rows, gemv2's tickets against the combine kernel */
    static const int verify2[] = {PATH_AUTO, PATH_GEMV | PATH_SEPARATE, GEMV_SPB(4)};
    moe_case(cpu, &X, 2, 8, &silu, verify2, 3, 0, 0, 1);
    moe_case(cpu, &X, 8, 8, &silu, verify, 3, 0, 0, 1);
    experts_free(&X);
    duet_kernels_destroy(cpu);
}

/* ---- argmax and sampling --------------------------------------------------------------------- */

/* Quantised logits tie often: the first index must win, as on the CPU. */
Test(cuda_ops, argmax, .timeout = 60)
{
    skip_without_device();
    const int64_t M = 16, V = 50000, ld = 50007;
    float *lg = xmalloc(sizeof(float) * M * ld);
    for (int64_t i = 0; i < M * ld; i++)
        lg[i] = (float)(int)(rng_n() * 4.0f);
    for (int64_t i = 0; i < V; i++) /* row 0: all equal */
        lg[i] = -1.0f;
    lg[ld + V - 1] = 1e9f; /* row 1: the last element */
    float *dl = dev_copy(lg, sizeof(float) * M * ld);
    int32_t *dout = dev_alloc(sizeof(int32_t) * M), got[16];
    DUET_OK_OR_FAIL(duet_cuda_argmax(0, dl, ld, V, M, dout));
    host_copy(got, dout, sizeof(got));
    int n_diff = 0;
    for (int64_t m = 0; m < M; m++)
        n_diff += got[m] != duet_argmax(lg + m * ld, V);
    printf("[cuda_ops] argmax M=%lld V=%lld: %d rows differ (must be 0)\n", (long long)M,
           (long long)V, n_diff);
    CHECK(n_diff == 0, "argmax");
    cudaFree(dout);
    cudaFree(dl);
    free(lg);
}

/* qsort order of the CPU sampler: logit descending, index ascending. */
static const float *sort_lg;
static int by_logit_desc(const void *a, const void *b)
{
    const float la = sort_lg[*(const int32_t *)a], lb = sort_lg[*(const int32_t *)b];
    if (la > lb)
        return -1;
    if (la < lb)
        return 1;
    return *(const int32_t *)a - *(const int32_t *)b;
}

/*
 * How close the CPU's decision for this row sits to a boundary: the smallest distance, relative
 * to the mass it is compared with, between top_p and the nucleus's running sum at its cut, and
 * between u · kept and the running sum at the chosen candidate. The CPU sampler's arithmetic,
 * replayed.
 */
static double boundary_margin(const float *lg, int64_t V, const duet_cuda_sample_params_t *p)
{
    int32_t *ix = xmalloc(sizeof(int32_t) * V);
    float *pr = xmalloc(sizeof(float) * V);
    for (int64_t i = 0; i < V; i++)
        ix[i] = (int32_t)i;
    sort_lg = lg;
    qsort(ix, (size_t)V, sizeof(int32_t), by_logit_desc);
    int64_t n = p->top_k > 0 && p->top_k < V ? p->top_k : V;
    const float inv_t = 1.0f / p->temperature, mx = lg[ix[0]];
    double sum = 0, margin = INFINITY;
    for (int64_t i = 0; i < n; i++) {
        pr[i] = expf((lg[ix[i]] - mx) * inv_t);
        sum += pr[i];
    }
    if (p->top_p < 1.0f) {
        double acc = 0, prev = 0;
        int64_t keep = n;
        for (int64_t i = 0; i < n; i++) {
            prev = acc;
            acc += pr[i] / sum;
            if (acc >= (double)p->top_p) {
                keep = i + 1;
                margin = fmin(acc - p->top_p, p->top_p - prev);
                break;
            }
        }
        n = keep;
        sum = 0;
        for (int64_t i = 0; i < n; i++)
            sum += pr[i];
    }
    const double u = (double)p->u * sum;
    double acc = 0, prev = 0;
    for (int64_t i = 0; i < n; i++) {
        prev = acc;
        acc += pr[i];
        if (u < acc) {
            margin = fmin(margin, fmin(acc - u, u - prev) / sum);
            break;
        }
    }
    free(pr);
    free(ix);
    return margin;
}

typedef struct {
    float temperature;
    int32_t top_k;
    float top_p;
} sample_cfg_t;

/* Logits of row m: spread and shape vary by row; every 5th row is quantised (many ties) and
 * every 7th has a third of its entries masked to -inf. */
static void make_logits(float *row, int64_t V, int64_t m)
{
    const float sd = 1.0f + (float)(m % 4);
    for (int64_t v = 0; v < V; v++) {
        float l = rng_n() * sd;
        if (m % 5 == 0)
            l = floorf(l * 2.0f) / 2.0f;
        if (m % 7 == 3 && rng_u32() % 3 == 0)
            l = -INFINITY;
        row[v] = l;
    }
    if (m % 6 == 1) /* a confident row */
        row[rng_u32() % V] += 12.0f;
}

/*
 * One batch of M rows with per-row settings cfg[m % n_cfg] against duet_sampler_sample. A row
 * whose token differs is allowed only when the CPU's decision sits within 1e-7 (relative) of a
 * boundary: the summation order moves the sums by ~1e-16, and a p_i whose expf rounds the other
 * way (glibc's expf is within 0.502 ulp, the GPU's is correctly rounded) by at most 6e-8 of the
 * sum. Those rows are counted and printed, and expected to be ~0.
 */
static void sample_batch(int64_t M, int64_t V, const sample_cfg_t *cfg, int n_cfg, uint64_t seed,
                         int *n_rows_p, int *n_boundary_p)
{
    float *lg = xmalloc(sizeof(float) * M * V);
    duet_cuda_sample_params_t *pa = xmalloc(sizeof(*pa) * M);
    int32_t *ref = xmalloc(sizeof(int32_t) * M), *got = xmalloc(sizeof(int32_t) * M);
    duet_sampler_t *s = NULL;
    DUET_OK_OR_FAIL(duet_sampler_create(V, &s));
    for (int64_t m = 0; m < M; m++) {
        make_logits(lg + m * V, V, m);
        const sample_cfg_t *c = &cfg[m % n_cfg];
        duet_rng_t rng, copy;
        duet_rng_seed(&rng, seed + (uint64_t)m);
        copy = rng;
        pa[m] = (duet_cuda_sample_params_t){.temperature = c->temperature,
                                            .top_k = c->top_k,
                                            .top_p = c->top_p,
                                            .u = duet_rng_uniform(&copy)};
        duet_sampling_t sp = {
            .temperature = c->temperature, .top_k = c->top_k, .top_p = c->top_p, .seed = 0};
        ref[m] = duet_sampler_sample(s, &sp, &rng, lg + m * V);
    }
    float *dl = dev_copy(lg, sizeof(float) * M * V);
    duet_cuda_sample_params_t *dp = dev_copy(pa, sizeof(*pa) * M);
    int32_t *dout = dev_alloc(sizeof(int32_t) * M);
    void *scratch = dev_alloc(duet_cuda_sample_scratch_bytes(M, V));
    DUET_OK_OR_FAIL(duet_cuda_sample(0, dl, V, V, M, dp, dout, scratch));
    host_copy(got, dout, sizeof(int32_t) * M);
    for (int64_t m = 0; m < M; m++) {
        if (got[m] == ref[m])
            continue;
        const double margin = boundary_margin(lg + m * V, V, &pa[m]);
        printf("[cuda_ops] sample row %lld (T=%g k=%d p=%g u=%.8f): gpu %d cpu %d, boundary "
               "margin %.3g\n",
               (long long)m, pa[m].temperature, pa[m].top_k, pa[m].top_p, pa[m].u, got[m], ref[m],
               margin);
        CHECK(margin < 1e-7, "sample row %lld: token %d, cpu %d, not at a boundary", (long long)m,
              got[m], ref[m]);
        (*n_boundary_p)++;
    }
    *n_rows_p += (int)M;
    cudaFree(scratch);
    cudaFree(dout);
    cudaFree(dp);
    cudaFree(dl);
    duet_sampler_destroy(s);
    free(got);
    free(ref);
    free(pa);
    free(lg);
}

Test(cuda_ops, sample, .timeout = 300)
{
    skip_without_device();
    static const sample_cfg_t cfgs[] = {
        {0.0f, 0, 1.0f},  {1.0f, 1, 1.0f},     {0.7f, 0, 1.0f},    {1.0f, 0, 0.9f},
        {1.3f, 50, 1.0f}, {0.8f, 50, 0.95f},   {1.0f, 1000, 0.5f}, {2.0f, 0, 0.99f},
        {0.05f, 0, 0.9f}, {1.0f, 40000, 0.8f}, {0.6f, 7, 0.3f},    {1.0f, 0, 0.999f},
    };
    const int n_cfg = (int)(sizeof(cfgs) / sizeof(cfgs[0]));
    int n_rows = 0, n_boundary = 0;
    /* each setting on its own batch, then all mixed in one batch, then the real vocabulary */
    for (int c = 0; c < n_cfg; c++)
        sample_batch(32, 32000, &cfgs[c], 1, 1000u * (uint64_t)c, &n_rows, &n_boundary);
    sample_batch(64, 32000, cfgs, n_cfg, 77777, &n_rows, &n_boundary);
    sample_batch(64, 163840, cfgs, n_cfg, 88888, &n_rows, &n_boundary);
    printf("[cuda_ops] sample: %d rows, %d differ from the CPU sampler, all at a boundary "
           "(expected ~0)\n",
           n_rows, n_boundary);
    CHECK(n_boundary <= 2, "%d boundary cases", n_boundary);
}

/* ---- graph capture --------------------------------------------------------------------------- */

/* The experts (both paths, with programmatic dependent launch) and the sampler captured into a
 * CUDA graph give bit-identical results to direct calls: nothing in them synchronises,
 * allocates or reads device data on the host. The experts' graph is replayed twice: the second
 * replay finds gemv2's ticket counters as the first left them and must reset them itself. */
Test(cuda_ops, graph_capture, .timeout = 120)
{
    skip_without_device();
    const int64_t E = 8, K = 2, D = 128, I = 96, V = 5000, M = 8;
    experts_t X;
    experts_make(&X, DUET_DTYPE_BF16, E, I, D);
    cudaStream_t st;
    CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    const int64_t Ts[] = {1, 5, 300}; /* GEMV direct, GEMV planned, MMA */
    for (int ti = 0; ti < 3; ti++) {
        const int64_t T = Ts[ti];
        float *x = xmalloc(sizeof(float) * T * D), *y1 = xmalloc(sizeof(float) * T * D);
        float *y2 = xmalloc(sizeof(float) * T * D), *wts = xmalloc(sizeof(float) * T * K);
        int32_t *idx = xmalloc(sizeof(int32_t) * T * K);
        for (int64_t i = 0; i < T * D; i++)
            x[i] = rng_n();
        make_routing(T, E, K, idx, wts);
        float *dx = dev_copy(x, sizeof(float) * T * D), *dy = dev_alloc(sizeof(float) * T * D);
        int32_t *di = dev_copy(idx, sizeof(int32_t) * T * K);
        float *dw = dev_copy(wts, sizeof(float) * T * K);
        void *scratch = dev_alloc(duet_cuda_moe_scratch_bytes(T, K, E, I, D));
        CUDA_OK(cudaMemsetAsync(dy, 0, sizeof(float) * T * D, st));
        DUET_OK_OR_FAIL(duet_cuda_moe_experts(st, &X.ex, dx, T, di, dw, K, DUET_CUDA_ACT_SILU, 0, 0,
                                              dy, scratch));
        CUDA_OK(cudaStreamSynchronize(st));
        host_copy(y1, dy, sizeof(float) * T * D);

        cudaGraph_t g;
        cudaGraphExec_t ge;
        CUDA_OK(cudaMemsetAsync(dy, 0, sizeof(float) * T * D, st));
        CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        DUET_OK_OR_FAIL(duet_cuda_moe_experts(st, &X.ex, dx, T, di, dw, K, DUET_CUDA_ACT_SILU, 0, 0,
                                              dy, scratch));
        CUDA_OK(cudaStreamEndCapture(st, &g));
        CUDA_OK(cudaGraphInstantiate(&ge, g, 0));
        for (int rep = 0; rep < 2; rep++) {
            CUDA_OK(cudaMemsetAsync(dy, 0, sizeof(float) * T * D, st));
            CUDA_OK(cudaGraphLaunch(ge, st));
            CUDA_OK(cudaStreamSynchronize(st));
            host_copy(y2, dy, sizeof(float) * T * D);
            CHECK(memcmp(y1, y2, sizeof(float) * T * D) == 0,
                  "graph replay %d of moe T=%lld differs", rep, (long long)T);
        }
        printf("[cuda_ops] graph capture: moe_experts T=%lld two replays bit-identical\n",
               (long long)T);
        cudaGraphExecDestroy(ge);
        cudaGraphDestroy(g);
        cudaFree(scratch);
        cudaFree(dw);
        cudaFree(di);
        cudaFree(dy);
        cudaFree(dx);
        free(idx);
        free(wts);
        free(y2);
        free(y1);
        free(x);
    }
    {
        float *lg = xmalloc(sizeof(float) * M * V);
        duet_cuda_sample_params_t pa[8];
        for (int64_t m = 0; m < M; m++) {
            make_logits(lg + m * V, V, m);
            pa[m] = (duet_cuda_sample_params_t){.temperature = 0.9f,
                                                .top_k = (int32_t)(m % 3) * 20,
                                                .top_p = 0.9f,
                                                .u = (float)m / 8.0f};
        }
        float *dl = dev_copy(lg, sizeof(float) * M * V);
        duet_cuda_sample_params_t *dp = dev_copy(pa, sizeof(pa));
        int32_t *dout = dev_alloc(sizeof(int32_t) * M), o1[8], o2[8];
        void *scratch = dev_alloc(duet_cuda_sample_scratch_bytes(M, V));
        DUET_OK_OR_FAIL(duet_cuda_sample(st, dl, V, V, M, dp, dout, scratch));
        CUDA_OK(cudaStreamSynchronize(st));
        host_copy(o1, dout, sizeof(o1));
        CUDA_OK(cudaMemsetAsync(dout, 0xff, sizeof(o1), st));
        cudaGraph_t g;
        cudaGraphExec_t ge;
        CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        DUET_OK_OR_FAIL(duet_cuda_sample(st, dl, V, V, M, dp, dout, scratch));
        CUDA_OK(cudaStreamEndCapture(st, &g));
        CUDA_OK(cudaGraphInstantiate(&ge, g, 0));
        CUDA_OK(cudaGraphLaunch(ge, st));
        CUDA_OK(cudaStreamSynchronize(st));
        host_copy(o2, dout, sizeof(o2));
        CHECK(memcmp(o1, o2, sizeof(o1)) == 0, "graph replay of sample differs");
        printf("[cuda_ops] graph capture: sample replay identical\n");
        cudaGraphExecDestroy(ge);
        cudaGraphDestroy(g);
        cudaFree(scratch);
        cudaFree(dout);
        cudaFree(dp);
        cudaFree(dl);
        free(lg);
    }
    CUDA_OK(cudaStreamDestroy(st));
    experts_free(&X);
}

/* ---- bench ----------------------------------------------------------------------------------- */

/* Bytes of the distinct experts a routing selects (what one call must read). */
static double routed_bytes(const int32_t *idx, int64_t n, int64_t E, double per_expert)
{
    uint8_t *seen = calloc((size_t)E, 1);
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++)
        if (!seen[idx[i]]) {
            seen[idx[i]] = 1;
            k++;
        }
    free(seen);
    return (double)k * per_expert;
}

typedef struct {
    cudaStream_t st;
    const experts_t *X;
    const float *dx;
    float *dy;
    void *scratch;
    const int32_t *di; /* nset routings of T rows */
    const float *dw;
    int64_t T, K, nset;
} moe_bench_t;

/* Microseconds per call over `iters` calls cycling through the routings; from a CUDA graph of
 * those calls (device time only) when graph != 0, else from stream launches. */
static double moe_time(const moe_bench_t *b, int path, int iters, int graph)
{
    cudaEvent_t e0, e1;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    cudaGraph_t g = NULL;
    cudaGraphExec_t ge = NULL;
    for (int w = 0; w < 2; w++)
        DUET_OK_OR_FAIL(moe_call(b->st, &b->X->ex, b->dx, b->T, b->di, b->dw, b->K,
                                 DUET_CUDA_ACT_SILU, 0, 0, b->dy, b->scratch, path));
    if (graph)
        CUDA_OK(cudaStreamBeginCapture(b->st, cudaStreamCaptureModeThreadLocal));
    else
        CUDA_OK(cudaEventRecord(e0, b->st));
    for (int it = 0; it < iters; it++) {
        const int64_t s = it % b->nset;
        DUET_OK_OR_FAIL(moe_call(b->st, &b->X->ex, b->dx, b->T, b->di + s * b->T * b->K,
                                 b->dw + s * b->T * b->K, b->K, DUET_CUDA_ACT_SILU, 0, 0, b->dy,
                                 b->scratch, path));
    }
    if (graph) {
        CUDA_OK(cudaStreamEndCapture(b->st, &g));
        CUDA_OK(cudaGraphInstantiate(&ge, g, 0));
        CUDA_OK(cudaGraphLaunch(ge, b->st));
        CUDA_OK(cudaEventRecord(e0, b->st));
        CUDA_OK(cudaGraphLaunch(ge, b->st));
    }
    CUDA_OK(cudaEventRecord(e1, b->st));
    CUDA_OK(cudaEventSynchronize(e1));
    float ms = 0;
    CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
    if (graph) {
        cudaGraphExecDestroy(ge);
        cudaGraphDestroy(g);
    }
    CUDA_OK(cudaEventDestroy(e1));
    CUDA_OK(cudaEventDestroy(e0));
    return 1e3 * ms / iters;
}

#define GEMV_NR(nr) (PATH_GEMV | ((nr) << 4))

/*
 * Timings at the real dims, BF16: decode sizes as effective bandwidth over the distinct selected
 * experts' bytes, rotating through 8 routings so no call finds the last one's experts in L2
 * (stream launches, and a CUDA graph of the same calls for device time alone, per GEMV slot
 * size); prefill sizes as TFLOP/s of the 3 · 2 · D · I flops per (row, k), per MMA tile height.
 */
Test(cuda_ops, bench_moe, .timeout = 300)
{
    skip_without_device();
    const int64_t E = 256, I = 1024, D = 2304, K = 8, NSET = 8;
    experts_t X;
    experts_make(&X, DUET_DTYPE_BF16, E, I, D);
    const double per_expert = 3.0 * (double)I * D * 2;
    const int64_t Ts[] = {1, 8, 64, 256, 2048, 8192};
    const int64_t maxT = 8192;
    void *scratch = dev_alloc(duet_cuda_moe_scratch_bytes(maxT, K, E, I, D));
    float *x = xmalloc(sizeof(float) * maxT * D);
    for (int64_t i = 0; i < maxT * D; i++)
        x[i] = rng_n();
    float *dx = dev_copy(x, sizeof(float) * maxT * D), *dy = dev_alloc(sizeof(float) * maxT * D);
    CUDA_OK(cudaMemset(dy, 0, sizeof(float) * maxT * D));
    cudaStream_t st;
    CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    for (size_t ti = 0; ti < sizeof(Ts) / sizeof(Ts[0]); ti++) {
        const int64_t T = Ts[ti], nset = T <= 256 ? NSET : 1;
        int32_t *idx = xmalloc(sizeof(int32_t) * T * K * nset);
        float *wts = xmalloc(sizeof(float) * T * K * nset);
        double bytes = 0;
        for (int64_t s = 0; s < nset; s++) {
            make_routing(T, E, K, idx + s * T * K, wts + s * T * K);
            bytes += routed_bytes(idx + s * T * K, T * K, E, per_expert);
        }
        bytes /= (double)nset;
        int32_t *di = dev_copy(idx, sizeof(int32_t) * T * K * nset);
        float *dw = dev_copy(wts, sizeof(float) * T * K * nset);
        const moe_bench_t b = {st, &X, dx, dy, scratch, di, dw, T, K, nset};
        const double flops = (double)T * K * 6.0 * I * D;
        if (T <= 64) {
            const double us = moe_time(&b, PATH_AUTO, 40, 0), gus = moe_time(&b, PATH_AUTO, 40, 1);
            printf(
                "[cuda_ops] BENCH moe_experts BF16 T=%-5lld auto %7.1f us/call (graph %7.1f us): "
                "%.1f MB of experts, %.0f GB/s (graph %.0f GB/s)\n",
                (long long)T, us, gus, bytes / 1e6, bytes / us / 1e3, bytes / gus / 1e3);
            const int variants[] = {
                PATH_AUTO | PATH_NO_PDL,   GEMV_NR(1),           GEMV_NR(2), GEMV_NR(4), GEMV_NR(8),
                PATH_GEMV | PATH_SEPARATE, PATH_GEMV | PATH_DEEP};
            const char *names[] = {"auto, no PDL       ", "slots of 1         ",
                                   "slots of 2         ", "slots of 4         ",
                                   "slots of 8         ", "T=1: gemv2+combine ",
                                   "T=1: uncapped      "};
            for (int v = 0; v < 7; v++) {
                const double t = moe_time(&b, variants[v], 40, 1);
                printf("[cuda_ops] BENCH   T=%-5lld gemv %s: graph %7.1f us, %.0f GB/s\n",
                       (long long)T, names[v], t, bytes / t / 1e3);
            }
        } else {
            const int iters = T <= 256 ? 20 : 10;
            const double us = moe_time(&b, PATH_AUTO, iters, 0);
            printf("[cuda_ops] BENCH moe_experts BF16 T=%-5lld auto %9.1f us/call: %.1f TFLOP/s, "
                   "%.0f GB/s of experts\n",
                   (long long)T, us, flops / us / 1e6, bytes / us / 1e3);
            const int variants[] = {MMA_BM(64) | PATH_SYNC, MMA_BM(128) | PATH_SYNC,
                                    MMA_BM(64) | PATH_WG,   MMA_BM(128) | PATH_WG | PATH_NO_WS,
                                    MMA_BM(128) | PATH_WG,  PATH_GEMV};
            const char *names[] = {"mma.sync 64-row tiles ", "mma.sync 128-row tiles",
                                   "wgmma 64-row tiles    ", "wgmma 128-row tiles   ",
                                   "wgmma 128 x 256, ws   ", "gemv                  "};
            const int wg = duet__cuda_moe_wgmma_default(D, I);
            for (int v = 0; v < 6; v++) {
                if ((v == 5 && T > 2048) || ((v >= 2 && v <= 4) && !wg))
                    continue;
                const double t = moe_time(&b, variants[v], v == 5 ? 2 : iters, 0);
                printf("[cuda_ops] BENCH   T=%-5lld %s %9.1f us/call: %.1f TFLOP/s\n", (long long)T,
                       names[v], t, flops / t / 1e6);
            }
        }
        fflush(stdout);
        cudaFree(dw);
        cudaFree(di);
        free(wts);
        free(idx);
    }
    CUDA_OK(cudaStreamDestroy(st));
    cudaFree(dy);
    cudaFree(dx);
    free(x);
    cudaFree(scratch);
    experts_free(&X);
}

/* Routing at Kimi-Linear's sizes (E = 256, top 8, no groups) and DeepSeek-V3's (8 groups, keep
 * 4): microseconds per call from a CUDA graph of 100 calls, with and without programmatic
 * dependent launch (with it, consecutive calls overlap, so it is a lower bound). */
Test(cuda_ops, bench_route, .timeout = 120)
{
    skip_without_device();
    const int64_t E = 256, K = 8, maxT = 64, iters = 100;
    static const int64_t Ts[] = {1, 8, 64};
    static const int64_t Gs[][2] = {{1, 1}, {8, 4}};
    float *lg = xmalloc(sizeof(float) * maxT * E), *bias = xmalloc(sizeof(float) * E);
    for (int64_t i = 0; i < maxT * E; i++)
        lg[i] = rng_n() * 2.0f;
    for (int64_t e = 0; e < E; e++)
        bias[e] = rng_f() * 0.1f;
    float *dl = dev_copy(lg, sizeof(float) * maxT * E), *db = dev_copy(bias, sizeof(float) * E);
    int32_t *di = dev_alloc(sizeof(int32_t) * maxT * K);
    float *dw = dev_alloc(sizeof(float) * maxT * K);
    cudaStream_t st;
    CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    for (int gi = 0; gi < 2; gi++)
        for (size_t ti = 0; ti < sizeof(Ts) / sizeof(Ts[0]); ti++)
            for (int pdl = 1; pdl >= 0; pdl--) {
                const int64_t T = Ts[ti];
                duet_cuda_pdl_set(pdl);
                cudaGraph_t g;
                cudaGraphExec_t ge;
                CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
                for (int64_t it = 0; it < iters; it++)
                    DUET_OK_OR_FAIL(duet_cuda_moe_route(st, dl, db, T, E, Gs[gi][0], Gs[gi][1], K,
                                                        1, 2.446f, di, dw));
                CUDA_OK(cudaStreamEndCapture(st, &g));
                duet_cuda_pdl_set(-1);
                CUDA_OK(cudaGraphInstantiate(&ge, g, 0));
                CUDA_OK(cudaGraphLaunch(ge, st));
                CUDA_OK(cudaEventRecord(e0, st));
                CUDA_OK(cudaGraphLaunch(ge, st));
                CUDA_OK(cudaEventRecord(e1, st));
                CUDA_OK(cudaEventSynchronize(e1));
                float ms = 0;
                CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
                printf("[cuda_ops] BENCH moe_route E=%lld k=%lld n_group=%lld T=%-3lld %s: graph "
                       "%.2f us/call\n",
                       (long long)E, (long long)K, (long long)Gs[gi][0], (long long)T,
                       pdl ? "PDL   " : "no PDL", 1e3 * ms / iters);
                cudaGraphExecDestroy(ge);
                cudaGraphDestroy(g);
            }
    CUDA_OK(cudaEventDestroy(e1));
    CUDA_OK(cudaEventDestroy(e0));
    CUDA_OK(cudaStreamDestroy(st));
    cudaFree(dw);
    cudaFree(di);
    cudaFree(db);
    cudaFree(dl);
    free(bias);
    free(lg);
}

/* Sampling at M = 64, V = 163840 on two kinds of logits: "flat" N(0, 3^2) (at T = 1 the top 10 %
 * of the vocabulary holds ~96 % of the mass, so draws past that need the full sort) and "peaky"
 * (the same plus 20 tokens raised by 12, closer to a language model's). */
Test(cuda_ops, bench_sample, .timeout = 120)
{
    skip_without_device();
    const int64_t M = 64, V = 163840;
    static const sample_cfg_t cfgs[] = {
        {1.0f, 0, 0.9f}, {0.7f, 50, 0.95f}, {1.0f, 0, 1.0f}, {0.0f, 0, 1.0f}};
    float *lg = xmalloc(sizeof(float) * M * V);
    float *dl = dev_alloc(sizeof(float) * M * V);
    int32_t *dout = dev_alloc(sizeof(int32_t) * M);
    void *scratch = dev_alloc(duet_cuda_sample_scratch_bytes(M, V));
    cudaEvent_t e0, e1;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    for (int peaky = 0; peaky < 2; peaky++) {
        for (int64_t m = 0; m < M; m++) {
            for (int64_t v = 0; v < V; v++)
                lg[m * V + v] = rng_n() * 3.0f;
            for (int j = 0; peaky && j < 20; j++)
                lg[m * V + rng_u32() % V] += 12.0f;
        }
        CUDA_OK(cudaMemcpy(dl, lg, sizeof(float) * M * V, cudaMemcpyHostToDevice));
        for (size_t c = 0; c < sizeof(cfgs) / sizeof(cfgs[0]); c++) {
            duet_cuda_sample_params_t pa[64];
            for (int64_t m = 0; m < M; m++)
                pa[m] = (duet_cuda_sample_params_t){.temperature = cfgs[c].temperature,
                                                    .top_k = cfgs[c].top_k,
                                                    .top_p = cfgs[c].top_p,
                                                    .u = (float)(m + 0.5) / (float)M};
            duet_cuda_sample_params_t *dp = dev_copy(pa, sizeof(pa));
            const int iters = 10;
            DUET_OK_OR_FAIL(duet_cuda_sample(0, dl, V, V, M, dp, dout, scratch));
            CUDA_OK(cudaEventRecord(e0, 0));
            for (int it = 0; it < iters; it++)
                DUET_OK_OR_FAIL(duet_cuda_sample(0, dl, V, V, M, dp, dout, scratch));
            CUDA_OK(cudaEventRecord(e1, 0));
            CUDA_OK(cudaEventSynchronize(e1));
            float ms = 0;
            CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
            printf(
                "[cuda_ops] BENCH sample %s M=%lld V=%lld T=%g top_k=%d top_p=%g: %.1f us/call\n",
                peaky ? "peaky" : "flat ", (long long)M, (long long)V, cfgs[c].temperature,
                cfgs[c].top_k, cfgs[c].top_p, 1e3 * ms / iters);
            cudaFree(dp);
        }
    }
    CUDA_OK(cudaEventRecord(e0, 0));
    for (int it = 0; it < 10; it++)
        DUET_OK_OR_FAIL(duet_cuda_argmax(0, dl, V, V, M, dout));
    CUDA_OK(cudaEventRecord(e1, 0));
    CUDA_OK(cudaEventSynchronize(e1));
    float ms = 0;
    CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
    printf("[cuda_ops] BENCH argmax M=%lld V=%lld: %.1f us/call\n", (long long)M, (long long)V,
           1e3 * ms / 10);
    CUDA_OK(cudaEventDestroy(e1));
    CUDA_OK(cudaEventDestroy(e0));
    cudaFree(scratch);
    cudaFree(dout);
    cudaFree(dl);
    free(lg);
}
