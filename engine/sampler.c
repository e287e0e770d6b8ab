/*
 * Sampling. The candidate set is reduced before anything is sorted: top-k by a partial
 * selection, then the softmax over the survivors, then the nucleus by sorting only those
 * survivors. With top-k unset the whole vocabulary is sorted, which is fine at our vocabulary
 * sizes compared with a forward pass.
 */
#include "engine/sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

struct duet_sampler {
    int64_t vocab;
    float *prob;  /* (vocab) */
    int32_t *idx; /* (vocab) */
};

static inline uint64_t duet__rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

void duet_rng_seed(duet_rng_t *rng, uint64_t seed)
{
    /* splitmix64 to spread the seed over the state */
    for (int i = 0; i < 4; i++) {
        seed += 0x9e3779b97f4a7c15ull;
        uint64_t z = seed;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        rng->s[i] = z ^ (z >> 31);
    }
}

uint64_t duet_rng_next(duet_rng_t *rng)
{
    uint64_t *s = rng->s;
    uint64_t result = duet__rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = duet__rotl(s[3], 45);
    return result;
}

float duet_rng_uniform(duet_rng_t *rng)
{
    return (float)(duet_rng_next(rng) >> 40) * (1.0f / 16777216.0f);
}

void duet_sampling_default(duet_sampling_t *p)
{
    p->temperature = 0.0f;
    p->top_k = 0;
    p->top_p = 1.0f;
    p->seed = 0;
}

duet_status_t duet_sampling_validate(const duet_sampling_t *p)
{
    if (!isfinite(p->temperature) || p->temperature < 0.0f)
        return duet_error_set(DUET_ERR_RANGE, "temperature must be a finite number >= 0, got %g",
                              (double)p->temperature);
    if (p->top_k < 0)
        return duet_error_set(DUET_ERR_RANGE, "top_k must be >= 0, got %lld", (long long)p->top_k);
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
        return duet_error_set(DUET_ERR_RANGE, "top_p must be in (0, 1], got %g", (double)p->top_p);
    return DUET_OK;
}

duet_status_t duet_sampler_create(int64_t vocab, duet_sampler_t **s_p)
{
    if (vocab <= 0)
        return duet_error_set(DUET_ERR_INVALID, "sampler: vocabulary size %lld", (long long)vocab);
    duet_sampler_t *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "sampler: out of memory");
    s->vocab = vocab;
    s->prob = malloc(sizeof(*s->prob) * (size_t)vocab);
    s->idx = malloc(sizeof(*s->idx) * (size_t)vocab);
    if (s->prob == NULL || s->idx == NULL) {
        duet_sampler_destroy(s);
        return duet_error_set(DUET_ERR_NOMEM, "sampler: out of memory");
    }
    *s_p = s;
    return DUET_OK;
}

void duet_sampler_destroy(duet_sampler_t *s)
{
    if (s == NULL)
        return;
    free(s->prob);
    free(s->idx);
    free(s);
}

int32_t duet_argmax(const float *logits, int64_t n)
{
    int64_t best = 0;
    for (int64_t i = 1; i < n; i++)
        if (logits[i] > logits[best])
            best = i;
    return (int32_t)best;
}

/* qsort comparator context: the sampler being sorted (qsort has no context argument). */
static _Thread_local const float *duet__sort_logits;

static int duet__by_logit_desc(const void *a, const void *b)
{
    float la = duet__sort_logits[*(const int32_t *)a], lb = duet__sort_logits[*(const int32_t *)b];
    if (la > lb)
        return -1;
    if (la < lb)
        return 1;
    return *(const int32_t *)a - *(const int32_t *)b;
}

int duet_sampling_greedy(const duet_sampling_t *p)
{
    return p->temperature <= 0.0f || p->top_k == 1;
}

float duet_sampling_draw(const duet_sampling_t *p, duet_rng_t *rng)
{
    if (duet_sampling_greedy(p))
        return 0.0f;
    return duet_rng_uniform(rng);
}

int32_t duet_sampler_sample(duet_sampler_t *s, const duet_sampling_t *p, duet_rng_t *rng,
                            const float *logits)
{
    return duet_sampler_sample_u(s, p, duet_sampling_draw(p, rng), logits);
}

/*
 * The candidates p samples from, most likely first: s->idx[0..n) with unnormalised weights
 * s->prob[0..n) summing to *sum (top-k by partial selection, the softmax at temperature, the
 * nucleus cut). Only for p that samples (temperature > 0, top_k != 1).
 */
static int64_t duet__candidates(duet_sampler_t *s, const duet_sampling_t *p, const float *logits,
                                double *sum_p)
{
    const int64_t V = s->vocab;
    /* candidates sorted by logit, descending; with top_k only the best k are kept */
    int64_t n = V;
    for (int64_t i = 0; i < V; i++)
        s->idx[i] = (int32_t)i;
    duet__sort_logits = logits;
    if (p->top_k > 0 && p->top_k < V) {
        /* partial selection: keep a sorted window of the k best */
        n = p->top_k;
        qsort(s->idx, (size_t)n, sizeof(int32_t), duet__by_logit_desc);
        for (int64_t i = n; i < V; i++) {
            int32_t cand = (int32_t)i;
            if (duet__by_logit_desc(&cand, &s->idx[n - 1]) >= 0)
                continue;
            int64_t j = n - 1;
            while (j > 0 && duet__by_logit_desc(&cand, &s->idx[j - 1]) < 0) {
                s->idx[j] = s->idx[j - 1];
                j--;
            }
            s->idx[j] = cand;
        }
    } else {
        qsort(s->idx, (size_t)n, sizeof(int32_t), duet__by_logit_desc);
    }
    /* softmax over candidates at temperature */
    const float inv_t = 1.0f / p->temperature;
    const float mx = logits[s->idx[0]];
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        s->prob[i] = expf((logits[s->idx[i]] - mx) * inv_t);
        sum += s->prob[i];
    }
    /* nucleus: smallest prefix whose mass reaches top_p */
    if (p->top_p < 1.0f) {
        double acc = 0.0;
        int64_t keep = n;
        for (int64_t i = 0; i < n; i++) {
            acc += s->prob[i] / sum;
            if (acc >= (double)p->top_p) {
                keep = i + 1;
                break;
            }
        }
        n = keep;
        sum = 0.0;
        for (int64_t i = 0; i < n; i++)
            sum += s->prob[i];
    }
    *sum_p = sum;
    return n;
}

int32_t duet_sampler_sample_u(duet_sampler_t *s, const duet_sampling_t *p, float u_draw,
                              const float *logits)
{
    if (duet_sampling_greedy(p))
        return duet_argmax(logits, s->vocab);
    double sum;
    const int64_t n = duet__candidates(s, p, logits, &sum);
    double u = (double)u_draw * sum;
    double acc = 0.0;
    for (int64_t i = 0; i < n; i++) {
        acc += s->prob[i];
        if (u < acc)
            return s->idx[i];
    }
    return s->idx[n - 1];
}

void duet_sampler_probs(duet_sampler_t *s, const duet_sampling_t *p, const float *logits,
                        float *probs)
{
    memset(probs, 0, sizeof(*probs) * (size_t)s->vocab);
    if (duet_sampling_greedy(p)) {
        probs[duet_argmax(logits, s->vocab)] = 1.0f;
        return;
    }
    double sum;
    const int64_t n = duet__candidates(s, p, logits, &sum);
    for (int64_t i = 0; i < n; i++)
        probs[s->idx[i]] = (float)(s->prob[i] / sum);
}

/* ---- logit processing ----------------------------------------------------------------- */

void duet_logit_proc_default(duet_logit_proc_t *lp)
{
    memset(lp, 0, sizeof(*lp));
}

int duet_logit_proc_needs_hist(const duet_logit_proc_t *lp)
{
    return lp->presence_penalty != 0.0f || lp->frequency_penalty != 0.0f ||
           (lp->repetition_penalty != 0.0f && lp->repetition_penalty != 1.0f);
}

int duet_logit_proc_active(const duet_logit_proc_t *lp)
{
    return duet_logit_proc_needs_hist(lp) || lp->n_bias > 0 ||
           (lp->min_tokens > 0 && lp->n_stop > 0);
}

static size_t duet__hist_bucket(int32_t id, size_t cap)
{
    return ((uint32_t)id * 0x9e3779b1u) & (cap - 1);
}

/* Grow to at least ncap buckets (a power of two), rehashing. */
static duet_status_t duet__hist_grow(duet_token_hist_t *h, size_t ncap)
{
    duet_token_hist_entry_t *ns = malloc(sizeof(*ns) * ncap);
    if (ns == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "token history: out of memory");
    for (size_t i = 0; i < ncap; i++)
        ns[i].id = -1;
    for (size_t i = 0; i < h->cap; i++) {
        if (h->slots[i].id < 0)
            continue;
        size_t b = duet__hist_bucket(h->slots[i].id, ncap);
        while (ns[b].id >= 0)
            b = (b + 1) & (ncap - 1);
        ns[b] = h->slots[i];
    }
    free(h->slots);
    h->slots = ns;
    h->cap = ncap;
    return DUET_OK;
}

duet_status_t duet_token_hist_reserve(duet_token_hist_t *h, size_t n)
{
    size_t ncap = h->cap ? h->cap : 64;
    while (n * 2 > ncap)
        ncap *= 2;
    return ncap > h->cap ? duet__hist_grow(h, ncap) : DUET_OK;
}

duet_status_t duet_token_hist_add(duet_token_hist_t *h, int32_t id, int from_prompt)
{
    /* kept at most half full */
    if ((h->used + 1) * 2 > h->cap && duet__hist_grow(h, h->cap ? h->cap * 2 : 64) != DUET_OK)
        return DUET_ERR_NOMEM;
    size_t b = duet__hist_bucket(id, h->cap);
    while (h->slots[b].id >= 0 && h->slots[b].id != id)
        b = (b + 1) & (h->cap - 1);
    if (h->slots[b].id < 0) {
        h->slots[b] = (duet_token_hist_entry_t){.id = id};
        h->used++;
    }
    if (from_prompt)
        h->slots[b].prompt = 1;
    else
        h->slots[b].count++;
    return DUET_OK;
}

void duet_token_hist_free(duet_token_hist_t *h)
{
    free(h->slots);
    memset(h, 0, sizeof(*h));
}

void duet_logits_process(const duet_logit_proc_t *lp, const duet_token_hist_t *h,
                         int64_t n_generated, float *logits, int64_t vocab)
{
    const float rp = lp->repetition_penalty;
    const int rep = rp != 0.0f && rp != 1.0f;
    for (size_t i = 0; h != NULL && i < h->cap; i++) {
        const duet_token_hist_entry_t *e = &h->slots[i];
        if (e->id < 0 || e->id >= vocab)
            continue;
        float *l = &logits[e->id];
        if (rep)
            *l = *l > 0.0f ? *l / rp : *l * rp;
        if (e->count > 0) { /* two subtractions, as vLLM applies them */
            *l -= (float)e->count * lp->frequency_penalty;
            *l -= lp->presence_penalty;
        }
    }
    for (size_t i = 0; i < lp->n_bias; i++)
        if (lp->bias[i].id >= 0 && lp->bias[i].id < vocab)
            logits[lp->bias[i].id] += lp->bias[i].bias;
    if (n_generated < lp->min_tokens)
        for (size_t i = 0; i < lp->n_stop; i++)
            if ((int64_t)lp->stop_ids[i] < vocab)
                logits[lp->stop_ids[i]] = -INFINITY;
}

/* ---- log-probabilities ---------------------------------------------------------------- */

void duet_logprobs(const float *logits, int64_t vocab, int32_t chosen, int n_top, float *chosen_lp,
                   int32_t *top_ids, float *top_lps)
{
    float mx = logits[0];
    for (int64_t i = 1; i < vocab; i++)
        if (logits[i] > mx)
            mx = logits[i];
    double sum = 0.0;
    for (int64_t i = 0; i < vocab; i++)
        sum += exp((double)logits[i] - (double)mx);
    const double lse = (double)mx + log(sum);
    *chosen_lp = (float)((double)logits[chosen] - lse);
    if (n_top > DUET_MAX_TOP_LOGPROBS)
        n_top = DUET_MAX_TOP_LOGPROBS;
    if (n_top > vocab)
        n_top = (int)vocab;
    /* insertion into a sorted window of n_top: O(vocab * n_top) at worst, n_top <= 20 */
    int n = 0;
    for (int64_t i = 0; i < vocab && n_top > 0; i++) {
        const float l = logits[i];
        if (n == n_top && !(l > logits[top_ids[n - 1]]))
            continue; /* not better than the worst kept (a tie loses: higher id) */
        int j = n < n_top ? n++ : n - 1;
        while (j > 0 && l > logits[top_ids[j - 1]]) {
            top_ids[j] = top_ids[j - 1];
            j--;
        }
        top_ids[j] = (int32_t)i;
    }
    for (int i = 0; i < n; i++)
        top_lps[i] = (float)((double)logits[top_ids[i]] - lse);
}
