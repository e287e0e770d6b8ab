/*
 * What the request-cache benchmarks share (duet-bench-suspend, duet-bench-move; issue 37; the
 * clock, medians and context lists also duet-bench-group's, issue 39): the clock and medians of
 * their tables, the --contexts list, and the model with Kimi-Linear-48B's
 * cache dimensions that both time beside the demo model.
 *
 * That model keeps a config's cache dimensions (its layer pattern, MLA latent kv_lora_rank +
 * qk_rope_head_dim, KDA heads, head dim and conv kernel) and shrinks everything that only sizes
 * weights (hidden 64, vocab 256, one MLA head, dense 64 / expert 32 wide, 2 experts top-1): only
 * the cache's bytes matter to these benchmarks, and the CPU backend loads weights from a
 * checkpoint only, so it is written to a temporary F32 checkpoint (tests/unit/st_writer.c).
 */
#ifndef DUET_BENCH_CACHE_BENCH_H
#define DUET_BENCH_CACHE_BENCH_H

#include <stddef.h>
#include <stdint.h>

#include "engine/model.h"
#include "engine/model_config.h"

/* CLOCK_MONOTONIC in seconds (one clock for every process of the machine). */
double cache_bench_now_s(void);
/* The median of v[0..n) (n >= 1; v is sorted in place). */
double cache_bench_median(double *v, int n);
/* Parse "1024,8192,32768" into ctx[0..*n_p): at most `max` positive counts up to 2^22; -1 on a
 * bad list. */
int cache_bench_parse_contexts(const char *s, int64_t *ctx, int max, int *n_p);

#define CACHE_BENCH_MAX_CTX  8
#define CACHE_BENCH_MAX_REPS 64

/* The options both benchmarks take: --quick, --reps N, --contexts LIST, --demo DIR, --big DIR. */
typedef struct {
    const char *demo_dir, *big_dir;
    int64_t ctx[CACHE_BENCH_MAX_CTX];
    int n_ctx, reps, quick, reps_set;
} cache_bench_args_t;

/* Defaults: models/duet-demo, bench/configs/kimi-linear-48b (under src_dir), 1K / 8K / 32K,
 * `reps` runs. */
void cache_bench_args_init(cache_bench_args_t *a, const char *src_dir, int reps);

/*
 * If argv[i] is one of the shared options, take it (and its value): returns how many arguments
 * it used (1 or 2); 0 when it is not one of them; -1 after printing why its value is bad (to
 * stderr, prefixed with `prog`: exit 2).
 */
int cache_bench_arg(const char *prog, cache_bench_args_t *a, int argc, char **argv, int i);

/* After the last argument: --quick means 1024 tokens and 3 runs (unless --reps was given). */
void cache_bench_args_finish(cache_bench_args_t *a);

/*
 * Write the small checkpoint with the cache dimensions of big_dir's config.json into a fresh
 * folder under /tmp (its path into dir[0..cap)); *big_p = big_dir's config. Messages go to stderr
 * prefixed with `prog`. 0 on success; on failure nothing is left behind.
 */
int cache_bench_small_checkpoint(const char *prog, const char *big_dir, duet_model_config_t *big_p,
                                 char *dir, size_t cap);
/* Remove what cache_bench_small_checkpoint wrote. */
void cache_bench_small_checkpoint_remove(const char *dir);
/* Whether the loaded model's KV and KDA pools have the dimensions `want` gives them under the
 * model's options (the small model against the big config). */
int cache_bench_same_cache_dims(duet_model_t *m, const duet_model_config_t *want);

#endif
