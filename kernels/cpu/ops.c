/*
 * ops.c: the element-wise and per-row ops of the CPU backend (RMSNorm, gated activations,
 * residual add, embedding gather).
 *
 * These are memory-bound and cheap next to the matmuls around them, so they stay plain loops
 * that the compiler vectorises where IEEE order allows. They go to the pool only when there is
 * enough work to pay for the dispatch (prefill sizes); decode sizes run on the calling thread.
 */
#include <math.h>

#include "common/log.h"
#include "kernels/cpu/cpu_impl.h"

/* Below this many elements an op runs on the calling thread. */
#define DUET__PAR_MIN   65536
#define DUET__PAR_GRAIN 16384

/* Convert n weight elements starting at element `off` of w->data. */
static inline float duet__w_at(const duet_tensor_t *w, int64_t i)
{
    switch (w->dtype) {
    case DUET_DTYPE_F32:
        return ((const float *)w->data)[i];
    case DUET_DTYPE_BF16:
        return duet_bf16_to_f32(((const uint16_t *)w->data)[i]);
    case DUET_DTYPE_F16:
        return duet_f16_to_f32(((const uint16_t *)w->data)[i]);
    }
    return 0.0f;
}

/* ---- rmsnorm ------------------------------------------------------------------------------- */

typedef struct {
    float *y;
    const float *x;
    const duet_tensor_t *w;
    int64_t D;
    float eps;
} duet__rms_t;

static void duet__rms_rows(void *ctx, int64_t begin, int64_t end, int thread_idx)
{
    const duet__rms_t *a = ctx;
    const int64_t D = a->D;
    for (int64_t r = begin; r < end; r++) {
        const float *x = a->x + r * D;
        float *y = a->y + r * D;
        double p[4] = {0.0, 0.0, 0.0, 0.0};
        int64_t i = 0;
        for (; i + 4 <= D; i += 4)
            for (int j = 0; j < 4; j++)
                p[j] += (double)x[i + j] * (double)x[i + j];
        for (; i < D; i++)
            p[0] += (double)x[i] * (double)x[i];
        double ss = (p[0] + p[1]) + (p[2] + p[3]);
        float scale = (float)(1.0 / sqrt(ss / (double)D + (double)a->eps));
        switch (a->w->dtype) {
        case DUET_DTYPE_F32: {
            const float *w = a->w->data;
            for (i = 0; i < D; i++)
                y[i] = w[i] * (x[i] * scale);
            break;
        }
        case DUET_DTYPE_BF16: {
            const uint16_t *w = a->w->data;
            for (i = 0; i < D; i++)
                y[i] = duet_bf16_to_f32(w[i]) * (x[i] * scale);
            break;
        }
        case DUET_DTYPE_F16:
            for (i = 0; i < D; i++)
                y[i] = duet__w_at(a->w, i) * (x[i] * scale);
            break;
        }
    }
}

void duet_k_rmsnorm(duet_kernels_t *k, float *y, const float *x, const duet_tensor_t *w, int64_t M,
                    int64_t D, float eps)
{
    DUET_ASSERT(duet_tensor_numel(w) >= D);
    duet__rms_t a = {.y = y, .x = x, .w = w, .D = D, .eps = eps};
    if (M * D < DUET__PAR_MIN)
        duet__rms_rows(&a, 0, M, 0);
    else
        duet_k_parallel_for(k, M, DUET__PAR_GRAIN / D + 1, duet__rms_rows, &a);
}

/* ---- gated activations --------------------------------------------------------------------- */

typedef struct {
    float *out;
    const float *gate;
    const float *up;
    float beta, beta_lin;
} duet__act_t;

static void duet__silu_range(void *ctx, int64_t begin, int64_t end, int thread_idx)
{
    const duet__act_t *a = ctx;
    for (int64_t i = begin; i < end; i++) {
        float g = a->gate[i];
        a->out[i] = g / (1.0f + expf(-g)) * a->up[i];
    }
}

void duet_k_silu_mul(duet_kernels_t *k, float *out, const float *gate, const float *up, int64_t n)
{
    duet__act_t a = {.out = out, .gate = gate, .up = up};
    if (n < DUET__PAR_MIN)
        duet__silu_range(&a, 0, n, 0);
    else
        duet_k_parallel_for(k, n, DUET__PAR_GRAIN, duet__silu_range, &a);
}

static void duet__situ_range(void *ctx, int64_t begin, int64_t end, int thread_idx)
{
    const duet__act_t *a = ctx;
    const float b = a->beta, bl = a->beta_lin;
    for (int64_t i = begin; i < end; i++) {
        float g = a->gate[i];
        float u = a->up[i];
        float sig = 1.0f / (1.0f + expf(-g));
        a->out[i] = (b * tanhf(g / b) * sig) * (bl * tanhf(u / bl));
    }
}

void duet_k_situ_mul(duet_kernels_t *k, float *out, const float *gate, const float *up, int64_t n,
                     float beta, float beta_lin)
{
    duet__act_t a = {.out = out, .gate = gate, .up = up, .beta = beta, .beta_lin = beta_lin};
    if (n < DUET__PAR_MIN)
        duet__situ_range(&a, 0, n, 0);
    else
        duet_k_parallel_for(k, n, DUET__PAR_GRAIN, duet__situ_range, &a);
}

/* ---- add ------------------------------------------------------------------------------------ */

typedef struct {
    float *y;
    const float *x;
} duet__add_t;

static void duet__add_range(void *ctx, int64_t begin, int64_t end, int thread_idx)
{
    const duet__add_t *a = ctx;
    float *restrict y = a->y;
    const float *x = a->x;
    for (int64_t i = begin; i < end; i++)
        y[i] += x[i];
}

void duet_k_add(duet_kernels_t *k, float *y, const float *x, int64_t n)
{
    duet__add_t a = {.y = y, .x = x};
    if (n < 4 * DUET__PAR_MIN)
        duet__add_range(&a, 0, n, 0);
    else
        duet_k_parallel_for(k, n, 4 * DUET__PAR_GRAIN, duet__add_range, &a);
}

/* ---- embed ---------------------------------------------------------------------------------- */

typedef struct {
    float *out;
    const duet_tensor_t *table;
    const int32_t *ids;
    int64_t D;
} duet__embed_t;

static void duet__embed_rows(void *ctx, int64_t begin, int64_t end, int thread_idx)
{
    const duet__embed_t *a = ctx;
    const size_t es = duet_dtype_size(a->table->dtype);
    for (int64_t t = begin; t < end; t++) {
        const char *row = (const char *)a->table->data + (size_t)a->ids[t] * (size_t)a->D * es;
        duet_convert_to_f32(a->out + t * a->D, row, a->table->dtype, a->D);
    }
}

void duet_k_embed(duet_kernels_t *k, float *out, const duet_tensor_t *table, const int32_t *ids,
                  int64_t n_ids)
{
    DUET_ASSERT(table->ndim == 2);
    const int64_t V = table->shape[0], D = table->shape[1];
    /* Ids come from our tokenizer or were validated against the vocabulary by the engine. */
    for (int64_t t = 0; t < n_ids; t++)
        DUET_ASSERT(ids[t] >= 0 && ids[t] < V);
    duet__embed_t a = {.out = out, .table = table, .ids = ids, .D = D};
    if (n_ids * D < DUET__PAR_MIN)
        duet__embed_rows(&a, 0, n_ids, 0);
    else
        duet_k_parallel_for(k, n_ids, DUET__PAR_GRAIN / (D > 0 ? D : 1) + 1, duet__embed_rows, &a);
}
