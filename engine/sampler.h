/*
 * Token sampling: greedy, temperature, top-k, top-p, seeded. A sampler owns the scratch it needs
 * for one vocabulary (made once per worker, not per step); the RNG state lives with the request
 * so a seeded request gives the same tokens whatever else is in the batch.
 */
#ifndef DUET_ENGINE_SAMPLER_H
#define DUET_ENGINE_SAMPLER_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct {
    float temperature; /* 0 = greedy (argmax, first index on ties) */
    int64_t top_k;     /* 0 = no limit */
    float top_p;       /* (0, 1]; 1 = no nucleus cut */
    uint64_t seed;
} duet_sampling_t;

/* xoshiro256** state */
typedef struct {
    uint64_t s[4];
} duet_rng_t;

void duet_rng_seed(duet_rng_t *rng, uint64_t seed);
uint64_t duet_rng_next(duet_rng_t *rng);
/* Uniform in [0, 1) with 24 bits. */
float duet_rng_uniform(duet_rng_t *rng);

/* Greedy defaults: temperature 0, top_k 0, top_p 1, seed 0. */
void duet_sampling_default(duet_sampling_t *p);

/* Whether p takes the arg-max (temperature 0 or top_k 1) rather than drawing. */
int duet_sampling_greedy(const duet_sampling_t *p);

/* DUET_ERR_RANGE naming the parameter when temperature < 0 or not finite, top_k < 0, top_p not
 * in (0, 1]. */
duet_status_t duet_sampling_validate(const duet_sampling_t *p);

typedef struct duet_sampler duet_sampler_t;

duet_status_t duet_sampler_create(int64_t vocab, duet_sampler_t **s_p);
void duet_sampler_destroy(duet_sampler_t *s); /* accepts NULL */

/* Index of the largest logit (first on ties). */
int32_t duet_argmax(const float *logits, int64_t n);

/* Draw one token from `logits` (not modified) under p, advancing rng. */
int32_t duet_sampler_sample(duet_sampler_t *s, const duet_sampling_t *p, duet_rng_t *rng,
                            const float *logits);

/*
 * The same rule with the uniform draw given: duet_sampler_sample(s, p, rng, l) ==
 * duet_sampler_sample_u(s, p, duet_sampling_draw(p, rng), l). Lets a device sampler and the CPU
 * one consume a request's RNG stream identically.
 */
int32_t duet_sampler_sample_u(duet_sampler_t *s, const duet_sampling_t *p, float u,
                              const float *logits);
/*
 * The distribution duet_sampler_sample draws from under p, dense over the vocabulary into
 * probs[vocab] (zero outside the top-k / nucleus candidates; one-hot at the argmax when p is
 * greedy). Speculative sampling compares the target's and the drafter's distributions with it.
 */
void duet_sampler_probs(duet_sampler_t *s, const duet_sampling_t *p, const float *logits,
                        float *probs);

/* The draw one token of p consumes: duet_rng_uniform(rng) when p samples, else 0 (no draw). */
float duet_sampling_draw(const duet_sampling_t *p, duet_rng_t *rng);

/* ---- logit processing (docs/architecture.md, "Sampling") ------------------------------- */

typedef struct {
    int32_t id;
    float bias;
} duet_logit_bias_t;

/*
 * What is done to a request's logits before temperature / top-k / top-p (and before the greedy
 * argmax), in this order: repetition_penalty (vLLM: an id seen in the prompt or the output has
 * its logit divided by it when positive, multiplied when not; 0 or 1 = off), frequency_penalty
 * (minus count * f for each id generated count times) and presence_penalty (minus p for each id
 * generated at least once; both OpenAI's, 0 = off), logit_bias added, and until min_tokens ids
 * were generated the stop ids set to -inf. Pointers are the caller's.
 */
typedef struct {
    float presence_penalty, frequency_penalty, repetition_penalty;
    const duet_logit_bias_t *bias; /* [n_bias], ids inside the vocabulary */
    size_t n_bias;
    int64_t min_tokens;
    const uint32_t *stop_ids; /* [n_stop]: what min_tokens holds back (EOS and stop ids) */
    size_t n_stop;
} duet_logit_proc_t;

/* All off. */
void duet_logit_proc_default(duet_logit_proc_t *lp);
/* Whether lp changes any logits at all (else processing is skipped). */
int duet_logit_proc_active(const duet_logit_proc_t *lp);
/* Whether lp needs the ids seen so far (a penalty is set): only then is a history kept. */
int duet_logit_proc_needs_hist(const duet_logit_proc_t *lp);

/*
 * The ids a request has seen: per distinct id, how many times it was generated and whether the
 * prompt has it. A hash table over the distinct ids, so a step's penalties cost O(distinct ids),
 * never O(vocabulary). Zero-initialise; free with duet_token_hist_free.
 */
typedef struct {
    int32_t id;     /* -1 = empty bucket */
    uint32_t count; /* generated */
    int32_t prompt; /* 1: in the prompt */
} duet_token_hist_entry_t;

typedef struct {
    duet_token_hist_entry_t *slots; /* [cap], cap a power of two (0 while empty) */
    size_t cap, used;
} duet_token_hist_t;

/* Record id (from the prompt when from_prompt, else one more generation of it). DUET_ERR_NOMEM
 * (the history is left as it was). */
duet_status_t duet_token_hist_add(duet_token_hist_t *h, int32_t id, int from_prompt);
/* Make room for n distinct ids, so that adding up to n never allocates. DUET_ERR_NOMEM. */
duet_status_t duet_token_hist_reserve(duet_token_hist_t *h, size_t n);
void duet_token_hist_free(duet_token_hist_t *h); /* leaves it empty, reusable */

/* Apply lp to logits[0..vocab) in place for a request that generated n_generated ids, whose
 * seen ids are h (may be NULL when no penalty is set). */
void duet_logits_process(const duet_logit_proc_t *lp, const duet_token_hist_t *h,
                         int64_t n_generated, float *logits, int64_t vocab);

/* ---- log-probabilities ---------------------------------------------------------------- */

#define DUET_MAX_TOP_LOGPROBS 20

/*
 * Log-probabilities of logits[0..vocab) as the model produced them (log_softmax, computed in
 * double): *chosen_lp = that of `chosen`, and the n_top (0..DUET_MAX_TOP_LOGPROBS) most likely
 * ids into top_ids / top_lps, most likely first, equal logits by lower id first.
 */
void duet_logprobs(const float *logits, int64_t vocab, int32_t chosen, int n_top, float *chosen_lp,
                   int32_t *top_ids, float *top_lps);

#endif
