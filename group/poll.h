/*
 * poll.h: the bounded wait both group transports (comm_mpi.c, comm_nccl.c) wrap around a request
 * they poll: a deadline from the communicator's timeout_ms, and a pause between polls that spins
 * briefly (a peer that is a few microseconds behind costs no sleep) and then sleeps in short,
 * growing steps, because a group's ranks share few cores with the engine's compute threads and a
 * rank waiting for a slow peer must not burn one. Internal to group/.
 */
#ifndef DUET_GROUP_POLL_H
#define DUET_GROUP_POLL_H

#include <stdint.h>
#include <time.h>

/* Spin this long before the first sleep, then sleep from DUET__POLL_SLEEP_MIN_NS, doubling to at
 * most DUET__POLL_SLEEP_MAX_NS: the cap keeps the latency a sleep adds to a late completion
 * small against a decode step. */
#define DUET__POLL_SPIN_NS      50000
#define DUET__POLL_SLEEP_MIN_NS 10000
#define DUET__POLL_SLEEP_MAX_NS 250000

typedef struct {
    uint64_t start_ns;
    uint64_t deadline_ns; /* 0: unbounded */
    uint64_t sleep_ns;    /* the next sleep; 0 while still spinning */
} duet__poll_t;

static inline uint64_t duet__poll_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Starts a wait bounded by timeout_ms (0 or less: unbounded). */
static inline void duet__poll_start(duet__poll_t *p, int64_t timeout_ms)
{
    p->start_ns = duet__poll_now_ns();
    p->deadline_ns = timeout_ms > 0 ? p->start_ns + (uint64_t)timeout_ms * 1000000u : 0;
    p->sleep_ns = 0;
}

/* 1 when the deadline has passed (never for an unbounded wait). */
static inline int duet__poll_expired(const duet__poll_t *p)
{
    return p->deadline_ns != 0 && duet__poll_now_ns() >= p->deadline_ns;
}

/* Milliseconds since duet__poll_start, for error details. */
static inline int64_t duet__poll_elapsed_ms(const duet__poll_t *p)
{
    return (int64_t)((duet__poll_now_ns() - p->start_ns) / 1000000u);
}

/* The pause between two polls: nothing while in the spin window, then a growing sleep. */
static inline void duet__poll_pause(duet__poll_t *p)
{
    if (p->sleep_ns == 0) {
        if (duet__poll_now_ns() - p->start_ns < DUET__POLL_SPIN_NS)
            return;
        p->sleep_ns = DUET__POLL_SLEEP_MIN_NS;
    }
    struct timespec ts = {0, (long)p->sleep_ns};
    nanosleep(&ts, NULL);
    if (p->sleep_ns < DUET__POLL_SLEEP_MAX_NS)
        p->sleep_ns *= 2;
    if (p->sleep_ns > DUET__POLL_SLEEP_MAX_NS)
        p->sleep_ns = DUET__POLL_SLEEP_MAX_NS;
}

#endif /* DUET_GROUP_POLL_H */
