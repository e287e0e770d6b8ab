/*
 * duet-router with duet-test-worker processes (a test tool that fakes ctx/gen workers with
 * deterministic tokens: the prompt ids reversed) on loopback: /health before and after a gen
 * worker registers, completions and chat (streaming and not) through Reserve -> Prefill ->
 * PrefillDone, local prefill (Generate) below the threshold, both gen workers used, a client
 * disconnect reaches the worker as Cancel, a dying ctx worker's prefill is retried once on
 * another, a gen worker that stops heartbeating fails its request with a clear error, refused
 * reservations give 429 with Retry-After, a full admission queue gives 429 and a paused one 503,
 * a wrong-version worker is refused, drain via the
 * admin API, a (fake) Helix group's reservations reach the ctx worker's Prefill unchanged and too
 * many of them fail the request naming the worker, and placement by the prefix summaries workers
 * report (faked: --prefix-ids), on and off.
 *
 * The model folder is made per test (config.json + a byte tokenizer); the fingerprint is the
 * literal "test" (--model.fingerprint), which the workers present.
 */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include "tests/integration/test_ports.h"

#define ROUTER DUET_BINARY_DIR "/router/duet-router"
#define WORKER DUET_BINARY_DIR "/tests/tools/duet-test-worker"

static char dir[256];
static int http_port, worker_port, admin_port;
static pid_t pids[16];
static int n_pids;

static void write_file(const char *name, const char *text)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
}

static pid_t spawn(char *const argv[], const char *log)
{
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        char path[512];
        snprintf(path, sizeof(path), "%s/%s", dir, log);
        int fd = open(path, O_WRONLY | O_CREAT | O_APPEND, 0644);
        dup2(fd, 1);
        dup2(fd, 2);
        setenv("DUET_LOG_LEVEL", "info", 1);
        execv(argv[0], argv);
        _exit(127);
    }
    pids[n_pids++] = pid;
    return pid;
}

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static int http_auth(int port, const char *method, const char *path, const char *body,
                     const char *auth, char *out, size_t cap);

/* One HTTP request with Connection: close; the whole response in out. Returns the status. */
static int http(int port, const char *method, const char *path, const char *body, char *out,
                size_t cap)
{
    return http_auth(port, method, path, body, NULL, out, cap);
}

/* The same with an Authorization header of value `auth` (NULL: none). */
static int http_auth(int port, const char *method, const char *path, const char *body,
                     const char *auth, char *out, size_t cap)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        close(fd);
        return -1;
    }
    char req[8192];
    int n = snprintf(req, sizeof(req),
                     "%s %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: "
                     "application/json\r\n%s%s%sContent-Length: %zu\r\n\r\n%s",
                     method, path, auth != NULL ? "Authorization: " : "", auth != NULL ? auth : "",
                     auth != NULL ? "\r\n" : "", body != NULL ? strlen(body) : 0,
                     body != NULL ? body : "");
    cr_assert_eq(write(fd, req, (size_t)n), n);
    size_t at = 0;
    for (;;) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 10000) <= 0)
            break;
        ssize_t r = read(fd, out + at, cap - 1 - at);
        if (r <= 0)
            break;
        at += (size_t)r;
    }
    out[at] = '\0';
    close(fd);
    int status = -1;
    sscanf(out, "HTTP/1.1 %d", &status);
    return status;
}

static int wait_status(const char *path, int want, int ms)
{
    static char buf[65536];
    uint64_t end = now_ms() + (uint64_t)ms;
    int st = -1;
    while (now_ms() < end) {
        st = http(http_port, "GET", path, NULL, buf, sizeof(buf));
        if (st == want)
            return st;
        usleep(20000);
    }
    return st;
}

/* Whether the events file of `name` has a line starting with `prefix` (waits up to ms). */
static int has_event(const char *name, const char *prefix, int ms)
{
    char path[512], line[512];
    snprintf(path, sizeof(path), "%s/%s.events", dir, name);
    uint64_t end = now_ms() + (uint64_t)ms;
    do {
        FILE *f = fopen(path, "r");
        if (f != NULL) {
            while (fgets(line, sizeof(line), f) != NULL)
                if (strncmp(line, prefix, strlen(prefix)) == 0) {
                    fclose(f);
                    return 1;
                }
            fclose(f);
        }
        usleep(20000);
    } while (now_ms() < end);
    return 0;
}

static void start_router(const char *extra1, const char *extra2)
{
    char tmpl[] = "/tmp/duet-router-test-XXXXXX";
    cr_assert_not_null(mkdtemp(tmpl));
    snprintf(dir, sizeof(dir), "%s", tmpl);
    write_file("config.json",
               "{\"bos_token_id\": 256, \"eos_token_id\": 257, \"model_max_length\": 4096}\n");
    write_file(
        "duet_tokenizer.json",
        "{\"type\": \"byte\", \"specials\": [\"<|bos|>\", \"<|eos|>\"], \"add_bos\": true}\n");
    http_port = free_port();
    worker_port = free_port();
    admin_port = free_port();
    char hp[16], wp[16], ap[16];
    snprintf(hp, sizeof(hp), "%d", http_port);
    snprintf(wp, sizeof(wp), "%d", worker_port);
    snprintf(ap, sizeof(ap), "%d", admin_port);
    char *argv[] = {ROUTER,
                    "--model",
                    dir,
                    "--model.name",
                    "m",
                    "--model.fingerprint",
                    "test",
                    "--http.port",
                    hp,
                    "--workers.port",
                    wp,
                    "--admin.port",
                    ap,
                    "--admin.insecure-no-token",
                    "--placement.policy",
                    "round_robin",
                    "--workers.heartbeat-timeout-ms",
                    "600",
                    (char *)extra1,
                    (char *)extra2,
                    NULL};
    if (extra1 == NULL)
        argv[18] = NULL;
    spawn(argv, "router.log");
    cr_assert_eq(wait_status("/live", 200, 5000), 200, "router did not come up");
}

/* Start a test worker and wait until it registered. Extra flags: up to 3. */
static void start_worker(const char *role, const char *name, const char *f1, const char *f2,
                         const char *f3)
{
    char rt[64], ev[512];
    snprintf(rt, sizeof(rt), "127.0.0.1:%d", worker_port);
    snprintf(ev, sizeof(ev), "%s/%s.events", dir, name);
    char *argv[17] = {
        /* 13 + three flags + NULL */
        WORKER,          "--router", rt,         "--role", (char *)role,     "--name", (char *)name,
        "--fingerprint", "test",     "--events", ev,       "--heartbeat-ms", "100"};
    int n = 13;
    if (f1 != NULL)
        argv[n++] = (char *)f1;
    if (f2 != NULL)
        argv[n++] = (char *)f2;
    if (f3 != NULL)
        argv[n++] = (char *)f3;
    argv[n] = NULL;
    char log[128];
    snprintf(log, sizeof(log), "%s.log", name);
    spawn(argv, log);
    cr_assert(has_event(name, "registered", 5000), "worker %s did not register", name);
}

static void stop_all(void)
{
    for (int i = n_pids - 1; i >= 0; i--) {
        kill(pids[i], SIGTERM);
        int st;
        for (int k = 0; k < 100 && waitpid(pids[i], &st, WNOHANG) == 0; k++)
            usleep(20000);
        kill(pids[i], SIGKILL);
        waitpid(pids[i], &st, 0);
    }
    n_pids = 0;
    char cmd[300];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    if (getenv("DUET_KEEP_TEST_DIR") == NULL && system(cmd) != 0)
        cr_log_warn("could not remove %s", dir);
}

static const char *body_of(const char *resp)
{
    const char *b = strstr(resp, "\r\n\r\n");
    return b != NULL ? b + 4 : "";
}

/* Concatenate the "content"/"text" deltas of an SSE stream (naive: our own JSON, no escapes). */
static void sse_text(const char *resp, const char *key, char *out, size_t cap)
{
    size_t at = 0;
    char pat[32];
    snprintf(pat, sizeof(pat), "\"%s\":\"", key);
    for (const char *p = strstr(resp, pat); p != NULL; p = strstr(p + 1, pat)) {
        p += strlen(pat);
        while (*p != '"' && at + 1 < cap)
            out[at++] = *p++;
    }
    out[at] = '\0';
}

/* ---------------------------------------------------------------- tests */

Test(router_cluster, health_503_without_gen_then_200, .timeout = 60)
{
    static char buf[65536];
    start_router(NULL, NULL);
    cr_assert_eq(http(http_port, "GET", "/health", NULL, buf, sizeof(buf)), 503);
    cr_assert(strstr(buf, "no live generation worker") != NULL, "%s", buf);
    cr_assert_eq(http(http_port, "GET", "/live", NULL, buf, sizeof(buf)), 200);
    /* a completion with no gen worker: 503 with Retry-After, not a hang */
    int st = http(http_port, "POST", "/v1/completions",
                  "{\"model\":\"m\",\"prompt\":\"hi\",\"max_tokens\":2}", buf, sizeof(buf));
    cr_assert_eq(st, 503, "%s", buf);
    cr_assert(strstr(buf, "Retry-After:") != NULL, "%s", buf);
    start_worker("ctx", "ctx-0", NULL, NULL, NULL);
    cr_assert_eq(http(http_port, "GET", "/health", NULL, buf, sizeof(buf)), 503, "ctx only");
    start_worker("gen", "gen-0", NULL, NULL, NULL);
    cr_assert_eq(wait_status("/health", 200, 3000), 200);
    cr_assert_eq(http(http_port, "GET", "/metrics", NULL, buf, sizeof(buf)), 200);
    cr_assert(strstr(buf, "duet_router_workers{role=\"gen\",state=\"up\"} 1") != NULL, "%s", buf);
    cr_assert(strstr(buf, "duet_router_workers{role=\"ctx\",state=\"up\"} 1") != NULL);
    /* promtool check metrics (docs/architecture.md, metrics); deploy/install-deps.sh --tests
     * installs it, and without it this test fails rather than pass unchecked. */
    cr_assert_eq(system("command -v promtool >/dev/null 2>&1"), 0,
                 "promtool not found: install the Debian package prometheus "
                 "(deploy/install-deps.sh --tests)");
    char path[512], cmd[700];
    snprintf(path, sizeof(path), "%s/metrics.txt", dir);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs(body_of(buf), f);
    fclose(f);
    snprintf(cmd, sizeof(cmd), "%s/tests/tools/promtool_check.sh %s", DUET_SOURCE_DIR, path);
    cr_assert_eq(system(cmd), 0, "promtool check metrics failed on %s", path);
    stop_all();
}

Test(router_cluster, completions_and_chat_streaming_and_not, .timeout = 90)
{
    static char buf[65536], text[4096];
    start_router("--placement.local-prefill-tokens", "8");
    start_worker("gen", "gen-0", NULL, NULL, NULL);
    start_worker("gen", "gen-1", NULL, NULL, NULL);
    start_worker("ctx", "ctx-0", NULL, NULL, NULL);
    cr_assert_eq(wait_status("/health", 200, 3000), 200);

    /* "<|bos|>hello world" = 12 tokens >= 8: Reserve -> Prefill -> PrefillDone */
    int st =
        http(http_port, "POST", "/v1/completions",
             "{\"model\":\"m\",\"prompt\":\"hello world\",\"max_tokens\":5}", buf, sizeof(buf));
    cr_assert_eq(st, 200, "%s", buf);
    cr_assert(strstr(body_of(buf), "\"text\":\"dlrow\"") != NULL, "%s", buf);
    cr_assert(strstr(buf, "\"finish_reason\":\"length\"") != NULL);
    cr_assert(strstr(buf, "\"prompt_tokens\":12,\"completion_tokens\":5") != NULL, "%s", buf);
    cr_assert(has_event("ctx-0", "prefill 1 12", 1000));

    /* the same streamed: the text arrives in chunks, then [DONE] */
    st = http(http_port, "POST", "/v1/completions",
              "{\"model\":\"m\",\"prompt\":\"hello world\",\"max_tokens\":5,\"stream\":true}", buf,
              sizeof(buf));
    cr_assert_eq(st, 200, "%s", buf);
    sse_text(buf, "text", text, sizeof(text));
    cr_assert_str_eq(text, "dlrow", "%s", buf);
    cr_assert(strstr(buf, "data: [DONE]") != NULL);

    /* both gen workers got a reservation (round robin) */
    cr_assert(has_event("gen-0", "reserve", 1000));
    cr_assert(has_event("gen-1", "reserve", 1000));

    /* chat, streaming: prompt "<|bos|>user: abc\nassistant: " reversed -> " :tnatsissa" */
    st = http(http_port, "POST", "/v1/chat/completions",
              "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"abc\"}],"
              "\"max_tokens\":11,\"stream\":true}",
              buf, sizeof(buf));
    cr_assert_eq(st, 200, "%s", buf);
    sse_text(buf, "content", text, sizeof(text));
    cr_assert_str_eq(text, " :tnatsissa", "%s", buf);
    cr_assert(strstr(buf, "\"role\":\"assistant\"") != NULL);
    /* chat, not streaming, with a stop string */
    st = http(http_port, "POST", "/v1/chat/completions",
              "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"abc\"}],"
              "\"max_tokens\":11,\"stop\":[\"ss\"]}",
              buf, sizeof(buf));
    cr_assert_eq(st, 200, "%s", buf);
    cr_assert(strstr(buf, "\"content\":\" :tnatsi\"") != NULL, "%s", buf);
    cr_assert(strstr(buf, "\"finish_reason\":\"stop\"") != NULL, "%s", buf);

    /* "<|bos|>hi" = 3 tokens < 8: local prefill (Generate) on a gen worker */
    st = http(http_port, "POST", "/v1/completions",
              "{\"model\":\"m\",\"prompt\":\"hi\",\"max_tokens\":2}", buf, sizeof(buf));
    cr_assert_eq(st, 200, "%s", buf);
    cr_assert(strstr(buf, "\"text\":\"ih\"") != NULL, "%s", buf);
    cr_assert(has_event("gen-0", "generate", 500) || has_event("gen-1", "generate", 500));

    /* validation errors come back OpenAI-shaped */
    st = http(http_port, "POST", "/v1/completions", "{\"model\":\"other\",\"prompt\":\"x\"}", buf,
              sizeof(buf));
    cr_assert_eq(st, 404, "%s", buf);
    cr_assert_eq(http(http_port, "GET", "/v1/models", NULL, buf, sizeof(buf)), 200);
    cr_assert(strstr(buf, "\"id\":\"m\"") != NULL);
    cr_assert_eq(http(http_port, "GET", "/metrics", NULL, buf, sizeof(buf)), 200);
    cr_assert(strstr(buf, "duet_router_ttft_seconds_count 5") != NULL, "%s", buf);
    cr_assert(strstr(buf,
                     "duet_router_http_requests_total{method=\"POST\",path=\"/v1/completions\","
                     "status=\"200\"} 3") != NULL,
              "%s", buf);
    stop_all();
}

/* The "content"/"text" deltas of choice `index` in an SSE stream (one chunk per line). */
static void sse_text_of(const char *resp, int index, const char *key, char *out, size_t cap)
{
    char want[32], pat[32];
    snprintf(want, sizeof(want), "\"choices\":[{\"index\":%d,", index);
    snprintf(pat, sizeof(pat), "\"%s\":\"", key);
    size_t at = 0;
    for (const char *line = strstr(resp, "data: "); line != NULL;
         line = strstr(line + 1, "data: ")) {
        const char *eol = strchr(line, '\n');
        const char *c = strstr(line, want), *p = strstr(line, pat);
        if (c == NULL || p == NULL || (eol != NULL && (c > eol || p > eol)))
            continue;
        for (p += strlen(pat); *p != '"' && at + 1 < cap;)
            out[at++] = *p++;
    }
    out[at] = '\0';
}

static int count(const char *hay, const char *needle)
{
    int n = 0;
    for (const char *p = strstr(hay, needle); p != NULL; p = strstr(p + 1, needle))
        n++;
    return n;
}

/* n > 1: n engine requests (seed + i), choices by index, usage summed, streams interleaved. */
Test(router_cluster, n_choices_fan_out, .timeout = 90)
{
    static char buf[65536], text[4096];
    start_router(NULL, NULL);
    start_worker("gen", "gen-0", NULL, NULL, NULL);
    start_worker("gen", "gen-1", NULL, NULL, NULL);
    start_worker("ctx", "ctx-0", NULL, NULL, NULL);
    cr_assert_eq(wait_status("/health", 200, 3000), 200);

    /* requests 1, 2, 3: seeds 7, 8, 9; each choice the prompt reversed (the test worker) */
    int st = http(http_port, "POST", "/v1/completions",
                  "{\"model\":\"m\",\"prompt\":\"hello world\",\"max_tokens\":5,\"n\":3,"
                  "\"best_of\":3,\"seed\":7}",
                  buf, sizeof(buf));
    cr_assert_eq(st, 200, "%s", buf);
    for (int i = 0; i < 3; i++) {
        char want[64];
        snprintf(want, sizeof(want), "{\"index\":%d,\"text\":\"dlrow\"", i);
        cr_assert(strstr(body_of(buf), want) != NULL, "%s", buf);
    }
    cr_assert(strstr(buf, "{\"index\":3") == NULL, "%s", buf);
    cr_assert(strstr(buf, "\"prompt_tokens\":12,\"completion_tokens\":15,\"total_tokens\":27") !=
                  NULL,
              "%s", buf);
    const char *seeds[3] = {"seed 1 7", "seed 2 8", "seed 3 9"};
    for (int i = 0; i < 3; i++)
        cr_assert(has_event("gen-0", seeds[i], 200) || has_event("gen-1", seeds[i], 200),
                  "no gen worker got \"%s\"", seeds[i]);

    /* chat, streaming, n = 2, with usage: each choice its role chunk, text and finish chunk;
     * one usage chunk, one [DONE] */
    st = http(http_port, "POST", "/v1/chat/completions",
              "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"abc\"}],"
              "\"max_tokens\":11,\"stream\":true,\"n\":2,\"stream_options\":{\"include_usage\":"
              "true}}",
              buf, sizeof(buf));
    cr_assert_eq(st, 200, "%s", buf);
    for (int i = 0; i < 2; i++) {
        sse_text_of(buf, i, "content", text, sizeof(text));
        cr_assert_str_eq(text, " :tnatsissa", "choice %d: %s", i, buf);
    }
    cr_assert_eq(count(buf, "\"role\":\"assistant\""), 2, "%s", buf);
    cr_assert_eq(count(buf, "\"finish_reason\":\"length\""), 2, "%s", buf);
    cr_assert_eq(count(buf, "\"choices\":[],\"usage\":{\"prompt_tokens\":"), 1, "%s", buf);
    cr_assert(strstr(buf, "\"completion_tokens\":22,") != NULL, "%s", buf);
    cr_assert_eq(count(buf, "data: [DONE]"), 1, "%s", buf);

    /* the limits: a 400 naming the parameter */
    st = http(http_port, "POST", "/v1/completions", "{\"model\":\"m\",\"prompt\":\"x\",\"n\":17}",
              buf, sizeof(buf));
    cr_assert_eq(st, 400, "%s", buf);
    cr_assert(strstr(buf, "\"param\":\"n\"") != NULL, "%s", buf);
    st = http(http_port, "POST", "/v1/completions",
              "{\"model\":\"m\",\"prompt\":\"x\",\"n\":2,\"best_of\":3,\"stream\":true}", buf,
              sizeof(buf));
    cr_assert_eq(st, 400, "%s", buf);
    cr_assert(strstr(buf, "\"param\":\"best_of\"") != NULL, "%s", buf);
    cr_assert_eq(http(http_port, "GET", "/metrics", NULL, buf, sizeof(buf)), 200);
    cr_assert(strstr(buf, "duet_router_request_results_total{endpoint=\"/v1/completions\","
                          "result=\"ok\"} 1") != NULL,
              "%s", buf);
    stop_all();
}

/* A failing choice fails the response and cancels its siblings; a disconnect cancels all n. */
Test(router_cluster, n_choices_fail_and_cancel_together, .timeout = 90)
{
    static char buf[65536];
    start_router(NULL, NULL);
    start_worker("gen", "gen-0", "--delay-ms", "50", NULL);
    start_worker("gen", "gen-1", "--die-after", "2", NULL);
    start_worker("ctx", "ctx-0", NULL, NULL, NULL);
    cr_assert_eq(wait_status("/health", 200, 3000), 200);
    /* choice 0 on gen-0 (slow), choice 1 on gen-1, which dies: 502 before anything was sent */
    int st = http(http_port, "POST", "/v1/completions",
                  "{\"model\":\"m\",\"prompt\":\"a long enough prompt\",\"max_tokens\":100,"
                  "\"n\":2}",
                  buf, sizeof(buf));
    cr_assert_eq(st, 502, "%s", buf);
    cr_assert(strstr(buf, "\"error\":{") != NULL, "%s", buf);
    cr_assert(has_event("gen-0", "cancel 1 another choice of the request failed", 3000) ||
                  has_event("gen-0", "cancel 2 another choice of the request failed", 100),
              "the choice on gen-0 was not cancelled");

    /* a disconnect mid-stream cancels both choices (requests 3 and 4 on gen-0, the one left) */
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)http_port)};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    const char *body = "{\"model\":\"m\",\"prompt\":\"a long enough prompt\",\"max_tokens\":200,"
                       "\"stream\":true,\"n\":2}";
    char req[1024];
    int n = snprintf(req, sizeof(req),
                     "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %zu\r\n\r\n%s",
                     strlen(body), body);
    cr_assert_eq(write(fd, req, (size_t)n), n);
    char rb[4096];
    size_t at = 0;
    rb[0] = '\0';
    while (strstr(rb, "data:") == NULL && at < sizeof(rb) - 1) {
        ssize_t r = read(fd, rb + at, sizeof(rb) - 1 - at);
        cr_assert_gt(r, 0);
        at += (size_t)r;
        rb[at] = '\0';
    }
    close(fd);
    cr_assert(has_event("gen-0", "cancel 3 client disconnected", 3000), "choice 0 not cancelled");
    cr_assert(has_event("gen-0", "cancel 4 client disconnected", 3000), "choice 1 not cancelled");
    stop_all();
}

/* GET /v1/models/{model}: the list's one object for the served id (percent escapes decoded, as
 * clients send a '/' of "org/name"), OpenAI's 404 for another; an unknown path is a 404 naming
 * method and path whatever the method, a known one with another method a 405. */
Test(router_cluster, model_retrieve_and_unknown_urls, .timeout = 60)
{
    static char buf[65536], list[4096];
    start_router(NULL, NULL);
    cr_assert_eq(http(http_port, "GET", "/v1/models", NULL, buf, sizeof(buf)), 200, "%s", buf);
    /* the list's one object: {"object":"list","data":[OBJ]} */
    const char *obj = strstr(body_of(buf), "[{");
    cr_assert_not_null(obj, "%s", buf);
    snprintf(list, sizeof(list), "%s", obj + 1);
    cr_assert_str_eq(list + strlen(list) - 2, "]}", "%s", buf);
    list[strlen(list) - 2] = '\0';
    for (int i = 0; i < 2; i++) {
        const char *path = i == 0 ? "/v1/models/m" : "/v1/models/%6D"; /* %6D = 'm' */
        cr_assert_eq(http(http_port, "GET", path, NULL, buf, sizeof(buf)), 200, "%s", buf);
        cr_assert_str_eq(body_of(buf), list, "%s: not the list's object", path);
    }
    static const struct {
        const char *method, *path;
        int status;
        const char *code, *message;
    } bad[] = {
        {"GET", "/v1/models/org%2Fm", 404, "model_not_found", "The model `org/m` does not exist"},
        {"GET", "/v1/models/m/", 404, "model_not_found", "The model `m/` does not exist"},
        {"GET", "/v1/models/m%", 404, "model_not_found", "The model `m%` does not exist"},
        {"GET", "/v1/models/%00m", 404, "model_not_found", "The model `%00m` does not exist"},
        {"GET", "/v1/models/", 404, "unknown_url", "Invalid URL (GET /v1/models/)"},
        {"POST", "/v1/embeddings", 404, "unknown_url", "Invalid URL (POST /v1/embeddings)"},
        {"DELETE", "/v1/nothing", 404, "unknown_url", "Invalid URL (DELETE /v1/nothing)"},
        {"POST", "/v1/models/m", 405, "method_not_allowed", "use GET"},
        {"GET", "/v1/completions", 405, "method_not_allowed", "use POST"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        const int st = http(http_port, bad[i].method, bad[i].path,
                            bad[i].status == 405 ? "{}" : NULL, buf, sizeof(buf));
        cr_expect_eq(st, bad[i].status, "%s %s: %s", bad[i].method, bad[i].path, buf);
        char code[64];
        snprintf(code, sizeof(code), "\"code\":\"%s\"", bad[i].code);
        cr_expect(strstr(body_of(buf), code) != NULL, "%s %s: %s", bad[i].method, bad[i].path, buf);
        cr_expect(strstr(body_of(buf), bad[i].message) != NULL, "%s %s: %s", bad[i].method,
                  bad[i].path, buf);
    }
    /* the metrics' path label is the route's, not the id asked for */
    cr_assert_eq(http(http_port, "GET", "/metrics", NULL, buf, sizeof(buf)), 200);
    cr_expect(strstr(buf, "path=\"/v1/models/{model}\",status=\"200\"} 2") != NULL, "%s", buf);
    cr_expect(strstr(buf, "path=\"/v1/models/{model}\",status=\"404\"} 4") != NULL, "%s", buf);
    cr_expect(strstr(buf, "org%2Fm") == NULL, "%s", buf);
    stop_all();
}

/* api.key from DUET_API_KEY: every API route needs the bearer key; health and metrics do not. */
Test(router_cluster, api_key_guards_the_api_routes, .timeout = 60)
{
    static char buf[65536];
    setenv("DUET_API_KEY", "sk-test-1", 1);
    start_router(NULL, NULL);
    unsetenv("DUET_API_KEY");
    start_worker("gen", "gen-0", NULL, NULL, NULL);
    start_worker("ctx", "ctx-0", NULL, NULL, NULL);
    cr_assert_eq(wait_status("/health", 200, 3000), 200, "/health is open");
    cr_assert_eq(http(http_port, "GET", "/metrics", NULL, buf, sizeof(buf)), 200);
    static const struct {
        const char *method, *path, *body;
        int ok_status;
    } routes[] = {
        {"GET", "/v1/models", NULL, 200},
        {"GET", "/v1/models/m", NULL, 200},
        {"POST", "/v1/completions", "{\"model\":\"m\",\"prompt\":\"hi\",\"max_tokens\":2}", 200},
        {"POST", "/v1/chat/completions",
         "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
         "\"max_tokens\":1}",
         200},
        {"POST", "/tokenize", "{\"prompt\":\"hi\"}", 200},
        {"POST", "/detokenize", "{\"tokens\":[104]}", 200},
        {"GET", "/v1/nothing-here", NULL, 404},
    };
    for (size_t i = 0; i < sizeof(routes) / sizeof(routes[0]); i++) {
        const char *m = routes[i].method, *p = routes[i].path, *b = routes[i].body;
        cr_assert_eq(http(http_port, m, p, b, buf, sizeof(buf)), 401, "%s without a key: %s", p,
                     buf);
        cr_assert(strstr(buf, "WWW-Authenticate: Bearer") != NULL, "%s", buf);
        cr_assert(strstr(body_of(buf), "\"code\":\"invalid_api_key\"") != NULL, "%s", buf);
        cr_assert(strstr(body_of(buf), "didn't provide an API key") != NULL, "%s", buf);
        cr_assert_eq(http_auth(http_port, m, p, b, "Bearer sk-test-2", buf, sizeof(buf)), 401,
                     "%s with a wrong key", p);
        cr_assert(strstr(body_of(buf), "Incorrect API key") != NULL, "%s", buf);
        cr_assert_eq(http_auth(http_port, m, p, b, "Basic sk-test-1", buf, sizeof(buf)), 401);
        cr_assert_eq(http_auth(http_port, m, p, b, "Bearer sk-test-", buf, sizeof(buf)), 401);
        cr_assert_eq(http_auth(http_port, m, p, b, "bearer  sk-test-1 ", buf, sizeof(buf)),
                     routes[i].ok_status, "%s with the key: %s", p, buf);
    }
    stop_all();
}

/* api.strict: an unknown request field is OpenAI's 400 (without it, ignored). */
Test(router_cluster, api_strict_refuses_unknown_fields, .timeout = 60)
{
    static char buf[65536];
    start_router("--api.strict", NULL);
    start_worker("gen", "gen-0", NULL, NULL, NULL);
    cr_assert_eq(wait_status("/health", 200, 3000), 200);
    int st = http(http_port, "POST", "/v1/completions",
                  "{\"model\":\"m\",\"prompt\":\"hi\",\"max_tokens\":2,\"guided_regex\":\"x\"}",
                  buf, sizeof(buf));
    cr_assert_eq(st, 400, "%s", buf);
    cr_assert(strstr(body_of(buf), "\"code\":\"unrecognized_argument\"") != NULL, "%s", buf);
    cr_assert(strstr(body_of(buf), "\"param\":\"guided_regex\"") != NULL, "%s", buf);
    stop_all();
}

/* Occurrences of needle in the router's log. */
static int router_log_count(const char *needle)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/router.log", dir);
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    static char line[4096];
    int n = 0;
    while (fgets(line, sizeof(line), f) != NULL)
        n += strstr(line, needle) != NULL;
    fclose(f);
    return n;
}

/* Without api.strict an unknown field is ignored, and logged once per name however often it
 * comes. */
Test(router_cluster, unknown_fields_ignored_and_logged_once_per_name, .timeout = 60)
{
    static char buf[65536];
    start_router("--log.level", "debug");
    start_worker("gen", "gen-0", NULL, NULL, NULL);
    start_worker("ctx", "ctx-0", NULL, NULL, NULL);
    cr_assert_eq(wait_status("/health", 200, 3000), 200);
    static const char *const bodies[] = {
        "{\"model\":\"m\",\"prompt\":\"hi\",\"max_tokens\":2,\"guided_regex\":\"x\"}",
        "{\"model\":\"m\",\"prompt\":\"hi\",\"max_tokens\":2,\"guided_regex\":\"y\"}",
        ("{\"model\":\"m\",\"prompt\":\"hi\",\"max_tokens\":2,\"guided_regex\":1,"
         "\"my_field\":[]}"),
    };
    for (size_t i = 0; i < 3; i++)
        cr_assert_eq(http(http_port, "POST", "/v1/completions", bodies[i], buf, sizeof(buf)), 200,
                     "body %zu: %s", i, buf);
    usleep(200000); /* the log lines reach the file */
    cr_expect_eq(router_log_count("unknown request field 'guided_regex'"), 1);
    cr_expect_eq(router_log_count("unknown request field 'my_field'"), 1);
    stop_all();
}

Test(router_cluster, client_disconnect_sends_cancel, .timeout = 60)
{
    start_router(NULL, NULL);
    start_worker("gen", "gen-0", "--delay-ms", "50", NULL);
    start_worker("ctx", "ctx-0", NULL, NULL, NULL);
    cr_assert_eq(wait_status("/health", 200, 3000), 200);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)http_port)};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    const char *body = "{\"model\":\"m\",\"prompt\":\"a long enough prompt\",\"max_tokens\":200,"
                       "\"stream\":true}";
    char req[1024];
    int n = snprintf(req, sizeof(req),
                     "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %zu\r\n\r\n%s",
                     strlen(body), body);
    cr_assert_eq(write(fd, req, (size_t)n), n);
    char buf[4096];
    size_t at = 0;
    while (strstr(buf, "data:") == NULL && at < sizeof(buf) - 1) { /* the first chunks */
        buf[at] = '\0';
        ssize_t r = read(fd, buf + at, sizeof(buf) - 1 - at);
        cr_assert_gt(r, 0);
        at += (size_t)r;
        buf[at] = '\0';
    }
    close(fd); /* mid-stream */
    cr_assert(has_event("gen-0", "cancel 1 client disconnected", 3000),
              "the gen worker did not get Cancel");
    stop_all();
}

Test(router_cluster, dead_ctx_prefill_is_retried_once_elsewhere, .timeout = 60)
{
    static char buf[65536];
    start_router(NULL, NULL);
    start_worker("gen", "gen-0", NULL, NULL, NULL);
    start_worker("ctx", "ctx-bad", "--die-after", "0", NULL); /* id 2: picked first */
    start_worker("ctx", "ctx-good", NULL, NULL, NULL);        /* id 3 */
    int st =
        http(http_port, "POST", "/v1/completions",
             "{\"model\":\"m\",\"prompt\":\"hello world\",\"max_tokens\":5}", buf, sizeof(buf));
    cr_assert_eq(st, 200, "%s", buf);
    cr_assert(strstr(buf, "\"text\":\"dlrow\"") != NULL, "%s", buf);
    cr_assert(has_event("ctx-bad", "prefill 1", 100));
    cr_assert(has_event("ctx-good", "prefill 1", 100));
    cr_assert_eq(http(http_port, "GET", "/metrics", NULL, buf, sizeof(buf)), 200);
    cr_assert(strstr(buf, "duet_router_prefill_retries_total 1") != NULL, "%s", buf);
    cr_assert(strstr(buf, "duet_router_workers{role=\"ctx\",state=\"dead\"} 1") != NULL, "%s", buf);
    stop_all();
}

Test(router_cluster, heartbeat_loss_fails_request_with_clear_error, .timeout = 60)
{
    static char buf[65536];
    start_router(NULL, NULL);
    start_worker("gen", "gen-0", "--stall-after", "2", NULL);
    start_worker("ctx", "ctx-0", NULL, NULL, NULL);
    cr_assert_eq(wait_status("/health", 200, 3000), 200);
    /* ctx gives token 1, gen token 2, then the gen worker goes silent (still connected) */
    int st =
        http(http_port, "POST", "/v1/completions",
             "{\"model\":\"m\",\"prompt\":\"hello world\",\"max_tokens\":8}", buf, sizeof(buf));
    cr_assert_eq(st, 502, "%s", buf);
    cr_assert(strstr(buf, "gen worker 1 (gen-0) lost: heartbeat timeout") != NULL, "%s", buf);
    cr_assert_eq(wait_status("/health", 503, 2000), 503, "no gen capacity left");
    /* streaming: the failure after the first token is an SSE error event */
    start_worker("gen", "gen-1", "--stall-after", "2", NULL);
    cr_assert_eq(wait_status("/health", 200, 3000), 200);
    st = http(http_port, "POST", "/v1/completions",
              "{\"model\":\"m\",\"prompt\":\"hello world\",\"max_tokens\":8,\"stream\":true}", buf,
              sizeof(buf));
    cr_assert_eq(st, 200, "%s", buf);
    cr_assert(strstr(buf, "\"error\"") != NULL && strstr(buf, "heartbeat timeout") != NULL, "%s",
              buf);
    stop_all();
}

Test(router_cluster, refused_reservations_429_and_wrong_version_refused, .timeout = 60)
{
    static char buf[65536];
    start_router(NULL, NULL);
    start_worker("gen", "gen-0", "--refuse", "--refuse-retry-ms", "0");
    start_worker("ctx", "ctx-0", NULL, NULL, NULL);
    int st =
        http(http_port, "POST", "/v1/completions",
             "{\"model\":\"m\",\"prompt\":\"hello world\",\"max_tokens\":5}", buf, sizeof(buf));
    cr_assert_eq(st, 429, "refused for good (no retry hint): at once: %s", buf);
    cr_assert(strstr(buf, "Retry-After: 1") != NULL, "%s", buf);
    cr_assert(strstr(buf, "refuses every reservation") != NULL, "%s", buf);
    cr_assert(strstr(buf, "\"code\":\"no_reservation\"") != NULL, "%s", buf);

    /* a worker with another protocol version or fingerprint is refused and exits (status 4) */
    char rt[64];
    snprintf(rt, sizeof(rt), "127.0.0.1:%d", worker_port);
    char *v[] = {WORKER, "--router", rt, "--role", "gen", "--proto-version", "99", "--quiet", NULL};
    pid_t p = spawn(v, "old.log");
    int ws;
    cr_assert_eq(waitpid(p, &ws, 0), p);
    cr_assert(WIFEXITED(ws) && WEXITSTATUS(ws) == 4);
    char *f[] = {WORKER,          "--router", rt,        "--role", "gen",
                 "--fingerprint", "other",    "--quiet", NULL};
    p = spawn(f, "fp.log");
    cr_assert_eq(waitpid(p, &ws, 0), p);
    cr_assert(WIFEXITED(ws) && WEXITSTATUS(ws) == 4);
    n_pids -= 2;
    stop_all();
}

/* Once the cluster is healthy, POST a 3-token completion of "hello world"; its status, the
 * answer in buf and *took_ms how long it took. */
static int post_hello_timed(char *buf, size_t cap, uint64_t *took_ms)
{
    cr_assert_eq(wait_status("/health", 200, 3000), 200);
    const uint64_t t0 = now_ms();
    int st = http(http_port, "POST", "/v1/completions",
                  "{\"model\":\"m\",\"prompt\":\"hello world\",\"max_tokens\":3}", buf, cap);
    *took_ms = now_ms() - t0;
    return st;
}

/* A gen worker that refuses for want of room now (a retry hint, 2 s here) does not fail the
 * request: it waits at the head of the admission queue, is tried again once the hint has passed,
 * and is answered when the worker takes it. */
Test(router_cluster, refused_for_room_waits_in_the_queue, .timeout = 60)
{
    static char buf[65536];
    start_router(NULL, NULL);
    start_worker("gen", "gen-0", "--refuse-first", "2", NULL);
    start_worker("ctx", "ctx-0", NULL, NULL, NULL);
    uint64_t took;
    int st = post_hello_timed(buf, sizeof(buf), &took);
    cr_assert_eq(st, 200, "%s", buf);
    cr_assert(strstr(buf, "\"text\":\"dlr\"") != NULL, "%s", buf);
    cr_expect_geq(took, 4000, "two refusals with a 2 s hint each: answered after %llu ms",
                  (unsigned long long)took);
    cr_expect_eq(router_log_count("back in the admission queue"), 1, "said once per request");
    cr_assert_eq(http(admin_port, "GET", "/admin/admission", NULL, buf, sizeof(buf)), 200);
    cr_expect(strstr(body_of(buf), "\"requeued_total\":2") != NULL, "%s", buf);
    cr_expect(strstr(body_of(buf), "\"in_flight\":0") != NULL, "%s", buf);
    cr_assert_eq(http(http_port, "GET", "/metrics", NULL, buf, sizeof(buf)), 200);
    cr_expect(strstr(buf, "duet_router_admission_requeued_total 2") != NULL, "%s", buf);
    stop_all();
}

/* One that never takes it: the request ends with the admission queue's 503 at its queue timeout
 * (1.5 s here), not a 429 and not a hang. */
Test(router_cluster, refused_for_room_until_the_queue_timeout_is_a_503, .timeout = 60)
{
    static char buf[65536];
    start_router("--admission.queue_timeout_ms", "1500");
    start_worker("gen", "gen-0", "--refuse", NULL, NULL);
    start_worker("ctx", "ctx-0", NULL, NULL, NULL);
    uint64_t took;
    int st = post_hello_timed(buf, sizeof(buf), &took);
    cr_assert_eq(st, 503, "%s", buf);
    cr_assert(strstr(body_of(buf), "\"code\":\"queue_timeout\"") != NULL, "%s", buf);
    cr_expect(took >= 1400 && took < 5000, "ended after %llu ms", (unsigned long long)took);
    cr_assert_eq(http(admin_port, "GET", "/admin/admission", NULL, buf, sizeof(buf)), 200);
    cr_expect(strstr(body_of(buf), "\"in_flight\":0") != NULL, "%s", buf);
    cr_expect(strstr(body_of(buf), "\"queued\":0") != NULL, "%s", buf);
    stop_all();
}

/* A fake gen worker answering as a Helix group of 3 ranks: the router carries rank 0's reservation
 * and the two more, unchanged and in order, into the Prefill (the fake ctx worker logs them as
 * they came; the line must match whole). */
Test(router_cluster, group_reservations_reach_the_prefill, .timeout = 60)
{
    static char buf[65536];
    start_router(NULL, NULL);
    start_worker("gen", "gen-0", "--group-ranks", "3", NULL);
    start_worker("ctx", "ctx-0", NULL, NULL, NULL);
    int st =
        http(http_port, "POST", "/v1/completions",
             "{\"model\":\"m\",\"prompt\":\"hello world\",\"max_tokens\":5}", buf, sizeof(buf));
    cr_assert_eq(st, 200, "%s", buf);
    cr_assert(strstr(body_of(buf), "\"text\":\"dlrow\"") != NULL, "%s", buf);
    cr_assert(has_event("ctx-0",
                        "reservations 1 test-reservation:1 test-reservation:1:1 "
                        "test-reservation:1:2\n",
                        1000),
              "the Prefill did not carry the group's reservations as sent");
    stop_all();

    /* one generation worker: rank 0's reservation alone */
    start_router(NULL, NULL);
    start_worker("gen", "gen-0", NULL, NULL, NULL);
    start_worker("ctx", "ctx-0", NULL, NULL, NULL);
    st = http(http_port, "POST", "/v1/completions",
              "{\"model\":\"m\",\"prompt\":\"hello world\",\"max_tokens\":5}", buf, sizeof(buf));
    cr_assert_eq(st, 200, "%s", buf);
    cr_assert(has_event("ctx-0", "reservations 1 test-reservation:1\n", 1000));
    stop_all();
}

/* 65 reservations (a group larger than DUET_XFER_MAX_RANKS): a bad Reserved, the request fails
 * with an error naming the worker, and the ctx worker never sees it. */
Test(router_cluster, too_many_group_reservations_fail_the_request, .timeout = 60)
{
    static char buf[65536];
    start_router(NULL, NULL);
    start_worker("gen", "gen-0", "--group-ranks", "65", NULL);
    start_worker("ctx", "ctx-0", NULL, NULL, NULL);
    int st =
        http(http_port, "POST", "/v1/completions",
             "{\"model\":\"m\",\"prompt\":\"hello world\",\"max_tokens\":5}", buf, sizeof(buf));
    cr_assert_eq(st, 502, "%s", buf);
    cr_assert(strstr(buf, "generation worker 1 sent a bad reservation: 65 reservations exceed a "
                          "group's 64 ranks") != NULL,
              "%s", buf);
    cr_assert(has_event("gen-0", "cancel 1", 1000), "the gen worker was not told to let go");
    cr_assert(!has_event("ctx-0", "prefill", 200));
    stop_all();
}

Test(router_cluster, drain_through_the_admin_api, .timeout = 60)
{
    static char buf[65536];
    start_router(NULL, NULL);
    start_worker("gen", "gen-0", NULL, NULL, NULL);
    start_worker("ctx", "ctx-0", NULL, NULL, NULL);
    cr_assert_eq(wait_status("/health", 200, 3000), 200);
    int st = http(admin_port, "POST", "/admin/workers/gen-0/drain", "", buf, sizeof(buf));
    cr_assert_eq(st, 200, "%s", buf);
    cr_assert(has_event("gen-0", "drain", 2000));
    cr_assert_eq(wait_status("/health", 503, 2000), 503, "the only gen worker drains");
    st = http(http_port, "POST", "/v1/completions",
              "{\"model\":\"m\",\"prompt\":\"hello world\",\"max_tokens\":5}", buf, sizeof(buf));
    cr_assert_eq(st, 503, "never placed on a draining worker: %s", buf);
    st = http(admin_port, "GET", "/admin/workers", NULL, buf, sizeof(buf));
    cr_assert_eq(st, 200);
    cr_assert(strstr(buf, "draining") != NULL, "%s", buf);
    st = http(admin_port, "POST", "/admin/workers/gen-0/undrain", "", buf, sizeof(buf));
    cr_assert_eq(st, 200, "%s", buf);
    cr_assert_eq(wait_status("/health", 200, 2000), 200);
    st = http(http_port, "POST", "/v1/completions",
              "{\"model\":\"m\",\"prompt\":\"hello world\",\"max_tokens\":5}", buf, sizeof(buf));
    cr_assert_eq(st, 200, "%s", buf);
    stop_all();
}

/* Run one completion in a child process; its exit status is 0 when the answer was 200. */
static pid_t request_in_child(const char *body)
{
    pid_t p = fork();
    cr_assert_geq(p, 0);
    if (p == 0) {
        static char out[65536];
        _exit(http(http_port, "POST", "/v1/completions", body, out, sizeof(out)) == 200 ? 0 : 1);
    }
    return p;
}

Test(router_cluster, admission_queue_429_and_pause_through_the_admin_api, .timeout = 60)
{
    static char buf[65536];
    static const char *body = "{\"model\":\"m\",\"prompt\":\"hello world\",\"max_tokens\":3}";
    start_router("--admission.max-inflight=1", "--admission.max-queue=1");
    start_worker("gen", "gen-0", "--delay-ms", "300", NULL); /* ~1 s per request */
    start_worker("ctx", "ctx-0", NULL, NULL, NULL);
    cr_assert_eq(wait_status("/health", 200, 3000), 200);
    /* one runs, one waits in the queue, the third finds the queue full */
    pid_t a = request_in_child(body);
    usleep(200000);
    pid_t b = request_in_child(body);
    usleep(200000);
    int st = http(http_port, "POST", "/v1/completions", body, buf, sizeof(buf));
    cr_assert_eq(st, 429, "queue full: %s", buf);
    cr_assert(strstr(buf, "Retry-After: ") != NULL, "%s", buf);
    int ws;
    cr_assert_eq(waitpid(a, &ws, 0), a);
    cr_assert(WIFEXITED(ws) && WEXITSTATUS(ws) == 0, "the running request completes");
    cr_assert_eq(waitpid(b, &ws, 0), b);
    cr_assert(WIFEXITED(ws) && WEXITSTATUS(ws) == 0, "the queued request runs after it");
    /* paused admission answers 503; resumed, requests run again */
    st = http(admin_port, "POST", "/admin/admission/pause", "", buf, sizeof(buf));
    cr_assert_eq(st, 200, "%s", buf);
    st = http(http_port, "POST", "/v1/completions", body, buf, sizeof(buf));
    cr_assert_eq(st, 503, "paused: %s", buf);
    st = http(admin_port, "POST", "/admin/admission/resume", "", buf, sizeof(buf));
    cr_assert_eq(st, 200, "%s", buf);
    st = http(http_port, "POST", "/v1/completions", body, buf, sizeof(buf));
    cr_assert_eq(st, 200, "resumed: %s", buf);
    stop_all();
}

/* Lines of the events file of `name` that start with `prefix`. */
static int count_events(const char *name, const char *prefix)
{
    char path[512], line[512];
    snprintf(path, sizeof(path), "%s/%s.events", dir, name);
    FILE *f = fopen(path, "r");
    int n = 0;
    while (f != NULL && fgets(line, sizeof(line), f) != NULL)
        n += strncmp(line, prefix, strlen(prefix)) == 0;
    if (f != NULL)
        fclose(f);
    return n;
}

/* text's prompt ids (the byte tokenizer: <|bos|> = 256, then one id per byte) as "256,I,J,..." */
static void ids_of(const char *text, char *out, size_t cap)
{
    size_t n = (size_t)snprintf(out, cap, "256");
    for (const char *p = text; *p != '\0' && n < cap; p++)
        n += (size_t)snprintf(out + n, cap - n, ",%u", (unsigned)(unsigned char)*p);
    cr_assert_lt(n, cap);
}

/* The router's duet_router_prefix_placements_total{role="ROLE"}, -1 when absent. */
static double prefix_placements(const char *role)
{
    static char buf[262144];
    cr_assert_eq(http(http_port, "GET", "/metrics", NULL, buf, sizeof(buf)), 200);
    char key[96];
    snprintf(key, sizeof(key), "duet_router_prefix_placements_total{role=\"%s\"} ", role);
    const char *p = strstr(buf, key);
    return p != NULL ? strtod(p + strlen(key), NULL) : -1;
}

/* 99 bytes each (100 tokens with <|bos|>: six whole 16-token blocks before the last token),
 * different from the first byte on */
#define PROMPT_P                                                                                   \
    "Pack my box with five dozen liquor jugs, then weigh the crate twice and write the sums on "   \
    "its lids."
#define PROMPT_Q                                                                                   \
    "Quick zephyrs blow, vexing daft Jim; the sailors reef the mainsail and steer their sloops "   \
    "home now."

/*
 * Placement by cached prefix, with the workers' summaries faked (--prefix-ids): gen-1 "holds" all
 * of P but its last 4 tokens, fewer than placement.local_prefill_tokens (8), so P is prefilled
 * there (Generate) every time, never on gen-0 nor a ctx worker; ctx-1 "holds" 96 tokens of Q, so
 * every Prefill of Q goes to ctx-1. With placement.prefix_aware off, round robin as ever.
 */
static void prefix_case(bool aware)
{
    static char buf[65536], ids_p[1024], ids_q[1024];
    cr_assert_eq(strlen(PROMPT_P), 99);
    cr_assert_eq(strlen(PROMPT_Q), 99);
    ids_of(PROMPT_P, ids_p, sizeof(ids_p));
    ids_of(PROMPT_Q, ids_q, sizeof(ids_q));
    start_router("--placement.local-prefill-tokens=8",
                 aware ? "--placement.prefix-aware" : "--no-placement.prefix-aware");
    start_worker("gen", "gen-0", NULL, NULL, NULL);
    start_worker("gen", "gen-1", "--prefix-ids", ids_p, NULL);
    start_worker("ctx", "ctx-0", NULL, NULL, NULL);
    start_worker("ctx", "ctx-1", "--prefix-ids", ids_q, NULL);
    cr_assert_eq(wait_status("/health", 200, 3000), 200);
    usleep(400000); /* heartbeats (100 ms) bring the summaries */
    const char *bodies[] = {"{\"model\":\"m\",\"prompt\":\"" PROMPT_P "\",\"max_tokens\":2}",
                            "{\"model\":\"m\",\"prompt\":\"" PROMPT_Q "\",\"max_tokens\":2}"};
    for (int i = 0; i < 4; i++) {
        int st = http(http_port, "POST", "/v1/completions", bodies[i % 2], buf, sizeof(buf));
        cr_assert_eq(st, 200, "%s", buf);
        /* the prompt reversed: its last two bytes */
        cr_assert(strstr(body_of(buf), i % 2 ? "\"text\":\".w\"" : "\"text\":\".s\"") != NULL, "%s",
                  buf);
        cr_assert(strstr(buf, "\"prompt_tokens\":100,") != NULL, "%s", buf);
    }
    if (aware) {
        cr_assert_eq(count_events("gen-1", "generate"), 2, "P prefilled where it is cached");
        cr_assert_eq(count_events("gen-0", "generate") + count_events("gen-0", "reserve") +
                         count_events("gen-1", "reserve"),
                     2, "Q reserved (round robin), P never");
        cr_assert_eq(count_events("ctx-1", "prefill"), 2, "Q prefilled where it is cached");
        cr_assert_eq(count_events("ctx-0", "prefill"), 0);
        cr_assert_eq(prefix_placements("gen"), 2);
        cr_assert_eq(prefix_placements("ctx"), 2);
    } else {
        cr_assert_eq(count_events("gen-0", "generate") + count_events("gen-1", "generate"), 0);
        cr_assert_eq(count_events("gen-0", "reserve"), 2, "round robin");
        cr_assert_eq(count_events("gen-1", "reserve"), 2, "round robin");
        cr_assert_eq(count_events("ctx-0", "prefill"), 2, "round robin");
        cr_assert_eq(count_events("ctx-1", "prefill"), 2, "round robin");
        cr_assert_eq(prefix_placements("gen"), 0);
        cr_assert_eq(prefix_placements("ctx"), 0);
    }
    stop_all();
}

Test(router_cluster, placement_by_cached_prefix, .timeout = 60)
{
    prefix_case(true);
}

Test(router_cluster, placement_by_cached_prefix_off_is_round_robin, .timeout = 60)
{
    prefix_case(false);
}
