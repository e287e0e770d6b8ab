#!/usr/bin/env bash
# Speculative decoding through the local cluster (router + 1 duet-ctx + 1 duet-gen, one thread
# each, deploy/configs/local-spec.yaml), side by side in one run: spec.method none, ngram and
# draft at each k, duet-bench closed loop at each concurrency, greedy, fixed output length
# (ignore_eos), on the GSM8K prompts and on a repetitive text (the passage bench/spec_compare.sh
# uses, four times over).
#
#   bench/spec_cluster.sh [CONCURRENCIES] [MAX_TOKENS]       e.g. bench/spec_cluster.sh "1 4" 128
#
# Environment: DRAFT (models/duet-demo-draft; the draft rows are skipped, saying so, when it is
# absent), KS ("2 4 7"), N_PROMPTS (8 per concurrency level, at least the concurrency),
# BUILD (build), OUT (configs, logs and duet-bench's --json files; default a temp dir).
#
# Prints a markdown table per workload: output tokens/s, mean TPOT, tokens per decode step and
# request (duet-bench's avg_decoded_tokens_per_iter), acceptance over all draft positions, and
# the speedup of output tokens/s over none at the same concurrency.
set -euo pipefail
cd "$(dirname "$0")/.."
CONCS=${1:-1 4}
MAXTOK=${2:-128}
DRAFT=${DRAFT:-models/duet-demo-draft}
KS=${KS:-2 4 7}
N_PROMPTS=${N_PROMPTS:-8}
BUILD=${BUILD:-build}
OUT=${OUT:-$(mktemp -d /tmp/duet-spec-cluster-XXXXXX)}
mkdir -p "$OUT"
B=$BUILD/bench/duet-bench
UP=$BUILD/deploy/launcher/duet
for bin in "$B" "$UP" "$BUILD/gen_worker/duet-gen"; do
    [ -x "$bin" ] || { echo "spec_cluster: build first (cmake --build $BUILD)" >&2; exit 1; }
done

configs=("none 0")
for k in $KS; do configs+=("ngram $k"); done
if [ -d "$DRAFT" ]; then
    for k in $KS; do configs+=("draft $k"); done
else
    echo "spec_cluster: no draft model at $DRAFT (set DRAFT=DIR): the draft rows are skipped" >&2
fi

# the workloads as duet-bench --prompts files
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
with open("data/prompts/gsm8k-test.jsonl") as f, open(out + "/gsm8k.jsonl", "w") as g:
    for line in f:
        g.write(json.dumps({"prompt": json.loads(line)["question"]}) + "\n")
text = open("data/corpus/web-plain.txt", "rb").read()[-4000:].decode("utf-8", "ignore")
start = text.index(". ") + 2
passage = text[start:start + 240].rsplit(" ", 1)[0] + " "
with open(out + "/repetitive.jsonl", "w") as g:
    g.write(json.dumps({"prompt": passage * 4}) + "\n")
PY

port=8400
for cfg in "${configs[@]}"; do
    read -r method k <<< "$cfg"
    name=$method${k/#0/}
    yaml=$OUT/$name.yaml
    # local-spec.yaml with this method, its k and (draft only) the draft model; our own ports
    python3 - "$yaml" "$method" "$k" "$DRAFT" "$port" <<'PY'
import re, sys
yaml, method, k, draft, port = sys.argv[1:6]
s = open("deploy/configs/local-spec.yaml").read()
# the keys' own lines (the comments mention them too)
s = re.sub(r"^(\s+)method: \w+", rf"\g<1>method: {method}", s, count=1, flags=re.M)
s = re.sub(r"^(\s+)k: \d+", rf"\g<1>k: {k if method != 'none' else 4}", s, count=1, flags=re.M)
s = re.sub(r"^(\s+)draft_model: \S+", rf"\g<1>draft_model: {draft}" if method == "draft" else "",
           s, count=1, flags=re.M)
s = s.replace("port: 8000", f"port: {port}").replace("port: 8100", f"port: {int(port) + 1}")
open(yaml, "w").write(s)
PY
    "$UP" up "$yaml" --no-sample --log-dir "$OUT/logs-$name" > "$OUT/up-$name.txt" 2>&1 &
    up=$!
    for _ in $(seq 200); do
        curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
        sleep 0.3
    done
    for work in gsm8k repetitive; do
        for c in $CONCS; do
            n=$(( N_PROMPTS > c ? N_PROMPTS : c ))
            "$B" --url "http://127.0.0.1:$port" --concurrency "$c" --num-prompts "$n" \
                --max-tokens "$MAXTOK" --ignore-eos --prompts "$OUT/$work.jsonl" --quiet \
                --json "$OUT/$work-$name-c$c.json" > /dev/null
        done
    done
    kill -INT "$up"
    wait "$up" || true
done

python3 - "$OUT" "$MAXTOK" "$CONCS" "${configs[@]}" <<'PY'
import json, sys
out, maxtok, concs, cfgs = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4:]
for work in ("gsm8k", "repetitive"):
    print(f"\n{work}: {maxtok} tokens per request, greedy, ignore_eos\n")
    print("| method | k | conc | out tok/s | TPOT ms | tokens/step | acceptance | speedup | errors |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in concs:
        base = None
        for cfg in cfgs:
            method, k = cfg.split()
            name = method + ("" if k == "0" else k)
            d = json.load(open(f"{out}/{work}-{name}-c{c}.json"))
            tps = d.get("output_throughput") or 0.0
            if method == "none":
                base = tps
            acc = d.get("spec_acceptance_rate")
            per = d.get("avg_decoded_tokens_per_iter")
            print(f"| {method} | {k if method != 'none' else '-'} | {c} | {tps:.1f} | "
                  f"{d.get('mean_tpot_ms') or 0:.2f} | {per if per is None else f'{per:.2f}'} | "
                  f"{'-' if acc is None else f'{acc:.3f}'} | "
                  f"{tps / base if base else 0:.2f}x | {d.get('error_rate', 0)} |")
PY
echo "results: $OUT" >&2
