#!/usr/bin/env python3
"""Reference benchmark: Hugging Face transformers' KimiLinearForCausalLM at Kimi-Linear-48B-A3B's dims.

Random weights, exact dimensions (bench/configs/kimi-linear-48b/config.json, hub spelling; the file duet-bench-model-cuda reads), bf16, one GPU. Measures:

  * decode-step time: model(input_ids=[B,1], past_key_values=cache, use_cache=True) at batch B with a
    cache that already holds C tokens of context (median over --steps timed steps after --warmup steps);
  * prefill throughput: one forward of 1 x P tokens (use_cache=True, logits_to_keep=1), tokens/s.

Results are JSON lines on stdout, progress on stderr:

  {"impl":"transformers","info":true,"params":...,"gpu":...,"torch":...,"transformers":...,...}
  {"impl":"transformers","layers":N,"batch":B,"context":C,"step_ms":...,...}
  {"impl":"transformers","layers":N,"prefill":P,"tok_s":...,...}
  (a case that cannot run has "skipped":true, "reason":..., and step_ms / tok_s null)

The context is not prefilled (32K x 64 tokens through transformers would take far too long): a real
2-token forward at batch B creates the model's own cache object (a DynamicCache built from the config:
DynamicLayer for every MLA layer, LinearAttentionLayer for every KDA layer), then

  MLA layer i:  cache.layers[i].keys   <- randn [B, 1, C, kv_lora_rank]    (normed compressed latent)
                cache.layers[i].values <- randn [B, 1, C, qk_rope_head_dim] (shared rope key)
  KDA layer i:  cache.layers[i].conv_states[0]      [B, 3*H*K, conv_kernel] filled in place (randn)
                cache.layers[i].recurrent_states[0] [B, H, K, V] fp32       filled in place (0.05*randn)
                (has_previous_state[0] is already True from the real forward -> decode path)

so cache.get_seq_length() == C and every timed step appends one token (DynamicLayer torch.cat), exactly
as transformers' generate() would after a C-token prefill.

Usage (GPU):
  python tools/bench_transformers.py --layers 27                 # 1,8,64 x 2048,32768 + prefill 2048,8192
  python tools/bench_transformers.py --layers 8 --batch 1,8 --context 2048 --prefill 2048
CPU self-test (tiny dims):
  python tools/bench_transformers.py --tiny --device cpu --dtype float32 --layers 8
"""

import argparse
import gc
import inspect
import json
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG = os.path.join(HERE, "..", "bench", "configs", "kimi-linear-48b", "config.json")

# Tiny dims for the CPU self-test (same structure: MLA without q_lora, KDA, dense layer 0 + MoE).
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_attention_heads=2, num_key_value_heads=2, num_experts=16, num_experts_per_token=4,
            num_shared_experts=1, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            bos_token_id=509, eos_token_id=510, pad_token_id=511)
TINY_LINEAR = dict(head_dim=32, num_heads=2)

T0 = time.time()
KDA_PATH = {}


def log(msg):
    print(f"[{time.time() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def emit(d):
    print(json.dumps(d), flush=True)


def int_list(s):
    return [int(x) for x in s.split(",") if x.strip()]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=27, help="number of decoder layers (27 = full model; 8 = slice). "
                   "MLA layers are 1-based every 4th layer plus the last, as in the hub config")
    p.add_argument("--batch", type=int_list, default=None, help="decode batch sizes (default 1,8,64; tiny 1,4)")
    p.add_argument("--context", type=int_list, default=None,
                   help="decode context lengths (default 2048,32768; tiny 32,160)")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per case (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed decode steps before timing (default 3)")
    p.add_argument("--prefill", type=int_list, default=None,
                   help="prefill lengths at batch 1 (default 2048,8192; tiny 64,200); empty string = none")
    p.add_argument("--prefill-reps", type=int, default=2, help="timed prefill forwards per length (default 2)")
    p.add_argument("--max-seconds", type=float, default=120.0,
                   help="guard: skip a case whose estimated time exceeds this; cut timed reps/steps to fit")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "bfloat16", "fp16", "float16", "fp32", "float32"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny dims (CPU self-test)")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="hub-spelling config.json (default bench/configs/kimi-linear-48b/config.json)")
    p.add_argument("--attn-impl", default=None,
                   help="transformers attn_implementation (default: transformers' choice, normally sdpa)")
    p.add_argument("--experts-impl", default=None,
                   help="transformers experts_implementation (default: transformers' choice, grouped_mm if available)")
    p.add_argument("--force", action="store_true", help="attempt decode cases the memory estimate says won't fit")
    p.add_argument("--headroom-gib", type=float, default=3.0, help="free memory kept in reserve by the estimate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-cache", action="store_true",
                   help="run the cache-construction self-test first (default on with --tiny)")
    p.add_argument("--no-check-cache", action="store_true", help="skip the self-test with --tiny")
    a = p.parse_args()
    if a.batch is None:
        a.batch = [1, 4] if a.tiny else [1, 8, 64]
    if a.context is None:
        a.context = [32, 160] if a.tiny else [2048, 32768]
    if a.prefill is None:
        a.prefill = [64, 200] if a.tiny else [2048, 8192]
    return a


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------
def layer_split(n):
    """1-based (kda_layers, full_attn_layers): MLA every 4th layer plus the last (27 -> 4,8,...,24,27)."""
    full = [i for i in range(1, n + 1) if i % 4 == 0 or i == n]
    kda = [i for i in range(1, n + 1) if i not in full]
    return kda, full


def build_config(args):
    from transformers import KimiLinearConfig

    with open(args.config) as f:
        d = json.load(f)
    n = args.layers
    kda, full = layer_split(n)
    if n == d["num_hidden_layers"]:
        la = d["linear_attn_config"]
        assert (sorted(la["kda_layers"]), sorted(la["full_attn_layers"])) == (kda, full), \
            "config.json layer lists differ from the every-4th-plus-last rule"
    d["num_hidden_layers"] = n
    d["linear_attn_config"] = dict(d["linear_attn_config"], kda_layers=kda, full_attn_layers=full)
    if args.tiny:
        d.update(TINY)
        d["linear_attn_config"].update(TINY_LINEAR)
    for k in ("architectures", "torch_dtype", "dtype"):
        d.pop(k, None)
    c = KimiLinearConfig(**d)

    # Check that every hub-spelled field landed on the attribute transformers' modeling code reads.
    la = d["linear_attn_config"]
    expect = {
        "vocab_size": d["vocab_size"], "hidden_size": d["hidden_size"], "num_hidden_layers": n,
        "intermediate_size": d["intermediate_size"], "moe_intermediate_size": d["moe_intermediate_size"],
        "num_attention_heads": d["num_attention_heads"], "num_key_value_heads": d["num_key_value_heads"],
        "num_local_experts": d["num_experts"], "num_experts_per_tok": d["num_experts_per_token"],
        "n_shared_experts": d["num_shared_experts"], "n_group": d["num_expert_group"],
        "topk_group": d["topk_group"], "norm_topk_prob": d["moe_renormalize"],
        "routed_scaling_factor": d["routed_scaling_factor"], "kv_lora_rank": d["kv_lora_rank"],
        "q_lora_rank": d["q_lora_rank"], "qk_nope_head_dim": d["qk_nope_head_dim"],
        "qk_rope_head_dim": d["qk_rope_head_dim"], "v_head_dim": d["v_head_dim"],
        "linear_head_dim": la["head_dim"], "linear_num_heads": la["num_heads"],
        "linear_conv_kernel_dim": la["short_conv_kernel_size"], "rms_norm_eps": d["rms_norm_eps"],
        "tie_word_embeddings": d["tie_word_embeddings"], "hidden_act": d["hidden_act"],
        "layer_types": ["full_attention" if i + 1 in full else "linear_attention" for i in range(n)],
        "mlp_layer_types": ["dense" if i < d["first_k_dense_replace"] else "sparse" for i in range(n)],
    }
    for k, v in expect.items():
        got = getattr(c, k)
        if isinstance(got, tuple):
            got = list(got)
        assert got == v, f"KimiLinearConfig.{k} = {got!r}, expected {v!r} (config field name mismatch?)"
    assert d["moe_router_activation_func"] == "sigmoid" and d["moe_layer_freq"] == 1  # transformers hard-codes these
    return c


def count_params_formula(c):
    """Analytic parameter count (cross-check of the instantiated model)."""
    D, V = c.hidden_size, c.vocab_size
    H, nope, rope, vd, r = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    assert c.q_lora_rank is None
    mla = D * H * (nope + rope) + D * (r + rope) + r + r * H * (nope + vd) + H * vd * D
    hk = c.linear_num_heads * c.linear_head_dim
    kda = 3 * D * hk + 3 * hk * c.linear_conv_kernel_dim + (D * c.linear_head_dim + c.linear_head_dim * hk + hk
                                                           + c.linear_num_heads) + D * c.linear_num_heads \
        + D * c.linear_head_dim + c.linear_head_dim * hk + c.linear_head_dim + hk * D
    dense = 3 * D * c.intermediate_size
    moe = c.num_local_experts * 3 * D * c.moe_intermediate_size + c.num_local_experts * D \
        + 3 * D * c.moe_intermediate_size * c.n_shared_experts
    total = 2 * V * D + D
    for i in range(c.num_hidden_layers):
        total += 2 * D + (mla if c.layer_types[i] == "full_attention" else kda)
        total += dense if c.mlp_layer_types[i] == "dense" else moe
    return total


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------
def build_model(config, args, torch, dtype, device):
    """Instantiate on the meta device (no init, no memory), materialize uninitialized storage on the
    target device with to_empty, then fill every tensor there: normals (std 0.02) for matrices,
    ones for norm weights, FLA-style A_log / dt_bias, zeros for e_score_correction_bias."""
    from transformers import KimiLinearForCausalLM

    kw = {}
    if args.attn_impl:
        kw["attn_implementation"] = args.attn_impl
    if args.experts_impl:
        kw["experts_implementation"] = args.experts_impl
    with torch.device("meta"):
        model = KimiLinearForCausalLM._from_config(config, dtype=dtype, **kw)
    model.eval()
    model.to_empty(device=device)

    gen = torch.Generator(device=device).manual_seed(args.seed)
    std = 0.02
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # input/post_attention_layernorm, kv_a_layernorm, o_norm, model.norm
                p.fill_(1.0)
            elif name.endswith("A_log"):
                p.uniform_(1.0, 16.0, generator=gen).log_()
            elif name.endswith("dt_bias"):
                dt = torch.empty(p.shape, device=device, dtype=torch.float32)
                dt.uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp_().clamp_(min=1e-4)
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
                del dt
            else:
                p.normal_(0.0, std, generator=gen)
        for name, b in model.named_buffers():
            if not name.endswith("e_score_correction_bias"):
                log(f"note: unexpected buffer {name} {tuple(b.shape)} set to zero")
            b.zero_()
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    return model, dtypes


def kernel_paths(torch):
    """Which implementation transformers bound for the KDA / short-conv functions (fla / causal_conv1d
    package kernels, or the reference torch fallback in modeling_kimi_linear)."""
    from transformers.models.kimi_linear import modeling_kimi_linear as mkl

    out = {}
    for fn in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn",
               "causal_conv1d_update"):
        f = getattr(mkl, fn)
        impl = None
        try:
            impl = inspect.getclosurevars(f).nonlocals.get("implementation")
        except Exception:
            pass
        mod = getattr(impl, "__module__", None) or getattr(f, "__module__", "?")
        out[fn] = "torch fallback" if mod == mkl.__name__ else f"{mod}.{getattr(impl, '__name__', '?')}"
    return out


# ----------------------------------------------------------------------------------------------
# Timing helpers
# ----------------------------------------------------------------------------------------------
class Timer:
    def __init__(self, torch, device):
        self.torch, self.cuda = torch, device.type == "cuda"

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def run(self, fn):
        """-> (result, gpu_ms, wall_ms). Synchronizes before and after."""
        torch = self.torch
        self.sync()
        w0 = time.perf_counter()
        if self.cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            r = fn()
            e1.record()
            torch.cuda.synchronize()
            ms = e0.elapsed_time(e1)
        else:
            r = fn()
            ms = None
        wall = (time.perf_counter() - w0) * 1e3
        return r, (ms if ms is not None else wall), wall


def free_memory(torch, device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def is_oom(e, torch):
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def gib(x):
    return x / 2**30


# ----------------------------------------------------------------------------------------------
# Decode
# ----------------------------------------------------------------------------------------------
def cache_bytes(c, B, T, esz):
    n_mla = sum(1 for t in c.layer_types if t == "full_attention")
    n_kda = c.num_hidden_layers - n_mla
    hk = c.linear_num_heads * c.linear_head_dim
    mla = n_mla * B * T * (c.kv_lora_rank + c.qk_rope_head_dim) * esz
    kda = n_kda * B * (c.linear_num_heads * c.linear_head_dim * c.linear_head_dim * 4
                       + 3 * hk * c.linear_conv_kernel_dim * esz)
    return mla + kda


def mla_step_transient_bytes(c, B, T, esz):
    """Largest per-layer temporaries of one MLA decode step in transformers: DynamicLayer.update's torch.cat
    (new latent copy), expand_kv's kv_b_proj output [B,T,H*(nope+v)] and key_states [B,H,T,nope+rope], and
    a possible contiguous copy of value_states [B,H,T,v] inside attention."""
    H = c.num_attention_heads
    per_tok = ((c.kv_lora_rank + c.qk_rope_head_dim) + H * (c.qk_nope_head_dim + c.v_head_dim)
               + H * (c.qk_nope_head_dim + c.qk_rope_head_dim) + H * c.v_head_dim)
    return B * T * per_tok * esz


def build_decode_cache(model, c, B, C, torch, device, gen, src=None):
    """Real 2-token forward -> model's own cache; then MLA latents replaced by C random tokens and
    KDA conv/recurrent states filled with random values in place. With src (a cache from a real
    C-token prefill; self-test only) the same slots are filled with src's tensors instead."""
    from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

    ids = torch.randint(0, c.vocab_size, (B, 2), device=device, generator=gen)
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    del out
    assert len(cache.layers) == c.num_hidden_layers, (len(cache.layers), c.num_hidden_layers)
    hk = c.linear_num_heads * c.linear_head_dim
    for i, (t, layer) in enumerate(zip(c.layer_types, cache.layers)):
        if t == "full_attention":
            assert type(layer) is DynamicLayer, (i, type(layer))
            assert tuple(layer.keys.shape) == (B, 1, 2, c.kv_lora_rank), (i, layer.keys.shape)
            assert tuple(layer.values.shape) == (B, 1, 2, c.qk_rope_head_dim), (i, layer.values.shape)
            kd, vd = layer.keys.dtype, layer.values.dtype
            layer.keys = layer.values = None
            if src is None:
                layer.keys = torch.randn((B, 1, C, c.kv_lora_rank), device=device, dtype=kd, generator=gen)
                layer.values = torch.randn((B, 1, C, c.qk_rope_head_dim), device=device, dtype=vd, generator=gen)
            else:
                layer.keys = src.layers[i].keys.clone()
                layer.values = src.layers[i].values.clone()
                assert tuple(layer.keys.shape) == (B, 1, C, c.kv_lora_rank), layer.keys.shape
        else:
            assert isinstance(layer, LinearAttentionLayer), (i, type(layer))
            assert layer.has_previous_state[0], i
            cs, rs = layer.conv_states[0], layer.recurrent_states[0]
            assert tuple(cs.shape) == (B, 3 * hk, c.linear_conv_kernel_dim), (i, cs.shape)
            assert tuple(rs.shape) == (B, c.linear_num_heads, c.linear_head_dim, c.linear_head_dim), (i, rs.shape)
            if src is None:  # in place: keeps the static addresses
                cs.normal_(0.0, 1.0, generator=gen)
                rs.normal_(0.0, 0.05, generator=gen)
            else:
                cs.copy_(src.layers[i].conv_states[0])
                rs.copy_(src.layers[i].recurrent_states[0])
    assert cache.get_seq_length() == C, (cache.get_seq_length(), C)
    return cache


def check_cache_construction(model, c, torch, device, args, B=2, C=37, steps=3):
    """Self-test: decode after a real C-token prefill vs. decode on a cache built by build_decode_cache
    filled with that prefill's tensors -> logits must match (the constructed cache carries no other state)."""
    gen = torch.Generator(device=device).manual_seed(args.seed + 99)
    prompt = torch.randint(0, c.vocab_size, (B, C), device=device, generator=gen)
    ref = model(input_ids=prompt, use_cache=True, logits_to_keep=1).past_key_values
    syn = build_decode_cache(model, c, B, C, torch, device, gen, src=ref)
    worst = 0.0
    for _ in range(steps):
        nxt = torch.randint(0, c.vocab_size, (B, 1), device=device, generator=gen)
        a = model(input_ids=nxt, past_key_values=ref, use_cache=True).logits.float()
        b = model(input_ids=nxt, past_key_values=syn, use_cache=True).logits.float()
        worst = max(worst, (a - b).abs().max().item() / max(a.abs().max().item(), 1e-30))
    assert ref.get_seq_length() == syn.get_seq_length() == C + steps
    return worst


def global_warmup(model, c, args, torch, device, timer):
    """Untimed: first-call costs (cuBLAS/grouped_mm heuristics, allocator growth, clocks) kept out of the
    first measured case."""
    gen = torch.Generator(device=device).manual_seed(args.seed + 5)
    cache = build_decode_cache(model, c, 1, 16, torch, device, gen)
    for _ in range(5):
        ids = torch.randint(0, c.vocab_size, (1, 1), device=device, generator=gen)
        timer.run(lambda: model(input_ids=ids, past_key_values=cache, use_cache=True).logits)
    ids = torch.randint(0, c.vocab_size, (1, 128), device=device, generator=gen)
    timer.run(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1).logits)
    cache = None
    free_memory(torch, device)


def router_spread_hook(model, torch):
    """Hook on the first MoE router: records the number of distinct experts chosen in one forward."""
    from transformers.models.kimi_linear import modeling_kimi_linear as mkl

    rec = {}
    for m in model.modules():
        if isinstance(m, mkl.KimiLinearTopkRouter):
            def hook(mod, inp, out):
                rec["distinct"] = int(torch.unique(out[2]).numel())
                rec["tokens"] = int(out[2].shape[0])
            return m.register_forward_hook(hook), rec
    return None, rec


def run_decode_case(model, c, args, B, C, torch, device, timer, esz, weight_bytes):
    base = {"impl": "transformers", "layers": c.num_hidden_layers, "batch": B, "context": C}
    T = C + args.warmup + args.steps + 2
    need = cache_bytes(c, B, T, esz) + mla_step_transient_bytes(c, B, T, esz)
    if device.type == "cuda":
        free_memory(torch, device)
        free, total = torch.cuda.mem_get_info()
        budget = free - args.headroom_gib * 2**30
        if need > budget and not args.force:
            reason = (f"memory: cache {gib(cache_bytes(c, B, T, esz)):.1f} GiB (MLA latents {B}x{T}x"
                      f"{c.kv_lora_rank + c.qk_rope_head_dim}x{esz}B x {sum(t == 'full_attention' for t in c.layer_types)}"
                      f" layers + KDA states) + MLA decode temporaries {gib(mla_step_transient_bytes(c, B, T, esz)):.1f}"
                      f" GiB (kv_b_proj expansion of all {T} cached tokens, one layer at a time) = {gib(need):.1f} GiB"
                      f" > free {gib(free):.1f} GiB - headroom {args.headroom_gib:g} GiB (weights {gib(weight_bytes):.1f}"
                      f" GiB, device {gib(total):.1f} GiB)")
            log(f"decode B={B} C={C}: skipped ({reason})")
            return dict(base, step_ms=None, skipped=True, reason=reason, need_gib=round(gib(need), 2),
                        free_gib=round(gib(free), 2))
        torch.cuda.reset_peak_memory_stats()

    gen = torch.Generator(device=device).manual_seed(args.seed + 1000 * B + C)
    cache = None
    try:
        t0 = time.time()
        cache = build_decode_cache(model, c, B, C, torch, device, gen)
        timer.sync()
        log(f"decode B={B} C={C}: cache built in {time.time() - t0:.1f}s "
            f"({gib(cache_bytes(c, B, C, esz)):.2f} GiB); warm-up {args.warmup} steps")

        ids = torch.randint(0, c.vocab_size, (args.warmup + args.steps, B, 1), device=device, generator=gen)
        it = iter(ids)

        def step():
            return model(input_ids=next(it), past_key_values=cache, use_cache=True).logits

        hook, spread = router_spread_hook(model, torch)
        warm_ms = []
        try:
            for i in range(args.warmup):
                _, ms, _ = timer.run(step)
                warm_ms.append(ms)
                if hook is not None:
                    hook.remove()
                    hook = None
        finally:
            if hook is not None:
                hook.remove()
        steps = args.steps
        if warm_ms and steps * warm_ms[-1] / 1e3 > args.max_seconds:
            steps = max(1, int(args.max_seconds * 1e3 / warm_ms[-1]))
            log(f"decode B={B} C={C}: step ~{warm_ms[-1]:.0f} ms, cutting timed steps to {steps} (--max-seconds)")
        gpu, wall = [], []
        logits = None
        for i in range(steps):
            logits, ms, w = timer.run(step)
            gpu.append(ms)
            wall.append(w)
        finite = bool(torch.isfinite(logits.float()).all().item())
        seq = cache.get_seq_length()
        # quartiles and max too: at batch 1 the step is bound by Python's launches, and its
        # spread between runs is what decides a speed-up ratio taken against the median
        q1, _, q3 = statistics.quantiles(gpu, n=4) if len(gpu) >= 2 else (gpu[0], gpu[0], gpu[0])
        rec = dict(base, step_ms=round(statistics.median(gpu), 3), step_ms_min=round(min(gpu), 3),
                   step_ms_p25=round(q1, 3), step_ms_p75=round(q3, 3), step_ms_max=round(max(gpu), 3),
                   step_ms_mean=round(statistics.fmean(gpu), 3), wall_ms=round(statistics.median(wall), 3),
                   tok_s=round(B * 1e3 / statistics.median(gpu), 1), steps=steps, warmup=len(warm_ms),
                   final_cache_len=seq, logits_finite=finite, kda_path=KDA_PATH.get("recurrent"))
        if spread:
            rec["router_distinct_experts_layer"] = spread["distinct"]
            rec["router_tokens"] = spread["tokens"]
        if device.type == "cuda":
            rec["peak_gib"] = round(gib(torch.cuda.max_memory_allocated()), 2)
        log(f"decode B={B} C={C}: median {rec['step_ms']:.2f} ms/step (min {rec['step_ms_min']:.2f}, "
            f"quartiles {rec['step_ms_p25']:.2f} / {rec['step_ms_p75']:.2f}, max {rec['step_ms_max']:.2f}, "
            f"wall {rec['wall_ms']:.2f}), {rec['tok_s']:.0f} tok/s")
        return rec
    except Exception as e:  # noqa: BLE001
        if not is_oom(e, torch):
            raise
        msg = str(e).split("\n")[0][:300]
        log(f"decode B={B} C={C}: OOM ({msg})")
        return dict(base, step_ms=None, skipped=True, reason=f"OOM: {msg}", need_gib=round(gib(need), 2))
    finally:
        cache = None
        free_memory(torch, device)


# ----------------------------------------------------------------------------------------------
# Prefill
# ----------------------------------------------------------------------------------------------
def run_prefill_case(model, c, args, P, torch, device, timer, paths, prev):
    base = {"impl": "transformers", "layers": c.num_hidden_layers, "prefill": P, "batch": 1}
    kda = paths["chunk_kimi_delta_attention"]
    if prev is not None:
        p0, s0 = prev
        est = s0 * P / p0
        if est > args.max_seconds:
            reason = f"estimated {est:.0f}s (from {p0} tokens in {s0:.1f}s) > --max-seconds {args.max_seconds:g}"
            log(f"prefill P={P}: skipped ({reason})")
            return dict(base, tok_s=None, skipped=True, reason=reason, kda_path=kda), prev
    gen = torch.Generator(device=device).manual_seed(args.seed + 7 + P)
    ids = torch.randint(0, c.vocab_size, (1, P), device=device, generator=gen)
    if device.type == "cuda":
        free_memory(torch, device)
        torch.cuda.reset_peak_memory_stats()

    def fwd():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        return out.logits

    try:
        log(f"prefill P={P}: warm-up forward (KDA chunk: {kda})")
        _, wms, _ = timer.run(fwd)
        times, wall = [], []
        warm_only = False
        reps = args.prefill_reps
        if reps * wms / 1e3 > args.max_seconds:
            reps = int(args.max_seconds * 1e3 / wms)
        if reps <= 0:
            times, wall, warm_only = [wms], [wms], True
        for _ in range(reps):
            _, ms, w = timer.run(fwd)
            times.append(ms)
            wall.append(w)
        med = statistics.median(times)
        rec = dict(base, tok_s=round(P * 1e3 / med, 1), ms=round(med, 2), wall_ms=round(statistics.median(wall), 2),
                   reps=len(times), warmup_ms=round(wms, 2), kda_path=kda)
        if warm_only:
            rec["warmup_only"] = True
        if device.type == "cuda":
            rec["peak_gib"] = round(gib(torch.cuda.max_memory_allocated()), 2)
        log(f"prefill P={P}: {rec['ms']:.1f} ms -> {rec['tok_s']:.0f} tok/s (warm-up {wms:.0f} ms)")
        return rec, (P, med / 1e3)
    except Exception as e:  # noqa: BLE001
        if not is_oom(e, torch):
            raise
        msg = str(e).split("\n")[0][:300]
        log(f"prefill P={P}: OOM ({msg})")
        return dict(base, tok_s=None, skipped=True, reason=f"OOM: {msg}", kda_path=kda), prev
    finally:
        ids = None
        free_memory(torch, device)


# ----------------------------------------------------------------------------------------------
def main():
    args = parse_args()
    log("importing torch / transformers")
    import torch
    import transformers

    dtype = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
             "fp32": torch.float32, "float32": torch.float32}[args.dtype]
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("CUDA not available (use --device cpu --tiny for a self-test)")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)
    esz = torch.empty((), dtype=dtype).element_size()

    config = build_config(args)
    n_mla = sum(t == "full_attention" for t in config.layer_types)
    log(f"config: {config.num_hidden_layers} layers ({n_mla} MLA, {config.num_hidden_layers - n_mla} KDA), "
        f"hidden {config.hidden_size}, {config.num_local_experts} experts top-{config.num_experts_per_tok}, "
        f"vocab {config.vocab_size}{' [TINY]' if args.tiny else ''}")

    t0 = time.time()
    model, pdtypes = build_model(config, args, torch, dtype, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    build_s = time.time() - t0
    n_params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    formula = count_params_formula(config)
    paths = kernel_paths(torch)
    KDA_PATH["recurrent"] = paths["recurrent_kimi_delta_attention"]
    info = {
        "impl": "transformers", "info": True, "layers": config.num_hidden_layers, "mla_layers": n_mla,
        "kda_layers": config.num_hidden_layers - n_mla, "tiny": bool(args.tiny),
        "params": n_params, "params_b": round(n_params / 1e9, 3), "params_formula": formula,
        "weight_gib": round(gib(weight_bytes), 2), "param_dtypes": pdtypes,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "device": str(device), "torch": torch.__version__, "transformers": transformers.__version__,
        "cuda": torch.version.cuda, "attn_impl": model.config._attn_implementation,
        "experts_impl": getattr(model.config, "_experts_implementation", None),
        "kda_chunk": paths["chunk_kimi_delta_attention"], "kda_recurrent": paths["recurrent_kimi_delta_attention"],
        "conv_fn": paths["causal_conv1d_fn"], "conv_update": paths["causal_conv1d_update"],
        "build_s": round(build_s, 2),
        "full_attn_layers_1based": [i + 1 for i, t in enumerate(config.layer_types) if t == "full_attention"],
    }
    emit(info)
    log(f"model: {n_params / 1e9:.3f} B params (formula {formula / 1e9:.3f} B), {gib(weight_bytes):.1f} GiB, "
        f"built in {build_s:.1f}s; attn={info['attn_impl']} experts={info['experts_impl']}; "
        f"KDA chunk={paths['chunk_kimi_delta_attention']}, recurrent={paths['recurrent_kimi_delta_attention']}, "
        f"conv={paths['causal_conv1d_fn']}/{paths['causal_conv1d_update']}")
    if n_params != formula:
        log(f"warning: instantiated parameter count {n_params} != analytic {formula}")
    if any(v == "torch fallback" for v in paths.values()):
        log("warning: some KDA/conv functions use transformers' reference torch path (fla / causal_conv1d not "
            "importable); timings include that slow path")

    timer = Timer(torch, device)
    with torch.inference_mode():
        if args.check_cache or (args.tiny and not args.no_check_cache):
            err = check_cache_construction(model, config, torch, device, args)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            log(f"cache-construction self-test: decode after real prefill vs constructed cache, "
                f"max rel logit diff {err:.2e} (tol {tol:g})")
            emit({"impl": "transformers", "check": "cache_construction", "max_rel_diff": err, "ok": err <= tol})
            if err > tol:
                sys.exit("cache-construction self-test failed")
            free_memory(torch, device)
        if args.batch and args.context:
            t0 = time.time()
            global_warmup(model, config, args, torch, device, timer)
            log(f"global warm-up (decode B=1 C=16 x5, prefill 1x128) took {time.time() - t0:.1f}s")
        for C in args.context:
            for B in args.batch:
                emit(run_decode_case(model, config, args, B, C, torch, device, timer, esz, weight_bytes))
        prev = None
        for P in sorted(args.prefill):
            rec, prev = run_prefill_case(model, config, args, P, torch, device, timer, paths, prev)
            emit(rec)
    log("done")


if __name__ == "__main__":
    main()
