/*
 * model_cuda.h: the engine's forward pass on an NVIDIA GPU (engine-internal; model.c dispatches to
 * it when the model was loaded with opts.device = DUET_DEVICE_CUDA).
 *
 * What lives on the device, allocated once at load: every weight (converted to the compute dtype,
 * F32 or BF16; the MoE router stays fp32 so routing ties resolve as on the CPU), the KV and KDA
 * pools (one spare page and one spare state slot beyond the host pools' ids: the padding items of
 * a CUDA-graph batch bucket write there), the step workspace, the GEMM handle and its workspace.
 * The host pools of model.c keep doing the bookkeeping (page and slot ids); their memory is only
 * touched as a staging mirror when a worker asks for it (mirror_in: seq_set_filled copies a
 * received sequence host → device; mirror_out: each layer's new KV / state is copied device →
 * host on a copy stream, overlapping the next layer's compute, before the layer hook runs).
 *
 * A pure decode step (every item one token, logits of the last row or a sampled token) runs as a
 * CUDA graph captured once per (batch bucket = next power of two, MLA split count, sampling
 * kind) and replayed with the step's metadata copied in first; other steps are queued kernel by
 * kernel. Every step ends with one stream synchronisation.
 */
#ifndef DUET_ENGINE_MODEL_CUDA_H
#define DUET_ENGINE_MODEL_CUDA_H

#include "engine/cache.h"
#include "engine/model.h"
#include "engine/weights.h"

typedef struct duet_cuda_model duet_cuda_model_t;

/* Host-side fp32 parameters model.c prepared (NULL arrays with w == NULL: random weights). */
typedef struct {
    float *const *conv_w;  /* [layer] (3*H*K, W) */
    float *const *dt_bias; /* [layer] (H*K) */
    float *const *neg_A;   /* [layer] (H) */
    float *const *o_norm;  /* [layer] (K) */
    float *const *wuk_t;   /* [layer] (n, r, dn) */
    float *const *moe_bias; /* [layer] (E) */
} duet_cuda_model_host_t;

/*
 * Build the device model. w == NULL: random weights generated on the device from `seed` (the
 * benchmark model; only the config is needed). kv / kda: the host pools (NULL when the model has
 * no such layers) whose ids and layout the device pools mirror.
 */
duet_status_t duet_cuda_model_create(const duet_model_config_t *cfg, const duet_model_opts_t *opts,
                                     const duet_weights_t *w, const duet_cuda_model_host_t *host,
                                     uint64_t seed, duet_kv_pool_t *kv, duet_kda_pool_t *kda,
                                     int64_t max_pages_per_seq, const int64_t *layer_sub,
                                     duet_cuda_model_t **dm_p);
void duet_cuda_model_destroy(duet_cuda_model_t *dm); /* accepts NULL */

/* A sequence was opened: zero its device pages and state slot (stream-ordered). */
duet_status_t duet_cuda_model_seq_opened(duet_cuda_model_t *dm, const duet_seq_t *seq);
/* A sequence was filled from outside: with mirror_in, copy its first n_tokens of KV and its
 * state from the host pools to the device (synchronous). */
duet_status_t duet_cuda_model_seq_filled(duet_cuda_model_t *dm, const duet_seq_t *seq,
                                         int64_t n_tokens);

/* One validated step (model.c checked the batch; rows = total new tokens). */
duet_status_t duet_cuda_model_forward(duet_cuda_model_t *dm, duet_batch_item_t *items,
                                      int64_t n_items, int64_t rows,
                                      duet_model_layer_hook_fn hook, void *hook_user);

/* Device pools and sizes (benchmarks fill them to stand for a long context). */
void duet_cuda_model_pools(duet_cuda_model_t *dm, void **kv, size_t *kv_bytes, void **kda,
                           size_t *kda_bytes);
/* Device memory the model holds, bytes (weights, pools, workspaces). */
size_t duet_cuda_model_device_bytes(const duet_cuda_model_t *dm);
/* Graphs captured so far. */
int duet_cuda_model_n_graphs(const duet_cuda_model_t *dm);

/*
 * Test hooks for the expanded MLA prefill form (cuda_mla.h; model_cuda.c duet__mla_x_step):
 * set(1) uses it where the shapes allow, set(0) never, set(-1) returns to the default (on unless
 * the environment has DUET_CUDA_NO_MLA_X=1); read when a model is created. steps() counts the
 * steps, over all models of the process, whose MLA layers took it.
 */
void duet_cuda_model_mla_x_set(int on);
int64_t duet_cuda_model_mla_x_steps(void);

#endif
