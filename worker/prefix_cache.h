/*
 * The prefix cache of a worker that prefills (docs/architecture.md, "Prefix cache"): finished
 * prompt blocks kept by content, so that a later prompt starting with the same tokens reuses
 * their MLA pages and the KDA layers' state after them and prefills only the rest.
 *
 * An entry is a prompt prefix of whole pages (n_blocks * page_tokens tokens) named by a hash
 * chain over its page-sized token blocks (the tokens themselves are kept and compared, so a hash
 * collision is never a hit), holding its pages (one hold each on the KV pool, duet_kv_pool_ref:
 * a page in use by a request or a transfer stays allocated whatever the cache drops) and a copy
 * of every KDA layer's state and conv windows after the prefix (the snapshot). Entries are
 * dropped least recently used first, when the cache is full or when the pool needs pages.
 * Single-threaded (the worker's loop).
 */
#ifndef DUET_WORKER_PREFIX_CACHE_H
#define DUET_WORKER_PREFIX_CACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/config.h"
#include "common/status.h"
#include "engine/cache.h"
#include "engine/model.h"
#include "proto/duet.pb-c.h"

/* The keys of a worker that keeps a prefix cache (duet-ctx, duet-gen);
 * duet_prefix_cache_from_config reads them. */
#define DUET_PREFIX_CACHE_CONFIG_KEYS                                                              \
    {"cache.prefix",                                                                               \
     DUET_CONFIG_BOOL,                                                                             \
     "false",                                                                                      \
     "keep finished prompts' pages and KDA state snapshots by content and prefill only what a "    \
     "new prompt adds to a cached prefix (worker/prefix_cache.h; one rank)",                       \
     .min = NULL,                                                                                  \
     .max = NULL},                                                                                 \
        {"cache.prefix_snapshots",                                                                 \
         DUET_CONFIG_INT,                                                                          \
         "16",                                                                                     \
         "prefix snapshots kept at most (each holds its prefix's pages and one copy of the KDA "   \
         "state: the worker logs its size)",                                                       \
         .min = "1",                                                                               \
         .max = "4096"},                                                                           \
    {                                                                                              \
        "cache.prefix_state_every", DUET_CONFIG_INT, "1",                                          \
            "snapshot the KDA state every this many pages of a prompt (at prefill chunk ends; "    \
            "duet-gen also as a request decodes, for its next turn)",                              \
            .min = "1", .max = "65536"                                                             \
    }

typedef struct {
    int64_t page_tokens; /* tokens per page (a block) */
    int64_t max_entries; /* snapshots kept at most (cache.prefix_snapshots) */
    size_t state_bytes;  /* one snapshot: duet_model_kda_state_bytes (0: no KDA layers) */
    int64_t
        state_every; /* snapshot grid: every this many pages (cache.prefix_state_every; 0 = 1) */
} duet_prefix_cache_desc_t;

typedef struct {
    uint64_t lookups, hits; /* prompts looked up; those that reused a prefix */
    uint64_t tokens_saved;  /* prompt tokens not prefilled thanks to a hit */
    uint64_t inserts, evictions;
    int64_t entries;
    int64_t pages;           /* distinct pages the entries hold */
    int64_t pages_evictable; /* of those, pages no request holds (evictions would free them) */
} duet_prefix_cache_stats_t;

typedef struct duet_prefix_cache duet_prefix_cache_t;

/* A cache over kv (which outlives it). DUET_ERR_INVALID for a bad desc, DUET_ERR_NOMEM. */
duet_status_t duet_prefix_cache_create(const duet_prefix_cache_desc_t *desc, duet_kv_pool_t *kv,
                                       duet_prefix_cache_t **pc_p);
/* Drop every entry (their page holds go back) and free the cache. Accepts NULL. */
void duet_prefix_cache_destroy(duet_prefix_cache_t *pc);

/*
 * The longest cached prefix of prompt[0..n) that leaves at least one token to prefill: its
 * block count (0 when none), with *pages_p (n_blocks pages) and *state_p (the snapshot) valid
 * until the next insert or evict. A hit is the most recently used entry afterwards.
 */
int64_t duet_prefix_cache_lookup(duet_prefix_cache_t *pc, const int32_t *prompt, int64_t n,
                                 const int32_t **pages_p, const void **state_p);

/* Count one prompt's lookup (once, however often it was retried), a hit when n_blocks > 0. */
void duet_prefix_cache_count(duet_prefix_cache_t *pc, int64_t n_blocks);

/*
 * Keep prompt[0..n_blocks * page_tokens), held in pages[0..n_blocks) (filled, never to be
 * written again), with its snapshot written by fill(user, dst) (state_bytes bytes; nonzero
 * return: the entry is not made). The cache takes one hold on each page. An entry of the same
 * tokens is only refreshed (most recently used). The least recently used entry goes first when
 * the cache is full. DUET_ERR_NOMEM, or fill's failure (DUET_ERR_INVALID): nothing is kept.
 */
duet_status_t duet_prefix_cache_insert(duet_prefix_cache_t *pc, const int32_t *prompt,
                                       int64_t n_blocks, const int32_t *pages,
                                       int (*fill)(void *user, void *dst), void *user);

/* Drop the least recently used entry (its page holds go back). false when the cache is empty. */
bool duet_prefix_cache_evict(duet_prefix_cache_t *pc);

/* Drop the entry of exactly prompt[0..n_blocks * page_tokens) if there is one (a request's
 * earlier decode snapshot, superseded by a longer one); whether one was dropped. */
bool duet_prefix_cache_forget(duet_prefix_cache_t *pc, const int32_t *prompt, int64_t n_blocks);

/* Entries kept now (cheap). Accepts NULL (0). */
int64_t duet_prefix_cache_entries(const duet_prefix_cache_t *pc);
/* The counters and what the entries hold now (a pass over their pages; no allocation). */
duet_prefix_cache_stats_t duet_prefix_cache_stats(duet_prefix_cache_t *pc);

/*
 * The cache's summary for the router (heartbeats): each entry's hash (common/prefix_hash.h, the
 * hash of the whole prefix it holds, which a prompt resumes from), at most max_out of them in no
 * particular order. Returns how many were written.
 */
size_t duet_prefix_cache_summary(const duet_prefix_cache_t *pc, uint64_t *out, size_t max_out);

/* Fill hb's prefix_* fields: the counters, and the summary (prefix_hashes, pointing into pc until
 * the next call). */
void duet_prefix_cache_heartbeat(duet_prefix_cache_t *pc, Duet__Heartbeat *hb);

/* ------------------------------------------------------------------ a worker's sequences on it
 *
 * What both workers do with the cache around the model's sequences (one home for the rules: the
 * chunk grid, eviction before refusing). pc may be NULL (cache.prefix off): plain model calls.
 */

/*
 * From a worker's keys (DUET_PREFIX_CACHE_CONFIG_KEYS): *pc_p NULL when cache.prefix is off,
 * else a cache over m's KV pool (DUET_ERR_UNSUPPORTED where m cannot share pages:
 * duet_model_prefix_supported). chunk (batch.prefill_chunk) is only logged with the sizes.
 */
duet_status_t duet_prefix_cache_from_config(const duet_config_t *cfg, duet_model_t *m,
                                            int64_t chunk, duet_prefix_cache_t **pc_p);

/*
 * Open *seq able to hold max_tokens for a prompt of n_prompt tokens: on the longest cached prefix
 * of prompt (the lookup counted once) when there is one, so that seq->n_tokens tokens are already
 * in (prefill from there), else empty. prompt NULL: no lookup (a request that needs every
 * prompt row's logits, or one whose caches arrive by transfer). When the KV pool is short of
 * pages, the least recently used entries are dropped until it fits or the cache is empty (pages a
 * request holds stay with it). Errors as duet_model_seq_open (seq->id -1).
 */
duet_status_t duet_prefix_cache_seq_open(duet_prefix_cache_t *pc, duet_model_t *m,
                                         const int32_t *prompt, int64_t n_prompt,
                                         int64_t max_tokens, duet_seq_t *seq);

/* duet_model_seq_grow, dropping least recently used entries while the pool is short of pages. */
duet_status_t duet_prefix_cache_seq_grow(duet_prefix_cache_t *pc, duet_model_t *m, duet_seq_t *seq,
                                         int64_t max_tokens);

/*
 * Keep seq's tokens (tokens[0..seq->n_tokens), what it holds) when seq->n_tokens is on the
 * snapshot grid (a multiple of page_tokens x state_every) and, for chunk > 0 (a prefill), a
 * multiple of chunk: a later prompt resumes there on duet-generate's chunk grid, so its output is
 * a miss's. chunk 0 (a decoding sequence): any grid point; accepted rows not yet folded into the
 * KDA state are folded in first (duet_model_seq_commit reaches plain decode's state bit for bit,
 * so the sequence's next tokens do not change); the state is then decode's, not a chunked
 * prefill's (docs/architecture.md, "Prefix cache": equal to rounding). A sequence with pending
 * verify rows is not kept. Returns the entry's block count, 0 when nothing was kept (off the
 * grid, or not kept: logged).
 */
int64_t duet_prefix_cache_keep(duet_prefix_cache_t *pc, duet_model_t *m, duet_seq_t *seq,
                               const int32_t *tokens, int64_t chunk);

#endif
