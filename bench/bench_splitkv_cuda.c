/*
 * bench_splitkv_cuda.c (duet-bench-splitkv-cuda): the CUDA MLA decode attention (kernels/cuda/
 * cuda_mla.h, one layer) on a skewed batch against a balanced one, under each split-KV plan
 * (issue 44; the CPU's is duet-bench-splitkv).
 *
 * Kimi-Linear-48B's MLA shape: 32 heads, kv_lora_rank 512, qk_rope_head_dim 64, BF16 KV in pages
 * of 64 positions. Batches of 64 decode items (one query row each): skewed = one item of
 * --long positions (default 131072) beside 63 of --short (2048); balanced = the same total KV
 * spread evenly over the 64 items. Plans: per_request (what the engine runs: each item its own
 * split count), uniform (one count for the step, from the item count and the longest item: the
 * per-step split the engine had before), none. Each figure is the planner plus the attention,
 * the mean over a timed loop of at least --min-ms (default 200) after warm-up, best of --rounds
 * (default 3) loops, CUDA events on one stream. The KV and queries are random (the attention's
 * cost does not depend on the values). Without a CUDA device it prints "no CUDA device" and exits
 * 0, so CI can run it.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "common/version.h"
#include "kernels/cuda/cuda_mla.h"
#include "kernels/splitkv.h"

/* The planner's mode hook (kernels/cuda/mla.cu; the engine always plans per request). */
void duet__cuda_mla_plan_mode(int mode);

#define CUDA_CHECK(call)                                                                           \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)
#define DUET_CHECK(call)                                                                           \
    do {                                                                                           \
        if ((call) != DUET_OK) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, duet_error_last());      \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

enum { ITEMS = 64, HEADS = 32, R = 512, DR = 64, PAGE = 64 };

static const struct {
    duet_splitkv_mode_t mode;
    const char *name;
} PLANS[] = {{DUET_SPLITKV_PER_REQUEST, "per_request"},
             {DUET_SPLITKV_UNIFORM, "uniform"},
             {DUET_SPLITKV_NONE, "none"}};

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint32_t rng_u32(void)
{
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 32);
}
static float rng_f(void)
{
    return (float)(rng_u32() >> 8) / (float)(1u << 24) - 0.5f;
}

/* One batch on the device: its step metadata, pages laid out item after item. */
typedef struct {
    int64_t lens[ITEMS];
    int64_t pages; /* pages the batch uses */
    duet_cuda_step_t st;
    void *d_meta;
} batch_t;

static void batch_make(batch_t *b, const int64_t *lens)
{
    memcpy(b->lens, lens, sizeof(b->lens));
    int32_t max_pages = 0;
    b->pages = 0;
    for (int i = 0; i < ITEMS; i++) {
        const int32_t np = (int32_t)((lens[i] + PAGE - 1) / PAGE);
        max_pages = np > max_pages ? np : max_pages;
        b->pages += np;
    }
    /* host copies of the arrays, one device allocation for them all */
    const size_t n_i32 =
        (ITEMS + 1) + ITEMS + ITEMS + (size_t)ITEMS * (size_t)max_pages + ITEMS + ITEMS;
    int32_t *h = calloc(n_i32, sizeof(int32_t));
    int32_t *row0 = h, *pos0 = row0 + ITEMS + 1, *slot = pos0 + ITEMS, *pg = slot + ITEMS,
            *ritem = pg + (size_t)ITEMS * max_pages, *rpos = ritem + ITEMS;
    int32_t next = 0;
    for (int i = 0; i < ITEMS; i++) {
        row0[i] = i;
        pos0[i] = (int32_t)(lens[i] - 1); /* one new row: the last position */
        ritem[i] = i;
        rpos[i] = (int32_t)(lens[i] - 1);
        const int32_t np = (int32_t)((lens[i] + PAGE - 1) / PAGE);
        for (int32_t p = 0; p < np; p++)
            pg[(size_t)i * max_pages + p] = next++;
    }
    row0[ITEMS] = ITEMS;
    CUDA_CHECK(cudaMalloc(&b->d_meta, n_i32 * sizeof(int32_t)));
    CUDA_CHECK(cudaMemcpy(b->d_meta, h, n_i32 * sizeof(int32_t), cudaMemcpyHostToDevice));
    int32_t *d = b->d_meta;
    b->st = (duet_cuda_step_t){.n_items = ITEMS,
                               .n_rows = ITEMS,
                               .max_item_tokens = 1,
                               .max_split_rows = 1,
                               .item_row0 = d,
                               .item_pos0 = d + (pos0 - h),
                               .item_slot = d + (slot - h),
                               .item_pages = d + (pg - h),
                               .max_pages = max_pages,
                               .row_item = d + (ritem - h),
                               .row_pos = d + (rpos - h)};
    free(h);
}

/* Mean milliseconds of plan + attend over a loop of at least min_ms, best of `rounds`. */
static double time_step(const batch_t *b, const duet_cuda_mla_layer_t *ly, const float *qhat,
                        const float *qr, float *lat, void *scratch, size_t bytes, double min_ms,
                        int rounds, cudaStream_t s)
{
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    const float scale = 1.0f / 13.856f; /* 1/sqrt(192), Kimi's q·k head dim */
    double best = 1e30;
    int reps = 4;
    for (int w = 0; w < 3; w++) { /* warm-up, and a loop long enough for min_ms */
        CUDA_CHECK(cudaEventRecord(e0, s));
        for (int k = 0; k < reps; k++) {
            DUET_CHECK(duet_cuda_mla_plan(s, &b->st, ly, scratch, bytes));
            DUET_CHECK(duet_cuda_mla_attend(s, &b->st, ly, qhat, qr, HEADS * DR, DR, scale, lat,
                                            scratch, bytes));
        }
        CUDA_CHECK(cudaEventRecord(e1, s));
        CUDA_CHECK(cudaEventSynchronize(e1));
        float ms = 0;
        CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
        if (ms < min_ms)
            reps = (int)((double)reps * min_ms / (ms > 0.01 ? ms : 0.01)) + 1;
    }
    for (int r = 0; r < rounds; r++) {
        CUDA_CHECK(cudaEventRecord(e0, s));
        for (int k = 0; k < reps; k++) {
            DUET_CHECK(duet_cuda_mla_plan(s, &b->st, ly, scratch, bytes));
            DUET_CHECK(duet_cuda_mla_attend(s, &b->st, ly, qhat, qr, HEADS * DR, DR, scale, lat,
                                            scratch, bytes));
        }
        CUDA_CHECK(cudaEventRecord(e1, s));
        CUDA_CHECK(cudaEventSynchronize(e1));
        float ms = 0;
        CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
        best = ms / reps < best ? ms / reps : best;
    }
    CUDA_CHECK(cudaEventDestroy(e0));
    CUDA_CHECK(cudaEventDestroy(e1));
    return best;
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: duet-bench-splitkv-cuda [--long N] [--short N] [--min-ms MS] [--rounds N]\n"
            "  the CUDA MLA decode attention at Kimi-Linear-48B's shape: 64 items, one of\n"
            "  --long positions (default 131072) beside 63 of --short (2048), against the\n"
            "  same KV spread evenly; per_request / uniform / none plans. JSON lines on stdout,\n"
            "  a table on stderr.\n");
}

int main(int argc, char **argv)
{
    int64_t lg = 131072, sh = 2048;
    double min_ms = 200;
    int rounds = 3;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        char *end = NULL;
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout);
            return 0;
        }
        if (strcmp(a, "--version") == 0) {
            duet_version_print("duet-bench-splitkv-cuda");
            return 0;
        }
        if (v == NULL) {
            fprintf(stderr, "duet-bench-splitkv-cuda: unknown or incomplete option %s\n", a);
            usage(stderr);
            return 2;
        }
        i++;
        if (strcmp(a, "--long") == 0)
            lg = strtoll(v, &end, 10);
        else if (strcmp(a, "--short") == 0)
            sh = strtoll(v, &end, 10);
        else if (strcmp(a, "--min-ms") == 0)
            min_ms = strtod(v, &end);
        else if (strcmp(a, "--rounds") == 0)
            rounds = (int)strtol(v, &end, 10);
        else {
            fprintf(stderr, "duet-bench-splitkv-cuda: unknown option %s\n", a);
            usage(stderr);
            return 2;
        }
        if (end == v || *end != '\0' || lg < 1 || sh < 1 || lg > (1 << 24) || sh > (1 << 24) ||
            min_ms <= 0 || min_ms > 1e5 || rounds < 1 || rounds > 100) {
            fprintf(stderr, "duet-bench-splitkv-cuda: bad value %s for %s\n", v, a);
            return 2;
        }
    }
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
        printf("no CUDA device\n");
        return 0;
    }
    struct cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    int64_t skew[ITEMS], even[ITEMS], total = lg + (ITEMS - 1) * sh;
    skew[0] = lg;
    for (int i = 1; i < ITEMS; i++)
        skew[i] = sh;
    for (int i = 0; i < ITEMS; i++) /* the same total, the remainder on the first items */
        even[i] = total / ITEMS + (i < total % ITEMS);
    batch_t bs, be;
    batch_make(&bs, skew);
    batch_make(&be, even);
    const int64_t pages = bs.pages > be.pages ? bs.pages : be.pages;
    const size_t page_bytes = (size_t)PAGE * (R + DR) * 2; /* BF16 */
    void *kv;
    CUDA_CHECK(cudaMalloc(&kv, (size_t)pages * page_bytes));
    { /* random BF16 (the top halves of random floats), one page pattern repeated */
        uint16_t *h = malloc(page_bytes);
        for (size_t i = 0; i < page_bytes / 2; i++) {
            const float f = rng_f();
            uint32_t u;
            memcpy(&u, &f, 4);
            h[i] = (uint16_t)(u >> 16);
        }
        for (int64_t p = 0; p < pages; p++)
            CUDA_CHECK(cudaMemcpy((char *)kv + (size_t)p * page_bytes, h, page_bytes,
                                  cudaMemcpyHostToDevice));
        free(h);
    }
    const size_t nq = (size_t)ITEMS * HEADS * R, nr = (size_t)ITEMS * HEADS * DR;
    float *h = malloc(sizeof(float) * nq), *qhat, *qr, *lat;
    for (size_t i = 0; i < nq; i++)
        h[i] = rng_f();
    CUDA_CHECK(cudaMalloc((void **)&qhat, sizeof(float) * nq));
    CUDA_CHECK(cudaMalloc((void **)&qr, sizeof(float) * nr));
    CUDA_CHECK(cudaMalloc((void **)&lat, sizeof(float) * nq));
    CUDA_CHECK(cudaMemcpy(qhat, h, sizeof(float) * nq, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(qr, h, sizeof(float) * nr, cudaMemcpyHostToDevice));
    free(h);
    const duet_cuda_mla_layer_t ly = {.kv_base = kv,
                                      .kv_dtype = DUET_DTYPE_BF16,
                                      .kv_n_layers = 1,
                                      .page_tokens = PAGE,
                                      .layer = 0,
                                      .n_heads = HEADS,
                                      .r = R,
                                      .dr = DR};
    const size_t bytes = duet_cuda_mla_scratch_bytes(&ly, ITEMS, ITEMS, 1);
    void *scratch;
    CUDA_CHECK(cudaMalloc(&scratch, bytes));
    cudaStream_t s;
    CUDA_CHECK(cudaStreamCreate(&s));
    fprintf(stderr,
            "duet-bench-splitkv-cuda %s on %s (%d SMs): 64 decode items, skewed = 1 x %lld + 63 x "
            "%lld positions, balanced = %lld each (%lld positions in all), BF16 KV\n",
            duet_version_string(), prop.name, prop.multiProcessorCount, (long long)lg,
            (long long)sh, (long long)(total / ITEMS), (long long)total);
    fprintf(stderr, "| plan | skewed ms | balanced ms | skewed / balanced |\n|---|---|---|---|\n");
    for (size_t p = 0; p < sizeof(PLANS) / sizeof(PLANS[0]); p++) {
        duet__cuda_mla_plan_mode(PLANS[p].mode);
        const double ts = time_step(&bs, &ly, qhat, qr, lat, scratch, bytes, min_ms, rounds, s);
        const double tb = time_step(&be, &ly, qhat, qr, lat, scratch, bytes, min_ms, rounds, s);
        fprintf(stderr, "| %s | %.4f | %.4f | %.2f |\n", PLANS[p].name, ts, tb, ts / tb);
        printf("{\"plan\":\"%s\",\"long\":%lld,\"short\":%lld,\"skewed_ms\":%.5f,"
               "\"balanced_ms\":%.5f,\"ratio\":%.4f,\"kv_bytes\":%lld}\n",
               PLANS[p].name, (long long)lg, (long long)sh, ts, tb, ts / tb,
               (long long)((size_t)total * (R + DR) * 2));
    }
    duet__cuda_mla_plan_mode(DUET_SPLITKV_PER_REQUEST);
    cudaFree(scratch);
    cudaFree(kv);
    cudaFree(qhat);
    cudaFree(qr);
    cudaFree(lat);
    cudaFree(bs.d_meta);
    cudaFree(be.d_meta);
    cudaStreamDestroy(s);
    return 0;
}
