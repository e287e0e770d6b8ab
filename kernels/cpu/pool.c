/*
 * pool.c: the CPU backend instance and its persistent worker pool.
 *
 * Workers are created once in duet_kernels_create and live until destroy. A job is published by
 * bumping `gen`; every thread (the caller included) then claims task indices with a CAS on
 * `claim` = (gen << 32) | next, which fails for a thread still looking at an older job, so no
 * thread ever runs a task with another job's function. The caller spins until `n_done` reaches
 * the task count. Before it rewrites the job's fields it closes the claim (the new gen, next at
 * DUET__CLAIM_CLOSED): a worker that read the old claim and is about to compare it with the new
 * task count would otherwise win its CAS on the old value and run, and count, a task twice. Idle
 * workers spin for `spin_ns` (DUET_SPIN_US, default 200 us) before they sleep on the condition
 * variable: a decode step issues ops back to back, and waking a sleeping thread costs several
 * microseconds, more than many of those ops take.
 *
 * Sleep/wake is a Dekker pattern on two seq_cst atomics: a worker increments n_sleeping, then
 * re-reads gen under the mutex before waiting; the caller stores gen, then reads n_sleeping and
 * broadcasts under the mutex when it is non-zero. One of the two always sees the other's store.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <sched.h>

#include "common/log.h"
#include "kernels/cpu/cpu_impl.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DUET__PAUSE() _mm_pause()
#else
#define DUET__PAUSE() ((void)0)
#endif

/* The pool whose task this thread is running (NULL outside tasks), and its thread index. */
static _Thread_local struct duet_kernels *duet__tls_in_task;
static _Thread_local int duet__tls_thread_idx;

static int64_t duet__now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* The claim's `next` while a job's fields are being written: past every task count. */
#define DUET__CLAIM_CLOSED 0xffffffffu

/* Claim and run tasks of job `gen` until none are left. */
static void duet__pool_work(struct duet_kernels *k, uint32_t gen, int thread_idx)
{
    uint64_t c = atomic_load_explicit(&k->claim, memory_order_acquire);
    for (;;) {
        if ((uint32_t)(c >> 32) != gen || (uint32_t)c == DUET__CLAIM_CLOSED)
            return;
        int64_t t = (int64_t)(c & 0xffffffffu);
        if (t >= atomic_load_explicit(&k->n_tasks, memory_order_relaxed))
            return;
        if (!atomic_compare_exchange_weak_explicit(&k->claim, &c, c + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        /* Our task is unfinished, so the caller cannot have moved on: fn and ctx are this job's. */
        k->fn(k->ctx, t, thread_idx);
        atomic_fetch_add_explicit(&k->n_done, 1, memory_order_release);
        c = atomic_load_explicit(&k->claim, memory_order_acquire);
    }
}

static void *duet__worker_main(void *arg)
{
    duet__worker_t *wk = arg;
    struct duet_kernels *k = wk->k;
    uint32_t seen = atomic_load(&k->gen);

    duet__tls_in_task = k;
    duet__tls_thread_idx = wk->idx;
    for (;;) {
        uint32_t g = atomic_load_explicit(&k->gen, memory_order_acquire);
        int64_t deadline = 0;
        int spins = 0;
        while (g == seen) {
            DUET__PAUSE();
            if (++spins == 256) {
                spins = 0;
                /* Cheap when the CPU is ours; hands it over when the machine is oversubscribed. */
                sched_yield();
                int64_t now = duet__now_ns();
                if (deadline == 0) {
                    deadline = now + k->spin_ns;
                } else if (now >= deadline) {
                    pthread_mutex_lock(&k->mu);
                    atomic_fetch_add(&k->n_sleeping, 1);
                    while ((g = atomic_load(&k->gen)) == seen && atomic_load(&k->stop) == 0)
                        pthread_cond_wait(&k->cv, &k->mu);
                    atomic_fetch_sub(&k->n_sleeping, 1);
                    pthread_mutex_unlock(&k->mu);
                    break;
                }
            }
            g = atomic_load_explicit(&k->gen, memory_order_acquire);
        }
        if (atomic_load(&k->stop) != 0)
            return NULL;
        seen = g;
        duet__pool_work(k, g, wk->idx);
    }
}

void duet__pool_run(struct duet_kernels *k, int64_t n_tasks, duet__task_fn fn, void *ctx)
{
    if (n_tasks <= 0)
        return;
    if (n_tasks == 1 || k->n_threads == 1 || duet__tls_in_task != NULL) {
        int idx = duet__tls_in_task != NULL ? duet__tls_thread_idx : 0;
        for (int64_t t = 0; t < n_tasks; t++)
            fn(ctx, t, idx);
        return;
    }
    DUET_ASSERT(n_tasks < (int64_t)DUET__CLAIM_CLOSED);
    /* One dispatcher at a time: two threads sharing one instance is a bug in the caller. */
    DUET_ASSERT(atomic_exchange(&k->busy, 1) == 0);

    uint32_t gen = atomic_load_explicit(&k->gen, memory_order_relaxed) + 1;
    /* a worker still holding the last job's claim value fails its CAS from here on */
    atomic_store(&k->claim, ((uint64_t)gen << 32) | DUET__CLAIM_CLOSED);
    k->fn = fn;
    k->ctx = ctx;
    atomic_store_explicit(&k->n_tasks, n_tasks, memory_order_relaxed);
    atomic_store_explicit(&k->n_done, 0, memory_order_relaxed);
    atomic_store_explicit(&k->claim, (uint64_t)gen << 32, memory_order_release);
    atomic_store(&k->gen, gen); /* seq_cst: pairs with the workers' n_sleeping increment */
    if (atomic_load(&k->n_sleeping) > 0) {
        pthread_mutex_lock(&k->mu);
        pthread_cond_broadcast(&k->cv);
        pthread_mutex_unlock(&k->mu);
    }

    duet__tls_in_task = k;
    duet__tls_thread_idx = 0;
    duet__pool_work(k, gen, 0);
    duet__tls_in_task = NULL;

    int spins = 0;
    while (atomic_load_explicit(&k->n_done, memory_order_acquire) < n_tasks) {
        DUET__PAUSE();
        if (++spins >= 256) { /* a worker may be descheduled mid-task: let it run */
            spins = 0;
            sched_yield();
        }
    }
    atomic_store_explicit(&k->busy, 0, memory_order_release);
}

typedef struct {
    duet_k_task_fn fn;
    void *ctx;
    int64_t n;
    int64_t n_tasks;
} duet__pfor_t;

static void duet__pfor_task(void *ctx, int64_t t, int thread_idx)
{
    const duet__pfor_t *p = ctx;
    int64_t begin = p->n * t / p->n_tasks;
    int64_t end = p->n * (t + 1) / p->n_tasks;
    p->fn(p->ctx, begin, end, thread_idx);
}

void duet_k_parallel_for(duet_kernels_t *k, int64_t n, int64_t grain, duet_k_task_fn fn, void *ctx)
{
    if (n <= 0)
        return;
    if (grain < 1)
        grain = 1;
    /* Ranges of n / n_tasks >= grain items; a few per thread so a slow thread is covered. */
    int64_t n_tasks = n / grain;
    int64_t max = (int64_t)k->n_threads * 4;
    if (n_tasks > max)
        n_tasks = max;
    if (n_tasks < 1)
        n_tasks = 1;
    if (n_tasks == 1 || k->n_threads == 1) {
        int idx = duet__tls_in_task != NULL ? duet__tls_thread_idx : 0;
        fn(ctx, 0, n, idx);
        return;
    }
    duet__pfor_t p = {.fn = fn, .ctx = ctx, .n = n, .n_tasks = n_tasks};
    duet__pool_run(k, n_tasks, duet__pfor_task, &p);
}

typedef struct {
    duet_k_task_fn fn;
    void *ctx;
} duet__each_t;

static void duet__each_task(void *ctx, int64_t t, int thread_idx)
{
    const duet__each_t *p = ctx;
    p->fn(p->ctx, t, t + 1, thread_idx);
}

void duet_k_parallel_each(duet_kernels_t *k, int64_t n, duet_k_task_fn fn, void *ctx)
{
    if (n <= 0)
        return;
    duet__each_t p = {.fn = fn, .ctx = ctx};
    duet__pool_run(k, n, duet__each_task, &p);
}

/* ---- instance ------------------------------------------------------------------------------ */

static int duet__default_threads(void)
{
    const char *env = getenv("DUET_THREADS");
    if (env != NULL && env[0] != '\0') {
        char *end = NULL;
        long v = strtol(env, &end, 10);
        if (end != NULL && *end == '\0' && v > 0 && v <= 4096)
            return (int)v;
        DUET_LOG_WARN("DUET_THREADS=%s is not a thread count; using the online CPUs", env);
    }
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static void duet__pool_stop(struct duet_kernels *k)
{
    pthread_mutex_lock(&k->mu);
    atomic_store(&k->stop, 1);
    atomic_fetch_add(&k->gen, 1);
    pthread_cond_broadcast(&k->cv);
    pthread_mutex_unlock(&k->mu);
    for (int i = 0; i < k->n_started; i++)
        pthread_join(k->workers[i].tid, NULL);
    k->n_started = 0;
}

duet_status_t duet_kernels_create(duet_device_kind_t dev, int n_threads, duet_kernels_t **k_p)
{
    if (dev == DUET_DEVICE_CUDA)
        return duet_error_set(DUET_ERR_UNSUPPORTED,
                              "kernels: a duet_kernels_t is the CPU backend; the CUDA kernels "
                              "take a stream (kernels/cuda) and are driven by the engine's CUDA "
                              "backend (engine/backend_cuda.c)");
    if (dev != DUET_DEVICE_CPU)
        return duet_error_set(DUET_ERR_INVALID, "kernels: unknown device kind %d", (int)dev);
    if (n_threads < 0)
        return duet_error_set(DUET_ERR_INVALID, "kernels: n_threads %d < 0", n_threads);
    if (n_threads == 0)
        n_threads = duet__default_threads();

    struct duet_kernels *k = calloc(1, sizeof(*k));
    if (k == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "kernels: out of memory");
    k->device = dev;
    k->n_threads = n_threads;
    k->isa = duet__isa_detect();
    k->spin_ns = 200000;
    const char *spin = getenv("DUET_SPIN_US");
    if (spin != NULL && spin[0] != '\0')
        k->spin_ns = (int64_t)strtol(spin, NULL, 10) * 1000;
    const char *isa = getenv("DUET_KERNELS_ISA");
    if (isa != NULL && isa[0] != '\0') {
        int want = -1;
        for (int i = DUET__ISA_SCALAR; i <= DUET__ISA_AVX512; i++)
            if (strcmp(isa, duet__isa_name((duet__isa_t)i)) == 0)
                want = i;
        if (want < 0)
            DUET_LOG_WARN("ignoring DUET_KERNELS_ISA=%s (scalar, avx2 or avx512)", isa);
        else if ((duet__isa_t)want < k->isa)
            k->isa = (duet__isa_t)want;
    }

    duet_status_t st;
    if (pthread_mutex_init(&k->mu, NULL) != 0) {
        st = duet_error_set(DUET_ERR_INTERNAL, "kernels: pthread_mutex_init failed");
        goto free_k;
    }
    if (pthread_cond_init(&k->cv, NULL) != 0) {
        st = duet_error_set(DUET_ERR_INTERNAL, "kernels: pthread_cond_init failed");
        goto destroy_mu;
    }
    if (n_threads > 1) {
        k->workers = calloc((size_t)(n_threads - 1), sizeof(*k->workers));
        if (k->workers == NULL) {
            st = duet_error_set(DUET_ERR_NOMEM, "kernels: out of memory");
            goto destroy_cv;
        }
        for (int i = 0; i < n_threads - 1; i++) {
            k->workers[i].k = k;
            k->workers[i].idx = i + 1;
            int rc = pthread_create(&k->workers[i].tid, NULL, duet__worker_main, &k->workers[i]);
            if (rc != 0) {
                st = duet_error_set(DUET_ERR_INTERNAL, "kernels: pthread_create: %s", strerror(rc));
                goto stop_workers;
            }
            k->n_started++;
        }
    }
    DUET_LOG_DEBUG("kernels: cpu backend, %d threads, matmul path %s", n_threads,
                   duet__isa_name(k->isa));
    *k_p = k;
    return DUET_OK;

stop_workers:
    duet__pool_stop(k);
    free(k->workers);
destroy_cv:
    pthread_cond_destroy(&k->cv);
destroy_mu:
    pthread_mutex_destroy(&k->mu);
free_k:
    free(k);
    return st;
}

void duet_kernels_destroy(duet_kernels_t *k)
{
    if (k == NULL)
        return;
    duet__pool_stop(k);
    free(k->workers);
    pthread_cond_destroy(&k->cv);
    pthread_mutex_destroy(&k->mu);
    free(k);
}

int duet_kernels_n_threads(const duet_kernels_t *k)
{
    return k->n_threads;
}

duet_device_kind_t duet_kernels_device(const duet_kernels_t *k)
{
    return k->device;
}

const char *duet_kernels_cpu_isa(const duet_kernels_t *k)
{
    return duet__isa_name(k->isa);
}

duet_status_t duet__kernels_cpu_set_isa(struct duet_kernels *k, duet__isa_t isa)
{
    if (isa > duet__isa_detect())
        return duet_error_set(DUET_ERR_UNSUPPORTED, "kernels: this CPU lacks %s",
                              duet__isa_name(isa));
    k->isa = isa;
    return DUET_OK;
}
