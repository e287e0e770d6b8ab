/*
 * comm.c: the transport-independent parts of common/comm.h: the one-rank "self" communicator and
 * the ordered host reduction.
 */
#include "common/comm.h"

#include <stdlib.h>
#include <string.h>

static duet_status_t duet__self_allgather(duet_comm_t *c, const void *send, void *recv,
                                          size_t bytes)
{
    (void)c;
    if (bytes > 0 && send != recv)
        memmove(recv, send, bytes);
    return DUET_OK;
}

static duet_status_t duet__self_allreduce(duet_comm_t *c, float *buf, int64_t n, float *scratch)
{
    (void)c, (void)buf, (void)n, (void)scratch;
    return DUET_OK;
}

static duet_status_t duet__self_alltoallv(duet_comm_t *c, const void *send,
                                          const size_t *send_bytes, const size_t *send_off,
                                          void *recv, const size_t *recv_bytes,
                                          const size_t *recv_off)
{
    (void)c;
    if (send_bytes[0] != recv_bytes[0])
        return duet_error_set(DUET_ERR_INVALID,
                              "comm self: alltoallv sends %zu bytes to itself "
                              "but receives %zu",
                              send_bytes[0], recv_bytes[0]);
    if (send_bytes[0] > 0)
        memmove((char *)recv + recv_off[0], (const char *)send + send_off[0], send_bytes[0]);
    return DUET_OK;
}

static duet_status_t duet__self_bcast(duet_comm_t *c, void *buf, size_t bytes, int root)
{
    (void)c, (void)buf, (void)bytes;
    if (root != 0)
        return duet_error_set(DUET_ERR_INVALID, "comm self: bcast from rank %d of 1", root);
    return DUET_OK;
}

static duet_status_t duet__self_barrier(duet_comm_t *c)
{
    (void)c;
    return DUET_OK;
}

static void duet__self_destroy(duet_comm_t *c)
{
    free(c);
}

static void duet__self_abort(duet_comm_t *c, int code)
{
    (void)c;
    exit(code);
}

static const duet_comm_ops_t duet__self_ops = {
    .name = "self",
    .on_device = 0,
    .allgather = duet__self_allgather,
    .allreduce_sum_f32 = duet__self_allreduce,
    .alltoallv = duet__self_alltoallv,
    .bcast = duet__self_bcast,
    .barrier = duet__self_barrier,
    .destroy = duet__self_destroy,
    .abort = duet__self_abort,
};

duet_status_t duet_comm_self_create(duet_comm_t **c_p)
{
    duet_comm_t *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "comm: out of memory");
    c->ops = &duet__self_ops;
    c->rank = 0;
    c->size = 1;
    c->timeout_ms = 0;
    *c_p = c;
    return DUET_OK;
}

void duet_comm_destroy(duet_comm_t *c)
{
    if (c != NULL)
        c->ops->destroy(c);
}

void duet_comm_sum_parts_f32(float *dst, const float *src, int parts, int64_t n)
{
    /* part 0 first, then each further part in rank order: one fixed order on every rank */
    if (parts <= 0)
        return;
    if (dst != src)
        memmove(dst, src, sizeof(float) * (size_t)n);
    for (int p = 1; p < parts; p++) {
        const float *s = src + (int64_t)p * n;
        for (int64_t i = 0; i < n; i++)
            dst[i] += s[i];
    }
}
