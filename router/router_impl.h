/*
 * What duet-router's own files share: the router's state (one per process) and the few functions
 * one part calls in another. Not a public header; only the files below include it.
 *
 *   router_main.c  start-up (config, model folder, metrics, listeners) and shutdown (signals)
 *   request.c      the request state machine: admission, Reserve/Prefill/PrefillDone/Generate,
 *                  tokens to the client, the one end of a request, worker events, deadlines
 *   endpoints.c    the HTTP endpoints, routed by method + path through one table
 *   admin_ops.c    the admin API's operations (list, drain, undrain) over the registry
 *   obs.c          the metrics under vLLM's names, the access line, the periodic stats line
 */
#ifndef DUET_ROUTER_ROUTER_IMPL_H
#define DUET_ROUTER_ROUTER_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "common/config.h"
#include "common/metrics.h"
#include "router/api/openai.h"
#include "router/cluster/admin.h"
#include "router/cluster/admission.h"
#include "router/cluster/placement.h"
#include "router/cluster/registry.h"
#include "router/http/http.h"
#include "tokenizer/tokenizer.h"

#define DUET__RQ_BUCKETS     1024 /* the live-request table's hash buckets (request.c) */
#define DUET__RT_MAX_MIGRATE 64   /* gen workers draining with migrate at once */

typedef struct duet__router duet__router_t;

/* vllm:request_success_total's finished_reason values (obs.c names them) */
enum { DUET__OBS_STOP = 0, DUET__OBS_LENGTH, DUET__OBS_ABORT, DUET__OBS_ERROR, DUET__OBS_N_FINISH };

/* obs.c's state: the vLLM-named series (model_name label) and the stats line's window. */
typedef struct {
    duet_metric_t *running, *waiting, *kv_usage;
    duet_metric_t *ttft, *itl, *tpot, *e2e, *queue, *prefill, *decode;
    duet_metric_t *prompt_tokens, *generation_tokens, *preemptions;
    duet_metric_t *success[DUET__OBS_N_FINISH];
    duet_metric_t *prefix_placements[3]; /* by role (ctx 1, gen 2): duet_router_prefix_... */
    uv_timer_t stats_timer;
    uint64_t win_start_ms, win_requests, win_prompt_tokens, win_gen_tokens;
} duet__obs_t;

/* What a request was, for duet__obs_request_end (times are uv_hrtime; 0 = never happened). */
typedef struct {
    uint64_t id;
    const char *endpoint; /* the path */
    int status;           /* the HTTP status answered (200 also for a stream that ended well) */
    int finish;           /* DUET__OBS_*, or -1: never admitted (invalid, refused) */
    size_t prompt_tokens, completion_tokens;
    uint64_t t_start_ns, t_admit_ns, t_first_ns, t_last_ns, t_end_ns;
} duet__obs_request_t;

struct duet__router {
    uv_loop_t *loop;
    duet_config_t *cfg;        /* owned */
    duet_tokenizer_t *tok;     /* owned */
    duet_oai_template_t *tmpl; /* owned */
    duet_oai_limits_t lim;
    struct json_t *ignored_seen;    /* unknown request fields already logged (api.strict off) */
    uint32_t eos[DUET_OAI_MAX_EOS]; /* (n_eos) the model's stop ids */
    size_t n_eos;
    char model_name[256];
    int64_t started_unix;     /* when the router started (/v1/models' "created") */
    const char *api_key;      /* api.key (owned by cfg); NULL: the API is open */
    duet_http_server_t *http; /* NULL once closed */
    duet_registry_t *reg;
    duet_admission_t *adm; /* owned */
    duet_admin_t *admin;   /* NULL when the admin API is disabled */
    duet_placement_t pl;
    uv_timer_t tick;
    uv_signal_t sig_int, sig_term;
    bool draining;              /* SIGINT / SIGTERM came: new completions and /health answer 503 */
    uint64_t leave_deadline_ms; /* shutdown.drain_s: uv_now when the router stops waiting */
    uint64_t next_rid;
    uint32_t local_prefill_tokens;
    uint64_t deadline_ms;
    uint64_t queue_timeout_ms;
    uint64_t migrate_timeout_ms; /* migrate.timeout_ms */
    /* gen workers drained with migrate (duetctl drain --migrate): their running requests move */
    uint64_t migrate_from[DUET__RT_MAX_MIGRATE];
    size_t n_migrate_from;
    struct rq *buckets[DUET__RQ_BUCKETS]; /* live requests by id (request.c's rq_t) */
    size_t n_rq;
    struct rt_drain_waiter *waiters; /* owned: `drain --wait` callers (admin_ops.c) */
    /* metrics (router_main.c makes them) */
    duet_metrics_t *metrics;
    duet_http_metrics_t http_fams;
    duet_metric_t *m_ttft, *m_tpot, *m_e2e, *m_tok_in, *m_tok_out;
    duet_metric_t *m_gen_steps, *m_gen_seq_steps, *m_gen_tokens, *m_gen_step_s, *m_prefill_tok;
    duet_metric_t *m_gen_suspended, *m_gen_resumed;
    /* the live gen workers' cache plans, summed when /metrics is scraped (endpoints.c) */
    duet_metric_t *m_cache_budget, *m_cache_target_pages, *m_cache_target_bytes;
    duet_metric_t *m_cache_draft_pages, *m_cache_draft_bytes;
    /* the workers' prefix caches (heartbeats): counters, and gauges summed at each scrape */
    duet_metric_t *m_prefix_lookups, *m_prefix_hits, *m_prefix_saved, *m_prefix_evictions;
    duet_metric_t *m_prefix_entries, *m_prefix_pages;
    /* speculative decoding: tokens per verify step; drafts proposed / kept by draft position */
    duet_metric_t *m_spec_step_tokens;
    duet_metric_t *m_spec_drafted[DUET_PROTO_SPEC_POSITIONS];
    duet_metric_t *m_spec_accepted[DUET_PROTO_SPEC_POSITIONS];
    duet_metric_family_t *f_workers, *f_results, *f_retries, *f_moves;
    duet__obs_t obs;
};

/* ---------------------------------------------------------------- request.c */

/*
 * A completion request arrived on `ep`: validate, tokenize, admit (or queue, or refuse). Takes
 * the request's reference: every way out, early failures included, ends in the request's one
 * end. `label` names the endpoint in metrics (a literal).
 */
void duet__rq_begin(duet__router_t *rt, duet_http_request_t *http, duet_oai_endpoint_t ep,
                    const char *label);
/* duet_http_options_t.on_abort: the client went away; its request ends (workers get Cancel). */
void duet__rq_on_abort(duet_http_request_t *http, void *user);
/* The router's periodic tick: admission queue timeouts (503), request deadlines (504), and moves
 * off generation workers drained with migrate. */
void duet__rq_tick(uv_timer_t *t);
/* Live generation workers may have come or gone: tell admission, start queued requests. */
void duet__rq_capacity_changed(duet__router_t *rt);
/* The registry's callbacks (user = the router): a worker up, its state changed, it died, it sent
 * a message. */
void duet__rq_on_worker_up(const duet_worker_info_t *w, void *user);
void duet__rq_on_worker_state(const duet_worker_info_t *w, void *user);
void duet__rq_on_worker_down(const duet_worker_info_t *w, const char *reason, void *user);
void duet__rq_on_message(uint64_t worker_id, const Duet__Envelope *env, void *user);

/* Whether gen worker `id` is drained with migrate; set / clear it (false: the table is full). */
bool duet__rt_migrating(const duet__router_t *rt, uint64_t id);
bool duet__rt_set_migrating(duet__router_t *rt, uint64_t id, bool on);

/* ---------------------------------------------------------------- endpoints.c */

/* duet_http_options_t.on_request and .path_class (user = the router). */
void duet__rt_on_request(duet_http_request_t *http, void *user);
const char *duet__rt_path_class(const char *path, void *user);

/* ---------------------------------------------------------------- obs.c */

/* Register the vLLM-named series in rt->metrics (after rt->model_name is known). */
duet_status_t duet__obs_init(duet__router_t *rt);
/* Start / stop the periodic stats line (every interval_ms when there was traffic; 0 = never). */
void duet__obs_start(duet__router_t *rt, uint64_t interval_ms);
void duet__obs_stop(duet__router_t *rt);
/* A request was admitted with this many prompt tokens. */
void duet__obs_admitted(duet__router_t *rt, size_t prompt_tokens);
/* A token reached the router at now_ns; prev_ns is the request's previous token's (0: first). */
void duet__obs_token(duet__router_t *rt, uint64_t prev_ns, uint64_t now_ns);
/* A request ended (called once, from its one end): histograms, counters, the access line. */
void duet__obs_request_end(duet__router_t *rt, const duet__obs_request_t *q);
/* Before /metrics renders: the gauges read from admission and the registry. */
void duet__obs_scrape(duet__router_t *rt);
/* Generation workers suspended n more requests (vllm:num_preemptions_total). */
void duet__obs_suspensions(duet__router_t *rt, uint64_t n);
/* A request was placed on a worker of `role` that holds part of its prompt (placement.h). */
void duet__obs_prefix_placement(duet__router_t *rt, duet_worker_role_t role);

/* ---------------------------------------------------------------- admin_ops.c */

/* The admin API's ops table (ctx = the router). */
extern const duet_admin_ops_t duet__rt_admin_ops;
/*
 * Answer the `drain --wait` callers of worker_id: with st and detail when st is an error (the
 * worker died or was undrained), else (DUET_OK) only once the router has no request in flight
 * there.
 */
void duet__rt_drain_waiters_check(duet__router_t *rt, uint64_t worker_id, duet_status_t st,
                                  const char *detail);

#endif
