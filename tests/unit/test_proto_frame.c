/*
 * TCP framing (proto/frame.h): round trips of every Envelope body, streams fed in arbitrary
 * chunks (byte by byte, random splits), refusals of zero, oversized and garbage frames with the
 * right status and a sticky error, and a deterministic fuzz pass of random and mutated streams.
 */
#include <criterion/criterion.h>
#include <criterion/redirect.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "proto/envelope.h"
#include "proto/frame.h"

static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Envelope number i of a test stream: the three bodies in turn, with i in every field. */
typedef struct {
    Duet__Envelope env;
    Duet__Reservation res;
    Duet__XferLayout layout;
    Duet__XferDone done;
    Duet__XferAbort abort_;
    int32_t pages[8];
    uint8_t addr[40];
    char msg[32];
} sample_t;

static void sample_make(sample_t *s, uint32_t i)
{
    memset(s, 0, sizeof(*s));
    duet__envelope__init(&s->env);
    s->env.version = DUET_PROTO_VERSION;
    switch (i % 3) {
    case 0:
        duet__xfer_layout__init(&s->layout);
        s->layout.page_tokens = 128;
        s->layout.token_bytes = 2304;
        duet__reservation__init(&s->res);
        s->res.version = 1;
        s->res.transfer_id = 1000 + i;
        s->res.request_id = i;
        s->res.layout = &s->layout;
        for (int k = 0; k < 8; k++)
            s->pages[k] = (int32_t)(i * 8 + (uint32_t)k);
        s->res.pages = s->pages;
        s->res.n_pages = 1 + i % 8;
        for (size_t k = 0; k < sizeof(s->addr); k++)
            s->addr[k] = (uint8_t)(i + k);
        s->res.worker_address = (ProtobufCBinaryData){.len = sizeof(s->addr), .data = s->addr};
        s->res.kda_slot = (int32_t)(i % 5) - 1;
        s->res.deadline_unix_ms = 1700000000000ull + i;
        s->env.body_case = DUET__ENVELOPE__BODY_RESERVATION;
        s->env.reservation = &s->res;
        break;
    case 1:
        duet__xfer_done__init(&s->done);
        s->done.transfer_id = 1000 + i;
        s->done.bytes = (uint64_t)i << 20;
        s->done.checksum = 0xdeadbeefcafef00dull ^ i;
        s->done.has_checksum = i % 2;
        s->env.body_case = DUET__ENVELOPE__BODY_XFER_DONE;
        s->env.xfer_done = &s->done;
        break;
    default:
        duet__xfer_abort__init(&s->abort_);
        s->abort_.transfer_id = 1000 + i;
        s->abort_.reason = DUET__XFER_ABORT__REASON__DEADLINE;
        snprintf(s->msg, sizeof(s->msg), "abort %u", i);
        s->abort_.message = s->msg;
        s->env.body_case = DUET__ENVELOPE__BODY_XFER_ABORT;
        s->env.xfer_abort = &s->abort_;
        break;
    }
}

/* Plain comparison (no cr_assert: it is called in loops). */
static bool sample_equal(const Duet__Envelope *got, uint32_t i)
{
    sample_t s;
    sample_make(&s, i);
    if (got->version != DUET_PROTO_VERSION || got->body_case != s.env.body_case)
        return false;
    switch (got->body_case) {
    case DUET__ENVELOPE__BODY_RESERVATION: {
        const Duet__Reservation *r = got->reservation;
        return r->transfer_id == s.res.transfer_id && r->request_id == i && r->layout != NULL &&
               r->layout->page_tokens == 128 && r->layout->token_bytes == 2304 &&
               r->n_pages == s.res.n_pages &&
               memcmp(r->pages, s.pages, r->n_pages * sizeof(int32_t)) == 0 &&
               r->worker_address.len == sizeof(s.addr) &&
               memcmp(r->worker_address.data, s.addr, sizeof(s.addr)) == 0 &&
               r->kda_slot == s.res.kda_slot && r->deadline_unix_ms == s.res.deadline_unix_ms;
    }
    case DUET__ENVELOPE__BODY_XFER_DONE:
        return got->xfer_done->transfer_id == s.done.transfer_id &&
               got->xfer_done->bytes == s.done.bytes &&
               got->xfer_done->checksum == s.done.checksum &&
               got->xfer_done->has_checksum == s.done.has_checksum;
    case DUET__ENVELOPE__BODY_XFER_ABORT:
        return got->xfer_abort->transfer_id == s.abort_.transfer_id &&
               got->xfer_abort->reason == DUET__XFER_ABORT__REASON__DEADLINE &&
               strcmp(got->xfer_abort->message, s.msg) == 0;
    default:
        return false;
    }
}

/* A stream of n frames made with duet_frame_append. */
static duet_strbuf_t make_stream(uint32_t n)
{
    duet_strbuf_t sb = {0};
    for (uint32_t i = 0; i < n; i++) {
        sample_t s;
        sample_make(&s, i);
        cr_assert_eq(duet_frame_append(&s.env, &sb), DUET_OK);
    }
    return sb;
}

/* Feed `len` bytes in chunks chosen by `chunk(i)`; return how many envelopes matched in order. */
static uint32_t feed_stream(const uint8_t *p, size_t len, uint64_t *rng, size_t max_chunk)
{
    duet_frame_decoder_t d;
    cr_assert_eq(duet_frame_decoder_init(&d, 0), DUET_OK);
    uint32_t n_ok = 0;
    size_t off = 0;
    while (off < len) {
        size_t chunk = max_chunk == 1 ? 1 : 1 + rng_next(rng) % max_chunk;
        if (chunk > len - off)
            chunk = len - off;
        size_t c_off = 0;
        while (c_off < chunk) {
            size_t used;
            Duet__Envelope *env;
            duet_status_t st =
                duet_frame_decoder_feed(&d, p + off + c_off, chunk - c_off, &used, &env);
            cr_assert_eq(st, DUET_OK, "%s", duet_error_last());
            cr_assert(used > 0 || env != NULL);
            c_off += used;
            if (env != NULL) {
                cr_assert(sample_equal(env, n_ok), "envelope %u differs", n_ok);
                n_ok++;
                duet_envelope_free(env);
            }
        }
        off += chunk;
    }
    cr_assert(duet_frame_decoder_idle(&d));
    duet_frame_decoder_free(&d);
    return n_ok;
}

Test(proto_frame, round_trip_every_body, .timeout = 10)
{
    for (uint32_t i = 0; i < 30; i++) {
        sample_t s;
        sample_make(&s, i);
        uint8_t buf[512];
        size_t len = 0;
        cr_assert_eq(duet_frame_encode(&s.env, buf, sizeof(buf), &len), DUET_OK);
        cr_assert_eq(len, duet_frame_size(&s.env));
        uint32_t body =
            ((uint32_t)buf[0] << 24) | ((uint32_t)buf[1] << 16) | ((uint32_t)buf[2] << 8) | buf[3];
        cr_assert_eq(body + 4, len);
        Duet__Envelope *env = NULL;
        cr_assert_eq(duet_envelope_unpack(buf + 4, body, 1024, &env), DUET_OK);
        cr_assert(sample_equal(env, i));
        duet_envelope_free(env);
    }
}

/* Every constructor of proto/envelope.h: this build's version, its body case, the body it was
 * given, and a frame that decodes to that case. */
Test(proto_frame, envelope_constructors, .timeout = 10)
{
    int n = 0;
#define CHECK_CTOR(field, CASE, Type)                                                              \
    do {                                                                                           \
        Duet__##Type body = DUET__##CASE##__INIT;                                                  \
        Duet__Envelope env = duet_envelope_##field(&body);                                         \
        cr_assert_eq(env.version, DUET_PROTO_VERSION, #field);                                     \
        cr_assert_eq(env.body_case, DUET__ENVELOPE__BODY_##CASE, #field);                          \
        cr_assert_eq(env.field, &body, #field);                                                    \
        uint8_t buf[256];                                                                          \
        size_t len = 0;                                                                            \
        cr_assert_eq(duet_frame_encode(&env, buf, sizeof(buf), &len), DUET_OK, #field);            \
        Duet__Envelope *got = NULL;                                                                \
        cr_assert_eq(duet_envelope_unpack(buf + DUET_FRAME_HEADER_BYTES,                           \
                                          len - DUET_FRAME_HEADER_BYTES, 1024, &got),              \
                     DUET_OK, #field);                                                             \
        cr_assert_eq(got->body_case, DUET__ENVELOPE__BODY_##CASE, #field);                         \
        cr_assert_eq(got->version, DUET_PROTO_VERSION);                                            \
        duet_envelope_free(got);                                                                   \
        n++;                                                                                       \
    } while (0);
    DUET_ENVELOPE_BODIES(CHECK_CTOR)
#undef CHECK_CTOR
    /* Envelope's fields less `version`: a body added to duet.proto must get a constructor */
    cr_assert_eq(n, (int)duet__envelope__descriptor.n_fields - 1, "%d constructors", n);
}

Test(proto_frame, stream_in_one_chunk_byte_by_byte_and_random_splits, .timeout = 30)
{
    duet_strbuf_t sb = make_stream(60);
    uint64_t rng = 7;
    const uint8_t *p = (const uint8_t *)sb.data;
    cr_assert_eq(feed_stream(p, sb.len, &rng, sb.len), 60u);
    cr_assert_eq(feed_stream(p, sb.len, &rng, 1), 60u);
    for (size_t max = 2; max < 400; max += 37)
        cr_assert_eq(feed_stream(p, sb.len, &rng, max), 60u);
    duet_strbuf_free(&sb);
}

Test(proto_frame, encode_refuses_small_buffer_and_empty_envelope, .timeout = 10,
     .init = cr_redirect_stderr)
{
    sample_t s;
    sample_make(&s, 1);
    uint8_t buf[64];
    size_t len = 99;
    size_t need = duet_frame_size(&s.env);
    cr_assert_eq(duet_frame_encode(&s.env, buf, need - 1, &len), DUET_ERR_NO_SPACE);
    cr_assert_eq(duet_frame_encode(&s.env, buf, 3, &len), DUET_ERR_NO_SPACE);
    cr_assert_eq(len, 99u);
    cr_assert_eq(duet_frame_encode(&s.env, buf, need, &len), DUET_OK);

    Duet__Envelope empty = DUET__ENVELOPE__INIT;
    cr_assert_eq(duet_frame_encode(&empty, buf, sizeof(buf), &len), DUET_ERR_INVALID);
    duet_strbuf_t sb = {0};
    cr_assert_eq(duet_frame_append(&empty, &sb), DUET_ERR_INVALID);
    cr_assert_eq(sb.len, 0u);
    duet_strbuf_free(&sb);
}

static duet_status_t feed_all(duet_frame_decoder_t *d, const uint8_t *p, size_t n,
                              Duet__Envelope **env_p)
{
    size_t used = 0;
    duet_status_t st = duet_frame_decoder_feed(d, p, n, &used, env_p);
    return st;
}

Test(proto_frame, oversized_length_refused_before_allocating, .timeout = 10,
     .init = cr_redirect_stderr)
{
    duet_frame_decoder_t d;
    cr_assert_eq(duet_frame_decoder_init(&d, 1 << 20), DUET_OK);
    const uint8_t hdr[] = {0x7f, 0xff, 0xff, 0xff, 0x08, 0x01};
    Duet__Envelope *env = (Duet__Envelope *)1;
    cr_assert_eq(feed_all(&d, hdr, sizeof(hdr), &env), DUET_ERR_RANGE);
    cr_assert_null(env);
    cr_assert_not_null(strstr(duet_error_last(), "exceeds the maximum frame"), "%s",
                       duet_error_last());
    cr_assert_eq(d.cap, 0u, "allocated for an announced length");
    /* Sticky: the stream is out of sync. */
    const uint8_t ok[] = {0, 0, 0, 2, 0x08, 0x01};
    cr_assert_eq(feed_all(&d, ok, sizeof(ok), &env), DUET_ERR_RANGE);
    cr_assert_not_null(strstr(duet_error_last(), "already failed"));
    cr_assert(!duet_frame_decoder_idle(&d));
    /* Reset makes it usable again. */
    duet_frame_decoder_reset(&d);
    cr_assert_eq(feed_all(&d, ok, sizeof(ok), &env), DUET_OK);
    cr_assert_not_null(env);
    cr_assert_eq(env->version, 1u);
    duet_envelope_free(env);
    /* A length one above the maximum, split over two feeds. */
    const uint8_t big[] = {0x00, 0x10, 0x00, 0x01};
    size_t used;
    cr_assert_eq(duet_frame_decoder_feed(&d, big, 2, &used, &env), DUET_OK);
    cr_assert_eq(used, 2u);
    cr_assert_eq(duet_frame_decoder_feed(&d, big + 2, 2, &used, &env), DUET_ERR_RANGE);
    duet_frame_decoder_free(&d);
    duet_frame_decoder_free(NULL);

    cr_assert_eq(duet_frame_decoder_init(&d, (size_t)DUET_FRAME_MAX_LIMIT + 1), DUET_ERR_INVALID);
}

/* Found with fuzz/fuzz_frame (short inputs ran slowly: each header announcing a length under the
 * maximum made the decoder allocate all of it before a byte of the body came). */
Test(proto_frame, announced_length_allocated_as_the_body_arrives, .timeout = 10)
{
    duet_frame_decoder_t d;
    cr_assert_eq(duet_frame_decoder_init(&d, 0), DUET_OK); /* 16 MiB */
    /* A 16 MiB Envelope: field 2 (reserved header space, unknown to this build) as bytes. */
    const uint32_t len = 16u << 20;
    const uint8_t hdr[] = {
        (uint8_t)(len >> 24), (uint8_t)(len >> 16), (uint8_t)(len >> 8), (uint8_t)len, 0x08, 0x01};
    Duet__Envelope *env = NULL;
    size_t used = 0;
    cr_assert_eq(duet_frame_decoder_feed(&d, hdr, sizeof(hdr), &used, &env), DUET_OK);
    cr_assert_eq(used, sizeof(hdr));
    cr_assert_null(env);
    cr_assert_leq(d.cap, 256u, "%zu bytes held for 2 body bytes of an announced %u", d.cap, len);
    /* The buffer follows the bytes (at most twice them) and the frame still completes. */
    uint8_t *chunk = calloc(1, 1u << 20);
    cr_assert_not_null(chunk);
    size_t have = 2, fed_chunks = 0;
    while (have < len) {
        size_t n = len - have < (1u << 20) ? len - have : (1u << 20);
        if (have == 2) { /* the rest of field 1's frame: unknown field 2, length-delimited */
            size_t rest = len - 2 - 5; /* tag + 4-byte varint length */
            chunk[0] = 0x12;
            chunk[1] = (uint8_t)(0x80 | (rest & 0x7f));
            chunk[2] = (uint8_t)(0x80 | ((rest >> 7) & 0x7f));
            chunk[3] = (uint8_t)(0x80 | ((rest >> 14) & 0x7f));
            chunk[4] = (uint8_t)(rest >> 21);
        }
        cr_assert_eq(duet_frame_decoder_feed(&d, chunk, n, &used, &env), DUET_OK, "%s",
                     duet_error_last());
        cr_assert_eq(used, n);
        if (have == 2)
            memset(chunk, 0, 5);
        have += n;
        fed_chunks++;
        if (have < len)
            cr_assert_leq(d.cap, 2 * have, "%zu bytes held for %zu received", d.cap, have);
    }
    cr_assert_not_null(env, "the whole frame did not decode after %zu chunks", fed_chunks);
    cr_assert_eq(env->version, 1u);
    duet_envelope_free(env);
    free(chunk);
    duet_frame_decoder_free(&d);
}

Test(proto_frame, zero_length_and_garbage_bodies_refused, .timeout = 10, .init = cr_redirect_stderr)
{
    duet_frame_decoder_t d;
    Duet__Envelope *env;
    cr_assert_eq(duet_frame_decoder_init(&d, 0), DUET_OK);
    const uint8_t zero[] = {0, 0, 0, 0};
    cr_assert_eq(feed_all(&d, zero, sizeof(zero), &env), DUET_ERR_FORMAT);
    cr_assert_not_null(strstr(duet_error_last(), "length 0"));
    duet_frame_decoder_reset(&d);
    /* Field 1 with wire type 7 (invalid). */
    const uint8_t bad[] = {0, 0, 0, 3, 0x0f, 0xff, 0xff};
    cr_assert_eq(feed_all(&d, bad, sizeof(bad), &env), DUET_ERR_FORMAT);
    cr_assert_not_null(strstr(duet_error_last(), "not a valid Envelope"));
    duet_frame_decoder_reset(&d);
    /* A reservation body whose length runs past the frame. */
    const uint8_t trunc[] = {0, 0, 0, 4, 0xf2, 0x01, 0x7f, 0x08};
    cr_assert_eq(feed_all(&d, trunc, sizeof(trunc), &env), DUET_ERR_FORMAT);
    duet_frame_decoder_free(&d);

    cr_assert_eq(duet_envelope_unpack(bad + 4, 3, 100, &env), DUET_ERR_FORMAT);
    cr_assert_eq(duet_envelope_unpack(bad + 4, 3, 2, &env), DUET_ERR_RANGE);
}

Test(proto_frame, truncated_frame_waits_for_more, .timeout = 10)
{
    sample_t s;
    sample_make(&s, 0);
    uint8_t buf[512];
    size_t len;
    cr_assert_eq(duet_frame_encode(&s.env, buf, sizeof(buf), &len), DUET_OK);
    duet_frame_decoder_t d;
    cr_assert_eq(duet_frame_decoder_init(&d, 0), DUET_OK);
    for (size_t cut = 1; cut < len; cut++) {
        Duet__Envelope *env = NULL;
        size_t used = 0;
        duet_frame_decoder_reset(&d);
        cr_assert_eq(duet_frame_decoder_feed(&d, buf, cut, &used, &env), DUET_OK);
        cr_assert_eq(used, cut);
        cr_assert_null(env);
        cr_assert(!duet_frame_decoder_idle(&d));
        cr_assert_eq(duet_frame_decoder_feed(&d, buf + cut, len - cut, &used, &env), DUET_OK);
        cr_assert_eq(used, len - cut);
        cr_assert(env != NULL && sample_equal(env, 0));
        duet_envelope_free(env);
    }
    duet_frame_decoder_free(&d);
}

/* A body tag this build does not know (a newer peer's message) decodes as NOT_SET. */
Test(proto_frame, unknown_body_decodes_as_not_set, .timeout = 10)
{
    /* version = 1; field 99 (varint) = 1 */
    const uint8_t frame[] = {0, 0, 0, 5, 0x08, 0x01, 0x98, 0x06, 0x01};
    duet_frame_decoder_t d;
    Duet__Envelope *env = NULL;
    cr_assert_eq(duet_frame_decoder_init(&d, 0), DUET_OK);
    cr_assert_eq(feed_all(&d, frame, sizeof(frame), &env), DUET_OK);
    cr_assert_not_null(env);
    cr_assert_eq(env->version, 1u);
    cr_assert_eq(env->body_case, DUET__ENVELOPE__BODY__NOT_SET);
    duet_envelope_free(env);
    duet_frame_decoder_free(&d);
}

/* Random bytes and mutated valid streams, in random chunks: never a crash, always a status. */
Test(proto_frame, fuzz_random_and_mutated_streams, .timeout = 120, .init = cr_redirect_stderr)
{
    duet_strbuf_t valid = make_stream(12);
    uint64_t rng = 0xf022;
    uint8_t *buf = malloc(valid.len + 64);
    int n_env = 0, n_err = 0, n_bad_status = 0;
    cr_assert_not_null(buf);
    for (int iter = 0; iter < 4000; iter++) {
        size_t len;
        if (iter % 2 == 0) { /* random bytes, small lengths so that headers often fit */
            len = rng_next(&rng) % 64;
            for (size_t i = 0; i < len; i++)
                buf[i] = (uint8_t)rng_next(&rng);
            if (len >= 4 && rng_next(&rng) % 2) {
                buf[0] = buf[1] = 0;
                buf[2] = (uint8_t)(rng_next(&rng) % 2);
            }
        } else { /* mutate a valid stream: flip, overwrite, truncate */
            len = valid.len;
            memcpy(buf, valid.data, len);
            int n_mut = 1 + (int)(rng_next(&rng) % 8);
            for (int m = 0; m < n_mut; m++) {
                size_t at = rng_next(&rng) % len;
                switch (rng_next(&rng) % 3) {
                case 0:
                    buf[at] ^= (uint8_t)(1u << (rng_next(&rng) % 8));
                    break;
                case 1:
                    buf[at] = (uint8_t)rng_next(&rng);
                    break;
                default:
                    len = at + 1;
                    break;
                }
            }
        }
        duet_frame_decoder_t d;
        duet_frame_decoder_init(&d, 1 + rng_next(&rng) % 4096);
        size_t off = 0;
        while (off < len) {
            size_t chunk = 1 + rng_next(&rng) % 100, used = 0;
            Duet__Envelope *env = NULL;
            if (chunk > len - off)
                chunk = len - off;
            duet_status_t st = duet_frame_decoder_feed(&d, buf + off, chunk, &used, &env);
            if (st < 0) {
                n_err++;
                if (st != DUET_ERR_FORMAT && st != DUET_ERR_RANGE)
                    n_bad_status++;
                break;
            }
            if (env != NULL) {
                n_env++;
                duet_envelope_free(env);
            }
            off += used;
        }
        duet_frame_decoder_free(&d);
    }
    free(buf);
    duet_strbuf_free(&valid);
    cr_assert_eq(n_bad_status, 0, "an error other than FORMAT/RANGE");
    cr_assert_gt(n_env, 0);
    cr_assert_gt(n_err, 0);
    cr_log_info("proto_frame fuzz: 4000 streams, %d envelopes, %d refusals", n_env, n_err);
}
