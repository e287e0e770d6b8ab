/*
 * group.h: a generation worker that is a Helix group of cp * tp ranks (docs/architecture.md,
 * "Generation groups"). Rank 0 is the worker the router knows: it runs the skeleton's loop and
 * decides everything; ranks 1.. are followers that hold their cut of the model (engine/shard.h)
 * and their share of the caches, and do what rank 0 tells them, in the same order.
 *
 * The channel is the group's communicator (common/comm.h): rank 0 broadcasts one command per
 * call that changes a model's state (open, close, reserve, cancel a reservation, filled, forward)
 * and, where it must know, gathers every rank's status. Each rank receives its own cache
 * transfer from the context worker (its own UCX worker and Reservation, gathered by rank 0 into
 * the Reserved the router carries). Every wait is bounded by the communicator's timeout except a
 * follower's wait for the next command (rank 0 may be idle for hours; a rank 0 that dies takes the
 * job down with it through mpirun). A failed collective breaks the group: rank 0 then fails its
 * requests, deregisters and aborts the job, so nothing is left waiting.
 */
#ifndef DUET_WORKER_GROUP_H
#define DUET_WORKER_GROUP_H

#include <stddef.h>
#include <stdint.h>

#include "common/comm.h"
#include "common/status.h"
#include "engine/model.h"
#include "transfer/xfer.h"

typedef struct duet_group duet_group_t;

/* A group over comm (owned by the group from here on) of cp * tp ranks; rank 0 leads. */
duet_status_t duet_group_create(duet_comm_t *comm, int cp, int tp, duet_group_t **g_p);
/* Rank 0: tells the followers to stop (when the group is healthy); every rank: frees. NULL ok. */
void duet_group_destroy(duet_group_t *g);

int duet_group_rank(const duet_group_t *g);
int duet_group_size(const duet_group_t *g);
int duet_group_cp(const duet_group_t *g);
duet_comm_t *duet_group_comm(duet_group_t *g);
/* Whether a collective failed: the group can only be torn down. */
int duet_group_broken(const duet_group_t *g);
/* End every rank's process (the communicator's abort): what a broken group's rank 0 does last. */
void duet_group_abort(duet_group_t *g, int code);

/*
 * Rank 0. Each does the call on rank 0's model and has every follower do the same on its own;
 * they return rank 0's status, or the first follower's failure (DUET_ERR_INTERNAL naming the rank:
 * the ranks disagree) or the collective's (DUET_ERR_TIMEOUT / DUET_ERR_TRANSPORT: the group is
 * broken). seq is rank 0's handle; followers keep theirs under the same id.
 */
duet_status_t duet_group_seq_open(duet_group_t *g, duet_model_t *m, int64_t max_tokens,
                                  duet_seq_t *seq);
void duet_group_seq_close(duet_group_t *g, duet_model_t *m, duet_seq_t *seq);
/* The sequence's first n_tokens arrived on rank 0; every follower waits (bounded, until
 * deadline_unix_ms) for its own share of the transfer, then marks it filled. */
duet_status_t duet_group_seq_filled(duet_group_t *g, duet_model_t *m, duet_seq_t *seq,
                                    int64_t n_tokens, uint64_t deadline_unix_ms);
duet_status_t duet_group_forward(duet_group_t *g, duet_model_t *m, duet_batch_item_t *items,
                                 int64_t n_items);
/*
 * Every follower reserves its share of seq's first n_tokens for request rid (transfer/xfer.h) and
 * rank 0 gets their packed Reservations: out[i] (malloc'ed, len[i] bytes) is rank i + 1's, for
 * i < size - 1; the caller frees them (duet_group_free_reservations). Rank 0 reserves its own.
 */
duet_status_t duet_group_reserve(duet_group_t *g, const duet_seq_t *seq, uint64_t rid,
                                 int64_t n_tokens, uint64_t deadline_unix_ms, uint8_t **out,
                                 size_t *len);
void duet_group_free_reservations(const duet_group_t *g, uint8_t **out);
/* Every follower ends its reservation for seq (if still live), telling its sender. */
void duet_group_recv_cancel(duet_group_t *g, const duet_seq_t *seq, const char *why);

/*
 * A follower: serve rank 0's commands with this rank's model, transfer context (pools registered)
 * and layout until rank 0 says stop (returns 0) or the group breaks (returns 1, logged).
 */
int duet_group_follow(duet_group_t *g, duet_model_t *m, duet_xfer_ctx_t *x,
                      const duet_xfer_layout_t *layout);

#endif /* DUET_WORKER_GROUP_H */
