"""Logprobs, per-adapter queue metrics and start-up readiness of `loramux serve`, through the official
openai client: completions' legacy `logprobs: N` and chat's `logprobs: true, top_logprobs: N`, streamed and
not — present, consistent (the greedy token is the top-1 alternative with the same logprob; alternatives
descend and their probabilities sum to at most 1; streamed chunks carry the same values) and without effect
on the sampled tokens; invalid widths are 400 naming the field. The server answers 503 "model is loading"
until the model is loaded (a test-only start-up delay shows it), then 200; SIGTERM while loading exits at once."""
import math
import os
import signal
import time

import openai
import pytest

from serve_helpers import ROOT, Server

MODEL = os.path.join(ROOT, "tests", "fixtures", "gpt_oss", "model")  # tiny GPT-OSS, vocab 256, no tokenizer
TOKENIZERS = next((d for d in [os.path.join(ROOT, "..", "shared", "data", "tokenizers"), "/work/shared/data/tokenizers"]
                   if os.path.isdir(d)), "")
QWEN3 = os.path.join(TOKENIZERS, "qwen3")
BASE = "preset:tiny-moe"


@pytest.fixture(scope="module")
def server():
    s = Server("--model", MODEL, "--dummy-loras", "2", "--max-model-len", "512")
    yield s
    s.stop()


def completion_logprobs(client, stream, **kw):
    """(token_ids, logprobs dict of lists) of one completion, the streamed chunks' logprobs concatenated."""
    if not stream:
        c = client.completions.create(**kw).choices[0]
        return c.to_dict()["token_ids"], c.logprobs.to_dict()
    ids, merged = [], {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            tokens = c.to_dict()["token_ids"]
            ids += tokens
            if tokens:
                assert c.logprobs is not None, "a streamed chunk with tokens carries no logprobs"
            if c.logprobs is not None:
                for key in merged:
                    merged[key] += c.logprobs.to_dict()[key]
    return ids, merged


def check_completion_logprobs(ids, lp, n, greedy):
    assert lp["tokens"] == [f"token_id:{t}" for t in ids]  # no tokenizer: vLLM's token_id:ID texts
    assert len(lp["token_logprobs"]) == len(ids) == len(lp["top_logprobs"]) == len(lp["text_offset"])
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert value <= 0 and top[token] == value  # the sampled token is always listed
        assert n <= len(top) <= n + 1
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-4
        best = max(top.items(), key=lambda kv: kv[1])
        if greedy:
            assert best[1] == value, (token, top)
        else:
            assert best[1] >= value


@pytest.mark.parametrize("model", [MODEL, "lora0"])
def test_completion_logprobs_stream_and_not(server, model):
    client = server.client()
    kw = dict(model=model, prompt=[1, 2, 3], max_tokens=8, extra_body={"ignore_eos": True})
    plain = client.completions.create(temperature=0, **kw).choices[0]
    assert plain.logprobs is None
    ids, lp = completion_logprobs(client, False, temperature=0, logprobs=5, **kw)
    assert ids == plain.to_dict()["token_ids"]  # logprobs never change the output
    check_completion_logprobs(ids, lp, 5, greedy=True)
    stream_ids, stream_lp = completion_logprobs(client, True, temperature=0, logprobs=5, **kw)
    assert stream_ids == ids and stream_lp == lp
    # Sampled (seeded): the same tokens with and without logprobs; raw logprobs do not depend on temperature
    # for the same tokens, so top lists of the greedy run's first step equal the sampled run's first step.
    sampled = client.completions.create(temperature=0.9, seed=11, **kw).choices[0].to_dict()["token_ids"]
    ids2, lp2 = completion_logprobs(client, True, temperature=0.9, seed=11, logprobs=3, **kw)
    assert ids2 == sampled
    check_completion_logprobs(ids2, lp2, 3, greedy=False)
    first_top = sorted(lp["top_logprobs"][0].items(), key=lambda kv: -kv[1])[:3]
    assert sorted(lp2["top_logprobs"][0].items(), key=lambda kv: -kv[1])[:3] == first_top
    # logprobs: 0 gives the sampled token's logprob only.
    ids0, lp0 = completion_logprobs(client, False, temperature=0, logprobs=0, **kw)
    assert ids0 == ids and lp0["token_logprobs"] == lp["token_logprobs"]
    assert all(len(top) == 1 for top in lp0["top_logprobs"])


def test_invalid_logprobs_are_400_naming_the_field(server):
    for body, param in [({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"logprobs": "5"}, "logprobs"),
                        ({"logprobs": True}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs")]:
        r = server.post("/v1/completions", {"model": MODEL, "prompt": [1, 2], **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model=MODEL, prompt=[1], logprobs=30)


def test_per_adapter_queue_figures_and_histograms(server):
    client = server.client()
    for model in [MODEL, "lora0", "lora1"]:
        client.completions.create(model=model, prompt=[4, 5, 6], max_tokens=5, extra_body={"ignore_eos": True})
    m = server.metrics()  # a finished request is in the figures before its response is sent: no polling
    for model in [MODEL, "lora0", "lora1"]:
        assert m[f'loramux_model_requests_running{{model="{model}"}}'] == 0
        assert m[f'loramux_model_requests_waiting{{model="{model}"}}'] == 0
        assert m[f'loramux_request_queue_time_seconds_count{{model="{model}"}}'] >= 1
        assert m[f'loramux_request_output_tokens_per_second_count{{model="{model}"}}'] >= 1
        assert m[f'loramux_time_to_first_token_seconds_count{{model="{model}"}}'] >= 1
    # While a long request runs, its adapter counts one running request.
    stream = iter(client.completions.create(model="lora1", prompt=[1], max_tokens=400, stream=True,
                                            extra_body={"ignore_eos": True}))
    next(stream)
    assert server.metrics()['loramux_model_requests_running{model="lora1"}'] == 1
    stream.close()


def test_not_ready_answers_503_then_200():
    s = Server("--model", MODEL, wait_ready=False, env={"LORAMUX_TEST_STARTUP_DELAY_MS": "2000"})
    try:
        r = s.get("/health")
        assert r.status_code == 503, r.text
        e = r.json()["error"]
        assert "loading" in e["message"] and e["code"] == 503
        r = s.post("/v1/completions", {"model": MODEL, "prompt": [1, 2]})
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        assert s.get("/v1/models").status_code == 503
        assert s.get("/metrics").status_code == 200
        with pytest.raises(openai.InternalServerError):
            s.client().completions.create(model=MODEL, prompt=[1])
        deadline = time.time() + 60
        while s.get("/health").status_code != 200:
            assert time.time() < deadline and s.proc.poll() is None
            time.sleep(0.05)
        r = s.client().completions.create(model=MODEL, prompt=[1, 2], max_tokens=3, extra_body={"ignore_eos": True})
        assert len(r.choices[0].to_dict()["token_ids"]) == 3
    finally:
        s.stop()


def test_sigterm_while_loading_exits_at_once():
    s = Server("--model", MODEL, wait_ready=False, env={"LORAMUX_TEST_STARTUP_DELAY_MS": "30000"})
    try:
        assert s.get("/health").status_code == 503
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(10) == 0
    finally:
        s.stop()


@pytest.mark.skipif(not TOKENIZERS or os.environ.get("LORAMUX_NO_SHARED_DATA") is not None,
                    reason="no ../shared/data/tokenizers (the published tokenizer files)")
def test_chat_and_text_logprobs_with_a_tokenizer():
    s = Server("--model", BASE, "--tokenizer", QWEN3, "--dummy-loras", "1", "--max-model-len", "512")
    try:
        client = s.client()
        messages = [{"role": "user", "content": "Name a colour."}]
        for model in [BASE, "lora0"]:
            kw = dict(model=model, messages=messages, max_tokens=6, temperature=0)
            plain = client.chat.completions.create(**kw).choices[0]
            r = client.chat.completions.create(logprobs=True, top_logprobs=4, **kw).choices[0]
            assert r.to_dict()["token_ids"] == plain.to_dict()["token_ids"]
            content = r.logprobs.content
            assert len(content) == len(r.to_dict()["token_ids"])
            for entry in content:
                assert len(entry.top_logprobs) == 4
                assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
                assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
                assert sum(math.exp(t.logprob) for t in entry.top_logprobs) <= 1 + 1e-4
                assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
            # Streamed: every chunk with tokens carries their entries; together they equal the whole list.
            streamed = []
            for chunk in client.chat.completions.create(stream=True, logprobs=True, top_logprobs=4, **kw):
                for c in chunk.choices:
                    if c.to_dict().get("token_ids"):
                        assert c.logprobs is not None and len(c.logprobs.content) == len(c.to_dict()["token_ids"])
                        streamed += c.logprobs.content
            assert [e.to_dict() for e in streamed] == [e.to_dict() for e in content]
            # logprobs: true alone lists no alternatives.
            r = client.chat.completions.create(logprobs=True, **kw).choices[0]
            assert all(e.top_logprobs == [] for e in r.logprobs.content)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=BASE, messages=messages, top_logprobs=3)
        r = s.post("/v1/chat/completions", {"model": BASE, "messages": messages, "top_logprobs": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
        r = s.post("/v1/chat/completions", {"model": BASE, "messages": messages, "logprobs": True, "top_logprobs": 21})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
        # Text completions: tokens are the token texts; text_offset counts characters of the completion text.
        c = client.completions.create(model=BASE, prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True}).choices[0]
        lp = c.logprobs
        assert len(lp.tokens) == 8 and lp.text_offset[0] == 0
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(c.text)
    finally:
        s.stop()
