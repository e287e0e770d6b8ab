/*
 * bench_kernels.c: duet-bench-kernels, GFLOP/s of the CPU matmul on the shapes that matter.
 *
 * Decode shapes (M = 1, 8, 64) and prefill shapes (M = 512) for the projection sizes of the demo
 * and 48B models ((N, K) in {(2304, 2304), (9216, 2304), (2304, 9216), (4096, 2304)}), F32 and
 * BF16 weights, one thread and all threads. For M = 1 it also prints the weight bandwidth
 * (bytes of W / time), since decode reads every weight once per call and is memory-bound. One
 * shape is also run through a naive triple loop to report the speed-up.
 *
 * Usage: duet-bench-kernels [--threads N] [--quick] [--min-ms MS]
 */
#include <float.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/config.h"
#include "common/version.h"
#include "kernels/kernels.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t rng = 88172645463325252ull;

static float rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)(rng >> 40) / 16777216.0f - 0.5f;
}

typedef struct {
    int64_t N, K;
} nk_t;

/* Seconds per call: best of repeated batches lasting at least min_ms in total. */
static double time_matmul(duet_kernels_t *k, float *y, const float *x, int64_t M,
                          const duet_tensor_t *w, double min_s)
{
    int64_t N = w->shape[0], K = w->shape[1];
    duet_k_matmul(k, y, N, x, K, M, w, 0); /* warm caches, wake the pool */
    double best = 1e30, total = 0;
    int reps = 0;
    while (total < min_s || reps < 3) {
        double t0 = now_s();
        duet_k_matmul(k, y, N, x, K, M, w, 0);
        double dt = now_s() - t0;
        if (dt < best)
            best = dt;
        total += dt;
        reps++;
    }
    return best;
}

static void naive_matmul(float *y, const float *x, const float *w, int64_t M, int64_t N, int64_t K)
{
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++)
                s += x[m * K + k] * w[n * K + k];
            y[m * N + n] = s;
        }
}

int main(int argc, char **argv)
{
    int max_threads = 0, quick = 0;
    double min_s = 0.3;
    for (int i = 1; i < argc; i++) {
        if (duet_version_flag(argv[i])) {
            duet_version_print("duet-bench-kernels");
            return 0;
        }
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            printf("usage: duet-bench-kernels [--threads N] [--quick] [--min-ms MS]\n"
                   "GFLOP/s of the CPU backend's matmul (kernels/cpu) at the demo and 48B models'\n"
                   "projection shapes for M = 1, 8, 64 and 512 rows, F32 and BF16 weights, on one\n"
                   "thread and on N (default: the backend's count, every core); weight bandwidth\n"
                   "at M = 1, and one shape against a naive loop. --quick: one shape; MS: the\n"
                   "least time per figure (default 300).\n");
            return 0;
        }
        if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
            int64_t t = 0;
            if (duet_config_parse_int(argv[++i], 1, 4096, &t) != DUET_OK) {
                fprintf(stderr, "duet-bench-kernels: bad value '%s' for --threads\n", argv[i]);
                return 2;
            }
            max_threads = (int)t;
        } else if (strcmp(argv[i], "--quick") == 0) {
            quick = 1;
        } else if (strcmp(argv[i], "--min-ms") == 0 && i + 1 < argc) {
            double ms = 0.0;
            if (duet_config_parse_float(argv[++i], DBL_TRUE_MIN, 1e6, &ms) != DUET_OK) {
                fprintf(stderr, "duet-bench-kernels: bad value '%s' for --min-ms\n", argv[i]);
                return 2;
            }
            min_s = ms / 1000.0;
        } else {
            fprintf(stderr, "duet-bench-kernels: unknown option %s (see --help)\n", argv[i]);
            return 2;
        }
    }

    static const nk_t nks[] = {{2304, 2304}, {9216, 2304}, {2304, 9216}, {4096, 2304}};
    static const int64_t ms[] = {1, 8, 64, 512};
    const int n_nk = quick ? 1 : (int)(sizeof(nks) / sizeof(nks[0]));
    int64_t max_n = 9216, max_k = 9216, max_m = 512;
    float *x = malloc((size_t)(max_m * max_k) * sizeof(float));
    float *y = malloc((size_t)(max_m * max_n) * sizeof(float));
    float *wf = malloc((size_t)(max_n * 2304) * sizeof(float) * 1);
    uint16_t *wb = malloc((size_t)(max_n * 2304) * sizeof(uint16_t));
    if (x == NULL || y == NULL || wf == NULL || wb == NULL) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    for (int64_t i = 0; i < max_m * max_k; i++)
        x[i] = rnd();
    for (int64_t i = 0; i < max_n * 2304; i++) {
        wf[i] = rnd() * 0.1f;
        wb[i] = duet_f32_to_bf16(wf[i]);
    }

    duet_kernels_t *k1 = NULL, *kn = NULL;
    if (duet_kernels_create(DUET_DEVICE_CPU, 1, &k1) != DUET_OK ||
        duet_kernels_create(DUET_DEVICE_CPU, max_threads, &kn) != DUET_OK) {
        fprintf(stderr, "kernels: %s\n", duet_error_last());
        return 1;
    }
    int nt = duet_kernels_n_threads(kn);
    printf("duet-bench-kernels: matmul y[M,N] = x[M,K] W[N,K]^T, path %s, threads 1 and %d, "
           "best of >= %.0f ms\n\n",
           duet_kernels_cpu_isa(kn), nt, min_s * 1000);
    printf("%-5s %-6s %-6s %-5s | %9s %9s | %9s %9s | %8s %8s\n", "M", "N", "K", "W", "ms(1t)",
           "GF/s(1t)", "ms(Nt)", "GF/s(Nt)", "GB/s(1t)", "GB/s(Nt)");
    printf("------------------------------+---------------------+---------------------+---------"
           "--------\n");
    for (int mi = 0; mi < (int)(sizeof(ms) / sizeof(ms[0])); mi++) {
        for (int s = 0; s < n_nk; s++) {
            int64_t M = ms[mi], N = nks[s].N, K = nks[s].K;
            for (int dt = 0; dt < 2; dt++) {
                duet_tensor_t w = {.data = dt == 0 ? (void *)wf : (void *)wb,
                                   .dtype = dt == 0 ? DUET_DTYPE_F32 : DUET_DTYPE_BF16,
                                   .device = DUET_DEVICE_CPU,
                                   .ndim = 2,
                                   .shape = {N, K}};
                double flops = 2.0 * (double)M * (double)N * (double)K;
                double bytes = (double)N * (double)K * (double)duet_dtype_size(w.dtype);
                double t1 = time_matmul(k1, y, x, M, &w, min_s);
                double tn = time_matmul(kn, y, x, M, &w, min_s);
                printf("%-5lld %-6lld %-6lld %-5s | %9.3f %9.1f | %9.3f %9.1f |", (long long)M,
                       (long long)N, (long long)K, duet_dtype_name(w.dtype), t1 * 1e3,
                       flops / t1 * 1e-9, tn * 1e3, flops / tn * 1e-9);
                if (M == 1)
                    printf(" %8.1f %8.1f", bytes / t1 * 1e-9, bytes / tn * 1e-9);
                printf("\n");
            }
        }
    }

    /* Naive triple loop (fp32, one thread) on one decode and one prefill shape. */
    printf("\nspeed-up over a naive triple loop (F32 weights, 1 thread):\n");
    static const int64_t naive_m[] = {1, 64};
    for (int i = 0; i < 2; i++) {
        int64_t M = naive_m[i], N = 2304, K = 2304;
        duet_tensor_t w = {.data = wf, .dtype = DUET_DTYPE_F32, .ndim = 2, .shape = {N, K}};
        double t0 = now_s();
        int reps = 0;
        do {
            naive_matmul(y, x, wf, M, N, K);
            reps++;
        } while (now_s() - t0 < min_s);
        double tnaive = (now_s() - t0) / reps;
        double t1 = time_matmul(k1, y, x, M, &w, min_s);
        double flops = 2.0 * (double)M * (double)N * (double)K;
        printf("  M=%-3lld N=%lld K=%lld: naive %.3f ms (%.1f GF/s), duet %.3f ms (%.1f GF/s): "
               "%.1fx\n",
               (long long)M, (long long)N, (long long)K, tnaive * 1e3, flops / tnaive * 1e-9,
               t1 * 1e3, flops / t1 * 1e-9, tnaive / t1);
    }

    duet_kernels_destroy(k1);
    duet_kernels_destroy(kn);
    free(x);
    free(y);
    free(wf);
    free(wb);
    return 0;
}
