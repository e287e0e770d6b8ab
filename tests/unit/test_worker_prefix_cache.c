/*
 * The prefix cache (worker/prefix_cache.h) over a real KV pool: the longest cached prefix wins
 * and always leaves a token to prefill; a token differing anywhere in a block is a miss (the
 * tokens are compared, not only the hash); entries hold their pages, so a page a request still
 * holds stays allocated when the cache drops it and returns to the pool with its last holder;
 * LRU order decides evictions; a failed snapshot makes no entry. Over the demo model: a sequence
 * opened on a cached chunk end computes a miss's logits bit for bit; an open or grow short of
 * pages evicts only what helps; a decode snapshot's KDA state is a prefill's to rounding
 * (measured). End to end: prefix_cache_cluster (ctx), prefix_cache_gen_cluster (gen).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/cache.h"
#include "engine/model.h"
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
    cr_assert_eq(duet_prefix_cache_stats(pc).pages_evictable, 0, "the test holds them too");
    duet_kv_pool_free(kv, pages + 1, 1); /* page 1: the cache's alone now */
    cr_assert_eq(duet_prefix_cache_stats(pc).pages_evictable, 1);
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
    /* page 0 held by both entries and the test: evictable only once the test lets it go */
    duet_kv_pool_free(kv, pages + 2, 2);
    cr_assert_eq(duet_prefix_cache_stats(pc).pages_evictable, 2);
    duet_kv_pool_free(kv, pages, 1);
    cr_assert_eq(duet_prefix_cache_stats(pc).pages_evictable, 3);
    cr_assert_eq(duet_prefix_cache_stats(pc).pages, 3, "the stats leave no count behind");
    duet_prefix_cache_destroy(pc);
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

/* ---- a worker's sequences on the cache, over the demo model ------------------------------------
 */

#define MP    16 /* the model's page_tokens */
#define CHUNK 32 /* the prefill cut: chunks start at multiples of it */

static duet_model_t *demo(int64_t kv_pages, int64_t max_seqs)
{
    duet_model_opts_t o;
    duet_model_opts_default(&o);
    o.n_threads = 1;
    o.device = DUET_DEVICE_CPU;
    o.dtype = DUET_MODEL_DTYPE_F32;
    o.max_seqs = max_seqs;
    o.max_seq_len = 256;
    o.max_batch_tokens = 64;
    o.page_tokens = MP;
    o.kv_pages = kv_pages;
    char dir[4096];
    snprintf(dir, sizeof(dir), "%s/models/duet-demo", DUET_SOURCE_DIR);
    duet_model_t *m = NULL;
    cr_assert_eq(duet_model_load(dir, &o, &m), DUET_OK, "%s: %s", dir, duet_error_last());
    return m;
}

static duet_prefix_cache_t *demo_cache(duet_model_t *m, int64_t max_entries)
{
    duet_prefix_cache_desc_t d = {.page_tokens = MP,
                                  .max_entries = max_entries,
                                  .state_bytes = duet_model_kda_state_bytes(m),
                                  .state_every = 1};
    duet_prefix_cache_t *pc;
    cr_assert_eq(duet_prefix_cache_create(&d, duet_model_kv_pool(m), &pc), DUET_OK);
    return pc;
}

/* Byte ids of a text (the demo model's vocabulary starts with the bytes). */
static void ids_of(const char *text, int32_t *out, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        out[i] = (unsigned char)text[i % (int64_t)strlen(text)];
}

/* Prefill toks[from..n) into s on the chunk grid, as a worker does; the last row's logits into
 * `last` (may be NULL); after each chunk duet_prefix_cache_keep (pc may be NULL). */
static void prefill(duet_model_t *m, duet_prefix_cache_t *pc, duet_seq_t *s, const int32_t *toks,
                    int64_t n, float *last)
{
    while (s->n_tokens < n) {
        int64_t end = (s->n_tokens / CHUNK + 1) * CHUNK;
        end = end < n ? end : n;
        duet_batch_item_t it = {.seq = s,
                                .tokens = toks + s->n_tokens,
                                .n_tokens = end - s->n_tokens,
                                .logits_mode =
                                    end == n && last ? DUET_LOGITS_LAST : DUET_LOGITS_NONE,
                                .logits = end == n ? last : NULL};
        cr_assert_eq(duet_model_forward(m, &it, 1), DUET_OK, "%s", duet_error_last());
        (void)duet_prefix_cache_keep(pc, m, s, toks, CHUNK);
    }
}

/*
 * A prompt resuming from a cached chunk end computes the same logits, bit for bit, as one
 * prefilled from the start (the promise of duet_prefix_cache_keep's grid), and keep makes entries
 * only at chunk ends on the page grid.
 */
Test(prefix_cache_model, a_hit_computes_what_a_miss_does, .timeout = 120)
{
    duet_model_t *m = demo(0, 4);
    duet_prefix_cache_t *pc = demo_cache(m, 8);
    const int64_t V = duet_model_config(m)->vocab_size;
    int32_t a[96], b[120];
    ids_of("In the beginning God created the heaven and the earth. ", a, 96);
    memcpy(b, a, sizeof(int32_t) * 80);
    ids_of("Call me Ishmael. Some years ago, never mind how long. ", b + 80, 40);
    duet_seq_t sa, sb, sc;
    cr_assert_eq(duet_prefix_cache_seq_open(pc, m, a, 96, 96, &sa), DUET_OK);
    cr_assert_eq(sa.n_tokens, 0, "an empty cache has no prefix");
    prefill(m, pc, &sa, a, 96, NULL);
    cr_assert_eq(duet_prefix_cache_stats(pc).entries, 3, "chunk ends 32, 64, 96");
    duet_model_seq_close(m, &sa);
    /* b shares 80 tokens with a: the 64-token entry is its longest cached prefix */
    cr_assert_eq(duet_prefix_cache_seq_open(pc, m, b, 120, 120, &sb), DUET_OK);
    cr_assert_eq(sb.n_tokens, 64);
    float *hit = malloc(sizeof(float) * (size_t)V), *miss = malloc(sizeof(float) * (size_t)V);
    prefill(m, NULL, &sb, b, 120, hit);
    cr_assert_eq(duet_model_seq_open(m, 120, &sc), DUET_OK);
    prefill(m, NULL, &sc, b, 120, miss);
    cr_assert_eq(memcmp(hit, miss, sizeof(float) * (size_t)V), 0, "a hit's logits differ");
    /* a length off the chunk grid is not kept by a prefill, and is by a decode (chunk 0) */
    const int64_t before = duet_prefix_cache_stats(pc).entries;
    duet_seq_t sd;
    cr_assert_eq(duet_model_seq_open(m, 120, &sd), DUET_OK);
    duet_batch_item_t it = {.seq = &sd, .tokens = b, .n_tokens = 48};
    cr_assert_eq(duet_model_forward(m, &it, 1), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(duet_prefix_cache_keep(pc, m, &sd, b, CHUNK), 0, "48 is no chunk end");
    cr_assert_eq(duet_prefix_cache_keep(pc, m, &sd, b, 0), 3, "48 is on the page grid");
    cr_assert_eq(duet_prefix_cache_stats(pc).entries, before + 1);
    free(hit);
    free(miss);
    duet_model_seq_close(m, &sb);
    duet_model_seq_close(m, &sc);
    duet_model_seq_close(m, &sd);
    duet_prefix_cache_destroy(pc);
    cr_assert_eq(duet_kv_pool_n_free(duet_model_kv_pool(m)),
                 duet_kv_pool_desc(duet_model_kv_pool(m))->n_pages, "pages leaked");
    duet_model_free(m);
}

/*
 * Pages short: an open or a grow drops the least recently used entries until it fits, never a
 * page a live sequence holds; when the shortage is a state slot, or what live sequences hold,
 * dropping cannot help and the error comes back (after the drops, in the second case).
 */
Test(prefix_cache_model, opening_short_of_pages_evicts_only_what_helps, .timeout = 120)
{
    duet_model_t *m = demo(12, 2); /* 12 pages of 16 tokens, 2 state slots */
    duet_prefix_cache_t *pc = demo_cache(m, 8);
    duet_kv_pool_t *kv = duet_model_kv_pool(m);
    int32_t a[64], b[64];
    ids_of("It was the best of times, it was the worst of times. ", a, 64);
    ids_of("Happy families are all alike; every unhappy family... ", b, 64);
    duet_seq_t s, t, u;
    cr_assert_eq(duet_prefix_cache_seq_open(pc, m, a, 64, 64, &s), DUET_OK);
    prefill(m, pc, &s, a, 64, NULL);
    duet_model_seq_close(m, &s);
    cr_assert_eq(duet_prefix_cache_seq_open(pc, m, b, 64, 64, &s), DUET_OK);
    prefill(m, pc, &s, b, 64, NULL); /* s stays open: b's 4 pages are its and the cache's */
    cr_assert_eq(duet_kv_pool_n_free(kv), 4, "a's and b's 4 pages each");
    /* 6 pages: a's entries (least recently used) go, b's stay */
    cr_assert_eq(duet_prefix_cache_seq_open(pc, m, NULL, 0, 96, &t), DUET_OK, "%s",
                 duet_error_last());
    int32_t got_pages[4];
    const int32_t *got;
    const void *state;
    cr_assert_eq(duet_prefix_cache_lookup(pc, a, 64, &got, &state), 0, "a was not evicted");
    cr_assert_eq(duet_prefix_cache_lookup(pc, b, 64, &got, &state), 2, "b was evicted");
    memcpy(got_pages, got, sizeof(int32_t) * 2);
    /* no state slot left: nothing to gain from the cache, which stays */
    const int64_t entries = duet_prefix_cache_stats(pc).entries;
    cr_assert_eq(duet_prefix_cache_seq_open(pc, m, NULL, 0, 16, &u), DUET_ERR_NO_SPACE);
    cr_assert_eq(u.id, -1);
    cr_assert_eq(duet_prefix_cache_stats(pc).entries, entries, "a slot shortage evicted");
    /* growing t past the pool: every entry goes, and s's pages (b's) stay s's */
    cr_assert_eq(duet_prefix_cache_seq_grow(pc, m, &t, 256), DUET_ERR_NO_SPACE);
    cr_assert_eq(duet_prefix_cache_stats(pc).entries, 0);
    cr_assert_eq(duet_kv_pool_holders(kv, got_pages[0]), 1, "s's page");
    cr_assert_eq(duet_prefix_cache_seq_grow(pc, m, &t, 128), DUET_OK, "%s", duet_error_last());
    duet_model_seq_close(m, &s);
    duet_model_seq_close(m, &t);
    cr_assert_eq(duet_kv_pool_n_free(kv), 12, "pages leaked");
    duet_prefix_cache_destroy(pc);
    duet_model_free(m);
}

/*
 * What a decode snapshot (duet-gen keeps one as a request decodes, for its next turn) holds: the
 * KDA state after tokens fed one per step, where a prefill of the same tokens computes it chunk
 * by chunk. They agree to float rounding, not bit for bit: measured here (printed), bounded by
 * the tolerance docs/architecture.md ("Prefix cache") states, and the next token's logits from
 * either state are as close (the greedy token the same on this text).
 */
#define DECODE_STATE_ABS_TOL 1e-5f
#define DECODE_LOGIT_ABS_TOL 1e-4f

Test(prefix_cache_model, a_decode_snapshot_is_a_prefill_to_rounding, .timeout = 120)
{
    duet_model_t *m = demo(0, 4);
    const int64_t V = duet_model_config(m)->vocab_size;
    const size_t bytes = duet_model_kda_state_bytes(m);
    cr_assert(bytes > 0 && bytes % sizeof(float) == 0, "the demo model has KDA layers (f32)");
    int32_t toks[129];
    ids_of("And God said, Let there be a firmament in the midst of the waters, and let it "
           "divide the waters from the waters. ",
           toks, 129);
    duet_seq_t dec, pre;
    cr_assert_eq(duet_model_seq_open(m, 160, &dec), DUET_OK);
    cr_assert_eq(duet_model_seq_open(m, 160, &pre), DUET_OK);
    prefill(m, NULL, &dec, toks, 64, NULL);
    for (int64_t i = 64; i < 128; i++) { /* decode: one token per step */
        duet_batch_item_t it = {.seq = &dec, .tokens = toks + i, .n_tokens = 1};
        cr_assert_eq(duet_model_forward(m, &it, 1), DUET_OK, "%s", duet_error_last());
    }
    prefill(m, NULL, &pre, toks, 128, NULL);
    float *sd = malloc(bytes), *sp = malloc(bytes);
    cr_assert_eq(duet_model_seq_kda_read(m, &dec, sd), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(duet_model_seq_kda_read(m, &pre, sp), DUET_OK, "%s", duet_error_last());
    float max_abs = 0, max_rel = 0, max_val = 0;
    size_t differ = 0;
    for (size_t i = 0; i < bytes / sizeof(float); i++) {
        const float d = fabsf(sd[i] - sp[i]), big = fmaxf(fabsf(sd[i]), fabsf(sp[i]));
        differ += d > 0;
        max_abs = fmaxf(max_abs, d);
        max_val = fmaxf(max_val, big);
        if (big > 1e-3f)
            max_rel = fmaxf(max_rel, d / big);
    }
    /* the next token from either state */
    float *ld = malloc(sizeof(float) * (size_t)V), *lp = malloc(sizeof(float) * (size_t)V);
    duet_batch_item_t a = {.seq = &dec,
                           .tokens = toks + 128,
                           .n_tokens = 1,
                           .logits_mode = DUET_LOGITS_LAST,
                           .logits = ld};
    duet_batch_item_t b = {.seq = &pre,
                           .tokens = toks + 128,
                           .n_tokens = 1,
                           .logits_mode = DUET_LOGITS_LAST,
                           .logits = lp};
    cr_assert_eq(duet_model_forward(m, &a, 1), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(duet_model_forward(m, &b, 1), DUET_OK, "%s", duet_error_last());
    float max_logit = 0;
    int64_t am = 0, bm = 0;
    for (int64_t i = 0; i < V; i++) {
        max_logit = fmaxf(max_logit, fabsf(ld[i] - lp[i]));
        am = ld[i] > ld[am] ? i : am;
        bm = lp[i] > lp[bm] ? i : bm;
    }
    printf("[prefix_cache] decode vs prefill KDA state after 128 tokens (64 decoded): %zu of %zu "
           "floats differ, max abs %.3g (largest |value| %.3g), max rel %.3g (|value| > 1e-3); "
           "next-token logits max abs %.3g, greedy %lld vs %lld\n",
           differ, bytes / sizeof(float), (double)max_abs, (double)max_val, (double)max_rel,
           (double)max_logit, (long long)am, (long long)bm);
    cr_expect(max_abs <= DECODE_STATE_ABS_TOL, "state max abs difference %g", (double)max_abs);
    cr_expect(max_logit <= DECODE_LOGIT_ABS_TOL, "logits max abs difference %g", (double)max_logit);
    cr_expect_eq(am, bm, "the greedy token differs");
    free(sd);
    free(sp);
    free(ld);
    free(lp);
    duet_model_seq_close(m, &dec);
    duet_model_seq_close(m, &pre);
    duet_model_free(m);
}
