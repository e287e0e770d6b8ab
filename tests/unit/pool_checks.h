/*
 * pool_checks.h: the CPU thread pool's checks (kernels/cpu/pool.c: parallel_for, parallel_each,
 * the sleep / wake path, jobs back to back on preempted threads, nested calls), shared by
 * test_kernels_cpu.c (a Criterion suite) and test_pool_threads.c (a plain program, so that the
 * pool can be run under ThreadSanitizer, which Criterion cannot host: docs/sanitizers.md).
 * Header-only; the includer defines CHECK(cond, fmt, ...), which reports a failed check (the
 * Criterion suite stops the test, the program prints it and counts).
 */
#ifndef DUET_TESTS_POOL_CHECKS_H
#define DUET_TESTS_POOL_CHECKS_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels/kernels.h"

static duet_kernels_t *pool_make(int n_threads)
{
    duet_kernels_t *k = NULL;
    duet_status_t st = duet_kernels_create(DUET_DEVICE_CPU, n_threads, &k);
    CHECK(st == DUET_OK, "create with %d threads: %s", n_threads, duet_error_last());
    if (k == NULL)
        exit(1); /* nothing to check without a pool */
    CHECK(duet_kernels_n_threads(k) == n_threads, "%d threads, not %d", duet_kernels_n_threads(k),
          n_threads);
    return k;
}

typedef struct {
    _Atomic int *hits;
    int64_t grain, n;
    int n_threads;
    _Atomic int bad;
    _Atomic int n_ranges;
} pool_pfor_ctx_t;

static void pool_pfor_fn(void *vctx, int64_t begin, int64_t end, int thread_idx)
{
    pool_pfor_ctx_t *c = vctx;
    if (thread_idx < 0 || thread_idx >= c->n_threads || begin >= end ||
        (end - begin < c->grain && end - begin != c->n))
        atomic_store(&c->bad, 1);
    atomic_fetch_add(&c->n_ranges, 1);
    for (int64_t i = begin; i < end; i++)
        atomic_fetch_add(&c->hits[i], 1);
}

/* parallel_for over thread counts, sizes and grains: every index exactly once per call, ranges of
 * at least the grain, thread indices in range; n = 0 runs nothing. Returns the combos run. */
static int pool_check_parallel_for_covers_once(void)
{
    static const int threads[] = {1, 2, 3, 5, 8};
    static const int64_t ns[] = {1, 2, 3, 7, 64, 100, 1000, 4097, 100003};
    static const int64_t grains[] = {0, 1, 3, 16, 1000, 200000};
    int combos = 0;
    for (size_t ti = 0; ti < sizeof(threads) / sizeof(threads[0]); ti++) {
        duet_kernels_t *k = pool_make(threads[ti]);
        for (size_t ni = 0; ni < sizeof(ns) / sizeof(ns[0]); ni++) {
            for (size_t gi = 0; gi < sizeof(grains) / sizeof(grains[0]); gi++) {
                int64_t n = ns[ni], wrong = 0, first = -1;
                pool_pfor_ctx_t c = {
                    .grain = grains[gi] < 1 ? 1 : grains[gi], .n = n, .n_threads = threads[ti]};
                c.hits = calloc((size_t)n, sizeof(*c.hits));
                for (int rep = 0; rep < 3; rep++)
                    duet_k_parallel_for(k, n, grains[gi], pool_pfor_fn, &c);
                for (int64_t i = 0; i < n; i++)
                    if (atomic_load(&c.hits[i]) != 3 && wrong++ == 0)
                        first = i;
                CHECK(wrong == 0,
                      "threads %d n %lld grain %lld: %lld indices not hit 3 times "
                      "(first %lld, hit %d)",
                      threads[ti], (long long)n, (long long)grains[gi], (long long)wrong,
                      (long long)first, first >= 0 ? atomic_load(&c.hits[first]) : 0);
                CHECK(atomic_load(&c.bad) == 0,
                      "threads %d n %lld grain %lld: a bad range or "
                      "thread_idx",
                      threads[ti], (long long)n, (long long)grains[gi]);
                free(c.hits);
                combos++;
            }
        }
        pool_pfor_ctx_t c = {.grain = 1, .n = 0, .n_threads = threads[ti]};
        duet_k_parallel_for(k, 0, 1, pool_pfor_fn, &c);
        CHECK(atomic_load(&c.n_ranges) == 0, "n = 0 ran %d ranges", atomic_load(&c.n_ranges));
        duet_kernels_destroy(k);
    }
    return combos;
}

/* reps tiny jobs back to back on 4 threads whose workers sleep at once (DUET_SPIN_US=0): the
 * condition-variable wake-up path must not lose a job. */
static void pool_check_many_small_jobs(int reps)
{
    setenv("DUET_SPIN_US", "0", 1);
    duet_kernels_t *k = pool_make(4);
    unsetenv("DUET_SPIN_US");
    _Atomic int hits[64];
    long wrong = 0;
    for (int rep = 0; rep < reps; rep++) {
        for (int i = 0; i < 64; i++)
            atomic_store(&hits[i], 0);
        pool_pfor_ctx_t c = {.hits = hits, .grain = 1, .n = 64, .n_threads = 4};
        duet_k_parallel_for(k, 64, 1, pool_pfor_fn, &c);
        for (int i = 0; i < 64; i++)
            wrong += atomic_load(&hits[i]) != 1;
    }
    duet_kernels_destroy(k);
    CHECK(wrong == 0, "%d jobs of 64 tasks: %ld tasks not run exactly once", reps, wrong);
}

typedef struct {
    int *out;
    int job;
    _Atomic int *runs;
} pool_each_ctx_t;

static void pool_each_fn(void *vctx, int64_t begin, int64_t end, int thread_idx)
{
    pool_each_ctx_t *c = vctx;
    (void)thread_idx;
    for (int64_t t = begin; t < end; t++) {
        c->out[t] = c->job;
        atomic_fetch_add(&c->runs[t], 1);
    }
}

static _Atomic int pool_hog_stop;

static void *pool_hog(void *arg)
{
    (void)arg;
    while (!atomic_load_explicit(&pool_hog_stop, memory_order_relaxed))
        ;
    return NULL;
}

/*
 * n_jobs tiny jobs back to back on 2 threads while two busy threads of this process preempt the
 * pool's: each task must run exactly once and every task of a job must have finished when the
 * job returns (out[t], a plain int the task writes, is read after the job without atomics).
 *
 * A worker that read the claim of a job just finished used to win its CAS once the next job's
 * task count was written but before its claim was, and run (and count) a task twice, so the job
 * could return before its last task had run: seen 2-4 times per 2 million jobs on 2 cores with
 * three spinning processes beside them (CI's failing test_engine_generate). With 1000000 jobs this
 * failed 3 runs in 4 on the 2-core build VM before the fix (3-11 tasks run twice per run), after
 * it none of 8. Under ThreadSanitizer far fewer jobs are enough: it reports an unordered access
 * whether or not this run's timing made it give a wrong result.
 */
static void pool_check_jobs_back_to_back(int n_jobs)
{
    unsetenv("DUET_SPIN_US"); /* the default spin, as a decode step has */
    duet_kernels_t *k = pool_make(2);
    pthread_t hogs[2];
    atomic_store(&pool_hog_stop, 0);
    for (int i = 0; i < 2; i++)
        CHECK(pthread_create(&hogs[i], NULL, pool_hog, NULL) == 0, "pthread_create");
    int out[8];
    _Atomic int runs[8];
    long early = 0, twice = 0;
    for (int job = 1; job <= n_jobs; job++) {
        const int n = 2 + job % 5;
        for (int t = 0; t < n; t++)
            atomic_store(&runs[t], 0);
        pool_each_ctx_t c = {.out = out, .job = job, .runs = runs};
        duet_k_parallel_each(k, n, pool_each_fn, &c);
        for (int t = 0; t < n; t++) {
            early += out[t] != job;
            twice += atomic_load(&runs[t]) != 1;
        }
    }
    atomic_store(&pool_hog_stop, 1);
    for (int i = 0; i < 2; i++)
        pthread_join(hogs[i], NULL);
    duet_kernels_destroy(k);
    CHECK(early == 0 && twice == 0,
          "%d jobs: %ld tasks unfinished when their job returned, %ld not run exactly once", n_jobs,
          early, twice);
}

typedef struct {
    duet_kernels_t *k;
    _Atomic int *hits;
} pool_nested_ctx_t;

static void pool_nested_inner(void *vctx, int64_t begin, int64_t end, int thread_idx)
{
    _Atomic int *hits = vctx;
    (void)thread_idx;
    for (int64_t i = begin; i < end; i++)
        atomic_fetch_add(&hits[i], 1);
}

static void pool_nested_outer(void *vctx, int64_t begin, int64_t end, int thread_idx)
{
    pool_nested_ctx_t *c = vctx;
    (void)thread_idx;
    for (int64_t i = begin; i < end; i++)
        duet_k_parallel_for(c->k, 100, 1, pool_nested_inner, c->hits + i * 100);
}

/* parallel_for called from inside a task runs inline on that thread: every index once. */
static void pool_check_nested_runs_inline(void)
{
    duet_kernels_t *k = pool_make(3);
    _Atomic int *hits = calloc(1000, sizeof(*hits));
    pool_nested_ctx_t c = {.k = k, .hits = hits};
    duet_k_parallel_for(k, 10, 1, pool_nested_outer, &c);
    int wrong = 0;
    for (int i = 0; i < 1000; i++)
        wrong += atomic_load(&hits[i]) != 1;
    CHECK(wrong == 0, "nested parallel_for: %d of 1000 indices not hit once", wrong);
    free(hits);
    duet_kernels_destroy(k);
}

#endif /* DUET_TESTS_POOL_CHECKS_H */
