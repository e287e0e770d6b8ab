/*
 * The child processes of `duet up`: start them, forward their output, notice when they exit,
 * stop them in order, and never leave one behind.
 *
 * Output. Each child's stdout and stderr share one pipe; the launcher reads it and writes every
 * line to its own stderr as "[name] line". With a log folder each child writes straight to
 * DIR/NAME.log instead (no pipe, so a launcher that stops reading cannot stall a child).
 *
 * Orphans. Each child runs in its own process group, so a Ctrl-C in the terminal reaches only
 * the launcher, which then stops workers before the router; and it asks the kernel for SIGTERM
 * when the launcher dies (prctl PR_SET_PDEATHSIG), so even a SIGKILLed launcher leaves nothing
 * running. duet_procs_destroy SIGKILLs and reaps whatever is still alive.
 *
 * Groups. A Helix generation worker is N ranks started by mpirun (duet_procs_worker_argv builds
 * that command line; duet_procs_spawn_group starts it). Open MPI puts each rank in a process
 * group of its own, and mpirun answers SIGTERM by stopping its ranks one at a time with only
 * one second each before SIGKILL, exiting 1 whatever they did. So a group's stop skips mpirun:
 * SIGTERM goes to rank 0 (the child of mpirun whose environment says OMPI_COMM_WORLD_RANK=0),
 * which drains and deregisters like any worker and then tells its followers to stop (duet-gen's
 * group protocol: a follower waits on rank 0 and has no SIGTERM handling of its own); every
 * rank exits 0 within the full grace period and mpirun with them. Should no rank 0 be found,
 * every rank gets the SIGTERM; while no rank exists yet, mpirun does. SIGKILL goes to every
 * rank's process group and to mpirun's, so a killed group leaves no rank behind.
 *
 * Signals. duet_procs_create installs handlers for SIGCHLD, SIGINT and SIGTERM that only write
 * to a self-pipe, so duet_procs_poll wakes at once; SIGPIPE is ignored in the launcher (and
 * restored in the children). One duet_procs_t per process.
 *
 * Single-threaded: call everything from one thread.
 */
#ifndef DUET_DEPLOY_LAUNCHER_PROCS_H
#define DUET_DEPLOY_LAUNCHER_PROCS_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#include "common/status.h"

#define DUET_PROCS_MAX 160 /* router + 2 * DUET_CLUSTER_MAX_WORKERS, with room to spare */

typedef struct duet_procs duet_procs_t;

/*
 * Create the process table and install the signal handlers. log_dir NULL forwards output to
 * stderr with name prefixes; otherwise each child writes DIR/NAME.log (the folder must exist).
 */
duet_status_t duet_procs_create(const char *log_dir, duet_procs_t **ps_p);

/* SIGKILL and reap every child still running, restore the signal handlers, free. NULL is fine. */
void duet_procs_destroy(duet_procs_t *ps);

/*
 * Start argv[0] (a path; argv NULL-terminated) as child `name` (printable, no '/'). Its index
 * goes to *idx_p. DUET_ERR_NOT_FOUND when argv[0] is not an executable file, DUET_ERR_IO when
 * fork/pipe/open fails; the detail names the child.
 */
duet_status_t duet_procs_spawn(duet_procs_t *ps, const char *name, char *const argv[], int *idx_p);

/*
 * duet_procs_spawn for an mpirun command line (a Helix group, see "Groups" above): the same
 * contract; only the stop and kill paths differ.
 */
duet_status_t duet_procs_spawn_group(duet_procs_t *ps, const char *name, char *const argv[],
                                     int *idx_p);

/* A worker's command line, for duet_procs_worker_argv. */
typedef struct {
    const char *binary; /* the worker's executable */
    char *const *fixed; /* (n_fixed) flags the launcher sets: --router, --model, --name */
    size_t n_fixed;
    char *const *args; /* (n_args) the cluster file's "--key=value" flags */
    size_t n_args;
    int cp, tp;         /* Helix group shape; cp * tp > 1 runs cp * tp ranks under mpirun */
    const char *mpirun; /* mpirun's path; read only for a group */
    bool as_root;       /* we are root: Open MPI refuses to start then unless told */
} duet_procs_cmd_t;

/*
 * Build a worker's argv (NULL-terminated, every string owned; free with duet_procs_argv_free)
 * into *argv_p. A single process (cp * tp == 1): binary, fixed, args. A group:
 *   mpirun -n N --oversubscribe [--allow-run-as-root] --bind-to none --tag-output
 *          --mca pml ob1 --mca btl self,vader,tcp
 *          binary fixed --helix.cp=C --helix.tp=T [--threads=1] args
 * (ranks may outnumber cores, so none is pinned, and each computes on one thread unless args
 * name `threads`; shared memory and TCP transports only, which work on any machine). Errors:
 * DUET_ERR_INVALID for cp or tp below 1 or a group without mpirun, DUET_ERR_NOMEM.
 */
duet_status_t duet_procs_worker_argv(const duet_procs_cmd_t *cmd, char ***argv_p);

/* Free an argv from duet_procs_worker_argv. NULL is fine. */
void duet_procs_argv_free(char **argv);

/*
 * Find the executable `prog` (no '/') in $PATH, as a shell would; its path goes to out (cap
 * bytes). False when it is not there (or the path does not fit).
 */
bool duet_procs_which(const char *prog, char *out, size_t cap);

/*
 * Wait up to timeout_ms for something to happen (output, a child exiting, a signal, or
 * extra_fd becoming ready for extra_events), forwarding output and reaping children as it
 * goes. extra_fd < 0 means none; *extra_revents_p (may be NULL) receives its revents.
 */
void duet_procs_poll(duet_procs_t *ps, int timeout_ms, int extra_fd, short extra_events,
                     short *extra_revents_p);

/*
 * The index of a child that exited since the last call (each reported once), or -1. Its wait
 * status is duet_procs_wait_status.
 */
int duet_procs_next_exit(duet_procs_t *ps);

/* SIGINT/SIGTERM received so far (a count; the caller compares with what it has handled). */
int duet_procs_stop_requests(const duet_procs_t *ps);

/* The last stop signal received (SIGINT or SIGTERM), 0 when none. */
int duet_procs_stop_signal(const duet_procs_t *ps);

bool duet_procs_running(const duet_procs_t *ps, int idx);
const char *duet_procs_name(const duet_procs_t *ps, int idx);
pid_t duet_procs_pid(const duet_procs_t *ps, int idx);
int duet_procs_wait_status(const duet_procs_t *ps, int idx); /* valid once not running */

/*
 * "exited with status 3", "was killed by signal 9 (Killed)" for a child that is not running.
 * Writes into buf (cap bytes) and returns it.
 */
const char *duet_procs_describe_exit(const duet_procs_t *ps, int idx, char *buf, size_t cap);

/*
 * Stop the children idx[0..n): SIGTERM to each running one, then wait (forwarding output) until
 * they exited or grace_ms passed, and SIGKILL the rest; a further SIGINT/SIGTERM during the wait
 * kills at once. Every child in the list is reaped on return. *n_killed_p (may be NULL) counts
 * the SIGKILLs.
 */
void duet_procs_stop(duet_procs_t *ps, const int *idx, size_t n, int grace_ms, int *n_killed_p);

#endif
