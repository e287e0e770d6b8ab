/*
 * Fuzz target: reservations as a context worker or a moving generation worker receives them
 * (transfer/reservation.c: duet_xfer_reservation_decode and _decode_group), and the transfer plan
 * the sender then builds against them (transfer/plan.c).
 *
 * Input: one byte n (1 + n % 4 reservations), then the reservations' bytes separated by
 * "\n--rank--\n" (n = 1: duet_xfer_reservation_decode; n > 1: _decode_group). The clock is fixed
 * (FUZZ_NOW_MS), so stale deadlines are found deterministically. Checked besides no crash /
 * sanitizer report:
 *  - a failure sets a detail, allocates nothing and leaves the output zeroed / untouched;
 *  - a decoded reservation passes validate, encodes (to exactly packed_size bytes), decodes again
 *    to the same fields, and re-encodes to the same bytes (decode -> encode -> decode round trip);
 *  - a group is ranks 0..n-1 in order, with one group_size, kv_ranks, request and token count;
 *  - a plan built from a sender with the same layout into the decoded reservations, when the
 *    builder accepts it, writes only inside each rank's advertised regions (kv_bytes, kda_bytes,
 *    replay_bytes): what validation promises the sender.
 */
#include "fuzz/fuzz.h"

#include "common/status.h"
#include "transfer/plan.h"
#include "transfer/reservation.h"

#define FUZZ_NOW_MS 1700000000000ull
#define MAX_GROUP   4

static bool same_bytes(duet_xfer_bytes_t a, duet_xfer_bytes_t b)
{
    return a.len == b.len && (a.len == 0 || memcmp(a.data, b.data, a.len) == 0);
}

static void check_same(const duet_xfer_reservation_t *a, const duet_xfer_reservation_t *b)
{
    FUZZ_CHECK(a->version == b->version && a->transfer_id == b->transfer_id &&
                   a->request_id == b->request_id && a->rank == b->rank &&
                   a->group_size == b->group_size && a->kv_ranks == b->kv_ranks,
               "header fields changed in the round trip");
    FUZZ_CHECK(same_bytes(a->worker_address, b->worker_address) &&
                   same_bytes(a->kv_rkey, b->kv_rkey) && same_bytes(a->kda_rkey, b->kda_rkey) &&
                   same_bytes(a->replay_rkey, b->replay_rkey),
               "byte fields changed in the round trip");
    FUZZ_CHECK(a->kv_base == b->kv_base && a->kv_bytes == b->kv_bytes &&
                   a->kda_base == b->kda_base && a->kda_bytes == b->kda_bytes &&
                   a->replay_base == b->replay_base && a->replay_bytes == b->replay_bytes,
               "regions changed in the round trip");
    FUZZ_CHECK(memcmp(&a->layout, &b->layout, sizeof(a->layout)) == 0, "layout changed");
    FUZZ_CHECK(a->n_pages == b->n_pages && a->kda_slot == b->kda_slot &&
                   a->n_tokens == b->n_tokens && a->deadline_unix_ms == b->deadline_unix_ms &&
                   a->n_replay == b->n_replay,
               "counts changed in the round trip");
    FUZZ_CHECK(a->n_pages == 0 || memcmp(a->pages, b->pages, a->n_pages * sizeof(*a->pages)) == 0,
               "pages changed in the round trip");
}

static void round_trip(const duet_xfer_reservation_t *r)
{
    FUZZ_CHECK(duet_xfer_reservation_validate(r, FUZZ_NOW_MS) == DUET_OK,
               "decoded but not valid: %s", duet_error_last());
    size_t need = duet_xfer_reservation_packed_size(r), len = 0, len2 = 0;
    uint8_t *buf = malloc(need + 1), *buf2 = malloc(need + 1);
    FUZZ_CHECK(buf != NULL && buf2 != NULL, "oom");
    FUZZ_CHECK(duet_xfer_reservation_encode(r, buf, need, &len) == DUET_OK && len == need,
               "encode: %s", duet_error_last());
    duet_xfer_reservation_t again;
    FUZZ_CHECK(duet_xfer_reservation_decode(buf, len, FUZZ_NOW_MS, &again) == DUET_OK,
               "its own encoding does not decode: %s", duet_error_last());
    check_same(r, &again);
    FUZZ_CHECK(duet_xfer_reservation_encode(&again, buf2, need, &len2) == DUET_OK && len2 == len &&
                   memcmp(buf, buf2, len) == 0,
               "encoding is not stable");
    duet_xfer_reservation_free(&again);
    free(buf);
    free(buf2);
}

/* A sender with rank 0's layout (all ranks' KDA heads) and enough pages; check the plan's ranges.
 */
static void check_plan(const duet_xfer_reservation_t *res, uint32_t n)
{
    duet_xfer_layout_t src_layout = res[0].layout, dst_layout[MAX_GROUP];
    duet_xfer_dest_t dst[MAX_GROUP];
    uint64_t heads = 0;
    for (uint32_t i = 0; i < n; i++) {
        dst_layout[i] = res[i].layout;
        duet_xfer_reservation_dest(&res[i], &dst[i]);
        heads += res[i].layout.kda_heads;
    }
    if (heads > UINT32_MAX)
        return;
    src_layout.kda_heads = (uint32_t)heads;
    uint64_t n_tokens = res[0].n_tokens;
    uint64_t src_pages = src_layout.page_tokens > 0
                             ? (n_tokens + src_layout.page_tokens - 1) / src_layout.page_tokens
                             : 0;
    if (src_pages > 4096)
        return; /* keep one input's work small */
    int32_t *pages = malloc((src_pages > 0 ? src_pages : 1) * sizeof(*pages));
    FUZZ_CHECK(pages != NULL, "oom");
    for (uint64_t i = 0; i < src_pages; i++)
        pages[i] = (int32_t)i;
    const duet_xfer_src_t src = {.pages = pages,
                                 .n_pages = (uint32_t)src_pages,
                                 .kda_slot = res[0].kda_slot >= 0 ? 0 : -1,
                                 .n_tokens = n_tokens,
                                 .n_replay = res[0].n_replay};
    duet_xfer_plan_t plan;
    memset(&plan, 0, sizeof(plan));
    if (duet_xfer_plan_build(&src_layout, &src, dst_layout, dst, n, res[0].kv_ranks, &plan) ==
        DUET_OK) {
        for (size_t i = 0; i < plan.n_entries; i++) {
            const duet_xfer_entry_t *e = &plan.entries[i];
            FUZZ_CHECK(e->rank < n && e->kind <= DUET_XFER_SEG_REPLAY, "entry %zu: rank %u kind %u",
                       i, e->rank, e->kind);
            const duet_xfer_reservation_t *r = &res[e->rank];
            uint64_t region = e->kind == DUET_XFER_SEG_KV    ? r->kv_bytes
                              : e->kind == DUET_XFER_SEG_KDA ? r->kda_bytes
                                                             : r->replay_bytes;
            FUZZ_CHECK(e->dst_off + e->len >= e->len && e->dst_off + e->len <= region,
                       "entry %zu (kind %u) writes [%llu, +%llu) on rank %u, which advertised "
                       "%llu bytes",
                       i, e->kind, (unsigned long long)e->dst_off, (unsigned long long)e->len,
                       e->rank, (unsigned long long)region);
        }
    }
    duet_xfer_plan_free(&plan);
    free(pages);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_quiet();
    fuzz_in_t in = {data, size};
    uint32_t n = 1 + fuzz_byte(&in) % MAX_GROUP;
    duet_xfer_bytes_t spans[MAX_GROUP];
    for (uint32_t i = 0; i < n; i++) {
        size_t len;
        const uint8_t *p = fuzz_piece(&in, "\n--rank--\n", &len);
        spans[i] = (duet_xfer_bytes_t){p, len};
    }
    duet_xfer_reservation_t res[MAX_GROUP];
    memset(res, 0x5a, sizeof(res));
    duet_error_clear();
    duet_status_t st;
    if (n == 1) {
        duet_xfer_reservation_t before = res[0];
        st = duet_xfer_reservation_decode(spans[0].data, spans[0].len, FUZZ_NOW_MS, &res[0]);
        if (st != DUET_OK)
            FUZZ_CHECK(memcmp(&before, &res[0], sizeof(before)) == 0, "written on failure");
    } else {
        st = duet_xfer_reservation_decode_group(spans, n, FUZZ_NOW_MS, res);
        if (st != DUET_OK)
            for (uint32_t i = 0; i < n; i++)
                FUZZ_CHECK(res[i].msg == NULL && res[i].n_pages == 0, "not zeroed on failure");
    }
    if (st != DUET_OK) {
        FUZZ_CHECK(st < 0 && duet_error_last()[0] != '\0', "failure %d without a detail", (int)st);
        return 0;
    }
    for (uint32_t i = 0; i < n; i++) {
        FUZZ_CHECK(res[i].msg != NULL, "decode owns its message");
        FUZZ_CHECK(res[i].rank == (n == 1 ? res[i].rank : i) && res[i].rank < res[i].group_size,
                   "rank %u of %u at %u", res[i].rank, res[i].group_size, i);
        FUZZ_CHECK(n == 1 || (res[i].group_size == n && res[i].kv_ranks == res[0].kv_ranks &&
                              res[i].request_id == res[0].request_id &&
                              res[i].n_tokens == res[0].n_tokens),
                   "group fields differ at %u", i);
        FUZZ_CHECK(res[i].kv_ranks >= 1 && res[i].kv_ranks <= res[i].group_size &&
                       res[i].group_size % res[i].kv_ranks == 0,
                   "kv_ranks %u of %u", res[i].kv_ranks, res[i].group_size);
        round_trip(&res[i]);
    }
    if (n == res[0].group_size)
        check_plan(res, n);
    for (uint32_t i = 0; i < n; i++)
        duet_xfer_reservation_free(&res[i]);
    return 0;
}
