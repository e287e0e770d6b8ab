#!/usr/bin/env bash
# Speculative decoding against plain decoding in duet-generate (single process, greedy, fixed
# output length), side by side in one run: --spec.method none, ngram and draft at each k, on the
# GSM8K prompts and on a repetitive text. Each prompt runs every configuration in turn before the
# next prompt, so that load drifting on a shared machine touches them all alike.
#
#   bench/spec_compare.sh [N_PROMPTS] [NEW_TOKENS]        e.g. bench/spec_compare.sh 8 128
#
# Environment: MODEL (models/duet-demo), DRAFT (models/duet-demo-draft; the draft rows are
# skipped, saying so, when the folder is absent), THREADS (1), KS ("2 4 7"), BUILD (build),
# DEVICE (cpu; cuda runs target and drafter on the GPU), OUT (the --json lines are kept there;
# default a temp dir).
#
# Prints a markdown table per workload: decode tokens/s (decoded tokens after the first over the
# decode time, summed over the prompts), tokens per step ((tokens - 1) / steps: the first token
# comes from the prefill), acceptance (accepted_tokens / draft_tokens), speedup over none, and
# whether every prompt's tokens equal none's (greedy speculation must be exact).
set -euo pipefail
cd "$(dirname "$0")/.."
N_PROMPTS=${1:-8}
NEW=${2:-128}
MODEL=${MODEL:-models/duet-demo}
DRAFT=${DRAFT:-models/duet-demo-draft}
THREADS=${THREADS:-1}
KS=${KS:-2 4 7}
BUILD=${BUILD:-build}
DEVICE=${DEVICE:-cpu}
OUT=${OUT:-$(mktemp -d /tmp/duet-spec-compare-XXXXXX)}
mkdir -p "$OUT"
bin=$BUILD/engine/duet-generate
[ -x "$bin" ] || { echo "spec_compare: build first (cmake --build $BUILD --target duet-generate)" >&2; exit 1; }

configs=("none 0")
for k in $KS; do configs+=("ngram $k"); done
if [ -d "$DRAFT" ]; then
    for k in $KS; do configs+=("draft $k"); done
else
    echo "spec_compare: no draft model at $DRAFT (set DRAFT=DIR): the draft rows are skipped" >&2
fi

# The workloads' prompts, one per line as JSON strings: the first N_PROMPTS GSM8K questions, and
# a repetitive text (a held-out passage of the demo model's corpus, four times over).
python3 - "$N_PROMPTS" "$OUT" <<'PY'
import json, sys
n, out = int(sys.argv[1]), sys.argv[2]
with open("data/prompts/gsm8k-test.jsonl") as f, open(out + "/gsm8k.prompts", "w") as g:
    for line, _ in zip(f, range(n)):
        g.write(json.dumps(json.loads(line)["question"]) + "\n")
text = open("data/corpus/web-plain.txt", "rb").read()[-4000:].decode("utf-8", "ignore")
start = text.index(". ") + 2
passage = text[start:start + 240].rsplit(" ", 1)[0] + " "
with open(out + "/repetitive.prompts", "w") as g:
    g.write(json.dumps(passage * 4) + "\n")
PY

for work in gsm8k repetitive; do
    : > "$OUT/$work.jsonl"
    i=0
    while IFS= read -r line; do
        prompt=$(printf '%s' "$line" | python3 -c 'import json,sys; print(json.load(sys.stdin), end="")')
        for cfg in "${configs[@]}"; do
            read -r method k <<< "$cfg"
            args=(--model "$MODEL" --prompt "$prompt" --max-tokens "$NEW" --ignore-eos --json
                  --threads "$THREADS" --device "$DEVICE" --spec.method "$method")
            [ "$method" = none ] || args+=(--spec.k "$k")
            [ "$method" = draft ] && args+=(--spec.draft_model "$DRAFT")
            res=$(DUET_LOG_LEVEL=error "$bin" "${args[@]}")
            printf '{"work":"%s","prompt":%d,"method":"%s","k":%d,"r":%s}\n' \
                "$work" "$i" "$method" "$k" "$res" >> "$OUT/$work.jsonl"
        done
        i=$((i + 1))
    done < "$OUT/$work.prompts"
done

python3 - "$OUT" "$MODEL" "$THREADS" "$NEW" "$DEVICE" <<'PY'
import json, sys
out, model, threads, new, device = sys.argv[1:6]
for work in ("gsm8k", "repetitive"):
    runs = [json.loads(l) for l in open(f"{out}/{work}.jsonl")]
    n_prompts = len({r["prompt"] for r in runs})
    ref = {r["prompt"]: r["r"]["tokens"] for r in runs if r["method"] == "none"}
    rows, order = {}, []
    for r in runs:
        key = (r["method"], r["k"])
        if key not in rows:
            rows[key] = {"tok": 0, "sec": 0.0, "steps": 0, "draft": 0, "acc": 0, "same": True}
            order.append(key)
        a, j = rows[key], r["r"]
        dec = len(j["tokens"]) - 1
        a["tok"] += dec
        a["sec"] += dec / j["decode_tokens_per_s"] if j["decode_tokens_per_s"] > 0 else 0.0
        a["steps"] += j["steps"]
        a["draft"] += j["draft_tokens"]
        a["acc"] += j["accepted_tokens"]
        a["same"] &= j["tokens"] == ref[r["prompt"]]
    base = rows[("none", 0)]
    base_tps = base["tok"] / base["sec"]
    print(f"\n### {work}: {n_prompts} prompt(s), {new} new tokens each, {model}, "
          f"{threads} thread(s), --device {device}, greedy\n")
    print("| method | k | decode tok/s | tokens/step | acceptance | speedup | tokens = none's |")
    print("|---|---|---|---|---|---|---|")
    for key in order:
        a = rows[key]
        tps = a["tok"] / a["sec"] if a["sec"] > 0 else 0.0
        tpstep = a["tok"] / a["steps"] if a["steps"] else 0.0
        acc = f"{100.0 * a['acc'] / a['draft']:.1f} %" if a["draft"] else "-"
        print(f"| {key[0]} | {key[1] if key[0] != 'none' else '-'} | {tps:.1f} | {tpstep:.2f} | "
              f"{acc} | {tps / base_tps:.2f}x | {'yes' if a['same'] else 'NO'} |")
print(f"\n(--json lines in {out})")
PY
