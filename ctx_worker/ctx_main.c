/*
 * duet-ctx: the context (prefill) worker (docs/architecture.md, "The path of one request", steps
 * 5-7).
 *
 * The worker skeleton (worker/skeleton.h) runs the process: the router link (Prefill, Cancel,
 * Drain, Undrain in; Tokens, Heartbeat out), UCX (puts into the generation worker's reserved
 * pages) and one prefill step per loop turn while prompts wait. This file is the role's state
 * machine. A request (cr_t):
 *   WAITING    decoded and checked, waiting for a sequence slot and pages (bounded queue)
 *   PREFILL    the transfer is started (connecting meanwhile); the prompt is prefilled in chunks
 *              that start at multiples of batch.prefill_chunk (duet-generate's cut), many
 *              requests per step up to batch.max_tokens
 *   SENDING    during the step that holds a prompt's last chunk, each MLA layer's KV pages are
 *              put as soon as that layer ran (the model's layer hook), the KDA state and conv
 *              windows after the step; the first token is sampled; now waiting for the transfer
 *   then       DONE: Tokens(first token) to the router, which tells the gen worker (PrefillDone);
 *              ABORTED: Tokens(ERROR, no ids) so the router may prefill once more elsewhere.
 * The sequence's pages are returned only once the transfer reported its outcome (no UCX
 * operation reads them any more). Cancel and deadlines end a request in any state.
 * A Prefill for a Helix generation group carries one reservation per rank (reservation and
 * more_reservations); they are decoded as one set (transfer/reservation.h: one whole group,
 * ordered by rank) and the transfer goes to every rank.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "worker/prefix_cache.h"
#include "worker/skeleton.h"

static const duet_config_key_t ctx_keys[] = {
    DUET_WORKER_CONFIG_KEYS,
    {"batch.max_seqs", DUET_CONFIG_INT, "8", "prompts prefilled or sending at once", .min = "1",
     .max = "65536"},
    {"batch.max_tokens", DUET_CONFIG_INT, "512",
     "prompt tokens per step at most: a smaller step finishes the oldest prompts sooner (lower "
     "TTFT), a larger one batches more prompts per step",
     .min = "1", .max = "1048576"},
    {"batch.max_queue", DUET_CONFIG_INT, "256", "prompts waiting for a slot at most", .min = "0",
     .max = "1000000"},
    DUET_PREFIX_CACHE_CONFIG_KEYS,
    {"test.xfer_hold_ms", DUET_CONFIG_INT, "0",
     "fault injection for tests: a prompt's cache transfer puts no byte until this long after its "
     "prefill finished (0 = none; bench/soak holds transfers past their deadline)",
     .min = "0", .max = "600000"},
};

typedef enum {
    CR_FREE = 0,
    CR_WAITING,
    CR_PREFILL,
    CR_SENDING,
} cr_phase_t;

typedef struct {
    duet_worker_req_t base;       /* first: the skeleton's table holds cr_t */
    duet_xfer_reservation_t *res; /* (n_res) decoded, rank r at [r]; each owns its message */
    uint32_t n_res;
    bool ended; /* the router was told the end; free at the outcome */
    bool last_in_step;
    double t_arrive;
    double t_admit; /* when its transfer started */
    double put_at;  /* SENDING with test.xfer_hold_ms: when the puts start (0 = started) */
} cr_t;

static struct {
    int64_t open_seqs;
    bool checksum;
    uint32_t hold_ms;        /* test.xfer_hold_ms */
    duet_prefix_cache_t *pc; /* cache.prefix; NULL when off */
} c;

static cr_t *cr_at(const duet_worker_t *w, int64_t i)
{
    return (cr_t *)duet_worker_req(w, i);
}

/* ------------------------------------------------------------------------------ requests */

static void ctx_release(duet_worker_t *w, duet_worker_req_t *q)
{
    if (q->seq.id >= 0)
        c.open_seqs--;
    cr_t *r = (cr_t *)q;
    for (uint32_t i = 0; i < r->n_res; i++)
        duet_xfer_reservation_free(&r->res[i]);
    free(r->res);
    duet_worker_req_clear(w, q); /* zeroes r */
}

/*
 * End a request from our side with a final Tokens (CANCELLED or ERROR). A live transfer is
 * cancelled first; its pages are freed when its outcome comes (ctx_release then).
 */
static void cr_end(duet_worker_t *w, cr_t *r, int finish, const char *error)
{
    if (!r->ended)
        duet_worker_send_tokens(w->link, r->base.rid, NULL, 0, finish, error);
    r->ended = true;
    if (r->base.xfer_live) {
        (void)duet_xfer_send_cancel(w->x, r->base.xid, error != NULL ? error : "cancelled");
        return; /* the outcome callback frees */
    }
    ctx_release(w, &r->base);
}

/* The request's sequence: on the longest cached prefix of its prompt when the prefix cache has
 * one (then only the rest is prefilled; not for prompt_logprobs, which scores every prompt row),
 * else empty; the cache's least recently used entries make room when pages are short. */
static duet_status_t ctx_seq_open(duet_worker_t *w, duet_worker_req_t *q)
{
    const int32_t *lookup = q->sampling.prompt_logprobs ? NULL : q->prompt;
    duet_status_t st =
        duet_prefix_cache_seq_open(c.pc, w->m, lookup, q->n_prompt, q->n_prompt, &q->seq);
    if (st != DUET_OK)
        return st;
    q->prefilled = q->seq.n_tokens;
    if (q->prefilled > 0)
        DUET_RLOG_DEBUG(q->rid, "prefix cache: %lld of %lld prompt tokens cached",
                        (long long)q->prefilled, (long long)q->n_prompt);
    return DUET_OK;
}

/* Give waiting requests a sequence and start their transfers, oldest first. */
static void ctx_admit(duet_worker_t *w)
{
    for (;;) {
        cr_t *best = NULL;
        for (int64_t i = 0; i < w->n_reqs; i++) {
            cr_t *r = cr_at(w, i);
            if (r->base.phase == CR_WAITING && !r->ended &&
                (best == NULL || r->base.arrival < best->base.arrival))
                best = r;
        }
        if (best == NULL || c.open_seqs >= w->max_seqs)
            break;
        cr_t *r = best;
        duet_worker_req_t *q = &r->base;
        if (ctx_seq_open(w, q) != DUET_OK) {
            q->seq.id = -1;
            if (c.open_seqs > 0)
                break; /* pages come back when a running prompt finishes */
            cr_end(w, r, DUET__TOKENS__FINISH_REASON__ERROR, duet_error_last());
            continue;
        }
        c.open_seqs++;
        duet_xfer_send_args_t a = {
            .req_id = q->rid,
            .reservations = r->res,
            .n_ranks = r->n_res,
            .layout = w->layout,
            .src = {.pages = q->seq.pages,
                    .n_pages = (uint32_t)q->seq.n_pages,
                    .kda_slot = q->seq.kda_slot,
                    .n_tokens = (uint64_t)q->n_prompt},
            .checksum = c.checksum,
            .cb = duet_worker_xfer_cb,
            .user = w,
        };
        if (w->layout.n_mla_layers == 0)
            a.src.n_pages = 0;
        if (duet_xfer_send_start(w->x, &a, &q->xid) != DUET_OK) {
            char msg[384];
            snprintf(msg, sizeof(msg), "cannot start the KV cache transfer: %s", duet_error_last());
            DUET_RLOG_WARN(q->rid, "%s", msg);
            cr_end(w, r, DUET__TOKENS__FINISH_REASON__ERROR, msg);
            continue;
        }
        q->xfer_live = true;
        q->phase = CR_PREFILL;
        r->t_admit = duet_worker_now();
    }
}

/* ------------------------------------------------------------------------------ transfer */

static void ctx_on_xfer(duet_worker_t *w, duet_worker_req_t *q, const duet_xfer_outcome_t *o)
{
    cr_t *r = (cr_t *)q;
    q->xfer_live = false;
    if (r->ended) {
        ctx_release(w, q);
        duet_worker_update(w);
        return;
    }
    if (o->kind == DUET_XFER_OUTCOME_DONE && q->phase == CR_SENDING) {
        int finish = DUET__TOKENS__FINISH_REASON__NONE;
        if (duet_worker_is_stop(&q->sampling, q->drawn))
            finish = DUET__TOKENS__FINISH_REASON__STOP;
        else if (q->max_tokens <= 1)
            finish = DUET__TOKENS__FINISH_REASON__LENGTH;
        uint32_t id = (uint32_t)q->drawn; /* the first token, drawn by the prompt's last step */
        DUET_RLOG_DEBUG(q->rid, "prefilled %lld tokens, cache sent (%llu bytes, %.3f ms)",
                        (long long)q->n_prompt, (unsigned long long)o->bytes, o->seconds * 1e3);
        const duet_worker_sampling_t *ws = &q->sampling;
        duet_worker_send_tokens_lp(w->link, q->rid, &id, 1, ws->logprobs ? &ws->drawn_lp : NULL,
                                   ws->prompt_lp, (size_t)ws->n_prompt_lp, finish, NULL);
        ctx_release(w, q);
    } else {
        char msg[384];
        snprintf(msg, sizeof(msg), "the KV cache transfer to the generation worker failed (%s): %s",
                 duet_xfer_reason_str(o->reason), o->message);
        DUET_RLOG_WARN(q->rid, "%s", msg);
        r->ended = true;
        duet_worker_send_tokens(w->link, q->rid, NULL, 0, DUET__TOKENS__FINISH_REASON__ERROR, msg);
        ctx_release(w, q);
    }
    duet_worker_update(w);
}

/* Layer hook: the step's finished prompts stream MLA layer `mla` now (unless held). */
static void ctx_on_layer(duet_worker_t *w, int64_t mla)
{
    for (int64_t i = 0; c.hold_ms == 0 && i < w->n_reqs; i++) {
        cr_t *r = cr_at(w, i);
        if (r->base.phase == CR_PREFILL && r->last_in_step && r->base.xfer_live)
            (void)duet_xfer_send_layer_ready(w->x, r->base.xid, (uint32_t)mla);
    }
}

/* ------------------------------------------------------------------------------ messages */

static void ctx_on_prefill(duet_worker_t *w, const Duet__Prefill *m)
{
    const char *why = NULL;
    char buf[320];
    if (w->draining)
        why = "this context worker is draining";
    else if (duet_worker_find(w, m->request_id) != NULL)
        why = "a request with this id is already here";
    else if (m->n_tokens == 0)
        why = "empty prompt";
    else if ((int64_t)m->n_tokens > duet_model_opts(w->m)->max_seq_len) {
        snprintf(buf, sizeof(buf),
                 "a %zu-token prompt exceeds this worker's cache.max_seq_len %lld", m->n_tokens,
                 (long long)duet_model_opts(w->m)->max_seq_len);
        why = buf;
    } else if (!duet_worker_in_vocab(w, m->tokens, m->n_tokens))
        why = "a prompt token is outside the vocabulary";
    cr_t *r = why == NULL ? (cr_t *)duet_worker_free_slot(w) : NULL;
    if (why == NULL && r == NULL)
        why = "the context worker's queue is full";
    duet_xfer_reservation_t *res = NULL;
    const uint32_t n_res = m->n_more_reservations < DUET_XFER_MAX_RANKS
                               ? (uint32_t)m->n_more_reservations + 1
                               : DUET_XFER_MAX_RANKS + 1;
    if (why == NULL && n_res > DUET_XFER_MAX_RANKS) {
        snprintf(buf, sizeof(buf), "unusable reservations: %zu of them, a group has at most %d",
                 m->n_more_reservations + 1, DUET_XFER_MAX_RANKS);
        why = buf;
    }
    if (why == NULL) {
        duet_xfer_bytes_t spans[DUET_XFER_MAX_RANKS];
        spans[0] = (duet_xfer_bytes_t){m->reservation.data, m->reservation.len};
        for (uint32_t i = 1; i < n_res; i++)
            spans[i] = (duet_xfer_bytes_t){m->more_reservations[i - 1].data,
                                           m->more_reservations[i - 1].len};
        res = calloc(n_res, sizeof(*res));
        if (res == NULL) {
            why = "out of memory";
        } else if (duet_xfer_reservation_decode_group(spans, n_res, 0, res) != DUET_OK) {
            snprintf(buf, sizeof(buf), "unusable reservation: %s", duet_error_last());
            why = buf;
            free(res);
            res = NULL;
        }
    }
    if (why != NULL) {
        DUET_RLOG_INFO(m->request_id, "prefill refused: %s", why);
        duet_worker_send_tokens(w->link, m->request_id, NULL, 0, DUET__TOKENS__FINISH_REASON__ERROR,
                                why);
        return;
    }
    if (!duet_worker_req_set_prompt(&r->base, m->tokens, m->n_tokens)) {
        for (uint32_t i = 0; i < n_res; i++)
            duet_xfer_reservation_free(&res[i]);
        free(res);
        duet_worker_send_tokens(w->link, m->request_id, NULL, 0, DUET__TOKENS__FINISH_REASON__ERROR,
                                "out of memory");
        return;
    }
    duet_worker_req_init(w, &r->base, m->request_id, (int64_t)m->n_tokens, m->max_tokens,
                         m->sampling, m->deadline_unix_ms);
    const char *bad = NULL;
    if (!duet_worker_req_setup(w, &r->base, m->tokens, m->n_tokens, NULL, 0, &bad)) {
        for (uint32_t i = 0; i < n_res; i++)
            duet_xfer_reservation_free(&res[i]);
        free(res);
        duet_worker_send_tokens(w->link, m->request_id, NULL, 0, DUET__TOKENS__FINISH_REASON__ERROR,
                                bad);
        duet_worker_req_clear(w, &r->base);
        return;
    }
    r->base.phase = CR_WAITING;
    r->res = res;
    r->n_res = n_res;
    r->t_arrive = duet_worker_now();
    duet_worker_update(w);
}

static void ctx_on_cancel(duet_worker_t *w, const Duet__Cancel *m)
{
    cr_t *r = (cr_t *)duet_worker_find(w, m->request_id);
    if (r == NULL || r->ended)
        return;
    DUET_RLOG_DEBUG(r->base.rid, "cancelled: %s", m->reason);
    cr_end(w, r, DUET__TOKENS__FINISH_REASON__CANCELLED, NULL);
    duet_worker_update(w);
}

static bool ctx_on_message(duet_worker_t *w, const Duet__Envelope *env)
{
    switch (env->body_case) {
    case DUET__ENVELOPE__BODY_PREFILL:
        ctx_on_prefill(w, env->prefill);
        return true;
    case DUET__ENVELOPE__BODY_CANCEL:
        ctx_on_cancel(w, env->cancel);
        return true;
    default:
        return false;
    }
}

/* ------------------------------------------------------------------------------ step */

/*
 * How long a prompt's first step may wait for the handshake with its generation worker. During
 * a step UCX moves only in the layer hook, so a handshake begun just before a long step would
 * stretch over it, the generation worker's reply pending on a connection to us the whole time;
 * were we killed then, that worker's UCX (1.13.1) would abort on an assertion while purging the
 * reply. Waiting here closes that window to the handshake's own time (about a millisecond on
 * one host); past the bound the step runs anyway and the handshake ends in the layer hook.
 */
#define CTX_CONNECT_WAIT_S 2.0

static bool cr_waits_for_peer(const duet_worker_t *w, const cr_t *r, double now)
{
    return r->base.prefilled == 0 && r->base.xfer_live && now - r->t_admit < CTX_CONNECT_WAIT_S &&
           duet_xfer_send_connecting(w->x, r->base.xid);
}

static bool cr_prefilling(const cr_t *r)
{
    return r->base.phase == CR_PREFILL && !r->ended;
}

/* The oldest prompts' next chunks, up to batch.max_tokens tokens. */
static int64_t ctx_plan_step(duet_worker_t *w)
{
    double now = duet_worker_now();
    for (int64_t i = 0; i < w->n_reqs; i++)
        if (cr_prefilling(cr_at(w, i)) && cr_waits_for_peer(w, cr_at(w, i), now)) {
            duet_worker_pump_progress(&w->pump); /* outside a step: outcomes are handled here */
            now = duet_worker_now();
            break;
        }
    int64_t n_pre = 0;
    for (int64_t i = 0; i < w->n_reqs; i++)
        if (cr_prefilling(cr_at(w, i)) && !cr_waits_for_peer(w, cr_at(w, i), now))
            w->order[n_pre++] = duet_worker_req(w, i);
    int64_t budget = w->budget;
    int64_t n = duet_worker_add_prefill(w, w->order, n_pre, 0, &budget);
    for (int64_t i = 0; i < n; i++) {
        cr_t *r = (cr_t *)w->item_req[i];
        r->last_in_step = w->items[i].token_out != NULL; /* draws the first token */
        if (r->base.prefilled == 0 && r->base.xfer_live) /* test_cluster reads this line */
            DUET_RLOG_DEBUG(
                r->base.rid, "first prefill step %.2f ms after the transfer started (%s)",
                (now - r->t_admit) * 1e3,
                duet_xfer_send_connecting(w->x, r->base.xid) ? "still connecting" : "connected");
    }
    return n;
}

static void ctx_step_done(duet_worker_t *w, int64_t n, duet_status_t st, double seconds)
{
    for (int64_t i = 0; i < n; i++) {
        cr_t *r = (cr_t *)w->item_req[i];
        bool last = r->last_in_step;
        r->last_in_step = false;
        if (st != DUET_OK) {
            cr_end(w, r, DUET__TOKENS__FINISH_REASON__ERROR, duet_error_last());
            continue;
        }
        r->base.prefilled += w->items[i].n_tokens;
        (void)duet_prefix_cache_keep(c.pc, w->m, &r->base.seq, r->base.prompt, w->chunk);
        if (!last)
            continue;
        r->base.phase = CR_SENDING; /* the step drew the first token */
        if (c.hold_ms > 0)
            r->put_at = duet_worker_now() + c.hold_ms / 1000.0; /* ctx_tick puts it all then */
        else if (r->base.xfer_live)
            (void)duet_xfer_send_kda_ready(w->x, r->base.xid);
        DUET_RLOG_DEBUG(r->base.rid, "prefill done in %.1f ms since arrival",
                        (duet_worker_now() - r->t_arrive) * 1e3);
    }
    if (st != DUET_OK)
        DUET_LOG_ERROR("prefill step failed: %s", duet_error_last());
}

static bool ctx_has_work(duet_worker_t *w)
{
    for (int64_t i = 0; i < w->n_reqs; i++)
        if (cr_prefilling(cr_at(w, i)))
            return true;
    return false;
}

/* ------------------------------------------------------------------------------ timers */

static void ctx_heartbeat(duet_worker_t *w, Duet__Heartbeat *hb)
{
    for (int64_t i = 0; i < w->n_reqs; i++) {
        const cr_t *r = cr_at(w, i);
        if (r->base.phase == CR_FREE || r->ended)
            continue;
        if (r->base.phase == CR_WAITING) {
            hb->queued++;
            hb->queued_tokens += (uint64_t)r->base.n_prompt;
        } else {
            hb->running++;
            hb->queued_tokens += (uint64_t)(r->base.n_prompt - r->base.prefilled);
        }
    }
    if (c.pc != NULL)
        duet_prefix_cache_heartbeat(c.pc, hb);
}

/* End overdue requests. */
static void ctx_tick(duet_worker_t *w)
{
    uint64_t wall = duet_xfer_now_unix_ms();
    for (int64_t i = 0; i < w->n_reqs; i++) {
        cr_t *r = cr_at(w, i);
        if (r->base.phase == CR_FREE || r->ended)
            continue;
        if (r->put_at > 0 && duet_worker_now() >= r->put_at && r->base.xfer_live) {
            r->put_at = 0; /* test.xfer_hold_ms has passed: every layer, then the KDA state */
            for (uint32_t l = 0; l < w->layout.n_mla_layers; l++)
                (void)duet_xfer_send_layer_ready(w->x, r->base.xid, l);
            (void)duet_xfer_send_kda_ready(w->x, r->base.xid);
        }
        if (duet_worker_req_overdue(&r->base, wall)) {
            DUET_RLOG_WARN(r->base.rid, "deadline passed before the prefill finished");
            cr_end(w, r, DUET__TOKENS__FINISH_REASON__ERROR,
                   "the request's deadline passed before its prefill finished");
        }
    }
}

/* ------------------------------------------------------------------------------ the role */

static duet_status_t ctx_init(duet_worker_t *w)
{
    c.checksum = duet_config_get_bool(w->cfg, "transfer.checksum");
    c.hold_ms = (uint32_t)duet_config_get_int(w->cfg, "test.xfer_hold_ms");
    w->n_reqs = w->max_seqs + duet_config_get_int(w->cfg, "batch.max_queue");
    return duet_prefix_cache_from_config(w->cfg, w->m, w->chunk, &c.pc);
}

/* Destroying the transfer context aborts live transfers; their outcomes then free quietly. */
static void ctx_shutdown(duet_worker_t *w)
{
    for (int64_t i = 0; i < w->n_reqs; i++)
        cr_at(w, i)->ended = true;
    duet_prefix_cache_destroy(c.pc); /* its page holds go back to the pool, still there */
    c.pc = NULL;
}

static const duet_worker_ops_t ctx_ops = {
    .prog = "duet-ctx",
    .usage = "duet-ctx --router HOST:PORT --model DIR [options]\n\n"
             "The context worker: prefills prompts in token-budgeted batches and puts each "
             "finished layer's KV pages, then the KDA state, into the pages a generation "
             "worker reserved (UCX), then returns the first token to the router.",
    .keys = ctx_keys,
    .n_keys = sizeof(ctx_keys) / sizeof(ctx_keys[0]),
    .role = DUET__WORKER_ROLE__WORKER_ROLE_CTX,
    .receives = false,
    .defer_outcomes = true,
    .drain_log = "draining: no new prompts; the queued ones finish",
    .undrain_log = "undrained: taking prompts again",
    .stop_reason = "the context worker is stopping",
    .req_size = sizeof(cr_t),
    .init = ctx_init,
    .on_message = ctx_on_message,
    .on_xfer = ctx_on_xfer,
    .on_layer = ctx_on_layer,
    .plan_step = ctx_plan_step,
    .step_done = ctx_step_done,
    .tick = ctx_tick,
    .heartbeat = ctx_heartbeat,
    .admit = ctx_admit,
    .has_work = ctx_has_work,
    .shutdown = ctx_shutdown,
    .release = ctx_release,
};

int main(int argc, char **argv)
{
    return duet_worker_main(&ctx_ops, argc, argv);
}
