/*
 * cpu_moe.h: MoE routing on the CPU (docs/model.md, "FFN"), the reference of
 * kernels/cuda/cuda_ops.h's duet_cuda_moe_route. The experts themselves are GEMMs over each
 * expert's gathered rows, which the engine's CPU backend runs with duet_k_matmul.
 */
#ifndef DUET_KERNELS_CPU_MOE_H
#define DUET_KERNELS_CPU_MOE_H

#include <stdint.h>

/*
 * Route each of T rows on its own: s = σ(logits) (E scores), b = s + bias used only to choose;
 * with n_group > 1, the topk_group groups with the best sum of their two largest b (their largest
 * if a group has one expert) stay in the running; top_k experts by b (first index on ties) into
 * idx [T][top_k], their s into wts [T][top_k], divided by (Σ + 1e-20) when renorm, times scale.
 * logits [T][E] and bias [E] fp32; n_group divides E; 1 <= topk_group <= n_group; top_k <= E.
 */
void duet_cpu_moe_route(const float *logits, const float *bias, int64_t T, int64_t E,
                        int64_t n_group, int64_t topk_group, int64_t top_k, int renorm, float scale,
                        int32_t *idx, float *wts);

#endif
