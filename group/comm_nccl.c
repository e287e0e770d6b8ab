/*
 * comm_nccl.c: the "nccl" transport of common/comm.h (group/comm_nccl.h): device buffers, NCCL
 * on one stream, one GPU per rank.
 *
 * The NCCL communicator is nonblocking (config.blocking = 0), so no NCCL call waits inside
 * NCCL: each op enqueues its work, then polls (group/poll.h) ncclCommGetAsyncError, which says
 * when a call still in progress has been enqueued or failed, and cudaStreamQuery, which says when
 * the work is done, until the communicator's deadline. Past it the communicator is aborted, which
 * also stops its kernels on the device, and is broken from then on.
 */
#include "group/comm_nccl.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <string.h>

#include <cuda_runtime.h>
#include <nccl.h>

#include "group/nccl_sum.h"
#include "group/poll.h"

typedef struct {
    duet_comm_t base;
    ncclComm_t nccl; /* NULL once aborted */
    cudaStream_t stream;
    int device;
    int broken;
    float *one;        /* the barrier's device float */
    duet_comm_t *boot; /* the MPI communicator it was bootstrapped through (the caller's) */
} duet__nccl_t;

/* Stops the NCCL communicator (its kernels too) and breaks this one. */
static void duet__nccl_abort(duet__nccl_t *m)
{
    if (m->nccl != NULL)
        ncclCommAbort(m->nccl);
    m->nccl = NULL;
    m->broken = 1;
}

static duet_status_t duet__nccl_fail(duet__nccl_t *m, const char *op, const char *call,
                                     ncclResult_t r)
{
    const char *last = m->nccl != NULL ? ncclGetLastError(m->nccl) : NULL;
    const duet_status_t st =
        duet_error_set(DUET_ERR_TRANSPORT, "comm nccl: %s failed in %s (rank %d of %d): %s%s%s", op,
                       call, m->base.rank, m->base.size, ncclGetErrorString(r),
                       last != NULL && last[0] != '\0' ? ": " : "", last != NULL ? last : "");
    duet__nccl_abort(m);
    return st;
}

static duet_status_t duet__nccl_cuda_fail(duet__nccl_t *m, const char *op, const char *call,
                                          cudaError_t e)
{
    const duet_status_t st =
        duet_error_set(DUET_ERR_DEVICE, "comm nccl: %s failed in %s (rank %d of %d, device %d): %s",
                       op, call, m->base.rank, m->base.size, m->device, cudaGetErrorString(e));
    duet__nccl_abort(m);
    return st;
}

static duet_status_t duet__nccl_enter(duet__nccl_t *m, const char *op, duet__poll_t *p)
{
    if (m->broken)
        return duet_error_set(DUET_ERR_TRANSPORT,
                              "comm nccl: %s on a communicator an earlier error broke "
                              "(rank %d of %d); it can only be destroyed",
                              op, m->base.rank, m->base.size);
    /* the calling thread may have another device current */
    const cudaError_t e = cudaSetDevice(m->device);
    if (e != cudaSuccess)
        return duet__nccl_cuda_fail(m, op, "cudaSetDevice", e);
    duet__poll_start(p, m->base.timeout_ms);
    return DUET_OK;
}

/* An NCCL call's result: ncclInProgress is fine (the wait sees it through), anything else but
 * success breaks the communicator. */
static duet_status_t duet__nccl_check(duet__nccl_t *m, const char *op, const char *call,
                                      ncclResult_t r)
{
    if (r == ncclSuccess || r == ncclInProgress)
        return DUET_OK;
    return duet__nccl_fail(m, op, call, r);
}

static duet_status_t duet__nccl_timeout(duet__nccl_t *m, const char *op, const duet__poll_t *p,
                                        const char *what)
{
    const duet_status_t st =
        duet_error_set(DUET_ERR_TIMEOUT,
                       "comm nccl: %s timed out after %lld ms %s (rank %d of a communicator of "
                       "%d, timeout_ms %lld); the communicator is aborted",
                       op, (long long)duet__poll_elapsed_ms(p), what, m->base.rank, m->base.size,
                       (long long)m->base.timeout_ms);
    duet__nccl_abort(m);
    return st;
}

/* Waits until NCCL has no call in progress, then (stream_too) until the stream is idle. */
static duet_status_t duet__nccl_wait(duet__nccl_t *m, const char *op, duet__poll_t *p,
                                     int stream_too)
{
    for (;;) {
        ncclResult_t async = ncclSuccess;
        ncclResult_t r = ncclCommGetAsyncError(m->nccl, &async);
        if (r != ncclSuccess)
            return duet__nccl_fail(m, op, "ncclCommGetAsyncError", r);
        if (async != ncclSuccess && async != ncclInProgress)
            return duet__nccl_fail(m, op, "the communicator", async);
        if (async == ncclSuccess) {
            if (!stream_too)
                return DUET_OK;
            const cudaError_t e = cudaStreamQuery(m->stream);
            if (e == cudaSuccess)
                return DUET_OK;
            if (e != cudaErrorNotReady)
                return duet__nccl_cuda_fail(m, op, "cudaStreamQuery", e);
        }
        if (duet__poll_expired(p))
            return duet__nccl_timeout(m, op, p, "waiting for the other ranks");
        duet__poll_pause(p);
    }
}

static duet_status_t duet__nccl_allgather(duet_comm_t *c, const void *send, void *recv,
                                          size_t bytes)
{
    duet__nccl_t *m = (duet__nccl_t *)c;
    duet__poll_t p;
    DUET_TRY(duet__nccl_enter(m, "allgather", &p));
    if (bytes == 0)
        return DUET_OK;
    DUET_TRY(duet__nccl_check(m, "allgather", "ncclAllGather",
                              ncclAllGather(send, recv, bytes, ncclUint8, m->nccl, m->stream)));
    return duet__nccl_wait(m, "allgather", &p, 1);
}

static duet_status_t duet__nccl_allreduce(duet_comm_t *c, float *buf, int64_t n, float *scratch)
{
    static const char op[] = "allreduce_sum_f32";
    duet__nccl_t *m = (duet__nccl_t *)c;
    duet__poll_t p;
    DUET_TRY(duet__nccl_enter(m, op, &p));
    if (n < 0)
        return duet_error_set(DUET_ERR_INVALID, "comm nccl: %s of %lld floats", op, (long long)n);
    if (n == 0)
        return DUET_OK;
    DUET_TRY(
        duet__nccl_check(m, op, "ncclAllGather",
                         ncclAllGather(buf, scratch, (size_t)n, ncclFloat32, m->nccl, m->stream)));
    /* the gather must be enqueued before the sum that reads it is */
    DUET_TRY(duet__nccl_wait(m, op, &p, 0));
    const cudaError_t e = duet__nccl_sum_parts_f32(buf, scratch, c->size, n, m->stream);
    if (e != cudaSuccess)
        return duet__nccl_cuda_fail(m, op, "the sum kernel's launch", e);
    return duet__nccl_wait(m, op, &p, 1);
}

static duet_status_t duet__nccl_alltoallv(duet_comm_t *c, const void *send,
                                          const size_t *send_bytes, const size_t *send_off,
                                          void *recv, const size_t *recv_bytes,
                                          const size_t *recv_off)
{
    static const char op[] = "alltoallv";
    duet__nccl_t *m = (duet__nccl_t *)c;
    duet__poll_t p;
    DUET_TRY(duet__nccl_enter(m, op, &p));
    const int me = c->rank;
    if (send_bytes[me] != recv_bytes[me])
        return duet_error_set(DUET_ERR_INVALID,
                              "comm nccl: alltoallv: rank %d sends %zu bytes to itself but "
                              "receives %zu",
                              me, send_bytes[me], recv_bytes[me]);
    if (send_bytes[me] > 0) {
        const cudaError_t e =
            cudaMemcpyAsync((char *)recv + recv_off[me], (const char *)send + send_off[me],
                            send_bytes[me], cudaMemcpyDeviceToDevice, m->stream);
        if (e != cudaSuccess)
            return duet__nccl_cuda_fail(m, op, "cudaMemcpyAsync", e);
    }
    DUET_TRY(duet__nccl_check(m, op, "ncclGroupStart", ncclGroupStart()));
    ncclResult_t r = ncclSuccess;
    const char *call = "ncclGroupEnd";
    for (int peer = 0; peer < c->size && r == ncclSuccess; peer++) {
        if (peer == me)
            continue;
        if (send_bytes[peer] > 0) {
            r = ncclSend((const char *)send + send_off[peer], send_bytes[peer], ncclUint8, peer,
                         m->nccl, m->stream);
            call = "ncclSend";
        }
        if (r == ncclSuccess && recv_bytes[peer] > 0) {
            r = ncclRecv((char *)recv + recv_off[peer], recv_bytes[peer], ncclUint8, peer, m->nccl,
                         m->stream);
            call = "ncclRecv";
        }
    }
    /* the group is closed even after a failed call, so NCCL's group state stays balanced */
    const ncclResult_t end = ncclGroupEnd();
    if (r == ncclSuccess) {
        r = end;
        call = "ncclGroupEnd";
    }
    DUET_TRY(duet__nccl_check(m, op, call, r));
    return duet__nccl_wait(m, op, &p, 1);
}

static duet_status_t duet__nccl_bcast(duet_comm_t *c, void *buf, size_t bytes, int root)
{
    duet__nccl_t *m = (duet__nccl_t *)c;
    duet__poll_t p;
    DUET_TRY(duet__nccl_enter(m, "bcast", &p));
    if (root < 0 || root >= c->size)
        return duet_error_set(DUET_ERR_INVALID, "comm nccl: bcast from rank %d of %d", root,
                              c->size);
    if (bytes == 0)
        return DUET_OK;
    DUET_TRY(duet__nccl_check(m, "bcast", "ncclBroadcast",
                              ncclBroadcast(buf, buf, bytes, ncclUint8, root, m->nccl, m->stream)));
    return duet__nccl_wait(m, "bcast", &p, 1);
}

static duet_status_t duet__nccl_barrier(duet_comm_t *c)
{
    duet__nccl_t *m = (duet__nccl_t *)c;
    duet__poll_t p;
    DUET_TRY(duet__nccl_enter(m, "barrier", &p));
    /* an allreduce cannot finish on any rank before every rank has contributed */
    DUET_TRY(duet__nccl_check(
        m, "barrier", "ncclAllReduce",
        ncclAllReduce(m->one, m->one, 1, ncclFloat32, ncclSum, m->nccl, m->stream)));
    return duet__nccl_wait(m, "barrier", &p, 1);
}

static void duet__nccl_destroy(duet_comm_t *c)
{
    duet__nccl_t *m = (duet__nccl_t *)c;
    if (m == NULL)
        return;
    if (!m->broken && m->nccl != NULL) {
        /* finalise (flushes this rank's pending work, collective) within the bound; a rank that
         * does not get through it aborts instead */
        duet__poll_t p;
        cudaSetDevice(m->device);
        duet__poll_start(&p, m->base.timeout_ms);
        if (ncclCommFinalize(m->nccl) != ncclSuccess ||
            duet__nccl_wait(m, "destroy", &p, 0) != DUET_OK)
            duet__nccl_abort(m);
        else
            ncclCommDestroy(m->nccl);
    }
    /* after an abort the barrier float is left: freeing device memory synchronises the device */
    if (!m->broken)
        cudaFree(m->one);
    free(m);
}

static void duet__nccl_abort_job(duet_comm_t *c, int code)
{
    duet__nccl_t *m = (duet__nccl_t *)c;
    if (!m->broken)
        duet__nccl_abort(m);
    m->boot->ops->abort(m->boot, code); /* the MPI job's ranks: mpirun ends them all */
}

static const duet_comm_ops_t duet__nccl_ops = {
    .name = "nccl",
    .on_device = 1,
    .allgather = duet__nccl_allgather,
    .allreduce_sum_f32 = duet__nccl_allreduce,
    .alltoallv = duet__nccl_alltoallv,
    .bcast = duet__nccl_bcast,
    .barrier = duet__nccl_barrier,
    .destroy = duet__nccl_destroy,
    .abort = duet__nccl_abort_job,
};

/* What each rank tells the others at creation: whether it is ready, and rank 0's unique id. */
typedef struct {
    int32_t ready;
    int32_t device;
    ncclUniqueId id;
} duet__nccl_hello_t;

duet_status_t duet_comm_nccl_create(duet_comm_t *mpi, int device, void *stream, int64_t timeout_ms,
                                    duet_comm_t **c_p)
{
    if (mpi == NULL || strcmp(mpi->ops->name, "mpi") != 0)
        return duet_error_set(DUET_ERR_INVALID,
                              "comm nccl: bootstrapping needs an \"mpi\" communicator, not \"%s\"",
                              mpi == NULL ? "(null)" : mpi->ops->name);
    duet__nccl_t *m = calloc(1, sizeof(*m));
    duet__nccl_hello_t *all = calloc((size_t)mpi->size, sizeof(*all));
    if (m == NULL || all == NULL) {
        free(m), free(all);
        return duet_error_set(DUET_ERR_NOMEM, "comm nccl: out of memory");
    }
    m->base.ops = &duet__nccl_ops;
    m->base.rank = mpi->rank;
    m->base.size = mpi->size;
    m->boot = mpi;
    m->base.timeout_ms = timeout_ms > 0 ? timeout_ms : 0;
    m->stream = (cudaStream_t)stream;
    m->device = device;

    /* local preparation; a failure is told to the other ranks rather than returned at once */
    duet__nccl_hello_t me = {.ready = 1, .device = device};
    char why[256] = "";
    cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess)
        e = cudaMalloc((void **)&m->one, sizeof(float));
    if (e == cudaSuccess)
        e = cudaMemsetAsync(m->one, 0, sizeof(float), m->stream);
    if (e != cudaSuccess) {
        me.ready = 0;
        snprintf(why, sizeof(why), "device %d: %s", device, cudaGetErrorString(e));
    }
    if (me.ready && mpi->rank == 0) {
        const ncclResult_t r = ncclGetUniqueId(&me.id);
        if (r != ncclSuccess) {
            me.ready = 0;
            snprintf(why, sizeof(why), "ncclGetUniqueId: %s", ncclGetErrorString(r));
        }
    }
    duet_status_t st = mpi->ops->allgather(mpi, &me, all, sizeof(me));
    if (st != DUET_OK)
        goto fail;
    for (int r = 0; r < mpi->size; r++) {
        if (!all[r].ready) {
            st = duet_error_set(
                DUET_ERR_DEVICE, "comm nccl: rank %d of %d could not start (device %d)%s%s", r,
                mpi->size, all[r].device, r == mpi->rank ? ": " : "", r == mpi->rank ? why : "");
            goto fail;
        }
    }

    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0; /* the bound: nothing waits inside NCCL */
    duet__poll_t p;
    duet__poll_start(&p, m->base.timeout_ms);
    const ncclResult_t r =
        ncclCommInitRankConfig(&m->nccl, mpi->size, all[0].id, mpi->rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
        st = duet__nccl_fail(m, "create", "ncclCommInitRankConfig", r);
        goto fail;
    }
    st = duet__nccl_wait(m, "create", &p, 1);
    if (st != DUET_OK)
        goto fail;
    free(all);
    *c_p = &m->base;
    return DUET_OK;
fail:
    /* the NCCL communicator, if one was made, is aborted already and never ran a collective */
    if (m->one != NULL)
        cudaFree(m->one);
    free(all);
    free(m);
    return st;
}
