/*
 * test_kernels_cpu.c: the CPU backend against naive references written here (double
 * accumulation), over odd shapes, strides, every weight dtype, accumulate on/off, one and
 * several threads, and every matmul instruction-set path this CPU has. Each op prints its max
 * absolute and relative difference (stdout, `ctest -V`) so a drift shows before it fails.
 *
 * Matmul error is judged against the rounding bound of an fp32 dot product: |y - ref| <=
 * 1e-5 * sum_k |x_k w_k|, which is the meaningful "relative" error when outputs cancel to ~0.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <criterion/criterion.h>
#include <criterion/logging.h>

#include "kernels/cpu/cpu_impl.h"
#include "kernels/kernels.h"
#include "test_rng.h"

/* ---- helpers ------------------------------------------------------------------------------- */

/*
 * cr_assert only when the check fails: the suite runs with --full-stats, which ships every passing
 * assertion to the runner, and the exhaustive loops make millions of checks.
 */
#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond))                                                                               \
            cr_assert(0, "check failed: " #cond " " __VA_ARGS__);                                  \
    } while (0)

/* One summary line per op on stdout (visible in `ctest -V`); per-case detail is cr_log_info. */
#define REPORT(...) (printf("[kernels] " __VA_ARGS__), printf("\n"), fflush(stdout))

/* the pool's checks, shared with the plain program test_pool_threads (pool_make too) */
#include "tests/unit/pool_checks.h"

static float bits_f(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

static uint32_t f_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

/* Fill n elements of dtype dt with random values (as stored) and return them widened. */
static void *make_weights(duet_dtype_t dt, int64_t n, float scale, double **wide_p)
{
    void *w = malloc((size_t)n * duet_dtype_size(dt));
    double *wide = malloc((size_t)n * sizeof(*wide));
    cr_assert_not_null(w);
    cr_assert_not_null(wide);
    for (int64_t i = 0; i < n; i++) {
        float v = rng_f() * scale;
        if (dt == DUET_DTYPE_F32) {
            ((float *)w)[i] = v;
            wide[i] = v;
        } else if (dt == DUET_DTYPE_BF16) {
            ((uint16_t *)w)[i] = duet_f32_to_bf16(v);
            wide[i] = duet_bf16_to_f32(((uint16_t *)w)[i]);
        } else {
            ((uint16_t *)w)[i] = duet_f32_to_f16(v);
            wide[i] = duet_f16_to_f32(((uint16_t *)w)[i]);
        }
    }
    *wide_p = wide;
    return w;
}

typedef struct {
    double max_abs, max_rel;
} diff_t;

/* Track |got - ref| and |got - ref| / |ref| (the latter over entries with |ref| >= floor). */
static void diff_add(diff_t *d, double got, double ref, double floor)
{
    double a = fabs(got - ref);
    if (a > d->max_abs)
        d->max_abs = a;
    if (fabs(ref) >= floor && a / fabs(ref) > d->max_rel)
        d->max_rel = a / fabs(ref);
}

/* ---- dtypes and conversions ---------------------------------------------------------------- */

Test(kernels_cpu, dtype_helpers, .timeout = 10)
{
    CHECK((duet_dtype_size(DUET_DTYPE_F32)) == (4));
    CHECK((duet_dtype_size(DUET_DTYPE_BF16)) == (2));
    CHECK((duet_dtype_size(DUET_DTYPE_F16)) == (2));
    cr_assert_str_eq(duet_dtype_name(DUET_DTYPE_F32), "F32");
    cr_assert_str_eq(duet_dtype_name(DUET_DTYPE_BF16), "BF16");
    cr_assert_str_eq(duet_dtype_name(DUET_DTYPE_F16), "F16");
    duet_tensor_t t = {.ndim = 3, .shape = {2, 3, 7}};
    CHECK((duet_tensor_numel(&t)) == (42));
    t.ndim = 0;
    CHECK((duet_tensor_numel(&t)) == (1));
}

/* The value of binary16 pattern h computed from its definition. */
static double f16_ref(uint16_t h)
{
    int s = h >> 15, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    double v;
    if (e == 0)
        v = ldexp((double)m, -24);
    else if (e == 31)
        v = m == 0 ? INFINITY : NAN;
    else
        v = ldexp(1.0 + m / 1024.0, e - 15);
    return s ? -v : v;
}

Test(kernels_cpu, f16_exhaustive, .timeout = 30)
{
    int n_nan = 0, n_sub = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = duet_f16_to_f32((uint16_t)h);
        double ref = f16_ref((uint16_t)h);
        if (isnan(ref)) {
            CHECK(isnan(f), "f16 %04x should be NaN", h);
            uint16_t back = duet_f32_to_f16(f);
            CHECK((back & 0x7c00) == 0x7c00 && (back & 0x3ff) != 0, "NaN %04x -> %04x", h, back);
            CHECK((back & 0x8000) == (h & 0x8000));
            n_nan++;
            continue;
        }
        CHECK((double)f == ref, "f16 %04x -> %.9g, want %.9g", h, f, ref);
        CHECK((signbit(f) != 0) == ((h & 0x8000) != 0), "sign of %04x", h);
        CHECK((duet_f32_to_f16(f)) == (h), "round trip %04x -> %04x", h, duet_f32_to_f16(f));
        if ((h & 0x7c00) == 0 && (h & 0x3ff) != 0)
            n_sub++;
        /* The midpoint to the next pattern up in magnitude rounds to the even of the two. */
        if ((h & 0x7fff) < 0x7bff) {
            double up = f16_ref((uint16_t)(h + 1));
            float mid = (float)((ref + up) / 2);
            CHECK(((double)mid) == ((ref + up) / 2)); /* exact in fp32 */
            uint16_t want = (h & 1) == 0 ? (uint16_t)h : (uint16_t)(h + 1);
            CHECK((duet_f32_to_f16(mid)) == (want), "tie above %04x -> %04x, want %04x", h,
                  duet_f32_to_f16(mid), want);
            /* just above / below the midpoint */
            float above = nextafterf(mid, fabsf(mid) * 4 * (mid < 0 ? -1.0f : 1.0f));
            float below = nextafterf(mid, 0.0f);
            CHECK((duet_f32_to_f16(above)) == ((uint16_t)(h + 1)));
            CHECK((duet_f32_to_f16(below)) == ((uint16_t)h));
        }
    }
    CHECK((n_nan) == (2 * 1023));
    CHECK((n_sub) == (2 * 1023));

    /* known values */
    CHECK((duet_f32_to_f16(1.0f)) == (0x3c00));
    CHECK((duet_f32_to_f16(-2.0f)) == (0xc000));
    CHECK((duet_f32_to_f16(0.1f)) == (0x2e66));
    CHECK((duet_f32_to_f16(65504.0f)) == (0x7bff));
    CHECK((duet_f32_to_f16(65519.99f)) == (0x7bff));
    CHECK((duet_f32_to_f16(65520.0f)) == (0x7c00));
    CHECK((duet_f32_to_f16(1e10f)) == (0x7c00));
    CHECK((duet_f32_to_f16(-INFINITY)) == (0xfc00));
    CHECK((duet_f32_to_f16(0x1p-24f)) == (0x0001));
    CHECK((duet_f32_to_f16(0x1p-25f)) == (0x0000)); /* tie to even */
    CHECK((duet_f32_to_f16(0x1.000002p-25f)) == (0x0001));
    CHECK((duet_f32_to_f16(0x1.8p-24f)) == (0x0002)); /* 1.5 ulp: tie to even */
    CHECK((duet_f32_to_f16(-0x1p-30f)) == (0x8000));
    CHECK((duet_f32_to_f16(0x1.ff8p-15f)) == (0x03ff)); /* largest subnormal */
    CHECK((duet_f32_to_f16(0x1.ffcp-15f)) == (0x0400)); /* tie: up to the smallest normal */
    CHECK((duet_f32_to_f16(1e-45f)) == (0x0000));       /* fp32 subnormal */
    CHECK(isnan(duet_f16_to_f32(duet_f32_to_f16(NAN))));
    CHECK((duet_f16_to_f32(0x7c00)) == (INFINITY));
    CHECK((duet_f16_to_f32(0x0001)) == (0x1p-24f));
    REPORT("f16: 65536 patterns exact, %d NaN, %d subnormal, ties to even", n_nan, n_sub);
}

#if defined(__x86_64__)
#include <immintrin.h>
__attribute__((target("f16c"))) static uint16_t f16c_cvt(float f)
{
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
}
#endif

Test(kernels_cpu, f32_to_f16_matches_f16c, .timeout = 60)
{
#if defined(__x86_64__)
    if (!duet__cpu_has_f16c())
        cr_skip_test("no F16C");
    /* 2^24 fp32 patterns spread over the whole space (every 256th, random low bits). */
    uint64_t n = 0;
    for (uint64_t i = 0; i < (1ull << 32); i += 256) {
        uint32_t u = (uint32_t)i | (rng_u32() & 255u);
        float f = bits_f(u);
        uint16_t mine = duet_f32_to_f16(f), hw = f16c_cvt(f);
        CHECK((mine) == (hw), "f32 %08x -> %04x, F16C says %04x", u, mine, hw);
        n++;
    }
    REPORT("f32->f16: %llu patterns equal to F16C", (unsigned long long)n);
#else
    cr_skip_test("not x86-64");
#endif
}

Test(kernels_cpu, bf16_exhaustive, .timeout = 10)
{
    for (uint32_t h = 0; h < 65536; h++) {
        float f = duet_bf16_to_f32((uint16_t)h);
        CHECK((f_bits(f)) == (h << 16));
        if (isnan(f)) {
            CHECK(isnan(duet_bf16_to_f32(duet_f32_to_bf16(f))), "NaN %04x", h);
            continue;
        }
        CHECK((duet_f32_to_bf16(f)) == (h), "round trip %04x", h);
        if ((h & 0x7fff) < 0x7f7f) { /* tie between h and h+1 rounds to even */
            float mid = bits_f((h << 16) | 0x8000u);
            CHECK((duet_f32_to_bf16(mid)) == ((h & 1) ? h + 1 : h));
            CHECK((duet_f32_to_bf16(bits_f((h << 16) | 0x8001u))) == (h + 1));
            CHECK((duet_f32_to_bf16(bits_f((h << 16) | 0x7fffu))) == (h));
        }
    }
    CHECK((duet_f32_to_bf16(1.0f)) == (0x3f80));
    CHECK((duet_f32_to_bf16(3.4e38f)) == (0x7f80));                        /* rounds up to inf */
    CHECK(isnan(duet_bf16_to_f32(duet_f32_to_bf16(bits_f(0x7f800001u))))); /* sNaN stays NaN */
    REPORT("bf16: 65536 patterns exact, ties to even");
}

Test(kernels_cpu, convert_to_f32, .timeout = 10)
{
    for (int dt = 0; dt < 3; dt++) {
        double *wide;
        void *w = make_weights((duet_dtype_t)dt, 1001, 3.0f, &wide);
        float *out = malloc(1001 * sizeof(*out));
        duet_convert_to_f32(out, w, (duet_dtype_t)dt, 1001);
        for (int i = 0; i < 1001; i++)
            CHECK(((double)out[i]) == (wide[i]));
        free(out);
        free(w);
        free(wide);
    }
}

/* ---- instance and pool --------------------------------------------------------------------- */

Test(kernels_cpu, create_and_errors, .timeout = 10)
{
    duet_kernels_t *k = NULL;
    CHECK((duet_kernels_create(DUET_DEVICE_CUDA, 0, &k)) == (DUET_ERR_UNSUPPORTED));
    cr_assert_null(k);
    CHECK(strstr(duet_error_last(), "CUDA") != NULL);
    /* No driver here (CI, build VMs): the probe must report 0, not fail or crash. */
    REPORT("CUDA devices visible: %d", duet_cuda_device_count());
    CHECK(duet_cuda_device_count() >= 0);
    CHECK((duet_kernels_create(DUET_DEVICE_CPU, -1, &k)) == (DUET_ERR_INVALID));

    unsetenv("DUET_THREADS");
    CHECK((duet_kernels_create(DUET_DEVICE_CPU, 0, &k)) == (DUET_OK));
    CHECK((duet_kernels_n_threads(k)) >= (1));
    CHECK((duet_kernels_device(k)) == (DUET_DEVICE_CPU));
    REPORT("default threads %d, matmul path %s", duet_kernels_n_threads(k),
           duet_kernels_cpu_isa(k));
    duet_kernels_destroy(k);

    setenv("DUET_THREADS", "3", 1);
    CHECK((duet_kernels_create(DUET_DEVICE_CPU, 0, &k)) == (DUET_OK));
    CHECK((duet_kernels_n_threads(k)) == (3));
    duet_kernels_destroy(k);
    CHECK((duet_kernels_create(DUET_DEVICE_CPU, 2, &k)) == (DUET_OK)); /* explicit wins */
    CHECK((duet_kernels_n_threads(k)) == (2));

    /* bad matmul arguments are a status, not a crash */
    float buf[16] = {0};
    duet_tensor_t w = {.data = buf, .dtype = DUET_DTYPE_F32, .ndim = 2, .shape = {2, 4}};
    CHECK((duet_k_matmul(k, buf, 2, buf, 3, 1, &w, 0)) == (DUET_ERR_INVALID)); /* ldx < K */
    CHECK((duet_k_matmul(k, buf, 1, buf, 4, 1, &w, 0)) == (DUET_ERR_INVALID)); /* ldy < N */
    w.ndim = 1;
    CHECK((duet_k_matmul(k, buf, 2, buf, 4, 1, &w, 0)) == (DUET_ERR_INVALID));
    w.ndim = 2;
    w.device = DUET_DEVICE_CUDA;
    CHECK((duet_k_matmul(k, buf, 2, buf, 4, 1, &w, 0)) == (DUET_ERR_INVALID));
    duet_kernels_destroy(k);
    duet_kernels_destroy(NULL);
}

Test(kernels_cpu, parallel_for_covers_once, .timeout = 60)
{
    int combos = pool_check_parallel_for_covers_once();
    REPORT("parallel_for: %d (threads, n, grain) combos, every index exactly once", combos);
}

/* Many tiny back-to-back jobs with sleeping in between: the wake-up path must not lose jobs. */
Test(kernels_cpu, pool_many_small_jobs, .timeout = 60)
{
    pool_check_many_small_jobs(20000);
}

/* Tiny jobs back to back while the pool's threads are preempted (pool_checks.h: the race this
 * caught, and how often). */
Test(kernels_cpu, pool_jobs_back_to_back_run_each_task_once, .timeout = 60)
{
    pool_check_jobs_back_to_back(1000000);
}

Test(kernels_cpu, parallel_for_nested_runs_inline, .timeout = 20)
{
    pool_check_nested_runs_inline();
}

/* ---- matmul --------------------------------------------------------------------------------- */

typedef struct {
    int64_t M, N, K, ldx_pad, ldy_pad;
} mm_shape_t;

static const mm_shape_t mm_shapes[] = {
    {1, 1, 1, 0, 0},     {1, 1, 17, 3, 1},      {1, 7, 33, 0, 2},     {2, 9, 15, 1, 0},
    {3, 5, 31, 5, 3},    {4, 4, 16, 0, 0},      {5, 19, 47, 2, 1},    {1, 300, 257, 0, 0},
    {1, 64, 2304, 0, 0}, {8, 100, 129, 7, 5},   {13, 37, 1100, 1, 1}, {64, 70, 2050, 0, 3},
    {65, 33, 63, 9, 0},  {130, 67, 1031, 4, 2}, {1, 1000, 8, 0, 0},   {200, 3, 600, 0, 0},
    {6, 21, 4099, 0, 0}, {33, 130, 1025, 0, 1},
};

/* ref[m, n] = sum_k x[m, k] w[n, k] in double; bound[m, n] = sum_k |x w|. */
static void mm_reference(const mm_shape_t *s, const float *x, int64_t ldx, const double *w,
                         double *ref, double *bound)
{
    for (int64_t m = 0; m < s->M; m++)
        for (int64_t n = 0; n < s->N; n++) {
            double acc = 0.0, b = 0.0;
            for (int64_t kk = 0; kk < s->K; kk++) {
                double p = (double)x[m * ldx + kk] * w[n * s->K + kk];
                acc += p;
                b += fabs(p);
            }
            ref[m * s->N + n] = acc;
            bound[m * s->N + n] = b;
        }
}

static void mm_check_isa(duet__isa_t isa)
{
    static const int threads[] = {1, 4};
    const float sentinel = -12345.0f;
    duet_kernels_t *ks[2];
    for (int t = 0; t < 2; t++) {
        ks[t] = pool_make(threads[t]);
        CHECK((duet__kernels_cpu_set_isa(ks[t], isa)) == (DUET_OK));
    }
    diff_t summary[3] = {{0}};
    double summary_worst[3] = {0};
    for (size_t si = 0; si < sizeof(mm_shapes) / sizeof(mm_shapes[0]); si++) {
        const mm_shape_t *s = &mm_shapes[si];
        int64_t ldx = s->K + s->ldx_pad, ldy = s->N + s->ldy_pad;
        float *x = malloc((size_t)(s->M * ldx) * sizeof(*x));
        float *y = malloc((size_t)(s->M * ldy) * sizeof(*y));
        float *y0 = malloc((size_t)(s->M * ldy) * sizeof(*y0));
        double *ref = malloc((size_t)(s->M * s->N) * sizeof(*ref));
        double *bnd = malloc((size_t)(s->M * s->N) * sizeof(*bnd));
        for (int64_t i = 0; i < s->M * ldx; i++)
            x[i] = rng_f();
        for (int64_t i = 0; i < s->M * ldy; i++)
            y0[i] = rng_f();
        for (int dt = 0; dt < 3; dt++) {
            double *wide;
            void *wdata = make_weights((duet_dtype_t)dt, s->N * s->K, 0.5f, &wide);
            duet_tensor_t w = {.data = wdata,
                               .dtype = (duet_dtype_t)dt,
                               .device = DUET_DEVICE_CPU,
                               .ndim = 2,
                               .shape = {s->N, s->K}};
            mm_reference(s, x, ldx, wide, ref, bnd);
            for (int t = 0; t < 2; t++) {
                for (int acc = 0; acc < 2; acc++) {
                    for (int64_t m = 0; m < s->M; m++)
                        for (int64_t n = 0; n < ldy; n++)
                            y[m * ldy + n] = n < s->N ? (acc ? y0[m * ldy + n] : NAN) : sentinel;
                    duet_status_t st = duet_k_matmul(ks[t], y, ldy, x, ldx, s->M, &w, acc);
                    CHECK((st) == (DUET_OK), "%s", duet_error_last());
                    diff_t d = {0};
                    double worst = 0.0;
                    for (int64_t m = 0; m < s->M; m++) {
                        for (int64_t n = 0; n < ldy; n++) {
                            float got = y[m * ldy + n];
                            if (n >= s->N) {
                                CHECK((got) == (sentinel), "wrote past N at m %lld n %lld",
                                      (long long)m, (long long)n);
                                continue;
                            }
                            double want = ref[m * s->N + n] + (acc ? y0[m * ldy + n] : 0.0);
                            double b = bnd[m * s->N + n] + (acc ? fabs(y0[m * ldy + n]) : 0.0);
                            diff_add(&d, got, want, 1e-3);
                            double e = fabs(got - want) / (b > 0 ? b : 1.0);
                            if (e > worst)
                                worst = e;
                            CHECK(e <= 1e-5 && !isnan(got),
                                  "%s %s M%lld N%lld K%lld t%d acc%d: y[%lld,%lld] = %.9g, "
                                  "want %.9g",
                                  duet__isa_name(isa), duet_dtype_name(w.dtype), (long long)s->M,
                                  (long long)s->N, (long long)s->K, threads[t], acc, (long long)m,
                                  (long long)n, got, want);
                        }
                    }
                    summary[dt].max_abs = fmax(summary[dt].max_abs, d.max_abs);
                    summary[dt].max_rel = fmax(summary[dt].max_rel, d.max_rel);
                    summary_worst[dt] = fmax(summary_worst[dt], worst);
                    cr_log_info("matmul %-6s %-4s M=%-3lld N=%-4lld K=%-4lld ldx=%-4lld "
                                "ldy=%-4lld threads=%d acc=%d: max_abs %.3g max_rel %.3g "
                                "max_err/sum|xw| %.3g",
                                duet__isa_name(isa), duet_dtype_name(w.dtype), (long long)s->M,
                                (long long)s->N, (long long)s->K, (long long)ldx, (long long)ldy,
                                threads[t], acc, d.max_abs, d.max_rel, worst);
                }
            }
            free(wdata);
            free(wide);
        }
        free(x);
        free(y);
        free(y0);
        free(ref);
        free(bnd);
    }
    for (int dt = 0; dt < 3; dt++)
        REPORT("matmul %-6s %-4s %zu shapes x threads {1,4} x accumulate {0,1}: max_abs %.3g "
               "max_rel %.3g max_err/sum|xw| %.3g",
               duet__isa_name(isa), duet_dtype_name((duet_dtype_t)dt),
               sizeof(mm_shapes) / sizeof(mm_shapes[0]), summary[dt].max_abs, summary[dt].max_rel,
               summary_worst[dt]);
    for (int t = 0; t < 2; t++)
        duet_kernels_destroy(ks[t]);
}

Test(kernels_cpu, matmul_scalar, .timeout = 120)
{
    mm_check_isa(DUET__ISA_SCALAR);
}

Test(kernels_cpu, matmul_avx2, .timeout = 120)
{
    if (duet__isa_detect() < DUET__ISA_AVX2)
        cr_skip_test("CPU lacks AVX2/FMA/F16C");
    mm_check_isa(DUET__ISA_AVX2);
}

Test(kernels_cpu, matmul_avx512, .timeout = 120)
{
    if (duet__isa_detect() < DUET__ISA_AVX512)
        cr_skip_test("CPU lacks AVX-512");
    mm_check_isa(DUET__ISA_AVX512);
}

/* A view of rows of a larger matrix, M = 0, K = 0. */
Test(kernels_cpu, matmul_views_and_empty, .timeout = 10)
{
    duet_kernels_t *k = pool_make(2);
    double *wide;
    float *wf = make_weights(DUET_DTYPE_F32, 10 * 20, 1.0f, &wide);
    float x[20], y[4];
    for (int i = 0; i < 20; i++)
        x[i] = rng_f();
    duet_tensor_t w = {.data = wf + 3 * 20, .dtype = DUET_DTYPE_F32, .ndim = 2, .shape = {4, 20}};
    CHECK((duet_k_matmul(k, y, 4, x, 20, 1, &w, 0)) == (DUET_OK));
    for (int n = 0; n < 4; n++) {
        double r = 0;
        for (int i = 0; i < 20; i++)
            r += x[i] * wide[(3 + n) * 20 + i];
        CHECK(fabs(y[n] - r) < 1e-5);
    }
    CHECK((duet_k_matmul(k, y, 4, x, 20, 0, &w, 0)) == (DUET_OK));
    w.shape[1] = 0;
    y[0] = 5.0f;
    CHECK((duet_k_matmul(k, y, 4, x, 20, 1, &w, 1)) == (DUET_OK));
    CHECK((y[0]) == (5.0f));
    CHECK((duet_k_matmul(k, y, 4, x, 20, 1, &w, 0)) == (DUET_OK));
    CHECK((y[0]) == (0.0f));
    free(wf);
    free(wide);
    duet_kernels_destroy(k);
}

/*
 * Batch invariance: row m of y = x W^T is bit-identical whether it is computed alone (M = 1),
 * inside a batch of any size at any position, and with any thread count; K past the blocking
 * threshold (1536) and N not a multiple of the tile are included. The serving workers rely on
 * this to match duet-generate token for token.
 */
Test(kernels_cpu, matmul_batch_invariant, .timeout = 120)
{
    static const int64_t Ks[] = {64, 1000, 1537, 3000};
    static const int64_t Ms[] = {1, 2, 3, 5, 8, 9, 17, 64, 65, 130};
    duet_kernels_t *k1 = pool_make(1);
    duet_kernels_t *k3 = pool_make(3);
    for (int dt_i = 0; dt_i < 2; dt_i++) {
        duet_dtype_t dt = dt_i == 0 ? DUET_DTYPE_F32 : DUET_DTYPE_BF16;
        for (size_t ki = 0; ki < sizeof(Ks) / sizeof(Ks[0]); ki++) {
            int64_t K = Ks[ki], N = 75, Mmax = 130;
            double *wide;
            void *wd = make_weights(dt, N * K, 1.0f, &wide);
            free(wide);
            duet_tensor_t w = {.data = wd, .dtype = dt, .ndim = 2, .shape = {N, K}};
            float *x = malloc(sizeof(float) * (size_t)(Mmax * K));
            float *y1 = malloc(sizeof(float) * (size_t)(Mmax * N));
            float *yb = malloc(sizeof(float) * (size_t)(Mmax * N));
            for (int64_t i = 0; i < Mmax * K; i++)
                x[i] = rng_f();
            for (int64_t m = 0; m < Mmax; m++) /* every row alone */
                CHECK(duet_k_matmul(k1, y1 + m * N, N, x + m * K, K, 1, &w, 0) == DUET_OK);
            for (size_t mi = 0; mi < sizeof(Ms) / sizeof(Ms[0]); mi++) {
                int64_t M = Ms[mi];
                int64_t off = (Mmax - M) / 2; /* a batch starting mid-way */
                for (int t = 0; t < 2; t++) {
                    CHECK(duet_k_matmul(t == 0 ? k1 : k3, yb, N, x + off * K, K, M, &w, 0) ==
                          DUET_OK);
                    CHECK(memcmp(yb, y1 + off * N, sizeof(float) * (size_t)(M * N)) == 0,
                          "K=%lld M=%lld threads=%d dtype=%d: a row differs from its M=1 result",
                          (long long)K, (long long)M, t == 0 ? 1 : 3, (int)dt);
                }
            }
            free(x);
            free(y1);
            free(yb);
            free(wd);
        }
    }
    duet_kernels_destroy(k1);
    duet_kernels_destroy(k3);
}

/* ---- rmsnorm, activations, add, embed ------------------------------------------------------ */

Test(kernels_cpu, rmsnorm, .timeout = 30)
{
    static const int64_t shapes[][2] = {{1, 1}, {1, 7}, {3, 2304}, {5, 33}, {64, 2304}, {200, 511}};
    for (int t = 1; t <= 3; t += 2) {
        duet_kernels_t *k = pool_make(t);
        for (size_t si = 0; si < sizeof(shapes) / sizeof(shapes[0]); si++) {
            int64_t M = shapes[si][0], D = shapes[si][1];
            for (int dt = 0; dt < 3; dt++) {
                double *wide;
                void *wd = make_weights((duet_dtype_t)dt, D, 2.0f, &wide);
                duet_tensor_t w = {.data = wd, .dtype = (duet_dtype_t)dt, .ndim = 1, .shape = {D}};
                float *x = malloc((size_t)(M * D) * sizeof(*x));
                float *y = malloc((size_t)(M * D) * sizeof(*y));
                for (int64_t i = 0; i < M * D; i++)
                    x[i] = rng_f() * 3.0f;
                for (int alias = 0; alias < 2; alias++) {
                    float *xin = alias ? y : x;
                    if (alias)
                        memcpy(y, x, (size_t)(M * D) * sizeof(*y));
                    duet_k_rmsnorm(k, y, xin, &w, M, D, 1e-6f);
                    diff_t d = {0};
                    for (int64_t m = 0; m < M; m++) {
                        double ss = 0;
                        for (int64_t i = 0; i < D; i++)
                            ss += (double)x[m * D + i] * x[m * D + i];
                        double sc = 1.0 / sqrt(ss / D + 1e-6);
                        for (int64_t i = 0; i < D; i++) {
                            double want = wide[i] * x[m * D + i] * sc;
                            diff_add(&d, y[m * D + i], want, 1e-3);
                            CHECK(fabs(y[m * D + i] - want) <= 1e-6 * (1 + fabs(want)),
                                  "rmsnorm M%lld D%lld %s", (long long)M, (long long)D,
                                  duet_dtype_name(w.dtype));
                        }
                    }
                    REPORT("rmsnorm %-4s M=%-3lld D=%-4lld threads=%d alias=%d: max_abs %.3g "
                           "max_rel %.3g",
                           duet_dtype_name(w.dtype), (long long)M, (long long)D, t, alias,
                           d.max_abs, d.max_rel);
                }
                free(x);
                free(y);
                free(wd);
                free(wide);
            }
        }
        duet_kernels_destroy(k);
    }
}

static double silu_ref(double g, double u)
{
    return g / (1.0 + exp(-g)) * u;
}

static double situ_ref(double g, double u, double b, double bl)
{
    return b * tanh(g / b) * (1.0 / (1.0 + exp(-g))) * (bl * tanh(u / bl));
}

Test(kernels_cpu, gated_activations, .timeout = 30)
{
    static const int64_t ns[] = {1, 17, 9216, 70001};
    for (int t = 1; t <= 3; t += 2) {
        duet_kernels_t *k = pool_make(t);
        for (size_t ni = 0; ni < sizeof(ns) / sizeof(ns[0]); ni++) {
            int64_t n = ns[ni];
            float *g = malloc((size_t)n * sizeof(*g)), *u = malloc((size_t)n * sizeof(*u));
            float *o = malloc((size_t)n * sizeof(*o));
            for (int64_t i = 0; i < n; i++) {
                g[i] = rng_f() * 12.0f;
                u[i] = rng_f() * 12.0f;
            }
            for (int which = 0; which < 2; which++) {
                for (int alias = 0; alias < 3; alias++) {
                    /* alias 0: separate out; 1: out == gate; 2: out == up */
                    float *gi = g, *ui = u, *out = o;
                    float *gc = malloc((size_t)n * sizeof(*gc)), *uc = malloc((size_t)n * 4);
                    memcpy(gc, g, (size_t)n * sizeof(*g));
                    memcpy(uc, u, (size_t)n * sizeof(*u));
                    if (alias == 1)
                        out = gi = gc;
                    if (alias == 2)
                        out = ui = uc;
                    if (which == 0)
                        duet_k_silu_mul(k, out, gi, ui, n);
                    else
                        duet_k_situ_mul(k, out, gi, ui, n, 3.0f, 2.0f);
                    diff_t d = {0};
                    for (int64_t i = 0; i < n; i++) {
                        double want =
                            which == 0 ? silu_ref(g[i], u[i]) : situ_ref(g[i], u[i], 3.0, 2.0);
                        diff_add(&d, out[i], want, 1e-3);
                        CHECK(fabs(out[i] - want) <= 2e-6 * (1 + fabs(want)),
                              "%s n %lld i %lld: %.9g want %.9g", which ? "situ" : "silu",
                              (long long)n, (long long)i, out[i], want);
                    }
                    if (alias == 0)
                        REPORT("%s_mul n=%-6lld threads=%d: max_abs %.3g max_rel %.3g",
                               which ? "situ" : "silu", (long long)n, t, d.max_abs, d.max_rel);
                    free(gc);
                    free(uc);
                }
            }
            free(g);
            free(u);
            free(o);
        }
        duet_kernels_destroy(k);
    }
}

Test(kernels_cpu, add, .timeout = 10)
{
    static const int64_t ns[] = {1, 5, 2304, 300001};
    duet_kernels_t *k = pool_make(3);
    for (size_t ni = 0; ni < sizeof(ns) / sizeof(ns[0]); ni++) {
        int64_t n = ns[ni];
        float *y = malloc((size_t)n * sizeof(*y)), *x = malloc((size_t)n * sizeof(*x));
        float *y0 = malloc((size_t)n * sizeof(*y0));
        for (int64_t i = 0; i < n; i++) {
            y[i] = y0[i] = rng_f();
            x[i] = rng_f();
        }
        duet_k_add(k, y, x, n);
        for (int64_t i = 0; i < n; i++)
            CHECK((y[i]) == (y0[i] + x[i])); /* one fp32 add: exact match */
        REPORT("add n=%lld: max_abs 0 (bit-exact)", (long long)n);
        free(y);
        free(x);
        free(y0);
    }
    duet_kernels_destroy(k);
}

Test(kernels_cpu, embed, .timeout = 10)
{
    duet_kernels_t *k = pool_make(3);
    const int64_t V = 1000, D = 129;
    for (int dt = 0; dt < 3; dt++) {
        double *wide;
        void *td = make_weights((duet_dtype_t)dt, V * D, 1.0f, &wide);
        duet_tensor_t table = {.data = td, .dtype = (duet_dtype_t)dt, .ndim = 2, .shape = {V, D}};
        for (int64_t n_ids = 1; n_ids <= 1024; n_ids *= 4) {
            int32_t *ids = malloc((size_t)n_ids * sizeof(*ids));
            float *out = malloc((size_t)(n_ids * D) * sizeof(*out));
            for (int64_t t = 0; t < n_ids; t++)
                ids[t] = (int32_t)(t == 0 ? V - 1 : rng_u32() % V);
            duet_k_embed(k, out, &table, ids, n_ids);
            for (int64_t t = 0; t < n_ids; t++)
                for (int64_t i = 0; i < D; i++)
                    CHECK(((double)out[t * D + i]) == (wide[ids[t] * D + i]));
            free(ids);
            free(out);
        }
        REPORT("embed %s: exact", duet_dtype_name(table.dtype));
        free(td);
        free(wide);
    }
    duet_kernels_destroy(k);
}
