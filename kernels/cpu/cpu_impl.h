/*
 * cpu_impl.h: internals of the CPU backend shared by the kernels/cpu sources (and by the CPU kernel
 * tests, which force each ISA path in turn). Not part of the public API.
 *
 * The pool: n_threads - 1 persistent workers plus the calling thread. A job is a function over
 * task indices [0, n_tasks); threads claim tasks with a CAS on one 64-bit word that holds the
 * job's generation (high 32 bits) and the next task index (low 32 bits), so a worker that wakes
 * late can never claim a task of a later job with the function of an earlier one. Workers spin
 * briefly after each job (decode issues hundreds of small ops per token, and a futex wake costs
 * more than the op) and then sleep on a condition variable.
 */
#ifndef DUET_KERNELS_CPU_IMPL_H
#define DUET_KERNELS_CPU_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "kernels/cpu/isa.h"
#include "kernels/kernels.h"

typedef void (*duet__task_fn)(void *ctx, int64_t task, int thread_idx);

typedef struct duet__worker {
    struct duet_kernels *k;
    pthread_t tid;
    int idx; /* 1..n_threads-1; the caller is 0 */
} duet__worker_t;

struct duet_kernels {
    duet_device_kind_t device;
    int n_threads;
    duet__isa_t isa;

    /* pool */
    duet__worker_t *workers; /* owned, n_threads - 1 entries */
    int n_started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    _Atomic uint32_t gen;   /* bumped once per job; workers watch it */
    _Atomic uint64_t claim; /* (gen << 32) | next task index */
    _Atomic int64_t n_done; /* tasks finished in the current job */
    _Atomic int n_sleeping; /* workers blocked (or about to block) on cv */
    _Atomic int busy;       /* a job is being dispatched (one caller at a time) */
    _Atomic int stop;
    duet__task_fn fn; /* current job, valid while its tasks run */
    void *ctx;
    /* read by a worker before its claim succeeds, which may be while the caller writes the next
     * job's count (its CAS then fails): atomic, relaxed, so the read is not a data race */
    _Atomic int64_t n_tasks;
    int64_t spin_ns; /* how long an idle worker spins before sleeping */

    const duet_tune_t *tuner; /* not owned; NULL: every matmul takes the default split */
};

/*
 * Run fn(ctx, t, thread_idx) for every t in [0, n_tasks) on the pool; returns when all are done.
 * Runs inline on the calling thread when n_tasks == 1, the pool has one thread, or when called
 * from inside a task (nested use).
 */
void duet__pool_run(struct duet_kernels *k, int64_t n_tasks, duet__task_fn fn, void *ctx);

/*
 * Force the matmul path of `k` (tests and benchmarks). Returns DUET_ERR_UNSUPPORTED when the CPU
 * lacks the ISA.
 */
duet_status_t duet__kernels_cpu_set_isa(struct duet_kernels *k, duet__isa_t isa);

/* The matmul's split tactics (matmul.c): 0 .. DUET__MM_TACTICS - 1. */
#define DUET__MM_TACTICS 13
/* duet__matmul_tactic's `tactic` that means: the tuner's choice, else the default. */
#define DUET__MM_LOOKUP (-2)

/*
 * duet_k_matmul with the split forced: `tactic` in [0, DUET__MM_TACTICS), -1 for the default
 * split, DUET__MM_LOOKUP for duet_k_matmul's own choice (tests and the tuner's profiling).
 */
duet_status_t duet__matmul_tactic(struct duet_kernels *k, float *y, int64_t ldy, const float *x,
                                  int64_t ldx, int64_t M, const duet_tensor_t *w, int accumulate,
                                  int tactic);
/* The tactic the tuner of k holds for an M-row product with w, or -1 (none). */
int duet__matmul_tactic_for(const struct duet_kernels *k, int64_t M, const duet_tensor_t *w);

#endif
