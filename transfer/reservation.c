/*
 * Reservation <-> protobuf, with validation of everything a peer could get wrong (reservation.h).
 *
 * The checks run on the C view so that encode (our own bug) and decode (a peer's bytes) apply the
 * same rules. Order matters only for messages: cheap structural checks first, then the page list
 * (bounds, then duplicates: two sequence positions on one page would make the sender overwrite
 * its own data), then the deadline, so that a malformed and stale reservation is reported as
 * malformed.
 */
#include "transfer/reservation.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"

uint64_t duet_xfer_now_unix_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static int cmp_i32(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Refuse a page that appears twice (sorts a copy: decode is once per request, not per token). */
static duet_status_t check_distinct(const int32_t *pages, uint32_t n)
{
    int32_t small[256];
    int32_t *tmp = n <= 256 ? small : malloc((size_t)n * sizeof(*tmp));
    if (tmp == NULL)
        return DUET_FAIL(DUET_ERR_NOMEM, "reservation: cannot check %u pages", n);
    memcpy(tmp, pages, (size_t)n * sizeof(*tmp));
    qsort(tmp, n, sizeof(*tmp), cmp_i32);
    duet_status_t st = DUET_OK;
    for (uint32_t i = 1; i < n; i++) {
        if (tmp[i] == tmp[i - 1]) {
            st = DUET_FAIL(DUET_ERR_RANGE, "reservation: pages: page %d appears twice", tmp[i]);
            break;
        }
    }
    if (tmp != small)
        free(tmp);
    return st;
}

duet_status_t duet_xfer_reservation_validate(const duet_xfer_reservation_t *r, uint64_t now_unix_ms)
{
    const duet_xfer_layout_t *l = &r->layout;
    duet_status_t st;
    uint64_t end;

    if (r->version != DUET_XFER_RESERVATION_VERSION)
        return DUET_FAIL(DUET_ERR_UNSUPPORTED, "reservation: version %u, this build speaks %u",
                         r->version, DUET_XFER_RESERVATION_VERSION);
    if (r->group_size < 1 || r->group_size > DUET_XFER_MAX_RANKS)
        return DUET_FAIL(DUET_ERR_RANGE, "reservation: group_size %u outside [1, %d]",
                         r->group_size, DUET_XFER_MAX_RANKS);
    if (r->rank >= r->group_size)
        return DUET_FAIL(DUET_ERR_RANGE, "reservation: rank %u not below group_size %u", r->rank,
                         r->group_size);
    const uint32_t kv_ranks = duet_xfer_kv_ranks_or(r->kv_ranks, r->group_size);
    if (kv_ranks > r->group_size)
        return DUET_FAIL(DUET_ERR_RANGE, "reservation: kv_ranks %u exceeds group_size %u", kv_ranks,
                         r->group_size);
    if (r->group_size % kv_ranks != 0)
        return DUET_FAIL(DUET_ERR_FORMAT,
                         "reservation: kv_ranks %u does not divide group_size %u (a Helix group "
                         "is cp x tp ranks)",
                         kv_ranks, r->group_size);
    if (r->worker_address.len == 0 || r->worker_address.data == NULL)
        return DUET_FAIL(DUET_ERR_FORMAT, "reservation: worker_address is empty");
    if (r->worker_address.len > DUET_XFER_WORKER_ADDRESS_MAX)
        return DUET_FAIL(DUET_ERR_RANGE, "reservation: worker_address of %zu bytes exceeds %u",
                         r->worker_address.len, DUET_XFER_WORKER_ADDRESS_MAX);
    if (r->kv_rkey.len > DUET_XFER_RKEY_MAX)
        return DUET_FAIL(DUET_ERR_RANGE, "reservation: kv_rkey of %zu bytes exceeds %u",
                         r->kv_rkey.len, DUET_XFER_RKEY_MAX);
    if (r->kda_rkey.len > DUET_XFER_RKEY_MAX)
        return DUET_FAIL(DUET_ERR_RANGE, "reservation: kda_rkey of %zu bytes exceeds %u",
                         r->kda_rkey.len, DUET_XFER_RKEY_MAX);
    if (r->replay_rkey.len > DUET_XFER_RKEY_MAX)
        return DUET_FAIL(DUET_ERR_RANGE, "reservation: replay_rkey of %zu bytes exceeds %u",
                         r->replay_rkey.len, DUET_XFER_RKEY_MAX);
    if (__builtin_add_overflow(r->kv_base, r->kv_bytes, &end))
        return DUET_FAIL(DUET_ERR_RANGE, "reservation: kv_base + kv_bytes overflows");
    if (__builtin_add_overflow(r->kda_base, r->kda_bytes, &end))
        return DUET_FAIL(DUET_ERR_RANGE, "reservation: kda_base + kda_bytes overflows");
    if (__builtin_add_overflow(r->replay_base, r->replay_bytes, &end))
        return DUET_FAIL(DUET_ERR_RANGE, "reservation: replay_base + replay_bytes overflows");
    if (l->n_mla_layers > UINT16_MAX || l->n_kda_layers > UINT16_MAX)
        return DUET_FAIL(DUET_ERR_RANGE,
                         "reservation: layout.n_mla_layers %u / n_kda_layers %u exceed %u",
                         l->n_mla_layers, l->n_kda_layers, UINT16_MAX);

    /* KV pages. */
    if (r->n_pages > DUET_XFER_RESERVATION_MAX_PAGES)
        return DUET_FAIL(DUET_ERR_RANGE, "reservation: %u pages exceed the cap of %u", r->n_pages,
                         DUET_XFER_RESERVATION_MAX_PAGES);
    if (r->n_tokens > 0 && l->n_mla_layers > 0) {
        if (l->page_tokens == 0)
            return DUET_FAIL(DUET_ERR_FORMAT, "reservation: layout.page_tokens is 0");
        if (l->token_bytes == 0)
            return DUET_FAIL(DUET_ERR_FORMAT, "reservation: layout.token_bytes is 0");
        uint64_t global = r->n_tokens / l->page_tokens + (r->n_tokens % l->page_tokens != 0);
        uint32_t shard = duet_xfer_kv_shard_of(r->rank, r->group_size, kv_ranks);
        uint64_t need = duet_xfer_kv_shard_pages(global, kv_ranks, shard);
        if (need > r->n_pages)
            return DUET_FAIL(DUET_ERR_RANGE,
                             "reservation: pages: %u pages of %u tokens on rank %u of %u (KV shard "
                             "%u of %u) cannot hold its share (%llu pages) of n_tokens %llu",
                             r->n_pages, l->page_tokens, r->rank, r->group_size, shard, kv_ranks,
                             (unsigned long long)need, (unsigned long long)r->n_tokens);
    }
    if (r->n_pages > 0) {
        if (r->pages == NULL)
            return DUET_FAIL(DUET_ERR_FORMAT, "reservation: pages missing");
        if (l->page_tokens == 0 || l->n_mla_layers == 0 || l->token_bytes == 0)
            return DUET_FAIL(DUET_ERR_FORMAT,
                             "reservation: pages given but layout.page_tokens %u, n_mla_layers "
                             "%u, token_bytes %u (all must be non-zero)",
                             l->page_tokens, l->n_mla_layers, l->token_bytes);
        if (r->kv_rkey.len == 0)
            return DUET_FAIL(DUET_ERR_FORMAT, "reservation: pages given but kv_rkey is empty");
        uint64_t page_bytes = duet_xfer_layout_kv_page_bytes(l);
        if (page_bytes == UINT64_MAX)
            return DUET_FAIL(DUET_ERR_RANGE, "reservation: layout page size overflows 64 bits");
        for (uint32_t i = 0; i < r->n_pages; i++) {
            int32_t p = r->pages[i];
            if (p < 0)
                return DUET_FAIL(DUET_ERR_RANGE, "reservation: pages[%u] = %d is negative", i, p);
            if (__builtin_mul_overflow((uint64_t)p + 1, page_bytes, &end) || end > r->kv_bytes)
                return DUET_FAIL(DUET_ERR_RANGE,
                                 "reservation: pages[%u] = %d (%llu bytes per page) lies outside "
                                 "kv_bytes %llu",
                                 i, p, (unsigned long long)page_bytes,
                                 (unsigned long long)r->kv_bytes);
        }
        if ((st = check_distinct(r->pages, r->n_pages)) < 0)
            return st;
    }

    /* KDA slot. */
    if (r->kda_slot < -1)
        return DUET_FAIL(DUET_ERR_RANGE, "reservation: kda_slot %d is invalid (-1 = none)",
                         r->kda_slot);
    if (r->kda_slot >= 0) {
        if (l->n_kda_layers == 0)
            return DUET_FAIL(DUET_ERR_FORMAT,
                             "reservation: kda_slot %d but layout.n_kda_layers is 0", r->kda_slot);
        if (l->kda_heads == 0 || l->kda_head_dim == 0 || l->conv_kernel == 0 || l->state_elem == 0)
            return DUET_FAIL(DUET_ERR_FORMAT,
                             "reservation: layout.kda_heads %u, kda_head_dim %u, conv_kernel %u, "
                             "state_elem %u (all must be non-zero with a kda_slot)",
                             l->kda_heads, l->kda_head_dim, l->conv_kernel, l->state_elem);
        if (r->kda_rkey.len == 0)
            return DUET_FAIL(DUET_ERR_FORMAT, "reservation: kda_slot %d but kda_rkey is empty",
                             r->kda_slot);
        uint64_t slot_bytes = duet_xfer_layout_kda_slot_bytes(l);
        if (slot_bytes == UINT64_MAX ||
            __builtin_mul_overflow((uint64_t)r->kda_slot + 1, slot_bytes, &end) ||
            end > r->kda_bytes)
            return DUET_FAIL(DUET_ERR_RANGE,
                             "reservation: kda_slot %d (%llu bytes per slot) lies outside "
                             "kda_bytes %llu",
                             r->kda_slot, (unsigned long long)slot_bytes,
                             (unsigned long long)r->kda_bytes);
    }

    /* Replay rows of the KDA slot (a moved running request). */
    if (r->n_replay > 0) {
        if (r->kda_slot < 0)
            return DUET_FAIL(DUET_ERR_FORMAT, "reservation: n_replay %u but no kda_slot",
                             r->n_replay);
        if (r->group_size != 1)
            return DUET_FAIL(DUET_ERR_RANGE,
                             "reservation: n_replay %u in a group of %u ranks (moving a request "
                             "into a Helix group is not built)",
                             r->n_replay, r->group_size);
        if (r->n_replay > l->replay_rows)
            return DUET_FAIL(DUET_ERR_RANGE,
                             "reservation: n_replay %u exceeds layout.replay_rows %u", r->n_replay,
                             l->replay_rows);
        if (r->n_replay > r->n_tokens)
            return DUET_FAIL(DUET_ERR_RANGE, "reservation: n_replay %u exceeds n_tokens %llu",
                             r->n_replay, (unsigned long long)r->n_tokens);
        if (r->replay_rkey.len == 0 || r->replay_rkey.data == NULL)
            return DUET_FAIL(DUET_ERR_FORMAT, "reservation: n_replay %u but replay_rkey is empty",
                             r->n_replay);
        uint64_t slot_bytes = duet_xfer_layout_replay_slot_bytes(l);
        if (slot_bytes == UINT64_MAX ||
            __builtin_mul_overflow((uint64_t)r->kda_slot + 1, slot_bytes, &end))
            return DUET_FAIL(DUET_ERR_RANGE,
                             "reservation: kda_slot %d's replay rows overflow 64-bit offsets "
                             "(layout.replay_rows %u)",
                             r->kda_slot, l->replay_rows);
        if (end > r->replay_bytes)
            return DUET_FAIL(DUET_ERR_RANGE,
                             "reservation: kda_slot %d's replay rows (%llu bytes per slot) lie "
                             "outside replay_bytes %llu",
                             r->kda_slot, (unsigned long long)slot_bytes,
                             (unsigned long long)r->replay_bytes);
    }

    if (r->deadline_unix_ms == 0)
        return DUET_FAIL(DUET_ERR_FORMAT, "reservation: deadline_unix_ms is missing");
    if (now_unix_ms != 0 && r->deadline_unix_ms <= now_unix_ms)
        return DUET_FAIL(DUET_ERR_TIMEOUT,
                         "reservation: stale reservation (deadline_unix_ms %llu is %llu ms in "
                         "the past)",
                         (unsigned long long)r->deadline_unix_ms,
                         (unsigned long long)(now_unix_ms - r->deadline_unix_ms));
    return DUET_OK;
}

static ProtobufCBinaryData bytes_to_proto(duet_xfer_bytes_t b)
{
    return (ProtobufCBinaryData){.len = b.len, .data = (uint8_t *)b.data};
}

static duet_xfer_bytes_t bytes_from_proto(ProtobufCBinaryData b)
{
    return (duet_xfer_bytes_t){.data = b.data, .len = b.len};
}

void duet_xfer_reservation_to_proto(const duet_xfer_reservation_t *r, Duet__Reservation *msg,
                                    Duet__XferLayout *layout_msg)
{
    const duet_xfer_layout_t *l = &r->layout;
    duet__xfer_layout__init(layout_msg);
    layout_msg->page_tokens = l->page_tokens;
    layout_msg->n_mla_layers = l->n_mla_layers;
    layout_msg->token_bytes = l->token_bytes;
    layout_msg->n_kda_layers = l->n_kda_layers;
    layout_msg->kda_heads = l->kda_heads;
    layout_msg->kda_head_dim = l->kda_head_dim;
    layout_msg->conv_kernel = l->conv_kernel;
    layout_msg->state_elem = l->state_elem;
    layout_msg->replay_rows = l->replay_rows;

    duet__reservation__init(msg);
    msg->version = r->version;
    msg->transfer_id = r->transfer_id;
    msg->request_id = r->request_id;
    msg->rank = r->rank;
    msg->group_size = r->group_size;
    msg->kv_ranks = r->kv_ranks;
    msg->worker_address = bytes_to_proto(r->worker_address);
    msg->kv_rkey = bytes_to_proto(r->kv_rkey);
    msg->kv_base = r->kv_base;
    msg->kv_bytes = r->kv_bytes;
    msg->kda_rkey = bytes_to_proto(r->kda_rkey);
    msg->kda_base = r->kda_base;
    msg->kda_bytes = r->kda_bytes;
    msg->layout = layout_msg;
    msg->n_pages = r->n_pages;
    msg->pages = (int32_t *)r->pages; /* pack only reads it */
    msg->kda_slot = r->kda_slot;
    msg->n_tokens = r->n_tokens;
    msg->deadline_unix_ms = r->deadline_unix_ms;
    msg->replay_rkey = bytes_to_proto(r->replay_rkey);
    msg->replay_base = r->replay_base;
    msg->replay_bytes = r->replay_bytes;
    msg->n_replay = r->n_replay;
}

duet_status_t duet_xfer_reservation_from_proto(const Duet__Reservation *msg, uint64_t now_unix_ms,
                                               duet_xfer_reservation_t *r_p)
{
    if (msg->layout == NULL)
        return DUET_FAIL(DUET_ERR_FORMAT, "reservation: layout is missing");
    if (msg->n_pages > DUET_XFER_RESERVATION_MAX_PAGES)
        return DUET_FAIL(DUET_ERR_RANGE, "reservation: %zu pages exceed the cap of %u",
                         msg->n_pages, DUET_XFER_RESERVATION_MAX_PAGES);
    const Duet__XferLayout *lm = msg->layout;
    duet_xfer_reservation_t r = {
        .version = msg->version,
        .transfer_id = msg->transfer_id,
        .request_id = msg->request_id,
        .rank = msg->rank,
        .group_size = msg->group_size,
        .kv_ranks = duet_xfer_kv_ranks_or(msg->kv_ranks, msg->group_size),
        .worker_address = bytes_from_proto(msg->worker_address),
        .kv_rkey = bytes_from_proto(msg->kv_rkey),
        .kv_base = msg->kv_base,
        .kv_bytes = msg->kv_bytes,
        .kda_rkey = bytes_from_proto(msg->kda_rkey),
        .kda_base = msg->kda_base,
        .kda_bytes = msg->kda_bytes,
        .layout = {.page_tokens = lm->page_tokens,
                   .n_mla_layers = lm->n_mla_layers,
                   .token_bytes = lm->token_bytes,
                   .n_kda_layers = lm->n_kda_layers,
                   .kda_heads = lm->kda_heads,
                   .kda_head_dim = lm->kda_head_dim,
                   .conv_kernel = lm->conv_kernel,
                   .state_elem = lm->state_elem,
                   .replay_rows = lm->replay_rows},
        .pages = msg->pages,
        .n_pages = (uint32_t)msg->n_pages,
        .kda_slot = msg->kda_slot,
        .n_tokens = msg->n_tokens,
        .deadline_unix_ms = msg->deadline_unix_ms,
        .replay_rkey = bytes_from_proto(msg->replay_rkey),
        .replay_base = msg->replay_base,
        .replay_bytes = msg->replay_bytes,
        .n_replay = msg->n_replay,
        .msg = NULL,
    };
    duet_status_t st = duet_xfer_reservation_validate(&r, now_unix_ms);
    if (st < 0)
        return st;
    *r_p = r;
    return DUET_OK;
}

size_t duet_xfer_reservation_packed_size(const duet_xfer_reservation_t *r)
{
    Duet__Reservation msg;
    Duet__XferLayout layout;
    duet_xfer_reservation_to_proto(r, &msg, &layout);
    return duet__reservation__get_packed_size(&msg);
}

duet_status_t duet_xfer_reservation_encode(const duet_xfer_reservation_t *r, uint8_t *buf,
                                           size_t cap, size_t *len_p)
{
    duet_status_t st = duet_xfer_reservation_validate(r, 0);
    if (st < 0)
        return st;
    Duet__Reservation msg;
    Duet__XferLayout layout;
    duet_xfer_reservation_to_proto(r, &msg, &layout);
    size_t need = duet__reservation__get_packed_size(&msg);
    if (need > cap)
        return duet_error_set(DUET_ERR_NO_SPACE, "reservation: %zu bytes needed, buffer holds %zu",
                              need, cap);
    size_t packed = duet__reservation__pack(&msg, buf);
    DUET_ASSERT(packed == need);
    *len_p = packed;
    return DUET_OK;
}

duet_status_t duet_xfer_reservation_decode(const uint8_t *buf, size_t n, uint64_t now_unix_ms,
                                           duet_xfer_reservation_t *r_p)
{
    if (n > DUET_XFER_RESERVATION_MAX_BYTES)
        return DUET_FAIL(DUET_ERR_RANGE, "reservation: %zu bytes exceed the cap of %u", n,
                         DUET_XFER_RESERVATION_MAX_BYTES);
    if (buf == NULL && n > 0)
        return DUET_FAIL(DUET_ERR_INVALID, "reservation: NULL buffer");
    Duet__Reservation *msg = duet__reservation__unpack(NULL, n, buf);
    if (msg == NULL)
        return DUET_FAIL(DUET_ERR_FORMAT, "reservation: %zu bytes are not a valid Reservation", n);
    if (now_unix_ms == 0)
        now_unix_ms = duet_xfer_now_unix_ms();
    duet_xfer_reservation_t r;
    duet_status_t st = duet_xfer_reservation_from_proto(msg, now_unix_ms, &r);
    if (st < 0) {
        duet__reservation__free_unpacked(msg, NULL);
        return st;
    }
    r.msg = msg;
    *r_p = r;
    return DUET_OK;
}

void duet_xfer_reservation_free(duet_xfer_reservation_t *r)
{
    if (r == NULL)
        return;
    if (r->msg != NULL)
        duet__reservation__free_unpacked(r->msg, NULL);
    memset(r, 0, sizeof(*r));
}

static int cmp_rank(const void *a, const void *b)
{
    uint32_t x = ((const duet_xfer_reservation_t *)a)->rank,
             y = ((const duet_xfer_reservation_t *)b)->rank;
    return (x > y) - (x < y);
}

duet_status_t duet_xfer_reservation_decode_group(const duet_xfer_bytes_t *bufs, uint32_t n,
                                                 uint64_t now_unix_ms, duet_xfer_reservation_t *out)
{
    duet_status_t st = DUET_OK;
    uint32_t done = 0;
    if (n < 1 || n > DUET_XFER_MAX_RANKS)
        return DUET_FAIL(DUET_ERR_INVALID, "reservations: %u of them, a group has 1 to %d", n,
                         DUET_XFER_MAX_RANKS);
    memset(out, 0, (size_t)n * sizeof(*out));
    if (now_unix_ms == 0)
        now_unix_ms = duet_xfer_now_unix_ms();
    for (; done < n; done++) {
        if ((st = duet_xfer_reservation_decode(bufs[done].data, bufs[done].len, now_unix_ms,
                                               &out[done])) < 0) {
            char why[256];
            snprintf(why, sizeof(why), "%s", duet_error_last()); /* FAIL rewrites the detail */
            st = DUET_FAIL(st, "reservations: [%u] of %u: %s", done, n, why);
            goto fail;
        }
    }
    qsort(out, n, sizeof(*out), cmp_rank);
    for (uint32_t i = 0; i < n; i++) {
        const duet_xfer_reservation_t *r = &out[i], *r0 = &out[0];
        if (r->group_size != n) {
            st = DUET_FAIL(DUET_ERR_INVALID,
                           "reservations: rank %u claims a group of %u, %u reservations came",
                           r->rank, r->group_size, n);
            goto fail;
        }
        if (i > 0 && r->rank == out[i - 1].rank) {
            st = DUET_FAIL(DUET_ERR_INVALID, "reservations: rank %u appears twice", r->rank);
            goto fail;
        }
        if (r->kv_ranks != r0->kv_ranks || r->request_id != r0->request_id ||
            r->n_tokens != r0->n_tokens) {
            st = DUET_FAIL(DUET_ERR_INVALID,
                           "reservations: rank %u (kv_ranks %u, request %llu, %llu tokens) differs "
                           "from rank %u (kv_ranks %u, request %llu, %llu tokens)",
                           r->rank, r->kv_ranks, (unsigned long long)r->request_id,
                           (unsigned long long)r->n_tokens, r0->rank, r0->kv_ranks,
                           (unsigned long long)r0->request_id, (unsigned long long)r0->n_tokens);
            goto fail;
        }
    }
    return DUET_OK; /* n distinct ranks below n: exactly 0..n-1, out[r] is rank r */
fail:
    for (uint32_t i = 0; i < done; i++)
        duet_xfer_reservation_free(&out[i]);
    return st;
}

void duet_xfer_reservation_dest(const duet_xfer_reservation_t *r, duet_xfer_dest_t *dest_p)
{
    *dest_p = (duet_xfer_dest_t){.pages = r->pages, .n_pages = r->n_pages, .kda_slot = r->kda_slot};
}
