/*
 * Sampler: greedy is argmax; seeded sampling is reproducible; top-k 1 and a tiny top-p are
 * greedy; sampled frequencies follow softmax(logits / T) (checked against the exact
 * probabilities computed here in double, within 5 standard errors); parameters out of range are
 * refused with the parameter named.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "engine/sampler.h"

static const float logits8[8] = {0.5f, 2.0f, -1.0f, 1.5f, 2.0f, 0.0f, -3.0f, 1.0f};

Test(engine_sampler, greedy_is_first_argmax, .timeout = 30)
{
    duet_sampler_t *s;
    cr_assert_eq(duet_sampler_create(8, &s), DUET_OK);
    duet_sampling_t p;
    duet_sampling_default(&p);
    duet_rng_t rng;
    duet_rng_seed(&rng, 1);
    cr_expect_eq(duet_sampler_sample(s, &p, &rng, logits8), 1); /* tie 1/4: first wins */
    p.temperature = 1.0f;
    p.top_k = 1;
    cr_expect_eq(duet_sampler_sample(s, &p, &rng, logits8), 1);
    p.top_k = 0;
    p.top_p = 1e-6f;
    cr_expect_eq(duet_sampler_sample(s, &p, &rng, logits8), 1);
    duet_sampler_destroy(s);
}

Test(engine_sampler, seeded_runs_repeat, .timeout = 30)
{
    duet_sampler_t *s;
    cr_assert_eq(duet_sampler_create(8, &s), DUET_OK);
    duet_sampling_t p = {.temperature = 0.8f, .top_k = 0, .top_p = 0.95f, .seed = 42};
    int32_t a[200], b[200];
    for (int run = 0; run < 2; run++) {
        duet_rng_t rng;
        duet_rng_seed(&rng, p.seed);
        for (int i = 0; i < 200; i++)
            (run ? b : a)[i] = duet_sampler_sample(s, &p, &rng, logits8);
    }
    cr_expect_arr_eq(a, b, sizeof(a));
    duet_sampler_destroy(s);
}

static void check_distribution(float temp, int64_t top_k, float top_p)
{
    duet_sampler_t *s;
    cr_assert_eq(duet_sampler_create(8, &s), DUET_OK);
    duet_sampling_t p = {.temperature = temp, .top_k = top_k, .top_p = top_p, .seed = 7};
    /* exact distribution: sort, cut top-k, softmax, cut nucleus, renormalise */
    int order[8] = {1, 4, 3, 7, 0, 5, 2, 6}; /* logits8 by value, ties by index */
    int n = top_k > 0 && top_k < 8 ? (int)top_k : 8;
    double w[8], sum = 0;
    for (int i = 0; i < n; i++) {
        w[i] = exp(((double)logits8[order[i]] - 2.0) / temp);
        sum += w[i];
    }
    int keep = n;
    double acc = 0;
    for (int i = 0; i < n; i++) {
        acc += w[i] / sum;
        if (acc >= top_p) {
            keep = i + 1;
            break;
        }
    }
    double ksum = 0;
    for (int i = 0; i < keep; i++)
        ksum += w[i];
    double expect[8] = {0};
    for (int i = 0; i < keep; i++)
        expect[order[i]] = w[i] / ksum;

    const int N = 200000;
    long count[8] = {0};
    duet_rng_t rng;
    duet_rng_seed(&rng, p.seed);
    for (int i = 0; i < N; i++)
        count[duet_sampler_sample(s, &p, &rng, logits8)]++;
    for (int t = 0; t < 8; t++) {
        double f = (double)count[t] / N;
        double se = sqrt(expect[t] * (1 - expect[t]) / N) + 1e-9;
        printf("T=%.1f k=%lld p=%.2f token %d: sampled %.4f expected %.4f\n", (double)temp,
               (long long)top_k, (double)top_p, t, f, expect[t]);
        cr_expect_leq(fabs(f - expect[t]), 5 * se + 1e-4, "token %d: %g vs %g", t, f, expect[t]);
    }
    duet_sampler_destroy(s);
}

Test(engine_sampler, frequencies_follow_softmax, .timeout = 60)
{
    check_distribution(1.0f, 0, 1.0f);
    check_distribution(0.5f, 0, 1.0f);
    check_distribution(1.0f, 3, 1.0f);
    check_distribution(1.0f, 0, 0.8f);
    check_distribution(2.0f, 5, 0.9f);
}

Test(engine_sampler, bad_parameters_are_refused, .timeout = 30)
{
    duet_sampling_t p;
    duet_sampling_default(&p);
    cr_expect_eq(duet_sampling_validate(&p), DUET_OK);
    p.temperature = -1.0f;
    cr_expect_eq(duet_sampling_validate(&p), DUET_ERR_RANGE);
    cr_expect(strstr(duet_error_last(), "temperature") != NULL);
    p.temperature = NAN;
    cr_expect_eq(duet_sampling_validate(&p), DUET_ERR_RANGE);
    duet_sampling_default(&p);
    p.top_p = 0.0f;
    cr_expect_eq(duet_sampling_validate(&p), DUET_ERR_RANGE);
    cr_expect(strstr(duet_error_last(), "top_p") != NULL);
    p.top_p = 1.5f;
    cr_expect_eq(duet_sampling_validate(&p), DUET_ERR_RANGE);
    duet_sampling_default(&p);
    p.top_k = -2;
    cr_expect_eq(duet_sampling_validate(&p), DUET_ERR_RANGE);
    cr_expect(strstr(duet_error_last(), "top_k") != NULL);
    duet_sampler_t *s = NULL;
    cr_expect_eq(duet_sampler_create(0, &s), DUET_ERR_INVALID);
}
