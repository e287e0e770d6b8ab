#!/bin/bash
# Loopback against network namespaces, same run: the same 3-process cluster (duet-router,
# duet-ctx, duet-gen; demo model, CPU, one thread each, UCX over tcp) once with every process on
# loopback (ucx.net_devices=lo) and once with each process in its own network namespace joined by
# veths through a bridge (ucx.net_devices=<its veth>), so every router message and KV transfer
# crosses a real interface. duet-bench sends long prompts (prefilled by duet-ctx, the KV moved
# to duet-gen: TTFT holds the transfer) and reports TTFT / TPOT.
# Then, in the same run and namespaces, the KV transfer itself: duet-bench-xfer --transport tcp
# (bandwidth of 1..256 MiB transfers, one-page latency) once on loopback and once with its sender
# in the context worker's namespace and its receiver in the generation worker's, on their veths;
# ROUNDS rounds, loopback and namespaces alternating so that a busy moment of the machine hits
# both: bandwidth = the best over the rounds (each already the best of its runs), latency p50 =
# the median of the rounds' p50s; the ratio netns / loopback of each. Each namespace run's veth
# counters must have moved by at least the KV bytes put (else the script fails: the bytes did not
# cross the veth). The cluster's own per-transfer time is not reported: a transfer starts with
# the prefill and puts each layer as it is computed, so its time is the prefill's, not the link's.
# Needs root and iproute2 (ip netns).
# Usage: bench/netns_bench.sh [BUILD_DIR] [PROMPTS] [WORDS] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
nprompts=${2:-12}
words=${3:-600}
rounds=${4:-5}
[ "$(id -u)" = 0 ] || { echo "netns_bench: needs root (ip netns)" >&2; exit 1; }
for b in router/duet-router ctx_worker/duet-ctx gen_worker/duet-gen bench/duet-bench \
  bench/duet-bench-xfer; do
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

# $1 mode (lo | netns): start, bench, stop; prints "ttft_ms tpot_ms completed" (medians)
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
  "${pre_c[@]}" "$build/ctx_worker/duet-ctx" "${common[@]}" --ucx.net_devices "$dev_c" \
    --name ctx-0 > "$dir/ctx-$mode.log" 2>&1 &
  pids+=($!)
  "${pre_g[@]}" "$build/gen_worker/duet-gen" "${common[@]}" --ucx.net_devices "$dev_g" \
    --name gen-0 > "$dir/gen-$mode.log" 2>&1 &
  pids+=($!)
  local _
  for _ in $(seq 300); do
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
  jq -r '[.ttft_ms.median, .tpot_ms.median, .completed] | @tsv' "$dir/$mode.json"
}

# $1 mode (lo | netns), $2 round: duet-bench-xfer --transport tcp into $dir/xfer-$mode-$2.txt;
# in netns the sender in duet-ctx's namespace, the receiver in duet-gen's, on their veths. Fails
# unless the sender's device sent at least the KV bytes put.
run_xfer() {
  local mode=$1 out=$dir/xfer-$1-$2.txt place=() dev=lo
  if [ "$mode" = netns ]; then
    place=(--netns "dnb$id-b,dnb$id-c" --net-devices "dnb${id}nb,dnb${id}nc") dev=dnb${id}nb
  fi
  env -u UCX_NET_DEVICES -u UCX_TLS "$build/bench/duet-bench-xfer" --transport tcp "${place[@]}" \
    > "$out" 2>&1 || { cat "$out" >&2; exit 1; }
  local put sent
  put=$(sed -n 's/^kv bytes put: \([0-9]*\)$/\1/p' "$out")
  sent=$(sed -n "s/^sender dev $dev: tx_bytes +\\([0-9]*\\) .*/\\1/p" "$out")
  [ -n "$put" ] && [ -n "$sent" ] && [ "$sent" -ge "$put" ] ||
    { cat "$out" >&2; echo "netns_bench: $dev sent '$sent' bytes, fewer than the '$put' put" >&2; exit 1; }
  printf '%s\t%s\n' "$put" "$sent"
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

for _ in $(seq 50); do # a veth's carrier comes a moment after both ends are up
  up=0
  for l in a b c; do
    [ "$(ip netns exec "dnb$id-$l" cat "/sys/class/net/dnb${id}n$l/operstate")" = up ] && up=$((up + 1))
  done
  [ $up = 3 ] && break
  sleep 0.1
done

echo "netns_bench: $(git rev-parse --short HEAD) $(date -u '+%F %H:%M UTC') $(nproc) cores," \
  "load $(cut -d' ' -f1-3 /proc/loadavg); $nprompts prompts of $words words, 16 tokens each"
read -r lo_ttft lo_tpot lo_n < <(run_mode lo)
read -r ns_ttft ns_tpot ns_n < <(run_mode netns)
printf '%-8s %10s %10s %5s\n' mode ttft_ms tpot_ms "done"
printf '%-8s %10.2f %10.2f %5s\n' loopback "$lo_ttft" "$lo_tpot" "$lo_n" \
  netns "$ns_ttft" "$ns_tpot" "$ns_n"
awk -v a="$lo_ttft" -v b="$ns_ttft" -v c="$lo_tpot" -v d="$ns_tpot" \
  'BEGIN { printf "netns / loopback: TTFT %.3f, TPOT %.3f\n", b / a, d / c }'

echo
echo "KV transfer: duet-bench-xfer --transport tcp, $rounds rounds (loopback, namespaces" \
  "alternating), load $(cut -d' ' -f1-3 /proc/loadavg) before; MTU lo" \
  "$(cat /sys/class/net/lo/mtu), veth $(ip netns exec "dnb$id-b" cat "/sys/class/net/dnb${id}nb/mtu")"
for r in $(seq "$rounds"); do
  for mode in lo netns; do
    read -r put sent < <(run_xfer "$mode" "$r")
    [ "$mode" = netns ] && echo "round $r: netns: $put KV bytes put, dnb${id}nb (ctx's veth) sent $sent"
  done
done
# the rows of every round's output, tagged: "bw MODE MIB GBPS" and "lat MODE WHAT P50"
for f in "$dir"/xfer-*.txt; do
  mode=$(basename "$f" .txt | cut -d- -f2)
  awk -v m="$mode" '$2 == "MiB" && $1 ~ /^[0-9]+$/ { print "bw", m, $1, $5 }
    /^1 page, 7 layers/ { print "lat", m, "1008KiB", $(NF - 1) }
    /^1 page, 1 layer/ { print "lat", m, "9KiB", $(NF - 1) }' "$f"
done > "$dir/rows.txt"
awk '
  $1 == "bw" { k = $3 SUBSEP $2; if (!(k in bw) || $4 > bw[k]) bw[k] = $4; sizes[$3] = 1 }
  $1 == "lat" { n = ++cnt[$3, $2]; lat[$3, $2, n] = $4; whats[$3] = 1 }
  function median(w, m,   n, i, j, t, v) {
    n = cnt[w, m]
    for (i = 1; i <= n; i++) v[i] = lat[w, m, i]
    for (i = 2; i <= n; i++) for (j = i; j > 1 && v[j - 1] > v[j]; j--) { t = v[j]; v[j] = v[j - 1]; v[j - 1] = t }
    return n % 2 ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2
  }
  END {
    printf "%-22s %12s %12s %10s\n", "bandwidth (best)", "lo GB/s", "netns GB/s", "netns/lo"
    for (s = 1; s <= 256; s *= 4)
      if (s in sizes)
        printf "%-22s %12.2f %12.2f %10.3f\n", s " MiB", bw[s, "lo"], bw[s, "netns"], bw[s, "netns"] / bw[s, "lo"]
    printf "%-22s %12s %12s %10s\n", "latency p50 (median)", "lo us", "netns us", "netns/lo"
    split("1008KiB 9KiB", ws, " ")
    for (i = 1; i <= 2; i++) {
      a = median(ws[i], "lo"); b = median(ws[i], "netns")
      printf "%-22s %12.1f %12.1f %10.3f\n", "1 page, " ws[i], a, b, b / a
    }
  }' "$dir/rows.txt"
