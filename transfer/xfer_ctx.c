/*
 * The transfer runtime's context: UCX context + worker, registered pools, the transfer table, the
 * endpoint cache, control messages, and the progress sweep (see xfer.h and xfer_impl.h).
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
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "proto/frame.h"

static const char *const duet__reason_names[] = {
#define DUET__XFER_REASON_STR(name, str) str,
    DUET_XFER_REASON_MAP(DUET__XFER_REASON_STR)
#undef DUET__XFER_REASON_STR
};

const char *duet_xfer_reason_str(duet_xfer_reason_t r)
{
    if ((unsigned)r >= DUET_XFER_N_REASONS)
        return "unknown";
    return duet__reason_names[r];
}

const char *duet__xfer_state_str(duet__xstate_t s)
{
    switch (s) {
    case DUET__X_FREE:       return "FREE";
    case DUET__X_RESERVED:   return "RESERVED";
    case DUET__X_RECEIVING:  return "RECEIVING";
    case DUET__X_CONNECTING: return "CONNECTING";
    case DUET__X_SENDING:    return "SENDING";
    case DUET__X_FLUSHING:   return "FLUSHING";
    case DUET__X_ABORTING:   return "ABORTING";
    }
    return "?";
}

void duet__xfer_set_state(duet__xfer_t *x, duet__xstate_t s)
{
    DUET_RLOG_DEBUG(x->req_id, "xfer %016llx %s: %s -> %s", (unsigned long long)x->id,
                    x->role == DUET_XFER_ROLE_SEND ? "send" : "recv", duet__xfer_state_str(x->state),
                    duet__xfer_state_str(s));
    x->state = s;
}

void duet__xfer_set_reason(duet__xfer_t *x, duet_xfer_reason_t reason, const char *fmt, ...)
{
    if (x->reason != DUET_XFER_REASON_NONE)
        return; /* the first reason wins */
    x->reason = reason;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(x->msg, sizeof(x->msg), fmt, ap);
    va_end(ap);
}

int duet__xfer_reason_to_proto(duet_xfer_reason_t r)
{
    switch (r) {
    case DUET_XFER_REASON_CANCELLED:   return DUET__XFER_ABORT__REASON__CANCELLED;
    case DUET_XFER_REASON_DEADLINE:    return DUET__XFER_ABORT__REASON__DEADLINE;
    case DUET_XFER_REASON_PEER_FAILED: return DUET__XFER_ABORT__REASON__PEER_FAILED;
    case DUET_XFER_REASON_REFUSED:
    case DUET_XFER_REASON_CHECKSUM:    return DUET__XFER_ABORT__REASON__REFUSED;
    case DUET_XFER_REASON_SHUTDOWN:    return DUET__XFER_ABORT__REASON__CANCELLED;
    default:                           return DUET__XFER_ABORT__REASON__INTERNAL;
    }
}

const char *duet__xfer_proto_reason_str(int r)
{
    switch (r) {
    case DUET__XFER_ABORT__REASON__CANCELLED:   return "cancelled";
    case DUET__XFER_ABORT__REASON__DEADLINE:    return "deadline";
    case DUET__XFER_ABORT__REASON__PEER_FAILED: return "peer_failed";
    case DUET__XFER_ABORT__REASON__REFUSED:     return "refused";
    case DUET__XFER_ABORT__REASON__INTERNAL:    return "internal";
    default:                                    return "unspecified";
    }
}

uint64_t duet__xfer_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void duet__xfer_hdr_write(uint8_t *hdr, uint16_t kind, uint64_t x_id)
{
    uint32_t magic = DUET__XFER_AM_MAGIC;
    for (int i = 0; i < 4; i++)
        hdr[i] = (uint8_t)(magic >> (8 * i));
    hdr[4] = (uint8_t)kind;
    hdr[5] = (uint8_t)(kind >> 8);
    hdr[6] = hdr[7] = 0;
    for (int i = 0; i < 8; i++)
        hdr[8 + i] = (uint8_t)(x_id >> (8 * i));
}

bool duet__xfer_hdr_read(const uint8_t *hdr, size_t len, uint16_t *kind_p, uint64_t *x_id_p)
{
    if (hdr == NULL || len != DUET__XFER_AM_HDR_BYTES)
        return false;
    uint32_t magic = 0;
    for (int i = 0; i < 4; i++)
        magic |= (uint32_t)hdr[i] << (8 * i);
    if (magic != DUET__XFER_AM_MAGIC)
        return false;
    uint64_t id = 0;
    for (int i = 0; i < 8; i++)
        id |= (uint64_t)hdr[8 + i] << (8 * i);
    *kind_p = (uint16_t)(hdr[4] | (hdr[5] << 8));
    *x_id_p = id;
    return true;
}

/* --- options, metrics --------------------------------------------------------------------- */

void duet_xfer_ctx_opts_default(duet_xfer_ctx_opts_t *opts)
{
    memset(opts, 0, sizeof(*opts));
    opts->max_transfers  = 256;
    opts->max_peers      = 64;
    opts->max_pages      = 4096;
    opts->abort_grace_ms = 1000;
}

static const char *duet__role_label[2]    = {"send", "recv"};
static const char *duet__outcome_label[2] = {"done", "aborted"};

static duet_status_t duet__xfer_metrics_init(duet_xfer_ctx_t *ctx, duet_metrics_t *reg)
{
    duet_metric_family_t *f_bytes, *f_xfers, *f_aborts, *f_secs;
    const char *role[] = {"role"};
    const char *role_outcome[] = {"role", "outcome"};
    const char *reason[] = {"reason"};
    const double buckets[] = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                              0.05,   0.1,     0.25,   0.5,   1,      2.5,   5,    10,   30};
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
        const char *v[] = {duet__role_label[r]};
        if ((st = duet_metrics_child(f_bytes, v, 1, &ctx->m.bytes[r])) < 0 ||
            (st = duet_metrics_child(f_secs, v, 1, &ctx->m.seconds[r])) < 0)
            return st;
        for (int o = 0; o < 2; o++) {
            const char *vo[] = {duet__role_label[r], duet__outcome_label[o]};
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

/* Message buffers ---------------------------------------------------------------------------- */

typedef enum { DUET__MSG_HELLO = 0, DUET__MSG_DONE = 1, DUET__MSG_ABORT = 2 } duet__msg_kind_t;

static duet__msg_t *duet__msg_take(duet_xfer_ctx_t *ctx)
{
    for (uint32_t k = 0; k < ctx->n_msgs; k++) {
        uint32_t i = (ctx->msg_hint + k) % ctx->n_msgs;
        if (!ctx->msgs[i].used) {
            ctx->msg_hint = i + 1;
            ctx->msgs[i].used = true;
            ctx->msgs[i].x = NULL;
            return &ctx->msgs[i];
        }
    }
    return NULL;
}

/* A message finished (sent, failed or cancelled): tell its transfer, free the buffer. */
static void duet__msg_done(duet__msg_t *m, ucs_status_t status)
{
    duet__xfer_t *x = m->x;
    if (x != NULL) {
        DUET_ASSERT(x->pending > 0);
        x->pending--;
        if (x->done_left > 0 && x->state == DUET__X_FLUSHING)
            x->done_left--;
        if (status != UCS_OK && x->op_err == UCS_OK)
            x->op_err = status;
    }
    m->used = false;
    m->x = NULL;
    m->ctx->dirty = true;
}

static void duet__msg_cb(void *request, ucs_status_t status, void *user_data)
{
    duet__msg_t *m = user_data;
    m->req = NULL;
    duet__msg_done(m, status);
    ucp_request_free(request);
}

static duet_status_t duet__msg_send(duet_xfer_ctx_t *ctx, ucp_ep_h ep, unsigned am_id,
                                    duet__msg_t *m, const void *data, size_t len, bool reply)
{
    ucp_request_param_t p = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                        UCP_OP_ATTR_FIELD_FLAGS,
        .cb.send = duet__msg_cb,
        .user_data = m,
        .flags = reply ? UCP_AM_SEND_FLAG_REPLY : 0,
    };
    if (m->x != NULL)
        m->x->pending++;
    ucs_status_ptr_t r = ucp_am_send_nbx(ep, am_id, m->hdr, DUET__XFER_AM_HDR_BYTES, data, len, &p);
    if (r == NULL) {
        duet__msg_done(m, UCS_OK);
        return DUET_OK;
    }
    if (UCS_PTR_IS_ERR(r)) {
        ucs_status_t us = UCS_PTR_STATUS(r);
        duet__msg_done(m, us);
        DUET_LOG_WARN("xfer: control message send failed: %s", ucs_status_string(us));
        return duet_error_set(DUET_ERR_TRANSPORT, "xfer: am send: %s", ucs_status_string(us));
    }
    m->req = r;
    return DUET_OK;
}

static bool duet__peer_usable(const duet__peer_t *p)
{
    return p->state == DUET__PEER_READY || p->state == DUET__PEER_CONNECTING;
}

duet_status_t duet__xfer_send_hello(duet_xfer_ctx_t *ctx, int32_t peer, uint64_t x_id)
{
    duet__peer_t *p = &ctx->peers[peer];
    if (!duet__peer_usable(p))
        return duet_error_set(DUET_ERR_TRANSPORT, "xfer: peer endpoint failed");
    duet__msg_t *m = duet__msg_take(ctx);
    if (m == NULL)
        return duet_error_set(DUET_ERR_BUSY, "xfer: no control-message buffer free");
    duet__xfer_hdr_write(m->hdr, DUET__XFER_AM_HELLO, x_id);
    return duet__msg_send(ctx, p->ep, DUET__XFER_AM_TO_RECV, m, ctx->addr, ctx->addr_len, true);
}

static duet_status_t duet__msg_pack_env(duet__msg_t *m, Duet__Envelope *env, size_t *len_p)
{
    size_t n = duet__envelope__get_packed_size(env);
    if (n > DUET__XFER_MSG_BYTES)
        return duet_error_set(DUET_ERR_INTERNAL, "xfer: control message of %zu bytes", n);
    *len_p = duet__envelope__pack(env, m->body);
    return DUET_OK;
}

duet_status_t duet__xfer_send_done(duet_xfer_ctx_t *ctx, duet__xfer_t *x, int32_t peer,
                                   uint64_t x_id, uint64_t bytes, bool has_checksum,
                                   uint64_t checksum)
{
    duet__peer_t *p = &ctx->peers[peer];
    if (!duet__peer_usable(p))
        return duet_error_set(DUET_ERR_TRANSPORT, "xfer: peer endpoint failed");
    duet__msg_t *m = duet__msg_take(ctx);
    if (m == NULL)
        return duet_error_set(DUET_ERR_BUSY, "xfer: no control-message buffer free");
    Duet__XferDone done = DUET__XFER_DONE__INIT;
    done.transfer_id = x_id;
    done.bytes = bytes;
    done.has_checksum = has_checksum;
    done.checksum = checksum;
    Duet__Envelope env = DUET__ENVELOPE__INIT;
    env.version = DUET_PROTO_VERSION;
    env.body_case = DUET__ENVELOPE__BODY_XFER_DONE;
    env.xfer_done = &done;
    size_t len = 0;
    duet_status_t st = duet__msg_pack_env(m, &env, &len);
    if (st < 0) {
        m->used = false;
        return st;
    }
    duet__xfer_hdr_write(m->hdr, DUET__XFER_AM_ENVELOPE, x_id);
    m->x = x;
    return duet__msg_send(ctx, p->ep, DUET__XFER_AM_TO_RECV, m, m->body, len, false);
}

static duet_status_t duet__xfer_send_abort_ep(duet_xfer_ctx_t *ctx, duet__xfer_t *x, ucp_ep_h ep,
                                              unsigned am_id, uint64_t x_id,
                                              duet_xfer_reason_t reason, const char *message)
{
    duet__msg_t *m = duet__msg_take(ctx);
    if (m == NULL)
        return duet_error_set(DUET_ERR_BUSY, "xfer: no control-message buffer free");
    char text[DUET__XFER_MSG_TEXT];
    snprintf(text, sizeof(text), "%s", message != NULL ? message : "");
    Duet__XferAbort ab = DUET__XFER_ABORT__INIT;
    ab.transfer_id = x_id;
    ab.reason = (Duet__XferAbort__Reason)duet__xfer_reason_to_proto(reason);
    ab.message = text;
    Duet__Envelope env = DUET__ENVELOPE__INIT;
    env.version = DUET_PROTO_VERSION;
    env.body_case = DUET__ENVELOPE__BODY_XFER_ABORT;
    env.xfer_abort = &ab;
    size_t len = 0;
    duet_status_t st = duet__msg_pack_env(m, &env, &len);
    if (st < 0) {
        m->used = false;
        return st;
    }
    duet__xfer_hdr_write(m->hdr, DUET__XFER_AM_ENVELOPE, x_id);
    m->x = x;
    return duet__msg_send(ctx, ep, am_id, m, m->body, len, false);
}

duet_status_t duet__xfer_send_abort(duet_xfer_ctx_t *ctx, duet__xfer_t *x, int32_t peer,
                                    unsigned am_id, uint64_t x_id, duet_xfer_reason_t reason,
                                    const char *message)
{
    duet__peer_t *p = &ctx->peers[peer];
    if (!duet__peer_usable(p))
        return duet_error_set(DUET_ERR_TRANSPORT, "xfer: peer endpoint failed");
    return duet__xfer_send_abort_ep(ctx, x, p->ep, am_id, x_id, reason, message);
}

duet_status_t duet__xfer_reply_abort(duet_xfer_ctx_t *ctx, ucp_ep_h reply_ep, uint64_t x_id,
                                     const char *message)
{
    return duet__xfer_send_abort_ep(ctx, NULL, reply_ep, DUET__XFER_AM_TO_SEND, x_id,
                                    DUET_XFER_REASON_REFUSED, message);
}

/* --- peers -------------------------------------------------------------------------------- */

static void duet__peer_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    duet__peer_t *p = arg;
    if (p->state == DUET__PEER_CONNECTING || p->state == DUET__PEER_READY) {
        p->state = DUET__PEER_FAILED;
        p->err = status;
    }
    p->ctx->dirty = true;
}

static void duet__peer_flush_cb(void *request, ucs_status_t status, void *user_data)
{
    duet__peer_t *p = user_data;
    p->req = NULL;
    if (p->state == DUET__PEER_CONNECTING) {
        if (status == UCS_OK) {
            p->state = DUET__PEER_READY;
        } else {
            p->state = DUET__PEER_FAILED;
            p->err = status;
        }
    }
    p->ctx->dirty = true;
    ucp_request_free(request);
}

static void duet__peer_close_cb(void *request, ucs_status_t status, void *user_data)
{
    duet__peer_t *p = user_data;
    p->req = NULL;
    p->ep = NULL;
    if (p->refs == 0)
        p->state = DUET__PEER_FREE;
    p->ctx->dirty = true;
    ucp_request_free(request);
}

/* Close p's endpoint (force for a failed peer, flush for a healthy idle one). */
static void duet__peer_close(duet_xfer_ctx_t *ctx, duet__peer_t *p, bool force)
{
    if (p->ep == NULL)
        return;
    if (p->no_err)
        force = false; /* force close needs UCP_ERR_HANDLING_MODE_PEER on both sides */
    for (uint32_t i = 0; i < p->n_rk; i++)
        ucp_rkey_destroy(p->rk[i].h);
    p->n_rk = 0;
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                        (force ? UCP_OP_ATTR_FIELD_FLAGS : 0),
        .cb.send = duet__peer_close_cb,
        .user_data = p,
        .flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0,
    };
    p->state = DUET__PEER_CLOSING;
    ucs_status_ptr_t r = ucp_ep_close_nbx(p->ep, &prm);
    if (r == NULL || UCS_PTR_IS_ERR(r)) {
        p->ep = NULL;
        p->req = NULL;
        if (p->refs == 0)
            p->state = DUET__PEER_FREE;
    } else {
        p->req = r;
    }
}

duet_status_t duet__xfer_peer_get(duet_xfer_ctx_t *ctx, const uint8_t *addr, size_t len,
                                  int32_t *peer_p)
{
    int32_t free_i = -1, lru = -1;
    if (len == 0 || len > DUET__XFER_ADDR_MAX)
        return DUET_FAIL(DUET_ERR_FORMAT, "xfer: worker address of %zu bytes (1..%u)", len,
                         DUET__XFER_ADDR_MAX);
    for (uint32_t i = 0; i < ctx->max_peers; i++) {
        duet__peer_t *p = &ctx->peers[i];
        if (duet__peer_usable(p) && p->addr_len == len && memcmp(p->addr, addr, len) == 0) {
            p->refs++;
            p->last_used = ctx->sweeps;
            *peer_p = (int32_t)i;
            return DUET_OK;
        }
        if (p->state == DUET__PEER_FREE && free_i < 0)
            free_i = (int32_t)i;
        if (p->state == DUET__PEER_READY && p->refs == 0 &&
            (lru < 0 || p->last_used < ctx->peers[lru].last_used))
            lru = (int32_t)i;
    }
    if (free_i < 0 && lru >= 0) {
        duet__peer_close(ctx, &ctx->peers[lru], false);
        if (ctx->peers[lru].state == DUET__PEER_FREE)
            free_i = lru;
    }
    if (free_i < 0)
        return DUET_FAIL(DUET_ERR_BUSY, "xfer: endpoint cache full (%u peers)", ctx->max_peers);

    duet__peer_t *p = &ctx->peers[free_i];
    ucp_ep_params_t ep_params = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .address = (const ucp_address_t *)addr,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = duet__peer_err_cb, .arg = p},
    };
    ucp_ep_h ep;
    ucs_status_t us = UCS_ERR_UNREACHABLE;
    if (!ctx->no_peer_err)
        us = ucp_ep_create(ctx->worker, &ep_params, &ep);
    p->no_err = false;
    if (us == UCS_ERR_UNREACHABLE) {
        /* UCX 1.13's shared-memory transports (posix, sysv) cannot detect a dead peer, so with
         * UCP_ERR_HANDLING_MODE_PEER a shm-only UCX_TLS has no active-message lane. Fall back to
         * an endpoint without error handling: the deadlines on both sides still end every
         * transfer, only later than an error callback would. */
        ep_params.field_mask &= ~(uint64_t)(UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                            UCP_EP_PARAM_FIELD_ERR_HANDLER);
        us = ucp_ep_create(ctx->worker, &ep_params, &ep);
        p->no_err = us == UCS_OK;
        if (us == UCS_OK && !ctx->no_peer_err)
            DUET_LOG_INFO("xfer: no transport can detect peer failure; endpoint %u relies on "
                           "deadlines", (unsigned)free_i);
        ctx->no_peer_err |= us == UCS_OK;
    }
    if (us != UCS_OK)
        return DUET_FAIL(DUET_ERR_FORMAT, "xfer: cannot connect to the worker address (%zu bytes): %s",
                         len, ucs_status_string(us));
    memcpy(p->addr, addr, len);
    p->addr_len = len;
    p->ep = ep;
    p->n_rk = 0;
    p->refs = 1;
    p->err = UCS_OK;
    p->last_used = ctx->sweeps;
    p->state = DUET__PEER_CONNECTING;
    /* docs/platform.md "UCX 1.13.1": flush a new endpoint before its first send. */
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
        .cb.send = duet__peer_flush_cb,
        .user_data = p,
    };
    ucs_status_ptr_t r = ucp_ep_flush_nbx(ep, &prm);
    if (r == NULL) {
        p->state = DUET__PEER_READY;
    } else if (UCS_PTR_IS_ERR(r)) {
        p->state = DUET__PEER_FAILED;
        p->err = UCS_PTR_STATUS(r);
    } else {
        p->req = r;
    }
    *peer_p = free_i;
    return DUET_OK;
}

ucs_status_t duet__xfer_peer_rkey(duet_xfer_ctx_t *ctx, int32_t peer, const uint8_t *key,
                                  size_t len, ucp_rkey_h *rkey_p, bool *own_p)
{
    duet__peer_t *p = &ctx->peers[peer];
    for (uint32_t i = 0; i < p->n_rk; i++)
        if (p->rk[i].len == len && memcmp(p->rk[i].key, key, len) == 0) {
            *rkey_p = p->rk[i].h;
            *own_p = false;
            return UCS_OK;
        }
    ucp_rkey_h h;
    ucs_status_t us = ucp_ep_rkey_unpack(p->ep, key, &h);
    if (us != UCS_OK)
        return us;
    if (len <= DUET__XFER_RKEY_BYTES && p->n_rk < DUET__XFER_RKEY_CACHE) {
        p->rk[p->n_rk].len = len;
        memcpy(p->rk[p->n_rk].key, key, len);
        p->rk[p->n_rk].h = h;
        p->n_rk++;
        *own_p = false;
    } else {
        *own_p = true;
    }
    *rkey_p = h;
    return UCS_OK;
}

void duet__xfer_peer_put(duet_xfer_ctx_t *ctx, int32_t peer)
{
    if (peer < 0)
        return;
    duet__peer_t *p = &ctx->peers[peer];
    DUET_ASSERT(p->refs > 0);
    p->refs--;
    if (p->refs == 0 && p->state == DUET__PEER_CLOSING && p->ep == NULL && p->req == NULL)
        p->state = DUET__PEER_FREE;
}

/* --- the transfer table ------------------------------------------------------------------- */

duet__xfer_t *duet__xfer_slot_take(duet_xfer_ctx_t *ctx, duet_xfer_role_t role)
{
    for (uint32_t i = 0; i < ctx->cap; i++) {
        duet__xfer_t *x = &ctx->xs[i];
        if (x->state != DUET__X_FREE || x->pending != 0)
            continue;
        x->gen++;
        x->role = role;
        x->state = role == DUET_XFER_ROLE_RECV ? DUET__X_RESERVED : DUET__X_CONNECTING;
        x->abort_stage = 0;
        x->id = ((uint64_t)ctx->nonce << 32) | ((uint64_t)x->gen << 16) | i;
        x->req_id = 0;
        x->cb = NULL;
        x->user = NULL;
        x->t0_ns = duet__xfer_now_ns();
        x->deadline_ns = 0;
        x->op_err = UCS_OK;
        x->reason = DUET_XFER_REASON_NONE;
        x->msg[0] = '\0';
        x->n_pages = 0;
        x->bytes = 0;
        x->kda_slot = -1;
        x->hello_pending = x->done_pending = x->abort_pending = false;
        x->hello_len = 0;
        x->done_has_checksum = false;
        x->n_ranks = 0;
        x->n_issued = 0;
        memset(x->ready, 0, sizeof(x->ready));
        memset(x->issued, 0, sizeof(x->issued));
        x->flush_left = x->done_left = 0;
        x->done_sent = false;
        ctx->n_active[role]++;
        return x;
    }
    return NULL;
}

void duet__xfer_slot_release(duet_xfer_ctx_t *ctx, duet__xfer_t *x)
{
    DUET_ASSERT(x->state != DUET__X_FREE);
    ctx->n_active[x->role]--;
    x->state = DUET__X_FREE;
}

duet__xfer_t *duet__xfer_find(duet_xfer_ctx_t *ctx, duet_xfer_role_t role, duet_xfer_id_t id)
{
    uint32_t i = (uint32_t)(id & 0xffffu);
    if ((uint32_t)(id >> 32) != ctx->nonce || i >= ctx->cap)
        return NULL;
    duet__xfer_t *x = &ctx->xs[i];
    if (x->state == DUET__X_FREE || x->role != role || x->id != id)
        return NULL;
    return x;
}

duet__xfer_t *duet__xfer_find_rank_id(duet_xfer_ctx_t *ctx, uint64_t rank_xfer_id)
{
    for (uint32_t i = 0; i < ctx->cap; i++) {
        duet__xfer_t *x = &ctx->xs[i];
        if (x->state == DUET__X_FREE || x->role != DUET_XFER_ROLE_SEND)
            continue;
        for (uint32_t r = 0; r < x->n_ranks; r++)
            if (x->ranks[r].xfer_id == rank_xfer_id)
                return x;
    }
    return NULL;
}

void duet__xfer_finish(duet_xfer_ctx_t *ctx, duet__xfer_t *x, duet_xfer_outcome_kind_t kind)
{
    duet_xfer_outcome_t o = {
        .id = x->id,
        .req_id = x->req_id,
        .role = x->role,
        .kind = kind,
        .reason = kind == DUET_XFER_OUTCOME_DONE ? DUET_XFER_REASON_NONE : x->reason,
        .message = kind == DUET_XFER_OUTCOME_DONE ? "" : x->msg,
        .bytes = x->bytes,
        .has_checksum = x->role == DUET_XFER_ROLE_RECV ? x->done_has_checksum : x->checksum,
        .checksum = x->role == DUET_XFER_ROLE_RECV ? x->done_checksum
                                                    : (x->n_ranks > 0 ? x->ranks[0].checksum : 0),
        .seconds = (double)(duet__xfer_now_ns() - x->t0_ns) * 1e-9,
    };
    char msg[DUET__XFER_MSG_TEXT];
    snprintf(msg, sizeof(msg), "%s", o.message);
    o.message = msg;
    if (kind == DUET_XFER_OUTCOME_ABORTED && o.reason == DUET_XFER_REASON_NONE)
        o.reason = DUET_XFER_REASON_TRANSPORT;

    if (ctx->m.transfers[o.role][kind] != NULL) {
        duet_metrics_counter_inc(ctx->m.transfers[o.role][kind]);
        duet_metrics_histogram_observe(ctx->m.seconds[o.role], o.seconds);
        if (kind == DUET_XFER_OUTCOME_DONE)
            duet_metrics_counter_add(ctx->m.bytes[o.role], (double)o.bytes);
        else
            duet_metrics_counter_inc(ctx->m.aborts[o.reason]);
    }
    if (kind == DUET_XFER_OUTCOME_DONE)
        DUET_RLOG_DEBUG(o.req_id, "xfer %016llx %s: DONE (%llu bytes, %.3f ms)",
                        (unsigned long long)o.id, duet__role_label[o.role],
                        (unsigned long long)o.bytes, o.seconds * 1e3);
    else
        DUET_RLOG_INFO(o.req_id, "xfer %016llx %s: ABORTED (%s: %s)", (unsigned long long)o.id,
                       duet__role_label[o.role], duet_xfer_reason_str(o.reason), msg);

    /* Drop what the transfer held. */
    if (x->role == DUET_XFER_ROLE_SEND) {
        for (uint32_t r = 0; r < x->n_ranks; r++) {
            for (int k = 0; k < DUET_XFER_N_POOLS; k++) {
                if (x->ranks[r].rkey[k] != NULL && x->ranks[r].rkey_own[k])
                    ucp_rkey_destroy(x->ranks[r].rkey[k]);
                x->ranks[r].rkey[k] = NULL;
            }
            duet__xfer_peer_put(ctx, x->ranks[r].peer);
            x->ranks[r].peer = -1;
        }
        x->n_ranks = 0;
    }
    duet_xfer_outcome_cb_t cb = x->cb;
    void *user = x->user;
    duet__xfer_slot_release(ctx, x);
    ctx->dirty = true;
    if (cb != NULL)
        cb(&o, user);
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
                         o.max_transfers, o.max_peers, o.max_pages, DUET_XFER_RESERVATION_MAX_PAGES);

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
    DUET_LOG_DEBUG("xfer: context up (worker address %zu bytes, table %u, peers %u)",
                   ctx->addr_len, ctx->cap, ctx->max_peers);
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
                duet__peer_close(ctx, p, p->state != DUET__PEER_READY);
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

bool duet__xfer_pools_on_host(const duet_xfer_ctx_t *ctx)
{
    for (int p = 0; p < DUET_XFER_N_POOLS; p++)
        if (ctx->pools[p].memh != NULL && ctx->pools[p].kind != DUET_XFER_MEM_HOST)
            return false;
    return true;
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
            duet__peer_close(ctx, p, true);
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
