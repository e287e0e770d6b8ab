/*
 * moe.c: MoE routing on the CPU (contract in cpu_moe.h). Each row is routed on its own, so a
 * row's experts and weights do not depend on the batch it came in.
 */
#include "kernels/cpu/cpu_moe.h"

#include <math.h>

/* Route one row: sigmoid scores, bias for choice, group-limited top-k, renormalise, scale. */
static void duet__route_row(const float *logits, const float *bias, int64_t E, int64_t G,
                            int64_t topk_group, int64_t top_k, int renorm, float scale,
                            int32_t *idx, float *wts)
{
    const int64_t gs = E / G;
    float score[E], choice[E];
    for (int64_t e = 0; e < E; e++) {
        score[e] = 1.0f / (1.0f + expf(-logits[e]));
        choice[e] = score[e] + bias[e];
    }
    if (G > 1) {
        float gscore[G];
        uint8_t keep[G];
        for (int64_t g = 0; g < G; g++) {
            float b1 = -INFINITY, b2 = -INFINITY;
            for (int64_t e = g * gs; e < (g + 1) * gs; e++) {
                if (choice[e] > b1) {
                    b2 = b1;
                    b1 = choice[e];
                } else if (choice[e] > b2) {
                    b2 = choice[e];
                }
            }
            gscore[g] = gs >= 2 ? b1 + b2 : b1;
            keep[g] = 0;
        }
        for (int64_t k = 0; k < topk_group; k++) {
            int64_t best = -1;
            for (int64_t g = 0; g < G; g++)
                if (!keep[g] && (best < 0 || gscore[g] > gscore[best]))
                    best = g;
            keep[best] = 1;
        }
        for (int64_t e = 0; e < E; e++)
            if (!keep[e / gs])
                choice[e] = -INFINITY;
    }
    float sum = 0.0f;
    for (int64_t k = 0; k < top_k; k++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t j = 0; j < k; j++)
                taken |= idx[j] == e;
            if (!taken && (best < 0 || choice[e] > choice[best]))
                best = e;
        }
        idx[k] = (int32_t)best;
        wts[k] = score[best];
        sum += wts[k];
    }
    for (int64_t k = 0; k < top_k; k++) {
        if (renorm)
            wts[k] /= sum + 1e-20f;
        wts[k] *= scale;
    }
}

void duet_cpu_moe_route(const float *logits, const float *bias, int64_t T, int64_t E,
                        int64_t n_group, int64_t topk_group, int64_t top_k, int renorm, float scale,
                        int32_t *idx, float *wts)
{
    const int64_t G = n_group > 0 ? n_group : 1;
    for (int64_t row = 0; row < T; row++)
        duet__route_row(logits + row * E, bias, E, G, topk_group, top_k, renorm, scale,
                        idx + row * top_k, wts + row * top_k);
}
