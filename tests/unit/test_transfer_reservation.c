/*
 * Reservations (transfer/reservation.h): round trips (bare and inside a framed Envelope), every
 * refusal with its status and the field named in the detail, stale deadlines, truncations, and a
 * deterministic fuzz pass of random and mutated buffers through decode. Refused inputs are packed
 * with protobuf-c directly, since our encoder refuses to write them.
 */
#include <criterion/criterion.h>
#include <criterion/redirect.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "proto/frame.h"
#include "transfer/plan.h"
#include "transfer/reservation.h"

static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

#define NOW 1700000000000ull /* a fixed "now" for deadline checks */

static uint8_t g_addr[300], g_kv_rkey[40], g_kda_rkey[24], g_rp_rkey[32];
static int32_t g_pages[16] = {9, 2, 7, 0, 4, 11, 5, 3, 1, 6, 8, 10, 12, 13, 14, 15};

/* Rank 1 of 2: 64-token pages, 3 MLA layers of 32 bytes per token, 2 KDA layers of 4 heads. */
static duet_xfer_reservation_t valid(void)
{
    for (size_t i = 0; i < sizeof(g_addr); i++)
        g_addr[i] = (uint8_t)(i * 7 + 1);
    memset(g_kv_rkey, 0xab, sizeof(g_kv_rkey));
    memset(g_kda_rkey, 0xcd, sizeof(g_kda_rkey));
    duet_xfer_layout_t l = {.page_tokens = 64,
                            .n_mla_layers = 3,
                            .token_bytes = 32,
                            .n_kda_layers = 2,
                            .kda_heads = 4,
                            .kda_head_dim = 8,
                            .conv_kernel = 4,
                            .state_elem = 4};
    return (duet_xfer_reservation_t){
        .version = DUET_XFER_RESERVATION_VERSION,
        .transfer_id = 0x1122334455667788ull,
        .request_id = 42,
        .rank = 1,
        .group_size = 2,
        .worker_address = {g_addr, sizeof(g_addr)},
        .kv_rkey = {g_kv_rkey, sizeof(g_kv_rkey)},
        .kv_base = 0x7f0000000000ull,
        .kv_bytes = 16ull * 64 * 3 * 32, /* 16 pages */
        .kda_rkey = {g_kda_rkey, sizeof(g_kda_rkey)},
        .kda_base = 0x7e0000000000ull,
        .kda_bytes = 3 * duet_xfer_layout_kda_slot_bytes(&l), /* 3 slots */
        .layout = l,
        .pages = g_pages,
        .n_pages = 5,
        .kda_slot = 2,
        .n_tokens = 600, /* 10 global pages of 64: 5 on rank 1 */
        .deadline_unix_ms = NOW + 5000,
    };
}

/* A moved running request into one generation worker: valid()'s layout with replay pools of 5
 * rows per (slot, layer), 3 rows of slot 2 sent; 600 tokens on 10 pages. */
static duet_xfer_reservation_t valid_replay(void)
{
    duet_xfer_reservation_t r = valid();
    memset(g_rp_rkey, 0xef, sizeof(g_rp_rkey));
    r.rank = 0;
    r.group_size = 1;
    r.n_pages = 10;
    r.layout.replay_rows = 5;
    r.replay_rkey = (duet_xfer_bytes_t){g_rp_rkey, sizeof(g_rp_rkey)};
    r.replay_base = 0x7d0000000000ull;
    r.replay_bytes = 3 * duet_xfer_layout_replay_slot_bytes(&r.layout); /* 3 slots */
    r.n_replay = 3;
    return r;
}

/* Pack r as protobuf-c would, without our validation. */
static uint8_t *pack_raw(const duet_xfer_reservation_t *r, bool drop_layout, size_t *len_p)
{
    Duet__Reservation msg;
    Duet__XferLayout layout;
    duet_xfer_reservation_to_proto(r, &msg, &layout);
    if (drop_layout)
        msg.layout = NULL;
    size_t n = duet__reservation__get_packed_size(&msg);
    uint8_t *buf = malloc(n + 1);
    cr_assert_not_null(buf);
    *len_p = duet__reservation__pack(&msg, buf);
    return buf;
}

static void same(const duet_xfer_reservation_t *a, const duet_xfer_reservation_t *b)
{
    cr_assert_eq(a->version, b->version);
    cr_assert_eq(a->transfer_id, b->transfer_id);
    cr_assert_eq(a->request_id, b->request_id);
    cr_assert_eq(a->rank, b->rank);
    cr_assert_eq(a->group_size, b->group_size);
    /* b is decoded: 0 (every rank its own pages) comes back as group_size */
    cr_assert_eq(duet_xfer_kv_ranks_or(a->kv_ranks, a->group_size), b->kv_ranks);
    cr_assert_eq(a->worker_address.len, b->worker_address.len);
    cr_assert_eq(memcmp(a->worker_address.data, b->worker_address.data, a->worker_address.len), 0);
    cr_assert_eq(a->kv_rkey.len, b->kv_rkey.len);
    cr_assert_eq(memcmp(a->kv_rkey.data, b->kv_rkey.data, a->kv_rkey.len), 0);
    cr_assert_eq(a->kda_rkey.len, b->kda_rkey.len);
    cr_assert_eq(memcmp(a->kda_rkey.data, b->kda_rkey.data, a->kda_rkey.len), 0);
    cr_assert_eq(a->kv_base, b->kv_base);
    cr_assert_eq(a->kv_bytes, b->kv_bytes);
    cr_assert_eq(a->kda_base, b->kda_base);
    cr_assert_eq(a->kda_bytes, b->kda_bytes);
    cr_assert_eq(memcmp(&a->layout, &b->layout, sizeof(a->layout)), 0);
    cr_assert_eq(a->n_pages, b->n_pages);
    cr_assert_eq(memcmp(a->pages, b->pages, a->n_pages * sizeof(int32_t)), 0);
    cr_assert_eq(a->kda_slot, b->kda_slot);
    cr_assert_eq(a->n_tokens, b->n_tokens);
    cr_assert_eq(a->deadline_unix_ms, b->deadline_unix_ms);
    cr_assert_eq(a->replay_rkey.len, b->replay_rkey.len);
    cr_assert(a->replay_rkey.len == 0 ||
              memcmp(a->replay_rkey.data, b->replay_rkey.data, a->replay_rkey.len) == 0);
    cr_assert_eq(a->replay_base, b->replay_base);
    cr_assert_eq(a->replay_bytes, b->replay_bytes);
    cr_assert_eq(a->n_replay, b->n_replay);
}

Test(transfer_reservation, round_trip, .timeout = 10)
{
    duet_xfer_reservation_t r = valid();
    uint8_t buf[2048];
    size_t len = 0;
    cr_assert_eq(duet_xfer_reservation_encode(&r, buf, sizeof(buf), &len), DUET_OK, "%s",
                 duet_error_last());
    cr_assert_eq(len, duet_xfer_reservation_packed_size(&r));
    duet_xfer_reservation_t got;
    cr_assert_eq(duet_xfer_reservation_decode(buf, len, NOW, &got), DUET_OK, "%s",
                 duet_error_last());
    same(&r, &got);
    cr_assert_not_null(got.msg);
    duet_xfer_dest_t dest;
    duet_xfer_reservation_dest(&got, &dest);
    cr_assert_eq(dest.n_pages, 5u);
    cr_assert_eq(dest.kda_slot, 2);
    cr_assert_eq(dest.pages, got.pages);
    duet_xfer_reservation_free(&got);
    cr_assert_null(got.msg);
    duet_xfer_reservation_free(&got);
    duet_xfer_reservation_free(NULL);

    /* No KDA, no pages: a minimal reservation. */
    r = valid();
    r.kda_slot = -1;
    r.kda_rkey.len = 0;
    r.n_pages = 0;
    r.n_tokens = 0;
    r.layout.n_kda_layers = 0;
    cr_assert_eq(duet_xfer_reservation_encode(&r, buf, sizeof(buf), &len), DUET_OK, "%s",
                 duet_error_last());
    cr_assert_eq(duet_xfer_reservation_decode(buf, len, NOW, &got), DUET_OK, "%s",
                 duet_error_last());
    cr_assert_eq(got.kda_slot, -1);
    cr_assert_eq(got.n_pages, 0u);
    duet_xfer_reservation_free(&got);
}

Test(transfer_reservation, decode_with_the_clock, .timeout = 10, .init = cr_redirect_stderr)
{
    duet_xfer_reservation_t r = valid();
    r.deadline_unix_ms = duet_xfer_now_unix_ms() + 60000;
    uint8_t buf[2048];
    size_t len;
    cr_assert_eq(duet_xfer_reservation_encode(&r, buf, sizeof(buf), &len), DUET_OK);
    duet_xfer_reservation_t got;
    cr_assert_eq(duet_xfer_reservation_decode(buf, len, 0, &got), DUET_OK, "%s", duet_error_last());
    duet_xfer_reservation_free(&got);
    r.deadline_unix_ms = duet_xfer_now_unix_ms() - 1;
    cr_assert_eq(duet_xfer_reservation_encode(&r, buf, sizeof(buf), &len), DUET_OK);
    cr_assert_eq(duet_xfer_reservation_decode(buf, len, 0, &got), DUET_ERR_TIMEOUT);
    cr_assert_not_null(strstr(duet_error_last(), "stale reservation"));
}

/* Reservation -> Envelope -> frame -> decoder -> from_proto -> plan. */
Test(transfer_reservation, through_a_frame_into_a_plan, .timeout = 10)
{
    duet_xfer_reservation_t r[2] = {valid(), valid()};
    r[0].rank = 0;
    duet_strbuf_t sb = {0};
    for (int i = 0; i < 2; i++) {
        Duet__Reservation msg;
        Duet__XferLayout layout;
        duet_xfer_reservation_to_proto(&r[i], &msg, &layout);
        Duet__Envelope env = DUET__ENVELOPE__INIT;
        env.version = DUET_PROTO_VERSION;
        env.body_case = DUET__ENVELOPE__BODY_RESERVATION;
        env.reservation = &msg;
        cr_assert_eq(duet_frame_append(&env, &sb), DUET_OK);
    }
    duet_frame_decoder_t d;
    cr_assert_eq(duet_frame_decoder_init(&d, 0), DUET_OK);
    Duet__Envelope *env[2];
    duet_xfer_reservation_t got[2];
    duet_xfer_layout_t dl[2];
    duet_xfer_dest_t dst[2];
    size_t off = 0;
    for (int i = 0; i < 2; i++) {
        size_t used;
        cr_assert_eq(duet_frame_decoder_feed(&d, (const uint8_t *)sb.data + off, sb.len - off,
                                             &used, &env[i]),
                     DUET_OK);
        off += used;
        cr_assert_not_null(env[i]);
        cr_assert_eq(env[i]->body_case, DUET__ENVELOPE__BODY_RESERVATION);
        cr_assert_eq(duet_xfer_reservation_from_proto(env[i]->reservation, NOW, &got[i]), DUET_OK,
                     "%s", duet_error_last());
        same(&r[i], &got[i]);
        cr_assert_null(got[i].msg);
        dl[i] = got[i].layout;
        duet_xfer_reservation_dest(&got[i], &dst[i]);
    }
    cr_assert_eq(off, sb.len);
    /* The sender: 128-token pages, 8 heads, slot 0. */
    duet_xfer_layout_t sl = dl[0];
    sl.page_tokens = 128;
    sl.kda_heads = 8;
    int32_t sp[5] = {4, 3, 2, 1, 0};
    duet_xfer_src_t src = {.pages = sp, .n_pages = 5, .kda_slot = 0, .n_tokens = 600};
    duet_xfer_plan_t plan = {0};
    cr_assert_eq(duet_xfer_plan_build(&sl, &src, dl, dst, 2, 0, &plan), DUET_OK, "%s",
                 duet_error_last());
    cr_assert_eq(plan.total_bytes, 600ull * 3 * 32 + 2 * duet_xfer_layout_kda_slot_bytes(&sl) / 2);
    for (size_t i = 0; i < plan.n_entries; i++) {
        const duet_xfer_entry_t *e = &plan.entries[i];
        uint64_t lim = e->kind == DUET_XFER_SEG_KV ? got[e->rank].kv_bytes : got[e->rank].kda_bytes;
        cr_assert_leq(e->dst_off + e->len, lim, "entry %zu beyond the reserved region", i);
    }
    duet_xfer_plan_free(&plan);
    for (int i = 0; i < 2; i++)
        duet_envelope_free(env[i]);
    duet_frame_decoder_free(&d);
    duet_strbuf_free(&sb);
}

/* Pack r raw, decode at NOW, expect `want` and `needle` in the detail. */
static void refused(const duet_xfer_reservation_t *r, bool drop_layout, duet_status_t want,
                    const char *needle)
{
    size_t len;
    uint8_t *buf = pack_raw(r, drop_layout, &len);
    duet_xfer_reservation_t got;
    memset(&got, 0x5a, sizeof(got));
    duet_status_t st = duet_xfer_reservation_decode(buf, len, NOW, &got);
    cr_assert_eq(st, want, "[%s] got %s (%s), want %s", needle, duet_status_name(st),
                 duet_error_last(), duet_status_name(want));
    cr_assert_not_null(strstr(duet_error_last(), needle), "detail \"%s\" lacks \"%s\"",
                       duet_error_last(), needle);
    cr_assert_eq(((uint8_t *)&got)[0], 0x5a, "out-param written on failure");
    free(buf);
}

#define REFUSE(mut, want, needle)                                                                  \
    do {                                                                                           \
        duet_xfer_reservation_t r = valid();                                                       \
        mut;                                                                                       \
        refused(&r, false, want, needle);                                                          \
    } while (0)

Test(transfer_reservation, refusals_name_the_field, .timeout = 30, .init = cr_redirect_stderr)
{
    static uint8_t big[DUET_XFER_WORKER_ADDRESS_MAX + 1];
    int32_t dup[5] = {3, 1, 4, 1, 5};
    int32_t neg[5] = {3, -1, 4, 2, 5};
    int32_t far[5] = {3, 1, 16, 2, 5}; /* page 16 of a 16-page region */

    REFUSE(r.version = 2, DUET_ERR_UNSUPPORTED, "version");
    REFUSE(r.version = 0, DUET_ERR_UNSUPPORTED, "version");
    REFUSE(r.group_size = 0, DUET_ERR_RANGE, "group_size");
    REFUSE(r.group_size = DUET_XFER_MAX_RANKS + 1, DUET_ERR_RANGE, "group_size");
    REFUSE(r.rank = 2, DUET_ERR_RANGE, "rank");
    REFUSE(r.kv_ranks = 3, DUET_ERR_RANGE, "kv_ranks 3 exceeds group_size 2");
    REFUSE((r.group_size = 4, r.kv_ranks = 3), DUET_ERR_FORMAT,
           "kv_ranks 3 does not divide group_size 4");
    REFUSE(r.worker_address.len = 0, DUET_ERR_FORMAT, "worker_address");
    REFUSE((r.worker_address = (duet_xfer_bytes_t){big, sizeof(big)}), DUET_ERR_RANGE,
           "worker_address");
    REFUSE(r.kv_rkey.len = 0, DUET_ERR_FORMAT, "kv_rkey");
    REFUSE((r.kv_rkey = (duet_xfer_bytes_t){big, DUET_XFER_RKEY_MAX + 1}), DUET_ERR_RANGE,
           "kv_rkey");
    REFUSE((r.kda_rkey = (duet_xfer_bytes_t){big, DUET_XFER_RKEY_MAX + 1}), DUET_ERR_RANGE,
           "kda_rkey");
    REFUSE(r.kda_rkey.len = 0, DUET_ERR_FORMAT, "kda_rkey");
    REFUSE(r.kv_base = UINT64_MAX - 10, DUET_ERR_RANGE, "kv_base");
    REFUSE(r.kda_base = UINT64_MAX - 10, DUET_ERR_RANGE, "kda_base");
    REFUSE(r.layout.page_tokens = 0, DUET_ERR_FORMAT, "page_tokens");
    REFUSE(r.layout.token_bytes = 0, DUET_ERR_FORMAT, "token_bytes");
    REFUSE((r.n_tokens = 0, r.layout.n_mla_layers = 0), DUET_ERR_FORMAT, "n_mla_layers");
    REFUSE(r.layout.n_mla_layers = 70000, DUET_ERR_RANGE, "n_mla_layers");
    REFUSE((r.layout.token_bytes = 0xffffffffu, r.layout.page_tokens = 0xffffffffu, r.n_tokens = 1),
           DUET_ERR_RANGE, "overflow");
    REFUSE(r.pages = neg, DUET_ERR_RANGE, "pages[1]");
    REFUSE(r.pages = far, DUET_ERR_RANGE, "kv_bytes");
    REFUSE(r.kv_bytes = 4 * 64 * 3 * 32, DUET_ERR_RANGE, "kv_bytes"); /* page 9 outside */
    REFUSE(r.pages = dup, DUET_ERR_RANGE, "twice");
    REFUSE(r.n_pages = 4, DUET_ERR_RANGE, "n_tokens");
    REFUSE(r.n_tokens = 1000, DUET_ERR_RANGE, "n_tokens"); /* 16 pages: 8 on rank 1 */
    REFUSE(r.kda_slot = 3, DUET_ERR_RANGE, "kda_slot");
    REFUSE(r.kda_slot = -2, DUET_ERR_RANGE, "kda_slot");
    REFUSE(r.kda_slot = INT32_MAX, DUET_ERR_RANGE, "kda_slot");
    REFUSE(r.layout.n_kda_layers = 0, DUET_ERR_FORMAT, "n_kda_layers");
    REFUSE(r.layout.kda_heads = 0, DUET_ERR_FORMAT, "kda_heads");
    REFUSE(r.layout.conv_kernel = 0, DUET_ERR_FORMAT, "conv_kernel");
    REFUSE(r.layout.kda_head_dim = 0xffffffffu, DUET_ERR_RANGE, "kda_slot");
    REFUSE(r.deadline_unix_ms = 0, DUET_ERR_FORMAT, "deadline_unix_ms");
    REFUSE(r.deadline_unix_ms = NOW, DUET_ERR_TIMEOUT, "stale reservation");
    REFUSE(r.deadline_unix_ms = NOW - 60000, DUET_ERR_TIMEOUT, "60000 ms in the past");

    duet_xfer_reservation_t r = valid();
    refused(&r, true, DUET_ERR_FORMAT, "layout is missing");
}

Test(transfer_reservation, n_tokens_641_needs_six_pages_on_rank_0, .timeout = 10,
     .init = cr_redirect_stderr)
{
    /* 641 tokens = 11 global pages: rank 0 holds 6, rank 1 holds 5. */
    duet_xfer_reservation_t r = valid();
    r.n_tokens = 641;
    uint8_t buf[2048];
    size_t len;
    cr_assert_eq(duet_xfer_reservation_encode(&r, buf, sizeof(buf), &len), DUET_OK, "%s",
                 duet_error_last());
    r.rank = 0;
    cr_assert_eq(duet_xfer_reservation_encode(&r, buf, sizeof(buf), &len), DUET_ERR_RANGE);
    cr_assert_not_null(strstr(duet_error_last(), "rank 0 of 2"));
}

/* Pack r with our encoder and decode it at NOW. */
static duet_status_t round_trip(const duet_xfer_reservation_t *r, duet_xfer_reservation_t *got)
{
    uint8_t buf[2048];
    size_t len;
    duet_status_t st = duet_xfer_reservation_encode(r, buf, sizeof(buf), &len);
    return st < 0 ? st : duet_xfer_reservation_decode(buf, len, NOW, got);
}

/* KV pages dealt over kv_ranks shards: a rank needs its shard's pages (rank r of a group of N
 * holds shard r / (N / kv_ranks)); 0 on the wire is group_size. */
Test(transfer_reservation, kv_ranks_set_each_ranks_page_need, .timeout = 10,
     .init = cr_redirect_stderr)
{
    duet_xfer_reservation_t got, r = valid();
    r.kv_ranks = 0; /* rank 1 of 2, its own 5 pages of 10 */
    cr_assert_eq(round_trip(&r, &got), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(got.kv_ranks, 2u, "kv_ranks 0 decodes as group_size");
    duet_xfer_reservation_free(&got);
    r.kv_ranks = 2;
    cr_assert_eq(round_trip(&r, &got), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(got.kv_ranks, 2u);
    duet_xfer_reservation_free(&got);

    /* tp 2 (kv_ranks 1): rank 1 holds all 10 pages */
    r.kv_ranks = 1;
    cr_assert_eq(round_trip(&r, &got), DUET_ERR_RANGE);
    cr_assert_not_null(strstr(duet_error_last(), "KV shard 0 of 1"), "%s", duet_error_last());
    r.n_pages = 10;
    cr_assert_eq(round_trip(&r, &got), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(got.kv_ranks, 1u);
    duet_xfer_reservation_free(&got);

    /* cp 2 x tp 2: 641 tokens = 11 pages, 6 in shard 0 (ranks 0, 1), 5 in shard 1 (2, 3) */
    r = valid();
    r.group_size = 4;
    r.kv_ranks = 2;
    r.n_tokens = 641;
    r.n_pages = 6;
    for (uint32_t rank = 0; rank < 4; rank++) {
        r.rank = rank;
        cr_assert_eq(round_trip(&r, &got), DUET_OK, "rank %u: %s", rank, duet_error_last());
        cr_assert_eq(got.kv_ranks, 2u);
        duet_xfer_reservation_free(&got);
    }
    r.n_pages = 5;
    for (uint32_t rank = 0; rank < 4; rank++) {
        r.rank = rank;
        cr_assert_eq(round_trip(&r, &got), rank < 2 ? DUET_ERR_RANGE : DUET_OK, "rank %u: %s", rank,
                     duet_error_last());
        if (rank < 2)
            cr_assert_not_null(strstr(duet_error_last(), "KV shard 0 of 2"), "%s",
                               duet_error_last());
        else
            duet_xfer_reservation_free(&got);
    }
}

/* ranks[i] of a group of `group` (kv_ranks kv), each packed into bufs[i] / spans[i]. */
static void pack_group(const uint32_t *ranks, uint32_t n, uint32_t group, uint32_t kv,
                       uint8_t (*bufs)[2048], duet_xfer_bytes_t *spans)
{
    for (uint32_t i = 0; i < n; i++) {
        duet_xfer_reservation_t r = valid();
        r.group_size = group;
        r.kv_ranks = kv;
        r.rank = ranks[i];
        r.n_pages = 10; /* enough for any rank's share */
        r.transfer_id += ranks[i];
        size_t len;
        cr_assert_eq(duet_xfer_reservation_encode(&r, bufs[i], sizeof(bufs[i]), &len), DUET_OK,
                     "%s", duet_error_last());
        spans[i] = (duet_xfer_bytes_t){bufs[i], len};
    }
}

Test(transfer_reservation, decode_group_orders_by_rank, .timeout = 10)
{
    uint8_t bufs[3][2048];
    duet_xfer_bytes_t spans[3];
    duet_xfer_reservation_t out[3];
    pack_group((const uint32_t[]){0, 2, 1}, 3, 3, 1, bufs, spans);
    cr_assert_eq(duet_xfer_reservation_decode_group(spans, 3, NOW, out), DUET_OK, "%s",
                 duet_error_last());
    for (uint32_t r = 0; r < 3; r++) {
        cr_assert_eq(out[r].rank, r);
        cr_assert_eq(out[r].transfer_id, valid().transfer_id + r);
        cr_assert_eq(out[r].kv_ranks, 1u);
        cr_assert_not_null(out[r].msg);
        duet_xfer_reservation_free(&out[r]);
    }
    pack_group((const uint32_t[]){0}, 1, 1, 0, bufs, spans); /* one generation worker */
    cr_assert_eq(duet_xfer_reservation_decode_group(spans, 1, NOW, out), DUET_OK, "%s",
                 duet_error_last());
    cr_assert_eq(out[0].kv_ranks, 1u);
    duet_xfer_reservation_free(&out[0]);
}

static void group_refused(const duet_xfer_bytes_t *spans, uint32_t n, duet_status_t want,
                          const char *needle)
{
    duet_xfer_reservation_t out[4];
    duet_status_t st = duet_xfer_reservation_decode_group(spans, n, NOW, out);
    cr_assert_eq(st, want, "[%s] got %s (%s)", needle, duet_status_name(st), duet_error_last());
    cr_assert_not_null(strstr(duet_error_last(), needle), "detail \"%s\" lacks \"%s\"",
                       duet_error_last(), needle);
    for (uint32_t i = 0; i < n; i++)
        cr_assert_null(out[i].msg, "out[%u] still owns a message", i);
}

Test(transfer_reservation, decode_group_refuses_inconsistent_sets, .timeout = 10,
     .init = cr_redirect_stderr)
{
    uint8_t bufs[4][2048];
    duet_xfer_bytes_t spans[4];
    /* two reservations that claim a group of 3 */
    pack_group((const uint32_t[]){0, 1}, 2, 3, 0, bufs, spans);
    group_refused(spans, 2, DUET_ERR_INVALID, "claims a group of 3, 2 reservations came");
    /* rank 1 twice, rank 0 missing */
    pack_group((const uint32_t[]){1, 1}, 2, 2, 0, bufs, spans);
    group_refused(spans, 2, DUET_ERR_INVALID, "rank 1 appears twice");
    /* kv_ranks differing between ranks */
    pack_group((const uint32_t[]){0, 1, 2, 3}, 4, 4, 2, bufs, spans);
    pack_group((const uint32_t[]){3}, 1, 4, 4, bufs + 3, spans + 3);
    group_refused(spans, 4, DUET_ERR_INVALID, "differs from rank 0");
    /* one undecodable member: named by its place */
    pack_group((const uint32_t[]){0, 1}, 2, 2, 0, bufs, spans);
    spans[1].len = 3;
    group_refused(spans, 2, DUET_ERR_FORMAT, "[1] of 2");
    group_refused(spans, 0, DUET_ERR_INVALID, "a group has 1 to 64");
}

Test(transfer_reservation, too_many_pages_and_oversized_buffers, .timeout = 30,
     .init = cr_redirect_stderr)
{
    uint32_t n = DUET_XFER_RESERVATION_MAX_PAGES + 1;
    int32_t *pages = calloc(n, sizeof(*pages));
    cr_assert_not_null(pages);
    duet_xfer_reservation_t r = valid();
    r.pages = pages;
    r.n_pages = n;
    refused(&r, false, DUET_ERR_RANGE, "exceed the cap");
    free(pages);

    size_t big = (size_t)DUET_XFER_RESERVATION_MAX_BYTES + 1;
    uint8_t *buf = calloc(big, 1);
    cr_assert_not_null(buf);
    duet_xfer_reservation_t got;
    cr_assert_eq(duet_xfer_reservation_decode(buf, big, NOW, &got), DUET_ERR_RANGE);
    cr_assert_not_null(strstr(duet_error_last(), "exceed the cap"));
    free(buf);
}

Test(transfer_reservation, encode_validates_and_checks_space, .timeout = 10,
     .init = cr_redirect_stderr)
{
    duet_xfer_reservation_t r = valid();
    uint8_t buf[2048];
    size_t len = 7;
    r.group_size = 0;
    cr_assert_eq(duet_xfer_reservation_encode(&r, buf, sizeof(buf), &len), DUET_ERR_RANGE);
    r = valid();
    r.deadline_unix_ms = 1; /* encode does not judge staleness */
    size_t need = duet_xfer_reservation_packed_size(&r);
    cr_assert_eq(duet_xfer_reservation_encode(&r, buf, need - 1, &len), DUET_ERR_NO_SPACE);
    cr_assert_eq(len, 7u);
    cr_assert_eq(duet_xfer_reservation_encode(&r, buf, need, &len), DUET_OK);
    cr_assert_eq(len, need);
}

Test(transfer_reservation, garbage_and_every_truncation_refused, .timeout = 30,
     .init = cr_redirect_stderr)
{
    duet_xfer_reservation_t got;
    const uint8_t junk[] = {0x0f, 0xff, 0xff, 0xff};
    cr_assert_eq(duet_xfer_reservation_decode(junk, sizeof(junk), NOW, &got), DUET_ERR_FORMAT);
    cr_assert_not_null(strstr(duet_error_last(), "not a valid Reservation"));
    /* Zero bytes are a message with every field absent: refused for the missing layout. */
    cr_assert_eq(duet_xfer_reservation_decode(NULL, 0, NOW, &got), DUET_ERR_FORMAT);
    cr_assert_not_null(strstr(duet_error_last(), "layout"));

    /* The deadline is the last field packed: every strict prefix is malformed or incomplete. */
    duet_xfer_reservation_t r = valid();
    size_t len;
    uint8_t *buf = pack_raw(&r, false, &len);
    for (size_t cut = 0; cut < len; cut++) {
        duet_status_t st = duet_xfer_reservation_decode(buf, cut, NOW, &got);
        cr_assert_neq(st, DUET_OK, "prefix of %zu / %zu bytes accepted", cut, len);
    }
    cr_assert_eq(duet_xfer_reservation_decode(buf, len, NOW, &got), DUET_OK);
    duet_xfer_reservation_free(&got);
    free(buf);
}

/* Random and mutated buffers through decode: a status every time, and anything accepted is
 * within its own advertised bounds. */
Test(transfer_reservation, fuzz_decode, .timeout = 120, .init = cr_redirect_stderr)
{
    duet_xfer_reservation_t r = valid();
    size_t vlen;
    uint8_t *valid_buf = pack_raw(&r, false, &vlen);
    uint8_t *buf = malloc(vlen + 64);
    uint64_t rng = 0xfa11;
    int n_ok = 0, n_bad = 0, n_weird = 0;
    cr_assert_not_null(buf);
    for (int iter = 0; iter < 5000; iter++) {
        size_t len;
        if (iter % 3 == 0) {
            len = rng_next(&rng) % 96;
            for (size_t i = 0; i < len; i++)
                buf[i] = (uint8_t)rng_next(&rng);
        } else {
            len = vlen;
            memcpy(buf, valid_buf, len);
            int n_mut = 1 + (int)(rng_next(&rng) % 4);
            for (int m = 0; m < n_mut; m++) {
                size_t at = rng_next(&rng) % len;
                switch (rng_next(&rng) % 4) {
                case 0:
                    buf[at] ^= (uint8_t)(1u << (rng_next(&rng) % 8));
                    break;
                case 1:
                    buf[at] = (uint8_t)rng_next(&rng);
                    break;
                case 2:
                    buf[at] = 0xff;
                    break;
                default:
                    len = at + 1;
                    break;
                }
            }
        }
        duet_xfer_reservation_t got;
        duet_status_t st = duet_xfer_reservation_decode(buf, len, NOW, &got);
        if (st == DUET_OK) {
            n_ok++;
            uint64_t pb = duet_xfer_layout_kv_page_bytes(&got.layout);
            for (uint32_t i = 0; i < got.n_pages; i++)
                if (got.pages[i] < 0 || ((uint64_t)got.pages[i] + 1) * pb > got.kv_bytes)
                    n_weird++;
            if (got.rank >= got.group_size || got.deadline_unix_ms <= NOW ||
                got.worker_address.len == 0)
                n_weird++;
            duet_xfer_reservation_free(&got);
        } else {
            n_bad++;
            if (st != DUET_ERR_FORMAT && st != DUET_ERR_RANGE && st != DUET_ERR_UNSUPPORTED &&
                st != DUET_ERR_TIMEOUT)
                n_weird++;
            if (duet_error_last()[0] == '\0')
                n_weird++;
        }
    }
    free(buf);
    free(valid_buf);
    cr_assert_eq(n_weird, 0);
    cr_assert_gt(n_ok, 0);
    cr_assert_gt(n_bad, 0);
    cr_log_info("reservation fuzz: 5000 buffers, %d accepted, %d refused", n_ok, n_bad);
}

/* ---- replay rows (a moved running request) --------------------------------------------------- */

Test(transfer_reservation, replay_round_trip_into_a_plan, .timeout = 10)
{
    duet_xfer_reservation_t r = valid_replay();
    /* the slot's rows: 2 layers x 5 rows of (6 * 4 * 8 + 4) * 4 bytes */
    cr_assert_eq(duet_xfer_layout_replay_slot_bytes(&r.layout), 2ull * 5 * (6 * 4 * 8 + 4) * 4);
    uint8_t buf[2048];
    size_t len = 0;
    cr_assert_eq(duet_xfer_reservation_encode(&r, buf, sizeof(buf), &len), DUET_OK, "%s",
                 duet_error_last());
    duet_xfer_reservation_t got;
    cr_assert_eq(duet_xfer_reservation_decode(buf, len, NOW, &got), DUET_OK, "%s",
                 duet_error_last());
    same(&r, &got);
    cr_assert_eq(got.layout.replay_rows, 5u);
    cr_assert_eq(got.n_replay, 3u);
    /* the sender's plan against it: each replay entry inside the advertised replay region */
    duet_xfer_layout_t sl = got.layout;
    sl.page_tokens = 128;
    sl.replay_rows = 7; /* the sides' pools may differ in rows */
    int32_t sp[5] = {4, 3, 2, 1, 0};
    duet_xfer_src_t src = {
        .pages = sp, .n_pages = 5, .kda_slot = 0, .n_tokens = 600, .n_replay = got.n_replay};
    duet_xfer_dest_t dst;
    duet_xfer_reservation_dest(&got, &dst);
    duet_xfer_plan_t plan = {0};
    cr_assert_eq(duet_xfer_plan_build(&sl, &src, &got.layout, &dst, 1, 0, &plan), DUET_OK, "%s",
                 duet_error_last());
    int n_replay_entries = 0;
    for (size_t i = 0; i < plan.n_entries; i++) {
        const duet_xfer_entry_t *e = &plan.entries[i];
        if (e->kind != DUET_XFER_SEG_REPLAY)
            continue;
        n_replay_entries++;
        cr_assert_leq(e->dst_off + e->len, got.replay_bytes);
    }
    cr_assert_eq(n_replay_entries, 2);
    duet_xfer_plan_free(&plan);
    duet_xfer_reservation_free(&got);

    /* a reservation without the new fields decodes with n_replay 0 and empty replay fields */
    r = valid();
    cr_assert_eq(duet_xfer_reservation_encode(&r, buf, sizeof(buf), &len), DUET_OK);
    cr_assert_eq(duet_xfer_reservation_decode(buf, len, NOW, &got), DUET_OK);
    cr_assert(got.n_replay == 0 && got.replay_rkey.len == 0 && got.replay_bytes == 0 &&
              got.layout.replay_rows == 0);
    duet_xfer_reservation_free(&got);
}

#define REFUSE_REPLAY(mut, want, needle)                                                           \
    do {                                                                                           \
        duet_xfer_reservation_t r = valid_replay();                                                \
        mut;                                                                                       \
        refused(&r, false, want, needle);                                                          \
    } while (0)

Test(transfer_reservation, malformed_replay_fields_refused, .timeout = 10,
     .init = cr_redirect_stderr)
{
    static uint8_t big[DUET_XFER_RKEY_MAX + 1];
    REFUSE_REPLAY(r.replay_rkey.len = 0, DUET_ERR_FORMAT, "replay_rkey is empty");
    REFUSE_REPLAY((r.replay_rkey = (duet_xfer_bytes_t){big, sizeof(big)}), DUET_ERR_RANGE,
                  "replay_rkey of");
    /* slot 2's rows end at 3 slots: 2 slots of rows do not hold them */
    REFUSE_REPLAY(r.replay_bytes = 2 * duet_xfer_layout_replay_slot_bytes(&r.layout),
                  DUET_ERR_RANGE, "outside replay_bytes");
    REFUSE_REPLAY(r.replay_bytes = 0, DUET_ERR_RANGE, "outside replay_bytes");
    REFUSE_REPLAY(r.replay_base = UINT64_MAX - 10, DUET_ERR_RANGE, "replay_base");
    REFUSE_REPLAY(r.n_replay = 6, DUET_ERR_RANGE, "replay_rows 5");
    REFUSE_REPLAY(r.layout.replay_rows = 0, DUET_ERR_RANGE, "replay_rows 0");
    REFUSE_REPLAY(r.n_tokens = 2, DUET_ERR_RANGE, "exceeds n_tokens 2");
    REFUSE_REPLAY((r.kda_slot = -1, r.kda_rkey.len = 0), DUET_ERR_FORMAT, "no kda_slot");
    REFUSE_REPLAY((r.group_size = 2, r.n_pages = 5), DUET_ERR_RANGE, "Helix");
    /* rows per slot past 64 bits: 2^31 heads of dim 1 (the KDA slot, 2^34 bytes, still fits),
     * 2^32 - 1 replay rows of 28 * 2^31 bytes */
    REFUSE_REPLAY((r.layout.kda_heads = 1u << 31, r.layout.kda_head_dim = 1,
                   r.layout.conv_kernel = 1, r.layout.replay_rows = 0xffffffffu,
                   r.kda_bytes = 3 * duet_xfer_layout_kda_slot_bytes(&r.layout)),
                  DUET_ERR_RANGE, "overflow 64-bit");
    /* the same reservation without replay rows is valid: the refusals are about the rows */
    duet_xfer_reservation_t r = valid_replay();
    r.n_replay = 0;
    r.replay_rkey.len = 0;
    r.replay_bytes = 0;
    uint8_t buf[2048];
    size_t len;
    cr_assert_eq(duet_xfer_reservation_encode(&r, buf, sizeof(buf), &len), DUET_OK, "%s",
                 duet_error_last());
}
