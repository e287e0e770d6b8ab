/*
 * backend.h: the one interface between the model front end (engine/model.c) and a device.
 *
 * A backend is a table of functions (duet_backend_ops_t, in the manner of ggml's backends or UCX's
 * transports) and an instance (duet_backend_t) that starts with a pointer to its table. Two
 * implement it: backend_cpu.c (the reference, kernels/cpu) and backend_cuda.c (kernels/cuda; in a
 * build without CUDA its create says so). duet_backend_find picks one by device kind or name.
 *
 * Who owns what:
 *  - The front end owns what does not depend on the device: config, checkpoint, bound weights,
 *    the host cache pools with their page / slot bookkeeping (common/cache_layout.h is their byte
 *    layout), the sequence table, batch validation, the layer hook's registration, advancing a
 *    sequence after a step. It includes this header and no device header, and never asks which
 *    device it runs on: a difference between devices is a field of the table.
 *  - A backend owns everything the device holds and computes: weights in its own form, its
 *    copies of the pools (the CUDA pools live on the GPU, the host pools then being bookkeeping and
 *    staging mirrors), workspaces, the forward pass and the drawing of tokens.
 *
 * Why in engine/ and not in kernels/: a backend consumes engine types (config, weights, pools,
 * sequences, batch items); kernels/ knows tensors and buffers only and includes no engine header
 * (docs/architecture.md, "Module layout"). The kernels a backend calls live in kernels/<device>/,
 * one folder per device with the same names on both (kda, mla, moe, step).
 *
 * Calls: create, then any number of seq_open / seq_set_filled / forward / seq_replay / seq_close,
 * then destroy, all from one thread. An op marked optional may be NULL: the front end then does
 * nothing for it (or refuses the feature that needs it with DUET_ERR_UNSUPPORTED).
 *
 * Extending: features add to this table rather than branching in the front end (model.c) or in
 * the other backend.
 *  - Speculative decoding's verify rows were added this way: an item field
 *    (duet_batch_item_t.verify) in model.h; DUET_BACKEND_CAP_VERIFY here, so that the load
 *    refuses spec_rows and duet_model_forward a verify item on a backend without it; each capable
 *    backend's forward handling the rows (and folding a sequence's accepted rows, seq->n_replay,
 *    into its state before its new rows); the replay pool (DUET_MODEL_POOL_REPLAY, created by
 *    the front end like the others); the seq_replay op for the replay-only commit. Accepting and
 *    truncating are the front end's bookkeeping. Both backends have them.
 *  - A new pool (a draft model's KV): a new duet_model_pool_t value; the front end creates its
 *    host pool and bookkeeping as for KV and KDA (sized by the config, laid out in
 *    common/cache_layout.h), a backend reports where its memory is through pool_mem and zeroes /
 *    copies it in seq_open / seq_set_filled as it does the two pools today. A draft model is a
 *    second duet_model_t with its own backend instance of the same table.
 *  - Sharded attention (Helix context parallelism: each rank holds some pages of a sequence): a
 *    new op that runs an MLA layer's attention over the local pages only and returns the partial
 *    output and log-sum-exp per (row, head), and one that merges the ranks' partials (the CUDA
 *    split-KV reducer's log-sum-exp merge, kernels/cuda/cuda_mla.h); the collective between ranks
 *    stays outside the backend.
 *  - Suspend / resume: ops that copy a sequence's pages and slot out to host memory and back (what
 *    mirror_out / seq_set_filled do per layer on CUDA today). The slot half exists: seq_state_copy
 *    (duet_model_seq_state_save / _restore, which a KDA draft model's rollback uses).
 */
#ifndef DUET_ENGINE_BACKEND_H
#define DUET_ENGINE_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "engine/cache.h"
#include "engine/model.h"
#include "engine/model_config.h"
#include "engine/shard.h"
#include "engine/weights.h"
#include "kernels/kernels.h"

/* q_a_layernorm / kv_a_layernorm eps: transformers builds those two norms with its default eps,
 * not rms_norm_eps (docs/model.md). Both backends use it. */
#define DUET_MLA_NORM_EPS 1e-6f

/* Bit of a duet_dtype_t in duet_backend_ops_t's dtype masks. */
#define DUET_BACKEND_DTYPE_BIT(dt) (1u << (unsigned)(dt))

/* Capabilities (duet_backend_ops_t.caps). */
#define DUET_BACKEND_CAP_RANDOM_WEIGHTS 0x1u /* create with w == NULL generates random weights */
/* verify items (speculative decoding): the replay pool and seq_replay */
#define DUET_BACKEND_CAP_VERIFY 0x2u
/* opts.tune: create profiles the backend's tactics (kernels/tune.h) for the model's shapes */
#define DUET_BACKEND_CAP_TUNE 0x4u

typedef struct duet_backend duet_backend_t;
typedef struct duet_backend_ops duet_backend_ops_t;

/* Every backend instance starts with this (its own struct embeds it as the first member). */
struct duet_backend {
    const duet_backend_ops_t *ops;
};

/*
 * What a backend is created from: the loaded model as the front end holds it. Every pointer is the
 * front end's and outlives the backend; the backend may keep the pointers.
 */
typedef struct {
    const duet_model_config_t *cfg;
    const duet_model_opts_t *opts; /* compute_dtype resolved */
    const duet_weights_t *w;       /* NULL: random weights from `seed`
                                      (DUET_BACKEND_CAP_RANDOM_WEIGHTS) */
    uint64_t seed;
    duet_kv_pool_t *kv;         /* host KV pool; NULL without MLA layers */
    duet_kda_pool_t *kda;       /* host KDA pool; NULL without KDA layers */
    duet_replay_pool_t *replay; /* host KDA replay pool; NULL without spec_rows or KDA layers */
    int64_t max_pages_per_seq;  /* columns of a sequence's page table */
    const int64_t *layer_sub;   /* [num_layers] index among layers of the same
                                   mixer (MLA layer l of the KV pool, ...) */
    /* A Helix group's rank (model.h's opts.comm): cfg and w are then the rank's cut
     * (engine/shard.h), the pools hold its share, and the forward is collective over comm.
     * NULL both when alone. */
    const duet_shard_t *shard;
    duet_comm_t *comm;
} duet_backend_model_t;

/*
 * One step, validated by the front end (duet_model_forward's rules: open sequences, each once,
 * none with pending verify rows, tokens in the vocabulary, buffers for the logits mode, rows <=
 * max_batch_tokens, verify items only on a backend with DUET_BACKEND_CAP_VERIFY and within
 * spec_rows). Every item appends items[i].n_tokens tokens at items[i].seq->n_tokens; before them
 * the backend folds the sequence's seq->n_replay accepted rows (rows 0.. of its replay block) into
 * its state. A verify item's rows are computed from the committed state, which stays as it is,
 * and its KDA rows go to the replay block. The backend leaves the sequence's fields alone (the
 * front end advances n_tokens, sets n_pending and clears n_replay after a successful step).
 */
typedef struct {
    duet_batch_item_t *items;
    int64_t n_items;
    int64_t n_rows;                /* total new tokens */
    duet_model_layer_hook_fn hook; /* NULL = none; model.h's contract */
    void *hook_user;
} duet_backend_batch_t;

/* Where a backend's copy of a cache pool lives (pool_mem). The byte layout is the host pool's
 * (duet_kv_pool_layout / duet_kda_pool_layout), page and slot ids the same; a device copy may
 * hold spare pages or slots after the last. */
typedef struct {
    void *base; /* NULL when the model has no such pool */
    size_t bytes;
    int on_device; /* 0: the front end's host pool itself */
} duet_backend_pool_mem_t;

struct duet_backend_ops {
    const char *name; /* the --device spelling: "cpu", "cuda" */
    duet_device_kind_t device;
    unsigned compute_dtypes; /* DUET_BACKEND_DTYPE_BIT of each dtype it computes in */
    unsigned kv_dtypes;      /* ... of each dtype its KV pool may hold */
    unsigned caps;           /* DUET_BACKEND_CAP_* */

    /* Whether the backend can run in this process: 1 yes; 0 no, nothing to say (no device); -1
     * no, a device is there but cannot be used, `why` (cap bytes, may be NULL) says why. */
    int (*probe)(char *why, size_t cap);

    /* Build the device side of `bm` (weights, pools, workspaces). On failure nothing is left and
     * the error is set. */
    duet_status_t (*create)(const duet_backend_model_t *bm, duet_backend_t **be_p);
    void (*destroy)(duet_backend_t *be); /* accepts NULL */
    /* One line for logs: "cpu, 8 threads (avx2)", "cuda, BF16 weights, F32 KV, graphs on". */
    void (*describe)(const duet_backend_t *be, char *buf, size_t cap);

    /* A sequence got its pages and slot from the host pools (the slot zeroed there): make its
     * caches empty wherever this backend reads them. */
    duet_status_t (*seq_open)(duet_backend_t *be, const duet_seq_t *seq);
    /* Optional. The host pools now hold the sequence's first n_tokens tokens, written from
     * outside (a cache transfer), and with seq->n_replay > 0 its accepted rows in the replay
     * pool (a moved request's): take them from there. */
    duet_status_t (*seq_set_filled)(duet_backend_t *be, const duet_seq_t *seq, int64_t n_tokens);
    /* Optional. The sequence's pages and slot go back to the host pools after this. */
    void (*seq_close)(duet_backend_t *be, const duet_seq_t *seq);
    /* DUET_BACKEND_CAP_VERIFY. Fold the sequence's seq->n_replay (> 0) accepted rows of its
     * replay block into its KDA state and conv windows, exactly as a forward does before its new
     * rows (the replay-only commit). The front end clears n_replay. */
    duet_status_t (*seq_replay)(duet_backend_t *be, const duet_seq_t *seq);

    /* Optional; needed when pool_mem puts the KDA pool on the device (the front end copies a host
     * pool itself). Copy the sequence's KDA slot (duet_kda_pool_slot_bytes bytes, the host
     * pool's slot layout) into host memory buf (to_host 1) or from it into the slot (0), after
     * the work queued before it and finished when it returns; a copy into the slot also updates
     * a host mirror of it. duet_model_seq_state_save / _restore. */
    duet_status_t (*seq_state_copy)(duet_backend_t *be, const duet_seq_t *seq, void *buf,
                                    int to_host);
    /* Optional; needed when pool_mem puts the KV pool on the device. The same for the sequence's
     * first n_pages pages: every MLA layer of each, in page order, the host pool's page layout
     * (n_pages * the layout's page bytes in buf); a copy into the pages also updates a host
     * mirror of them. duet_model_seq_snapshot_save / _restore (suspend and resume). buf NULL:
     * each page to / from its own place in the host pool (duet_model_seq_sync_host). */
    duet_status_t (*seq_kv_copy)(duet_backend_t *be, const duet_seq_t *seq, int64_t n_pages,
                                 void *buf, int to_host);

    /* One mixed step: prefill chunks and decode rows of any logits mode, DUET_LOGITS_TOKEN drawn
     * by the backend (on the device for CUDA). Runs the batch's hook after each layer's mixer. */
    duet_status_t (*forward)(duet_backend_t *be, const duet_backend_batch_t *b);

    /* Where the backend's copy of pool `which` is (what a transfer moves when it moves device
     * memory). */
    void (*pool_mem)(const duet_backend_t *be, duet_model_pool_t which,
                     duet_backend_pool_mem_t *out);
};

/* The backends of this build, in the order --device auto prefers them (cuda, then cpu). */
extern const duet_backend_ops_t duet_backend_cuda_ops;
extern const duet_backend_ops_t duet_backend_cpu_ops;

/* The backend of a device kind, or of a --device name; NULL when there is none. */
const duet_backend_ops_t *duet_backend_find(duet_device_kind_t dev);
const duet_backend_ops_t *duet_backend_find_name(const char *name);
/* The first backend (in the order above) whose probe says it can run here: always one, the CPU
 * at the latest. A backend skipped with a reason has it logged as a warning. */
const duet_backend_ops_t *duet_backend_pick_auto(void);

/*
 * Tell the batch's hook that layer l's mixer outputs are final (model.h's contract: the index
 * among MLA layers, or among KDA layers, the other one -1). Does nothing without a hook.
 */
void duet_backend_layer_done(const duet_backend_model_t *bm, const duet_backend_batch_t *b,
                             int64_t l);

/*
 * fp32 per-layer parameters both backends start from, converted once from the checkpoint's
 * tensors: the small vectors (conv taps, dt_bias, -exp(A_log), o_norm, the router bias) and
 * W_UK[h]ᵀ for the absorbed MLA form. Entries of layers of the other kind are NULL.
 */
typedef struct {
    float *conv_w;   /* KDA: (3*H*K, W) q, k, v taps */
    float *dt_bias;  /* KDA: (H*K) */
    float *neg_A;    /* KDA: (H) = -exp(A_log) */
    float *o_norm;   /* KDA: (K) */
    float *wuk_t;    /* MLA: (n, r, dn) = W_UK[h]ᵀ per head */
    float *moe_bias; /* MoE: (E) e_score_correction_bias */
} duet_backend_f32_t;

/* [cfg->num_layers] entries into *f32_p (owned; free with duet_backend_f32_free).
 * DUET_ERR_NOMEM; nothing allocated on failure. */
duet_status_t duet_backend_f32_prepare(const duet_model_config_t *cfg, const duet_weights_t *w,
                                       duet_backend_f32_t **f32_p);
void duet_backend_f32_free(const duet_model_config_t *cfg, duet_backend_f32_t *f32);

#endif
