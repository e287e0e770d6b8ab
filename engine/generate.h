/*
 * One prompt through a loaded model, single process: prefill in chunks, then decode one token
 * per forward, or with speculation (engine/spec.h) a verify of the drafted tokens per forward,
 * until max_tokens or a stop id. This is duet-generate's loop, in one home: the CLI runs it, and
 * the tests that prove speculation exact (greedy) and distribution-preserving (sampling) run the
 * very same code rather than a copy of it.
 */
#ifndef DUET_ENGINE_GENERATE_H
#define DUET_ENGINE_GENERATE_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "engine/model.h"
#include "engine/sampler.h"
#include "engine/spec.h"

typedef struct {
    duet_sampling_t sampling; /* the rule and the seed the request's RNG starts from (the caller
                                 validates it: duet_sampling_validate) */
    int64_t max_tokens;       /* tokens to generate at most, >= 0 */
    const uint32_t *stop_ids; /* an emitted stop id ends the output: it is the last of `tokens`
                                 and the finish is "stop" */
    size_t n_stop;
    int ignore_eos;        /* 1: stop ids do not end the output */
    duet_spec_t *spec;     /* the speculative decoder of this model (duet_spec_create), or
                              NULL: no speculation. Not owned */
    int64_t prefill_chunk; /* prompt tokens per forward, 1..the model's max_batch_tokens
                              (0 = max_batch_tokens) */
    /* With it, each prefill chunk is run with the logits of every row, handed here ([n_rows]
     * [vocab], in prompt order: duet-generate's --dump-logits); NULL: only the last row's. A
     * status other than DUET_OK ends the run with it. */
    duet_status_t (*on_prefill_logits)(void *user, const float *logits, int64_t n_rows);
    /* Each emitted token that is not a stop id, in order, as it is emitted (duet-generate's
     * text); NULL: none. A status other than DUET_OK ends the run with it. */
    duet_status_t (*on_token)(void *user, int32_t token);
    /* Logit processing (engine/sampler.h; its stop ids are set from stop_ids here unless
     * ignore_eos). Active processing decodes without speculation. */
    duet_logit_proc_t proc;
    /* Each generated token (stop ids included) with the raw logits row it was drawn from, before
     * any processing (duet-generate's --logprobs and --dump-step-logits): speculating, the verify
     * row of its position (bit-identical to plain decoding's on the CPU); NULL: none. A status
     * other than DUET_OK ends the run with it. */
    duet_status_t (*on_step_logits)(void *user, const float *logits, int32_t token);
    void *user;
} duet_generate_opts_t;

/* Defaults: greedy, max_tokens 64, no stop ids, no speculation, prefill_chunk 0, no callbacks. */
void duet_generate_opts_default(duet_generate_opts_t *o);

typedef struct {
    int32_t *tokens;          /* the caller's array of at least max(1, max_tokens) entries: the
                                 generated tokens, a stop id included */
    int64_t n_tokens;         /* how many */
    int stopped;              /* 1: a stop id ended the output ("stop"); 0: max_tokens ("length") */
    int64_t steps;            /* decode forwards after the prefill (the first token comes from the
                                 prefill's logits): verify steps and plain one-row steps */
    uint64_t verify_steps;    /* of which verify steps (drafts > 0) */
    uint64_t draft_tokens;    /* drafted tokens verified */
    uint64_t accepted_tokens; /* drafted tokens kept */
    double prefill_s;         /* the prefill's wall time (duet_generate_run) */
    double decode_s;          /* from drawing the first token to the end, callbacks included (and
                                 the draft model's prompt catch-up, which runs in decode steps) */
} duet_generate_result_t;

/*
 * Prefill: run prompt[0..n_prompt) (n_prompt >= 1) into `seq` (open, empty) in forwards of at
 * most o->prefill_chunk tokens. The last prompt row's logits end in logits[0..vocab); `logits`
 * holds vocab floats, or chunk * vocab with o->on_prefill_logits. Errors: the forward's
 * ("prefill failed: ..."), the callback's.
 */
duet_status_t duet_generate_prefill(duet_model_t *m, duet_seq_t *seq, const int32_t *prompt,
                                    int64_t n_prompt, const duet_generate_opts_t *o, float *logits);

/*
 * Decode after a prefill: `seq` holds exactly the prompt prompt[0..n_prompt) (as
 * duet_generate_prefill leaves it, or a copy of such a sequence) and room for max_tokens more;
 * last_logits is the prompt's last row. The first token is drawn from last_logits with a fresh
 * RNG seeded from o->sampling.seed, then each step forwards the newest token (with o->spec: and
 * the drafts proposed for it, at most as many as leave the kept ones and the target's token
 * within max_tokens) and emits what it keeps. Greedy, the tokens are plain decoding's whatever
 * o->spec is; sampling, their distribution is (engine/spec.h). `seq` is left holding every
 * emitted token but the newest (committed, or accepted rows still to replay). r->tokens must be
 * set; the rest of *r is written. Errors: DUET_ERR_INVALID (a sequence not holding the prompt,
 * max_tokens < 0), DUET_ERR_RANGE (no room), the drafter's ("drafting failed: ..."), the
 * forward's ("decode failed: ..."), duet_spec_*'s, the callback's.
 */
duet_status_t duet_generate_decode(duet_model_t *m, duet_seq_t *seq, const int32_t *prompt,
                                   int64_t n_prompt, const float *last_logits,
                                   const duet_generate_opts_t *o, duet_generate_result_t *r);

/*
 * The whole run: open a sequence of n_prompt + max_tokens tokens, prefill (timed into
 * r->prefill_s), decode, close it. Errors: duet_model_seq_open's, DUET_ERR_NOMEM, and those of
 * duet_generate_prefill / duet_generate_decode.
 */
duet_status_t duet_generate_run(duet_model_t *m, const int32_t *prompt, int64_t n_prompt,
                                const duet_generate_opts_t *o, duet_generate_result_t *r);

#endif
