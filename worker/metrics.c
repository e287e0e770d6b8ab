/*
 * A worker's /metrics; see metrics.h. The figures are read when scraped: gauges are set from the
 * pools and a heartbeat's worth of fields (duet_worker_fill_heartbeat), and the work counters,
 * which the role keeps as totals, are advanced by their increase since the last scrape.
 */
#include "worker/metrics.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/strbuf.h"
#include "router/http/http.h"
#include "worker/skeleton.h"

/* Gauges, then counters fed from a Heartbeat's totals (indexes into wm->m and wm->last). */
enum {
    WM_KV_PAGES,
    WM_KV_FREE,
    WM_KV_USED,
    WM_SLOTS,
    WM_SLOTS_FREE,
    WM_RUNNING,
    WM_QUEUED,
    WM_QUEUED_TOKENS,
    WM_DRAINING,
    WM_PREFIX_ENTRIES,
    WM_PREFIX_PAGES,
    WM_N_GAUGES,
    WM_PREFILL_TOKENS = WM_N_GAUGES,
    WM_BUSY_SECONDS,
    WM_DECODE_STEPS,
    WM_DECODE_SEQ_STEPS,
    WM_DECODED_TOKENS,
    WM_STEP_SECONDS,
    WM_SUSPENDED,
    WM_RESUMED,
    WM_PREFIX_LOOKUPS,
    WM_PREFIX_HITS,
    WM_PREFIX_SAVED,
    WM_PREFIX_EVICTIONS,
    WM_N
};

static const struct {
    const char *name, *help;
} wm_series[WM_N] = {
    {"duet_worker_kv_pages", "KV pages in the pool (a group: over its ranks)"},
    {"duet_worker_kv_pages_free", "KV pages no request holds"},
    {"duet_worker_kv_pages_used", "KV pages requests hold"},
    {"duet_worker_state_slots", "KDA state slots in the pool (0 without KDA layers)"},
    {"duet_worker_state_slots_free", "KDA state slots no sequence holds"},
    {"duet_worker_running", "requests in the worker's batch"},
    {"duet_worker_queued", "requests waiting (prefill queue / admission)"},
    {"duet_worker_queued_tokens", "prompt tokens waiting to be prefilled or admitted"},
    {"duet_worker_draining", "1 while the worker takes no new requests"},
    {"duet_worker_prefix_cache_entries", "prefix snapshots kept (cache.prefix)"},
    {"duet_worker_prefix_cache_pages", "KV pages the prefix cache holds (shared or not)"},
    {"duet_worker_prefill_tokens_total", "prompt tokens this worker prefilled"},
    {"duet_worker_busy_seconds_total", "wall time in forward steps"},
    {"duet_worker_decode_steps_total", "gen: forward steps that decoded"},
    {"duet_worker_decode_seq_steps_total", "gen: sum over those steps of the requests decoding"},
    {"duet_worker_decoded_tokens_total", "gen: tokens those steps produced"},
    {"duet_worker_step_seconds_total", "gen: wall time of those steps"},
    {"duet_worker_suspended_total", "gen: requests suspended to host memory (pages ran out)"},
    {"duet_worker_resumed_total", "gen: suspended requests resumed"},
    {"duet_worker_prefix_cache_lookups_total", "prompts looked up in the prefix cache"},
    {"duet_worker_prefix_cache_hits_total", "prompts that reused a cached prefix"},
    {"duet_worker_prefix_cache_tokens_saved_total", "prompt tokens not prefilled (hits)"},
    {"duet_worker_prefix_cache_evictions_total", "prefix snapshots dropped"},
};

struct duet_worker_metrics {
    duet_worker_t *w;
    duet_metrics_t *reg;
    duet_http_server_t *http;
    duet_metric_t *m[WM_N];
    double last[WM_N]; /* counters: the totals at the last scrape */
    /* speculation: verify steps by tokens emitted, drafts proposed / kept by position */
    duet_metric_t *spec_step_tokens;
    duet_metric_t *spec_drafted[DUET_PROTO_SPEC_POSITIONS];
    duet_metric_t *spec_accepted[DUET_PROTO_SPEC_POSITIONS];
    uint64_t last_step_tokens[DUET_PROTO_SPEC_POSITIONS + 1];
    uint64_t last_drafted[DUET_PROTO_SPEC_POSITIONS], last_accepted[DUET_PROTO_SPEC_POSITIONS];
};

/* The increase of a total since the last scrape (a total that went down counts from 0). */
static double wm_delta(double now, double *last)
{
    const double d = now >= *last ? now - *last : now;
    *last = now;
    return d;
}

static uint64_t wm_delta_u(uint64_t now, uint64_t *last)
{
    const uint64_t d = now >= *last ? now - *last : now;
    *last = now;
    return d;
}

static void wm_update(duet_worker_metrics_t *wm)
{
    duet_worker_t *w = wm->w;
    Duet__Heartbeat hb = DUET__HEARTBEAT__INIT;
    uint32_t kv_pages = 0;
    duet_worker_fill_heartbeat(w, &hb, &kv_pages);
    const double g[WM_N_GAUGES] = {
        [WM_KV_PAGES] = kv_pages,
        [WM_KV_FREE] = hb.free_pages,
        [WM_KV_USED] = kv_pages >= hb.free_pages ? kv_pages - hb.free_pages : 0,
        [WM_SLOTS] = hb.state_slots,
        [WM_SLOTS_FREE] = hb.free_state_slots,
        [WM_RUNNING] = hb.running,
        [WM_QUEUED] = hb.queued,
        [WM_QUEUED_TOKENS] = (double)hb.queued_tokens,
        [WM_DRAINING] = hb.draining ? 1 : 0,
        [WM_PREFIX_ENTRIES] = hb.prefix_entries,
        [WM_PREFIX_PAGES] = hb.prefix_pages,
    };
    for (int i = 0; i < WM_N_GAUGES; i++)
        duet_metrics_gauge_set(wm->m[i], g[i]);
    const double c[WM_N] = {
        [WM_PREFILL_TOKENS] = (double)hb.prefill_tokens,
        [WM_BUSY_SECONDS] = hb.busy_seconds,
        [WM_DECODE_STEPS] = (double)hb.decode_steps,
        [WM_DECODE_SEQ_STEPS] = (double)hb.decode_seq_steps,
        [WM_DECODED_TOKENS] = (double)hb.decoded_tokens,
        [WM_STEP_SECONDS] = hb.step_seconds,
        [WM_SUSPENDED] = (double)hb.suspensions,
        [WM_RESUMED] = (double)hb.resumes,
        [WM_PREFIX_LOOKUPS] = (double)hb.prefix_lookups,
        [WM_PREFIX_HITS] = (double)hb.prefix_hits,
        [WM_PREFIX_SAVED] = (double)hb.prefix_tokens_saved,
        [WM_PREFIX_EVICTIONS] = (double)hb.prefix_evictions,
    };
    for (int i = WM_N_GAUGES; i < WM_N; i++)
        duet_metrics_counter_add(wm->m[i], wm_delta(c[i], &wm->last[i]));
    for (size_t i = 0; i < hb.n_spec_step_tokens && i <= DUET_PROTO_SPEC_POSITIONS; i++)
        duet_metrics_histogram_observe_n(
            wm->spec_step_tokens, (double)(i + 1),
            wm_delta_u(hb.spec_step_tokens[i], &wm->last_step_tokens[i]));
    for (size_t j = 0; j < hb.n_spec_drafted && j < DUET_PROTO_SPEC_POSITIONS; j++)
        duet_metrics_counter_add(wm->spec_drafted[j],
                                 (double)wm_delta_u(hb.spec_drafted[j], &wm->last_drafted[j]));
    for (size_t j = 0; j < hb.n_spec_accepted && j < DUET_PROTO_SPEC_POSITIONS; j++)
        duet_metrics_counter_add(wm->spec_accepted[j],
                                 (double)wm_delta_u(hb.spec_accepted[j], &wm->last_accepted[j]));
}

static void wm_on_request(duet_http_request_t *req, void *user)
{
    duet_worker_metrics_t *wm = user;
    const char *method = duet_http_request_method(req);
    if (strcmp(duet_http_request_path(req), "/metrics") != 0) {
        static const char nf[] = "not found: this worker serves GET /metrics only\n";
        duet_http_respond(req, 404, "text/plain", NULL, 0, nf, sizeof(nf) - 1);
    } else if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0) {
        static const char na[] = "use GET\n";
        duet_http_header_t h = {"Allow", "GET, HEAD"};
        duet_http_respond(req, 405, "text/plain", &h, 1, na, sizeof(na) - 1);
    } else {
        wm_update(wm);
        duet_strbuf_t sb;
        duet_strbuf_init(&sb);
        if (duet_metrics_render(wm->reg, &sb) == DUET_OK)
            duet_http_respond(req, 200, DUET_METRICS_CONTENT_TYPE, NULL, 0,
                              sb.data != NULL ? sb.data : "", sb.len);
        else
            duet_http_respond(req, 500, "text/plain", NULL, 0, "out of memory\n", 14);
        duet_strbuf_free(&sb);
    }
    duet_http_request_release(req);
}

static duet_status_t wm_spec_init(duet_worker_metrics_t *wm)
{
    duet_status_t st;
    duet_metric_family_t *f, *fd, *fa;
    double bounds[DUET_PROTO_SPEC_POSITIONS + 1];
    duet_metrics_buckets_linear(1.0, 1.0, DUET_PROTO_SPEC_POSITIONS + 1, bounds);
    const char *const pos[] = {"position"};
    if ((st = duet_metrics_histogram_new(wm->reg, "duet_worker_spec_step_tokens",
                                         "gen: tokens a verify step emitted for a request "
                                         "(drafts kept + 1)",
                                         NULL, 0, bounds, DUET_PROTO_SPEC_POSITIONS + 1, &f)) < 0 ||
        (st = duet_metrics_counter_new(wm->reg, "duet_worker_spec_drafted_total",
                                       "gen: drafted tokens verified, by draft position", pos, 1,
                                       &fd)) < 0 ||
        (st = duet_metrics_counter_new(wm->reg, "duet_worker_spec_accepted_total",
                                       "gen: drafted tokens kept, by draft position", pos, 1,
                                       &fa)) < 0)
        return st;
    wm->spec_step_tokens = duet_metrics_single(f);
    for (unsigned j = 0; j < DUET_PROTO_SPEC_POSITIONS; j++) {
        char v[16];
        snprintf(v, sizeof(v), "%u", j + 1);
        const char *const vals[] = {v};
        if ((st = duet_metrics_child(fd, vals, 1, &wm->spec_drafted[j])) < 0 ||
            (st = duet_metrics_child(fa, vals, 1, &wm->spec_accepted[j])) < 0)
            return st;
    }
    return DUET_OK;
}

duet_status_t duet_worker_metrics_start(duet_worker_t *w, duet_metrics_t *reg, const char *host,
                                        uint16_t port, duet_worker_metrics_t **wm_p)
{
    duet_worker_metrics_t *wm = calloc(1, sizeof(*wm));
    if (wm == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "out of memory");
    wm->w = w;
    wm->reg = reg;
    duet_status_t st = DUET_OK;
    for (int i = 0; i < WM_N && st == DUET_OK; i++) {
        duet_metric_family_t *f;
        st = i < WM_N_GAUGES
                 ? duet_metrics_gauge_new(reg, wm_series[i].name, wm_series[i].help, NULL, 0, &f)
                 : duet_metrics_counter_new(reg, wm_series[i].name, wm_series[i].help, NULL, 0, &f);
        if (st == DUET_OK)
            wm->m[i] = duet_metrics_single(f);
    }
    if (st == DUET_OK)
        st = wm_spec_init(wm);
    if (st == DUET_OK) {
        duet_http_options_t ho;
        duet_http_options_default(&ho);
        ho.host = host;
        ho.port = port;
        ho.max_connections = 16;
        ho.max_body_bytes = 1024;
        ho.on_request = wm_on_request;
        ho.user = wm;
        st = duet_http_server_start(w->loop, &ho, &wm->http);
    }
    if (st != DUET_OK) {
        free(wm);
        return st;
    }
    *wm_p = wm;
    return DUET_OK;
}

uint16_t duet_worker_metrics_port(const duet_worker_metrics_t *wm)
{
    return duet_http_server_port(wm->http);
}

static void wm_closed(void *user)
{
    free(user);
}

void duet_worker_metrics_close(duet_worker_metrics_t *wm)
{
    if (wm == NULL)
        return;
    duet_http_server_close(wm->http, wm_closed, wm);
}
