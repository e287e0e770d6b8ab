/*
 * Transfer plans (transfer/plan.h) against a byte-by-byte reference.
 *
 * Each random case allocates real pools as byte arrays: the sender's KV and KDA pools filled with
 * random bytes, and per destination rank a KV and a KDA pool filled with random "background"
 * bytes, twice (one copy for the plan, one for the reference). The plan is applied with one
 * memcpy per entry; the reference is computed independently of plan.c, token by token for the
 * KV (where does token t of layer l live on each side?) and head by head / channel by channel for
 * the KDA state and conv windows, row by row for the replay rows of a moved request (each offset
 * from the replay pool's formula in common/cache_layout.h, written out here). The two destination
 * copies must then be identical, which also proves that no byte outside the planned ranges was
 * touched (the background would differ).
 * Structural checks: entries grouped by layer in order, no two entries overlapping on a
 * destination, every range inside its pool, adjacent mergeable entries merged, and the byte
 * counters adding up.
 */
#include <criterion/criterion.h>
#include <criterion/redirect.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "transfer/plan.h"

/* ---- deterministic randomness --------------------------------------------------------------- */

static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint32_t rng_range(uint64_t *s, uint32_t lo, uint32_t hi) /* [lo, hi] */
{
    return lo + (uint32_t)(rng_next(s) % ((uint64_t)hi - lo + 1));
}

static void rng_fill(uint64_t *s, uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)rng_next(s);
}

/* n distinct page ids out of [0, pool_pages), in random order (a shuffled prefix). */
static void rng_pages(uint64_t *s, int32_t *out, uint32_t n, uint32_t pool_pages)
{
    int32_t *all = malloc((size_t)pool_pages * sizeof(*all));
    cr_assert_not_null(all);
    for (uint32_t i = 0; i < pool_pages; i++)
        all[i] = (int32_t)i;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t j = rng_range(s, i, pool_pages - 1);
        int32_t t = all[i];
        all[i] = all[j];
        all[j] = t;
        out[i] = all[i];
    }
    free(all);
}

/* ---- one case ------------------------------------------------------------------------------- */

typedef struct {
    uint32_t ps, pd; /* page tokens: sender, destination */
    uint32_t n_tokens;
    uint32_t L, LK;          /* MLA, KDA layers */
    uint32_t tb;             /* token bytes */
    uint32_t H, K, W, e;     /* KDA heads (sender), head dim, conv kernel, elem */
    uint32_t N;              /* destination ranks */
    uint32_t KV;             /* KV shards (kv_ranks, divides N): rank r holds shard r / (N / KV) */
    bool kda;                /* send KDA state */
    uint32_t R;              /* replay rows sent (only with N = 1 and kda) */
    uint32_t rows_s, rows_d; /* replay rows per (slot, layer): sender, destination */
} shape_t;

typedef struct {
    uint8_t *kv, *kda, *rp;             /* plan copy */
    uint8_t *kv_ref, *kda_ref, *rp_ref; /* reference copy */
    size_t kv_bytes, kda_bytes, rp_bytes;
    int32_t *pages;
    uint32_t n_pages;
    int32_t slot;
} rank_pools_t;

static char g_why[512]; /* why the last case failed */

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            snprintf(g_why, sizeof(g_why), __VA_ARGS__);                                           \
            ok = false;                                                                            \
            goto out;                                                                              \
        }                                                                                          \
    } while (0)

static uint64_t kda_layer_bytes(uint32_t H, uint32_t K, uint32_t W, uint32_t e)
{
    return ((uint64_t)H * K * K + 3ull * H * K * (W - 1)) * e;
}

/* One replay row: (6*H*K + H) * e (common/cache_layout.h). */
static uint64_t replay_row_bytes(uint32_t H, uint32_t K, uint32_t e)
{
    return (6ull * H * K + H) * e;
}

/* Row `row` of (slot, layer) in a replay pool of LK layers and `rows` rows per (slot, layer). */
static uint64_t replay_row_off(uint32_t slot, uint32_t layer, uint32_t row, uint32_t LK,
                               uint32_t rows, uint64_t row_bytes)
{
    return (((uint64_t)slot * LK + layer) * rows + row) * row_bytes;
}

static uint64_t div_up(uint64_t a, uint64_t b)
{
    return (a + b - 1) / b;
}

/* Run one shape; returns false (with g_why) on any mismatch. */
static bool run_case(uint64_t *rng, const shape_t *sh, duet_xfer_plan_t *plan)
{
    bool ok = true;
    const uint32_t N = sh->N, Hr = sh->H / sh->N, KV = sh->KV, TP = N / KV;
    rank_pools_t rk[DUET_XFER_MAX_RANKS];
    memset(rk, 0, sizeof(rk));

    /* Sender. */
    duet_xfer_layout_t sl = {.page_tokens = sh->ps,
                             .n_mla_layers = sh->L,
                             .token_bytes = sh->tb,
                             .n_kda_layers = sh->LK,
                             .kda_heads = sh->H,
                             .kda_head_dim = sh->K,
                             .conv_kernel = sh->W,
                             .state_elem = sh->e,
                             .replay_rows = sh->rows_s};
    uint32_t src_need = (uint32_t)div_up(sh->n_tokens, sh->ps);
    uint32_t src_extra = rng_range(rng, 0, 3);
    uint32_t src_pool_pages = src_need + src_extra + rng_range(rng, 0, 5);
    uint64_t src_page_bytes = (uint64_t)sh->ps * sh->L * sh->tb;
    size_t src_kv_bytes = (size_t)(src_pool_pages * src_page_bytes);
    uint32_t src_slots = rng_range(rng, 1, 3);
    uint64_t src_kda_layer = kda_layer_bytes(sh->H, sh->K, sh->W, sh->e);
    size_t src_kda_bytes = (size_t)(src_slots * sh->LK * src_kda_layer);
    const uint64_t rb = replay_row_bytes(sh->H, sh->K, sh->e);
    size_t src_rp_bytes = (size_t)((uint64_t)src_slots * sh->LK * sh->rows_s * rb);
    uint8_t *src_kv = malloc(src_kv_bytes + 1);
    uint8_t *src_kda = malloc(src_kda_bytes + 1);
    uint8_t *src_rp = malloc(src_rp_bytes + 1);
    int32_t *src_pages = malloc((size_t)(src_need + src_extra + 1) * sizeof(int32_t));
    cr_assert(src_kv && src_kda && src_rp && src_pages);
    rng_fill(rng, src_kv, src_kv_bytes);
    rng_fill(rng, src_kda, src_kda_bytes);
    rng_fill(rng, src_rp, src_rp_bytes);
    rng_pages(rng, src_pages, src_need + src_extra, src_pool_pages);
    duet_xfer_src_t src = {.pages = src_pages,
                           .n_pages = src_need + src_extra,
                           .kda_slot = sh->kda ? (int32_t)rng_range(rng, 0, src_slots - 1) : -1,
                           .n_tokens = sh->n_tokens,
                           .n_replay = sh->R};

    /* Destination ranks. */
    duet_xfer_layout_t dl[DUET_XFER_MAX_RANKS];
    duet_xfer_dest_t dst[DUET_XFER_MAX_RANKS];
    uint64_t global_pages = div_up(sh->n_tokens, sh->pd);
    uint64_t dst_kda_layer = kda_layer_bytes(Hr, sh->K, sh->W, sh->e);
    for (uint32_t r = 0; r < N; r++) {
        dl[r] = sl;
        dl[r].page_tokens = sh->pd;
        dl[r].kda_heads = Hr;
        dl[r].replay_rows = sh->rows_d;
        const uint32_t c = r / TP; /* the rank's KV shard, written out (not plan.h's helper) */
        uint32_t need = (uint32_t)(global_pages / KV + (c < global_pages % KV));
        uint32_t extra = rng_range(rng, 0, 2);
        uint32_t pool = need + extra + rng_range(rng, 0, 5);
        rk[r].n_pages = need + extra;
        rk[r].kv_bytes = (size_t)pool * sh->pd * sh->L * sh->tb;
        uint32_t slots = rng_range(rng, 1, 3);
        rk[r].kda_bytes = (size_t)(slots * sh->LK * dst_kda_layer);
        rk[r].slot = sh->kda ? (int32_t)rng_range(rng, 0, slots - 1) : -1;
        rk[r].rp_bytes = (size_t)((uint64_t)slots * sh->LK * sh->rows_d * rb);
        rk[r].rp = malloc(rk[r].rp_bytes + 1);
        rk[r].rp_ref = malloc(rk[r].rp_bytes + 1);
        cr_assert(rk[r].rp && rk[r].rp_ref);
        rng_fill(rng, rk[r].rp, rk[r].rp_bytes);
        memcpy(rk[r].rp_ref, rk[r].rp, rk[r].rp_bytes);
        rk[r].pages = malloc((size_t)(rk[r].n_pages + 1) * sizeof(int32_t));
        rk[r].kv = malloc(rk[r].kv_bytes + 1);
        rk[r].kv_ref = malloc(rk[r].kv_bytes + 1);
        rk[r].kda = malloc(rk[r].kda_bytes + 1);
        rk[r].kda_ref = malloc(rk[r].kda_bytes + 1);
        cr_assert(rk[r].pages && rk[r].kv && rk[r].kv_ref && rk[r].kda && rk[r].kda_ref);
        rng_pages(rng, rk[r].pages, rk[r].n_pages, pool);
        rng_fill(rng, rk[r].kv, rk[r].kv_bytes);
        memcpy(rk[r].kv_ref, rk[r].kv, rk[r].kv_bytes);
        rng_fill(rng, rk[r].kda, rk[r].kda_bytes);
        memcpy(rk[r].kda_ref, rk[r].kda, rk[r].kda_bytes);
        dst[r] = (duet_xfer_dest_t){
            .pages = rk[r].pages, .n_pages = rk[r].n_pages, .kda_slot = rk[r].slot};
    }

    /* kv_ranks = N is also passed as 0 (its spelling on the wire) half of the time */
    duet_status_t st =
        duet_xfer_plan_build(&sl, &src, dl, dst, N, KV == N && rng_next(rng) % 2 ? 0 : KV, plan);
    CHECK(st == DUET_OK, "build: %s: %s", duet_status_name(st), duet_error_last());

    /* Reference: KV token by token, into every rank of the token's page's shard. */
    for (uint32_t l = 0; l < sh->L; l++) {
        for (uint64_t t = 0; t < sh->n_tokens; t++) {
            uint64_t s_off =
                (((uint64_t)src_pages[t / sh->ps] * sh->L + l) * sh->ps + t % sh->ps) * sh->tb;
            uint64_t j = t / sh->pd;
            for (uint32_t r = 0; r < N; r++) {
                if (r / TP != j % KV)
                    continue;
                uint64_t d_off =
                    (((uint64_t)rk[r].pages[j / KV] * sh->L + l) * sh->pd + t % sh->pd) * sh->tb;
                memcpy(rk[r].kv_ref + d_off, src_kv + s_off, sh->tb);
            }
        }
    }
    /* Reference: KDA head by head (S) and channel by channel (conv windows). */
    if (sh->kda) {
        for (uint32_t l = 0; l < sh->LK; l++) {
            uint64_t s_layer = ((uint64_t)src.kda_slot * sh->LK + l) * src_kda_layer;
            uint64_t s_conv = s_layer + (uint64_t)sh->H * sh->K * sh->K * sh->e;
            for (uint32_t h = 0; h < sh->H; h++) {
                uint32_t r = h / Hr, hl = h % Hr;
                uint64_t d_layer = ((uint64_t)rk[r].slot * sh->LK + l) * dst_kda_layer;
                uint64_t d_conv = d_layer + (uint64_t)Hr * sh->K * sh->K * sh->e;
                uint64_t s_head = (uint64_t)sh->K * sh->K * sh->e;
                memcpy(rk[r].kda_ref + d_layer + hl * s_head, src_kda + s_layer + h * s_head,
                       s_head);
                for (uint32_t c = 0; c < 3; c++) {
                    for (uint32_t k = 0; k < sh->K; k++) {
                        uint64_t s_ch = (uint64_t)c * sh->H * sh->K + (uint64_t)h * sh->K + k;
                        uint64_t d_ch = (uint64_t)c * Hr * sh->K + (uint64_t)hl * sh->K + k;
                        uint64_t row = (uint64_t)(sh->W - 1) * sh->e;
                        memcpy(rk[r].kda_ref + d_conv + d_ch * row, src_kda + s_conv + s_ch * row,
                               row);
                    }
                }
            }
        }
    }

    /* Reference: the replay rows, row by row (one rank). */
    for (uint32_t l = 0; l < sh->LK && sh->R > 0; l++)
        for (uint32_t row = 0; row < sh->R; row++)
            memcpy(rk[0].rp_ref +
                       replay_row_off((uint32_t)rk[0].slot, l, row, sh->LK, sh->rows_d, rb),
                   src_rp + replay_row_off((uint32_t)src.kda_slot, l, row, sh->LK, sh->rows_s, rb),
                   rb);

    /* Structure: groups, bounds, merging, counters. */
    size_t n_groups = (size_t)sh->L + sh->LK;
    CHECK(plan->n_groups == n_groups, "n_groups %zu, want %zu", plan->n_groups, n_groups);
    CHECK(plan->layer_first[0] == 0, "layer_first[0] = %zu", plan->layer_first[0]);
    CHECK(plan->layer_first[n_groups] == plan->n_entries, "layer_first[end] %zu != n_entries %zu",
          plan->layer_first[n_groups], plan->n_entries);
    uint64_t per_rank[DUET_XFER_MAX_RANKS] = {0}, total = 0;
    for (size_t g = 0; g < n_groups; g++) {
        CHECK(plan->layer_first[g] <= plan->layer_first[g + 1], "layer_first not monotone at %zu",
              g);
        uint8_t kind = g < sh->L ? DUET_XFER_SEG_KV : DUET_XFER_SEG_KDA;
        uint16_t layer = (uint16_t)(g < sh->L ? g : g - sh->L);
        uint32_t n_replay_entries = 0;
        for (size_t i = plan->layer_first[g]; i < plan->layer_first[g + 1]; i++) {
            const duet_xfer_entry_t *en = &plan->entries[i];
            /* a KDA layer's group ends with its replay rows: one entry, at the formula's offsets */
            const bool replay = kind == DUET_XFER_SEG_KDA && en->kind == DUET_XFER_SEG_REPLAY;
            CHECK((en->kind == kind || replay) && en->layer == layer,
                  "entry %zu in group %zu has kind %u layer %u", i, g, en->kind, en->layer);
            CHECK(en->rank < N && en->len > 0, "entry %zu: rank %u len %llu", i, en->rank,
                  (unsigned long long)en->len);
            if (replay) {
                n_replay_entries++;
                CHECK(i + 1 == plan->layer_first[g + 1], "replay entry %zu is not its group's last",
                      i);
                CHECK(en->rank == 0 &&
                          en->src_off == replay_row_off((uint32_t)src.kda_slot, layer, 0, sh->LK,
                                                        sh->rows_s, rb) &&
                          en->dst_off == replay_row_off((uint32_t)rk[0].slot, layer, 0, sh->LK,
                                                        sh->rows_d, rb) &&
                          en->len == sh->R * rb,
                      "replay entry %zu: rank %u src %llu dst %llu len %llu", i, en->rank,
                      (unsigned long long)en->src_off, (unsigned long long)en->dst_off,
                      (unsigned long long)en->len);
            }
            size_t src_lim = en->kind == DUET_XFER_SEG_KV    ? src_kv_bytes
                             : en->kind == DUET_XFER_SEG_KDA ? src_kda_bytes
                                                             : src_rp_bytes;
            size_t dst_lim = en->kind == DUET_XFER_SEG_KV    ? rk[en->rank].kv_bytes
                             : en->kind == DUET_XFER_SEG_KDA ? rk[en->rank].kda_bytes
                                                             : rk[en->rank].rp_bytes;
            CHECK(en->src_off + en->len <= src_lim && en->dst_off + en->len <= dst_lim,
                  "entry %zu out of its pools", i);
            if (i > plan->layer_first[g]) {
                const duet_xfer_entry_t *pv = en - 1;
                CHECK(!(pv->kind == en->kind && pv->rank == en->rank &&
                        pv->src_off + pv->len == en->src_off &&
                        pv->dst_off + pv->len == en->dst_off),
                      "entries %zu and %zu should have been merged", i - 1, i);
            }
            per_rank[en->rank] += en->len;
            total += en->len;
        }
        CHECK(n_replay_entries == (kind == DUET_XFER_SEG_KDA && sh->R > 0),
              "group %zu has %u replay entries (%u rows sent)", g, n_replay_entries, sh->R);
    }
    CHECK(total == plan->total_bytes, "total_bytes %llu, entries sum to %llu",
          (unsigned long long)plan->total_bytes, (unsigned long long)total);
    uint64_t want_total = (uint64_t)sh->n_tokens * sh->L * sh->tb * TP +
                          (sh->kda ? (uint64_t)sh->LK * src_kda_layer : 0) +
                          (uint64_t)sh->LK * sh->R * rb;
    CHECK(total == want_total, "total %llu, want %llu", (unsigned long long)total,
          (unsigned long long)want_total);
    for (uint32_t r = 0; r < DUET_XFER_MAX_RANKS; r++)
        CHECK(per_rank[r] == plan->bytes_per_rank[r], "bytes_per_rank[%u] %llu, entries %llu", r,
              (unsigned long long)plan->bytes_per_rank[r], (unsigned long long)per_rank[r]);
    for (uint32_t r = 0; r < N; r++) { /* each rank: its shard's tokens + its heads + replay */
        uint64_t kv_tokens = 0;
        for (uint64_t j = r / TP; j < global_pages; j += KV)
            kv_tokens += sh->n_tokens - j * sh->pd < sh->pd ? sh->n_tokens - j * sh->pd : sh->pd;
        uint64_t want = kv_tokens * sh->L * sh->tb + (sh->kda ? sh->LK * dst_kda_layer : 0) +
                        (r == 0 ? (uint64_t)sh->LK * sh->R * rb : 0);
        CHECK(per_rank[r] == want, "rank %u: %llu bytes planned, its share is %llu", r,
              (unsigned long long)per_rank[r], (unsigned long long)want);
    }

    /* No two entries overlap on a destination: mark every destination byte once. */
    for (uint32_t r = 0; r < N; r++) {
        uint8_t *seen_kv = calloc(rk[r].kv_bytes + 1, 1);
        uint8_t *seen_kda = calloc(rk[r].kda_bytes + 1, 1);
        uint8_t *seen_rp = calloc(rk[r].rp_bytes + 1, 1);
        cr_assert(seen_kv && seen_kda && seen_rp);
        bool overlap = false;
        size_t bad = 0;
        for (size_t i = 0; i < plan->n_entries && !overlap; i++) {
            const duet_xfer_entry_t *en = &plan->entries[i];
            if (en->rank != r)
                continue;
            uint8_t *seen = en->kind == DUET_XFER_SEG_KV    ? seen_kv
                            : en->kind == DUET_XFER_SEG_KDA ? seen_kda
                                                            : seen_rp;
            for (uint64_t b = 0; b < en->len; b++) {
                if (seen[en->dst_off + b]++ != 0) {
                    overlap = true;
                    bad = i;
                    break;
                }
            }
        }
        free(seen_kv);
        free(seen_kda);
        free(seen_rp);
        CHECK(!overlap, "rank %u: entry %zu overlaps another on the destination", r, bad);
    }

    /* Apply the plan and compare every destination byte with the reference. */
    for (size_t i = 0; i < plan->n_entries; i++) {
        const duet_xfer_entry_t *en = &plan->entries[i];
        if (en->kind == DUET_XFER_SEG_KV)
            memcpy(rk[en->rank].kv + en->dst_off, src_kv + en->src_off, en->len);
        else if (en->kind == DUET_XFER_SEG_KDA)
            memcpy(rk[en->rank].kda + en->dst_off, src_kda + en->src_off, en->len);
        else
            memcpy(rk[en->rank].rp + en->dst_off, src_rp + en->src_off, en->len);
    }
    for (uint32_t r = 0; r < N; r++) {
        CHECK(memcmp(rk[r].kv, rk[r].kv_ref, rk[r].kv_bytes) == 0, "rank %u: KV bytes differ", r);
        CHECK(memcmp(rk[r].kda, rk[r].kda_ref, rk[r].kda_bytes) == 0, "rank %u: KDA bytes differ",
              r);
        CHECK(memcmp(rk[r].rp, rk[r].rp_ref, rk[r].rp_bytes) == 0, "rank %u: replay bytes differ",
              r);
    }

out:
    for (uint32_t r = 0; r < N; r++) {
        free(rk[r].pages);
        free(rk[r].kv);
        free(rk[r].kv_ref);
        free(rk[r].kda);
        free(rk[r].kda_ref);
        free(rk[r].rp);
        free(rk[r].rp_ref);
    }
    free(src_kv);
    free(src_kda);
    free(src_rp);
    free(src_pages);
    return ok;
}

static const uint32_t k_page_sizes[] = {1, 2, 3, 7, 16, 32, 63, 64, 65, 100, 128, 200, 255, 256};

static uint32_t rng_page_size(uint64_t *rng)
{
    if (rng_next(rng) % 2 == 0)
        return k_page_sizes[rng_next(rng) % (sizeof(k_page_sizes) / sizeof(k_page_sizes[0]))];
    return rng_range(rng, 1, 256);
}

static shape_t random_shape(uint64_t *rng)
{
    shape_t sh;
    sh.ps = rng_page_size(rng);
    sh.pd = rng_page_size(rng);
    switch (rng_next(rng) % 4) { /* token counts around page boundaries are the interesting ones */
    case 0:
        sh.n_tokens = rng_range(rng, 1, 2000);
        break;
    case 1:
        sh.n_tokens = rng_range(rng, 1, 300);
        break;
    case 2: {
        uint32_t p = sh.ps > sh.pd ? sh.ps : sh.pd;
        uint32_t m = rng_range(rng, 1, 2000 / p > 0 ? 2000 / p : 1);
        sh.n_tokens = m * p + rng_range(rng, 0, 2) - 1;
        if (sh.n_tokens == 0 || sh.n_tokens > 2000)
            sh.n_tokens = 1;
        break;
    }
    default:
        sh.n_tokens = rng_range(rng, 1, 8);
        break;
    }
    sh.L = rng_range(rng, 0, 8);
    sh.LK = rng_range(rng, 0, 6);
    sh.tb = rng_range(rng, 1, 24);
    sh.N = rng_range(rng, 1, 6);
    sh.H = sh.N * rng_range(rng, 1, 12 / sh.N);
    do /* a divisor of N: N (every rank its pages) as often as the others together */
        sh.KV = rng_next(rng) % 2 ? sh.N : rng_range(rng, 1, sh.N);
    while (sh.N % sh.KV != 0);
    sh.K = rng_range(rng, 1, 6);
    sh.W = rng_range(rng, 1, 4);
    sh.e = (uint32_t[]){1, 2, 4}[rng_next(rng) % 3];
    sh.kda = sh.LK > 0 && rng_next(rng) % 5 != 0;
    /* replay pools on both sides of differing sizes; rows sent in 3/4 of the one-rank KDA cases */
    sh.rows_s = rng_range(rng, 0, 6);
    sh.rows_d = rng_range(rng, 0, 6);
    uint32_t most = sh.rows_s < sh.rows_d ? sh.rows_s : sh.rows_d;
    most = most < sh.n_tokens ? most : sh.n_tokens;
    sh.R = sh.kda && sh.N == 1 && most > 0 && rng_next(rng) % 4 != 0 ? rng_range(rng, 1, most) : 0;
    return sh;
}

static void describe(const shape_t *sh, char *buf, size_t n)
{
    snprintf(buf, n,
             "ps %u pd %u tokens %u L %u LK %u tb %u H %u K %u W %u e %u N %u KV %u kda %d R %u "
             "rows %u -> %u",
             sh->ps, sh->pd, sh->n_tokens, sh->L, sh->LK, sh->tb, sh->H, sh->K, sh->W, sh->e, sh->N,
             sh->KV, sh->kda, sh->R, sh->rows_s, sh->rows_d);
}

/* Thousands of random shapes through one reused plan (buffers grow and shrink in use). */
Test(transfer_plan, random_shapes_match_reference, .timeout = 240)
{
    enum { N_CASES = 4000 };
    duet_xfer_plan_t plan = {0};
    uint64_t rng = 0x5eed0001;
    int n_replay_cases = 0, n_shared_kv_cases = 0;
    for (int c = 0; c < N_CASES; c++) {
        shape_t sh = random_shape(&rng);
        n_replay_cases += sh.R > 0;
        n_shared_kv_cases += sh.KV < sh.N;
        if (!run_case(&rng, &sh, &plan)) {
            char d[256];
            describe(&sh, d, sizeof(d));
            cr_assert_fail("case %d (%s): %s", c, d, g_why);
            break;
        }
    }
    cr_assert_geq(n_replay_cases, 200, "only %d cases sent replay rows", n_replay_cases);
    cr_assert_geq(n_shared_kv_cases, 400, "only %d cases dealt KV over fewer ranks than the group",
                  n_shared_kv_cases);
    cr_log_info("transfer_plan: %d random shapes (%d with replay rows) match the reference",
                N_CASES, n_replay_cases);
    duet_xfer_plan_free(&plan);
}

/* The page-size pairs the issue names, and their neighbours, across Helix group sizes. */
Test(transfer_plan, named_page_size_pairs, .timeout = 120)
{
    static const uint32_t pairs[][2] = {{64, 128}, {128, 64}, {128, 128}, {64, 64},  {32, 128},
                                        {128, 32}, {1, 256},  {256, 1},   {96, 128}, {128, 96}};
    duet_xfer_plan_t plan = {0};
    uint64_t rng = 0x5eed0002;
    int n = 0;
    for (size_t p = 0; p < sizeof(pairs) / sizeof(pairs[0]); p++) {
        for (uint32_t N = 1; N <= 5; N++) {
            for (int rep = 0; rep < 12; rep++) {
                shape_t sh = random_shape(&rng);
                sh.ps = pairs[p][0];
                sh.pd = pairs[p][1];
                sh.N = N;
                sh.KV = N % 2 == 0 && rep % 2 ? N / 2 : N; /* cp x tp 2 half the time */
                sh.H = N * rng_range(&rng, 1, 8 / N);
                sh.L = rng_range(&rng, 1, 8);
                if (rep == 0)
                    sh.n_tokens = 2000;
                else if (rep == 1)
                    sh.n_tokens = 1;
                else if (rep == 2)
                    sh.n_tokens =
                        pairs[p][0] * pairs[p][1] > 2000 ? 1000 : pairs[p][0] * pairs[p][1];
                if (N > 1)
                    sh.R = 0; /* replay rows go to one rank only */
                if (sh.R > sh.n_tokens)
                    sh.R = sh.n_tokens;
                if (!run_case(&rng, &sh, &plan)) {
                    char d[256];
                    describe(&sh, d, sizeof(d));
                    cr_assert_fail("%s: %s", d, g_why);
                    goto done;
                }
                n++;
            }
        }
    }
done:
    cr_log_info("transfer_plan: %d named-pair cases match the reference", n);
    duet_xfer_plan_free(&plan);
}

/* Helix groups whose tp ranks share KV pages: cp 2 x tp 2 (N 4, kv_ranks 2) and tp 2 (N 2,
 * kv_ranks 1), across page-size pairs and token counts around page boundaries. run_case checks
 * every destination byte against the reference (each page into every rank of its c, nowhere
 * else: the background bytes would differ), each rank's byte share and its page count (the
 * destination reserves exactly its shard's pages), and the KDA heads cut over all N. */
Test(transfer_plan, kv_shared_by_tp_ranks_match_reference, .timeout = 60)
{
    static const uint32_t groups[][2] = {{4, 2}, {2, 1}, {4, 1}, {6, 3}}; /* N, kv_ranks */
    static const uint32_t pairs[][2] = {{64, 128}, {128, 64}, {128, 128}, {1, 16}, {7, 3}};
    duet_xfer_plan_t plan = {0};
    uint64_t rng = 0x5eed0003;
    int n = 0;
    for (size_t g = 0; g < sizeof(groups) / sizeof(groups[0]); g++) {
        for (size_t p = 0; p < sizeof(pairs) / sizeof(pairs[0]); p++) {
            for (int rep = 0; rep < 8; rep++) {
                shape_t sh = random_shape(&rng);
                sh.N = groups[g][0];
                sh.KV = groups[g][1];
                sh.H = sh.N * rng_range(&rng, 1, 2);
                sh.ps = pairs[p][0];
                sh.pd = pairs[p][1];
                sh.L = rng_range(&rng, 1, 4);
                sh.LK = rng_range(&rng, 1, 3);
                sh.kda = true;
                sh.R = 0;
                const uint32_t m = sh.ps > sh.pd ? sh.ps : sh.pd;
                sh.n_tokens = rep < 4 ? (uint32_t)(rep + 1) * m * sh.N + (uint32_t)rep % 3 - 1
                                      : rng_range(&rng, 1, 1500);
                if (!run_case(&rng, &sh, &plan)) {
                    char d[256];
                    describe(&sh, d, sizeof(d));
                    cr_assert_fail("%s: %s", d, g_why);
                    goto done;
                }
                n++;
            }
        }
    }
done:
    cr_log_info("transfer_plan: %d cases with KV shared by tp ranks match the reference", n);
    duet_xfer_plan_free(&plan);
}

/* Equal page sizes, one rank, consecutive pages on both sides and one layer: one entry. */
Test(transfer_plan, contiguous_runs_merge_into_one_entry, .timeout = 10)
{
    int32_t sp[3] = {4, 5, 6}, dp[3] = {10, 11, 12};
    duet_xfer_layout_t l = {.page_tokens = 16, .n_mla_layers = 1, .token_bytes = 8};
    duet_xfer_src_t src = {.pages = sp, .n_pages = 3, .kda_slot = -1, .n_tokens = 40};
    duet_xfer_dest_t dst = {.pages = dp, .n_pages = 3, .kda_slot = -1};
    duet_xfer_plan_t plan = {0};
    cr_assert_eq(duet_xfer_plan_build(&l, &src, &l, &dst, 1, 0, &plan), DUET_OK, "%s",
                 duet_error_last());
    cr_assert_eq(plan.n_entries, 1);
    cr_assert_eq(plan.entries[0].src_off, 4u * 16 * 8);
    cr_assert_eq(plan.entries[0].dst_off, 10u * 16 * 8);
    cr_assert_eq(plan.entries[0].len, 40u * 8);
    cr_assert_eq(plan.total_bytes, 320u);
    cr_assert_eq(plan.bytes_per_rank[0], 320u);
    duet_xfer_plan_free(&plan);
    duet_xfer_plan_free(&plan); /* freeing twice (zeroed) is fine */
    duet_xfer_plan_free(NULL);
}

/* ---- refusals ------------------------------------------------------------------------------- */

typedef struct {
    duet_xfer_layout_t sl, dl[8];
    duet_xfer_src_t src;
    duet_xfer_dest_t dst[8];
    int32_t sp[16], dp[8][16];
    uint32_t n;
    uint32_t kv; /* kv_ranks (0 = n) */
} fixture_t;

/* A valid 2-rank case: 64-token pages into 128-token pages, 2 MLA + 2 KDA layers, 4 heads. */
static void fixture(fixture_t *f)
{
    memset(f, 0, sizeof(*f));
    f->n = 2;
    f->sl = (duet_xfer_layout_t){.page_tokens = 64,
                                 .n_mla_layers = 2,
                                 .token_bytes = 16,
                                 .n_kda_layers = 2,
                                 .kda_heads = 4,
                                 .kda_head_dim = 4,
                                 .conv_kernel = 4,
                                 .state_elem = 4};
    for (int i = 0; i < 16; i++)
        f->sp[i] = 15 - i;
    f->src = (duet_xfer_src_t){.pages = f->sp, .n_pages = 8, .kda_slot = 1, .n_tokens = 500};
    for (uint32_t r = 0; r < 8; r++) {
        f->dl[r] = f->sl;
        f->dl[r].page_tokens = 128;
        f->dl[r].kda_heads = 2;
        for (int i = 0; i < 16; i++)
            f->dp[r][i] = 2 * i + 1;
        f->dst[r] = (duet_xfer_dest_t){.pages = f->dp[r], .n_pages = 2, .kda_slot = 0};
    }
}

static void expect_refusal(fixture_t *f, duet_status_t want, const char *needle)
{
    duet_xfer_plan_t plan = {0};
    duet_status_t st = duet_xfer_plan_build(&f->sl, &f->src, f->dl, f->dst, f->n, f->kv, &plan);
    cr_assert_eq(st, want, "got %s (%s), want %s", duet_status_name(st), duet_error_last(),
                 duet_status_name(want));
    cr_assert_not_null(strstr(duet_error_last(), needle), "detail \"%s\" lacks \"%s\"",
                       duet_error_last(), needle);
    cr_assert_eq(plan.n_entries, 0);
    duet_xfer_plan_free(&plan);
}

Test(transfer_plan, fixture_is_valid, .timeout = 10)
{
    fixture_t f;
    fixture(&f);
    duet_xfer_plan_t plan = {0};
    cr_assert_eq(duet_xfer_plan_build(&f.sl, &f.src, f.dl, f.dst, f.n, f.kv, &plan), DUET_OK, "%s",
                 duet_error_last());
    /* 500 tokens = 4 pages of 128: ranks 0 and 1 get 2 each. */
    cr_assert_eq(plan.bytes_per_rank[0] + plan.bytes_per_rank[1], plan.total_bytes);
    cr_assert_eq(plan.n_groups, 4u);
    duet_xfer_plan_free(&plan);
}

Test(transfer_plan, refuses_mismatched_layouts, .timeout = 10, .init = cr_redirect_stderr)
{
    fixture_t f;
    fixture(&f);
    f.dl[1].token_bytes = 32;
    expect_refusal(&f, DUET_ERR_INVALID, "token_bytes");
    fixture(&f);
    f.dl[0].n_mla_layers = 3;
    expect_refusal(&f, DUET_ERR_INVALID, "n_mla_layers");
    fixture(&f);
    f.dl[0].n_kda_layers = 1;
    expect_refusal(&f, DUET_ERR_INVALID, "n_kda_layers");
    fixture(&f);
    f.dl[1].kda_head_dim = 8;
    expect_refusal(&f, DUET_ERR_INVALID, "kda_head_dim");
    fixture(&f);
    f.dl[1].conv_kernel = 3;
    expect_refusal(&f, DUET_ERR_INVALID, "conv_kernel");
    fixture(&f);
    f.dl[0].state_elem = 2;
    expect_refusal(&f, DUET_ERR_INVALID, "state_elem");
    fixture(&f);
    f.dl[1].kda_heads = 4; /* a rank must hold H/N heads */
    expect_refusal(&f, DUET_ERR_INVALID, "kda_heads");
    fixture(&f);
    f.n = 3; /* 4 heads over 3 ranks */
    f.dl[2].kda_heads = 1;
    expect_refusal(&f, DUET_ERR_INVALID, "cannot be split");
    fixture(&f);
    f.dl[1].page_tokens = 64; /* one page size per group */
    expect_refusal(&f, DUET_ERR_INVALID, "page_tokens");
    fixture(&f);
    f.dl[0].page_tokens = 0;
    expect_refusal(&f, DUET_ERR_INVALID, "page_tokens");
    fixture(&f);
    f.sl.token_bytes = 0;
    for (int r = 0; r < 2; r++)
        f.dl[r].token_bytes = 0;
    expect_refusal(&f, DUET_ERR_INVALID, "token_bytes");
    fixture(&f);
    f.dst[1].kda_slot = -1; /* sender sends KDA, rank 1 reserved none */
    expect_refusal(&f, DUET_ERR_INVALID, "kda_slot");
    fixture(&f);
    f.src.kda_slot = -2;
    expect_refusal(&f, DUET_ERR_RANGE, "kda_slot");
}

Test(transfer_plan, refuses_too_few_pages, .timeout = 10, .init = cr_redirect_stderr)
{
    fixture_t f;
    fixture(&f);
    f.src.n_pages = 7; /* 500 tokens need 8 pages of 64 */
    expect_refusal(&f, DUET_ERR_RANGE, "source pages");
    fixture(&f);
    f.dst[1].n_pages = 1; /* 4 pages of 128 over 2 ranks: 2 each */
    expect_refusal(&f, DUET_ERR_RANGE, "rank 1");
    fixture(&f);
    f.src.n_tokens = 513; /* now 5 global pages: rank 0 needs 3 */
    f.src.n_pages = 9;
    expect_refusal(&f, DUET_ERR_RANGE, "rank 0");
    fixture(&f);
    f.dp[0][1] = -3;
    expect_refusal(&f, DUET_ERR_RANGE, "negative");
    fixture(&f);
    f.sp[7] = -1;
    expect_refusal(&f, DUET_ERR_RANGE, "negative");
    fixture(&f);
    f.dst[0].pages = NULL;
    expect_refusal(&f, DUET_ERR_RANGE, "rank 0");
}

Test(transfer_plan, refuses_bad_rank_counts, .timeout = 10, .init = cr_redirect_stderr)
{
    fixture_t f;
    fixture(&f);
    f.n = 0;
    expect_refusal(&f, DUET_ERR_INVALID, "n_ranks");
    f.n = DUET_XFER_MAX_RANKS + 1;
    expect_refusal(&f, DUET_ERR_INVALID, "n_ranks");
    fixture(&f);
    f.kv = 3; /* more KV shards than ranks */
    expect_refusal(&f, DUET_ERR_INVALID, "does not divide");
    fixture(&f);
    f.n = 4;
    f.kv = 3; /* 3 does not divide 4 */
    for (uint32_t r = 0; r < 4; r++)
        f.dl[r].kda_heads = 1;
    expect_refusal(&f, DUET_ERR_INVALID, "does not divide");
}

/* cp 2 x tp 2, 500 tokens into 4 pages of 128: pages 0 and 2 go to ranks 0 and 1 (c 0) as their
 * local pages 0 and 1, pages 1 and 3 to ranks 2 and 3 (c 1); each KV entry lies within one page
 * of the right rank's list; the KDA heads are cut over 4 ranks. */
Test(transfer_plan, kv_pages_of_c_go_to_its_tp_ranks, .timeout = 10)
{
    fixture_t f;
    fixture(&f);
    f.n = 4;
    f.kv = 2;
    for (uint32_t r = 0; r < 4; r++)
        f.dl[r].kda_heads = 1;
    duet_xfer_plan_t plan = {0};
    cr_assert_eq(duet_xfer_plan_build(&f.sl, &f.src, f.dl, f.dst, f.n, f.kv, &plan), DUET_OK, "%s",
                 duet_error_last());
    const uint64_t page_bytes = 128ull * 2 * 16,
                   kda_layer = (16ull + 3 * 4 * 3) * 4; /* H 1, K 4, W 4, fp32 */
    uint64_t kv_bytes[4] = {0};
    for (size_t i = 0; i < plan.n_entries; i++) {
        const duet_xfer_entry_t *e = &plan.entries[i];
        if (e->kind != DUET_XFER_SEG_KV)
            continue;
        /* the global page of the entry's first token: from its source offset (64-token source
         * pages, sp[i] = 15 - i, 2 layers of 16-byte tokens) */
        uint64_t src_page = e->src_off / (64ull * 2 * 16);
        uint64_t in_page = e->src_off % (64ull * 2 * 16) % (64ull * 16) / 16;
        uint64_t t = (15 - src_page) * 64 + in_page, j = t / 128;
        cr_assert_eq(e->rank / 2, j % 2, "entry %zu (token %llu, page %llu) on rank %u", i,
                     (unsigned long long)t, (unsigned long long)j, e->rank);
        uint64_t dpage = e->dst_off / page_bytes;
        cr_assert_eq(dpage, (uint64_t)f.dp[e->rank][j / 2], "entry %zu: dst page %llu", i,
                     (unsigned long long)dpage);
        kv_bytes[e->rank] += e->len;
    }
    /* c 0: pages 0, 2 (256 tokens); c 1: pages 1, 3 (128 + 116 tokens); 2 layers of 16 bytes */
    const uint64_t want[4] = {256 * 32, 256 * 32, 244 * 32, 244 * 32};
    for (uint32_t r = 0; r < 4; r++) {
        cr_assert_eq(kv_bytes[r], want[r], "rank %u: %llu KV bytes", r,
                     (unsigned long long)kv_bytes[r]);
        cr_assert_eq(plan.bytes_per_rank[r], want[r] + 2 * kda_layer, "rank %u", r);
    }
    cr_assert_eq(plan.total_bytes, 2 * 500u * 32 + 2 * 4 * kda_layer);
    duet_xfer_plan_free(&plan);
}

/* cp 2 x tp 2: each rank needs its shard's pages (4 global pages: 2 per c), not a quarter. */
Test(transfer_plan, refuses_too_few_pages_for_the_shard, .timeout = 10, .init = cr_redirect_stderr)
{
    fixture_t f;
    fixture(&f);
    f.n = 4;
    f.kv = 2;
    for (uint32_t r = 0; r < 4; r++)
        f.dl[r].kda_heads = 1;
    f.dst[3].n_pages = 1;
    expect_refusal(&f, DUET_ERR_RANGE, "rank 3 (KV shard 1 of 2)");
    fixture(&f);
    f.n = 2;
    f.kv = 1; /* tp 2: both ranks hold all 4 pages */
    f.dst[0].n_pages = 3;
    expect_refusal(&f, DUET_ERR_RANGE, "rank 0 (KV shard 0 of 1)");
}

Test(transfer_plan, refuses_overflowing_offsets, .timeout = 10, .init = cr_redirect_stderr)
{
    fixture_t f;
    fixture(&f);
    f.sl.token_bytes = 0xffffffffu;
    f.sl.page_tokens = 0xffffffffu;
    f.src.n_tokens = 10;
    expect_refusal(&f, DUET_ERR_RANGE, "overflow");
    fixture(&f);
    f.sl.kda_head_dim = 0xffffffffu;
    for (int r = 0; r < 2; r++)
        f.dl[r].kda_head_dim = 0xffffffffu;
    expect_refusal(&f, DUET_ERR_RANGE, "overflow");
}

/* No MLA layers, or no tokens, or no KDA slot: only what exists is planned. */
Test(transfer_plan, empty_parts_give_empty_groups, .timeout = 10)
{
    fixture_t f;
    fixture(&f);
    f.src.kda_slot = -1;
    for (int r = 0; r < 2; r++)
        f.dst[r].kda_slot = -1;
    duet_xfer_plan_t plan = {0};
    cr_assert_eq(duet_xfer_plan_build(&f.sl, &f.src, f.dl, f.dst, f.n, f.kv, &plan), DUET_OK);
    cr_assert_eq(plan.layer_first[2], plan.n_entries); /* KDA groups empty */
    cr_assert_eq(plan.total_bytes, 500u * 2 * 16);
    fixture(&f);
    f.src.n_tokens = 0;
    cr_assert_eq(duet_xfer_plan_build(&f.sl, &f.src, f.dl, f.dst, f.n, f.kv, &plan), DUET_OK);
    cr_assert_eq(plan.layer_first[2], 0u); /* KV groups empty */
    cr_assert_eq(plan.total_bytes, 2u * (4 * 16 + 3 * 16 * 3) * 4);
    duet_xfer_plan_free(&plan);
}

/* ---- replay rows (a moved running request) -------------------------------------------------- */

/* The fixture as a move into one generation worker: 4 heads on both sides, 4 pages of 128, replay
 * pools of 5 (sender) and 3 (destination) rows per (slot, layer), 3 rows sent. */
static void replay_fixture(fixture_t *f)
{
    fixture(f);
    f->n = 1;
    f->sl.replay_rows = 5;
    f->dl[0].kda_heads = 4;
    f->dl[0].replay_rows = 3;
    f->dst[0].n_pages = 4;
    f->src.n_replay = 3;
}

/* Each KDA layer's group ends with one replay entry: rows [0, 3) of the layer's block of the
 * sender's slot 1 into the destination's slot 0, at the offsets of common/cache_layout.h's
 * formula, ((slot * LK + layer) * rows + row) * row_bytes, row_bytes = (6 * H * K + H) * elem. */
Test(transfer_plan, replay_rows_follow_each_kda_layer, .timeout = 10)
{
    fixture_t f;
    replay_fixture(&f);
    duet_xfer_plan_t plan = {0};
    cr_assert_eq(duet_xfer_plan_build(&f.sl, &f.src, f.dl, f.dst, f.n, f.kv, &plan), DUET_OK, "%s",
                 duet_error_last());
    const uint64_t rb = (6 * 4 * 4 + 4) * 4; /* H = K = 4, fp32 */
    cr_assert_eq(rb, 400);
    uint64_t replay_total = 0;
    for (uint32_t l = 0; l < 2; l++) {
        const size_t g = 2 + l, last = plan.layer_first[g + 1] - 1;
        cr_assert_gt(plan.layer_first[g + 1], plan.layer_first[g]);
        for (size_t i = plan.layer_first[g]; i < last; i++)
            cr_assert_eq(plan.entries[i].kind, DUET_XFER_SEG_KDA);
        const duet_xfer_entry_t *e = &plan.entries[last];
        cr_assert_eq(e->kind, DUET_XFER_SEG_REPLAY);
        cr_assert_eq(e->layer, l);
        cr_assert_eq(e->rank, 0);
        cr_assert_eq(e->src_off, ((1 * 2 + l) * 5 + 0) * rb);
        cr_assert_eq(e->dst_off, ((0 * 2 + l) * 3 + 0) * rb);
        cr_assert_eq(e->len, 3 * rb);
        replay_total += e->len;
    }
    /* KV (500 tokens x 2 layers x 16 B), 2 KDA layer blocks, 2 x 3 replay rows */
    const uint64_t kda_layer = (4 * 4 * 4 + 3 * 4 * 4 * 3) * 4;
    cr_assert_eq(plan.total_bytes, 500u * 2 * 16 + 2 * kda_layer + replay_total);
    cr_assert_eq(replay_total, 6 * rb);
    /* what the receiver counts with (duet_xfer_layout_replay_bytes) */
    cr_assert_eq(duet_xfer_layout_replay_bytes(&f.dl[0], 3), 6 * rb);
    cr_assert_eq(duet_xfer_layout_replay_slot_bytes(&f.dl[0]), 2 * 3 * rb);
    cr_assert_eq(duet_xfer_layout_replay_slot_bytes(&f.sl), 2 * 5 * rb);
    /* n_replay 0: the same plan without the replay entries */
    f.src.n_replay = 0;
    cr_assert_eq(duet_xfer_plan_build(&f.sl, &f.src, f.dl, f.dst, f.n, f.kv, &plan), DUET_OK);
    cr_assert_eq(plan.total_bytes, 500u * 2 * 16 + 2 * kda_layer);
    for (size_t i = 0; i < plan.n_entries; i++)
        cr_assert_neq(plan.entries[i].kind, DUET_XFER_SEG_REPLAY);
    duet_xfer_plan_free(&plan);
}

Test(transfer_plan, refuses_bad_replay_rows, .timeout = 10, .init = cr_redirect_stderr)
{
    fixture_t f;
    replay_fixture(&f);
    f.n = 2; /* into a Helix group: not built */
    f.dl[0].kda_heads = 2;
    f.dl[1].replay_rows = 3;
    f.dst[0].n_pages = 2;
    expect_refusal(&f, DUET_ERR_INVALID, "Helix");
    replay_fixture(&f);
    f.src.n_replay = 4; /* the destination holds 3 rows per (slot, layer) */
    expect_refusal(&f, DUET_ERR_RANGE, "rank 0's replay pool holds 3");
    replay_fixture(&f);
    f.sl.replay_rows = 2; /* the sender holds 2 */
    expect_refusal(&f, DUET_ERR_RANGE, "sender's replay pool holds 2");
    replay_fixture(&f);
    f.dl[0].replay_rows = 0; /* no replay pool on the destination */
    expect_refusal(&f, DUET_ERR_RANGE, "holds 0");
    replay_fixture(&f);
    f.src.kda_slot = -1; /* no KDA state sent */
    f.dst[0].kda_slot = -1;
    expect_refusal(&f, DUET_ERR_INVALID, "no KDA state");
    replay_fixture(&f);
    f.sl.n_kda_layers = 0; /* no KDA layers */
    f.dl[0].n_kda_layers = 0;
    expect_refusal(&f, DUET_ERR_INVALID, "no KDA state");
    replay_fixture(&f);
    f.src.n_tokens = 2; /* 3 accepted rows of 2 tokens */
    expect_refusal(&f, DUET_ERR_RANGE, "of only 2 tokens");
    replay_fixture(&f);
    /* slot ends past 64 bits in the replay pool only: 2^20 heads of dim 1 (a KDA layer block of
     * 40 MiB, a replay row of 28 MiB), 2^32 - 1 rows per (slot, layer), slot 1024 */
    f.sl.kda_heads = f.dl[0].kda_heads = 1u << 20;
    f.sl.kda_head_dim = f.dl[0].kda_head_dim = 1;
    f.sl.replay_rows = 0xffffffffu;
    f.src.kda_slot = 1024;
    expect_refusal(&f, DUET_ERR_RANGE, "sender replay slot 1024 overflows");
    f.sl.replay_rows = 5;
    f.src.kda_slot = 0;
    f.dl[0].replay_rows = 0xffffffffu;
    f.dst[0].kda_slot = 1024;
    expect_refusal(&f, DUET_ERR_RANGE, "rank 0: replay slot 1024 overflows");
    f.dl[0].replay_rows = 3; /* the same slots with rows that fit: planned */
    duet_xfer_plan_t plan = {0};
    cr_assert_eq(duet_xfer_plan_build(&f.sl, &f.src, f.dl, f.dst, f.n, f.kv, &plan), DUET_OK, "%s",
                 duet_error_last());
    duet_xfer_plan_free(&plan);
}
