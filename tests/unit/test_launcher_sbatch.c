/*
 * `duet sbatch` (deploy/launcher/sbatch.h): the batch script of a cluster file with one ctx worker
 * and one gen worker that is a Helix group of cp 2 has the allocation, the router's step on the
 * head node, one srun step per worker (the group as one `--mpi=pmix` step of 2 tasks with the
 * helix flags), per-process logs, the drain on stop when the router has an admin token, GPUs per
 * task when asked, shutdown.drain_s for every process (a plain scancel: workers finish what they
 * hold, the router goes last) unless the file sets its own; bash accepts its syntax; its task
 * wrapper picks each rank's device and lets only rank 0 of a group take SIGTERM; values reach the
 * shell quoted; bad options are refused. The job itself runs on a real Slurm in
 * tests/integration/test_slurm.sh.
 */
#define _GNU_SOURCE
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "deploy/launcher/sbatch.h"

static const duet_cluster_paths_t paths = {.root = "/repo", .binaries = "/repo/build"};

static const char cp2_yaml[] = "model: models/duet-demo\n"
                               "router:\n"
                               "  http: {host: 0.0.0.0, port: 8000}\n"
                               "  workers: {host: 0.0.0.0, port: 8100}\n"
                               "ctx: {count: 1, args: {threads: 2}}\n"
                               "gen: {count: 1, cp: 2, args: {dtype: f32}}\n";

/* The script for yaml with opts; a malloc'd string. */
static char *script(const char *yaml, const duet_sbatch_opts_t *o)
{
    duet_cluster_t *spec = NULL;
    cr_assert_eq(duet_cluster_load_string(yaml, strlen(yaml), "t.yaml", &paths, &spec), DUET_OK,
                 "%s", duet_error_last());
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    cr_assert_eq(duet_sbatch_write(spec, o, &sb), DUET_OK, "%s", duet_error_last());
    duet_cluster_destroy(spec);
    return duet_strbuf_detach(&sb);
}

/* An srun step spans the line with `--job-name=NAME` and the two continuation lines after it. */
static char *step_of(const char *text, const char *name)
{
    char needle[64];
    snprintf(needle, sizeof(needle), "--job-name=%s ", name);
    const char *hit = strstr(text, needle);
    cr_assert_not_null(hit, "no step %s", name);
    while (hit > text && hit[-1] != '\n')
        hit--;
    const char *end = strstr(hit, " &\n");
    cr_assert_not_null(end);
    return strndup(hit, (size_t)(end - hit));
}

static void has(const char *text, const char *needle)
{
    cr_assert_not_null(strstr(text, needle), "\"%s\" missing from:\n%s", needle, text);
}

static void lacks(const char *text, const char *needle)
{
    cr_assert_null(strstr(text, needle), "\"%s\" unexpected in:\n%s", needle, text);
}

Test(launcher_sbatch, ctx1_gen_cp2_steps)
{
    duet_sbatch_opts_t o = {.nodes = 2};
    char *s = script(cp2_yaml, &o);
    cr_assert_eq(strncmp(s, "#!/bin/bash\n", 12), 0);
    /* the allocation: 1 ctx rank + 2 gen ranks; CPUs per task from the largest `threads` */
    has(s, "#SBATCH --nodes=2\n");
    has(s, "#SBATCH --ntasks=3\n");
    has(s, "#SBATCH --cpus-per-task=2\n");
    has(s, "#SBATCH --signal=B:TERM@70\n"); /* 4 x stop_timeout_s (10) + 30 */
    lacks(s, "--gpus");
    /* the router: on the head node, sharing CPUs with the workers */
    has(s, "DUET_HEAD=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\n");
    char *router = step_of(s, "router");
    has(router, "srun --overlap --nodes=1 --ntasks=1 --nodelist=\"$DUET_HEAD\"");
    has(router, "--output=\"$DUET_LOG_DIR/router.log\"");
    /* a plain scancel: the router outlasts its workers, who finish what they hold */
    has(router, "'/repo/build/router/duet-router' --model \"$DUET_MODEL\" "
                "--shutdown.drain_s=$((DUET_STOP_TIMEOUT + 5)) '--http.host=0.0.0.0'");
    /* wildcard binds: the workers and the endpoint use the head node's name */
    has(s, "DUET_ROUTER_ADDR=\"$DUET_HEAD\":8100\n");
    has(s, "DUET_ENDPOINT=http://\"$DUET_HEAD\":8000\n");
    has(s, "DUET_LOG_DIR=\"${SLURM_SUBMIT_DIR:-$PWD}/duet-$SLURM_JOB_ID\"\n");
    /* the ctx worker: its own single-task step */
    char *ctx = step_of(s, "ctx-0");
    has(ctx, "srun --exact --nodes=1 --ntasks=1 --cpus-per-task=2 --job-name=ctx-0");
    has(ctx, "--output=\"$DUET_LOG_DIR/ctx-0.log\"");
    has(ctx, "bash \"$DUET_LOG_DIR/task.sh\" '/repo/build/ctx_worker/duet-ctx' --router "
             "\"$DUET_ROUTER_ADDR\" --model \"$DUET_MODEL\" --name ctx-0 "
             "--shutdown.drain_s=\"$DUET_STOP_TIMEOUT\" '--threads=2'");
    lacks(ctx, "--mpi");
    lacks(ctx, "--helix");
    /* the gen worker: one pmix step of cp 2 ranks with the helix flags, a log per rank */
    char *gen = step_of(s, "gen-0");
    has(gen, "srun --exact --nodes=1 --ntasks=2 --cpus-per-task=1 --job-name=gen-0");
    has(gen, "--output=\"$DUET_LOG_DIR/gen-0.%t.log\" --mpi=pmix");
    has(gen, "'/repo/build/gen_worker/duet-gen' --router \"$DUET_ROUTER_ADDR\" --model "
             "\"$DUET_MODEL\" --name gen-0 --shutdown.drain_s=\"$DUET_STOP_TIMEOUT\" "
             "--helix.cp=2 --helix.tp=1 --threads=1 '--dtype=f32'");
    /* the task wrapper: a device per local task, SIGTERM for rank 0 of a group only */
    has(s, "export CUDA_VISIBLE_DEVICES=${devs[$local_id]}\n");
    has(s, "export CUDA_VISIBLE_DEVICES=$local_id\n");
    has(s, "trap '' TERM\n");
    /* the stop: gen, then ctx, then the router; no admin token, so no duetctl drain */
    const char *p_gen = strstr(s, "stop_steps \"$DUET_STOP_TIMEOUT\" \"${DUET_GEN[@]}\"");
    const char *p_ctx = strstr(s, "stop_steps \"$DUET_STOP_TIMEOUT\" \"${DUET_CTX[@]}\"");
    const char *p_rt = strstr(s, "stop_steps \"$DUET_STOP_TIMEOUT\" router");
    cr_assert(p_gen != NULL && p_ctx != NULL && p_rt != NULL && p_gen < p_ctx && p_ctx < p_rt);
    has(s, "DUET_ADMIN_URL=\"\"");
    has(s, "DUET_CTX=(ctx-0)\nDUET_GEN=(gen-0)\n");
    has(s, "trap 'say \"SIGTERM received: stopping the cluster\"; stop_all; exit 0' TERM\n");
    free(router), free(ctx), free(gen), free(s);
}

/* bash itself reads the script: no syntax error in what was generated. */
Test(launcher_sbatch, bash_syntax)
{
    duet_sbatch_opts_t o = {.nodes = 1, .gpus_per_node = 4, .time = "1-00:00:00"};
    char *s = script(cp2_yaml, &o);
    char path[] = "/tmp/duet-sbatch-XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    cr_assert_eq(write(fd, s, strlen(s)), (ssize_t)strlen(s));
    close(fd);
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "bash -n %s", path);
    int rc = system(cmd);
    unlink(path);
    cr_assert(WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "bash -n rejected the script:\n%s", s);
    free(s);
}

Test(launcher_sbatch, gpus_time_admin_drain)
{
    const char *yaml = "model: m\n"
                       "router:\n"
                       "  http: {host: 127.0.0.1, port: 9000}\n"
                       "  workers: {host: 127.0.0.1, port: 9100}\n"
                       "  admin: {port: 9200, token: tok}\n"
                       "ctx: {count: 0}\n"
                       "gen: {count: 2, cp: 2, tp: 2}\n"
                       "stop_timeout_s: 5\n";
    duet_sbatch_opts_t o = {.nodes = 1, .gpus_per_node = 8, .time = "02:00:00"};
    char *s = script(yaml, &o);
    has(s, "#SBATCH --gpus-per-node=8\n");
    has(s, "#SBATCH --time=02:00:00\n");
    has(s, "#SBATCH --ntasks=8\n"); /* two groups of 2 x 2 */
    has(s, "#SBATCH --signal=B:TERM@50\n");
    /* loopback binds are used as written */
    has(s, "DUET_ROUTER_ADDR='127.0.0.1':9100\n");
    has(s, "DUET_ENDPOINT=http://'127.0.0.1':9000\n");
    /* the drain through the admin API before the stop */
    has(s, "DUET_ADMIN_URL=http://'127.0.0.1':'9200'\n");
    has(s, "DUET_ADMIN_TOKEN='tok'\n");
    has(s, "DUET_DUETCTL='/repo/build'/router/duetctl\n");
    has(s, "drain \"$g\" --wait --timeout \"$DUET_STOP_TIMEOUT\"");
    has(s, "DUET_CTX=()\nDUET_GEN=(gen-0 gen-1)\n");
    lacks(s, "--job-name=ctx-0");
    for (int i = 0; i < 2; i++) {
        char name[8];
        snprintf(name, sizeof(name), "gen-%d", i);
        char *gen = step_of(s, name);
        has(gen, "--ntasks=4");
        has(gen, "--mpi=pmix --gpus-per-task=1");
        has(gen, "--helix.cp=2 --helix.tp=2 --threads=1");
        free(gen);
    }
    free(s);
}

/* The script's task wrapper (task.sh), written to a temp file whose path goes to path. */
static void write_task_sh(char *path)
{
    duet_sbatch_opts_t o = {.nodes = 1};
    char *s = script(cp2_yaml, &o);
    const char *a = strstr(s, "<<'EOF'\n");
    cr_assert_not_null(a);
    a += strlen("<<'EOF'\n");
    const char *b = strstr(a, "\nEOF\n");
    cr_assert_not_null(b);
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    cr_assert_eq(write(fd, a, (size_t)(b - a) + 1), (ssize_t)(b - a) + 1);
    close(fd);
    free(s);
}

/* Run `env ENV bash task.sh CMD` through the shell; its first line of stdout goes to out. */
static void run_task(const char *task, const char *env, const char *cmd, char *out, size_t cap)
{
    char line[1024];
    snprintf(line, sizeof(line),
             "(env -u CUDA_VISIBLE_DEVICES %s bash %s %s | grep -v duet-task) 2>/dev/null", env,
             task, cmd);
    FILE *p = popen(line, "r");
    cr_assert_not_null(p);
    out[0] = '\0';
    if (fgets(out, (int)cap, p) == NULL)
        out[0] = '\0';
    out[strcspn(out, "\n")] = '\0';
    pclose(p);
}

/* Each task keeps its own GPU: entry SLURM_LOCALID of the step's list, a single entry as it
 * is, SLURM_LOCALID itself without a list; in a group only rank 0 takes SIGTERM. */
Test(launcher_sbatch, task_wrapper_devices_and_sigterm)
{
    char task[] = "/tmp/duet-task-XXXXXX";
    write_task_sh(task);
    char out[256];
    const char *dev = "bash -c 'echo \"dev=$CUDA_VISIBLE_DEVICES\"'";
    run_task(task, "SLURM_LOCALID=2 CUDA_VISIBLE_DEVICES=4,5,6,7", dev, out, sizeof(out));
    cr_assert_str_eq(out, "dev=6");
    run_task(task, "SLURM_LOCALID=0 CUDA_VISIBLE_DEVICES=4,5", dev, out, sizeof(out));
    cr_assert_str_eq(out, "dev=4");
    run_task(task, "SLURM_LOCALID=1 CUDA_VISIBLE_DEVICES=3", dev, out, sizeof(out));
    cr_assert_str_eq(out, "dev=3"); /* Slurm bound one GPU to this task already */
    run_task(task, "SLURM_LOCALID=3", dev, out, sizeof(out));
    cr_assert_str_eq(out, "dev=3");
    /* a follower survives the SIGTERM sent to every task of its step; rank 0 does not */
    const char *term = "bash -c 'kill -TERM $$; echo survived'";
    run_task(task, "SLURM_STEP_NUM_TASKS=2 SLURM_PROCID=1", term, out, sizeof(out));
    cr_assert_str_eq(out, "survived");
    run_task(task, "SLURM_STEP_NUM_TASKS=2 SLURM_PROCID=0", term, out, sizeof(out));
    cr_assert_str_eq(out, "");
    run_task(task, "SLURM_STEP_NUM_TASKS=1 SLURM_PROCID=0", term, out, sizeof(out));
    cr_assert_str_eq(out, "");
    unlink(task);
}

/* A value with a quote and a command substitution reaches the shell as one literal word. */
Test(launcher_sbatch, values_quoted)
{
    const char *yaml = "model: \"/m/it's $(touch x)\"\n"
                       "gen: {count: 1, args: {tag: \"a'b; rm -rf /\"}}\n";
    duet_sbatch_opts_t o = {.nodes = 1};
    char *s = script(yaml, &o);
    has(s, "DUET_MODEL='/m/it'\\''s $(touch x)'\n");
    has(s, " '--tag=a'\\''b; rm -rf /' &\n");
    free(s);
}

/* The file's own shutdown.drain_s wins over the script's default, for the router and a worker. */
Test(launcher_sbatch, own_drain_time_kept)
{
    const char *yaml = "model: models/duet-demo\n"
                       "router: {shutdown: {drain_s: 40}}\n"
                       "gen: {count: 1, args: {shutdown: {drain_s: 7}}}\n";
    duet_sbatch_opts_t o = {.nodes = 1};
    char *s = script(yaml, &o);
    char *router = step_of(s, "router");
    char *gen = step_of(s, "gen-0");
    char *ctx = step_of(s, "ctx-0");
    has(router, " '--shutdown.drain_s=40'");
    lacks(router, "DUET_STOP_TIMEOUT + 5");
    has(gen, " '--shutdown.drain_s=7'");
    lacks(gen, "--shutdown.drain_s=\"$DUET_STOP_TIMEOUT\"");
    has(ctx, " --shutdown.drain_s=\"$DUET_STOP_TIMEOUT\"");
    free(router);
    free(gen);
    free(ctx);
    free(s);
}

/* A file name with a newline stays inside its comment line. */
Test(launcher_sbatch, file_name_in_comment)
{
    duet_cluster_t *spec = NULL;
    cr_assert_eq(
        duet_cluster_load_string(cp2_yaml, strlen(cp2_yaml), "a\nrm -rf x\n.yaml", &paths, &spec),
        DUET_OK);
    duet_sbatch_opts_t o = {.nodes = 1};
    duet_strbuf_t sb;
    duet_strbuf_init(&sb);
    cr_assert_eq(duet_sbatch_write(spec, &o, &sb), DUET_OK);
    has(sb.data, "from a?rm -rf x?.yaml (docs/deploy-slurm.md).\n");
    lacks(sb.data, "\nrm -rf x");
    duet_strbuf_free(&sb);
    duet_cluster_destroy(spec);
}

Test(launcher_sbatch, bad_options)
{
    duet_cluster_t *spec = NULL;
    cr_assert_eq(duet_cluster_load_string(cp2_yaml, strlen(cp2_yaml), "t.yaml", &paths, &spec),
                 DUET_OK);
    const struct {
        duet_sbatch_opts_t o;
        duet_status_t want;
        const char *needle;
    } cases[] = {
        {{.nodes = 0}, DUET_ERR_RANGE, "--nodes 0"},
        {{.nodes = 5000}, DUET_ERR_RANGE, "--nodes 5000"},
        {{.nodes = 1, .gpus_per_node = -1}, DUET_ERR_RANGE, "--gpus-per-node -1"},
        {{.nodes = 1, .gpus_per_node = 65}, DUET_ERR_RANGE, "--gpus-per-node 65"},
        {{.nodes = 1, .time = "1:00; reboot"}, DUET_ERR_INVALID, "--time"},
        {{.nodes = 1, .time = ""}, DUET_ERR_INVALID, "--time"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        duet_strbuf_t sb;
        duet_strbuf_init(&sb);
        duet_status_t st = duet_sbatch_write(spec, &cases[i].o, &sb);
        cr_assert_eq(st, cases[i].want, "case %zu: %s", i, duet_error_last());
        cr_assert_not_null(strstr(duet_error_last(), cases[i].needle), "case %zu: %s", i,
                           duet_error_last());
        duet_strbuf_free(&sb);
    }
    duet_cluster_destroy(spec);
}
