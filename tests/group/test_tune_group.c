/*
 * test_tune_group: the autotuner's profiling split over a real group (kernels/tune.h over the MPI
 * transport). Not a Criterion suite: it runs as N MPI ranks under mpirun (tests/group/group.cmake).
 *
 * Every rank registers the same (shape, tactic) pairs, in an order of its own, and runs the tuner
 * over the group with a deterministic cost model injected (a hash of the pair: few distinct
 * values, so ties happen) that counts which pairs this rank profiled. Checked: every pair with
 * more than one candidate was profiled exactly once over the group and the others never; each
 * rank profiled its 1/N share (within one pair, and the pairs of one-candidate shapes that fall
 * in its share and need no profile); every rank holds the same table; and that table equals the
 * one a single rank profiling everything alone (comm NULL) chooses. Every rank makes every
 * collective call whatever it found, so one rank's failure cannot leave the others waiting.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/comm.h"
#include "group/comm_mpi.h"
#include "kernels/tune.h"

#define N_SHAPES 24
#define N_TAC    9

static duet_tune_key_t keys[N_SHAPES];
static int tactics[N_SHAPES][N_TAC], n_tac[N_SHAPES];
static int profiled[N_SHAPES][N_TAC];

static double cost(const duet_tune_key_t *k, int tactic)
{
    uint64_t h = (uint64_t)k->dtype * 0xbf58476d1ce4e5b9u ^ (uint64_t)k->m * 0x94d049bb133111ebu ^
                 (uint64_t)k->n * 0x2545f4914f6cdd1du ^ (uint64_t)k->k * 0x5851f42d4c957f2du ^
                 (uint64_t)(tactic + 1) * 0x14057b7ef767814fu;
    h ^= h >> 31;
    h *= 0x9e3779b97f4a7c15u;
    h ^= h >> 29;
    return 1e-6 * (double)(1 + h % 3);
}

static double profile(void *user, const duet_tune_key_t *key, int tactic)
{
    int *count = user;
    for (int i = 0; i < N_SHAPES; i++)
        if (duet_tune_key_cmp(&keys[i], key) == 0) {
            profiled[i][tactic]++;
            (*count)++;
            return cost(key, tactic);
        }
    return NAN;
}

/* The shapes registered in the order rank `rank` uses; returns the tuner or NULL. */
static duet_tune_t *tuner(int rank)
{
    duet_tune_space_t sp = {0};
    sp.n_tactics[DUET_TUNE_OP_CPU_MATMUL] = N_TAC;
    duet_tune_t *t = NULL;
    if (duet_tune_create(&sp, "test machine", &t) != DUET_OK)
        return NULL;
    for (int j = 0; j < N_SHAPES; j++) {
        const int i = (j * 5 + rank * 7) % N_SHAPES; /* 5 is prime to 24: a permutation */
        if (duet_tune_add(t, &keys[i], tactics[i], n_tac[i]) != DUET_OK) {
            duet_tune_destroy(t);
            return NULL;
        }
    }
    return t;
}

int main(int argc, char **argv)
{
    int rank = 0, size = 1;
    duet_comm_t *c = NULL;
    if (duet_group_mpi_init(&argc, &argv, &rank, &size) != DUET_OK ||
        duet_comm_mpi_create(30000, &c) != DUET_OK) {
        fprintf(stderr, "test_tune_group: %s\n", duet_error_last());
        return 1;
    }
    int pairs = 0, singles = 0;
    for (int i = 0; i < N_SHAPES; i++) {
        keys[i] = (duet_tune_key_t){.op = DUET_TUNE_OP_CPU_MATMUL,
                                    .dtype = i % 3,
                                    .m = i % DUET_TUNE_M_BUCKETS,
                                    .n = 32 + 16 * i,
                                    .k = 4096 - 64 * i};
        n_tac[i] = i % 7 == 3 ? 1 : 2 + i % (N_TAC - 1);
        for (int t = 0; t < n_tac[i]; t++)
            tactics[i][t] = (t * 4 + i) % N_TAC; /* distinct: 4 is prime to 9 */
        if (n_tac[i] > 1)
            pairs += n_tac[i];
        else
            singles++;
    }
    int ok = 1, mine = 0;
    duet_tune_t *t = tuner(rank);
    duet_tune_stats_t stats;
    if (t == NULL || duet_tune_run(t, c, profile, &mine, &stats) != DUET_OK) {
        fprintf(stderr, "rank %d: %s\n", rank, duet_error_last());
        ok = 0;
    }
    /* every pair profiled once over the group: sum the counts in rank order */
    int counts[N_SHAPES * N_TAC], *all = calloc((size_t)size, sizeof(counts));
    memcpy(counts, profiled, sizeof(counts));
    if (all == NULL || c->ops->allgather(c, counts, all, sizeof(counts)) != DUET_OK) {
        fprintf(stderr, "rank %d: the counts' allgather: %s\n", rank, duet_error_last());
        return 1; /* the communicator is broken: nothing collective can follow */
    }
    for (int i = 0; i < N_SHAPES; i++)
        for (int x = 0; x < N_TAC; x++) {
            int sum = 0;
            for (int r = 0; r < size; r++)
                sum += all[r * N_SHAPES * N_TAC + i * N_TAC + x];
            int cand = 0;
            for (int y = 0; y < n_tac[i]; y++)
                cand |= tactics[i][y] == x;
            const int want = cand && n_tac[i] > 1 ? 1 : 0;
            if (sum != want) {
                fprintf(stderr,
                        "rank %d: shape %d tactic %d profiled %d times over the group, "
                        "want %d\n",
                        rank, i, x, sum, want);
                ok = 0;
            }
        }
    if (mine < pairs / size - singles || mine > (pairs + singles + size - 1) / size) {
        fprintf(stderr, "rank %d profiled %d of %d pairs: not its 1/%d share\n", rank, mine, pairs,
                size);
        ok = 0;
    }
    /* the same table everywhere, and the one a rank alone picks */
    int table[N_SHAPES], alone[N_SHAPES], *tables = calloc((size_t)size, sizeof(table));
    for (int i = 0; i < N_SHAPES; i++)
        table[i] = t != NULL ? duet_tune_get(t, &keys[i]) : -1;
    if (tables == NULL || c->ops->allgather(c, table, tables, sizeof(table)) != DUET_OK) {
        fprintf(stderr, "rank %d: the tables' allgather: %s\n", rank, duet_error_last());
        return 1;
    }
    duet_tune_t *solo = tuner(rank);
    int solo_count = 0;
    memset(profiled, 0, sizeof(profiled));
    if (solo == NULL || duet_tune_run(solo, NULL, profile, &solo_count, &stats) != DUET_OK) {
        fprintf(stderr, "rank %d alone: %s\n", rank, duet_error_last());
        ok = 0;
    }
    for (int i = 0; solo != NULL && i < N_SHAPES; i++) {
        alone[i] = duet_tune_get(solo, &keys[i]);
        for (int r = 0; r < size; r++)
            if (tables[r * N_SHAPES + i] != table[i]) {
                fprintf(stderr, "shape %d: rank %d chose %d, rank %d %d\n", i, r,
                        tables[r * N_SHAPES + i], rank, table[i]);
                ok = 0;
            }
        if (table[i] != alone[i] || table[i] < 0) {
            fprintf(stderr, "shape %d: the group chose %d, one rank alone %d\n", i, table[i],
                    alone[i]);
            ok = 0;
        }
    }
    if (solo_count != pairs) {
        fprintf(stderr, "alone: %d pairs profiled of %d\n", solo_count, pairs);
        ok = 0;
    }
    int32_t mine_ok = ok, oks[64];
    if (c->ops->allgather(c, &mine_ok, oks, sizeof(mine_ok)) != DUET_OK)
        ok = 0;
    for (int r = 0; r < size; r++)
        ok = ok && oks[r];
    if (rank == 0)
        printf(
            "test_tune_group: %d ranks, %d pairs: each profiled once over the group (rank 0: %d), "
            "tables equal on every rank and to one rank alone: %s\n",
            size, pairs, mine, ok ? "yes" : "NO");
    duet_tune_destroy(t);
    duet_tune_destroy(solo);
    free(all);
    free(tables);
    duet_comm_destroy(c);
    duet_group_mpi_finalize();
    return ok ? 0 : 1;
}
