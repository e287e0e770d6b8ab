/*
 * The accuracy gate of duet-bench (--accuracy): score one document from an OpenAI completions
 * answer with echoed prompt log-probabilities, and decide with a paired t-test whether a run's
 * bits per byte rose over a baseline's.
 *
 * Scoring (what is scored, exactly): the answer to {"prompt": doc, "max_tokens": 0, "echo": true,
 * "logprobs": k} has in choices[0].logprobs one entry per prompt token: token_logprobs (the
 * first is null or ignored: nothing precedes that token, which is BOS when the server adds one)
 * and text_offset (where each token starts in choices[0].text, in Unicode code points as OpenAI
 * and vLLM count them). The scored text is choices[0].text from text_offset[1] to its end; it
 * must be the end of the document (a server that echoed something else, or generated text
 * after it, is refused rather than scored). Then
 *   bits_per_byte = -(token_logprobs[1] + ... + token_logprobs[n-1]) / ln 2 / scored_bytes
 * with scored_bytes the UTF-8 bytes of the scored text. With BOS first every byte of the
 * document is scored; without, the first token's bytes are not (they have no prediction).
 *
 * Pure functions: no I/O.
 */
#ifndef DUET_BENCH_SERVING_ACCURACY_H
#define DUET_BENCH_SERVING_ACCURACY_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "common/status.h"

typedef struct {
    double sum_logprob;   /* natural log, over the scored tokens */
    size_t tokens_scored; /* n - 1 */
    size_t bytes_scored;
    double bits_per_byte;
} serving_doc_score_t;

/*
 * Score the completions answer `resp` (a parsed JSON object) for the document doc[0..doc_len).
 * DUET_ERR_FORMAT with a detail naming the field on anything malformed or inconsistent: no
 * choices[0].logprobs, fewer than 2 tokens, a scored logprob that is not a finite number <= 0
 * (1e-3 of rounding is allowed above 0), text_offset not non-decreasing integers >= 0 or its
 * [1] past the text, arrays of unequal length, nothing scored, a scored text that is not the
 * document's end. *out is written only on success.
 */
duet_status_t serving_score_echo(const json_t *resp, const char *doc, size_t doc_len,
                                 serving_doc_score_t *out);

/*
 * The regularized incomplete beta function I_x(a, b) for a, b > 0 and 0 <= x <= 1 (Lentz's
 * continued fraction, relative accuracy ~1e-12); NaN outside the domain.
 */
double serving_betainc(double a, double b, double x);

/* Student's t survival function P(T >= t) with df > 0 degrees of freedom; NaN when df <= 0. */
double serving_t_sf(double t, double df);

/* A one-sided paired t-test of H1 "the run's values are larger" (bits per byte rose). */
typedef struct {
    size_t n;
    double mean_diff; /* mean of run[i] - base[i] */
    double sd_diff;   /* sample standard deviation (n - 1) of the differences */
    double t;         /* mean_diff / (sd_diff / sqrt(n)); +-inf when sd is 0 and mean is not */
    double df;        /* n - 1 */
    double p;         /* P(T_df >= t); 0 for t = +inf, 1 when every difference is 0 or t = -inf */
    bool dropped;     /* p < alpha */
} serving_paired_t;

/*
 * The test over n >= 2 pairs at significance alpha (0 < alpha < 1). DUET_ERR_INVALID when n < 2
 * or a value is not finite. *out is written only on success.
 */
duet_status_t serving_paired_ttest(const double *run, const double *base, size_t n, double alpha,
                                   serving_paired_t *out);

#endif
