/*
 * Sampler: greedy is argmax; seeded sampling is reproducible; top-k 1 and a tiny top-p are
 * greedy; sampled frequencies follow softmax(logits / T) (checked against the exact
 * probabilities computed here in double, within 5 standard errors); parameters out of range are
 * refused with the parameter named. Logit processing equals the rules written out naively over
 * random logits and histories; logprobs are log_softmax (1e-6) with the top ids in descending
 * order, ties by lower id.
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

/* ---- logit processing and log-probabilities (docs/architecture.md, "Sampling") ---------- */

/* A small deterministic generator for the tests' random logits and histories. */
static uint64_t lp_rand(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return *s >> 33;
}

/*
 * The rules written out naively over dense arrays (what duet_logits_process must equal):
 * repetition (vLLM) over prompt-or-generated ids, then frequency and presence (OpenAI) over the
 * generated counts, then the bias, then min_tokens' -inf on the stop ids.
 */
static void naive_process(float *l, int V, const int *prompt_seen, const int *gen_count,
                          int n_generated, float rep, float freq, float pres,
                          const duet_logit_bias_t *bias, size_t n_bias, int min_tokens,
                          const uint32_t *stop, size_t n_stop)
{
    for (int v = 0; v < V; v++) {
        if (rep != 1.0f && (prompt_seen[v] || gen_count[v] > 0))
            l[v] = l[v] > 0 ? l[v] / rep : l[v] * rep;
        l[v] -= freq * (float)gen_count[v];
        if (gen_count[v] > 0)
            l[v] -= pres;
    }
    for (size_t i = 0; i < n_bias; i++)
        l[bias[i].id] += bias[i].bias;
    if (n_generated < min_tokens)
        for (size_t i = 0; i < n_stop; i++)
            l[stop[i]] = -INFINITY;
}

Test(engine_sampler, processing_equals_the_naive_rules, .timeout = 30)
{
    enum { V = 300 };
    uint64_t seed = 7;
    for (int trial = 0; trial < 200; trial++) {
        float raw[V], got[V], want[V];
        int prompt_seen[V] = {0}, gen_count[V] = {0};
        for (int v = 0; v < V; v++)
            raw[v] = (float)((int)(lp_rand(&seed) % 2001) - 1000) / 100.0f; /* [-10, 10] */
        duet_token_hist_t h = {0};
        if (trial % 2 == 0) /* half the trials reserve room first, as a worker does */
            cr_assert_eq(duet_token_hist_reserve(&h, 64), DUET_OK);
        const int n_prompt = (int)(lp_rand(&seed) % 40), n_gen = (int)(lp_rand(&seed) % 60);
        for (int i = 0; i < n_prompt; i++) {
            int id = (int)(lp_rand(&seed) % V);
            prompt_seen[id] = 1;
            cr_assert_eq(duet_token_hist_add(&h, id, 1), DUET_OK);
        }
        for (int i = 0; i < n_gen; i++) {
            int id = (int)(lp_rand(&seed) % 50); /* repeats */
            gen_count[id]++;
            cr_assert_eq(duet_token_hist_add(&h, id, 0), DUET_OK);
        }
        duet_logit_bias_t bias[3] = {{(int32_t)(lp_rand(&seed) % V), 5.0f},
                                     {(int32_t)(lp_rand(&seed) % V), -100.0f},
                                     {(int32_t)(lp_rand(&seed) % V), 0.5f}};
        const uint32_t stop[2] = {(uint32_t)(lp_rand(&seed) % V), 7};
        duet_logit_proc_t lp;
        duet_logit_proc_default(&lp);
        lp.repetition_penalty = trial % 3 == 0 ? 1.0f : 0.5f + (float)(trial % 7) * 0.25f;
        lp.frequency_penalty = (float)((int)(trial % 5) - 2) * 0.5f;
        lp.presence_penalty = (float)((int)(trial % 9) - 4) * 0.5f;
        lp.bias = bias;
        lp.n_bias = trial % 4 == 0 ? 0 : 3;
        lp.min_tokens = trial % 2 == 0 ? n_gen + 1 : n_gen;
        lp.stop_ids = stop;
        lp.n_stop = 2;
        memcpy(got, raw, sizeof(raw));
        memcpy(want, raw, sizeof(raw));
        duet_logits_process(&lp, &h, n_gen, got, V);
        naive_process(want, V, prompt_seen, gen_count, n_gen, lp.repetition_penalty,
                      lp.frequency_penalty, lp.presence_penalty, bias, lp.n_bias,
                      (int)lp.min_tokens, stop, 2);
        for (int v = 0; v < V; v++)
            cr_assert(got[v] == want[v] || (isinf(got[v]) && isinf(want[v])),
                      "trial %d id %d: %g, naive %g", trial, v, (double)got[v], (double)want[v]);
        cr_expect_eq(duet_logit_proc_active(&lp), 1);
        duet_token_hist_free(&h);
    }
    duet_logit_proc_t off;
    duet_logit_proc_default(&off);
    off.repetition_penalty = 1.0f;
    cr_expect_eq(duet_logit_proc_active(&off), 0, "all off (repetition 1) processes nothing");
    cr_expect_eq(duet_logit_proc_needs_hist(&off), 0);
}

Test(engine_sampler, hist_reserve_means_no_growth, .timeout = 30)
{
    duet_token_hist_t h = {0};
    cr_assert_eq(duet_token_hist_reserve(&h, 500), DUET_OK);
    const duet_token_hist_entry_t *slots = h.slots;
    for (int i = 0; i < 500; i++)
        cr_assert_eq(duet_token_hist_add(&h, i * 7919 % 100003, i % 2), DUET_OK);
    cr_expect_eq(h.slots, slots, "500 distinct ids after reserving 500 reallocated");
    cr_expect_eq(h.used, 500);
    duet_token_hist_free(&h);
}

Test(engine_sampler, logprobs_are_log_softmax_with_ordered_ties, .timeout = 30)
{
    enum { V = 1000 };
    uint64_t seed = 11;
    static float l[V];
    for (int trial = 0; trial < 50; trial++) {
        for (int v = 0; v < V; v++) /* coarse values: many ties */
            l[v] = (float)((int)(lp_rand(&seed) % 41) - 20) / 4.0f;
        double mx = -1e30, sum = 0;
        for (int v = 0; v < V; v++)
            mx = l[v] > mx ? l[v] : mx;
        for (int v = 0; v < V; v++)
            sum += exp((double)l[v] - mx);
        const double lse = mx + log(sum);
        const int32_t chosen = (int32_t)(lp_rand(&seed) % V);
        const int n_top = trial % (DUET_MAX_TOP_LOGPROBS + 1);
        float lp, top_lps[DUET_MAX_TOP_LOGPROBS];
        int32_t top_ids[DUET_MAX_TOP_LOGPROBS];
        duet_logprobs(l, V, chosen, n_top, &lp, top_ids, top_lps);
        cr_expect_float_eq(lp, (float)(l[chosen] - lse), 1e-6, "trial %d", trial);
        /* the naive top list: a stable sort by logit, descending (ties: lower id first) */
        int order[V];
        for (int v = 0; v < V; v++)
            order[v] = v;
        for (int i = 1; i < V; i++) /* insertion sort: stable */
            for (int j = i; j > 0 && l[order[j]] > l[order[j - 1]]; j--) {
                int t = order[j];
                order[j] = order[j - 1];
                order[j - 1] = t;
            }
        for (int k = 0; k < n_top; k++) {
            cr_assert_eq(top_ids[k], order[k], "trial %d rank %d: id %d, want %d", trial, k,
                         top_ids[k], order[k]);
            cr_expect_float_eq(top_lps[k], (float)(l[order[k]] - lse), 1e-6);
        }
    }
}
