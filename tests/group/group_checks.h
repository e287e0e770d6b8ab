/*
 * group_checks.h: the checks every transport of common/comm.h must pass across real ranks,
 * shared by test_comm_mpi.c (host buffers) and test_comm_nccl.c (device buffers): each test
 * gives the memory its transport works on (gt_mem_t) and calls these. Each rank computes what it
 * must receive from the ranks' numbers alone; results are compared across ranks with plain MPI on
 * MPI_COMM_WORLD, not with the transport under test. Header-only; the includer is a program run
 * as N ranks under mpirun (no Criterion): a failed check prints one "FAIL" line and counts.
 */
#ifndef DUET_TESTS_GROUP_CHECKS_H
#define DUET_TESTS_GROUP_CHECKS_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <mpi.h>

#include "common/comm.h"

static int g_rank = -1, g_fail = 0;
static const char *g_prog = "test";

/* one write per failure, so that the ranks' lines do not interleave */
#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            char why_[512];                                                                        \
            snprintf(why_, sizeof(why_), __VA_ARGS__);                                             \
            fprintf(stderr, "%s rank %d: FAIL %s:%d: %s\n", g_prog, g_rank, __func__, __LINE__,    \
                    why_);                                                                         \
            g_fail++;                                                                              \
        }                                                                                          \
    } while (0)

/* st must be `want`; on a mismatch the detail says why */
#define CHECK_ST(st, want, what)                                                                   \
    CHECK((st) == (want), "%s: got %s (%s), want %s", what, duet_status_name(st),                  \
          duet_error_last(), duet_status_name(want))

/* The memory a transport's buffers live in: host for on_device 0, device for 1. get is called
 * after the op returned, so the transport has made its results readable (comm.h). */
typedef struct {
    void *(*alloc)(size_t bytes);
    void (*put)(void *dst, const void *host, size_t bytes);
    void (*get)(void *host, const void *src, size_t bytes);
    void (*release)(void *p);
} gt_mem_t;

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

/* transport memory holding `bytes` bytes of host (a fresh buffer) */
static void *gt_upload(const gt_mem_t *mem, const void *host, size_t bytes)
{
    void *p = mem->alloc(bytes > 0 ? bytes : 1);
    if (p == NULL) {
        fprintf(stderr, "%s rank %d: no memory for %zu bytes\n", g_prog, g_rank, bytes);
        exit(1);
    }
    if (bytes > 0)
        mem->put(p, host, bytes);
    return p;
}

static void check_allgather(duet_comm_t *c, const gt_mem_t *mem)
{
    enum { B = 13 };
    const int n = c->size;
    uint8_t send[B], *recv = malloc((size_t)n * B);
    for (int k = 0; k < B; k++)
        send[k] = pattern(c->rank, 0, k);
    memset(recv, 0xEE, (size_t)n * B);
    void *dsend = gt_upload(mem, send, B), *drecv = gt_upload(mem, recv, (size_t)n * B);
    CHECK_ST(c->ops->allgather(c, dsend, drecv, B), DUET_OK, "allgather");
    mem->get(recv, drecv, (size_t)n * B);
    for (int r = 0; r < n; r++)
        for (int k = 0; k < B; k++)
            CHECK(recv[r * B + k] == pattern(r, 0, k),
                  "allgather: byte %d of rank %d is %u, not %u", k, r, recv[r * B + k],
                  pattern(r, 0, k));
    /* zero bytes: nothing moves, nothing is written */
    mem->put(drecv, (uint8_t[1]){0xEE}, 1);
    CHECK_ST(c->ops->allgather(c, dsend, drecv, 0), DUET_OK, "allgather of 0 bytes");
    mem->get(recv, drecv, 1);
    CHECK(recv[0] == 0xEE, "allgather of 0 bytes wrote into recv");
    mem->release(dsend), mem->release(drecv), free(recv);
}

/* Rank r's element i: large values that cancel and small ones that vanish beside them, rotated
 * by element, so that the float sum depends on the order the parts are added in. */
static float reduce_value(int r, int64_t i)
{
    static const float v[] = {1e8f, 1.0f, -1e8f, 1.0f, 3.0e7f, -0.25f};
    return v[(r + i) % 6] + (float)(i % 5) * 0.125f;
}

static void check_allreduce(duet_comm_t *c, const gt_mem_t *mem)
{
    const int n = c->size;
    const int64_t len = 96;
    float *buf = malloc(sizeof(float) * len), *all = malloc(sizeof(float) * len * n);
    for (int64_t i = 0; i < len; i++)
        buf[i] = reduce_value(c->rank, i);
    float *dbuf = gt_upload(mem, buf, sizeof(float) * len);
    float *dscratch = gt_upload(mem, all, sizeof(float) * len * n); /* contents unused */
    CHECK_ST(c->ops->allreduce_sum_f32(c, dbuf, len, dscratch), DUET_OK, "allreduce_sum_f32");
    mem->get(buf, dbuf, sizeof(float) * len);
    /* the reference: the rank-order float sum, written out here */
    int order_matters = 0;
    for (int64_t i = 0; i < len; i++) {
        float acc = reduce_value(0, i), rev = reduce_value(n - 1, i);
        for (int r = 1; r < n; r++)
            acc += reduce_value(r, i);
        for (int r = n - 2; r >= 0; r--)
            rev += reduce_value(r, i);
        order_matters |= memcmp(&acc, &rev, sizeof(float)) != 0;
        CHECK(memcmp(&buf[i], &acc, sizeof(float)) == 0,
              "allreduce element %lld is %.9g, the rank-order sum is %.9g", (long long)i, buf[i],
              acc);
    }
    /* with 3 or more ranks the values do make the order visible, so the check above has teeth */
    if (n >= 3)
        CHECK(order_matters, "no element's sum depends on the order: the check could not fail");
    /* every rank holds the same bits */
    MPI_Allgather(buf, (int)len, MPI_FLOAT, all, (int)len, MPI_FLOAT, MPI_COMM_WORLD);
    for (int r = 0; r < n; r++)
        CHECK(memcmp(all + (int64_t)r * len, all, sizeof(float) * len) == 0,
              "allreduce: rank %d's result differs from rank 0's", r);
    CHECK_ST(c->ops->allreduce_sum_f32(c, dbuf, 0, dscratch), DUET_OK, "allreduce of 0 floats");
    CHECK_ST(c->ops->allreduce_sum_f32(c, dbuf, -1, dscratch), DUET_ERR_INVALID,
             "allreduce of -1 floats");
    mem->release(dbuf), mem->release(dscratch), free(buf), free(all);
}

/* What rank s sends rank d: uneven, and zero for some pairs (s = d included for some n). */
static size_t a2a_bytes(int s, int d)
{
    return (size_t)((s * 3 + d * 5 + 1) % 6) * 7;
}

static void check_alltoallv(duet_comm_t *c, const gt_mem_t *mem)
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
    void *dsend = gt_upload(mem, send, stot), *drecv = gt_upload(mem, recv, rtot);
    CHECK_ST(c->ops->alltoallv(c, dsend, sb, so, drecv, rb, ro), DUET_OK, "alltoallv");
    mem->get(recv, drecv, rtot);
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
    mem->release(dsend), mem->release(drecv);
}

static void check_bcast(duet_comm_t *c, const gt_mem_t *mem)
{
    enum { B = 100 };
    const int root = c->size - 1;
    uint8_t buf[B];
    for (int k = 0; k < B; k++)
        buf[k] = c->rank == root ? pattern(root, 7, k) : 0;
    void *dbuf = gt_upload(mem, buf, B);
    CHECK_ST(c->ops->bcast(c, dbuf, B, root), DUET_OK, "bcast");
    mem->get(buf, dbuf, B);
    for (int k = 0; k < B; k++)
        CHECK(buf[k] == pattern(root, 7, k), "bcast: byte %d is %u, not %u", k, buf[k],
              pattern(root, 7, k));
    CHECK_ST(c->ops->bcast(c, dbuf, B, c->size), DUET_ERR_INVALID, "bcast from rank size");
    CHECK_ST(c->ops->bcast(c, dbuf, B, -1), DUET_ERR_INVALID, "bcast from rank -1");
    mem->release(dbuf);
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

/* The bound, on a communicator c made with a GT_TIMEOUT_MS timeout: the last rank sleeps past it
 * while the others call allgather. They must give up within the timeout plus slack, with a detail
 * naming the op and the size, and every later op must fail at once. The late rank's own
 * allgather then completes (late_completes: MPI, where the others' collectives are still pending
 * in memory their communicator kept and MPI progresses them in the world barrier) or fails
 * within its own bound (NCCL, where the others aborted). Ends with every rank in a world
 * barrier. Returns 1 on the ranks that timed out. */
enum { GT_TIMEOUT_MS = 300, GT_SLACK_MS = 700, GT_SLEEP_MS = 1200 };

static int check_timeout(duet_comm_t *c, const gt_mem_t *mem, int late_completes)
{
    const int late = c->size - 1, n = c->size;
    uint8_t send[8], *recv = malloc((size_t)n * 8);
    memset(send, c->rank + 1, sizeof(send));
    void *dsend = gt_upload(mem, send, sizeof(send)), *drecv = mem->alloc((size_t)n * 8);
    int timed_out = 0;
    if (c->rank == late) {
        sleep_ms(GT_SLEEP_MS);
        const double t0 = now_ms();
        duet_status_t st = c->ops->allgather(c, dsend, drecv, sizeof(send));
        const double dt = now_ms() - t0;
        if (late_completes) {
            CHECK_ST(st, DUET_OK, "the late rank's allgather");
            mem->get(recv, drecv, (size_t)n * 8);
            for (int r = 0; st == DUET_OK && r < n; r++)
                CHECK(recv[r * 8] == r + 1, "late allgather: rank %d sent %u", r, recv[r * 8]);
        } else {
            CHECK(st == DUET_ERR_TIMEOUT || st == DUET_ERR_TRANSPORT,
                  "the late rank's allgather with its peers gone: %s", duet_status_name(st));
        }
        CHECK(dt <= GT_TIMEOUT_MS + GT_SLACK_MS, "the late rank's allgather took %.0f ms", dt);
    } else {
        const double t0 = now_ms();
        duet_status_t st = c->ops->allgather(c, dsend, drecv, sizeof(send));
        const double dt = now_ms() - t0;
        timed_out = 1;
        CHECK_ST(st, DUET_ERR_TIMEOUT, "allgather with a rank asleep");
        CHECK(dt >= GT_TIMEOUT_MS - 1 && dt <= GT_TIMEOUT_MS + GT_SLACK_MS,
              "the timeout took %.0f ms (timeout %d ms, slack %d ms)", dt, GT_TIMEOUT_MS,
              GT_SLACK_MS);
        char want[32];
        snprintf(want, sizeof(want), "of %d", n);
        CHECK(strstr(duet_error_last(), "allgather") != NULL &&
                  strstr(duet_error_last(), want) != NULL,
              "the detail names neither the op nor the size: %s", duet_error_last());
        /* broken: every later op fails at once, without waiting for anyone */
        size_t *z = calloc(n, sizeof(size_t));
        const double t1 = now_ms();
        CHECK_ST(c->ops->barrier(c), DUET_ERR_TRANSPORT, "barrier after a timeout");
        CHECK_ST(c->ops->allgather(c, dsend, drecv, sizeof(send)), DUET_ERR_TRANSPORT,
                 "allgather after a timeout");
        CHECK_ST(c->ops->allreduce_sum_f32(c, dsend, 1, drecv), DUET_ERR_TRANSPORT,
                 "allreduce after a timeout");
        CHECK_ST(c->ops->alltoallv(c, NULL, z, z, NULL, z, z), DUET_ERR_TRANSPORT,
                 "alltoallv after a timeout");
        CHECK_ST(c->ops->bcast(c, dsend, 4, 0), DUET_ERR_TRANSPORT, "bcast after a timeout");
        const double dt1 = now_ms() - t1;
        CHECK(dt1 < 50, "five ops on a broken communicator took %.1f ms", dt1);
        free(z);
    }
    free(recv);
    MPI_Barrier(MPI_COMM_WORLD);
    /* device memory a broken NCCL communicator's aborted kernels used stays; the host's goes */
    if (!timed_out || late_completes)
        mem->release(dsend), mem->release(drecv);
    return timed_out;
}

#endif /* DUET_TESTS_GROUP_CHECKS_H */
