/*
 * Admission control (see admission.h). The queue is a doubly linked list threaded through a node
 * pool by index, so cancel can unlink from the middle and the pool can grow with realloc (in
 * set_limits) without invalidating links. Free nodes form a singly linked free list.
 *
 * The queue-full Retry-After is an estimate of how long the current queue takes to drain: the
 * queue length times a moving average of the interval between releases, measured only while
 * requests were waiting (an idle gap says nothing about throughput). Without a sample it is 1 s.
 */
#include "router/cluster/admission.h"

#include <stdlib.h>
#include <string.h>

#include "common/log.h"

#define NIL UINT32_MAX

typedef struct {
    void *handle;         /* caller's request; NULL while the node is free */
    uint64_t enqueued_ms; /* when it entered the queue */
    uint64_t deadline_ms; /* absolute */
    uint32_t prev, next;  /* queue links, or next = free-list link */
} adm_node_t;

struct duet_admission {
    duet_admission_options_t opts; /* limits in here are the current ones */
    adm_node_t *nodes;             /* owned, node_cap entries */
    uint32_t node_cap;
    uint32_t head, tail, free_head;
    uint32_t queued, in_flight;
    uint32_t worker_slots;  /* 0: no bound beyond opts.max_inflight */
    uint64_t hold_until_ms; /* no promotion before this (a requeue), unless a release comes */
    bool paused, has_capacity;

    uint64_t last_release_ms;
    bool have_last_release;
    double release_interval_ms; /* moving average; 0 = no sample yet */

    uint64_t admitted_total, queued_total, cancelled_total, requeued_total;
    uint64_t rejected_total[DUET_ADMISSION_REASON_COUNT];

    /* metric children (NULL without a registry), owned by the registry */
    duet_metric_t *m_inflight, *m_queue, *m_admitted, *m_cancelled, *m_requeued;
    duet_metric_t *m_rejected[DUET_ADMISSION_REASON_COUNT];
};

static const char *const reason_names[DUET_ADMISSION_REASON_COUNT] = {"queue_full", "paused",
                                                                      "no_capacity", "expired"};

const char *duet_admission_reason_name(duet_admission_reason_t reason)
{
    return (unsigned)reason < DUET_ADMISSION_REASON_COUNT ? reason_names[reason] : "unknown";
}

const char *duet_admission_verdict_name(duet_admission_verdict_t verdict)
{
    switch (verdict) {
    case DUET_ADMISSION_ADMIT:
        return "admit";
    case DUET_ADMISSION_QUEUED:
        return "queued";
    case DUET_ADMISSION_REJECT_FULL:
        return "reject_full";
    case DUET_ADMISSION_REJECT_PAUSED:
        return "reject_paused";
    case DUET_ADMISSION_REJECT_NO_CAPACITY:
        return "reject_no_capacity";
    }
    return "unknown";
}

void duet_admission_options_default(duet_admission_options_t *opts)
{
    memset(opts, 0, sizeof(*opts));
    opts->max_inflight = 64;
    opts->max_queue = 256;
    opts->has_capacity = false;
    opts->paused_retry_after_s = 5;
    opts->max_retry_after_s = 60;
    opts->metrics = NULL;
}

static duet_status_t check_limits(uint32_t max_inflight, uint32_t max_queue)
{
    if (max_inflight < 1 || max_inflight > DUET_ADMISSION_MAX_INFLIGHT)
        return duet_error_set(DUET_ERR_RANGE, "admission: max_inflight %u outside [1, %u]",
                              max_inflight, DUET_ADMISSION_MAX_INFLIGHT);
    if (max_queue > DUET_ADMISSION_MAX_QUEUE)
        return duet_error_set(DUET_ERR_RANGE, "admission: max_queue %u outside [0, %u]", max_queue,
                              DUET_ADMISSION_MAX_QUEUE);
    return DUET_OK;
}

/* Grow the node pool to at least `want` nodes; new nodes go on the free list. */
static duet_status_t pool_reserve(duet_admission_t *adm, uint32_t want)
{
    if (want <= adm->node_cap)
        return DUET_OK;
    adm_node_t *n = realloc(adm->nodes, (size_t)want * sizeof(*n));
    if (n == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "admission: cannot grow the queue to %u", want);
    for (uint32_t i = adm->node_cap; i < want; i++) {
        n[i].handle = NULL;
        n[i].prev = NIL;
        n[i].next = (i + 1 < want) ? i + 1 : adm->free_head;
    }
    adm->free_head = adm->node_cap;
    adm->nodes = n;
    adm->node_cap = want;
    return DUET_OK;
}

static void update_gauges(duet_admission_t *adm)
{
    if (adm->m_inflight != NULL)
        duet_metrics_gauge_set(adm->m_inflight, (double)adm->in_flight);
    if (adm->m_queue != NULL)
        duet_metrics_gauge_set(adm->m_queue, (double)adm->queued);
}

static void count_reject(duet_admission_t *adm, duet_admission_reason_t reason)
{
    adm->rejected_total[reason]++;
    if (adm->m_rejected[reason] != NULL)
        duet_metrics_counter_inc(adm->m_rejected[reason]);
}

static void count_admit(duet_admission_t *adm)
{
    adm->in_flight++;
    adm->admitted_total++;
    if (adm->m_admitted != NULL)
        duet_metrics_counter_inc(adm->m_admitted);
}

static duet_status_t register_metrics(duet_admission_t *adm, duet_metrics_t *reg)
{
    duet_metric_family_t *f = NULL;
    duet_status_t st;
    st = duet_metrics_gauge_new(reg, "duet_router_inflight",
                                "Requests admitted and running in the router", NULL, 0, &f);
    if (st < 0)
        return st;
    adm->m_inflight = duet_metrics_single(f);
    st = duet_metrics_gauge_new(reg, "duet_router_queue_depth",
                                "Requests waiting in the router's admission queue", NULL, 0, &f);
    if (st < 0)
        return st;
    adm->m_queue = duet_metrics_single(f);
    st = duet_metrics_counter_new(reg, "duet_router_admission_admitted_total",
                                  "Requests that started running (at once or from the queue)", NULL,
                                  0, &f);
    if (st < 0)
        return st;
    adm->m_admitted = duet_metrics_single(f);
    st = duet_metrics_counter_new(reg, "duet_router_admission_cancelled_total",
                                  "Queued requests whose client went away", NULL, 0, &f);
    if (st < 0)
        return st;
    adm->m_cancelled = duet_metrics_single(f);
    st = duet_metrics_counter_new(reg, "duet_router_admission_requeued_total",
                                  "Running requests every generation worker refused for want of "
                                  "room, back in the queue",
                                  NULL, 0, &f);
    if (st < 0)
        return st;
    adm->m_requeued = duet_metrics_single(f);
    static const char *const labels[] = {"reason"};
    st = duet_metrics_counter_new(reg, "duet_router_admission_rejected_total",
                                  "Requests refused by admission, by reason", labels, 1, &f);
    if (st < 0)
        return st;
    for (int r = 0; r < DUET_ADMISSION_REASON_COUNT; r++) {
        const char *v[] = {reason_names[r]};
        st = duet_metrics_child(f, v, 1, &adm->m_rejected[r]);
        if (st < 0)
            return st;
    }
    return DUET_OK;
}

duet_status_t duet_admission_create(const duet_admission_options_t *opts, duet_admission_t **adm_p)
{
    duet_status_t st = check_limits(opts->max_inflight, opts->max_queue);
    if (st < 0)
        return st;
    duet_admission_t *adm = calloc(1, sizeof(*adm));
    if (adm == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "admission: out of memory");
    adm->opts = *opts;
    if (adm->opts.paused_retry_after_s == 0)
        adm->opts.paused_retry_after_s = 1;
    if (adm->opts.max_retry_after_s == 0)
        adm->opts.max_retry_after_s = 1;
    adm->head = adm->tail = adm->free_head = NIL;
    adm->has_capacity = opts->has_capacity;
    st = pool_reserve(adm, opts->max_queue);
    if (st < 0)
        goto undo_alloc;
    if (opts->metrics != NULL) {
        st = register_metrics(adm, opts->metrics);
        if (st < 0)
            goto undo_pool;
        update_gauges(adm);
    }
    *adm_p = adm;
    return DUET_OK;

undo_pool:
    free(adm->nodes);
undo_alloc:
    free(adm);
    return st;
}

void duet_admission_destroy(duet_admission_t *adm)
{
    if (adm == NULL)
        return;
    free(adm->nodes);
    free(adm);
}

static void unlink_node(duet_admission_t *adm, uint32_t i)
{
    adm_node_t *n = &adm->nodes[i];
    if (n->prev != NIL)
        adm->nodes[n->prev].next = n->next;
    else
        adm->head = n->next;
    if (n->next != NIL)
        adm->nodes[n->next].prev = n->prev;
    else
        adm->tail = n->prev;
    n->handle = NULL;
    n->prev = NIL;
    n->next = adm->free_head;
    adm->free_head = i;
    DUET_ASSERT(adm->queued > 0);
    adm->queued--;
}

/* Queue `handle` at the tail, or at the head; the caller checked there is room. */
static void enqueue(duet_admission_t *adm, void *handle, uint64_t now_ms, uint64_t deadline_ms,
                    bool at_head)
{
    DUET_ASSERT(adm->free_head != NIL);
    uint32_t i = adm->free_head;
    adm_node_t *n = &adm->nodes[i];
    adm->free_head = n->next;
    n->handle = handle;
    n->enqueued_ms = now_ms;
    n->deadline_ms = deadline_ms;
    n->prev = at_head ? NIL : adm->tail;
    n->next = at_head ? adm->head : NIL;
    if (n->prev != NIL)
        adm->nodes[n->prev].next = i;
    else
        adm->head = i;
    if (n->next != NIL)
        adm->nodes[n->next].prev = i;
    else
        adm->tail = i;
    adm->queued++;
}

static uint32_t retry_after_full(const duet_admission_t *adm)
{
    double ms = adm->release_interval_ms * (double)(adm->queued > 0 ? adm->queued : 1);
    double s = ms / 1000.0;
    uint32_t r = s < 1.0 ? 1
                         : (s > (double)adm->opts.max_retry_after_s ? adm->opts.max_retry_after_s
                                                                    : (uint32_t)(s + 0.999));
    return r < 1 ? 1 : r;
}

/* Whether a queued request with deadline > now_ms exists. */
static bool live_queued(const duet_admission_t *adm, uint64_t now_ms)
{
    for (uint32_t i = adm->head; i != NIL; i = adm->nodes[i].next)
        if (adm->nodes[i].deadline_ms > now_ms)
            return true;
    return false;
}

/* Requests that may run at once: max_inflight, or what the generation workers hold. */
static uint32_t inflight_limit(const duet_admission_t *adm)
{
    const uint32_t w = adm->worker_slots;
    return w > 0 && w < adm->opts.max_inflight ? w : adm->opts.max_inflight;
}

static bool can_promote(const duet_admission_t *adm, uint64_t now_ms)
{
    return !adm->paused && adm->has_capacity && adm->in_flight < inflight_limit(adm) &&
           now_ms >= adm->hold_until_ms;
}

duet_status_t duet_admission_try_admit(duet_admission_t *adm, void *handle, uint64_t now_ms,
                                       uint64_t deadline_ms, duet_admission_result_t *res_p)
{
    if (handle == NULL)
        return duet_error_set(DUET_ERR_INVALID, "admission: NULL request handle");
    duet_admission_result_t r = {DUET_ADMISSION_ADMIT, 0, 0};
    if (adm->paused) {
        r.verdict = DUET_ADMISSION_REJECT_PAUSED;
        r.http_status = DUET_ADMISSION_PAUSED_HTTP_STATUS;
        r.retry_after_s = adm->opts.paused_retry_after_s;
        count_reject(adm, DUET_ADMISSION_REASON_PAUSED);
    } else if (!adm->has_capacity) {
        r.verdict = DUET_ADMISSION_REJECT_NO_CAPACITY;
        r.http_status = DUET_ADMISSION_NO_CAPACITY_HTTP_STATUS;
        r.retry_after_s = adm->opts.paused_retry_after_s;
        count_reject(adm, DUET_ADMISSION_REASON_NO_CAPACITY);
    } else if (adm->in_flight < inflight_limit(adm) && now_ms >= adm->hold_until_ms &&
               !live_queued(adm, now_ms)) {
        /* A slot is free and nobody who may still run is ahead in line. (Live queued requests
         * with a free slot exist only until the caller's pop_ready loop runs; they go first.) */
        count_admit(adm);
    } else if (adm->queued < adm->opts.max_queue && deadline_ms > now_ms) {
        enqueue(adm, handle, now_ms, deadline_ms, false);
        adm->queued_total++;
        r.verdict = DUET_ADMISSION_QUEUED;
    } else {
        r.verdict = DUET_ADMISSION_REJECT_FULL;
        r.http_status = DUET_ADMISSION_FULL_HTTP_STATUS;
        r.retry_after_s = retry_after_full(adm);
        count_reject(adm, DUET_ADMISSION_REASON_QUEUE_FULL);
    }
    update_gauges(adm);
    *res_p = r;
    return DUET_OK;
}

bool duet_admission_pop_ready(duet_admission_t *adm, uint64_t now_ms, void **handle_p)
{
    *handle_p = NULL;
    if (!can_promote(adm, now_ms))
        return false;
    for (uint32_t i = adm->head; i != NIL; i = adm->nodes[i].next) {
        if (adm->nodes[i].deadline_ms <= now_ms)
            continue; /* expired: left for duet_admission_expire */
        void *h = adm->nodes[i].handle;
        unlink_node(adm, i);
        count_admit(adm);
        update_gauges(adm);
        *handle_p = h;
        return true;
    }
    return false;
}

bool duet_admission_release(duet_admission_t *adm, uint64_t now_ms, void **next_p)
{
    DUET_ASSERT(adm->in_flight > 0);
    adm->in_flight--;
    adm->hold_until_ms = 0; /* a request ended: its worker has room again */
    if (adm->queued > 0 && adm->have_last_release && now_ms >= adm->last_release_ms) {
        double dt = (double)(now_ms - adm->last_release_ms);
        adm->release_interval_ms =
            adm->release_interval_ms == 0.0 ? dt : 0.8 * adm->release_interval_ms + 0.2 * dt;
    }
    adm->last_release_ms = now_ms;
    adm->have_last_release = true;
    update_gauges(adm);
    return duet_admission_pop_ready(adm, now_ms, next_p);
}

size_t duet_admission_expire(duet_admission_t *adm, uint64_t now_ms, duet_admission_expired_cb cb,
                             void *user)
{
    /* Take one expired node at a time and restart from the head after each callback: the
     * callback may cancel, admit or promote, which can change any link we would keep. */
    size_t n = 0;
    for (;;) {
        uint32_t i = adm->head;
        while (i != NIL && adm->nodes[i].deadline_ms > now_ms)
            i = adm->nodes[i].next;
        if (i == NIL)
            break;
        void *h = adm->nodes[i].handle;
        uint64_t waited = now_ms - adm->nodes[i].enqueued_ms;
        unlink_node(adm, i);
        count_reject(adm, DUET_ADMISSION_REASON_EXPIRED);
        update_gauges(adm);
        n++;
        if (cb != NULL)
            cb(h, waited, user);
    }
    return n;
}

duet_status_t duet_admission_requeue(duet_admission_t *adm, void *handle, uint64_t now_ms,
                                     uint64_t deadline_ms, uint64_t hold_until_ms)
{
    DUET_ASSERT(adm->in_flight > 0);
    if (handle == NULL)
        return duet_error_set(DUET_ERR_INVALID, "admission: NULL request handle");
    if (deadline_ms <= now_ms || adm->queued >= adm->opts.max_queue)
        return duet_error_set(DUET_ERR_RANGE, "admission: no room to requeue (%s)",
                              deadline_ms <= now_ms ? "its queue deadline has passed"
                                                    : "the queue is full");
    enqueue(adm, handle, now_ms, deadline_ms, true); /* it was first in line: first again */
    adm->in_flight--;
    if (hold_until_ms > adm->hold_until_ms)
        adm->hold_until_ms = hold_until_ms;
    adm->requeued_total++;
    if (adm->m_requeued != NULL)
        duet_metrics_counter_inc(adm->m_requeued);
    update_gauges(adm);
    return DUET_OK;
}

bool duet_admission_next_deadline(const duet_admission_t *adm, uint64_t *deadline_p)
{
    bool any = false;
    uint64_t best = 0;
    for (uint32_t i = adm->head; i != NIL; i = adm->nodes[i].next) {
        if (!any || adm->nodes[i].deadline_ms < best)
            best = adm->nodes[i].deadline_ms;
        any = true;
    }
    if (any)
        *deadline_p = best;
    return any;
}

duet_status_t duet_admission_cancel(duet_admission_t *adm, void *handle)
{
    for (uint32_t i = adm->head; i != NIL; i = adm->nodes[i].next) {
        if (adm->nodes[i].handle == handle) {
            unlink_node(adm, i);
            adm->cancelled_total++;
            if (adm->m_cancelled != NULL)
                duet_metrics_counter_inc(adm->m_cancelled);
            update_gauges(adm);
            return DUET_OK;
        }
    }
    return DUET_ERR_NOT_FOUND;
}

void duet_admission_pause(duet_admission_t *adm)
{
    if (!adm->paused)
        DUET_LOG_INFO("admission paused (%u running, %u queued)", adm->in_flight, adm->queued);
    adm->paused = true;
}

void duet_admission_resume(duet_admission_t *adm)
{
    if (adm->paused)
        DUET_LOG_INFO("admission resumed (%u running, %u queued)", adm->in_flight, adm->queued);
    adm->paused = false;
}

void duet_admission_set_capacity(duet_admission_t *adm, bool has_capacity)
{
    adm->has_capacity = has_capacity;
}

void duet_admission_set_worker_slots(duet_admission_t *adm, uint32_t slots)
{
    if (slots == adm->worker_slots)
        return;
    adm->worker_slots = slots;
    if (slots > 0) /* 0: the last worker left, which the registry says */
        DUET_LOG_INFO("admission: the generation workers hold %u requests at once, so %u may run "
                      "(%u running, %u queued)",
                      slots, inflight_limit(adm), adm->in_flight, adm->queued);
}

duet_status_t duet_admission_set_limits(duet_admission_t *adm, uint32_t max_inflight,
                                        uint32_t max_queue)
{
    duet_status_t st = check_limits(max_inflight, max_queue);
    if (st < 0)
        return st;
    st = pool_reserve(adm, max_queue);
    if (st < 0)
        return st;
    if (max_inflight != adm->opts.max_inflight || max_queue != adm->opts.max_queue)
        DUET_LOG_INFO("admission limits: max_inflight %u -> %u, max_queue %u -> %u (%u running, "
                      "%u queued)",
                      adm->opts.max_inflight, max_inflight, adm->opts.max_queue, max_queue,
                      adm->in_flight, adm->queued);
    adm->opts.max_inflight = max_inflight;
    adm->opts.max_queue = max_queue;
    return DUET_OK;
}

void duet_admission_stats(const duet_admission_t *adm, duet_admission_stats_t *stats_p)
{
    duet_admission_stats_t s;
    memset(&s, 0, sizeof(s));
    s.in_flight = adm->in_flight;
    s.queued = adm->queued;
    s.max_inflight = adm->opts.max_inflight;
    s.max_queue = adm->opts.max_queue;
    s.worker_slots = adm->worker_slots;
    s.limit = inflight_limit(adm);
    s.paused = adm->paused;
    s.has_capacity = adm->has_capacity;
    s.admitted_total = adm->admitted_total;
    s.queued_total = adm->queued_total;
    s.cancelled_total = adm->cancelled_total;
    s.requeued_total = adm->requeued_total;
    s.hold_until_ms = adm->hold_until_ms;
    memcpy(s.rejected_total, adm->rejected_total, sizeof(s.rejected_total));
    *stats_p = s;
}
