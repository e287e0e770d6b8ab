/*
 * The prefix cache (worker/prefix_cache.h) over a real KV pool: the longest cached prefix wins
 * and always leaves a token to prefill; a token differing anywhere in a block is a miss (the
 * tokens are compared, not only the hash); entries hold their pages, so a page a request still
 * holds stays allocated when the cache drops it and returns to the pool with its last holder;
 * LRU order decides evictions; a failed snapshot makes no entry. (A sequence opened on a cached
 * prefix is checked end to end by prefix_cache_cluster: its answers equal duet-generate's.)
 */
#include <criterion/criterion.h>
#include <string.h>

#include "engine/cache.h"
#include "worker/prefix_cache.h"

#define P 4

static duet_kv_pool_t *pool(int64_t pages)
{
    duet_kv_pool_desc_t d = {
        .page_tokens = P, .n_pages = pages, .n_layers = 1, .token_dim = 2, .dtype = DUET_DTYPE_F32};
    duet_kv_pool_t *kv = NULL;
    cr_assert_eq(duet_kv_pool_create(&d, &kv), DUET_OK, "%s", duet_error_last());
    return kv;
}

static int fill_byte(void *user, void *dst)
{
    memset(dst, *(int *)user, 8);
    return 0;
}

static int fill_fails(void *user, void *dst)
{
    (void)user;
    (void)dst;
    return -1;
}

Test(prefix_cache, longest_prefix_that_leaves_a_token)
{
    duet_kv_pool_t *kv = pool(16);
    duet_prefix_cache_desc_t d = {.page_tokens = P, .max_entries = 4, .state_bytes = 8};
    duet_prefix_cache_t *pc;
    cr_assert_eq(duet_prefix_cache_create(&d, kv, &pc), DUET_OK);
    int32_t prompt[20];
    for (int i = 0; i < 20; i++)
        prompt[i] = 100 + i;
    int32_t pages[4];
    cr_assert_eq(duet_kv_pool_alloc(kv, 4, pages), DUET_OK);
    int one = 1, two = 2;
    cr_assert_eq(duet_prefix_cache_insert(pc, prompt, 1, pages, fill_byte, &one), DUET_OK);
    cr_assert_eq(duet_prefix_cache_insert(pc, prompt, 3, pages, fill_byte, &two), DUET_OK);
    const int32_t *got;
    const void *state;
    /* 20 tokens: 3 blocks cached (12 tokens), 8 left */
    cr_assert_eq(duet_prefix_cache_lookup(pc, prompt, 20, &got, &state), 3);
    duet_prefix_cache_count(pc, 3);
    duet_prefix_cache_count(pc, 1);
    cr_assert_eq(duet_prefix_cache_stats(pc).pages, 3, "distinct pages held");
    cr_assert_eq(memcmp(got, pages, 3 * sizeof(int32_t)), 0);
    cr_assert_eq(((const uint8_t *)state)[0], 2);
    /* exactly 12 tokens: the 3-block entry would leave nothing, the 1-block one is used */
    cr_assert_eq(duet_prefix_cache_lookup(pc, prompt, 12, &got, &state), 1);
    cr_assert_eq(((const uint8_t *)state)[7], 1);
    /* 4 tokens: nothing may be reused (no token would be left) */
    cr_assert_eq(duet_prefix_cache_lookup(pc, prompt, 4, &got, &state), 0);
    /* a different token in block 3: only block 1 matches; in block 1: a miss */
    prompt[9] = 7;
    cr_assert_eq(duet_prefix_cache_lookup(pc, prompt, 20, &got, &state), 1);
    prompt[0] = 7;
    cr_assert_eq(duet_prefix_cache_lookup(pc, prompt, 20, &got, &state), 0);
    duet_prefix_cache_stats_t st = duet_prefix_cache_stats(pc);
    cr_assert(st.lookups == 2 && st.hits == 2 && st.tokens_saved == 12 + 4 && st.entries == 2,
              "lookups %llu hits %llu saved %llu entries %lld", (unsigned long long)st.lookups,
              (unsigned long long)st.hits, (unsigned long long)st.tokens_saved,
              (long long)st.entries);
    duet_prefix_cache_destroy(pc);
    duet_kv_pool_free(kv, pages, 4);
    cr_assert_eq(duet_kv_pool_n_free(kv), 16);
    duet_kv_pool_destroy(kv);
}

Test(prefix_cache, pages_outlive_the_cache_while_held_and_return_with_the_last_holder)
{
    duet_kv_pool_t *kv = pool(8);
    duet_prefix_cache_desc_t d = {.page_tokens = P, .max_entries = 2, .state_bytes = 8};
    duet_prefix_cache_t *pc;
    cr_assert_eq(duet_prefix_cache_create(&d, kv, &pc), DUET_OK);
    int32_t a[12], b[12], c[12];
    for (int i = 0; i < 12; i++)
        a[i] = i, b[i] = 50 + i, c[i] = 90 + i;
    int32_t pa[2], pb[2], pcg[2];
    cr_assert_eq(duet_kv_pool_alloc(kv, 2, pa), DUET_OK);
    cr_assert_eq(duet_kv_pool_alloc(kv, 2, pb), DUET_OK);
    cr_assert_eq(duet_kv_pool_alloc(kv, 2, pcg), DUET_OK);
    int x = 3;
    cr_assert_eq(duet_prefix_cache_insert(pc, a, 2, pa, fill_byte, &x), DUET_OK);
    cr_assert_eq(duet_prefix_cache_insert(pc, b, 2, pb, fill_byte, &x), DUET_OK);
    cr_assert_eq(duet_kv_pool_holders(kv, pa[0]), 2);
    /* request a finishes: its pages stay, held by the cache */
    duet_kv_pool_free(kv, pa, 2);
    cr_assert_eq(duet_kv_pool_holders(kv, pa[0]), 1);
    cr_assert_eq(duet_kv_pool_n_free(kv), 2);
    /* a is used again, so b is the least recently used: a third entry evicts b */
    const int32_t *got;
    const void *state;
    cr_assert_eq(duet_prefix_cache_lookup(pc, a, 12, &got, &state), 2);
    cr_assert_eq(duet_prefix_cache_insert(pc, c, 2, pcg, fill_byte, &x), DUET_OK);
    cr_assert_eq(duet_prefix_cache_lookup(pc, b, 12, &got, &state), 0, "b was not evicted");
    cr_assert_eq(duet_prefix_cache_stats(pc).evictions, 1);
    /* b's request still holds its pages: evicting b freed none of them */
    cr_assert_eq(duet_kv_pool_holders(kv, pb[1]), 1);
    cr_assert_eq(duet_kv_pool_n_free(kv), 2);
    duet_kv_pool_free(kv, pb, 2);
    cr_assert_eq(duet_kv_pool_n_free(kv), 4);
    /* an entry whose snapshot cannot be read is not made and holds nothing */
    int32_t d4[12];
    for (int i = 0; i < 12; i++)
        d4[i] = 200 + i;
    cr_assert_eq(duet_prefix_cache_insert(pc, d4, 2, pcg, fill_fails, NULL), DUET_ERR_INVALID);
    cr_assert_eq(duet_prefix_cache_lookup(pc, d4, 12, &got, &state), 0);
    cr_assert_eq(duet_kv_pool_holders(kv, pcg[0]), 2, "c's request and c's entry");
    /* the same tokens again only refresh the entry */
    cr_assert_eq(duet_prefix_cache_insert(pc, c, 2, pcg, fill_byte, &x), DUET_OK);
    cr_assert_eq(duet_kv_pool_holders(kv, pcg[0]), 2);
    /* evict all: only pages no one else holds come back */
    while (duet_prefix_cache_evict(pc))
        ;
    cr_assert_eq(duet_kv_pool_n_free(kv), 6);
    duet_kv_pool_free(kv, pcg, 2);
    cr_assert_eq(duet_kv_pool_n_free(kv), 8);
    duet_prefix_cache_destroy(pc);
    duet_kv_pool_destroy(kv);
}
