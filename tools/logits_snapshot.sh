#!/bin/bash
# Snapshot of what duet-generate computes on the CPU for every golden fixture and the demo model:
# the prompt logits (--dump-logits, float32 [prompt_len, vocab]) and 32 greedy tokens, at a few
# prefill chunk sizes and thread counts. Run it before and after a refactor that must not change
# a single output, then compare the two folders byte for byte:
#
#   tools/logits_snapshot.sh build /tmp/before      (at the old commit's build)
#   tools/logits_snapshot.sh build /tmp/after       (at the new one's)
#   diff -r /tmp/before /tmp/after && echo identical
#
# Usage: tools/logits_snapshot.sh BUILD_DIR OUT_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
gen=${1:?usage: tools/logits_snapshot.sh BUILD_DIR OUT_DIR}/engine/duet-generate
out=${2:?usage: tools/logits_snapshot.sh BUILD_DIR OUT_DIR}
[ -x "$gen" ] || { echo "logits_snapshot: $gen not built" >&2; exit 1; }
mkdir -p "$out"
n=0
for dir in tests/fixtures/*/ models/duet-demo/; do
  dir=${dir%/}
  name=$(basename "$dir")
  if [ -f "$dir/golden.json" ]; then
    ids=$(python3 -c 'import json,sys; print(",".join(map(str, json.load(open(sys.argv[1]))["prompt_ids"])))' "$dir/golden.json")
  else  # the demo model: a text prompt through its tokenizer
    ids=$(python3 -c 'print(",".join(str(b) for b in [256] + list(b"The LORD said unto Moses, ")))')
  fi
  for chunk in 512 7; do
    for th in 1 2; do
      tag=$name.c$chunk.t$th
      DUET_LOG_LEVEL=error "$gen" --model "$dir" --tokens "$ids" --max-tokens 32 --device cpu \
        --threads "$th" --prefill-chunk "$chunk" --dump-logits "$out/$tag.logits" --json \
        > "$out/$tag.json"
      # keep the outputs, not the timings
      python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["tokens"], d["finish_reason"])' \
        "$out/$tag.json" > "$out/$tag.tokens" && rm "$out/$tag.json"
      n=$((n + 1))
    done
  done
done
echo "logits_snapshot: $n runs in $out"
