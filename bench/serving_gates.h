/*
 * Performance gates for duet-bench: a baseline file bounds metrics of the results JSON, and a
 * run fails (exit 3) when any bound is broken or a gated metric was not measured.
 *
 * Baseline format (JSON):
 *   {
 *     "description": "optional free text",
 *     "gates": {
 *       "error_rate":        {"max": 0.0},
 *       "output_throughput": {"min": 50},
 *       "mean_tpot_ms":      {"min": 1, "max": 200}
 *     }
 *   }
 * Each key of "gates" names a top-level number of the results JSON (--json); each gate has "min"
 * and/or "max" (numbers, min <= max), both inclusive. Unknown keys anywhere are refused, so a
 * typo ("mxa") cannot silently disable a gate. A gated metric that is absent, null or not a
 * number fails its gate with that reason.
 *
 * Pure functions over jansson values: the caller reads files and prints.
 */
#ifndef DUET_BENCH_SERVING_GATES_H
#define DUET_BENCH_SERVING_GATES_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "common/status.h"
#include "common/strbuf.h"

typedef struct {
    char *metric; /* owned: a top-level key of the results JSON */
    bool has_min, has_max;
    double min, max;
} serving_gate_t;

typedef struct {
    serving_gate_t *gates; /* owned, (n) in the order of the file */
    size_t n;
} serving_gates_t;

/*
 * Validate a parsed baseline and copy its gates into *out_p (free with serving_gates_free).
 * DUET_ERR_FORMAT with a detail naming `source` and the offending field on any type or shape
 * error; DUET_ERR_NOMEM. *out_p is written only on success.
 */
duet_status_t serving_gates_parse(const json_t *root, const char *source, serving_gates_t *out_p);

/* Free the gates. Accepts NULL. */
void serving_gates_free(serving_gates_t *g);

/*
 * Evaluate one gate against the results object. Returns whether it passed; *value_p receives
 * the measured value (NaN when there is none) and why (cap bytes) a short reason for a failure
 * ("" on pass).
 */
bool serving_gate_eval(const serving_gate_t *g, const json_t *results, double *value_p, char *why,
                       size_t cap);

/*
 * Evaluate every gate, appending one line per gate to report ("PASS output_throughput = 812.3
 * (min 50)" / "FAIL ... : reason"). Returns the number of failed gates.
 */
size_t serving_gates_check(const serving_gates_t *g, const json_t *results, duet_strbuf_t *report);

#endif
