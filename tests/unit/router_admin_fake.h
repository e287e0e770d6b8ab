/*
 * Test support for the admin API (router/cluster/admin.h): a FAKE ops table standing in for the
 * router's worker registry (a fixed array of workers whose load the test sets), and a harness that
 * runs the admin server with a real admission controller on a uv loop in a second thread.
 * Test-thread changes to the fake go through uv_async so that every op runs on the loop thread, as
 * in the router. Header-only (static functions): included by test_router_admin.c and
 * test_duetctl.c.
 */
#ifndef DUET_TESTS_ROUTER_ADMIN_FAKE_H
#define DUET_TESTS_ROUTER_ADMIN_FAKE_H

#include <criterion/criterion.h>

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "common/log.h"
#include "router/cluster/admin.h"
#include "router/cluster/admission.h"

#define FAKE_MAX_WORKERS 4

typedef struct {
    char name[32];
    char role[8];
    duet_admin_worker_state_t state;
    int64_t free_pages, running, queued;
    duet_admin_drain_done_cb done_cb; /* a pending drain wait, NULL when none */
    void *done_user;
} fake_worker_t;

typedef struct {
    fake_worker_t w[FAKE_MAX_WORKERS];
    int n;
    atomic_int drains, undrains, forgets, changed, migrates, log_levels;
} fake_registry_t;

static fake_worker_t *fake_find(fake_registry_t *f, const char *name)
{
    for (int i = 0; i < f->n; i++)
        if (strcmp(f->w[i].name, name) == 0)
            return &f->w[i];
    return NULL;
}

static void fake_list(void *ctx, duet_admin_worker_visit_cb visit, void *visit_user)
{
    fake_registry_t *f = ctx;
    for (int i = 0; i < f->n; i++) {
        char address[32];
        snprintf(address, sizeof(address), "127.0.0.1:4000%d", i + 1);
        duet_admin_worker_info_t info = {
            .id = (uint64_t)i + 1,
            .name = f->w[i].name,
            .role = f->w[i].role,
            .state = f->w[i].state,
            .free_pages = f->w[i].free_pages,
            .kv_pages = 4096, /* every fake worker's pool; slots: 16, as many free as not running */
            .free_state_slots = 16 - f->w[i].running,
            .state_slots = 16,
            .running = f->w[i].running,
            .queued = f->w[i].queued,
            .prefix_pages = 7 * i, /* worker i's prefix cache: 7i pages in 2i entries */
            .prefix_entries = 2 * i,
            /* operators' figures: worker i was up 3725 + i s, heard from 300 ms ago, busy half
             * the time */
            .address = address,
            .device = "cpu",
            .dtype = "f32",
            .uptime_s = 3725 + i,
            .heartbeat_age_ms = 300,
            .utilisation = 0.5,
            .metrics_port = 9100 + i,
        };
        visit(&info, visit_user);
    }
}

static duet_status_t fake_drain(void *ctx, const char *name, bool migrate,
                                duet_admin_drain_done_cb done_cb, void *done_user)
{
    fake_registry_t *f = ctx;
    fake_worker_t *w = fake_find(f, name);
    if (w == NULL)
        return DUET_ERR_NOT_FOUND;
    if (w->state == DUET_ADMIN_WORKER_DEAD)
        return duet_error_set(DUET_ERR_INVALID, "worker %s is dead", name);
    if (migrate && strcmp(w->role, "gen") != 0)
        return duet_error_set(DUET_ERR_INVALID, "worker %s is not a generation worker", name);
    atomic_fetch_add(&f->drains, 1);
    atomic_fetch_add(&f->migrates, migrate ? 1 : 0);
    w->state = DUET_ADMIN_WORKER_DRAINING;
    if (done_cb != NULL) {
        if (w->running == 0) {
            done_cb(done_user, DUET_OK, NULL); /* already idle: synchronous, as allowed */
        } else {
            cr_assert_null(w->done_cb, "fake supports one waiter per worker");
            w->done_cb = done_cb;
            w->done_user = done_user;
        }
    }
    return DUET_OK;
}

static void fake_forget(void *ctx, void *done_user)
{
    fake_registry_t *f = ctx;
    for (int i = 0; i < f->n; i++) {
        if (f->w[i].done_user == done_user && f->w[i].done_cb != NULL) {
            f->w[i].done_cb = NULL;
            f->w[i].done_user = NULL;
        }
    }
    atomic_fetch_add(&f->forgets, 1);
}

static duet_status_t fake_undrain(void *ctx, const char *name)
{
    fake_registry_t *f = ctx;
    fake_worker_t *w = fake_find(f, name);
    if (w == NULL)
        return DUET_ERR_NOT_FOUND;
    if (w->state == DUET_ADMIN_WORKER_DEAD)
        return duet_error_set(DUET_ERR_INVALID, "worker %s is dead", name);
    atomic_fetch_add(&f->undrains, 1);
    w->state = DUET_ADMIN_WORKER_LIVE;
    if (w->done_cb != NULL) {
        duet_admin_drain_done_cb cb = w->done_cb;
        w->done_cb = NULL;
        cb(w->done_user, DUET_ERR_CANCELLED, "worker was undrained");
    }
    return DUET_OK;
}

static void fake_changed(void *ctx)
{
    fake_registry_t *f = ctx;
    atomic_fetch_add(&f->changed, 1);
}

/* Counts the calls; "tells" the two live workers. */
static size_t fake_log_level(void *ctx, duet_log_level_t level)
{
    fake_registry_t *f = ctx;
    atomic_fetch_add(&f->log_levels, 1);
    return 2;
}

static const duet_admin_ops_t fake_ops = {
    .list_workers = fake_list,
    .drain = fake_drain,
    .drain_forget = fake_forget,
    .undrain = fake_undrain,
    .admission_changed = fake_changed,
    .log_level_changed = fake_log_level,
};

/* ------------------------------------------------------------------ admin server in a thread */

typedef struct {
    uv_loop_t loop;
    uv_async_t stop, poke;
    pthread_t thread;
    duet_admin_t *admin;
    duet_admission_t *adm;
    fake_registry_t fake;
    uint16_t port;
    atomic_int closed;
    char idle_name[32]; /* poke: this worker's running drops to 0 */
    pthread_mutex_t mu;
    bool running;
} admin_harness_t;

static admin_harness_t AH;

#define TEST_TOKEN "s3cret-token"

static void ah_on_closed(void *user)
{
    atomic_store(&AH.closed, 1);
}

static void ah_on_stop(uv_async_t *a)
{
    duet_admin_close(AH.admin, ah_on_closed, NULL);
    uv_close((uv_handle_t *)&AH.stop, NULL);
    uv_close((uv_handle_t *)&AH.poke, NULL);
}

/* Loop thread: the worker named in idle_name finished its requests; report a pending drain. */
static void ah_on_poke(uv_async_t *a)
{
    pthread_mutex_lock(&AH.mu);
    fake_worker_t *w = fake_find(&AH.fake, AH.idle_name);
    pthread_mutex_unlock(&AH.mu);
    if (w == NULL)
        return;
    w->running = 0;
    if (w->done_cb != NULL) {
        duet_admin_drain_done_cb cb = w->done_cb;
        w->done_cb = NULL;
        cb(w->done_user, DUET_OK, NULL);
    }
}

static void *ah_thread(void *arg)
{
    uv_run(&AH.loop, UV_RUN_DEFAULT);
    return NULL;
}

static void ah_add_worker(const char *name, const char *role, duet_admin_worker_state_t st,
                          int64_t free_pages, int64_t running, int64_t queued)
{
    fake_worker_t *w = &AH.fake.w[AH.fake.n++];
    snprintf(w->name, sizeof(w->name), "%s", name);
    snprintf(w->role, sizeof(w->role), "%s", role);
    w->state = st;
    w->free_pages = free_pages;
    w->running = running;
    w->queued = queued;
}

/* Start with three workers: gen-0 (busy), gen-1 (idle), ctx-0 (dead). */
static void ah_start_with(const char *token, bool insecure)
{
    memset(&AH, 0, sizeof(AH));
    duet_log_set_level(DUET_LOG_LEVEL_WARN);
    pthread_mutex_init(&AH.mu, NULL);
    cr_assert_eq(uv_loop_init(&AH.loop), 0);
    ah_add_worker("gen-0", "gen", DUET_ADMIN_WORKER_LIVE, 1024, 2, 1);
    ah_add_worker("gen-1", "gen", DUET_ADMIN_WORKER_LIVE, 2048, 0, 0);
    ah_add_worker("ctx-0", "ctx", DUET_ADMIN_WORKER_DEAD, 0, 0, 0);
    duet_admission_options_t ao;
    duet_admission_options_default(&ao);
    ao.max_inflight = 8;
    ao.max_queue = 16;
    ao.has_capacity = true;
    cr_assert_eq(duet_admission_create(&ao, &AH.adm), DUET_OK);
    duet_admin_options_t o;
    duet_admin_options_default(&o);
    o.port = 0;
    o.token = token;
    o.insecure_no_token = insecure;
    o.drain_wait_timeout_ms = 5000;
    o.ops = &fake_ops;
    o.ops_ctx = &AH.fake;
    o.admission = AH.adm;
    cr_assert_eq(duet_admin_start(&AH.loop, &o, &AH.admin), DUET_OK, "%s", duet_error_last());
    AH.port = duet_admin_port(AH.admin);
    cr_assert_eq(uv_async_init(&AH.loop, &AH.stop, ah_on_stop), 0);
    cr_assert_eq(uv_async_init(&AH.loop, &AH.poke, ah_on_poke), 0);
    cr_assert_eq(pthread_create(&AH.thread, NULL, ah_thread, NULL), 0);
    AH.running = true;
}

static void ah_start(void)
{
    ah_start_with(TEST_TOKEN, false);
}

/* From the test thread: worker `name` has no running requests any more. */
static void ah_make_idle(const char *name)
{
    pthread_mutex_lock(&AH.mu);
    snprintf(AH.idle_name, sizeof(AH.idle_name), "%s", name);
    pthread_mutex_unlock(&AH.mu);
    uv_async_send(&AH.poke);
}

static void ah_count_handle(uv_handle_t *h, void *arg)
{
    (*(int *)arg)++;
}

/* Close the admin API from its loop, join, and prove the loop closed clean. */
static void ah_stop(void)
{
    cr_assert(AH.running);
    AH.running = false;
    uv_async_send(&AH.stop);
    pthread_join(AH.thread, NULL);
    int n = 0;
    uv_walk(&AH.loop, ah_count_handle, &n);
    cr_assert_eq(n, 0, "%d handle(s) left open", n);
    cr_assert_eq(uv_loop_close(&AH.loop), 0);
    cr_assert_eq(atomic_load(&AH.closed), 1, "admin close callback not called");
    for (int i = 0; i < AH.fake.n; i++)
        cr_assert_null(AH.fake.w[i].done_cb, "a drain waiter was never forgotten");
    duet_admission_destroy(AH.adm);
    pthread_mutex_destroy(&AH.mu);
}

#endif
