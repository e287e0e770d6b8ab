/*
 * Receiver side of a transfer: RESERVED -> RECEIVING -> DONE | ABORTED (see xfer.h).
 *
 * The receiver never touches the bytes while they arrive: the sender writes them with RMA puts.
 * What the receiver does is bookkeeping with a deadline: it learns the sender's address from the
 * hello (and opens an endpoint back only to send an abort), and ends on the first of XferDone,
 * XferAbort, the deadline, the sender's death, or the owner's cancel. The outcome goes to the owner
 * at once so it can return the pages to its pools.
 *
 * The checksum of a rank's bytes is recomputed from the destination pages in the order the
 * sender's plan writes them (transfer/plan.h): for each MLA layer, this rank's tokens in sequence
 * order (its local pages in order, full pages then the partial last one), then each KDA layer's
 * whole block (S, then the q, k, v conv windows) followed by that layer's replay rows (a moved
 * request's). That is "destination bytes in plan order".
 */
#include <stdio.h>
#include <string.h>

#include "common/log.h"
#include "transfer/xfer_recv_impl.h"

/* Tokens of KV that rank `rank` of a group of `n` holds when the group receives n_tokens, and
 * how many local pages they take (global page j lives on the ranks of KV shard j % kv_ranks;
 * transfer/plan.h). kv_ranks resolved and checked against n. */
static void duet__rank_tokens(uint64_t n_tokens, uint32_t page_tokens, uint32_t rank, uint32_t n,
                              uint32_t kv_ranks, uint64_t *tokens_p, uint64_t *pages_p)
{
    uint64_t g_pages = (n_tokens + page_tokens - 1) / page_tokens, tokens = 0, pages = 0;
    for (uint64_t j = duet_xfer_kv_shard_of(rank, n, kv_ranks); j < g_pages; j += kv_ranks) {
        uint64_t left = n_tokens - j * page_tokens;
        tokens += left < page_tokens ? left : page_tokens;
        pages++;
    }
    *tokens_p = tokens;
    *pages_p = pages;
}

duet_status_t duet_xfer_recv_reserve(duet_xfer_ctx_t *ctx, const duet_xfer_recv_args_t *a,
                                     duet_xfer_reservation_t *res_p)
{
    const duet_xfer_layout_t *l = &a->layout;
    uint64_t now_ms = duet_xfer_now_unix_ms();

    if (a->cb == NULL)
        return DUET_FAIL(DUET_ERR_INVALID, "xfer reserve: no outcome callback");
    if (a->group_size == 0 || a->group_size > DUET_XFER_MAX_RANKS || a->rank >= a->group_size)
        return DUET_FAIL(DUET_ERR_RANGE, "xfer reserve: rank %u of a group of %u", a->rank,
                         a->group_size);
    const uint32_t kv_ranks = duet_xfer_kv_ranks_or(a->kv_ranks, a->group_size);
    if (kv_ranks > a->group_size || a->group_size % kv_ranks != 0)
        return DUET_FAIL(DUET_ERR_RANGE,
                         "xfer reserve: KV pages dealt over %u ranks of a group of %u (must divide "
                         "it)",
                         kv_ranks, a->group_size);
    if (a->n_pages > ctx->max_pages)
        return DUET_FAIL(DUET_ERR_RANGE, "xfer reserve: %u pages (max_pages %u)", a->n_pages,
                         ctx->max_pages);
    if (a->n_pages > 0 && a->pages == NULL)
        return DUET_FAIL(DUET_ERR_INVALID, "xfer reserve: %u pages but no page list", a->n_pages);
    if (l->page_tokens == 0 || l->token_bytes == 0 ||
        (uint64_t)l->n_mla_layers + l->n_kda_layers > DUET__XFER_MAX_GROUPS)
        return DUET_FAIL(DUET_ERR_INVALID,
                         "xfer reserve: layout page_tokens %u, token_bytes %u, %u + %u layers",
                         l->page_tokens, l->token_bytes, l->n_mla_layers, l->n_kda_layers);
    if (a->deadline_unix_ms <= now_ms)
        return DUET_FAIL(DUET_ERR_TIMEOUT, "xfer reserve: deadline %llu ms is not in the future",
                         (unsigned long long)a->deadline_unix_ms);

    /* The pages and slot must lie inside the registered pools, as the layout describes them. */
    uint64_t page_bytes = duet_xfer_layout_kv_page_bytes(l);
    if (a->n_pages > 0) {
        if (ctx->pools[DUET_XFER_POOL_KV].memh == NULL)
            return DUET_FAIL(DUET_ERR_INVALID, "xfer reserve: the KV pool is not registered");
        for (uint32_t i = 0; i < a->n_pages; i++) {
            int32_t p = a->pages[i];
            if (p < 0 || ((uint64_t)p + 1) * page_bytes > ctx->pools[DUET_XFER_POOL_KV].bytes)
                return DUET_FAIL(DUET_ERR_RANGE,
                                 "xfer reserve: page %d (entry %u) outside the KV pool "
                                 "(%zu bytes, %llu per page)",
                                 p, i, ctx->pools[DUET_XFER_POOL_KV].bytes,
                                 (unsigned long long)page_bytes);
        }
    }
    uint64_t slot_bytes = l->n_kda_layers > 0 ? duet_xfer_layout_kda_slot_bytes(l) : 0;
    if (a->kda_slot >= 0) {
        if (ctx->pools[DUET_XFER_POOL_KDA].memh == NULL || slot_bytes == 0)
            return DUET_FAIL(DUET_ERR_INVALID,
                             "xfer reserve: KDA slot %d but no KDA pool registered or no KDA "
                             "layers in the layout",
                             a->kda_slot);
        if (((uint64_t)a->kda_slot + 1) * slot_bytes > ctx->pools[DUET_XFER_POOL_KDA].bytes)
            return DUET_FAIL(DUET_ERR_RANGE, "xfer reserve: KDA slot %d outside the KDA pool",
                             a->kda_slot);
    }
    uint64_t replay_bytes = 0; /* what the replay rows add to the transfer */
    if (a->n_replay > 0) {
        if (a->kda_slot < 0 || ctx->pools[DUET_XFER_POOL_REPLAY].memh == NULL)
            return DUET_FAIL(DUET_ERR_INVALID, "xfer reserve: %u replay rows but %s", a->n_replay,
                             a->kda_slot < 0 ? "no KDA slot" : "no replay pool registered");
        uint64_t rs = duet_xfer_layout_replay_slot_bytes(l), end;
        if (a->n_replay > l->replay_rows || rs == UINT64_MAX ||
            __builtin_mul_overflow((uint64_t)a->kda_slot + 1, rs, &end) ||
            end > ctx->pools[DUET_XFER_POOL_REPLAY].bytes)
            return DUET_FAIL(DUET_ERR_RANGE,
                             "xfer reserve: %u replay rows of KDA slot %d outside the replay pool "
                             "(layout.replay_rows %u)",
                             a->n_replay, a->kda_slot, l->replay_rows);
        replay_bytes = duet_xfer_layout_replay_bytes(l, a->n_replay);
    }
    uint64_t tokens, need_pages;
    duet__rank_tokens(a->n_tokens, l->page_tokens, a->rank, a->group_size, kv_ranks, &tokens,
                      &need_pages);
    if (need_pages > a->n_pages)
        return DUET_FAIL(
            DUET_ERR_RANGE, "xfer reserve: %llu tokens need %llu pages on rank %u, %u reserved",
            (unsigned long long)a->n_tokens, (unsigned long long)need_pages, a->rank, a->n_pages);

    duet__xfer_t *x = duet__xfer_slot_take(ctx, DUET_XFER_ROLE_RECV);
    if (x == NULL)
        return DUET_FAIL(DUET_ERR_BUSY, "xfer reserve: transfer table full (%u)", ctx->cap);
    x->req_id = a->req_id;
    x->cb = a->cb;
    x->user = a->user;
    x->layout = *l;
    if (a->n_pages > 0)
        memcpy(x->pages, a->pages, sizeof(*x->pages) * a->n_pages);
    x->n_pages = a->n_pages;
    x->kda_slot = a->kda_slot;
    x->n_tokens = a->n_tokens;
    x->n_replay = a->n_replay;
    x->rank = a->rank;
    x->group_size = a->group_size;
    x->kv_ranks = kv_ranks;
    x->deadline_unix_ms = a->deadline_unix_ms;
    x->deadline_ns = x->t0_ns + (a->deadline_unix_ms - now_ms) * 1000000ull;
    x->expect_bytes = tokens * l->token_bytes * l->n_mla_layers +
                      (a->kda_slot >= 0 ? slot_bytes : 0) + replay_bytes;

    duet_xfer_reservation_t r = {
        .version = DUET_XFER_RESERVATION_VERSION,
        .transfer_id = x->id,
        .request_id = a->req_id,
        .rank = a->rank,
        .group_size = a->group_size,
        .kv_ranks = kv_ranks,
        .worker_address = {(const uint8_t *)ctx->addr, ctx->addr_len},
        .layout = *l,
        .pages = x->pages,
        .n_pages = a->n_pages,
        .kda_slot = a->kda_slot,
        .n_tokens = a->n_tokens,
        .deadline_unix_ms = a->deadline_unix_ms,
        .n_replay = a->n_replay,
    };
    if (ctx->pools[DUET_XFER_POOL_KV].memh != NULL) {
        r.kv_rkey = (duet_xfer_bytes_t){ctx->pools[DUET_XFER_POOL_KV].rkey,
                                        ctx->pools[DUET_XFER_POOL_KV].rkey_len};
        r.kv_base = (uint64_t)(uintptr_t)ctx->pools[DUET_XFER_POOL_KV].base;
        r.kv_bytes = ctx->pools[DUET_XFER_POOL_KV].bytes;
    }
    if (a->kda_slot >= 0) {
        r.kda_rkey = (duet_xfer_bytes_t){ctx->pools[DUET_XFER_POOL_KDA].rkey,
                                         ctx->pools[DUET_XFER_POOL_KDA].rkey_len};
        r.kda_base = (uint64_t)(uintptr_t)ctx->pools[DUET_XFER_POOL_KDA].base;
        r.kda_bytes = ctx->pools[DUET_XFER_POOL_KDA].bytes;
    }
    if (a->n_replay > 0) { /* only then: a reservation without replay rows stays as it was */
        r.replay_rkey = (duet_xfer_bytes_t){ctx->pools[DUET_XFER_POOL_REPLAY].rkey,
                                            ctx->pools[DUET_XFER_POOL_REPLAY].rkey_len};
        r.replay_base = (uint64_t)(uintptr_t)ctx->pools[DUET_XFER_POOL_REPLAY].base;
        r.replay_bytes = ctx->pools[DUET_XFER_POOL_REPLAY].bytes;
    }
    duet_status_t st = duet_xfer_reservation_validate(&r, now_ms);
    if (st < 0) {
        char why[256];
        snprintf(why, sizeof(why), "%s", duet_error_last()); /* FAIL rewrites the detail */
        duet__xfer_slot_release(ctx, x);
        return DUET_FAIL(st, "xfer reserve: %s", why);
    }
    DUET_RLOG_DEBUG(x->req_id,
                    "xfer %016llx recv: RESERVED (%u pages, slot %d, %u replay rows, %llu bytes "
                    "due)",
                    (unsigned long long)x->id, x->n_pages, x->kda_slot, x->n_replay,
                    (unsigned long long)x->expect_bytes);
    *res_p = r;
    return DUET_OK;
}

duet_status_t duet_xfer_recv_cancel(duet_xfer_ctx_t *ctx, duet_xfer_id_t id, const char *message)
{
    duet__xfer_t *x = duet__xfer_find(ctx, DUET_XFER_ROLE_RECV, id);
    if (x == NULL)
        return duet_error_set(DUET_ERR_NOT_FOUND, "xfer cancel: transfer %016llx has ended",
                              (unsigned long long)id);
    duet__xfer_set_reason(x, DUET_XFER_REASON_CANCELLED, "%s",
                          message != NULL ? message : "cancelled by the owner");
    duet__xfer_recv_abort(ctx, x, DUET_XFER_REASON_CANCELLED, true);
    return DUET_OK;
}

void duet__xfer_recv_abort(duet_xfer_ctx_t *ctx, duet__xfer_t *x, duet_xfer_reason_t reason,
                           bool tell_peer)
{
    duet__xfer_set_reason(x, reason, "%s", duet_xfer_reason_str(reason));
    if (tell_peer && x->hello_len > 0 && !ctx->recv_no_abort_back) {
        int32_t p;
        if (duet__xfer_peer_get(ctx, x->hello_addr, x->hello_len, &p) == DUET_OK) {
            (void)duet__xfer_send_abort(ctx, NULL, p, DUET__XFER_AM_TO_SEND, x->id, x->reason,
                                        x->msg);
            duet__xfer_peer_put(ctx, p); /* stays cached; the message keeps flowing */
        } else {
            DUET_RLOG_WARN(x->req_id, "xfer %016llx: cannot tell the sender: %s",
                           (unsigned long long)x->id, duet_error_last());
        }
    }
    duet__xfer_finish(ctx, x, DUET_XFER_OUTCOME_ABORTED);
}

/* XXH3-64 of this rank's destination bytes in plan order (see the file comment). */
static uint64_t duet__recv_checksum(duet_xfer_ctx_t *ctx, const duet__xfer_t *x)
{
    const duet_xfer_layout_t *l = &x->layout;
    const uint8_t *kv = ctx->pools[DUET_XFER_POOL_KV].base;
    const uint8_t *kda = ctx->pools[DUET_XFER_POOL_KDA].base;
    uint64_t tokens, pages;
    duet__rank_tokens(x->n_tokens, l->page_tokens, x->rank, x->group_size, x->kv_ranks, &tokens,
                      &pages);
    XXH3_64bits_reset(ctx->xxh);
    for (uint32_t layer = 0; layer < l->n_mla_layers; layer++) {
        uint64_t left = tokens;
        for (uint32_t i = 0; i < x->n_pages && left > 0; i++) {
            uint64_t t = left < l->page_tokens ? left : l->page_tokens;
            uint64_t off = (((uint64_t)x->pages[i] * l->n_mla_layers + layer) * l->page_tokens) *
                           l->token_bytes;
            XXH3_64bits_update(ctx->xxh, kv + off, t * l->token_bytes);
            left -= t;
        }
    }
    if (x->kda_slot >= 0 && l->n_kda_layers > 0) {
        const uint64_t slot_bytes = duet_xfer_layout_kda_slot_bytes(l);
        const uint64_t layer_bytes = slot_bytes / l->n_kda_layers;
        const uint8_t *replay = ctx->pools[DUET_XFER_POOL_REPLAY].base;
        const duet_replay_layout_t rl = duet_xfer_layout_replay(l);
        uint64_t row = 0; /* the replay region was checked against the pool at reserve */
        (void)duet_replay_layout_row_bytes(&rl, &row);
        for (uint32_t layer = 0; layer < l->n_kda_layers; layer++) {
            XXH3_64bits_update(ctx->xxh,
                               kda + (uint64_t)x->kda_slot * slot_bytes + layer * layer_bytes,
                               layer_bytes);
            uint64_t off = 0;
            if (x->n_replay > 0 &&
                duet_replay_layout_row_offset(&rl, (uint64_t)x->kda_slot, layer, 0, &off))
                XXH3_64bits_update(ctx->xxh, replay + off, row * x->n_replay);
        }
    }
    return XXH3_64bits_digest(ctx->xxh);
}

void duet__xfer_recv_step(duet_xfer_ctx_t *ctx, duet__xfer_t *x, uint64_t now_ns)
{
    if (x->hello_pending) {
        /* The endpoint back to the sender is opened only when an abort must travel back: with
         * UCX 1.13 on shared memory, receivers of a CP group opening endpoints to the sender
         * while its puts arrive crashed inside UCX (ucp_ep_create / ucp_put_handler asserts). */
        x->hello_pending = false;
        if (x->state == DUET__X_RESERVED)
            duet__xfer_set_state(x, DUET__X_RECEIVING);
    }
    if (x->abort_pending) {
        duet__xfer_recv_abort(ctx, x, DUET_XFER_REASON_PEER_ABORTED, false);
        return;
    }
    if (x->done_pending) {
        x->done_pending = false;
        if (x->done_bytes != x->expect_bytes) {
            duet__xfer_set_reason(x, DUET_XFER_REASON_REFUSED,
                                  "sender reported %llu bytes, the reservation expects %llu",
                                  (unsigned long long)x->done_bytes,
                                  (unsigned long long)x->expect_bytes);
            duet__xfer_recv_abort(ctx, x, DUET_XFER_REASON_REFUSED, false);
            return;
        }
        x->bytes = x->done_bytes;
        if (x->done_has_checksum && !duet__xfer_pools_on_host(ctx)) {
            /* the CPU cannot read device pools: delivered, but unverified (xfer.h) */
            DUET_LOG_DEBUG("xfer: transfer %llx: checksum not verified (device pools)",
                           (unsigned long long)x->id);
            x->done_has_checksum = false;
        }
        if (x->done_has_checksum) {
            uint64_t mine = duet__recv_checksum(ctx, x);
            if (mine != x->done_checksum) {
                duet__xfer_set_reason(x, DUET_XFER_REASON_CHECKSUM,
                                      "checksum mismatch: sender %016llx, received bytes %016llx",
                                      (unsigned long long)x->done_checksum,
                                      (unsigned long long)mine);
                duet__xfer_recv_abort(ctx, x, DUET_XFER_REASON_CHECKSUM, false);
                return;
            }
        }
        duet__xfer_finish(ctx, x, DUET_XFER_OUTCOME_DONE);
        return;
    }
    if (now_ns >= x->deadline_ns) {
        duet__xfer_set_reason(x, DUET_XFER_REASON_DEADLINE,
                              "deadline passed in state %s (%.0f ms after the reservation)",
                              duet__xfer_state_str(x->state), (now_ns - x->t0_ns) * 1e-6);
        duet__xfer_recv_abort(ctx, x, DUET_XFER_REASON_DEADLINE, true);
    }
}

void duet__xfer_recv_on_am(duet_xfer_ctx_t *ctx, const uint8_t *hdr, const void *data, size_t len,
                           ucp_ep_h reply_ep)
{
    uint16_t kind;
    uint64_t id;
    if (!duet__xfer_hdr_read(hdr, DUET__XFER_AM_HDR_BYTES, &kind, &id)) {
        DUET_LOG_WARN("xfer: control message with a bad header dropped");
        return;
    }
    duet__xfer_t *x = duet__xfer_find(ctx, DUET_XFER_ROLE_RECV, id);
    if (kind == DUET__XFER_AM_HELLO) {
        /* A hello while RECEIVING is a replacement sender: the router prefills a request once
         * more on another context worker when the first one died or gave up mid-transfer; the
         * new sender rewrites every byte, and the abort address becomes the new one. */
        if (x == NULL || (x->state != DUET__X_RESERVED && x->state != DUET__X_RECEIVING) ||
            len == 0 || len > DUET__XFER_ADDR_MAX) {
            DUET_LOG_INFO("xfer: hello for transfer %016llx refused (%s)", (unsigned long long)id,
                          x == NULL ? "unknown or ended" : "bad state");
            if (reply_ep != NULL)
                (void)duet__xfer_reply_abort(ctx, reply_ep, id,
                                             "no such reservation (ended, or never made)");
            return;
        }
        memcpy(x->hello_addr, data, len);
        x->hello_len = len;
        x->hello_pending = true;
        ctx->dirty = true;
        return;
    }
    duet__arena_t arena;
    Duet__Envelope *env = duet__xfer_env_unpack(&arena, data, len);
    if (env == NULL) {
        DUET_LOG_WARN("xfer: malformed control message for transfer %016llx dropped",
                      (unsigned long long)id);
        return;
    }
    if (x == NULL || x->done_pending || x->abort_pending) {
        DUET_LOG_DEBUG("xfer: control message for ended transfer %016llx ignored",
                       (unsigned long long)id);
        return;
    }
    if (env->body_case == DUET__ENVELOPE__BODY_XFER_DONE && env->xfer_done->transfer_id == id) {
        x->done_bytes = env->xfer_done->bytes;
        x->done_has_checksum = env->xfer_done->has_checksum;
        x->done_checksum = env->xfer_done->checksum;
        x->done_pending = true;
    } else if (env->body_case == DUET__ENVELOPE__BODY_XFER_ABORT &&
               env->xfer_abort->transfer_id == id) {
        duet__xfer_set_reason(x, DUET_XFER_REASON_PEER_ABORTED, "sender aborted (%s): %s",
                              duet__xfer_proto_reason_str(env->xfer_abort->reason),
                              env->xfer_abort->message != NULL ? env->xfer_abort->message : "");
        x->abort_pending = true;
    } else {
        DUET_LOG_WARN("xfer: unexpected control message (body %d) for transfer %016llx dropped",
                      (int)env->body_case, (unsigned long long)id);
        return;
    }
    ctx->dirty = true;
}
