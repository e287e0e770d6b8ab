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

#include "common/status.h"
#include "engine/cache.h"
#include "proto/duet.pb-c.h"

typedef struct {
    int64_t page_tokens; /* tokens per page (a block) */
    int64_t max_entries; /* snapshots kept at most (cache.prefix_snapshots) */
    size_t state_bytes;  /* one snapshot: duet_model_kda_state_bytes (0: no KDA layers) */
} duet_prefix_cache_desc_t;

typedef struct {
    uint64_t lookups, hits; /* prompts looked up; those that reused a prefix */
    uint64_t tokens_saved;  /* prompt tokens not prefilled thanks to a hit */
    uint64_t inserts, evictions;
    int64_t entries;
    int64_t pages; /* distinct pages the entries hold */
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

duet_prefix_cache_stats_t duet_prefix_cache_stats(const duet_prefix_cache_t *pc);

/*
 * The cache's summary for the router (heartbeats): each entry's hash (common/prefix_hash.h, the
 * hash of the whole prefix it holds, which a prompt resumes from), at most max_out of them in no
 * particular order. Returns how many were written.
 */
size_t duet_prefix_cache_summary(const duet_prefix_cache_t *pc, uint64_t *out, size_t max_out);

/* Fill hb's prefix_* fields: the counters, and the summary (prefix_hashes, pointing into pc until
 * the next call). */
void duet_prefix_cache_heartbeat(duet_prefix_cache_t *pc, Duet__Heartbeat *hb);

#endif
