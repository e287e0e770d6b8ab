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
        char why[128], bounds[96];
        double v = NAN;
        bool pass = serving_gate_eval(gt, results, &v, why, sizeof(why));
        if (gt->has_min && gt->has_max)
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
