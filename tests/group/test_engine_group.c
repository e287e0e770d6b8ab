/*
 * test_engine_group: a Helix group's forward (engine/shard.h) against the single-process model.
 *
 * Not a Criterion suite: it runs as N MPI ranks (ctest starts it under mpirun, tests/group/
 * group.cmake). Every rank loads its cut of MODEL with cp x tp from the command line; rank 0 also
 * loads the whole model alone (the reference). Three sequences whose prompts span fewer pages than
 * there are ranks, one page and several pages (16-token pages) are prefilled in one step (the
 * longest in two chunks beside the others), then decoded greedily together for STEPS steps, the
 * tokens drawn on rank 0 and broadcast. Checked on rank 0 at every step: the group's logits equal
 * the reference's within TOL (fp32: the group sums the sub-layers' parts and merges attention by
 * log-sum-exp in another order than one process does; differences seen are ~1e-5, a tenth of TOL)
 * and the greedy tokens are the same. Exit status 0 only when every rank agrees that everything
 * held.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/comm.h"
#include "engine/model.h"
#include "group/comm_mpi.h"

#define NS    3
#define STEPS 16
#define TOL   1e-4

static const int plen[NS] = {5, 40, 100};

static duet_model_t *load(const char *dir, duet_comm_t *c, int cp, int tp)
{
    duet_model_opts_t o;
    duet_model_opts_default(&o);
    o.n_threads = 1;
    o.max_seqs = 4;
    o.max_seq_len = 256;
    o.page_tokens = 16;
    o.max_batch_tokens = 256;
    o.comm = c;
    o.helix_cp = cp;
    o.helix_tp = tp;
    duet_model_t *m = NULL;
    if (duet_model_load(dir, &o, &m) != DUET_OK) {
        fprintf(stderr, "test_engine_group: load %s: %s\n", dir, duet_error_last());
        return NULL;
    }
    return m;
}

typedef struct {
    float *logits[STEPS + 1][NS]; /* the reference's, kept by rank 0 */
    double max_diff;
    int token_diffs;
} ref_t;

/* The scenario on model m (c NULL: alone). want_ref: record into ref; else compare with it. */
static int run(duet_model_t *m, duet_comm_t *c, int record, ref_t *ref)
{
    const int rank = c != NULL ? c->rank : 0;
    const int64_t V = duet_model_config(m)->vocab_size;
    duet_seq_t s[NS];
    int32_t toks[NS][128];
    float *lg = malloc(sizeof(float) * (size_t)(V * NS));
    int ok = lg != NULL;
    for (int i = 0; i < NS && ok; i++) {
        if (duet_model_seq_open(m, 200, &s[i]) != DUET_OK) {
            fprintf(stderr, "rank %d: open: %s\n", rank, duet_error_last());
            ok = 0;
        }
        for (int t = 0; t < plen[i]; t++)
            toks[i][t] = (int32_t)((t * 7 + i * 3 + 1) % V);
    }
    const int mode = rank == 0 ? DUET_LOGITS_LAST : DUET_LOGITS_NONE;
    /* prefill: the long prompt's first 64 tokens beside the two short ones, then its rest */
    duet_batch_item_t it[NS];
    for (int i = 0; i < NS && ok; i++)
        it[i] = (duet_batch_item_t){.seq = &s[i],
                                    .tokens = toks[i],
                                    .n_tokens = i == 2 ? 64 : plen[i],
                                    .logits_mode = i == 2 ? DUET_LOGITS_NONE : mode,
                                    .logits = lg + i * V};
    if (ok && duet_model_forward(m, it, NS) != DUET_OK)
        ok = 0;
    duet_batch_item_t rest = {.seq = &s[2],
                              .tokens = toks[2] + 64,
                              .n_tokens = plen[2] - 64,
                              .logits_mode = mode,
                              .logits = lg + 2 * V};
    if (ok && duet_model_forward(m, &rest, 1) != DUET_OK)
        ok = 0;
    if (!ok)
        fprintf(stderr, "rank %d: prefill: %s\n", rank, duet_error_last());
    for (int step = 0; ok && step <= STEPS; step++) {
        int32_t next[NS] = {0};
        for (int i = 0; rank == 0 && i < NS; i++) {
            const float *L = lg + i * V;
            if (record) {
                ref->logits[step][i] = malloc(sizeof(float) * (size_t)V);
                memcpy(ref->logits[step][i], L, sizeof(float) * (size_t)V);
            }
            int64_t b = 0, rb = 0;
            for (int64_t v = 1; v < V; v++) {
                b = L[v] > L[b] ? v : b;
                if (!record)
                    rb = ref->logits[step][i][v] > ref->logits[step][i][rb] ? v : rb;
            }
            if (!record) {
                for (int64_t v = 0; v < V; v++) {
                    const double d = fabs((double)L[v] - ref->logits[step][i][v]);
                    ref->max_diff = d > ref->max_diff ? d : ref->max_diff;
                }
                ref->token_diffs += b != rb;
                b = rb; /* decode the reference's tokens: one difference does not snowball */
            }
            next[i] = (int32_t)b;
        }
        if (c != NULL && c->ops->bcast(c, next, sizeof(next), 0) != DUET_OK) {
            fprintf(stderr, "rank %d: bcast: %s\n", rank, duet_error_last());
            ok = 0;
            break;
        }
        if (step == STEPS)
            break;
        for (int i = 0; i < NS; i++)
            it[i] = (duet_batch_item_t){.seq = &s[i],
                                        .tokens = &next[i],
                                        .n_tokens = 1,
                                        .logits_mode = mode,
                                        .logits = lg + i * V};
        if (duet_model_forward(m, it, NS) != DUET_OK) {
            fprintf(stderr, "rank %d: step %d: %s\n", rank, step, duet_error_last());
            ok = 0;
        }
    }
    for (int i = 0; i < NS; i++)
        duet_model_seq_close(m, &s[i]);
    free(lg);
    return ok;
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: mpirun -n CP*TP test_engine_group MODEL CP TP\n");
        return 2;
    }
    const char *dir = argv[1];
    const int cp = atoi(argv[2]), tp = atoi(argv[3]);
    int rank = 0, size = 1;
    if (duet_group_mpi_init(&argc, &argv, &rank, &size) != DUET_OK) {
        fprintf(stderr, "test_engine_group: %s\n", duet_error_last());
        return 1;
    }
    duet_comm_t *c = NULL;
    if (duet_comm_mpi_create(60000, &c) != DUET_OK) {
        fprintf(stderr, "test_engine_group: %s\n", duet_error_last());
        return 1;
    }
    int ok = size == cp * tp;
    if (!ok && rank == 0)
        fprintf(stderr, "test_engine_group: %d ranks for cp %d x tp %d\n", size, cp, tp);
    static ref_t ref;
    if (ok && rank == 0) {
        duet_model_t *alone = load(dir, NULL, 1, 1);
        ok = alone != NULL && run(alone, NULL, 1, &ref);
        duet_model_free(alone);
    }
    /* every rank learns whether rank 0's reference ran: all or none go on */
    int32_t mine = ok, all[64];
    ok = c->ops->allgather(c, &mine, all, sizeof(mine)) == DUET_OK;
    for (int r = 0; ok && r < size; r++)
        ok = all[r] != 0;
    duet_model_t *m = ok ? load(dir, c, cp, tp) : NULL;
    mine = m != NULL;
    ok = c->ops->allgather(c, &mine, all, sizeof(mine)) == DUET_OK;
    for (int r = 0; ok && r < size; r++)
        ok = all[r] != 0;
    if (ok)
        ok = run(m, c, 0, &ref);
    if (ok && rank == 0) {
        printf("test_engine_group %s cp %d x tp %d: %d steps of %d sequences, max |logit diff| "
               "%.3g (tolerance %.0e), greedy token differences %d\n",
               dir, cp, tp, STEPS, NS, ref.max_diff, TOL, ref.token_diffs);
        ok = ref.max_diff <= TOL && ref.token_diffs == 0;
        if (!ok)
            fprintf(stderr, "test_engine_group: FAILED: the group's logits differ from one "
                            "process's\n");
    }
    mine = ok;
    if (c->ops->allgather(c, &mine, all, sizeof(mine)) != DUET_OK)
        mine = 0;
    for (int r = 0; r < size; r++)
        ok = ok && all[r] != 0;
    duet_model_free(m);
    duet_comm_destroy(c);
    duet_group_mpi_finalize();
    return ok ? 0 : 1;
}
