#!/usr/bin/env bash
# Cross-check duet-bench against an established third-party client, NVIDIA aiperf (pinned), on
# the same server: same prompts (in the same order), concurrency, request count, max tokens and
# ignore_eos; streamed completions. Prints TTFT, TPOT and output throughput side by side with the
# relative difference. A manual tool: not part of CI.
#
#   bench/crosscheck.sh URL MODEL [CONCURRENCY] [NUM_PROMPTS] [MAX_TOKENS]
#   e.g. bench/crosscheck.sh http://127.0.0.1:8000 m 4 64 32
#
# Environment:
#   DUET_BENCH      the duet-bench binary (default: build/bench/duet-bench, then build-bench/...)
#   PROMPTS         JSONL prompts (default data/prompts/gsm8k-test.jsonl); the
#                   first NUM_PROMPTS "question"/"prompt"/"text" fields are used by both clients
#   PROMPT_CHARS    cut prompts to this many characters (default 400)
#   AIPERF_VERSION  default 0.13.0; installed with pip into $CACHE/venv-aiperf-$AIPERF_VERSION
#   CACHE           default ${XDG_CACHE_HOME:-$HOME/.cache}/duet-bench
#   AIPERF_TOKENIZER  a Hugging Face tokenizer name or local folder for aiperf (default: a
#                   byte-level tokenizer folder this script writes under $CACHE, 1 token a byte
#                   like the demo model's duet_tokenizer.json; no network needed)
#
# Token counting. aiperf wants a Hugging Face tokenizer (default: the model name, downloaded
# from huggingface.co) even when it counts tokens from usage. With no network to
# huggingface.co that cannot load, and its "builtin" tokenizer is not offline either (tiktoken
# fetches o200k_base from openaipublic.blob.core.windows.net). So the script writes a local
# byte-level tokenizer.json with the `tokenizers` package from aiperf's venv and runs aiperf
# with --use-server-token-count: output and prompt lengths come from the usage of the final
# chunk, exactly what duet-bench uses, so the tokenizer does not affect the compared numbers.
#
# Definitions compared: TTFT (both: send -> first content chunk); TPOT: duet-bench's mean
# (e2el - ttft) / (output_tokens - 1) against aiperf's "inter_token_latency" (the same
# per-request formula); output throughput: output tokens / benchmark duration in both. aiperf
# counts its duration from its first request to its last response, as duet-bench does.
set -euo pipefail

if [[ $# -lt 2 || "$1" == "-h" || "$1" == "--help" ]]; then
    sed -n '2,32p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
URL=$1
MODEL=$2
CONC=${3:-4}
NUM=${4:-64}
MAXTOK=${5:-32}

HERE=$(cd "$(dirname "$0")/.." && pwd)
PROMPTS=${PROMPTS:-$HERE/data/prompts/gsm8k-test.jsonl}
PROMPT_CHARS=${PROMPT_CHARS:-400}
AIPERF_VERSION=${AIPERF_VERSION:-0.13.0}
CACHE=${CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/duet-bench}
if [[ -z "${DUET_BENCH:-}" ]]; then
    for b in "$HERE/build/bench/duet-bench" "$HERE/build-bench/bench/duet-bench"; do
        [[ -x "$b" ]] && DUET_BENCH=$b && break
    done
fi
[[ -x "${DUET_BENCH:-}" ]] || { echo "crosscheck: no duet-bench binary (set DUET_BENCH)" >&2; exit 2; }
[[ -r "$PROMPTS" ]] || { echo "crosscheck: cannot read $PROMPTS" >&2; exit 2; }

VENV=$CACHE/venv-aiperf-$AIPERF_VERSION
if [[ ! -x "$VENV/bin/aiperf" ]]; then
    echo "crosscheck: installing aiperf==$AIPERF_VERSION into $VENV" >&2
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q "aiperf==$AIPERF_VERSION"
fi

# An offline byte-level Hugging Face tokenizer: 256 byte symbols, no merges, no network.
if [[ -z "${AIPERF_TOKENIZER:-}" ]]; then
    AIPERF_TOKENIZER=$CACHE/byte-tokenizer
    if [[ ! -f "$AIPERF_TOKENIZER/tokenizer.json" ]]; then
        mkdir -p "$AIPERF_TOKENIZER"
        "$VENV/bin/python" - "$AIPERF_TOKENIZER" <<'EOF'
import json, sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
vocab["<|bos|>"], vocab["<|eos|>"] = 256, 257
tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
tok.decoder = decoders.ByteLevel()
tok.save(sys.argv[1] + "/tokenizer.json")
json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>",
           "eos_token": "<|eos|>", "model_max_length": 1048576},
          open(sys.argv[1] + "/tokenizer_config.json", "w"))
EOF
    fi
fi

WORK=$(mktemp -d /tmp/duet-crosscheck-XXXXXX)
echo "crosscheck: work dir $WORK" >&2

# The same NUM prompts for both, as aiperf single_turn JSONL ({"text": ...}), which duet-bench
# reads too (its "text" field).
python3 - "$PROMPTS" "$NUM" "$PROMPT_CHARS" > "$WORK/prompts.jsonl" <<'EOF'
import json, sys
path, n, cut = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
src = [json.loads(l) for l in open(path, encoding="utf-8") if l.strip()]
for i in range(n):
    o = src[i % len(src)]
    t = next(o[k] for k in ("question", "prompt", "text") if isinstance(o.get(k), str))
    print(json.dumps({"text": t[:cut]}))
EOF

# The router's own latency histograms (duet_router_{ttft,tpot,e2e}_seconds), scraped around each
# client's run, are a third, server-side reference: a lower bound on what a client can measure.
scrape() { curl -s -m 10 "$URL/metrics" > "$WORK/$1.prom" || true; }

echo "crosscheck: duet-bench, concurrency $CONC, $NUM prompts, max_tokens $MAXTOK" >&2
scrape duet-before
"$DUET_BENCH" --url "$URL" --model "$MODEL" --concurrency "$CONC" --num-prompts "$NUM" \
    --max-tokens "$MAXTOK" --ignore-eos --prompts "$WORK/prompts.jsonl" --quiet \
    --json "$WORK/duet-bench.json" > "$WORK/duet-bench.txt"

scrape duet-after
echo "crosscheck: aiperf $AIPERF_VERSION, same load" >&2
scrape aiperf-before
"$VENV/bin/aiperf" profile --model "$MODEL" --url "$URL" --endpoint-type completions \
    --streaming --input-file "$WORK/prompts.jsonl" --custom-dataset-type single_turn \
    --dataset-sampling-strategy sequential --concurrency "$CONC" --request-count "$NUM" \
    --extra-inputs max_tokens:"$MAXTOK" --extra-inputs ignore_eos:true \
    --use-server-token-count --tokenizer "$AIPERF_TOKENIZER" \
    --output-artifact-dir "$WORK/aiperf" --ui-type none > "$WORK/aiperf.txt" 2>&1 || {
    echo "crosscheck: aiperf failed; its output:" >&2
    tail -40 "$WORK/aiperf.txt" >&2
    exit 1
}
scrape aiperf-after

python3 - "$WORK/duet-bench.json" "$WORK/aiperf" "$WORK" <<'EOF'
import glob, json, sys
d = json.load(open(sys.argv[1]))
def prom(path):
    v = {}
    try:
        for line in open(path):
            if not line.startswith("#") and " " in line:
                k, x = line.rsplit(" ", 1)
                v[k] = float(x)
    except (OSError, ValueError):
        pass
    return v
def router_mean_ms(who, name):
    b, a_ = prom(f"{sys.argv[3]}/{who}-before.prom"), prom(f"{sys.argv[3]}/{who}-after.prom")
    s, c = f"duet_router_{name}_seconds_sum", f"duet_router_{name}_seconds_count"
    if s not in a_ or c not in a_ or a_[c] - b.get(c, 0) <= 0:
        return None
    return 1000 * (a_[s] - b.get(s, 0)) / (a_[c] - b.get(c, 0))
files = glob.glob(sys.argv[2] + "/**/profile_export_aiperf.json", recursive=True)
if not files:
    sys.exit("crosscheck: no profile_export_aiperf.json under " + sys.argv[2])
a = json.load(open(files[0]))
def am(name):
    m = a.get(name) or a.get("records", {}).get(name) or {}
    return m.get("avg"), m.get("unit", "")
rows = [
    ("TTFT mean (ms)", d["mean_ttft_ms"], am("time_to_first_token")),
    ("TTFT median (ms)", d["median_ttft_ms"], (a.get("time_to_first_token", {}).get("p50"), "")),
    ("TPOT mean (ms)", d["mean_tpot_ms"], am("inter_token_latency")),
    ("output throughput (tok/s)", d["output_throughput"], am("output_token_throughput")),
    ("request throughput (req/s)", d["request_throughput"], am("request_throughput")),
    ("E2E latency mean (ms)", d["mean_e2el_ms"], am("request_latency")),
    ("output tokens / request", d["total_output_tokens"] / max(d["completed"], 1),
     am("output_sequence_length")),
]
print(f"{'metric':30s} {'duet-bench':>12s} {'aiperf':>12s} {'rel diff':>9s}")
for name, ours, (theirs, unit) in rows:
    if ours is None or theirs is None:
        print(f"{name:30s} {str(ours):>12s} {str(theirs):>12s} {'n/a':>9s}")
        continue
    rel = (ours - theirs) / theirs if theirs else float("nan")
    print(f"{name:30s} {ours:12.3f} {theirs:12.3f} {rel:+9.1%}")
for name, key in (("router-side TTFT mean (ms)", "ttft"), ("router-side TPOT mean (ms)", "tpot"),
                  ("router-side E2E mean (ms)", "e2e")):
    ours, theirs = router_mean_ms("duet", key), router_mean_ms("aiperf", key)
    if ours is not None and theirs is not None:
        print(f"{name:30s} {ours:12.3f} {theirs:12.3f}   (server's view of each run)")
print(f"completed/failed: duet-bench {d['completed']}/{d['failed']}, aiperf "
      f"{a.get('request_count', {}).get('avg')}/{a.get('error_request_count', {}).get('avg', 0)}")
EOF
