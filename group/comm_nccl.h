/*
 * comm_nccl.h: the "nccl" transport of common/comm.h (on_device 1): a generation group's GPU
 * ranks exchange device buffers with NCCL on one CUDA stream, one GPU per rank, bootstrapped
 * through the group's "mpi" communicator (group/comm_mpi.h). Built only when CUDA and NCCL are
 * found (group/CMakeLists.txt); linked as duet_group_nccl.
 *
 * Bounded like every transport: each op enqueues its NCCL work on the stream and then polls the
 * stream and NCCL's asynchronous error until the work is done or timeout_ms passed, so an op
 * returns with its results complete on the device (stronger than comm.h's "ordered on the
 * stream", and the price of the bound). Past the deadline, or on an asynchronous error, the NCCL
 * communicator is aborted (ncclCommAbort) and broken: DUET_ERR_TIMEOUT / DUET_ERR_TRANSPORT.
 * Like the mpi transport, ops are called from one thread at a time.
 */
#ifndef DUET_GROUP_COMM_NCCL_H
#define DUET_GROUP_COMM_NCCL_H

#include <stdint.h>

#include "common/comm.h"
#include "common/status.h"

/*
 * A communicator over the ranks of `mpi` (an "mpi" communicator, same rank and size) on CUDA
 * device `device` and stream `stream` (a cudaStream_t; NULL is the default stream), the stream
 * every op's buffers are ordered on. Rank 0 makes the NCCL unique id; one allgather over `mpi`
 * carries it to every rank together with every rank's readiness (device selected), so a rank
 * that cannot start makes all of them fail alike. The NCCL communicator is made nonblocking and
 * its initialisation is bounded by timeout_ms (0 = unbounded), like every op. Collective over
 * `mpi`, which the new communicator does not own; it must outlive it (abort goes through it).
 * Destroy with duet_comm_destroy.
 */
duet_status_t duet_comm_nccl_create(duet_comm_t *mpi, int device, void *stream, int64_t timeout_ms,
                                    duet_comm_t **c_p);

#endif /* DUET_GROUP_COMM_NCCL_H */
