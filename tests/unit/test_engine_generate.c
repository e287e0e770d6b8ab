/*
 * duet-generate's loop (engine/generate.h, the code the CLI runs) with speculative decoding,
 * against the same loop without it, on the CPU.
 *
 * Greedy is exact: on every golden fixture (tests/fixtures) and the demo model, three prompts
 * each (the case's own, a repetitive one so that drafts are kept, a short one), prompt lookup
 * (ngram) and a draft model at k = 1, 2, 4, 7 and 8 give exactly the tokens of plain decoding,
 * bound 0 (token for token). Plain decoding itself is tied to transformers: on each fixture's
 * own prompt its first 32 tokens are golden.json's greedy_ids. The draft model is
 * models/duet-demo-draft for the demo model when the tree has it, else (and for every fixture)
 * the case's own first MLA layer cut into a one-layer model (spec_test_util.h), which shares the
 * vocabulary and agrees with the target part of the time. A drafter with KDA layers (the case's
 * first KDA layer and first MLA layer cut into a two-layer model, rolled back by restoring a
 * saved state) runs too, on every case, at k = 2, 7 here and k = 1, 4, 8 in the batch below
 * (each k once, to keep the file's wall time). The counters hold their invariants
 * (kept <= drafted <= k * verify steps, verify steps <= steps, tokens = 1 + steps + kept when
 * max_tokens ends the output; the first token comes from the prefill). max_tokens and stop ids
 * (ignore_eos off) end the output exactly where plain decoding's ends, also when the stop id is
 * a kept draft with more tokens after it in the same verify.
 *
 * Greedy in a batch, as a continuous-batching worker serves requests (batch_run): four requests
 * with prompts of different lengths join at different forwards and prefill in chunks of 8, one
 * is never drafted for, so verify items share forwards with prefill chunks and plain rows; for
 * ngram and the draft model at k = 1, 2, 4, 7, 8 and the drafter with KDA layers at k = 1, 4, 8,
 * on every fixture and the demo model, each request's tokens equal plain decoding's alone through
 * duet_generate_run (same prefill chunks), token for token. Exact output alone would not notice
 * a drafter that rolls back wrongly (the target still decides), so every proposal of both draft
 * models is checked against the draft model's own greedy continuation of the request's history,
 * computed on a second instance without speculation (check_drafts: its argmax, or within TIE_TOL
 * = 1e-3 of its max logit where other prefill chunks may flip a near tie; we see every draft
 * exactly the argmax). With truncate's state restore removed, this check fails.
 *
 * Sampling keeps the target's distribution (the demo model, STAT_PROMPT): the joint distribution
 * of the first three generated tokens (t1 from the prefill's logits, t2 and t3 from a verify of
 * up to two drafts and what follows it) over STAT_DRAWS = 2000 seeded draws per method, each
 * decoding a copy of one prefilled prompt, is compared with the exact distribution plain
 * decoding gives: p(t1) p(t2 | t1) p(t3 | t1, t2), every factor duet_sampler_probs of plain
 * one-token decode steps' logits (test_engine_accept checks it is what duet_sampler_sample draws
 * from), under temperature 1 and top-k 4 so the support is at most 4^3 = 64 cells. The draws run
 * 100 to a batch (batch_run); the first 10 of each method are drawn again one by one through
 * duet_generate_decode, the CLI's loop, and must be the same tokens. Pearson's chi-square over
 * the cells, those expected below 5 pooled into one group; df = groups - 1 (8 on this prompt at
 * 2000 draws: p-value below 1e-5 means chi-square above 37.33); the p-value from the regularised
 * incomplete gamma function (checked against closed forms and a table). A draw outside the
 * support fails outright. Significance level STAT_ALPHA = 1e-5 per comparison; three comparisons
 * (plain sampling through the same loop as the control, ngram k = 2, the draft model k = 2), so a
 * correct implementation fails with probability below 3e-5 (to the chi-square approximation);
 * the seeds are fixed, so a run repeats itself. The test has power: with the rule swapped
 * (duet_spec_set_accept_rule) for one that draws a rejected draft's replacement from p instead of
 * max(0, p - q) (ngram and draft model), and for one keeping a draft model's draft with
 * probability min(1, q / p), the same draws must give a p-value below STAT_ALPHA.
 */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "engine/generate.h"
#include "engine/model.h"
#include "engine/sampler.h"
#include "engine/spec.h"

#include "golden_fixtures.h"
#include "spec_test_util.h"

#define MAX_NEW    48 /* tokens per greedy run */
#define N_PROMPTS  3
#define MAX_CASES  (MAX_FIXTURES + 1)
#define SPEC_ROWS  (DUET_SPEC_MAX_K + 1)
#define DEMO_BOS   256
#define STAT_TOPK  4
#define STAT_TEMP  1.0f
#define STAT_MAX   4 /* tokens per draw: room for a first verify of two drafts */
#define STAT_DRAWS 2000
#define STAT_BATCH 100 /* draws per batch */
#define STAT_TIE   10  /* draws also drawn alone through duet_generate_decode */
#define STAT_ALPHA 1e-5

static const int ks[] = {1, 2, 4, 7, 8};
#define N_KS ((int)(sizeof(ks) / sizeof(ks[0])))

/* A model, its prompts and its draft model. */
typedef struct {
    char dir[2048], name[256];
    int32_t *prompt[N_PROMPTS];
    int64_t n_prompt[N_PROMPTS];
    int32_t golden[64]; /* greedy_ids of prompt[0] (fixtures) */
    int64_t n_golden;
    char draft[2048];  /* the draft model's folder */
    int draft_cut;     /* 1: a cut in /tmp, removed at the end */
    char kdraft[2048]; /* a drafter with KDA layers cut from the model (kda_mla_make); "" when
                          the model lacks a KDA or an MLA layer */
} gcase_t;

/* The drafters the greedy tests run: prompt lookup, the case's draft model (MLA-only), and its
 * drafter with KDA layers (rolled back by restoring a saved state). */
#define N_DRAFTERS 3
static const char *const drafter_names[N_DRAFTERS] = {"ngram", "draft", "draft-kda"};

static duet_spec_method_t drafter_method(int v)
{
    return v == 0 ? DUET_SPEC_NGRAM : DUET_SPEC_DRAFT;
}

/* Whether drafter v runs at ks[ki]: the drafter with KDA layers runs each k in one of the two
 * greedy tests (single requests: k = 2, 7; the batch: k = 1, 4, 8), which keeps the file's wall
 * time near what it was; the others run every k in both. */
static int drafter_runs_k(int v, int ki, int batched)
{
    if (v < 2)
        return 1;
    const int k = ks[ki];
    return batched ? k == 1 || k == 4 || k == 8 : k == 2 || k == 7;
}

/* The drafter's folder; NULL when the case has none of that kind. */
static const char *drafter_dir(const gcase_t *c, int v)
{
    return v < 2 ? c->draft : c->kdraft[0] != '\0' ? c->kdraft : NULL;
}

static int32_t *bytes_prompt(const char *text, int64_t *n_p)
{
    const int64_t n = 1 + (int64_t)strlen(text);
    int32_t *p = malloc(sizeof(int32_t) * (size_t)n);
    p[0] = DEMO_BOS;
    for (int64_t i = 1; i < n; i++)
        p[i] = (unsigned char)text[i - 1];
    *n_p = n;
    return p;
}

static int32_t *copy_ids(const int32_t *src, int64_t n)
{
    int32_t *p = malloc(sizeof(int32_t) * (size_t)n);
    memcpy(p, src, sizeof(int32_t) * (size_t)n);
    return p;
}

/* The first GSM8K question of data/prompts (byte-level for the demo model). */
static char *gsm8k_question(void)
{
    char path[2048];
    snprintf(path, sizeof(path), "%s/data/prompts/gsm8k-test.jsonl", DUET_SOURCE_DIR);
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "cannot open %s", path);
    char line[8192];
    cr_assert_not_null(fgets(line, sizeof(line), f));
    fclose(f);
    json_error_t jerr;
    json_t *o = json_loads(line, 0, &jerr);
    cr_assert_not_null(o, "%s: %s", path, jerr.text);
    char *q = strdup(json_string_value(json_object_get(o, "question")));
    json_decref(o);
    return q;
}

#define DEMO_REPEAT                                                                                \
    "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat"

static void demo_draft(char *dir, size_t cap, int *cut)
{
    char path[2048];
    struct stat sb;
    snprintf(path, sizeof(path), "%s/models/duet-demo-draft/config.json", DUET_SOURCE_DIR);
    if (stat(path, &sb) == 0) {
        snprintf(dir, cap, "%s/models/duet-demo-draft", DUET_SOURCE_DIR);
        *cut = 0;
        return;
    }
    char src[2048];
    snprintf(src, sizeof(src), "%s/models/duet-demo", DUET_SOURCE_DIR);
    mla_only_make(src, dir, cap);
    *cut = 1;
}

/* Every golden fixture, then the demo model. */
static int load_cases(gcase_t *cs)
{
    fixture_t *fx = calloc(MAX_FIXTURES, sizeof(*fx));
    cr_assert_not_null(fx);
    const int n = load_fixtures(fx, MAX_FIXTURES);
    cr_assert_geq(n, 7, "expected the 7 committed fixtures, found %d", n);
    for (int i = 0; i < n; i++) {
        gcase_t *c = &cs[i];
        memset(c, 0, sizeof(*c));
        snprintf(c->dir, sizeof(c->dir), "%.2000s", fx[i].dir);
        snprintf(c->name, sizeof(c->name), "%.200s", fx[i].name);
        const int64_t P = fx[i].n_prompt;
        cr_assert_geq(P, 5, "%s: a prompt of %lld tokens", c->name, (long long)P);
        c->prompt[0] = copy_ids(fx[i].prompt, P);
        c->n_prompt[0] = P;
        /* its first five tokens four times, then two more: prompt lookup finds them */
        c->n_prompt[1] = 22;
        c->prompt[1] = malloc(sizeof(int32_t) * 22);
        for (int64_t t = 0; t < 22; t++)
            c->prompt[1][t] = fx[i].prompt[t % 5];
        c->prompt[2] = copy_ids(fx[i].prompt, 2);
        c->n_prompt[2] = 2;
        memcpy(c->golden, fx[i].greedy, sizeof(c->golden));
        c->n_golden = fx[i].n_greedy;
        mla_only_make(c->dir, c->draft, sizeof(c->draft));
        c->draft_cut = 1;
        if (!kda_mla_make(c->dir, c->kdraft, sizeof(c->kdraft)))
            c->kdraft[0] = '\0';
    }
    free_fixtures(fx, n);
    free(fx);
    gcase_t *d = &cs[n];
    memset(d, 0, sizeof(*d));
    snprintf(d->dir, sizeof(d->dir), "%s/models/duet-demo", DUET_SOURCE_DIR);
    snprintf(d->name, sizeof(d->name), "duet-demo");
    d->prompt[0] = bytes_prompt("The LORD said unto Moses, ", &d->n_prompt[0]);
    d->prompt[1] = bytes_prompt(DEMO_REPEAT, &d->n_prompt[1]);
    char *q = gsm8k_question();
    d->prompt[2] = bytes_prompt(q, &d->n_prompt[2]);
    free(q);
    demo_draft(d->draft, sizeof(d->draft), &d->draft_cut);
    cr_assert(kda_mla_make(d->dir, d->kdraft, sizeof(d->kdraft)), "the demo model has both kinds");
    return n + 1;
}

static void free_cases(gcase_t *cs, int n)
{
    for (int i = 0; i < n; i++) {
        for (int p = 0; p < N_PROMPTS; p++)
            free(cs[i].prompt[p]);
        if (cs[i].draft_cut)
            mla_only_remove(cs[i].draft);
        if (cs[i].kdraft[0] != '\0')
            mla_only_remove(cs[i].kdraft);
    }
}

/* The target as duet-generate loads it (one sequence), with a page size verify rows cross. */
static duet_model_t *load_target(const char *dir, int64_t spec_rows, int64_t max_seqs,
                                 int64_t max_seq_len, int n_threads)
{
    duet_model_opts_t opts;
    duet_model_opts_default(&opts);
    opts.n_threads = n_threads;
    opts.max_seqs = max_seqs;
    opts.max_seq_len = max_seq_len;
    opts.page_tokens = 16;
    opts.spec_rows = spec_rows;
    opts.device = DUET_DEVICE_CPU;
    duet_model_t *m = NULL;
    cr_assert_eq(duet_model_load(dir, &opts, &m), DUET_OK, "%s: %s", dir, duet_error_last());
    return m;
}

static duet_spec_t *make_spec(duet_model_t *target, duet_spec_method_t method, int k,
                              const char *draft)
{
    duet_spec_opts_t so;
    duet_spec_opts_default(&so);
    so.method = method;
    so.k = k;
    so.draft_model = draft;
    duet_spec_t *sp = NULL;
    cr_assert_eq(duet_spec_create(&so, target, &sp), DUET_OK, "%s", duet_error_last());
    return sp;
}

/* One greedy run of duet-generate's loop. */
static void run_greedy(duet_model_t *m, const int32_t *prompt, int64_t n_prompt, int64_t max_new,
                       duet_spec_t *sp, const uint32_t *stop, size_t n_stop, int ignore_eos,
                       int32_t *out, duet_generate_result_t *r)
{
    duet_generate_opts_t o;
    duet_generate_opts_default(&o);
    o.max_tokens = max_new;
    o.spec = sp;
    o.stop_ids = stop;
    o.n_stop = n_stop;
    o.ignore_eos = ignore_eos;
    memset(r, 0, sizeof(*r));
    r->tokens = out;
    cr_assert_eq(duet_generate_run(m, prompt, n_prompt, &o, r), DUET_OK, "%s", duet_error_last());
}

/* What every run's counters must satisfy; k = 0 for plain decoding. */
static void check_counters(const duet_generate_result_t *r, int k, const char *what)
{
    cr_assert_leq(r->accepted_tokens, r->draft_tokens, "%s: kept %llu of %llu drafts", what,
                  (unsigned long long)r->accepted_tokens, (unsigned long long)r->draft_tokens);
    cr_assert_leq(r->draft_tokens, (uint64_t)k * r->verify_steps,
                  "%s: %llu drafts in %llu verify steps of k = %d", what,
                  (unsigned long long)r->draft_tokens, (unsigned long long)r->verify_steps, k);
    cr_assert_leq(r->verify_steps, (uint64_t)r->steps, "%s: more verify steps than steps", what);
    cr_assert(r->verify_steps == 0 || r->draft_tokens >= r->verify_steps,
              "%s: a verify step without a draft", what);
    if (r->n_tokens == 0)
        cr_assert(r->steps == 0 && r->draft_tokens == 0, "%s: steps without a token", what);
    else if (r->stopped)
        cr_assert_leq(r->n_tokens, 1 + r->steps + (int64_t)r->accepted_tokens,
                      "%s: %lld tokens from %lld steps and %llu kept drafts", what,
                      (long long)r->n_tokens, (long long)r->steps,
                      (unsigned long long)r->accepted_tokens);
    else
        cr_assert_eq(r->n_tokens, 1 + r->steps + (int64_t)r->accepted_tokens,
                     "%s: %lld tokens from %lld steps and %llu kept drafts", what,
                     (long long)r->n_tokens, (long long)r->steps,
                     (unsigned long long)r->accepted_tokens);
    if (k == 0)
        cr_assert(r->draft_tokens == 0 && r->verify_steps == 0, "%s: plain decoding drafted", what);
}

static const char *const method_names[] = {"none", "ngram", "draft"};

Test(engine_generate, greedy_speculation_equals_plain_decoding, .timeout = 600)
{
    gcase_t cs[MAX_CASES];
    const int n = load_cases(cs);
    int32_t ref[MAX_NEW], got[MAX_NEW];
    uint64_t all_kept[N_DRAFTERS] = {0};
    int n_kda = 0;
    for (int c = 0; c < n; c++) {
        int64_t longest = 0;
        for (int p = 0; p < N_PROMPTS; p++)
            longest = cs[c].n_prompt[p] > longest ? cs[c].n_prompt[p] : longest;
        duet_model_t *plain = load_target(cs[c].dir, 0, 1, longest + MAX_NEW, 2);
        duet_model_t *m = load_target(cs[c].dir, SPEC_ROWS, 1, longest + MAX_NEW, 2);
        uint64_t drafted[N_DRAFTERS] = {0}, kept[N_DRAFTERS] = {0}, steps[N_DRAFTERS] = {0},
                 plain_steps = 0;
        n_kda += drafter_dir(&cs[c], 2) != NULL;
        for (int p = 0; p < N_PROMPTS; p++) {
            const int32_t *prompt = cs[c].prompt[p];
            const int64_t P = cs[c].n_prompt[p];
            duet_generate_result_t r;
            char what[512];
            run_greedy(plain, prompt, P, MAX_NEW, NULL, NULL, 0, 0, ref, &r);
            snprintf(what, sizeof(what), "%s prompt %d plain", cs[c].name, p);
            cr_assert(r.n_tokens == MAX_NEW && !r.stopped, "%s: %lld tokens", what,
                      (long long)r.n_tokens);
            check_counters(&r, 0, what);
            cr_assert_eq(r.steps, MAX_NEW - 1, "%s", what);
            plain_steps += (uint64_t)r.steps;
            if (p == 0 && cs[c].n_golden > 0) {
                const int64_t g = cs[c].n_golden < MAX_NEW ? cs[c].n_golden : MAX_NEW;
                for (int64_t t = 0; t < g; t++)
                    cr_assert_eq(ref[t], cs[c].golden[t],
                                 "%s: token %lld is %d, transformers' greedy_ids say %d", what,
                                 (long long)t, ref[t], cs[c].golden[t]);
            }
            /* the target loaded for speculation decodes plainly as the plain one does */
            run_greedy(m, prompt, P, MAX_NEW, NULL, NULL, 0, 0, got, &r);
            cr_assert(memcmp(got, ref, sizeof(ref)) == 0,
                      "%s prompt %d: plain decoding on the model loaded with spec_rows differs",
                      cs[c].name, p);
            for (int v = 0; v < N_DRAFTERS; v++)
                for (int ki = 0; ki < N_KS && drafter_dir(&cs[c], v) != NULL; ki++) {
                    if (!drafter_runs_k(v, ki, 0))
                        continue;
                    const duet_spec_method_t meth = drafter_method(v);
                    duet_spec_t *sp = make_spec(m, meth, ks[ki], drafter_dir(&cs[c], v));
                    run_greedy(m, prompt, P, MAX_NEW, sp, NULL, 0, 0, got, &r);
                    snprintf(what, sizeof(what), "%s prompt %d %s k=%d", cs[c].name, p,
                             drafter_names[v], ks[ki]);
                    cr_assert(r.n_tokens == MAX_NEW && !r.stopped, "%s: %lld tokens", what,
                              (long long)r.n_tokens);
                    for (int64_t t = 0; t < MAX_NEW; t++)
                        cr_assert_eq(got[t], ref[t], "%s: token %lld is %d, plain decoding's is %d",
                                     what, (long long)t, got[t], ref[t]);
                    check_counters(&r, ks[ki], what);
                    /* the drafter always drafts, but at the end and while it catches up on a
                     * prompt longer than DUET_SPEC_CATCHUP_ROWS (by that many rows a step, each
                     * plain step adding its token) */
                    if (meth == DUET_SPEC_DRAFT) {
                        const int64_t lag0 = P + 1, C = DUET_SPEC_CATCHUP_ROWS;
                        const int64_t catch_up = lag0 > C ? (lag0 - C + C - 2) / (C - 1) : 0;
                        cr_assert_leq(r.steps - (int64_t)r.verify_steps, 1 + catch_up, "%s", what);
                    }
                    drafted[v] += r.draft_tokens;
                    kept[v] += r.accepted_tokens;
                    steps[v] += (uint64_t)r.steps;
                    duet_spec_destroy(sp);
                }
        }
        for (int v = 0; v < N_DRAFTERS && drafter_dir(&cs[c], v) != NULL; v++) {
            printf("generate %-30s %-9s k=%s x %d prompts: %5llu drafted, %5llu kept "
                   "(%4.1f%%), %5llu steps (plain: %llu each k): tokens equal plain decoding's\n",
                   cs[c].name, drafter_names[v], v < 2 ? "1,2,4,7,8" : "2,7      ", N_PROMPTS,
                   (unsigned long long)drafted[v], (unsigned long long)kept[v],
                   drafted[v] ? 100.0 * (double)kept[v] / (double)drafted[v] : 0.0,
                   (unsigned long long)steps[v], (unsigned long long)plain_steps);
            all_kept[v] += kept[v];
            /* a draft model agrees with its own target part of the time on every case */
            if (v > 0)
                cr_expect_gt(kept[v], 0, "%s %s: no draft was kept", cs[c].name, drafter_names[v]);
        }
        duet_model_free(m);
        duet_model_free(plain);
    }
    /* kept drafts were tested, not only rejected ones (prompt lookup keeps none on some random
     * fixtures, whose greedy text never repeats the prompt) */
    for (int v = 0; v < N_DRAFTERS; v++)
        cr_expect_gt(all_kept[v], 0, "%s: no draft was kept on any case", drafter_names[v]);
    cr_assert_geq(n_kda, 2, "a drafter with KDA layers ran on the fixtures and the demo model");
    free_cases(cs, n);
}

/* ---- a batch of requests, as a continuous-batching worker serves them ---------------------- */

/*
 * One request of batch_run. The caller sets the fields above `seq`; a request that starts
 * prefilled (pre != NULL) decodes a copy of `pre` (prompt prefilled, last row's logits in
 * pre_logits) from the first forward.
 */
typedef struct {
    const int32_t *prompt;
    int64_t n_prompt, max_tokens;
    uint64_t seed;
    int64_t start; /* the forward it joins at */
    int no_spec;   /* 1: never drafted for (plain one-row steps among the verify items) */
    const duet_seq_t *pre;
    const float *pre_logits;
    int32_t *out; /* max_tokens */
    /* the run's */
    duet_seq_t seq;
    duet_spec_seq_t ss;
    duet_seq_t rseq; /* bstats_t.dref's sequence (check_drafts) */
    duet_rng_t rng;
    int64_t n_pre, n_out;
    int open, done;
    float *logits;
    uint64_t drafted, kept;
} breq_t;

typedef struct {
    int64_t forwards, mixed; /* forwards; of which carried a verify item, a plain decode row and
                                a prefill chunk at once */
    duet_model_t *dref;      /* set by the caller: the greedy draft model again, loaded alone:
                                every proposal is checked against its greedy continuation of the
                                request's history (check_drafts) */
    int64_t checked, exact;  /* drafts checked; of which its exact argmax */
} bstats_t;

#define TIE_TOL 1e-3f /* a draft off the reference's argmax must be this close to its max logit */

/*
 * A greedy drafter's proposal after ss's history must be its own greedy continuation: dref (the
 * same checkpoint, loaded alone) holds the history in *rs (advanced here by the tokens it lacks,
 * as one chunk); a copy of it (clone_seq: the pools copied, not the engine's state save) runs
 * the proposed drafts one per step. Each draft must be the argmax of its row, or within TIE_TOL
 * of the row's max (the drafter's catch-up cut the history into other chunks, whose rounding may
 * flip a near tie). A drafter whose caches after a rollback still held rejected drafts proposes
 * other tokens.
 */
static void check_drafts(duet_model_t *dref, duet_seq_t *rs, const duet_spec_seq_t *ss,
                         bstats_t *bs)
{
    const int64_t V = duet_model_config(dref)->vocab_size;
    float *lg = malloc(sizeof(float) * (size_t)V);
    if (rs->id < 0)
        cr_assert_eq(duet_model_seq_open(dref, ss->cap + DUET_SPEC_MAX_K, rs), DUET_OK, "%s",
                     duet_error_last());
    cr_assert_lt(rs->n_tokens, ss->n_hist);
    duet_batch_item_t it = {.seq = rs,
                            .tokens = ss->hist + rs->n_tokens,
                            .n_tokens = ss->n_hist - rs->n_tokens,
                            .logits_mode = DUET_LOGITS_LAST,
                            .logits = lg};
    cr_assert_eq(duet_model_forward(dref, &it, 1), DUET_OK, "%s", duet_error_last());
    duet_seq_t s;
    clone_seq(dref, rs, ss->cap + DUET_SPEC_MAX_K, &s);
    for (int j = 0; j < ss->k; j++) {
        if (j > 0) {
            it = (duet_batch_item_t){.seq = &s,
                                     .tokens = &ss->drafts[j - 1],
                                     .n_tokens = 1,
                                     .logits_mode = DUET_LOGITS_LAST,
                                     .logits = lg};
            cr_assert_eq(duet_model_forward(dref, &it, 1), DUET_OK, "%s", duet_error_last());
        }
        const int32_t best = duet_argmax(lg, V);
        cr_assert_geq(lg[ss->drafts[j]], lg[best] - TIE_TOL,
                      "draft %d after %lld tokens is %d (logit %g), the draft model's own greedy "
                      "continuation %d (logit %g)",
                      j, (long long)ss->n_hist, ss->drafts[j], (double)lg[ss->drafts[j]], best,
                      (double)lg[best]);
        bs->checked++;
        bs->exact += ss->drafts[j] == best;
    }
    duet_model_seq_close(dref, &s);
    free(lg);
}

/* The request whose speculation ss is. */
static breq_t *who_ss(breq_t *rq, int n, const duet_spec_seq_t *ss)
{
    for (int i = 0; i < n; i++)
        if (&rq[i].ss == ss)
            return &rq[i];
    cr_assert_fail("no request speculates with %p", (const void *)ss);
    return NULL;
}

/* Every request's first token: from its prompt's last row, with its RNG fresh from its seed, as
 * duet_generate_decode draws it; then its speculation starts. */
static void breq_first(duet_model_t *m, duet_spec_t *sp, duet_sampler_t *smp,
                       const duet_sampling_t *sampling, breq_t *q, const float *last)
{
    duet_rng_seed(&q->rng, q->seed);
    q->out[q->n_out++] = duet_sampler_sample(smp, sampling, &q->rng, last);
    (void)m;
    if (q->n_out >= q->max_tokens)
        q->done = 1;
    else if (sp != NULL)
        cr_assert_eq(duet_spec_seq_open(sp, &q->ss, q->prompt, q->n_prompt, q->out[0],
                                        q->max_tokens, sampling, &q->rng),
                     DUET_OK, "%s", duet_error_last());
}

/*
 * Serve n requests (n <= the model's max_seqs) in shared forwards until each has max_tokens
 * tokens: a request joins at its `start` forward and prefills in chunks of `chunk` tokens while
 * the others decode; a decoding request forwards its newest token, with sp the drafts
 * duet_spec_propose made for all decoding requests together (a verify item), and keeps what
 * duet_spec_finish keeps. This is what duet_generate_decode does for one request, interleaved;
 * by the forward's batch invariance each request's tokens are those it gets alone with the same
 * prefill chunks and seed.
 */
static void batch_run(duet_model_t *m, duet_spec_t *sp, const duet_sampling_t *sampling,
                      int64_t chunk, breq_t *rq, int n, bstats_t *bs)
{
    const int64_t V = duet_model_config(m)->vocab_size;
    const int K = sp != NULL ? duet_spec_opts(sp)->k : 0;
    duet_sampler_t *smp = NULL;
    cr_assert_eq(duet_sampler_create(V, &smp), DUET_OK);
    duet_batch_item_t *items = calloc((size_t)n, sizeof(*items));
    breq_t **who = calloc((size_t)n, sizeof(*who));
    duet_spec_seq_t **props = calloc((size_t)n, sizeof(*props));
    int *kcap = calloc((size_t)n, sizeof(*kcap));
    int32_t(*vt)[SPEC_ROWS] = calloc((size_t)n, sizeof(*vt));
    cr_assert(items && who && props && kcap && vt);
    for (int i = 0; i < n; i++) {
        breq_t *q = &rq[i];
        q->ss = (duet_spec_seq_t){.dseq = {.id = -1}};
        q->rseq = (duet_seq_t){.id = -1};
        q->n_out = 0;
        q->done = q->max_tokens == 0;
        q->drafted = q->kept = 0;
        q->logits = malloc(sizeof(float) * (size_t)(V * (K + 1)));
        cr_assert_not_null(q->logits);
        if (q->pre != NULL) {
            clone_seq(m, q->pre, q->n_prompt + q->max_tokens + K, &q->seq);
            q->n_pre = q->n_prompt;
        } else {
            cr_assert_eq(duet_model_seq_open(m, q->n_prompt + q->max_tokens + K, &q->seq), DUET_OK,
                         "%s", duet_error_last());
            q->n_pre = 0;
        }
        q->open = 1;
    }
    int left = n;
    for (int64_t f = 0; left > 0; f++) {
        /* the prefilled requests' first tokens, and the end of the finished */
        for (int i = 0; i < n; i++) {
            breq_t *q = &rq[i];
            if (q->open && !q->done && q->pre != NULL && q->n_out == 0 && f >= q->start)
                breq_first(m, sp, smp, sampling, q, q->pre_logits);
            if (q->open && (q->done || q->n_out >= q->max_tokens)) {
                if (sp != NULL) {
                    q->drafted = q->ss.drafted;
                    q->kept = q->ss.kept;
                    duet_spec_seq_close(sp, &q->ss);
                }
                duet_model_seq_close(m, &q->seq);
                if (bs->dref != NULL)
                    duet_model_seq_close(bs->dref, &q->rseq);
                q->open = 0;
                q->done = 1;
                left--;
            }
        }
        if (left == 0)
            break;
        /* drafts for every decoding request at once */
        int np = 0;
        for (int i = 0; i < n && sp != NULL; i++) {
            breq_t *q = &rq[i];
            if (q->open && q->n_out > 0) {
                const int64_t room = q->max_tokens - q->n_out - 1;
                kcap[np] = q->no_spec ? 0 : (int)(room < K ? room : K);
                props[np++] = &q->ss;
            }
        }
        if (np > 0)
            cr_assert_eq(duet_spec_propose(sp, props, kcap, np), DUET_OK, "%s", duet_error_last());
        for (int j = 0; j < np && bs->dref != NULL; j++)
            if (props[j]->k > 0)
                check_drafts(bs->dref, &who_ss(rq, n, props[j])->rseq, props[j], bs);
        int ni = 0, n_verify = 0, n_plain = 0, n_prefill = 0;
        for (int i = 0; i < n; i++) {
            breq_t *q = &rq[i];
            if (!q->open || f < q->start)
                continue;
            duet_batch_item_t *it = &items[ni];
            if (q->n_out > 0) {
                vt[ni][0] = q->out[q->n_out - 1];
                const int k = sp != NULL ? q->ss.k : 0;
                if (k > 0)
                    memcpy(&vt[ni][1], q->ss.drafts, sizeof(int32_t) * (size_t)k);
                *it = (duet_batch_item_t){.seq = &q->seq,
                                          .tokens = vt[ni],
                                          .n_tokens = k + 1,
                                          .logits_mode = k > 0 ? DUET_LOGITS_ALL : DUET_LOGITS_LAST,
                                          .logits = q->logits,
                                          .verify = k > 0};
                n_verify += k > 0;
                n_plain += k == 0;
            } else if (q->n_pre < q->n_prompt) {
                const int64_t c = q->n_prompt - q->n_pre < chunk ? q->n_prompt - q->n_pre : chunk;
                *it = (duet_batch_item_t){.seq = &q->seq,
                                          .tokens = q->prompt + q->n_pre,
                                          .n_tokens = c,
                                          .logits_mode = q->n_pre + c == q->n_prompt
                                                             ? DUET_LOGITS_LAST
                                                             : DUET_LOGITS_NONE,
                                          .logits = q->logits};
                n_prefill++;
            } else
                continue;
            who[ni++] = q;
        }
        if (ni == 0)
            continue;
        cr_assert_eq(duet_model_forward(m, items, ni), DUET_OK, "forward %lld: %s", (long long)f,
                     duet_error_last());
        bs->forwards++;
        bs->mixed += n_verify > 0 && n_plain > 0 && n_prefill > 0;
        for (int j = 0; j < ni; j++) {
            breq_t *q = who[j];
            if (q->n_out == 0) {
                q->n_pre += items[j].n_tokens;
                if (q->n_pre == q->n_prompt)
                    breq_first(m, sp, smp, sampling, q, q->logits);
                continue;
            }
            int32_t toks[SPEC_ROWS];
            int nt = 0;
            if (sp != NULL)
                cr_assert_eq(duet_spec_finish(sp, &q->ss, &q->seq, q->logits, toks, &nt), DUET_OK,
                             "%s", duet_error_last());
            else
                toks[nt++] = duet_sampler_sample(smp, sampling, &q->rng, q->logits);
            for (int t = 0; t < nt && q->n_out < q->max_tokens; t++)
                q->out[q->n_out++] = toks[t];
        }
    }
    for (int i = 0; i < n; i++)
        free(rq[i].logits);
    free(items);
    free(who);
    free(props);
    free(kcap);
    free(vt);
    duet_sampler_destroy(smp);
}

#define BATCH    4
#define BCHUNK   8 /* prefill tokens per forward in a batch */
#define BMAX_NEW 40

/*
 * Greedy in a batch: four requests of different prompt lengths, the shortest prompt and a cut of
 * 9 tokens joining at forward 0, the middle one at 1, the longest at 3, so that verify items
 * share forwards with prefill chunks and plain rows (the cut one is never drafted for; others
 * get plain rows when the drafter finds nothing or one token is left). Every request's tokens
 * equal plain decoding's alone (duet_generate_run with the same prefill chunks), token for token.
 */
Test(engine_generate, greedy_speculation_in_a_batch_equals_plain_decoding, .timeout = 600)
{
    gcase_t cs[MAX_CASES];
    const int n = load_cases(cs);
    const duet_sampling_t greedy = {.temperature = 0.0f, .top_k = 0, .top_p = 1.0f};
    for (int c = 0; c < n; c++) {
        int64_t longest = 0;
        for (int p = 0; p < N_PROMPTS; p++)
            longest = cs[c].n_prompt[p] > longest ? cs[c].n_prompt[p] : longest;
        duet_model_t *m =
            load_target(cs[c].dir, SPEC_ROWS, BATCH, longest + BMAX_NEW + SPEC_ROWS, 2);
        /* the case's prompts by length, and prompt 1 cut to 9 tokens; different max_tokens so
         * that some end while others still verify */
        int lo = 0, hi = 0;
        for (int p = 1; p < N_PROMPTS; p++) {
            lo = cs[c].n_prompt[p] < cs[c].n_prompt[lo] ? p : lo;
            hi = cs[c].n_prompt[p] > cs[c].n_prompt[hi] ? p : hi;
        }
        const int mid = N_PROMPTS * (N_PROMPTS - 1) / 2 - lo - hi;
        cr_assert(lo != hi && mid != lo && mid != hi && cs[c].n_prompt[hi] > 2 * BCHUNK);
        const int32_t *pr[BATCH] = {cs[c].prompt[lo], cs[c].prompt[1], cs[c].prompt[mid],
                                    cs[c].prompt[hi]};
        const int64_t np[BATCH] = {cs[c].n_prompt[lo], 9, cs[c].n_prompt[mid], cs[c].n_prompt[hi]};
        const int64_t mx[BATCH] = {BMAX_NEW, 17, BMAX_NEW - 3, BMAX_NEW - 7};
        const int64_t start[BATCH] = {0, 0, 1, 3};
        int32_t ref[BATCH][BMAX_NEW], got[BATCH][BMAX_NEW];
        for (int i = 0; i < BATCH; i++) {
            duet_generate_opts_t o;
            duet_generate_opts_default(&o);
            o.max_tokens = mx[i];
            o.prefill_chunk = BCHUNK;
            duet_generate_result_t r = {.tokens = ref[i]};
            cr_assert_eq(duet_generate_run(m, pr[i], np[i], &o, &r), DUET_OK, "%s",
                         duet_error_last());
            cr_assert_eq(r.n_tokens, mx[i]);
        }
        int64_t mixed = 0, checked = 0, exact = 0;
        uint64_t drafted = 0, kept = 0;
        /* v = -1: plain decoding through the same loop */
        for (int v = -1; v < N_DRAFTERS; v++)
            for (int ki = 0; ki < N_KS; ki++) {
                if ((v < 0 && ki > 0) ||
                    (v >= 0 && (drafter_dir(&cs[c], v) == NULL || !drafter_runs_k(v, ki, 1))))
                    continue;
                duet_spec_t *sp =
                    v < 0 ? NULL : make_spec(m, drafter_method(v), ks[ki], drafter_dir(&cs[c], v));
                breq_t rq[BATCH];
                memset(rq, 0, sizeof(rq));
                for (int i = 0; i < BATCH; i++)
                    rq[i] = (breq_t){.prompt = pr[i],
                                     .n_prompt = np[i],
                                     .max_tokens = mx[i],
                                     .start = start[i],
                                     .no_spec = i == 1,
                                     .out = got[i]};
                /* a draft model's proposals against its own greedy continuation (both roll
                 * back: the MLA-only one by truncating, the one with KDA by restoring) */
                bstats_t bs = {0};
                if (v >= 1)
                    bs.dref = load_target(drafter_dir(&cs[c], v), 0, 2 * BATCH,
                                          longest + BMAX_NEW + SPEC_ROWS + DUET_SPEC_MAX_K, 2);
                batch_run(m, sp, &greedy, BCHUNK, rq, BATCH, &bs);
                duet_model_free(bs.dref);
                checked += bs.checked;
                exact += bs.exact;
                for (int i = 0; i < BATCH; i++) {
                    cr_assert_eq(rq[i].n_out, mx[i]);
                    for (int64_t t = 0; t < mx[i]; t++)
                        cr_assert_eq(got[i][t], ref[i][t],
                                     "%s batch %s k=%d request %d (prompt of %lld): token %lld "
                                     "is %d, plain decoding's alone is %d",
                                     cs[c].name, v < 0 ? "none" : drafter_names[v], ks[ki], i,
                                     (long long)np[i], (long long)t, got[i][t], ref[i][t]);
                    drafted += rq[i].drafted;
                    kept += rq[i].kept;
                }
                mixed += bs.mixed;
                duet_spec_destroy(sp);
            }
        printf(
            "generate %-30s batch of %d (prompts of %lld, 9, %lld, %lld tokens), plain / ngram "
            "/ draft k=1,2,4,7,8%s: %llu drafted, %llu kept, %lld forwards with verify + plain + "
            "prefill items: tokens equal plain decoding's alone; the draft models' %lld drafts "
            "their own greedy continuations (%lld exactly its argmax, the rest within %g)\n",
            cs[c].name, BATCH, (long long)np[0], (long long)np[2], (long long)np[3],
            drafter_dir(&cs[c], 2) != NULL ? " / draft-kda k=1,4,8" : "",
            (unsigned long long)drafted, (unsigned long long)kept, (long long)mixed,
            (long long)checked, (long long)exact, (double)TIE_TOL);
        cr_expect_gt(mixed, 0, "%s: no forward mixed verify, plain and prefill items", cs[c].name);
        cr_expect_gt(checked, 0, "%s: no draft checked", cs[c].name);
        cr_expect_gt(kept, 0, "%s: no draft was kept in a batch", cs[c].name);
        duet_model_free(m);
    }
    free_cases(cs, n);
}

/* max_tokens and stop ids on one case: speculation ends where plain decoding ends. */
static int check_cuts(const gcase_t *c)
{
    const int64_t P = c->n_prompt[1], N = MAX_NEW;
    duet_model_t *plain = load_target(c->dir, 0, 1, P + N, 2);
    duet_model_t *m = load_target(c->dir, SPEC_ROWS, 1, P + N, 2);
    int32_t ref[MAX_NEW], got[MAX_NEW];
    duet_generate_result_t r;
    run_greedy(plain, c->prompt[1], P, N, NULL, NULL, 0, 0, ref, &r);
    /* stop ids: tokens at their first occurrence, so plain decoding stops there */
    int64_t at[MAX_NEW];
    int n_at = 0;
    for (int64_t j = 0; j < N; j++) {
        int seen = 0;
        for (int64_t i = 0; i < j; i++)
            seen |= ref[i] == ref[j];
        if (!seen)
            at[n_at++] = j;
    }
    cr_assert_geq(n_at, 3, "%s: too few distinct tokens to stop at", c->name);
    static const struct {
        duet_spec_method_t meth;
        int k;
    } cfgs[] = {{DUET_SPEC_NONE, 0},  {DUET_SPEC_NGRAM, 2}, {DUET_SPEC_NGRAM, 7},
                {DUET_SPEC_DRAFT, 1}, {DUET_SPEC_DRAFT, 4}, {DUET_SPEC_DRAFT, 8}};
    static const int64_t maxes[] = {0, 1, 2, 3, 5, 8, 13, 21, 34};
    int mid_verify = 0, n_runs = 0;
    for (size_t ci = 0; ci < sizeof(cfgs) / sizeof(cfgs[0]); ci++) {
        duet_model_t *tm = cfgs[ci].meth == DUET_SPEC_NONE ? plain : m;
        duet_spec_t *sp = cfgs[ci].meth == DUET_SPEC_NONE
                              ? NULL
                              : make_spec(m, cfgs[ci].meth, cfgs[ci].k, c->draft);
        char what[512];
        for (size_t mi = 0; mi < sizeof(maxes) / sizeof(maxes[0]); mi++) {
            run_greedy(tm, c->prompt[1], P, maxes[mi], sp, NULL, 0, 0, got, &r);
            snprintf(what, sizeof(what), "%s %s k=%d max_tokens %lld", c->name,
                     method_names[cfgs[ci].meth], cfgs[ci].k, (long long)maxes[mi]);
            cr_assert(r.n_tokens == maxes[mi] && !r.stopped, "%s: %lld tokens", what,
                      (long long)r.n_tokens);
            cr_assert(memcmp(got, ref, sizeof(int32_t) * (size_t)maxes[mi]) == 0,
                      "%s: not plain decoding's first tokens", what);
            check_counters(&r, cfgs[ci].k, what);
            n_runs++;
        }
        for (int s = 0; s < n_at; s++) {
            const uint32_t stop[2] = {(uint32_t)ref[at[s]], 0xffffffffu};
            run_greedy(tm, c->prompt[1], P, N, sp, stop, 2, 0, got, &r);
            snprintf(what, sizeof(what), "%s %s k=%d stop id %d (plain decoding's token %lld)",
                     c->name, method_names[cfgs[ci].meth], cfgs[ci].k, ref[at[s]],
                     (long long)at[s]);
            cr_assert(r.stopped && r.n_tokens == at[s] + 1,
                      "%s: %lld tokens, stopped %d, expected %lld tokens ending in the stop id",
                      what, (long long)r.n_tokens, r.stopped, (long long)(at[s] + 1));
            cr_assert(memcmp(got, ref, sizeof(int32_t) * (size_t)r.n_tokens) == 0,
                      "%s: not plain decoding's tokens", what);
            check_counters(&r, cfgs[ci].k, what);
            /* the stop id was a kept draft with more emitted after it in its verify */
            mid_verify += r.n_tokens < 1 + r.steps + (int64_t)r.accepted_tokens;
            /* with ignore_eos it does not stop */
            run_greedy(tm, c->prompt[1], P, N, sp, stop, 2, 1, got, &r);
            cr_assert(!r.stopped && r.n_tokens == N && memcmp(got, ref, sizeof(ref)) == 0,
                      "%s, ignore_eos: not plain decoding's %lld tokens", what, (long long)N);
            n_runs += 2;
        }
        duet_spec_destroy(sp);
    }
    printf("generate %-30s max_tokens in {0..34} and %d stop ids, plain / ngram / draft: %d runs "
           "end where plain decoding ends; %d stops inside a verify's kept drafts\n",
           c->name, n_at, n_runs, mid_verify);
    duet_model_free(m);
    duet_model_free(plain);
    return mid_verify;
}

Test(engine_generate, max_tokens_and_stop_ids_cut_where_plain_decoding_does, .timeout = 300)
{
    gcase_t cs[MAX_CASES];
    const int n = load_cases(cs);
    int mid = 0;
    mid += check_cuts(&cs[0]);     /* a fixture */
    mid += check_cuts(&cs[n - 1]); /* the demo model */
    cr_expect_gt(mid, 0, "no stop id fell inside a verify's kept drafts: that path is untested");
    free_cases(cs, n);
}

/* ---- sampling keeps the target's distribution ------------------------------------------------ */

/*
 * Q(a, x), the regularised upper incomplete gamma function; a chi-square statistic x with df
 * degrees of freedom has the p-value Q(df / 2, x / 2). The power series of P = 1 - Q below
 * x = a + 1, the continued fraction of Q (evaluated by the modified Lentz method) above.
 */
static double gamma_q(double a, double x)
{
    if (x <= 0.0)
        return 1.0;
    const double front = exp(-x + a * log(x) - lgamma(a));
    if (x < a + 1.0) {
        double term = 1.0 / a, sum = term;
        for (int n = 1; n < 10000 && fabs(term) > fabs(sum) * 1e-16; n++) {
            term *= x / (a + n);
            sum += term;
        }
        return 1.0 - front * sum;
    }
    const double tiny = 1e-300;
    double b = x + 1.0 - a, c = 1.0 / tiny, d = 1.0 / b, h = d;
    for (int i = 1; i < 10000; i++) {
        const double an = -(double)i * ((double)i - a);
        b += 2.0;
        d = an * d + b;
        d = fabs(d) < tiny ? tiny : d;
        c = b + an / c;
        c = fabs(c) < tiny ? tiny : c;
        d = 1.0 / d;
        h *= d * c;
        if (fabs(d * c - 1.0) < 1e-16)
            break;
    }
    return front * h;
}

#define STAT_CELLS (STAT_TOPK * STAT_TOPK * STAT_TOPK)

/* t1 is nearly always 'h', and the two letters after it are where prompt lookup ("er", from
 * "there") and the draft model propose, and are kept or rejected often enough (about 40% and 20%
 * kept) for a wrong rule to show */
#define STAT_PROMPT                                                                                \
    "And God said, Let there be light. And God said, Let there be light. And God said, Let t"

/* The demo model with one prefilled prompt, and the exact distribution of (t1, t2, t3). */
typedef struct {
    duet_model_t *m;
    int64_t V, P;
    int32_t *prompt;
    duet_seq_t pre; /* the prompt, prefilled once; every draw decodes a copy */
    float *last;    /* its last row's logits */
    duet_sampling_t sampling;
    char draft[2048];
    int draft_cut;
    int n_cells;
    int32_t cell[STAT_CELLS][3];
    double prob[STAT_CELLS];
} stat_t;

/* One plain one-token decode step of `s`; the row's distribution under st->sampling into probs. */
static void plain_step_probs(stat_t *st, duet_sampler_t *smp, duet_seq_t *s, int32_t tok,
                             float *logits, float *probs)
{
    duet_batch_item_t it = {
        .seq = s, .tokens = &tok, .n_tokens = 1, .logits_mode = DUET_LOGITS_LAST, .logits = logits};
    cr_assert_eq(duet_model_forward(st->m, &it, 1), DUET_OK, "%s", duet_error_last());
    duet_sampler_probs(smp, &st->sampling, logits, probs);
}

static void stat_setup(stat_t *st)
{
    memset(st, 0, sizeof(*st));
    char dir[2048];
    snprintf(dir, sizeof(dir), "%s/models/duet-demo", DUET_SOURCE_DIR);
    st->prompt = bytes_prompt(STAT_PROMPT, &st->P);
    /* the prompt, a batch of draws, and the reference's two copies; verify rows for k = 2 */
    st->m = load_target(dir, 3, STAT_BATCH + 3, st->P + STAT_MAX + SPEC_ROWS, 1);
    st->V = duet_model_config(st->m)->vocab_size;
    st->sampling = (duet_sampling_t){.temperature = STAT_TEMP, .top_k = STAT_TOPK, .top_p = 1.0f};
    demo_draft(st->draft, sizeof(st->draft), &st->draft_cut);
    /* the prefill, as duet-generate runs it */
    duet_generate_opts_t o;
    duet_generate_opts_default(&o);
    st->last = malloc(sizeof(float) * (size_t)st->V);
    cr_assert_eq(duet_model_seq_open(st->m, st->P + STAT_MAX + SPEC_ROWS, &st->pre), DUET_OK);
    cr_assert_eq(duet_generate_prefill(st->m, &st->pre, st->prompt, st->P, &o, st->last), DUET_OK,
                 "%s", duet_error_last());

    /* the exact joint distribution: plain decode steps over every prefix in the support */
    duet_sampler_t *smp = NULL;
    cr_assert_eq(duet_sampler_create(st->V, &smp), DUET_OK);
    float *p1 = malloc(sizeof(float) * (size_t)st->V), *p2 = malloc(sizeof(float) * (size_t)st->V);
    float *p3 = malloc(sizeof(float) * (size_t)st->V), *lg = malloc(sizeof(float) * (size_t)st->V);
    duet_sampler_probs(smp, &st->sampling, st->last, p1);
    double total = 0.0;
    for (int32_t a = 0; a < st->V; a++) {
        if (p1[a] <= 0.0f)
            continue;
        duet_seq_t s1, s2;
        clone_seq(st->m, &st->pre, st->P + STAT_MAX + SPEC_ROWS, &s1);
        plain_step_probs(st, smp, &s1, a, lg, p2);
        for (int32_t b = 0; b < st->V; b++) {
            if (p2[b] <= 0.0f)
                continue;
            clone_seq(st->m, &s1, st->P + STAT_MAX + SPEC_ROWS, &s2);
            plain_step_probs(st, smp, &s2, b, lg, p3);
            for (int32_t c = 0; c < st->V; c++) {
                if (p3[c] <= 0.0f)
                    continue;
                cr_assert_lt(st->n_cells, STAT_CELLS, "more than top-k^3 cells");
                st->cell[st->n_cells][0] = a;
                st->cell[st->n_cells][1] = b;
                st->cell[st->n_cells][2] = c;
                st->prob[st->n_cells] = (double)p1[a] * (double)p2[b] * (double)p3[c];
                total += st->prob[st->n_cells++];
            }
            duet_model_seq_close(st->m, &s2);
        }
        duet_model_seq_close(st->m, &s1);
    }
    cr_assert_float_eq(total, 1.0, 1e-4, "the cells' probabilities sum to %.6f", total);
    free(p1);
    free(p2);
    free(p3);
    free(lg);
    duet_sampler_destroy(smp);
}

static void stat_teardown(stat_t *st)
{
    duet_model_seq_close(st->m, &st->pre);
    duet_model_free(st->m);
    if (st->draft_cut)
        mla_only_remove(st->draft);
    free(st->prompt);
    free(st->last);
}

typedef struct {
    long counts[STAT_CELLS];
    long n, impossible; /* draws; draws outside the support */
    uint64_t drafted, kept, steps;
    double x2, p; /* chi-square and its p-value */
    int df;
} stat_run_t;

/* Tokens of one draw through duet_generate_decode, the CLI's loop, from a copy of the prefilled
 * prompt. */
static void stat_draw_alone(stat_t *st, duet_spec_t *sp, uint64_t seed, int64_t max_tokens,
                            int32_t *toks)
{
    duet_seq_t s;
    clone_seq(st->m, &st->pre, st->P + STAT_MAX + SPEC_ROWS, &s);
    duet_generate_opts_t o;
    duet_generate_opts_default(&o);
    o.sampling = st->sampling;
    o.sampling.seed = seed;
    o.max_tokens = max_tokens;
    o.spec = sp;
    duet_generate_result_t r = {.tokens = toks};
    cr_assert_eq(duet_generate_decode(st->m, &s, st->prompt, st->P, st->last, &o, &r), DUET_OK,
                 "%s", duet_error_last());
    cr_assert_eq(r.n_tokens, max_tokens);
    check_counters(&r, sp != NULL ? duet_spec_opts(sp)->k : 0, "a sampled draw");
    duet_model_seq_close(st->m, &s);
}

/*
 * STAT_DRAWS draws, seeds seed0.., from copies of the prefilled prompt, STAT_BATCH to a batch
 * (batch_run), then the chi-square against the exact cells. The first STAT_TIE draws are also
 * drawn one by one through duet_generate_decode and must be the same tokens: the batch is the
 * CLI's loop, only faster (the forward is batch invariant, each draw has its own RNG).
 */
static void stat_draw(stat_t *st, duet_spec_t *sp, uint64_t seed0, stat_run_t *out)
{
    memset(out, 0, sizeof(*out));
    /* plain: the three tokens; speculating: room for two drafts in the first verify */
    const int64_t max_tokens = sp != NULL ? STAT_MAX : 3;
    static int32_t toks[STAT_BATCH][STAT_MAX];
    breq_t rq[STAT_BATCH];
    for (long i0 = 0; i0 < STAT_DRAWS; i0 += STAT_BATCH) {
        const int nb = STAT_DRAWS - i0 < STAT_BATCH ? (int)(STAT_DRAWS - i0) : STAT_BATCH;
        for (int j = 0; j < nb; j++)
            rq[j] = (breq_t){.prompt = st->prompt,
                             .n_prompt = st->P,
                             .max_tokens = max_tokens,
                             .seed = seed0 + (uint64_t)(i0 + j),
                             .pre = &st->pre,
                             .pre_logits = st->last,
                             .out = toks[j]};
        bstats_t bs = {0};
        batch_run(st->m, sp, &st->sampling, 1, rq, nb, &bs);
        for (int j = 0; j < nb; j++) {
            cr_assert_eq(rq[j].n_out, max_tokens);
            if (i0 + j < STAT_TIE) {
                int32_t alone[STAT_MAX];
                stat_draw_alone(st, sp, rq[j].seed, max_tokens, alone);
                cr_assert(memcmp(alone, toks[j], sizeof(int32_t) * (size_t)max_tokens) == 0,
                          "draw %ld: the batch's tokens differ from duet_generate_decode's",
                          i0 + j);
            }
            out->drafted += rq[j].drafted;
            out->kept += rq[j].kept;
            int found = 0;
            for (int c = 0; c < st->n_cells && !found; c++)
                if (st->cell[c][0] == toks[j][0] && st->cell[c][1] == toks[j][1] &&
                    st->cell[c][2] == toks[j][2]) {
                    out->counts[c]++;
                    found = 1;
                }
            out->impossible += !found;
            out->n++;
        }
        out->steps += (uint64_t)bs.forwards;
    }
    /* Pearson's chi-square; cells expected below 5 pooled into one */
    double x2 = 0.0, pool_e = 0.0;
    long pool_o = 0;
    int groups = 0;
    for (int c = 0; c < st->n_cells; c++) {
        const double e = st->prob[c] * (double)out->n;
        if (e < 5.0) {
            pool_e += e;
            pool_o += out->counts[c];
            continue;
        }
        x2 += ((double)out->counts[c] - e) * ((double)out->counts[c] - e) / e;
        groups++;
    }
    if (pool_e > 0.0) {
        x2 += ((double)pool_o - pool_e) * ((double)pool_o - pool_e) / pool_e;
        groups++;
    }
    out->x2 = x2;
    out->df = groups - 1;
    /* a draw the target cannot give fails outright */
    out->p = out->impossible > 0 ? 0.0 : gamma_q(0.5 * out->df, 0.5 * x2);
}

static void stat_print(const char *what, const stat_run_t *r)
{
    printf("generate sampling %-34s %ld draws: chi-square %.2f, df %d, p = %.3g (alpha %.0e); "
           "%ld outside the support; drafted %llu, kept %llu; %llu batched forwards\n",
           what, r->n, r->x2, r->df, r->p, STAT_ALPHA, r->impossible,
           (unsigned long long)r->drafted, (unsigned long long)r->kept,
           (unsigned long long)r->steps);
}

Test(engine_generate, chi_square_p_values_are_right, .timeout = 10)
{
    /* df 2: the survival function is exp(-x / 2); df 7 at 40.522: 1e-6 (a table's quantile) */
    for (double x = 0.5; x < 60.0; x *= 1.7)
        cr_assert_float_eq(gamma_q(1.0, 0.5 * x), exp(-0.5 * x), 1e-12 * fmax(1.0, exp(-0.5 * x)),
                           "df 2, x %g: %.17g", x, gamma_q(1.0, 0.5 * x));
    const double q7 = gamma_q(3.5, 0.5 * 40.522);
    cr_assert(q7 > 0.99e-6 && q7 < 1.01e-6, "df 7 at 40.522: %.4g", q7);
    /* df 1: p = erfc(sqrt(x / 2)) */
    for (double x = 0.1; x < 50.0; x *= 2.3)
        cr_assert_float_eq(gamma_q(0.5, 0.5 * x), erfc(sqrt(0.5 * x)),
                           1e-10 * fmax(1e-10, erfc(sqrt(0.5 * x))), "df 1, x %g", x);
}

Test(engine_generate, sampling_keeps_the_target_distribution, .timeout = 300)
{
    stat_t st;
    stat_setup(&st);
    printf("generate sampling: duet-demo, repetitive prompt of %lld tokens, temperature %.1f, "
           "top-k %d: %d cells of (t1, t2, t3), exact from plain decode steps\n",
           (long long)st.P, STAT_TEMP, STAT_TOPK, st.n_cells);
    stat_run_t r;
    stat_draw(&st, NULL, 1000000, &r);
    stat_print("plain (the control)", &r);
    cr_expect_geq(r.p, STAT_ALPHA,
                  "plain sampling through the loop is off the exact "
                  "distribution: the test itself is wrong");

    duet_spec_t *sp = make_spec(st.m, DUET_SPEC_NGRAM, 2, NULL);
    stat_draw(&st, sp, 2000000, &r);
    stat_print("ngram k=2", &r);
    cr_expect_geq(r.p, STAT_ALPHA, "ngram: not the target's distribution");
    cr_expect(r.kept > 0 && r.kept < r.drafted,
              "ngram: both kept and rejected drafts wanted "
              "(%llu of %llu kept)",
              (unsigned long long)r.kept, (unsigned long long)r.drafted);
    duet_spec_destroy(sp);

    sp = make_spec(st.m, DUET_SPEC_DRAFT, 2, st.draft);
    stat_draw(&st, sp, 3000000, &r);
    stat_print(st.draft_cut ? "draft k=2 (the demo's MLA layer 3)" : "draft k=2 (duet-demo-draft)",
               &r);
    cr_expect_geq(r.p, STAT_ALPHA, "draft model: not the target's distribution");
    cr_expect(r.kept > 0 && r.kept < r.drafted,
              "draft: both kept and rejected drafts wanted "
              "(%llu of %llu kept)",
              (unsigned long long)r.kept, (unsigned long long)r.drafted);
    duet_spec_destroy(sp);
    stat_teardown(&st);
}

/* Wrong rule 1: a rejected draft's replacement drawn from p itself, not from max(0, p - q). */
static int rule_resample_from_p(duet_sampler_t *s, const duet_sampling_t *p, duet_rng_t *rng,
                                const float *logits, int64_t vocab, const int32_t *drafts, int k,
                                const float *q, float *scratch, int32_t *out)
{
    const int n = duet_spec_accept(s, p, rng, logits, vocab, drafts, k, q, scratch, out);
    if (n <= k) /* drafts[n - 1] was rejected */
        out[n - 1] = duet_sampler_sample(s, p, rng, logits + (int64_t)(n - 1) * vocab);
    return n;
}

/*
 * Wrong rule 2: the draft model's ratio inverted, a draft kept with probability min(1, q / p)
 * (p = 0: kept), the rejected one's replacement from max(0, p - q) as it should be. (Forgetting q,
 * i.e. taking a sampled draft for a point mass, is no wrong rule: for any proposal d, keeping it
 * with probability p(d) and else drawing from p without d gives p.)
 */
static int rule_inverted_ratio(duet_sampler_t *s, const duet_sampling_t *p, duet_rng_t *rng,
                               const float *logits, int64_t vocab, const int32_t *drafts, int k,
                               const float *q, float *scratch, int32_t *out)
{
    cr_assert_not_null(q, "the inverted rule is for the draft model");
    float *pr = scratch, *res = scratch + vocab;
    for (int j = 0; j < k; j++) {
        duet_sampler_probs(s, p, logits + (int64_t)j * vocab, pr);
        const float *qj = q + (int64_t)j * vocab;
        const float pd = pr[drafts[j]], qd = qj[drafts[j]];
        if (pd <= 0.0f || duet_rng_uniform(rng) < qd / pd) {
            out[j] = drafts[j];
            continue;
        }
        double total = 0.0;
        for (int64_t v = 0; v < vocab; v++) {
            res[v] = pr[v] > qj[v] ? pr[v] - qj[v] : 0.0f;
            total += res[v];
        }
        const double u = (double)duet_rng_uniform(rng) * total;
        double acc = 0.0;
        int32_t pick = -1;
        for (int64_t v = 0; v < vocab && pick < 0; v++)
            if (res[v] > 0.0f && (acc += res[v]) > u)
                pick = (int32_t)v;
        for (int64_t v = vocab - 1; v >= 0 && pick < 0; v--) /* rounding: the last nonzero */
            if (res[v] > 0.0f)
                pick = (int32_t)v;
        out[j] = pick;
        return j + 1;
    }
    out[k] = duet_sampler_sample(s, p, rng, logits + (int64_t)k * vocab);
    return k + 1;
}

Test(engine_generate, the_distribution_test_catches_a_wrong_rule, .timeout = 300)
{
    stat_t st;
    stat_setup(&st);
    stat_run_t r;
    duet_spec_t *sp = make_spec(st.m, DUET_SPEC_NGRAM, 2, NULL);
    duet_spec_set_accept_rule(sp, rule_resample_from_p);
    stat_draw(&st, sp, 2000000, &r);
    stat_print("ngram k=2, WRONG: resample from p", &r);
    cr_expect_lt(r.p, STAT_ALPHA, "a rule resampling from p passed (p = %.3g)", r.p);
    duet_spec_destroy(sp);

    sp = make_spec(st.m, DUET_SPEC_DRAFT, 2, st.draft);
    duet_spec_set_accept_rule(sp, rule_inverted_ratio);
    stat_draw(&st, sp, 3000000, &r);
    stat_print("draft k=2, WRONG: min(1, q / p)", &r);
    cr_expect_lt(r.p, STAT_ALPHA, "a rule keeping drafts with min(1, q / p) passed (p = %.3g)",
                 r.p);
    duet_spec_destroy(sp);

    sp = make_spec(st.m, DUET_SPEC_DRAFT, 2, st.draft);
    duet_spec_set_accept_rule(sp, rule_resample_from_p);
    stat_draw(&st, sp, 3000000, &r);
    stat_print("draft k=2, WRONG: resample from p", &r);
    cr_expect_lt(r.p, STAT_ALPHA, "a rule resampling from p passed (p = %.3g)", r.p);
    duet_spec_destroy(sp);
    stat_teardown(&st);
}
