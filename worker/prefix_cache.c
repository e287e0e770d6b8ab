/*
 * Entries in a small array searched linearly (a worker keeps tens of snapshots: the hash chain
 * is computed once per lookup, each length compared against every entry's). The hash chain is
 * common/prefix_hash.h's, the router's too (placement by cached prefix).
 */
#include "worker/prefix_cache.h"

#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/prefix_hash.h"
#include "proto/frame.h"

typedef struct {
    uint64_t hash; /* the chain's hash after n_blocks blocks */
    int64_t n_blocks;
    int32_t *tokens; /* owned, n_blocks * page_tokens */
    int32_t *pages;  /* owned, n_blocks; one hold each on the pool */
    void *state;     /* owned, state_bytes */
    uint64_t used;   /* tick of the last insert or hit */
} pc_entry_t;

struct duet_prefix_cache {
    duet_prefix_cache_desc_t d;
    duet_kv_pool_t *kv;
    pc_entry_t *e; /* [d.max_entries], the first n used */
    int64_t n;
    uint64_t tick;
    duet_prefix_cache_stats_t st;
    uint64_t summary[DUET_PROTO_PREFIX_HASHES]; /* the last heartbeat's prefix_hashes */
    int32_t *holds; /* [the pool's pages] stats' scratch, all 0 between calls: the cache's holds */
};

duet_status_t duet_prefix_cache_create(const duet_prefix_cache_desc_t *desc, duet_kv_pool_t *kv,
                                       duet_prefix_cache_t **pc_p)
{
    if (desc->page_tokens <= 0 || desc->max_entries <= 0 || desc->state_every < 0 || kv == NULL)
        return duet_error_set(DUET_ERR_INVALID,
                              "prefix cache: page_tokens %lld and entries %lld "
                              "must be positive, over a KV pool",
                              (long long)desc->page_tokens, (long long)desc->max_entries);
    duet_prefix_cache_t *pc = calloc(1, sizeof(*pc));
    if (pc == NULL || (pc->e = calloc((size_t)desc->max_entries, sizeof(*pc->e))) == NULL ||
        (pc->holds = calloc((size_t)duet_kv_pool_desc(kv)->n_pages, sizeof(*pc->holds))) == NULL) {
        if (pc != NULL)
            free(pc->e);
        free(pc);
        return duet_error_set(DUET_ERR_NOMEM, "prefix cache: out of memory");
    }
    pc->d = *desc;
    if (pc->d.state_every == 0)
        pc->d.state_every = 1;
    pc->kv = kv;
    *pc_p = pc;
    return DUET_OK;
}

static void entry_drop(duet_prefix_cache_t *pc, int64_t i)
{
    pc_entry_t *e = &pc->e[i];
    duet_kv_pool_free(pc->kv, e->pages, e->n_blocks);
    free(e->tokens);
    free(e->pages);
    free(e->state);
    pc->e[i] = pc->e[--pc->n];
    memset(&pc->e[pc->n], 0, sizeof(pc->e[pc->n]));
    pc->st.entries = pc->n;
}

void duet_prefix_cache_destroy(duet_prefix_cache_t *pc)
{
    if (pc == NULL)
        return;
    while (pc->n > 0)
        entry_drop(pc, pc->n - 1);
    free(pc->e);
    free(pc->holds);
    free(pc);
}

static int64_t entry_of(const duet_prefix_cache_t *pc, uint64_t hash, int64_t n_blocks,
                        const int32_t *tokens)
{
    const size_t bytes = sizeof(*tokens) * (size_t)(n_blocks * pc->d.page_tokens);
    for (int64_t i = 0; i < pc->n; i++)
        if (pc->e[i].n_blocks == n_blocks && pc->e[i].hash == hash &&
            memcmp(pc->e[i].tokens, tokens, bytes) == 0)
            return i;
    return -1;
}

int64_t duet_prefix_cache_lookup(duet_prefix_cache_t *pc, const int32_t *prompt, int64_t n,
                                 const int32_t **pages_p, const void **state_p)
{
    const int64_t P = pc->d.page_tokens;
    int64_t best = -1;
    uint64_t h = DUET_PREFIX_HASH_SEED;
    for (int64_t k = 1; k * P < n; k++) { /* at least one token left to prefill */
        h = duet_prefix_hash_block(h, prompt + (k - 1) * P, P);
        int64_t i = entry_of(pc, h, k, prompt);
        if (i >= 0)
            best = i;
    }
    if (best < 0)
        return 0;
    pc_entry_t *e = &pc->e[best];
    e->used = ++pc->tick;
    *pages_p = e->pages;
    *state_p = e->state;
    return e->n_blocks;
}

bool duet_prefix_cache_evict(duet_prefix_cache_t *pc)
{
    if (pc->n == 0)
        return false;
    int64_t lru = 0;
    for (int64_t i = 1; i < pc->n; i++)
        if (pc->e[i].used < pc->e[lru].used)
            lru = i;
    entry_drop(pc, lru);
    pc->st.evictions++;
    return true;
}

bool duet_prefix_cache_forget(duet_prefix_cache_t *pc, const int32_t *prompt, int64_t n_blocks)
{
    uint64_t h = DUET_PREFIX_HASH_SEED;
    for (int64_t k = 0; k < n_blocks; k++)
        h = duet_prefix_hash_block(h, prompt + k * pc->d.page_tokens, pc->d.page_tokens);
    const int64_t i = n_blocks > 0 ? entry_of(pc, h, n_blocks, prompt) : -1;
    if (i < 0)
        return false;
    entry_drop(pc, i);
    return true;
}

duet_status_t duet_prefix_cache_insert(duet_prefix_cache_t *pc, const int32_t *prompt,
                                       int64_t n_blocks, const int32_t *pages,
                                       int (*fill)(void *user, void *dst), void *user)
{
    const int64_t P = pc->d.page_tokens;
    if (n_blocks <= 0)
        return duet_error_set(DUET_ERR_INVALID, "prefix cache: an entry of %lld blocks",
                              (long long)n_blocks);
    uint64_t h = DUET_PREFIX_HASH_SEED;
    for (int64_t k = 0; k < n_blocks; k++)
        h = duet_prefix_hash_block(h, prompt + k * P, P);
    int64_t have = entry_of(pc, h, n_blocks, prompt);
    if (have >= 0) {
        pc->e[have].used = ++pc->tick;
        return DUET_OK;
    }
    pc_entry_t e = {.hash = h, .n_blocks = n_blocks};
    e.tokens = malloc(sizeof(*e.tokens) * (size_t)(n_blocks * P));
    e.pages = malloc(sizeof(*e.pages) * (size_t)n_blocks);
    e.state = malloc(pc->d.state_bytes > 0 ? pc->d.state_bytes : 1);
    duet_status_t st = DUET_OK;
    if (e.tokens == NULL || e.pages == NULL || e.state == NULL)
        st = duet_error_set(DUET_ERR_NOMEM, "prefix cache: out of memory for an entry");
    else if (pc->d.state_bytes > 0 && fill(user, e.state) != 0)
        st = duet_error_set(DUET_ERR_INVALID, "prefix cache: the snapshot could not be read");
    if (st != DUET_OK) {
        free(e.tokens);
        free(e.pages);
        free(e.state);
        return st;
    }
    memcpy(e.tokens, prompt, sizeof(*e.tokens) * (size_t)(n_blocks * P));
    memcpy(e.pages, pages, sizeof(*e.pages) * (size_t)n_blocks);
    if (pc->n == pc->d.max_entries)
        (void)duet_prefix_cache_evict(pc);
    duet_kv_pool_ref(pc->kv, e.pages, n_blocks);
    e.used = ++pc->tick;
    pc->e[pc->n++] = e;
    pc->st.inserts++;
    pc->st.entries = pc->n;
    return DUET_OK;
}

void duet_prefix_cache_count(duet_prefix_cache_t *pc, int64_t n_blocks)
{
    pc->st.lookups++;
    if (n_blocks > 0) {
        pc->st.hits++;
        pc->st.tokens_saved += (uint64_t)(n_blocks * pc->d.page_tokens);
    }
}

int64_t duet_prefix_cache_entries(const duet_prefix_cache_t *pc)
{
    return pc != NULL ? pc->n : 0;
}

duet_prefix_cache_stats_t duet_prefix_cache_stats(duet_prefix_cache_t *pc)
{
    duet_prefix_cache_stats_t st = pc->st;
    st.pages = st.pages_evictable = 0;
    /* two passes over the entries' pages, the second leaving the scratch all 0 again */
    for (int64_t i = 0; i < pc->n; i++)
        for (int64_t k = 0; k < pc->e[i].n_blocks; k++)
            pc->holds[pc->e[i].pages[k]]++;
    for (int64_t i = 0; i < pc->n; i++)
        for (int64_t k = 0; k < pc->e[i].n_blocks; k++) {
            const int32_t page = pc->e[i].pages[k];
            if (pc->holds[page] == 0)
                continue; /* counted already */
            st.pages++;
            st.pages_evictable += pc->holds[page] == duet_kv_pool_holders(pc->kv, page);
            pc->holds[page] = 0;
        }
    return st;
}

size_t duet_prefix_cache_summary(const duet_prefix_cache_t *pc, uint64_t *out, size_t max_out)
{
    size_t n = 0;
    uint64_t floor = 0; /* with more entries than room: only those used after the floor */
    if ((size_t)pc->n > max_out) {
        /* the max_out-th most recent tick: entries' ticks are distinct */
        for (int64_t i = 0; i < pc->n; i++) {
            size_t newer = 0;
            for (int64_t j = 0; j < pc->n; j++)
                newer += pc->e[j].used > pc->e[i].used;
            if (newer == max_out) {
                floor = pc->e[i].used;
                break;
            }
        }
    }
    for (int64_t i = 0; i < pc->n && n < max_out; i++)
        if (pc->e[i].used > floor)
            out[n++] = pc->e[i].hash;
    return n;
}

void duet_prefix_cache_heartbeat(duet_prefix_cache_t *pc, Duet__Heartbeat *hb)
{
    const duet_prefix_cache_stats_t ps = duet_prefix_cache_stats(pc);
    hb->prefix_lookups = ps.lookups;
    hb->prefix_hits = ps.hits;
    hb->prefix_tokens_saved = ps.tokens_saved;
    hb->prefix_evictions = ps.evictions;
    hb->prefix_entries = (uint32_t)ps.entries;
    hb->prefix_pages = (uint32_t)ps.pages;
    hb->prefix_pages_evictable = (uint32_t)ps.pages_evictable;
    hb->n_prefix_hashes = duet_prefix_cache_summary(pc, pc->summary, DUET_PROTO_PREFIX_HASHES);
    hb->prefix_hashes = pc->summary;
    hb->prefix_page_tokens = (uint32_t)pc->d.page_tokens;
}

/* ------------------------------------------------------------------ a worker's sequences on it */

duet_status_t duet_prefix_cache_from_config(const duet_config_t *cfg, duet_model_t *m,
                                            int64_t chunk, duet_prefix_cache_t **pc_p)
{
    *pc_p = NULL;
    if (!duet_config_get_bool(cfg, "cache.prefix"))
        return DUET_OK;
    duet_status_t st = duet_model_prefix_supported(m, "cache.prefix");
    if (st != DUET_OK)
        return st;
    const duet_model_opts_t *mo = duet_model_opts(m);
    const duet_prefix_cache_desc_t d = {
        .page_tokens = mo->page_tokens,
        .max_entries = duet_config_get_int(cfg, "cache.prefix_snapshots"),
        .state_bytes = duet_model_kda_state_bytes(m),
        .state_every = duet_config_get_int(cfg, "cache.prefix_state_every"),
    };
    if ((st = duet_prefix_cache_create(&d, duet_model_kv_pool(m), pc_p)) != DUET_OK)
        return st;
    DUET_LOG_INFO("prefix cache: up to %lld snapshots of %.1f MiB (KDA state) each, one every "
                  "%lld tokens at prefill chunk ends (%lld tokens)",
                  (long long)d.max_entries, (double)d.state_bytes / (1 << 20),
                  (long long)(d.page_tokens * (*pc_p)->d.state_every), (long long)chunk);
    return DUET_OK;
}

/* Whether a failed open or grow for `pages` more pages is the pool's shortage that dropping an
 * entry may end (not a state slot's, nor max_seq_len's). */
static bool pc_short(duet_prefix_cache_t *pc, duet_status_t st, int64_t pages)
{
    return pc != NULL && st == DUET_ERR_NO_SPACE && duet_kv_pool_n_free(pc->kv) < pages;
}

duet_status_t duet_prefix_cache_seq_open(duet_prefix_cache_t *pc, duet_model_t *m,
                                         const int32_t *prompt, int64_t n_prompt,
                                         int64_t max_tokens, duet_seq_t *seq)
{
    for (;;) {
        const int32_t *pages = NULL;
        const void *state = NULL;
        const int64_t k = pc != NULL && prompt != NULL
                              ? duet_prefix_cache_lookup(pc, prompt, n_prompt, &pages, &state)
                              : 0;
        duet_status_t st = k > 0 ? duet_model_seq_open_prefix(m, max_tokens, pages, k, state, seq)
                                 : duet_model_seq_open(m, max_tokens, seq);
        if (st == DUET_OK) {
            if (pc != NULL && prompt != NULL)
                duet_prefix_cache_count(pc, k);
            return DUET_OK;
        }
        seq->id = -1;
        const int64_t P = pc != NULL ? pc->d.page_tokens : 1;
        if (!pc_short(pc, st, (max_tokens + P - 1) / P - k) || !duet_prefix_cache_evict(pc))
            return st;
    }
}

duet_status_t duet_prefix_cache_seq_grow(duet_prefix_cache_t *pc, duet_model_t *m, duet_seq_t *seq,
                                         int64_t max_tokens)
{
    for (;;) {
        duet_status_t st = duet_model_seq_grow(m, seq, max_tokens);
        if (st == DUET_OK)
            return st;
        const int64_t P = pc != NULL ? pc->d.page_tokens : 1;
        if (!pc_short(pc, st, (max_tokens + P - 1) / P - seq->n_pages) ||
            !duet_prefix_cache_evict(pc))
            return st;
    }
}

typedef struct {
    const duet_model_t *m;
    const duet_seq_t *seq;
} pc_snap_t;

static int pc_snapshot_fill(void *user, void *dst)
{
    const pc_snap_t *sn = user;
    return duet_model_seq_kda_read(sn->m, sn->seq, dst) == DUET_OK ? 0 : -1;
}

int64_t duet_prefix_cache_keep(duet_prefix_cache_t *pc, duet_model_t *m, duet_seq_t *seq,
                               const int32_t *tokens, int64_t chunk)
{
    const int64_t n = seq->n_tokens;
    if (pc == NULL || tokens == NULL || n <= 0 ||
        n % (pc->d.page_tokens * pc->d.state_every) != 0 || (chunk > 0 && n % chunk != 0) ||
        seq->n_pending > 0)
        return 0;
    if (seq->n_replay > 0 && duet_model_seq_commit(m, seq) != DUET_OK) {
        DUET_LOG_WARN("prefix cache: not kept: %s", duet_error_last());
        return 0;
    }
    const pc_snap_t sn = {m, seq};
    const int64_t n_blocks = n / pc->d.page_tokens;
    if (duet_prefix_cache_insert(pc, tokens, n_blocks, seq->pages, pc_snapshot_fill, (void *)&sn) !=
        DUET_OK) {
        DUET_LOG_WARN("prefix cache: not kept: %s", duet_error_last());
        return 0;
    }
    return n_blocks;
}
