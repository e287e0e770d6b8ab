#!/usr/bin/env python3
"""Acceptance of greedy speculative decoding against a target, on held-out text, with transformers.

  python tools/draft_acceptance.py --target models/duet-demo --draft models/duet-demo-draft \\
      --readme models/duet-demo-draft/README.md

Prompts: --prompts windows of --prompt-len bytes of the held-out text (the last 2% of each
data/corpus file, as tools/train_demo.py holds out), spread evenly over the files, each starting a
line (or a word, in a long line); every prompt gets <|bos|> in front. The target (fp32) continues each prompt greedily
for --gen bytes (+ 7 so that every draft can be checked); with greedy verification speculative
decoding produces exactly this text, so the target runs once and each drafter is replayed on it:

  t = 0; while t < gen: d = drafter's k tokens after prompt + out[:t]; a = the length of the
  longest prefix of d equal to out[t:t + len(d)]; t += a + 1 (the verify step's own token); one step.

Reported per drafter and k: drafted tokens, accepted tokens, acceptance (accepted / drafted), and
tokens per verify step (tokens produced / steps: 1 + accepted per step, steps without a draft
included). Drafters:
  - a draft model (--draft, any number of them): greedy k tokens from its own cache, in transformers
    fp32 (agree@1 = how often its first token is the target's next token, over every position);
  - prompt lookup (n-gram): the longest of the last 3, 2, 1 tokens of prompt + output that occurred
    before in them, its most recent occurrence, the (up to) k tokens that followed it; no match, no
    draft;
  - with --table-orders, a byte n-gram table from the training text (order 2: the most frequent byte
    after the previous one; order 3: after the previous two, else order 2), greedy: a reference for
    what a drafter that sees the order of the last bytes gets (an MLA-only drafter does not: Kimi
    Linear's MLA is NoPE).

Greedy drafts for k < K are the first k tokens of the K-token draft, so each drafter drafts K =
max(--k) tokens at every position once, and each k replays those.
"""

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_demo as td  # noqa: E402
import train_draft  # noqa: E402

from transformers import KimiLinearForCausalLM  # noqa: E402


def held_prompts(held, n, length):
    """n prompts of `length` bytes, spread evenly over the held-out parts, each starting a line (a word
    where the line began more than 512 bytes before: web-plain.txt ends in one 18 kB glossary line)."""
    per, out = -(-n // len(held)), []
    for h in held:
        b, starts = bytes(h.numpy()), []
        for i in range(min(per, n - len(out))):
            off = (i + 1) * (len(b) - length) // per
            nl = b.rfind(b"\n", 0, off)
            starts.append(nl + 1 if off - nl <= 512 else b.rfind(b" ", 0, off) + 1)
            assert len(set(starts)) == len(starts), "held-out text too short for this many prompts"
        out += [b[s:s + length] for s in starts]
    return out


def target_continuations(target_dir, prompts, n, cache):
    """The target's greedy continuation (n bytes) of every prompt; stored in `cache` (JSON) if given."""
    key = {"target": os.path.abspath(target_dir), "prompts": [p.hex() for p in prompts], "n": n}
    if cache and os.path.exists(cache):
        with open(cache) as f:
            d = json.load(f)
        if {k: d[k] for k in key} == key:
            return [bytes(c) for c in d["continuations"]]
        print(f"{cache}: made for other prompts or another target; recomputing", flush=True)
    target = train_draft.load_target(target_dir)
    x = torch.tensor([[td.BOS] + list(p) for p in prompts])
    with train_draft.recurrent_kda():
        cont, _ = train_draft.greedy_continue(target, x, n)
    assert int(cont.max()) < 256, "the target produced a special token"
    out = [bytes(r) for r in cont.tolist()]
    if cache:
        with open(cache, "w") as f:
            json.dump(dict(key, continuations=[list(c) for c in out]), f)
    return out


@torch.no_grad()
def model_drafts(draft, prompts, conts, gen, K):
    """drafts[p][t] = the draft model's greedy K tokens after <|bos|> + prompts[p] + conts[p][:t], for
    t < gen; all prompts advance together (same lengths), the cache cropped after each draft."""
    def pick(logits):
        logits = logits[:, -1].float()
        logits[:, td.BOS] = -float("inf")
        return logits.argmax(-1, keepdim=True)

    x = torch.tensor([[td.BOS] + list(p) for p in prompts])
    c = torch.tensor([list(cc) for cc in conts])
    out = draft(input_ids=x, use_cache=True)
    past, nxt, res = out.past_key_values, pick(out.logits), []
    for t in range(gen):
        d = [nxt]
        for _ in range(K - 1):
            d.append(pick(draft(input_ids=d[-1], past_key_values=past, use_cache=True).logits))
        if K > 1:
            past.crop(-(K - 1))
        res.append(torch.cat(d, 1))
        nxt = pick(draft(input_ids=c[:, t:t + 1], past_key_values=past, use_cache=True).logits)
    return torch.stack(res, 1).tolist()  # [P][gen][K]


def lookup_drafts(prompt, cont, gen, K, max_n=3):
    """Prompt-lookup drafts for t < gen: for n = max_n..1, the last n bytes of prompt + cont[:t], their
    most recent earlier occurrence, and the up to K bytes after it; [] when no n matches."""
    res = []
    for t in range(gen):
        seq = prompt + cont[:t]
        d = []
        for n in range(max_n, 0, -1):
            if len(seq) <= n:
                continue
            j = seq.rfind(seq[-n:], 0, len(seq) - 1)  # an occurrence that ends before the last byte
            if j >= 0:
                d = list(seq[j + n:j + n + K])
                break
        res.append(d)
    return res


def table_drafts(train, order, prompts, conts, gen, K):
    """Greedy drafts from the training text's most frequent next byte after the last order - 1 bytes."""
    nxt = {}
    for o in range(2, order + 1):
        ctx = 256 ** (o - 1)
        counts = np.zeros(ctx * 256, dtype=np.int64)
        for t in train:
            b = t.numpy().astype(np.int64)
            c = np.zeros(len(b) - o + 1, dtype=np.int64)
            for i in range(o):  # (context bytes, next byte) as one base-256 number
                c = c * 256 + b[i:len(b) - o + 1 + i]
            counts += np.bincount(c, minlength=ctx * 256)
        counts = counts.reshape(ctx, 256)
        nxt[o] = (counts.argmax(1), counts.sum(1) > 0)
    res = []
    for p, c in zip(prompts, conts):
        rp = []
        for t in range(gen):
            seq, d = list(p + c[:t]), []
            for _ in range(K):
                tok = None
                for o in range(order, 1, -1):
                    key = 0
                    for x in seq[len(seq) - o + 1:]:
                        key = key * 256 + x
                    if nxt[o][1][key]:
                        tok = int(nxt[o][0][key])
                        break
                d.append(tok if tok is not None else 32)
                seq.append(d[-1])
            rp.append(d)
        res.append(rp)
    return res


def replay(drafts, cont, gen, k):
    """Greedy verification of the k-token prefixes of `drafts` against the target's output `cont`."""
    t = drafted = accepted = steps = 0
    while t < gen:
        d = drafts[t][:k]
        a = 0
        while a < len(d) and d[a] == cont[t + a]:
            a += 1
        drafted, accepted, steps, t = drafted + len(d), accepted + a, steps + 1, t + a + 1
    return dict(drafted=drafted, accepted=accepted, steps=steps, produced=t)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/corpus")
    ap.add_argument("--target", default="models/duet-demo")
    ap.add_argument("--draft", action="append", default=[], help="draft model folder (repeatable)")
    ap.add_argument("--k", default="2,4,7")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--table-orders", default="", help="also byte n-gram table drafters of these orders, e.g. 2,3")
    ap.add_argument("--target-cache", default="", help="JSON file keeping the target's continuations")
    ap.add_argument("--readme", default="", help="README.md whose acceptance section to replace with the table")
    ap.add_argument("--json", default="", help="write the figures here too")
    a = ap.parse_args()
    ks = [int(k) for k in a.k.split(",")]
    K = max(ks)

    train, held = td.load_data(a.data)
    prompts = held_prompts(held, a.prompts, a.prompt_len)
    conts = target_continuations(a.target, prompts, a.gen + K, a.target_cache)

    drafters = []  # (name, drafts [P][gen][<=K], agree@1 or None)
    for path in a.draft:
        model = KimiLinearForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        dr = model_drafts(model, prompts, conts, a.gen, K)
        agree = sum(dr[p][t][0] == conts[p][t] for p in range(len(prompts)) for t in range(a.gen))
        n_params = sum(p.numel() for p in model.parameters())
        drafters.append((f"`{os.path.basename(os.path.normpath(path))}` ({n_params / 1e6:.2f} M)", dr,
                         agree / (len(prompts) * a.gen)))
    for o in [int(x) for x in a.table_orders.split(",") if x]:
        dr = table_drafts(train, o, prompts, conts, a.gen, K)
        agree = sum(dr[p][t][0] == conts[p][t] for p in range(len(prompts)) for t in range(a.gen))
        drafters.append((f"corpus byte {o}-gram table", dr, agree / (len(prompts) * a.gen)))
    drafters.append(("prompt lookup (n = 3, 2, 1)", [lookup_drafts(p, c, a.gen, K) for p, c in zip(prompts, conts)],
                     None))

    rows, figures = [], []
    for name, dr, agree in drafters:
        for k in ks:
            r = [replay(dr[p], conts[p], a.gen, k) for p in range(len(prompts))]
            s = {f: sum(x[f] for x in r) for f in r[0]}
            acc = s["accepted"] / max(1, s["drafted"])
            tps = s["produced"] / s["steps"]
            no_draft = sum(1 for p in range(len(prompts)) for t in range(a.gen) if not dr[p][t]) / (len(prompts) * a.gen)
            figures.append(dict(drafter=name, k=k, acceptance=acc, tokens_per_step=tps, agree1=agree,
                                no_draft_positions=no_draft, **s))
            rows.append(f"| {name} | {k} | {s['drafted']:,} | {s['accepted']:,} | {acc:.3f} | {tps:.2f} | "
                        + (f"{agree:.3f}" if agree is not None else f"({no_draft:.1%} of positions: no match)")
                        + " |")
    table = "\n".join([
        "| drafter | k | drafted | accepted | acceptance | tokens / verify step | agree@1 |",
        "| --- | --- | --- | --- | --- | --- | --- |"] + rows)
    text = (f"Against `{os.path.basename(os.path.normpath(a.target))}` (transformers fp32, greedy) on {len(prompts)} held-out "
            f"prompts of {a.prompt_len} bytes (each after `<|bos|>`), {a.gen} generated bytes each "
            f"({len(prompts) * a.gen:,} positions); greedy drafting, greedy verification:\n\n{table}\n")
    print(text, flush=True)
    cmd = "python tools/draft_acceptance.py " + " ".join(sys.argv[1:])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(command=cmd, figures=figures), f, indent=1)
    if a.readme:
        s = open(a.readme).read()
        i, j = s.index(train_draft.REPLAY_BEGIN), s.index(train_draft.REPLAY_END)
        section = (f"{train_draft.REPLAY_BEGIN}\n## Acceptance on held-out text (transformers replay)\n\n"
                   f"Measured by `tools/draft_acceptance.py`:\n\n"
                   f"    {cmd}\n\n{text}")
        with open(a.readme, "w") as f:
            f.write(s[:i] + section + s[j:])


if __name__ == "__main__":
    main()
