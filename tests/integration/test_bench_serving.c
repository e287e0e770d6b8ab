/*
 * duet-bench against a real duet-router with duet-test-worker processes (a test tool: fake
 * deterministic tokens, the prompt ids reversed; --delay-ms before each token) on loopback.
 *
 * Checks the JSON of a closed-loop run (completed, failed, output tokens = usage counts, TTFT,
 * TPOT measured against the workers' 20 ms per-token delay), the exit codes of a failing (3) and
 * a passing (0) baseline, an earlier run as the baseline (relative gates, 3 and 0), a malformed
 * baseline (2, before any load), the chat endpoint with Poisson arrivals, a server that is not
 * there (every request fails with a reason, exit 1), --save-result (vLLM's keys, one entry per
 * request, the numbers of --json for the same run), a concurrency sweep and a request-rate sweep
 * (a file per value, the CSV's rows) and bench/plot_sweep.py's PNG of the CSV.
 *
 * The model folder is made per test (config.json + a byte tokenizer); the fingerprint is the
 * literal "test", which the workers present.
 */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define BENCH  DUET_BINARY_DIR "/bench/duet-bench"
#define ROUTER DUET_BINARY_DIR "/router/duet-router"
#define WORKER DUET_BINARY_DIR "/tests/tools/duet-test-worker"

#define DELAY_MS "20"

static char tdir[256];
static int port_http, port_workers, port_admin;
static pid_t procs[8];
static int n_procs;

static int pick_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(bind(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    socklen_t l = sizeof(a);
    getsockname(fd, (struct sockaddr *)&a, &l);
    close(fd);
    return ntohs(a.sin_port);
}

static void put_file(const char *name, const char *text)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", tdir, name);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f, "%s", path);
    fputs(text, f);
    fclose(f);
}

/* fork + exec argv with stdout and stderr appended to tdir/log. */
static pid_t launch(char *const argv[], const char *log)
{
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        char path[512];
        snprintf(path, sizeof(path), "%s/%s", tdir, log);
        int fd = open(path, O_WRONLY | O_CREAT | O_APPEND, 0644);
        dup2(fd, 1);
        dup2(fd, 2);
        execv(argv[0], argv);
        _exit(127);
    }
    return pid;
}

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Whether tdir/file contains `needle`, waiting up to `s` seconds. */
static bool file_has(const char *file, const char *needle, double s)
{
    char path[512], buf[8192];
    snprintf(path, sizeof(path), "%s/%s", tdir, file);
    double end = mono_s() + s;
    do {
        FILE *f = fopen(path, "r");
        if (f != NULL) {
            size_t n = fread(buf, 1, sizeof(buf) - 1, f);
            fclose(f);
            buf[n] = '\0';
            if (strstr(buf, needle) != NULL)
                return true;
        }
        usleep(20000);
    } while (mono_s() < end);
    return false;
}

/* Whether 127.0.0.1:port accepts a connection, trying for up to `s` seconds. */
static bool port_accepts(int port, double s)
{
    double end = mono_s() + s;
    do {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        int r = connect(fd, (struct sockaddr *)&a, sizeof(a));
        close(fd);
        if (r == 0)
            return true;
        usleep(20000);
    } while (mono_s() < end);
    return false;
}

static void cluster_start(void)
{
    char tmpl[] = "/tmp/duet-bench-test-XXXXXX";
    cr_assert_not_null(mkdtemp(tmpl));
    snprintf(tdir, sizeof(tdir), "%s", tmpl);
    put_file("config.json",
             "{\"bos_token_id\": 256, \"eos_token_id\": 257, \"model_max_length\": 4096}\n");
    put_file("duet_tokenizer.json",
             "{\"type\": \"byte\", \"specials\": [\"<|bos|>\", \"<|eos|>\"], \"add_bos\": true}\n");
    port_http = pick_port();
    port_workers = pick_port();
    port_admin = pick_port();
    char hp[16], wp[16], ap[16], rt[64];
    snprintf(hp, sizeof(hp), "%d", port_http);
    snprintf(wp, sizeof(wp), "%d", port_workers);
    snprintf(ap, sizeof(ap), "%d", port_admin);
    snprintf(rt, sizeof(rt), "127.0.0.1:%d", port_workers);
    char *router[] = {ROUTER, "--model",
                      tdir,   "--model.name",
                      "m",    "--model.fingerprint",
                      "test", "--http.port",
                      hp,     "--workers.port",
                      wp,     "--admin.port",
                      ap,     "--admin.insecure-no-token",
                      NULL};
    procs[n_procs++] = launch(router, "router.log");
    cr_assert(port_accepts(port_http, 5.0), "router did not come up (log %s/router.log)", tdir);
    static const char *roles[] = {"gen", "ctx"};
    for (int i = 0; i < 2; i++) {
        char name[16], ev[512];
        snprintf(name, sizeof(name), "%s-0", roles[i]);
        snprintf(ev, sizeof(ev), "%s/%s.events", tdir, name);
        char *w[] = {WORKER,
                     "--router",
                     rt,
                     "--role",
                     (char *)roles[i],
                     "--name",
                     name,
                     "--fingerprint",
                     "test",
                     "--events",
                     ev,
                     "--heartbeat-ms",
                     "100",
                     "--delay-ms",
                     DELAY_MS,
                     "--quiet",
                     NULL};
        char log[32];
        snprintf(log, sizeof(log), "%s.log", name);
        procs[n_procs++] = launch(w, log);
        snprintf(ev, sizeof(ev), "%s.events", name);
        cr_assert(file_has(ev, "registered", 5.0), "worker %s did not register", name);
    }
}

static void cluster_stop(void)
{
    for (int i = n_procs - 1; i >= 0; i--) {
        kill(procs[i], SIGTERM);
        int st;
        for (int k = 0; k < 100 && waitpid(procs[i], &st, WNOHANG) == 0; k++)
            usleep(20000);
        kill(procs[i], SIGKILL);
        waitpid(procs[i], &st, 0);
    }
    n_procs = 0;
    char cmd[300];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", tdir);
    if (getenv("DUET_KEEP_TEST_DIR") == NULL && system(cmd) != 0)
        cr_log_warn("could not remove %s", tdir);
}

/* Run duet-bench with up to 24 extra arguments; returns its exit code (-1 on a signal). */
static int run_bench(const char *log, const char *const *args)
{
    char url[64];
    snprintf(url, sizeof(url), "http://127.0.0.1:%d", port_http);
    char *argv[32] = {BENCH, "--url", url, "--quiet"};
    int n = 4;
    for (int i = 0; args[i] != NULL && n < 31; i++)
        argv[n++] = (char *)args[i];
    argv[n] = NULL;
    pid_t pid = launch(argv, log);
    int st;
    double end = mono_s() + 120;
    while (waitpid(pid, &st, WNOHANG) == 0) {
        if (mono_s() > end) {
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            cr_assert_fail("duet-bench did not finish in 120 s (log %s/%s)", tdir, log);
        }
        usleep(20000);
    }
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static json_t *load_json(const char *name)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", tdir, name);
    json_error_t e;
    json_t *j = json_load_file(path, 0, &e);
    cr_assert_not_null(j, "%s: %s", path, e.text);
    return j;
}

static double num(const json_t *j, const char *key)
{
    json_t *v = json_object_get(j, key);
    cr_assert(json_is_number(v), "%s is not a number", key);
    return json_number_value(v);
}

/* 16 distinct ASCII prompts, each longer than 8 tokens so 8 reversed tokens are plain text. */
static void write_prompts(void)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/prompts.jsonl", tdir);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    for (int i = 0; i < 16; i++)
        fprintf(f,
                "{\"question\": \"Question number %d: what is %d plus %d?\", \"answer\": \"x\"}\n",
                i, i, i + 1);
    fclose(f);
}

Test(bench_serving, closed_loop_json_tpot_and_gates, .timeout = 240)
{
    cluster_start();
    write_prompts();
    char prompts[512], out[512], pass[512], fail[512];
    snprintf(prompts, sizeof(prompts), "%s/prompts.jsonl", tdir);
    snprintf(out, sizeof(out), "%s/out.json", tdir);
    const char *args[] = {"--concurrency",
                          "4",
                          "--num-prompts",
                          "16",
                          "--max-tokens",
                          "8",
                          "--ignore-eos",
                          "--prompts",
                          prompts,
                          "--json",
                          out,
                          "--metrics-settle-ms",
                          "200",
                          "--goodput",
                          "ttft:5000",
                          "tpot:1000",
                          NULL};
    int rc = run_bench("bench1.log", args);
    cr_assert_eq(rc, 0, "exit %d (log %s/bench1.log)", rc, tdir);

    json_t *j = load_json("out.json");
    cr_assert_eq(num(j, "completed"), 16);
    cr_assert_eq(num(j, "failed"), 0);
    cr_assert_eq(num(j, "error_rate"), 0);
    cr_assert_eq(num(j, "total_output_tokens"), 16 * 8);
    cr_assert_gt(num(j, "total_input_tokens"), 16 * 20, "usage.prompt_tokens summed");
    cr_assert_gt(num(j, "mean_ttft_ms"), 0);
    cr_assert_gt(num(j, "median_ttft_ms"), 0);
    cr_assert_geq(num(j, "p99_ttft_ms"), num(j, "median_ttft_ms"));
    /* the workers space tokens by at least 20 ms from each send; what the client sees can be
     * shorter by the difference in delivery delay of the first and last token over n - 1 gaps:
     * 1 ms of tolerance (a wrong definition, e.g. dividing by n, gives 15 ms at 4 tokens) */
    double tpot = num(j, "mean_tpot_ms");
    cr_assert_geq(tpot, 19.0, "mean TPOT %.2f ms below the workers' 20 ms delay", tpot);
    cr_assert_lt(tpot, 200.0, "mean TPOT %.2f ms", tpot);
    cr_assert_geq(num(j, "mean_itl_ms"), 15.0);
    cr_assert_gt(num(j, "mean_e2el_ms"), num(j, "mean_ttft_ms"));
    cr_assert_gt(num(j, "output_throughput"), 0);
    cr_assert_gt(num(j, "request_throughput"), 0);
    cr_assert_gt(num(j, "total_token_throughput"), num(j, "output_throughput"));
    double user = num(j, "user_throughput");
    cr_assert(user > 0 && user <= 1000.0 / 20.0 + 1e-6, "user_throughput %.2f", user);
    cr_assert_eq(num(j, "goodput"), num(j, "request_throughput"), "every request meets loose SLOs");
    cr_assert_gt(num(j, "duration_s"), 0);
    /* the server counters: null until the router exports them, a number after */
    json_t *v = json_object_get(j, "avg_decoded_tokens_per_iter");
    cr_assert(v != NULL && (json_is_null(v) || json_is_number(v)));
    v = json_object_get(j, "device_step_time_ms");
    cr_assert(v != NULL && (json_is_null(v) || json_is_number(v)));
    /* the test workers do not speculate: the router's per-position series stay 0 */
    cr_assert(json_is_null(json_object_get(j, "spec_acceptance_rate")));
    cr_assert(json_is_null(json_object_get(j, "spec_mean_step_tokens")));
    v = json_object_get(j, "spec_positions");
    cr_assert(json_is_array(v) && json_array_size(v) == 0);
    json_t *cfg = json_object_get(j, "config");
    cr_assert_str_eq(json_string_value(json_object_get(cfg, "model")), "m", "from /v1/models");
    cr_assert_eq(json_integer_value(json_object_get(cfg, "max_tokens")), 8);
    json_decref(j);

    /* gates: one that must fail -> 3, loose ones -> 0 */
    snprintf(fail, sizeof(fail), "%s/fail.json", tdir);
    snprintf(pass, sizeof(pass), "%s/pass.json", tdir);
    put_file("fail.json", "{\"gates\": {\"error_rate\": {\"max\": 0},"
                          " \"output_throughput\": {\"min\": 1e9}}}");
    put_file("pass.json", "{\"gates\": {\"error_rate\": {\"max\": 0}, \"completed\": {\"min\": 4},"
                          " \"mean_tpot_ms\": {\"min\": 19, \"max\": 500}}}");
    const char *gate_fail[] = {"--concurrency",
                               "4",
                               "--num-prompts",
                               "4",
                               "--max-tokens",
                               "4",
                               "--prompts",
                               prompts,
                               "--metrics-settle-ms",
                               "0",
                               "--baseline",
                               fail,
                               NULL};
    rc = run_bench("bench2.log", gate_fail);
    cr_assert_eq(rc, 3, "failing gate: exit %d", rc);
    cr_assert(file_has("bench2.log", "FAIL output_throughput", 0),
              "no FAIL line (log %s/bench2.log)", tdir);
    cr_assert(file_has("bench2.log", "PASS error_rate", 0));
    const char *gate_pass[] = {
        "--concurrency", "4",     "--num-prompts",       "4", "--max-tokens", "4",  "--ignore-eos",
        "--prompts",     prompts, "--metrics-settle-ms", "0", "--baseline",   pass, NULL};
    rc = run_bench("bench3.log", gate_pass);
    cr_assert_eq(rc, 0, "passing gates: exit %d (log %s/bench3.log)", rc, tdir);

    /* an earlier run as the baseline (relative gates): the first run's JSON made unbeatable
     * (throughput x 1e6) fails with exit 3; made easy (throughputs / 1e6, latencies x 1e6) and
     * with a tolerance for one more metric, it passes */
    json_t *base = load_json("out.json");
    json_t *easy = json_deep_copy(base);
    json_object_set_new(base, "output_throughput", json_real(num(base, "output_throughput") * 1e6));
    cr_assert_eq(json_dump_file(base, fail, 0), 0);
    const char *names[] = {"request_throughput", "output_throughput", "total_token_throughput"};
    for (size_t i = 0; i < 3; i++)
        json_object_set_new(easy, names[i], json_real(num(easy, names[i]) / 1e6));
    const char *lat[] = {"mean_ttft_ms",   "median_ttft_ms", "mean_tpot_ms",
                         "median_tpot_ms", "mean_itl_ms",    "median_itl_ms",
                         "mean_e2el_ms",   "median_e2el_ms", "p99_e2el_ms"};
    for (size_t i = 0; i < sizeof(lat) / sizeof(lat[0]); i++)
        json_object_set_new(easy, lat[i], json_real(num(easy, lat[i]) * 1e6));
    cr_assert_eq(json_dump_file(easy, pass, 0), 0);
    json_decref(base);
    json_decref(easy);
    rc = run_bench("bench5.log", gate_fail); /* --baseline fail.json: now a run */
    cr_assert_eq(rc, 3, "a baseline run out of reach: exit %d (log %s/bench5.log)", rc, tdir);
    cr_assert(file_has("bench5.log", "FAIL output_throughput", 0), "log %s/bench5.log", tdir);
    cr_assert(file_has("bench5.log", "- 5%)", 0), "no relative bound (log %s/bench5.log)", tdir);
    const char *run_pass[] = {"--concurrency",
                              "4",
                              "--num-prompts",
                              "4",
                              "--max-tokens",
                              "4",
                              "--ignore-eos",
                              "--prompts",
                              prompts,
                              "--baseline",
                              pass,
                              "--tolerance",
                              "p99_e2el_ms=+10%",
                              "--metrics-settle-ms",
                              "0",
                              NULL};
    rc = run_bench("bench6.log", run_pass);
    cr_assert_eq(rc, 0, "an easy baseline run: exit %d (log %s/bench6.log)", rc, tdir);
    cr_assert(file_has("bench6.log", "PASS p99_e2el_ms", 0), "log %s/bench6.log", tdir);
    cr_assert(file_has("bench6.log", "PASS mean_ttft_ms", 0), "log %s/bench6.log", tdir);

    /* a malformed baseline: usage error before any request */
    put_file("bad.json", "{\"gates\": {\"error_rate\": {\"max\": \"zero\"}}}");
    char bad[512];
    snprintf(bad, sizeof(bad), "%s/bad.json", tdir);
    const char *gate_bad[] = {"--baseline", bad, NULL};
    cr_assert_eq(run_bench("bench4.log", gate_bad), 2);
    cr_assert(file_has("bench4.log", "gates.error_rate.max: expected a number", 0));
    cluster_stop();
}

Test(bench_serving, chat_poisson_and_no_server, .timeout = 180)
{
    cluster_start();
    char out[512];
    snprintf(out, sizeof(out), "%s/chat.json", tdir);
    const char *chat[] = {"--endpoint",
                          "chat",
                          "--request-rate",
                          "50",
                          "--seed",
                          "3",
                          "--num-prompts",
                          "6",
                          "--max-tokens",
                          "5",
                          "--ignore-eos",
                          "--random-prompt-len",
                          "12",
                          "--json",
                          out,
                          "--metrics-settle-ms",
                          "0",
                          NULL};
    int rc = run_bench("chat.log", chat);
    cr_assert_eq(rc, 0, "exit %d (log %s/chat.log)", rc, tdir);
    json_t *j = load_json("chat.json");
    cr_assert_eq(num(j, "completed"), 6);
    cr_assert_eq(num(j, "total_output_tokens"), 6 * 5);
    cr_assert_str_eq(json_string_value(json_object_get(json_object_get(j, "config"), "endpoint")),
                     "chat");
    json_decref(j);
    cluster_stop();

    /* nobody listens on the port any more: every request fails with a connect reason */
    snprintf(out, sizeof(out), "/tmp/duet-bench-none-%d.json", (int)getpid());
    const char *none[] = {
        "--model", "m", "--num-prompts", "3", "--json", out, "--metrics-settle-ms", "0", NULL};
    cr_assert_not_null(mkdtemp(strcpy(tdir, "/tmp/duet-bench-test-XXXXXX")));
    rc = run_bench("none.log", none);
    cr_assert_eq(rc, 1, "nothing completed: exit %d", rc);
    json_error_t e;
    j = json_load_file(out, 0, &e);
    cr_assert_not_null(j, "%s", e.text);
    cr_assert_eq(num(j, "failed"), 3);
    cr_assert_eq(num(j, "error_rate"), 1);
    cr_assert(json_is_null(json_object_get(j, "mean_ttft_ms")));
    json_t *errs = json_object_get(j, "errors");
    cr_assert(strstr(json_string_value(json_object_get(json_array_get(errs, 0), "reason")),
                     "connect") != NULL);
    json_decref(j);
    unlink(out);
    cluster_stop();
}

/* The text of tdir/name (malloc'd, NUL-terminated). */
static char *read_text(const char *name, size_t *len_p)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", tdir, name);
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "%s", path);
    char *buf = malloc(1 << 20);
    size_t n = fread(buf, 1, (1 << 20) - 1, f);
    fclose(f);
    buf[n] = '\0';
    if (len_p != NULL)
        *len_p = n;
    return buf;
}

/*
 * --save-result next to --json of the same run: vLLM's keys, one array entry per request, and the
 * same numbers (vLLM's ttfts are seconds, the statistics ms).
 */
static void check_save_result(const char *save, const char *json, long n_req, long max_tokens)
{
    json_t *v = load_json(save), *j = load_json(json);
    static const char *const keys[] = {"date",
                                       "backend",
                                       "model_id",
                                       "tokenizer_id",
                                       "num_prompts",
                                       "request_rate",
                                       "burstiness",
                                       "max_concurrency",
                                       "duration",
                                       "completed",
                                       "total_input_tokens",
                                       "total_output_tokens",
                                       "request_throughput",
                                       "request_goodput",
                                       "output_throughput",
                                       "total_token_throughput",
                                       "input_lens",
                                       "output_lens",
                                       "ttfts",
                                       "itls",
                                       "generated_texts",
                                       "errors"};
    for (size_t k = 0; k < sizeof(keys) / sizeof(keys[0]); k++)
        cr_assert_not_null(json_object_get(v, keys[k]), "%s: no %s", save, keys[k]);
    static const char *const arrays[] = {"input_lens", "output_lens",     "ttfts",
                                         "itls",       "generated_texts", "errors"};
    for (size_t k = 0; k < 6; k++)
        cr_assert_eq(json_array_size(json_object_get(v, arrays[k])), (size_t)n_req, "%s %s", save,
                     arrays[k]);
    cr_assert_str_eq(json_string_value(json_object_get(v, "backend")), "openai");
    cr_assert_str_eq(json_string_value(json_object_get(v, "model_id")), "m");
    cr_assert_eq(num(v, "num_prompts"), n_req);
    cr_assert(json_is_null(json_object_get(v, "request_goodput")), "no --goodput given");
    /* the same run: every shared number equal */
    static const char *const same[] = {"completed",           "total_input_tokens",
                                       "total_output_tokens", "request_throughput",
                                       "output_throughput",   "total_token_throughput"};
    for (size_t k = 0; k < sizeof(same) / sizeof(same[0]); k++)
        cr_assert_float_eq(num(v, same[k]), num(j, same[k]), 1e-9 * (1 + fabs(num(j, same[k]))),
                           "%s", same[k]);
    cr_assert_float_eq(num(v, "duration"), num(j, "duration_s"), 1e-9);
    static const char *const met[] = {"ttft", "tpot", "itl", "e2el"};
    static const char *const stat[] = {"mean", "median", "std", "p99"};
    for (size_t m = 0; m < 4; m++)
        for (size_t k = 0; k < 4; k++) {
            char key[64];
            snprintf(key, sizeof(key), "%s_%s_ms", stat[k], met[m]);
            cr_assert_float_eq(num(v, key), num(j, key), 1e-6, "%s", key);
        }
    /* per request: seconds, lengths and texts that add up to the summary */
    double ttft_sum = 0, out_sum = 0, in_sum = 0;
    size_t n_itl = 0;
    for (size_t i = 0; i < (size_t)n_req; i++) {
        json_t *t = json_array_get(json_object_get(v, "ttfts"), i);
        cr_assert(json_is_number(t));
        ttft_sum += json_number_value(t);
        json_int_t ol = json_integer_value(json_array_get(json_object_get(v, "output_lens"), i));
        cr_assert_eq(ol, max_tokens, "request %zu output_len", i);
        out_sum += (double)ol;
        in_sum += (double)json_integer_value(json_array_get(json_object_get(v, "input_lens"), i));
        json_t *itl = json_array_get(json_object_get(v, "itls"), i);
        cr_assert(json_is_array(itl));
        for (size_t k = 0; k < json_array_size(itl); k++)
            cr_assert(json_number_value(json_array_get(itl, k)) < 10.0, "itls in seconds");
        n_itl += json_array_size(itl);
        const char *text =
            json_string_value(json_array_get(json_object_get(v, "generated_texts"), i));
        cr_assert(text != NULL && strlen(text) > 0, "request %zu generated text", i);
        cr_assert_str_eq(json_string_value(json_array_get(json_object_get(v, "errors"), i)), "");
    }
    cr_assert_float_eq(ttft_sum / (double)n_req * 1000.0, num(j, "mean_ttft_ms"), 1e-6,
                       "ttfts are seconds and average to mean_ttft_ms");
    cr_assert_eq(out_sum, num(j, "total_output_tokens"));
    cr_assert_eq(in_sum, num(j, "total_input_tokens"));
    cr_assert_eq(n_itl, (size_t)num(json_object_get(j, "itl_ms"), "n"));
    json_decref(v);
    json_decref(j);
}

/* One CSV cell of row r (0 = first data row) by column name, as a number (NaN when empty). */
static double csv_cell(const char *csv, int r, const char *col)
{
    char *dup = strdup(csv), *save = NULL;
    char *hdr = strtok_r(dup, "\n", &save);
    int want = -1, c = 0;
    for (char *p = hdr, *q; p != NULL; p = q, c++) {
        q = strchr(p, ',');
        size_t l = q != NULL ? (size_t)(q - p) : strlen(p);
        if (l == strlen(col) && strncmp(p, col, l) == 0)
            want = c;
        if (q != NULL)
            q++;
    }
    cr_assert_geq(want, 0, "no CSV column %s", col);
    char *line = NULL;
    for (int i = 0; i <= r; i++)
        line = strtok_r(NULL, "\n", &save);
    cr_assert_not_null(line, "no CSV row %d", r);
    const char *p = line;
    for (int i = 0; i < want; i++) {
        p = strchr(p, ',');
        cr_assert_not_null(p);
        p++;
    }
    double v = (*p == ',' || *p == '\0') ? NAN : strtod(p, NULL);
    free(dup);
    return v;
}

/* Debian's python3, where python3-matplotlib installs (deploy/install-deps.sh --tests). */
#define SYSTEM_PYTHON "/usr/bin/python3"

Test(bench_serving, save_result_sweep_csv_and_plot, .timeout = 180)
{
    cluster_start();
    write_prompts();
    char prompts[512], json[512], save[512], csv[512];
    snprintf(prompts, sizeof(prompts), "%s/prompts.jsonl", tdir);
    snprintf(json, sizeof(json), "%s/run.json", tdir);
    snprintf(save, sizeof(save), "%s/vllm.json", tdir);
    snprintf(csv, sizeof(csv), "%s/sweep.csv", tdir);

    /* one run: --save-result beside --json */
    const char *one[] = {"--concurrency",
                         "2",
                         "--num-prompts",
                         "6",
                         "--max-tokens",
                         "4",
                         "--ignore-eos",
                         "--prompts",
                         prompts,
                         "--json",
                         json,
                         "--save-result",
                         save,
                         "--metrics-settle-ms",
                         "0",
                         NULL};
    int rc = run_bench("one.log", one);
    cr_assert_eq(rc, 0, "exit %d (log %s/one.log)", rc, tdir);
    check_save_result("vllm.json", "run.json", 6, 4);
    json_t *v = load_json("vllm.json");
    cr_assert_str_eq(json_string_value(json_object_get(v, "request_rate")), "inf",
                     "a closed loop is vLLM's inf rate with max_concurrency");
    cr_assert_eq(num(v, "max_concurrency"), 2);
    json_decref(v);

    /* a sweep of 2 concurrencies: a file per value, 2 CSV rows, a table */
    const char *sweep[] = {"--sweep",
                           "concurrency=1,2",
                           "--num-prompts",
                           "4",
                           "--max-tokens",
                           "4",
                           "--ignore-eos",
                           "--prompts",
                           prompts,
                           "--json",
                           json,
                           "--save-result",
                           save,
                           "--csv",
                           csv,
                           "--metrics-settle-ms",
                           "0",
                           NULL};
    rc = run_bench("sweep.log", sweep);
    cr_assert_eq(rc, 0, "exit %d (log %s/sweep.log)", rc, tdir);
    cr_assert(file_has("sweep.log", "Sweep: concurrency", 0), "no table (log %s/sweep.log)", tdir);
    check_save_result("vllm-concurrency-1.json", "run-concurrency-1.json", 4, 4);
    check_save_result("vllm-concurrency-2.json", "run-concurrency-2.json", 4, 4);
    size_t len;
    char *text = read_text("sweep.csv", &len);
    int lines = 0;
    for (size_t i = 0; i < len; i++)
        lines += text[i] == '\n';
    cr_assert_eq(lines, 3, "header + 2 rows:\n%s", text);
    cr_assert(strncmp(text, "sweep,value,", 12) == 0);
    for (int r = 0; r < 2; r++) {
        cr_assert_eq(csv_cell(text, r, "value"), r + 1);
        cr_assert_eq(csv_cell(text, r, "completed"), 4);
        cr_assert_eq(csv_cell(text, r, "error_rate"), 0);
        cr_assert_gt(csv_cell(text, r, "output_throughput"), 0);
        cr_assert_gt(csv_cell(text, r, "request_throughput"), 0);
        /* the workers' 20 ms per token bounds TPOT from below (see the first test) */
        cr_assert_geq(csv_cell(text, r, "median_tpot_ms"), 19.0);
        cr_assert_lt(csv_cell(text, r, "median_tpot_ms"), 500.0);
        cr_assert_geq(csv_cell(text, r, "p99_ttft_ms"), csv_cell(text, r, "median_ttft_ms"));
        cr_assert_gt(csv_cell(text, r, "mean_e2el_ms"), csv_cell(text, r, "mean_ttft_ms"));
        json_t *j = load_json(r == 0 ? "run-concurrency-1.json" : "run-concurrency-2.json");
        cr_assert_float_eq(csv_cell(text, r, "output_throughput"), num(j, "output_throughput"),
                           1e-5 * num(j, "output_throughput"), "the CSV row is the run's");
        json_decref(j);
    }
    /* two in flight deliver more tokens per second than one: 4 x 4 tokens at 20 ms each */
    cr_assert_gt(csv_cell(text, 1, "output_throughput"), csv_cell(text, 0, "output_throughput"));
    free(text);

    /* a request-rate sweep: "inf" as a value, in the CSV and in the file names */
    char rates_csv[512];
    snprintf(rates_csv, sizeof(rates_csv), "%s/rates.csv", tdir);
    const char *rates[] = {"--sweep",
                           "request-rate=50,inf",
                           "--num-prompts",
                           "3",
                           "--max-tokens",
                           "2",
                           "--random-prompt-len",
                           "12",
                           "--json",
                           json,
                           "--csv",
                           rates_csv,
                           "--metrics-settle-ms",
                           "0",
                           NULL};
    rc = run_bench("rates.log", rates);
    cr_assert_eq(rc, 0, "exit %d (log %s/rates.log)", rc, tdir);
    text = read_text("rates.csv", &len);
    cr_assert(strstr(text, "\nrequest-rate,50,3,0,0,") != NULL, "%s", text);
    cr_assert(strstr(text, "\nrequest-rate,inf,3,0,0,") != NULL, "%s", text);
    free(text);
    v = load_json("run-request-rate-inf.json");
    cr_assert_str_eq(
        json_string_value(json_object_get(json_object_get(v, "config"), "request_rate")), "inf");
    json_decref(v);
    v = load_json("run-request-rate-50.json");
    cr_assert_eq(num(json_object_get(v, "config"), "request_rate"), 50);
    json_decref(v);

    /* the plot of the concurrency sweep's CSV: a PNG */
    char cmd[1600];
    snprintf(cmd, sizeof(cmd), "%s %s/bench/plot_sweep.py %s %s/sweep.png > %s/plot.log 2>&1",
             SYSTEM_PYTHON, DUET_SOURCE_DIR, csv, tdir, tdir);
    rc = system(cmd);
    cr_assert_eq(rc, 0, "plot_sweep.py failed (needs python3-matplotlib; log %s/plot.log)", tdir);
    char *png = read_text("sweep.png", &len);
    cr_assert_gt(len, 8);
    cr_assert(memcmp(png, "\x89PNG\r\n\x1a\n", 8) == 0, "not a PNG");
    free(png);
    cluster_stop();
}
