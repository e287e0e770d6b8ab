/*
 * duet-ctx: the context (prefill) worker (docs/architecture.md, "The path of one request", steps
 * 5-7).
 *
 * One process, one libuv loop thread (the engine's thread pool does the math inside a step):
 *   router link (worker/link.h)  Prefill, Cancel, Drain, Undrain in; Tokens, Heartbeat out
 *   UCX (transfer/xfer.h)        puts into the generation worker's reserved pages
 *   an idle handle               one prefill step per loop turn while prompts wait
 *
 * A request (cr_t):
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
 */
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

static const duet_config_key_t ctx_keys[] = {
    DUET_WORKER_CONFIG_KEYS,
    {"batch.max_seqs", DUET_CONFIG_INT, "8", "prompts prefilled or sending at once", .min = "1",
     .max = "65536"},
    {"batch.max_tokens", DUET_CONFIG_INT, "512",
     "prompt tokens per step at most: a smaller step finishes the oldest prompts sooner (lower "
     "TTFT), a larger one batches more prompts per step", .min = "1", .max = "1048576"},
    {"batch.max_queue", DUET_CONFIG_INT, "256", "prompts waiting for a slot at most", .min = "0",
     .max = "1000000"},
    {"transfer.checksum", DUET_CONFIG_BOOL, "false",
     "send an XXH3-64 of each transfer's bytes (the gen worker verifies it; host pools only: "
     "not with transfer.device_pools moving the GPU's pools)", .min = NULL},
};

typedef enum {
    CR_FREE = 0,
    CR_WAITING,
    CR_PREFILL,
    CR_SENDING,
} cr_phase_t;

typedef struct {
    uint64_t                rid;
    cr_phase_t              phase;
    duet_seq_t              seq;
    int32_t                *prompt; /* (n_prompt) owned */
    int64_t                 n_prompt, prefilled;
    uint32_t                max_tokens;
    duet_worker_sampling_t  sampling;
    duet_xfer_reservation_t res; /* decoded; owns its message */
    duet_xfer_id_t          xid;
    bool                    xfer_live; /* started, outcome not yet reported */
    bool                    ended;     /* the router was told the end; free at the outcome */
    bool                    last_in_step;
    int32_t                 first;
    uint64_t                arrival;
    uint64_t                deadline_unix_ms;
    double                  t_arrive;
    double                  t_admit; /* when its transfer started */
} cr_t;

static struct {
    duet_config_t     *cfg;
        duet_model_t      *m;
    duet_xfer_ctx_t   *x;
    duet_worker_pump_t   pump;
    duet_xfer_layout_t layout;
    duet_worker_rt_t   rt;
    cr_t              *reqs; /* [n_reqs] = max_seqs + max_queue */
    int64_t            n_reqs, max_seqs, open_seqs;
    int64_t            V, chunk, budget;
    bool               checksum, draining;
    uint64_t           arrivals;
    duet_batch_item_t *items;
    cr_t             **item_req;
    cr_t             **order;
    uint64_t           prefill_tokens;
    /* outcomes that arrive while a step runs (UCX progress in the layer hook) wait for its end:
     * their handler frees sequences the step may still be using */
    bool               in_step;
    struct ctx_deferred {
        duet_xfer_outcome_t o;
        char                msg[256];
    }                 *deferred; /* [n_reqs]: one outcome per transfer at most */
    int64_t            n_deferred;
} c;

/* ------------------------------------------------------------------------------ requests */

static cr_t *cr_find(uint64_t rid)
{
    for (int64_t i = 0; i < c.n_reqs; i++)
        if (c.reqs[i].phase != CR_FREE && c.reqs[i].rid == rid)
            return &c.reqs[i];
    return NULL;
}

static cr_t *cr_find_xfer(duet_xfer_id_t id)
{
    for (int64_t i = 0; i < c.n_reqs; i++)
        if (c.reqs[i].phase != CR_FREE && c.reqs[i].xfer_live && c.reqs[i].xid == id)
            return &c.reqs[i];
    return NULL;
}

static void cr_free(cr_t *r)
{
    if (r->seq.id >= 0) {
        duet_model_seq_close(c.m, &r->seq);
        c.open_seqs--;
    }
    duet_xfer_reservation_free(&r->res);
    free(r->prompt);
    memset(r, 0, sizeof(*r));
    r->seq.id = -1;
}

/*
 * End a request from our side with a final Tokens (CANCELLED or ERROR). A live transfer is
 * cancelled first; its pages are freed when its outcome comes (cr_free then).
 */
static void cr_end(cr_t *r, int finish, const char *error)
{
    if (!r->ended)
        duet_worker_send_tokens(c.rt.link, r->rid, NULL, 0, finish, error);
    r->ended = true;
    if (r->xfer_live) {
        (void)duet_xfer_send_cancel(c.x, r->xid, error != NULL ? error : "cancelled");
        return; /* the outcome callback frees */
    }
    cr_free(r);
}

static void ctx_update_idle(void);
static void ctx_on_xfer(const duet_xfer_outcome_t *o, void *user);

/* Give waiting requests a sequence and start their transfers, oldest first. */
static void ctx_admit(void)
{
    if (c.rt.stopping)
        return;
    for (;;) {
        cr_t *best = NULL;
        for (int64_t i = 0; i < c.n_reqs; i++)
            if (c.reqs[i].phase == CR_WAITING && !c.reqs[i].ended &&
                (best == NULL || c.reqs[i].arrival < best->arrival))
                best = &c.reqs[i];
        if (best == NULL || c.open_seqs >= c.max_seqs)
            break;
        cr_t *r = best;
        if (duet_model_seq_open(c.m, r->n_prompt, &r->seq) != DUET_OK) {
            r->seq.id = -1;
            if (c.open_seqs > 0)
                break; /* pages come back when a running prompt finishes */
            cr_end(r, DUET__TOKENS__FINISH_REASON__ERROR, duet_error_last());
            continue;
        }
        c.open_seqs++;
        duet_xfer_send_args_t a = {
            .req_id       = r->rid,
            .reservations = &r->res,
            .n_ranks      = 1,
            .layout       = c.layout,
            .src          = {.pages = r->seq.pages, .n_pages = (uint32_t)r->seq.n_pages,
                             .kda_slot = r->seq.kda_slot, .n_tokens = (uint64_t)r->n_prompt},
            .checksum     = c.checksum,
            .cb           = ctx_on_xfer,
        };
        if (c.layout.n_mla_layers == 0)
            a.src.n_pages = 0;
        if (duet_xfer_send_start(c.x, &a, &r->xid) != DUET_OK) {
            char msg[384];
            snprintf(msg, sizeof(msg), "cannot start the KV cache transfer: %s",
                     duet_error_last());
            DUET_RLOG_WARN(r->rid, "%s", msg);
            cr_end(r, DUET__TOKENS__FINISH_REASON__ERROR, msg);
            continue;
        }
        r->xfer_live = true;
        r->phase     = CR_PREFILL;
        r->t_admit   = duet_worker_now();
    }
    ctx_update_idle();
}

/* ------------------------------------------------------------------------------ transfer */

static void ctx_on_xfer(const duet_xfer_outcome_t *o, void *user)
{
    if (c.in_step && c.n_deferred < c.n_reqs) {
        struct ctx_deferred *d = &c.deferred[c.n_deferred++];
        d->o                   = *o;
        snprintf(d->msg, sizeof(d->msg), "%s", o->message != NULL ? o->message : "");
        d->o.message = d->msg;
        return;
    }
    cr_t *r = cr_find_xfer(o->id);
    if (r == NULL)
        return;
    r->xfer_live = false;
    if (r->ended) {
        cr_free(r);
        ctx_admit();
        return;
    }
    if (o->kind == DUET_XFER_OUTCOME_DONE && r->phase == CR_SENDING) {
        int finish = DUET__TOKENS__FINISH_REASON__NONE;
        if (duet_worker_is_stop(&r->sampling, r->first))
            finish = DUET__TOKENS__FINISH_REASON__STOP;
        else if (r->max_tokens <= 1)
            finish = DUET__TOKENS__FINISH_REASON__LENGTH;
        uint32_t id = (uint32_t)r->first;
        DUET_RLOG_DEBUG(r->rid, "prefilled %lld tokens, cache sent (%llu bytes, %.3f ms)",
                        (long long)r->n_prompt, (unsigned long long)o->bytes, o->seconds * 1e3);
        duet_worker_send_tokens(c.rt.link, r->rid, &id, 1, finish, NULL);
        cr_free(r);
    } else {
        char msg[384];
        snprintf(msg, sizeof(msg), "the KV cache transfer to the generation worker failed (%s): %s",
                 duet_xfer_reason_str(o->reason), o->message);
        DUET_RLOG_WARN(r->rid, "%s", msg);
        r->ended = true;
        duet_worker_send_tokens(c.rt.link, r->rid, NULL, 0, DUET__TOKENS__FINISH_REASON__ERROR, msg);
        cr_free(r);
    }
    ctx_admit();
}

/* Layer hook: the step's finished prompts stream MLA layer `mla` now. */
static void ctx_heartbeat(void);
static void ctx_on_layer(void *user, int64_t layer, int64_t mla, int64_t kda)
{
    if (duet_worker_rt_heartbeat_due(&c.rt)) /* a long step still shows the worker alive */
        ctx_heartbeat();
    if (mla >= 0)
        for (int64_t i = 0; i < c.n_reqs; i++) {
            cr_t *r = &c.reqs[i];
            if (r->phase == CR_PREFILL && r->last_in_step && r->xfer_live)
                (void)duet_xfer_send_layer_ready(c.x, r->xid, (uint32_t)mla);
        }
    /* keep UCX moving between layers: connection handshakes and puts (over tcp the sender must
     * progress) do not wait for the step; outcomes are deferred to its end (c.in_step) */
    duet_worker_pump_progress(&c.pump);
}

/* ------------------------------------------------------------------------------ messages */

static void ctx_on_prefill(const Duet__Prefill *m)
{
    const char *why = NULL;
    char        buf[320];
    if (c.draining)
        why = "this context worker is draining";
    else if (cr_find(m->request_id) != NULL)
        why = "a request with this id is already here";
    else if (m->n_tokens == 0)
        why = "empty prompt";
    else if ((int64_t)m->n_tokens > duet_model_opts(c.m)->max_seq_len) {
        snprintf(buf, sizeof(buf), "a %zu-token prompt exceeds this worker's cache.max_seq_len %lld",
                 m->n_tokens, (long long)duet_model_opts(c.m)->max_seq_len);
        why = buf;
    }
    for (size_t i = 0; why == NULL && i < m->n_tokens; i++)
        if ((int64_t)m->tokens[i] >= c.V)
            why = "a prompt token is outside the vocabulary";
    cr_t *r = NULL;
    for (int64_t i = 0; why == NULL && i < c.n_reqs && r == NULL; i++)
        if (c.reqs[i].phase == CR_FREE)
            r = &c.reqs[i];
    if (why == NULL && r == NULL)
        why = "the context worker's queue is full";
    duet_xfer_reservation_t res = {0};
    if (why == NULL &&
        duet_xfer_reservation_decode(m->reservation.data, m->reservation.len, 0, &res) != DUET_OK) {
        snprintf(buf, sizeof(buf), "unusable reservation: %s", duet_error_last());
        why = buf;
    }
    if (why != NULL) {
        DUET_RLOG_INFO(m->request_id, "prefill refused: %s", why);
        duet_worker_send_tokens(c.rt.link, m->request_id, NULL, 0,
                                DUET__TOKENS__FINISH_REASON__ERROR, why);
        return;
    }
    r->prompt = malloc(sizeof(int32_t) * m->n_tokens);
    if (r->prompt == NULL) {
        duet_xfer_reservation_free(&res);
        duet_worker_send_tokens(c.rt.link, m->request_id, NULL, 0,
                                DUET__TOKENS__FINISH_REASON__ERROR, "out of memory");
        return;
    }
    for (size_t i = 0; i < m->n_tokens; i++)
        r->prompt[i] = (int32_t)m->tokens[i];
    r->rid              = m->request_id;
    r->phase            = CR_WAITING;
    r->seq.id           = -1;
    r->n_prompt         = (int64_t)m->n_tokens;
    r->max_tokens       = m->max_tokens;
    r->res              = res;
    r->arrival          = ++c.arrivals;
    r->deadline_unix_ms = m->deadline_unix_ms;
    r->t_arrive         = duet_worker_now();
    duet_worker_sampling_init(&r->sampling, m->sampling, r->rid);
    ctx_admit();
}

static void ctx_on_cancel(const Duet__Cancel *m)
{
    cr_t *r = cr_find(m->request_id);
    if (r == NULL || r->ended)
        return;
    DUET_RLOG_DEBUG(r->rid, "cancelled: %s", m->reason);
    cr_end(r, DUET__TOKENS__FINISH_REASON__CANCELLED, NULL);
    ctx_admit();
}

static void ctx_on_message(const Duet__Envelope *env, void *user)
{
    switch (env->body_case) {
    case DUET__ENVELOPE__BODY_PREFILL: ctx_on_prefill(env->prefill); break;
    case DUET__ENVELOPE__BODY_CANCEL: ctx_on_cancel(env->cancel); break;
    case DUET__ENVELOPE__BODY_DRAIN:
        DUET_LOG_INFO("draining: no new prompts; the queued ones finish");
        c.draining = true;
        break;
    case DUET__ENVELOPE__BODY_UNDRAIN:
        DUET_LOG_INFO("undrained: taking prompts again");
        c.draining = false;
        break;
    default:
        DUET_LOG_WARN("ignoring a message with body %d from the router", (int)env->body_case);
        break;
    }
}

/* ------------------------------------------------------------------------------ step */

static int cr_by_arrival(const void *a, const void *b)
{
    const cr_t *x = *(cr_t *const *)a, *y = *(cr_t *const *)b;
    return x->arrival < y->arrival ? -1 : x->arrival > y->arrival;
}

/*
 * How long a prompt's first step may wait for the handshake with its generation worker. During
 * a step UCX moves only in the layer hook, so a handshake begun just before a long step would
 * stretch over it, the generation worker's reply pending on a connection to us the whole time;
 * were we killed then, that worker's UCX (1.13.1) would abort on an assertion while purging the
 * reply. Waiting here closes that window to the handshake's own time (about a millisecond on
 * one host); past the bound the step runs anyway and the handshake ends in the layer hook.
 */
#define CTX_CONNECT_WAIT_S 2.0

static bool cr_waits_for_peer(const cr_t *r, double now)
{
    return r->prefilled == 0 && r->xfer_live && now - r->t_admit < CTX_CONNECT_WAIT_S &&
           duet_xfer_send_connecting(c.x, r->xid);
}

static void ctx_step(uv_idle_t *h)
{
    double now = duet_worker_now();
    for (int64_t i = 0; i < c.n_reqs; i++)
        if (c.reqs[i].phase == CR_PREFILL && !c.reqs[i].ended &&
            cr_waits_for_peer(&c.reqs[i], now)) {
            duet_worker_pump_progress(&c.pump); /* outside a step: outcomes are handled here */
            now = duet_worker_now();
            break;
        }
    int64_t n_pre = 0;
    for (int64_t i = 0; i < c.n_reqs; i++)
        if (c.reqs[i].phase == CR_PREFILL && !c.reqs[i].ended &&
            !cr_waits_for_peer(&c.reqs[i], now))
            c.order[n_pre++] = &c.reqs[i];
    qsort(c.order, (size_t)n_pre, sizeof(c.order[0]), cr_by_arrival);
    int64_t n = 0, budget = c.budget, tokens = 0;
    for (int64_t i = 0; i < n_pre; i++) {
        cr_t   *r   = c.order[i];
        int64_t end = duet_worker_chunk_end(r->prefilled, r->n_prompt, c.chunk);
        int64_t len = end - r->prefilled;
        if (len > budget)
            continue; /* whole chunks only: the cut must match duet-generate's */
        r->last_in_step = end == r->n_prompt;
        /* the prompt's last chunk draws the first token inside the step (on the device for a
         * CUDA model): the request's rule and its next draw, as duet_sampler_sample would */
        c.items[n] = (duet_batch_item_t){
            .seq = &r->seq, .tokens = r->prompt + r->prefilled, .n_tokens = len,
            .logits_mode = r->last_in_step ? DUET_LOGITS_TOKEN : DUET_LOGITS_NONE};
        if (r->last_in_step) {
            c.items[n].sampling  = r->sampling.sp;
            c.items[n].u         = duet_sampling_draw(&r->sampling.sp, &r->sampling.rng);
            c.items[n].token_out = &r->first;
        }
        if (r->prefilled == 0 && r->xfer_live) /* test_cluster reads this line */
            DUET_RLOG_DEBUG(r->rid, "first prefill step %.2f ms after the transfer started (%s)",
                            (now - r->t_admit) * 1e3,
                            duet_xfer_send_connecting(c.x, r->xid) ? "still connecting"
                                                                   : "connected");
        c.item_req[n] = r;
        n++;
        budget -= len;
        tokens += len;
    }
    if (n == 0) {
        ctx_update_idle();
        return;
    }
    c.in_step        = true;
    duet_status_t st = duet_model_forward(c.m, c.items, n);
    c.in_step        = false;
    for (int64_t i = 0; i < n; i++) {
        cr_t *r         = c.item_req[i];
        bool  last      = r->last_in_step;
        r->last_in_step = false;
        if (st != DUET_OK) {
            cr_end(r, DUET__TOKENS__FINISH_REASON__ERROR, duet_error_last());
            continue;
        }
        r->prefilled += c.items[i].n_tokens;
        if (!last)
            continue;
        r->phase = CR_SENDING; /* r->first was drawn by the step */
        if (r->xfer_live)
            (void)duet_xfer_send_kda_ready(c.x, r->xid);
        DUET_RLOG_DEBUG(r->rid, "prefill done in %.1f ms since arrival",
                        (duet_worker_now() - r->t_arrive) * 1e3);
    }
    if (st != DUET_OK)
        DUET_LOG_ERROR("prefill step failed: %s", duet_error_last());
    else
        c.prefill_tokens += (uint64_t)tokens;
    for (int64_t i = 0; i < c.n_deferred; i++) /* outcomes that came during the step */
        ctx_on_xfer(&c.deferred[i].o, NULL);
    c.n_deferred = 0;
    ctx_update_idle();
}

static void ctx_update_idle(void)
{
    bool work = false;
    for (int64_t i = 0; i < c.n_reqs && !work; i++)
        work = c.reqs[i].phase == CR_PREFILL && !c.reqs[i].ended;
    duet_worker_rt_busy(&c.rt, work);
}

/* ------------------------------------------------------------------------------ heartbeat */

/* Heartbeat from the current state; no side effects, so the layer hook may call it mid-step. */
static void ctx_heartbeat(void)
{
    uint32_t running = 0, queued = 0;
    uint64_t queued_tokens = 0;
    for (int64_t i = 0; i < c.n_reqs; i++) {
        const cr_t *r = &c.reqs[i];
        if (r->phase == CR_FREE || r->ended)
            continue;
        if (r->phase == CR_WAITING) {
            queued++;
            queued_tokens += (uint64_t)r->n_prompt;
        } else {
            running++;
            queued_tokens += (uint64_t)(r->n_prompt - r->prefilled);
        }
    }
    duet_kv_pool_t *kv = duet_model_kv_pool(c.m);
    Duet__Heartbeat hb = DUET__HEARTBEAT__INIT;
    hb.free_pages      = kv != NULL ? (uint32_t)duet_kv_pool_n_free(kv) : 0;
    hb.running         = running;
    hb.queued          = queued;
    hb.queued_tokens   = queued_tokens;
    hb.draining        = c.draining;
    hb.prefill_tokens  = c.prefill_tokens;
    duet_worker_rt_heartbeat(&c.rt, &hb);
}

/* Every heartbeat period: end overdue requests, heartbeat, admit waiting ones. */
static void ctx_tick(uv_timer_t *t)
{
    uint64_t wall = duet_xfer_now_unix_ms();
    for (int64_t i = 0; i < c.n_reqs; i++) {
        cr_t *r = &c.reqs[i];
        if (r->phase == CR_FREE || r->ended)
            continue;
        if (r->deadline_unix_ms != 0 && wall > r->deadline_unix_ms) {
            DUET_RLOG_WARN(r->rid, "deadline passed before the prefill finished");
            cr_end(r, DUET__TOKENS__FINISH_REASON__ERROR,
                   "the request's deadline passed before its prefill finished");
        }
    }
    ctx_heartbeat();
    ctx_admit();
}

int main(int argc, char **argv)
{
    int rc = duet_worker_configure(
        ctx_keys, sizeof(ctx_keys) / sizeof(ctx_keys[0]), argc, argv, "duet-ctx",
        "duet-ctx --router HOST:PORT --model DIR [options]\n\n"
        "The context worker: prefills prompts in token-budgeted batches and puts each finished "
        "layer's KV pages, then the KDA state, into the pages a generation worker reserved "
        "(UCX), then returns the first token to the router.",
        &c.cfg);
    if (rc >= 0)
        return rc;
    const char *dir = duet_config_get_string(c.cfg, "model.dir");
    c.chunk         = duet_config_get_int(c.cfg, "batch.prefill_chunk");
    c.budget        = duet_config_get_int(c.cfg, "batch.max_tokens");
    c.checksum      = duet_config_get_bool(c.cfg, "transfer.checksum");
    if (c.chunk > c.budget) {
        fprintf(stderr, "duet-ctx: batch.prefill_chunk (%lld) must not exceed batch.max_tokens "
                        "(%lld)\n", (long long)c.chunk, (long long)c.budget);
        return 2;
    }
    duet_status_t        st;
    duet_xfer_ctx_opts_t xo;
    duet_xfer_ctx_opts_default(&xo);
    if ((st = duet_xfer_ctx_create(&xo, &c.x)) != DUET_OK) {
        fprintf(stderr, "duet-ctx: cannot start UCX: %s\n", duet_error_last());
        return 1;
    }
    duet_model_opts_t mo;
    duet_worker_model_opts(c.cfg, &mo);
    /* sending pools: UCX reads a GPU model's device pools directly when it can, else each
     * layer is staged in the host pools the puts read */
    const bool device_pools = duet_worker_device_pools(c.cfg, &mo, c.x);
    mo.mirror_out = !device_pools;
    if ((st = duet_model_load(dir, &mo, &c.m)) != DUET_OK) {
        fprintf(stderr, "duet-ctx: cannot load %s: %s\n", dir, duet_error_last());
        duet_xfer_ctx_destroy(c.x);
        return 1;
    }
    if ((st = duet_worker_register_pools(c.x, c.m, device_pools)) != DUET_OK) {
        fprintf(stderr, "duet-ctx: cannot register the cache pools with UCX: %s\n",
                duet_error_last());
        return 1;
    }
    duet_worker_layout(c.m, &c.layout);
    duet_model_set_layer_hook(c.m, ctx_on_layer, NULL);
    c.V        = duet_model_config(c.m)->vocab_size;
    c.max_seqs = mo.max_seqs;
    c.n_reqs   = mo.max_seqs + duet_config_get_int(c.cfg, "batch.max_queue");
    c.reqs     = calloc((size_t)c.n_reqs, sizeof(*c.reqs));
    c.items    = calloc((size_t)c.max_seqs, sizeof(*c.items));
    c.item_req = calloc((size_t)c.max_seqs, sizeof(*c.item_req));
    c.order    = calloc((size_t)c.n_reqs, sizeof(*c.order));
    c.deferred = calloc((size_t)c.n_reqs, sizeof(*c.deferred));
    if (c.reqs == NULL || c.items == NULL || c.item_req == NULL || c.order == NULL ||
        c.deferred == NULL) {
        fprintf(stderr, "duet-ctx: out of memory\n");
        return 1;
    }
    for (int64_t i = 0; i < c.n_reqs; i++)
        c.reqs[i].seq.id = -1;

    uv_loop_t *loop = uv_default_loop();
    if ((st = duet_worker_pump_start(loop, c.x, &c.pump)) != DUET_OK ||
        (st = duet_worker_rt_start(&c.rt, loop, c.cfg, DUET__WORKER_ROLE__WORKER_ROLE_CTX, c.m,
                                   ctx_tick, ctx_step, ctx_on_message)) != DUET_OK) {
        fprintf(stderr, "duet-ctx: %s\n", duet_error_last());
        return 1;
    }
    uv_run(loop, UV_RUN_DEFAULT);

    duet_worker_rt_close(&c.rt, &c.pump, "the context worker is stopping");
    /* aborts live transfers (their callbacks run; nothing is reported any more) */
    for (int64_t i = 0; i < c.n_reqs; i++)
        c.reqs[i].ended = true;
    duet_xfer_ctx_destroy(c.x);
    for (int64_t i = 0; i < c.n_reqs; i++)
        if (c.reqs[i].phase != CR_FREE)
            cr_free(&c.reqs[i]);
    duet_model_free(c.m);
    free(c.reqs);
    free(c.items);
    free(c.item_req);
    free(c.order);
    free(c.deferred);
    duet_config_destroy(c.cfg);
    DUET_LOG_INFO("stopped");
    return 0;
}
