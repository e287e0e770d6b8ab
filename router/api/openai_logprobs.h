/*
 * The OpenAI API's log-probabilities and logit processing (docs/architecture.md, "Sampling"),
 * kept apart from openai.c's parser and text streaming:
 *
 *   body fields --duet_oai_lp_parse--> duet_oai_request_t.lp (validated)
 *   the workers' TokenLogprob values --duet_oai_lp_add / _set_prompt--> a duet_oai_lp_t
 *   a range of them --duet_oai_lp_json--> choices[i].logprobs in OpenAI's shapes:
 *     chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
 *                  "logprob", "bytes"}]}]}
 *     completions: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}
 *
 * A token's string is its piece in the tokenizer (ill-formed UTF-8 as U+FFFD), "bytes" the
 * piece's bytes. Completions' top_logprobs also hold the chosen token when it is not among the
 * most likely (OpenAI: "up to logprobs + 1 elements"); with echo the prompt's tokens come first,
 * the first with null logprob and null top_logprobs. text_offset is each token's byte offset in
 * the concatenation of the pieces (the prompt's first with echo).
 */
#ifndef DUET_ROUTER_OPENAI_LOGPROBS_H
#define DUET_ROUTER_OPENAI_LOGPROBS_H

#include "router/api/openai.h"

#define DUET_OAI_MAX_TOP_LOGPROBS       20 /* chat top_logprobs at most */
#define DUET_OAI_MAX_TOP_LOGPROBS_COMPL 5  /* completions logprobs at most (OpenAI's legacy API) */

/*
 * Read and validate, from a request body's object `root`, the fields of duet_oai_lp_params_t:
 * presence_penalty, frequency_penalty ([-2, 2]), repetition_penalty (> 0), logit_bias (an object
 * of token-id strings below lim->vocab_size to numbers in [-100, 100], at most
 * DUET_OAI_MAX_LOGIT_BIAS), min_tokens (0..max_tokens), stop_token_ids (at most
 * DUET_OAI_MAX_EOS ids below lim->vocab_size), logprobs (chat: a boolean; completions:
 * an integer 0..5), top_logprobs (chat: 0..20, above 0 only with logprobs true), echo
 * (completions; with it max_tokens may be 0, but not when streaming). req->endpoint,
 * req->max_tokens and req->stream are set. Bad input: a 400 in *err naming the parameter,
 * DUET_ERR_INVALID; DUET_ERR_NOMEM with a 500.
 */
duet_status_t duet_oai_lp_parse(const struct json_t *root, const duet_oai_limits_t *lim,
                                duet_oai_request_t *req, duet_oai_error_t *err);

/* Free what duet_oai_lp_parse allocated and zero it. */
void duet_oai_lp_params_free(duet_oai_lp_params_t *p);

/* One position's log-probabilities, as a worker sent them. */
typedef struct {
    uint32_t id; /* the chosen (or, for the prompt, the given) id */
    float logprob;
    int n_top;
    uint32_t top_ids[DUET_OAI_MAX_TOP_LOGPROBS];
    float top_lps[DUET_OAI_MAX_TOP_LOGPROBS];
} duet_oai_lp_entry_t;

typedef struct duet_oai_lp duet_oai_lp_t;

/* The log-probabilities of one choice of req (its endpoint, echo), with tok for the token
 * strings. DUET_ERR_NOMEM. */
duet_status_t duet_oai_lp_create(const duet_tokenizer_t *tok, const duet_oai_request_t *req,
                                 duet_oai_lp_t **lp_p);
void duet_oai_lp_destroy(duet_oai_lp_t *lp); /* accepts NULL */

/* Append generated positions, in order. DUET_ERR_NOMEM. */
duet_status_t duet_oai_lp_add(duet_oai_lp_t *lp, const duet_oai_lp_entry_t *e, size_t n);

/* The prompt: ids[0..n) and e[0..n - 1) for ids[1..n) (echo with logprobs). DUET_ERR_NOMEM. */
duet_status_t duet_oai_lp_set_prompt(duet_oai_lp_t *lp, const uint32_t *ids, size_t n,
                                     const duet_oai_lp_entry_t *e);

/* Generated positions recorded so far. */
size_t duet_oai_lp_count(const duet_oai_lp_t *lp);

/* The mean log-probability of the generated positions [0, n) (n <= duet_oai_lp_count): best_of's
 * rank. 0 when n is 0. */
double duet_oai_lp_mean(const duet_oai_lp_t *lp, size_t n);

/*
 * Append choices[i].logprobs for the generated positions [from, to) (to <= duet_oai_lp_count),
 * led by the prompt's when with_prompt (echo), to out (NUL-terminated there).
 */
duet_status_t duet_oai_lp_json(const duet_oai_lp_t *lp, size_t from, size_t to, bool with_prompt,
                               duet_strbuf_t *out);

#endif
