#!/bin/bash
# Loopback against network namespaces, same run: the same 3-process cluster (duet-router,
# duet-ctx, duet-gen; demo model, CPU, one thread each, UCX over tcp) once with every process on
# loopback (ucx.net_devices=lo) and once with each process in its own network namespace joined by
# veths through a bridge (ucx.net_devices=<its veth>), so every router message and KV transfer
# crosses a real interface. duet-bench sends long prompts (prefilled by duet-ctx, the KV moved
# to duet-gen: TTFT holds the transfer) and reports TTFT / TPOT; the KV transfer rate is each
# transfer's bytes over its time as the sender logs it (duet-ctx at debug: "xfer ... send: DONE (B
# bytes, T ms)", from the first put to the receiver's XferDone), median over the run's transfers;
# the script prints the ratios.
# Needs root and iproute2 (ip netns). Usage: bench/netns_bench.sh [BUILD_DIR] [PROMPTS] [WORDS]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
nprompts=${2:-12}
words=${3:-600}
[ "$(id -u)" = 0 ] || { echo "netns_bench: needs root (ip netns)" >&2; exit 1; }
for b in router/duet-router ctx_worker/duet-ctx gen_worker/duet-gen bench/duet-bench; do
  [ -x "$build/$b" ] || { echo "netns_bench: $build/$b missing" >&2; exit 1; }
done
id=$$ net=10.214.$(($$ % 250)) hp=$((20000 + $$ % 20000))
dir=$(mktemp -d /tmp/duet-netns-bench-XXXXXX)
pids=()
stop_all() {
  local p
  for p in "${pids[@]}"; do kill -TERM "$p" 2> /dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2> /dev/null || true; done
  pids=()
}
cleanup() {
  stop_all
  for l in a b c; do ip netns del "dnb$id-$l" 2> /dev/null || true; done
  ip link del "dnb${id}b" 2> /dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT

# $1 mode (lo | netns): start, bench, stop; prints "ttft_ms tpot_ms" medians
run_mode() {
  local mode=$1 rip=127.0.0.1 pre_r=() pre_c=() pre_g=() dev_c=lo dev_g=lo
  if [ "$mode" = netns ]; then
    rip=$net.1 pre_r=(ip netns exec "dnb$id-a") pre_c=(ip netns exec "dnb$id-b")
    pre_g=(ip netns exec "dnb$id-c") dev_c=dnb${id}nb dev_g=dnb${id}nc
  fi
  local common=(--model models/duet-demo --threads 1 --dtype f32 --device cpu --heartbeat_ms 100
    --ucx.tls tcp --router "$rip:$((hp + 1))" --batch.prefill_chunk 512 --batch.max_tokens 1024)
  "${pre_r[@]}" "$build/router/duet-router" --model models/duet-demo --http.host "$rip" \
    --http.port "$hp" --workers.host "$rip" --workers.port $((hp + 1)) --admin.host "$rip" \
    --admin.port $((hp + 2)) --admin.insecure-no-token --placement.local_prefill_tokens 32 \
    > "$dir/router-$mode.log" 2>&1 &
  pids+=($!)
  DUET_LOG_LEVEL=debug "${pre_c[@]}" "$build/ctx_worker/duet-ctx" "${common[@]}" \
    --ucx.net_devices "$dev_c" \
    --name ctx-0 > "$dir/ctx-$mode.log" 2>&1 &
  pids+=($!)
  "${pre_g[@]}" "$build/gen_worker/duet-gen" "${common[@]}" --ucx.net_devices "$dev_g" \
    --name gen-0 > "$dir/gen-$mode.log" 2>&1 &
  pids+=($!)
  local k
  for k in $(seq 300); do
    if "${pre_r[@]}" curl -sf "http://$rip:$hp/health" 2> /dev/null | grep -q '"gen_workers":1'; then
      break
    fi
    sleep 0.1
  done
  "$build/bench/duet-bench" --url "http://$rip:$hp" --random-prompt-len "$words" \
    --max-tokens 16 --ignore-eos --concurrency 1 --num-prompts "$nprompts" --quiet \
    --metrics-settle-ms 0 --json "$dir/$mode.json" > "$dir/bench-$mode.txt" 2>&1 ||
    { cat "$dir/bench-$mode.txt" "$dir"/*-"$mode".log >&2; exit 1; }
  stop_all
  local rate
  rate=$(sed -nE 's/.* send: DONE \(([0-9]+) bytes, ([0-9.]+) ms\).*/\1 \2/p' "$dir/ctx-$mode.log" |
    awk '$2 > 0 { print $1 / ($2 * 1000) }' | sort -g |
    awk '{ v[NR] = $1 } END { if (NR == 0) print "nan"; else print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }')
  printf '%s\t%s\n' "$(jq -r '[.ttft_ms.median, .tpot_ms.median, .completed] | @tsv' "$dir/$mode.json")" "$rate"
}

ip link add "dnb${id}b" type bridge
ip addr add "$net.254/24" dev "dnb${id}b"
ip link set "dnb${id}b" up
i=1
for l in a b c; do
  ip netns add "dnb$id-$l"
  ip link add "dnb${id}h$l" type veth peer name "dnb${id}n$l"
  ip link set "dnb${id}n$l" netns "dnb$id-$l"
  ip link set "dnb${id}h$l" master "dnb${id}b" up
  ip -n "dnb$id-$l" addr add "$net.$i/24" dev "dnb${id}n$l"
  ip -n "dnb$id-$l" link set "dnb${id}n$l" up
  ip -n "dnb$id-$l" link set lo up
  i=$((i + 1))
done

echo "netns_bench: $(git rev-parse --short HEAD) $(date -u '+%F %H:%M UTC') $(nproc) cores," \
  "load $(cut -d' ' -f1-3 /proc/loadavg); $nprompts prompts of $words words, 16 tokens each"
read -r lo_ttft lo_tpot lo_n lo_rate < <(run_mode lo)
read -r ns_ttft ns_tpot ns_n ns_rate < <(run_mode netns)
printf '%-8s %10s %10s %5s %12s\n' mode ttft_ms tpot_ms done kv_MB_per_s
printf '%-8s %10.2f %10.2f %5s %12.1f\n' loopback "$lo_ttft" "$lo_tpot" "$lo_n" "$lo_rate" \
  netns "$ns_ttft" "$ns_tpot" "$ns_n" "$ns_rate"
awk -v a="$lo_ttft" -v b="$ns_ttft" -v c="$lo_tpot" -v d="$ns_tpot" -v e="$lo_rate" -v f="$ns_rate" \
  'BEGIN { printf "netns / loopback: TTFT %.3f, TPOT %.3f, KV transfer rate %.3f\n", b / a, d / c, f / e }'
