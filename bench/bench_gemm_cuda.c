/*
 * bench_gemm_cuda.c (duet-bench-gemm-cuda): TFLOP/s of the cuBLASLt GEMM (kernels/cuda) for
 * prefill-sized products, and device-to-device copy bandwidth, on the first CUDA device.
 *
 * Shapes are Kimi-Linear-48B-A3B's projections (tests/unit/data/kimi_linear_48b_hub.json:
 * hidden 2304, 32 heads, head_dim 128, MLA q 32·(128+64), dense intermediate 9216, expert
 * intermediate 1024) times M = 2048 and 8192 tokens, plus square 4096 and 8192 for reference.
 * Two columns per shape: "gemm" is cuBLASLt alone on x already in bf16
 * (duet_cuda_gemm_matmul_lowp), "+cvt" includes the fp32 -> bf16 conversion of x that
 * duet_cuda_gemm_matmul does first (the engine's activations are fp32). FLOPs = 2·M·N·K.
 * Each figure is the mean over a timed loop of at least --min-ms (default 100) after warm-up,
 * timed with CUDA events on one stream.
 *
 * Copy bandwidth counts bytes read + written (2 × size) per cudaMemcpyAsync D2D.
 * Without a CUDA device it prints "no CUDA device" and exits 0, so CI can run it.
 */
#include <float.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/config.h"
#include "common/version.h"
#include "kernels/cuda/cuda_gemm.h"
#include "kernels/kernels.h"

#define CUDA_CHECK(call)                                                                           \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

typedef struct {
    int64_t N, K;
    const char *what;
} shape_t;

static const shape_t SHAPES[] = {
    {2304, 2304, "square D"},           {1024, 2304, "expert gate/up (I=1024)"},
    {4096, 2304, "KDA q/k/v (32x128)"}, {6144, 2304, "MLA q (32x192)"},
    {2304, 4096, "attn o_proj"},        {9216, 2304, "dense gate/up"},
    {2304, 9216, "dense down"},         {4096, 4096, "square 4096"},
    {8192, 8192, "square 8192"},
};
static const int64_t MS[] = {2048, 8192};

typedef struct {
    duet_cuda_gemm_t *g;
    cudaStream_t s;
    float *y, *x;
    void *xb;
    duet_tensor_t w;
    int64_t M;
    int convert;
} job_t;

static void job_run(const job_t *j)
{
    duet_status_t st;
    if (j->convert)
        st = duet_cuda_gemm_matmul(j->g, j->s, j->y, j->w.shape[0], j->x, j->w.shape[1], j->M,
                                   &j->w, 0, 0);
    else
        st = duet_cuda_gemm_matmul_lowp(j->g, j->s, j->y, j->w.shape[0], j->xb, j->w.shape[1], j->M,
                                        &j->w, 0, 0);
    if (st != DUET_OK) {
        fprintf(stderr, "gemm failed: %s: %s\n", duet_status_name(st), duet_error_last());
        exit(1);
    }
}

typedef struct {
    void *dst;
    const void *src;
    size_t bytes;
    cudaStream_t s;
} copy_t;

static void copy_run(const void *ctx)
{
    const copy_t *c = ctx;
    CUDA_CHECK(cudaMemcpyAsync(c->dst, c->src, c->bytes, cudaMemcpyDeviceToDevice, c->s));
}

static void job_run_cb(const void *ctx)
{
    job_run(ctx);
}

/* Mean milliseconds per fn(ctx) queued on s, over a loop of at least min_ms after warm-up. */
static double time_loop(void (*fn)(const void *), const void *ctx, cudaStream_t s, double min_ms)
{
    cudaEvent_t a, b;
    CUDA_CHECK(cudaEventCreate(&a));
    CUDA_CHECK(cudaEventCreate(&b));
    for (int i = 0; i < 3; i++)
        fn(ctx);
    float ms = 0;
    int iters = 1;
    for (;;) {
        CUDA_CHECK(cudaEventRecord(a, s));
        for (int i = 0; i < iters; i++)
            fn(ctx);
        CUDA_CHECK(cudaEventRecord(b, s));
        CUDA_CHECK(cudaEventSynchronize(b));
        CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
        if (ms >= min_ms || iters >= 1 << 16)
            break;
        iters = ms <= 0 ? iters * 16 : (int)(iters * (min_ms * 1.2 / ms)) + 1;
    }
    CUDA_CHECK(cudaEventDestroy(a));
    CUDA_CHECK(cudaEventDestroy(b));
    return ms / iters;
}

int main(int argc, char **argv)
{
    double min_ms = 100;
    for (int i = 1; i < argc; i++) {
        if (duet_version_flag(argv[i])) {
            duet_version_print("duet-bench-gemm-cuda");
            return 0;
        }
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            printf(
                "usage: duet-bench-gemm-cuda [--min-ms MS]\n"
                "TFLOP/s of the cuBLASLt bf16 GEMM at Kimi-Linear-48B's prefill shapes (with and\n"
                "without the fp32 -> bf16 conversion of x) and device-to-device copy bandwidth,\n"
                "on the first CUDA device. Each figure is the mean of a timed loop of at least\n"
                "MS milliseconds (default 100). Without a device it says so and exits 0.\n");
            return 0;
        }
        if (strcmp(argv[i], "--min-ms") == 0 && i + 1 < argc) {
            if (duet_config_parse_float(argv[++i], DBL_TRUE_MIN, 1e6, &min_ms) != DUET_OK) {
                fprintf(stderr, "duet-bench-gemm-cuda: bad value '%s' for --min-ms\n", argv[i]);
                return 2;
            }
        } else {
            fprintf(stderr, "duet-bench-gemm-cuda: unknown option %s (see --help)\n", argv[i]);
            return 2;
        }
    }
    if (duet_cuda_device_count() == 0) {
        printf("no CUDA device\n");
        return 0;
    }
    struct cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s, %d SMs, %.1f GiB\n", prop.name, prop.multiProcessorCount,
           (double)prop.totalGlobalMem / (1 << 30));

    /* One allocation per operand at the largest size; every shape uses a prefix. */
    int64_t max_mk = 0, max_mn = 0, max_nk = 0;
    for (size_t si = 0; si < sizeof(SHAPES) / sizeof(SHAPES[0]); si++) {
        int64_t m = MS[sizeof(MS) / sizeof(MS[0]) - 1];
        if (m * SHAPES[si].K > max_mk)
            max_mk = m * SHAPES[si].K;
        if (m * SHAPES[si].N > max_mn)
            max_mn = m * SHAPES[si].N;
        if (SHAPES[si].N * SHAPES[si].K > max_nk)
            max_nk = SHAPES[si].N * SHAPES[si].K;
    }
    duet_cuda_gemm_t *g = NULL;
    duet_status_t st = duet_cuda_gemm_create(0, max_mk, &g);
    if (st != DUET_OK) {
        fprintf(stderr, "create: %s\n", duet_error_last());
        return 1;
    }
    cudaStream_t s;
    CUDA_CHECK(cudaStreamCreate(&s));
    float *x, *y;
    void *xb, *w;
    CUDA_CHECK(cudaMalloc((void **)&x, (size_t)max_mk * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&xb, (size_t)max_mk * 2));
    CUDA_CHECK(cudaMalloc((void **)&y, (size_t)max_mn * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&w, (size_t)max_nk * 2));
    /* Small random-ish values: 0x3c00-range bf16 patterns (|v| < 1) avoid inf/NaN slow paths. */
    uint16_t *hw = malloc((size_t)max_nk * 2);
    float *hx = malloc((size_t)max_mk * sizeof(float));
    if (hw == NULL || hx == NULL)
        return 1;
    uint32_t r = 12345;
    for (int64_t i = 0; i < max_nk; i++) {
        r = r * 1664525u + 1013904223u;
        hw[i] = duet_f32_to_bf16(((float)(r >> 8) / 16777216.0f - 0.5f) * 0.1f);
    }
    for (int64_t i = 0; i < max_mk; i++) {
        r = r * 1664525u + 1013904223u;
        hx[i] = (float)(r >> 8) / 16777216.0f - 0.5f;
    }
    CUDA_CHECK(cudaMemcpy(w, hw, (size_t)max_nk * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(x, hx, (size_t)max_mk * sizeof(float), cudaMemcpyHostToDevice));
    free(hx);
    free(hw);
    st = duet_cuda_convert_from_f32(xb, DUET_DTYPE_BF16, x, max_mk, 1, max_mk, s);
    if (st != DUET_OK) {
        fprintf(stderr, "convert: %s\n", duet_error_last());
        return 1;
    }

    printf("\ncuBLASLt bf16 GEMM, y[M,N] fp32 = x[M,K] bf16 . W[N,K]^T bf16, fp32 accumulate "
           "(min %.0f ms per figure)\n\n",
           min_ms);
    printf("| M | N x K | what | gemm ms | gemm TFLOP/s | +cvt ms | +cvt TFLOP/s |\n");
    printf("|---|---|---|---|---|---|---|\n");
    for (size_t mi = 0; mi < sizeof(MS) / sizeof(MS[0]); mi++) {
        for (size_t si = 0; si < sizeof(SHAPES) / sizeof(SHAPES[0]); si++) {
            job_t j = {.g = g, .s = s, .y = y, .x = x, .xb = xb, .M = MS[mi]};
            j.w = (duet_tensor_t){.data = w,
                                  .dtype = DUET_DTYPE_BF16,
                                  .device = DUET_DEVICE_CUDA,
                                  .ndim = 2,
                                  .shape = {SHAPES[si].N, SHAPES[si].K}};
            double flop = 2.0 * (double)j.M * (double)SHAPES[si].N * (double)SHAPES[si].K;
            double t_raw = time_loop(job_run_cb, &j, s, min_ms);
            j.convert = 1;
            double t_cvt = time_loop(job_run_cb, &j, s, min_ms);
            printf("| %lld | %lld x %lld | %s | %.3f | %.0f | %.3f | %.0f |\n", (long long)j.M,
                   (long long)SHAPES[si].N, (long long)SHAPES[si].K, SHAPES[si].what, t_raw,
                   flop / (t_raw * 1e9), t_cvt, flop / (t_cvt * 1e9));
            fflush(stdout);
        }
    }

    printf("\ndevice-to-device copy (cudaMemcpyAsync D2D), bytes read + written\n\n");
    printf("| size | ms | GB/s |\n|---|---|---|\n");
    static const size_t sizes[] = {(size_t)64 << 20, (size_t)256 << 20, (size_t)1 << 30};
    void *src, *dst;
    CUDA_CHECK(cudaMalloc(&src, sizes[2]));
    CUDA_CHECK(cudaMalloc(&dst, sizes[2]));
    CUDA_CHECK(cudaMemset(src, 1, sizes[2]));
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        copy_t c = {.dst = dst, .src = src, .bytes = sizes[i], .s = s};
        double t = time_loop(copy_run, &c, s, min_ms);
        printf("| %zu MiB | %.3f | %.0f |\n", sizes[i] >> 20, t,
               2.0 * (double)sizes[i] / (t * 1e6));
    }
    CUDA_CHECK(cudaFree(dst));
    CUDA_CHECK(cudaFree(src));
    CUDA_CHECK(cudaFree(w));
    CUDA_CHECK(cudaFree(y));
    CUDA_CHECK(cudaFree(xb));
    CUDA_CHECK(cudaFree(x));
    CUDA_CHECK(cudaStreamDestroy(s));
    duet_cuda_gemm_destroy(g);
    return 0;
}
