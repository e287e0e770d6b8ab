/*
 * test_comm_mpi.c: the "mpi" transport of common/comm.h (group/comm_mpi.c) checked across real
 * ranks. A plain C program, not a Criterion suite: it runs as N ranks under mpirun (ctest starts
 * it at N = 2 and 4, tests/group/group.cmake), each rank checks what it received against data
 * it can compute itself (the checks every transport shares are in group_checks.h), prints
 * "FAIL" with a reason for every failed check, and the job exits nonzero when any rank failed.
 *
 * Modes:
 *   (none)          every op, the refusals, the timeout (under mpirun, N >= 2)
 *   --kill TAG      one rank SIGKILLs itself while the others loop on collectives: driven by
 *                   tests/group/kill_rank.sh, which checks that mpirun ends the job (TAG marks
 *                   this job's processes for its leftover check)
 *   --launched-env  duet_group_mpi_launched against environments set here (no MPI, no mpirun)
 */
#include <limits.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <mpi.h>

#include "common/comm.h"
#include "group/comm_mpi.h"
#include "tests/group/group_checks.h"

static void *host_alloc(size_t bytes)
{
    return malloc(bytes);
}

static void host_copy(void *dst, const void *src, size_t bytes)
{
    memcpy(dst, src, bytes);
}

static const gt_mem_t host_mem = {host_alloc, host_copy, host_copy, free};

/* Sizes past MPI's int count are refused before any data is touched (the pointers given are
 * never read: a dereference would crash), and the communicator stays usable. */
static void check_int_max(duet_comm_t *c)
{
    const int n = c->size;
    const size_t big = (size_t)INT_MAX + 1;
    char one[1] = {0};
    void *bogus = (void *)(uintptr_t)0x10; /* never dereferenced */
    CHECK_ST(c->ops->allgather(c, bogus, bogus, big), DUET_ERR_RANGE, "allgather past INT_MAX");
    CHECK(strstr(duet_error_last(), "allgather") != NULL, "detail names the op: %s",
          duet_error_last());
    CHECK_ST(c->ops->bcast(c, bogus, big, 0), DUET_ERR_RANGE, "bcast past INT_MAX");
    CHECK_ST(c->ops->allreduce_sum_f32(c, bogus, (int64_t)INT_MAX / 4 + 1, bogus), DUET_ERR_RANGE,
             "allreduce past INT_MAX bytes");
    size_t *sb = calloc(n, sizeof(size_t)), *off = calloc(n, sizeof(size_t));
    sb[0] = big; /* every rank sends rank 0 too much, and rank 0 expects it from everyone */
    CHECK_ST(c->ops->alltoallv(c, bogus, sb, off, bogus, sb, off), DUET_ERR_RANGE,
             "alltoallv with one part past INT_MAX");
    /* parts that fit alone but whose total does not */
    for (int r = 0; r < n; r++)
        sb[r] = (size_t)INT_MAX / 2 + 1;
    CHECK_ST(c->ops->alltoallv(c, bogus, sb, off, bogus, sb, off), DUET_ERR_RANGE,
             "alltoallv with a total past INT_MAX");
    free(sb), free(off);
    char *all = malloc((size_t)n);
    CHECK_ST(c->ops->allgather(c, one, all, 1), DUET_OK, "allgather after refusals");
    free(all);
}

/* The bound (group_checks.h) on the MPI transport */
static void check_timeout_mpi(void)
{
    duet_comm_t *c = NULL;
    duet_status_t st = duet_comm_mpi_create(GT_TIMEOUT_MS, &c);
    CHECK_ST(st, DUET_OK, "create with a short timeout");
    if (st != DUET_OK)
        return;
    const double t0 = now_ms();
    if (check_timeout(c, &host_mem, 1)) {
        CHECK(now_ms() - t0 < GT_SLEEP_MS + GT_SLACK_MS + 2000, "the timeout check took %.0f ms",
              now_ms() - t0);
    }
    duet_comm_destroy(c);
}

/* --kill: the last rank kills itself at iteration 20 while every rank loops on collectives
 * (timeout 3 s). The others never finish the loop; whether mpirun ends them first or their ops
 * time out, the job must end nonzero, which kill_rank.sh checks with its timing and leftovers. */
static int run_kill(void)
{
    duet_comm_t *c = NULL;
    duet_status_t st = duet_comm_mpi_create(3000, &c);
    if (st != DUET_OK) {
        fprintf(stderr, "test_comm_mpi rank %d: create: %s\n", g_rank, duet_error_last());
        return 1;
    }
    const int victim = c->size - 1;
    float buf[256], *scratch = malloc(sizeof(float) * 256 * c->size);
    for (int it = 0; it < 1000000; it++) {
        if (c->rank == victim && it == 20) {
            printf("test_comm_mpi rank %d: killing myself at iteration %d\n", g_rank, it);
            fflush(stdout);
            raise(SIGKILL);
        }
        for (int i = 0; i < 256; i++)
            buf[i] = (float)(i + c->rank);
        st = c->ops->allreduce_sum_f32(c, buf, 256, scratch);
        if (st == DUET_OK)
            st = c->ops->barrier(c);
        if (st != DUET_OK) {
            printf("test_comm_mpi rank %d: iteration %d: %s: %s\n", g_rank, it,
                   duet_status_name(st), duet_error_last());
            fflush(stdout);
            _exit(3); /* a broken group: no finalisation (comm_mpi.h) */
        }
    }
    fprintf(stderr, "test_comm_mpi rank %d: FAIL: the loop finished although rank %d died\n",
            g_rank, victim);
    return 1;
}

/* --launched-env: duet_group_mpi_launched for the launchers' environments, set here one by
 * one (no MPI is initialised in this mode). */
static int run_launched_env(void)
{
    static const char *const vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK",
                                       "SLURM_STEP_NUM_TASKS"};
    static const struct {
        const char *vals[4]; /* in the order of vars; NULL: unset */
        int want;
    } cases[] = {
        {{NULL, NULL, NULL, NULL}, 0}, {{"4", NULL, NULL, NULL}, 1},
        {{"1", NULL, NULL, NULL}, 0},  {{"2", "1", NULL, NULL}, 1},
        {{"4x", NULL, NULL, NULL}, 0}, {{" 4", NULL, NULL, NULL}, 0},
        {{"-2", NULL, NULL, NULL}, 0}, {{"0", NULL, NULL, NULL}, 0},
        {{"99999999999", 0, 0, 0}, 0}, {{NULL, "3", NULL, NULL}, 1},
        {{NULL, "1", NULL, NULL}, 0},  {{"junk", "2", NULL, NULL}, 1},
        {{NULL, NULL, "0", NULL}, 1},  {{NULL, NULL, "0", "1"}, 0},
        {{NULL, NULL, "1", "8"}, 1},   {{NULL, NULL, "", NULL}, 0},
        {{NULL, NULL, NULL, "8"}, 0},  {{"1", NULL, "0", "8"}, 0},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        for (int v = 0; v < 4; v++) {
            if (cases[i].vals[v] != NULL)
                setenv(vars[v], cases[i].vals[v], 1);
            else
                unsetenv(vars[v]);
        }
        const int got = duet_group_mpi_launched();
        CHECK(got == cases[i].want, "case %zu: launched() is %d, want %d", i, got, cases[i].want);
    }
    printf("test_comm_mpi --launched-env: %zu cases, %d failed\n", sizeof(cases) / sizeof(cases[0]),
           g_fail);
    return g_fail != 0;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    g_prog = "test_comm_mpi";
    if (argc >= 2 && strcmp(argv[1], "--launched-env") == 0)
        return run_launched_env();
    const int kill_mode = argc >= 3 && strcmp(argv[1], "--kill") == 0;
    if (argc >= 2 && !kill_mode) {
        fprintf(stderr, "usage: test_comm_mpi [--kill TAG | --launched-env]\n");
        return 2;
    }
    /* mpirun says the job has more than one rank before MPI is touched */
    const int launched = duet_group_mpi_launched();
    int size = 0;
    duet_status_t st = duet_group_mpi_init(&argc, &argv, &g_rank, &size);
    if (st != DUET_OK) {
        fprintf(stderr, "test_comm_mpi: FAIL: init: %s\n", duet_error_last());
        return 1;
    }
    if (kill_mode)
        return run_kill();
    CHECK(size >= 2 && size <= 64, "run this under mpirun with 2 to 64 ranks (size %d)", size);
    CHECK(launched == 1, "launched() is %d under mpirun with %d ranks", launched, size);
    int r2 = -1, n2 = -1;
    CHECK_ST(duet_group_mpi_init(NULL, NULL, &r2, &n2), DUET_OK, "a second init");
    CHECK(r2 == g_rank && n2 == size, "a second init gives rank %d of %d", r2, n2);

    duet_comm_t *c = NULL;
    st = duet_comm_mpi_create(10000, &c);
    CHECK_ST(st, DUET_OK, "create");
    if (st == DUET_OK) {
        CHECK(c->rank == g_rank && c->size == size && strcmp(c->ops->name, "mpi") == 0 &&
                  c->ops->on_device == 0 && c->timeout_ms == 10000,
              "create: rank %d of %d, \"%s\", on_device %d, timeout %lld", c->rank, c->size,
              c->ops->name, c->ops->on_device, (long long)c->timeout_ms);
        check_allgather(c, &host_mem);
        check_allreduce(c, &host_mem);
        check_alltoallv(c, &host_mem);
        check_bcast(c, &host_mem);
        check_barrier(c);
        check_int_max(c);
        duet_comm_destroy(c);
    }
    if (size >= 2)
        check_timeout_mpi();

    int any = 0;
    MPI_Allreduce(&g_fail, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (g_rank == 0)
        printf("test_comm_mpi: %d ranks: %s\n", size,
               any == 0 ? "all checks passed" : "FAILED (see the FAIL lines)");
    duet_group_mpi_finalize();
    duet_group_mpi_finalize(); /* idempotent */
    return g_fail != 0;
}
