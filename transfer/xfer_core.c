/*
 * What the transfer context and both state machines use (xfer_impl.h): reasons and states, the
 * active-message header, control-message buffers, the endpoint cache, the transfer table and the
 * one place an outcome is reported.
 */
#define _GNU_SOURCE
#include "transfer/xfer_impl.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"
#include "proto/envelope.h"

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

static const char *const duet__role_label[2] = {"send", "recv"};

const char *duet__xfer_role_str(duet_xfer_role_t role)
{
    return duet__role_label[role];
}

// clang-format off
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
// clang-format on

void duet__xfer_set_state(duet__xfer_t *x, duet__xstate_t s)
{
    DUET_RLOG_DEBUG(x->req_id, "xfer %016llx %s: %s -> %s", (unsigned long long)x->id,
                    duet__xfer_role_str(x->role), duet__xfer_state_str(x->state),
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

// clang-format off
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
// clang-format on

// clang-format off
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
// clang-format on

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

/* --- control messages -------------------------------------------------------------------- */

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
        .op_attr_mask =
            UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS,
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

/* Pack env into a free buffer and send it to ep as a control message of transfer x_id (x, when
 * not NULL, counts it as pending). */
static duet_status_t duet__msg_send_env(duet_xfer_ctx_t *ctx, duet__xfer_t *x, ucp_ep_h ep,
                                        unsigned am_id, uint64_t x_id, Duet__Envelope *env)
{
    size_t n = duet__envelope__get_packed_size(env);
    if (n > DUET__XFER_MSG_BYTES)
        return duet_error_set(DUET_ERR_INTERNAL, "xfer: control message of %zu bytes", n);
    duet__msg_t *m = duet__msg_take(ctx);
    if (m == NULL)
        return duet_error_set(DUET_ERR_BUSY, "xfer: no control-message buffer free");
    size_t len = duet__envelope__pack(env, m->body);
    duet__xfer_hdr_write(m->hdr, DUET__XFER_AM_ENVELOPE, x_id);
    m->x = x;
    return duet__msg_send(ctx, ep, am_id, m, m->body, len, false);
}

duet_status_t duet__xfer_send_done(duet_xfer_ctx_t *ctx, duet__xfer_t *x, int32_t peer,
                                   uint64_t x_id, uint64_t bytes, bool has_checksum,
                                   uint64_t checksum)
{
    duet__peer_t *p = &ctx->peers[peer];
    if (!duet__peer_usable(p))
        return duet_error_set(DUET_ERR_TRANSPORT, "xfer: peer endpoint failed");
    Duet__XferDone done = DUET__XFER_DONE__INIT;
    done.transfer_id = x_id;
    done.bytes = bytes;
    done.has_checksum = has_checksum;
    done.checksum = checksum;
    Duet__Envelope env = duet_envelope_xfer_done(&done);
    return duet__msg_send_env(ctx, x, p->ep, DUET__XFER_AM_TO_RECV, x_id, &env);
}

static duet_status_t duet__xfer_send_abort_ep(duet_xfer_ctx_t *ctx, duet__xfer_t *x, ucp_ep_h ep,
                                              unsigned am_id, uint64_t x_id,
                                              duet_xfer_reason_t reason, const char *message)
{
    char text[DUET__XFER_MSG_TEXT];
    snprintf(text, sizeof(text), "%s", message != NULL ? message : "");
    Duet__XferAbort ab = DUET__XFER_ABORT__INIT;
    ab.transfer_id = x_id;
    ab.reason = (Duet__XferAbort__Reason)duet__xfer_reason_to_proto(reason);
    ab.message = text;
    Duet__Envelope env = duet_envelope_xfer_abort(&ab);
    return duet__msg_send_env(ctx, x, ep, am_id, x_id, &env);
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

void duet__xfer_peer_close(duet_xfer_ctx_t *ctx, duet__peer_t *p, bool force)
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
        duet__xfer_peer_close(ctx, &ctx->peers[lru], false);
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
         * UCP_ERR_HANDLING_MODE_PEER a shm-only UCX_TLS (ctx->no_peer_err, known from UCX_TLS)
         * has no active-message lane: an endpoint without error handling, whose transfers the
         * deadlines on both sides still end, only later than an error callback would. Otherwise
         * it is this peer that no such transport reaches (the worker is gone: its tcp listener
         * refuses; or its UCX_TLS lacks tcp): the same fallback, for this endpoint only and not
         * kept past its transfers (duet__xfer_peer_put). Once this turned error handling off for
         * every later peer, and an endpoint to a dead worker was never closed, its pools' shared
         * memory staying mapped here (bench/soak saw a context worker grow by each restarted
         * generation worker's pools). */
        ep_params.field_mask &=
            ~(uint64_t)(UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER);
        us = ucp_ep_create(ctx->worker, &ep_params, &ep);
        p->no_err = us == UCS_OK;
        if (us == UCS_OK && !ctx->no_peer_err)
            DUET_LOG_INFO("xfer: no transport that detects peer failure reaches endpoint %u; it "
                          "relies on deadlines and closes when its transfers end",
                          (unsigned)free_i);
    }
    if (us != UCS_OK)
        return DUET_FAIL(DUET_ERR_FORMAT,
                         "xfer: cannot connect to the worker address (%zu bytes): %s", len,
                         ucs_status_string(us));
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
    /* an endpoint without error handling where UCX_TLS could detect failures (peer_get) is not
     * kept: its peer may be gone for good, which nothing would tell us */
    if (p->refs == 0 && p->no_err && !ctx->no_peer_err && p->state == DUET__PEER_READY)
        duet__xfer_peer_close(ctx, p, false);
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

void duet__xfer_drop_ranks(duet_xfer_ctx_t *ctx, duet__xfer_t *x)
{
    for (uint32_t r = 0; r < x->n_ranks; r++) {
        for (int k = 0; k < DUET_XFER_N_POOLS; k++) {
            if (x->ranks[r].rkey[k] != NULL && x->ranks[r].rkey_own[k])
                ucp_rkey_destroy(x->ranks[r].rkey[k]);
            x->ranks[r].rkey[k] = NULL;
            x->ranks[r].key[k] = NULL;
        }
        duet__xfer_peer_put(ctx, x->ranks[r].peer);
        x->ranks[r].peer = -1;
    }
    x->n_ranks = 0;
    free(x->keys);
    x->keys = NULL;
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

    if (x->role == DUET_XFER_ROLE_SEND)
        duet__xfer_drop_ranks(ctx, x);
    duet_xfer_outcome_cb_t cb = x->cb;
    void *user = x->user;
    duet__xfer_slot_release(ctx, x);
    ctx->dirty = true;
    if (cb != NULL)
        cb(&o, user);
}

bool duet__xfer_pools_on_host(const duet_xfer_ctx_t *ctx)
{
    for (int p = 0; p < DUET_XFER_N_POOLS; p++)
        if (ctx->pools[p].memh != NULL && ctx->pools[p].kind != DUET_XFER_MEM_HOST)
            return false;
    return true;
}

/* --- control Envelopes ------------------------------------------------------------------- */

static void *duet__arena_alloc(void *a_, size_t n)
{
    duet__arena_t *a = a_;
    size_t at = (a->used + 15) & ~(size_t)15;
    if (at + n > sizeof(a->buf))
        return NULL;
    a->used = at + n;
    return a->buf + at;
}

static void duet__arena_free(void *a, void *p)
{
    (void)a;
    (void)p;
}

Duet__Envelope *duet__xfer_env_unpack(duet__arena_t *arena, const void *data, size_t len)
{
    if (len == 0 || len > 2 * DUET__XFER_MSG_BYTES)
        return NULL;
    ProtobufCAllocator al = {
        .alloc = duet__arena_alloc, .free = duet__arena_free, .allocator_data = arena};
    arena->used = 0;
    return duet__envelope__unpack(&al, len, data);
}
