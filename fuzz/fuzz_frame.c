/*
 * Fuzz target: the TCP framing of Envelopes (proto/frame.c), the incremental decoder every
 * router <-> worker connection runs on the bytes it reads.
 *
 * Input: a control byte (the decoder's max_frame: 1..4096 or the default), a byte seeding the
 * chunk sizes, then the stream. Checked besides no crash / sanitizer report:
 *  - the stream decodes to the same Envelopes and the same final status whether it is fed in
 *    one piece or in the fuzzed chunks (the decoder must not depend on how reads split);
 *  - a decoder that failed stays failed (sticky) and consumes nothing;
 *  - every Envelope without unknown fields (fuzz/proto_check.h) round-trips: its frame
 *    (duet_frame_append) decodes to an Envelope that packs to the same bytes (decode -> encode
 *    -> decode), and duet_frame_encode agrees with duet_frame_append byte for byte;
 *  - the decoder holds at most twice the body bytes that came (a peer cannot make it allocate a
 *    length it only announces);
 *  - duet_envelope_unpack of a frame body gives the same Envelope as the decoder.
 */
#include "fuzz/fuzz.h"
#include "fuzz/proto_check.h"

#include "common/status.h"
#include "common/strbuf.h"
#include "proto/frame.h"

typedef struct {
    duet_strbuf_t *packed; /* [n] each Envelope's packed bytes */
    size_t n, cap;
    duet_status_t final;
} run_t;

static void pack_into(const Duet__Envelope *env, duet_strbuf_t *sb)
{
    size_t n = duet__envelope__get_packed_size(env);
    uint8_t *buf = malloc(n > 0 ? n : 1);
    FUZZ_CHECK(buf != NULL, "oom");
    FUZZ_CHECK(duet__envelope__pack(env, buf) == n, "pack size");
    duet_strbuf_append(sb, (const char *)buf, n);
    free(buf);
}

/* Frame env, decode the frame with a fresh decoder and check the result packs the same. */
static void round_trip(const Duet__Envelope *env, const duet_strbuf_t *packed)
{
    if (packed->len == 0)
        return; /* every field at its default: nothing to frame (encode refuses it) */
    if (fuzz_proto_has_unknown(&env->base))
        return; /* see fuzz/proto_check.h */
    duet_strbuf_t frame;
    duet_strbuf_init(&frame);
    FUZZ_CHECK(duet_frame_append(env, &frame) == DUET_OK, "append: %s", duet_error_last());
    FUZZ_CHECK(frame.len == DUET_FRAME_HEADER_BYTES + packed->len &&
                   frame.len == duet_frame_size(env),
               "frame size");
    uint8_t *enc = malloc(frame.len);
    size_t enc_len = 0;
    FUZZ_CHECK(enc != NULL, "oom");
    FUZZ_CHECK(duet_frame_encode(env, enc, frame.len, &enc_len) == DUET_OK &&
                   enc_len == frame.len && memcmp(enc, frame.data, frame.len) == 0,
               "encode and append disagree");
    free(enc);
    duet_frame_decoder_t d;
    FUZZ_CHECK(duet_frame_decoder_init(&d, packed->len) == DUET_OK, "init");
    size_t used = 0;
    Duet__Envelope *again = NULL;
    FUZZ_CHECK(duet_frame_decoder_feed(&d, (const uint8_t *)frame.data, frame.len, &used, &again) ==
                       DUET_OK &&
                   used == frame.len && again != NULL,
               "own frame does not decode: %s", duet_error_last());
    duet_strbuf_t repacked;
    duet_strbuf_init(&repacked);
    pack_into(again, &repacked);
    FUZZ_CHECK(repacked.len == packed->len && memcmp(repacked.data, packed->data, packed->len) == 0,
               "round trip changed the Envelope");
    duet_envelope_free(again);
    duet_strbuf_free(&repacked);
    FUZZ_CHECK(duet_frame_decoder_idle(&d), "decoder not idle after a whole frame");
    duet_frame_decoder_free(&d);
    duet_strbuf_free(&frame);
}

/* Feed stream[0..n) in chunks from `seed` (0 = one piece); record what came out. */
static void run(const uint8_t *stream, size_t n, size_t max_frame, uint8_t seed, run_t *out)
{
    duet_frame_decoder_t d;
    FUZZ_CHECK(duet_frame_decoder_init(&d, max_frame) == DUET_OK, "init");
    out->n = 0;
    out->final = DUET_OK;
    uint32_t rng = seed * 2654435761u + 1;
    size_t at = 0, peak = 0; /* peak: the most body bytes one frame had in the buffer */
    while (at < n) {
        size_t chunk = n - at;
        if (seed != 0) {
            rng = rng * 1103515245u + 12345u;
            chunk = 1 + (rng >> 16) % 64;
            if (chunk > n - at)
                chunk = n - at;
        }
        const uint8_t *p = stream + at;
        size_t left = chunk;
        while (left > 0) {
            size_t used = 0;
            Duet__Envelope *env = NULL;
            duet_status_t st = duet_frame_decoder_feed(&d, p, left, &used, &env);
            if (st < 0) {
                FUZZ_CHECK(used == 0 && env == NULL, "a failed feed consumed or returned");
                out->final = st;
                /* sticky: the next feed fails the same way and takes nothing */
                st = duet_frame_decoder_feed(&d, p, left, &used, &env);
                FUZZ_CHECK(st == out->final && used == 0 && env == NULL, "failure is not sticky");
                FUZZ_CHECK(!duet_frame_decoder_idle(&d), "a failed decoder reports idle");
                duet_frame_decoder_free(&d);
                return;
            }
            FUZZ_CHECK(used > 0 && used <= left, "feed consumed %zu of %zu", used, left);
            if (d.have > peak)
                peak = d.have;
            FUZZ_CHECK(d.cap <= 256 || d.cap <= 2 * peak, "%zu bytes held for %zu received", d.cap,
                       peak);
            p += used;
            left -= used;
            if (env != NULL) {
                if (out->n == out->cap) {
                    out->cap = out->cap ? out->cap * 2 : 16;
                    out->packed = realloc(out->packed, out->cap * sizeof(*out->packed));
                    FUZZ_CHECK(out->packed != NULL, "oom");
                }
                duet_strbuf_init(&out->packed[out->n]);
                pack_into(env, &out->packed[out->n]);
                if (seed == 0)
                    round_trip(env, &out->packed[out->n]);
                out->n++;
                duet_envelope_free(env);
            }
        }
        at += chunk;
    }
    duet_frame_decoder_free(&d);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_quiet();
    fuzz_in_t in = {data, size};
    uint8_t b = fuzz_byte(&in);
    size_t max_frame = b < 128 ? 0 : 1 + (size_t)(b - 128) * 32;
    uint8_t seed = fuzz_byte(&in);
    if (seed == 0)
        seed = 1;
    run_t whole = {0}, split = {0};
    run(in.p, in.n, max_frame, 0, &whole);
    run(in.p, in.n, max_frame, seed, &split);
    FUZZ_CHECK(whole.final == split.final, "status %d in one piece, %d in chunks", (int)whole.final,
               (int)split.final);
    FUZZ_CHECK(whole.n == split.n, "%zu Envelopes in one piece, %zu in chunks", whole.n, split.n);
    for (size_t i = 0; i < whole.n; i++) {
        FUZZ_CHECK(whole.packed[i].len == split.packed[i].len &&
                       memcmp(whole.packed[i].data, split.packed[i].data, whole.packed[i].len) == 0,
                   "Envelope %zu differs between one piece and chunks", i);
        duet_strbuf_free(&whole.packed[i]);
        duet_strbuf_free(&split.packed[i]);
    }
    free(whole.packed);
    free(split.packed);
    /* The first frame's body through duet_envelope_unpack (a UCX active message's path). */
    if (in.n >= DUET_FRAME_HEADER_BYTES) {
        size_t len = ((size_t)in.p[0] << 24) | ((size_t)in.p[1] << 16) | ((size_t)in.p[2] << 8) |
                     (size_t)in.p[3];
        if (len <= in.n - DUET_FRAME_HEADER_BYTES) {
            Duet__Envelope *env = NULL;
            duet_status_t st =
                duet_envelope_unpack(in.p + DUET_FRAME_HEADER_BYTES, len, 1u << 20, &env);
            FUZZ_CHECK(st == DUET_OK || (st < 0 && env == NULL), "unpack status %d", (int)st);
            duet_envelope_free(env);
        }
    }
    return 0;
}
