/*
 * duet-router's request state machine (docs/architecture.md, "The path of one request"). One rq_t
 * per engine request, all on the loop thread; a client request is an rq_group_t of n of them (its
 * `n` choices, each its own engine request: see rq_group_t), most often one:
 *
 *   NEW         validated and tokenized (duet__rq_begin) -> admission: run now, queue, or refuse
 *   QUEUED      waits in admission's bounded FIFO (429 / 503 with Retry-After when refused)
 *   RESERVING   Reserve sent to a gen worker   <- Reserved (-> PREFILLING) | Refused (next gen,
 *                                                 else 429)
 *   PREFILLING  Prefill + reservation sent to a ctx worker   <- Tokens (the first token), then
 *                                                 PrefillDone to the gen worker
 * A Helix generation group's Reserved carries one reservation per rank (more_reservations: ranks
 * 1..); the router keeps them, opaque, with the request (at most DUET_XFER_MAX_RANKS in all, each
 * within DUET_XFER_RESERVATION_MAX_BYTES, else the request fails naming the worker) and puts them
 * into the Prefill. A move into a group is not supported: such a Reserved refuses the move.
 *   GENERATING  the gen worker streams Tokens (after PrefillDone, or at once after Generate when
 *               the prompt is shorter than placement.local_prefill_tokens)
 *
 * Moving (docs/architecture.md, "Moving a running request"): a GENERATING request on a gen worker
 * drained with migrate moves to another one, beside its phase (r->move):
 *   MV_PAUSING    MovePause sent to the source (gen_id)  <- MovePaused: ok (-> MV_RESERVING), or
 *                                                           not decoding yet (retried later)
 *   MV_RESERVING  Reserve with the MoveState sent to the target (move_to)  <- Reserved: MoveOut
 *                 to the source (-> MV_SENDING) | Refused: the next target, else MoveCancel
 *   MV_SENDING    the source puts the caches into the target's pages  <- Moved: ok: gen_id becomes
 *                 the target, PrefillDone to it; failed: Cancel to the target, the source goes on
 * Until Moved(ok) the source owns the request and its Tokens are the stream; the target's are
 * ignored. Whatever ends the request cancels both. A source lost mid-move fails the request
 * (502); a target lost mid-move sends the source MoveCancel and the source goes on.
 *
 * Tokens go through the openai stream state (detokenization, stop strings, max_tokens) to the
 * client, as SSE chunks or one JSON body. SSE headers go out with the first token, so every
 * failure before it is a proper HTTP status; after it, an SSE error event.
 *
 * With tools offered, each choice's text goes through the Kimi K2 tool-call parser
 * (router/api/tools.h) before it reaches the client.
 *
 * Ending. rq_end() is the only exit and runs exactly once per request (guarded by r->done),
 * early failures included: it cancels whatever a worker still runs for it (client disconnect,
 * deadline, stop string, error), gives the admission slot back (which may start a queued
 * request) and releases the HTTP request. A request whose context worker dies (or fails) before
 * the first token is prefilled once more on another context worker; any other loss fails it with
 * a message that names the worker and the reason.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jansson.h>

#include "common/log.h"
#include "common/strbuf.h"
#include "proto/envelope.h"
#include "router/api/openai_logprobs.h"
#include "router/router_impl.h"
#include "transfer/plan.h"        /* DUET_XFER_MAX_RANKS (constants only) */
#include "transfer/reservation.h" /* DUET_XFER_RESERVATION_MAX_BYTES */

typedef enum {
    RQ_NEW = 0,    /* not queued, not started (also: left the queue without starting) */
    RQ_QUEUED,     /* waiting in admission */
    RQ_RESERVING,  /* Reserve sent to gen_id */
    RQ_PREFILLING, /* Prefill sent to ctx_id */
    RQ_GENERATING, /* gen_id streams (after PrefillDone, or Generate) */
} rq_phase_t;

typedef enum {
    MV_NONE = 0,
    MV_PAUSING,   /* MovePause sent to gen_id */
    MV_RESERVING, /* Reserve (with move) sent to move_to */
    MV_SENDING,   /* MoveOut sent to gen_id: its caches go to move_to */
} rq_move_t;

#define RQ_MAX_EXCLUDE   8
#define RQ_MOVE_ATTEMPTS 3   /* moves of one request that may fail before the router gives up */
#define RQ_MOVE_RETRY_MS 200 /* a source not ready to move (not decoding yet) is asked again */

/*
 * One client request: the HTTP exchange and its n choices (the request's `n`), each an rq_t
 * placed and run like a request of its own; it ends when its last choice has ended. What is sent
 * back is the group's: choice i's chunks carry index i, the non-streaming body and the usage come
 * once all n finished. A failure of any choice fails the whole response (a status when nothing
 * was sent yet, else one SSE error event and [DONE]) and cancels the other choices.
 */
typedef struct rq_group {
    duet__router_t *rt;
    uint64_t id;               /* its first choice's request id: the response id, logs */
    duet_http_request_t *http; /* one reference, released when the last choice ends */
    duet_oai_request_t oai;    /* owned */
    uint32_t *ids;             /* (n_ids) prompt, owned; the choices share it */
    size_t n_ids;
    duet_prefix_prompt_t prefix; /* the prompt's prefix hashes, for placement (chains owned) */
    duet_oai_resp_meta_t meta;   /* index 0; each choice has a copy with its index */
    char resp_id[32];
    const char *endpoint; /* metric label (a literal) */
    uint64_t t_start_ns;
    bool sse_started, answered;           /* answered: the final bytes or an error went out */
    uint32_t n, n_live, n_finished, hold; /* hold: a loop over choices keeps it alive */
    uint32_t completion_tokens;           /* finished choices' tokens, summed */
    struct rq **choices;                  /* (n) NULL once that choice ended */
    duet_oai_choice_t *results;           /* (n) finished choices, texts owned (non-streaming) */
    double *rank;                         /* (n) best_of > n: each choice's mean logprob */
    uint32_t n_return;                    /* choices answered: oai.n (n runs oai.best_of) */
    uint32_t stop_ids[DUET_OAI_MAX_EOS];  /* (n_stop_ids) the model's EOS ids (unless ignore_eos)
                                             and the request's stop_token_ids */
    size_t n_stop_ids;
    Duet__LogitBias *bias_msgs; /* (oai.lp.n_bias) Sampling.logit_bias, owned */
    Duet__LogitBias **bias_ptrs;
} rq_group_t;

typedef struct rq {
    duet__router_t *rt;
    uint64_t id;
    rq_group_t *g;       /* the client request this choice belongs to */
    uint32_t index;      /* choice index */
    const uint32_t *ids; /* (n_ids) the group's prompt */
    size_t n_ids;
    duet_oai_stream_t *stream; /* owned */
    duet_oai_toolparse_t *tp;  /* owned; the request offers tools: the text's tool calls */
    duet_oai_resp_meta_t meta; /* the group's, with this choice's index */
    rq_phase_t phase;
    bool admitted, local, began, done;    /* began: its first chunk went out (streaming) */
    uint64_t gen_id, ctx_id;              /* 0 = none */
    bool gen_busy, ctx_busy;              /* the worker still works on it (owes Tokens) */
    uint64_t exclude_gen[RQ_MAX_EXCLUDE]; /* gens that refused */
    size_t n_exclude_gen;
    uint64_t exclude_ctx[RQ_MAX_EXCLUDE]; /* ctx workers that failed it */
    size_t n_exclude_ctx;
    int prefill_attempts;
    uint8_t *reservation; /* owned */
    size_t reservation_len;
    ProtobufCBinaryData *more_res; /* (n_more_res) a Helix group's ranks 1..; each owned */
    size_t n_more_res;
    uint64_t t_start_ns, t_first_ns, t_last_ns;
    uint64_t t_admit_ns;  /* when admission let it run (0: never) */
    int status, finish;   /* for the access line and metrics (obs.c): HTTP status, DUET__OBS_* */
    uint64_t deadline_ms; /* uv_now clock */
    uint64_t queue_deadline_ms; /* uv_now clock: how long it may wait in the admission queue */
    uint32_t retry_after_ms;    /* the largest of this attempt's refusals' hints */
    uint32_t requeues;          /* times every gen worker refused it and it waited again */
    uint32_t *out; /* (n_out, cap_out) every generated id so far: a move's MoveState.generated */
    size_t n_out, cap_out;
    /* moving from gen_id to move_to (the file comment) */
    rq_move_t move;
    uint64_t move_to;       /* the target, 0 = none */
    bool move_to_busy;      /* the target holds a reservation for it (owes a final Tokens) */
    int move_attempts;      /* moves started (PAUSING) */
    bool move_given_up;     /* stays where it is */
    uint64_t move_retry_ms; /* uv_now: not before */
    uint64_t move_t0_ns;
    uint64_t move_exclude[RQ_MAX_EXCLUDE]; /* targets that refused this move */
    size_t n_move_exclude;
    struct {
        uint64_t kv_tokens, rng[DUET_PROTO_RNG_WORDS];
        uint32_t replay_rows, produced, next_token;
    } mv; /* the source's MovePaused state */
    /* log-probabilities (NULL when not asked for) and how many the stream has sent */
    duet_oai_lp_t *lp;
    size_t lp_sent;
    struct rq *bucket_next;
} rq_t;

/* Drop the extra reservations of a Helix group (a Reserved's more_reservations). */
static void rq_more_res_free(rq_t *r)
{
    for (size_t i = 0; i < r->n_more_res; i++)
        free(r->more_res[i].data);
    free(r->more_res);
    r->more_res = NULL;
    r->n_more_res = 0;
}

/* ---------------------------------------------------------------- the live-request table */

static void rq_table_add(duet__router_t *rt, rq_t *r)
{
    size_t b = r->id % DUET__RQ_BUCKETS;
    r->bucket_next = rt->buckets[b];
    rt->buckets[b] = r;
    rt->n_rq++;
}

static void rq_table_del(duet__router_t *rt, rq_t *r)
{
    for (rq_t **p = &rt->buckets[r->id % DUET__RQ_BUCKETS]; *p != NULL; p = &(*p)->bucket_next)
        if (*p == r) {
            *p = r->bucket_next;
            rt->n_rq--;
            return;
        }
}

static rq_t *rq_find(duet__router_t *rt, uint64_t id)
{
    for (rq_t *r = rt->buckets[id % DUET__RQ_BUCKETS]; r != NULL; r = r->bucket_next)
        if (r->id == id)
            return r;
    return NULL;
}

/* The ids of every live request, collected first so that the caller may end them (ending one
 * choice can end its siblings: look each id up again with rq_find). */
static size_t rq_collect(duet__router_t *rt, uint64_t **out_p)
{
    uint64_t *v = malloc((rt->n_rq + 1) * sizeof(*v));
    size_t n = 0;
    if (v == NULL)
        return 0;
    for (size_t b = 0; b < DUET__RQ_BUCKETS; b++)
        for (rq_t *r = rt->buckets[b]; r != NULL; r = r->bucket_next)
            v[n++] = r->id;
    *out_p = v;
    return n;
}

/* ---------------------------------------------------------------- helpers */

static void rt_result(duet__router_t *rt, const char *endpoint, const char *result)
{
    duet_metric_t *m;
    const char *const v[2] = {endpoint, result};
    if (duet_metrics_child(rt->f_results, v, 2, &m) == DUET_OK)
        duet_metrics_counter_inc(m);
}

static uint64_t unix_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* The request's deadline on the workers' clock (they compare it with their wall clock). */
static uint64_t rq_deadline_unix_ms(const rq_t *r)
{
    return unix_ms() + (r->deadline_ms - uv_now(r->rt->loop));
}

static void rt_send_cancel(duet__router_t *rt, uint64_t worker_id, uint64_t rid, const char *reason)
{
    Duet__Cancel c = DUET__CANCEL__INIT;
    c.request_id = rid;
    c.reason = (char *)reason;
    Duet__Envelope env = duet_envelope_cancel(&c);
    if (duet_registry_send(rt->reg, worker_id, &env) == DUET_OK)
        DUET_RLOG_DEBUG(rid, "cancel sent to worker %llu: %s", (unsigned long long)worker_id,
                        reason);
}

static void respond_error(duet_http_request_t *http, const duet_oai_error_t *e,
                          uint32_t retry_after_s)
{
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    duet_oai_error_json(e, &sb);
    char ra[24];
    duet_http_header_t h = {"Retry-After", ra};
    snprintf(ra, sizeof(ra), "%u", retry_after_s);
    duet_http_respond(http, e->http_status, "application/json", &h, retry_after_s > 0 ? 1 : 0,
                      sb.data != NULL ? sb.data : "", sb.len);
    duet_strbuf_free(&sb);
}

/* ---------------------------------------------------------------- ending */

static void rq_start(rq_t *r);
static void rq_end(rq_t *r, const char *why);
static void rq_move_reserve(rq_t *r);
static void rq_move_target_gone(rq_t *r, const char *cancel_why);
static void rq_send_move_cancel(rq_t *r, const char *reason);
static void rt_move_result(duet__router_t *rt, const char *result);

/*
 * Let worker *id go from request rid: a Cancel(cancel_why) when it still owes Tokens (*busy; a
 * NULL cancel_why: it holds nothing, it refused or died), its in-flight count back, its
 * `drain --wait` callers told; then *id = 0 and *busy = false. Nothing when *id is 0.
 */
static void rt_release(duet__router_t *rt, uint64_t rid, uint64_t *id, bool *busy,
                       const char *cancel_why)
{
    if (*id == 0)
        return;
    const uint64_t wid = *id;
    if (*busy && cancel_why != NULL)
        rt_send_cancel(rt, wid, rid, cancel_why);
    *id = 0;
    *busy = false;
    duet_registry_inflight_add(rt->reg, wid, -1);
    duet__rt_drain_waiters_check(rt, wid, DUET_OK, NULL);
}

/* Free the group once no choice is live and no loop holds it: the HTTP reference goes. */
static void rq_group_maybe_free(rq_group_t *g)
{
    if (g->n_live > 0 || g->hold > 0)
        return;
    duet_http_request_set_data(g->http, NULL);
    duet_http_request_release(g->http);
    duet_oai_request_free(&g->oai);
    duet_prefix_prompt_free(&g->prefix);
    free(g->ids);
    for (uint32_t i = 0; i < g->n && g->results != NULL; i++) {
        free((char *)g->results[i].text);
        free((char *)g->results[i].tool_calls_json);
        free((char *)g->results[i].logprobs_json);
    }
    free(g->rank);
    free(g->results);
    free(g->bias_msgs);
    free(g->bias_ptrs);
    free(g->choices);
    free(g);
}

/* End every live choice of g (the client went away, or one choice failed the response), each
 * recorded (obs.c) with HTTP `status` and, when it was admitted, `finish` (DUET__OBS_*). */
static void rq_group_end_all(rq_group_t *g, const char *why, int status, int finish)
{
    g->hold++;
    for (uint32_t i = 0; i < g->n; i++) {
        rq_t *c = g->choices[i];
        if (c == NULL)
            continue;
        c->status = status;
        c->finish = c->t_admit_ns != 0 ? finish : -1;
        rq_end(c, why);
    }
    g->hold--;
    rq_group_maybe_free(g);
}

/*
 * The one exit of a choice. Cancels workers that still hold it, hands the admission slot on, and
 * releases it (the group goes with its last choice). Runs once (r->done guards it).
 */
static void rq_end(rq_t *r, const char *why)
{
    if (r->done)
        return;
    r->done = true;
    duet__router_t *rt = r->rt;
    rt_release(rt, r->id, &r->gen_id, &r->gen_busy, why);
    rt_release(rt, r->id, &r->move_to, &r->move_to_busy, why);
    rt_release(rt, r->id, &r->ctx_id, &r->ctx_busy, why);
    uint64_t now = uv_now(rt->loop);
    if (r->admitted) {
        void *next = NULL;
        if (duet_admission_release(rt->adm, now, &next) && next != NULL)
            rq_start((rq_t *)next);
    } else if (r->phase == RQ_QUEUED) {
        duet_admission_cancel(rt->adm, r);
    }
    rq_table_del(rt, r);
    DUET_RLOG_DEBUG(r->id, "request ended: %s", why);
    const duet__obs_request_t rec = {
        .id = r->id,
        .endpoint = r->g->endpoint,
        .status = r->status,
        .finish = r->finish,
        .prompt_tokens = r->n_ids,
        .completion_tokens = r->stream != NULL ? duet_oai_stream_n_tokens(r->stream) : 0,
        .t_start_ns = r->t_start_ns,
        .t_admit_ns = r->t_admit_ns,
        .t_first_ns = r->t_first_ns,
        .t_last_ns = r->t_last_ns,
        .t_end_ns = uv_hrtime(),
    };
    duet__obs_request_end(rt, &rec); /* one access line per engine request (choice) */
    rq_group_t *g = r->g;
    g->choices[r->index] = NULL;
    g->n_live--;
    duet_oai_stream_destroy(r->stream);
    duet_oai_toolparse_destroy(r->tp);
    duet_oai_lp_destroy(r->lp);
    free(r->out);
    free(r->reservation);
    rq_more_res_free(r);
    free(r);
    rq_group_maybe_free(g);
}

/* Fail a request with an OpenAI error: a status when nothing was sent yet, else an SSE event. */
static void rq_fail(rq_t *r, int status, const char *type, const char *code, uint32_t retry_after_s,
                    const char *fmt, ...) __attribute__((format(printf, 6, 7)));
static void rq_fail(rq_t *r, int status, const char *type, const char *code, uint32_t retry_after_s,
                    const char *fmt, ...)
{
    if (r->done)
        return;
    duet_oai_error_t e;
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    duet_oai_error_make(&e, status, type, code, NULL, "%s", msg);
    DUET_RLOG_WARN(r->id, "request failed (%d): %s", status, msg);
    rq_group_t *g = r->g;
    if (g->answered) { /* another choice failed it already */
        rq_end(r, msg);
        return;
    }
    g->answered = true;
    g->hold++; /* until every choice has ended */
    if (!duet_http_request_aborted(g->http)) {
        if (g->sse_started) {
            duet_strbuf_t sb;
            duet_strbuf_init(&sb);
            duet_oai_sse_error(&e, &sb);
            duet_strbuf_puts(&sb, "data: [DONE]\n\n");
            duet_http_stream_write(g->http, sb.data, sb.len);
            duet_http_stream_end(g->http);
            duet_strbuf_free(&sb);
        } else {
            respond_error(g->http, &e, retry_after_s);
        }
    }
    rt_result(r->rt, g->endpoint, status == 429 ? "rejected" : "error");
    r->status = status;
    r->finish = r->t_admit_ns != 0 ? DUET__OBS_ERROR : -1;
    rq_end(r, msg);
    g->hold--;
    rq_group_end_all(g, "another choice of the request failed", status, DUET__OBS_ABORT);
}

/* ---------------------------------------------------------------- logprobs and echo */

/* This choice's "logprobs" for generated positions [from, to) (and the prompt's with with_prompt)
 * in *buf; NULL without logprobs (or when out of memory: the field is then null). */
static const char *rq_logprobs_json(rq_t *r, size_t from, size_t to, bool with_prompt,
                                    duet_strbuf_t *buf)
{
    if (r->lp == NULL || !r->g->oai.lp.logprobs || (from >= to && !with_prompt) ||
        duet_oai_lp_json(r->lp, from, to, with_prompt, buf) != DUET_OK)
        return NULL;
    r->lp_sent = to;
    return buf->data;
}

/* The prompt's text for echo: as the client gave it, or its ids decoded. malloc'd into *len_p
 * bytes; NULL when out of memory or on a decode error. */
static char *rq_prompt_text(const rq_t *r, size_t *len_p)
{
    if (r->g->oai.prompt != NULL) {
        char *t = malloc(r->g->oai.prompt_len + 1);
        if (t != NULL)
            memcpy(t, r->g->oai.prompt, r->g->oai.prompt_len + 1);
        *len_p = r->g->oai.prompt_len;
        return t;
    }
    /* ids: decoded as output is (special tokens the tokenizer skips give no text) */
    const duet_tokenizer_t *tok = r->rt->tok;
    uint32_t *ids = malloc((r->g->oai.n_prompt_ids + 1) * sizeof(*ids));
    if (ids == NULL)
        return NULL;
    size_t n_ids = 0, n = 0;
    for (size_t i = 0; i < r->g->oai.n_prompt_ids; i++)
        if (!r->g->oai.skip_special_tokens ||
            !duet_tokenizer_is_skipped(tok, r->g->oai.prompt_ids[i]))
            ids[n_ids++] = r->g->oai.prompt_ids[i];
    duet_status_t st = duet_tokenizer_decode(tok, ids, n_ids, NULL, 0, &n);
    char *t = st == DUET_OK || st == DUET_ERR_NO_SPACE ? malloc(n + 1) : NULL;
    if (t == NULL || duet_tokenizer_decode(tok, ids, n_ids, t, n, &n) != DUET_OK) {
        free(ids);
        free(t);
        return NULL;
    }
    free(ids);
    t[n] = '\0';
    *len_p = n;
    return t;
}

/* echo (non-streaming): the prompt's text then the output's, malloc'd, *len_p updated; NULL
 * without echo (or on failure: the output alone is sent). */
static char *rq_echo_text(const rq_t *r, const char *text, size_t *len_p)
{
    if (!r->g->oai.lp.echo)
        return NULL;
    size_t plen = 0;
    char *p = rq_prompt_text(r, &plen);
    char *all = p != NULL ? realloc(p, plen + *len_p + 1) : NULL;
    if (all == NULL) {
        free(p);
        return NULL;
    }
    memcpy(all + plen, text, *len_p);
    all[plen + *len_p] = '\0';
    *len_p += plen;
    return all;
}

/* echo (streaming): the prompt's text as the first content chunk, with its logprobs. */
static void rq_echo_chunk(rq_t *r, duet_strbuf_t *sb)
{
    if (!r->g->oai.lp.echo)
        return;
    size_t plen = 0;
    char *p = rq_prompt_text(r, &plen);
    duet_strbuf_t lpj;
    duet_strbuf_init(&lpj);
    r->meta.logprobs_json = rq_logprobs_json(r, 0, 0, true, &lpj);
    if (p != NULL)
        duet_oai_sse_delta(&r->meta, p, plen, sb);
    r->meta.logprobs_json = NULL;
    duet_strbuf_free(&lpj);
    free(p);
}

/* Streaming: the SSE headers (once per group) and this choice's first chunk (chat: its role
 * chunk) into sb; false when the client is gone (on_abort ends the request). */
static bool rq_stream_begin(rq_t *r, duet_strbuf_t *sb)
{
    rq_group_t *g = r->g;
    if (!g->sse_started) {
        if (duet_http_sse_begin(g->http, NULL, 0) != DUET_OK)
            return false;
        g->sse_started = true;
    }
    if (!r->began) {
        r->began = true;
        duet_oai_sse_begin(&r->meta, sb);
        rq_echo_chunk(r, sb);
    }
    return true;
}

/* The choice finished normally: its final bytes (and the response's, when it is the last),
 * metrics, end. */
static bool rq_emit_tools(rq_t *r, const char *text, size_t len, bool end);

/* The choices to answer: all of them, or with best_of > n the n of the highest mean logprob per
 * generated token (OpenAI's rule), best first, ties to the lower index. A shallow copy the
 * caller frees (not its strings), or g->results itself. */
static duet_oai_choice_t *rq_best_of(const rq_group_t *g)
{
    if (g->n_return >= g->n)
        return g->results;
    duet_oai_choice_t *best = malloc(g->n_return * sizeof(*best));
    bool *taken = calloc(g->n, sizeof(*taken));
    if (best == NULL || taken == NULL) { /* the first n then, rather than no answer */
        free(best);
        free(taken);
        return g->results;
    }
    for (uint32_t k = 0; k < g->n_return; k++) {
        uint32_t pick = g->n;
        for (uint32_t i = 0; i < g->n; i++)
            if (!taken[i] && (pick == g->n || g->rank[i] > g->rank[pick]))
                pick = i;
        taken[pick] = true;
        best[k] = g->results[pick];
    }
    free(taken);
    return best;
}

static void rq_complete(rq_t *r, duet_oai_finish_t finish)
{
    duet__router_t *rt = r->rt;
    rq_group_t *g = r->g;
    char *calls = NULL;
    if (r->tp != NULL) { /* the held text settles; a choice that called tools says so */
        if (!rq_emit_tools(r, NULL, 0, true))
            return; /* it failed (and is gone) */
        if (duet_oai_toolparse_n_calls(r->tp) > 0) {
            duet_strbuf_t cj;
            duet_strbuf_init(&cj);
            duet_oai_toolparse_calls_json(r->tp, &cj);
            calls = duet_strbuf_detach(&cj);
            duet_strbuf_free(&cj);
            if (finish == DUET_OAI_FINISH_STOP)
                finish = DUET_OAI_FINISH_TOOL_CALLS;
        }
    }
    uint32_t n_c = duet_oai_stream_n_tokens(r->stream);
    g->completion_tokens += n_c;
    const bool last = ++g->n_finished == g->n;
    duet_strbuf_t sb, lpj;
    duet_strbuf_init(&sb);
    duet_strbuf_init(&lpj);
    if (g->oai.stream) {
        if (rq_stream_begin(r, &sb)) {
            /* the finish chunk carries what no content chunk did (held back by a stop string,
             * the EOS id) */
            r->meta.logprobs_json = rq_logprobs_json(r, r->lp_sent, n_c, false, &lpj);
            duet_oai_sse_finish(&r->meta, finish, &sb);
            if (last)
                duet_oai_sse_done(&g->meta, (uint32_t)g->n_ids, g->completion_tokens, &sb);
            duet_http_stream_write(g->http, sb.data, sb.len);
            if (last)
                duet_http_stream_end(g->http);
        }
    } else {
        const char *text;
        size_t len;
        if (r->tp != NULL)
            duet_oai_toolparse_content(r->tp, &text, &len);
        else
            duet_oai_stream_text(r->stream, &text, &len);
        const char *lp = rq_logprobs_json(r, 0, n_c, g->oai.lp.echo, &lpj);
        char *lp_copy = lp != NULL ? strdup(lp) : NULL;
        char *copy = rq_echo_text(r, text, &len);
        if (copy == NULL && (copy = malloc(len + 1)) != NULL) {
            memcpy(copy, text, len);
            copy[len] = '\0';
        }
        if (copy == NULL || (lp != NULL && lp_copy == NULL) ||
            (r->tp != NULL && duet_oai_toolparse_n_calls(r->tp) > 0 && calls == NULL)) {
            free(copy);
            free(lp_copy);
            duet_strbuf_free(&lpj);
            duet_strbuf_free(&sb);
            g->n_finished--;
            rq_fail(r, 500, "server_error", NULL, 0, "out of memory");
            return;
        }
        g->results[r->index] = (duet_oai_choice_t){.text = copy,
                                                   .len = len,
                                                   .finish = finish,
                                                   .tool_calls_json = calls,
                                                   .logprobs_json = lp_copy};
        calls = NULL;
        if (r->lp != NULL)
            g->rank[r->index] = duet_oai_lp_mean(r->lp, n_c);
        if (last) {
            duet_oai_choice_t *best = rq_best_of(g);
            duet_oai_response_json_n(&g->meta, best, g->n_return, (uint32_t)g->n_ids,
                                     g->completion_tokens, &sb);
            if (best != g->results)
                free(best);
            duet_http_respond(g->http, 200, "application/json", NULL, 0, sb.data, sb.len);
        }
    }
    r->meta.logprobs_json = NULL;
    duet_strbuf_free(&lpj);
    duet_strbuf_free(&sb);
    free(calls);
    if (n_c > 1 && r->t_last_ns > r->t_first_ns)
        duet_metrics_histogram_observe(rt->m_tpot,
                                       (double)(r->t_last_ns - r->t_first_ns) / 1e9 / (n_c - 1));
    duet_metrics_counter_add(rt->m_tok_out, n_c);
    if (last) {
        g->answered = true;
        duet_metrics_histogram_observe(rt->m_e2e, (double)(uv_hrtime() - g->t_start_ns) / 1e9);
        rt_result(rt, g->endpoint, "ok");
    }
    r->status = 200;
    r->finish = finish == DUET_OAI_FINISH_LENGTH ? DUET__OBS_LENGTH : DUET__OBS_STOP;
    rq_end(r, "finished");
}

/* Text of a choice that offers tools through its tool-call parser (`end`: the last), then, when
 * streaming, out as content and tool-call deltas. False when the request failed (r is gone). */
static bool rq_emit_tools(rq_t *r, const char *text, size_t len, bool end)
{
    const duet_oai_tp_event_t *ev = NULL;
    size_t n = 0;
    if (duet_oai_toolparse_feed(r->tp, text, len, end, &ev, &n) != DUET_OK) {
        rq_fail(r, 500, "server_error", NULL, 0, "out of memory");
        return false;
    }
    if (!r->g->oai.stream || n == 0)
        return true;
    duet_strbuf_t sb, d;
    duet_strbuf_init(&sb);
    duet_strbuf_init(&d);
    if (rq_stream_begin(r, &sb)) {
        for (size_t i = 0; i < n; i++) {
            if (ev[i].kind == DUET_OAI_TP_CONTENT) {
                duet_oai_sse_delta(&r->meta, ev[i].text, ev[i].len, &sb);
                continue;
            }
            d.len = 0;
            duet_oai_tool_delta_json(&ev[i], &d);
            duet_oai_sse_delta_json(&r->meta, d.data, d.len, &sb);
        }
        duet_http_stream_write(r->g->http, sb.data, sb.len);
    }
    duet_strbuf_free(&d);
    duet_strbuf_free(&sb);
    return true;
}

/* Emit text now (streaming) or keep it (the stream keeps it for non-streaming). False when the
 * request failed (r is gone). */
static bool rq_emit(rq_t *r, const char *text, size_t len)
{
    if (r->tp != NULL && len > 0)
        return rq_emit_tools(r, text, len, false);
    if (!r->g->oai.stream || len == 0)
        return true;
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    if (rq_stream_begin(r, &sb)) {
        /* the ids fed up to this text: the ones whose text it is (held-back text waits with its
         * logprobs) */
        duet_strbuf_t lpj;
        duet_strbuf_init(&lpj);
        r->meta.logprobs_json =
            rq_logprobs_json(r, r->lp_sent, duet_oai_stream_n_tokens(r->stream), false, &lpj);
        duet_oai_sse_delta(&r->meta, text, len, &sb);
        r->meta.logprobs_json = NULL;
        duet_strbuf_free(&lpj);
        duet_http_stream_write(r->g->http, sb.data, sb.len);
    }
    duet_strbuf_free(&sb);
    return true;
}

/*
 * Feed ids from a worker; returns true when the request ended (it is freed then).
 * worker_finish: the worker's finish_reason for this message.
 */
static bool rq_feed(rq_t *r, const uint32_t *ids, size_t n, int worker_finish)
{
    for (size_t i = 0; i < n; i++) {
        const char *text = NULL;
        size_t len = 0;
        duet_oai_finish_t fin = DUET_OAI_FINISH_NONE;
        if (r->t_first_ns == 0) {
            r->t_first_ns = uv_hrtime();
            if (r->index == 0) /* one TTFT per client request */
                duet_metrics_histogram_observe(r->rt->m_ttft,
                                               (double)(r->t_first_ns - r->t_start_ns) / 1e9);
        }
        const uint64_t now_ns = uv_hrtime();
        duet__obs_token(r->rt, r->t_last_ns, now_ns);
        r->t_last_ns = now_ns;
        duet_status_t st = duet_oai_stream_feed(r->stream, ids[i], &text, &len, &fin);
        if (st < 0) {
            rq_fail(r, 502, "server_error", "bad_worker_output", 0,
                    "worker sent token id %u, which is outside the vocabulary", ids[i]);
            return true;
        }
        if (!rq_emit(r, text, len))
            return true;
        if (fin != DUET_OAI_FINISH_NONE) {
            rq_complete(r, fin);
            return true;
        }
    }
    if (worker_finish == DUET__TOKENS__FINISH_REASON__STOP ||
        worker_finish == DUET__TOKENS__FINISH_REASON__LENGTH) {
        const char *text = NULL;
        size_t len = 0;
        duet_oai_finish_t fin = DUET_OAI_FINISH_NONE;
        duet_oai_stream_finish(r->stream,
                               worker_finish == DUET__TOKENS__FINISH_REASON__STOP
                                   ? DUET_OAI_FINISH_STOP
                                   : DUET_OAI_FINISH_LENGTH,
                               &text, &len, &fin);
        if (!rq_emit(r, text, len))
            return true;
        rq_complete(r, fin != DUET_OAI_FINISH_NONE ? fin : DUET_OAI_FINISH_STOP);
        return true;
    }
    return false;
}

/* ---------------------------------------------------------------- placement and sending */

/*
 * A worker of `role` not in ex[0..n_ex) (placement.h), 0 when none. With a prompt (pp) and
 * placement.prefix_aware, the workers' cached prefixes of it weigh in (a gen worker's only where
 * it would prefill the rest itself: duet_placement_gen_cached), and *cached_p (when not NULL) is
 * the tokens of it the pick holds as weighed.
 */
static uint64_t rt_pick(duet__router_t *rt, duet_worker_role_t role, const uint64_t *ex,
                        size_t n_ex, duet_prefix_prompt_t *pp, uint64_t *cached_p)
{
    duet_placement_candidate_t c[256];
    size_t n = duet_registry_candidates(rt->reg, c, 256);
    if (pp != NULL && rt->pl.prefix_aware) {
        duet_registry_prefix_cached(rt->reg, role, pp, c, n);
        for (size_t i = 0; i < n && role == DUET_WORKER_ROLE_GEN; i++)
            c[i].cached_tokens = duet_placement_gen_cached(pp->n_tokens, c[i].cached_tokens,
                                                           rt->local_prefill_tokens);
    }
    size_t idx = 0;
    if (duet_placement_pick(&rt->pl, role, c, n, ex, n_ex, &idx) < 0)
        return 0;
    if (c[idx].cached_tokens > 0)
        duet__obs_prefix_placement(rt, role);
    if (cached_p != NULL)
        *cached_p = c[idx].cached_tokens;
    return c[idx].id;
}

/* Whether r is prefilled on its gen worker whatever that worker caches: a prompt shorter than
 * placement.local_prefill_tokens, or a scoring request (echo, max_tokens 0: it generates
 * nothing, the gen worker's local prefill answers it). */
static bool rq_local_always(const rq_t *r)
{
    return r->n_ids < r->rt->local_prefill_tokens || r->g->oai.max_tokens == 0;
}

static void rq_fill_sampling(const rq_t *r, Duet__Sampling *s, uint32_t *stop_ids)
{
    const duet_oai_request_t *o = &r->g->oai;
    const duet_oai_lp_params_t *lp = &o->lp;
    s->presence_penalty = (float)lp->presence_penalty;
    s->frequency_penalty = (float)lp->frequency_penalty;
    s->repetition_penalty = (float)lp->repetition_penalty;
    s->logit_bias = r->g->bias_ptrs;
    s->n_logit_bias = r->g->bias_ptrs != NULL ? lp->n_bias : 0;
    s->min_tokens = lp->min_tokens;
    s->logprobs = lp->logprobs || r->g->n > r->g->n_return; /* best_of ranks by them */
    s->top_logprobs = lp->top_logprobs;
    s->prompt_logprobs = lp->logprobs && lp->echo;
    s->response_format = (char *)(o->response_format != NULL ? o->response_format : "");
    s->json_schema = o->json_schema != NULL ? o->json_schema : (char *)"";
    s->temperature = (float)o->temperature;
    s->top_p = (float)o->top_p;
    s->top_k = o->top_k > 0 ? (uint32_t)o->top_k : 0;
    s->has_seed = o->has_seed;
    s->seed = (uint64_t)o->seed + r->index; /* choice 0 is the n = 1 answer with that seed */
    s->ignore_eos = o->ignore_eos;
    size_t n = r->g->n_stop_ids;
    memcpy(stop_ids, r->g->stop_ids, n * sizeof(*stop_ids));
    s->stop_token_ids = stop_ids;
    s->n_stop_token_ids = n;
}

/* Send Reserve (or Generate) to a gen worker not yet excluded; false when none is left. */
static bool rq_send_to_gen(rq_t *r)
{
    duet__router_t *rt = r->rt;
    uint64_t cached = 0; /* counts only where it makes the prefill local (rt_pick) */
    uint64_t gid = rt_pick(rt, DUET_WORKER_ROLE_GEN, r->exclude_gen, r->n_exclude_gen,
                           rt->local_prefill_tokens > 0 ? &r->g->prefix : NULL, &cached);
    if (gid == 0)
        return false;
    r->local = rq_local_always(r) || cached > 0;
    r->gen_id = gid;
    r->gen_busy = true;
    duet_registry_inflight_add(rt->reg, gid, +1);
    uint32_t stop_ids[DUET_OAI_MAX_EOS];
    Duet__Sampling s = DUET__SAMPLING__INIT;
    rq_fill_sampling(r, &s, stop_ids);
    uint64_t deadline = rq_deadline_unix_ms(r);
    if (r->local) {
        Duet__Generate g = DUET__GENERATE__INIT;
        g.request_id = r->id;
        g.tokens = (uint32_t *)r->ids;
        g.n_tokens = r->n_ids;
        g.sampling = &s;
        g.max_tokens = r->g->oai.max_tokens;
        g.deadline_unix_ms = deadline;
        Duet__Envelope env = duet_envelope_generate(&g);
        r->phase = RQ_GENERATING;
        duet_registry_send(rt->reg, gid, &env);
    } else {
        Duet__Reserve rs = DUET__RESERVE__INIT;
        rs.request_id = r->id;
        rs.prompt_tokens = (uint32_t)r->n_ids;
        rs.max_tokens = r->g->oai.max_tokens;
        rs.deadline_unix_ms = deadline;
        rs.tokens = (uint32_t *)r->ids;
        rs.n_tokens = r->n_ids;
        rs.sampling = &s;
        Duet__Envelope env = duet_envelope_reserve(&rs);
        r->phase = RQ_RESERVING;
        duet_registry_send(rt->reg, gid, &env);
    }
    DUET_RLOG_DEBUG(r->id, "%s sent to gen worker %llu (it holds %llu prompt tokens)",
                    r->local ? "Generate" : "Reserve", (unsigned long long)gid,
                    (unsigned long long)cached);
    return true;
}

/* Send Prefill to a ctx worker; false when none is live. */
static bool rq_send_to_ctx(rq_t *r)
{
    duet__router_t *rt = r->rt;
    uint64_t cached = 0;
    uint64_t cid =
        rt_pick(rt, DUET_WORKER_ROLE_CTX, r->exclude_ctx, r->n_exclude_ctx, &r->g->prefix, &cached);
    if (cid == 0)
        return false;
    if (r->ctx_id != 0)
        duet_registry_inflight_add(rt->reg, r->ctx_id, -1);
    r->ctx_id = cid;
    r->ctx_busy = true;
    r->prefill_attempts++;
    duet_registry_inflight_add(rt->reg, cid, +1);
    uint32_t stop_ids[DUET_OAI_MAX_EOS];
    Duet__Sampling s = DUET__SAMPLING__INIT;
    rq_fill_sampling(r, &s, stop_ids);
    Duet__Prefill p = DUET__PREFILL__INIT;
    p.request_id = r->id;
    p.tokens = (uint32_t *)r->ids;
    p.n_tokens = r->n_ids;
    p.sampling = &s;
    p.max_tokens = r->g->oai.max_tokens;
    p.reservation.data = r->reservation;
    p.reservation.len = r->reservation_len;
    p.more_reservations = r->more_res;
    p.n_more_reservations = r->n_more_res;
    p.deadline_unix_ms = rq_deadline_unix_ms(r);
    Duet__Envelope env = duet_envelope_prefill(&p);
    r->phase = RQ_PREFILLING;
    duet_registry_send(rt->reg, cid, &env);
    DUET_RLOG_DEBUG(r->id,
                    "Prefill sent to ctx worker %llu (attempt %d; it holds %llu prompt tokens)",
                    (unsigned long long)cid, r->prefill_attempts, (unsigned long long)cached);
    return true;
}

/* The prefill on r->ctx_id failed (worker died or reported an error): retry once elsewhere. */
static void rq_prefill_failed(rq_t *r, const char *what)
{
    duet__router_t *rt = r->rt;
    r->ctx_busy = false;
    if (r->n_exclude_ctx < RQ_MAX_EXCLUDE)
        r->exclude_ctx[r->n_exclude_ctx++] = r->ctx_id;
    if (r->prefill_attempts < 2 && rq_send_to_ctx(r)) {
        duet_metrics_counter_inc(duet_metrics_single(rt->f_retries));
        DUET_RLOG_WARN(r->id, "prefill retried on ctx worker %llu after: %s",
                       (unsigned long long)r->ctx_id, what);
        return;
    }
    rq_fail(r, 502, "server_error", "worker_failed", 0, "prefill failed: %s%s", what,
            r->prefill_attempts >= 2 ? " (already retried once on another context worker)"
                                     : " (no other live context worker to retry on)");
}

/* An admitted request starts: pick the gen worker first. */
static void rq_start(rq_t *r)
{
    r->admitted = true;
    if (r->t_admit_ns == 0) { /* not again after a requeue */
        r->t_admit_ns = uv_hrtime();
        duet__obs_admitted(r->rt, r->n_ids);
    }
    if (!rq_send_to_gen(r))
        rq_fail(r, 503, "server_error", "no_capacity", 1,
                "no live generation worker can take the request");
}

/* ---------------------------------------------------------------- a request arrives */

#define RT_MAX_IGNORED_LOGGED                                                                      \
    256 /* distinct unknown field names remembered (then no more logs)                             \
         */

/* Log each unknown request field the parser ignored, once per name per process. */
static void rt_log_ignored(duet__router_t *rt, const json_t *names)
{
    size_t i;
    const json_t *v;
    json_array_foreach(names, i, v)
    {
        const char *name = json_string_value(v);
        if (rt->ignored_seen == NULL)
            rt->ignored_seen = json_object();
        if (rt->ignored_seen == NULL || json_object_get(rt->ignored_seen, name) != NULL ||
            json_object_size(rt->ignored_seen) >= RT_MAX_IGNORED_LOGGED)
            continue;
        json_object_set_new(rt->ignored_seen, name, json_true());
        DUET_LOG_DEBUG("router: ignoring the unknown request field '%.100s' (logged once; "
                       "api.strict refuses such fields)",
                       name);
    }
}

/*
 * The ids that end g's choices with "stop": the model's EOS ids unless ignore_eos, then
 * stop_token_ids (they stop even with ignore_eos, as in vLLM). The stream gets them as its EOS
 * list, and a copy of the request without ignore_eos (rq_stream_create). false: more than
 * DUET_OAI_MAX_EOS in all, a 400 in *err.
 */
static bool rq_stop_ids(rq_group_t *g, duet_oai_error_t *err)
{
    const duet__router_t *rt = g->rt;
    const size_t n_eos = g->oai.ignore_eos ? 0 : rt->n_eos;
    if (n_eos + g->oai.lp.n_stop_token_ids > DUET_OAI_MAX_EOS) {
        duet_oai_error_make(err, 400, NULL, "invalid_value", "stop_token_ids",
                            "Invalid 'stop_token_ids': at most %zu ids beside this model's %zu "
                            "end-of-sequence ids.",
                            DUET_OAI_MAX_EOS - n_eos, n_eos);
        return false;
    }
    memcpy(g->stop_ids, rt->eos, n_eos * sizeof(*g->stop_ids));
    memcpy(g->stop_ids + n_eos, g->oai.lp.stop_token_ids,
           g->oai.lp.n_stop_token_ids * sizeof(*g->stop_ids));
    g->n_stop_ids = n_eos + g->oai.lp.n_stop_token_ids;
    return true;
}

/* r's text stream, ended by the group's stop_ids (which already leave the EOS ids out under
 * ignore_eos: the stream is given a shallow copy of the request without it). */
static duet_status_t rq_stream_create(rq_t *r)
{
    const rq_group_t *g = r->g;
    duet_oai_request_t q = g->oai;
    q.ignore_eos = false;
    return duet_oai_stream_create(r->rt->tok, &q, g->stop_ids, g->n_stop_ids, !g->oai.stream,
                                  &r->stream);
}

/* The request's Sampling.logit_bias messages, shared by its choices; false when out of memory. */
static bool rq_bias_begin(rq_group_t *g)
{
    const duet_oai_lp_params_t *lp = &g->oai.lp;
    if (lp->n_bias == 0)
        return true;
    g->bias_msgs = calloc(lp->n_bias, sizeof(*g->bias_msgs));
    g->bias_ptrs = calloc(lp->n_bias, sizeof(*g->bias_ptrs));
    if (g->bias_msgs == NULL || g->bias_ptrs == NULL)
        return false;
    for (size_t i = 0; i < lp->n_bias; i++) {
        duet__logit_bias__init(&g->bias_msgs[i]);
        g->bias_msgs[i].id = lp->bias_ids[i];
        g->bias_msgs[i].bias = lp->bias[i];
        g->bias_ptrs[i] = &g->bias_msgs[i];
    }
    return true;
}

/* One position's logprobs from a worker's message (at most DUET_OAI_MAX_TOP_LOGPROBS kept; the
 * shorter of its two lists). */
static void rq_lp_entry(const Duet__TokenLogprob *t, uint32_t id, duet_oai_lp_entry_t *e)
{
    e->id = id;
    e->logprob = t->logprob;
    size_t n = t->n_top_ids < t->n_top_logprobs ? t->n_top_ids : t->n_top_logprobs;
    e->n_top = (int)(n < DUET_OAI_MAX_TOP_LOGPROBS ? n : DUET_OAI_MAX_TOP_LOGPROBS);
    for (int j = 0; j < e->n_top; j++) {
        e->top_ids[j] = t->top_ids[j];
        e->top_lps[j] = t->top_logprobs[j];
    }
}

/* A worker's logprobs for m's ids (and, in the first message, the prompt's) into r->lp. false:
 * the worker sent the wrong count (what is wrong goes to *why), or out of memory. */
static bool rq_lp_record(rq_t *r, const Duet__Tokens *m, const char **why)
{
    *why = "out of memory";
    if (r->lp == NULL)
        return true;
    if (m->n_logprobs != m->n_ids) {
        *why = "worker sent logprobs that do not match its token ids";
        return false;
    }
    duet_oai_lp_entry_t e[16];
    for (size_t i = 0; i < m->n_logprobs;) {
        size_t k = 0;
        for (; k < 16 && i < m->n_logprobs; k++, i++) {
            rq_lp_entry(m->logprobs[i], m->ids[i], &e[k]);
        }
        if (duet_oai_lp_add(r->lp, e, k) != DUET_OK)
            return false;
    }
    if (m->n_prompt_logprobs == 0 || !r->g->oai.lp.echo)
        return true;
    if (m->n_prompt_logprobs + 1 != r->n_ids) {
        *why = "worker sent prompt logprobs that do not match the prompt";
        return false;
    }
    duet_oai_lp_entry_t *pe = calloc(m->n_prompt_logprobs, sizeof(*pe));
    if (pe == NULL)
        return false;
    for (size_t i = 0; i < m->n_prompt_logprobs; i++)
        rq_lp_entry(m->prompt_logprobs[i], r->ids[i + 1], &pe[i]);
    const bool ok = duet_oai_lp_set_prompt(r->lp, r->ids, r->n_ids, pe) == DUET_OK;
    free(pe);
    return ok;
}

/* Refuse a request before it has an rq_t (nothing else to end). */
static void rt_refuse(duet_http_request_t *http, int status, const char *code,
                      uint32_t retry_after_s, const char *message)
{
    duet_oai_error_t e;
    duet_oai_error_make(&e, status, "server_error", code, NULL, "%s", message);
    respond_error(http, &e, retry_after_s);
    duet_http_request_release(http);
}

/* Admit choice r (run now, queue, or refuse, which fails the whole request). */
static void rq_admit(rq_t *r, uint64_t now)
{
    duet__router_t *rt = r->rt;
    /* the admission integration point: bounded queue, 429 / 503 with Retry-After */
    duet_admission_result_t res;
    r->queue_deadline_ms = now + rt->queue_timeout_ms;
    duet_admission_try_admit(rt->adm, r, now, r->queue_deadline_ms, &res);
    switch (res.verdict) {
    case DUET_ADMISSION_ADMIT:
        rq_start(r);
        return;
    case DUET_ADMISSION_QUEUED:
        r->phase = RQ_QUEUED;
        return;
    case DUET_ADMISSION_REJECT_FULL:
        rq_fail(r, res.http_status, "rate_limit_exceeded", "queue_full", res.retry_after_s,
                "the router is at capacity (admission queue full); retry later");
        return;
    case DUET_ADMISSION_REJECT_PAUSED:
        rq_fail(r, res.http_status, "server_error", "paused", res.retry_after_s,
                "admission is paused by an operator; retry later");
        return;
    case DUET_ADMISSION_REJECT_NO_CAPACITY:
    default:
        rq_fail(r, res.http_status != 0 ? res.http_status : 503, "server_error", "no_capacity",
                res.retry_after_s, "no live generation worker");
        return;
    }
}

/* Choice i of g: its own request id, text stream and deadline; into the live table. NULL when
 * out of memory (nothing made). */
static rq_t *rq_choice_new(rq_group_t *g, uint32_t i, uint64_t now)
{
    duet__router_t *rt = g->rt;
    rq_t *r = calloc(1, sizeof(*r));
    if (r == NULL)
        return NULL;
    r->rt = rt;
    r->g = g;
    if (rq_stream_create(r) < 0 ||
        (g->oai.tools != NULL && duet_oai_toolparse_create(&r->tp) < 0) ||
        ((g->oai.lp.logprobs || g->n > g->n_return) &&
         duet_oai_lp_create(rt->tok, &g->oai, &r->lp) != DUET_OK)) {
        duet_oai_stream_destroy(r->stream);
        duet_oai_toolparse_destroy(r->tp);
        free(r);
        return NULL;
    }
    r->index = i;
    r->id = i == 0 ? g->id : ++rt->next_rid;
    r->ids = g->ids;
    r->n_ids = g->n_ids;
    r->meta = g->meta;
    r->meta.index = i;
    r->t_start_ns = g->t_start_ns;
    r->finish = -1;
    r->local = rq_local_always(r); /* and where a gen worker holds most of it (rq_send_to_gen) */
    r->deadline_ms = now + rt->deadline_ms;
    g->choices[i] = r;
    g->n_live++;
    rq_table_add(rt, r);
    return r;
}

void duet__rq_begin(duet__router_t *rt, duet_http_request_t *http, duet_oai_endpoint_t ep,
                    const char *label)
{
    if (rt->draining) {
        rt_refuse(http, 503, "draining", 1, "the router is shutting down");
        return;
    }
    rq_group_t *g = calloc(1, sizeof(*g));
    if (g == NULL) {
        rt_refuse(http, 500, NULL, 0, "out of memory");
        return;
    }
    g->rt = rt;
    g->http = http;
    g->id = ++rt->next_rid;
    g->t_start_ns = uv_hrtime();
    g->endpoint = label;
    size_t len = 0;
    const char *body = duet_http_request_body(http, &len);
    duet_oai_error_t err;
    memset(&err, 0, sizeof(err));
    if (duet_oai_request_parse(&rt->lim, ep, body, len, &g->oai, &err) < 0 ||
        duet_oai_request_tokens(&g->oai, &rt->lim, rt->tmpl, rt->tok, &g->ids, &g->n_ids, &err) <
            0 ||
        !rq_stop_ids(g, &err) || !rq_bias_begin(g) ||
        (g->n = g->oai.best_of > g->oai.n ? g->oai.best_of
                : g->oai.n > 0            ? g->oai.n
                                          : 1,
         g->n_return = g->oai.n > 0 ? g->oai.n : 1,
         (g->choices = calloc(g->n, sizeof(*g->choices))) == NULL ||
             (g->results = calloc(g->n, sizeof(*g->results))) == NULL ||
             (g->rank = calloc(g->n, sizeof(*g->rank))) == NULL)) {
        if (err.http_status == 0)
            duet_oai_error_make(&err, 500, "server_error", NULL, NULL, "out of memory");
        DUET_RLOG_INFO(g->id, "rejected (%d): %s", err.http_status, err.message);
        respond_error(http, &err, 0);
        rt_result(rt, g->endpoint, "invalid");
        const duet__obs_request_t rec = {.id = g->id,
                                         .endpoint = g->endpoint,
                                         .status = err.http_status,
                                         .finish = -1,
                                         .t_start_ns = g->t_start_ns,
                                         .t_end_ns = uv_hrtime()};
        duet__obs_request_end(rt, &rec);
        rq_group_maybe_free(g);
        return;
    }
    duet_prefix_prompt_init(&g->prefix, g->ids, g->n_ids); /* hashed when a pick needs it */
    if (g->oai.ignored_fields != NULL)
        rt_log_ignored(rt, g->oai.ignored_fields);
    duet_oai_response_id(ep, g->id, g->resp_id, sizeof(g->resp_id));
    g->meta.endpoint = ep;
    g->meta.id = g->resp_id;
    g->meta.model = rt->model_name;
    g->meta.created = (int64_t)time(NULL);
    g->meta.include_usage = g->oai.include_usage;
    duet_metrics_counter_add(rt->m_tok_in, (double)g->n_ids);
    duet_http_request_set_data(http, g);
    DUET_RLOG_DEBUG(g->id, "%s: %zu prompt tokens, max_tokens %u, stream %d, n %u", g->endpoint,
                    g->n_ids, g->oai.max_tokens, (int)g->oai.stream, g->n);

    /* n independent choices, each admitted and placed like a request of its own; a refusal of
     * any fails the request (and ends those made before it) */
    const uint64_t now = uv_now(rt->loop);
    g->hold++;
    for (uint32_t i = 0; i < g->n && !g->answered; i++) {
        rq_t *r = rq_choice_new(g, i, now);
        if (r == NULL) {
            rq_t *live = NULL;
            for (uint32_t k = 0; k < i && live == NULL; k++)
                live = g->choices[k];
            if (live != NULL) {
                rq_fail(live, 500, "server_error", NULL, 0, "out of memory");
            } else {
                duet_oai_error_make(&err, 500, "server_error", NULL, NULL, "out of memory");
                respond_error(http, &err, 0);
                rt_result(rt, g->endpoint, "error");
                g->answered = true;
            }
            break;
        }
        if (g->n > 1)
            DUET_RLOG_DEBUG(r->id, "choice %u of request %llu", i, (unsigned long long)g->id);
        rq_admit(r, now);
    }
    g->hold--;
    rq_group_maybe_free(g);
}

void duet__rq_on_abort(duet_http_request_t *http, void *user)
{
    rq_group_t *g = duet_http_request_get_data(http);
    if (g == NULL)
        return;
    DUET_RLOG_INFO(g->id, "client disconnected");
    rt_result(g->rt, g->endpoint, "cancelled");
    g->answered = true;
    /* 499, nginx's "client closed request": nothing was answered */
    rq_group_end_all(g, "client disconnected", 499, DUET__OBS_ABORT);
}

/* ---------------------------------------------------------------- worker events */

/* Starts every queued request admission lets run now (none without capacity, paused or held). */
static void rq_start_ready(duet__router_t *rt, uint64_t now)
{
    void *h = NULL;
    while (duet_admission_pop_ready(rt->adm, now, &h))
        rq_start((rq_t *)h);
}

/* Adds a live generation worker's request slots (batch.max_seqs) to the sum at user. */
static void rq_add_gen_slots(const duet_worker_info_t *w, void *user)
{
    if (w->role == DUET_WORKER_ROLE_GEN && w->state == DUET_WORKER_STATE_UP)
        *(uint64_t *)user += w->max_seqs;
}

void duet__rq_capacity_changed(duet__router_t *rt)
{
    bool cap = duet_registry_count(rt->reg, DUET_WORKER_ROLE_GEN, DUET_WORKER_STATE_UP) > 0;
    duet_admission_set_capacity(rt->adm, cap);
    /* every running request holds a slot on its generation worker from Reserve to its end:
     * past their sum a request waits in the queue rather than be refused there with a 429 */
    uint64_t slots = 0;
    duet_registry_foreach(rt->reg, rq_add_gen_slots, &slots);
    duet_admission_set_worker_slots(rt->adm, slots < UINT32_MAX ? (uint32_t)slots : UINT32_MAX);
    rq_start_ready(rt, uv_now(rt->loop));
}

void duet__rq_on_worker_up(const duet_worker_info_t *w, void *user)
{
    duet__rq_capacity_changed(user);
}

void duet__rq_on_worker_state(const duet_worker_info_t *w, void *user)
{
    duet__rq_capacity_changed(user);
}

void duet__rq_on_worker_down(const duet_worker_info_t *w, const char *reason, void *user)
{
    duet__router_t *rt = user;
    uint64_t *v = NULL;
    size_t n = rq_collect(rt, &v);
    char what[256];
    snprintf(what, sizeof(what), "%s worker %llu (%s) lost: %s", duet_worker_role_name(w->role),
             (unsigned long long)w->id, w->name, reason);
    for (size_t i = 0; i < n; i++) {
        rq_t *r = rq_find(rt, v[i]);
        if (r == NULL)
            continue; /* ended with a sibling choice */
        if (r->gen_id == w->id && r->phase != RQ_QUEUED) {
            r->gen_busy = false;
            r->gen_id = 0; /* its in-flight count died with it */
            if (r->move != MV_NONE)
                rt_move_result(rt, "lost");
            rq_fail(r, 502, "server_error", "worker_lost", 0, "%s", what);
        } else if (r->move_to == w->id) {
            /* the move's target: another target, or the source goes on with it */
            rq_move_target_gone(r, NULL);
            if (r->move == MV_RESERVING) {
                rq_move_reserve(r);
            } else if (r->move == MV_SENDING) {
                rq_send_move_cancel(r, what); /* its Moved (failed) follows */
                rt_move_result(rt, "lost");
            }
        } else if (r->ctx_id == w->id && r->phase == RQ_PREFILLING) {
            rq_prefill_failed(r, what); /* excludes r->ctx_id (= w) and retries once */
        }
    }
    free(v);
    (void)duet__rt_set_migrating(rt, w->id, false);
    duet__rt_drain_waiters_check(rt, w->id, DUET_ERR_TRANSPORT, what);
    duet__rq_capacity_changed(rt);
}

/* ---------------------------------------------------------------- moving a running request */

static void rt_move_result(duet__router_t *rt, const char *result)
{
    duet_metric_t *m;
    const char *const v[1] = {result};
    if (duet_metrics_child(rt->f_moves, v, 1, &m) == DUET_OK)
        duet_metrics_counter_inc(m);
}

/* Append a worker's ids to what the request has generated; false when out of memory. */
static bool rq_record(rq_t *r, const uint32_t *ids, size_t n)
{
    if (n == 0) /* e.g. a scoring request's only Tokens: nothing to copy (r->out may be NULL) */
        return true;
    if (r->n_out + n > r->cap_out) {
        size_t cap = r->cap_out > 0 ? r->cap_out : 64;
        while (cap < r->n_out + n)
            cap *= 2;
        uint32_t *v = realloc(r->out, cap * sizeof(*v));
        if (v == NULL)
            return false;
        r->out = v;
        r->cap_out = cap;
    }
    memcpy(r->out + r->n_out, ids, n * sizeof(*ids));
    r->n_out += n;
    return true;
}

static void rq_send_move_cancel(rq_t *r, const char *reason)
{
    Duet__MoveCancel mc = DUET__MOVE_CANCEL__INIT;
    mc.request_id = r->id;
    mc.reason = (char *)reason;
    Duet__Envelope env = duet_envelope_move_cancel(&mc);
    (void)duet_registry_send(r->rt->reg, r->gen_id, &env);
}

/* The move's target lets the request go (it refused, died, or the move failed: cancel_why). */
static void rq_move_target_gone(rq_t *r, const char *cancel_why)
{
    rt_release(r->rt, r->id, &r->move_to, &r->move_to_busy, cancel_why);
}

/* No target can take the request: it goes on where it is, and stays there. */
static void rq_move_abandon(rq_t *r, const char *why)
{
    DUET_RLOG_INFO(r->id, "not moving off gen worker %llu: %s", (unsigned long long)r->gen_id, why);
    rq_send_move_cancel(r, why);
    rq_move_target_gone(r, why);
    r->move = MV_NONE;
    r->move_given_up = true;
    rt_move_result(r->rt, "abandoned");
}

/* Ask the source to pause r between two steps and say where it stands. */
static void rq_move_start(rq_t *r)
{
    Duet__MovePause mp = DUET__MOVE_PAUSE__INIT;
    mp.request_id = r->id;
    Duet__Envelope env = duet_envelope_move_pause(&mp);
    if (duet_registry_send(r->rt->reg, r->gen_id, &env) < 0)
        return; /* the worker is going; its loss ends the request */
    r->move = MV_PAUSING;
    r->move_attempts++;
    r->n_move_exclude = 0;
    r->move_t0_ns = uv_hrtime();
    DUET_RLOG_DEBUG(r->id, "moving off gen worker %llu: pausing it (attempt %d)",
                    (unsigned long long)r->gen_id, r->move_attempts);
}

/* Reserve on a target other than the source and those that refused; none left: abandon. */
static void rq_move_reserve(rq_t *r)
{
    duet__router_t *rt = r->rt;
    uint64_t ex[RQ_MAX_EXCLUDE + 1];
    size_t n_ex = 0;
    ex[n_ex++] = r->gen_id;
    for (size_t i = 0; i < r->n_move_exclude; i++)
        ex[n_ex++] = r->move_exclude[i];
    uint64_t tid = rt_pick(rt, DUET_WORKER_ROLE_GEN, ex, n_ex, NULL, NULL);
    if (tid == 0) {
        rq_move_abandon(r, "no other live generation worker can take it");
        return;
    }
    uint32_t stop_ids[DUET_OAI_MAX_EOS];
    Duet__Sampling s = DUET__SAMPLING__INIT;
    rq_fill_sampling(r, &s, stop_ids);
    Duet__MoveState ms = DUET__MOVE_STATE__INIT;
    ms.kv_tokens = r->mv.kv_tokens;
    ms.replay_rows = r->mv.replay_rows;
    ms.produced = r->mv.produced;
    ms.next_token = r->mv.next_token;
    ms.rng = r->mv.rng;
    ms.n_rng = DUET_PROTO_RNG_WORDS;
    ms.generated = r->out;
    ms.n_generated = r->n_out;
    Duet__Reserve rs = DUET__RESERVE__INIT;
    rs.request_id = r->id;
    rs.prompt_tokens = (uint32_t)r->n_ids;
    rs.max_tokens = r->g->oai.max_tokens;
    /* the move's own bound: past it the source goes on with the request */
    uint64_t deadline = rq_deadline_unix_ms(r), bound = unix_ms() + rt->migrate_timeout_ms;
    rs.deadline_unix_ms = bound < deadline ? bound : deadline;
    ms.request_deadline_unix_ms = deadline; /* the decoding after the move keeps the request's */
    rs.tokens = (uint32_t *)r->ids;
    rs.n_tokens = r->n_ids;
    rs.sampling = &s;
    rs.move = &ms;
    Duet__Envelope env = duet_envelope_reserve(&rs);
    if (duet_registry_send(rt->reg, tid, &env) < 0) {
        if (r->n_move_exclude < RQ_MAX_EXCLUDE) {
            r->move_exclude[r->n_move_exclude++] = tid;
            rq_move_reserve(r);
        } else {
            rq_move_abandon(r, "no generation worker could be reached");
        }
        return;
    }
    r->move = MV_RESERVING;
    r->move_to = tid;
    r->move_to_busy = true;
    duet_registry_inflight_add(rt->reg, tid, +1);
    DUET_RLOG_DEBUG(r->id, "moving to gen worker %llu: %llu tokens of KV", (unsigned long long)tid,
                    (unsigned long long)r->mv.kv_tokens);
}

/* MovePaused: the source stopped decoding r (or cannot yet). */
static void rq_on_move_paused(duet__router_t *rt, uint64_t wid, const Duet__MovePaused *m)
{
    rq_t *r = rq_find(rt, m->request_id);
    if (r == NULL || r->gen_id != wid || r->move != MV_PAUSING)
        return; /* ended meanwhile: its Cancel reaches the source */
    if (!m->ok) {
        DUET_RLOG_DEBUG(r->id, "gen worker %llu cannot pause it yet: %s", (unsigned long long)wid,
                        m->reason);
        r->move = MV_NONE;
        r->move_attempts--; /* not an attempt: it was not decoding yet */
        r->move_retry_ms = uv_now(rt->loop) + RQ_MOVE_RETRY_MS;
        return;
    }
    const Duet__MoveState *st = m->state;
    /* the source sent every token before pausing (one connection, in order), so the router's
     * record and the source's state must agree */
    if (st == NULL || st->n_rng != DUET_PROTO_RNG_WORDS || st->produced != r->n_out ||
        r->n_out == 0 || st->next_token != r->out[r->n_out - 1] ||
        st->kv_tokens != (uint64_t)r->n_ids + r->n_out - 1 || st->replay_rows > st->kv_tokens) {
        DUET_RLOG_ERROR(r->id,
                        "gen worker %llu paused it in a state that does not match its stream "
                        "(%u tokens produced, %zu streamed)",
                        (unsigned long long)wid, st != NULL ? st->produced : 0, r->n_out);
        rq_move_abandon(r, "the source's state does not match the stream");
        return;
    }
    r->mv.kv_tokens = st->kv_tokens;
    r->mv.replay_rows = st->replay_rows;
    r->mv.produced = st->produced;
    r->mv.next_token = st->next_token;
    memcpy(r->mv.rng, st->rng, sizeof(r->mv.rng));
    rq_move_reserve(r);
}

/* Reserved by the move's target: the source sends the caches into it. */
static void rq_move_out(rq_t *r, const Duet__Reserved *m)
{
    Duet__MoveOut mo = DUET__MOVE_OUT__INIT;
    mo.request_id = r->id;
    mo.reservation = m->reservation;
    Duet__Envelope env = duet_envelope_move_out(&mo);
    if (duet_registry_send(r->rt->reg, r->gen_id, &env) < 0)
        return; /* the source is going; its loss ends the request */
    r->move = MV_SENDING;
}

/* Moved: the source's transfer ended; ok: the target continues the request. */
static void rq_on_moved(duet__router_t *rt, uint64_t wid, const Duet__Moved *m)
{
    rq_t *r = rq_find(rt, m->request_id);
    if (r == NULL || r->gen_id != wid || r->move != MV_SENDING)
        return;
    const double ms = (double)(uv_hrtime() - r->move_t0_ns) / 1e6;
    if (!m->ok) {
        DUET_RLOG_WARN(r->id,
                       "moving off gen worker %llu failed after %.1f ms, it goes on there: %s",
                       (unsigned long long)wid, ms, m->reason);
        rq_move_target_gone(r, "the move failed");
        r->move = MV_NONE;
        r->move_retry_ms = uv_now(rt->loop) + 1000;
        r->move_given_up = r->move_attempts >= RQ_MOVE_ATTEMPTS;
        rt_move_result(rt, "failed");
        return;
    }
    if (r->move_to == 0) { /* the target died after the source let go */
        r->gen_busy = false;
        rt_move_result(rt, "lost");
        rq_fail(r, 502, "server_error", "worker_lost", 0,
                "the request's caches went to a generation worker that was lost before it resumed");
        return;
    }
    uint64_t src = r->gen_id, src_shown = src;
    bool src_busy = false;  /* it let go: nothing to cancel */
    r->gen_id = r->move_to; /* its inflight count moves with it */
    r->gen_busy = true;
    r->move_to = 0;
    r->move_to_busy = false;
    r->move = MV_NONE;
    rt_release(rt, r->id, &src, &src_busy, NULL);
    Duet__PrefillDone pd = DUET__PREFILL_DONE__INIT;
    pd.request_id = r->id;
    Duet__Envelope env = duet_envelope_prefill_done(&pd);
    DUET_RLOG_INFO(r->id, "moved from gen worker %llu to %llu in %.1f ms at %zu generated tokens",
                   (unsigned long long)src_shown, (unsigned long long)r->gen_id, ms, r->n_out);
    rt_move_result(rt, "ok");
    if (duet_registry_send(rt->reg, r->gen_id, &env) < 0)
        rq_fail(r, 502, "server_error", "worker_lost", 0, "generation worker %llu is gone",
                (unsigned long long)r->gen_id);
}

/* Keep a Reserved's reservations (copies; opaque) with r; false when r failed (a bad Reserved:
 * too many or too big, the error names the worker; or out of memory). */
static bool rq_keep_reservations(rq_t *r, uint64_t wid, const Duet__Reserved *m)
{
    size_t too_big = SIZE_MAX;
    if (m->reservation.len > DUET_XFER_RESERVATION_MAX_BYTES)
        too_big = 0;
    for (size_t i = 0; i < m->n_more_reservations && too_big == SIZE_MAX; i++)
        if (m->more_reservations[i].len > DUET_XFER_RESERVATION_MAX_BYTES)
            too_big = i + 1;
    if (m->n_more_reservations > DUET_XFER_MAX_RANKS - 1 || too_big != SIZE_MAX) {
        char what[96];
        if (too_big != SIZE_MAX)
            snprintf(what, sizeof(what), "reservation %zu is larger than %u bytes", too_big,
                     DUET_XFER_RESERVATION_MAX_BYTES);
        else
            snprintf(what, sizeof(what), "%zu reservations exceed a group's %d ranks",
                     m->n_more_reservations + 1, DUET_XFER_MAX_RANKS);
        DUET_RLOG_ERROR(r->id, "gen worker %llu sent a bad Reserved: %s", (unsigned long long)wid,
                        what);
        rq_fail(r, 502, "server_error", "bad_worker_output", 0,
                "generation worker %llu sent a bad reservation: %s", (unsigned long long)wid, what);
        return false;
    }
    free(r->reservation);
    rq_more_res_free(r);
    r->reservation_len = m->reservation.len;
    r->reservation = malloc(r->reservation_len > 0 ? r->reservation_len : 1);
    if (r->reservation == NULL)
        goto nomem;
    memcpy(r->reservation, m->reservation.data, r->reservation_len);
    if (m->n_more_reservations > 0) {
        r->more_res = calloc(m->n_more_reservations, sizeof(*r->more_res));
        if (r->more_res == NULL)
            goto nomem;
        for (size_t i = 0; i < m->n_more_reservations; i++, r->n_more_res++) {
            const size_t n = m->more_reservations[i].len;
            r->more_res[i].data = malloc(n > 0 ? n : 1);
            if (r->more_res[i].data == NULL)
                goto nomem;
            memcpy(r->more_res[i].data, m->more_reservations[i].data, n);
            r->more_res[i].len = n;
        }
    }
    return true;
nomem:
    rq_fail(r, 500, "server_error", NULL, 0, "out of memory");
    return false;
}

/* Reserved: the gen worker holds pages for the request; the ctx worker prefills into them. */
static void rq_on_reserved(duet__router_t *rt, uint64_t wid, const Duet__Reserved *m)
{
    rq_t *r = rq_find(rt, m->request_id);
    if (r != NULL && r->move == MV_RESERVING && wid == r->move_to) {
        if (m->n_more_reservations > 0) { /* a Helix group: moving into one is not built */
            DUET_RLOG_INFO(r->id,
                           "gen worker %llu reserved as a group of %zu ranks: moving a running "
                           "request into a Helix group is not supported",
                           (unsigned long long)wid, m->n_more_reservations + 1);
            rq_move_target_gone(r, "moving a running request into a Helix group is not supported");
            if (r->n_move_exclude < RQ_MAX_EXCLUDE)
                r->move_exclude[r->n_move_exclude++] = wid;
            rq_move_reserve(r);
            return;
        }
        rq_move_out(r, m);
        return;
    }
    if (r == NULL || r->gen_id != wid || r->phase != RQ_RESERVING) {
        /* the request is gone (or this is stale): give the pages back */
        if (r == NULL)
            rt_send_cancel(rt, wid, m->request_id, "request no longer exists");
        return;
    }
    if (!rq_keep_reservations(r, wid, m))
        return;
    if (!rq_send_to_ctx(r))
        rq_fail(r, 503, "server_error", "no_capacity", 1,
                "no live context worker can prefill the request");
}

#define RQ_MAX_HOLD_MS 5000 /* the longest a refusal's retry hint holds admission */

/*
 * Every gen worker refused r, one at least for want of room for now (a retry hint: its slots or
 * pages are held past what the router counts, e.g. by an aborted transfer's quarantine). r waits
 * again at the head of the admission queue, within its queue deadline, and admission holds
 * promotions until the hint has passed or a running request ends. False when admission has no
 * room for it or no refusal was for room (the caller answers 429).
 */
static bool rq_requeue(rq_t *r, const char *reason)
{
    duet__router_t *rt = r->rt;
    const uint64_t now = uv_now(rt->loop);
    /* a worker's hint, bounded: no peer holds every promotion for long */
    const uint64_t hold = r->retry_after_ms < RQ_MAX_HOLD_MS ? r->retry_after_ms : RQ_MAX_HOLD_MS;
    if (r->retry_after_ms == 0 ||
        duet_admission_requeue(rt->adm, r, now, r->queue_deadline_ms, now + hold) != DUET_OK)
        return false;
    r->admitted = false;
    r->phase = RQ_QUEUED;
    r->n_exclude_gen = 0;
    r->retry_after_ms = 0;
    r->requeues++;
    if (r->requeues == 1) /* a request refused again while slots stay held says it once */
        DUET_RLOG_INFO(r->id,
                       "every generation worker refused it for now (%s): back in the admission "
                       "queue",
                       reason);
    else
        DUET_RLOG_DEBUG(r->id, "refused for now again (%s): back in the admission queue, time %u",
                        reason, r->requeues);
    return true;
}

/* Refused: try the next gen worker, else wait again in the queue when a refusal was for room
 * (rq_requeue), else 429 with the largest retry hint heard. */
static void rq_on_refused(duet__router_t *rt, uint64_t wid, const Duet__Refused *m)
{
    rq_t *r = rq_find(rt, m->request_id);
    if (r != NULL && r->move == MV_RESERVING && wid == r->move_to) {
        DUET_RLOG_INFO(r->id, "gen worker %llu cannot take the moving request: %s",
                       (unsigned long long)wid, m->reason);
        rq_move_target_gone(r, NULL);
        if (r->n_move_exclude < RQ_MAX_EXCLUDE)
            r->move_exclude[r->n_move_exclude++] = wid;
        rq_move_reserve(r);
        return;
    }
    if (r == NULL || r->gen_id != wid ||
        !(r->phase == RQ_RESERVING || (r->local && r->t_first_ns == 0)))
        return;
    DUET_RLOG_INFO(r->id, "gen worker %llu refused: %s", (unsigned long long)wid, m->reason);
    r->gen_busy = false;
    duet_registry_inflight_add(rt->reg, wid, -1);
    r->gen_id = 0;
    if (m->retry_after_ms > r->retry_after_ms)
        r->retry_after_ms = m->retry_after_ms;
    if (r->n_exclude_gen < RQ_MAX_EXCLUDE)
        r->exclude_gen[r->n_exclude_gen++] = wid;
    if (r->n_exclude_gen < RQ_MAX_EXCLUDE && rq_send_to_gen(r))
        return;
    if (rq_requeue(r, m->reason))
        return;
    uint32_t ra = (r->retry_after_ms + 999) / 1000;
    rq_fail(r, 429, "rate_limit_exceeded", "no_reservation", ra > 0 ? ra : 1,
            "no generation worker could reserve cache for the request (last refusal: %s)",
            m->reason);
}

/*
 * Tokens: from the ctx worker the first token (then PrefillDone to the gen worker), from the gen
 * worker the rest; a worker's ERROR or CANCELLED fails the request (a ctx worker's ERROR without
 * ids is a failed prefill, retried once; the gen worker's during the prefill ends it, since its
 * reservation is gone).
 */
static void rq_on_tokens(duet__router_t *rt, uint64_t wid, const Duet__Tokens *m)
{
    rq_t *r = rq_find(rt, m->request_id);
    if (r == NULL)
        return; /* ended already (its Cancel crossed these tokens) */
    const int fin = m->finish_reason;
    const bool failed =
        fin == DUET__TOKENS__FINISH_REASON__ERROR || fin == DUET__TOKENS__FINISH_REASON__CANCELLED;
    bool from_ctx = r->phase == RQ_PREFILLING && wid == r->ctx_id;
    /* while a context worker prefills, the gen worker's final Tokens says it ended the
     * reservation (the transfer aborted: the sender gave up or stopped, the deadline): no prefill
     * can land there any more, and one retried on another context worker would put into pages
     * the gen worker has quarantined and will hand to another request */
    bool from_gen =
        wid == r->gen_id && (r->phase == RQ_GENERATING || (r->phase == RQ_PREFILLING && failed));
    if (wid == r->move_to && wid != r->gen_id) {
        /* a move's target before the switch: its final Tokens says it let its pages go (its
         * reservation ended); the source still streams */
        if (m->finish_reason != DUET__TOKENS__FINISH_REASON__NONE)
            r->move_to_busy = false;
        return;
    }
    if (!from_ctx && !from_gen) {
        DUET_RLOG_DEBUG(r->id, "ignoring Tokens from worker %llu (phase %d)",
                        (unsigned long long)wid, (int)r->phase);
        return;
    }
    bool *busy = from_ctx ? &r->ctx_busy : &r->gen_busy;
    if (failed) {
        char what[320];
        snprintf(what, sizeof(what), "worker %llu %s: %s", (unsigned long long)wid,
                 fin == DUET__TOKENS__FINISH_REASON__ERROR ? "failed" : "cancelled the request",
                 m->error != NULL && m->error[0] != '\0' ? m->error : "(no detail)");
        if (from_ctx && fin == DUET__TOKENS__FINISH_REASON__ERROR && m->n_ids == 0) {
            rq_prefill_failed(r, what);
            return;
        }
        *busy = false;
        rq_fail(r, 502, "server_error", "worker_failed", 0, "%s", what);
        return;
    }
    if (fin != DUET__TOKENS__FINISH_REASON__NONE)
        *busy = false;
    if (!rq_record(r, m->ids, m->n_ids)) {
        rq_fail(r, 500, "server_error", NULL, 0, "out of memory");
        return;
    }
    const char *lp_why = NULL;
    if (!rq_lp_record(r, m, &lp_why)) {
        rq_fail(r, 502, "server_error", "bad_worker_output", 0, "worker %llu: %s",
                (unsigned long long)wid, lp_why);
        return;
    }
    if (!from_ctx) {
        rq_feed(r, m->ids, m->n_ids, fin);
        return;
    }
    /* the first token: after it, the gen worker continues (unless this was the end) */
    if (m->n_ids == 0 && fin == DUET__TOKENS__FINISH_REASON__NONE)
        return;
    uint32_t first = m->n_ids > 0 ? m->ids[m->n_ids - 1] : 0;
    r->ctx_busy = false;
    if (rq_feed(r, m->ids, m->n_ids, fin))
        return;
    Duet__PrefillDone pd = DUET__PREFILL_DONE__INIT;
    pd.request_id = r->id;
    pd.first_token = first;
    Duet__Envelope env = duet_envelope_prefill_done(&pd);
    r->phase = RQ_GENERATING;
    if (duet_registry_send(rt->reg, r->gen_id, &env) < 0)
        rq_fail(r, 502, "server_error", "worker_lost", 0, "generation worker %llu is gone",
                (unsigned long long)r->gen_id);
}

void duet__rq_on_message(uint64_t wid, const Duet__Envelope *env, void *user)
{
    duet__router_t *rt = user;
    switch (env->body_case) {
    case DUET__ENVELOPE__BODY_RESERVED:
        rq_on_reserved(rt, wid, env->reserved);
        return;
    case DUET__ENVELOPE__BODY_REFUSED:
        rq_on_refused(rt, wid, env->refused);
        return;
    case DUET__ENVELOPE__BODY_TOKENS:
        rq_on_tokens(rt, wid, env->tokens);
        return;
    case DUET__ENVELOPE__BODY_MOVE_PAUSED:
        rq_on_move_paused(rt, wid, env->move_paused);
        return;
    case DUET__ENVELOPE__BODY_MOVED:
        rq_on_moved(rt, wid, env->moved);
        return;
    default:
        return;
    }
}

/* ---------------------------------------------------------------- timers */

static void rq_on_expired(void *handle, uint64_t waited_ms, void *user)
{
    rq_t *r = handle;
    r->phase = RQ_NEW; /* admission has dropped it: rq_end must not cancel it there */
    rq_fail(r, DUET_ADMISSION_EXPIRED_HTTP_STATUS, "server_error", "queue_timeout", 1,
            "waited %llu ms in the admission queue without a free slot",
            (unsigned long long)waited_ms);
}

void duet__rq_tick(uv_timer_t *t)
{
    duet__router_t *rt = t->data;
    uint64_t now = uv_now(rt->loop);
    duet_admission_expire(rt->adm, now, rq_on_expired, rt);
    rq_start_ready(rt, now); /* a requeue's hold may have ended */
    uint64_t *v = NULL;
    size_t n = rq_collect(rt, &v);
    for (size_t i = 0; i < n; i++) {
        rq_t *r = rq_find(rt, v[i]);
        if (r == NULL)
            continue; /* ended with a sibling choice */
        if (r->phase != RQ_QUEUED && now >= r->deadline_ms) {
            rq_fail(r, 504, "server_error", "deadline_exceeded", 0,
                    "the request ran past its deadline (request.deadline_ms = %llu)",
                    (unsigned long long)rt->deadline_ms);
            continue;
        }
        if (rt->n_migrate_from > 0 && r->phase == RQ_GENERATING && r->move == MV_NONE &&
            !r->move_given_up && now >= r->move_retry_ms && duet__rt_migrating(rt, r->gen_id))
            rq_move_start(r);
    }
    free(v);
}
