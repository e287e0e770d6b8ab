/*
 * duet-bench's metric math (bench/serving_stats.h) on hand-computed record sets: means, medians,
 * numpy-style percentile interpolation, TPOT leaving out 1-token requests, ITL pooling, goodput
 * with SLOs, throughputs; percentiles on random data against an independent reference; the
 * --goodput item parser; the Prometheus sum used for the router's counters.
 *
 * Tolerance: 1e-9 relative (the expected values are exact decimals computed by hand; only
 * floating-point rounding separates them from the module's results).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench/serving_stats.h"

#define TOL 1e-9

static void near(double got, double want, const char *what)
{
    cr_assert(fabs(got - want) <= TOL * fmax(1.0, fabs(want)), "%s: got %.12g, want %.12g", what,
              got, want);
}

/*
 * r0: ttft 10, e2el 110, 11 tokens -> tpot 100/10 = 10, decode speed 10 / 0.1 s = 100 tok/s
 * r1: ttft 20, e2el 220,  5 tokens -> tpot 200/4 = 50, decode speed 4 / 0.2 s = 20 tok/s
 * r2: ttft 30, e2el  40,  1 token  -> no tpot
 * r3: failed
 * over 2 s.
 */
static const double itl0[] = {9, 11}, itl1[] = {40, 60};
static const serving_record_t recs[] = {
    {.ok = true,
     .ttft_ms = 10,
     .e2el_ms = 110,
     .prompt_tokens = 5,
     .output_tokens = 11,
     .itl_ms = itl0,
     .n_itl = 2},
    {.ok = true,
     .ttft_ms = 20,
     .e2el_ms = 220,
     .prompt_tokens = 6,
     .output_tokens = 5,
     .itl_ms = itl1,
     .n_itl = 2},
    {.ok = true, .ttft_ms = 30, .e2el_ms = 40, .prompt_tokens = 7, .output_tokens = 1},
    {.ok = false, .ttft_ms = 999, .e2el_ms = 999, .output_tokens = 99, .itl_ms = itl0, .n_itl = 2},
};

Test(bench_stats, hand_computed_summary)
{
    serving_summary_t s;
    cr_assert_eq(serving_summarize(recs, 4, 2.0, NULL, &s), DUET_OK);
    cr_assert_eq(s.completed, 3);
    cr_assert_eq(s.failed, 1);
    near(s.error_rate, 0.25, "error_rate");
    cr_assert_eq(s.total_input_tokens, 18);
    cr_assert_eq(s.total_output_tokens, 17);
    near(s.request_throughput, 1.5, "request_throughput");
    near(s.output_throughput, 8.5, "output_throughput");
    near(s.total_token_throughput, 17.5, "total_token_throughput");
    near(s.user_throughput, 60, "user_throughput"); /* (100 + 20) / 2 */
    cr_assert(!s.has_goodput);
    cr_assert(isnan(s.goodput));

    /* TTFT {10, 20, 30} */
    cr_assert_eq(s.ttft.n, 3);
    near(s.ttft.mean, 20, "ttft mean");
    near(s.ttft.median, 20, "ttft median");
    near(s.ttft.std, sqrt(200.0 / 3.0), "ttft std (population)");
    near(s.ttft.p90, 28, "ttft p90"); /* rank 1.8: 20 + 0.8 * 10 */
    near(s.ttft.p99, 29.8, "ttft p99");
    near(s.ttft.min, 10, "ttft min");
    near(s.ttft.max, 30, "ttft max");

    /* TPOT {10, 50}: the 1-token request is left out */
    cr_assert_eq(s.tpot.n, 2);
    near(s.tpot.mean, 30, "tpot mean");
    near(s.tpot.median, 30, "tpot median");
    near(s.tpot.std, 20, "tpot std");
    near(s.tpot.p99, 49.6, "tpot p99"); /* rank 0.99: 10 + 0.99 * 40 */

    /* ITL pooled over the completed requests {9, 11, 40, 60} */
    cr_assert_eq(s.itl.n, 4);
    near(s.itl.mean, 30, "itl mean");
    near(s.itl.median, 25.5, "itl median"); /* rank 1.5 */
    near(s.itl.p90, 54, "itl p90");         /* rank 2.7: 40 + 0.7 * 20 */
    near(s.itl.p99, 59.4, "itl p99");       /* rank 2.97 */

    /* E2EL {40, 110, 220} */
    near(s.e2el.mean, 370.0 / 3.0, "e2el mean");
    near(s.e2el.median, 110, "e2el median");
    near(s.e2el.p99, 217.8, "e2el p99"); /* rank 1.98: 110 + 0.98 * 110 */
}

Test(bench_stats, goodput_with_slos)
{
    serving_summary_t s;
    /* ttft <= 25 and tpot <= 20: r0 only (r1 tpot 50, r2 ttft 30) */
    serving_slo_t slo = {.ttft_ms = 25, .tpot_ms = 20};
    cr_assert_eq(serving_summarize(recs, 4, 2.0, &slo, &s), DUET_OK);
    cr_assert(s.has_goodput);
    cr_assert_eq(s.good, 1);
    near(s.goodput, 0.5, "goodput ttft+tpot");
    /* tpot only: r0 and r2 (a 1-token request counts as tpot 0, as in vLLM) */
    slo = (serving_slo_t){.tpot_ms = 20};
    cr_assert_eq(serving_summarize(recs, 4, 2.0, &slo, &s), DUET_OK);
    cr_assert_eq(s.good, 2);
    near(s.goodput, 1.0, "goodput tpot");
    /* e2el <= 110 (inclusive): r0 and r2; the failed request never counts */
    slo = (serving_slo_t){.e2el_ms = 110};
    cr_assert_eq(serving_summarize(recs, 4, 2.0, &slo, &s), DUET_OK);
    cr_assert_eq(s.good, 2);
}

Test(bench_stats, empty_and_all_failed)
{
    serving_summary_t s;
    cr_assert_eq(serving_summarize(recs + 3, 1, 1.0, NULL, &s), DUET_OK);
    cr_assert_eq(s.completed, 0);
    near(s.error_rate, 1.0, "error_rate");
    cr_assert(isnan(s.ttft.mean) && isnan(s.tpot.p99) && isnan(s.itl.median));
    cr_assert(isnan(s.user_throughput));
    near(s.output_throughput, 0, "output_throughput");
    cr_assert_eq(serving_summarize(NULL, 0, 1.0, NULL, &s), DUET_OK);
    cr_assert(isnan(s.error_rate));
    cr_assert_eq(serving_summarize(recs, 4, 0.0, NULL, &s), DUET_ERR_INVALID);
}

/* Independent reference: insertion sort, then numpy's linear method written out. */
static double ref_percentile(const double *in, size_t n, double p)
{
    double *v = malloc(n * sizeof(*v));
    for (size_t i = 0; i < n; i++) {
        size_t j = i;
        while (j > 0 && v[j - 1] > in[i]) {
            v[j] = v[j - 1];
            j--;
        }
        v[j] = in[i];
    }
    double h = (double)(n - 1) * p / 100.0;
    size_t j = (size_t)h;
    double g = h - (double)j;
    double r = j + 1 < n ? (1 - g) * v[j] + g * v[j + 1] : v[j];
    free(v);
    return r;
}

Test(bench_stats, percentiles_match_reference_on_random_data)
{
    srand(7);
    for (int trial = 0; trial < 200; trial++) {
        size_t n = 1 + (size_t)(rand() % 50);
        double in[64], work[64];
        for (size_t i = 0; i < n; i++)
            in[i] = (double)(rand() % 10000) / 7.0;
        memcpy(work, in, n * sizeof(*in));
        serving_dist_t d;
        serving_dist_compute(work, n, &d);
        near(d.median, ref_percentile(in, n, 50), "median");
        near(d.p90, ref_percentile(in, n, 90), "p90");
        near(d.p99, ref_percentile(in, n, 99), "p99");
        near(d.min, ref_percentile(in, n, 0), "min");
        near(d.max, ref_percentile(in, n, 100), "max");
    }
    cr_assert(isnan(serving_percentile_sorted(NULL, 0, 50)));
}

Test(bench_stats, goodput_items)
{
    serving_slo_t slo = {0};
    cr_assert_eq(serving_slo_parse_item("ttft:100", &slo), DUET_OK);
    cr_assert_eq(serving_slo_parse_item("tpot:12.5", &slo), DUET_OK);
    cr_assert_eq(serving_slo_parse_item("e2el:1e3", &slo), DUET_OK);
    near(slo.ttft_ms, 100, "ttft");
    near(slo.tpot_ms, 12.5, "tpot");
    near(slo.e2el_ms, 1000, "e2el");
    cr_assert_eq(serving_slo_parse_item("ttft", &slo), DUET_ERR_INVALID);
    cr_assert_eq(serving_slo_parse_item("ttft:", &slo), DUET_ERR_INVALID);
    cr_assert_eq(serving_slo_parse_item("ttft:-1", &slo), DUET_ERR_INVALID);
    cr_assert_eq(serving_slo_parse_item("ttft:5ms", &slo), DUET_ERR_INVALID);
    cr_assert_eq(serving_slo_parse_item("itl:5", &slo), DUET_ERR_INVALID);
    cr_assert(strstr(duet_error_last(), "itl:5") != NULL, "%s", duet_error_last());
}

Test(bench_stats, prometheus_sums_over_label_sets)
{
    const char *text = "# HELP duet_gen_decode_steps_total decode iterations\n"
                       "# TYPE duet_gen_decode_steps_total counter\n"
                       "duet_gen_decode_steps_total{worker=\"gen-0\"} 10\n"
                       "duet_gen_decode_steps_total{worker=\"gen}1\",x=\"a\\\"b\"} 2.5\n"
                       "duet_gen_decode_steps_total_bucket{le=\"1\"} 100\n"
                       "duet_gen_decode_steps_totalx 100\n"
                       "duet_gen_step_seconds_total 1.25e-1\n"
                       "duet_gen_decoded_tokens_total garbage\n"
                       "duet_gen_decode_seq_steps_total{broken 5\n";
    double v;
    bool found;
    serving_prom_sum(text, strlen(text), "duet_gen_decode_steps_total", &v, &found);
    cr_assert(found);
    near(v, 12.5, "steps");
    serving_prom_sum(text, strlen(text), "duet_gen_step_seconds_total", &v, &found);
    cr_assert(found);
    near(v, 0.125, "seconds");
    serving_prom_sum(text, strlen(text), "duet_gen_decoded_tokens_total", &v, &found);
    cr_assert(!found, "an unparsable value is not a sample");
    serving_prom_sum(text, strlen(text), "duet_gen_decode_seq_steps_total", &v, &found);
    cr_assert(!found, "an unterminated label set is not a sample");
    serving_prom_sum(text, strlen(text), "absent_total", &v, &found);
    cr_assert(!found);
    cr_assert_eq(v, 0);
    /* no trailing newline, and a length that cuts the text */
    serving_prom_sum("a_total 3", 9, "a_total", &v, &found);
    cr_assert(found && v == 3);
    serving_prom_sum("a_total 3\na_total 4", 10, "a_total", &v, &found);
    cr_assert(found && v == 3);
}

/* Per-position speculation counters: one label picks the series, other labels add up. */
Test(bench_stats, prometheus_sums_one_label_value)
{
    const char *text =
        "# TYPE duet_gen_spec_drafted_total counter\n"
        "duet_gen_spec_drafted_total{position=\"1\"} 250\n"
        "duet_gen_spec_drafted_total{position=\"2\"} 239\n"
        "duet_gen_spec_drafted_total{position=\"12\"} 7\n"
        "duet_gen_spec_drafted_total{worker=\"a,position=\\\"2\\\"\",position=\"2\"} 1\n"
        "duet_gen_spec_drafted_total{ position=\"3\" , worker=\"}\"} 5\n"
        "duet_gen_spec_drafted_total{worker=\"position=\\\"4\\\"\"} 9\n"
        "duet_gen_spec_drafted_total{position=4} 9\n"
        "duet_gen_spec_drafted_total{position=\"4\" 9\n"
        "duet_gen_spec_drafted_total{position=\"4\\\"} 9\n"
        "duet_gen_spec_drafted_total_x{position=\"1\"} 100\n";
    double v;
    bool found;
    serving_prom_sum_where(text, strlen(text), "duet_gen_spec_drafted_total", "position", "1", &v,
                           &found);
    cr_assert(found);
    near(v, 250, "position 1 (not 12, not a longer name)");
    serving_prom_sum_where(text, strlen(text), "duet_gen_spec_drafted_total", "position", "2", &v,
                           &found);
    cr_assert(found);
    near(v, 240, "position 2 of two label sets; a quoted look-alike is not a label");
    serving_prom_sum_where(text, strlen(text), "duet_gen_spec_drafted_total", "position", "3", &v,
                           &found);
    cr_assert(found);
    near(v, 5, "spaces around labels, '}' inside a value");
    serving_prom_sum_where(text, strlen(text), "duet_gen_spec_drafted_total", "position", "4", &v,
                           &found);
    cr_assert(!found, "unquoted, unterminated and look-alike label sets are not samples: %g", v);
    cr_assert_eq(v, 0);
    serving_prom_sum_where(text, strlen(text), "duet_gen_spec_drafted_total", NULL, NULL, &v,
                           &found);
    cr_assert(found);
    near(v, 250 + 239 + 7 + 1 + 5 + 9, "no label: every parsable sample, as serving_prom_sum");
}
