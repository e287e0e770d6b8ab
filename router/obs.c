/*
 * duet-router's observability of requests: the metrics under vLLM's names (so that dashboards
 * and autoscalers written for vLLM read a duet cluster unchanged), the access line each request
 * logs when it ends, and the periodic throughput line. docs/observability.md lists every series.
 *
 * Where each figure comes from. The request state machine (request.c) stamps a request's times
 * (arrival, admission, first and last token) and calls duet__obs_request_end once from its one
 * end; the token gaps come from duet__obs_token as tokens reach the router; the gauges (running,
 * waiting, KV cache usage) are read from admission and the registry when /metrics is scraped;
 * preemptions are the generation workers' suspensions (their heartbeats, router_main.c); the
 * placements by cached prefix are counted by request.c's worker pick.
 *
 * Bucket lists are vLLM v1's (vllm/v1/metrics/loggers.py), so that histogram_quantile over a
 * mixed fleet compares like with like.
 */
#include <stdio.h>
#include <string.h>

#include "common/log.h"
#include "router/router_impl.h"

static const double obs_ttft_buckets[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,
                                          0.25,  0.5,   0.75, 1.0,  2.5,  5.0,  7.5,  10.0,
                                          20.0,  40.0,  80.0, 160., 640., 2560.};
static const double obs_token_buckets[] = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
                                           0.3,  0.4,   0.5,  0.75,  1.0, 2.5,  5.0,
                                           7.5,  10.0,  20.0, 40.0,  80.0};
static const double obs_request_buckets[] = {0.3,  0.5,  0.8,   1.0,   1.5,   2.0,   2.5,
                                             5.0,  10.0, 15.0,  20.0,  30.0,  40.0,  50.0,
                                             60.0, 120., 240.0, 480.0, 960.0, 1920., 7680.};
#define OBS_N(a) (sizeof(a) / sizeof((a)[0]))

/* vLLM's finished_reason values: every series exists from the start (0 until one ends so). */
static const char *const obs_finish[DUET__OBS_N_FINISH] = {"stop", "length", "abort", "error"};

/* One model_name-labelled child of a new family of the given type. */
static duet_status_t obs_family(duet__router_t *rt, duet_metric_type_t type, const char *name,
                                const char *help, const double *buckets, size_t n_buckets,
                                duet_metric_t **m_p)
{
    const char *const lbl[] = {"model_name"};
    const char *const val[] = {rt->model_name};
    duet_metric_family_t *f;
    duet_status_t st =
        type == DUET_METRIC_COUNTER ? duet_metrics_counter_new(rt->metrics, name, help, lbl, 1, &f)
        : type == DUET_METRIC_GAUGE
            ? duet_metrics_gauge_new(rt->metrics, name, help, lbl, 1, &f)
            : duet_metrics_histogram_new(rt->metrics, name, help, lbl, 1, buckets, n_buckets, &f);
    if (st < 0)
        return st;
    return duet_metrics_child(f, val, 1, m_p);
}

duet_status_t duet__obs_init(duet__router_t *rt)
{
    duet__obs_t *o = &rt->obs;
    duet_status_t st;
    static const struct {
        duet_metric_type_t type;
        const char *name, *help;
        const double *buckets;
        size_t n_buckets;
        size_t off;
    } fams[] = {
        {DUET_METRIC_GAUGE, "vllm:num_requests_running",
         "requests admitted and not yet ended (the router's in-flight count)", NULL, 0,
         offsetof(duet__obs_t, running)},
        {DUET_METRIC_GAUGE, "vllm:num_requests_waiting", "requests in the admission queue", NULL, 0,
         offsetof(duet__obs_t, waiting)},
        {DUET_METRIC_GAUGE, "vllm:kv_cache_usage_perc",
         "KV cache usage of the live generation workers, 0..1 (pages in use / pages, summed)", NULL,
         0, offsetof(duet__obs_t, kv_usage)},
        {DUET_METRIC_HISTOGRAM, "vllm:time_to_first_token_seconds",
         "time from a request's arrival to its first token", obs_ttft_buckets,
         OBS_N(obs_ttft_buckets), offsetof(duet__obs_t, ttft)},
        {DUET_METRIC_HISTOGRAM, "vllm:inter_token_latency_seconds",
         "time between two successive tokens of a request reaching the router", obs_token_buckets,
         OBS_N(obs_token_buckets), offsetof(duet__obs_t, itl)},
        {DUET_METRIC_HISTOGRAM, "vllm:time_per_output_token_seconds",
         "a finished request's decode time over its tokens after the first", obs_token_buckets,
         OBS_N(obs_token_buckets), offsetof(duet__obs_t, tpot)},
        {DUET_METRIC_HISTOGRAM, "vllm:e2e_request_latency_seconds",
         "time from a finished request's arrival to its end", obs_request_buckets,
         OBS_N(obs_request_buckets), offsetof(duet__obs_t, e2e)},
        {DUET_METRIC_HISTOGRAM, "vllm:request_queue_time_seconds",
         "time a finished request waited for admission", obs_request_buckets,
         OBS_N(obs_request_buckets), offsetof(duet__obs_t, queue)},
        {DUET_METRIC_HISTOGRAM, "vllm:request_prefill_time_seconds",
         "time from a finished request's admission to its first token", obs_request_buckets,
         OBS_N(obs_request_buckets), offsetof(duet__obs_t, prefill)},
        {DUET_METRIC_HISTOGRAM, "vllm:request_decode_time_seconds",
         "time from a finished request's first token to its last", obs_request_buckets,
         OBS_N(obs_request_buckets), offsetof(duet__obs_t, decode)},
        {DUET_METRIC_COUNTER, "vllm:prompt_tokens_total", "prompt tokens of admitted requests",
         NULL, 0, offsetof(duet__obs_t, prompt_tokens)},
        {DUET_METRIC_COUNTER, "vllm:generation_tokens_total",
         "tokens generated (every token that reached the router)", NULL, 0,
         offsetof(duet__obs_t, generation_tokens)},
        {DUET_METRIC_COUNTER, "vllm:num_preemptions_total",
         "requests generation workers suspended to host memory when their pages ran out", NULL, 0,
         offsetof(duet__obs_t, preemptions)},
    };
    for (size_t i = 0; i < OBS_N(fams); i++)
        if ((st = obs_family(rt, fams[i].type, fams[i].name, fams[i].help, fams[i].buckets,
                             fams[i].n_buckets, (duet_metric_t **)((char *)o + fams[i].off))) < 0)
            return st;
    const char *const lbl[] = {"model_name", "finished_reason"};
    duet_metric_family_t *f;
    if ((st = duet_metrics_counter_new(rt->metrics, "vllm:request_success_total",
                                       "requests ended, by finished_reason (stop, length: "
                                       "answered; abort: the client left; error: failed)",
                                       lbl, 2, &f)) < 0)
        return st;
    for (int i = 0; i < DUET__OBS_N_FINISH; i++) {
        const char *const v[] = {rt->model_name, obs_finish[i]};
        if ((st = duet_metrics_child(f, v, 2, &o->success[i])) < 0)
            return st;
    }
    const char *const role[] = {"role"};
    if ((st = duet_metrics_counter_new(rt->metrics, "duet_router_prefix_placements_total",
                                       "requests placed on a worker that holds part of their "
                                       "prompt (placement.prefix_aware), by role",
                                       role, 1, &f)) < 0)
        return st;
    const duet_worker_role_t roles[] = {DUET_WORKER_ROLE_CTX, DUET_WORKER_ROLE_GEN};
    for (size_t i = 0; i < OBS_N(roles); i++) {
        const char *const v[] = {duet_worker_role_name(roles[i])};
        if ((st = duet_metrics_child(f, v, 1, &o->prefix_placements[roles[i]])) < 0)
            return st;
    }
    return DUET_OK;
}

static double obs_span_s(uint64_t from_ns, uint64_t to_ns)
{
    return from_ns != 0 && to_ns > from_ns ? (double)(to_ns - from_ns) / 1e9 : 0.0;
}

void duet__obs_token(duet__router_t *rt, uint64_t prev_ns, uint64_t now_ns)
{
    duet__obs_t *o = &rt->obs;
    duet_metrics_counter_inc(o->generation_tokens);
    o->win_gen_tokens++;
    if (prev_ns == 0)
        return;
    duet_metrics_histogram_observe(o->itl, obs_span_s(prev_ns, now_ns));
}

void duet__obs_admitted(duet__router_t *rt, size_t prompt_tokens)
{
    duet_metrics_counter_add(rt->obs.prompt_tokens, (double)prompt_tokens);
    rt->obs.win_prompt_tokens += prompt_tokens;
}

void duet__obs_request_end(duet__router_t *rt, const duet__obs_request_t *q)
{
    duet__obs_t *o = &rt->obs;
    const double ttft_ms = obs_span_s(q->t_start_ns, q->t_first_ns) * 1e3;
    const double dur_ms = obs_span_s(q->t_start_ns, q->t_end_ns) * 1e3;
    /* the access line: one per completion request, whatever its end */
    DUET_RLOG_INFO(q->id,
                   "access %s status=%d finish=%s prompt_tokens=%zu completion_tokens=%zu "
                   "ttft_ms=%.1f duration_ms=%.1f",
                   q->endpoint, q->status, q->finish >= 0 ? obs_finish[q->finish] : "-",
                   q->prompt_tokens, q->completion_tokens, ttft_ms, dur_ms);
    o->win_requests++;
    /* the histograms describe requests that ran: admitted, then ended */
    if (q->finish < 0 || q->t_admit_ns == 0)
        return;
    duet_metrics_counter_inc(o->success[q->finish]);
    duet_metrics_histogram_observe(o->e2e, obs_span_s(q->t_start_ns, q->t_end_ns));
    duet_metrics_histogram_observe(o->queue, obs_span_s(q->t_start_ns, q->t_admit_ns));
    if (q->t_first_ns == 0)
        return;
    duet_metrics_histogram_observe(o->ttft, obs_span_s(q->t_start_ns, q->t_first_ns));
    duet_metrics_histogram_observe(o->prefill, obs_span_s(q->t_admit_ns, q->t_first_ns));
    duet_metrics_histogram_observe(o->decode, obs_span_s(q->t_first_ns, q->t_last_ns));
    if (q->completion_tokens > 1)
        duet_metrics_histogram_observe(o->tpot, obs_span_s(q->t_first_ns, q->t_last_ns) /
                                                    (double)(q->completion_tokens - 1));
}

/* Adds a live generation worker's pages in use and pages into sums[0..1]. Pages only its prefix
 * cache holds count as free: they are given back as soon as a request needs them. */
static void obs_pages_add(const duet_worker_info_t *w, void *user)
{
    double *sum = user;
    if (w->role != DUET_WORKER_ROLE_GEN || w->state == DUET_WORKER_STATE_DEAD || w->kv_pages == 0)
        return;
    const uint64_t avail = (uint64_t)w->free_pages + w->prefix_pages_evictable;
    const uint64_t free_pages = avail < w->kv_pages ? avail : w->kv_pages;
    sum[0] += (double)(w->kv_pages - free_pages);
    sum[1] += (double)w->kv_pages;
}

/* The KV cache usage of the live generation workers, 0..1 (0 without one). */
static double obs_kv_usage(duet__router_t *rt)
{
    double pages[2] = {0, 0};
    duet_registry_foreach(rt->reg, obs_pages_add, pages);
    return pages[1] > 0 ? pages[0] / pages[1] : 0.0;
}

void duet__obs_scrape(duet__router_t *rt)
{
    duet_admission_stats_t s;
    duet_admission_stats(rt->adm, &s);
    duet_metrics_gauge_set(rt->obs.running, (double)s.in_flight);
    duet_metrics_gauge_set(rt->obs.waiting, (double)s.queued);
    duet_metrics_gauge_set(rt->obs.kv_usage, obs_kv_usage(rt));
}

void duet__obs_suspensions(duet__router_t *rt, uint64_t n)
{
    duet_metrics_counter_add(rt->obs.preemptions, (double)n);
}

void duet__obs_prefix_placement(duet__router_t *rt, duet_worker_role_t role)
{
    if (role == DUET_WORKER_ROLE_CTX || role == DUET_WORKER_ROLE_GEN)
        duet_metrics_counter_inc(rt->obs.prefix_placements[role]);
}

/* The periodic line: throughput over the window and the load now, when the window saw traffic. */
static void obs_on_stats_timer(uv_timer_t *t)
{
    duet__router_t *rt = t->data;
    duet__obs_t *o = &rt->obs;
    const uint64_t now = uv_now(rt->loop);
    const double s = now > o->win_start_ms ? (double)(now - o->win_start_ms) / 1e3 : 1.0;
    if (o->win_requests > 0 || o->win_gen_tokens > 0 || o->win_prompt_tokens > 0) {
        duet_admission_stats_t a;
        duet_admission_stats(rt->adm, &a);
        DUET_LOG_INFO("stats: %.1f req/s, prompt %.1f tok/s, generation %.1f tok/s over %.1f s; "
                      "running %u, waiting %u, KV cache %.1f%% used",
                      (double)o->win_requests / s, (double)o->win_prompt_tokens / s,
                      (double)o->win_gen_tokens / s, s, a.in_flight, a.queued,
                      100.0 * obs_kv_usage(rt));
    }
    o->win_requests = o->win_gen_tokens = o->win_prompt_tokens = 0;
    o->win_start_ms = now;
}

void duet__obs_start(duet__router_t *rt, uint64_t interval_ms)
{
    duet__obs_t *o = &rt->obs;
    uv_timer_init(rt->loop, &o->stats_timer);
    o->stats_timer.data = rt;
    o->win_start_ms = uv_now(rt->loop);
    if (interval_ms > 0)
        uv_timer_start(&o->stats_timer, obs_on_stats_timer, interval_ms, interval_ms);
}

void duet__obs_stop(duet__router_t *rt)
{
    uv_timer_stop(&rt->obs.stats_timer);
    uv_close((uv_handle_t *)&rt->obs.stats_timer, NULL);
}
