/*
 * TCP framing: 4-byte big-endian length + one packed Envelope (see frame.h).
 *
 * The decoder avoids copies where it can: when it holds no partial frame and the chunk contains a
 * whole frame, it unpacks straight from the chunk; otherwise it assembles the body in a buffer
 * that is kept and reused for later frames (grown only up to max_frame).
 */
#include "proto/frame.h"

#include <stdlib.h>
#include <string.h>

#include "common/log.h"

size_t duet_frame_size(const Duet__Envelope *env)
{
    return DUET_FRAME_HEADER_BYTES + duet__envelope__get_packed_size(env);
}

static void frame_put_header(uint8_t *p, uint32_t len)
{
    p[0] = (uint8_t)(len >> 24);
    p[1] = (uint8_t)(len >> 16);
    p[2] = (uint8_t)(len >> 8);
    p[3] = (uint8_t)len;
}

static duet_status_t frame_check_body_size(size_t body)
{
    if (body == 0)
        return DUET_FAIL(DUET_ERR_INVALID, "frame: envelope packs to 0 bytes (version unset?)");
    if (body > DUET_FRAME_MAX_LIMIT)
        return DUET_FAIL(DUET_ERR_RANGE, "frame: envelope of %zu bytes exceeds the %u-byte limit",
                         body, DUET_FRAME_MAX_LIMIT);
    return DUET_OK;
}

duet_status_t duet_frame_encode(const Duet__Envelope *env, uint8_t *buf, size_t cap, size_t *len_p)
{
    size_t body = duet__envelope__get_packed_size(env);
    duet_status_t st = frame_check_body_size(body);
    if (st < 0)
        return st;
    if (cap < DUET_FRAME_HEADER_BYTES || cap - DUET_FRAME_HEADER_BYTES < body)
        return duet_error_set(DUET_ERR_NO_SPACE, "frame: %zu bytes needed, buffer holds %zu",
                              body + DUET_FRAME_HEADER_BYTES, cap);
    frame_put_header(buf, (uint32_t)body);
    size_t packed = duet__envelope__pack(env, buf + DUET_FRAME_HEADER_BYTES);
    DUET_ASSERT(packed == body);
    *len_p = DUET_FRAME_HEADER_BYTES + body;
    return DUET_OK;
}

/* protobuf-c output sink that appends to a strbuf (errors stay sticky in the strbuf). */
typedef struct {
    ProtobufCBuffer base;
    duet_strbuf_t *sb;
} frame_sb_sink_t;

static void frame_sb_append(ProtobufCBuffer *buffer, size_t len, const uint8_t *data)
{
    frame_sb_sink_t *sink = (frame_sb_sink_t *)buffer;
    (void)duet_strbuf_append(sink->sb, (const char *)data, len);
}

duet_status_t duet_frame_append(const Duet__Envelope *env, duet_strbuf_t *sb)
{
    size_t body = duet__envelope__get_packed_size(env);
    duet_status_t st = frame_check_body_size(body);
    if (st < 0)
        return st;
    uint8_t hdr[DUET_FRAME_HEADER_BYTES];
    frame_put_header(hdr, (uint32_t)body);
    size_t start = sb->len;
    frame_sb_sink_t sink = {.base = {.append = frame_sb_append}, .sb = sb};
    (void)duet_strbuf_append(sb, (const char *)hdr, sizeof(hdr));
    size_t packed = duet__envelope__pack_to_buffer(env, &sink.base);
    if (duet_strbuf_status(sb) < 0)
        return DUET_FAIL(DUET_ERR_NOMEM, "frame: out of memory appending a %zu-byte frame",
                         body + sizeof(hdr));
    DUET_ASSERT(packed == body && sb->len == start + sizeof(hdr) + body);
    return DUET_OK;
}

duet_status_t duet_envelope_unpack(const uint8_t *buf, size_t n, size_t max_bytes,
                                   Duet__Envelope **env_p)
{
    if (n > max_bytes)
        return DUET_FAIL(DUET_ERR_RANGE, "envelope: %zu bytes exceed the %zu-byte limit", n,
                         max_bytes);
    Duet__Envelope *env = duet__envelope__unpack(NULL, n, buf);
    if (env == NULL)
        return DUET_FAIL(DUET_ERR_FORMAT, "envelope: %zu bytes are not a valid Envelope", n);
    *env_p = env;
    return DUET_OK;
}

void duet_envelope_free(Duet__Envelope *env)
{
    if (env != NULL)
        duet__envelope__free_unpacked(env, NULL);
}

duet_status_t duet_frame_decoder_init(duet_frame_decoder_t *d, size_t max_frame)
{
    if (max_frame == 0)
        max_frame = DUET_FRAME_MAX_DEFAULT;
    if (max_frame > DUET_FRAME_MAX_LIMIT)
        return DUET_FAIL(DUET_ERR_INVALID, "frame decoder: max_frame %zu above the limit %u",
                         max_frame, DUET_FRAME_MAX_LIMIT);
    memset(d, 0, sizeof(*d));
    d->max_frame = (uint32_t)max_frame;
    return DUET_OK;
}

void duet_frame_decoder_free(duet_frame_decoder_t *d)
{
    if (d == NULL)
        return;
    free(d->buf);
    memset(d, 0, sizeof(*d));
}

void duet_frame_decoder_reset(duet_frame_decoder_t *d)
{
    d->have = 0;
    d->need = 0;
    d->hdr_have = 0;
    d->failed = DUET_OK;
}

bool duet_frame_decoder_idle(const duet_frame_decoder_t *d)
{
    return d->hdr_have == 0 && d->failed == DUET_OK;
}

static duet_status_t frame_decoder_fail(duet_frame_decoder_t *d, duet_status_t st)
{
    d->failed = st;
    return st;
}

/* The header is complete: check the length before anything is allocated for the body. */
static duet_status_t frame_decoder_header_done(duet_frame_decoder_t *d)
{
    uint32_t len = ((uint32_t)d->hdr[0] << 24) | ((uint32_t)d->hdr[1] << 16) |
                   ((uint32_t)d->hdr[2] << 8) | (uint32_t)d->hdr[3];
    if (len == 0)
        return frame_decoder_fail(
            d, DUET_FAIL(DUET_ERR_FORMAT, "frame: length 0 (an Envelope is never empty)"));
    if (len > d->max_frame)
        return frame_decoder_fail(d, DUET_FAIL(DUET_ERR_RANGE,
                                               "frame: length %u exceeds the maximum frame of %u "
                                               "bytes",
                                               len, d->max_frame));
    d->need = len;
    d->have = 0;
    return DUET_OK;
}

static duet_status_t frame_decoder_reserve(duet_frame_decoder_t *d, size_t n)
{
    if (d->cap >= n)
        return DUET_OK;
    size_t cap = d->cap < 256 ? 256 : d->cap;
    while (cap < n)
        cap *= 2;
    if (cap > d->max_frame)
        cap = d->max_frame;
    uint8_t *p = realloc(d->buf, cap);
    if (p == NULL)
        return frame_decoder_fail(
            d, DUET_FAIL(DUET_ERR_NOMEM, "frame: cannot allocate %zu bytes for a frame", cap));
    d->buf = p;
    d->cap = cap;
    return DUET_OK;
}

static duet_status_t frame_decoder_unpack(duet_frame_decoder_t *d, const uint8_t *body,
                                          Duet__Envelope **env_p)
{
    Duet__Envelope *env = duet__envelope__unpack(NULL, d->need, body);
    if (env == NULL)
        return frame_decoder_fail(
            d, DUET_FAIL(DUET_ERR_FORMAT, "frame: %u-byte body is not a valid Envelope", d->need));
    d->hdr_have = 0;
    d->have = 0;
    d->need = 0;
    *env_p = env;
    return DUET_OK;
}

duet_status_t duet_frame_decoder_feed(duet_frame_decoder_t *d, const uint8_t *data, size_t n,
                                      size_t *consumed_p, Duet__Envelope **env_p)
{
    *consumed_p = 0;
    *env_p = NULL;
    if (d->failed < 0)
        return duet_error_set(d->failed, "frame: stream already failed (%s); close it",
                              duet_status_name(d->failed));

    size_t used = 0;
    duet_status_t st;
    Duet__Envelope *env = NULL;
    while (used < n && d->hdr_have < DUET_FRAME_HEADER_BYTES) {
        d->hdr[d->hdr_have++] = data[used++];
        if (d->hdr_have == DUET_FRAME_HEADER_BYTES && (st = frame_decoder_header_done(d)) < 0)
            return st;
    }
    if (d->hdr_have < DUET_FRAME_HEADER_BYTES) {
        *consumed_p = used;
        return DUET_OK;
    }

    size_t avail = n - used;
    size_t want = d->need - d->have;
    if (d->have == 0 && avail >= want) {
        /* Whole body in this chunk: unpack in place, no copy. */
        if ((st = frame_decoder_unpack(d, data + used, &env)) < 0)
            return st;
        *consumed_p = used + want;
        *env_p = env;
        return DUET_OK;
    }
    /* Grow with the bytes that came, not to the announced length: a peer that sends a header
     * and a trickle of body must not make us hold max_frame bytes per connection. */
    size_t take = avail < want ? avail : want;
    if (take == 0) { /* the header ended the chunk */
        *consumed_p = used;
        return DUET_OK;
    }
    if ((st = frame_decoder_reserve(d, d->have + take)) < 0)
        return st;
    memcpy(d->buf + d->have, data + used, take);
    d->have += take;
    used += take;
    if (d->have == d->need) {
        if ((st = frame_decoder_unpack(d, d->buf, &env)) < 0)
            return st;
        *env_p = env;
    }
    *consumed_p = used;
    return DUET_OK;
}
