/*
 * Performance gates; the file format and contract are in serving_gates.h.
 */
#include "bench/serving_gates.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void serving_gates_free(serving_gates_t *g)
{
    if (g == NULL)
        return;
    for (size_t i = 0; i < g->n; i++)
        free(g->gates[i].metric);
    free(g->gates);
    g->gates = NULL;
    g->n = 0;
}

/* One bound ("min" / "max") of gate `metric`: absent is fine, else it must be a finite number. */
static duet_status_t gates_bound(json_t *gate, const char *source, const char *metric,
                                 const char *key, bool *has_p, double *v_p)
{
    json_t *v = json_object_get(gate, key);
    if (v == NULL)
        return DUET_OK;
    if (!json_is_number(v) || !isfinite(json_number_value(v)))
        return duet_error_set(DUET_ERR_FORMAT, "%s: gates.%s.%s: expected a number, got %s", source,
                              metric, key,
                              json_is_string(v)    ? "a string"
                              : json_is_null(v)    ? "null"
                              : json_is_object(v)  ? "an object"
                              : json_is_array(v)   ? "an array"
                              : json_is_boolean(v) ? "a boolean"
                                                   : "a non-finite number");
    *has_p = true;
    *v_p = json_number_value(v);
    return DUET_OK;
}

duet_status_t serving_gates_parse(const json_t *root, const char *source, serving_gates_t *out_p)
{
    if (!json_is_object(root))
        return duet_error_set(DUET_ERR_FORMAT, "%s: expected a JSON object at the top", source);
    const char *key;
    json_t *val;
    json_object_foreach((json_t *)root, key, val)
    {
        if (strcmp(key, "gates") != 0 && strcmp(key, "description") != 0)
            return duet_error_set(DUET_ERR_FORMAT,
                                  "%s: unknown top-level key \"%s\" (expected \"gates\" and an "
                                  "optional \"description\")",
                                  source, key);
    }
    json_t *gates = json_object_get(root, "gates");
    if (!json_is_object(gates))
        return duet_error_set(DUET_ERR_FORMAT,
                              "%s: \"gates\" must be an object of "
                              "{\"METRIC\": {\"min\": X, \"max\": Y}}",
                              source);
    size_t n = json_object_size(gates);
    if (n == 0)
        return duet_error_set(DUET_ERR_FORMAT, "%s: \"gates\" is empty", source);

    serving_gates_t g = {.gates = calloc(n, sizeof(serving_gate_t)), .n = 0};
    if (g.gates == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "%s: %zu gates", source, n);
    duet_status_t st = DUET_OK;
    json_object_foreach(gates, key, val)
    {
        if (!json_is_object(val)) {
            st = duet_error_set(DUET_ERR_FORMAT,
                                "%s: gates.%s: expected an object with "
                                "\"min\" and/or \"max\"",
                                source, key);
            goto fail;
        }
        const char *bk;
        json_t *bv;
        json_object_foreach(val, bk, bv)
        {
            if (strcmp(bk, "min") != 0 && strcmp(bk, "max") != 0) {
                st = duet_error_set(DUET_ERR_FORMAT,
                                    "%s: gates.%s: unknown key \"%s\" (expected min / max)", source,
                                    key, bk);
                goto fail;
            }
        }
        serving_gate_t *gt = &g.gates[g.n];
        if ((st = gates_bound(val, source, key, "min", &gt->has_min, &gt->min)) != DUET_OK ||
            (st = gates_bound(val, source, key, "max", &gt->has_max, &gt->max)) != DUET_OK)
            goto fail;
        if (!gt->has_min && !gt->has_max) {
            st = duet_error_set(DUET_ERR_FORMAT, "%s: gates.%s: needs \"min\" or \"max\"", source,
                                key);
            goto fail;
        }
        if (gt->has_min && gt->has_max && gt->min > gt->max) {
            st = duet_error_set(DUET_ERR_FORMAT, "%s: gates.%s: min %g is above max %g", source,
                                key, gt->min, gt->max);
            goto fail;
        }
        gt->metric = strdup(key);
        if (gt->metric == NULL) {
            st = duet_error_set(DUET_ERR_NOMEM, "%s: gate name", source);
            goto fail;
        }
        g.n++;
    }
    *out_p = g;
    return DUET_OK;
fail:
    serving_gates_free(&g);
    return st;
}

/* The defaults of a baseline run: which way each metric may move, and how far. */
static const struct {
    const char *metric;
    double tol;
} gates_default_tols[] = {
    {"error_rate", 0.0},          {"request_throughput", -0.05},
    {"output_throughput", -0.05}, {"total_token_throughput", -0.05},
    {"mean_ttft_ms", 0.10},       {"median_ttft_ms", 0.10},
    {"mean_tpot_ms", 0.10},       {"median_tpot_ms", 0.10},
    {"mean_itl_ms", 0.10},        {"median_itl_ms", 0.10},
    {"mean_e2el_ms", 0.10},       {"median_e2el_ms", 0.10},
};

duet_status_t serving_tol_parse(const char *arg, serving_tol_t *out)
{
    const char *eq = strchr(arg, '=');
    if (eq == NULL || eq == arg || (size_t)(eq - arg) >= sizeof(out->metric))
        return duet_error_set(DUET_ERR_INVALID,
                              "tolerance \"%s\": expected METRIC=-5%% (may drop) or "
                              "METRIC=+10%% (may rise)",
                              arg);
    const char *v = eq + 1;
    char *end = NULL;
    double x = strtod(v, &end);
    bool pct = end != v && *end == '%';
    if (end == v || (pct ? end[1] != '\0' : *end != '\0') || !isfinite(x))
        return duet_error_set(DUET_ERR_INVALID, "tolerance \"%s\": \"%s\" is not a number", arg, v);
    if (pct)
        x /= 100.0;
    if (x < -1.0 || x > 100.0)
        return duet_error_set(DUET_ERR_INVALID,
                              "tolerance \"%s\": a drop is at most 100%% and a rise at most "
                              "10000%%",
                              arg);
    memcpy(out->metric, arg, (size_t)(eq - arg));
    out->metric[eq - arg] = '\0';
    out->tol = x;
    return DUET_OK;
}

bool serving_gates_is_run(const json_t *root)
{
    return json_is_object(root) && !json_is_object(json_object_get(root, "gates")) &&
           json_is_integer(json_object_get(root, "completed")) &&
           json_object_get(root, "output_throughput") != NULL;
}

/* Append the relative gate metric = ref x (1 + tol) to g (capacity checked by the caller). */
static duet_status_t gates_add_relative(serving_gates_t *g, const char *metric, double ref,
                                        double tol)
{
    for (size_t i = 0; i < g->n; i++)
        if (strcmp(g->gates[i].metric, metric) == 0) { /* a tolerance replacing a default */
            g->gates[i].tol = tol;
            g->gates[i].has_min = tol < 0;
            g->gates[i].has_max = tol >= 0;
            g->gates[i].min = g->gates[i].max = ref * (1.0 + tol);
            return DUET_OK;
        }
    serving_gate_t *gt = &g->gates[g->n];
    gt->metric = strdup(metric);
    if (gt->metric == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "gate name");
    gt->relative = true;
    gt->ref = ref;
    gt->tol = tol;
    gt->has_min = tol < 0;
    gt->has_max = tol >= 0;
    gt->min = gt->max = ref * (1.0 + tol);
    g->n++;
    return DUET_OK;
}

duet_status_t serving_gates_from_run(const json_t *run, const char *source,
                                     const serving_tol_t *tols, size_t n_tols,
                                     serving_gates_t *out_p)
{
    const size_t n_def = sizeof(gates_default_tols) / sizeof(gates_default_tols[0]);
    serving_gates_t g = {.gates = calloc(n_def + n_tols, sizeof(serving_gate_t)), .n = 0};
    if (g.gates == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "%s: gates", source);
    duet_status_t st = DUET_OK;
    for (size_t i = 0; i < n_def; i++) {
        json_t *v = json_object_get(run, gates_default_tols[i].metric);
        if (!json_is_number(v) || !isfinite(json_number_value(v)))
            continue; /* not measured in the baseline run (e.g. TPOT of one-token answers) */
        if ((st = gates_add_relative(&g, gates_default_tols[i].metric, json_number_value(v),
                                     gates_default_tols[i].tol)) != DUET_OK)
            goto fail;
    }
    for (size_t i = 0; i < n_tols; i++) {
        json_t *v = json_object_get(run, tols[i].metric);
        if (!json_is_number(v) || !isfinite(json_number_value(v))) {
            st = duet_error_set(DUET_ERR_FORMAT,
                                "%s: the baseline run has no number for \"%s\" to gate against",
                                source, tols[i].metric);
            goto fail;
        }
        if ((st = gates_add_relative(&g, tols[i].metric, json_number_value(v), tols[i].tol)) !=
            DUET_OK)
            goto fail;
    }
    if (g.n == 0) {
        st = duet_error_set(DUET_ERR_FORMAT, "%s: the baseline run measured nothing to gate on",
                            source);
        goto fail;
    }
    *out_p = g;
    return DUET_OK;
fail:
    serving_gates_free(&g);
    return st;
}

bool serving_gate_eval(const serving_gate_t *g, const json_t *results, double *value_p, char *why,
                       size_t cap)
{
    *value_p = NAN;
    why[0] = '\0';
    json_t *v = json_object_get(results, g->metric);
    if (v == NULL) {
        snprintf(why, cap, "metric missing from the results");
        return false;
    }
    if (json_is_null(v)) {
        snprintf(why, cap, "metric is null (not measured in this run)");
        return false;
    }
    if (!json_is_number(v)) {
        snprintf(why, cap, "metric is not a number");
        return false;
    }
    double x = json_number_value(v);
    *value_p = x;
    if (g->has_min && !(x >= g->min)) {
        snprintf(why, cap, "below min %g", g->min);
        return false;
    }
    if (g->has_max && !(x <= g->max)) {
        snprintf(why, cap, "above max %g", g->max);
        return false;
    }
    return true;
}

size_t serving_gates_check(const serving_gates_t *g, const json_t *results, duet_strbuf_t *report)
{
    size_t failed = 0;
    for (size_t i = 0; i < g->n; i++) {
        const serving_gate_t *gt = &g->gates[i];
        char why[128], bounds[160];
        double v = NAN;
        bool pass = serving_gate_eval(gt, results, &v, why, sizeof(why));
        if (gt->relative)
            snprintf(bounds, sizeof(bounds), "%s %g = baseline %g %c %g%%",
                     gt->has_min ? "min" : "max", gt->has_min ? gt->min : gt->max, gt->ref,
                     gt->tol < 0 ? '-' : '+', fabs(gt->tol) * 100.0);
        else if (gt->has_min && gt->has_max)
            snprintf(bounds, sizeof(bounds), "min %g, max %g", gt->min, gt->max);
        else if (gt->has_min)
            snprintf(bounds, sizeof(bounds), "min %g", gt->min);
        else
            snprintf(bounds, sizeof(bounds), "max %g", gt->max);
        if (isnan(v))
            duet_strbuf_printf(report, "%s %s = null (%s)", pass ? "PASS" : "FAIL", gt->metric,
                               bounds);
        else
            duet_strbuf_printf(report, "%s %s = %.6g (%s)", pass ? "PASS" : "FAIL", gt->metric, v,
                               bounds);
        if (!pass) {
            duet_strbuf_printf(report, ": %s", why);
            failed++;
        }
        duet_strbuf_puts(report, "\n");
    }
    return failed;
}
