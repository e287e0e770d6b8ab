/*
 * Internals of the UCX transfer runtime (xfer.h): the shared structures, and what xfer_core.c
 * gives the context (xfer_ctx.c: UCX, pools, active-message handlers, the progress sweep) and the
 * two state machines (xfer_recv.c, xfer_send.c) alike.
 *
 * Dependencies run one way: the context drives the state machines through xfer_recv_impl.h and
 * xfer_send_impl.h (only xfer_ctx.c includes those besides their own .c); the state machines call
 * only xfer_core.c, never the context nor each other; xfer_core.c calls none of the three.
 *
 * Threading: one thread. UCX callbacks (completions, active messages, endpoint errors) only record
 * facts in the objects they reach and set ctx->dirty; duet_xfer_ctx_progress() then sweeps the
 * table and advances each transfer's state machine, so owner callbacks never run inside UCX.
 *
 * Lifetimes: a transfer slot is reused only when nothing UCX holds points at it (pending == 0).
 * Control messages (hello, done, abort) are sent from a fixed pool of buffers (duet__xfer_msg_t)
 * that their completion returns, because ucp_am_send_nbx in UCX 1.13 needs the header and data
 * valid until completion.
 *
 * Active-message header (16 bytes, little-endian): u32 magic 'DXF1', u16 kind, u16 zero,
 * u64 transfer id (the receiver's id). Kind HELLO carries the sender's worker address as data;
 * kind ENVELOPE carries a packed duet.Envelope (XferDone or XferAbort) as data.
 */
#ifndef DUET_TRANSFER_XFER_IMPL_H
#define DUET_TRANSFER_XFER_IMPL_H

#include <stdbool.h>
#include <stdint.h>

#include <ucp/api/ucp.h>
#include <xxhash.h>

#include "transfer/xfer.h"

#define DUET__XFER_AM_TO_RECV   0x0d1u      /* hello, done, abort for a receiver's transfer */
#define DUET__XFER_AM_TO_SEND   0x0d2u      /* abort for a sender's transfer */
#define DUET__XFER_AM_MAGIC     0x31465844u /* "DXF1" */
#define DUET__XFER_AM_HDR_BYTES 16u
#define DUET__XFER_AM_HELLO     1u
#define DUET__XFER_AM_ENVELOPE  2u
#define DUET__XFER_MSG_BYTES    384u  /* packed Envelope of a done or abort (message capped) */
#define DUET__XFER_MSG_TEXT     160u  /* bytes of an abort message we keep / send */
#define DUET__XFER_MAX_GROUPS   1024u /* MLA + KDA layers of one layout */
#define DUET__XFER_ADDR_MAX     4096u /* worker address bytes a hello may carry */
#define DUET__XFER_RKEY_CACHE   4u    /* unpacked rkeys kept per peer */
#define DUET__XFER_RKEY_BYTES   512u  /* packed rkeys longer than this are not cached */

typedef struct duet__xfer duet__xfer_t;

typedef enum {
    DUET__PEER_FREE = 0,
    DUET__PEER_CONNECTING, /* ep created, first flush in flight (docs/platform.md) */
    DUET__PEER_READY,
    DUET__PEER_FAILED,  /* error callback ran; force-close pending in the sweep */
    DUET__PEER_CLOSING, /* ucp_ep_close_nbx in flight */
} duet__peer_state_t;

/* One cached endpoint to a remote worker. */
typedef struct {
    duet__peer_state_t state;
    ucp_ep_h ep;
    void *req;          /* connect flush or close request in flight; UCX-owned */
    ucs_status_t err;   /* why it failed */
    uint32_t refs;      /* transfers using it */
    bool no_err;        /* created with UCP_ERR_HANDLING_MODE_NONE (see peer_get) */
    uint64_t last_used; /* sweep counter, for eviction */
    size_t addr_len;
    uint8_t *addr; /* owned, [DUET__XFER_ADDR_MAX]: the remote worker address */
    /* Unpacked remote keys of this peer's pools, kept while the endpoint lives: unpacking maps
     * the remote shared-memory segment, and mapping it afresh per transfer (then faulting its
     * pages in again) cost ~2 ms per MiB in the benchmark. */
    struct {
        size_t len;
        uint8_t key[DUET__XFER_RKEY_BYTES];
        ucp_rkey_h h;
    } rk[DUET__XFER_RKEY_CACHE];
    uint32_t n_rk;
    struct duet_xfer_ctx *ctx;
} duet__peer_t;

/* A control-message buffer; owned by ctx->msgs, lent to one ucp_am_send_nbx. */
typedef struct {
    bool used;
    duet__xfer_t *x; /* transfer to tell on completion, or NULL */
    void *req;       /* UCX request while in flight (released at destroy if stuck) */
    uint8_t hdr[DUET__XFER_AM_HDR_BYTES];
    uint8_t body[DUET__XFER_MSG_BYTES];
    struct duet_xfer_ctx *ctx;
} duet__msg_t;

typedef enum {
    DUET__X_FREE = 0,
    /* receiver */
    DUET__X_RESERVED,  /* waiting for the sender's hello */
    DUET__X_RECEIVING, /* hello seen; waiting for done / abort / deadline / peer failure */
    /* sender */
    DUET__X_CONNECTING, /* endpoints to every rank being flushed */
    DUET__X_SENDING,    /* hellos sent; puts issued as layers become ready */
    DUET__X_FLUSHING,   /* every put issued; ep flushes, then done messages, in flight */
    DUET__X_ABORTING,   /* abort messages + flushes in flight before the outcome */
} duet__xstate_t;

/* Per destination rank of a sender's transfer. */
typedef struct {
    int32_t peer;                          /* index in ctx->peers */
    uint64_t xfer_id;                      /* the receiver's transfer id */
    ucp_rkey_h rkey[DUET_XFER_N_POOLS];    /* unpacked for peer's ep; NULL when absent */
    bool rkey_own[DUET_XFER_N_POOLS];      /* not in the peer's cache: destroy at the end */
    const uint8_t *key[DUET_XFER_N_POOLS]; /* packed rkey (in the transfer's keys) until it is
                                              unpacked once the endpoint is up; NULL when none */
    uint32_t key_len[DUET_XFER_N_POOLS];
    uint64_t base[DUET_XFER_N_POOLS]; /* remote pool bases */
    uint64_t checksum;
    void *flush_req[2]; /* flushes in flight on this rank's endpoint (completion, abort);
                           released at destroy if stuck */
} duet__rank_t;

struct duet__xfer {
    uint32_t idx;
    uint16_t gen;
    duet__xstate_t state;
    duet_xfer_role_t role;
    duet_xfer_id_t id;
    uint64_t req_id;
    duet_xfer_outcome_cb_t cb;
    void *user;
    uint64_t t0_ns;       /* reserve / start time (monotonic) */
    uint64_t deadline_ns; /* monotonic */
    uint32_t pending;     /* UCX requests and messages pointing at this slot */
    ucs_status_t op_err;  /* first failure of those */
    duet_xfer_reason_t reason;
    char msg[DUET__XFER_MSG_TEXT];
    int32_t *pages; /* owned, [ctx->max_pages]: receiver's pages */
    uint8_t *keys;  /* owned, sender: the ranks' packed rkeys, copied at the start */
    uint32_t n_pages;
    uint64_t bytes;

    /* receiver */
    duet_xfer_layout_t layout;
    int32_t kda_slot;
    uint64_t n_tokens;
    uint32_t n_replay;
    uint32_t rank, group_size, kv_ranks; /* kv_ranks resolved (never 0) */
    uint64_t deadline_unix_ms;
    uint64_t expect_bytes;
    bool hello_pending; /* hello arrived; address in hello_addr (hello_len > 0) */
    size_t hello_len;
    uint8_t *hello_addr; /* owned, [DUET__XFER_ADDR_MAX] */
    bool done_pending;   /* XferDone arrived; fields below */
    uint64_t done_bytes, done_checksum;
    bool done_has_checksum;
    bool abort_pending; /* XferAbort arrived; reason/msg set */

    /* sender */
    uint32_t n_ranks;
    duet__rank_t *ranks;   /* owned, [DUET_XFER_MAX_RANKS] */
    duet_xfer_plan_t plan; /* buffers reused across transfers */
    uint32_t n_groups;     /* plan groups that carry data: MLA layers (+ KDA layers) */
    uint32_t n_mla;        /* MLA layer groups */
    uint32_t n_issued;
    uint64_t ready[DUET__XFER_MAX_GROUPS / 64];
    uint64_t issued[DUET__XFER_MAX_GROUPS / 64];
    bool checksum;
    uint32_t flush_left, done_left;
    bool done_sent;
    uint64_t abort_deadline_ns;
    uint32_t abort_stage; /* 0: waiting; 1: endpoints failed, waiting once more */
};

struct duet_xfer_ctx {
    ucp_context_h ucp;
    ucp_worker_h worker;
    int efd;
    ucp_address_t *addr; /* owned by UCX: ucp_worker_release_address */
    size_t addr_len;

    struct {
        void *base;
        size_t bytes;
        ucp_mem_h memh;
        void *rkey; /* packed; ucp_rkey_buffer_release */
        size_t rkey_len;
        duet_xfer_mem_kind_t kind;
    } pools[DUET_XFER_N_POOLS];
    uint64_t mem_types; /* UCS_BIT(ucs_memory_type_t) for each type this UCX can move */

    uint32_t cap, max_peers, max_pages, n_msgs;
    uint32_t abort_grace_ms;
    bool recv_no_abort_back;
    duet__xfer_t *xs; /* owned, [cap] */
    uint32_t n_active[2];
    duet__peer_t *peers; /* owned, [max_peers] */
    duet__msg_t *msgs;   /* owned, [n_msgs] */
    uint32_t msg_hint;
    uint32_t nonce; /* high 32 bits of ids, random per context */
    uint64_t sweeps;
    bool dirty; /* something changed inside a UCX callback */
    bool destroying;
    bool no_peer_err;  /* UCX_TLS has no transport that detects a dead peer: every endpoint
                          without error handling (duet__xfer_peer_get) */
    XXH3_state_t *xxh; /* owned, checksum scratch */

    struct {
        duet_metric_t *bytes[2];                    /* {role} */
        duet_metric_t *transfers[2][2];             /* {role, outcome} */
        duet_metric_t *aborts[DUET_XFER_N_REASONS]; /* {reason} */
        duet_metric_t *seconds[2];                  /* {role} */
    } m;
};

/* Bump allocator for unpacking one control message without malloc (lives on the stack). */
typedef struct {
    uint8_t buf[4096];
    size_t used;
} duet__arena_t;

/* --- xfer_core.c: what the context and both state machines use ---------------------------- */

uint64_t duet__xfer_now_ns(void);
const char *duet__xfer_role_str(duet_xfer_role_t role); /* "send", "recv" */
const char *duet__xfer_state_str(duet__xstate_t s);
void duet__xfer_set_state(duet__xfer_t *x, duet__xstate_t s);
void duet__xfer_set_reason(duet__xfer_t *x, duet_xfer_reason_t reason, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
int duet__xfer_reason_to_proto(duet_xfer_reason_t r);
const char *duet__xfer_proto_reason_str(int r);
/* Every registered pool is host memory (checksums read pool bytes on the CPU). */
bool duet__xfer_pools_on_host(const duet_xfer_ctx_t *ctx);

/* Little-endian header helpers. */
void duet__xfer_hdr_write(uint8_t *hdr, uint16_t kind, uint64_t x_id);
bool duet__xfer_hdr_read(const uint8_t *hdr, size_t len, uint16_t *kind_p, uint64_t *x_id_p);
/* Unpack a control Envelope into `arena`; NULL when the bytes are not one. */
Duet__Envelope *duet__xfer_env_unpack(duet__arena_t *arena, const void *data, size_t len);

/* The transfer table. */
duet__xfer_t *duet__xfer_slot_take(duet_xfer_ctx_t *ctx, duet_xfer_role_t role);
void duet__xfer_slot_release(duet_xfer_ctx_t *ctx, duet__xfer_t *x);
duet__xfer_t *duet__xfer_find(duet_xfer_ctx_t *ctx, duet_xfer_role_t role, duet_xfer_id_t id);
duet__xfer_t *duet__xfer_find_rank_id(duet_xfer_ctx_t *ctx, uint64_t rank_xfer_id);
/* A sender's ranks let go: their own rkeys destroyed, their peers released; n_ranks = 0. */
void duet__xfer_drop_ranks(duet_xfer_ctx_t *ctx, duet__xfer_t *x);
/* Report the outcome (metrics, log, callback) and free the slot. */
void duet__xfer_finish(duet_xfer_ctx_t *ctx, duet__xfer_t *x, duet_xfer_outcome_kind_t kind);

/* The endpoint cache. Find or create the peer for a worker address; takes a reference.
 * DUET_ERR_BUSY when full. */
duet_status_t duet__xfer_peer_get(duet_xfer_ctx_t *ctx, const uint8_t *addr, size_t len,
                                  int32_t *peer_p);
void duet__xfer_peer_put(duet_xfer_ctx_t *ctx, int32_t peer);
/* The unpacked rkey for packed bytes key[0..len) on this peer (cached when small enough;
 * *own_p = true when the caller must destroy it). */
ucs_status_t duet__xfer_peer_rkey(duet_xfer_ctx_t *ctx, int32_t peer, const uint8_t *key,
                                  size_t len, ucp_rkey_h *rkey_p, bool *own_p);
/* Close p's endpoint (force for a failed peer, flush for a healthy idle one). */
void duet__xfer_peer_close(duet_xfer_ctx_t *ctx, duet__peer_t *p, bool force);

/* Send a control message to a peer: hello (x_id, data = our address) or an Envelope. */
duet_status_t duet__xfer_send_hello(duet_xfer_ctx_t *ctx, int32_t peer, uint64_t x_id);
duet_status_t duet__xfer_send_done(duet_xfer_ctx_t *ctx, duet__xfer_t *x, int32_t peer,
                                   uint64_t x_id, uint64_t bytes, bool has_checksum,
                                   uint64_t checksum);
duet_status_t duet__xfer_send_abort(duet_xfer_ctx_t *ctx, duet__xfer_t *x, int32_t peer,
                                    unsigned am_id, uint64_t x_id, duet_xfer_reason_t reason,
                                    const char *message);
/* Refuse a hello for an unknown transfer from inside the AM callback, on its reply endpoint. */
duet_status_t duet__xfer_reply_abort(duet_xfer_ctx_t *ctx, ucp_ep_h reply_ep, uint64_t x_id,
                                     const char *message);

/* --- xfer_ctx.c (exposed for tests) ------------------------------------------------------- */

/* Whether a UCX_TLS value lets UCX use tcp (see xfer_ctx.c: device memory stays off then). */
bool duet__tls_may_use_tcp(const char *tls);
/* Whether a UCX_TLS value may give UCX a transport that detects a dead peer (tcp, InfiniBand). */
bool duet__tls_may_detect_peer_failure(const char *tls);

#endif
