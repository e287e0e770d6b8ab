/*
 * duet-router: the one door of a duet cluster (docs/architecture.md). It serves the OpenAI API over
 * HTTP (router/http/, router/api/), tokenizes in-process (the tokenizer library, never the
 * engine), keeps the worker registry, places requests, bounds what it accepts and exposes the
 * admin API (router/cluster/).
 *
 * This file is its start-up and shutdown: configuration, the model folder (tokenizer, chat
 * template, stop ids, fingerprint), metrics, the three listeners (HTTP, workers, admin) and the
 * signals that drain it. What a request does is request.c; the endpoints are endpoints.c; the
 * admin API's operations are admin_ops.c (router/router_impl.h lists them).
 */
#include <jansson.h>
#include <libgen.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <uv.h>

#include "common/fingerprint.h"
#include "common/json.h"
#include "common/log.h"
#include "common/version.h"
#include "router/router_impl.h"

static const char *const rt_policies[] = {"round_robin", "least_loaded", NULL};

static const duet_config_key_t rt_keys[] = {
    {"http.host", DUET_CONFIG_STRING, "127.0.0.1", "HTTP (OpenAI API) bind address", .min = NULL},
    {"http.port", DUET_CONFIG_INT, "8000", "HTTP port (0 = ephemeral)", .min = "0", .max = "65535"},
    {"http.max_connections", DUET_CONFIG_INT, "1024", "open client connections at most", .min = "1",
     .max = "1000000"},
    {"workers.host", DUET_CONFIG_STRING, "127.0.0.1", "worker port bind address", .min = NULL},
    {"workers.port", DUET_CONFIG_INT, "8100", "port where workers register (0 = ephemeral)",
     .min = "0", .max = "65535"},
    {"workers.heartbeat_timeout_ms", DUET_CONFIG_INT, "5000",
     "a worker without a heartbeat for this long is dead", .min = "50", .max = "3600000"},
    {"model.dir", DUET_CONFIG_STRING, NULL,
     "model folder: config.json, tokenizer, chat_template.json", .required = true,
     .alias = "model"},
    {"model.name", DUET_CONFIG_STRING, "", "served model name (default: the folder's name)",
     .min = NULL},
    {"model.fingerprint", DUET_CONFIG_STRING, "",
     "what workers must present: \"\" = computed from model.dir, \"first\" = adopt the first "
     "worker's, anything else = this exact string",
     .min = NULL},
    {"placement.policy", DUET_CONFIG_ENUM, "least_loaded", "worker choice", .choices = rt_policies},
    {"placement.local_prefill_tokens", DUET_CONFIG_INT, "0",
     "prompts shorter than this are prefilled on the gen worker (Generate), and so are those a gen "
     "worker's prefix cache holds all but fewer than this many tokens of (placement.prefix_aware); "
     "0 = never",
     .min = "0", .max = "1000000"},
    {"placement.prefix_aware", DUET_CONFIG_BOOL, "true",
     "place a request on the worker whose prefix cache likely holds the most of its prompt, less "
     "its queued tokens (the workers' heartbeats summarise their caches); off = the policy alone",
     .min = NULL},
    {"request.deadline_ms", DUET_CONFIG_INT, "600000",
     "a request still running after this long is cancelled (504)", .min = "1", .max = "86400000"},
    {"shutdown.drain_s", DUET_CONFIG_INT, "0",
     "on SIGINT / SIGTERM, let the requests in flight run up to S s (at least 10), then wait up "
     "to S s for the workers to leave before closing their links (0 = close at once)",
     .min = "0", .max = "86400"},
    {"migrate.timeout_ms", DUET_CONFIG_INT, "10000",
     "moving a running request to another generation worker (duetctl drain --migrate) gives up "
     "after this long, and the request goes on where it was",
     .min = "1", .max = "3600000"},
    {"limits.max_tokens_default", DUET_CONFIG_INT, "256", "max_tokens when a request has none",
     .min = "1", .max = "10000000"},
    {"limits.max_tokens", DUET_CONFIG_INT, "8192", "largest max_tokens accepted", .min = "1",
     .max = "10000000"},
    {"limits.max_prompt_tokens", DUET_CONFIG_INT, "0", "longest prompt (0 = no limit)", .min = "0",
     .max = "100000000"},
    {"limits.max_context", DUET_CONFIG_INT, "0",
     "prompt + max_tokens at most (0 = config.json's model_max_length, else no limit)", .min = "0",
     .max = "100000000"},
    {"limits.max_body_bytes", DUET_CONFIG_SIZE, "4MiB", "largest request body", .min = "1024",
     .max = "1GiB"},
    {"api.strict", DUET_CONFIG_BOOL, "false",
     "refuse (400) request fields the OpenAI API does not define, instead of ignoring them",
     .min = NULL},
    {"api.key", DUET_CONFIG_STRING, "",
     "bearer token every /v1 route, /tokenize and /detokenize require (\"\" = open; /health and "
     "/metrics stay open); keep it off the command line: DUET_API_KEY",
     .secret = true},
    {"log.stats_interval_s", DUET_CONFIG_INT, "10",
     "log throughput and KV cache use every S s when there was traffic (0 = never)", .min = "0",
     .max = "86400"},
    DUET_ADMISSION_CONFIG_KEYS,
    DUET_ADMIN_CONFIG_KEYS,
    DUET_LOG_CONFIG_KEYS,
};

/* ---------------------------------------------------------------- start-up */

/* model_max_length from config.json (0 when absent). */
static duet_status_t rt_load_model_config(const char *dir, size_t *max_len_p)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/config.json", dir);
    json_t *root = NULL;
    duet_status_t st = duet_json_load_file(path, DUET_JSON_DEFAULT_MAX_BYTES, &root);
    if (st < 0)
        return st;
    json_t *ml = json_object_get(root, "model_max_length");
    *max_len_p =
        json_is_integer(ml) && json_integer_value(ml) > 0 ? (size_t)json_integer_value(ml) : 0;
    json_decref(root);
    return DUET_OK;
}

/*
 * Speculative decoding on the generation workers (their heartbeats): how many tokens each verify
 * step emitted (1 .. DUET_PROTO_SPEC_POSITIONS + 1: the kept drafts, then the target's token), and
 * per draft position how many drafts were proposed and kept, so that the acceptance rate of each
 * position is accepted / drafted. Every position's series exists from the start (0 without
 * speculation).
 */
static duet_status_t rt_spec_metrics_init(duet__router_t *rt)
{
    duet_status_t st;
    duet_metric_family_t *f, *fd, *fa;
    double bounds[DUET_PROTO_SPEC_POSITIONS + 1];
    duet_metrics_buckets_linear(1.0, 1.0, DUET_PROTO_SPEC_POSITIONS + 1, bounds);
    const char *const pos[] = {"position"};
    if ((st = duet_metrics_histogram_new(rt->metrics, "duet_gen_spec_step_tokens",
                                         "tokens a generation worker's verify step emitted for a "
                                         "request (drafts kept + 1)",
                                         NULL, 0, bounds, DUET_PROTO_SPEC_POSITIONS + 1, &f)) < 0 ||
        (st = duet_metrics_counter_new(rt->metrics, "duet_gen_spec_drafted_total",
                                       "drafted tokens verified, by draft position (1 = the first "
                                       "draft after the request's next token)",
                                       pos, 1, &fd)) < 0 ||
        (st = duet_metrics_counter_new(rt->metrics, "duet_gen_spec_accepted_total",
                                       "drafted tokens kept by the verify, by draft position", pos,
                                       1, &fa)) < 0)
        return st;
    rt->m_spec_step_tokens = duet_metrics_single(f);
    for (unsigned j = 0; j < DUET_PROTO_SPEC_POSITIONS; j++) {
        char v[16];
        snprintf(v, sizeof(v), "%u", j + 1);
        const char *const vals[] = {v};
        if ((st = duet_metrics_child(fd, vals, 1, &rt->m_spec_drafted[j])) < 0 ||
            (st = duet_metrics_child(fa, vals, 1, &rt->m_spec_accepted[j])) < 0)
            return st;
    }
    return DUET_OK;
}

static duet_status_t rt_metrics_init(duet__router_t *rt)
{
    duet_status_t st;
    duet_metrics_t *m = rt->metrics;
    const char *const req[] = {"method", "path", "status"};
    const char *const res[] = {"result"};
    const char *const wk[] = {"role", "state"};
    const char *const er[] = {"endpoint", "result"};
    const char *const mv[] = {"result"};
    double lat[16];
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
                                         "time per output token after the first", NULL, 0, tpot, 14,
                                         &f)) < 0)
        return st;
    rt->m_tpot = duet_metrics_single(f);
    if ((st = duet_metrics_histogram_new(m, "duet_router_e2e_seconds",
                                         "time from request arrival to its last byte (finished "
                                         "requests)",
                                         NULL, 0, lat, 16, &f)) < 0)
        return st;
    rt->m_e2e = duet_metrics_single(f);
    if ((st = duet_metrics_counter_new(m, "duet_router_tokens_in_total", "prompt tokens accepted",
                                       NULL, 0, &f)) < 0)
        return st;
    rt->m_tok_in = duet_metrics_single(f);
    if ((st = duet_metrics_counter_new(m, "duet_router_tokens_out_total",
                                       "completion tokens sent (finished requests)", NULL, 0, &f)) <
        0)
        return st;
    rt->m_tok_out = duet_metrics_single(f);
    static const struct {
        const char *name, *help;
        size_t off;
    } wc[] = {
        {"duet_gen_decode_steps_total", "generation workers' forward steps that decoded",
         offsetof(duet__router_t, m_gen_steps)},
        {"duet_gen_decode_seq_steps_total", "sum over those steps of the requests decoding in each",
         offsetof(duet__router_t, m_gen_seq_steps)},
        {"duet_gen_decoded_tokens_total", "tokens produced by those steps",
         offsetof(duet__router_t, m_gen_tokens)},
        {"duet_gen_step_seconds_total", "wall time of those steps",
         offsetof(duet__router_t, m_gen_step_s)},
        {"duet_worker_prefill_tokens_total", "prompt tokens prefilled by workers",
         offsetof(duet__router_t, m_prefill_tok)},
        {"duet_gen_suspended_total",
         "requests a generation worker suspended to host memory when its pages ran out",
         offsetof(duet__router_t, m_gen_suspended)},
        {"duet_gen_resumed_total", "suspended requests resumed when pages freed up",
         offsetof(duet__router_t, m_gen_resumed)},
        {"duet_router_prefix_lookups_total",
         "prompts the workers looked up in their prefix caches (cache.prefix)",
         offsetof(duet__router_t, m_prefix_lookups)},
        {"duet_router_prefix_hits_total", "of those, prompts that reused a cached prefix",
         offsetof(duet__router_t, m_prefix_hits)},
        {"duet_router_prefix_tokens_saved_total",
         "prompt tokens the workers did not prefill thanks to a cached prefix",
         offsetof(duet__router_t, m_prefix_saved)},
        {"duet_router_prefix_evictions_total", "prefix cache entries the workers dropped",
         offsetof(duet__router_t, m_prefix_evictions)},
    };
    for (size_t i = 0; i < sizeof(wc) / sizeof(wc[0]); i++) {
        if ((st = duet_metrics_counter_new(m, wc[i].name, wc[i].help, NULL, 0, &f)) < 0)
            return st;
        *(duet_metric_t **)((char *)rt + wc[i].off) = duet_metrics_single(f);
    }
    static const struct {
        const char *name, *help;
        size_t off;
    } cp[] = {
        {"duet_gen_cache_budget_bytes",
         "cache budgets of the live generation workers, summed (their cache plans)",
         offsetof(duet__router_t, m_cache_budget)},
        {"duet_gen_cache_target_pages", "target KV pages those plans give, summed",
         offsetof(duet__router_t, m_cache_target_pages)},
        {"duet_gen_cache_target_bytes", "bytes of those target KV pools, summed",
         offsetof(duet__router_t, m_cache_target_bytes)},
        {"duet_gen_cache_draft_pages", "draft model KV pages those plans give, summed",
         offsetof(duet__router_t, m_cache_draft_pages)},
        {"duet_gen_cache_draft_bytes", "bytes of those draft KV pools, summed",
         offsetof(duet__router_t, m_cache_draft_bytes)},
        {"duet_router_prefix_cache_entries",
         "prefix cache entries the live workers keep, summed (cache occupancy)",
         offsetof(duet__router_t, m_prefix_entries)},
        {"duet_router_prefix_cache_pages", "KV pages those entries hold, summed",
         offsetof(duet__router_t, m_prefix_pages)},
    };
    for (size_t i = 0; i < sizeof(cp) / sizeof(cp[0]); i++) {
        if ((st = duet_metrics_gauge_new(m, cp[i].name, cp[i].help, NULL, 0, &f)) < 0)
            return st;
        *(duet_metric_t **)((char *)rt + cp[i].off) = duet_metrics_single(f);
    }
    if ((st = rt_spec_metrics_init(rt)) < 0 || (st = duet__obs_init(rt)) < 0)
        return st;
    if ((st = duet_metrics_gauge_new(m, "duet_router_workers",
                                     "registered workers by role and state", wk, 2,
                                     &rt->f_workers)) < 0 ||
        (st = duet_metrics_counter_new(m, "duet_router_request_results_total",
                                       "completion requests by endpoint and result (ok, invalid, "
                                       "rejected, error, cancelled)",
                                       er, 2, &rt->f_results)) < 0 ||
        (st = duet_metrics_counter_new(m, "duet_router_prefill_retries_total",
                                       "prefills retried on another context worker", NULL, 0,
                                       &rt->f_retries)) < 0 ||
        (st = duet_metrics_counter_new(m, "duet_router_moves_total",
                                       "running requests moved between generation workers, by "
                                       "result (ok; failed: the source goes on with it; "
                                       "abandoned: no target could take it; lost: a worker died "
                                       "mid-move)",
                                       mv, 1, &rt->f_moves)) < 0)
        return st;
    return DUET_OK;
}

/* Workers' work counters (heartbeats) become router counters, for duet-bench and dashboards. */
static void rt_on_stats(const duet_worker_info_t *w, const duet_worker_stats_t *d, void *user)
{
    duet__router_t *rt = user;
    if (w->role == DUET_WORKER_ROLE_GEN) {
        duet_metrics_counter_add(rt->m_gen_steps, (double)d->decode_steps);
        duet_metrics_counter_add(rt->m_gen_seq_steps, (double)d->decode_seq_steps);
        duet_metrics_counter_add(rt->m_gen_tokens, (double)d->decoded_tokens);
        duet_metrics_counter_add(rt->m_gen_step_s, d->step_seconds);
        duet_metrics_counter_add(rt->m_gen_suspended, (double)d->suspensions);
        duet__obs_suspensions(rt, d->suspensions);
        duet_metrics_counter_add(rt->m_gen_resumed, (double)d->resumes);
        for (unsigned i = 0; i <= DUET_PROTO_SPEC_POSITIONS; i++)
            duet_metrics_histogram_observe_n(rt->m_spec_step_tokens, (double)(i + 1),
                                             d->spec_step_tokens[i]);
        for (unsigned j = 0; j < DUET_PROTO_SPEC_POSITIONS; j++) {
            duet_metrics_counter_add(rt->m_spec_drafted[j], (double)d->spec_drafted[j]);
            duet_metrics_counter_add(rt->m_spec_accepted[j], (double)d->spec_accepted[j]);
        }
    }
    duet_metrics_counter_add(rt->m_prefill_tok, (double)d->prefill_tokens);
    duet_metrics_counter_add(rt->m_prefix_lookups, (double)d->prefix_lookups);
    duet_metrics_counter_add(rt->m_prefix_hits, (double)d->prefix_hits);
    duet_metrics_counter_add(rt->m_prefix_saved, (double)d->prefix_tokens_saved);
    duet_metrics_counter_add(rt->m_prefix_evictions, (double)d->prefix_evictions);
}

/* ---------------------------------------------------------------- shutdown */

/* The workers' links, the admin API and the loop's handles: the loop then ends. */
static void rt_close_rest(duet__router_t *rt)
{
    duet_registry_close(rt->reg, NULL, NULL);
    if (rt->admin != NULL)
        duet_admin_close(rt->admin, NULL, NULL);
    uv_timer_stop(&rt->tick);
    uv_close((uv_handle_t *)&rt->tick, NULL);
    duet__obs_stop(rt);
    uv_close((uv_handle_t *)&rt->sig_int, NULL);
    uv_close((uv_handle_t *)&rt->sig_term, NULL);
}

static size_t rt_live_workers(const duet__router_t *rt)
{
    return duet_registry_count(rt->reg, 0, DUET_WORKER_STATE_UP) +
           duet_registry_count(rt->reg, 0, DUET_WORKER_STATE_DRAINING);
}

/* shutdown.drain_s: the router goes last, once its workers have left or the time is up. */
static void rt_wait_workers(uv_timer_t *t)
{
    duet__router_t *rt = t->data;
    const size_t n = rt_live_workers(rt);
    if (n > 0 && uv_now(rt->loop) < rt->leave_deadline_ms)
        return;
    if (n > 0)
        DUET_LOG_WARN("router: shutdown.drain_s passed with %zu worker%s still registered: closing "
                      "their links",
                      n, n == 1 ? "" : "s");
    else
        DUET_LOG_INFO("router: every worker has left");
    rt_close_rest(rt);
}

static void rt_http_closed(void *user)
{
    duet__router_t *rt = user;
    rt->http = NULL;
    const int64_t drain_s = duet_config_get_int(rt->cfg, "shutdown.drain_s");
    const size_t n = rt_live_workers(rt);
    if (drain_s == 0 || n == 0) {
        rt_close_rest(rt);
        return;
    }
    DUET_LOG_INFO("router: requests finished; waiting up to %lld s for %zu worker%s to leave",
                  (long long)drain_s, n, n == 1 ? "" : "s");
    rt->leave_deadline_ms = uv_now(rt->loop) + (uint64_t)drain_s * 1000;
    uv_timer_start(&rt->tick, rt_wait_workers, 100, 100); /* the request tick has nothing left */
}

/* SIGINT / SIGTERM: drain (health and new completions 503), let requests in flight finish. */
static void rt_on_signal(uv_signal_t *s, int signum)
{
    duet__router_t *rt = s->data;
    if (rt->draining)
        return;
    DUET_LOG_INFO("router: signal %d: draining (health 503), finishing requests in flight", signum);
    rt->draining = true;
    duet_http_server_close(rt->http, rt_http_closed, rt);
}

/* ---------------------------------------------------------------- main */

static duet__router_t g_rt; /* one router per process; a static keeps the signal handlers trivial */

/*
 * Flags, --config YAML and DUET_* variables into rt->cfg. Returns -1 to go on, else the exit
 * status (0 after --help / --version, 2 for a bad command line).
 */
static int rt_configure(duet__router_t *rt, int argc, char **argv)
{
    char *text = NULL;
    if (duet_config_create(rt_keys, sizeof(rt_keys) / sizeof(rt_keys[0]), &rt->cfg) < 0)
        return 1;
    int n_pos = 0;
    duet_status_t st = duet_config_load_all(rt->cfg, argc, argv, &n_pos);
    if (st == DUET_OK && duet_config_help_requested(rt->cfg)) {
        duet_config_help(rt->cfg, "duet-router [options] [--model MODEL_DIR]", &text);
        printf("duet-router: the OpenAI-compatible front door of a duet cluster. Clients speak\n"
               "HTTP to http.port; ctx/gen workers register on workers.port.\n\n%s",
               text);
        free(text);
        return 0;
    }
    if (st == DUET_OK && duet_config_version_requested(rt->cfg)) {
        duet_version_print("duet-router");
        return 0;
    }
    if (st == DUET_OK && n_pos == 1 &&
        duet_config_source(rt->cfg, "model.dir") == DUET_CONFIG_SRC_UNSET)
        st = duet_config_set(rt->cfg, "model.dir", argv[1]);
    else if (st == DUET_OK && n_pos > 0)
        st = duet_error_set(DUET_ERR_INVALID, "unexpected argument %s", argv[1]);
    if (st == DUET_OK)
        st = duet_config_check_required(rt->cfg);
    if (st < 0) {
        fprintf(stderr, "duet-router: %s\n(try --help)\n", duet_error_last());
        return 2;
    }
    duet_log_configure(rt->cfg); /* before the configuration's own lines */
    duet_config_log(rt->cfg);
    return -1;
}

/*
 * The model folder: served name, tokenizer, stop ids, chat template, context length, and the
 * fingerprint workers must present (fingerprint: cap bytes; "" = adopt the first worker's).
 * Then the request limits and placement settings from the configuration.
 */
static duet_status_t rt_load_model(duet__router_t *rt, char *fingerprint, size_t cap)
{
    duet_config_t *cfg = rt->cfg;
    const char *dir = duet_config_get_string(cfg, "model.dir");
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
    duet_status_t st;
    /* the folder's tokenizer and stop ids: one reader of those files (tokenizer) */
    if ((st = rt_load_model_config(dir, &model_max_len)) < 0 ||
        (st = duet_tokenizer_load(dir, &rt->tok)) < 0 ||
        (st = duet_tokenizer_stop_ids(dir, rt->tok, rt->eos, DUET_OAI_MAX_EOS, &rt->n_eos)) < 0 ||
        (st = duet_oai_template_load(dir, rt->tok, &rt->tmpl)) < 0) {
        fprintf(stderr, "duet-router: %s\n", duet_error_last());
        return st;
    }
    char stops[256] = "";
    size_t off = 0;
    for (size_t i = 0; i < rt->n_eos && off < sizeof(stops); i++)
        off += (size_t)snprintf(stops + off, sizeof(stops) - off, "%s%u", i > 0 ? ", " : "",
                                rt->eos[i]);
    DUET_LOG_INFO("router: %s: vocabulary of %u ids, stop ids [%s]", dir,
                  duet_tokenizer_vocab_size(rt->tok), stops);
    const char *fp_cfg = duet_config_get_string(cfg, "model.fingerprint");
    fingerprint[0] = '\0';
    if (fp_cfg == NULL || fp_cfg[0] == '\0') {
        if ((st = duet_model_fingerprint(dir, fingerprint, cap)) < 0) {
            fprintf(stderr, "duet-router: model fingerprint: %s\n", duet_error_last());
            return st;
        }
    } else if (strcmp(fp_cfg, "first") != 0) {
        snprintf(fingerprint, cap, "%s", fp_cfg);
    }
    rt->lim.model_name = rt->model_name;
    rt->lim.max_tokens_cap = (uint32_t)duet_config_get_int(cfg, "limits.max_tokens");
    rt->lim.max_tokens_default = (uint32_t)duet_config_get_int(cfg, "limits.max_tokens_default");
    if (rt->lim.max_tokens_default > rt->lim.max_tokens_cap)
        rt->lim.max_tokens_default = rt->lim.max_tokens_cap;
    rt->lim.max_body_bytes = (size_t)duet_config_get_size(cfg, "limits.max_body_bytes");
    rt->lim.vocab_size = duet_tokenizer_vocab_size(rt->tok);
    rt->lim.max_prompt_tokens = (size_t)duet_config_get_int(cfg, "limits.max_prompt_tokens");
    rt->lim.max_context = (size_t)duet_config_get_int(cfg, "limits.max_context");
    rt->lim.jinja_template = duet_oai_template_is_jinja(rt->tmpl);
    rt->lim.strict = duet_config_get_bool(cfg, "api.strict");
    /* tools are offered when the tokenizer has Kimi K2's tool-call tokens (router/api/tools.h) */
    static const char *const markers[] = {DUET_OAI_TOOL_SECTION_BEGIN, DUET_OAI_TOOL_SECTION_END,
                                          DUET_OAI_TOOL_CALL_BEGIN, DUET_OAI_TOOL_ARG_BEGIN,
                                          DUET_OAI_TOOL_CALL_END};
    rt->lim.tool_calls = true;
    for (size_t i = 0; i < sizeof(markers) / sizeof(markers[0]); i++) {
        uint32_t id;
        rt->lim.tool_calls =
            rt->lim.tool_calls && duet_tokenizer_special_id(rt->tok, markers[i], &id) == DUET_OK;
    }
    const char *key = duet_config_get_string(cfg, "api.key");
    rt->api_key = key != NULL && key[0] != '\0' ? key : NULL;
    if (rt->lim.max_context == 0)
        rt->lim.max_context = model_max_len;
    rt->local_prefill_tokens = (uint32_t)duet_config_get_int(cfg, "placement.local_prefill_tokens");
    rt->deadline_ms = (uint64_t)duet_config_get_int(cfg, "request.deadline_ms");
    rt->migrate_timeout_ms = (uint64_t)duet_config_get_int(cfg, "migrate.timeout_ms");
    rt->queue_timeout_ms = (uint64_t)duet_config_get_int(cfg, "admission.queue_timeout_ms");
    duet_placement_policy_t policy;
    duet_placement_policy_parse(duet_config_get_enum(cfg, "placement.policy"), &policy);
    duet_placement_init(&rt->pl, policy);
    rt->pl.prefix_aware = duet_config_get_bool(cfg, "placement.prefix_aware");
    return DUET_OK;
}

/*
 * Metrics, admission, then the listeners: workers, HTTP, admin API (when a token is set); the
 * request tick and the signals. Prints the one "serving" line scripts wait for. On failure the
 * message is printed and the loop may hold handles (the process exits anyway).
 */
static duet_status_t rt_start(duet__router_t *rt, const char *fingerprint)
{
    duet_config_t *cfg = rt->cfg;
    duet_status_t st;
    rt->loop = uv_default_loop();
    rt->started_unix = (int64_t)time(NULL);
    if ((st = duet_metrics_create(&rt->metrics)) < 0 || (st = rt_metrics_init(rt)) < 0) {
        fprintf(stderr, "duet-router: metrics: %s\n", duet_error_last());
        return st;
    }
    duet_admission_options_t ao;
    duet_admission_options_default(&ao);
    ao.max_inflight = (uint32_t)duet_config_get_int(cfg, "admission.max_inflight");
    ao.max_queue = (uint32_t)duet_config_get_int(cfg, "admission.max_queue");
    ao.metrics = rt->metrics;
    if ((st = duet_admission_create(&ao, &rt->adm)) < 0) {
        fprintf(stderr, "duet-router: admission: %s\n", duet_error_last());
        return st;
    }

    duet_registry_options_t ro;
    duet_registry_options_default(&ro);
    ro.host = duet_config_get_string(cfg, "workers.host");
    ro.port = (uint16_t)duet_config_get_int(cfg, "workers.port");
    ro.heartbeat_timeout_ms = (uint32_t)duet_config_get_int(cfg, "workers.heartbeat_timeout_ms");
    ro.fingerprint = fingerprint;
    ro.on_worker_up = duet__rq_on_worker_up;
    ro.on_worker_down = duet__rq_on_worker_down;
    ro.on_worker_state = duet__rq_on_worker_state;
    ro.on_message = duet__rq_on_message;
    ro.on_stats = rt_on_stats;
    ro.user = rt;
    if ((st = duet_registry_start(rt->loop, &ro, &rt->reg)) < 0) {
        fprintf(stderr, "duet-router: %s\n", duet_error_last());
        return st;
    }

    duet_http_options_t ho;
    duet_http_options_default(&ho);
    ho.host = duet_config_get_string(cfg, "http.host");
    ho.port = (uint16_t)duet_config_get_int(cfg, "http.port");
    ho.max_body_bytes = rt->lim.max_body_bytes;
    ho.max_connections = (size_t)duet_config_get_int(cfg, "http.max_connections");
    /* a drain lets the streams in flight run as long as shutdown.drain_s, not the default 10 s */
    const int64_t drain_s = duet_config_get_int(cfg, "shutdown.drain_s");
    if (drain_s * 1000 > (int64_t)ho.shutdown_grace_ms)
        ho.shutdown_grace_ms = (uint32_t)(drain_s * 1000);
    ho.on_request = duet__rt_on_request;
    ho.on_abort = duet__rq_on_abort;
    ho.user = rt;
    ho.path_class = duet__rt_path_class;
    ho.metrics = rt->http_fams;
    if ((st = duet_http_server_start(rt->loop, &ho, &rt->http)) < 0) {
        fprintf(stderr, "duet-router: %s\n", duet_error_last());
        return st;
    }

    duet_admin_options_t mo;
    duet_admin_options_default(&mo);
    duet_admin_options_from_config(&mo, cfg);
    mo.ops = &duet__rt_admin_ops;
    mo.ops_ctx = rt;
    mo.admission = rt->adm;
    if ((mo.token == NULL || mo.token[0] == '\0') && !mo.insecure_no_token) {
        DUET_LOG_WARN("router: admin API disabled (set admin.token, or admin.insecure_no_token "
                      "for tests)");
    } else if ((st = duet_admin_start(rt->loop, &mo, &rt->admin)) < 0) {
        fprintf(stderr, "duet-router: admin API: %s\n", duet_error_last());
        return st;
    }

    uv_timer_init(rt->loop, &rt->tick);
    rt->tick.data = rt;
    uv_timer_start(&rt->tick, duet__rq_tick, 50, 50);
    duet__obs_start(rt, (uint64_t)duet_config_get_int(cfg, "log.stats_interval_s") * 1000);
    uv_signal_init(rt->loop, &rt->sig_int);
    uv_signal_init(rt->loop, &rt->sig_term);
    rt->sig_int.data = rt;
    rt->sig_term.data = rt;
    uv_signal_start(&rt->sig_int, rt_on_signal, SIGINT);
    uv_signal_start(&rt->sig_term, rt_on_signal, SIGTERM);
    /* one line on stdout that scripts and tests can wait for */
    printf("duet-router: serving %s on http %s:%u, workers %s:%u, admin %s%u\n", rt->model_name,
           ho.host, duet_http_server_port(rt->http), ro.host, duet_registry_port(rt->reg),
           rt->admin != NULL ? "" : "disabled ",
           rt->admin != NULL ? duet_admin_port(rt->admin) : 0);
    fflush(stdout);
    return DUET_OK;
}

int main(int argc, char **argv)
{
    duet__router_t *rt = &g_rt;
    int rc = rt_configure(rt, argc, argv);
    if (rc >= 0) {
        duet_config_destroy(rt->cfg);
        return rc;
    }
    rc = 1;
    char fingerprint[DUET_REGISTRY_FINGERPRINT_MAX + 1];
    if (rt_load_model(rt, fingerprint, sizeof(fingerprint)) < 0 || rt_start(rt, fingerprint) < 0)
        goto out;
    uv_run(rt->loop, UV_RUN_DEFAULT);
    rc = 0;
out:
    /* on a start-up failure the loop may hold handles; the process exits anyway */
    duet_admission_destroy(rt->adm);
    duet_oai_template_destroy(rt->tmpl);
    duet_tokenizer_destroy(rt->tok);
    if (rc == 0)
        duet_metrics_destroy(rt->metrics);
    json_decref(rt->ignored_seen);
    duet_config_destroy(rt->cfg);
    return rc;
}
