/*
 * The admin API (see admin.h). Most requests are answered and released inside on_request. The
 * exception is a drain with ?wait=1: it becomes a waiter that holds the request and a timer
 * until the router reports the worker idle (done callback), the timer fires (504), the client
 * goes away (on_abort) or the admin closes (503). Whichever comes first finishes the waiter; the
 * others find it finished. A finished waiter is unlinked at once but freed, and its request
 * released, only in the timer's close callback, so nothing the loop may still deliver can touch
 * freed memory; the router is told to forget the waiter (drain_forget) whenever it may still
 * hold it.
 */
#include "router/cluster/admin.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/config.h"
#include "common/json.h"
#include "common/log.h"
#include "common/utf8.h"
#include "router/http/http.h"
#include "router/http/http_impl.h"

#define ADMIN_MAX_BODY (64 * 1024)
#define ADMIN_MAX_NAME 256
#define WORKERS_PREFIX "/admin/workers/"

typedef struct admin_waiter {
    uv_timer_t timer; /* deadline of the wait; closed when the waiter finishes */
    duet_admin_t *admin;
    duet_http_request_t *req; /* the admin's reference, released in waiter_on_close */
    struct admin_waiter *prev, *next;
    char name[ADMIN_MAX_NAME];
    uint64_t started_ms;
    uint32_t timeout_ms;
    bool registered; /* the router may still call done_cb for this waiter */
    bool in_drain;   /* inside ops->drain: a synchronous done is finished by the caller */
    bool finished;
} admin_waiter_t;

struct duet_admin {
    uv_loop_t *loop;
    duet_http_server_t *srv;
    duet_admin_options_t opts;
    char *token; /* owned copy; NULL when running without a token */
    size_t token_len;
    admin_waiter_t *waiters; /* unfinished waiters, linked */
    int open_handles;        /* waiter timers still closing + the server */
    bool closing;
    void (*close_cb)(void *user);
    void *close_user;
};

const char *duet_admin_worker_state_name(duet_admin_worker_state_t state)
{
    switch (state) {
    case DUET_ADMIN_WORKER_LIVE:
        return "live";
    case DUET_ADMIN_WORKER_DRAINING:
        return "draining";
    case DUET_ADMIN_WORKER_DEAD:
        return "dead";
    }
    return "unknown";
}

void duet_admin_options_default(duet_admin_options_t *opts)
{
    memset(opts, 0, sizeof(*opts));
    opts->host = "127.0.0.1";
    opts->port = DUET_ADMIN_DEFAULT_PORT;
    opts->drain_wait_timeout_ms = 60 * 1000;
    opts->max_drain_wait_timeout_ms = 3600 * 1000;
}

void duet_admin_options_from_config(duet_admin_options_t *opts, const duet_config_t *cfg)
{
    opts->host = duet_config_get_string(cfg, "admin.host");
    opts->port = (uint16_t)duet_config_get_int(cfg, "admin.port");
    opts->token = duet_config_get_string(cfg, "admin.token");
    opts->insecure_no_token = duet_config_get_bool(cfg, "admin.insecure_no_token");
    opts->drain_wait_timeout_ms =
        (uint32_t)duet_config_get_int(cfg, "admin.drain_wait_timeout_s") * 1000u;
}

/* ------------------------------------------------------------------ responses */

static void respond_json(duet_http_request_t *req, int status, json_t *body,
                         const duet_http_header_t *headers, size_t n_headers)
{
    char *text = json_dumps(body, JSON_COMPACT);
    json_decref(body);
    if (text == NULL) {
        static const char oom[] = "{\"error\":{\"code\":500,\"message\":\"out of memory\"}}";
        duet_http_respond(req, 500, "application/json", NULL, 0, oom, sizeof(oom) - 1);
        return;
    }
    size_t len = strlen(text);
    /* A failure here means the client is gone; on_abort or release cleans up. */
    duet_http_respond(req, status, "application/json", headers, n_headers, text, len);
    free(text);
}

static void respond_error_h(duet_http_request_t *req, int status, const duet_http_header_t *headers,
                            size_t n_headers, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

static void respond_error_h(duet_http_request_t *req, int status, const duet_http_header_t *headers,
                            size_t n_headers, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    for (char *p = msg; *p != '\0'; p++) /* keep the JSON valid whatever the input echoed */
        if ((unsigned char)*p < 0x20 || (unsigned char)*p >= 0x7f)
            *p = '?';
    DUET_RLOG_INFO(duet_http_request_id(req), "admin: %s %s from %s -> %d: %s",
                   duet_http_request_method(req), duet_http_request_path(req),
                   duet_http_request_peer(req), status, msg);
    json_t *body = json_pack("{s:{s:i,s:s}}", "error", "code", status, "message", msg);
    respond_json(req, status, body, headers, n_headers);
}

#define respond_error(req, status, ...) respond_error_h((req), (status), NULL, 0, __VA_ARGS__)

static void respond_405(duet_http_request_t *req, const char *allow)
{
    duet_http_header_t h = {"Allow", allow};
    respond_error_h(req, 405, &h, 1, "method %s not allowed on %s (allowed: %s)",
                    duet_http_request_method(req), duet_http_request_path(req), allow);
}

/* ------------------------------------------------------------------ auth */

static bool authorized(const duet_admin_t *admin, duet_http_request_t *req)
{
    if (admin->token == NULL)
        return true;
    duet_http_auth_t a = duet_http_request_bearer(req, admin->token, admin->token_len);
    if (a == DUET_HTTP_AUTH_MISSING) {
        duet_http_header_t h = {"WWW-Authenticate", "Bearer"};
        respond_error_h(req, 401, &h, 1,
                        "missing Authorization header: send \"Authorization: Bearer <token>\"");
        return false;
    }
    if (a != DUET_HTTP_AUTH_OK) {
        duet_http_header_t h = {"WWW-Authenticate", "Bearer error=\"invalid_token\""};
        respond_error_h(req, 401, &h, 1, "invalid admin token");
        return false;
    }
    return true;
}

/* ------------------------------------------------------------------ JSON views */

static json_t *admission_json(duet_admission_t *adm)
{
    duet_admission_stats_t s;
    duet_admission_stats(adm, &s);
    json_t *rej = json_object();
    for (int r = 0; r < DUET_ADMISSION_REASON_COUNT; r++)
        json_object_set_new(rej, duet_admission_reason_name((duet_admission_reason_t)r),
                            json_integer((json_int_t)s.rejected_total[r]));
    json_t *o = json_object();
    json_object_set_new(o, "paused", json_boolean(s.paused));
    json_object_set_new(o, "has_capacity", json_boolean(s.has_capacity));
    json_object_set_new(o, "in_flight", json_integer(s.in_flight));
    json_object_set_new(o, "queued", json_integer(s.queued));
    json_object_set_new(o, "max_inflight", json_integer(s.max_inflight));
    json_object_set_new(o, "worker_slots", json_integer(s.worker_slots));
    json_object_set_new(o, "limit", json_integer(s.limit));
    json_object_set_new(o, "max_queue", json_integer(s.max_queue));
    json_object_set_new(o, "admitted_total", json_integer((json_int_t)s.admitted_total));
    json_object_set_new(o, "queued_total", json_integer((json_int_t)s.queued_total));
    json_object_set_new(o, "cancelled_total", json_integer((json_int_t)s.cancelled_total));
    json_object_set_new(o, "requeued_total", json_integer((json_int_t)s.requeued_total));
    json_object_set_new(o, "rejected_total", rej);
    return o;
}

static void add_worker(const duet_admin_worker_info_t *w, void *user)
{
    json_t *arr = user;
    json_t *load = json_pack(
        "{s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I}", "free_pages", (json_int_t)w->free_pages, "kv_pages",
        (json_int_t)w->kv_pages, "free_state_slots", (json_int_t)w->free_state_slots, "state_slots",
        (json_int_t)w->state_slots, "running", (json_int_t)w->running, "queued",
        (json_int_t)w->queued, "prefix_pages", (json_int_t)w->prefix_pages, "prefix_entries",
        (json_int_t)w->prefix_entries);
    json_t *o = json_pack("{s:I,s:s,s:s,s:s,s:o}", "id", (json_int_t)w->id, "name",
                          w->name != NULL ? w->name : "", "role", w->role != NULL ? w->role : "",
                          "state", duet_admin_worker_state_name(w->state), "load", load);
    if (o == NULL)
        return;
    /* json_string refuses invalid UTF-8: the registry keeps these to [A-Za-z0-9_.:-] */
    json_object_set_new(o, "address", json_string(w->address != NULL ? w->address : ""));
    json_object_set_new(o, "device", json_string(w->device != NULL ? w->device : ""));
    json_object_set_new(o, "dtype", json_string(w->dtype != NULL ? w->dtype : ""));
    json_object_set_new(o, "uptime_s", json_integer((json_int_t)w->uptime_s));
    json_object_set_new(o, "heartbeat_age_ms", json_integer((json_int_t)w->heartbeat_age_ms));
    json_object_set_new(o, "utilisation", json_real(w->utilisation));
    json_object_set_new(o, "metrics_port", json_integer((json_int_t)w->metrics_port));
    json_array_append_new(arr, o);
}

typedef struct {
    const char *name;
    bool found;
    duet_admin_worker_info_t info;
} find_worker_t;

static void find_worker(const duet_admin_worker_info_t *w, void *user)
{
    find_worker_t *f = user;
    if (!f->found && w->name != NULL && strcmp(w->name, f->name) == 0) {
        f->found = true;
        f->info = *w;
        f->info.name = NULL; /* borrowed strings end with the visit */
        f->info.role = NULL;
        f->info.address = f->info.device = f->info.dtype = NULL;
    }
}

/* ------------------------------------------------------------------ drain waiters */

static void admin_handle_closed(duet_admin_t *admin)
{
    DUET_ASSERT(admin->open_handles > 0);
    if (--admin->open_handles == 0 && admin->closing) {
        void (*cb)(void *) = admin->close_cb;
        void *user = admin->close_user;
        free(admin->token);
        free(admin);
        if (cb != NULL)
            cb(user);
    }
}

static void waiter_on_close(uv_handle_t *h)
{
    admin_waiter_t *w = h->data;
    duet_admin_t *admin = w->admin;
    if (w->req != NULL) {
        duet_http_request_set_data(w->req, NULL);
        duet_http_request_release(w->req);
    }
    free(w);
    admin_handle_closed(admin);
}

/* Unlink, let the router forget it if it may still call back, close the timer. */
static void waiter_finish(admin_waiter_t *w)
{
    if (w->finished)
        return;
    w->finished = true;
    duet_admin_t *admin = w->admin;
    if (w->registered) {
        w->registered = false;
        admin->opts.ops->drain_forget(admin->opts.ops_ctx, w);
    }
    if (w->prev != NULL)
        w->prev->next = w->next;
    else
        admin->waiters = w->next;
    if (w->next != NULL)
        w->next->prev = w->prev;
    w->prev = w->next = NULL;
    duet_http_request_set_data(w->req, NULL);
    uv_timer_stop(&w->timer);
    uv_close((uv_handle_t *)&w->timer, waiter_on_close);
}

static void waiter_on_done(void *done_user, duet_status_t st, const char *detail)
{
    admin_waiter_t *w = done_user;
    if (w->finished)
        return; /* the router broke the drain_forget contract; nothing to answer */
    w->registered = false;
    uint64_t waited = uv_now(w->admin->loop) - w->started_ms;
    if (st == DUET_OK) {
        DUET_RLOG_INFO(duet_http_request_id(w->req), "admin: worker %s drained after %llu ms",
                       w->name, (unsigned long long)waited);
        json_t *o = json_pack("{s:s,s:s,s:b,s:I}", "worker", w->name, "state", "draining", "idle",
                              1, "waited_ms", (json_int_t)waited);
        respond_json(w->req, 200, o, NULL, 0);
    } else {
        respond_error(w->req, 409, "drain of worker %s did not complete: %s", w->name,
                      detail != NULL && detail[0] != '\0' ? detail : duet_status_str(st));
    }
    if (!w->in_drain)
        waiter_finish(w);
}

static void waiter_on_timeout(uv_timer_t *t)
{
    admin_waiter_t *w = t->data;
    respond_error(w->req, 504,
                  "worker %s still has running requests after %.1f s; it stays draining (retry "
                  "the wait, or undrain it)",
                  w->name, w->timeout_ms / 1000.0);
    waiter_finish(w);
}

/* ------------------------------------------------------------------ handlers */

static int status_to_http(duet_status_t st)
{
    return st == DUET_ERR_NOT_FOUND ? 404 : 409;
}

/* Returns true when a waiter took over the caller's reference to req. */
static bool handle_drain(duet_admin_t *admin, duet_http_request_t *req, const char *name)
{
    char buf[32];
    bool wait = false;
    if (duet_http_request_query_param(req, "wait", buf, sizeof(buf))) {
        if (strcmp(buf, "1") == 0 || strcmp(buf, "true") == 0)
            wait = true;
        else if (strcmp(buf, "0") != 0 && strcmp(buf, "false") != 0) {
            respond_error(req, 400, "query parameter wait: expected 1/true or 0/false, got \"%s\"",
                          buf);
            return false;
        }
    }
    bool migrate = false;
    if (duet_http_request_query_param(req, "migrate", buf, sizeof(buf))) {
        if (strcmp(buf, "1") == 0 || strcmp(buf, "true") == 0)
            migrate = true;
        else if (strcmp(buf, "0") != 0 && strcmp(buf, "false") != 0) {
            respond_error(req, 400,
                          "query parameter migrate: expected 1/true or 0/false, got \"%s\"", buf);
            return false;
        }
    }
    uint32_t timeout_ms = admin->opts.drain_wait_timeout_ms;
    if (duet_http_request_query_param(req, "timeout_s", buf, sizeof(buf))) {
        char *end = NULL;
        double s = strtod(buf, &end);
        double max_s = admin->opts.max_drain_wait_timeout_ms / 1000.0;
        if (end == buf || *end != '\0' || !(s > 0) || s > max_s) {
            respond_error(req, 400,
                          "query parameter timeout_s: expected seconds in (0, %.0f], "
                          "got \"%s\"",
                          max_s, buf);
            return false;
        }
        timeout_ms = (uint32_t)(s * 1000.0);
        if (timeout_ms == 0)
            timeout_ms = 1;
    }

    const duet_admin_ops_t *ops = admin->opts.ops;
    if (!wait) {
        duet_error_clear();
        duet_status_t st = ops->drain(admin->opts.ops_ctx, name, migrate, NULL, NULL);
        if (st < 0) {
            if (st == DUET_ERR_NOT_FOUND)
                respond_error(req, 404, "unknown worker \"%s\"", name);
            else
                respond_error(req, 409, "cannot drain worker %s: %s", name,
                              duet_error_last()[0] != '\0' ? duet_error_last()
                                                           : duet_status_str(st));
            return false;
        }
        find_worker_t f = {.name = name};
        ops->list_workers(admin->opts.ops_ctx, find_worker, &f);
        DUET_RLOG_INFO(duet_http_request_id(req), "admin: drain worker %s (from %s)", name,
                       duet_http_request_peer(req));
        json_t *o = json_pack("{s:s,s:s,s:b,s:b}", "worker", name, "state", "draining", "idle",
                              f.found && f.info.running == 0, "migrate", migrate);
        respond_json(req, 200, o, NULL, 0);
        return false;
    }

    admin_waiter_t *w = calloc(1, sizeof(*w));
    if (w == NULL) {
        respond_error(req, 500, "out of memory");
        return false;
    }
    w->admin = admin;
    w->req = NULL; /* set once we keep the request */
    snprintf(w->name, sizeof(w->name), "%s", name);
    w->started_ms = uv_now(admin->loop);
    w->timeout_ms = timeout_ms;
    uv_timer_init(admin->loop, &w->timer);
    w->timer.data = w;
    admin->open_handles++;
    w->next = admin->waiters;
    if (admin->waiters != NULL)
        admin->waiters->prev = w;
    admin->waiters = w;
    w->req = req; /* from here the waiter owns the caller's reference */
    duet_http_request_set_data(req, w);

    DUET_RLOG_INFO(duet_http_request_id(req),
                   "admin: drain worker %s and wait up to %u ms (from %s)", name, timeout_ms,
                   duet_http_request_peer(req));
    w->registered = true;
    w->in_drain = true;
    duet_error_clear();
    duet_status_t st = ops->drain(admin->opts.ops_ctx, name, migrate, waiter_on_done, w);
    w->in_drain = false;
    if (st < 0) {
        w->registered = false; /* the router keeps nothing on failure */
        if (st == DUET_ERR_NOT_FOUND)
            respond_error(req, 404, "unknown worker \"%s\"", name);
        else
            respond_error(req, status_to_http(st), "cannot drain worker %s: %s", name,
                          duet_error_last()[0] != '\0' ? duet_error_last() : duet_status_str(st));
        waiter_finish(w);
        return true;
    }
    if (!w->registered) { /* done_cb ran inside drain: already answered */
        waiter_finish(w);
        return true;
    }
    uv_timer_start(&w->timer, waiter_on_timeout, timeout_ms, 0);
    return true;
}

static void handle_undrain(duet_admin_t *admin, duet_http_request_t *req, const char *name)
{
    duet_error_clear();
    duet_status_t st = admin->opts.ops->undrain(admin->opts.ops_ctx, name);
    if (st == DUET_ERR_NOT_FOUND) {
        respond_error(req, 404, "unknown worker \"%s\"", name);
        return;
    }
    if (st < 0) {
        respond_error(req, 409, "cannot undrain worker %s: %s", name,
                      duet_error_last()[0] != '\0' ? duet_error_last() : duet_status_str(st));
        return;
    }
    DUET_RLOG_INFO(duet_http_request_id(req), "admin: undrain worker %s (from %s)", name,
                   duet_http_request_peer(req));
    respond_json(req, 200, json_pack("{s:s,s:s}", "worker", name, "state", "live"), NULL, 0);
}

static void admission_changed(duet_admin_t *admin)
{
    if (admin->opts.ops->admission_changed != NULL)
        admin->opts.ops->admission_changed(admin->opts.ops_ctx);
}

static void handle_admission_set(duet_admin_t *admin, duet_http_request_t *req)
{
    size_t len = 0;
    const char *body = duet_http_request_body(req, &len);
    json_t *root = NULL;
    duet_status_t st = duet_json_load_buffer(body, len, "request body", ADMIN_MAX_BODY, &root);
    if (st < 0) {
        respond_error(req, 400, "bad JSON: %s", duet_error_last());
        return;
    }
    if (!json_is_object(root)) {
        respond_error(req, 400, "request body: expected a JSON object, got %s",
                      duet_json_type_name(root));
        json_decref(root);
        return;
    }
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val)
    {
        if (strcmp(key, "max_inflight") != 0 && strcmp(key, "max_queue") != 0) {
            respond_error(req, 400,
                          "request body: unknown field \"%.100s\" (expected max_inflight, "
                          "max_queue)",
                          key);
            json_decref(root);
            return;
        }
    }
    duet_admission_stats_t s;
    duet_admission_stats(admin->opts.admission, &s);
    int64_t mi = 0, mq = 0;
    st = duet_json_get_int_opt(root, "request body", "max_inflight", 1, DUET_ADMISSION_MAX_INFLIGHT,
                               -1, &mi);
    if (st == DUET_OK)
        st = duet_json_get_int_opt(root, "request body", "max_queue", 0, DUET_ADMISSION_MAX_QUEUE,
                                   -1, &mq);
    if (st < 0) {
        respond_error(req, 400, "%s", duet_error_last());
        json_decref(root);
        return;
    }
    json_decref(root);
    if (mi < 0 && mq < 0) {
        respond_error(req, 400,
                      "request body: nothing to set (give max_inflight and/or max_queue)");
        return;
    }
    uint32_t new_mi = mi < 0 ? s.max_inflight : (uint32_t)mi;
    uint32_t new_mq = mq < 0 ? s.max_queue : (uint32_t)mq;
    st = duet_admission_set_limits(admin->opts.admission, new_mi, new_mq);
    if (st < 0) {
        respond_error(req, st == DUET_ERR_RANGE ? 400 : 500, "%s", duet_error_last());
        return;
    }
    DUET_RLOG_INFO(duet_http_request_id(req),
                   "admin: admission limits max_inflight %u max_queue %u (from %s)", new_mi, new_mq,
                   duet_http_request_peer(req));
    admission_changed(admin);
    respond_json(req, 200, admission_json(admin->opts.admission), NULL, 0);
}

/* POST /admin/log-level {"level": "debug"}: the router's level now, then its workers'. */
static void handle_log_level_set(duet_admin_t *admin, duet_http_request_t *req)
{
    size_t len = 0;
    const char *body = duet_http_request_body(req, &len);
    json_t *root = NULL;
    if (duet_json_load_buffer(body, len, "request body", ADMIN_MAX_BODY, &root) < 0) {
        respond_error(req, 400, "bad JSON: %s", duet_error_last());
        return;
    }
    json_t *lv = json_object_get(root, "level");
    duet_log_level_t level;
    if (!json_is_object(root) || json_object_size(root) != 1 || !json_is_string(lv) ||
        duet_log_level_parse(json_string_value(lv), &level) != DUET_OK) {
        respond_error(req, 400,
                      "request body: expected {\"level\": \"error|warn|info|debug|trace\"} and "
                      "no other field");
        json_decref(root);
        return;
    }
    json_decref(root);
    const duet_log_level_t previous = duet_log_level();
    duet_log_set_level(level);
    size_t told = 0;
    if (admin->opts.ops->log_level_changed != NULL)
        told = admin->opts.ops->log_level_changed(admin->opts.ops_ctx, level);
    /* at warn, so that the change shows at any level it leaves */
    DUET_RLOG_WARN(duet_http_request_id(req),
                   "admin: log level %s -> %s (from %s; %zu workers told)",
                   duet_log_level_name(previous), duet_log_level_name(level),
                   duet_http_request_peer(req), told);
    respond_json(req, 200,
                 json_pack("{s:s,s:s,s:I}", "level", duet_log_level_name(level), "previous",
                           duet_log_level_name(previous), "workers", (json_int_t)told),
                 NULL, 0);
}

/* Percent-decode one path segment into out (cap bytes); false for bad or unsafe names. */
static bool decode_name(const char *s, size_t n, char *out, size_t cap)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '%') {
            int hi = i + 2 < n ? duet_hex_digit((unsigned char)s[i + 1]) : -1;
            int lo = i + 2 < n ? duet_hex_digit((unsigned char)s[i + 2]) : -1;
            if (hi < 0 || lo < 0)
                return false;
            c = (unsigned char)(hi * 16 + lo);
            i += 2;
        }
        if (c <= 0x20 || c >= 0x7f || c == '/') /* names are printable ASCII */
            return false;
        if (k + 1 >= cap)
            return false;
        out[k++] = (char)c;
    }
    out[k] = '\0';
    return k > 0;
}

/* Answer req; true when a drain waiter kept the request (it releases it later). */
static bool route(duet_admin_t *admin, duet_http_request_t *req)
{
    const char *method = duet_http_request_method(req);
    const char *path = duet_http_request_path(req);
    bool get = strcmp(method, "GET") == 0 || strcmp(method, "HEAD") == 0;
    bool post = strcmp(method, "POST") == 0;

    if (strcmp(path, "/admin/workers") == 0 || strcmp(path, "/admin/workers/") == 0) {
        if (!get) {
            respond_405(req, "GET");
            return false;
        }
        json_t *arr = json_array();
        admin->opts.ops->list_workers(admin->opts.ops_ctx, add_worker, arr);
        respond_json(req, 200, json_pack("{s:o}", "workers", arr), NULL, 0);
        return false;
    }
    if (strncmp(path, WORKERS_PREFIX, strlen(WORKERS_PREFIX)) == 0) {
        const char *seg = path + strlen(WORKERS_PREFIX);
        const char *slash = strchr(seg, '/');
        const char *action = slash != NULL ? slash + 1 : "";
        bool drain = strcmp(action, "drain") == 0, undrain = strcmp(action, "undrain") == 0;
        if (slash == NULL || (!drain && !undrain)) {
            respond_error(req, 404,
                          "no such admin endpoint: %s (try POST %s<name>/drain or "
                          "/undrain)",
                          path, WORKERS_PREFIX);
            return false;
        }
        if (!post) {
            respond_405(req, "POST");
            return false;
        }
        char name[ADMIN_MAX_NAME];
        if (!decode_name(seg, (size_t)(slash - seg), name, sizeof(name))) {
            respond_error(req, 400, "bad worker name in %s", path);
            return false;
        }
        if (drain)
            return handle_drain(admin, req, name);
        handle_undrain(admin, req, name);
        return false;
    }
    if (strcmp(path, "/admin/admission") == 0) {
        if (get)
            respond_json(req, 200, admission_json(admin->opts.admission), NULL, 0);
        else if (post)
            handle_admission_set(admin, req);
        else
            respond_405(req, "GET, POST");
        return false;
    }
    if (strcmp(path, "/admin/log-level") == 0) {
        if (get)
            respond_json(req, 200,
                         json_pack("{s:s}", "level", duet_log_level_name(duet_log_level())), NULL,
                         0);
        else if (post)
            handle_log_level_set(admin, req);
        else
            respond_405(req, "GET, POST");
        return false;
    }
    if (strcmp(path, "/admin/admission/pause") == 0 ||
        strcmp(path, "/admin/admission/resume") == 0) {
        if (!post) {
            respond_405(req, "POST");
            return false;
        }
        bool pause = strcmp(path, "/admin/admission/pause") == 0;
        if (pause)
            duet_admission_pause(admin->opts.admission);
        else
            duet_admission_resume(admin->opts.admission);
        DUET_RLOG_INFO(duet_http_request_id(req), "admin: admission %s (from %s)",
                       pause ? "paused" : "resumed", duet_http_request_peer(req));
        if (!pause)
            admission_changed(admin);
        respond_json(req, 200, admission_json(admin->opts.admission), NULL, 0);
        return false;
    }
    respond_error(req, 404, "no such admin endpoint: %s", path);
    return false;
}

static void on_request(duet_http_request_t *req, void *user)
{
    duet_admin_t *admin = user;
    bool kept = false;
    if (admin->closing)
        respond_error(req, 503, "admin API is shutting down");
    else if (authorized(admin, req))
        kept = route(admin, req);
    if (!kept)
        duet_http_request_release(req);
}

static void on_abort(duet_http_request_t *req, void *user)
{
    admin_waiter_t *w = duet_http_request_get_data(req);
    if (w != NULL) {
        DUET_RLOG_INFO(duet_http_request_id(req),
                       "admin: client gone while waiting for %s to drain", w->name);
        waiter_finish(w);
    }
}

static const char *path_class(const char *path, void *user)
{
    if (strncmp(path, WORKERS_PREFIX, strlen(WORKERS_PREFIX)) == 0)
        return "/admin/workers/*";
    static const char *const known[] = {"/admin/workers", "/admin/admission",
                                        "/admin/admission/pause", "/admin/admission/resume",
                                        "/admin/log-level"};
    for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++)
        if (strcmp(path, known[i]) == 0)
            return known[i];
    return "other";
}

/* duet_admin_start, or with `fake_out` its test seam (see duet__admin_start_fake). */
static duet_status_t admin_start(uv_loop_t *loop, const duet_admin_options_t *opts,
                                 duet_strbuf_t *fake_out, duet_admin_t **admin_p)
{
    const duet_admin_ops_t *ops = opts->ops;
    if (ops == NULL || ops->list_workers == NULL || ops->drain == NULL ||
        ops->drain_forget == NULL || ops->undrain == NULL)
        return DUET_FAIL(DUET_ERR_INVALID, "admin API: the router's ops table is incomplete");
    if (opts->admission == NULL)
        return DUET_FAIL(DUET_ERR_INVALID, "admin API: no admission controller");
    bool no_token = opts->token == NULL || opts->token[0] == '\0';
    if (no_token && !opts->insecure_no_token)
        return DUET_FAIL(DUET_ERR_INVALID,
                         "admin API: refusing to start without a token: set admin.token (or "
                         "DUET_ADMIN_TOKEN), or pass --admin.insecure-no-token to run it "
                         "unauthenticated");
    if (opts->drain_wait_timeout_ms == 0 || opts->max_drain_wait_timeout_ms == 0)
        return DUET_FAIL(DUET_ERR_INVALID, "admin API: drain wait timeouts must be > 0");

    duet_admin_t *admin = calloc(1, sizeof(*admin));
    if (admin == NULL)
        return DUET_FAIL(DUET_ERR_NOMEM, "admin API: out of memory");
    admin->loop = loop;
    admin->opts = *opts;
    admin->opts.token = NULL;
    if (!no_token) {
        admin->token = strdup(opts->token);
        if (admin->token == NULL) {
            free(admin);
            return DUET_FAIL(DUET_ERR_NOMEM, "admin API: out of memory");
        }
        admin->token_len = strlen(admin->token);
    } else {
        DUET_LOG_WARN("admin API runs WITHOUT a token (--admin.insecure-no-token): anyone who "
                      "can reach %s:%u can drain workers and pause admission",
                      opts->host != NULL ? opts->host : "127.0.0.1", opts->port);
    }

    duet_http_options_t ho;
    duet_http_options_default(&ho);
    if (opts->host != NULL)
        ho.host = opts->host;
    ho.port = opts->port;
    ho.max_body_bytes = ADMIN_MAX_BODY;
    ho.max_connections = 64;
    /* A drain wait may last up to the cap; the idle timer must not cut it. */
    ho.idle_timeout_ms = opts->max_drain_wait_timeout_ms + 60 * 1000;
    ho.shutdown_grace_ms = 2000;
    ho.on_request = on_request;
    ho.on_abort = on_abort;
    ho.user = admin;
    ho.path_class = path_class;
    duet_status_t st = fake_out != NULL
                           ? duet__http_server_start_fake(loop, &ho, fake_out, &admin->srv)
                           : duet_http_server_start(loop, &ho, &admin->srv);
    if (st < 0) {
        DUET_LOG_ERROR("admin API: %s", duet_error_last());
        free(admin->token);
        free(admin);
        return st;
    }
    admin->open_handles = 1; /* the server */
    DUET_LOG_INFO("admin API listening on %s:%u%s", ho.host, duet_http_server_port(admin->srv),
                  admin->token == NULL ? " (no token)" : "");
    *admin_p = admin;
    return DUET_OK;
}

duet_status_t duet_admin_start(uv_loop_t *loop, const duet_admin_options_t *opts,
                               duet_admin_t **admin_p)
{
    return admin_start(loop, opts, NULL, admin_p);
}

duet_status_t duet__admin_start_fake(uv_loop_t *loop, const duet_admin_options_t *opts,
                                     duet_strbuf_t *out, duet_admin_t **admin_p)
{
    if (out == NULL)
        return DUET_FAIL(DUET_ERR_INVALID, "admin API: the fake needs an output buffer");
    return admin_start(loop, opts, out, admin_p);
}

bool duet__admin_feed(duet_admin_t *admin, const char *data, size_t len)
{
    return duet__http_server_feed(admin->srv, data, len);
}

uint16_t duet_admin_port(const duet_admin_t *admin)
{
    return duet_http_server_port(admin->srv);
}

static void on_server_closed(void *user)
{
    admin_handle_closed(user);
}

void duet_admin_close(duet_admin_t *admin, void (*cb)(void *user), void *user)
{
    DUET_ASSERT(!admin->closing);
    admin->closing = true;
    admin->close_cb = cb;
    admin->close_user = user;
    while (admin->waiters != NULL) {
        admin_waiter_t *w = admin->waiters;
        respond_error(w->req, 503, "admin API is shutting down; worker %s stays draining", w->name);
        waiter_finish(w);
    }
    duet_http_server_close(admin->srv, on_server_closed, admin);
}

/* ------------------------------------------------------------------ the admin file */

bool duet_admin_file_path(char *out, size_t cap)
{
    const char *f = getenv("DUET_ADMIN_FILE"), *home = getenv("HOME");
    if (f != NULL && f[0] != '\0')
        return (size_t)snprintf(out, cap, "%s", f) < cap;
    if (home != NULL && home[0] != '\0')
        return (size_t)snprintf(out, cap, "%s/.duet/admin", home) < cap;
    return false;
}

duet_status_t duet_admin_file_write(const char *path, const char *url, const char *token)
{
    char dir[4096];
    snprintf(dir, sizeof(dir), "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash != NULL && slash != dir) {
        *slash = '\0';
        if (mkdir(dir, 0700) != 0 && errno != EEXIST)
            return duet_error_set(DUET_ERR_IO, "%s: %s", dir, strerror(errno));
    }
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0)
        return duet_error_set(DUET_ERR_IO, "%s: %s", path, strerror(errno));
    (void)fchmod(fd, 0600); /* an older file of wider mode */
    char text[1024];
    int n = snprintf(text, sizeof(text), "url=%s\ntoken=%s\n", url, token);
    bool ok = n > 0 && (size_t)n < sizeof(text) && write(fd, text, (size_t)n) == n;
    close(fd);
    return ok ? DUET_OK : duet_error_set(DUET_ERR_IO, "%s: write failed", path);
}

duet_status_t duet_admin_file_read(const char *path, char *url, size_t url_cap, char *token,
                                   size_t token_cap)
{
    url[0] = token[0] = '\0';
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return duet_error_set(DUET_ERR_IO, "%s: %s", path, strerror(errno));
    char text[4097];
    size_t n = fread(text, 1, sizeof(text) - 1, f);
    fclose(f);
    if (n == sizeof(text) - 1)
        return duet_error_set(DUET_ERR_FORMAT, "%s: larger than 4 KiB", path);
    text[n] = '\0';
    int lineno = 0;
    for (char *line = text, *next; line != NULL && *line != '\0'; line = next) {
        lineno++;
        next = strchr(line, '\n');
        if (next != NULL)
            *next++ = '\0';
        char *out = strncmp(line, "url=", 4) == 0     ? url
                    : strncmp(line, "token=", 6) == 0 ? token
                                                      : NULL;
        const size_t cap = out == url ? url_cap : token_cap;
        const char *v = out == url ? line + 4 : line + 6;
        if (out == NULL)
            return duet_error_set(DUET_ERR_FORMAT, "%s:%d: expected url=... or token=...", path,
                                  lineno);
        for (const char *p = v; *p != '\0'; p++)
            if ((unsigned char)*p < 0x20 || *p == 0x7f)
                return duet_error_set(DUET_ERR_FORMAT, "%s:%d: a control character", path, lineno);
        if (strlen(v) >= cap)
            return duet_error_set(DUET_ERR_FORMAT, "%s:%d: value too long", path, lineno);
        memcpy(out, v, strlen(v) + 1);
    }
    return DUET_OK;
}
