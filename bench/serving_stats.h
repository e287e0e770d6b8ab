/*
 * Serving-benchmark metric math for duet-bench: per-request records in, one summary out.
 *
 * The definitions follow vLLM's benchmarks/benchmark_serving.py so numbers can be compared with
 * it (every time is in milliseconds):
 *   TTFT   send -> first chunk that carries text.
 *   TPOT   per request (e2el - ttft) / (output_tokens - 1); requests with fewer than 2 output
 *          tokens have no TPOT and are left out of its statistics.
 *   ITL    the gaps between successive text chunks; the gaps of all requests are pooled.
 *   E2EL   send -> last byte of the response.
 * Statistics: mean, median, std (population, numpy's default ddof = 0), p90, p99 (linear
 * interpolation between closest ranks, numpy's default percentile method), min, max. Only
 * completed requests contribute. A statistic of an empty set is NaN (the JSON writer prints null).
 *
 * user_throughput is the mean over completed requests with at least 2 output tokens of that
 * request's decode speed (output_tokens - 1) / ((e2el - ttft) / 1000), i.e. the mean of
 * 1000 / TPOT_i in tokens/s: what one user sees once the first token arrived. The first token is
 * left out because its time is TTFT's, exactly as in TPOT.
 *
 * Goodput (vLLM's --goodput): requests per second of benchmark time that completed and met every
 * given SLO (ttft_ms <= slo, tpot_ms <= slo, e2el_ms <= slo). A request without a TPOT (one
 * output token) counts as TPOT 0, as vLLM does.
 *
 * Pure functions: no I/O, no clocks. The module also parses the Prometheus text the router's
 * /metrics serves, for the server-side counters.
 */
#ifndef DUET_BENCH_SERVING_STATS_H
#define DUET_BENCH_SERVING_STATS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

/* One request as measured by the client. */
typedef struct {
    bool ok;                /* completed: HTTP 200, a well-formed stream ending in [DONE] */
    double ttft_ms;         /* send -> first text chunk (valid when ok) */
    double e2el_ms;         /* send -> last byte (valid when ok) */
    uint32_t prompt_tokens; /* usage.prompt_tokens, 0 when the server sent no usage */
    uint32_t output_tokens; /* usage.completion_tokens, else the number of text chunks */
    const double *itl_ms;   /* (n_itl) gaps between successive text chunks, not owned */
    size_t n_itl;
} serving_record_t;

/* Statistics of one latency metric over a set of values. NaN fields when n == 0. */
typedef struct {
    size_t n;
    double mean, median, std, p90, p99, min, max;
} serving_dist_t;

/* Service-level objectives for goodput; a value <= 0 means "no objective on this metric". */
typedef struct {
    double ttft_ms;
    double tpot_ms;
    double e2el_ms;
} serving_slo_t;

typedef struct {
    size_t completed, failed;
    double duration_s;
    uint64_t total_input_tokens;  /* sum of prompt_tokens over completed requests */
    uint64_t total_output_tokens; /* sum of output_tokens over completed requests */
    double error_rate;            /* failed / (completed + failed); NaN when there are none */
    double request_throughput;    /* completed / duration_s */
    double output_throughput;     /* total_output_tokens / duration_s */
    double total_token_throughput;
    double user_throughput; /* mean of (output_tokens - 1) / (e2el - ttft) over requests with
                               >= 2 output tokens, tokens/s; NaN when there are none */
    bool has_goodput;       /* at least one SLO was given */
    size_t good;            /* completed requests meeting every SLO */
    double goodput;         /* good / duration_s (NaN when !has_goodput) */
    serving_dist_t ttft, tpot, itl, e2el;
} serving_summary_t;

/*
 * The p-th percentile (0 <= p <= 100) of the n values at v, which must be sorted ascending:
 * rank p/100 * (n - 1), linearly interpolated between its neighbours (numpy's default). NaN when
 * n == 0.
 */
double serving_percentile_sorted(const double *v, size_t n, double p);

/*
 * Fill *d with the statistics of the n values at v. Sorts v in place (callers pass a scratch
 * copy when the order matters).
 */
void serving_dist_compute(double *v, size_t n, serving_dist_t *d);

/*
 * Summarise n records measured over duration_s seconds of benchmark time. slo may be NULL (no
 * goodput). Allocates scratch arrays only; DUET_ERR_NOMEM when that fails, DUET_ERR_INVALID when
 * duration_s is not positive. *out_p is written only on success.
 */
duet_status_t serving_summarize(const serving_record_t *recs, size_t n, double duration_s,
                                const serving_slo_t *slo, serving_summary_t *out_p);

/*
 * Parse a --goodput argument list: each item "ttft:MS", "tpot:MS" or "e2el:MS" with MS > 0.
 * DUET_ERR_INVALID with a detail naming the bad item otherwise. Items not given stay 0.
 */
duet_status_t serving_slo_parse_item(const char *item, serving_slo_t *slo);

/*
 * Sum of the samples named `name` in a Prometheus text exposition (every label set of that
 * name: per-worker series add up). Comment lines are skipped; samples whose label set or value
 * does not parse are ignored. *found_p says whether any sample of that name was present (then
 * *sum_p is their sum, else 0). Never fails: text from outside is read defensively.
 */
void serving_prom_sum(const char *text, size_t len, const char *name, double *sum_p, bool *found_p);

/*
 * serving_prom_sum over only the samples whose label set holds label="value" (other labels may
 * differ: per-worker series of one position add up). `value` is compared with the quoted text as
 * it stands, so it must be one that needs no escaping (e.g. "3"). A label set that does not parse
 * (no '=', an unquoted value, no closing '}') is not a sample. label NULL: every sample, as
 * serving_prom_sum.
 */
void serving_prom_sum_where(const char *text, size_t len, const char *name, const char *label,
                            const char *value, double *sum_p, bool *found_p);

#endif
