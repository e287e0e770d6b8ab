/*
 * The UCX runtime of transfer/: moves MLA KV pages and KDA state from a context worker's pools
 * straight into pages a generation worker reserved (docs/architecture.md). It knows pools, pages
 * and byte ranges (transfer/plan.h), never models.
 *
 * One duet_xfer_ctx_t per process: one UCX context (RMA + AM + WAKEUP) and one worker, driven by
 * its owner's loop through duet_xfer_ctx_fd() / duet_xfer_ctx_progress() (a libuv poll handle
 * later; duet_xfer_ctx_wait() in tests and tools). Everything runs on the thread that calls
 * progress: the runtime is single-threaded like the worker (UCS_THREAD_MODE_SINGLE).
 *
 * Receiver (generation side):
 *   duet_xfer_recv_reserve() takes the request's destination pages and KDA slot (and, for a
 *   running request moved from another generation worker, how many replay rows come: n_replay),
 *   which the owner
 *   already took from its pools) and a deadline, and produces the Reservation (worker address,
 *   rkeys, pool bases, layout, pages, deadline) that travels to the sender through the router.
 *   The transfer is then RESERVED -> RECEIVING (the sender said hello; a later hello from another
 *   sender replaces it: a prefill retried elsewhere rewrites every byte) -> DONE | ABORTED, and the
 *   owner's callback is told exactly one outcome: DONE once the sender's completion message came
 *   (byte count checked, checksum verified when sent), or ABORTED with a reason: the sender's
 *   abort message, the deadline, a bad completion, the owner's cancel, or shutdown. A sender that
 *   dies is noticed by the deadline: the receiver keeps no endpoint of its own to the sender
 *   (opening one while a CP group's puts arrive crashed UCX 1.13 on shm), it opens one only to
 *   send an abort back. On ABORTED the owner returns the pages at once; the runtime never owns
 *   pages.
 *
 * Sender (context side):
 *   duet_xfer_send_start() takes one decoded Reservation per destination rank (N for a Helix
 *   group of cp x tp ranks: KV pages dealt over the cp shards, each to the tp ranks of its
 *   shard, the KDA heads cut over all N; transfer/plan.h) and the source pages/slot, builds the
 * plan, connects (one cached endpoint per peer worker), and is CONNECTING -> SENDING -> FLUSHING ->
 * DONE | ABORTED. Layer-wise streaming: duet_xfer_send_layer_ready(L) puts MLA layer L at once
 * (ucp_put_nbx, zero copy from the registered pool), duet_xfer_send_kda_ready() puts the KDA state
 * and conv windows (and the replay rows of a moved running request, src.n_replay > 0); when every
 *   layer is out the endpoints are flushed and one XferDone active message goes to each rank
 *   (bytes, optional XXH3-64 of the rank's bytes in plan order, computed on the source bytes).
 *   A dead or failing receiver ends the transfer through the endpoint's UCX error handler
 *   (UCP_ERR_HANDLING_MODE_PEER; over tcp within milliseconds), a failed put or flush, or the
 *   deadline. The sender's outcome is reported once its abort messages and flushes completed, or
 *   the endpoints were force-closed after abort_grace_ms, so that no UCX operation still reads
 *   its source pages. Exception: shared-memory-only UCX_TLS has no transport that detects a dead
 *   peer, so those endpoints are created without error handling and cannot be force-closed; a
 *   transfer stuck on one is reported after a second abort_grace_ms (its slot is reused only when
 *   UCX lets go of it).
 *
 * Wire (docs/architecture.md, "The wire"): data are RMA puts; control messages are UCX active
 * messages whose body is a packed duet.Envelope (XferDone / XferAbort). One control message is not
 * in duet.proto: the sender's hello, which carries the sender's worker address so that the receiver
 * can send an abort back later. It is a fixed 16-byte AM header plus the raw address, see
 * xfer_impl.h.
 *
 * Bounded: transfers live in a fixed table (opts.max_transfers; DUET_ERR_BUSY when full), peers
 * in a fixed cache (opts.max_peers), control messages in a fixed buffer pool; every state has a
 * deadline, so no path waits forever.
 *
 * Known limit: when a receiver aborts on its own (deadline, cancel) its owner reclaims the pages
 * at once, while a sender that has not yet seen the abort may still have puts in flight into them.
 * Closing that window needs per-reservation registration or an acknowledged abort; not done here.
 */
#ifndef DUET_TRANSFER_XFER_H
#define DUET_TRANSFER_XFER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/metrics.h"
#include "common/status.h"
#include "transfer/plan.h"
#include "transfer/reservation.h"

typedef struct duet_xfer_ctx duet_xfer_ctx_t;

/* A transfer's id: on the receiver the Reservation's transfer_id, on the sender a local handle. */
typedef uint64_t duet_xfer_id_t;

/*
 * Where a pool lives. CUDA device memory (cudaMalloc'ed by its owner, then registered) needs a
 * UCX with CUDA transports (cuda_copy, cuda_ipc) enabled: duet_xfer_ctx_mem_supported() says
 * whether this process's UCX has them, and registering device memory without them is refused
 * with DUET_ERR_UNSUPPORTED. Such a context runs UCX's new protocol layer (UCX_PROTO_ENABLE=y
 * unless set otherwise; 1.13's default protocols crash putting into device memory), and device
 * memory stays off when UCX_TLS allows tcp (1.13's new protocols crash sending active messages
 * over it: measured, see xfer_ctx.c), e.g. UCX_TLS=sm,self,cuda_copy,cuda_ipc on one node. Debian's
 * UCX has none, so the workers stage device pools through registered host pools
 * (engine/backend_cuda.c: mirror_in / mirror_out). A transfer whose sender or receiver has a device
 * pool carries no verified checksum: the CPU cannot read those bytes (the sender sends none; a
 * receiver with device pools reports has_checksum = false).
 */
typedef enum {
    DUET_XFER_MEM_HOST = 0,
    DUET_XFER_MEM_CUDA = 1,
} duet_xfer_mem_kind_t;

/* The registered pools; the values match duet_xfer_seg_kind_t so plan entries index them. The
 * replay pool (speculative decoding's KDA replay rows) is registered only by a process whose
 * model has one: it is sent only when a running request moves between generation workers. */
typedef enum {
    DUET_XFER_POOL_KV = 0,
    DUET_XFER_POOL_KDA = 1,
    DUET_XFER_POOL_REPLAY = 2,
    DUET_XFER_N_POOLS = 3,
} duet_xfer_pool_t;

typedef enum {
    DUET_XFER_ROLE_SEND = 0,
    DUET_XFER_ROLE_RECV = 1,
} duet_xfer_role_t;

typedef enum {
    DUET_XFER_OUTCOME_DONE = 0,
    DUET_XFER_OUTCOME_ABORTED = 1,
} duet_xfer_outcome_kind_t;

#define DUET_XFER_REASON_MAP(X)                                                                    \
    X(DUET_XFER_REASON_NONE, "none")                                                               \
    X(DUET_XFER_REASON_CANCELLED, "cancelled")       /* the owner cancelled */                     \
    X(DUET_XFER_REASON_DEADLINE, "deadline")         /* the deadline passed */                     \
    X(DUET_XFER_REASON_PEER_FAILED, "peer_failed")   /* the endpoint to the peer failed */         \
    X(DUET_XFER_REASON_PEER_ABORTED, "peer_aborted") /* the peer sent XferAbort */                 \
    X(DUET_XFER_REASON_REFUSED, "refused")           /* bad completion message / byte count */     \
    X(DUET_XFER_REASON_CHECKSUM, "checksum")         /* checksum mismatch */                       \
    X(DUET_XFER_REASON_TRANSPORT, "transport")       /* a local UCX operation failed */            \
    X(DUET_XFER_REASON_SHUTDOWN, "shutdown")         /* the context is being destroyed */

typedef enum {
#define DUET__XFER_REASON_ENUM(name, str) name,
    DUET_XFER_REASON_MAP(DUET__XFER_REASON_ENUM)
#undef DUET__XFER_REASON_ENUM
        DUET_XFER_N_REASONS
} duet_xfer_reason_t;

/* "deadline" for DUET_XFER_REASON_DEADLINE (also the metric label value). */
const char *duet_xfer_reason_str(duet_xfer_reason_t r);

/* What a transfer ended with; passed to the owner's callback, valid during the call only. */
typedef struct {
    duet_xfer_id_t id;
    uint64_t req_id;
    duet_xfer_role_t role;
    duet_xfer_outcome_kind_t kind;
    duet_xfer_reason_t reason; /* NONE when DONE */
    const char *message;       /* human-readable detail ("" when DONE) */
    uint64_t bytes;            /* bytes moved (sender: all ranks; receiver: its own) */
    bool has_checksum;         /* receiver: the sender sent one and it matched */
    uint64_t checksum;
    double seconds; /* from reserve / start to the outcome */
} duet_xfer_outcome_t;

/*
 * Called once per transfer, from duet_xfer_ctx_progress() (or from the cancel / destroy call
 * that ended it). The transfer is already gone from the table, so the callback may start,
 * reserve or cancel other transfers; it must not destroy the context.
 */
typedef void (*duet_xfer_outcome_cb_t)(const duet_xfer_outcome_t *o, void *user);

typedef struct {
    uint32_t max_transfers;  /* table capacity, both roles together (default 256) */
    uint32_t max_peers;      /* cached endpoints (default 64) */
    uint32_t max_pages;      /* pages per reservation (default 4096) */
    uint32_t abort_grace_ms; /* sender: how long an abort may wait for its flush (1000) */
    bool recv_no_abort_back; /* receiver: never send XferAbort back to a sender (on
                             cancel, deadline, shutdown; default false = send). A
                             generation worker sets it: the router cancels the sender
                             itself, and with UCX 1.13 over tcp, connecting back to a
                             sender that was just killed can trip an assertion inside
                             UCX's wireup and take the receiver down. */
    duet_metrics_t *metrics; /* registry for duet_xfer_*; not owned; NULL = none */
} duet_xfer_ctx_opts_t;

/* Defaults for every field (metrics NULL). */
void duet_xfer_ctx_opts_default(duet_xfer_ctx_opts_t *opts);

/*
 * Create the UCX context and worker (transports from the UCX_* environment, e.g. UCX_TLS and
 * UCX_NET_DEVICES) and register the duet_xfer_* metrics in opts->metrics. DUET_ERR_TRANSPORT
 * when UCX cannot start, DUET_ERR_INVALID for bad options or metrics already registered.
 */
duet_status_t duet_xfer_ctx_create(const duet_xfer_ctx_opts_t *opts, duet_xfer_ctx_t **ctx_p);

/*
 * Abort every live transfer (reason SHUTDOWN, callbacks run), tell peers, close endpoints
 * (bounded wait), unregister pools, free everything. Accepts NULL.
 */
void duet_xfer_ctx_destroy(duet_xfer_ctx_t *ctx);

/*
 * Register pool `pool` (ucp_mem_map of the existing buffer base[0..bytes), host or CUDA device
 * memory as `kind` says) and pack its rkey. Once per pool; DUET_ERR_INVALID when already
 * registered, DUET_ERR_UNSUPPORTED for device memory when this UCX cannot move it. The buffer
 * must outlive the context.
 */
duet_status_t duet_xfer_ctx_register(duet_xfer_ctx_t *ctx, duet_xfer_pool_t pool, void *base,
                                     size_t bytes, duet_xfer_mem_kind_t kind);

/*
 * Allocate pool `pool` through UCX (ucp_mem_map with UCP_MEM_MAP_ALLOCATE: a shared-memory
 * segment when posix/sysv are enabled) and register it; *base_p = its address, zero-filled,
 * owned by the context until destroy. Use this for pools that *receive*: with UCX 1.13, RMA into
 * an ordinary malloc'ed buffer over shared memory falls back to a software emulation over active
 * messages (~0.1-2 GB/s), while puts into a UCX-allocated segment are plain copies into the
 * mapped segment (see bench/RESULTS.md). Host pools only (device pools: DUET_ERR_UNSUPPORTED);
 * otherwise the same errors as duet_xfer_ctx_register.
 */
duet_status_t duet_xfer_ctx_alloc(duet_xfer_ctx_t *ctx, duet_xfer_pool_t pool, size_t bytes,
                                  duet_xfer_mem_kind_t kind, void **base_p);

/* Whether this process's UCX can register and move memory of `kind` (host: always; CUDA: only
 * with CUDA transports built in and enabled). */
bool duet_xfer_ctx_mem_supported(const duet_xfer_ctx_t *ctx, duet_xfer_mem_kind_t kind);

/* The worker's event fd: readable when progress may have work (after duet_xfer_ctx_arm). */
int duet_xfer_ctx_fd(const duet_xfer_ctx_t *ctx);

/*
 * Progress UCX, advance every transfer's state machine, enforce deadlines, and run outcome
 * callbacks. Returns the number of events handled (0 = nothing happened).
 */
int duet_xfer_ctx_progress(duet_xfer_ctx_t *ctx);

/*
 * Arm the event fd before sleeping on it. DUET_OK: safe to sleep until the fd is readable or
 * duet_xfer_ctx_timeout_ms() passes; DUET_ERR_BUSY: call progress again first.
 */
duet_status_t duet_xfer_ctx_arm(duet_xfer_ctx_t *ctx);

/* Milliseconds until the next deadline or internal timer (-1 = none): the loop's timer. */
int duet_xfer_ctx_timeout_ms(const duet_xfer_ctx_t *ctx);

/*
 * Progress, then, if nothing happened, sleep on the event fd for at most timeout_ms (and at most
 * until the next deadline). Returns progress's event count. For tests, tools and benchmarks.
 */
int duet_xfer_ctx_wait(duet_xfer_ctx_t *ctx, int timeout_ms);

/* Live transfers of a role (for tests and gauges). */
uint32_t duet_xfer_ctx_active(const duet_xfer_ctx_t *ctx, duet_xfer_role_t role);

/* --- receiver ---------------------------------------------------------------------------- */

typedef struct {
    uint64_t req_id;
    duet_xfer_layout_t layout; /* this rank's pool layout */
    const int32_t *pages;      /* reserved local pages, sequence order; copied */
    uint32_t n_pages;
    int32_t kda_slot;          /* -1 when no KDA state is expected */
    uint64_t n_tokens;         /* tokens of KV the whole group receives */
    uint32_t n_replay;         /* replay rows expected with the KDA state (a moved running
                                  request; transfer/plan.h): 0 = none. Needs kda_slot >= 0, the
                                  replay pool registered, layout.replay_rows >= n_replay and
                                  group_size 1; they count in XferDone's byte check */
    uint32_t rank;             /* this rank in the destination group */
    uint32_t group_size;       /* 1 = no Helix group */
    uint32_t kv_ranks;         /* KV shards the group's pages are dealt over (its cp; this rank
                                  holds shard duet_xfer_kv_shard_of(rank, group_size, kv_ranks),
                                  transfer/plan.h); 0 = group_size. Must divide group_size */
    uint64_t deadline_unix_ms; /* wall clock (the peer is another host) */
    duet_xfer_outcome_cb_t cb;
    void *user;
} duet_xfer_recv_args_t;

/*
 * Reserve: check the pages and slot against the registered pools and the layout, take a table
 * entry, and fill *res_p with the Reservation to send (encode it with
 * duet_xfer_reservation_encode, or embed it with duet_xfer_reservation_to_proto). Its spans point
 * into the context (worker address, rkeys, a copy of the pages) and stay valid until the outcome
 * callback runs. res_p->transfer_id is the transfer's id. DUET_ERR_BUSY when the table is full,
 * DUET_ERR_INVALID / DUET_ERR_RANGE for bad arguments (pages outside the KV pool, more than
 * max_pages, a layout not matching the registered pools), DUET_ERR_TIMEOUT for a deadline in the
 * past. On error nothing is reserved and no callback will run.
 */
duet_status_t duet_xfer_recv_reserve(duet_xfer_ctx_t *ctx, const duet_xfer_recv_args_t *args,
                                     duet_xfer_reservation_t *res_p);

/*
 * The owner gives up (client gone, drain): the sender is told (XferAbort) when it has said
 * hello, and the callback runs before this returns with ABORTED(CANCELLED, message).
 * DUET_ERR_NOT_FOUND when the transfer already ended.
 */
duet_status_t duet_xfer_recv_cancel(duet_xfer_ctx_t *ctx, duet_xfer_id_t id, const char *message);

/* --- sender ------------------------------------------------------------------------------ */

typedef struct {
    uint64_t req_id;
    const duet_xfer_reservation_t *reservations; /* [n_ranks], rank r at [r]; decoded; all
                                                    with one group_size and kv_ranks */
    uint32_t n_ranks;                            /* destination group size */
    duet_xfer_layout_t layout;                   /* the source pools' layout */
    duet_xfer_src_t src;       /* source pages / slot / n_tokens / n_replay; pages copied */
    uint64_t deadline_unix_ms; /* 0 = the reservations' (earliest) deadline */
    bool checksum;             /* send XXH3-64 of each rank's bytes (host pools) */
    duet_xfer_outcome_cb_t cb;
    void *user;
} duet_xfer_send_args_t;

/*
 * Start sending: check every reservation again (duet_xfer_reservation_validate with the current
 * clock: it may have been filled by hand or waited in a queue) and against each other and the
 * source (rank r at [r], one group size and kv_ranks, one transfer per rank, n_tokens and
 * n_replay equal to src's, the plan's byte ranges inside each rank's advertised pools and inside
 * our registered pools), build the plan, connect (the rkeys must unpack). Nothing is put until
 * layers are ready. *id_p = the sender-side handle. Refusals, each with a detail in
 * duet_error_last(): DUET_ERR_UNSUPPORTED (version), DUET_ERR_FORMAT (a required field missing, an
 * rkey or worker address UCX cannot use), DUET_ERR_INVALID (inconsistent group or layouts),
 * DUET_ERR_RANGE (oversized: pages past max_pages, bytes outside a pool), DUET_ERR_TIMEOUT (stale:
 * deadline passed), DUET_ERR_BUSY (table or peer cache full). On error no callback will run.
 */
duet_status_t duet_xfer_send_start(duet_xfer_ctx_t *ctx, const duet_xfer_send_args_t *args,
                                   duet_xfer_id_t *id_p);

/*
 * MLA layer `layer` of the source pages is final: put it now (or as soon as connected).
 * Idempotent. DUET_ERR_NOT_FOUND when the transfer already ended (e.g. aborted by the peer: the
 * outcome callback has run or will run), DUET_ERR_RANGE for a layer past the layout.
 */
duet_status_t duet_xfer_send_layer_ready(duet_xfer_ctx_t *ctx, duet_xfer_id_t id, uint32_t layer);

/*
 * Whether the transfer still waits for the handshakes of its endpoints (nothing said or put
 * yet). False once every endpoint is up, and for a transfer that ended or is unknown. A sender
 * that is about to stop progressing UCX for a while (a long prefill step) waits for this to turn
 * false first: a handshake stretched over that time leaves the peer's reply pending on a
 * connection to us, and if we die then, UCX 1.13.1 asserts in the peer while purging it (fixed
 * upstream after 1.13).
 */
bool duet_xfer_send_connecting(duet_xfer_ctx_t *ctx, duet_xfer_id_t id);

/* The KDA state and conv windows (and replay rows, src.n_replay) are final: put them (no-op
 * when the request has none). */
duet_status_t duet_xfer_send_kda_ready(duet_xfer_ctx_t *ctx, duet_xfer_id_t id);

/*
 * Abort from the sender's side: tell every rank (XferAbort), flush, then run the callback with
 * ABORTED(CANCELLED) from progress. DUET_ERR_NOT_FOUND when the transfer already ended.
 */
duet_status_t duet_xfer_send_cancel(duet_xfer_ctx_t *ctx, duet_xfer_id_t id, const char *message);

#endif
