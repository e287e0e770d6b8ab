#!/usr/bin/env python3
"""Train duet's bundled demo model (models/duet-demo) with transformers' KimiLinearForCausalLM.

  python tools/train_demo.py --data data/corpus --out models/duet-demo --minutes 9

Byte-level vocabulary: ids 0..255 are bytes, 256 = <|bos|>, 257 = <|eos|> (vocab 258).
Data: every *.txt in --data; the last 2% of each file is held out for the bits-per-byte figure.
Training: bf16 autocast, AdamW, warmup + cosine schedule over the wall-clock budget, random windows
of --seq bytes each preceded by <|bos|>; aux-loss-free router balancing (DeepSeek-V3 style: the
e_score_correction_bias of every MoE layer is nudged by --bias-rate * sign(mean load - load) after
each step), which also gives the demo a non-zero correction bias like the real checkpoints.
Output (Moonshot naming, tools/kimi_ckpt.py): config.json (hub spelling), bf16 safetensors (sharded
when larger than --shard-mib), duet_tokenizer.json, README.md with config, size, training and
held-out bits per byte, and samples.
"""

import argparse
import glob
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kimi_ckpt  # noqa: E402

import transformers  # noqa: E402
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402
from transformers.models.kimi_linear import modeling_kimi_linear as mkl  # noqa: E402

BOS, EOS, VOCAB = 256, 257, 258
# duet_tokenizer.json: every training window starts with <|bos|>, so duet-generate must prepend it.
TOKENIZER = {"type": "byte", "specials": ["<|bos|>", "<|eos|>"], "add_bos": True}


def log(*a):
    print(*a, flush=True)


def load_data(data_dir, held_frac=0.02):
    files = sorted(glob.glob(os.path.join(data_dir, "*.txt")))
    assert files, f"no *.txt in {data_dir}"
    train, held = [], []
    for fn in files:
        b = open(fn, "rb").read()
        cut = int(len(b) * (1 - held_frac))
        train.append(b[:cut])
        held.append(b[cut:])
        log(f"data: {os.path.basename(fn)} {len(b)} bytes, train {cut}, held-out {len(b) - cut}")
    return [torch.frombuffer(bytearray(x), dtype=torch.uint8) for x in train], \
        [torch.frombuffer(bytearray(x), dtype=torch.uint8) for x in held]


def make_config(a):
    """KimiLinearConfig from the command line's sizes. --mla-layers lists the 1-based MLA layers (the
    rest are KDA; "all" makes every layer MLA, "none" every layer KDA, as draft models may have); the
    first --dense-layers layers have a dense MLP, the rest MoE (the hub's first_k_dense_replace).
    a.kda_head_dim, when set and non-zero, sizes KDA heads apart from MLA's (drafters); else both
    use --head-dim."""
    n = a.layers
    if a.mla_layers == "all":
        mla = set(range(n))
    elif a.mla_layers == "none":
        mla = set()
    else:
        mla = {int(i) - 1 for i in a.mla_layers.split(",")}  # 1-based like the hub's full_attn_layers
    assert all(0 <= i < n for i in mla), f"--mla-layers {a.mla_layers} outside 1..{n}"
    assert 0 <= a.dense_layers <= n, f"--dense-layers {a.dense_layers} outside 0..{n}"
    layer_types = ["full_attention" if i in mla else "linear_attention" for i in range(n)]
    return KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=a.hidden, intermediate_size=a.dense_inter,
        moe_intermediate_size=a.moe_inter, num_hidden_layers=n, num_attention_heads=a.mla_heads,
        num_key_value_heads=a.mla_heads, n_shared_experts=1, routed_scaling_factor=2.446,
        kv_lora_rank=a.kv_lora, q_lora_rank=None, qk_rope_head_dim=a.rope, v_head_dim=a.head_dim,
        qk_nope_head_dim=a.head_dim, n_group=1, topk_group=1, num_experts_per_tok=2, norm_topk_prob=True,
        hidden_act="silu", max_position_embeddings=1048576, initializer_range=0.02, rms_norm_eps=1e-5,
        pad_token_id=None, bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False,
        num_local_experts=a.experts, layer_types=layer_types,
        mlp_layer_types=["dense"] * a.dense_layers + ["sparse"] * (n - a.dense_layers),
        linear_head_dim=getattr(a, "kda_head_dim", 0) or a.head_dim, linear_num_heads=a.kda_heads, linear_conv_kernel_dim=4,
    )


def count_params(model, config):
    total = sum(p.numel() for p in model.parameters())
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size
    n_moe = sum(1 for t in config.mlp_layer_types if t == "sparse")
    inactive = n_moe * (config.num_local_experts - config.num_experts_per_tok) * per_expert
    return total, total - inactive


def make_optimizer(model, lr, wd, device):
    """AdamW (betas 0.9/0.95) with weight decay on matrices only (not norms, biases, KDA's A_log/dt_bias)."""
    decay, no_decay = [], []
    for n_, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in n_ or "A_log" in n_ or "dt_bias" in n_ else decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def lr_at(step, prog, lr, warmup, min_lr_frac):
    """Linear warmup over `warmup` steps, then cosine to min_lr_frac * lr over the budget (prog in 0..1)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * (min_lr_frac + (1 - min_lr_frac) * 0.5 * (1 + math.cos(math.pi * prog)))


def batch_from(parts, weights, batch, seq, device, gen=None):
    """batch windows of seq bytes from the train parts (chosen in proportion to their size), with <|bos|>."""
    which = torch.multinomial(weights, batch, replacement=True, generator=gen)
    rows = []
    for i in range(len(parts)):
        k = int((which == i).sum())
        if k == 0:
            continue
        off = torch.randint(0, parts[i].numel() - seq, (k,), generator=gen, device=parts[i].device)
        idx = off[:, None] + torch.arange(seq, device=parts[i].device)[None]
        rows.append(parts[i][idx].long())
    x = torch.cat(rows, 0)
    bos = torch.full((x.shape[0], 1), BOS, dtype=torch.long, device=x.device)
    return torch.cat([bos, x], 1).to(device)  # [batch, seq+1]: input = [:, :-1], target = [:, 1:]


def lm_loss(model, x):
    logits = model(input_ids=x[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


@torch.no_grad()
def heldout_bpb(model, held, seq, device, max_bytes, batch=16, amp=True):
    """Bits per byte over the held-out text: non-overlapping windows of seq bytes, each after <|bos|>
    (so early bytes of a window see little context: this slightly overstates the bpb)."""
    model.eval()
    tot_nll, tot_n = 0.0, 0
    per_part = max_bytes // len(held)
    for h in held:
        h = h[:per_part]
        nwin = h.numel() // seq
        wins = h[: nwin * seq].view(nwin, seq).long()
        for i in range(0, nwin, batch):
            x = wins[i:i + batch].to(device)
            x = torch.cat([torch.full((x.shape[0], 1), BOS, dtype=torch.long, device=device), x], 1)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
                logits = model(input_ids=x[:, :-1], use_cache=False).logits
            nll = F.cross_entropy(logits.float().reshape(-1, VOCAB), x[:, 1:].reshape(-1), reduction="sum")
            tot_nll += nll.item()
            tot_n += x[:, 1:].numel()
    model.train()
    return tot_nll / tot_n / math.log(2), tot_n


@torch.no_grad()
def generate(model, prompt, n, device, temperature=0.0, top_k=0, seed=0, amp=True):
    """Hand-written cached decode loop (prefill, then one token a step)."""
    model.eval()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = [BOS] + list(prompt.encode("utf-8"))
    x = torch.tensor([ids], device=device)
    out_ids = []
    past = None
    for _ in range(n):
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
            out = model(input_ids=x, past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1].float().cpu()
        logits[BOS] = -float("inf")
        if temperature <= 0:
            tok = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                v, _ = logits.topk(top_k)
                logits[logits < v[-1]] = -float("inf")
            tok = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        if tok == EOS:
            break
        out_ids.append(tok)
        x = torch.tensor([[tok]], device=device)
    model.train()
    return prompt + bytes(out_ids).decode("utf-8", errors="replace")


def save_model(model, config, out_dir, shard_mib):
    sd = kimi_ckpt.internal_to_moonshot(model.state_dict(), config)
    sd = {k: v.to(torch.bfloat16).cpu() for k, v in sd.items()}
    nbytes = sum(v.numel() * v.element_size() for v in sd.values())
    shards = max(1, math.ceil(nbytes / (shard_mib * 2 ** 20)))
    kimi_ckpt.save_moonshot(out_dir, sd, kimi_ckpt.hub_config(config, dtype="bfloat16"), n_shards=shards)
    with open(os.path.join(out_dir, "duet_tokenizer.json"), "w") as f:
        json.dump(TOKENIZER, f)
        f.write("\n")
    return nbytes, shards


@torch.no_grad()
def verify_reload(model, config, out_dir, device):
    """Reload with from_pretrained; weights must equal the bf16-rounded trained weights and a
    forward must match the in-memory model (rounded to bf16, computed in fp32)."""
    ref = KimiLinearForCausalLM(config).to(device).float().eval()
    ref.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    re = KimiLinearForCausalLM.from_pretrained(out_dir, dtype=torch.float32).to(device).eval()
    kimi_ckpt.check_weights_equal(ref, re)
    x = torch.tensor([[BOS] + list(b"In the beginning God created the heaven and the earth.")], device=device)
    a, b = ref(input_ids=x).logits, re(input_ids=x).logits
    err = (a - b).abs().max().item()
    assert err < 1e-4, f"reloaded forward differs by {err}"
    return err


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/corpus")
    ap.add_argument("--out", default="models/duet-demo")
    ap.add_argument("--minutes", type=float, default=9.0, help="wall-clock budget for the training loop")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0 = no limit)")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--bias-rate", type=float, default=1e-3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--mla-layers", default="4,8", help='1-based MLA layer numbers (or "all"); the rest are KDA')
    ap.add_argument("--dense-layers", type=int, default=1, help="the first N layers have a dense MLP, the rest MoE")
    ap.add_argument("--kda-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64, help="KDA head dim = MLA qk_nope = v_head_dim")
    ap.add_argument("--mla-heads", type=int, default=4)
    ap.add_argument("--rope", type=int, default=32)
    ap.add_argument("--kv-lora", type=int, default=128)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--moe-inter", type=int, default=128)
    ap.add_argument("--dense-inter", type=int, default=768)
    ap.add_argument("--eval-bytes", type=int, default=400_000)
    ap.add_argument("--shard-mib", type=float, default=15.0)
    ap.add_argument("--sample-len", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()

    t_start = time.time()
    torch.manual_seed(a.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    amp = True
    log(f"device {device}{' ' + torch.cuda.get_device_name() if device.type == 'cuda' else ''}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    train, held = load_data(a.data)
    train_dev = [t.to(device) for t in train]
    weights = torch.tensor([float(t.numel()) for t in train])

    config = make_config(a)
    model = KimiLinearForCausalLM(config).to(device).float()
    model.train()
    total, active = count_params(model, config)
    log(f"model: {total / 1e6:.2f} M params ({active / 1e6:.2f} M active per token); layer_types "
        f"{''.join('M' if t == 'full_attention' else 'K' for t in config.layer_types)}")

    # Aux-loss-free balancing: count expert loads in each router's forward.
    routers = [m for m in model.modules() if isinstance(m, mkl.KimiLinearTopkRouter)]
    loads = {id(r): torch.zeros(config.num_local_experts, device=device) for r in routers}

    def count_hook(mod, inp, out):
        if mod.training:
            loads[id(mod)] += torch.bincount(out[2].reshape(-1), minlength=config.num_local_experts).float()

    for r in routers:
        r.register_forward_hook(count_hook)

    opt = make_optimizer(model, a.lr, a.wd, device)

    # Find a batch size that fits (halve on OOM); fall back to the eager experts loop if the
    # default experts implementation (grouped_mm on Hopper) fails in training.
    batch = a.batch
    log(f"experts implementation: {model.config._experts_implementation}")
    while True:
        try:
            x = batch_from(train_dev, weights, batch, a.seq, device)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
                loss = lm_loss(model, x)
            loss.backward()
            opt.zero_grad(set_to_none=True)
            break
        except torch.OutOfMemoryError:
            loss = None
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            batch //= 2
            log(f"OOM: batch -> {batch}")
            assert batch >= 1
        except Exception as e:  # noqa: BLE001
            if model.config._experts_implementation == "eager":
                raise
            log(f"training step failed with experts '{model.config._experts_implementation}' ({e!r}); using eager")
            opt.zero_grad(set_to_none=True)
            model.set_experts_implementation("eager")
    for r in routers:
        loads[id(r)].zero_()
    if device.type == "cuda":
        log(f"batch {batch} x seq {a.seq}; peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")

    budget = a.minutes * 60.0
    t0 = time.time()
    step, tokens, ema = 0, 0, None
    last_log = t0
    while True:
        elapsed = time.time() - t0
        if elapsed >= budget or (a.max_steps and step >= a.max_steps):
            break
        lr = lr_at(step, min(1.0, elapsed / budget), a.lr, a.warmup, a.min_lr_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        x = batch_from(train_dev, weights, batch, a.seq, device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
            loss = lm_loss(model, x)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for r in routers:
                ld = loads[id(r)]
                r.e_score_correction_bias.add_(a.bias_rate * torch.sign(ld.mean() - ld))
                ld.zero_()
        step += 1
        tokens += batch * a.seq
        now = time.time()
        if step <= 3 or now - last_log >= 15 or step % 200 == 0:
            lv = loss.item()
            ema = lv if ema is None else 0.9 * ema + 0.1 * lv
            log(f"step {step:6d}  loss {lv:.4f} ({lv / math.log(2):.3f} bits/byte)  lr {lr:.2e}  "
                f"gnorm {float(gnorm):.2f}  tok/s {tokens / (now - t0):,.0f}  elapsed {now - t0:.0f}s")
            last_log = now
    train_time = time.time() - t0
    log(f"training done: {step} steps, {tokens:,} tokens, {train_time:.0f}s")

    nbytes, shards = save_model(model, config, a.out, a.shard_mib)
    log(f"saved {nbytes / 2**20:.1f} MiB in {shards} file(s) to {a.out}")

    def write_readme(bpb, nb, samples):
        c = config
        mla = [i + 1 for i, t in enumerate(c.layer_types) if t == "full_attention"]
        kda = [i + 1 for i, t in enumerate(c.layer_types) if t == "linear_attention"]
        files = "model.safetensors" if shards == 1 else f"model-0000i-of-{shards:05d}.safetensors + model.safetensors.index.json"
        readme = f"""# duet-demo

A tiny Kimi-Linear model (transformers `KimiLinearForCausalLM` architecture: KDA + MLA + MoE) trained
from scratch on the project's English corpus, bundled so that duet can serve something readable
without downloading a 48B checkpoint. It is a toy: expect English-looking text, not sense.

Made by `tools/train_demo.py` (transformers {transformers.__version__}, torch {torch.__version__},
{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}):

    python tools/train_demo.py --data <corpus dir> --out models/duet-demo --minutes {a.minutes:g} \\
        --seq {a.seq} --batch {batch} --lr {a.lr:g} --hidden {a.hidden} --layers {a.layers} --mla-layers {a.mla_layers} \\
        --experts {a.experts} --moe-inter {a.moe_inter} --dense-inter {a.dense_inter}

## Files
- `config.json`: hub spelling (`linear_attn_config` with 1-based `kda_layers` / `full_attn_layers`,
  `first_k_dense_replace`, `num_experts`, ...), `torch_dtype` bfloat16.
- `{files}`: bf16 weights in Moonshot's naming ({nbytes / 2**20:.1f} MiB).
- `duet_tokenizer.json`: byte-level tokenizer: ids 0..255 are the bytes, 256 = `<|bos|>`, 257 = `<|eos|>`.
  Prompts should start with `<|bos|>` (every training window did); its `"add_bos": true` makes
  duet-generate prepend config.json's `bos_token_id` to text prompts. The model never saw `<|eos|>`.

## Config
| | |
| --- | --- |
| vocab | {c.vocab_size} (bytes + 2 specials) |
| hidden | {c.hidden_size}, {c.num_hidden_layers} layers, rms_norm_eps {c.rms_norm_eps} |
| KDA layers (1-based) | {kda}: {c.linear_num_heads} heads x {c.linear_head_dim}, short conv {c.linear_conv_kernel_dim} |
| MLA layers (1-based) | {mla}: {c.num_attention_heads} heads, qk_nope {c.qk_nope_head_dim}, qk_rope {c.qk_rope_head_dim}, v {c.v_head_dim}, kv_lora_rank {c.kv_lora_rank}, q_lora_rank null |
| FFN | layer 1 dense (intermediate {c.intermediate_size}); layers 2-{c.num_hidden_layers} MoE: {c.num_local_experts} experts top-{c.num_experts_per_tok} (sigmoid router, renormalised, routed_scaling_factor {c.routed_scaling_factor}), expert intermediate {c.moe_intermediate_size}, 1 shared expert |
| parameters | {total:,} ({total / 1e6:.2f} M), {active:,} active per token |

## Training
- data: `data/corpus/*.txt` (World English Bible + Brown corpus, {sum(t.numel() for t in train):,} training bytes); the last 2% of each file held out.
- {step:,} steps of {batch} x {a.seq} bytes ({tokens:,} tokens, {tokens / sum(t.numel() for t in train):.1f} epochs) in {train_time:.0f} s; bf16 autocast, AdamW (lr {a.lr:g}, betas 0.9/0.95, wd {a.wd}), {a.warmup} warmup steps then cosine over the wall-clock budget to {a.min_lr_frac:g} x lr, grad clip 1.0.
- router: aux-loss-free balancing (e_score_correction_bias += {a.bias_rate:g} * sign(mean load - load) per step).
- **held-out: {"%.3f" % bpb if bpb is not None else "(not measured yet)"} bits per byte** over {nb:,} held-out bytes (windows of {a.seq} bytes after `<|bos|>`).

## Samples (transformers, bf16 autocast, cached decoding, {a.sample_len} bytes)
"""
        for prompt, kind, txt in samples:
            readme += f"\n{kind}, prompt `{prompt}`:\n\n```\n{txt}\n```\n"
        if not samples:
            readme += "\n(not written yet)\n"
        with open(os.path.join(a.out, "README.md"), "w") as f:
            f.write(readme)

    write_readme(None, 0, [])
    err = verify_reload(model, config, a.out, device)
    log(f"reload check ok (max |logit diff| {err:.2e})")

    bpb, nb = heldout_bpb(model, held, a.seq, device, a.eval_bytes, amp=amp)
    log(f"held-out: {bpb:.4f} bits/byte over {nb:,} bytes")

    samples = []
    for prompt, temp, topk, seed in [("The ", 0.0, 0, 0), ("And God said", 0.0, 0, 0),
                                     ("The jury ", 0.8, 40, 1), ("In the morning ", 0.8, 40, 2)]:
        txt = generate(model, prompt, a.sample_len, device, temperature=temp, top_k=topk, seed=seed, amp=amp)
        kind = "greedy" if temp <= 0 else f"sampled, temperature {temp}, top-k {topk}, seed {seed}"
        samples.append((prompt, kind, txt))
        log(f"--- sample ({kind}) ---\n{txt}\n")
    write_readme(bpb, nb, samples)

    summary = dict(params=total, active_params=active, steps=step, tokens=tokens, train_seconds=train_time,
                   heldout_bpb=bpb, heldout_bytes=nb, batch=batch, seq=a.seq, shards=shards,
                   total_seconds=time.time() - t_start)
    log("summary " + json.dumps(summary))


if __name__ == "__main__":
    main()
