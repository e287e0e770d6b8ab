/*
 * Frames on TCP streams (docs/architecture.md, "The wire"): a 4-byte big-endian length, then one
 * packed `Envelope`.
 *
 * The encoder writes into a caller buffer or appends to a strbuf. The decoder is incremental: it
 * accepts byte chunks of any size as they come from a socket and hands back whole Envelopes. It
 * refuses a length above its maximum as soon as the 4 header bytes are in, before allocating
 * anything for the body, and below it grows its buffer with the body bytes that arrived (at most
 * twice them), so a peer cannot make us allocate what it merely announces. A stream
 * that produced an error is out of sync and stays failed (the connection must be closed); the
 * decoder then answers every feed with the same status.
 *
 * Envelopes come from protobuf-c's unpack (default allocator); free them with
 * duet_envelope_free(). The decoder does not interpret the body: checking `version` and
 * `body_case` is the receiver's job (an unknown body from a newer peer decodes as NOT_SET).
 */
#ifndef DUET_PROTO_FRAME_H
#define DUET_PROTO_FRAME_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "common/strbuf.h"
#include "proto/duet.pb-c.h"

#define DUET_PROTO_VERSION      1u /* Envelope.version written by this build */
#define DUET_FRAME_HEADER_BYTES 4u
#define DUET_FRAME_MAX_DEFAULT  (16u << 20) /* 16 MiB: far above any message we send */
#define DUET_FRAME_MAX_LIMIT    0x7fffffffu /* largest max_frame a decoder accepts */

/* Draft positions a Heartbeat's speculation counters cover at most (spec_drafted, spec_accepted;
 * spec_step_tokens has one entry more): the router's metrics are sized by it, and duet-gen checks
 * at compile time that its drafts per step (engine/spec.h, DUET_SPEC_MAX_K) fit. */
#define DUET_PROTO_SPEC_POSITIONS 8u

/* Prefix hashes a Heartbeat carries at most (prefix_hashes: one per prefix cache entry; a worker
 * keeping more entries reports its most recently used): the router refuses the summary of a
 * heartbeat with more and places that worker as if it held nothing. */
#define DUET_PROTO_PREFIX_HASHES 256u

/* Words of a request's RNG state in MoveState.rng (engine/sampler.h's duet_rng_t; duet-gen checks
 * at compile time that they agree). */
#define DUET_PROTO_RNG_WORDS 4u

/* Bytes the frame of `env` takes (header included). */
size_t duet_frame_size(const Duet__Envelope *env);

/*
 * Write the frame of `env` into buf[0..cap). *len_p = bytes written. DUET_ERR_NO_SPACE when cap
 * is too small (nothing useful written), DUET_ERR_RANGE when the packed Envelope is larger than
 * DUET_FRAME_MAX_LIMIT, DUET_ERR_INVALID when it packs to zero bytes (an Envelope always carries
 * at least its version).
 */
duet_status_t duet_frame_encode(const Duet__Envelope *env, uint8_t *buf, size_t cap, size_t *len_p);

/* Append the frame of `env` to sb (binary bytes; sb stays NUL-terminated after them). */
duet_status_t duet_frame_append(const Duet__Envelope *env, duet_strbuf_t *sb);

/*
 * Unpack one Envelope from exactly n bytes (no length header; e.g. a UCX active message).
 * DUET_ERR_RANGE when n > max_bytes, DUET_ERR_FORMAT when the bytes are not an Envelope.
 */
duet_status_t duet_envelope_unpack(const uint8_t *buf, size_t n, size_t max_bytes,
                                   Duet__Envelope **env_p);

/* Free an Envelope from duet_envelope_unpack or the decoder. Accepts NULL. */
void duet_envelope_free(Duet__Envelope *env);

/* Incremental decoder. Embeddable; treat the fields as private. */
typedef struct {
    uint8_t *buf;  /* owned: body of the frame being assembled; reused across frames */
    size_t cap;    /* bytes allocated at buf */
    size_t have;   /* body bytes received so far */
    uint32_t need; /* body length of the current frame (valid when hdr_have == 4) */
    uint8_t hdr[DUET_FRAME_HEADER_BYTES];
    uint8_t hdr_have;     /* header bytes received so far */
    uint32_t max_frame;   /* largest body accepted */
    duet_status_t failed; /* sticky error, DUET_OK while in sync */
} duet_frame_decoder_t;

/* max_frame: largest body length accepted, in [1, DUET_FRAME_MAX_LIMIT] (0 = the default). */
duet_status_t duet_frame_decoder_init(duet_frame_decoder_t *d, size_t max_frame);

/* Free the buffer; the decoder must be init'ed again before reuse. Accepts NULL. */
void duet_frame_decoder_free(duet_frame_decoder_t *d);

/* Drop any partial frame and the sticky error (keeps the buffer). */
void duet_frame_decoder_reset(duet_frame_decoder_t *d);

/*
 * Feed n bytes. Consumes bytes until one whole frame is complete or the input is used up;
 * *consumed_p = bytes taken, *env_p = the decoded Envelope (the caller frees it) or NULL when more
 * bytes are needed. Call again with the rest (data + *consumed_p) until it is used up:
 *
 *   while (n > 0) {
 *       if ((st = duet_frame_decoder_feed(&d, p, n, &used, &env)) < 0) goto close_connection;
 *       p += used; n -= used;
 *       if (env != NULL) { handle(env); duet_envelope_free(env); }
 *   }
 *
 * Errors (sticky): DUET_ERR_RANGE for a length above max_frame, DUET_ERR_FORMAT for a zero length
 * or a body that is not an Envelope, DUET_ERR_NOMEM. On error *consumed_p and *env_p are 0/NULL.
 */
duet_status_t duet_frame_decoder_feed(duet_frame_decoder_t *d, const uint8_t *data, size_t n,
                                      size_t *consumed_p, Duet__Envelope **env_p);

/* True when no partial frame is pending (the stream ended on a frame boundary). */
bool duet_frame_decoder_idle(const duet_frame_decoder_t *d);

#endif
