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
