/*
 * test_comm_mpi.c: the "mpi" transport of common/comm.h (group/comm_mpi.c) checked across real
 * ranks. A plain C program, not a Criterion suite: it runs as N ranks under mpirun (ctest starts
 * it at N = 2 and 4, tests/group/group.cmake), each rank checks what it received against data
 * it can compute itself, prints "FAIL" with a reason for every failed check, and the job
 * exits nonzero when any rank failed.
 *
 * Modes:
 *   (none)          every op, the refusals, the timeout (under mpirun, N >= 2)
 *   --kill TAG      one rank SIGKILLs itself while the others loop on collectives: driven by
 *                   tests/group/kill_rank.sh, which checks that mpirun ends the job (TAG marks
 *                   this job's processes for its leftover check)
 *   --launched-env  duet_group_mpi_launched against environments set here (no MPI, no mpirun)
 */
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <mpi.h>

#include "common/comm.h"
#include "group/comm_mpi.h"

static int g_rank = -1, g_fail = 0;

/* one write per failure, so that the ranks' lines do not interleave */
#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            char why_[512];                                                                        \
            snprintf(why_, sizeof(why_), __VA_ARGS__);                                             \
            fprintf(stderr, "test_comm_mpi rank %d: FAIL %s:%d: %s\n", g_rank, __func__, __LINE__, \
                    why_);                                                                         \
            g_fail++;                                                                              \
        }                                                                                          \
    } while (0)

/* st must be `want`; on a mismatch the detail says why */
#define CHECK_ST(st, want, what)                                                                   \
    CHECK((st) == (want), "%s: got %s (%s), want %s", what, duet_status_name(st),                  \
          duet_error_last(), duet_status_name(want))

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0)
        ;
}

static uint8_t pattern(int a, int b, int k)
{
    return (uint8_t)(a * 31 + b * 17 + k * 3 + 1);
}

static void check_allgather(duet_comm_t *c)
{
    enum { B = 13 };
    const int n = c->size;
    uint8_t send[B], *recv = malloc((size_t)n * B);
    for (int k = 0; k < B; k++)
        send[k] = pattern(c->rank, 0, k);
    memset(recv, 0xEE, (size_t)n * B);
    CHECK_ST(c->ops->allgather(c, send, recv, B), DUET_OK, "allgather");
    for (int r = 0; r < n; r++)
        for (int k = 0; k < B; k++)
            CHECK(recv[r * B + k] == pattern(r, 0, k),
                  "allgather: byte %d of rank %d is %u, not %u", k, r, recv[r * B + k],
                  pattern(r, 0, k));
    /* zero bytes: nothing moves, nothing is written */
    CHECK_ST(c->ops->allgather(c, send, recv, 0), DUET_OK, "allgather of 0 bytes");
    CHECK(recv[0] == pattern(0, 0, 0), "allgather of 0 bytes wrote into recv");
    free(recv);
}

/* Rank r's element i: large values that cancel and small ones that vanish beside them, rotated
 * by element, so that the float sum depends on the order the parts are added in. */
static float reduce_value(int r, int64_t i)
{
    static const float v[] = {1e8f, 1.0f, -1e8f, 1.0f, 3.0e7f, -0.25f};
    return v[(r + i) % 6] + (float)(i % 5) * 0.125f;
}

static void check_allreduce(duet_comm_t *c)
{
    const int n = c->size;
    const int64_t len = 96;
    float *buf = malloc(sizeof(float) * len), *scratch = malloc(sizeof(float) * len * n);
    float *want = malloc(sizeof(float) * len), *all = malloc(sizeof(float) * len * n);
    for (int64_t i = 0; i < len; i++)
        buf[i] = reduce_value(c->rank, i);
    CHECK_ST(c->ops->allreduce_sum_f32(c, buf, len, scratch), DUET_OK, "allreduce_sum_f32");
    /* the reference: the rank-order float sum, written out here */
    int order_matters = 0;
    for (int64_t i = 0; i < len; i++) {
        float acc = reduce_value(0, i), rev = reduce_value(n - 1, i);
        for (int r = 1; r < n; r++)
            acc += reduce_value(r, i);
        for (int r = n - 2; r >= 0; r--)
            rev += reduce_value(r, i);
        want[i] = acc;
        order_matters |= memcmp(&acc, &rev, sizeof(float)) != 0;
        CHECK(memcmp(&buf[i], &acc, sizeof(float)) == 0,
              "allreduce element %lld is %.9g, the rank-order sum is %.9g", (long long)i, buf[i],
              acc);
    }
    /* with 3 or more ranks the values do make the order visible, so the check above has teeth */
    if (n >= 3)
        CHECK(order_matters, "no element's sum depends on the order: the check could not fail");
    /* every rank holds the same bits (gathered by plain MPI, not by the transport under test) */
    MPI_Allgather(buf, (int)len, MPI_FLOAT, all, (int)len, MPI_FLOAT, MPI_COMM_WORLD);
    for (int r = 0; r < n; r++)
        CHECK(memcmp(all + (int64_t)r * len, all, sizeof(float) * len) == 0,
              "allreduce: rank %d's result differs from rank 0's", r);
    CHECK_ST(c->ops->allreduce_sum_f32(c, buf, 0, scratch), DUET_OK, "allreduce of 0 floats");
    CHECK_ST(c->ops->allreduce_sum_f32(c, buf, -1, scratch), DUET_ERR_INVALID,
             "allreduce of -1 floats");
    free(buf), free(scratch), free(want), free(all);
}

/* What rank s sends rank d: uneven, and zero for some pairs (s = d included for some n). */
static size_t a2a_bytes(int s, int d)
{
    return (size_t)((s * 3 + d * 5 + 1) % 6) * 7;
}

static void check_alltoallv(duet_comm_t *c)
{
    const int n = c->size, me = c->rank;
    size_t *sb = calloc(n, sizeof(size_t)), *so = calloc(n, sizeof(size_t));
    size_t *rb = calloc(n, sizeof(size_t)), *ro = calloc(n, sizeof(size_t));
    size_t stot = 0, rtot = 0;
    int zeros = 0;
    /* parts laid out in reverse rank order with 3-byte gaps, so offsets are exercised */
    for (int r = n - 1; r >= 0; r--) {
        sb[r] = a2a_bytes(me, r), so[r] = stot, stot += sb[r] + 3;
        rb[r] = a2a_bytes(r, me), ro[r] = rtot, rtot += rb[r] + 3;
        zeros += sb[r] == 0 || rb[r] == 0;
    }
    uint8_t *send = malloc(stot), *recv = malloc(rtot);
    memset(send, 0x55, stot);
    memset(recv, 0xEE, rtot);
    for (int r = 0; r < n; r++)
        for (size_t k = 0; k < sb[r]; k++)
            send[so[r] + k] = pattern(me, r, (int)k);
    CHECK_ST(c->ops->alltoallv(c, send, sb, so, recv, rb, ro), DUET_OK, "alltoallv");
    for (int r = 0; r < n; r++) {
        for (size_t k = 0; k < rb[r]; k++)
            CHECK(recv[ro[r] + k] == pattern(r, me, (int)k),
                  "alltoallv: byte %zu from rank %d is %u, not %u", k, r, recv[ro[r] + k],
                  pattern(r, me, (int)k));
        for (size_t k = 0; k < 3; k++)
            CHECK(recv[ro[r] + rb[r] + k] == 0xEE, "alltoallv wrote into the gap after rank %d", r);
    }
    int any_zero = 0;
    MPI_Allreduce(&zeros, &any_zero, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    CHECK(any_zero > 0, "the sizes chosen have no zero: the zero case went untested");
    /* every size zero */
    size_t *z = calloc(n, sizeof(size_t));
    CHECK_ST(c->ops->alltoallv(c, NULL, z, z, NULL, z, z), DUET_OK, "alltoallv of nothing");
    free(z), free(sb), free(so), free(rb), free(ro), free(send), free(recv);
}

static void check_bcast(duet_comm_t *c)
{
    enum { B = 100 };
    const int root = c->size - 1;
    uint8_t buf[B];
    for (int k = 0; k < B; k++)
        buf[k] = c->rank == root ? pattern(root, 7, k) : 0;
    CHECK_ST(c->ops->bcast(c, buf, B, root), DUET_OK, "bcast");
    for (int k = 0; k < B; k++)
        CHECK(buf[k] == pattern(root, 7, k), "bcast: byte %d is %u, not %u", k, buf[k],
              pattern(root, 7, k));
    CHECK_ST(c->ops->bcast(c, buf, B, c->size), DUET_ERR_INVALID, "bcast from rank size");
    CHECK_ST(c->ops->bcast(c, buf, B, -1), DUET_ERR_INVALID, "bcast from rank -1");
}

/* No rank leaves the barrier before the last one entered it: rank 0 enters 200 ms late, and the
 * ranks (one host, one monotonic clock) compare their entry and exit times. */
static void check_barrier(duet_comm_t *c)
{
    const int n = c->size;
    if (c->rank == 0)
        sleep_ms(200);
    double t[2] = {now_ms(), 0}, *all = malloc(sizeof(t) * n);
    CHECK_ST(c->ops->barrier(c), DUET_OK, "barrier");
    t[1] = now_ms();
    MPI_Allgather(t, 2, MPI_DOUBLE, all, 2, MPI_DOUBLE, MPI_COMM_WORLD);
    double last_in = 0;
    for (int r = 0; r < n; r++)
        last_in = fmax(last_in, all[2 * r]);
    for (int r = 0; r < n; r++)
        CHECK(all[2 * r + 1] >= last_in, "barrier: rank %d left %.3f ms before the last entered", r,
              last_in - all[2 * r + 1]);
    free(all);
}

static size_t gv_len(int r)
{
    return r == 1 ? 0 : (size_t)(r * 5 + 3);
}

static void check_gatherv(duet_comm_t *c)
{
    const int n = c->size, root = 1, me = c->rank;
    uint8_t send[64] = {0}, recv[512];
    size_t lens[64], total = 0;
    for (size_t k = 0; k < gv_len(me); k++)
        send[k] = pattern(me, 3, (int)k);
    for (int r = 0; r < n; r++)
        total += gv_len(r);
    memset(recv, 0xEE, sizeof(recv));
    duet_status_t st = duet_comm_mpi_gatherv_bytes(c, send, gv_len(me), me == root ? recv : NULL,
                                                   me == root ? lens : NULL, sizeof(recv), root);
    CHECK_ST(st, DUET_OK, "gatherv_bytes");
    if (me == root && st == DUET_OK) {
        size_t at = 0;
        for (int r = 0; r < n; r++) {
            CHECK(lens[r] == gv_len(r), "gatherv: rank %d's length is %zu, not %zu", r, lens[r],
                  gv_len(r));
            for (size_t k = 0; k < gv_len(r); k++)
                CHECK(recv[at + k] == pattern(r, 3, (int)k),
                      "gatherv: byte %zu of rank %d is %u, not %u", k, r, recv[at + k],
                      pattern(r, 3, (int)k));
            at += gv_len(r);
        }
        CHECK(recv[total] == 0xEE, "gatherv wrote past the packed total %zu", total);
    }
    /* root's capacity one byte short: every rank refuses alike and nothing moves */
    memset(recv, 0xEE, sizeof(recv));
    st = duet_comm_mpi_gatherv_bytes(c, send, gv_len(me), me == root ? recv : NULL,
                                     me == root ? lens : NULL, total - 1, root);
    CHECK_ST(st, DUET_ERR_RANGE, "gatherv past root's capacity");
    CHECK(strstr(duet_error_last(), "capacity") != NULL, "gatherv refusal says: %s",
          duet_error_last());
    CHECK(recv[0] == 0xEE, "a refused gatherv wrote into recv");
    /* root without a lengths array: every rank refuses */
    st = duet_comm_mpi_gatherv_bytes(c, send, gv_len(me), recv, NULL, sizeof(recv), root);
    CHECK_ST(st, DUET_ERR_INVALID, "gatherv with no lengths array at root");
    CHECK_ST(duet_comm_mpi_gatherv_bytes(c, send, 1, recv, lens, sizeof(recv), n), DUET_ERR_INVALID,
             "gatherv to rank size");
    duet_comm_t *self = NULL;
    CHECK_ST(duet_comm_self_create(&self), DUET_OK, "self create");
    CHECK_ST(duet_comm_mpi_gatherv_bytes(self, send, 1, recv, lens, sizeof(recv), 0),
             DUET_ERR_INVALID, "gatherv on a self communicator");
    duet_comm_destroy(self);
    /* still healthy after the refusals */
    CHECK_ST(c->ops->barrier(c), DUET_OK, "barrier after gatherv refusals");
}

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
    size_t lens[64];
    CHECK_ST(duet_comm_mpi_gatherv_bytes(c, bogus, big, bogus, lens, SIZE_MAX, 0), DUET_ERR_RANGE,
             "gatherv past INT_MAX");
    char *all = malloc((size_t)n);
    CHECK_ST(c->ops->allgather(c, one, all, 1), DUET_OK, "allgather after refusals");
    free(all);
}

/* The bound: the last rank sleeps past a 300 ms timeout while the others call allgather. They
 * must give up within the timeout plus slack, with a detail naming the op and the size, and
 * every later op must fail at once. The sleeper's own allgather then completes (the others'
 * collectives are still pending, in memory their communicator leaked, and MPI progresses them
 * while they wait in the world barrier), after which everyone meets again. */
enum { TIMEOUT_MS = 300, SLACK_MS = 700, SLEEP_MS = 1200 };

static void check_timeout(void)
{
    duet_comm_t *c = NULL;
    duet_status_t st = duet_comm_mpi_create(TIMEOUT_MS, &c);
    CHECK_ST(st, DUET_OK, "create with a 300 ms timeout");
    if (st != DUET_OK)
        return;
    const int late = c->size - 1;
    uint8_t send[8], *recv = malloc((size_t)c->size * 8);
    memset(send, c->rank + 1, sizeof(send));
    if (c->rank == late) {
        sleep_ms(SLEEP_MS);
        const double t0 = now_ms();
        st = c->ops->allgather(c, send, recv, sizeof(send));
        const double dt = now_ms() - t0;
        CHECK_ST(st, DUET_OK, "the late rank's allgather");
        CHECK(dt <= TIMEOUT_MS + SLACK_MS, "the late rank's allgather took %.0f ms", dt);
        for (int r = 0; st == DUET_OK && r < c->size; r++)
            CHECK(recv[r * 8] == r + 1, "late allgather: rank %d sent %u", r, recv[r * 8]);
    } else {
        const double t0 = now_ms();
        st = c->ops->allgather(c, send, recv, sizeof(send));
        const double dt = now_ms() - t0;
        CHECK_ST(st, DUET_ERR_TIMEOUT, "allgather with a rank asleep");
        CHECK(dt >= TIMEOUT_MS - 1 && dt <= TIMEOUT_MS + SLACK_MS,
              "the timeout took %.0f ms (timeout %d ms, slack %d ms)", dt, TIMEOUT_MS, SLACK_MS);
        char want[32];
        snprintf(want, sizeof(want), "of %d", c->size);
        CHECK(strstr(duet_error_last(), "allgather") != NULL &&
                  strstr(duet_error_last(), want) != NULL,
              "the detail names neither the op nor the size: %s", duet_error_last());
        /* broken: every later op fails at once, without waiting for anyone */
        float f = 1, scratch[64];
        size_t z[64] = {0};
        const double t1 = now_ms();
        CHECK_ST(c->ops->barrier(c), DUET_ERR_TRANSPORT, "barrier after a timeout");
        CHECK_ST(c->ops->allgather(c, send, recv, sizeof(send)), DUET_ERR_TRANSPORT,
                 "allgather after a timeout");
        CHECK_ST(c->ops->allreduce_sum_f32(c, &f, 1, scratch), DUET_ERR_TRANSPORT,
                 "allreduce after a timeout");
        CHECK_ST(c->ops->alltoallv(c, NULL, z, z, NULL, z, z), DUET_ERR_TRANSPORT,
                 "alltoallv after a timeout");
        CHECK_ST(c->ops->bcast(c, &f, sizeof(f), 0), DUET_ERR_TRANSPORT, "bcast after a timeout");
        CHECK_ST(duet_comm_mpi_gatherv_bytes(c, send, 1, NULL, NULL, 0, 0), DUET_ERR_TRANSPORT,
                 "gatherv after a timeout");
        const double dt1 = now_ms() - t1;
        CHECK(dt1 < 50, "six ops on a broken communicator took %.1f ms", dt1);
    }
    free(recv);
    MPI_Barrier(MPI_COMM_WORLD);
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
        check_allgather(c);
        check_allreduce(c);
        check_alltoallv(c);
        check_bcast(c);
        check_barrier(c);
        check_gatherv(c);
        check_int_max(c);
        duet_comm_destroy(c);
    }
    if (size >= 2)
        check_timeout();

    int any = 0;
    MPI_Allreduce(&g_fail, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (g_rank == 0)
        printf("test_comm_mpi: %d ranks: %s\n", size,
               any == 0 ? "all checks passed" : "FAILED (see the FAIL lines)");
    duet_group_mpi_finalize();
    duet_group_mpi_finalize(); /* idempotent */
    return g_fail != 0;
}
