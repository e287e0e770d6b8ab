/*
 * duet-bench-suspend: what suspending and resuming a request costs on the CPU (issue 37). A
 * generation worker out of pages suspends a request (duet_model_seq_snapshot_save, then close)
 * and resumes it later (open, then duet_model_seq_snapshot_restore); both are copies of the
 * request's cache, so the question is how close they come to memcpy of the same bytes.
 *
 * Two models: the demo model (models/duet-demo, loaded as it is) and one with Kimi-Linear-48B's
 * cache dimensions (bench/configs/kimi-linear-48b) but tiny weights, written to a temporary
 * checkpoint at start (bench/cache_bench.h). The sequence is filled with duet_model_seq_set_filled
 * over a byte pattern (no prefill: the copies do not depend on the values), and each resume is
 * checked to give back the suspended bytes.
 *
 *   duet-bench-suspend [--quick] [--reps N] [--contexts 1024,8192,32768] [--demo DIR] [--big DIR]
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bench/cache_bench.h"
#include "common/log.h"
#include "common/version.h"
#include "engine/cache.h"
#include "engine/model.h"
#include "engine/model_config.h"

/* Every byte of both pools gets a position-dependent value, so a resume that lost or moved
 * bytes shows up in the check, and no page is left untouched (zero-page mapping). */
static void fill_pattern(duet_model_t *m)
{
    if (duet_model_kv_pool(m) != NULL) {
        uint8_t *p = duet_kv_pool_base(duet_model_kv_pool(m));
        const size_t n = duet_kv_pool_bytes(duet_model_kv_pool(m));
        for (size_t i = 0; i < n; i++)
            p[i] = (uint8_t)(i * 131u + (i >> 12));
    }
    if (duet_model_kda_pool(m) != NULL) {
        uint8_t *p = duet_kda_pool_base(duet_model_kda_pool(m));
        const size_t n = duet_kda_pool_bytes(duet_model_kda_pool(m));
        for (size_t i = 0; i < n; i++)
            p[i] = (uint8_t)(i * 197u + (i >> 10) + 7u);
    }
}

/* One model, one context: median times of `reps` suspend / resume cycles and of memcpy. */
static int bench_one(duet_model_t *m, const char *label, int64_t ctx, int reps)
{
    const size_t bytes = duet_model_seq_snapshot_bytes(m, ctx);
    uint8_t *buf = malloc(bytes), *chk = malloc(bytes), *dst = malloc(bytes);
    duet_seq_t seq = {.id = -1};
    int rc = -1;
    if (buf == NULL || chk == NULL || dst == NULL) {
        fprintf(stderr, "duet-bench-suspend: no memory for %zu-byte buffers\n", bytes);
        goto done;
    }
    memset(buf, 1, bytes);
    memset(chk, 2, bytes);
    memset(dst, 3, bytes);
    if (duet_model_seq_open(m, ctx, &seq) != DUET_OK)
        goto fail;
    fill_pattern(m);
    if (duet_model_seq_set_filled(m, &seq, ctx) != DUET_OK ||
        duet_model_seq_snapshot_save(m, &seq, chk) != DUET_OK)
        goto fail;
    double t_save[CACHE_BENCH_MAX_REPS], t_close[CACHE_BENCH_MAX_REPS],
        t_open[CACHE_BENCH_MAX_REPS], t_rest[CACHE_BENCH_MAX_REPS], t_resume[CACHE_BENCH_MAX_REPS],
        t_cpy[CACHE_BENCH_MAX_REPS];
    for (int r = 0; r < reps; r++) {
        double t0 = cache_bench_now_s();
        if (duet_model_seq_snapshot_save(m, &seq, buf) != DUET_OK)
            goto fail;
        double t1 = cache_bench_now_s();
        duet_model_seq_close(m, &seq);
        double t2 = cache_bench_now_s();
        if (duet_model_seq_open(m, ctx, &seq) != DUET_OK)
            goto fail;
        double t3 = cache_bench_now_s();
        if (duet_model_seq_snapshot_restore(m, &seq, buf, ctx) != DUET_OK)
            goto fail;
        double t4 = cache_bench_now_s();
        memcpy(dst, buf, bytes);
        double t5 = cache_bench_now_s();
        t_save[r] = t1 - t0;
        t_close[r] = t2 - t1;
        t_open[r] = t3 - t2;
        t_rest[r] = t4 - t3;
        t_resume[r] = t4 - t2;
        t_cpy[r] = t5 - t4;
        if (memcmp(buf, chk, bytes) != 0 || memcmp(dst, chk, bytes) != 0) {
            fprintf(stderr, "duet-bench-suspend: %s at %lld tokens: the snapshot changed\n", label,
                    (long long)ctx);
            goto done;
        }
    }
    /* the last resume left the sequence holding exactly the first snapshot's bytes */
    if (duet_model_seq_snapshot_save(m, &seq, dst) != DUET_OK)
        goto fail;
    if (memcmp(dst, chk, bytes) != 0) {
        fprintf(stderr, "duet-bench-suspend: %s at %lld tokens: resume lost bytes\n", label,
                (long long)ctx);
        goto done;
    }
    const double gb = (double)bytes / 1e9, save = cache_bench_median(t_save, reps),
                 close = cache_bench_median(t_close, reps), open = cache_bench_median(t_open, reps),
                 rest = cache_bench_median(t_rest, reps),
                 resume = cache_bench_median(t_resume, reps), cpy = cache_bench_median(t_cpy, reps);
    printf("| %s | %lld | %.1f | %.2f (%.1f) | %.3f | %.2f | %.2f (%.1f) | %.2f (%.1f) | %.2f "
           "(%.1f) |\n",
           label, (long long)ctx, (double)bytes / 1048576.0, save * 1e3, gb / save, close * 1e3,
           open * 1e3, rest * 1e3, gb / rest, resume * 1e3, gb / resume, cpy * 1e3, gb / cpy);
    fflush(stdout);
    rc = 0;
    goto done;
fail:
    fprintf(stderr, "duet-bench-suspend: %s at %lld tokens: %s\n", label, (long long)ctx,
            duet_error_last());
done:
    if (seq.id >= 0)
        duet_model_seq_close(m, &seq);
    free(buf);
    free(chk);
    free(dst);
    return rc;
}

static int bench_model(duet_model_t *m, const char *label, const int64_t *ctx, int n_ctx, int reps)
{
    for (int i = 0; i < n_ctx; i++)
        if (bench_one(m, label, ctx[i], reps) != 0)
            return -1;
    return 0;
}

static void opts_for(duet_model_opts_t *o, int64_t max_ctx)
{
    duet_model_opts_default(o);
    o->n_threads = 1; /* the copies are single-threaded; the forward pass never runs */
    o->max_seqs = 1;
    o->max_seq_len = max_ctx;
    o->max_batch_tokens = 16;
}

int main(int argc, char **argv)
{
    cache_bench_args_t A;
    cache_bench_args_init(&A, DUET_SOURCE_DIR, 7);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (duet_version_flag(a)) {
            duet_version_print("duet-bench-suspend");
            return 0;
        }
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            printf("usage: duet-bench-suspend [--quick] [--reps N] [--contexts 1024,8192,32768]\n"
                   "                          [--demo DIR] [--big DIR]\n"
                   "Time to suspend (snapshot save + close) and resume (open + snapshot restore)\n"
                   "a request on the CPU, at each context length, for the demo model (--demo,\n"
                   "default models/duet-demo) and for a model with the cache dimensions of\n"
                   "--big's config.json (default bench/configs/kimi-linear-48b) and tiny\n"
                   "weights, against memcpy of the same bytes; medians of --reps runs (7).\n"
                   "Prints a markdown table. --quick: 1024 tokens, 3 runs.\n");
            return 0;
        }
        const int used = cache_bench_arg("duet-bench-suspend", &A, argc, argv, i);
        if (used < 0)
            return 2;
        if (used == 0) {
            fprintf(stderr,
                    "duet-bench-suspend: unknown option or missing value: %s (see --help)\n", a);
            return 2;
        }
        i += used - 1;
    }
    cache_bench_args_finish(&A);
    const char *demo_dir = A.demo_dir, *big_dir = A.big_dir;
    const int64_t *ctx = A.ctx;
    const int n_ctx = A.n_ctx, reps = A.reps;
    int64_t max_ctx = 0;
    for (int i = 0; i < n_ctx; i++)
        max_ctx = ctx[i] > max_ctx ? ctx[i] : max_ctx;
    if (getenv("DUET_LOG_LEVEL") == NULL)
        duet_log_set_level(DUET_LOG_LEVEL_WARN);

    int rc = 1;
    duet_model_t *m = NULL;
    char tmp[256];
    int have_tmp = 0;
    duet_model_opts_t o;
    opts_for(&o, max_ctx);

    printf("Medians of %d runs; times in ms, (GB/s) = snapshot bytes / time. suspend = save + "
           "close, resume = open + restore.\n\n",
           reps);
    printf("| model | context | snapshot MiB | save ms (GB/s) | close ms | open ms | restore ms "
           "(GB/s) | open + restore ms (GB/s) | memcpy ms (GB/s) |\n");
    printf("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
    fflush(stdout);

    if (duet_model_load(demo_dir, &o, &m) != DUET_OK) {
        fprintf(stderr, "duet-bench-suspend: %s: %s\n", demo_dir, duet_error_last());
        goto done;
    }
    if (bench_model(m, "demo", ctx, n_ctx, reps) != 0)
        goto done;
    duet_model_free(m);
    m = NULL;

    duet_model_config_t big;
    if (cache_bench_small_checkpoint("duet-bench-suspend", big_dir, &big, tmp, sizeof(tmp)) != 0)
        goto done;
    have_tmp = 1;
    if (duet_model_load(tmp, &o, &m) != DUET_OK) {
        fprintf(stderr, "duet-bench-suspend: the small checkpoint: %s\n", duet_error_last());
        goto done;
    }
    if (!cache_bench_same_cache_dims(m, &big)) {
        fprintf(stderr, "duet-bench-suspend: the small model's cache differs from %s's\n", big_dir);
        goto done;
    }
    if (bench_model(m, "48B cache", ctx, n_ctx, reps) != 0)
        goto done;
    rc = 0;
done:
    duet_model_free(m);
    if (have_tmp)
        cache_bench_small_checkpoint_remove(tmp);
    return rc;
}
