/*
 * Speculative decoding's host side, shared by duet-generate and duet-gen: the methods, prompt
 * lookup (the n-gram drafter) and the acceptance rule. The engine verifies k drafted tokens of a
 * sequence in one forward (engine/model.h: verify items, duet_model_seq_accept); what is drafted
 * and how much of it is kept is decided here.
 *
 * Acceptance keeps the target's output exactly what decoding without speculation would give:
 *  - greedy (temperature 0 or top_k 1): drafts are kept while each equals the target's argmax at
 *    its row; then the target's own token follows, so the tokens are plain greedy decoding's;
 *  - sampling: speculative sampling (Leviathan et al., Chen et al.): draft d drawn from q is kept
 *    with probability min(1, p(d) / q(d)); on a rejection the token is drawn from the normalised
 *    max(0, p - q); after k kept drafts one more token is drawn from p. Every emitted token is then
 *    distributed as the target's p (p and q after the request's temperature / top-k / top-p:
 *    duet_sampler_probs). A drafter that proposes without sampling (the n-gram one, or a greedy
 *    draft model) is a point mass q.
 * The uniform draws come from the request's RNG, one per kept-or-rejected test and one per token
 * drawn, so a seeded request repeats itself; its tokens are not those of the same seed without
 * speculation (the draws are used differently), only their distribution is.
 */
#ifndef DUET_ENGINE_SPEC_H
#define DUET_ENGINE_SPEC_H

#include <stdint.h>

#include "common/status.h"
#include "engine/sampler.h"

#define DUET_SPEC_MAX_K 8 /* drafts per verify step at most (spec.k in 1..8) */

typedef enum {
    DUET_SPEC_NONE = 0,  /* no speculation */
    DUET_SPEC_NGRAM = 1, /* prompt lookup: the tokens that followed the last n tokens before */
    DUET_SPEC_DRAFT = 2, /* a small draft model in the same format and vocabulary */
} duet_spec_method_t;

/* "none", "ngram", "draft" <-> the enum; DUET_ERR_INVALID naming the value. */
duet_status_t duet_spec_method_parse(const char *s, duet_spec_method_t *m_p);
const char *duet_spec_method_name(duet_spec_method_t m);

/*
 * Prompt lookup: match the last n tokens of hist[0..n_hist) (the prompt and the output so far,
 * newest last) against the earlier tokens, n from n_max down to n_min (1 <= n_min <= n_max), and
 * propose the tokens that followed the most recent earlier occurrence of the longest n that
 * matches: up to k of them (fewer when the history ends first). Returns how many were written to
 * drafts[0..k) (0: no match). Pure; O(n_hist * n_max).
 */
int duet_spec_ngram_propose(const int32_t *hist, int64_t n_hist, int n_min, int n_max, int k,
                            int32_t *drafts);

/*
 * The acceptance rule over one verify item's logits. logits: [k + 1][vocab] rows of the target,
 * row j after the sequence's next token and drafts[0..j) (row 0 is the plain next-token row).
 * q: [k][vocab] the drafter's distributions drafts[j] was drawn from (duet_sampler_probs under
 * the same p), or NULL for a drafter that proposes without sampling (point masses). scratch: 2 *
 * vocab floats. Writes the tokens to emit into out[0..n) and returns n in 1..k+1: the kept
 * drafts, then the target's token. The sequence keeps n verify rows (duet_model_seq_accept(m,
 * seq, n)): the next token and the kept drafts. k may be 0 (then it is plain decoding).
 */
int duet_spec_accept(duet_sampler_t *s, const duet_sampling_t *p, duet_rng_t *rng,
                     const float *logits, int64_t vocab, const int32_t *drafts, int k,
                     const float *q, float *scratch, int32_t *out);

#endif
