/*
 * duet-gen: the generation worker (docs/architecture.md: "The path of one request", steps 4 and
 * 8-9; "Quarantine").
 *
 * The worker skeleton (worker/skeleton.h) runs the process: the router link (Reserve,
 * PrefillDone, Generate, Cancel, Drain, Undrain in; Reserved, Refused, Tokens, Heartbeat out),
 * UCX (context workers put KV pages and KDA state into our pools) and one forward step per loop
 * turn while there is work. This file is the role's state machine. A request (gr_t) is, in this
 * order:
 *   RECEIVING  pages + a state slot reserved (Reserve), waiting for the cache transfer's XferDone
 *              and the router's PrefillDone (first token, sampled by the context worker)
 *   PREFILL    a local prompt (Generate: conditional disaggregation) prefilled in chunks that
 *              start at multiples of batch.prefill_chunk, as duet-generate cuts them
 *   DECODE     one token per step in the continuous batch, streamed to the router; or, when
 *              speculating (spec.method), a verify of up to spec.k drafted tokens per step and
 *              1..k+1 tokens streamed
 *   SUSPENDED  out of pages (below): its cache in a host buffer, no pages, no state slot
 *   PAUSED     a decoding request the router is moving to another generation worker (MovePause):
 *              out of the batch, its caches as the last step left them, until MoveOut / MoveCancel
 *   MOVING     its caches are being put into the target's reservation (MoveOut); DONE: Moved(ok)
 *              and the request is the target's; ABORTED: Moved(failed) and it decodes here again
 *   QUARANTINE a reservation that ended without its data (cancel, deadline, abort): its pages
 *              stay held for cache.quarantine_ms so that a context worker that has not yet seen
 *              the abort cannot put into pages another request already uses (transfer/xfer.h,
 *              "known limit"), then they return to the pool
 * Every end sends exactly one final Tokens (STOP, LENGTH, CANCELLED or ERROR) unless the router
 * ended the request first, and returns the pages (at once, or after the quarantine). A request
 * that moved away ends with Moved(ok) instead.
 *
 * Moving in (Reserve with a MoveState; docs/architecture.md, "Moving a running request"): the
 * request is RECEIVING its KV, KDA state and pending replay rows from the source generation
 * worker; the router's PrefillDone says the source let go, and it decodes on from the MoveState
 * (produced, next token, RNG state; with speculation the drafter starts from the prompt and the
 * generated ids).
 *
 * Pages under pressure (cache.suspend, on by default; docs/architecture.md, "Suspend
 * and resume"): a request's sequence holds pages for its tokens plus one step's growth and grows
 * page by page as it decodes, so the pool admits requests by what they hold, not by what they may
 * reach. When a decoding request cannot grow, the youngest decoding requests (by arrival; the
 * request itself when it is the youngest) are suspended: the replay-only commit, the KV pages and
 * KDA state copied to a host buffer (duet_model_seq_snapshot_save), the sequence closed. The
 * oldest suspended request is resumed (open, restore) as soon as its pages and a slot are free;
 * younger ones wait behind it, and no reservation is taken while one waits. The drafter's
 * sequence (its own pool) stays open through a suspension. The restored caches are the bytes
 * saved, so a suspended request's tokens are those of a run never suspended; the client only sees
 * a pause. With cache.suspend off (and in a group) a request reserves prompt + max_tokens + slack
 * up front and the pool refuses what does not fit, as before.
 *
 * Batch invariance (engine/model.h) makes every request's tokens equal to duet-generate's under
 * greedy sampling, whatever else runs in the batch. A seeded request samples the same tokens as
 * duet-generate with that seed: the context worker drew the first token from the same stream, so
 * the stream here skips that one draw.
 *
 * Speculative decoding (engine/spec.h; docs/architecture.md, "Speculative steps"): each step the
 * decoder drafts for every decoding request together, each request with drafts becomes a verify
 * item (its next token and the drafts, logits of every row) beside the prefill chunks, and the
 * acceptance rule keeps a prefix; the tokens are plain greedy decoding's exactly (the verify rows
 * are bit-identical to one-token steps), and a seeded request's are those of duet-generate with
 * the same spec keys and seed. How many drafts a request gets depends only on the request (spec.k,
 * less near max_tokens), never on the rest of the batch, so seeded streams repeat themselves.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "engine/cache_plan.h"
#include "engine/shard.h"
#include "engine/spec.h"
#include "proto/envelope.h"
#include "group/comm_mpi.h"
#include "worker/prefix_cache.h"
#include "worker/skeleton.h"

_Static_assert(DUET_SPEC_MAX_K <= DUET_PROTO_SPEC_POSITIONS,
               "the heartbeat's speculation counters must cover every draft position");
_Static_assert(sizeof(duet_rng_t) == DUET_PROTO_RNG_WORDS * sizeof(uint64_t),
               "MoveState.rng must carry the whole RNG state");

static const duet_config_key_t gen_keys[] = {
    DUET_WORKER_CONFIG_KEYS,
    {"batch.max_seqs", DUET_CONFIG_INT, "16", "requests held at once (state slots)", .min = "1",
     .max = "65536"},
    {"batch.max_tokens", DUET_CONFIG_INT, "2048",
     "tokens per step at most (decodes + local prefill chunks): larger steps prefill waiting "
     "prompts together and interrupt decoding less often",
     .min = "1", .max = "1048576"},
    {"cache.quarantine_ms", DUET_CONFIG_INT, "2000",
     "pages of an aborted reservation are reused after this long, and never before the router's "
     "heartbeat timeout",
     .min = "0", .max = "600000"},
    {"cache.suspend", DUET_CONFIG_BOOL, "true",
     "reserve pages for what a request holds and grow it as it decodes, suspending the youngest "
     "requests to host memory when the pool runs out (not in a generation group)",
     .min = NULL},
    {"tune", DUET_CONFIG_BOOL, "false",
     "at load, profile the kernels' tactics and keep the fastest per shape (costs load time; "
     "cpu: the matmul's work split, same output; cuda: cuBLASLt's GEMM algorithm, output equal "
     "to fp32 summation order)",
     .min = NULL},
    {"tune_file", DUET_CONFIG_STRING, NULL,
     "with tune: load the tuned table from this file if it exists, else save it there",
     .min = NULL},
    {"cache.slack_tokens", DUET_CONFIG_INT, "0",
     "extra tokens reserved per request (draft slack for speculative decoding: at least spec.k "
     "when speculating)",
     .min = "0", .max = "65536"},
    DUET_SPEC_CONFIG_KEYS,
    DUET_PREFIX_CACHE_CONFIG_KEYS,
    {"cache.budget_gib", DUET_CONFIG_FLOAT, "0",
     "cache memory in GiB for the target's and the draft model's KV pools and KDA state / replay "
     "slots (0 = what cache.kv_pages implies); split as docs/architecture.md, \"The cache plan\", "
     "says; sets cache.kv_pages",
     .min = "0", .max = "1048576"},
    {"cache.draft_kv_budget_gib", DUET_CONFIG_FLOAT, "0",
     "the most GiB of the budget the draft model's KV pool takes (0 = no cap; never below its "
     "floor: batch.max_seqs requests at cache.max_seq_len + spec.k tokens); the excess goes to the "
     "target's pool",
     .min = "0", .max = "1048576"},
    {"print_cache_plan", DUET_CONFIG_BOOL, "false",
     "print the cache plan (pools, pages, bytes) as JSON and exit, without a router or weights",
     .min = NULL},
    {"helix.cp", DUET_CONFIG_INT, "1",
     "context-parallel ranks of a generation group (docs/architecture.md, \"Generation "
     "groups\"): MLA KV pages dealt over them; started as cp x tp MPI ranks (mpirun, srun)",
     .min = "1", .max = "64"},
    {"helix.tp", DUET_CONFIG_INT, "1",
     "tensor-parallel ranks of a generation group: MLA query heads split over them (each "
     "holding its cp share of the KV); KDA heads, MLPs and experts are split over all cp x tp",
     .min = "1", .max = "64"},
    {"helix.timeout_ms", DUET_CONFIG_INT, "30000",
     "the longest a rank of a generation group waits for the others in a collective before the "
     "group is declared failed",
     .min = "100", .max = "3600000"},
    {"test.move_hold_ms", DUET_CONFIG_INT, "0",
     "fault injection for tests: a request moving off this worker waits this long after its "
     "transfer started before any byte is put (0 = none)",
     .min = "0", .max = "600000"},
};

typedef enum {
    GR_FREE = 0,
    GR_RECEIVING,
    GR_PREFILL,
    GR_DECODE,
    GR_SUSPENDED,
    GR_QUARANTINE,
    GR_PAUSED,
    GR_MOVING,
} gr_phase_t;

typedef struct {
    duet_worker_req_t base; /* first: the skeleton's table holds gr_t */
    uint32_t produced;
    bool xfer_done, have_first, cancelling;
    int32_t next;      /* the next input token (DECODE) */
    double release_at; /* QUARANTINE */
    int64_t full;      /* tokens it may come to hold: prompt + max_tokens + slack */
    int64_t full_cap;  /* the capacity a reservation of `full` tokens has (whole pages) */
    uint8_t *snap;     /* SUSPENDED: the sequence's cache (duet_model_seq_snapshot_save) */
    int64_t snap_tokens;
    /* speculating (g.spec): the request's speculative state, open from its first token on */
    bool spec_open;
    duet_spec_seq_t ss;
    int32_t vtok[DUET_SPEC_MAX_K + 1]; /* the step's item: the next token, then the drafts */
    int32_t vmax[DUET_SPEC_MAX_K + 1]; /* its rows' arg-maxes (gr_spec_argmax) */
    /* logprobs of a speculating step's tokens, from its verify rows */
    duet_worker_logprob_t vlp[DUET_SPEC_MAX_K + 1];
    int64_t n_hist; /* ids in base.prompt: the prompt, or a moved-in request's prompt and
                       generated ids but the newest (what its drafter starts from) */
    /* moving in: RECEIVING holds the source's caches */
    bool moved_in;
    int64_t in_tokens, in_replay; /* tokens of KV received; of them, pending replay rows */
    /* moving out (PAUSED, MOVING) */
    duet_xfer_reservation_t mres; /* the target's reservation, decoded (MOVING) */
    bool mres_live;
    double put_at; /* MOVING: test.move_hold_ms: when the puts start (0 = started) */
    /* the prefix cache (g.pc) and the request's ids known: prompt then every generated id, so
     * that what its sequence holds can be kept for its next turn (gr_keep_decoded) */
    int32_t *ids; /* owned, ids_cap */
    int64_t n_ids, ids_cap;
    int64_t kept_blocks; /* its newest decode snapshot's blocks (0: none) */
} gr_t;

static struct {
    int64_t slack;
    uint32_t quarantine_ms;
    bool grow;                     /* cache.suspend in effect: pages grow with the sequence */
    uint64_t suspensions, resumes; /* Heartbeat 14-15 */
    int64_t n_decode;              /* decodes in the step being run */
    /* work counters (Heartbeat 6-9) */
    uint64_t decode_steps, decode_seq_steps, decoded_tokens;
    double step_seconds;
    /* speculative decoding: NULL when spec.method is none */
    duet_spec_opts_t so;
    duet_spec_t *spec;
    float *logits;        /* owned: (spec.k + 1) rows of vocab floats per request slot */
    duet_spec_seq_t **ss; /* owned, [n_reqs]: the step's drafting requests */
    int *k_cap;           /* owned, [n_reqs]: their draft allowances */
    /* Heartbeat 11-13: verify steps by tokens emitted; drafts proposed / kept per position */
    uint64_t spec_step_tokens[DUET_SPEC_MAX_K + 1];
    uint64_t spec_drafted[DUET_SPEC_MAX_K], spec_accepted[DUET_SPEC_MAX_K];
    duet_cache_plan_t plan;  /* how the cache budget was split (gen_cache_plan) */
    bool checksum;           /* transfer.checksum: moves send an XXH3-64 */
    uint32_t move_hold_ms;   /* test.move_hold_ms */
    duet_prefix_cache_t *pc; /* cache.prefix; NULL when off */
} g;

static gr_t *gr_at(const duet_worker_t *w, int64_t i)
{
    return (gr_t *)duet_worker_req(w, i);
}

/* ------------------------------------------------------------------------------ requests */

/*
 * End request q: its sequence, prompt and speculative state. A speculating sequence first folds
 * its accepted rows into the KDA state (duet_model_seq_commit), so whatever reads the sequence's
 * state as it is released (today nothing; a transfer, suspend or migration would) sees exactly
 * what plain decoding would have left. A commit that fails (the step that left the rows failed)
 * changes nothing for a sequence about to close.
 */
static void gr_free(duet_worker_t *w, duet_worker_req_t *q)
{
    gr_t *r = (gr_t *)q;
    if (r->spec_open) {
        if (q->seq.id >= 0 && q->seq.n_pending == 0 &&
            duet_model_seq_commit(w->m, &q->seq) != DUET_OK)
            DUET_RLOG_DEBUG(q->rid, "closing without folding the accepted rows in: %s",
                            duet_error_last());
        duet_spec_seq_close(g.spec, &r->ss);
        r->spec_open = false;
    }
    if (r->mres_live)
        duet_xfer_reservation_free(&r->mres);
    free(r->snap);
    free(r->ids);
    duet_worker_req_clear(w, q);
}

/* End request q with Tokens(ERROR, why). */
static void gr_fail(duet_worker_t *w, duet_worker_req_t *q, const char *why)
{
    duet_worker_send_tokens(w->link, q->rid, NULL, 0, DUET__TOKENS__FINISH_REASON__ERROR, why);
    gr_free(w, q);
}

/*
 * With the prefix cache: r's ids start as prompt[0..n) then generated[0..n_gen), with room for
 * every id it may produce. Without the cache, or out of memory, r keeps none (nothing of it is
 * kept for a next turn; it is served as ever).
 */
static void gr_ids_init(gr_t *r, const uint32_t *prompt, size_t n, const uint32_t *generated,
                        size_t n_gen)
{
    if (g.pc == NULL || prompt == NULL)
        return;
    r->ids_cap = (int64_t)n + r->base.max_tokens + 1;
    r->ids = malloc(sizeof(*r->ids) * (size_t)r->ids_cap);
    if (r->ids == NULL)
        return;
    for (size_t i = 0; i < n; i++)
        r->ids[r->n_ids++] = (int32_t)prompt[i];
    for (size_t i = 0; i < n_gen && r->n_ids < r->ids_cap; i++)
        r->ids[r->n_ids++] = (int32_t)generated[i];
}

/* r produced toks[0..n) (generated ids, in order). */
static void gr_ids_add(gr_t *r, const int32_t *toks, int n)
{
    if (r->ids == NULL)
        return;
    if (r->n_ids + n > r->ids_cap) { /* never: ids_cap counts max_tokens; drop rather than lie */
        free(r->ids);
        r->ids = NULL;
        return;
    }
    memcpy(r->ids + r->n_ids, toks, sizeof(*toks) * (size_t)n);
    r->n_ids += n;
}

/*
 * After a decode step: when r's sequence now holds a snapshot-grid length, keep it (its ids and
 * pages, the state decode reached) for its next turn, in place of its previous decode snapshot
 * (a request keeps its newest one only, so that one long answer does not flush the cache).
 */
static void gr_keep_decoded(duet_worker_t *w, gr_t *r)
{
    duet_worker_req_t *q = &r->base;
    if (r->ids == NULL || r->n_ids < q->seq.n_tokens)
        return;
    const int64_t k = duet_prefix_cache_keep(g.pc, w->m, &q->seq, r->ids, 0);
    if (k <= 0)
        return;
    if (r->kept_blocks > 0 && r->kept_blocks < k)
        (void)duet_prefix_cache_forget(g.pc, r->ids, r->kept_blocks);
    r->kept_blocks = k;
}

/* Request slot of r: which rows of g.logits are its. */
static float *gr_logits(const duet_worker_t *w, const gr_t *r)
{
    const int64_t slot = (int64_t)(((const char *)r - (const char *)w->reqs) / w->ops->req_size);
    return g.logits + slot * (int64_t)(g.so.k + 1) * w->V;
}

/* Whether r is decoded speculatively: on a worker that speculates, unless it has logit
 * processing. */
static bool gr_speculates(const gr_t *r)
{
    return g.spec != NULL && duet_worker_sampling_speculates(&r->base.sampling);
}

/* Whether a speculating r's steps need only their rows' arg-maxes (DUET_LOGITS_ARGMAX: greedy,
 * no logprobs), so the vocabulary rows stay on the device. */
static bool gr_spec_argmax(const gr_t *r)
{
    return duet_spec_seq_greedy(&r->ss) && !r->base.sampling.logprobs;
}

/*
 * Start speculating for r, whose newest generated token is r->next: the decoder's history is the
 * prompt (then freed; a moved-in request's also holds the tokens it generated before) and that
 * token. false: the request was ended with an error.
 */
static bool gr_spec_open(duet_worker_t *w, gr_t *r)
{
    duet_worker_req_t *q = &r->base;
    if (!gr_speculates(r)) { /* processing: no speculation (docs/architecture.md, "Sampling") */
        free(q->prompt);
        q->prompt = NULL;
        return true;
    }
    duet_status_t st = duet_spec_seq_open(g.spec, &r->ss, q->prompt, r->n_hist, r->next,
                                          q->max_tokens, &q->sampling.sp, &q->sampling.rng);
    free(q->prompt);
    q->prompt = NULL;
    if (st != DUET_OK) {
        char why[320];
        snprintf(why, sizeof(why), "cannot start speculative decoding: %s", duet_error_last());
        gr_fail(w, q, why);
        return false;
    }
    r->spec_open = true;
    return true;
}

/*
 * Hold the pages of a reservation that ended without its data; freed by the heartbeat tick, after
 * cache.quarantine_ms but never before the router's heartbeat timeout. A sender that is stopped
 * or starved (SIGSTOP, a paused VM) reads its Cancel only when it runs again, and its timers and
 * the rest of its step put first: for less than the timeout it is still the router's worker and
 * does so; for longer it has been dropped and leaves as it runs again, putting nothing
 * (worker/skeleton.c, w_frozen). So the timeout bounds how late its puts can come; a quarantine
 * shorter than that once let them land in another request's pages (bench/soak: a wrong answer).
 */
static void gr_quarantine(duet_worker_t *w, gr_t *r)
{
    free(r->base.prompt);
    r->base.prompt = NULL;
    r->base.phase = GR_QUARANTINE;
    r->base.xfer_live = false;
    const uint32_t rt = w->link != NULL ? duet_link_router_timeout_ms(w->link) : 0;
    r->release_at = duet_worker_now() + (rt > g.quarantine_ms ? rt : g.quarantine_ms) / 1000.0;
}

/* The retry hint of a refusal for want of room now (a slot, pages): the router tries again. */
#define GR_RETRY_MS 500

/*
 * A new request in a free slot with a sequence for `held` tokens (its prompt; a moved-in
 * request's KV) and the next step's rows (with cache.suspend; else all it may come to hold).
 * NULL with *why when it cannot be taken, and *retry_ms: GR_RETRY_MS when it may be taken once
 * other requests leave (no free slot or pages now), 0 when it never can be here.
 */
static gr_t *gr_new(duet_worker_t *w, uint64_t rid, uint32_t prompt_tokens, uint32_t max_tokens,
                    int64_t held, const uint32_t *lookup, const Duet__Sampling *s,
                    uint64_t deadline, const char **why, uint32_t *retry_ms)
{
    *retry_ms = 0;
    if (duet_worker_find(w, rid) != NULL) {
        *why = "a request with this id is already here";
        return NULL;
    }
    if (prompt_tokens == 0) {
        *why = "empty prompt";
        return NULL;
    }
    gr_t *r = (gr_t *)duet_worker_free_slot(w);
    if (r == NULL) {
        *why = "all request slots are in use";
        *retry_ms = GR_RETRY_MS;
        return NULL;
    }
    const int64_t full = (int64_t)prompt_tokens + max_tokens + g.slack;
    int64_t need = full;
    /* past max_seq_len: seq_open below refuses it, saying so */
    if (g.grow && full <= duet_model_opts(w->m)->max_seq_len) {
        /* it must fit the pool alone, so that resuming it never waits for nothing */
        static char msg[160];
        const duet_kv_pool_desc_t *kd = duet_kv_pool_desc(duet_model_kv_pool(w->m));
        const int64_t pages = (full + kd->page_tokens - 1) / kd->page_tokens;
        if (pages > kd->n_pages) {
            snprintf(msg, sizeof(msg), "the request may need %lld pages; the pool holds %lld",
                     (long long)pages, (long long)kd->n_pages);
            *why = msg;
            return NULL;
        }
        for (int64_t i = 0; i < w->n_reqs; i++)
            if (gr_at(w, i)->base.phase == GR_SUSPENDED) {
                *why = "suspended requests are waiting for pages";
                *retry_ms = GR_RETRY_MS;
                return NULL;
            }
        /* what it holds and the next step's rows; decoding grows it */
        need = held + 1 + g.slack;
        need = need < full ? need : full;
    }
    /* prompt_logprobs scores every prompt row: no prefix skipped */
    if (s != NULL && s->prompt_logprobs)
        lookup = NULL;
    /* ids < V (checked by the caller): the same bits as int32 */
    duet_status_t st = g.pc != NULL
                           ? duet_prefix_cache_seq_open(g.pc, w->m, (const int32_t *)lookup,
                                                        prompt_tokens, need, &r->base.seq)
                           : duet_worker_seq_open(w, need, &r->base.seq);
    if (st != DUET_OK) {
        *why = duet_error_last();
        *retry_ms = st == DUET_ERR_NO_SPACE ? GR_RETRY_MS : 0; /* not RANGE: over max_seq_len */
        r->base.seq.id = -1;
        return NULL;
    }
    duet_worker_req_init(w, &r->base, rid, prompt_tokens, max_tokens, s, deadline);
    r->base.prefilled = r->base.seq.n_tokens; /* a cached prefix (a local prefill's) */
    if (r->base.prefilled > 0)
        DUET_RLOG_DEBUG(rid, "prefix cache: %lld of %lld prompt tokens cached",
                        (long long)r->base.prefilled, (long long)prompt_tokens);
    r->full = full;
    r->full_cap = full;
    r->n_hist = prompt_tokens;
    if (duet_model_kv_pool(w->m) != NULL) {
        const int64_t pt = w->layout.page_tokens;
        r->full_cap = (full + pt - 1) / pt * pt;
    }
    return r;
}

/*
 * A step produced toks[0..n) for r (one, or with speculation the 1..k+1 a verify kept; the
 * sequence holds every one of them but the last): stream them in one Tokens, cut at the first
 * that ends the request (a stop id, max_tokens, a full sequence) exactly where one token per step
 * would stop, and end the request there or go on decoding. Returns how many were streamed.
 */
static int gr_emit(duet_worker_t *w, gr_t *r, const int32_t *toks, int n,
                   const duet_worker_logprob_t *lps)
{
    duet_worker_req_t *q = &r->base;
    int finish = DUET__TOKENS__FINISH_REASON__NONE, i = 0;
    uint32_t ids[DUET_SPEC_MAX_K + 1] = {0};
    while (i < n && finish == DUET__TOKENS__FINISH_REASON__NONE) {
        const int32_t tok = toks[i];
        ids[i++] = (uint32_t)tok;
        r->produced++;
        /* tokens of the sequence when tok is the newest: toks[i..n) come after it */
        const int64_t held = q->seq.n_tokens - (n - i);
        if (duet_worker_is_stop(&q->sampling, tok))
            finish = DUET__TOKENS__FINISH_REASON__STOP;
        else if (r->produced >= q->max_tokens || held + 1 > r->full_cap)
            finish = DUET__TOKENS__FINISH_REASON__LENGTH;
    }
    /* lps: one per token (NULL without logprobs); a local prefill's first Tokens carries the
     * prompt's */
    const duet_worker_sampling_t *ws = &q->sampling;
    const bool first = r->produced == (uint32_t)i;
    duet_worker_send_tokens_lp(w->link, q->rid, ids, (size_t)i, ws->logprobs ? lps : NULL,
                               first ? ws->prompt_lp : NULL, first ? (size_t)ws->n_prompt_lp : 0,
                               finish, NULL);
    if (finish != DUET__TOKENS__FINISH_REASON__NONE) {
        DUET_RLOG_DEBUG(q->rid, "finished: %u tokens", r->produced);
        gr_free(w, q);
        return i;
    }
    r->next = toks[i - 1];
    q->phase = GR_DECODE;
    return i;
}

static void gr_resume_moved_in(duet_worker_t *w, gr_t *r);
static void gr_reserve_recv(duet_worker_t *w, gr_t *r, int64_t n_tokens, int64_t n_replay,
                            uint64_t deadline_unix_ms);

/* Transferred cache and first token are both here: continue after the prompt. */
static void gr_start_decode(duet_worker_t *w, gr_t *r)
{
    duet_worker_req_t *q = &r->base;
    q->xfer_live = false;
    if (r->moved_in) {
        gr_resume_moved_in(w, r);
        return;
    }
    if (duet_worker_seq_filled(w, &q->seq, q->n_prompt, q->deadline_unix_ms) != DUET_OK) {
        gr_fail(w, q, duet_error_last());
        return;
    }
    r->produced = 1; /* the context worker's token, already streamed by the router */
    gr_ids_add(r, &r->next, 1);
    duet_worker_sampling_seen(&q->sampling, r->next);
    if (!duet_sampling_greedy(&q->sampling.sp))
        (void)duet_rng_uniform(&q->sampling.rng); /* the draw the context worker made for it */
    int finish = DUET__TOKENS__FINISH_REASON__NONE;
    if (duet_worker_is_stop(&q->sampling, r->next))
        finish = DUET__TOKENS__FINISH_REASON__STOP;
    else if (r->produced >= q->max_tokens)
        finish = DUET__TOKENS__FINISH_REASON__LENGTH;
    if (finish != DUET__TOKENS__FINISH_REASON__NONE) {
        duet_worker_send_tokens(w->link, q->rid, NULL, 0, finish, NULL);
        gr_free(w, q);
        return;
    }
    q->phase = GR_DECODE;
    if (g.spec != NULL && !gr_spec_open(w, r))
        return;
    duet_worker_update(w);
}

/* ------------------------------------------------------------------------------ moving */

static void gen_send_moved(duet_worker_t *w, uint64_t rid, bool ok, const char *reason)
{
    Duet__Moved mv = DUET__MOVED__INIT;
    mv.request_id = rid;
    mv.ok = ok;
    mv.reason = (char *)(reason != NULL ? reason : "");
    Duet__Envelope env = duet_envelope_moved(&mv);
    (void)duet_link_send(w->link, &env);
}

static void gen_send_paused(duet_worker_t *w, uint64_t rid, const char *refusal,
                            const Duet__MoveState *st)
{
    Duet__MovePaused mp = DUET__MOVE_PAUSED__INIT;
    mp.request_id = rid;
    mp.ok = refusal == NULL;
    mp.reason = (char *)(refusal != NULL ? refusal : "");
    mp.state = (Duet__MoveState *)st;
    Duet__Envelope env = duet_envelope_move_paused(&mp);
    (void)duet_link_send(w->link, &env);
}

/* A moved-in request's caches and the router's go are both here: decode on from its state. */
static void gr_resume_moved_in(duet_worker_t *w, gr_t *r)
{
    duet_worker_req_t *q = &r->base;
    if (duet_model_seq_set_received(w->m, &q->seq, r->in_tokens, r->in_replay) != DUET_OK) {
        char why[320];
        snprintf(why, sizeof(why), "cannot take the moved caches: %s", duet_error_last());
        gr_fail(w, q, why);
        return;
    }
    q->phase = GR_DECODE;
    DUET_RLOG_DEBUG(q->rid, "moved in: decoding on from %lld tokens, %u generated",
                    (long long)r->in_tokens, r->produced);
    if (g.spec != NULL && !gr_spec_open(w, r))
        return;
    free(q->prompt); /* without speculation nothing reads it */
    q->prompt = NULL;
    duet_worker_update(w);
}

/*
 * Reserve with a MoveState: a running request moving in from another generation worker. Its
 * state is checked against itself (the router checked it against the stream) before anything is
 * reserved: pages for the KV it holds, the state slot, the pending replay rows.
 */
static void gen_on_move_in(duet_worker_t *w, const Duet__Reserve *m)
{
    const Duet__MoveState *ms = m->move;
    const char *bad = NULL;
    if (w->group != NULL)
        bad = "Reserve: moving a running request into a generation group is not built";
    else if (ms->n_rng != DUET_PROTO_RNG_WORDS)
        bad = "Reserve: the moving request's RNG state has the wrong size";
    else if (ms->produced == 0 || ms->produced >= m->max_tokens ||
             ms->n_generated != ms->produced || ms->generated[ms->produced - 1] != ms->next_token)
        bad = "Reserve: the moving request's generated ids do not match its state";
    else if (m->n_tokens != m->prompt_tokens || m->prompt_tokens == 0 ||
             ms->kv_tokens != (uint64_t)m->prompt_tokens + ms->produced - 1)
        bad = "Reserve: the moving request's KV length is not its prompt and generated ids";
    else if (ms->replay_rows > ms->kv_tokens)
        bad = "Reserve: more replay rows than tokens";
    else if (ms->replay_rows > w->layout.replay_rows)
        bad = "Reserve: the moving request has more pending replay rows than this worker's replay "
              "pool holds per slot (no speculation here, or a smaller spec.k)";
    else if (!duet_worker_in_vocab(w, m->tokens, m->n_tokens) ||
             !duet_worker_in_vocab(w, ms->generated, ms->n_generated))
        bad = "Reserve: a token of the moving request is outside the vocabulary";
    if (bad != NULL) {
        DUET_RLOG_WARN(m->request_id, "refusing the move: %s", bad);
        duet_worker_send_refused(w->link, m->request_id, bad, 0);
        return;
    }
    const char *why = NULL;
    /* the reservation is bound by the move's deadline (gr_reserve_recv below), the request's
     * decoding after it by its own */
    const uint64_t deadline =
        ms->request_deadline_unix_ms != 0 ? ms->request_deadline_unix_ms : m->deadline_unix_ms;
    uint32_t retry_ms = 0;
    gr_t *r = gr_new(w, m->request_id, m->prompt_tokens, m->max_tokens, (int64_t)ms->kv_tokens,
                     NULL, m->sampling, deadline, &why, &retry_ms);
    if (r == NULL) {
        DUET_RLOG_INFO(m->request_id, "refusing the move: %s", why);
        duet_worker_send_refused(w->link, m->request_id, why, retry_ms);
        return;
    }
    duet_worker_req_t *q = &r->base;
    if (!duet_worker_req_setup(w, q, m->tokens, m->n_tokens, ms->generated, ms->n_generated,
                               &why)) {
        duet_worker_send_refused(w->link, q->rid, why, 500);
        gr_free(w, q);
        return;
    }
    gr_ids_init(r, m->tokens, m->n_tokens, ms->generated, ms->produced);
    r->moved_in = true;
    r->in_tokens = (int64_t)ms->kv_tokens;
    r->in_replay = ms->replay_rows;
    r->produced = ms->produced;
    r->next = (int32_t)ms->next_token;
    for (unsigned i = 0; i < DUET_PROTO_RNG_WORDS; i++)
        q->sampling.rng.s[i] = ms->rng[i];
    if (g.spec != NULL) { /* the drafter's history: prompt, then every id but the newest */
        r->n_hist = r->in_tokens;
        q->prompt = malloc(sizeof(int32_t) * (size_t)r->n_hist);
        if (q->prompt == NULL) {
            duet_worker_send_refused(w->link, q->rid, "out of memory", 500);
            gr_free(w, q);
            return;
        }
        for (size_t i = 0; i < m->n_tokens; i++)
            q->prompt[i] = (int32_t)m->tokens[i];
        for (uint32_t i = 0; i + 1 < ms->produced; i++)
            q->prompt[m->n_tokens + i] = (int32_t)ms->generated[i];
    }
    gr_reserve_recv(w, r, r->in_tokens, r->in_replay, m->deadline_unix_ms);
}

/* MovePause: take a decoding request out of the batch and tell the router where it stands. */
static void gen_on_move_pause(duet_worker_t *w, const Duet__MovePause *m)
{
    gr_t *r = (gr_t *)duet_worker_find(w, m->request_id);
    if (w->group != NULL) {
        gen_send_paused(w, m->request_id, "moving a request out of a generation group is not built",
                        NULL);
        return;
    }
    if (r == NULL || r->base.phase != GR_DECODE) {
        gen_send_paused(w, m->request_id,
                        r == NULL ? "no such request here" : "the request is not decoding yet",
                        NULL);
        return;
    }
    duet_worker_req_t *q = &r->base;
    /* The move reads the host pools unless UCX moves the device pools directly: a device model's
     * caches (its KV, state and replay rows live on the GPU) are copied there first. */
    if (!duet_model_opts(w->m)->device_pools_shared &&
        duet_model_seq_sync_host(w->m, &q->seq) != DUET_OK) {
        char why[384];
        snprintf(why, sizeof(why), "cannot stage the request's caches for the move: %s",
                 duet_error_last());
        gen_send_paused(w, m->request_id, why, NULL);
        return;
    }
    /* between steps nothing is pending (n_pending 0); the accepted rows not yet folded into the
     * KDA state (n_replay) travel as they are (a device replay pool's were folded in just now),
     * and the target folds them in at its first step */
    uint64_t rng[DUET_PROTO_RNG_WORDS];
    for (unsigned i = 0; i < DUET_PROTO_RNG_WORDS; i++)
        rng[i] = q->sampling.rng.s[i];
    Duet__MoveState st = DUET__MOVE_STATE__INIT;
    st.kv_tokens = (uint64_t)q->seq.n_tokens;
    st.replay_rows = (uint32_t)q->seq.n_replay;
    st.produced = r->produced;
    st.next_token = (uint32_t)r->next;
    st.rng = rng;
    st.n_rng = DUET_PROTO_RNG_WORDS;
    q->phase = GR_PAUSED;
    gen_send_paused(w, q->rid, NULL, &st);
    DUET_RLOG_DEBUG(q->rid, "paused to move at %lld tokens", (long long)q->seq.n_tokens);
}

/* Put every byte of a moving request (now, or when test.move_hold_ms has passed). */
static void gr_move_put(duet_worker_t *w, gr_t *r)
{
    r->put_at = 0;
    for (uint32_t l = 0; l < w->layout.n_mla_layers; l++)
        (void)duet_xfer_send_layer_ready(w->x, r->base.xid, l); /* an ended one reports */
    (void)duet_xfer_send_kda_ready(w->x, r->base.xid);
}

/* MoveOut: send a paused request's caches into the target's reservation. */
static void gen_on_move_out(duet_worker_t *w, const Duet__MoveOut *m)
{
    gr_t *r = (gr_t *)duet_worker_find(w, m->request_id);
    if (r == NULL || r->base.phase != GR_PAUSED) {
        gen_send_moved(w, m->request_id, false, "MoveOut for a request not paused here");
        return;
    }
    duet_worker_req_t *q = &r->base;
    char why[384];
    duet_status_t st = duet_xfer_reservation_decode(m->reservation.data, m->reservation.len,
                                                    duet_xfer_now_unix_ms(), &r->mres);
    if (st == DUET_OK) {
        r->mres_live = true;
        const uint32_t pt = w->layout.page_tokens;
        duet_xfer_send_args_t a = {
            .req_id = q->rid,
            .reservations = &r->mres,
            .n_ranks = 1,
            .layout = w->layout,
            .src = {.pages = q->seq.pages,
                    .n_pages = (uint32_t)((q->seq.n_tokens + pt - 1) / pt),
                    .kda_slot = q->seq.kda_slot,
                    .n_tokens = (uint64_t)q->seq.n_tokens,
                    .n_replay = (uint32_t)q->seq.n_replay},
            .checksum = g.checksum,
            .cb = duet_worker_xfer_cb,
            .user = w,
        };
        if (w->layout.n_mla_layers == 0)
            a.src.n_pages = 0;
        st = duet_xfer_send_start(w->x, &a, &q->xid);
    }
    if (st != DUET_OK) {
        snprintf(why, sizeof(why), "cannot start sending the caches: %s", duet_error_last());
        DUET_RLOG_WARN(q->rid, "%s", why);
        if (r->mres_live)
            duet_xfer_reservation_free(&r->mres);
        r->mres_live = false;
        q->phase = GR_DECODE;
        gen_send_moved(w, q->rid, false, why);
        duet_worker_update(w);
        return;
    }
    q->xfer_live = true;
    q->phase = GR_MOVING;
    if (g.move_hold_ms > 0)
        r->put_at = duet_worker_now() + g.move_hold_ms / 1000.0;
    else
        gr_move_put(w, r);
}

/* MoveCancel: the move is off; decode on (a transfer under way ends first, in gr_moved). */
static void gen_on_move_cancel(duet_worker_t *w, const Duet__MoveCancel *m)
{
    gr_t *r = (gr_t *)duet_worker_find(w, m->request_id);
    if (r == NULL)
        return;
    if (r->base.phase == GR_PAUSED) {
        DUET_RLOG_DEBUG(r->base.rid, "not moving: %s", m->reason);
        r->base.phase = GR_DECODE;
        duet_worker_update(w);
    } else if (r->base.phase == GR_MOVING && r->base.xfer_live) {
        (void)duet_xfer_send_cancel(w->x, r->base.xid, m->reason);
    }
}

/* The outcome of a moving request's transfer: gone to the target, or back in the batch. */
static void gr_moved(duet_worker_t *w, gr_t *r, const duet_xfer_outcome_t *o)
{
    duet_worker_req_t *q = &r->base;
    q->xfer_live = false;
    if (r->mres_live)
        duet_xfer_reservation_free(&r->mres);
    r->mres_live = false;
    if (r->cancelling) { /* the request ended meanwhile (its final Tokens went out) */
        gr_free(w, q);
        duet_worker_update(w);
        return;
    }
    if (o->kind == DUET_XFER_OUTCOME_DONE) {
        DUET_RLOG_INFO(q->rid, "moved out: %lld tokens, %lld replay rows, %llu bytes in %.3f ms",
                       (long long)q->seq.n_tokens, (long long)q->seq.n_replay,
                       (unsigned long long)o->bytes, o->seconds * 1e3);
        gen_send_moved(w, q->rid, true, NULL);
        gr_free(w, q);
        duet_worker_update(w);
        return;
    }
    char msg[384];
    snprintf(msg, sizeof(msg), "sending the caches failed (%s): %s",
             duet_xfer_reason_str(o->reason), o->message);
    DUET_RLOG_WARN(q->rid, "%s; decoding on here", msg);
    q->phase = GR_DECODE;
    gen_send_moved(w, q->rid, false, msg);
    duet_worker_update(w);
}

/* ------------------------------------------------------------------------------ transfer */

static void gen_on_xfer(duet_worker_t *w, duet_worker_req_t *q, const duet_xfer_outcome_t *o)
{
    gr_t *r = (gr_t *)q;
    if (o->role == DUET_XFER_ROLE_SEND) {
        gr_moved(w, r, o);
        return;
    }
    if (o->kind == DUET_XFER_OUTCOME_DONE) {
        r->xfer_done = true;
        DUET_RLOG_DEBUG(q->rid, "cache received: %llu bytes in %.3f ms",
                        (unsigned long long)o->bytes, o->seconds * 1e3);
        if (r->have_first)
            gr_start_decode(w, r);
        return;
    }
    if (!r->cancelling) {
        char msg[384];
        snprintf(msg, sizeof(msg), "the KV cache transfer was aborted (%s): %s",
                 duet_xfer_reason_str(o->reason), o->message);
        DUET_RLOG_WARN(q->rid, "%s", msg);
        duet_worker_send_tokens(w->link, q->rid, NULL, 0, DUET__TOKENS__FINISH_REASON__ERROR, msg);
    }
    gr_quarantine(w, r);
}

/* ------------------------------------------------------------------------------ messages */

static void gen_on_reserve(duet_worker_t *w, const Duet__Reserve *m)
{
    if (w->draining) {
        duet_worker_send_refused(w->link, m->request_id, "draining", 0);
        return;
    }
    if (m->move != NULL) {
        gen_on_move_in(w, m);
        return;
    }
    if (m->n_tokens != 0 && m->n_tokens != m->prompt_tokens) {
        duet_worker_send_refused(w->link, m->request_id, "Reserve: tokens and prompt_tokens differ",
                                 0);
        return;
    }
    if (m->max_tokens == 0) { /* scoring the prompt only is a Generate (local prefill) */
        duet_worker_send_refused(w->link, m->request_id, "Reserve: max_tokens 0", 0);
        return;
    }
    /* speculation drafts from the prompt (and a draft model prefills it here) */
    if (g.spec != NULL && m->n_tokens == 0) {
        duet_worker_send_refused(w->link, m->request_id,
                                 "Reserve: speculative decoding needs the prompt ids (tokens)", 0);
        return;
    }
    if (g.spec != NULL && !duet_worker_in_vocab(w, m->tokens, m->n_tokens)) {
        duet_worker_send_refused(w->link, m->request_id,
                                 "Reserve: a prompt token is outside the vocabulary", 0);
        return;
    }
    const char *why = NULL;
    uint32_t retry_ms = 0;
    gr_t *r = gr_new(w, m->request_id, m->prompt_tokens, m->max_tokens, m->prompt_tokens, NULL,
                     m->sampling, m->deadline_unix_ms, &why, &retry_ms);
    if (r == NULL) {
        DUET_RLOG_INFO(m->request_id, "refusing the reservation: %s", why);
        duet_worker_send_refused(w->link, m->request_id, why, retry_ms);
        return;
    }
    duet_worker_req_t *q = &r->base;
    /* the penalties read the prompt ids (the router sends them) */
    if (!duet_worker_req_setup(w, q, m->n_tokens == m->prompt_tokens ? m->tokens : NULL,
                               m->prompt_tokens, NULL, 0, &why)) {
        duet_worker_send_refused(w->link, q->rid, why, 0);
        gr_free(w, q);
        return;
    }
    if (g.spec != NULL && !duet_worker_req_set_prompt(q, m->tokens, m->n_tokens)) {
        duet_worker_send_refused(w->link, q->rid, "out of memory", 500);
        gr_free(w, q);
        return;
    }
    gr_ids_init(r, m->n_tokens == m->prompt_tokens ? m->tokens : NULL, m->n_tokens, NULL, 0);
    gr_reserve_recv(w, r, q->n_prompt, 0, m->deadline_unix_ms);
}

/*
 * Reserve r's first n_tokens tokens of KV, its state slot and n_replay replay rows for a sender
 * (RECEIVING) and answer Reserved with the reservation; or Refused, r freed.
 */
static void gr_reserve_recv(duet_worker_t *w, gr_t *r, int64_t n_tokens, int64_t n_replay,
                            uint64_t deadline_unix_ms)
{
    duet_worker_req_t *q = &r->base;
    const uint32_t pt = w->layout.page_tokens;
    q->phase = GR_RECEIVING;
    /* in a group rank 0 holds the pages of c = 0: global pages 0, cp, 2 cp, ... */
    const int64_t cp = w->group != NULL ? duet_group_cp(w->group) : 1;
    duet_xfer_recv_args_t a = {
        .req_id = q->rid,
        .layout = w->layout,
        .pages = q->seq.pages,
        .n_pages = (uint32_t)duet_xfer_kv_shard_pages((uint64_t)((n_tokens + pt - 1) / pt),
                                                      (uint32_t)cp, 0),
        .kda_slot = q->seq.kda_slot,
        .n_tokens = (uint64_t)n_tokens,
        .rank = 0,
        .group_size = w->group != NULL ? (uint32_t)duet_group_size(w->group) : 1,
        .kv_ranks = (uint32_t)cp,
        .deadline_unix_ms = deadline_unix_ms,
        .cb = duet_worker_xfer_cb,
        .user = w,
    };
    a.n_replay = (uint32_t)n_replay;
    if (w->layout.n_mla_layers == 0)
        a.n_pages = 0;
    duet_xfer_reservation_t res;
    duet_status_t st = duet_xfer_recv_reserve(w->x, &a, &res);
    uint8_t *buf = NULL;
    size_t len = 0;
    if (st == DUET_OK) {
        size_t cap = duet_xfer_reservation_packed_size(&res);
        buf = malloc(cap > 0 ? cap : 1);
        st = buf == NULL ? DUET_ERR_NOMEM : duet_xfer_reservation_encode(&res, buf, cap, &len);
        if (st != DUET_OK)
            (void)duet_xfer_recv_cancel(w->x, res.transfer_id, "encoding failed");
        else {
            q->xid = res.transfer_id;
            q->xfer_live = true;
        }
    }
    /* the followers' shares of a group */
    uint8_t *more[DUET_XFER_MAX_RANKS] = {0};
    size_t more_len[DUET_XFER_MAX_RANKS] = {0};
    ProtobufCBinaryData more_pb[DUET_XFER_MAX_RANKS];
    const int n_more = w->group != NULL ? duet_group_size(w->group) - 1 : 0;
    if (st == DUET_OK && n_more > 0 &&
        (st = duet_group_reserve(w->group, &q->seq, q->rid, n_tokens, deadline_unix_ms, more,
                                 more_len)) != DUET_OK) {
        char why[256];
        snprintf(why, sizeof(why), "%s", duet_error_last());
        (void)duet_xfer_recv_cancel(w->x, q->xid, why);
        q->xfer_live = false;
        duet_error_set(st, "%s", why);
    }
    if (st != DUET_OK) {
        char why_buf[256];
        snprintf(why_buf, sizeof(why_buf), "cannot reserve: %s", duet_error_last());
        duet_worker_send_refused(w->link, q->rid, why_buf, st == DUET_ERR_BUSY ? 500 : 0);
        gr_free(w, q);
        free(buf);
        return;
    }
    Duet__Reserved rs = DUET__RESERVED__INIT;
    rs.request_id = q->rid;
    rs.reservation.data = buf;
    rs.reservation.len = len;
    for (int i = 0; i < n_more; i++)
        more_pb[i] = (ProtobufCBinaryData){.len = more_len[i], .data = more[i]};
    rs.n_more_reservations = (size_t)n_more;
    rs.more_reservations = n_more > 0 ? more_pb : NULL;
    Duet__Envelope env = duet_envelope_reserved(&rs);
    (void)duet_link_send(w->link, &env);
    free(buf);
    if (n_more > 0)
        duet_group_free_reservations(w->group, more);
    DUET_RLOG_DEBUG(q->rid, "reserved %lld pages for %lld tokens (%lld + %u at most)",
                    (long long)q->seq.n_pages, (long long)n_tokens, (long long)q->n_prompt,
                    q->max_tokens);
}

/* End r's reservation before its data came (rank 0's, and in a group every rank's share). */
static void gen_recv_cancel(duet_worker_t *w, gr_t *r, const char *why)
{
    if (w->group != NULL)
        duet_group_recv_cancel(w->group, &r->base.seq, why);
    (void)duet_xfer_recv_cancel(w->x, r->base.xid, why);
}

static void gen_on_prefill_done(duet_worker_t *w, const Duet__PrefillDone *m)
{
    gr_t *r = (gr_t *)duet_worker_find(w, m->request_id);
    if (r == NULL || r->base.phase != GR_RECEIVING || r->have_first) {
        duet_worker_send_tokens(w->link, m->request_id, NULL, 0, DUET__TOKENS__FINISH_REASON__ERROR,
                                "PrefillDone for a request with no reservation here (it expired, "
                                "was cancelled or its transfer failed)");
        return;
    }
    if ((int64_t)m->first_token >= w->V) {
        duet_worker_send_tokens(w->link, r->base.rid, NULL, 0, DUET__TOKENS__FINISH_REASON__ERROR,
                                "PrefillDone: first token outside the vocabulary");
        if (r->base.xfer_live) {
            r->cancelling = true;
            gen_recv_cancel(w, r, "bad first token");
        }
        return;
    }
    r->have_first = true;
    if (!r->moved_in) /* a moved-in request's next token came with its MoveState */
        r->next = (int32_t)m->first_token;
    if (r->xfer_done)
        gr_start_decode(w, r);
}

static void gen_on_generate(duet_worker_t *w, const Duet__Generate *m)
{
    if (w->draining) {
        duet_worker_send_refused(w->link, m->request_id, "draining", 0);
        return;
    }
    if (!duet_worker_in_vocab(w, m->tokens, m->n_tokens)) {
        duet_worker_send_tokens(w->link, m->request_id, NULL, 0, DUET__TOKENS__FINISH_REASON__ERROR,
                                "Generate: a prompt token is outside the vocabulary");
        return;
    }
    const char *why = NULL;
    uint32_t retry_ms = 0;
    gr_t *r = gr_new(w, m->request_id, (uint32_t)m->n_tokens, m->max_tokens, (int64_t)m->n_tokens,
                     m->tokens, m->sampling, m->deadline_unix_ms, &why, &retry_ms);
    if (r == NULL) {
        DUET_RLOG_INFO(m->request_id, "refusing the local prefill: %s", why);
        duet_worker_send_refused(w->link, m->request_id, why, retry_ms);
        return;
    }
    if (!duet_worker_req_setup(w, &r->base, m->tokens, m->n_tokens, NULL, 0, &why)) {
        /* not a matter of capacity (bad Sampling, or out of memory): end it, saying why */
        duet_worker_send_tokens(w->link, m->request_id, NULL, 0, DUET__TOKENS__FINISH_REASON__ERROR,
                                why);
        gr_free(w, &r->base);
        return;
    }
    if (!duet_worker_req_set_prompt(&r->base, m->tokens, m->n_tokens)) {
        duet_worker_send_refused(w->link, m->request_id, "out of memory", 500);
        gr_free(w, &r->base);
        return;
    }
    gr_ids_init(r, m->tokens, m->n_tokens, NULL, 0);
    r->base.phase = GR_PREFILL;
    duet_worker_update(w);
}

static void gen_on_cancel(duet_worker_t *w, const Duet__Cancel *m)
{
    gr_t *r = (gr_t *)duet_worker_find(w, m->request_id);
    if (r == NULL || r->base.phase == GR_QUARANTINE)
        return;
    /* prefix_cache_gen_cluster reads this line: a cancel while the prompt is prefilled */
    DUET_RLOG_DEBUG(r->base.rid, "cancelled at %lld of %lld prompt tokens prefilled: %s",
                    (long long)r->base.prefilled, (long long)r->base.n_prompt, m->reason);
    duet_worker_send_tokens(w->link, r->base.rid, NULL, 0, DUET__TOKENS__FINISH_REASON__CANCELLED,
                            NULL);
    if (r->base.phase == GR_MOVING && r->base.xfer_live) {
        r->cancelling = true; /* freed by the outcome, once no put reads its pages */
        (void)duet_xfer_send_cancel(w->x, r->base.xid, m->reason);
        return;
    }
    if (r->base.phase == GR_RECEIVING && r->base.xfer_live) {
        r->cancelling = true;
        gen_recv_cancel(w, r, m->reason);  /* outcome: quarantine */
        if (r->base.phase == GR_RECEIVING) /* ended before? */
            gr_quarantine(w, r);
        return;
    }
    if (r->base.phase == GR_RECEIVING) {
        gr_quarantine(w, r);
        return;
    }
    gr_free(w, &r->base);
}

static bool gen_on_message(duet_worker_t *w, const Duet__Envelope *env)
{
    switch (env->body_case) {
    case DUET__ENVELOPE__BODY_RESERVE:
        gen_on_reserve(w, env->reserve);
        return true;
    case DUET__ENVELOPE__BODY_PREFILL_DONE:
        gen_on_prefill_done(w, env->prefill_done);
        return true;
    case DUET__ENVELOPE__BODY_GENERATE:
        gen_on_generate(w, env->generate);
        return true;
    case DUET__ENVELOPE__BODY_CANCEL:
        gen_on_cancel(w, env->cancel);
        return true;
    case DUET__ENVELOPE__BODY_MOVE_PAUSE:
        gen_on_move_pause(w, env->move_pause);
        return true;
    case DUET__ENVELOPE__BODY_MOVE_OUT:
        gen_on_move_out(w, env->move_out);
        return true;
    case DUET__ENVELOPE__BODY_MOVE_CANCEL:
        gen_on_move_cancel(w, env->move_cancel);
        return true;
    default:
        return false;
    }
}

/* ------------------------------------------------------------------------------ suspend */

/* Tokens r's sequence must hold for its next step: a token, or a verify of up to spec.k drafts
 * (never past what it may come to hold). */
static int64_t gr_step_need(const gr_t *r, int64_t n_tokens)
{
    const int64_t need = n_tokens + 1 + (g.spec != NULL ? g.so.k : 0);
    return need < r->full ? need : r->full;
}

/* Suspend decoding request r: its cache to a host buffer, its pages and slot back to the pool. */
static void gr_suspend(duet_worker_t *w, gr_t *r)
{
    duet_worker_req_t *q = &r->base;
    const size_t bytes = duet_model_seq_snapshot_bytes(w->m, q->seq.n_tokens);
    r->snap = malloc(bytes > 0 ? bytes : 1);
    if (r->snap == NULL) {
        gr_fail(w, q, "out of host memory to suspend the request in");
        return;
    }
    if (duet_model_seq_snapshot_save(w->m, &q->seq, r->snap) != DUET_OK) {
        char why[320];
        snprintf(why, sizeof(why), "cannot suspend the request: %s", duet_error_last());
        gr_fail(w, q, why);
        return;
    }
    r->snap_tokens = q->seq.n_tokens;
    duet_model_seq_close(w->m, &q->seq);
    q->phase = GR_SUSPENDED;
    g.suspensions++;
    DUET_RLOG_DEBUG(q->rid, "suspended at %lld tokens (%zu bytes)", (long long)r->snap_tokens,
                    bytes);
}

/* Resume suspended request r if its pages and a slot are free; false when they are not. */
static bool gr_resume(duet_worker_t *w, gr_t *r)
{
    duet_worker_req_t *q = &r->base;
    if (duet_prefix_cache_seq_open(g.pc, w->m, NULL, 0, gr_step_need(r, r->snap_tokens), &q->seq) !=
        DUET_OK)
        return false;
    duet_status_t st = duet_model_seq_snapshot_restore(w->m, &q->seq, r->snap, r->snap_tokens);
    free(r->snap);
    r->snap = NULL;
    g.resumes++;
    if (st != DUET_OK) {
        char why[320];
        snprintf(why, sizeof(why), "cannot resume the request: %s", duet_error_last());
        gr_fail(w, q, why);
        return true;
    }
    q->phase = GR_DECODE;
    DUET_RLOG_DEBUG(q->rid, "resumed at %lld tokens", (long long)r->snap_tokens);
    return true;
}

/* The request of phase `ph` that arrived first (oldest 1) or last (0); NULL when none. */
static gr_t *gr_by_age(const duet_worker_t *w, int ph, int oldest)
{
    gr_t *best = NULL;
    for (int64_t i = 0; i < w->n_reqs; i++) {
        gr_t *r = gr_at(w, i);
        if ((int)r->base.phase == ph &&
            (best == NULL || (oldest ? r->base.arrival < best->base.arrival
                                     : r->base.arrival > best->base.arrival)))
            best = r;
    }
    return best;
}

/*
 * Before a step (cache.suspend): every decoding request, oldest first, grows to hold the step's
 * rows; one that cannot suspends the youngest decoding request (itself when it is the youngest)
 * until it can. Then the oldest suspended requests resume, in order, while they fit.
 */
static void gen_make_room(duet_worker_t *w)
{
    for (;;) {
        gr_t *r = NULL; /* the oldest decoding request not yet grown this step */
        for (int64_t i = 0; i < w->n_reqs; i++) {
            gr_t *c = gr_at(w, i);
            if (c->base.phase == GR_DECODE &&
                c->base.seq.cap_tokens < gr_step_need(c, c->base.seq.n_tokens) &&
                (r == NULL || c->base.arrival < r->base.arrival))
                r = c;
        }
        if (r == NULL)
            break;
        /* the prefix cache's entries go before any request is suspended */
        while (duet_prefix_cache_seq_grow(g.pc, w->m, &r->base.seq,
                                          gr_step_need(r, r->base.seq.n_tokens)) != DUET_OK) {
            gr_t *v = gr_by_age(w, GR_DECODE, 0);
            gr_suspend(w, v);
            if (v == r)
                break;
        }
    }
    gr_t *o;
    while ((o = gr_by_age(w, GR_SUSPENDED, 1)) != NULL && gr_resume(w, o))
        ;
}

/* ------------------------------------------------------------------------------ step */

/*
 * Speculating: the decoding requests of the step, in table order as plain decoding takes them, each
 * with its whole draft allowance reserved in the budget (spec.k, less near max_tokens so that the
 * kept drafts and the target's token never pass it; a request whose allowance does not fit waits
 * for a later step). Reserving before drafting keeps what a request drafts independent of the rest
 * of the batch. Drafts for all of them come from one propose; a request with drafts becomes a
 * verify item [next token, drafts] with the logits of every row, one without a plain row whose
 * logits the acceptance rule samples from. Rows reserved but not drafted go back to the budget.
 */
static int64_t gen_plan_spec(duet_worker_t *w, int64_t *budget_p)
{
    int64_t n = 0, budget = *budget_p;
    for (int64_t i = 0; i < w->n_reqs; i++) {
        gr_t *r = gr_at(w, i);
        if (r->base.phase != GR_DECODE || !gr_speculates(r))
            continue; /* one row per step, planned by gen_plan_step */
        /* a decoding request has produced fewer than max_tokens */
        const int64_t left = (int64_t)r->base.max_tokens - r->produced - 1;
        const int cap = (int)(left < g.so.k ? left : g.so.k);
        if (1 + cap > budget)
            continue;
        w->item_req[n] = &r->base;
        g.ss[n] = &r->ss;
        g.k_cap[n] = cap;
        budget -= 1 + cap;
        n++;
    }
    if (n == 0)
        return 0;
    if (duet_spec_propose(g.spec, g.ss, g.k_cap, n) != DUET_OK) {
        /* the draft model's sequences are in an unknown state: end what drafted */
        char why[320];
        snprintf(why, sizeof(why), "drafting failed: %s", duet_error_last());
        DUET_LOG_ERROR("%s", why);
        for (int64_t j = 0; j < n; j++)
            gr_fail(w, w->item_req[j], why);
        return 0;
    }
    for (int64_t j = 0; j < n; j++) {
        gr_t *r = (gr_t *)w->item_req[j];
        const int k = r->ss.k;
        budget += g.k_cap[j] - k;
        r->vtok[0] = duet_spec_seq_next(&r->ss);
        memcpy(r->vtok + 1, r->ss.drafts, sizeof(int32_t) * (size_t)k);
        const bool am = gr_spec_argmax(r);
        w->items[j] = (duet_batch_item_t){.seq = &r->base.seq,
                                          .tokens = r->vtok,
                                          .n_tokens = k + 1,
                                          .logits_mode = am      ? DUET_LOGITS_ARGMAX
                                                         : k > 0 ? DUET_LOGITS_ALL
                                                                 : DUET_LOGITS_LAST,
                                          .logits = gr_logits(w, r),
                                          .token_out = r->vmax,
                                          .verify = k > 0};
    }
    *budget_p = budget;
    return n;
}

/* Every decoding request (one token each, or a verify when speculating), then prefill chunks
 * within batch.max_tokens. */
static int64_t gen_plan_step(duet_worker_t *w)
{
    int64_t n = 0, budget = w->budget;
    if (g.grow)
        gen_make_room(w);
    if (g.spec != NULL)
        n = gen_plan_spec(w, &budget);
    for (int64_t i = 0; i < w->n_reqs && budget > 0; i++) {
        gr_t *r = gr_at(w, i);
        if (r->base.phase != GR_DECODE || gr_speculates(r))
            continue;
        w->items[n] = (duet_batch_item_t){.seq = &r->base.seq, .tokens = &r->next, .n_tokens = 1};
        duet_worker_item_draw(w, &r->base, &w->items[n]);
        w->item_req[n] = &r->base;
        n++;
        budget--;
    }
    g.n_decode = n;
    int64_t n_pre = 0;
    for (int64_t i = 0; i < w->n_reqs; i++)
        if (gr_at(w, i)->base.phase == GR_PREFILL)
            w->order[n_pre++] = duet_worker_req(w, i);
    return duet_worker_add_prefill(w, w->order, n_pre, n, &budget);
}

/*
 * After a speculating request's step (item `it`): what the verify keeps (duet_spec_finish: the
 * sequence accepts it, the history records it) into toks[0..*n_p), and the speculation counters.
 * false: the request was ended with an error.
 */
static bool gen_spec_finish(duet_worker_t *w, gr_t *r, const duet_batch_item_t *it, int32_t *toks,
                            int *n_p)
{
    const int k = r->ss.k;
    const duet_status_t st =
        it->logits_mode == DUET_LOGITS_ARGMAX
            ? duet_spec_finish_argmax(g.spec, &r->ss, &r->base.seq, r->vmax, toks, n_p)
            : duet_spec_finish(g.spec, &r->ss, &r->base.seq, it->logits, toks, n_p);
    if (st != DUET_OK) {
        char why[320];
        snprintf(why, sizeof(why), "speculative step failed: %s", duet_error_last());
        gr_fail(w, &r->base, why);
        return false;
    }
    if (k > 0) { /* a verify step: the kept drafts are always the first n - 1 */
        g.spec_step_tokens[*n_p - 1]++;
        for (int j = 0; j < k; j++) {
            g.spec_drafted[j]++;
            g.spec_accepted[j] += j < *n_p - 1;
        }
    }
    return true;
}

static void gen_step_done(duet_worker_t *w, int64_t n, duet_status_t st, double seconds)
{
    if (st != DUET_OK) {
        /* validation refused the batch: nothing advanced; fail its requests, keep serving */
        char why[512];
        snprintf(why, sizeof(why), "%s", duet_error_last());
        DUET_LOG_ERROR("forward step failed: %s", why);
        for (int64_t i = 0; i < n; i++)
            gr_fail(w, w->item_req[i], why);
        return;
    }
    if (g.n_decode > 0) {
        g.decode_steps++;
        g.decode_seq_steps += (uint64_t)g.n_decode;
        g.step_seconds += seconds;
    }
    for (int64_t i = 0; i < n; i++) {
        gr_t *r = (gr_t *)w->item_req[i];
        if (i < g.n_decode) { /* a decoding request: its token(s) */
            int32_t toks[DUET_SPEC_MAX_K + 1];
            int n_toks = 1;
            toks[0] = r->base.drawn; /* drawn by the step (or the host after it) */
            const duet_worker_logprob_t *lps = &r->base.sampling.drawn_lp;
            if (gr_speculates(r)) {
                if (!gen_spec_finish(w, r, &w->items[i], toks, &n_toks))
                    continue;
                /* token j came from verify row j (row 0 of a plain step) */
                for (int j = 0; j < n_toks && r->base.sampling.logprobs; j++)
                    duet_worker_logprob(&r->base.sampling, w->items[i].logits + j * w->V, w->V,
                                        toks[j], &r->vlp[j]);
                lps = r->vlp;
            }
            gr_ids_add(r, toks, n_toks); /* the sequence holds all but the newest */
            gr_keep_decoded(w, r);
            g.decoded_tokens += (uint64_t)gr_emit(w, r, toks, n_toks, lps);
            continue;
        }
        r->base.prefilled += w->items[i].n_tokens; /* a prefill chunk */
        (void)duet_prefix_cache_keep(g.pc, w->m, &r->base.seq, r->base.prompt, w->chunk);
        if (r->base.prefilled < r->base.n_prompt)
            continue;
        if (r->base.max_tokens == 0) { /* scoring the prompt (echo): no token, its logprobs */
            const duet_worker_sampling_t *ws = &r->base.sampling;
            duet_worker_send_tokens_lp(w->link, r->base.rid, NULL, 0, NULL, ws->prompt_lp,
                                       (size_t)ws->n_prompt_lp, DUET__TOKENS__FINISH_REASON__LENGTH,
                                       NULL);
            gr_free(w, &r->base);
            continue;
        }
        /* the first token, drawn by the last chunk */
        gr_ids_add(r, &r->base.drawn, 1);
        gr_emit(w, r, &r->base.drawn, 1, &r->base.sampling.drawn_lp);
        if (r->base.phase != GR_DECODE)
            continue; /* it ended there */
        if (g.spec == NULL) {
            free(r->base.prompt);
            r->base.prompt = NULL;
        } else {
            (void)gr_spec_open(w, r); /* takes the prompt */
        }
    }
}

/* Decoding or prefilling requests, or a suspended one whose pages are free. */
static bool gen_has_work(duet_worker_t *w)
{
    for (int64_t i = 0; i < w->n_reqs; i++)
        if (gr_at(w, i)->base.phase == GR_DECODE || gr_at(w, i)->base.phase == GR_PREFILL)
            return true;
    const gr_t *o = gr_by_age(w, GR_SUSPENDED, 1);
    if (o == NULL)
        return false;
    if (duet_prefix_cache_entries(g.pc) > 0)
        return true; /* its resume drops cache entries for pages (gen_make_room) */
    const int64_t pt = w->layout.page_tokens;
    return (gr_step_need(o, o->snap_tokens) + pt - 1) / pt <=
           duet_kv_pool_n_free(duet_model_kv_pool(w->m));
}

/* ------------------------------------------------------------------------------ timers */

static void gen_heartbeat(duet_worker_t *w, Duet__Heartbeat *hb)
{
    for (int64_t i = 0; i < w->n_reqs; i++) {
        const gr_t *r = gr_at(w, i);
        if (r->base.phase == GR_FREE || r->base.phase == GR_QUARANTINE)
            continue;
        hb->running++;
        if (r->base.phase == GR_PREFILL) {
            hb->queued++;
            hb->queued_tokens += (uint64_t)(r->base.n_prompt - r->base.prefilled);
        }
    }
    hb->decode_steps = g.decode_steps;
    hb->decode_seq_steps = g.decode_seq_steps;
    hb->decoded_tokens = g.decoded_tokens;
    hb->step_seconds = g.step_seconds;
    hb->suspensions = g.suspensions;
    hb->resumes = g.resumes;
    hb->cache_budget_bytes = g.plan.budget_bytes;
    hb->cache_target_pages = (uint64_t)g.plan.target.pages;
    hb->cache_target_bytes = g.plan.target.bytes;
    hb->cache_draft_pages = (uint64_t)g.plan.draft.pages;
    hb->cache_draft_bytes = g.plan.draft.bytes;
    if (g.spec != NULL) { /* positions up to spec.k; the heartbeat is packed before they change */
        hb->n_spec_step_tokens = (size_t)g.so.k + 1;
        hb->spec_step_tokens = g.spec_step_tokens;
        hb->n_spec_drafted = hb->n_spec_accepted = (size_t)g.so.k;
        hb->spec_drafted = g.spec_drafted;
        hb->spec_accepted = g.spec_accepted;
    }
    if (g.pc != NULL)
        duet_prefix_cache_heartbeat(g.pc, hb);
}

/* End quarantines and overdue requests. */
static void gen_tick(duet_worker_t *w)
{
    double now = duet_worker_now();
    uint64_t wall = duet_xfer_now_unix_ms();
    for (int64_t i = 0; i < w->n_reqs; i++) {
        gr_t *r = gr_at(w, i);
        if (r->base.phase == GR_QUARANTINE && now >= r->release_at) {
            gr_free(w, &r->base);
            continue;
        }
        if (r->base.phase == GR_FREE || r->base.phase == GR_QUARANTINE)
            continue;
        if (r->base.phase == GR_MOVING && r->put_at > 0 && now >= r->put_at)
            gr_move_put(w, r);
        if (r->base.phase == GR_MOVING && r->cancelling)
            continue; /* ending: its outcome frees it */
        if (r->base.phase == GR_MOVING && duet_worker_req_overdue(&r->base, wall)) {
            DUET_RLOG_WARN(r->base.rid, "deadline passed while moving: ending the request");
            duet_worker_send_tokens(w->link, r->base.rid, NULL, 0,
                                    DUET__TOKENS__FINISH_REASON__ERROR,
                                    "the request's deadline passed");
            r->cancelling = true;
            (void)duet_xfer_send_cancel(w->x, r->base.xid, "the request's deadline passed");
            continue;
        }
        if (duet_worker_req_overdue(&r->base, wall) &&
            r->base.phase != GR_RECEIVING) { /* a reservation's deadline is the transfer layer's */
            DUET_RLOG_WARN(r->base.rid, "deadline passed: ending the request");
            duet_worker_send_tokens(w->link, r->base.rid, NULL, 0,
                                    DUET__TOKENS__FINISH_REASON__ERROR,
                                    "the request's deadline passed");
            gr_free(w, &r->base);
        }
    }
    duet_worker_update(w); /* pages freed here may let a suspended request resume */
}

/* ------------------------------------------------------------------------------ the role */

/*
 * The cache plan (engine/cache_plan.h) from the model configs, before anything loads: the target's
 * KV pages go into mo, the draft model's into g.so (duet_spec_create loads it with them).
 */
static duet_status_t gen_cache_plan(duet_worker_t *w, duet_model_opts_t *mo)
{
    duet_model_config_t tc, dc;
    const char *dir = duet_config_get_string(w->cfg, "model.dir");
    duet_status_t st = duet_model_config_load(dir, &tc);
    if (st == DUET_OK && g.so.method == DUET_SPEC_DRAFT &&
        (st = duet_model_config_load(g.so.draft_model, &dc)) != DUET_OK) {
        char why[400];
        snprintf(why, sizeof(why), "%s", duet_error_last());
        st = duet_error_set(st, "spec.draft_model %s: %s", g.so.draft_model, why);
    }
    /* an unreadable config.json: the model's load reports it (exit 1, as it always did);
     * only --print-cache-plan, which loads nothing, fails here */
    if (st != DUET_OK)
        return duet_config_get_bool(w->cfg, "print_cache_plan") ? st : DUET_OK;
    duet_cache_plan_in_t in;
    duet_cache_plan_inputs(
        &tc, mo, g.so.method == DUET_SPEC_DRAFT ? &dc : NULL, &g.so,
        duet_cache_plan_gib_bytes(duet_config_get_float(w->cfg, "cache.budget_gib")),
        duet_cache_plan_gib_bytes(duet_config_get_float(w->cfg, "cache.draft_kv_budget_gib")), &in);
    if ((st = duet_cache_plan_compute(&in, &g.plan)) != DUET_OK)
        return st;
    const duet_cache_plan_t *p = &g.plan;
    if (p->target.pages > 0)
        mo->kv_pages = p->target.pages;
    g.so.draft_kv_pages = p->draft.pages;
    DUET_LOG_INFO("cache plan: budget %.3f GiB (%s), KDA state + replay %.3f GiB; target KV %lld "
                  "pages of %lld tokens (%.3f GiB, %llu bytes per token); draft KV %lld pages of "
                  "%lld tokens (%.3f GiB, floor %lld pages%s%s)",
                  (double)p->budget_bytes / 1073741824.0,
                  p->budget_implied ? "from cache.kv_pages" : "cache.budget_gib",
                  (double)p->fixed_bytes / 1073741824.0, (long long)p->target.pages,
                  (long long)p->target.page_tokens, (double)p->target.bytes / 1073741824.0,
                  (unsigned long long)p->target.token_bytes, (long long)p->draft.pages,
                  (long long)p->draft.page_tokens, (double)p->draft.bytes / 1073741824.0,
                  (long long)p->draft.min_pages, p->cap_bound ? ", capped" : "",
                  p->floor_bound ? ", at its floor" : "");
    return DUET_OK;
}

/* The spec.* keys (checked together, naming the key) and the target's verify rows. */
/*
 * helix.cp x helix.tp > 1: this process is one rank of a generation group started by mpirun /
 * srun as that many ranks (worker/group.h); the model loads the rank's cut. What a group does
 * not do yet is refused here, saying so.
 */
static duet_status_t gen_group(duet_worker_t *w, duet_model_opts_t *mo)
{
    const int cp = (int)duet_config_get_int(w->cfg, "helix.cp");
    const int tp = (int)duet_config_get_int(w->cfg, "helix.tp");
    if (cp * tp == 1)
        return DUET_OK;
    if (g.so.method != DUET_SPEC_NONE)
        return duet_error_set(DUET_ERR_UNSUPPORTED,
                              "helix.cp x helix.tp = %d: speculative "
                              "decoding in a generation group is not built "
                              "(set spec.method none)",
                              cp * tp);
    if (cp * tp > DUET_SHARD_MAX_RANKS)
        return duet_error_set(DUET_ERR_RANGE, "helix.cp x helix.tp = %d: at most %d ranks", cp * tp,
                              DUET_SHARD_MAX_RANKS);
    int rank = 0, size = 1;
    duet_status_t st = duet_group_mpi_init(NULL, NULL, &rank, &size);
    if (st != DUET_OK)
        return st;
    if (size != cp * tp)
        return duet_error_set(DUET_ERR_INVALID,
                              "helix.cp %d x helix.tp %d = %d ranks, but this job has %d: start "
                              "it with mpirun -n %d (or srun -n %d)",
                              cp, tp, cp * tp, size, cp * tp, cp * tp);
    duet_comm_t *comm = NULL;
    if ((st = duet_comm_mpi_create(duet_config_get_int(w->cfg, "helix.timeout_ms"), &comm)) !=
            DUET_OK ||
        (st = duet_group_create(comm, cp, tp, &w->group)) != DUET_OK) {
        duet_comm_destroy(comm);
        return st;
    }
    mo->comm = comm;
    mo->helix_cp = cp;
    mo->helix_tp = tp;
    /* a group computes on the cpu backend only: `auto` means that one even beside a GPU (an
     * explicit `cuda` is refused by the model, saying why) */
    if (strcmp(duet_config_get_enum(w->cfg, "device"), "auto") == 0 &&
        mo->device != DUET_DEVICE_CPU) {
        mo->device = DUET_DEVICE_CPU;
        if (rank == 0)
            DUET_LOG_WARN("device auto: a generation group computes on the cpu backend (no "
                          "sharded forward on cuda yet), so the group runs on the CPU");
    }
    if (rank != 0) /* a follower's log lines say which rank they come from */
        snprintf(w->name, sizeof(w->name), "rank %d", rank);
    DUET_LOG_INFO("generation group: rank %d of cp %d x tp %d", rank, cp, tp);
    return DUET_OK;
}

static duet_status_t gen_configure(duet_worker_t *w, duet_model_opts_t *mo)
{
    duet_status_t st = duet_spec_opts_from_config(w->cfg, &g.so);
    if (st != DUET_OK)
        return st;
    if ((st = gen_group(w, mo)) != DUET_OK)
        return st;
    /* on a backend without verify rows the model's load refuses this, saying why */
    mo->spec_rows = duet_spec_target_rows(&g.so);
    mo->tune = duet_config_get_bool(w->cfg, "tune");
    mo->tune_file = duet_config_get_string(w->cfg, "tune_file");
    if ((st = gen_cache_plan(w, mo)) != DUET_OK)
        return st;
    if (duet_config_get_bool(w->cfg, "print_cache_plan")) {
        duet_strbuf_t sb;
        duet_strbuf_init(&sb);
        if ((st = duet_cache_plan_json(&g.plan, &sb)) == DUET_OK) {
            printf("%s\n", sb.data);
            w->exit_now = true;
        }
        duet_strbuf_free(&sb);
    }
    return st;
}

static duet_status_t gen_init(duet_worker_t *w)
{
    g.quarantine_ms = (uint32_t)duet_config_get_int(w->cfg, "cache.quarantine_ms");
    g.slack = duet_config_get_int(w->cfg, "cache.slack_tokens");
    g.checksum = duet_config_get_bool(w->cfg, "transfer.checksum");
    g.move_hold_ms = (uint32_t)duet_config_get_int(w->cfg, "test.move_hold_ms");
    g.grow = duet_config_get_bool(w->cfg, "cache.suspend") && duet_model_kv_pool(w->m) != NULL;
    if (g.grow && w->group != NULL) {
        DUET_LOG_INFO("cache.suspend: off in a generation group (suspending a sharded sequence "
                      "is not built); requests reserve their pages up front");
        g.grow = false;
    }
    duet_status_t st = duet_prefix_cache_from_config(w->cfg, w->m, w->chunk, &g.pc);
    if (st != DUET_OK || g.so.method == DUET_SPEC_NONE)
        return st;
    st = duet_spec_create(&g.so, w->m, &g.spec);
    if (st != DUET_OK) {
        char why[512];
        snprintf(why, sizeof(why), "%s", duet_error_last());
        if (g.so.method == DUET_SPEC_DRAFT)
            return duet_error_set(st, "spec.draft_model %s: %s", g.so.draft_model, why);
        return duet_error_set(st, "spec.method %s: %s", duet_spec_method_name(g.so.method), why);
    }
    /* A verify item writes k + 1 rows from the sequence's end. The drafts are capped so that the
     * kept ones and the target's token stay within max_tokens, which keeps those rows inside
     * prompt + max_tokens already; the slack keeps them inside the request's pages whatever the
     * cap (engine/spec.h asks k more tokens per sequence). cache.slack_tokens is that slack, so a
     * smaller value is raised to k rather than added to. */
    if (g.slack < g.so.k)
        g.slack = g.so.k;
    const size_t rows = (size_t)w->n_reqs * (size_t)(g.so.k + 1);
    g.logits = malloc(sizeof(float) * rows * (size_t)w->V);
    g.ss = calloc((size_t)w->n_reqs, sizeof(*g.ss));
    g.k_cap = calloc((size_t)w->n_reqs, sizeof(*g.k_cap));
    if (g.logits == NULL || g.ss == NULL || g.k_cap == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "out of memory for the verify logits (%zu rows)",
                              rows);
    DUET_LOG_INFO("speculative decoding: %s, up to %d drafts per step, %lld tokens of slack per "
                  "request",
                  duet_spec_method_name(g.so.method), g.so.k, (long long)g.slack);
    return DUET_OK;
}

static void gen_fini(duet_worker_t *w)
{
    (void)w;
    duet_prefix_cache_destroy(g.pc); /* its page holds go back to the pool, still there */
    g.pc = NULL;
    duet_spec_destroy(g.spec);
    g.spec = NULL;
    free(g.logits);
    free(g.ss);
    free(g.k_cap);
    g.logits = NULL;
    g.ss = NULL;
    g.k_cap = NULL;
}

static const duet_worker_ops_t gen_ops = {
    .prog = "duet-gen",
    .usage = "duet-gen --router HOST:PORT --model DIR [options]\n\n"
             "The generation worker: reserves cache pages for requests, receives their "
             "prefilled caches from context workers over UCX (or prefills short prompts "
             "itself), and decodes them in a continuous batch.",
    .keys = gen_keys,
    .n_keys = sizeof(gen_keys) / sizeof(gen_keys[0]),
    .role = DUET__WORKER_ROLE__WORKER_ROLE_GEN,
    .receives = true,
    /* outcomes touch only RECEIVING requests, never one in the running step */
    .defer_outcomes = false,
    .drain_log = "draining: no new requests; running ones finish",
    .undrain_log = "undrained: taking requests again",
    .stop_reason = "the generation worker is stopping",
    .req_size = sizeof(gr_t),
    .configure = gen_configure,
    .init = gen_init,
    .fini = gen_fini,
    .on_message = gen_on_message,
    .on_xfer = gen_on_xfer,
    .plan_step = gen_plan_step,
    .step_done = gen_step_done,
    .tick = gen_tick,
    .heartbeat = gen_heartbeat,
    .has_work = gen_has_work,
    .release = gr_free,
};

int main(int argc, char **argv)
{
    const int rc = duet_worker_main(&gen_ops, argc, argv);
    duet_group_mpi_finalize(); /* nothing when this was no group */
    return rc;
}
