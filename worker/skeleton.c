/*
 * The worker skeleton; see worker/skeleton.h. Start-up fails with a message on stderr and exit
 * status 1 (2 for a bad command line); once registered, everything runs from the loop until a
 * signal or a lost router stops it.
 */
#include "worker/skeleton.h"

#include <ctype.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/fingerprint.h"
#include "common/log.h"
#include "common/version.h"
#include "kernels/kernels.h"
#include "proto/envelope.h"
#include "tokenizer/tokenizer.h"
#include "worker/metrics.h"

/* ---- requests ------------------------------------------------------------------------- */

duet_worker_req_t *duet_worker_find(const duet_worker_t *w, uint64_t rid)
{
    for (int64_t i = 0; i < w->n_reqs; i++) {
        duet_worker_req_t *r = duet_worker_req(w, i);
        if (r->phase != 0 && r->rid == rid)
            return r;
    }
    return NULL;
}

static duet_worker_req_t *w_find_xfer(const duet_worker_t *w, duet_xfer_id_t id)
{
    for (int64_t i = 0; i < w->n_reqs; i++) {
        duet_worker_req_t *r = duet_worker_req(w, i);
        if (r->phase != 0 && r->xfer_live && r->xid == id)
            return r;
    }
    return NULL;
}

duet_worker_req_t *duet_worker_free_slot(const duet_worker_t *w)
{
    for (int64_t i = 0; i < w->n_reqs; i++) {
        duet_worker_req_t *r = duet_worker_req(w, i);
        if (r->phase == 0)
            return r;
    }
    return NULL;
}

void duet_worker_req_init(duet_worker_t *w, duet_worker_req_t *r, uint64_t rid, int64_t n_prompt,
                          uint32_t max_tokens, const Duet__Sampling *s, uint64_t deadline_unix_ms)
{
    r->rid = rid;
    r->n_prompt = n_prompt;
    r->max_tokens = max_tokens;
    r->deadline_unix_ms = deadline_unix_ms;
    r->arrival = ++w->arrivals;
    duet_worker_sampling_init(&r->sampling, s, rid);
}

bool duet_worker_req_set_prompt(duet_worker_req_t *r, const uint32_t *ids, size_t n)
{
    r->prompt = malloc(sizeof(int32_t) * (n > 0 ? n : 1));
    if (r->prompt == NULL)
        return false;
    for (size_t i = 0; i < n; i++)
        r->prompt[i] = (int32_t)ids[i];
    return true;
}

bool duet_worker_req_setup(duet_worker_t *w, duet_worker_req_t *r, const uint32_t *prompt,
                           size_t n_prompt, const uint32_t *generated, size_t n_generated,
                           const char **why)
{
    return duet_worker_sampling_setup(&r->sampling, prompt, n_prompt, generated, n_generated,
                                      r->max_tokens, w->V, w->chunk, why);
}

void duet_worker_item_draw(duet_worker_t *w, duet_worker_req_t *r, duet_batch_item_t *it)
{
    (void)w;
    it->sampling = r->sampling.sp;
    it->u = duet_sampling_draw(&r->sampling.sp, &r->sampling.rng);
    it->token_out = &r->drawn;
    if (!r->sampling.host) {
        it->logits_mode = DUET_LOGITS_TOKEN;
        return;
    }
    /* a prompt chunk scored for prompt_logprobs keeps every row (rows_cap = chunk) */
    it->logits_mode = it->logits_mode == DUET_LOGITS_ALL ? DUET_LOGITS_ALL : DUET_LOGITS_LAST;
    it->logits = r->sampling.rows;
}

/* The step's host-path work (the skeleton's, before ops->step_done): prompt chunks scored for
 * prompt_logprobs, and the tokens of items that left their logits for the host to draw. */
static void w_host_draws(duet_worker_t *w, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        duet_batch_item_t *it = &w->items[i];
        duet_worker_req_t *r = w->item_req[i];
        if (it->logits_mode == DUET_LOGITS_TOKEN || it->logits != r->sampling.rows ||
            it->logits == NULL)
            continue;
        const int64_t rows = it->logits_mode == DUET_LOGITS_ALL ? it->n_tokens : 1;
        if (it->logits_mode == DUET_LOGITS_ALL && r->prompt != NULL &&
            it->tokens == r->prompt + r->prefilled)
            duet_worker_prompt_logprobs(&r->sampling, r->prompt, r->prefilled, it->n_tokens,
                                        it->logits, w->V);
        if (it->token_out != NULL)
            *it->token_out = duet_worker_host_draw(
                &r->sampling, w->smp, it->logits + (rows - 1) * w->V, w->scratch, w->V, it->u);
    }
}

void duet_worker_req_clear(duet_worker_t *w, duet_worker_req_t *r)
{
    duet_worker_seq_close(w, &r->seq);
    duet_worker_sampling_free(&r->sampling);
    free(r->prompt);
    memset(r, 0, w->ops->req_size);
    r->seq.id = -1;
}

duet_status_t duet_worker_seq_open(duet_worker_t *w, int64_t max_tokens, duet_seq_t *seq)
{
    if (w->group == NULL)
        return duet_model_seq_open(w->m, max_tokens, seq);
    return duet_group_seq_open(w->group, w->m, max_tokens, seq);
}

void duet_worker_seq_close(duet_worker_t *w, duet_seq_t *seq)
{
    if (w->group == NULL || duet_group_broken(w->group))
        duet_model_seq_close(w->m, seq);
    else
        duet_group_seq_close(w->group, w->m, seq);
}

duet_status_t duet_worker_seq_filled(duet_worker_t *w, duet_seq_t *seq, int64_t n_tokens,
                                     uint64_t deadline_unix_ms)
{
    if (w->group == NULL)
        return duet_model_seq_set_filled(w->m, seq, n_tokens);
    return duet_group_seq_filled(w->group, w->m, seq, n_tokens, deadline_unix_ms);
}

bool duet_worker_in_vocab(const duet_worker_t *w, const uint32_t *ids, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if ((int64_t)ids[i] >= w->V)
            return false;
    return true;
}

bool duet_worker_req_overdue(const duet_worker_req_t *r, uint64_t wall_ms)
{
    return r->deadline_unix_ms != 0 && wall_ms > r->deadline_unix_ms;
}

static int w_by_arrival(const void *a, const void *b)
{
    const duet_worker_req_t *x = *(duet_worker_req_t *const *)a;
    const duet_worker_req_t *y = *(duet_worker_req_t *const *)b;
    return x->arrival < y->arrival ? -1 : x->arrival > y->arrival;
}

int64_t duet_worker_add_prefill(duet_worker_t *w, duet_worker_req_t **pre, int64_t n_pre, int64_t n,
                                int64_t *budget_p)
{
    qsort(pre, (size_t)n_pre, sizeof(pre[0]), w_by_arrival);
    for (int64_t i = 0; i < n_pre; i++) {
        duet_worker_req_t *r = pre[i];
        int64_t end = duet_worker_chunk_end(r->prefilled, r->n_prompt, w->chunk);
        int64_t len = end - r->prefilled;
        if (len > *budget_p)
            continue;
        const bool last = end == r->n_prompt;
        /* prompt_logprobs: every chunk's rows, scored after the step (w_host_draws) */
        const bool score = r->sampling.prompt_logprobs && r->sampling.rows != NULL;
        w->items[n] = (duet_batch_item_t){
            .seq = &r->seq,
            .tokens = r->prompt + r->prefilled,
            .n_tokens = len,
            .logits_mode = score ? DUET_LOGITS_ALL : DUET_LOGITS_NONE,
            .logits = score ? r->sampling.rows : NULL,
        };
        if (last)
            duet_worker_item_draw(w, r, &w->items[n]);
        w->item_req[n] = r;
        n++;
        *budget_p -= len;
        w->step_prefill += len;
    }
    return n;
}

/* ---- the loop ------------------------------------------------------------------------- */

static void w_stop(duet_worker_t *w, const char *why)
{
    if (w->stopping)
        return;
    DUET_LOG_INFO("stopping: %s", why);
    if (w->idle_on)
        uv_idle_stop(&w->idle);
    w->idle_on = false;
    w->stopping = true;
    uv_timer_stop(&w->hb);
    uv_signal_stop(&w->sigint);
    uv_signal_stop(&w->sigterm);
    uv_stop(w->loop);
}

static void w_heartbeat(duet_worker_t *w);

/* SIGTERM with shutdown.drain_s > 0 starts leaving (w_leave_tick ends it); a repeated SIGTERM
 * does not cut that short, since Slurm and the job's own stop may both send one. */
static void w_on_signal(uv_signal_t *s, int signum)
{
    duet_worker_t *w = s->data;
    if (signum != SIGTERM || w->drain_s <= 0) {
        w_stop(w, signum == SIGINT ? "SIGINT" : "SIGTERM");
        return;
    }
    if (w->leaving) {
        DUET_LOG_INFO("SIGTERM again: still finishing the requests here (SIGINT stops now)");
        return;
    }
    int64_t n = 0;
    for (int64_t i = 0; i < w->n_reqs; i++)
        n += duet_worker_req(w, i)->phase != 0;
    DUET_LOG_INFO("SIGTERM: taking no new work, finishing %lld request%s here, then stopping "
                  "(shutdown.drain_s %.0f; SIGINT stops now)",
                  (long long)n, n == 1 ? "" : "s", w->drain_s);
    w->leaving = true;
    w->leave_deadline = duet_worker_now() + w->drain_s;
    w->idle_since = 0;
    if (w->link != NULL)
        w_heartbeat(w); /* says draining: the router places nothing new here from now on */
}

static void w_on_closed(const char *reason, void *user)
{
    w_stop(user, reason);
}

/*
 * The process did not run for longer than the router's heartbeat timeout (stopped, or starved):
 * the router has dropped this worker and failed its requests, and its peers have failed their UCX
 * endpoints to it. Leave at once, without touching UCX again. bench/soak found both ways that went
 * wrong: UCX 1.13 aborted a generation worker when a put that arrived meanwhile was to be
 * acknowledged on such an endpoint; and a context worker stopped mid-step went on with the step
 * and put a prefill whose reservation had long ended into pages the generation worker had given
 * to another request (a wrong answer). So the layer hook, the step's end and the tick check too,
 * before any put. Exit status 0, as for a router that went away; a group's rank 0 aborts the job
 * instead, so that no follower waits for it.
 */
static void w_frozen(void *user, uint64_t gap_ms)
{
    duet_worker_t *w = user;
    DUET_LOG_WARN("stopping: this process did not run for %llu ms, longer than the router's "
                  "heartbeat timeout (%u ms): the router has dropped it; leaving without touching "
                  "UCX again",
                  (unsigned long long)gap_ms, w->pump.frozen_ms);
    fflush(NULL);
    if (w->group != NULL)
        duet_group_abort(w->group, 1);
    _exit(0);
}

void duet_worker_group_failed(duet_worker_t *w)
{
    if (w->group == NULL || !duet_group_broken(w->group) || w->stopping)
        return;
    char why[320];
    snprintf(why, sizeof(why),
             "the generation group %s failed (a rank died or stopped answering): its requests "
             "end here",
             w->name);
    DUET_LOG_ERROR("%s", why);
    for (int64_t i = 0; i < w->n_reqs; i++) {
        duet_worker_req_t *r = duet_worker_req(w, i);
        if (r->phase == 0)
            continue;
        duet_worker_send_tokens(w->link, r->rid, NULL, 0, DUET__TOKENS__FINISH_REASON__ERROR, why);
        w->ops->release(w, r);
    }
    w_stop(w, why); /* then Deregister; duet_worker_main aborts the job */
}

/* A Heartbeat from the current state (also from the layer hook, mid-step). */
static int64_t w_kv_scale(const duet_worker_t *w)
{
    return w->group != NULL ? duet_group_cp(w->group) : 1;
}

void duet_worker_fill_heartbeat(duet_worker_t *w, Duet__Heartbeat *hb, uint32_t *kv_pages_p)
{
    duet_kv_pool_t *kv = duet_model_kv_pool(w->m);
    /* a group's pages: rank 0 holds the largest share of every sequence, cp ranks share them */
    hb->free_pages = kv != NULL ? (uint32_t)(duet_kv_pool_n_free(kv) * w_kv_scale(w)) : 0;
    if (kv_pages_p != NULL)
        *kv_pages_p = kv != NULL ? (uint32_t)(duet_kv_pool_desc(kv)->n_pages * w_kv_scale(w)) : 0;
    duet_kda_pool_t *kda = duet_model_kda_pool(w->m);
    if (kda != NULL) {
        hb->free_state_slots = (uint32_t)duet_kda_pool_n_free(kda);
        hb->state_slots = (uint32_t)duet_kda_pool_desc(kda)->n_slots;
    }
    hb->draining = w->draining || w->leaving;
    hb->prefill_tokens = w->prefill_tokens;
    hb->busy_seconds = w->busy_seconds;
    w->ops->heartbeat(w, hb);
}

static void w_heartbeat(duet_worker_t *w)
{
    Duet__Heartbeat hb = DUET__HEARTBEAT__INIT;
    duet_worker_fill_heartbeat(w, &hb, NULL);
    Duet__Envelope env = duet_envelope_heartbeat(&hb);
    (void)duet_link_send(w->link, &env);
    w->last_hb = duet_worker_now();
}

static void w_step(uv_idle_t *h);

void duet_worker_update(duet_worker_t *w)
{
    if (w->ops->admit != NULL && !w->stopping)
        w->ops->admit(w);
    const bool work = !w->stopping && w->ops->has_work(w);
    if (work && !w->idle_on)
        uv_idle_start(&w->idle, w_step);
    else if (!work && w->idle_on)
        uv_idle_stop(&w->idle);
    w->idle_on = work;
}

void duet_worker_xfer_cb(const duet_xfer_outcome_t *o, void *user)
{
    duet_worker_t *w = user;
    /* a group's followers are inside the step's collectives: no other group call may start */
    if ((w->ops->defer_outcomes || w->group != NULL) && w->in_step && w->n_deferred < w->n_reqs) {
        duet_worker_deferred_t *d = &w->deferred[w->n_deferred++];
        d->o = *o;
        snprintf(d->msg, sizeof(d->msg), "%s", o->message != NULL ? o->message : "");
        d->o.message = d->msg;
        return;
    }
    duet_worker_req_t *r = w_find_xfer(w, o->id);
    if (r != NULL)
        w->ops->on_xfer(w, r, o);
}

/* One forward step per loop turn while there is work. */
static void w_step(uv_idle_t *h)
{
    duet_worker_t *w = h->data;
    if (w->group != NULL && duet_group_broken(w->group)) {
        duet_worker_group_failed(w);
        return;
    }
    w->step_prefill = 0;
    int64_t n = w->ops->plan_step(w);
    if (n == 0) {
        duet_worker_update(w);
        return;
    }
    double t0 = duet_worker_now();
    w->in_step = true;
    duet_status_t st = w->group != NULL ? duet_group_forward(w->group, w->m, w->items, n)
                                        : duet_model_forward(w->m, w->items, n);
    w->in_step = false;
    duet_worker_pump_check_frozen(&w->pump); /* before step_done puts */
    if (st != DUET_OK && w->group != NULL && duet_group_broken(w->group)) {
        w->n_deferred = 0;           /* their requests end below */
        duet_worker_group_failed(w); /* every request, the step's too, ends naming the group */
        return;
    }
    double dt = duet_worker_now() - t0;
    w->busy_seconds += dt;
    if (st == DUET_OK) {
        w->prefill_tokens += (uint64_t)w->step_prefill;
        w_host_draws(w, n);
    }
    w->ops->step_done(w, n, st, dt);
    for (int64_t i = 0; i < w->n_deferred; i++) /* outcomes that came during the step */
        duet_worker_xfer_cb(&w->deferred[i].o, w);
    w->n_deferred = 0;
    duet_worker_update(w);
}

/* Every heartbeat period: the role's timers, a heartbeat, then admission. */
/*
 * Leaving: stop once nothing has been here for two heartbeat periods (a request the router
 * placed before it saw this worker draining is still on its way for about one round trip), or
 * at the deadline.
 */
static void w_leave_tick(duet_worker_t *w)
{
    int64_t n = 0;
    for (int64_t i = 0; i < w->n_reqs; i++)
        n += duet_worker_req(w, i)->phase != 0;
    const double now = duet_worker_now();
    if (n > 0) {
        w->idle_since = 0;
        if (now < w->leave_deadline)
            return;
        char why[160];
        snprintf(why, sizeof(why),
                 "SIGTERM: shutdown.drain_s (%.0f s) passed with %lld request%s here", w->drain_s,
                 (long long)n, n == 1 ? "" : "s");
        w_stop(w, why);
        return;
    }
    if (w->idle_since == 0)
        w->idle_since = now;
    else if (now - w->idle_since >= 2 * w->hb_period_s)
        w_stop(w, "SIGTERM: every request here finished");
}

static void w_tick(uv_timer_t *t)
{
    duet_worker_t *w = t->data;
    duet_worker_pump_check_frozen(&w->pump); /* timers run first when it runs again */
    if (w->group != NULL && duet_group_broken(w->group)) {
        duet_worker_group_failed(w);
        return;
    }
    w->ops->tick(w);
    w_heartbeat(w);
    duet_worker_update(w);
    if (w->leaving && !w->stopping)
        w_leave_tick(w);
}

/* Layer hook: inside a long step the loop cannot run, so a heartbeat that is due goes out here
 * (the router must not take a busy worker for a dead one) and UCX keeps moving: connection
 * handshakes and puts (over tcp both sides must progress) do not wait for the step's end. */
static void w_on_layer(void *user, int64_t layer, int64_t mla, int64_t kda)
{
    duet_worker_t *w = user;
    duet_worker_pump_check_frozen(&w->pump); /* before on_layer puts */
    if (w->link != NULL && !w->stopping && duet_worker_now() - w->last_hb >= w->hb_period_s)
        w_heartbeat(w);
    if (mla >= 0 && w->ops->on_layer != NULL)
        w->ops->on_layer(w, mla);
    duet_worker_pump_progress(&w->pump);
}

static void w_on_message(const Duet__Envelope *env, void *user)
{
    duet_worker_t *w = user;
    switch (env->body_case) {
    case DUET__ENVELOPE__BODY_DRAIN:
        DUET_LOG_INFO("%s", w->ops->drain_log);
        w->draining = true;
        return;
    case DUET__ENVELOPE__BODY_UNDRAIN:
        DUET_LOG_INFO("%s", w->ops->undrain_log);
        w->draining = false;
        return;
    case DUET__ENVELOPE__BODY_SET_LOG_LEVEL: {
        duet_log_level_t lvl;
        const char *name = env->set_log_level->level;
        if (duet_log_level_parse(name, &lvl) != DUET_OK) {
            DUET_LOG_WARN("ignoring a log level the router sent that is not one of error, warn, "
                          "info, debug, trace");
            return;
        }
        DUET_LOG_WARN("log level %s -> %s (the router's admin API)",
                      duet_log_level_name(duet_log_level()), duet_log_level_name(lvl));
        duet_log_set_level(lvl);
        return;
    }
    default:
        if (!w->ops->on_message(w, env))
            DUET_LOG_WARN("ignoring a message with body %d from the router", (int)env->body_case);
        return;
    }
}

/* ---- start-up and shutdown ------------------------------------------------------------ */

/*
 * Parse the command line, the --config YAML and DUET_* variables; print --help or --version.
 * Returns -1 to go on with *cfg_p set, else the exit status (0 after --help, 2 for bad flags).
 */
static int w_configure(const duet_worker_ops_t *ops, int argc, char **argv, duet_config_t **cfg_p)
{
    duet_config_t *cfg = NULL;
    int n_pos = 0;
    duet_status_t st = duet_config_create(ops->keys, ops->n_keys, &cfg);
    if (st == DUET_OK)
        st = duet_config_load_all(cfg, argc, argv, &n_pos);
    if (st == DUET_OK && duet_config_help_requested(cfg)) {
        char *text = NULL;
        if (duet_config_help(cfg, ops->usage, &text) == DUET_OK)
            fputs(text, stdout);
        free(text);
        duet_config_destroy(cfg);
        return 0;
    }
    if (st == DUET_OK && duet_config_version_requested(cfg)) {
        duet_version_print(ops->prog);
        duet_config_destroy(cfg);
        return 0;
    }
    if (st == DUET_OK && n_pos > 0)
        st = duet_error_set(DUET_ERR_INVALID, "unexpected argument '%s' (see --help)", argv[1]);
    if (st == DUET_OK)
        st = duet_config_check_required(cfg);
    if (st == DUET_OK) {
        const int64_t chunk = duet_config_get_int(cfg, "batch.prefill_chunk");
        const int64_t max = duet_config_get_int(cfg, "batch.max_tokens");
        if (chunk > max)
            st = duet_error_set(DUET_ERR_INVALID,
                                "batch.prefill_chunk (%lld) must not exceed batch.max_tokens "
                                "(%lld)",
                                (long long)chunk, (long long)max);
    }
    if (st == DUET_OK) {
        duet_log_configure(cfg); /* before the configuration's own lines */
        duet_config_log(cfg);
    }
    if (st == DUET_OK) /* before w_load starts UCX, which reads them */
        st = duet_worker_ucx_env(cfg);
    if (st != DUET_OK) {
        fprintf(stderr, "%s: %s\n", ops->prog, duet_error_last());
        duet_config_destroy(cfg);
        return 2;
    }
    *cfg_p = cfg;
    return -1;
}

static int w_token_bytes(void *user, uint32_t id, const uint8_t **p, size_t *n)
{
    return duet_tokenizer_token_bytes(user, id, p, n) != DUET_OK;
}

static int w_token_special(void *user, uint32_t id)
{
    return duet_tokenizer_is_special(user, id);
}

/* response_format's vocabulary trie from the model folder's tokenizer (a folder without one
 * serves no response_format; the requests are refused). */
static duet_status_t w_json_vocab(duet_worker_t *w, const char *dir)
{
    duet_status_t st = duet_tokenizer_load(dir, &w->tok);
    if (st == DUET_ERR_NOT_FOUND) {
        DUET_LOG_INFO("%s has no tokenizer: response_format is refused", dir);
        return DUET_OK;
    }
    if (st != DUET_OK)
        return st;
    if ((st = duet_json_vocab_create(w->V, w_token_bytes, w_token_special, w->tok, &w->jv)) !=
        DUET_OK)
        return st;
    duet_worker_set_json_vocab(w->jv);
    return DUET_OK;
}

/* UCX, the model (options mo) and its pools; a failure is told on stderr. *pools_from_ucx_p: the
 * transfer context owns the pool memory. */
static duet_status_t w_load(duet_worker_t *w, duet_model_opts_t mo, bool *pools_from_ucx_p)
{
    const duet_worker_ops_t *ops = w->ops;
    duet_status_t st;
    duet_xfer_ctx_opts_t xo;
    duet_xfer_ctx_opts_default(&xo);
    xo.recv_no_abort_back = ops->receives;
    /* metrics.port: a registry for the worker's /metrics, which the transfer layer fills too */
    if (duet_config_get_int(w->cfg, "metrics.port") >= 0 &&
        (st = duet_metrics_create(&w->metrics)) != DUET_OK) {
        fprintf(stderr, "%s: metrics: %s\n", ops->prog, duet_error_last());
        return st;
    }
    xo.metrics = w->metrics;
    if ((st = duet_xfer_ctx_create(&xo, &w->x)) != DUET_OK) {
        fprintf(stderr, "%s: cannot start UCX: %s\n", ops->prog, duet_error_last());
        return st;
    }
    /* UCX moves a GPU model's device pools directly when it can; otherwise a sender stages each
     * layer in the host pools the puts read, a receiver copies received sequences from them */
    const bool device_pools = duet_worker_device_pools(w->cfg, &mo, w->x);
    if (ops->receives) {
        mo.mirror_in = !device_pools;
        mo.device_pools_shared = device_pools;
        if (!device_pools) { /* UCX segments, registered as they are allocated */
            mo.pool_alloc = duet_worker_pool_alloc;
            mo.pool_alloc_user = w->x;
        }
    } else {
        mo.mirror_out = !device_pools;
    }
    *pools_from_ucx_p = mo.pool_alloc != NULL;
    const char *dir = duet_config_get_string(w->cfg, "model.dir");
    if ((st = duet_model_load(dir, &mo, &w->m)) != DUET_OK) {
        fprintf(stderr, "%s: cannot load %s: %s\n", ops->prog, dir, duet_error_last());
        return st;
    }
    if (!*pools_from_ucx_p &&
        (st = duet_worker_register_pools(w->x, w->m, device_pools)) != DUET_OK) {
        fprintf(stderr, "%s: cannot register the cache pools with UCX: %s\n", ops->prog,
                duet_error_last());
        return st;
    }
    DUET_LOG_INFO("transfers move the %s pools%s", device_pools ? "device" : "host",
                  device_pools ? " directly (UCX has CUDA transports)" : "");
    duet_worker_layout(w->m, &w->layout);
    duet_model_set_layer_hook(w->m, w_on_layer, w);
    w->V = duet_model_config(w->m)->vocab_size;
    if ((st = w_json_vocab(w, dir)) != DUET_OK) {
        fprintf(stderr, "%s: cannot load the tokenizer of %s: %s\n", ops->prog, dir,
                duet_error_last());
        return st;
    }
    w->max_seqs = mo.max_seqs;
    w->n_reqs = mo.max_seqs;
    return DUET_OK;
}

static duet_status_t w_tables(duet_worker_t *w)
{
    w->reqs = calloc((size_t)w->n_reqs, w->ops->req_size);
    w->items = calloc((size_t)w->max_seqs, sizeof(*w->items));
    w->item_req = calloc((size_t)w->max_seqs, sizeof(*w->item_req));
    w->order = calloc((size_t)w->n_reqs, sizeof(*w->order));
    w->deferred = calloc((size_t)w->n_reqs, sizeof(*w->deferred));
    w->scratch = malloc(sizeof(float) * (size_t)w->V);
    if (w->reqs == NULL || w->items == NULL || w->item_req == NULL || w->order == NULL ||
        w->deferred == NULL || w->scratch == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "out of memory");
    duet_status_t st = duet_sampler_create(w->V, &w->smp);
    if (st != DUET_OK)
        return st;
    for (int64_t i = 0; i < w->n_reqs; i++)
        duet_worker_req(w, i)->seq.id = -1;
    return DUET_OK;
}

/*
 * Register with the router (name, model fingerprint, capacity) and arm the loop: heartbeats
 * every heartbeat_ms, the step while there is work, SIGINT / SIGTERM.
 */
static duet_status_t w_start(duet_worker_t *w)
{
    const char *role_name = w->ops->role == DUET__WORKER_ROLE__WORKER_ROLE_CTX ? "ctx" : "gen";
    snprintf(w->name, sizeof(w->name), "%s", duet_config_get_string(w->cfg, "name"));
    if (w->name[0] == '\0')
        snprintf(w->name, sizeof(w->name), "%s-%d", role_name, (int)getpid());
    char fp[DUET_FINGERPRINT_LEN];
    duet_status_t st =
        duet_model_fingerprint(duet_config_get_string(w->cfg, "model.dir"), fp, sizeof(fp));
    if (st != DUET_OK)
        return st;
    const duet_model_opts_t *mo = duet_model_opts(w->m);
    duet_kv_pool_t *kv = duet_model_kv_pool(w->m);
    Duet__Capacity cap = DUET__CAPACITY__INIT;
    cap.kv_pages = kv != NULL ? (uint32_t)(duet_kv_pool_desc(kv)->n_pages * w_kv_scale(w)) : 0;
    cap.page_tokens = (uint32_t)mo->page_tokens;
    cap.max_seqs = (uint32_t)mo->max_seqs;
    cap.max_batch_tokens = (uint32_t)mo->max_batch_tokens;
    Duet__Register reg = DUET__REGISTER__INIT;
    reg.role = w->ops->role;
    reg.worker_name = w->name;
    reg.model_fingerprint = fp;
    reg.capacity = &cap;
    reg.device = (char *)duet_model_device_name(mo->device);
    char dtype[16]; /* "f32", as the dtype key spells it */
    snprintf(dtype, sizeof(dtype), "%s", duet_dtype_name(mo->compute_dtype));
    for (char *p = dtype; *p != '\0'; p++)
        *p = (char)tolower((unsigned char)*p);
    reg.dtype = dtype;
    reg.started_unix_ms = w->started_unix_ms;
    if (w->metrics != NULL) { /* before Register, which reports its port */
        const char *host = duet_config_get_string(w->cfg, "metrics.host");
        if ((st = duet_worker_metrics_start(w, w->metrics, host,
                                            (uint16_t)duet_config_get_int(w->cfg, "metrics.port"),
                                            &w->wmetrics)) != DUET_OK)
            return st;
        reg.metrics_port = duet_worker_metrics_port(w->wmetrics);
        DUET_LOG_INFO("metrics: serving GET /metrics on %s:%u", host, reg.metrics_port);
    }
    duet_link_opts_t lo = {
        .router = duet_config_get_string(w->cfg, "router"),
        .connect_timeout_ms = (uint32_t)duet_config_get_int(w->cfg, "router_connect_timeout_ms"),
        .reg = &reg,
        .on_message = w_on_message,
        .on_closed = w_on_closed,
        .user = w,
    };
    uint64_t wid = 0;
    if ((st = duet_link_open(w->loop, &lo, &w->link, &wid)) != DUET_OK)
        return st;
    w->pump.frozen_ms = duet_link_router_timeout_ms(w->link);
    w->pump.on_frozen = w_frozen;
    w->pump.frozen_user = w;
    DUET_LOG_INFO("%s registered with the router at %s as worker %llu (%u KV pages of %u tokens, "
                  "%u sequences, %u tokens per step)",
                  w->name, lo.router, (unsigned long long)wid, cap.kv_pages, cap.page_tokens,
                  cap.max_seqs, cap.max_batch_tokens);
    const int64_t hb_ms = duet_config_get_int(w->cfg, "heartbeat_ms");
    uv_idle_init(w->loop, &w->idle);
    uv_timer_init(w->loop, &w->hb);
    uv_signal_init(w->loop, &w->sigint);
    uv_signal_init(w->loop, &w->sigterm);
    w->idle.data = w;
    w->hb.data = w;
    w->sigint.data = w;
    w->sigterm.data = w;
    w->hb_period_s = (double)hb_ms / 1000.0;
    w->drain_s = (double)duet_config_get_int(w->cfg, "shutdown.drain_s");
    uv_timer_start(&w->hb, w_tick, 0, (uint64_t)hb_ms);
    uv_signal_start(&w->sigint, w_on_signal, SIGINT);
    uv_signal_start(&w->sigterm, w_on_signal, SIGTERM);
    signal(SIGPIPE, SIG_IGN);
    return DUET_OK;
}

/*
 * After the loop returned: Deregister (the router fails what still runs here with this reason),
 * flush and close the link, close every handle and the loop.
 */
static void w_close(duet_worker_t *w)
{
    Duet__Deregister dr = DUET__DEREGISTER__INIT;
    dr.reason = (char *)w->ops->stop_reason;
    Duet__Envelope env = duet_envelope_deregister(&dr);
    (void)duet_link_send(w->link, &env);
    duet_link_close(w->link, 1000);
    w->link = NULL;
    duet_worker_metrics_close(w->wmetrics);
    w->wmetrics = NULL;
    duet_worker_pump_stop(&w->pump);
    uv_close((uv_handle_t *)&w->idle, NULL);
    uv_close((uv_handle_t *)&w->hb, NULL);
    uv_close((uv_handle_t *)&w->sigint, NULL);
    uv_close((uv_handle_t *)&w->sigterm, NULL);
    uv_run(w->loop, UV_RUN_DEFAULT);
    uv_loop_close(w->loop);
}

static void w_release_all(duet_worker_t *w)
{
    for (int64_t i = 0; w->reqs != NULL && i < w->n_reqs; i++) {
        duet_worker_req_t *r = duet_worker_req(w, i);
        if (r->phase != 0)
            w->ops->release(w, r);
    }
}

/*
 * Free everything. Live transfers still read or write the pools: the transfer context goes first
 * (its destruction aborts them and reports their outcomes), unless it allocated the pools, which
 * must then outlive the model.
 */
static void w_free(duet_worker_t *w, bool pools_from_ucx)
{
    if (!pools_from_ucx) {
        duet_xfer_ctx_destroy(w->x);
        w->x = NULL;
    }
    w_release_all(w);
    if (w->ops->fini != NULL)
        w->ops->fini(w);
    duet_group_destroy(w->group); /* rank 0: the followers stop once every sequence is closed */
    w->group = NULL;
    duet_model_free(w->m);
    duet_worker_set_json_vocab(NULL);
    duet_json_vocab_destroy(w->jv);
    duet_tokenizer_destroy(w->tok);
    w->jv = NULL;
    w->tok = NULL;
    duet_xfer_ctx_destroy(w->x);
    free(w->reqs);
    free(w->items);
    free(w->item_req);
    free(w->order);
    free(w->deferred);
    duet_metrics_destroy(w->metrics); /* after the transfer context, which updated it */
    w->metrics = NULL;
    free(w->scratch);
    duet_sampler_destroy(w->smp);
    duet_config_destroy(w->cfg);
}

/* A group's follower rank: serve rank 0 until it stops the group (or the group breaks). */
static int w_follow(duet_worker_t *w, bool owned)
{
    /* no loop, no router: UCX progresses while the follower waits on the group (on_wait) */
    duet_model_set_layer_hook(w->m, NULL, NULL);
    const int rc = duet_group_follow(w->group, w->m, w->x, &w->layout);
    if (rc != 0)
        duet_group_abort(w->group, 1);
    w_free(w, owned);
    DUET_LOG_INFO("stopped");
    return 0;
}

int duet_worker_main(const duet_worker_ops_t *ops, int argc, char **argv)
{
    static duet_worker_t w; /* lives as long as the process; handles point into it */
    w.ops = ops;
    w.started_unix_ms = duet_xfer_now_unix_ms();
    int rc = w_configure(ops, argc, argv, &w.cfg);
    if (rc >= 0)
        return rc;
    w.chunk = duet_config_get_int(w.cfg, "batch.prefill_chunk");
    w.budget = duet_config_get_int(w.cfg, "batch.max_tokens");
    duet_model_opts_t mo;
    duet_status_t st = duet_worker_model_opts(w.cfg, &mo);
    if (st == DUET_OK && ops->configure != NULL)
        st = ops->configure(&w, &mo);
    if (st != DUET_OK) {
        fprintf(stderr, "%s: %s\n", ops->prog, duet_error_last());
        duet_config_destroy(w.cfg);
        return 2;
    }
    if (w.exit_now) {
        duet_config_destroy(w.cfg);
        return 0;
    }
    bool owned = false;
    st = w_load(&w, mo, &owned);
    if (st == DUET_OK && w.group != NULL && duet_group_rank(w.group) != 0)
        return w_follow(&w, owned);
    if (st == DUET_OK && (st = ops->init(&w)) != DUET_OK)
        fprintf(stderr, "%s: %s\n", ops->prog, duet_error_last());
    if (st == DUET_OK && (st = w_tables(&w)) != DUET_OK)
        fprintf(stderr, "%s: out of memory\n", ops->prog);
    if (st == DUET_OK) {
        w.loop = uv_default_loop();
        if ((st = duet_worker_pump_start(w.loop, w.x, &w.pump)) != DUET_OK ||
            (st = w_start(&w)) != DUET_OK)
            fprintf(stderr, "%s: %s\n", ops->prog, duet_error_last());
    }
    if (st != DUET_OK) {
        w_free(&w, owned);
        return 1;
    }
    uv_run(w.loop, UV_RUN_DEFAULT);

    w_close(&w);
    if (ops->shutdown != NULL)
        ops->shutdown(&w);
    else
        w_release_all(&w);
    const bool broken = w.group != NULL && duet_group_broken(w.group);
    if (broken) /* the followers may be waiting on a collective that will never end */
        duet_group_abort(w.group, 1);
    w_free(&w, owned);
    DUET_LOG_INFO("stopped");
    return 0;
}
