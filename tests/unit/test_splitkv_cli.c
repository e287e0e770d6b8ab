/*
 * duet-splitkv-plan against the library: its JSON for a skewed batch (the example), for
 * row lists with prefill and empty items, and for random batches in every mode is read back
 * with jansson and must be the plan duet_splitkv_plan makes for the same input (splits, work
 * items, token ranges), keep the plan invariants (splitkv_check.h), and carry a unit
 * simulation equal to a naive re-deal of the same work list here. Every bad input must end
 * with exit status 2, a message naming it on stderr and nothing on stdout.
 */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/splitkv.h"
#include "tests/unit/test_run.h"

#define DUET_TEST_RNG_SEED 0xc11c0ffee5eedull
#include "tests/unit/splitkv_check.h"

#define OUT_CAP ((size_t)16 << 20)
static char *OUT;      /* the binary's stdout */
static char ERR[8192]; /* its stderr */

static const char *const MODES[] = {"per_request", "uniform", "none"};

/* Run the binary with `args`; stdout into OUT, stderr into ERR; returns the exit status. */
static int run_plan(const char *args)
{
    if (OUT == NULL) {
        OUT = malloc(OUT_CAP);
        cr_assert_not_null(OUT);
    }
    char errpath[] = "/tmp/duet-skv-err-XXXXXX";
    const int fd = mkstemp(errpath);
    cr_assert(fd >= 0, "mkstemp");
    close(fd);
    const size_t cap = strlen(args) + strlen(errpath) + 256;
    char *cmd = malloc(cap);
    cr_assert_not_null(cmd);
    snprintf(cmd, cap, "'%s' %s 2>'%s' </dev/null", DUET_SPLITKV_PLAN_BIN, args, errpath);
    const int rc = test_run(cmd, OUT, OUT_CAP);
    cr_assert(strlen(OUT) < OUT_CAP - 1, "output cut at %zu bytes", OUT_CAP);
    free(cmd);
    FILE *f = fopen(errpath, "r");
    cr_assert_not_null(f);
    const size_t n = fread(ERR, 1, sizeof(ERR) - 1, f);
    ERR[n] = '\0';
    fclose(f);
    unlink(errpath);
    return rc;
}

static int64_t jint(const json_t *obj, const char *key)
{
    const json_t *v = json_object_get(obj, key);
    cr_assert(json_is_integer(v), "\"%s\" is not an integer", key);
    return (int64_t)json_integer_value(v);
}

/* A comma list of n values. */
static void list_arg(char *buf, size_t cap, const int64_t *v, int64_t n)
{
    size_t at = 0;
    buf[0] = '\0';
    for (int64_t i = 0; i < n; i++)
        at += (size_t)snprintf(buf + at, cap - at, "%s%lld", i ? "," : "", (long long)v[i]);
    cr_assert(at < cap, "argument list too long");
}

/*
 * Run the binary on `in` (rows given as one value when all equal and `one_rows`) and check its
 * JSON against duet_splitkv_plan's plan for the same input, the invariants, and a naive
 * re-deal of the work to units. Returns the number of tasks checked.
 */
static int64_t check_cli(const duet_splitkv_in_t *in, bool one_rows, bool pretty)
{
    const int64_t n = in->n_items;
    cr_assert(n >= 1, "the binary needs at least one length");
    static char lens_s[SKV_MAX_N * 24 + 64], rows_s[SKV_MAX_N * 24 + 64];
    static char args[sizeof(lens_s) + sizeof(rows_s) + 256];
    list_arg(lens_s, sizeof(lens_s), in->lens, n);
    list_arg(rows_s, sizeof(rows_s), in->rows, one_rows ? 1 : n);
    snprintf(args, sizeof(args),
             "--lens %s --rows %s --heads %lld --page %lld --units %lld "
             "--mode %s%s",
             lens_s, rows_s, (long long)in->heads, (long long)in->block_tokens,
             (long long)in->units, MODES[in->mode], pretty ? " --pretty" : "");
    const int rc = run_plan(args);
    cr_assert_eq(rc, 0, "exit %d for %.200s: %s", rc, args, ERR);
    json_error_t jerr;
    json_t *root = json_loads(OUT, 0, &jerr);
    cr_assert_not_null(root, "not JSON: %s (line %d)", jerr.text, jerr.line);

    /* The library's plan for the same input. */
    const int64_t cap = duet_splitkv_max_work(n, in->heads, in->units);
    int32_t *splits = malloc((size_t)n * sizeof(int32_t));
    int32_t *work0 = malloc((size_t)(n + 1) * sizeof(int32_t));
    duet_splitkv_work_t *work = malloc((size_t)cap * sizeof(*work));
    cr_assert(splits != NULL && work0 != NULL && work != NULL);
    duet_splitkv_plan_t lib = {.splits = splits, .work0 = work0, .work = work};
    cr_assert_eq(duet_splitkv_plan(in, &lib, cap), DUET_OK, "%s", duet_error_last());

    const json_t *input = json_object_get(root, "input");
    cr_assert(jint(input, "items") == n && jint(input, "heads") == in->heads &&
              jint(input, "page") == in->block_tokens && jint(input, "units") == in->units);
    cr_assert_str_eq(json_string_value(json_object_get(input, "mode")), MODES[in->mode]);
    cr_assert_eq(jint(root, "want_work"), skv_ref_want(in->heads, in->units));
    cr_assert_eq(jint(root, "chunk"), lib.chunk);
    cr_assert_eq(jint(root, "n_work"), lib.n_work);
    cr_assert_eq(jint(root, "max_work"), cap);

    /* The JSON's plan, rebuilt as arrays: it must equal the library's and keep the invariants. */
    const json_t *reqs = json_object_get(root, "requests");
    cr_assert(json_is_array(reqs) && (int64_t)json_array_size(reqs) == n);
    int32_t *jsplits = malloc((size_t)n * sizeof(int32_t));
    int32_t *jwork0 = malloc((size_t)(n + 1) * sizeof(int32_t));
    duet_splitkv_work_t *jwork = malloc((size_t)(lib.n_work + 1) * sizeof(*jwork));
    cr_assert(jsplits != NULL && jwork0 != NULL && jwork != NULL);
    int64_t nw = 0, total_blocks = 0, total_cost = 0, empty = 0, split_items = 0;
    for (int64_t i = 0; i < n; i++) {
        const json_t *r = json_array_get(reqs, (size_t)i);
        const int64_t len = in->lens[i], b = skv_ref_blocks(len, in->block_tokens);
        const int64_t rr = skv_ref_rows(in->rows[i]);
        cr_assert(jint(r, "item") == i && jint(r, "length") == len &&
                      jint(r, "rows") == in->rows[i] && jint(r, "blocks") == b &&
                      jint(r, "cost") == b * rr,
                  "request %lld: item/length/rows/blocks/cost differ", (long long)i);
        jsplits[i] = (int32_t)jint(r, "splits");
        cr_assert_eq(jsplits[i], splits[i], "request %lld: %d splits, the library %d", (long long)i,
                     jsplits[i], splits[i]);
        jwork0[i] = (int32_t)nw;
        const json_t *wl = json_object_get(r, "work");
        cr_assert(json_is_array(wl));
        int64_t tok = 0; /* positions covered so far, in order */
        for (size_t k = 0; k < json_array_size(wl); k++) {
            const json_t *e = json_array_get(wl, k);
            cr_assert(nw < lib.n_work, "more work items in the JSON than in the plan");
            jwork[nw] = (duet_splitkv_work_t){.item = (int32_t)i,
                                              .split = (int32_t)jint(e, "split"),
                                              .block0 = (int32_t)jint(e, "block0"),
                                              .block1 = (int32_t)jint(e, "block1")};
            const duet_splitkv_work_t *lw = &work[nw];
            cr_assert(jint(e, "index") == nw && lw->item == i && jwork[nw].split == lw->split &&
                          jwork[nw].block0 == lw->block0 && jwork[nw].block1 == lw->block1,
                      "request %lld work %zu differs from the library's", (long long)i, k);
            const int64_t t0 = jint(e, "token0"), t1 = jint(e, "token1");
            const int64_t end = (int64_t)lw->block1 * in->block_tokens;
            cr_assert(t0 == tok && t0 == (int64_t)lw->block0 * in->block_tokens &&
                          t1 == (end < len ? end : len) && t1 > t0,
                      "request %lld work %zu: positions [%lld, %lld)", (long long)i, k,
                      (long long)t0, (long long)t1);
            cr_assert_eq(jint(e, "cost"), (int64_t)(lw->block1 - lw->block0) * rr);
            tok = t1;
            nw++;
        }
        cr_assert_eq(tok, len, "request %lld: positions covered up to %lld of %lld", (long long)i,
                     (long long)tok, (long long)len);
        total_blocks += b;
        total_cost += b * rr;
        empty += b == 0;
        split_items += splits[i] > 1;
    }
    jwork0[n] = (int32_t)nw;
    cr_assert_eq(nw, lib.n_work);
    const duet_splitkv_plan_t jp = {.splits = jsplits,
                                    .work0 = jwork0,
                                    .work = jwork,
                                    .n_work = nw,
                                    .chunk = jint(root, "chunk")};
    skv_check_plan(in, &jp, "the binary's plan");

    /* The simulation, re-dealt here by a linear scan for the least-loaded unit. */
    const int64_t U = in->units;
    int64_t *load = calloc((size_t)U, sizeof(int64_t));
    size_t *next = calloc((size_t)U, sizeof(size_t));
    cr_assert(load != NULL && next != NULL);
    const json_t *sim = json_object_get(root, "simulation");
    const json_t *units = json_object_get(sim, "units");
    cr_assert(json_is_array(units) && (int64_t)json_array_size(units) == U);
    cr_assert(json_is_string(json_object_get(sim, "how")) &&
              strstr(json_string_value(json_object_get(sim, "how")), "not a measurement"));
    int64_t tasks = 0;
    for (int64_t w = 0; w < lib.n_work; w++) {
        const int64_t c =
            (int64_t)(work[w].block1 - work[w].block0) * skv_ref_rows(in->rows[work[w].item]);
        for (int64_t h = 0; h < in->heads; h++) {
            int64_t u = 0;
            for (int64_t v = 1; v < U; v++)
                if (load[v] < load[u])
                    u = v;
            const json_t *ut = json_object_get(json_array_get(units, (size_t)u), "tasks");
            const json_t *t = json_array_get(ut, next[u]++);
            cr_assert(json_is_array(t) && json_array_size(t) == 3 &&
                          json_integer_value(json_array_get(t, 0)) == work[w].item &&
                          json_integer_value(json_array_get(t, 1)) == work[w].split &&
                          json_integer_value(json_array_get(t, 2)) == h,
                      "work %lld head %lld: not the next task of unit %lld", (long long)w,
                      (long long)h, (long long)u);
            load[u] += c;
            tasks++;
        }
    }
    int64_t most = 0, least = INT64_MAX, sum = 0;
    for (int64_t u = 0; u < U; u++) {
        const json_t *e = json_array_get(units, (size_t)u);
        cr_assert(jint(e, "unit") == u && jint(e, "cost") == load[u] &&
                      jint(e, "n_tasks") == (int64_t)next[u] &&
                      json_array_size(json_object_get(e, "tasks")) == next[u],
                  "unit %lld: cost %lld, want %lld", (long long)u, (long long)jint(e, "cost"),
                  (long long)load[u]);
        most = load[u] > most ? load[u] : most;
        least = load[u] < least ? load[u] : least;
        sum += load[u];
    }
    cr_assert_eq(sum, total_cost * in->heads, "the units' costs add up to %lld, want %lld",
                 (long long)sum, (long long)(total_cost * in->heads));
    cr_assert(jint(sim, "max_cost") == most && jint(sim, "min_cost") == least);
    const double mean = (double)sum / (double)U;
    cr_assert_float_eq(json_real_value(json_object_get(sim, "mean_cost")), mean,
                       1e-9 * mean + 1e-12);
    cr_assert_float_eq(json_real_value(json_object_get(sim, "imbalance")),
                       mean > 0 ? (double)most / mean : 1.0, 1e-9);

    const json_t *tot = json_object_get(root, "totals");
    cr_assert(jint(tot, "items") == n && jint(tot, "empty_items") == empty &&
              jint(tot, "split_items") == split_items && jint(tot, "blocks") == total_blocks &&
              jint(tot, "cost") == total_cost && jint(tot, "work_items") == lib.n_work &&
              jint(tot, "tasks") == tasks && tasks == lib.n_work * in->heads);

    free(load);
    free(next);
    free(jsplits);
    free(jwork0);
    free(jwork);
    free(splits);
    free(work0);
    free(work);
    json_decref(root);
    return tasks;
}

/* The batch: one request at 128K beside 63 of 100 positions, 32 heads, 132 units. */
Test(splitkv_cli, skewed_batch_matches_the_library, .timeout = 60)
{
    int64_t lens[64], rows[64];
    for (int i = 0; i < 64; i++) {
        lens[i] = i == 0 ? 131072 : 100;
        rows[i] = 1;
    }
    for (int m = 0; m < 3; m++) {
        const duet_splitkv_in_t in = {.n_items = 64,
                                      .lens = lens,
                                      .rows = rows,
                                      .heads = 32,
                                      .block_tokens = 128,
                                      .units = 132,
                                      .mode = (duet_splitkv_mode_t)m};
        check_cli(&in, true, m == 1);
    }
    /* Per request the long one is split and the greedy deal is then nearly even. A unit's last
     * task went to it while it was least loaded, so at most the mean then (loads only grow);
     * its cost now is at most the final mean plus that task's cost, and no work item here
     * costs more than the chunk (one row: bound (A) of test_splitkv.c). */
    cr_assert_eq(run_plan("--lens 131072" /* + 63 x 100 */
                          ",100,100,100,100,100,100,100,100,100,100,100,100,100,100,100,100"
                          ",100,100,100,100,100,100,100,100,100,100,100,100,100,100,100,100"
                          ",100,100,100,100,100,100,100,100,100,100,100,100,100,100,100,100"
                          ",100,100,100,100,100,100,100,100,100,100,100,100,100,100,100"
                          " --heads 32 --page 128 --units 132"),
                 0, "%s", ERR);
    json_t *root = json_loads(OUT, 0, NULL);
    cr_assert_not_null(root);
    const json_t *sim = json_object_get(root, "simulation");
    cr_assert(json_array_size(json_object_get(root, "requests")) == 64);
    cr_assert(jint(json_array_get(json_object_get(root, "requests"), 0), "splits") > 1);
    cr_assert(jint(sim, "max_cost") - json_real_value(json_object_get(sim, "mean_cost")) <=
              (double)jint(root, "chunk"));
    json_decref(root);
}

/* Rows per request: decode, drafts, a prefill chunk (never split), an empty item. */
Test(splitkv_cli, row_lists_and_empty_items, .timeout = 60)
{
    int64_t lens[6] = {65536, 0, 3000, 40000, 17, 100000}, rows[6] = {1, 1, 5, 512, 9, 0};
    for (int m = 0; m < 3; m++) {
        const duet_splitkv_in_t in = {.n_items = 6,
                                      .lens = lens,
                                      .rows = rows,
                                      .heads = 8,
                                      .block_tokens = 64,
                                      .units = 16,
                                      .mode = (duet_splitkv_mode_t)m};
        check_cli(&in, false, false);
    }
}

/* Random batches (the property tests' generator), every mode, through the binary. */
Test(splitkv_cli, random_batches_match_the_library, .timeout = 120)
{
    rng_state = DUET_TEST_RNG_SEED;
    static batch_t b;
    int runs = 0;
    int64_t tasks = 0;
    while (runs < 60) {
        gen_batch(&b);
        if (b.n == 0)
            continue;
        const duet_splitkv_in_t in = {.n_items = b.n,
                                      .lens = b.lens,
                                      .rows = b.rows,
                                      .heads = b.heads,
                                      .block_tokens = b.bt,
                                      .units = b.units,
                                      .mode = (duet_splitkv_mode_t)(runs % 3)};
        bool same = true;
        for (int64_t i = 1; i < b.n; i++)
            same = same && b.rows[i] == b.rows[0];
        tasks += check_cli(&in, same && runs % 2 == 0, runs % 5 == 0);
        runs++;
    }
    printf("[splitkv_cli] %d random batches, %lld tasks dealt\n", runs, (long long)tasks);
}

/* --pretty changes the layout only. */
Test(splitkv_cli, pretty_is_the_same_json)
{
    const char *args = "--lens 5000,0,12,900 --rows 1,1,20,3 --heads 4 --page 16 --units 7";
    cr_assert_eq(run_plan(args), 0, "%s", ERR);
    json_t *a = json_loads(OUT, 0, NULL);
    cr_assert(strchr(OUT, '\n') == OUT + strlen(OUT) - 1, "compact output is one line");
    char pretty[256];
    snprintf(pretty, sizeof(pretty), "%s --pretty", args);
    cr_assert_eq(run_plan(pretty), 0, "%s", ERR);
    json_t *b = json_loads(OUT, 0, NULL);
    cr_assert(a != NULL && b != NULL && json_equal(a, b), "--pretty printed other JSON");
    cr_assert(strchr(OUT, '\n') < OUT + strlen(OUT) - 1, "--pretty printed one line");
    json_decref(a);
    json_decref(b);
}

Test(splitkv_cli, bad_inputs_exit_2)
{
    static const struct {
        const char *args, *says;
    } cases[] = {
        {"--lens 1,x --heads 1 --page 1 --units 1", "bad value 'x' for --lens (value 2"},
        {"--lens 1.5 --heads 1 --page 1 --units 1", "bad value '1.5' for --lens"},
        {"--lens ' 7' --heads 1 --page 1 --units 1", "bad value ' 7' for --lens"},
        {"--lens 1,-3 --heads 1 --page 1 --units 1", "bad value '-3' for --lens"},
        {"--lens '' --heads 1 --page 1 --units 1", "--lens is empty"},
        {"--lens 1,,2 --heads 1 --page 1 --units 1", "value 2 of the list is empty"},
        {"--lens 1, --heads 1 --page 1 --units 1", "value 2 of the list is empty"},
        {"--lens 9223372036854775808 --heads 1 --page 1 --units 1",
         "bad value '9223372036854775808' for --lens"},
        {"--lens 1,2 --rows 1,2,3 --heads 1 --page 1 --units 1",
         "--rows has 3 values for 2 requests"},
        {"--lens 1,2,3 --rows 1,2 --heads 1 --page 1 --units 1",
         "--rows has 2 values for 3 requests"},
        {"--lens 1 --rows -1 --heads 1 --page 1 --units 1", "bad value '-1' for --rows"},
        {"--lens 1 --rows 2147483648 --heads 1 --page 1 --units 1",
         "bad value '2147483648' for --rows"},
        {"--lens 1 --rows '' --heads 1 --page 1 --units 1", "--rows is empty"},
        {"--lens 1 --heads 0 --page 1 --units 1", "bad value '0' for --heads"},
        {"--lens 1 --heads 1025 --page 1 --units 1", "bad value '1025' for --heads"},
        {"--lens 1 --heads 2147483648 --page 1 --units 1", "bad value '2147483648' for --heads"},
        {"--lens 1 --heads abc --page 1 --units 1", "bad value 'abc' for --heads"},
        {"--lens 1 --heads 1 --page 0 --units 1", "bad value '0' for --page"},
        {"--lens 1 --heads 1 --page -128 --units 1", "bad value '-128' for --page"},
        {"--lens 1 --heads 1 --page 9223372036854775808 --units 1",
         "bad value '9223372036854775808' for --page"},
        {"--lens 1 --heads 1 --page 1 --units 0", "bad value '0' for --units"},
        {"--lens 1 --heads 1 --page 1 --units 65537", "bad value '65537' for --units"},
        {"--lens 1 --heads 1 --page 1 --units 1 --mode fast", "bad value 'fast' for --mode"},
        {"--lens 1 --heads 1 --page 1 --units 1 --bogus", "unknown option --bogus"},
        {"--lens 1 --heads 1 --page 1 --units 1 extra", "unknown argument extra"},
        {"--lens 1 --heads 1 --page 1", "missing --units"},
        {"--heads 1 --page 1 --units 1", "missing --lens"},
        {"--lens 1 --heads 1 --page 1 --units", "--units needs a value"},
        {"--lens 1 --lens 2 --heads 1 --page 1 --units 1", "--lens given twice"},
        /* Refused by the library: past int32 blocks, past its cost limit. */
        {"--lens 2147483648 --heads 1 --page 1 --units 1",
         "item 0 has 2147483648 blocks (more than int32)"},
        {"--lens 9223372036854775807 --heads 1 --page 2 --units 1", "(more than int32)"},
        {"--lens 4611686016279904256 --rows 2147483647 --heads 1 --page 2147483648 --units 1",
         "the step's cost (blocks x rows) passes"},
        /* Within the library's limit, but not once per head in the simulation's sums. */
        {"--lens 2199023254528 --rows 536870912 --heads 16 --page 1024 --units 1",
         "times 16 heads passes 2^63-1"},
    };
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        const int rc = run_plan(cases[k].args);
        cr_expect_eq(rc, 2, "%s: exit %d (stderr: %s)", cases[k].args, rc, ERR);
        cr_expect(strstr(ERR, cases[k].says) != NULL, "%s: stderr \"%s\" does not say \"%s\"",
                  cases[k].args, ERR, cases[k].says);
        cr_expect(strncmp(ERR, "duet-splitkv-plan: ", 19) == 0 && strchr(ERR, '\n') != NULL &&
                      strchr(ERR, '\n')[1] == '\0',
                  "%s: not one line naming the program: %s", cases[k].args, ERR);
        cr_expect_eq(OUT[0], '\0', "%s: printed on stdout: %.200s", cases[k].args, OUT);
    }
}

Test(splitkv_cli, help_documents_every_option)
{
    cr_assert_eq(run_plan("--help"), 0);
    static const char *const words[] = {
        "usage:",      "--lens",  "--rows", "--heads",  "--page",    "--units",    "--mode",
        "per_request", "uniform", "none",   "--pretty", "--version", "simulation", "Exit status"};
    for (size_t k = 0; k < sizeof(words) / sizeof(words[0]); k++)
        cr_expect(strstr(OUT, words[k]) != NULL, "--help does not mention %s", words[k]);
    cr_assert_eq(ERR[0], '\0', "--help wrote to stderr: %s", ERR);
}
