/*
 * duet-bench-splitkv: the CPU's MLA decode attention (kernels/cpu/cpu_mla.h) on a skewed batch
 * against a balanced one (issue 38). Kimi-Linear-48B's MLA dimensions (32 heads, kv_lora_rank
 * 512, qk_rope_head_dim 64, fp32 cache, 128-token pages), one query row per item:
 *
 *   skewed    one item of --long positions (32768) beside 63 of --short (256)
 *   balanced  64 items sharing the same total positions evenly
 *
 * each under the three plans of kernels/splitkv.h: per_request (what the engine runs), uniform
 * (one split count for the step, from the item count and the longest item: the rule the CUDA
 * kernel used before) and none (every item whole). Every thread of the machine (--threads to
 * change it); median of --reps calls of one layer's attention. The outputs of all plans are
 * compared bit for bit (the plan must not change them).
 *
 *   duet-bench-splitkv [--quick] [--reps N] [--threads N] [--long N] [--short N]
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/version.h"
#include "kernels/cpu/cpu_mla.h"
#include "kernels/kernels.h"

#define NH    32
#define R     512
#define DR    64
#define PT    128
#define ITEMS 64

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static uint64_t rng = 0x2545f4914f6cdd1dull;
static float rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((rng >> 40) & 0xffffff) / 16777216.0f - 0.5f;
}

typedef struct {
    int64_t row0[ITEMS + 1], pos0[ITEMS];
    int32_t *pages[ITEMS];
    int32_t *page_ids;
    float *kv, *qhat, *qr, *lat;
    duet_kv_layout_t layout;
} batch_t;

static int batch_make(batch_t *b, const int64_t *lens)
{
    memset(b, 0, sizeof(*b));
    int64_t n_pages = 0;
    for (int i = 0; i < ITEMS; i++) {
        b->row0[i + 1] = i + 1;
        b->pos0[i] = lens[i] - 1;
        n_pages += (lens[i] + PT - 1) / PT;
    }
    b->layout = (duet_kv_layout_t){.page_tokens = PT, .n_layers = 1, .token_bytes = (R + DR) * 4};
    b->kv = malloc((size_t)(n_pages * PT * (R + DR)) * sizeof(float));
    b->page_ids = malloc((size_t)n_pages * sizeof(int32_t));
    b->qhat = malloc((size_t)(ITEMS * NH * R) * sizeof(float));
    b->qr = malloc((size_t)(ITEMS * NH * DR) * sizeof(float));
    b->lat = malloc((size_t)(ITEMS * NH * R) * sizeof(float));
    if (b->kv == NULL || b->page_ids == NULL || b->qhat == NULL || b->qr == NULL || b->lat == NULL)
        return -1;
    for (int64_t x = 0; x < n_pages * PT * (R + DR); x++)
        b->kv[x] = rnd();
    for (int64_t x = 0; x < ITEMS * NH * R; x++)
        b->qhat[x] = rnd();
    for (int64_t x = 0; x < ITEMS * NH * DR; x++)
        b->qr[x] = rnd();
    for (int64_t p = 0; p < n_pages; p++)
        b->page_ids[p] = (int32_t)p;
    int64_t used = 0;
    for (int i = 0; i < ITEMS; i++) {
        b->pages[i] = b->page_ids + used;
        used += (lens[i] + PT - 1) / PT;
    }
    return 0;
}

static void batch_free(batch_t *b)
{
    free(b->kv);
    free(b->page_ids);
    free(b->qhat);
    free(b->qr);
    free(b->lat);
}

/* Median seconds of reps plans + calls under `mode` (the engine plans once per step, then runs
 * each MLA layer); the output stays in b->lat. */
static double run(duet_kernels_t *k, batch_t *b, duet_splitkv_mode_t mode, int reps, float *scratch,
                  int64_t per, int *max_splits)
{
    const duet_cpu_step_t st = {.n_items = ITEMS,
                                .n_rows = ITEMS,
                                .item_row0 = b->row0,
                                .item_pos0 = b->pos0,
                                .item_pages = (const int32_t *const *)b->pages};
    const duet_cpu_mla_layer_t ly = {
        .kv_base = b->kv, .layout = b->layout, .layer = 0, .n_heads = NH, .r = R, .dr = DR};
    duet_cpu_mla_ws_t ws = {.mode = mode};
    double t[64];
    for (int i = -1; i < reps; i++) { /* one warm-up call */
        const double t0 = now_s();
        if (duet_cpu_mla_plan(k, &st, NH, R, &ws) != DUET_OK) { /* timed with the attention */
            fprintf(stderr, "duet-bench-splitkv: %s\n", duet_error_last());
            exit(1);
        }
        duet_cpu_mla_attend(k, &st, &ly, b->qhat, b->qr, NH * DR, DR, 0.0625f, b->lat, NULL,
                            scratch, per, &ws);
        if (i >= 0)
            t[i] = now_s() - t0;
    }
    *max_splits = 0;
    for (int i = 0; i < ITEMS; i++)
        *max_splits = ws.plan.splits[i] > *max_splits ? ws.plan.splits[i] : *max_splits;
    duet_cpu_mla_ws_free(&ws);
    qsort(t, (size_t)reps, sizeof(double), cmp_double);
    return t[reps / 2];
}

static long arg_long(const char *flag, const char *v, long lo, long hi)
{
    char *end = NULL;
    long x = v != NULL ? strtol(v, &end, 10) : 0;
    if (v == NULL || *end != '\0' || x < lo || x > hi) {
        fprintf(stderr, "duet-bench-splitkv: %s wants an integer in [%ld, %ld]\n", flag, lo, hi);
        exit(2);
    }
    return x;
}

int main(int argc, char **argv)
{
    int reps = 15, threads = 0;
    long long_len = 32768, short_len = 256;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            printf("usage: duet-bench-splitkv [--quick] [--reps N] [--threads N] [--long N] "
                   "[--short N]\n"
                   "MLA decode attention on the CPU (Kimi-Linear-48B's MLA dimensions, one row\n"
                   "per item) of one item of --long positions (32768) beside 63 of --short\n"
                   "(256), against 64 items sharing those positions evenly, under the plans\n"
                   "per_request, uniform and none (kernels/splitkv.h); median of --reps (15)\n"
                   "calls on --threads (all online CPUs). Prints a markdown table. --quick:\n"
                   "--long 4096, 3 reps.\n");
            return 0;
        }
        if (strcmp(a, "--version") == 0) {
            duet_version_print("duet-bench-splitkv");
            return 0;
        }
        if (strcmp(a, "--quick") == 0) {
            long_len = 4096;
            reps = 3;
        } else if (strcmp(a, "--reps") == 0) {
            reps = (int)arg_long(a, v, 1, 64);
            i++;
        } else if (strcmp(a, "--threads") == 0) {
            threads = (int)arg_long(a, v, 1, 4096);
            i++;
        } else if (strcmp(a, "--long") == 0) {
            long_len = arg_long(a, v, 1, 1 << 20);
            i++;
        } else if (strcmp(a, "--short") == 0) {
            short_len = arg_long(a, v, 1, 1 << 20);
            i++;
        } else {
            fprintf(stderr, "duet-bench-splitkv: unknown argument %s (try --help)\n", a);
            return 2;
        }
    }
    duet_kernels_t *k = NULL;
    if (duet_kernels_create(DUET_DEVICE_CPU, threads, &k) != DUET_OK) {
        fprintf(stderr, "duet-bench-splitkv: %s\n", duet_error_last());
        return 1;
    }
    const int nthr = duet_kernels_n_threads(k);
    int64_t skew[ITEMS], even[ITEMS];
    const int64_t total = long_len + (ITEMS - 1) * short_len;
    for (int i = 0; i < ITEMS; i++) {
        skew[i] = i == 0 ? long_len : short_len;
        even[i] = total / ITEMS + (i < total % ITEMS);
    }
    const int64_t per = duet_cpu_mla_scratch_floats(NH, R);
    float *scratch = malloc((size_t)(nthr * per) * sizeof(float));
    static const char *const mode_name[] = {"per_request", "uniform", "none"};
    double t[2][3];
    int splits[2][3];
    batch_t b[2];
    if (scratch == NULL || batch_make(&b[0], skew) != 0 || batch_make(&b[1], even) != 0) {
        fprintf(stderr, "duet-bench-splitkv: out of memory\n");
        return 1;
    }
    const size_t out_bytes = (size_t)(ITEMS * NH * R) * sizeof(float);
    float *ref = malloc(out_bytes);
    for (int bi = 0; bi < 2; bi++)
        for (int m = 0; m < 3; m++) {
            t[bi][m] = run(k, &b[bi], (duet_splitkv_mode_t)m, reps, scratch, per, &splits[bi][m]);
            if (m == 0)
                memcpy(ref, b[bi].lat, out_bytes);
            else if (memcmp(ref, b[bi].lat, out_bytes) != 0) {
                fprintf(stderr, "duet-bench-splitkv: plan %s changed the output\n", mode_name[m]);
                return 1;
            }
        }
    printf("MLA decode attention, %d threads, 64 items x 1 row, 32 heads, r 512 + 64, fp32, "
           "%lld positions in all; median of %d calls (ms)\n\n",
           nthr, (long long)total, reps);
    printf("| plan | skewed (1 x %ld + 63 x %ld) ms | most splits | balanced (64 x ~%lld) ms | "
           "most splits | skewed / balanced |\n| --- | ---: | ---: | ---: | ---: | ---: |\n",
           long_len, short_len, (long long)(total / ITEMS));
    for (int m = 0; m < 3; m++)
        printf("| %s | %.2f | %d | %.2f | %d | %.2f |\n", mode_name[m], t[0][m] * 1e3, splits[0][m],
               t[1][m] * 1e3, splits[1][m], t[0][m] / t[1][m]);
    printf("\nskewed, per_request against uniform: %.2fx; against none: %.2fx\n", t[0][0] / t[0][1],
           t[0][0] / t[0][2]);
    free(ref);
    free(scratch);
    batch_free(&b[0]);
    batch_free(&b[1]);
    duet_kernels_destroy(k);
    return 0;
}
