#!/usr/bin/env python3
"""Acceptance of speculative decoding as duet itself measures it: duet-generate on GSM8K questions.

  python tools/spec_acceptance.py --model models/duet-demo --draft models/duet-demo-draft \\
      --readme models/duet-demo-draft/README.md

For each of the first --prompts questions of data/prompts/gsm8k-test.jsonl (the question text as the
prompt; a byte-level model folder prepends <|bos|> itself), runs `duet-generate --json --device cpu`
greedily for --max-tokens tokens without speculation, then with `--spec.method draft` at every k of
--k (and `--spec.method ngram` with --ngram). Every speculative run must produce the same tokens as
the plain one (greedy speculation is exact); the script exits 1 otherwise. Reported per method and k,
summed over the prompts: draft_tokens, accepted_tokens, acceptance (accepted / drafted), tokens per
step (generated tokens / steps: each step is one target forward, its first token included) and decode
tokens/s (generated tokens over the runs' decode time, from each run's decode_tokens_per_s; the
machine's other load makes it noisy). --readme replaces the README's section between
train_draft.ACCEPT_BEGIN and ACCEPT_END with the table.
"""

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_draft  # noqa: E402


def run(a, prompt, extra):
    cmd = [a.generate, "--model", a.model, "--prompt", prompt, "--max-tokens", str(a.max_tokens), "--json",
           "--device", "cpu", "--threads", str(a.threads)] + extra
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, DUET_LOG_LEVEL="error"))
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()}")
    return json.loads(r.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/duet-demo")
    ap.add_argument("--draft", default="models/duet-demo-draft")
    ap.add_argument("--generate", default="build/engine/duet-generate")
    ap.add_argument("--prompts-file", default="data/prompts/gsm8k-test.jsonl")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", default="2,4,7")
    ap.add_argument("--ngram", action="store_true", help="also prompt lookup (--spec.method ngram) at each k")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--readme", default="", help="README.md whose acceptance section to replace with the table")
    a = ap.parse_args()
    ks = [int(k) for k in a.k.split(",")]
    with open(a.prompts_file) as f:
        questions = [json.loads(line)["question"] for line in f][: a.prompts]

    methods = [("none", 0, [])]
    methods += [("draft", k, ["--spec.method", "draft", "--spec.draft-model", a.draft, "--spec.k", str(k)]) for k in ks]
    if a.ngram:
        methods += [("ngram", k, ["--spec.method", "ngram", "--spec.k", str(k)]) for k in ks]
    sums = {(m, k): dict(tokens=0, steps=0, draft=0, accepted=0, decode_s=0.0) for m, k, _ in methods}
    for i, q in enumerate(questions):
        plain = None
        for m, k, extra in methods:
            o = run(a, q, extra)
            if plain is None:
                plain = o["tokens"]
            elif o["tokens"] != plain:
                sys.exit(f"prompt {i}: --spec.method {m} --spec.k {k} changed the greedy output")
            s, n = sums[(m, k)], len(o["tokens"])
            s["tokens"] += n
            s["steps"] += o["steps"]
            s["draft"] += o["draft_tokens"]
            s["accepted"] += o["accepted_tokens"]
            s["decode_s"] += (n - 1) / o["decode_tokens_per_s"] if o["decode_tokens_per_s"] > 0 else 0.0
    base = sums[("none", 0)]
    rows = []
    for m, k, _ in methods:
        s = sums[(m, k)]
        tps = (s["tokens"] - len(questions)) / s["decode_s"]
        base_tps = (base["tokens"] - len(questions)) / base["decode_s"]
        acc = f"{s['accepted'] / s['draft']:.3f}" if s["draft"] else "-"
        rows.append(f"| {m} | {k or '-'} | {s['draft']:,} | {s['accepted']:,} | {acc} | "
                    f"{s['tokens'] / s['steps']:.2f} | {tps:,.0f} ({tps / base_tps:.2f}x) |")
    cmd = "python tools/spec_acceptance.py " + " ".join(sys.argv[1:])
    text = (f"Measured by duet itself (`duet-generate --json --device cpu --threads {a.threads}`, greedy, "
            f"{a.max_tokens} tokens) on the first {len(questions)} GSM8K test questions of `{a.prompts_file}`; every "
            f"speculative run's tokens equal the plain run's:\n\n    {cmd}\n\n"
            "| method | k | draft_tokens | accepted_tokens | acceptance | tokens / step | decode tokens/s |\n"
            "| --- | --- | --- | --- | --- | --- | --- |\n" + "\n".join(rows) + "\n")
    print(text, flush=True)
    if a.readme:
        with open(a.readme) as f:
            s = f.read()
        i, j = s.index(train_draft.ACCEPT_BEGIN), s.index(train_draft.ACCEPT_END)
        with open(a.readme, "w") as f:
            f.write(s[:i] + f"{train_draft.ACCEPT_BEGIN}\n## Acceptance\n\n{text}" + s[j:])


if __name__ == "__main__":
    main()
