#!/usr/bin/env python3
"""Trains loramux's built-in default model: a byte-level BPE tokenizer, a small Qwen3-MoE model and four
PEFT LoRA adapters, each on one style or language, so that one prompt visibly continues differently per
adapter. Also writes the Hugging Face reference outputs that tests/engine/test_default_model.cpp and
tests/server/test_default_model.py check loramux against. Not called by the build; its output is committed.

    tools/fetch_default_corpus.sh                                     # once: .corpus/ (Debian packages)
    python3 tools/train_default.py --device cuda                      # the real run (H200: ~3 min)
    /opt/tv/bin/python tools/train_default.py --device cpu --base-steps 20 --adapter-steps 5 --batch 8 --seq 64
                                                                      # pipeline smoke test on a CPU
    /opt/tv/bin/python tools/train_default.py --fixtures-only         # only the reference outputs, from
                                                                      # the model already in --out

Writes --out (default models/default): config.json, model.safetensors (bf16), tokenizer.json,
tokenizer_config.json, adapters/<name>/{adapter_config.json, adapter_model.safetensors} (bf16),
TRAINING.md; and --fixtures (default tests/fixtures/default_model.json, format below).

Determinism: every random choice comes from --seed (torch generators, data windows); CPU runs repeat
bit for bit, CUDA runs up to the nondeterminism of its kernels (recorded in TRAINING.md).

Fixture format (JSON): {format: 1, reference: {torch, transformers, peft}, max_new_tokens,
  adapters: [names], prompts: [{text, ids}], results: [{adapter (null = base), prompt (index),
  last_logits [V] (fp32 logits at the last prompt position, 7 significant digits), greedy [ids],
  greedy_margins [top-1 minus top-2 logit per greedy step], min_router_gap, text (the greedy tokens before
  the first EOS, decoded: what a server answers), stops_at_eos}]}.
The reference is transformers + peft in float32 with eager attention and eager experts on the saved
bf16 files (bf16 -> fp32 is exact), the same fp32 math as loramux's CPU backend.
"""

import argparse
import inspect
import json
import math
import os
import platform
import random
import shutil
import sys
import time

# ----------------------------------------------------------------------------------------------------
# What is trained. Dims follow the glossary: V vocab, H hidden, I expert intermediate, E experts, K top-k,
# D head dim, R LoRA rank.

VOCAB = 4096           # V, incl. the one special token
EOS = "<|endoftext|>"  # id 0: ends every training document
MODEL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, intermediate_size=512,
             norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=True,
             router_aux_loss_coef=0.01)
ROPE_THETA = 10000.0

# Corpus files under --corpus/text (made by tools/fetch_default_corpus.sh) and their share of the base mix.
SOURCES = {"fortunes_en": 0.35, "kjv": 0.2, "fortunes_de": 0.15, "fortunes_es": 0.1, "fortunes_it": 0.1,
           "sonnet": 0.1}
# One adapter per style: name -> corpus file.
ADAPTERS = {"kjv": "kjv", "sonnet": "sonnet", "german": "fortunes_de", "spanish": "fortunes_es"}
LORA_RANK, LORA_ALPHA = 8, 16
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}\n{% endfor %}"

# Reference outputs: the first FIXTURE_PROMPTS candidates whose greedy steps and router choices are all
# clear enough (see MIN_*) for fp32 summation-order differences not to flip them.
PROMPT_CANDIDATES = ["The", "And the", "Shall I compare thee", "Der", "El", "Love is", "I think that",
                     "In the beginning", "When"]
FIXTURE_PROMPTS = 3
MAX_NEW_TOKENS = 12
MIN_GREEDY_MARGIN = 1e-3
MIN_ROUTER_GAP = 1e-4
MAX_TOTAL_BYTES = 15_000_000


def compact(x):
    return float(f"{float(x):.7g}")


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, ensure_ascii=False)
        f.write("\n")


def read_documents(corpus, name):
    path = os.path.join(corpus, "text", name + ".txt")
    if not os.path.exists(path):
        raise SystemExit(f"train_default.py: missing corpus file {path} (run tools/fetch_default_corpus.sh, "
                         f"or pass --corpus DIR)")
    with open(path, encoding="utf-8") as f:
        docs = [d.strip("\n") for d in f.read().split("\n%\n")]
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise SystemExit(f"train_default.py: {path} holds no documents")
    return docs


# ----------------------------------------------------------------------------------------------------
# Tokenizer: byte-level BPE (GPT-2 pre-tokenizer regex, no prefix space), one special token, no BOS.

def train_tokenizer(docs_by_source, out_dir, seed):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    rng = random.Random(seed)
    # A balanced sample, so that every language gets merges (the German fortunes alone outweigh sonnets 100x).
    sample = []
    for name in sorted(docs_by_source):
        docs = docs_by_source[name]
        sample += rng.sample(docs, min(len(docs), 4000)) if len(docs) > 4000 else docs * max(1, 400 // len(docs))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator(sample, trainer=trainer)
    assert tok.token_to_id(EOS) == 0, "the EOS token must be id 0"
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    write_json(os.path.join(out_dir, "tokenizer_config.json"), {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": EOS, "pad_token": EOS,
        "add_bos_token": False, "model_max_length": MODEL["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE})
    return tok


def encode_stream(torch, tok, docs):
    """All documents, each followed by EOS, as one 1-D int64 token stream."""
    ids = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(0)
    return torch.tensor(ids, dtype=torch.long)


# ----------------------------------------------------------------------------------------------------
# Model.

def model_config(eos_id):
    import torch
    import transformers
    c = dict(MODEL)
    cfg = transformers.Qwen3MoeConfig(vocab_size=VOCAB, rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
                                      decoder_sparse_step=1, mlp_only_layers=[], bos_token_id=None,
                                      eos_token_id=eos_id, pad_token_id=eos_id, output_router_logits=False, **c)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    cfg.dtype = torch.bfloat16
    return cfg


def batches(torch, streams, weights, batch, seq, gen, device):
    """Random windows of seq+1 tokens; each row's source drawn by `weights`."""
    names = list(streams)
    probs = torch.tensor([weights[n] for n in names], dtype=torch.float64)
    while True:
        which = torch.multinomial(probs, batch, replacement=True, generator=gen)
        rows = []
        for w in which.tolist():
            s = streams[names[w]]
            start = int(torch.randint(0, len(s) - seq - 1, (1,), generator=gen))
            rows.append(s[start:start + seq + 1])
        yield torch.stack(rows).to(device)


def lr_at(progress, step, warmup, peak):
    """Linear warmup over `warmup` steps, then cosine from peak to peak/10 as progress goes 0 -> 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train_loop(torch, model, params, data, steps, peak_lr, device, label, max_seconds, weight_decay=0.0):
    """AdamW with warmup + cosine; bf16 autocast on CUDA. With max_seconds the schedule runs on whichever of
    steps and time is further along, so a time-capped run still decays its learning rate and stops by then.
    Returns (steps run, mean loss of the last 20 steps, seconds)."""
    opt = torch.optim.AdamW(params, lr=peak_lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    model.train()
    losses, t0, ran = [], time.time(), 0
    warmup = max(1, min(100, steps // 10))
    for step in range(steps):
        progress = step / steps
        if max_seconds:
            progress = max(progress, (time.time() - t0) / max_seconds)
        if progress >= 1.0:
            print(f"  {label}: stopped at step {step} of {steps} (--max-*seconds {max_seconds})", flush=True)
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(progress, step, warmup, peak_lr)
        x = next(data)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=(device == "cuda")):
            out = model(input_ids=x[:, :-1])
            logits = out.logits.float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
            # Router load balancing (transformers computes it when output_router_logits is set).
            aux = getattr(out, "aux_loss", None)
            total = loss + model_aux_coef(model) * aux if aux is not None else loss
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        ran = step + 1
        if step % 100 == 0 or step + 1 == steps:
            print(f"  {label} step {step:5d}/{steps}  loss {loss.item():.3f}  {time.time() - t0:6.1f}s", flush=True)
    tail = losses[-20:]
    return ran, sum(tail) / len(tail), time.time() - t0


def model_aux_coef(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.config.router_aux_loss_coef if base.config.output_router_logits else 0.0


def bf16_state(torch, model):
    """The base checkpoint: every tensor rounded to bf16 (tied lm_head omitted)."""
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        out[name] = t.detach().to("cpu", torch.bfloat16).contiguous()
    return out


def save_base(torch, model, cfg, out_dir):
    from safetensors.torch import save_file
    cfg.save_pretrained(out_dir)
    save_file(bf16_state(torch, model), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def load_base(out_dir, device="cpu", reference=True, experts=None):
    """The saved bf16 checkpoint as an fp32 transformers model: for reference outputs with eager attention
    and eager experts; for training with transformers' defaults (or `experts`)."""
    import torch
    import transformers
    kw = dict(dtype=torch.float32)
    if reference:
        kw["attn_implementation"] = "eager"
        experts = "eager"
    if experts is None:
        return transformers.Qwen3MoeForCausalLM.from_pretrained(out_dir, **kw).to(device)
    try:
        model = transformers.Qwen3MoeForCausalLM.from_pretrained(out_dir, experts_implementation=experts, **kw)
    except (TypeError, ValueError):  # a transformers 5 without experts_implementation: its experts are eager
        if experts != "eager":
            raise
        model = transformers.Qwen3MoeForCausalLM.from_pretrained(out_dir, **kw)
    return model.to(device)


def lora_config_kwargs():
    """Attention + fused experts when this peft has target_parameters (>= 0.17), else attention only."""
    from peft import LoraConfig
    fields = set(getattr(LoraConfig, "__dataclass_fields__", {})) or set(inspect.signature(LoraConfig).parameters)
    kw = dict(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=list(ATTN), task_type="CAUSAL_LM")
    if "target_parameters" in fields:
        kw["target_parameters"] = list(EXPERTS)
    return kw


def save_adapter(torch, peft_model, adapter_dir):
    """PEFT's own save_pretrained with bf16 tensors; README dropped; no absolute base path."""
    for n, p in peft_model.named_parameters():
        if "lora_" in n:
            p.data = p.data.to(torch.bfloat16)
    peft_model.save_pretrained(adapter_dir)
    readme = os.path.join(adapter_dir, "README.md")
    if os.path.exists(readme):
        os.remove(readme)
    cfg_path = os.path.join(adapter_dir, "adapter_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["base_model_name_or_path"] = None
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


# ----------------------------------------------------------------------------------------------------
# Reference outputs.

def reference(torch, model, ids):
    """Last-position logits, greedy continuation (the prompt recomputed each step, no cache), per-step
    top-1/top-2 margins, and the smallest k-th vs (k+1)-th router-logit gap seen."""
    top_k = MODEL["num_experts_per_tok"]
    gap = {"min": float("inf")}

    def hook(_m, _inp, out):
        logits = out[0] if isinstance(out, tuple) else out
        s = logits.reshape(-1, logits.shape[-1]).float().sort(dim=-1, descending=True).values
        gap["min"] = min(gap["min"], (s[:, top_k - 1] - s[:, top_k]).min().item())

    handles = [m.register_forward_hook(hook) for n, m in model.named_modules() if n.endswith("mlp.gate")]
    if not handles:
        raise SystemExit("train_default.py: found no mlp.gate router modules to check router gaps on")
    model.eval()
    with torch.no_grad():
        cur = torch.tensor([ids], dtype=torch.long)
        last = None
        greedy, margins = [], []
        for _ in range(MAX_NEW_TOKENS):
            lg = model(input_ids=cur).logits[0, -1].float()
            if last is None:
                last = lg.clone()
            top2 = lg.topk(2).values
            margins.append((top2[0] - top2[1]).item())
            nxt = int(lg.argmax().item())
            greedy.append(nxt)
            cur = torch.cat([cur, torch.tensor([[nxt]])], dim=1)
    for hd in handles:
        hd.remove()
    return dict(last=last, greedy=greedy, margins=margins, router_gap=gap["min"])


def until_eos(ids):
    """What a server returns for a greedy continuation: the tokens before the first EOS (id 0)."""
    return ids[:ids.index(0)] if 0 in ids else ids


def write_fixtures(out_dir, fixtures_path):
    import peft
    import torch
    import transformers
    from peft import PeftModel
    from tokenizers import Tokenizer
    torch.set_grad_enabled(False)
    tok = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
    adapter_names = sorted(os.listdir(os.path.join(out_dir, "adapters")))
    models = {None: load_base(out_dir)}
    for name in adapter_names:
        models[name] = PeftModel.from_pretrained(load_base(out_dir), os.path.join(out_dir, "adapters", name)).eval()

    prompts, results, rejected = [], [], []
    for text in PROMPT_CANDIDATES:
        if len(prompts) == FIXTURE_PROMPTS:
            break
        ids = tok.encode(text).ids
        refs = {name: reference(torch, m, ids) for name, m in models.items()}
        worst_margin = min(min(r["margins"]) for r in refs.values())
        worst_gap = min(r["router_gap"] for r in refs.values())
        if worst_margin < MIN_GREEDY_MARGIN or worst_gap < MIN_ROUTER_GAP:
            rejected.append(f"{text!r} (greedy margin {worst_margin:.2e}, router gap {worst_gap:.2e})")
            continue
        index = len(prompts)
        prompts.append(dict(text=text, ids=ids))
        for name, r in refs.items():
            results.append(dict(adapter=name, prompt=index, greedy=r["greedy"],
                                greedy_margins=[compact(m) for m in r["margins"]],
                                min_router_gap=compact(r["router_gap"]),
                                text=tok.decode(until_eos(r["greedy"])),
                                stops_at_eos=0 in r["greedy"],
                                last_logits=[compact(v) for v in r["last"].tolist()]))
    for line in rejected:
        print(f"  fixtures: prompt {line} too close to a tie; skipped")
    if not prompts:
        raise SystemExit("train_default.py: no candidate prompt has clear greedy steps and router choices")
    by_prompt = {}
    for r in results:
        by_prompt.setdefault(r["prompt"], {})[r["adapter"]] = r["greedy"]
    for p, per in by_prompt.items():
        same = [a for a in adapter_names if per[a] == per[None]]
        if same:
            print(f"  fixtures: WARNING prompt {prompts[p]['text']!r}: adapters {same} continue like the base model")
    obj = dict(format=1, reference=dict(torch=torch.__version__, transformers=transformers.__version__, peft=peft.__version__),
               max_new_tokens=MAX_NEW_TOKENS, min_greedy_margin=MIN_GREEDY_MARGIN, min_router_gap=MIN_ROUTER_GAP,
               adapters=adapter_names, prompts=prompts, results=results)
    os.makedirs(os.path.dirname(os.path.abspath(fixtures_path)), exist_ok=True)
    # One result per line keeps diffs readable.
    with open(fixtures_path, "w") as f:
        head = {k: v for k, v in obj.items() if k != "results"}
        text = json.dumps(head, ensure_ascii=False)[:-1]
        f.write(text + ', "results": [\n')
        f.write(",\n".join(json.dumps(r, ensure_ascii=False) for r in results))
        f.write("\n]}\n")
    print(f"wrote {fixtures_path}: {len(prompts)} prompts x {len(models)} models")
    return obj


# ----------------------------------------------------------------------------------------------------

def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def write_training_md(out_dir, record, fixtures):
    lines = ["# The default model: how it was trained", "",
             "Made by `tools/train_default.py` (its docstring says how to rerun it) from the corpus of",
             "`tools/fetch_default_corpus.sh`; do not edit by hand. A toy: it shows multi-LoRA serving working,",
             "it knows no facts.", "",
             "## Machine and libraries", "",
             f"- {record['machine']}", f"- device `{record['device']}`, torch {record['torch']}, transformers "
             f"{record['transformers']}, peft {record['peft']}, tokenizers {record['tokenizers']}",
             f"- seed {record['seed']}; wall time {record['wall_s']:.0f} s; training experts kernel "
             f"`{record['experts_impl']}`",
             f"- command: `{record['command']}`", "",
             "## Corpus", "",
             "| source | documents | tokens | share of the base mix |", "|---|---|---|---|"]
    for name in sorted(record["corpus"]):
        c = record["corpus"][name]
        lines.append(f"| {name} | {c['documents']} | {c['tokens']} | {SOURCES[name]:.2f} |")
    lines += ["", "Sources and licenses: `.corpus/SOURCES.md` from the fetch script, copied below.", "",
              "```", record["sources_md"].strip(), "```", "",
              "## Tokenizer", "",
              f"Byte-level BPE (GPT-2 pre-tokenizer regex, no prefix space), V = {VOCAB}, trained with `tokenizers` "
              f"on a balanced sample of every source. `{EOS}` (id 0) ends every training document and is the EOS; no "
              "BOS. The chat template only joins the messages' contents, one per line: this is a text-completion model.", "",
              "## Base model", "",
              f"`Qwen3MoeForCausalLM`: {MODEL['num_hidden_layers']} layers, H {MODEL['hidden_size']}, "
              f"{MODEL['num_attention_heads']} query / {MODEL['num_key_value_heads']} KV heads of D {MODEL['head_dim']}, "
              f"E {MODEL['num_experts']} experts (top-{MODEL['num_experts_per_tok']}, renormalized) of I "
              f"{MODEL['moe_intermediate_size']}, tied embeddings, RoPE theta {ROPE_THETA:g}; "
              f"{record['base_params']:,} parameters, stored in bf16.", "",
              f"Training: {record['base_steps']} steps of {record['batch']} x {record['seq']} tokens, AdamW "
              f"(peak lr {record['base_lr']}, warmup + cosine to 10%, weight decay 0.1, clip 1.0), router "
              f"load-balancing loss x {MODEL['router_aux_loss_coef']}; final loss (mean of the last 20 steps) "
              f"{record['base_loss']:.3f}; {record['base_s']:.0f} s.", "",
              "## Adapters", "",
              f"PEFT LoRA r {LORA_RANK}, alpha {LORA_ALPHA} on `{', '.join(record['lora_targets'])}`, each trained "
              f"on its source alone (peak lr {record['adapter_lr']}, steps below) on top of "
              "the bf16 base; saved in bf16.", "",
              "| adapter | source | base loss on the source | adapter loss (last 20 steps) | steps | seconds |",
              "|---|---|---|---|---|---|"]
    for name, a in record["adapters"].items():
        lines.append(f"| {name} | {a['source']} | {a['base_loss']:.3f} | {a['loss']:.3f} | {a['steps']} | "
                     f"{a['seconds']:.0f} |")
    lines += ["", "## Greedy continuations (the reference outputs the tests check)", ""]
    if fixtures:
        for p_index, p in enumerate(fixtures["prompts"]):
            lines.append(f"Prompt {json.dumps(p['text'], ensure_ascii=False)}:")
            lines.append("")
            for r in fixtures["results"]:
                if r["prompt"] == p_index:
                    lines.append(f"- {r['adapter'] or 'base'}: {json.dumps(r['text'], ensure_ascii=False)}")
            lines.append("")
    lines.append(f"Size of this folder: {record['total_bytes'] / 1e6:.2f} MB.")
    with open(os.path.join(out_dir, "TRAINING.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", default=".corpus", help="folder made by tools/fetch_default_corpus.sh")
    ap.add_argument("--out", default="models/default")
    ap.add_argument("--fixtures", default="tests/fixtures/default_model.json")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--base-steps", type=int, default=2000)
    ap.add_argument("--adapter-steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--base-lr", type=float, default=3e-3)
    ap.add_argument("--adapter-lr", type=float, default=3e-3)
    ap.add_argument("--max-seconds", type=float, default=0,
                    help="cap on the base training in seconds (0: none); the schedule fits it, steps run are recorded")
    ap.add_argument("--max-adapter-seconds", type=float, default=0, help="the same cap per adapter")
    ap.add_argument("--experts-implementation", default=None,
                    help="transformers' experts kernel for training (eager, grouped_mm, ...; default: its choice); "
                         "reference outputs always use eager")
    ap.add_argument("--fixtures-only", action="store_true", help="only rewrite --fixtures from the model in --out")
    args = ap.parse_args()

    if args.fixtures_only:
        write_fixtures(args.out, args.fixtures)
        return

    import peft
    import tokenizers
    import torch
    import transformers
    from peft import get_peft_model, LoraConfig

    t_start = time.time()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("train_default.py: --device cuda but torch sees no GPU")
        torch.backends.cuda.matmul.allow_tf32 = True
    device = args.device

    docs = {name: read_documents(args.corpus, name) for name in SOURCES}
    with open(os.path.join(args.corpus, "SOURCES.md")) as f:
        sources_md = f.read()
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(os.path.join(args.out, "adapters"))

    t_tok = time.time()
    tok = train_tokenizer(docs, args.out, args.seed)
    streams = {name: encode_stream(torch, tok, d) for name, d in docs.items()}
    print(f"tokenizer trained and corpus encoded in {time.time() - t_tok:.0f} s", flush=True)
    for name, s in streams.items():
        if len(s) < args.seq + 2:
            raise SystemExit(f"train_default.py: source {name} has {len(s)} tokens, fewer than --seq {args.seq} + 2")
    record = dict(machine=f"{platform.node()} ({platform.machine()}, {platform.platform()})"
                  + (f", {torch.cuda.get_device_name(0)}" if device == "cuda" else ""),
                  device=device, torch=torch.__version__, transformers=transformers.__version__, peft=peft.__version__,
                  tokenizers=tokenizers.__version__, seed=args.seed, batch=args.batch, seq=args.seq,
                  base_lr=args.base_lr, command="python3 tools/train_default.py " + " ".join(sys.argv[1:]), adapter_lr=args.adapter_lr, sources_md=sources_md,
                  corpus={n: dict(documents=len(docs[n]), tokens=len(streams[n])) for n in SOURCES})
    print(f"tokenizer: V {tok.get_vocab_size()}; tokens per source: "
          + ", ".join(f"{n} {len(s)}" for n, s in streams.items()), flush=True)

    # Base model on the mix.
    cfg = model_config(eos_id=0)
    train_cfg = model_config(eos_id=0)
    train_cfg.output_router_logits = True
    if args.experts_implementation:
        train_cfg._experts_implementation = args.experts_implementation
    model = transformers.Qwen3MoeForCausalLM(train_cfg).to(device)
    record["experts_impl"] = getattr(model.config, "_experts_implementation", None) or "eager"
    record["base_params"] = sum(p.numel() for n, p in model.named_parameters())
    gen = torch.Generator().manual_seed(args.seed)
    data = batches(torch, streams, SOURCES, args.batch, args.seq, gen, device)
    params = [p for p in model.parameters() if p.requires_grad]
    ran, loss, secs = train_loop(torch, model, params, data, args.base_steps, args.base_lr, device, "base",
                                 args.max_seconds, weight_decay=0.1)
    record.update(base_steps=ran, base_loss=loss, base_s=secs)
    save_base(torch, model, cfg, args.out)
    del model

    # Adapters, each on the saved bf16 base.
    lora_kw = lora_config_kwargs()
    record["lora_targets"] = lora_kw["target_modules"] + lora_kw.get("target_parameters", [])
    if "target_parameters" not in lora_kw:
        print(f"WARNING: peft {peft.__version__} has no target_parameters: adapters cover attention only", flush=True)
    record["adapters"] = {}
    for a_index, (name, source) in enumerate(ADAPTERS.items()):
        torch.manual_seed(args.seed + 1 + a_index)
        base = load_base(args.out, device, reference=False, experts=args.experts_implementation)
        for p in base.parameters():
            p.requires_grad_(False)
        gen = torch.Generator().manual_seed(args.seed + 100 + a_index)
        eval_data = batches(torch, {source: streams[source]}, {source: 1.0}, args.batch, args.seq, gen, device)
        with torch.no_grad(), torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=(device == "cuda")):
            base_losses = []
            for _ in range(4):
                x = next(eval_data)
                lg = base(input_ids=x[:, :-1]).logits.float()
                base_losses.append(torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), x[:, 1:].reshape(-1)).item())
        pm = get_peft_model(base, LoraConfig(**lora_kw))
        params = [p for p in pm.parameters() if p.requires_grad]
        data = batches(torch, {source: streams[source]}, {source: 1.0}, args.batch, args.seq, gen, device)
        ran, loss, secs = train_loop(torch, pm, params, data, args.adapter_steps, args.adapter_lr, device,
                                     f"adapter {name}", args.max_adapter_seconds)
        pm = pm.to("cpu")
        save_adapter(torch, pm, os.path.join(args.out, "adapters", name))
        record["adapters"][name] = dict(source=source, loss=loss, seconds=secs, steps=ran,
                                        base_loss=sum(base_losses) / len(base_losses))
        del pm, base

    for d, _, fs in os.walk(args.out):  # safetensors writes 0600 files
        for f in fs:
            os.chmod(os.path.join(d, f), 0o644)
    t_fix = time.time()
    fixtures = write_fixtures(args.out, args.fixtures)
    print(f"reference outputs in {time.time() - t_fix:.0f} s", flush=True)
    record["wall_s"] = time.time() - t_start
    record["total_bytes"] = dir_bytes(args.out)
    write_training_md(args.out, record, fixtures)
    record["total_bytes"] = dir_bytes(args.out)
    print(f"wrote {args.out}: {record['total_bytes'] / 1e6:.2f} MB in {record['wall_s']:.0f} s")
    if record["total_bytes"] > MAX_TOTAL_BYTES:
        raise SystemExit(f"train_default.py: {args.out} is {record['total_bytes']} bytes, over {MAX_TOTAL_BYTES}")


if __name__ == "__main__":
    main()
