/*
 * `duet sbatch CLUSTER.yaml`: the cluster file of `duet up` (deploy/launcher/cluster.h) turned
 * into a Slurm batch script (docs/deploy-slurm.md). The script runs the router as a job step on
 * the allocation's first node, each context worker and each generation worker (a Helix group of
 * cp x tp ranks under `srun --mpi=pmix`) as a step of its own, waits until the router reports
 * every worker up, prints the endpoint, and on SIGTERM (`scancel --batch --signal=TERM`, or the
 * time limit through `--signal=B:TERM@N`) drains the generation workers, then stops them, the
 * context workers and the router, in that order.
 *
 * Why a generator rather than one fixed script reading the YAML at run time: the compute nodes
 * need nothing but bash, srun and curl, and the operator can read exactly what will run before
 * submitting it. The cluster file is validated by the same parser as `duet up`.
 */
#ifndef DUET_DEPLOY_LAUNCHER_SBATCH_H
#define DUET_DEPLOY_LAUNCHER_SBATCH_H

#include "common/status.h"
#include "common/strbuf.h"
#include "deploy/launcher/cluster.h"

/* What the cluster file does not say about the allocation. */
typedef struct {
    int nodes;           /* #SBATCH --nodes (1..4096) */
    int gpus_per_node;   /* #SBATCH --gpus-per-node and one GPU per worker rank; 0: none (0..64) */
    const char *time;    /* #SBATCH --time (Slurm's syntax, [A-Za-z0-9:-] only); NULL: default */
    const char *duetctl; /* duetctl's path, for the drain on stop when the router has an admin
                            token; NULL: "<binaries>/router/duetctl" */
} duet_sbatch_opts_t;

/*
 * Append the batch script for `spec` to out. DUET_ERR_RANGE for nodes / gpus_per_node out of
 * range, DUET_ERR_INVALID for a time with other characters, DUET_ERR_NOMEM; the detail says which.
 * Pure: reads no file and starts nothing.
 */
duet_status_t duet_sbatch_write(const duet_cluster_t *spec, const duet_sbatch_opts_t *opts,
                                duet_strbuf_t *out);

/* Append s to sb quoted for a POSIX shell ('...' with ' written as '\''). */
void duet_sbatch_shell_quote(duet_strbuf_t *sb, const char *s);

#endif
