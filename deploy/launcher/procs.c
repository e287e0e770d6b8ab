/*
 * Child processes of `duet up`; see procs.h for the contract.
 *
 * fork + exec rather than libuv's uv_spawn, because the child must run two calls between the
 * two (setpgid and prctl(PR_SET_PDEATHSIG)), which uv_spawn has no hook for. Signals are
 * blocked around fork so that the launcher's handlers never run in a child before it resets
 * them. Everything else is one poll() over the self-pipe and the children's output pipes.
 */
#define _GNU_SOURCE
#include "deploy/launcher/procs.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"

#define PROCS_NAME_MAX  64
#define PROCS_LINE_MAX  4096 /* a longer line is forwarded in pieces */
#define PROCS_MAX_RANKS 256  /* children of one mpirun looked at (a group has at most 64) */

typedef struct {
    char name[PROCS_NAME_MAX];
    pid_t pid;
    bool group; /* mpirun: its children are ranks, each leading its own process group */
    int fd;     /* read end of the output pipe; -1 with a log folder or once closed */
    bool running;
    bool reported; /* duet_procs_next_exit returned it */
    int wstatus;
    char line[PROCS_LINE_MAX]; /* the unfinished last line */
    size_t line_len;
} proc_t;

struct duet_procs {
    proc_t procs[DUET_PROCS_MAX];
    int n;
    char *log_dir; /* owned, NULL = forward to stderr */
    struct sigaction old_int, old_term, old_chld, old_pipe;
};

/* Process-wide: a signal handler can reach only these. */
static int procs_sigpipe[2] = {-1, -1};
static volatile sig_atomic_t procs_stop_count;
static volatile sig_atomic_t procs_stop_sig;

static void procs_on_signal(int sig)
{
    int saved = errno;
    if (sig == SIGINT || sig == SIGTERM) {
        procs_stop_count++;
        procs_stop_sig = sig;
    }
    char c = (char)sig;
    ssize_t w = write(procs_sigpipe[1], &c, 1); /* full pipe: a wake-up is already pending */
    (void)w;
    errno = saved;
}

static uint64_t procs_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* ---------------------------------------------------------------- output */

static void procs_write_all(int fd, const char *s, size_t n)
{
    while (n > 0) {
        ssize_t w = write(fd, s, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return; /* our stderr is gone; nothing better to do with the line */
        s += w;
        n -= (size_t)w;
    }
}

static void procs_emit_line(const proc_t *p, const char *s, size_t n)
{
    char buf[PROCS_NAME_MAX + PROCS_LINE_MAX + 8];
    size_t at = (size_t)snprintf(buf, sizeof(buf), "[%s] ", p->name);
    memcpy(buf + at, s, n);
    at += n;
    buf[at++] = '\n';
    procs_write_all(2, buf, at);
}

/* Split `n` bytes of output into lines; a line that outgrows the buffer goes out in pieces. */
static void procs_feed(proc_t *p, const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (s[i] == '\n') {
            procs_emit_line(p, p->line, p->line_len);
            p->line_len = 0;
            continue;
        }
        if (p->line_len == sizeof(p->line)) {
            procs_emit_line(p, p->line, p->line_len);
            p->line_len = 0;
        }
        p->line[p->line_len++] = s[i];
    }
}

/* Read what the pipe holds now; on end of file flush the last line and close it. */
static void procs_drain(proc_t *p)
{
    char buf[16384];
    while (p->fd >= 0) {
        ssize_t r = read(p->fd, buf, sizeof(buf));
        if (r > 0) {
            procs_feed(p, buf, (size_t)r);
            continue;
        }
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && p->running)
            return;
        /* end of file, an error, or a dead child whose pipe a grandchild still holds */
        if (p->line_len > 0)
            procs_emit_line(p, p->line, p->line_len);
        p->line_len = 0;
        close(p->fd);
        p->fd = -1;
    }
}

/* ---------------------------------------------------------------- life cycle */

duet_status_t duet_procs_create(const char *log_dir, duet_procs_t **ps_p)
{
    if (procs_sigpipe[0] >= 0)
        return duet_error_set(DUET_ERR_BUSY, "duet_procs_create: one process table per process");
    duet_procs_t *ps = calloc(1, sizeof(*ps));
    if (ps == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "out of memory");
    if (log_dir != NULL && (ps->log_dir = strdup(log_dir)) == NULL) {
        free(ps);
        return duet_error_set(DUET_ERR_NOMEM, "out of memory");
    }
    if (pipe2(procs_sigpipe, O_CLOEXEC | O_NONBLOCK) != 0) {
        duet_status_t st = duet_error_set(DUET_ERR_IO, "pipe: %s", strerror(errno));
        free(ps->log_dir);
        free(ps);
        return st;
    }
    procs_stop_count = 0;
    procs_stop_sig = 0;
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = procs_on_signal;
    sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &ps->old_int);
    sigaction(SIGTERM, &sa, &ps->old_term);
    sigaction(SIGCHLD, &sa, &ps->old_chld);
    struct sigaction ign;
    memset(&ign, 0, sizeof(ign));
    ign.sa_handler = SIG_IGN;
    sigaction(SIGPIPE, &ign, &ps->old_pipe);
    *ps_p = ps;
    return DUET_OK;
}

/* Signal the process group `pid` leads, or the process alone when it leads none. */
static void procs_kill_group(pid_t pid, int sig)
{
    if (kill(-pid, sig) != 0)
        kill(pid, sig);
}

/* The children of `parent` (found in /proc, since the launcher is not their parent), at most
 * cap of them; the number found. */
static int procs_children(pid_t parent, pid_t *out, int cap)
{
    DIR *d = opendir("/proc");
    if (d == NULL)
        return 0;
    int n = 0;
    struct dirent *e;
    while (n < cap && (e = readdir(d)) != NULL) {
        char *end;
        long pid = strtol(e->d_name, &end, 10);
        if (end == e->d_name || *end != '\0' || pid <= 0)
            continue;
        char path[64], buf[512];
        snprintf(path, sizeof(path), "/proc/%ld/stat", pid);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            continue; /* gone meanwhile */
        ssize_t r = read(fd, buf, sizeof(buf) - 1);
        close(fd);
        if (r <= 0)
            continue;
        buf[r] = '\0';
        /* "pid (comm) state ppid ...": comm may hold anything, so parse after its last ')' */
        const char *rp = strrchr(buf, ')');
        int ppid = 0;
        if (rp != NULL && sscanf(rp + 1, " %*c %d", &ppid) == 1 && ppid == (int)parent)
            out[n++] = (pid_t)pid;
    }
    closedir(d);
    return n;
}

/* Whether process `pid` is rank 0 of its Open MPI job (mpirun sets OMPI_COMM_WORLD_RANK in
 * every rank's environment). */
static bool procs_is_rank0(pid_t pid)
{
    static const char key[] = "OMPI_COMM_WORLD_RANK=0";
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/environ", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return false;
    /* entries are NUL-terminated; keep the unfinished one across reads */
    char buf[8192];
    size_t have = 0;
    bool found = false, skipping = false;
    for (;;) {
        ssize_t r = read(fd, buf + have, sizeof(buf) - have);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        have += (size_t)r;
        size_t start = 0;
        for (size_t i = 0; i < have; i++) {
            if (buf[i] != '\0')
                continue;
            if (!skipping && i - start == sizeof(key) - 1 &&
                memcmp(buf + start, key, i - start) == 0)
                found = true;
            skipping = false;
            start = i + 1;
        }
        if (found)
            break;
        memmove(buf, buf + start, have - start);
        have -= start;
        if (have == sizeof(buf)) { /* an entry longer than the buffer: not ours */
            have = 0;
            skipping = true;
        }
    }
    close(fd);
    return found;
}

static void procs_kill(const proc_t *p, int sig)
{
    if (!p->group) {
        /* the child leads its own group: reach whatever it started too */
        procs_kill_group(p->pid, sig);
        return;
    }
    pid_t ranks[PROCS_MAX_RANKS];
    if (sig == SIGKILL) {
        /* freeze mpirun so it starts no rank between the scan and its own end */
        procs_kill_group(p->pid, SIGSTOP);
        int n = procs_children(p->pid, ranks, PROCS_MAX_RANKS);
        for (int i = 0; i < n; i++)
            procs_kill_group(ranks[i], SIGKILL);
        procs_kill_group(p->pid, SIGKILL);
        return;
    }
    /* rank 0, which stops its followers (see procs.h, "Groups"); every rank when none is known
     * to be rank 0; mpirun only while it has no rank yet */
    int n = procs_children(p->pid, ranks, PROCS_MAX_RANKS);
    for (int i = 0; i < n; i++)
        if (procs_is_rank0(ranks[i])) {
            procs_kill_group(ranks[i], sig);
            return;
        }
    for (int i = 0; i < n; i++)
        procs_kill_group(ranks[i], sig);
    if (n == 0)
        procs_kill_group(p->pid, sig);
}

static void procs_reap_blocking(proc_t *p)
{
    int st = 0;
    while (waitpid(p->pid, &st, 0) < 0 && errno == EINTR)
        ;
    p->running = false;
    p->wstatus = st;
    procs_drain(p);
}

void duet_procs_destroy(duet_procs_t *ps)
{
    if (ps == NULL)
        return;
    for (int i = 0; i < ps->n; i++) {
        proc_t *p = &ps->procs[i];
        if (p->running) {
            procs_kill(p, SIGKILL);
            procs_reap_blocking(p);
        }
        if (p->fd >= 0)
            close(p->fd);
    }
    sigaction(SIGINT, &ps->old_int, NULL);
    sigaction(SIGTERM, &ps->old_term, NULL);
    sigaction(SIGCHLD, &ps->old_chld, NULL);
    sigaction(SIGPIPE, &ps->old_pipe, NULL);
    close(procs_sigpipe[0]);
    close(procs_sigpipe[1]);
    procs_sigpipe[0] = procs_sigpipe[1] = -1;
    free(ps->log_dir);
    free(ps);
}

static duet_status_t procs_spawn(duet_procs_t *ps, const char *name, char *const argv[], bool group,
                                 int *idx_p)
{
    struct stat sb;
    if (ps->n == DUET_PROCS_MAX)
        return duet_error_set(DUET_ERR_NO_SPACE, "%s: more than %d processes", name,
                              DUET_PROCS_MAX);
    if (stat(argv[0], &sb) != 0)
        return duet_error_set(DUET_ERR_NOT_FOUND, "%s: %s: %s", name, argv[0], strerror(errno));
    if (!S_ISREG(sb.st_mode) || access(argv[0], X_OK) != 0)
        return duet_error_set(DUET_ERR_NOT_FOUND, "%s: %s is not an executable file", name,
                              argv[0]);

    proc_t *p = &ps->procs[ps->n];
    memset(p, 0, sizeof(*p));
    snprintf(p->name, sizeof(p->name), "%s", name);
    p->fd = -1;

    /* where the child's stdout and stderr go */
    int out_fd = -1;
    if (ps->log_dir != NULL) {
        char path[4096];
        snprintf(path, sizeof(path), "%s/%s.log", ps->log_dir, name);
        out_fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (out_fd < 0)
            return duet_error_set(DUET_ERR_IO, "%s: cannot open %s: %s", name, path,
                                  strerror(errno));
    } else {
        int fds[2];
        if (pipe2(fds, O_CLOEXEC) != 0)
            return duet_error_set(DUET_ERR_IO, "%s: pipe: %s", name, strerror(errno));
        fcntl(fds[0], F_SETFL, fcntl(fds[0], F_GETFL) | O_NONBLOCK);
        p->fd = fds[0];
        out_fd = fds[1];
    }
    int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (null_fd < 0) {
        duet_status_t st = duet_error_set(DUET_ERR_IO, "/dev/null: %s", strerror(errno));
        close(out_fd);
        if (p->fd >= 0)
            close(p->fd);
        return st;
    }
    /* prepared here: after fork the child may only make async-signal-safe calls */
    char exec_fail[512];
    int exec_fail_len =
        snprintf(exec_fail, sizeof(exec_fail), "duet: cannot execute %s\n", argv[0]);
    if (exec_fail_len < 0 || (size_t)exec_fail_len >= sizeof(exec_fail))
        exec_fail_len = (int)sizeof(exec_fail) - 1;
    pid_t parent = getpid();
    sigset_t all, old;
    sigfillset(&all);
    sigprocmask(SIG_SETMASK, &all, &old);
    pid_t pid = fork();
    if (pid == 0) {
        setpgid(0, 0);
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (getppid() != parent) /* the launcher died before prctl took effect */
            _exit(1);
        signal(SIGPIPE, SIG_DFL);
        signal(SIGINT, SIG_DFL);
        signal(SIGTERM, SIG_DFL);
        signal(SIGCHLD, SIG_DFL);
        dup2(null_fd, 0);
        dup2(out_fd, 1);
        dup2(out_fd, 2);
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        execv(argv[0], argv);
        ssize_t w = write(2, exec_fail, (size_t)exec_fail_len);
        (void)w;
        _exit(127);
    }
    int fork_errno = errno;
    if (pid > 0)
        setpgid(pid, pid); /* also from here, so a signal to the group cannot race the child */
    sigprocmask(SIG_SETMASK, &old, NULL);
    close(out_fd);
    close(null_fd);
    if (pid < 0) {
        if (p->fd >= 0)
            close(p->fd);
        p->fd = -1;
        return duet_error_set(DUET_ERR_IO, "%s: fork: %s", name, strerror(fork_errno));
    }
    p->pid = pid;
    p->group = group;
    p->running = true;
    *idx_p = ps->n++;
    return DUET_OK;
}

duet_status_t duet_procs_spawn(duet_procs_t *ps, const char *name, char *const argv[], int *idx_p)
{
    return procs_spawn(ps, name, argv, false, idx_p);
}

duet_status_t duet_procs_spawn_group(duet_procs_t *ps, const char *name, char *const argv[],
                                     int *idx_p)
{
    return procs_spawn(ps, name, argv, true, idx_p);
}

/* ---------------------------------------------------------------- command lines */

void duet_procs_argv_free(char **argv)
{
    if (argv == NULL)
        return;
    for (char **a = argv; *a != NULL; a++)
        free(*a);
    free(argv);
}

/* Append a copy of s (printf format) to argv[*n]; false when out of memory. */
static bool procs_argv_add(char **argv, size_t *n, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static bool procs_argv_add(char **argv, size_t *n, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int rc = vasprintf(&argv[*n], fmt, ap);
    va_end(ap);
    if (rc < 0) {
        argv[*n] = NULL;
        return false;
    }
    (*n)++;
    return true;
}

duet_status_t duet_procs_worker_argv(const duet_procs_cmd_t *cmd, char ***argv_p)
{
    static const char *const mpi_opts[] = {
        "--oversubscribe", "--bind-to", "none",          "--tag-output", "--mca", "pml", "ob1",
        "--mca",           "btl",       "self,vader,tcp"};
    const size_t n_mpi = sizeof(mpi_opts) / sizeof(mpi_opts[0]);
    if (cmd->cp < 1 || cmd->tp < 1)
        return duet_error_set(DUET_ERR_INVALID, "%s: helix cp %d x tp %d: each must be at least 1",
                              cmd->binary, cmd->cp, cmd->tp);
    const bool group = cmd->cp * cmd->tp > 1;
    if (group && (cmd->mpirun == NULL || cmd->mpirun[0] == '\0'))
        return duet_error_set(DUET_ERR_INVALID, "%s: a group of cp %d x tp %d needs mpirun",
                              cmd->binary, cmd->cp, cmd->tp);
    bool has_threads = false;
    for (size_t i = 0; i < cmd->n_args; i++)
        has_threads = has_threads || strcmp(cmd->args[i], "--threads") == 0 ||
                      strncmp(cmd->args[i], "--threads=", 10) == 0;
    /* mpirun -n N, its options, --allow-run-as-root; the helix pair and --threads=1 */
    size_t cap = 1 + cmd->n_fixed + cmd->n_args + 1 + (group ? 3 + n_mpi + 1 + 3 : 0);
    char **argv = calloc(cap, sizeof(*argv));
    if (argv == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "out of memory");
    size_t n = 0;
    bool ok = true;
    if (group) {
        ok = procs_argv_add(argv, &n, "%s", cmd->mpirun) && procs_argv_add(argv, &n, "-n") &&
             procs_argv_add(argv, &n, "%d", cmd->cp * cmd->tp);
        for (size_t i = 0; ok && i < n_mpi; i++)
            ok = procs_argv_add(argv, &n, "%s", mpi_opts[i]);
        if (ok && cmd->as_root)
            ok = procs_argv_add(argv, &n, "--allow-run-as-root");
    }
    ok = ok && procs_argv_add(argv, &n, "%s", cmd->binary);
    for (size_t i = 0; ok && i < cmd->n_fixed; i++)
        ok = procs_argv_add(argv, &n, "%s", cmd->fixed[i]);
    if (ok && group) {
        ok = procs_argv_add(argv, &n, "--helix.cp=%d", cmd->cp) &&
             procs_argv_add(argv, &n, "--helix.tp=%d", cmd->tp);
        if (ok && !has_threads)
            ok = procs_argv_add(argv, &n, "--threads=1");
    }
    for (size_t i = 0; ok && i < cmd->n_args; i++)
        ok = procs_argv_add(argv, &n, "%s", cmd->args[i]);
    if (!ok) {
        duet_procs_argv_free(argv);
        return duet_error_set(DUET_ERR_NOMEM, "out of memory");
    }
    *argv_p = argv;
    return DUET_OK;
}

bool duet_procs_which(const char *prog, char *out, size_t cap)
{
    const char *path = getenv("PATH");
    if (path == NULL || strchr(prog, '/') != NULL)
        return false;
    for (const char *at = path;;) {
        const char *colon = strchr(at, ':');
        size_t len = colon != NULL ? (size_t)(colon - at) : strlen(at);
        struct stat sb;
        /* an empty entry is the working directory, as in a shell */
        int w = len > 0 ? snprintf(out, cap, "%.*s/%s", (int)len, at, prog)
                        : snprintf(out, cap, "./%s", prog);
        if (w > 0 && (size_t)w < cap && stat(out, &sb) == 0 && S_ISREG(sb.st_mode) &&
            access(out, X_OK) == 0)
            return true;
        if (colon == NULL)
            break;
        at = colon + 1;
    }
    if (cap > 0)
        out[0] = '\0';
    return false;
}

/* ---------------------------------------------------------------- waiting */

static void procs_reap(duet_procs_t *ps)
{
    for (int i = 0; i < ps->n; i++) {
        proc_t *p = &ps->procs[i];
        int st;
        if (p->running && waitpid(p->pid, &st, WNOHANG) == p->pid) {
            p->running = false;
            p->wstatus = st;
            procs_drain(p); /* its last words come before anyone reports the exit */
        }
    }
}

void duet_procs_poll(duet_procs_t *ps, int timeout_ms, int extra_fd, short extra_events,
                     short *extra_revents_p)
{
    struct pollfd pfd[DUET_PROCS_MAX + 2];
    int who[DUET_PROCS_MAX + 2]; /* child index per pollfd, -1 / -2 for the others */
    nfds_t n = 0;
    pfd[n] = (struct pollfd){.fd = procs_sigpipe[0], .events = POLLIN};
    who[n++] = -1;
    for (int i = 0; i < ps->n; i++)
        if (ps->procs[i].fd >= 0) {
            pfd[n] = (struct pollfd){.fd = ps->procs[i].fd, .events = POLLIN};
            who[n++] = i;
        }
    if (extra_fd >= 0) {
        pfd[n] = (struct pollfd){.fd = extra_fd, .events = extra_events};
        who[n++] = -2;
    }
    if (extra_revents_p != NULL)
        *extra_revents_p = 0;
    int r = poll(pfd, n, timeout_ms);
    if (r < 0 && errno != EINTR)
        DUET_LOG_WARN("launcher: poll: %s", strerror(errno));
    for (nfds_t k = 0; r > 0 && k < n; k++) {
        if (pfd[k].revents == 0)
            continue;
        if (who[k] == -1) {
            char buf[64];
            while (read(procs_sigpipe[0], buf, sizeof(buf)) > 0)
                ;
        } else if (who[k] == -2) {
            if (extra_revents_p != NULL)
                *extra_revents_p = pfd[k].revents;
        } else {
            procs_drain(&ps->procs[who[k]]);
        }
    }
    procs_reap(ps);
}

int duet_procs_next_exit(duet_procs_t *ps)
{
    for (int i = 0; i < ps->n; i++)
        if (!ps->procs[i].running && !ps->procs[i].reported) {
            ps->procs[i].reported = true;
            return i;
        }
    return -1;
}

int duet_procs_stop_requests(const duet_procs_t *ps)
{
    return (int)procs_stop_count;
}

int duet_procs_stop_signal(const duet_procs_t *ps)
{
    return (int)procs_stop_sig;
}

bool duet_procs_running(const duet_procs_t *ps, int idx)
{
    return ps->procs[idx].running;
}

const char *duet_procs_name(const duet_procs_t *ps, int idx)
{
    return ps->procs[idx].name;
}

pid_t duet_procs_pid(const duet_procs_t *ps, int idx)
{
    return ps->procs[idx].pid;
}

int duet_procs_wait_status(const duet_procs_t *ps, int idx)
{
    return ps->procs[idx].wstatus;
}

const char *duet_procs_describe_exit(const duet_procs_t *ps, int idx, char *buf, size_t cap)
{
    int st = ps->procs[idx].wstatus;
    if (ps->procs[idx].running)
        snprintf(buf, cap, "is running");
    else if (WIFEXITED(st))
        snprintf(buf, cap, "exited with status %d", WEXITSTATUS(st));
    else if (WIFSIGNALED(st))
        snprintf(buf, cap, "was killed by signal %d (%s)", WTERMSIG(st), strsignal(WTERMSIG(st)));
    else
        snprintf(buf, cap, "ended (wait status %#x)", (unsigned)st);
    return buf;
}

void duet_procs_stop(duet_procs_t *ps, const int *idx, size_t n, int grace_ms, int *n_killed_p)
{
    int killed = 0;
    for (size_t i = 0; i < n; i++)
        if (ps->procs[idx[i]].running)
            procs_kill(&ps->procs[idx[i]], SIGTERM);
    int base = (int)procs_stop_count;
    uint64_t deadline = procs_now_ms() + (uint64_t)(grace_ms > 0 ? grace_ms : 0);
    for (;;) {
        bool any = false;
        for (size_t i = 0; i < n; i++)
            any = any || ps->procs[idx[i]].running;
        uint64_t now = procs_now_ms();
        if (!any || now >= deadline || (int)procs_stop_count != base)
            break;
        uint64_t left = deadline - now;
        duet_procs_poll(ps, left < 100 ? (int)left : 100, -1, 0, NULL);
    }
    for (size_t i = 0; i < n; i++) {
        proc_t *p = &ps->procs[idx[i]];
        if (!p->running)
            continue;
        DUET_LOG_WARN("launcher: %s (pid %d) still running; sending SIGKILL", p->name, (int)p->pid);
        procs_kill(p, SIGKILL);
        procs_reap_blocking(p);
        killed++;
    }
    if (n_killed_p != NULL)
        *n_killed_p = killed;
}
