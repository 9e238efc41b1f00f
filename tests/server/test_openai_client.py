"""`loramux serve` end to end through the official `openai` client (and raw HTTP where the client cannot
go): completions by token ids, streaming and not, base and adapters by `model`, equality with
`loramux generate`, adapter load/unload under load, every error status, disconnects, slow clients,
overload, API keys and SIGTERM draining. Run by scripts/test (LORAMUX_BIN = the built CLI)."""
import concurrent.futures as cf
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time

import openai
import pytest

from serve_helpers import BIN, ROOT, Server

MODEL = os.path.join(ROOT, "tests", "fixtures", "gpt_oss", "model")  # tiny GPT-OSS, vocab 256
FIXTURE_ADAPTERS = os.path.join(ROOT, "tests", "fixtures", "gpt_oss", "adapters")


@pytest.fixture(scope="module")
def lora_root():
    root = tempfile.mkdtemp(prefix="loramux_lora_root_")
    shutil.copytree(os.path.join(FIXTURE_ADAPTERS, "attn"), os.path.join(root, "attn"))
    shutil.copytree(os.path.join(FIXTURE_ADAPTERS, "experts"), os.path.join(root, "experts"))
    os.makedirs(os.path.join(root, "broken"))
    with open(os.path.join(root, "broken", "adapter_config.json"), "w") as f:
        f.write('{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["no_such_module"]}')
    shutil.copy(os.path.join(FIXTURE_ADAPTERS, "attn", "adapter_model.safetensors"), os.path.join(root, "broken"))
    outside = tempfile.mkdtemp(prefix="loramux_outside_")
    shutil.copytree(os.path.join(FIXTURE_ADAPTERS, "attn"), os.path.join(outside, "attn"))
    os.symlink(os.path.join(outside, "attn"), os.path.join(root, "escape"))
    yield root
    shutil.rmtree(root)
    shutil.rmtree(outside)


@pytest.fixture(scope="module")
def server(lora_root):
    s = Server("--model", MODEL, "--dummy-loras", "2", "--lora-dir", lora_root, "--max-num-seqs", "64",
               "--max-model-len", "4096", "--max-body-bytes", "65536")
    yield s
    s.stop()


def generate_cli(adapter, prompt, max_tokens, temperature, seed):
    args = [BIN, "generate", "--model", MODEL, "--dummy-loras", "2", "--prompt-ids", ",".join(map(str, prompt)),
            "--max-tokens", str(max_tokens), "--temperature", str(temperature), "--seed", str(seed), "--ignore-eos"]
    if adapter:
        args += ["--adapter", adapter]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["token_ids"]


def stream_ids(stream):
    ids, finish, usage, ids_seen = [], None, None, set()
    for chunk in stream:
        ids_seen.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            ids += c.to_dict()["token_ids"]
            finish = c.finish_reason or finish
    assert len(ids_seen) == 1
    return ids, finish, usage


def test_completions_equal_generate_for_base_and_adapters(server):
    client = server.client()
    outputs = {}
    for model in [MODEL, "lora0", "lora1"]:
        kw = dict(model=model, prompt=[1, 2, 3], max_tokens=6, temperature=0.8, seed=7, extra_body={"ignore_eos": True})
        r = client.completions.create(**kw)
        choice = r.choices[0].to_dict()
        assert choice["text"] == "" and choice["finish_reason"] == "length"
        assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 6 and r.usage.total_tokens == 9
        expected = generate_cli(None if model == MODEL else model, [1, 2, 3], 6, 0.8, 7)
        assert choice["token_ids"] == expected, model
        ids, finish, usage = stream_ids(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        assert ids == expected and finish == "length"
        assert usage.prompt_tokens == 3 and usage.completion_tokens == 6
        outputs[model] = expected
    assert len({tuple(v) for v in outputs.values()}) == 3  # adapters change the output


def test_models_lists_base_and_adapters(server):
    ids = [m.id for m in server.client().models.list().data]
    assert ids[0] == MODEL and "lora0" in ids and "lora1" in ids


def test_errors_have_openai_shape_and_status(server):
    def error(body, status, param=None, contains=""):
        r = server.post("/v1/completions", body)
        assert r.status_code == status, r.text
        e = r.json()["error"]
        assert e["param"] == param and contains in e["message"], e
    base = {"model": "lora0", "prompt": [1, 2, 3]}
    error("{not json", 400)
    error(b'{"model": "lora0", "prompt": "\xff\xfe"}', 400, None, "UTF-8")
    error({**base, "model": "nope"}, 404, "model", "nope")
    error({**base, "max_tokens": 0}, 400, "max_tokens")
    error({**base, "max_tokens": "5"}, 400, "max_tokens")
    error({**base, "temperature": -1}, 400, "temperature")
    error({**base, "top_p": 0}, 400, "top_p")
    error({**base, "stop_token_ids": [-1]}, 400, "stop_token_ids")
    error({**base, "n": 2}, 400, "n")
    error({**base, "prompt": [1, 999]}, 400, "prompt", "outside the vocabulary")
    error({**base, "prompt": []}, 400, "prompt")
    error({**base, "prompt": [1] * 4090, "max_tokens": 10}, 400, "max_tokens", "maximum context length is 4096")
    error({**base, "stream_options": {"include_usage": True}}, 400, "stream_options")
    r = server.post("/v1/completions", {**base, "prompt": "hello"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "tokenizer" in r.json()["error"]["message"]
    r = server.post("/v1/chat/completions", {"model": "lora0", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
    r = server.post("/v1/completions", b'{"prompt": [' + b"1," * 40000 + b"1]}")
    assert r.status_code == 413
    assert server.get("/v1/nothing").status_code == 404
    assert server.get("/v1/completions").status_code == 405
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="missing", prompt=[1])
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model="lora0", prompt=[1], max_tokens=0)
    assert server.get("/health").status_code == 200


def test_adapter_load_and_unload(server):
    r = server.post("/v1/load_lora_adapter", {"lora_name": "attn", "lora_path": "attn"})
    assert r.status_code == 200, r.text
    assert "attn" in [m.id for m in server.client().models.list().data]
    out = server.client().completions.create(model="attn", prompt=[5, 6], max_tokens=4, extra_body={"ignore_eos": True})
    assert len(out.choices[0].to_dict()["token_ids"]) == 4
    r = server.post("/v1/load_lora_adapter", {"lora_name": "attn", "lora_path": "attn"})
    assert r.status_code == 400 and "already loaded" in r.text
    r = server.post("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": "broken"})
    assert r.status_code == 400 and "rank mismatch" in r.json()["error"]["message"], r.text
    for path, status in [("escape", 400), ("../", 400), ("/etc", 400), ("missing", 404)]:
        r = server.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": path})
        assert r.status_code == status, (path, r.text)
    r = server.post("/v1/load_lora_adapter", {"lora_name": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert server.post("/v1/unload_lora_adapter", {"lora_name": "attn"}).status_code == 200
    assert server.post("/v1/unload_lora_adapter", {"lora_name": "attn"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="attn", prompt=[1])
    # The server still serves after all of this.
    assert len(server.client().completions.create(model="lora0", prompt=[1]).choices[0].to_dict()["token_ids"]) > 0


def test_64_concurrent_streams_while_adapters_load_and_unload(server):
    assert server.post("/v1/load_lora_adapter", {"lora_name": "dyn", "lora_path": "experts"}).status_code == 200
    models = [MODEL, "lora0", "lora1", "dyn"]
    prompts = [[(7 * i + j) % 250 + 1 for j in range(3 + i)] for i in range(8)]
    client = server.client()
    kw = dict(max_tokens=48, extra_body={"ignore_eos": True})
    jobs = [(m, p) for m in models for p in prompts]  # 32 distinct requests, each sent twice below
    with cf.ThreadPoolExecutor(32) as pool:
        reference = list(pool.map(lambda j: client.completions.create(model=j[0], prompt=j[1], **kw).choices[0].to_dict()["token_ids"], jobs))

    started = threading.Barrier(65)
    def run(i):
        m, p = jobs[i % len(jobs)]
        stream = client.completions.create(model=m, prompt=p, stream=True, stream_options={"include_usage": True}, **kw)
        it = iter(stream)
        first = next(it)
        started.wait(60)
        ids, finish, usage = stream_ids([first, *it])
        return i, ids, finish, usage
    with cf.ThreadPoolExecutor(64) as pool:
        futures = [pool.submit(run, i) for i in range(64)]
        started.wait(60)  # every stream is running: now change the adapter set under them
        assert server.post("/v1/load_lora_adapter", {"lora_name": "late", "lora_path": "attn"}).status_code == 200
        assert server.post("/v1/unload_lora_adapter", {"lora_name": "dyn"}).status_code == 200
        results = [f.result(120) for f in futures]
    for i, ids, finish, usage in results:
        assert ids == reference[i % len(jobs)], f"request {i} ({jobs[i % len(jobs)][0]}) corrupted"
        assert finish == "length" and usage.completion_tokens == 48
    assert "dyn" not in [m.id for m in client.models.list().data]
    assert len(client.completions.create(model="late", prompt=[1, 2], max_tokens=3).choices[0].to_dict()["token_ids"]) == 3
    wait_idle(server)
    m = server.metrics()
    assert 'loramux_adapter_resident{adapter="dyn"}' not in m  # unloaded once its requests finished
    assert m['loramux_requests_total{model="dyn",finish_reason="length"}'] >= 16
    assert m['loramux_time_to_first_token_seconds_count{model="lora0"}'] >= 16
    # engine-thread time: 64 streams of 48 tokens ran decode steps (and prefill, mixed, steps), each
    # iteration at least as long as the step inside it
    for kind in ("decode", "mixed"):
        assert m[f'loramux_engine_steps_total{{kind="{kind}"}}'] > 0
        step, loop = m[f'loramux_engine_step_seconds_total{{kind="{kind}"}}'], m[f'loramux_engine_loop_seconds_total{{kind="{kind}"}}']
        assert 0 < step <= loop
        # device time: the CPU backend has no device timer, so the counter is there and stays 0
        assert m[f'loramux_engine_device_seconds_total{{kind="{kind}"}}'] == 0
        # the recent window's quantiles: ordered, within the steps' range, over at most 1024 steps
        count = m[f'loramux_engine_step_seconds_count{{kind="{kind}"}}']
        assert count == min(1024, m[f'loramux_engine_steps_total{{kind="{kind}"}}'])
        q = [m[f'loramux_engine_step_seconds{{kind="{kind}",quantile="{p}"}}'] for p in ("0.5", "0.9", "0.99")]
        assert 0 < q[0] <= q[1] <= q[2] <= m[f'loramux_engine_step_seconds_sum{{kind="{kind}"}}']
        assert m[f'loramux_engine_step_device_seconds{{kind="{kind}",quantile="0.5"}}'] == 0
        # host launch time: the CPU backend runs the forward inside the launch, so it is there, positive and
        # at most the step's own time
        launch = [m[f'loramux_engine_step_launch_seconds{{kind="{kind}",quantile="{p}"}}'] for p in ("0.5", "0.99")]
        assert 0 < launch[0] <= launch[1] <= q[2]
        assert m[f'loramux_engine_step_launch_seconds_count{{kind="{kind}"}}'] == count
    # the refill wait (on by default): its holds are counted and stay within their budget, 2% of the steps'
    # time plus the 64 banked holds of 3 ms
    holds = m['loramux_engine_refill_waits_total{outcome="arrived"}'] + m['loramux_engine_refill_waits_total{outcome="timeout"}']
    held = m['loramux_engine_refill_wait_seconds_total']
    steps = sum(m[f'loramux_engine_step_seconds_total{{kind="{kind}"}}'] for kind in ("decode", "mixed"))
    assert holds >= 0 and 0 <= held <= 0.02 * steps + 64 * 0.003 + 0.05
    assert (held > 0) == (holds > 0)


def wait_idle(server, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = server.metrics()
        if m["loramux_kv_pages_used"] == 0 and m["loramux_num_requests_running"] == 0 and m["loramux_num_requests_waiting"] == 0:
            return m
        time.sleep(0.05)
    pytest.fail(f"engine not idle: {server.metrics()}")


def raw_request(server, body, read_first=True):
    s = socket.create_connection(("127.0.0.1", server.port))
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    if read_first:
        assert b"200 OK" in s.recv(4096)
    return s


def test_client_disconnect_cancels_and_frees_pages(server):
    before = server.metrics().get('loramux_requests_total{model="lora0",finish_reason="abort"}', 0)
    for stream in (True, False):
        s = raw_request(server, {"model": "lora0", "prompt": [1, 2, 3], "max_tokens": 4000, "stream": stream,
                                 "ignore_eos": True}, read_first=stream)
        time.sleep(0.05)
        s.close()
    wait_idle(server)
    assert server.metrics()['loramux_requests_total{model="lora0",finish_reason="abort"}'] >= before + 2


def test_slow_client_does_not_block_others(server):
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.connect(("127.0.0.1", server.port))
    data = json.dumps({"model": "lora1", "prompt": [1, 2], "max_tokens": 4000, "stream": True, "ignore_eos": True}).encode()
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    t0 = time.time()
    for _ in range(3):  # never reads: others still complete promptly
        r = server.client().completions.create(model="lora0", prompt=[3, 4], max_tokens=4)
        assert len(r.choices[0].to_dict()["token_ids"]) > 0
    assert time.time() - t0 < 10
    slow.close()
    wait_idle(server)


def test_overload_api_key_and_sigterm_drain():
    s = Server("--model", MODEL, "--api-key", "secret", "--max-num-seqs", "1", "--max-pending-requests", "1",
               "--max-model-len", "512")
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").models.list()
        assert s.get("/health").status_code == 200  # not under /v1: no key needed
        good = s.client("secret")
        kw = dict(model=MODEL, prompt=[1, 2], max_tokens=400, extra_body={"ignore_eos": True})
        long_stream = iter(good.completions.create(stream=True, **kw))
        first = next(long_stream)
        with pytest.raises(openai.RateLimitError):
            good.completions.create(model=MODEL, prompt=[1], max_tokens=2)
        s.proc.send_signal(signal.SIGTERM)  # drain: the running stream completes, then exit 0
        ids, finish, _ = stream_ids([first, *long_stream])
        assert len(ids) == 400 and finish == "length"
        assert s.proc.wait(30) == 0
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", s.port), timeout=2)
    finally:
        s.stop()
