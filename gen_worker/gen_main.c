/*
 * duet-gen: the generation worker (docs/architecture.md: "The path of one request", steps 4 and
 * 8-9; "Quarantine").
 *
 * The worker skeleton (worker/skeleton.h) runs the process: the router link (Reserve,
 * PrefillDone, Generate, Cancel, Drain, Undrain in; Reserved, Refused, Tokens, Heartbeat out),
 * UCX (context workers put KV pages and KDA state into our pools) and one forward step per loop
 * turn while there is work. This file is the role's state machine. A request (gr_t) is, in this
 * order:
 *   RECEIVING  pages + a state slot reserved (Reserve), waiting for the cache transfer's XferDone
 *              and the router's PrefillDone (first token, sampled by the context worker)
 *   PREFILL    a local prompt (Generate: conditional disaggregation) prefilled in chunks that
 *              start at multiples of batch.prefill_chunk, as duet-generate cuts them
 *   DECODE     one token per step in the continuous batch, streamed to the router
 *   QUARANTINE a reservation that ended without its data (cancel, deadline, abort): its pages
 *              stay held for cache.quarantine_ms so that a context worker that has not yet seen
 *              the abort cannot put into pages another request already uses (transfer/xfer.h,
 *              "known limit"), then they return to the pool
 * Every end sends exactly one final Tokens (STOP, LENGTH, CANCELLED or ERROR) unless the router
 * ended the request first, and returns the pages (at once, or after the quarantine).
 *
 * Batch invariance (engine/model.h) makes every request's tokens equal to duet-generate's under
 * greedy sampling, whatever else runs in the batch. A seeded request samples the same tokens as
 * duet-generate with that seed: the context worker drew the first token from the same stream, so
 * the stream here skips that one draw.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "proto/envelope.h"
#include "worker/skeleton.h"

static const duet_config_key_t gen_keys[] = {
    DUET_WORKER_CONFIG_KEYS,
    {"batch.max_seqs", DUET_CONFIG_INT, "16", "requests held at once (state slots)", .min = "1",
     .max = "65536"},
    {"batch.max_tokens", DUET_CONFIG_INT, "2048",
     "tokens per step at most (decodes + local prefill chunks): larger steps prefill waiting "
     "prompts together and interrupt decoding less often",
     .min = "1", .max = "1048576"},
    {"cache.quarantine_ms", DUET_CONFIG_INT, "2000",
     "pages of an aborted reservation are reused after this long", .min = "0", .max = "600000"},
    {"cache.slack_tokens", DUET_CONFIG_INT, "0",
     "extra tokens reserved per request (draft slack for speculative decoding)", .min = "0",
     .max = "65536"},
};

typedef enum {
    GR_FREE = 0,
    GR_RECEIVING,
    GR_PREFILL,
    GR_DECODE,
    GR_QUARANTINE,
} gr_phase_t;

typedef struct {
    duet_worker_req_t base; /* first: the skeleton's table holds gr_t */
    uint32_t produced;
    bool xfer_done, have_first, cancelling;
    int32_t next;      /* the next input token (DECODE) */
    double release_at; /* QUARANTINE */
} gr_t;

static struct {
    int64_t slack;
    uint32_t quarantine_ms;
    int64_t n_decode; /* decodes in the step being run */
    /* work counters (Heartbeat 6-9) */
    uint64_t decode_steps, decode_seq_steps, decoded_tokens;
    double step_seconds;
} g;

static gr_t *gr_at(const duet_worker_t *w, int64_t i)
{
    return (gr_t *)duet_worker_req(w, i);
}

/* ------------------------------------------------------------------------------ requests */

static void gr_free(duet_worker_t *w, duet_worker_req_t *q)
{
    duet_worker_req_clear(w, q);
}

/* Hold the pages of a reservation that ended without its data; freed by the heartbeat tick. */
static void gr_quarantine(gr_t *r)
{
    free(r->base.prompt);
    r->base.prompt = NULL;
    r->base.phase = GR_QUARANTINE;
    r->base.xfer_live = false;
    r->release_at = duet_worker_now() + g.quarantine_ms / 1000.0;
}

static gr_t *gr_new(duet_worker_t *w, uint64_t rid, uint32_t prompt_tokens, uint32_t max_tokens,
                    const Duet__Sampling *s, uint64_t deadline, const char **why)
{
    if (duet_worker_find(w, rid) != NULL) {
        *why = "a request with this id is already here";
        return NULL;
    }
    if (prompt_tokens == 0 || max_tokens == 0) {
        *why = "empty prompt or max_tokens 0";
        return NULL;
    }
    gr_t *r = (gr_t *)duet_worker_free_slot(w);
    if (r == NULL) {
        *why = "all request slots are in use";
        return NULL;
    }
    int64_t need = (int64_t)prompt_tokens + max_tokens + g.slack;
    if (duet_model_seq_open(w->m, need, &r->base.seq) != DUET_OK) {
        *why = duet_error_last();
        r->base.seq.id = -1;
        return NULL;
    }
    duet_worker_req_init(w, &r->base, rid, prompt_tokens, max_tokens, s, deadline);
    return r;
}

/* A token was produced (r->produced already counts it): stream it, end the request or go on. */
static void gr_emit(duet_worker_t *w, gr_t *r, int32_t tok)
{
    duet_worker_req_t *q = &r->base;
    int finish = DUET__TOKENS__FINISH_REASON__NONE;
    if (duet_worker_is_stop(&q->sampling, tok))
        finish = DUET__TOKENS__FINISH_REASON__STOP;
    else if (r->produced >= q->max_tokens || q->seq.n_tokens + 1 > q->seq.cap_tokens)
        finish = DUET__TOKENS__FINISH_REASON__LENGTH;
    uint32_t id = (uint32_t)tok;
    duet_worker_send_tokens(w->link, q->rid, &id, 1, finish, NULL);
    if (finish != DUET__TOKENS__FINISH_REASON__NONE) {
        DUET_RLOG_DEBUG(q->rid, "finished: %u tokens", r->produced);
        gr_free(w, q);
        return;
    }
    r->next = tok;
    q->phase = GR_DECODE;
}

/* Transferred cache and first token are both here: continue after the prompt. */
static void gr_start_decode(duet_worker_t *w, gr_t *r)
{
    duet_worker_req_t *q = &r->base;
    q->xfer_live = false;
    if (duet_model_seq_set_filled(w->m, &q->seq, q->n_prompt) != DUET_OK) {
        duet_worker_send_tokens(w->link, q->rid, NULL, 0, DUET__TOKENS__FINISH_REASON__ERROR,
                                duet_error_last());
        gr_free(w, q);
        return;
    }
    r->produced = 1; /* the context worker's token, already streamed by the router */
    if (q->sampling.sp.temperature > 0.0f && q->sampling.sp.top_k != 1)
        (void)duet_rng_uniform(&q->sampling.rng); /* the draw the context worker made for it */
    int finish = DUET__TOKENS__FINISH_REASON__NONE;
    if (duet_worker_is_stop(&q->sampling, r->next))
        finish = DUET__TOKENS__FINISH_REASON__STOP;
    else if (r->produced >= q->max_tokens)
        finish = DUET__TOKENS__FINISH_REASON__LENGTH;
    if (finish != DUET__TOKENS__FINISH_REASON__NONE) {
        duet_worker_send_tokens(w->link, q->rid, NULL, 0, finish, NULL);
        gr_free(w, q);
        return;
    }
    q->phase = GR_DECODE;
    duet_worker_update(w);
}

/* ------------------------------------------------------------------------------ transfer */

static void gen_on_xfer(duet_worker_t *w, duet_worker_req_t *q, const duet_xfer_outcome_t *o)
{
    gr_t *r = (gr_t *)q;
    if (o->kind == DUET_XFER_OUTCOME_DONE) {
        r->xfer_done = true;
        DUET_RLOG_DEBUG(q->rid, "cache received: %llu bytes in %.3f ms",
                        (unsigned long long)o->bytes, o->seconds * 1e3);
        if (r->have_first)
            gr_start_decode(w, r);
        return;
    }
    if (!r->cancelling) {
        char msg[384];
        snprintf(msg, sizeof(msg), "the KV cache transfer was aborted (%s): %s",
                 duet_xfer_reason_str(o->reason), o->message);
        DUET_RLOG_WARN(q->rid, "%s", msg);
        duet_worker_send_tokens(w->link, q->rid, NULL, 0, DUET__TOKENS__FINISH_REASON__ERROR, msg);
    }
    gr_quarantine(r);
}

/* ------------------------------------------------------------------------------ messages */

static void gen_on_reserve(duet_worker_t *w, const Duet__Reserve *m)
{
    if (w->draining) {
        duet_worker_send_refused(w->link, m->request_id, "draining", 0);
        return;
    }
    if (m->n_tokens != 0 && m->n_tokens != m->prompt_tokens) {
        duet_worker_send_refused(w->link, m->request_id, "Reserve: tokens and prompt_tokens differ",
                                 0);
        return;
    }
    const char *why = NULL;
    gr_t *r = gr_new(w, m->request_id, m->prompt_tokens, m->max_tokens, m->sampling,
                     m->deadline_unix_ms, &why);
    if (r == NULL) {
        DUET_RLOG_INFO(m->request_id, "refusing the reservation: %s", why);
        duet_worker_send_refused(w->link, m->request_id, why, 500);
        return;
    }
    duet_worker_req_t *q = &r->base;
    const uint32_t pt = w->layout.page_tokens;
    q->phase = GR_RECEIVING;
    duet_xfer_recv_args_t a = {
        .req_id = q->rid,
        .layout = w->layout,
        .pages = q->seq.pages,
        .n_pages = (uint32_t)((q->n_prompt + pt - 1) / pt),
        .kda_slot = q->seq.kda_slot,
        .n_tokens = (uint64_t)q->n_prompt,
        .rank = 0,
        .group_size = 1,
        .deadline_unix_ms = m->deadline_unix_ms,
        .cb = duet_worker_xfer_cb,
        .user = w,
    };
    if (w->layout.n_mla_layers == 0)
        a.n_pages = 0;
    duet_xfer_reservation_t res;
    duet_status_t st = duet_xfer_recv_reserve(w->x, &a, &res);
    uint8_t *buf = NULL;
    size_t len = 0;
    if (st == DUET_OK) {
        size_t cap = duet_xfer_reservation_packed_size(&res);
        buf = malloc(cap > 0 ? cap : 1);
        st = buf == NULL ? DUET_ERR_NOMEM : duet_xfer_reservation_encode(&res, buf, cap, &len);
        if (st != DUET_OK)
            (void)duet_xfer_recv_cancel(w->x, res.transfer_id, "encoding failed");
        else {
            q->xid = res.transfer_id;
            q->xfer_live = true;
        }
    }
    if (st != DUET_OK) {
        char why_buf[256];
        snprintf(why_buf, sizeof(why_buf), "cannot reserve: %s", duet_error_last());
        duet_worker_send_refused(w->link, q->rid, why_buf, st == DUET_ERR_BUSY ? 500 : 0);
        gr_free(w, q);
        free(buf);
        return;
    }
    Duet__Reserved rs = DUET__RESERVED__INIT;
    rs.request_id = q->rid;
    rs.reservation.data = buf;
    rs.reservation.len = len;
    Duet__Envelope env = duet_envelope_reserved(&rs);
    (void)duet_link_send(w->link, &env);
    free(buf);
    DUET_RLOG_DEBUG(q->rid, "reserved %lld pages for %lld + %u tokens", (long long)q->seq.n_pages,
                    (long long)q->n_prompt, q->max_tokens);
}

static void gen_on_prefill_done(duet_worker_t *w, const Duet__PrefillDone *m)
{
    gr_t *r = (gr_t *)duet_worker_find(w, m->request_id);
    if (r == NULL || r->base.phase != GR_RECEIVING || r->have_first) {
        duet_worker_send_tokens(w->link, m->request_id, NULL, 0, DUET__TOKENS__FINISH_REASON__ERROR,
                                "PrefillDone for a request with no reservation here (it expired, "
                                "was cancelled or its transfer failed)");
        return;
    }
    if ((int64_t)m->first_token >= w->V) {
        duet_worker_send_tokens(w->link, r->base.rid, NULL, 0, DUET__TOKENS__FINISH_REASON__ERROR,
                                "PrefillDone: first token outside the vocabulary");
        if (r->base.xfer_live) {
            r->cancelling = true;
            (void)duet_xfer_recv_cancel(w->x, r->base.xid, "bad first token");
        }
        return;
    }
    r->have_first = true;
    r->next = (int32_t)m->first_token;
    if (r->xfer_done)
        gr_start_decode(w, r);
}

static void gen_on_generate(duet_worker_t *w, const Duet__Generate *m)
{
    if (w->draining) {
        duet_worker_send_refused(w->link, m->request_id, "draining", 0);
        return;
    }
    if (!duet_worker_in_vocab(w, m->tokens, m->n_tokens)) {
        duet_worker_send_tokens(w->link, m->request_id, NULL, 0, DUET__TOKENS__FINISH_REASON__ERROR,
                                "Generate: a prompt token is outside the vocabulary");
        return;
    }
    const char *why = NULL;
    gr_t *r = gr_new(w, m->request_id, (uint32_t)m->n_tokens, m->max_tokens, m->sampling,
                     m->deadline_unix_ms, &why);
    if (r == NULL) {
        DUET_RLOG_INFO(m->request_id, "refusing the local prefill: %s", why);
        duet_worker_send_refused(w->link, m->request_id, why, 500);
        return;
    }
    if (!duet_worker_req_set_prompt(&r->base, m->tokens, m->n_tokens)) {
        duet_worker_send_refused(w->link, m->request_id, "out of memory", 500);
        gr_free(w, &r->base);
        return;
    }
    r->base.phase = GR_PREFILL;
    duet_worker_update(w);
}

static void gen_on_cancel(duet_worker_t *w, const Duet__Cancel *m)
{
    gr_t *r = (gr_t *)duet_worker_find(w, m->request_id);
    if (r == NULL || r->base.phase == GR_QUARANTINE)
        return;
    DUET_RLOG_DEBUG(r->base.rid, "cancelled: %s", m->reason);
    duet_worker_send_tokens(w->link, r->base.rid, NULL, 0, DUET__TOKENS__FINISH_REASON__CANCELLED,
                            NULL);
    if (r->base.phase == GR_RECEIVING && r->base.xfer_live) {
        r->cancelling = true;
        (void)duet_xfer_recv_cancel(w->x, r->base.xid, m->reason); /* outcome: quarantine */
        if (r->base.phase == GR_RECEIVING)                         /* ended before? */
            gr_quarantine(r);
        return;
    }
    if (r->base.phase == GR_RECEIVING) {
        gr_quarantine(r);
        return;
    }
    gr_free(w, &r->base);
}

static bool gen_on_message(duet_worker_t *w, const Duet__Envelope *env)
{
    switch (env->body_case) {
    case DUET__ENVELOPE__BODY_RESERVE:
        gen_on_reserve(w, env->reserve);
        return true;
    case DUET__ENVELOPE__BODY_PREFILL_DONE:
        gen_on_prefill_done(w, env->prefill_done);
        return true;
    case DUET__ENVELOPE__BODY_GENERATE:
        gen_on_generate(w, env->generate);
        return true;
    case DUET__ENVELOPE__BODY_CANCEL:
        gen_on_cancel(w, env->cancel);
        return true;
    default:
        return false;
    }
}

/* ------------------------------------------------------------------------------ step */

/* Every decoding request (one token each), then prefill chunks within batch.max_tokens. */
static int64_t gen_plan_step(duet_worker_t *w)
{
    int64_t n = 0, budget = w->budget;
    for (int64_t i = 0; i < w->n_reqs && budget > 0; i++) {
        gr_t *r = gr_at(w, i);
        if (r->base.phase != GR_DECODE)
            continue;
        w->items[n] = (duet_batch_item_t){.seq = &r->base.seq,
                                          .tokens = &r->next,
                                          .n_tokens = 1,
                                          .logits_mode = DUET_LOGITS_TOKEN,
                                          .sampling = r->base.sampling.sp,
                                          .token_out = &r->base.drawn};
        w->items[n].u = duet_sampling_draw(&r->base.sampling.sp, &r->base.sampling.rng);
        w->item_req[n] = &r->base;
        n++;
        budget--;
    }
    g.n_decode = n;
    int64_t n_pre = 0;
    for (int64_t i = 0; i < w->n_reqs; i++)
        if (gr_at(w, i)->base.phase == GR_PREFILL)
            w->order[n_pre++] = duet_worker_req(w, i);
    return duet_worker_add_prefill(w, w->order, n_pre, n, &budget);
}

static void gen_step_done(duet_worker_t *w, int64_t n, duet_status_t st, double seconds)
{
    if (st != DUET_OK) {
        /* validation refused the batch: nothing advanced; fail its requests, keep serving */
        DUET_LOG_ERROR("forward step failed: %s", duet_error_last());
        for (int64_t i = 0; i < n; i++) {
            duet_worker_send_tokens(w->link, w->item_req[i]->rid, NULL, 0,
                                    DUET__TOKENS__FINISH_REASON__ERROR, duet_error_last());
            gr_free(w, w->item_req[i]);
        }
        return;
    }
    if (g.n_decode > 0) {
        g.decode_steps++;
        g.decode_seq_steps += (uint64_t)g.n_decode;
        g.decoded_tokens += (uint64_t)g.n_decode;
        g.step_seconds += seconds;
    }
    for (int64_t i = 0; i < n; i++) {
        gr_t *r = (gr_t *)w->item_req[i];
        if (r->base.phase == GR_PREFILL) {
            r->base.prefilled += w->items[i].n_tokens;
            if (r->base.prefilled < r->base.n_prompt)
                continue;
            free(r->base.prompt);
            r->base.prompt = NULL;
        }
        r->produced++;
        gr_emit(w, r, r->base.drawn); /* drawn by the step (DUET_LOGITS_TOKEN) */
    }
}

static bool gen_has_work(duet_worker_t *w)
{
    for (int64_t i = 0; i < w->n_reqs; i++)
        if (gr_at(w, i)->base.phase == GR_DECODE || gr_at(w, i)->base.phase == GR_PREFILL)
            return true;
    return false;
}

/* ------------------------------------------------------------------------------ timers */

static void gen_heartbeat(duet_worker_t *w, Duet__Heartbeat *hb)
{
    for (int64_t i = 0; i < w->n_reqs; i++) {
        const gr_t *r = gr_at(w, i);
        if (r->base.phase == GR_FREE || r->base.phase == GR_QUARANTINE)
            continue;
        hb->running++;
        if (r->base.phase == GR_PREFILL) {
            hb->queued++;
            hb->queued_tokens += (uint64_t)(r->base.n_prompt - r->base.prefilled);
        }
    }
    hb->decode_steps = g.decode_steps;
    hb->decode_seq_steps = g.decode_seq_steps;
    hb->decoded_tokens = g.decoded_tokens;
    hb->step_seconds = g.step_seconds;
}

/* End quarantines and overdue requests. */
static void gen_tick(duet_worker_t *w)
{
    double now = duet_worker_now();
    uint64_t wall = duet_xfer_now_unix_ms();
    for (int64_t i = 0; i < w->n_reqs; i++) {
        gr_t *r = gr_at(w, i);
        if (r->base.phase == GR_QUARANTINE && now >= r->release_at) {
            gr_free(w, &r->base);
            continue;
        }
        if (r->base.phase == GR_FREE || r->base.phase == GR_QUARANTINE)
            continue;
        if (duet_worker_req_overdue(&r->base, wall) &&
            r->base.phase != GR_RECEIVING) { /* a reservation's deadline is the transfer layer's */
            DUET_RLOG_WARN(r->base.rid, "deadline passed: ending the request");
            duet_worker_send_tokens(w->link, r->base.rid, NULL, 0,
                                    DUET__TOKENS__FINISH_REASON__ERROR,
                                    "the request's deadline passed");
            gr_free(w, &r->base);
        }
    }
}

/* ------------------------------------------------------------------------------ the role */

static void gen_init(duet_worker_t *w)
{
    g.quarantine_ms = (uint32_t)duet_config_get_int(w->cfg, "cache.quarantine_ms");
    g.slack = duet_config_get_int(w->cfg, "cache.slack_tokens");
}

static const duet_worker_ops_t gen_ops = {
    .prog = "duet-gen",
    .usage = "duet-gen --router HOST:PORT --model DIR [options]\n\n"
             "The generation worker: reserves cache pages for requests, receives their "
             "prefilled caches from context workers over UCX (or prefills short prompts "
             "itself), and decodes them in a continuous batch.",
    .keys = gen_keys,
    .n_keys = sizeof(gen_keys) / sizeof(gen_keys[0]),
    .role = DUET__WORKER_ROLE__WORKER_ROLE_GEN,
    .receives = true,
    /* outcomes touch only RECEIVING requests, never one in the running step */
    .defer_outcomes = false,
    .drain_log = "draining: no new requests; running ones finish",
    .undrain_log = "undrained: taking requests again",
    .stop_reason = "the generation worker is stopping",
    .req_size = sizeof(gr_t),
    .init = gen_init,
    .on_message = gen_on_message,
    .on_xfer = gen_on_xfer,
    .plan_step = gen_plan_step,
    .step_done = gen_step_done,
    .tick = gen_tick,
    .heartbeat = gen_heartbeat,
    .has_work = gen_has_work,
    .release = gr_free,
};

int main(int argc, char **argv)
{
    return duet_worker_main(&gen_ops, argc, argv);
}
