/*
 * duet-bench: a serving benchmark client for OpenAI-compatible HTTP servers (duet-router, vLLM,
 * ...), measuring what vLLM's benchmarks/benchmark_serving.py measures with the same definitions
 * (bench/serving_stats.h), plus the router's decode counters from /metrics, and checking
 * performance gates (bench/serving_gates.h).
 *
 * Shape of a run: read the prompts and the baseline (bad input fails here, before any load),
 * find the model (GET /v1/models unless --model), scrape /metrics, build every request body,
 * then drive all requests through one libuv loop with one TCP connection per request: a closed
 * loop of N in flight (--concurrency) or Poisson arrivals (--request-rate, optionally capped by
 * --concurrency). Every streamed byte is timestamped as it is read (uv_hrtime) and parsed by
 * serving_sse. After the last request: wait --metrics-settle-ms, scrape /metrics again,
 * summarise, print, check gates, write --json and --save-result (vLLM's result file). With a
 * speculating cluster the router also exports drafts proposed / kept per draft position;
 * duet-bench reports each position's acceptance rate. --sweep repeats the run once per value of
 * the concurrency or the request rate (same prompts and bodies), each run as above, then prints
 * a table; --csv gets one row per run.
 *
 * Request bodies are built before the clock starts so the timed path only connects, writes and
 * parses. The send time of a request is taken just before its connect: TTFT and E2EL include the
 * loopback connect, as a fresh HTTP client's would.
 *
 * --accuracy DATA replaces the load run: each document of DATA is scored in bits per byte from
 * the echoed prompt log-probabilities of POST /v1/completions (bench/serving_accuracy.h says
 * exactly what is scored), and with --baseline a paired t-test over documents decides whether
 * accuracy dropped.
 *
 * Exit codes: 0 ok; 1 the run could not happen or nothing completed (no server, no model, cannot
 * write --json, a document that could not be scored); 2 usage (bad flag, unreadable or malformed
 * prompts/baseline/documents file, a baseline over other documents); 3 a gate failed or accuracy
 * dropped.
 */
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "bench/serving_accuracy.h"
#include "bench/serving_gates.h"
#include "bench/serving_http.h"
#include "bench/serving_sse.h"
#include "bench/serving_stats.h"
#include "common/fingerprint.h"
#include "common/json.h"
#include "common/strbuf.h"
#include "common/utf8.h"
#include "common/version.h"

#define BENCH_EXIT_OK    0
#define BENCH_EXIT_RUN   1
#define BENCH_EXIT_USAGE 2
#define BENCH_EXIT_GATE  3

#define BENCH_MAX_PROMPT_FILE ((size_t)256 << 20)
#define BENCH_ERR_BODY_MAX    240  /* bytes of an error response kept for the reason */
#define BENCH_TICK_MS         100  /* timeout checks */
#define BENCH_PROGRESS_MS     1000 /* progress line period */
#define BENCH_MAX_REASONS     16   /* distinct failure reasons reported */
#define BENCH_MAX_TOLS        32   /* --tolerance flags */
#define BENCH_MAX_SWEEP       32   /* values of --sweep */

/* The router counters read from /metrics before and after the run (docs/architecture.md,
 * "Admission, placement, drain, admin API, metrics"): [4], [5] are the count and sum of the
 * histogram of tokens a speculating worker's verify step emitted per request, [6..9] the
 * workers' prefix caches (cache.prefix). */
static const char *const bench_server_counters[] = {
    "duet_gen_decode_steps_total",           "duet_gen_decode_seq_steps_total",
    "duet_gen_decoded_tokens_total",         "duet_gen_step_seconds_total",
    "duet_gen_spec_step_tokens_count",       "duet_gen_spec_step_tokens_sum",
    "duet_router_prefix_lookups_total",      "duet_router_prefix_hits_total",
    "duet_router_prefix_tokens_saved_total", "duet_router_prefix_evictions_total",
};
#define BENCH_N_COUNTERS 10
/* Gauges read once, after the run: the prefix caches' occupancy at its end. */
#define BENCH_PREFIX_PAGES   "duet_router_prefix_cache_pages"
#define BENCH_PREFIX_ENTRIES "duet_router_prefix_cache_entries"

/* Drafts proposed / kept per draft position (label position="1", "2", ...): positions are read
 * from 1 up while the router exports them, at most this many. */
#define BENCH_SPEC_DRAFTED       "duet_gen_spec_drafted_total"
#define BENCH_SPEC_ACCEPTED      "duet_gen_spec_accepted_total"
#define BENCH_SPEC_MAX_POSITIONS 64

typedef enum { BENCH_EP_COMPLETIONS = 0, BENCH_EP_CHAT = 1 } bench_endpoint_t;

/* What --sweep varies; the names are the flags' and the CSV's "sweep" column. */
typedef enum { BENCH_SWEEP_NONE = 0, BENCH_SWEEP_CONC, BENCH_SWEEP_RATE } bench_sweep_t;
static const char *const bench_sweep_names[] = {"", "concurrency", "request-rate"};

typedef struct {
    const char *url;
    char host[256];
    int port;
    const char *model; /* NULL: first id of /v1/models */
    bench_endpoint_t endpoint;
    long concurrency;    /* 0 = not given */
    double request_rate; /* 0 = not given; INFINITY = all at once */
    long num_prompts;
    long max_tokens;
    bool ignore_eos;
    double temperature;
    const char *prompts_file;
    long prompt_chars_max;  /* 0 = no truncation */
    long random_prompt_len; /* 0 = not given */
    uint64_t seed;
    double timeout_s;
    serving_slo_t slo;
    long settle_ms;
    const char *json_path;
    const char *baseline_path;
    serving_tol_t tols[BENCH_MAX_TOLS]; /* --tolerance, for a baseline run */
    size_t n_tols;
    bool quiet;
    const char *save_result_path; /* vLLM's --save-result shape */
    bench_sweep_t sweep;
    double sweep_values[BENCH_MAX_SWEEP]; /* concurrency or request rate (INFINITY = inf) */
    size_t n_sweep;
    const char *csv_path;
    const char *accuracy_path; /* --accuracy: score documents instead of a load run */
    long accuracy_doc_bytes;   /* > 0: accuracy_path is plain text cut into documents */
    double accuracy_alpha;
} bench_opts_t;

typedef struct bench_run bench_run_t;

typedef struct {
    serving_http_req_t http;
    serving_stream_t stream;
    bench_run_t *run; /* not owned */
    const char *body; /* not owned: bench_run_t.bodies[prompt index] */
    size_t body_len;
    uint64_t t_send_ns, t_last_ns;
    int status;
    bool sse; /* 200 with Content-Type text/event-stream */
    bool in_flight, ok;
    char err_body[BENCH_ERR_BODY_MAX + 1];
    size_t err_len;
    char error[256]; /* failure reason, "" when ok */
} bench_req_t;

struct bench_run {
    const bench_opts_t *o;
    uv_loop_t *loop;
    struct sockaddr_storage addr;
    const char *path;  /* endpoint path */
    bench_req_t *reqs; /* (n) */
    size_t n;
    uint64_t *arrival_ns; /* (n) offsets from t0 for --request-rate, NULL for closed loop */
    size_t cap;           /* most requests in flight */
    size_t next, in_flight, done, failed;
    uint64_t out_tokens_done;
    uint64_t t0_ns, t_end_ns, last_progress_ns;
    uv_timer_t tick, arrive;
    bool timers_closed;
};

/* ---------------------------------------------------------------- small helpers */

/* splitmix64: deterministic random numbers from --seed, the same on every platform. */
static uint64_t bench_rand(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Uniform in (0, 1]. */
static double bench_rand_unit(uint64_t *state)
{
    return ((double)(bench_rand(state) >> 11) + 1.0) / 9007199254740992.0;
}

static bool bench_parse_long(const char *s, long min, long max, long *v_p)
{
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (end == s || *end != '\0' || errno != 0 || v < min || v > max)
        return false;
    *v_p = v;
    return true;
}

static bool bench_parse_double(const char *s, double min, double max, double *v_p)
{
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end != '\0' || errno != 0 || isnan(v) || v < min || v > max)
        return false;
    *v_p = v;
    return true;
}

/* Cut s to at most max bytes without splitting a UTF-8 sequence. */
static void bench_truncate_utf8(char *s, size_t max)
{
    size_t n = strlen(s);
    if (n <= max)
        return;
    while (max > 0 && ((unsigned char)s[max] & 0xC0) == 0x80)
        max--;
    s[max] = '\0';
}

/* ---------------------------------------------------------------- options */

static const char bench_usage_text[] =
    "usage: duet-bench [options]\n"
    "\n"
    "Benchmark an OpenAI-compatible server (duet-router, vLLM, ...) with streamed requests, the\n"
    "way vLLM's benchmark_serving.py does, and check performance gates.\n"
    "\n"
    "server and request:\n"
    "  --url URL               server, http://HOST[:PORT] (default http://127.0.0.1:8000)\n"
    "  --model NAME            model name (default: the first id of GET /v1/models)\n"
    "  --endpoint E            completions (POST /v1/completions, \"prompt\") or chat\n"
    "                          (POST /v1/chat/completions, one user message); default completions\n"
    "  --max-tokens M          max_tokens of every request (default 64)\n"
    "  --ignore-eos            send \"ignore_eos\": true (fixed output lengths)\n"
    "  --temperature T         default 0\n"
    "  --timeout-s S           a request still running after S seconds fails (default 600)\n"
    "load:\n"
    "  --concurrency N         closed loop: N requests in flight at all times (default 1 when\n"
    "                          no --request-rate); with --request-rate: at most N in flight\n"
    "  --request-rate R        Poisson arrivals at R requests/s; inf = all at once\n"
    "  --num-prompts N         requests in the run (default 32)\n"
    "  --seed S                seed for arrivals and random prompts (default 0)\n"
    "prompts (used in order, cycling):\n"
    "  --prompts FILE          JSONL, one object a line with a \"question\", \"prompt\" or\n"
    "                          \"text\" string (e.g. gsm8k-test.jsonl)\n"
    "  --prompt-chars-max N    cut each prompt to N bytes (at a UTF-8 boundary)\n"
    "  --random-prompt-len N   synthetic prompts of N random words (~N BPE tokens; default\n"
    "                          source when no --prompts: 32 words)\n"
    "metrics and output:\n"
    "  --goodput SLO...        SLOs for goodput: ttft:MS tpot:MS e2el:MS (one or more items,\n"
    "                          in one argument separated by spaces/commas or as following args)\n"
    "  --metrics-settle-ms MS  wait before the final /metrics scrape (default 1500)\n"
    "  --json FILE             write every metric and the configuration as JSON\n"
    "  --save-result FILE      write the run as vLLM's benchmark_serving.py --save-result (with\n"
    "                          --save-detailed) does: its top-level keys and the per-request\n"
    "                          input_lens, output_lens, ttfts (s), itls (lists of s),\n"
    "                          generated_texts and errors (\"\" when the request succeeded)\n"
    "  --sweep P=V1,V2,...     one run per value in one invocation, same prompts: P concurrency\n"
    "                          (integers) or request-rate (numbers or inf); prints a table.\n"
    "                          --json / --save-result FILE then write one file per value,\n"
    "                          \"-P-V\" inserted before the extension: out.json ->\n"
    "                          out-concurrency-4.json, out-request-rate-inf.json, ...;\n"
    "                          gates apply to every run\n"
    "  --csv FILE              one row per run: sweep,value,completed,failed,error_rate,\n"
    "                          request_throughput,output_throughput, then mean/median/p99 of\n"
    "                          ttft, tpot, itl, e2el in ms (empty when not measured);\n"
    "                          bench/plot_sweep.py CSV PNG plots it\n"
    "  --baseline FILE         perf gates, exit 3 when one fails: a gates file, or an earlier\n"
    "                          run's --json output (relative gates; both below); with\n"
    "                          --accuracy an earlier accuracy run's --json (see accuracy)\n"
    "  --tolerance M=+-P%      with a baseline run: metric M may rise (+) or drop (-) by P%\n"
    "                          (repeatable; replaces M's default or gates one more metric)\n"
    "  --quiet                 no progress lines on stderr\n"
    "accuracy (instead of a load run; see \"accuracy\" below):\n"
    "  --accuracy DATA         score the documents of DATA through POST /v1/completions\n"
    "  --accuracy-doc-bytes N  DATA is plain text cut into documents of N bytes (at a UTF-8\n"
    "                          boundary); without it DATA is JSONL with a \"text\" string a line\n"
    "  --accuracy-alpha A      significance level of the test against --baseline (default 0.01)\n"
    "  -h, --help              this text\n"
    "  --version               the version, git commit and CUDA build\n"
    "\n"
    "metrics (vLLM's definitions; times in ms, statistics over completed requests):\n"
    "  ttft   send -> first chunk carrying text;  e2el  send -> last byte\n"
    "  tpot   per request (e2el - ttft) / (output_tokens - 1); 1-token requests excluded\n"
    "  itl    gaps between successive text chunks, all requests pooled\n"
    "  output_tokens = usage.completion_tokens of the final chunk (stream_options.include_usage),\n"
    "         else the number of text chunks\n"
    "  output_throughput = total output tokens / duration; request_throughput, total_token_\n"
    "         throughput (prompt + output) likewise; duration = first send -> last response\n"
    "  user_throughput = mean over requests with >= 2 output tokens of\n"
    "         (output_tokens - 1) / (e2el - ttft) in tok/s, i.e. mean of 1000 / tpot_i\n"
    "  goodput = completed requests meeting every --goodput SLO / duration\n"
    "  error_rate = failed / all requests (HTTP error, connection failure, malformed stream,\n"
    "         SSE error event, no text, timeout)\n"
    "  server side (deltas of the router's /metrics over the run, null when absent):\n"
    "  avg_decoded_tokens_per_iter = d duet_gen_decoded_tokens_total /\n"
    "                                d duet_gen_decode_seq_steps_total\n"
    "  device_step_time_ms = 1000 * d duet_gen_step_seconds_total / d duet_gen_decode_steps_total\n"
    "  speculative decoding (null when no drafts were verified):\n"
    "  spec_mean_step_tokens = d duet_gen_spec_step_tokens_sum / d ..._count: tokens a verify\n"
    "         step emitted per request (drafts kept + 1)\n"
    "  spec_acceptance_rate = d duet_gen_spec_accepted_total / d duet_gen_spec_drafted_total\n"
    "         (every draft position); spec_positions lists each position's drafted, accepted\n"
    "         and acceptance_rate (positions with drafts only)\n"
    "  prefix caches (null when no worker looked a prompt up: cache.prefix off):\n"
    "  prefix_hit_rate = d duet_router_prefix_hits_total / d duet_router_prefix_lookups_total;\n"
    "         prefix_tokens_saved, prefix_evictions: deltas of ..._tokens_saved_total,\n"
    "         ..._evictions_total; prefix_cache_entries / _pages: the gauges after the run\n"
    "\n"
    "baseline file (--baseline):\n"
    "  {\"description\": \"...\", \"gates\": {\"error_rate\": {\"max\": 0},\n"
    "   \"output_throughput\": {\"min\": 50}, \"mean_tpot_ms\": {\"min\": 1, \"max\": 200}}}\n"
    "  Each key is a top-level number of the --json output; min/max are inclusive. A gated metric\n"
    "  that is missing or null fails. Each gate prints PASS/FAIL with measured value and bound.\n"
    "  A baseline run (an earlier --json): request / output / total token throughput may drop\n"
    "  5%, the mean and median TTFT, TPOT, ITL and E2EL may rise 10%, error_rate may not rise\n"
    "  (metrics the run measured); e.g. --tolerance output_throughput=-3% --tolerance\n"
    "  p99_ttft_ms=+25%.\n"
    "\n"
    "accuracy (--accuracy DATA):\n"
    "  Each document is sent alone, in order: {\"prompt\": text, \"max_tokens\": 0,\n"
    "  \"echo\": true, \"logprobs\": 1, \"temperature\": 0}. The answer's choices[0].logprobs has\n"
    "  one entry per prompt token; the first (null: nothing precedes it, e.g. BOS) is not\n"
    "  scored, every later one must be a number. The scored text is choices[0].text from\n"
    "  text_offset[1] (a code-point offset, as OpenAI and vLLM give it) to its end, and must be\n"
    "  a suffix of the document.\n"
    "  bits_per_byte = -(sum of the scored token_logprobs) / ln 2 / (UTF-8 bytes of scored text)\n"
    "  The --json holds the mean over documents and each document's value, bytes, tokens and\n"
    "  sha256. --baseline FILE (an earlier --accuracy --json) compares: the documents must be the\n"
    "  same (same sha256 in the same order, else exit 2); a one-sided paired t-test on the\n"
    "  per-document differences d = bpb - bpb_baseline (t = mean(d) / (sd(d) / sqrt(n)), sd with\n"
    "  n - 1, df = n - 1, p = P(T_df >= t)) says accuracy dropped when p < --accuracy-alpha:\n"
    "  exit 3. bench/accuracy_docs.py cuts the demo model's held-out text into such documents.\n"
    "\n"
    "exit: 0 ok, 1 run failed (no server/model, nothing completed), 2 usage, 3 a gate failed or\n"
    "  accuracy dropped\n";

static int bench_usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int bench_usage_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("duet-bench: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputs(" (duet-bench --help)\n", stderr);
    va_end(ap);
    return BENCH_EXIT_USAGE;
}

/* http://HOST[:PORT][/] -> host, port. */
static bool bench_parse_url(const char *url, char *host, size_t cap, int *port_p)
{
    const char *p = url;
    if (strncmp(p, "http://", 7) != 0)
        return false;
    p += 7;
    size_t hl = strcspn(p, ":/");
    if (hl == 0 || hl >= cap)
        return false;
    memcpy(host, p, hl);
    host[hl] = '\0';
    p += hl;
    long port = 80;
    if (*p == ':') {
        char num[8];
        size_t k = strcspn(p + 1, "/");
        if (k == 0 || k >= sizeof(num))
            return false;
        memcpy(num, p + 1, k);
        num[k] = '\0';
        if (!bench_parse_long(num, 1, 65535, &port))
            return false;
        p += 1 + k;
    }
    if (*p != '\0' && strcmp(p, "/") != 0)
        return false;
    *port_p = (int)port;
    return true;
}

/* One or more goodput items separated by spaces or commas. */
static int bench_parse_goodput(const char *arg, serving_slo_t *slo)
{
    char buf[256];
    snprintf(buf, sizeof(buf), "%s", arg);
    int n = 0;
    for (char *save = NULL, *it = strtok_r(buf, " ,", &save); it != NULL;
         it = strtok_r(NULL, " ,", &save), n++)
        if (serving_slo_parse_item(it, slo) != DUET_OK)
            return -1;
    return n;
}

/* "concurrency=1,2,4" or "request-rate=1,2,inf" into o->sweep, o->sweep_values. */
static duet_status_t bench_parse_sweep(const char *arg, bench_opts_t *o)
{
    const char *eq = strchr(arg, '=');
    size_t nl = eq != NULL ? (size_t)(eq - arg) : 0;
    if (eq != NULL && nl == 11 && strncmp(arg, "concurrency", nl) == 0)
        o->sweep = BENCH_SWEEP_CONC;
    else if (eq != NULL && nl == 12 && strncmp(arg, "request-rate", nl) == 0)
        o->sweep = BENCH_SWEEP_RATE;
    else
        return duet_error_set(DUET_ERR_INVALID,
                              "expected concurrency=N,N,... or request-rate=R,R,..., not \"%s\"",
                              arg);
    char buf[512];
    snprintf(buf, sizeof(buf), "%s", eq + 1);
    o->n_sweep = 0;
    for (char *save = NULL, *it = strtok_r(buf, ",", &save); it != NULL;
         it = strtok_r(NULL, ",", &save)) {
        if (o->n_sweep == BENCH_MAX_SWEEP)
            return duet_error_set(DUET_ERR_INVALID, "at most %d values", BENCH_MAX_SWEEP);
        double v;
        long c;
        if (o->sweep == BENCH_SWEEP_CONC) {
            if (!bench_parse_long(it, 1, 100000, &c))
                return duet_error_set(DUET_ERR_INVALID,
                                      "concurrency \"%s\" is not an integer in [1, 100000]", it);
            v = (double)c;
        } else if (strcmp(it, "inf") == 0 || strcmp(it, "infinity") == 0) {
            v = INFINITY;
        } else if (!bench_parse_double(it, 1e-9, 1e9, &v)) {
            return duet_error_set(DUET_ERR_INVALID,
                                  "request rate \"%s\" is not a positive number or inf", it);
        }
        o->sweep_values[o->n_sweep++] = v;
    }
    if (o->n_sweep == 0)
        return duet_error_set(DUET_ERR_INVALID, "no values after \"=\"");
    return DUET_OK;
}

enum {
    OPT_URL = 256,
    OPT_MODEL,
    OPT_ENDPOINT,
    OPT_CONC,
    OPT_RATE,
    OPT_NUM,
    OPT_MAXTOK,
    OPT_IGNORE_EOS,
    OPT_TEMP,
    OPT_PROMPTS,
    OPT_CHARS,
    OPT_RANDOM,
    OPT_SEED,
    OPT_TIMEOUT,
    OPT_GOODPUT,
    OPT_SETTLE,
    OPT_JSON,
    OPT_BASELINE,
    OPT_TOLERANCE,
    OPT_QUIET,
    OPT_SAVE_RESULT,
    OPT_SWEEP,
    OPT_CSV,
    OPT_ACCURACY,
    OPT_ACC_DOC_BYTES,
    OPT_ACC_ALPHA,
};

/* Parse argv into *o. Returns -1 to go on, else the exit code (help: 0, bad flag: 2). */
static int bench_parse_args(int argc, char **argv, bench_opts_t *o)
{
    static const struct option longopts[] = {
        {"url", 1, 0, OPT_URL},
        {"model", 1, 0, OPT_MODEL},
        {"endpoint", 1, 0, OPT_ENDPOINT},
        {"concurrency", 1, 0, OPT_CONC},
        {"request-rate", 1, 0, OPT_RATE},
        {"num-prompts", 1, 0, OPT_NUM},
        {"max-tokens", 1, 0, OPT_MAXTOK},
        {"ignore-eos", 0, 0, OPT_IGNORE_EOS},
        {"temperature", 1, 0, OPT_TEMP},
        {"prompts", 1, 0, OPT_PROMPTS},
        {"prompt-chars-max", 1, 0, OPT_CHARS},
        {"random-prompt-len", 1, 0, OPT_RANDOM},
        {"seed", 1, 0, OPT_SEED},
        {"timeout-s", 1, 0, OPT_TIMEOUT},
        {"goodput", 1, 0, OPT_GOODPUT},
        {"metrics-settle-ms", 1, 0, OPT_SETTLE},
        {"json", 1, 0, OPT_JSON},
        {"baseline", 1, 0, OPT_BASELINE},
        {"tolerance", 1, 0, OPT_TOLERANCE},
        {"quiet", 0, 0, OPT_QUIET},
        {"save-result", 1, 0, OPT_SAVE_RESULT},
        {"sweep", 1, 0, OPT_SWEEP},
        {"csv", 1, 0, OPT_CSV},
        {"accuracy", 1, 0, OPT_ACCURACY},
        {"accuracy-doc-bytes", 1, 0, OPT_ACC_DOC_BYTES},
        {"accuracy-alpha", 1, 0, OPT_ACC_ALPHA},
        {"help", 0, 0, 'h'},
        {"version", 0, 0, 'V'},
        {0, 0, 0, 0},
    };
    *o = (bench_opts_t){.url = "http://127.0.0.1:8000",
                        .num_prompts = 32,
                        .max_tokens = 64,
                        .timeout_s = 600,
                        .settle_ms = 1500,
                        .accuracy_alpha = 0.01};
    long seed = 0;
    int c;
    opterr = 0;
    /* '+': stop at the first non-option, so --goodput can take the items that follow it */
    while ((c = getopt_long(argc, argv, "+:h", longopts, NULL)) != -1) {
        const char *a = optarg;
        switch (c) {
        case 'h':
            fputs(bench_usage_text, stdout);
            return BENCH_EXIT_OK;
        case 'V':
            duet_version_print("duet-bench");
            return BENCH_EXIT_OK;
        case OPT_URL:
            o->url = a;
            break;
        case OPT_MODEL:
            o->model = a;
            break;
        case OPT_ENDPOINT:
            if (strcmp(a, "completions") == 0)
                o->endpoint = BENCH_EP_COMPLETIONS;
            else if (strcmp(a, "chat") == 0)
                o->endpoint = BENCH_EP_CHAT;
            else
                return bench_usage_error("--endpoint must be completions or chat, not \"%s\"", a);
            break;
        case OPT_CONC:
            if (!bench_parse_long(a, 1, 100000, &o->concurrency))
                return bench_usage_error("--concurrency must be an integer in [1, 100000]");
            break;
        case OPT_RATE:
            if (strcmp(a, "inf") == 0 || strcmp(a, "infinity") == 0)
                o->request_rate = INFINITY;
            else if (!bench_parse_double(a, 1e-9, 1e9, &o->request_rate))
                return bench_usage_error("--request-rate must be a positive number or inf");
            break;
        case OPT_NUM:
            if (!bench_parse_long(a, 1, 10000000, &o->num_prompts))
                return bench_usage_error("--num-prompts must be an integer in [1, 10^7]");
            break;
        case OPT_MAXTOK:
            if (!bench_parse_long(a, 1, 1000000, &o->max_tokens))
                return bench_usage_error("--max-tokens must be an integer in [1, 10^6]");
            break;
        case OPT_IGNORE_EOS:
            o->ignore_eos = true;
            break;
        case OPT_TEMP:
            if (!bench_parse_double(a, 0, 100, &o->temperature))
                return bench_usage_error("--temperature must be a number in [0, 100]");
            break;
        case OPT_PROMPTS:
            o->prompts_file = a;
            break;
        case OPT_CHARS:
            if (!bench_parse_long(a, 1, 100000000, &o->prompt_chars_max))
                return bench_usage_error("--prompt-chars-max must be a positive integer");
            break;
        case OPT_RANDOM:
            if (!bench_parse_long(a, 1, 1000000, &o->random_prompt_len))
                return bench_usage_error("--random-prompt-len must be an integer in [1, 10^6]");
            break;
        case OPT_SEED:
            if (!bench_parse_long(a, 0, LONG_MAX, &seed))
                return bench_usage_error("--seed must be a non-negative integer");
            o->seed = (uint64_t)seed;
            break;
        case OPT_TIMEOUT:
            if (!bench_parse_double(a, 0.001, 1e7, &o->timeout_s))
                return bench_usage_error("--timeout-s must be a positive number of seconds");
            break;
        case OPT_GOODPUT:
            if (bench_parse_goodput(a, &o->slo) <= 0)
                return bench_usage_error("--goodput: %s", duet_error_last()[0] != '\0'
                                                              ? duet_error_last()
                                                              : "no SLO given");
            /* vLLM style: items may follow as separate arguments */
            while (optind < argc && argv[optind][0] != '-' && strchr(argv[optind], ':') != NULL) {
                if (bench_parse_goodput(argv[optind], &o->slo) < 0)
                    return bench_usage_error("--goodput: %s", duet_error_last());
                optind++;
            }
            break;
        case OPT_SETTLE:
            if (!bench_parse_long(a, 0, 600000, &o->settle_ms))
                return bench_usage_error("--metrics-settle-ms must be an integer in [0, 600000]");
            break;
        case OPT_JSON:
            o->json_path = a;
            break;
        case OPT_BASELINE:
            o->baseline_path = a;
            break;
        case OPT_TOLERANCE:
            if (o->n_tols == BENCH_MAX_TOLS)
                return bench_usage_error("--tolerance: at most %d", BENCH_MAX_TOLS);
            if (serving_tol_parse(a, &o->tols[o->n_tols]) != DUET_OK)
                return bench_usage_error("--tolerance: %s", duet_error_last());
            o->n_tols++;
            break;
        case OPT_QUIET:
            o->quiet = true;
            break;
        case OPT_SAVE_RESULT:
            o->save_result_path = a;
            break;
        case OPT_SWEEP:
            if (bench_parse_sweep(a, o) != DUET_OK)
                return bench_usage_error("--sweep: %s", duet_error_last());
            break;
        case OPT_CSV:
            o->csv_path = a;
            break;
        case OPT_ACCURACY:
            o->accuracy_path = a;
            break;
        case OPT_ACC_DOC_BYTES:
            if (!bench_parse_long(a, 1, 100000000, &o->accuracy_doc_bytes))
                return bench_usage_error("--accuracy-doc-bytes must be an integer in [1, 10^8]");
            break;
        case OPT_ACC_ALPHA:
            if (!bench_parse_double(a, 1e-12, 0.5, &o->accuracy_alpha))
                return bench_usage_error("--accuracy-alpha must be a number in (0, 0.5]");
            break;
        case ':':
            return bench_usage_error("%s needs a value", argv[optind - 1]);
        default:
            return bench_usage_error("unknown option %s", argv[optind - 1]);
        }
    }
    if (optind < argc)
        return bench_usage_error("unexpected argument \"%s\"", argv[optind]);
    if (o->n_tols > 0 && o->baseline_path == NULL)
        return bench_usage_error("--tolerance needs --baseline with an earlier run's --json");
    if (!bench_parse_url(o->url, o->host, sizeof(o->host), &o->port))
        return bench_usage_error("--url must be http://HOST[:PORT], not \"%s\"", o->url);
    if (o->prompts_file != NULL && o->random_prompt_len > 0)
        return bench_usage_error("--prompts and --random-prompt-len exclude each other");
    if (o->accuracy_doc_bytes > 0 && o->accuracy_path == NULL)
        return bench_usage_error("--accuracy-doc-bytes needs --accuracy");
    if (o->accuracy_path != NULL && (o->sweep != BENCH_SWEEP_NONE || o->csv_path != NULL ||
                                     o->save_result_path != NULL || o->n_tols > 0))
        return bench_usage_error("--accuracy excludes --sweep, --csv, --save-result, --tolerance");
    if (o->sweep == BENCH_SWEEP_RATE && o->request_rate > 0)
        return bench_usage_error("--sweep request-rate replaces --request-rate: give one");
    if (o->sweep == BENCH_SWEEP_CONC && o->concurrency > 0)
        return bench_usage_error("--sweep concurrency replaces --concurrency: give one");
    if (o->request_rate == 0 && o->concurrency == 0 && o->sweep != BENCH_SWEEP_RATE)
        o->concurrency = 1;
    return -1;
}

/* ---------------------------------------------------------------- prompts */

typedef struct {
    char **v; /* owned strings, (n) */
    size_t n;
} bench_prompts_t;

static void bench_prompts_free(bench_prompts_t *p)
{
    for (size_t i = 0; i < p->n; i++)
        free(p->v[i]);
    free(p->v);
    p->v = NULL;
    p->n = 0;
}

static duet_status_t bench_prompts_push(bench_prompts_t *p, size_t *cap, const char *s)
{
    if (p->n == *cap) {
        size_t ncap = *cap != 0 ? *cap * 2 : 256;
        char **nv = realloc(p->v, ncap * sizeof(*nv));
        if (nv == NULL)
            return duet_error_set(DUET_ERR_NOMEM, "prompt list");
        p->v = nv;
        *cap = ncap;
    }
    p->v[p->n] = strdup(s);
    if (p->v[p->n] == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "prompt");
    p->n++;
    return DUET_OK;
}

/*
 * JSONL: one object a line; the first string field among keys (n_keys of them; `what` names
 * them in the error of a record without any).
 */
static duet_status_t bench_jsonl_load(const char *path, const char *const *keys, size_t n_keys,
                                      const char *what, bench_prompts_t *p)
{
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    duet_status_t st = duet_strbuf_read_file(&sb, path, BENCH_MAX_PROMPT_FILE);
    if (st != DUET_OK)
        return st;
    size_t cap = 0, lineno = 0;
    char *save = NULL;
    for (char *line = strtok_r(sb.data != NULL ? sb.data : "", "\n", &save); line != NULL;
         line = strtok_r(NULL, "\n", &save)) {
        lineno++; /* strtok skips empty lines; numbers count non-empty lines */
        if (strspn(line, " \t\r") == strlen(line))
            continue;
        json_error_t jerr;
        json_t *obj = json_loads(line, 0, &jerr);
        if (!json_is_object(obj)) {
            st = duet_error_set(DUET_ERR_FORMAT, "%s: record %zu: %s", path, lineno,
                                obj == NULL ? jerr.text : "not a JSON object");
            json_decref(obj);
            goto fail;
        }
        const char *text = NULL;
        for (size_t k = 0; k < n_keys && text == NULL; k++) {
            json_t *v = json_object_get(obj, keys[k]);
            if (json_is_string(v))
                text = json_string_value(v);
        }
        if (text == NULL) {
            json_decref(obj);
            st =
                duet_error_set(DUET_ERR_FORMAT, "%s: record %zu: no %s string", path, lineno, what);
            goto fail;
        }
        st = bench_prompts_push(p, &cap, text);
        json_decref(obj);
        if (st != DUET_OK)
            goto fail;
    }
    duet_strbuf_free(&sb);
    if (p->n == 0)
        return duet_error_set(DUET_ERR_FORMAT, "%s: no records", path);
    return DUET_OK;
fail:
    duet_strbuf_free(&sb);
    bench_prompts_free(p);
    return st;
}

/* --prompts: "question", "prompt" or "text" (e.g. gsm8k-test.jsonl). */
static duet_status_t bench_prompts_load(const char *path, bench_prompts_t *p)
{
    static const char *const keys[] = {"question", "prompt", "text"};
    return bench_jsonl_load(path, keys, 3, "\"question\", \"prompt\" or \"text\"", p);
}

/* n synthetic prompts of `words` random words each, deterministic in seed. */
static duet_status_t bench_prompts_random(size_t n, long words, uint64_t seed, bench_prompts_t *p)
{
    static const char *const vocab[] = {
        "the",      "of",     "and",    "to",     "in",      "is",       "was",     "for",
        "on",       "with",   "as",     "by",     "at",      "from",     "time",    "year",
        "people",   "way",    "day",    "man",    "thing",   "woman",    "life",    "child",
        "world",    "school", "state",  "family", "student", "group",    "country", "problem",
        "hand",     "part",   "place",  "case",   "week",    "company",  "system",  "program",
        "question", "work",   "number", "night",  "point",   "home",     "water",   "room",
        "mother",   "area",   "money",  "story",  "fact",    "month",    "lot",     "right",
        "study",    "book",   "eye",    "job",    "word",    "business", "issue",   "side"};
    size_t nv = sizeof(vocab) / sizeof(vocab[0]);
    uint64_t state = seed ^ 0x5EEDB0A7ull;
    size_t cap = 0;
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    for (size_t i = 0; i < n; i++) {
        sb.len = 0;
        for (long w = 0; w < words; w++)
            duet_strbuf_printf(&sb, "%s%s", w > 0 ? " " : "", vocab[bench_rand(&state) % nv]);
        duet_status_t st = duet_strbuf_status(&sb);
        if (st == DUET_OK)
            st = bench_prompts_push(p, &cap, sb.data);
        if (st != DUET_OK) {
            duet_strbuf_free(&sb);
            bench_prompts_free(p);
            return st;
        }
    }
    duet_strbuf_free(&sb);
    return DUET_OK;
}

/* The JSON body of one request. Returns a malloc'd string or NULL (out of memory / bad UTF-8). */
static char *bench_body(const bench_opts_t *o, const char *model, const char *prompt)
{
    json_t *b = json_object();
    json_object_set_new(b, "model", json_string(model));
    json_t *text = json_string(prompt);
    if (text == NULL) { /* invalid UTF-8 */
        json_decref(b);
        return NULL;
    }
    if (o->endpoint == BENCH_EP_CHAT) {
        json_t *msg = json_pack("{s:s, s:o}", "role", "user", "content", text);
        json_object_set_new(b, "messages", json_pack("[o]", msg));
    } else {
        json_object_set_new(b, "prompt", text);
    }
    json_object_set_new(b, "max_tokens", json_integer(o->max_tokens));
    json_object_set_new(b, "temperature", json_real(o->temperature));
    json_object_set_new(b, "stream", json_true());
    json_object_set_new(b, "stream_options", json_pack("{s:b}", "include_usage", 1));
    if (o->ignore_eos)
        json_object_set_new(b, "ignore_eos", json_true());
    char *s = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    return s;
}

/* ---------------------------------------------------------------- the run */

static void bench_pump(bench_run_t *run);
static void bench_on_arrive(uv_timer_t *t);

static void bench_req_headers(serving_http_req_t *h, int status, const char *ct)
{
    bench_req_t *r = h->arg;
    r->status = status;
    if (status == 200) {
        if (strncasecmp(ct, "text/event-stream", 17) != 0)
            serving_http_abort(h, "HTTP 200 but not an event stream (Content-Type \"%.60s\")", ct);
        else
            r->sse = true;
    }
}

static void bench_req_body(serving_http_req_t *h, const char *data, size_t len, uint64_t now_ns)
{
    bench_req_t *r = h->arg;
    r->t_last_ns = now_ns;
    if (!r->sse) { /* an error status: keep the start of its body for the reason */
        size_t room = BENCH_ERR_BODY_MAX - r->err_len;
        size_t n = len < room ? len : room;
        memcpy(r->err_body + r->err_len, data, n);
        r->err_len += n;
        r->err_body[r->err_len] = '\0';
        return;
    }
    if (serving_stream_feed(&r->stream, data, len, now_ns) != DUET_OK)
        serving_http_abort(h, "%s", r->stream.error);
}

static void bench_req_done(serving_http_req_t *h, const char *error)
{
    bench_req_t *r = h->arg;
    bench_run_t *run = r->run;
    uint64_t now = uv_hrtime();
    if (r->t_last_ns == 0)
        r->t_last_ns = now;
    if (error != NULL) {
        snprintf(r->error, sizeof(r->error), "%s", error);
    } else if (r->status != 200) {
        for (size_t i = 0; i < r->err_len; i++) /* one line in reports */
            if (r->err_body[i] == '\n' || r->err_body[i] == '\r')
                r->err_body[i] = ' ';
        snprintf(r->error, sizeof(r->error), "HTTP %d: %s", r->status, r->err_body);
    } else if (serving_stream_finish(&r->stream) != DUET_OK) {
        snprintf(r->error, sizeof(r->error), "%s", r->stream.error);
    } else if (r->stream.n_text_chunks == 0) {
        snprintf(r->error, sizeof(r->error), "the response carried no text");
    } else {
        r->ok = true;
    }
    r->in_flight = false;
    run->in_flight--;
    run->done++;
    if (!r->ok)
        run->failed++;
    else
        run->out_tokens_done +=
            r->stream.has_usage ? r->stream.usage_completion_tokens : r->stream.n_text_chunks;
    if (run->done == run->n)
        run->t_end_ns = now;
    bench_pump(run);
}

static const serving_http_cbs_t bench_req_cbs = {bench_req_headers, bench_req_body, bench_req_done};

static void bench_progress(bench_run_t *run, uint64_t now, bool last)
{
    if (run->o->quiet)
        return;
    double el = (double)(now - run->t0_ns) / 1e9;
    fprintf(stderr,
            "duet-bench: %zu/%zu done, %zu failed, %zu in flight, %.1f s, %.1f out tok/s%s\n",
            run->done, run->n, run->failed, run->in_flight, el,
            el > 0 ? (double)run->out_tokens_done / el : 0.0, last ? " (finished)" : "");
}

static void bench_timer_closed(uv_handle_t *h) {}

/* Start requests while the load shape allows; stop the timers when everything is done. */
static void bench_pump(bench_run_t *run)
{
    uint64_t now = uv_hrtime();
    while (run->next < run->n && run->in_flight < run->cap) {
        if (run->arrival_ns != NULL && run->t0_ns + run->arrival_ns[run->next] > now)
            break;
        bench_req_t *r = &run->reqs[run->next++];
        r->t_send_ns = uv_hrtime();
        r->in_flight = true;
        run->in_flight++;
        duet_status_t st =
            serving_http_start(run->loop, &r->http, (struct sockaddr *)&run->addr, run->o->host,
                               "POST", run->path, r->body, r->body_len, &bench_req_cbs, r);
        if (st != DUET_OK) { /* nothing started: account it here */
            snprintf(r->error, sizeof(r->error), "%s", duet_error_last());
            r->in_flight = false;
            run->in_flight--;
            run->done++;
            run->failed++;
            if (run->done == run->n)
                run->t_end_ns = uv_hrtime();
        }
    }
    if (run->done == run->n) {
        if (!run->timers_closed) {
            run->timers_closed = true;
            bench_progress(run, run->t_end_ns, true);
            uv_close((uv_handle_t *)&run->tick, bench_timer_closed);
            uv_close((uv_handle_t *)&run->arrive, bench_timer_closed);
        }
        return;
    }
    if (run->arrival_ns != NULL && run->next < run->n && run->in_flight < run->cap) {
        uint64_t due = run->t0_ns + run->arrival_ns[run->next];
        uint64_t ms = due > now ? (due - now + 999999) / 1000000 : 0;
        uv_timer_start(&run->arrive, bench_on_arrive, ms, 0);
    }
}

static void bench_on_arrive(uv_timer_t *t)
{
    bench_pump(t->data);
}

static void bench_on_tick(uv_timer_t *t)
{
    bench_run_t *run = t->data;
    uint64_t now = uv_hrtime();
    uint64_t limit = (uint64_t)(run->o->timeout_s * 1e9);
    for (size_t i = 0; i < run->next; i++) {
        bench_req_t *r = &run->reqs[i];
        if (r->in_flight && now - r->t_send_ns > limit)
            serving_http_abort(&r->http, "timed out after %g s", run->o->timeout_s);
    }
    if (now - run->last_progress_ns >= (uint64_t)BENCH_PROGRESS_MS * 1000000) {
        run->last_progress_ns = now;
        bench_progress(run, now, false);
    }
}

/* Poisson arrival offsets (exponential gaps at rate R), or all zero for R = inf. */
static uint64_t *bench_arrivals(size_t n, double rate, uint64_t seed)
{
    uint64_t *a = calloc(n, sizeof(*a));
    if (a == NULL || isinf(rate))
        return a;
    uint64_t state = seed ^ 0xA77A1Full;
    double t = 0;
    for (size_t i = 0; i < n; i++) {
        if (i > 0)
            t += -log(bench_rand_unit(&state)) / rate;
        a[i] = (uint64_t)(t * 1e9);
    }
    return a;
}

/* ---------------------------------------------------------------- server metrics */

typedef struct {
    bool ok; /* the scrape answered 200 */
    bool found[BENCH_N_COUNTERS];
    double value[BENCH_N_COUNTERS];
    int n_positions; /* draft positions 1..n_positions have both series */
    double drafted[BENCH_SPEC_MAX_POSITIONS], accepted[BENCH_SPEC_MAX_POSITIONS];
    bool found_prefix; /* both prefix gauges were there */
    double prefix_pages, prefix_entries;
} bench_scrape_t;

static void bench_scrape(bench_run_t *run, bench_scrape_t *s)
{
    memset(s, 0, sizeof(*s));
    duet_strbuf_t body;
    duet_strbuf_init(&body);
    int status = 0;
    if (serving_http_get(run->loop, (struct sockaddr *)&run->addr, run->o->host, "/metrics", 10000,
                         &status, &body) == DUET_OK &&
        status == 200) {
        s->ok = true;
        const char *text = body.data != NULL ? body.data : "";
        for (int i = 0; i < BENCH_N_COUNTERS; i++)
            serving_prom_sum(text, body.len, bench_server_counters[i], &s->value[i], &s->found[i]);
        bool fp, fe;
        serving_prom_sum(text, body.len, BENCH_PREFIX_PAGES, &s->prefix_pages, &fp);
        serving_prom_sum(text, body.len, BENCH_PREFIX_ENTRIES, &s->prefix_entries, &fe);
        s->found_prefix = fp && fe;
        for (int j = 0; j < BENCH_SPEC_MAX_POSITIONS; j++) {
            char pos[16];
            snprintf(pos, sizeof(pos), "%d", j + 1);
            bool fd, fa;
            serving_prom_sum_where(text, body.len, BENCH_SPEC_DRAFTED, "position", pos,
                                   &s->drafted[j], &fd);
            serving_prom_sum_where(text, body.len, BENCH_SPEC_ACCEPTED, "position", pos,
                                   &s->accepted[j], &fa);
            if (!fd || !fa)
                break;
            s->n_positions = j + 1;
        }
    }
    duet_strbuf_free(&body);
}

/* ---------------------------------------------------------------- model discovery */

static duet_status_t bench_find_model(bench_run_t *run, char **model_p)
{
    duet_strbuf_t body;
    duet_strbuf_init(&body);
    int status = 0;
    duet_status_t st = serving_http_get(run->loop, (struct sockaddr *)&run->addr, run->o->host,
                                        "/v1/models", 10000, &status, &body);
    if (st != DUET_OK)
        goto out;
    if (status != 200) {
        st = duet_error_set(DUET_ERR_TRANSPORT, "GET /v1/models: HTTP %d: %.200s", status,
                            body.data != NULL ? body.data : "");
        goto out;
    }
    json_t *root = NULL;
    st = duet_json_load_buffer(body.data != NULL ? body.data : "", body.len, "GET /v1/models",
                               1u << 24, &root);
    if (st != DUET_OK)
        goto out;
    const char *id = NULL;
    st = duet_json_get_string(root, "GET /v1/models", "data[0].id", &id);
    if (st == DUET_OK) {
        *model_p = strdup(id);
        if (*model_p == NULL)
            st = duet_error_set(DUET_ERR_NOMEM, "model name");
    }
    json_decref(root);
out:
    duet_strbuf_free(&body);
    return st;
}

/* ---------------------------------------------------------------- results */

/* A number, or null for NaN (JSON has no NaN). */
static json_t *bench_num(double v)
{
    return isfinite(v) ? json_real(v) : json_null();
}

static void bench_put_dist(json_t *res, const char *name, const serving_dist_t *d)
{
    static const char *const stat[] = {"mean", "median", "std", "p90", "p99", "min", "max"};
    double v[] = {d->mean, d->median, d->std, d->p90, d->p99, d->min, d->max};
    json_t *block = json_object();
    char key[64];
    for (size_t i = 0; i < 7; i++) {
        snprintf(key, sizeof(key), "%s_%s_ms", stat[i], name);
        json_object_set_new(res, key, bench_num(v[i]));
        json_object_set_new(block, stat[i], bench_num(v[i]));
    }
    json_object_set_new(block, "n", json_integer((json_int_t)d->n));
    snprintf(key, sizeof(key), "%s_ms", name);
    json_object_set_new(res, key, block);
}

/*
 * Speculative decoding over the run: mean tokens per verify step from the histogram's count and
 * sum deltas, acceptance per draft position (positions both scrapes have and the run drafted at)
 * and over all positions.
 */
static void bench_put_spec(json_t *res, double d_steps, double d_emitted,
                           const bench_scrape_t *before, const bench_scrape_t *after)
{
    json_object_set_new(res, "spec_mean_step_tokens",
                        bench_num(d_steps > 0 ? d_emitted / d_steps : NAN));
    const int n =
        before->n_positions < after->n_positions ? before->n_positions : after->n_positions;
    double drafted = 0, accepted = 0;
    json_t *pos = json_array();
    for (int j = 0; j < n; j++) {
        const double dd = after->drafted[j] - before->drafted[j],
                     da = after->accepted[j] - before->accepted[j];
        if (!(dd > 0))
            continue;
        drafted += dd;
        accepted += da;
        json_array_append_new(pos, json_pack("{s:i, s:o, s:o, s:o}", "position", j + 1, "drafted",
                                             bench_num(dd), "accepted", bench_num(da),
                                             "acceptance_rate", bench_num(da / dd)));
    }
    json_object_set_new(res, "spec_acceptance_rate",
                        bench_num(drafted > 0 ? accepted / drafted : NAN));
    json_object_set_new(res, "spec_positions", pos);
}

typedef struct {
    const char *reason;
    size_t count;
} bench_reason_t;

static json_t *bench_results_json(const bench_run_t *run, const char *model,
                                  const serving_summary_t *s, const bench_scrape_t *before,
                                  const bench_scrape_t *after)
{
    const bench_opts_t *o = run->o;
    json_t *res = json_object();
    json_object_set_new(res, "completed", json_integer((json_int_t)s->completed));
    json_object_set_new(res, "failed", json_integer((json_int_t)s->failed));
    json_object_set_new(res, "error_rate", bench_num(s->error_rate));
    json_object_set_new(res, "duration_s", bench_num(s->duration_s));
    json_object_set_new(res, "total_input_tokens", json_integer((json_int_t)s->total_input_tokens));
    json_object_set_new(res, "total_output_tokens",
                        json_integer((json_int_t)s->total_output_tokens));
    json_object_set_new(res, "request_throughput", bench_num(s->request_throughput));
    json_object_set_new(res, "output_throughput", bench_num(s->output_throughput));
    json_object_set_new(res, "total_token_throughput", bench_num(s->total_token_throughput));
    json_object_set_new(res, "user_throughput", bench_num(s->user_throughput));
    json_object_set_new(res, "goodput", bench_num(s->goodput));
    if (s->has_goodput)
        json_object_set_new(res, "good_requests", json_integer((json_int_t)s->good));
    bench_put_dist(res, "ttft", &s->ttft);
    bench_put_dist(res, "tpot", &s->tpot);
    bench_put_dist(res, "itl", &s->itl);
    bench_put_dist(res, "e2el", &s->e2el);

    /* server-side counters: deltas, null when absent in either scrape */
    double d[BENCH_N_COUNTERS];
    json_t *srv = json_object();
    for (int i = 0; i < BENCH_N_COUNTERS; i++) {
        bool have = before->found[i] && after->found[i];
        d[i] = have ? after->value[i] - before->value[i] : NAN;
        json_object_set_new(srv, bench_server_counters[i], bench_num(d[i]));
    }
    json_object_set_new(srv, "scraped", json_boolean(before->ok && after->ok));
    json_object_set_new(res, "server_metrics_delta", srv);
    double per_iter = d[1] > 0 ? d[2] / d[1] : NAN;
    double step_ms = d[0] > 0 ? 1000.0 * d[3] / d[0] : NAN;
    json_object_set_new(res, "avg_decoded_tokens_per_iter", bench_num(per_iter));
    json_object_set_new(res, "device_step_time_ms", bench_num(step_ms));
    bench_put_spec(res, d[4], d[5], before, after);
    /* prefix caches: null when the workers looked nothing up (cache.prefix off) */
    const bool prefix = d[6] > 0;
    json_object_set_new(res, "prefix_hit_rate", bench_num(prefix ? d[7] / d[6] : NAN));
    json_object_set_new(res, "prefix_tokens_saved", bench_num(prefix ? d[8] : NAN));
    json_object_set_new(res, "prefix_evictions", bench_num(prefix ? d[9] : NAN));
    json_object_set_new(res, "prefix_cache_pages",
                        bench_num(prefix && after->found_prefix ? after->prefix_pages : NAN));
    json_object_set_new(res, "prefix_cache_entries",
                        bench_num(prefix && after->found_prefix ? after->prefix_entries : NAN));

    /* the distinct failure reasons with counts */
    bench_reason_t reasons[BENCH_MAX_REASONS];
    size_t n_reasons = 0;
    for (size_t i = 0; i < run->n; i++) {
        const bench_req_t *r = &run->reqs[i];
        if (r->ok)
            continue;
        size_t k = 0;
        while (k < n_reasons && strcmp(reasons[k].reason, r->error) != 0)
            k++;
        if (k < n_reasons)
            reasons[k].count++;
        else if (n_reasons < BENCH_MAX_REASONS)
            reasons[n_reasons++] = (bench_reason_t){r->error, 1};
    }
    json_t *errs = json_array();
    for (size_t k = 0; k < n_reasons; k++)
        json_array_append_new(errs, json_pack("{s:s, s:I}", "reason", reasons[k].reason, "count",
                                              (json_int_t)reasons[k].count));
    json_object_set_new(res, "errors", errs);

    /* configuration */
    char date[64];
    time_t t = time(NULL);
    struct tm tm;
    gmtime_r(&t, &tm);
    strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", &tm);
    json_t *cfg = json_object();
    json_object_set_new(cfg, "url", json_string(o->url));
    json_object_set_new(cfg, "model", json_string(model));
    json_object_set_new(cfg, "endpoint",
                        json_string(o->endpoint == BENCH_EP_CHAT ? "chat" : "completions"));
    json_object_set_new(cfg, "concurrency",
                        o->concurrency > 0 ? json_integer(o->concurrency) : json_null());
    json_object_set_new(cfg, "request_rate",
                        o->request_rate == 0     ? json_null()
                        : isinf(o->request_rate) ? json_string("inf")
                                                 : json_real(o->request_rate));
    json_object_set_new(cfg, "num_prompts", json_integer(o->num_prompts));
    json_object_set_new(cfg, "max_tokens", json_integer(o->max_tokens));
    json_object_set_new(cfg, "ignore_eos", json_boolean(o->ignore_eos));
    json_object_set_new(cfg, "temperature", json_real(o->temperature));
    json_object_set_new(cfg, "prompts",
                        o->prompts_file != NULL ? json_string(o->prompts_file) : json_null());
    json_object_set_new(cfg, "prompt_chars_max",
                        o->prompt_chars_max > 0 ? json_integer(o->prompt_chars_max) : json_null());
    json_object_set_new(cfg, "random_prompt_len",
                        o->prompts_file == NULL ? json_integer(o->random_prompt_len) : json_null());
    json_object_set_new(cfg, "seed", json_integer((json_int_t)o->seed));
    json_object_set_new(cfg, "timeout_s", json_real(o->timeout_s));
    json_object_set_new(
        cfg, "goodput_slo_ms",
        json_pack("{s:o, s:o, s:o}", "ttft",
                  o->slo.ttft_ms > 0 ? json_real(o->slo.ttft_ms) : json_null(), "tpot",
                  o->slo.tpot_ms > 0 ? json_real(o->slo.tpot_ms) : json_null(), "e2el",
                  o->slo.e2el_ms > 0 ? json_real(o->slo.e2el_ms) : json_null()));
    json_object_set_new(cfg, "metrics_settle_ms", json_integer(o->settle_ms));
    json_object_set_new(cfg, "date", json_string(date));
    json_object_set_new(res, "config", cfg);
    return res;
}

static void bench_row_f(const char *label, double v, int prec)
{
    if (isfinite(v))
        printf("%-40s %.*f\n", label, prec, v);
    else
        printf("%-40s %s\n", label, "n/a");
}

static void bench_print_dist(const char *title, const char *tag, const serving_dist_t *d)
{
    char line[64], label[64];
    snprintf(line, sizeof(line), "%s", title);
    printf("%s\n", line);
    static const char *const names[] = {"Mean", "Median", "Std", "P90", "P99", "Min", "Max"};
    double v[] = {d->mean, d->median, d->std, d->p90, d->p99, d->min, d->max};
    for (size_t i = 0; i < 7; i++) {
        snprintf(label, sizeof(label), "%s %s (ms):", names[i], tag);
        bench_row_f(label, v[i], 2);
    }
}

static void bench_print(const json_t *res, const serving_summary_t *s)
{
    printf("============ Serving Benchmark Result ============\n");
    printf("%-40s %zu\n", "Successful requests:", s->completed);
    printf("%-40s %zu\n", "Failed requests:", s->failed);
    bench_row_f("Error rate:", s->error_rate, 4);
    bench_row_f("Benchmark duration (s):", s->duration_s, 2);
    printf("%-40s %llu\n", "Total input tokens:", (unsigned long long)s->total_input_tokens);
    printf("%-40s %llu\n", "Total generated tokens:", (unsigned long long)s->total_output_tokens);
    bench_row_f("Request throughput (req/s):", s->request_throughput, 2);
    bench_row_f("Output token throughput (tok/s):", s->output_throughput, 2);
    bench_row_f("Total Token throughput (tok/s):", s->total_token_throughput, 2);
    bench_row_f("User throughput (tok/s per request):", s->user_throughput, 2);
    if (s->has_goodput)
        bench_row_f("Request goodput (req/s):", s->goodput, 2);
    bench_print_dist("---------------Time to First Token----------------", "TTFT", &s->ttft);
    bench_print_dist("-----Time per Output Token (excl. 1st token)------", "TPOT", &s->tpot);
    bench_print_dist("---------------Inter-token Latency----------------", "ITL", &s->itl);
    bench_print_dist("----------------End-to-end Latency----------------", "E2EL", &s->e2el);
    printf("--------Server side (router /metrics deltas)------\n");
    json_t *srv = json_object_get(res, "server_metrics_delta");
    for (int i = 0; i < BENCH_N_COUNTERS; i++) {
        char label[64];
        snprintf(label, sizeof(label), "%s:", bench_server_counters[i]);
        json_t *v = json_object_get(srv, bench_server_counters[i]);
        bench_row_f(label, json_is_number(v) ? json_number_value(v) : NAN, 3);
    }
    json_t *v = json_object_get(res, "avg_decoded_tokens_per_iter");
    bench_row_f("Avg decoded tokens per iteration:", json_is_number(v) ? json_number_value(v) : NAN,
                3);
    v = json_object_get(res, "device_step_time_ms");
    bench_row_f("Device step time (ms):", json_is_number(v) ? json_number_value(v) : NAN, 3);
    v = json_object_get(res, "prefix_hit_rate");
    if (json_is_number(v)) {
        bench_row_f("Prefix cache hit rate:", json_number_value(v), 3);
        static const char *const rows[][2] = {
            {"prefix_tokens_saved", "Prefix cache tokens saved:"},
            {"prefix_evictions", "Prefix cache evictions:"},
            {"prefix_cache_entries", "Prefix cache entries (end):"},
            {"prefix_cache_pages", "Prefix cache pages (end):"}};
        for (size_t k = 0; k < sizeof(rows) / sizeof(rows[0]); k++) {
            json_t *x = json_object_get(res, rows[k][0]);
            bench_row_f(rows[k][1], json_is_number(x) ? json_number_value(x) : NAN, 0);
        }
    }
    json_t *pos = json_object_get(res, "spec_positions");
    if (json_array_size(pos) > 0) {
        v = json_object_get(res, "spec_mean_step_tokens");
        bench_row_f("Spec tokens per verify step:", json_is_number(v) ? json_number_value(v) : NAN,
                    3);
        v = json_object_get(res, "spec_acceptance_rate");
        bench_row_f("Spec acceptance rate:", json_is_number(v) ? json_number_value(v) : NAN, 3);
        size_t i;
        json_t *p;
        json_array_foreach(pos, i, p)
        {
            char label[64];
            snprintf(label, sizeof(label), "  at draft position %lld (%.0f/%.0f):",
                     (long long)json_integer_value(json_object_get(p, "position")),
                     json_number_value(json_object_get(p, "accepted")),
                     json_number_value(json_object_get(p, "drafted")));
            bench_row_f(label, json_number_value(json_object_get(p, "acceptance_rate")), 3);
        }
    }
    json_t *errs = json_object_get(res, "errors");
    if (json_array_size(errs) > 0) {
        printf("---------------------Failures---------------------\n");
        size_t i;
        json_t *e;
        json_array_foreach(errs, i, e)
        {
            printf("%6lld x %s\n", (long long)json_integer_value(json_object_get(e, "count")),
                   json_string_value(json_object_get(e, "reason")));
        }
    }
    printf("==================================================\n");
}

/* ---------------------------------------------------------------- vLLM's --save-result */

/*
 * The run in the shape vLLM's benchmark_serving.py (benchmarks/serve.py) writes with
 * --save-result --save-detailed: date ("%Y%m%d-%H%M%S", local time), backend, model_id,
 * tokenizer_id (the model name: duet-bench has no tokenizer), num_prompts, request_rate ("inf"
 * for a closed loop, as vLLM's --max-concurrency runs say), burstiness (1: Poisson),
 * max_concurrency, the summary numbers and the per-request arrays in request order. A failed
 * request has input and output length 0, ttft 0, no itls, "" text and its reason in errors, as
 * vLLM's RequestFuncOutput defaults give. Latency statistics: mean, median, std, p90, p99 of
 * ttft, tpot, itl, e2el in ms (the same values as --json).
 */
static json_t *bench_vllm_result(const bench_run_t *run, const char *model,
                                 const serving_summary_t *s)
{
    const bench_opts_t *o = run->o;
    char date[32];
    time_t t = time(NULL);
    struct tm tm;
    localtime_r(&t, &tm);
    strftime(date, sizeof(date), "%Y%m%d-%H%M%S", &tm);
    json_t *r = json_object();
    json_object_set_new(r, "date", json_string(date));
    json_object_set_new(r, "backend",
                        json_string(o->endpoint == BENCH_EP_CHAT ? "openai-chat" : "openai"));
    json_object_set_new(r, "model_id", json_string(model));
    json_object_set_new(r, "tokenizer_id", json_string(model));
    json_object_set_new(r, "num_prompts", json_integer(o->num_prompts));
    json_object_set_new(r, "request_rate",
                        o->request_rate > 0 && isfinite(o->request_rate)
                            ? json_real(o->request_rate)
                            : json_string("inf"));
    json_object_set_new(r, "burstiness", json_real(1.0));
    json_object_set_new(r, "max_concurrency",
                        o->concurrency > 0 ? json_integer(o->concurrency) : json_null());
    json_object_set_new(r, "duration", bench_num(s->duration_s));
    json_object_set_new(r, "completed", json_integer((json_int_t)s->completed));
    json_object_set_new(r, "total_input_tokens", json_integer((json_int_t)s->total_input_tokens));
    json_object_set_new(r, "total_output_tokens", json_integer((json_int_t)s->total_output_tokens));
    json_object_set_new(r, "request_throughput", bench_num(s->request_throughput));
    json_object_set_new(r, "request_goodput", s->has_goodput ? bench_num(s->goodput) : json_null());
    json_object_set_new(r, "output_throughput", bench_num(s->output_throughput));
    json_object_set_new(r, "total_token_throughput", bench_num(s->total_token_throughput));

    json_t *in = json_array(), *out = json_array(), *ttfts = json_array(), *itls = json_array(),
           *texts = json_array(), *errs = json_array();
    for (size_t i = 0; i < run->n; i++) {
        const bench_req_t *q = &run->reqs[i];
        const serving_stream_t *st = &q->stream;
        json_t *itl = json_array();
        if (q->ok) {
            json_array_append_new(in, json_integer(st->usage_prompt_tokens));
            json_array_append_new(
                out, json_integer(st->has_usage ? st->usage_completion_tokens : st->n_text_chunks));
            json_array_append_new(ttfts,
                                  json_real((double)(st->first_text_ns - q->t_send_ns) / 1e9));
            for (size_t k = 0; k < st->n_itl; k++)
                json_array_append_new(itl, json_real(st->itl_ms[k] / 1e3));
            json_t *text = json_stringn(st->text != NULL ? st->text : "", st->text_len);
            json_array_append_new(texts, text != NULL ? text : json_string(""));
            json_array_append_new(errs, json_string(""));
        } else {
            json_array_append_new(in, json_integer(0));
            json_array_append_new(out, json_integer(0));
            json_array_append_new(ttfts, json_real(0.0));
            json_array_append_new(texts, json_string(""));
            json_t *why = json_string(q->error);
            json_array_append_new(errs, why != NULL ? why : json_string("(not UTF-8)"));
        }
        json_array_append_new(itls, itl);
    }
    json_object_set_new(r, "input_lens", in);
    json_object_set_new(r, "output_lens", out);
    json_object_set_new(r, "ttfts", ttfts);
    json_object_set_new(r, "itls", itls);
    json_object_set_new(r, "generated_texts", texts);
    json_object_set_new(r, "errors", errs);

    static const char *const names[] = {"ttft", "tpot", "itl", "e2el"};
    const serving_dist_t *d[] = {&s->ttft, &s->tpot, &s->itl, &s->e2el};
    for (size_t m = 0; m < 4; m++) {
        static const char *const stat[] = {"mean", "median", "std", "p90", "p99"};
        double v[] = {d[m]->mean, d[m]->median, d[m]->std, d[m]->p90, d[m]->p99};
        for (size_t k = 0; k < 5; k++) {
            char key[64];
            snprintf(key, sizeof(key), "%s_%s_ms", stat[k], names[m]);
            json_object_set_new(r, key, bench_num(v[k]));
        }
    }
    return r;
}

/* ---------------------------------------------------------------- sweeps */

/* A sweep value as text: "4", "2.5", "inf". */
static void bench_sweep_value_str(bench_sweep_t sw, double v, char *buf, size_t cap)
{
    if (isinf(v))
        snprintf(buf, cap, "inf");
    else if (sw == BENCH_SWEEP_CONC)
        snprintf(buf, cap, "%ld", (long)v);
    else
        snprintf(buf, cap, "%g", v);
}

/*
 * The file of one sweep run: "-PARAM-VALUE" inserted before path's extension (the last '.' of
 * its last component), or appended when it has none. malloc'd; NULL when out of memory.
 */
static char *bench_sweep_path(const char *path, bench_sweep_t sw, double v)
{
    char val[32];
    bench_sweep_value_str(sw, v, val, sizeof(val));
    const char *slash = strrchr(path, '/');
    const char *dot = strrchr(slash != NULL ? slash + 1 : path, '.');
    if (dot == NULL || dot == (slash != NULL ? slash + 1 : path))
        dot = path + strlen(path);
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    duet_strbuf_append(&sb, path, (size_t)(dot - path));
    duet_strbuf_printf(&sb, "-%s-%s%s", bench_sweep_names[sw], val, dot);
    if (duet_strbuf_status(&sb) != DUET_OK) {
        duet_strbuf_free(&sb);
        return NULL;
    }
    return duet_strbuf_detach(&sb);
}

/* The CSV columns after "sweep,value": keys of the results JSON. */
static const char *const bench_csv_keys[] = {
    "completed",      "failed",         "error_rate",    "request_throughput", "output_throughput",
    "mean_ttft_ms",   "median_ttft_ms", "p99_ttft_ms",   "mean_tpot_ms",       "median_tpot_ms",
    "p99_tpot_ms",    "mean_itl_ms",    "median_itl_ms", "p99_itl_ms",         "mean_e2el_ms",
    "median_e2el_ms", "p99_e2el_ms"};
#define BENCH_N_CSV (sizeof(bench_csv_keys) / sizeof(bench_csv_keys[0]))

static void bench_csv_header(FILE *f)
{
    fputs("sweep,value", f);
    for (size_t k = 0; k < BENCH_N_CSV; k++)
        fprintf(f, ",%s", bench_csv_keys[k]);
    fputc('\n', f);
}

/* One row: the swept parameter (for a single run: how its load was shaped) and its value. */
static void bench_csv_row(FILE *f, const char *param, const char *value, const json_t *res)
{
    fprintf(f, "%s,%s", param, value);
    for (size_t k = 0; k < BENCH_N_CSV; k++) {
        json_t *v = json_object_get(res, bench_csv_keys[k]);
        if (json_is_integer(v))
            fprintf(f, ",%lld", (long long)json_integer_value(v));
        else if (json_is_number(v))
            fprintf(f, ",%.6g", json_number_value(v));
        else
            fputc(',', f);
    }
    fputc('\n', f);
    fflush(f);
}

static double bench_get(const json_t *res, const char *key)
{
    json_t *v = json_object_get(res, key);
    return json_is_number(v) ? json_number_value(v) : NAN;
}

static void bench_sweep_table(const bench_opts_t *o, json_t *const *res)
{
    printf("================ Sweep: %s ================\n", bench_sweep_names[o->sweep]);
    printf("%-8s %9s %7s %9s %10s %10s %10s %10s %10s\n", "value", "completed", "errors", "req/s",
           "out tok/s", "med TTFT", "med TPOT", "med ITL", "p99 E2EL");
    for (size_t i = 0; i < o->n_sweep; i++) {
        char val[32];
        bench_sweep_value_str(o->sweep, o->sweep_values[i], val, sizeof(val));
        if (res[i] == NULL) {
            printf("%-8s (no result)\n", val);
            continue;
        }
        printf("%-8s %9.0f %7.4f %9.2f %10.2f %10.2f %10.2f %10.2f %10.2f\n", val,
               bench_get(res[i], "completed"), bench_get(res[i], "error_rate"),
               bench_get(res[i], "request_throughput"), bench_get(res[i], "output_throughput"),
               bench_get(res[i], "median_ttft_ms"), bench_get(res[i], "median_tpot_ms"),
               bench_get(res[i], "median_itl_ms"), bench_get(res[i], "p99_e2el_ms"));
    }
    printf("(latencies in ms)\n");
}

/* ---------------------------------------------------------------- one run */

/* What every run of an invocation shares. */
typedef struct {
    uv_loop_t *loop;
    struct sockaddr_storage addr;
    const char *model;
    char *const *bodies; /* request bodies, one per distinct prompt used */
    size_t n_prompts;    /* request i sends bodies[i % n_prompts] */
    const serving_gates_t *gates;
} bench_shared_t;

/* Write j to path; digits: significant digits of reals (17 round-trips a double exactly). */
static int bench_write_json(const json_t *j, const char *path, const char *what, int digits)
{
    if (json_dump_file(j, path, JSON_INDENT(2) | JSON_SORT_KEYS | JSON_REAL_PRECISION(digits)) !=
        0) {
        fprintf(stderr, "duet-bench: cannot write %s %s: %s\n", what, path, strerror(errno));
        return BENCH_EXIT_RUN;
    }
    return BENCH_EXIT_OK;
}

/*
 * One load run shaped by o: send, measure, print, check gates, write json_path / save_path
 * (either may be NULL). *res_p receives the results JSON (NULL when the run could not happen).
 * Returns 0, 1 (could not run, nothing completed, a file not written) or 3 (a gate failed).
 */
static int bench_measure(const bench_shared_t *sh, const bench_opts_t *o, const char *json_path,
                         const char *save_path, json_t **res_p)
{
    *res_p = NULL;
    int rc = BENCH_EXIT_RUN;
    bench_run_t run = {.o = o, .loop = sh->loop, .addr = sh->addr};
    run.n = (size_t)o->num_prompts;
    run.path = o->endpoint == BENCH_EP_CHAT ? "/v1/chat/completions" : "/v1/completions";
    run.reqs = calloc(run.n, sizeof(*run.reqs));
    serving_record_t *recs = calloc(run.n, sizeof(*recs));
    json_t *res = NULL;
    if (run.reqs == NULL || recs == NULL) {
        fprintf(stderr, "duet-bench: out of memory\n");
        goto out;
    }
    for (size_t i = 0; i < run.n; i++) {
        run.reqs[i].run = &run;
        run.reqs[i].body = sh->bodies[i % sh->n_prompts];
        run.reqs[i].body_len = strlen(run.reqs[i].body);
        serving_stream_init(&run.reqs[i].stream);
    }
    if (o->request_rate > 0) {
        run.arrival_ns = bench_arrivals(run.n, o->request_rate, o->seed);
        if (run.arrival_ns == NULL) {
            fprintf(stderr, "duet-bench: out of memory\n");
            goto out;
        }
        run.cap = o->concurrency > 0 ? (size_t)o->concurrency : run.n;
    } else {
        run.cap = (size_t)o->concurrency;
    }

    bench_scrape_t before, after;
    bench_scrape(&run, &before);
    if (!o->quiet)
        fprintf(stderr, "duet-bench: %s model %s, %zu requests, %s, max_tokens %ld%s\n", o->url,
                sh->model, run.n, o->request_rate > 0 ? "Poisson arrivals" : "closed loop",
                o->max_tokens, before.ok ? "" : " (no /metrics: server-side metrics will be null)");

    uv_timer_init(run.loop, &run.tick);
    uv_timer_init(run.loop, &run.arrive);
    run.tick.data = &run;
    run.arrive.data = &run;
    run.t0_ns = run.last_progress_ns = uv_hrtime();
    uv_timer_start(&run.tick, bench_on_tick, BENCH_TICK_MS, BENCH_TICK_MS);
    bench_pump(&run);
    uv_run(run.loop, UV_RUN_DEFAULT);

    if (o->settle_ms > 0)
        usleep((useconds_t)o->settle_ms * 1000);
    bench_scrape(&run, &after);

    /* records for the stats module */
    for (size_t i = 0; i < run.n; i++) {
        const bench_req_t *r = &run.reqs[i];
        serving_record_t *c = &recs[i];
        c->ok = r->ok;
        if (!r->ok)
            continue;
        c->ttft_ms = (double)(r->stream.first_text_ns - r->t_send_ns) / 1e6;
        c->e2el_ms = (double)(r->t_last_ns - r->t_send_ns) / 1e6;
        c->prompt_tokens = r->stream.usage_prompt_tokens;
        c->output_tokens =
            r->stream.has_usage ? r->stream.usage_completion_tokens : r->stream.n_text_chunks;
        c->itl_ms = r->stream.itl_ms;
        c->n_itl = r->stream.n_itl;
    }
    double duration = (double)(run.t_end_ns - run.t0_ns) / 1e9;
    serving_summary_t sum;
    if (serving_summarize(recs, run.n, duration > 0 ? duration : 1e-9, &o->slo, &sum) != DUET_OK) {
        fprintf(stderr, "duet-bench: %s\n", duet_error_last());
        goto out;
    }
    res = bench_results_json(&run, sh->model, &sum, &before, &after);
    bench_print(res, &sum);

    rc = sum.completed > 0 ? BENCH_EXIT_OK : BENCH_EXIT_RUN;
    if (sum.completed == 0)
        fprintf(stderr, "duet-bench: no request completed\n");
    const serving_gates_t *gates = sh->gates;
    if (gates->n > 0) {
        duet_strbuf_t report;
        duet_strbuf_init(&report);
        size_t failed = serving_gates_check(gates, res, &report);
        printf("--------------- Perf gates (%s) ---------------\n%s", o->baseline_path,
               report.data != NULL ? report.data : "");
        printf("gates: %zu of %zu failed\n", failed, gates->n);
        json_t *gj = json_array();
        for (size_t i = 0; i < gates->n; i++) {
            char why[128];
            double v;
            bool pass = serving_gate_eval(&gates->gates[i], res, &v, why, sizeof(why));
            json_array_append_new(gj, json_pack("{s:s, s:o, s:b, s:s}", "metric",
                                                gates->gates[i].metric, "value", bench_num(v),
                                                "pass", pass, "reason", why));
        }
        json_object_set_new(res, "gates", gj);
        json_object_set_new(res, "gates_failed", json_integer((json_int_t)failed));
        duet_strbuf_free(&report);
        if (failed > 0)
            rc = BENCH_EXIT_GATE;
    }
    if (json_path != NULL && bench_write_json(res, json_path, "--json", 10) != BENCH_EXIT_OK &&
        rc == BENCH_EXIT_OK)
        rc = BENCH_EXIT_RUN;
    if (save_path != NULL) {
        json_t *v = bench_vllm_result(&run, sh->model, &sum);
        if (bench_write_json(v, save_path, "--save-result", 10) != BENCH_EXIT_OK &&
            rc == BENCH_EXIT_OK)
            rc = BENCH_EXIT_RUN;
        json_decref(v);
    }
    fflush(stdout);
    *res_p = res;
out:
    if (run.reqs != NULL)
        for (size_t i = 0; i < run.n; i++)
            serving_stream_free(&run.reqs[i].stream);
    free(run.reqs);
    free(run.arrival_ns);
    free(recs);
    return rc;
}

/*
 * Resolve --url and find the model (--model, else the first id of GET /v1/models), printing the
 * reason on failure. *model_p is malloc'd.
 */
static duet_status_t bench_connect(const bench_opts_t *o, uv_loop_t *loop,
                                   struct sockaddr_storage *addr, char **model_p)
{
    if (serving_http_resolve(loop, o->host, o->port, addr) != DUET_OK) {
        fprintf(stderr, "duet-bench: %s\n", duet_error_last());
        return DUET_ERR_TRANSPORT;
    }
    if (o->model != NULL) {
        *model_p = strdup(o->model);
        if (*model_p == NULL) {
            fprintf(stderr, "duet-bench: out of memory\n");
            return DUET_ERR_NOMEM;
        }
        return DUET_OK;
    }
    bench_run_t probe = {.o = o, .loop = loop, .addr = *addr};
    duet_status_t st = bench_find_model(&probe, model_p);
    if (st != DUET_OK)
        fprintf(stderr, "duet-bench: cannot find the model (pass --model): %s\n",
                duet_error_last());
    return st;
}

/* ---------------------------------------------------------------- accuracy */

/* --accuracy DATA with --accuracy-doc-bytes N: plain UTF-8 text cut into N-byte documents,
 * each cut moved back to a character boundary. */
static duet_status_t bench_docs_cut(const char *path, size_t n, bench_prompts_t *d)
{
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    duet_status_t st = duet_strbuf_read_file(&sb, path, BENCH_MAX_PROMPT_FILE);
    if (st != DUET_OK)
        return st;
    const char *t = sb.data != NULL ? sb.data : "";
    if (!duet_utf8_valid(t, sb.len) || memchr(t, '\0', sb.len) != NULL) {
        duet_strbuf_free(&sb);
        return duet_error_set(DUET_ERR_FORMAT, "%s: not UTF-8 text (or holds NUL bytes)", path);
    }
    size_t cap = 0;
    for (size_t at = 0; at < sb.len && st == DUET_OK;) {
        size_t end = sb.len - at > n ? at + n : sb.len;
        while (end > at + 1 && end < sb.len && ((unsigned char)t[end] & 0xC0) == 0x80)
            end--;
        char save = sb.data[end];
        sb.data[end] = '\0';
        st = bench_prompts_push(d, &cap, t + at);
        sb.data[end] = save;
        at = end;
    }
    duet_strbuf_free(&sb);
    if (st == DUET_OK && d->n == 0)
        st = duet_error_set(DUET_ERR_FORMAT, "%s: empty", path);
    if (st != DUET_OK)
        bench_prompts_free(d);
    return st;
}

/* "sha256:" + 64 hex digits of s (what a baseline's documents are matched by). */
static void bench_sha256_hex(const char *s, char out[72])
{
    uint8_t h[32];
    duet__sha256(s, strlen(s), h);
    memcpy(out, "sha256:", 7);
    for (int i = 0; i < 32; i++)
        snprintf(out + 7 + 2 * i, 3, "%02x", h[i]);
}

/*
 * Read an earlier --accuracy --json and check it scored the same documents (same sha256, same
 * order): its per-document bits per byte into *base_p (malloc'd, n). Exit code 2 with a message
 * on any mismatch or malformed file, else -1.
 */
static int bench_accuracy_baseline(const char *path, char (*hashes)[72], size_t n, double **base_p)
{
    json_t *root = NULL;
    if (duet_json_load_file(path, 256u << 20, &root) != DUET_OK) {
        fprintf(stderr, "duet-bench: --baseline: %s\n", duet_error_last());
        return BENCH_EXIT_USAGE;
    }
    int rc = BENCH_EXIT_USAGE;
    json_t *docs = json_object_get(json_object_get(root, "accuracy"), "per_document");
    double *base = NULL;
    if (!json_is_array(docs)) {
        fprintf(stderr,
                "duet-bench: --baseline %s: no accuracy.per_document array (not an "
                "--accuracy run's --json)\n",
                path);
        goto out;
    }
    if (json_array_size(docs) != n) {
        fprintf(stderr,
                "duet-bench: --baseline %s scored %zu documents, this run has %zu: refusing to "
                "compare different document sets\n",
                path, json_array_size(docs), n);
        goto out;
    }
    base = calloc(n, sizeof(*base));
    if (base == NULL) {
        fprintf(stderr, "duet-bench: out of memory\n");
        rc = BENCH_EXIT_RUN;
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *d = json_array_get(docs, i);
        const char *h = json_string_value(json_object_get(d, "sha256"));
        json_t *b = json_object_get(d, "bits_per_byte");
        if (h == NULL || !json_is_number(b) || !isfinite(json_number_value(b))) {
            fprintf(stderr,
                    "duet-bench: --baseline %s: per_document[%zu] needs a sha256 string and a "
                    "bits_per_byte number\n",
                    path, i);
            goto out;
        }
        if (strcmp(h, hashes[i]) != 0) {
            fprintf(stderr,
                    "duet-bench: --baseline %s: document %zu differs (%s there, %s here): "
                    "refusing to compare different document sets\n",
                    path, i + 1, h, hashes[i]);
            goto out;
        }
        base[i] = json_number_value(b);
    }
    *base_p = base;
    base = NULL;
    rc = -1;
out:
    free(base);
    json_decref(root);
    return rc;
}

/* One document through POST /v1/completions with echo: its score, or an error with detail. */
static duet_status_t bench_accuracy_doc(uv_loop_t *loop, const struct sockaddr *addr,
                                        const bench_opts_t *o, const char *model, const char *doc,
                                        serving_doc_score_t *sc)
{
    json_t *b = json_object();
    json_object_set_new(b, "model", json_string(model));
    json_t *text = json_string(doc);
    if (text == NULL) {
        json_decref(b);
        return duet_error_set(DUET_ERR_FORMAT, "not valid UTF-8");
    }
    json_object_set_new(b, "prompt", text);
    json_object_set_new(b, "max_tokens", json_integer(0));
    json_object_set_new(b, "echo", json_true());
    /* 1, not 0: a server testing `if logprobs:` would read 0 as "none"; top_logprobs is unused */
    json_object_set_new(b, "logprobs", json_integer(1));
    json_object_set_new(b, "temperature", json_real(0));
    char *body = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    if (body == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "request body");
    duet_strbuf_t resp;
    duet_strbuf_init(&resp);
    int status = 0;
    duet_status_t st =
        serving_http_fetch(loop, addr, o->host, "POST", "/v1/completions", body, strlen(body),
                           (uint64_t)(o->timeout_s * 1000), &status, &resp);
    free(body);
    if (st == DUET_OK && status != 200)
        st = duet_error_set(DUET_ERR_TRANSPORT, "HTTP %d: %.200s", status,
                            resp.data != NULL ? resp.data : "");
    json_t *root = NULL;
    if (st == DUET_OK)
        st = duet_json_load_buffer(resp.data != NULL ? resp.data : "", resp.len, "the answer",
                                   64u << 20, &root);
    if (st == DUET_OK)
        st = serving_score_echo(root, doc, strlen(doc), sc);
    json_decref(root);
    duet_strbuf_free(&resp);
    return st;
}

/*
 * --accuracy: load the documents (and the baseline, checked against them) before any request,
 * score each document in order, print, compare, write --json. Exit 0, 1 (a document could not
 * be scored: no partial result), 2 (usage, different document sets) or 3 (accuracy dropped).
 */
static int bench_accuracy(const bench_opts_t *o)
{
    bench_prompts_t docs = {0};
    char(*hashes)[72] = NULL;
    double *base = NULL, *bpb = NULL;
    serving_doc_score_t *sc = NULL;
    char *model = NULL;
    json_t *res = NULL;
    uv_loop_t *loop = NULL;
    int rc = BENCH_EXIT_USAGE;
    static const char *const keys[] = {"text"};
    duet_status_t st = o->accuracy_doc_bytes > 0
                           ? bench_docs_cut(o->accuracy_path, (size_t)o->accuracy_doc_bytes, &docs)
                           : bench_jsonl_load(o->accuracy_path, keys, 1, "\"text\"", &docs);
    if (st != DUET_OK) {
        fprintf(stderr, "duet-bench: --accuracy: %s\n", duet_error_last());
        goto out;
    }
    rc = BENCH_EXIT_RUN;
    hashes = calloc(docs.n, sizeof(*hashes));
    bpb = calloc(docs.n, sizeof(*bpb));
    sc = calloc(docs.n, sizeof(*sc));
    if (hashes == NULL || bpb == NULL || sc == NULL) {
        fprintf(stderr, "duet-bench: out of memory\n");
        goto out;
    }
    for (size_t i = 0; i < docs.n; i++)
        bench_sha256_hex(docs.v[i], hashes[i]);
    if (o->baseline_path != NULL &&
        (rc = bench_accuracy_baseline(o->baseline_path, hashes, docs.n, &base)) >= 0)
        goto out;
    rc = BENCH_EXIT_RUN;
    struct sockaddr_storage addr;
    loop = uv_default_loop();
    if (bench_connect(o, loop, &addr, &model) != DUET_OK)
        goto out;
    if (!o->quiet)
        fprintf(stderr, "duet-bench: %s model %s, accuracy over %zu documents of %s\n", o->url,
                model, docs.n, o->accuracy_path);

    double sum_bpb = 0, sum_nats = 0;
    size_t bytes = 0, tokens = 0;
    uint64_t last = uv_hrtime();
    for (size_t i = 0; i < docs.n; i++) {
        if (bench_accuracy_doc(loop, (struct sockaddr *)&addr, o, model, docs.v[i], &sc[i]) !=
            DUET_OK) {
            fprintf(stderr, "duet-bench: --accuracy: document %zu: %s\n", i + 1, duet_error_last());
            goto out;
        }
        bpb[i] = sc[i].bits_per_byte;
        sum_bpb += bpb[i];
        sum_nats += sc[i].sum_logprob;
        bytes += sc[i].bytes_scored;
        tokens += sc[i].tokens_scored;
        uint64_t now = uv_hrtime();
        if (!o->quiet && (now - last >= (uint64_t)BENCH_PROGRESS_MS * 1000000 || i + 1 == docs.n)) {
            last = now;
            fprintf(stderr, "duet-bench: %zu/%zu documents, mean %.4f bits per byte\n", i + 1,
                    docs.n, sum_bpb / (double)(i + 1));
        }
    }
    double mean = sum_bpb / (double)docs.n, pooled = -sum_nats / M_LN2 / (double)bytes;

    res = json_object();
    json_t *acc = json_object(), *per = json_array();
    for (size_t i = 0; i < docs.n; i++)
        json_array_append_new(per, json_pack("{s:I, s:s, s:I, s:I, s:I, s:f, s:f}", "index",
                                             (json_int_t)i, "sha256", hashes[i], "bytes",
                                             (json_int_t)strlen(docs.v[i]), "bytes_scored",
                                             (json_int_t)sc[i].bytes_scored, "tokens_scored",
                                             (json_int_t)sc[i].tokens_scored, "sum_logprob",
                                             sc[i].sum_logprob, "bits_per_byte", bpb[i]));
    json_object_set_new(acc, "documents", json_integer((json_int_t)docs.n));
    json_object_set_new(acc, "mean_bits_per_byte", json_real(mean));
    json_object_set_new(acc, "pooled_bits_per_byte", json_real(pooled));
    json_object_set_new(acc, "bytes_scored", json_integer((json_int_t)bytes));
    json_object_set_new(acc, "tokens_scored", json_integer((json_int_t)tokens));
    json_object_set_new(acc, "per_document", per);
    json_object_set_new(res, "accuracy", acc);
    printf("============ Accuracy (bits per byte) ============\n");
    printf("%-40s %zu\n", "Documents:", docs.n);
    printf("%-40s %zu\n", "Bytes scored:", bytes);
    printf("%-40s %zu\n", "Tokens scored:", tokens);
    printf("%-40s %.6f\n", "Mean bits per byte (per document):", mean);
    printf("%-40s %.6f\n", "Bits per byte (all bytes pooled):", pooled);

    rc = BENCH_EXIT_OK;
    if (base != NULL) {
        serving_paired_t t;
        if (serving_paired_ttest(bpb, base, docs.n, o->accuracy_alpha, &t) != DUET_OK) {
            fprintf(stderr, "duet-bench: --baseline: %s\n", duet_error_last());
            rc = BENCH_EXIT_USAGE;
            goto out;
        }
        printf("---------- vs baseline (paired t-test) -----------\n");
        printf("%-40s %s\n", "Baseline:", o->baseline_path);
        printf("%-40s %+.6f\n", "Mean difference (run - baseline):", t.mean_diff);
        printf("%-40s %.6f\n", "Std of the differences (n - 1):", t.sd_diff);
        printf("%-40s %.4f (df %.0f)\n", "t statistic:", t.t, t.df);
        printf("%-40s %.3g\n", "p, one-sided (H1: bits per byte rose):", t.p);
        printf("accuracy %s at alpha %g\n", t.dropped ? "DROPPED" : "did not drop",
               o->accuracy_alpha);
        json_object_set_new(res, "comparison",
                            json_pack("{s:s, s:s, s:I, s:f, s:f, s:o, s:f, s:f, s:f, s:b}",
                                      "baseline", o->baseline_path, "test",
                                      "paired t, one-sided (bits per byte rose)", "n",
                                      (json_int_t)t.n, "mean_diff", t.mean_diff, "sd_diff",
                                      t.sd_diff, "t", bench_num(t.t), "df", t.df, "p", t.p, "alpha",
                                      o->accuracy_alpha, "dropped", t.dropped));
        if (t.dropped)
            rc = BENCH_EXIT_GATE;
    }
    printf("==================================================\n");
    json_object_set_new(
        res, "config",
        json_pack("{s:s, s:s, s:s, s:o, s:f}", "url", o->url, "model", model, "data",
                  o->accuracy_path, "doc_bytes",
                  o->accuracy_doc_bytes > 0 ? json_integer(o->accuracy_doc_bytes) : json_null(),
                  "alpha", o->accuracy_alpha));
    /* every digit: a later run compares its per-document values with these */
    if (o->json_path != NULL &&
        bench_write_json(res, o->json_path, "--json", 17) != BENCH_EXIT_OK && rc == BENCH_EXIT_OK)
        rc = BENCH_EXIT_RUN;
    fflush(stdout);
out:
    if (loop != NULL) {
        uv_run(loop, UV_RUN_NOWAIT);
        uv_loop_close(loop);
    }
    json_decref(res);
    free(model);
    free(hashes);
    free(base);
    free(bpb);
    free(sc);
    bench_prompts_free(&docs);
    return rc;
}

/* ---------------------------------------------------------------- main */

/*
 * Load and validate the baseline before any load is sent: a gates file, or an earlier run's
 * results with o's tolerances. Exit code on failure, else -1.
 */
static int bench_load_baseline(const bench_opts_t *o, serving_gates_t *g)
{
    const char *path = o->baseline_path;
    json_t *root = NULL;
    duet_status_t st = duet_json_load_file(path, 16u << 20, &root);
    if (st == DUET_OK) {
        if (serving_gates_is_run(root))
            st = serving_gates_from_run(root, path, o->tols, o->n_tols, g);
        else if (o->n_tols > 0)
            st = duet_error_set(DUET_ERR_INVALID,
                                "%s is a gates file: --tolerance applies to an earlier run's "
                                "--json output",
                                path);
        else
            st = serving_gates_parse(root, path, g);
        json_decref(root);
    }
    if (st != DUET_OK) {
        fprintf(stderr, "duet-bench: --baseline: %s\n", duet_error_last());
        return BENCH_EXIT_USAGE;
    }
    return -1;
}

/* Every run of the invocation (one, or one per --sweep value), the CSV and the sweep table. */
static int bench_runs(const bench_shared_t *sh, const bench_opts_t *o)
{
    FILE *csv = NULL;
    if (o->csv_path != NULL) {
        csv = fopen(o->csv_path, "w");
        if (csv == NULL) {
            fprintf(stderr, "duet-bench: cannot write --csv %s: %s\n", o->csv_path,
                    strerror(errno));
            return BENCH_EXIT_RUN;
        }
        bench_csv_header(csv);
    }
    int rc = BENCH_EXIT_OK;
    if (o->sweep == BENCH_SWEEP_NONE) {
        json_t *res = NULL;
        rc = bench_measure(sh, o, o->json_path, o->save_result_path, &res);
        if (csv != NULL && res != NULL) {
            char val[32];
            bool rate = o->request_rate > 0;
            bench_sweep_value_str(rate ? BENCH_SWEEP_RATE : BENCH_SWEEP_CONC,
                                  rate ? o->request_rate : (double)o->concurrency, val,
                                  sizeof(val));
            bench_csv_row(csv, bench_sweep_names[rate ? BENCH_SWEEP_RATE : BENCH_SWEEP_CONC], val,
                          res);
        }
        json_decref(res);
    } else {
        json_t *res[BENCH_MAX_SWEEP] = {0};
        for (size_t i = 0; i < o->n_sweep; i++) {
            bench_opts_t ov = *o;
            if (o->sweep == BENCH_SWEEP_CONC)
                ov.concurrency = (long)o->sweep_values[i];
            else
                ov.request_rate = o->sweep_values[i];
            char val[32];
            bench_sweep_value_str(o->sweep, o->sweep_values[i], val, sizeof(val));
            printf("################ %s = %s ################\n", bench_sweep_names[o->sweep], val);
            char *jp = o->json_path != NULL
                           ? bench_sweep_path(o->json_path, o->sweep, o->sweep_values[i])
                           : NULL;
            char *sp = o->save_result_path != NULL
                           ? bench_sweep_path(o->save_result_path, o->sweep, o->sweep_values[i])
                           : NULL;
            int r = BENCH_EXIT_RUN;
            if ((o->json_path != NULL && jp == NULL) || (o->save_result_path != NULL && sp == NULL))
                fprintf(stderr, "duet-bench: out of memory\n");
            else
                r = bench_measure(sh, &ov, jp, sp, &res[i]);
            free(jp);
            free(sp);
            if (csv != NULL && res[i] != NULL)
                bench_csv_row(csv, bench_sweep_names[o->sweep], val, res[i]);
            if (r > rc) /* a failed gate (3) outranks a failed run (1), as in one run */
                rc = r;
        }
        bench_sweep_table(o, res);
        for (size_t i = 0; i < o->n_sweep; i++)
            json_decref(res[i]);
    }
    if (csv != NULL && fclose(csv) != 0) {
        fprintf(stderr, "duet-bench: cannot write --csv %s: %s\n", o->csv_path, strerror(errno));
        if (rc == BENCH_EXIT_OK)
            rc = BENCH_EXIT_RUN;
    }
    fflush(stdout);
    return rc;
}

int main(int argc, char **argv)
{
    bench_opts_t o;
    int rc = bench_parse_args(argc, argv, &o);
    if (rc >= 0)
        return rc;
    signal(SIGPIPE, SIG_IGN);
    if (o.accuracy_path != NULL)
        return bench_accuracy(&o);

    serving_gates_t gates = {0};
    bench_prompts_t prompts = {0};
    bench_shared_t sh = {.gates = &gates};
    char *model = NULL;
    char **bodies = NULL; /* (prompts.n) request bodies, one per distinct prompt */
    rc = BENCH_EXIT_RUN;

    if (o.baseline_path != NULL && (rc = bench_load_baseline(&o, &gates)) >= 0)
        goto out;
    rc = BENCH_EXIT_USAGE;
    duet_status_t st;
    if (o.prompts_file != NULL)
        st = bench_prompts_load(o.prompts_file, &prompts);
    else
        st = bench_prompts_random((size_t)o.num_prompts,
                                  o.random_prompt_len > 0 ? o.random_prompt_len : 32, o.seed,
                                  &prompts);
    if (st != DUET_OK) {
        fprintf(stderr, "duet-bench: prompts: %s\n", duet_error_last());
        goto out;
    }
    for (size_t i = 0; o.prompt_chars_max > 0 && i < prompts.n; i++)
        bench_truncate_utf8(prompts.v[i], (size_t)o.prompt_chars_max);

    rc = BENCH_EXIT_RUN;
    sh.loop = uv_default_loop();
    if (bench_connect(&o, sh.loop, &sh.addr, &model) != DUET_OK)
        goto out;
    sh.model = model;

    /* every request body, before the clock starts */
    bodies = calloc(prompts.n, sizeof(*bodies));
    if (bodies == NULL) {
        fprintf(stderr, "duet-bench: out of memory\n");
        goto out;
    }
    size_t n_bodies = (size_t)o.num_prompts < prompts.n ? (size_t)o.num_prompts : prompts.n;
    for (size_t i = 0; i < n_bodies; i++) {
        bodies[i] = bench_body(&o, model, prompts.v[i]);
        if (bodies[i] == NULL) {
            fprintf(stderr, "duet-bench: prompt %zu: not valid UTF-8 (or out of memory)\n", i + 1);
            goto out;
        }
    }
    sh.bodies = bodies;
    sh.n_prompts = prompts.n;
    rc = bench_runs(&sh, &o);

out:
    for (size_t i = 0; i < prompts.n && bodies != NULL; i++)
        free(bodies[i]);
    free(bodies);
    if (sh.loop != NULL) {
        uv_run(sh.loop, UV_RUN_NOWAIT);
        uv_loop_close(sh.loop);
    }
    free(model);
    bench_prompts_free(&prompts);
    serving_gates_free(&gates);
    return rc;
}
