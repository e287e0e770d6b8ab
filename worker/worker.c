/* What duet-ctx and duet-gen share; see worker/worker.h. */
#include "worker/worker.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "common/log.h"
#include "proto/envelope.h"

const char *const duet_worker_devices[] = {"auto", "cpu", "cuda", NULL};
const char *const duet_worker_dtypes[] = {"auto", "f32", "bf16", NULL};
const char *const duet_worker_device_pools_modes[] = {"off", "auto", NULL};

duet_status_t duet_worker_model_opts(const duet_config_t *cfg, duet_model_opts_t *o)
{
    duet_model_opts_default(o);
    o->n_threads = (int)duet_config_get_int(cfg, "threads");
    o->max_batch_tokens = duet_config_get_int(cfg, "batch.max_tokens");
    o->max_seqs = duet_config_get_int(cfg, "batch.max_seqs");
    o->max_seq_len = duet_config_get_int(cfg, "cache.max_seq_len");
    o->page_tokens = duet_config_get_int(cfg, "cache.page_tokens");
    o->kv_pages = duet_config_get_int(cfg, "cache.kv_pages");
    /* the config validated the enum (auto / cpu / cuda) and every build has both backends'
     * tables (a CPU-only build a cuda stub whose load fails, saying why); should the engine ever
     * not take one of them, the start fails rather than running somewhere else */
    const char *dev = duet_config_get_enum(cfg, "device");
    if (duet_model_device_parse(dev, &o->device) != DUET_OK)
        return duet_error_set(DUET_ERR_UNSUPPORTED, "device: this build has no %s backend", dev);
    /* only auto / f32 / bf16 reach here */
    if (duet_model_dtype_parse(duet_config_get_enum(cfg, "dtype"), &o->dtype) != DUET_OK)
        o->dtype = DUET_MODEL_DTYPE_AUTO;
    return DUET_OK;
}

/* A UCX list value: names of [A-Za-z0-9_.:-] joined by commas, optionally led by '^'. */
static bool duet__ucx_list_ok(const char *v)
{
    if (*v == '^')
        v++;
    if (*v == '\0' || strlen(v) > 1024)
        return false;
    bool item = false; /* the current name has a character */
    for (; *v != '\0'; v++) {
        const char c = *v;
        if (c == ',') {
            if (!item)
                return false;
            item = false;
        } else if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                   c == '_' || c == '.' || c == ':' || c == '-') {
            item = true;
        } else {
            return false;
        }
    }
    return item;
}

duet_status_t duet_worker_ucx_env(const duet_config_t *cfg)
{
    static const char *const map[][2] = {{"ucx.tls", "UCX_TLS"},
                                         {"ucx.net_devices", "UCX_NET_DEVICES"}};
    const size_t n = sizeof(map) / sizeof(map[0]);
    for (size_t i = 0; i < n; i++) { /* all checked before any is set */
        const char *v = duet_config_get_string(cfg, map[i][0]);
        if (v != NULL && *v != '\0' && !duet__ucx_list_ok(v))
            return duet_error_set(DUET_ERR_INVALID,
                                  "%s: '%s' is not a UCX list (names of letters, digits, _ . : - "
                                  "separated by commas, optionally led by ^)",
                                  map[i][0], v);
    }
    for (size_t i = 0; i < n; i++) {
        const char *v = duet_config_get_string(cfg, map[i][0]);
        const char *env = getenv(map[i][1]);
        if (v != NULL && *v != '\0') {
            /* the role's own key is the more specific choice than a variable the whole job may
             * have inherited; the operator sees that it was replaced */
            if (env != NULL && strcmp(env, v) != 0)
                DUET_LOG_WARN("%s=%s replaces %s=%s from the environment", map[i][0], v, map[i][1],
                              env);
            if (setenv(map[i][1], v, 1) != 0)
                return duet_error_set(DUET_ERR_NOMEM, "setenv %s", map[i][1]);
            DUET_LOG_INFO("UCX: %s=%s (from %s)", map[i][1], v, map[i][0]);
        } else {
            DUET_LOG_INFO("UCX: %s=%s", map[i][1], env != NULL ? env : "unset (UCX's own choice)");
        }
    }
    return DUET_OK;
}

bool duet_worker_device_pools(const duet_config_t *cfg, const duet_model_opts_t *mo,
                              duet_xfer_ctx_t *x)
{
    return mo->device == DUET_DEVICE_CUDA &&
           strcmp(duet_config_get_enum(cfg, "transfer.device_pools"), "auto") == 0 &&
           duet_xfer_ctx_mem_supported(x, DUET_XFER_MEM_CUDA);
}

duet_status_t duet_worker_register_pools(duet_xfer_ctx_t *x, duet_model_t *m, bool device)
{
    duet_kv_pool_t *kv = duet_model_kv_pool(m);
    duet_kda_pool_t *kda = duet_model_kda_pool(m);
    void *kv_base = kv != NULL ? duet_kv_pool_base(kv) : NULL;
    void *kda_base = kda != NULL ? duet_kda_pool_base(kda) : NULL;
    const duet_xfer_mem_kind_t kind = device ? DUET_XFER_MEM_CUDA : DUET_XFER_MEM_HOST;
    if (device) {
        size_t kv_dev_bytes, kda_dev_bytes;
        duet_model_device_pools(m, &kv_base, &kv_dev_bytes, &kda_base, &kda_dev_bytes);
        if ((kv != NULL && (kv_base == NULL || kv_dev_bytes < duet_kv_pool_bytes(kv))) ||
            (kda != NULL && (kda_base == NULL || kda_dev_bytes < duet_kda_pool_bytes(kda))))
            return duet_error_set(DUET_ERR_INTERNAL,
                                  "the model's device pools do not cover its host pools");
    }
    duet_replay_pool_t *rp = duet_model_replay_pool(m);
    if (device && rp != NULL)
        return duet_error_set(DUET_ERR_UNSUPPORTED,
                              "moving a device model's KDA replay rows is not built");
    duet_status_t st = DUET_OK;
    if (kv != NULL)
        st = duet_xfer_ctx_register(x, DUET_XFER_POOL_KV, kv_base, duet_kv_pool_bytes(kv), kind);
    if (st == DUET_OK && kda != NULL)
        st =
            duet_xfer_ctx_register(x, DUET_XFER_POOL_KDA, kda_base, duet_kda_pool_bytes(kda), kind);
    if (st == DUET_OK && rp != NULL)
        st = duet_xfer_ctx_register(x, DUET_XFER_POOL_REPLAY, duet_replay_pool_base(rp),
                                    duet_replay_pool_bytes(rp), DUET_XFER_MEM_HOST);
    return st;
}

duet_xfer_pool_t duet_worker_xfer_pool(duet_model_pool_t which)
{
    switch (which) {
    case DUET_MODEL_POOL_KV:
        return DUET_XFER_POOL_KV;
    case DUET_MODEL_POOL_KDA:
        return DUET_XFER_POOL_KDA;
    case DUET_MODEL_POOL_REPLAY:
        return DUET_XFER_POOL_REPLAY;
    }
    return DUET_XFER_N_POOLS; /* refused by duet_xfer_ctx_alloc */
}

void *duet_worker_pool_alloc(void *xfer_ctx, duet_model_pool_t which, size_t bytes)
{
    void *base = NULL;
    if (duet_xfer_ctx_alloc(xfer_ctx, duet_worker_xfer_pool(which), bytes, DUET_XFER_MEM_HOST,
                            &base) != DUET_OK) {
        DUET_LOG_ERROR("cannot allocate a %zu-byte pool through UCX: %s", bytes, duet_error_last());
        return NULL;
    }
    return base;
}

void duet_worker_layout(duet_model_t *m, duet_xfer_layout_t *l)
{
    const duet_model_config_t *c = duet_model_config(m);
    duet_kv_pool_t *kv = duet_model_kv_pool(m);
    duet_kda_pool_t *kda = duet_model_kda_pool(m);
    memset(l, 0, sizeof(*l));
    l->page_tokens = (uint32_t)duet_model_opts(m)->page_tokens;
    if (kv != NULL) { /* the pool's own numbers (common/cache_layout.h), not a second formula */
        const duet_kv_layout_t kl = duet_kv_pool_layout(kv);
        l->n_mla_layers = (uint32_t)kl.n_layers;
        l->token_bytes = (uint32_t)kl.token_bytes;
    } else {
        l->token_bytes = (uint32_t)((c->kv_lora_rank + c->qk_rope_head_dim) * 4);
    }
    l->state_elem = 4;
    if (kda != NULL) {
        const duet_kda_layout_t dl = duet_kda_pool_layout(kda);
        l->n_kda_layers = (uint32_t)dl.n_layers;
        l->kda_heads = (uint32_t)dl.heads;
        l->kda_head_dim = (uint32_t)dl.head_dim;
        l->conv_kernel = (uint32_t)dl.conv_kernel;
        l->state_elem = (uint32_t)dl.elem_bytes;
    } else {
        l->kda_heads = 1;
        l->kda_head_dim = 1;
        l->conv_kernel = 1;
    }
    duet_replay_pool_t *rp = duet_model_replay_pool(m);
    l->replay_rows = rp != NULL ? (uint32_t)duet_replay_pool_layout(rp).rows : 0;
}

/* ---- UCX on the loop ------------------------------------------------------------------ */

void duet_worker_pump_check_frozen(duet_worker_pump_t *p)
{
    const uint64_t now = uv_hrtime() / 1000000;
    if (p->frozen_ms > 0 && p->on_frozen != NULL && p->last_ms > 0 &&
        now - p->last_ms > p->frozen_ms)
        p->on_frozen(p->frozen_user, now - p->last_ms);
}

void duet_worker_pump_progress(duet_worker_pump_t *p)
{
    duet_worker_pump_check_frozen(p);
    p->last_ms = uv_hrtime() / 1000000;
    while (duet_xfer_ctx_progress(p->x) > 0) {
    }
}

static void pump_on_timer(uv_timer_t *t)
{
    duet_worker_pump_progress(t->data);
}

static void pump_on_poll(uv_poll_t *h, int status, int events)
{
    duet_worker_pump_progress(h->data);
}

/* Before the loop sleeps: drain UCX, arm its fd, and wake at its next deadline. */
static void pump_on_prepare(uv_prepare_t *h)
{
    duet_worker_pump_t *p = h->data;
    for (int i = 0; i < 64; i++) {
        duet_worker_pump_progress(p);
        if (duet_xfer_ctx_arm(p->x) == DUET_OK)
            break;
    }
    int ms = duet_xfer_ctx_timeout_ms(p->x);
    if (ms >= 0)
        uv_timer_start(&p->timer, pump_on_timer, (uint64_t)ms, 0);
    else
        uv_timer_stop(&p->timer);
}

duet_status_t duet_worker_pump_start(uv_loop_t *loop, duet_xfer_ctx_t *x, duet_worker_pump_t *p)
{
    memset(p, 0, sizeof(*p));
    p->x = x;
    int rc = uv_poll_init(loop, &p->poll, duet_xfer_ctx_fd(x));
    if (rc == 0)
        rc = uv_prepare_init(loop, &p->prep);
    if (rc == 0)
        rc = uv_timer_init(loop, &p->timer);
    if (rc < 0)
        return duet_error_set(DUET_ERR_IO, "libuv: %s", uv_strerror(rc));
    p->poll.data = p;
    p->prep.data = p;
    p->timer.data = p;
    uv_poll_start(&p->poll, UV_READABLE, pump_on_poll);
    uv_prepare_start(&p->prep, pump_on_prepare);
    return DUET_OK;
}

void duet_worker_pump_stop(duet_worker_pump_t *p)
{
    if (!uv_is_closing((uv_handle_t *)&p->poll)) {
        uv_close((uv_handle_t *)&p->poll, NULL);
        uv_close((uv_handle_t *)&p->prep, NULL);
        uv_close((uv_handle_t *)&p->timer, NULL);
    }
}

/* ---- requests ------------------------------------------------------------------------- */

/* The response_format mask's vocabulary (duet_worker_set_json_vocab). */
static const duet_json_vocab_t *g_json_vocab;

void duet_worker_set_json_vocab(const duet_json_vocab_t *v)
{
    g_json_vocab = v;
}

void duet_worker_sampling_init(duet_worker_sampling_t *w, const Duet__Sampling *s, uint64_t rid)
{
    memset(w, 0, sizeof(*w));
    duet_sampling_default(&w->sp);
    uint64_t seed = 0;
    if (s != NULL) {
        w->sp.temperature = s->temperature > 0 ? s->temperature : 0.0f;
        w->sp.top_p = s->top_p > 0 && s->top_p <= 1 ? s->top_p : 1.0f;
        w->sp.top_k = s->top_k;
        for (size_t i = 0; i < s->n_stop_token_ids && w->n_stop < DUET_WORKER_MAX_STOP; i++)
            w->stop[w->n_stop++] = s->stop_token_ids[i];
        if (s->has_seed)
            seed = s->seed;
        /* the router validated the ranges; what does not fit is left out rather than read */
        w->proc.presence_penalty = s->presence_penalty;
        w->proc.frequency_penalty = s->frequency_penalty;
        w->proc.repetition_penalty = s->repetition_penalty;
        for (size_t i = 0; i < s->n_logit_bias && i < DUET_WORKER_MAX_BIAS; i++)
            w->bias[i] = (duet_logit_bias_t){.id = (int32_t)s->logit_bias[i]->id,
                                             .bias = s->logit_bias[i]->bias};
        w->proc.n_bias =
            s->n_logit_bias < DUET_WORKER_MAX_BIAS ? s->n_logit_bias : DUET_WORKER_MAX_BIAS;
        w->proc.min_tokens = s->min_tokens;
        w->logprobs = s->logprobs;
        w->n_top =
            s->top_logprobs < DUET_MAX_TOP_LOGPROBS ? (int)s->top_logprobs : DUET_MAX_TOP_LOGPROBS;
        w->prompt_logprobs = s->prompt_logprobs;
        if (s->response_format != NULL && s->response_format[0] != '\0') {
            w->grammar = strcmp(s->response_format, "json_object") == 0;
            duet_json_init(&w->js, 1);
            if (strcmp(s->response_format, "json_schema") == 0 && s->json_schema != NULL &&
                duet_jschema_compile(s->json_schema, strlen(s->json_schema), &w->schema) ==
                    DUET_OK) {
                duet_jschema_start(w->schema, &w->jss);
                w->grammar = true;
            }
            w->bad_format = !w->grammar;
        }
    }
    w->proc.bias = w->bias;
    w->proc.stop_ids = w->stop;
    w->proc.n_stop = w->n_stop;
    w->host = duet_logit_proc_active(&w->proc) || w->logprobs || w->prompt_logprobs || w->grammar;
    if (s == NULL || !s->has_seed)
        if (getrandom(&seed, sizeof(seed), 0) != (ssize_t)sizeof(seed))
            seed = rid * 0x9e3779b97f4a7c15ull ^ (uint64_t)(duet_worker_now() * 1e9);
    w->sp.seed = seed;
    duet_rng_seed(&w->rng, seed);
}

bool duet_worker_sampling_setup(duet_worker_sampling_t *w, const uint32_t *prompt, size_t n_prompt,
                                const uint32_t *generated, size_t n_generated, uint32_t max_tokens,
                                int64_t vocab, int64_t chunk, const char **why)
{
    /* the router validated these; a worker still refuses what would make NaN logits */
    const duet_logit_proc_t *lp = &w->proc;
    if (!isfinite(lp->presence_penalty) || !isfinite(lp->frequency_penalty) ||
        !isfinite(lp->repetition_penalty) || lp->repetition_penalty < 0.0f) {
        *why = "Sampling: a penalty is not a finite number (repetition_penalty >= 0)";
        return false;
    }
    for (size_t i = 0; i < lp->n_bias; i++)
        if (!isfinite(w->bias[i].bias)) {
            *why = "Sampling: a logit_bias is not a finite number";
            return false;
        }
    *why = "out of memory";
    for (size_t i = 0; i < w->proc.n_bias; i++)
        if (w->bias[i].id >= vocab) {
            *why = "logit_bias: a token id is outside the vocabulary";
            return false;
        }
    if (w->bad_format) {
        *why = "Sampling: unknown response_format (this worker knows \"json_object\" and "
               "\"json_schema\" with a schema it compiles)";
        return false;
    }
    if (w->grammar && (g_json_vocab == NULL || duet_json_vocab_size(g_json_vocab) != vocab)) {
        *why = "response_format needs the model folder's tokenizer, which this worker has not "
               "loaded";
        return false;
    }
    if (!w->host)
        return true;
    if (w->grammar && (w->ok = malloc((size_t)vocab)) == NULL)
        return false;
    if (duet_logit_proc_needs_hist(&w->proc)) {
        if (prompt == NULL && n_prompt > 0) {
            *why = "the penalties need the prompt ids";
            return false;
        }
        /* distinct ids at most: prompt + output, and never more than the vocabulary; adding
         * then never grows the table (it grows when more than half full) */
        int64_t distinct = (int64_t)n_prompt + max_tokens;
        distinct = distinct < vocab ? distinct : vocab;
        if (duet_token_hist_reserve(&w->hist, (size_t)distinct) != DUET_OK)
            return false;
        for (size_t i = 0; i < n_prompt; i++)
            (void)duet_token_hist_add(&w->hist, (int32_t)prompt[i], 1);
    }
    for (size_t i = 0; i < n_generated; i++)
        duet_worker_sampling_seen(w, (int32_t)generated[i]);
    w->rows_cap = w->prompt_logprobs ? chunk : 1;
    w->rows = malloc(sizeof(float) * (size_t)vocab * (size_t)(w->rows_cap + 1));
    if (w->rows == NULL)
        return false;
    if (w->prompt_logprobs && n_prompt > 1) {
        w->prompt_lp = calloc(n_prompt - 1, sizeof(*w->prompt_lp));
        if (w->prompt_lp == NULL)
            return false;
        w->n_prompt_lp = (int64_t)n_prompt - 1;
    }
    return true;
}

void duet_worker_sampling_seen(duet_worker_sampling_t *w, int32_t tok)
{
    w->n_generated++;
    if (duet_logit_proc_needs_hist(&w->proc))
        (void)duet_token_hist_add(&w->hist, tok, 0); /* room reserved by setup */
    if (w->grammar && !duet_worker_is_stop(w, tok)) {
        size_t n;
        const uint8_t *b = duet_json_vocab_bytes(g_json_vocab, (uint32_t)tok, &n);
        /* the mask let only accepted ids through; an id it rejects (a replayed one that came
         * from elsewhere) leaves the automaton where it was, which keeps masking */
        if (w->schema != NULL) {
            duet_jschema_state_t t = w->jss;
            if (b != NULL && duet_jschema_feed_n(w->schema, &t, b, n))
                w->jss = t;
        } else {
            duet_json_t t = w->js;
            if (b != NULL && duet_json_feed_n(&t, b, n))
                w->js = t;
        }
    }
}

/*
 * response_format: ids the automaton rejects to -inf in row; the stop ids allowed exactly when
 * the JSON is complete. When nothing would be left (complete, and no stop id: ignore_eos) the
 * row is left as it is.
 */
static void duet__worker_mask(duet_worker_sampling_t *w, float *row, int64_t vocab)
{
    int done;
    if (w->schema != NULL) {
        (void)duet_jschema_allowed(w->schema, &w->jss, g_json_vocab, w->ok);
        done = duet_jschema_accepting(w->schema, &w->jss);
    } else {
        (void)duet_json_allowed(&w->js, g_json_vocab, w->ok);
        done = duet_json_accepting(&w->js);
    }
    for (size_t i = 0; i < w->n_stop; i++)
        if ((int64_t)w->stop[i] < vocab)
            w->ok[w->stop[i]] = (uint8_t)done;
    if (memchr(w->ok, 1, (size_t)vocab) == NULL)
        return;
    for (int64_t i = 0; i < vocab; i++)
        if (!w->ok[i])
            row[i] = -INFINITY;
}

void duet_worker_sampling_free(duet_worker_sampling_t *w)
{
    duet_token_hist_free(&w->hist);
    free(w->rows);
    free(w->prompt_lp);
    free(w->ok);
    w->ok = NULL;
    duet_jschema_free(w->schema);
    w->schema = NULL;
    w->rows = NULL;
    w->prompt_lp = NULL;
    w->n_prompt_lp = 0;
}

bool duet_worker_sampling_speculates(const duet_worker_sampling_t *w)
{
    return !duet_logit_proc_active(&w->proc) && !w->grammar;
}

void duet_worker_logprob(const duet_worker_sampling_t *w, const float *raw, int64_t vocab,
                         int32_t chosen, duet_worker_logprob_t *out)
{
    out->n_top = w->n_top < vocab ? w->n_top : (int)vocab;
    duet_logprobs(raw, vocab, chosen, out->n_top, &out->logprob, out->top_ids, out->top_lps);
}

int32_t duet_worker_host_draw(duet_worker_sampling_t *w, duet_sampler_t *smp, const float *raw,
                              float *scratch, int64_t vocab, float u)
{
    const float *row = raw;
    if (duet_logit_proc_active(&w->proc)) {
        memcpy(scratch, raw, sizeof(float) * (size_t)vocab);
        duet_logits_process(&w->proc, &w->hist, w->n_generated, scratch, vocab);
        row = scratch;
    }
    if (w->grammar) {
        if (row != scratch)
            memcpy(scratch, raw, sizeof(float) * (size_t)vocab);
        duet__worker_mask(w, scratch, vocab);
        row = scratch;
    }
    const int32_t t = duet_sampler_sample_u(smp, &w->sp, u, row);
    if (w->logprobs)
        duet_worker_logprob(w, raw, vocab, t, &w->drawn_lp);
    duet_worker_sampling_seen(w, t);
    return t;
}

void duet_worker_prompt_logprobs(duet_worker_sampling_t *w, const int32_t *prompt, int64_t from,
                                 int64_t n_rows, const float *rows, int64_t vocab)
{
    for (int64_t j = 0; j < n_rows; j++) {
        const int64_t a = from + j; /* row a scores prompt[a + 1] */
        if (a < w->n_prompt_lp)
            duet_worker_logprob(w, rows + j * vocab, vocab, prompt[a + 1], &w->prompt_lp[a]);
    }
}

bool duet_worker_is_stop(const duet_worker_sampling_t *w, int32_t tok)
{
    for (size_t i = 0; i < w->n_stop; i++)
        if ((int32_t)w->stop[i] == tok)
            return true;
    return false;
}

int64_t duet_worker_chunk_end(int64_t prefilled, int64_t n_prompt, int64_t chunk)
{
    int64_t end = (prefilled / chunk + 1) * chunk;
    return end < n_prompt ? end : n_prompt;
}

/* ---- messages ------------------------------------------------------------------------- */

void duet_worker_send_tokens(duet_link_t *link, uint64_t rid, const uint32_t *ids, size_t n,
                             int finish, const char *error)
{
    Duet__Tokens t = DUET__TOKENS__INIT;
    t.request_id = rid;
    t.ids = (uint32_t *)ids;
    t.n_ids = n;
    t.finish_reason = finish;
    t.error = (char *)(error != NULL ? error : "");
    Duet__Envelope env = duet_envelope_tokens(&t);
    if (duet_link_send(link, &env) < 0)
        DUET_RLOG_WARN(rid, "tokens not sent: %s", duet_error_last());
}

void duet_worker_send_tokens_lp(duet_link_t *link, uint64_t rid, const uint32_t *ids, size_t n,
                                const duet_worker_logprob_t *lps,
                                const duet_worker_logprob_t *prompt_lps, size_t n_prompt_lps,
                                int finish, const char *error)
{
    if (lps == NULL && n_prompt_lps == 0) {
        duet_worker_send_tokens(link, rid, ids, n, finish, error);
        return;
    }
    const size_t n_lp = lps != NULL ? n : 0, total = n_lp + n_prompt_lps;
    Duet__TokenLogprob *m = calloc(total ? total : 1, sizeof(*m));
    Duet__TokenLogprob **p = calloc(total ? total : 1, sizeof(*p));
    uint32_t *top_ids = calloc((total ? total : 1) * DUET_MAX_TOP_LOGPROBS, sizeof(*top_ids));
    if (m == NULL || p == NULL || top_ids == NULL) {
        free(m);
        free(p);
        free(top_ids);
        duet_worker_send_tokens(link, rid, NULL, 0, DUET__TOKENS__FINISH_REASON__ERROR,
                                "out of memory for the log-probabilities");
        return;
    }
    for (size_t i = 0; i < total; i++) {
        const duet_worker_logprob_t *l = i < n_lp ? &lps[i] : &prompt_lps[i - n_lp];
        duet__token_logprob__init(&m[i]);
        m[i].logprob = l->logprob;
        m[i].n_top_ids = m[i].n_top_logprobs = (size_t)l->n_top;
        m[i].top_ids = top_ids + i * DUET_MAX_TOP_LOGPROBS;
        for (int k = 0; k < l->n_top; k++)
            m[i].top_ids[k] = (uint32_t)l->top_ids[k];
        m[i].top_logprobs = (float *)l->top_lps;
        p[i] = &m[i];
    }
    Duet__Tokens t = DUET__TOKENS__INIT;
    t.request_id = rid;
    t.ids = (uint32_t *)ids;
    t.n_ids = n;
    t.finish_reason = finish;
    t.error = (char *)(error != NULL ? error : "");
    t.logprobs = n_lp ? p : NULL;
    t.n_logprobs = n_lp;
    t.prompt_logprobs = n_prompt_lps ? p + n_lp : NULL;
    t.n_prompt_logprobs = n_prompt_lps;
    Duet__Envelope env = duet_envelope_tokens(&t);
    if (duet_link_send(link, &env) < 0)
        DUET_RLOG_WARN(rid, "tokens not sent: %s", duet_error_last());
    free(m);
    free(p);
    free(top_ids);
}

void duet_worker_send_refused(duet_link_t *link, uint64_t rid, const char *reason,
                              uint32_t retry_after_ms)
{
    Duet__Refused r = DUET__REFUSED__INIT;
    r.request_id = rid;
    r.reason = (char *)reason;
    r.retry_after_ms = retry_after_ms;
    Duet__Envelope env = duet_envelope_refused(&r);
    if (duet_link_send(link, &env) < 0)
        DUET_RLOG_WARN(rid, "refusal not sent: %s", duet_error_last());
}

double duet_worker_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}
