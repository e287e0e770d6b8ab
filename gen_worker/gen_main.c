/*
 * duet-gen: the generation worker (docs/architecture.md: "The path of one request", steps 4 and
 * 8-9; "Quarantine").
 *
 * One process, one libuv loop thread (the engine's thread pool does the math inside a step):
 *   router link (worker/link.h)   Reserve, PrefillDone, Generate, Cancel, Drain, Undrain in;
 *                                 Reserved, Refused, Tokens, Heartbeat out
 *   UCX (transfer/xfer.h)         context workers put KV pages and KDA state into our pools
 *   an idle handle                one forward step per loop turn while there is work
 *
 * A request (gr_t) is, in this order:
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
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <uv.h>

#include "common/config.h"
#include "common/fingerprint.h"
#include "common/log.h"
#include "engine/sampler.h"
#include "worker/worker.h"

static const duet_config_key_t gen_keys[] = {
    DUET_WORKER_CONFIG_KEYS,
    {"batch.max_seqs", DUET_CONFIG_INT, "16", "requests held at once (state slots)", .min = "1",
     .max = "65536"},
    {"batch.max_tokens", DUET_CONFIG_INT, "2048",
     "tokens per step at most (decodes + local prefill chunks): larger steps prefill waiting "
     "prompts together and interrupt decoding less often", .min = "1", .max = "1048576"},
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
    uint64_t        rid;
    gr_phase_t      phase;
    duet_seq_t      seq;
    int32_t        *prompt; /* (n_prompt) owned, local prefill only */
    int64_t         n_prompt, prefilled;
    uint32_t        max_tokens, produced;
    duet_worker_sampling_t sampling;
    duet_xfer_id_t  xid;
    bool            xfer_live, xfer_done, have_first, cancelling;
    int32_t         next; /* the next input token (DECODE) */
    uint64_t        arrival;
    uint64_t        deadline_unix_ms;
    double          release_at; /* QUARANTINE */
} gr_t;

static struct {
    duet_config_t     *cfg;
        duet_model_t      *m;
    duet_xfer_ctx_t   *x;
    duet_worker_pump_t   pump;
    duet_xfer_layout_t layout;
    duet_worker_rt_t   rt;
    gr_t              *reqs;  /* [n_reqs] */
    int64_t            n_reqs;
    int64_t            V, chunk, budget, page_tokens, slack;
    uint32_t           quarantine_ms;
    bool               draining;
    uint64_t           arrivals;
    /* step scratch */
    duet_batch_item_t *items;
    gr_t             **item_req;
    gr_t             **pre;    /* prefilling requests, by arrival */
    int32_t           *tok; /* [n_reqs] tokens the step drew (DUET_LOGITS_TOKEN) */
    /* work counters (Heartbeat 6-10) */
    uint64_t decode_steps, decode_seq_steps, decoded_tokens, prefill_tokens;
    double   step_seconds;
} g;

/* ------------------------------------------------------------------------------ requests */

static gr_t *gr_find(uint64_t rid)
{
    for (int64_t i = 0; i < g.n_reqs; i++)
        if (g.reqs[i].phase != GR_FREE && g.reqs[i].rid == rid)
            return &g.reqs[i];
    return NULL;
}

static gr_t *gr_find_xfer(duet_xfer_id_t id)
{
    for (int64_t i = 0; i < g.n_reqs; i++)
        if (g.reqs[i].phase == GR_RECEIVING && g.reqs[i].xfer_live && g.reqs[i].xid == id)
            return &g.reqs[i];
    return NULL;
}

static void gr_free(gr_t *r)
{
    duet_model_seq_close(g.m, &r->seq);
    free(r->prompt);
    memset(r, 0, sizeof(*r));
    r->seq.id = -1;
}

/* Hold the pages of a reservation that ended without its data; freed by the heartbeat tick. */
static void gr_quarantine(gr_t *r)
{
    free(r->prompt);
    r->prompt     = NULL;
    r->phase      = GR_QUARANTINE;
    r->xfer_live  = false;
    r->release_at = duet_worker_now() + g.quarantine_ms / 1000.0;
}

static void gen_update_idle(void);

static gr_t *gr_new(uint64_t rid, uint32_t prompt_tokens, uint32_t max_tokens,
                    const Duet__Sampling *s, uint64_t deadline, const char **why)
{
    if (gr_find(rid) != NULL) {
        *why = "a request with this id is already here";
        return NULL;
    }
    if (prompt_tokens == 0 || max_tokens == 0) {
        *why = "empty prompt or max_tokens 0";
        return NULL;
    }
    gr_t *r = NULL;
    for (int64_t i = 0; i < g.n_reqs && r == NULL; i++)
        if (g.reqs[i].phase == GR_FREE)
            r = &g.reqs[i];
    if (r == NULL) {
        *why = "all request slots are in use";
        return NULL;
    }
    int64_t need = (int64_t)prompt_tokens + max_tokens + g.slack;
    if (duet_model_seq_open(g.m, need, &r->seq) != DUET_OK) {
        *why = duet_error_last();
        r->seq.id = -1;
        return NULL;
    }
    r->rid              = rid;
    r->n_prompt         = prompt_tokens;
    r->max_tokens       = max_tokens;
    r->deadline_unix_ms = deadline;
    r->arrival          = ++g.arrivals;
    duet_worker_sampling_init(&r->sampling, s, rid);
    return r;
}

/* A token was produced (r->produced already counts it): stream it, end the request or go on. */
static void gr_emit(gr_t *r, int32_t tok)
{
    int finish = DUET__TOKENS__FINISH_REASON__NONE;
    if (duet_worker_is_stop(&r->sampling, tok))
        finish = DUET__TOKENS__FINISH_REASON__STOP;
    else if (r->produced >= r->max_tokens || r->seq.n_tokens + 1 > r->seq.cap_tokens)
        finish = DUET__TOKENS__FINISH_REASON__LENGTH;
    uint32_t id = (uint32_t)tok;
    duet_worker_send_tokens(g.rt.link, r->rid, &id, 1, finish, NULL);
    if (finish != DUET__TOKENS__FINISH_REASON__NONE) {
        DUET_RLOG_DEBUG(r->rid, "finished: %u tokens", r->produced);
        gr_free(r);
        return;
    }
    r->next  = tok;
    r->phase = GR_DECODE;
}

/* Transferred cache and first token are both here: continue after the prompt. */
static void gr_start_decode(gr_t *r)
{
    r->xfer_live = false;
    if (duet_model_seq_set_filled(g.m, &r->seq, r->n_prompt) != DUET_OK) {
        duet_worker_send_tokens(g.rt.link, r->rid, NULL, 0, DUET__TOKENS__FINISH_REASON__ERROR,
                                duet_error_last());
        gr_free(r);
        return;
    }
    r->produced = 1; /* the context worker's token, already streamed by the router */
    if (r->sampling.sp.temperature > 0.0f && r->sampling.sp.top_k != 1)
        (void)duet_rng_uniform(&r->sampling.rng); /* the draw the context worker made for it */
    int finish = DUET__TOKENS__FINISH_REASON__NONE;
    if (duet_worker_is_stop(&r->sampling, r->next))
        finish = DUET__TOKENS__FINISH_REASON__STOP;
    else if (r->produced >= r->max_tokens)
        finish = DUET__TOKENS__FINISH_REASON__LENGTH;
    if (finish != DUET__TOKENS__FINISH_REASON__NONE) {
        duet_worker_send_tokens(g.rt.link, r->rid, NULL, 0, finish, NULL);
        gr_free(r);
        return;
    }
    r->phase = GR_DECODE;
    gen_update_idle();
}

/* ------------------------------------------------------------------------------ transfer */

static void gen_on_xfer(const duet_xfer_outcome_t *o, void *user)
{
    gr_t *r = gr_find_xfer(o->id);
    if (r == NULL)
        return;
    if (o->kind == DUET_XFER_OUTCOME_DONE) {
        r->xfer_done = true;
        DUET_RLOG_DEBUG(r->rid, "cache received: %llu bytes in %.3f ms",
                        (unsigned long long)o->bytes, o->seconds * 1e3);
        if (r->have_first)
            gr_start_decode(r);
        return;
    }
    if (!r->cancelling) {
        char msg[384];
        snprintf(msg, sizeof(msg), "the KV cache transfer was aborted (%s): %s",
                 duet_xfer_reason_str(o->reason), o->message);
        DUET_RLOG_WARN(r->rid, "%s", msg);
        duet_worker_send_tokens(g.rt.link, r->rid, NULL, 0, DUET__TOKENS__FINISH_REASON__ERROR, msg);
    }
    gr_quarantine(r);
}

static void *gen_pool_alloc(void *user, duet_model_pool_t which, size_t bytes)
{
    void *base = NULL;
    if (duet_xfer_ctx_alloc(g.x, which == DUET_MODEL_POOL_KV ? DUET_XFER_POOL_KV : DUET_XFER_POOL_KDA,
                            bytes, DUET_XFER_MEM_HOST, &base) != DUET_OK) {
        DUET_LOG_ERROR("cannot allocate a %zu-byte pool through UCX: %s", bytes,
                       duet_error_last());
        return NULL;
    }
    return base;
}

/* ------------------------------------------------------------------------------ messages */

static void gen_on_reserve(const Duet__Reserve *m)
{
    if (g.draining) {
        duet_worker_send_refused(g.rt.link, m->request_id, "draining", 0);
        return;
    }
    if (m->n_tokens != 0 && m->n_tokens != m->prompt_tokens) {
        duet_worker_send_refused(g.rt.link, m->request_id, "Reserve: tokens and prompt_tokens differ",
                                 0);
        return;
    }
    const char *why = NULL;
    gr_t       *r   = gr_new(m->request_id, m->prompt_tokens, m->max_tokens, m->sampling,
                             m->deadline_unix_ms, &why);
    if (r == NULL) {
        DUET_RLOG_INFO(m->request_id, "refusing the reservation: %s", why);
        duet_worker_send_refused(g.rt.link, m->request_id, why, 500);
        return;
    }
    r->phase                   = GR_RECEIVING;
    duet_xfer_recv_args_t a    = {
        .req_id           = r->rid,
        .layout           = g.layout,
        .pages            = r->seq.pages,
        .n_pages          = (uint32_t)((r->n_prompt + g.page_tokens - 1) / g.page_tokens),
        .kda_slot         = r->seq.kda_slot,
        .n_tokens         = (uint64_t)r->n_prompt,
        .rank             = 0,
        .group_size       = 1,
        .deadline_unix_ms = m->deadline_unix_ms,
        .cb               = gen_on_xfer,
    };
    if (g.layout.n_mla_layers == 0)
        a.n_pages = 0;
    duet_xfer_reservation_t res;
    duet_status_t           st = duet_xfer_recv_reserve(g.x, &a, &res);
    uint8_t                *buf = NULL;
    size_t                  len = 0;
    if (st == DUET_OK) {
        size_t cap = duet_xfer_reservation_packed_size(&res);
        buf        = malloc(cap > 0 ? cap : 1);
        st         = buf == NULL ? DUET_ERR_NOMEM : duet_xfer_reservation_encode(&res, buf, cap, &len);
        if (st != DUET_OK)
            (void)duet_xfer_recv_cancel(g.x, res.transfer_id, "encoding failed");
        else {
            r->xid       = res.transfer_id;
            r->xfer_live = true;
        }
    }
    if (st != DUET_OK) {
        char why_buf[256];
        snprintf(why_buf, sizeof(why_buf), "cannot reserve: %s", duet_error_last());
        duet_worker_send_refused(g.rt.link, r->rid, why_buf, st == DUET_ERR_BUSY ? 500 : 0);
        gr_free(r);
        free(buf);
        return;
    }
    Duet__Reserved rs   = DUET__RESERVED__INIT;
    rs.request_id       = r->rid;
    rs.reservation.data = buf;
    rs.reservation.len  = len;
    Duet__Envelope env  = DUET__ENVELOPE__INIT;
    env.body_case       = DUET__ENVELOPE__BODY_RESERVED;
    env.reserved        = &rs;
    (void)duet_link_send(g.rt.link, &env);
    free(buf);
    DUET_RLOG_DEBUG(r->rid, "reserved %lld pages for %lld + %u tokens", (long long)r->seq.n_pages,
                    (long long)r->n_prompt, r->max_tokens);
}

static void gen_on_prefill_done(const Duet__PrefillDone *m)
{
    gr_t *r = gr_find(m->request_id);
    if (r == NULL || r->phase != GR_RECEIVING || r->have_first) {
        duet_worker_send_tokens(g.rt.link, m->request_id, NULL, 0,
                                DUET__TOKENS__FINISH_REASON__ERROR,
                                "PrefillDone for a request with no reservation here (it expired, "
                                "was cancelled or its transfer failed)");
        return;
    }
    if ((int64_t)m->first_token >= g.V) {
        duet_worker_send_tokens(g.rt.link, r->rid, NULL, 0, DUET__TOKENS__FINISH_REASON__ERROR,
                                "PrefillDone: first token outside the vocabulary");
        if (r->xfer_live) {
            r->cancelling = true;
            (void)duet_xfer_recv_cancel(g.x, r->xid, "bad first token");
        }
        return;
    }
    r->have_first = true;
    r->next       = (int32_t)m->first_token;
    if (r->xfer_done)
        gr_start_decode(r);
}

static void gen_on_generate(const Duet__Generate *m)
{
    if (g.draining) {
        duet_worker_send_refused(g.rt.link, m->request_id, "draining", 0);
        return;
    }
    for (size_t i = 0; i < m->n_tokens; i++)
        if ((int64_t)m->tokens[i] >= g.V) {
            duet_worker_send_tokens(g.rt.link, m->request_id, NULL, 0,
                                    DUET__TOKENS__FINISH_REASON__ERROR,
                                    "Generate: a prompt token is outside the vocabulary");
            return;
        }
    const char *why = NULL;
    gr_t *r = gr_new(m->request_id, (uint32_t)m->n_tokens, m->max_tokens, m->sampling,
                     m->deadline_unix_ms, &why);
    if (r == NULL) {
        DUET_RLOG_INFO(m->request_id, "refusing the local prefill: %s", why);
        duet_worker_send_refused(g.rt.link, m->request_id, why, 500);
        return;
    }
    r->prompt = malloc(sizeof(int32_t) * m->n_tokens);
    if (r->prompt == NULL) {
        duet_worker_send_refused(g.rt.link, m->request_id, "out of memory", 500);
        gr_free(r);
        return;
    }
    for (size_t i = 0; i < m->n_tokens; i++)
        r->prompt[i] = (int32_t)m->tokens[i];
    r->phase = GR_PREFILL;
    gen_update_idle();
}

static void gen_on_cancel(const Duet__Cancel *m)
{
    gr_t *r = gr_find(m->request_id);
    if (r == NULL || r->phase == GR_QUARANTINE)
        return;
    DUET_RLOG_DEBUG(r->rid, "cancelled: %s", m->reason);
    duet_worker_send_tokens(g.rt.link, r->rid, NULL, 0, DUET__TOKENS__FINISH_REASON__CANCELLED,
                            NULL);
    if (r->phase == GR_RECEIVING && r->xfer_live) {
        r->cancelling = true;
        (void)duet_xfer_recv_cancel(g.x, r->xid, m->reason); /* outcome: quarantine */
        if (r->phase == GR_RECEIVING)                        /* ended before? */
            gr_quarantine(r);
        return;
    }
    if (r->phase == GR_RECEIVING) {
        gr_quarantine(r);
        return;
    }
    gr_free(r);
}

static void gen_on_message(const Duet__Envelope *env, void *user)
{
    switch (env->body_case) {
    case DUET__ENVELOPE__BODY_RESERVE: gen_on_reserve(env->reserve); break;
    case DUET__ENVELOPE__BODY_PREFILL_DONE: gen_on_prefill_done(env->prefill_done); break;
    case DUET__ENVELOPE__BODY_GENERATE: gen_on_generate(env->generate); break;
    case DUET__ENVELOPE__BODY_CANCEL: gen_on_cancel(env->cancel); break;
    case DUET__ENVELOPE__BODY_DRAIN:
        DUET_LOG_INFO("draining: no new requests; %s", "running ones finish");
        g.draining = true;
        break;
    case DUET__ENVELOPE__BODY_UNDRAIN:
        DUET_LOG_INFO("undrained: taking requests again");
        g.draining = false;
        break;
    default:
        DUET_LOG_WARN("ignoring a message with body %d from the router", (int)env->body_case);
        break;
    }
}

/* ------------------------------------------------------------------------------ step */

static int gr_by_arrival(const void *a, const void *b)
{
    const gr_t *x = *(gr_t *const *)a, *y = *(gr_t *const *)b;
    return x->arrival < y->arrival ? -1 : x->arrival > y->arrival;
}

static void gen_step(uv_idle_t *h)
{
    int64_t n = 0, budget = g.budget, n_decode = 0, n_prefill_tok = 0;
    for (int64_t i = 0; i < g.n_reqs && budget > 0; i++) {
        gr_t *r = &g.reqs[i];
        if (r->phase != GR_DECODE)
            continue;
        g.items[n] = (duet_batch_item_t){.seq = &r->seq, .tokens = &r->next, .n_tokens = 1,
                                         .logits_mode = DUET_LOGITS_TOKEN,
                                         .sampling = r->sampling.sp, .token_out = &g.tok[n]};
        g.items[n].u  = duet_sampling_draw(&r->sampling.sp, &r->sampling.rng);
        g.item_req[n] = r;
        n++;
        n_decode++;
        budget--;
    }
    /* prefill chunks, oldest request first; a chunk goes whole or waits for the next step */
    gr_t  **pre   = g.pre;
    int64_t n_pre = 0;
    for (int64_t i = 0; i < g.n_reqs; i++)
        if (g.reqs[i].phase == GR_PREFILL)
            pre[n_pre++] = &g.reqs[i];
    qsort(pre, (size_t)n_pre, sizeof(pre[0]), gr_by_arrival);
    for (int64_t i = 0; i < n_pre; i++) {
        gr_t   *r   = pre[i];
        int64_t end = duet_worker_chunk_end(r->prefilled, r->n_prompt, g.chunk);
        int64_t len = end - r->prefilled;
        if (len > budget)
            continue;
        bool last  = end == r->n_prompt;
        g.items[n] = (duet_batch_item_t){.seq = &r->seq, .tokens = r->prompt + r->prefilled,
                                         .n_tokens = len,
                                         .logits_mode = last ? DUET_LOGITS_TOKEN : DUET_LOGITS_NONE,
                                         .token_out = &g.tok[n]};
        if (last) {
            g.items[n].sampling = r->sampling.sp;
            g.items[n].u        = duet_sampling_draw(&r->sampling.sp, &r->sampling.rng);
        }
        g.item_req[n] = r;
        n++;
        budget -= len;
        n_prefill_tok += len;
    }
    if (n == 0) {
        gen_update_idle();
        return;
    }
    double        t0 = duet_worker_now();
    duet_status_t st = duet_model_forward(g.m, g.items, n);
    double        dt = duet_worker_now() - t0;
    if (st != DUET_OK) {
        /* validation refused the batch: nothing advanced; fail its requests, keep serving */
        DUET_LOG_ERROR("forward step failed: %s", duet_error_last());
        for (int64_t i = 0; i < n; i++) {
            duet_worker_send_tokens(g.rt.link, g.item_req[i]->rid, NULL, 0,
                                    DUET__TOKENS__FINISH_REASON__ERROR, duet_error_last());
            gr_free(g.item_req[i]);
        }
        gen_update_idle();
        return;
    }
    if (n_decode > 0) {
        g.decode_steps++;
        g.decode_seq_steps += (uint64_t)n_decode;
        g.decoded_tokens += (uint64_t)n_decode;
        g.step_seconds += dt;
    }
    g.prefill_tokens += (uint64_t)n_prefill_tok;
    for (int64_t i = 0; i < n; i++) {
        gr_t *r = g.item_req[i];
        if (r->phase == GR_PREFILL) {
            r->prefilled += g.items[i].n_tokens;
            if (r->prefilled < r->n_prompt)
                continue;
            free(r->prompt);
            r->prompt = NULL;
        }
        int32_t tok = g.tok[i]; /* drawn by the step (DUET_LOGITS_TOKEN) */
        r->produced++;
        gr_emit(r, tok);
    }
    gen_update_idle();
}

static void gen_update_idle(void)
{
    bool work = false;
    for (int64_t i = 0; i < g.n_reqs && !work; i++)
        work = g.reqs[i].phase == GR_DECODE || g.reqs[i].phase == GR_PREFILL;
    duet_worker_rt_busy(&g.rt, work);
}

/* ------------------------------------------------------------------------------ heartbeat */

/* Heartbeat from the current state; no side effects, so a layer hook may call it mid-step. */
static void gen_heartbeat(void)
{
    uint32_t running = 0, queued = 0;
    uint64_t queued_tokens = 0;
    for (int64_t i = 0; i < g.n_reqs; i++) {
        const gr_t *r = &g.reqs[i];
        if (r->phase == GR_FREE || r->phase == GR_QUARANTINE)
            continue;
        running++;
        if (r->phase == GR_PREFILL) {
            queued++;
            queued_tokens += (uint64_t)(r->n_prompt - r->prefilled);
        }
    }
    duet_kv_pool_t *kv  = duet_model_kv_pool(g.m);
    Duet__Heartbeat hb  = DUET__HEARTBEAT__INIT;
    hb.free_pages       = kv != NULL ? (uint32_t)duet_kv_pool_n_free(kv) : 0;
    hb.running          = running;
    hb.queued           = queued;
    hb.queued_tokens    = queued_tokens;
    hb.draining         = g.draining;
    hb.decode_steps     = g.decode_steps;
    hb.decode_seq_steps = g.decode_seq_steps;
    hb.decoded_tokens   = g.decoded_tokens;
    hb.step_seconds     = g.step_seconds;
    hb.prefill_tokens   = g.prefill_tokens;
    duet_worker_rt_heartbeat(&g.rt, &hb);
}

/* Layer hook: a long step still heartbeats between layers, so the router does not take a busy
 * worker for a dead one. */
static void gen_on_layer(void *user, int64_t layer, int64_t mla, int64_t kda)
{
    if (duet_worker_rt_heartbeat_due(&g.rt))
        gen_heartbeat();
    /* keep UCX moving between layers (handshakes, tcp puts into our pools); the outcomes touch
     * only RECEIVING requests, never one in the running step */
    duet_worker_pump_progress(&g.pump);
}

/* Every heartbeat period: end quarantines and overdue requests, then heartbeat. */
static void gen_tick(uv_timer_t *t)
{
    double   now  = duet_worker_now();
    uint64_t wall = duet_xfer_now_unix_ms();
    for (int64_t i = 0; i < g.n_reqs; i++) {
        gr_t *r = &g.reqs[i];
        if (r->phase == GR_QUARANTINE && now >= r->release_at) {
            gr_free(r);
            continue;
        }
        if (r->phase == GR_FREE || r->phase == GR_QUARANTINE)
            continue;
        if (r->deadline_unix_ms != 0 && wall > r->deadline_unix_ms &&
            r->phase != GR_RECEIVING) { /* a reservation's deadline is the transfer layer's */
            DUET_RLOG_WARN(r->rid, "deadline passed: ending the request");
            duet_worker_send_tokens(g.rt.link, r->rid, NULL, 0, DUET__TOKENS__FINISH_REASON__ERROR,
                                    "the request's deadline passed");
            gr_free(r);
        }
    }
    gen_heartbeat();
    gen_update_idle();
}

int main(int argc, char **argv)
{
    int rc = duet_worker_configure(
        gen_keys, sizeof(gen_keys) / sizeof(gen_keys[0]), argc, argv, "duet-gen",
        "duet-gen --router HOST:PORT --model DIR [options]\n\n"
        "The generation worker: reserves cache pages for requests, receives their prefilled "
        "caches from context workers over UCX (or prefills short prompts itself), and decodes "
        "them in a continuous batch.",
        &g.cfg);
    if (rc >= 0)
        return rc;
    const char *dir = duet_config_get_string(g.cfg, "model.dir");
    g.quarantine_ms = (uint32_t)duet_config_get_int(g.cfg, "cache.quarantine_ms");
    g.slack         = duet_config_get_int(g.cfg, "cache.slack_tokens");
    g.chunk         = duet_config_get_int(g.cfg, "batch.prefill_chunk");
    g.budget        = duet_config_get_int(g.cfg, "batch.max_tokens");
    if (g.chunk > g.budget) {
        fprintf(stderr, "duet-gen: batch.prefill_chunk (%lld) must not exceed batch.max_tokens "
                        "(%lld)\n", (long long)g.chunk, (long long)g.budget);
        return 2;
    }
    duet_status_t        st;
    duet_xfer_ctx_opts_t xo;
    duet_xfer_ctx_opts_default(&xo);
    xo.recv_no_abort_back = true; /* the router cancels the context worker itself */
    if ((st = duet_xfer_ctx_create(&xo, &g.x)) != DUET_OK) {
        fprintf(stderr, "duet-gen: cannot start UCX: %s\n", duet_error_last());
        return 1;
    }
    duet_model_opts_t mo;
    duet_worker_model_opts(g.cfg, &mo);
    /* receiving pools: a GPU model's device pools when UCX can write them; else UCX segments
     * on the host (shm puts are copies) that a GPU model copies received sequences from */
    const bool device_pools = duet_worker_device_pools(g.cfg, &mo, g.x);
    mo.mirror_in = !device_pools;
    mo.device_pools_shared = device_pools;
    mo.pool_alloc = device_pools ? NULL : gen_pool_alloc;
    if ((st = duet_model_load(dir, &mo, &g.m)) != DUET_OK) {
        fprintf(stderr, "duet-gen: cannot load %s: %s\n", dir, duet_error_last());
        duet_xfer_ctx_destroy(g.x);
        return 1;
    }
    if (device_pools && (st = duet_worker_register_pools(g.x, g.m, true)) != DUET_OK) {
        fprintf(stderr, "duet-gen: cannot register the device pools with UCX: %s\n",
                duet_error_last());
        duet_xfer_ctx_destroy(g.x);
        return 1;
    }
    if (!device_pools)
        DUET_LOG_INFO("transfers move the host pools");
    g.V           = duet_model_config(g.m)->vocab_size;
    g.page_tokens = mo.page_tokens;
    g.n_reqs      = mo.max_seqs;
    duet_worker_layout(g.m, &g.layout);
    duet_model_set_layer_hook(g.m, gen_on_layer, NULL);
    g.reqs     = calloc((size_t)g.n_reqs, sizeof(*g.reqs));
    g.items    = calloc((size_t)g.n_reqs, sizeof(*g.items));
    g.item_req = calloc((size_t)g.n_reqs, sizeof(*g.item_req));
    g.pre      = calloc((size_t)g.n_reqs, sizeof(*g.pre));
    g.tok      = calloc((size_t)g.n_reqs, sizeof(*g.tok));
    if (g.reqs == NULL || g.items == NULL || g.item_req == NULL || g.pre == NULL ||
        g.tok == NULL) {
        fprintf(stderr, "duet-gen: out of memory\n");
        return 1;
    }
    for (int64_t i = 0; i < g.n_reqs; i++)
        g.reqs[i].seq.id = -1;

    uv_loop_t *loop = uv_default_loop();
    if ((st = duet_worker_pump_start(loop, g.x, &g.pump)) != DUET_OK ||
        (st = duet_worker_rt_start(&g.rt, loop, g.cfg, DUET__WORKER_ROLE__WORKER_ROLE_GEN, g.m,
                                   gen_tick, gen_step, gen_on_message)) != DUET_OK) {
        fprintf(stderr, "duet-gen: %s\n", duet_error_last());
        return 1;
    }
    uv_run(loop, UV_RUN_DEFAULT);

    /* leaving: the router fails what still runs here with the Deregister's reason */
    duet_worker_rt_close(&g.rt, &g.pump, "the generation worker is stopping");
    for (int64_t i = 0; i < g.n_reqs; i++)
        if (g.reqs[i].phase != GR_FREE)
            gr_free(&g.reqs[i]);
    duet_model_free(g.m);
    duet_xfer_ctx_destroy(g.x); /* aborts live transfers; the pools were its allocations */
    free(g.reqs);
    free(g.items);
    free(g.item_req);
    free(g.pre);
    free(g.tok);
    duet_config_destroy(g.cfg);
    DUET_LOG_INFO("stopped");
    return 0;
}
