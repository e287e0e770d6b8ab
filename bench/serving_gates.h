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
 * A baseline can also be an earlier run's results JSON (duet-bench --json): each metric then
 * gets a bound relative to the run's value, as serving CI's regression gates do: by default
 * the throughputs may drop by 5 % (min = baseline x 0.95), the mean and median latencies may
 * rise by 10 % (max = baseline x 1.10) and error_rate may not rise at all; a tolerance
 * ("output_throughput=-3%", "p99_ttft_ms=+20%") replaces a default or gates one more metric.
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
    /* relative to a baseline run: the bound is ref x (1 + tol); tol < 0 a min, >= 0 a max */
    bool relative;
    double ref, tol;
} serving_gate_t;

/* One relative tolerance: metric may move by tol (a fraction: -0.05 = may drop 5 %). */
typedef struct {
    char metric[64];
    double tol;
} serving_tol_t;

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

/*
 * Parse "METRIC=-5%" / "METRIC=+10%" / "METRIC=0.1" (a fraction; the sign says drop or rise, no
 * sign is a rise) into *out. DUET_ERR_INVALID with a detail for anything else, a magnitude over
 * 100 % of a drop included.
 */
duet_status_t serving_tol_parse(const char *arg, serving_tol_t *out);

/* Whether root is a results JSON of duet-bench (a baseline run) rather than a gates file. */
bool serving_gates_is_run(const json_t *root);

/*
 * Relative gates from a baseline run's results (source names it in errors): the defaults above
 * for each metric the run measured (a finite number), then tols (n_tols) replacing or adding;
 * a tolerance for a metric the run lacks is an error (DUET_ERR_FORMAT), as is a run with no
 * gateable metric. Free with serving_gates_free.
 */
duet_status_t serving_gates_from_run(const json_t *run, const char *source,
                                     const serving_tol_t *tols, size_t n_tols,
                                     serving_gates_t *out_p);

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
