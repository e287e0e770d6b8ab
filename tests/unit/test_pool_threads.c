/*
 * test_pool_threads.c: the CPU thread pool's checks (tests/unit/pool_checks.h) as a plain
 * program, the form in which they run under ThreadSanitizer (the DUET_SANITIZE=thread build in
 * CI): Criterion cannot start under TSan (its sandbox maps its arena at addresses TSan keeps for
 * itself; Criterion issue 274), so the checks test_kernels_cpu runs as a suite run here in one
 * process, with fewer jobs: TSan reports an unordered access however the timing of one run fell.
 * Prints a FAIL line per failed check and exits 1 if any failed.
 * Usage: test_pool_threads [JOBS]    JOBS: jobs back to back (default 20000; the suite runs 1e6)
 */
#include <stdio.h>
#include <stdlib.h>

static int g_fail = 0;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "test_pool_threads: FAIL %s:%d: ", __func__, __LINE__);                \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
            g_fail++;                                                                              \
        }                                                                                          \
    } while (0)

#include "tests/unit/pool_checks.h"

int main(int argc, char **argv)
{
    int jobs = 20000;
    if (argc > 2 || (argc == 2 && (jobs = atoi(argv[1])) <= 0)) {
        fprintf(stderr, "usage: test_pool_threads [JOBS]\n");
        return 2;
    }
    int combos = pool_check_parallel_for_covers_once();
    pool_check_many_small_jobs(jobs / 10);
    pool_check_jobs_back_to_back(jobs);
    pool_check_nested_runs_inline();
    printf("test_pool_threads: %d parallel_for combos, %d + %d jobs back to back, nested: %s\n",
           combos, jobs / 10, jobs, g_fail == 0 ? "all checks passed" : "FAILED");
    return g_fail != 0;
}
