/*
 * duet-bench-group: the decode step time of a Helix generation group (engine/shard.h) against one
 * process, at long contexts, on the CPU (issue 39).
 *
 *   duet-bench-group [--model DIR] [--ctx 32768,131072] [--batch 1] [--steps 20] [--threads 1]
 *   mpirun -n CP*TP duet-bench-group --cp CP --tp TP [same options]
 *
 * Each of --batch sequences holds --ctx tokens of cache (zeroed pools marked filled: a decode
 * step reads every cached position whatever its values, so the time is what a real context of
 * that length costs) and decodes --steps greedy tokens together; the median step over the
 * steps after the first two is printed by rank 0 with the group's shape. Under mpirun every rank
 * uses --threads compute threads (the group then occupies CP*TP*threads cores; compare with one
 * process given as many threads).
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/comm.h"
#include "bench/cache_bench.h"
#include "common/version.h"
#include "engine/model.h"
#include "group/comm_mpi.h"

#define MAX_BATCH 64

static void usage(FILE *f)
{
    fprintf(f, "usage: [mpirun -n CP*TP] duet-bench-group [--cp N] [--tp N] [--model DIR]\n"
               "           [--ctx N,N,...] [--batch N] [--steps N] [--threads N]\n"
               "The decode step time of a generation group at long contexts (CPU).\n");
}

int main(int argc, char **argv)
{
    const char *model = DUET_SOURCE_DIR "/models/duet-demo";
    int cp = 1, tp = 1, batch = 1, steps = 20, threads = 1, n_ctx = 0;
    int64_t ctx[CACHE_BENCH_MAX_CTX];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout);
            return 0;
        }
        if (strcmp(a, "--version") == 0) {
            duet_version_print("duet-bench-group");
            return 0;
        }
        if (v == NULL) {
            fprintf(stderr, "duet-bench-group: %s needs a value (try --help)\n", a);
            return 2;
        }
        i++;
        if (strcmp(a, "--model") == 0)
            model = v;
        else if (strcmp(a, "--cp") == 0)
            cp = atoi(v);
        else if (strcmp(a, "--tp") == 0)
            tp = atoi(v);
        else if (strcmp(a, "--batch") == 0)
            batch = atoi(v);
        else if (strcmp(a, "--steps") == 0)
            steps = atoi(v);
        else if (strcmp(a, "--threads") == 0)
            threads = atoi(v);
        else if (strcmp(a, "--ctx") == 0) {
            if (cache_bench_parse_contexts(v, ctx, CACHE_BENCH_MAX_CTX, &n_ctx) != 0) {
                fprintf(stderr, "duet-bench-group: --ctx %s: up to %d positive counts\n", v,
                        CACHE_BENCH_MAX_CTX);
                return 2;
            }
        } else {
            fprintf(stderr, "duet-bench-group: unknown argument %s (try --help)\n", a);
            return 2;
        }
    }
    if (n_ctx == 0) {
        ctx[0] = 32768;
        ctx[1] = 131072;
        n_ctx = 2;
    }
    if (cp < 1 || tp < 1 || batch < 1 || batch > MAX_BATCH || steps < 3 || threads < 1) {
        fprintf(stderr,
                "duet-bench-group: --cp, --tp, --threads >= 1, --batch 1..%d, --steps >= "
                "3\n",
                MAX_BATCH);
        return 2;
    }
    int rank = 0, size = 1;
    duet_comm_t *comm = NULL;
    if (cp * tp > 1) {
        if (duet_group_mpi_init(&argc, &argv, &rank, &size) != DUET_OK ||
            duet_comm_mpi_create(600000, &comm) != DUET_OK) {
            fprintf(stderr, "duet-bench-group: %s\n", duet_error_last());
            return 1;
        }
        if (size != cp * tp) {
            fprintf(stderr, "duet-bench-group: cp %d x tp %d needs mpirun -n %d (got %d ranks)\n",
                    cp, tp, cp * tp, size);
            return 2;
        }
    }
    int64_t longest = 0;
    for (int c = 0; c < n_ctx; c++)
        longest = ctx[c] > longest ? ctx[c] : longest;
    duet_model_opts_t o;
    duet_model_opts_default(&o);
    o.n_threads = threads;
    o.max_seqs = batch;
    o.max_seq_len = longest + steps + 1;
    o.max_batch_tokens = batch;
    o.comm = comm;
    o.helix_cp = cp;
    o.helix_tp = tp;
    duet_model_t *m = NULL;
    if (duet_model_load(model, &o, &m) != DUET_OK) {
        fprintf(stderr, "duet-bench-group: rank %d: %s\n", rank, duet_error_last());
        return 1;
    }
    const int64_t V = duet_model_config(m)->vocab_size;
    float *logits = malloc(sizeof(float) * (size_t)(V * batch));
    double *t = malloc(sizeof(double) * (size_t)steps);
    int rc = logits == NULL || t == NULL;
    for (int c = 0; c < n_ctx && rc == 0; c++) {
        duet_seq_t s[MAX_BATCH];
        duet_batch_item_t it[MAX_BATCH];
        int32_t tok[MAX_BATCH];
        for (int b = 0; b < batch && rc == 0; b++) {
            if (duet_model_seq_open(m, ctx[c] + steps + 1, &s[b]) != DUET_OK ||
                duet_model_seq_set_filled(m, &s[b], ctx[c]) != DUET_OK) {
                fprintf(stderr, "duet-bench-group: rank %d: %s\n", rank, duet_error_last());
                rc = 1;
            }
            tok[b] = (int32_t)(b + 1);
        }
        for (int k = 0; k < steps && rc == 0; k++) {
            for (int b = 0; b < batch; b++)
                it[b] = (duet_batch_item_t){.seq = &s[b],
                                            .tokens = &tok[b],
                                            .n_tokens = 1,
                                            .logits_mode =
                                                rank == 0 ? DUET_LOGITS_LAST : DUET_LOGITS_NONE,
                                            .logits = logits + b * V};
            const double t0 = cache_bench_now_s();
            if (duet_model_forward(m, it, batch) != DUET_OK) {
                fprintf(stderr, "duet-bench-group: rank %d: %s\n", rank, duet_error_last());
                rc = 1;
                break;
            }
            t[k] = cache_bench_now_s() - t0;
        }
        for (int b = 0; b < batch; b++)
            duet_model_seq_close(m, &s[b]);
        if (rc == 0 && rank == 0) {
            const double med = cache_bench_median(t + 2, steps - 2);
            printf("duet-bench-group cp %d x tp %d, %d thread(s) per rank, batch %d, context "
                   "%lld: decode step %.3f ms (median of %d)\n",
                   cp, tp, threads, batch, (long long)ctx[c], 1e3 * med, steps - 2);
            fflush(stdout);
        }
    }
    free(logits);
    free(t);
    duet_model_free(m);
    duet_comm_destroy(comm);
    if (comm != NULL)
        duet_group_mpi_finalize();
    return rc;
}
