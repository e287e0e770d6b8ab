/*
 * The engine: a loaded Kimi-Linear checkpoint, its caches and one batched forward pass.
 *
 * duet_model_forward() serves a batch of sequences in one call, each at its own position:
 * a prefill chunk of one request and single-token decode steps of others can share a step. All
 * rows of the batch go through every projection, norm and FFN together (one GEMM per weight);
 * only the mixers' sequence-dependent parts (conv windows, KDA recurrence, MLA attention over the
 * paged latent cache) run per sequence. Workspaces are sized at load for `max_batch_tokens` rows
 * and nothing is allocated per step. The device's part is a backend's (engine/backend.h: CPU or
 * CUDA); this API is the same for both.
 *
 * Speculative decoding (the engine's part): a *verify item* (duet_batch_item_t.verify) carries a
 * sequence's next token followed by k drafted tokens and computes logits for all of them from the
 * committed caches without committing anything; duet_model_seq_accept then keeps the first rows.
 * KDA layers carry a recurrent state that cannot be rolled back, so the KDA pool keeps the state
 * after the last *committed* token: a verify item computes its rows on a copy of S and of the
 * conv windows and leaves, per row, what folding the token in needs in the KDA replay pool; the
 * accepted rows are folded into S (replayed) at the sequence's next forward, before its new rows,
 * or by duet_model_seq_commit. Each verify row is computed bit for bit as plain decode (one token
 * per step) computes that token had the rows before it been committed, and the replay reaches
 * the state plain decode reaches, bit for bit (CPU; tests/unit/test_engine_spec.c), so greedy
 * speculation gives exactly the tokens of plain greedy decoding. A drafting model (plain
 * decode, no verify rows) rolls back with duet_model_seq_truncate instead: its MLA KV of later
 * positions is simply overwritten, and its KDA state is restored from a copy the caller saved
 * before drafting (duet_model_seq_state_save).
 */
#ifndef DUET_ENGINE_MODEL_H
#define DUET_ENGINE_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "common/comm.h"
#include "common/status.h"
#include "engine/cache.h"
#include "engine/model_config.h"
#include "engine/sampler.h"
#include "kernels/kernels.h"

typedef struct duet_model duet_model_t;

/* Which cache pool a pool_alloc call is for. */
typedef enum {
    DUET_MODEL_POOL_KV = 0,     /* the MLA KV pool */
    DUET_MODEL_POOL_KDA = 1,    /* the KDA state pool */
    DUET_MODEL_POOL_REPLAY = 2, /* the KDA replay pool (spec_rows > 0, KDA layers) */
} duet_model_pool_t;

/*
 * Memory for a cache pool: `bytes` zeroed bytes, 64-byte aligned, that outlive the model (the
 * model never frees them); NULL = out of memory. A generation worker passes an allocator that
 * returns UCX-registered segments so that a context worker's puts land in them directly, and
 * another generation worker's when a running request moves (its pending replay rows too). Called
 * for every pool the model has (duet_model_pool_descs): KV, KDA, and the replay pool.
 */
typedef void *(*duet_model_pool_alloc_fn)(void *user, duet_model_pool_t which, size_t bytes);

/*
 * The compute dtype a caller asks for (the binaries' --dtype); duet_model_dtype_resolve turns it
 * and the checkpoint's dtype into the one the model computes in.
 */
typedef enum {
    DUET_MODEL_DTYPE_AUTO = 0, /* the checkpoint's, as far as the device computes in it */
    DUET_MODEL_DTYPE_F32 = 1,
    DUET_MODEL_DTYPE_BF16 = 2,
} duet_model_dtype_t;

typedef struct {
    int n_threads;                       /* CPU threads, 0 = all online CPUs (or DUET_THREADS) */
    int64_t max_batch_tokens;            /* rows one forward call may carry (default 512) */
    int64_t max_seqs;                    /* sequences open at once = KDA state slots (default 8) */
    int64_t max_seq_len;                 /* tokens one sequence may hold (default 4096) */
    int64_t page_tokens;                 /* MLA KV page size in tokens (default 128) */
    int64_t kv_pages;                    /* 0 = max_seqs * ceil(max_seq_len / page_tokens) */
    duet_model_pool_alloc_fn pool_alloc; /* NULL = the model allocates its pools */
    void *pool_alloc_user;
    /* Where the forward pass runs (DUET_DEVICE_CPU default): the backend of that device
     * (engine/backend.h). With CUDA, weights, caches and workspaces live on the GPU
     * (engine/backend_cuda.c); the pools above stay on the host for page / slot bookkeeping and
     * as the transfer staging area. */
    duet_device_kind_t device;
    duet_model_dtype_t dtype;   /* what the caller asks for (default AUTO) */
    duet_dtype_t compute_dtype; /* what the model computes in: set by the load from `dtype`
                                   (duet_model_dtype_resolve), read it through
                                   duet_model_opts(); a caller's value is overwritten.
                                   CUDA: F32 (exact fp32, TF32 off) or BF16; CPU: F32 */
    duet_dtype_t kv_dtype;      /* KV pool elements: F32 (default), BF16 on CUDA only */
    int mirror_in;   /* CUDA: seq_set_filled copies the host pools' sequence to the device */
    int mirror_out;  /* CUDA: each layer's new KV / state is copied to the host pools before
                        the layer hook runs (a context worker streaming them) */
    int cuda_graphs; /* CUDA: replay decode steps as CUDA graphs (default 1) */
    int device_pools_shared; /* CUDA: others (a CUDA-aware UCX) write the device pools directly:
                                seq_open returns once its zeroing of them is done */
    int64_t logit_rows_cap;  /* CUDA: logits rows the device buffer holds (0 = as many as fit in
                                1 GiB; never below one per sequence of a batch); a step with more
                                logits rows computes the head in slices of this many */
    int64_t spec_rows;       /* speculative decoding: the most rows one verify item may carry
                                (k + 1 for k drafted tokens); 0 = no speculation (the default),
                                else 2..max_batch_tokens and <= max_seq_len. Sizes the KDA replay
                                pool (spec_rows rows per state slot and KDA layer, allocated at
                                load). Needs a backend with verify rows (cpu
                                and cuda have them) */
    /* A Helix generation group (engine/shard.h, docs/architecture.md "Generation groups"): this
     * model is rank comm->rank of helix_cp * helix_tp == comm->size ranks, holds that rank's cut
     * of the weights and caches, and every forward is collective: each rank of the group makes
     * the same calls (seq_open, set_filled, forward, close) in the same order with the same
     * tokens. NULL (or one rank) = alone. The communicator is the caller's and outlives the
     * model. Groups compute on the cpu backend and without spec_rows (DUET_ERR_UNSUPPORTED);
     * only rank 0 computes logits (the others' items must ask for none). kv_pages counts the
     * rank's own pages; a sequence's pages are dealt across the cp ranks (seq->pages holds this
     * rank's share, seq->cap_tokens the whole sequence's). With tune, the group's ranks split
     * the profiling over comm. */
    duet_comm_t *comm;
    int helix_cp, helix_tp;
    /* Autotuning (kernels/tune.h, issue 39): 1 = at load, profile the backend's tactics for the
     * model's shapes and keep the fastest per shape. cpu: the matmul's work split for the decode
     * shapes (M = 1 .. max_seqs), every tactic giving the same bits; cuda: cuBLASLt's algorithm of
     * each weight GEMM for the M buckets of decode and prefill (up to max_batch_tokens) that reach
     * cuBLASLt, tactics agreeing to fp32 summation order (not bit for bit: cuda_gemm.h). It costs
     * load time, so it is off by default. Needs a backend with DUET_BACKEND_CAP_TUNE (cpu, cuda);
     * DUET_ERR_UNSUPPORTED elsewhere. */
    int tune;
    /* With tune: a table to load instead of profiling when the file exists, and where the
     * profiled table is saved when it does not (NULL = neither). A malformed file or one made on
     * another machine fails the load. In a group every rank loads its file or, if one has none,
     * every rank profiles (duet_tune_load_group). */
    const char *tune_file;
} duet_model_opts_t;

/*
 * Parse a --device value: "cpu", "cuda", or "auto" (cuda when this build has the CUDA backend
 * and a device is visible, else cpu). DUET_ERR_INVALID naming the value otherwise.
 */
duet_status_t duet_model_device_parse(const char *s, duet_device_kind_t *dev_p);
/* "cpu" / "cuda". */
const char *duet_model_device_name(duet_device_kind_t dev);

/* The --dtype help text of every binary that loads a model (one wording of the rule below). */
#define DUET_MODEL_DTYPE_HELP                                                                      \
    "compute dtype: auto = the checkpoint's on cuda (bf16 for a bf16 checkpoint such as the "      \
    "published one; f32 for an f32 or f16 one: cuda computes in f32 or bf16 and auto never "       \
    "rounds the stored weights), f32 on the cpu; f32 = exact fp32 (TF32 off); bf16 = bf16 "        \
    "weights and GEMM inputs (cuda only: the cpu always computes in f32)"

/*
 * Parse a --dtype value: "auto", "f32" or "bf16". DUET_ERR_INVALID naming the value otherwise.
 */
duet_status_t duet_model_dtype_parse(const char *s, duet_model_dtype_t *dt_p);
/* "auto" / "f32" / "bf16". */
const char *duet_model_dtype_name(duet_model_dtype_t dt);

/*
 * The dtype a model on `dev` computes in, given the checkpoint's dtype (duet_checkpoint_dtype)
 * and the request. Pure: no I/O, no logging.
 *  - CPU: F32, whatever is asked (the CPU kernels compute in fp32 and read BF16 / F16 weights
 *    as they are; a BF16 request changes nothing there).
 *  - CUDA, F32 or BF16 asked: that.
 *  - CUDA, AUTO: BF16 for a BF16 checkpoint (the published Kimi-Linear; F32 would need twice
 *    the memory, ~190 GB for the 48B model); F32 for an F32 checkpoint; F32 for an F16 one too:
 *    the GPU computes in F32 or BF16 only, and BF16 would drop 3 of F16's mantissa bits, so auto
 *    never rounds the stored weights (ask for bf16 to halve the memory).
 * DUET_ERR_INVALID for a value outside the enums.
 */
duet_status_t duet_model_dtype_resolve(duet_device_kind_t dev, duet_dtype_t ckpt,
                                       duet_model_dtype_t req, duet_dtype_t *out_p);

/* Fill opts with the defaults above. */
void duet_model_opts_default(duet_model_opts_t *opts);

/*
 * The descriptors of the cache pools a model of config c loads with under opts (mem NULL): the
 * one place that says which pools a model has and how large they are, for the load and for
 * whoever sizes pools before loading (engine/cache_plan.h). A pool the model does not have gets
 * n_layers 0 (no MLA layers: no KV pool; no KDA layers: no state or replay pool; spec_rows 0: no
 * replay pool). Pure; opts are not validated here.
 */
void duet_model_pool_descs(const duet_model_config_t *c, const duet_model_opts_t *opts,
                           duet_kv_pool_desc_t *kv, duet_kda_pool_desc_t *kda,
                           duet_replay_pool_desc_t *replay);

/*
 * Load checkpoint folder `dir` (config.json + safetensors), validate it, bind the weights,
 * resolve the compute dtype (opts->dtype and the checkpoint's dtype, duet_model_dtype_resolve;
 * logged), create the backend and the cache pools. Errors carry a detail naming the file/tensor.
 */
duet_status_t duet_model_load(const char *dir, const duet_model_opts_t *opts, duet_model_t **m_p);
/*
 * A model of config `cfg` with random weights generated on the device from `seed`, no
 * checkpoint (benchmarks of real model sizes). CUDA only: DUET_ERR_UNSUPPORTED on the CPU.
 * opts->dtype must be F32 or BF16 (no checkpoint for AUTO to follow: DUET_ERR_INVALID).
 */
duet_status_t duet_model_create_random(const duet_model_config_t *cfg,
                                       const duet_model_opts_t *opts, uint64_t seed,
                                       duet_model_t **m_p);
/* CUDA models: the device pools (NULL / 0 on the CPU), for benchmarks that fill a context. */
void duet_model_device_pools(duet_model_t *m, void **kv, size_t *kv_bytes, void **kda,
                             size_t *kda_bytes);
/* Human-readable backend summary for logs ("cpu, 8 threads" / "cuda, BF16 weights, ..."). */
void duet_model_describe_backend(const duet_model_t *m, char *buf, size_t cap);
void duet_model_free(duet_model_t *m); /* accepts NULL */

const duet_model_config_t *duet_model_config(const duet_model_t *m);
const duet_model_opts_t *duet_model_opts(const duet_model_t *m);
duet_kv_pool_t *duet_model_kv_pool(duet_model_t *m);
duet_kda_pool_t *duet_model_kda_pool(duet_model_t *m);
/* The KDA replay pool, addressed by a sequence's kda_slot; NULL without spec_rows or without KDA
 * layers. Outside the engine only a transfer writes it (a moved running request's rows, then
 * duet_model_seq_set_received); tests and tools read it. */
duet_replay_pool_t *duet_model_replay_pool(duet_model_t *m);

/* A sequence's cache handle. Fields are read-only for callers. */
typedef struct {
    int32_t id;         /* index in the model's sequence table; -1 when closed */
    int32_t kda_slot;   /* KDA state slot; -1 when the model has no KDA layers */
    int64_t n_tokens;   /* tokens committed: their KV is in the pages and (n_replay aside) their
                           state in the KDA pool */
    int64_t cap_tokens; /* n_pages * page_tokens */
    int32_t *pages;     /* MLA pages in order; model-owned table row */
    int64_t n_pages;
    int64_t n_pending; /* rows of the last verify item, not yet accepted (duet_model_seq_accept):
                          while > 0 the sequence may not be forwarded (closing it is fine) */
    int64_t n_replay;  /* accepted rows (the last n_replay of n_tokens) whose KDA updates are
                          still in the replay pool, not yet in S and the conv windows: folded
                          in at the sequence's next forward or by duet_model_seq_commit. 0 on
                          a model without KDA layers */
} duet_seq_t;

/*
 * Open a sequence able to hold `max_tokens` tokens: reserves ceil(max_tokens / page_tokens)
 * pages (when the model has MLA layers) and a KDA state slot, all zeroed.
 * DUET_ERR_NO_SPACE when the pools cannot hold it; DUET_ERR_RANGE above max_seq_len.
 */
duet_status_t duet_model_seq_open(duet_model_t *m, int64_t max_tokens, duet_seq_t *seq_p);
/*
 * duet_model_seq_open for a prompt whose first n_shared * page_tokens tokens are a cached prefix
 * (the prefix cache, worker/prefix_cache.h): its first n_shared pages are `shared`, each gaining a
 * holder (duet_kv_pool_ref) and never written by it, and its KDA state and conv windows a copy of
 * kda_state (duet_model_kda_state_bytes bytes, the state after the prefix; NULL without KDA
 * layers). Afterwards n_tokens = n_shared * page_tokens. The pages may be a device pool's (the
 * same ids); the state is copied to the device when the KDA pool is there. DUET_ERR_UNSUPPORTED
 * as duet_model_prefix_supported says; else as seq_open.
 */
duet_status_t duet_model_seq_open_prefix(duet_model_t *m, int64_t max_tokens, const int32_t *shared,
                                         int64_t n_shared, const void *kda_state,
                                         duet_seq_t *seq_p);
/* DUET_OK when sequences of m can open on a cached prefix (MLA layers, one rank, and a KDA state
 * the host can copy: a host pool, or a backend with seq_state_copy), else DUET_ERR_UNSUPPORTED
 * with a detail led by `what`. */
duet_status_t duet_model_prefix_supported(const duet_model_t *m, const char *what);
/* Copy the sequence's KDA state and conv windows (after its n_tokens, which must all be folded
 * in: no pending or replay rows) to dst, duet_model_kda_state_bytes bytes. Errors as above. */
duet_status_t duet_model_seq_kda_read(const duet_model_t *m, const duet_seq_t *seq, void *dst);
/* Bytes of one sequence's KDA state and conv windows (0 without KDA layers). */
size_t duet_model_kda_state_bytes(const duet_model_t *m);

/*
 * The sequence's caches were filled from outside (a cache transfer from a context worker): they
 * now hold the first n_tokens tokens (KV pages and KDA state + conv windows after token n-1).
 * DUET_ERR_RANGE when n_tokens > cap_tokens or the sequence already holds tokens (committed or
 * pending). Afterwards n_pending = n_replay = 0 (the replay pool holds nothing of it).
 */
duet_status_t duet_model_seq_set_filled(duet_model_t *m, duet_seq_t *seq, int64_t n_tokens);

/*
 * A sequence whose pools were written from outside (a moved request): n_tokens of KV, the KDA
 * state through n_tokens - n_replay, and the last n_replay accepted rows in the replay pool,
 * folded in at its next forward (or duet_model_seq_commit). n_replay 0 == set_filled.
 *
 * The rows are rows [0, n_replay) of each KDA layer of the sequence's slot in the replay pool
 * (common/cache_layout.h), exactly what duet_model_seq_accept left there on the sending model;
 * afterwards n_pending = 0 and n_replay = n_replay, as after that accept. Errors (nothing
 * changes): duet_model_seq_set_filled's; DUET_ERR_RANGE for n_replay < 0, > n_tokens or >
 * spec_rows; DUET_ERR_UNSUPPORTED (n_replay > 0) on a backend without verify rows;
 * DUET_ERR_INVALID (n_replay > 0) for a model without KDA
 * layers or without a replay pool (spec_rows 0).
 */
duet_status_t duet_model_seq_set_received(duet_model_t *m, duet_seq_t *seq, int64_t n_tokens,
                                          int64_t n_replay);

/* Return the sequence's pages and slot. Accepts an already closed sequence, and one with pending
 * or unreplayed rows (they are dropped). */
void duet_model_seq_close(duet_model_t *m, duet_seq_t *seq);

/*
 * Keep the first n_rows rows of the sequence's last verify item: n_tokens += n_rows,
 * n_pending = 0, n_replay = n_rows (0 without KDA layers). Their MLA KV is already in the pages;
 * the rows after them are dropped (their page slots are overwritten by the next tokens); their
 * KDA updates are folded into S and the conv windows at the sequence's next forward, fused with
 * it and before its new rows, or by duet_model_seq_commit. A caller that sampled a token from
 * row n_rows - 1's logits passes it as the first token of the next forward. Errors (nothing
 * changes): DUET_ERR_INVALID for a closed sequence or one without pending rows (no verify since
 * the last accept), DUET_ERR_RANGE for n_rows outside 1..n_pending.
 */
duet_status_t duet_model_seq_accept(duet_model_t *m, duet_seq_t *seq, int64_t n_rows);

/*
 * The replay-only commit: fold the sequence's n_replay accepted rows into S and the conv windows
 * now, so the KDA pool holds exactly the state after its last committed token, as plain decode
 * would have left it (needed before the state is read from outside: a transfer, suspend,
 * migration; callers may call it before close). n_replay = 0 afterwards. Runs no layer hook.
 * DUET_OK and nothing done when n_replay is 0. DUET_ERR_INVALID for a closed sequence or one with
 * pending rows (accept them first).
 */
duet_status_t duet_model_seq_commit(duet_model_t *m, duet_seq_t *seq);

/*
 * A sequence's KDA state, copied out and back (a drafting model rolling back its rejected drafts;
 * later suspend / resume): every KDA layer's S and conv windows of its state slot, in the slot
 * layout of common/cache_layout.h (duet_kda_layout_slot_bytes; duet_kda_pool_state(slot, 0)
 * onward in the host pool). On the CPU the host pool is the state and a copy is a memcpy; a
 * backend whose state lives on a device copies through its seq_state_copy op (engine/backend.h).
 *
 * duet_model_seq_state_bytes: the bytes of one copy; 0 for a model without KDA layers (nothing
 * to copy: its caches are the MLA pages, which a rollback leaves in place).
 */
size_t duet_model_seq_state_bytes(const duet_model_t *m);

/*
 * Copy the sequence's KDA state, the state after its n_tokens committed tokens, into buf
 * (duet_model_seq_state_bytes(m) bytes; nothing is written for a model without KDA layers). The
 * sequence is unchanged; rows of a pending verify item are not part of the state. Errors:
 * DUET_ERR_INVALID for a closed sequence or one with accepted rows not yet folded into its state
 * (n_replay > 0: duet_model_seq_commit first); DUET_ERR_UNSUPPORTED on a backend that holds the
 * state where it cannot copy it from.
 */
duet_status_t duet_model_seq_state_save(duet_model_t *m, const duet_seq_t *seq, void *buf);

/*
 * Overwrite the sequence's KDA state with buf (what duet_model_seq_state_save wrote for a
 * sequence of this model). Pending verify rows and unreplayed accepted rows are dropped (they
 * were computed from the state being replaced); n_tokens is left as it is: the caller then makes
 * it the length the state belongs to (duet_model_seq_truncate does both for a rollback).
 * Errors: DUET_ERR_INVALID for a closed sequence, DUET_ERR_UNSUPPORTED as for save.
 */
duet_status_t duet_model_seq_state_restore(duet_model_t *m, duet_seq_t *seq, const void *buf);

/*
 * Roll the sequence back to its first n_tokens tokens (a drafting model dropping its rejected
 * drafts): n_tokens is set, pending and unreplayed rows are dropped; the MLA KV of later
 * positions stays in the pages and is overwritten by the next tokens. A model with KDA layers
 * cannot undo its recurrent state, so the caller passes `state`: what duet_model_seq_state_save
 * wrote when this sequence held exactly n_tokens tokens (the engine cannot check that; another
 * state gives wrong results, not an error); it is restored (duet_model_seq_state_restore).
 * Without KDA layers `state` is ignored and may be NULL. Errors (nothing changes):
 * DUET_ERR_INVALID for a closed sequence or, with KDA layers, a NULL state; DUET_ERR_RANGE when
 * n_tokens < 0 or > seq->n_tokens; duet_model_seq_state_restore's.
 */
duet_status_t duet_model_seq_truncate(duet_model_t *m, duet_seq_t *seq, int64_t n_tokens,
                                      const void *state);

/*
 * Grow an open sequence so that it can hold `max_tokens` tokens: take the pages it lacks (zeroed)
 * from the pool and append them to its page table; cap_tokens follows. A generation worker
 * reserves pages for what a request holds plus a step's growth and grows it as it decodes, so
 * that running out of pages happens inside a step, where the worker can suspend a request
 * (duet_model_seq_snapshot_save), rather than at admission. Nothing is done when the sequence
 * already holds enough. Errors (nothing changes): DUET_ERR_INVALID for a closed sequence,
 * DUET_ERR_RANGE above max_seq_len, DUET_ERR_NO_SPACE when the pool has too few free pages.
 */
duet_status_t duet_model_seq_grow(duet_model_t *m, duet_seq_t *seq, int64_t max_tokens);

/*
 * Suspend and resume (a generation worker out of pages): a sequence's whole cache, the MLA KV of
 * its committed tokens (every MLA layer of the pages that hold them, in page order, one
 * duet_kv_pool_block_bytes block per (page, layer)) then its KDA state (duet_model_seq_state_save's
 * bytes), copied to a host buffer so that its pages and slot can be freed (close it), and copied
 * back into a freshly opened sequence later. The resumed sequence computes exactly what the
 * suspended one would have: the bytes are the caches' own.
 *
 * duet_model_seq_snapshot_bytes: the bytes of a snapshot of a sequence holding n_tokens tokens.
 */
size_t duet_model_seq_snapshot_bytes(const duet_model_t *m, int64_t n_tokens);

/*
 * Copy the sequence's cache into buf (duet_model_seq_snapshot_bytes(m, seq->n_tokens) bytes).
 * Accepted rows not yet folded into the KDA state are folded in first (duet_model_seq_commit, the
 * replay-only commit), so the snapshot is the state after its last committed token. The sequence
 * is left open and otherwise unchanged. Errors: DUET_ERR_INVALID for a closed sequence or one with
 * pending verify rows (accept them first); DUET_ERR_UNSUPPORTED on a backend whose pools live on
 * a device it cannot copy from (no seq_kv_copy / seq_state_copy), and duet_model_seq_commit's.
 */
duet_status_t duet_model_seq_snapshot_save(duet_model_t *m, duet_seq_t *seq, void *buf);

/*
 * Fill an empty open sequence (n_tokens 0, nothing pending; opened or grown to hold at least
 * n_tokens) from buf, what duet_model_seq_snapshot_save wrote for a sequence of this model holding
 * n_tokens tokens: it then holds them, as duet_model_seq_set_filled leaves a transferred one.
 * Errors (the sequence stays empty): DUET_ERR_INVALID for a closed sequence, DUET_ERR_RANGE when
 * n_tokens < 0, above cap_tokens or the sequence is not empty, DUET_ERR_UNSUPPORTED as for save.
 */
duet_status_t duet_model_seq_snapshot_restore(duet_model_t *m, duet_seq_t *seq, const void *buf,
                                              int64_t n_tokens);

/*
 * Make the host pools hold what the backend holds of the sequence: its KV pages through n_tokens
 * and its KDA slot, copied from the device where the backend keeps them there (a no-op where the
 * host pools are the backend's own). Accepted rows still in a device replay pool are folded in
 * first (duet_model_seq_commit); rows in a host replay pool stay there. What a transfer that reads
 * the host pools needs before it sends a sequence computed on a device (a generation worker's
 * move). Errors: DUET_ERR_INVALID for a closed sequence or one with pending verify rows,
 * duet_model_seq_commit's, DUET_ERR_UNSUPPORTED / DEVICE from the copies.
 */
duet_status_t duet_model_seq_sync_host(duet_model_t *m, duet_seq_t *seq);

typedef enum {
    DUET_LOGITS_NONE = 0,   /* no logits (a prefill chunk that is not the prompt's last) */
    DUET_LOGITS_LAST = 1,   /* logits of the item's last token: [1][vocab] */
    DUET_LOGITS_ALL = 2,    /* logits of every token of the item: [n_tokens][vocab] */
    DUET_LOGITS_TOKEN = 3,  /* no logits: the model draws the next token (on the device for
                               CUDA) with `sampling` and the uniform `u` into *token_out */
    DUET_LOGITS_ARGMAX = 4, /* no logits: the arg-max of every row's logits (duet_argmax's,
                               the lowest id of a tie; on the device for CUDA) into
                               token_out[0..n_tokens): greedy speculation keeps the vocabulary
                               rows of a verify on the device */
} duet_logits_mode_t;

typedef struct {
    duet_seq_t *seq;
    const int32_t *tokens; /* new tokens, appended at seq->n_tokens */
    int64_t n_tokens;      /* >= 1; a verify item 2..spec_rows */
    duet_logits_mode_t logits_mode;
    float *logits;            /* caller-owned, rows per logits_mode */
    duet_sampling_t sampling; /* DUET_LOGITS_TOKEN: the rule (duet_sampler_sample's) */
    float u;                  /* DUET_LOGITS_TOKEN: this token's draw, duet_sampling_draw() */
    int32_t *token_out;       /* DUET_LOGITS_TOKEN: where the token goes; ARGMAX: n_tokens */
    int verify; /* 1: the rows are tentative (speculative decoding): the sequence's next token then
                   k drafts, n_tokens = k + 1 in 2..spec_rows, logits_mode DUET_LOGITS_ALL or
                   DUET_LOGITS_ARGMAX.
                   Each row is computed from the committed caches as plain decode would compute
                   it after the rows before it; nothing is committed: afterwards seq->n_pending =
                   n_tokens and seq->n_tokens is unchanged (duet_model_seq_accept keeps a prefix).
                   0: ordinary rows, committed by the step */
} duet_batch_item_t;

/*
 * Called during duet_model_forward() right after the token mixer of `layer` ran for every item of
 * the batch: for an MLA layer (mla_index >= 0) that layer's KV of every item is then final in the
 * pool; for a KDA layer (kda_index >= 0) its state and conv windows. A context worker streams the
 * layer's pages from here. The hook must not call into the model.
 */
typedef void (*duet_model_layer_hook_fn)(void *user, int64_t layer, int64_t mla_index,
                                         int64_t kda_index);
void duet_model_set_layer_hook(duet_model_t *m, duet_model_layer_hook_fn fn, void *user);

/*
 * Run one step over the batch: append each item's tokens to its sequence, update the caches
 * and write the requested logits. The total of n_tokens must be <= max_batch_tokens, a sequence
 * may appear once per call and must have no pending verify rows, tokens must be in [0, vocab).
 * A sequence's accepted rows not yet replayed (n_replay) are folded into its state first, in the
 * same step; n_replay is 0 afterwards. A verify item (its `verify` field) leaves its sequence's
 * n_tokens and committed caches as they were and sets n_pending. On error no sequence is
 * advanced (nor its n_replay, n_pending changed) only if the error is detected before compute
 * (validation); after an error during compute the batch's caches are undefined. Errors are
 * DUET_ERR_INVALID/RANGE, and DUET_ERR_UNSUPPORTED for a verify item on a backend without verify
 * rows.
 *
 * Batch invariance: an item's results (logits, caches) are bit-identical whatever else is in the
 * batch and wherever it sits in it (every kernel computes a row the same way for any row count),
 * so a request served in a continuous batch gives exactly duet-generate's output, provided its
 * prompt is cut into the same prefill chunks.
 */
duet_status_t duet_model_forward(duet_model_t *m, duet_batch_item_t *items, int64_t n_items);

#endif
