/*
 * The transfer runtime's context: UCX context + worker, registered pools, the active-message
 * handlers and the progress sweep (see xfer.h and xfer_impl.h); the table, the endpoint cache and
 * control messages are xfer_core.c's; the two state machines are driven through
 * xfer_recv_impl.h and xfer_send_impl.h.
 *
 * Why a sweep: UCX completes operations and delivers active messages inside
 * ucp_worker_progress(); touching owner state from there invites re-entrancy (an owner callback
 * that starts a transfer while UCX is mid-progress). So callbacks only record facts; after
 * ucp_worker_progress returns, the sweep walks the (small, fixed) table and lets each transfer's
 * state machine act on them: deadlines, peer failures, messages. The sweep is O(table) per
 * progress call, which is nothing next to a transfer of pages.
 */
#define _GNU_SOURCE
#include "transfer/xfer_impl.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "common/log.h"
#include "transfer/xfer_recv_impl.h"
#include "transfer/xfer_send_impl.h"

/* --- options, metrics --------------------------------------------------------------------- */

void duet_xfer_ctx_opts_default(duet_xfer_ctx_opts_t *opts)
{
    memset(opts, 0, sizeof(*opts));
    opts->max_transfers = 256;
    opts->max_peers = 64;
    opts->max_pages = 4096;
    opts->abort_grace_ms = 1000;
}

static const char *duet__outcome_label[2] = {"done", "aborted"};

static duet_status_t duet__xfer_metrics_init(duet_xfer_ctx_t *ctx, duet_metrics_t *reg)
{
    duet_metric_family_t *f_bytes, *f_xfers, *f_aborts, *f_secs;
    const char *role[] = {"role"};
    const char *role_outcome[] = {"role", "outcome"};
    const char *reason[] = {"reason"};
    const double buckets[] = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                              0.1,    0.25,    0.5,    1,     2.5,    5,     10,   30};
    duet_status_t st;

    if ((st = duet_metrics_counter_new(reg, "duet_xfer_bytes_total",
                                       "Bytes of cache moved by completed transfers.", role, 1,
                                       &f_bytes)) < 0 ||
        (st = duet_metrics_counter_new(reg, "duet_xfer_transfers_total",
                                       "Transfers ended, by role and outcome.", role_outcome, 2,
                                       &f_xfers)) < 0 ||
        (st = duet_metrics_counter_new(reg, "duet_xfer_aborts_total",
                                       "Aborted transfers by reason.", reason, 1, &f_aborts)) < 0 ||
        (st = duet_metrics_histogram_new(reg, "duet_xfer_transfer_seconds",
                                         "Time from reservation (receiver) or start (sender) to "
                                         "the outcome.",
                                         role, 1, buckets, sizeof(buckets) / sizeof(buckets[0]),
                                         &f_secs)) < 0)
        return st;
    for (int r = 0; r < 2; r++) {
        const char *v[] = {duet__xfer_role_str((duet_xfer_role_t)r)};
        if ((st = duet_metrics_child(f_bytes, v, 1, &ctx->m.bytes[r])) < 0 ||
            (st = duet_metrics_child(f_secs, v, 1, &ctx->m.seconds[r])) < 0)
            return st;
        for (int o = 0; o < 2; o++) {
            const char *vo[] = {duet__xfer_role_str((duet_xfer_role_t)r), duet__outcome_label[o]};
            if ((st = duet_metrics_child(f_xfers, vo, 2, &ctx->m.transfers[r][o])) < 0)
                return st;
        }
    }
    for (int i = 1; i < DUET_XFER_N_REASONS; i++) {
        const char *v[] = {duet_xfer_reason_str((duet_xfer_reason_t)i)};
        if ((st = duet_metrics_child(f_aborts, v, 1, &ctx->m.aborts[i])) < 0)
            return st;
    }
    return DUET_OK;
}

/* --- active messages ---------------------------------------------------------------------- */

static ucs_status_t duet__am_cb(void *arg, const void *header, size_t header_length, void *data,
                                size_t length, const ucp_am_recv_param_t *param)
{
    duet_xfer_ctx_t *ctx = arg;
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
        DUET_LOG_WARN("xfer: dropped a %zu-byte control message sent by rendezvous", length);
        return UCS_OK;
    }
    ucp_ep_h reply = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : NULL;
    duet__xfer_recv_on_am(ctx, header, data, length, reply);
    (void)header_length;
    return UCS_OK;
}

static ucs_status_t duet__am_send_side_cb(void *arg, const void *header, size_t header_length,
                                          void *data, size_t length,
                                          const ucp_am_recv_param_t *param)
{
    duet_xfer_ctx_t *ctx = arg;
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
        DUET_LOG_WARN("xfer: dropped a %zu-byte control message sent by rendezvous", length);
        return UCS_OK;
    }
    if (header_length != DUET__XFER_AM_HDR_BYTES) {
        DUET_LOG_WARN("xfer: control message with a %zu-byte header dropped", header_length);
        return UCS_OK;
    }
    duet__xfer_send_on_am(ctx, header, data, length);
    return UCS_OK;
}

static duet_status_t duet__am_register(duet_xfer_ctx_t *ctx, unsigned id, ucp_am_recv_callback_t cb)
{
    ucp_am_handler_param_t p = {
        .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                      UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS,
        .id = id,
        .cb = cb,
        .arg = ctx,
        .flags = UCP_AM_FLAG_WHOLE_MSG,
    };
    ucs_status_t us = ucp_worker_set_am_recv_handler(ctx->worker, &p);
    if (us != UCS_OK)
        return DUET_FAIL(DUET_ERR_TRANSPORT, "xfer: set AM handler %u: %s", id,
                         ucs_status_string(us));
    return DUET_OK;
}

/* --- context ------------------------------------------------------------------------------ */

/* Whether any name in the comma-separated list (no leading '^') satisfies match(name, length). */
static bool duet__tls_any(const char *list, bool (*match)(const char *name, size_t n))
{
    for (const char *p = list; *p != '\0';) {
        const char *e = strchr(p, ',');
        const size_t n = e != NULL ? (size_t)(e - p) : strlen(p);
        if (match(p, n))
            return true;
        p += n + (e != NULL);
    }
    return false;
}

static bool duet__tls_is_tcp(const char *name, size_t n)
{
    return n == 3 && strncmp(name, "tcp", 3) == 0;
}

static bool duet__tls_is_tcp_or_all(const char *name, size_t n)
{
    return duet__tls_is_tcp(name, n) || (n == 3 && strncmp(name, "all", 3) == 0);
}

/* tcp, all, or an InfiniBand transport (ib, rc*, ud*, dc*) */
static bool duet__tls_detects_peers(const char *name, size_t n)
{
    return duet__tls_is_tcp_or_all(name, n) || (n == 2 && strncmp(name, "ib", 2) == 0) ||
           (n >= 2 && (strncmp(name, "rc", 2) == 0 || strncmp(name, "ud", 2) == 0 ||
                       strncmp(name, "dc", 2) == 0));
}

/* Whether a UCX_TLS value lets UCX use tcp: unset, "all", a list naming tcp, or an exclusion
 * list ("^a,b") that does not name it. */
bool duet__tls_may_use_tcp(const char *tls)
{
    if (tls == NULL || *tls == '\0')
        return true;
    if (*tls == '^')
        return !duet__tls_any(tls + 1, duet__tls_is_tcp);
    return duet__tls_any(tls, duet__tls_is_tcp_or_all);
}

/* Whether a UCX_TLS value may give UCX a transport that detects a dead peer: unset, "all", an
 * exclusion list, or a list naming tcp or an InfiniBand transport (ib, rc*, ud*, dc*). Shared
 * memory, self, cma and the CUDA transports cannot in UCX 1.13; with only those an endpoint
 * asked for UCP_ERR_HANDLING_MODE_PEER fails and UCX prints an error first. */
bool duet__tls_may_detect_peer_failure(const char *tls)
{
    if (tls == NULL || *tls == '\0' || *tls == '^')
        return true;
    return duet__tls_any(tls, duet__tls_detects_peers);
}

/* ucp_init with the environment's configuration (UCX_*), plus PROTO_ENABLE=y when proto_v2. */
static ucs_status_t duet__ucp_init(const ucp_params_t *up, bool proto_v2, ucp_context_h *ucp_p)
{
    ucp_config_t *cfg = NULL;
    ucs_status_t us = ucp_config_read(NULL, NULL, &cfg);
    if (us != UCS_OK)
        return us;
    if (proto_v2)
        us = ucp_config_modify(cfg, "PROTO_ENABLE", "y");
    if (us == UCS_OK)
        us = ucp_init(up, cfg, ucp_p);
    ucp_config_release(cfg);
    return us;
}

/* UCS_BIT(ucs_memory_type_t) of every memory type the context can register and move. */
static uint64_t duet__ucp_mem_types(ucp_context_h ucp)
{
    ucp_context_attr_t ca = {.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES};
    uint64_t m = ucp_context_query(ucp, &ca) == UCS_OK ? ca.memory_types : 0;
    return m | UCS_BIT(UCS_MEMORY_TYPE_HOST);
}

duet_status_t duet_xfer_ctx_create(const duet_xfer_ctx_opts_t *opts, duet_xfer_ctx_t **ctx_p)
{
    duet_xfer_ctx_opts_t o;
    duet_status_t st;
    if (opts == NULL)
        duet_xfer_ctx_opts_default(&o);
    else
        o = *opts;
    if (o.max_transfers == 0 || o.max_transfers > 0xffffu || o.max_peers == 0 ||
        o.max_peers > 4096 || o.max_pages == 0 || o.max_pages > DUET_XFER_RESERVATION_MAX_PAGES)
        return DUET_FAIL(DUET_ERR_INVALID,
                         "xfer: options out of range (max_transfers %u in 1..65535, max_peers %u "
                         "in 1..4096, max_pages %u in 1..%u)",
                         o.max_transfers, o.max_peers, o.max_pages,
                         DUET_XFER_RESERVATION_MAX_PAGES);

    duet_xfer_ctx_t *ctx = calloc(1, sizeof(*ctx));
    if (ctx == NULL)
        return DUET_FAIL(DUET_ERR_NOMEM, "xfer: context");
    ctx->efd = -1;
    ctx->cap = o.max_transfers;
    ctx->max_peers = o.max_peers;
    ctx->max_pages = o.max_pages;
    ctx->abort_grace_ms = o.abort_grace_ms;
    ctx->recv_no_abort_back = o.recv_no_abort_back;
    ctx->n_msgs = 4 * o.max_transfers + 64;
    if (getrandom(&ctx->nonce, sizeof(ctx->nonce), 0) != sizeof(ctx->nonce))
        ctx->nonce = (uint32_t)duet__xfer_now_ns() ^ (uint32_t)getpid() * 2654435761u;

    ctx->xs = calloc(ctx->cap, sizeof(*ctx->xs));
    ctx->peers = calloc(ctx->max_peers, sizeof(*ctx->peers));
    ctx->msgs = calloc(ctx->n_msgs, sizeof(*ctx->msgs));
    ctx->xxh = XXH3_createState();
    if (ctx->xs == NULL || ctx->peers == NULL || ctx->msgs == NULL || ctx->xxh == NULL) {
        st = DUET_FAIL(DUET_ERR_NOMEM, "xfer: tables");
        goto fail;
    }
    for (uint32_t i = 0; i < ctx->cap; i++) {
        duet__xfer_t *x = &ctx->xs[i];
        x->idx = i;
        x->pages = malloc(sizeof(*x->pages) * ctx->max_pages);
        x->ranks = calloc(DUET_XFER_MAX_RANKS, sizeof(*x->ranks));
        x->hello_addr = malloc(DUET__XFER_ADDR_MAX);
        if (x->pages == NULL || x->ranks == NULL || x->hello_addr == NULL) {
            st = DUET_FAIL(DUET_ERR_NOMEM, "xfer: transfer table");
            goto fail;
        }
    }
    for (uint32_t i = 0; i < ctx->max_peers; i++) {
        ctx->peers[i].ctx = ctx;
        ctx->peers[i].addr = malloc(DUET__XFER_ADDR_MAX);
        if (ctx->peers[i].addr == NULL) {
            st = DUET_FAIL(DUET_ERR_NOMEM, "xfer: peer table");
            goto fail;
        }
    }
    for (uint32_t i = 0; i < ctx->n_msgs; i++)
        ctx->msgs[i].ctx = ctx;

    if (o.metrics != NULL && (st = duet__xfer_metrics_init(ctx, o.metrics)) < 0) {
        char why[256];
        snprintf(why, sizeof(why), "%s", duet_error_last()); /* FAIL rewrites the detail */
        st = DUET_FAIL(st, "xfer: metrics: %s", why);
        goto fail;
    }

    ucp_params_t up = {
        .field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME,
        .features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
        .name = "duet-xfer",
    };
    ucs_status_t us = duet__ucp_init(&up, false, &ctx->ucp);
    if (us != UCS_OK) {
        st = DUET_FAIL(DUET_ERR_TRANSPORT, "xfer: ucp_init: %s", ucs_status_string(us));
        goto fail;
    }
    /* No transport that could detect a dead peer: endpoints without error handling from the
     * start (duet__xfer_peer_get), not after a failed first try that UCX reports as an ERROR. */
    if (!duet__tls_may_detect_peer_failure(getenv("UCX_TLS"))) {
        ctx->no_peer_err = true;
        DUET_LOG_INFO("xfer: UCX_TLS=%s has no transport that detects a dead peer; endpoints "
                      "rely on deadlines",
                      getenv("UCX_TLS"));
    }
    /* Which memory this UCX can register and move: host always; CUDA only when it was built with
     * CUDA transports (cuda_copy / cuda_ipc) and they are enabled (UCX_TLS). */
    ctx->mem_types = duet__ucp_mem_types(ctx->ucp);
    const bool cuda = (ctx->mem_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
    if (cuda && duet__tls_may_use_tcp(getenv("UCX_TLS"))) {
        /* Measured with a CUDA-built UCX 1.13.1 on an H200: with tcp among the transports, a
         * context on the new protocol layer (needed for device memory, below) crashes in
         * ucp_am_send_nbx on its first active message. Device memory stays off: the owner
         * stages through host pools. */
        DUET_LOG_INFO("xfer: UCX has CUDA transports, but UCX_TLS allows tcp, with which UCX "
                      "1.13 cannot move device memory safely: device pools stay off (set "
                      "UCX_TLS to e.g. sm,self,cuda_copy,cuda_ipc to move them directly)");
        ctx->mem_types &= ~UCS_BIT(UCS_MEMORY_TYPE_CUDA);
    } else if (cuda && getenv("UCX_PROTO_ENABLE") == NULL) {
        /* UCX 1.13's default protocols carry a put into device memory over shared memory as an
         * active message that the target copies with the CPU: a crash (measured on an H200 with
         * a CUDA-built UCX 1.13.1, cuda_copy + cuda_ipc + posix). Its new protocol layer moves
         * device memory correctly, so a context that can see CUDA memory uses it (unless the
         * operator chose with UCX_PROTO_ENABLE). */
        ucp_cleanup(ctx->ucp);
        ctx->ucp = NULL;
        us = duet__ucp_init(&up, true, &ctx->ucp);
        if (us != UCS_OK) {
            st = DUET_FAIL(DUET_ERR_TRANSPORT, "xfer: ucp_init (PROTO_ENABLE=y): %s",
                           ucs_status_string(us));
            goto fail;
        }
        ctx->mem_types = duet__ucp_mem_types(ctx->ucp);
    }
    ucp_worker_params_t wp = {
        .field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE | UCP_WORKER_PARAM_FIELD_EVENTS,
        .thread_mode = UCS_THREAD_MODE_SINGLE,
        .events = UCP_WAKEUP_RMA | UCP_WAKEUP_TX | UCP_WAKEUP_RX,
    };
    us = ucp_worker_create(ctx->ucp, &wp, &ctx->worker);
    if (us != UCS_OK) {
        st = DUET_FAIL(DUET_ERR_TRANSPORT, "xfer: ucp_worker_create: %s", ucs_status_string(us));
        goto fail;
    }
    us = ucp_worker_get_efd(ctx->worker, &ctx->efd);
    if (us != UCS_OK) {
        st = DUET_FAIL(DUET_ERR_TRANSPORT, "xfer: ucp_worker_get_efd: %s", ucs_status_string(us));
        goto fail;
    }
    us = ucp_worker_get_address(ctx->worker, &ctx->addr, &ctx->addr_len);
    if (us != UCS_OK) {
        st = DUET_FAIL(DUET_ERR_TRANSPORT, "xfer: ucp_worker_get_address: %s",
                       ucs_status_string(us));
        goto fail;
    }
    if (ctx->addr_len > DUET__XFER_ADDR_MAX) {
        st = DUET_FAIL(DUET_ERR_UNSUPPORTED, "xfer: worker address of %zu bytes (max %u)",
                       ctx->addr_len, DUET__XFER_ADDR_MAX);
        goto fail;
    }
    if ((st = duet__am_register(ctx, DUET__XFER_AM_TO_RECV, duet__am_cb)) < 0 ||
        (st = duet__am_register(ctx, DUET__XFER_AM_TO_SEND, duet__am_send_side_cb)) < 0)
        goto fail;
    DUET_LOG_DEBUG("xfer: context up (worker address %zu bytes, table %u, peers %u)", ctx->addr_len,
                   ctx->cap, ctx->max_peers);
    *ctx_p = ctx;
    return DUET_OK;

fail:
    duet_xfer_ctx_destroy(ctx);
    return st;
}

static bool duet__ctx_any_active(const duet_xfer_ctx_t *ctx)
{
    return ctx->n_active[0] + ctx->n_active[1] > 0;
}

void duet_xfer_ctx_destroy(duet_xfer_ctx_t *ctx)
{
    if (ctx == NULL)
        return;
    ctx->destroying = true;
    if (ctx->worker != NULL) {
        /* Abort every transfer; the sender's aborts wait for their flushes (bounded). */
        for (uint32_t i = 0; i < ctx->cap; i++) {
            duet__xfer_t *x = &ctx->xs[i];
            if (x->state == DUET__X_FREE)
                continue;
            if (x->role == DUET_XFER_ROLE_RECV) {
                duet__xfer_set_reason(x, DUET_XFER_REASON_SHUTDOWN, "transfer context destroyed");
                duet__xfer_recv_abort(ctx, x, DUET_XFER_REASON_SHUTDOWN, true);
            } else {
                duet__xfer_set_reason(x, DUET_XFER_REASON_SHUTDOWN, "transfer context destroyed");
                duet__xfer_send_abort_x(ctx, x, DUET_XFER_REASON_SHUTDOWN);
            }
        }
        uint64_t t_end = duet__xfer_now_ns() + (uint64_t)(ctx->abort_grace_ms + 1000) * 1000000ull;
        while (duet__ctx_any_active(ctx) && duet__xfer_now_ns() < t_end)
            duet_xfer_ctx_wait(ctx, 10);
        /* Close every endpoint: flush mode for healthy ones, bounded, then force. */
        for (uint32_t i = 0; i < ctx->max_peers; i++) {
            duet__peer_t *p = &ctx->peers[i];
            if (p->ep != NULL && p->state != DUET__PEER_CLOSING)
                duet__xfer_peer_close(ctx, p, p->state != DUET__PEER_READY);
        }
        t_end = duet__xfer_now_ns() + 1000000000ull;
        for (;;) {
            bool busy = false;
            for (uint32_t i = 0; i < ctx->max_peers; i++)
                busy |= ctx->peers[i].req != NULL;
            for (uint32_t i = 0; i < ctx->n_msgs; i++)
                busy |= ctx->msgs[i].used;
            if (!busy || duet__xfer_now_ns() >= t_end)
                break;
            ucp_worker_progress(ctx->worker);
        }
        /* Whatever is still in flight is stuck on a dead peer that could not be force-closed
         * (no error handling on shared memory): hand those requests back to UCX so that the
         * worker can be destroyed; their callbacks will not run any more. */
        for (uint32_t i = 0; i < ctx->max_peers; i++)
            if (ctx->peers[i].req != NULL) {
                ucp_request_free(ctx->peers[i].req);
                ctx->peers[i].req = NULL;
            }
        for (uint32_t i = 0; i < ctx->n_msgs; i++)
            if (ctx->msgs[i].used && ctx->msgs[i].req != NULL) {
                ucp_request_free(ctx->msgs[i].req);
                ctx->msgs[i].req = NULL;
            }
        for (uint32_t i = 0; i < ctx->cap; i++)
            for (uint32_t r = 0; r < DUET_XFER_MAX_RANKS; r++)
                for (int j = 0; j < 2; j++)
                    if (ctx->xs[i].ranks[r].flush_req[j] != NULL) {
                        ucp_request_free(ctx->xs[i].ranks[r].flush_req[j]);
                        ctx->xs[i].ranks[r].flush_req[j] = NULL;
                    }
    }
    for (int k = 0; k < DUET_XFER_N_POOLS; k++) {
        if (ctx->pools[k].rkey != NULL)
            ucp_rkey_buffer_release(ctx->pools[k].rkey);
        if (ctx->pools[k].memh != NULL)
            ucp_mem_unmap(ctx->ucp, ctx->pools[k].memh);
    }
    if (ctx->addr != NULL)
        ucp_worker_release_address(ctx->worker, ctx->addr);
    if (ctx->worker != NULL)
        ucp_worker_destroy(ctx->worker);
    if (ctx->ucp != NULL)
        ucp_cleanup(ctx->ucp);
    if (ctx->xs != NULL) {
        for (uint32_t i = 0; i < ctx->cap; i++) {
            free(ctx->xs[i].pages);
            free(ctx->xs[i].ranks);
            free(ctx->xs[i].hello_addr);
            duet_xfer_plan_free(&ctx->xs[i].plan);
        }
    }
    if (ctx->peers != NULL)
        for (uint32_t i = 0; i < ctx->max_peers; i++)
            free(ctx->peers[i].addr);
    free(ctx->xs);
    free(ctx->peers);
    free(ctx->msgs);
    if (ctx->xxh != NULL)
        XXH3_freeState(ctx->xxh);
    free(ctx);
}

static duet_status_t duet__xfer_map(duet_xfer_ctx_t *ctx, duet_xfer_pool_t pool, void *base,
                                    size_t bytes, duet_xfer_mem_kind_t kind, void **base_p)
{
    if ((unsigned)pool >= DUET_XFER_N_POOLS || (base == NULL && base_p == NULL) || bytes == 0)
        return DUET_FAIL(DUET_ERR_INVALID, "xfer register: pool %d, base %p, %zu bytes", (int)pool,
                         base, bytes);
    if (kind != DUET_XFER_MEM_HOST && kind != DUET_XFER_MEM_CUDA)
        return DUET_FAIL(DUET_ERR_INVALID, "xfer register: pool %d: unknown memory kind %d",
                         (int)pool, (int)kind);
    if (!duet_xfer_ctx_mem_supported(ctx, kind))
        return DUET_FAIL(DUET_ERR_UNSUPPORTED,
                         "xfer register: pool %d is CUDA device memory, and this UCX has no CUDA "
                         "transports (cuda_copy / cuda_ipc: not built in, or left out of UCX_TLS); "
                         "stage the pool through registered host memory instead",
                         (int)pool);
    if (kind == DUET_XFER_MEM_CUDA && base == NULL)
        return DUET_FAIL(DUET_ERR_UNSUPPORTED,
                         "xfer alloc: pool %d: device pools are allocated by their owner "
                         "(cudaMalloc) and registered",
                         (int)pool);
    if (ctx->pools[pool].memh != NULL)
        return DUET_FAIL(DUET_ERR_INVALID, "xfer register: pool %d already registered", (int)pool);
    ucp_mem_map_params_t mp = {
        .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE | UCP_MEM_MAP_PARAM_FIELD_FLAGS,
        .address = base,
        .length = bytes,
        .memory_type = kind == DUET_XFER_MEM_CUDA ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST,
        .flags = base == NULL ? UCP_MEM_MAP_ALLOCATE : 0,
    };
    ucp_mem_h memh;
    ucs_status_t us = ucp_mem_map(ctx->ucp, &mp, &memh);
    if (us != UCS_OK)
        return DUET_FAIL(DUET_ERR_TRANSPORT, "xfer register: ucp_mem_map(%zu bytes): %s", bytes,
                         ucs_status_string(us));
    if (base == NULL) {
        ucp_mem_attr_t attr = {.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS};
        us = ucp_mem_query(memh, &attr);
        if (us != UCS_OK) {
            ucp_mem_unmap(ctx->ucp, memh);
            return DUET_FAIL(DUET_ERR_TRANSPORT, "xfer register: ucp_mem_query: %s",
                             ucs_status_string(us));
        }
        base = attr.address;
        memset(base, 0, bytes);
    }
    void *rkey;
    size_t rkey_len;
    us = ucp_rkey_pack(ctx->ucp, memh, &rkey, &rkey_len);
    if (us != UCS_OK) {
        ucp_mem_unmap(ctx->ucp, memh);
        return DUET_FAIL(DUET_ERR_TRANSPORT, "xfer register: ucp_rkey_pack: %s",
                         ucs_status_string(us));
    }
    ctx->pools[pool].base = base;
    ctx->pools[pool].bytes = bytes;
    ctx->pools[pool].memh = memh;
    ctx->pools[pool].rkey = rkey;
    ctx->pools[pool].rkey_len = rkey_len;
    ctx->pools[pool].kind = kind;
    if (base_p != NULL)
        *base_p = base;
    return DUET_OK;
}

duet_status_t duet_xfer_ctx_register(duet_xfer_ctx_t *ctx, duet_xfer_pool_t pool, void *base,
                                     size_t bytes, duet_xfer_mem_kind_t kind)
{
    if (base == NULL)
        return DUET_FAIL(DUET_ERR_INVALID, "xfer register: pool %d: NULL base", (int)pool);
    return duet__xfer_map(ctx, pool, base, bytes, kind, NULL);
}

duet_status_t duet_xfer_ctx_alloc(duet_xfer_ctx_t *ctx, duet_xfer_pool_t pool, size_t bytes,
                                  duet_xfer_mem_kind_t kind, void **base_p)
{
    return duet__xfer_map(ctx, pool, NULL, bytes, kind, base_p);
}

bool duet_xfer_ctx_mem_supported(const duet_xfer_ctx_t *ctx, duet_xfer_mem_kind_t kind)
{
    if (kind == DUET_XFER_MEM_HOST)
        return true;
    return kind == DUET_XFER_MEM_CUDA && (ctx->mem_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
}

int duet_xfer_ctx_fd(const duet_xfer_ctx_t *ctx)
{
    return ctx->efd;
}

uint32_t duet_xfer_ctx_active(const duet_xfer_ctx_t *ctx, duet_xfer_role_t role)
{
    return ctx->n_active[role];
}

int duet_xfer_ctx_progress(duet_xfer_ctx_t *ctx)
{
    int n = 0;
    for (int i = 0; i < 256; i++) {
        unsigned k = ucp_worker_progress(ctx->worker);
        if (k == 0)
            break;
        n += (int)k;
    }
    uint64_t now = duet__xfer_now_ns();
    ctx->sweeps++;
    ctx->dirty = false;
    for (uint32_t i = 0; i < ctx->cap; i++) {
        duet__xfer_t *x = &ctx->xs[i];
        if (x->state == DUET__X_FREE)
            continue;
        if (x->role == DUET_XFER_ROLE_RECV)
            duet__xfer_recv_step(ctx, x, now);
        else
            duet__xfer_send_step(ctx, x, now);
    }
    /* After the transfers saw their failed peers, close those endpoints (force: the peer is gone
     * or stuck; this also completes whatever was still outstanding on them). */
    for (uint32_t i = 0; i < ctx->max_peers; i++) {
        duet__peer_t *p = &ctx->peers[i];
        if (p->state == DUET__PEER_FAILED) {
            DUET_LOG_INFO("xfer: peer %u failed (%s); closing its endpoint", i,
                          ucs_status_string(p->err));
            duet__xfer_peer_close(ctx, p, true);
            n++;
        }
    }
    if (ctx->dirty)
        n++;
    return n;
}

duet_status_t duet_xfer_ctx_arm(duet_xfer_ctx_t *ctx)
{
    if (ctx->dirty)
        return DUET_ERR_BUSY;
    ucs_status_t us = ucp_worker_arm(ctx->worker);
    if (us == UCS_ERR_BUSY)
        return DUET_ERR_BUSY;
    if (us != UCS_OK)
        return DUET_FAIL(DUET_ERR_TRANSPORT, "xfer: ucp_worker_arm: %s", ucs_status_string(us));
    return DUET_OK;
}

int duet_xfer_ctx_timeout_ms(const duet_xfer_ctx_t *ctx)
{
    if (!duet__ctx_any_active(ctx))
        return -1;
    uint64_t now = duet__xfer_now_ns(), next = UINT64_MAX;
    for (uint32_t i = 0; i < ctx->cap; i++) {
        const duet__xfer_t *x = &ctx->xs[i];
        if (x->state == DUET__X_FREE)
            continue;
        uint64_t d = x->state == DUET__X_ABORTING ? x->abort_deadline_ns : x->deadline_ns;
        if (d < next)
            next = d;
    }
    if (next == UINT64_MAX)
        return -1;
    if (next <= now)
        return 0;
    uint64_t ms = (next - now + 999999) / 1000000;
    return ms > 0x7fffffff ? 0x7fffffff : (int)ms;
}

int duet_xfer_ctx_wait(duet_xfer_ctx_t *ctx, int timeout_ms)
{
    int n = duet_xfer_ctx_progress(ctx);
    if (n > 0 || timeout_ms == 0)
        return n;
    if (duet_xfer_ctx_arm(ctx) != DUET_OK)
        return duet_xfer_ctx_progress(ctx);
    int t = duet_xfer_ctx_timeout_ms(ctx);
    if (t < 0 || (timeout_ms >= 0 && timeout_ms < t))
        t = timeout_ms;
    /* A safety net against a transport that does not signal its fd: never sleep long. */
    if (t < 0 || t > 50)
        t = 50;
    struct pollfd pfd = {.fd = ctx->efd, .events = POLLIN};
    if (poll(&pfd, 1, t) < 0 && errno != EINTR)
        DUET_LOG_WARN("xfer: poll: %m");
    return duet_xfer_ctx_progress(ctx);
}
