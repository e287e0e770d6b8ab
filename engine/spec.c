/* spec.c: see spec.h. */
#include "engine/spec.h"

#include <string.h>

static const char *const duet__spec_names[] = {"none", "ngram", "draft"};

duet_status_t duet_spec_method_parse(const char *s, duet_spec_method_t *m_p)
{
    for (int i = 0; i < 3; i++)
        if (s != NULL && strcmp(s, duet__spec_names[i]) == 0) {
            *m_p = (duet_spec_method_t)i;
            return DUET_OK;
        }
    return duet_error_set(DUET_ERR_INVALID, "spec.method: \"%s\" is not none, ngram or draft",
                          s != NULL ? s : "(null)");
}

const char *duet_spec_method_name(duet_spec_method_t m)
{
    return (int)m >= 0 && (int)m < 3 ? duet__spec_names[m] : "?";
}

int duet_spec_ngram_propose(const int32_t *hist, int64_t n_hist, int n_min, int n_max, int k,
                            int32_t *drafts)
{
    if (n_min < 1 || n_max < n_min || k < 1)
        return 0;
    for (int n = n_max; n >= n_min; n--) {
        if ((int64_t)n >= n_hist)
            continue;
        const int32_t *pat = hist + n_hist - n;
        /* the most recent earlier occurrence: its start i < n_hist - n, newest first */
        for (int64_t i = n_hist - n - 1; i >= 0; i--) {
            if (memcmp(hist + i, pat, sizeof(*pat) * (size_t)n) != 0)
                continue;
            int64_t avail = n_hist - (i + n);
            int m = avail < k ? (int)avail : k;
            memcpy(drafts, hist + i + n, sizeof(*drafts) * (size_t)m);
            return m;
        }
    }
    return 0;
}

/* A token drawn from the weights w[0..V) (summing to `sum` > 0) with the uniform u in [0, 1). */
static int32_t duet__draw(const float *w, int64_t V, double sum, float u)
{
    const double target = (double)u * sum;
    double acc = 0.0;
    int64_t last = 0;
    for (int64_t i = 0; i < V; i++) {
        if (w[i] <= 0.0f)
            continue;
        acc += w[i];
        last = i;
        if (target < acc)
            return (int32_t)i;
    }
    return (int32_t)last;
}

int duet_spec_accept(duet_sampler_t *s, const duet_sampling_t *p, duet_rng_t *rng,
                     const float *logits, int64_t vocab, const int32_t *drafts, int k,
                     const float *q, float *scratch, int32_t *out)
{
    const int greedy = p->temperature <= 0.0f || p->top_k == 1;
    float *P = scratch, *R = scratch + vocab;
    int n = 0;
    for (int j = 0; j < k; j++) {
        const float *row = logits + (int64_t)j * vocab;
        const int32_t d = drafts[j];
        if (greedy) {
            const int32_t t = duet_argmax(row, vocab);
            out[n++] = t;
            if (t != d)
                return n;
            continue;
        }
        duet_sampler_probs(s, p, row, P);
        const float *Q = q != NULL ? q + (int64_t)j * vocab : NULL;
        const float qd = Q != NULL ? Q[d] : 1.0f;
        const float u = duet_rng_uniform(rng);
        if (qd > 0.0f && u * qd < P[d]) { /* kept with probability min(1, p(d) / q(d)) */
            out[n++] = d;
            continue;
        }
        /* rejected: the token comes from the normalised max(0, p - q) */
        double sum = 0.0;
        for (int64_t i = 0; i < vocab; i++) {
            const float qi = Q != NULL ? Q[i] : (i == d ? 1.0f : 0.0f);
            R[i] = P[i] > qi ? P[i] - qi : 0.0f;
            sum += R[i];
        }
        const float u2 = duet_rng_uniform(rng);
        out[n++] = sum > 0.0 ? duet__draw(R, vocab, sum, u2) : duet__draw(P, vocab, 1.0, u2);
        return n;
    }
    /* every draft kept: one more token from the last row, as plain decoding draws it */
    const float *row = logits + (int64_t)k * vocab;
    out[n++] = duet_sampler_sample(s, p, rng, row);
    return n;
}
