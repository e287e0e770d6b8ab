/*
 * The child processes of `duet up` for Helix generation groups (deploy/launcher/procs.h): the
 * command line duet_procs_worker_argv builds (mpirun first, -n N, the options, then the worker
 * with --helix.cp/--helix.tp and a default --threads=1; a plain worker unchanged), its refusals,
 * duet_procs_which, and real groups under Open MPI's mpirun (a dependency, deploy/install-deps.sh;
 * its absence fails these tests): a small shell script stands in for duet-gen, so the test sees
 * that mpirun starts N ranks with the flags, that their output reaches the worker's log, that a
 * stop reaches rank 0 alone, which stops its followers, so every rank and mpirun exit 0, and
 * that neither a stop nor a SIGKILL leaves any rank running (checked in /proc by the script's
 * unique path).
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "deploy/launcher/procs.h"

static void assert_argv(char **argv, const char *const *want, size_t n)
{
    size_t got = 0;
    while (argv[got] != NULL)
        got++;
    for (size_t i = 0; i < n && i < got; i++)
        cr_expect_str_eq(argv[i], want[i], "argv[%zu]", i);
    cr_assert_eq(got, n, "want %zu arguments, got %zu", n, got);
}

static char *const fixed[] = {"--router", "127.0.0.1:8100", "--model", "/m", "--name", "gen-0"};

Test(launcher_procs, group_argv)
{
    char *args[] = {"--cache.budget=1GiB", "--quiet"};
    duet_procs_cmd_t cmd = {.binary = "/b/duet-gen",
                            .fixed = fixed,
                            .n_fixed = 6,
                            .args = args,
                            .n_args = 2,
                            .cp = 2,
                            .tp = 1,
                            .mpirun = "/usr/bin/mpirun",
                            .as_root = true};
    char **argv = NULL;
    cr_assert_eq(duet_procs_worker_argv(&cmd, &argv), DUET_OK, "%s", duet_error_last());
    static const char *const want[] = {"/usr/bin/mpirun",
                                       "-n",
                                       "2",
                                       "--oversubscribe",
                                       "--bind-to",
                                       "none",
                                       "--tag-output",
                                       "--mca",
                                       "pml",
                                       "ob1",
                                       "--mca",
                                       "btl",
                                       "self,vader,tcp",
                                       "--allow-run-as-root",
                                       "/b/duet-gen",
                                       "--router",
                                       "127.0.0.1:8100",
                                       "--model",
                                       "/m",
                                       "--name",
                                       "gen-0",
                                       "--helix.cp=2",
                                       "--helix.tp=1",
                                       "--threads=1",
                                       "--cache.budget=1GiB",
                                       "--quiet"};
    assert_argv(argv, want, sizeof(want) / sizeof(want[0]));
    duet_procs_argv_free(argv);

    /* not root: no --allow-run-as-root; threads given: kept, no default; -n is cp * tp */
    char *args2[] = {"--threads=4"};
    cmd = (duet_procs_cmd_t){.binary = "g",
                             .fixed = fixed,
                             .n_fixed = 2,
                             .args = args2,
                             .n_args = 1,
                             .cp = 4,
                             .tp = 2,
                             .mpirun = "mpirun"};
    cr_assert_eq(duet_procs_worker_argv(&cmd, &argv), DUET_OK, "%s", duet_error_last());
    static const char *const want2[] = {"mpirun",
                                        "-n",
                                        "8",
                                        "--oversubscribe",
                                        "--bind-to",
                                        "none",
                                        "--tag-output",
                                        "--mca",
                                        "pml",
                                        "ob1",
                                        "--mca",
                                        "btl",
                                        "self,vader,tcp",
                                        "g",
                                        "--router",
                                        "127.0.0.1:8100",
                                        "--helix.cp=4",
                                        "--helix.tp=2",
                                        "--threads=4"};
    assert_argv(argv, want2, sizeof(want2) / sizeof(want2[0]));
    duet_procs_argv_free(argv);

    /* a bare --threads counts as given too */
    char *args3[] = {"--threads"};
    cmd.args = args3;
    cmd.cp = 1;
    cr_assert_eq(duet_procs_worker_argv(&cmd, &argv), DUET_OK, "%s", duet_error_last());
    static const char *const want3[] = {"mpirun",
                                        "-n",
                                        "2",
                                        "--oversubscribe",
                                        "--bind-to",
                                        "none",
                                        "--tag-output",
                                        "--mca",
                                        "pml",
                                        "ob1",
                                        "--mca",
                                        "btl",
                                        "self,vader,tcp",
                                        "g",
                                        "--router",
                                        "127.0.0.1:8100",
                                        "--helix.cp=1",
                                        "--helix.tp=2",
                                        "--threads"};
    assert_argv(argv, want3, sizeof(want3) / sizeof(want3[0]));
    duet_procs_argv_free(argv);
    duet_procs_argv_free(NULL);
}

/* 1 x 1 is the plain worker: no mpirun (none needed), no helix flags, no --threads default */
Test(launcher_procs, single_process_argv)
{
    char *args[] = {"--cache.budget=1GiB"};
    duet_procs_cmd_t cmd = {.binary = "/b/duet-ctx",
                            .fixed = fixed,
                            .n_fixed = 6,
                            .args = args,
                            .n_args = 1,
                            .cp = 1,
                            .tp = 1,
                            .as_root = true};
    char **argv = NULL;
    cr_assert_eq(duet_procs_worker_argv(&cmd, &argv), DUET_OK, "%s", duet_error_last());
    static const char *const want[] = {
        "/b/duet-ctx", "--router", "127.0.0.1:8100", "--model",
        "/m",          "--name",   "gen-0",          "--cache.budget=1GiB"};
    assert_argv(argv, want, sizeof(want) / sizeof(want[0]));
    duet_procs_argv_free(argv);

    cmd = (duet_procs_cmd_t){.binary = "/b/duet-router", .cp = 1, .tp = 1};
    cr_assert_eq(duet_procs_worker_argv(&cmd, &argv), DUET_OK, "%s", duet_error_last());
    static const char *const want2[] = {"/b/duet-router"};
    assert_argv(argv, want2, 1);
    duet_procs_argv_free(argv);
}

Test(launcher_procs, argv_refusals)
{
    char **argv = (char **)0x1;
    duet_procs_cmd_t cmd = {.binary = "g", .cp = 0, .tp = 1, .mpirun = "mpirun"};
    cr_assert_eq(duet_procs_worker_argv(&cmd, &argv), DUET_ERR_INVALID);
    cr_assert_not_null(strstr(duet_error_last(), "cp 0 x tp 1"), "%s", duet_error_last());
    cmd = (duet_procs_cmd_t){.binary = "g", .cp = 2, .tp = -1, .mpirun = "mpirun"};
    cr_assert_eq(duet_procs_worker_argv(&cmd, &argv), DUET_ERR_INVALID);
    cmd = (duet_procs_cmd_t){.binary = "g", .cp = 2, .tp = 1};
    cr_assert_eq(duet_procs_worker_argv(&cmd, &argv), DUET_ERR_INVALID);
    cr_assert_not_null(strstr(duet_error_last(), "needs mpirun"), "%s", duet_error_last());
    cmd.mpirun = "";
    cr_assert_eq(duet_procs_worker_argv(&cmd, &argv), DUET_ERR_INVALID);
    cr_assert_eq(argv, (char **)0x1, "out-param written on failure");
}

/* ---------------------------------------------------------------- PATH and real groups */

static char tmp_dir[64];

static void make_tmp(void)
{
    snprintf(tmp_dir, sizeof(tmp_dir), "/tmp/duet-procs-XXXXXX");
    cr_assert_not_null(mkdtemp(tmp_dir));
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    return remove(path);
}

/* Remove the test's folder once it passed (a failure leaves it, logs included, to look at). */
static void remove_tmp(void)
{
    cr_assert_eq(nftw(tmp_dir, rm_entry, 8, FTW_DEPTH | FTW_PHYS), 0, "%s", tmp_dir);
}

static void write_file(const char *path, const char *text, mode_t mode)
{
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f, "%s", path);
    fputs(text, f);
    fclose(f);
    cr_assert_eq(chmod(path, mode), 0);
}

Test(launcher_procs, which)
{
    make_tmp();
    char a[128], b[128], prog[200], out[256];
    snprintf(a, sizeof(a), "%s/a", tmp_dir);
    snprintf(b, sizeof(b), "%s/b", tmp_dir);
    cr_assert_eq(mkdir(a, 0755), 0);
    cr_assert_eq(mkdir(b, 0755), 0);
    snprintf(prog, sizeof(prog), "%s/tool", a); /* not executable: skipped */
    write_file(prog, "#!/bin/sh\n", 0644);
    snprintf(prog, sizeof(prog), "%s/tool", b);
    write_file(prog, "#!/bin/sh\n", 0755);
    char path[400];
    snprintf(path, sizeof(path), "/nonexistent:%s:%s", a, b);
    setenv("PATH", path, 1);
    cr_assert(duet_procs_which("tool", out, sizeof(out)));
    cr_assert_str_eq(out, prog);
    cr_assert_not(duet_procs_which("absent-tool", out, sizeof(out)));
    cr_assert_str_eq(out, "");
    cr_assert_not(duet_procs_which("b/tool", out, sizeof(out)), "a name with '/' is not searched");
    cr_assert_not(duet_procs_which("tool", out, 8), "a path that does not fit is not returned");
    unsetenv("PATH");
    cr_assert_not(duet_procs_which("tool", out, sizeof(out)));
    remove_tmp();
}

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/*
 * Ranks running `needle` ("/bin/sh SCRIPT": mpirun's own command line names the script too, but
 * not after /bin/sh), counted by process group: each rank leads one, and a subshell the script
 * has forked but not yet exec'd (its `sleep`) wears the same command line in the same group.
 */
static int count_procs_with(const char *needle)
{
    DIR *d = opendir("/proc");
    cr_assert_not_null(d);
    int pgids[256], n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] < '0' || e->d_name[0] > '9')
            continue;
        char path[300], buf[4096], st[512];
        snprintf(path, sizeof(path), "/proc/%s/stat", e->d_name);
        int fd = open(path, O_RDONLY);
        if (fd < 0)
            continue;
        ssize_t r = read(fd, st, sizeof(st) - 1);
        close(fd);
        if (r <= 0)
            continue;
        st[r] = '\0';
        const char *rp = strrchr(st, ')');
        char state = 0;
        int ppid = 0, pgid = 0;
        if (rp == NULL || sscanf(rp + 1, " %c %d %d", &state, &ppid, &pgid) != 3 || state == 'Z')
            continue; /* a zombie runs nothing; its parent reaps it */
        snprintf(path, sizeof(path), "/proc/%s/cmdline", e->d_name);
        if ((fd = open(path, O_RDONLY)) < 0)
            continue;
        r = read(fd, buf, sizeof(buf) - 1);
        close(fd);
        if (r <= 0)
            continue;
        for (ssize_t i = 0; i < r; i++)
            if (buf[i] == '\0')
                buf[i] = ' ';
        buf[r] = '\0';
        if (strstr(buf, needle) == NULL)
            continue;
        bool seen = false;
        for (int i = 0; i < n; i++)
            seen = seen || pgids[i] == pgid;
        if (!seen && n < 256)
            pgids[n++] = pgid;
    }
    closedir(d);
    return n;
}

static int count_lines_with(const char *file, const char *needle)
{
    FILE *f = fopen(file, "r");
    if (f == NULL)
        return 0;
    char line[4096];
    int n = 0;
    while (fgets(line, sizeof(line), f) != NULL)
        n += strstr(line, needle) != NULL;
    fclose(f);
    return n;
}

/* Until no process runs the script, for up to timeout_ms; the count left. */
static int wait_none_with(const char *needle, int timeout_ms)
{
    uint64_t deadline = now_ms() + (uint64_t)timeout_ms;
    int n;
    while ((n = count_procs_with(needle)) > 0 && now_ms() < deadline)
        usleep(20000);
    return n;
}

/*
 * Start `script` as a group of cp x tp ranks named gen-0 with a log folder, as duet up does, and
 * wait until every rank has written "up" to the log. *ps_p, *idx_p and the log path come back.
 */
static void start_group(const char *script, int cp, int tp, duet_procs_t **ps_p, int *idx_p,
                        char *log, size_t cap)
{
    char mpirun[512];
    cr_assert(duet_procs_which("mpirun", mpirun, sizeof(mpirun)),
              "mpirun is not on PATH: install Open MPI (deploy/install-deps.sh)");
    duet_procs_cmd_t cmd = {.binary = script,
                            .fixed = fixed,
                            .n_fixed = 6,
                            .cp = cp,
                            .tp = tp,
                            .mpirun = mpirun,
                            .as_root = geteuid() == 0};
    char **argv = NULL;
    cr_assert_eq(duet_procs_worker_argv(&cmd, &argv), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(duet_procs_create(tmp_dir, ps_p), DUET_OK, "%s", duet_error_last());
    cr_assert_eq(duet_procs_spawn_group(*ps_p, "gen-0", argv, idx_p), DUET_OK, "%s",
                 duet_error_last());
    duet_procs_argv_free(argv);
    snprintf(log, cap, "%s/gen-0.log", tmp_dir);
    uint64_t deadline = now_ms() + 30000;
    while (count_lines_with(log, " up ") < cp * tp && now_ms() < deadline) {
        cr_assert(duet_procs_running(*ps_p, *idx_p), "mpirun ended early; its log %s", log);
        duet_procs_poll(*ps_p, 50, -1, 0, NULL);
    }
    cr_assert_eq(count_lines_with(log, " up "), cp * tp, "every rank started (log %s)", log);
}

/*
 * A stand-in for duet-gen's group protocol: prints its rank, size and flags; rank 0 on SIGTERM
 * drains a little, then tells the followers to stop (a file beside the script, where duet-gen
 * broadcasts a stop command) and exits 0; a follower has no SIGTERM handler (one signalled
 * directly dies of it, and mpirun then exits non-zero) and exits 0 once told.
 */
static const char graceful_rank[] =
    "#!/bin/sh\n"
    "dir=$(dirname \"$0\")\n"
    "r=$OMPI_COMM_WORLD_RANK\n"
    "if [ \"$r\" = 0 ]; then\n"
    "  trap 'sleep 0.5; : > \"$dir/stop\"; echo \"rank 0 bye\"; exit 0' TERM\n"
    "fi\n"
    "echo \"rank $r of $OMPI_COMM_WORLD_SIZE up $*\"\n"
    "while :; do\n"
    "  if [ \"$r\" != 0 ] && [ -e \"$dir/stop\" ]; then echo \"rank $r bye\"; exit 0; fi\n"
    "  sleep 0.05\n"
    "done\n";

Test(launcher_procs, group_starts_n_ranks_and_stops_cleanly, .timeout = 60)
{
    make_tmp();
    char script[128], log[128];
    snprintf(script, sizeof(script), "%s/fake-gen.sh", tmp_dir);
    char rank_cmd[160];
    snprintf(rank_cmd, sizeof(rank_cmd), "/bin/sh %s", script);
    write_file(script, graceful_rank, 0755);
    duet_procs_t *ps = NULL;
    int idx = -1;
    start_group(script, 2, 2, &ps, &idx, log, sizeof(log));
    /* N ranks, each told its shape and one thread, each line tagged with its rank by mpirun */
    for (int r = 0; r < 4; r++) {
        char want[160];
        snprintf(want, sizeof(want),
                 "[1,%d]<stdout>:rank %d of 4 up --router 127.0.0.1:8100 --model /m --name gen-0 "
                 "--helix.cp=2 --helix.tp=2 --threads=1",
                 r, r);
        cr_expect_eq(count_lines_with(log, want), 1, "log %s lacks \"%s\"", log, want);
    }
    cr_assert_eq(count_procs_with(rank_cmd), 4, "4 ranks run the script");

    /* the stop: rank 0 gets SIGTERM, drains, stops the followers, and every rank says bye;
     * mpirun exits 0 within the grace period, with no SIGKILL (mpirun's own SIGTERM handling
     * would kill each rank in turn and exit 1) */
    uint64_t t0 = now_ms();
    int killed = -1;
    duet_procs_stop(ps, &idx, 1, 10000, &killed);
    uint64_t took = now_ms() - t0;
    cr_assert_not(duet_procs_running(ps, idx));
    cr_expect_eq(killed, 0);
    int ws = duet_procs_wait_status(ps, idx);
    char how[128];
    cr_expect(WIFEXITED(ws) && WEXITSTATUS(ws) == 0, "mpirun %s",
              duet_procs_describe_exit(ps, idx, how, sizeof(how)));
    cr_expect_lt(took, 1900, "the group stopped within %llu ms", (unsigned long long)took);
    cr_expect_eq(count_lines_with(log, " bye"), 4, "every rank shut down cleanly (log %s)", log);
    cr_assert_eq(wait_none_with(rank_cmd, 2000), 0, "no rank left running after the stop");
    duet_procs_destroy(ps);
    remove_tmp();
}

/* Ignores SIGTERM: the grace period ends in SIGKILL, which must reach every rank. */
static const char stubborn_rank[] = "#!/bin/sh\n"
                                    "trap '' TERM\n"
                                    "echo \"rank $OMPI_COMM_WORLD_RANK up $*\"\n"
                                    "while :; do sleep 0.05; done\n";

Test(launcher_procs, group_sigkill_leaves_no_rank, .timeout = 60)
{
    make_tmp();
    char script[128], log[128];
    snprintf(script, sizeof(script), "%s/stubborn-gen.sh", tmp_dir);
    char rank_cmd[160];
    snprintf(rank_cmd, sizeof(rank_cmd), "/bin/sh %s", script);
    write_file(script, stubborn_rank, 0755);
    duet_procs_t *ps = NULL;
    int idx = -1;
    start_group(script, 3, 1, &ps, &idx, log, sizeof(log));
    cr_assert_eq(count_procs_with(rank_cmd), 3);
    int killed = -1;
    duet_procs_stop(ps, &idx, 1, 300, &killed);
    cr_assert_not(duet_procs_running(ps, idx));
    cr_expect_eq(killed, 1, "the group needed SIGKILL");
    cr_assert_eq(wait_none_with(rank_cmd, 2000), 0, "no rank left running after SIGKILL");

    /* and duet_procs_destroy's SIGKILL of a running group */
    duet_procs_destroy(ps);
    start_group(script, 2, 1, &ps, &idx, log, sizeof(log));
    cr_assert_eq(count_procs_with(rank_cmd), 2);
    duet_procs_destroy(ps);
    cr_assert_eq(wait_none_with(rank_cmd, 2000), 0, "no rank left running after destroy");
    remove_tmp();
}
