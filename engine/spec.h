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

#include "common/config.h"
#include "common/status.h"
#include "engine/model.h"
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

/* duet_spec_accept's signature: an acceptance rule. */
typedef int (*duet_spec_accept_fn)(duet_sampler_t *s, const duet_sampling_t *p, duet_rng_t *rng,
                                   const float *logits, int64_t vocab, const int32_t *drafts, int k,
                                   const float *q, float *scratch, int32_t *out);

/* ---- the speculative decoder: drafts for a batch of sequences, and what a verify keeps ---- */

typedef struct {
    duet_spec_method_t method; /* default NONE */
    int k;                     /* drafts per verify step, 1..DUET_SPEC_MAX_K (default 4) */
    int ngram_min, ngram_max;  /* NGRAM: match lengths tried, longest first (default 1..3) */
    const char *draft_model;   /* DRAFT: the draft checkpoint's folder (not owned) */
    int64_t draft_page_tokens; /* DRAFT: its KV page size in tokens (default 32) */
    int64_t draft_kv_pages;    /* DRAFT: its KV pool's pages (0 = max_seqs * ceil((max_seq_len
                                  + k + 1) / draft_page_tokens); duet-gen passes its cache
                                  plan's, engine/cache_plan.h) */
} duet_spec_opts_t;

/* The defaults above. */
void duet_spec_opts_default(duet_spec_opts_t *o);

/* "none", "ngram", "draft", NULL: the spec.method choices. */
extern const char *const duet_spec_method_choices[];

/*
 * The config keys of speculative decoding, to splice into a binary's duet_config_key_t table
 * (duet-generate's, duet-gen's): spec.method, spec.k, spec.draft_model, spec.ngram_min,
 * spec.ngram_max, cache.draft_page_tokens. duet_spec_opts_from_config reads them back.
 */
#define DUET_SPEC_CONFIG_KEYS                                                                      \
    {.name = "spec.method",                                                                        \
     .type = DUET_CONFIG_ENUM,                                                                     \
     .def = "none",                                                                                \
     .help = "speculative decoding: none, ngram (prompt lookup) or draft (spec.draft_model)",      \
     .choices = duet_spec_method_choices},                                                         \
        {.name = "spec.k",                                                                         \
         .type = DUET_CONFIG_INT,                                                                  \
         .def = "4",                                                                               \
         .help = "drafted tokens verified per step",                                               \
         .min = "1",                                                                               \
         .max = "8"},                                                                              \
        {.name = "spec.draft_model",                                                               \
         .type = DUET_CONFIG_STRING,                                                               \
         .help = "draft checkpoint folder (any KDA / MLA layers, the target's vocabulary)"},       \
        {.name = "spec.ngram_min",                                                                 \
         .type = DUET_CONFIG_INT,                                                                  \
         .def = "1",                                                                               \
         .help = "shortest n-gram prompt lookup matches",                                          \
         .min = "1",                                                                               \
         .max = "16"},                                                                             \
        {.name = "spec.ngram_max",                                                                 \
         .type = DUET_CONFIG_INT,                                                                  \
         .def = "3",                                                                               \
         .help = "longest n-gram prompt lookup tries first",                                       \
         .min = "1",                                                                               \
         .max = "16"},                                                                             \
    {                                                                                              \
        .name = "cache.draft_page_tokens", .type = DUET_CONFIG_INT, .def = "32",                   \
        .help = "the draft model's KV page size in tokens", .min = "1", .max = "65536"             \
    }

/* Fill o from DUET_SPEC_CONFIG_KEYS' values in cfg and validate it (duet_spec_opts_validate).
 * o->draft_model points into cfg. */
duet_status_t duet_spec_opts_from_config(const duet_config_t *cfg, duet_spec_opts_t *o);

/*
 * Check o (method, 1 <= k <= DUET_SPEC_MAX_K, 1 <= ngram_min <= ngram_max <= 16, a draft folder
 * for DRAFT, draft_page_tokens >= 1). DUET_ERR_INVALID / DUET_ERR_RANGE naming the key (spec.*).
 */
duet_status_t duet_spec_opts_validate(const duet_spec_opts_t *o);

/*
 * What the target model must be loaded with to speculate under o: spec_rows = k + 1 (0 for
 * NONE). A caller also opens each sequence with k tokens more than it will keep (the verify
 * rows past the last kept one are written into its pages).
 */
int64_t duet_spec_target_rows(const duet_spec_opts_t *o);

typedef struct duet_spec duet_spec_t;

/* The options duet_spec_create loads a DRAFT model with, beside a target loaded with `to`: CPU,
 * the target's threads and max_seqs, max_seq_len + k + 1 tokens per sequence, draft_page_tokens
 * and draft_kv_pages, room for whole catch-up items in one forward. */
void duet_spec_draft_opts(const duet_spec_opts_t *o, const duet_model_opts_t *to,
                          duet_model_opts_t *dopts);

/*
 * The speculative decoder of `target` (loaded with spec_rows >= k + 1; it must outlive the
 * decoder): for DRAFT it loads o->draft_model on the target's device with as many sequences as
 * the target
 * and max_seq_len + k tokens each (plain decode: no verify rows) and o->draft_kv_pages KV pages,
 * and refuses one whose vocabulary differs from the target's. Its layers may be any mix of KDA and
 * MLA layers: a draft sequence is rolled back past rejected drafts with duet_model_seq_truncate,
 * its KDA state from a copy taken before the drafts (duet_spec_propose). Errors:
 * duet_spec_opts_validate's, the draft model's load errors, DUET_ERR_UNSUPPORTED, NOMEM.
 */
duet_status_t duet_spec_create(const duet_spec_opts_t *o, duet_model_t *target, duet_spec_t **sp_p);
void duet_spec_destroy(duet_spec_t *sp); /* accepts NULL */
const duet_spec_opts_t *duet_spec_opts(const duet_spec_t *sp);

/*
 * Tests only: the decoder's duet_spec_finish applies `rule` instead of duet_spec_accept (NULL:
 * duet_spec_accept again), so that a statistical test can show it catches a wrong rule through
 * the whole decode loop. Nothing else calls it.
 */
void duet_spec_set_accept_rule(duet_spec_t *sp, duet_spec_accept_fn rule);

/* One speculating request. Fields are the decoder's; callers read the stats and `k`. */
typedef struct {
    int32_t *hist; /* (cap) owned: the prompt and every token emitted so far, newest last; the
                      target's sequence holds all but the newest */
    int64_t n_hist, cap;
    duet_seq_t dseq; /* DRAFT: the draft model's sequence; dseq.n_tokens of hist are in it */
    void *dstate;    /* DRAFT, a draft model with KDA layers: (duet_model_seq_state_bytes) owned:
                        dseq's KDA state when it held dstate_at tokens, saved before the last
                        proposal's draft steps: what a rollback past rejected drafts restores */
    int64_t dstate_at;
    const duet_sampling_t *sampling; /* the request's; not owned */
    duet_rng_t *rng;                 /* the request's stream; not owned */
    int32_t drafts[DUET_SPEC_MAX_K]; /* the last proposal: drafts[0..k) */
    int k;
    float *q;               /* (DUET_SPEC_MAX_K * vocab) owned: q of each draft when the draft
                               model sampled it; unused otherwise */
    int q_valid;            /* 1 when q holds the last proposal's distributions */
    uint64_t drafted, kept; /* drafts proposed / kept over the request */
    uint64_t verify_steps;  /* verify steps */
    uint64_t kept_at[DUET_SPEC_MAX_K]; /* kept_at[j]: drafts kept at position j */
    uint64_t drafted_at[DUET_SPEC_MAX_K];
} duet_spec_seq_t;

/*
 * Start a request: hist = prompt[0..n_prompt) then `first` (the request's first generated token,
 * not yet in the target's sequence), room for max_tokens tokens in all. DRAFT: opens a draft
 * sequence; the draft model's prompt KV is computed on the generation side, from the prompt ids,
 * by the following duet_spec_propose calls (a bounded chunk per call). sampling and rng are the
 * request's and must outlive ss. Errors: the draft model's (NO_SPACE when its pools are full),
 * NOMEM; ss is then left closed.
 */
duet_status_t duet_spec_seq_open(duet_spec_t *sp, duet_spec_seq_t *ss, const int32_t *prompt,
                                 int64_t n_prompt, int32_t first, int64_t max_tokens,
                                 const duet_sampling_t *sampling, duet_rng_t *rng);
void duet_spec_seq_close(duet_spec_t *sp, duet_spec_seq_t *ss); /* accepts a closed one */

/* Rows of history one sequence's draft model catches up per duet_spec_propose call when it is
 * further behind than that (a new request's prompt): the most drafting adds to a step per new
 * request. A constant, not a key: when a request starts drafting must not depend on the batch or
 * the binary, so that seeded streams repeat everywhere. */
#define DUET_SPEC_CATCHUP_ROWS 256

/* The newest token of the request: the one a verify item starts with. */
int32_t duet_spec_seq_next(const duet_spec_seq_t *ss);

/*
 * Draft for n requests at once: ss[i] gets up to k_cap[i] drafts (k_cap[i] <= k; 0: none, e.g. a
 * request one token from its limit) into ss[i]->drafts / ->k (and ->q). NGRAM: prompt lookup over
 * the history. DRAFT: the draft model catches each sequence up with the history and runs up to
 * k steps for all of them together (batched forwards). A sequence more than
 * DUET_SPEC_CATCHUP_ROWS tokens behind (a new request's long prompt) catches up by that many rows
 * per call and gets no drafts until it is within them (its steps are plain one-row steps). A
 * request that samples draws each draft
 * from the draft model's distribution with its own RNG (and keeps q), a greedy one takes the
 * draft model's argmax. A draft model with KDA layers has each drafting sequence's KDA state
 * copied (ss[i]->dstate) after the catch-up and before the draft steps, for duet_spec_finish's
 * rollback. Errors: the draft model's forward and state copy errors.
 */
duet_status_t duet_spec_propose(duet_spec_t *sp, duet_spec_seq_t *const *ss, const int *k_cap,
                                int64_t n);

/*
 * A verify step of the target's sequence tseq just ran with the item [next, drafts[0..k)]
 * (n_tokens k + 1, logits [k + 1][vocab] in `logits`): choose what it keeps (duet_spec_accept),
 * keep it (duet_model_seq_accept(target, tseq, n)), record it in the history, roll the draft
 * sequence back to what stays valid when it holds a rejected draft (MLA-only: to the last valid
 * token; with KDA layers: to the proposal's start, its saved state restored, so the next
 * proposal's catch-up forwards the kept tokens again as one chunk; nothing when no draft it
 * holds was rejected), and write the n tokens to emit into out[0..n) (n returned,
 * 1..k+1; out[n - 1] is the next verify's first token). With ss->k == 0 the caller ran a plain
 * one-row step instead: then logits is that row and the target's sequence already advanced.
 * Errors: duet_model_seq_accept's and the draft model's.
 */
duet_status_t duet_spec_finish(duet_spec_t *sp, duet_spec_seq_t *ss, duet_seq_t *tseq,
                               const float *logits, int32_t *out, int *n_p);

/* Whether ss's request decodes greedily (temperature 0 or top_k 1): its verify can then run with
 * DUET_LOGITS_ARGMAX and finish with duet_spec_finish_argmax. */
int duet_spec_seq_greedy(const duet_spec_seq_t *ss);

/*
 * duet_spec_finish for a greedy request whose step ran with DUET_LOGITS_ARGMAX: row_tokens[j] is
 * row j's arg-max (k + 1 of them; one for a plain step, ss->k == 0). The greedy rule on them, which
 * is duet_spec_accept's (drafts kept while each equals its row's arg-max, then the next row's),
 * then the same keeping, history and rollback. DUET_ERR_INVALID for a request that samples
 * (nothing changes); otherwise duet_spec_finish's errors.
 */
duet_status_t duet_spec_finish_argmax(duet_spec_t *sp, duet_spec_seq_t *ss, duet_seq_t *tseq,
                                      const int32_t *row_tokens, int32_t *out, int *n_p);

#endif
