/*
 * The CPU engine against transformers' KimiLinearForCausalLM (tests/fixtures, made by
 * tools/make_fixtures.py). The reference is transformers computing in fp32 from the stored
 * weights. Tolerances (issue 2): prompt logits relative L2 <= 1e-4 and the 32-token greedy
 * continuation identical, for every fixture and every variant folder of one (the same weights
 * under other names transformers loads, e.g. save-pretrained-bf16/internal). The same fixtures
 * check engine-internal equivalences: prefill + decode == full recompute, chunked prefill ==
 * one-shot prefill, and a mixed batch == each request alone (all <= 1e-4 relative L2, and
 * usually far below).
 */
#include <criterion/criterion.h>
#include <dirent.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model.h"
#include "engine/sampler.h"

#include "golden_fixtures.h"

static duet_model_t *load_dir(const char *dir, const char *name, int64_t batch_tokens)
{
    duet_model_opts_t opts;
    duet_model_opts_default(&opts);
    opts.n_threads = 2;
    opts.max_seqs = 4;
    opts.max_seq_len = 512;
    opts.max_batch_tokens = batch_tokens;
    opts.page_tokens = 16; /* several pages per prompt */
    duet_model_t *m = NULL;
    duet_status_t st = duet_model_load(dir, &opts, &m);
    cr_assert_eq(st, DUET_OK, "%s: load failed: %s", name, duet_error_last());
    return m;
}

static duet_model_t *load_model(const fixture_t *x, int64_t batch_tokens)
{
    return load_dir(x->dir, x->name, batch_tokens);
}

/* Prefill `n` tokens in pieces of `chunk` (LOGITS_ALL), writing (n, V) logits. */
static void prefill(duet_model_t *m, duet_seq_t *seq, const int32_t *toks, int64_t n, int64_t chunk,
                    float *logits, int64_t V)
{
    for (int64_t at = 0; at < n; at += chunk) {
        int64_t len = n - at < chunk ? n - at : chunk;
        duet_batch_item_t item = {.seq = seq,
                                  .tokens = toks + at,
                                  .n_tokens = len,
                                  .logits_mode = DUET_LOGITS_ALL,
                                  .logits = logits + at * V};
        cr_assert_eq(duet_model_forward(m, &item, 1), DUET_OK, "%s", duet_error_last());
    }
}

/*
 * The checkpoint in `dir` (fixture x's folder or one of its variants) against x's transformers
 * goldens: prompt logits rel L2 <= 1e-4 and the greedy continuation identical. The prompt
 * logits are left in *logits_p (malloc'ed) for the caller to compare further or free.
 */
static void check_against_transformers(const fixture_t *x, const char *dir, const char *label,
                                       float **logits_p)
{
    duet_model_t *m = load_dir(dir, label, 512);
    const int64_t V = duet_model_config(m)->vocab_size;
    cr_assert_eq(V, x->vocab);
    duet_seq_t seq;
    cr_assert_eq(duet_model_seq_open(m, x->n_prompt + x->n_greedy, &seq), DUET_OK);
    float *logits = malloc(sizeof(float) * (size_t)(x->n_prompt * V));
    prefill(m, &seq, x->prompt, x->n_prompt, 512, logits, V);
    double err = rel_l2(logits, x->logits, x->n_prompt * V);
    double mad = max_abs_diff(logits, x->logits, x->n_prompt * V);
    double err_bf16 =
        x->logits_bf16 != NULL ? rel_l2(x->logits_bf16, x->logits, x->n_prompt * V) : 0;
    printf("golden %-37s prompt %3lld tokens: vs transformers fp32 rel L2 %.3g, max |diff| %.3g%s",
           label, (long long)x->n_prompt, err, mad, x->logits_bf16 ? "" : "\n");
    if (x->logits_bf16 != NULL)
        printf(" (transformers bf16 vs fp32 = %.3g)\n", err_bf16);
    cr_expect_leq(err, 1e-4, "%s: prompt logits rel L2 %g > 1e-4", label, err);

    /* greedy continuation, decoding one token at a time */
    float *last = malloc(sizeof(float) * (size_t)V);
    memcpy(last, logits + (x->n_prompt - 1) * V, sizeof(float) * (size_t)V);
    int32_t got[64];
    for (int64_t t = 0; t < x->n_greedy; t++) {
        got[t] = duet_argmax(last, V);
        if (t + 1 == x->n_greedy)
            break;
        duet_batch_item_t item = {.seq = &seq,
                                  .tokens = &got[t],
                                  .n_tokens = 1,
                                  .logits_mode = DUET_LOGITS_LAST,
                                  .logits = last};
        cr_assert_eq(duet_model_forward(m, &item, 1), DUET_OK);
    }
    int64_t first_diff = -1;
    for (int64_t t = 0; t < x->n_greedy && first_diff < 0; t++)
        if (got[t] != x->greedy[t])
            first_diff = t;
    cr_expect_eq(first_diff, -1, "%s: greedy continuation differs at step %lld (%d vs %d)", label,
                 (long long)first_diff, first_diff >= 0 ? got[first_diff] : 0,
                 first_diff >= 0 ? x->greedy[first_diff] : 0);
    duet_model_seq_close(m, &seq);
    free(last);
    duet_model_free(m);
    *logits_p = logits;
}

Test(engine_golden, prompt_logits_and_greedy_match_transformers, .timeout = 600)
{
    fixture_t fx[MAX_FIXTURES];
    int n = load_fixtures(fx, MAX_FIXTURES);
    cr_assert_geq(n, 7, "expected the 7 committed fixtures, found %d", n);
    int n_variants = 0;
    for (int i = 0; i < n; i++) {
        fixture_t *x = &fx[i];
        float *logits;
        check_against_transformers(x, x->dir, x->name, &logits);
        /* the same weights under other names: transformers' goldens again, and the very
         * bytes of the main folder's logits (one binding, whatever the names) */
        for (int k = 0; k < x->n_variants; k++, n_variants++) {
            char dir[2200], label[340];
            snprintf(dir, sizeof(dir), "%s/%s", x->dir, x->variants[k]);
            snprintf(label, sizeof(label), "%s/%s", x->name, x->variants[k]);
            float *vl;
            check_against_transformers(x, dir, label, &vl);
            cr_expect(memcmp(vl, logits, sizeof(float) * (size_t)(x->n_prompt * x->vocab)) == 0,
                      "%s: logits differ from %s's", label, x->name);
            free(vl);
        }
        free(logits);
    }
    cr_assert_geq(n_variants, 1, "expected save-pretrained-bf16/internal, found no variant");
    free_fixtures(fx, n);
}

Test(engine_golden, prefill_then_decode_equals_full_recompute, .timeout = 600)
{
    fixture_t fx[MAX_FIXTURES];
    int n = load_fixtures(fx, MAX_FIXTURES);
    cr_assert_geq(n, 1);
    for (int i = 0; i < n; i++) {
        fixture_t *x = &fx[i];
        duet_model_t *m = load_model(x, 512);
        const int64_t V = x->vocab, steps = 12, total = x->n_prompt + steps;
        int32_t *toks = malloc(sizeof(int32_t) * (size_t)total);
        memcpy(toks, x->prompt, sizeof(int32_t) * (size_t)x->n_prompt);
        memcpy(toks + x->n_prompt, x->greedy, sizeof(int32_t) * (size_t)steps);
        float *inc = malloc(sizeof(float) * (size_t)(total * V));
        float *full = malloc(sizeof(float) * (size_t)(total * V));
        duet_seq_t a, b;
        cr_assert_eq(duet_model_seq_open(m, total, &a), DUET_OK);
        prefill(m, &a, toks, x->n_prompt, 512, inc, V);
        for (int64_t t = x->n_prompt; t < total; t++) /* one token per step */
            prefill(m, &a, toks + t, 1, 1, inc + t * V, V);
        cr_assert_eq(duet_model_seq_open(m, total, &b), DUET_OK);
        prefill(m, &b, toks, total, 512, full, V);
        double err = rel_l2(inc + x->n_prompt * V, full + x->n_prompt * V, steps * V);
        printf("recompute %-26s decode-step logits vs full recompute: rel L2 %.3g\n", x->name, err);
        cr_expect_leq(err, 1e-4, "%s: %g", x->name, err);
        duet_model_seq_close(m, &a);
        duet_model_seq_close(m, &b);
        free(inc);
        free(full);
        free(toks);
        duet_model_free(m);
    }
    free_fixtures(fx, n);
}

Test(engine_golden, chunked_prefill_equals_one_shot, .timeout = 600)
{
    fixture_t fx[MAX_FIXTURES];
    int n = load_fixtures(fx, MAX_FIXTURES);
    cr_assert_geq(n, 1);
    for (int i = 0; i < n; i++) {
        fixture_t *x = &fx[i];
        duet_model_t *m = load_model(x, 512);
        const int64_t V = x->vocab;
        float *one = malloc(sizeof(float) * (size_t)(x->n_prompt * V));
        float *chk = malloc(sizeof(float) * (size_t)(x->n_prompt * V));
        duet_seq_t a, b;
        cr_assert_eq(duet_model_seq_open(m, x->n_prompt, &a), DUET_OK);
        prefill(m, &a, x->prompt, x->n_prompt, 512, one, V);
        cr_assert_eq(duet_model_seq_open(m, x->n_prompt, &b), DUET_OK);
        prefill(m, &b, x->prompt, x->n_prompt, 23, chk, V); /* pieces cross pages and chunks */
        double err = rel_l2(chk, one, x->n_prompt * V);
        printf("chunked   %-26s prefill in pieces of 23 vs one shot: rel L2 %.3g\n", x->name, err);
        cr_expect_leq(err, 1e-4, "%s: %g", x->name, err);
        duet_model_seq_close(m, &a);
        duet_model_seq_close(m, &b);
        free(one);
        free(chk);
        duet_model_free(m);
    }
    free_fixtures(fx, n);
}

Test(engine_golden, mixed_batch_equals_each_alone, .timeout = 600)
{
    fixture_t fx[MAX_FIXTURES];
    int n = load_fixtures(fx, MAX_FIXTURES);
    cr_assert_geq(n, 1);
    for (int i = 0; i < n; i++) {
        fixture_t *x = &fx[i];
        duet_model_t *m = load_model(x, 512);
        const int64_t V = x->vocab, P = x->n_prompt;
        /* three requests: A decodes after its prompt, B prefills its second half, C starts */
        const int64_t a_len = P / 2, b_len = P / 3;
        duet_seq_t sa, sb, sc;
        cr_assert_eq(duet_model_seq_open(m, P + 8, &sa), DUET_OK);
        cr_assert_eq(duet_model_seq_open(m, P + 8, &sb), DUET_OK);
        cr_assert_eq(duet_model_seq_open(m, P + 8, &sc), DUET_OK);
        float *scratch = malloc(sizeof(float) * (size_t)(P * V));
        prefill(m, &sa, x->prompt, a_len, 512, scratch, V);
        prefill(m, &sb, x->prompt + 1, b_len, 512, scratch, V);
        /* batched step */
        float *la = malloc(sizeof(float) * (size_t)V);
        float *lb = malloc(sizeof(float) * (size_t)((P - 1 - b_len) * V));
        float *lc = malloc(sizeof(float) * (size_t)V);
        duet_batch_item_t items[3] = {
            {.seq = &sa,
             .tokens = x->prompt + a_len,
             .n_tokens = 1,
             .logits_mode = DUET_LOGITS_LAST,
             .logits = la},
            {.seq = &sb,
             .tokens = x->prompt + 1 + b_len,
             .n_tokens = P - 1 - b_len,
             .logits_mode = DUET_LOGITS_ALL,
             .logits = lb},
            {.seq = &sc,
             .tokens = x->prompt + 2,
             .n_tokens = P - 2,
             .logits_mode = DUET_LOGITS_LAST,
             .logits = lc},
        };
        cr_assert_eq(duet_model_forward(m, items, 3), DUET_OK, "%s", duet_error_last());
        /* the same requests alone */
        duet_seq_t r;
        float *ref = malloc(sizeof(float) * (size_t)(P * V));
        cr_assert_eq(duet_model_seq_open(m, P + 8, &r), DUET_OK);
        prefill(m, &r, x->prompt, a_len + 1, 512, ref, V);
        double ea = rel_l2(la, ref + a_len * V, V);
        duet_model_seq_close(m, &r);
        cr_assert_eq(duet_model_seq_open(m, P + 8, &r), DUET_OK);
        prefill(m, &r, x->prompt + 1, P - 1, 512, ref, V);
        double eb = rel_l2(lb, ref + b_len * V, (P - 1 - b_len) * V);
        duet_model_seq_close(m, &r);
        cr_assert_eq(duet_model_seq_open(m, P + 8, &r), DUET_OK);
        prefill(m, &r, x->prompt + 2, P - 2, 512, ref, V);
        double ec = rel_l2(lc, ref + (P - 3) * V, V);
        duet_model_seq_close(m, &r);
        printf("batch     %-26s decode %.3g, prefill-continue %.3g, fresh prefill %.3g (rel L2)\n",
               x->name, ea, eb, ec);
        cr_expect_leq(ea, 1e-4);
        cr_expect_leq(eb, 1e-4);
        cr_expect_leq(ec, 1e-4);
        duet_model_seq_close(m, &sa);
        duet_model_seq_close(m, &sb);
        duet_model_seq_close(m, &sc);
        free(ref);
        free(la);
        free(lb);
        free(lc);
        free(scratch);
        duet_model_free(m);
    }
    free_fixtures(fx, n);
}

/*
 * Batch invariance, exactly: with the same chunking, each item of a mixed batch (a decode step, a
 * prefill continuation, a fresh prefill) gets bit-identical logits to the same step run alone.
 * This is what lets a cluster's continuous batch reproduce duet-generate token for token.
 */
Test(engine_golden, mixed_batch_bit_identical_to_alone, .timeout = 600)
{
    fixture_t fx[MAX_FIXTURES];
    int n = load_fixtures(fx, MAX_FIXTURES);
    cr_assert_geq(n, 1);
    for (int i = 0; i < n; i++) {
        fixture_t *x = &fx[i];
        duet_model_t *m = load_model(x, 512);
        const int64_t V = x->vocab, P = x->n_prompt;
        const int64_t a_len = P / 2, b_len = P / 3, b_rest = P - 1 - b_len;
        float *scratch = malloc(sizeof(float) * (size_t)(P * V));
        float *got[3], *want[3];
        int64_t rows[3] = {1, b_rest, 1};
        for (int k = 0; k < 3; k++) {
            got[k] = malloc(sizeof(float) * (size_t)(rows[k] * V));
            want[k] = malloc(sizeof(float) * (size_t)(rows[k] * V));
        }
        duet_seq_t s[3];
        for (int pass = 0; pass < 2; pass++) { /* 0: batched, 1: each alone */
            for (int k = 0; k < 3; k++)
                cr_assert_eq(duet_model_seq_open(m, P + 8, &s[k]), DUET_OK);
            prefill(m, &s[0], x->prompt, a_len, 512, scratch, V);
            prefill(m, &s[1], x->prompt + 1, b_len, 512, scratch, V);
            float **out = pass == 0 ? got : want;
            duet_batch_item_t items[3] = {
                {.seq = &s[0],
                 .tokens = x->prompt + a_len,
                 .n_tokens = 1,
                 .logits_mode = DUET_LOGITS_LAST,
                 .logits = out[0]},
                {.seq = &s[1],
                 .tokens = x->prompt + 1 + b_len,
                 .n_tokens = b_rest,
                 .logits_mode = DUET_LOGITS_ALL,
                 .logits = out[1]},
                {.seq = &s[2],
                 .tokens = x->prompt + 2,
                 .n_tokens = P - 2,
                 .logits_mode = DUET_LOGITS_LAST,
                 .logits = out[2]},
            };
            if (pass == 0) {
                cr_assert_eq(duet_model_forward(m, items, 3), DUET_OK, "%s", duet_error_last());
            } else {
                for (int k = 2; k >= 0; k--) /* other order too */
                    cr_assert_eq(duet_model_forward(m, &items[k], 1), DUET_OK, "%s",
                                 duet_error_last());
            }
            for (int k = 0; k < 3; k++)
                duet_model_seq_close(m, &s[k]);
        }
        for (int k = 0; k < 3; k++) {
            cr_expect(memcmp(got[k], want[k], sizeof(float) * (size_t)(rows[k] * V)) == 0,
                      "%s: batch item %d differs from the same step alone", x->name, k);
            free(got[k]);
            free(want[k]);
        }
        free(scratch);
        duet_model_free(m);
    }
    free_fixtures(fx, n);
}

Test(engine_golden, bad_batches_are_refused, .timeout = 120)
{
    fixture_t fx[MAX_FIXTURES];
    int n = load_fixtures(fx, MAX_FIXTURES);
    cr_assert_geq(n, 1);
    duet_model_t *m = load_model(&fx[0], 64);
    duet_seq_t s;
    cr_assert_eq(duet_model_seq_open(m, 100, &s), DUET_OK);
    int32_t toks[128] = {0};
    float *lg = malloc(sizeof(float) * (size_t)fx[0].vocab);
    duet_batch_item_t it = {
        .seq = &s, .tokens = toks, .n_tokens = 65, .logits_mode = DUET_LOGITS_LAST, .logits = lg};
    cr_expect_eq(duet_model_forward(m, &it, 1), DUET_ERR_RANGE, "over max_batch_tokens");
    cr_expect(strstr(duet_error_last(), "max_batch_tokens") != NULL, "%s", duet_error_last());
    toks[3] = (int32_t)fx[0].vocab;
    it.n_tokens = 4;
    cr_expect_eq(duet_model_forward(m, &it, 1), DUET_ERR_RANGE, "token outside the vocabulary");
    cr_expect(strstr(duet_error_last(), "vocabulary") != NULL, "%s", duet_error_last());
    toks[3] = 1;
    duet_batch_item_t two[2] = {it, it};
    cr_expect_eq(duet_model_forward(m, two, 2), DUET_ERR_INVALID, "same sequence twice");
    it.logits = NULL;
    cr_expect_eq(duet_model_forward(m, &it, 1), DUET_ERR_INVALID, "logits without buffer");
    cr_expect_eq(s.n_tokens, 0, "a refused step must not advance the sequence");
    cr_expect_eq(duet_model_seq_open(m, 100000, &s), DUET_ERR_RANGE);
    duet_model_seq_close(m, &s);
    duet_model_free(m);
    free(lg);
    free_fixtures(fx, n);
}
