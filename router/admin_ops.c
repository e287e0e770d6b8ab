/*
 * The admin API's operations over this router (router/cluster/admin.h knows nothing of the
 * registry; it calls this ops table): list the workers, drain (optionally moving its running
 * requests elsewhere: request.c's tick starts the moves) and undrain one by name, and
 * answer `drain --wait` callers once the router has no request in flight on the worker. A
 * request's end (request.c) and a worker's death check the waiters, since either can be what
 * they wait for.
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "proto/envelope.h"

#include "router/router_impl.h"

struct rt_drain_waiter {
    uint64_t worker_id;
    duet_admin_drain_done_cb cb;
    void *user;
    struct rt_drain_waiter *next;
};

typedef struct {
    duet_admin_worker_visit_cb visit;
    void *user;
    uint64_t now_ms, now_unix_ms; /* uv_now, the wall clock */
} rt_visit_t;

static void rt_visit_one(const duet_worker_info_t *w, void *user)
{
    rt_visit_t *v = user;
    /* uptime from the worker's own start when it said it (and the clocks agree), else since it
     * registered */
    const uint64_t up_ms = w->started_unix_ms != 0 && w->started_unix_ms <= v->now_unix_ms
                               ? v->now_unix_ms - w->started_unix_ms
                               : v->now_ms - w->registered_ms;
    duet_admin_worker_info_t a = {
        .id = w->id,
        .name = w->name,
        .role = duet_worker_role_name(w->role),
        .state = w->state == DUET_WORKER_STATE_UP         ? DUET_ADMIN_WORKER_LIVE
                 : w->state == DUET_WORKER_STATE_DRAINING ? DUET_ADMIN_WORKER_DRAINING
                                                          : DUET_ADMIN_WORKER_DEAD,
        .free_pages = w->free_pages,
        .kv_pages = w->kv_pages,
        .free_state_slots = w->free_state_slots,
        .state_slots = w->state_slots,
        .running = w->running,
        .queued = w->queued,
        .prefix_pages = w->prefix_pages,
        .prefix_entries = w->prefix_entries,
        .address = w->peer,
        .device = w->device,
        .dtype = w->dtype,
        .uptime_s = (int64_t)(up_ms / 1000),
        .heartbeat_age_ms = (int64_t)(v->now_ms - w->last_heartbeat_ms),
        .utilisation = w->utilisation,
        .metrics_port = w->metrics_port,
    };
    v->visit(&a, v->user);
}

static void rt_admin_list(void *ctx, duet_admin_worker_visit_cb visit, void *visit_user)
{
    duet__router_t *rt = ctx;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    rt_visit_t v = {visit, visit_user, uv_now(rt->loop),
                    (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000};
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
        f->id = w->id;
        f->live = live;
    }
}

static duet_status_t rt_find_worker(duet__router_t *rt, const char *name, uint64_t *id_p)
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

void duet__rt_drain_waiters_check(duet__router_t *rt, uint64_t worker_id, duet_status_t st,
                                  const char *detail)
{
    duet_worker_info_t w;
    if (st == DUET_OK && (duet_registry_get(rt->reg, worker_id, &w) < 0 || w.inflight > 0))
        return;
    for (struct rt_drain_waiter **p = &rt->waiters; *p != NULL;) {
        struct rt_drain_waiter *d = *p;
        if (d->worker_id != worker_id) {
            p = &d->next;
            continue;
        }
        *p = d->next;
        d->cb(d->user, st, detail);
        free(d);
    }
}

bool duet__rt_migrating(const duet__router_t *rt, uint64_t id)
{
    for (size_t i = 0; i < rt->n_migrate_from; i++)
        if (rt->migrate_from[i] == id)
            return true;
    return false;
}

bool duet__rt_set_migrating(duet__router_t *rt, uint64_t id, bool on)
{
    for (size_t i = 0; i < rt->n_migrate_from; i++)
        if (rt->migrate_from[i] == id) {
            if (!on)
                rt->migrate_from[i] = rt->migrate_from[--rt->n_migrate_from];
            return true;
        }
    if (!on)
        return true;
    if (rt->n_migrate_from == DUET__RT_MAX_MIGRATE)
        return false;
    rt->migrate_from[rt->n_migrate_from++] = id;
    return true;
}

static duet_status_t rt_admin_drain(void *ctx, const char *name, bool migrate,
                                    duet_admin_drain_done_cb done_cb, void *done_user)
{
    duet__router_t *rt = ctx;
    uint64_t id = 0;
    duet_status_t st = rt_find_worker(rt, name, &id);
    if (st < 0)
        return st;
    duet_worker_info_t w;
    if (migrate && (duet_registry_get(rt->reg, id, &w) < 0 || w.role != DUET_WORKER_ROLE_GEN))
        return duet_error_set(DUET_ERR_INVALID,
                              "worker %s is not a generation worker: only those move requests",
                              name);
    if (migrate && !duet__rt_set_migrating(rt, id, true))
        return duet_error_set(DUET_ERR_BUSY, "%d workers are already draining with migrate",
                              DUET__RT_MAX_MIGRATE);
    if ((st = duet_registry_set_draining(rt->reg, id, true)) < 0)
        return st;
    duet__rq_capacity_changed(rt);
    if (done_cb == NULL)
        return DUET_OK;
    struct rt_drain_waiter *d = calloc(1, sizeof(*d));
    if (d == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "drain waiter");
    d->worker_id = id;
    d->cb = done_cb;
    d->user = done_user;
    d->next = rt->waiters;
    rt->waiters = d;
    duet__rt_drain_waiters_check(rt, id, DUET_OK, NULL);
    return DUET_OK;
}

static void rt_admin_drain_forget(void *ctx, void *done_user)
{
    duet__router_t *rt = ctx;
    for (struct rt_drain_waiter **p = &rt->waiters; *p != NULL;) {
        struct rt_drain_waiter *d = *p;
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
    duet__router_t *rt = ctx;
    uint64_t id = 0;
    duet_status_t st = rt_find_worker(rt, name, &id);
    if (st < 0)
        return st;
    if ((st = duet_registry_set_draining(rt->reg, id, false)) < 0)
        return st;
    (void)duet__rt_set_migrating(rt, id, false); /* moves under way finish; no new ones */
    duet__rt_drain_waiters_check(rt, id, DUET_ERR_CANCELLED, "the worker was undrained");
    duet__rq_capacity_changed(rt);
    return DUET_OK;
}

static void rt_admin_changed(void *ctx)
{
    duet__rq_capacity_changed(ctx);
}

typedef struct {
    duet__router_t *rt;
    const char *level;
    size_t told;
} rt_log_level_t;

static void rt_log_level_one(const duet_worker_info_t *w, void *user)
{
    rt_log_level_t *l = user;
    if (w->state == DUET_WORKER_STATE_DEAD)
        return;
    Duet__SetLogLevel m = DUET__SET_LOG_LEVEL__INIT;
    m.level = (char *)l->level;
    Duet__Envelope env = duet_envelope_set_log_level(&m);
    if (duet_registry_send(l->rt->reg, w->id, &env) == DUET_OK)
        l->told++;
}

/* The router's log level changed (admin API): every live worker's too. */
static size_t rt_admin_log_level(void *ctx, duet_log_level_t level)
{
    rt_log_level_t l = {ctx, duet_log_level_name(level), 0};
    duet_registry_foreach(((duet__router_t *)ctx)->reg, rt_log_level_one, &l);
    return l.told;
}

const duet_admin_ops_t duet__rt_admin_ops = {
    .list_workers = rt_admin_list,
    .drain = rt_admin_drain,
    .drain_forget = rt_admin_drain_forget,
    .undrain = rt_admin_undrain,
    .admission_changed = rt_admin_changed,
    .log_level_changed = rt_admin_log_level,
};
