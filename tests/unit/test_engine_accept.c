/*
 * engine/spec: prompt lookup on constructed histories (what it must find, and prefer), greedy
 * acceptance against the target's argmax rows, and speculative sampling's one promise: every token
 * it emits is distributed as the target's p, whatever the drafter's q. That last is checked by
 * simulation against the exact p (duet_sampler_probs of the same rows): a chi-square statistic
 * over 8 tokens (7 degrees of freedom) must stay below 40.52, the 1 - 1e-6 quantile, so a correct
 * rule fails one seed in a million; the seeds are fixed, so the test is repeatable.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "engine/sampler.h"
#include "engine/spec.h"
#define DUET_TEST_RNG_SEED 0x5bec5bec5bec5becull
#include "tests/unit/test_rng.h"

#define CHI2_7DF_1E6 40.522 /* chi-square quantile, 7 degrees of freedom, 1 - 1e-6 */

Test(engine_accept, method_names, .timeout = 5)
{
    duet_spec_method_t m;
    cr_assert_eq(duet_spec_method_parse("draft", &m), DUET_OK);
    cr_assert_eq(m, DUET_SPEC_DRAFT);
    cr_assert_eq(duet_spec_method_parse("ngram", &m), DUET_OK);
    cr_assert_str_eq(duet_spec_method_name(m), "ngram");
    cr_assert_eq(duet_spec_method_parse("eagle", &m), DUET_ERR_INVALID);
    cr_assert(strstr(duet_error_last(), "eagle") != NULL);
    cr_assert_eq(duet_spec_method_parse(NULL, &m), DUET_ERR_INVALID);
}

Test(engine_accept, ngram_finds_the_longest_most_recent_match, .timeout = 5)
{
    int32_t d[8];
    /* ... 1 2 3 [7 8 9] ... 1 2 3 [4 5] ... 2 3: "2 3" matched by n = 2 at its newest place */
    const int32_t h1[] = {1, 2, 3, 7, 8, 9, 1, 2, 3, 4, 5, 6, 2, 3};
    cr_assert_eq(duet_spec_ngram_propose(h1, 14, 1, 3, 4, d), 4);
    cr_assert(d[0] == 4 && d[1] == 5 && d[2] == 6 && d[3] == 2, "%d %d %d %d", d[0], d[1], d[2],
              d[3]);
    /* n = 3 wins over the newer n = 1 match of "3" */
    const int32_t h2[] = {5, 1, 2, 3, 9, 3, 8, 1, 2, 3};
    cr_assert_eq(duet_spec_ngram_propose(h2, 10, 1, 3, 2, d), 2);
    cr_assert(d[0] == 9 && d[1] == 3);
    /* with n_max 1 the newest "3" is taken */
    cr_assert_eq(duet_spec_ngram_propose(h2, 10, 1, 1, 2, d), 2);
    cr_assert(d[0] == 8 && d[1] == 1);
    /* k bounded by what follows the match */
    const int32_t h3[] = {4, 4};
    cr_assert_eq(duet_spec_ngram_propose(h3, 2, 1, 3, 5, d), 1);
    cr_assert_eq(d[0], 4);
    /* no match, too short a history, bad arguments */
    const int32_t h4[] = {1, 2, 3, 4};
    cr_assert_eq(duet_spec_ngram_propose(h4, 4, 1, 3, 4, d), 0);
    cr_assert_eq(duet_spec_ngram_propose(h4, 1, 1, 3, 4, d), 0);
    cr_assert_eq(duet_spec_ngram_propose(h4, 4, 0, 3, 4, d), 0);
    cr_assert_eq(duet_spec_ngram_propose(h4, 4, 2, 1, 4, d), 0);
    cr_assert_eq(duet_spec_ngram_propose(h4, 4, 1, 3, 0, d), 0);
}

/* Rows of logits whose argmax is want[j]. */
static void argmax_rows(float *logits, int64_t V, const int32_t *want, int rows)
{
    for (int j = 0; j < rows; j++)
        for (int64_t i = 0; i < V; i++)
            logits[j * V + i] = i == want[j] ? 3.0f : (float)(i % 3) * 0.1f;
}

Test(engine_accept, greedy_keeps_drafts_while_they_are_the_argmax, .timeout = 5)
{
    const int64_t V = 10;
    duet_sampler_t *s = NULL;
    cr_assert_eq(duet_sampler_create(V, &s), DUET_OK);
    duet_sampling_t p;
    duet_sampling_default(&p);
    duet_rng_t rng;
    duet_rng_seed(&rng, 1);
    float logits[5 * 10], scratch[20];
    int32_t out[5];
    const int32_t target[] = {4, 7, 1, 2, 9};
    argmax_rows(logits, V, target, 5);
    /* all four kept: the target's fifth token follows */
    const int32_t all[] = {4, 7, 1, 2};
    cr_assert_eq(duet_spec_accept(s, &p, &rng, logits, V, all, 4, NULL, scratch, out), 5);
    cr_assert_eq(memcmp(out, target, sizeof(target)), 0);
    /* the second differs: one kept, then the target's own second token */
    const int32_t second[] = {4, 8, 1, 2};
    cr_assert_eq(duet_spec_accept(s, &p, &rng, logits, V, second, 4, NULL, scratch, out), 2);
    cr_assert(out[0] == 4 && out[1] == 7);
    /* none kept; and k = 0 is plain decoding */
    const int32_t none[] = {3, 7, 1, 2};
    cr_assert_eq(duet_spec_accept(s, &p, &rng, logits, V, none, 4, NULL, scratch, out), 1);
    cr_assert_eq(out[0], 4);
    cr_assert_eq(duet_spec_accept(s, &p, &rng, logits, V, none, 0, NULL, scratch, out), 1);
    cr_assert_eq(out[0], 4);
    /* greedy draws nothing from the request's RNG */
    duet_rng_t fresh;
    duet_rng_seed(&fresh, 1);
    cr_assert_eq(memcmp(&rng, &fresh, sizeof(rng)), 0);
    duet_sampler_destroy(s);
}

/* Chi-square of counts[0..V) against probabilities p[0..V) (all p > 0 here). */
static double chi2(const long *counts, const float *p, int64_t V, long n)
{
    double x = 0.0;
    for (int64_t i = 0; i < V; i++) {
        double e = (double)p[i] * (double)n;
        x += ((double)counts[i] - e) * ((double)counts[i] - e) / e;
    }
    return x;
}

/*
 * Speculative sampling keeps the target's distribution: over many trials with random target
 * rows p_0, p_1 and drafts drawn from q (a draft model's distributions, and point masses as
 * the n-gram drafter gives), the first emitted token is distributed as p_0 and the second (when
 * the first draft was kept) as p_1.
 */
static void check_distribution(int point_mass, uint64_t seed)
{
    enum { V = 8, K = 2, N = 200000 };
    duet_sampler_t *s = NULL;
    cr_assert_eq(duet_sampler_create(V, &s), DUET_OK);
    duet_sampling_t p = {.temperature = 0.8f, .top_k = 0, .top_p = 1.0f, .seed = seed};
    float logits[(K + 1) * V], qlogits[K * V], q[K * V], P[(K + 1) * V], scratch[2 * V];
    for (int i = 0; i < (K + 1) * V; i++)
        logits[i] = rng_f() * 2.0f;
    for (int i = 0; i < K * V; i++)
        qlogits[i] = rng_f() * 2.0f;
    for (int j = 0; j <= K; j++)
        duet_sampler_probs(s, &p, logits + j * V, P + j * V);
    for (int j = 0; j < K; j++)
        duet_sampler_probs(s, &p, qlogits + j * V, q + j * V);
    long c0[V] = {0}, c1[V] = {0}, n1 = 0, kept = 0;
    duet_rng_t rng, drng;
    duet_rng_seed(&rng, seed);
    duet_rng_seed(&drng, seed ^ 0x5eedull);
    for (long t = 0; t < N; t++) {
        int32_t drafts[K], out[K + 1];
        for (int j = 0; j < K; j++)
            drafts[j] = point_mass ? (int32_t)((t + j) % V) /* any proposer, as n-gram */
                                   : duet_sampler_sample(s, &p, &drng, qlogits + j * V);
        int n = duet_spec_accept(s, &p, &rng, logits, V, drafts, K, point_mass ? NULL : q, scratch,
                                 out);
        cr_assert(n >= 1 && n <= K + 1);
        c0[out[0]]++;
        if (n >= 2) {
            c1[out[1]]++;
            n1++;
        }
        kept += n - 1;
    }
    double x0 = chi2(c0, P, V, N), x1 = chi2(c1, P + V, V, n1);
    printf("[spec] %s q, seed %llu: %ld trials, %.2f drafts kept per step; chi-square first "
           "token %.2f, second %.2f over %ld (bound %.2f)\n",
           point_mass ? "point-mass" : "draft-model", (unsigned long long)seed, (long)N,
           (double)kept / N, x0, x1, n1, CHI2_7DF_1E6);
    cr_expect_lt(x0, CHI2_7DF_1E6, "first token not distributed as p: chi2 %.2f", x0);
    cr_expect_lt(x1, CHI2_7DF_1E6, "second token not distributed as p: chi2 %.2f", x1);
    cr_assert_gt(n1, N / 20, "too few second tokens to test (%ld)", n1);
    duet_sampler_destroy(s);
}

Test(engine_accept, sampling_keeps_the_target_distribution_draft_model_q, .timeout = 60)
{
    check_distribution(0, 11);
    check_distribution(0, 12);
}

Test(engine_accept, sampling_keeps_the_target_distribution_point_mass_q, .timeout = 60)
{
    check_distribution(1, 21);
    check_distribution(1, 22);
}

/* The check above can fail: a rule that always keeps the draft (ignoring p) is caught. */
Test(engine_accept, the_distribution_check_catches_a_wrong_rule, .timeout = 30)
{
    enum { V = 8, N = 200000 };
    duet_sampler_t *s = NULL;
    cr_assert_eq(duet_sampler_create(V, &s), DUET_OK);
    duet_sampling_t p = {.temperature = 0.8f, .top_p = 1.0f};
    float logits[V], qlogits[V], P[V];
    for (int i = 0; i < V; i++) {
        logits[i] = rng_f() * 2.0f;
        qlogits[i] = rng_f() * 2.0f;
    }
    duet_sampler_probs(s, &p, logits, P);
    duet_rng_t drng;
    duet_rng_seed(&drng, 32);
    long c[V] = {0};
    for (long t = 0; t < N; t++)
        c[duet_sampler_sample(s, &p, &drng, qlogits)]++; /* "always keep" = the draft's q */
    double x = chi2(c, P, V, N);
    cr_assert_gt(x, CHI2_7DF_1E6, "a rule emitting q passed as p (chi2 %.2f)", x);
    duet_sampler_destroy(s);
}

Test(engine_accept, sampler_probs_is_what_sample_draws_from, .timeout = 30)
{
    enum { V = 8, N = 200000 };
    duet_sampler_t *s = NULL;
    cr_assert_eq(duet_sampler_create(V, &s), DUET_OK);
    const duet_sampling_t ps[] = {{.temperature = 1.0f, .top_p = 1.0f},
                                  {.temperature = 0.7f, .top_k = 3, .top_p = 1.0f},
                                  {.temperature = 1.3f, .top_p = 0.6f}};
    float logits[V], P[V];
    for (int i = 0; i < V; i++)
        logits[i] = rng_f() * 2.0f;
    for (size_t c = 0; c < sizeof(ps) / sizeof(ps[0]); c++) {
        duet_sampler_probs(s, &ps[c], logits, P);
        double sum = 0.0;
        long counts[V] = {0}, zero_hits = 0;
        for (int i = 0; i < V; i++)
            sum += P[i];
        cr_assert_float_eq(sum, 1.0, 1e-5);
        duet_rng_t rng;
        duet_rng_seed(&rng, 42 + c);
        for (long t = 0; t < N; t++) {
            int32_t tok = duet_sampler_sample(s, &ps[c], &rng, logits);
            counts[tok]++;
            zero_hits += P[tok] == 0.0f;
        }
        cr_assert_eq(zero_hits, 0, "sampled a token probs gives 0");
        /* chi-square over the tokens with p > 0 (fewer degrees of freedom: a looser bound) */
        double x = 0.0;
        for (int i = 0; i < V; i++)
            if (P[i] > 0.0f) {
                double e = (double)P[i] * N;
                x += ((double)counts[i] - e) * ((double)counts[i] - e) / e;
            }
        cr_assert_lt(x, CHI2_7DF_1E6, "case %zu: chi2 %.2f", c, x);
    }
    /* greedy: one-hot at the argmax */
    duet_sampling_t g;
    duet_sampling_default(&g);
    duet_sampler_probs(s, &g, logits, P);
    cr_assert_eq(P[duet_argmax(logits, V)], 1.0f);
    duet_sampler_destroy(s);
}
