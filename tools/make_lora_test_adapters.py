#!/usr/bin/env python3
"""Write the real-PEFT LoRA fixtures under tests/lora/data/ (run with a Python that has torch, transformers
and peft; the committed fixtures were made with peft 0.21.2 and transformers 5.24).

Each fixture directory holds what PEFT's save_pretrained wrote (adapter_config.json,
adapter_model.safetensors; README.md removed) plus expected_delta.safetensors: for every adapted
(layer, target) the delta weight PEFT itself computes (get_delta_weight, scaling included), as the true
linear map [out, in] (dense) or [E, out, in] (experts), in float32, under the names
"layers.{l}.{target}" with loramux's target words (q_proj ... o_proj, mlp.gate_proj ..., experts.gate_up,
experts.down). tests/lora/test_peft_fixtures.cpp checks b·a of the loaded adapter against it.

Only one orientation fact is supplied here rather than by PEFT: transformers stores GPT-OSS experts as
[E, in, out] (forward: x @ W[e]) and Qwen3-MoE/Mixtral fused experts as [E, out, in] (F.linear), so the
GPT-OSS delta is transposed to [E, out, in].

Fixtures (all tiny, deterministic seeds):
  peft_gpt_oss_fused       GPT-OSS, q/v_proj + target_parameters gate_up_proj & down_proj (f32)
  peft_qwen3_moe_fused     Qwen3-MoE (transformers 5 fused experts), attention + both expert params,
                           rsLoRA, rank_pattern / alpha_pattern (bf16)
  peft_qwen3_moe_fused_v018_layout
                           as above but laid out as PEFT <= 0.19.0 did for [E, out, in] parameters
                           (lora_A sized by dim 1): produced by real PEFT with the experts module marked
                           `is_transposed = True`, which makes 0.21.2 skip its swap exactly as the old
                           releases did; peft_version is then recorded as "0.18.1" (f32)
  peft_qwen3_moe_square_gate_up[_v018_layout]
                           Qwen3-MoE with 2I == H and only gate_up_proj targeted: the shapes cannot tell the
                           layouts apart, so the loader must decide from peft_version (f32)
  peft_llama_dense         Llama, all 7 projections, layers_to_transform, rank_pattern, alpha_pattern (f16)
"""
import json
import os
import shutil
import sys

import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.layer import LoraLayer, ParamWrapper
from safetensors.torch import save_file
from transformers import (GptOssConfig, GptOssForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "lora", "data")

TARGET_WORDS = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "o_proj": "o_proj",
                "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj",
                "gate_up_proj": "experts.gate_up", "down_proj@experts": "experts.down"}


def randomize_lora(model, seed):
    # PEFT initialises lora_B to zero; give every LoRA weight small random values so deltas are nonzero.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_A" in name or "lora_B" in name:
                p.copy_((torch.randn(p.shape, generator=gen) * 0.5).to(p.dtype))


def expected_deltas(model, experts_in_out):
    """{"layers.{l}.{target}": delta as the true [out, in] / [E, out, in] float32 map}, from PEFT."""
    model = model.float()  # deltas from the saved (possibly bf16/f16) values, computed in f32
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or "default" not in module.lora_A:
            continue
        layer = int(name.split(".layers.")[1].split(".")[0])
        if isinstance(module, ParamWrapper):
            delta = module.get_delta_weight("default")  # shaped like the parameter
            pname = module.parameter_name
            if experts_in_out:
                delta = delta.transpose(1, 2)  # GPT-OSS stores [E, in, out]
            target = TARGET_WORDS["gate_up_proj" if pname == "gate_up_proj" else "down_proj@experts"]
        else:
            delta = module.get_delta_weight("default")  # [out, in]
            target = TARGET_WORDS[name.rsplit(".", 1)[1]]
        out[f"layers.{layer}.{target}"] = delta.detach().float().contiguous()
    return out


def save(model, name, experts_in_out, seed, dtype=None, config_edits=None):
    if dtype is not None:
        model = model.to(dtype)
    randomize_lora(model, seed)
    d = os.path.join(ROOT, name)
    shutil.rmtree(d, ignore_errors=True)
    model.save_pretrained(d)
    if os.path.exists(os.path.join(d, "README.md")):
        os.remove(os.path.join(d, "README.md"))
    if config_edits:
        path = os.path.join(d, "adapter_config.json")
        with open(path) as f:
            cfg = json.load(f)
        cfg.update(config_edits)
        with open(path, "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
    save_file(expected_deltas(model, experts_in_out), os.path.join(d, "expected_delta.safetensors"))
    sizes = {f: os.path.getsize(os.path.join(d, f)) for f in sorted(os.listdir(d))}
    print(name, sizes)


def gpt_oss():
    torch.manual_seed(1)
    cfg = GptOssConfig(vocab_size=32, hidden_size=16, intermediate_size=6, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_local_experts=3,
                       num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"])
    model = GptOssForCausalLM(cfg)
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                      rank_pattern={"down_proj": 3}, alpha_pattern={"down_proj": 9})
    save(get_peft_model(model, lora), "peft_gpt_oss_fused", experts_in_out=True, seed=11)


def qwen3_moe(name, legacy):
    torch.manual_seed(2)
    cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=6,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         num_experts=4, num_experts_per_tok=2)
    model = Qwen3MoeForCausalLM(cfg)
    if legacy:
        for layer in model.model.layers:
            layer.mlp.experts.is_transposed = True  # PEFT then keeps lora_A sized by dim 1 (<= 0.19.0 behaviour)
    lora = LoraConfig(r=2, lora_alpha=5, use_rslora=True, target_modules=["q_proj", "k_proj", "o_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                      rank_pattern={r"layers\.1\..*gate_up_proj": 4},
                      alpha_pattern={"model.layers.0.self_attn.o_proj": 7})
    peft_model = get_peft_model(model, lora)
    if legacy:
        save(peft_model, name, experts_in_out=False, seed=13, config_edits={"peft_version": "0.18.1"})
    else:
        save(peft_model, name, experts_in_out=False, seed=12, dtype=torch.bfloat16)


def qwen3_moe_square(name, legacy):
    torch.manual_seed(4)
    cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=12, intermediate_size=32, moe_intermediate_size=6,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         num_experts=3, num_experts_per_tok=2)
    model = Qwen3MoeForCausalLM(cfg)
    if legacy:
        model.model.layers[0].mlp.experts.is_transposed = True
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=[], target_parameters=["mlp.experts.gate_up_proj"])
    edits = {"peft_version": "0.18.1"} if legacy else None
    save(get_peft_model(model, lora), name, experts_in_out=False, seed=15 + legacy, config_edits=edits)


def llama():
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    model = LlamaForCausalLM(cfg)
    lora = LoraConfig(r=2, lora_alpha=3,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                      layers_to_transform=[0, 2], rank_pattern={"o_proj": 4},
                      alpha_pattern={"model.layers.2.mlp.down_proj": 6})
    save(get_peft_model(model, lora), "peft_llama_dense", experts_in_out=False, seed=14, dtype=torch.float16)


if __name__ == "__main__":
    import peft, transformers
    print("peft", peft.__version__, "transformers", transformers.__version__, file=sys.stderr)
    os.makedirs(ROOT, exist_ok=True)
    gpt_oss()
    qwen3_moe("peft_qwen3_moe_fused", legacy=False)
    qwen3_moe("peft_qwen3_moe_fused_v018_layout", legacy=True)
    qwen3_moe_square("peft_qwen3_moe_square_gate_up", legacy=False)
    qwen3_moe_square("peft_qwen3_moe_square_gate_up_v018_layout", legacy=True)
    llama()
