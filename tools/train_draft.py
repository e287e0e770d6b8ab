#!/usr/bin/env python3
"""Train a draft model for speculative decoding against a target Kimi-Linear checkpoint
(models/duet-demo-draft against models/duet-demo), on the CPU.

  python tools/train_draft.py --target models/duet-demo --out models/duet-demo-draft \\
      --teacher-minutes 4 --minutes 8

The drafter is a Kimi-Linear checkpoint with MLA layers only (duet's draft model path keeps a KV
cache and no recurrent state), built and saved with tools/train_demo.py's pieces (config, data,
Moonshot naming, reload check, held-out bits per byte, samples): same byte vocabulary and tokenizer
file as the target.

Distillation (--teacher-minutes > 0): before training, the target (transformers, fp32) labels
windows of the training text: --prompt-len bytes of corpus text after <|bos|>, then --gen-len bytes
of the target's own greedy continuation, with the target's full next-byte distribution at every
position. Acceptance is decided on the target's own output, so its greedy continuations are the
contexts the drafter will draft on. Each training step then adds KL(target || drafter) over
--kd-batch of those windows to the cross-entropy on --batch corpus windows. The target runs through
transformers' recurrent KDA reference rather than its chunked one: the same recurrence, several
times faster on a CPU (the chunked reference pads every call to 64 positions and builds
[chunk, chunk, head_dim] tensors).

Without a teacher (--teacher-minutes 0) it is plain next-byte cross-entropy on the corpus.
--teacher-cache FILE stores the labelled windows (or reuses them when FILE exists), so that several
drafters can be trained against one labelling.

Writes the model folder (config.json, model.safetensors, duet_tokenizer.json) and README.md with the
config, parameters, command, training and held-out figures; tools/spec_acceptance.py --readme adds
the acceptance duet-generate measures, tools/draft_acceptance.py --readme the transformers replay on
held-out text.
"""

import argparse
import contextlib
import json
import math
import os
import shlex
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_demo as td  # noqa: E402

import transformers  # noqa: E402
from transformers import KimiLinearForCausalLM  # noqa: E402
from transformers.models.kimi_linear import modeling_kimi_linear as mkl  # noqa: E402

log = td.log
# README sections the measuring tools fill in: duet's own acceptance (tools/spec_acceptance.py --readme)
# and the transformers replay on held-out text (tools/draft_acceptance.py --readme).
ACCEPT_BEGIN, ACCEPT_END = "<!-- acceptance: tools/spec_acceptance.py --readme -->", "<!-- /acceptance -->"
REPLAY_BEGIN, REPLAY_END = "<!-- replay: tools/draft_acceptance.py --readme -->", "<!-- /replay -->"


@contextlib.contextmanager
def recurrent_kda():
    """Run KDA prefill through transformers' recurrent reference instead of its chunked one (CPU speed)."""
    chunk = mkl.chunk_kimi_delta_attention

    def recurrent(q, k, v, g, beta, chunk_size=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, **kw):
        return mkl.recurrent_kimi_delta_attention(q, k, v, g, beta, initial_state, output_final_state,
                                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    mkl.chunk_kimi_delta_attention = recurrent
    try:
        yield
    finally:
        mkl.chunk_kimi_delta_attention = chunk


def load_target(path):
    model = KimiLinearForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert model.config.vocab_size == td.VOCAB, f"{path}: vocab {model.config.vocab_size}, expected {td.VOCAB}"
    return model


@torch.no_grad()
def greedy_continue(model, x, n):
    """Greedy continuation of every row of x ([B, P] ids, all rows the same length) by n tokens with
    the model's cache. Returns (ids [B, n], log-probs [B, P + n - 1, VOCAB] float32 of every position
    that predicts a token of x[:, 1:] or of the continuation). <|bos|> is never chosen, as in
    train_demo.generate."""
    out = model(input_ids=x, use_cache=True)
    past, lps, toks = out.past_key_values, [F.log_softmax(out.logits.float(), -1)], []
    for i in range(n):
        logits = out.logits[:, -1].float()
        logits[:, td.BOS] = -float("inf")
        tok = logits.argmax(-1, keepdim=True)
        toks.append(tok)
        if i == n - 1:
            break
        out = model(input_ids=tok, past_key_values=past, use_cache=True)
        past = out.past_key_values
        lps.append(F.log_softmax(out.logits.float(), -1))
    return torch.cat(toks, 1), torch.cat(lps, 1)


def teacher_windows(target, train, weights, a):
    """Windows labelled by the target for --teacher-minutes: ids [N, 1 + prompt + gen] (uint8 would not
    hold <|bos|>: int16), log-probs [N, prompt + gen, VOCAB] float16 (row i predicts ids[:, i + 1])."""
    gen = torch.Generator().manual_seed(a.seed + 1)
    ids, lps, t0 = [], [], time.time()
    with recurrent_kda():
        while time.time() - t0 < a.teacher_minutes * 60:
            x = td.batch_from(train, weights, a.teacher_batch, a.prompt_len, torch.device("cpu"), gen)
            cont, lp = greedy_continue(target, x, a.gen_len)
            ids.append(torch.cat([x, cont], 1).to(torch.int16))
            lps.append(lp.to(torch.float16))
            n = sum(t.shape[0] for t in ids)
            log(f"teacher: {n} windows ({n * lp.shape[1]:,} positions) in {time.time() - t0:.0f}s")
    return torch.cat(ids), torch.cat(lps)


def kd_loss(model, ids, lp):
    """Mean KL(target || drafter) per position over a batch of labelled windows."""
    logits = model(input_ids=ids[:, :-1].long(), use_cache=False).logits.float()
    logq = F.log_softmax(logits, -1).reshape(-1, td.VOCAB)
    return F.kl_div(logq, lp.float().reshape(-1, td.VOCAB), log_target=True, reduction="batchmean")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/corpus")
    ap.add_argument("--target", default="models/duet-demo")
    ap.add_argument("--out", default="models/duet-demo-draft")
    ap.add_argument("--minutes", type=float, default=8.0, help="wall-clock budget for the training loop")
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8, help="corpus windows per step (cross-entropy)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--wd", type=float, default=0.1)
    # the drafter: MLA layers only, dense MLPs (train_demo.make_config's sizes)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--mla-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64, help="MLA qk_nope = v_head_dim")
    ap.add_argument("--rope", type=int, default=32)
    ap.add_argument("--kv-lora", type=int, default=128)
    ap.add_argument("--dense-inter", type=int, default=768)
    # distillation
    ap.add_argument("--teacher-minutes", type=float, default=4.0, help="time for labelling (0: no distillation)")
    ap.add_argument("--teacher-batch", type=int, default=256)
    ap.add_argument("--teacher-cache", default="", help="file to save the labelled windows to, or load them from")
    ap.add_argument("--prompt-len", type=int, default=64, help="corpus bytes before the target's continuation")
    ap.add_argument("--gen-len", type=int, default=192, help="bytes of the target's greedy continuation")
    ap.add_argument("--kd-batch", type=int, default=16, help="labelled windows per step")
    ap.add_argument("--kd-weight", type=float, default=1.0)
    ap.add_argument("--eval-bytes", type=int, default=400_000)
    ap.add_argument("--sample-len", type=int, default=200)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    # train_demo.make_config's remaining knobs: every layer MLA, every MLP dense. The KDA and expert
    # sizes describe layers the drafter does not have; they keep the target's values, which the
    # cross-field checks (top-k <= experts, ...) of transformers and duet accept.
    a.mla_layers, a.dense_layers, a.kda_heads, a.experts, a.moe_inter = "all", a.layers, 4, 8, 128

    t_start = time.time()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    cpu = torch.device("cpu")
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads")
    train, held = td.load_data(a.data)
    weights = torch.tensor([float(t.numel()) for t in train])

    kd_ids = kd_lp = None
    teacher_time = 0.0
    if a.teacher_cache and os.path.exists(a.teacher_cache):
        kd_ids, kd_lp = torch.load(a.teacher_cache)
        log(f"teacher: {kd_ids.shape[0]} labelled windows from {a.teacher_cache}")
    elif a.teacher_minutes > 0:
        t0 = time.time()
        target = load_target(a.target)
        kd_ids, kd_lp = teacher_windows(target, train, weights, a)
        del target
        teacher_time = time.time() - t0
        if a.teacher_cache:
            torch.save((kd_ids, kd_lp), a.teacher_cache)
    if kd_ids is not None:
        tgt_bpb = -kd_lp[:, : a.prompt_len].float().gather(-1, kd_ids[:, 1: a.prompt_len + 1, None].long()).mean()
        log(f"teacher: {kd_ids.shape[0]} windows x {kd_lp.shape[1]} positions; target on their corpus part: "
            f"{tgt_bpb / math.log(2):.3f} bits/byte")

    config = td.make_config(a)
    model = KimiLinearForCausalLM(config).float().train()
    total, _ = td.count_params(model, config)
    log(f"drafter: {total:,} params, {config.num_hidden_layers} MLA layers, hidden {config.hidden_size}")
    opt = td.make_optimizer(model, a.lr, a.wd, cpu)

    budget, t0 = a.minutes * 60.0, time.time()
    step, tokens, last_log = 0, 0, t0
    while True:
        elapsed = time.time() - t0
        if elapsed >= budget or (a.max_steps and step >= a.max_steps):
            break
        lr = td.lr_at(step, min(1.0, elapsed / budget), a.lr, a.warmup, a.min_lr_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        ce = td.lm_loss(model, td.batch_from(train, weights, a.batch, a.seq, cpu))
        loss, kl = ce, None
        tokens += a.batch * a.seq
        if kd_ids is not None and a.kd_batch > 0:
            idx = torch.randint(0, kd_ids.shape[0], (a.kd_batch,))
            kl = kd_loss(model, kd_ids[idx], kd_lp[idx])
            loss = ce + a.kd_weight * kl
            tokens += a.kd_batch * kd_lp.shape[1]
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        now = time.time()
        if step <= 3 or now - last_log >= 30:
            log(f"step {step:5d}  ce {ce.item() / math.log(2):.3f} bits/byte"
                + (f"  kl {kl.item() / math.log(2):.3f} bits" if kl is not None else "")
                + f"  lr {lr:.2e}  gnorm {float(gnorm):.2f}  tok/s {tokens / (now - t0):,.0f}  elapsed {now - t0:.0f}s")
            last_log = now
    train_time = time.time() - t0
    log(f"training done: {step} steps, {tokens:,} tokens, {train_time:.0f}s")

    nbytes, shards = td.save_model(model, config, a.out, shard_mib=64)
    err = td.verify_reload(model, config, a.out, cpu)
    log(f"saved {nbytes / 2**20:.2f} MiB to {a.out}; reload check ok (max |logit diff| {err:.2e})")
    model = KimiLinearForCausalLM.from_pretrained(a.out, dtype=torch.float32).eval()  # what ships: bf16 weights
    bpb, nb = td.heldout_bpb(model, held, a.seq, cpu, a.eval_bytes, amp=False)
    log(f"held-out: {bpb:.4f} bits/byte over {nb:,} bytes")
    samples = []
    for prompt in ["The LORD said unto Moses,", "The jury "]:
        txt = td.generate(model, prompt, a.sample_len, cpu, amp=False)
        samples.append((prompt, txt))
        log(f"--- greedy sample ---\n{txt}\n")

    c = config
    cmd = "python tools/train_draft.py " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    kd_line = ("- distillation: none (cross-entropy on the corpus only)." if kd_ids is None else
               f"- distillation: {kd_ids.shape[0]:,} windows labelled by the target"
               + (f" in {teacher_time:.0f} s" if teacher_time else f" (loaded from {a.teacher_cache})")
               + f" ({a.prompt_len} corpus bytes after `<|bos|>`, then {a.gen_len} bytes of the target's greedy"
               f" continuation; the target's full distribution at each of the {kd_lp.shape[1]} positions);"
               f" each step adds {a.kd_weight:g} x KL(target || drafter) over {a.kd_batch} of them.")
    readme = f"""# duet-demo-draft

A draft model for speculative decoding against [duet-demo](../duet-demo): a Kimi-Linear checkpoint
(transformers `KimiLinearForCausalLM`, Moonshot naming, hub config spelling) with **MLA layers only**,
so that drafting needs a KV cache and no recurrent state. Same byte vocabulary (258: ids 0..255 the
bytes, 256 `<|bos|>`, 257 `<|eos|>`) and the same `duet_tokenizer.json` as the target.

Made by `tools/train_draft.py` (transformers {transformers.__version__}, torch {torch.__version__}, CPU,
{torch.get_num_threads()} threads):

    {cmd}

## Files
- `config.json`: hub spelling; `linear_attn_config.kda_layers` is empty, `full_attn_layers` lists every
  layer, `first_k_dense_replace` = {c.num_hidden_layers} (every MLP dense), `torch_dtype` bfloat16.
- `model.safetensors`: bf16 weights in Moonshot's naming ({nbytes / 2**20:.2f} MiB of tensors).
- `duet_tokenizer.json`: identical to duet-demo's (`"add_bos": true`).

## Config
| | |
| --- | --- |
| vocab | {c.vocab_size} (bytes + 2 specials) |
| hidden | {c.hidden_size}, {c.num_hidden_layers} layers, rms_norm_eps {c.rms_norm_eps} |
| MLA layers (1-based) | all: {c.num_attention_heads} heads, qk_nope {c.qk_nope_head_dim}, qk_rope {c.qk_rope_head_dim}, v {c.v_head_dim}, kv_lora_rank {c.kv_lora_rank}, q_lora_rank null (NoPE, as in every Kimi-Linear MLA layer) |
| FFN | dense, intermediate {c.intermediate_size} (no experts) |
| parameters | {total:,} ({total / 1e6:.2f} M), all active |

## Training
- data: `data/corpus/*.txt` ({sum(t.numel() for t in train):,} training bytes); the last 2% of each file held out.
{kd_line}
- {step:,} steps of {a.batch} x {a.seq} corpus bytes{f" + {a.kd_batch} labelled windows" if kd_ids is not None else ""} ({tokens:,} positions) in {train_time:.0f} s of training; fp32, AdamW (lr {a.lr:g}, betas 0.9/0.95, wd {a.wd}), {a.warmup} warmup steps then cosine over the wall-clock budget to {a.min_lr_frac:g} x lr, grad clip 1.0. Whole run (data, labelling, training, checks): {time.time() - t_start:.0f} s.
- **held-out: {bpb:.3f} bits per byte** over {nb:,} held-out bytes (windows of {a.seq} bytes after `<|bos|>`; duet-demo: 1.730).

{ACCEPT_BEGIN}
(run tools/spec_acceptance.py --readme)
{ACCEPT_END}

{REPLAY_BEGIN}
(run tools/draft_acceptance.py --readme)
{REPLAY_END}

## Samples (transformers fp32, greedy, cached decoding, {a.sample_len} bytes)
"""
    for prompt, txt in samples:
        readme += f"\nprompt `{prompt}`:\n\n```\n{txt}\n```\n"
    with open(os.path.join(a.out, "README.md"), "w") as f:
        f.write(readme)
    summary = dict(params=total, steps=step, tokens=tokens, train_seconds=train_time, teacher_seconds=teacher_time,
                   heldout_bpb=bpb, heldout_bytes=nb, safetensors_bytes=nbytes, total_seconds=time.time() - t_start)
    log("summary " + json.dumps(summary))


if __name__ == "__main__":
    main()
