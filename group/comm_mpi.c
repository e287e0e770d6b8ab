/*
 * comm_mpi.c: the "mpi" transport of common/comm.h over Open MPI, for a generation group's CPU
 * ranks, and the process-level MPI setup (group/comm_mpi.h).
 *
 * Each op starts the nonblocking collective and polls it (group/poll.h) until it completes or
 * the communicator's timeout passes; then the communicator is broken, and every later op fails
 * at once. The data goes through a staging area the communicator owns (comm_mpi.h says why), and
 * a broken communicator is never freed: destroy moves it, with everything a pending collective may
 * touch and the collective's request, to a list the process keeps until it exits (so the memory is
 * still there for MPI, and LeakSanitizer sees it held rather than lost).
 */
#include "group/comm_mpi.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <string.h>

#include <mpi.h>

#include "group/poll.h"

/* The receive part of the staging area starts on this boundary (floats, uint64). */
#define DUET__MPI_STAGE_ALIGN 64

typedef struct duet__mpi {
    duet_comm_t base;
    MPI_Comm comm;
    int broken; /* an op failed or timed out: every later op fails, destroy abandons it */
    char *stage;
    size_t stage_cap;
    int *counts;         /* 4 * size: send counts, send displs, recv counts, recv displs */
    MPI_Request pending; /* the collective a timeout left running (MPI_REQUEST_NULL if none) */
    struct duet__mpi *next_abandoned;
} duet__mpi_t;

/* Broken communicators, kept (never freed) for the collectives they may have pending: MPI can
 * neither cancel nor free those, and writes the staging area if the late rank arrives. Only the
 * MPI thread touches the list (MPI_THREAD_FUNNELED). */
static duet__mpi_t *duet__mpi_abandoned;

/* Keep m and what it owns until the process exits (see duet__mpi_abandoned). */
static void duet__mpi_abandon(duet__mpi_t *m)
{
    m->next_abandoned = duet__mpi_abandoned;
    duet__mpi_abandoned = m;
}

static const duet_comm_ops_t duet__mpi_ops;

static size_t duet__mpi_align(size_t n)
{
    return (n + DUET__MPI_STAGE_ALIGN - 1) / DUET__MPI_STAGE_ALIGN * DUET__MPI_STAGE_ALIGN;
}

/* An MPI call failed: the communicator is broken, and the detail carries MPI's own words. */
static duet_status_t duet__mpi_fail(duet__mpi_t *m, const char *op, const char *call, int rc)
{
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS)
        snprintf(msg, sizeof(msg), "MPI error %d", rc);
    m->broken = 1;
    return duet_error_set(DUET_ERR_TRANSPORT, "comm mpi: %s failed in %s (rank %d of %d): %s", op,
                          call, m->base.rank, m->base.size, msg);
}

/* What every op checks first: the communicator is healthy and this is MPI's thread. */
static duet_status_t duet__mpi_enter(duet__mpi_t *m, const char *op)
{
    if (m->broken)
        return duet_error_set(DUET_ERR_TRANSPORT,
                              "comm mpi: %s on a communicator an earlier error broke "
                              "(rank %d of %d); it can only be destroyed",
                              op, m->base.rank, m->base.size);
    int main_thread = 0;
    MPI_Is_thread_main(&main_thread);
    if (!main_thread)
        return duet_error_set(DUET_ERR_INVALID,
                              "comm mpi: %s called from a thread other than the one that "
                              "initialised MPI (MPI_THREAD_FUNNELED)",
                              op);
    return DUET_OK;
}

/* Waits for *req until the communicator's timeout; past it the communicator is broken. */
static duet_status_t duet__mpi_wait(duet__mpi_t *m, MPI_Request *req, const char *op)
{
    duet__poll_t p;
    duet__poll_start(&p, m->base.timeout_ms);
    for (;;) {
        int done = 0;
        const int rc = MPI_Test(req, &done, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS)
            return duet__mpi_fail(m, op, "MPI_Test", rc);
        if (done)
            return DUET_OK;
        if (duet__poll_expired(&p)) {
            m->broken = 1;
            m->pending = *req; /* still running: kept with m (duet__mpi_abandon) */
            return duet_error_set(DUET_ERR_TIMEOUT,
                                  "comm mpi: %s timed out after %lld ms waiting for the other "
                                  "ranks (rank %d of a communicator of %d, timeout_ms %lld); "
                                  "the communicator is broken",
                                  op, (long long)duet__poll_elapsed_ms(&p), m->base.rank,
                                  m->base.size, (long long)m->base.timeout_ms);
        }
        if (m->base.on_wait != NULL) /* the rank's other duties (a follower's UCX progress) */
            m->base.on_wait(m->base.on_wait_user);
        duet__poll_pause(&p);
    }
}

/* A staging area of at least `bytes`; only ever grown on a healthy communicator (no collective
 * pending), so the old area can go. */
static duet_status_t duet__mpi_stage(duet__mpi_t *m, size_t bytes, const char *op)
{
    if (bytes <= m->stage_cap)
        return DUET_OK;
    char *s = aligned_alloc(DUET__MPI_STAGE_ALIGN, duet__mpi_align(bytes));
    if (s == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "comm mpi: %s: no memory for %zu staging bytes", op,
                              bytes);
    free(m->stage);
    m->stage = s;
    m->stage_cap = duet__mpi_align(bytes);
    return DUET_OK;
}

static duet_status_t duet__mpi_check_count(duet__mpi_t *m, const char *op, const char *what,
                                           size_t bytes)
{
    if (bytes > (size_t)INT_MAX)
        return duet_error_set(DUET_ERR_RANGE,
                              "comm mpi: %s of %zu bytes (%s) exceeds MPI's int count "
                              "(at most %d bytes; rank %d of %d)",
                              op, bytes, what, INT_MAX, m->base.rank, m->base.size);
    return DUET_OK;
}

/* Every rank's `bytes` bytes of send, in rank order, into the staging area at *out. */
static duet_status_t duet__mpi_allgather_stage(duet__mpi_t *m, const char *op, const void *send,
                                               size_t bytes, char **out)
{
    DUET_TRY(duet__mpi_check_count(m, op, "per rank", bytes));
    const size_t off = duet__mpi_align(bytes);
    DUET_TRY(duet__mpi_stage(m, off + (size_t)m->base.size * bytes, op));
    if (bytes > 0)
        memcpy(m->stage, send, bytes);
    MPI_Request req;
    const int rc = MPI_Iallgather(m->stage, (int)bytes, MPI_BYTE, m->stage + off, (int)bytes,
                                  MPI_BYTE, m->comm, &req);
    if (rc != MPI_SUCCESS)
        return duet__mpi_fail(m, op, "MPI_Iallgather", rc);
    DUET_TRY(duet__mpi_wait(m, &req, op));
    *out = m->stage + off;
    return DUET_OK;
}

static duet_status_t duet__mpi_allgather(duet_comm_t *c, const void *send, void *recv, size_t bytes)
{
    duet__mpi_t *m = (duet__mpi_t *)c;
    DUET_TRY(duet__mpi_enter(m, "allgather"));
    if (bytes > 0 && (send == NULL || recv == NULL))
        return duet_error_set(DUET_ERR_INVALID, "comm mpi: allgather of %zu bytes with no buffer",
                              bytes);
    char *out = NULL;
    DUET_TRY(duet__mpi_allgather_stage(m, "allgather", send, bytes, &out));
    if (bytes > 0)
        memcpy(recv, out, (size_t)c->size * bytes);
    return DUET_OK;
}

static duet_status_t duet__mpi_allreduce(duet_comm_t *c, float *buf, int64_t n, float *scratch)
{
    /* the staging area plays the part of scratch (comm_mpi.h: the caller's memory must not be
     * where a collective that may outlive the op writes) */
    (void)scratch;
    duet__mpi_t *m = (duet__mpi_t *)c;
    DUET_TRY(duet__mpi_enter(m, "allreduce_sum_f32"));
    if (n < 0 || (n > 0 && buf == NULL))
        return duet_error_set(DUET_ERR_INVALID,
                              "comm mpi: allreduce_sum_f32 of %lld floats at %p (rank %d of %d)",
                              (long long)n, (void *)buf, c->rank, c->size);
    if ((uint64_t)n > (uint64_t)INT_MAX / sizeof(float))
        return duet_error_set(DUET_ERR_RANGE,
                              "comm mpi: allreduce_sum_f32 of %lld floats exceeds MPI's int count "
                              "(at most %d bytes per rank; rank %d of %d)",
                              (long long)n, INT_MAX, c->rank, c->size);
    char *out = NULL;
    DUET_TRY(
        duet__mpi_allgather_stage(m, "allreduce_sum_f32", buf, (size_t)n * sizeof(float), &out));
    duet_comm_sum_parts_f32(buf, (const float *)(void *)out, c->size, n);
    return DUET_OK;
}

static duet_status_t duet__mpi_alltoallv(duet_comm_t *c, const void *send, const size_t *send_bytes,
                                         const size_t *send_off, void *recv,
                                         const size_t *recv_bytes, const size_t *recv_off)
{
    static const char op[] = "alltoallv";
    duet__mpi_t *m = (duet__mpi_t *)c;
    DUET_TRY(duet__mpi_enter(m, op));
    const int n = c->size;
    int *scount = m->counts, *sdispl = scount + n, *rcount = sdispl + n, *rdispl = rcount + n;
    size_t stotal = 0, rtotal = 0;
    for (int r = 0; r < n; r++) {
        DUET_TRY(duet__mpi_check_count(m, op, "sent to one rank", send_bytes[r]));
        DUET_TRY(duet__mpi_check_count(m, op, "received from one rank", recv_bytes[r]));
        stotal += send_bytes[r];
        rtotal += recv_bytes[r];
        DUET_TRY(duet__mpi_check_count(m, op, "sent in all", stotal));
        DUET_TRY(duet__mpi_check_count(m, op, "received in all", rtotal));
    }
    if ((stotal > 0 && send == NULL) || (rtotal > 0 && recv == NULL))
        return duet_error_set(DUET_ERR_INVALID,
                              "comm mpi: alltoallv of %zu bytes out, %zu in with no buffer", stotal,
                              rtotal);
    const size_t roff = duet__mpi_align(stotal);
    DUET_TRY(duet__mpi_stage(m, roff + rtotal, op));
    /* packed in rank order, so the int displacements stay below the checked totals */
    size_t at = 0;
    for (int r = 0; r < n; r++) {
        if (send_bytes[r] > 0)
            memcpy(m->stage + at, (const char *)send + send_off[r], send_bytes[r]);
        scount[r] = (int)send_bytes[r];
        sdispl[r] = (int)at;
        at += send_bytes[r];
    }
    at = 0;
    for (int r = 0; r < n; r++) {
        rcount[r] = (int)recv_bytes[r];
        rdispl[r] = (int)at;
        at += recv_bytes[r];
    }
    MPI_Request req;
    const int rc = MPI_Ialltoallv(m->stage, scount, sdispl, MPI_BYTE, m->stage + roff, rcount,
                                  rdispl, MPI_BYTE, m->comm, &req);
    if (rc != MPI_SUCCESS)
        return duet__mpi_fail(m, op, "MPI_Ialltoallv", rc);
    DUET_TRY(duet__mpi_wait(m, &req, op));
    for (int r = 0; r < n; r++)
        if (recv_bytes[r] > 0)
            memcpy((char *)recv + recv_off[r], m->stage + roff + rdispl[r], recv_bytes[r]);
    return DUET_OK;
}

static duet_status_t duet__mpi_bcast(duet_comm_t *c, void *buf, size_t bytes, int root)
{
    duet__mpi_t *m = (duet__mpi_t *)c;
    DUET_TRY(duet__mpi_enter(m, "bcast"));
    if (root < 0 || root >= c->size)
        return duet_error_set(DUET_ERR_INVALID, "comm mpi: bcast from rank %d of %d", root,
                              c->size);
    DUET_TRY(duet__mpi_check_count(m, "bcast", "in all", bytes));
    if (bytes == 0)
        return DUET_OK;
    if (buf == NULL)
        return duet_error_set(DUET_ERR_INVALID, "comm mpi: bcast of %zu bytes with no buffer",
                              bytes);
    DUET_TRY(duet__mpi_stage(m, bytes, "bcast"));
    if (c->rank == root)
        memcpy(m->stage, buf, bytes);
    MPI_Request req;
    const int rc = MPI_Ibcast(m->stage, (int)bytes, MPI_BYTE, root, m->comm, &req);
    if (rc != MPI_SUCCESS)
        return duet__mpi_fail(m, "bcast", "MPI_Ibcast", rc);
    DUET_TRY(duet__mpi_wait(m, &req, "bcast"));
    if (c->rank != root)
        memcpy(buf, m->stage, bytes);
    return DUET_OK;
}

static duet_status_t duet__mpi_barrier(duet_comm_t *c)
{
    duet__mpi_t *m = (duet__mpi_t *)c;
    DUET_TRY(duet__mpi_enter(m, "barrier"));
    MPI_Request req;
    const int rc = MPI_Ibarrier(m->comm, &req);
    if (rc != MPI_SUCCESS)
        return duet__mpi_fail(m, "barrier", "MPI_Ibarrier", rc);
    return duet__mpi_wait(m, &req, "barrier");
}

static void duet__mpi_destroy(duet_comm_t *c)
{
    duet__mpi_t *m = (duet__mpi_t *)c;
    if (m == NULL)
        return;
    /* A broken communicator may have a collective pending that still reads the counts and
     * writes the staging area if the late rank ever arrives: all of it is kept, once per broken
     * communicator (the group fails after that). */
    if (m->broken) {
        duet__mpi_abandon(m);
        return;
    }
    MPI_Comm_free(&m->comm);
    free(m->stage);
    free(m->counts);
    free(m);
}

static void duet__mpi_abort(duet_comm_t *c, int code)
{
    (void)c;
    MPI_Abort(MPI_COMM_WORLD, code); /* mpirun ends every rank of the job */
    _exit(code);
}

static const duet_comm_ops_t duet__mpi_ops = {
    .name = "mpi",
    .on_device = 0,
    .allgather = duet__mpi_allgather,
    .allreduce_sum_f32 = duet__mpi_allreduce,
    .alltoallv = duet__mpi_alltoallv,
    .bcast = duet__mpi_bcast,
    .barrier = duet__mpi_barrier,
    .destroy = duet__mpi_destroy,
    .abort = duet__mpi_abort,
};

duet_status_t duet_group_mpi_init(int *argc, char ***argv, int *rank, int *size)
{
    int finalized = 0, initialized = 0, provided = MPI_THREAD_SINGLE;
    MPI_Finalized(&finalized);
    if (finalized)
        return duet_error_set(DUET_ERR_INVALID,
                              "group: MPI was finalised in this process and cannot start again");
    MPI_Initialized(&initialized);
    if (!initialized) {
        const int rc = MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
        if (rc != MPI_SUCCESS) {
            char msg[MPI_MAX_ERROR_STRING];
            int len = 0;
            if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS)
                snprintf(msg, sizeof(msg), "MPI error %d", rc);
            return duet_error_set(DUET_ERR_TRANSPORT, "group: MPI_Init_thread failed: %s", msg);
        }
    } else {
        MPI_Query_thread(&provided);
    }
    if (provided < MPI_THREAD_FUNNELED)
        return duet_error_set(DUET_ERR_UNSUPPORTED,
                              "group: MPI gives thread level %d, below MPI_THREAD_FUNNELED (%d): "
                              "the engine's threads could not coexist with MPI",
                              provided, MPI_THREAD_FUNNELED);
    int r = 0, n = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    if (rank != NULL)
        *rank = r;
    if (size != NULL)
        *size = n;
    return DUET_OK;
}

void duet_group_mpi_finalize(void)
{
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (initialized && !finalized)
        MPI_Finalize();
}

/* The value of environment variable `name` when it is a plain decimal from 1 to INT_MAX, else
 * 0 (unset, empty, signs, spaces, trailing text, zero, overflow). */
static long duet__env_positive(const char *name)
{
    const char *s = getenv(name);
    if (s == NULL || *s == '\0')
        return 0;
    long v = 0;
    for (; *s != '\0'; s++) {
        if (*s < '0' || *s > '9')
            return 0;
        v = v * 10 + (*s - '0');
        if (v > INT_MAX)
            return 0;
    }
    return v;
}

int duet_group_mpi_launched(void)
{
    /* mpirun (Open MPI) and PMI-1/2 launchers say the size outright */
    static const char *const sizes[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"};
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        const long n = duet__env_positive(sizes[i]);
        if (n > 0)
            return n > 1;
    }
    /* PMIx (srun --mpi=pmix) names the rank; the size comes from Slurm when it is there */
    const char *pmix_rank = getenv("PMIX_RANK");
    if (pmix_rank != NULL && *pmix_rank != '\0') {
        const long n = duet__env_positive("SLURM_STEP_NUM_TASKS");
        return n > 0 ? n > 1 : 1;
    }
    return 0;
}

duet_status_t duet_comm_mpi_create(int64_t timeout_ms, duet_comm_t **c_p)
{
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (!initialized || finalized)
        return duet_error_set(DUET_ERR_INVALID,
                              "comm mpi: MPI is not running (call duet_group_mpi_init first)");
    duet__mpi_t *m = calloc(1, sizeof(*m));
    if (m == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "comm mpi: out of memory");
    m->base.ops = &duet__mpi_ops;
    m->base.timeout_ms = timeout_ms > 0 ? timeout_ms : 0;
    m->comm = MPI_COMM_NULL;
    m->pending = MPI_REQUEST_NULL;
    MPI_Comm_rank(MPI_COMM_WORLD, &m->base.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &m->base.size);
    duet_status_t st = duet__mpi_enter(m, "create");
    if (st != DUET_OK)
        goto fail;
    const size_t n = (size_t)m->base.size;
    m->counts = malloc(sizeof(int) * 4 * n);
    if (m->counts == NULL) {
        st = duet_error_set(DUET_ERR_NOMEM, "comm mpi: out of memory");
        goto fail;
    }
    /* the duplicate is made nonblocking too: a rank that never joins must not hang the rest */
    MPI_Request req;
    int rc = MPI_Comm_idup(MPI_COMM_WORLD, &m->comm, &req);
    if (rc != MPI_SUCCESS) {
        st = duet__mpi_fail(m, "create", "MPI_Comm_idup", rc);
        goto fail;
    }
    st = duet__mpi_wait(m, &req, "create");
    if (st != DUET_OK) {
        duet__mpi_abandon(m); /* the pending duplication writes m->comm */
        return st;
    }
    rc = MPI_Comm_set_errhandler(m->comm, MPI_ERRORS_RETURN);
    if (rc != MPI_SUCCESS) {
        st = duet__mpi_fail(m, "create", "MPI_Comm_set_errhandler", rc);
        m->broken = 0; /* nothing is pending: the duplicate can go */
        MPI_Comm_free(&m->comm);
        goto fail;
    }
    *c_p = &m->base;
    return DUET_OK;
fail:
    free(m->counts);
    free(m);
    return st;
}
