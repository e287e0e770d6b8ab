/*
 * comm_mpi.h: the "mpi" transport of common/comm.h (host buffers, Open MPI) and the process-level
 * MPI setup a generation group's binary needs (docs/architecture.md "Generation groups").
 *
 * Threading: MPI is initialised with MPI_THREAD_FUNNELED, so only the thread that called
 * duet_group_mpi_init may call MPI, and with it every op of an "mpi" communicator (an op called
 * from another thread fails with DUET_ERR_INVALID). The engine's compute threads never call MPI.
 *
 * Every op is a nonblocking MPI collective polled until timeout_ms (common/comm.h "Bounded"),
 * through buffers the communicator owns: a collective that timed out can be neither cancelled
 * nor freed (MPI forbids both for nonblocking collectives) and may still complete if the late
 * rank arrives, so it must then write into memory the communicator keeps after destroy, never into
 * the caller's. Each op therefore costs one host copy of its data in and one out.
 */
#ifndef DUET_GROUP_COMM_MPI_H
#define DUET_GROUP_COMM_MPI_H

#include <stddef.h>
#include <stdint.h>

#include "common/comm.h"
#include "common/status.h"

/*
 * Initialises MPI (MPI_Init_thread, MPI_THREAD_FUNNELED) on the calling thread, which becomes the
 * only one that may call MPI, and gives this process's rank and the world's size (either pointer
 * may be NULL). argc / argv go to MPI_Init_thread (may be NULL). Idempotent: when MPI is already
 * initialised (by this function or by the caller) it only reads rank and size, but it fails with
 * DUET_ERR_UNSUPPORTED when the existing initialisation gives less than MPI_THREAD_FUNNELED, and
 * with DUET_ERR_INVALID after MPI has been finalised (MPI cannot be initialised twice).
 */
duet_status_t duet_group_mpi_init(int *argc, char ***argv, int *rank, int *size);

/*
 * Finalises MPI when it is initialised and not yet finalised; otherwise does nothing. Collective
 * over the world: call it only when every rank is healthy. After a communicator broke (a timeout
 * or a dead peer) a rank should exit without it (a dead peer never reaches the finalisation).
 */
void duet_group_mpi_finalize(void);

/*
 * 1 when this process was started by a launcher (mpirun, srun) as one rank of a job of more than
 * one rank, read from the environment the launchers set (OMPI_COMM_WORLD_SIZE, PMI_SIZE; with
 * PMIx, PMIX_RANK plus SLURM_STEP_NUM_TASKS when Slurm gives the size, or PMIX_RANK alone, whose
 * size is unknown: then 1, and MPI tells the size once initialised). 0 otherwise, and for a
 * value that is not a plain positive number. Calls no MPI, so a binary can decide from it
 * whether to initialise MPI at all.
 */
int duet_group_mpi_launched(void);

/*
 * A communicator over every rank of MPI_COMM_WORLD: a duplicate of it (MPI_Comm_idup, bounded by
 * timeout_ms like every op) whose errors return rather than abort. timeout_ms: the longest any
 * op waits for the other ranks (0 = unbounded). Collective over the world; MPI must be
 * initialised (duet_group_mpi_init). Destroy with duet_comm_destroy.
 */
duet_status_t duet_comm_mpi_create(int64_t timeout_ms, duet_comm_t **c_p);
#endif /* DUET_GROUP_COMM_MPI_H */
