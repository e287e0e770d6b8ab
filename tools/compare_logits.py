#!/usr/bin/env python3
"""Compare duet-generate's prompt logits with transformers' for a byte-level model folder.

  python tools/compare_logits.py --model models/duet-demo-draft --prompt "The LORD said unto Moses,"

Runs `duet-generate --model DIR --prompt TEXT --dump-logits FILE --json --device cpu` (float32
[prompt_len, vocab]), builds the same prompt ids from the folder's duet_tokenizer.json (a byte
tokenizer: UTF-8 bytes, config.json's bos_token_id in front when "add_bos" is set; the count must
equal duet's prompt_tokens), runs KimiLinearForCausalLM.from_pretrained(DIR) in fp32 on them and
prints the max absolute difference, the relative L2 error and how many rows agree on the argmax.
Exits 1 when the max absolute difference exceeds --tol.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
from transformers import KimiLinearForCausalLM


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--generate", default="build/engine/duet-generate")
    ap.add_argument("--tol", type=float, default=1e-3, help="max |duet - transformers| allowed")
    a = ap.parse_args()

    with open(os.path.join(a.model, "duet_tokenizer.json")) as f:
        tok = json.load(f)
    if tok.get("type") != "byte":
        sys.exit(f"{a.model}: tokenizer type {tok.get('type')!r}; this tool handles byte tokenizers only")
    with open(os.path.join(a.model, "config.json")) as f:
        bos = json.load(f)["bos_token_id"]
    ids = ([bos] if tok.get("add_bos") else []) + list(a.prompt.encode("utf-8"))

    with tempfile.TemporaryDirectory() as tmp:
        dump = os.path.join(tmp, "logits.bin")
        r = subprocess.run([a.generate, "--model", a.model, "--prompt", a.prompt, "--max-tokens", "1",
                            "--device", "cpu", "--dump-logits", dump, "--json"],
                           capture_output=True, text=True, env=dict(os.environ, DUET_LOG_LEVEL="error"))
        if r.returncode != 0:
            sys.exit(f"duet-generate failed ({r.returncode}): {r.stderr.strip()}")
        info = json.loads(r.stdout)
        duet = np.fromfile(dump, dtype="<f4")
    if info["prompt_tokens"] != len(ids):
        sys.exit(f"duet counted {info['prompt_tokens']} prompt tokens, the tokenizer file gives {len(ids)}")
    model = KimiLinearForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0].numpy()
    if duet.size != ref.size:
        sys.exit(f"duet dumped {duet.size} floats, expected {ref.shape[0]} x {ref.shape[1]}")
    duet = duet.reshape(ref.shape)
    diff = np.abs(duet - ref)
    rel = float(np.linalg.norm(duet - ref) / np.linalg.norm(ref))
    agree = int((duet.argmax(-1) == ref.argmax(-1)).sum())
    print(f"{a.model}: {len(ids)} prompt tokens x vocab {ref.shape[1]}: max |duet - transformers| {diff.max():.3g} "
          f"(max |logit| {np.abs(ref).max():.3g}), rel L2 {rel:.3g}, argmax equal in {agree}/{len(ids)} rows")
    if diff.max() > a.tol:
        sys.exit(f"max abs difference {diff.max():.3g} exceeds --tol {a.tol:g}")


if __name__ == "__main__":
    main()
