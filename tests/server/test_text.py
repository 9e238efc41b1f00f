"""Text in, text out through `loramux serve` and the official openai client: a preset sized to a real
tokenizer (Qwen3, with its chat template) serves text completions and chat, streamed and not, for the base
and an adapter; streamed text equals the non-streamed text; stop strings cut the output where they first
occur (across token boundaries) and are not emitted; prompt token counts equal our tokenizer's; GPT-OSS
chat renders through templates/harmony.jinja; a tokenizer larger than the model's vocabulary is refused at
start. Token-id-only servers are covered in test_openai_client.py."""
import json
import os
import re
import subprocess
import time

import pytest

from serve_helpers import BIN, ROOT, Server

# The published tokenizer files beside the checkout (as tests/CMakeLists.txt searches for them).
TOKENIZERS = next((d for d in [os.path.join(ROOT, "..", "shared", "data", "tokenizers"), "/work/shared/data/tokenizers"]
                   if os.path.isdir(d)), "")
QWEN3 = os.path.join(TOKENIZERS, "qwen3")
GPT_OSS = os.path.join(TOKENIZERS, "gpt-oss")
HARMONY = os.path.join(ROOT, "templates", "harmony.jinja")
BASE = "preset:tiny-moe"
PROMPT = "Once upon a time, in a café by the sea, 小猫 said:"

pytestmark = pytest.mark.skipif(not TOKENIZERS or os.environ.get("LORAMUX_NO_SHARED_DATA") is not None,
                                reason="no ../shared/data/tokenizers (the published tokenizer files)")


def tokenize_cli(tokenizer_dir, values, decode=False, special=True):
    """`loramux tokenize` over JSON lines: texts -> id lists, or (decode) id lists -> texts."""
    args = [BIN, "tokenize", "--model", tokenizer_dir] + (["--decode"] if decode else []) + ([] if special else ["--no-special"])
    out = subprocess.run(args, input="".join(json.dumps(v) + "\n" for v in values), capture_output=True, text=True,
                         check=True).stdout
    return [json.loads(line) for line in out.splitlines()]


@pytest.fixture(scope="module")
def server():
    s = Server("--model", BASE, "--tokenizer", QWEN3, "--dummy-loras", "2", "--max-model-len", "1024")
    yield s
    s.stop()


def completion(client, stream, **kw):
    """(text, token_ids, finish_reason, usage) of one completion or chat request, streamed or not."""
    chat = "messages" in kw
    create = client.chat.completions.create if chat else client.completions.create
    if not stream:
        r = create(**kw)
        c = r.choices[0]
        text = c.message.content if chat else c.text
        if chat:
            assert c.message.role == "assistant"
        return text, c.to_dict()["token_ids"], c.finish_reason, r.usage
    text, ids, finish, usage, ids_seen = "", [], None, None, set()
    for i, chunk in enumerate(create(stream=True, stream_options={"include_usage": True}, **kw)):
        ids_seen.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if chat:
                if i == 0:
                    assert c.delta.role == "assistant"
                text += c.delta.content or ""
            else:
                text += c.text
            ids += c.to_dict()["token_ids"]
            finish = c.finish_reason or finish
    assert len(ids_seen) == 1
    return text, ids, finish, usage


def test_text_completions_stream_equal_non_stream_for_base_and_adapter(server):
    client = server.client()
    prompt_ids = tokenize_cli(QWEN3, [PROMPT])[0]
    prompt_tokens = len(prompt_ids)
    texts, outputs = {}, {}
    for model in [BASE, "lora0"]:
        kw = dict(model=model, prompt=PROMPT, max_tokens=16, temperature=0.9, seed=11, extra_body={"ignore_eos": True})
        text, ids, finish, usage = completion(client, False, **kw)
        assert finish == "length" and len(ids) == 16 and text
        assert usage.prompt_tokens == prompt_tokens and usage.completion_tokens == 16 and usage.total_tokens == prompt_tokens + 16
        s_text, s_ids, s_finish, s_usage = completion(client, True, **kw)
        assert (s_text, s_ids, s_finish) == (text, ids, finish), model
        assert s_usage.prompt_tokens == prompt_tokens and s_usage.completion_tokens == 16
        texts[model], outputs[model] = text, ids
    assert texts[BASE] != texts["lora0"]
    # The text is the tokenizer's decode of the ids (special tokens left out).
    assert tokenize_cli(QWEN3, [outputs[BASE], outputs["lora0"]], decode=True, special=False) == [texts[BASE], texts["lora0"]]
    # Token-id prompts keep working and now carry text too.
    text, _, _, _ = completion(client, False, model=BASE, prompt=prompt_ids, max_tokens=16, temperature=0.9, seed=11,
                               extra_body={"ignore_eos": True})
    assert text == texts[BASE]


def test_chat_stream_and_non_stream_for_base_and_adapter(server):
    client = server.client()
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    rendered = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n"
    prompt_tokens = len(tokenize_cli(QWEN3, [rendered], special=False)[0])
    contents = {}
    for model in [BASE, "lora1"]:
        kw = dict(model=model, messages=messages, max_tokens=12, temperature=0)  # greedy: sampling over 151k ids is slow on the cpu
        text, ids, finish, usage = completion(client, False, **kw)
        assert finish in ("length", "stop") and usage.prompt_tokens == prompt_tokens
        assert usage.completion_tokens == len(ids)
        assert (text, ids, finish) == completion(client, True, **kw)[:3], model
        contents[model] = text
    assert contents[BASE] != contents["lora1"]
    # The tokenizer's EOS (<|im_end|>) ends generation; the preset's vocabulary is the tokenizer's.
    log = open(server.log.name).read()
    assert "vocab 151669" in log and re.search(r"eos ids +151645\n", log), log
    # No MXFP4 flag given: the default (kAuto), which is off for a Qwen3 preset on the cpu.
    assert re.search(r"mxfp4 experts +off \(default for this model and device\)\n", log), log


def test_stop_strings_cut_output_and_are_not_emitted(server):
    client = server.client()
    kw = dict(model="lora0", prompt=PROMPT, max_tokens=32, temperature=0, extra_body={"ignore_eos": True})
    full, ids, _, _ = completion(client, False, **kw)
    # A stop string spanning a token boundary in the middle of the output: the boundary is where the decode of
    # a prefix of the ids ends (and is a prefix of the text).
    prefixes = tokenize_cli(QWEN3, [ids[:k] for k in range(len(ids) // 2, len(ids) - 2)], decode=True, special=False)
    cut = next(len(p) for p in prefixes if full.startswith(p) and 2 <= len(p) <= len(full) - 2 and full[len(p) - 2:len(p) + 2].strip())
    stop = full[cut - 2:cut + 2]
    expected = full[:full.find(stop)]
    for stream in (False, True):
        text, _, finish, _ = completion(client, stream, stop=["never-in-this-output", stop], **kw)
        assert text == expected and finish == "stop", (stream, stop)
        assert stop not in text
    # A single string works too, and a stop string that never occurs changes nothing.
    assert completion(client, False, stop=stop, **kw)[0] == expected
    text, _, finish, _ = completion(client, True, stop="never-in-this-output", **kw)
    assert text == full and finish == "length"
    m = server.metrics()
    assert m['loramux_requests_total{model="lora0",finish_reason="stop"}'] >= 3


def test_gpt_oss_chat_renders_harmony():
    s = Server("--model", BASE, "--tokenizer", GPT_OSS, "--chat-template", HARMONY, "--max-model-len", "512")
    try:
        messages = [{"role": "user", "content": "Hello!"}]
        day_before = time.strftime("%Y-%m-%d")
        r = s.client().chat.completions.create(model=BASE, messages=messages, max_tokens=4)
        days = {day_before, time.strftime("%Y-%m-%d")}  # a request that crosses midnight may use either date
        assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == len(r.choices[0].to_dict()["token_ids"])
        harmony = ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
                   "Knowledge cutoff: 2024-06\nCurrent date: {day}\n\nReasoning: medium\n\n# Valid channels: analysis, "
                   "commentary, final. Channel must be included for every message.<|end|>"
                   "<|start|>user<|message|>Hello!<|end|><|start|>assistant")
        counts = {len(ids) for ids in tokenize_cli(GPT_OSS, [harmony.format(day=d) for d in days], special=False)}
        assert r.usage.prompt_tokens in counts
    finally:
        s.stop()


def test_start_refuses_a_tokenizer_larger_than_the_model_vocabulary():
    model = os.path.join(ROOT, "tests", "fixtures", "gpt_oss", "model")  # vocab 256, no tokenizer
    r = subprocess.run([BIN, "serve", "--model", model, "--tokenizer", QWEN3, "--port", "0"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and "151669" in r.stderr and "256" in r.stderr, r.stderr
    r = subprocess.run([BIN, "serve", "--model", model, "--chat-template", HARMONY, "--port", "0"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and "--chat-template needs a tokenizer" in r.stderr, r.stderr
