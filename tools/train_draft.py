#!/usr/bin/env python3
"""Train a draft model for speculative decoding against a target Kimi-Linear checkpoint
(a drafter for models/duet-demo), on a GPU or on the CPU.

  python tools/train_draft.py --target models/duet-demo --out /tmp/draft --minutes 20
  tools/train_draft_gpu.sh OUTDIR MINUTES      (the settings chosen for one H200)

The drafter is a Kimi-Linear checkpoint built and saved with tools/train_demo.py's pieces (config,
data, Moonshot naming, reload check, held-out bits per byte, samples), with the target's byte
vocabulary and tokenizer file. Its layers: --kda-layers KDA layers, then --mla-layers MLA layers
(or any order with --layer-pattern, e.g. KMK), every MLP dense. Kimi-Linear's MLA is NoPE: MLA
layers alone see the bytes before the current one as an unordered set, which a byte-level drafter
cannot afford; KDA layers carry order through their short convolution and their recurrence.

Each step's loss is a weighted sum of
  --ce-weight  cross-entropy on --batch corpus windows of --seq bytes (each after <|bos|>);
  --tf-weight  teacher-forced distillation on the same windows: the target runs over them in one
               forward (no cache, no generation) and the drafter is fitted to its full next-byte
               distribution at every position, KL(target || drafter). Labelled on the fly each step,
               so it needs no labelling time or file, and on a GPU it gives millions of labelled
               positions a minute;
  --kd-weight  distillation on the target's own greedy output: before training, the target labels
               windows for --teacher-minutes (--prompt-len corpus bytes after <|bos|>, then
               --gen-len bytes of its greedy continuation, with its full distribution at every
               position), and each step adds KL(target || drafter) over --kd-batch of them.
               Acceptance is decided on the target's own output, so these are the contexts the
               drafter will draft on. --teacher-cache FILE stores the labelled windows (or reuses
               them when FILE exists), so that several drafters can share one labelling.

Device: --device cuda|cpu (default cuda when available). On cuda, --amp bf16 (default) runs the
drafter's forward and backward under bf16 autocast with fp32 master weights; --amp fp32 turns it off;
the target always runs in fp32 (TF32 matmuls) as the teacher. On the CPU everything is fp32 and the
target's KDA prefill runs through transformers' recurrent reference instead of its chunked one: the
same recurrence, several times faster on a CPU (the chunked reference pads every call to 64 positions
and builds [chunk, chunk, head_dim] tensors), but a loop of one small step per position, which a GPU
runs slower than the chunked form. Neither needs the `fla` package: transformers uses fla's kernels
when it is installed and its own pure-torch references otherwise.

Writes the model folder (config.json, model.safetensors, duet_tokenizer.json; the checkpoint is bf16)
and README.md with the device, command, seed, layers, parameters, training, held-out bits per byte and
agreement with the target; tools/spec_acceptance.py --readme adds the acceptance duet-generate
measures, tools/draft_acceptance.py --readme the transformers replay on held-out text.
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
CPU = torch.device("cpu")
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


def teacher_kda(device):
    """The KDA form the target runs in as a teacher: recurrent on the CPU, transformers' default elsewhere."""
    return recurrent_kda() if device.type == "cpu" else contextlib.nullcontext()


def load_target(path, device=CPU):
    """The target in fp32 for labelling. On a GPU, a forward is tried first: if the experts kernel
    transformers picks (grouped_mm) fails there, the eager experts loop is used instead."""
    model = KimiLinearForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    assert model.config.vocab_size == td.VOCAB, f"{path}: vocab {model.config.vocab_size}, expected {td.VOCAB}"
    if device.type != "cpu":
        x = torch.full((2, 9), td.BOS, dtype=torch.long, device=device)
        try:
            with torch.no_grad():
                model(input_ids=x, use_cache=False)
        except Exception as e:  # noqa: BLE001
            log(f"target: forward failed with experts '{model.config._experts_implementation}' ({e!r}); using eager")
            model.set_experts_implementation("eager")
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


def teacher_windows(target, train, weights, a, device):
    """Windows labelled by the target for --teacher-minutes (or until --teacher-max-windows): ids
    [N, 1 + prompt + gen] int16 (uint8 would not hold <|bos|>), log-probs [N, prompt + gen, VOCAB]
    float16 (row i predicts ids[:, i + 1]), both on `device`."""
    gen = torch.Generator().manual_seed(a.seed + 1)
    ids, lps, n, t0 = [], [], 0, time.time()
    with teacher_kda(device):
        while time.time() - t0 < a.teacher_minutes * 60:
            if a.teacher_max_windows and n >= a.teacher_max_windows:
                break
            x = td.batch_from(train, weights, a.teacher_batch, a.prompt_len, CPU, gen).to(device)
            cont, lp = greedy_continue(target, x, a.gen_len)
            ids.append(torch.cat([x, cont], 1).to(torch.int16))
            lps.append(lp.to(torch.float16))
            n += x.shape[0]
            log(f"teacher: {n} windows ({n * lp.shape[1]:,} positions) in {time.time() - t0:.0f}s")
    return torch.cat(ids), torch.cat(lps)


def kl_per_position(logq, lp):
    """Mean KL(target || drafter) per position; logq, lp: [..., VOCAB] log-probs."""
    return F.kl_div(logq.reshape(-1, td.VOCAB), lp.float().reshape(-1, td.VOCAB), log_target=True,
                    reduction="batchmean")


def drafter_logprobs(model, ids, amp):
    """Drafter log-probs (fp32) of every position of ids [B, T], no cache."""
    with torch.autocast(device_type=ids.device.type, dtype=torch.bfloat16, enabled=amp):
        logits = model(input_ids=ids, use_cache=False).logits
    return F.log_softmax(logits.float(), -1)


def target_logprobs(target, ids):
    with torch.no_grad(), teacher_kda(ids.device):
        return F.log_softmax(target(input_ids=ids, use_cache=False).logits.float(), -1)


@torch.no_grad()
def heldout_agreement(model, target, held, seq, device, max_bytes, batch=16):
    """Teacher-forced on held-out text (windows of seq bytes after <|bos|>, as td.heldout_bpb): the
    fraction of positions where the drafter's most likely byte is the target's, and the mean
    KL(target || drafter) in bits. <|bos|> is left out of both argmaxes, as the greedy loops do."""
    model.eval()
    agree, kl, n = 0, 0.0, 0
    for h in held:
        h = h[: max_bytes // len(held)]
        nwin = h.numel() // seq
        wins = h[: nwin * seq].view(nwin, seq).long()
        for i in range(0, nwin, batch):
            x = wins[i:i + batch].to(device)
            x = torch.cat([torch.full((x.shape[0], 1), td.BOS, dtype=torch.long, device=device), x[:, :-1]], 1)
            lq, lp = drafter_logprobs(model, x, False), target_logprobs(target, x)
            kl += float(kl_per_position(lq, lp)) * x.numel()
            lq[..., td.BOS], lp[..., td.BOS] = -float("inf"), -float("inf")
            agree += int((lq.argmax(-1) == lp.argmax(-1)).sum())
            n += x.numel()
    model.train()
    return agree / max(n, 1), kl / max(n, 1) / math.log(2), n


def layer_pattern(a):
    """The drafter's layers as a string of K (KDA) and M (MLA), first layer first."""
    p = a.layer_pattern.upper() if a.layer_pattern else "K" * a.kda_layers + "M" * a.mla_layers
    if not p or set(p) - {"K", "M"}:
        sys.exit(f"layer pattern {p!r}: letters K (KDA) and M (MLA) only, at least one")
    if "M" not in p:
        # transformers' cache asks an attention layer for the sequence length (get_seq_length), so a
        # KDA-only model fails its cached forward: the reload check, the samples, the acceptance replay
        sys.exit(f"layer pattern {p!r}: needs an MLA layer (transformers' KimiLinear cache fails without one)")
    return p


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/corpus")
    ap.add_argument("--target", default="models/duet-demo")
    ap.add_argument("--out", required=True, help="model folder to write (models/duet-demo-draft is the shipped one)")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: cuda when available")
    ap.add_argument("--amp", choices=["bf16", "fp32"], default="bf16",
                    help="on cuda, the drafter's autocast (fp32 master weights either way); the CPU runs fp32")
    ap.add_argument("--minutes", type=float, default=8.0, help="wall-clock budget for the training loop")
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8, help="corpus windows per step (cross-entropy and teacher-forced KL)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--log-every", type=int, default=25, help="progress line every N steps (and at least every minute)")
    # the drafter: KDA and MLA layers, dense MLPs (train_demo.make_config's sizes)
    ap.add_argument("--kda-layers", type=int, default=1, help="KDA layers, placed first")
    ap.add_argument("--mla-layers", type=int, default=1, help="MLA layers, after the KDA layers")
    ap.add_argument("--layer-pattern", default="", help="layer order as K/M letters (e.g. KMK); overrides the counts")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--kda-heads", type=int, default=2)
    ap.add_argument("--kda-head-dim", type=int, default=64)
    ap.add_argument("--mla-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32, help="MLA qk_nope = v_head_dim")
    ap.add_argument("--rope", type=int, default=16, help="MLA qk_rope_head_dim (NoPE: no rotation is applied)")
    ap.add_argument("--kv-lora", type=int, default=64)
    ap.add_argument("--dense-inter", type=int, default=512)
    # losses and distillation
    ap.add_argument("--ce-weight", type=float, default=1.0, help="cross-entropy on the corpus windows")
    ap.add_argument("--tf-weight", type=float, default=1.0, help="teacher-forced KL(target || drafter) on the corpus windows")
    ap.add_argument("--kd-weight", type=float, default=1.0, help="KL(target || drafter) on the greedy-continuation windows")
    ap.add_argument("--teacher-minutes", type=float, default=4.0, help="time for greedy labelling (0: none)")
    ap.add_argument("--teacher-max-windows", type=int, default=0, help="stop greedy labelling at this many windows (0: time only)")
    ap.add_argument("--teacher-batch", type=int, default=256)
    ap.add_argument("--teacher-cache", default="", help="file to save the greedy windows to, or load them from")
    ap.add_argument("--prompt-len", type=int, default=64, help="corpus bytes before the target's continuation")
    ap.add_argument("--gen-len", type=int, default=192, help="bytes of the target's greedy continuation")
    ap.add_argument("--kd-batch", type=int, default=16, help="greedy windows per step")
    ap.add_argument("--eval-bytes", type=int, default=400_000, help="held-out bytes for bits per byte")
    ap.add_argument("--agree-bytes", type=int, default=100_000, help="held-out bytes for agreement with the target")
    ap.add_argument("--sample-len", type=int, default=200)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    pattern = layer_pattern(a)
    # train_demo.make_config's remaining knobs: the pattern's MLA layers, every MLP dense. The expert
    # sizes describe layers the drafter does not have; they keep the target's values, which the
    # cross-field checks (top-k <= experts, ...) of transformers and duet accept.
    a.layers = len(pattern)
    mla_list = [i + 1 for i, t in enumerate(pattern) if t == "M"]
    a.mla_layers_spec = ",".join(map(str, mla_list)) if mla_list else "none"
    a.dense_layers, a.experts, a.moe_inter = a.layers, 8, 128

    t_start = time.time()
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device")
    device = torch.device(a.device)
    amp = device.type == "cuda" and a.amp == "bf16"
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        where = f"{torch.cuda.get_device_name()}, {'bf16 autocast' if amp else 'fp32'}"
    else:
        where = f"CPU, {torch.get_num_threads()} threads, fp32"
    log(f"device {device} ({where}); torch {torch.__version__}, transformers {transformers.__version__}")
    train, held = td.load_data(a.data)
    train_dev = [t.to(device) for t in train]
    weights = torch.tensor([float(t.numel()) for t in train])

    target = load_target(a.target, device)
    tgt_total, tgt_active = td.count_params(target, target.config)
    kd_ids = kd_lp = None
    teacher_time = 0.0
    if a.kd_weight > 0 and a.kd_batch > 0:
        if a.teacher_cache and os.path.exists(a.teacher_cache):
            kd_ids, kd_lp = torch.load(a.teacher_cache, map_location=device)
            log(f"teacher: {kd_ids.shape[0]} greedy windows from {a.teacher_cache}")
        elif a.teacher_minutes > 0:
            t0 = time.time()
            kd_ids, kd_lp = teacher_windows(target, train, weights, a, device)
            teacher_time = time.time() - t0
            if a.teacher_cache:
                torch.save((kd_ids.cpu(), kd_lp.cpu()), a.teacher_cache)
    if kd_ids is not None:
        tgt_bpb = -kd_lp[:, : a.prompt_len].float().gather(-1, kd_ids[:, 1: a.prompt_len + 1, None].long()).mean()
        log(f"teacher: {kd_ids.shape[0]} greedy windows x {kd_lp.shape[1]} positions; target on their corpus part: "
            f"{tgt_bpb / math.log(2):.3f} bits/byte")

    # make_config reads --mla-layers as train_demo spells it: the 1-based MLA layer list
    config = td.make_config(argparse.Namespace(**dict(vars(a), mla_layers=a.mla_layers_spec)))
    model = KimiLinearForCausalLM(config).to(device).float().train()
    total, _ = td.count_params(model, config)
    # What a decode step reads: every weight but the embedding table (a row lookup).
    step_params, tgt_step_params = total - td.VOCAB * config.hidden_size, tgt_active - td.VOCAB * target.config.hidden_size
    cost = step_params / tgt_step_params
    kda_list = [i + 1 for i, t in enumerate(pattern) if t == "K"]
    log(f"drafter: {total:,} params, layers {pattern} (KDA {kda_list}, MLA {mla_list}), hidden {config.hidden_size}; "
        f"{step_params:,} weights read per decode step = {cost:.1%} of the target's {tgt_step_params:,}")
    opt = td.make_optimizer(model, a.lr, a.wd, device)

    use_corpus = a.ce_weight > 0 or a.tf_weight > 0
    use_kd = kd_ids is not None

    def losses(batch, kd_batch):
        """This step's weighted loss and its parts (nats per position)."""
        parts, loss = {}, 0.0
        if use_corpus:
            x = td.batch_from(train_dev, weights, batch, a.seq, device)
            logq = drafter_logprobs(model, x[:, :-1], amp)
            parts["ce"] = F.nll_loss(logq.reshape(-1, td.VOCAB), x[:, 1:].reshape(-1))
            loss = loss + a.ce_weight * parts["ce"]
            if a.tf_weight > 0:
                lp = target_logprobs(target, x[:, :-1])
                parts["tf"] = kl_per_position(logq, lp)
                parts["target_ce"] = F.nll_loss(lp.reshape(-1, td.VOCAB), x[:, 1:].reshape(-1))
                loss = loss + a.tf_weight * parts["tf"]
        if use_kd:
            idx = torch.randint(0, kd_ids.shape[0], (kd_batch,), device=device)
            parts["kd"] = kl_per_position(drafter_logprobs(model, kd_ids[idx, :-1].long(), amp), kd_lp[idx])
            loss = loss + a.kd_weight * parts["kd"]
        return loss, parts

    batch, kd_batch = a.batch, a.kd_batch
    if not use_corpus and not use_kd:
        sys.exit("nothing to train on: --ce-weight and --tf-weight are 0 and there are no greedy windows")
    if device.type == "cuda":
        # Halve the batches until a step fits in memory.
        while True:
            try:
                loss, _ = losses(batch, kd_batch)
                loss.backward()
                opt.zero_grad(set_to_none=True)
                break
            except torch.OutOfMemoryError:
                loss = None
                opt.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                if batch == 1 and kd_batch == 1:
                    raise
                batch, kd_batch = max(1, batch // 2), max(1, kd_batch // 2)
                log(f"OOM: batch {batch}, kd batch {kd_batch}")
        log(f"batch {batch} x {a.seq} corpus bytes + {kd_batch if use_kd else 0} greedy windows; "
            f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    per_step = (batch * a.seq if use_corpus else 0) + (kd_batch * kd_lp.shape[1] if use_kd else 0)

    budget, t0 = a.minutes * 60.0, time.time()
    step, positions, last_log = 0, 0, t0
    while True:
        elapsed = time.time() - t0
        if elapsed >= budget or (a.max_steps and step >= a.max_steps):
            break
        lr = td.lr_at(step, min(1.0, elapsed / budget), a.lr, a.warmup, a.min_lr_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        loss, parts = losses(batch, kd_batch)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        positions += per_step
        now = time.time()
        if step <= 3 or step % a.log_every == 0 or now - last_log >= 60:
            names = {"ce": "ce", "tf": "tf-kl", "kd": "kd-kl", "target_ce": "target ce"}
            log(f"step {step:6d}  " + "  ".join(f"{names[k]} {v.item() / math.log(2):.3f}" for k, v in parts.items())
                + f" bits  lr {lr:.2e}  gnorm {float(gnorm):.2f}  positions/s {positions / (now - t0):,.0f}"
                f"  elapsed {now - t0:.0f}s")
            last_log = now
    train_time = time.time() - t0
    log(f"training done: {step} steps, {positions:,} positions, {train_time:.0f}s")

    if device.type == "cuda":  # the checks and figures below in plain fp32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    nbytes, _ = td.save_model(model, config, a.out, shard_mib=64)
    err = td.verify_reload(model, config, a.out, device)
    log(f"saved {nbytes / 2**20:.2f} MiB to {a.out}; reload check ok (max |logit diff| {err:.2e})")
    model = KimiLinearForCausalLM.from_pretrained(a.out, dtype=torch.float32).to(device).eval()  # what ships: bf16 weights
    bpb, nb = td.heldout_bpb(model, held, a.seq, device, a.eval_bytes, amp=False)
    log(f"held-out: {bpb:.4f} bits/byte over {nb:,} bytes")
    agree, agree_kl, na = heldout_agreement(model, target, held, a.seq, device, a.agree_bytes)
    log(f"held-out agreement with the target: {agree:.3f} of {na:,} positions; KL(target || drafter) {agree_kl:.3f} bits")
    samples = []
    for prompt in ["The LORD said unto Moses,", "The jury "]:
        txt = td.generate(model, prompt, a.sample_len, device, amp=False)
        samples.append((prompt, txt))
        log(f"--- greedy sample ---\n{txt}\n")

    c = config
    name = os.path.basename(os.path.normpath(a.out))
    target_name = os.path.basename(os.path.normpath(a.target))
    cmd = "python tools/train_draft.py " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    kinds = {"K": "KDA", "M": "MLA"}
    layers_txt = ", ".join(kinds[t] for t in pattern)
    kda_row = (f"| KDA layers (1-based) | {kda_list}: {c.linear_num_heads} heads x {c.linear_head_dim}, short conv "
               f"{c.linear_conv_kernel_dim} |\n" if kda_list else "")
    mla_row = (f"| MLA layers (1-based) | {mla_list}: {c.num_attention_heads} heads, qk_nope {c.qk_nope_head_dim}, qk_rope "
               f"{c.qk_rope_head_dim}, v {c.v_head_dim}, kv_lora_rank {c.kv_lora_rank}, q_lora_rank null (NoPE, as in "
               f"every Kimi-Linear MLA layer) |\n" if mla_list else "")
    loss_lines = []
    if a.ce_weight > 0:
        loss_lines.append(f"{a.ce_weight:g} x cross-entropy on {batch} corpus windows of {a.seq} bytes after `<|bos|>`")
    if a.tf_weight > 0:
        where_tf = "the same windows" if a.ce_weight > 0 else f"{batch} corpus windows of {a.seq} bytes after `<|bos|>`"
        loss_lines.append(f"{a.tf_weight:g} x KL(target || drafter) on {where_tf}, teacher-forced (the target's "
                          f"full next-byte distribution at every position, from one fp32 forward of the target per step)")
    if use_kd:
        loss_lines.append(
            f"{a.kd_weight:g} x KL(target || drafter) over {kd_batch} of {kd_ids.shape[0]:,} windows of the target's "
            f"own greedy output ({a.prompt_len} corpus bytes after `<|bos|>`, then {a.gen_len} bytes of its greedy "
            f"continuation; its full distribution at each of the {kd_lp.shape[1]} positions), labelled "
            + (f"in {teacher_time:.0f} s before training" if teacher_time else f"earlier (loaded from `{a.teacher_cache}`)"))
    readme = f"""# {name}

A draft model for speculative decoding against [{target_name}](../{target_name}): a Kimi-Linear checkpoint
(transformers `KimiLinearForCausalLM`, Moonshot naming, hub config spelling) with {len(pattern)} layers,
**{layers_txt}** (first to last), and dense MLPs. Kimi-Linear's MLA layers are NoPE; the KDA layers
carry byte order (short convolution and recurrence). Same byte vocabulary (258: ids 0..255 the bytes,
256 `<|bos|>`, 257 `<|eos|>`) and the same `duet_tokenizer.json` as the target.

Made by `tools/train_draft.py` (transformers {transformers.__version__}, torch {torch.__version__}, {where},
seed {a.seed}):

    {cmd}

Trained on `{a.data}` and distilled from `{a.target}`: the same licence terms as those (see their READMEs).
The budgets are wall-clock, so a rerun on another machine gives a similar, not an identical, model.

## Files
- `config.json`: hub spelling; `linear_attn_config.kda_layers` = {kda_list}, `full_attn_layers` = {mla_list},
  `first_k_dense_replace` = {c.num_hidden_layers} (every MLP dense), `torch_dtype` bfloat16.
- `model.safetensors`: bf16 weights in Moonshot's naming ({nbytes / 2**20:.2f} MiB of tensors).
- `duet_tokenizer.json`: identical to the target's (`"add_bos": true`).

## Config
| | |
| --- | --- |
| vocab | {c.vocab_size} (bytes + 2 specials) |
| hidden | {c.hidden_size}, {c.num_hidden_layers} layers ({pattern}), rms_norm_eps {c.rms_norm_eps} |
{kda_row}{mla_row}| FFN | dense, intermediate {c.intermediate_size} (no experts) |
| parameters | {total:,} ({total / 1e6:.2f} M), all active; {step_params:,} read per decode step besides the embedding row, {cost:.1%} of the target's {tgt_step_params:,} |

## Training
- data: `{a.data}/*.txt` ({sum(t.numel() for t in train):,} training bytes); the last 2% of each file held out.
- loss per step: {"; ".join(loss_lines) if loss_lines else "none"}.
- {step:,} steps ({positions:,} positions) in {train_time:.0f} s of training; {"bf16 autocast, fp32 master weights" if amp else "fp32"}, AdamW (lr {a.lr:g}, betas 0.9/0.95, wd {a.wd}), {a.warmup} warmup steps then cosine over the wall-clock budget to {a.min_lr_frac:g} x lr, grad clip 1.0. Whole run (data, labelling, training, checks): {time.time() - t_start:.0f} s.
- **held-out: {bpb:.3f} bits per byte** over {nb:,} held-out bytes (windows of {a.seq} bytes after `<|bos|>`, fp32 with the saved bf16 weights{"; duet-demo: 1.730" if target_name == "duet-demo" else ""}).
- held-out agreement with the target (teacher-forced, the same windows, first {na:,} positions): the drafter's most likely byte is the target's at **{agree:.3f}** of positions; KL(target || drafter) {agree_kl:.3f} bits per position.

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
    summary = dict(device=where, layers=pattern, params=total, decode_cost_vs_target=cost, steps=step,
                   positions=positions, train_seconds=train_time, teacher_seconds=teacher_time, heldout_bpb=bpb,
                   heldout_bytes=nb, agree_top1=agree, agree_kl_bits=agree_kl, safetensors_bytes=nbytes,
                   total_seconds=time.time() - t_start)
    log("summary " + json.dumps(summary))
    log(f"model written to {os.path.abspath(a.out)}")


if __name__ == "__main__":
    main()
