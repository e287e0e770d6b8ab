/*
 * `duet up` as a real process, with duet-test-worker (a test tool that fakes ctx/gen workers;
 * its tokens are the prompt ids reversed) standing in for duet-ctx and duet-gen through each
 * role's `binary:`: --once with 2 ctx + 2 gen answers the sample and exits 0 leaving nothing
 * running; SIGTERM to a foreground launcher stops every child within the grace period and exits
 * 0; a worker that exits at once fails start-up with a message naming it; a SIGKILLed launcher's
 * children die too (PR_SET_PDEATHSIG); --log-dir writes one file per process; a worker killed
 * after start-up is reported while the rest keep serving, or stops everything with
 * --exit-on-child-death; a missing binary and a busy port are refused before anything starts;
 * the router's admin API is on with a token duet up made, printed and left in the admin file,
 * where a plain `duetctl status` finds it (and the file goes with the cluster).
 *
 * "Nothing running" is checked two ways: no process whose command line holds this test's
 * private model folder (every child gets --model DIR), and both router ports refuse connections.
 * The model folder is made per test (config.json + a byte tokenizer); the router's fingerprint
 * is the literal "test", which the workers present.
 */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdint.h>
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

#define DUET    DUET_BINARY_DIR "/deploy/launcher/duet"
#define WORKER  DUET_BINARY_DIR "/tests/tools/duet-test-worker"
#define DUETCTL DUET_BINARY_DIR "/router/duetctl"

static char dir[256];
static int http_port, worker_port, admin_port;

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static bool port_open(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    bool ok = connect(fd, (struct sockaddr *)&a, sizeof(a)) == 0;
    close(fd);
    return ok;
}

static void write_file(const char *name, const char *text)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
}

/* The whole of file `name` in dir (static buffer). */
static const char *read_file(const char *name)
{
    static char buf[1 << 20];
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    buf[0] = '\0';
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return buf;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

/*
 * A model folder and a cluster file in a fresh temporary folder. ctx_binary NULL = the test
 * worker; extra is appended to the file.
 */
static void setup_cluster(int n_ctx, int n_gen, const char *ctx_binary, const char *extra)
{
    char tmpl[] = "/tmp/duet-up-test-XXXXXX";
    cr_assert_not_null(mkdtemp(tmpl));
    snprintf(dir, sizeof(dir), "%s", tmpl);
    char model[300];
    snprintf(model, sizeof(model), "%s/model", dir);
    cr_assert_eq(mkdir(model, 0755), 0);
    write_file("model/config.json",
               "{\"bos_token_id\": 256, \"eos_token_id\": 257, \"model_max_length\": 4096}\n");
    write_file(
        "model/duet_tokenizer.json",
        "{\"type\": \"byte\", \"specials\": [\"<|bos|>\", \"<|eos|>\"], \"add_bos\": true}\n");
    http_port = free_port();
    worker_port = free_port();
    while (worker_port == http_port)
        worker_port = free_port();
    admin_port = free_port();
    while (admin_port == http_port || admin_port == worker_port)
        admin_port = free_port();
    char yaml[4096];
    snprintf(yaml, sizeof(yaml),
             "model: %s\n"
             "router:\n"
             "  http: {host: 127.0.0.1, port: %d}\n"
             "  workers: {host: 127.0.0.1, port: %d, heartbeat_timeout_ms: 2000}\n"
             "  model: {fingerprint: test}\n"
             "  placement: {policy: round_robin}\n"
             "  admin: {port: %d}\n"
             "ctx:\n"
             "  count: %d\n"
             "  binary: %s\n"
             "  args: {role: ctx, fingerprint: test, heartbeat-ms: 100}\n"
             "gen:\n"
             "  count: %d\n"
             "  binary: %s\n"
             "  args: {role: gen, fingerprint: test, heartbeat-ms: 100}\n"
             "startup_timeout_s: 30\n"
             "stop_timeout_s: 5\n"
             "sample: {prompt: \"hello world\", max_tokens: 11}\n"
             "%s",
             model, http_port, worker_port, admin_port, n_ctx,
             ctx_binary != NULL ? ctx_binary : WORKER, n_gen, WORKER, extra != NULL ? extra : "");
    write_file("cluster.yaml", yaml);
}

/* Start `duet up cluster.yaml` + flags (NULL-terminated, up to 4), output in dir/out, dir/err. */
static pid_t start_up(const char *f1, const char *f2, const char *f3, const char *f4)
{
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        char out[512], err[512], cfg[512];
        snprintf(out, sizeof(out), "%s/out", dir);
        snprintf(err, sizeof(err), "%s/err", dir);
        snprintf(cfg, sizeof(cfg), "%s/cluster.yaml", dir);
        int o = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        int e = open(err, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(o, 1);
        dup2(e, 2);
        setenv("DUET_LOG_LEVEL", "info", 1);
        char admin[512];
        snprintf(admin, sizeof(admin), "%s/admin", dir); /* not the user's ~/.duet/admin */
        setenv("DUET_ADMIN_FILE", admin, 1);
        unsetenv("DUET_ADMIN_TOKEN");
        char *argv[] = {DUET, "up", cfg, (char *)f1, (char *)f2, (char *)f3, (char *)f4, NULL};
        execv(argv[0], argv);
        _exit(127);
    }
    return pid;
}

/* Wait for pid up to ms; its exit status, or -1 on timeout (then it is SIGKILLed). */
static int wait_exit(pid_t pid, int ms, uint64_t *took_ms_p)
{
    uint64_t t0 = now_ms();
    for (;;) {
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) {
            if (took_ms_p != NULL)
                *took_ms_p = now_ms() - t0;
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        }
        if (now_ms() - t0 > (uint64_t)ms) {
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            return -1;
        }
        usleep(20000);
    }
}

/*
 * Live processes (not zombies) whose command line holds this test's model folder (every child
 * gets --model DIR/model; the launcher itself does not), and of those the one named `name`
 * (--name NAME) when name is not NULL. Returns the count; *pid_p (may be NULL) the last match.
 */
static int scan_children(const char *name, pid_t *pid_p)
{
    char needle[300];
    if (name != NULL)
        snprintf(needle, sizeof(needle), "%s/model --name %s ", dir, name);
    else
        snprintf(needle, sizeof(needle), "%s/model", dir);
    DIR *d = opendir("/proc");
    cr_assert_not_null(d);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] < '0' || e->d_name[0] > '9' || atoi(e->d_name) == getpid())
            continue;
        char path[300], buf[8192];
        snprintf(path, sizeof(path), "/proc/%s/cmdline", e->d_name);
        int fd = open(path, O_RDONLY);
        if (fd < 0)
            continue;
        ssize_t r = read(fd, buf, sizeof(buf) - 1);
        close(fd);
        if (r <= 0)
            continue; /* zombies have an empty command line */
        for (ssize_t i = 0; i < r; i++)
            if (buf[i] == '\0')
                buf[i] = ' ';
        buf[r] = '\0';
        if (strstr(buf, needle) != NULL) {
            n++;
            if (pid_p != NULL)
                *pid_p = (pid_t)atoi(e->d_name);
        }
    }
    closedir(d);
    return n;
}

static int count_children(void)
{
    return scan_children(NULL, NULL);
}

/* The pid of this test's child named `name`, or -1. */
static pid_t find_child(const char *name)
{
    pid_t pid = -1;
    scan_children(name, &pid);
    return pid;
}

/* Wait until no child of this test is left (up to ms); the number still there. */
static int wait_no_children(int ms)
{
    uint64_t end = now_ms() + (uint64_t)ms;
    int n;
    while ((n = count_children()) > 0 && now_ms() < end)
        usleep(50000);
    return n;
}

/* Wait until dir/out contains `s` (up to ms), while pid runs. */
static bool wait_output(pid_t pid, const char *s, int ms)
{
    uint64_t end = now_ms() + (uint64_t)ms;
    while (now_ms() < end) {
        if (strstr(read_file("out"), s) != NULL)
            return true;
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid)
            return false;
        usleep(20000);
    }
    return false;
}

static void assert_all_gone(void)
{
    cr_assert_eq(wait_no_children(3000), 0, "processes left behind:\n%s", read_file("err"));
    cr_assert(!port_open(http_port), "http port %d still open", http_port);
    cr_assert(!port_open(worker_port), "worker port %d still open", worker_port);
}

Test(launcher_up, once_two_ctx_two_gen)
{
    setup_cluster(2, 2, NULL, NULL);
    int rc = wait_exit(start_up("--once", NULL, NULL, NULL), 60000, NULL);
    cr_assert_eq(rc, 0, "duet up --once exited %d\nstdout:\n%s\nstderr:\n%s", rc, read_file("out"),
                 read_file("err"));
    const char *out = read_file("out");
    /* "hello world" reversed by the test workers (after the <|bos|> the tokenizer adds) */
    cr_assert_not_null(strstr(out, "dlrow olleh"), "no sample answer in:\n%s", out);
    char want[128];
    snprintf(want, sizeof(want), "curl -s http://127.0.0.1:%d/v1/completions", http_port);
    cr_assert_not_null(strstr(out, want), "no curl line in:\n%s", out);
    const char *err = read_file("err");
    for (int i = 0; i < 2; i++) {
        char tag[64];
        snprintf(tag, sizeof(tag), "[ctx-%d] ", i);
        cr_assert_not_null(strstr(err, tag), "no %s lines in:\n%s", tag, err);
        snprintf(tag, sizeof(tag), "[gen-%d] ", i);
        cr_assert_not_null(strstr(err, tag), "no %s lines in:\n%s", tag, err);
    }
    cr_assert_not_null(strstr(err, "[router] "));
    cr_assert_not_null(strstr(err, "all 5 processes stopped"), "%s", err);
    assert_all_gone();
}

Test(launcher_up, sigterm_stops_foreground_cluster)
{
    setup_cluster(1, 2, NULL, NULL);
    pid_t pid = start_up(NULL, NULL, NULL, NULL);
    cr_assert(wait_output(pid, "answer", 30000), "never came up:\n%s\n%s", read_file("out"),
              read_file("err"));
    cr_assert_eq(count_children(), 4, "router + 3 workers expected");
    cr_assert(port_open(http_port));
    /* the admin API is on with a token duet up made and printed, and plain duetctl finds both
     * in the admin file */
    char want[128];
    snprintf(want, sizeof(want), "admin       http://127.0.0.1:%d  token ", admin_port);
    const char *tok = strstr(read_file("out"), want);
    cr_assert_not_null(tok, "no admin line in:\n%s", read_file("out"));
    char token[64] = "";
    cr_assert_eq(sscanf(tok + strlen(want), "%63[0-9a-f]", token), 1);
    cr_expect_eq(strlen(token), 32, "a 128-bit token: %s", token);
    struct stat sa;
    char admin[512];
    snprintf(admin, sizeof(admin), "%s/admin", dir);
    cr_assert_eq(stat(admin, &sa), 0, "no admin file %s", admin);
    cr_expect_eq(sa.st_mode & 0777, 0600, "admin file mode %o", sa.st_mode & 0777);
    char cmd[1024], out[8192];
    snprintf(cmd, sizeof(cmd), "env -u DUET_ADMIN_TOKEN DUET_ADMIN_FILE=%s %s status 2>&1", admin,
             DUETCTL);
    cr_expect_eq(test_run(cmd, out, sizeof(out)), 0, "%s", out);
    cr_expect(strstr(out, "gen-1") != NULL && strstr(out, "ctx-0") != NULL, "%s", out);
    snprintf(cmd, sizeof(cmd),
             "env -u DUET_ADMIN_TOKEN DUET_ADMIN_FILE=/nonexistent %s --admin "
             "http://127.0.0.1:%d status 2>&1",
             DUETCTL, admin_port);
    cr_expect_eq(test_run(cmd, out, sizeof(out)), 3, "no token: refused: %s", out);
    kill(pid, SIGTERM);
    uint64_t took = 0;
    int rc = wait_exit(pid, 15000, &took);
    cr_assert_eq(rc, 0, "exit %d after SIGTERM:\n%s", rc, read_file("err"));
    cr_assert_lt(took, 5000, "took %llu ms, longer than the 5 s grace", (unsigned long long)took);
    cr_assert_not_null(strstr(read_file("err"), "SIGTERM received"));
    cr_expect_neq(access(admin, F_OK), 0, "the admin file outlived its router");
    assert_all_gone();
}

Test(launcher_up, worker_exiting_at_once_fails_startup)
{
    setup_cluster(1, 1, "/bin/false", NULL);
    int rc = wait_exit(start_up("--once", NULL, NULL, NULL), 30000, NULL);
    cr_assert_neq(rc, 0);
    cr_assert_neq(rc, -1, "timed out");
    const char *err = read_file("err");
    cr_assert_not_null(strstr(err, "ctx-0 (/bin/false) exited with status 1 during start-up"), "%s",
                       err);
    cr_assert_null(strstr(read_file("out"), "answer"));
    assert_all_gone();
}

Test(launcher_up, missing_binary_is_refused_before_starting)
{
    setup_cluster(1, 1, "/nonexistent/duet-ctx", NULL);
    int rc = wait_exit(start_up("--once", NULL, NULL, NULL), 30000, NULL);
    cr_assert_eq(rc, 2);
    cr_assert_not_null(strstr(read_file("err"), "/nonexistent/duet-ctx is missing"), "%s",
                       read_file("err"));
    assert_all_gone();
}

/* a Helix gen group (cp x tp > 1) is started by mpirun: without one on PATH, nothing starts */
Test(launcher_up, group_without_mpirun_is_refused_before_starting)
{
    setup_cluster(1, 1, NULL, NULL);
    char yaml[8192];
    snprintf(yaml, sizeof(yaml), "%s", read_file("cluster.yaml"));
    char *gen = strstr(yaml, "gen:\n");
    cr_assert_not_null(gen);
    char grouped[8300];
    snprintf(grouped, sizeof(grouped), "%.*sgen:\n  cp: 2\n%s", (int)(gen - yaml), yaml,
             gen + strlen("gen:\n"));
    write_file("cluster.yaml", grouped);
    setenv("PATH", "/nonexistent", 1);
    int rc = wait_exit(start_up("--once", NULL, NULL, NULL), 30000, NULL);
    cr_assert_eq(rc, 2);
    cr_assert_not_null(strstr(read_file("err"), "gen cp 2 x tp 1 needs mpirun (Open MPI: apt "
                                                "install openmpi-bin)"),
                       "%s", read_file("err"));
    assert_all_gone();
}

Test(launcher_up, killed_launcher_leaves_no_orphans)
{
    setup_cluster(1, 1, NULL, NULL);
    pid_t pid = start_up("--no-sample", NULL, NULL, NULL);
    cr_assert(wait_output(pid, "duet is up", 30000), "never came up:\n%s", read_file("err"));
    cr_assert_eq(count_children(), 3);
    kill(pid, SIGKILL);
    cr_assert_eq(wait_exit(pid, 5000, NULL), 128 + SIGKILL);
    assert_all_gone();
}

Test(launcher_up, log_dir_one_file_per_process)
{
    setup_cluster(1, 1, NULL, NULL);
    char logs[300];
    snprintf(logs, sizeof(logs), "%s/logs", dir);
    int rc = wait_exit(start_up("--once", "--log-dir", logs, NULL), 60000, NULL);
    cr_assert_eq(rc, 0, "%s", read_file("err"));
    cr_assert_not_null(strstr(read_file("out"), "dlrow olleh"));
    cr_assert_null(strstr(read_file("err"), "[gen-0] "), "output forwarded despite --log-dir");
    cr_assert_not_null(strstr(read_file("logs/router.log"), "registered"));
    cr_assert_not_null(strstr(read_file("logs/ctx-0.log"), "registered as worker"));
    cr_assert_not_null(strstr(read_file("logs/gen-0.log"), "registered as worker"));
    assert_all_gone();
}

Test(launcher_up, port_in_use_is_refused)
{
    setup_cluster(1, 1, NULL, NULL);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)worker_port)};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    cr_assert_eq(bind(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    cr_assert_eq(listen(fd, 4), 0);
    int rc = wait_exit(start_up("--once", NULL, NULL, NULL), 30000, NULL);
    close(fd);
    cr_assert_eq(rc, 2);
    cr_assert_not_null(strstr(read_file("err"), "already listens"), "%s", read_file("err"));
    cr_assert_eq(wait_no_children(3000), 0);
}

Test(launcher_up, worker_death_after_startup_is_reported_and_the_rest_keep_serving)
{
    setup_cluster(1, 2, NULL, NULL);
    pid_t pid = start_up("--no-sample", NULL, NULL, NULL);
    cr_assert(wait_output(pid, "duet is up", 30000), "never came up:\n%s", read_file("err"));
    pid_t gen1 = find_child("gen-1");
    cr_assert_gt(gen1, 0);
    kill(gen1, SIGKILL);
    uint64_t end = now_ms() + 5000;
    while (strstr(read_file("err"), "gen-1 (") == NULL && now_ms() < end)
        usleep(20000);
    cr_assert_not_null(strstr(read_file("err"), "was killed by signal 9 (Killed); the rest keep "
                                                "running"),
                       "%s", read_file("err"));
    usleep(200000);
    cr_assert_eq(waitpid(pid, NULL, WNOHANG), 0, "the launcher stopped");
    cr_assert_eq(count_children(), 3, "router + ctx-0 + gen-0 expected");
    kill(pid, SIGINT);
    int rc = wait_exit(pid, 15000, NULL);
    cr_assert_eq(rc, 0, "exit %d:\n%s", rc, read_file("err"));
    cr_assert_not_null(strstr(read_file("err"), "SIGINT received"));
    assert_all_gone();
}

Test(launcher_up, exit_on_child_death_stops_everything)
{
    setup_cluster(1, 1, NULL, NULL);
    pid_t pid = start_up("--no-sample", "--exit-on-child-death", NULL, NULL);
    cr_assert(wait_output(pid, "duet is up", 30000), "never came up:\n%s", read_file("err"));
    pid_t ctx0 = find_child("ctx-0");
    cr_assert_gt(ctx0, 0);
    kill(ctx0, SIGKILL);
    int rc = wait_exit(pid, 15000, NULL);
    cr_assert_eq(rc, 1, "exit %d:\n%s", rc, read_file("err"));
    cr_assert_not_null(strstr(read_file("err"), "stopping the cluster (--exit-on-child-death)"),
                       "%s", read_file("err"));
    assert_all_gone();
}
