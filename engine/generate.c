/* generate.c: see generate.h. */
#include "engine/generate.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

void duet_generate_opts_default(duet_generate_opts_t *o)
{
    memset(o, 0, sizeof(*o));
    duet_sampling_default(&o->sampling);
    o->max_tokens = 64;
}

static double duet__generate_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Put `what` before the detail the failing call left, saying which phase failed. (The detail is
 * copied first: it lives in the buffer duet_error_set writes.) */
static duet_status_t duet__generate_fail(duet_status_t st, const char *what)
{
    char detail[1024];
    snprintf(detail, sizeof(detail), "%s", duet_error_last());
    return duet_error_set(st, "%s: %s", what, detail);
}

static int64_t duet__generate_chunk(const duet_model_t *m, const duet_generate_opts_t *o)
{
    return o->prefill_chunk > 0 ? o->prefill_chunk : duet_model_opts(m)->max_batch_tokens;
}

duet_status_t duet_generate_prefill(duet_model_t *m, duet_seq_t *seq, const int32_t *prompt,
                                    int64_t n_prompt, const duet_generate_opts_t *o, float *logits)
{
    const int64_t V = duet_model_config(m)->vocab_size;
    const int64_t chunk = duet__generate_chunk(m, o);
    if (n_prompt < 1)
        return duet_error_set(DUET_ERR_INVALID, "generate: the prompt is empty");
    if (chunk > duet_model_opts(m)->max_batch_tokens)
        return duet_error_set(DUET_ERR_RANGE,
                              "generate: prefill_chunk %lld is above the model's max_batch_tokens "
                              "%lld",
                              (long long)chunk, (long long)duet_model_opts(m)->max_batch_tokens);
    for (int64_t at = 0; at < n_prompt; at += chunk) {
        const int64_t n = n_prompt - at < chunk ? n_prompt - at : chunk;
        const int last = at + n == n_prompt;
        duet_batch_item_t item = {
            .seq = seq,
            .tokens = prompt + at,
            .n_tokens = n,
            .logits_mode = o->on_prefill_logits != NULL
                               ? DUET_LOGITS_ALL
                               : (last ? DUET_LOGITS_LAST : DUET_LOGITS_NONE),
            .logits = logits,
        };
        duet_status_t st = duet_model_forward(m, &item, 1);
        if (st != DUET_OK)
            return duet__generate_fail(st, "prefill failed");
        if (o->on_prefill_logits != NULL) {
            if ((st = o->on_prefill_logits(o->user, logits, n)) != DUET_OK)
                return st;
            if (last) /* keep the last row for the first token */
                memmove(logits, logits + (n - 1) * V, sizeof(float) * (size_t)V);
        }
    }
    return DUET_OK;
}

/* Record one generated token; *end = 1 when it is a stop id (then no callback: a stop id adds
 * no text). */
static duet_status_t duet__generate_emit(const duet_generate_opts_t *o, duet_generate_result_t *r,
                                         int32_t t, int *end)
{
    r->tokens[r->n_tokens++] = t;
    for (size_t i = 0; i < o->n_stop && !o->ignore_eos; i++)
        if (o->stop_ids[i] == (uint32_t)t) {
            *end = 1;
            r->stopped = 1;
            return DUET_OK;
        }
    return o->on_token != NULL ? o->on_token(o->user, t) : DUET_OK;
}

/* Record a generated id in the history penalties read. */
static duet_status_t duet__generate_seen(const duet_logit_proc_t *proc, duet_token_hist_t *hist,
                                         int32_t t)
{
    return duet_logit_proc_needs_hist(proc) ? duet_token_hist_add(hist, t, 0) : DUET_OK;
}

/* One token from a raw logits row of `vocab`: the row handed to on_step_logits, processed into
 * `work` (the raw row kept) when proc is active, then drawn under the request's rule. Errors into
 * *st. */
static int32_t duet__generate_draw(const duet_generate_opts_t *o, const duet_logit_proc_t *proc,
                                   const duet_token_hist_t *hist, duet_sampler_t *smp,
                                   duet_rng_t *rng, int64_t vocab, const float *raw, float *work,
                                   int64_t n_generated, duet_status_t *st)
{
    const float *row = raw;
    if (duet_logit_proc_active(proc)) {
        memcpy(work, raw, sizeof(float) * (size_t)vocab);
        duet_logits_process(proc, hist, n_generated, work, vocab);
        row = work;
    }
    const int32_t t = duet_sampler_sample(smp, &o->sampling, rng, row);
    *st = o->on_step_logits != NULL ? o->on_step_logits(o->user, raw, t) : DUET_OK;
    return t;
}

duet_status_t duet_generate_decode(duet_model_t *m, duet_seq_t *seq, const int32_t *prompt,
                                   int64_t n_prompt, const float *last_logits,
                                   const duet_generate_opts_t *o, duet_generate_result_t *r)
{
    const int64_t V = duet_model_config(m)->vocab_size, max_new = o->max_tokens;
    r->n_tokens = 0;
    r->stopped = 0;
    r->steps = 0;
    r->verify_steps = r->draft_tokens = r->accepted_tokens = 0;
    r->decode_s = 0.0;
    if (max_new < 0)
        return duet_error_set(DUET_ERR_INVALID, "generate: max_tokens %lld is negative",
                              (long long)max_new);
    if (seq->id < 0 || seq->n_tokens != n_prompt || seq->n_pending != 0)
        return duet_error_set(DUET_ERR_INVALID,
                              "generate: the sequence must hold exactly the prompt's %lld tokens "
                              "(it holds %lld, %lld pending)",
                              (long long)n_prompt, (long long)seq->n_tokens,
                              (long long)seq->n_pending);
    /* every emitted token but the newest is forwarded */
    if (max_new > 0 && seq->cap_tokens < n_prompt + max_new - 1)
        return duet_error_set(DUET_ERR_RANGE,
                              "generate: the sequence holds %lld tokens, %lld prompt + %lld "
                              "generated need %lld",
                              (long long)seq->cap_tokens, (long long)n_prompt, (long long)max_new,
                              (long long)(n_prompt + max_new - 1));
    const int k_max = o->spec != NULL ? duet_spec_opts(o->spec)->k : 0;
    duet_sampler_t *smp = NULL;
    duet_spec_seq_t ss = {.dseq = {.id = -1}};
    duet_token_hist_t hist = {0};
    /* processing (its stop ids the request's unless ignore_eos), and a copy of the row it works
     * on when the raw row is wanted too */
    duet_logit_proc_t proc = o->proc;
    proc.stop_ids = o->ignore_eos ? NULL : o->stop_ids;
    proc.n_stop = o->ignore_eos ? 0 : o->n_stop;
    const int processing = duet_logit_proc_active(&proc);
    /* speculation only without processing (docs/architecture.md, "Sampling"); on_step_logits
     * then gets the verify rows of the emitted tokens */
    const int speculate = o->spec != NULL && !processing;
    float *logits = malloc(sizeof(float) * (size_t)V * (size_t)(k_max + 2));
    float *work = logits != NULL ? logits + (size_t)V * (size_t)(k_max + 1) : NULL;
    duet_status_t st = logits == NULL ? duet_error_set(DUET_ERR_NOMEM, "out of memory")
                                      : duet_sampler_create(V, &smp);
    for (int64_t i = 0; st == DUET_OK && duet_logit_proc_needs_hist(&proc) && i < n_prompt; i++)
        st = duet_token_hist_add(&hist, prompt[i], 1);
    if (st != DUET_OK)
        goto out;

    /* the first token from the prefill's logits, then one forward per step (a verify of the
     * drafts with speculation, else one row) */
    duet_rng_t rng;
    duet_rng_seed(&rng, o->sampling.seed);
    int end = 0;
    const double t1 = duet__generate_now();
    if (max_new > 0) {
        const int32_t first =
            duet__generate_draw(o, &proc, &hist, smp, &rng, V, last_logits, work, r->n_tokens, &st);
        if (st != DUET_OK || (st = duet__generate_emit(o, r, first, &end)) != DUET_OK ||
            (st = duet__generate_seen(&proc, &hist, first)) != DUET_OK)
            goto out;
        if (speculate && end == 0 &&
            (st = duet_spec_seq_open(o->spec, &ss, prompt, n_prompt, first, max_new, &o->sampling,
                                     &rng)) != DUET_OK)
            goto out;
    }
    while (end == 0 && r->n_tokens < max_new) {
        int32_t toks[DUET_SPEC_MAX_K + 1], vtoks[DUET_SPEC_MAX_K + 1], vmax[DUET_SPEC_MAX_K + 1];
        int n_toks = 0;
        int32_t next = r->tokens[r->n_tokens - 1];
        /* greedy speculation without a logits consumer needs only each row's arg-max */
        const int argmax = speculate && duet_spec_seq_greedy(&ss) && o->on_step_logits == NULL;
        duet_batch_item_t item = {.seq = seq,
                                  .tokens = &next,
                                  .n_tokens = 1,
                                  .logits_mode = argmax ? DUET_LOGITS_ARGMAX : DUET_LOGITS_LAST,
                                  .logits = logits,
                                  .token_out = vmax};
        if (speculate) {
            /* drafts so that the kept ones and the target's token stay within max_tokens */
            const int64_t room = max_new - r->n_tokens - 1;
            int k_cap = (int)(room < k_max ? room : k_max);
            duet_spec_seq_t *one = &ss;
            if ((st = duet_spec_propose(o->spec, &one, &k_cap, 1)) != DUET_OK) {
                st = duet__generate_fail(st, "drafting failed");
                goto out;
            }
            if (ss.k > 0) {
                vtoks[0] = next;
                memcpy(vtoks + 1, ss.drafts, sizeof(int32_t) * (size_t)ss.k);
                item.tokens = vtoks;
                item.n_tokens = ss.k + 1;
                item.logits_mode = argmax ? DUET_LOGITS_ARGMAX : DUET_LOGITS_ALL;
                item.verify = 1;
            }
        }
        if ((st = duet_model_forward(m, &item, 1)) != DUET_OK) {
            st = duet__generate_fail(st, "decode failed");
            goto out;
        }
        r->steps++;
        if (speculate) {
            st = argmax ? duet_spec_finish_argmax(o->spec, &ss, seq, vmax, toks, &n_toks)
                        : duet_spec_finish(o->spec, &ss, seq, logits, toks, &n_toks);
            if (st != DUET_OK)
                goto out;
        } else {
            toks[n_toks++] =
                duet__generate_draw(o, &proc, &hist, smp, &rng, V, logits, work, r->n_tokens, &st);
            if (st != DUET_OK)
                goto out;
        }
        for (int i = 0; i < n_toks && end == 0 && r->n_tokens < max_new; i++) {
            /* speculating, toks[i] came from verify row i (row 0 of a plain step) */
            if (speculate && o->on_step_logits != NULL &&
                (st = o->on_step_logits(o->user, logits + (size_t)i * (size_t)V, toks[i])) !=
                    DUET_OK)
                goto out;
            if ((st = duet__generate_emit(o, r, toks[i], &end)) != DUET_OK ||
                (st = duet__generate_seen(&proc, &hist, toks[i])) != DUET_OK)
                goto out;
        }
    }
    r->decode_s = duet__generate_now() - t1;

out:
    r->verify_steps = ss.verify_steps;
    r->draft_tokens = ss.drafted;
    r->accepted_tokens = ss.kept;
    if (o->spec != NULL)
        duet_spec_seq_close(o->spec, &ss);
    duet_token_hist_free(&hist);
    duet_sampler_destroy(smp);
    free(logits);
    return st;
}

duet_status_t duet_generate_run(duet_model_t *m, const int32_t *prompt, int64_t n_prompt,
                                const duet_generate_opts_t *o, duet_generate_result_t *r)
{
    const int64_t V = duet_model_config(m)->vocab_size;
    const int64_t rows = o->on_prefill_logits != NULL ? duet__generate_chunk(m, o) : 1;
    duet_seq_t seq = {.id = -1};
    float *logits = NULL;
    r->prefill_s = 0.0;
    if (o->max_tokens < 0)
        return duet_error_set(DUET_ERR_INVALID, "generate: max_tokens %lld is negative",
                              (long long)o->max_tokens);
    duet_status_t st = duet_model_seq_open(m, n_prompt + o->max_tokens, &seq);
    if (st != DUET_OK)
        return st;
    logits = malloc(sizeof(float) * (size_t)V * (size_t)(rows > 0 ? rows : 1));
    if (logits == NULL) {
        st = duet_error_set(DUET_ERR_NOMEM, "out of memory");
        goto out;
    }
    const double t0 = duet__generate_now();
    if ((st = duet_generate_prefill(m, &seq, prompt, n_prompt, o, logits)) != DUET_OK)
        goto out;
    r->prefill_s = duet__generate_now() - t0;
    st = duet_generate_decode(m, &seq, prompt, n_prompt, logits, o, r);
out:
    duet_model_seq_close(m, &seq);
    free(logits);
    return st;
}
