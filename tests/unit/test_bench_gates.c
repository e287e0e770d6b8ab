/*
 * duet-bench's perf gates (bench/serving_gates.h): min/max pass and fail (bounds inclusive), a
 * missing or null metric fails with its reason, the report lines, and malformed baselines
 * refused with a message that names the offending field.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "bench/serving_gates.h"

static json_t *parse(const char *text)
{
    json_error_t e;
    json_t *j = json_loads(text, 0, &e);
    cr_assert_not_null(j, "%s", e.text);
    return j;
}

static const char *results_text = "{\"error_rate\": 0.0, \"output_throughput\": 812.5,"
                                  " \"mean_tpot_ms\": 20, \"device_step_time_ms\": null,"
                                  " \"config\": {\"model\": \"m\"}}";

Test(bench_gates, min_max_pass_and_fail)
{
    json_t *res = parse(results_text);
    json_t *b = parse("{\"description\": \"demo\", \"gates\": {"
                      "\"error_rate\": {\"max\": 0.0},"
                      "\"output_throughput\": {\"min\": 812.5},"
                      "\"mean_tpot_ms\": {\"min\": 1, \"max\": 20}}}");
    serving_gates_t g;
    cr_assert_eq(serving_gates_parse(b, "b.json", &g), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(g.n, 3);
    duet_strbuf_t rep;
    duet_strbuf_init(&rep);
    cr_assert_eq(serving_gates_check(&g, res, &rep), 0, "%s", rep.data);
    cr_assert(strstr(rep.data, "PASS output_throughput = 812.5 (min 812.5)") != NULL, "%s",
              rep.data);
    serving_gates_free(&g);
    json_decref(b);

    /* just outside each bound */
    b = parse("{\"gates\": {\"error_rate\": {\"max\": -0.001},"
              "\"output_throughput\": {\"min\": 812.6},"
              "\"mean_tpot_ms\": {\"max\": 19.99}}}");
    cr_assert_eq(serving_gates_parse(b, "b.json", &g), DUET_OK);
    duet_strbuf_free(&rep);
    cr_assert_eq(serving_gates_check(&g, res, &rep), 3);
    cr_assert(strstr(rep.data, "FAIL output_throughput = 812.5 (min 812.6): below min 812.6") !=
                  NULL,
              "%s", rep.data);
    cr_assert(strstr(rep.data, "FAIL mean_tpot_ms = 20 (max 19.99): above max 19.99") != NULL, "%s",
              rep.data);
    serving_gates_free(&g);
    serving_gates_free(NULL);
    duet_strbuf_free(&rep);
    json_decref(b);
    json_decref(res);
}

Test(bench_gates, missing_null_and_non_number_metrics_fail)
{
    json_t *res = parse(results_text);
    json_t *b = parse("{\"gates\": {\"avg_decoded_tokens_per_iter\": {\"min\": 1},"
                      "\"device_step_time_ms\": {\"max\": 100},"
                      "\"config\": {\"min\": 0}}}");
    serving_gates_t g;
    cr_assert_eq(serving_gates_parse(b, "b.json", &g), DUET_OK);
    char why[128];
    double v = 0;
    cr_assert(!serving_gate_eval(&g.gates[0], res, &v, why, sizeof(why)));
    cr_assert(isnan(v));
    cr_assert(strstr(why, "missing") != NULL, "%s", why);
    cr_assert(!serving_gate_eval(&g.gates[1], res, &v, why, sizeof(why)));
    cr_assert(strstr(why, "null") != NULL, "%s", why);
    cr_assert(!serving_gate_eval(&g.gates[2], res, &v, why, sizeof(why)));
    cr_assert(strstr(why, "not a number") != NULL, "%s", why);
    duet_strbuf_t rep;
    duet_strbuf_init(&rep);
    cr_assert_eq(serving_gates_check(&g, res, &rep), 3);
    cr_assert(strstr(rep.data, "FAIL device_step_time_ms = null (max 100): metric is null") != NULL,
              "%s", rep.data);
    duet_strbuf_free(&rep);
    serving_gates_free(&g);
    json_decref(b);
    json_decref(res);
}

/* Each malformed baseline is refused and the message contains `want`. */
static void refused(const char *text, const char *want)
{
    json_t *b = parse(text);
    serving_gates_t g = {.gates = (void *)0x1, .n = 99}; /* must stay untouched */
    cr_assert_eq(serving_gates_parse(b, "base.json", &g), DUET_ERR_FORMAT, "accepted: %s", text);
    cr_assert(g.n == 99, "out-param written on failure");
    cr_assert(strstr(duet_error_last(), "base.json") != NULL, "%s", duet_error_last());
    cr_assert(strstr(duet_error_last(), want) != NULL, "%s: got \"%s\", want \"%s\"", text,
              duet_error_last(), want);
    json_decref(b);
}

Test(bench_gates, malformed_baselines_are_refused_with_a_message)
{
    refused("[1, 2]", "top");
    refused("{}", "\"gates\" must be an object");
    refused("{\"gates\": [1]}", "\"gates\" must be an object");
    refused("{\"gates\": {}}", "empty");
    refused("{\"gate\": {}}", "unknown top-level key \"gate\"");
    refused("{\"gates\": {\"error_rate\": 0}}", "gates.error_rate: expected an object");
    refused("{\"gates\": {\"error_rate\": {}}}", "needs \"min\" or \"max\"");
    refused("{\"gates\": {\"error_rate\": {\"mxa\": 1}}}", "unknown key \"mxa\"");
    refused("{\"gates\": {\"error_rate\": {\"max\": \"0\"}}}",
            "gates.error_rate.max: expected a number, got a string");
    refused("{\"gates\": {\"a\": {\"min\": null}}}", "gates.a.min: expected a number, got null");
    refused("{\"gates\": {\"a\": {\"min\": true}}}", "got a boolean");
    refused("{\"gates\": {\"a\": {\"min\": 5, \"max\": 1}}}", "min 5 is above max 1");
    /* a bad gate after good ones: nothing leaks, nothing is returned */
    refused("{\"gates\": {\"a\": {\"min\": 1}, \"b\": {\"max\": []}}}", "gates.b.max");
}

/* A baseline run: throughput may drop 5 %, mean / median latency rise 10 %, errors not rise;
 * only what the run measured is gated; --tolerance replaces a default or adds a metric. */
Test(bench_gates, baseline_run_gates_relative_to_its_values)
{
    json_t *base = parse("{\"completed\": 32, \"failed\": 0, \"error_rate\": 0.0,"
                         " \"output_throughput\": 100.0, \"request_throughput\": 2.0,"
                         " \"mean_ttft_ms\": 50.0, \"median_tpot_ms\": null,"
                         " \"p99_ttft_ms\": 80.0, \"gates\": []}");
    cr_assert(serving_gates_is_run(base));
    cr_assert_not(serving_gates_is_run(json_object_get(base, "gates")));
    serving_gates_t g;
    cr_assert_eq(serving_gates_from_run(base, "run.json", NULL, 0, &g), DUET_OK, "%s",
                 duet_error_last());
    cr_assert_eq(g.n, 4, "error_rate, 2 throughputs, mean_ttft: got %zu", g.n);

    /* just inside every bound: 95 = 100 - 5 %, 55 = 50 + 10 % */
    json_t *now = parse("{\"error_rate\": 0.0, \"output_throughput\": 95.0,"
                        " \"request_throughput\": 1.9, \"mean_ttft_ms\": 55.0}");
    duet_strbuf_t rep;
    duet_strbuf_init(&rep);
    cr_assert_eq(serving_gates_check(&g, now, &rep), 0, "%s", rep.data);
    cr_assert(strstr(rep.data, "PASS output_throughput = 95 (min 95 = baseline 100 - 5%)") != NULL,
              "%s", rep.data);
    cr_assert(strstr(rep.data, "PASS mean_ttft_ms = 55 (max 55 = baseline 50 + 10%)") != NULL, "%s",
              rep.data);
    json_decref(now);

    /* just outside: throughput 94.9, TTFT 55.1, one error */
    now = parse("{\"error_rate\": 0.01, \"output_throughput\": 94.9,"
                " \"request_throughput\": 2.5, \"mean_ttft_ms\": 55.1}");
    duet_strbuf_free(&rep);
    cr_assert_eq(serving_gates_check(&g, now, &rep), 3, "%s", rep.data);
    cr_assert(strstr(rep.data, "FAIL output_throughput = 94.9") != NULL, "%s", rep.data);
    cr_assert(strstr(rep.data, "FAIL mean_ttft_ms = 55.1") != NULL, "%s", rep.data);
    cr_assert(strstr(rep.data, "FAIL error_rate = 0.01 (max 0 = baseline 0 + 0%)") != NULL, "%s",
              rep.data);
    serving_gates_free(&g);

    /* tolerances: a default replaced (throughput may drop 30 %), a metric added (p99 TTFT +25 %) */
    serving_tol_t t[2];
    cr_assert_eq(serving_tol_parse("output_throughput=-30%", &t[0]), DUET_OK);
    cr_assert_eq(serving_tol_parse("p99_ttft_ms=+25%", &t[1]), DUET_OK);
    cr_assert_eq(serving_gates_from_run(base, "run.json", t, 2, &g), DUET_OK, "%s",
                 duet_error_last());
    cr_assert_eq(g.n, 5);
    json_object_set_new(now, "p99_ttft_ms", json_real(100.0));
    json_object_set_new(now, "error_rate", json_real(0.0));
    json_object_set_new(now, "mean_ttft_ms", json_real(50.0));
    duet_strbuf_free(&rep);
    cr_assert_eq(serving_gates_check(&g, now, &rep), 0, "%s", rep.data);
    json_object_set_new(now, "p99_ttft_ms", json_real(100.5));
    duet_strbuf_free(&rep);
    cr_assert_eq(serving_gates_check(&g, now, &rep), 1, "%s", rep.data);
    serving_gates_free(&g);
    duet_strbuf_free(&rep);
    json_decref(now);

    /* a tolerance for something the run did not measure */
    cr_assert_eq(serving_tol_parse("median_tpot_ms=+5%", &t[0]), DUET_OK);
    cr_assert_eq(serving_gates_from_run(base, "run.json", t, 1, &g), DUET_ERR_FORMAT);
    cr_assert(strstr(duet_error_last(), "no number for \"median_tpot_ms\"") != NULL, "%s",
              duet_error_last());
    json_decref(base);
}

Test(bench_gates, tolerances_parse_or_are_refused)
{
    serving_tol_t t;
    cr_assert_eq(serving_tol_parse("a=-5%", &t), DUET_OK);
    cr_assert_str_eq(t.metric, "a");
    cr_assert_float_eq(t.tol, -0.05, 1e-12);
    cr_assert_eq(serving_tol_parse("b=0.1", &t), DUET_OK);
    cr_assert_float_eq(t.tol, 0.1, 1e-12);
    cr_assert_eq(serving_tol_parse("c=+10%", &t), DUET_OK);
    cr_assert_float_eq(t.tol, 0.1, 1e-12);
    const char *bad[] = {"a", "=5%", "a=", "a=x", "a=5%%", "a=5 %", "a=-101%", "a=nan", "a=inf"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        cr_assert_neq(serving_tol_parse(bad[i], &t), DUET_OK, "\"%s\" was accepted", bad[i]);
    char long_name[100];
    memset(long_name, 'm', 80);
    strcpy(long_name + 80, "=5%");
    cr_assert_neq(serving_tol_parse(long_name, &t), DUET_OK);
}
