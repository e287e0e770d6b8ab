/*
 * Reservations: what one destination rank reserved for one request, as it crosses processes
 * (the `Reservation` message of proto/duet.proto; docs/architecture.md, "The path of one request").
 *
 * The generation worker fills a duet_xfer_reservation_t from its pools and encodes it; the
 * router carries the bytes; the context worker decodes them and builds a transfer plan against
 * them. Those bytes come from another process, so decoding validates every field before anything
 * uses it: sizes are capped before protobuf-c allocates, the page list must fit the advertised
 * registered region, the KDA slot must fit the KDA region (and, when replay rows are sent, the
 * replay region), products must not overflow, and a
 * reservation whose deadline has passed is refused as stale. Each refusal names the field.
 *
 * Byte spans and the page list of a decoded reservation point into the unpacked protobuf message
 * that the struct holds (no copies); duet_xfer_reservation_free() releases it. A reservation
 * filled by hand for encoding points at the caller's memory and owns nothing.
 */
#ifndef DUET_TRANSFER_RESERVATION_H
#define DUET_TRANSFER_RESERVATION_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "proto/duet.pb-c.h"
#include "transfer/plan.h"

#define DUET_XFER_RESERVATION_VERSION   1u
#define DUET_XFER_RESERVATION_MAX_BYTES (8u << 20)  /* packed size accepted by decode */
#define DUET_XFER_RESERVATION_MAX_PAGES (1u << 20)  /* pages of one rank for one request */
#define DUET_XFER_WORKER_ADDRESS_MAX    (64u << 10) /* packed UCX worker address */
#define DUET_XFER_RKEY_MAX              (4u << 10)  /* packed UCX rkey */

/* A span of bytes; not owned. */
typedef struct {
    const uint8_t *data;
    size_t len;
} duet_xfer_bytes_t;

typedef struct {
    uint32_t version; /* DUET_XFER_RESERVATION_VERSION */
    uint64_t transfer_id;
    uint64_t request_id;
    uint32_t rank;       /* this rank in the destination group */
    uint32_t group_size; /* ranks in the group, [1, DUET_XFER_MAX_RANKS] */
    uint32_t kv_ranks;   /* KV shards the pages are dealt over (a Helix group's cp; this rank holds
                            shard duet_xfer_kv_shard_of(rank, ..), transfer/plan.h): in
                            [1, group_size] and dividing it; 0 = group_size (decode writes
                            group_size) */
    duet_xfer_bytes_t worker_address; /* receiver's packed UCX worker address, non-empty */
    duet_xfer_bytes_t kv_rkey;        /* packed rkey of the KV pool (non-empty with pages) */
    uint64_t kv_base;                 /* remote address of the KV pool */
    uint64_t kv_bytes;                /* bytes registered at kv_base */
    duet_xfer_bytes_t kda_rkey;       /* packed rkey of the KDA pool (non-empty with a slot) */
    uint64_t kda_base;
    uint64_t kda_bytes;
    duet_xfer_layout_t layout; /* this rank's pool layout */
    const int32_t *pages;      /* [n_pages] local page ids, sequence order; not owned */
    uint32_t n_pages;
    int32_t kda_slot;          /* -1 when no KDA state is sent */
    uint64_t n_tokens;         /* tokens of KV the whole group receives */
    uint64_t deadline_unix_ms; /* wall clock (CLOCK_REALTIME) ms; 0 is refused */
    /* A moved running request's replay rows (transfer/plan.h; all 0 / empty when none are sent:
     * a context worker's transfer, or a peer that predates them) */
    duet_xfer_bytes_t replay_rkey; /* packed rkey of the replay pool (non-empty with n_replay) */
    uint64_t replay_base;
    uint64_t replay_bytes;
    uint32_t n_replay;      /* rows [0, n_replay) of each KDA layer of kda_slot; <=
                               layout.replay_rows and n_tokens; needs a kda_slot */
    Duet__Reservation *msg; /* owned after decode: backs the spans; NULL otherwise */
} duet_xfer_reservation_t;

/* Wall-clock milliseconds since the Unix epoch (the clock deadlines are written in). */
uint64_t duet_xfer_now_unix_ms(void);

/*
 * Check every field of r (the checks decode applies; see the file comment). now_unix_ms: the
 * current wall clock for the deadline check, or 0 to skip it (encode skips it). Refusals:
 * DUET_ERR_UNSUPPORTED (version), DUET_ERR_FORMAT (a required field missing or empty),
 * DUET_ERR_RANGE (a value outside its bounds or not fitting the advertised region),
 * DUET_ERR_TIMEOUT ("stale reservation": deadline_unix_ms <= now_unix_ms).
 */
duet_status_t duet_xfer_reservation_validate(const duet_xfer_reservation_t *r,
                                             uint64_t now_unix_ms);

/*
 * Point `msg` (and `layout_msg`, which msg->layout is set to) at the fields of r, without
 * copying: both must outlive any use of msg. Use it to embed a reservation in an Envelope.
 */
void duet_xfer_reservation_to_proto(const duet_xfer_reservation_t *r, Duet__Reservation *msg,
                                    Duet__XferLayout *layout_msg);

/*
 * Validate `msg` (an unpacked message, e.g. an Envelope's body) and fill *r_p with spans into it
 * (r_p->msg stays NULL: msg still belongs to the caller and must outlive *r_p).
 * now_unix_ms as for validate (0 skips the deadline check). *r_p is written only on success.
 */
duet_status_t duet_xfer_reservation_from_proto(const Duet__Reservation *msg, uint64_t now_unix_ms,
                                               duet_xfer_reservation_t *r_p);

/* Bytes the packed reservation takes. */
size_t duet_xfer_reservation_packed_size(const duet_xfer_reservation_t *r);

/*
 * Validate r (without the deadline) and pack it into buf[0..cap); *len_p = bytes written.
 * DUET_ERR_NO_SPACE when cap < duet_xfer_reservation_packed_size(r).
 */
duet_status_t duet_xfer_reservation_encode(const duet_xfer_reservation_t *r, uint8_t *buf,
                                           size_t cap, size_t *len_p);

/*
 * Unpack and validate n bytes from another process. DUET_ERR_RANGE when n exceeds
 * DUET_XFER_RESERVATION_MAX_BYTES (checked before unpacking), DUET_ERR_FORMAT when the bytes are
 * not a Reservation, then the refusals of validate. now_unix_ms: the wall clock for the deadline
 * check (0 = read it now with duet_xfer_now_unix_ms()). On success *r_p owns the unpacked message
 * (free with duet_xfer_reservation_free); on failure nothing is allocated and *r_p is untouched.
 */
duet_status_t duet_xfer_reservation_decode(const uint8_t *buf, size_t n, uint64_t now_unix_ms,
                                           duet_xfer_reservation_t *r_p);

/* Release what decode allocated and zero *r. Accepts NULL and hand-filled reservations. */
void duet_xfer_reservation_free(duet_xfer_reservation_t *r);

/*
 * Decode the reservations of one destination group (rank 0's and the others', in any order:
 * Prefill.reservation and Prefill.more_reservations) into out[0..n), ordered by rank (out[r] is
 * rank r's). Each is decoded as by duet_xfer_reservation_decode (now_unix_ms likewise); then the
 * set must be one whole group: n in [1, DUET_XFER_MAX_RANKS], every one with group_size n and
 * the same kv_ranks, request_id and n_tokens, and no rank twice (DUET_ERR_INVALID, naming what
 * differs). On success out[0..n) own their messages (free each with
 * duet_xfer_reservation_free); on failure nothing is allocated and out is zeroed.
 */
duet_status_t duet_xfer_reservation_decode_group(const duet_xfer_bytes_t *bufs, uint32_t n,
                                                 uint64_t now_unix_ms,
                                                 duet_xfer_reservation_t *out);

/* The plan's view of this rank's reservation (pointers into r). */
void duet_xfer_reservation_dest(const duet_xfer_reservation_t *r, duet_xfer_dest_t *dest_p);

#endif
