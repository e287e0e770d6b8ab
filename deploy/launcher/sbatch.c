/*
 * The batch script of `duet sbatch` (deploy/launcher/sbatch.h). The variable part (paths, ports,
 * one srun line per worker) is written from the cluster file; the rest is fixed bash below. Every
 * value from the file reaches the shell single-quoted, so no key or path can inject a command.
 */
#define _GNU_SOURCE
#include "deploy/launcher/sbatch.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void duet_sbatch_shell_quote(duet_strbuf_t *sb, const char *s)
{
    duet_strbuf_puts(sb, "'");
    for (; *s != '\0'; s++) {
        if (*s == '\'')
            duet_strbuf_puts(sb, "'\\''");
        else
            duet_strbuf_append(sb, s, 1);
    }
    duet_strbuf_puts(sb, "'");
}

/* CPUs one rank of a role computes on: its `threads` when a positive number, else 1. */
static int sb__cpus(const duet_cluster_role_t *r)
{
    const char *t = duet_cluster_arg(r, "threads");
    long n = t != NULL ? strtol(t, NULL, 10) : 1;
    return n >= 1 && n <= 1024 ? (int)n : 1;
}

static bool sb__wildcard(const char *host)
{
    return host[0] == '\0' || strcmp(host, "0.0.0.0") == 0 || strcmp(host, "::") == 0 ||
           strcmp(host, "[::]") == 0;
}

/* "VAR=HOST:PORT" (var ends in '='): how the rest of the job reaches an address the router binds;
 * a wildcard is the head node. */
static void sb__reach(duet_strbuf_t *sb, const char *var, const char *host, int port)
{
    duet_strbuf_puts(sb, var);
    if (sb__wildcard(host)) {
        duet_strbuf_printf(sb, "\"$DUET_HEAD\":%d\n", port);
    } else {
        duet_sbatch_shell_quote(sb, host);
        duet_strbuf_printf(sb, ":%d\n", port);
    }
}

/* The shell functions every script shares: logging, the task wrapper, stopping, readiness. */
static const char sb__body[] =
    "say() { printf 'duet: %s %s\\n' \"$(date +%H:%M:%S)\" \"$*\" | tee -a "
    "\"$DUET_LOG_DIR/job.log\"; }\n"
    "\n"
    "# Every worker rank starts through this wrapper. Its GPU: the step's CUDA_VISIBLE_DEVICES\n"
    "# (Slurm's GPU binding) indexed by SLURM_LOCALID, or device SLURM_LOCALID when Slurm set\n"
    "# none, so that device 0 of the process (the engine's) is its own. In a Helix group only\n"
    "# rank 0 answers SIGTERM (it drains, deregisters and then stops its followers); the other\n"
    "# ranks ignore the SIGTERM that `scancel --signal=TERM JOB.STEP` sends to every task.\n"
    "cat > \"$DUET_LOG_DIR/task.sh\" <<'EOF'\n"
    "#!/bin/bash\n"
    "local_id=${SLURM_LOCALID:-0}\n"
    "if [ -n \"${CUDA_VISIBLE_DEVICES:-}\" ]; then\n"
    "  IFS=, read -r -a devs <<<\"$CUDA_VISIBLE_DEVICES\"\n"
    "  if [ \"${#devs[@]}\" -gt \"$local_id\" ] && [ \"${#devs[@]}\" -gt 1 ]; then\n"
    "    export CUDA_VISIBLE_DEVICES=${devs[$local_id]}\n"
    "  fi\n"
    "else\n"
    "  export CUDA_VISIBLE_DEVICES=$local_id\n"
    "fi\n"
    "if [ \"${SLURM_STEP_NUM_TASKS:-1}\" -gt 1 ] && [ \"${SLURM_PROCID:-0}\" -ne 0 ]; then\n"
    "  trap '' TERM\n"
    "fi\n"
    "echo \"duet-task: $(hostname) step ${SLURM_STEP_ID:-?} rank ${SLURM_PROCID:-0} local "
    "$local_id CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES\"\n"
    "exec \"$@\"\n"
    "EOF\n"
    "\n"
    "declare -A DUET_PID=()\n"
    "started() { DUET_PID[$1]=$2; say \"$1: step started (srun pid $2), log "
    "$DUET_LOG_DIR/$1*.log\"; }\n"
    "alive() { [ -n \"${DUET_PID[$1]:-}\" ] && kill -0 \"${DUET_PID[$1]}\" 2>/dev/null; }\n"
    "\n"
    "# Slurm's id (JOB.STEP) of the step NAME, or nothing.\n"
    "step_id() {\n"
    "  squeue -h -s -j \"$SLURM_JOB_ID\" -o '%i %j' 2>/dev/null | awk -v n=\"$1\" '$2 == n "
    "{print $1}'\n"
    "}\n"
    "\n"
    "# SIGTERM to the tasks of the steps NAME... through Slurm (they may be on other nodes; a\n"
    "# signal to srun itself would make it kill them), wait up to GRACE s, then SIGKILL the\n"
    "# steps left.\n"
    "stop_steps() {\n"
    "  local grace=$1 name t id left=(); shift\n"
    "  for name; do alive \"$name\" && left+=(\"$name\"); done\n"
    "  [ ${#left[@]} -eq 0 ] && return 0\n"
    "  say \"stopping ${left[*]}\"\n"
    "  for name in \"${left[@]}\"; do\n"
    "    id=$(step_id \"$name\")\n"
    "    if [ -n \"$id\" ]; then scancel --signal=TERM \"$id\"; else kill -TERM "
    "\"${DUET_PID[$name]}\"; fi\n"
    "  done\n"
    "  for ((t = 0; t < grace * 10; t++)); do\n"
    "    left=(); for name; do alive \"$name\" && left+=(\"$name\"); done\n"
    "    [ ${#left[@]} -eq 0 ] && break\n"
    "    sleep 0.1\n"
    "  done\n"
    "  for name in \"${left[@]}\"; do\n"
    "    say \"$name did not stop within ${grace} s (stop_timeout_s): killing its step\"\n"
    "    id=$(step_id \"$name\")\n"
    "    [ -n \"$id\" ] && scancel --signal=KILL \"$id\"\n"
    "    kill -KILL \"${DUET_PID[$name]}\" 2>/dev/null\n"
    "  done\n"
    "  for name; do [ -n \"${DUET_PID[$name]:-}\" ] && wait \"${DUET_PID[$name]}\" 2>/dev/null; "
    "done\n"
    "  return 0\n"
    "}\n"
    "\n"
    "DUET_STOPPING=0\n"
    "stop_all() {\n"
    "  [ \"$DUET_STOPPING\" = 1 ] && return\n"
    "  DUET_STOPPING=1\n"
    "  trap '' TERM INT\n"
    "  local g\n"
    "  if [ -n \"$DUET_ADMIN_URL\" ] && alive router; then\n"
    "    for g in \"${DUET_GEN[@]}\"; do\n"
    "      alive \"$g\" || continue\n"
    "      say \"draining $g\"\n"
    "      \"$DUET_DUETCTL\" --admin \"$DUET_ADMIN_URL\" --token \"$DUET_ADMIN_TOKEN\" drain "
    "\"$g\" "
    "--wait --timeout \"$DUET_STOP_TIMEOUT\" >>\"$DUET_LOG_DIR/job.log\" 2>&1 ||\n"
    "        say \"drain of $g failed (see job.log); stopping it anyway\"\n"
    "    done\n"
    "  fi\n"
    "  stop_steps \"$DUET_STOP_TIMEOUT\" \"${DUET_GEN[@]}\"\n"
    "  stop_steps \"$DUET_STOP_TIMEOUT\" \"${DUET_CTX[@]}\"\n"
    "  stop_steps \"$DUET_STOP_TIMEOUT\" router\n"
    "  say \"all steps stopped\"\n"
    "}\n"
    "trap 'say \"SIGTERM received: stopping the cluster\"; stop_all; exit 0' TERM\n"
    "trap 'say \"SIGINT received: stopping the cluster\"; stop_all; exit 0' INT\n"
    "fail() { say \"$*\"; stop_all; exit 1; }\n"
    "# sleep in the background so that a signal's trap runs at once\n"
    "nap() { sleep \"$1\" & wait $! 2>/dev/null; }\n"
    "\n"
    "health() {\n"
    "  local out code ctx gen\n"
    "  out=$(curl -s -m 2 -w '\\n%{http_code}' \"$DUET_HEALTH_URL\" 2>/dev/null) || return 1\n"
    "  code=${out##*$'\\n'}\n"
    "  ctx=$(grep -o '\"ctx_workers\": *[0-9]*' <<<\"$out\" | grep -o '[0-9]*$')\n"
    "  gen=$(grep -o '\"gen_workers\": *[0-9]*' <<<\"$out\" | grep -o '[0-9]*$')\n"
    "  DUET_UP=\"ctx ${ctx:-0}/${#DUET_CTX[@]}, gen ${gen:-0}/${#DUET_GEN[@]}\"\n"
    "  [ \"$code\" = 200 ] && [ \"${ctx:-0}\" -ge ${#DUET_CTX[@]} ] && [ \"${gen:-0}\" -ge "
    "${#DUET_GEN[@]} ]\n"
    "}\n"
    "\n"
    "say \"job $SLURM_JOB_ID on $SLURM_JOB_NODELIST (head $DUET_HEAD); logs in $DUET_LOG_DIR\"\n"
    "srun --overlap --nodes=\"$SLURM_JOB_NUM_NODES\" --ntasks=\"$SLURM_JOB_NUM_NODES\" "
    "--ntasks-per-node=1 --cpus-per-task=1 "
    "--job-name=nodes --output=\"$DUET_LOG_DIR/node-%N.log\" \\\n"
    "  bash -c 'echo \"$(hostname): $(date)\"; echo \"cpus $(nproc)\"; "
    "nvidia-smi -L 2>/dev/null || echo \"no nvidia-smi\"' || fail \"cannot run a step on "
    "every node\"\n"
    "DUET_T0=$SECONDS\n";

static const char sb__ready[] =
    "deadline=$((DUET_T0 + DUET_STARTUP_TIMEOUT))\n"
    "until (exec 3<>\"/dev/tcp/${DUET_ROUTER_ADDR%:*}/${DUET_ROUTER_ADDR##*:}\") 2>/dev/null; do\n"
    "  alive router || fail \"the router exited during start-up; see $DUET_LOG_DIR/router.log\"\n"
    "  [ $SECONDS -lt $deadline ] || fail \"the router's worker port $DUET_ROUTER_ADDR did not "
    "open within $DUET_STARTUP_TIMEOUT s (startup_timeout_s)\"\n"
    "  nap 0.2\n"
    "done\n";

static const char sb__serve[] =
    "DUET_UP=\"\"\n"
    "until health; do\n"
    "  for n in router \"${DUET_CTX[@]}\" \"${DUET_GEN[@]}\"; do\n"
    "    alive \"$n\" || fail \"$n exited during start-up; see $DUET_LOG_DIR/$n*.log\"\n"
    "  done\n"
    "  [ $SECONDS -lt $deadline ] || fail \"start-up timed out after $DUET_STARTUP_TIMEOUT s "
    "(startup_timeout_s): $DUET_UP\"\n"
    "  nap 0.5\n"
    "done\n"
    "say \"up in $((SECONDS - DUET_T0)) s: ${#DUET_CTX[@]} ctx + ${#DUET_GEN[@]} gen workers\"\n"
    "say \"endpoint $DUET_ENDPOINT\"\n"
    "say \"stop with: scancel $SLURM_JOB_ID (each process finishes its requests, the router "
    "last) or, role by role: scancel --batch --signal=TERM $SLURM_JOB_ID\"\n"
    "\n"
    "declare -A DUET_GONE=()\n"
    "while :; do\n"
    "  nap 2\n"
    "  alive router || fail \"the router exited; stopping the workers\"\n"
    "  for n in \"${DUET_CTX[@]}\" \"${DUET_GEN[@]}\"; do\n"
    "    if [ -z \"${DUET_GONE[$n]:-}\" ] && ! alive \"$n\"; then\n"
    "      DUET_GONE[$n]=1\n"
    "      say \"$n exited; the rest keep serving (see $DUET_LOG_DIR/$n*.log)\"\n"
    "    fi\n"
    "  done\n"
    "done\n";

/* One worker's srun line: `srun ... bash task.sh BINARY --router ... ARGS & started NAME $!`. */
static void sb__worker(duet_strbuf_t *sb, const duet_cluster_role_t *r, const char *name, int gpus)
{
    const int ranks = r->cp * r->tp;
    duet_strbuf_printf(sb,
                       "srun --exact --nodes=1 --ntasks=%d --cpus-per-task=%d --job-name=%s "
                       "--input=none \\\n     --output=\"$DUET_LOG_DIR/%s%s.log\"",
                       ranks, sb__cpus(r), name, name, ranks > 1 ? ".%t" : "");
    if (ranks > 1)
        duet_strbuf_puts(sb, " --mpi=pmix");
    if (gpus > 0)
        duet_strbuf_puts(sb, " --gpus-per-task=1");
    duet_strbuf_puts(sb, " \\\n     bash \"$DUET_LOG_DIR/task.sh\" ");
    duet_sbatch_shell_quote(sb, r->binary);
    duet_strbuf_printf(sb, " --router \"$DUET_ROUTER_ADDR\" --model \"$DUET_MODEL\" --name %s",
                       name);
    /* a plain `scancel JOB` sends every task SIGTERM at once: each worker finishes what it
     * holds before it stops, and the router waits for them (the batch script's order) */
    if (duet_cluster_arg(r, "shutdown.drain_s") == NULL)
        duet_strbuf_puts(sb, " --shutdown.drain_s=\"$DUET_STOP_TIMEOUT\"");
    if (ranks > 1) {
        duet_strbuf_printf(sb, " --helix.cp=%d --helix.tp=%d", r->cp, r->tp);
        if (duet_cluster_arg(r, "threads") == NULL)
            duet_strbuf_puts(sb, " --threads=1"); /* as duet up's groups: one thread a rank */
    }
    for (size_t i = 0; i < r->n_args; i++) {
        duet_strbuf_puts(sb, " ");
        duet_sbatch_shell_quote(sb, r->args[i]);
    }
    duet_strbuf_printf(sb, " &\nstarted %s $!\n", name);
}

static bool sb__time_ok(const char *t)
{
    if (t[0] == '\0')
        return false;
    for (; *t != '\0'; t++)
        if (!((*t >= '0' && *t <= '9') || (*t >= 'a' && *t <= 'z') || (*t >= 'A' && *t <= 'Z') ||
              *t == ':' || *t == '-'))
            return false;
    return true;
}

duet_status_t duet_sbatch_write(const duet_cluster_t *s, const duet_sbatch_opts_t *o,
                                duet_strbuf_t *sb)
{
    if (o->nodes < 1 || o->nodes > 4096)
        return duet_error_set(DUET_ERR_RANGE, "--nodes %d: must be 1..4096", o->nodes);
    if (o->gpus_per_node < 0 || o->gpus_per_node > 64)
        return duet_error_set(DUET_ERR_RANGE, "--gpus-per-node %d: must be 0..64",
                              o->gpus_per_node);
    if (o->time != NULL && !sb__time_ok(o->time))
        return duet_error_set(DUET_ERR_INVALID,
                              "--time \"%s\": Slurm's time limit has only digits, letters, ':' "
                              "and '-' (e.g. 2-00:00:00)",
                              o->time);
    const int ranks = s->ctx.count + s->gen.count * s->gen.cp * s->gen.tp;
    int cpus = sb__cpus(&s->ctx) > sb__cpus(&s->gen) ? sb__cpus(&s->ctx) : sb__cpus(&s->gen);
    /* the teardown's worst case: drains, then three stages of stop_timeout_s, plus slack */
    const int grace = 4 * s->stop_timeout_s + 30;
    /* the file's name goes into a comment: a control character (a newline) would end it */
    char *file = strdup(s->file);
    if (file == NULL)
        return duet_error_set(DUET_ERR_NOMEM, "sbatch script: out of memory");
    for (char *c = file; *c != '\0'; c++)
        if ((unsigned char)*c < 0x20 || *c == 0x7f)
            *c = '?';

    duet_strbuf_printf(
        sb,
        "#!/bin/bash\n"
        "# duet on Slurm, generated by `duet sbatch` from %s (docs/deploy-slurm.md).\n"
        "# Regenerate rather than edit. Submit: sbatch THIS_FILE. Stop: scancel JOBID (every\n"
        "# process finishes its requests, the router last; within the cluster's KillWait), or\n"
        "# with the batch script draining and stopping one role after another:\n"
        "#   scancel --batch --signal=TERM JOBID\n"
        "#SBATCH --job-name=duet\n"
        "#SBATCH --nodes=%d\n"
        "#SBATCH --ntasks=%d\n"
        "#SBATCH --cpus-per-task=%d\n"
        "#SBATCH --output=duet-%%j.out\n"
        "#SBATCH --signal=B:TERM@%d\n",
        file, o->nodes, ranks, cpus, grace);
    free(file);
    if (o->gpus_per_node > 0)
        duet_strbuf_printf(sb, "#SBATCH --gpus-per-node=%d\n", o->gpus_per_node);
    if (o->time != NULL)
        duet_strbuf_printf(sb, "#SBATCH --time=%s\n", o->time);
    duet_strbuf_puts(sb, "set -u\n\n");

#define SB_VAR(name, value)                                                                        \
    do {                                                                                           \
        duet_strbuf_puts(sb, name "=");                                                            \
        duet_sbatch_shell_quote(sb, value);                                                        \
        duet_strbuf_puts(sb, "\n");                                                                \
    } while (0)
    SB_VAR("DUET_MODEL", s->model);
    duet_strbuf_printf(sb, "DUET_STARTUP_TIMEOUT=%d\nDUET_STOP_TIMEOUT=%d\n", s->startup_timeout_s,
                       s->stop_timeout_s);
    duet_strbuf_puts(sb,
                     "DUET_HEAD=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\n"
                     "DUET_LOG_DIR=\"${SLURM_SUBMIT_DIR:-$PWD}/duet-$SLURM_JOB_ID\"\n"
                     "mkdir -p \"$DUET_LOG_DIR\" || exit 1\n");
    sb__reach(sb, "DUET_ROUTER_ADDR=", s->workers_host, s->workers_port);
    /* the batch script itself runs on the head node: it reaches a wildcard bind on loopback */
    duet_strbuf_puts(sb, "DUET_HEALTH_URL=http://");
    duet_sbatch_shell_quote(sb, sb__wildcard(s->http_host) ? "127.0.0.1" : s->http_host);
    duet_strbuf_printf(sb, ":%d/health\n", s->http_port);
    sb__reach(sb, "DUET_ENDPOINT=http://", s->http_host, s->http_port);
    duet_strbuf_puts(sb, "DUET_ENDPOINT=$DUET_ENDPOINT/v1\n");

    /* the drain on stop needs the admin API, which runs only with a token */
    const char *token = duet_cluster_arg(&s->router, "admin.token");
    if (token != NULL) {
        const char *host = duet_cluster_arg(&s->router, "admin.host");
        const char *port = duet_cluster_arg(&s->router, "admin.port");
        duet_strbuf_puts(sb, "DUET_ADMIN_URL=http://");
        duet_sbatch_shell_quote(sb, host == NULL || sb__wildcard(host) ? "127.0.0.1" : host);
        duet_strbuf_puts(sb, ":");
        duet_sbatch_shell_quote(sb, port != NULL ? port : "8081");
        duet_strbuf_puts(sb, "\n");
        SB_VAR("DUET_ADMIN_TOKEN", token);
        if (o->duetctl != NULL) {
            SB_VAR("DUET_DUETCTL", o->duetctl);
        } else {
            duet_strbuf_puts(sb, "DUET_DUETCTL=");
            duet_sbatch_shell_quote(sb, s->binaries);
            duet_strbuf_puts(sb, "/router/duetctl\n");
        }
    } else {
        duet_strbuf_puts(sb, "DUET_ADMIN_URL=\"\"  # no admin.token: workers drain on SIGTERM\n");
    }
#undef SB_VAR
    duet_strbuf_puts(sb, "DUET_CTX=(");
    for (int i = 0; i < s->ctx.count; i++)
        duet_strbuf_printf(sb, "%sctx-%d", i > 0 ? " " : "", i);
    duet_strbuf_puts(sb, ")\nDUET_GEN=(");
    for (int i = 0; i < s->gen.count; i++)
        duet_strbuf_printf(sb, "%sgen-%d", i > 0 ? " " : "", i);
    duet_strbuf_puts(sb, ")\n\n");
    duet_strbuf_puts(sb, sb__body);

    /* the router: one task on the head node, sharing its CPUs with the workers (--overlap) */
    duet_strbuf_puts(sb, "\nsay \"starting the router on $DUET_HEAD\"\n"
                         "srun --overlap --nodes=1 --ntasks=1 --nodelist=\"$DUET_HEAD\" "
                         "--job-name=router --input=none \\\n"
                         "     --output=\"$DUET_LOG_DIR/router.log\" ");
    duet_sbatch_shell_quote(sb, s->router.binary);
    duet_strbuf_puts(sb, " --model \"$DUET_MODEL\"");
    if (duet_cluster_arg(&s->router, "shutdown.drain_s") == NULL)
        duet_strbuf_puts(sb, " --shutdown.drain_s=$((DUET_STOP_TIMEOUT + 5))");
    for (size_t i = 0; i < s->router.n_args; i++) {
        duet_strbuf_puts(sb, " ");
        duet_sbatch_shell_quote(sb, s->router.args[i]);
    }
    duet_strbuf_puts(sb, " &\nstarted router $!\n");
    duet_strbuf_puts(sb, sb__ready);

    duet_strbuf_printf(sb,
                       "\nsay \"starting %d ctx + %d gen workers (gen: cp %d x tp %d ranks "
                       "each); workers reach the router at $DUET_ROUTER_ADDR\"\n",
                       s->ctx.count, s->gen.count, s->gen.cp, s->gen.tp);
    char name[32];
    for (int i = 0; i < s->ctx.count; i++) {
        snprintf(name, sizeof(name), "ctx-%d", i);
        sb__worker(sb, &s->ctx, name, o->gpus_per_node);
    }
    for (int i = 0; i < s->gen.count; i++) {
        snprintf(name, sizeof(name), "gen-%d", i);
        sb__worker(sb, &s->gen, name, o->gpus_per_node);
    }
    duet_strbuf_puts(sb, "\n");
    duet_strbuf_puts(sb, sb__serve);
    return duet_strbuf_status(sb) == DUET_OK
               ? DUET_OK
               : duet_error_set(DUET_ERR_NOMEM, "sbatch script: out of memory");
}
