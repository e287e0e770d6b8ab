/*
 * The parts duet-ctx and duet-gen are built from (docs/architecture.md, "worker/"): the config
 * keys every worker has, the cache layout both sides of a transfer describe, UCX progress driven
 * by the worker's libuv loop, per-request sampling and the prefill cut, and Tokens / Refused
 * messages to the router. worker/skeleton.h assembles them into the workers' one main.
 */
#ifndef DUET_WORKER_WORKER_H
#define DUET_WORKER_WORKER_H

#include <stdbool.h>
#include <stdint.h>

#include <uv.h>

#include "common/config.h"
#include "common/log.h"
#include "grammar/json_grammar.h"
#include "grammar/json_schema.h"
#include "engine/model.h"
#include "engine/sampler.h"
#include "transfer/xfer.h"
#include "worker/link.h"

/* Keys of both workers (each binary adds its own: batch.max_seqs and batch.max_tokens, with its
 * own defaults). */
#define DUET_WORKER_CONFIG_KEYS                                                                    \
    {"router", DUET_CONFIG_STRING, "127.0.0.1:8100", "the router's worker port, HOST:PORT",        \
     .min = NULL},                                                                                 \
        {"model.dir",      DUET_CONFIG_STRING, NULL, "model folder (config.json + safetensors)",   \
         .required = true, .alias = "model"},                                                      \
        {"name", DUET_CONFIG_STRING, "", "worker name shown by duetctl (default: role-pid)",       \
         .min = NULL},                                                                             \
        {"threads",  DUET_CONFIG_INT, "0", "compute threads (0 = all online CPUs)",                \
         .min = "0", .max = "1024"},                                                               \
        {"device", DUET_CONFIG_ENUM, "auto",                                                       \
         "where the model runs: auto (cuda when a GPU is "                                         \
         "visible), cpu or cuda",                                                                  \
         .choices = duet_worker_devices},                                                          \
        {"dtype", DUET_CONFIG_ENUM, "auto", DUET_MODEL_DTYPE_HELP, .choices = duet_worker_dtypes}, \
        {"heartbeat_ms", DUET_CONFIG_INT, "250", "heartbeat period", .min = "10", .max = "60000"}, \
        {"metrics.port",                                                                           \
         DUET_CONFIG_INT,                                                                          \
         "-1",                                                                                     \
         "serve GET /metrics (Prometheus) on this port: -1 = off, 0 = an ephemeral port (the "     \
         "router lists it at /metrics/targets)",                                                   \
         .min = "-1",                                                                              \
         .max = "65535"},                                                                          \
        {"metrics.host", DUET_CONFIG_STRING, "127.0.0.1",                                          \
         "the /metrics listener's bind address (\"0.0.0.0\": reachable from other hosts)",         \
         .min = NULL},                                                                             \
        {"shutdown.drain_s",                                                                       \
         DUET_CONFIG_INT,                                                                          \
         "0",                                                                                      \
         "on SIGTERM take no new work and finish what is here for up to S s, then stop (0 = stop " \
         "at once; SIGINT always stops at once)",                                                  \
         .min = "0",                                                                               \
         .max = "86400"},                                                                          \
        {"router_connect_timeout_ms",                                                              \
         DUET_CONFIG_INT,                                                                          \
         "60000",                                                                                  \
         "keep trying to reach the router this long at start",                                     \
         .min = "0",                                                                               \
         .max = "3600000"},                                                                        \
        {"cache.page_tokens",      DUET_CONFIG_INT, "128",                                         \
         "tokens per MLA KV page", .min = "1",      .max = "65536"},                               \
        {"cache.max_seq_len",                                                                      \
         DUET_CONFIG_INT,                                                                          \
         "4096",                                                                                   \
         "tokens one request may hold (prompt + output)",                                          \
         .min = "1",                                                                               \
         .max = "16777216"},                                                                       \
        {"cache.kv_pages",                                                                         \
         DUET_CONFIG_INT,                                                                          \
         "0",                                                                                      \
         "KV pages in the pool (0 = batch.max_seqs * max_seq_len / page_tokens)",                  \
         .min = "0",                                                                               \
         .max = "100000000"},                                                                      \
        {"batch.prefill_chunk",                                                                    \
         DUET_CONFIG_INT,                                                                          \
         "512",                                                                                    \
         "prompt tokens of one request per step (chunks start at multiples of it, as in "          \
         "duet-generate --prefill-chunk)",                                                         \
         .min = "1",                                                                               \
         .max = "1048576"},                                                                        \
        {"ucx.tls", DUET_CONFIG_STRING, "",                                                        \
         "UCX transports for KV transfers (sets UCX_TLS, e.g. tcp or rc,sm,self; empty = the "     \
         "environment's UCX_TLS or UCX's own choice)",                                             \
         .min = NULL},                                                                             \
        {"ucx.net_devices", DUET_CONFIG_STRING, "",                                                \
         "network devices UCX may use (sets UCX_NET_DEVICES, e.g. eth1 or mlx5_0:1; empty = the "  \
         "environment's UCX_NET_DEVICES or all)",                                                  \
         .min = NULL},                                                                             \
        {"transfer.checksum", DUET_CONFIG_BOOL, "false",                                           \
         "send an XXH3-64 of the bytes of each transfer this worker sends (a context worker's "    \
         "prefill, a generation worker's moved request); the receiver verifies it. Host pools "    \
         "only: not with transfer.device_pools moving the GPU's pools",                            \
         .min = NULL},                                                                             \
        {"transfer.device_pools", DUET_CONFIG_ENUM, "off",                                         \
         "cuda: off = KV and state go through pinned host pools; auto = UCX reads and writes "     \
         "the "                                                                                    \
         "GPU's pools directly when it has CUDA transports (experimental: with UCX 1.13.1 "        \
         "slower "                                                                                 \
         "than staging, see bench/RESULTS.md)",                                                    \
         .choices = duet_worker_device_pools_modes},                                               \
        DUET_LOG_CONFIG_KEYS

extern const char *const duet_worker_devices[];            /* "auto", "cpu", "cuda" */
extern const char *const duet_worker_dtypes[];             /* "auto", "f32", "bf16" */
extern const char *const duet_worker_device_pools_modes[]; /* "off", "auto" */

/* Model options from the keys above (+ batch.max_seqs); pool_alloc left NULL. DUET_ERR_UNSUPPORTED
 * naming the device when the engine takes no backend of that name (never a silent fallback to
 * another device). */
duet_status_t duet_worker_model_opts(const duet_config_t *cfg, duet_model_opts_t *opts);

/*
 * Check ucx.tls and ucx.net_devices and put them into the environment as UCX_TLS and
 * UCX_NET_DEVICES, before UCX is initialised (duet_xfer_ctx_create reads its configuration
 * there). A value is a comma-separated list of names of [A-Za-z0-9_.:-], optionally led by '^'
 * (UCX's "all but"); anything else is DUET_ERR_INVALID naming the key, the environment untouched.
 * A set key wins over the variable the process inherited; a different inherited value is logged
 * as a warning. An empty key leaves the variable as it is. Each variable's effective value (or
 * "unset") is logged at info.
 */
duet_status_t duet_worker_ucx_env(const duet_config_t *cfg);

/*
 * Whether this worker's transfers move its model's device pools directly (decided before the
 * model loads): the model runs on CUDA, transfer.device_pools is auto (default off) and x's UCX
 * can move device memory (duet_xfer_ctx_mem_supported). Otherwise the pools are staged through
 * the host pools (model opts mirror_in / mirror_out).
 */
bool duet_worker_device_pools(const duet_config_t *cfg, const duet_model_opts_t *mo,
                              duet_xfer_ctx_t *x);
/* Register a loaded model's pools with x: the device pools (device == true; the host pools' byte
 * ranges, whose page and slot offsets they share) or the host pools, and the KDA replay pool when
 * the model has one (host memory; a device model has none: its backend has no verify rows, and
 * DUET_ERR_UNSUPPORTED should one have it). */
duet_status_t duet_worker_register_pools(duet_xfer_ctx_t *x, duet_model_t *m, bool device);

/* The transfer pool that holds model pool `which` (KV, KDA, replay). */
duet_xfer_pool_t duet_worker_xfer_pool(duet_model_pool_t which);

/* A duet_model_pool_alloc_fn for a worker whose pools receive: `xfer_ctx` is its
 * duet_xfer_ctx_t, and every pool the model asks for (KV, KDA, the replay pool with spec_rows)
 * comes from duet_xfer_ctx_alloc, registered as it is allocated, so that puts land in it directly
 * (a context worker's, or another generation worker's moving a running request). NULL (logged)
 * when UCX gives none. */
void *duet_worker_pool_alloc(void *xfer_ctx, duet_model_pool_t which, size_t bytes);

/* The transfer layout of a loaded model's pools (fp32 KV and state on the CPU path; replay_rows
 * from its replay pool, 0 without one). */
void duet_worker_layout(duet_model_t *m, duet_xfer_layout_t *l);

/*
 * UCX progress on a libuv loop: progress before every sleep, on fd events and at deadlines.
 * frozen_ms > 0: when more than that passed since the last progress (the process was stopped or
 * starved that long), on_frozen runs first, before UCX is touched again (progress checks it;
 * duet_worker_pump_check_frozen for the callers that put).
 */
typedef struct {
    duet_xfer_ctx_t *x;
    uv_poll_t poll;
    uv_prepare_t prep;
    uv_timer_t timer;
    int open_handles;
    uint64_t last_ms; /* monotonic: the last progress */
    uint32_t frozen_ms;
    void (*on_frozen)(void *user, uint64_t gap_ms);
    void *frozen_user;
} duet_worker_pump_t;

duet_status_t duet_worker_pump_start(uv_loop_t *loop, duet_xfer_ctx_t *x, duet_worker_pump_t *p);
/* Progress UCX until it has nothing left to do now (layer hooks call it inside long steps). */
void duet_worker_pump_progress(duet_worker_pump_t *p);
/* on_frozen when more than frozen_ms passed since the last progress: before anything that may
 * start a UCX operation (a put) outside progress. */
void duet_worker_pump_check_frozen(duet_worker_pump_t *p);
/* Close the handles (run the loop afterwards to finish closing). */
void duet_worker_pump_stop(duet_worker_pump_t *p);

/* Stop ids kept per request; the router sends at most DUET_OAI_MAX_EOS (8). */
#define DUET_WORKER_MAX_STOP 16

/* logit_bias entries kept per request; the router accepts at most this many (OpenAI's 300). */
#define DUET_WORKER_MAX_BIAS 300

/* One position's log-probabilities (Duet__TokenLogprob's content). */
typedef struct {
    float logprob;
    int n_top;
    int32_t top_ids[DUET_MAX_TOP_LOGPROBS];
    float top_lps[DUET_MAX_TOP_LOGPROBS];
} duet_worker_logprob_t;

/*
 * How one request samples: parameters, its own RNG stream, the ids that end it, its logit
 * processing and log-probabilities (docs/architecture.md, "Sampling").
 */
typedef struct {
    duet_sampling_t sp;
    duet_rng_t rng;
    uint32_t stop[DUET_WORKER_MAX_STOP];
    size_t n_stop;
    duet_logit_proc_t proc; /* proc.bias -> bias, proc.stop_ids -> stop */
    duet_logit_bias_t bias[DUET_WORKER_MAX_BIAS];
    duet_token_hist_t hist; /* with a penalty: the prompt's and the generated ids (owned) */
    int64_t n_generated;    /* ids drawn so far (min_tokens) */
    bool logprobs, prompt_logprobs;
    int n_top;
    /* processing or logprobs: the step computes the logits row and the host draws from it
     * (duet_worker_host_draw) instead of the backend; with processing, no speculation */
    bool host;
    float *rows; /* owned, rows_cap rows of the vocabulary: the host path's logits */
    int64_t rows_cap;
    duet_worker_logprob_t drawn_lp;   /* logprobs: the newest drawn id's */
    duet_worker_logprob_t *prompt_lp; /* owned, prompt_logprobs: [n_prompt - 1] */
    int64_t n_prompt_lp;
    /* response_format (Sampling.response_format): the output's JSON automaton, advanced by every
     * generated id; each host draw masks the ids it rejects (grammar/json_grammar.h) */
    bool grammar;
    bool bad_format; /* an unknown response_format or a schema that does not compile: setup
                      * refuses the request */
    duet_json_t js;
    duet_jschema_t *schema; /* owned, "json_schema": the compiled schema (js then unused) */
    duet_jschema_state_t jss;
    uint8_t *ok; /* owned, grammar: [vocab] the mask's scratch */
} duet_worker_sampling_t;

/*
 * The vocabulary the response_format mask walks (worker-wide, made from the model folder's
 * tokenizer at start; NULL when it has none: such requests are then refused). Not owned.
 */
void duet_worker_set_json_vocab(const duet_json_vocab_t *v);

/* From a request's Sampling (NULL = greedy); without a seed, the stream is seeded at random.
 * Allocates only a json_schema's compiled schema (duet_worker_sampling_free frees it). */
void duet_worker_sampling_init(duet_worker_sampling_t *w, const Duet__Sampling *s, uint64_t rid);

/*
 * Make w ready for a request of prompt[0..n_prompt) that may generate max_tokens ids and has
 * already generated generated[0..n_generated) (a moved-in request; else 0) on a worker of vocab
 * ids whose prefill chunks are `chunk` tokens: the history sized so that recording never
 * allocates, the prompt and generated ids recorded (with a penalty), the host path's logits rows
 * (prompt_logprobs: a chunk's) and the prompt's logprob slots. prompt may be NULL when the
 * request needs no history. false: out of memory, or prompt ids needed but not given (`why`).
 */
bool duet_worker_sampling_setup(duet_worker_sampling_t *w, const uint32_t *prompt, size_t n_prompt,
                                const uint32_t *generated, size_t n_generated, uint32_t max_tokens,
                                int64_t vocab, int64_t chunk, const char **why);

/* Whether a request of w may be decoded speculatively: not with logit processing or a
 * response_format (its logprobs
 * then come from the verify rows, duet_worker_logprob). */
bool duet_worker_sampling_speculates(const duet_worker_sampling_t *w);

/* The log-probabilities of `chosen` in a raw logits row, with w->n_top most likely. */
void duet_worker_logprob(const duet_worker_sampling_t *w, const float *raw, int64_t vocab,
                         int32_t chosen, duet_worker_logprob_t *out);

/* Record a generated id (min_tokens, penalties). Never allocates after setup. */
void duet_worker_sampling_seen(duet_worker_sampling_t *w, int32_t tok);

/* Free what setup allocated (the rest is plain data). */
void duet_worker_sampling_free(duet_worker_sampling_t *w);

/*
 * The host path's draw for w from a raw logits row: logprobs into w->drawn_lp (when asked),
 * processing into scratch (vocab floats), the request's rule with the uniform u, and the id
 * recorded (duet_worker_sampling_seen). smp: a sampler of this vocabulary.
 */
int32_t duet_worker_host_draw(duet_worker_sampling_t *w, duet_sampler_t *smp, const float *raw,
                              float *scratch, int64_t vocab, float u);

/* Whether tok is one of the request's stop ids. */
bool duet_worker_is_stop(const duet_worker_sampling_t *w, int32_t tok);

/* End of the prefill chunk that starts at `prefilled`: chunks start at multiples of `chunk`
 * (duet-generate's cut, which batch invariance needs to give its exact output). */
int64_t duet_worker_chunk_end(int64_t prefilled, int64_t n_prompt, int64_t chunk);

/* prompt_logprobs: the rows of a prefill chunk of prompt[from..from + n_rows) ([n_rows][vocab],
 * row j after prompt[from + j]) score the prompt ids after them into w->prompt_lp. */
void duet_worker_prompt_logprobs(duet_worker_sampling_t *w, const int32_t *prompt, int64_t from,
                                 int64_t n_rows, const float *rows, int64_t vocab);

/* Send Tokens(ids, finish, error) for request rid. */
void duet_worker_send_tokens(duet_link_t *link, uint64_t rid, const uint32_t *ids, size_t n,
                             int finish, const char *error);
/* The same with log-probabilities: lps[0..n) one per id (NULL: none), prompt_lps[0..n_prompt_lps)
 * (NULL: none) for the request's first Tokens. */
void duet_worker_send_tokens_lp(duet_link_t *link, uint64_t rid, const uint32_t *ids, size_t n,
                                const duet_worker_logprob_t *lps,
                                const duet_worker_logprob_t *prompt_lps, size_t n_prompt_lps,
                                int finish, const char *error);
/* Send Refused(reason, retry_after_ms) for request rid. */
void duet_worker_send_refused(duet_link_t *link, uint64_t rid, const char *reason,
                              uint32_t retry_after_ms);

/* Monotonic seconds. */
double duet_worker_now(void);

#endif
