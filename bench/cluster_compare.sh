#!/usr/bin/env bash
# Disaggregated (1 duet-ctx + 1 duet-gen, one thread each: deploy/configs/bench-disagg.yaml)
# against one co-located duet-gen that prefills everything itself (two threads:
# deploy/configs/bench-colocated.yaml), at the same load, one after the other in one run:
# duet-bench closed loop at each concurrency, gsm8k prompts, fixed output length (ignore_eos).
#
#   bench/cluster_compare.sh [CONCURRENCIES] [MAX_TOKENS]     e.g. bench/cluster_compare.sh "1 8" 64
#
# Prints one row per (setup, concurrency); JSON results stay in $OUT (default a temp dir).
set -euo pipefail
cd "$(dirname "$0")/.."
CONCS=${1:-1 8}
MAXTOK=${2:-64}
PROMPTS=${PROMPTS:-data/prompts/gsm8k-test.jsonl}
OUT=${OUT:-$(mktemp -d /tmp/duet-compare-XXXXXX)}
mkdir -p "$OUT"
BUILD=${BUILD:-build}
B=$BUILD/bench/duet-bench
for setup in disagg colocated; do
    cfg=deploy/configs/bench-$setup.yaml
    port=$([[ $setup == disagg ]] && echo 8200 || echo 8300)
    "$BUILD"/deploy/launcher/duet up "$cfg" --no-sample --log-dir "$OUT/logs-$setup" \
        > "$OUT/up-$setup.txt" 2>&1 &
    up=$!
    for _ in $(seq 100); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
        sleep 0.3
    done
    for c in $CONCS; do
        n=$(( c * 8 < 16 ? 16 : c * 8 ))
        "$B" --url "http://127.0.0.1:$port" --concurrency "$c" --num-prompts "$n" \
            --max-tokens "$MAXTOK" --ignore-eos --prompts "$PROMPTS" --quiet \
            --json "$OUT/$setup-c$c.json" > /dev/null
    done
    kill -INT "$up"
    wait "$up" || true
done
python3 - "$OUT" $CONCS <<'PY'
import json, sys
out, concs = sys.argv[1], sys.argv[2:]
keys = [("output_throughput", "out tok/s"), ("request_throughput", "req/s"),
        ("mean_ttft_ms", "TTFT mean ms"), ("p99_ttft_ms", "TTFT p99 ms"),
        ("mean_tpot_ms", "TPOT mean ms"), ("mean_e2el_ms", "E2E mean ms"),
        ("device_step_time_ms", "step ms"), ("error_rate", "errors")]
print("| setup | conc | " + " | ".join(k[1] for k in keys) + " |")
print("|---|---|" + "---|" * len(keys))
for c in concs:
    for s in ("disagg", "colocated"):
        d = json.load(open(f"{out}/{s}-c{c}.json"))
        cells = ["%.2f" % d[k] if isinstance(d.get(k), (int, float)) else "-" for k, _ in keys]
        print(f"| {s} | {c} | " + " | ".join(cells) + " |")
PY
echo "results: $OUT" >&2
