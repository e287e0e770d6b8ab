/*
 * Sender side of a transfer: CONNECTING -> SENDING -> FLUSHING -> DONE | ABORTING -> ABORTED
 * (see xfer.h).
 *
 * CONNECTING waits until every rank's endpoint finished its first flush (UCX 1.13 quirk,
 * docs/platform.md). SENDING: each ready layer group of the plan goes out as one ucp_put_nbx per
 * plan entry, straight from the registered source pool; puts carry no callback (their requests are
 * released at once) because the endpoint flush that follows is what proves them complete. FLUSHING:
 * one ucp_ep_flush_nbx per rank, then one XferDone per rank; DONE when those were sent.
 *
 * Aborts (owner cancel, deadline, a rank's XferAbort, a failed endpoint, a failed operation) tell
 * the live ranks with XferAbort and flush their endpoints, so that when the owner hears ABORTED no
 * put can still read its source pages and the rkeys can go. A flush that does not end within
 * abort_grace_ms marks that endpoint failed; the sweep force-closes it, which completes whatever
 * was outstanding on it.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "transfer/xfer_send_impl.h"

/* A pool's name in refusals, by duet_xfer_pool_t (= the plan entry's kind). */
static const char *const duet__pool_name[DUET_XFER_N_POOLS] = {"KV", "KDA", "replay"};

#define DUET__BIT_TEST(w, i) (((w)[(i) / 64] >> ((i) % 64)) & 1u)
#define DUET__BIT_SET(w, i)  ((w)[(i) / 64] |= (uint64_t)1 << ((i) % 64))

/* A failed operation: the peer's fault (it died or stopped answering) or ours. */
static duet_xfer_reason_t duet__send_err_reason(ucs_status_t us)
{
    switch (us) {
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_REJECTED:
        return DUET_XFER_REASON_PEER_FAILED;
    default:
        return DUET_XFER_REASON_TRANSPORT;
    }
}

static void duet__send_flush_cb(void *request, ucs_status_t status, void *user_data)
{
    duet__xfer_t *x = user_data;
    DUET_ASSERT(x->pending > 0);
    x->pending--;
    for (uint32_t r = 0; r < DUET_XFER_MAX_RANKS; r++)
        for (int j = 0; j < 2; j++)
            if (x->ranks[r].flush_req[j] == request)
                x->ranks[r].flush_req[j] = NULL;
    if (x->flush_left > 0)
        x->flush_left--;
    if (status != UCS_OK && x->op_err == UCS_OK)
        x->op_err = status;
    ucp_request_free(request);
}

/* Issue a flush of rank r's endpoint that counts in x->pending; false when it failed at once. */
static bool duet__send_flush_rank(duet_xfer_ctx_t *ctx, duet__xfer_t *x, uint32_t r)
{
    duet__peer_t *p = &ctx->peers[x->ranks[r].peer];
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
        .cb.send = duet__send_flush_cb,
        .user_data = x,
    };
    ucs_status_ptr_t req = ucp_ep_flush_nbx(p->ep, &prm);
    if (req == NULL) {
        if (x->flush_left > 0)
            x->flush_left--;
        return true;
    }
    if (UCS_PTR_IS_ERR(req)) {
        if (x->flush_left > 0)
            x->flush_left--;
        if (x->op_err == UCS_OK)
            x->op_err = UCS_PTR_STATUS(req);
        return false;
    }
    x->pending++;
    /* At most two per rank (the completion flush, then an abort's); see destroy. */
    x->ranks[r].flush_req[x->ranks[r].flush_req[0] == NULL ? 0 : 1] = req;
    return true;
}

void duet__xfer_send_abort_x(duet_xfer_ctx_t *ctx, duet__xfer_t *x, duet_xfer_reason_t reason)
{
    if (x->state == DUET__X_ABORTING)
        return;
    duet__xfer_set_reason(x, reason, "%s", duet_xfer_reason_str(reason));
    duet__xfer_set_state(x, DUET__X_ABORTING);
    x->abort_deadline_ns = duet__xfer_now_ns() + (uint64_t)ctx->abort_grace_ms * 1000000ull;
    for (uint32_t r = 0; r < x->n_ranks; r++) {
        int32_t pi = x->ranks[r].peer;
        if (pi < 0 || ctx->peers[pi].state != DUET__PEER_READY)
            continue;
        (void)duet__xfer_send_abort(ctx, x, pi, DUET__XFER_AM_TO_RECV, x->ranks[r].xfer_id,
                                    x->reason, x->msg);
        (void)duet__send_flush_rank(ctx, x, r);
    }
    ctx->dirty = true;
}

/* Per-rank XXH3-64 of the source bytes in plan order (what each rank will find). */
static void duet__send_checksums(duet_xfer_ctx_t *ctx, duet__xfer_t *x)
{
    const duet_xfer_plan_t *pl = &x->plan;
    for (uint32_t r = 0; r < x->n_ranks; r++) {
        XXH3_64bits_reset(ctx->xxh);
        for (size_t i = 0; i < pl->n_entries; i++) {
            const duet_xfer_entry_t *e = &pl->entries[i];
            if (e->rank != r)
                continue;
            const uint8_t *base = ctx->pools[e->kind].base;
            XXH3_64bits_update(ctx->xxh, base + e->src_off, e->len);
        }
        x->ranks[r].checksum = XXH3_64bits_digest(ctx->xxh);
    }
}

static void duet__send_start_flush(duet_xfer_ctx_t *ctx, duet__xfer_t *x)
{
    if (x->checksum)
        duet__send_checksums(ctx, x);
    duet__xfer_set_state(x, DUET__X_FLUSHING);
    x->flush_left = x->n_ranks;
    for (uint32_t r = 0; r < x->n_ranks; r++) {
        if (!duet__send_flush_rank(ctx, x, r)) {
            duet__xfer_set_reason(x, DUET_XFER_REASON_TRANSPORT, "flush of rank %u failed: %s", r,
                                  ucs_status_string(x->op_err));
            duet__xfer_send_abort_x(ctx, x, DUET_XFER_REASON_TRANSPORT);
            return;
        }
    }
    ctx->dirty = true;
}

/* Put every entry of plan group g. False (reason set) when a put failed. */
static bool duet__send_issue(duet_xfer_ctx_t *ctx, duet__xfer_t *x, uint32_t g)
{
    const duet_xfer_plan_t *pl = &x->plan;
    DUET__BIT_SET(x->issued, g);
    x->n_issued++;
    for (size_t i = pl->layer_first[g]; i < pl->layer_first[g + 1]; i++) {
        const duet_xfer_entry_t *e = &pl->entries[i];
        duet__rank_t *rk = &x->ranks[e->rank];
        ucp_request_param_t prm = {.op_attr_mask = 0};
        ucs_status_ptr_t req = ucp_put_nbx(
            ctx->peers[rk->peer].ep, (const uint8_t *)ctx->pools[e->kind].base + e->src_off, e->len,
            rk->base[e->kind] + e->dst_off, rk->rkey[e->kind], &prm);
        if (UCS_PTR_IS_ERR(req)) {
            duet__xfer_set_reason(x, duet__send_err_reason(UCS_PTR_STATUS(req)),
                                  "put to rank %u failed: %s", e->rank,
                                  ucs_status_string(UCS_PTR_STATUS(req)));
            return false;
        }
        if (req != NULL)
            ucp_request_free(req); /* completion is proven by the flush */
        x->bytes += e->len;
    }
    return true;
}

/* Issue every ready group not yet issued, in order; flush when all are out. */
static void duet__send_pump(duet_xfer_ctx_t *ctx, duet__xfer_t *x)
{
    for (uint32_t g = 0; g < x->n_groups; g++) {
        if (!DUET__BIT_TEST(x->ready, g) || DUET__BIT_TEST(x->issued, g))
            continue;
        if (!duet__send_issue(ctx, x, g)) {
            duet__xfer_send_abort_x(ctx, x, x->reason);
            return;
        }
    }
    if (x->n_issued == x->n_groups)
        duet__send_start_flush(ctx, x);
}

static bool duet__send_peers_ready(duet_xfer_ctx_t *ctx, const duet__xfer_t *x)
{
    for (uint32_t r = 0; r < x->n_ranks; r++)
        if (ctx->peers[x->ranks[r].peer].state != DUET__PEER_READY)
            return false;
    return true;
}

/* Every endpoint is up: unpack the ranks' rkeys, say hello to each rank, then put what is
 * ready. */
static void duet__send_go(duet_xfer_ctx_t *ctx, duet__xfer_t *x)
{
    for (uint32_t r = 0; r < x->n_ranks; r++) {
        duet__rank_t *rk = &x->ranks[r];
        for (int k = 0; k < DUET_XFER_N_POOLS; k++) {
            if (rk->key[k] == NULL || rk->rkey[k] != NULL)
                continue;
            ucs_status_t us = duet__xfer_peer_rkey(ctx, rk->peer, rk->key[k], rk->key_len[k],
                                                   &rk->rkey[k], &rk->rkey_own[k]);
            if (us != UCS_OK) {
                rk->rkey[k] = NULL;
                duet__xfer_set_reason(x, DUET_XFER_REASON_TRANSPORT,
                                      "rank %u: %s rkey does not unpack: %s", r, duet__pool_name[k],
                                      ucs_status_string(us));
                duet__xfer_send_abort_x(ctx, x, DUET_XFER_REASON_TRANSPORT);
                return;
            }
        }
    }
    for (uint32_t r = 0; r < x->n_ranks; r++) {
        if (duet__xfer_send_hello(ctx, x->ranks[r].peer, x->ranks[r].xfer_id) < 0) {
            duet__xfer_set_reason(x, DUET_XFER_REASON_TRANSPORT, "hello to rank %u: %s", r,
                                  duet_error_last());
            duet__xfer_send_abort_x(ctx, x, DUET_XFER_REASON_TRANSPORT);
            return;
        }
    }
    duet__xfer_set_state(x, DUET__X_SENDING);
    duet__send_pump(ctx, x);
}

void duet__xfer_send_step(duet_xfer_ctx_t *ctx, duet__xfer_t *x, uint64_t now_ns)
{
    if (x->state == DUET__X_ABORTING) {
        if (x->pending == 0) {
            duet__xfer_finish(ctx, x, DUET_XFER_OUTCOME_ABORTED);
        } else if (now_ns >= x->abort_deadline_ns && x->abort_stage == 0) {
            /* The abort's flushes did not end: fail those endpoints (the sweep force-closes
             * them, which completes what was outstanding) and wait one more grace period. */
            DUET_RLOG_WARN(x->req_id,
                           "xfer %016llx: abort not flushed after %u ms; failing its endpoints",
                           (unsigned long long)x->id, ctx->abort_grace_ms);
            for (uint32_t r = 0; r < x->n_ranks; r++) {
                duet__peer_t *p = &ctx->peers[x->ranks[r].peer];
                if (p->state == DUET__PEER_READY || p->state == DUET__PEER_CONNECTING) {
                    p->state = DUET__PEER_FAILED;
                    p->err = UCS_ERR_TIMED_OUT;
                }
            }
            x->abort_stage = 1;
            x->abort_deadline_ns = now_ns + (uint64_t)ctx->abort_grace_ms * 1000000ull;
        } else if (now_ns >= x->abort_deadline_ns) {
            /* Endpoints without error handling cannot be force-closed: report anyway. The slot
             * is not reused until its last request completes (slot_take checks pending). */
            DUET_RLOG_WARN(x->req_id, "xfer %016llx: %u operations still pending; reporting",
                           (unsigned long long)x->id, x->pending);
            duet__xfer_finish(ctx, x, DUET_XFER_OUTCOME_ABORTED);
        }
        return;
    }
    if (x->abort_pending) {
        duet__xfer_send_abort_x(ctx, x, DUET_XFER_REASON_PEER_ABORTED);
        return;
    }
    for (uint32_t r = 0; r < x->n_ranks; r++) {
        duet__peer_t *p = &ctx->peers[x->ranks[r].peer];
        if (p->state == DUET__PEER_FAILED || p->state == DUET__PEER_CLOSING) {
            duet__xfer_set_reason(
                x, DUET_XFER_REASON_PEER_FAILED, "endpoint to rank %u failed: %s", r,
                ucs_status_string(p->err != UCS_OK ? p->err : UCS_ERR_CONNECTION_RESET));
            duet__xfer_send_abort_x(ctx, x, DUET_XFER_REASON_PEER_FAILED);
            return;
        }
    }
    if (x->op_err != UCS_OK) {
        duet__xfer_set_reason(x, duet__send_err_reason(x->op_err), "operation failed: %s",
                              ucs_status_string(x->op_err));
        duet__xfer_send_abort_x(ctx, x, x->reason);
        return;
    }
    if (now_ns >= x->deadline_ns) {
        duet__xfer_set_reason(x, DUET_XFER_REASON_DEADLINE, "deadline passed in state %s",
                              duet__xfer_state_str(x->state));
        duet__xfer_send_abort_x(ctx, x, DUET_XFER_REASON_DEADLINE);
        return;
    }
    switch (x->state) {
    case DUET__X_CONNECTING:
        if (duet__send_peers_ready(ctx, x))
            duet__send_go(ctx, x);
        break;
    case DUET__X_FLUSHING:
        if (x->flush_left == 0 && !x->done_sent) {
            x->done_sent = true;
            x->done_left = x->n_ranks;
            for (uint32_t r = 0; r < x->n_ranks; r++) {
                if (duet__xfer_send_done(ctx, x, x->ranks[r].peer, x->ranks[r].xfer_id,
                                         x->plan.bytes_per_rank[r], x->checksum,
                                         x->ranks[r].checksum) < 0) {
                    duet__xfer_set_reason(x, DUET_XFER_REASON_TRANSPORT,
                                          "completion message to rank %u: %s", r,
                                          duet_error_last());
                    duet__xfer_send_abort_x(ctx, x, DUET_XFER_REASON_TRANSPORT);
                    return;
                }
            }
        }
        if (x->done_sent && x->done_left == 0 && x->pending == 0 && x->op_err == UCS_OK)
            duet__xfer_finish(ctx, x, DUET_XFER_OUTCOME_DONE);
        break;
    default:
        break;
    }
}

void duet__xfer_send_on_am(duet_xfer_ctx_t *ctx, const uint8_t *hdr, const void *data, size_t len)
{
    uint16_t kind;
    uint64_t id;
    if (!duet__xfer_hdr_read(hdr, DUET__XFER_AM_HDR_BYTES, &kind, &id) ||
        kind != DUET__XFER_AM_ENVELOPE) {
        DUET_LOG_WARN("xfer: control message with a bad header dropped");
        return;
    }
    duet__arena_t arena;
    Duet__Envelope *env = duet__xfer_env_unpack(&arena, data, len);
    if (env == NULL || env->body_case != DUET__ENVELOPE__BODY_XFER_ABORT ||
        env->xfer_abort->transfer_id != id) {
        DUET_LOG_WARN("xfer: malformed abort for transfer %016llx dropped", (unsigned long long)id);
        return;
    }
    duet__xfer_t *x = duet__xfer_find_rank_id(ctx, id);
    if (x == NULL || x->state == DUET__X_ABORTING || x->abort_pending) {
        DUET_LOG_DEBUG("xfer: abort for ended transfer %016llx ignored", (unsigned long long)id);
        return;
    }
    uint32_t r = 0;
    while (r < x->n_ranks && x->ranks[r].xfer_id != id)
        r++;
    duet__xfer_set_reason(x, DUET_XFER_REASON_PEER_ABORTED, "receiver rank %u aborted (%s): %s", r,
                          duet__xfer_proto_reason_str(env->xfer_abort->reason),
                          env->xfer_abort->message != NULL ? env->xfer_abort->message : "");
    x->abort_pending = true;
    ctx->dirty = true;
}

/* Undo a start that failed half way (no callback: the caller gets the error). */
static void duet__send_unwind(duet_xfer_ctx_t *ctx, duet__xfer_t *x)
{
    duet__xfer_drop_ranks(ctx, x);
    duet__xfer_slot_release(ctx, x);
}

duet_status_t duet_xfer_send_start(duet_xfer_ctx_t *ctx, const duet_xfer_send_args_t *a,
                                   duet_xfer_id_t *id_p)
{
    const duet_xfer_layout_t *l = &a->layout;
    uint32_t n = a->n_ranks;
    uint64_t now_ms = duet_xfer_now_unix_ms();
    duet_status_t st;

    if (a->cb == NULL)
        return DUET_FAIL(DUET_ERR_INVALID, "xfer send: no outcome callback");
    if (n == 0 || n > DUET_XFER_MAX_RANKS || a->reservations == NULL)
        return DUET_FAIL(DUET_ERR_RANGE, "xfer send: %u reservations (1..%u)", n,
                         DUET_XFER_MAX_RANKS);
    if (a->src.n_pages > ctx->max_pages)
        return DUET_FAIL(DUET_ERR_RANGE, "xfer send: %u source pages (max_pages %u)",
                         a->src.n_pages, ctx->max_pages);
    if (a->src.n_pages > 0 && a->src.pages == NULL)
        return DUET_FAIL(DUET_ERR_INVALID, "xfer send: %u source pages but no page list",
                         a->src.n_pages);
    if ((uint64_t)l->n_mla_layers + l->n_kda_layers > DUET__XFER_MAX_GROUPS)
        return DUET_FAIL(DUET_ERR_RANGE, "xfer send: %u + %u layers (max %u)", l->n_mla_layers,
                         l->n_kda_layers, DUET__XFER_MAX_GROUPS);
    bool want_kda = a->src.kda_slot >= 0 && l->n_kda_layers > 0;
    uint64_t deadline = a->deadline_unix_ms != 0 ? a->deadline_unix_ms : UINT64_MAX;

    duet_xfer_layout_t dst_layout[DUET_XFER_MAX_RANKS];
    duet_xfer_dest_t dst[DUET_XFER_MAX_RANKS];
    const uint32_t kv_ranks = duet_xfer_kv_ranks_or(a->reservations[0].kv_ranks, n);
    for (uint32_t r = 0; r < n; r++) {
        const duet_xfer_reservation_t *rv = &a->reservations[r];
        if ((st = duet_xfer_reservation_validate(rv, now_ms)) < 0) {
            char why[256];
            snprintf(why, sizeof(why), "%s", duet_error_last()); /* FAIL rewrites the detail */
            return DUET_FAIL(st, "xfer send: reservation of rank %u refused: %s", r, why);
        }
        if (rv->rank != r || rv->group_size != n)
            return DUET_FAIL(DUET_ERR_INVALID,
                             "xfer send: reservation [%u] is rank %u of %u, expected rank %u of %u",
                             r, rv->rank, rv->group_size, r, n);
        if (duet_xfer_kv_ranks_or(rv->kv_ranks, n) != kv_ranks)
            return DUET_FAIL(DUET_ERR_INVALID,
                             "xfer send: rank %u deals the KV pages over %u ranks, rank 0 over %u",
                             r, duet_xfer_kv_ranks_or(rv->kv_ranks, n), kv_ranks);
        if (rv->n_tokens != a->src.n_tokens)
            return DUET_FAIL(DUET_ERR_INVALID,
                             "xfer send: rank %u reserved for %llu tokens, the source has %llu", r,
                             (unsigned long long)rv->n_tokens, (unsigned long long)a->src.n_tokens);
        if (rv->n_replay != a->src.n_replay)
            return DUET_FAIL(DUET_ERR_INVALID,
                             "xfer send: rank %u reserved for %u replay rows, the source has %u", r,
                             rv->n_replay, a->src.n_replay);
        if (rv->n_pages > ctx->max_pages)
            return DUET_FAIL(DUET_ERR_RANGE, "xfer send: rank %u reserved %u pages (max_pages %u)",
                             r, rv->n_pages, ctx->max_pages);
        if (a->req_id != 0 && rv->request_id != a->req_id)
            return DUET_FAIL(DUET_ERR_INVALID,
                             "xfer send: rank %u reservation is for request %llu, not %llu", r,
                             (unsigned long long)rv->request_id, (unsigned long long)a->req_id);
        for (uint32_t q = 0; q < r; q++)
            if (a->reservations[q].transfer_id == rv->transfer_id)
                return DUET_FAIL(DUET_ERR_INVALID,
                                 "xfer send: ranks %u and %u share transfer id %016llx", q, r,
                                 (unsigned long long)rv->transfer_id);
        if (want_kda != (rv->kda_slot >= 0))
            return DUET_FAIL(
                DUET_ERR_INVALID, "xfer send: rank %u %s a KDA slot but the source %s KDA state", r,
                rv->kda_slot >= 0 ? "reserved" : "did not reserve", want_kda ? "has" : "has no");
        if (rv->deadline_unix_ms < deadline)
            deadline = rv->deadline_unix_ms;
        dst_layout[r] = rv->layout;
        duet_xfer_reservation_dest(rv, &dst[r]);
    }
    if (deadline <= now_ms)
        return DUET_FAIL(DUET_ERR_TIMEOUT, "xfer send: stale: the deadline passed %llu ms ago",
                         (unsigned long long)(now_ms - deadline));
    if (a->src.n_pages > 0 && ctx->pools[DUET_XFER_POOL_KV].memh == NULL)
        return DUET_FAIL(DUET_ERR_INVALID, "xfer send: the KV pool is not registered");
    if (want_kda && ctx->pools[DUET_XFER_POOL_KDA].memh == NULL)
        return DUET_FAIL(DUET_ERR_INVALID, "xfer send: the KDA pool is not registered");
    const bool want_replay = a->src.n_replay > 0;
    if (want_replay && ctx->pools[DUET_XFER_POOL_REPLAY].memh == NULL)
        return DUET_FAIL(DUET_ERR_INVALID,
                         "xfer send: %u replay rows but the replay pool is not "
                         "registered",
                         a->src.n_replay);

    duet__xfer_t *x = duet__xfer_slot_take(ctx, DUET_XFER_ROLE_SEND);
    if (x == NULL)
        return DUET_FAIL(DUET_ERR_BUSY, "xfer send: transfer table full (%u)", ctx->cap);
    if (a->src.n_pages > 0)
        memcpy(x->pages, a->src.pages, sizeof(*x->pages) * a->src.n_pages);
    x->n_pages = a->src.n_pages;
    duet_xfer_src_t src = a->src;
    src.pages = x->pages;
    if ((st = duet_xfer_plan_build(l, &src, dst_layout, dst, n, kv_ranks, &x->plan)) < 0) {
        duet__xfer_slot_release(ctx, x);
        return st;
    }
    /* The plan's ranges must fall inside our pools and each rank's advertised pools. */
    for (size_t i = 0; i < x->plan.n_entries; i++) {
        const duet_xfer_entry_t *e = &x->plan.entries[i];
        if (e->kind >= DUET_XFER_N_POOLS || e->rank >= n) { /* the plan makes no such entry */
            duet__xfer_slot_release(ctx, x);
            return DUET_FAIL(DUET_ERR_INTERNAL, "xfer send: plan entry of kind %u to rank %u",
                             e->kind, e->rank);
        }
        const duet_xfer_reservation_t *rv = &a->reservations[e->rank];
        const uint64_t adv[DUET_XFER_N_POOLS] = {rv->kv_bytes, rv->kda_bytes, rv->replay_bytes};
        const uint64_t dst_bytes = adv[e->kind];
        if (e->src_off + e->len > ctx->pools[e->kind].bytes || e->src_off + e->len < e->len) {
            duet__xfer_slot_release(ctx, x);
            return DUET_FAIL(DUET_ERR_RANGE,
                             "xfer send: source range [%llu, +%llu) outside the local %s pool",
                             (unsigned long long)e->src_off, (unsigned long long)e->len,
                             duet__pool_name[e->kind]);
        }
        if (e->dst_off + e->len > dst_bytes || e->dst_off + e->len < e->len) {
            duet__xfer_slot_release(ctx, x);
            return DUET_FAIL(DUET_ERR_RANGE,
                             "xfer send: rank %u destination range [%llu, +%llu) outside its "
                             "advertised %s pool (%llu bytes)",
                             e->rank, (unsigned long long)e->dst_off, (unsigned long long)e->len,
                             duet__pool_name[e->kind], (unsigned long long)dst_bytes);
        }
    }

    /* Endpoints, and the packed rkeys: they are unpacked only once every endpoint is up
     * (duet__send_go). Unpacking maps the receiver's shared memory, and for a receiver that died
     * meanwhile UCX 1.13 crashed in the failed unpack's cleanup (uct_rkey_release, seen by
     * bench/soak on a context worker); a dead receiver's endpoint fails its first flush instead. */
    size_t key_bytes = 0;
    for (uint32_t r = 0; r < n; r++) {
        x->ranks[r].peer = -1;
        for (int k = 0; k < DUET_XFER_N_POOLS; k++) {
            x->ranks[r].rkey[k] = NULL;
            x->ranks[r].key[k] = NULL;
        }
        const duet_xfer_reservation_t *rv = &a->reservations[r];
        key_bytes += rv->kv_rkey.len + rv->kda_rkey.len + rv->replay_rkey.len;
    }
    x->keys = malloc(key_bytes > 0 ? key_bytes : 1);
    if (x->keys == NULL) {
        duet__xfer_slot_release(ctx, x);
        return DUET_FAIL(DUET_ERR_NOMEM, "xfer send: %zu bytes of rkeys", key_bytes);
    }
    x->n_ranks = n;
    size_t key_at = 0;
    for (uint32_t r = 0; r < n; r++) {
        const duet_xfer_reservation_t *rv = &a->reservations[r];
        duet__rank_t *rk = &x->ranks[r];
        rk->xfer_id = rv->transfer_id;
        rk->base[DUET_XFER_POOL_KV] = rv->kv_base;
        rk->base[DUET_XFER_POOL_KDA] = rv->kda_base;
        rk->base[DUET_XFER_POOL_REPLAY] = rv->replay_base;
        rk->checksum = 0;
        if ((st = duet__xfer_peer_get(ctx, rv->worker_address.data, rv->worker_address.len,
                                      &rk->peer)) < 0) {
            duet__send_unwind(ctx, x);
            return st;
        }
        const duet_xfer_bytes_t *keys[DUET_XFER_N_POOLS] = {&rv->kv_rkey, &rv->kda_rkey,
                                                            &rv->replay_rkey};
        for (int k = 0; k < DUET_XFER_N_POOLS; k++) {
            if (keys[k]->len == 0 || (k == DUET_XFER_POOL_KDA && !want_kda) ||
                (k == DUET_XFER_POOL_REPLAY && !want_replay))
                continue;
            memcpy(x->keys + key_at, keys[k]->data, keys[k]->len);
            rk->key[k] = x->keys + key_at;
            rk->key_len[k] = (uint32_t)keys[k]->len;
            key_at += keys[k]->len;
        }
    }

    x->req_id = a->req_id != 0 ? a->req_id : a->reservations[0].request_id;
    x->cb = a->cb;
    x->user = a->user;
    x->checksum = a->checksum && duet__xfer_pools_on_host(ctx); /* see xfer.h: device pools */
    x->deadline_ns = x->t0_ns + (deadline - now_ms) * 1000000ull;
    x->n_mla = l->n_mla_layers;
    x->n_groups = l->n_mla_layers + l->n_kda_layers;
    if (!want_kda)
        for (uint32_t g = x->n_mla; g < x->n_groups; g++)
            DUET__BIT_SET(x->ready, g); /* nothing to send for these: they are "ready" */
    DUET_RLOG_DEBUG(x->req_id, "xfer %016llx send: CONNECTING (%u ranks, %zu puts, %llu bytes)",
                    (unsigned long long)x->id, n, x->plan.n_entries,
                    (unsigned long long)x->plan.total_bytes);
    if (duet__send_peers_ready(ctx, x))
        duet__send_go(ctx, x);
    *id_p = x->id;
    return DUET_OK;
}

static duet__xfer_t *duet__send_live(duet_xfer_ctx_t *ctx, duet_xfer_id_t id)
{
    duet__xfer_t *x = duet__xfer_find(ctx, DUET_XFER_ROLE_SEND, id);
    if (x == NULL || x->state == DUET__X_ABORTING)
        return NULL;
    return x;
}

static void duet__send_mark(duet_xfer_ctx_t *ctx, duet__xfer_t *x, uint32_t g)
{
    if (DUET__BIT_TEST(x->ready, g))
        return;
    DUET__BIT_SET(x->ready, g);
}

duet_status_t duet_xfer_send_layer_ready(duet_xfer_ctx_t *ctx, duet_xfer_id_t id, uint32_t layer)
{
    duet__xfer_t *x = duet__send_live(ctx, id);
    if (x == NULL)
        return duet_error_set(DUET_ERR_NOT_FOUND, "xfer send: transfer %016llx has ended",
                              (unsigned long long)id);
    if (layer >= x->n_mla)
        return DUET_FAIL(DUET_ERR_RANGE, "xfer send: MLA layer %u of %u", layer, x->n_mla);
    duet__send_mark(ctx, x, layer);
    if (x->state == DUET__X_SENDING)
        duet__send_pump(ctx, x);
    return DUET_OK;
}

bool duet_xfer_send_connecting(duet_xfer_ctx_t *ctx, duet_xfer_id_t id)
{
    const duet__xfer_t *x = duet__send_live(ctx, id);
    return x != NULL && x->state == DUET__X_CONNECTING;
}

duet_status_t duet_xfer_send_kda_ready(duet_xfer_ctx_t *ctx, duet_xfer_id_t id)
{
    duet__xfer_t *x = duet__send_live(ctx, id);
    if (x == NULL)
        return duet_error_set(DUET_ERR_NOT_FOUND, "xfer send: transfer %016llx has ended",
                              (unsigned long long)id);
    for (uint32_t g = x->n_mla; g < x->n_groups; g++)
        duet__send_mark(ctx, x, g);
    if (x->state == DUET__X_SENDING)
        duet__send_pump(ctx, x);
    return DUET_OK;
}

duet_status_t duet_xfer_send_cancel(duet_xfer_ctx_t *ctx, duet_xfer_id_t id, const char *message)
{
    duet__xfer_t *x = duet__send_live(ctx, id);
    if (x == NULL)
        return duet_error_set(DUET_ERR_NOT_FOUND, "xfer send: transfer %016llx has ended",
                              (unsigned long long)id);
    duet__xfer_set_reason(x, DUET_XFER_REASON_CANCELLED, "%s",
                          message != NULL ? message : "cancelled by the owner");
    duet__xfer_send_abort_x(ctx, x, DUET_XFER_REASON_CANCELLED);
    return DUET_OK;
}
