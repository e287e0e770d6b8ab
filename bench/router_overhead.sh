#!/bin/bash
# Router overhead: requests/s, latency p50/p99 and the server process's CPU per request of POST
# /v1/completions (small prompt; max_tokens 1 and 16 non-streaming, 64 streamed) through
# duet-router with instant duet-test-worker processes (--delay-ms 0: 1 ctx + 1 gen), side by side
# with the same body POSTed to duet-http-echo's /echo (the bare HTTP server core). Router
# overhead ~= router - bare; the router's CPU per streamed token = (CPU per request at 64
# streamed - at 1) / 63.
# Pinning when taskset and 2+ cores exist: servers (router+workers, or echo) on cpu 0, wrk on cpu 1.
# Usage: bench/router_overhead.sh [BUILD_DIR] [SECONDS] ["CONNECTIONS..."] [REPS]
# Defaults: build 5 "1 16" 3. -c1 gives the unloaded latency (the added cost per request);
# -c16 the throughput, where latency is mostly queueing on the one server core.
# Needs wrk (apt-get install -y wrk). Loopback numbers on a shared VM are noisy: see load average.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
secs=${2:-5}
conns_list=${3:-1 16}
reps=${4:-3}
router=$build/router/duet-router
worker=$build/tests/tools/duet-test-worker
echo_bin=$build/tests/tools/duet-http-echo
for b in "$router" "$worker" "$echo_bin"; do
  [ -x "$b" ] || { echo "router_overhead: $b missing (cmake --build $build)" >&2; exit 1; }
done
command -v wrk > /dev/null || { echo "router_overhead: wrk not found (apt-get install -y wrk)" >&2; exit 1; }
lua=$(pwd)/bench/router_completions.lua
load_before=$(cut -d" " -f1-3 /proc/loadavg)

pin_srv=(); pin_wrk=()
if command -v taskset > /dev/null && [ "$(nproc)" -ge 2 ]; then
  pin_srv=(taskset -c 0); pin_wrk=(taskset -c 1)
fi
dir=$(mktemp -d /tmp/duet-router-bench-XXXXXX)
pids=()
stop_all() {
  local p
  for p in "${pids[@]}"; do kill -TERM "$p" 2> /dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2> /dev/null || true; done
  pids=()
}
trap 'stop_all; rm -rf "$dir"' EXIT

# ---- bare server
DUET_LOG_LEVEL=error "${pin_srv[@]}" "$echo_bin" --port 0 --max-connections 4096 > "$dir/echo.out" &
pids+=($!)
echo_pid=$!
for _ in $(seq 50); do grep -q '^port ' "$dir/echo.out" && break; sleep 0.1; done
echo_port=$(awk '/^port /{print $2}' "$dir/echo.out")
[ -n "$echo_port" ] || { echo "router_overhead: duet-http-echo did not start" >&2; exit 1; }

# ---- router + instant test workers
printf '{"bos_token_id": 256, "eos_token_id": 257, "model_max_length": 4096}\n' > "$dir/config.json"
printf '{"type": "byte", "specials": ["<|bos|>", "<|eos|>"], "add_bos": true}\n' > "$dir/duet_tokenizer.json"
DUET_LOG_LEVEL=error "${pin_srv[@]}" "$router" --model "$dir" --model.name m --model.fingerprint test \
  --http.port 0 --workers.port 0 --admin.port 0 --admin.insecure-no-token \
  --admission.max-inflight 1024 > "$dir/router.out" 2> "$dir/router.log" &
pids+=($!)
router_pid=$!
line=""
for _ in $(seq 100); do
  line=$(grep -m1 '^duet-router: serving' "$dir/router.out" 2> /dev/null) && break
  sleep 0.1
done
[ -n "$line" ] || { cat "$dir/router.log" >&2; echo "router_overhead: router did not start" >&2; exit 1; }
rport=$(sed -E 's/.* on http [^,]*:([0-9]+),.*/\1/' <<< "$line")
wport=$(sed -E 's/.*, workers [^,]*:([0-9]+),.*/\1/' <<< "$line")
for role in ctx gen; do
  "${pin_srv[@]}" "$worker" --router "127.0.0.1:$wport" --role $role --name $role-0 \
    --fingerprint test --delay-ms 0 --quiet &
  pids+=($!)
done
for _ in $(seq 100); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$rport/health")" = 200 ] && break
  sleep 0.05
done
curl -sf -X POST -H 'Content-Type: application/json' "http://127.0.0.1:$rport/v1/completions" \
  -d '{"model":"m","prompt":"the quick brown fox jumps over the lazy dog","max_tokens":16}' \
  > "$dir/check.json" || { echo "router_overhead: a completion through the router failed" >&2; exit 1; }
grep -q '"completion_tokens":16' "$dir/check.json" ||
  { echo "router_overhead: unexpected answer: $(cat "$dir/check.json")" >&2; exit 1; }

# ---- wrk runs: "req/s p50_us p99_us non2xx cpu_us" per run, cpu_us = the server process's
# CPU time (user + system, /proc/PID/stat) over the run divided by the requests wrk completed
# (the router's own share; its test workers are not counted); the median run by req/s is reported
to_us() { awk '{v=$1; if (v ~ /us$/) {sub(/us$/,"",v); print v} else if (v ~ /ms$/) {sub(/ms$/,"",v); print v*1000} else if (v ~ /s$/) {sub(/s$/,"",v); print v*1000000} else print v}'; }
hz=$(getconf CLK_TCK)
cpu_ticks() { sed 's/.*) //' "/proc/$1/stat" | awk '{print $12 + $13}'; }
one() { # one URL MAX_TOKENS CONNS PID [STREAM]
  local c0 c1 o
  c0=$(cpu_ticks "$4")
  o=$(MAX_TOKENS=$2 STREAM=${5:-false} "${pin_wrk[@]}" wrk -t1 -c"$3" -d"${secs}s" --latency -s "$lua" "$1")
  c1=$(cpu_ticks "$4")
  local rps p50 p99 bad n
  rps=$(awk '/^Requests\/sec:/{print $2}' <<< "$o")
  p50=$(awk '$1=="50%"{print $2}' <<< "$o" | to_us)
  p99=$(awk '$1=="99%"{print $2}' <<< "$o" | to_us)
  bad=$(awk '/Non-2xx/{print $NF}' <<< "$o"); bad=${bad:-0}
  n=$(awk '/requests in/{print $1}' <<< "$o")
  echo "$rps $p50 $p99 $bad $(awk -v a="$c0" -v b="$c1" -v hz="$hz" -v n="$n" 'BEGIN {printf "%.1f", (b - a) * 1e6 / hz / n}')"
}
median_run() { sort -g -k1 | awk '{a[NR]=$0} END {print a[int((NR+1)/2)]}'; }
declare -A R
cases="1:false 16:false 64:true" # max_tokens:stream
for conns in $conns_list; do
for cs in $cases; do
  mt=${cs%:*} st=${cs#*:}
  for target in bare router; do
    if [ $target = bare ]; then url=http://127.0.0.1:$echo_port/echo pid=$echo_pid
    else url=http://127.0.0.1:$rport/v1/completions pid=$router_pid; fi
    runs=""
    for _ in $(seq "$reps"); do runs+="$(one "$url" "$mt" "$conns" "$pid" "$st")"$'\n'; done
    R[$target,$cs,$conns]=$(printf '%s' "$runs" | median_run)
  done
done
done

printf "router overhead, wrk -t1 -c{%s} -d%ss --latency, keep-alive, median run (by req/s) of %d%s\n" \
  "$conns_list" "$secs" "$reps" "${pin_srv:+; servers on cpu 0, wrk on cpu 1}"
printf "load average: %s before, %s after (1/5/15 min)\n" "$load_before" "$(cut -d" " -f1-3 /proc/loadavg)"
printf "| conns | max_tokens | stream | target | req/s | p50 µs | p99 µs | non-2xx | server CPU µs/req |\n"
printf "|---|---|---|---|---|---|---|---|---|\n"
for conns in $conns_list; do
for cs in $cases; do
  mt=${cs%:*} st=${cs#*:}
  for target in bare router; do
    read -r rps p50 p99 bad cpu <<< "${R[$target,$cs,$conns]}"
    printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n" "$conns" "$mt" "$st" \
      "$([ $target = bare ] && echo 'duet-http-echo /echo' || echo 'duet-router /v1/completions')" \
      "$rps" "$p50" "$p99" "$bad" "$cpu"
  done
  read -r brps bp50 bp99 _ bcpu <<< "${R[bare,$cs,$conns]}"
  read -r rrps rp50 rp99 _ rcpu <<< "${R[router,$cs,$conns]}"
  awk -v c="$conns" -v mt="$mt" -v st="$st" -v a="$rp50" -v b="$bp50" -v e="$rp99" -v d="$bp99" \
    -v x="$rrps" -v y="$brps" -v rc="$rcpu" -v bc="$bcpu" \
    'BEGIN {printf "| %s | %s | %s | **router − bare** | %.0f%% of bare | **%+.0f** | %+.0f | | %+.1f |\n", c, mt, st, 100*x/y, a-b, e-d, rc-bc}'
done
# the router's CPU per request (max_tokens 1) and per streamed token (64 streamed against 1)
read -r _ _ _ _ c1 <<< "${R[router,1:false,$conns]}"
read -r _ _ _ _ c64 <<< "${R[router,64:true,$conns]}"
awk -v c="$conns" -v a="$c1" -v b="$c64" \
  'BEGIN {printf "c%s: router CPU %.1f µs per request (max_tokens 1), %.2f µs per streamed token ((64 streamed - 1) / 63)\n", c, a, (b - a) / 63}'
done
