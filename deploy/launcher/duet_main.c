/*
 * duet: the one-command local cluster (docs/architecture.md, "Processes"). `duet up [CLUSTER.yaml]`
 * reads a cluster file (deploy/launcher/cluster.h), starts duet-router, waits for its worker port,
 * starts the context and generation workers, waits until the router reports every one of them up,
 * prints the endpoint and a sample curl command, sends that sample request itself and prints the
 * answer, then stays in the foreground until Ctrl-C / SIGTERM (or exits after the answer with
 * --once). `duet sbatch [CLUSTER.yaml]` writes the same cluster as a Slurm batch script instead
 * (deploy/launcher/sbatch.h).
 *
 * Readiness. The router's GET /health answers {"gen_workers": N, "ctx_workers": M, ...} from its
 * registry's UP counts, whatever the status code; the cluster is up when it answers 200 (at least
 * one gen worker, not draining) and both counts reach the cluster file's. That is the registry's
 * own view, so it cannot disagree with placement the way a log line or a port probe could.
 *
 * Stopping. Workers first (they deregister from a live router), then the router, each with the
 * grace period (stop_timeout_s) before SIGKILL; every child is reaped (deploy/launcher/procs.h
 * says how orphans are prevented even when the launcher itself is killed). A child that dies
 * after start-up is reported and the rest keep serving, unless --exit-on-child-death; the
 * router's death always stops the cluster, since nothing can reach the workers without it.
 *
 * Output. The launcher's own lines ("duet: ...") and the children's ("[gen-0] ...") go to
 * stderr; what the operator came for (endpoint, curl command, sample answer) goes to stdout.
 * Exit status: 0 after a requested stop where every child stopped on SIGTERM; 1 when start-up,
 * the sample request (--once) or a stop fails; 2 for usage and cluster-file errors.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/strbuf.h"
#include "common/version.h"
#include "deploy/launcher/cluster.h"
#include "deploy/launcher/hreq.h"
#include "deploy/launcher/procs.h"
#include "deploy/launcher/sbatch.h"
#include "router/cluster/admin.h"

#define UP_HEALTH_EVERY_MS   200
#define UP_PROGRESS_EVERY_MS 2000
#define UP_PROBE_TIMEOUT_MS  2000

typedef struct {
    duet_cluster_t *spec; /* owned */
    duet_procs_t *ps;     /* owned */
    const char *log_dir;  /* argv, may be NULL */
    bool once, no_sample, exit_on_child_death;
    int router;                                /* proc index, -1 before it starts */
    int workers[2 * DUET_CLUSTER_MAX_WORKERS]; /* proc indexes, ctx then gen */
    int n_workers;
    bool started;        /* start-up finished: child deaths are no longer fatal */
    duet_status_t abort; /* sticky: why the current phase must end (OK = keep going) */
    int stops_seen;      /* stop requests handled */
    char http_host[256], workers_host[256]; /* addresses to connect to (0.0.0.0 -> 127.0.0.1) */
    char mpirun[PATH_MAX];                  /* found on PATH when a gen group needs it, else "" */
    uint64_t t0_ms;
    /* the router's admin API (up_admin_prepare): its URL, the token (made here when the file
     * sets none: then the router alone gets it, as DUET_ADMIN_TOKEN), the admin file written */
    char admin_url[300], admin_token[72], admin_file[PATH_MAX];
    bool admin_on, token_made, admin_file_written;
} up_t;

static uint64_t up_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* The address to connect to for a bind address: a wildcard means this machine. */
static void up_connect_host(const char *bind, char *out, size_t cap)
{
    if (bind[0] == '\0' || strcmp(bind, "0.0.0.0") == 0)
        snprintf(out, cap, "127.0.0.1");
    else if (strcmp(bind, "::") == 0 || strcmp(bind, "[::]") == 0)
        snprintf(out, cap, "::1");
    else
        snprintf(out, cap, "%s", bind);
}

/* ---------------------------------------------------------------- paths */

static bool up_is_file(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

static bool up_is_dir(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISDIR(sb.st_mode);
}

/* The folder holding this executable (resolved), or "" when /proc is not there. */
static void up_exe_dir(char *out, size_t cap)
{
    char buf[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
    out[0] = '\0';
    if (n <= 0)
        return;
    buf[n] = '\0';
    char *slash = strrchr(buf, '/');
    if (slash != NULL)
        *slash = '\0';
    snprintf(out, cap, "%s", buf);
}

/*
 * The repository root: DUET_SOURCE_DIR, else the first folder above the executable that holds
 * deploy/configs/ (a build tree inside or beside the checkout), else the one it was built from.
 */
static void up_find_root(const char *exe_dir, char *out, size_t cap)
{
    const char *env = getenv("DUET_SOURCE_DIR");
    if (env != NULL && env[0] != '\0') {
        snprintf(out, cap, "%s", env);
        return;
    }
    char dir[PATH_MAX], probe[PATH_MAX + 64];
    snprintf(dir, sizeof(dir), "%s", exe_dir);
    for (int depth = 0; depth < 8 && dir[0] != '\0'; depth++) {
        snprintf(probe, sizeof(probe), "%s/deploy/configs/local.yaml", dir);
        if (up_is_file(probe)) {
            snprintf(out, cap, "%s", dir);
            return;
        }
        char *slash = strrchr(dir, '/');
        if (slash == NULL)
            break;
        *slash = '\0';
    }
    snprintf(out, cap, "%s", DUET_LAUNCHER_SOURCE_DIR);
}

/* ---------------------------------------------------------------- usage */

static const char up_usage[] =
    "usage: duet up [CLUSTER.yaml] [--once] [--no-sample] [--log-dir DIR]\n"
    "               [--exit-on-child-death]\n"
    "\n"
    "Start a local duet cluster: duet-router, then the context (duet-ctx) and generation\n"
    "(duet-gen) workers the cluster file asks for; wait until the router reports all of them\n"
    "up; print the endpoint and a sample curl command; send that sample request and print the\n"
    "answer; then run in the foreground until Ctrl-C or SIGTERM, which stop the workers, then\n"
    "the router (SIGKILL after the file's stop_timeout_s).\n"
    "\n"
    "  CLUSTER.yaml             the cluster file (default: deploy/configs/local.yaml in the\n"
    "                           source tree: DUET_SOURCE_DIR, else found from this binary)\n"
    "  --once                   stop everything after the sample answer; exit 0 if it came\n"
    "  --no-sample              do not send the sample request\n"
    "  --log-dir DIR            write each process's output to DIR/NAME.log instead of\n"
    "                           forwarding it to stderr as \"[NAME] line\"\n"
    "  --exit-on-child-death    stop the cluster when any child exits after start-up\n"
    "                           (default: report it and keep the rest running)\n"
    "  -h, --help               this text\n"
    "\n"
    "The cluster file's keys: model, binaries, router, ctx {count, args, binary},\n"
    "gen {count, cp, tp, args, binary}, startup_timeout_s, stop_timeout_s, sample\n"
    "(deploy/configs/local.yaml explains each). gen cp / tp (default 1, cp * tp <= 64) make\n"
    "each generation worker a Helix group of cp x tp ranks, started as\n"
    "`mpirun -n CP*TP ... duet-gen ... --helix.cp=CP --helix.tp=TP` (Open MPI's mpirun must\n"
    "be on PATH); it is one worker to the router, and its ranks' output goes to its log.\n"
    "\n"
    "Exit status: 0 after a requested stop, 1 when start-up, the --once sample or the stop\n"
    "failed, 2 for usage and cluster-file errors.\n";

static const char main_usage[] =
    "usage: duet <command> [options]\n"
    "\n"
    "Commands:\n"
    "  up [CLUSTER.yaml]   start a local cluster (router + ctx + gen workers) in the\n"
    "                      foreground; `duet up --help` for its options\n"
    "  sbatch [CLUSTER.yaml]\n"
    "                      write a Slurm batch script for the cluster file to stdout;\n"
    "                      `duet sbatch --help` for its options\n"
    "  --version           the version, git commit and CUDA build\n"
    "\n"
    "The processes themselves are duet-router, duet-ctx and duet-gen; each takes --help.\n";

/* ---------------------------------------------------------------- watching */

static bool up_is_worker(const up_t *up, int idx)
{
    return idx != up->router;
}

/* The executable a child runs, for messages. */
static const char *up_binary_of(const up_t *up, int idx)
{
    const char *name = duet_procs_name(up->ps, idx);
    if (!up_is_worker(up, idx))
        return up->spec->router.binary;
    return strncmp(name, "ctx-", 4) == 0 ? up->spec->ctx.binary : up->spec->gen.binary;
}

/*
 * React to what happened since the last call: stop requests and children that exited. Sets
 * and returns up->abort: DUET_ERR_CANCELLED for a stop request, DUET_ERR_INTERNAL for a death
 * that ends this phase (any during start-up; the router's, or any with --exit-on-child-death,
 * later).
 */
static duet_status_t up_watch(up_t *up)
{
    int stops = duet_procs_stop_requests(up->ps);
    if (stops > up->stops_seen && up->abort == DUET_OK) {
        up->stops_seen = stops;
        fprintf(stderr, "duet: %s received; stopping the cluster\n",
                duet_procs_stop_signal(up->ps) == SIGINT ? "SIGINT" : "SIGTERM");
        up->abort = DUET_ERR_CANCELLED;
    }
    int idx;
    while ((idx = duet_procs_next_exit(up->ps)) >= 0) {
        char how[128];
        duet_procs_describe_exit(up->ps, idx, how, sizeof(how));
        const char *name = duet_procs_name(up->ps, idx);
        if (!up->started) {
            fprintf(stderr, "duet: %s (%s) %s during start-up; %s. Stopping the cluster.\n", name,
                    up_binary_of(up, idx), how,
                    up->log_dir != NULL ? "its output is in the log folder"
                                        : "its output, if any, is above as [name] lines");
        } else if (!up_is_worker(up, idx)) {
            fprintf(stderr, "duet: the router %s; stopping the workers\n", how);
        } else if (up->exit_on_child_death) {
            fprintf(stderr, "duet: %s (%s) %s; stopping the cluster (--exit-on-child-death)\n",
                    name, up_binary_of(up, idx), how);
        } else {
            fprintf(stderr,
                    "duet: %s (%s) %s; the rest keep running (the router serves with the "
                    "workers left)\n",
                    name, up_binary_of(up, idx), how);
            continue;
        }
        if (up->abort == DUET_OK)
            up->abort = DUET_ERR_INTERNAL;
    }
    return up->abort;
}

/*
 * One HTTP request to the router while children keep being watched and their output forwarded.
 * On DUET_OK *status_p and *body_p (malloc'd, free it) hold the response. DUET_ERR_CANCELLED
 * when up_watch ended the phase; DUET_ERR_TIMEOUT after timeout_ms; other errors from the
 * request itself (detail set).
 */
static duet_status_t up_request(up_t *up, const char *method, const char *path, const char *body,
                                int timeout_ms, int *status_p, char **body_p)
{
    duet_hreq_t *req;
    duet_status_t st =
        duet_hreq_start(up->http_host, up->spec->http_port, method, path, body, &req);
    if (st != DUET_OK)
        return st;
    uint64_t deadline = up_now_ms() + (uint64_t)timeout_ms;
    for (;;) {
        if (up_watch(up) != DUET_OK) {
            st = DUET_ERR_CANCELLED;
            break;
        }
        uint64_t now = up_now_ms();
        if (now >= deadline) {
            st = duet_error_set(DUET_ERR_TIMEOUT, "%s %s: no answer within %d ms", method, path,
                                timeout_ms);
            break;
        }
        short rev = 0;
        int wait = deadline - now < 250 ? (int)(deadline - now) : 250;
        duet_procs_poll(up->ps, wait, duet_hreq_fd(req), duet_hreq_events(req), &rev);
        if (rev == 0)
            continue;
        st = duet_hreq_step(req);
        if (st == DUET_ERR_BUSY)
            continue;
        if (st == DUET_OK) {
            *status_p = duet_hreq_status(req);
            if ((*body_p = strdup(duet_hreq_body(req, NULL))) == NULL)
                st = duet_error_set(DUET_ERR_NOMEM, "out of memory");
        }
        break;
    }
    duet_hreq_destroy(req);
    return st;
}

/* ---------------------------------------------------------------- start-up */

static duet_status_t up_preflight(up_t *up)
{
    const duet_cluster_t *s = up->spec;
    if (!up_is_dir(s->model))
        return duet_error_set(DUET_ERR_NOT_FOUND, "%s: model folder %s does not exist", s->file,
                              s->model);
    const struct {
        const duet_cluster_role_t *role;
        const char *what, *key;
    } roles[] = {{&s->router, "duet-router", "router.binary"},
                 {&s->ctx, "duet-ctx", "ctx.binary"},
                 {&s->gen, "duet-gen", "gen.binary"}};
    for (size_t i = 0; i < sizeof(roles) / sizeof(roles[0]); i++) {
        const char *bin = roles[i].role->binary;
        if (roles[i].role->count > 0 && (!up_is_file(bin) || access(bin, X_OK) != 0))
            return duet_error_set(DUET_ERR_NOT_FOUND,
                                  "%s: %s is not built: %s is missing or not executable (build "
                                  "it, or point `binaries:` or %s at it)",
                                  s->file, roles[i].what, bin, roles[i].key);
    }
    if (s->gen.count > 0 && s->gen.cp * s->gen.tp > 1 &&
        !duet_procs_which("mpirun", up->mpirun, sizeof(up->mpirun)))
        return duet_error_set(DUET_ERR_NOT_FOUND,
                              "%s: gen cp %d x tp %d needs mpirun (Open MPI: apt install "
                              "openmpi-bin); none on PATH",
                              s->file, s->gen.cp, s->gen.tp);
    const struct {
        const char *host;
        int port;
        const char *key;
    } ports[] = {{up->http_host, s->http_port, "router.http.port"},
                 {up->workers_host, s->workers_port, "router.workers.port"}};
    for (size_t i = 0; i < sizeof(ports) / sizeof(ports[0]); i++)
        if (duet_hreq_port_open(ports[i].host, ports[i].port, 500))
            return duet_error_set(DUET_ERR_BUSY,
                                  "%s: %s %d: something already listens on %s:%d (another duet "
                                  "up?); stop it or pick another port",
                                  s->file, ports[i].key, ports[i].port, ports[i].host,
                                  ports[i].port);
    if (up->log_dir != NULL && mkdir(up->log_dir, 0755) != 0 && errno != EEXIST)
        return duet_error_set(DUET_ERR_IO, "--log-dir %s: %s", up->log_dir, strerror(errno));
    return DUET_OK;
}

/* Start one child: the role's binary (or, for a Helix group, mpirun over it), fixed flags, then
 * the role's flattened flags; duet_procs_worker_argv has the command line's contract. */
static duet_status_t up_spawn(up_t *up, const char *name, const duet_cluster_role_t *role,
                              char *const *fixed, size_t n_fixed, int *idx_p)
{
    const duet_procs_cmd_t cmd = {.binary = role->binary,
                                  .fixed = fixed,
                                  .n_fixed = n_fixed,
                                  .args = role->args,
                                  .n_args = role->n_args,
                                  .cp = role->cp,
                                  .tp = role->tp,
                                  .mpirun = up->mpirun,
                                  .as_root = geteuid() == 0};
    char **argv = NULL;
    duet_status_t st = duet_procs_worker_argv(&cmd, &argv);
    if (st != DUET_OK)
        return st;
    st = role->cp * role->tp > 1 ? duet_procs_spawn_group(up->ps, name, argv, idx_p)
                                 : duet_procs_spawn(up->ps, name, argv, idx_p);
    duet_procs_argv_free(argv);
    if (st == DUET_OK && up->log_dir != NULL)
        fprintf(stderr, "duet: %s: output in %s/%s.log\n", name, up->log_dir, name);
    return st;
}

/*
 * The router's admin API, so that `duetctl status` works out of the box: its admin.token from
 * the cluster file or DUET_ADMIN_TOKEN, else a fresh random one (admin.insecure_no_token: none);
 * the URL from admin.host / admin.port (default 127.0.0.1:8081). Both go to the admin file
 * (router/cluster/admin.h), which plain duetctl reads; a failure to write it only warns.
 */
static void up_admin_prepare(up_t *up)
{
    const duet_cluster_role_t *r = &up->spec->router;
    const char *token = duet_cluster_arg(r, "admin.token");
    const char *insecure = duet_cluster_arg(r, "admin.insecure_no_token");
    if (token == NULL || token[0] == '\0')
        token = getenv("DUET_ADMIN_TOKEN");
    const bool no_token = insecure != NULL && strcmp(insecure, "false") != 0;
    if ((token == NULL || token[0] == '\0') && !no_token) {
        unsigned char raw[16];
        FILE *f = fopen("/dev/urandom", "rb");
        const bool ok = f != NULL && fread(raw, 1, sizeof(raw), f) == sizeof(raw);
        if (f != NULL)
            fclose(f);
        if (!ok) {
            fprintf(stderr, "duet: cannot read /dev/urandom: the admin API stays off\n");
            return;
        }
        for (size_t i = 0; i < sizeof(raw); i++)
            snprintf(up->admin_token + 2 * i, 3, "%02x", raw[i]);
        up->token_made = true;
    } else if (token != NULL) {
        snprintf(up->admin_token, sizeof(up->admin_token), "%s", token);
    }
    const char *host = duet_cluster_arg(r, "admin.host"), *port = duet_cluster_arg(r, "admin.port");
    char connect[256];
    up_connect_host(host != NULL ? host : "127.0.0.1", connect, sizeof(connect));
    const bool v6 = strchr(connect, ':') != NULL;
    snprintf(up->admin_url, sizeof(up->admin_url), "http://%s%s%s:%s", v6 ? "[" : "", connect,
             v6 ? "]" : "", port != NULL ? port : "8081");
    up->admin_on = true;
    if (duet_admin_file_path(up->admin_file, sizeof(up->admin_file))) {
        if (duet_admin_file_write(up->admin_file, up->admin_url, up->admin_token) == DUET_OK)
            up->admin_file_written = true;
        else
            fprintf(stderr, "duet: %s (duetctl needs --admin and --token)\n", duet_error_last());
    }
}

static duet_status_t up_start_router(up_t *up)
{
    const duet_cluster_t *s = up->spec;
    char *fixed[] = {"--model", s->model};
    fprintf(stderr, "duet: starting duet-router (%s): http %s:%d, workers %s:%d\n",
            s->router.binary, s->http_host, s->http_port, s->workers_host, s->workers_port);
    /* a token made here reaches the router only (the environment, not its command line, which
     * other users can read; the workers have no such key and would warn) */
    if (up->token_made)
        setenv("DUET_ADMIN_TOKEN", up->admin_token, 1);
    duet_status_t st = up_spawn(up, "router", &s->router, fixed, 2, &up->router);
    if (up->token_made)
        unsetenv("DUET_ADMIN_TOKEN");
    if (st != DUET_OK)
        return st;
    uint64_t deadline = up->t0_ms + (uint64_t)s->startup_timeout_s * 1000;
    while (!duet_hreq_port_open(up->workers_host, s->workers_port, 200)) {
        if (up_watch(up) != DUET_OK)
            return up->abort;
        if (up_now_ms() >= deadline)
            return duet_error_set(DUET_ERR_TIMEOUT,
                                  "the router's worker port %s:%d did not open within %d s "
                                  "(startup_timeout_s)",
                                  up->workers_host, s->workers_port, s->startup_timeout_s);
        duet_procs_poll(up->ps, 100, -1, 0, NULL);
    }
    return up_watch(up);
}

static duet_status_t up_start_workers(up_t *up)
{
    const duet_cluster_t *s = up->spec;
    char router_addr[300];
    snprintf(router_addr, sizeof(router_addr), "%s:%d", up->workers_host, s->workers_port);
    const struct {
        const duet_cluster_role_t *role;
        const char *prefix;
    } roles[] = {{&s->ctx, "ctx"}, {&s->gen, "gen"}};
    for (size_t r = 0; r < 2; r++) {
        const duet_cluster_role_t *role = roles[r].role;
        if (role->count > 0 && role->cp * role->tp > 1)
            fprintf(stderr,
                    "duet: starting %d %s worker%s (%s), each a Helix group of cp %d x tp %d = %d "
                    "ranks under %s\n",
                    role->count, roles[r].prefix, role->count == 1 ? "" : "s", role->binary,
                    role->cp, role->tp, role->cp * role->tp, up->mpirun);
        else if (role->count > 0)
            fprintf(stderr, "duet: starting %d %s worker%s (%s)\n", role->count, roles[r].prefix,
                    role->count == 1 ? "" : "s", role->binary);
        for (int i = 0; i < roles[r].role->count; i++) {
            char name[32];
            snprintf(name, sizeof(name), "%s-%d", roles[r].prefix, i);
            char *fixed[] = {"--router", router_addr, "--model", s->model, "--name", name};
            duet_status_t st =
                up_spawn(up, name, roles[r].role, fixed, 6, &up->workers[up->n_workers]);
            if (st != DUET_OK)
                return st;
            up->n_workers++;
        }
    }
    return up_watch(up);
}

/* Poll /health until both worker counts are reached (see the file comment). */
static duet_status_t up_wait_ready(up_t *up)
{
    const duet_cluster_t *s = up->spec;
    int want = s->ctx.count + s->gen.count;
    uint64_t deadline = up->t0_ms + (uint64_t)s->startup_timeout_s * 1000;
    uint64_t next_progress = up_now_ms() + UP_PROGRESS_EVERY_MS;
    int last_up = -1;
    long ctx = 0, gen = 0;
    for (;;) {
        int status = 0;
        char *body = NULL;
        duet_status_t st =
            up_request(up, "GET", "/health", NULL, UP_PROBE_TIMEOUT_MS, &status, &body);
        if (st == DUET_ERR_CANCELLED)
            return up->abort;
        if (st == DUET_OK) {
            json_t *j = json_loads(body, 0, NULL);
            ctx = json_integer_value(json_object_get(j, "ctx_workers"));
            gen = json_integer_value(json_object_get(j, "gen_workers"));
            json_decref(j);
        }
        free(body);
        if (st == DUET_OK && status == 200 && ctx >= s->ctx.count && gen >= s->gen.count)
            return DUET_OK;
        uint64_t now = up_now_ms();
        int n_up = (int)(ctx + gen);
        if (now >= deadline)
            return duet_error_set(DUET_ERR_TIMEOUT,
                                  "start-up timed out after %d s (startup_timeout_s): %d/%d "
                                  "workers up (ctx %ld/%d, gen %ld/%d)",
                                  s->startup_timeout_s, n_up, want, ctx, s->ctx.count, gen,
                                  s->gen.count);
        if (now >= next_progress || n_up != last_up) {
            fprintf(stderr, "duet: waiting for %d ctx + %d gen workers (%d/%d up, %d s)\n",
                    s->ctx.count, s->gen.count, n_up, want, (int)((now - up->t0_ms) / 1000));
            next_progress = now + UP_PROGRESS_EVERY_MS;
        }
        last_up = n_up;
        uint64_t until = now + UP_HEALTH_EVERY_MS, t;
        while ((t = up_now_ms()) < until) {
            if (up_watch(up) != DUET_OK)
                return up->abort;
            duet_procs_poll(up->ps, (int)(until - t), -1, 0, NULL);
        }
    }
}

/* ---------------------------------------------------------------- the sample request */

/*
 * The served model's name from /v1/models (the request must name it); else the model folder's
 * name, the router's default. A copy, or NULL when out of memory.
 */
static char *up_model_name(up_t *up)
{
    int status = 0;
    char *body = NULL;
    char *name = NULL;
    if (up_request(up, "GET", "/v1/models", NULL, UP_PROBE_TIMEOUT_MS, &status, &body) == DUET_OK &&
        status == 200) {
        json_t *j = json_loads(body, 0, NULL);
        const char *id =
            json_string_value(json_object_get(json_array_get(json_object_get(j, "data"), 0), "id"));
        if (id != NULL)
            name = strdup(id);
        json_decref(j);
    }
    free(body);
    if (name == NULL) {
        char dir[PATH_MAX];
        snprintf(dir, sizeof(dir), "%s", up->spec->model);
        size_t l = strlen(dir);
        while (l > 1 && dir[l - 1] == '/')
            dir[--l] = '\0';
        const char *slash = strrchr(dir, '/');
        name = strdup(slash != NULL ? slash + 1 : dir);
    }
    return name;
}

/*
 * Print the endpoint and a curl command, then (unless --no-sample) send that request and print
 * the answer. DUET_OK when no sample was asked for or it answered 200 with text.
 */
static duet_status_t up_announce(up_t *up)
{
    const duet_cluster_t *s = up->spec;
    char *model = up_model_name(up);
    if (up->abort != DUET_OK) {
        free(model);
        return up->abort;
    }
    json_t *req = json_pack("{s:s, s:s, s:i, s:i}", "model", model != NULL ? model : "", "prompt",
                            s->sample_prompt, "max_tokens", s->sample_max_tokens, "temperature", 0);
    char *body = req != NULL ? json_dumps(req, JSON_COMPACT) : NULL;
    json_decref(req);
    if (body == NULL) {
        free(model);
        return duet_error_set(DUET_ERR_NOMEM, "out of memory");
    }
    const char *h6 = strchr(up->http_host, ':') != NULL ? "[" : "";
    const char *h6e = h6[0] != '\0' ? "]" : "";
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    duet_strbuf_printf(&sb,
                       "curl -s http://%s%s%s:%d/v1/completions -H 'Content-Type: "
                       "application/json' -d ",
                       h6, up->http_host, h6e, s->http_port);
    duet_sbatch_shell_quote(&sb, body);
    printf("\nduet is up in %.1f s: %d ctx + %d gen workers, model \"%s\"\n"
           "  OpenAI API  http://%s%s%s:%d/v1   (health /health, metrics /metrics)\n"
           "  try         %s\n",
           (double)(up_now_ms() - up->t0_ms) / 1000.0, s->ctx.count, s->gen.count,
           model != NULL ? model : "?", h6, up->http_host, h6e, s->http_port,
           sb.data != NULL ? sb.data : "");
    if (up->admin_on && up->admin_file_written)
        printf("  admin       %s  token %s\n"
               "  operate     duetctl status   (URL and token in %s)\n",
               up->admin_url, up->admin_token[0] != '\0' ? up->admin_token : "(none)",
               up->admin_file);
    else if (up->admin_on)
        printf("  admin       %s  token %s\n"
               "  operate     duetctl --admin %s%s%s status\n",
               up->admin_url, up->admin_token[0] != '\0' ? up->admin_token : "(none)",
               up->admin_url, up->admin_token[0] != '\0' ? " --token " : "", up->admin_token);
    printf("\n");
    fflush(stdout);
    duet_strbuf_free(&sb);
    free(model);

    duet_status_t st = DUET_OK;
    if (!up->no_sample) {
        int status = 0;
        char *resp = NULL;
        uint64_t t = up_now_ms();
        st = up_request(up, "POST", "/v1/completions", body, s->startup_timeout_s * 1000, &status,
                        &resp);
        if (st == DUET_OK) {
            json_t *j = json_loads(resp, 0, NULL);
            const char *text = json_string_value(
                json_object_get(json_array_get(json_object_get(j, "choices"), 0), "text"));
            if (status == 200 && text != NULL) {
                printf("sample (%.1f s, %lld tokens):\n  prompt  %s\n  answer  %s\n\n",
                       (double)(up_now_ms() - t) / 1000.0,
                       (long long)json_integer_value(
                           json_object_get(json_object_get(j, "usage"), "completion_tokens")),
                       s->sample_prompt, text);
                fflush(stdout);
            } else {
                st = duet_error_set(DUET_ERR_IO, "the sample request answered HTTP %d: %.300s",
                                    status, resp);
            }
            json_decref(j);
        }
        free(resp);
        if (st == DUET_ERR_CANCELLED)
            st = up->abort;
        else if (st != DUET_OK)
            fprintf(stderr, "duet: sample request failed: %s\n", duet_error_last());
    }
    free(body);
    return st;
}

/* ---------------------------------------------------------------- stopping */

/* Whether a child's end after our SIGTERM counts as clean: exit 0, or killed by that SIGTERM. */
static bool up_clean_exit(int wstatus)
{
    return (WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0) ||
           (WIFSIGNALED(wstatus) && WTERMSIG(wstatus) == SIGTERM);
}

/* Stop workers, then the router; true when every one that was still running stopped cleanly. */
static bool up_stop(up_t *up)
{
    int grace_ms = up->spec->stop_timeout_s * 1000;
    int running[DUET_PROCS_MAX];
    int n = 0, killed = 0, k = 0;
    bool clean = true;
    int idx;
    while ((idx = duet_procs_next_exit(up->ps)) >= 0) {
        char how[128];
        fprintf(stderr, "duet: %s (%s) %s\n", duet_procs_name(up->ps, idx), up_binary_of(up, idx),
                duet_procs_describe_exit(up->ps, idx, how, sizeof(how)));
    }
    for (int i = 0; i < up->n_workers; i++)
        if (duet_procs_running(up->ps, up->workers[i]))
            running[n++] = up->workers[i];
    int n_workers = n;
    if (up->router >= 0 && duet_procs_running(up->ps, up->router))
        running[n++] = up->router;
    if (n == 0)
        return true;
    fprintf(stderr, "duet: stopping %d worker%s, then the router (SIGKILL after %d s)\n", n_workers,
            n_workers == 1 ? "" : "s", up->spec->stop_timeout_s);
    int stops = duet_procs_stop_requests(up->ps);
    duet_procs_stop(up->ps, running, (size_t)n_workers, grace_ms, &k);
    killed += k;
    if (n > n_workers) {
        /* a second Ctrl-C meanwhile means "now" */
        duet_procs_stop(up->ps, running + n_workers, 1,
                        duet_procs_stop_requests(up->ps) != stops ? 0 : grace_ms, &k);
        killed += k;
    }
    for (int i = 0; i < n; i++) {
        int st = duet_procs_wait_status(up->ps, running[i]);
        if (!up_clean_exit(st)) {
            char how[128];
            fprintf(stderr, "duet: %s %s while stopping\n", duet_procs_name(up->ps, running[i]),
                    duet_procs_describe_exit(up->ps, running[i], how, sizeof(how)));
            clean = false;
        }
    }
    while (duet_procs_next_exit(up->ps) >= 0)
        ; /* all reported above */
    fprintf(stderr, "duet: all %d processes stopped%s\n", n,
            killed > 0 ? " (some needed SIGKILL)" : "");
    return clean && killed == 0;
}

/* ---------------------------------------------------------------- main */

/* Foreground: serve until a stop request or a fatal death. True for a requested stop. */
static bool up_serve(up_t *up)
{
    fprintf(stderr, "duet: running; Ctrl-C or SIGTERM stops the cluster\n");
    while (up_watch(up) == DUET_OK)
        duet_procs_poll(up->ps, 1000, -1, 0, NULL);
    return up->abort == DUET_ERR_CANCELLED;
}

/*
 * Load the cluster file `file` (NULL: deploy/configs/local.yaml of the source tree), relative
 * paths resolved against the repository root and binaries defaulting to this build's folder.
 */
static duet_status_t load_cluster(const char *file, duet_cluster_t **spec_p)
{
    char exe_dir[PATH_MAX], root[PATH_MAX], bin[PATH_MAX + 8], def_file[PATH_MAX + 32];
    up_exe_dir(exe_dir, sizeof(exe_dir));
    up_find_root(exe_dir, root, sizeof(root));
    /* the executable sits at <build>/deploy/launcher/duet */
    char joined[PATH_MAX + 8];
    snprintf(joined, sizeof(joined), "%s/../..", exe_dir);
    if (exe_dir[0] == '\0' || realpath(joined, bin) == NULL)
        snprintf(bin, sizeof(bin), "%s/build", root);
    if (file == NULL) {
        snprintf(def_file, sizeof(def_file), "%s/deploy/configs/local.yaml", root);
        file = def_file;
    }
    duet_cluster_paths_t paths = {.root = root, .binaries = bin};
    return duet_cluster_load_file(file, &paths, spec_p);
}

static int up_main(int argc, char **argv)
{
    up_t up = {.router = -1};
    const char *file = NULL;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            fputs(up_usage, stdout);
            return 0;
        } else if (strcmp(a, "--once") == 0) {
            up.once = true;
        } else if (strcmp(a, "--no-sample") == 0) {
            up.no_sample = true;
        } else if (strcmp(a, "--exit-on-child-death") == 0) {
            up.exit_on_child_death = true;
        } else if (strncmp(a, "--log-dir=", 10) == 0 && a[10] != '\0') {
            up.log_dir = a + 10;
        } else if (strcmp(a, "--log-dir") == 0 && i + 1 < argc) {
            up.log_dir = argv[++i];
        } else if (a[0] == '-' || file != NULL) {
            fprintf(stderr, "duet up: unexpected argument %s\n%s", a, up_usage);
            return 2;
        } else {
            file = a;
        }
    }

    if (load_cluster(file, &up.spec) != DUET_OK) {
        fprintf(stderr, "duet up: %s\n", duet_error_last());
        return 2;
    }
    up_connect_host(up.spec->http_host, up.http_host, sizeof(up.http_host));
    up_connect_host(up.spec->workers_host, up.workers_host, sizeof(up.workers_host));
    if (up_preflight(&up) != DUET_OK) {
        fprintf(stderr, "duet up: %s\n", duet_error_last());
        duet_cluster_destroy(up.spec);
        return 2;
    }
    if (duet_procs_create(up.log_dir, &up.ps) != DUET_OK) {
        fprintf(stderr, "duet up: %s\n", duet_error_last());
        duet_cluster_destroy(up.spec);
        return 1;
    }
    fprintf(stderr, "duet: cluster %s: model %s\n", up.spec->file, up.spec->model);
    up.t0_ms = up_now_ms();
    int rc = 1;
    up_admin_prepare(&up);
    duet_status_t st = up_start_router(&up);
    if (st == DUET_OK)
        st = up_start_workers(&up);
    if (st == DUET_OK)
        st = up_wait_ready(&up);
    if (st == DUET_OK) {
        up.started = true;
        st = up_announce(&up);
        if (up.once) {
            rc = st == DUET_OK ? 0 : 1;
        } else if (up.abort == DUET_OK) {
            /* a failed sample is reported; the cluster keeps serving for a look */
            rc = up_serve(&up) ? 0 : 1;
        } else {
            rc = up.abort == DUET_ERR_CANCELLED ? 0 : 1;
        }
    } else if (st != DUET_ERR_CANCELLED && st != DUET_ERR_INTERNAL) {
        fprintf(stderr, "duet: %s; stopping the cluster\n", duet_error_last());
    }
    if (!up.started && st == DUET_ERR_CANCELLED)
        fprintf(stderr, "duet: start-up interrupted\n");
    if (!up_stop(&up) && rc == 0)
        rc = 1;
    if (up.admin_file_written) /* its router is gone */
        (void)unlink(up.admin_file);
    duet_procs_destroy(up.ps);
    duet_cluster_destroy(up.spec);
    return rc;
}

/* ---------------------------------------------------------------- sbatch */

static const char sbatch_usage[] =
    "usage: duet sbatch [CLUSTER.yaml] [--nodes N] [--gpus-per-node G] [--time T] > job.sbatch\n"
    "\n"
    "Write a Slurm batch script for the cluster file to stdout (docs/deploy-slurm.md): the\n"
    "router as a job step on the allocation's first node, each ctx worker and each gen worker\n"
    "as a step of its own (a gen worker with cp x tp > 1: one `srun --mpi=pmix -n CP*TP` step\n"
    "of duet-gen with --helix.cp/--helix.tp). The job prints \"duet: ... endpoint URL\" once\n"
    "every worker is up; logs go to $SLURM_SUBMIT_DIR/duet-$SLURM_JOB_ID/. Stop it in order\n"
    "(drain the gen workers, stop them, the ctx workers, the router) with\n"
    "`scancel --batch --signal=TERM JOBID`.\n"
    "\n"
    "  CLUSTER.yaml        the cluster file of `duet up` (default deploy/configs/local.yaml);\n"
    "                      paths in it must be the same on every node (a shared file system)\n"
    "  --nodes N           nodes to allocate (default 1)\n"
    "  --gpus-per-node G   allocate G GPUs a node and give each worker rank one of them\n"
    "                      (default 0: CPU workers, or GPUs without Slurm's GPU scheduling)\n"
    "  --time T            the job's time limit, in Slurm's syntax (default: the partition's)\n"
    "  -h, --help          this text\n"
    "\n"
    "Exit status: 0 when the script was written, 2 for usage and cluster-file errors.\n";

/* Parse a count option's value; false (and a message) when it is not an integer. */
static bool sbatch_int(const char *opt, const char *v, int *out)
{
    char *end = NULL;
    long n = strtol(v, &end, 10);
    if (v[0] == '\0' || *end != '\0' || n < INT_MIN || n > INT_MAX) {
        fprintf(stderr, "duet sbatch: %s \"%s\": not an integer\n", opt, v);
        return false;
    }
    *out = (int)n;
    return true;
}

static bool sbatch_loopback(const char *host)
{
    return strncmp(host, "127.", 4) == 0 || strcmp(host, "::1") == 0 ||
           strcmp(host, "localhost") == 0;
}

static int sbatch_main(int argc, char **argv)
{
    duet_sbatch_opts_t o = {.nodes = 1};
    const char *file = NULL;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            fputs(sbatch_usage, stdout);
            return 0;
        } else if (strcmp(a, "--nodes") == 0 && v != NULL) {
            if (!sbatch_int(a, argv[++i], &o.nodes))
                return 2;
        } else if (strcmp(a, "--gpus-per-node") == 0 && v != NULL) {
            if (!sbatch_int(a, argv[++i], &o.gpus_per_node))
                return 2;
        } else if (strcmp(a, "--time") == 0 && v != NULL) {
            o.time = argv[++i];
        } else if (a[0] == '-' || file != NULL) {
            fprintf(stderr, "duet sbatch: unexpected argument %s\n%s", a, sbatch_usage);
            return 2;
        } else {
            file = a;
        }
    }
    duet_cluster_t *spec = NULL;
    if (load_cluster(file, &spec) != DUET_OK) {
        fprintf(stderr, "duet sbatch: %s\n", duet_error_last());
        return 2;
    }
    if (o.nodes > 1 && (sbatch_loopback(spec->workers_host) || sbatch_loopback(spec->http_host)))
        fprintf(stderr,
                "duet sbatch: warning: %s: the router binds loopback (http %s, workers %s), which "
                "workers on the other %d nodes cannot reach; bind 0.0.0.0 for several nodes\n",
                spec->file, spec->http_host, spec->workers_host, o.nodes - 1);
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    duet_status_t st = duet_sbatch_write(spec, &o, &sb);
    int rc = 0;
    if (st != DUET_OK) {
        fprintf(stderr, "duet sbatch: %s\n", duet_error_last());
        rc = 2;
    } else if (fwrite(sb.data, 1, sb.len, stdout) != sb.len || fflush(stdout) != 0) {
        fprintf(stderr, "duet sbatch: writing the script: %s\n", strerror(errno));
        rc = 1;
    }
    duet_strbuf_free(&sb);
    duet_cluster_destroy(spec);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc < 2 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0 ||
        strcmp(argv[1], "help") == 0) {
        fputs(main_usage, argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (duet_version_flag(argv[1])) {
        duet_version_print("duet");
        return 0;
    }
    if (strcmp(argv[1], "up") == 0)
        return up_main(argc - 2, argv + 2);
    if (strcmp(argv[1], "sbatch") == 0)
        return sbatch_main(argc - 2, argv + 2);
    fprintf(stderr, "duet: unknown command \"%s\"\n%s", argv[1], main_usage);
    return 2;
}
