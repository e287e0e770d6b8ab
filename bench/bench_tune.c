/*
 * bench_tune.c: duet-bench-tune, how long the autotuner's warm-up (kernels/tune.h, issue 39)
 * takes when a model loads with opts.tune: the load's time with tuning on less the load's time
 * with it off, the median of several loads each, for decode shapes up to --max-seqs rows.
 *
 * Usage: duet-bench-tune [--model DIR] [--threads N] [--max-seqs S] [--reps R]
 *
 * The warm-up is collective over a communicator (common/comm.h). Alone it is the one-rank "self"
 * transport; started by mpirun as N ranks it is the MPI transport and the model loads as a
 * generation group of cp N (engine/shard.h): every rank tunes its cut's shapes and profiles its
 * share of the pairs; each prints its own line, "rank r of n".
 *
 *   mpirun -n 2 duet-bench-tune [options]
 */
#include <float.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/comm.h"
#include "common/config.h"
#include "common/log.h"
#include "common/version.h"
#include "engine/model.h"
#include "group/comm_mpi.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_dbl(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The group the warm-up is split over: the one place to change for MPI. */
static duet_status_t bench_comm_create(int *argc, char ***argv, duet_comm_t **c_p)
{
    if (!duet_group_mpi_launched())
        return duet_comm_self_create(c_p);
    int rank, size;
    duet_status_t st = duet_group_mpi_init(argc, argv, &rank, &size);
    return st != DUET_OK ? st : duet_comm_mpi_create(600000, c_p);
}

/* Seconds duet_model_load takes with tune on or off (the model freed again). */
static duet_status_t timed_load(const char *dir, const duet_model_opts_t *base, int tune,
                                double *sec)
{
    duet_model_opts_t o = *base;
    o.tune = tune;
    duet_model_t *m = NULL;
    double t0 = now_s();
    duet_status_t st = duet_model_load(dir, &o, &m);
    *sec = now_s() - t0;
    duet_model_free(m);
    return st;
}

int main(int argc, char **argv)
{
    char dir_buf[1024];
    const char *dir = NULL;
    int64_t threads = 0, max_seqs = 8, reps = 5;
    for (int i = 1; i < argc; i++) {
        if (duet_version_flag(argv[i])) {
            duet_version_print("duet-bench-tune");
            return 0;
        }
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            printf("usage: duet-bench-tune [--model DIR] [--threads N] [--max-seqs S] [--reps R]\n"
                   "Seconds the autotuner's warm-up adds to a CPU model's load (tune on less\n"
                   "tune off, the median of R loads each; default 5) for decode shapes of 1..S\n"
                   "rows (default 8). DIR defaults to models/duet-demo of the source tree.\n");
            return 0;
        }
        int64_t *dst = NULL, lo = 1, hi = 1 << 20;
        if (strcmp(argv[i], "--model") == 0 && i + 1 < argc) {
            dir = argv[++i];
            continue;
        } else if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
            dst = &threads, hi = 4096;
        } else if (strcmp(argv[i], "--max-seqs") == 0 && i + 1 < argc) {
            dst = &max_seqs, hi = 4096;
        } else if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
            dst = &reps, hi = 1000;
        } else {
            fprintf(stderr, "duet-bench-tune: unknown option %s (see --help)\n", argv[i]);
            return 2;
        }
        if (duet_config_parse_int(argv[i + 1], lo, hi, dst) != DUET_OK) {
            fprintf(stderr, "duet-bench-tune: bad value '%s' for %s\n", argv[i + 1], argv[i]);
            return 2;
        }
        i++;
    }
    if (dir == NULL) {
        snprintf(dir_buf, sizeof(dir_buf), "%s/models/duet-demo", DUET_SOURCE_DIR);
        dir = dir_buf;
    }
    duet_log_set_level(DUET_LOG_LEVEL_WARN); /* one tune line per load otherwise */

    duet_comm_t *comm = NULL;
    duet_status_t st = bench_comm_create(&argc, &argv, &comm);
    if (st != DUET_OK) {
        fprintf(stderr, "duet-bench-tune: %s\n", duet_error_last());
        return 1;
    }
    duet_model_opts_t base;
    duet_model_opts_default(&base);
    base.device = DUET_DEVICE_CPU;
    base.n_threads = (int)threads;
    base.max_seqs = max_seqs;
    base.max_seq_len = 256;
    base.comm = comm;
    base.helix_cp = comm->size; /* under mpirun: a group of cp N */
    double *on = calloc((size_t)reps, sizeof(double)), *off = calloc((size_t)reps, sizeof(double));
    int rc = 1;
    if (on == NULL || off == NULL)
        goto out;
    for (int64_t r = 0; r < reps; r++) {
        if ((st = timed_load(dir, &base, 0, &off[r])) != DUET_OK ||
            (st = timed_load(dir, &base, 1, &on[r])) != DUET_OK) {
            fprintf(stderr, "duet-bench-tune: %s: %s\n", dir, duet_error_last());
            goto out;
        }
    }
    qsort(on, (size_t)reps, sizeof(double), cmp_dbl);
    qsort(off, (size_t)reps, sizeof(double), cmp_dbl);
    printf("duet-bench-tune: %s, rank %d of %d (%s), max_seqs %lld, threads %lld: load %.1f ms "
           "untuned, %.1f ms tuned, warm-up %.1f ms (medians of %lld)\n",
           dir, comm->rank, comm->size, comm->ops->name, (long long)max_seqs, (long long)threads,
           1e3 * off[reps / 2], 1e3 * on[reps / 2], 1e3 * (on[reps / 2] - off[reps / 2]),
           (long long)reps);
    rc = 0;
out:
    free(on);
    free(off);
    const int mpi = strcmp(comm->ops->name, "mpi") == 0;
    duet_comm_destroy(comm);
    if (mpi)
        duet_group_mpi_finalize();
    return rc;
}
