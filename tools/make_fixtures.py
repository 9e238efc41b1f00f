#!/usr/bin/env python3
"""Truth fixtures for loramux: tiny random models of every family, PEFT adapters, reference outputs.

Writes tests/fixtures/<case>/{model/, adapters/<name>/, expected.json}; the format is described in
tests/fixtures/README.md. Not called by the build: the C++ model and adapter tests read its output,
which is committed. Rerun it after changing a case, then `git diff --stat tests/fixtures`.

    /opt/tv/bin/python tools/make_fixtures.py --out tests/fixtures

Stages, each a subprocess (this driver needs only the stdlib), in this order:
  v5       --python-v5 (default /opt/tv/bin/python): torch + transformers 5.x + peft >= 0.19.1 (fused
           experts, target_parameters); gpt_oss, qwen3_moe_fused*, qwen3_dense, llama.
  v4       --python-v4 (default /opt/tv4/bin/python): transformers 4.x + peft 0.18.x, whose per-expert
           nn.Linear experts transformers 5 no longer has; qwen3_moe_per_expert, mixtral.
  v5old    the v5 interpreter with a peft 0.18.x first on PYTHONPATH (--peft-old-path, default: the
           peft of --python-v4 linked into a temp folder): old-layout adapters of qwen3_moe_fused_2i_eq_h.
  v5check  cross-checks only: transformers 5 + peft read the per-expert cases like transformers 4.
  verify   an independent float64 re-implementation of every case from tests/fixtures/README.md's rules
           (torch + safetensors only) must reproduce expected.json; alone: --verify.
Setting up the v4 interpreter without duplicating torch (PyPI only):
    python3 -m venv /opt/tv4 && echo /opt/tv/lib/python3.11/site-packages \
        > /opt/tv4/lib/python3.11/site-packages/zz_tv.pth   # after the venv's own packages
    /opt/tv4/bin/pip install 'transformers<5' 'peft>=0.18,<0.19' safetensors
Everything is seeded per tensor (crc32 of a name) and prompts are chosen deterministically, so reruns
are byte-identical with the same library versions (other versions move the last digits of the floats).
All weights are bf16-exact, base models are saved in bf16 (gpt_oss experts in MXFP4), and the reference
forward runs in float32 with eager attention and eager experts: fp32 math on bf16-exact inputs.
"""

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import tempfile
import zlib

MAX_NEW_TOKENS = 8
PROMPT_LENGTHS = (5, 12, 19)
VOCAB = 256
# A greedy step or a router choice closer than this (in logits) would make the C++ comparison flaky.
MIN_GREEDY_MARGIN = 1e-3
MIN_ROUTER_GAP = 1e-4
OUT_DIR = None  # set by --out in a stage subprocess

# ----------------------------------------------------------------------------------------------------
# Cases. Dims follow the glossary: H hidden, I intermediate (per expert), E experts, K top-k, D head dim.
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16)

CASES = {
    "gpt_oss": dict(stage="v5", seed=11, arch="GptOssForCausalLM",
                    config=dict(COMMON, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                                sliding_window=4, layer_types=["sliding_attention", "full_attention"])),
    "qwen3_moe_fused": dict(stage="v5", seed=21, arch="Qwen3MoeForCausalLM",
                            config=dict(COMMON, moe_intermediate_size=48, intermediate_size=96, num_experts=8,
                                        num_experts_per_tok=2, norm_topk_prob=True, rope_theta=1000000.0,
                                        rms_norm_eps=1e-6)),
    "qwen3_moe_fused_2i_eq_h": dict(stage="v5", seed=31, arch="Qwen3MoeForCausalLM",
                                    config=dict(COMMON, moe_intermediate_size=32, intermediate_size=96,
                                                num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                                rope_theta=1000000.0, rms_norm_eps=1e-6)),
    # Same base weights as qwen3_moe_fused (split per expert), published per-expert layout.
    "qwen3_moe_per_expert": dict(stage="v4", seed=21, arch="Qwen3MoeForCausalLM", same_base_as="qwen3_moe_fused"),
    "mixtral": dict(stage="v4", seed=41, arch="MixtralForCausalLM",
                    config=dict(COMMON, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                                rope_theta=1000000.0, sliding_window=None, rms_norm_eps=1e-5)),
    "qwen3_dense": dict(stage="v5", seed=51, arch="Qwen3ForCausalLM",
                        config=dict(COMMON, intermediate_size=96, tie_word_embeddings=True, rope_theta=1000000.0,
                                    rms_norm_eps=1e-6)),
    "llama": dict(stage="v5", seed=61, arch="LlamaForCausalLM", shards=2,
                  config=dict(COMMON, num_hidden_layers=3, intermediate_size=96, rms_norm_eps=1e-5,
                              max_position_embeddings=131072,
                              rope_parameters=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                   high_freq_factor=4.0, original_max_position_embeddings=8192,
                                                   rope_theta=500000.0))),
}
CASES["qwen3_moe_per_expert"]["config"] = CASES["qwen3_moe_fused"]["config"]

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]

# Adapters per case, in result order. `lora` holds LoraConfig arguments; `save_dtype` the dtype of the
# saved tensors; `stage` the environment that creates them (default: the case's); `copy_tensors_from`
# reuses another adapter's saved tensors verbatim.
ADAPTERS = {
    "gpt_oss": [
        dict(name="attn", lora=dict(r=8, lora_alpha=16, target_modules=ATTN)),
        dict(name="experts", lora=dict(r=4, lora_alpha=8, target_modules=[], target_parameters=EXPERTS)),
        dict(name="experts_down_only", lora=dict(r=4, lora_alpha=8, target_modules=[],
                                                 target_parameters=["mlp.experts.down_proj"])),
        dict(name="attn_experts", lora=dict(r=8, lora_alpha=32, target_modules=ATTN, target_parameters=EXPERTS)),
        dict(name="rslora", lora=dict(r=4, lora_alpha=6, use_rslora=True, target_modules=ATTN,
                                      target_parameters=EXPERTS)),
        dict(name="mixed_rank", lora=dict(
            r=4, lora_alpha=8, target_modules=ATTN, target_parameters=EXPERTS,
            rank_pattern={"q_proj": 8, "model.layers.1.self_attn.o_proj": 2, "mlp.experts.down_proj": 6},
            alpha_pattern={"v_proj": 4, "model.layers.0.mlp.experts.gate_up_proj": 20})),
        dict(name="attn_experts_fp32", save_dtype="float32",
             lora=dict(r=4, lora_alpha=8, target_modules=ATTN, target_parameters=EXPERTS)),
    ],
    "qwen3_moe_fused": [
        dict(name="attn_experts", lora=dict(r=8, lora_alpha=16, target_modules=ATTN, target_parameters=EXPERTS)),
        dict(name="experts_gate_up_only", lora=dict(r=4, lora_alpha=8, target_modules=[],
                                                    target_parameters=["mlp.experts.gate_up_proj"])),
        dict(name="experts_mixed_rank", lora=dict(
            r=4, lora_alpha=8, target_modules=[], target_parameters=EXPERTS,
            rank_pattern={"model.layers.1.mlp.experts.gate_up_proj": 8, "down_proj": 2},
            alpha_pattern={"model.layers.1.mlp.experts.gate_up_proj": 32})),
    ],
    "qwen3_moe_fused_2i_eq_h": [
        dict(name="experts_v021", lora=dict(r=4, lora_alpha=8, target_modules=[], target_parameters=EXPERTS)),
        dict(name="experts_gate_up_v021", lora=dict(r=4, lora_alpha=8, target_modules=[],
                                                    target_parameters=["mlp.experts.gate_up_proj"])),
        dict(name="experts_v018", stage="v5old",
             lora=dict(r=4, lora_alpha=8, target_modules=[], target_parameters=EXPERTS)),
        dict(name="experts_gate_up_v018", stage="v5old", copy_tensors_from="experts_gate_up_v021",
             lora=dict(r=4, lora_alpha=8, target_modules=[], target_parameters=["mlp.experts.gate_up_proj"])),
    ],
    "qwen3_moe_per_expert": [
        dict(name="experts_per_expert", lora=dict(r=4, lora_alpha=8,
                                                  target_modules=["gate_proj", "up_proj", "down_proj"])),
        dict(name="attn_experts_per_expert", lora=dict(r=8, lora_alpha=16,
                                                       target_modules=ATTN + ["gate_proj", "up_proj", "down_proj"])),
    ],
    "mixtral": [
        dict(name="attn_w123", lora=dict(r=8, lora_alpha=16, target_modules=ATTN + ["w1", "w2", "w3"])),
    ],
    "qwen3_dense": [
        dict(name="attn_mlp", lora=dict(r=8, lora_alpha=16,
                                        target_modules=ATTN + ["gate_proj", "up_proj", "down_proj"])),
        dict(name="mlp_rslora", lora=dict(r=4, lora_alpha=8, use_rslora=True,
                                          target_modules=["gate_proj", "up_proj", "down_proj"])),
    ],
    "llama": [
        dict(name="attn_layers_0_2", lora=dict(r=8, lora_alpha=16, target_modules=ATTN, layers_to_transform=[0, 2])),
        dict(name="qv_r16", lora=dict(r=16, lora_alpha=16, target_modules=["q_proj", "v_proj"])),
    ],
}


# ----------------------------------------------------------------------------------------------------
# Small pure helpers (no torch).

def compact(x):
    """A float rounded to 7 significant digits, as the shortest repr that reads back to it."""
    return float(f"{float(x):.7g}")


def write_json(path, obj, sort_keys=False):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1 if not sort_keys else 2, sort_keys=sort_keys)
        f.write("\n")


def write_expected(path, obj):
    """JSON with one result per block and each float list on one line, to keep diffs readable."""
    lines = ["{"]
    items = list(obj.items())
    for i, (k, v) in enumerate(items):
        tail = "," if i + 1 < len(items) else ""
        if k == "results":
            lines.append(' "results": [')
            for j, r in enumerate(v):
                rtail = "," if j + 1 < len(v) else ""
                head = ", ".join(f"{json.dumps(rk)}: {json.dumps(rv)}" for rk, rv in r.items() if rk != "last_logits")
                lines.append("  {" + head + ",")
                lines.append('   "last_logits": ' + json.dumps(r["last_logits"]) + "}" + rtail)
            lines.append(" ]" + tail)
        elif isinstance(v, dict) and v:
            lines.append(f" {json.dumps(k)}: {{")
            sub = list(v.items())
            for j, (sk, sv) in enumerate(sub):
                lines.append(f"  {json.dumps(sk)}: {json.dumps(sv)}" + ("," if j + 1 < len(sub) else ""))
            lines.append(" }" + tail)
        else:
            lines.append(f" {json.dumps(k)}: {json.dumps(v)}{tail}")
    lines.append("}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def make_prompts(seed):
    """Deterministic prompts without torch: an LCG over the vocabulary."""
    state = seed * 2654435761 % (1 << 32)
    prompts = []
    for n in PROMPT_LENGTHS:
        p = []
        for _ in range(n):
            state = (1103515245 * state + 12345) % (1 << 31)
            p.append((state >> 8) % VOCAB)
        prompts.append(p)
    return prompts


# ----------------------------------------------------------------------------------------------------
# Torch helpers, shared by every stage (transformers 4 and 5 alike).

def torch_helpers():
    import torch

    class H:
        pass

    h = H()
    h.torch = torch

    def seeded_normal(key, shape, std, mean=0.0):
        g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        t = torch.randn(tuple(shape), generator=g, dtype=torch.float32) * std + mean
        return t.to(torch.bfloat16).to(torch.float32)  # bf16-exact

    h.seeded_normal = seeded_normal

    def base_init(case, name, shape):
        """Small, non-degenerate values by tensor role; bf16-exact."""
        key = f"{case}/{name}"
        if name.endswith("norm.weight"):  # input/post_attention/final norm, q_norm, k_norm
            return seeded_normal(key, shape, 0.1, 1.0)
        if "embed_tokens" in name:
            # Tied embeddings (qwen3_dense) are also the LM head: kept small, else every token predicts itself.
            return seeded_normal(key, shape, 0.1 if CASES[case]["config"].get("tie_word_embeddings") else 0.5)
        if name.endswith("sinks"):
            return seeded_normal(key, shape, 0.5)
        if name.endswith(("mlp.router.weight", "mlp.gate.weight", "block_sparse_moe.gate.weight")):
            return seeded_normal(key, shape, 0.3)
        if name.endswith("bias"):
            return seeded_normal(key, shape, 0.05)
        if name.endswith("lm_head.weight"):
            return seeded_normal(key, shape, 0.15)
        w = seeded_normal(key, shape, 0.1)
        if case == "gpt_oss" and name.endswith("experts.gate_up_proj"):
            # Expert 0 six times larger, so the clamped SwiGLU (limit 7) actually clamps.
            w[0] = (w[0] * 6).to(torch.bfloat16).to(torch.float32)
        return w

    h.base_init = base_init

    def save_safetensors(path, tensors):
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})

    h.save_safetensors = save_safetensors

    def save_checkpoint(model_dir, tensors, shards=1):
        """model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json."""
        names = list(tensors.keys())
        if shards == 1:
            save_safetensors(os.path.join(model_dir, "model.safetensors"), tensors)
            return
        # Split by order of names (layer-major), each shard a contiguous run.
        per = math.ceil(len(names) / shards)
        weight_map, total = {}, 0
        for s in range(shards):
            part = names[s * per:(s + 1) * per]
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            save_safetensors(os.path.join(model_dir, fname), {k: tensors[k] for k in part})
            for k in part:
                weight_map[k] = fname
                total += tensors[k].numel() * tensors[k].element_size()
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        write_json(os.path.join(model_dir, "model.safetensors.index.json"), index, sort_keys=True)

    h.save_checkpoint = save_checkpoint

    def load_dir_tensors(model_dir):
        from safetensors.torch import load_file
        out = {}
        for f in sorted(os.listdir(model_dir)):
            if f.endswith(".safetensors"):
                out.update(load_file(os.path.join(model_dir, f)))
        return out

    h.load_dir_tensors = load_dir_tensors

    def router_gap_hooks(model, top_k):
        """Record the smallest logit gap between the k-th and (k+1)-th expert of any routed token."""
        state = {"min": float("inf")}
        handles = []

        def hook(_m, _inp, out):
            logits = out[0] if isinstance(out, tuple) else out
            logits = logits.reshape(-1, logits.shape[-1]).float()
            s = logits.sort(dim=-1, descending=True).values
            gap = (s[:, top_k - 1] - s[:, top_k]).min().item()
            state["min"] = min(state["min"], gap)

        for name, mod in model.named_modules():
            if name.endswith(("mlp.router", "mlp.gate", "block_sparse_moe.gate")):
                handles.append(mod.register_forward_hook(hook))
        return state, handles

    h.router_gap_hooks = router_gap_hooks

    @torch.no_grad()
    def run_reference(model, prompts, top_k=None):
        """last-position logits per prompt, greedy continuation (no-cache recompute, cross-checked
        against generate() with a KV cache), smallest top-1/top-2 margin, smallest router gap."""
        model.eval()
        gap_state, handles = (router_gap_hooks(model, top_k) if top_k else ({"min": None}, []))
        out = []
        for p in prompts:
            ids = torch.tensor([p], dtype=torch.long)
            logits = model(input_ids=ids).logits[0, -1].float()
            last = logits.clone()
            greedy, margin = [], float("inf")
            cur = ids
            for _ in range(MAX_NEW_TOKENS):
                lg = model(input_ids=cur).logits[0, -1].float()
                top2 = lg.topk(2).values
                margin = min(margin, (top2[0] - top2[1]).item())
                nxt = int(lg.argmax().item())
                greedy.append(nxt)
                cur = torch.cat([cur, torch.tensor([[nxt]])], dim=1)
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_NEW_TOKENS, min_new_tokens=MAX_NEW_TOKENS,
                                 use_cache=True, pad_token_id=0, eos_token_id=None)
            cached = gen[0, ids.shape[1]:].tolist()
            assert cached == greedy, f"generate(use_cache=True) {cached} != no-cache greedy {greedy}"
            out.append(dict(last=last, greedy=greedy, margin=margin))
        for hd in handles:
            hd.remove()
        return out, gap_state["min"]

    h.run_reference = run_reference

    def fill_lora(model, case, adapter_name, peft_adapter="default"):
        """Deterministic bf16-exact LoRA factors: A ~ N(0, 1/in), B sized so that the update is about
        as large as the base output (so greedy continuations change)."""
        for mname, mod in model.named_modules():
            lora_a = getattr(mod, "lora_A", None)
            if lora_a is None or peft_adapter not in lora_a:
                continue
            a = lora_a[peft_adapter].weight
            b = mod.lora_B[peft_adapter].weight
            r = mod.r[peft_adapter]
            scaling = mod.scaling[peft_adapter]
            key = f"{case}/{adapter_name}/{mname}"
            with torch.no_grad():
                a.copy_(seeded_normal(key + "/A", a.shape, 1.0 / math.sqrt(a.shape[1])))
                b.copy_(seeded_normal(key + "/B", b.shape, 0.6 / (scaling * math.sqrt(r))))

    h.fill_lora = fill_lora

    def save_adapter(peft_model, adapter_dir, save_dtype):
        """PEFT's own save_pretrained, tensors cast to save_dtype (values are bf16-exact, so lossless)."""
        dt = getattr(torch, save_dtype)
        saved = {}
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                saved[n] = p.data
                p.data = p.data.to(dt)
        peft_model.save_pretrained(adapter_dir)
        for n, p in peft_model.named_parameters():
            if n in saved:
                p.data = saved[n]
        readme = os.path.join(adapter_dir, "README.md")
        if os.path.exists(readme):
            os.remove(readme)
        cfg_path = os.path.join(adapter_dir, "adapter_config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg["base_model_name_or_path"] = None  # PEFT writes the absolute path of the base here
        write_json(cfg_path, cfg, sort_keys=True)

    h.save_adapter = save_adapter

    def results_json(adapter, refs):
        return [dict(adapter=adapter, prompt=i, greedy=r["greedy"], greedy_min_margin=compact(r["margin"]),
                     last_logits=[compact(v) for v in r["last"].tolist()])
                for i, r in enumerate(refs)]

    h.results_json = results_json
    return h


def dtype_kw(transformers_major):
    import torch
    return {"dtype": torch.float32} if transformers_major >= 5 else {"torch_dtype": torch.float32}


# ----------------------------------------------------------------------------------------------------
# MXFP4 (OCP microscaling FP4 E2M1, 32-element blocks, E8M0 scales), as gpt-oss checkpoints store it.

FP4_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def mxfp4_quantize(torch, w):
    """w [..., K] (K % 32 == 0, the contraction dim last) -> blocks [..., K/32, 16] u8, scales [..., K/32] u8.
    Scale exponent = ceil(log2(amax / 6)) so nothing clips; nearest magnitude (ties to the smaller);
    sign kept even when the magnitude rounds to 0 (code 8 = -0.0); element 2j in the low nibble."""
    *pre, k = w.shape
    g = w.reshape(*pre, k // 32, 32)
    amax = g.abs().amax(-1)
    e = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.full_like(amax, -127.0)).clamp(-127, 127)
    scaled = g / torch.exp2(e)[..., None]
    lut = torch.tensor(FP4_MAGNITUDES)
    idx = (scaled.abs()[..., None] - lut).abs().argmin(-1)
    code = idx + 8 * (scaled < 0).long()
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    scales = (e + 127).to(torch.uint8)
    return blocks, scales


def mxfp4_dequantize(torch, blocks, scales):
    """Inverse of the packing: [..., G, 16] u8 + [..., G] u8 -> [..., G*32] float32."""
    lut = torch.tensor(FP4_MAGNITUDES + [-v for v in FP4_MAGNITUDES])
    lo = lut[(blocks & 0x0F).long()]
    hi = lut[(blocks >> 4).long()]
    vals = torch.stack([lo, hi], dim=-1).reshape(*blocks.shape[:-1], 32)
    vals = vals * torch.exp2(scales.to(torch.float32) - 127.0)[..., None]
    return vals.reshape(*blocks.shape[:-2], -1)


# ----------------------------------------------------------------------------------------------------
# Stage v5: transformers 5 + peft >= 0.20.

def v5_config(case):
    import torch
    import transformers
    spec = CASES[case]
    c = dict(spec["config"])
    arch = spec["arch"]
    if arch == "GptOssForCausalLM":
        return None  # written by hand in the published layout, see write_gpt_oss_config
    cls = {"Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig, "Qwen3ForCausalLM": transformers.Qwen3Config,
           "LlamaForCausalLM": transformers.LlamaConfig}[arch]
    if "rope_theta" in c:
        c["rope_parameters"] = {"rope_type": "default", "rope_theta": c.pop("rope_theta")}
    cfg = cls(**c)
    cfg.architectures = [arch]
    cfg.dtype = torch.bfloat16
    return cfg


def gpt_oss_config_dict():
    """config.json as openai/gpt-oss-20b publishes it (v4 keys `rope_scaling` + `rope_theta`), tiny dims."""
    c = CASES["gpt_oss"]["config"]
    return {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "experts_per_token": c["num_experts_per_tok"],
        "head_dim": c["head_dim"],
        "hidden_act": "silu",
        "hidden_size": c["hidden_size"],
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": c["intermediate_size"],
        "layer_types": c["layer_types"],
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": c["num_attention_heads"],
        "num_experts_per_tok": c["num_experts_per_tok"],
        "num_hidden_layers": c["num_hidden_layers"],
        "num_key_value_heads": c["num_key_value_heads"],
        "num_local_experts": c["num_local_experts"],
        "output_router_logits": False,
        "quantization_config": {
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                       "model.embed_tokens", "lm_head"],
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": c["sliding_window"],
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": c["vocab_size"],
    }


def v5_load(case, model_dir):
    import transformers
    kw = dict(dtype_kw(5), attn_implementation="eager", experts_implementation="eager")
    if CASES[case]["arch"] == "GptOssForCausalLM":
        kw["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
    return getattr(transformers, CASES[case]["arch"]).from_pretrained(model_dir, **kw)


def v5_build_base(h, case, case_dir):
    """Random bf16-exact weights -> checkpoint on disk (bf16, MXFP4 experts for gpt_oss) -> loaded back;
    asserts that what transformers loads is exactly what was generated. Returns extra expected.json keys."""
    import torch
    import transformers
    spec = CASES[case]
    model_dir = os.path.join(case_dir, "model")
    os.makedirs(model_dir)
    if spec["arch"] == "GptOssForCausalLM":
        cfg_dict = gpt_oss_config_dict()
        write_json(os.path.join(model_dir, "config.json"), cfg_dict, sort_keys=True)
        skeleton_cfg = transformers.GptOssConfig.from_dict({k: v for k, v in cfg_dict.items()
                                                            if k != "quantization_config"})
    else:
        skeleton_cfg = v5_config(case)
        skeleton_cfg.save_pretrained(model_dir)
    skeleton = getattr(transformers, spec["arch"])(skeleton_cfg)
    truth = {}  # name -> fp32 tensor in the transformers-5 parameter layout
    for name, p in skeleton.state_dict().items():
        if skeleton_cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        truth[name] = h.base_init(case, name, p.shape)

    ckpt = {}
    for name, w in truth.items():
        if spec["arch"] == "GptOssForCausalLM" and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # HF layout [E, in, out]; the checkpoint stores [E, out, in/32, 16] blocks, contraction dim last.
            blocks, scales = mxfp4_quantize(torch, w.transpose(1, 2).contiguous())
            deq = mxfp4_dequantize(torch, blocks, scales).transpose(1, 2).contiguous()
            truth[name] = deq
            ckpt[name + "_blocks"] = blocks
            ckpt[name + "_scales"] = scales
        else:
            ckpt[name] = w.to(torch.bfloat16)
    h.save_checkpoint(model_dir, ckpt, spec.get("shards", 1))

    model = v5_load(case, model_dir)
    loaded = model.state_dict()
    for name, w in truth.items():
        assert name in loaded, f"{case}: {name} not loaded"
        got = loaded[name].float()
        assert got.shape == w.shape and torch.equal(got, w), f"{case}: {name} differs after loading"
    if skeleton_cfg.tie_word_embeddings:
        assert torch.equal(loaded["lm_head.weight"], loaded["model.embed_tokens.weight"])
    if spec["arch"] == "GptOssForCausalLM":
        rp = model.config.rope_parameters
        assert rp["rope_type"] == "yarn" and rp["truncate"] is False and rp["factor"] == 32.0, rp
    return model


def mxfp4_summary(torch, state):
    """Checksums of the dequantized expert tensors as transformers holds them ([E, in, out], fp32)."""
    out = {}
    for name in sorted(state):
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        t = state[name].float().contiguous()
        flat = t.reshape(-1)
        n = flat.numel()
        picks = sorted({0, 1, 31, 32, 33, n // 3, n // 2, n - 1})
        out[name] = dict(
            shape=list(t.shape),
            sha256_f32_le=hashlib.sha256(t.numpy().tobytes()).hexdigest(),
            sha256_bf16_le=hashlib.sha256(t.to(torch.bfloat16).view(torch.int16).numpy().tobytes()).hexdigest(),
            sum=float(t.double().sum().item()),
            abs_sum=float(t.double().abs().sum().item()),
            samples=[[i, float(flat[i].item())] for i in picks],
            row0=[float(v) for v in t[0, 0, :8].tolist()],
        )
    return out


def make_adapter(h, case, case_dir, load_base, spec):
    """get_peft_model on a fresh base, fill the factors, save with PEFT, reload with
    PeftModel.from_pretrained and assert the reload reproduces the in-memory logits (so the saved files
    are what produced the reference). Returns the reloaded model."""
    torch = h.torch
    from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
    name = spec["name"]
    adir = os.path.join(case_dir, "adapters", name)
    pm = get_peft_model(load_base(), LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **spec["lora"]))
    if spec.get("copy_tensors_from"):
        src = h.load_dir_tensors(os.path.join(case_dir, "adapters", spec["copy_tensors_from"]))
        ours = {k for k in pm.state_dict() if "lora_" in k}
        res = set_peft_model_state_dict(pm, {k: v.float() for k, v in src.items()})
        assert not getattr(res, "unexpected_keys", []), res.unexpected_keys
        assert len(ours) == len(src), (sorted(ours), sorted(src))
    else:
        h.fill_lora(pm, case, name)
    check = make_prompts(CASES[case]["seed"])
    with torch.no_grad():
        mem = [pm(input_ids=torch.tensor([p])).logits[0, -1].float() for p in check]
    h.save_adapter(pm, adir, spec.get("save_dtype", "bfloat16"))
    del pm

    reloaded = PeftModel.from_pretrained(load_base(), adir).eval()
    for n, p in reloaded.named_parameters():
        if "lora_" in n:
            assert p.dtype == torch.float32, f"{n} reloaded as {p.dtype}"
    with torch.no_grad():
        for m, p in zip(mem, check):
            err = (m - reloaded(input_ids=torch.tensor([p])).logits[0, -1].float()).abs().max().item()
            assert err <= 1e-5, f"{case}/{name}: reloaded adapter changes logits by {err}"
        for mname, mod in reloaded.named_modules():
            if hasattr(mod, "parameter_name") and "default" in mod.lora_A:
                check_param_delta(torch, f"{case}/{name}/{mname}", mod)
    return reloaded


def check_param_delta(torch, where, mod):
    """Asserts the fused-expert layout documented in tests/fixtures/README.md against PEFT's own delta.
    P [E, d1, d2]; A = lora_A [r*E, a] (expert-slowest rows), B = lora_B [b, r*E] (expert-fastest columns);
    A_e = A[e*r:(e+1)*r], B_e = B[:, e::E]. Delta of P[e] = scaling * (B_e A_e)^T when P is stored
    [E, in, out] (gpt-oss, `is_transposed`) or PEFT < 0.19.1 wrote the adapter; else scaling * B_e A_e."""
    import peft
    from packaging.version import Version
    p = mod.get_param()
    e_count, r, scaling = p.shape[0], mod.r["default"], mod.scaling["default"]
    a = mod.lora_A["default"].weight.float()
    b = mod.lora_B["default"].weight.float()
    transposed = bool(getattr(mod.get_base_layer(), "is_transposed", False))
    old = Version(peft.__version__.partition("+")[0]) < Version("0.19.1")
    assert Version(peft.__version__.partition("+")[0]) != Version("0.19.0"), "peft 0.19.0 swaps the other way"
    mine = []
    for e in range(e_count):
        ba = b[:, e::e_count] @ a[e * r:(e + 1) * r]
        mine.append(scaling * (ba.T if (transposed or old) else ba))
    mine = torch.stack(mine)
    theirs = mod.get_delta_weight("default").float()
    assert mine.shape == theirs.shape and torch.allclose(mine, theirs, atol=1e-6, rtol=1e-5), where


def lora_modules(model, peft_adapter="default"):
    """What PEFT built per saved key prefix: rank, alpha, scaling (after rank/alpha patterns and rsLoRA),
    and for target_parameters wrappers the wrapped parameter and the expert count."""
    out = {}
    for mname, mod in model.named_modules():
        lora_a = getattr(mod, "lora_A", None)
        if lora_a is None or peft_adapter not in lora_a:
            continue
        info = dict(r=int(mod.r[peft_adapter]), alpha=mod.lora_alpha[peft_adapter],
                    scaling=compact(mod.scaling[peft_adapter]))
        if hasattr(mod, "parameter_name"):
            info["param"] = mod.parameter_name
            info["num_experts"] = int(mod.num_experts)
        out[mname] = info
    return out


def clear(refs, gap):
    return all(r["margin"] >= MIN_GREEDY_MARGIN for r in refs) and (gap is None or gap >= MIN_ROUTER_GAP)


def references(h, case, base, adapters, top_k, prompts=None):
    """References of the base and every adapter. Without `prompts`, takes the first prompt set
    (seeds seed*1000, seed*1000+1, ...) on which every model's greedy steps and router choices are clear
    of near-ties, so a correct implementation cannot flip them by rounding, and on which every adapter's
    greedy continuation differs from the base's for at least one prompt. With `prompts`, asserts that."""
    attempts = [prompts] if prompts else [make_prompts(CASES[case]["seed"] * 1000 + i) for i in range(100)]
    for cand in attempts:
        base_refs, gap = h.run_reference(base, cand, top_k) if base is not None else (None, None)
        ok = base is None or clear(base_refs, gap)
        out = {None: (base_refs, gap)} if base is not None else {}
        for name, model in adapters:
            if not ok:
                break
            refs, g = h.run_reference(model, cand, top_k)
            ok = clear(refs, g)
            if ok and base_refs is not None:
                ok = any(r["greedy"] != b["greedy"] for r, b in zip(refs, base_refs))
            out[name] = (refs, g)
        if ok:
            return cand, out
        assert prompts is None, f"{case}: near-ties or unchanged greedy output with the given prompts: " + \
            str({k: ([r["margin"] for r in v[0]], v[1]) for k, v in out.items()})
    raise AssertionError(f"{case}: no prompt set without near-ties")


def top_k_of(case):
    return CASES[case]["config"].get("num_experts_per_tok")


def run_case(h, case, base, load_base, stage, prompts=None, base_refs=None):
    """Adapters of `stage` for one case, then references; returns the stage report for the case."""
    import peft
    import transformers
    case_dir = os.path.join(OUT_DIR, case)
    adapters = [(a["name"], make_adapter(h, case, case_dir, load_base, a))
                for a in ADAPTERS.get(case, []) if a.get("stage", CASES[case]["stage"]) == stage]
    prompts, refs = references(h, case, base, adapters, top_k_of(case), prompts)
    if base is None:  # base references come from the main stage; greedy must still differ from them
        for name, (r, _) in refs.items():
            assert any(x["greedy"] != b["greedy"] for x, b in zip(r, base_refs)), f"{case}/{name}: same as base"
    results = []
    for name, (r, _) in refs.items():
        results += h.results_json(name, r)
    versions = dict(torch=h.torch.__version__, transformers=transformers.__version__, peft=peft.__version__)
    print(f"[{stage}] {case}: " + ("base + " if base is not None else "") + f"{len(adapters)} adapters", flush=True)
    return dict(prompts=prompts, results=results, gaps=[g for _, g in refs.values()],
                modules={name: lora_modules(m) for name, m in adapters}, versions=versions, extra={})


def stage_v5(work):
    h = torch_helpers()
    report = {}
    for case, spec in CASES.items():
        if spec["stage"] != "v5":
            continue
        base = v5_build_base(h, case, os.path.join(OUT_DIR, case)).eval()
        model_dir = os.path.join(OUT_DIR, case, "model")
        report[case] = run_case(h, case, base, lambda: v5_load(case, model_dir), "v5")
        if spec["arch"] == "GptOssForCausalLM":
            report[case]["extra"]["mxfp4_dequant"] = mxfp4_summary(h.torch, base.state_dict())
    write_json(os.path.join(work, "v5.json"), report)


def stage_v5old(work):
    """peft 0.18 on transformers 5: the old fused-expert layout for non-transposed experts."""
    h = torch_helpers()
    with open(os.path.join(work, "v5.json")) as f:
        v5 = json.load(f)
    report = {}
    for case, adapters in ADAPTERS.items():
        if not any(a.get("stage") == "v5old" for a in adapters):
            continue
        model_dir = os.path.join(OUT_DIR, case, "model")
        base_refs = [dict(greedy=r["greedy"]) for r in v5[case]["results"] if r["adapter"] is None]
        report[case] = run_case(h, case, None, lambda: v5_load(case, model_dir), "v5old",
                                prompts=v5[case]["prompts"], base_refs=base_refs)
    write_json(os.path.join(work, "v5old.json"), report)


# ----------------------------------------------------------------------------------------------------
# Stage v4: transformers 4 + peft 0.18, per-expert nn.Linear experts.

def v4_config(case):
    import torch
    import transformers
    spec = CASES[case]
    c = dict(spec["config"])
    cls = {"Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig, "MixtralForCausalLM": transformers.MixtralConfig}[spec["arch"]]
    cfg = cls(**c)
    cfg.architectures = [spec["arch"]]
    cfg.torch_dtype = torch.bfloat16
    return cfg


def v4_load(case, model_dir):
    import transformers
    return getattr(transformers, CASES[case]["arch"]).from_pretrained(
        model_dir, attn_implementation="eager", **dtype_kw(4))


def v4_build_base(h, case, case_dir):
    torch = h.torch
    import transformers
    spec = CASES[case]
    model_dir = os.path.join(case_dir, "model")
    os.makedirs(model_dir)
    cfg = v4_config(case)
    cfg.save_pretrained(model_dir)
    skeleton = getattr(transformers, spec["arch"])(cfg)
    names = list(skeleton.state_dict().keys())
    truth = {}
    if spec.get("same_base_as"):
        # Split the fused checkpoint: gate_up [E, 2I, H] = cat(gate [E, I, H], up [E, I, H]); down [E, H, I].
        fused = h.load_dir_tensors(os.path.join(os.path.dirname(case_dir), spec["same_base_as"], "model"))
        for name, t in fused.items():
            t = t.float()
            if name.endswith("mlp.experts.gate_up_proj"):
                pre = name[: -len("gate_up_proj")]
                i = t.shape[1] // 2
                for e in range(t.shape[0]):
                    truth[f"{pre}{e}.gate_proj.weight"] = t[e, :i]
                    truth[f"{pre}{e}.up_proj.weight"] = t[e, i:]
            elif name.endswith("mlp.experts.down_proj"):
                pre = name[: -len("down_proj")]
                for e in range(t.shape[0]):
                    truth[f"{pre}{e}.down_proj.weight"] = t[e]
            else:
                truth[name] = t
        assert sorted(truth) == sorted(names), (sorted(set(truth) ^ set(names)))
        truth = {n: truth[n] for n in names}
    else:
        for name in names:
            truth[name] = h.base_init(case, name, skeleton.state_dict()[name].shape)
    h.save_checkpoint(model_dir, {k: v.to(torch.bfloat16) for k, v in truth.items()}, spec.get("shards", 1))
    model = v4_load(case, model_dir)
    loaded = model.state_dict()
    for name, w in truth.items():
        assert torch.equal(loaded[name].float(), w), f"{case}: {name} differs after loading"
    return model


def stage_v4(work):
    h = torch_helpers()
    report = {}
    for case, spec in CASES.items():
        if spec["stage"] != "v4":
            continue
        base = v4_build_base(h, case, os.path.join(OUT_DIR, case)).eval()
        model_dir = os.path.join(OUT_DIR, case, "model")
        report[case] = run_case(h, case, base, lambda: v4_load(case, model_dir), "v4")
    write_json(os.path.join(work, "v4.json"), report)


# ----------------------------------------------------------------------------------------------------
# Stage v5check: cross-checks only (writes nothing into the fixtures). transformers 5 converts per-expert
# checkpoints to fused tensors at load time, and peft >= 0.20 converts per-expert adapters likewise.

def stage_v5check(work):
    import torch
    from peft import PeftModel
    with open(os.path.join(work, "v4.json")) as f:
        v4 = json.load(f)
    with open(os.path.join(work, "v5.json")) as f:
        v5 = json.load(f)
    notes = {}
    for case, rep in v4.items():
        case_dir = os.path.join(OUT_DIR, case)
        model_dir = os.path.join(case_dir, "model")
        prompts = rep["prompts"]
        want = {(r["adapter"], r["prompt"]): r for r in rep["results"]}

        def max_err(model, adapter):
            with torch.no_grad():
                errs = []
                for i, p in enumerate(prompts):
                    got = model(input_ids=torch.tensor([p])).logits[0, -1].float()
                    errs.append((got - torch.tensor(want[(adapter, i)]["last_logits"])).abs().max().item())
                return max(errs)

        err = max_err(v5_load(case, model_dir), None)
        assert err < 1e-4, f"{case}: transformers 5 reads the per-expert checkpoint differently ({err})"
        notes[f"{case}/base"] = err
        same = CASES[case].get("same_base_as")
        if same:
            fused_base = [r for r in v5[same]["results"] if r["adapter"] is None]
            for r in fused_base:
                mine = want[(None, r["prompt"])]["last_logits"]
                e = max(abs(a - b) for a, b in zip(mine, r["last_logits"]))
                assert e < 1e-4, f"{case}: differs from {same} ({e})"
        for a in ADAPTERS[case]:
            try:
                m = PeftModel.from_pretrained(v5_load(case, model_dir), os.path.join(case_dir, "adapters", a["name"]))
            except Exception as ex:  # older peft cannot convert per-expert adapters: a finding, not a failure
                notes[f"{case}/{a['name']}"] = f"{type(ex).__name__}: {str(ex)[:200]}"
                continue
            err = max_err(m, a["name"])
            assert err < 1e-4, f"{case}/{a['name']}: peft's per-expert -> fused conversion differs ({err})"
            notes[f"{case}/{a['name']}"] = err
    for k, v in notes.items():
        print(f"[v5check] {k}: {v}", flush=True)
    write_json(os.path.join(work, "v5check.json"), notes)


# ----------------------------------------------------------------------------------------------------
# Stage verify: an independent float64 re-implementation of every case from the rules written in
# tests/fixtures/README.md, reading only the fixture files (torch + safetensors; no transformers, no
# peft). It checks that the README is a sufficient spec: last_logits within 1e-4, greedy ids equal,
# and the scaling derived from adapter_config.json equal to what PEFT built.

def verify_fixtures(out_dir):
    import re
    import torch
    from safetensors.torch import load_file
    dt = torch.float64
    fp4 = torch.tensor(FP4_MAGNITUDES + [-v for v in FP4_MAGNITUDES], dtype=dt)

    def tensors(d):
        t = {}
        for f in sorted(os.listdir(d)):
            if f.endswith(".safetensors"):
                t.update({k: v.to(dt) if v.is_floating_point() else v for k, v in load_file(os.path.join(d, f)).items()})
        return t

    def dequant(blocks, scales):  # [E, out, G, 16] u8, [E, out, G] u8 -> [E, out, in]
        v = torch.stack([fp4[(blocks & 15).long()], fp4[(blocks >> 4).long()]], -1)
        v = v.reshape(*blocks.shape[:-1], 32) * torch.exp2(scales.to(dt) - 127)[..., None]
        return v.reshape(*blocks.shape[:-2], -1)

    def rmsnorm(x, w, eps):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w

    def rope_tables(cfg, d, n):
        p = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        theta = p.get("rope_theta", cfg.get("rope_theta"))
        inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=dt) / d)
        att = 1.0
        if p.get("rope_type") == "yarn":
            f, orig = p["factor"], p["original_max_position_embeddings"]
            dim_of = lambda rot: d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))  # noqa: E731
            lo, hi = dim_of(p["beta_fast"]), dim_of(p["beta_slow"])
            if p.get("truncate", True):
                lo, hi = math.floor(lo), math.ceil(hi)
            lo, hi = max(lo, 0), min(hi, d - 1)
            keep = 1 - ((torch.arange(d // 2, dtype=dt) - lo) / (hi - lo)).clamp(0, 1)
            inv = inv / f * (1 - keep) + inv * keep
            att = 0.1 * math.log(f) + 1
        elif p.get("rope_type") == "llama3":
            f, lf, hf, orig = p["factor"], p["low_freq_factor"], p["high_freq_factor"], p["original_max_position_embeddings"]
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > orig / lf, inv / f, inv)
            smooth = (orig / wavelen - lf) / (hf - lf)
            mid = (wavelen >= orig / hf) & (wavelen <= orig / lf)
            inv = torch.where(mid, (1 - smooth) * scaled / f + smooth * scaled, scaled)
        ang = torch.arange(n, dtype=dt)[:, None] * inv[None]
        return torch.cos(ang) * att, torch.sin(ang) * att

    def rope(x, cos, sin):  # [T, heads, D], halves rotated
        h = x.shape[-1] // 2
        a, b, c, s = x[..., :h], x[..., h:], cos[:, None], sin[:, None]
        return torch.cat([a * c - b * s, b * c + a * s], -1)

    def pattern_value(patterns, key, default):
        for k, v in patterns.items():  # file order = PEFT's sorted order
            if re.match(rf"(.*\.)?({k})$", key):
                return v
        return default

    class Adapter:
        def __init__(self, d, modules):
            self.t = tensors(d)
            with open(os.path.join(d, "adapter_config.json")) as f:
                self.cfg = json.load(f)
            v = tuple(int(x) for x in re.findall(r"\d+", self.cfg.get("peft_version", "0.0.0"))[:3])
            self.b_input_side = v <= (0, 19, 0)  # non-transposed experts; 0.19.0 on gpt-oss not covered here
            self.modules = modules

        def scaling(self, prefix, match_key, r):
            c = self.cfg
            assert r == pattern_value(c["rank_pattern"], match_key, c["r"]), (prefix, r)
            alpha = pattern_value(c["alpha_pattern"], match_key, c["lora_alpha"])
            s = alpha / math.sqrt(r) if c["use_rslora"] else alpha / r
            assert abs(s - self.modules[prefix]["scaling"]) < 1e-6, (prefix, s, self.modules[prefix])
            return s

        def linear(self, name):
            prefix = "base_model.model." + name
            if prefix + ".lora_A.weight" not in self.t:
                return None
            a, b = self.t[prefix + ".lora_A.weight"], self.t[prefix + ".lora_B.weight"]
            return a, b, self.scaling(prefix, name, a.shape[0])

        def experts(self, layer_prefix, param, e_count, transposed):
            targets = self.cfg.get("target_parameters") or []
            if f"mlp.experts.{param}" not in targets:
                return None
            inner = param == "gate_up_proj" and "mlp.experts.down_proj" in targets
            prefix = f"base_model.model.{layer_prefix}.mlp.experts" + (".base_layer" if inner else "")
            a, b = self.t[prefix + ".lora_A.weight"], self.t[prefix + ".lora_B.weight"]
            r = a.shape[0] // e_count
            s = self.scaling(prefix, f"{layer_prefix}.mlp.experts.{param}", r)
            swapped = self.b_input_side and not transposed

            def delta(e, x):  # x [in] -> [out]
                ae, be = a[e * r:(e + 1) * r], b[:, e::e_count]
                return s * ((x @ be) @ ae if swapped else be @ (ae @ x))
            return delta

    def linear(x, t, name, ad):
        y = x @ t[name + ".weight"].T
        if name + ".bias" in t:
            y = y + t[name + ".bias"]
        lo = ad.linear(name) if ad else None
        if lo:
            a, b, s = lo
            y = y + s * (x @ a.T) @ b.T
        return y

    def forward(cfg, t, ids, ad):
        n, d, eps = len(ids), cfg["head_dim"], cfg["rms_norm_eps"]
        nh, nkv, arch = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["architectures"][0]
        cos, sin = rope_tables(cfg, d, n)
        x = t["model.embed_tokens.weight"][ids]
        for layer in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{layer}"
            h = rmsnorm(x, t[p + ".input_layernorm.weight"], eps)
            q = linear(h, t, p + ".self_attn.q_proj", ad).view(n, nh, d)
            k = linear(h, t, p + ".self_attn.k_proj", ad).view(n, nkv, d)
            v = linear(h, t, p + ".self_attn.v_proj", ad).view(n, nkv, d)
            if p + ".self_attn.q_norm.weight" in t:
                q = rmsnorm(q, t[p + ".self_attn.q_norm.weight"], eps)
                k = rmsnorm(k, t[p + ".self_attn.k_norm.weight"], eps)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
            scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(d)
            i, j = torch.arange(n)[:, None], torch.arange(n)[None]
            visible = j <= i
            if (cfg.get("layer_types") or [None] * 99)[layer] == "sliding_attention":
                visible &= j > i - cfg["sliding_window"]
            scores = scores.masked_fill(~visible, float("-inf"))
            if p + ".self_attn.sinks" in t:
                sinks = t[p + ".self_attn.sinks"][:, None, None].expand(nh, n, 1)
                probs = torch.softmax(torch.cat([scores, sinks], -1), -1)[..., :-1]
            else:
                probs = torch.softmax(scores, -1)
            x = x + linear(torch.einsum("hts,shd->thd", probs, v).reshape(n, nh * d), t, p + ".self_attn.o_proj", ad)
            h = rmsnorm(x, t[p + ".post_attention_layernorm.weight"], eps)
            x = x + mlp(cfg, arch, t, p, h, ad)
        x = rmsnorm(x, t["model.norm.weight"], eps)
        return x[-1] @ t.get("lm_head.weight", t["model.embed_tokens.weight"]).T

    def mlp(cfg, arch, t, p, h, ad):
        if arch in ("Qwen3ForCausalLM", "LlamaForCausalLM"):
            act = torch.nn.functional.silu(linear(h, t, p + ".mlp.gate_proj", ad)) * linear(h, t, p + ".mlp.up_proj", ad)
            return linear(act, t, p + ".mlp.down_proj", ad)
        e_count, k = cfg.get("num_experts") or cfg["num_local_experts"], cfg["num_experts_per_tok"]
        gpt_oss = arch == "GptOssForCausalLM"
        if gpt_oss:  # top-k of logits, softmax over the k
            logits = h @ t[p + ".mlp.router.weight"].T + t[p + ".mlp.router.bias"]
            top, idx = logits.topk(k, -1)
            weights = torch.softmax(top, -1)
            gate_up = dequant(t[p + ".mlp.experts.gate_up_proj_blocks"], t[p + ".mlp.experts.gate_up_proj_scales"])
            down = dequant(t[p + ".mlp.experts.down_proj_blocks"], t[p + ".mlp.experts.down_proj_scales"])
        else:  # softmax over all, top-k, renormalized
            router = p + (".block_sparse_moe.gate.weight" if arch == "MixtralForCausalLM" else ".mlp.gate.weight")
            top, idx = torch.softmax(h @ t[router].T, -1).topk(k, -1)
            weights = top / top.sum(-1, keepdim=True)
            gate_up, down = t.get(p + ".mlp.experts.gate_up_proj"), t.get(p + ".mlp.experts.down_proj")
        lora_gu = ad.experts(p, "gate_up_proj", e_count, gpt_oss) if ad and gate_up is not None else None
        lora_dn = ad.experts(p, "down_proj", e_count, gpt_oss) if ad and gate_up is not None else None
        out = torch.zeros_like(h)
        for tok in range(h.shape[0]):
            for slot in range(k):
                e, xt = int(idx[tok, slot]), h[tok]
                if gate_up is None:  # per-expert Linear modules
                    ep = p + (f".block_sparse_moe.experts.{e}" if arch == "MixtralForCausalLM" else f".mlp.experts.{e}")
                    g, u, dn = ("w1", "w3", "w2") if arch == "MixtralForCausalLM" else ("gate_proj", "up_proj", "down_proj")
                    act = torch.nn.functional.silu(linear(xt, t, f"{ep}.{g}", ad)) * linear(xt, t, f"{ep}.{u}", ad)
                    y = linear(act, t, f"{ep}.{dn}", ad)
                else:
                    gu = gate_up[e] @ xt + (t[p + ".mlp.experts.gate_up_proj_bias"][e] if gpt_oss else 0)
                    if lora_gu:
                        gu = gu + lora_gu(e, xt)
                    if gpt_oss:  # interleaved gate/up, clamped SwiGLU
                        g, u = gu[0::2].clamp(max=7.0), gu[1::2].clamp(-7.0, 7.0)
                        act = (u + 1) * g * torch.sigmoid(1.702 * g)
                    else:
                        half = gu.shape[0] // 2
                        act = torch.nn.functional.silu(gu[:half]) * gu[half:]
                    y = down[e] @ act + (t[p + ".mlp.experts.down_proj_bias"][e] if gpt_oss else 0)
                    if lora_dn:
                        y = y + lora_dn(e, act)
                out[tok] += weights[tok, slot] * y
        return out

    worst = 0.0
    for case in CASES:
        case_dir = os.path.join(out_dir, case)
        with open(os.path.join(case_dir, "model", "config.json")) as f:
            cfg = json.load(f)
        with open(os.path.join(case_dir, "expected.json")) as f:
            exp = json.load(f)
        t = tensors(os.path.join(case_dir, "model"))
        if cfg["architectures"][0] == "GptOssForCausalLM":  # the dequantized experts as transformers holds them
            for name, want in exp["mxfp4_dequant"].items():
                got = dequant(t[name + "_blocks"], t[name + "_scales"]).transpose(1, 2).contiguous().float()
                assert hashlib.sha256(got.numpy().tobytes()).hexdigest() == want["sha256_f32_le"], name
        adapters = {None: None}
        for name in exp["adapters"]:
            adapters[name] = Adapter(os.path.join(case_dir, "adapters", name), exp["adapter_modules"][name])
        for r in exp["results"]:
            ad = adapters[r["adapter"]]
            seq = list(exp["prompts"][r["prompt"]])
            last = forward(cfg, t, seq, ad)
            err = (last - torch.tensor(r["last_logits"], dtype=dt)).abs().max().item()
            assert err < 1e-4, f"verify {case}/{r['adapter']}/{r['prompt']}: logits differ by {err}"
            worst = max(worst, err)
            greedy = []
            for _ in range(exp["max_new_tokens"]):
                greedy.append(int((last if not greedy else forward(cfg, t, seq, ad)).argmax()))
                seq.append(greedy[-1])
            assert greedy == r["greedy"], f"verify {case}/{r['adapter']}/{r['prompt']}: greedy {greedy} != {r['greedy']}"
        print(f"[verify] {case}: {len(exp['results'])} results match", flush=True)
    print(f"[verify] largest logit difference {worst:.2e}", flush=True)


# ----------------------------------------------------------------------------------------------------
# Driver.

def assemble(out_dir, work):
    reports = {}
    for stage in ("v5", "v4", "v5old"):
        with open(os.path.join(work, f"{stage}.json")) as f:
            reports[stage] = json.load(f)
    for case, spec in CASES.items():
        main = reports[spec["stage"]][case]
        results = list(main["results"])
        versions = {spec["stage"]: main["versions"]}
        gaps = list(main["gaps"])
        modules = dict(main["modules"])
        old = reports["v5old"].get(case)
        if old:
            results += old["results"]
            modules.update(old["modules"])
            versions["v5old"] = old["versions"]
            gaps += old["gaps"]
        order = [None] + [a["name"] for a in ADAPTERS.get(case, [])]
        results.sort(key=lambda r: (order.index(r["adapter"]), r["prompt"]))
        for a in ADAPTERS.get(case, []):
            if a.get("copy_tensors_from"):  # same tensors, other PEFT generation: must mean something else
                mine = [r["last_logits"] for r in results if r["adapter"] == a["name"]]
                theirs = [r["last_logits"] for r in results if r["adapter"] == a["copy_tensors_from"]]
                diff = max(abs(x - y) for m, t in zip(mine, theirs) for x, y in zip(m, t))
                assert diff > 1e-2, f"{case}/{a['name']}: same logits as {a['copy_tensors_from']}"
        expected = {
            "format": 1,
            "case": case,
            "architecture": spec["arch"],
            "reference": versions,
            "prompts": main["prompts"],
            "max_new_tokens": MAX_NEW_TOKENS,
            "adapters": order[1:],
        }
        if any(g is not None for g in gaps):
            expected["min_router_gap"] = compact(min(g for g in gaps if g is not None))
        expected.update(main["extra"])
        expected["adapter_modules"] = {a: modules[a] for a in order[1:]}
        expected["results"] = results
        write_expected(os.path.join(out_dir, case, "expected.json"), expected)


def run_stage(python, stage, out_dir, work, extra_path=None):
    env = dict(os.environ, PYTHONHASHSEED="0", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
    if extra_path:
        env["PYTHONPATH"] = extra_path + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [python, os.path.abspath(__file__), "--stage", stage, "--out", out_dir, "--work", work]
    print("+", " ".join(cmd), f"(PYTHONPATH={extra_path})" if extra_path else "", flush=True)
    subprocess.run(cmd, env=env, check=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tests/fixtures")
    ap.add_argument("--python-v5", default="/opt/tv/bin/python")
    ap.add_argument("--python-v4", default="/opt/tv4/bin/python")
    ap.add_argument("--peft-old-path", default=None,
                    help="folder holding only a peft 0.18.x package (default: link the one of --python-v4)")
    ap.add_argument("--stage", choices=["v5", "v4", "v5old", "v5check", "verify"], help=argparse.SUPPRESS)
    ap.add_argument("--verify", action="store_true",
                    help="only re-check existing fixtures with the independent float64 implementation")
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    out_dir = os.path.abspath(args.out)

    if args.stage:
        global OUT_DIR
        OUT_DIR = out_dir
        if args.stage == "verify":
            verify_fixtures(out_dir)
            return
        {"v5": stage_v5, "v4": stage_v4, "v5old": stage_v5old, "v5check": stage_v5check}[args.stage](args.work)
        return
    if args.verify:
        run_stage(args.python_v5, "verify", out_dir, "-")
        return

    os.makedirs(out_dir, exist_ok=True)
    for case in CASES:
        shutil.rmtree(os.path.join(out_dir, case), ignore_errors=True)
    work = tempfile.mkdtemp(prefix="lmx_fixtures_")
    try:
        peft_old = args.peft_old_path
        if peft_old is None:
            pkg = subprocess.run([args.python_v4, "-c", "import peft, os; print(os.path.dirname(peft.__file__))"],
                                 check=True, capture_output=True, text=True).stdout.strip()
            peft_old = os.path.join(work, "peft_old")
            os.makedirs(peft_old)
            os.symlink(pkg, os.path.join(peft_old, "peft"))
        run_stage(args.python_v5, "v5", out_dir, work)
        run_stage(args.python_v4, "v4", out_dir, work)
        run_stage(args.python_v5, "v5old", out_dir, work, extra_path=peft_old)
        run_stage(args.python_v5, "v5check", out_dir, work)
        assemble(out_dir, work)
        run_stage(args.python_v5, "verify", out_dir, work)
        for case in CASES:  # safetensors writes 0600 files
            for d, _, fs in os.walk(os.path.join(out_dir, case)):
                for f in fs:
                    os.chmod(os.path.join(d, f), 0o644)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out_dir) for f in fs)
    print(f"wrote {out_dir}: {total / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
