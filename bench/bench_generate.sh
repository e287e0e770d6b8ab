#!/bin/bash
# duet-generate throughput on this machine: prefill and decode tokens/s of one model, with 1
# thread and with all cores, each the median of REPS runs, measured in one invocation.
# Usage: bench/bench_generate.sh [MODEL_DIR] [PROMPT_TOKENS] [NEW_TOKENS] [REPS]
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-models/duet-demo}
n_prompt=${2:-512}
n_new=${3:-128}
reps=${4:-3}
bin=build/engine/duet-generate
[ -x "$bin" ] || { echo "bench_generate: build first (cmake --build build)" >&2; exit 1; }
# A prompt of n_prompt byte tokens from the held-out tail of the demo model's corpus.
tokens=$(python3 - "$n_prompt" <<'PY'
import sys
n = int(sys.argv[1])
data = open("data/corpus/web-plain.txt", "rb").read()[-20000:]
data = (data * (n // max(len(data), 1) + 1))[:n]
print(",".join(str(b) for b in data))
PY
)
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
printf "model %s, prompt %d tokens, %d new tokens, median of %d runs\n" "$model" "$n_prompt" "$n_new" "$reps"
printf "%-8s %16s %16s\n" threads "prefill tok/s" "decode tok/s"
for th in 1 "$(nproc)"; do
  pre=(); dec=()
  for _ in $(seq "$reps"); do
    out=$(DUET_LOG_LEVEL=error "$bin" --model "$model" --tokens "$tokens" --max-tokens "$n_new" \
          --ignore-eos --json --threads "$th")
    pre+=("$(echo "$out" | python3 -c 'import json,sys; print(json.load(sys.stdin)["prefill_tokens_per_s"])')")
    dec+=("$(echo "$out" | python3 -c 'import json,sys; print(json.load(sys.stdin)["decode_tokens_per_s"])')")
  done
  printf "%-8s %16.1f %16.1f\n" "$th" "$(printf '%s\n' "${pre[@]}" | median)" "$(printf '%s\n' "${dec[@]}" | median)"
done
