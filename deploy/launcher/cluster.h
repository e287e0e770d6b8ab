/*
 * The cluster file of `duet up` (docs/architecture.md, "Processes"): one YAML that names the model,
 * the binaries, the router's settings and how many context and generation workers to start with
 * which flags.
 *
 *   model: models/duet-demo            # required; relative paths resolve against `root`
 *   binaries: build                    # optional; default: the caller's default
 *   router:                            # any duet-router key, nested as in its own YAML
 *     binary: PATH                     #   optional override of the executable
 *     http: {host: 127.0.0.1, port: 8000}
 *     workers: {host: 127.0.0.1, port: 8100}
 *   ctx: {count: 1, args: {threads: 1}, binary: PATH}   # count 0..64
 *   gen: {count: 1, cp: 1, tp: 1, args: {threads: 1}, binary: PATH}   # count 1..64
 *   startup_timeout_s: 120             # 1..3600
 *   stop_timeout_s: 10                 # grace before SIGKILL, 1..600
 *   sample: {prompt: "...", max_tokens: 40}
 *
 * Flattening. The router section (but `binary`) and each role's `args` are nested mappings of
 * scalars; they become flags "--a.b=value" in file order, which every duet binary reads through
 * common/config.h. A plain `true` becomes the bare flag "--a.b" (a bool key reads it as true,
 * and so does a getopt tool). A folder the workers read besides the model (spec.draft_model) is
 * joined to `root` when relative, as `model` is. Lists, null values, empty mappings and keys the
 * launcher sets itself (the router's model.dir; a worker's router, model, name; a gen worker's
 * helix.cp, helix.tp) are refused.
 *
 * Helix groups. gen's `cp` and `tp` (each 1..64, cp * tp <= 64, default 1) make each generation
 * worker a group of cp x tp ranks: context parallelism over the KV cache times tensor
 * parallelism over the heads. A group is one worker to the router (its rank 0 registers); the
 * launcher starts it under mpirun with --helix.cp/--helix.tp (deploy/launcher/procs.h), which is
 * why those two are refused inside `args`. 1 x 1 is a plain single-process worker.
 *
 * Why the parser knows so little about the keys: duet-router, duet-ctx and duet-gen validate
 * their own flags, so a misspelt router or worker key is reported by that binary, at start-up,
 * with a suggestion. What this file checks is the launcher's own structure, strictly, with
 * file:line in every message: unknown keys, wrong types, counts and ports out of range, and the
 * router's http/workers addresses (the launcher must know them to connect, so port 0 is refused).
 */
#ifndef DUET_DEPLOY_LAUNCHER_CLUSTER_H
#define DUET_DEPLOY_LAUNCHER_CLUSTER_H

#include <stdbool.h>
#include <stddef.h>

#include "common/status.h"

#define DUET_CLUSTER_MAX_WORKERS 64 /* per role */
#define DUET_CLUSTER_MAX_RANKS   64 /* cp * tp of one Helix group */

/* One kind of process: the router, the context workers or the generation workers. */
typedef struct {
    char *binary; /* executable path (root-relative paths resolved), owned */
    char **args;  /* (n_args) flattened "--key=value" flags, owned, in file order */
    size_t n_args;
    int count;  /* processes to start: 1 for the router; gen: groups */
    int cp, tp; /* gen: each worker is a Helix group of cp * tp ranks; 1 x 1 for the others */
} duet_cluster_role_t;

/* A validated cluster file. Read-only for callers; free with duet_cluster_destroy. */
typedef struct {
    char *file;     /* the name given to the loader, owned */
    char *model;    /* model folder, root-relative resolved, owned */
    char *binaries; /* folder holding router/, ctx_worker/, gen_worker/, owned */
    duet_cluster_role_t router, ctx, gen;
    char *http_host; /* router.http.host (default 127.0.0.1), owned */
    int http_port;   /* router.http.port (default 8000) */
    char *workers_host;
    int workers_port;      /* router.workers.port (default 8100) */
    int startup_timeout_s; /* default 120 */
    int stop_timeout_s;    /* default 10 */
    char *sample_prompt;   /* default "The LORD said unto Moses,", owned */
    int sample_max_tokens; /* default 40 */
} duet_cluster_t;

/* Where relative paths point and what fills in an absent `binaries:`. */
typedef struct {
    const char *root;     /* relative paths resolve against this folder; NULL = as written */
    const char *binaries; /* default build folder; NULL = "<root>/build" */
} duet_cluster_paths_t;

/*
 * Parse and validate the YAML text[0..len); `name` stands in for the file name in messages.
 * On success *spec_p receives a new cluster (destroy it). Errors, with a detail naming
 * name:line: DUET_ERR_FORMAT (syntax, structure, types, lists), DUET_ERR_NOT_FOUND (unknown
 * key), DUET_ERR_RANGE (counts, cp, tp, ports, timeouts), DUET_ERR_INVALID (missing model, keys the
 * launcher sets itself, empty values). Never touches the file system.
 */
duet_status_t duet_cluster_load_string(const char *text, size_t len, const char *name,
                                       const duet_cluster_paths_t *paths, duet_cluster_t **spec_p);

/* Same for the file at `path` (at most 1 MiB); DUET_ERR_IO when it cannot be read. */
duet_status_t duet_cluster_load_file(const char *path, const duet_cluster_paths_t *paths,
                                     duet_cluster_t **spec_p);

/* Free a cluster. Accepts NULL. */
void duet_cluster_destroy(duet_cluster_t *spec);

/* The value of flag "--key=value" among a role's flags (its `args:` / the router's keys), or
 * NULL when the file does not set it. */
const char *duet_cluster_arg(const duet_cluster_role_t *r, const char *key);

#endif
