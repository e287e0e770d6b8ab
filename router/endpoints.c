/*
 * duet-router's HTTP endpoints. One table names every endpoint by method and path, so that
 * routing, the 404 / 405 answers and the `path` label of the HTTP metrics all read from it. The
 * completions endpoints hand the request to the request state machine (request.c); the others
 * answer at once from the router's state.
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/strbuf.h"
#include "router/api/tokenize.h"
#include "router/router_impl.h"

typedef struct rt_endpoint rt_endpoint_t;

/* Answers `http` and owns its one reference: releases it, or hands it on (completions). */
typedef void (*rt_endpoint_fn)(duet__router_t *rt, duet_http_request_t *http,
                               const rt_endpoint_t *e);

struct rt_endpoint {
    const char *method; /* "POST", or "GET" (which also answers HEAD) */
    const char *path;   /* a tail "{name}" matches any non-empty rest of the path */
    rt_endpoint_fn handle;
    duet_oai_endpoint_t oai; /* the completions endpoints: which OpenAI API */
    bool api;                /* an API route: needs api.key when one is set */
};

/* The whole answer, and the handler's reference dropped: for endpoints that keep no state. */
static void rt_answer(duet_http_request_t *http, int status, const char *content_type,
                      const duet_http_header_t *headers, size_t n_headers, const char *body,
                      size_t len)
{
    duet_http_respond(http, status, content_type, headers, n_headers, body, len);
    duet_http_request_release(http);
}

static void rt_answer_json(duet_http_request_t *http, int status, const char *body)
{
    rt_answer(http, status, "application/json", NULL, 0, body, strlen(body));
}

/* 405 naming the one method the path takes (GET also allows HEAD). */
static void rt_method_not_allowed(duet_http_request_t *http, const char *method)
{
    char body[160];
    int len = snprintf(body, sizeof(body),
                       "{\"error\":{\"message\":\"use %s\",\"type\":\"invalid_request_error\","
                       "\"param\":null,\"code\":\"method_not_allowed\"}}",
                       method);
    duet_http_header_t h = {"Allow", strcmp(method, "GET") == 0 ? "GET, HEAD" : method};
    rt_answer(http, 405, "application/json", &h, 1, body, (size_t)len);
}

/* ---------------------------------------------------------------- the endpoints */

static void ep_completion(duet__router_t *rt, duet_http_request_t *http, const rt_endpoint_t *e)
{
    duet__rq_begin(rt, http, e->oai, e->path);
}

/* The OpenAI error *err as the whole answer. */
static void rt_answer_error(duet_http_request_t *http, const duet_oai_error_t *err)
{
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    duet_oai_error_json(err, &sb);
    rt_answer(http, err->http_status, "application/json", NULL, 0, sb.data != NULL ? sb.data : "",
              sb.len);
    duet_strbuf_free(&sb);
}

/* Appends the one served model's object: vLLM's max_model_len (null: no limit), the router's
 * start as "created". */
static void rt_model_object(const duet__router_t *rt, duet_strbuf_t *sb)
{
    duet_strbuf_puts(sb, "{\"id\":");
    duet_oai_json_string(sb, rt->model_name, strlen(rt->model_name));
    duet_strbuf_printf(sb,
                       ",\"object\":\"model\",\"created\":%lld,\"owned_by\":\"duet\","
                       "\"root\":",
                       (long long)rt->started_unix);
    duet_oai_json_string(sb, rt->model_name, strlen(rt->model_name));
    duet_strbuf_puts(sb, ",\"max_model_len\":");
    if (rt->lim.max_context > 0)
        duet_strbuf_printf(sb, "%zu}", rt->lim.max_context);
    else
        duet_strbuf_puts(sb, "null}");
}

/* GET /v1/models: a list of the one served model. */
static void ep_models(duet__router_t *rt, duet_http_request_t *http, const rt_endpoint_t *e)
{
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    duet_strbuf_puts(&sb, "{\"object\":\"list\",\"data\":[");
    rt_model_object(rt, &sb);
    duet_strbuf_puts(&sb, "]}");
    rt_answer(http, 200, "application/json", NULL, 0, sb.data, sb.len);
    duet_strbuf_free(&sb);
}

/*
 * Decodes the percent escapes of s into out (cap bytes, NUL-terminated): clients escape a '/' of
 * a model id ("org/name") as %2F. False for a truncated or non-hex escape, %00, or no room.
 */
static bool rt_unescape(const char *s, char *out, size_t cap)
{
    size_t n = 0;
    for (; *s != '\0'; n++) {
        unsigned c = (unsigned char)*s++;
        if (c == '%') {
            unsigned v = 0;
            for (int i = 0; i < 2; i++, s++) {
                const char h = *s;
                if (h >= '0' && h <= '9')
                    v = v * 16 + (unsigned)(h - '0');
                else if ((h | 0x20) >= 'a' && (h | 0x20) <= 'f')
                    v = v * 16 + (unsigned)((h | 0x20) - 'a' + 10);
                else
                    return false;
            }
            if (v == 0)
                return false;
            c = v;
        }
        if (n + 1 >= cap)
            return false;
        out[n] = (char)c;
    }
    out[n] = '\0';
    return true;
}

/* GET /v1/models/{model}: the served model's object, OpenAI's 404 for any other id. */
static void ep_model(duet__router_t *rt, duet_http_request_t *http, const rt_endpoint_t *e)
{
    const char *id = duet_http_request_path(http) + (strchr(e->path, '{') - e->path);
    char name[1024];
    const bool decoded = rt_unescape(id, name, sizeof(name));
    if (decoded && strcmp(name, rt->model_name) == 0) {
        duet_strbuf_t sb;
        duet_strbuf_init(&sb);
        rt_model_object(rt, &sb);
        rt_answer(http, 200, "application/json", NULL, 0, sb.data, sb.len);
        duet_strbuf_free(&sb);
        return;
    }
    duet_oai_error_t err;
    duet_oai_error_make(&err, 404, NULL, "model_not_found", "model",
                        "The model `%.200s` does not exist. This server serves `%.200s`.",
                        decoded ? name : id, rt->model_name);
    rt_answer_error(http, &err);
}

/* POST /tokenize and /detokenize (vLLM's): answered at once from the tokenizer. */
static void ep_tokenize(duet__router_t *rt, duet_http_request_t *http, const rt_endpoint_t *e)
{
    size_t len = 0;
    const char *body = duet_http_request_body(http, &len);
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    duet_oai_error_t err;
    memset(&err, 0, sizeof(err));
    duet_status_t st = strcmp(e->path, "/tokenize") == 0
                           ? duet_oai_tokenize(&rt->lim, rt->tmpl, rt->tok, body, len, &sb, &err)
                           : duet_oai_detokenize(&rt->lim, rt->tok, body, len, &sb, &err);
    if (st != DUET_OK)
        rt_answer_error(http, &err);
    else
        rt_answer(http, 200, "application/json", NULL, 0, sb.data != NULL ? sb.data : "", sb.len);
    duet_strbuf_free(&sb);
}

/* 200 while a generation worker is up and the router is not draining, else 503 with why. */
static void ep_health(duet__router_t *rt, duet_http_request_t *http, const rt_endpoint_t *e)
{
    size_t gens = duet_registry_count(rt->reg, DUET_WORKER_ROLE_GEN, DUET_WORKER_STATE_UP);
    size_t ctxs = duet_registry_count(rt->reg, DUET_WORKER_ROLE_CTX, DUET_WORKER_STATE_UP);
    const char *why = rt->draining ? "draining" : gens == 0 ? "no live generation worker" : "";
    char b[256];
    snprintf(b, sizeof(b),
             "{\"status\":\"%s\",\"reason\":\"%s\",\"gen_workers\":%zu,\"ctx_workers\":%zu}",
             why[0] == '\0' ? "ok" : "unavailable", why, gens, ctxs);
    rt_answer_json(http, why[0] == '\0' ? 200 : 503, b);
}

static void ep_live(duet__router_t *rt, duet_http_request_t *http, const rt_endpoint_t *e)
{
    rt_answer_json(http, 200, "{\"status\":\"live\"}");
}

/* Adds a live generation worker's cache plan into the sums at user (doubles: the figures come
 * off the wire, and a double sum cannot wrap). */
static void ep_cache_plan_add(const duet_worker_info_t *w, void *user)
{
    double *sum = user;
    if (w->role != DUET_WORKER_ROLE_GEN || w->state == DUET_WORKER_STATE_DEAD)
        return;
    sum[0] += (double)w->cache_plan.budget_bytes;
    sum[1] += (double)w->cache_plan.target_pages;
    sum[2] += (double)w->cache_plan.target_bytes;
    sum[3] += (double)w->cache_plan.draft_pages;
    sum[4] += (double)w->cache_plan.draft_bytes;
}

/* Adds a live worker's prefix cache (entries, pages) into the sums at user. */
static void ep_prefix_add(const duet_worker_info_t *w, void *user)
{
    double *sum = user;
    if (w->state == DUET_WORKER_STATE_DEAD)
        return;
    sum[0] += (double)w->prefix_entries;
    sum[1] += (double)w->prefix_pages;
}

static void ep_metrics(duet__router_t *rt, duet_http_request_t *http, const rt_endpoint_t *e)
{
    /* summed over the live workers at each scrape, so a departed worker's share goes with it */
    double plans[5] = {0}, prefix[2] = {0};
    duet_registry_foreach(rt->reg, ep_cache_plan_add, plans);
    duet_registry_foreach(rt->reg, ep_prefix_add, prefix);
    duet_metrics_gauge_set(rt->m_prefix_entries, prefix[0]);
    duet_metrics_gauge_set(rt->m_prefix_pages, prefix[1]);
    duet_metrics_gauge_set(rt->m_cache_budget, plans[0]);
    duet_metrics_gauge_set(rt->m_cache_target_pages, plans[1]);
    duet_metrics_gauge_set(rt->m_cache_target_bytes, plans[2]);
    duet_metrics_gauge_set(rt->m_cache_draft_pages, plans[3]);
    duet_metrics_gauge_set(rt->m_cache_draft_bytes, plans[4]);
    duet__obs_scrape(rt);
    /* the worker gauges are read from the registry when scraped, not kept up to date */
    for (int role = DUET_WORKER_ROLE_CTX; role <= DUET_WORKER_ROLE_GEN; role++)
        for (int s = 0; s < DUET_WORKER_STATE_COUNT; s++) {
            const char *const v[2] = {duet_worker_role_name((duet_worker_role_t)role),
                                      duet_worker_state_name((duet_worker_state_t)s)};
            duet_metric_t *m;
            if (duet_metrics_child(rt->f_workers, v, 2, &m) == DUET_OK)
                duet_metrics_gauge_set(
                    m, (double)duet_registry_count(rt->reg, role, (duet_worker_state_t)s));
        }
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    duet_metrics_render(rt->metrics, &sb);
    rt_answer(http, 200, DUET_METRICS_CONTENT_TYPE, NULL, 0, sb.data != NULL ? sb.data : "",
              sb.len);
    duet_strbuf_free(&sb);
}

/* Adds a live worker that serves /metrics to the http_sd array at user. */
static void ep_target_add(const duet_worker_info_t *w, void *user)
{
    if (w->metrics_port == 0 || w->state == DUET_WORKER_STATE_DEAD)
        return;
    /* the address the worker connected from ("ip:port", "[ip6]:port"), with its metrics port */
    char host[64], target[80];
    snprintf(host, sizeof(host), "%s", w->peer);
    char *colon = strrchr(host, ':');
    if (colon != NULL)
        *colon = '\0';
    snprintf(target, sizeof(target), "%s:%u", host, w->metrics_port);
    char id[24];
    snprintf(id, sizeof(id), "%llu", (unsigned long long)w->id);
    json_t *labels = json_pack("{s:s, s:s, s:s}", "role", duet_worker_role_name(w->role), "worker",
                               w->name, "worker_id", id);
    json_t *o = json_pack("{s:[s], s:o}", "targets", target, "labels", labels);
    if (o != NULL)
        json_array_append_new(user, o);
}

/* GET /metrics/targets: the live workers' /metrics endpoints in Prometheus's HTTP service
 * discovery shape ([{"targets": ["host:port"], "labels": {...}}]; docs/observability.md). */
static void ep_metrics_targets(duet__router_t *rt, duet_http_request_t *http,
                               const rt_endpoint_t *e)
{
    json_t *a = json_array();
    duet_registry_foreach(rt->reg, ep_target_add, a);
    char *text = a != NULL ? json_dumps(a, JSON_COMPACT) : NULL;
    json_decref(a);
    if (text == NULL) {
        rt_answer_json(http, 500, "{\"error\":{\"message\":\"out of memory\"}}");
        return;
    }
    rt_answer_json(http, 200, text);
    free(text);
}

// clang-format off
static const rt_endpoint_t rt_endpoints[] = {
    {.method = "POST", .path = "/v1/completions",      .handle = ep_completion,
     .oai = DUET_OAI_ENDPOINT_COMPLETIONS, .api = true},
    {.method = "POST", .path = "/v1/chat/completions", .handle = ep_completion,
     .oai = DUET_OAI_ENDPOINT_CHAT, .api = true},
    {.method = "GET",  .path = "/v1/models",           .handle = ep_models,   .api = true},
    {.method = "GET",  .path = "/v1/models/{model}",   .handle = ep_model,    .api = true},
    {.method = "POST", .path = "/tokenize",            .handle = ep_tokenize, .api = true},
    {.method = "POST", .path = "/detokenize",          .handle = ep_tokenize, .api = true},
    {.method = "GET",  .path = "/health",              .handle = ep_health},
    {.method = "GET",  .path = "/live",                .handle = ep_live},
    {.method = "GET",  .path = "/metrics",             .handle = ep_metrics},
    {.method = "GET",  .path = "/metrics/targets",     .handle = ep_metrics_targets},
};
// clang-format on

static const rt_endpoint_t *rt_endpoint_find(const char *path)
{
    for (size_t i = 0; i < sizeof(rt_endpoints) / sizeof(rt_endpoints[0]); i++) {
        const char *p = rt_endpoints[i].path, *brace = strchr(p, '{');
        if (brace == NULL ? strcmp(path, p) == 0
                          : strncmp(path, p, (size_t)(brace - p)) == 0 && path[brace - p] != '\0')
            return &rt_endpoints[i];
    }
    return NULL;
}

/* ---------------------------------------------------------------- routing */

const char *duet__rt_path_class(const char *path, void *user)
{
    const rt_endpoint_t *e = rt_endpoint_find(path);
    return e != NULL ? e->path : "other";
}

/*
 * api.key: an API route (and any unknown path under /v1/) without "Authorization: Bearer <key>"
 * gets 401, shaped as OpenAI's; true when it may go on. /health, /live and /metrics stay open.
 */
static bool rt_api_authorized(duet__router_t *rt, duet_http_request_t *http, const rt_endpoint_t *e)
{
    const char *path = duet_http_request_path(http);
    if (rt->api_key == NULL || !(e != NULL ? e->api : strncmp(path, "/v1/", 4) == 0))
        return true;
    duet_http_auth_t a = duet_http_request_bearer(http, rt->api_key, strlen(rt->api_key));
    if (a == DUET_HTTP_AUTH_OK)
        return true;
    duet_oai_error_t err;
    duet_oai_error_make(&err, 401, NULL, "invalid_api_key", NULL, "%s",
                        a == DUET_HTTP_AUTH_MISSING
                            ? "You didn't provide an API key. You need to provide your API key in "
                              "an Authorization header using Bearer auth (i.e. Authorization: "
                              "Bearer YOUR_KEY)."
                            : "Incorrect API key provided.");
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    duet_oai_error_json(&err, &sb);
    duet_http_header_t h = {"WWW-Authenticate", "Bearer"};
    rt_answer(http, 401, "application/json", &h, 1, sb.data != NULL ? sb.data : "", sb.len);
    duet_strbuf_free(&sb);
    return false;
}

/* A known path with another method gets 405; an unknown path 404 whatever the method. */
void duet__rt_on_request(duet_http_request_t *http, void *user)
{
    duet__router_t *rt = user;
    const char *method = duet_http_request_method(http);
    bool get = strcmp(method, "GET") == 0 || strcmp(method, "HEAD") == 0;
    const rt_endpoint_t *e = rt_endpoint_find(duet_http_request_path(http));
    if (!rt_api_authorized(rt, http, e))
        return;
    if (e == NULL) {
        duet_oai_error_t err;
        duet_oai_error_make(&err, 404, NULL, "unknown_url", NULL, "Invalid URL (%.16s %.300s)",
                            method, duet_http_request_path(http));
        rt_answer_error(http, &err);
    } else if (strcmp(e->method, "GET") == 0 ? get : strcmp(method, e->method) == 0)
        e->handle(rt, http, e);
    else
        rt_method_not_allowed(http, e->method);
}
