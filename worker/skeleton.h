/*
 * The one main of duet-ctx and duet-gen (docs/architecture.md, "worker/"): start-up (flags,
 * config, UCX, the model and its pools, registration with the router), the libuv loop (router
 * messages, heartbeats, the step, UCX progress, transfer outcomes) and shutdown. A role plugs its
 * request state machine in through a table of callbacks (duet_worker_ops_t), so that
 * ctx_worker/ctx_main.c and gen_worker/gen_main.c hold only what their role does with a request.
 *
 * The skeleton also keeps the request table: every request starts with a duet_worker_req_t (the
 * fields both roles have), so finding a request, taking a free slot, ordering prompts by arrival
 * and cutting prefill chunks are written once here.
 */
#ifndef DUET_WORKER_SKELETON_H
#define DUET_WORKER_SKELETON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "worker/group.h"
#include "worker/worker.h"

typedef struct duet_worker duet_worker_t;

/*
 * What every request of either role has. A role's request struct starts with one (`base`); the
 * skeleton's table holds n_reqs of them, ops->req_size bytes apart, zeroed when free.
 */
typedef struct {
    uint64_t rid;
    int phase;       /* the role's state; 0 = a free slot */
    duet_seq_t seq;  /* id -1 while no sequence is open */
    int32_t *prompt; /* (n_prompt) owned, while the prompt is still to prefill */
    int64_t n_prompt, prefilled;
    uint32_t max_tokens;
    duet_worker_sampling_t sampling;
    duet_xfer_id_t xid;
    bool xfer_live;            /* a transfer was started and has not reported yet */
    int32_t drawn;             /* the token the last step drew for it (DUET_LOGITS_TOKEN) */
    uint64_t arrival;          /* arrival order, for oldest-first */
    uint64_t deadline_unix_ms; /* 0 = none */
} duet_worker_req_t;

/*
 * A role: its flags and config keys, and the callbacks through which the skeleton hands it
 * events. Every callback runs on the loop thread; `w` is the skeleton. Required unless marked
 * optional.
 */
typedef struct {
    const char *prog;              /* "duet-ctx": prefix of start-up errors, --version */
    const char *usage;             /* first lines of --help */
    const duet_config_key_t *keys; /* DUET_WORKER_CONFIG_KEYS + the role's own */
    size_t n_keys;
    Duet__WorkerRole role;
    /* Receives caches (duet-gen): its host pools are allocated by UCX so that puts land in them
     * directly (with UCX 1.13 puts into malloc'ed memory over shared memory are emulated and
     * much slower), and an aborted transfer is not told back to the sender: the router cancels
     * the context worker itself. Otherwise the pools are the model's, registered with UCX. */
    bool receives;
    /* Transfer outcomes that arrive during a step (UCX progresses in the layer hook) wait for
     * the step's end, because the role's handler frees sequences the step may still use. */
    bool defer_outcomes;
    const char *drain_log, *undrain_log; /* logged on Drain / Undrain */
    const char *stop_reason;             /* the Deregister's reason */
    size_t req_size;                     /* sizeof the role's request (starts with a base) */

    /* Optional: after the keys were read, before UCX starts and the model loads: check the
     * role's keys together and adjust the engine options the model is loaded with (mo, from the
     * shared keys). An error fails the start like a bad command line (exit 2, its message on
     * stderr). */
    duet_status_t (*configure)(duet_worker_t *w, duet_model_opts_t *mo);
    /* After the model loaded, before the tables are made: read the role's keys, make what the
     * role needs beside the model; may raise w->n_reqs (default batch.max_seqs). An error fails
     * the start (exit 1, its message on stderr); fini still runs. */
    duet_status_t (*init)(duet_worker_t *w);
    /* Optional: at the end (also after a failed start), once every request is released and
     * before the model is freed: free what init made (it may have made only part of it). */
    void (*fini)(duet_worker_t *w);
    /* A message from the router other than Drain / Undrain; false: not one this role takes. */
    bool (*on_message)(duet_worker_t *w, const Duet__Envelope *env);
    /* The outcome of request r's transfer (r->xfer_live still set). */
    void (*on_xfer)(duet_worker_t *w, duet_worker_req_t *r, const duet_xfer_outcome_t *o);
    /* Optional: inside a step, MLA layer `mla` is final for every item (the model's layer hook). */
    void (*on_layer)(duet_worker_t *w, int64_t mla);
    /* Fill w->items / w->item_req for the next step; returns how many (0: nothing to run). */
    int64_t (*plan_step)(duet_worker_t *w);
    /* After the step of n items ran (st: its status, seconds: its duration). */
    void (*step_done)(duet_worker_t *w, int64_t n, duet_status_t st, double seconds);
    /* Every heartbeat period, before the heartbeat: deadlines and timers. */
    void (*tick)(duet_worker_t *w);
    /* The role's Heartbeat fields (running, queued, queued_tokens, work counters); the skeleton
     * sets free_pages, draining and prefill_tokens. No side effects: it runs mid-step too. */
    void (*heartbeat)(duet_worker_t *w, Duet__Heartbeat *hb);
    /* Optional: start waiting requests where there is room (never while stopping). */
    void (*admit)(duet_worker_t *w);
    /* Whether a step has anything to run. */
    bool (*has_work)(duet_worker_t *w);
    /* Optional, after the loop ended: let the requests go as the transfers allow (NULL: release
     * every request at once). What is left is released after the transfer context is gone. */
    void (*shutdown)(duet_worker_t *w);
    /* Free request r (its sequence, prompt and the role's own resources) and zero its slot. */
    void (*release)(duet_worker_t *w, duet_worker_req_t *r);
} duet_worker_ops_t;

/* A transfer outcome kept for the step's end (ops->defer_outcomes). */
typedef struct {
    duet_xfer_outcome_t o;
    char msg[256];
} duet_worker_deferred_t;

/*
 * The skeleton's state: the role reads it, and writes only its requests and, in plan_step, the
 * step's items.
 */
struct duet_worker {
    const duet_worker_ops_t *ops;
    duet_config_t *cfg;
    duet_model_t *m;
    duet_xfer_ctx_t *x;
    duet_xfer_layout_t layout; /* of this worker's pools */
    /* A Helix group (worker/group.h; set by the role's configure): this process is its rank 0
     * when it runs the loop; every sequence change and step then goes through the group */
    duet_group_t *group;
    duet_worker_pump_t pump;
    duet_link_t *link; /* the router; NULL once closed */
    int64_t V;         /* vocabulary size */
    int64_t chunk;     /* batch.prefill_chunk */
    int64_t budget;    /* batch.max_tokens */
    int64_t max_seqs;
    bool draining, stopping;
    bool exit_now; /* set by ops->configure: the role did what the command line asked (e.g.
                      printed something) and the process exits 0 without loading the model */
    bool in_step;  /* inside duet_model_forward */
    uint64_t arrivals;
    uint64_t prefill_tokens; /* prompt tokens prefilled (Heartbeat) */
    int64_t step_prefill;    /* of the step being planned or run */

    void *reqs; /* owned, [n_reqs] of ops->req_size bytes */
    int64_t n_reqs;
    duet_batch_item_t *items;         /* owned, [max_seqs]: the step's items */
    duet_worker_req_t **item_req;     /* owned, [max_seqs]: each item's request */
    duet_worker_req_t **order;        /* owned, [n_reqs]: scratch for the step */
    duet_worker_deferred_t *deferred; /* owned, [n_reqs]: one outcome per transfer at most */
    int64_t n_deferred;
    duet_sampler_t *smp;        /* owned: the host path's sampler (duet_worker_host_draw) */
    float *scratch;             /* owned, [V]: its processed row */
    struct duet_tokenizer *tok; /* owned: the model folder's, for response_format (or NULL) */
    duet_json_vocab_t *jv;      /* owned: its vocabulary trie (or NULL) */

    /* the loop */
    uv_loop_t *loop;
    uv_idle_t idle;
    uv_timer_t hb;
    uv_signal_t sigint, sigterm;
    bool idle_on;
    char name[64];
    double hb_period_s, last_hb; /* seconds (duet_worker_now) */
    /* SIGTERM with shutdown.drain_s: finishing what is here (heartbeats say draining, so the
     * router places nothing new) until it is done or the deadline; then the usual stop */
    bool leaving;
    double drain_s, leave_deadline, idle_since; /* duet_worker_now; idle_since 0 while busy */
    /* observability: the registry of this worker's /metrics (NULL when metrics.port is -1; the
     * transfer layer's duet_xfer_* go there too) and its listener; time in steps; start time */
    duet_metrics_t *metrics;
    struct duet_worker_metrics *wmetrics;
    double busy_seconds;
    uint64_t started_unix_ms;
};

/*
 * A heartbeat's worth of the worker's state into hb (from DUET__HEARTBEAT__INIT): its pools'
 * free pages and slots, draining, prefill tokens, busy seconds and the role's fields; *kv_pages_p
 * (may be NULL) receives the pool's pages as Register reported them. No side effects: the
 * heartbeat and the worker's /metrics (worker/metrics.h) both read it.
 */
void duet_worker_fill_heartbeat(duet_worker_t *w, Duet__Heartbeat *hb, uint32_t *kv_pages_p);

/* Run a worker of this role: returns the process's exit status (0, 1 on a failed start, 2 for a
 * bad command line). */
int duet_worker_main(const duet_worker_ops_t *ops, int argc, char **argv);

/* Request slot i of the table. */
static inline duet_worker_req_t *duet_worker_req(const duet_worker_t *w, int64_t i)
{
    return (duet_worker_req_t *)((char *)w->reqs + (size_t)i * w->ops->req_size);
}

/* The live request with this id, or NULL. */
duet_worker_req_t *duet_worker_find(const duet_worker_t *w, uint64_t rid);

/* A free slot, or NULL when the table is full. */
duet_worker_req_t *duet_worker_free_slot(const duet_worker_t *w);

/* Fill a new request's common fields (phase and the role's fields stay the caller's). */
void duet_worker_req_init(duet_worker_t *w, duet_worker_req_t *r, uint64_t rid, int64_t n_prompt,
                          uint32_t max_tokens, const Duet__Sampling *s, uint64_t deadline_unix_ms);

/* Copy n prompt ids into r->prompt; false when out of memory (r->prompt stays NULL). */
bool duet_worker_req_set_prompt(duet_worker_req_t *r, const uint32_t *ids, size_t n);

/*
 * After duet_worker_req_init: r's sampling state for its prompt (and, moved in, the ids it
 * generated before): duet_worker_sampling_setup with this worker's vocabulary and chunk. false
 * with `why` (out of memory; prompt ids missing when a penalty needs them): the caller refuses.
 */
bool duet_worker_req_setup(duet_worker_t *w, duet_worker_req_t *r, const uint32_t *prompt,
                           size_t n_prompt, const uint32_t *generated, size_t n_generated,
                           const char **why);

/*
 * Make `it` (r's row whose logits give r's next token) draw that token into r->drawn with r's
 * rule and its next RNG draw: inside the step (DUET_LOGITS_TOKEN), or for a request on the host
 * path (processing, logprobs) as the logits of its last row, drawn after the step by the
 * skeleton before ops->step_done sees r->drawn. it->seq, tokens and n_tokens are the caller's.
 */
void duet_worker_item_draw(duet_worker_t *w, duet_worker_req_t *r, duet_batch_item_t *it);

/* Close r's sequence, free its prompt and zero the whole slot (the role freed its own parts). */
void duet_worker_req_clear(duet_worker_t *w, duet_worker_req_t *r);

/* The model's sequence calls as the worker makes them: on rank 0 of a group the followers make
 * them too (worker/group.h), alone they are the model's own. A failure that broke the group ends
 * the worker (duet_worker_group_failed). */
duet_status_t duet_worker_seq_open(duet_worker_t *w, int64_t max_tokens, duet_seq_t *seq);
void duet_worker_seq_close(duet_worker_t *w, duet_seq_t *seq);
/* The sequence's first n_tokens arrived (a cache transfer); a group's followers wait for theirs
 * until deadline_unix_ms (0: the group's bound). */
duet_status_t duet_worker_seq_filled(duet_worker_t *w, duet_seq_t *seq, int64_t n_tokens,
                                     uint64_t deadline_unix_ms);

/*
 * The group broke (a rank died or stopped answering): every request ends with Tokens(ERROR, why)
 * once, the worker deregisters and stops; the process then aborts the job so that no rank is
 * left behind. Does nothing when the group is healthy or there is none.
 */
void duet_worker_group_failed(duet_worker_t *w);

/* Whether every id is inside the vocabulary. */
bool duet_worker_in_vocab(const duet_worker_t *w, const uint32_t *ids, size_t n);

/* Whether r's deadline has passed at wall-clock `wall_ms`. */
bool duet_worker_req_overdue(const duet_worker_req_t *r, uint64_t wall_ms);

/*
 * Add the prompts' next chunks to the step, oldest first (pre[0..n_pre) is sorted here): items
 * from index n on, within *budget_p tokens, whole chunks only (a chunk that does not fit waits for
 * a later step: the cut must be duet-generate's). A prompt's last chunk draws its next token
 * inside the step into r->drawn, with the request's rule and its next RNG draw. Returns the new
 * item count.
 */
int64_t duet_worker_add_prefill(duet_worker_t *w, duet_worker_req_t **pre, int64_t n_pre, int64_t n,
                                int64_t *budget_p);

/* The outcome callback to give the transfer layer (user = w): finds the request and calls
 * ops->on_xfer, at once or at the step's end (ops->defer_outcomes). */
void duet_worker_xfer_cb(const duet_xfer_outcome_t *o, void *user);

/* After a change: admit waiting requests (ops->admit) and run the step while there is work. */
void duet_worker_update(duet_worker_t *w);

#endif
