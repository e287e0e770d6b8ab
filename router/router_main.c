/*
 * duet-router: the one door of a duet cluster (docs/architecture.md). It serves the OpenAI API over
 * HTTP (router/http/http.h + router/api/openai.h), tokenizes in-process (the tokenizer library, never the
 * engine), keeps the worker registry (router/cluster/registry.h), places requests (router/cluster/placement.h),
 * bounds what it accepts (router/cluster/admission.h) and exposes the admin API (router/cluster/admin.h).
 *
 * Path of one request (rq_t), all on the loop thread:
 *   validate + tokenize -> admission (429/503 with Retry-After, or wait in the bounded queue)
 *   -> pick a gen worker -> Reserve             (or Generate when the prompt is shorter than
 *   <- Reserved | Refused (next gen, else 429)    placement.local_prefill_tokens: local prefill)
 *   -> pick a ctx worker -> Prefill + reservation
 *   <- Tokens (first token) from ctx -> PrefillDone to gen
 *   <- Tokens from gen ... finish
 * Tokens go through the openai stream state (detokenization, stop strings, max_tokens) to the
 * client, as SSE chunks or one JSON body. SSE headers go out with the first token, so every
 * failure before it is a proper HTTP status; after it, an SSE error event.
 *
 * Ending. rq_end() is the only exit and runs exactly once per request (guarded by rq->done): it
 * cancels whatever a worker still runs for it (client disconnect, deadline, stop string, error),
 * gives the admission slot back (which may start a queued request), and releases the HTTP
 * request. Worker death: a request whose context worker dies (or fails) before the first token
 * is prefilled once more on another context worker; any other loss fails it with a message that
 * names the worker and the reason.
 */
#include <jansson.h>
#include <libgen.h>
#include <math.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <uv.h>

#include "common/config.h"
#include "common/fingerprint.h"
#include "common/json.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/strbuf.h"
#include "common/version.h"
#include "tokenizer/tokenizer.h"
#include "proto/frame.h"
#include "router/cluster/admin.h"
#include "router/cluster/admission.h"
#include "router/api/chat_template.h"
#include "router/http/http.h"
#include "router/api/openai.h"
#include "router/cluster/placement.h"
#include "router/cluster/registry.h"

/* ------------------------------------------------------------------------------ config */

static const char *const rt_policies[] = {"round_robin", "least_loaded", NULL};

static const duet_config_key_t rt_keys[] = {
    {"http.host", DUET_CONFIG_STRING, "127.0.0.1", "HTTP (OpenAI API) bind address", .min = NULL},
    {"http.port", DUET_CONFIG_INT, "8000", "HTTP port (0 = ephemeral)", .min = "0", .max = "65535"},
    {"http.max_connections", DUET_CONFIG_INT, "1024", "open client connections at most",
     .min = "1", .max = "1000000"},
    {"workers.host", DUET_CONFIG_STRING, "127.0.0.1", "worker port bind address", .min = NULL},
    {"workers.port", DUET_CONFIG_INT, "8100", "port where workers register (0 = ephemeral)",
     .min = "0", .max = "65535"},
    {"workers.heartbeat_timeout_ms", DUET_CONFIG_INT, "5000",
     "a worker without a heartbeat for this long is dead", .min = "50", .max = "3600000"},
    {"model.dir", DUET_CONFIG_STRING, NULL,
     "model folder: config.json, tokenizer, chat_template.json", .required = true,
     .alias = "model"},
    {"model.name", DUET_CONFIG_STRING, "", "served model name (default: the folder's name)", .min = NULL},
    {"model.fingerprint", DUET_CONFIG_STRING, "",
     "what workers must present: \"\" = computed from model.dir, \"first\" = adopt the first "
     "worker's, anything else = this exact string", .min = NULL},
    {"placement.policy", DUET_CONFIG_ENUM, "least_loaded", "worker choice", .choices = rt_policies},
    {"placement.local_prefill_tokens", DUET_CONFIG_INT, "0",
     "prompts shorter than this are prefilled on the gen worker (Generate); 0 = never",
     .min = "0", .max = "1000000"},
    {"request.deadline_ms", DUET_CONFIG_INT, "600000",
     "a request still running after this long is cancelled (504)", .min = "1",
     .max = "86400000"},
    {"limits.max_tokens_default", DUET_CONFIG_INT, "256", "max_tokens when a request has none",
     .min = "1", .max = "10000000"},
    {"limits.max_tokens", DUET_CONFIG_INT, "8192", "largest max_tokens accepted", .min = "1",
     .max = "10000000"},
    {"limits.max_prompt_tokens", DUET_CONFIG_INT, "0", "longest prompt (0 = no limit)", .min = "0",
     .max = "100000000"},
    {"limits.max_context", DUET_CONFIG_INT, "0",
     "prompt + max_tokens at most (0 = config.json's model_max_length, else no limit)",
     .min = "0", .max = "100000000"},
    {"limits.max_body_bytes", DUET_CONFIG_SIZE, "4MiB", "largest request body", .min = "1024",
     .max = "1GiB"},
    DUET_ADMISSION_CONFIG_KEYS,
    DUET_ADMIN_CONFIG_KEYS,
};

/* ------------------------------------------------------------------------------ state */

typedef enum {
    RQ_QUEUED = 0,  /* waiting in admission */
    RQ_RESERVING,   /* Reserve sent to gen_id */
    RQ_PREFILLING,  /* Prefill sent to ctx_id */
    RQ_GENERATING,  /* gen_id streams (after PrefillDone, or Generate) */
} rq_phase_t;

#define RQ_MAX_EXCLUDE 8
#define RQ_BUCKETS     1024

typedef struct rt rt_t;

typedef struct rq {
    rt_t *rt;
    uint64_t id;
    duet_http_request_t *http; /* one reference, released in rq_end */
    duet_oai_request_t oai;    /* owned */
    uint32_t *ids;             /* (n_ids) prompt, owned */
    size_t n_ids;
    duet_oai_stream_t *stream; /* owned */
    duet_oai_resp_meta_t meta;
    char resp_id[32];
    const char *endpoint; /* metric label */
    rq_phase_t phase;
    bool admitted, local, sse_started, done;
    uint64_t gen_id, ctx_id;          /* 0 = none */
    bool gen_busy, ctx_busy;          /* the worker still works on it (owes Tokens) */
    uint64_t exclude_gen[RQ_MAX_EXCLUDE]; /* gens that refused */
    size_t n_exclude_gen;
    uint64_t exclude_ctx[RQ_MAX_EXCLUDE]; /* ctx workers that failed it */
    size_t n_exclude_ctx;
    int prefill_attempts;
    uint8_t *reservation; /* owned */
    size_t reservation_len;
    uint64_t t_start_ns, t_first_ns, t_last_ns;
    uint64_t deadline_ms; /* uv_now clock */
    uint32_t retry_after_ms;
    struct rq *bucket_next;
} rq_t;

typedef struct drain_waiter {
    uint64_t worker_id;
    duet_admin_drain_done_cb cb;
    void *user;
    struct drain_waiter *next;
} drain_waiter_t;

struct rt {
    uv_loop_t *loop;
    duet_config_t *cfg;
    duet_tokenizer_t *tok;
    duet_oai_template_t *tmpl;
    duet_oai_limits_t lim;
    uint32_t eos[DUET_OAI_MAX_EOS];
    size_t n_eos;
    char model_name[256];
    duet_http_server_t *http;
    duet_registry_t *reg;
    duet_admission_t *adm;
    duet_admin_t *admin;
    duet_placement_t pl;
    uv_timer_t tick;
    uv_signal_t sig_int, sig_term;
    bool draining;
    uint64_t next_rid;
    uint32_t local_prefill_tokens;
    uint64_t deadline_ms;
    uint64_t queue_timeout_ms;
    rq_t *buckets[RQ_BUCKETS];
    size_t n_rq;
    drain_waiter_t *waiters;
    /* metrics */
    duet_metrics_t *metrics;
    duet_http_metrics_t http_fams;
    duet_metric_t *m_ttft, *m_tpot, *m_e2e, *m_tok_in, *m_tok_out;
    duet_metric_t *m_gen_steps, *m_gen_seq_steps, *m_gen_tokens, *m_gen_step_s, *m_prefill_tok;
    duet_metric_family_t *f_workers, *f_results, *f_retries;
};

static rt_t g_rt; /* one router per process; a static keeps the signal handlers trivial */

/* ------------------------------------------------------------------------------ requests table */

static void rq_table_add(rt_t *rt, rq_t *r)
{
    size_t b       = r->id % RQ_BUCKETS;
    r->bucket_next = rt->buckets[b];
    rt->buckets[b] = r;
    rt->n_rq++;
}

static void rq_table_del(rt_t *rt, rq_t *r)
{
    for (rq_t **p = &rt->buckets[r->id % RQ_BUCKETS]; *p != NULL; p = &(*p)->bucket_next)
        if (*p == r) {
            *p = r->bucket_next;
            rt->n_rq--;
            return;
        }
}

static rq_t *rq_find(rt_t *rt, uint64_t id)
{
    for (rq_t *r = rt->buckets[id % RQ_BUCKETS]; r != NULL; r = r->bucket_next)
        if (r->id == id)
            return r;
    return NULL;
}

/* Every live request, collected first so that the callee may end them. */
static size_t rq_collect(rt_t *rt, rq_t ***out_p)
{
    rq_t **v = malloc((rt->n_rq + 1) * sizeof(*v));
    size_t n = 0;
    if (v == NULL)
        return 0;
    for (size_t b = 0; b < RQ_BUCKETS; b++)
        for (rq_t *r = rt->buckets[b]; r != NULL; r = r->bucket_next)
            v[n++] = r;
    *out_p = v;
    return n;
}

/* ------------------------------------------------------------------------------ helpers */

static void rt_result(rt_t *rt, const char *endpoint, const char *result)
{
    duet_metric_t     *m;
    const char *const  v[2] = {endpoint, result};
    if (duet_metrics_child(rt->f_results, v, 2, &m) == DUET_OK)
        duet_metrics_counter_inc(m);
}

static uint64_t unix_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static void rt_send_cancel(rt_t *rt, uint64_t worker_id, uint64_t rid, const char *reason)
{
    Duet__Cancel   c   = DUET__CANCEL__INIT;
    c.request_id       = rid;
    c.reason           = (char *)reason;
    Duet__Envelope env = DUET__ENVELOPE__INIT;
    env.body_case      = DUET__ENVELOPE__BODY_CANCEL;
    env.cancel         = &c;
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
    char               ra[24];
    duet_http_header_t h = {"Retry-After", ra};
    snprintf(ra, sizeof(ra), "%u", retry_after_s);
    duet_http_respond(http, e->http_status, "application/json", &h, retry_after_s > 0 ? 1 : 0,
                      sb.data != NULL ? sb.data : "", sb.len);
    duet_strbuf_free(&sb);
}

static void rt_drain_waiters_check(rt_t *rt, uint64_t worker_id, duet_status_t st,
                                   const char *detail);

/* ------------------------------------------------------------------------------ ending */

static void rq_start(rq_t *r);

/*
 * The one exit. Cancels workers that still hold the request, hands the admission slot on, and
 * releases everything. Runs once (r->done guards it).
 */
static void rq_end(rq_t *r, const char *why)
{
    if (r->done)
        return;
    r->done   = true;
    rt_t *rt  = r->rt;
    if (r->gen_id != 0) {
        if (r->gen_busy)
            rt_send_cancel(rt, r->gen_id, r->id, why);
        duet_registry_inflight_add(rt->reg, r->gen_id, -1);
        rt_drain_waiters_check(rt, r->gen_id, DUET_OK, NULL);
    }
    if (r->ctx_id != 0) {
        if (r->ctx_busy)
            rt_send_cancel(rt, r->ctx_id, r->id, why);
        duet_registry_inflight_add(rt->reg, r->ctx_id, -1);
        rt_drain_waiters_check(rt, r->ctx_id, DUET_OK, NULL);
    }
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
    duet_http_request_set_data(r->http, NULL);
    duet_http_request_release(r->http);
    duet_oai_stream_destroy(r->stream);
    duet_oai_request_free(&r->oai);
    free(r->ids);
    free(r->reservation);
    free(r);
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
    char             msg[512];
    va_list          ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    duet_oai_error_make(&e, status, type, code, NULL, "%s", msg);
    DUET_RLOG_WARN(r->id, "request failed (%d): %s", status, msg);
    if (!duet_http_request_aborted(r->http)) {
        if (r->sse_started) {
            duet_strbuf_t sb;
            duet_strbuf_init(&sb);
            duet_oai_sse_error(&e, &sb);
            duet_strbuf_puts(&sb, "data: [DONE]\n\n");
            duet_http_stream_write(r->http, sb.data, sb.len);
            duet_http_stream_end(r->http);
            duet_strbuf_free(&sb);
        } else {
            respond_error(r->http, &e, retry_after_s);
        }
    }
    rt_result(r->rt, r->endpoint, status == 429 ? "rejected" : "error");
    rq_end(r, msg);
}

/* The choice finished normally: final bytes to the client, metrics, end. */
static void rq_complete(rq_t *r, duet_oai_finish_t finish)
{
    rt_t    *rt  = r->rt;
    uint32_t n_c = duet_oai_stream_n_tokens(r->stream);
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    if (r->oai.stream) {
        if (!r->sse_started) {
            if (duet_http_sse_begin(r->http, NULL, 0) == DUET_OK)
                r->sse_started = true;
            duet_oai_sse_begin(&r->meta, &sb);
        }
        duet_oai_sse_end(&r->meta, finish, (uint32_t)r->n_ids, n_c, &sb);
        duet_http_stream_write(r->http, sb.data, sb.len);
        duet_http_stream_end(r->http);
    } else {
        const char *text;
        size_t      len;
        duet_oai_stream_text(r->stream, &text, &len);
        duet_oai_response_json(&r->meta, text, len, finish, (uint32_t)r->n_ids, n_c, &sb);
        duet_http_respond(r->http, 200, "application/json", NULL, 0, sb.data, sb.len);
    }
    duet_strbuf_free(&sb);
    uint64_t now = uv_hrtime();
    duet_metrics_histogram_observe(rt->m_e2e, (double)(now - r->t_start_ns) / 1e9);
    if (n_c > 1 && r->t_last_ns > r->t_first_ns)
        duet_metrics_histogram_observe(rt->m_tpot,
                                       (double)(r->t_last_ns - r->t_first_ns) / 1e9 / (n_c - 1));
    duet_metrics_counter_add(rt->m_tok_out, n_c);
    rt_result(rt, r->endpoint, "ok");
    rq_end(r, "finished");
}

/* Emit text now (streaming) or keep it (the stream keeps it for non-streaming). */
static void rq_emit(rq_t *r, const char *text, size_t len)
{
    if (!r->oai.stream || len == 0)
        return;
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    if (!r->sse_started) {
        if (duet_http_sse_begin(r->http, NULL, 0) != DUET_OK) {
            duet_strbuf_free(&sb);
            return; /* aborted: on_abort ends it */
        }
        r->sse_started = true;
        duet_oai_sse_begin(&r->meta, &sb);
    }
    duet_oai_sse_delta(&r->meta, text, len, &sb);
    duet_http_stream_write(r->http, sb.data, sb.len);
    duet_strbuf_free(&sb);
}

/*
 * Feed ids from a worker; returns true when the request ended (it is freed then).
 * worker_finish: the worker's finish_reason for this message.
 */
static bool rq_feed(rq_t *r, const uint32_t *ids, size_t n, int worker_finish)
{
    for (size_t i = 0; i < n; i++) {
        const char       *text = NULL;
        size_t            len  = 0;
        duet_oai_finish_t fin  = DUET_OAI_FINISH_NONE;
        if (r->t_first_ns == 0) {
            r->t_first_ns = uv_hrtime();
            duet_metrics_histogram_observe(r->rt->m_ttft,
                                           (double)(r->t_first_ns - r->t_start_ns) / 1e9);
        }
        r->t_last_ns     = uv_hrtime();
        duet_status_t st = duet_oai_stream_feed(r->stream, ids[i], &text, &len, &fin);
        if (st < 0) {
            rq_fail(r, 502, "server_error", "bad_worker_output", 0,
                    "worker sent token id %u, which is outside the vocabulary", ids[i]);
            return true;
        }
        rq_emit(r, text, len);
        if (fin != DUET_OAI_FINISH_NONE) {
            rq_complete(r, fin);
            return true;
        }
    }
    if (worker_finish == DUET__TOKENS__FINISH_REASON__STOP ||
        worker_finish == DUET__TOKENS__FINISH_REASON__LENGTH) {
        const char       *text = NULL;
        size_t            len  = 0;
        duet_oai_finish_t fin  = DUET_OAI_FINISH_NONE;
        duet_oai_stream_finish(r->stream,
                               worker_finish == DUET__TOKENS__FINISH_REASON__STOP
                                   ? DUET_OAI_FINISH_STOP
                                   : DUET_OAI_FINISH_LENGTH,
                               &text, &len, &fin);
        rq_emit(r, text, len);
        rq_complete(r, fin != DUET_OAI_FINISH_NONE ? fin : DUET_OAI_FINISH_STOP);
        return true;
    }
    return false;
}

/* ------------------------------------------------------------------------------ placement */

static uint64_t rt_pick(rt_t *rt, duet_worker_role_t role, const uint64_t *ex, size_t n_ex)
{
    duet_placement_candidate_t c[256];
    size_t                     n   = duet_registry_candidates(rt->reg, c, 256);
    size_t                     idx = 0;
    if (duet_placement_pick(&rt->pl, role, c, n, ex, n_ex, &idx) < 0)
        return 0;
    return c[idx].id;
}

static void rq_fill_sampling(const rq_t *r, Duet__Sampling *s, uint32_t *stop_ids)
{
    s->temperature  = (float)r->oai.temperature;
    s->top_p        = (float)r->oai.top_p;
    s->top_k        = r->oai.top_k > 0 ? (uint32_t)r->oai.top_k : 0;
    s->has_seed     = r->oai.has_seed;
    s->seed         = (uint64_t)r->oai.seed;
    s->ignore_eos   = r->oai.ignore_eos;
    size_t n        = 0;
    if (!r->oai.ignore_eos)
        for (size_t i = 0; i < r->rt->n_eos; i++)
            stop_ids[n++] = r->rt->eos[i];
    s->stop_token_ids   = stop_ids;
    s->n_stop_token_ids = n;
}

/* Send Reserve (or Generate) to a gen worker not yet excluded; false when none is left. */
static bool rq_send_to_gen(rq_t *r)
{
    rt_t    *rt  = r->rt;
    uint64_t gid = rt_pick(rt, DUET_WORKER_ROLE_GEN, r->exclude_gen, r->n_exclude_gen);
    if (gid == 0)
        return false;
    r->gen_id   = gid;
    r->gen_busy = true;
    duet_registry_inflight_add(rt->reg, gid, +1);
    uint32_t       stop_ids[DUET_OAI_MAX_EOS];
    Duet__Sampling s   = DUET__SAMPLING__INIT;
    Duet__Envelope env = DUET__ENVELOPE__INIT;
    rq_fill_sampling(r, &s, stop_ids);
    uint64_t deadline = unix_ms() + (r->deadline_ms - uv_now(rt->loop));
    if (r->local) {
        Duet__Generate g   = DUET__GENERATE__INIT;
        g.request_id       = r->id;
        g.tokens           = r->ids;
        g.n_tokens         = r->n_ids;
        g.sampling         = &s;
        g.max_tokens       = r->oai.max_tokens;
        g.deadline_unix_ms = deadline;
        env.body_case      = DUET__ENVELOPE__BODY_GENERATE;
        env.generate       = &g;
        r->phase           = RQ_GENERATING;
        duet_registry_send(rt->reg, gid, &env);
    } else {
        Duet__Reserve rs     = DUET__RESERVE__INIT;
        rs.request_id        = r->id;
        rs.prompt_tokens     = (uint32_t)r->n_ids;
        rs.max_tokens        = r->oai.max_tokens;
        rs.deadline_unix_ms  = deadline;
        rs.tokens            = r->ids;
        rs.n_tokens          = r->n_ids;
        rs.sampling          = &s;
        env.body_case        = DUET__ENVELOPE__BODY_RESERVE;
        env.reserve          = &rs;
        r->phase             = RQ_RESERVING;
        duet_registry_send(rt->reg, gid, &env);
    }
    DUET_RLOG_DEBUG(r->id, "%s sent to gen worker %llu", r->local ? "Generate" : "Reserve",
                    (unsigned long long)gid);
    return true;
}

/* Send Prefill to a ctx worker; false when none is live. */
static bool rq_send_to_ctx(rq_t *r)
{
    rt_t    *rt  = r->rt;
    uint64_t cid = rt_pick(rt, DUET_WORKER_ROLE_CTX, r->exclude_ctx, r->n_exclude_ctx);
    if (cid == 0)
        return false;
    if (r->ctx_id != 0)
        duet_registry_inflight_add(rt->reg, r->ctx_id, -1);
    r->ctx_id   = cid;
    r->ctx_busy = true;
    r->prefill_attempts++;
    duet_registry_inflight_add(rt->reg, cid, +1);
    uint32_t       stop_ids[DUET_OAI_MAX_EOS];
    Duet__Sampling s   = DUET__SAMPLING__INIT;
    rq_fill_sampling(r, &s, stop_ids);
    Duet__Prefill p    = DUET__PREFILL__INIT;
    p.request_id       = r->id;
    p.tokens           = r->ids;
    p.n_tokens         = r->n_ids;
    p.sampling         = &s;
    p.max_tokens       = r->oai.max_tokens;
    p.reservation.data = r->reservation;
    p.reservation.len  = r->reservation_len;
    p.deadline_unix_ms = unix_ms() + (r->deadline_ms - uv_now(rt->loop));
    Duet__Envelope env = DUET__ENVELOPE__INIT;
    env.body_case      = DUET__ENVELOPE__BODY_PREFILL;
    env.prefill        = &p;
    r->phase           = RQ_PREFILLING;
    duet_registry_send(rt->reg, cid, &env);
    DUET_RLOG_DEBUG(r->id, "Prefill sent to ctx worker %llu (attempt %d)", (unsigned long long)cid,
                    r->prefill_attempts);
    return true;
}

/* The prefill on r->ctx_id failed (worker died or reported an error): retry once elsewhere. */
static void rq_prefill_failed(rq_t *r, const char *what)
{
    rt_t *rt    = r->rt;
    r->ctx_busy = false;
    if (r->n_exclude_ctx < RQ_MAX_EXCLUDE)
        r->exclude_ctx[r->n_exclude_ctx++] = r->ctx_id;
    if (r->prefill_attempts < 2 && rq_send_to_ctx(r)) {
        duet_metrics_counter_inc(duet_metrics_single(rt->f_retries));
        DUET_RLOG_WARN(r->id, "prefill retried on ctx worker %llu after: %s",
                       (unsigned long long)r->ctx_id, what);
        return;
    }
    rq_fail(r, 502, "server_error", "worker_failed", 0,
            "prefill failed: %s%s", what,
            r->prefill_attempts >= 2 ? " (already retried once on another context worker)"
                                     : " (no other live context worker to retry on)");
}

/* An admitted request starts: pick the gen worker first. */
static void rq_start(rq_t *r)
{
    r->admitted = true;
    if (!rq_send_to_gen(r))
        rq_fail(r, 503, "server_error", "no_capacity", 1,
                "no live generation worker can take the request");
}

/* ------------------------------------------------------------------------------ worker events */

static void rt_update_capacity(rt_t *rt)
{
    bool cap = duet_registry_count(rt->reg, DUET_WORKER_ROLE_GEN, DUET_WORKER_STATE_UP) > 0;
    duet_admission_set_capacity(rt->adm, cap);
    void *h = NULL;
    while (cap && duet_admission_pop_ready(rt->adm, uv_now(rt->loop), &h))
        rq_start((rq_t *)h);
}

static void rt_on_worker_up(const duet_worker_info_t *w, void *user)
{
    rt_update_capacity(user);
}

static void rt_on_worker_state(const duet_worker_info_t *w, void *user)
{
    rt_update_capacity(user);
}

static void rt_on_worker_down(const duet_worker_info_t *w, const char *reason, void *user)
{
    rt_t  *rt = user;
    rq_t **v  = NULL;
    size_t n  = rq_collect(rt, &v);
    char   what[256];
    snprintf(what, sizeof(what), "%s worker %llu (%s) lost: %s", duet_worker_role_name(w->role),
             (unsigned long long)w->id, w->name, reason);
    for (size_t i = 0; i < n; i++) {
        rq_t *r = v[i];
        if (r->gen_id == w->id && r->phase != RQ_QUEUED) {
            r->gen_busy = false;
            r->gen_id   = 0; /* its in-flight count died with it */
            rq_fail(r, 502, "server_error", "worker_lost", 0, "%s", what);
        } else if (r->ctx_id == w->id && r->phase == RQ_PREFILLING) {
            rq_prefill_failed(r, what); /* excludes r->ctx_id (= w) and retries once */
        }
    }
    free(v);
    rt_drain_waiters_check(rt, w->id, DUET_ERR_TRANSPORT, what);
    rt_update_capacity(rt);
}

/* Workers' work counters (heartbeats) become router counters, for duet-bench and dashboards. */
static void rt_on_stats(const duet_worker_info_t *w, const duet_worker_stats_t *d, void *user)
{
    rt_t *rt = user;
    if (w->role == DUET_WORKER_ROLE_GEN) {
        duet_metrics_counter_add(rt->m_gen_steps, (double)d->decode_steps);
        duet_metrics_counter_add(rt->m_gen_seq_steps, (double)d->decode_seq_steps);
        duet_metrics_counter_add(rt->m_gen_tokens, (double)d->decoded_tokens);
        duet_metrics_counter_add(rt->m_gen_step_s, d->step_seconds);
    }
    duet_metrics_counter_add(rt->m_prefill_tok, (double)d->prefill_tokens);
}

static void rt_on_message(uint64_t wid, const Duet__Envelope *env, void *user)
{
    rt_t *rt = user;
    switch (env->body_case) {
    case DUET__ENVELOPE__BODY_RESERVED: {
        rq_t *r = rq_find(rt, env->reserved->request_id);
        if (r == NULL || r->gen_id != wid || r->phase != RQ_RESERVING) {
            /* the request is gone (or this is stale): give the pages back */
            if (r == NULL)
                rt_send_cancel(rt, wid, env->reserved->request_id, "request no longer exists");
            return;
        }
        free(r->reservation);
        r->reservation_len = env->reserved->reservation.len;
        r->reservation     = malloc(r->reservation_len > 0 ? r->reservation_len : 1);
        if (r->reservation == NULL) {
            rq_fail(r, 500, "server_error", NULL, 0, "out of memory");
            return;
        }
        memcpy(r->reservation, env->reserved->reservation.data, r->reservation_len);
        if (!rq_send_to_ctx(r))
            rq_fail(r, 503, "server_error", "no_capacity", 1,
                    "no live context worker can prefill the request");
        return;
    }
    case DUET__ENVELOPE__BODY_REFUSED: {
        const Duet__Refused *m = env->refused;
        rq_t                *r = rq_find(rt, m->request_id);
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
        uint32_t ra = (r->retry_after_ms + 999) / 1000;
        rq_fail(r, 429, "rate_limit_exceeded", "no_reservation", ra > 0 ? ra : 1,
                "no generation worker could reserve cache for the request (last refusal: %s)",
                m->reason);
        return;
    }
    case DUET__ENVELOPE__BODY_TOKENS: {
        const Duet__Tokens *m = env->tokens;
        rq_t               *r = rq_find(rt, m->request_id);
        if (r == NULL)
            return; /* ended already (its Cancel crossed these tokens) */
        bool from_ctx = r->phase == RQ_PREFILLING && wid == r->ctx_id;
        bool from_gen = r->phase == RQ_GENERATING && wid == r->gen_id;
        if (!from_ctx && !from_gen) {
            DUET_RLOG_DEBUG(r->id, "ignoring Tokens from worker %llu (phase %d)",
                            (unsigned long long)wid, (int)r->phase);
            return;
        }
        int fin = m->finish_reason;
        if (fin == DUET__TOKENS__FINISH_REASON__ERROR ||
            fin == DUET__TOKENS__FINISH_REASON__CANCELLED) {
            char what[320];
            snprintf(what, sizeof(what), "worker %llu %s: %s", (unsigned long long)wid,
                     fin == DUET__TOKENS__FINISH_REASON__ERROR ? "failed" : "cancelled the request",
                     m->error != NULL && m->error[0] != '\0' ? m->error : "(no detail)");
            if (from_ctx && fin == DUET__TOKENS__FINISH_REASON__ERROR && m->n_ids == 0) {
                rq_prefill_failed(r, what);
                return;
            }
            if (from_ctx)
                r->ctx_busy = false;
            else
                r->gen_busy = false;
            rq_fail(r, 502, "server_error", "worker_failed", 0, "%s", what);
            return;
        }
        if (fin != DUET__TOKENS__FINISH_REASON__NONE) {
            if (from_ctx)
                r->ctx_busy = false;
            else
                r->gen_busy = false;
        }
        if (from_ctx) {
            /* the first token: after it, the gen worker continues (unless this was the end) */
            if (m->n_ids == 0 && fin == DUET__TOKENS__FINISH_REASON__NONE)
                return;
            uint32_t first = m->n_ids > 0 ? m->ids[m->n_ids - 1] : 0;
            r->ctx_busy = false;
            if (rq_feed(r, m->ids, m->n_ids, fin))
                return;
            Duet__PrefillDone pd = DUET__PREFILL_DONE__INIT;
            pd.request_id        = r->id;
            pd.first_token       = first;
            Duet__Envelope e     = DUET__ENVELOPE__INIT;
            e.body_case          = DUET__ENVELOPE__BODY_PREFILL_DONE;
            e.prefill_done       = &pd;
            r->phase             = RQ_GENERATING;
            if (duet_registry_send(rt->reg, r->gen_id, &e) < 0)
                rq_fail(r, 502, "server_error", "worker_lost",
                        0, "generation worker %llu is gone", (unsigned long long)r->gen_id);
            return;
        }
        rq_feed(r, m->ids, m->n_ids, fin);
        return;
    }
    default:
        return;
    }
}

/* ------------------------------------------------------------------------------ admin ops */

typedef struct {
    duet_admin_worker_visit_cb visit;
    void *user;
} rt_visit_t;

static void rt_visit_one(const duet_worker_info_t *w, void *user)
{
    rt_visit_t              *v = user;
    duet_admin_worker_info_t a = {
        .id         = w->id,
        .name       = w->name,
        .role       = duet_worker_role_name(w->role),
        .state      = w->state == DUET_WORKER_STATE_UP         ? DUET_ADMIN_WORKER_LIVE
                      : w->state == DUET_WORKER_STATE_DRAINING ? DUET_ADMIN_WORKER_DRAINING
                                                               : DUET_ADMIN_WORKER_DEAD,
        .free_pages = w->free_pages,
        .running    = w->running,
        .queued     = w->queued,
    };
    v->visit(&a, v->user);
}

static void rt_admin_list(void *ctx, duet_admin_worker_visit_cb visit, void *visit_user)
{
    rt_t      *rt = ctx;
    rt_visit_t v  = {visit, visit_user};
    duet_registry_foreach(rt->reg, rt_visit_one, &v);
}

typedef struct {
    const char *name;
    uint64_t id;
    bool live;
} rt_find_t;

static void rt_find_one(const duet_worker_info_t *w, void *user)
{
    rt_find_t *f = user;
    if (strcmp(w->name, f->name) != 0)
        return;
    bool live = w->state != DUET_WORKER_STATE_DEAD;
    if (f->id == 0 || (live && !f->live)) { /* prefer a live worker of that name */
        f->id   = w->id;
        f->live = live;
    }
}

static duet_status_t rt_find_worker(rt_t *rt, const char *name, uint64_t *id_p)
{
    rt_find_t f = {name, 0, false};
    duet_registry_foreach(rt->reg, rt_find_one, &f);
    if (f.id == 0)
        return duet_error_set(DUET_ERR_NOT_FOUND, "no worker named %s", name);
    if (!f.live)
        return duet_error_set(DUET_ERR_BUSY, "worker %s is dead", name);
    *id_p = f.id;
    return DUET_OK;
}

static void rt_drain_waiters_check(rt_t *rt, uint64_t worker_id, duet_status_t st,
                                   const char *detail)
{
    duet_worker_info_t w;
    if (st == DUET_OK && (duet_registry_get(rt->reg, worker_id, &w) < 0 || w.inflight > 0))
        return;
    for (drain_waiter_t **p = &rt->waiters; *p != NULL;) {
        drain_waiter_t *d = *p;
        if (d->worker_id != worker_id) {
            p = &d->next;
            continue;
        }
        *p = d->next;
        d->cb(d->user, st, detail);
        free(d);
    }
}

static duet_status_t rt_admin_drain(void *ctx, const char *name, duet_admin_drain_done_cb done_cb,
                                    void *done_user)
{
    rt_t         *rt = ctx;
    uint64_t      id = 0;
    duet_status_t st = rt_find_worker(rt, name, &id);
    if (st < 0)
        return st;
    if ((st = duet_registry_set_draining(rt->reg, id, true)) < 0)
        return st;
    rt_update_capacity(rt);
    if (done_cb == NULL)
        return DUET_OK;
    drain_waiter_t *d = calloc(1, sizeof(*d));
    if (d == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "drain waiter");
    d->worker_id = id;
    d->cb        = done_cb;
    d->user      = done_user;
    d->next      = rt->waiters;
    rt->waiters  = d;
    rt_drain_waiters_check(rt, id, DUET_OK, NULL);
    return DUET_OK;
}

static void rt_admin_drain_forget(void *ctx, void *done_user)
{
    rt_t *rt = ctx;
    for (drain_waiter_t **p = &rt->waiters; *p != NULL;) {
        drain_waiter_t *d = *p;
        if (d->user == done_user) {
            *p = d->next;
            free(d);
        } else {
            p = &d->next;
        }
    }
}

static duet_status_t rt_admin_undrain(void *ctx, const char *name)
{
    rt_t         *rt = ctx;
    uint64_t      id = 0;
    duet_status_t st = rt_find_worker(rt, name, &id);
    if (st < 0)
        return st;
    if ((st = duet_registry_set_draining(rt->reg, id, false)) < 0)
        return st;
    rt_drain_waiters_check(rt, id, DUET_ERR_CANCELLED, "the worker was undrained");
    rt_update_capacity(rt);
    return DUET_OK;
}

static void rt_admin_changed(void *ctx)
{
    rt_update_capacity(ctx);
}

static const duet_admin_ops_t rt_admin_ops = {
    .list_workers      = rt_admin_list,
    .drain             = rt_admin_drain,
    .drain_forget      = rt_admin_drain_forget,
    .undrain           = rt_admin_undrain,
    .admission_changed = rt_admin_changed,
};

/* ------------------------------------------------------------------------------ HTTP */

static const char *rt_path_class(const char *path, void *user)
{
    static const char *known[] = {"/v1/completions", "/v1/chat/completions", "/v1/models",
                                  "/health", "/live", "/metrics"};
    for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++)
        if (strcmp(path, known[i]) == 0)
            return known[i];
    return "other";
}

static void respond_json_text(duet_http_request_t *http, int status, const char *body)
{
    duet_http_respond(http, status, "application/json", NULL, 0, body, strlen(body));
}

static void rt_set_worker_gauges(rt_t *rt)
{
    for (int role = DUET_WORKER_ROLE_CTX; role <= DUET_WORKER_ROLE_GEN; role++)
        for (int s = 0; s < DUET_WORKER_STATE_COUNT; s++) {
            const char *const v[2] = {duet_worker_role_name((duet_worker_role_t)role),
                                      duet_worker_state_name((duet_worker_state_t)s)};
            duet_metric_t    *m;
            if (duet_metrics_child(rt->f_workers, v, 2, &m) == DUET_OK)
                duet_metrics_gauge_set(
                    m, (double)duet_registry_count(rt->reg, role, (duet_worker_state_t)s));
        }
}

static void rt_handle_completion(rt_t *rt, duet_http_request_t *http, duet_oai_endpoint_t ep)
{
    size_t           len  = 0;
    const char      *body = duet_http_request_body(http, &len);
    duet_oai_error_t err;
    rq_t            *r = calloc(1, sizeof(*r));
    if (r == NULL) {
        duet_oai_error_make(&err, 500, "server_error", NULL, NULL, "out of memory");
        respond_error(http, &err, 0);
        duet_http_request_release(http);
        return;
    }
    r->rt         = rt;
    r->http       = http;
    r->id         = ++rt->next_rid;
    r->t_start_ns = uv_hrtime();
    r->endpoint   = ep == DUET_OAI_ENDPOINT_CHAT ? "/v1/chat/completions" : "/v1/completions";
    if (duet_oai_request_parse(&rt->lim, ep, body, len, &r->oai, &err) < 0 ||
        duet_oai_request_tokens(&r->oai, &rt->lim, rt->tmpl, rt->tok, &r->ids, &r->n_ids, &err) <
            0 ||
        duet_oai_stream_create(rt->tok, &r->oai, rt->eos, rt->n_eos, !r->oai.stream, &r->stream) <
            0) {
        if (err.http_status == 0)
            duet_oai_error_make(&err, 500, "server_error", NULL, NULL, "%s", duet_error_last());
        DUET_RLOG_INFO(r->id, "rejected (%d): %s", err.http_status, err.message);
        respond_error(http, &err, 0);
        rt_result(rt, r->endpoint, "invalid");
        duet_http_request_release(http);
        duet_oai_stream_destroy(r->stream);
        duet_oai_request_free(&r->oai);
        free(r->ids);
        free(r);
        return;
    }
    duet_oai_response_id(ep, r->id, r->resp_id, sizeof(r->resp_id));
    r->meta.endpoint      = ep;
    r->meta.id            = r->resp_id;
    r->meta.model         = rt->model_name;
    r->meta.created       = (int64_t)time(NULL);
    r->meta.include_usage = r->oai.include_usage;
    r->local              = r->n_ids < rt->local_prefill_tokens;
    uint64_t now          = uv_now(rt->loop);
    r->deadline_ms        = now + rt->deadline_ms;
    duet_metrics_counter_add(rt->m_tok_in, (double)r->n_ids);
    rq_table_add(rt, r);
    duet_http_request_set_data(http, r);
    DUET_RLOG_DEBUG(r->id, "%s: %zu prompt tokens, max_tokens %u, stream %d", r->endpoint,
                    r->n_ids, r->oai.max_tokens, (int)r->oai.stream);

    /* the admission integration point: bounded queue, 429 / 503 with Retry-After */
    duet_admission_result_t res;
    duet_admission_try_admit(rt->adm, r, now, now + rt->queue_timeout_ms, &res);
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

static void rt_on_request(duet_http_request_t *http, void *user)
{
    rt_t       *rt     = user;
    const char *path   = duet_http_request_path(http);
    const char *method = duet_http_request_method(http);
    bool        get    = strcmp(method, "GET") == 0 || strcmp(method, "HEAD") == 0;
    bool        post   = strcmp(method, "POST") == 0;

    if (strcmp(path, "/v1/completions") == 0 || strcmp(path, "/v1/chat/completions") == 0) {
        if (!post) {
            duet_http_header_t h = {"Allow", "POST"};
            const char *b = "{\"error\":{\"message\":\"use POST\",\"type\":\"invalid_request_error\","
                            "\"param\":null,\"code\":\"method_not_allowed\"}}";
            duet_http_respond(http, 405, "application/json", &h, 1, b, strlen(b));
        } else if (rt->draining) {
            duet_oai_error_t e;
            duet_oai_error_make(&e, 503, "server_error", "draining", NULL,
                                "the router is shutting down");
            respond_error(http, &e, 1);
        } else {
            rt_handle_completion(rt, http,
                                 path[4] == 'c' && path[5] == 'h' ? DUET_OAI_ENDPOINT_CHAT
                                                                  : DUET_OAI_ENDPOINT_COMPLETIONS);
            return; /* released by the request path */
        }
    } else if (!get) {
        duet_http_header_t h = {"Allow", "GET, HEAD"};
        const char *b = "{\"error\":{\"message\":\"use GET\",\"type\":\"invalid_request_error\","
                        "\"param\":null,\"code\":\"method_not_allowed\"}}";
        duet_http_respond(http, 405, "application/json", &h, 1, b, strlen(b));
    } else if (strcmp(path, "/live") == 0) {
        respond_json_text(http, 200, "{\"status\":\"live\"}");
    } else if (strcmp(path, "/health") == 0) {
        size_t gens = duet_registry_count(rt->reg, DUET_WORKER_ROLE_GEN, DUET_WORKER_STATE_UP);
        size_t ctxs = duet_registry_count(rt->reg, DUET_WORKER_ROLE_CTX, DUET_WORKER_STATE_UP);
        char   b[256];
        const char *why = rt->draining ? "draining" : gens == 0 ? "no live generation worker" : "";
        snprintf(b, sizeof(b),
                 "{\"status\":\"%s\",\"reason\":\"%s\",\"gen_workers\":%zu,\"ctx_workers\":%zu}",
                 why[0] == '\0' ? "ok" : "unavailable", why, gens, ctxs);
        respond_json_text(http, why[0] == '\0' ? 200 : 503, b);
    } else if (strcmp(path, "/metrics") == 0) {
        rt_set_worker_gauges(rt);
        duet_strbuf_t sb;
        duet_strbuf_init(&sb);
        duet_metrics_render(rt->metrics, &sb);
        duet_http_respond(http, 200, DUET_METRICS_CONTENT_TYPE, NULL, 0, sb.data != NULL ? sb.data : "",
                          sb.len);
        duet_strbuf_free(&sb);
    } else if (strcmp(path, "/v1/models") == 0) {
        duet_strbuf_t sb;
        duet_strbuf_init(&sb);
        duet_strbuf_puts(&sb, "{\"object\":\"list\",\"data\":[{\"id\":");
        duet_oai_json_string(&sb, rt->model_name, strlen(rt->model_name));
        duet_strbuf_printf(&sb, ",\"object\":\"model\",\"created\":%lld,\"owned_by\":\"duet\"}]}",
                           (long long)0);
        duet_http_respond(http, 200, "application/json", NULL, 0, sb.data, sb.len);
        duet_strbuf_free(&sb);
    } else {
        respond_json_text(http, 404, "{\"error\":{\"message\":\"not found\",\"type\":"
                                     "\"invalid_request_error\",\"param\":null,\"code\":null}}");
    }
    duet_http_request_release(http);
}

static void rt_on_abort(duet_http_request_t *http, void *user)
{
    rq_t *r = duet_http_request_get_data(http);
    if (r == NULL)
        return;
    DUET_RLOG_INFO(r->id, "client disconnected");
    rt_result(r->rt, r->endpoint, "cancelled");
    rq_end(r, "client disconnected");
}

/* ------------------------------------------------------------------------------ timers */

static void rt_on_expired(void *handle, uint64_t waited_ms, void *user)
{
    rq_t *r  = handle;
    r->phase = RQ_RESERVING; /* no longer queued: rq_end must not cancel it in admission */
    rq_fail(r, DUET_ADMISSION_EXPIRED_HTTP_STATUS, "server_error", "queue_timeout", 1,
            "waited %llu ms in the admission queue without a free slot",
            (unsigned long long)waited_ms);
}

static void rt_tick(uv_timer_t *t)
{
    rt_t    *rt  = t->data;
    uint64_t now = uv_now(rt->loop);
    duet_admission_expire(rt->adm, now, rt_on_expired, rt);
    rq_t **v = NULL;
    size_t n = rq_collect(rt, &v);
    for (size_t i = 0; i < n; i++)
        if (v[i]->phase != RQ_QUEUED && now >= v[i]->deadline_ms)
            rq_fail(v[i], 504, "server_error", "deadline_exceeded", 0,
                    "the request ran past its deadline (request.deadline_ms = %llu)",
                    (unsigned long long)rt->deadline_ms);
    free(v);
}

/* ------------------------------------------------------------------------------ shutdown */

static void rt_http_closed(void *user)
{
    rt_t *rt = user;
    rt->http = NULL;
    duet_registry_close(rt->reg, NULL, NULL);
    if (rt->admin != NULL)
        duet_admin_close(rt->admin, NULL, NULL);
    uv_timer_stop(&rt->tick);
    uv_close((uv_handle_t *)&rt->tick, NULL);
    uv_close((uv_handle_t *)&rt->sig_int, NULL);
    uv_close((uv_handle_t *)&rt->sig_term, NULL);
}

static void rt_on_signal(uv_signal_t *s, int signum)
{
    rt_t *rt = s->data;
    if (rt->draining)
        return;
    DUET_LOG_INFO("router: signal %d: draining (health 503), finishing requests in flight",
                  signum);
    rt->draining = true;
    duet_http_server_close(rt->http, rt_http_closed, rt);
}

/* ------------------------------------------------------------------------------ start-up */

/* model_max_length from config.json (0 when absent). */
static duet_status_t rt_load_model_config(const char *dir, size_t *max_len_p)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/config.json", dir);
    json_t       *root = NULL;
    duet_status_t st   = duet_json_load_file(path, DUET_JSON_DEFAULT_MAX_BYTES, &root);
    if (st < 0)
        return st;
    json_t *ml = json_object_get(root, "model_max_length");
    *max_len_p = json_is_integer(ml) && json_integer_value(ml) > 0
                     ? (size_t)json_integer_value(ml)
                     : 0;
    json_decref(root);
    return DUET_OK;
}

static duet_status_t rt_metrics_init(rt_t *rt)
{
    duet_status_t      st;
    duet_metrics_t    *m     = rt->metrics;
    const char *const  req[] = {"method", "path", "status"};
    const char *const  res[] = {"result"};
    const char *const  wk[]  = {"role", "state"};
    const char *const  er[]  = {"endpoint", "result"};
    double             lat[16];
    duet_metric_family_t *f;
    duet_metrics_buckets_exponential(0.005, 2.0, 16, lat); /* 5 ms .. 164 s */
    double tpot[14];
    duet_metrics_buckets_exponential(0.001, 2.0, 14, tpot); /* 1 ms .. 8 s */
    if ((st = duet_metrics_counter_new(m, "duet_router_http_requests_total",
                                       "HTTP responses by method, path and status", req, 3,
                                       &rt->http_fams.requests_total)) < 0 ||
        (st = duet_metrics_counter_new(m, "duet_router_http_bytes_in_total",
                                       "bytes read from HTTP clients", NULL, 0,
                                       &rt->http_fams.bytes_in_total)) < 0 ||
        (st = duet_metrics_counter_new(m, "duet_router_http_bytes_out_total",
                                       "bytes written to HTTP clients", NULL, 0,
                                       &rt->http_fams.bytes_out_total)) < 0 ||
        (st = duet_metrics_gauge_new(m, "duet_router_http_connections", "open HTTP connections",
                                     NULL, 0, &rt->http_fams.connections)) < 0 ||
        (st = duet_metrics_counter_new(m, "duet_router_http_connections_total",
                                       "HTTP connections by result", res, 1,
                                       &rt->http_fams.connections_total)) < 0)
        return st;
    if ((st = duet_metrics_histogram_new(m, "duet_router_ttft_seconds",
                                         "time from request arrival to the first token", NULL, 0,
                                         lat, 16, &f)) < 0)
        return st;
    rt->m_ttft = duet_metrics_single(f);
    if ((st = duet_metrics_histogram_new(m, "duet_router_tpot_seconds",
                                         "time per output token after the first", NULL, 0, tpot,
                                         14, &f)) < 0)
        return st;
    rt->m_tpot = duet_metrics_single(f);
    if ((st = duet_metrics_histogram_new(m, "duet_router_e2e_seconds",
                                         "time from request arrival to its last byte (finished "
                                         "requests)", NULL, 0, lat, 16, &f)) < 0)
        return st;
    rt->m_e2e = duet_metrics_single(f);
    if ((st = duet_metrics_counter_new(m, "duet_router_tokens_in_total", "prompt tokens accepted",
                                       NULL, 0, &f)) < 0)
        return st;
    rt->m_tok_in = duet_metrics_single(f);
    if ((st = duet_metrics_counter_new(m, "duet_router_tokens_out_total",
                                       "completion tokens sent (finished requests)", NULL, 0,
                                       &f)) < 0)
        return st;
    rt->m_tok_out = duet_metrics_single(f);
    static const struct {
        const char *name, *help;
        size_t      off;
    } wc[] = {
        {"duet_gen_decode_steps_total", "generation workers' forward steps that decoded",
         offsetof(rt_t, m_gen_steps)},
        {"duet_gen_decode_seq_steps_total",
         "sum over those steps of the requests decoding in each", offsetof(rt_t, m_gen_seq_steps)},
        {"duet_gen_decoded_tokens_total", "tokens produced by those steps",
         offsetof(rt_t, m_gen_tokens)},
        {"duet_gen_step_seconds_total", "wall time of those steps",
         offsetof(rt_t, m_gen_step_s)},
        {"duet_worker_prefill_tokens_total", "prompt tokens prefilled by workers",
         offsetof(rt_t, m_prefill_tok)},
    };
    for (size_t i = 0; i < sizeof(wc) / sizeof(wc[0]); i++) {
        if ((st = duet_metrics_counter_new(m, wc[i].name, wc[i].help, NULL, 0, &f)) < 0)
            return st;
        *(duet_metric_t **)((char *)rt + wc[i].off) = duet_metrics_single(f);
    }
    if ((st = duet_metrics_gauge_new(m, "duet_router_workers", "registered workers by role and state",
                                     wk, 2, &rt->f_workers)) < 0 ||
        (st = duet_metrics_counter_new(m, "duet_router_request_results_total",
                                       "completion requests by endpoint and result (ok, invalid, "
                                       "rejected, error, cancelled)",
                                       er, 2, &rt->f_results)) < 0 ||
        (st = duet_metrics_counter_new(m, "duet_router_prefill_retries_total",
                                       "prefills retried on another context worker", NULL, 0,
                                       &rt->f_retries)) < 0)
        return st;
    return DUET_OK;
}

int main(int argc, char **argv)
{
    rt_t         *rt = &g_rt;
    duet_status_t st;
    int           rc = 1;
    char         *text = NULL;
    if ((st = duet_config_create(rt_keys, sizeof(rt_keys) / sizeof(rt_keys[0]), &rt->cfg)) < 0)
        return 1;
    int n_pos = 0;
    st        = duet_config_load_all(rt->cfg, argc, argv, &n_pos);
    if (st == DUET_OK && duet_config_help_requested(rt->cfg)) {
        duet_config_help(rt->cfg, "duet-router [options] [--model MODEL_DIR]", &text);
        printf("duet-router: the OpenAI-compatible front door of a duet cluster. Clients speak\n"
               "HTTP to http.port; ctx/gen workers register on workers.port.\n\n%s", text);
        free(text);
        duet_config_destroy(rt->cfg);
        return 0;
    }
    if (st == DUET_OK && duet_config_version_requested(rt->cfg)) {
        duet_version_print("duet-router");
        duet_config_destroy(rt->cfg);
        return 0;
    }
    if (st == DUET_OK && n_pos == 1 && duet_config_source(rt->cfg, "model.dir") == DUET_CONFIG_SRC_UNSET)
        st = duet_config_set(rt->cfg, "model.dir", argv[1]);
    else if (st == DUET_OK && n_pos > 0)
        st = duet_error_set(DUET_ERR_INVALID, "unexpected argument %s", argv[1]);
    if (st == DUET_OK)
        st = duet_config_check_required(rt->cfg);
    if (st < 0) {
        fprintf(stderr, "duet-router: %s\n(try --help)\n", duet_error_last());
        duet_config_destroy(rt->cfg);
        return 2;
    }
    duet_config_log(rt->cfg);
    duet_config_t *cfg = rt->cfg;
    const char    *dir = duet_config_get_string(cfg, "model.dir");

    /* model: name, tokenizer, template, eos, context */
    const char *name = duet_config_get_string(cfg, "model.name");
    if (name == NULL || name[0] == '\0') {
        char tmp[4096];
        snprintf(tmp, sizeof(tmp), "%s", dir);
        size_t l = strlen(tmp);
        while (l > 1 && tmp[l - 1] == '/')
            tmp[--l] = '\0';
        snprintf(rt->model_name, sizeof(rt->model_name), "%s", basename(tmp));
    } else {
        snprintf(rt->model_name, sizeof(rt->model_name), "%s", name);
    }
    size_t model_max_len = 0;
    char   fingerprint[DUET_REGISTRY_FINGERPRINT_MAX + 1] = "";
    const char *fp_cfg = duet_config_get_string(cfg, "model.fingerprint");
    /* the folder's tokenizer and stop ids: one reader of those files (tokenizer) */
    if ((st = rt_load_model_config(dir, &model_max_len)) < 0 ||
        (st = duet_tokenizer_load(dir, &rt->tok)) < 0 ||
        (st = duet_tokenizer_stop_ids(dir, rt->tok, rt->eos, DUET_OAI_MAX_EOS, &rt->n_eos)) < 0 ||
        (st = duet_oai_template_load(dir, rt->tok, &rt->tmpl)) < 0) {
        fprintf(stderr, "duet-router: %s\n", duet_error_last());
        goto out;
    }
    {
        char   stops[256] = "";
        size_t off        = 0;
        for (size_t i = 0; i < rt->n_eos && off < sizeof(stops); i++)
            off += (size_t)snprintf(stops + off, sizeof(stops) - off, "%s%u", i > 0 ? ", " : "",
                                    rt->eos[i]);
        DUET_LOG_INFO("router: %s: vocabulary of %u ids, stop ids [%s]", dir,
                      duet_tokenizer_vocab_size(rt->tok), stops);
    }
    if (fp_cfg == NULL || fp_cfg[0] == '\0') {
        if ((st = duet_model_fingerprint(dir, fingerprint, sizeof(fingerprint))) < 0) {
            fprintf(stderr, "duet-router: model fingerprint: %s\n", duet_error_last());
            goto out;
        }
    } else if (strcmp(fp_cfg, "first") != 0) {
        snprintf(fingerprint, sizeof(fingerprint), "%s", fp_cfg);
    }
    rt->lim.model_name         = rt->model_name;
    rt->lim.max_tokens_cap     = (uint32_t)duet_config_get_int(cfg, "limits.max_tokens");
    rt->lim.max_tokens_default = (uint32_t)duet_config_get_int(cfg, "limits.max_tokens_default");
    if (rt->lim.max_tokens_default > rt->lim.max_tokens_cap)
        rt->lim.max_tokens_default = rt->lim.max_tokens_cap;
    rt->lim.max_body_bytes    = (size_t)duet_config_get_size(cfg, "limits.max_body_bytes");
    rt->lim.vocab_size        = duet_tokenizer_vocab_size(rt->tok);
    rt->lim.max_prompt_tokens = (size_t)duet_config_get_int(cfg, "limits.max_prompt_tokens");
    rt->lim.max_context       = (size_t)duet_config_get_int(cfg, "limits.max_context");
    rt->lim.jinja_template    = duet_oai_template_is_jinja(rt->tmpl);
    if (rt->lim.max_context == 0)
        rt->lim.max_context = model_max_len;
    rt->local_prefill_tokens = (uint32_t)duet_config_get_int(cfg, "placement.local_prefill_tokens");
    rt->deadline_ms          = (uint64_t)duet_config_get_int(cfg, "request.deadline_ms");
    rt->queue_timeout_ms     = (uint64_t)duet_config_get_int(cfg, "admission.queue_timeout_ms");
    duet_placement_policy_t policy;
    duet_placement_policy_parse(duet_config_get_enum(cfg, "placement.policy"), &policy);
    duet_placement_init(&rt->pl, policy);

    rt->loop = uv_default_loop();
    if ((st = duet_metrics_create(&rt->metrics)) < 0 || (st = rt_metrics_init(rt)) < 0) {
        fprintf(stderr, "duet-router: metrics: %s\n", duet_error_last());
        goto out;
    }
    duet_admission_options_t ao;
    duet_admission_options_default(&ao);
    ao.max_inflight = (uint32_t)duet_config_get_int(cfg, "admission.max_inflight");
    ao.max_queue    = (uint32_t)duet_config_get_int(cfg, "admission.max_queue");
    ao.metrics      = rt->metrics;
    if ((st = duet_admission_create(&ao, &rt->adm)) < 0) {
        fprintf(stderr, "duet-router: admission: %s\n", duet_error_last());
        goto out;
    }

    duet_registry_options_t ro;
    duet_registry_options_default(&ro);
    ro.host                 = duet_config_get_string(cfg, "workers.host");
    ro.port                 = (uint16_t)duet_config_get_int(cfg, "workers.port");
    ro.heartbeat_timeout_ms = (uint32_t)duet_config_get_int(cfg, "workers.heartbeat_timeout_ms");
    ro.fingerprint          = fingerprint;
    ro.on_worker_up         = rt_on_worker_up;
    ro.on_worker_down       = rt_on_worker_down;
    ro.on_worker_state      = rt_on_worker_state;
    ro.on_message           = rt_on_message;
    ro.on_stats             = rt_on_stats;
    ro.user                 = rt;
    if ((st = duet_registry_start(rt->loop, &ro, &rt->reg)) < 0) {
        fprintf(stderr, "duet-router: %s\n", duet_error_last());
        goto out;
    }

    duet_http_options_t ho;
    duet_http_options_default(&ho);
    ho.host            = duet_config_get_string(cfg, "http.host");
    ho.port            = (uint16_t)duet_config_get_int(cfg, "http.port");
    ho.max_body_bytes  = rt->lim.max_body_bytes;
    ho.max_connections = (size_t)duet_config_get_int(cfg, "http.max_connections");
    ho.on_request      = rt_on_request;
    ho.on_abort        = rt_on_abort;
    ho.user            = rt;
    ho.path_class      = rt_path_class;
    ho.metrics         = rt->http_fams;
    if ((st = duet_http_server_start(rt->loop, &ho, &rt->http)) < 0) {
        fprintf(stderr, "duet-router: %s\n", duet_error_last());
        goto out;
    }

    duet_admin_options_t mo;
    duet_admin_options_default(&mo);
    duet_admin_options_from_config(&mo, cfg);
    mo.ops       = &rt_admin_ops;
    mo.ops_ctx   = rt;
    mo.admission = rt->adm;
    if ((mo.token == NULL || mo.token[0] == '\0') && !mo.insecure_no_token) {
        DUET_LOG_WARN("router: admin API disabled (set admin.token, or admin.insecure_no_token "
                      "for tests)");
    } else if ((st = duet_admin_start(rt->loop, &mo, &rt->admin)) < 0) {
        fprintf(stderr, "duet-router: admin API: %s\n", duet_error_last());
        goto out;
    }

    uv_timer_init(rt->loop, &rt->tick);
    rt->tick.data = rt;
    uv_timer_start(&rt->tick, rt_tick, 50, 50);
    uv_signal_init(rt->loop, &rt->sig_int);
    uv_signal_init(rt->loop, &rt->sig_term);
    rt->sig_int.data  = rt;
    rt->sig_term.data = rt;
    uv_signal_start(&rt->sig_int, rt_on_signal, SIGINT);
    uv_signal_start(&rt->sig_term, rt_on_signal, SIGTERM);
    /* one line on stdout that scripts and tests can wait for */
    printf("duet-router: serving %s on http %s:%u, workers %s:%u, admin %s%u\n", rt->model_name,
           ho.host, duet_http_server_port(rt->http), ro.host, duet_registry_port(rt->reg),
           rt->admin != NULL ? "" : "disabled ", rt->admin != NULL ? duet_admin_port(rt->admin) : 0);
    fflush(stdout);
    uv_run(rt->loop, UV_RUN_DEFAULT);
    rc = 0;
out:
    /* on a start-up failure the loop may hold handles; the process exits anyway */
    duet_admission_destroy(rt->adm);
    duet_oai_template_destroy(rt->tmpl);
    duet_tokenizer_destroy(rt->tok);
    if (rc == 0)
        duet_metrics_destroy(rt->metrics);
    duet_config_destroy(rt->cfg);
    return rc;
}
