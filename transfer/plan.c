/*
 * Transfer plans (contract in plan.h): a pure mapping from the sender's pages to the byte ranges
 * that the destination ranks reserved.
 *
 * KV: for each MLA layer, tokens are walked in runs over which neither the source page nor the
 * destination page changes (a run ends at whichever page boundary comes first, or at n_tokens),
 * so one run is one contiguous range on both sides; a run that continues the previous entry on
 * both sides (same rank) is merged into it. A page held by several ranks (the tp ranks of one
 * Helix c) is walked once per copy: copy t of every page, then copy t + 1, so that each rank's
 * runs stay adjacent and merge. KDA: per layer and rank, S of the rank's heads is one
 * contiguous range on the sender (heads are the outer dimension) and the q, k, v conv windows of
 * its channels are three more; with one rank the four are contiguous and merge into one. Replay
 * rows (one rank only): per KDA layer, rows [0, n_replay) of the slot's block are contiguous on
 * both sides, one entry after the layer's state; entries of different pools never merge.
 *
 * Everything is validated before the plan is touched, with 64-bit overflow checks on every
 * offset the plan can produce (the largest page id and slot bound them). The entry buffer is
 * grown once to an upper bound computed up front and reused by later builds.
 *
 * Sizes and offsets come from common/cache_layout.h, the one definition of the pools' byte
 * layout that the engine's pools use too; this file only maps a duet_xfer_layout_t (the wire's
 * spelling of a layout) onto it.
 */
#include "transfer/plan.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/cache_layout.h"
#include "common/log.h"

static bool mul64(uint64_t a, uint64_t b, uint64_t *r)
{
    return !__builtin_mul_overflow(a, b, r);
}

static duet_kv_layout_t kv_layout_of(const duet_xfer_layout_t *l)
{
    return (duet_kv_layout_t){
        .page_tokens = l->page_tokens, .n_layers = l->n_mla_layers, .token_bytes = l->token_bytes};
}

static duet_kda_layout_t kda_layout_of(const duet_xfer_layout_t *l)
{
    return (duet_kda_layout_t){.n_layers = l->n_kda_layers,
                               .heads = l->kda_heads,
                               .head_dim = l->kda_head_dim,
                               .conv_kernel = l->conv_kernel,
                               .elem_bytes = l->state_elem};
}

duet_replay_layout_t duet_xfer_layout_replay(const duet_xfer_layout_t *l)
{
    return (duet_replay_layout_t){.n_layers = l->n_kda_layers,
                                  .heads = l->kda_heads,
                                  .head_dim = l->kda_head_dim,
                                  .rows = l->replay_rows,
                                  .elem_bytes = l->state_elem};
}

/* Bytes of one KDA layer block. False on overflow or a conv kernel of 0. */
static bool layout_kda_layer_bytes(const duet_xfer_layout_t *l, uint64_t *r)
{
    const duet_kda_layout_t k = kda_layout_of(l);
    return duet_kda_layout_layer_bytes(&k, r);
}

uint64_t duet_xfer_layout_kv_page_bytes(const duet_xfer_layout_t *l)
{
    const duet_kv_layout_t k = kv_layout_of(l);
    uint64_t r;
    if (!duet_kv_layout_page_bytes(&k, &r))
        return UINT64_MAX;
    return r;
}

uint64_t duet_xfer_layout_kda_slot_bytes(const duet_xfer_layout_t *l)
{
    const duet_kda_layout_t k = kda_layout_of(l);
    uint64_t r;
    if (l->n_kda_layers == 0)
        return 0;
    if (!duet_kda_layout_slot_bytes(&k, &r))
        return UINT64_MAX;
    return r;
}

uint64_t duet_xfer_layout_replay_slot_bytes(const duet_xfer_layout_t *l)
{
    const duet_replay_layout_t k = duet_xfer_layout_replay(l);
    uint64_t r;
    if (l->n_kda_layers == 0 || l->replay_rows == 0)
        return 0;
    if (!duet_replay_layout_slot_bytes(&k, &r))
        return UINT64_MAX;
    return r;
}

uint64_t duet_xfer_layout_replay_bytes(const duet_xfer_layout_t *l, uint32_t n_replay)
{
    const duet_replay_layout_t k = duet_xfer_layout_replay(l);
    uint64_t row, r;
    if (!duet_replay_layout_row_bytes(&k, &row) || !mul64(row, n_replay, &r) ||
        !mul64(r, l->n_kda_layers, &r))
        return UINT64_MAX;
    return r;
}

/* Pages of `page_tokens` needed to hold n tokens. */
static uint64_t pages_for(uint64_t n_tokens, uint32_t page_tokens)
{
    return n_tokens / page_tokens + (n_tokens % page_tokens != 0);
}

/* Check the ids of pages[0..n) and that (max id + 1) pages of page_bytes fit in 64 bits. */
static duet_status_t check_pages(const char *side, uint32_t rank, const int32_t *pages, uint64_t n,
                                 uint64_t page_bytes)
{
    int32_t max = -1;
    for (uint64_t i = 0; i < n; i++) {
        if (pages[i] < 0)
            return DUET_FAIL(DUET_ERR_RANGE, "xfer plan: %s rank %u: page[%llu] = %d is negative",
                             side, rank, (unsigned long long)i, pages[i]);
        if (pages[i] > max)
            max = pages[i];
    }
    uint64_t end;
    if (!mul64((uint64_t)max + 1, page_bytes, &end))
        return DUET_FAIL(DUET_ERR_RANGE,
                         "xfer plan: %s rank %u: page %d of %llu bytes overflows 64-bit offsets",
                         side, rank, max, (unsigned long long)page_bytes);
    return DUET_OK;
}

static duet_status_t check_layout_pair(const duet_xfer_layout_t *s, const duet_xfer_layout_t *d,
                                       uint32_t r, uint32_t n_ranks, bool kv, bool kda)
{
#define PLAN_SAME(field)                                                                           \
    if (s->field != d->field)                                                                      \
    return DUET_FAIL(DUET_ERR_INVALID,                                                             \
                     "xfer plan: rank %u: layout." #field " %u differs from the sender's %u", r,   \
                     d->field, s->field)
    PLAN_SAME(n_mla_layers);
    PLAN_SAME(n_kda_layers);
    if (kv) {
        PLAN_SAME(token_bytes);
        if (d->page_tokens == 0)
            return DUET_FAIL(DUET_ERR_INVALID, "xfer plan: rank %u: layout.page_tokens is 0", r);
    }
    if (kda) {
        PLAN_SAME(kda_head_dim);
        PLAN_SAME(conv_kernel);
        PLAN_SAME(state_elem);
        if ((uint64_t)d->kda_heads * n_ranks != s->kda_heads)
            return DUET_FAIL(DUET_ERR_INVALID,
                             "xfer plan: rank %u: layout.kda_heads %u != sender's %u / %u ranks", r,
                             d->kda_heads, s->kda_heads, n_ranks);
    }
#undef PLAN_SAME
    return DUET_OK;
}

static duet_status_t plan_reserve(duet_xfer_plan_t *plan, size_t n_entries, size_t n_groups)
{
    if (plan->cap < n_entries) {
        duet_xfer_entry_t *e = realloc(plan->entries, n_entries * sizeof(*e));
        if (e == NULL)
            return DUET_FAIL(DUET_ERR_NOMEM, "xfer plan: cannot allocate %zu entries", n_entries);
        plan->entries = e;
        plan->cap = n_entries;
    }
    if (plan->layer_cap < n_groups + 1) {
        size_t *f = realloc(plan->layer_first, (n_groups + 1) * sizeof(*f));
        if (f == NULL)
            return DUET_FAIL(DUET_ERR_NOMEM, "xfer plan: cannot allocate %zu layer groups",
                             n_groups);
        plan->layer_first = f;
        plan->layer_cap = n_groups + 1;
    }
    return DUET_OK;
}

/* Append a range to the current layer group, merging it into the previous entry when it
 * continues that entry on both sides (in the same pools). `group_start` is the first entry of the
 * group. */
static void plan_add(duet_xfer_plan_t *plan, size_t group_start, uint8_t kind, uint32_t rank,
                     uint32_t layer, uint64_t src_off, uint64_t dst_off, uint64_t len)
{
    if (len == 0)
        return;
    plan->bytes_per_rank[rank] += len;
    plan->total_bytes += len;
    if (plan->n_entries > group_start) {
        duet_xfer_entry_t *p = &plan->entries[plan->n_entries - 1];
        if (p->kind == kind && p->rank == rank && p->src_off + p->len == src_off &&
            p->dst_off + p->len == dst_off) {
            p->len += len;
            return;
        }
    }
    DUET_ASSERT(plan->n_entries < plan->cap);
    plan->entries[plan->n_entries++] = (duet_xfer_entry_t){.kind = kind,
                                                           .rank = (uint8_t)rank,
                                                           .layer = (uint16_t)layer,
                                                           .src_off = src_off,
                                                           .dst_off = dst_off,
                                                           .len = len};
}

duet_status_t duet_xfer_plan_build(const duet_xfer_layout_t *src_layout, const duet_xfer_src_t *src,
                                   const duet_xfer_layout_t *dst_layout,
                                   const duet_xfer_dest_t *dst, uint32_t n_ranks, uint32_t kv_ranks,
                                   duet_xfer_plan_t *plan_p)
{
    duet_status_t st;
    if (src_layout == NULL || src == NULL || dst_layout == NULL || dst == NULL || plan_p == NULL)
        return DUET_FAIL(DUET_ERR_INVALID, "xfer plan: NULL argument");
    if (n_ranks < 1 || n_ranks > DUET_XFER_MAX_RANKS)
        return DUET_FAIL(DUET_ERR_INVALID, "xfer plan: n_ranks %u outside [1, %d]", n_ranks,
                         DUET_XFER_MAX_RANKS);
    kv_ranks = duet_xfer_kv_ranks_or(kv_ranks, n_ranks);
    if (kv_ranks > n_ranks || n_ranks % kv_ranks != 0)
        return DUET_FAIL(DUET_ERR_INVALID,
                         "xfer plan: KV pages dealt over %u ranks, which does not divide the group "
                         "of %u",
                         kv_ranks, n_ranks);
    const uint32_t copies = n_ranks / kv_ranks; /* ranks holding each KV page (a c's tp) */

    const duet_xfer_layout_t *sl = src_layout;
    const uint32_t L = sl->n_mla_layers;
    const uint32_t LK = sl->n_kda_layers;
    if (L > UINT16_MAX || LK > UINT16_MAX)
        return DUET_FAIL(DUET_ERR_RANGE, "xfer plan: %u MLA / %u KDA layers exceed %u", L, LK,
                         UINT16_MAX);

    /* KV side: moved when there are MLA layers and tokens. */
    const bool kv = L > 0 && src->n_tokens > 0;
    if (kv && (sl->page_tokens == 0 || sl->token_bytes == 0))
        return DUET_FAIL(DUET_ERR_INVALID, "xfer plan: sender layout.%s is 0",
                         sl->page_tokens == 0 ? "page_tokens" : "token_bytes");

    /* KDA side: moved when there are KDA layers and the sender names a slot. */
    if (src->kda_slot < -1)
        return DUET_FAIL(DUET_ERR_RANGE, "xfer plan: sender kda_slot %d is invalid", src->kda_slot);
    const bool kda = LK > 0 && src->kda_slot >= 0;
    uint64_t src_kda_layer = 0;
    if (kda) {
        if (sl->kda_heads == 0 || sl->kda_head_dim == 0 || sl->conv_kernel == 0 ||
            sl->state_elem == 0)
            return DUET_FAIL(DUET_ERR_INVALID,
                             "xfer plan: sender KDA layout has a zero field (heads %u, head_dim "
                             "%u, conv_kernel %u, state_elem %u)",
                             sl->kda_heads, sl->kda_head_dim, sl->conv_kernel, sl->state_elem);
        if (sl->kda_heads % n_ranks != 0)
            return DUET_FAIL(DUET_ERR_INVALID,
                             "xfer plan: %u KDA heads cannot be split over %u ranks", sl->kda_heads,
                             n_ranks);
        uint64_t slot_end;
        if (!layout_kda_layer_bytes(sl, &src_kda_layer) ||
            !mul64(((uint64_t)src->kda_slot + 1) * LK, src_kda_layer, &slot_end))
            return DUET_FAIL(DUET_ERR_RANGE, "xfer plan: sender KDA slot %d overflows 64 bits",
                             src->kda_slot);
    }

    /* Replay rows: moved with the KDA state, into one rank (a move into a Helix group would
     * have to shard the rows by heads: not built). */
    const uint32_t n_replay = src->n_replay;
    uint64_t replay_row = 0;
    if (n_replay > 0) {
        if (n_ranks != 1)
            return DUET_FAIL(DUET_ERR_INVALID,
                             "xfer plan: %u replay rows into a group of %u ranks (moving a "
                             "request into a Helix group is not built)",
                             n_replay, n_ranks);
        if (!kda)
            return DUET_FAIL(DUET_ERR_INVALID,
                             "xfer plan: %u replay rows but no KDA state is sent (%u KDA layers, "
                             "sender kda_slot %d)",
                             n_replay, LK, src->kda_slot);
        if (n_replay > src->n_tokens)
            return DUET_FAIL(DUET_ERR_RANGE, "xfer plan: %u replay rows of only %llu tokens",
                             n_replay, (unsigned long long)src->n_tokens);
        if (n_replay > sl->replay_rows)
            return DUET_FAIL(DUET_ERR_RANGE,
                             "xfer plan: %u replay rows, the sender's replay pool holds %u per "
                             "slot and layer",
                             n_replay, sl->replay_rows);
        const duet_replay_layout_t srl = duet_xfer_layout_replay(sl);
        uint64_t slot_end;
        if (!duet_replay_layout_row_bytes(&srl, &replay_row) ||
            !duet_replay_layout_row_offset(&srl, (uint64_t)src->kda_slot + 1, 0, 0, &slot_end))
            return DUET_FAIL(DUET_ERR_RANGE,
                             "xfer plan: sender replay slot %d overflows 64-bit offsets",
                             src->kda_slot);
    }

    const uint32_t pd = dst_layout[0].page_tokens;
    uint64_t n_dst_pages = 0; /* global destination pages */
    uint64_t src_page_bytes = 0;
    if (kv) {
        uint64_t need = pages_for(src->n_tokens, sl->page_tokens);
        if (src->pages == NULL || need > src->n_pages)
            return DUET_FAIL(DUET_ERR_RANGE,
                             "xfer plan: %llu tokens need %llu source pages of %u, have %u",
                             (unsigned long long)src->n_tokens, (unsigned long long)need,
                             sl->page_tokens, src->n_pages);
        src_page_bytes = duet_xfer_layout_kv_page_bytes(sl);
        if (src_page_bytes == UINT64_MAX)
            return DUET_FAIL(DUET_ERR_RANGE, "xfer plan: sender page size overflows 64 bits");
        if ((st = check_pages("sender", 0, src->pages, need, src_page_bytes)) < 0)
            return st;
        if (pd == 0)
            return DUET_FAIL(DUET_ERR_INVALID, "xfer plan: rank 0: layout.page_tokens is 0");
        n_dst_pages = pages_for(src->n_tokens, pd);
    }

    for (uint32_t r = 0; r < n_ranks; r++) {
        const duet_xfer_layout_t *dl = &dst_layout[r];
        if ((st = check_layout_pair(sl, dl, r, n_ranks, kv, kda)) < 0)
            return st;
        if (kv) {
            if (dl->page_tokens != pd)
                return DUET_FAIL(DUET_ERR_INVALID,
                                 "xfer plan: rank %u: layout.page_tokens %u differs from rank 0's "
                                 "%u (one page size per group)",
                                 r, dl->page_tokens, pd);
            const uint32_t shard = duet_xfer_kv_shard_of(r, n_ranks, kv_ranks);
            uint64_t need = duet_xfer_kv_shard_pages(n_dst_pages, kv_ranks, shard);
            if (need > dst[r].n_pages || (need > 0 && dst[r].pages == NULL))
                return DUET_FAIL(DUET_ERR_RANGE,
                                 "xfer plan: rank %u (KV shard %u of %u): %llu tokens need %llu "
                                 "pages of %u tokens on this rank, the reservation has %u",
                                 r, shard, kv_ranks, (unsigned long long)src->n_tokens,
                                 (unsigned long long)need, pd, dst[r].n_pages);
            uint64_t page_bytes = duet_xfer_layout_kv_page_bytes(dl);
            if (page_bytes == UINT64_MAX)
                return DUET_FAIL(DUET_ERR_RANGE, "xfer plan: rank %u: page size overflows", r);
            if ((st = check_pages("destination", r, dst[r].pages, need, page_bytes)) < 0)
                return st;
        }
        if (LK > 0 && (dst[r].kda_slot >= 0) != (src->kda_slot >= 0))
            return DUET_FAIL(DUET_ERR_INVALID,
                             "xfer plan: rank %u: kda_slot %d but the sender's is %d (both or "
                             "neither must send KDA state)",
                             r, dst[r].kda_slot, src->kda_slot);
        if (dst[r].kda_slot < -1)
            return DUET_FAIL(DUET_ERR_RANGE, "xfer plan: rank %u: kda_slot %d is invalid", r,
                             dst[r].kda_slot);
        if (kda) {
            uint64_t layer, slot_end;
            if (!layout_kda_layer_bytes(dl, &layer) ||
                !mul64(((uint64_t)dst[r].kda_slot + 1) * LK, layer, &slot_end))
                return DUET_FAIL(DUET_ERR_RANGE, "xfer plan: rank %u: KDA slot %d overflows", r,
                                 dst[r].kda_slot);
        }
        if (n_replay > 0) {
            if (n_replay > dl->replay_rows)
                return DUET_FAIL(DUET_ERR_RANGE,
                                 "xfer plan: %u replay rows, rank %u's replay pool holds %u per "
                                 "slot and layer",
                                 n_replay, r, dl->replay_rows);
            const duet_replay_layout_t drl = duet_xfer_layout_replay(dl);
            uint64_t slot_end;
            if (!duet_replay_layout_row_offset(&drl, (uint64_t)dst[r].kda_slot + 1, 0, 0,
                                               &slot_end))
                return DUET_FAIL(DUET_ERR_RANGE,
                                 "xfer plan: rank %u: replay slot %d overflows 64-bit offsets", r,
                                 dst[r].kda_slot);
        }
    }

    /* Upper bound on entries: per MLA layer and copy one run per source or destination page
     * boundary; per KDA layer and rank S + 3 conv windows, and the replay rows. */
    uint64_t src_pages_used = kv ? pages_for(src->n_tokens, sl->page_tokens) : 0;
    uint64_t bound = (uint64_t)L * copies * (src_pages_used + n_dst_pages) +
                     (kda ? 4ull * LK * n_ranks : 0) + (n_replay > 0 ? LK : 0);
    if (bound > SIZE_MAX / sizeof(duet_xfer_entry_t))
        return DUET_FAIL(DUET_ERR_RANGE, "xfer plan: %llu entries are too many",
                         (unsigned long long)bound);
    size_t n_groups = (size_t)L + LK;
    if ((st = plan_reserve(plan_p, (size_t)bound, n_groups)) < 0)
        return st;

    duet_xfer_plan_t *plan = plan_p;
    plan->n_entries = 0;
    plan->n_groups = n_groups;
    plan->total_bytes = 0;
    memset(plan->bytes_per_rank, 0, sizeof(plan->bytes_per_rank));

    /* MLA KV, layer by layer, in token order once per copy (offsets within the bounds checked
     * above): page j goes to rank c * copies + copy, c = j % kv_ranks. */
    const uint64_t tb = sl->token_bytes;
    const uint32_t ps = sl->page_tokens;
    const duet_kv_layout_t skv = kv_layout_of(sl);
    duet_kv_layout_t dkv[DUET_XFER_MAX_RANKS];
    for (uint32_t r = 0; r < n_ranks; r++)
        dkv[r] = kv_layout_of(&dst_layout[r]);
    for (uint32_t l = 0; l < L; l++) {
        size_t group_start = plan->n_entries;
        plan->layer_first[l] = group_start;
        if (!kv)
            continue;
        for (uint32_t copy = 0; copy < copies; copy++) {
            for (uint64_t t = 0; t < src->n_tokens;) {
                uint64_t a = t / ps, sa = t % ps; /* source page index, slot */
                uint64_t j = t / pd, sd = t % pd; /* global destination page index, slot */
                uint64_t run = ps - sa;
                if (pd - sd < run)
                    run = pd - sd;
                if (src->n_tokens - t < run)
                    run = src->n_tokens - t;
                uint32_t r = (uint32_t)(j % kv_ranks) * copies + copy;
                uint64_t local = j / kv_ranks;
                uint64_t src_off = 0, dst_off = 0;
                bool ok =
                    duet_kv_layout_offset(&skv, (uint64_t)src->pages[a], l, sa, &src_off) &&
                    duet_kv_layout_offset(&dkv[r], (uint64_t)dst[r].pages[local], l, sd, &dst_off);
                DUET_ASSERT(ok);
                plan_add(plan, group_start, DUET_XFER_SEG_KV, r, l, src_off, dst_off, run * tb);
                t += run;
            }
        }
    }

    /* KDA: per layer, per rank: the rank's heads of S, then its channels of the q, k, v windows
     * (a rank's pool is laid out as one of H / N heads). Offsets within the bounds checked above.
     */
    const duet_kda_layout_t skd = kda_layout_of(sl);
    for (uint32_t l = 0; l < LK; l++) {
        size_t group_start = plan->n_entries;
        plan->layer_first[L + l] = group_start;
        if (!kda)
            continue;
        const uint64_t K = sl->kda_head_dim;
        const uint64_t Hr = sl->kda_heads / n_ranks;
        uint64_t s_len = 0, c_len = 0;
        bool ok = duet_kda_layout_state_bytes(&skd, Hr, &s_len) &&
                  duet_kda_layout_conv_bytes(&skd, Hr * K, &c_len);
        DUET_ASSERT(ok);
        for (uint32_t r = 0; r < n_ranks; r++) {
            const duet_kda_layout_t dkd = kda_layout_of(&dst_layout[r]);
            const uint64_t ss = (uint64_t)src->kda_slot, ds = (uint64_t)dst[r].kda_slot;
            uint64_t src_off = 0, dst_off = 0;
            ok = duet_kda_layout_state_offset(&skd, ss, l, r * Hr, &src_off) &&
                 duet_kda_layout_state_offset(&dkd, ds, l, 0, &dst_off);
            DUET_ASSERT(ok);
            plan_add(plan, group_start, DUET_XFER_SEG_KDA, r, l, src_off, dst_off, s_len);
            for (uint64_t c = 0; c < 3; c++) {
                ok = duet_kda_layout_conv_offset(&skd, ss, l, c, r * Hr * K, &src_off) &&
                     duet_kda_layout_conv_offset(&dkd, ds, l, c, 0, &dst_off);
                DUET_ASSERT(ok);
                plan_add(plan, group_start, DUET_XFER_SEG_KDA, r, l, src_off, dst_off, c_len);
            }
        }
        if (n_replay > 0) { /* one rank (checked above): rows [0, n_replay) of the layer */
            const duet_replay_layout_t srl = duet_xfer_layout_replay(sl),
                                       drl = duet_xfer_layout_replay(dst_layout);
            uint64_t src_off = 0, dst_off = 0;
            ok = duet_replay_layout_row_offset(&srl, (uint64_t)src->kda_slot, l, 0, &src_off) &&
                 duet_replay_layout_row_offset(&drl, (uint64_t)dst[0].kda_slot, l, 0, &dst_off);
            DUET_ASSERT(ok);
            plan_add(plan, group_start, DUET_XFER_SEG_REPLAY, 0, l, src_off, dst_off,
                     replay_row * n_replay);
        }
    }
    plan->layer_first[n_groups] = plan->n_entries;
    return DUET_OK;
}

void duet_xfer_plan_free(duet_xfer_plan_t *plan)
{
    if (plan == NULL)
        return;
    free(plan->entries);
    free(plan->layer_first);
    memset(plan, 0, sizeof(*plan));
}
