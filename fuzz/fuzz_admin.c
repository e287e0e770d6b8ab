/*
 * Fuzz target: the router's admin API as an operator's client reaches it (router/cluster/admin.c
 * on the HTTP server's socketless fake, duet__admin_start_fake): request line, path (worker names
 * percent-decoded), query (wait, migrate, timeout_s), Authorization header and JSON bodies, with
 * a fake worker table (a generation worker with running requests, an idle context worker, a dead
 * one) and a real admission controller.
 *
 * Input: a control byte (bit 0: run without a token, else the token is "fuzz-token"; bits 1-3:
 * whether held drain waits finish between reads, and how), a byte seeding the read sizes, then
 * the bytes the client sends; the client's EOF follows them.
 * Checked besides no crash / sanitizer report / hang:
 *  - what the admin wrote is a valid stream of HTTP responses; every application/json body is
 *    JSON, an error body is {"error": {"code": <its status>, "message": "..."}}, and statuses are
 *    the documented ones;
 *  - authentication: with a token, an input that never spells it changes nothing (no drain,
 *    undrain or admission change reaches the router), and every answer is a 401 or a server
 *    error answer;
 *  - the router's drain contract: done callbacks are never called for a forgotten waiter, every
 *    waiter is finished by close;
 *  - admission limits stay within their bounds.
 */
#include "fuzz/fuzz.h"
#include "fuzz/fuzz_loop.h"
#include "fuzz/http_check.h"

#include <jansson.h>
#include <uv.h>

#include "common/status.h"
#include "common/strbuf.h"
#include "router/cluster/admin.h"
#include "router/cluster/admission.h"

#define TOKEN     "fuzz-token"
#define N_WORKERS 3
#define MAX_WAITS 64

typedef struct {
    const char *name, *role;
    duet_admin_worker_state_t state;
    int64_t running;
} worker_t;

typedef struct {
    worker_t w[N_WORKERS];
    duet_admin_drain_done_cb done_cb[MAX_WAITS];
    void *done_user[MAX_WAITS];
    size_t n_waits;
    size_t changes; /* drains, undrains, admission changes that reached the router */
} fake_t;

static worker_t *find(fake_t *f, const char *name)
{
    for (int i = 0; i < N_WORKERS; i++)
        if (strcmp(f->w[i].name, name) == 0)
            return &f->w[i];
    return NULL;
}

static void op_list(void *ctx, duet_admin_worker_visit_cb visit, void *visit_user)
{
    fake_t *f = ctx;
    for (int i = 0; i < N_WORKERS; i++) {
        const duet_admin_worker_info_t info = {.id = (uint64_t)i + 1,
                                               .name = f->w[i].name,
                                               .role = f->w[i].role,
                                               .state = f->w[i].state,
                                               .free_pages = 10,
                                               .running = f->w[i].running,
                                               .queued = 0};
        visit(&info, visit_user);
    }
}

static duet_status_t op_drain(void *ctx, const char *name, bool migrate,
                              duet_admin_drain_done_cb done_cb, void *done_user)
{
    fake_t *f = ctx;
    FUZZ_CHECK(name != NULL && name[0] != '\0' && strchr(name, '/') == NULL,
               "drain of a bad name \"%s\"", name);
    worker_t *w = find(f, name);
    if (w == NULL)
        return DUET_ERR_NOT_FOUND;
    if (w->state == DUET_ADMIN_WORKER_DEAD)
        return duet_error_set(DUET_ERR_INVALID, "worker %s is dead", name);
    if (migrate && strcmp(w->role, "gen") != 0)
        return duet_error_set(DUET_ERR_INVALID, "worker %s is not a generation worker", name);
    f->changes++;
    w->state = DUET_ADMIN_WORKER_DRAINING;
    if (done_cb != NULL) {
        if (w->running == 0 || f->n_waits == MAX_WAITS)
            done_cb(done_user, DUET_OK, NULL); /* already idle: answered from inside drain */
        else {
            f->done_cb[f->n_waits] = done_cb;
            f->done_user[f->n_waits++] = done_user;
        }
    }
    return DUET_OK;
}

static void op_forget(void *ctx, void *done_user)
{
    fake_t *f = ctx;
    for (size_t i = 0; i < f->n_waits; i++)
        if (f->done_user[i] == done_user) {
            f->done_cb[i] = f->done_cb[--f->n_waits];
            f->done_user[i] = f->done_user[f->n_waits];
            return;
        }
}

static duet_status_t op_undrain(void *ctx, const char *name)
{
    fake_t *f = ctx;
    worker_t *w = find(f, name);
    if (w == NULL)
        return DUET_ERR_NOT_FOUND;
    if (w->state == DUET_ADMIN_WORKER_DEAD)
        return duet_error_set(DUET_ERR_INVALID, "worker %s is dead", name);
    f->changes++;
    w->state = DUET_ADMIN_WORKER_LIVE;
    return DUET_OK;
}

static void op_changed(void *ctx)
{
    ((fake_t *)ctx)->changes++;
}

/* Finish the waits the router holds: all done (OK), or all failed (undrained). */
static void finish_waits(fake_t *f, bool ok)
{
    while (f->n_waits > 0) {
        size_t i = --f->n_waits;
        f->done_cb[i](f->done_user[i], ok ? DUET_OK : DUET_ERR_CANCELLED, ok ? NULL : "undrained");
    }
}

typedef struct {
    bool token_mode, token_seen;
    size_t n_401;
} seen_t;

static void on_response(void *user, size_t k, int status, const char *ctype, const char *body,
                        size_t len)
{
    seen_t *s = user;
    FUZZ_CHECK(status == 200 || status == 400 || status == 401 || status == 404 || status == 405 ||
                   status == 408 || status == 409 || status == 413 || status == 414 ||
                   status == 431 || status == 500 || status == 501 || status == 503 ||
                   status == 504 || status == 505,
               "response %zu: status %d", k, status);
    s->n_401 += status == 401;
    if (s->token_mode && !s->token_seen)
        FUZZ_CHECK(status == 401 || strcmp(ctype, "text/plain") == 0,
                   "response %zu: %d without the token", k, status);
    if (strcmp(ctype, "application/json") != 0)
        return;
    json_error_t e;
    json_t *j = json_loadb(body, len, 0, &e);
    FUZZ_CHECK(j != NULL, "response %zu: body is not JSON: %s", k, e.text);
    if (status >= 400) {
        json_t *err = json_object_get(j, "error");
        FUZZ_CHECK(json_is_object(err) &&
                       json_integer_value(json_object_get(err, "code")) == status &&
                       json_is_string(json_object_get(err, "message")),
                   "response %zu: error body", k);
    }
    json_decref(j);
}

static bool has(const uint8_t *p, size_t n, const char *s)
{
    size_t l = strlen(s);
    for (size_t i = 0; i + l <= n; i++)
        if (memcmp(p + i, s, l) == 0)
            return true;
    return false;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_quiet();
    uv_loop_t *loop = fuzz_loop();
    fuzz_in_t in = {data, size};
    uint8_t ctl = fuzz_byte(&in);
    uint32_t rng = fuzz_byte(&in) * 2654435761u + 3;
    fake_t fake = {.w = {{"gen-0", "gen", DUET_ADMIN_WORKER_LIVE, 2},
                         {"ctx-0", "ctx", DUET_ADMIN_WORKER_LIVE, 0},
                         {"gen-1", "gen", DUET_ADMIN_WORKER_DEAD, 0}}};
    const duet_admin_ops_t ops = {.list_workers = op_list,
                                  .drain = op_drain,
                                  .drain_forget = op_forget,
                                  .undrain = op_undrain,
                                  .admission_changed = op_changed};
    duet_admission_options_t ao;
    duet_admission_options_default(&ao);
    duet_admission_t *adm = NULL;
    FUZZ_CHECK(duet_admission_create(&ao, &adm) == DUET_OK, "admission");
    duet_admission_stats_t before;
    duet_admission_stats(adm, &before);

    duet_admin_options_t o;
    duet_admin_options_default(&o);
    const bool token_mode = (ctl & 1) == 0;
    o.token = token_mode ? TOKEN : NULL;
    o.insecure_no_token = !token_mode;
    o.drain_wait_timeout_ms = 1000;
    o.max_drain_wait_timeout_ms = 5000;
    o.ops = &ops;
    o.ops_ctx = &fake;
    o.admission = adm;
    duet_strbuf_t out;
    duet_strbuf_init(&out);
    duet_admin_t *admin = NULL;
    FUZZ_CHECK(duet__admin_start_fake(loop, &o, &out, &admin) == DUET_OK, "start: %s",
               duet_error_last());
    const uint8_t *stream = in.p;
    const size_t stream_len = in.n;
    while (in.n > 0) {
        rng = rng * 1103515245u + 12345u;
        size_t chunk = 1 + (rng >> 16) % 512, len;
        const uint8_t *p = fuzz_take(&in, chunk, &len);
        bool took = duet__admin_feed(admin, (const char *)p, len);
        uv_run(loop, UV_RUN_NOWAIT);
        if ((ctl >> 1) & 1)
            finish_waits(&fake, (ctl >> 2) & 1);
        if (!took) {
            finish_waits(&fake, true);
            uv_run(loop, UV_RUN_NOWAIT);
            if (!duet__admin_feed(admin, (const char *)p, len))
                break;
            uv_run(loop, UV_RUN_NOWAIT);
        }
    }
    (void)duet__admin_feed(admin, "", 0);
    uv_run(loop, UV_RUN_NOWAIT);
    bool closed = false;
    duet_admin_close(admin, fuzz_on_closed, &closed);
    while (!closed)
        uv_run(loop, UV_RUN_ONCE);
    FUZZ_CHECK(fake.n_waits == 0, "%zu waits not forgotten at close", fake.n_waits);

    seen_t seen = {.token_mode = token_mode, .token_seen = has(stream, stream_len, TOKEN)};
    if (!has(stream, stream_len, "HEAD")) { /* a HEAD answer has no body: the parser must know */
        const fuzz_http_resp_cb_t cb = {.on_response = on_response, .user = &seen};
        (void)fuzz_http_check_responses(out.data, out.len, &cb);
    }
    duet_admission_stats_t after;
    duet_admission_stats(adm, &after);
    if (token_mode && !seen.token_seen) {
        FUZZ_CHECK(fake.changes == 0, "%zu changes without the token", fake.changes);
        FUZZ_CHECK(after.paused == before.paused && after.max_inflight == before.max_inflight &&
                       after.max_queue == before.max_queue,
                   "admission changed without the token");
    }
    FUZZ_CHECK(after.max_inflight >= 1 && after.max_inflight <= DUET_ADMISSION_MAX_INFLIGHT &&
                   after.max_queue <= DUET_ADMISSION_MAX_QUEUE,
               "admission limits %u %u", after.max_inflight, after.max_queue);
    duet_strbuf_free(&out);
    duet_admission_destroy(adm);
    return 0;
}
