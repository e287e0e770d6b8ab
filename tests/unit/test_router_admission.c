/*
 * Admission control (router/cluster/admission.h): directed tests of each verdict, FIFO promotion,
 * deadlines, cancel, pause, capacity, run-time limits, Retry-After and metrics; then a randomized
 * model check that drives the module and a tiny reference model (plain arrays, written from the
 * header's contract) with the same few thousand operation sequences and compares every answer.
 * Invariants checked on the way: in-flight only grows while below the limit (max_inflight, or
 * the generation workers' slots when fewer), the queue only
 * grows while below max_queue, promotions and expiries follow queue order, and at the end every
 * request has ended exactly once (rejected, released, expired or cancelled) and none is lost.
 */
#include <criterion/criterion.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/config.h"
#include "common/metrics.h"
#include "common/strbuf.h"
#include "router/cluster/admission.h"

#define H(i) ((void *)(uintptr_t)(i))

static duet_admission_t *make(uint32_t max_inflight, uint32_t max_queue, duet_metrics_t *reg)
{
    duet_admission_options_t o;
    duet_admission_options_default(&o);
    o.max_inflight = max_inflight;
    o.max_queue = max_queue;
    o.has_capacity = true;
    o.metrics = reg;
    duet_admission_t *adm = NULL;
    cr_assert_eq(duet_admission_create(&o, &adm), DUET_OK);
    return adm;
}

static duet_admission_verdict_t admit(duet_admission_t *adm, uintptr_t id, uint64_t now,
                                      uint64_t deadline)
{
    duet_admission_result_t r;
    cr_assert_eq(duet_admission_try_admit(adm, H(id), now, deadline, &r), DUET_OK);
    return r.verdict;
}

Test(admission, defaults_refuse_until_capacity_is_reported)
{
    duet_admission_options_t o;
    duet_admission_options_default(&o);
    cr_expect_eq(o.max_inflight, 64);
    cr_expect_eq(o.max_queue, 256);
    cr_expect_not(o.has_capacity);
    duet_admission_t *adm = NULL;
    cr_assert_eq(duet_admission_create(&o, &adm), DUET_OK);
    duet_admission_result_t r;
    cr_assert_eq(duet_admission_try_admit(adm, H(1), 0, 1000, &r), DUET_OK);
    cr_expect_eq(r.verdict, DUET_ADMISSION_REJECT_NO_CAPACITY);
    cr_expect_eq(r.http_status, 503);
    cr_expect_eq(r.retry_after_s, 5);
    duet_admission_set_capacity(adm, true);
    cr_expect_eq(admit(adm, 2, 0, 1000), DUET_ADMISSION_ADMIT);
    duet_admission_stats_t s;
    duet_admission_stats(adm, &s);
    cr_expect_eq(s.in_flight, 1);
    cr_expect_eq(s.rejected_total[DUET_ADMISSION_REASON_NO_CAPACITY], 1);
    duet_admission_destroy(adm);
    duet_admission_destroy(NULL);
}

Test(admission, create_and_set_limits_validate_ranges)
{
    duet_admission_options_t o;
    duet_admission_options_default(&o);
    duet_admission_t *adm = NULL;
    o.max_inflight = 0;
    cr_expect_eq(duet_admission_create(&o, &adm), DUET_ERR_RANGE);
    cr_expect(strstr(duet_error_last(), "max_inflight") != NULL, "%s", duet_error_last());
    o.max_inflight = 1;
    o.max_queue = DUET_ADMISSION_MAX_QUEUE + 1;
    cr_expect_eq(duet_admission_create(&o, &adm), DUET_ERR_RANGE);
    cr_expect(strstr(duet_error_last(), "max_queue") != NULL, "%s", duet_error_last());
    cr_expect_null(adm);

    adm = make(2, 2, NULL);
    cr_expect_eq(duet_admission_set_limits(adm, 0, 3), DUET_ERR_RANGE);
    cr_expect_eq(duet_admission_set_limits(adm, DUET_ADMISSION_MAX_INFLIGHT + 1, 3),
                 DUET_ERR_RANGE);
    cr_expect_eq(duet_admission_set_limits(adm, 3, DUET_ADMISSION_MAX_QUEUE + 1), DUET_ERR_RANGE);
    duet_admission_stats_t s;
    duet_admission_stats(adm, &s);
    cr_expect_eq(s.max_inflight, 2, "limits unchanged after a refused set");
    cr_expect_eq(s.max_queue, 2);
    duet_admission_result_t r;
    cr_expect_eq(duet_admission_try_admit(adm, NULL, 0, 10, &r), DUET_ERR_INVALID);
    duet_admission_destroy(adm);
}

Test(admission, admit_queue_then_reject_full_with_retry_after)
{
    duet_admission_t *adm = make(2, 2, NULL);
    cr_expect_eq(admit(adm, 1, 0, 100), DUET_ADMISSION_ADMIT);
    cr_expect_eq(admit(adm, 2, 0, 100), DUET_ADMISSION_ADMIT);
    cr_expect_eq(admit(adm, 3, 0, 100), DUET_ADMISSION_QUEUED);
    cr_expect_eq(admit(adm, 4, 0, 100), DUET_ADMISSION_QUEUED);
    duet_admission_result_t r;
    cr_assert_eq(duet_admission_try_admit(adm, H(5), 0, 100, &r), DUET_OK);
    cr_expect_eq(r.verdict, DUET_ADMISSION_REJECT_FULL);
    cr_expect_eq(r.http_status, 429);
    cr_expect_eq(r.retry_after_s, 1, "no throughput sample yet: 1 s");
    duet_admission_stats_t s;
    duet_admission_stats(adm, &s);
    cr_expect_eq(s.in_flight, 2);
    cr_expect_eq(s.queued, 2);
    cr_expect_eq(s.admitted_total, 2);
    cr_expect_eq(s.queued_total, 2);
    cr_expect_eq(s.rejected_total[DUET_ADMISSION_REASON_QUEUE_FULL], 1);
    duet_admission_destroy(adm);
}

Test(admission, release_promotes_in_fifo_order)
{
    duet_admission_t *adm = make(1, 10, NULL);
    cr_expect_eq(admit(adm, 1, 0, 1000), DUET_ADMISSION_ADMIT);
    for (uintptr_t i = 2; i <= 6; i++)
        cr_expect_eq(admit(adm, i, 0, 1000), DUET_ADMISSION_QUEUED);
    void *next = NULL;
    for (uintptr_t i = 2; i <= 6; i++) {
        cr_assert(duet_admission_release(adm, 10 * i, &next));
        cr_expect_eq(next, H(i));
    }
    cr_expect_not(duet_admission_release(adm, 100, &next));
    cr_expect_null(next);
    duet_admission_stats_t s;
    duet_admission_stats(adm, &s);
    cr_expect_eq(s.in_flight, 0);
    cr_expect_eq(s.queued, 0);
    cr_expect_eq(s.admitted_total, 6);
    duet_admission_destroy(adm);
}

Test(admission, retry_after_tracks_release_rate_and_is_capped)
{
    duet_admission_t *adm = make(1, 3, NULL);
    uintptr_t id = 1;
    uint64_t t = 0;
    cr_expect_eq(admit(adm, id++, t, 1000000), DUET_ADMISSION_ADMIT);
    for (int i = 0; i < 3; i++)
        cr_expect_eq(admit(adm, id++, t, 1000000), DUET_ADMISSION_QUEUED);
    /* Saturated: one release every 2 s, refill the queue after each. */
    void *next;
    for (int i = 0; i < 10; i++) {
        t += 2000;
        cr_assert(duet_admission_release(adm, t, &next));
        cr_expect_eq(admit(adm, id++, t, 10000000), DUET_ADMISSION_QUEUED);
    }
    duet_admission_result_t r;
    cr_assert_eq(duet_admission_try_admit(adm, H(id++), t, t + 1000, &r), DUET_OK);
    cr_expect_eq(r.verdict, DUET_ADMISSION_REJECT_FULL);
    cr_expect_eq(r.retry_after_s, 6, "3 queued x 2 s per release, got %u", r.retry_after_s);
    /* 100 s per release: capped at max_retry_after_s (60). */
    for (int i = 0; i < 20; i++) {
        t += 100000;
        cr_assert(duet_admission_release(adm, t, &next));
        cr_expect_eq(admit(adm, id++, t, t + 100000000), DUET_ADMISSION_QUEUED);
    }
    cr_assert_eq(duet_admission_try_admit(adm, H(id++), t, t + 1000, &r), DUET_OK);
    cr_expect_eq(r.retry_after_s, 60);
    duet_admission_destroy(adm);
}

Test(admission, paused_rejects_new_and_holds_queued_until_resume)
{
    duet_admission_t *adm = make(1, 4, NULL);
    cr_expect_eq(admit(adm, 1, 0, 1000), DUET_ADMISSION_ADMIT);
    cr_expect_eq(admit(adm, 2, 0, 1000), DUET_ADMISSION_QUEUED);
    cr_expect_eq(admit(adm, 3, 0, 1000), DUET_ADMISSION_QUEUED);
    duet_admission_pause(adm);
    duet_admission_result_t r;
    cr_assert_eq(duet_admission_try_admit(adm, H(4), 0, 1000, &r), DUET_OK);
    cr_expect_eq(r.verdict, DUET_ADMISSION_REJECT_PAUSED);
    cr_expect_eq(r.http_status, 503);
    cr_expect_eq(r.retry_after_s, 5);
    void *next;
    cr_expect_not(duet_admission_release(adm, 10, &next), "paused: no promotion");
    duet_admission_stats_t s;
    duet_admission_stats(adm, &s);
    cr_expect(s.paused);
    cr_expect_eq(s.queued, 2);
    cr_expect_eq(s.in_flight, 0);
    duet_admission_resume(adm);
    cr_assert(duet_admission_pop_ready(adm, 20, &next));
    cr_expect_eq(next, H(2));
    cr_expect_not(duet_admission_pop_ready(adm, 20, &next), "max_inflight 1 reached");
    cr_expect_eq(admit(adm, 5, 20, 1000), DUET_ADMISSION_QUEUED, "behind request 3");
    duet_admission_destroy(adm);
}

Test(admission, no_capacity_rejects_at_once_and_queued_wait_for_it)
{
    duet_admission_t *adm = make(1, 4, NULL);
    cr_expect_eq(admit(adm, 1, 0, 1000), DUET_ADMISSION_ADMIT);
    cr_expect_eq(admit(adm, 2, 0, 1000), DUET_ADMISSION_QUEUED);
    duet_admission_set_capacity(adm, false);
    cr_expect_eq(admit(adm, 3, 0, 1000), DUET_ADMISSION_REJECT_NO_CAPACITY);
    void *next;
    cr_expect_not(duet_admission_release(adm, 5, &next));
    duet_admission_set_capacity(adm, true);
    cr_assert(duet_admission_pop_ready(adm, 6, &next));
    cr_expect_eq(next, H(2));
    duet_admission_stats_t s;
    duet_admission_stats(adm, &s);
    cr_expect_eq(s.rejected_total[DUET_ADMISSION_REASON_NO_CAPACITY], 1);
    duet_admission_destroy(adm);
}

typedef struct {
    void *seen[16];
    uint64_t waited[16];
    int n;
    duet_admission_t *adm;
    void *cancel_in_cb; /* cancel this handle from inside the first callback */
} expired_log_t;

static void on_expired(void *handle, uint64_t waited_ms, void *user)
{
    expired_log_t *log = user;
    log->waited[log->n] = waited_ms;
    log->seen[log->n++] = handle;
    if (log->cancel_in_cb != NULL) {
        cr_expect_eq(duet_admission_cancel(log->adm, log->cancel_in_cb), DUET_OK);
        log->cancel_in_cb = NULL;
    }
}

Test(admission, expire_hands_back_overdue_in_order_and_promotion_skips_them)
{
    duet_admission_t *adm = make(1, 8, NULL);
    cr_expect_eq(admit(adm, 1, 0, 1000), DUET_ADMISSION_ADMIT);
    cr_expect_eq(admit(adm, 2, 0, 50), DUET_ADMISSION_QUEUED);
    cr_expect_eq(admit(adm, 3, 10, 500), DUET_ADMISSION_QUEUED);
    cr_expect_eq(admit(adm, 4, 20, 40), DUET_ADMISSION_QUEUED);
    cr_expect_eq(admit(adm, 5, 30, 30), DUET_ADMISSION_REJECT_FULL, "deadline already passed");
    uint64_t d = 0;
    cr_assert(duet_admission_next_deadline(adm, &d));
    cr_expect_eq(d, 40);
    /* At 60 requests 2 and 4 are overdue: a release promotes 3, skipping 2. */
    void *next;
    cr_assert(duet_admission_release(adm, 60, &next));
    cr_expect_eq(next, H(3));
    expired_log_t log = {.adm = adm};
    cr_expect_eq(duet_admission_expire(adm, 60, on_expired, &log), 2);
    cr_assert_eq(log.n, 2);
    cr_expect_eq(log.seen[0], H(2));
    cr_expect_eq(log.waited[0], 60);
    cr_expect_eq(log.seen[1], H(4));
    cr_expect_eq(log.waited[1], 40);
    cr_expect_not(duet_admission_next_deadline(adm, &d));
    duet_admission_stats_t s;
    duet_admission_stats(adm, &s);
    cr_expect_eq(s.rejected_total[DUET_ADMISSION_REASON_EXPIRED], 2);
    cr_expect_eq(s.queued, 0);
    duet_admission_destroy(adm);
}

Test(admission, expire_callback_may_call_back_into_admission)
{
    duet_admission_t *adm = make(1, 8, NULL);
    cr_expect_eq(admit(adm, 1, 0, 1000), DUET_ADMISSION_ADMIT);
    cr_expect_eq(admit(adm, 2, 0, 10), DUET_ADMISSION_QUEUED);
    cr_expect_eq(admit(adm, 3, 0, 10), DUET_ADMISSION_QUEUED);
    cr_expect_eq(admit(adm, 4, 0, 10), DUET_ADMISSION_QUEUED);
    expired_log_t log = {.adm = adm, .cancel_in_cb = H(3)};
    cr_expect_eq(duet_admission_expire(adm, 20, on_expired, &log), 2);
    cr_assert_eq(log.n, 2);
    cr_expect_eq(log.seen[0], H(2));
    cr_expect_eq(log.seen[1], H(4));
    duet_admission_stats_t s;
    duet_admission_stats(adm, &s);
    cr_expect_eq(s.queued, 0);
    cr_expect_eq(s.cancelled_total, 1);
    duet_admission_destroy(adm);
}

Test(admission, cancel_removes_from_the_middle)
{
    duet_admission_t *adm = make(1, 8, NULL);
    cr_expect_eq(admit(adm, 1, 0, 1000), DUET_ADMISSION_ADMIT);
    for (uintptr_t i = 2; i <= 5; i++)
        cr_expect_eq(admit(adm, i, 0, 1000), DUET_ADMISSION_QUEUED);
    cr_expect_eq(duet_admission_cancel(adm, H(3)), DUET_OK);
    cr_expect_eq(duet_admission_cancel(adm, H(3)), DUET_ERR_NOT_FOUND, "only once");
    cr_expect_eq(duet_admission_cancel(adm, H(1)), DUET_ERR_NOT_FOUND, "running, not queued");
    cr_expect_eq(duet_admission_cancel(adm, H(5)), DUET_OK, "the tail");
    void *next;
    cr_assert(duet_admission_release(adm, 1, &next));
    cr_expect_eq(next, H(2));
    cr_assert(duet_admission_release(adm, 2, &next));
    cr_expect_eq(next, H(4));
    cr_expect_not(duet_admission_release(adm, 3, &next));
    duet_admission_destroy(adm);
}

Test(admission, lowering_limits_keeps_running_and_queued_requests)
{
    duet_admission_t *adm = make(4, 4, NULL);
    for (uintptr_t i = 1; i <= 4; i++)
        cr_expect_eq(admit(adm, i, 0, 1000), DUET_ADMISSION_ADMIT);
    for (uintptr_t i = 5; i <= 8; i++)
        cr_expect_eq(admit(adm, i, 0, 1000), DUET_ADMISSION_QUEUED);
    cr_assert_eq(duet_admission_set_limits(adm, 2, 1), DUET_OK);
    duet_admission_stats_t s;
    duet_admission_stats(adm, &s);
    cr_expect_eq(s.in_flight, 4, "running requests are never killed");
    cr_expect_eq(s.queued, 4, "queued requests are never dropped");
    cr_expect_eq(admit(adm, 9, 0, 1000), DUET_ADMISSION_REJECT_FULL);
    void *next;
    cr_expect_not(duet_admission_release(adm, 1, &next), "4 -> 3 running, still above 2");
    cr_expect_not(duet_admission_release(adm, 2, &next), "3 -> 2 running, at the limit");
    cr_assert(duet_admission_release(adm, 3, &next), "2 -> 1 running: promote");
    cr_expect_eq(next, H(5));
    /* Raising the limits lets several run at once through pop_ready. */
    cr_assert_eq(duet_admission_set_limits(adm, 10, 100), DUET_OK);
    int n = 0;
    while (duet_admission_pop_ready(adm, 4, &next)) {
        cr_expect_eq(next, H(6 + n));
        n++;
    }
    cr_expect_eq(n, 3);
    /* The pool grew: 100 can now wait. */
    for (uintptr_t i = 100; i < 105; i++) /* 5 running + 5 = 10 */
        cr_expect_eq(admit(adm, i, 5, 1000), DUET_ADMISSION_ADMIT);
    for (uintptr_t i = 200; i < 300; i++)
        cr_expect_eq(admit(adm, i, 5, 1000), DUET_ADMISSION_QUEUED);
    cr_expect_eq(admit(adm, 300, 5, 1000), DUET_ADMISSION_REJECT_FULL);
    duet_admission_destroy(adm);
}

/* The generation workers' slots bound what runs when they are fewer than max_inflight: the rest
 * wait in the queue, a worker's slots arriving promote them, and 0 lifts the bound. */
Test(admission, worker_slots_bound_what_runs)
{
    duet_admission_t *adm = make(8, 8, NULL);
    duet_admission_set_worker_slots(adm, 2);
    duet_admission_stats_t s;
    duet_admission_stats(adm, &s);
    cr_expect_eq(s.worker_slots, 2);
    cr_expect_eq(s.limit, 2);
    cr_expect_eq(s.max_inflight, 8, "the configured limit is kept");
    cr_expect_eq(admit(adm, 1, 0, 1000), DUET_ADMISSION_ADMIT);
    cr_expect_eq(admit(adm, 2, 0, 1000), DUET_ADMISSION_ADMIT);
    for (uintptr_t i = 3; i <= 6; i++)
        cr_expect_eq(admit(adm, i, 0, 1000), DUET_ADMISSION_QUEUED, "request %zu", (size_t)i);
    void *next = NULL;
    cr_assert(duet_admission_release(adm, 1, &next), "a slot freed: the oldest waiting runs");
    cr_expect_eq(next, H(3));
    /* a second worker of 2 slots: two more run at once */
    duet_admission_set_worker_slots(adm, 4);
    int n = 0;
    while (duet_admission_pop_ready(adm, 2, &next))
        cr_expect_eq(next, H(4 + n++));
    cr_expect_eq(n, 2);
    duet_admission_stats(adm, &s);
    cr_expect_eq(s.in_flight, 4);
    cr_expect_eq(s.queued, 1);
    /* more slots than max_inflight: max_inflight bounds */
    duet_admission_set_worker_slots(adm, 100);
    duet_admission_stats(adm, &s);
    cr_expect_eq(s.limit, 8);
    cr_assert(duet_admission_pop_ready(adm, 3, &next));
    cr_expect_eq(next, H(6));
    for (uintptr_t i = 7; i <= 9; i++)
        cr_expect_eq(admit(adm, i, 3, 1000), DUET_ADMISSION_ADMIT);
    cr_expect_eq(admit(adm, 10, 3, 1000), DUET_ADMISSION_QUEUED, "8 running");
    /* fewer slots than running: nobody is stopped, promotions wait */
    duet_admission_set_worker_slots(adm, 1);
    duet_admission_stats(adm, &s);
    cr_expect_eq(s.in_flight, 8);
    cr_expect_not(duet_admission_release(adm, 4, &next), "7 running, 1 slot");
    /* 0: no bound beyond max_inflight */
    duet_admission_set_worker_slots(adm, 0);
    duet_admission_stats(adm, &s);
    cr_expect_eq(s.limit, 8);
    cr_assert(duet_admission_pop_ready(adm, 5, &next));
    cr_expect_eq(next, H(10));
    duet_admission_destroy(adm);
}

/* A running request every worker refused goes back to the head of the queue; until the hold
 * ends (or a running request ends) nothing is promoted and a newcomer queues behind it. */
Test(admission, requeue_goes_first_and_holds_promotions)
{
    duet_admission_t *adm = make(2, 2, NULL);
    cr_expect_eq(admit(adm, 1, 0, 1000), DUET_ADMISSION_ADMIT);
    cr_expect_eq(admit(adm, 2, 0, 1000), DUET_ADMISSION_ADMIT);
    cr_expect_eq(admit(adm, 3, 0, 1000), DUET_ADMISSION_QUEUED);
    cr_assert_eq(duet_admission_requeue(adm, H(2), 10, 1000, 60), DUET_OK);
    duet_admission_stats_t s;
    duet_admission_stats(adm, &s);
    cr_expect_eq(s.in_flight, 1);
    cr_expect_eq(s.queued, 2);
    cr_expect_eq(s.requeued_total, 1);
    cr_expect_eq(s.hold_until_ms, 60);
    void *next = NULL;
    cr_expect_not(duet_admission_pop_ready(adm, 59, &next), "held: a slot is free but no one runs");
    cr_expect_eq(admit(adm, 4, 59, 1000), DUET_ADMISSION_REJECT_FULL, "the queue holds 2");
    cr_assert(duet_admission_pop_ready(adm, 60, &next), "the hold has ended");
    cr_expect_eq(next, H(2), "the requeued request goes first");
    /* a requeue with a full queue changes nothing */
    cr_expect_eq(admit(adm, 5, 61, 1000), DUET_ADMISSION_QUEUED);
    cr_expect_eq(duet_admission_requeue(adm, H(1), 61, 1000, 500), DUET_ERR_RANGE);
    /* nor one past its queue deadline */
    cr_expect_eq(duet_admission_requeue(adm, H(1), 61, 61, 500), DUET_ERR_RANGE);
    duet_admission_stats(adm, &s);
    cr_expect_eq(s.in_flight, 2);
    cr_expect_eq(s.requeued_total, 1);
    /* a release ends a hold at once */
    void *gone = NULL;
    cr_assert(duet_admission_release(adm, 62, &gone) && gone == H(3)); /* 1 ended: 3 runs */
    cr_assert_eq(duet_admission_requeue(adm, H(3), 63, 1000, 900), DUET_OK);
    cr_expect_not(duet_admission_pop_ready(adm, 64, &next));
    cr_assert(duet_admission_release(adm, 65, &next), "2 ended: the hold ends, 3 runs again");
    cr_expect_eq(next, H(3));
    duet_admission_destroy(adm);
}

Test(admission, zero_queue_rejects_when_full)
{
    duet_admission_t *adm = make(1, 0, NULL);
    cr_expect_eq(admit(adm, 1, 0, 1000), DUET_ADMISSION_ADMIT);
    cr_expect_eq(admit(adm, 2, 0, 1000), DUET_ADMISSION_REJECT_FULL);
    duet_admission_destroy(adm);
}

Test(admission, metrics_are_exported)
{
    duet_metrics_t *reg = NULL;
    cr_assert_eq(duet_metrics_create(&reg), DUET_OK);
    duet_admission_t *adm = make(1, 1, reg);
    cr_expect_eq(admit(adm, 1, 0, 1000), DUET_ADMISSION_ADMIT);
    cr_expect_eq(admit(adm, 2, 0, 1000), DUET_ADMISSION_QUEUED);
    cr_expect_eq(admit(adm, 3, 0, 1000), DUET_ADMISSION_REJECT_FULL);
    duet_admission_pause(adm);
    cr_expect_eq(admit(adm, 4, 0, 1000), DUET_ADMISSION_REJECT_PAUSED);
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    cr_assert_eq(duet_metrics_render(reg, &sb), DUET_OK);
    const char *want[] = {
        "duet_router_inflight 1\n",
        "duet_router_queue_depth 1\n",
        "duet_router_admission_admitted_total 1\n",
        "duet_router_admission_rejected_total{reason=\"queue_full\"} 1\n",
        "duet_router_admission_rejected_total{reason=\"paused\"} 1\n",
        "duet_router_admission_rejected_total{reason=\"no_capacity\"} 0\n",
        "duet_router_admission_rejected_total{reason=\"expired\"} 0\n",
        "duet_router_admission_cancelled_total 0\n",
        "# TYPE duet_router_queue_depth gauge\n",
    };
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++)
        cr_expect(strstr(sb.data, want[i]) != NULL, "missing %s in\n%s", want[i], sb.data);
    duet_strbuf_free(&sb);
    /* A second controller in the same registry is refused (duplicate families). */
    duet_admission_options_t o;
    duet_admission_options_default(&o);
    o.metrics = reg;
    duet_admission_t *adm2 = NULL;
    cr_expect_eq(duet_admission_create(&o, &adm2), DUET_ERR_INVALID);
    duet_admission_destroy(adm);
    duet_metrics_destroy(reg);
}

Test(admission, config_keys_parse_in_a_table)
{
    static const duet_config_key_t keys[] = {DUET_ADMISSION_CONFIG_KEYS};
    duet_config_t *cfg = NULL;
    cr_assert_eq(duet_config_create(keys, sizeof(keys) / sizeof(keys[0]), &cfg), DUET_OK);
    cr_expect_eq(duet_config_get_int(cfg, "admission.max_inflight"), 64);
    cr_expect_eq(duet_config_get_int(cfg, "admission.max_queue"), 256);
    cr_expect_eq(duet_config_get_int(cfg, "admission.queue_timeout_ms"), 30000);
    duet_config_destroy(cfg);
}

/* ------------------------------------------------------------------ model check */

enum { ST_NEW = 0, ST_RUNNING, ST_QUEUED, ST_DONE };

#define MAXREQ 256

typedef struct {
    /* reference queue: ids in FIFO order with their deadlines and arrival */
    int q[MAXREQ];
    uint64_t q_deadline[MAXREQ], q_enq[MAXREQ];
    int nq;
    int in_flight;
    uint32_t max_inflight, max_queue, worker_slots;
    uint64_t hold; /* no promotion before (a requeue), cleared by a release */
    bool paused, cap;
    uint64_t admitted, queued_total, cancelled, requeued, rejected[DUET_ADMISSION_REASON_COUNT];
    /* per request: state and how many times it ended */
    int state[MAXREQ];
    int ends[MAXREQ];
} ref_t;

/* The header's limit: max_inflight, or worker_slots when set and smaller. */
static int ref_limit(const ref_t *r)
{
    return (int)(r->worker_slots > 0 && r->worker_slots < r->max_inflight ? r->worker_slots
                                                                          : r->max_inflight);
}

static bool ref_live_queued(const ref_t *r, uint64_t now)
{
    for (int i = 0; i < r->nq; i++)
        if (r->q_deadline[i] > now)
            return true;
    return false;
}

static void ref_remove(ref_t *r, int at)
{
    memmove(&r->q[at], &r->q[at + 1], (size_t)(r->nq - at - 1) * sizeof(r->q[0]));
    memmove(&r->q_deadline[at], &r->q_deadline[at + 1],
            (size_t)(r->nq - at - 1) * sizeof(r->q_deadline[0]));
    memmove(&r->q_enq[at], &r->q_enq[at + 1], (size_t)(r->nq - at - 1) * sizeof(r->q_enq[0]));
    r->nq--;
}

/* The next id the reference would promote, removing it; -1 when none. */
static int ref_pop(ref_t *r, uint64_t now)
{
    if (r->paused || !r->cap || r->in_flight >= ref_limit(r) || now < r->hold)
        return -1;
    for (int i = 0; i < r->nq; i++) {
        if (r->q_deadline[i] > now) {
            int id = r->q[i];
            ref_remove(r, i);
            r->in_flight++;
            r->admitted++;
            r->state[id] = ST_RUNNING;
            return id;
        }
    }
    return -1;
}

typedef struct {
    int ids[MAXREQ];
    int n;
    ref_t *ref;
} mc_expired_t;

static void mc_on_expired(void *handle, uint64_t waited_ms, void *user)
{
    mc_expired_t *e = user;
    e->ids[e->n++] = (int)(uintptr_t)handle - 1;
}

static void mc_compare_stats(duet_admission_t *adm, const ref_t *r, int seq, int step)
{
    duet_admission_stats_t s;
    duet_admission_stats(adm, &s);
    cr_assert_eq(s.in_flight, (uint32_t)r->in_flight, "seq %d step %d: in_flight", seq, step);
    cr_assert_eq(s.queued, (uint32_t)r->nq, "seq %d step %d: queued", seq, step);
    cr_assert_eq(s.max_inflight, r->max_inflight);
    cr_assert_eq(s.max_queue, r->max_queue);
    cr_assert_eq(s.worker_slots, r->worker_slots);
    cr_assert_eq(s.limit, (uint32_t)ref_limit(r), "seq %d step %d: limit", seq, step);
    cr_assert_eq(s.paused, r->paused);
    cr_assert_eq(s.has_capacity, r->cap);
    cr_assert_eq(s.admitted_total, r->admitted, "seq %d step %d: admitted", seq, step);
    cr_assert_eq(s.queued_total, r->queued_total);
    cr_assert_eq(s.cancelled_total, r->cancelled);
    cr_assert_eq(s.requeued_total, r->requeued, "seq %d step %d: requeued", seq, step);
    cr_assert_eq(s.hold_until_ms, r->hold, "seq %d step %d: hold", seq, step);
    for (int k = 0; k < DUET_ADMISSION_REASON_COUNT; k++)
        cr_assert_eq(s.rejected_total[k], r->rejected[k], "seq %d step %d: rejected[%d]", seq, step,
                     k);
}

/* Hand out promotions from both sides and compare them. */
static void mc_pop_all(duet_admission_t *adm, ref_t *r, uint64_t now, int seq, int step)
{
    for (;;) {
        int pre = r->in_flight;
        int want = ref_pop(r, now);
        void *got = NULL;
        bool ok = duet_admission_pop_ready(adm, now, &got);
        cr_assert_eq(ok, want >= 0, "seq %d step %d: pop_ready", seq, step);
        if (!ok)
            return;
        cr_assert_eq(got, H(want + 1), "seq %d step %d: FIFO promotion", seq, step);
        cr_assert_lt(pre, ref_limit(r), "promoted above the limit");
    }
}

static void model_check_one(int seq, unsigned *rng)
{
    duet_admission_options_t o;
    duet_admission_options_default(&o);
    o.max_inflight = 1 + (uint32_t)(rand_r(rng) % 4);
    o.max_queue = (uint32_t)(rand_r(rng) % 5);
    o.has_capacity = true;
    duet_admission_t *adm = NULL;
    cr_assert_eq(duet_admission_create(&o, &adm), DUET_OK);
    static ref_t R;
    memset(&R, 0, sizeof(R));
    ref_t *r = &R;
    r->max_inflight = o.max_inflight;
    r->max_queue = o.max_queue;
    r->cap = true;
    int next_id = 0;
    uint64_t now = 0;
    int steps = 20 + rand_r(rng) % 60;
    for (int step = 0; step < steps && next_id < MAXREQ - 1; step++) {
        now += (uint64_t)(rand_r(rng) % 8);
        int op = rand_r(rng) % 100;
        if (op < 35) { /* a new request */
            int id = next_id++;
            uint64_t deadline = now + (uint64_t)(rand_r(rng) % 40);
            duet_admission_result_t res;
            cr_assert_eq(duet_admission_try_admit(adm, H(id + 1), now, deadline, &res), DUET_OK);
            duet_admission_verdict_t want;
            if (r->paused) {
                want = DUET_ADMISSION_REJECT_PAUSED;
                r->rejected[DUET_ADMISSION_REASON_PAUSED]++;
                r->state[id] = ST_DONE;
                r->ends[id]++;
            } else if (!r->cap) {
                want = DUET_ADMISSION_REJECT_NO_CAPACITY;
                r->rejected[DUET_ADMISSION_REASON_NO_CAPACITY]++;
                r->state[id] = ST_DONE;
                r->ends[id]++;
            } else if (r->in_flight < ref_limit(r) && now >= r->hold && !ref_live_queued(r, now)) {
                want = DUET_ADMISSION_ADMIT;
                r->in_flight++;
                r->admitted++;
                r->state[id] = ST_RUNNING;
            } else if (r->nq < (int)r->max_queue && deadline > now) {
                want = DUET_ADMISSION_QUEUED;
                r->q[r->nq] = id;
                r->q_deadline[r->nq] = deadline;
                r->q_enq[r->nq] = now;
                r->nq++;
                r->queued_total++;
                r->state[id] = ST_QUEUED;
            } else {
                want = DUET_ADMISSION_REJECT_FULL;
                r->rejected[DUET_ADMISSION_REASON_QUEUE_FULL]++;
                r->state[id] = ST_DONE;
                r->ends[id]++;
            }
            cr_assert_eq(res.verdict, want, "seq %d step %d: verdict %s, want %s", seq, step,
                         duet_admission_verdict_name(res.verdict),
                         duet_admission_verdict_name(want));
            cr_assert_eq(res.verdict >= DUET_ADMISSION_REJECT_FULL, res.retry_after_s >= 1);
        } else if (op < 60) { /* a running request ends */
            int running[MAXREQ], n = 0;
            for (int i = 0; i < next_id; i++)
                if (r->state[i] == ST_RUNNING)
                    running[n++] = i;
            if (n == 0)
                continue;
            int id = running[rand_r(rng) % n];
            r->state[id] = ST_DONE;
            r->ends[id]++;
            r->in_flight--;
            r->hold = 0;
            int want = ref_pop(r, now);
            void *got = NULL;
            bool ok = duet_admission_release(adm, now, &got);
            cr_assert_eq(ok, want >= 0, "seq %d step %d: release promotion", seq, step);
            if (ok)
                cr_assert_eq(got, H(want + 1), "seq %d step %d: FIFO promotion", seq, step);
        } else if (op < 72) { /* the expiry timer */
            mc_expired_t e = {.n = 0};
            size_t n = duet_admission_expire(adm, now, mc_on_expired, &e);
            cr_assert_eq(n, (size_t)e.n);
            int k = 0;
            for (int i = 0; i < r->nq;) {
                if (r->q_deadline[i] <= now) {
                    cr_assert(k < e.n, "seq %d step %d: expiry missed", seq, step);
                    cr_assert_eq(e.ids[k], r->q[i], "seq %d step %d: expiry order", seq, step);
                    r->state[r->q[i]] = ST_DONE;
                    r->ends[r->q[i]]++;
                    r->rejected[DUET_ADMISSION_REASON_EXPIRED]++;
                    ref_remove(r, i);
                    k++;
                } else {
                    i++;
                }
            }
            cr_assert_eq(k, e.n, "seq %d step %d: extra expiries", seq, step);
            mc_pop_all(adm, r, now, seq, step); /* the same timer sees a hold end */
        } else if (op < 80) {                   /* a client goes away */
            int id = next_id > 0 ? rand_r(rng) % next_id : 0;
            duet_status_t st = duet_admission_cancel(adm, H(id + 1));
            int at = -1;
            for (int i = 0; i < r->nq; i++)
                if (r->q[i] == id)
                    at = i;
            cr_assert_eq(st, at >= 0 ? DUET_OK : DUET_ERR_NOT_FOUND, "seq %d step %d: cancel", seq,
                         step);
            if (at >= 0) {
                ref_remove(r, at);
                r->state[id] = ST_DONE;
                r->ends[id]++;
                r->cancelled++;
            }
        } else if (op < 85) {
            duet_admission_pause(adm);
            r->paused = true;
        } else if (op < 90) {
            duet_admission_resume(adm);
            r->paused = false;
            mc_pop_all(adm, r, now, seq, step);
        } else if (op < 92) {
            bool cap = rand_r(rng) % 3 != 0;
            duet_admission_set_capacity(adm, cap);
            r->cap = cap;
            if (cap)
                mc_pop_all(adm, r, now, seq, step);
        } else if (op < 94) { /* every worker refused a running request: it waits again */
            int running[MAXREQ], n = 0;
            for (int i = 0; i < next_id; i++)
                if (r->state[i] == ST_RUNNING)
                    running[n++] = i;
            if (n == 0)
                continue;
            const int id = running[rand_r(rng) % n];
            const uint64_t deadline = now + (uint64_t)(rand_r(rng) % 30),
                           hold = now + (uint64_t)(rand_r(rng) % 12);
            const duet_status_t st = duet_admission_requeue(adm, H(id + 1), now, deadline, hold);
            const bool room = r->nq < (int)r->max_queue && deadline > now;
            cr_assert_eq(st, room ? DUET_OK : DUET_ERR_RANGE, "seq %d step %d: requeue", seq, step);
            if (room) {
                memmove(&r->q[1], &r->q[0], (size_t)r->nq * sizeof(r->q[0]));
                memmove(&r->q_deadline[1], &r->q_deadline[0],
                        (size_t)r->nq * sizeof(r->q_deadline[0]));
                memmove(&r->q_enq[1], &r->q_enq[0], (size_t)r->nq * sizeof(r->q_enq[0]));
                r->q[0] = id;
                r->q_deadline[0] = deadline;
                r->q_enq[0] = now;
                r->nq++;
                r->in_flight--;
                r->requeued++;
                if (hold > r->hold)
                    r->hold = hold;
                r->state[id] = ST_QUEUED;
            }
        } else if (op < 96) { /* a generation worker comes or goes */
            const uint32_t ws = (uint32_t)(rand_r(rng) % 6);
            duet_admission_set_worker_slots(adm, ws);
            r->worker_slots = ws;
            mc_pop_all(adm, r, now, seq, step);
        } else {
            uint32_t mi = 1 + (uint32_t)(rand_r(rng) % 5), mq = (uint32_t)(rand_r(rng) % 6);
            cr_assert_eq(duet_admission_set_limits(adm, mi, mq), DUET_OK);
            r->max_inflight = mi;
            r->max_queue = mq;
            mc_pop_all(adm, r, now, seq, step);
        }
        mc_compare_stats(adm, r, seq, step);
        uint64_t d;
        bool any = duet_admission_next_deadline(adm, &d);
        cr_assert_eq(any, r->nq > 0);
        if (any) {
            uint64_t best = r->q_deadline[0];
            for (int i = 1; i < r->nq; i++)
                if (r->q_deadline[i] < best)
                    best = r->q_deadline[i];
            cr_assert_eq(d, best);
        }
    }

    /* Drain: everything queued ends by promotion or expiry, everything running is released. */
    duet_admission_resume(adm);
    r->paused = false;
    duet_admission_set_capacity(adm, true);
    r->cap = true;
    mc_pop_all(adm, r, now, seq, -1);
    for (int guard = 0; guard < 4 * MAXREQ; guard++) {
        int id = -1;
        for (int i = 0; i < next_id && id < 0; i++)
            if (r->state[i] == ST_RUNNING)
                id = i;
        if (id < 0)
            break;
        r->state[id] = ST_DONE;
        r->ends[id]++;
        r->in_flight--;
        r->hold = 0;
        int want = ref_pop(r, now);
        void *got = NULL;
        cr_assert_eq(duet_admission_release(adm, now, &got), want >= 0);
        if (want >= 0)
            cr_assert_eq(got, H(want + 1));
    }
    mc_expired_t e = {.n = 0};
    duet_admission_expire(adm, UINT64_MAX, mc_on_expired, &e);
    for (int k = 0; k < e.n; k++) {
        cr_assert_eq(r->state[e.ids[k]], ST_QUEUED, "expired a request not queued");
        r->state[e.ids[k]] = ST_DONE;
        r->ends[e.ids[k]]++;
        r->rejected[DUET_ADMISSION_REASON_EXPIRED]++;
    }
    r->nq -= e.n;
    duet_admission_stats_t s;
    duet_admission_stats(adm, &s);
    cr_assert_eq(s.in_flight, 0);
    cr_assert_eq(s.queued, 0);
    for (int i = 0; i < next_id; i++)
        cr_assert_eq(r->ends[i], 1, "seq %d: request %d ended %d times (state %d)", seq, i,
                     r->ends[i], r->state[i]);
    /* Conservation: every request is counted once in the totals. */
    uint64_t rejected_new = s.rejected_total[DUET_ADMISSION_REASON_QUEUE_FULL] +
                            s.rejected_total[DUET_ADMISSION_REASON_PAUSED] +
                            s.rejected_total[DUET_ADMISSION_REASON_NO_CAPACITY];
    /* (a requeued request is admitted again, expires or is cancelled: it counts once) */
    cr_assert_eq(s.admitted_total - s.requeued_total + rejected_new +
                     s.rejected_total[DUET_ADMISSION_REASON_EXPIRED] + s.cancelled_total,
                 (uint64_t)next_id, "seq %d: conservation", seq);
    duet_admission_destroy(adm);
}

Test(admission, model_check_random_sequences, .timeout = 120)
{
    unsigned rng = 20240611u;
    for (int seq = 0; seq < 4000; seq++)
        model_check_one(seq, &rng);
}
