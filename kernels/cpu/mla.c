/*
 * mla.c: MLA's cache write and paged attention on the CPU (contract in cpu_mla.h). Scores are
 * taken over the latent rows (r + dr dims) and the softmax-weighted sum stays in the r-dim latent
 * space: W_UK and W_UV are applied by the caller's GEMMs, before and after.
 */
#include "kernels/cpu/cpu_mla.h"

#include <math.h>
#include <string.h>

#include "kernels/cpu/isa.h"

/* Dot product with 8 independent partial sums: the explicit lanes let the compiler vectorise
 * without reassociating (no -ffast-math). */
static inline float duet__dot(const float *a, const float *b, int64_t n)
{
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++)
            acc[k] += a[i + k] * b[i + k];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++)
        s += a[i] * b[i];
    return s;
}

/* Token slot 0 of (page, this layer). */
static float *duet__mla_block(const duet_cpu_mla_layer_t *ly, int32_t page)
{
    uint64_t off = 0;
    (void)duet_kv_layout_offset(&ly->layout, (uint64_t)page, (uint64_t)ly->layer, 0, &off);
    return (float *)((uint8_t *)ly->kv_base + off);
}

void duet_cpu_mla_kv_write(duet_kernels_t *k, const duet_cpu_step_t *st,
                           const duet_cpu_mla_layer_t *ly, float *ckr, const duet_tensor_t *norm_w,
                           float eps)
{
    const int64_t r = ly->r, td = ly->r + ly->dr, PT = (int64_t)ly->layout.page_tokens;
    for (int64_t it = 0; it < st->n_items; it++) {
        const int64_t r0 = st->item_row0[it], n = st->item_row0[it + 1] - r0;
        for (int64_t t = 0; t < n; t++) {
            const int64_t row = r0 + t, pos = st->item_pos0[it] + t;
            float *src = ckr + row * td;
            duet_k_rmsnorm(k, src, src, norm_w, 1, r, eps);
            float *dst = duet__mla_block(ly, st->item_pages[it][pos / PT]) + (pos % PT) * td;
            memcpy(dst, src, sizeof(float) * (size_t)td);
        }
    }
}

typedef struct {
    const duet_cpu_step_t *st;
    const duet_cpu_mla_layer_t *ly;
    const float *qhat, *qr;
    int64_t ldqr, dqr_stride;
    float scale;
    float *lat;
    float *scratch;
    int64_t per_thread;
} duet__mla_attn_ctx_t;

/* Attention over the latent cache for one (item, head): every new token t of the item attends
 * to positions 0 .. pos+t. Scores in r + dr dims, result in r dims (absorbed form). */
DUET__CPU_CLONES
static void duet__mla_attn_task(void *vctx, int64_t b, int64_t e, int tid)
{
    const duet__mla_attn_ctx_t *cx = vctx;
    const duet_cpu_step_t *st = cx->st;
    const duet_cpu_mla_layer_t *ly = cx->ly;
    const int64_t n = ly->n_heads, dr = ly->dr, r = ly->r, td = r + dr;
    const int64_t PT = (int64_t)ly->layout.page_tokens;
    const float scale = cx->scale;
    float *sc = cx->scratch + (int64_t)tid * cx->per_thread;

    for (int64_t idx = b; idx < e; idx++) {
        const int64_t it = idx / n, h = idx % n;
        const int32_t *const pages = st->item_pages[it];
        const int64_t r0 = st->item_row0[it], nt = st->item_row0[it + 1] - r0;
        const int64_t pos0 = st->item_pos0[it];
        for (int64_t t = 0; t < nt; t++) {
            const int64_t row = r0 + t, last = pos0 + t;
            const float *qh = cx->qhat + (row * n + h) * r;
            const float *qr = cx->qr + row * cx->ldqr + h * cx->dqr_stride;
            float mx = -INFINITY;
            /* keys page by page: one block lookup per page, contiguous tokens inside */
            for (int64_t p0 = 0; p0 <= last; p0 += PT) {
                const float *blk = duet__mla_block(ly, pages[p0 / PT]);
                const int64_t ns = last - p0 + 1 < PT ? last - p0 + 1 : PT;
                for (int64_t s = 0; s < ns; s++) {
                    const float *kv = blk + s * td;
                    float acc = (duet__dot(qh, kv, r) + duet__dot(qr, kv + r, dr)) * scale;
                    sc[p0 + s] = acc;
                    mx = acc > mx ? acc : mx;
                }
            }
            float sum = 0.0f;
            for (int64_t s = 0; s <= last; s++) {
                sc[s] = expf(sc[s] - mx);
                sum += sc[s];
            }
            float *out = cx->lat + (row * n + h) * r;
            for (int64_t j = 0; j < r; j++)
                out[j] = 0.0f;
            for (int64_t p0 = 0; p0 <= last; p0 += PT) {
                const float *blk = duet__mla_block(ly, pages[p0 / PT]);
                const int64_t ns = last - p0 + 1 < PT ? last - p0 + 1 : PT;
                for (int64_t s = 0; s < ns; s++) {
                    const float *kv = blk + s * td;
                    const float p = sc[p0 + s];
                    for (int64_t j = 0; j < r; j++)
                        out[j] += p * kv[j];
                }
            }
            float inv = 1.0f / sum;
            for (int64_t j = 0; j < r; j++)
                out[j] *= inv;
        }
    }
}

void duet_cpu_mla_attend(duet_kernels_t *k, const duet_cpu_step_t *st,
                         const duet_cpu_mla_layer_t *ly, const float *qhat, const float *qr,
                         int64_t ldqr, int64_t dqr_stride, float scale, float *lat, float *scratch,
                         int64_t scratch_per_thread)
{
    duet__mla_attn_ctx_t cx = {.st = st,
                               .ly = ly,
                               .qhat = qhat,
                               .qr = qr,
                               .ldqr = ldqr,
                               .dqr_stride = dqr_stride,
                               .scale = scale,
                               .lat = lat,
                               .scratch = scratch,
                               .per_thread = scratch_per_thread};
    duet_k_parallel_for(k, st->n_items * ly->n_heads, 1, duet__mla_attn_task, &cx);
}
