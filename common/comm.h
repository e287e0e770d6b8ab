/*
 * comm.h: the collectives a group of ranks decodes with (a Helix generation group,
 * docs/architecture.md "Generation groups"), as one interface with several transports.
 *
 * A communicator is a table of functions and an instance that starts with a pointer to it, in the
 * manner of engine/backend.h: the engine's backends call these ops and never include a transport
 * header. Transports:
 *  - "self": one rank, every op a copy (comm.c). What a model without a group behaves as.
 *  - "mpi": host buffers, Open MPI (group/comm_mpi.c), for CPU ranks.
 *  - "nccl": device buffers, NCCL on one CUDA stream, bootstrapped through an MPI communicator
 *    (group/comm_nccl.c), for GPU ranks.
 *
 * Contracts every transport keeps:
 *  - Collective: every rank calls the same ops in the same order with the same sizes (the counts
 *    of an alltoallv must agree pairwise).
 *  - Bounded: no op waits longer than the communicator's timeout_ms for the other ranks; past it
 *    the op returns DUET_ERR_TIMEOUT, a dead or failed peer gives DUET_ERR_TRANSPORT, both with
 *    duet_error_set() naming the op and the rank. After an error the communicator is broken: the
 *    caller only destroys it (the group then fails its requests, the design's "nothing hangs").
 *  - allreduce_sum_f32 gives the same bits on every rank (a group's ranks then keep identical
 *    residual streams, and take identical routing decisions from them).
 *  - Buffers are host memory for a transport with on_device 0, device memory (on `stream`) for
 *    one with on_device 1; an op returns when its results are ready to read on the host
 *    (on_device 0) or are ordered on the stream (on_device 1).
 */
#ifndef DUET_COMMON_COMM_H
#define DUET_COMMON_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct duet_comm duet_comm_t;
typedef struct duet_comm_ops duet_comm_ops_t;

struct duet_comm {
    const duet_comm_ops_t *ops;
    int rank;           /* 0 .. size - 1 */
    int size;           /* ranks in the group */
    int64_t timeout_ms; /* the longest any op waits for the other ranks (0 = no bound) */
    /* Optional: called now and then while an op of a host transport waits for the other ranks,
     * for the rank's other duties (a follower's UCX progress); it must not use the
     * communicator. */
    void (*on_wait)(void *user);
    void *on_wait_user;
};

struct duet_comm_ops {
    const char *name; /* "self", "mpi", "nccl" */
    int on_device;    /* 1: buffers are device pointers ordered on the communicator's stream */

    /* Every rank's `bytes` bytes of `send`, in rank order, into recv (size * bytes). */
    duet_status_t (*allgather)(duet_comm_t *c, const void *send, void *recv, size_t bytes);
    /* Elementwise sum of every rank's buf (n floats) into buf, the same bits on every rank;
     * scratch holds size * n floats (host or device as the buffers). */
    duet_status_t (*allreduce_sum_f32)(duet_comm_t *c, float *buf, int64_t n, float *scratch);
    /* Rank r sends send_bytes[r] bytes from send + send_off[r] to each rank r, and receives
     * recv_bytes[r] bytes from rank r at recv + recv_off[r]. Zero sizes are allowed. */
    duet_status_t (*alltoallv)(duet_comm_t *c, const void *send, const size_t *send_bytes,
                               const size_t *send_off, void *recv, const size_t *recv_bytes,
                               const size_t *recv_off);
    /* root's `bytes` bytes of buf into every rank's buf. */
    duet_status_t (*bcast)(duet_comm_t *c, void *buf, size_t bytes, int root);
    /* Every rank arrives before any leaves (bounded like the rest). */
    duet_status_t (*barrier)(duet_comm_t *c);
    /* Frees the instance; collective only when the communicator is healthy. Accepts NULL. */
    void (*destroy)(duet_comm_t *c);
    /* Ends every rank's process with this exit code (after a failure, so that no rank is left
     * waiting for the others); does not return. */
    void (*abort)(duet_comm_t *c, int code);
};

/* A one-rank communicator ("self"): *c_p owns nothing else; destroy with duet_comm_destroy. */
duet_status_t duet_comm_self_create(duet_comm_t **c_p);

/* Frees `c` through its table; accepts NULL. */
void duet_comm_destroy(duet_comm_t *c);

/* Sum of `parts` float arrays of n each (part p at src + p * n) in part order into dst: the
 * ordered host reduction every host transport uses, so that each rank gets the same bits. */
void duet_comm_sum_parts_f32(float *dst, const float *src, int parts, int64_t n);

#endif /* DUET_COMMON_COMM_H */
