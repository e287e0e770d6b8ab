/*
 * The cluster end to end: duet-router + duet-ctx + duet-gen processes on loopback serving the
 * bundled demo model (models/duet-demo), against duet-generate as the reference.
 *
 *   greedy_32_concurrent_equal_duet_generate  32 concurrent requests of mixed lengths (prompts
 *        over many KV pages, ctx pages of 16 tokens into gen pages of 32, prompts cut in several
 *        prefill chunks, and short ones prefilled on the gen worker itself) give exactly
 *        duet-generate's text and token count; every prompt token is prefilled exactly once
 *        (router metric); afterwards every page is back on every worker (admin API)
 *   client_cancel_frees_pages_on_both_workers  a client that goes away mid-prefill and one that
 *        goes away mid-stream: both workers end up with all pages free and nothing running;
 *        then seeded sampling (temperature 0.8, top_p 0.95) equals duet-generate --seed on the
 *        disaggregated and the local path
 *   ctx_killed_during_prefill_is_retried  kill -9 of the context worker that is prefilling:
 *        the request is prefilled again on the other one and still equals duet-generate;
 *        with no other context worker it fails with a clear error; no pages leak
 *   a_stopped_ctx_worker_puts_into_no_reused_page  a context worker stopped 2 s (under the
 *        heartbeat timeout) while its transfer is held and its client leaves: a local request
 *        decoding meanwhile still equals duet-generate (no late put lands in its pages)
 *   ctx_stopped_mid_transfer_fails_with_the_reservations_end  SIGTERM of the context worker
 *        whose transfer is held (test.xfer_hold_ms): the request fails at once with the gen
 *        worker's reason (a retry on the other one is cancelled), no pages leak
 *   gen_killed_fails_its_requests_router_stays_healthy  kill -9 of a generation worker mid-stream:
 *        its requests end with a clear error, the other worker's complete, /health stays 200 and
 *        new requests succeed; the router's cache-plan gauges are twice duet-gen
 *        --print-cache-plan's figures before the kill and once after
 *   perf_gates_on_the_real_cluster  duet-bench against the cluster: a baseline the cluster meets
 *        passes (exit 0; the server-side metrics avg_decoded_tokens_per_iter = 1 and
 *        device_step_time_ms come through the router), an impossible one fails (exit 3)
 *   drain_under_load_loses_nothing  draining a generation worker while 12 requests run: all
 *        complete correctly, drain --wait returns, new requests avoid the drained worker
 *   drain_migrate_moves_requests_mid_decode  drain --migrate --wait while greedy requests decode:
 *        gen-0's move to gen-1 mid-decode, every answer equals duet-generate's, the drain returns
 *        while streams still run, every page comes back
 *   drain_migrate_faults_end_once_and_free_every_page  a move's target killed, its deadline
 *        passing (the request goes on at the source, equal to duet-generate), its source killed
 *        (the request ends once, naming the worker); every page back on the live workers
 *   vllm_metrics_move_under_traffic_and_pass_promtool  the router's vLLM-named series before,
 *        during and after traffic: gauges rise and fall back, counters and histograms grow by
 *        exactly the requests' figures, promtool accepts each scrape, one access line a request,
 *        a stats line with the traffic and none while idle; ctx-0 with log.format json writes
 *        only JSON lines (ts, level, msg, src), the run-time level change among them;
 *        each worker's own /metrics (listed by the router's /metrics/targets): cache, prefill
 *        and decode counters, transfers (duet_xfer_*) grow by the requests' figures
 *
 * With speculative decoding on the generation workers (cluster_spec: prompt lookup, spec.k 2 and
 * 4; the draft model variant needs models/duet-demo-draft):
 *   greedy_equal_duet_generate_k2_k4  requests of mixed lengths in flight together (verify rows,
 *        plain rows and the gen worker's own prefill chunks share steps; streamed and not) give
 *        exactly duet-generate's text and token count without speculation; the router's metrics
 *        show several tokens per decode step, verify steps by tokens emitted and drafts proposed /
 *        kept per position, consistent with each other and with the tokens the clients got;
 *        its workers run on a GPU when there is one (greedy tokens have no seeded draw to differ)
 *   client_cancel_frees_pages_on_both_workers, gen_killed_fails_its_requests_router_stays_healthy,
 *   drain_under_load_loses_nothing, drain_migrate_moves_requests_mid_decode  the bodies above
 *        with speculation on (drain_migrate_with_the_draft_model: the migrate body with the
 *        draft model, rebuilt on the target) (seeded sampling then
 *        equals duet-generate with the same spec keys and seed)
 *   duet_up_local_spec_yaml_answers  `duet up deploy/configs/local-spec.yaml --once` (prompt
 *        lookup standing in for the draft model) answers the sample as duet-generate does
 *
 * Generation groups (cluster_group; docs/architecture.md, "Generation groups"): gen workers started
 * by mpirun as helix.cp x helix.tp ranks:
 *   cp2_ / cp4_ / tp2_greedy_equal_duet_generate  requests of mixed lengths (prompts over fewer KV
 *        pages than ranks and over many; prefilled by the context worker into every rank's pools
 *        and by the group itself) give exactly duet-generate's text and token count; every page
 *        back; no rank left after the stop
 *   a_rank_killed_fails_the_groups_requests_once  kill -9 of rank 1 of a CP=2 group beside a plain
 *        worker: the group's requests fail naming it, the other's complete, new requests
 *        succeed, the job ends and leaves no rank
 *   a_stalled_rank_fails_the_group_in_bounded_time  SIGSTOP of rank 1: rank 0's collective times
 *        out (helix.timeout_ms), its requests end with the group's reason, the job ends
 *   drain_of_a_group_loses_nothing  drain_under_load_loses_nothing with gen-0 a CP=2 group
 *   duet_up_local_cp2_yaml_answers  `duet up deploy/configs/local-cp2.yaml --once` answers the
 *        sample as duet-generate does, its generation worker a CP=2 group
 *
 * Across network namespaces (cluster_netns; needs root and iproute2, fails without them): the
 * router, a context worker and two generation workers each in its own namespace, joined by veths
 * through a bridge (10.213.<pid % 250>.0/24), UCX over tcp on the veth only (ucx.tls,
 * ucx.net_devices), so every router message and KV transfer crosses a real interface:
 *   greedy_equal_and_a_cut_link_fails_its_requests_once  each worker logs the UCX variables its
 *        keys set; short and long (moved from the context worker) prompts give exactly
 *        duet-generate's text; gen-0's link set down while streams decode and prompts arrive: its
 *        requests end once with an error within 30 s, the others complete equal to
 *        duet-generate, every page is back on the live workers, a new request succeeds. The
 *        cut-off worker stays cut (two gen workers, so the cluster goes on): a worker that
 *        came back would have to re-register, which is not what this checks. Namespaces and
 *        links are named dnt<pid>; the fini and the next run's start remove them.
 *
 * Every process runs with one compute thread so the suite fits the 2-core CI machine.
 */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tests/unit/test_run.h"
#include "tests/integration/test_ports.h"

#define ROUTER   DUET_BINARY_DIR "/router/duet-router"
#define CTX      DUET_BINARY_DIR "/ctx_worker/duet-ctx"
#define GEN      DUET_BINARY_DIR "/gen_worker/duet-gen"
#define GENERATE DUET_BINARY_DIR "/engine/duet-generate"
#define BENCH    DUET_BINARY_DIR "/bench/duet-bench"
#define UP       DUET_BINARY_DIR "/deploy/launcher/duet"
#define MODEL    DUET_SOURCE_DIR "/models/duet-demo"
#define DRAFT    DUET_SOURCE_DIR "/models/duet-demo-draft"

#define CTX_PAGES   400 /* 16-token pages */
#define GEN_PAGES   300 /* 32-token pages (a test may start its gen workers with fewer) */
#define LOCAL_BELOW 24
#define CHUNK       64

static char dir[256];
static int http_port, worker_port, admin_port;
static const char *http_host =
    "127.0.0.1"; /* the router's address (cluster_netns: its namespace) */
/* cluster_netns: > 0 while the namespaces dnt<netns_id>-{a,b,c,d} exist; their 10.x.y subnet */
static int netns_id;
static char netns_net[16];
static pid_t pids[16];
static char names[16][32];
static int n_pids;

/* Set by a test before start_cluster: its context workers log at DEBUG (the handshake wait). */
static int ctx_debug;

/* --device of every worker: auto (a GPU when there is one). The fault tests that kill a worker
 * mid-prefill or mid-decode pin it to cpu: on a GPU the work ends long before the kill lands. */
static const char *worker_device = "auto";

/* Set by a test before start_cluster: the generation workers speculate with these spec.method and
 * spec.k (NULL: they do not), and seeded references use the same keys. */
static const char *spec_method, *spec_k;

static void speculate(const char *method, const char *k)
{
    spec_method = method;
    spec_k = k;
    /* the seeded (sampling) references are duet-generate's on the CPU, and a GPU's logits differ
     * from the CPU's within rounding, enough to change a sampled token: CPU workers here (GPU
     * speculation: test_engine_cuda spec_verify_matches_cpu) */
    worker_device = "cpu";
}

/* gen-0's command line in the last start_cluster, shell-quoted (check_cache_gauges reruns it) */
static char gen_cmd[4096];

/* Set by a test before start_cluster: gen-0 (or every gen worker with helix_all) is a generation
 * group of helix_cp x helix_tp ranks started by mpirun (docs/architecture.md, "Generation
 * groups"); 0: plain processes. Its cache.kv_pages are per rank; it reports cp times as many. */
static int helix_cp, helix_tp, helix_all;

/* placement.local_prefill_tokens: prompts shorter than this are prefilled by the gen worker */
static int local_below = LOCAL_BELOW;
/* the gen workers' cache.kv_pages in the next start_cluster */
static int gen_pages = GEN_PAGES;
/* extra flags for the router / every gen worker in the next start_cluster (NULL-ended) */
static const char *router_extra[5], *gen_extra[5], *ctx_extra[5];

/* ---------------------------------------------------------------- processes and HTTP */

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/*
 * cluster_netns: one namespace per process (router a, ctx-0 b, gen-0 c, gen-1 d), each with
 * one veth into a bridge in the test's namespace; address 10.213.S.<1..4>, the bridge .254.
 * Process names map to namespace letters; interface names stay under IFNAMSIZ (15).
 */
static char netns_letter(const char *name)
{
    if (strcmp(name, "router") == 0)
        return 'a';
    if (strncmp(name, "ctx-", 4) == 0)
        return 'b';
    if (strncmp(name, "gen-", 4) == 0)
        return (char)('c' + atoi(name + 4) % 2);
    return 0;
}

/* In the child: exec argv in name's namespace through `ip netns exec`, with the role's network
 * keys (the router binds its address, a worker's UCX uses tcp on its veth only). */
static void netns_exec(const char *name, char *const argv[])
{
    const char l = netns_letter(name);
    static char ns[32], dev[32], ip[32];
    snprintf(ns, sizeof(ns), "dnt%d-%c", netns_id, l);
    snprintf(dev, sizeof(dev), "dnt%dn%c", netns_id, l);
    snprintf(ip, sizeof(ip), "%s.%d", netns_net, l - 'a' + 1);
    char *nargv[96];
    size_t n = 0;
    nargv[n++] = "ip";
    nargv[n++] = "netns";
    nargv[n++] = "exec";
    nargv[n++] = ns;
    for (size_t a = 0; argv[a] != NULL && n < 80; a++)
        nargv[n++] = argv[a];
    if (l == 'a') {
        const char *keys[] = {"--http.host", "--workers.host", "--admin.host"};
        for (size_t k = 0; k < 3; k++) {
            nargv[n++] = (char *)keys[k];
            nargv[n++] = ip;
        }
    } else {
        nargv[n++] = "--ucx.tls";
        nargv[n++] = "tcp";
        nargv[n++] = "--ucx.net_devices";
        nargv[n++] = dev;
    }
    nargv[n] = NULL;
    execvp("ip", nargv);
    _exit(127);
}

static pid_t spawn(const char *name, char *const argv[])
{
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        char path[512];
        snprintf(path, sizeof(path), "%s/%s.log", dir, name);
        int fd = open(path, O_WRONLY | O_CREAT | O_APPEND, 0644);
        dup2(fd, 1);
        dup2(fd, 2);
        setenv("DUET_LOG_LEVEL", ctx_debug && strncmp(name, "ctx-", 4) == 0 ? "debug" : "info", 1);
        /* tcp: dead peers are detected, not only timed out. DUET_TEST_UCX_TLS replaces the list
         * (a GPU run adds cuda_copy,cuda_ipc so that a CUDA-built UCX moves device pools) */
        const char *tls = getenv("DUET_TEST_UCX_TLS");
        setenv("UCX_TLS", tls != NULL ? tls : "tcp,self,sm", 1);
        setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 1);
        /* a generation group's mpirun: ranks over shared memory, root allowed (CI runs as root) */
        setenv("OMPI_MCA_pml", "ob1", 1);
        setenv("OMPI_MCA_btl", "self,vader", 1);
        setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none", 1);
        setenv("OMPI_MCA_oob_tcp_if_include", "lo", 1);
        setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
        setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
        if (netns_id > 0)
            netns_exec(name, argv);
        execv(argv[0], argv);
        _exit(127);
    }
    snprintf(names[n_pids], sizeof(names[0]), "%s", name);
    pids[n_pids++] = pid;
    return pid;
}

static pid_t pid_of(const char *name)
{
    for (int i = 0; i < n_pids; i++)
        if (strcmp(names[i], name) == 0)
            return pids[i];
    return -1;
}

/* Open a connection and send one request; returns the fd (or -1). */
static int http_send(int port, const char *method, const char *path, const char *body)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, http_host, &a.sin_addr);
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        close(fd);
        return -1;
    }
    size_t blen = body != NULL ? strlen(body) : 0;
    char *req = malloc(blen + 512);
    int n = snprintf(req, blen + 512,
                     "%s %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: "
                     "application/json\r\nContent-Length: %zu\r\n\r\n%s",
                     method, path, blen, body != NULL ? body : "");
    ssize_t w = write(fd, req, (size_t)n);
    free(req);
    if (w != n) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Read the whole response (until close or timeout_ms of silence) into out. Returns the status. */
static int http_recv(int fd, char *out, size_t cap, int timeout_ms)
{
    size_t at = 0;
    for (;;) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, timeout_ms) <= 0)
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

static int http(int port, const char *method, const char *path, const char *body, char *out,
                size_t cap)
{
    int fd = http_send(port, method, path, body);
    if (fd < 0)
        return -1;
    return http_recv(fd, out, cap, 120000);
}

static const char *body_of(const char *resp)
{
    const char *b = strstr(resp, "\r\n\r\n");
    return b != NULL ? b + 4 : "";
}

/* DUET_TEST_PREFIX_CACHE set: every worker not in a group runs with cache.prefix (the
 * test_cluster_prefix entry: the cluster suite with the prefix caches on). */
static bool prefix_cache_on(void)
{
    return getenv("DUET_TEST_PREFIX_CACHE") != NULL;
}

/* Admin API: sum of running over workers and whether every live worker has all its pages (free,
 * or held by its prefix cache alone: nothing runs). */
static int workers_idle(int expect_workers)
{
    static char buf[65536];
    if (http(admin_port, "GET", "/admin/workers", NULL, buf, sizeof(buf)) != 200)
        return 0;
    json_error_t e;
    json_t *o = json_loads(body_of(buf), 0, &e);
    json_t *a = json_is_array(o) ? o : json_object_get(o, "workers");
    int ok = json_is_array(a), live = 0;
    for (size_t i = 0; ok && i < json_array_size(a); i++) {
        json_t *w = json_array_get(a, i);
        const char *state = json_string_value(json_object_get(w, "state"));
        const char *role = json_string_value(json_object_get(w, "role"));
        if (state == NULL || strcmp(state, "dead") == 0)
            continue;
        live++;
        json_t *load = json_object_get(w, "load");
        int pages = (int)(json_integer_value(json_object_get(load, "free_pages")) +
                          json_integer_value(json_object_get(load, "prefix_pages")));
        int run = (int)json_integer_value(json_object_get(load, "running"));
        const char *wname = json_string_value(json_object_get(w, "name"));
        int want = role != NULL && strcmp(role, "ctx") == 0 ? CTX_PAGES : gen_pages;
        if (helix_cp > 0 && wname != NULL && strncmp(wname, "gen-", 4) == 0 &&
            (helix_all || strcmp(wname, "gen-0") == 0))
            want *= helix_cp;
        const json_int_t slots = json_integer_value(json_object_get(load, "state_slots"));
        if (pages != want || run != 0 ||
            json_integer_value(json_object_get(load, "free_state_slots")) != slots || slots == 0)
            ok = 0;
    }
    json_decref(o);
    return ok && live == expect_workers;
}

static void wait_idle(int expect_workers, int ms)
{
    uint64_t end = now_ms() + (uint64_t)ms;
    while (now_ms() < end) {
        if (workers_idle(expect_workers))
            return;
        usleep(50000);
    }
    static char buf[65536];
    http(admin_port, "GET", "/admin/workers", NULL, buf, sizeof(buf));
    cr_assert(0, "workers did not return every page within %d ms: %s", ms, body_of(buf));
}

static int wait_workers(int n_up, int ms)
{
    static char buf[65536];
    uint64_t end = now_ms() + (uint64_t)ms;
    while (now_ms() < end) {
        if (http(http_port, "GET", "/health", NULL, buf, sizeof(buf)) == 200) {
            json_t *o = json_loads(body_of(buf), 0, NULL);
            int got = (int)(json_integer_value(json_object_get(o, "gen_workers")) +
                            json_integer_value(json_object_get(o, "ctx_workers")));
            json_decref(o);
            if (got == n_up)
                return 1;
        }
        usleep(50000);
    }
    return 0;
}

static void start_cluster(int n_ctx, int n_gen)
{
    static char gen_kv_pages[16];
    snprintf(gen_kv_pages, sizeof(gen_kv_pages), "%d", gen_pages);
    char tmpl[] = "/tmp/duet-cluster-test-XXXXXX";
    cr_assert_not_null(mkdtemp(tmpl));
    snprintf(dir, sizeof(dir), "%s", tmpl);
    http_port = free_port();
    worker_port = free_port();
    admin_port = free_port();
    char hp[16], wp[16], ap[16], lp[16], rt[64];
    snprintf(hp, sizeof(hp), "%d", http_port);
    snprintf(wp, sizeof(wp), "%d", worker_port);
    snprintf(ap, sizeof(ap), "%d", admin_port);
    snprintf(lp, sizeof(lp), "%d", local_below);
    snprintf(rt, sizeof(rt), "%s:%d", http_host, worker_port);
    char *rargv[] = {ROUTER,
                     "--model",
                     MODEL,
                     "--http.port",
                     hp,
                     "--workers.port",
                     wp,
                     "--admin.port",
                     ap,
                     "--admin.insecure-no-token",
                     "--placement.local_prefill_tokens",
                     lp,
                     "--placement.policy",
                     "round_robin",
                     "--workers.heartbeat-timeout-ms",
                     "5000",
                     "--admission.max_inflight",
                     "64",
                     NULL,
                     NULL,
                     NULL,
                     NULL,
                     NULL};
    size_t rtail = 0; /* the first empty slot */
    while (rargv[rtail] != NULL)
        rtail++;
    for (size_t e = 0; router_extra[e] != NULL; e++)
        rargv[rtail + e] = (char *)router_extra[e];
    spawn("router", rargv);
    for (int i = 0; i < n_ctx; i++) {
        char name[16];
        snprintf(name, sizeof(name), "ctx-%d", i);
        char *argv[] = {CTX,        "--router",
                        rt,         "--model",
                        MODEL,      "--name",
                        name,       "--threads",
                        "1",        "--cache.page_tokens",
                        "16",       "--cache.kv_pages",
                        "400",      "--batch.prefill_chunk",
                        "64",       "--batch.max_tokens",
                        "256",      "--batch.max_seqs",
                        "8",        "--heartbeat_ms",
                        "100",      "--transfer.checksum",
                        "--device", (char *)worker_device,
                        "--dtype",  "f32",
                        NULL,       NULL, /* DUET_TEST_PREFIX_CACHE, ctx_extra */
                        NULL,       NULL,
                        NULL,       NULL};
        size_t tail = 0; /* the first empty slot */
        while (argv[tail] != NULL)
            tail++;
        if (prefix_cache_on())
            argv[tail++] = "--cache.prefix";
        for (size_t e = 0; ctx_extra[e] != NULL; e++)
            argv[tail++] = (char *)ctx_extra[e];
        spawn(name, argv);
    }
    for (int i = 0; i < n_gen; i++) {
        char name[16];
        snprintf(name, sizeof(name), "gen-%d", i);
        char *argv[] = {GEN,
                        "--router",
                        rt,
                        "--model",
                        MODEL,
                        "--name",
                        name,
                        "--threads",
                        "1",
                        "--cache.page_tokens",
                        "32",
                        "--cache.kv_pages",
                        gen_kv_pages,
                        "--batch.prefill_chunk",
                        "64",
                        "--batch.max_tokens",
                        "256",
                        "--batch.max_seqs",
                        "40",
                        "--heartbeat_ms",
                        "100",
                        "--cache.quarantine_ms",
                        "500",
                        "--device",
                        (char *)worker_device,
                        "--dtype",
                        "f32",
                        NULL, /* speculation's four flags, the draft model's two, extras, */
                        NULL, /* DUET_TEST_PREFIX_CACHE */
                        NULL,
                        NULL,
                        NULL,
                        NULL,
                        NULL,
                        NULL,
                        NULL,
                        NULL,
                        NULL,
                        NULL,
                        NULL};
        size_t tail = 0; /* the first empty slot */
        while (argv[tail] != NULL)
            tail++;
        for (size_t e = 0; gen_extra[e] != NULL; e++)
            argv[tail++] = (char *)gen_extra[e];
        const bool grouped = helix_cp * helix_tp > 1 && (helix_all || i == 0);
        if (prefix_cache_on() && !grouped) /* a group refuses it (sharded sequences) */
            argv[tail++] = "--cache.prefix";
        if (spec_method != NULL) {
            const size_t at = tail;
            argv[at] = "--spec.method";
            argv[at + 1] = (char *)spec_method;
            argv[at + 2] = "--spec.k";
            argv[at + 3] = (char *)spec_k;
            if (strcmp(spec_method, "draft") == 0) {
                argv[at + 4] = "--spec.draft-model";
                argv[at + 5] = DRAFT;
            }
        }
        /* a group: mpirun -n cp*tp <the same command> --helix.cp C --helix.tp T */
        static char np[16], hcp[16], htp[16];
        char *margv[64];
        if (helix_cp * helix_tp > 1 && (helix_all || i == 0)) {
            snprintf(np, sizeof(np), "%d", helix_cp * helix_tp);
            snprintf(hcp, sizeof(hcp), "%d", helix_cp);
            snprintf(htp, sizeof(htp), "%d", helix_tp);
            size_t m = 0;
            const char *pre[] = {DUET_MPIEXEC,
                                 "--oversubscribe",
                                 "--allow-run-as-root",
                                 "--bind-to",
                                 "none",
                                 "-n",
                                 np};
            for (size_t k = 0; k < sizeof(pre) / sizeof(pre[0]); k++)
                margv[m++] = (char *)pre[k];
            for (size_t a = 0; argv[a] != NULL; a++)
                margv[m++] = argv[a];
            const char *post[] = {"--helix.cp", hcp, "--helix.tp", htp, NULL};
            for (size_t k = 0; k < sizeof(post) / sizeof(post[0]); k++)
                margv[m++] = (char *)post[k];
            spawn(name, margv);
            continue;
        }
        if (i == 0) {
            gen_cmd[0] = '\0';
            for (size_t a = 0; argv[a] != NULL; a++) {
                size_t at = strlen(gen_cmd);
                snprintf(gen_cmd + at, sizeof(gen_cmd) - at, "%s'%s'", a > 0 ? " " : "", argv[a]);
            }
        }
        spawn(name, argv);
    }
    cr_assert(wait_workers(n_ctx + n_gen, 30000), "the cluster did not come up (logs in %s)", dir);
}

static void stop_all(void)
{
    for (int i = n_pids - 1; i >= 0; i--) {
        if (pids[i] <= 0) /* reaped by the test already */
            continue;
        kill(pids[i], SIGTERM);
        int st;
        for (int k = 0; k < 150 && waitpid(pids[i], &st, WNOHANG) == 0; k++)
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

/* ---------------------------------------------------------------- prompts and references */

static const char *const corpus =
    "In the beginning God created the heaven and the earth. And the earth was without form, "
    "and void; and darkness was upon the face of the deep. And the Spirit of God moved upon the "
    "face of the waters. And God said, Let there be light: and there was light. And God saw the "
    "light, that it was good: and God divided the light from the darkness. And God called the "
    "light Day, and the darkness he called Night. And the evening and the morning were the first "
    "day. And God said, Let there be a firmament in the midst of the waters, and let it divide "
    "the waters from the waters. And God made the firmament, and divided the waters which were "
    "under the firmament from the waters which were above the firmament: and it was so.";

typedef struct {
    char prompt[1024];
    int max_tokens;
    char *want_text; /* duet-generate's */
    int want_tokens;
    char *got_text;
    int got_tokens;
    int status;
    int stream;
    int ignore_eos;
    int seed;         /* > 0: sample at temperature 0.8, top_p 0.95 with this seed */
    int delay_ms;     /* run_job waits this long before sending */
    uint64_t done_ms; /* now_ms() when the answer had come */
} job_t;

static void prompt_of(job_t *j, int i, int len, int max_tokens)
{
    size_t n = strlen(corpus);
    size_t off = ((size_t)i * 53) % (n - 1);
    size_t at = 0;
    for (int k = 0; k < len; k++)
        j->prompt[at++] = corpus[(off + (size_t)k) % n];
    j->prompt[at] = '\0';
    j->max_tokens = max_tokens;
}

/* JSON-escape s into out. */
static void json_str(const char *s, char *out, size_t cap)
{
    json_t *v = json_string(s);
    char *t = json_dumps(v, JSON_ENCODE_ANY);
    snprintf(out, cap, "%s", t);
    free(t);
    json_decref(v);
}

/* duet-generate's greedy continuation (same prefill chunk as the workers). */
static void reference(job_t *j)
{
    char outpath[512], mt[16];
    snprintf(outpath, sizeof(outpath), "%s/ref.json", dir);
    snprintf(mt, sizeof(mt), "%d", j->max_tokens);
    pid_t p = fork();
    cr_assert_geq(p, 0);
    if (p == 0) {
        int fd = open(outpath, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(fd, 1);
        int nul = open("/dev/null", O_WRONLY);
        dup2(nul, 2);
        char seed[16];
        snprintf(seed, sizeof(seed), "%d", j->seed);
        /* f32 here and in every worker: a GPU's --dtype auto would compute this bf16 model in
         * bf16, and the fault tests' CPU workers compute in f32 */
        /* a seeded request's tokens depend on speculation (the draws are used differently),
         * greedy ones never do: those are compared with plain decoding */
        if (j->seed > 0 && spec_method != NULL)
            execl(GENERATE, GENERATE, "--model", MODEL, "--prompt", j->prompt, "--max-tokens", mt,
                  "--prefill-chunk", "64", "--threads", "1", "--dtype", "f32", "--json",
                  "--temperature", "0.8", "--top-p", "0.95", "--seed", seed, "--spec.method",
                  spec_method, "--spec.k", spec_k, "--spec.draft-model", DRAFT, "--device", "cpu",
                  (char *)NULL); /* on the CPU, as the workers speculate (speculate) */
        if (j->seed > 0)
            execl(GENERATE, GENERATE, "--model", MODEL, "--prompt", j->prompt, "--max-tokens", mt,
                  "--prefill-chunk", "64", "--threads", "1", "--dtype", "f32", "--json",
                  "--temperature", "0.8", "--top-p", "0.95", "--seed", seed, (char *)NULL);
        execl(GENERATE, GENERATE, "--model", MODEL, "--prompt", j->prompt, "--max-tokens", mt,
              "--prefill-chunk", "64", "--threads", "1", "--dtype", "f32", "--json",
              j->ignore_eos ? "--ignore-eos" : (char *)NULL, (char *)NULL);
        _exit(127);
    }
    int st;
    waitpid(p, &st, 0);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "duet-generate failed");
    json_error_t e;
    json_t *o = json_load_file(outpath, 0, &e);
    cr_assert_not_null(o, "duet-generate output: %s", e.text);
    j->want_text = strdup(json_string_value(json_object_get(o, "text")));
    j->want_tokens = (int)json_array_size(json_object_get(o, "tokens"));
    json_decref(o);
}

/* Concatenate the "text" of every SSE chunk; the usage chunk gives completion_tokens. */
static void parse_sse(job_t *j, const char *body)
{
    size_t cap = strlen(body) + 1, at = 0;
    j->got_text = calloc(1, cap);
    for (const char *p = strstr(body, "data: "); p != NULL; p = strstr(p, "data: ")) {
        p += 6;
        const char *e = strstr(p, "\n\n");
        if (e == NULL)
            break;
        if (strncmp(p, "[DONE]", 6) != 0) {
            json_t *o = json_loadb(p, (size_t)(e - p), 0, NULL);
            json_t *c = json_array_get(json_object_get(o, "choices"), 0);
            const char *t = json_string_value(json_object_get(c, "text"));
            if (t != NULL) {
                memcpy(j->got_text + at, t, strlen(t));
                at += strlen(t);
            }
            const char *err =
                json_string_value(json_object_get(json_object_get(o, "error"), "message"));
            if (err != NULL) { /* an error event ends a started stream */
                j->got_text = realloc(j->got_text, cap += strlen(err) + 16);
                at += (size_t)sprintf(j->got_text + at, "\n[error] %s", err);
            }
            json_t *u = json_object_get(o, "usage");
            if (json_is_object(u))
                j->got_tokens = (int)json_integer_value(json_object_get(u, "completion_tokens"));
            json_decref(o);
        }
        p = e;
    }
}

static void *run_job(void *arg)
{
    job_t *j = arg;
    if (j->delay_ms > 0)
        usleep((useconds_t)j->delay_ms * 1000);
    char ps[2048];
    json_str(j->prompt, ps, sizeof(ps));
    char body[4096];
    char sampling[96] = "\"temperature\":0";
    if (j->seed > 0)
        snprintf(sampling, sizeof(sampling), "\"temperature\":0.8,\"top_p\":0.95,\"seed\":%d",
                 j->seed);
    snprintf(body, sizeof(body), "{\"model\":\"duet-demo\",\"prompt\":%s,\"max_tokens\":%d,%s%s%s}",
             ps, j->max_tokens, sampling,
             j->stream ? ",\"stream\":true,\"stream_options\":{\"include_usage\":true}" : "",
             j->ignore_eos ? ",\"ignore_eos\":true" : "");
    static __thread char resp[1 << 20];
    j->status = http(http_port, "POST", "/v1/completions", body, resp, sizeof(resp));
    j->done_ms = now_ms();
    if (j->status != 200) {
        j->got_text = strdup(resp);
        return NULL;
    }
    if (j->stream) {
        parse_sse(j, body_of(resp));
        return NULL;
    }
    json_t *o = json_loads(body_of(resp), 0, NULL);
    json_t *c = json_array_get(json_object_get(o, "choices"), 0);
    const char *t = json_string_value(json_object_get(c, "text"));
    j->got_text = strdup(t != NULL ? t : "(no text)");
    j->got_tokens =
        (int)json_integer_value(json_object_get(json_object_get(o, "usage"), "completion_tokens"));
    json_decref(o);
    return NULL;
}

static double metric(const char *name)
{
    static char buf[1 << 18];
    if (http(http_port, "GET", "/metrics", NULL, buf, sizeof(buf)) != 200)
        return -1;
    char pat[128];
    snprintf(pat, sizeof(pat), "\n%s ", name);
    const char *p = strstr(buf, pat);
    return p != NULL ? atof(p + strlen(pat)) : -1;
}

/* An integer of duet-gen --print-cache-plan's JSON (pool NULL: top level; a null pool: 0). */
static double plan_figure(json_t *o, const char *pool, const char *key)
{
    json_t *p = pool != NULL ? json_object_get(o, pool) : o;
    if (json_is_null(p))
        return 0;
    json_t *v = json_object_get(p, key);
    cr_assert(json_is_integer(v), "--print-cache-plan: %s.%s missing", pool ? pool : "", key);
    return (double)json_integer_value(v);
}

/*
 * The router's cache-plan gauges are the sums over n_gen live generation workers of the plan
 * duet-gen --print-cache-plan prints for the same flags (every gen worker of start_cluster has
 * gen-0's). Waits up to 3 s: the figures come with the workers' heartbeats, and a worker that
 * died leaves the sums only once the router has noticed.
 */
static void check_cache_gauges(int n_gen)
{
    static char out[1 << 16];
    char cmd[sizeof(gen_cmd) + 64];
    snprintf(cmd, sizeof(cmd), "%s --print-cache-plan 2>/dev/null", gen_cmd);
    cr_assert_eq(test_run(cmd, out, sizeof(out)), 0, "%s\n%s", cmd, out);
    json_error_t je;
    json_t *o = json_loads(out, 0, &je);
    cr_assert_not_null(o, "--print-cache-plan: not JSON: %s (%s)", je.text, out);
    static const struct {
        const char *metric, *pool, *key;
    } g[] = {
        {"duet_gen_cache_budget_bytes", NULL, "budget_bytes"},
        {"duet_gen_cache_target_pages", "target", "pages"},
        {"duet_gen_cache_target_bytes", "target", "bytes"},
        {"duet_gen_cache_draft_pages", "draft", "pages"},
        {"duet_gen_cache_draft_bytes", "draft", "bytes"},
    };
    enum { NG = sizeof(g) / sizeof(g[0]) };
    double want[NG], got[NG];
    for (int i = 0; i < NG; i++)
        want[i] = n_gen * plan_figure(o, g[i].pool, g[i].key);
    json_decref(o);
    cr_assert_gt(want[1], 0, "the plan gives the target pages: %s", out);
    if (spec_method != NULL && strcmp(spec_method, "draft") == 0)
        cr_assert_gt(want[3], 0, "the plan gives the drafter pages: %s", out);
    uint64_t end = now_ms() + 3000;
    for (;;) {
        int same = 1;
        for (int i = 0; i < NG; i++) {
            got[i] = metric(g[i].metric);
            same &= got[i] == want[i];
        }
        if (same || now_ms() >= end)
            break;
        usleep(50000);
    }
    for (int i = 0; i < NG; i++)
        cr_expect_eq(got[i], want[i], "%s: %.0f, want %d x %s%s%s = %.0f", g[i].metric, got[i],
                     n_gen, g[i].pool ? g[i].pool : "", g[i].pool ? "." : "", g[i].key, want[i]);
}

static void check_job(const job_t *j, int i)
{
    cr_expect_eq(j->status, 200, "request %d: HTTP %d: %s", i, j->status, j->got_text);
    cr_expect_str_eq(j->got_text, j->want_text,
                     "request %d (%zu-byte prompt, max_tokens %d): cluster text differs from "
                     "duet-generate's",
                     i, strlen(j->prompt), j->max_tokens);
    cr_expect_eq(j->got_tokens, j->want_tokens, "request %d: token count", i);
}

/* Sends every job at once, each from its own thread, and checks each answer (check_job). */
static void run_jobs_and_check(job_t *jobs, int n)
{
    pthread_t *th = calloc((size_t)n, sizeof(*th));
    cr_assert_not_null(th);
    for (int i = 0; i < n; i++)
        pthread_create(&th[i], NULL, run_job, &jobs[i]);
    for (int i = 0; i < n; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < n; i++)
        check_job(&jobs[i], i);
    free(th);
}

/*
 * A context worker's first prefill step of a prompt waits for the UCX handshake with the prompt's
 * generation worker (ctx_main.c, CTX_CONNECT_WAIT_S = 2 s): during a step UCX moves only between
 * layers, and a handshake left pending over a step once crashed a generation worker's UCX when
 * the context worker was killed. Each such step logs (DEBUG) how long after the transfer began
 * it ran and whether the handshake had completed; every line must say "connected" or show the
 * whole 2 s bound spent. Without the wait, a prompt towards a new peer steps at once, before the
 * peer can have answered. Returns how many first steps the log holds.
 */
static int check_first_steps_connected(const char *worker)
{
    char path[512], line[1024];
    snprintf(path, sizeof(path), "%s/%s.log", dir, worker);
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    int n = 0;
    while (fgets(line, sizeof(line), f) != NULL) {
        const char *p = strstr(line, "first prefill step ");
        if (p == NULL)
            continue;
        double ms = -1.0;
        char state[32] = "";
        int got =
            sscanf(p, "first prefill step %lf ms after the transfer started (%31[^)])", &ms, state);
        cr_expect_eq(got, 2, "%s: unreadable line: %s", worker, line);
        cr_expect(strcmp(state, "connected") == 0 || ms >= 2000.0,
                  "%s: a first prefill step ran %.2f ms after its transfer began, %s: %s", worker,
                  ms, state, line);
        n++;
    }
    fclose(f);
    return n;
}

/* ---------------------------------------------------------------- tests */

Test(cluster, greedy_32_concurrent_equal_duet_generate, .timeout = 300)
{
    static const int lens[] = {3,   9,   15,  20,  22,  25,  31,  40,  63,  64,  65,
                               90,  127, 128, 129, 150, 200, 255, 256, 257, 300, 333,
                               400, 450, 500, 511, 520, 5,   12,  18,  70,  140};
    enum { N = 32 };
    static job_t jobs[N];
    ctx_debug = 1;
    start_cluster(2, 2);
    ctx_debug = 0;
    uint64_t prompt_tokens = 0;
    for (int i = 0; i < N; i++) {
        memset(&jobs[i], 0, sizeof(jobs[i]));
        prompt_of(&jobs[i], i, lens[i], 8 + (i * 7) % 41);
        jobs[i].stream = i % 3 == 0;
        reference(&jobs[i]);
        prompt_tokens += (uint64_t)lens[i] + 1; /* + BOS */
    }
    double before = metric("duet_worker_prefill_tokens_total");
    run_jobs_and_check(jobs, N);
    wait_idle(4, 10000);
    usleep(400000); /* a heartbeat carries the last counters */
    double after = metric("duet_worker_prefill_tokens_total");
    cr_expect_eq((uint64_t)(after - before), prompt_tokens,
                 "every prompt token is prefilled exactly once (on a ctx or, for short prompts, "
                 "the gen worker): %.0f vs %llu",
                 after - before, (unsigned long long)prompt_tokens);
    cr_expect_gt(metric("duet_gen_decode_steps_total"), 0);
    for (int i = 0; i < N; i++) {
        free(jobs[i].want_text);
        free(jobs[i].got_text);
    }
    /* which pools the transfers moved (each worker logs it at start); a GPU run with a
     * CUDA-built UCX sets DUET_TEST_EXPECT_DEVICE_POOLS to require the device pools */
    const int expect_dev = getenv("DUET_TEST_EXPECT_DEVICE_POOLS") != NULL;
    static const char *const ws[] = {"ctx-0", "ctx-1", "gen-0", "gen-1"};
    for (int i = 0; i < 4; i++) {
        char path[512], line[1024];
        snprintf(path, sizeof(path), "%s/%s.log", dir, ws[i]);
        FILE *f = fopen(path, "r");
        cr_assert_not_null(f, "%s", path);
        int dev = -1;
        while (fgets(line, sizeof(line), f) != NULL)
            if (strstr(line, "transfers move the ") != NULL)
                dev = strstr(line, "transfers move the device pools") != NULL;
        fclose(f);
        cr_expect_neq(dev, -1, "%s did not say which pools its transfers move", ws[i]);
        printf("cluster: %s transfers move the %s pools\n", ws[i], dev == 1 ? "device" : "host");
        if (expect_dev)
            cr_expect_eq(dev, 1,
                         "%s: DUET_TEST_EXPECT_DEVICE_POOLS, but it staged through the "
                         "host pools",
                         ws[i]);
    }
    /* round robin: both context workers prefill a share of the long prompts */
    const int first0 = check_first_steps_connected("ctx-0"),
              first1 = check_first_steps_connected("ctx-1");
    printf("cluster: %d + %d first prefill steps, each after its handshake\n", first0, first1);
    cr_expect(first0 >= 2 && first1 >= 2, "first prefill steps logged: %d, %d", first0, first1);
    stop_all();
}

/* ---------------------------------------------------------------- observability */

#define VLLM_MODEL "{model_name=\"duet-demo\"}"

/* The value of one exposition series ("name{labels}", exactly as rendered) in text; -1: absent. */
static double series_in(const char *text, const char *series)
{
    char pat[256];
    snprintf(pat, sizeof(pat), "\n%s ", series);
    const char *p = strstr(text, pat);
    return p != NULL ? atof(p + strlen(pat)) : -1;
}

/* GET /metrics into out (the body); the status. */
static int scrape(int port, char *out, size_t cap)
{
    static char buf[1 << 18];
    int st = http(port, "GET", "/metrics", NULL, buf, sizeof(buf));
    snprintf(out, cap, "\n%s", body_of(buf)); /* a leading newline: series_in finds line 1 */
    return st;
}

/* tests/tools/promtool_check.sh on an exposition (kept in the test's folder as name). */
static void promtool_ok(const char *text, const char *name)
{
    char path[512], cmd[1024], out[4096];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs(text + 1, f);
    fclose(f);
    snprintf(cmd, sizeof(cmd), "%s/tests/tools/promtool_check.sh %s 2>&1", DUET_SOURCE_DIR, path);
    cr_assert_eq(test_run(cmd, out, sizeof(out)), 0, "%s: %s", name, out);
}

/*
 * GET /metrics/targets on the router: the http_sd list of the workers' /metrics, one target per
 * worker labelled with its role and name; their ports.
 */
static void worker_metrics_ports(int *ctx_port, int *gen_port)
{
    static char buf[65536];
    cr_assert_eq(http(http_port, "GET", "/metrics/targets", NULL, buf, sizeof(buf)), 200);
    json_error_t je;
    json_t *a = json_loads(body_of(buf), 0, &je);
    cr_assert(json_is_array(a) && json_array_size(a) == 2, "/metrics/targets: %s", body_of(buf));
    for (size_t i = 0; i < 2; i++) {
        json_t *t = json_array_get(a, i);
        json_t *targets = json_object_get(t, "targets");
        cr_assert(json_is_array(targets) && json_array_size(targets) == 1, "%s", body_of(buf));
        const char *hp = json_string_value(json_array_get(targets, 0));
        const char *role = json_string_value(json_object_get(json_object_get(t, "labels"), "role"));
        const char *name =
            json_string_value(json_object_get(json_object_get(t, "labels"), "worker"));
        cr_assert(hp != NULL && role != NULL && name != NULL, "%s", body_of(buf));
        int port = 0;
        cr_assert_eq(sscanf(hp, "127.0.0.1:%d", &port), 1, "target %s", hp);
        cr_assert_str_eq(name, strcmp(role, "ctx") == 0 ? "ctx-0" : "gen-0");
        *(strcmp(role, "ctx") == 0 ? ctx_port : gen_port) = port;
    }
    json_decref(a);
    cr_assert(*ctx_port > 0 && *gen_port > 0, "%s", body_of(buf));
}

/*
 * Process name logs with log.format json: every line of ours parses as an object with ts, level,
 * msg and src (others, e.g. a library's own, are not ours and are skipped: they do not start with
 * '{' nor with a date), the run-time change among them at warn, and no text line of ours.
 */
static void check_json_log(const char *name)
{
    char path[512], line[4096];
    snprintf(path, sizeof(path), "%s/%s.log", dir, name);
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    int objects = 0, warn_change = 0;
    while (fgets(line, sizeof(line), f) != NULL) {
        int y, mo, d;
        cr_expect(sscanf(line, "%4d-%2d-%2dT", &y, &mo, &d) != 3, "%s: a text line: %s", name,
                  line);
        if (line[0] != '{')
            continue;
        json_error_t e;
        json_t *o = json_loads(line, 0, &e);
        cr_assert_not_null(o, "%s: not JSON (%s): %s", name, e.text, line);
        const char *lvl = json_string_value(json_object_get(o, "level"));
        const char *msg = json_string_value(json_object_get(o, "msg"));
        cr_expect(json_is_string(json_object_get(o, "ts")) && lvl != NULL && msg != NULL &&
                      json_is_string(json_object_get(o, "src")),
                  "%s: fields missing: %s", name, line);
        warn_change += lvl != NULL && msg != NULL && strcmp(lvl, "warn") == 0 &&
                       strstr(msg, "log level info -> debug") != NULL;
        objects++;
        json_decref(o);
    }
    fclose(f);
    cr_expect_gt(objects, 10, "%s: %d JSON lines", name, objects);
    cr_expect_eq(warn_change, 1, "%s: the level change at warn", name);
}

/* Lines of process name's log that hold every string of want[0..n). */
static int log_count(const char *name, const char *const *want, int n)
{
    char path[512], line[2048];
    snprintf(path, sizeof(path), "%s/%s.log", dir, name);
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    int count = 0;
    while (fgets(line, sizeof(line), f) != NULL) {
        int all = 1;
        for (int i = 0; i < n && all; i++)
            all = strstr(line, want[i]) != NULL;
        count += all;
    }
    fclose(f);
    return count;
}

/*
 * The router's vLLM-named series under traffic (docs/observability.md), and the workers' own
 * /metrics (metrics.port 0: ephemeral ports, found through the router's /metrics/targets): running
 * goes up while requests stream and back to 0; KV cache usage is above 0 and at most 1 meanwhile;
 * after N requests of P prompt tokens that each run to max_tokens M (ignore_eos), the token
 * counters grew by exactly N x P and N x M, request_success{length} by N, every request histogram
 * by N observations and the inter-token one by N x (M - 1); promtool accepts the exposition before,
 * during and after; the router logged one access line per request.
 */
Test(cluster, vllm_metrics_move_under_traffic_and_pass_promtool, .timeout = 180)
{
    /* M long enough that each request holds its pages over several 100 ms heartbeats (the KV
     * usage comes with them): at 24 a request could start and end between two, and a CI run saw
     * the usage stay 0 */
    enum { N = 6, LEN = 60, M = 128 };
    static char before[1 << 18], during[1 << 18], after[1 << 18];
    static job_t jobs[N];
    ctx_extra[0] = gen_extra[0] = "--metrics.port";
    ctx_extra[1] = gen_extra[1] = "0"; /* ephemeral: the router lists them */
    ctx_extra[2] = "--log.format";     /* ctx-0 logs JSON lines */
    ctx_extra[3] = "json";
    router_extra[0] = "--log.stats_interval_s";
    router_extra[1] = "1";
    start_cluster(1, 1);
    ctx_extra[0] = gen_extra[0] = router_extra[0] = NULL;
    cr_assert_eq(scrape(http_port, before, sizeof(before)), 200);
    int ctx_mport = 0, gen_mport = 0;
    worker_metrics_ports(&ctx_mport, &gen_mport);
    static char wbefore[2][1 << 18], wafter[2][1 << 18];
    cr_assert_eq(scrape(ctx_mport, wbefore[0], sizeof(wbefore[0])), 200);
    cr_assert_eq(scrape(gen_mport, wbefore[1], sizeof(wbefore[1])), 200);
    static const char *const series[] = {
        "vllm:num_requests_running" VLLM_MODEL,
        "vllm:num_requests_waiting" VLLM_MODEL,
        "vllm:kv_cache_usage_perc" VLLM_MODEL,
        "vllm:prompt_tokens_total" VLLM_MODEL,
        "vllm:generation_tokens_total" VLLM_MODEL,
        "vllm:num_preemptions_total" VLLM_MODEL,
        "vllm:request_success_total{model_name=\"duet-demo\",finished_reason=\"stop\"}",
        "vllm:request_success_total{model_name=\"duet-demo\",finished_reason=\"length\"}",
        "vllm:request_success_total{model_name=\"duet-demo\",finished_reason=\"abort\"}",
        "vllm:request_success_total{model_name=\"duet-demo\",finished_reason=\"error\"}",
    };
    for (size_t i = 0; i < sizeof(series) / sizeof(series[0]); i++)
        cr_assert_geq(series_in(before, series[i]), 0, "%s missing before traffic", series[i]);
    static const char *const hists[] = {
        "vllm:time_to_first_token_seconds",  "vllm:time_per_output_token_seconds",
        "vllm:e2e_request_latency_seconds",  "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
        "vllm:inter_token_latency_seconds",
    };
    enum { NH = sizeof(hists) / sizeof(hists[0]) };
    double h0[NH];
    for (int i = 0; i < NH; i++) {
        char c[128];
        snprintf(c, sizeof(c), "%s_count" VLLM_MODEL, hists[i]);
        h0[i] = series_in(before, c);
        cr_assert_geq(h0[i], 0, "%s missing before traffic", c);
    }
    promtool_ok(before, "metrics-before.txt");

    pthread_t th[N];
    for (int i = 0; i < N; i++) {
        memset(&jobs[i], 0, sizeof(jobs[i]));
        prompt_of(&jobs[i], i, LEN, M);
        jobs[i].stream = i % 2;
        jobs[i].ignore_eos = 1;
        pthread_create(&th[i], NULL, run_job, &jobs[i]);
    }
    /* during: running > 0 at some scrape; the most KV usage seen */
    double running = 0, kv = 0, gen_during = 0;
    int scraped_during = 0;
    for (uint64_t end = now_ms() + 20000; now_ms() < end;) {
        cr_assert_eq(scrape(http_port, during, sizeof(during)), 200);
        const double r = series_in(during, "vllm:num_requests_running" VLLM_MODEL);
        const double k = series_in(during, "vllm:kv_cache_usage_perc" VLLM_MODEL);
        cr_assert(k >= 0 && k <= 1, "vllm:kv_cache_usage_perc %f outside 0..1", k);
        if (r > running)
            running = r;
        if (k > kv)
            kv = k;
        if (r > 0 && !scraped_during) {
            scraped_during = 1;
            promtool_ok(during, "metrics-during.txt");
        }
        gen_during = series_in(during, "vllm:generation_tokens_total" VLLM_MODEL);
        if (r > 0 && k > 0 && gen_during > series_in(before, series[4]))
            break;
        usleep(20000);
    }
    for (int i = 0; i < N; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < N; i++) {
        cr_expect_eq(jobs[i].status, 200, "request %d: %s", i, jobs[i].got_text);
        cr_expect_eq(jobs[i].got_tokens, M, "request %d: completion tokens", i);
        free(jobs[i].got_text);
    }
    cr_expect_gt(running, 0, "vllm:num_requests_running never above 0 while %d requests ran", N);
    cr_expect_gt(kv, 0, "vllm:kv_cache_usage_perc never above 0 while %d requests ran", N);
    cr_expect_gt(gen_during, series_in(before, series[4]),
                 "vllm:generation_tokens_total did not move while requests streamed");
    wait_idle(2, 10000);
    usleep(400000); /* a heartbeat carries the free pages */
    cr_assert_eq(scrape(http_port, after, sizeof(after)), 200);
    cr_expect_eq(series_in(after, series[0]), 0, "running after the traffic");
    cr_expect_eq(series_in(after, series[1]), 0, "waiting after the traffic");
    cr_expect_eq(series_in(after, series[2]), 0, "KV cache usage once every page is back");
    cr_expect_eq(series_in(after, series[3]) - series_in(before, series[3]), N * (LEN + 1),
                 "prompt tokens: N x (prompt + BOS)");
    cr_expect_eq(series_in(after, series[4]) - series_in(before, series[4]), N * M,
                 "generation tokens");
    cr_expect_eq(series_in(after, series[7]) - series_in(before, series[7]), N,
                 "request_success{length}");
    cr_expect_eq(series_in(after, series[6]) - series_in(before, series[6]), 0,
                 "request_success{stop}");
    for (int i = 0; i < NH; i++) {
        char c[128], sum[128];
        snprintf(c, sizeof(c), "%s_count" VLLM_MODEL, hists[i]);
        snprintf(sum, sizeof(sum), "%s_sum" VLLM_MODEL, hists[i]);
        const double want = strcmp(hists[i], "vllm:inter_token_latency_seconds") == 0
                                ? N * (M - 1)
                                : N; /* per gap, else per request */
        cr_expect_eq(series_in(after, c) - h0[i], want, "%s: observations", c);
        cr_expect_geq(series_in(after, sum), 0, "%s", sum);
    }
    cr_expect_gt(series_in(after, "vllm:e2e_request_latency_seconds_sum" VLLM_MODEL), 0);
    promtool_ok(after, "metrics-after.txt");
    /* one access line per request, with its figures */
    char ct[64];
    snprintf(ct, sizeof(ct), "completion_tokens=%d ", M);
    const char *const access[] = {"INFO",
                                  "access /v1/completions status=200 finish=length",
                                  "prompt_tokens=61 ",
                                  ct,
                                  "ttft_ms=",
                                  "duration_ms="};
    cr_expect_eq(log_count("router", access, 6), N, "access lines in %s/router.log", dir);
    /* the stats line (log.stats_interval_s 1): one came with the traffic, none while idle */
    const char *const stats[] = {
        "INFO", "stats: ", " req/s, prompt ", " tok/s, generation ", "; running ", ", KV cache "};
    usleep(1200000);
    const int n_stats = log_count("router", stats, 6);
    cr_expect_geq(n_stats, 1, "no stats line in %s/router.log", dir);
    usleep(2200000);
    cr_expect_eq(log_count("router", stats, 6), n_stats, "stats lines while idle");

    /* the workers' own /metrics: cache, counters, transfers (every prompt is over LOCAL_BELOW:
     * prefilled on ctx-0, whose KV moved to gen-0 once per request) */
    cr_assert_eq(scrape(ctx_mport, wafter[0], sizeof(wafter[0])), 200);
    cr_assert_eq(scrape(gen_mport, wafter[1], sizeof(wafter[1])), 200);
    cr_expect_eq(series_in(wafter[0], "duet_worker_kv_pages"), CTX_PAGES);
    cr_expect_eq(series_in(wafter[1], "duet_worker_kv_pages"), GEN_PAGES);
    cr_expect_eq(series_in(wafter[1], "duet_worker_kv_pages_free") +
                     series_in(wafter[1], "duet_worker_prefix_cache_pages"),
                 GEN_PAGES, "all pages back (free, or the prefix cache's)");
    cr_expect_gt(series_in(wafter[1], "duet_worker_state_slots"), 0);
    cr_expect_eq(series_in(wafter[0], "duet_worker_prefill_tokens_total") -
                     series_in(wbefore[0], "duet_worker_prefill_tokens_total") +
                     series_in(wafter[0], "duet_worker_prefix_cache_tokens_saved_total") -
                     series_in(wbefore[0], "duet_worker_prefix_cache_tokens_saved_total"),
                 N * (LEN + 1), "ctx-0 prefilled every prompt token once (or had it cached)");
    cr_expect_eq(series_in(wafter[1], "duet_worker_decoded_tokens_total") -
                     series_in(wbefore[1], "duet_worker_decoded_tokens_total"),
                 N * (M - 1), "gen-0 decoded every token after the first");
    cr_expect_gt(series_in(wafter[1], "duet_worker_busy_seconds_total"), 0);
    cr_expect_geq(series_in(wafter[1], "duet_worker_spec_drafted_total{position=\"1\"}"), 0);
    const char *sent = "duet_xfer_transfers_total{role=\"send\",outcome=\"done\"}";
    const char *got = "duet_xfer_transfers_total{role=\"recv\",outcome=\"done\"}";
    cr_expect_eq(series_in(wafter[0], sent) - series_in(wbefore[0], sent), N, "%s", sent);
    cr_expect_eq(series_in(wafter[1], got) - series_in(wbefore[1], got), N, "%s", got);
    cr_expect_gt(series_in(wafter[1], "duet_xfer_bytes_total{role=\"recv\"}"), 0);
    promtool_ok(wafter[0], "metrics-ctx.txt");
    promtool_ok(wafter[1], "metrics-gen.txt");
    static char other[4096];
    cr_expect_eq(http(gen_mport, "GET", "/v1/models", NULL, other, sizeof(other)), 404);
    cr_expect_eq(http(gen_mport, "POST", "/metrics", "{}", other, sizeof(other)), 405);

    /* duetctl against this router: what each worker said of itself; the log level at run time
     * on the router and both workers */
    static char out[1 << 16];
    char cmd[1024];
    snprintf(cmd, sizeof(cmd), "%s --admin http://127.0.0.1:%d --json status 2>&1",
             test_bin("router/duetctl"), admin_port);
    cr_assert_eq(test_run(cmd, out, sizeof(out)), 0, "%s", out);
    json_t *st = json_loads(out, 0, NULL);
    json_t *ws = json_object_get(st, "workers");
    cr_assert_eq(json_array_size(ws), 2, "%s", out);
    for (size_t i = 0; i < 2; i++) {
        json_t *w = json_array_get(ws, i);
        const char *role = json_string_value(json_object_get(w, "role"));
        cr_expect_str_eq(json_string_value(json_object_get(w, "device")), "cpu");
        cr_expect_str_eq(json_string_value(json_object_get(w, "dtype")), "f32");
        cr_expect(strncmp(json_string_value(json_object_get(w, "address")), "127.0.0.1:", 10) == 0,
                  "%s", out);
        cr_expect_eq(json_integer_value(json_object_get(w, "metrics_port")),
                     strcmp(role, "ctx") == 0 ? ctx_mport : gen_mport);
        cr_expect_lt(json_integer_value(json_object_get(w, "heartbeat_age_ms")), 2000);
        cr_expect_lt(json_integer_value(json_object_get(w, "uptime_s")), 600);
        const double u = json_number_value(json_object_get(w, "utilisation"));
        cr_expect(u >= 0 && u <= 1, "utilisation %f", u);
    }
    json_decref(st);
    snprintf(cmd, sizeof(cmd), "%s --admin http://127.0.0.1:%d log-level debug 2>&1",
             test_bin("router/duetctl"), admin_port);
    cr_assert_eq(test_run(cmd, out, sizeof(out)), 0, "%s", out);
    cr_expect(strstr(out, "log level: debug (was info; 2 workers told)") != NULL, "%s", out);
    const char *const changed[] = {"log level info -> debug"};
    for (uint64_t end = now_ms() + 3000; now_ms() < end;) {
        if (log_count("ctx-0", changed, 1) == 1 && log_count("gen-0", changed, 1) == 1)
            break;
        usleep(50000);
    }
    cr_expect_eq(log_count("ctx-0", changed, 1), 1, "ctx-0 did not log the change");
    cr_expect_eq(log_count("gen-0", changed, 1), 1, "gen-0 did not log the change");
    cr_expect_eq(log_count("router", changed, 1), 1, "the router did not log the change");
    check_json_log("ctx-0");
    stop_all();
}

static void client_cancel_body(void)
{
    static char buf[1 << 16];
    start_cluster(1, 1);
    /* mid-prefill: a long prompt, the client leaves right after sending it */
    char prompt[4000], ps[8192], body[9000];
    for (int i = 0; i < 3000; i++)
        prompt[i] = corpus[i % strlen(corpus)];
    prompt[3000] = '\0';
    json_str(prompt, ps, sizeof(ps));
    snprintf(body, sizeof(body),
             "{\"model\":\"duet-demo\",\"prompt\":%s,\"max_tokens\":200,\"stream\":true}", ps);
    int fd = http_send(http_port, "POST", "/v1/completions", body);
    cr_assert_geq(fd, 0);
    usleep(1500000); /* the ctx worker is prefilling 3000 tokens at ~400/s */
    close(fd);
    wait_idle(2, 15000);
    /* mid-stream: read a few chunks, then leave */
    snprintf(body, sizeof(body),
             "{\"model\":\"duet-demo\",\"prompt\":\"And God said, Let there be\",\"max_tokens\":"
             "3000,\"ignore_eos\":true,\"stream\":true}");
    fd = http_send(http_port, "POST", "/v1/completions", body);
    cr_assert_geq(fd, 0);
    size_t at = 0;
    uint64_t end = now_ms() + 20000;
    int chunks = 0;
    while (chunks < 10 && now_ms() < end) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 1000) <= 0)
            continue;
        ssize_t r = read(fd, buf + at, sizeof(buf) - 1 - at);
        cr_assert_gt(r, 0);
        at += (size_t)r;
        buf[at] = '\0';
        chunks = 0;
        for (const char *q = strstr(buf, "data: "); q != NULL; q = strstr(q + 1, "data: "))
            chunks++;
    }
    cr_assert_geq(chunks, 10, "the stream started: %s", buf);
    close(fd);
    wait_idle(2, 15000);
    /* and the cluster still answers, also seeded sampling: the context worker draws the first
     * token from the request's stream, the generation worker continues that stream, so both
     * paths (disaggregated 100-byte prompt, local 10-byte prompt) equal duet-generate --seed */
    static const int lens[3] = {100, 10, 60};
    for (int k = 0; k < 3; k++) {
        job_t j = {0};
        prompt_of(&j, 7 + k, lens[k], 30);
        j.seed = k == 2 ? 0 : 7 + k;
        reference(&j);
        run_job(&j);
        check_job(&j, k);
        free(j.want_text);
        free(j.got_text);
    }
    stop_all();
}

/*
 * More requests at once than the generation worker holds (batch.max_seqs 2, 10 requests sent
 * together): the router runs at most what the live generation workers hold and keeps the rest in
 * its admission queue, so every request is answered as duet-generate answers it, none with a
 * 429, and the worker never refuses a reservation for want of a slot.
 */
Test(cluster, a_burst_past_the_generation_slots_waits_in_the_queue, .timeout = 300)
{
    enum { N = 10 };
    static job_t jobs[N];
    gen_extra[0] = "--batch.max_seqs"; /* after start_cluster's 40: the last one counts */
    gen_extra[1] = "2";
    start_cluster(1, 1);
    gen_extra[0] = gen_extra[1] = NULL;
    for (int i = 0; i < N; i++) {
        memset(&jobs[i], 0, sizeof(jobs[i]));
        prompt_of(&jobs[i], i, 20 + 13 * i, 16 + i);
        jobs[i].stream = i % 2;
        reference(&jobs[i]);
    }
    static char buf[65536];
    json_t *a = NULL;
    for (uint64_t end = now_ms() + 5000;; usleep(50000)) {
        cr_assert_eq(http(admin_port, "GET", "/admin/admission", NULL, buf, sizeof(buf)), 200);
        json_decref(a);
        a = json_loads(body_of(buf), 0, NULL);
        if (json_integer_value(json_object_get(a, "limit")) == 2 || now_ms() >= end)
            break;
    }
    cr_assert_eq(json_integer_value(json_object_get(a, "worker_slots")), 2, "%s", body_of(buf));
    cr_assert_eq(json_integer_value(json_object_get(a, "limit")), 2, "%s", body_of(buf));
    cr_assert_eq(json_integer_value(json_object_get(a, "max_inflight")), 64, "%s", body_of(buf));
    json_decref(a);
    run_jobs_and_check(jobs, N);
    cr_assert_eq(http(admin_port, "GET", "/admin/admission", NULL, buf, sizeof(buf)), 200);
    a = json_loads(body_of(buf), 0, NULL);
    cr_expect_geq(json_integer_value(json_object_get(a, "queued_total")), 1,
                  "no request waited: %s", body_of(buf));
    json_decref(a);
    static const char *const refused[] = {"refused"};
    cr_expect_eq(log_count("router", refused, 1), 0, "a reservation was refused: %s/router.log",
                 dir);
    wait_idle(2, 10000);
    for (int i = 0; i < N; i++) {
        free(jobs[i].want_text);
        free(jobs[i].got_text);
    }
    stop_all();
}

/*
 * A generation worker with too few pages for its load (cache.suspend, gen_main.c): 10 greedy
 * requests (local and remote prefill, streamed and not, ignore_eos so that each decodes all its
 * max_tokens) are admitted by what they hold, 12-16 pages each when they finish against 48 in the
 * pool, so the worker suspends the youngest to host memory and resumes them as pages free up.
 * Every answer equals duet-generate's, every page is back at the end, and the router counts the
 * suspensions and resumes (> 0: the load did run out of pages).
 */
static void suspend_under_pressure_body(void)
{
    enum { N = 10 };
    static const int lens[N] = {10, 150, 20, 200, 120, 15, 180, 90, 220, 60};
    static job_t jobs[N];
    gen_pages = 48;
    start_cluster(1, 1);
    for (int i = 0; i < N; i++) {
        memset(&jobs[i], 0, sizeof(jobs[i]));
        prompt_of(&jobs[i], i, lens[i], 200 + (i * 37) % 150);
        jobs[i].stream = i % 2 == 0;
        jobs[i].ignore_eos = 1;
        reference(&jobs[i]);
    }
    const double sus0 = metric("duet_gen_suspended_total");
    const double res0 = metric("duet_gen_resumed_total");
    cr_assert(sus0 >= 0 && res0 >= 0, "the router exports the suspension counters");
    run_jobs_and_check(jobs, N);
    wait_idle(2, 15000);
    usleep(300000); /* a heartbeat after the last step carries the final counts */
    const double sus = metric("duet_gen_suspended_total") - sus0;
    const double res = metric("duet_gen_resumed_total") - res0;
    cr_expect_gt(sus, 0, "the load should have run the pool out of pages");
    cr_expect_eq(sus, res, "every suspended request resumed (%g suspensions, %g resumes)", sus,
                 res);
    for (int i = 0; i < N; i++) {
        free(jobs[i].want_text);
        free(jobs[i].got_text);
    }
    stop_all();
    gen_pages = GEN_PAGES;
}

Test(cluster, suspend_under_page_pressure_equal_duet_generate, .timeout = 300)
{
    suspend_under_pressure_body();
}

Test(cluster, client_cancel_frees_pages_on_both_workers, .timeout = 120)
{
    client_cancel_body();
}

/* Wait until a worker named prefix<i> (i < n) reports a running request; returns i or -1. */
static int busy_worker(const char *prefix, int n, int ms)
{
    static char buf[65536];
    uint64_t end = now_ms() + (uint64_t)ms;
    while (now_ms() < end) {
        if (http(admin_port, "GET", "/admin/workers", NULL, buf, sizeof(buf)) == 200) {
            json_t *o = json_loads(body_of(buf), 0, NULL);
            json_t *a = json_is_array(o) ? o : json_object_get(o, "workers");
            for (size_t i = 0; i < json_array_size(a); i++) {
                json_t *w = json_array_get(a, i);
                const char *name = json_string_value(json_object_get(w, "name"));
                const char *state = json_string_value(json_object_get(w, "state"));
                if (state == NULL || strcmp(state, "dead") == 0)
                    continue;
                int run =
                    (int)json_integer_value(json_object_get(json_object_get(w, "load"), "running"));
                const size_t pl = strlen(prefix);
                if (name != NULL && strncmp(name, prefix, pl) == 0 && run > 0) {
                    const int idx = atoi(name + pl);
                    if (idx >= 0 && idx < n) {
                        json_decref(o);
                        return idx;
                    }
                }
            }
            json_decref(o);
        }
        usleep(20000);
    }
    return -1;
}

/* Wait until a ctx worker reports a running prefill; returns its name's index or -1. */
static int busy_ctx(int n_ctx, int ms)
{
    return busy_worker("ctx-", n_ctx, ms);
}

Test(cluster, ctx_killed_during_prefill_is_retried, .timeout = 180)
{
    worker_device = "cpu"; /* the kill must land inside the prefill */
    start_cluster(2, 1);
    job_t j = {0};
    /* 0.3-0.5 s of prefill on one thread (the 2-core VM, 2026-12): the kill goes 50 ms after a
     * heartbeat (every 100 ms) shows it running; 300 ms after, it missed 2 runs in 8 */
    prompt_of(&j, 3, 900, 16);
    reference(&j);
    pthread_t th;
    pthread_create(&th, NULL, run_job, &j);
    int victim = busy_ctx(2, 10000);
    cr_assert_geq(victim, 0, "no ctx worker took the prefill");
    char name[16];
    snprintf(name, sizeof(name), "ctx-%d", victim);
    usleep(50000);
    kill(pid_of(name), SIGKILL);
    pthread_join(th, NULL);
    check_job(&j, 0); /* prefilled again on the other ctx worker, same tokens */
    free(j.want_text);
    free(j.got_text);
    wait_idle(2, 15000); /* the gen worker and the surviving ctx worker hold nothing */

    /* now the last ctx worker dies during a prefill: a clear error, nothing leaks */
    job_t k = {0};
    prompt_of(&k, 4, 900, 16);
    pthread_create(&th, NULL, run_job, &k);
    int last = busy_ctx(2, 10000);
    cr_assert_geq(last, 0);
    usleep(50000);
    snprintf(name, sizeof(name), "ctx-%d", last);
    kill(pid_of(name), SIGKILL);
    pthread_join(th, NULL);
    cr_expect_eq(k.status, 502, "HTTP %d: %s", k.status, k.got_text);
    cr_expect(strstr(k.got_text, "prefill failed") != NULL, "a clear error: %s", k.got_text);
    free(k.got_text);
    wait_idle(1, 15000);
    stop_all();
}

/*
 * A context worker stopped while it holds a prompt's transfer (test.xfer_hold_ms) aborts it, and
 * the generation worker ends the reservation: the request fails at once with that reason. It
 * once was prefilled again on the other context worker, into the ended reservation (the retry's
 * puts reach quarantined pages; it failed later as "no such reservation", or after its first
 * token as "PrefillDone for a request with no reservation"). Found by bench/soak.
 */
Test(cluster, ctx_stopped_mid_transfer_fails_with_the_reservations_end, .timeout = 120)
{
    static const char *hold[] = {"--test.xfer_hold_ms", "60000", NULL};
    memcpy(ctx_extra, hold, sizeof(hold));
    start_cluster(2, 1);
    ctx_extra[0] = NULL;
    job_t j = {0};
    prompt_of(&j, 5, 200, 16);
    pthread_t th;
    pthread_create(&th, NULL, run_job, &j);
    const int victim = busy_ctx(2, 10000);
    cr_assert_geq(victim, 0, "no ctx worker took the prefill");
    char name[16];
    snprintf(name, sizeof(name), "ctx-%d", victim);
    usleep(300000); /* prefilled: the puts are held */
    const uint64_t t0 = now_ms();
    kill(pid_of(name), SIGTERM); /* shutdown.drain_s 0: stops now, aborting the transfer */
    pthread_join(th, NULL);
    cr_expect_eq(j.status, 502, "HTTP %d: %s", j.status, j.got_text);
    cr_expect(strstr(j.got_text, "the KV cache transfer was aborted") != NULL,
              "the gen worker's reason: %s", j.got_text);
    cr_expect_lt(j.done_ms - t0, 5000, "failed at once: %llu ms",
                 (unsigned long long)(j.done_ms - t0));
    free(j.got_text);
    wait_idle(2, 15000);
    stop_all();
}

/*
 * A context worker stopped (SIGSTOP, 2 s: under the router's heartbeat timeout, so it stays)
 * while its transfer is held; the client leaves, so the gen worker quarantines the reservation
 * (cache.quarantine_ms 500 here) and a short local request then decodes on the gen worker. When
 * the context worker runs again its timer puts the held transfer before it reads its Cancel: the
 * reservation's pages and state slot must not have gone to the new request (they once had, the
 * pool handing out the last freed first, and its answer went wrong; bench/soak saw it). The
 * quarantine now lasts at least the router's heartbeat timeout, past which a stopped worker puts
 * nothing (it leaves as it runs again).
 */
Test(cluster, a_stopped_ctx_worker_puts_into_no_reused_page, .timeout = 120)
{
    static const char *hold[] = {"--test.xfer_hold_ms", "1000", NULL};
    memcpy(ctx_extra, hold, sizeof(hold));
    gen_pages = 48;
    start_cluster(1, 1);
    ctx_extra[0] = NULL;
    job_t b = {0};
    prompt_of(&b, 9, 10, 400); /* local: below placement.local_prefill_tokens */
    b.stream = 1;
    b.ignore_eos = 1;
    reference(&b);
    char prompt[256], ps[512], body[1024];
    for (int i = 0; i < 200; i++)
        prompt[i] = corpus[(i * 7) % strlen(corpus)];
    prompt[200] = '\0';
    json_str(prompt, ps, sizeof(ps));
    snprintf(body, sizeof(body),
             "{\"model\":\"duet-demo\",\"prompt\":%s,\"max_tokens\":16,\"stream\":true}", ps);
    int fd = http_send(http_port, "POST", "/v1/completions", body);
    cr_assert_geq(fd, 0);
    cr_assert_eq(busy_ctx(1, 10000), 0, "the ctx worker did not take the prompt");
    usleep(300000); /* prefilled; its puts are held */
    const pid_t ctx = pid_of("ctx-0");
    kill(ctx, SIGSTOP);
    close(fd); /* the client leaves: Cancel to both workers, quarantine on the gen worker */
    usleep(900000);
    pthread_t th;
    pthread_create(&th, NULL, run_job, &b);
    cr_assert_eq(busy_worker("gen-", 1, 10000), 0, "the local request did not start");
    usleep(1000000);
    kill(ctx, SIGCONT); /* its timer puts the held transfer, then it reads the Cancel */
    pthread_join(th, NULL);
    check_job(&b, 0);
    free(b.want_text);
    free(b.got_text);
    wait_idle(2, 15000);
    stop_all();
    gen_pages = GEN_PAGES;
}

static void gen_killed_body(void)
{
    enum { N = 8 };
    static job_t jobs[N];
    worker_device = "cpu"; /* the kill must land while the streams are still decoding */
    start_cluster(1, 2);
    check_cache_gauges(2);
    pthread_t th[N];
    for (int i = 0; i < N; i++) {
        memset(&jobs[i], 0, sizeof(jobs[i]));
        prompt_of(&jobs[i], i, 30 + i * 10, 300);
        jobs[i].stream = 1;
        jobs[i].ignore_eos = 1;
        reference(&jobs[i]);
    }
    for (int i = 0; i < N; i++)
        pthread_create(&th[i], NULL, run_job, &jobs[i]);
    /* kill gen-0 once it decodes (a fixed delay let every stream finish first on a fast
     * host): each stream is 300 tokens, so what it runs then is still running at the kill */
    cr_assert_eq(busy_worker("gen-", 1, 20000), 0, "gen-0 never ran a request");
    kill(pid_of("gen-0"), SIGKILL);
    for (int i = 0; i < N; i++)
        pthread_join(th[i], NULL);
    int ok = 0, failed = 0;
    for (int i = 0; i < N; i++) {
        if (strcmp(jobs[i].got_text, jobs[i].want_text) == 0 &&
            jobs[i].got_tokens == jobs[i].want_tokens) {
            ok++;
        } else {
            failed++;
            /* a stream that had started ends with an error event naming the lost worker;
             * one that had not got a 502 */
            cr_expect(strstr(jobs[i].got_text, "gen-0") != NULL ||
                          strstr(jobs[i].got_text, "lost") != NULL ||
                          strstr(jobs[i].got_text, "502") != NULL,
                      "request %d failed without naming the lost worker: %.300s", i,
                      jobs[i].got_text);
        }
    }
    cr_expect_gt(ok, 0, "requests on the surviving worker completed");
    cr_expect_gt(failed, 0, "requests on the killed worker failed");
    static char buf[4096];
    cr_expect_eq(http(http_port, "GET", "/health", NULL, buf, sizeof(buf)), 200, "%s", buf);
    check_cache_gauges(1); /* the dead worker's plan left the sums */
    job_t j = {0};
    prompt_of(&j, 11, 120, 24);
    reference(&j);
    run_job(&j);
    check_job(&j, 0);
    wait_idle(2, 15000);
    for (int i = 0; i < N; i++) {
        free(jobs[i].want_text);
        free(jobs[i].got_text);
    }
    free(j.want_text);
    free(j.got_text);
    stop_all();
}

Test(cluster, gen_killed_fails_its_requests_router_stays_healthy, .timeout = 180)
{
    gen_killed_body();
}

static void drain_body(void)
{
    enum { N = 12 };
    static job_t jobs[N];
    static char buf[65536];
    start_cluster(1, 2);
    pthread_t th[N];
    for (int i = 0; i < N; i++) {
        memset(&jobs[i], 0, sizeof(jobs[i]));
        prompt_of(&jobs[i], i + 40, 20 + i * 17, 120);
        jobs[i].stream = i % 2;
        reference(&jobs[i]);
    }
    for (int i = 0; i < N; i++)
        pthread_create(&th[i], NULL, run_job, &jobs[i]);
    usleep(700000);
    uint64_t t0 = now_ms();
    int st = http(admin_port, "POST", "/admin/workers/gen-0/drain?wait=1", "", buf, sizeof(buf));
    cr_expect_eq(st, 200, "drain --wait: %s", buf);
    cr_log_info("drain took %llu ms", (unsigned long long)(now_ms() - t0));
    for (int i = 0; i < N; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < N; i++)
        check_job(&jobs[i], i);
    /* new work goes to gen-1 only */
    job_t j = {0};
    prompt_of(&j, 5, 60, 16);
    reference(&j);
    run_job(&j);
    check_job(&j, 0);
    http(admin_port, "GET", "/admin/workers", NULL, buf, sizeof(buf));
    cr_expect(strstr(buf, "draining") != NULL, "gen-0 stays draining: %s", body_of(buf));
    for (int i = 0; i < N; i++) {
        free(jobs[i].want_text);
        free(jobs[i].got_text);
    }
    free(j.want_text);
    free(j.got_text);
    stop_all();
}

Test(cluster, drain_under_load_loses_nothing, .timeout = 180)
{
    drain_body();
}

/* A labelled series of the router's /metrics ("name{labels}"), or -1. */
static double metric_series(const char *name, const char *labels)
{
    char full[256];
    snprintf(full, sizeof(full), "%s%s", name, labels);
    return metric(full);
}

/* duet_router_moves_total{result} (0 before the first one of that result). */
static double moves(const char *result)
{
    char l[64];
    snprintf(l, sizeof(l), "{result=\"%s\"}", result);
    const double v = metric_series("duet_router_moves_total", l);
    return v < 0 ? 0 : v;
}

/*
 * drain --migrate --wait of a generation worker while greedy requests decode on both: every
 * request on it moves mid-decode to the other one and every answer (streamed and not) equals
 * duet-generate's token for token; the drain returns once the worker holds nothing, well before
 * the streams end; the router counted the moves and no failure; every page is back on every
 * worker at the end.
 */
/* Moves the gen workers' logs record ("moved out: T tokens, R replay rows, ..."): how many, and
 * how many of them carried replay rows (R > 0). */
static int moved_out_logged(int n_gen, int *with_replay)
{
    int n = 0;
    *with_replay = 0;
    for (int i = 0; i < n_gen; i++) {
        char path[512], line[1024];
        snprintf(path, sizeof(path), "%s/gen-%d.log", dir, i);
        FILE *f = fopen(path, "r");
        if (f == NULL)
            continue;
        while (fgets(line, sizeof(line), f) != NULL) {
            const char *p = strstr(line, "moved out: ");
            long long t = 0, rows = 0;
            if (p == NULL || sscanf(p, "moved out: %lld tokens, %lld replay rows", &t, &rows) != 2)
                continue;
            n++;
            *with_replay += rows > 0;
        }
        fclose(f);
    }
    return n;
}

static void migrate_body(void)
{
    enum { N = 6 };
    static job_t jobs[N];
    static char buf[65536];
    worker_device = "cpu"; /* the moves must land mid-decode */
    start_cluster(1, 2);
    pthread_t th[N];
    for (int i = 0; i < N; i++) {
        memset(&jobs[i], 0, sizeof(jobs[i]));
        prompt_of(&jobs[i], i + 60, 30 + i * 41, 260);
        jobs[i].stream = i % 2;
        jobs[i].ignore_eos = 1;
        reference(&jobs[i]);
    }
    for (int i = 0; i < N; i++)
        pthread_create(&th[i], NULL, run_job, &jobs[i]);
    cr_assert_eq(busy_worker("gen-", 1, 20000), 0, "gen-0 never ran a request");
    usleep(400000); /* its requests are decoding */
    const uint64_t t0 = now_ms();
    int st = http(admin_port, "POST", "/admin/workers/gen-0/drain?migrate=1&wait=1", "", buf,
                  sizeof(buf));
    const uint64_t drained_ms = now_ms() - t0;
    cr_expect_eq(st, 200, "drain --migrate --wait: %s", buf);
    int running = 0;
    for (int i = 0; i < N; i++)
        running += jobs[i].status == 0; /* not answered yet */
    for (int i = 0; i < N; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < N; i++)
        check_job(&jobs[i], i);
    cr_log_info("drain --migrate took %llu ms; %d requests were still running then",
                (unsigned long long)drained_ms, running);
    cr_expect_gt(running, 0, "requests were still running on gen-1 when gen-0 was drained");
    cr_expect_geq(moves("ok"), 1, "the router moved requests");
    cr_expect_eq(moves("failed") + moves("lost"), 0, "no move failed");
    int with_replay = 0;
    cr_expect_eq(moved_out_logged(2, &with_replay), (int)moves("ok"), "each move is logged");
    if (spec_method != NULL) /* a verify leaves its accepted rows as replay rows */
        cr_expect_gt(with_replay, 0, "a move carried pending replay rows");
    else
        cr_expect_eq(with_replay, 0, "replay rows without speculation");
    wait_idle(3, 15000); /* gen-0 stays live, draining, with every page back */
    for (int i = 0; i < N; i++) {
        free(jobs[i].want_text);
        free(jobs[i].got_text);
    }
    stop_all();
}

Test(cluster, drain_migrate_moves_requests_mid_decode, .timeout = 240)
{
    migrate_body();
}

/*
 * Faults during a move. The source holds each move 1.5 s after its transfer started, before any
 * byte (test.move_hold_ms), and the router gives a move 1 s (migrate.timeout_ms):
 *   - the target is killed mid-move: the source decodes on; the answer equals duet-generate's
 *   - the move's deadline passes: the same, and the router counts the failed moves
 *   - the source is killed mid-move: the request ends once with an error naming the lost worker
 *   - no other generation worker: the move is abandoned and the request finishes where it is
 * and afterwards every page is back on every live worker (the target's after its quarantine).
 */
static job_t *fault_start(job_t *j, pthread_t *th, int seed)
{
    memset(j, 0, sizeof(*j));
    /* long enough to still be decoding when the move starts on a fast host (one CPU thread of
     * a 16-core machine decodes the demo model at ~500 tokens/s) */
    prompt_of(j, seed, 40, 1500);
    j->stream = 1;
    j->ignore_eos = 1;
    reference(j);
    pthread_create(th, NULL, run_job, j);
    return j;
}

/* The gen worker running the only request (waits for it to decode), and the other one. */
static void fault_roles(char *src, char *dst)
{
    const int i = busy_worker("gen-", 2, 20000);
    cr_assert_geq(i, 0, "no gen worker ran the request");
    snprintf(src, 16, "gen-%d", i);
    snprintf(dst, 16, "gen-%d", 1 - i);
    usleep(400000);
}

static void migrate_faults_body(void)
{
    static char buf[65536];
    static const char *hold[] = {"--test.move_hold_ms", "1500", NULL};
    static const char *bound[] = {"--migrate.timeout_ms", "1000", NULL};
    memcpy(gen_extra, hold, sizeof(hold));
    memcpy(router_extra, bound, sizeof(bound));
    worker_device = "cpu";
    job_t j;
    pthread_t th;
    char src[16], dst[16], path[96];

    /* the target dies while the source holds the move */
    start_cluster(1, 2);
    fault_start(&j, &th, 71);
    fault_roles(src, dst);
    snprintf(path, sizeof(path), "/admin/workers/%s/drain?migrate=1", src);
    cr_assert_eq(http(admin_port, "POST", path, "", buf, sizeof(buf)), 200, "%s", buf);
    usleep(500000);
    kill(pid_of(dst), SIGKILL);
    pthread_join(th, NULL);
    check_job(&j, 0);
    cr_expect_geq(moves("failed") + moves("lost"), 1, "the broken move was counted");
    cr_expect_eq(moves("ok"), 0);
    wait_idle(2, 15000);
    free(j.want_text);
    free(j.got_text);
    stop_all();

    /* the move's deadline passes while the source holds it (every attempt) */
    start_cluster(1, 2);
    fault_start(&j, &th, 72);
    fault_roles(src, dst);
    snprintf(path, sizeof(path), "/admin/workers/%s/drain?migrate=1", src);
    cr_assert_eq(http(admin_port, "POST", path, "", buf, sizeof(buf)), 200, "%s", buf);
    pthread_join(th, NULL);
    check_job(&j, 0);
    cr_expect_geq(moves("failed"), 1, "the late moves were counted as failed");
    cr_expect_eq(moves("ok"), 0);
    wait_idle(3, 15000);
    free(j.want_text);
    free(j.got_text);
    stop_all();

    /* the source dies while it holds the move */
    start_cluster(1, 2);
    fault_start(&j, &th, 73);
    fault_roles(src, dst);
    snprintf(path, sizeof(path), "/admin/workers/%s/drain?migrate=1", src);
    cr_assert_eq(http(admin_port, "POST", path, "", buf, sizeof(buf)), 200, "%s", buf);
    usleep(500000);
    kill(pid_of(src), SIGKILL);
    pthread_join(th, NULL);
    cr_expect_eq(j.status, 200, "the stream had started: %s", j.got_text);
    cr_expect(strstr(j.got_text, "[error]") != NULL && strstr(j.got_text, src) != NULL,
              "the stream ends with an error naming %s: %.400s", src, j.got_text);
    cr_expect_geq(moves("lost"), 1);
    wait_idle(2, 15000);
    free(j.want_text);
    free(j.got_text);
    stop_all();

    /* a move that succeeds well inside its 1 s: the request decodes on after it for longer
     * than that, bound by its own deadline, not the move's (the target once took the move's
     * deadline for the request's and ended it 1 s after the move) */
    gen_extra[0] = NULL;
    start_cluster(1, 2);
    memset(&j, 0, sizeof(j));
    prompt_of(&j, 75, 40, 3000); /* ~6 s at 500 tokens/s: decodes for seconds after the move */
    j.stream = 1;
    j.ignore_eos = 1;
    reference(&j);
    pthread_create(&th, NULL, run_job, &j);
    fault_roles(src, dst);
    snprintf(path, sizeof(path), "/admin/workers/%s/drain?migrate=1", src);
    cr_assert_eq(http(admin_port, "POST", path, "", buf, sizeof(buf)), 200, "%s", buf);
    const uint64_t t_drain = now_ms();
    pthread_join(th, NULL);
    cr_log_info("the moved request finished %llu ms after the drain",
                (unsigned long long)(now_ms() - t_drain));
    check_job(&j, 0);
    cr_expect_geq(moves("ok"), 1, "the request was moved");
    wait_idle(3, 15000);
    free(j.want_text);
    free(j.got_text);
    stop_all();

    /* no other generation worker: the request stays and finishes where it is */
    gen_extra[0] = router_extra[0] = NULL;
    start_cluster(1, 1);
    fault_start(&j, &th, 74);
    cr_assert_eq(busy_worker("gen-", 1, 20000), 0);
    usleep(400000);
    cr_assert_eq(
        http(admin_port, "POST", "/admin/workers/gen-0/drain?migrate=1", "", buf, sizeof(buf)), 200,
        "%s", buf);
    pthread_join(th, NULL);
    check_job(&j, 0);
    cr_expect_geq(moves("abandoned"), 1, "the router gave the move up");
    cr_expect_eq(moves("ok") + moves("failed") + moves("lost"), 0);
    wait_idle(2, 15000);
    free(j.want_text);
    free(j.got_text);
    stop_all();
}

Test(cluster, drain_migrate_faults_end_once_and_free_every_page, .timeout = 300)
{
    migrate_faults_body();
}

/* Run duet-bench's `workload` against the cluster; returns its exit status, its stdout in out. */
static int run_bench_workload(const char *workload, const char *baseline, const char *json,
                              char *out, size_t cap)
{
    char url[64], cmd[2048];
    snprintf(url, sizeof(url), "http://127.0.0.1:%d", http_port);
    snprintf(cmd, sizeof(cmd),
             "%s --url %s %s --metrics-settle-ms 600 --quiet --json %s --baseline %s 2>&1", BENCH,
             url, workload, json, baseline);
    return test_run(cmd, out, cap);
}

static int run_bench(const char *baseline, const char *json, char *out, size_t cap)
{
    return run_bench_workload("--concurrency 4 --num-prompts 16 --max-tokens 24 --ignore-eos "
                              "--random-prompt-len 60 --seed 3",
                              baseline, json, out, cap);
}

Test(cluster, perf_gates_on_the_real_cluster, .timeout = 180)
{
    static char out[1 << 16];
    start_cluster(1, 1);
    char json[512], bad[512];
    snprintf(json, sizeof(json), "%s/bench.json", dir);
    int rc =
        run_bench(DUET_SOURCE_DIR "/bench/baselines/demo-cluster-ci.json", json, out, sizeof(out));
    cr_expect_eq(rc, 0, "duet-bench with the CI baseline: exit %d\n%s", rc, out);
    json_error_t e;
    json_t *o = json_load_file(json, 0, &e);
    cr_assert_not_null(o, "%s", e.text);
    cr_expect_eq(json_integer_value(json_object_get(o, "completed")), 16);
    cr_expect_eq(json_integer_value(json_object_get(o, "total_output_tokens")), 16 * 24);
    cr_expect_float_eq(json_real_value(json_object_get(o, "avg_decoded_tokens_per_iter")), 1.0,
                       1e-9, "no drafts: one token per request per decode step");
    cr_expect_gt(json_real_value(json_object_get(o, "device_step_time_ms")), 0.0);
    cr_expect(json_is_null(json_object_get(o, "spec_acceptance_rate")) &&
                  json_is_null(json_object_get(o, "spec_mean_step_tokens")) &&
                  json_array_size(json_object_get(o, "spec_positions")) == 0 &&
                  json_is_array(json_object_get(o, "spec_positions")),
              "no speculation: no acceptance figures");
    json_decref(o);
    snprintf(bad, sizeof(bad), "%s/impossible.json", dir);
    FILE *f = fopen(bad, "w");
    cr_assert_not_null(f);
    fputs("{\"gates\": {\"output_throughput\": {\"min\": 1e9}}}\n", f);
    fclose(f);
    rc = run_bench(bad, json, out, sizeof(out));
    cr_expect_eq(rc, 3, "an unmet gate fails the run: exit %d\n%s", rc, out);
    cr_expect(strstr(out, "output_throughput") != NULL, "the failed gate is named: %s", out);
    stop_all();
}

/* ---------------------------------------------------------------- speculative decoding */

Test(cluster_spec, client_cancel_frees_pages_on_both_workers, .timeout = 120)
{
    speculate("ngram", "4");
    client_cancel_body();
}

/* With drafts and the draft model: a verify's rows grow the sequence by up to k + 1 at once, a
 * suspension folds the accepted rows in first, and the drafter's sequence stays open meanwhile. */
Test(cluster_spec, suspend_under_page_pressure_equal_duet_generate, .timeout = 300)
{
    speculate("draft", "4");
    suspend_under_pressure_body();
}

Test(cluster_spec, gen_killed_fails_its_requests_router_stays_healthy, .timeout = 180)
{
    speculate("draft", "4");
    gen_killed_body();
}

/* Moves carry the KDA replay rows of the last verify (ngram drafts keep many). */
Test(cluster_spec, drain_migrate_moves_requests_mid_decode, .timeout = 240)
{
    speculate("ngram", "4");
    migrate_body();
}

/* The draft model (KDA and MLA layers) is rebuilt on the target from the prompt and the generated
 * ids, catching up as for a new request. */
Test(cluster_spec, drain_migrate_with_the_draft_model, .timeout = 240)
{
    speculate("draft", "4");
    migrate_body();
}

Test(cluster_spec, drain_under_load_loses_nothing, .timeout = 180)
{
    /* the drafter samples its drafts for the seeded requests here: their streams must repeat
     * duet-generate's with the same keys whatever the batch around them */
    speculate("draft", "2");
    drain_body();
}

/*
 * The speculation metrics of a fresh cluster after `jobs` (all complete, each finished by the gen
 * worker) ran with spec.k = k: consistent with each other and with what the clients got.
 */
static void check_spec_metrics(const job_t *jobs, int n, int k)
{
    const double steps = metric("duet_gen_spec_step_tokens_count");
    const double emitted = metric("duet_gen_spec_step_tokens_sum");
    const double seq_steps = metric("duet_gen_decode_seq_steps_total");
    const double decoded = metric("duet_gen_decoded_tokens_total");
    double client_tokens = 0;
    for (int i = 0; i < n; i++)
        client_tokens += jobs[i].got_tokens - 1; /* the first comes from the prefill */
    cr_expect_eq(decoded, client_tokens,
                 "decoded tokens %.0f, the clients got %.0f after the "
                 "first",
                 decoded, client_tokens);
    cr_expect_gt(steps, 0.0, "verify steps ran");
    cr_expect_gt(decoded / seq_steps, 1.0,
                 "avg_decoded_tokens_per_iter %.3f (%.0f tokens in %.0f request steps): several "
                 "tokens per step on these prompts",
                 decoded / seq_steps, decoded, seq_steps);
    printf("cluster_spec k=%d: %.0f tokens in %.0f request steps (%.3f per step), %.0f verify "
           "steps emitting %.0f\n",
           k, decoded, seq_steps, decoded / seq_steps, steps, emitted);
    /* every verify step drafts position 1; a step keeps a prefix of its drafts */
    double kept = 0, prev_d = steps, prev_a = steps;
    for (int j = 1; j <= 8; j++) {
        char lab[32];
        snprintf(lab, sizeof(lab), "{position=\"%d\"}", j);
        const double d = metric_series("duet_gen_spec_drafted_total", lab);
        const double a = metric_series("duet_gen_spec_accepted_total", lab);
        printf("  position %d: %.0f drafted, %.0f kept\n", j, d, a);
        if (j == 1)
            cr_expect_eq(d, steps, "position 1 is drafted in every verify step");
        if (j > k)
            cr_expect_eq(d, 0.0, "position %d drafted with spec.k %d", j, k);
        cr_expect(d >= 0 && a >= 0 && a <= d && d <= prev_d && a <= prev_a,
                  "position %d: %.0f drafted, %.0f kept (position %d: %.0f, %.0f)", j, d, a, j - 1,
                  prev_d, prev_a);
        kept += a;
        prev_d = d;
        prev_a = a;
    }
    cr_expect_eq(kept, emitted - steps,
                 "each verify step emits its kept drafts + 1: %.0f kept, "
                 "%.0f emitted in %.0f steps",
                 kept, emitted, steps);
    double le_k = metric_series("duet_gen_spec_step_tokens_bucket", "{le=\"1\"}");
    char lab[32];
    snprintf(lab, sizeof(lab), "{le=\"%d\"}", k + 1);
    cr_expect_eq(metric_series("duet_gen_spec_step_tokens_bucket", lab), steps,
                 "no verify step emits more than spec.k + 1 tokens");
    cr_expect_lt(le_k, steps, "some verify steps kept drafts");
}

/* The router's speculation counters: drafted / kept per position 1..8, verify steps, emitted. */
typedef struct {
    double drafted[8], accepted[8], steps, emitted;
} spec_counts_t;

static void spec_counts(spec_counts_t *c)
{
    for (int j = 0; j < 8; j++) {
        char lab[32];
        snprintf(lab, sizeof(lab), "{position=\"%d\"}", j + 1);
        c->drafted[j] = metric_series("duet_gen_spec_drafted_total", lab);
        c->accepted[j] = metric_series("duet_gen_spec_accepted_total", lab);
    }
    c->steps = metric("duet_gen_spec_step_tokens_count");
    c->emitted = metric("duet_gen_spec_step_tokens_sum");
}

/*
 * duet-bench against a speculating cluster (spec.k = k) with bench/baselines/local-spec.json: its
 * gates (avg_decoded_tokens_per_iter > 1: verify steps keep drafts) pass on the workload the
 * baseline names; its avg_decoded_tokens_per_iter, tokens per verify step and acceptance per draft
 * position are the router's counters over the run (read here from /metrics); and a baseline asking
 * for more tokens per step than a verify step can give (spec.k + 1) fails the run, naming the gate.
 */
static void check_spec_bench(int k)
{
    static char out[1 << 16];
    char json[512], bad[512];
    snprintf(json, sizeof(json), "%s/bench-spec.json", dir);
    const double tok0 = metric("duet_gen_decoded_tokens_total"),
                 seq0 = metric("duet_gen_decode_seq_steps_total");
    spec_counts_t c0, c1;
    spec_counts(&c0);
    int rc = run_bench_workload("--concurrency 4 --num-prompts 8 --max-tokens 64 --ignore-eos "
                                "--prompts " DUET_SOURCE_DIR "/data/prompts/gsm8k-test.jsonl",
                                DUET_SOURCE_DIR "/bench/baselines/local-spec.json", json, out,
                                sizeof(out));
    cr_expect_eq(rc, 0, "duet-bench with the local-spec baseline: exit %d\n%s", rc, out);
    cr_expect(strstr(out, "PASS avg_decoded_tokens_per_iter") != NULL, "the gate ran:\n%s", out);
    json_error_t e;
    json_t *o = json_load_file(json, 0, &e);
    cr_assert_not_null(o, "%s", e.text);
    const double per_iter = json_real_value(json_object_get(o, "avg_decoded_tokens_per_iter"));
    const double tok = metric("duet_gen_decoded_tokens_total") - tok0,
                 seq = metric("duet_gen_decode_seq_steps_total") - seq0;
    spec_counts(&c1);
    cr_expect_float_eq(per_iter, tok / seq, 1e-9, "duet-bench %.6f, the router %.0f / %.0f",
                       per_iter, tok, seq);
    const double steps = c1.steps - c0.steps, emitted = c1.emitted - c0.emitted;
    cr_expect_float_eq(json_real_value(json_object_get(o, "spec_mean_step_tokens")),
                       emitted / steps, 1e-9, "tokens per verify step: the router %.0f / %.0f",
                       emitted, steps);
    const json_t *pos = json_object_get(o, "spec_positions");
    cr_assert(json_is_array(pos), "spec_positions");
    /* a position is drafted only after the one before it: those with drafts are 1..m */
    double drafted = 0, accepted = 0;
    size_t m = 0;
    for (int j = 0; j < 8; j++) {
        const double d = c1.drafted[j] - c0.drafted[j], a = c1.accepted[j] - c0.accepted[j];
        drafted += d;
        accepted += a;
        if (j >= k)
            cr_expect_eq(d, 0.0, "position %d drafted with spec.k %d", j + 1, k);
        if (!(d > 0))
            continue;
        cr_expect_eq(m++, (size_t)j, "position %d drafted after one that was not", j + 1);
        const json_t *p = json_array_get(pos, (size_t)j);
        cr_expect_eq(json_integer_value(json_object_get(p, "position")), j + 1);
        cr_expect_eq(json_real_value(json_object_get(p, "drafted")), d, "position %d", j + 1);
        cr_expect_eq(json_real_value(json_object_get(p, "accepted")), a, "position %d", j + 1);
        cr_expect_float_eq(json_real_value(json_object_get(p, "acceptance_rate")), a / d, 1e-9,
                           "position %d: %.0f of %.0f kept", j + 1, a, d);
    }
    cr_expect(m >= 1 && json_array_size(pos) == m, "%zu positions in duet-bench, %zu drafted",
              json_array_size(pos), m);
    cr_expect_float_eq(json_real_value(json_object_get(o, "spec_acceptance_rate")),
                       accepted / drafted, 1e-9, "%.0f of %.0f drafts kept", accepted, drafted);
    cr_expect(strstr(out, "Spec acceptance rate:") != NULL &&
                  strstr(out, "at draft position 1 (") != NULL,
              "the text report shows acceptance per position:\n%s", out);
    printf("cluster_spec: duet-bench avg_decoded_tokens_per_iter %.3f, acceptance %.3f\n", per_iter,
           accepted / drafted);
    json_decref(o);

    snprintf(bad, sizeof(bad), "%s/beyond-k.json", dir);
    FILE *f = fopen(bad, "w");
    cr_assert_not_null(f);
    fprintf(f,
            "{\"gates\": {\"error_rate\": {\"max\": 0}, \"avg_decoded_tokens_per_iter\": "
            "{\"min\": %d.01}}}\n",
            k + 1);
    fclose(f);
    rc = run_bench_workload("--concurrency 4 --num-prompts 4 --max-tokens 16 --ignore-eos "
                            "--prompts " DUET_SOURCE_DIR "/data/prompts/gsm8k-test.jsonl",
                            bad, json, out, sizeof(out));
    cr_expect_eq(rc, 3, "a gate above spec.k + 1 tokens per step fails the run: exit %d\n%s", rc,
                 out);
    cr_expect(strstr(out, "FAIL avg_decoded_tokens_per_iter") != NULL &&
                  strstr(out, "PASS error_rate") != NULL,
              "the failed gate is named:\n%s", out);
}

/*
 * Greedy answers of a speculating cluster equal duet-generate's without speculation, token for
 * token, for prompt lookup at spec.k 2 and 4 and the drafter at spec.k 4: ten requests in flight
 * together, half streamed; the long-output ones start first so that the short prompts the gen
 * worker prefills itself (in 64-token chunks) share steps with verify rows and plain rows (a
 * request prompt lookup found nothing for).
 */
Test(cluster_spec, greedy_equal_duet_generate_k2_k4, .timeout = 420)
{
    enum { N = 10 };
    static job_t jobs[N];
    static const struct {
        int len, max_tokens, delay_ms; /* len 0: the text below */
        const char *text;
    } js[N] = {
        {0, 60, 0, "And"},
        {0, 40, 0,
         "And the evening and the morning were the first day. And the evening and the "
         "morning were the"},
        {300, 40, 0, NULL},
        {200, 48, 0, NULL},
        {250, 32, 0, NULL},
        {10, 40, 300, NULL},
        {90, 50, 300, NULL},
        {150, 40, 400, NULL},
        {130, 64, 400, NULL},
        {30, 24, 500, NULL},
    };
    local_below = 160; /* prompts under 160 tokens are prefilled on the gen worker */
    static const char *const methods[3] = {"ngram", "ngram", "draft"}, *const ks[3] = {"2", "4",
                                                                                       "4"};
    for (int round = 0; round < 3; round++) {
        speculate(methods[round], ks[round]);
        worker_device = "auto"; /* greedy: on a GPU when there is one (verify graphs, drafter) */
        start_cluster(1, 1);
        for (int i = 0; i < N; i++) {
            if (round == 0) { /* duet-generate without speculation, once */
                memset(&jobs[i], 0, sizeof(jobs[i]));
                if (js[i].text != NULL) {
                    snprintf(jobs[i].prompt, sizeof(jobs[i].prompt), "%s", js[i].text);
                    jobs[i].max_tokens = js[i].max_tokens;
                } else {
                    prompt_of(&jobs[i], 20 + i, js[i].len, js[i].max_tokens);
                }
                jobs[i].stream = i % 2;
                jobs[i].delay_ms = js[i].delay_ms;
                reference(&jobs[i]);
            }
            free(jobs[i].got_text);
            jobs[i].got_text = NULL;
            jobs[i].got_tokens = 0;
        }
        run_jobs_and_check(jobs, N);
        wait_idle(2, 10000);
        usleep(400000); /* a heartbeat carries the last counters */
        check_spec_metrics(jobs, N, atoi(ks[round]));
        if (round == 1) /* the speculating cluster's perf gate (the baseline's own workload) */
            check_spec_bench(atoi(ks[round]));
        stop_all();
    }
    for (int i = 0; i < N; i++) {
        free(jobs[i].want_text);
        free(jobs[i].got_text);
    }
}

/*
 * deploy/configs/local-spec.yaml through `duet up --once`: the launcher starts the speculating
 * cluster with the drafter (models/duet-demo-draft) and the sample answer is duet-generate's. The
 * file runs as it is, from a copy on free ports.
 */
/* `duet up deploy/configs/NAME --once` answers the sample as duet-generate does, and gen-0's log
 * holds `want` (the worker is what the file says it is). */
static void duet_up_yaml_answers(const char *name, const char *want_log)
{
    static char text[8192], out[1 << 16];
    char tmpl[] = "/tmp/duet-cluster-test-XXXXXX";
    cr_assert_not_null(mkdtemp(tmpl));
    snprintf(dir, sizeof(dir), "%s", tmpl);
    char src[512];
    snprintf(src, sizeof(src), "%s/deploy/configs/%s", DUET_SOURCE_DIR, name);
    FILE *f = fopen(src, "r");
    cr_assert_not_null(f);
    size_t n = fread(text, 1, sizeof(text) - 1, f);
    fclose(f);
    text[n] = '\0';
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    f = fopen(path, "w");
    cr_assert_not_null(f);
    http_port = free_port();
    worker_port = free_port();
    int replaced = 0;
    for (char *line = strtok(text, "\n"); line != NULL; line = strtok(NULL, "\n")) {
        char *p;
        if ((p = strstr(line, "port: 8000")) != NULL) {
            fprintf(f, "%.*sport: %d%s\n", (int)(p - line), line, http_port, p + 10);
            replaced++;
            continue;
        }
        if ((p = strstr(line, "port: 8100")) != NULL) {
            fprintf(f, "%.*sport: %d%s\n", (int)(p - line), line, worker_port, p + 10);
            replaced++;
            continue;
        }
        fprintf(f, "%s\n", line);
    }
    fclose(f);
    cr_assert_eq(replaced, 2, "%s: both ports found", name);
    /* the sample the file asks for, from duet-generate */
    job_t j = {0};
    snprintf(j.prompt, sizeof(j.prompt), "The LORD said unto Moses,");
    j.max_tokens = 40;
    reference(&j);
    char cmd[1400];
    snprintf(cmd, sizeof(cmd),
             "DUET_SOURCE_DIR=%s UCX_TLS=tcp,self,sm UCX_WARN_UNUSED_ENV_VARS=n timeout 150 %s up "
             "%s --once --log-dir %s/logs 2>&1",
             DUET_SOURCE_DIR, UP, path, dir);
    const int rc = test_run(cmd, out, sizeof(out));
    cr_expect_eq(rc, 0, "duet up --once: exit %d\n%s", rc, out);
    char want[4096];
    snprintf(want, sizeof(want), "  answer  %s\n", j.want_text);
    cr_expect(strstr(out, want) != NULL, "the sample answer is duet-generate's (%s):\n%s",
              j.want_text, out);
    snprintf(path, sizeof(path), "%s/logs/gen-0.log", dir);
    f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    int found = 0;
    while (fgets(text, sizeof(text), f) != NULL)
        found |= strstr(text, want_log) != NULL;
    fclose(f);
    cr_expect(found, "gen-0's log says \"%s\" (%s)", want_log, path);
    free(j.want_text);
    n_pids = 0;
    stop_all(); /* removes the folder */
}

Test(cluster_spec, duet_up_local_spec_yaml_answers, .timeout = 180)
{
    duet_up_yaml_answers("local-spec.yaml", "speculative decoding: draft, up to 4 drafts");
}

/* `duet up deploy/configs/local-cp2.yaml --once`: its generation worker a CP=2 group. */
Test(cluster_group, duet_up_local_cp2_yaml_answers, .timeout = 180)
{
    duet_up_yaml_answers("local-cp2.yaml", "helix follower: rank 1 of 2 (cp 2 x tp 1)");
}

/* ---------------------------------------------------------------- generation groups (Helix) */

/* Processes whose parent is `parent` (a group's ranks under its mpirun). */
static int children_of(pid_t parent, pid_t *out, int cap)
{
    int n = 0;
    FILE *p = popen("ps -e -o pid=,ppid=", "r");
    cr_assert_not_null(p);
    int pid, ppid;
    while (n < cap && fscanf(p, "%d %d", &pid, &ppid) == 2)
        if (ppid == parent)
            out[n++] = pid;
    pclose(p);
    return n;
}

/* The pid of the rank `rank` of the group whose mpirun is `mpirun` (its OMPI_COMM_WORLD_RANK). */
static pid_t rank_pid(pid_t mpirun, int rank)
{
    pid_t kids[64];
    const int n = children_of(mpirun, kids, 64);
    char want[64];
    snprintf(want, sizeof(want), "OMPI_COMM_WORLD_RANK=%d", rank);
    for (int i = 0; i < n; i++) {
        char path[64], env[65536];
        snprintf(path, sizeof(path), "/proc/%d/environ", (int)kids[i]);
        FILE *f = fopen(path, "r");
        if (f == NULL)
            continue;
        size_t len = fread(env, 1, sizeof(env) - 1, f);
        fclose(f);
        for (size_t at = 0; at < len; at += strlen(env + at) + 1)
            if (strcmp(env + at, want) == 0)
                return kids[i];
    }
    return -1;
}

/* Whether a generation worker of this test's cluster (its router port; other tests run beside
 * it) still runs: a group's rank left behind. */
static int gen_running(int port)
{
    char cmd[512], out[256];
    snprintf(cmd, sizeof(cmd), "pgrep -f '^%s .*--router 127.0.0.1:%d( |$)' || true", GEN, port);
    return test_run(cmd, out, sizeof(out)) == 0 && out[0] != '\0';
}

/*
 * One generation group (cp x tp ranks) behind the router with one context worker: requests of
 * mixed lengths in flight together — prompts over fewer KV pages than the group has ranks and
 * over many, prefilled by the context worker (which puts each page into its ranks' pools) and
 * by the group itself (short prompts), streamed and not — give exactly duet-generate's text and
 * token count; afterwards every page is back and no rank is left once the group stops.
 */
static void group_greedy_body(int cp, int tp)
{
    enum { N = 8 };
    static job_t jobs[N];
    helix_cp = cp;
    helix_tp = tp;
    helix_all = 1;
    worker_device = "cpu"; /* a group computes on the cpu backend */
    start_cluster(1, 1);
    pthread_t th[N];
    /* prompt lengths in tokens (bytes): under local_prefill_tokens, one 32-token page (fewer
     * pages than ranks), a few pages, many pages */
    const int len[N] = {12, 20, 30, 45, 70, 110, 180, 260};
    for (int i = 0; i < N; i++) {
        memset(&jobs[i], 0, sizeof(jobs[i]));
        prompt_of(&jobs[i], i * 3 + 1, len[i], 24 + 8 * (i % 3));
        jobs[i].stream = i % 2;
        reference(&jobs[i]);
    }
    for (int i = 0; i < N; i++)
        pthread_create(&th[i], NULL, run_job, &jobs[i]);
    for (int i = 0; i < N; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < N; i++)
        check_job(&jobs[i], i);
    wait_idle(2, 15000);
    for (int i = 0; i < N; i++) {
        free(jobs[i].want_text);
        free(jobs[i].got_text);
    }
    const int port = worker_port;
    stop_all();
    cr_expect(!gen_running(port), "a rank of the group is still running after the stop");
    helix_cp = helix_tp = helix_all = 0;
}

Test(cluster_group, cp2_greedy_equal_duet_generate, .timeout = 240)
{
    group_greedy_body(2, 1);
}

Test(cluster_group, cp4_greedy_equal_duet_generate, .timeout = 240)
{
    group_greedy_body(4, 1);
}

Test(cluster_group, tp2_greedy_equal_duet_generate, .timeout = 240)
{
    group_greedy_body(1, 2);
}

/*
 * After gen-0 (a group) failed beside a plain gen-1: some requests completed as duet-generate's
 * (gen-1's), the others failed with a body holding one of want_a / want_b (NULL: none needed).
 */
static void expect_group_failed(job_t *jobs, int n, const char *want_a, const char *want_b)
{
    int ok = 0, failed = 0;
    for (int i = 0; i < n; i++) {
        if (strcmp(jobs[i].got_text, jobs[i].want_text) == 0 &&
            jobs[i].got_tokens == jobs[i].want_tokens) {
            ok++;
            continue;
        }
        failed++;
        cr_expect(strstr(jobs[i].got_text, want_a) != NULL ||
                      (want_b != NULL && strstr(jobs[i].got_text, want_b) != NULL),
                  "request %d failed without naming %s: %.300s", i, want_a, jobs[i].got_text);
    }
    cr_expect_gt(ok, 0, "requests on gen-1 completed");
    cr_expect_gt(failed, 0, "requests on the group failed");
}

/*
 * gen-0 a CP=2 group beside a plain gen-1 (extra: gen flags or NULL), n greedy streams of 300
 * tokens prefilled by the generation workers (decoding at once) started on threads th; returns
 * once gen-0 runs one, with its mpirun's pid in *mpirun_p and its rank 1's.
 */
static pid_t group_streams(job_t *jobs, int n, pthread_t *th, int seed, const char *extra,
                           const char *extra_value, pid_t *mpirun_p)
{
    helix_cp = 2;
    helix_tp = 1;
    helix_all = 0;
    worker_device = "cpu";
    gen_extra[0] = extra;
    gen_extra[1] = extra_value;
    start_cluster(1, 2);
    gen_extra[0] = gen_extra[1] = NULL;
    for (int i = 0; i < n; i++) {
        memset(&jobs[i], 0, sizeof(jobs[i]));
        prompt_of(&jobs[i], i + seed, 12 + i, 300);
        jobs[i].stream = 1;
        jobs[i].ignore_eos = 1;
        reference(&jobs[i]);
    }
    for (int i = 0; i < n; i++)
        pthread_create(&th[i], NULL, run_job, &jobs[i]);
    cr_assert_eq(busy_worker("gen-", 1, 30000), 0, "gen-0 never ran a request");
    const pid_t mpirun = pid_of("gen-0"), victim = rank_pid(mpirun, 1);
    cr_assert_gt(victim, 0, "rank 1 of gen-0 not found under mpirun %d", (int)mpirun);
    *mpirun_p = mpirun;
    return victim;
}

/*
 * kill -9 of one rank (not rank 0) of gen-0, a CP=2 group, while it decodes beside a plain gen-1:
 * gen-0's requests end once with an error naming it, gen-1's complete as duet-generate's, new
 * requests go to gen-1 and succeed, and nothing of gen-0's job is left running.
 */
Test(cluster_group, a_rank_killed_fails_the_groups_requests_once, .timeout = 240)
{
    enum { N = 6 };
    static job_t jobs[N];
    pthread_t th[N];
    pid_t mpirun;
    const pid_t victim = group_streams(jobs, N, th, 7, NULL, NULL, &mpirun);
    kill(victim, SIGKILL);
    for (int i = 0; i < N; i++)
        pthread_join(th[i], NULL);
    expect_group_failed(jobs, N, "gen-0", "502");
    /* the group's job ends: mpirun exits (nothing hangs), no rank is left */
    int st = 0;
    pid_t done = 0;
    for (int k = 0; k < 300 && (done = waitpid(mpirun, &st, WNOHANG)) == 0; k++)
        usleep(50000);
    cr_expect_eq(done, mpirun, "gen-0's mpirun still runs 15 s after a rank died");
    for (int i = 0; i < n_pids; i++)
        if (pids[i] == mpirun)
            pids[i] = -1; /* reaped */
    usleep(200000);
    pid_t left[8];
    cr_expect_eq(children_of(mpirun, left, 8), 0, "a rank of gen-0 is left running");
    /* new work goes to gen-1 */
    job_t j = {0};
    prompt_of(&j, 13, 90, 20);
    reference(&j);
    run_job(&j);
    check_job(&j, 0);
    for (int i = 0; i < N; i++) {
        free(jobs[i].want_text);
        free(jobs[i].got_text);
    }
    free(j.want_text);
    free(j.got_text);
    stop_all();
    helix_cp = helix_tp = 0;
}

/* drain --wait of gen-0, a CP=2 group, under load beside gen-1: drain_body's checks. */
Test(cluster_group, drain_of_a_group_loses_nothing, .timeout = 240)
{
    helix_cp = 2;
    helix_tp = 1;
    helix_all = 0;
    worker_device = "cpu";
    drain_body();
    cr_expect(!gen_running(worker_port), "a rank of the group is still running after the stop");
    helix_cp = helix_tp = 0;
}

/*
 * SIGSTOP of rank 1 of gen-0 (a CP=2 group, helix.timeout_ms 2000) while it decodes beside a
 * plain gen-1: rank 0's next collective times out, the group ends its requests once with an error
 * naming it, deregisters and aborts its job (the stopped rank too) in bounded time; gen-1's
 * requests complete as duet-generate's and new requests go to gen-1.
 */
Test(cluster_group, a_stalled_rank_fails_the_group_in_bounded_time, .timeout = 240)
{
    enum { N = 6 };
    static job_t jobs[N];
    pthread_t th[N];
    pid_t mpirun;
    const pid_t victim = group_streams(jobs, N, th, 3, "--helix.timeout_ms", "2000", &mpirun);
    const uint64_t t0 = now_ms();
    kill(victim, SIGSTOP);
    int st = 0;
    pid_t done = 0;
    for (int k = 0; k < 400 && (done = waitpid(mpirun, &st, WNOHANG)) == 0; k++)
        usleep(50000);
    cr_expect_eq(done, mpirun, "gen-0's job still runs 20 s after its rank 1 stopped");
    cr_log_info("gen-0's job ended %llu ms after its rank 1 stopped",
                (unsigned long long)(now_ms() - t0));
    for (int i = 0; i < n_pids; i++)
        if (pids[i] == mpirun)
            pids[i] = -1;  /* reaped */
    kill(victim, SIGKILL); /* in case the job left it (checked below) */
    for (int i = 0; i < N; i++)
        pthread_join(th[i], NULL);
    expect_group_failed(jobs, N, "generation group gen-0 failed", NULL);
    job_t j = {0};
    prompt_of(&j, 17, 90, 20);
    reference(&j);
    run_job(&j);
    check_job(&j, 0);
    for (int i = 0; i < N; i++) {
        free(jobs[i].want_text);
        free(jobs[i].got_text);
    }
    free(j.want_text);
    free(j.got_text);
    const int port = worker_port;
    stop_all();
    cr_expect(!gen_running(port), "a rank of gen-0 is left running");
    helix_cp = helix_tp = 0;
}

/* ---------------------------------------------------------------- across network namespaces */

/* Remove what an earlier run left (a crash skips the fini): namespaces and links named dnt<pid>
 * whose pid is gone. The bridge is a link; deleting a namespace deletes the veth end in it and
 * with it the other end. */
static void netns_sweep(const char *only)
{
    char cmd[1024];
    snprintf(cmd, sizeof(cmd),
             "for n in $(ip netns list | awk '{print $1}' | grep -E '^dnt[0-9]+-[a-d]$'); do "
             "p=${n#dnt}; p=${p%%%%-*}; if [ \"$p\" = '%s' ] || ! kill -0 \"$p\" 2>/dev/null; "
             "then ip netns del \"$n\"; fi; done; "
             "for l in $(ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//' | "
             "grep -E '^dnt[0-9]+[bhn][a-d]?$'); do p=$(echo \"$l\" | sed -E "
             "'s/^dnt([0-9]+).*/\\1/'); if [ \"$p\" = '%s' ] || ! kill -0 \"$p\" 2>/dev/null; "
             "then ip link del \"$l\" 2>/dev/null; fi; done; true",
             only, only);
    if (system(cmd) != 0)
        cr_log_warn("netns sweep failed");
}

static void netns_init(void)
{
    cr_assert_eq(geteuid(), 0,
                 "cluster_netns needs root (CAP_NET_ADMIN) to create network namespaces and veth "
                 "links; CI runs as root: run this suite as root");
    cr_assert_eq(system("ip netns list >/dev/null 2>&1"), 0,
                 "cluster_netns needs iproute2's `ip` with netns support on PATH");
    netns_sweep("");
    const int id = (int)getpid();
    snprintf(netns_net, sizeof(netns_net), "10.213.%d", id % 250);
    char cmd[2048];
    int at = snprintf(cmd, sizeof(cmd),
                      "set -e; ip link add dnt%db type bridge; ip addr add %s.254/24 dev dnt%db; "
                      "ip link set dnt%db up; ",
                      id, netns_net, id, id);
    for (int i = 0; i < 4; i++) {
        const char l = (char)('a' + i);
        at += snprintf(cmd + at, sizeof(cmd) - (size_t)at,
                       "ip netns add dnt%d-%c; ip link add dnt%dh%c type veth peer name dnt%dn%c; "
                       "ip link set dnt%dn%c netns dnt%d-%c; ip link set dnt%dh%c master dnt%db "
                       "up; ip -n dnt%d-%c addr add %s.%d/24 dev dnt%dn%c; "
                       "ip -n dnt%d-%c link set dnt%dn%c up; ip -n dnt%d-%c link set lo up; ",
                       id, l, id, l, id, l, id, l, id, l, id, l, id, id, l, netns_net, i + 1, id, l,
                       id, l, id, l, id, l);
    }
    netns_id = id; /* from here the fini removes them */
    cr_assert_eq(system(cmd), 0, "could not create the namespaces: %s", cmd);
    static char host[32];
    snprintf(host, sizeof(host), "%s.1", netns_net);
    http_host = host;
}

static void netns_fini(void)
{
    stop_all();
    if (netns_id > 0) {
        char pid[16];
        snprintf(pid, sizeof(pid), "%d", netns_id);
        netns_sweep(pid);
    }
    netns_id = 0;
    http_host = "127.0.0.1";
}

/* Whether name's log holds the line want. */
static int log_has(const char *name, const char *want)
{
    char path[512], line[2048];
    snprintf(path, sizeof(path), "%s/%s.log", dir, name);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return 0;
    int found = 0;
    while (!found && fgets(line, sizeof(line), f) != NULL)
        found = strstr(line, want) != NULL;
    fclose(f);
    return found;
}

/*
 * Router, context worker and two generation workers each in their own network namespace, UCX
 * over tcp on the veths only (ucx.tls, ucx.net_devices): every router message and every KV
 * transfer crosses a real interface. Greedy answers equal duet-generate's; then gen-0's link is
 * cut while streams decode and prompts are in transfer: its requests end once, with an error,
 * within a bound; every page comes back on the live workers; a new request succeeds.
 */
Test(cluster_netns, greedy_equal_and_a_cut_link_fails_its_requests_once, .init = netns_init,
     .fini = netns_fini, .timeout = 120)
{
    worker_device = "cpu";
    start_cluster(1, 2);
    for (int i = 0; i < 3; i++) {
        const char *w = i == 0 ? "ctx-0" : i == 1 ? "gen-0" : "gen-1";
        char dev[64];
        snprintf(dev, sizeof(dev), "UCX: UCX_NET_DEVICES=dnt%dn%c (from ucx.net_devices)", netns_id,
                 (char)('b' + i));
        cr_expect(log_has(w, "UCX: UCX_TLS=tcp (from ucx.tls)"), "%s: no ucx.tls line", w);
        cr_expect(log_has(w, "ucx.tls=tcp replaces UCX_TLS=tcp,self,sm from the environment"),
                  "%s: the key replaced the inherited UCX_TLS without saying so", w);
        cr_expect(log_has(w, dev), "%s: no '%s'", w, dev);
    }
    /* short ones prefilled on the gen workers, the rest by ctx-0 and moved across */
    static const int lens[] = {8, 20, 40, 130, 300, 500};
    enum { G = 6, N = 8 };
    static job_t jobs[N];
    pthread_t th[N];
    for (int i = 0; i < G; i++) {
        memset(&jobs[i], 0, sizeof(jobs[i]));
        prompt_of(&jobs[i], i, lens[i], 12 + i * 5);
        jobs[i].stream = i % 2;
        reference(&jobs[i]);
    }
    for (int i = 0; i < G; i++)
        pthread_create(&th[i], NULL, run_job, &jobs[i]);
    for (int i = 0; i < G; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < G; i++) {
        check_job(&jobs[i], i);
        free(jobs[i].want_text);
        free(jobs[i].got_text);
    }
    wait_idle(3, 10000);

    /* long streams on both gen workers, more prompts arriving around the cut */
    for (int i = 0; i < N; i++) {
        memset(&jobs[i], 0, sizeof(jobs[i]));
        prompt_of(&jobs[i], i + 20, 40 + i * 30, 200);
        jobs[i].stream = 1;
        jobs[i].ignore_eos = 1;
        jobs[i].delay_ms = i < 4 ? 0 : 300 * (i - 3);
        reference(&jobs[i]);
    }
    for (int i = 0; i < N; i++)
        pthread_create(&th[i], NULL, run_job, &jobs[i]);
    cr_assert_eq(busy_worker("gen-", 1, 20000), 0, "gen-0 never ran a request");
    char cmd[256];
    snprintf(cmd, sizeof(cmd), "ip link set dnt%dhc down", netns_id);
    const uint64_t cut = now_ms();
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    for (int i = 0; i < N; i++)
        pthread_join(th[i], NULL);
    int ok = 0, failed = 0;
    for (int i = 0; i < N; i++) {
        if (jobs[i].status == 200 && strcmp(jobs[i].got_text, jobs[i].want_text) == 0 &&
            jobs[i].got_tokens == jobs[i].want_tokens) {
            ok++;
            continue;
        }
        failed++;
        const char *e = strstr(jobs[i].got_text, "[error]");
        /* a started stream: one error event, nothing after it; else one error response */
        if (jobs[i].status == 200) {
            cr_expect_not_null(e, "request %d: a stream cut short without an error: %.300s", i,
                               jobs[i].got_text);
            if (e != NULL)
                cr_expect(strstr(e + 1, "[error]") == NULL && strchr(e, '\n') == NULL,
                          "request %d: more after its error: %.300s", i, e);
        }
        cr_expect(strstr(jobs[i].got_text, "gen-0") != NULL ||
                      strstr(jobs[i].got_text, "lost") != NULL || jobs[i].status >= 500,
                  "request %d failed without naming the lost worker: %.300s", i, jobs[i].got_text);
        cr_expect_lt(jobs[i].done_ms - cut, 30000,
                     "request %d ended %llu ms after the cut (bound 30 s)", i,
                     (unsigned long long)(jobs[i].done_ms - cut));
    }
    printf("cluster_netns: after the cut %d requests completed, %d failed\n", ok, failed);
    cr_expect_gt(ok, 0, "requests on gen-1 completed");
    cr_expect_gt(failed, 0, "requests on the cut-off gen-0 failed");
    wait_idle(2, 20000); /* ctx-0 and gen-1, all pages back */
    job_t j = {0};
    prompt_of(&j, 7, 200, 16);
    reference(&j);
    run_job(&j);
    check_job(&j, 0);
    wait_idle(2, 10000);
    for (int i = 0; i < N; i++) {
        free(jobs[i].want_text);
        free(jobs[i].got_text);
    }
    free(j.want_text);
    free(j.got_text);
}
