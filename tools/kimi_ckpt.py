"""Shared helpers: write a transformers KimiLinearForCausalLM as a Moonshot-named checkpoint.

transformers 5.17 keeps Kimi Linear weights under its own internal names; the hub checkpoints
(and the duet C loader, docs/model.md) use Moonshot's names. transformers converts
Moonshot -> internal on load (conversion_mapping.py, "kimi_linear"); this module does the reverse:

  internal                                        Moonshot
  layers.N.self_attn.conv1d.weight [3HK,1,W]   -> self_attn.{q,k,v}_conv1d.weight [HK,1,W]
  layers.N.self_attn.forget_gate.X             -> self_attn.X   (f_a_proj, f_b_proj, dt_bias, A_log)
  layers.N.mlp.* (sparse layers)               -> block_sparse_moe.*
  mlp.experts.gate_up_proj [E,2I,D]            -> block_sparse_moe.experts.E.w1 (rows :I) / w3 (rows I:)
  mlp.experts.down_proj [E,D,I]                -> block_sparse_moe.experts.E.w2

transformers' own save_pretrained applies the reverse of its conversion, which cannot tell dense
from sparse layers: it writes the table above except that *every* layer's mlp.* becomes
block_sparse_moe.*, so a dense layer's MLP is saved as block_sparse_moe.{gate,up,down}_proj.weight
(the hub says mlp.*). transformers loads both, and its internal names as they are; so does duet
(engine/weights.c). tools/make_fixtures.py's save-pretrained-bf16 fixture records what it writes.

Used by tools/make_fixtures.py and tools/train_demo.py.
"""

import json
import os
import re

import torch
from safetensors.torch import save_file

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


def internal_to_moonshot(state_dict, config):
    """Map a KimiLinearForCausalLM state_dict (internal names) to Moonshot names.

    Returns an ordered dict name -> contiguous tensor (same dtype as the input)."""
    out = {}
    for name, t in state_dict.items():
        m = _LAYER_RE.match(name)
        if m is None:
            out[name] = t
            continue
        li, rest = int(m.group(1)), m.group(2)
        pre = f"model.layers.{li}."
        if rest == "self_attn.conv1d.weight":
            q, k, v = t.chunk(3, dim=0)
            out[pre + "self_attn.q_conv1d.weight"] = q
            out[pre + "self_attn.k_conv1d.weight"] = k
            out[pre + "self_attn.v_conv1d.weight"] = v
        elif rest.startswith("self_attn.forget_gate."):
            out[pre + "self_attn." + rest[len("self_attn.forget_gate."):]] = t
        elif rest.startswith("mlp.") and config.mlp_layer_types[li] == "sparse":
            sub = rest[len("mlp."):]
            moe = pre + "block_sparse_moe."
            if sub == "experts.gate_up_proj":
                inter = t.shape[1] // 2
                for e in range(t.shape[0]):
                    out[moe + f"experts.{e}.w1.weight"] = t[e, :inter]
                    out[moe + f"experts.{e}.w3.weight"] = t[e, inter:]
            elif sub == "experts.down_proj":
                for e in range(t.shape[0]):
                    out[moe + f"experts.{e}.w2.weight"] = t[e]
            else:  # gate.weight, gate.e_score_correction_bias, shared_experts.*
                out[moe + sub] = t
        else:
            out[name] = t
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def _layer_of(name):
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


def save_moonshot(out_dir, tensors, config_text, n_shards=1):
    """Write config.json (given as text) and the tensors as model.safetensors, or, with
    n_shards > 1, as model-0000i-of-0000n.safetensors + model.safetensors.index.json.
    Shards split on layer boundaries (embeddings in the first shard, norm + lm_head in the last)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        f.write(config_text)
    for fn in os.listdir(out_dir):
        if fn.endswith(".safetensors") or fn == "model.safetensors.index.json":
            os.remove(os.path.join(out_dir, fn))
    meta = {"format": "pt"}
    if n_shards <= 1:
        save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata=meta)
        return
    layers = sorted({_layer_of(k) for k in tensors if _layer_of(k) is not None})
    per = -(-len(layers) // n_shards)

    def shard_of(name):
        li = _layer_of(name)
        if li is None:
            return 0 if name.startswith("model.embed_tokens") else n_shards - 1
        return min(layers.index(li) // per, n_shards - 1)

    shards = [dict() for _ in range(n_shards)]
    for k, v in tensors.items():
        shards[shard_of(k)][k] = v
    weight_map, total = {}, 0
    for i, sh in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file(sh, os.path.join(out_dir, fn), metadata=meta)
        for k, v in sh.items():
            weight_map[k] = fn
            total += v.numel() * v.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")


def _eos(c):
    return c.eos_token_id if not isinstance(c.eos_token_id, list) else c.eos_token_id[0]


def hub_config(c, dtype="bfloat16", extra=None):
    """config.json text in the hub's spelling (as moonshotai/Kimi-Linear-48B-A3B-* ships it):
    linear_attn_config with 1-based kda_layers/full_attn_layers, first_k_dense_replace, ...
    Requires mlp_layer_types to be 'dense' for a prefix of layers and 'sparse' after."""
    n = c.num_hidden_layers
    kda = [i + 1 for i in range(n) if c.layer_types[i] == "linear_attention"]
    full = [i + 1 for i in range(n) if c.layer_types[i] == "full_attention"]
    assert len(kda) + len(full) == n
    k_dense = sum(1 for t in c.mlp_layer_types if t == "dense")
    assert list(c.mlp_layer_types) == ["dense"] * k_dense + ["sparse"] * (n - k_dense), c.mlp_layer_types
    d = {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "bos_token_id": c.bos_token_id,
        "eos_token_id": _eos(c),
        "pad_token_id": c.pad_token_id,
        "first_k_dense_replace": k_dense,
        "hidden_act": c.hidden_act,
        "hidden_size": c.hidden_size,
        "initializer_range": c.initializer_range,
        "intermediate_size": c.intermediate_size,
        "kv_lora_rank": c.kv_lora_rank,
        "linear_attn_config": {
            "full_attn_layers": full,
            "head_dim": c.linear_head_dim,
            "kda_layers": kda,
            "num_heads": c.linear_num_heads,
            "short_conv_kernel_size": c.linear_conv_kernel_dim,
        },
        "mla_use_nope": True,
        "model_max_length": c.max_position_embeddings,
        "moe_intermediate_size": c.moe_intermediate_size,
        "moe_layer_freq": 1,
        "moe_renormalize": bool(c.norm_topk_prob),
        "moe_router_activation_func": "sigmoid",
        "num_attention_heads": c.num_attention_heads,
        "num_expert_group": c.n_group,
        "num_experts": c.num_local_experts,
        "num_experts_per_token": c.num_experts_per_tok,
        "num_hidden_layers": n,
        "num_key_value_heads": c.num_key_value_heads,
        "num_nextn_predict_layers": 0,
        "num_shared_experts": c.n_shared_experts,
        "q_lora_rank": c.q_lora_rank,
        "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.qk_rope_head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_scaling": None,
        "routed_scaling_factor": c.routed_scaling_factor,
        "tie_word_embeddings": False,
        "topk_group": c.topk_group,
        "torch_dtype": dtype,
        "use_cache": True,
        "v_head_dim": c.v_head_dim,
        "vocab_size": c.vocab_size,
    }
    if extra:
        d.update(extra)
    return json.dumps(d, indent=2) + "\n"


def transformers_config(c, dtype="float32", extra=None):
    """config.json text in transformers' spelling (layer_types, mlp_layer_types, linear_*, n_group...)."""
    d = {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "bos_token_id": c.bos_token_id,
        "eos_token_id": _eos(c),
        "pad_token_id": c.pad_token_id,
        "dtype": dtype,
        "hidden_act": c.hidden_act,
        "hidden_size": c.hidden_size,
        "initializer_range": c.initializer_range,
        "intermediate_size": c.intermediate_size,
        "kv_lora_rank": c.kv_lora_rank,
        "layer_types": list(c.layer_types),
        "linear_conv_kernel_dim": c.linear_conv_kernel_dim,
        "linear_head_dim": c.linear_head_dim,
        "linear_num_heads": c.linear_num_heads,
        "max_position_embeddings": c.max_position_embeddings,
        "mlp_layer_types": list(c.mlp_layer_types),
        "moe_intermediate_size": c.moe_intermediate_size,
        "n_group": c.n_group,
        "n_shared_experts": c.n_shared_experts,
        "norm_topk_prob": bool(c.norm_topk_prob),
        "num_attention_heads": c.num_attention_heads,
        "num_experts_per_tok": c.num_experts_per_tok,
        "num_hidden_layers": c.num_hidden_layers,
        "num_key_value_heads": c.num_key_value_heads,
        "num_local_experts": c.num_local_experts,
        "q_lora_rank": c.q_lora_rank,
        "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.qk_rope_head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "routed_scaling_factor": c.routed_scaling_factor,
        "tie_word_embeddings": False,
        "topk_group": c.topk_group,
        "use_cache": True,
        "v_head_dim": c.v_head_dim,
        "vocab_size": c.vocab_size,
    }
    if extra:
        d.update(extra)
    return json.dumps(d, indent=2) + "\n"


# Fields whose parsed values must agree between the in-memory config and a reloaded config.json.
CHECK_FIELDS = [
    "layer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim",
    "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "n_shared_experts", "routed_scaling_factor", "kv_lora_rank", "q_lora_rank",
    "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_group", "topk_group", "num_experts_per_tok",
    "norm_topk_prob", "num_local_experts", "hidden_act", "rms_norm_eps", "vocab_size",
]


def check_config_roundtrip(c, out_dir):
    from transformers import KimiLinearConfig

    r = KimiLinearConfig.from_pretrained(out_dir)
    for f in CHECK_FIELDS:
        a, b = getattr(c, f), getattr(r, f)
        if isinstance(a, (list, tuple)):
            a, b = list(a), list(b)
        assert a == b, f"config field {f}: {a!r} != reloaded {b!r}"
    return r


def check_weights_equal(model_a, model_b):
    """Assert every parameter and buffer of two models is bit-identical (after casting b to a's dtype)."""
    sa, sb = model_a.state_dict(), model_b.state_dict()
    assert set(sa) == set(sb), (set(sa) ^ set(sb))
    for k in sa:
        ta, tb = sa[k], sb[k].to(sa[k].dtype)
        assert ta.shape == tb.shape, (k, ta.shape, tb.shape)
        assert torch.equal(ta, tb), f"weight {k} differs after reload"
    return len(sa)
