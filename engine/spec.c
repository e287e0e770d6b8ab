/* spec.c: see spec.h. */
#include "engine/spec.h"

#include <stdlib.h>
#include <string.h>

#include "common/log.h"

const char *const duet_spec_method_choices[] = {"none", "ngram", "draft", NULL};
static const char *const *const duet__spec_names = duet_spec_method_choices;

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
    const int greedy = duet_sampling_greedy(p);
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

/* ---- the speculative decoder ---------------------------------------------------------------- */

struct duet_spec {
    duet_spec_opts_t o;
    duet_model_t *target; /* not owned */
    int64_t vocab;
    duet_sampler_t *sampler;
    float *scratch;           /* (2 * vocab) duet_spec_accept's */
    duet_model_t *draft;      /* DRAFT: owned */
    int64_t draft_rows;       /* rows one draft forward may carry */
    duet_batch_item_t *items; /* (max_seqs) one draft step's items */
    int32_t *tok;             /* (max_seqs) their one token each, when drafting */
    int64_t *idx;   /* (2 * max_seqs) the drafting sequences, as indices into ss, then those that
                       only catch up this call */
    float *dlogits; /* (max_seqs * vocab) row t: the t-th drafting sequence's logits */
    int64_t max_seqs;
    duet_spec_accept_fn accept; /* duet_spec_accept, or a test's rule */
};

void duet_spec_opts_default(duet_spec_opts_t *o)
{
    *o = (duet_spec_opts_t){.method = DUET_SPEC_NONE,
                            .k = 4,
                            .ngram_min = 1,
                            .ngram_max = 3,
                            .draft_model = NULL,
                            .draft_page_tokens = 32};
}

duet_status_t duet_spec_opts_validate(const duet_spec_opts_t *o)
{
    if ((int)o->method < DUET_SPEC_NONE || (int)o->method > DUET_SPEC_DRAFT)
        return duet_error_set(DUET_ERR_INVALID, "spec.method: unknown method %d", (int)o->method);
    if (o->method == DUET_SPEC_NONE)
        return DUET_OK;
    if (o->k < 1 || o->k > DUET_SPEC_MAX_K)
        return duet_error_set(DUET_ERR_RANGE, "spec.k: %d is outside 1..%d", o->k, DUET_SPEC_MAX_K);
    if (o->method == DUET_SPEC_NGRAM &&
        (o->ngram_min < 1 || o->ngram_max < o->ngram_min || o->ngram_max > 16))
        return duet_error_set(DUET_ERR_RANGE,
                              "spec.ngram_min / spec.ngram_max: %d / %d (need 1 <= min <= max <= "
                              "16)",
                              o->ngram_min, o->ngram_max);
    if (o->method == DUET_SPEC_DRAFT && (o->draft_model == NULL || o->draft_model[0] == '\0'))
        return duet_error_set(DUET_ERR_INVALID,
                              "spec.method draft needs spec.draft_model (the draft checkpoint's "
                              "folder)");
    if (o->method == DUET_SPEC_DRAFT && o->draft_kv_pages < 0)
        return duet_error_set(DUET_ERR_RANGE, "draft KV pages: %lld (need >= 0)",
                              (long long)o->draft_kv_pages);
    if (o->method == DUET_SPEC_DRAFT && o->draft_page_tokens < 1)
        return duet_error_set(DUET_ERR_RANGE, "cache.draft_page_tokens: %lld (need >= 1)",
                              (long long)o->draft_page_tokens);
    return DUET_OK;
}

duet_status_t duet_spec_opts_from_config(const duet_config_t *cfg, duet_spec_opts_t *o)
{
    duet_spec_opts_default(o);
    o->k = (int)duet_config_get_int(cfg, "spec.k");
    o->ngram_min = (int)duet_config_get_int(cfg, "spec.ngram_min");
    o->ngram_max = (int)duet_config_get_int(cfg, "spec.ngram_max");
    o->draft_model = duet_config_get_string(cfg, "spec.draft_model");
    o->draft_page_tokens = duet_config_get_int(cfg, "cache.draft_page_tokens");
    duet_status_t st = duet_spec_method_parse(duet_config_get_enum(cfg, "spec.method"), &o->method);
    return st == DUET_OK ? duet_spec_opts_validate(o) : st;
}

int64_t duet_spec_target_rows(const duet_spec_opts_t *o)
{
    return o->method == DUET_SPEC_NONE ? 0 : o->k + 1;
}

void duet_spec_destroy(duet_spec_t *sp)
{
    if (sp == NULL)
        return;
    duet_model_free(sp->draft);
    duet_sampler_destroy(sp->sampler);
    free(sp->scratch);
    free(sp->items);
    free(sp->tok);
    free(sp->idx);
    free(sp->dlogits);
    free(sp);
}

void duet_spec_draft_opts(const duet_spec_opts_t *o, const duet_model_opts_t *to,
                          duet_model_opts_t *dopts)
{
    duet_model_opts_default(dopts);
    dopts->device = to->device; /* the draft's pools and steps beside the target's */
    dopts->n_threads = to->n_threads;
    dopts->max_seqs = to->max_seqs;
    dopts->max_seq_len = to->max_seq_len + o->k + 1;
    dopts->page_tokens = o->draft_page_tokens;
    dopts->kv_pages = o->draft_kv_pages;
    /* whole catch-up items (up to DUET_SPEC_CATCHUP_ROWS rows) and a draft step of every
     * sequence must fit one forward */
    dopts->max_batch_tokens = to->max_batch_tokens;
    if (dopts->max_batch_tokens < DUET_SPEC_CATCHUP_ROWS)
        dopts->max_batch_tokens = DUET_SPEC_CATCHUP_ROWS;
    if (dopts->max_batch_tokens < to->max_seqs)
        dopts->max_batch_tokens = to->max_seqs;
}

duet_status_t duet_spec_create(const duet_spec_opts_t *o, duet_model_t *target, duet_spec_t **sp_p)
{
    duet_status_t st = duet_spec_opts_validate(o);
    if (st != DUET_OK)
        return st;
    const duet_model_opts_t *to = duet_model_opts(target);
    if (o->method != DUET_SPEC_NONE && to->spec_rows < o->k + 1)
        return duet_error_set(DUET_ERR_INVALID,
                              "speculation with spec.k %d needs the target loaded with spec_rows "
                              ">= %d (it has %lld)",
                              o->k, o->k + 1, (long long)to->spec_rows);
    duet_spec_t *sp = calloc(1, sizeof(*sp));
    if (sp == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "spec: out of memory");
    sp->o = *o;
    sp->target = target;
    sp->accept = duet_spec_accept;
    sp->vocab = duet_model_config(target)->vocab_size;
    sp->max_seqs = to->max_seqs;
    sp->scratch = malloc(sizeof(float) * 2 * (size_t)sp->vocab);
    if (sp->scratch == NULL || (st = duet_sampler_create(sp->vocab, &sp->sampler)) != DUET_OK) {
        duet_spec_destroy(sp);
        return st != DUET_OK ? st : duet_error_set(DUET_ERR_NOMEM, "spec: out of memory");
    }
    if (o->method == DUET_SPEC_DRAFT) {
        duet_model_opts_t dopts;
        duet_spec_draft_opts(o, to, &dopts);
        if ((st = duet_model_load(o->draft_model, &dopts, &sp->draft)) != DUET_OK) {
            duet_spec_destroy(sp);
            return st;
        }
        const duet_model_config_t *dc = duet_model_config(sp->draft);
        if (dc->vocab_size != sp->vocab) {
            st = duet_error_set(DUET_ERR_UNSUPPORTED,
                                "%s: the draft model's vocabulary (%lld) is not the target's "
                                "(%lld)",
                                o->draft_model, (long long)dc->vocab_size, (long long)sp->vocab);
        }
        sp->draft_rows = dopts.max_batch_tokens;
        sp->items = calloc((size_t)sp->max_seqs, sizeof(*sp->items));
        sp->tok = calloc((size_t)sp->max_seqs, sizeof(*sp->tok));
        sp->idx = calloc(2 * (size_t)sp->max_seqs, sizeof(*sp->idx));
        sp->dlogits = malloc(sizeof(float) * (size_t)sp->max_seqs * (size_t)sp->vocab);
        if (st == DUET_OK &&
            (sp->items == NULL || sp->tok == NULL || sp->idx == NULL || sp->dlogits == NULL))
            st = duet_error_set(DUET_ERR_NOMEM, "spec: out of memory");
        if (st != DUET_OK) {
            duet_spec_destroy(sp);
            return st;
        }
    }
    *sp_p = sp;
    return DUET_OK;
}

const duet_spec_opts_t *duet_spec_opts(const duet_spec_t *sp)
{
    return &sp->o;
}

void duet_spec_set_accept_rule(duet_spec_t *sp, duet_spec_accept_fn rule)
{
    sp->accept = rule != NULL ? rule : duet_spec_accept;
}

void duet_spec_seq_close(duet_spec_t *sp, duet_spec_seq_t *ss)
{
    if (sp->draft != NULL && ss->dseq.id >= 0)
        duet_model_seq_close(sp->draft, &ss->dseq);
    free(ss->hist);
    free(ss->q);
    free(ss->dstate);
    memset(ss, 0, sizeof(*ss));
    ss->dseq.id = -1;
}

/* Run the draft model over the history tokens each sequence ss[which[t]] does not hold yet, at
 * most DUET_SPEC_CATCHUP_ROWS of them; with want_logits (only for sequences that catch up
 * completely), the logits after its newest token into dlogits row t. A sequence's rows always go
 * in one item of one forward and forwards carry whole items up to draft_rows rows: how its rows
 * are computed (the KDA chunks) then depends on nothing but the sequence, not on the batch. */
static duet_status_t duet__draft_catch_up(duet_spec_t *sp, duet_spec_seq_t *const *ss,
                                          const int64_t *which, int64_t n, int want_logits)
{
    int64_t n_items = 0, rows = 0;
    for (int64_t j = 0; j <= n; j++) {
        int64_t take = 0;
        duet_spec_seq_t *s = NULL;
        if (j < n) {
            s = ss[which[j]];
            take = s->n_hist - s->dseq.n_tokens;
            if (take > DUET_SPEC_CATCHUP_ROWS)
                take = DUET_SPEC_CATCHUP_ROWS;
            if (take <= 0)
                continue;
        }
        if (n_items > 0 && (j == n || rows + take > sp->draft_rows)) {
            duet_status_t st = duet_model_forward(sp->draft, sp->items, n_items);
            if (st != DUET_OK)
                return st;
            n_items = rows = 0;
        }
        if (j == n)
            break;
        const int last = s->dseq.n_tokens + take == s->n_hist;
        sp->items[n_items++] = (duet_batch_item_t){
            .seq = &s->dseq,
            .tokens = s->hist + s->dseq.n_tokens,
            .n_tokens = take,
            .logits_mode = last && want_logits ? DUET_LOGITS_LAST : DUET_LOGITS_NONE,
            .logits = sp->dlogits + j * sp->vocab,
        };
        rows += take;
    }
    return DUET_OK;
}

duet_status_t duet_spec_seq_open(duet_spec_t *sp, duet_spec_seq_t *ss, const int32_t *prompt,
                                 int64_t n_prompt, int32_t first, int64_t max_tokens,
                                 const duet_sampling_t *sampling, duet_rng_t *rng)
{
    memset(ss, 0, sizeof(*ss));
    ss->dseq.id = -1;
    ss->cap = n_prompt + max_tokens + 1;
    ss->hist = malloc(sizeof(*ss->hist) * (size_t)ss->cap);
    if (ss->hist == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "spec: out of memory");
    memcpy(ss->hist, prompt, sizeof(*prompt) * (size_t)n_prompt);
    ss->hist[n_prompt] = first;
    ss->n_hist = n_prompt + 1;
    ss->sampling = sampling;
    ss->rng = rng;
    if (sp->draft == NULL)
        return DUET_OK;
    duet_status_t st = DUET_OK;
    ss->q = malloc(sizeof(float) * DUET_SPEC_MAX_K * (size_t)sp->vocab);
    const size_t state_bytes = duet_model_seq_state_bytes(sp->draft);
    if (state_bytes > 0)
        ss->dstate = malloc(state_bytes);
    if (ss->q == NULL || (state_bytes > 0 && ss->dstate == NULL))
        st = duet_error_set(DUET_ERR_NOMEM, "spec: out of memory");
    if (st == DUET_OK)
        st = duet_model_seq_open(sp->draft, ss->cap + sp->o.k, &ss->dseq);
    if (st != DUET_OK)
        duet_spec_seq_close(sp, ss);
    return st;
}

int32_t duet_spec_seq_next(const duet_spec_seq_t *ss)
{
    return ss->hist[ss->n_hist - 1];
}

duet_status_t duet_spec_propose(duet_spec_t *sp, duet_spec_seq_t *const *ss, const int *k_cap,
                                int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        ss[i]->k = 0;
        ss[i]->q_valid = 0;
    }
    if (sp->o.method == DUET_SPEC_NGRAM) {
        for (int64_t i = 0; i < n; i++)
            if (k_cap[i] > 0)
                ss[i]->k = duet_spec_ngram_propose(ss[i]->hist, ss[i]->n_hist, sp->o.ngram_min,
                                                   sp->o.ngram_max, k_cap[i], ss[i]->drafts);
        return DUET_OK;
    }
    if (sp->o.method != DUET_SPEC_DRAFT)
        return DUET_OK;
    /* the sequences that draft: idx[t] into ss, their logits in dlogits row t */
    int64_t *idx = sp->idx, n_d = 0, kmax = 0;
    if (n > sp->max_seqs)
        return duet_error_set(DUET_ERR_RANGE, "spec: %lld sequences, the model holds %lld",
                              (long long)n, (long long)sp->max_seqs);
    /* A sequence behind the history by more than DUET_SPEC_CATCHUP_ROWS (a new request's long
     * prompt) takes that many rows per call, stays a token short (it drafts at a later call) and
     * drafts nothing now: a long prompt costs a step one bounded chunk instead of stalling the
     * step that opened it. The bound is per sequence, so when a request starts drafting depends
     * on nothing but its own prompt, and a seeded stream is the same in any batch. */
    int64_t n_part = 0, *part = sp->idx + n;
    for (int64_t i = 0; i < n; i++) {
        if (k_cap[i] <= 0)
            continue;
        const int64_t lag = ss[i]->n_hist - ss[i]->dseq.n_tokens;
        if (lag <= DUET_SPEC_CATCHUP_ROWS) {
            idx[n_d++] = i;
            if (k_cap[i] > kmax)
                kmax = k_cap[i];
        } else {
            part[n_part++] = i;
        }
    }
    duet_status_t st = duet__draft_catch_up(sp, ss, part, n_part, 0);
    if (st != DUET_OK || n_d == 0)
        return st;
    st = duet__draft_catch_up(sp, ss, idx, n_d, 1);
    /* a KDA state cannot drop the drafts fed to it: keep it as it is before them (a sequence
     * drafting one token feeds none) */
    for (int64_t t = 0; st == DUET_OK && t < n_d; t++) {
        duet_spec_seq_t *s = ss[idx[t]];
        if (s->dstate != NULL && k_cap[idx[t]] > 1) {
            st = duet_model_seq_state_save(sp->draft, &s->dseq, s->dstate);
            s->dstate_at = s->dseq.n_tokens;
        }
    }
    for (int64_t j = 0; st == DUET_OK && j < kmax; j++) {
        int64_t n_items = 0;
        for (int64_t t = 0; t < n_d; t++) {
            duet_spec_seq_t *s = ss[idx[t]];
            if (j >= k_cap[idx[t]])
                continue;
            const float *row = sp->dlogits + t * sp->vocab;
            const int greedy = duet_sampling_greedy(s->sampling);
            int32_t d;
            if (greedy) {
                d = duet_argmax(row, sp->vocab);
            } else {
                float *q = s->q + (int64_t)j * sp->vocab;
                duet_sampler_probs(sp->sampler, s->sampling, row, q);
                d = duet_sampler_sample(sp->sampler, s->sampling, s->rng, row);
                s->q_valid = 1;
            }
            s->drafts[j] = d;
            s->k = (int)j + 1;
            if (j + 1 < k_cap[idx[t]]) { /* feed it to draft the next one */
                sp->tok[n_items] = d;
                sp->items[n_items] = (duet_batch_item_t){
                    .seq = &s->dseq,
                    .tokens = &sp->tok[n_items],
                    .n_tokens = 1,
                    .logits_mode = DUET_LOGITS_LAST,
                    .logits = sp->dlogits + t * sp->vocab,
                };
                n_items++;
            }
        }
        if (n_items > 0)
            st = duet_model_forward(sp->draft, sp->items, n_items);
    }
    return st;
}

/* duet_spec_finish's rest once out[0..n) is chosen: the target keeps the rows, the history and
 * the counters record them, the draft sequence rolls back. */
static duet_status_t duet__spec_keep(duet_spec_t *sp, duet_spec_seq_t *ss, duet_seq_t *tseq,
                                     const int32_t *out, int n)
{
    const int k = ss->k;
    if (k > 0) {
        duet_status_t st = duet_model_seq_accept(sp->target, tseq, n);
        if (st != DUET_OK)
            return st;
        ss->verify_steps++;
        ss->drafted += (uint64_t)k;
        ss->kept += (uint64_t)(n - 1);
        for (int j = 0; j < k; j++) {
            ss->drafted_at[j]++;
            ss->kept_at[j] += j < n - 1;
        }
    }
    if (ss->n_hist + n > ss->cap)
        return duet_error_set(DUET_ERR_RANGE, "spec: more tokens than the request's max_tokens");
    const int64_t old = ss->n_hist;
    memcpy(ss->hist + ss->n_hist, out, sizeof(*out) * (size_t)n);
    ss->n_hist += n;
    /* the draft sequence holds the old history and drafts[0..k-1): keep what stayed true. An
     * MLA-only one drops the rest; one with KDA layers goes back to the state saved before the
     * drafts (at `old` tokens) and the next catch-up forwards the kept ones again */
    if (sp->draft != NULL && k > 0) {
        const int64_t valid = old + (n - 1 < k - 1 ? n - 1 : k - 1);
        if (ss->dseq.n_tokens > valid) {
            DUET_ASSERT(ss->dstate == NULL || ss->dstate_at == old);
            duet_status_t st = duet_model_seq_truncate(
                sp->draft, &ss->dseq, ss->dstate != NULL ? ss->dstate_at : valid, ss->dstate);
            if (st != DUET_OK)
                return st;
        }
    }
    ss->k = 0;
    return DUET_OK;
}

duet_status_t duet_spec_finish(duet_spec_t *sp, duet_spec_seq_t *ss, duet_seq_t *tseq,
                               const float *logits, int32_t *out, int *n_p)
{
    const int k = ss->k;
    int n = 1;
    if (k == 0)
        out[0] = duet_sampler_sample(sp->sampler, ss->sampling, ss->rng, logits);
    else
        n = sp->accept(sp->sampler, ss->sampling, ss->rng, logits, sp->vocab, ss->drafts, k,
                       ss->q_valid ? ss->q : NULL, sp->scratch, out);
    duet_status_t st = duet__spec_keep(sp, ss, tseq, out, n);
    if (st == DUET_OK)
        *n_p = n;
    return st;
}

int duet_spec_seq_greedy(const duet_spec_seq_t *ss)
{
    return duet_sampling_greedy(ss->sampling);
}

duet_status_t duet_spec_finish_argmax(duet_spec_t *sp, duet_spec_seq_t *ss, duet_seq_t *tseq,
                                      const int32_t *row_tokens, int32_t *out, int *n_p)
{
    if (!duet_spec_seq_greedy(ss))
        return duet_error_set(DUET_ERR_INVALID,
                              "spec: a sampling request's verify needs its rows' logits");
    /* duet_spec_accept's greedy rule on the rows' arg-maxes: drafts kept while they equal them,
     * then the arg-max of the row after the last kept one */
    const int k = ss->k;
    int n = 0;
    while (n < k && row_tokens[n] == ss->drafts[n]) {
        out[n] = row_tokens[n];
        n++;
    }
    out[n] = row_tokens[n];
    n++;
    duet_status_t st = duet__spec_keep(sp, ss, tseq, out, n);
    if (st == DUET_OK)
        *n_p = n;
    return st;
}
