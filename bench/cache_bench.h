/*
 * What the request-cache benchmarks share (duet-bench-suspend, duet-bench-move; issue 37): the
 * clock and medians of their tables, the --contexts list, and the model with Kimi-Linear-48B's
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
