/*
 * duet-splitkv-plan: print the split-KV plan (kernels/splitkv.h) of a batch as JSON, to see how
 * a step of given lengths is cut into work items and how evenly that work could spread over the
 * parallel units, without a model or a GPU (issue 38). The plan is the library's; what this adds
 * is a greedy simulation of dealing the work to units, stated as such in the output.
 *
 *   duet-splitkv-plan --lens L,L,... [--rows R | --rows R,R,...] --heads H --page P --units U
 *       [--mode per_request|uniform|none] [--pretty]
 *
 * Exit status: 0 printed; 2 bad usage or a bad value (a message on stderr); 1 out of memory or
 * a failed write.
 */
#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/config.h"
#include "common/version.h"
#include "kernels/splitkv.h"

#define SKV_PROG "duet-splitkv-plan"
/* Bounds that keep the simulation's output finite: its tasks are about 8 x units plus one per
 * item and head. Far above any GPU's SMs, any CPU's threads, any model's heads. */
#define SKV_MAX_HEADS 1024
#define SKV_MAX_UNITS 65536

static const char skv_usage[] =
    "usage: " SKV_PROG " --lens L,L,... [--rows R | --rows R,R,...] --heads H --page P\n"
    "           --units U [--mode per_request|uniform|none] [--pretty]\n"
    "\n"
    "Print the split-KV plan of one attention step (kernels/splitkv.h) as JSON: how each\n"
    "request's KV blocks are cut into work items, and how those work items would spread over\n"
    "the parallel units (a greedy simulation, not a measurement).\n"
    "\n"
    "  --lens L,L,...   each request's KV length in positions (0..2^63-1; 0 = an empty item);\n"
    "                   one request per value, at least one\n"
    "  --rows R         query rows of every request (0..2^31-1; default 1: decoding one token;\n"
    "                   k+1 when verifying k draft tokens; a prefill chunk's length), or\n"
    "  --rows R,R,...   one value per request (as many values as --lens)\n"
    "  --heads H        attention heads, 1..1024: each work item runs once per head\n"
    "  --page P         positions per KV block (a pool page on the GPU, a segment on the CPU),\n"
    "                   1..2^63-1\n"
    "  --units U        parallel units (SMs, threads), 1..65536\n"
    "  --mode M         per_request (default): each request its own split count; uniform: one\n"
    "                   count for the step (from the number of requests and the longest);\n"
    "                   none: never split\n"
    "  --pretty         indent the JSON (default: one line)\n"
    "  --version        the version, git commit and CUDA build\n"
    "  --help           this text\n"
    "\n"
    "Output (one JSON object):\n"
    "  input            the values above; mode as a string\n"
    "  want_work        work items the plan aims at (about 8 per unit, counting each once per\n"
    "                   head); chunk: the cost (blocks x rows) one work item aims at;\n"
    "                   n_work: work items planned; max_work: the most any plan of this step\n"
    "                   could have\n"
    "  requests[]       per request: item, length, rows, blocks, cost (blocks x rows, 0 rows\n"
    "                   counted as 1), splits, and work[]: each work item's index in the work\n"
    "                   list, split, blocks [block0, block1), the positions [token0, token1)\n"
    "                   they hold, and its cost; an empty request (length 0) has one split and\n"
    "                   no work items\n"
    "  simulation       what a unit would get if the work list were dealt in order, each work\n"
    "                   item once per head (its heads one after another), each to the unit with\n"
    "                   the least cost so far (the lowest-numbered on a tie): units[] with each\n"
    "                   unit's cost, task count and tasks as [item, split, head]; max_cost,\n"
    "                   min_cost, mean_cost, imbalance (max over mean)\n"
    "  totals           items, empty items, split items, blocks, cost, work items, tasks\n"
    "                   (work items x heads)\n"
    "\n"
    "Example: " SKV_PROG " --lens 131072,100,100 --rows 1 --heads 32 --page 128 --units 132\n"
    "\n"
    "Exit status: 0 printed; 2 bad usage or a bad value (message on stderr); 1 out of memory\n"
    "or a failed write.\n";

static int skv_bad(const char *flag, const char *value, const char *why)
{
    fprintf(stderr, SKV_PROG ": bad value '%s' for %s (%s)\n", value, flag, why);
    return 2;
}

/*
 * A comma-separated list of whole numbers in [min, max] into a new array (*vals_p, *n_p).
 * Returns 0, 2 after a message on stderr for bad text (an empty list or element, a non-number,
 * a value outside the bounds), or 1 when out of memory.
 */
static int skv_parse_list(const char *flag, const char *text, int64_t min, int64_t max,
                          const char *bounds, int64_t **vals_p, int64_t *n_p)
{
    if (text[0] == '\0') {
        fprintf(stderr, SKV_PROG ": %s is empty: give at least one value\n", flag);
        return 2;
    }
    int64_t n = 1;
    for (const char *c = text; *c != '\0'; c++)
        n += *c == ',';
    char *copy = strdup(text);
    int64_t *vals = malloc((size_t)n * sizeof(*vals));
    int rc = 1;
    if (copy == NULL || vals == NULL)
        goto cleanup;
    rc = 2;
    char *field = copy;
    for (int64_t i = 0; i < n; i++) {
        char *comma = strchr(field, ',');
        if (comma != NULL)
            *comma = '\0';
        char why[160];
        if (field[0] == '\0') {
            snprintf(why, sizeof(why), "value %lld of the list is empty", (long long)i + 1);
            skv_bad(flag, text, why);
            goto cleanup;
        }
        const duet_status_t st = duet_config_parse_int(field, min, max, &vals[i]);
        if (st != DUET_OK) {
            snprintf(why, sizeof(why), "value %lld of the list: %s, want a whole number in %s",
                     (long long)i + 1, st == DUET_ERR_RANGE ? "out of range" : "not a number",
                     bounds);
            skv_bad(flag, field, why);
            goto cleanup;
        }
        field = comma != NULL ? comma + 1 : field + strlen(field);
    }
    *vals_p = vals;
    *n_p = n;
    vals = NULL;
    rc = 0;
cleanup:
    free(copy);
    free(vals);
    return rc;
}

/* One whole number in [min, max]; 0, or 2 after a message. */
static int skv_parse_one(const char *flag, const char *text, int64_t min, int64_t max,
                         const char *bounds, int64_t *v)
{
    const duet_status_t st = duet_config_parse_int(text, min, max, v);
    if (st == DUET_OK)
        return 0;
    char why[128];
    snprintf(why, sizeof(why), "%s, want a whole number in %s",
             st == DUET_ERR_RANGE ? "out of range" : "not a number", bounds);
    return skv_bad(flag, text, why);
}

static const char *const skv_modes[] = {
    [DUET_SPLITKV_PER_REQUEST] = "per_request",
    [DUET_SPLITKV_UNIFORM] = "uniform",
    [DUET_SPLITKV_NONE] = "none",
};

/* A unit in the simulation's min-heap: least cost first, then the lowest index. */
typedef struct {
    int64_t cost;
    int64_t unit;
} skv_slot_t;

static bool skv_before(const skv_slot_t *a, const skv_slot_t *b)
{
    return a->cost < b->cost || (a->cost == b->cost && a->unit < b->unit);
}

static void skv_sift_down(skv_slot_t *heap, int64_t n, int64_t i)
{
    for (;;) {
        int64_t m = i;
        const int64_t l = 2 * i + 1, r = 2 * i + 2;
        if (l < n && skv_before(&heap[l], &heap[m]))
            m = l;
        if (r < n && skv_before(&heap[r], &heap[m]))
            m = r;
        if (m == i)
            return;
        const skv_slot_t t = heap[i];
        heap[i] = heap[m];
        heap[m] = t;
        i = m;
    }
}

/* jansson's setters fail only without memory: one flag collects every failure. */
static void skv_set(json_t *obj, const char *key, json_t *v, bool *oom)
{
    if (v == NULL || json_object_set_new(obj, key, v) != 0)
        *oom = true;
}

static void skv_push(json_t *arr, json_t *v, bool *oom)
{
    if (v == NULL || json_array_append_new(arr, v) != 0)
        *oom = true;
}

/* The requests[] array: each item's blocks and work items with the positions they hold. */
static json_t *skv_requests_json(const duet_splitkv_in_t *in, const duet_splitkv_plan_t *plan,
                                 bool *oom)
{
    json_t *reqs = json_array();
    if (reqs == NULL) {
        *oom = true;
        return NULL;
    }
    for (int64_t i = 0; i < in->n_items && !*oom; i++) {
        const int64_t len = in->lens[i], rows = in->rows[i];
        const int64_t blocks = duet_splitkv_blocks(len, in->block_tokens);
        json_t *r = json_object(), *work = json_array();
        skv_push(reqs, r, oom);
        if (r == NULL || work == NULL) {
            json_decref(work);
            *oom = true;
            break;
        }
        skv_set(r, "item", json_integer(i), oom);
        skv_set(r, "length", json_integer(len), oom);
        skv_set(r, "rows", json_integer(rows), oom);
        skv_set(r, "blocks", json_integer(blocks), oom);
        skv_set(r, "cost", json_integer(duet_splitkv_cost(blocks, rows)), oom);
        skv_set(r, "splits", json_integer(plan->splits[i]), oom);
        skv_set(r, "work", work, oom);
        for (int32_t w = plan->work0[i]; w < plan->work0[i + 1] && !*oom; w++) {
            const duet_splitkv_work_t *wk = &plan->work[w];
            /* block0 < blocks, so block0 x page < len; block1 x page passes len (and may pass
             * int64) only for the item's last block, whose end is len. */
            const int64_t t0 = (int64_t)wk->block0 * in->block_tokens;
            const int64_t t1 = wk->block1 >= blocks ? len : (int64_t)wk->block1 * in->block_tokens;
            json_t *e = json_object();
            skv_push(work, e, oom);
            if (e == NULL)
                break;
            skv_set(e, "index", json_integer(w), oom);
            skv_set(e, "split", json_integer(wk->split), oom);
            skv_set(e, "block0", json_integer(wk->block0), oom);
            skv_set(e, "block1", json_integer(wk->block1), oom);
            skv_set(e, "token0", json_integer(t0), oom);
            skv_set(e, "token1", json_integer(t1), oom);
            skv_set(e, "cost", json_integer(duet_splitkv_cost(wk->block1 - wk->block0, rows)), oom);
        }
    }
    return reqs;
}

/* The simulation object: the work list dealt greedily to the least-loaded unit. */
static json_t *skv_simulation_json(const duet_splitkv_in_t *in, const duet_splitkv_plan_t *plan,
                                   bool *oom)
{
    const int64_t U = in->units;
    skv_slot_t *heap = malloc((size_t)U * sizeof(*heap));
    json_t **tasks = calloc((size_t)U, sizeof(*tasks));
    json_t *sim = json_object(), *units = json_array(), *fields = json_array();
    if (heap == NULL || tasks == NULL || sim == NULL || units == NULL || fields == NULL) {
        *oom = true;
        json_decref(units);
        json_decref(fields);
        goto cleanup;
    }
    skv_set(sim, "how",
            json_string("greedy: the work list in order, each work item once per head (its heads "
                        "one after another), each to the unit with the least cost so far (the "
                        "lowest-numbered on a tie); a model of how units pick up work, not a "
                        "measurement"),
            oom);
    skv_push(fields, json_string("item"), oom);
    skv_push(fields, json_string("split"), oom);
    skv_push(fields, json_string("head"), oom);
    skv_set(sim, "task", fields, oom);
    skv_set(sim, "units", units, oom);
    for (int64_t u = 0; u < U; u++) {
        heap[u] = (skv_slot_t){.cost = 0, .unit = u};
        tasks[u] = json_array();
        if (tasks[u] == NULL)
            *oom = true;
    }
    /* Costs all 0 and units in order: already a heap. */
    for (int64_t w = 0; w < plan->n_work && !*oom; w++) {
        const duet_splitkv_work_t *wk = &plan->work[w];
        const int64_t cost = duet_splitkv_cost(wk->block1 - wk->block0, in->rows[wk->item]);
        for (int64_t h = 0; h < in->heads && !*oom; h++) {
            json_t *t = json_array();
            skv_push(tasks[heap[0].unit], t, oom);
            if (t == NULL)
                break;
            skv_push(t, json_integer(wk->item), oom);
            skv_push(t, json_integer(wk->split), oom);
            skv_push(t, json_integer(h), oom);
            heap[0].cost += cost;
            skv_sift_down(heap, U, 0);
        }
    }
    int64_t max_cost = 0, min_cost = INT64_MAX, sum = 0;
    for (int64_t k = 0; k < U && !*oom; k++) {
        const int64_t c = heap[k].cost;
        sum += c;
        max_cost = c > max_cost ? c : max_cost;
        min_cost = c < min_cost ? c : min_cost;
    }
    /* units[] in unit order: find each unit's cost in the heap. */
    int64_t *cost_of = *oom ? NULL : malloc((size_t)U * sizeof(*cost_of));
    if (cost_of == NULL) {
        *oom = true;
        goto cleanup;
    }
    for (int64_t k = 0; k < U; k++)
        cost_of[heap[k].unit] = heap[k].cost;
    for (int64_t u = 0; u < U && !*oom; u++) {
        json_t *e = json_object();
        skv_push(units, e, oom);
        if (e == NULL)
            break;
        skv_set(e, "unit", json_integer(u), oom);
        skv_set(e, "cost", json_integer(cost_of[u]), oom);
        skv_set(e, "n_tasks", json_integer((json_int_t)json_array_size(tasks[u])), oom);
        skv_set(e, "tasks", tasks[u], oom);
        tasks[u] = NULL;
    }
    free(cost_of);
    const double mean = (double)sum / (double)U;
    skv_set(sim, "max_cost", json_integer(max_cost), oom);
    skv_set(sim, "min_cost", json_integer(min_cost), oom);
    skv_set(sim, "mean_cost", json_real(mean), oom);
    skv_set(sim, "imbalance", json_real(mean > 0 ? (double)max_cost / mean : 1.0), oom);
cleanup:
    if (tasks != NULL)
        for (int64_t u = 0; u < U; u++)
            json_decref(tasks[u]);
    free(tasks);
    free(heap);
    return sim;
}

int main(int argc, char **argv)
{
    const char *lens_s = NULL, *rows_s = NULL, *heads_s = NULL, *page_s = NULL, *units_s = NULL,
               *mode_s = NULL;
    bool pretty = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            fputs(skv_usage, stdout);
            return 0;
        }
        if (duet_version_flag(a)) {
            duet_version_print(SKV_PROG);
            return 0;
        }
        if (strcmp(a, "--pretty") == 0) {
            pretty = true;
            continue;
        }
        const char **slot = strcmp(a, "--lens") == 0    ? &lens_s
                            : strcmp(a, "--rows") == 0  ? &rows_s
                            : strcmp(a, "--heads") == 0 ? &heads_s
                            : strcmp(a, "--page") == 0  ? &page_s
                            : strcmp(a, "--units") == 0 ? &units_s
                            : strcmp(a, "--mode") == 0  ? &mode_s
                                                        : NULL;
        if (slot == NULL) {
            fprintf(stderr, SKV_PROG ": unknown %s %s (see --help)\n",
                    a[0] == '-' ? "option" : "argument", a);
            return 2;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, SKV_PROG ": %s needs a value (see --help)\n", a);
            return 2;
        }
        if (*slot != NULL) {
            fprintf(stderr, SKV_PROG ": %s given twice\n", a);
            return 2;
        }
        *slot = argv[++i];
    }
    static const char *const required[][2] = {
        {"--lens", "each request's KV length"},
        {"--heads", "attention heads"},
        {"--page", "positions per KV block"},
        {"--units", "parallel units"},
    };
    const char *given[] = {lens_s, heads_s, page_s, units_s};
    for (size_t k = 0; k < sizeof(given) / sizeof(given[0]); k++)
        if (given[k] == NULL) {
            fprintf(stderr, SKV_PROG ": missing %s (%s; see --help)\n", required[k][0],
                    required[k][1]);
            return 2;
        }

    int rc = 2;
    int64_t *lens = NULL, *rows = NULL, n = 0, n_rows = 0;
    int32_t *splits = NULL, *work0 = NULL;
    duet_splitkv_work_t *work = NULL;
    json_t *root = NULL;
    duet_splitkv_in_t in = {.mode = DUET_SPLITKV_PER_REQUEST};
    if (mode_s != NULL) {
        int m = -1;
        for (int k = 0; k < (int)(sizeof(skv_modes) / sizeof(skv_modes[0])); k++)
            if (strcmp(mode_s, skv_modes[k]) == 0)
                m = k;
        if (m < 0) {
            rc = skv_bad("--mode", mode_s, "want per_request, uniform or none");
            goto cleanup;
        }
        in.mode = (duet_splitkv_mode_t)m;
    }
    if ((rc = skv_parse_one("--heads", heads_s, 1, SKV_MAX_HEADS, "1..1024", &in.heads)) != 0 ||
        (rc = skv_parse_one("--page", page_s, 1, INT64_MAX, "1..2^63-1", &in.block_tokens)) != 0 ||
        (rc = skv_parse_one("--units", units_s, 1, SKV_MAX_UNITS, "1..65536", &in.units)) != 0)
        goto cleanup;
    if ((rc = skv_parse_list("--lens", lens_s, 0, INT64_MAX, "0..2^63-1", &lens, &n)) != 0 ||
        (rc = skv_parse_list("--rows", rows_s != NULL ? rows_s : "1", 0, INT32_MAX, "0..2^31-1",
                             &rows, &n_rows)) != 0)
        goto cleanup;
    if (n_rows != 1 && n_rows != n) {
        fprintf(stderr,
                SKV_PROG ": --rows has %lld values for %lld requests (give one value, or "
                         "one per --lens value)\n",
                (long long)n_rows, (long long)n);
        rc = 2;
        goto cleanup;
    }
    if (n_rows == 1 && n > 1) {
        int64_t *all = malloc((size_t)n * sizeof(*all));
        rc = 1;
        if (all == NULL)
            goto cleanup;
        for (int64_t i = 0; i < n; i++)
            all[i] = rows[0];
        free(rows);
        rows = all;
    }
    in.n_items = n;
    in.lens = lens;
    in.rows = rows;

    /* heads and units are bounded above, so this is at most n + 8 x 65536 entries. */
    const int64_t cap = duet_splitkv_max_work(n, in.heads, in.units);
    rc = 1;
    splits = malloc((size_t)n * sizeof(*splits));
    work0 = malloc((size_t)(n + 1) * sizeof(*work0));
    work = malloc((size_t)cap * sizeof(*work));
    if (splits == NULL || work0 == NULL || work == NULL) {
        fprintf(stderr, SKV_PROG ": out of memory for %lld requests\n", (long long)n);
        goto cleanup;
    }
    duet_splitkv_plan_t plan = {.splits = splits, .work0 = work0, .work = work};
    const duet_status_t st = duet_splitkv_plan(&in, &plan, cap);
    if (st != DUET_OK) {
        fprintf(stderr, SKV_PROG ": %s\n", duet_error_last());
        rc = st == DUET_ERR_INVALID ? 2 : 1;
        goto cleanup;
    }

    bool oom = false;
    int64_t total_blocks = 0, total_cost = 0, empty = 0, split_items = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t b = duet_splitkv_blocks(lens[i], in.block_tokens);
        total_blocks += b; /* each <= int32, and the plan refused a cost past int64 / 4 */
        total_cost += duet_splitkv_cost(b, rows[i]);
        empty += b == 0;
        split_items += splits[i] > 1;
    }
    /* The simulation adds up every task's cost: the step's cost once per head must fit. */
    if (total_cost > INT64_MAX / in.heads) {
        fprintf(stderr,
                SKV_PROG ": the step's cost %lld (blocks x rows) times %lld heads passes "
                         "2^63-1: too much to simulate\n",
                (long long)total_cost, (long long)in.heads);
        rc = 2;
        goto cleanup;
    }
    root = json_object();
    json_t *input = json_object(), *totals = json_object();
    skv_set(root, "input", input, &oom);
    if (input != NULL) {
        skv_set(input, "items", json_integer(n), &oom);
        skv_set(input, "heads", json_integer(in.heads), &oom);
        skv_set(input, "page", json_integer(in.block_tokens), &oom);
        skv_set(input, "units", json_integer(in.units), &oom);
        skv_set(input, "mode", json_string(skv_modes[in.mode]), &oom);
    }
    skv_set(root, "want_work", json_integer(duet_splitkv_want_work(in.heads, in.units)), &oom);
    skv_set(root, "chunk", json_integer(plan.chunk), &oom);
    skv_set(root, "n_work", json_integer(plan.n_work), &oom);
    skv_set(root, "max_work", json_integer(cap), &oom);
    skv_set(root, "requests", skv_requests_json(&in, &plan, &oom), &oom);
    skv_set(root, "simulation", skv_simulation_json(&in, &plan, &oom), &oom);
    skv_set(root, "totals", totals, &oom);
    if (totals != NULL) {
        skv_set(totals, "items", json_integer(n), &oom);
        skv_set(totals, "empty_items", json_integer(empty), &oom);
        skv_set(totals, "split_items", json_integer(split_items), &oom);
        skv_set(totals, "blocks", json_integer(total_blocks), &oom);
        skv_set(totals, "cost", json_integer(total_cost), &oom);
        skv_set(totals, "work_items", json_integer(plan.n_work), &oom);
        skv_set(totals, "tasks", json_integer(plan.n_work * in.heads), &oom);
    }
    if (root == NULL || oom) {
        fprintf(stderr, SKV_PROG ": out of memory building the JSON\n");
        rc = 1;
        goto cleanup;
    }
    if (json_dumpf(root, stdout, pretty ? JSON_INDENT(2) : JSON_COMPACT) != 0 ||
        fputc('\n', stdout) == EOF || fflush(stdout) != 0) {
        fprintf(stderr, SKV_PROG ": writing the JSON failed\n");
        rc = 1;
        goto cleanup;
    }
    rc = 0;
cleanup:
    json_decref(root);
    free(lens);
    free(rows);
    free(splits);
    free(work0);
    free(work);
    return rc;
}
