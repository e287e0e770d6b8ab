/*
 * Fuzz target: an Envelope as its receivers take it apart, outside the TCP framing (fuzz_frame)
 * and the router's worker connections (fuzz_registry):
 *  - a UCX control message of the transfer layer: the 16-byte active-message header
 *    (duet__xfer_hdr_read) and the body unpacked into the stack arena of at most 4 KiB
 *    (duet__xfer_env_unpack: no malloc on UCX's callback path), then read as xfer_recv.c reads
 *    an XferDone / XferAbort;
 *  - the same bytes through duet_envelope_unpack (protobuf-c's malloc), and the reservations a
 *    Prefill, Reserved or MoveOut carries through the decoders their receivers call
 *    (duet_xfer_reservation_decode_group as the context worker does for a Prefill,
 *    duet_xfer_reservation_decode for MoveOut).
 *
 * Input: 16 header bytes, then the body. Checked besides no crash / sanitizer report:
 *  - the arena never hands out more than it has; an Envelope the arena unpacks is the one
 *    malloc unpacks (both pack to the same bytes), and it round-trips (pack -> unpack -> pack)
 *    unless it carries fields this build does not know (fuzz/proto_check.h says why);
 *  - the header reader accepts exactly the magic and reads kind and id little-endian;
 *  - string fields are C strings; reservation decoders fail with a detail or give a valid
 *    reservation.
 */
#include "fuzz/fuzz.h"
#include "fuzz/proto_check.h"

#include "common/status.h"
#include "proto/frame.h"
#include "transfer/reservation.h"
#include "transfer/xfer_impl.h"

#define FUZZ_NOW_MS 1700000000000ull

static uint8_t *pack_alloc(const Duet__Envelope *env, size_t *len_p)
{
    size_t n = duet__envelope__get_packed_size(env);
    uint8_t *buf = malloc(n > 0 ? n : 1);
    FUZZ_CHECK(buf != NULL, "oom");
    FUZZ_CHECK(duet__envelope__pack(env, buf) == n, "pack size");
    *len_p = n;
    return buf;
}

static void check_reservations(const ProtobufCBinaryData *first, const ProtobufCBinaryData *more,
                               size_t n_more)
{
    duet_xfer_bytes_t spans[DUET_XFER_MAX_RANKS];
    uint32_t n = n_more < DUET_XFER_MAX_RANKS ? (uint32_t)n_more + 1 : DUET_XFER_MAX_RANKS + 1;
    if (n > DUET_XFER_MAX_RANKS)
        return; /* the context worker refuses this count before decoding */
    spans[0] = (duet_xfer_bytes_t){first->data, first->len};
    for (uint32_t i = 1; i < n; i++)
        spans[i] = (duet_xfer_bytes_t){more[i - 1].data, more[i - 1].len};
    duet_xfer_reservation_t *res = calloc(n, sizeof(*res));
    FUZZ_CHECK(res != NULL, "oom");
    duet_error_clear();
    duet_status_t st = duet_xfer_reservation_decode_group(spans, n, FUZZ_NOW_MS, res);
    if (st < 0) {
        FUZZ_CHECK(duet_error_last()[0] != '\0', "group refused without a detail");
    } else {
        for (uint32_t i = 0; i < n; i++) {
            FUZZ_CHECK(res[i].rank == i && res[i].group_size == n, "rank %u of %u at %u",
                       res[i].rank, res[i].group_size, i);
            FUZZ_CHECK(duet_xfer_reservation_validate(&res[i], FUZZ_NOW_MS) == DUET_OK,
                       "decoded but invalid: %s", duet_error_last());
            duet_xfer_reservation_free(&res[i]);
        }
    }
    free(res);
}

static void check_bodies(const Duet__Envelope *env)
{
    switch (env->body_case) {
    case DUET__ENVELOPE__BODY_PREFILL:
        check_reservations(&env->prefill->reservation, env->prefill->more_reservations,
                           env->prefill->n_more_reservations);
        break;
    case DUET__ENVELOPE__BODY_RESERVED:
        check_reservations(&env->reserved->reservation, env->reserved->more_reservations,
                           env->reserved->n_more_reservations);
        break;
    case DUET__ENVELOPE__BODY_MOVE_OUT: {
        duet_xfer_reservation_t r;
        duet_error_clear();
        if (duet_xfer_reservation_decode(env->move_out->reservation.data,
                                         env->move_out->reservation.len, FUZZ_NOW_MS,
                                         &r) == DUET_OK) {
            FUZZ_CHECK(duet_xfer_reservation_validate(&r, FUZZ_NOW_MS) == DUET_OK, "invalid");
            duet_xfer_reservation_free(&r);
        } else {
            FUZZ_CHECK(duet_error_last()[0] != '\0', "refused without a detail");
        }
        break;
    }
    case DUET__ENVELOPE__BODY_REFUSED:
        FUZZ_CHECK(env->refused->reason != NULL, "reason");
        (void)strlen(env->refused->reason);
        break;
    case DUET__ENVELOPE__BODY_TOKENS:
        FUZZ_CHECK(env->tokens->error != NULL && (env->tokens->n_ids == 0 || env->tokens->ids),
                   "tokens");
        (void)strlen(env->tokens->error);
        break;
    default:
        break;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_quiet();
    if (size < DUET__XFER_AM_HDR_BYTES)
        return 0;
    const uint8_t *hdr = data, *body = data + DUET__XFER_AM_HDR_BYTES;
    size_t len = size - DUET__XFER_AM_HDR_BYTES;

    uint16_t kind = 0;
    uint64_t id = 0;
    bool hdr_ok = duet__xfer_hdr_read(hdr, DUET__XFER_AM_HDR_BYTES, &kind, &id);
    uint32_t magic =
        (uint32_t)hdr[0] | (uint32_t)hdr[1] << 8 | (uint32_t)hdr[2] << 16 | (uint32_t)hdr[3] << 24;
    FUZZ_CHECK(hdr_ok == (magic == DUET__XFER_AM_MAGIC), "header magic");
    if (hdr_ok) {
        uint64_t want = 0;
        for (int i = 7; i >= 0; i--)
            want = want << 8 | hdr[8 + i];
        FUZZ_CHECK(kind == (uint16_t)(hdr[4] | hdr[5] << 8) && id == want, "header fields");
    }
    FUZZ_CHECK(!duet__xfer_hdr_read(hdr, DUET__XFER_AM_HDR_BYTES - 1, &kind, &id),
               "a short header is accepted");

    duet__arena_t *arena = malloc(sizeof(*arena));
    FUZZ_CHECK(arena != NULL, "oom");
    Duet__Envelope *a = duet__xfer_env_unpack(arena, body, len);
    Duet__Envelope *m = NULL;
    duet_error_clear();
    duet_status_t st = duet_envelope_unpack(body, len, 1u << 20, &m);
    FUZZ_CHECK(st == DUET_OK || (st < 0 && m == NULL && duet_error_last()[0] != '\0'),
               "unpack status %d", (int)st);
    if (a != NULL) {
        FUZZ_CHECK(arena->used <= sizeof(arena->buf), "arena used %zu of %zu", arena->used,
                   sizeof(arena->buf));
        FUZZ_CHECK(m != NULL, "the arena unpacked what malloc refuses");
        size_t la, lm;
        uint8_t *pa = pack_alloc(a, &la), *pm = pack_alloc(m, &lm);
        FUZZ_CHECK(la == lm && memcmp(pa, pm, la) == 0, "arena and malloc unpack differ");
        free(pa);
        free(pm);
        /* what xfer_recv.c reads of a done / abort */
        if (a->body_case == DUET__ENVELOPE__BODY_XFER_ABORT && a->xfer_abort->message != NULL)
            (void)strlen(a->xfer_abort->message);
        if (a->body_case == DUET__ENVELOPE__BODY_XFER_DONE)
            (void)(a->xfer_done->bytes + a->xfer_done->checksum);
    }
    if (m != NULL) {
        if (!fuzz_proto_has_unknown(&m->base)) {
            size_t l1, l2;
            uint8_t *p1 = pack_alloc(m, &l1);
            Duet__Envelope *again = NULL;
            FUZZ_CHECK(duet_envelope_unpack(p1, l1, 1u << 20, &again) == DUET_OK,
                       "its own packing does not unpack");
            uint8_t *p2 = pack_alloc(again, &l2);
            FUZZ_CHECK(l1 == l2 && memcmp(p1, p2, l1) == 0, "pack -> unpack -> pack changed it");
            free(p1);
            free(p2);
            duet_envelope_free(again);
        }
        check_bodies(m);
        duet_envelope_free(m);
    }
    free(arena);
    return 0;
}
