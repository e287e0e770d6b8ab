#!/bin/bash
# `duet sbatch` on a real Slurm (docs/deploy-slurm.md): munged, slurmctld and slurmd started on this
# machine from a generated slurm.conf in a temp folder; the batch script of a cluster file with one
# ctx worker and one gen worker that is a Helix group of cp 2 (two ranks under srun --mpi=pmix) is
# submitted; once the job prints its endpoint, greedy completions are compared with duet-generate's
# for the same prompts (the flags of test_cluster.c's reference()); then
# `scancel --batch --signal=TERM` must stop everything in order: the job leaves squeue, its output
# says every step stopped without a kill, no process of the job is left, and the logs exist.
# A second job is then stopped with a plain `scancel JOB` (Slurm sends every process SIGTERM at
# once) while a long completion streams: the stream must run to its end and equal duet-generate's,
# the workers finish and leave before the router (shutdown.drain_s), and nothing is left.
# Fails (never skips) when Slurm or munge is missing (deploy/install-deps.sh --tests installs them)
# or its daemons do not come up.
# Usage: test_slurm.sh SOURCE_DIR BUILD_DIR
set -u
SRC=$(cd "$1" && pwd)
BUILD=$(cd "$2" && pwd)
T=""
PIDS=()
JOB=""

die() {
  echo "test_slurm: FAIL: $*" >&2
  for f in "$T"/slurmctld.log "$T"/slurmd.log "$T"/submit/duet-*.out "$T"/submit/duet-*/*.log; do
    [ -f "$f" ] && { echo "---- $f (tail)" >&2; tail -n 25 "$f" >&2; }
  done
  exit 1
}

# The live processes of the job: those carrying this test's tag (sbatch and srun pass the
# submitter's environment to every task), as "PID (command line, state S)"; zombies run nothing.
job_procs() {
  local env pid state
  for env in /proc/[0-9]*/environ; do
    tr '\0' '\n' 2>/dev/null <"$env" | grep -qx "DUET_SLURM_TEST_TAG=$T" || continue
    pid=${env#/proc/}
    pid=${pid%/environ}
    state=$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f1)
    [ -n "$state" ] && [ "$state" != Z ] &&
      echo "$pid ($(tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline"), state $state)"
  done
}
cleanup() {
  local i p
  if [ -n "$JOB" ]; then
    # let Slurm end the job while its daemons still run, then end whatever the job left
    SLURM_CONF=$T/slurm.conf scancel "$JOB" 2>/dev/null
    for ((i = 0; i < 150; i++)); do
      [ -z "$(SLURM_CONF=$T/slurm.conf squeue -h -j "$JOB" 2>/dev/null)" ] && break
      sleep 0.1
    done
    for p in $(job_procs | cut -d' ' -f1); do kill -KILL "$p" 2>/dev/null; done
  fi
  # our daemons, by the ids we started them with, slurmd first (it owns the job's processes)
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do kill -TERM "${PIDS[$i]}" 2>/dev/null; done
  for ((i = 0; i < 50; i++)); do
    local left=0
    for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null && left=1; done
    [ $left = 0 ] && break
    sleep 0.1
  done
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; done
  [ -n "$T" ] && rm -rf "$T"
}
# `timeout 400` on each daemon: should ctest kill this script (SIGKILL runs no trap), the daemons
# still end after the test's TIMEOUT
trap cleanup EXIT
trap 'exit 1' INT TERM

for b in munged slurmctld slurmd sbatch squeue scancel scontrol sinfo srun curl python3; do
  command -v "$b" >/dev/null ||
    die "$b is not installed: the Slurm test needs slurm-wlm and munge (deploy/install-deps.sh --tests)"
done
[ "$(id -u)" -eq 0 ] || die "starting slurmd and munged needs root (CI runs as root)"
for b in deploy/launcher/duet router/duet-router router/duetctl ctx_worker/duet-ctx \
  gen_worker/duet-gen engine/duet-generate; do
  [ -x "$BUILD/$b" ] || die "$BUILD/$b is not built"
done

T=$(mktemp -d /tmp/duet-slurm.XXXXXX)
chmod 755 "$T" # munged runs as user munge and must reach its socket folder
mkdir -p "$T/munge" "$T/state" "$T/spool" "$T/submit"
chown munge: "$T/munge" || die "no user munge (is the munge package installed?)"

# a free TCP port for each use, none listening now, below the kernel's ephemeral range: there
# an outgoing connection of a test running beside this one can take the port between the check
# and the bind (seen in CI: the router's "address already in use")
read -r eph_lo _ < /proc/sys/net/ipv4/ip_local_port_range 2> /dev/null || eph_lo=32768
[ "$eph_lo" -gt 11024 ] 2> /dev/null || eph_lo=32768
used=" "
free_port() {
  local p
  while :; do
    p=$((10000 + RANDOM % (eph_lo - 10000)))
    case "$used" in *" $p "*) continue ;; esac
    (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null && continue
    used="$used$p "
    echo "$p"
    return
  done
}
CTLD_PORT=$(free_port); used="$used$CTLD_PORT "
SLURMD_PORT=$(free_port); used="$used$SLURMD_PORT "
HTTP_PORT=$(free_port); used="$used$HTTP_PORT "
WORKERS_PORT=$(free_port); used="$used$WORKERS_PORT "
ADMIN_PORT=$(free_port)

dd if=/dev/urandom of="$T/munge/munge.key" bs=1024 count=1 2>/dev/null
chown munge: "$T/munge/munge.key" && chmod 400 "$T/munge/munge.key"
runuser -u munge -- timeout 400 munged -F --key-file="$T/munge/munge.key" \
  --socket="$T/munge/munge.sock" --pid-file="$T/munge/munged.pid" \
  --log-file="$T/munge/munged.log" --seed-file="$T/munge/seed" >"$T/munged.out" 2>&1 &
PIDS+=($!)

# The machine has few cores; slurmd takes the node's CPUs from this file (config_overrides) so the
# job's three worker ranks fit however many cores CI has.
cat >"$T/slurm.conf" <<EOF
ClusterName=duettest
SlurmctldHost=localhost
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$T/munge/munge.sock
StateSaveLocation=$T/state
SlurmdSpoolDir=$T/spool
SlurmctldPidFile=$T/slurmctld.pid
SlurmdPidFile=$T/slurmd.pid
SlurmctldLogFile=$T/slurmctld.log
SlurmdLogFile=$T/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
KillWait=90
NodeName=localhost NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
# PMIx's per-step client directories (spmix_appdir_UID_JOB.STEP) default to /tmp; job ids restart at
# 1 with every fresh state directory, so one left by an earlier run (a killed step does not remove
# its own) would fail the same step here with "File exists". Keep them in this run's directory.
mkdir -p "$T/pmix"
echo "PMIxCliTmpDirBase=$T/pmix" >"$T/mpi.conf"
export SLURM_CONF=$T/slurm.conf

for ((i = 0; i < 50; i++)); do [ -S "$T/munge/munge.sock" ] && break; sleep 0.1; done
[ -S "$T/munge/munge.sock" ] || die "munged did not start: $(cat "$T/munged.out" "$T/munge/munged.log" 2>/dev/null)"
timeout 400 slurmctld -D -f "$T/slurm.conf" >"$T/slurmctld.out" 2>&1 &
PIDS+=($!)
timeout 400 slurmd -D -N localhost -f "$T/slurm.conf" >"$T/slurmd.out" 2>&1 &
PIDS+=($!)
state=""
for ((i = 0; i < 150; i++)); do
  state=$(sinfo -h -n localhost -o %T 2>/dev/null)
  [ "$state" = idle ] && break
  sleep 0.2
done
[ "$state" = idle ] || die "Slurm did not come up: node state \"$state\" after 30 s"

cat >"$T/cluster.yaml" <<EOF
model: $SRC/models/duet-demo
binaries: $BUILD
router:
  http: {host: 127.0.0.1, port: $HTTP_PORT}
  workers: {host: 127.0.0.1, port: $WORKERS_PORT}
  admin: {port: $ADMIN_PORT, token: slurm-test-token}
  limits: {max_context: 4096}
ctx:
  count: 1
  args: {threads: 1, dtype: f32, batch: {prefill_chunk: 64}}
gen:
  count: 1
  cp: 2
  args: {threads: 1, dtype: f32, batch: {prefill_chunk: 64}}
startup_timeout_s: 60
stop_timeout_s: 60
EOF
"$BUILD/deploy/launcher/duet" sbatch "$T/cluster.yaml" >"$T/submit/job.sbatch" ||
  die "duet sbatch failed"
cd "$T/submit" || die "no submit folder"
# the tag marks every process of the job (job_procs), and only those: it is sbatch's alone
# submit the script; sets JOB, OUT, LOGS and endpoint once the job printed it
submit() {
  JOB=$(DUET_SLURM_TEST_TAG=$T sbatch --parsable job.sbatch) || die "sbatch refused the script"
  OUT="$T/submit/duet-$JOB.out"
  LOGS="$T/submit/duet-$JOB"
  echo "test_slurm: job $JOB submitted"
  endpoint=""
  for ((i = 0; i < 600; i++)); do
    endpoint=$(grep -o 'endpoint http://[^ ]*' "$OUT" 2>/dev/null | head -n 1 | cut -d' ' -f2)
    [ -n "$endpoint" ] && break
    [ -n "$(squeue -h -j "$JOB" 2>/dev/null)" ] || die "the job ended before printing its endpoint"
    sleep 0.1
  done
  [ -n "$endpoint" ] || die "no endpoint line in the job's output within 60 s"
  echo "test_slurm: endpoint $endpoint"
}

# wait until job JOB left squeue and none of its processes is left; then JOB_DONE=JOB, JOB=""
wait_gone() {
  for ((i = 0; i < 600; i++)); do
    [ -z "$(squeue -h -j "$JOB" 2>/dev/null)" ] && break
    sleep 0.1
  done
  [ -z "$(squeue -h -j "$JOB" 2>/dev/null)" ] || die "the job was still in squeue 60 s after scancel"
  JOB_DONE=$JOB
  JOB=""
  # nothing that ran in the job is left (a zombie gets 5 s for its parent to reap it)
  for ((i = 0; i < 50; i++)); do
    left=$(job_procs)
    [ -z "$left" ] && break
    sleep 0.1
  done
  [ -z "$left" ] || die "processes of job $JOB_DONE still running: $left"
}

submit

model=$(curl -s -m 5 "$endpoint/models" |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])') ||
  die "GET $endpoint/models failed"
n=0
for prompt in "The LORD said unto Moses," "In the beginning God created"; do
  want=$("$BUILD/engine/duet-generate" --model "$SRC/models/duet-demo" --prompt "$prompt" \
    --max-tokens 12 --prefill-chunk 64 --threads 1 --dtype f32 --json 2>/dev/null |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["text"], end="")') ||
    die "duet-generate failed for \"$prompt\""
  body=$(python3 -c 'import json,sys; print(json.dumps({"model": sys.argv[1], "prompt": sys.argv[2],
         "max_tokens": 12, "temperature": 0}))' "$model" "$prompt")
  got=$(curl -s -m 60 "$endpoint/completions" -H 'Content-Type: application/json' -d "$body" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["text"], end="")') ||
    die "POST $endpoint/completions failed for \"$prompt\""
  [ "$got" = "$want" ] || die "\"$prompt\": the Slurm cluster answered \"$got\", duet-generate \"$want\""
  [ -n "$got" ] || die "\"$prompt\": empty answer"
  n=$((n + 1))
done
echo "test_slurm: $n completions match duet-generate"

scancel --batch --signal=TERM "$JOB" || die "scancel failed"
wait_gone
grep -q "SIGTERM received" "$OUT" || die "the batch script did not see the SIGTERM"
grep -q "draining gen-0" "$OUT" || die "gen-0 was not drained before its stop"
grep -q "all steps stopped" "$OUT" || die "the job did not report every step stopped"
! grep -q "killing its step\|drain of .* failed" "$OUT" || die "the stop was not clean: $(grep 'killing\|failed' "$OUT")"
# the order: the gen workers stop before the ctx workers, which stop before the router
order=$(grep -oE 'stopping (gen|ctx|router)' "$OUT" | cut -d' ' -f2 | tr '\n' ' ')
[ "$order" = "gen ctx router " ] || die "stop order \"$order\", want \"gen ctx router \""
for f in job.log router.log ctx-0.log gen-0.0.log gen-0.1.log task.sh; do
  [ -s "$LOGS/$f" ] || die "log $LOGS/$f is missing or empty"
done
nodelogs=("$LOGS"/node-*.log)
[ ${#nodelogs[@]} -eq 1 ] && [ -s "${nodelogs[0]}" ] || die "want one node log, have: ${nodelogs[*]}"
grep -q "no nvidia-smi\|GPU" "${nodelogs[0]}" || die "the node log lacks its device line"
# each rank of the group took its own device from SLURM_LOCALID (no GPU scheduling here)
for r in 0 1; do
  grep -q "rank $r local $r CUDA_VISIBLE_DEVICES=$r\$" "$LOGS/gen-0.$r.log" ||
    die "gen-0 rank $r: no device line for local id $r: $(grep duet-task "$LOGS/gen-0.$r.log")"
done
for f in ctx-0.log gen-0.0.log; do
  grep -q "stopping: SIGTERM" "$LOGS/$f" || die "$f: the worker did not stop on SIGTERM"
done
echo "test_slurm: job $JOB_DONE: up, $n answers as duet-generate, stopped in order, logs present"

# A plain scancel while a long completion streams.
first=$JOB_DONE
submit
prompt="And it came to pass"
want=$("$BUILD/engine/duet-generate" --model "$SRC/models/duet-demo" --prompt "$prompt" \
  --max-tokens 1500 --prefill-chunk 64 --threads 1 --dtype f32 --json 2>/dev/null |
  python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["finish_reason"], d["text"], end="")') ||
  die "duet-generate failed for \"$prompt\""
[ "${want%% *}" = length ] || die "duet-generate stopped early (${want%% *}): pick a longer answer"
# the client: streams the completion, says "first" after its first chunk, writes the text and
# the finish reason when the stream ends
python3 - "$endpoint" "$model" "$prompt" >"$T/stream.out" 2>"$T/stream.err" <<'PY' &
import json, sys, urllib.request
url, model, prompt = sys.argv[1:4]
body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1500, "temperature": 0,
                   "stream": True}).encode()
req = urllib.request.Request(url + "/completions", body, {"Content-Type": "application/json"})
text, reason, first = "", None, True
with urllib.request.urlopen(req, timeout=120) as r:
    for line in r:
        line = line.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ch = json.loads(line[6:])["choices"][0]
        text += ch["text"]
        reason = ch.get("finish_reason") or reason
        if first:
            print("first", file=sys.stderr, flush=True)
            first = False
sys.stdout.write(f"{reason} {text}")
PY
client=$!
for ((i = 0; i < 300; i++)); do
  grep -q first "$T/stream.err" 2>/dev/null && break
  kill -0 $client 2>/dev/null || break
  sleep 0.05
done
grep -q first "$T/stream.err" || die "the stream did not start: $(cat "$T/stream.err")"
kill -0 $client 2>/dev/null || die "the stream ended before scancel: no mid-stream stop to test"
scancel "$JOB" || die "plain scancel failed"
wait $client || die "the stream failed after a plain scancel: $(tail -n 5 "$T/stream.err")"
got=$(cat "$T/stream.out")
[ "$got" = "$want" ] ||
  die "plain scancel cut the stream: got ${#got} chars (${got%% *}), duet-generate ${#want} (${want%% *})"
wait_gone
for f in ctx-0.log gen-0.0.log; do
  grep -q "SIGTERM: taking no new work" "$LOGS/$f" || die "$f: the worker did not drain on SIGTERM"
  grep -q "stopping: SIGTERM: every request here finished" "$LOGS/$f" ||
    die "$f: the worker did not finish its requests before it stopped"
done
grep -q "router: every worker has left" "$LOGS/router.log" ||
  die "the router did not outlast its workers: $(tail -n 5 "$LOGS/router.log")"
! grep -q "killing its step" "$OUT" || die "a step had to be killed: $(grep killing "$OUT")"
echo "test_slurm: PASS (job $first stopped in order by the batch script; job $JOB_DONE by a plain" \
  "scancel mid-stream: the ${#got}-char answer as duet-generate, workers before the router)"
